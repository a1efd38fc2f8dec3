// softmax_attention: split-KV non-causal attention of a query block over a paged context and
// the block's own live K/V (contract: crates/dflash-ops/src/softmax_attention/mod.rs).
//
// This file also holds the body shared with sliding_window_attention: its launcher compiles
// this file followed by kernels/sliding_window_attention.cu as one module. The two ops differ
// only in the context map (pages here, a ring there) and the window (0 = none).
//
// Query rows. The Hq / Hkv query heads of one KV head times the live columns of one request
// share every K/V tile: query row m = i * G + hh (column i, head kvh * G + hh, G = Hq / Hkv).
// A block takes ATTN_ROWS = 64 such rows (four m16 MMA tiles, one per warp; more rows than 64
// (G * cols > 64) use further row blocks).
//
// Key list of a row. Context keys first: positions [ctx_lo, F) (paged: ctx_lo = 0; ring:
// ctx_lo = max(0, F - S + 1), the union of what the columns see), in tiles of KT keys; then
// the live block columns [0, L) in tiles of KT keys. Work follows the live context, not the
// capacity: with T = ceil(n_ctx / KT) + ceil(L / KT) tiles and `splits` blocks launched per
// (row, KV head, row block), each active split takes tps = ceil(T / splits) consecutive tiles;
// splits past ceil(T / tps) exit at once.
//
// Per tile (all threads): cp.async stages the KT K and V rows (16-byte chunks, zero-filled for
// invalid keys) STAGES - 1 tiles ahead of the one being computed (one barrier per tile).
// Each warp computes S = Q K^T for its 16 query rows (and its share of the tile's keys) with
// mma.m16n8k16 (BF16 in, FP32 accumulate), masks invisible keys (window, page holes, dead
// columns) to -inf, runs an online softmax in base 2 (scores pre-scaled by log2(e) / sqrt(D)
// against an integer base per row, raised lazily: attn_raise_base) and accumulates P V with the
// tensor cores, V used exactly as stored (attn_split_body says how P is represented). Context
// and block tiles run in two loops of one tile step instantiated for each (FP16 or BF16 P V),
// so neither issues the other's MMAs under predicates.
//
// sm_90a variant (this source compiled with ATTN_WGMMA for sm_90a; AttnWg): the splits of
// head dim 128 take their 64 query rows as one warpgroup (the launcher also gives them the
// blocks of 17 to 32 rows that the portable kernels split in key pairs; the rows past the
// live ones are zero in Q and masked, as everywhere). `_d128`: one warpgroup per block,
// 32-key tiles, 3 stages. `_d128_ks2`: a pair of warpgroups (256 threads, one block per SM)
// shares Q and every 64-key tile (warpgroup w takes keys 32 w .. 32 w + 31, 4 stages), each
// with its own online softmax; the second hands its state to the first through shared
// memory before the split writes its one partial (the launcher's SplitForm::pairs_pay says
// where that pays). Q and the K / V tiles are staged by the same cp.async code into the
// 128-byte swizzled layout (df_sw128_off, no padding); per tile one chain of 8 wgmma
// m64n32k16 (Q and K from shared memory) gives S, the softmax runs on the same fragments as
// above, and 4 wgmma m64n128k16 (P hi and lo from registers, V an MN-major shared operand)
// add P V; that group stays in flight until the next tile step's start, before the barrier
// that frees its stage. Numbers, masks, the workspace and the merge are the portable ones.
//
// Workspace (f32 words; item = ((r * cols + i) * Hq + h) * splits + s):
//   ws[2 * item] = m (the row's base: an integer in base-2 scaled units, at least the max
//   score minus ATTN_LAZY; -inf when no key was visible),
//   ws[2 * item + 1] = l (sum of 2^(score - m)),
//   ws[ML + item * D + d] = acc[d] (sum of 2^(score - m) * v[d]), ML = 2 * rows * cols * Hq * splits.
// Only the active splits of a row write their items; nothing else is written.
// The merge (a warp or a block per (head, column, row) item, see attn_merge_body) recomputes
// the row's plan from the same metadata (attn_plan on the row's extent), combines the active
// splits with exact power-of-two factors and writes +0.0 for dead columns.
//
// Launch. Where the device has programmatic dependent launch (sm_90 and later, see
// df_pdl_wait; CudaBackend::launch_ex) the merge is a dependent launch of the split, and
// the split of the warpgroup-pair form (SplitForm::dependent_launch) one of whatever kernel
// precedes it in the stream: its blocks can become resident while that kernel finishes.
// Every split block first waits for the kernel ahead (attn_split_start: a no-op for an
// ordinary launch) and then lets the merge start. The merge's blocks can become resident,
// and read their row's metadata and compute its plan, while the split still runs (as far as
// the SMs have room: the rest start as split blocks finish; that metadata is never written
// by the split, and its writers had finished before any split block let the merge start);
// each merge block lets the next kernel start at once (a dependent launch, such as the next
// call's split, waits before it reads anything) and then waits for the split's completion
// before it reads a partial or writes the output.

#define ATTN_THREADS 128  // threads of a portable split block (AttnWg::threads)
#define ATTN_ROWS 64
#define ATTN_MIN_BLOCKS 3  // resident blocks per SM the register budget is sized for
#define ATTN_NEG_INF __int_as_float((int)0xff800000u)  // -inf without <math.h> (NVRTC)
#define ATTN_NO_KEY ((int)0x80000000)                  // kpos of an invalid key
#define ATTN_LAZY 8.0f  // a row's base is raised only when a tile's max exceeds it by more

// 2^d for an integer-valued d <= 0: exact (a power of two built from its exponent bits); 0 for
// d < -126 and for d = -inf; NaN stays NaN.
__device__ __forceinline__ float attn_pow2(float d) {
    if (d >= -126.f) return __int_as_float(((int)d + 127) << 23);
    return d != d ? d : 0.f;
}

// The factor 2^(m - M) that moves a state of base m to base M >= m (both integers or -inf):
// exact, and 0 for a state that saw no key (m = -inf, whatever M is). Used by every rescale:
// the tile step, the key-split pair combination and the merge.
__device__ __forceinline__ float attn_scale(float m, float M) {
    return m == ATTN_NEG_INF ? 0.f : attn_pow2(m - M);
}

// The running base of a row (base-2 units) after a tile whose visible max is t: unchanged
// while t <= base + ATTN_LAZY (weights 2^(x - base) stay <= 2^ATTN_LAZY), else ceil(t). The
// base is therefore an integer (or -inf before any visible key), every rescale of the
// accumulators is an exact power of two, and where rescales happen does not change the result.
__device__ __forceinline__ float attn_raise_base(float base, float t) {
    return t > base + ATTN_LAZY ? ceilf(t) : base;
}

// 2^x (ex2.approx, results below 2^-126 flushed to zero: such a weight is zero in FP16 and
// negligible against the row's largest weight, which is > 2^-1).
__device__ __forceinline__ float attn_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Tile geometry for a padded head dimension DP (a multiple of 16, >= head_dim). Mirrored by
// `SplitForm::tile_keys` / `SplitForm::smem_bytes` in the launcher.
template <int DP>
struct AttnCfg {
    static constexpr int KT = DP <= 128 ? 32 : 16;     // keys per tile
    static constexpr int STAGES = DP <= 128 ? 3 : 2;   // cp.async pipeline depth
    static constexpr int LD = DP + 8;                  // smem row stride in elements (+16 B)
    static constexpr int NK = KT / 8;                  // key n8 tiles of S
    static constexpr int ND = DP / 8;                  // d n8 tiles of O
    static constexpr int KC = DP / 16;                 // k16 chunks of Q K^T
};

// Whether the split of (DP, KS) is an sm_90a warpgroup-MMA form (the module compiled with
// ATTN_WGMMA, for sm_90a): DP = 128, a block of 64 query rows as one warpgroup (KS = 1) or as
// a pair of warpgroups sharing each tile's keys (KS = 2). The launcher uses that module only
// for those forms (`attend::SplitForm`); every other entry of that module is the portable code.
template <int DP, int KS>
struct AttnWg {
#ifdef ATTN_WGMMA
    static constexpr bool value = DP == 128;
#else
    static constexpr bool value = false;
#endif
    // Threads, keys per tile, pipeline depth and the resident blocks per SM the register
    // budget is sized for (the portable AttnCfg values where !value). KS = 2: two warpgroups
    // of one block share every 64-key tile (32 keys each). Mirrored by the launcher's
    // `SplitForm::threads` / `tile_geometry` (and `WARPGROUP_BLOCKS_PER_SM`).
    static constexpr int threads = value ? 128 * KS : ATTN_THREADS;
    static constexpr int kt = value ? 32 * KS : AttnCfg<DP>::KT;
    static constexpr int stages = value ? (KS == 2 ? 4 : 3) : AttnCfg<DP>::STAGES;
    static constexpr int min_blocks = value && KS == 2 ? 1 : (DP == 256 ? 1 : ATTN_MIN_BLOCKS);
};
// Context addressing of the full layer: position p of the row lives in page table[p / ps],
// slot p % ps. `slot` returns the flat slot, or -1 when the page id is out of range (the key
// is then invisible). Tile-wise (see attn_split_body): `unit` is the page size and
// `unit_base(q)` the first slot of page q of the row (-1 when out of range), so that the keys
// of one page need one table read and no division.
struct AttnPagedCtx {
    const int* table_row;
    int page_size;
    int pages;
    __device__ __forceinline__ int unit() const { return page_size; }
    __device__ __forceinline__ int unit_base(int q) const {
        const int pg = table_row[q];
        return (pg < 0 || pg >= pages) ? -1 : pg * page_size;
    }
    __device__ __forceinline__ int slot(int p) const {
        const int b = unit_base(p / page_size);
        return b < 0 ? -1 : b + (p % page_size);
    }
};

// Block order of the split kernels: grid (kv_heads * row_blocks, rows, splits), so the linear
// block index is split-major (every (row, KV head, row block) item's split 0 first, then split
// 1, ...). A row's splits past its active count exit at once; in this order the blocks with
// work come first, and the hardware (which dispatches blocks by increasing linear index)
// spreads them evenly over the SMs instead of leaving some SMs one more busy block than others.

// Tiles of a row and how they are split: computed by the split body and by the merge entry
// points from the row's extent (AttnRow), so both agree on the active splits.
struct AttnPlan {
    int t_ctx;   // context tiles
    int tiles;   // context + block tiles
    int tps;     // tiles per split
    int active;  // splits with work
};

// The extent of row r: its clamped frontier F, its first context position ctx_lo (the
// context keys are [ctx_lo, F)) and its live columns L. Computed by an op's split entry and
// its merge entry from the same metadata (so both see the same plan).
struct AttnRow {
    int F, ctx_lo, L;
};

// Full layer: F = start_pos[r] clamped to [0, max_pages * page_size], no window (ctx_lo = 0).
__device__ __forceinline__ AttnRow softmax_attention_row(const int* start_pos, const int* live,
                                                         int r, int cols, int max_pages,
                                                         int page_size) {
    const long long cap = (long long)max_pages * page_size;  // <= i32::MAX (checked on the host)
    AttnRow w;
    w.F = (int)min(max((long long)start_pos[r], 0LL), cap);
    w.ctx_lo = 0;
    w.L = min(max(live[r], 0), cols);
    return w;
}

__device__ __forceinline__ AttnPlan attn_plan(long long n_ctx, int L, int kt, int splits) {
    AttnPlan p;
    p.t_ctx = (int)((n_ctx + kt - 1) / kt);
    p.tiles = p.t_ctx + (L + kt - 1) / kt;
    p.tps = (p.tiles + splits - 1) / splits;
    if (p.tps < 1) p.tps = 1;
    p.active = L > 0 ? (p.tiles + p.tps - 1) / p.tps : 0;
    return p;
}

// One split of one (row, KV head, row block). window > 0: local layer (|p_key - p_query| <
// window); window == 0: no window. F, ctx_lo, L are already clamped by the entry point.
//
// Warps (KS, a compile-time choice of the launcher). KS = 1: m-tile mt (16 query rows) of the
// block goes to warp mt. KS = 2 (at most 32 query rows, KT = 32): warps 2 mt and 2 mt + 1
// share m-tile mt and each takes half of every key tile; the pair's partial states are
// combined before the split writes its partial. Every warp's key share is a compile-time
// count (KT / KS keys).
// Masks. A tile whose keys are all valid and visible to every live column (a "full" tile:
// every context tile of the full layer but the last, the interior of a window) skips the
// per-key mask; the flag is one ballot of the tile's key list when it is staged.
// Scores. s = q.k in FP32; a tile's max is taken in base-2 units (max s * log2(e) / sqrt(D),
// rounded once); the row's base m follows attn_raise_base (an integer, raised only when a
// tile's max passes it by more than ATTN_LAZY), and a weight is 2^(fma(s, log2(e) / sqrt(D),
// -m)) <= 2^ATTN_LAZY. Rescales (and the pair and merge combinations) are exact powers of two.
// P. Two terms hi + lo of the type of the V they multiply: FP16 against the context's F16 V,
// BF16 against the block's BF16 V (hi = P rounded, lo = the rest rounded), so P keeps about
// 22 (FP16) or 16 (BF16) bits; one FP16 term alone (11 bits) would lose more than the output
// tolerance where the weighted values cancel. The softmax sum adds the same represented
// weights (hi + lo) in FP32, per thread over its keys, then over the quad of the row.
template <int DP, int KS, typename Ctx>
__device__ __forceinline__ void attn_split_body(
    const Ctx ctx, int F, int ctx_lo, int L, int window,
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_blk,
    const __nv_bfloat16* __restrict__ v_blk, const __nv_bfloat16* __restrict__ ctx_k,
    const __half* __restrict__ ctx_v, float* __restrict__ ws, int r, int kvh, int rb, int s,
    int rows, int cols, int q_heads, int kv_heads, int head_dim, int splits) {
    typedef AttnCfg<DP> C;
    typedef AttnWg<DP, KS> W;
    constexpr bool WG = W::value;
    constexpr int THREADS = W::threads, KT = W::kt, STAGES = W::stages;
    constexpr int LD = C::LD, NK = KT / 8, ND = C::ND;
    constexpr int NKW = NK / KS;  // key n8 tiles of one warp per tile
    static_assert(KS == 1 || (KS == 2 && KT == (WG ? 64 : 32)),
                  "key-split pairs need 32-key tiles (warpgroup pairs: 64-key tiles)");
    static_assert(NKW % 2 == 0, "a warp takes whole k16 chunks of P V");
    // Shared tiles: rows of LD elements (portable), or (WG) the 128-byte swizzled layout of
    // df_sw128_off without padding, from a 1024-byte-aligned base.
    constexpr int Q_EL = WG ? ATTN_ROWS * DP : ATTN_ROWS * LD;  // elements of the Q block
    constexpr int T_EL = WG ? KT * DP : KT * LD;                // elements of one K or V tile
    extern __shared__ __align__(16) unsigned char attn_smem[];
    unsigned char* smem0 = attn_smem;
    if (WG) smem0 += (1024u - (df_smem_u32(attn_smem) & 1023u)) & 1023u;
    __nv_bfloat16* Qs = reinterpret_cast<__nv_bfloat16*>(smem0);
    unsigned short* KVs = reinterpret_cast<unsigned short*>(Qs + Q_EL);  // [STAGES][K,V][T_EL]
    int* kpos = reinterpret_cast<int*>(KVs + 2 * STAGES * T_EL);      // [STAGES][KT]
    int* tfull = kpos + STAGES * KT;                                   // [STAGES]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, qd = lane & 3;
    const int group = q_heads / kv_heads;
    const float inv_group = 1.0f / (float)group;  // exact row / group for rows < 2^20
    const int n_ctx = F - ctx_lo;
    const AttnPlan plan = attn_plan(n_ctx, L, KT, splits);
    const long long ml_len = 2LL * rows * cols * q_heads * splits;
    const int row0 = rb * ATTN_ROWS;  // first query row of this block
    const int live_rows = min(ATTN_ROWS, group * L - row0);
    if (s >= plan.active || live_rows <= 0) return;
    const int t0 = s * plan.tps;
    const int t1 = min(plan.tiles, t0 + plan.tps);
    // 16-byte rows, compile-time chunking (WG: head_dim == DP, guaranteed by the launcher).
    const bool fast = WG || head_dim == DP;
    const bool vec = (head_dim & 7) == 0;
    const int slot_stride = kv_heads * head_dim;  // elements between context slots
    const int kvh_off = kvh * head_dim;
    const int unit = ctx.unit();

    // Zero the padding columns [head_dim, DP) of Q and every K/V stage once: loads never
    // write them, and Q K^T / P V then see exact zeros there.
    if (!fast) {
        for (int e = tid; e < (ATTN_ROWS + 2 * STAGES * KT) * (DP - head_dim); e += THREADS) {
            const int row = e / (DP - head_dim);
            const int c = head_dim + e % (DP - head_dim);
            if (row < ATTN_ROWS) Qs[row * LD + c] = __float2bfloat16_rn(0.0f);
            else KVs[(row - ATTN_ROWS) * LD + c] = 0;
        }
    }

    // Generic row copy (head dims below DP): chunk c of a row, zero-filled if !valid.
    const int chunks = vec ? head_dim / 8 : head_dim / 2;
    auto copy_chunk = [&](unsigned short* dst, const unsigned short* src, bool valid, int c) {
        if (vec) {
            df_cp_async16(df_smem_u32(dst + c * 8), valid ? (const void*)(src + c * 8) : (const void*)q,
                          valid);
        } else {
            reinterpret_cast<unsigned*>(dst)[c] = valid ? reinterpret_cast<const unsigned*>(src)[c] : 0u;
        }
    };
    auto q_src = [&](int m, bool& valid) -> const unsigned short* {
        const int gm = row0 + m;
        const int i = __float2int_rz(((float)gm + 0.5f) * inv_group);
        const int hh = gm - i * group;
        valid = i < L;
        return reinterpret_cast<const unsigned short*>(
            q + (((long long)r * cols + (valid ? i : 0)) * q_heads + kvh * group + hh) * head_dim);
    };

    // Q rows of this block (row m = i * G + hh), zero when past the live columns; only the
    // rows of the m16 tiles that live warps read (q_rows; WG: all 64, every warp computes).
    const int q_rows = WG ? ATTN_ROWS : (live_rows + 15) / 16 * 16;
    if (fast) {
        constexpr int CH = DP / 8, PER = ATTN_ROWS * CH / THREADS, MSTEP = THREADS / CH;
        const int c = tid % CH;
#pragma unroll
        for (int u = 0; u < PER; ++u) {
            const int m = tid / CH + u * MSTEP;
            if (m >= q_rows) break;  // m grows with u
            bool valid;
            const unsigned short* src = q_src(m, valid);
            const unsigned dst = WG ? df_smem_u32(Qs) + df_sw128_off(m, c, ATTN_ROWS)
                                    : df_smem_u32(Qs + m * LD + c * 8);
            df_cp_async16(dst, valid ? (const void*)(src + c * 8) : (const void*)q, valid);
        }
    } else {
        for (int e = tid; e < q_rows * chunks; e += THREADS) {
            const int m = e / chunks, c = e % chunks;
            bool valid;
            const unsigned short* src = q_src(m, valid);
            copy_chunk(reinterpret_cast<unsigned short*>(Qs + m * LD), src, valid, c);
        }
    }

    // Slot (or block column) of key t of tile tt, -1 when invalid. The context keys of one
    // tile are the consecutive positions p0 + t (p0 = ctx_lo + tt * KT); with q0 = p0 / unit,
    // r0 = p0 % unit and b0 = the first slot of unit q0, key t is b0 + r0 + t while r0 + t <
    // unit (the same page, or no ring wrap), else resolved alone. Tiles are staged in
    // increasing order t0, t0 + 1, ... (the prologue, then one per step), so (q0, r0) is
    // advanced by KT per staged tile instead of divided out, and b0 (a page-table read on the
    // full layer) is read one staged tile ahead: its latency overlaps a whole tile step.
    struct TileAddr { int r0, b0; };
    int nx_q = 0, nx_r = 0, nx_b = -1;  // (q0, r0, b0) of the next context tile to stage
    if (t0 < plan.t_ctx) {
        const int p0 = ctx_lo + t0 * KT;
        nx_q = p0 / unit;
        nx_r = p0 - nx_q * unit;
        nx_b = ctx.unit_base(nx_q);
    }
    // The address of tile tt (the next one to stage), then advance to tile tt + 1.
    auto next_tile_addr = [&](int tt) -> TileAddr {
        TileAddr a;
        a.r0 = unit;  // block tiles: unused
        a.b0 = -1;
        if (tt < plan.t_ctx) {
            a.r0 = nx_r;
            a.b0 = nx_b;
            nx_r += KT;
            while (nx_r >= unit) {  // once at most when unit >= KT
                nx_r -= unit;
                ++nx_q;
            }
            if (tt + 1 < plan.t_ctx) nx_b = ctx.unit_base(nx_q);
        }
        return a;
    };
    auto key_slot = [&](int tt, const TileAddr& a, int t) -> int {
        if (tt < plan.t_ctx) {
            const int o = tt * KT + t;  // offset in the context range (no overflow past F)
            if (o >= n_ctx) return -1;
            const int off = a.r0 + t;
            if (off < unit) return a.b0 < 0 ? -1 : a.b0 + off;
            return ctx.slot(ctx_lo + o);
        }
        const int j = (tt - plan.t_ctx) * KT + t;
        return j < L ? j : -1;
    };
    // This thread's rows and chunk of a staged tile (head_dim == DP, KT * DP / 8 >= threads):
    // keys ld_t + u * LD_KSTEP (u < LD_PER), chunk ld_c.
    constexpr int LD_CH = DP / 8;
    constexpr int LD_PER = KT * LD_CH / THREADS > 0 ? KT * LD_CH / THREADS : 1;
    constexpr int LD_KSTEP = THREADS / LD_CH > 0 ? THREADS / LD_CH : 1;
    const int ld_t = tid / LD_CH, ld_c = tid % LD_CH;
    // Stage tile tt into buffer st: K, V rows, their kpos (context: p - F in -n_ctx..-1;
    // block: the column; ATTN_NO_KEY when invalid) and the tile's full flag.
    // A context tile whose KT keys are valid consecutive slots of one unit (a "contiguous"
    // tile: every context tile of the benchmark shapes but the last and a ring's wrap) takes
    // one address and constant strides; the others resolve each key.
    auto load_tile = [&](int tt, int st) {
        unsigned short* Ks = KVs + (2 * st) * T_EL;
        unsigned short* Vs = KVs + (2 * st + 1) * T_EL;
        const bool is_ctx = tt < plan.t_ctx;
        const TileAddr ta = next_tile_addr(tt);
        const bool contiguous =
            is_ctx && ta.b0 >= 0 && ta.r0 + KT <= unit && (tt + 1) * KT <= n_ctx;
        const unsigned short* kbase = reinterpret_cast<const unsigned short*>(is_ctx ? ctx_k : k_blk);
        const unsigned short* vbase = is_ctx ? reinterpret_cast<const unsigned short*>(ctx_v)
                                             : reinterpret_cast<const unsigned short*>(v_blk);
        const long long blk0 = ((long long)r * cols) * slot_stride;  // block row r
        auto row_off = [&](int sl) -> long long {
            return (is_ctx ? 0LL : blk0) + (long long)sl * slot_stride + kvh_off;
        };
        if (fast && KT * LD_CH >= THREADS) {
            // WG: rows ld_t + u * LD_KSTEP share ld_t % 8 (LD_KSTEP is a multiple of 8), so
            // one swizzled chunk offset serves every u.
            static_assert(!WG || LD_KSTEP % 8 == 0, "swizzle phase constant over u");
            const unsigned sk = WG ? df_smem_u32(Ks) + df_sw128_off(ld_t, ld_c, KT)
                                   : df_smem_u32(Ks + ld_t * LD + ld_c * 8);
            // Row stride: LD elements (portable), 128 bytes inside a swizzled atom (WG).
            constexpr unsigned V_OFF = T_EL * 2, U_OFF = LD_KSTEP * (WG ? 64 : LD) * 2;
            if (contiguous) {
                const long long e0 = (long long)(ta.b0 + ta.r0 + ld_t) * slot_stride + kvh_off + ld_c * 8;
                const long long step_e = (long long)LD_KSTEP * slot_stride;
#pragma unroll
                for (int u = 0; u < LD_PER; ++u) {
                    df_cp_async16(sk + u * U_OFF, kbase + e0 + u * step_e, true);
                    df_cp_async16(sk + V_OFF + u * U_OFF, vbase + e0 + u * step_e, true);
                }
            } else {
                int sl[LD_PER];
#pragma unroll
                for (int u = 0; u < LD_PER; ++u) sl[u] = key_slot(tt, ta, ld_t + u * LD_KSTEP);
#pragma unroll
                for (int u = 0; u < LD_PER; ++u) {
                    const bool valid = sl[u] >= 0;
                    const long long off = valid ? row_off(sl[u]) + ld_c * 8 : 0;
                    df_cp_async16(sk + u * U_OFF, kbase + off, valid);
                    df_cp_async16(sk + V_OFF + u * U_OFF, vbase + off, valid);
                }
            }
        } else if (fast) {  // small tiles (DP = 16): one chunk per thread
            if (tid < KT * LD_CH) {
                const int sl = key_slot(tt, ta, ld_t);
                const bool valid = sl >= 0;
                const long long off = valid ? row_off(sl) + ld_c * 8 : 0;
                df_cp_async16(df_smem_u32(Ks + ld_t * LD + ld_c * 8), kbase + off, valid);
                df_cp_async16(df_smem_u32(Vs + ld_t * LD + ld_c * 8), vbase + off, valid);
            }
        } else {
            for (int e = tid; e < KT * chunks; e += THREADS) {
                const int t = e / chunks, c = e % chunks;
                const int sl = key_slot(tt, ta, t);
                const bool valid = sl >= 0;
                const long long off = valid ? row_off(sl) : 0;
                copy_chunk(Ks + t * LD, kbase + off, valid, c);
                copy_chunk(Vs + t * LD, vbase + off, valid, c);
            }
        }
        if (warp == 0) {  // warp 0 writes the key list (32 keys per pass) and the full flag
            bool all_valid = true;
#pragma unroll
            for (int t0k = 0; t0k < KT; t0k += 32) {
                const int t = t0k + lane;
                int kp = ATTN_NO_KEY;
                if (t < KT) {
                    const bool valid = contiguous || key_slot(tt, ta, t) >= 0;
                    if (valid) kp = is_ctx ? tt * KT + t - n_ctx : (tt - plan.t_ctx) * KT + t;
                    kpos[st * KT + t] = kp;
                }
                all_valid = __all_sync(0xffffffffu, t >= KT || kp != ATTN_NO_KEY) && all_valid;
            }
            // Context key kk (= p - F) is visible to column i iff kk - i > -window: the first
            // key and the last live column decide for the whole tile.
            const bool in_window = window == 0 || tt * KT - n_ctx - (L - 1) > -window;
            if (lane == 0) tfull[st] = is_ctx && all_valid && in_window;
        }
    };

    // Warp roles (see above): m-tile, key share. WG: warp w of warpgroup w / 4 holds rows
    // 16 (w % 4) .. of the wgmma fragments; warpgroup pairs (KS = 2) split every tile's keys.
    const int n_mt = (live_rows + 15) / 16;
    const int mt = WG ? warp % 4 : warp / KS;
    const int kbeg = (WG ? warp / 4 : warp % KS) * (KT / KS);
    const bool warp_live = mt < n_mt;
    const int mrow0 = mt * 16;
    int col_of[2];
    bool row_ok[2];
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
        const int gm = row0 + mrow0 + g + 8 * h2;
        col_of[h2] = __float2int_rz(((float)gm + 0.5f) * inv_group);
        row_ok[h2] = col_of[h2] < L;
    }
    float m_run[2] = {ATTN_NEG_INF, ATTN_NEG_INF};
    // Softmax sums of rows g (ls[0]) and g + 8 (ls[1]): FP32 sums of the represented weights
    // (hi + lo, exactly as P V sees them) of this thread's keys, until the quad's are added
    // after the last tile.
    float ls[2] = {0.f, 0.f};
    float o[ND][4];
#pragma unroll
    for (int dt = 0; dt < ND; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
    const float sl2 = 1.4426950408889634f / sqrtf((float)head_dim);

    // Prologue: Q with tile t0 (group 0), then tiles t0 + 1 .. t0 + STAGES - 2 (not unrolled:
    // one copy of load_tile less in the instruction stream).
#pragma unroll 1
    for (int s0 = 0; s0 < STAGES - 1; ++s0) {
        if (t0 + s0 < t1) load_tile(t0 + s0, s0);
        df_cp_commit();  // possibly empty
    }

    // The pieces of a tile step (inlined; CTX is a constant at every call, see the two loops
    // below, so each loop holds only its own P V chain: FP16 against F16 V, BF16 against BF16
    // V; one loop over both tile kinds issued both chains under predicates).
    // P (hi, lo) A fragments of a tile's k16 chunks; WG: the P V wgmma reads them, so they
    // stay untouched until its group retires.
    unsigned wg_a[NKW / 2][2][4];
    // WG: S = Q K^T (64 x this warpgroup's KT / KS keys of stage st) in 8 k16 steps, both
    // operands K-major swizzled tiles (k16 step kc: atom kc / 4, 32 bytes per step inside it,
    // = df_sw128_off(0, 2 kc, rows)); issued and committed as one group, not waited for.
    auto issue_s = [&](const int st, float (&sc)[NKW][4]) {
        if constexpr (WG) {
            const unsigned short* Ks = KVs + (2 * st) * T_EL;
            df_wg_fence();
#pragma unroll
            for (int kc = 0; kc < C::KC; ++kc) {
                const unsigned qa = df_smem_u32(Qs) + (kc >> 2) * (ATTN_ROWS * 128) + (kc & 3) * 32;
                const unsigned ka = df_smem_u32(Ks) + (kc >> 2) * (KT * 128) + kbeg * 128 + (kc & 3) * 32;
                df_wgmma_bf16(sc, df_wg_desc(qa, 16, 1024), df_wg_desc(ka, 16, 1024), kc > 0);
            }
            df_wg_commit();
        }
    };
    // Portable: S over this warp's keys of stage st with mma.sync.
    auto mma_s = [&](const int st, float (&sc)[NKW][4]) {
        const unsigned short* Ks = KVs + (2 * st) * T_EL;
#pragma unroll
        for (int j = 0; j < NKW; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
#pragma unroll
        for (int kc = 0; kc < C::KC; ++kc) {
            unsigned a0, a1, a2, a3;
            df_ldsm_x4(df_smem_u32(Qs + (mrow0 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + kc * 16 +
                                   (lane >> 4) * 8),
                       a0, a1, a2, a3);
#pragma unroll
            for (int np = 0; np < NKW / 2; ++np) {
                unsigned b0, b1, b2, b3;
                df_ldsm_x4(df_smem_u32(Ks + (kbeg + np * 16 + (lane & 7) + (lane >> 4) * 8) * LD +
                                       kc * 16 + ((lane >> 3) & 1) * 8),
                           b0, b1, b2, b3);
                df_mma_bf16(sc[2 * np], a0, a1, a2, a3, b0, b1);
                df_mma_bf16(sc[2 * np + 1], a0, a1, a2, a3, b2, b3);
            }
        }
    };
    // Mask (edge tiles only) and online softmax of the scores sc of stage st (per thread:
    // rows g, g + 8; a quad shares a row): the new base per row, the sums and accumulators
    // rescaled to it, and sc := the weights 2^(score - base).
    auto softmax = [&](const int st, const bool CTX, float (&sc)[NKW][4]) {
        const int* kp = kpos + st * KT + kbeg;
        const bool full = CTX && tfull[st] != 0;
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
            float mx = ATTN_NEG_INF;
            if (full) {
#pragma unroll
                for (int j = 0; j < NKW; ++j) mx = fmaxf(mx, fmaxf(sc[j][2 * h2], sc[j][2 * h2 + 1]));
            } else {
                const int i = col_of[h2];
#pragma unroll
                for (int j = 0; j < NKW; ++j) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int kk = kp[j * 8 + 2 * qd + e];
                        bool vis = row_ok[h2] && kk != ATTN_NO_KEY;
                        if (window > 0) {
                            // context: p - F_q > -window with p = F + kk, query at F + i;
                            // block: |j - i| < window.
                            vis = vis && (CTX ? (kk - i > -window) : (abs(kk - i) < window));
                        }
                        const float v = vis ? sc[j][2 * h2 + e] : ATTN_NEG_INF;
                        sc[j][2 * h2 + e] = v;
                        mx = fmaxf(mx, v);
                    }
                }
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = attn_raise_base(m_run[h2], mx * sl2);
            if (__any_sync(0xffffffffu, m_new != m_run[h2] && m_run[h2] != ATTN_NEG_INF)) {
                // The vote is the warp's: rows whose base did not change get 1, rows that saw no
                // key yet 0 (their sums are exact zeros, so a warp whose rows all saw none skips
                // the rescale: a split's first tile).
                const float corr = attn_scale(m_run[h2], m_new);
                ls[h2] *= corr;
#pragma unroll
                for (int dt = 0; dt < ND; ++dt) {
                    o[dt][2 * h2] *= corr;
                    o[dt][2 * h2 + 1] *= corr;
                }
            }
            m_run[h2] = m_new;
            const float base = m_new == ATTN_NEG_INF ? 0.f : m_new;
#pragma unroll
            for (int j = 0; j < NKW; ++j) {
                sc[j][2 * h2] = attn_exp2(fmaf(sc[j][2 * h2], sl2, -base));
                sc[j][2 * h2 + 1] = attn_exp2(fmaf(sc[j][2 * h2 + 1], sl2, -base));
            }
        }
    };
    // P of the weights sc as two terms hi + lo of V's type (wg_a), their represented sum added
    // to the row sums (each thread its own keys: the quad's sums are added after the last
    // tile), and (portable) O += P V with mma.sync over this warp's keys of stage st.
    auto pv = [&](const int st, const bool CTX, const float (&sc)[NKW][4]) {
        const unsigned short* Vs = KVs + (2 * st + 1) * T_EL;
#pragma unroll
        for (int kc2 = 0; kc2 < NKW / 2; ++kc2) {
            unsigned(&ah)[4] = wg_a[kc2][0];
            unsigned(&al)[4] = wg_a[kc2][1];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                // u: 0 = (row g, keys 2q..), 1 = (row g+8, ..), 2 = (row g, 8+2q..), 3 = (g+8, 8+..)
                const int j = 2 * kc2 + (u >> 1);
                const int h2 = u & 1;
                const float p0 = sc[j][2 * h2], p1 = sc[j][2 * h2 + 1];
                if (CTX) {
                    const __half2 ph = __floats2half2_rn(p0, p1);
                    const float2 hf = __half22float2(ph);
                    const __half2 pl = __floats2half2_rn(p0 - hf.x, p1 - hf.y);
                    const float2 lf = __half22float2(pl);
                    ah[u] = *reinterpret_cast<const unsigned*>(&ph);
                    al[u] = *reinterpret_cast<const unsigned*>(&pl);
                    ls[h2] += (hf.x + lf.x) + (hf.y + lf.y);
                } else {
                    const __nv_bfloat16 h0 = __float2bfloat16_rn(p0), h1 = __float2bfloat16_rn(p1);
                    const __nv_bfloat16 q0 = __float2bfloat16_rn(p0 - __bfloat162float(h0));
                    const __nv_bfloat16 q1 = __float2bfloat16_rn(p1 - __bfloat162float(h1));
                    ah[u] = df_pack_bf16(h0, h1);
                    al[u] = df_pack_bf16(q0, q1);
                    ls[h2] += (__bfloat162float(h0) + __bfloat162float(q0)) +
                              (__bfloat162float(h1) + __bfloat162float(q1));
                }
            }
            if constexpr (!WG) {  // WG: P V is one wgmma chain over the whole tile (issue_pv)
#pragma unroll
                for (int dp = 0; dp < ND / 2; ++dp) {
                    unsigned b0, b1, b2, b3;
                    df_ldsm_x4_trans(df_smem_u32(Vs + (kbeg + kc2 * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD +
                                                 dp * 16 + (lane >> 4) * 8),
                                     b0, b1, b2, b3);
                    if (CTX) {
                        df_mma_f16(o[2 * dp], ah[0], ah[1], ah[2], ah[3], b0, b1);
                        df_mma_f16(o[2 * dp + 1], ah[0], ah[1], ah[2], ah[3], b2, b3);
                        df_mma_f16(o[2 * dp], al[0], al[1], al[2], al[3], b0, b1);
                        df_mma_f16(o[2 * dp + 1], al[0], al[1], al[2], al[3], b2, b3);
                    } else {
                        df_mma_bf16(o[2 * dp], ah[0], ah[1], ah[2], ah[3], b0, b1);
                        df_mma_bf16(o[2 * dp + 1], ah[0], ah[1], ah[2], ah[3], b2, b3);
                        df_mma_bf16(o[2 * dp], al[0], al[1], al[2], al[3], b0, b1);
                        df_mma_bf16(o[2 * dp + 1], al[0], al[1], al[2], al[3], b2, b3);
                    }
                }
            }
        }
    };
    // WG: O (64 x 128) += P V from wg_a: V an MN-major swizzled tile; k16 step kc2 starts at
    // key row 16 kc2, and its two 64-column atoms are KT * 128 bytes apart (the leading byte
    // offset). Committed as one group, not waited for.
    auto issue_pv = [&](const int st, const bool CTX) {
        if constexpr (WG) {
            const unsigned short* Vs = KVs + (2 * st + 1) * T_EL;
            df_wg_fence();
#pragma unroll
            for (int kc2 = 0; kc2 < NKW / 2; ++kc2) {
                const u64 vd = df_wg_desc(df_smem_u32(Vs) + (kbeg + kc2 * 16) * 128, KT * 128, 1024);
#pragma unroll
                for (int part = 0; part < 2; ++part) {
                    if (CTX) df_wgmma_rs_f16_nt(o, wg_a[kc2][part], vd, 1);
                    else df_wgmma_rs_bf16_nt(o, wg_a[kc2][part], vd, 1);
                }
            }
            df_wg_commit();
        }
    };

    int tt = t0;
    const int tc = min(t1, plan.t_ctx);
    // One tile step: wait for tile tt, stage tile tt + STAGES - 1, then (live warps)
    // scores, mask, online softmax and P V. WG: the previous tile's P V group is retired
    // before the barrier that frees its stage, and the cp.async data are made visible to
    // the async proxy (wgmma operands) before it; this tile's group stays in flight until
    // the next step's start.
    auto step = [&](const int tt, const bool CTX) {
        const int st = (tt - t0) % STAGES;
        if (WG) df_wg_wait<0>();
        df_cp_wait<STAGES - 2>();
        if (WG) df_fence_proxy_async();
        __syncthreads();  // tile tt (and Q) visible to every thread; tile tt - 1's stage is free
        {
            const int nt = tt + STAGES - 1;  // into the stage of tile tt - 1
            if (nt < t1) load_tile(nt, (nt - t0) % STAGES);
            df_cp_commit();  // possibly empty: one group per step keeps the wait count
        }
        if (!WG && !warp_live) return;  // WG: every warp of the warpgroup issues the wgmma
        float sc[NKW][4];
        if constexpr (WG) {
            issue_s(st, sc);
            df_wg_wait<0>();
        } else {
            mma_s(st, sc);
        }
        softmax(st, CTX, sc);
        pv(st, CTX, sc);
        if constexpr (WG) issue_pv(st, CTX);
    };
    for (; tt < tc; ++tt) step(tt, true);
    for (; tt < t1; ++tt) step(tt, false);
    if (WG) df_wg_wait<0>();
    df_cp_wait<0>();
    // Row sums: each thread's sums of its keys, added over the quad that shares the row.
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
        ls[h2] += __shfl_xor_sync(0xffffffffu, ls[h2], 1);
        ls[h2] += __shfl_xor_sync(0xffffffffu, ls[h2], 2);
    }

    // Key-split pairs: the second warp of a pair (WG: the second warpgroup's warp of the same
    // m-tile) hands its state to the first through shared memory (the K/V stages are free
    // now; word e of lane l at [mt][e][l], conflict-free), which combines the two.
    if constexpr (KS == 2) {
        constexpr int XW = 4 * ND + 4;  // words per lane: m, l of two rows, the accumulators
        static_assert(4 * 32 * XW * 4 <= 2 * STAGES * T_EL * 2, "exchange fits in the stages");
        const bool second = WG ? warp >= 4 : (warp % 2) == 1;
        __syncthreads();  // every warp is done with the stages
        float* xch = reinterpret_cast<float*>(KVs) + (size_t)mt * 32 * XW + lane;
        if (warp_live && second) {
            xch[0] = m_run[0];
            xch[32] = m_run[1];
            xch[64] = ls[0];
            xch[96] = ls[1];
#pragma unroll
            for (int dt = 0; dt < ND; ++dt)
#pragma unroll
                for (int e = 0; e < 4; ++e) xch[32 * (4 + 4 * dt + e)] = o[dt][e];
        }
        __syncthreads();
        if (second) return;
        if (warp_live) {
#pragma unroll
            for (int h2 = 0; h2 < 2; ++h2) {
                const float m1 = xch[32 * h2];
                const float M = fmaxf(m_run[h2], m1);
                const float a0 = attn_scale(m_run[h2], M);
                const float a1 = attn_scale(m1, M);
                m_run[h2] = M;
                ls[h2] = ls[h2] * a0 + xch[32 * (2 + h2)] * a1;
#pragma unroll
                for (int dt = 0; dt < ND; ++dt) {
                    o[dt][2 * h2] = o[dt][2 * h2] * a0 + xch[32 * (4 + 4 * dt + 2 * h2)] * a1;
                    o[dt][2 * h2 + 1] =
                        o[dt][2 * h2 + 1] * a0 + xch[32 * (4 + 4 * dt + 2 * h2 + 1)] * a1;
                }
            }
        }
    }

    // Partials of this split: (m, l) per live query row and its accumulator row.
    if (!warp_live) return;
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
        const float l = ls[h2];
        if (!row_ok[h2]) continue;
        const int gm = row0 + mrow0 + g + 8 * h2;
        const int i = col_of[h2], h = kvh * group + (gm - i * group);
        const long long item = (((long long)r * cols + i) * q_heads + h) * splits + s;
        if (qd == 0) {
            ws[2 * item] = m_run[h2];
            ws[2 * item + 1] = l;
        }
        float* a = ws + ml_len + item * head_dim;
#pragma unroll
        for (int dt = 0; dt < ND; ++dt) {
            const int d = dt * 8 + 2 * qd;
            if (d < head_dim) {
                *reinterpret_cast<float2*>(a + d) = make_float2(o[dt][2 * h2], o[dt][2 * h2 + 1]);
            }
        }
    }
}

// Merge: out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over the row's `active` splits
// (M = max m_s; the bases are integers, so every factor is an exact power of two), RNE to bf16
// once; dead columns get +0.0. A block is ATTN_MERGE_WARPS warps; an item (head, column, row)
// takes WPI of them (a compile-time choice of the launcher, as PER):
// - WPI = ATTN_MERGE_WARPS (entry `_merge_s64`): one item per block, warp w sums the splits
//   s = w (mod WPI), and the warps' sums are added in warp order in shared memory;
// - WPI = 1 (entries `_merge_w8`, `_merge_w16`): one item per warp, ATTN_MERGE_WARPS items
//   (consecutive heads) per block, each warp summing all its item's splits: for calls with few
//   splits, where the block-per-item form keeps too few items' loads in flight per SM.
// After df_pdl_wait every load of a chunk of 128 elements is issued at once (one round trip):
// lane s reads (m, l) of splits s and s + 32, and each warp the 16-byte accumulator chunk (4
// consecutive elements per lane) of its PER splits (scalar loads when the partials are not
// 16-byte aligned); shuffles share the factors and each warp sums its splits in increasing s.
// An entry point takes at most WPI * PER splits. `active` comes from the entry point (the
// row's plan), never from the workspace.
#define ATTN_MAX_SPLITS 64
#define ATTN_MERGE_WARPS 4
template <int PER, int WPI>
__device__ __forceinline__ void attn_merge_body(const float* __restrict__ ws, int active, bool dead,
                                                __nv_bfloat16* __restrict__ out, int rows,
                                                int cols, int q_heads, int head_dim, int splits) {
    static_assert(WPI == 1 || WPI == ATTN_MERGE_WARPS, "a warp or a block per item");
    static_assert(PER * WPI <= ATTN_MAX_SPLITS, "at most ATTN_MAX_SPLITS splits");
    __shared__ float4 red[WPI == 1 ? 1 : ATTN_MERGE_WARPS][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wi = warp % WPI;  // this warp's share of its item
    const int h = blockIdx.x * (ATTN_MERGE_WARPS / WPI) + warp / WPI, i = blockIdx.y, r = blockIdx.z;
    // A dependent launch queued next (the next call's split) may start now: it waits for this
    // merge before it reads anything. Every warp then waits (also a dead column's): the merge
    // completes after the split, so work queued after the op sees both finished.
    df_pdl_launch_dependents();
    df_pdl_wait();
    if (h >= q_heads) return;  // WPI = 1: the last block's spare warps (no barrier follows)
    __nv_bfloat16* o = out + (((long long)r * cols + i) * q_heads + h) * head_dim;
    if (dead) {
        for (int d = wi * 32 + lane; d < head_dim; d += 32 * WPI) o[d] = f2bf(0.0f);
        return;
    }
    const long long ml_len = 2LL * rows * cols * q_heads * splits;
    const long long item0 = (((long long)r * cols + i) * q_heads + h) * splits;
    const int n_act = min(max(active, 0), min(splits, PER * WPI));
    float ms[2], ls[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        const int sp = lane + 32 * u;
        const float2 p = sp < n_act ? *reinterpret_cast<const float2*>(ws + 2 * (item0 + sp))
                                    : make_float2(ATTN_NEG_INF, 0.f);
        ms[u] = p.x;
        ls[u] = p.y;
    }
    const float* acc = ws + ml_len + item0 * head_dim;
    const bool vec = (head_dim & 3) == 0 && ((ml_len + item0 * head_dim) & 3) == 0;
    float4 v[PER];
    // This warp's splits' elements d0 .. d0 + 3 (zeros past the active splits and head_dim).
    auto load_chunk = [&](int c0) {
        const int d0 = c0 + 4 * lane;
        const float* a0 = acc + d0;
        const bool on = d0 < head_dim;
        if (vec) {  // one branch for all the loads (they stay in flight together)
#pragma unroll
            for (int j = 0; j < PER; ++j) {
                const int s = wi + j * WPI;  // s * head_dim < 2^31 (s < 64)
                v[j] = on && s < n_act ? *reinterpret_cast<const float4*>(a0 + s * head_dim)
                                       : make_float4(0.f, 0.f, 0.f, 0.f);
            }
        } else {
#pragma unroll
            for (int j = 0; j < PER; ++j) {
                const int s = wi + j * WPI;
                const float* a = a0 + s * head_dim;
                const bool ok = on && s < n_act;
                v[j].x = ok ? a[0] : 0.f;
                v[j].y = ok && d0 + 1 < head_dim ? a[1] : 0.f;
                v[j].z = ok && d0 + 2 < head_dim ? a[2] : 0.f;
                v[j].w = ok && d0 + 3 < head_dim ? a[3] : 0.f;
            }
        }
    };
    load_chunk(0);
    float mx = fmaxf(ms[0], ms[1]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    float w[2], den = 0.f;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        w[u] = attn_scale(ms[u], mx);  // 0 for a split that saw no key (and when all saw none)
        den = fmaf(w[u], ls[u], den);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) den += __shfl_xor_sync(0xffffffffu, den, off);
    const float inv_ok = den > 0.f ? 1.f : 0.f;  // no visible key at all: +0.0
    for (int c0 = 0;;) {  // uniform over the item's warps (shuffles and barriers)
        float4 n = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int s = wi + j * WPI;
            const float ws_s = __shfl_sync(0xffffffffu, s < 32 ? w[0] : w[1], s & 31);
            n.x = fmaf(ws_s, v[j].x, n.x);
            n.y = fmaf(ws_s, v[j].y, n.y);
            n.z = fmaf(ws_s, v[j].z, n.z);
            n.w = fmaf(ws_s, v[j].w, n.w);
        }
        if (WPI == 1) {
            // Lane l finishes elements c0 + 4l .. c0 + 4l + 3 (one 8-byte store when whole).
            const int d0 = c0 + 4 * lane;
            const __nv_bfloat16 b0 = f2bf(inv_ok != 0.f ? n.x / den : 0.f);
            const __nv_bfloat16 b1 = f2bf(inv_ok != 0.f ? n.y / den : 0.f);
            const __nv_bfloat16 b2 = f2bf(inv_ok != 0.f ? n.z / den : 0.f);
            const __nv_bfloat16 b3 = f2bf(inv_ok != 0.f ? n.w / den : 0.f);
            if (vec && d0 + 3 < head_dim) {
                *reinterpret_cast<uint2*>(o + d0) = make_uint2(df_pack_bf16(b0, b1), df_pack_bf16(b2, b3));
            } else {
                if (d0 < head_dim) o[d0] = b0;
                if (d0 + 1 < head_dim) o[d0 + 1] = b1;
                if (d0 + 2 < head_dim) o[d0 + 2] = b2;
                if (d0 + 3 < head_dim) o[d0 + 3] = b3;
            }
        } else {
            red[warp][lane] = n;
            __syncthreads();
            // Thread t finishes element c0 + t: the warps' sums in warp order.
            const int t = threadIdx.x;
            if (t < 128 && c0 + t < head_dim) {
                float num = 0.f;
#pragma unroll
                for (int k = 0; k < ATTN_MERGE_WARPS; ++k) num += reinterpret_cast<const float*>(red[k])[t];
                o[c0 + t] = f2bf(inv_ok != 0.f ? num / den : 0.0f);
            }
        }
        c0 += 128;
        if (c0 >= head_dim) break;
        if (WPI != 1) __syncthreads();
        load_chunk(c0);
    }
}

// The split entry points of attention op OP, as X(NAME, DP, KS): `OP_split_d{DP}` (KS = 1)
// and, for DP <= 128, `OP_split_d{DP}_ks2` (KS = 2: portable, key-split warp pairs for at
// most 32 query rows per block; sm_90a `_d128_ks2`, a pair of warpgroups). Threads and
// resident blocks per SM: AttnWg<DP, KS>. Mirrored by the launcher's `split_name`; both ops
// instantiate this one list.
#define ATTN_SPLIT_ENTRIES(X, OP)   \
    X(OP##_split_d16, 16, 1)        \
    X(OP##_split_d32, 32, 1)        \
    X(OP##_split_d64, 64, 1)        \
    X(OP##_split_d128, 128, 1)      \
    X(OP##_split_d256, 256, 1)      \
    X(OP##_split_d16_ks2, 16, 2)    \
    X(OP##_split_d32_ks2, 32, 2)    \
    X(OP##_split_d64_ks2, 64, 2)    \
    X(OP##_split_d128_ks2, 128, 2)

// First statement of every split entry (where the split is a programmatic dependent launch,
// see Launch above): wait until the kernel ahead in the stream has finished and its writes
// are visible (it may have written q, the block K / V, the context or the row metadata), then
// let the merge start (so the merge's pre-wait metadata reads also follow that kernel).
__device__ __forceinline__ void attn_split_start() {
    df_pdl_wait();
    df_pdl_launch_dependents();
}

// Full-layer entry: grid (kv_heads * row_blocks, rows, splits), AttnWg<DP, KS>::threads
// threads, dynamic shared memory SplitForm::smem_bytes (crates/dflash-ops, attend.rs).
template <int DP, int KS>
__device__ __forceinline__ void softmax_attention_split_entry(
    const __nv_bfloat16* q, const __nv_bfloat16* k_blk, const __nv_bfloat16* v_blk,
    const __nv_bfloat16* pages_k, const __half* pages_v, const int* page_table,
    const int* start_pos, const int* live, float* ws, int rows, int cols, int q_heads,
    int kv_heads, int head_dim, int pages, int page_size, int max_pages, int splits,
    int row_blocks) {
    attn_split_start();
    const int s = blockIdx.z;  // split-major block order (see above)
    const int kvh = blockIdx.x / row_blocks, rb = blockIdx.x % row_blocks;
    const int r = blockIdx.y;
    const AttnRow w = softmax_attention_row(start_pos, live, r, cols, max_pages, page_size);
    AttnPagedCtx ctx;
    ctx.table_row = page_table + (long long)r * max_pages;
    ctx.page_size = page_size;
    ctx.pages = pages;
    attn_split_body<DP, KS>(ctx, w.F, w.ctx_lo, w.L, 0, q, k_blk, v_blk, pages_k, pages_v, ws, r,
                            kvh, rb, s, rows, cols, q_heads, kv_heads, head_dim, splits);
}

#define ATTN_FULL_ENTRY(NAME, DP, KS)                                                            \
    extern "C" __global__ void                                                                   \
    __launch_bounds__((AttnWg<DP, KS>::threads), (AttnWg<DP, KS>::min_blocks)) NAME(             \
        const __nv_bfloat16* q, const __nv_bfloat16* k_blk, const __nv_bfloat16* v_blk,          \
        const __nv_bfloat16* pages_k, const __half* pages_v, const int* page_table,              \
        const int* start_pos, const int* live, float* ws, int rows, int cols, int q_heads,       \
        int kv_heads, int head_dim, int pages, int page_size, int max_pages, int splits,         \
        int row_blocks) {                                                                        \
        softmax_attention_split_entry<DP, KS>(q, k_blk, v_blk, pages_k, pages_v, page_table,    \
                                              start_pos, live, ws, rows, cols, q_heads,         \
                                              kv_heads, head_dim, pages, page_size, max_pages,  \
                                              splits, row_blocks);                              \
    }
ATTN_SPLIT_ENTRIES(ATTN_FULL_ENTRY, softmax_attention)

// The merge entry points of attention op OP, as X(NAME, PER, WPI): `OP_merge_w8` and
// `OP_merge_w16` (a warp per item, at most 8 or 16 splits; grid x = ceil(Hq / 4)) and
// `OP_merge_s64` (a block per item, at most 64; grid x = Hq). Mirrored by the launcher's
// `merge_entry`.
#define ATTN_MERGE_ENTRIES(X, OP) \
    X(OP##_merge_w8, 8, 1)        \
    X(OP##_merge_w16, 16, 1)      \
    X(OP##_merge_s64, 16, ATTN_MERGE_WARPS)

// grid (x, cols, rows) as above; 32 * ATTN_MERGE_WARPS threads; `kt` = the split's AttnCfg<DP>::KT
// (attend::tile_keys). Row metadata is read before df_pdl_wait: the split never writes it.
#define ATTN_FULL_MERGE_ENTRY(NAME, PER, WPI)                                                     \
    extern "C" __global__ void __launch_bounds__(32 * ATTN_MERGE_WARPS) NAME(                    \
        const float* ws, const int* start_pos, const int* live, __nv_bfloat16* out, int rows,    \
        int cols, int q_heads, int head_dim, int max_pages, int page_size, int splits, int kt) { \
        const AttnRow w =                                                                        \
            softmax_attention_row(start_pos, live, blockIdx.z, cols, max_pages, page_size);      \
        const AttnPlan plan = attn_plan(w.F - w.ctx_lo, w.L, kt, splits);                        \
        attn_merge_body<PER, WPI>(ws, plan.active, (int)blockIdx.y >= w.L, out, rows, cols,     \
                                  q_heads, head_dim, splits);                                    \
    }
ATTN_MERGE_ENTRIES(ATTN_FULL_MERGE_ENTRY, softmax_attention)
