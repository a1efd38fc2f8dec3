// context_kv_materialize: store RoPE'd BF16 K and FP16(BF16(v)) V of the stored columns
// (contract: crates/dflash-ops/src/context_kv_materialize/mod.rs). The launcher prepends
// kernels/head_norm_rope.cu (head_norm_rope_warp) to this file.

// k_raw, v_raw: [rows*cols, kv_heads*d] FP32 (the gemm helper's output, unrounded).
// One warp per (row, col, kv head) item, blockDim.x a multiple of 32. Metadata out of range
// (refused on the CPU) makes the item skip its write, never write out of bounds.
// paged == 0: units = lanes, unit_len = ring capacity, slots = lane per row [rows].
// paged != 0: units = pages, unit_len = page_size, slots = page table [rows, max_pages].
extern "C" __global__ void context_kv_materialize_store(
    const float* __restrict__ k_raw, const float* __restrict__ v_raw,
    const __nv_bfloat16* __restrict__ key_norm, const int* __restrict__ start_pos,
    const int* __restrict__ counts, const int* __restrict__ slots,
    __nv_bfloat16* __restrict__ cache_k, __half* __restrict__ cache_v, int rows, int cols,
    int kv_heads, int d, int paged, int units, int unit_len, int max_pages, double theta,
    float eps) {
    const long long item = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const long long total = (long long)rows * cols * kv_heads;
    if (item >= total) return;  // every early exit below is uniform across the warp
    const int h = (int)(item % kv_heads);
    const long long rc = item / kv_heads;  // = r * cols + c
    const int c = (int)(rc % cols);
    const int r = (int)(rc / cols);
    int count = counts[r];
    if (count > cols) count = cols;
    if (c >= count) return;  // dead column (also every column when count <= 0)
    if (!paged && count - c > unit_len) return;  // before the ring's final window
    const int sp = start_pos[r];
    if (sp < 0) return;
    const long long p = (long long)sp + c;
    long long slot;
    if (!paged) {
        const int lane_id = slots[r];
        if (lane_id < 0 || lane_id >= units) return;
        slot = (long long)lane_id * unit_len + p % unit_len;
    } else {
        const long long idx = p / unit_len;
        if (idx >= max_pages) return;
        const int page = slots[(long long)r * max_pages + idx];
        if (page < 0 || page >= units) return;
        slot = (long long)page * unit_len + p % unit_len;
    }
    const long long kvd = (long long)kv_heads * d;
    const long long src = rc * kvd + (long long)h * d;
    const long long dst = slot * kvd + (long long)h * d;
    head_norm_rope_warp(k_raw + src, key_norm, cache_k + dst, p, d, theta, eps);
    const int lane = threadIdx.x & 31;
    for (int j = lane; j < d; j += 32) {
        cache_v[dst + j] = f2h(bf2f(f2bf(v_raw[src + j])));
    }
}
