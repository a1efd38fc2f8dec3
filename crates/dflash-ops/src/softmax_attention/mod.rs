//! Softmax attention (full draft layers): non-causal attention of a query block over the
//! row's whole paged context and the live columns of its own block.
//!
//! ```text
//! Semantics. For row r with context frontier F = start_pos[r] and L = live[r] live columns,
//! query column i < L (absolute position F + i) and query head h (KV head
//! kvh = h / (Hq / Hkv)), the visible keys are
//!   - every context position p in [0, F): K = pages_k[table[r][p / page_size], p % page_size,
//!     kvh], V = pages_v[same] (V stored F16);
//!   - every block column j < L of the same row: K = k_blk[r, j, kvh], V = v_blk[r, j, kvh]
//!     (non-causal: columns after i are visible too).
//!
//!   s_k = (q[r, i, h] . K_k) / sqrt(D);  w_k = exp(s_k - max_k s_k)
//!   out[r, i, h*D..(h+1)*D] = bf16_rne(sum_k w_k V_k / sum_k w_k)
//!
//! Rows never see other rows. Columns i >= L are dead: every element of them is written +0.0.
//! (The window-limited variant of the same math is sliding_window_attention; both
//! evaluate it with one shared helper.)
//! Shapes. q: [rows, cols, Hq, D]; k_blk, v_blk: [rows, cols, Hkv, D];
//!   pages_k, pages_v: [pages, page_size, Hkv, D]; page_table: [rows, max_pages];
//!   start_pos, live: [rows]; out: [rows, cols, Hq * D]; workspace: at least
//!   workspace_len() f32.
//! Dtypes. q, k_blk, v_blk, pages_k: bf16; pages_v: f16; page_table, start_pos, live: i32;
//!   out: bf16; workspace: f32 scratch.
//! Rounding points. Only the output (bf16, RNE, once). Scores, softmax and the weighted sum are
//!   unrounded math.
//! Accumulation. Implementation choice (CUDA: FP32, split-KV with an online softmax per split
//!   and an exact-formula merge); the oracle is f64 from the represented inputs (the CPU
//!   reference is that oracle).
//! Tie-breaking. None (no discrete decision).
//! Masking/live extents. Query columns i >= live[r] output +0.0; block keys j >= live[r] are
//!   invisible (their q/k/v contents have no effect). The context is exactly [0, F).
//! Caller guarantees (checked on the CPU, trusted on CUDA, where out-of-range metadata is
//!   clamped or skipped so nothing is read or written out of bounds but the result is then
//!   unspecified): start_pos[r] >= 0 and F <= max_pages * page_size; live[r] in 1..=cols;
//!   table[r][0..ceil(F / page_size)] in 0..pages (later entries are never read). No
//!   aliasing between out/workspace and the inputs.
//! Writes. Every element of out; the first workspace_len() elements of workspace on
//!   CUDA (scratch, contents unspecified afterwards; the CPU does not touch it). Inputs are
//!   never modified.
//! Comparison. out: close (abs 1e-4, 2 bf16 ulps); dead columns: exact +0.0 bits.
//! ```
//!
//! CUDA (kernels/softmax_attention.cu; one body and one launcher for both attention ops, which
//! differ only in the context map and the window).
//! - Work split: the Hq / Hkv query heads of a KV head times the live columns of a request
//!   form up to 64 query rows (four m16 tiles) that share every K/V tile; grid (Hkv * row
//!   blocks, rows, splits) of 128 threads (256 for the sm_90a warpgroup pairs below), a
//!   split-major block order (every item's first split first, so the blocks with work spread
//!   evenly over the SMs; a row's splits past its active count exit at once). A row's key
//!   list is its visible context (here `[0, F)`) in tiles of 32 keys (16 for head dims above
//!   128, 64 for the warpgroup pairs), then its live block columns; each active split takes
//!   consecutive tiles, so the work follows the live context (a row with
//!   300 keys uses 10 tiles whatever the capacity). The launched split count is
//!   min([`split_count`], the device's resident blocks / (rows * Hkv * row blocks)).
//! - Tiles: K/V tiles are staged through shared memory by cp.async in a 3-stage pipeline (2
//!   tiles in flight while one is computed; 3 blocks per SM). A tile's context keys are
//!   consecutive positions: their slots come from one page-table read (or one ring offset)
//!   per tile; the tile's (page, offset) advances by the tile width without a division and
//!   its page-table entry is read one staged tile ahead. A tile inside one page (or before
//!   the ring's end) is staged from one address and constant strides; keys are resolved one
//!   by one only where the tile crosses a page, the ring's end or the frontier. Q rows are staged only for the m16 tiles with live rows. Each warp owns an
//!   m16 tile (entry `_d{DP}`); when the call has at most 32 query rows per block (entry
//!   `_d{DP}_ks2`, a compile-time choice), warp pairs split every tile's keys and combine
//!   their states at the end. A tile whose keys are all valid and visible to every live column
//!   (flagged by one ballot when staged) skips the per-key mask. Q K^T and P V run on the
//!   tensor cores (mma.m16n8k16, FP32 accumulation) with an online softmax in base 2 (a
//!   tile's max is s * log2(e) / sqrt(D) rounded once; each row keeps an integer base, raised
//!   to the ceiling of a tile's max only when that max passes it by more than 8, so weights
//!   2^fma(s, log2(e) / sqrt(D), -base) stay <= 2^8 and every rescale is an exact power of
//!   two; a warp whose rows have seen no visible key yet skips the rescale, whose factors
//!   would multiply exact zeros). Context and block tiles are two instantiations of one tile step (FP16 or BF16
//!   P V), never both under predicates. P is two
//!   terms hi + lo of the type of the V it multiplies (FP16 against the context's F16 V, BF16
//!   against the block's BF16 V: one FP16 term, 11 bits, loses more than the tolerance where
//!   the weighted values cancel); the softmax sum adds the same represented weights (FP32,
//!   each thread over its keys of every tile, then the four threads of a row).
//! - Merge: each active split writes FP32 partials (max, sum, accumulator); the merge
//!   recomputes the row's split plan from the same metadata, reads every (max, sum) and every
//!   accumulator chunk of an item's active splits in one round trip per 128 elements of the
//!   head (one for D <= 128), combines them with exact power-of-two factors and writes the
//!   dead columns' zeros. Entries by the launched split
//!   count: `_merge_w8` / `_merge_w16` (at most 8 / 16: one warp per (head, column, row) item,
//!   four items per block, so a call with few splits keeps many items' loads in flight per
//!   SM) or `_merge_s64` (up to 64: one block per item, its four warps sharing the splits).
//! - sm_90a (compute capability 9.0, `CudaOptions::kernels` = `Auto`; see
//!   `attend::SplitForm`): the split of head dim 128 with more than 16 query rows per KV
//!   head (K = 7 and K = 15 of the official drafts; at K = 7 the portable kernels use
//!   key-split pairs) runs a warpgroup-MMA form. Its 64 query rows are one warpgroup (rows
//!   past the block's live ones are zero in Q and masked); the tiles are staged by the same
//!   cp.async code into the 128-byte swizzled layout without padding; S = Q K^T is one chain
//!   of 8 wgmma m64n32k16 per warpgroup and tile (both operands from shared memory), P V four
//!   wgmma m64n128k16 (P hi and lo as register operands, V an MN-major shared operand), in
//!   flight until the next tile's barrier. Entry `_d128`: one warpgroup per block, 32-key
//!   tiles, 3 stages, 3 blocks per SM. Entry `_d128_ks2` (K = 15 where the batch has at most
//!   sm_count / 4 row blocks and one warpgroup per block would give each split at most 4
//!   tiles at the layer's key capacity: B = 1 of both drafts, `SplitForm::pairs_pay`): a pair
//!   of warpgroups per block (256 threads, one block per SM) shares Q and every 64-key tile,
//!   32 keys each with its own online softmax, and combines the two states in shared memory
//!   before the split's one partial (half the partials for the same keys per block). Same
//!   contract, masks, P representation, workspace and merge; every other shape runs the
//!   portable kernels, and `KernelVariants::Portable` selects them everywhere.
//! - Launch: on compute capability 9.0 and later the merge is a programmatic dependent
//!   launch of the split (`CudaBackend::launch_ex`), and the warpgroup-pair split one
//!   of the kernel ahead of it in the stream (`SplitForm::dependent_launch`: measured to pay
//!   there, not for the one-warpgroup split): its blocks can become resident while that
//!   kernel finishes (in a sequence of attention calls, the previous call's merge, which
//!   allows it at its start). Every split block first waits for the kernel ahead (a no-op for
//!   an ordinary launch), then lets the merge start. The merge's blocks can become resident and read their row's
//!   metadata while the split still runs, then wait for the split's completion before reading
//!   a partial. The portable kernel variants (`KernelVariants::Portable`) launch both as
//!   usual.
//! - Head dims are padded to 16, 32, 64, 128 or 256 with zeros in shared memory; D % 8 != 0
//!   uses 4-byte copies; context slots are addressed in 32 bits (pages * page_size and lanes *
//!   window at most 2^31 - 1 on CUDA).
//!
//! Shared math: [`crate::sliding_window_attention`] evaluates the same per-row helper.
//! Sizes: [`workspace_len`], [`split_count`].

pub(crate) mod attend;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod reference;
#[cfg(test)]
mod tests;

use half::{bf16, f16};

#[cfg(any(test, feature = "conformance"))]
use crate::Element;
#[cfg(any(test, feature = "conformance"))]
use crate::registry::{Case, CaseRun, InputCheck};
use crate::{Backend, Buffer, OpsError, Result, check_len, check_param};
#[cfg(any(test, feature = "conformance"))]
use attend::CaseRng;
use attend::{Geometry, Lens};

/// Registry id.
pub const OP: &str = "softmax_attention";

/// Static shape of a full-layer attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FullAttentionParams {
    /// Requests in the batch (>= 1).
    pub rows: usize,
    /// Query columns per request, W = K + 1 (>= 1).
    pub cols: usize,
    /// Query heads Hq (a multiple of `kv_heads`).
    pub q_heads: usize,
    /// KV heads Hkv (>= 1).
    pub kv_heads: usize,
    /// Head dimension D (even, 2..=256).
    pub head_dim: usize,
    /// Pages in the pool.
    pub pages: usize,
    /// Positions per page (>= 1).
    pub page_size: usize,
    /// Page-table entries per row; a row's context holds at most `max_pages * page_size`
    /// positions.
    pub max_pages: usize,
}

impl FullAttentionParams {
    fn geometry(&self) -> Geometry {
        Geometry {
            rows: self.rows,
            cols: self.cols,
            q_heads: self.q_heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
        }
    }

    /// Most keys a row can see: `max_pages * page_size + cols` (saturating).
    fn key_capacity(&self) -> usize {
        self.max_pages
            .saturating_mul(self.page_size)
            .saturating_add(self.cols)
    }
}

/// The most splits the CUDA kernels launch for `p` (depends on shapes only; bounds the
/// workspace): `clamp(min(ceil(key capacity / 64), ceil(512 / (rows * Hkv * row blocks))), 1,
/// 64)`, a row block being 64 query rows of a KV head (`ceil(Hq / Hkv * cols / 64)`).
pub fn split_count(p: &FullAttentionParams) -> usize {
    attend::split_count(&p.geometry(), p.key_capacity())
}

/// f32 elements the `workspace` of [`run`] must have at least:
/// `rows * cols * q_heads * split_count(p) * (head_dim + 2)` (saturating for nonsense
/// shapes, which [`run`] refuses anyway).
pub fn workspace_len(p: &FullAttentionParams) -> usize {
    attend::workspace_len(&p.geometry(), p.key_capacity())
}

/// Full-layer attention (see the module contract).
pub fn run(
    be: &Backend,
    q: &Buffer<bf16>,
    k_blk: &Buffer<bf16>,
    v_blk: &Buffer<bf16>,
    pages_k: &Buffer<bf16>,
    pages_v: &Buffer<f16>,
    page_table: &Buffer<i32>,
    start_pos: &Buffer<i32>,
    live: &Buffer<i32>,
    out: &mut Buffer<bf16>,
    workspace: &mut Buffer<f32>,
    p: &FullAttentionParams,
) -> Result<()> {
    let g = p.geometry();
    g.validate(OP)?;
    let i32_max = i32::MAX as usize;
    check_param(
        OP,
        "page_size",
        (1..=i32_max).contains(&p.page_size),
        p.page_size,
        || "page_size >= 1".into(),
    )?;
    check_param(OP, "pages", p.pages <= i32_max, p.pages, || {
        "pages <= i32::MAX".into()
    })?;
    check_param(
        OP,
        "max_pages",
        p.max_pages
            .checked_mul(p.page_size)
            .and_then(|n| n.checked_add(p.cols))
            .is_some_and(|n| n <= i32_max),
        p.max_pages,
        || "max_pages * page_size + cols <= i32::MAX".into(),
    )?;
    let slot_elems = p
        .pages
        .checked_mul(p.page_size)
        .and_then(|n| n.checked_mul(p.kv_heads * p.head_dim))
        .ok_or_else(|| OpsError::Param {
            op: OP,
            param: "pages",
            expected: "pages * page_size * kv_heads * head_dim to fit in usize".into(),
            found: p.pages.to_string(),
        })?;
    attend::check_common(
        OP,
        &g,
        &Lens {
            q: q.len(),
            k_blk: k_blk.len(),
            v_blk: v_blk.len(),
            start_pos: start_pos.len(),
            live: live.len(),
            out: out.len(),
            workspace: workspace.len(),
            key_capacity: p.key_capacity(),
        },
    )?;
    let (pg, ps, hkv, d) = (p.pages, p.page_size, p.kv_heads, p.head_dim);
    check_len(OP, "pages_k", pages_k.len(), slot_elems, || {
        format!("[pages={pg}, page_size={ps}, kv_heads={hkv}, head_dim={d}]")
    })?;
    check_len(OP, "pages_v", pages_v.len(), slot_elems, || {
        format!("[pages={pg}, page_size={ps}, kv_heads={hkv}, head_dim={d}]")
    })?;
    check_len(
        OP,
        "page_table",
        page_table.len(),
        p.rows * p.max_pages,
        || format!("[rows={}, max_pages={}]", p.rows, p.max_pages),
    )?;
    match be {
        Backend::Cpu => reference::run(
            &g,
            p,
            attend::Inputs {
                q: q.host(OP, "q")?,
                k_blk: k_blk.host(OP, "k_blk")?,
                v_blk: v_blk.host(OP, "v_blk")?,
                ctx_k: pages_k.host(OP, "pages_k")?,
                ctx_v: pages_v.host(OP, "pages_v")?,
                start_pos: start_pos.host(OP, "start_pos")?,
                live: live.host(OP, "live")?,
            },
            page_table.host(OP, "page_table")?,
            {
                // The workspace must still live on this backend.
                workspace.host(OP, "workspace")?;
                out.host_mut(OP, "out")?
            },
        ),
        #[cfg(feature = "cuda")]
        Backend::Cuda(c) => cuda::run(
            c, q, k_blk, v_blk, pages_k, pages_v, page_table, start_pos, live, out, workspace, p,
        ),
    }
}

/// One conformance case: rows given as (F, live), a scattered page table (pages assigned
/// from a random permutation of a pool with `spare` unused pages, unused entries -1).
#[cfg(any(test, feature = "conformance"))]
struct CaseSpec {
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    cols: usize,
    page_size: usize,
    rows: Vec<(i32, i32)>,
    spare: usize,
    seed: u64,
}

#[cfg(any(test, feature = "conformance"))]
fn case(spec: CaseSpec) -> impl Fn(&Backend) -> Result<CaseRun> + Send + Sync {
    move |be: &Backend| {
        let s = &spec;
        let rows = s.rows.len();
        let used: Vec<usize> = s
            .rows
            .iter()
            .map(|&(f, _)| (f as usize).div_ceil(s.page_size))
            .collect();
        let max_pages = used.iter().copied().max().unwrap_or(0).max(1) + 1;
        let pages = used.iter().sum::<usize>() + s.spare;
        let p = FullAttentionParams {
            rows,
            cols: s.cols,
            q_heads: s.q_heads,
            kv_heads: s.kv_heads,
            head_dim: s.head_dim,
            pages,
            page_size: s.page_size,
            max_pages,
        };
        let mut rng = CaseRng::new(s.seed);
        let perm = rng.permutation(pages);
        let mut table = vec![-1i32; rows * max_pages];
        let mut next = 0;
        for (r, &u) in used.iter().enumerate() {
            for k in 0..u {
                table[r * max_pages + k] = perm[next] as i32;
                next += 1;
            }
        }
        let g = p.geometry();
        let slot_elems = pages * s.page_size * s.kv_heads * s.head_dim;
        let mut inputs = InputCheck::default();
        let q = inputs.upload(be, "q", &rng.bf16s(g.q_len(), 2.0))?;
        let kb = inputs.upload(be, "k_blk", &rng.bf16s(g.kv_len(), 2.0))?;
        let vb = inputs.upload(be, "v_blk", &rng.bf16s(g.kv_len(), 1.0))?;
        let pk = inputs.upload(be, "pages_k", &rng.bf16s(slot_elems, 2.0))?;
        let pv = inputs.upload(be, "pages_v", &rng.ctx_v(slot_elems, 1.0))?;
        let pt = inputs.upload(be, "page_table", &table)?;
        let fs: Vec<i32> = s.rows.iter().map(|r| r.0).collect();
        let ls: Vec<i32> = s.rows.iter().map(|r| r.1).collect();
        let sp = inputs.upload(be, "start_pos", &fs)?;
        let lv = inputs.upload(be, "live", &ls)?;
        let mut out = be.filled(g.q_len(), bf16::POISON)?;
        let mut ws = be.filled(workspace_len(&p), f32::POISON)?;
        run(
            be, &q, &kb, &vb, &pk, &pv, &pt, &sp, &lv, &mut out, &mut ws, &p,
        )?;
        let mut modified = Vec::new();
        inputs.verify(be, "q", &q, &mut modified)?;
        inputs.verify(be, "k_blk", &kb, &mut modified)?;
        inputs.verify(be, "v_blk", &vb, &mut modified)?;
        inputs.verify(be, "pages_k", &pk, &mut modified)?;
        inputs.verify(be, "pages_v", &pv, &mut modified)?;
        inputs.verify(be, "page_table", &pt, &mut modified)?;
        inputs.verify(be, "start_pos", &sp, &mut modified)?;
        inputs.verify(be, "live", &lv, &mut modified)?;
        Ok(CaseRun {
            outputs: attend::case_outputs(&g, &ls, &be.download(&out)?),
            modified_inputs: modified,
        })
    }
}

/// Conformance cases.
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn cases() -> Vec<Case> {
    let official = |cols, page_size, rows: Vec<(i32, i32)>, seed| CaseSpec {
        q_heads: 32,
        kv_heads: 8,
        head_dim: 128,
        cols,
        page_size,
        rows,
        spare: 3,
        seed,
    };
    // Head dim 128 with two query row blocks per KV head: group 8 x 16 columns.
    let two_row_blocks = |rows, seed| CaseSpec {
        q_heads: 16,
        kv_heads: 2,
        head_dim: 128,
        cols: 16,
        page_size: 16,
        rows,
        spare: 3,
        seed,
    };
    vec![
        Case::new(
            OP,
            "small_hq4_hkv2_d16_p4_rows3",
            case(CaseSpec {
                q_heads: 4,
                kv_heads: 2,
                head_dim: 16,
                cols: 5,
                page_size: 4,
                rows: vec![(0, 5), (9, 3), (33, 1)],
                spare: 3,
                seed: 11,
            }),
        ),
        Case::new(
            OP,
            "official_f0_rows8_k15",
            case(official(16, 16, vec![(0, 16); 8], 12)),
        ),
        Case::new(
            OP,
            "official_p16_rows8_k15_scattered",
            case(official(
                16,
                16,
                vec![
                    (0, 16),
                    (1, 9),
                    (17, 16),
                    (100, 1),
                    (1000, 16),
                    (2048, 12),
                    (4096, 16),
                    (5000, 7),
                ],
                13,
            )),
        )
        .heavy(),
        Case::new(
            OP,
            "official_p64_rows8_k1_scattered",
            case(official(
                2,
                64,
                vec![
                    (5000, 2),
                    (0, 1),
                    (63, 2),
                    (64, 2),
                    (65, 1),
                    (3000, 2),
                    (4096, 2),
                    (777, 1),
                ],
                14,
            )),
        )
        .heavy(),
        Case::new(
            OP,
            "official_p64_rows1_k15_f300",
            case(official(16, 64, vec![(300, 11)], 15)),
        ),
        // Benchmark shapes: B=1 K=7 at 2048; a long context (many tiles per split); eight
        // requests with unequal frontiers and dead columns over a pool with many holes; a
        // head dim that is not a multiple of 8 (4-byte copies) and a large GQA group (two
        // query row blocks).
        Case::new(
            OP,
            "official_p64_rows1_k7_f2048",
            case(official(8, 64, vec![(2048, 8)], 16)),
        )
        .heavy(),
        Case::new(
            OP,
            "official_p64_rows1_k7_f16384",
            case(official(8, 64, vec![(16384, 8)], 17)),
        )
        .heavy(),
        Case::new(
            OP,
            "official_p64_rows8_k15_unequal_holes",
            case(CaseSpec {
                spare: 40,
                ..official(
                    16,
                    64,
                    vec![
                        (4096, 16),
                        (0, 16),
                        (4033, 5),
                        (64, 16),
                        (1, 1),
                        (2500, 16),
                        (130, 8),
                        (4000, 15),
                    ],
                    18,
                )
            }),
        )
        .heavy(),
        Case::new(
            OP,
            "small_d10_hq16_hkv1_p8_rows2_two_row_blocks",
            case(CaseSpec {
                q_heads: 16,
                kv_heads: 1,
                head_dim: 10,
                cols: 5,
                page_size: 8,
                rows: vec![(70, 5), (3, 4)],
                spare: 5,
                seed: 19,
            }),
        ),
        // Head dim 128 with two query row blocks per KV head (group 8 x 16 columns), the
        // first request's second row block all dead (3 live columns, so the merge writes its
        // zeros): a frontier of 1000 (17 splits: the block-per-item merge) and one of 100 (a
        // few splits: a warp per item).
        Case::new(
            OP,
            "d128_hq16_hkv2_p16_rows2_k15_dead_row_block_f1000",
            case(two_row_blocks(vec![(1000, 3), (50, 16)], 40)),
        ),
        Case::new(
            OP,
            "d128_hq16_hkv2_p16_rows2_k15_dead_row_block_f100",
            case(two_row_blocks(vec![(100, 3), (20, 16)], 41)),
        ),
        // Head dim 256 (16-key tiles, the d256 split) with a frontier of 2000: about 33
        // launched splits, so the block-per-item merge over two 128-element chunks.
        Case::new(
            OP,
            "small_d256_hq4_hkv1_p16_rows1_f2000",
            case(CaseSpec {
                q_heads: 4,
                kv_heads: 1,
                head_dim: 256,
                cols: 5,
                page_size: 16,
                rows: vec![(2000, 5)],
                spare: 3,
                seed: 20,
            }),
        ),
    ]
}
