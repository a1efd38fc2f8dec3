// candidate_selector: DFlash2's conditional left-to-right walk over the top-16 lattice
// (contract: crates/dflash-ops/src/candidate_selector/mod.rs).
//
// One block of CS_THREADS = 16 warps per row, in two phases per batch of up to CS_SB steps.
//
// Edge tables first. Step i's predecessor is one of 16 known ids before the walk has chosen:
// the anchor at step 0, else one of step i - 1's candidates C_{i-1}. So the block forms every
// edge score the walk could need, E_i[p][c] = dot(a_{i,p}, W_succ[C_i[c]]) + unary_i[c] with
// a_{i,p}[r] = f32(g_i[r] * W_pred[P_i[p], r]) (P_0[p] = the anchor for every p, P_i = C_{i-1}),
// into a shared table [step][p][c], none of it waiting on a decision. Work split of a step
// (its rank axis in chunks of CS_RC = 256): all threads stage the chunk of the 16 a rows in
// shared memory (f32, exact: a product of two BF16); warp w takes the 4 x 4 tile of
// predecessors 4 (w / 4) .. and candidates 4 (w % 4) .., holding its 4 W_succ rows in
// registers (lane l: r = r0 + l + 32 t, t < 8) and reading the a rows from shared memory.
// The loads of the next (step, chunk) are issued before the current one is computed, and
// every row of the batch is prefetched into the L2 at its start.
// Each dot product is summed in the contract's CUDA order (as the earlier walk, one dot a
// warp, summed it): lane-strided fmaf in increasing r (chunk after chunk), then a butterfly
// over the lanes at offsets 16, 8, 4, 2, 1. A warp's 16 sums are reduced together (reduce-scatter: at each offset a lane keeps
// half of its values and adds its partner's copy of them), which adds the same pairs in the
// same tree, so each sum is bit-identical to the butterfly's (IEEE addition commutes); lanes
// 2j and 2j + 1 end with sum j of the tile.
// Then the walk: warp 0 runs the batch's steps in order over the table (row 0 at step 0,
// else the rank chosen at the step before), lane c holding candidate c, deciding in the
// contract's exact order (cs_decide) and writing q, proposals and chosen; the uniforms of the
// batch's steps are drawn first, in parallel (they do not depend on the walk).
// Ids are clamped into [0, vocab) before any codebook read (the CPU validates them; on the
// device they are the caller's guarantee).
// Measured (H100, Nsight Compute, a 27B DFlash2 block at B=1, K=15; docs/performance-selector-h100.md):
// 76.6 us for the walk that scored only the chosen predecessor, a dependent codebook read a
// step, -> 50.6 us. Bound by issue, not by DRAM: a trial build that touched every row of the
// batch with real loads at its start, all in flight together, instead of prefetching them,
// took the same 50.3 us and issued 173 K warp instructions, most of them the 2-byte codebook
// loads of `load` and their address arithmetic.

#define CS_TOPK 16
#define CS_THREADS (CS_TOPK * 32)
#define CS_RC 256  // rank chunk: lane l takes r0 + l + 32 t, t < CS_T
#define CS_T (CS_RC / 32)
#define CS_SB 16   // steps per batch (the edge tables in shared memory)
#define CS_TILE 4  // a warp's predecessors x candidates: CS_TILE x CS_TILE sums
// Dynamic shared memory (mirrored by the launcher's SMEM_BYTES): the a rows of one chunk
// [16][CS_RC] f32, the tables [CS_SB][16][16] f32, the batch's clamped ids [CS_SB + 1][16] i32
// (row 0: the predecessors of the batch's first step), its candidate ids as given
// [CS_SB][16] i32 (the proposals) and its uniforms [CS_SB] f32.
#define CS_SMEM_BYTES \
    ((CS_TOPK * CS_RC + CS_SB * CS_TOPK * CS_TOPK + (2 * CS_SB + 1) * CS_TOPK + CS_SB) * 4)

__device__ __forceinline__ int cs_clamp(int id, int vocab) {
    return id < 0 ? 0 : (id >= vocab ? vocab - 1 : id);
}

// The BF16 bits at p if `ok`, else 0 (+0.0).
__device__ __forceinline__ unsigned cs_raw(const __nv_bfloat16* p, bool ok) {
    return ok ? (unsigned)*reinterpret_cast<const unsigned short*>(p) : 0u;
}

// One step's decision by a warp (lane c & 15 holds candidate c's edge score e; every lane
// returns the same rank j, and lane c's q[c] in p): temperature > 0, the softmax at temp and
// the inverse CDF of u; else the lowest rank attaining the max. The contract's exact order:
// the max (order-free), x[c] = expf((e[c] - m) / temp) per lane, their sum in rank order (every
// lane adds the 16 shuffled values in turn), q[c] = x[c] / sum per lane, then the inclusive
// prefix sum in rank order against u; past the F32 total, the last rank with mass.
__device__ __forceinline__ int cs_decide(float e, float temp, float u, int lane, float& p) {
    float m = e;
#pragma unroll
    for (int off = 8; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    if (temp > 0.0f) {
        const float x = expf((e - m) / temp);
        float s = 0.0f;
#pragma unroll
        for (int c = 0; c < CS_TOPK; ++c) s += __shfl_sync(0xffffffffu, x, c);
        p = x / s;
        const unsigned mass = __ballot_sync(0xffffffffu, p > 0.0f) & 0xffffu;
        int j = mass ? 31 - __clz(mass) : CS_TOPK - 1;
        float cum = 0.0f;
#pragma unroll
        for (int c = 0; c < CS_TOPK; ++c) {
            cum += __shfl_sync(0xffffffffu, p, c);
            if (u < cum) { j = c; break; }  // cum and u are warp-uniform: a uniform branch
        }
        return j;
    }
    // No lane equal to the max (NaN scores, an unspecified rank): rank 0.
    const int j = max(__ffs(__ballot_sync(0xffffffffu, e == m) & 0xffffu) - 1, 0);
    p = (lane & (CS_TOPK - 1)) == j ? 1.0f : 0.0f;
    return j;
}

// Reduce-scatter of a warp's CS_TILE x CS_TILE sums v (index 4 * pi + ci) over its lanes, at
// offsets 16, 8, 4, 2, 1: returns sum (l >> 1) of lane l, bit-identical to a butterfly of it.
__device__ __forceinline__ float cs_reduce_scatter(const float (&v)[16], int lane) {
    float w[8], x[4], y[2];
    const bool b4 = (lane >> 4) & 1, b3 = (lane >> 3) & 1, b2 = (lane >> 2) & 1, b1 = (lane >> 1) & 1;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float give = b4 ? v[j] : v[j + 8];
        w[j] = (b4 ? v[j + 8] : v[j]) + __shfl_xor_sync(0xffffffffu, give, 16);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float give = b3 ? w[j] : w[j + 4];
        x[j] = (b3 ? w[j + 4] : w[j]) + __shfl_xor_sync(0xffffffffu, give, 8);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const float give = b2 ? x[j] : x[j + 2];
        y[j] = (b2 ? x[j + 2] : x[j]) + __shfl_xor_sync(0xffffffffu, give, 4);
    }
    const float z = (b1 ? y[1] : y[0]) + __shfl_xor_sync(0xffffffffu, b1 ? y[0] : y[1], 2);
    return z + __shfl_xor_sync(0xffffffffu, z, 1);
}

// The raw BF16 values one thread loads for a (step, chunk) unit, two to a word (low half
// first): its element of g_i, its element of the 8 a rows it stages (rows (tid >> 8) + 2 j,
// element tid & 255), and its warp's 4 W_succ rows at its lane's 8 positions. Positions past
// the rank are zero.
struct CsRaw {
    unsigned g, wp[4], ws[CS_TILE][CS_T / 2];
};
__device__ __forceinline__ float cs_lo(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float cs_hi(unsigned w) { return __uint_as_float(w & 0xffff0000u); }

// grid (rows), block (CS_THREADS), dynamic shared memory CS_SMEM_BYTES.
extern "C" __global__ void __launch_bounds__(CS_THREADS, 1)
candidate_selector_walk(const __nv_bfloat16* __restrict__ g, const int* __restrict__ cand_ids,
                        const float* __restrict__ unary, const __nv_bfloat16* __restrict__ w_pred,
                        const __nv_bfloat16* __restrict__ w_succ, const int* __restrict__ anchors,
                        const int* __restrict__ seeds, const int* __restrict__ start_pos,
                        const float* __restrict__ temperature, int* __restrict__ proposals,
                        float* __restrict__ q, int* __restrict__ chosen, int k, int rank,
                        int vocab, unsigned int purpose) {
    extern __shared__ float s_mem[];
    float* s_a = s_mem;                                      // [16][CS_RC]
    float* s_e = s_a + CS_TOPK * CS_RC;                      // [CS_SB][16 p][16 c]
    int* s_ids = reinterpret_cast<int*>(s_e + CS_SB * CS_TOPK * CS_TOPK);  // [CS_SB + 1][16]
    int* s_cand = s_ids + (CS_SB + 1) * CS_TOPK;                            // [CS_SB][16]
    float* s_u = reinterpret_cast<float*>(s_cand + CS_SB * CS_TOPK);        // [CS_SB]
    __shared__ int s_prev;  // the rank chosen at the step before the batch

    const long long row = blockIdx.x;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int p0 = CS_TILE * (warp / CS_TILE), c0 = CS_TILE * (warp % CS_TILE);
    const int ar = tid & (CS_RC - 1), ap = tid / CS_RC;  // staging: element ar of rows ap + 2 j
    const int anchor = cs_clamp(anchors[row], vocab);
    const int chunks = (rank + CS_RC - 1) / CS_RC;
    if (tid == 0) s_prev = 0;

    for (int i0 = 0; i0 < k; i0 += CS_SB) {
        const int nb = min(CS_SB, k - i0);
        // The batch's ids, clamped: row 0 the predecessors of step i0, row 1 + s the
        // candidates of step i0 + s.
        __syncthreads();  // the previous batch's walk has read s_ids
        for (int e = tid; e < (nb + 1) * CS_TOPK; e += CS_THREADS) {
            const int s = e / CS_TOPK - 1, c = e % CS_TOPK;
            const int i = i0 + s;  // step of the row; -1 is the anchor's
            const int id = i < 0 ? anchor : cand_ids[(row * k + i) * CS_TOPK + c];
            s_ids[e] = cs_clamp(id, vocab);
            if (s >= 0) s_cand[e - CS_TOPK] = id;
        }
        __syncthreads();
        // The codebook rows of the batch (their first chunk) and its g rows into the L2: both
        // codebooks' rows of every id of s_ids (32 rows more than the steps read: W_succ of
        // row 0's ids, W_pred of the last step's candidates; one loop for all).
        {
            const int lines = (min(rank, CS_RC) * 2 + 127) / 128;
            const int n_rows = (nb + 1) * CS_TOPK * 2;
            for (int e = tid; e < n_rows * lines + nb * lines; e += CS_THREADS) {
                const int ln = e % lines, rw = e / lines;
                const char* p;
                if (rw < n_rows) {
                    const int id = s_ids[rw >> 1];
                    p = reinterpret_cast<const char*>(((rw & 1) ? w_succ : w_pred) + (long long)id * rank);
                } else {
                    p = reinterpret_cast<const char*>(g + (row * k + i0 + (rw - n_rows)) * (long long)rank);
                }
                asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p + 128 * ln));
            }
        }

        // Unit u = (step s of the batch, chunk): its raw values, loaded one unit ahead.
        auto load = [&](int u, CsRaw& w) {
            const int s = u / chunks, r0 = (u % chunks) * CS_RC;
            const long long col = row * k + i0 + s;
            const int r = r0 + ar;
            w.g = cs_raw(g + col * rank + r, r < rank);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                // Step i0 + s's predecessors are ids row s.
                const int* pr = s_ids + s * CS_TOPK + ap;
                const unsigned lo = cs_raw(w_pred + (long long)pr[4 * j] * rank + r, r < rank);
                const unsigned hi = cs_raw(w_pred + (long long)pr[4 * j + 2] * rank + r, r < rank);
                w.wp[j] = lo | hi << 16;
            }
#pragma unroll
            for (int ci = 0; ci < CS_TILE; ++ci) {
                const __nv_bfloat16* ws = w_succ + (long long)s_ids[(s + 1) * CS_TOPK + c0 + ci] * rank;
#pragma unroll
                for (int t = 0; t < CS_T; t += 2) {
                    const int rr = r0 + lane + 32 * t;
                    w.ws[ci][t / 2] = cs_raw(ws + rr, rr < rank) | cs_raw(ws + rr + 32, rr + 32 < rank) << 16;
                }
            }
        };
        const int units = nb * chunks;
        CsRaw nx;
        load(0, nx);
        float acc[CS_TILE * CS_TILE];
        for (int u = 0; u < units; ++u) {
            const int s = u / chunks, r0 = (u % chunks) * CS_RC;
            float wsr[CS_TILE][CS_T];
#pragma unroll
            for (int ci = 0; ci < CS_TILE; ++ci)
#pragma unroll
                for (int t = 0; t < CS_T; t += 2) {
                    wsr[ci][t] = cs_lo(nx.ws[ci][t / 2]);
                    wsr[ci][t + 1] = cs_hi(nx.ws[ci][t / 2]);
                }
            {  // a = f32(g * W_pred): exact
                const float gv = cs_lo(nx.g);
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    s_a[(ap + 4 * j) * CS_RC + ar] = gv * cs_lo(nx.wp[j]);
                    s_a[(ap + 4 * j + 2) * CS_RC + ar] = gv * cs_hi(nx.wp[j]);
                }
            }
            if (u + 1 < units) load(u + 1, nx);  // in flight during this unit's sums
            __syncthreads();
            if (r0 == 0) {
#pragma unroll
                for (int v = 0; v < CS_TILE * CS_TILE; ++v) acc[v] = 0.0f;
            }
#pragma unroll
            for (int t = 0; t < CS_T; ++t) {
                if (r0 + lane + 32 * t < rank) {
                    float a[CS_TILE];
#pragma unroll
                    for (int pi = 0; pi < CS_TILE; ++pi) a[pi] = s_a[(p0 + pi) * CS_RC + lane + 32 * t];
#pragma unroll
                    for (int pi = 0; pi < CS_TILE; ++pi)
#pragma unroll
                        for (int ci = 0; ci < CS_TILE; ++ci)
                            acc[pi * CS_TILE + ci] = fmaf(a[pi], wsr[ci][t], acc[pi * CS_TILE + ci]);
                }
            }
            if (r0 + CS_RC >= rank) {  // the step's last chunk: its table
                const float e = cs_reduce_scatter(acc, lane);
                if ((lane & 1) == 0) {
                    const int v = lane >> 1, c = c0 + v % CS_TILE;
                    const long long col = row * k + i0 + s;
                    s_e[(s * CS_TOPK + p0 + v / CS_TILE) * CS_TOPK + c] = e + unary[col * CS_TOPK + c];
                }
            }
            __syncthreads();  // s_a is free again; after the last unit the tables are complete
        }

        if (warp == 0) {  // the walk over the batch's tables
            const float temp = temperature[row];
            if (temp > 0.0f) {  // the steps' uniforms do not depend on the walk
                const u64 seed = (u64)(u32)seeds[2 * row] | ((u64)(u32)seeds[2 * row + 1] << 32);
                const u64 frontier = (u64)(u32)start_pos[row];
                for (int s = lane; s < nb; s += 32)
                    s_u[s] = dflash_unit_f32(dflash_rng_word(seed, frontier + (u64)(i0 + s), purpose, 0u));
                __syncwarp();
            }
            const int c = lane & (CS_TOPK - 1);
            int prev = s_prev;
            for (int s = 0; s < nb; ++s) {
                const long long col = row * k + i0 + s;
                const float e = s_e[(s * CS_TOPK + (i0 + s == 0 ? 0 : prev)) * CS_TOPK + c];
                float p;
                const int j = cs_decide(e, temp, temp > 0.0f ? s_u[s] : 0.0f, lane, p);
                if (lane < CS_TOPK) q[col * CS_TOPK + c] = p;
                if (lane == 0) {
                    proposals[col] = s_cand[s * CS_TOPK + j];
                    chosen[col] = j;
                }
                prev = j;
            }
            if (lane == 0) s_prev = prev;
        }
    }
}
