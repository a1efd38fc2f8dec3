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
// The padding columns of the last column chunk (past n) take no part: their logits are all
// zero and would tie. Each tile first raises the lists to their columns' shared floors, the
// best 16th value any warpgroup's list has reached (see ut_key), so that a warpgroup's
// threshold follows the best rows seen by all of them, not only its own.
// Before the passes of a tile, a list that still has empty entries (a warpgroup's first tile)
// gets a floor from the tile itself: the 16th largest of the 32 holders' best logits, below
// which no logit of the column can end in its top 16; the list's entries below it become the
// floor, so the list is full at that threshold (see fill_floor). Then passes run until no
// holder has an unappended logit that beats its column's threshold (in the total order):
// - a holder first skips the column when the max of its 4 logits is below a threshold that
//   is not -inf (one compare: the steady state), or equals it while none of its ids is below
//   the threshold's (ties: zero or duplicate head rows);
// - while the column's list still has empty entries (threshold -inf: a first tile with fewer
//   than 16 holders of candidates, whose floor is -inf), it appends only its best
//   not-yet-appended logit that beats the threshold and asks for another pass if a second
//   one beats it too, so such a pass appends the best ones first and at most 32 (one per
//   holder);
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
// final lists are exact (as candidates and floor entries (f, PH_NO_ID): see ut_key). Shared
// arrays are column-minor ([slot][NC]).
// Merge: one block per column takes the top-16 of the P * 16 partial candidates (the lists
// held one entry a lane, combined by bitonic merges across the lanes of a warp: see
// unary_topk_merge).

#define UT_K 16
#define UT_CAP 32  // candidate slots per column and pass (one per holder while the list is not full)
#define UT_THREAD_MERGE_NC 64  // columns from which each column's thread merges its own list

// Insert (v, id) into the sorted (best first) register list if it beats the last entry: one
// compare per entry (whether (v, id) beats entry j - 1; the compare with entry j is the
// previous step's), entries shifted down from the insertion point.
__device__ __forceinline__ void ut_push(float (&lv)[UT_K], int (&li)[UT_K], float v, int id) {
    if (!ph_beats(v, id, lv[UT_K - 1], li[UT_K - 1])) return;
    bool cur = true;  // (v, id) beats entry j (old value): known for j = UT_K - 1
#pragma unroll
    for (int j = UT_K - 1; j > 0; --j) {
        // lv[j - 1] and lv[j] still hold their old values here (descending j).
        const bool prev = ph_beats(v, id, lv[j - 1], li[j - 1]);
        if (prev) { lv[j] = lv[j - 1]; li[j] = li[j - 1]; }
        else if (cur) { lv[j] = v; li[j] = id; }
        cur = prev;
    }
    if (cur) { lv[0] = v; li[0] = id; }
}

// The 16th largest of 32 values (bitonic sort, descending; -inf sorts last; no NaN).
__device__ __forceinline__ float ut_sixteenth(float (&h)[32]) {
#pragma unroll
    for (int k = 2; k <= 32; k <<= 1)
#pragma unroll
        for (int j = k >> 1; j > 0; j >>= 1)
#pragma unroll
            for (int i = 0; i < 32; ++i) {
                const int l = i ^ j;
                if (l <= i) continue;
                const float a = h[i], b = h[l];
                const bool desc = (i & k) == 0;
                h[i] = desc ? fmaxf(a, b) : fminf(a, b);
                h[l] = desc ? fminf(a, b) : fmaxf(a, b);
            }
    return h[UT_K - 1];
}

// A column's shared floor. Every warpgroup publishes, per column, the value of its list's
// 16th entry (atomicMax of ut_key) once the list is full; a value v published there is backed
// by 16 distinct candidates scoring at least v (a list's entries are candidates, or floor
// entries (f, PH_NO_ID) whose f is itself so backed: see fill_floor), so no candidate below
// the largest published value can be in the column's top 16. Each tile, a warpgroup first
// raises its lists to the floor g it last loaded (raise_to, as fill_floor does): every entry that
// does not beat (g, PH_NO_ID) becomes (g, PH_NO_ID). Its threshold is then at least g, and
// it appends only the tile's candidates at or above the best floor of all warpgroups (without
// it, each warpgroup's threshold rises only with its own rows). A candidate of the top 16
// scores at least g and beats (g, PH_NO_ID), so it is never dropped; the floor entries never
// reach the merged result, which has 16 candidates beating them. Any value once published
// stays valid, so a floor loaded a tile earlier (off the critical path) is as exact.
// Keys: an order-preserving map of the float to an unsigned, 0 (the workspace as the launcher
// zeroes it) meaning no floor.
__device__ __forceinline__ unsigned ut_key(float v) {
    const unsigned b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float ut_unkey(unsigned k) {
    if (k == 0u) return PH_NEG_INF;
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
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
    // The columns of this block's chunk that exist (the last chunk's others are padding: their
    // logits are zeros, which would all tie; no list is kept for them).
    int live;
    bool full = false;  // every list of this warpgroup is full (lists never empty again)
    unsigned* gf;       // [n] the columns' shared floor keys (ut_key), after the partials
    unsigned g_next = 0u;  // thread c: column c's floor key for the next tile
    __device__ __forceinline__ PhTopk(unsigned char* epi_smem, PhRows rows_, float* ws_, int n_)
        : rw(rows_), ws(ws_), n(n_), live(min(NC, n_ - (int)blockIdx.y * NC)),
          gf(reinterpret_cast<unsigned*>(ws_ + (long long)n_ * PH_MAX_PARTIALS * UT_K * 2) + blockIdx.y * NC) {
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

    // Thread c < live: raise column c's list to the floor g (its entries that do not beat
    // (g, PH_NO_ID) become that; the list is sorted, so they are its last ones).
    __device__ __forceinline__ void raise_to(int c, float g) {
        if (g == PH_NEG_INF || !ph_beats(g, PH_NO_ID, lv[(UT_K - 1) * NC + c], li[(UT_K - 1) * NC + c])) return;
#pragma unroll
        for (int j = 0; j < UT_K; ++j) {
            if (!ph_beats(lv[j * NC + c], li[j * NC + c], g, PH_NO_ID)) {
                lv[j * NC + c] = g;
                li[j * NC + c] = PH_NO_ID;
            }
        }
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

    // The floor of a tile for the lists with empty entries (a warpgroup's first tile): each
    // holder's best candidate logit of each column (NaN and non-candidate rows left out) goes
    // to the candidate buffer, which is free between tiles ([holder][NC]: 32 x NC); the
    // column's thread takes f, the 16th largest of the 32. When f > -inf, 16 distinct
    // candidates of this tile (one per holder) score at least f, so no candidate below f can
    // end in the top 16: every entry of the list that does not beat (f, PH_NO_ID) becomes
    // (f, PH_NO_ID), which ranks after every candidate scoring f. The list is then full at
    // threshold f, and the tile's passes take the full-list path: one pass appends the few
    // candidates at or above f at once (about 20 of the 128 for spread logits), instead of
    // filling the list one holder's best at a time; those 16 candidates push every (f,
    // PH_NO_ID) out, so none is ever written. f = -inf (fewer than 16 holders with a finite
    // candidate) leaves the list as it is.
    __device__ __forceinline__ void fill_floor(const float (&acc)[2][NT][4], const int (&ids)[4]) {
        const int lane = ph_tid() & 31, warp = ph_tid() >> 5;
        const int holder = warp * 8 + (lane >> 2);
        static_assert(UT_CAP == 32 && PH_WARPS * 8 == 32, "the buffer holds one word per holder");
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                float m = PH_NEG_INF;
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const float x = acc[k >> 1][nt][2 * (k & 1) + e];
                    if (ids[k] != PH_NO_ID && x > m) m = x;  // NaN never passes
                }
                cv[holder * NC + nt * 8 + 2 * (lane & 3) + e] = m;
            }
        PH_SYNC();
        const int c = ph_tid();
        if (c < live && lv[(UT_K - 1) * NC + c] == PH_NEG_INF) {
            float h[32];
#pragma unroll
            for (int k = 0; k < 32; ++k) h[k] = cv[k * NC + c];
            raise_to(c, ut_sixteenth(h));
        }
        PH_SYNC();  // the floors are visible; the buffer is free again
    }

    __device__ __forceinline__ void tile(const float (&acc)[2][NT][4], long long r0, long long row_end) {
        const int lane = ph_tid() & 31, warp = ph_tid() >> 5;
        // Element k = 2 * mt + h of a column: row ph_row(r0, mt, h), logit acc[mt][nt][2h + e].
        int ids[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) ids[k] = rw.id(ph_row(r0, k >> 1, k & 1), row_end);
        // Thread `own` raises column own's list to its shared floor as loaded at the end of the
        // previous tile (a value a tile old is as valid, and its load is off the critical
        // path); while a list may still be empty, the floor is loaded now: other warpgroups'
        // first floors spare it most of a first tile's appends.
        const int own = ph_tid();
        if (!full && own < live) g_next = *reinterpret_cast<volatile unsigned*>(gf + own);
        const float g = ut_unkey(g_next);
        if (own < live) raise_to(own, g);
        if (!full) {  // until every list is full: a floor for those with empty entries
            if (PH_SYNC_OR(own < live && lv[(UT_K - 1) * NC + own] == PH_NEG_INF)) fill_floor(acc, ids);
            else full = true;
        } else {
            PH_SYNC();  // the raised lists are visible to every holder
        }
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
                    if (c >= live) continue;  // a padding column of the last chunk
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
        // Publish a full list's 16th value where it beats the floor this tile started from,
        // then load the floor for the next tile.
        if (own < live) {
            const float v16 = lv[(UT_K - 1) * NC + own];
            if (v16 > g) atomicMax(gf + own, ut_key(v16));  // never an empty list's -inf
            g_next = *reinterpret_cast<volatile unsigned*>(gf + own);
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

// Merge. One block per column, UT_MERGE_WARPS warps. A list of 16 entries lives one entry a
// lane: warp w keeps its running top 16 R in lanes 0..15 (best first) and folds partial lists
// w, w + UT_MERGE_WARPS, ... into it: lanes 16..31 load the next list reversed (worst first),
// so the 32 lanes hold a bitonic sequence, and 5 half-cleaner stages across the lanes (stride
// 16, 8, 4, 2, 1: the lower lane of each pair keeps the better entry) sort it best first; R
// is then lanes 0..15 again. A list whose best entry does not beat R's 16th cannot change R
// and is skipped (one compare: after the first lists most are). The loads of
// UT_MERGE_AHEAD lists are in flight together. The warps' lists are then folded the same
// way, pairwise through shared memory (log2(UT_MERGE_WARPS) levels; warp 0 writes the result). Every step keeps the exact top 16 of the entries seen (the
// order is total and the ids are distinct), so the result is the column's top 16, best
// first; empty entries (-inf, no id) fill a column with fewer candidates. The partial lists
// never hold NaN (the epilogue ranks NaN as -inf and never stores it); they may hold floor
// entries (f, PH_NO_ID), equal ones in several lists (a comparison network sorts equal
// entries too), but none reaches the result: 16 candidates of the column beat each (see
// ut_key).
#define UT_MERGE_WARPS 16
#define UT_MERGE_THREADS (32 * UT_MERGE_WARPS)
#define UT_MERGE_AHEAD 16

// One bitonic merge step of the lanes' entries: lanes 0..15 sorted best first, lanes 16..31
// worst first; afterwards all 32 sorted best first.
__device__ __forceinline__ void ut_lane_merge(float& v, int& id) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, s);
        const int oi = __shfl_xor_sync(0xffffffffu, id, s);
        const bool take = (lane & s) == 0 ? ph_beats(ov, oi, v, id) : ph_beats(v, id, ov, oi);
        if (take) { v = ov; id = oi; }
    }
}

// grid (n), UT_MERGE_THREADS threads; top-16 of column blockIdx.x's P partial lists (16
// (value, id bits) pairs each, best first) into scores[col * 16 + j], ids[col * 16 + j].
extern "C" __global__ void __launch_bounds__(UT_MERGE_THREADS)
unary_topk_merge(const float* __restrict__ ws, float* __restrict__ scores, int* __restrict__ ids, int P) {
    __shared__ float w_v[UT_MERGE_WARPS][UT_K];
    __shared__ int w_id[UT_MERGE_WARPS][UT_K];
    const long long col = blockIdx.x;
    const int warp = (int)(threadIdx.x >> 5), lane = (int)(threadIdx.x & 31);
    const float2* src = reinterpret_cast<const float2*>(ws) + col * P * UT_K;
    const int j = 31 - lane;  // lanes 16..31: entry j of a loaded list (worst first)
    float v = PH_NEG_INF;
    int id = PH_NO_ID;
    for (int b0 = warp; b0 < P; b0 += UT_MERGE_WARPS * UT_MERGE_AHEAD) {
        float2 x[UT_MERGE_AHEAD];
#pragma unroll
        for (int a = 0; a < UT_MERGE_AHEAD; ++a) {
            const int b = b0 + a * UT_MERGE_WARPS;
            x[a] = lane >= UT_K && b < P ? src[(long long)b * UT_K + j]
                                         : make_float2(PH_NEG_INF, __int_as_float(PH_NO_ID));
        }
#pragma unroll
        for (int a = 0; a < UT_MERGE_AHEAD; ++a) {
            // Lane 31 holds the list's best entry, lane 15 R's 16th.
            const float bv = __shfl_sync(0xffffffffu, x[a].x, 31);
            const int bi = __float_as_int(__shfl_sync(0xffffffffu, x[a].y, 31));
            const float rv = __shfl_sync(0xffffffffu, v, UT_K - 1);
            const int ri = __shfl_sync(0xffffffffu, id, UT_K - 1);
            if (!ph_beats(bv, bi, rv, ri)) continue;  // warp-uniform
            if (lane >= UT_K) { v = x[a].x; id = __float_as_int(x[a].y); }
            ut_lane_merge(v, id);
        }
    }
    // The warps' lists, folded pairwise: at the level of stride h, warp w < h folds warp w +
    // h's list into its own (skipped when that list's best does not beat its 16th).
    if (lane < UT_K) { w_v[warp][lane] = v; w_id[warp][lane] = id; }
#pragma unroll 1
    for (int h = UT_MERGE_WARPS / 2; h > 0; h >>= 1) {
        __syncthreads();  // level h's lists (slots < 2h) are written; none is read and written at once
        if (warp < h) {
            const float rv = __shfl_sync(0xffffffffu, v, UT_K - 1);
            const int ri = __shfl_sync(0xffffffffu, id, UT_K - 1);
            if (ph_beats(w_v[warp + h][0], w_id[warp + h][0], rv, ri)) {  // warp-uniform
                if (lane >= UT_K) { v = w_v[warp + h][j]; id = w_id[warp + h][j]; }
                ut_lane_merge(v, id);
                if (lane < UT_K) { w_v[warp][lane] = v; w_id[warp][lane] = id; }
            }
        }
    }
    if (warp == 0 && lane < UT_K) {
        scores[col * UT_K + lane] = v;
        ids[col * UT_K + lane] = id;
    }
}
