// rms_norm: plain RMSNorm y = w * x / sqrt(mean(x^2) + eps), BF16 out
// (contract: crates/dflash-ops/src/rms_norm/mod.rs). One block per row; blockDim.x a multiple
// of 32, at most 1024. Also launched by feature_projection on its F32 projection scratch.
// rms_norm_residual_bf16 first adds a delta into the BF16 residual stream in place (the
// layer's residual add fused with the norm that follows it).

__device__ __forceinline__ float rms_norm_warp_sum(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float rms_norm_load(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float rms_norm_load(const __nv_bfloat16* p, long long i) {
    return bf2f(p[i]);
}

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

template <typename T>
__device__ __forceinline__ void rms_norm_row(const T* __restrict__ x,
                                             const __nv_bfloat16* __restrict__ w,
                                             __nv_bfloat16* __restrict__ y, int h, float eps,
                                             float* partial) {
    const long long base = (long long)blockIdx.x * h;
    float ss = 0.0f;
    for (int j = threadIdx.x; j < h; j += blockDim.x) {
        float v = rms_norm_load(x, base + j);
        ss += v * v;
    }
    ss = rms_norm_block_sum(ss, partial);
    const float inv = 1.0f / sqrtf(ss / (float)h + eps);
    for (int j = threadIdx.x; j < h; j += blockDim.x) {
        y[base + j] = f2bf(bf2f(w[j]) * (rms_norm_load(x, base + j) * inv));
    }
}

// x: [rows, h] BF16 (grid.x = rows).
extern "C" __global__ void rms_norm_bf16(const __nv_bfloat16* __restrict__ x,
                                         const __nv_bfloat16* __restrict__ w,
                                         __nv_bfloat16* __restrict__ y, int h, float eps) {
    __shared__ float partial[32];
    rms_norm_row(x, w, y, h, eps, partial);
}

// x: [rows, h] F32 (grid.x = rows).
extern "C" __global__ void rms_norm_f32(const float* __restrict__ x,
                                        const __nv_bfloat16* __restrict__ w,
                                        __nv_bfloat16* __restrict__ y, int h, float eps) {
    __shared__ float partial[32];
    rms_norm_row(x, w, y, h, eps, partial);
}

// x: [rows, h] BF16 residual stream, updated in place to x + delta (each element's f32 sum
// rounded once to BF16, as residual_add: innocuous double rounding), then y = norm of the
// updated row (grid.x = rows). The same per-thread element order and block sum as
// rms_norm_bf16, so the result is bit-identical to residual_add followed by rms_norm_bf16.
extern "C" __global__ void rms_norm_residual_bf16(__nv_bfloat16* __restrict__ x,
                                                  const __nv_bfloat16* __restrict__ delta,
                                                  const __nv_bfloat16* __restrict__ w,
                                                  __nv_bfloat16* __restrict__ y, int h, float eps) {
    __shared__ float partial[32];
    const long long base = (long long)blockIdx.x * h;
    for (int j = threadIdx.x; j < h; j += blockDim.x) {
        x[base + j] = f2bf(bf2f(x[base + j]) + bf2f(delta[base + j]));
    }
    // Each thread reads back only the elements it wrote itself: no barrier needed.
    rms_norm_row(x, w, y, h, eps, partial);
}
