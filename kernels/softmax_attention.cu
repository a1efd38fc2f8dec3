// softmax_attention: split-KV non-causal attention of a query block over a paged context and
// the block's own live K/V (contract: crates/dflash-ops/src/softmax_attention/mod.rs).
//
// This file also holds the device bodies shared with sliding_window_attention: its launcher
// compiles this file followed by kernels/sliding_window_attention.cu as one module.
//
// Work split. A row's key list is its context keys t in [0, n_ctx) (absolute position
// ctx_lo + t) followed by its live block keys t in [n_ctx, n_ctx + L) (block column
// t - n_ctx). Block (split s, KV head kvh, row r) takes keys [s*chunk, (s+1)*chunk) with
// chunk = ceil(n / splits) and, for every live column i and every query head h of the KV
// group, one warp runs an online softmax over the visible keys of the chunk and writes the
// partial (m, l, acc[D]) to the workspace. Layout (item = ((r*cols + i)*Hq + h)*splits + s):
//   ws[2*item] = m (max score, -inf when no key was visible), ws[2*item + 1] = l (sum of
//   exp(score - m)), ws[2*rows*cols*Hq*splits + item*D + d] = acc[d] (sum of exp(score-m)*v).
// The merge (one block per (row, column)) combines the splits exactly and writes +0.0 for
// dead columns.

#define ATTN_MAX_PAIRS 4  // head_dim <= 256: lane owns bf16 pairs lane + 32*u, u < 4
#define ATTN_NEG_INF __int_as_float((int)0xff800000u)  // -inf without <math.h> (NVRTC)

// Context addressing of the full layer: position p of the row lives in page table[p / ps],
// slot p % ps. Returns the flat slot, or -1 when the page id is out of range (skipped).
struct AttnPagedCtx {
    const int* table_row;
    int page_size;
    int pages;
    __device__ __forceinline__ long long slot(long long p) const {
        const int pg = table_row[p / page_size];
        if (pg < 0 || pg >= pages) return -1;
        return (long long)pg * page_size + (p % page_size);
    }
};

// One split of one (row, KV head): all live columns x all query heads of the group.
// window > 0: local layer (|p_key - p_query| < window); window == 0: no window.
template <typename Ctx>
__device__ __forceinline__ void attn_split_body(
    const Ctx ctx, long long F, long long ctx_lo, int L, int window,
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_blk,
    const __nv_bfloat16* __restrict__ v_blk, const __nv_bfloat16* __restrict__ ctx_k,
    const __half* __restrict__ ctx_v, float* __restrict__ ws, int r, int kvh, int s, int rows,
    int cols, int q_heads, int kv_heads, int head_dim, int splits) {
    const int group = q_heads / kv_heads;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nwarps = blockDim.x >> 5;
    const int npairs = head_dim >> 1;
    const long long n_ctx = F - ctx_lo;  // >= 0
    const long long n = n_ctx + L;
    const long long chunk = (n + splits - 1) / splits;
    const long long t0 = min(n, (long long)s * chunk);
    const long long t1 = min(n, t0 + chunk);
    const float scale = 1.0f / sqrtf((float)head_dim);
    const long long ml_len = 2LL * rows * cols * q_heads * splits;

    for (int it = warp; it < group * L; it += nwarps) {
        const int i = it / group;
        const int h = kvh * group + (it % group);
        const long long qoff = (((long long)r * cols + i) * q_heads + h) * head_dim;
        const __nv_bfloat162* q2 = reinterpret_cast<const __nv_bfloat162*>(q + qoff);
        float qf[2 * ATTN_MAX_PAIRS];
        float acc[2 * ATTN_MAX_PAIRS];
#pragma unroll
        for (int u = 0; u < ATTN_MAX_PAIRS; ++u) {
            const int pr = lane + 32 * u;
            float2 v = make_float2(0.f, 0.f);
            if (pr < npairs) v = __bfloat1622float2(q2[pr]);
            qf[2 * u] = v.x;
            qf[2 * u + 1] = v.y;
            acc[2 * u] = 0.f;
            acc[2 * u + 1] = 0.f;
        }
        float m = ATTN_NEG_INF;
        float l = 0.f;
        const long long pq = F + i;  // absolute query position
        for (long long t = t0; t < t1; ++t) {
            // Everything deciding visibility is uniform across the warp.
            const bool is_ctx = t < n_ctx;
            long long off;
            if (is_ctx) {
                const long long p = ctx_lo + t;
                if (window > 0 && p <= pq - window) continue;  // distance >= window
                const long long slot = ctx.slot(p);
                if (slot < 0) continue;
                off = (slot * kv_heads + kvh) * head_dim;
            } else {
                const int j = (int)(t - n_ctx);
                if (window > 0 && abs(j - i) >= window) continue;
                off = (((long long)r * cols + j) * kv_heads + kvh) * head_dim;
            }
            const __nv_bfloat162* k2 = reinterpret_cast<const __nv_bfloat162*>(
                (is_ctx ? ctx_k : k_blk) + off);
            float part = 0.f;
#pragma unroll
            for (int u = 0; u < ATTN_MAX_PAIRS; ++u) {
                const int pr = lane + 32 * u;
                if (pr < npairs) {
                    const float2 kk = __bfloat1622float2(k2[pr]);
                    part = fmaf(qf[2 * u], kk.x, part);
                    part = fmaf(qf[2 * u + 1], kk.y, part);
                }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
            const float sc = part * scale;
            const float m_new = fmaxf(m, sc);
            const float corr = expf(m - m_new);  // 0 when m == -inf
            const float w = expf(sc - m_new);
            l = fmaf(l, corr, w);
#pragma unroll
            for (int u = 0; u < ATTN_MAX_PAIRS; ++u) {
                const int pr = lane + 32 * u;
                if (pr < npairs) {
                    float2 vv;
                    if (is_ctx) {
                        vv = __half22float2(reinterpret_cast<const __half2*>(ctx_v + off)[pr]);
                    } else {
                        vv = __bfloat1622float2(
                            reinterpret_cast<const __nv_bfloat162*>(v_blk + off)[pr]);
                    }
                    acc[2 * u] = fmaf(acc[2 * u], corr, w * vv.x);
                    acc[2 * u + 1] = fmaf(acc[2 * u + 1], corr, w * vv.y);
                }
            }
            m = m_new;
        }
        const long long item = (((long long)r * cols + i) * q_heads + h) * splits + s;
        if (lane == 0) {
            ws[2 * item] = m;
            ws[2 * item + 1] = l;
        }
        float* a = ws + ml_len + item * head_dim;
#pragma unroll
        for (int u = 0; u < ATTN_MAX_PAIRS; ++u) {
            const int pr = lane + 32 * u;
            if (pr < npairs) {
                a[2 * pr] = acc[2 * u];
                a[2 * pr + 1] = acc[2 * u + 1];
            }
        }
    }
}

// Merge of one (row, column): out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s, RNE to
// bf16 once; dead columns (i >= live) get +0.0 in every element.
__device__ __forceinline__ void attn_merge_body(const float* __restrict__ ws,
                                                const int* __restrict__ live,
                                                __nv_bfloat16* __restrict__ out, int rows,
                                                int cols, int q_heads, int head_dim, int splits) {
    const int r = blockIdx.x / cols;
    const int i = blockIdx.x % cols;
    const int L = min(max(live[r], 0), cols);
    const int hd = q_heads * head_dim;
    __nv_bfloat16* o = out + ((long long)r * cols + i) * hd;
    if (i >= L) {
        for (int e = threadIdx.x; e < hd; e += blockDim.x) o[e] = f2bf(0.0f);
        return;
    }
    const long long ml_len = 2LL * rows * cols * q_heads * splits;
    for (int e = threadIdx.x; e < hd; e += blockDim.x) {
        const int h = e / head_dim;
        const int d = e - h * head_dim;
        const long long item0 = (((long long)r * cols + i) * q_heads + h) * splits;
        float mx = ATTN_NEG_INF;
        for (int s = 0; s < splits; ++s) mx = fmaxf(mx, ws[2 * (item0 + s)]);
        float num = 0.f;
        float den = 0.f;
        if (mx != ATTN_NEG_INF) {
            for (int s = 0; s < splits; ++s) {
                const float ms = ws[2 * (item0 + s)];
                if (ms == ATTN_NEG_INF) continue;  // neutral partial
                const float w = expf(ms - mx);
                den = fmaf(w, ws[2 * (item0 + s) + 1], den);
                num = fmaf(w, ws[ml_len + (item0 + s) * head_dim + d], num);
            }
        }
        o[e] = f2bf(den > 0.f ? num / den : 0.0f);
    }
}

// grid (splits, kv_heads, rows); block 32 * nwarps threads.
extern "C" __global__ void softmax_attention_split(
    const __nv_bfloat16* q, const __nv_bfloat16* k_blk, const __nv_bfloat16* v_blk,
    const __nv_bfloat16* pages_k, const __half* pages_v, const int* page_table,
    const int* start_pos, const int* live, float* ws, int rows, int cols, int q_heads,
    int kv_heads, int head_dim, int pages, int page_size, int max_pages, int splits) {
    const int s = blockIdx.x;
    const int kvh = blockIdx.y;
    const int r = blockIdx.z;
    const long long cap = (long long)max_pages * page_size;
    const long long F = min(max((long long)start_pos[r], 0LL), cap);
    const int L = min(max(live[r], 0), cols);
    AttnPagedCtx ctx;
    ctx.table_row = page_table + (long long)r * max_pages;
    ctx.page_size = page_size;
    ctx.pages = pages;
    attn_split_body(ctx, F, 0LL, L, 0, q, k_blk, v_blk, pages_k, pages_v, ws, r, kvh, s, rows,
                    cols, q_heads, kv_heads, head_dim, splits);
}

// grid (rows * cols); block 256 threads.
extern "C" __global__ void softmax_attention_merge(const float* ws, const int* live,
                                                   __nv_bfloat16* out, int rows, int cols,
                                                   int q_heads, int head_dim, int splits) {
    attn_merge_body(ws, live, out, rows, cols, q_heads, head_dim, splits);
}
