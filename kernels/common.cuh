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

// 8 consecutive BF16 values at a 16-byte aligned address as one 16-byte access: widened to
// f32 (exact), or rounded from f32 (RNE, as f2bf) and stored.
__device__ __forceinline__ void df_load8(const __nv_bfloat16* p, float (&v)[8]) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float2 f = __bfloat1622float2(h[j]);
        v[2 * j] = f.x;
        v[2 * j + 1] = f.y;
    }
}
__device__ __forceinline__ void df_store8(__nv_bfloat16* p, const float (&v)[8]) {
    uint4 u;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
    for (int j = 0; j < 4; ++j) h[j] = __floats2bfloat162_rn(v[2 * j], v[2 * j + 1]);
    *reinterpret_cast<uint4*>(p) = u;
}

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

// ---- Warpgroup MMA (wgmma; only the sm_90a kernel variants call these) ----
// A warpgroup is 4 consecutive warps; every thread of it executes each wgmma. Accumulator
// fragments of m64nNk16 (float d[N/8][4]): warp w of the warpgroup holds rows 16w + g (d[j][0],
// d[j][1]: columns 8j + 2q, 8j + 2q + 1) and 16w + g + 8 (d[j][2], d[j][3]), the mma.m16n8k16
// C layout per n8 tile; an A fragment in registers has the mma.m16n8k16 A layout per warp.
// Registers a wgmma reads or writes must not be touched between its issue and the
// df_wg_wait that retires its group; df_wg_fence orders earlier register writes before it.
//
// Shared operands use the 128-byte swizzled layout: rows of 64 16-bit elements (128 B), the
// 16-byte chunk c of row r stored at chunk c ^ (r % 8), each 8-row group an atom of 1024 B
// on a 1024-byte boundary (df_sw128_off). A descriptor (df_wg_desc) names a start address,
// the leading byte offset `lbo` (MN-major operands: the stride between 64-element atoms
// along M or N; K-major: unused, 16) and the stride byte offset `sbo` (between 8-row groups).
__device__ __forceinline__ u64 df_wg_desc(unsigned addr, unsigned lbo, unsigned sbo) {
    return ((u64)(addr & 0x3FFFFu) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32) |
           (1ull << 62);
}
// A K-major tile whose 8-row groups are consecutive atoms (rows 128 B apart).
__device__ __forceinline__ u64 df_wg_desc_k(const void* p) {
    return df_wg_desc(df_smem_u32(p), 16, 1024);
}
// Byte offset of 16-byte chunk c (elements 8c .. 8c + 7) of row r in a swizzled tile of
// `rows` rows (a multiple of 8) and 64-element atoms: chunks 8a .. 8a + 7 of every row form
// the a-th column block of rows * 128 bytes.
__device__ __forceinline__ unsigned df_sw128_off(int r, int c, int rows) {
    return (unsigned)((c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}
__device__ __forceinline__ void df_wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void df_wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void df_wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Orders this thread's generic-proxy shared-memory writes (plain stores, cp.async once
// waited for) before later async-proxy reads (wgmma operands), after a barrier.
__device__ __forceinline__ void df_fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// d (+)= A B, both from shared memory (K-major descriptors), BF16, FP32 accumulate;
// `accumulate` == 0 overwrites d.
__device__ __forceinline__ void df_wgmma_bf16(float (&d)[1][4], u64 da, u64 db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3}, %4, %5, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3])
        : "l"(da), "l"(db), "r"(accumulate));
}
__device__ __forceinline__ void df_wgmma_bf16(float (&d)[2][4], u64 da, u64 db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3])
        : "l"(da), "l"(db), "r"(accumulate));
}
__device__ __forceinline__ void df_wgmma_bf16(float (&d)[4][4], u64 da, u64 db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
        : "l"(da), "l"(db), "r"(accumulate));
}
__device__ __forceinline__ void df_wgmma_bf16(float (&d)[8][4], u64 da, u64 db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "l"(da), "l"(db), "r"(accumulate));
}
__device__ __forceinline__ void df_wgmma_bf16(float (&d)[16][4], u64 da, u64 db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "l"(da), "l"(db), "r"(accumulate));
}
// d (+)= A B with A (m64k16) from registers and B (k16 x n128) an MN-major shared tile
// (descriptor `db`, imm-trans-b = 1), FP16 (df_wgmma_rs_f16_nt) or BF16 (df_wgmma_rs_bf16_nt),
// FP32 accumulate; `accumulate` == 0 overwrites d.
#define DF_WGMMA_RS_NT(NAME, T)                                                                  \
    __device__ __forceinline__ void NAME(float (&d)[16][4], const unsigned (&a)[4], u64 db,      \
                                         int accumulate) {                                      \
        asm volatile(                                                                            \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                         \
            "wgmma.mma_async.sync.aligned.m64n128k16.f32." T "." T " "                           \
            "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"                                     \
            : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])                                                                               \
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));             \
    }
DF_WGMMA_RS_NT(df_wgmma_rs_f16_nt, "f16")
DF_WGMMA_RS_NT(df_wgmma_rs_bf16_nt, "bf16")
#undef DF_WGMMA_RS_NT

// Prefetch the 128-byte line holding `p` into the L2 (no value returned, nothing waited for).
__device__ __forceinline__ void df_prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

// ---- SiLU (swiglu, and the gemm SwiGLU epilogue: one definition, the same bits) ----
// silu(g) = g / (1 + exp(-g)), written so that exp never overflows: with e = exp(-|g|),
// sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) for g < 0.
__device__ __forceinline__ float df_silu(float g) {
    float e = expf(-fabsf(g));
    float s = g >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
    return g * s;
}

// ---- Programmatic dependent launch (sm_90 and later; no-ops below) ----
// A kernel launched with the programmatic-stream-serialization attribute (the backend's
// `launch_ex`) may start before the kernel ahead of it in the stream has finished:
// once every block of that kernel has called df_pdl_launch_dependents (or exited). Kernels
// trigger early (most call df_pdl_launch_dependents as they start), so when a kernel starts,
// the one ahead and the ones before it may all still run: before df_pdl_wait a kernel reads
// only what no earlier kernel of the stream writes (weights, row metadata uploaded before
// the chain), and writes nothing. df_pdl_wait returns once the kernel ahead has completed and
// its writes are visible; since that kernel waited too, so have all before it. Launched
// without the attribute, both are no-ops (the launch itself orders the two kernels).
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

// ---- Thread-block clusters (sm_90 and later; one-block clusters below) ----
// A kernel launched in clusters (the backend's `launch_ex` with cluster > 1) sees its blocks'
// rank within the cluster and their count; launched without, or compiled below sm_90, every
// cluster is the block alone (rank 0 of 1). df_cluster_sync is a barrier of every thread of
// every block of the cluster that orders shared-memory writes before it with reads after it
// across the cluster (release / acquire; __syncthreads for a one-block cluster below sm_90).
// df_cluster_peer maps a pointer into this block's shared memory to the same variable in
// block `rank` of the cluster (a generic address any load can read); a block must not exit
// while another may still read its shared memory (end with df_cluster_sync).
__device__ __forceinline__ unsigned df_cluster_blocks() {
#if __CUDA_ARCH__ >= 900
    unsigned n;
    asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(n));
    return n;
#else
    return 1u;
#endif
}
__device__ __forceinline__ unsigned df_cluster_rank() {
#if __CUDA_ARCH__ >= 900
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
#else
    return 0u;
#endif
}
__device__ __forceinline__ void df_cluster_sync() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n"
                 "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#else
    __syncthreads();
#endif
}
template <typename T>
__device__ __forceinline__ const T* df_cluster_peer(const T* p, unsigned rank) {
#if __CUDA_ARCH__ >= 900
    unsigned long long out;
    asm volatile("mapa.u64 %0, %1, %2;\n" : "=l"(out) : "l"((unsigned long long)p), "r"(rank));
    return (const T*)out;
#else
    (void)rank;
    return p;
#endif
}

// ---- mbarriers and TMA (sm_90 and later; only the sm_90a kernel variants call these) ----
#if __CUDA_ARCH__ >= 900
// A CUtensorMap (the driver's opaque 128-byte TMA descriptor), passed by value as a
// __grid_constant__ kernel parameter; encoded on the host by the launcher.
struct __align__(64) DfTmap {
    u64 w[16];
};

__device__ __forceinline__ void df_mbar_init(unsigned bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void df_mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void df_mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Wait until the phase of parity `parity` of barrier `bar` has completed. The spin loop stays
// inside one asm block (scoped labels): a C++ loop here would make ptxas see the wgmma chain
// as divergent and serialize it.
__device__ __forceinline__ void df_mbar_wait(unsigned bar, unsigned parity) {
    asm volatile(
        "{\n.reg .pred p;\nDF_WAIT:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@p bra DF_DONE;\n"
        "bra DF_WAIT;\nDF_DONE:\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
// TMA: the box at element coordinates (x = K, y = row) of `map` into shared memory at `dst`,
// completing `bytes` of transaction on `bar`.
__device__ __forceinline__ void df_tma_2d(unsigned dst, const DfTmap* map, int x, int y, unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
        "l"(reinterpret_cast<u64>(map)), "r"(x), "r"(y), "r"(bar)
        : "memory");
}
// TMA: the same box into the L2 only (no shared memory, no barrier, nothing returned).
__device__ __forceinline__ void df_tma_prefetch_2d(const DfTmap* map, int x, int y) {
    asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global.tile [%0, {%1, %2}];\n" ::"l"(reinterpret_cast<u64>(map)),
                 "r"(x), "r"(y)
                 : "memory");
}
#endif  // __CUDA_ARCH__ >= 900
