// dynamic_grouped_conv: DFlash2's two-tap, group-16 convolution
// (contract: crates/dflash-ops/src/dynamic_grouped_conv/mod.rs).
// prepare = split (inv_rms, exact hi/lo split of the normalized-input products) + a GEMM for
// the dynamic increments (the launcher, through the gemm helper) + apply; finish = one
// elementwise kernel.
// Layouts: x, prepared, z, residual, out [rows, cols, H]; base [2 sides, 2 taps, H];
// w_delta [4G, H] (k = s*2G + t*G + g); finish_delta [rows, cols, 2 taps, G]; G = H / 16.
// All arithmetic in f32; every stored value rounded once (RNE).

#define DGC_GROUP 16

__device__ __forceinline__ float dgc_warp_sum(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;  // butterfly: every lane holds the identical total
}

// Every 8-channel access below (df_load8 / df_store8, common.cuh) is 16-byte aligned: H is a
// multiple of 16 and device buffers start 16-byte aligned.

// prepare, step 1 of 3. grid (columns), blockDim.x a multiple of 32 (at most 1024), 8
// channels a thread per step. Per column: inv_rms = 1 / sqrt(mean(x^2) + eps) into inv[col],
// and the normalized-input products p = norm_w[c] * x[c] (exact in f32: two 8-bit
// significands) split into two BF16 rows of `split`, hi = bf16(p) at row 2 col and lo = p - hi
// at row 2 col + 1 (exactly representable: the remaining <= 8 significant bits), so that the
// BF16 GEMM of step 2 sees p without rounding.
extern "C" __global__ void __launch_bounds__(1024) dynamic_grouped_conv_split_kernel(
    const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ norm_w,
    __nv_bfloat16* __restrict__ split, float* __restrict__ inv, int hidden, float eps) {
    df_pdl_launch_dependents();  // a dependent GEMM may start streaming its weight
    df_pdl_wait();
    __shared__ float part[32];
    const u64 col = blockIdx.x;
    const u64 H = (u64)hidden;
    const __nv_bfloat16* xc = x + col * H;
    float s = 0.0f;
    for (int c = threadIdx.x * 8; c < hidden; c += blockDim.x * 8) {
        float xv[8], wv[8], hi[8], lo[8];
        df_load8(xc + c, xv);
        df_load8(norm_w + c, wv);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            s = fmaf(xv[j], xv[j], s);
            const float p = wv[j] * xv[j];
            hi[j] = bf2f(f2bf(p));  // stored exactly
            lo[j] = p - hi[j];      // exactly representable in BF16: stored exactly
        }
        df_store8(split + 2 * col * H + c, hi);
        df_store8(split + (2 * col + 1) * H + c, lo);
    }
    s = dgc_warp_sum(s);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        float t = 0.0f;
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) t += part[w];
        inv[col] = 1.0f / sqrtf(t / (float)hidden + eps);
    }
}

// prepare, step 3 of 3 (step 2 is the GEMM raw[2 col + e, k] = sum_c split[2 col + e, c]
// * w_delta[k, c], f32). grid (columns, ceil(H / 2048)), 256 threads, 8 channels per thread
// (half a group), each input read as one 16-byte word. delta[k] = inv[col] * (raw[2 col, k] + raw[2 col + 1, k]) with k = s * 2G +
// t * G + g; writes prepared[col, c] and, for the first channel of each group, the BF16
// output-side delta finish_delta[col, t * G + g].
extern "C" __global__ void __launch_bounds__(256) dynamic_grouped_conv_apply_kernel(
    const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ norm_w,
    const __nv_bfloat16* __restrict__ base, const float* __restrict__ raw,
    const float* __restrict__ inv, __nv_bfloat16* __restrict__ prepared,
    __nv_bfloat16* __restrict__ finish_delta, int cols, int hidden) {
    df_pdl_launch_dependents();  // a dependent GEMM may start streaming its weight
    df_pdl_wait();
    const u64 col = blockIdx.x;
    const int i = (int)(col % (u64)cols);
    const u64 H = (u64)hidden;
    const int G = hidden / DGC_GROUP;
    const int c0 = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
    if (c0 >= hidden) return;
    const int g = c0 / DGC_GROUP;
    const float inv0 = inv[col];
    const float inv1 = i >= 1 ? inv[col - 1] : 0.0f;
    const float* rh = raw + 2 * col * (u64)(4 * G);
    const float* rl = rh + 4 * G;
    auto delta = [&](int s, int t) {
        const int k = s * 2 * G + t * G + g;
        return inv0 * (rh[k] + rl[k]);
    };
    const float d00 = delta(0, 0), d01 = delta(0, 1);
    const __nv_bfloat16* xc = x + col * H;
    float w[8], xv[8], b0[8], o[8];
    df_load8(norm_w + c0, w);
    df_load8(xc + c0, xv);
    df_load8(base + c0, b0);
    if (i >= 1) {
        float xp[8], b1[8];
        df_load8(xc - H + c0, xp);
        df_load8(base + H + c0, b1);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float n0 = w[j] * xv[j] * inv0, n1 = w[j] * xp[j] * inv1;
            o[j] = fmaf(b1[j] + d01, n1, (b0[j] + d00) * n0);
        }
    } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) o[j] = (b0[j] + d00) * (w[j] * xv[j] * inv0);
    }
    df_store8(prepared + col * H + c0, o);
    if (c0 % DGC_GROUP == 0) {
        finish_delta[col * (u64)(2 * G) + g] = f2bf(delta(1, 0));
        finish_delta[col * (u64)(2 * G) + G + g] = f2bf(delta(1, 1));
    }
}

// grid (columns, ceil(H / (8 * blockDim.x))), 8 channels (half a group) a thread:
// out = bf16(residual + (base[1,0,c] + fd[i,0,g]) * z[i,c] + 1{i>=1} (base[1,1,c] + fd[i,1,g])
// * z[i-1,c]); the convolved value is not rounded.
extern "C" __global__ void dynamic_grouped_conv_finish_kernel(
    const __nv_bfloat16* __restrict__ z, const __nv_bfloat16* __restrict__ finish_delta,
    const __nv_bfloat16* __restrict__ base, const __nv_bfloat16* __restrict__ residual,
    __nv_bfloat16* __restrict__ out, int cols, int hidden) {
    df_pdl_launch_dependents();  // a dependent GEMM may start streaming its weight
    df_pdl_wait();
    const u64 col = blockIdx.x;
    const int i = (int)(col % (u64)cols);
    const int c0 = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
    if (c0 >= hidden) return;
    const u64 H = (u64)hidden;
    const int G = hidden / DGC_GROUP;
    const int g = c0 / DGC_GROUP;
    const __nv_bfloat16* fd = finish_delta + col * (u64)(2 * G);
    const float f0 = bf2f(fd[g]);
    const u64 e = col * H + c0;
    float zv[8], rv[8], b0[8], o[8];
    df_load8(z + e, zv);
    df_load8(residual + e, rv);
    df_load8(base + 2 * H + c0, b0);
    if (i >= 1) {
        const float f1 = bf2f(fd[G + g]);
        float zp[8], b1[8];
        df_load8(z + e - H, zp);
        df_load8(base + 3 * H + c0, b1);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            float v = (b0[j] + f0) * zv[j];
            v = fmaf(b1[j] + f1, zp[j], v);
            o[j] = rv[j] + v;
        }
    } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) o[j] = rv[j] + (b0[j] + f0) * zv[j];
    }
    df_store8(out + e, o);
}
