// gemm: C = A W^T (or C += A W^T) for at most 64 rows of A, streaming the weight W once
// (contract: crates/dflash-ops/src/gemm/mod.rs). The launcher (crates/dflash-ops/src/gemm/
// cuda.rs) takes this path for m <= 64 when k is a multiple of 32, the row strides of A and W
// are multiples of 8 elements and both start 16-byte aligned; every other product goes
// through cuBLAS.
//
// Work split. Block b owns the 16 RG weight rows (output features) 16 RG b .. 16 RG (b + 1) - 1,
// RG row groups of 16; its warps split the reduction axis in 32-element chunks, interleaved
// (warp w of W takes chunks w, w + W, w + 2W, ..., so the block reads neighbouring chunks of
// its rows at the same time). Per chunk, lane 4g + q copies 16 bytes of weight rows g and
// g + 8 of each row group at element k0 + 8q and 16 bytes of A rows 8j + g (j < NT, the n8
// tiles of A's rows) at the same k into its own slots of the warp's GEMM_STAGES-deep cp.async
// ring (L2 only: each weight byte is read once, A by every block from the L2; RG row groups
// share each A load), so that GEMM_STAGES - 1 chunks are in flight while one is multiplied;
// a lane reads back only what it copied itself, so the ring needs no barrier. The chunk is
// two mma.m16n8k16 per row group and n8 tile with the weight as the A operand (16 x 16) and
// A^T as B (16 x 8); both operands take the reduction axis in the same permuted order
// (logical k 2q, 2q + 1, 8 + 2q, 8 + 2q + 1 of the first MMA are physical 8q .. 8q + 3, of
// the second 8q + 4 .. 8q + 7), which leaves each dot product's terms unchanged. Weight rows
// past n and A rows past m are read at row 0 instead and their results never stored (an
// MMA output element depends only on its own row and column).
//
// Reduction. Each warp's FP32 partial sums go to shared memory and are added in warp order
// (fixed, so the result is deterministic and does not depend on the grid), then one thread
// per output element stores it: F32 as is, BF16 rounded once (RNE); with `accumulate`, the
// old C element (as F32) is added to the sum before that rounding, as cuBLAS does for beta = 1.
//
// Entries gemm_skinny_rg{RG}_nt{NT}_{f32,bf16}: RG in {1, 2, 4}, NT in {1, 2, 4, 8}; the
// launcher's plan (crates/dflash-ops/src/gemm/plan.rs) picks one per product.

__device__ __forceinline__ float gemm_load_out(const float* p) { return *p; }
__device__ __forceinline__ float gemm_load_out(const __nv_bfloat16* p) { return bf2f(*p); }
__device__ __forceinline__ void gemm_store_out(float* p, float v) { *p = v; }
__device__ __forceinline__ void gemm_store_out(__nv_bfloat16* p, float v) { *p = f2bf(v); }

__device__ __forceinline__ uint4 gemm_lds(unsigned addr) {
    uint4 r;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "r"(addr));
    return r;
}

// Shared memory of one warp: GEMM_STAGES stages of a chunk, each 2 RG + NT slots of 32
// lanes x 16 bytes (weight rows lo, hi of each row group, then A's n8 tiles), lane-major so
// each lane's 16 bytes are contiguous with its neighbours' (conflict-free).
#define GEMM_STAGES 4
#define GEMM_SUB 1  // 32-element sub-chunks a chunk (stage): the reduction axis in 32 GEMM_SUB steps
template <int NT, int RG>
struct GemmCfg {
    static constexpr int SLOTS = 2 * RG + NT;
    static constexpr int STAGE_BYTES = GEMM_SUB * SLOTS * 32 * 16;
    static constexpr int WARP_BYTES = GEMM_STAGES * STAGE_BYTES;
};

template <int NT, int RG, class T>
__device__ __forceinline__ void gemm_skinny(const __nv_bfloat16* __restrict__ a,
                                            const __nv_bfloat16* __restrict__ w, T* __restrict__ c,
                                            int m, int n, int k, long long lda, long long ldw,
                                            long long ldc, int accumulate) {
    typedef GemmCfg<NT, RG> C;
    extern __shared__ __align__(16) unsigned char gemm_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int g = lane >> 2, q = lane & 3;
    const long long row0 = (long long)blockIdx.x * (16 * RG);
    const int chunks = k / (32 * GEMM_SUB);
    // This warp's chunks: warp, warp + warps, ... (the block's warps read neighbouring
    // chunks of its rows at the same time).
    const int mine = chunks > warp ? (chunks - warp + warps - 1) / warps : 0;
    const __nv_bfloat16* src[C::SLOTS];
#pragma unroll
    for (int r = 0; r < 2 * RG; ++r) {
        const long long row = row0 + 16 * (r >> 1) + g + 8 * (r & 1);
        src[r] = w + (row < n ? row : 0) * ldw + 8 * q;
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        const int t = 8 * j + g;
        src[2 * RG + j] = a + (t < m ? (long long)t * lda : 0) + 8 * q;
    }
    const unsigned base = df_smem_u32(gemm_smem) + warp * C::WARP_BYTES + lane * 16;
    // The warp's i-th chunk into stage i % GEMM_STAGES (nothing past its count); one commit
    // group per call either way, so wait_group counts stay aligned.
    auto issue = [&](int i) {
        if (i < mine) {
            const unsigned st = base + (i % GEMM_STAGES) * C::STAGE_BYTES;
            const long long off = (long long)(warp + i * warps) * (32 * GEMM_SUB);
#pragma unroll
            for (int u = 0; u < GEMM_SUB; ++u)
#pragma unroll
                for (int s = 0; s < C::SLOTS; ++s)
                    df_cp_async16(st + (u * C::SLOTS + s) * 512, src[s] + off + 32 * u, true);
        }
        df_cp_commit();
    };
    float acc[RG][NT][4];
#pragma unroll
    for (int r = 0; r < RG; ++r)
#pragma unroll
        for (int j = 0; j < NT; ++j) acc[r][j][0] = acc[r][j][1] = acc[r][j][2] = acc[r][j][3] = 0.0f;
#pragma unroll
    for (int i = 0; i < GEMM_STAGES - 1; ++i) issue(i);
    for (int i = 0; i < mine; ++i) {
        issue(i + GEMM_STAGES - 1);
        df_cp_wait<GEMM_STAGES - 1>();  // this lane's copies of chunk i have landed
#pragma unroll
        for (int u = 0; u < GEMM_SUB; ++u) {
        const unsigned st = base + (i % GEMM_STAGES) * C::STAGE_BYTES + u * C::SLOTS * 512;
        uint4 b[NT];
#pragma unroll
        for (int j = 0; j < NT; ++j) b[j] = gemm_lds(st + (2 * RG + j) * 512);
#pragma unroll
        for (int r = 0; r < RG; ++r) {
            const uint4 lo = gemm_lds(st + (2 * r) * 512), hi = gemm_lds(st + (2 * r + 1) * 512);
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                df_mma_bf16(acc[r][j], lo.x, hi.x, lo.y, hi.y, b[j].x, b[j].y);
                df_mma_bf16(acc[r][j], lo.z, hi.z, lo.w, hi.w, b[j].z, b[j].w);
            }
        }
        }
    }
    df_cp_wait<0>();
    __syncthreads();  // every warp's pipeline is drained: its shared memory is reused below

    constexpr int PER_WARP = RG * NT * 4 * 32;
    float* red = reinterpret_cast<float*>(gemm_smem);  // [warp][RG][NT][4][32]
    float* own = red + warp * PER_WARP;
#pragma unroll
    for (int r = 0; r < RG; ++r)
#pragma unroll
        for (int e = 0; e < NT * 4; ++e) own[(r * NT * 4 + e) * 32 + lane] = acc[r][e / 4][e % 4];
    __syncthreads();
    for (int e = threadIdx.x; e < PER_WARP; e += blockDim.x) {
        float s = red[e];
        for (int wi = 1; wi < warps; ++wi) s += red[wi * PER_WARP + e];
        const int l = e & 31, x = e >> 5;
        const int reg = x & 3, j = (x >> 2) % NT, r = (x >> 2) / NT;
        const long long row = row0 + 16 * r + (l >> 2) + (reg >= 2 ? 8 : 0);
        const int tok = 8 * j + 2 * (l & 3) + (reg & 1);
        if (row < n && tok < m) {
            T* out = c + (long long)tok * ldc + row;
            if (accumulate) s += gemm_load_out(out);
            gemm_store_out(out, s);
        }
    }
}

// Warps per block at most (mirrored by the launcher, `gemm::plan::max_warps`): 16, or 8 where
// a warp holds 16 or more accumulator tiles (RG x NT; their registers and loads need more
// than the 128 a thread of a 512-thread block may have).
#define GEMM_MAX_WARPS(NT, RG) ((NT) * (RG) >= 16 ? 8 : 16)

#define GEMM_ENTRY(NAME, NT, RG, T)                                                            \
    extern "C" __global__ void __launch_bounds__(GEMM_MAX_WARPS(NT, RG) * 32) NAME(             \
        const __nv_bfloat16* a, const __nv_bfloat16* w, T* c, int m, int n, int k,             \
        long long lda, long long ldw, long long ldc, int accumulate) {                         \
        gemm_skinny<NT, RG, T>(a, w, c, m, n, k, lda, ldw, ldc, accumulate);                  \
    }

GEMM_ENTRY(gemm_skinny_rg1_nt1_f32, 1, 1, float)
GEMM_ENTRY(gemm_skinny_rg1_nt2_f32, 2, 1, float)
GEMM_ENTRY(gemm_skinny_rg1_nt4_f32, 4, 1, float)
GEMM_ENTRY(gemm_skinny_rg1_nt8_f32, 8, 1, float)
GEMM_ENTRY(gemm_skinny_rg2_nt1_f32, 1, 2, float)
GEMM_ENTRY(gemm_skinny_rg2_nt2_f32, 2, 2, float)
GEMM_ENTRY(gemm_skinny_rg2_nt4_f32, 4, 2, float)
GEMM_ENTRY(gemm_skinny_rg2_nt8_f32, 8, 2, float)
GEMM_ENTRY(gemm_skinny_rg4_nt1_f32, 1, 4, float)
GEMM_ENTRY(gemm_skinny_rg4_nt2_f32, 2, 4, float)
GEMM_ENTRY(gemm_skinny_rg4_nt4_f32, 4, 4, float)
GEMM_ENTRY(gemm_skinny_rg4_nt8_f32, 8, 4, float)
GEMM_ENTRY(gemm_skinny_rg1_nt1_bf16, 1, 1, __nv_bfloat16)
GEMM_ENTRY(gemm_skinny_rg1_nt2_bf16, 2, 1, __nv_bfloat16)
GEMM_ENTRY(gemm_skinny_rg1_nt4_bf16, 4, 1, __nv_bfloat16)
GEMM_ENTRY(gemm_skinny_rg1_nt8_bf16, 8, 1, __nv_bfloat16)
GEMM_ENTRY(gemm_skinny_rg2_nt1_bf16, 1, 2, __nv_bfloat16)
GEMM_ENTRY(gemm_skinny_rg2_nt2_bf16, 2, 2, __nv_bfloat16)
GEMM_ENTRY(gemm_skinny_rg2_nt4_bf16, 4, 2, __nv_bfloat16)
GEMM_ENTRY(gemm_skinny_rg2_nt8_bf16, 8, 2, __nv_bfloat16)
GEMM_ENTRY(gemm_skinny_rg4_nt1_bf16, 1, 4, __nv_bfloat16)
GEMM_ENTRY(gemm_skinny_rg4_nt2_bf16, 2, 4, __nv_bfloat16)
GEMM_ENTRY(gemm_skinny_rg4_nt4_bf16, 4, 4, __nv_bfloat16)
GEMM_ENTRY(gemm_skinny_rg4_nt8_bf16, 8, 4, __nv_bfloat16)
