// chain_accept: greedy and stochastic chain verification
// (contract: crates/dflash-ops/src/chain_accept/mod.rs).
//
// One block of CA_THREADS threads per row. Every f64 operation of a decision is an _rn
// intrinsic in the order the contract fixes, so the CPU reference decides bit-identically.
// A column's p_i is its stored p row, or (has_greedy, greedy[r, i] = g >= 0) the one-hot at g,
// computed as (v == g) ? 1 : 0 and never loaded: exactly the values of the stored one-hot row,
// so both forms take the same decisions. The p row of a greedy column is never read.

#define CA_THREADS 1024
#define CA_TILE 1024
#define CA_MAX_TILES 1024
#define CA_TOP 16
#define CA_BATCH 16
#define CA_MAX_COLS 256
#define CA_PURPOSE_ACCEPT 2u
#define CA_PURPOSE_CORRECTION 3u
#define CA_PURPOSE_BONUS 4u

// p(v) of a column whose stored p(v) (read only for g < 0) is pv: the one-hot at g (g >= 0: a
// greedy column) or pv.
__device__ __forceinline__ double ca_p_of(int g, int v, float pv) {
    return g >= 0 ? (v == g ? 1.0 : 0.0) : (double)pv;
}
// p(v) of a column: the one-hot at g (prow never read) or prow[v].
__device__ __forceinline__ double ca_p(const float* prow, int g, int v) {
    return ca_p_of(g, v, g >= 0 ? 0.0f : prow[v]);
}

// Draw weight of id v < vocab whose p(v) is pv: mode 0 = p(v) (bonus / fallback),
// 1 = max(p - onehot_x, 0), 2 = max(p - q_top16, 0) with q of the first slot holding v,
// 3 = the explicit slot weight s_w[s] where slot s holds v, else p(v) (tree_accept's
// residual), 4 = 0 where a slot holds v, else p(v) (tree_accept's sum M).
__device__ __forceinline__ double ca_weight_of(double pv, int v, int mode, int x,
                                               const int* s_ids, const float* s_q,
                                               const double* s_w) {
    if (mode == 0) return pv;
    if (mode >= 3) {
        for (int s = 0; s < CA_TOP; ++s) {
            if (s_ids[s] == v) return mode == 3 ? s_w[s] : 0.0;
        }
        return pv;
    }
    double qv = 0.0;
    if (mode == 1) {
        qv = (v == x) ? 1.0 : 0.0;
    } else {
        for (int s = 0; s < CA_TOP; ++s) {
            if (s_ids[s] == v) { qv = (double)s_q[s]; break; }
        }
    }
    return fmax(__dsub_rn(pv, qv), 0.0);
}

struct CaShared {
    double tile_sum[CA_MAX_TILES];
    double tile_w[CA_TILE];
    double w[CA_TOP];
    int ids[CA_TOP];
    float q[CA_TOP];
    unsigned char pass[CA_MAX_COLS];
    double c;
    double target;
    int jstar;
    int tok;
    int accepted;
    int rejected;
    int x;
};

// Draw weight of any id v (0 at and past the vocabulary).
__device__ __forceinline__ double ca_weight(const CaShared& sh, const float* prow, int g, int v,
                                            int vocab, int mode, int x) {
    if (v >= vocab) return 0.0;
    return ca_weight_of(ca_p(prow, g, v), v, mode, x, sh.ids, sh.q, sh.w);
}

// The tile sums of item 3 into sh.tile_sum (every thread; ends with a barrier).
__device__ void ca_tile_sums(CaShared& sh, const float* prow, int g, int vocab, int mode, int x) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    const int tiles = (vocab + CA_TILE - 1) / CA_TILE;
    for (int j = warp; j < tiles; j += nwarps) {
        double a = 0.0;
        // CA_BATCH loads of a lane issued before the first is added (the adds stay in the
        // contract's order): a lane's 32 dependent loads would otherwise each wait a full
        // memory latency.
        for (int k0 = 0; k0 < 32; k0 += CA_BATCH) {
            float pl[CA_BATCH];
#pragma unroll
            for (int k = 0; k < CA_BATCH; ++k) {
                const int v = j * CA_TILE + (k0 + k) * 32 + lane;
                pl[k] = (g < 0 && v < vocab) ? prow[v] : 0.0f;
            }
#pragma unroll
            for (int k = 0; k < CA_BATCH; ++k) {
                const int v = j * CA_TILE + (k0 + k) * 32 + lane;
                // An id past the vocabulary weighs 0: adding it leaves a (never -0) as it is.
                if (v < vocab) {
                    a = __dadd_rn(a, ca_weight_of(ca_p_of(g, v, pl[k]), v, mode, x, sh.ids, sh.q,
                                                  sh.w));
                }
            }
        }
        for (int off = 16; off > 0; off >>= 1) a = __dadd_rn(a, __shfl_down_sync(0xffffffffu, a, off));
        if (lane == 0) sh.tile_sum[j] = a;
    }
    __syncthreads();
}

// Blocked inverse-CDF draw (contract item 3). Returns -1 when there is no positive total or
// no tile is chosen. Must be called by every thread of the block.
__device__ int ca_draw(CaShared& sh, const float* prow, int g, int vocab, int mode, int x,
                       float u) {
    const int tid = threadIdx.x;
    const int tiles = (vocab + CA_TILE - 1) / CA_TILE;
    ca_tile_sums(sh, prow, g, vocab, mode, x);
    if (tid == 0) {
        double total = 0.0;
        for (int j = 0; j < tiles; ++j) total = __dadd_rn(total, sh.tile_sum[j]);
        int jstar = -1;
        double c = 0.0, target = 0.0;
        if (total > 0.0) {
            target = __dmul_rn((double)u, total);
            for (int j = 0; j < tiles; ++j) {
                const double next = __dadd_rn(c, sh.tile_sum[j]);
                if (next > target) { jstar = j; break; }
                c = next;
            }
        }
        sh.jstar = jstar;
        sh.c = c;
        sh.target = target;
    }
    __syncthreads();
    const int jstar = sh.jstar;
    if (jstar < 0) return -1;  // uniform over the block
    for (int t = tid; t < CA_TILE; t += blockDim.x) {
        sh.tile_w[t] = ca_weight(sh, prow, g, jstar * CA_TILE + t, vocab, mode, x);
    }
    __syncthreads();
    if (tid == 0) {
        double run = sh.c;
        const double target = sh.target;
        int tok = -1, last = -1;
        for (int t = 0; t < CA_TILE; ++t) {
            const int v = jstar * CA_TILE + t;
            if (v >= vocab) break;
            const double w = sh.tile_w[t];
            run = __dadd_rn(run, w);
            if (w > 0.0) last = v;
            if (run > target) { tok = v; break; }
        }
        sh.tok = tok >= 0 ? tok : last;
    }
    __syncthreads();
    return sh.tok;
}

extern "C" __global__ void __launch_bounds__(CA_THREADS) chain_accept_kernel(
    const float* __restrict__ p, const int* __restrict__ greedy, int has_greedy,
    const int* __restrict__ proposals, const int* __restrict__ live,
    const float* __restrict__ q, const int* __restrict__ ids, int top16,
    const int* __restrict__ seeds, const int* __restrict__ start_pos, int* __restrict__ accepted,
    int* __restrict__ out_tokens, int* __restrict__ out_len, int rows, int cols, int vocab) {
    __shared__ CaShared sh;
    const int r = blockIdx.x;
    if (r >= rows) return;
    const int tid = threadIdx.x;
    int Q = live[r];
    Q = Q < 1 ? 1 : (Q > cols ? cols : Q);
    const int P = Q - 1;
    const int K = cols - 1;
    const u64 seed = (u64)(u32)seeds[2 * r] | ((u64)(u32)seeds[2 * r + 1] << 32);
    const u64 F = (u64)(u32)start_pos[r];
    const int* prop = proposals + (size_t)r * K;

    // Acceptance tests: thread i tests column i < P (its loads and random word independent
    // of every other column's), then thread 0 scans the results in order and stops at the
    // first rejection.
    for (int i = tid; i < P; i += blockDim.x) {
        const int x = prop[i];
        const float* pi = p + ((size_t)r * cols + i) * (size_t)vocab;
        const int g = has_greedy ? greedy[(size_t)r * cols + i] : -1;
        const double px = (x >= 0 && x < vocab) ? ca_p(pi, g, x) : 0.0;
        double qx = 1.0;
        if (top16) {
            qx = 0.0;
            const size_t sb = ((size_t)r * K + i) * CA_TOP;
            for (int s = 0; s < CA_TOP; ++s) {
                if (ids[sb + s] == x) { qx = (double)q[sb + s]; break; }
            }
        }
        const float u = dflash_unit_f32(dflash_rng_word(seed, F + 1 + (u64)i, CA_PURPOSE_ACCEPT, 0u));
        sh.pass[i] = __dmul_rn((double)u, qx) < px ? 1 : 0;
    }
    __syncthreads();
    if (tid == 0) {
        int A = 0, rejected = 0, xr = -1;
        for (int i = 0; i < P; ++i) {
            if (sh.pass[i]) {
                ++A;
            } else {
                rejected = 1;
                xr = prop[i];
                break;
            }
        }
        sh.accepted = A;
        sh.rejected = rejected;
        sh.x = xr;
    }
    __syncthreads();
    const int A = sh.accepted;
    const int rejected = sh.rejected;
    const int x = sh.x;
    const float* pc = p + ((size_t)r * cols + A) * (size_t)vocab;
    const int gc = has_greedy ? greedy[(size_t)r * cols + A] : -1;  // A <= P < Q <= cols
    int mode = 0;
    float u;
    if (rejected) {
        u = dflash_unit_f32(dflash_rng_word(seed, F + 1 + (u64)A, CA_PURPOSE_CORRECTION, 0u));
        mode = top16 ? 2 : 1;
        if (top16 && tid < CA_TOP) {
            const size_t sb = ((size_t)r * K + A) * CA_TOP;
            sh.ids[tid] = ids[sb + tid];
            sh.q[tid] = q[sb + tid];
        }
    } else {
        u = dflash_unit_f32(dflash_rng_word(seed, F + 1 + (u64)A, CA_PURPOSE_BONUS, 0u));
    }
    __syncthreads();
    // A greedy column (0 <= gc < vocab, uniform over the block): p is one-hot at gc, and every draw
    // weight is 0 except at gc (the bonus: p itself; a correction: p - q at gc is positive,
    // since the rejected proposal was not gc and q(gc) < 1 then), so the blocked draw returns
    // gc for any u: taken directly, without the scan of the vocabulary.
    int tok;
    if (gc >= 0 && gc < vocab) {
        tok = gc;
    } else {
        tok = ca_draw(sh, pc, gc, vocab, mode, x, u);
        if (tok < 0 && mode != 0) tok = ca_draw(sh, pc, gc, vocab, 0, x, u);
        if (tok < 0) tok = 0;
    }

    for (int j = tid; j < cols; j += blockDim.x) {
        out_tokens[(size_t)r * cols + j] = j < A ? prop[j] : (j == A ? tok : -1);
    }
    if (tid == 0) {
        accepted[r] = A;
        out_len[r] = A + 1;
    }
}
