//! Sliding-window attention (local draft layers): non-causal attention of a query block over
//! the row's ring context and the live columns of its own block, limited to a window S.
//!
//! ```text
//! Semantics. For row r with context frontier F = start_pos[r], L = live[r] live columns and
//! ring lane lanes[r], query column i < L sits at absolute position p_q = F + i; query head
//! h reads KV head kvh = h / (Hq / Hkv). Key visibility (allowed(p_q, p_k) = |p_k - p_q| < S,
//! distance S - 1 included, S excluded; populated bounds clip it):
//!   - context position p is visible iff p in [max(0, F - S), F) (the ring's live interval)
//!     and |p - p_q| < S, i.e. p in [max(0, F + i + 1 - S), F): with a full left context,
//!     column i sees S - 1 - i context positions. K = ring_k[lanes[r], p mod S, kvh],
//!     V = ring_v[same] (V stored F16);
//!   - block column j (position F + j) is visible iff j < L and |j - i| < S (non-causal:
//!     columns after i are visible). K = k_blk[r, j, kvh], V = v_blk[r, j, kvh].
//!
//!   s_k = (q[r, i, h] . K_k) / sqrt(D);  w_k = exp(s_k - max_k s_k)
//!   out[r, i, h*D..(h+1)*D] = bf16_rne(sum_k w_k V_k / sum_k w_k)
//!
//! Rows never see other rows. Columns i >= L are dead: every element of them is written +0.0.
//! Column i always sees at least its own block key, so the softmax is never empty. (The
//! unwindowed variant is softmax_attention; both evaluate the same shared helper.)
//! Shapes. q: [rows, cols, Hq, D]; k_blk, v_blk: [rows, cols, Hkv, D];
//!   ring_k, ring_v: [lanes, S, Hkv, D]; lanes, start_pos, live: [rows];
//!   out: [rows, cols, Hq * D]; workspace: at least workspace_len() f32.
//! Dtypes. q, k_blk, v_blk, ring_k: bf16; ring_v: f16; lanes, start_pos, live: i32; out: bf16;
//!   workspace: f32 scratch.
//! Rounding points. Only the output (bf16, RNE, once). Scores, softmax and the weighted sum
//!   are unrounded math.
//! Accumulation. Implementation choice (CUDA: FP32 split-KV, online softmax per split, exact
//!   merge); the oracle is f64 from the represented inputs (the CPU reference is that oracle).
//! Tie-breaking. None (no discrete decision).
//! Masking/live extents. Query columns i >= live[r] output +0.0; block keys j >= live[r] are
//!   invisible (their q/k/v contents have no effect); ring slots outside the live interval
//!   (old bytes) are never read.
//! Caller guarantees (checked on the CPU, trusted on CUDA, where out-of-range metadata is
//!   clamped or skipped so nothing is read or written out of bounds but the result is then
//!   unspecified): start_pos[r] >= 0; live[r] in 1..=cols; lanes[r] in 0..lanes. Two rows
//!   may share a lane (it is only read). No aliasing between out/workspace and the inputs.
//! Writes. Every element of out; the first workspace_len() elements of workspace on
//!   CUDA (scratch, contents unspecified afterwards; the CPU does not touch it). Inputs are
//!   never modified.
//! Comparison. out: close (abs 1e-4, 2 bf16 ulps); dead columns: exact +0.0 bits.
//! ```
//!
//! CUDA. The kernel body and launcher of [`crate::softmax_attention`] (see its CUDA section:
//! GQA-packed 64-row query tiles, cp.async K/V tiles, tensor-core Q K^T and P V, split-KV over
//! the visible key range, exact merge) with the ring as context map: a row's key list is the
//! context positions `[max(0, F - S + 1), F)` (the union of what its columns see; each column's
//! own window is applied per key), then its live block columns.
//!
//! Shared math: [`crate::softmax_attention`] evaluates the same per-row helper.
//! Sizes: [`workspace_len`], [`split_count`].

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
#[cfg(any(test, feature = "conformance"))]
use crate::softmax_attention::attend::CaseRng;
use crate::softmax_attention::attend::{self, Geometry, Inputs, Lens};
use crate::{Backend, Buffer, OpsError, Result, check_len, check_param};

/// Registry id.
pub const OP: &str = "sliding_window_attention";

/// Static shape of a local-layer attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalAttentionParams {
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
    /// Ring lanes in the cache (>= 1).
    pub lanes: usize,
    /// The sliding-window scalar S, also the ring capacity (>= 1).
    pub window: usize,
}

impl LocalAttentionParams {
    fn geometry(&self) -> Geometry {
        Geometry {
            rows: self.rows,
            cols: self.cols,
            q_heads: self.q_heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
        }
    }

    /// Most keys a row can see: `S - 1` context positions plus `cols` block columns.
    fn key_capacity(&self) -> usize {
        self.window.saturating_sub(1).saturating_add(self.cols)
    }
}

/// The most splits the CUDA kernels launch for `p` (depends on shapes only; bounds the
/// workspace): `clamp(min(ceil((S - 1 + cols) / 64), ceil(512 / (rows * Hkv * row blocks))), 1,
/// 64)`, a row block being 64 query rows of a KV head (`ceil(Hq / Hkv * cols / 64)`).
pub fn split_count(p: &LocalAttentionParams) -> usize {
    attend::split_count(&p.geometry(), p.key_capacity())
}

/// f32 elements the `workspace` of [`run`] must have at least:
/// `rows * cols * q_heads * split_count(p) * (head_dim + 2)` (saturating for nonsense
/// shapes, which [`run`] refuses anyway).
pub fn workspace_len(p: &LocalAttentionParams) -> usize {
    attend::workspace_len(&p.geometry(), p.key_capacity())
}

/// Local-layer attention (see the module contract).
pub fn run(
    be: &Backend,
    q: &Buffer<bf16>,
    k_blk: &Buffer<bf16>,
    v_blk: &Buffer<bf16>,
    ring_k: &Buffer<bf16>,
    ring_v: &Buffer<f16>,
    lanes: &Buffer<i32>,
    start_pos: &Buffer<i32>,
    live: &Buffer<i32>,
    out: &mut Buffer<bf16>,
    workspace: &mut Buffer<f32>,
    p: &LocalAttentionParams,
) -> Result<()> {
    let g = p.geometry();
    g.validate(OP)?;
    let i32_max = i32::MAX as usize;
    check_param(
        OP,
        "lanes",
        (1..=i32_max).contains(&p.lanes),
        p.lanes,
        || "lanes >= 1".into(),
    )?;
    check_param(
        OP,
        "window",
        p.window >= 1 && p.key_capacity() <= i32_max,
        p.window,
        || "window >= 1 and window - 1 + cols <= i32::MAX".into(),
    )?;
    let ring_elems = p
        .lanes
        .checked_mul(p.window)
        .and_then(|n| n.checked_mul(p.kv_heads * p.head_dim))
        .ok_or_else(|| OpsError::Param {
            op: OP,
            param: "lanes",
            expected: "lanes * window * kv_heads * head_dim to fit in usize".into(),
            found: p.lanes.to_string(),
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
    let (n, s, hkv, d) = (p.lanes, p.window, p.kv_heads, p.head_dim);
    check_len(OP, "ring_k", ring_k.len(), ring_elems, || {
        format!("[lanes={n}, window={s}, kv_heads={hkv}, head_dim={d}]")
    })?;
    check_len(OP, "ring_v", ring_v.len(), ring_elems, || {
        format!("[lanes={n}, window={s}, kv_heads={hkv}, head_dim={d}]")
    })?;
    check_len(OP, "lanes", lanes.len(), p.rows, || {
        format!("[rows={}]", p.rows)
    })?;
    match be {
        Backend::Cpu => reference::run(
            &g,
            p,
            Inputs {
                q: q.host(OP, "q")?,
                k_blk: k_blk.host(OP, "k_blk")?,
                v_blk: v_blk.host(OP, "v_blk")?,
                ctx_k: ring_k.host(OP, "ring_k")?,
                ctx_v: ring_v.host(OP, "ring_v")?,
                start_pos: start_pos.host(OP, "start_pos")?,
                live: live.host(OP, "live")?,
            },
            lanes.host(OP, "lanes")?,
            {
                // The workspace must still live on this backend.
                workspace.host(OP, "workspace")?;
                out.host_mut(OP, "out")?
            },
        ),
        #[cfg(feature = "cuda")]
        Backend::Cuda(c) => cuda::run(
            c, q, k_blk, v_blk, ring_k, ring_v, lanes, start_pos, live, out, workspace, p,
        ),
    }
}

/// One conformance case: rows given as (F, live); row r uses lane `lanes - 1 - r` of
/// `rows + 1` lanes (one lane unused), every ring slot filled (old bytes included).
#[cfg(any(test, feature = "conformance"))]
struct CaseSpec {
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    cols: usize,
    window: usize,
    rows: Vec<(i32, i32)>,
    seed: u64,
}

#[cfg(any(test, feature = "conformance"))]
fn case(spec: CaseSpec) -> impl Fn(&Backend) -> Result<CaseRun> + Send + Sync {
    move |be: &Backend| {
        let s = &spec;
        let rows = s.rows.len();
        let p = LocalAttentionParams {
            rows,
            cols: s.cols,
            q_heads: s.q_heads,
            kv_heads: s.kv_heads,
            head_dim: s.head_dim,
            lanes: rows + 1,
            window: s.window,
        };
        let g = p.geometry();
        let mut rng = CaseRng::new(s.seed);
        let ring_elems = p.lanes * p.window * p.kv_heads * p.head_dim;
        let lane_ids: Vec<i32> = (0..rows).map(|r| (p.lanes - 1 - r) as i32).collect();
        let mut inputs = InputCheck::default();
        let q = inputs.upload(be, "q", &rng.bf16s(g.q_len(), 2.0))?;
        let kb = inputs.upload(be, "k_blk", &rng.bf16s(g.kv_len(), 2.0))?;
        let vb = inputs.upload(be, "v_blk", &rng.bf16s(g.kv_len(), 1.0))?;
        let rk = inputs.upload(be, "ring_k", &rng.bf16s(ring_elems, 2.0))?;
        let rv = inputs.upload(be, "ring_v", &rng.ctx_v(ring_elems, 1.0))?;
        let ln = inputs.upload(be, "lanes", &lane_ids)?;
        let fs: Vec<i32> = s.rows.iter().map(|r| r.0).collect();
        let ls: Vec<i32> = s.rows.iter().map(|r| r.1).collect();
        let sp = inputs.upload(be, "start_pos", &fs)?;
        let lv = inputs.upload(be, "live", &ls)?;
        let mut out = be.filled(g.q_len(), bf16::POISON)?;
        let mut ws = be.filled(workspace_len(&p), f32::POISON)?;
        run(
            be, &q, &kb, &vb, &rk, &rv, &ln, &sp, &lv, &mut out, &mut ws, &p,
        )?;
        let mut modified = Vec::new();
        inputs.verify(be, "q", &q, &mut modified)?;
        inputs.verify(be, "k_blk", &kb, &mut modified)?;
        inputs.verify(be, "v_blk", &vb, &mut modified)?;
        inputs.verify(be, "ring_k", &rk, &mut modified)?;
        inputs.verify(be, "ring_v", &rv, &mut modified)?;
        inputs.verify(be, "lanes", &ln, &mut modified)?;
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
    let official = |window, cols, rows: Vec<(i32, i32)>, seed| CaseSpec {
        q_heads: 32,
        kv_heads: 8,
        head_dim: 128,
        cols,
        window,
        rows,
        seed,
    };
    // Head dim 128 with two query row blocks per KV head: group 8 x 16 columns.
    let two_row_blocks = |window, rows, seed| CaseSpec {
        q_heads: 16,
        kv_heads: 2,
        head_dim: 128,
        cols: 16,
        window,
        rows,
        seed,
    };
    // Official 35B-A3B local layer, F around the window (shorter, equal, longer), mixed live.
    let mixed16 = vec![
        (100, 16),
        (4096, 16),
        (5000, 9),
        (0, 16),
        (4095, 1),
        (4097, 12),
        (9000, 16),
        (1, 5),
    ];
    let mixed2 = vec![
        (5000, 2),
        (100, 1),
        (4096, 2),
        (0, 2),
        (4095, 2),
        (8191, 1),
        (4097, 2),
        (3, 2),
    ];
    vec![
        Case::new(
            OP,
            "small_window8_cols16_rows3",
            case(CaseSpec {
                q_heads: 4,
                kv_heads: 2,
                head_dim: 16,
                cols: 16,
                window: 8,
                rows: vec![(20, 16), (3, 11), (0, 16)],
                seed: 21,
            }),
        ),
        Case::new(
            OP,
            "small_window64_cols5_rows3",
            case(CaseSpec {
                q_heads: 6,
                kv_heads: 3,
                head_dim: 8,
                cols: 5,
                window: 64,
                rows: vec![(10, 5), (64, 2), (200, 4)],
                seed: 22,
            }),
        ),
        // Head dim 256 (16-key tiles, the d256 split): a window of 2048 (about 33 launched
        // splits: the block-per-item merge) and one of 100 (a few splits: a warp per item),
        // each over two 128-element chunks.
        Case::new(
            OP,
            "small_d256_hq4_hkv1_window2048_rows1",
            case(CaseSpec {
                q_heads: 4,
                kv_heads: 1,
                head_dim: 256,
                cols: 5,
                window: 2048,
                rows: vec![(3000, 5)],
                seed: 34,
            }),
        ),
        Case::new(
            OP,
            "small_d256_hq4_hkv1_window100_rows2",
            case(CaseSpec {
                q_heads: 4,
                kv_heads: 1,
                head_dim: 256,
                cols: 5,
                window: 100,
                rows: vec![(300, 5), (50, 2)],
                seed: 35,
            }),
        ),
        // Head dim 128 with two query row blocks per KV head (group 8 x 16 columns), the
        // first request's second row block all dead (3 live columns, so the merge writes its
        // zeros): a window of 2048 (33 splits: the block-per-item merge) and one of 256 (a
        // few splits: a warp per item).
        Case::new(
            OP,
            "d128_hq16_hkv2_window2048_rows2_k15_dead_row_block",
            case(two_row_blocks(2048, vec![(3000, 3), (50, 16)], 42)),
        ),
        Case::new(
            OP,
            "d128_hq16_hkv2_window256_rows2_k15_dead_row_block",
            case(two_row_blocks(256, vec![(1000, 3), (50, 16)], 43)),
        ),
        Case::new(
            OP,
            "official_heads_s128_rows2_k15",
            case(official(128, 16, vec![(300, 16), (40, 10)], 28)),
        ),
        Case::new(
            OP,
            "official35b_s4096_rows1_k1_f100",
            case(official(4096, 2, vec![(100, 2)], 23)),
        )
        .heavy(),
        Case::new(
            OP,
            "official35b_s4096_rows1_k15_f4096",
            case(official(4096, 16, vec![(4096, 16)], 24)),
        )
        .heavy(),
        Case::new(
            OP,
            "official35b_s4096_rows8_k15_mixed",
            case(official(4096, 16, mixed16, 25)),
        )
        .heavy(),
        Case::new(
            OP,
            "official35b_s4096_rows8_k1_mixed",
            case(official(4096, 2, mixed2, 26)),
        )
        .heavy(),
        // Benchmark shapes: frontier below S; a window shorter than the key range (S = 2048
        // at F = 4096); eight requests with unequal frontiers and dead columns; W > S.
        Case::new(
            OP,
            "official35b_s4096_rows1_k7_f2048",
            case(official(4096, 8, vec![(2048, 8)], 29)),
        )
        .heavy(),
        Case::new(
            OP,
            "official27b_s2048_rows1_k15_f4096",
            case(official(2048, 16, vec![(4096, 16)], 30)),
        )
        .heavy(),
        Case::new(
            OP,
            "official27b_s2048_rows8_k15_unequal_dead",
            case(official(
                2048,
                16,
                vec![
                    (4096, 16),
                    (1, 16),
                    (2047, 3),
                    (2048, 16),
                    (3000, 9),
                    (64, 1),
                    (65, 16),
                    (9999, 12),
                ],
                31,
            )),
        )
        .heavy(),
        Case::new(
            OP,
            "official_heads_s12_cols16_window_below_width",
            case(official(12, 16, vec![(100, 16), (5, 16), (11, 7)], 32)),
        ),
        Case::new(
            OP,
            "official27b_s2048_rows4_k7",
            case(official(
                2048,
                8,
                vec![(2047, 8), (2048, 5), (6000, 8), (50, 3)],
                27,
            )),
        )
        .heavy(),
    ]
}
