// sliding_window_attention: split-KV non-causal attention of a query block over a ring
// context and the block's own live K/V, limited to |p_key - p_query| < S
// (contract: crates/dflash-ops/src/sliding_window_attention/mod.rs).
//
// The launcher compiles kernels/softmax_attention.cu first and this file after it: the split
// body (attn_split_body), the merge body, the tiling and the workspace layout are shared with
// the full layer and documented there. Only the context map and the window differ.

// Context addressing of a local layer: position p of the row lives in ring slot
// lane * S + p mod S (the caller's live interval is [max(0, F - S), F)).
// Tile-wise (see attn_split_body): the unit is the ring capacity S, and every unit starts at
// the lane's base.
struct AttnRingCtx {
    int base;    // lane * S (lanes * S <= i32::MAX: checked on the host)
    int window;  // S
    __device__ __forceinline__ int unit() const { return window; }
    __device__ __forceinline__ int unit_base(int) const { return base; }
    __device__ __forceinline__ int slot(int p) const { return base + (p % window); }
};

// The extent of row r (see AttnRow): positions are i32 >= 0 and F + cols stays below 2^31 for
// any real frontier (F is clamped so the key arithmetic cannot overflow). The union over
// columns of the visible context is [max(0, F - S + 1), F) (column 0 sees the most); a row
// whose lane is out of range reads no context at all (ctx_lo = F). `base` = the lane's first
// ring slot.
__device__ __forceinline__ AttnRow sliding_window_attention_row(const int* start_pos, const int* live,
                                                                const int* lanes, int r, int cols,
                                                                int n_lanes, int window, int& base) {
    AttnRow w;
    w.F = min(max(start_pos[r], 0), 0x7fffffff - cols - 64);
    w.L = min(max(live[r], 0), cols);
    const int lane_id = lanes[r];
    const bool lane_ok = lane_id >= 0 && lane_id < n_lanes;
    w.ctx_lo = lane_ok ? max(w.F - window + 1, 0) : w.F;
    base = (lane_ok ? lane_id : 0) * window;
    return w;
}

// grid (kv_heads * row_blocks, rows, splits), AttnWg<DP, KS>::threads threads, dynamic shared
// memory SplitForm::smem_bytes; entry points as the full layer's (`_d{DP}`, `_d{DP}_ks2`).
template <int DP, int KS>
__device__ __forceinline__ void sliding_window_attention_split_entry(
    const __nv_bfloat16* q, const __nv_bfloat16* k_blk, const __nv_bfloat16* v_blk,
    const __nv_bfloat16* ring_k, const __half* ring_v, const int* lanes, const int* start_pos,
    const int* live, float* ws, int rows, int cols, int q_heads, int kv_heads, int head_dim,
    int n_lanes, int window, int splits, int row_blocks) {
    attn_split_start();
    const int s = blockIdx.z;  // split-major block order, as the full layer's
    const int kvh = blockIdx.x / row_blocks, rb = blockIdx.x % row_blocks;
    const int r = blockIdx.y;
    AttnRingCtx ctx;
    const AttnRow w = sliding_window_attention_row(start_pos, live, lanes, r, cols, n_lanes, window,
                                                   ctx.base);
    ctx.window = window;
    attn_split_body<DP, KS>(ctx, w.F, w.ctx_lo, w.L, window, q, k_blk, v_blk, ring_k, ring_v, ws, r,
                            kvh, rb, s, rows, cols, q_heads, kv_heads, head_dim, splits);
}

#define ATTN_RING_ENTRY(NAME, DP, KS)                                                            \
    extern "C" __global__ void                                                                   \
    __launch_bounds__((AttnWg<DP, KS>::threads), (AttnWg<DP, KS>::min_blocks)) NAME(             \
        const __nv_bfloat16* q, const __nv_bfloat16* k_blk, const __nv_bfloat16* v_blk,          \
        const __nv_bfloat16* ring_k, const __half* ring_v, const int* lanes,                     \
        const int* start_pos, const int* live, float* ws, int rows, int cols, int q_heads,       \
        int kv_heads, int head_dim, int n_lanes, int window, int splits, int row_blocks) {       \
        sliding_window_attention_split_entry<DP, KS>(q, k_blk, v_blk, ring_k, ring_v, lanes,     \
                                                     start_pos, live, ws, rows, cols, q_heads,   \
                                                     kv_heads, head_dim, n_lanes, window,        \
                                                     splits, row_blocks);                        \
    }
ATTN_SPLIT_ENTRIES(ATTN_RING_ENTRY, sliding_window_attention)

// grid and `kt` as the full layer's merge (entry points `_merge_w8`, `_merge_w16`,
// `_merge_s64`).
#define ATTN_RING_MERGE_ENTRY(NAME, PER, WPI)                                                     \
    extern "C" __global__ void __launch_bounds__(32 * ATTN_MERGE_WARPS) NAME(                    \
        const float* ws, const int* start_pos, const int* live, const int* lanes,                \
        __nv_bfloat16* out, int rows, int cols, int q_heads, int head_dim, int n_lanes,          \
        int window, int splits, int kt) {                                                        \
        int base;                                                                                \
        const AttnRow w = sliding_window_attention_row(start_pos, live, lanes, blockIdx.z, cols, \
                                                       n_lanes, window, base);                   \
        const AttnPlan plan = attn_plan(w.F - w.ctx_lo, w.L, kt, splits);                        \
        attn_merge_body<PER, WPI>(ws, plan.active, (int)blockIdx.y >= w.L, out, rows, cols,     \
                                  q_heads, head_dim, splits);                                    \
    }
ATTN_MERGE_ENTRIES(ATTN_RING_MERGE_ENTRY, sliding_window_attention)
