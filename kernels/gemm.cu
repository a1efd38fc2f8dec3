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
