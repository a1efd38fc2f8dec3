// residual_add: out = bf16_rne(x + y) (contract: crates/dflash-ops/src/residual_add/mod.rs).
// The f32 sum of two bf16 values rounded to bf16 equals the correctly rounded sum.

extern "C" __global__ void residual_add_kernel(const __nv_bfloat16* x, const __nv_bfloat16* y,
                                               __nv_bfloat16* out, u64 n) {
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = f2bf(bf2f(x[i]) + bf2f(y[i]));
    }
}

extern "C" __global__ void residual_add_inplace_kernel(__nv_bfloat16* x, const __nv_bfloat16* y, u64 n) {
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        x[i] = f2bf(bf2f(x[i]) + bf2f(y[i]));
    }
}
