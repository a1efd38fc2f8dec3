// rms_norm: plain RMSNorm y = w * x / sqrt(mean(x^2) + eps), BF16 out
// (contract: crates/dflash-ops/src/rms_norm/mod.rs). One block per row; blockDim.x a multiple
// of 32, at most 1024. Also launched by feature_projection on its F32 projection scratch.
// rms_norm_residual_bf16 first adds a delta into the BF16 residual stream in place (the
// layer's residual add fused with the norm that follows it).
//
// Access. With `vec` set (the launcher's check: h a multiple of 8, every row 16-byte aligned)
// a thread takes 8 consecutive elements a step (one 16-byte BF16 load, or two for F32), so a
// row of up to 8 * blockDim.x elements is one step per thread (the launcher sizes the block
// that way): the loads of a row are all in flight at once instead of one dependent load per
// element and thread. The thread's first step stays in registers for the second pass.
// Without `vec`, one element a step. The block sum is the same in both (FP32 per thread, warp
// butterflies, warps in order); each form's result is a function of the row alone.

__device__ __forceinline__ float rms_norm_warp_sum(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float rms_norm_load(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float rms_norm_load(const __nv_bfloat16* p, long long i) {
    return bf2f(p[i]);
}

// 8 consecutive elements at p (16-byte aligned) widened to f32: BF16 through df_load8
// (common.cuh), F32 as two 16-byte loads.
__device__ __forceinline__ void rms_norm_load8(const __nv_bfloat16* p, float (&v)[8]) { df_load8(p, v); }
__device__ __forceinline__ void rms_norm_load8(const float* p, float (&v)[8]) {
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

// The residual step of 8 (or 1) BF16 elements: x <- bf16(x + delta), v the rounded sums.
// F32 rows have no residual form (a no-op overload keeps one row template).
__device__ __forceinline__ void rms_norm_add8(__nv_bfloat16* x, const __nv_bfloat16* d, float (&v)[8]) {
    float dv[8];
    rms_norm_load8(d, dv);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = bf2f(f2bf(v[j] + dv[j]));
    df_store8(x, v);
}
__device__ __forceinline__ void rms_norm_add8(float*, const __nv_bfloat16*, float (&)[8]) {}
__device__ __forceinline__ float rms_norm_add1(__nv_bfloat16* x, const __nv_bfloat16* d, float v) {
    const __nv_bfloat16 s = f2bf(v + bf2f(*d));
    *x = s;
    return bf2f(s);
}
__device__ __forceinline__ float rms_norm_add1(float*, const __nv_bfloat16*, float v) { return v; }

// Sum of v over the block; every thread receives the total. `partial` holds >= 32 floats.
__device__ __forceinline__ float rms_norm_block_sum(float v, float* partial) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    v = rms_norm_warp_sum(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float t = lane < warps ? partial[lane] : 0.0f;
        t = rms_norm_warp_sum(t);
        if (lane == 0) partial[0] = t;
    }
    __syncthreads();
    return partial[0];
}

// One row: x row at x + base, y row at y + out (element offsets); with `delta` (BF16 x only,
// at delta + base), x <- bf16(x + delta) first; then y = norm(x).
template <typename T>
__device__ __forceinline__ void rms_norm_row(T* __restrict__ x, const __nv_bfloat16* __restrict__ delta,
                                             const __nv_bfloat16* __restrict__ w,
                                             __nv_bfloat16* __restrict__ y, long long base, long long out,
                                             int h, float eps, int vec, float* partial) {
    float ss = 0.0f;
    if (vec) {
        const int step = 8 * blockDim.x;
        const int c0 = 8 * threadIdx.x;
        float first[8];  // this thread's first step, kept for the second pass
        for (int c = c0; c < h; c += step) {
            float v[8];
            rms_norm_load8(x + base + c, v);
            if (delta) rms_norm_add8(x + base + c, delta + base + c, v);
#pragma unroll
            for (int j = 0; j < 8; ++j) ss += v[j] * v[j];
            if (c == c0) {
#pragma unroll
                for (int j = 0; j < 8; ++j) first[j] = v[j];
            }
        }
        ss = rms_norm_block_sum(ss, partial);
        const float inv = 1.0f / sqrtf(ss / (float)h + eps);
        for (int c = c0; c < h; c += step) {
            float v[8], wv[8];
            if (c == c0) {
#pragma unroll
                for (int j = 0; j < 8; ++j) v[j] = first[j];
            } else {
                rms_norm_load8(x + base + c, v);  // this thread's own earlier store, if any
            }
            rms_norm_load8(w + c, wv);
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = wv[j] * (v[j] * inv);
            df_store8(y + out + c, v);
        }
        return;
    }
    for (int j = threadIdx.x; j < h; j += blockDim.x) {
        float v = rms_norm_load(x, base + j);
        if (delta) v = rms_norm_add1(x + base + j, delta + base + j, v);
        ss += v * v;
    }
    ss = rms_norm_block_sum(ss, partial);
    const float inv = 1.0f / sqrtf(ss / (float)h + eps);
    for (int j = threadIdx.x; j < h; j += blockDim.x) {
        y[out + j] = f2bf(bf2f(w[j]) * (rms_norm_load(x, base + j) * inv));
    }
}

// y: [rows, h] BF16 (grid.x = rows); output row i normalizes x row (i / group) * stride +
// offset + i % group (the plain form: group = stride = 1, offset = 0).
extern "C" __global__ void __launch_bounds__(1024) rms_norm_bf16(const __nv_bfloat16* __restrict__ x,
                                                                 const __nv_bfloat16* __restrict__ w,
                                                                 __nv_bfloat16* __restrict__ y, int h,
                                                                 float eps, int vec, int group, int stride,
                                                                 int offset) {
    df_pdl_launch_dependents();  // a dependent GEMM may start streaming its weight
    df_pdl_wait();
    __shared__ float partial[32];
    const long long i = blockIdx.x;
    const long long src = (i / group) * stride + offset + i % group;
    rms_norm_row(const_cast<__nv_bfloat16*>(x), (const __nv_bfloat16*)nullptr, w, y, src * h, i * h, h, eps,
                 vec, partial);
}

// x F32, otherwise as rms_norm_bf16.
extern "C" __global__ void __launch_bounds__(1024) rms_norm_f32(const float* __restrict__ x,
                                                                const __nv_bfloat16* __restrict__ w,
                                                                __nv_bfloat16* __restrict__ y, int h,
                                                                float eps, int vec, int group, int stride,
                                                                int offset) {
    df_pdl_launch_dependents();  // a dependent GEMM may start streaming its weight
    df_pdl_wait();
    __shared__ float partial[32];
    const long long i = blockIdx.x;
    const long long src = (i / group) * stride + offset + i % group;
    rms_norm_row(const_cast<float*>(x), (const __nv_bfloat16*)nullptr, w, y, src * h, i * h, h, eps, vec,
                 partial);
}

// x: [rows, h] BF16 residual stream, updated in place to x + delta (each element's f32 sum
// rounded once to BF16, as residual_add: innocuous double rounding), then y = norm of the
// updated row (grid.x = rows). The same element order and block sum as rms_norm_bf16, so the
// result is bit-identical to residual_add followed by rms_norm_bf16 at the same launch shape.
extern "C" __global__ void __launch_bounds__(1024) rms_norm_residual_bf16(__nv_bfloat16* __restrict__ x,
                                                                          const __nv_bfloat16* __restrict__ delta,
                                                                          const __nv_bfloat16* __restrict__ w,
                                                                          __nv_bfloat16* __restrict__ y, int h,
                                                                          float eps, int vec) {
    df_pdl_launch_dependents();  // a dependent GEMM may start streaming its weight
    df_pdl_wait();
    __shared__ float partial[32];
    const long long base = (long long)blockIdx.x * h;
    rms_norm_row(x, delta, w, y, base, base, h, eps, vec, partial);
}
