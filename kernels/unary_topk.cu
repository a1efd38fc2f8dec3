// unary_topk: the proposal head GEMM fused with a stable per-column top-16 (score
// descending, exact ties to the lower global id); no [n, rows] logits in memory
// (contract: crates/dflash-ops/src/unary_topk/mod.rs).
//
// The launcher compiles kernels/proposal_argmax.cu (the head GEMM driver ph_run, the row ids,
// the partial layout) first and this file after it; only the epilogue and the merge differ.
//
// Epilogue. Each block keeps, per column, its running top-16 (sorted, best first) in shared
// memory. After a tile: (1) every warp reduces its 32 rows to a best per column and the block
// combines the four warps; a column is "hot" only if that best beats the column's current
// 16th entry (otherwise nothing in the tile can enter). (2) Only if some column is hot, the
// tile's logits go to shared memory 16 columns at a time and one warp per hot column
// extracts the tile's candidates best-first (warp argmax over 128 rows) and inserts them
// into the list until the next one no longer beats the 16th entry (at most 16 insertions).
// After the first tiles of a block almost no column is hot, so the steady state costs one
// reduction per tile.
// Merge: one block per column takes the top-16 of the P * 16 partial candidates (a sorted
// list per thread, then 16 rounds of a block-wide argmax over the list heads).

#define UT_K 16
#define UT_SLAB 16  // columns of logits staged at once on the hot path

// Top-16 epilogue of the head GEMM (see above). Shared memory: warp bests, the lists, hot
// flags, the tile's row ids and one slab of logits.
template <int NT>
struct PhTopk {
    static constexpr int NC = 8 * NT;
    static constexpr int SLAB = NC < UT_SLAB ? NC : UT_SLAB;
    static constexpr int SMEM_BYTES =
        PH_WARPS * NC * 8 + NC * UT_K * 8 + NC * 4 + PH_TV * 4 + SLAB * PH_TV * 4;  // mirrored by the launcher
    float* wv;     // [PH_WARPS][NC]
    int* wi;
    float* lv;     // [NC][UT_K]
    int* li;
    int* hot;      // [NC]
    int* tids;     // [PH_TV] ids of the tile's rows (PH_NO_ID when not a candidate)
    float* slab;   // [SLAB][PH_TV]
    PhRows rw;
    float* ws;
    int n;
    __device__ __forceinline__ PhTopk(unsigned char* epi_smem, PhRows rows_, float* ws_, int n_)
        : rw(rows_), ws(ws_), n(n_) {
        wv = reinterpret_cast<float*>(epi_smem);
        wi = reinterpret_cast<int*>(wv + PH_WARPS * NC);
        lv = reinterpret_cast<float*>(wi + PH_WARPS * NC);
        li = reinterpret_cast<int*>(lv + NC * UT_K);
        hot = li + NC * UT_K;
        tids = hot + NC;
        slab = reinterpret_cast<float*>(tids + PH_TV);
    }
    __device__ __forceinline__ void init() {
        for (int e = threadIdx.x; e < NC * UT_K; e += PH_THREADS) { lv[e] = PH_NEG_INF; li[e] = PH_NO_ID; }
    }

    // One warp: merge the candidates of slab column `cl` (ids tids) into list `c`.
    __device__ __forceinline__ void select(int cl, int c) {
        const int lane = threadIdx.x & 31;
        float cv[4];
        int ci[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int rr = lane + 32 * j;
            ci[j] = tids[rr];
            float x = slab[cl * PH_TV + rr];
            if (x != x || ci[j] == PH_NO_ID) x = PH_NEG_INF;
            cv[j] = x;
        }
        float mv = lane < UT_K ? lv[c * UT_K + lane] : PH_NEG_INF;
        int mi = lane < UT_K ? li[c * UT_K + lane] : PH_NO_ID;
        for (int round = 0; round < UT_K; ++round) {
            // This lane's best remaining candidate, then the warp's.
            float bv = cv[0];
            int bi = ci[0], bj = 0;
#pragma unroll
            for (int j = 1; j < 4; ++j)
                if (ph_beats(cv[j], ci[j], bv, bi)) { bv = cv[j]; bi = ci[j]; bj = j; }
            int bl = lane;
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) {
                const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
                const int oi = __shfl_xor_sync(0xffffffffu, bi, off);
                const int ol = __shfl_xor_sync(0xffffffffu, bl, off);
                if (ph_beats(ov, oi, bv, bi)) { bv = ov; bi = oi; bl = ol; }
            }
            const float tv = __shfl_sync(0xffffffffu, mv, UT_K - 1);
            const int ti = __shfl_sync(0xffffffffu, mi, UT_K - 1);
            if (!ph_beats(bv, bi, tv, ti)) break;  // uniform: every lane sees the same values
            // Insert at pos = number of entries that beat it; entries below shift down.
            const unsigned above = __ballot_sync(0xffffffffu, lane < UT_K && ph_beats(mv, mi, bv, bi));
            const int pos = __popc(above);
            const float uv = __shfl_up_sync(0xffffffffu, mv, 1);
            const int ui = __shfl_up_sync(0xffffffffu, mi, 1);
            if (lane < UT_K) {
                if (lane == pos) { mv = bv; mi = bi; }
                else if (lane > pos) { mv = uv; mi = ui; }
            }
            if (lane == bl) {
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    if (j == bj) { cv[j] = PH_NEG_INF; ci[j] = PH_NO_ID; }
            }
        }
        if (lane < UT_K) { lv[c * UT_K + lane] = mv; li[c * UT_K + lane] = mi; }
    }

    __device__ __forceinline__ void tile(const float (&acc)[2][NT][4], long long r0, long long row_end) {
        const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
        int ids[2][2];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) ids[mt][h] = rw.id(ph_row(r0, mt, h), row_end);
        float v[NT][2];
        int id[NT][2];
        ph_warp_best<NT>(acc, ids, v, id);
        if ((lane >> 2) == 0) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int c = nt * 8 + 2 * (lane & 3) + e;
                    wv[warp * NC + c] = v[nt][e];
                    wi[warp * NC + c] = id[nt][e];
                }
        }
        tids[tid] = rw.id(r0 + tid, row_end);  // PH_THREADS == PH_TV
        __syncthreads();
        int any = 0;
        for (int c = tid; c < NC; c += PH_THREADS) {
            float b = PH_NEG_INF;
            int bid = PH_NO_ID;
#pragma unroll
            for (int w = 0; w < PH_WARPS; ++w)
                if (ph_beats(wv[w * NC + c], wi[w * NC + c], b, bid)) { b = wv[w * NC + c]; bid = wi[w * NC + c]; }
            const int h = ph_beats(b, bid, lv[c * UT_K + UT_K - 1], li[c * UT_K + UT_K - 1]) ? 1 : 0;
            hot[c] = h;
            any |= h;
        }
        if (!__syncthreads_or(any)) return;
        for (int s0 = 0; s0 < NC; s0 += SLAB) {
            // Stage columns [s0, s0 + SLAB) of the tile: slab[c - s0][local row].
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                if (nt * 8 < s0 || nt * 8 >= s0 + SLAB) continue;
#pragma unroll
                for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int c = nt * 8 + 2 * (lane & 3) + e;
                            const int rr = warp * 32 + mt * 16 + (lane >> 2) + 8 * h;
                            slab[(c - s0) * PH_TV + rr] = acc[mt][nt][2 * h + e];
                        }
            }
            __syncthreads();
            for (int cl = warp; cl < SLAB; cl += PH_WARPS)
                if (hot[s0 + cl]) select(cl, s0 + cl);
            __syncthreads();
        }
    }

    __device__ __forceinline__ void finish() {
        const int P = gridDim.x;
        for (int e = threadIdx.x; e < NC * UT_K; e += PH_THREADS) {
            const int c = e / UT_K, j = e % UT_K;
            const long long col = (long long)blockIdx.y * NC + c;
            if (col >= n) continue;
            float* o = ws + ((col * P + blockIdx.x) * UT_K + j) * 2;
            o[0] = lv[e];
            o[1] = __int_as_float(li[e]);
        }
    }
};

#define PH_TOPK_ENTRY(NT)                                                                       \
    extern "C" __global__ void __launch_bounds__(PH_THREADS) unary_topk_gemm_nt##NT(            \
        const __nv_bfloat16* hidden, const __nv_bfloat16* head, const int* token_ids,          \
        float* ws, int n, int rows, int H, int public_vocab) {                                   \
        extern __shared__ __align__(16) unsigned char ph_smem[];                                \
        PhRows rw;                                                                               \
        rw.token_ids = token_ids;                                                                \
        rw.considered = public_vocab;                                                            \
        PhTopk<NT> epi(ph_smem + PhCfg<NT>::PIPE_BYTES, rw, ws, n);                              \
        ph_run<NT>(hidden, head, n, rows, H, ph_smem, epi);                                      \
    }
PH_TOPK_ENTRY(1)
PH_TOPK_ENTRY(2)
PH_TOPK_ENTRY(4)
PH_TOPK_ENTRY(8)
PH_TOPK_ENTRY(16)

#define UT_MERGE_THREADS 256
#define UT_MERGE_WARPS (UT_MERGE_THREADS / 32)

// Insert (v, id) into the sorted (best first) register list if it beats the last entry.
__device__ __forceinline__ void ut_push(float (&lv)[UT_K], int (&li)[UT_K], float v, int id) {
    if (!ph_beats(v, id, lv[UT_K - 1], li[UT_K - 1])) return;
#pragma unroll
    for (int j = UT_K - 1; j > 0; --j) {
        // lv[j - 1] and lv[j] still hold their old values here (descending j).
        const bool above_prev = ph_beats(v, id, lv[j - 1], li[j - 1]);
        const bool above_cur = ph_beats(v, id, lv[j], li[j]);
        if (above_prev) { lv[j] = lv[j - 1]; li[j] = li[j - 1]; }
        else if (above_cur) { lv[j] = v; li[j] = id; }
    }
    if (ph_beats(v, id, lv[0], li[0])) { lv[0] = v; li[0] = id; }
}

__device__ __forceinline__ void ut_warp_best(float& bv, int& bid, int& bt) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_down_sync(0xffffffffu, bv, off);
        const int oid = __shfl_down_sync(0xffffffffu, bid, off);
        const int ot = __shfl_down_sync(0xffffffffu, bt, off);
        if (ph_beats(ov, oid, bv, bid)) { bv = ov; bid = oid; bt = ot; }
    }
}

// Merge: grid (n), UT_MERGE_THREADS threads; top-16 of column blockIdx.x's P * 16 partial
// candidates into scores[col * 16 + j], ids[col * 16 + j].
extern "C" __global__ void __launch_bounds__(UT_MERGE_THREADS)
unary_topk_merge(const float* __restrict__ ws, float* __restrict__ scores, int* __restrict__ ids, int P) {
    __shared__ float s_v[UT_K][UT_MERGE_THREADS];
    __shared__ int s_id[UT_K][UT_MERGE_THREADS];
    __shared__ float w_v[UT_MERGE_WARPS];
    __shared__ int w_id[UT_MERGE_WARPS];
    __shared__ int w_t[UT_MERGE_WARPS];
    __shared__ int s_winner;
    const long long col = blockIdx.x;
    const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
    float lv[UT_K];
    int li[UT_K];
#pragma unroll
    for (int j = 0; j < UT_K; ++j) { lv[j] = PH_NEG_INF; li[j] = PH_NO_ID; }
    const float* src = ws + col * P * UT_K * 2;
    for (int k = t; k < P * UT_K; k += UT_MERGE_THREADS)
        ut_push(lv, li, src[2 * k], __float_as_int(src[2 * k + 1]));
#pragma unroll
    for (int j = 0; j < UT_K; ++j) { s_v[j][t] = lv[j]; s_id[j][t] = li[j]; }
    __syncthreads();
    int head = 0;
    for (int r = 0; r < UT_K; ++r) {
        float hv = head < UT_K ? s_v[head][t] : PH_NEG_INF;
        int hid = head < UT_K ? s_id[head][t] : PH_NO_ID;
        int ht = t;
        ut_warp_best(hv, hid, ht);
        if (lane == 0) { w_v[warp] = hv; w_id[warp] = hid; w_t[warp] = ht; }
        __syncthreads();
        if (warp == 0) {
            hv = lane < UT_MERGE_WARPS ? w_v[lane] : PH_NEG_INF;
            hid = lane < UT_MERGE_WARPS ? w_id[lane] : PH_NO_ID;
            ht = lane < UT_MERGE_WARPS ? w_t[lane] : -1;
            ut_warp_best(hv, hid, ht);
            if (lane == 0) {
                scores[col * UT_K + r] = hv;
                ids[col * UT_K + r] = hid;
                s_winner = ht;
            }
        }
        __syncthreads();
        if (t == s_winner) ++head;
    }
}
