// candidate_selector: DFlash2's conditional left-to-right walk over the top-16 lattice
// (contract: crates/dflash-ops/src/candidate_selector/mod.rs).
// One block of CS_THREADS = 16 warps per row; the k steps run in order inside the block.
// Step i: all threads stage a[r] = f32(g_i[r] * W_pred[pred, r]) in shared memory; warp c
// computes the edge score of candidate c (lane-strided partial sums with exact products via
// fmaf, butterfly-combined; lane 0 adds the unary score); thread 0 then makes the decision in
// the contract's exact order (max, exp, rank-ordered sum, divide, inverse CDF) and publishes
// the chosen predecessor for the next step. Ids are clamped into [0, vocab) before any
// codebook read (the CPU validates them; on the device they are the caller's guarantee).
// Latency: a step's only load that depends on the walk is the predecessor's W_pred row. The
// candidate's W_succ row does not, so (for rank <= 32 * CS_REGS) each warp holds it in
// registers, loaded for step i + 1 as soon as its step-i dot product is done, while the
// decision runs: one dependent DRAM round trip a step instead of two. The sums are formed in
// the same order either way (lane-strided fmaf, then the butterfly), so the values are too.

#define CS_TOPK 16
#define CS_THREADS (CS_TOPK * 32)
#define CS_REGS 16  // W_succ values a lane holds (rank up to 512 in registers)

__device__ __forceinline__ int cs_clamp(int id, int vocab) {
    return id < 0 ? 0 : (id >= vocab ? vocab - 1 : id);
}

// Lane `lane`'s values of candidate `slot`'s W_succ row at column `col`: r = lane + 32 t.
__device__ __forceinline__ void cs_load_succ(float (&wsr)[CS_REGS], const __nv_bfloat16* __restrict__ w_succ,
                                             const int* __restrict__ cand_ids, long long col, int slot,
                                             int lane, int rank, int vocab) {
    const int c = cs_clamp(cand_ids[col * CS_TOPK + slot], vocab);
    const __nv_bfloat16* ws = w_succ + (long long)c * rank;
#pragma unroll
    for (int t = 0; t < CS_REGS; ++t) {
        const int r = lane + 32 * t;
        wsr[t] = r < rank ? bf2f(ws[r]) : 0.0f;
    }
}

// grid (rows), block (CS_THREADS), dynamic shared memory rank * sizeof(float).
extern "C" __global__ void __launch_bounds__(CS_THREADS)
candidate_selector_walk(const __nv_bfloat16* __restrict__ g, const int* __restrict__ cand_ids,
                        const float* __restrict__ unary, const __nv_bfloat16* __restrict__ w_pred,
                        const __nv_bfloat16* __restrict__ w_succ, const int* __restrict__ anchors,
                        const int* __restrict__ seeds, const int* __restrict__ start_pos,
                        const float* __restrict__ temperature, int* __restrict__ proposals,
                        float* __restrict__ q, int* __restrict__ chosen, int k, int rank,
                        int vocab, unsigned int purpose) {
    extern __shared__ float s_a[];  // [rank]
    __shared__ float s_e[CS_TOPK];
    __shared__ int s_pred;

    const long long row = blockIdx.x;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const float temp = temperature[row];
    const u64 seed = (u64)(u32)seeds[2 * row] | ((u64)(u32)seeds[2 * row + 1] << 32);
    const u64 frontier = (u64)(u32)start_pos[row];
    if (tid == 0) s_pred = cs_clamp(anchors[row], vocab);
    __syncthreads();

    // This warp's candidate row of W_succ for column `col`, into registers (in_regs).
    const bool in_regs = rank <= 32 * CS_REGS;
    float wsr[CS_REGS];
    if (in_regs && k > 0) cs_load_succ(wsr, w_succ, cand_ids, row * k, warp, lane, rank, vocab);

    for (int i = 0; i < k; ++i) {
        const long long col = row * k + i;
        const __nv_bfloat16* gi = g + col * rank;
        const __nv_bfloat16* wp = w_pred + (long long)s_pred * rank;
        for (int r = tid; r < rank; r += CS_THREADS) s_a[r] = bf2f(gi[r]) * bf2f(wp[r]);
        __syncthreads();

        {   // warp == candidate rank (CS_THREADS / 32 == CS_TOPK warps)
            float acc = 0.0f;
            if (in_regs) {
#pragma unroll
                for (int t = 0; t < CS_REGS; ++t) {
                    const int r = lane + 32 * t;
                    if (r < rank) acc = fmaf(s_a[r], wsr[t], acc);
                }
                // In flight during the decision.
                if (i + 1 < k) cs_load_succ(wsr, w_succ, cand_ids, col + 1, warp, lane, rank, vocab);
            } else {
                const int c = cs_clamp(cand_ids[col * CS_TOPK + warp], vocab);
                const __nv_bfloat16* ws = w_succ + (long long)c * rank;
                for (int r = lane; r < rank; r += 32) acc = fmaf(s_a[r], bf2f(ws[r]), acc);
            }
            #pragma unroll
            for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
            if (lane == 0) s_e[warp] = acc + unary[col * CS_TOPK + warp];
        }
        __syncthreads();

        if (tid == 0) {
            float e[CS_TOPK], p[CS_TOPK];
            #pragma unroll
            for (int c = 0; c < CS_TOPK; ++c) e[c] = s_e[c];
            int j = 0;
            if (temp > 0.0f) {
                float m = e[0];
                #pragma unroll
                for (int c = 1; c < CS_TOPK; ++c) if (e[c] > m) m = e[c];
                float s = 0.0f;
                #pragma unroll
                for (int c = 0; c < CS_TOPK; ++c) { p[c] = expf((e[c] - m) / temp); s += p[c]; }
                #pragma unroll
                for (int c = 0; c < CS_TOPK; ++c) p[c] = p[c] / s;
                const float u = dflash_unit_f32(dflash_rng_word(seed, frontier + (u64)i, purpose, 0u));
                float cum = 0.0f;
                // Past the F32 total (a few ulps short of 1): the last rank with mass.
                j = CS_TOPK - 1;
                #pragma unroll
                for (int c = 0; c < CS_TOPK; ++c) if (p[c] > 0.0f) j = c;
                #pragma unroll
                for (int c = 0; c < CS_TOPK; ++c) {
                    cum += p[c];
                    if (u < cum) { j = c; break; }
                }
            } else {
                #pragma unroll
                for (int c = 1; c < CS_TOPK; ++c) if (e[c] > e[j]) j = c;
                #pragma unroll
                for (int c = 0; c < CS_TOPK; ++c) p[c] = c == j ? 1.0f : 0.0f;
            }
            #pragma unroll
            for (int c = 0; c < CS_TOPK; ++c) q[col * CS_TOPK + c] = p[c];
            const int d = cand_ids[col * CS_TOPK + j];
            proposals[col] = d;
            chosen[col] = j;
            s_pred = cs_clamp(d, vocab);
        }
        __syncthreads();
    }
}
