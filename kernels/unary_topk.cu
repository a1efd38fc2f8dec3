// unary_topk: the proposal head GEMM fused with a stable per-column top-16 (score
// descending, exact ties to the lower global id); no [n, rows] logits in memory
// (contract: crates/dflash-ops/src/unary_topk/mod.rs).
//
// The launcher compiles kernels/proposal_argmax.cu (the head GEMM driver ph_run, the row ids,
// the partial layout) first and this file after it; only the epilogue and the merge differ.
//
// Epilogue. Each block keeps, per column, its running top-16 (sorted, best first) in shared
// memory; the 16th entry is the column's threshold. A column's 128 logits of a tile are held
// by 32 threads ("holders": the lanes of its quad position in each of the 4 warps), 4 each.
// After a tile, passes run until no holder has an unappended logit that beats its column's
// threshold (in the total order):
// - a holder first skips the column when the max of its 4 logits is below a threshold that
//   is not -inf (one compare: the steady state), or equals it while none of its ids is below
//   the threshold's (ties: zero or duplicate head rows);
// - while the column's list still has empty entries (threshold -inf: a block's first tile),
//   it appends only its best not-yet-appended logit that beats the threshold and asks for
//   another pass if a second one beats it too, so such a pass appends the best ones first
//   and at most 32 (one per holder);
// - once the list is full, it appends every not-yet-appended logit that beats the threshold
//   at once: one shared-memory atomic reserves their consecutive slots of the column's
//   candidate buffer; those whose slot is past its UT_CAP entries stay unappended and ask for
//   another pass. In the steady state one pass takes a tile's few winners;
// - the candidates are merged into the list: for 64 columns and more by the column's own
//   thread (the list in registers, one compare-and-shift insertion per candidate: all
//   columns at once, no shuffles); for fewer columns by one warp per column, by rank (an
//   element's new position is the number of elements of the union that beat it: per
//   candidate one broadcast, compares and a ballot).
// An element that failed a threshold can never enter later (thresholds only rise), so the
// final lists are exact. Shared arrays are column-minor ([slot][NC]).
// Merge: one block per column takes the top-16 of the P * 16 partial candidates (a sorted
// list per thread, combined by bitonic top-16 merges: see unary_topk_merge).

#define UT_K 16
#define UT_CAP 32  // candidate slots per column and pass (one per holder while the list is not full)
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

template <int NT>
struct PhTopk {
    static constexpr int NC = 8 * NT;
    static_assert(NC <= PH_THREADS, "one merging thread per column");
    static constexpr int SMEM_BYTES = NC * UT_K * 8 + NC * 4 + NC * UT_CAP * 8;  // mirrored by the launcher
    static constexpr int WG_STAGES = 4;  // sm_90a pipeline depth: two of these states fit beside it
    float* lv;   // [UT_K][NC] running lists, best first
    int* li;
    int* cnt;    // [NC] candidates appended this pass (may exceed UT_CAP: overflow)
    float* cv;   // [UT_CAP][NC]
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
        for (int e = ph_tid(); e < NC * UT_K; e += PH_THREADS) { lv[e] = PH_NEG_INF; li[e] = PH_NO_ID; }
        for (int c = ph_tid(); c < NC; c += PH_THREADS) cnt[c] = 0;
    }

    // Thread c: push column c's buffered candidates into its list (their order does not
    // matter: the result is the top-16 of the union, and the order is total), then empty the
    // buffer.
    __device__ __forceinline__ void insert_own() {
        const int c = ph_tid();
        if (c >= NC) return;
        const int m = min(cnt[c], UT_CAP);
        if (m == 0) return;
        float v[UT_K];
        int id[UT_K];
#pragma unroll
        for (int j = 0; j < UT_K; ++j) { v[j] = lv[j * NC + c]; id[j] = li[j * NC + c]; }
        for (int k = 0; k < m; ++k) ut_push(v, id, cv[k * NC + c], ci[k * NC + c]);
#pragma unroll
        for (int j = 0; j < UT_K; ++j) { lv[j * NC + c] = v[j]; li[j * NC + c] = id[j]; }
        cnt[c] = 0;
    }

    // One warp: merge the m candidates of column c (lane k < m holds candidate k) into its
    // list (lane j < 16 holds entry j) by rank: an element's new position is the number of
    // elements of the union that beat it (the order is total and the ids are distinct, so the
    // ranks of the valid elements are distinct, and the empty entries (-inf, no id) follow
    // them in order); those ranked below 16 are written to their slot. One step per
    // candidate k: broadcast it, count it against every list entry and candidate, and count
    // the list entries that beat it with a ballot (no chain through the list). Then empty the
    // buffer.
    __device__ __forceinline__ void insert_warp(int c) {
        const int lane = ph_tid() & 31;
        const int m = min(cnt[c], UT_CAP);
        const float x = lane < m ? cv[lane * NC + c] : PH_NEG_INF;
        const int xi = lane < m ? ci[lane * NC + c] : PH_NO_ID;
        const float mv = lane < UT_K ? lv[lane * NC + c] : PH_NEG_INF;
        const int mi = lane < UT_K ? li[lane * NC + c] : PH_NO_ID;
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
        if (lane < UT_K && rank_m < UT_K) { lv[rank_m * NC + c] = mv; li[rank_m * NC + c] = mi; }
        if (lane < m && rank_x < UT_K) { lv[rank_x * NC + c] = x; li[rank_x * NC + c] = xi; }
        __syncwarp();
        if (lane == 0) cnt[c] = 0;
    }

    __device__ __forceinline__ void tile(const float (&acc)[2][NT][4], long long r0, long long row_end) {
        const int lane = ph_tid() & 31, warp = ph_tid() >> 5;
        // Element k = 2 * mt + h of a column: row ph_row(r0, mt, h), logit acc[mt][nt][2h + e].
        int ids[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) ids[k] = rw.id(ph_row(r0, k >> 1, k & 1), row_end);
        const int id_min = min(min(ids[0], ids[1]), min(ids[2], ids[3]));
        // Bit 4 * (2 * nt + e) + k (of word nt / 4): appended already (or not a candidate).
        unsigned done[(NT + 3) / 4];
        unsigned none = 0u;
#pragma unroll
        for (int k = 0; k < 4; ++k) none |= ids[k] == PH_NO_ID ? 1u << k : 0u;
#pragma unroll
        for (int w = 0; w < (NT + 3) / 4; ++w) done[w] = none * 0x11111111u;
        for (;;) {
            int more = 0;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int c = nt * 8 + 2 * (lane & 3) + e;
                    const int sh = 4 * (2 * (nt & 3) + e);
                    const float tv = lv[(UT_K - 1) * NC + c];
                    float x[4];
#pragma unroll
                    for (int k = 0; k < 4; ++k) x[k] = acc[k >> 1][nt][2 * (k & 1) + e];
                    // Nothing here can beat a full list's 16th entry (fmaxf ignores NaN, which
                    // ranks as -inf and so cannot either).
                    const float mx = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
                    if (tv != PH_NEG_INF && !(mx >= tv)) continue;
                    const int ti = li[(UT_K - 1) * NC + c];
                    // A logit equal to the threshold beats it only with a lower id: a holder
                    // whose max ties and whose ids are all at or above the threshold's has
                    // nothing to append (zero or duplicate head rows give such ties).
                    if (tv != PH_NEG_INF && mx == tv && id_min >= ti) continue;
                    const unsigned d = done[nt >> 2] >> sh;
                    if (tv != PH_NEG_INF) {  // a full list: every winner at once
                        // (NaN beats no threshold that is not -inf: it needs no mapping here.)
                        unsigned win = 0u;
#pragma unroll
                        for (int k = 0; k < 4; ++k)
                            win |= (!((d >> k) & 1u) && ph_beats(x[k], ids[k], tv, ti)) ? 1u << k : 0u;
                        if (win == 0u) continue;
                        int slot = atomicAdd(&cnt[c], __popc(win));  // may pass UT_CAP: overflow
#pragma unroll
                        for (int k = 0; k < 4; ++k) {
                            if (!((win >> k) & 1u)) continue;
                            if (slot < UT_CAP) {
                                cv[slot * NC + c] = x[k];
                                ci[slot * NC + c] = ids[k];
                                done[nt >> 2] |= 1u << (sh + k);
                            } else {
                                more = 1;  // stays unappended: the next pass, at a higher threshold
                            }
                            ++slot;
                        }
                        continue;
                    }
                    int best = -1, passing = 0;
                    float bv = PH_NEG_INF;
                    int bi = PH_NO_ID;
#pragma unroll
                    for (int k = 0; k < 4; ++k) {
                        float v = x[k];
                        if (v != v) v = PH_NEG_INF;  // NaN ranks as -inf
                        if ((d >> k) & 1u || !ph_beats(v, ids[k], tv, ti)) continue;
                        ++passing;
                        if (best < 0 || ph_beats(v, ids[k], bv, bi)) { best = k; bv = v; bi = ids[k]; }
                    }
                    if (best < 0) continue;
                    const int slot = atomicAdd(&cnt[c], 1);  // < UT_CAP: one append per holder
                    if (slot < UT_CAP) {
                        cv[slot * NC + c] = bv;
                        ci[slot * NC + c] = bi;
                        done[nt >> 2] |= 1u << (sh + best);
                        --passing;
                    }
                    more |= passing;
                }
            PH_SYNC();
            if (NC >= UT_THREAD_MERGE_NC) {
                insert_own();
            } else {
                for (int c = warp; c < NC; c += PH_WARPS)
                    if (cnt[c] > 0) insert_warp(c);
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
