// Shared device helpers, prepended by the CUDA backend to every kernels/<op>.cu before NVRTC.
// Raw pointers and sizes only; no framework types.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

typedef unsigned int u32;
typedef unsigned long long u64;

// Philox4x32-10 (Random123 constants), the RNG identity of dflash-ops (see rng.rs):
// key = (seed lo, seed hi); counter = (pos lo, pos hi, purpose, sub); word 0 is the draw.
__device__ __forceinline__ void philox4x32_10(u32 c[4], u32 k0, u32 k1) {
    #pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r > 0) { k0 += 0x9E3779B9u; k1 += 0xBB67AE85u; }
        u32 hi0 = __umulhi(0xD2511F53u, c[0]);
        u32 lo0 = 0xD2511F53u * c[0];
        u32 hi1 = __umulhi(0xCD9E8D57u, c[2]);
        u32 lo1 = 0xCD9E8D57u * c[2];
        u32 n0 = hi1 ^ c[1] ^ k0;
        u32 n1 = lo1;
        u32 n2 = hi0 ^ c[3] ^ k1;
        u32 n3 = lo0;
        c[0] = n0; c[1] = n1; c[2] = n2; c[3] = n3;
    }
}

__device__ __forceinline__ u32 dflash_rng_word(u64 seed, u64 pos, u32 purpose, u32 sub) {
    u32 c[4] = {(u32)pos, (u32)(pos >> 32), purpose, sub};
    philox4x32_10(c, (u32)seed, (u32)(seed >> 32));
    return c[0];
}

// (word >> 8) * 2^-24: f32 in [0, 1) with 24 bits, exact.
__device__ __forceinline__ float dflash_unit_f32(u32 w) {
    return (float)(w >> 8) * (1.0f / 16777216.0f);
}

__device__ __forceinline__ float bf2f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ __nv_bfloat16 f2bf(float x) { return __float2bfloat16_rn(x); }
__device__ __forceinline__ float h2f(__half x) { return __half2float(x); }
__device__ __forceinline__ __half f2h(float x) { return __float2half_rn(x); }
