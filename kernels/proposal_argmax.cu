// proposal_argmax: per-column argmax of F32 head logits with ties to the lower global id
// (contract: crates/dflash-ops/src/proposal_argmax/mod.rs).
// One block per logit column; each thread scans a strided (coalesced) slice keeping its best
// (value, id) pair; warp shuffles and one shared-memory round reduce the block. The order
// (larger value, then lower id) is total, so the result is independent of reduction order.
// NaN logits are treated as -inf. token_ids are copied to the output, never dereferenced.

#define PA_NEG_INF __int_as_float(0xff800000)
#define PA_NO_ID 0x7fffffff

__device__ __forceinline__ bool pa_beats(float v, int id, float bv, int bid) {
    return v > bv || (v == bv && id < bid);
}

__device__ __forceinline__ void pa_warp_best(float& bv, int& bid) {
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        float ov = __shfl_down_sync(0xffffffffu, bv, off);
        int oid = __shfl_down_sync(0xffffffffu, bid, off);
        if (pa_beats(ov, oid, bv, bid)) { bv = ov; bid = oid; }
    }
}

// token_ids == nullptr: full head (id = row index, candidates 0..considered).
__device__ __forceinline__ void pa_column(const float* __restrict__ logits,
                                          const int* __restrict__ token_ids, int* __restrict__ ids,
                                          int rows, int considered) {
    __shared__ float s_v[32];
    __shared__ int s_id[32];
    const long long col = blockIdx.x;
    const float* l = logits + col * (long long)rows;
    float bv = PA_NEG_INF;
    int bid = PA_NO_ID;
    for (int k = threadIdx.x; k < considered; k += blockDim.x) {
        float v = l[k];
        if (v != v) v = PA_NEG_INF;
        int id = token_ids ? token_ids[k] : k;
        if (pa_beats(v, id, bv, bid)) { bv = v; bid = id; }
    }
    pa_warp_best(bv, bid);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) { s_v[warp] = bv; s_id[warp] = bid; }
    __syncthreads();
    if (warp == 0) {
        const int nwarps = blockDim.x >> 5;
        bv = lane < nwarps ? s_v[lane] : PA_NEG_INF;
        bid = lane < nwarps ? s_id[lane] : PA_NO_ID;
        pa_warp_best(bv, bid);
        if (lane == 0) ids[col] = bid;
    }
}

// grid (n), block (multiple of 32, <= 1024); logits [n, rows]; candidates 0..public_vocab.
extern "C" __global__ void proposal_argmax_full(const float* __restrict__ logits, int* __restrict__ ids,
                                                int rows, int public_vocab) {
    pa_column(logits, nullptr, ids, rows, public_vocab);
}

// grid (n), block (multiple of 32, <= 1024); logits [n, rows]; token_ids [rows].
extern "C" __global__ void proposal_argmax_indexed(const float* __restrict__ logits,
                                                   const int* __restrict__ token_ids,
                                                   int* __restrict__ ids, int rows) {
    pa_column(logits, token_ids, ids, rows, rows);
}
