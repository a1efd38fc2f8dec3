// swiglu: out = bf16_rne(silu(gate) * up) (contract: crates/dflash-ops/src/swiglu/mod.rs).
// Separate layout: stride = inter, up_off = 0 (gate and up distinct buffers).
// Fused layout: gate == up == gate_up, stride = 2 * inter, up_off = inter.
// grid (rows, ceil(inter / (8 * blockDim.x))): a thread takes 8 consecutive channels of one
// row (no per-element index division); with `vec` set (inter, stride and up_off multiples of
// 8, buffers 16-byte aligned) as one 16-byte load of each input and one store.

extern "C" __global__ void swiglu_kernel(const __nv_bfloat16* __restrict__ gate,
                                         const __nv_bfloat16* __restrict__ up,
                                         __nv_bfloat16* __restrict__ out, int inter, u64 stride,
                                         u64 up_off, int vec) {
    df_pdl_launch_dependents();  // a dependent GEMM may start streaming its weight
    df_pdl_wait();
    const u64 r = blockIdx.x;
    const int c0 = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
    if (c0 >= inter) return;
    const __nv_bfloat16* g = gate + r * stride + c0;
    const __nv_bfloat16* u = up + up_off + r * stride + c0;
    __nv_bfloat16* o = out + r * (u64)inter + c0;
    if (vec) {
        float gv[8], uv[8], ov[8];
        df_load8(g, gv);
        df_load8(u, uv);
#pragma unroll
        for (int j = 0; j < 8; ++j) ov[j] = df_silu(gv[j]) * uv[j];
        df_store8(o, ov);
    } else {
        const int n = min(8, inter - c0);
        for (int j = 0; j < n; ++j) o[j] = f2bf(df_silu(bf2f(g[j])) * bf2f(u[j]));
    }
}
