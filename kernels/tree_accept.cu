// tree_accept: greedy and stochastic verification of a DFlash2 proposal tree
// (contract: crates/dflash-ops/src/tree_accept/mod.rs).
//
// Compiled after kernels/chain_accept.cu (one module): the blocked draw (ca_draw), the tile
// sums (ca_tile_sums), p of a column (ca_p) and the block's shared state (CaShared) are
// chain_accept's. One block of CA_THREADS threads per row. Thread 0 walks the tree: it finds
// a node's children by a scan of the row's parents (at most TA_MAX_COLS), runs each child's
// test and the residual update in the contract's f64 order (_rn intrinsics), and the whole
// block runs the vocabulary passes: the sum M of p outside the node's slots (ca_tile_sums in
// mode 4, then the tile sums added in order by thread 0) and the correction or bonus draw
// (ca_draw in mode 3 over the residual slot weights sh.w, or mode 0 over p). A greedy column
// (has_greedy, 0 <= g < vocab) needs neither pass: M is 0 or 1 (g in the slots or not) and its
// correction or bonus is g (every residual weight is 0 except at g; if that one is 0 too,
// the fallback over p returns g).

#define TA_MAX_COLS 32

struct TaShared {
    int path[TA_MAX_COLS];  // visited nodes, path[0] = 0
    int kids[TA_MAX_COLS];  // children of the current node, in index order
    int nk;                 // their count
    int plen;               // visited nodes so far
    int state;              // 0: compute M and Z next; 1: a child accepted; 2: all rejected
    int tok;                // the correction or bonus
    int have_m;             // M of the current node computed
    double m;               // M
};

// The walk's step at the current node after the block computed what thread 0 asked for.
// Thread 0 only. Tests children from *k on; returns the state (TaShared::state).
__device__ int ta_test_children(TaShared& ts, CaShared& sh, const int* tok_row, u64 seed,
                                u64 pos, int* k, double* z, double* d, unsigned* tried) {
    while (*k < ts.nk) {
        const int c = ts.kids[*k];
        const int x = tok_row[c - 1];
        const float uf = dflash_unit_f32(dflash_rng_word(seed, pos, CA_PURPOSE_ACCEPT, (u32)*k));
        const double u = (double)uf;
        ++*k;
        int j = -1;
        for (int s = 0; s < CA_TOP; ++s) {
            if (sh.ids[s] == x) { j = s; break; }
        }
        // A token outside the slots or a repeated slot: rejected, the residual unchanged.
        if (j < 0 || ((*tried >> j) & 1u)) continue;
        const double qx = (double)sh.q[j];
        bool accept;
        if (qx > 0.0) {
            accept = __dmul_rn(__dmul_rn(u, qx), *z) < __dmul_rn(sh.w[j], *d);
        } else {
            accept = __dmul_rn(u, *z) < sh.w[j];
        }
        if (accept) {
            ts.path[ts.plen++] = c;
            return 1;
        }
        if (qx > 0.0) {
            for (int s = 0; s < CA_TOP; ++s) {
                if (!((*tried >> s) & 1u)) {
                    const double t = __ddiv_rn(__dmul_rn(*z, (double)sh.q[s]), *d);
                    sh.w[s] = fmax(__dsub_rn(sh.w[s], t), 0.0);
                }
            }
        } else {
            sh.w[j] = fmax(__dsub_rn(sh.w[j], *z), 0.0);
        }
        *tried |= 1u << j;
        double dd = 0.0;
        for (int s = 0; s < CA_TOP; ++s) {
            if (!((*tried >> s) & 1u)) dd = __dadd_rn(dd, (double)sh.q[s]);
        }
        *d = dd;
        if (*k < ts.nk) return 0;  // the next test needs Z: M first
    }
    return 2;
}

extern "C" __global__ void __launch_bounds__(CA_THREADS) tree_accept_kernel(
    const float* __restrict__ p, const int* __restrict__ greedy, int has_greedy,
    const int* __restrict__ nodes, const int* __restrict__ tokens,
    const int* __restrict__ parents, const float* __restrict__ q, const int* __restrict__ ids,
    const int* __restrict__ seeds, const int* __restrict__ start_pos, int* __restrict__ accepted,
    int* __restrict__ out_tokens, int* __restrict__ out_len, int* __restrict__ path, int rows,
    int cols, int vocab) {
    __shared__ CaShared sh;
    __shared__ TaShared ts;
    const int r = blockIdx.x;
    if (r >= rows) return;
    const int tid = threadIdx.x;
    int N = nodes[r];
    N = N < 1 ? 1 : (N > cols ? cols : N);
    const int K = cols - 1;
    const u64 seed = (u64)(u32)seeds[2 * r] | ((u64)(u32)seeds[2 * r + 1] << 32);
    const u64 F = (u64)(u32)start_pos[r];
    const int* tok_row = tokens + (size_t)r * K;
    const int* par_row = parents + (size_t)r * K;
    if (tid == 0) {
        ts.path[0] = 0;
        ts.plen = 1;
    }
    // Thread 0's walk state (only thread 0 reads or writes these).
    int k = 0;
    double z = 1.0, d = 1.0;
    unsigned tried = 0u;
    int tok = 0;
    for (;;) {
        __syncthreads();
        const int node = ts.path[ts.plen - 1];
        const u64 pos = F + 1 + (u64)(ts.plen - 1);
        const float* prow = p + ((size_t)r * cols + node) * (size_t)vocab;
        const int g = has_greedy ? greedy[(size_t)r * cols + node] : -1;
        const bool onehot = g >= 0 && g < vocab;
        if (tid == 0) {
            int nk = 0;
            for (int i = node + 1; i < N; ++i) {
                if (par_row[i - 1] == node) ts.kids[nk++] = i;
            }
            ts.nk = nk;
            ts.have_m = 0;
        }
        __syncthreads();
        if (ts.nk == 0) {
            // A leaf: the bonus from p.
            const float u = dflash_unit_f32(dflash_rng_word(seed, pos, CA_PURPOSE_BONUS, 0u));
            if (onehot) {
                tok = g;
            } else {
                tok = ca_draw(sh, prow, g, vocab, 0, 0, u);
                if (tok < 0) tok = 0;
            }
            break;
        }
        if (tid < CA_TOP) {
            const size_t sb = ((size_t)r * K + node) * CA_TOP;
            const int v = ids[sb + tid];
            sh.ids[tid] = v;
            sh.q[tid] = q[sb + tid];
            sh.w[tid] = (v >= 0 && v < vocab) ? ca_p(prow, g, v) : 0.0;
        }
        __syncthreads();
        if (tid == 0) {
            k = 0;
            z = 1.0;
            d = 1.0;
            tried = 0u;
            ts.state = ta_test_children(ts, sh, tok_row, seed, pos, &k, &z, &d, &tried);
        }
        __syncthreads();
        while (ts.state == 0) {
            // Z for the next test: M (once per node), then thread 0 adds the slot weights.
            if (!ts.have_m) {
                if (onehot || (has_greedy && g >= vocab)) {
                    if (tid == 0) {
                        bool in_slots = false;
                        for (int s = 0; s < CA_TOP; ++s) in_slots |= sh.ids[s] == g;
                        ts.m = (onehot && !in_slots) ? 1.0 : 0.0;
                    }
                } else {
                    ca_tile_sums(sh, prow, g, vocab, 4, 0);
                    if (tid == 0) {
                        const int tiles = (vocab + CA_TILE - 1) / CA_TILE;
                        double m = 0.0;
                        for (int j = 0; j < tiles; ++j) m = __dadd_rn(m, sh.tile_sum[j]);
                        ts.m = m;
                    }
                }
                if (tid == 0) ts.have_m = 1;
            }
            __syncthreads();
            if (tid == 0) {
                double zz = ts.m;
                for (int s = 0; s < CA_TOP; ++s) zz = __dadd_rn(zz, sh.w[s]);
                z = zz;
                ts.state = ta_test_children(ts, sh, tok_row, seed, pos, &k, &z, &d, &tried);
            }
            __syncthreads();
        }
        if (ts.state == 1) continue;  // the walk moves to the accepted child
        // Every child rejected: the correction from the residual.
        const float u = dflash_unit_f32(dflash_rng_word(seed, pos, CA_PURPOSE_CORRECTION, 0u));
        if (onehot) {
            tok = g;
        } else {
            tok = ca_draw(sh, prow, g, vocab, 3, 0, u);
            if (tok < 0) tok = ca_draw(sh, prow, g, vocab, 0, 0, u);
            if (tok < 0) tok = 0;
        }
        break;
    }
    __syncthreads();
    const int A = ts.plen - 1;
    for (int j = tid; j < cols; j += blockDim.x) {
        out_tokens[(size_t)r * cols + j] =
            j < A ? tok_row[ts.path[j + 1] - 1] : (j == A ? tok : -1);
        path[(size_t)r * cols + j] = j <= A ? ts.path[j] : -1;
    }
    if (tid == 0) {
        accepted[r] = A;
        out_len[r] = A + 1;
    }
}
