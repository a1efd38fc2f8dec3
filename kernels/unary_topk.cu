// unary_topk: the proposal head GEMM fused with a stable per-column top-16 (score
// descending, exact ties to the lower global id); no [n, rows] logits in memory
// (contract: crates/dflash-ops/src/unary_topk/mod.rs).
//
// The launcher compiles kernels/proposal_argmax.cu (the head GEMM driver ph_run, the row ids,
// the partial layout) first and this file after it; only the epilogue and the merge differ.
//
// Epilogue. Each block keeps, per column, its running top-16 (sorted, best first) in shared
// memory; the 16th entry is the column's threshold. After a tile every thread tests its own
// accumulator elements against their column's threshold; only those that beat it (in the
// total order) are appended to the column's candidate buffer (UT_CAP slots, a shared-memory
// atomic per append), and one warp per column with candidates merges them into its list by
// rank (see `insert`). When a buffer overflows (the first tiles of a
// block, whose lists are still empty), the pass repeats over the elements not yet appended,
// against the raised thresholds; an element that failed a threshold can never enter later
// (thresholds only rise), so the final lists are exact. In the steady state a tile costs one
// compare per logit and a few insertions per column.
// Merge: one block per column takes the top-16 of the P * 16 partial candidates (a sorted
// list per thread, then 16 rounds of a block-wide argmax over the list heads).

#define UT_K 16
#define UT_CAP 32  // candidate slots per column and pass (one per lane of the inserting warp)

template <int NT>
struct PhTopk {
    static constexpr int NC = 8 * NT;
    static constexpr int SMEM_BYTES = NC * UT_K * 8 + NC * 4 + NC * UT_CAP * 8;  // mirrored by the launcher
    float* lv;   // [NC][UT_K] running lists, best first
    int* li;
    int* cnt;    // [NC] candidates appended this pass (may exceed UT_CAP: overflow)
    float* cv;   // [NC][UT_CAP]
    int* ci;
    PhRows rw;
    float* ws;
    int n;
    __device__ __forceinline__ PhTopk(unsigned char* epi_smem, PhRows rows_, float* ws_, int n_)
        : rw(rows_), ws(ws_), n(n_) {
        lv = reinterpret_cast<float*>(epi_smem);
        li = reinterpret_cast<int*>(lv + NC * UT_K);
        cnt = li + NC * UT_K;
        cv = reinterpret_cast<float*>(cnt + NC);
        ci = reinterpret_cast<int*>(cv + NC * UT_CAP);
    }
    __device__ __forceinline__ void init() {
        for (int e = threadIdx.x; e < NC * UT_K; e += PH_THREADS) { lv[e] = PH_NEG_INF; li[e] = PH_NO_ID; }
        for (int c = threadIdx.x; c < NC; c += PH_THREADS) cnt[c] = 0;
    }

    // One warp: merge the m candidates of column c (lane k < m holds candidate k) into its
    // list (lane j < 16 holds entry j) by rank: an element's new position is the number of
    // elements of the union that beat it (the order is total and the ids are distinct, so the
    // ranks of the valid elements are distinct, and the empty entries (-inf, no id) follow
    // them in order); those ranked below 16 are written to their slot. One step per
    // candidate k: broadcast it, count it against every list entry and candidate, and count
    // the list entries that beat it with a ballot (no chain through the list). Then empty the
    // buffer.
    __device__ __forceinline__ void insert(int c) {
        const int lane = threadIdx.x & 31;
        const int m = min(cnt[c], UT_CAP);
        const float x = lane < m ? cv[c * UT_CAP + lane] : PH_NEG_INF;
        const int xi = lane < m ? ci[c * UT_CAP + lane] : PH_NO_ID;
        const float mv = lane < UT_K ? lv[c * UT_K + lane] : PH_NEG_INF;
        const int mi = lane < UT_K ? li[c * UT_K + lane] : PH_NO_ID;
        int rank_x = 0, rank_m = lane;
        for (int k = 0; k < m; ++k) {  // m is warp-uniform
            const float ov = __shfl_sync(0xffffffffu, x, k);
            const int oi = __shfl_sync(0xffffffffu, xi, k);
            rank_m += ph_beats(ov, oi, mv, mi) ? 1 : 0;
            rank_x += ph_beats(ov, oi, x, xi) ? 1 : 0;
            const unsigned above = __ballot_sync(0xffffffffu, lane < UT_K && ph_beats(mv, mi, ov, oi));
            if (lane == k) rank_x += __popc(above);
        }
        __syncwarp();  // every lane has read its entry before any slot is rewritten
        if (lane < UT_K && rank_m < UT_K) { lv[c * UT_K + rank_m] = mv; li[c * UT_K + rank_m] = mi; }
        if (lane < m && rank_x < UT_K) { lv[c * UT_K + rank_x] = x; li[c * UT_K + rank_x] = xi; }
        __syncwarp();
        if (lane == 0) cnt[c] = 0;
    }

    __device__ __forceinline__ void tile(const float (&acc)[2][NT][4], long long r0, long long row_end) {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
        int ids[2][2];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) ids[mt][h] = rw.id(ph_row(r0, mt, h), row_end);
        // Bit (nt, e, mt, h) = 8 * nt + 4 * e + 2 * mt + h: appended already (or not a candidate).
        unsigned done[(NT + 3) / 4];
#pragma unroll
        for (int w = 0; w < (NT + 3) / 4; ++w) done[w] = 0u;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e)
#pragma unroll
                for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        if (ids[mt][h] == PH_NO_ID) done[nt >> 2] |= 1u << ((nt & 3) * 8 + 4 * e + 2 * mt + h);
        for (;;) {
            int over = 0;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int c = nt * 8 + 2 * (lane & 3) + e;
                    const float tv = lv[c * UT_K + UT_K - 1];
                    const int ti = li[c * UT_K + UT_K - 1];
#pragma unroll
                    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const unsigned bit = 1u << ((nt & 3) * 8 + 4 * e + 2 * mt + h);
                            if (done[nt >> 2] & bit) continue;
                            float x = acc[mt][nt][2 * h + e];
                            if (x != x) x = PH_NEG_INF;  // NaN ranks as -inf
                            const int xi = ids[mt][h];
                            if (!ph_beats(x, xi, tv, ti)) continue;
                            const int slot = atomicAdd(&cnt[c], 1);
                            if (slot < UT_CAP) {
                                cv[c * UT_CAP + slot] = x;
                                ci[c * UT_CAP + slot] = xi;
                                done[nt >> 2] |= bit;
                            } else {
                                over = 1;
                            }
                        }
                }
            PH_SYNC();
            for (int c = warp; c < NC; c += PH_WARPS)
                if (cnt[c] > 0) insert(c);
            if (!PH_SYNC_OR(over)) break;
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

#define PH_TOPK_ENTRY(NT) PH_ENTRY(unary_topk, PhTopk, NT)
#ifndef PH_WGMMA
PH_TOPK_ENTRY(1)
PH_TOPK_ENTRY(2)
PH_TOPK_ENTRY(4)
#endif
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
