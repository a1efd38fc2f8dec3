// gemm: C = A W^T (or C += A W^T) for at most 32 rows of A, streaming the weight W once
// (contract: crates/dflash-ops/src/gemm/mod.rs). The launcher (crates/dflash-ops/src/gemm/
// cuda.rs, its plan in gemm/plan.rs) takes this path for the products its measured rule gives
// it, when k is a multiple of 32, the row strides of A and W are multiples of 8 elements and
// both start 16-byte aligned; every other product goes through cuBLAS.
//
// Work split. Block b owns the 16 weight rows (output features) 16b .. 16b + 15; its warps
// split the reduction axis in 32-element chunks, interleaved (warp w of W takes chunks w,
// w + W, w + 2W, ..., so the block reads neighbouring chunks of its rows at the same time).
// Per chunk, lane 4g + q copies 16 bytes of weight rows g and g + 8 at element k0 + 8q and 16
// bytes of A rows 8j + g (j < NT, the n8 tiles of A's rows) at the same k into its own slots
// of the warp's GEMM_STAGES-deep cp.async ring (L2 only: each weight byte is read once, A by
// every block from the L2), so that GEMM_STAGES - 1 chunks are in flight while one is
// multiplied; a lane reads back only what it copied itself, so the ring needs no barrier.
// The chunk is two mma.m16n8k16 per n8 tile with the weight as the A operand (16 x 16) and
// A^T as B (16 x 8); both operands take the reduction axis in the same permuted order
// (logical k 2q, 2q + 1, 8 + 2q, 8 + 2q + 1 of the first MMA are physical 8q .. 8q + 3, of
// the second 8q + 4 .. 8q + 7), which leaves each dot product's terms unchanged. Weight rows
// past n and A rows past m are read at row 0 instead and their results never stored (an MMA
// output element depends only on its own row and column).
//
// Dependent launch (sm_90 and later, `CudaBackend::launch_ex`). The kernel is launched as a
// programmatic dependent of the kernel ahead of it: before df_pdl_wait each block prefetches
// into the L2 the first GEMM_PREFETCH_K elements of each of its 16 weight rows (128-byte
// lines, `prefetch.global.L2`), so its DRAM stream starts while the kernel ahead finishes. A
// prefetch only moves lines into the L2, the device's point of coherence, and returns
// nothing: whoever wrote W, every value the kernel uses is read after the wait, so the
// contract asks nothing of the caller. The kernel lets its own dependents launch once its
// main loop is done (before the warps' reduction and the stores).

// Reduction. Each warp's FP32 partial sums go to shared memory and are added in warp order
// (fixed, so the result is deterministic and does not depend on the grid), then one thread
// per output element stores it: F32 as is, BF16 rounded once (RNE); with `accumulate`, the
// old C element (as F32) is added to the sum before that rounding, as cuBLAS does for beta = 1.
//
// Entries gemm_skinny_nt{1,2,4}_{f32,bf16} and gemm_skinny_swiglu_nt{1,2,4} (BF16 out, see SWIGLU
// below): NT = 1 for m <= 8, 2 for m <= 16, 4 for m <= 32.

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

// Warps per block at most (`gemm::plan::MAX_WARPS`).
#define GEMM_MAX_WARPS 16
// Shared memory of one warp: GEMM_STAGES stages of a chunk, each 2 + NT slots of 32 lanes x
// 16 bytes (weight rows lo, hi, then A's n8 tiles), lane-major so each lane's 16 bytes are
// contiguous with its neighbours' (conflict-free). Mirrored by `gemm::plan`.
#define GEMM_STAGES 4
// Elements of each weight row a block prefetches into the L2 before it waits for the kernel
// ahead (4 KB a row, 64 KB a block).
#define GEMM_PREFETCH_K 2048
template <int NT>
struct GemmCfg {
    static constexpr int SLOTS = 2 + NT;
    static constexpr int STAGE_BYTES = SLOTS * 32 * 16;
    static constexpr int WARP_BYTES = GEMM_STAGES * STAGE_BYTES;
};

// SWIGLU: the weight is [gate; up] (n = 2 I rows, gate rows 0 .. I - 1, up rows I .. 2 I - 1)
// and C is [m, I] BF16: block b owns output features 8b .. 8b + 7, its MMA rows 0 .. 7 being
// their gate rows and 8 .. 15 their up rows, so the thread that holds a gate sum also holds
// the matching up sum (accumulator registers 0, 1 and 2, 3 of the m16n8 tile) and stores
// bf16(silu(bf16(gate)) * bf16(up)): bit for bit the unfused product rounded to BF16 followed
// by the swiglu op (same sums, same roundings, the same silu).
template <int NT, class T, bool SWIGLU>
__device__ __forceinline__ void gemm_skinny(const __nv_bfloat16* __restrict__ a,
                                            const __nv_bfloat16* __restrict__ w, T* __restrict__ c,
                                            int m, int n, int k, long long lda, long long ldw,
                                            long long ldc, int accumulate) {
    typedef GemmCfg<NT> C;
    extern __shared__ __align__(16) unsigned char gemm_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int g = lane >> 2, q = lane & 3;
    const long long row0 = (long long)blockIdx.x * (SWIGLU ? 8 : 16);
    const int chunks = k >> 5;
    // This warp's chunks: warp, warp + warps, ...
    const int mine = chunks > warp ? (chunks - warp + warps - 1) / warps : 0;
    // Weight row of MMA row r (0 .. 15) of this block; row 0 stands in for rows past the end.
    auto wrow = [&](int r) -> long long {
        if (SWIGLU) {
            const long long inter = n >> 1, f = row0 + (r & 7);
            return f < inter ? (r < 8 ? f : inter + f) : 0;
        }
        return row0 + r < n ? row0 + r : 0;
    };
    const __nv_bfloat16* src[C::SLOTS];
    src[0] = w + wrow(g) * ldw + 8 * q;
    src[1] = w + wrow(g + 8) * ldw + 8 * q;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        const int t = 8 * j + g;
        src[2 + j] = a + (t < m ? (long long)t * lda : 0) + 8 * q;
    }
    const unsigned base = df_smem_u32(gemm_smem) + warp * C::WARP_BYTES + lane * 16;
    // The warp's i-th chunk into stage i % GEMM_STAGES (nothing past its count); one commit
    // group per call either way, so wait_group counts stay aligned.
    auto issue = [&](int i) {
        if (i < mine) {
            const unsigned st = base + (i % GEMM_STAGES) * C::STAGE_BYTES;
            const long long off = (long long)(warp + i * warps) * 32;
#pragma unroll
            for (int s = 0; s < C::SLOTS; ++s) df_cp_async16(st + s * 512, src[s] + off, true);
        }
        df_cp_commit();
    };
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    {
        // The head of each weight row into the L2 while the kernel ahead finishes.
        const int lines = (min(k, GEMM_PREFETCH_K) * 2 + 127) >> 7;
        for (int i = threadIdx.x; i < 16 * lines; i += blockDim.x) {
            const int r = i / lines;
            df_prefetch_l2(w + wrow(r) * ldw + (long long)(i - r * lines) * 64);
        }
    }
    df_pdl_wait();
#pragma unroll
    for (int i = 0; i < GEMM_STAGES - 1; ++i) issue(i);
    for (int i = 0; i < mine; ++i) {
        issue(i + GEMM_STAGES - 1);
        df_cp_wait<GEMM_STAGES - 1>();  // this lane's copies of chunk i have landed
        const unsigned st = base + (i % GEMM_STAGES) * C::STAGE_BYTES;
        const uint4 lo = gemm_lds(st), hi = gemm_lds(st + 512);
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const uint4 b = gemm_lds(st + (2 + j) * 512);
            df_mma_bf16(acc[j], lo.x, hi.x, lo.y, hi.y, b.x, b.y);
            df_mma_bf16(acc[j], lo.z, hi.z, lo.w, hi.w, b.z, b.w);
        }
    }
    df_cp_wait<0>();
    __syncthreads();  // every warp's pipeline is drained: its shared memory is reused below
    df_pdl_launch_dependents();

    constexpr int PER_WARP = NT * 4 * 32;
    float* red = reinterpret_cast<float*>(gemm_smem);  // [warp][NT][4][32]
    float* own = red + warp * PER_WARP;
#pragma unroll
    for (int e = 0; e < NT * 4; ++e) own[e * 32 + lane] = acc[e / 4][e % 4];
    __syncthreads();
    auto sum = [&](int e) {
        float v = red[e];
        for (int wi = 1; wi < warps; ++wi) v += red[wi * PER_WARP + e];
        return v;
    };
    for (int e = threadIdx.x; e < PER_WARP; e += blockDim.x) {
        const int l = e & 31, reg = (e >> 5) & 3, j = e >> 7;
        const int tok = 8 * j + 2 * (l & 3) + (reg & 1);
        if (SWIGLU) {
            // Registers 0, 1 (gate, row g) pair with 2, 3 (up, row g + 8): 64 floats on.
            const long long col = row0 + (l >> 2);
            if (reg < 2 && col < (n >> 1) && tok < m) {
                const float gate = bf2f(f2bf(sum(e))), up = bf2f(f2bf(sum(e + 64)));
                gemm_store_out(c + (long long)tok * ldc + col, df_silu(gate) * up);
            }
            continue;
        }
        const long long row = row0 + (l >> 2) + (reg >= 2 ? 8 : 0);
        if (row < n && tok < m) {
            float s = sum(e);
            T* out = c + (long long)tok * ldc + row;
            if (accumulate) s += gemm_load_out(out);
            gemm_store_out(out, s);
        }
    }
}

#define GEMM_ENTRY(NAME, NT, T, SWIGLU)                                                        \
    extern "C" __global__ void __launch_bounds__(GEMM_MAX_WARPS * 32) NAME(                     \
        const __nv_bfloat16* a, const __nv_bfloat16* w, T* c, int m, int n, int k,             \
        long long lda, long long ldw, long long ldc, int accumulate) {                         \
        gemm_skinny<NT, T, SWIGLU>(a, w, c, m, n, k, lda, ldw, ldc, accumulate);              \
    }

GEMM_ENTRY(gemm_skinny_nt1_f32, 1, float, false)
GEMM_ENTRY(gemm_skinny_nt2_f32, 2, float, false)
GEMM_ENTRY(gemm_skinny_nt4_f32, 4, float, false)
GEMM_ENTRY(gemm_skinny_nt1_bf16, 1, __nv_bfloat16, false)
GEMM_ENTRY(gemm_skinny_nt2_bf16, 2, __nv_bfloat16, false)
GEMM_ENTRY(gemm_skinny_nt4_bf16, 4, __nv_bfloat16, false)
GEMM_ENTRY(gemm_skinny_swiglu_nt1, 1, __nv_bfloat16, true)
GEMM_ENTRY(gemm_skinny_swiglu_nt2, 2, __nv_bfloat16, true)
GEMM_ENTRY(gemm_skinny_swiglu_nt4, 4, __nv_bfloat16, true)

#ifdef GEMM_WGMMA
// ---- The wide kernel (sm_90a; this file compiled with GEMM_WGMMA): wgmma + TMA, split-K ----
// For the products the skinny kernel does not take, up to 128 rows of A (`gemm::plan::
// wide_plan`): any k, A and W rows 16-byte aligned (addresses, and row strides that are
// multiples of 8 elements).
//
// Work split. Block (t, r) owns weight rows 64t .. 64t + 63 (one m64 wgmma tile, the weight
// on the M side and A's rows on the N side: NC = 8 * NT columns, NT = 1 .. 16) and the r-th
// of S equal ranges of the reduction axis, in chunks of 64 (the last chunk's elements past k
// read as zero). The S blocks of a tile form a thread-block cluster (grid x = tiles * S,
// cluster x = S <= 8), so the split needs no workspace and no second kernel.
// - Pipeline: warp 4's first lane streams the block's chunks with TMA through `stages`
//   shared-memory stages (a 64 x 64 weight box, or for the SwiGLU form a 32-row gate box and
//   a 32-row up box, and an NC x 64 box of A, all 128-byte swizzled; rows past the tensors
//   zero-filled): stage s is announced full by mbarrier full[s] (transaction bytes) and handed
//   back by empty[s] (an arrival of each consumer thread). Warps 0-3 (the consumer
//   warpgroup) run four m64nNCk16 wgmma per chunk (FP32 accumulators, the first chunk's first
//   overwriting them), wait for them and release the stage.
// - Dependent launch: before df_pdl_wait the producer prefetches its first stages' weight
//   boxes into the L2 (a TMA prefetch returns nothing, so nothing is read early, whoever
//   wrote W); the block lets its dependents launch after its main loop.
// - Reduction: each block stores its 64 x NC partial sums in its own shared memory (the
//   drained stages), the cluster synchronizes, and block r reduces the r-th of S equal
//   shares of the tile's elements, adding the S blocks' partials in rank order (a fixed
//   order: the result depends only on the shape, the plan and the inputs), then stores them
//   as the skinny kernel does (F32 as is, BF16 rounded once, `accumulate` adding the old C
//   element before that rounding; the SwiGLU form bf16(silu(bf16(G)) * bf16(U)) from the
//   gate sum of tile row j and the up sum of row 32 + j). A last cluster barrier keeps every
//   block's shared memory alive until its peers have read it.
//
// Entries gemm_wide_nt{1,2,4,8,16}_{f32,bf16} and gemm_wide_swiglu_nt{1,2,4,8,16} (the weight
// [gate; up], n = 2 I, C [m, I]: block t owns features 32t .. 32t + 31).
#define GW_ROWS 64                 // weight rows of a tile (one m64 wgmma)
#define GW_KC 64                   // reduction elements a stage (one 128-byte swizzled row)
#define GW_THREADS 160             // the consumer warpgroup and the producer warp
#define GW_RED_LD (GW_ROWS + 4)    // floats a column of the partial tile (conflict-free stores)
#define GW_W_BYTES (GW_ROWS * GW_KC * 2)

template <int NT, class T, bool SWIGLU>
__device__ __forceinline__ void gemm_wide(const DfTmap* tm_a, const DfTmap* tm_w, T* __restrict__ c, int m,
                                          int n, int k, long long ldc, int accumulate, int stages) {
    constexpr int NC = 8 * NT;
    constexpr unsigned STAGE_BYTES = GW_W_BYTES + NC * GW_KC * 2;  // a multiple of 1024
    extern __shared__ __align__(16) unsigned char gemm_smem[];
    unsigned char* base = gemm_smem + ((1024 - (df_smem_u32(gemm_smem) & 1023)) & 1023);
    const unsigned pipe = df_smem_u32(base);
    const unsigned bars = pipe + stages * STAGE_BYTES;  // full[stages], then empty[stages]
    const int tid = threadIdx.x;
    const int warp = __shfl_sync(0xffffffffu, tid >> 5, 0);
    const int splits = (int)df_cluster_blocks(), rank = (int)df_cluster_rank();
    const int tile = blockIdx.x / splits;
    const int kch = (k + GW_KC - 1) / GW_KC;
    const int c0 = (int)((long long)rank * kch / splits), c1 = (int)((long long)(rank + 1) * kch / splits);
    const int nk = c1 - c0;
    const int inter = n >> 1;
    // Weight rows of the tile's boxes: one 64-row box, or the gate and up boxes of 32 rows.
    const int wr0 = SWIGLU ? tile * 32 : tile * GW_ROWS;
    const int wr1 = inter + tile * 32;
    if (tid == 0) {
        for (int s = 0; s < stages; ++s) {
            df_mbar_init(bars + 8 * s, 1);
            df_mbar_init(bars + 8 * (stages + s), 128);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    float acc[NT][4];
    if (warp == 4) {
        if ((tid & 31) == 0) {
            for (int j = 0; j < min(nk, stages); ++j) {
                const int k0 = (c0 + j) * GW_KC;
                df_tma_prefetch_2d(tm_w, k0, wr0);
                if (SWIGLU) df_tma_prefetch_2d(tm_w, k0, wr1);
            }
            df_pdl_wait();
            for (int j = 0; j < nk; ++j) {
                const int s = j % stages;
                if (j >= stages) df_mbar_wait(bars + 8 * (stages + s), (unsigned)((j / stages - 1) & 1));
                const unsigned full = bars + 8 * s, dst = pipe + s * STAGE_BYTES;
                df_mbar_expect_tx(full, STAGE_BYTES);
                const int k0 = (c0 + j) * GW_KC;
                if (SWIGLU) {
                    df_tma_2d(dst, tm_w, k0, wr0, full);
                    df_tma_2d(dst + GW_W_BYTES / 2, tm_w, k0, wr1, full);
                } else {
                    df_tma_2d(dst, tm_w, k0, wr0, full);
                }
                df_tma_2d(dst + GW_W_BYTES, tm_a, k0, 0, full);
            }
        }
        __syncwarp();
        df_pdl_wait();  // the warp's other lanes store C below
    } else {
        df_pdl_wait();
        for (int j = 0; j < nk; ++j) {
            const int s = j % stages;
            df_mbar_wait(bars + 8 * s, (unsigned)((j / stages) & 1));
            const __nv_bfloat16* Ws = reinterpret_cast<const __nv_bfloat16*>(base + s * STAGE_BYTES);
            const __nv_bfloat16* As = Ws + GW_ROWS * GW_KC;
            df_wg_fence();
#pragma unroll
            for (int k16 = 0; k16 < GW_KC / 16; ++k16)
                df_wgmma_bf16(acc, df_wg_desc_k(Ws + k16 * 16), df_wg_desc_k(As + k16 * 16), (j > 0 || k16 > 0) ? 1 : 0);
            df_wg_commit();
            df_wg_wait<0>();
            df_mbar_arrive(bars + 8 * (stages + s));
        }
        if (nk == 0) {
#pragma unroll
            for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
        }
    }
    df_pdl_launch_dependents();
    // Every stage was consumed (each full barrier waited for) and, once all four consumer
    // warps have passed their last wgmma wait (named barrier 1, the warpgroup only), no
    // wgmma reads the pipeline's memory any more: it is free for the partial tile.
    float* red = reinterpret_cast<float*>(base);  // [NC][GW_RED_LD]: column = row of A
    if (warp < 4) {
        asm volatile("bar.sync 1, 128;\n" ::: "memory");
        const int lane = tid & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    red[(8 * j + 2 * q + e) * GW_RED_LD + warp * 16 + g + 8 * h] = acc[j][2 * h + e];
    }
    df_cluster_sync();
    constexpr int OUT_ROWS = SWIGLU ? 32 : GW_ROWS;
    constexpr int ELEMS = NC * OUT_ROWS;
    const int share = (ELEMS + splits - 1) / splits;
    const int e1 = min(ELEMS, (rank + 1) * share);
    auto sum = [&](int off) {
        float v = *df_cluster_peer(red + off, 0u);
        for (int p = 1; p < splits; ++p) v += *df_cluster_peer(red + off, (unsigned)p);
        return v;
    };
    for (int e = rank * share + tid; e < e1; e += GW_THREADS) {
        const int col = e / OUT_ROWS, row = e - col * OUT_ROWS;
        if (col >= m) continue;
        if (SWIGLU) {
            const int f = tile * 32 + row;
            if (f >= inter) continue;
            const float gate = bf2f(f2bf(sum(col * GW_RED_LD + row)));
            const float up = bf2f(f2bf(sum(col * GW_RED_LD + 32 + row)));
            gemm_store_out(c + (long long)col * ldc + f, df_silu(gate) * up);
        } else {
            const int f = tile * GW_ROWS + row;
            if (f >= n) continue;
            float v = sum(col * GW_RED_LD + row);
            T* out = c + (long long)col * ldc + f;
            if (accumulate) v += gemm_load_out(out);
            gemm_store_out(out, v);
        }
    }
    __syncwarp();  // the loop's trip counts differ by thread: reconverge for the aligned barrier
    df_cluster_sync();
}

#define GEMM_WIDE_ENTRY(NAME, NT, T, SWIGLU)                                                              \
    extern "C" __global__ void __launch_bounds__(GW_THREADS) NAME(                                      \
        const __grid_constant__ DfTmap tm_a, const __grid_constant__ DfTmap tm_w, T* c, int m, int n, int k, \
        long long ldc, int accumulate, int stages) {                                                     \
        gemm_wide<NT, T, SWIGLU>(&tm_a, &tm_w, c, m, n, k, ldc, accumulate, stages);                    \
    }
#define GEMM_WIDE_ENTRIES(NT)                                           \
    GEMM_WIDE_ENTRY(gemm_wide_nt##NT##_f32, NT, float, false)           \
    GEMM_WIDE_ENTRY(gemm_wide_nt##NT##_bf16, NT, __nv_bfloat16, false)  \
    GEMM_WIDE_ENTRY(gemm_wide_swiglu_nt##NT, NT, __nv_bfloat16, true)
GEMM_WIDE_ENTRIES(1)
GEMM_WIDE_ENTRIES(2)
GEMM_WIDE_ENTRIES(4)
GEMM_WIDE_ENTRIES(8)
GEMM_WIDE_ENTRIES(16)
#endif  // GEMM_WGMMA
