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

// ---- Tensor-core and async-copy helpers (sm_80 and later; inline PTX) ----
// Fragment layouts of mma.m16n8k16 (g = lane / 4, q = lane % 4): A (16x16, row-major) regs
// a0 = (g, 2q..2q+1), a1 = (g+8, 2q..), a2 = (g, 8+2q..), a3 = (g+8, 8+2q..); B (16x8, "col":
// stored [n][k]) b0 = (k 2q..2q+1, n g), b1 = (k 8+2q.., n g); C/D (16x8 f32) c0,c1 = (g, 2q..),
// c2,c3 = (g+8, 2q..). Each 32-bit register holds two 16-bit elements, the lower index in the
// low half.

__device__ __forceinline__ unsigned df_smem_u32(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// 16-byte global -> shared async copy; `valid == false` writes 16 zero bytes (reads nothing).
__device__ __forceinline__ void df_cp_async16(unsigned dst, const void* src, bool valid) {
    const int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void df_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void df_cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void df_ldsm_x4(unsigned addr, unsigned& r0, unsigned& r1,
                                           unsigned& r2, unsigned& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
__device__ __forceinline__ void df_ldsm_x4_trans(unsigned addr, unsigned& r0, unsigned& r1,
                                                 unsigned& r2, unsigned& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
__device__ __forceinline__ void df_ldsm_x2(unsigned addr, unsigned& r0, unsigned& r1) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r0), "=r"(r1)
                 : "r"(addr));
}

// d += a * b, BF16 inputs, FP32 accumulate.
__device__ __forceinline__ void df_mma_bf16(float (&d)[4], unsigned a0, unsigned a1, unsigned a2,
                                            unsigned a3, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// d += a * b, FP16 inputs, FP32 accumulate.
__device__ __forceinline__ void df_mma_f16(float (&d)[4], unsigned a0, unsigned a1, unsigned a2,
                                           unsigned a3, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Two floats as one register of two 16-bit values (lo in the low half), RNE.
__device__ __forceinline__ unsigned df_pack_bf16(__nv_bfloat16 lo, __nv_bfloat16 hi) {
    return (unsigned)__bfloat16_as_ushort(lo) | ((unsigned)__bfloat16_as_ushort(hi) << 16);
}
__device__ __forceinline__ unsigned df_pack_f16(__half lo, __half hi) {
    return (unsigned)__half_as_ushort(lo) | ((unsigned)__half_as_ushort(hi) << 16);
}

// ---- Programmatic dependent launch (sm_90 and later; no-ops below) ----
// A kernel launched with the programmatic-stream-serialization attribute (the backend's
// `launch_dependent`) may start before the kernel ahead of it in the stream has finished:
// once every block of that kernel has called df_pdl_launch_dependents (or exited). Before
// df_pdl_wait it may only read what the kernels before that one wrote; df_pdl_wait returns
// once the kernel ahead has completed and its writes are visible. Launched without the
// attribute, both are no-ops (the launch itself orders the two kernels).
__device__ __forceinline__ void df_pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void df_pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
