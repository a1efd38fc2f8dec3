// unary_topk: the proposal head GEMM fused with a stable per-column top-16 (score
// descending, exact ties to the lower global id); no [n, rows] logits in memory
// (contract: crates/dflash-ops/src/unary_topk/mod.rs).
//
// The launcher compiles kernels/proposal_argmax.cu (the head GEMM driver ph_run, the row ids,
// the partial layout) first and this file after it; only the epilogue and the merge differ.
//
// Epilogue. Each consumer warpgroup keeps, per column, its running top-16 (sorted, best first)
// in shared memory; the 16th entry is the column's threshold. A column's 128 logits of a tile
// are held by 32 threads ("holders": the lanes of its quad position in each of the 4 warps), 4
// each; holder h = 8 * warp + lane / 4 owns slot h of the column's candidate buffer. After a
// tile, passes run until no holder has an unappended logit that beats its column's threshold
// (in the total order; NaN ranks as -inf, and is stored as -inf):
// - every holder reads the thresholds of all its 2 NT columns at once. A warp skips a
//   slot where none of its lanes has a not-yet-appended logit at or above the threshold (one
//   vote: the steady state, and the repeat passes); otherwise every lane, with no branch,
//   finds its best not-yet-appended logit that beats the threshold, writes it to its
//   candidate slot, marks it appended and asks for another pass if a second one beats the
//   threshold too, and a ballot gives the column's occupancy byte of this warp (which of its
//   holders wrote; the column's merging thread clears the occupancy after reading it). The
//   threshold's id is read only where a logit equals its value (ties: zero or duplicate head
//   rows);
// - the candidates are merged into the list: for 64 columns and more by the column's own
//   thread (the list in registers, one compare-and-shift insertion per occupied slot: all
//   columns at once, no shuffles); for fewer columns by one warp per column, by rank (an
//   element's new position is the number of elements of the union that beat it: per
//   candidate one broadcast, compares and a ballot).
// A pass appends at most one logit per holder and column, so the 32 slots never overflow; a
// block's first tile (empty lists, threshold -inf) appends the holders' best ones first. An
// element that failed a threshold can never enter later (thresholds only rise), so the final
// lists are exact. Shared arrays are column-minor ([slot][NC]).
// Merge: one block per column takes the top-16 of the P * 16 partial candidates (a sorted
// list per thread, combined by bitonic top-16 merges: see unary_topk_merge).

#define UT_K 16
#define UT_CAP 32  // candidate slots per column: one per holder (8 lanes x 4 warps)
#define UT_THREAD_MERGE_NC 64  // columns from which each column's thread merges its own list

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

// The 8 bits of `bal` at positions q, q + 4, ..., q + 28, as bits 0..7 (the lanes of quad
// position q in lane order).
__device__ __forceinline__ unsigned ut_quad_bits(unsigned bal, int q) {
    unsigned y = (bal >> q) & 0x11111111u;
    y = (y | (y >> 3)) & 0x03030303u;
    y = (y | (y >> 6)) & 0x000f000fu;
    return (y | (y >> 12)) & 0xffu;
}

template <int NT>
struct PhTopk {
    static constexpr int NC = 8 * NT;
    static_assert(NC <= PH_THREADS, "one merging thread per column");
    static_assert(UT_CAP == 8 * PH_WARPS, "one candidate slot per holder");
    static constexpr int SMEM_BYTES = NC * UT_K * 8 + NC * 4 + NC * UT_CAP * 8;  // mirrored by the launcher
    static constexpr int WG_STAGES = 4;  // sm_90a pipeline depth: two of these states fit beside it
    float* lv;   // [UT_K][NC] running lists, best first
    int* li;
    unsigned* occ;  // [NC] byte w: the holders of warp w that wrote their slot this pass
    float* cv;   // [UT_CAP][NC] slot h: holder h's candidate of this pass
    int* ci;
    PhRows rw;
    float* ws;
    int n;
    __device__ __forceinline__ PhTopk(unsigned char* epi_smem, PhRows rows_, float* ws_, int n_)
        : rw(rows_), ws(ws_), n(n_) {
        lv = reinterpret_cast<float*>(epi_smem);
        li = reinterpret_cast<int*>(lv + NC * UT_K);
        occ = reinterpret_cast<unsigned*>(li + NC * UT_K);
        cv = reinterpret_cast<float*>(occ + NC);
        ci = reinterpret_cast<int*>(cv + NC * UT_CAP);
    }
    __device__ __forceinline__ void init() {
        for (int e = ph_tid(); e < NC * UT_K; e += PH_THREADS) { lv[e] = PH_NEG_INF; li[e] = PH_NO_ID; }
        for (int c = ph_tid(); c < NC; c += PH_THREADS) occ[c] = 0u;
    }

    // Thread c: push the candidates of column c's occupied slots into its list (their order
    // does not matter: the result is the top-16 of the union, and the order is total).
    __device__ __forceinline__ void insert_own() {
        const int c = ph_tid();
        if (c >= NC) return;
        unsigned m = occ[c];
        if (m == 0u) return;
        occ[c] = 0u;  // the next pass's holders set only the bytes of the slots they enter
        float v[UT_K];
        int id[UT_K];
#pragma unroll
        for (int j = 0; j < UT_K; ++j) { v[j] = lv[j * NC + c]; id[j] = li[j * NC + c]; }
        for (; m != 0u; m &= m - 1u) {
            const int k = __ffs(m) - 1;
            ut_push(v, id, cv[k * NC + c], ci[k * NC + c]);
        }
#pragma unroll
        for (int j = 0; j < UT_K; ++j) { lv[j * NC + c] = v[j]; li[j * NC + c] = id[j]; }
    }

    // One warp: merge the candidates of column c's occupied slots `m` (lane k holds slot k)
    // into its list (lane j < 16 holds entry j) by rank: an element's new position is the
    // number of elements of the union that beat it (the order is total and the ids are
    // distinct, so the ranks of the valid elements are distinct, and the empty entries (-inf,
    // no id) follow them in order); those ranked below 16 are written to their slot. One step
    // per candidate k: broadcast it, count it against every list entry and candidate, and
    // count the list entries that beat it with a ballot (no chain through the list).
    __device__ __forceinline__ void insert_warp(int c, unsigned m) {
        const int lane = ph_tid() & 31;
        const bool mine = (m >> lane) & 1u;
        const float x = mine ? cv[lane * NC + c] : PH_NEG_INF;
        const int xi = mine ? ci[lane * NC + c] : PH_NO_ID;
        const float mv = lane < UT_K ? lv[lane * NC + c] : PH_NEG_INF;
        const int mi = lane < UT_K ? li[lane * NC + c] : PH_NO_ID;
        int rank_x = 0, rank_m = lane;
        for (unsigned r = m; r != 0u; r &= r - 1u) {  // m is warp-uniform
            const int k = __ffs(r) - 1;
            const float ov = __shfl_sync(0xffffffffu, x, k);
            const int oi = __shfl_sync(0xffffffffu, xi, k);
            rank_m += ph_beats(ov, oi, mv, mi) ? 1 : 0;
            rank_x += ph_beats(ov, oi, x, xi) ? 1 : 0;
            const unsigned above = __ballot_sync(0xffffffffu, lane < UT_K && ph_beats(mv, mi, ov, oi));
            if (lane == k) rank_x += __popc(above);
        }
        __syncwarp();  // every lane has read its entry before any slot is rewritten
        if (lane < UT_K && rank_m < UT_K) { lv[rank_m * NC + c] = mv; li[rank_m * NC + c] = mi; }
        if (mine && rank_x < UT_K) { lv[rank_x * NC + c] = x; li[rank_x * NC + c] = xi; }
        if (lane == 0) occ[c] = 0u;  // as in insert_own
        __syncwarp();
    }

    __device__ __forceinline__ void tile(const float (&acc)[2][NT][4], long long r0, long long row_end) {
        const int lane = ph_tid() & 31, warp = ph_tid() >> 5;
        const int q = lane & 3;
        const int h = 8 * warp + (lane >> 2);  // this thread's candidate slot (holder index)
        unsigned char* occ_b = reinterpret_cast<unsigned char*>(occ);
        // Element k = 2 * mt + hh of a column: row ph_row(r0, mt, hh), logit acc[mt][nt][2hh + e].
        int ids[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) ids[k] = rw.id(ph_row(r0, k >> 1, k & 1), row_end);
        // Bit 4 * (2 * nt + e) + k (of word nt / 4): appended already (or not a candidate).
        unsigned done[(NT + 3) / 4];
        unsigned none = 0u;
#pragma unroll
        for (int k = 0; k < 4; ++k) none |= ids[k] == PH_NO_ID ? 1u << k : 0u;
#pragma unroll
        for (int w = 0; w < (NT + 3) / 4; ++w) done[w] = none * 0x11111111u;
        for (;;) {
            // Every slot's threshold value first (no store in between: the loads issue together).
            float tvs[2 * NT];
#pragma unroll
            for (int j = 0; j < 2 * NT; ++j) tvs[j] = lv[(UT_K - 1) * NC + (j >> 1) * 8 + 2 * q + (j & 1)];
            int more = 0;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int c = nt * 8 + 2 * q + e;
                    const int sh = 4 * (2 * (nt & 3) + e);
                    const float tv = tvs[2 * nt + e];
                    const unsigned d = done[nt >> 2] >> sh;
                    // NaN ranks as -inf (fmaxf returns the other operand); appended logits
                    // count as -inf for the warp's test whether the slot has any candidate.
                    float x[4];
                    float mx = PH_NEG_INF;
#pragma unroll
                    for (int k = 0; k < 4; ++k) {
                        x[k] = fmaxf(acc[k >> 1][nt][2 * (k & 1) + e], PH_NEG_INF);
                        mx = fmaxf(mx, (d >> k) & 1u ? PH_NEG_INF : x[k]);
                    }
                    // Nothing of this warp's holders can beat the thresholds (a tie needs
                    // equality; an empty list's (-inf, no id) is beaten by every real row, so
                    // mx >= tv holds there): the slot is skipped, its occupancy stays 0.
                    if (!__any_sync(0xffffffffu, mx >= tv)) continue;
                    bool tie = false;
#pragma unroll
                    for (int k = 0; k < 4; ++k) tie |= !((d >> k) & 1u) && x[k] == tv;
                    // The threshold's id matters only for a logit equal to its value.
                    const int ti = tie ? li[(UT_K - 1) * NC + c] : PH_NO_ID;
                    unsigned win = 0u;
#pragma unroll
                    for (int k = 0; k < 4; ++k)
                        win |= (!((d >> k) & 1u) && ph_beats(x[k], ids[k], tv, ti)) ? 1u << k : 0u;
                    // The best winner: every winner has a real id, so it beats (-inf, no id).
                    float bv = PH_NEG_INF;
                    int bi = PH_NO_ID, best = 0;
#pragma unroll
                    for (int k = 0; k < 4; ++k)
                        if (((win >> k) & 1u) && ph_beats(x[k], ids[k], bv, bi)) { bv = x[k]; bi = ids[k]; best = k; }
                    const bool has = win != 0u;
                    more |= (win & (win - 1u)) != 0u ? 1 : 0;  // a second winner: another pass
                    // Written unconditionally (no branch): a slot is read only where its
                    // occupancy bit is set.
                    cv[h * NC + c] = bv;
                    ci[h * NC + c] = bi;
                    done[nt >> 2] |= has ? 1u << (sh + best) : 0u;
                    // The 8 lanes of quad position q write the same byte (column c, warp).
                    const unsigned bal = __ballot_sync(0xffffffffu, has);
                    occ_b[c * 4 + warp] = (unsigned char)ut_quad_bits(bal, q);
                }
            PH_SYNC();
            if (NC >= UT_THREAD_MERGE_NC) {
                insert_own();
            } else {
                for (int c = warp; c < NC; c += PH_WARPS) {
                    const unsigned m = occ[c];
                    if (m != 0u) insert_warp(c, m);
                }
            }
            if (!PH_SYNC_OR(more)) break;
        }
    }

    __device__ __forceinline__ void finish() {
        const int P = gridDim.x * PH_CONSUMERS;
        const int b = blockIdx.x * PH_CONSUMERS + ph_wg();
        for (int e = ph_tid(); e < NC * UT_K; e += PH_THREADS) {
            const int c = e / UT_K, j = e % UT_K;
            const long long col = (long long)blockIdx.y * NC + c;
            if (col >= n) continue;
            float* o = ws + ((col * P + b) * UT_K + j) * 2;
            o[0] = lv[j * NC + c];
            o[1] = __int_as_float(li[j * NC + c]);
        }
    }
};

#define PH_TOPK_ENTRY(NT) PH_ENTRY(unary_topk, PhTopk, NT)
PH_TOPK_ENTRY(1)
PH_TOPK_ENTRY(2)
PH_TOPK_ENTRY(4)
PH_TOPK_ENTRY(8)
PH_TOPK_ENTRY(16)

// Merge. One block per column, T = 32 * ceil(P / 32) threads (at most UT_MERGE_MAX_THREADS,
// then a thread takes lists t, t + T, ...): thread t loads partial list t (16 entries, best
// first) and folds any further list of its own into it with ut_merge16; the lanes of a warp
// then combine their lists in 5 butterfly levels (at level k a lane takes its partner's list,
// lane ^ 2^k, by shuffles and both keep the top 16 of the two: the same list, the order being
// total), and warp 0 combines the warps' lists (through shared memory) the same way. Every
// step keeps the exact top 16 of the lists it has seen, so the result is the column's top 16
// best first; empty entries (-inf, no id) fill a column with fewer candidates. The partial
// lists never hold NaN (the epilogue ranks NaN as -inf and never stores it).
#define UT_MERGE_MAX_THREADS 512
#define UT_MERGE_WARPS_MAX (UT_MERGE_MAX_THREADS / 32)

// a := the top 16 of a and b (both sorted best first), sorted best first: c[j] = the better
// of a[j] and b[15 - j] holds the 16 best of the union (a descending against b ascending) as a
// bitonic sequence, which four half-cleaner stages sort (compare-exchange, better first).
__device__ __forceinline__ void ut_merge16(float (&av)[UT_K], int (&ai)[UT_K], const float (&bv)[UT_K],
                                           const int (&bi)[UT_K]) {
#pragma unroll
    for (int j = 0; j < UT_K; ++j) {
        if (ph_beats(bv[UT_K - 1 - j], bi[UT_K - 1 - j], av[j], ai[j])) {
            av[j] = bv[UT_K - 1 - j];
            ai[j] = bi[UT_K - 1 - j];
        }
    }
#pragma unroll
    for (int stride = UT_K / 2; stride > 0; stride >>= 1) {
#pragma unroll
        for (int j = 0; j < UT_K; ++j) {
            if (j & stride) continue;
            if (ph_beats(av[j + stride], ai[j + stride], av[j], ai[j])) {
                const float tv = av[j];
                const int ti = ai[j];
                av[j] = av[j + stride];
                ai[j] = ai[j + stride];
                av[j + stride] = tv;
                ai[j + stride] = ti;
            }
        }
    }
}

// Lanes of a warp: each ends with the top 16 of all 32 lanes' lists.
__device__ __forceinline__ void ut_warp_merge(float (&v)[UT_K], int (&id)[UT_K]) {
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        float ov[UT_K];
        int oi[UT_K];
#pragma unroll
        for (int j = 0; j < UT_K; ++j) {
            ov[j] = __shfl_xor_sync(0xffffffffu, v[j], off);
            oi[j] = __shfl_xor_sync(0xffffffffu, id[j], off);
        }
        ut_merge16(v, id, ov, oi);
    }
}

// Load partial list `src` (16 (value, id bits) pairs, 128-byte aligned) into registers.
__device__ __forceinline__ void ut_load_list(const float* __restrict__ src, float (&v)[UT_K], int (&id)[UT_K]) {
#pragma unroll
    for (int q = 0; q < UT_K / 2; ++q) {
        const float4 x = reinterpret_cast<const float4*>(src)[q];
        v[2 * q] = x.x;
        id[2 * q] = __float_as_int(x.y);
        v[2 * q + 1] = x.z;
        id[2 * q + 1] = __float_as_int(x.w);
    }
}

// grid (n), T threads as above; top-16 of column blockIdx.x's P * 16 partial candidates into
// scores[col * 16 + j], ids[col * 16 + j].
extern "C" __global__ void __launch_bounds__(UT_MERGE_MAX_THREADS)
unary_topk_merge(const float* __restrict__ ws, float* __restrict__ scores, int* __restrict__ ids, int P) {
    __shared__ float w_v[UT_MERGE_WARPS_MAX][UT_K];
    __shared__ int w_id[UT_MERGE_WARPS_MAX][UT_K];
    const long long col = blockIdx.x;
    const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
    const int warps = (int)(blockDim.x >> 5);
    const float* src = ws + col * P * UT_K * 2;
    float v[UT_K];
    int id[UT_K];
#pragma unroll
    for (int j = 0; j < UT_K; ++j) { v[j] = PH_NEG_INF; id[j] = PH_NO_ID; }
    if (t < P) ut_load_list(src + (long long)t * UT_K * 2, v, id);
    for (int b = t + (int)blockDim.x; b < P; b += (int)blockDim.x) {
        float bv[UT_K];
        int bi[UT_K];
        ut_load_list(src + (long long)b * UT_K * 2, bv, bi);
        ut_merge16(v, id, bv, bi);
    }
    ut_warp_merge(v, id);
    if (lane == 0) {
#pragma unroll
        for (int j = 0; j < UT_K; ++j) { w_v[warp][j] = v[j]; w_id[warp][j] = id[j]; }
    }
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int j = 0; j < UT_K; ++j) {
        v[j] = lane < warps ? w_v[lane][j] : PH_NEG_INF;
        id[j] = lane < warps ? w_id[lane][j] : PH_NO_ID;
    }
    ut_warp_merge(v, id);
    // Lane j writes entry j (a compile-time register index per lane: one select each).
    float ov = PH_NEG_INF;
    int oi = PH_NO_ID;
#pragma unroll
    for (int j = 0; j < UT_K; ++j) {
        if (lane == j) { ov = v[j]; oi = id[j]; }
    }
    if (lane < UT_K) {
        scores[col * UT_K + lane] = ov;
        ids[col * UT_K + lane] = oi;
    }
}
