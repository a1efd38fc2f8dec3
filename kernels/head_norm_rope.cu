// head_norm_rope: per-head plain RMSNorm + split-half RoPE
// (contract: crates/dflash-ops/src/head_norm_rope/mod.rs).
// Also prepended to kernels/context_kv_materialize.cu (with HNR_DEVICE_ONLY defined: the
// device code only), which stores K through head_norm_rope_warp (one definition of the
// device math).
//
// Entries: head_norm_rope_kernel (one tensor of heads, angles from the positions),
// head_norm_rope_table (a block's reduced angles, once for every layer) and
// head_norm_rope_qkv (the fused Q/K/V projection's output: Q and K heads normalized and
// rotated with the table's angles, V heads rounded to BF16).

__device__ __forceinline__ float head_norm_rope_warp_sum(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The reduced RoPE angle of pair j of a head of dimension d at position pos, narrowed to f32:
// a = pos * theta^(-2j/d) in f64, reduced to [0, 2*pi] in f64 (the contract's reduction).
__device__ __forceinline__ float head_norm_rope_angle(long long pos, int j, int d, double theta) {
    const double two_pi = 6.283185307179586476925286766559;
    double inv_freq = pow(theta, -(double)(2 * j) / (double)d);
    double ang = (double)pos * inv_freq;
    double red = ang - two_pi * floor(ang / two_pi);
    return (float)red;
}

// One head of d (even) elements, processed by one full warp (all 32 lanes must call it):
//   n = w * x / sqrt(mean(x^2) + eps)                       (FP32)
//   for j < d/2, with a = angle(j) (a reduced angle, f32):
//   out[j] = n[j] cos a - n[j+d/2] sin a;  out[j+d/2] = n[j+d/2] cos a + n[j] sin a  (BF16 RNE once)
// x may be any FP32 row (raw projection output); out is BF16.
template <class Angle>
__device__ __forceinline__ void head_norm_rope_warp_at(const float* __restrict__ x,
                                                       const __nv_bfloat16* __restrict__ w,
                                                       __nv_bfloat16* __restrict__ out, int d,
                                                       float eps, Angle angle) {
    const int lane = threadIdx.x & 31;
    const int hd = d >> 1;  // pairs (j, j + hd)
    float ss = 0.0f;
    // Unrolled so that a lane's loads of a head (4 for D = 128) are in flight together; the
    // sum keeps its order.
#pragma unroll 4
    for (int j = lane; j < d; j += 32) {
        float v = x[j];
        ss += v * v;
    }
    ss = head_norm_rope_warp_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)d + eps);
#pragma unroll 2
    for (int j = lane; j < hd; j += 32) {
        float a = bf2f(w[j]) * (x[j] * inv);
        float b = bf2f(w[j + hd]) * (x[j + hd] * inv);
        float s, c;
        sincosf(angle(j), &s, &c);
        out[j] = f2bf(a * c - b * s);
        out[j + hd] = f2bf(b * c + a * s);
    }
}

// Angles from a position (computed per element).
struct HnrPosAngle {
    long long pos;
    int d;
    double theta;
    __device__ __forceinline__ float operator()(int j) const { return head_norm_rope_angle(pos, j, d, theta); }
};

// Angles read from a row of the table (d/2 reduced angles).
struct HnrTableAngle {
    const float* a;
    __device__ __forceinline__ float operator()(int j) const { return a[j]; }
};

// One head at position pos (the form context_kv_materialize uses).
__device__ __forceinline__ void head_norm_rope_warp(const float* __restrict__ x,
                                                    const __nv_bfloat16* __restrict__ w,
                                                    __nv_bfloat16* __restrict__ out, long long pos,
                                                    int d, double theta, float eps) {
    head_norm_rope_warp_at(x, w, out, d, eps, HnrPosAngle{pos, d, theta});
}

// The entry points: left out where the file is prepended for its device code alone
// (context_kv_materialize defines HNR_DEVICE_ONLY), so no module compiles them twice.
#ifndef HNR_DEVICE_ONLY

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

// angles: [rows, cols, d/2] f32, angles[(r * cols + c) * d/2 + j] = the reduced angle of pair
// j at position start_pos[r] + c (a negative start_pos, refused on the CPU, clamps to 0).
// One thread per element.
extern "C" __global__ void head_norm_rope_table(const int* __restrict__ start_pos,
                                                float* __restrict__ angles, int rows, int cols,
                                                int d, double theta) {
    const int hd = d >> 1;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * cols * hd) return;
    const int j = (int)(i % hd);
    const long long rc = i / hd;
    const int c = (int)(rc % cols);
    const int r = (int)(rc / cols);
    const int sp = start_pos[r];
    angles[i] = head_norm_rope_angle((long long)(sp < 0 ? 0 : sp) + c, j, d, theta);
}

// qkv: [tokens, q_heads + 2 * kv_heads, d] F32 (one GEMM against [q_proj; k_proj; v_proj]);
// angles: [tokens, d/2] (head_norm_rope_table). One warp per (token, head) item:
// heads 0..q_heads -> q [tokens, q_heads, d] (q_norm, rotated), the next kv_heads -> k
// [tokens, kv_heads, d] (k_norm, rotated), the last kv_heads -> v [tokens, kv_heads, d]
// (each value rounded once to BF16).
extern "C" __global__ void head_norm_rope_qkv(const float* __restrict__ qkv,
                                              const __nv_bfloat16* __restrict__ q_norm,
                                              const __nv_bfloat16* __restrict__ k_norm,
                                              const float* __restrict__ angles,
                                              __nv_bfloat16* __restrict__ q, __nv_bfloat16* __restrict__ k,
                                              __nv_bfloat16* __restrict__ v, int tokens, int q_heads,
                                              int kv_heads, int d, float eps) {
    df_pdl_launch_dependents();  // the attention split may launch (it waits before it reads)
    df_pdl_wait();
    const int heads = q_heads + 2 * kv_heads;
    const long long item = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (item >= (long long)tokens * heads) return;  // whole warps exit together
    const long long t = item / heads;
    const int h = (int)(item % heads);
    const float* x = qkv + item * (long long)d;
    const HnrTableAngle ang{angles + t * (long long)(d >> 1)};
    if (h < q_heads) {
        head_norm_rope_warp_at(x, q_norm, q + (t * q_heads + h) * (long long)d, d, eps, ang);
    } else if (h < q_heads + kv_heads) {
        head_norm_rope_warp_at(x, k_norm, k + (t * kv_heads + (h - q_heads)) * (long long)d, d, eps, ang);
    } else {
        __nv_bfloat16* o = v + (t * kv_heads + (h - q_heads - kv_heads)) * (long long)d;
#pragma unroll 4
        for (int j = threadIdx.x & 31; j < d; j += 32) o[j] = f2bf(x[j]);
    }
}

#endif  // HNR_DEVICE_ONLY
