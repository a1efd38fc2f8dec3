// unary_topk: per-column top-16 of F32 head logits, score descending, exact ties to the lower
// global id (contract: crates/dflash-ops/src/unary_topk/mod.rs).
// One block of UT_THREADS threads per column. Phase 1: each thread scans a strided
// (coalesced) slice and keeps its own sorted top-16 in registers (one compare against its
// 16th entry per element; insertions are rare). Phase 2: the per-thread lists go to shared
// memory and 16 rounds of a block-wide argmax over the list heads (warp shuffles, then one
// warp over the warp winners) emit the merged list in order; the winning thread advances its
// head. The order (larger value, then lower id) is total, so the result does not depend on
// the thread count or reduction order. NaN logits are treated as -inf. token_ids are copied
// to the output, never dereferenced.

#define UT_K 16
#define UT_THREADS 256
#define UT_WARPS (UT_THREADS / 32)
#define UT_NEG_INF __int_as_float(0xff800000)
#define UT_NO_ID 0x7fffffff

__device__ __forceinline__ bool ut_beats(float v, int id, float bv, int bid) {
    return v > bv || (v == bv && id < bid);
}

// Insert (v, id) into the sorted (best first) register list if it beats the last entry.
__device__ __forceinline__ void ut_push(float (&lv)[UT_K], int (&li)[UT_K], float v, int id) {
    if (v != v) v = UT_NEG_INF;
    if (!ut_beats(v, id, lv[UT_K - 1], li[UT_K - 1])) return;
    #pragma unroll
    for (int j = UT_K - 1; j > 0; --j) {
        // lv[j - 1] and lv[j] still hold their old values here (descending j).
        const bool above_prev = ut_beats(v, id, lv[j - 1], li[j - 1]);
        const bool above_cur = ut_beats(v, id, lv[j], li[j]);
        if (above_prev) { lv[j] = lv[j - 1]; li[j] = li[j - 1]; }
        else if (above_cur) { lv[j] = v; li[j] = id; }
    }
    if (ut_beats(v, id, lv[0], li[0])) { lv[0] = v; li[0] = id; }
}

__device__ __forceinline__ void ut_warp_best(float& bv, int& bid, int& bt) {
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        float ov = __shfl_down_sync(0xffffffffu, bv, off);
        int oid = __shfl_down_sync(0xffffffffu, bid, off);
        int ot = __shfl_down_sync(0xffffffffu, bt, off);
        if (ut_beats(ov, oid, bv, bid)) { bv = ov; bid = oid; bt = ot; }
    }
}

// token_ids == nullptr: full head (id = row index, candidates 0..considered).
// Requires blockDim.x == UT_THREADS and considered >= UT_K (checked by the launcher).
__device__ __forceinline__ void ut_column(const float* __restrict__ logits,
                                          const int* __restrict__ token_ids,
                                          float* __restrict__ scores, int* __restrict__ ids,
                                          int rows, int considered) {
    __shared__ float s_v[UT_K][UT_THREADS];
    __shared__ int s_id[UT_K][UT_THREADS];
    __shared__ float w_v[UT_WARPS];
    __shared__ int w_id[UT_WARPS];
    __shared__ int w_t[UT_WARPS];
    __shared__ int s_winner;

    const long long col = blockIdx.x;
    const float* l = logits + col * (long long)rows;
    const int t = threadIdx.x, warp = t >> 5, lane = t & 31;

    float lv[UT_K];
    int li[UT_K];
    #pragma unroll
    for (int j = 0; j < UT_K; ++j) { lv[j] = UT_NEG_INF; li[j] = UT_NO_ID; }

    // Phase 1: four loads in flight per iteration, then the remainder.
    int k = t;
    for (; k < considered - 3 * UT_THREADS; k += 4 * UT_THREADS) {
        const float v0 = l[k], v1 = l[k + UT_THREADS], v2 = l[k + 2 * UT_THREADS],
                    v3 = l[k + 3 * UT_THREADS];
        int i0 = k, i1 = k + UT_THREADS, i2 = k + 2 * UT_THREADS, i3 = k + 3 * UT_THREADS;
        if (token_ids) { i0 = token_ids[i0]; i1 = token_ids[i1]; i2 = token_ids[i2]; i3 = token_ids[i3]; }
        ut_push(lv, li, v0, i0);
        ut_push(lv, li, v1, i1);
        ut_push(lv, li, v2, i2);
        ut_push(lv, li, v3, i3);
    }
    for (; k < considered; k += UT_THREADS) ut_push(lv, li, l[k], token_ids ? token_ids[k] : k);

    #pragma unroll
    for (int j = 0; j < UT_K; ++j) { s_v[j][t] = lv[j]; s_id[j][t] = li[j]; }
    __syncthreads();

    // Phase 2: 16 rounds of block argmax over the heads of the per-thread lists.
    int head = 0;
    for (int r = 0; r < UT_K; ++r) {
        float hv = head < UT_K ? s_v[head][t] : UT_NEG_INF;
        int hid = head < UT_K ? s_id[head][t] : UT_NO_ID;
        int ht = t;
        ut_warp_best(hv, hid, ht);
        if (lane == 0) { w_v[warp] = hv; w_id[warp] = hid; w_t[warp] = ht; }
        __syncthreads();
        if (warp == 0) {
            hv = lane < UT_WARPS ? w_v[lane] : UT_NEG_INF;
            hid = lane < UT_WARPS ? w_id[lane] : UT_NO_ID;
            ht = lane < UT_WARPS ? w_t[lane] : -1;
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

// grid (n), block (UT_THREADS); logits [n, rows]; candidates 0..public_vocab; out [n, 16].
extern "C" __global__ void __launch_bounds__(UT_THREADS)
unary_topk_full(const float* __restrict__ logits, float* __restrict__ scores,
                int* __restrict__ ids, int rows, int public_vocab) {
    ut_column(logits, nullptr, scores, ids, rows, public_vocab);
}

// grid (n), block (UT_THREADS); logits [n, rows]; token_ids [rows]; out [n, 16].
extern "C" __global__ void __launch_bounds__(UT_THREADS)
unary_topk_indexed(const float* __restrict__ logits, const int* __restrict__ token_ids,
                   float* __restrict__ scores, int* __restrict__ ids, int rows) {
    ut_column(logits, token_ids, scores, ids, rows, rows);
}
