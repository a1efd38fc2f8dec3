// target_distribution: processed target distribution of every live verify column
// (contract: crates/dflash-ops/src/target_distribution/mod.rs).
//
// One cluster of TD_THREADS-thread blocks per (row, column) (df_cluster_blocks() blocks: the
// launcher's cluster size on sm_90 and later, else 1); two entries that differ only in the
// logits' dtype: target_distribution_kernel (f32) and target_distribution_bf16_kernel (bf16,
// each logit widened exactly to f32: its 16 bits become the high half of the f32's bits).
// Blocks x = column * nb + rank. Row r's column i is the logits column col_start[r] + i
// (starts = 1) or r * cols + i (starts = 0); a column outside the logits' logit_cols columns
// is treated as dead, so no logits read leaves the buffer. Block `rank` owns the chunks of
// TD_THREADS ids at rank * TD_THREADS + k * nb * TD_THREADS; thread t owns the id t of each
// chunk in every pass but the first, which with vec4 (the launcher's alignment condition)
// loads 4 consecutive ids of a chunk with one 16-byte load instead. A block only reads back
// the p elements it wrote itself, after a barrier (a sampled column's p row holds the
// processed logits z as scratch between passes; a greedy column stores nothing before its
// result). Every
// cross-block quantity is exact and identical in every block of the cluster: the argmax
// (merged with the lowest-id tie rule), the top-k counts and top-p masses (integer
// histograms summed over the blocks in shared memory read through the cluster), and S (each
// block's f64 part, summed in rank order by every block). Exact f32 steps use the _rn
// intrinsics so that no multiply-add is contracted.
//
// live_form = 0 (Full): every p element of the row's columns is written (greedy one-hot, dead
// zeros). live_form = 1 (Live): a greedy column writes greedy[r, i] = its argmax and nothing
// in p; a sampled column writes greedy[r, i] = -1 and its p row; a dead column writes nothing.
//
// History (read only where the row's penalties are not neutral): `proposals` holds the tokens
// of the nodes 1..cols-1 ([rows, cols-1]). has_parents = 0 (a chain): column i's history is
// proposals[r, 0..i]. has_parents = 1 (a tree): node j's parent is parents[r, j-1] and column
// i's history is the tokens of its root path i, par(i), .. excluding the anchor (node 0); a
// parent outside 0..j (not an earlier node) ends the walk as if it were the anchor, so the
// walk takes at most i steps and never leaves the row. `parents` is not read for a chain.

#define TD_THREADS 512
#define TD_MAX_COLS 256
#define TD_UNROLL 8
#define TD_VU 4
#define TD_MASS_SCALE 1099511627776.0
#define TD_MASS_ZERO -27.75

// Logit loads: f32 as stored, bf16 widened exactly (bf16 is the high half of an f32).
__device__ __forceinline__ float td_load(const float* __restrict__ x, size_t i) { return x[i]; }
__device__ __forceinline__ float td_load(const unsigned short* __restrict__ x, size_t i) {
    return __uint_as_float((u32)x[i] << 16);
}

// Four consecutive logits from i (i a multiple of 4, the row 16-byte aligned: the launcher's
// vec4 condition), each widened as td_load does.
__device__ __forceinline__ void td_load4(const float* __restrict__ x, size_t i, float (&o)[4]) {
    const float4 t = *reinterpret_cast<const float4*>(x + i);
    o[0] = t.x; o[1] = t.y; o[2] = t.z; o[3] = t.w;
}
__device__ __forceinline__ void td_load4(const unsigned short* __restrict__ x, size_t i,
                                         float (&o)[4]) {
    const uint2 t = *reinterpret_cast<const uint2*>(x + i);
    o[0] = __uint_as_float(t.x << 16); o[1] = __uint_as_float(t.x & 0xffff0000u);
    o[2] = __uint_as_float(t.y << 16); o[3] = __uint_as_float(t.y & 0xffff0000u);
}

// Order-preserving u32 key of a (non-NaN) f32: a < b  <=>  key(a) < key(b).
__device__ __forceinline__ u32 td_key(float z) {
    u32 b = __float_as_uint(z);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// (bv, bi) <- the better of itself and (v, i): larger value, ties to the lower id.
__device__ __forceinline__ void td_better(float& bv, int& bi, float v, int i) {
    if (v > bv || (v == bv && i < bi)) { bv = v; bi = i; }
}

// Steps 1-5 of the contract for id v with stored count cnt and logit l: the penalized,
// scaled z (the column's history is s_hist[0 .. hn)); with `penal` false (neutral penalties)
// the count and the history are not read.
__device__ __forceinline__ float td_z(int v, int cnt, float l, bool penal, const u32* s_filter,
                                      const int* s_hist, int hn, float rep, float freq,
                                      float pres, bool greedy, float T) {
    if (penal) {
        long long c = (long long)cnt;
        if ((s_filter[(v >> 5) & 31] >> (v & 31)) & 1u) {
            for (int j = 0; j < hn; ++j) c += (s_hist[j] == v) ? 1 : 0;
        }
        if (c > 0) {
            l = (l > 0.0f) ? __fdiv_rn(l, rep) : __fmul_rn(l, rep);
            l = __fsub_rn(l, __fadd_rn(__fmul_rn(freq, __ll2float_rn(c)), pres));
        }
    }
    const float z = greedy ? l : __fdiv_rn(l, T);
    return __fadd_rn(z, 0.0f);  // -0 -> +0
}

// f(v, z) for each of a thread's ids v < limit (from `first`, step `stride`), z being its p-row
// entry for v < zlimit (0 past it): the passes after the first read the z the block wrote
// into its p row, TD_UNROLL loads issued before the first use (one load at a time would wait
// a full memory latency an id).
template <typename F>
__device__ __forceinline__ void td_each_z(const float* out, int first, int stride, int limit,
                                          int zlimit, F&& f) {
    for (int v0 = first; v0 < limit; v0 += stride * TD_UNROLL) {
        float zs[TD_UNROLL];
#pragma unroll
        for (int u = 0; u < TD_UNROLL; ++u) {
            const int v = v0 + u * stride;
            zs[u] = v < zlimit ? out[v] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < TD_UNROLL; ++u) {
            const int v = v0 + u * stride;
            if (v >= limit) break;
            f(v, zs[u]);
        }
    }
}

// A thread's run of ids falling in one histogram bin, added with one shared-memory atomic when
// the bin changes (the z of a column crowd into a few bins: one atomic an id would serialize
// on them; integer sums, exact in any grouping). C: unsigned int counts or u64 masses.
template <typename C>
struct TdRun {
    u32 bin = 0u;
    C sum = 0;
    __device__ __forceinline__ void add(C* hist, u32 b, C x) {
        if (sum != 0 && b != bin) {
            atomicAdd(&hist[bin], sum);
            sum = 0;
        }
        bin = b;
        sum += x;
    }
    __device__ __forceinline__ void flush(C* hist) {
        if (sum != 0) atomicAdd(&hist[bin], sum);
    }
};

// Block-wide f64 sum (fixed tree order). s_red holds 33 doubles.
__device__ __forceinline__ double td_block_sum(double x, double* s_red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int off = 16; off > 0; off >>= 1) x = __dadd_rn(x, __shfl_down_sync(0xffffffffu, x, off));
    __syncthreads();  // previous readers of s_red are done
    if (lane == 0) s_red[warp] = x;
    __syncthreads();
    if (warp == 0) {
        double t = lane < nw ? s_red[lane] : 0.0;
        for (int off = 16; off > 0; off >>= 1) t = __dadd_rn(t, __shfl_down_sync(0xffffffffu, t, off));
        if (lane == 0) s_red[32] = t;
    }
    __syncthreads();
    return s_red[32];
}

template <typename LT>
__device__ __forceinline__ void td_column(
    const LT* __restrict__ logits, long long logit_cols, const int* __restrict__ col_start,
    int starts, const int* __restrict__ live, const int* __restrict__ counts,
    const int* __restrict__ proposals, const int* __restrict__ parents,
    const float* __restrict__ temperature, const int* __restrict__ top_k,
    const float* __restrict__ top_p, const float* __restrict__ min_p,
    const float* __restrict__ rep_pen, const float* __restrict__ freq_pen,
    const float* __restrict__ pres_pen, float* __restrict__ p, int* __restrict__ greedy_out,
    int live_form, int rows, int cols, int vocab, int public_vocab, int vec4, int has_parents) {
    __shared__ int s_hist[TD_MAX_COLS];
    __shared__ int s_tok[TD_MAX_COLS];
    __shared__ int s_par[TD_MAX_COLS];
    __shared__ int s_hn;
    __shared__ u32 s_filter[32];
    // Read by the cluster's other blocks: this block's best, its top-k counts and top-p
    // masses (two buffers, alternating by pass, so that one cluster barrier a pass suffices:
    // a buffer is cleared again only after every block has passed the barrier of the pass
    // after the one that read it) and its part of S.
    __shared__ float s_cbv;
    __shared__ int s_cbi;
    __shared__ unsigned int s_count[2][256];
    __shared__ unsigned long long s_mass[2][256];
    __shared__ double s_csum;
    // This block's own.
    __shared__ unsigned long long s_tot[256];
    __shared__ double s_red[33];
    __shared__ float s_bv[32];
    __shared__ int s_bi[32];
    __shared__ float s_zmax;
    __shared__ int s_amax;
    __shared__ u32 s_prefix;
    __shared__ u32 s_rem;
    __shared__ unsigned long long s_above;
    __shared__ double s_target;

    const unsigned nb = df_cluster_blocks(), rank = df_cluster_rank();
    const int column = blockIdx.x / nb;
    const int r = column / cols;
    const int i = column % cols;
    // Everything below that returns early does so for every block of the cluster (it
    // depends on the column only), so every barrier is reached by all of them.
    if (r >= rows) return;
    const int tid = threadIdx.x, nt = blockDim.x;
    const int first = (int)rank * nt + tid;  // this thread's first id
    const int stride = (int)nb * nt;         // and the step between its ids
    const size_t base = ((size_t)r * cols + i) * (size_t)vocab;
    float* out = p + base;
    int q = live[r];
    q = q < 0 ? 0 : (q > cols ? cols : q);
    // The logits column of (r, i); outside the buffer: dead.
    const long long lc = starts ? (long long)col_start[r] + i : (long long)r * cols + i;
    if (i >= q || lc < 0 || lc >= logit_cols) {  // dead column: no barrier, nothing shared
        if (!live_form) {
            for (int v = first; v < vocab; v += stride) out[v] = 0.0f;
        }
        return;
    }

    const float T = temperature[r];
    const bool greedy = !(T > 0.0f);
    const float rep = rep_pen[r], freq = freq_pen[r], pres = pres_pen[r];
    // Neutral penalties (rep 1, freq 0, pres 0): every step that reads a count leaves the
    // logit unchanged exactly (l / 1, l * 1 and l - (0 * c + 0) are l), so neither the counts
    // nor the history are read (uniform over the cluster: it depends on the row only).
    const bool penal = !(rep == 1.0f && freq == 0.0f && pres == 0.0f);

    // History of this column, s_hist[0 .. hn) (hn <= i <= cols - 1 < TD_MAX_COLS), and a
    // 1024-bit filter of it (bit d & 1023 of each of its tokens d): an id whose bit is clear is
    // in no history token, so its count is counts[r, v] alone and the history is scanned only
    // for the few ids it flags. The 32 ids of a warp share one filter word (their v >> 5 is the
    // same), a broadcast.
    int hn = i;
    if (penal) {
        if (tid < 32) s_filter[tid] = 0u;
        const size_t hrow = (size_t)r * (cols - 1);
        if (has_parents) {
            // A tree: the tokens and parents of nodes 1..i, staged by the whole block; then one
            // thread walks node i's root path in shared memory (each step to a smaller node, so
            // at most i steps), writing its tokens to s_hist[0 ..).
            for (int j = tid; j < i; j += nt) {
                s_tok[j] = proposals[hrow + j];
                s_par[j] = parents[hrow + j];
            }
            __syncthreads();
            if (tid == 0) {
                int len = 0;
                for (int n = i; n >= 1;) {
                    const int d = s_tok[n - 1];
                    const int up = s_par[n - 1];
                    s_hist[len++] = d;
                    s_filter[(d >> 5) & 31] |= 1u << (d & 31);
                    n = (up >= 0 && up < n) ? up : 0;  // not an earlier node: the anchor
                }
                s_hn = len;
            }
        } else {
            // A chain: the prefix d_1..d_i.
            __syncthreads();
            for (int j = tid; j < i; j += nt) {
                const int d = proposals[hrow + j];
                s_hist[j] = d;
                atomicOr(&s_filter[(d >> 5) & 31], 1u << (d & 31));
            }
        }
        __syncthreads();
        if (has_parents) hn = s_hn;
    }

    const int* crow = counts + (size_t)r * vocab;
    const LT* lrow = logits + (size_t)lc * (size_t)vocab;

    // Pass 1: the lowest-id argmax and, for a sampled column, z into its p row (scratch).
    float bv = __int_as_float((int)0xff800000u);  // -inf without <math.h> (NVRTC)
    int bi = 0x7fffffff;
    if (vec4) {
        // 16-byte loads: the block's ids are its chunks of TD_THREADS ids (rank * TD_THREADS
        // + jj * stride, jj = 0, 1, ..), as in the scalar mapping, but thread t loads the 4
        // ids 4 * (t % 128) .. + 3 of chunk 4 * it + t / 128 (it = 0, 1, ..), TD_VU chunks
        // at once. Its z reach the block's other threads through the barrier below.
        const int sub = tid >> 7, off4 = (tid & 127) * 4;
        const int c0 = (int)rank * nt + off4;
        for (int it0 = 0; c0 + (4 * it0 + sub) * stride < public_vocab; it0 += TD_VU) {
            float lv[TD_VU][4];
            int cv[TD_VU][4];
#pragma unroll
            for (int u = 0; u < TD_VU; ++u) {
                const int v4 = c0 + (4 * (it0 + u) + sub) * stride;
                if (v4 + 3 < public_vocab) {
                    td_load4(lrow, (size_t)v4, lv[u]);
                    if (penal) {
                        const int4 t = *reinterpret_cast<const int4*>(crow + v4);
                        cv[u][0] = t.x; cv[u][1] = t.y; cv[u][2] = t.z; cv[u][3] = t.w;
                    }
                } else {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        if (v4 + e < public_vocab) {
                            lv[u][e] = td_load(lrow, (size_t)(v4 + e));
                            if (penal) cv[u][e] = crow[v4 + e];
                        }
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < TD_VU; ++u) {
                const int v4 = c0 + (4 * (it0 + u) + sub) * stride;
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int v = v4 + e;
                    if (v < public_vocab) {
                        const float z = td_z(v, penal ? cv[u][e] : 0, lv[u][e], penal, s_filter,
                                             s_hist, hn, rep, freq, pres, greedy, T);
                        if (!greedy) out[v] = z;
                        td_better(bv, bi, z, v);
                    }
                }
            }
        }
    } else {
        // TD_UNROLL ids a thread at once: their count and logit loads are all issued before
        // the first is used (the loads in flight set a block's rate).
        for (int v0 = first; v0 < public_vocab; v0 += stride * TD_UNROLL) {
            int cv[TD_UNROLL];
            float lv[TD_UNROLL];
#pragma unroll
            for (int u = 0; u < TD_UNROLL; ++u) {
                const int v = v0 + u * stride;
                if (v < public_vocab) {
                    if (penal) cv[u] = crow[v];
                    lv[u] = td_load(lrow, (size_t)v);
                }
            }
#pragma unroll
            for (int u = 0; u < TD_UNROLL; ++u) {
                const int v = v0 + u * stride;
                if (v < public_vocab) {
                    const float z = td_z(v, penal ? cv[u] : 0, lv[u], penal, s_filter, s_hist,
                                         hn, rep, freq, pres, greedy, T);
                    if (!greedy) out[v] = z;
                    td_better(bv, bi, z, v);
                }
            }
        }
    }
    for (int off = 16; off > 0; off >>= 1) {
        float ov = __shfl_down_sync(0xffffffffu, bv, off);
        int oi = __shfl_down_sync(0xffffffffu, bi, off);
        td_better(bv, bi, ov, oi);
    }
    {
        const int lane = tid & 31, warp = tid >> 5, nw = nt >> 5;
        if (lane == 0) { s_bv[warp] = bv; s_bi[warp] = bi; }
        __syncthreads();
        if (tid == 0) {
            float b = s_bv[0];
            int id = s_bi[0];
            for (int w = 1; w < nw; ++w) td_better(b, id, s_bv[w], s_bi[w]);
            s_cbv = b;
            s_cbi = id;
        }
        df_cluster_sync();
        if (tid == 0) {
            float b = *df_cluster_peer(&s_cbv, 0u);
            int id = *df_cluster_peer(&s_cbi, 0u);
            for (unsigned k = 1; k < nb; ++k) {
                td_better(b, id, *df_cluster_peer(&s_cbv, k), *df_cluster_peer(&s_cbi, k));
            }
            s_zmax = b;
            s_amax = id;
        }
        __syncthreads();
    }
    const int amax = s_amax;

    if (greedy) {
        if (live_form) {
            if (rank == 0 && tid == 0) greedy_out[(size_t)r * cols + i] = amax;
        } else {
            for (int v = first; v < vocab; v += stride) out[v] = (v == amax) ? 1.0f : 0.0f;
        }
        df_cluster_sync();  // the other blocks have read s_cbv / s_cbi
        return;
    }
    if (live_form && rank == 0 && tid == 0) greedy_out[(size_t)r * cols + i] = -1;
    const double zmax = (double)s_zmax;

    // Top-k: radix select of the k-th largest key (multiplicity counted).
    u32 tk_key = 0;
    int pass = 0;  // selects the histogram buffer
    const int K = top_k[r];
    if (K > 0 && K < public_vocab) {
        u32 prefix = 0, mask = 0;
        if (tid == 0) s_rem = (u32)K;
        for (int shift = 24; shift >= 0; shift -= 8, ++pass) {
            unsigned int* mine = s_count[pass & 1];
            for (int b = tid; b < 256; b += nt) mine[b] = 0u;
            __syncthreads();
            TdRun<unsigned int> run;
            td_each_z(out, first, stride, public_vocab, public_vocab, [&](int, float z) {
                const u32 key = td_key(z);
                if ((key & mask) == prefix) run.add(mine, (key >> shift) & 255u, 1u);
            });
            run.flush(mine);
            df_cluster_sync();
            for (int b = tid; b < 256; b += nt) {
                unsigned long long c = 0ull;
                for (unsigned k = 0; k < nb; ++k) c += *df_cluster_peer(&mine[b], k);
                s_tot[b] = c;
            }
            __syncthreads();
            if (tid == 0) {
                u32 rem = s_rem;
                int pick = 0;
                for (int b = 255; b >= 0; --b) {
                    u32 c = (u32)s_tot[b];
                    if (c >= rem) { pick = b; break; }
                    rem -= c;
                }
                s_rem = rem;
                s_prefix = prefix | ((u32)pick << shift);
            }
            __syncthreads();
            prefix = s_prefix;
            mask |= 255u << shift;
        }
        tk_key = prefix;
    }

    // Top-p: radix select on fixed-point masses m = floor(e * 2^40) over the top-k set.
    u32 tp_key = 0;
    const float TP = top_p[r];
    if (TP < 1.0f) {
        u32 prefix = 0, mask = 0;
        for (int shift = 24; shift >= 0; shift -= 8, ++pass) {
            unsigned long long* mine = s_mass[pass & 1];
            for (int b = tid; b < 256; b += nt) mine[b] = 0ull;
            __syncthreads();
            // An id with z - zmax <= TD_MASS_ZERO has m = 0 (e * 2^40 <= exp(-27.75) * 2^40
            // < 0.98): it adds nothing, so no exp is spent on it (most of a real vocabulary).
            TdRun<unsigned long long> run;
            td_each_z(out, first, stride, public_vocab, public_vocab, [&](int, float z) {
                const u32 key = td_key(z);
                const double x = __dsub_rn((double)z, zmax);
                if (key >= tk_key && (key & mask) == prefix && x > TD_MASS_ZERO) {
                    const unsigned long long m =
                        (unsigned long long)__dmul_rn(exp(x), TD_MASS_SCALE);
                    run.add(mine, (key >> shift) & 255u, m);
                }
            });
            run.flush(mine);
            df_cluster_sync();
            for (int b = tid; b < 256; b += nt) {
                unsigned long long m = 0ull;
                for (unsigned k = 0; k < nb; ++k) m += *df_cluster_peer(&mine[b], k);
                s_tot[b] = m;
            }
            __syncthreads();
            if (tid == 0) {
                if (shift == 24) {
                    unsigned long long total = 0ull;
                    for (int b = 0; b < 256; ++b) total += s_tot[b];
                    s_target = __dmul_rn((double)TP, __ull2double_rn(total));
                    s_above = 0ull;
                }
                unsigned long long above = s_above;
                const double target = s_target;
                int pick = 0;
                for (int b = 255; b >= 0; --b) {
                    unsigned long long m = s_tot[b];
                    if (__ull2double_rn(above + m) >= target) { pick = b; break; }
                    above += m;
                }
                s_above = above;
                s_prefix = prefix | ((u32)pick << shift);
            }
            __syncthreads();
            prefix = s_prefix;
            mask |= 255u << shift;
        }
        tp_key = prefix;
    }

    // Min-p and the normalizer over the kept set: each block's part, then the parts in rank
    // order (the same S in every block).
    const u32 thr = tk_key > tp_key ? tk_key : tp_key;
    const double mp = (double)min_p[r];
    double part = 0.0;
    td_each_z(out, first, stride, public_vocab, public_vocab, [&](int, float z) {
        if (td_key(z) >= thr) {
            const double e = exp(__dsub_rn((double)z, zmax));
            if (e >= mp) part = __dadd_rn(part, e);
        }
    });
    const double block_part = td_block_sum(part, s_red);
    if (tid == 0) s_csum = block_part;
    df_cluster_sync();
    double S = 0.0;
    for (unsigned k = 0; k < nb; ++k) S = __dadd_rn(S, *df_cluster_peer(&s_csum, k));

    // Write pass (every id of the row: zeros past the public vocabulary).
    td_each_z(out, first, stride, vocab, public_vocab, [&](int v, float z) {
        float val = 0.0f;
        if (v < public_vocab && td_key(z) >= thr) {
            const double e = exp(__dsub_rn((double)z, zmax));
            if (e >= mp) val = __double2float_rn(__ddiv_rn(e, S));
        }
        out[v] = val;
    });
    df_cluster_sync();  // the other blocks have read s_csum
}

#define TD_ENTRY(NAME, LT)                                                                      \
    extern "C" __global__ void __launch_bounds__(TD_THREADS, 1) NAME(                            \
        const LT* __restrict__ logits, long long logit_cols, const int* __restrict__ col_start, \
        int starts, const int* __restrict__ live, const int* __restrict__ counts,               \
        const int* __restrict__ proposals, const int* __restrict__ parents,                     \
        const float* __restrict__ temperature, const int* __restrict__ top_k,                   \
        const float* __restrict__ top_p, const float* __restrict__ min_p,                       \
        const float* __restrict__ rep_pen, const float* __restrict__ freq_pen,                  \
        const float* __restrict__ pres_pen, float* __restrict__ p,                              \
        int* __restrict__ greedy_out, int live_form, int rows, int cols, int vocab,             \
        int public_vocab, int vec4, int has_parents) {                                          \
        td_column<LT>(logits, logit_cols, col_start, starts, live, counts, proposals, parents,  \
                      temperature, top_k, top_p, min_p, rep_pen, freq_pen, pres_pen, p,         \
                      greedy_out, live_form, rows, cols, vocab, public_vocab, vec4,             \
                      has_parents);                                                             \
    }

// The two entries (f32 and bf16 logits).
TD_ENTRY(target_distribution_kernel, float)
TD_ENTRY(target_distribution_bf16_kernel, unsigned short)
