// sliding_window_attention: split-KV non-causal attention of a query block over a ring
// context and the block's own live K/V, limited to |p_key - p_query| < S
// (contract: crates/dflash-ops/src/sliding_window_attention/mod.rs).
//
// The launcher compiles kernels/softmax_attention.cu first and this file after it: the split
// and merge bodies (attn_split_body, attn_merge_body) and the workspace layout are shared
// with the full layer and documented there.

// Context addressing of a local layer: position p of the row lives in ring slot
// lane * S + p mod S (the caller's live interval is [max(0, F - S), F)).
struct AttnRingCtx {
    long long base;  // lane * S
    int window;      // S
    __device__ __forceinline__ long long slot(long long p) const { return base + (p % window); }
};

// grid (splits, kv_heads, rows); block 32 * nwarps threads.
extern "C" __global__ void sliding_window_attention_split(
    const __nv_bfloat16* q, const __nv_bfloat16* k_blk, const __nv_bfloat16* v_blk,
    const __nv_bfloat16* ring_k, const __half* ring_v, const int* lanes, const int* start_pos,
    const int* live, float* ws, int rows, int cols, int q_heads, int kv_heads, int head_dim,
    int n_lanes, int window, int splits) {
    const int s = blockIdx.x;
    const int kvh = blockIdx.y;
    const int r = blockIdx.z;
    const long long F = max((long long)start_pos[r], 0LL);
    const int L = min(max(live[r], 0), cols);
    const int lane_id = lanes[r];
    // The union over columns of the visible context is [max(0, F - S + 1), F) (column 0 sees
    // the most); a row whose lane is out of range reads no context at all.
    long long ctx_lo = max(F - window + 1, 0LL);
    if (lane_id < 0 || lane_id >= n_lanes) ctx_lo = F;
    AttnRingCtx ctx;
    ctx.base = (long long)(lane_id < 0 || lane_id >= n_lanes ? 0 : lane_id) * window;
    ctx.window = window;
    attn_split_body(ctx, F, ctx_lo, L, window, q, k_blk, v_blk, ring_k, ring_v, ws, r, kvh, s,
                    rows, cols, q_heads, kv_heads, head_dim, splits);
}

// grid (rows * cols); block 256 threads.
extern "C" __global__ void sliding_window_attention_merge(const float* ws, const int* live,
                                                          __nv_bfloat16* out, int rows, int cols,
                                                          int q_heads, int head_dim, int splits) {
    attn_merge_body(ws, live, out, rows, cols, q_heads, head_dim, splits);
}
