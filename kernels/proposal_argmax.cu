// proposal_argmax: the proposal head GEMM fused with its per-column argmax; no [n, rows]
// logits in memory (contract: crates/dflash-ops/src/proposal_argmax/mod.rs).
//
// This file also holds the head GEMM drivers shared with unary_topk: its launcher compiles
// this file followed by kernels/unary_topk.cu as one module; the two ops differ only in the
// epilogue (a running argmax or a running top-16 per column). Compiled as is, the module is
// the portable variant (sm_80 and later); compiled with PH_WGMMA defined (for sm_90a) it is
// the wgmma + TMA variant, with the same entry-point names for NT = 8 and 16.
//
// Work split. The head's rows (the vocabulary, or a shortlist) are streamed once: block b of
// the grid owns the contiguous row range [b * chunk, (b + 1) * chunk) (chunk = ceil(rows /
// blocks) rounded up to 16) and walks it in tiles of PH_TV = 128 rows; grid.y splits the
// columns in chunks of NC = 8 * NT (NC <= 128). The K axis (hidden) is staged in chunks of
// KC = 64: the head tile (128 x 64) and the hidden tile (NC x 64) of a stage feed the tensor
// cores (BF16 in, FP32 accumulate; the head rows are the M side, the columns the N side).
// - Portable driver: a PH_STAGES-deep cp.async pipeline that runs across tile boundaries,
//   mma.m16n8k16 with each warp owning 32 rows of the tile (two m16 tiles).
// - sm_90a driver: a TMA producer warpgroup and mbarriers, two consumer warpgroups taking the
//   tiles in turn (see its comment), two m64nNCk16 wgmma chains per tile with warp w of a
//   warpgroup owning rows 16w.. of each 64-row half.
// After a tile's last chunk the epilogue folds its 128 x NC logits into the warpgroup's
// running per-column result in shared memory (they never leave the chip); at the end each
// warpgroup writes its partial per column, and a merge kernel reduces the partials. Order
// everywhere: larger logit, then lower global id (a total order, so the result does not
// depend on the reduction order). NaN logits rank as -inf.
//
// Partials (f32 words; P = gridDim.x * PH_CONSUMERS, b = blockIdx.x * PH_CONSUMERS + the
// warpgroup): ws[((col * P + b) * K + j) * 2] = value, ws[... + 1] = the global id's bits;
// K = 1 (argmax) or 16 (top-16, best first).

#define PH_THREADS 128  // threads of one consumer warpgroup: it runs the MMAs and an epilogue
#define PH_WARPS 4
// A consumer thread's index within its warpgroup, and the warpgroup (0 on the portable driver).
__device__ __forceinline__ int ph_tid() { return (int)(threadIdx.x & (PH_THREADS - 1)); }
__device__ __forceinline__ int ph_wg() { return (int)(threadIdx.x / PH_THREADS); }
#ifndef PH_WGMMA
#define PH_CONSUMERS 1
#define PH_BLOCK_THREADS PH_THREADS
#define PH_SYNC() __syncthreads()
#define PH_SYNC_OR(x) __syncthreads_or(x)
#else
#define PH_CONSUMERS 2  // consumer warpgroups, taking the block's tiles in turn
#define PH_BLOCK_THREADS ((PH_CONSUMERS + 1) * PH_THREADS)  // + the TMA producer warpgroup
// Registers per thread after the start (setmaxnreg): the producer warpgroup gives back what
// the consumers' accumulators and epilogue need (128 * 40 + 256 * 232 <= 384 * 168).
#define PH_PRODUCER_REGS 40
#define PH_CONSUMER_REGS 232
// Barriers of one consumer warpgroup only (named barrier 1 + its index; the producer never
// joins).
#define PH_SYNC() asm volatile("bar.sync %0, 128;\n" ::"r"(1 + ph_wg()) : "memory")
__device__ __forceinline__ int ph_sync_or(int v) {
    int r;
    asm volatile("{\n.reg .pred p, q;\nsetp.ne.s32 p, %1, 0;\nbar.red.or.pred q, %2, 128, p;\nselp.s32 %0, 1, 0, q;\n}\n"
                 : "=r"(r)
                 : "r"(v), "r"(1 + ph_wg())
                 : "memory");
    return r;
}
#define PH_SYNC_OR(x) ph_sync_or(x)
#endif
#define PH_TV 128
#define PH_MAX_PARTIALS 1024  // partial lists per column the workspace holds (MAX_PARTIAL_BLOCKS)
#define PH_NEG_INF __int_as_float(0xff800000)
#define PH_NO_ID 0x7fffffff

__device__ __forceinline__ bool ph_beats(float v, int id, float bv, int bid) {
    return v > bv || (v == bv && id < bid);
}

// Stage geometry for NT column tiles (NC = 8 * NT columns). Mirrored by the launcher
// (`head::pipe_bytes`). The portable driver pads smem rows to 72 elements (conflict-free
// ldmatrix); the wgmma driver stores 64-element rows in the 128-byte swizzled layout that its
// shared-memory descriptors name, 1024-byte aligned (hence the slack).
#ifndef PH_WGMMA
#define PH_STAGES 3
#define PH_EPI_STAGES(E) PH_STAGES  // every epilogue: the same pipeline depth
template <int NT, int S>
struct PhCfg {
    static constexpr int NC = 8 * NT;
    static constexpr int KC = 64;                       // K elements per stage
    static constexpr int LD = KC + 8;                   // smem row stride (elements, +16 B)
    static constexpr int W_ELEMS = PH_TV * LD;
    static constexpr int STAGE = W_ELEMS + NC * LD;     // bf16 elements per stage
    static constexpr int PIPE_BYTES = S * STAGE * 2;
};
#else
#define PH_EPI_STAGES(E) E::WG_STAGES  // the depth that leaves room for two epilogues
template <int NT, int S>
struct PhCfg {
    static constexpr int NC = 8 * NT;
    static constexpr int KC = 64;
    static constexpr int LD = KC;
    static constexpr int W_ELEMS = PH_TV * LD;
    static constexpr int STAGE = W_ELEMS + NC * LD;
    static_assert(STAGE * 2 % 1024 == 0, "every stage's boxes start 1024-byte aligned (the swizzle)");
    static constexpr int PIPE_BYTES = S * STAGE * 2 + 1024 + 2 * S * 8 + S * 4;  // + slack, mbarriers, tickets
};
#endif

// Row (within a 128-row tile) of accumulator element acc[mt][nt][2 * h + e] of this thread:
// the portable driver gives each warp 32 consecutive rows (two m16 tiles); the wgmma driver
// runs two m64 wgmma per warpgroup, so warp w holds rows 16w.. of each 64-row half.
__device__ __forceinline__ int ph_frag_row(int mt, int h) {
    const int lane = ph_tid() & 31, warp = ph_tid() >> 5;
#ifndef PH_WGMMA
    return warp * 32 + mt * 16 + (lane >> 2) + 8 * h;
#else
    return mt * 64 + warp * 16 + (lane >> 2) + 8 * h;
#endif
}

// What the epilogues need to know about the rows of a tile.
struct PhRows {
    const int* token_ids;  // nullptr: full head (id = row)
    int considered;        // full head: rows below this are candidates (public_vocab)
    // Candidate id of head row `row` of this block's range ending at `row_end`, or PH_NO_ID.
    __device__ __forceinline__ int id(long long row, long long row_end) const {
        if (row >= row_end) return PH_NO_ID;
        if (token_ids) return token_ids[row];
        return row < considered ? (int)row : PH_NO_ID;
    }
};

// Global head row of accumulator element acc[mt][nt][2 * h + e] of a tile starting at r0.
__device__ __forceinline__ long long ph_row(long long r0, int mt, int h) {
    return r0 + ph_frag_row(mt, h);
}

// The block's best (value, id) per column of this tile and warp, reduced over the warp's 32
// rows (whichever they are, see ph_frag_row); lanes with g == 0 hold the result for their columns 8 * nt + 2 * q + e.
template <int NT>
__device__ __forceinline__ void ph_warp_best(const float (&acc)[2][NT][4], const int (&ids)[2][2],
                                             float (&bv)[NT][2], int (&bi)[NT][2]) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            float v = PH_NEG_INF;
            int id = PH_NO_ID;
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float x = acc[mt][nt][2 * h + e];
                    const int xi = ids[mt][h];
                    if (x != x || xi == PH_NO_ID) x = PH_NEG_INF;  // NaN ranks as -inf
                    if (ph_beats(x, xi, v, id)) { v = x; id = xi; }
                }
            }
#pragma unroll
            for (int off = 4; off < 32; off <<= 1) {
                const float ov = __shfl_xor_sync(0xffffffffu, v, off);
                const int oi = __shfl_xor_sync(0xffffffffu, id, off);
                if (ph_beats(ov, oi, v, id)) { v = ov; id = oi; }
            }
            bv[nt][e] = v;
            bi[nt][e] = id;
        }
    }
}

#ifndef PH_WGMMA
// The GEMM driver: streams this block's head rows, calling epi.tile(acc, r0, row_end) after
// every 128-row tile and epi.finish() at the end. All threads call both (they synchronize).
template <int NT, int S, class Epi>
__device__ __forceinline__ void ph_run(const __nv_bfloat16* __restrict__ hidden,
                                       const __nv_bfloat16* __restrict__ head, int n, int rows,
                                       int H, unsigned char* smem, Epi& epi) {
    static_assert(S == PH_STAGES, "the portable pipeline depth is fixed");
    typedef PhCfg<NT, S> C;
    constexpr int NC = C::NC, KC = C::KC, LD = C::LD;
    __nv_bfloat16* pipe = reinterpret_cast<__nv_bfloat16*>(smem);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int col0 = blockIdx.y * NC;
    const long long per = ((long long)rows + gridDim.x - 1) / gridDim.x;
    const long long chunk = (per + 15) / 16 * 16;
    const long long row_begin = (long long)blockIdx.x * chunk;
    const long long row_end = min((long long)rows, row_begin + chunk);
    epi.init();
    if (row_begin >= row_end) {
        __syncthreads();
        epi.finish();
        return;
    }
    const int tiles = (int)((row_end - row_begin + PH_TV - 1) / PH_TV);
    const int kch = (H + KC - 1) / KC;
    const int total = tiles * kch;

    auto load = [&](int it, int s) {
        const long long r0 = row_begin + (long long)(it / kch) * PH_TV;
        const int k0 = (it % kch) * KC;
        __nv_bfloat16* Ws = pipe + s * C::STAGE;
        __nv_bfloat16* Xs = Ws + C::W_ELEMS;
        constexpr int CPR = KC / 8;  // 16-byte chunks per row
#pragma unroll
        for (int e = tid; e < PH_TV * CPR; e += PH_THREADS) {
            const int r = e / CPR, c = e % CPR;
            const long long row = r0 + r;
            const int k = k0 + c * 8;
            const bool valid = row < row_end && k < H;
            const __nv_bfloat16* src = head + (valid ? row * H + k : 0);
            df_cp_async16(df_smem_u32(Ws + r * LD + c * 8), src, valid);
        }
        for (int e = tid; e < NC * CPR; e += PH_THREADS) {
            const int cc = e / CPR, c = e % CPR;
            const int col = col0 + cc;
            const int k = k0 + c * 8;
            const bool valid = col < n && k < H;
            const __nv_bfloat16* src = hidden + (valid ? (long long)col * H + k : 0);
            df_cp_async16(df_smem_u32(Xs + cc * LD + c * 8), src, valid);
        }
    };

#pragma unroll
    for (int s = 0; s < PH_STAGES - 1; ++s) {
        if (s < total) load(s, s);
        df_cp_commit();
    }
    float acc[2][NT][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;

    for (int it = 0; it < total; ++it) {
        df_cp_wait<PH_STAGES - 2>();
        __syncthreads();  // stage it landed; stage it - 1 is free again
        if (it + PH_STAGES - 1 < total) load(it + PH_STAGES - 1, (it + PH_STAGES - 1) % PH_STAGES);
        df_cp_commit();
        const __nv_bfloat16* Ws = pipe + (it % PH_STAGES) * C::STAGE;
        const __nv_bfloat16* Xs = Ws + C::W_ELEMS;
#pragma unroll
        for (int k16 = 0; k16 < KC / 16; ++k16) {
            unsigned a[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                df_ldsm_x4(df_smem_u32(Ws + (warp * 32 + mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD +
                                       k16 * 16 + (lane >> 4) * 8),
                           a[mt][0], a[mt][1], a[mt][2], a[mt][3]);
            }
            if (NT == 1) {
                unsigned b0, b1;
                df_ldsm_x2(df_smem_u32(Xs + (lane & 7) * LD + k16 * 16 + ((lane >> 3) & 1) * 8), b0, b1);
#pragma unroll
                for (int mt = 0; mt < 2; ++mt)
                    df_mma_bf16(acc[mt][0], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b0, b1);
            } else {
#pragma unroll
                for (int np = 0; np < NT / 2; ++np) {
                    unsigned b0, b1, b2, b3;
                    df_ldsm_x4(df_smem_u32(Xs + (np * 16 + (lane & 7) + (lane >> 4) * 8) * LD + k16 * 16 +
                                           ((lane >> 3) & 1) * 8),
                               b0, b1, b2, b3);
#pragma unroll
                    for (int mt = 0; mt < 2; ++mt) {
                        df_mma_bf16(acc[mt][2 * np], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b0, b1);
                        df_mma_bf16(acc[mt][2 * np + 1], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b2, b3);
                    }
                }
            }
        }
        if (it % kch == kch - 1) {
            epi.tile(acc, row_begin + (long long)(it / kch) * PH_TV, row_end);
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
                    acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;
        }
    }
    df_cp_wait<0>();
    __syncthreads();
    epi.finish();
}

#else  // PH_WGMMA: the sm_90a driver

// Wait until shared word `addr` holds `v` (the producer's ticket of a stage, see ph_run); in
// one asm block for the same reason as df_mbar_wait.
__device__ __forceinline__ void ph_ticket_wait(unsigned addr, int v) {
    asm volatile(
        "{\n.reg .pred p;\n.reg .b32 t;\nPH_TICKET:\nld.volatile.shared.b32 t, [%0];\nsetp.eq.b32 p, t, %1;\n"
        "@p bra PH_TICKET_DONE;\nnanosleep.u32 32;\nbra PH_TICKET;\nPH_TICKET_DONE:\n}\n" ::"r"(addr),
        "r"(v)
        : "memory");
}
// The sm_90a GEMM driver: same contract, work split and epilogue calls as the portable one
// above. A block is PH_CONSUMERS = 2 consumer warpgroups (warps 0-7) plus one producer
// warpgroup (warps 8-11), which hands most of its registers to the consumers (setmaxnreg).
// The producer's first thread streams the block's K chunks, tile after tile, through S
// shared-memory stages with TMA (a 128 x 64 head box and an NC x 64 hidden box per stage,
// 128-byte swizzled by the TMA unit, rows and columns past the tensors zero-filled): stage s
// is announced full by mbarrier full[s] (transaction bytes) and handed back by empty[s] (an
// arrival of every thread of the warpgroup that read it). The warpgroups take the tiles in
// turn (warpgroup w: tiles w, w + 2, ...), so one runs its epilogue while the other consumes
// the stream: the epilogue is off the memory's critical path as long as it takes less than a
// tile's read. A warpgroup's next chunk may be many phases of its stage ahead of the barrier
// (a phase parity cannot tell them apart), so before waiting on full[s] it waits for the
// stage's ticket, the stream index the producer wrote there when it reused the stage: then
// the barrier is in that chunk's phase. Each warpgroup has its own epilogue state and writes its own partial (P =
// 2 * gridDim.x). Each 128-row tile is two m64nNCk16 wgmma chains per K chunk (one wgmma
// group); the consumer waits for the group and releases its stage before it waits for the
// next chunk, so all S stages are loading while it waits (the stream is memory-bound: a
// chunk's MMAs take about half of its read).
template <int NT, int S, class Epi>
__device__ __forceinline__ void ph_run(const DfTmap* tm_hidden, const DfTmap* tm_head, int n, int rows,
                                       int H, unsigned char* smem, Epi& epi) {
    typedef PhCfg<NT, S> C;
    constexpr int KC = C::KC;
    constexpr unsigned STAGE_BYTES = (unsigned)C::STAGE * 2u;  // bytes TMA writes per stage
    unsigned char* base = smem + ((1024 - (df_smem_u32(smem) & 1023)) & 1023);
    __nv_bfloat16* pipe = reinterpret_cast<__nv_bfloat16*>(base);
    const unsigned bars = df_smem_u32(base + S * C::STAGE * 2);  // full[S], then empty[S]
    int* tickets = reinterpret_cast<int*>(base + S * C::STAGE * 2 + 2 * S * 8);  // [S]
    const int tid = threadIdx.x;
    // Warp-uniform (and provably so for ptxas) role index: 0-7 consumers, 8-11 the producer.
    const int warp = __shfl_sync(0xffffffffu, tid >> 5, 0);
    const int col0 = blockIdx.y * C::NC;
    const long long per = ((long long)rows + gridDim.x - 1) / gridDim.x;
    const long long chunk = (per + 15) / 16 * 16;
    const long long row_begin = (long long)blockIdx.x * chunk;
    const long long row_end = min((long long)rows, row_begin + chunk);
    const int tiles = row_begin < row_end ? (int)((row_end - row_begin + PH_TV - 1) / PH_TV) : 0;
    const int kch = (H + KC - 1) / KC;
    const int total = tiles * kch;
    if (tid == 0) {
        for (int s = 0; s < S; ++s) {
            df_mbar_init(bars + 8 * s, 1);
            df_mbar_init(bars + 8 * (S + s), PH_THREADS);
            tickets[s] = -1;
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (warp >= PH_CONSUMERS * PH_WARPS) {  // the producer warpgroup: one thread streams
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PH_PRODUCER_REGS));
        if (tid == PH_CONSUMERS * PH_THREADS) {
            for (int j = 0; j < total; ++j) {
                const int s = j % S;
                if (j >= S) df_mbar_wait(bars + 8 * (S + s), (unsigned)((j / S - 1) & 1));
                *reinterpret_cast<volatile int*>(tickets + s) = j;
                const unsigned full = bars + 8 * s;
                df_mbar_expect_tx(full, STAGE_BYTES);
                const int k0 = (j % kch) * KC;
                const int r0 = (int)(row_begin + (long long)(j / kch) * PH_TV);
                const unsigned ws = df_smem_u32(pipe + s * C::STAGE);
                df_tma_2d(ws, tm_head, k0, r0, full);
                df_tma_2d(ws + C::W_ELEMS * 2, tm_hidden, k0, col0, full);
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(PH_CONSUMER_REGS));
    const int wg = warp / PH_WARPS;
    epi.init();
    PH_SYNC();
    // The accumulators are only written by wgmma (the first of each tile overwrites them,
    // accumulate = 0) and only read by the epilogue after wait_group 0, so ptxas never has to
    // serialize the chain.
    float acc[2][NT][4];
    for (int t = wg; t < tiles; t += PH_CONSUMERS) {
        const int it0 = t * kch;  // the tile's first K chunk in the stream
        for (int kc = 0; kc < kch; ++kc) {
            const int it = it0 + kc;
            const int s = it % S;
            ph_ticket_wait(df_smem_u32(tickets + s), it);
            df_mbar_wait(bars + 8 * s, (unsigned)((it / S) & 1));
            const __nv_bfloat16* Ws = pipe + s * C::STAGE;
            const __nv_bfloat16* Xs = Ws + C::W_ELEMS;
            df_wg_fence();
#pragma unroll
            for (int k16 = 0; k16 < KC / 16; ++k16) {
                const u64 db = df_wg_desc_k(Xs + k16 * 16);
                const int accumulate = (kc > 0 || k16 > 0) ? 1 : 0;
#pragma unroll
                for (int mt = 0; mt < 2; ++mt)
                    df_wgmma_bf16(acc[mt], df_wg_desc_k(Ws + mt * 64 * KC + k16 * 16), db, accumulate);
            }
            df_wg_commit();
            // Hand the stage back as soon as its group has completed, before waiting for the
            // next chunk: a stage held while its successor's data are awaited would leave only
            // S - 1 loads in flight where the stream is memory-bound (measured: the top-16
            // epilogue's 4 stages at 128 columns ran at 0.8 of the copy rate that way).
            df_wg_wait<0>();
            df_mbar_arrive(bars + 8 * (S + s));
        }
        epi.tile(acc, row_begin + (long long)t * PH_TV, row_end);
    }
    epi.finish();
}
#endif  // PH_WGMMA

// Argmax epilogue: a running best (value, id) per column in shared memory.
template <int NT>
struct PhArgmax {
    static constexpr int NC = 8 * NT;
    static constexpr int SMEM_BYTES = (PH_WARPS + 1) * NC * 8;  // mirrored by the launcher
    static constexpr int WG_STAGES = 5;  // sm_90a pipeline depth
    float* wv;  // [PH_WARPS][NC]
    int* wi;
    float* bv;  // [NC]
    int* bi;
    PhRows rw;
    float* ws;
    int n;
    __device__ __forceinline__ PhArgmax(unsigned char* epi_smem, PhRows rows_, float* ws_, int n_)
        : rw(rows_), ws(ws_), n(n_) {
        wv = reinterpret_cast<float*>(epi_smem);
        wi = reinterpret_cast<int*>(wv + PH_WARPS * NC);
        bv = reinterpret_cast<float*>(wi + PH_WARPS * NC);
        bi = reinterpret_cast<int*>(bv + NC);
    }
    __device__ __forceinline__ void init() {
        for (int c = ph_tid(); c < NC; c += PH_THREADS) { bv[c] = PH_NEG_INF; bi[c] = PH_NO_ID; }
    }
    __device__ __forceinline__ void tile(const float (&acc)[2][NT][4], long long r0, long long row_end) {
        const int lane = ph_tid() & 31, warp = ph_tid() >> 5;
        int ids[2][2];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) ids[mt][h] = rw.id(ph_row(r0, mt, h), row_end);
        float v[NT][2];
        int id[NT][2];
        ph_warp_best<NT>(acc, ids, v, id);
        if ((lane >> 2) == 0) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int c = nt * 8 + 2 * (lane & 3) + e;
                    wv[warp * NC + c] = v[nt][e];
                    wi[warp * NC + c] = id[nt][e];
                }
        }
        PH_SYNC();
        for (int c = ph_tid(); c < NC; c += PH_THREADS) {
            float b = bv[c];
            int bid = bi[c];
#pragma unroll
            for (int w = 0; w < PH_WARPS; ++w) {
                if (ph_beats(wv[w * NC + c], wi[w * NC + c], b, bid)) { b = wv[w * NC + c]; bid = wi[w * NC + c]; }
            }
            bv[c] = b;
            bi[c] = bid;
        }
#ifdef PH_WGMMA
        PH_SYNC();  // wv / wi are rewritten by the next tile (no pipeline barrier in between)
#endif
        // Portable: the next write of wv / wi follows the next tile's pipeline barrier.
    }
    __device__ __forceinline__ void finish() {
        const int P = gridDim.x * PH_CONSUMERS;
        const int b = blockIdx.x * PH_CONSUMERS + ph_wg();
        for (int c = ph_tid(); c < NC; c += PH_THREADS) {
            const long long col = (long long)blockIdx.y * NC + c;
            if (col >= n) continue;
            float* o = ws + (col * P + b) * 2;
            o[0] = bv[c];
            o[1] = __int_as_float(bi[c]);
        }
    }
};

// Entry parameters and the driver's operands: raw pointers (portable) or the TMA maps of
// hidden and head (sm_90a); the rest is shared.
#ifndef PH_WGMMA
#define PH_OPERANDS const __nv_bfloat16 *hidden, const __nv_bfloat16 *head
#define PH_RUN_OPERANDS hidden, head
#else
#define PH_OPERANDS const __grid_constant__ DfTmap tm_hidden, const __grid_constant__ DfTmap tm_head
#define PH_RUN_OPERANDS &tm_hidden, &tm_head
#endif

// The fused GEMM entry `{op}_gemm_nt{NT}` with epilogue EPI (both head ops use this): the
// pipeline, then one epilogue state per consumer warpgroup.
#define PH_ENTRY(NAME, EPI, NT)                                                                 \
    extern "C" __global__ void __launch_bounds__(PH_BLOCK_THREADS, 1) NAME##_gemm_nt##NT(        \
        PH_OPERANDS, const int* token_ids, float* ws, int n, int rows, int H, int public_vocab) { \
        extern __shared__ __align__(16) unsigned char ph_smem[];                                \
        constexpr int S = PH_EPI_STAGES(EPI<NT>);                                                \
        PhRows rw;                                                                               \
        rw.token_ids = token_ids;                                                                \
        rw.considered = public_vocab;                                                            \
        const int wg = min(ph_wg(), PH_CONSUMERS - 1); /* the producer warp: unused */         \
        EPI<NT> epi(ph_smem + PhCfg<NT, S>::PIPE_BYTES + wg * EPI<NT>::SMEM_BYTES, rw, ws, n);  \
        ph_run<NT, S>(PH_RUN_OPERANDS, n, rows, H, ph_smem, epi);                                \
    }
#define PH_ARGMAX_ENTRY(NT) PH_ENTRY(proposal_argmax, PhArgmax, NT)
PH_ARGMAX_ENTRY(1)
PH_ARGMAX_ENTRY(2)
PH_ARGMAX_ENTRY(4)
PH_ARGMAX_ENTRY(8)
PH_ARGMAX_ENTRY(16)

// Merge: grid (n), 256 threads; the best of the P partials of column blockIdx.x.
extern "C" __global__ void __launch_bounds__(256) proposal_argmax_merge(const float* __restrict__ ws,
                                                                        int* __restrict__ ids, int P) {
    __shared__ float s_v[8];
    __shared__ int s_i[8];
    const long long col = blockIdx.x;
    float v = PH_NEG_INF;
    int id = PH_NO_ID;
    for (int b = threadIdx.x; b < P; b += blockDim.x) {
        const float x = ws[(col * P + b) * 2];
        const int xi = __float_as_int(ws[(col * P + b) * 2 + 1]);
        if (ph_beats(x, xi, v, id)) { v = x; id = xi; }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, off);
        const int oi = __shfl_xor_sync(0xffffffffu, id, off);
        if (ph_beats(ov, oi, v, id)) { v = ov; id = oi; }
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) { s_v[warp] = v; s_i[warp] = id; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w)
            if (ph_beats(s_v[w], s_i[w], v, id)) { v = s_v[w]; id = s_i[w]; }
        ids[col] = id;
    }
}
