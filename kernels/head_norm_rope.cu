// head_norm_rope: per-head plain RMSNorm + split-half RoPE
// (contract: crates/dflash-ops/src/head_norm_rope/mod.rs).
// Also prepended to kernels/context_kv_materialize.cu, which stores K through
// head_norm_rope_warp (one definition of the device math).

__device__ __forceinline__ float head_norm_rope_warp_sum(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// One head of d (even) elements, processed by one full warp (all 32 lanes must call it):
//   n = w * x / sqrt(mean(x^2) + eps)                       (FP32)
//   for j < d/2: a = pos * theta^(-2j/d) in f64, reduced mod 2*pi in f64, sin/cos in f32
//   out[j] = n[j] cos - n[j+d/2] sin;  out[j+d/2] = n[j+d/2] cos + n[j] sin   (BF16 RNE once)
// x may be any FP32 row (raw projection output); out is BF16.
__device__ __forceinline__ void head_norm_rope_warp(const float* __restrict__ x,
                                                    const __nv_bfloat16* __restrict__ w,
                                                    __nv_bfloat16* __restrict__ out, long long pos,
                                                    int d, double theta, float eps) {
    const int lane = threadIdx.x & 31;
    const int hd = d >> 1;  // pairs (j, j + hd)
    float ss = 0.0f;
    for (int j = lane; j < d; j += 32) {
        float v = x[j];
        ss += v * v;
    }
    ss = head_norm_rope_warp_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)d + eps);
    const double two_pi = 6.283185307179586476925286766559;
    for (int j = lane; j < hd; j += 32) {
        float a = bf2f(w[j]) * (x[j] * inv);
        float b = bf2f(w[j + hd]) * (x[j + hd] * inv);
        double inv_freq = pow(theta, -(double)(2 * j) / (double)d);
        double ang = (double)pos * inv_freq;
        double red = ang - two_pi * floor(ang / two_pi);
        float s, c;
        sincosf((float)red, &s, &c);
        out[j] = f2bf(a * c - b * s);
        out[j + hd] = f2bf(b * c + a * s);
    }
}

// x, out: [rows, cols, heads, d]; one warp per (row, col, head) item, blockDim.x a multiple
// of 32. A negative start_pos (refused on the CPU) is clamped to 0.
extern "C" __global__ void head_norm_rope_kernel(const float* __restrict__ x,
                                                 const __nv_bfloat16* __restrict__ w,
                                                 const int* __restrict__ start_pos,
                                                 __nv_bfloat16* __restrict__ out, int rows, int cols,
                                                 int heads, int d, double theta, float eps) {
    const long long item = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const long long total = (long long)rows * cols * heads;
    if (item >= total) return;  // whole warps exit together
    const long long rc = item / heads;
    const int c = (int)(rc % cols);
    const int r = (int)(rc / cols);
    const int sp = start_pos[r];
    const long long pos = (long long)(sp < 0 ? 0 : sp) + c;
    const long long base = item * (long long)d;
    head_norm_rope_warp(x + base, w, out + base, pos, d, theta, eps);
}
