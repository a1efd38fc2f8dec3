// dynamic_grouped_conv: DFlash2's two-tap, group-16 convolution
// (contract: crates/dflash-ops/src/dynamic_grouped_conv/mod.rs).
// Layouts: x, prepared, z, residual, out [rows, cols, H]; base [2 sides, 2 taps, H];
// w_delta [4G, H] (k = s*2G + t*G + g); finish_delta [rows, cols, 2 taps, G]; G = H / 16.
// All arithmetic in f32; every stored value rounded once (RNE).

#define DGC_GROUP 16
#define DGC_COLS_PER_PASS 8

__device__ __forceinline__ float dgc_warp_sum(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;  // butterfly: every lane holds the identical total
}

// 1 / sqrt(mean(x^2) + eps) of one column of `hidden` values; whole warp calls, every lane
// gets the same value. Used by both prepare kernels, so both see bit-identical factors.
__device__ __forceinline__ float dgc_inv_rms(const __nv_bfloat16* xc, int hidden, float eps, int lane) {
    float s = 0.0f;
    for (int c = lane; c < hidden; c += 32) {
        float v = bf2f(xc[c]);
        s = fmaf(v, v, s);
    }
    s = dgc_warp_sum(s);
    return 1.0f / sqrtf(s / (float)hidden + eps);
}

// grid (ceil(4G / warps), rows), block = warps * 32 threads, dynamic shared: cols floats.
// Warp w of block (bx, row) computes projection row k = bx * warps + w for every column m of
// the request: delta[m, k] = inv_rms[m] * sum_c (w_delta[k, c] * norm_w[c]) * x[m, c].
// Side s = 0 (input side) goes, unrounded, to the f32 scratch `stash` at the head of the
// column's own row of `prepared` (float index col * H/2 + t*G + g; 2G <= H/2 floats fit in the
// row's H bf16 slots); side 1 is stored BF16 in finish_delta.
extern "C" __global__ void dynamic_grouped_conv_delta_kernel(
    const __nv_bfloat16* x, const __nv_bfloat16* norm_w, const __nv_bfloat16* w_delta,
    __nv_bfloat16* finish_delta, float* stash, int cols, int hidden, float eps) {
    extern __shared__ float dgc_inv[];  // [cols]
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    const int G = hidden / DGC_GROUP;
    const u64 row = blockIdx.y;
    const u64 H = (u64)hidden;
    const __nv_bfloat16* xrow = x + row * (u64)cols * H;

    for (int m = warp; m < cols; m += warps) {
        float v = dgc_inv_rms(xrow + (u64)m * H, hidden, eps, lane);
        if (lane == 0) dgc_inv[m] = v;
    }
    __syncthreads();

    const int k = blockIdx.x * warps + warp;
    if (k >= 4 * G) return;  // no barrier follows
    const int s = k / (2 * G);
    const int t = (k / G) % 2;
    const int g = k % G;
    const __nv_bfloat16* wk = w_delta + (u64)k * H;

    for (int m0 = 0; m0 < cols; m0 += DGC_COLS_PER_PASS) {
        float acc[DGC_COLS_PER_PASS];
        #pragma unroll
        for (int j = 0; j < DGC_COLS_PER_PASS; ++j) acc[j] = 0.0f;
        for (int c = lane; c < hidden; c += 32) {
            const float wc = bf2f(wk[c]) * bf2f(norm_w[c]);  // exact: 8 x 8 significant bits
            #pragma unroll
            for (int j = 0; j < DGC_COLS_PER_PASS; ++j) {
                if (m0 + j < cols) acc[j] = fmaf(wc, bf2f(xrow[(u64)(m0 + j) * H + c]), acc[j]);
            }
        }
        #pragma unroll
        for (int j = 0; j < DGC_COLS_PER_PASS; ++j) acc[j] = dgc_warp_sum(acc[j]);
        if (lane == 0) {
            #pragma unroll
            for (int j = 0; j < DGC_COLS_PER_PASS; ++j) {
                const int m = m0 + j;
                if (m < cols) {
                    const u64 col = row * (u64)cols + (u64)m;
                    const float d = acc[j] * dgc_inv[m];
                    if (s == 0) {
                        stash[col * (H / 2) + (u64)(t * G + g)] = d;
                    } else {
                        finish_delta[col * (u64)(2 * G) + (u64)(t * G + g)] = f2bf(d);
                    }
                }
            }
        }
    }
}

// grid (rows * cols), block >= 64 threads, dynamic shared: 2G floats. Block = one column.
// Reads the column's input-side delta from the scratch words at the head of its own row of
// `prepared`, synchronizes, then overwrites that row with the convolved values:
// prepared[i, c] = bf16((base[0,0,c] + d[0,g]) * n[i,c] + 1{i>=1} (base[0,1,c] + d[1,g]) * n[i-1,c]).
extern "C" __global__ void dynamic_grouped_conv_prepare_kernel(
    const __nv_bfloat16* x, const __nv_bfloat16* norm_w, const __nv_bfloat16* base,
    __nv_bfloat16* prepared, int cols, int hidden, float eps) {
    extern __shared__ float dgc_din[];  // [2G]: tap 0 then tap 1 of the input side
    __shared__ float dgc_col_inv[2];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int G = hidden / DGC_GROUP;
    const u64 H = (u64)hidden;
    const u64 col = blockIdx.x;
    const int i = (int)(col % (u64)cols);
    __nv_bfloat16* dst = prepared + col * H;
    const float* stash = (const float*)dst;
    const __nv_bfloat16* xc = x + col * H;

    if (warp == 0) {
        float v = dgc_inv_rms(xc, hidden, eps, lane);
        if (lane == 0) dgc_col_inv[0] = v;
    } else if (warp == 1) {
        float v = i >= 1 ? dgc_inv_rms(xc - H, hidden, eps, lane) : 0.0f;
        if (lane == 0) dgc_col_inv[1] = v;
    }
    for (int q = threadIdx.x; q < 2 * G; q += blockDim.x) dgc_din[q] = stash[q];
    __syncthreads();  // every scratch word is read before any thread overwrites the row

    const float inv0 = dgc_col_inv[0];
    const float inv1 = dgc_col_inv[1];
    for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
        const int g = c / DGC_GROUP;
        const float w = bf2f(norm_w[c]);
        const float n0 = w * bf2f(xc[c]) * inv0;
        float v = (bf2f(base[c]) + dgc_din[g]) * n0;
        if (i >= 1) {
            const float n1 = w * bf2f(xc[(long long)c - (long long)hidden]) * inv1;
            v = fmaf(bf2f(base[H + c]) + dgc_din[G + g], n1, v);
        }
        dst[c] = f2bf(v);
    }
}

// Elementwise over rows * cols * H: out = bf16(residual + (base[1,0,c] + fd[i,0,g]) * z[i,c]
// + 1{i>=1} (base[1,1,c] + fd[i,1,g]) * z[i-1,c]); the convolved value is not rounded.
extern "C" __global__ void dynamic_grouped_conv_finish_kernel(
    const __nv_bfloat16* z, const __nv_bfloat16* finish_delta, const __nv_bfloat16* base,
    const __nv_bfloat16* residual, __nv_bfloat16* out, u64 total, u64 cols, u64 hidden) {
    const u64 G = hidden / DGC_GROUP;
    const u64 step = (u64)gridDim.x * blockDim.x;
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += step) {
        const u64 col = e / hidden;
        const u64 c = e - col * hidden;
        const u64 i = col % cols;
        const u64 g = c / DGC_GROUP;
        const __nv_bfloat16* fd = finish_delta + col * 2 * G;
        float v = (bf2f(base[2 * hidden + c]) + bf2f(fd[g])) * bf2f(z[e]);
        if (i >= 1) v = fmaf(bf2f(base[3 * hidden + c]) + bf2f(fd[G + g]), bf2f(z[e - hidden]), v);
        out[e] = f2bf(bf2f(residual[e]) + v);
    }
}
