//! Dynamic grouped convolution (DFlash2): the two-tap, group-16 convolution around each
//! draft layer's attention and MLP branch, as two entries, [`prepare`] and [`finish`].
//!
//! Notation. A batch has `rows` requests of `cols` columns (the draft block, W = K + 1);
//! `H = hidden`, `G = H / 16` groups, channel `c = g * 16 + j`. Column `i` is the position
//! within its row; the convolution never looks across rows, requests or rounds. `x[i]`
//! below means `x[row, i, :]` of the same row.
//!
//! Semantics of [`prepare`] (branch input side). For each row and column i:
//!   `n[i, c] = norm_w[c] * x[i, c] / sqrt(mean_c'(x[i, c']^2) + eps)`   (plain RMSNorm)
//!   `delta[i, k] = sum_c w_delta[k, c] * n[i, c]`, `k < 4G`, read as `[2 sides, 2 taps, G]`
//!     (`k = s * 2G + t * G + g`)
//!   `prepared[i, c] = bf16_rne( (base[0,0,c] + delta[i,0,0,g]) * n[i, c]
//!                     + 1{i >= 1} (base[0,1,c] + delta[i,0,1,g]) * n[i-1, c] )`
//!   `finish_delta[i, t, g] = bf16_rne(delta[i, 1, t, g])`
//! Semantics of [`finish`] (branch output side, fused with the residual add).
//!   `out[i, c] = bf16_rne( residual[i, c] + ( (base[1,0,c] + fd[i,0,g]) * z[i, c]
//!                          + 1{i >= 1} (base[1,1,c] + fd[i,1,g]) * z[i-1, c] ) )`
//!   with `fd = finish_delta` as stored (BF16) by [`prepare`] and `z` the branch output
//!   (`W_o a`, or the MLP down projection).
//! Shapes (flat, row-major). x, prepared, z, residual, out: `[rows, cols, H]` bf16;
//!   norm_w: `[H]` (input_layernorm or post_attention_layernorm); base: `[2 sides, 2 taps, H]`
//!   (`base_kernel`, element `(s, t, c)` at `s * 2H + t * H + c`); w_delta: `[4G, H]`
//!   (`kernel_projection.weight`, row-major `[out, in]`); finish_delta: `[rows, cols, 2 taps, G]`.
//! Dtypes. All BF16; eps an f32 (> 0, finite).
//! Rounding points. prepare: `prepared` and `finish_delta` are stored BF16 (RNE), once each.
//!   The normalized input `n` and every `delta` (input and output side) are unrounded
//!   intermediates: the input-side coefficients `base + delta` are never stored, and the
//!   output-side delta is rounded only as the stored `finish_delta`. finish: the convolved
//!   branch value `(base + fd) * z + ...` is NOT rounded before the residual add; only `out`
//!   is rounded, once.
//! Accumulation. Implementation choice (the CUDA path uses f32 throughout); the oracle is
//!   f64 from the represented inputs.
//! CUDA. prepare is three launches: a split kernel (one block per column: the inverse RMS,
//!   and each product `norm_w[c] * x[c]`, exact in f32, split into two BF16 terms hi + lo that
//!   sum to it exactly), one GEMM (the gemm helper) of those `2 * columns` rows against
//!   `w_delta` (BF16 in, FP32 accumulate: the products enter unrounded), and an apply kernel
//!   (grid over columns x 2048-channel chunks, 8 channels per thread) that scales the
//!   increments by the inverse RMS and writes `prepared` and `finish_delta`. finish is one
//!   elementwise kernel.
//! Masking. Column 0 of every row has no preceding tap (the `1{i >= 1}` terms vanish); every
//!   column is computed (DFlash2 computes all W columns, live or not).
//! Caller guarantees. group = 16 (the only width the spec defines; others are refused),
//!   H a positive multiple of 16, eps finite and > 0, every length as above (all checked
//!   before anything is written). Non-finite data propagate (not refused). Outputs never
//!   alias inputs (enforced by borrowing).
//! Writes. prepare: every element of `prepared` and `finish_delta` (and, on CUDA, its
//!   [`PrepareScratch`]). finish: every element of `out`. Nothing else.
//! Comparison. prepared, finish_delta, out: close(abs 1e-4, rel 0, 1 bf16 ulp): the f32
//!   device path may land on the other side of a BF16 rounding boundary than the oracle.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod reference;
#[cfg(test)]
mod tests;

#[cfg(any(test, feature = "conformance"))]
use crate::Element;
#[cfg(any(test, feature = "conformance"))]
use crate::registry::{Case, CaseRun, Criterion, InputCheck, output};
#[cfg(any(test, feature = "conformance"))]
use crate::residual_add::bf16_values;
use crate::{Backend, Buffer, OpsError, Result, bf16, check_len, check_param};

/// Registry id.
pub const OP: &str = "dynamic_grouped_conv";

/// The group width the specification defines (channels sharing one dynamic increment).
pub const GROUP: usize = 16;

/// The comparison criterion of every output.
#[cfg(any(test, feature = "conformance"))]
pub const CRITERION: Criterion = Criterion::Close {
    abs: 1e-4,
    rel: 0.0,
    bf16_ulps: 1,
};

/// Shape and constants of a dynamic grouped convolution.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ConvParams {
    /// Requests in the batch.
    pub rows: usize,
    /// Columns per request (the block width W).
    pub cols: usize,
    /// Hidden width H (5120 for the official 27B DFlash2).
    pub hidden: usize,
    /// Group width; must be [`GROUP`].
    pub group: usize,
    /// RMSNorm epsilon (1e-6 for the official drafts).
    pub eps: f32,
}

impl ConvParams {
    /// Number of groups `G = hidden / group`.
    pub fn groups(&self) -> usize {
        self.hidden / self.group.max(1)
    }
}

/// Checked element counts: (activations `rows*cols*H`, finish_delta `rows*cols*2G`,
/// w_delta `4G*H`).
fn sizes(p: &ConvParams) -> Result<(usize, usize, usize)> {
    check_param(OP, "group", p.group == GROUP, p.group, || {
        format!("{GROUP} (the specified group width)")
    })?;
    check_param(
        OP,
        "hidden",
        p.hidden > 0 && p.hidden.is_multiple_of(GROUP),
        p.hidden,
        || format!("a positive multiple of group = {GROUP}"),
    )?;
    check_param(OP, "eps", p.eps.is_finite() && p.eps > 0.0, p.eps, || {
        "a finite value > 0".into()
    })?;
    let g = p.groups();
    let overflow = || OpsError::Param {
        op: OP,
        param: "rows * cols * hidden",
        expected: "a product that fits in usize".into(),
        found: format!("{} * {} * {}", p.rows, p.cols, p.hidden),
    };
    let columns = p.rows.checked_mul(p.cols).ok_or_else(overflow)?;
    let act = columns.checked_mul(p.hidden).ok_or_else(overflow)?;
    let fd = columns.checked_mul(2 * g).ok_or_else(overflow)?;
    let wd = (4 * g).checked_mul(p.hidden).ok_or_else(overflow)?;
    Ok((act, fd, wd))
}

/// Device scratch of [`prepare`] for one shape: the split normalized-input products
/// `[2 * rows * cols, H]` BF16 and the projected increments `[2 * rows * cols, 4G]` plus one
/// inverse RMS per column, F32. Allocated once (before a CUDA graph is captured); the CPU
/// reference does not touch it.
#[derive(Debug)]
pub struct PrepareScratch {
    split: Buffer<bf16>,
    raw: Buffer<f32>,
}

impl PrepareScratch {
    /// Bytes the scratch allocated (both buffers' capacities).
    pub fn bytes(&self) -> u64 {
        (self.split.capacity() * 2 + self.raw.capacity() * 4) as u64
    }

    /// Scratch for `p` on `be`.
    pub fn new(be: &Backend, p: &ConvParams) -> Result<Self> {
        let (split, raw) = Self::lens(p)?;
        Ok(PrepareScratch {
            split: be.zeros(split)?,
            raw: be.zeros(raw)?,
        })
    }

    /// Resize the scratch for `p` within what it was made for (no allocation, same
    /// addresses; [`Buffer::set_len`]): a scratch made for the largest shape serves smaller
    /// ones. [`OpsError::Length`] when `p` needs more than it holds (nothing changes then).
    pub fn fit(&mut self, p: &ConvParams) -> Result<()> {
        let (split, raw) = Self::lens(p)?;
        for (buf_cap, need, tensor) in [
            (self.split.capacity(), split, "scratch.split"),
            (self.raw.capacity(), raw, "scratch.raw"),
        ] {
            if need > buf_cap {
                return Err(OpsError::Length {
                    op: OP,
                    tensor,
                    expected: buf_cap,
                    shape: format!("at most the scratch's capacity, for {p:?}"),
                    found: need,
                });
            }
        }
        self.split.set_len(split)?;
        self.raw.set_len(raw)
    }

    /// (split, raw) element counts for `p`.
    fn lens(p: &ConvParams) -> Result<(usize, usize)> {
        let (act, fd, _) = sizes(p)?;
        let columns = p.rows * p.cols; // fits: checked by `sizes`
        // raw: 2 * columns * 4G = 4 * fd f32, then the columns' inverse RMS.
        let raw = fd
            .checked_mul(4)
            .and_then(|n| n.checked_add(columns))
            .ok_or_else(|| OpsError::Param {
                op: OP,
                param: "rows * cols * hidden",
                expected: "a scratch size that fits in usize".into(),
                found: format!("{} * {} * {}", p.rows, p.cols, p.hidden),
            })?;
        Ok((2 * act, raw))
    }
}

/// The input side: normalize `x`, project the dynamic increments, emit the convolved
/// `prepared` input and the output side's `finish_delta` (see the module contract).
/// `scratch` must have been made by [`PrepareScratch::new`] for a shape with the same sizes.
pub fn prepare(
    be: &Backend,
    x: &Buffer<bf16>,
    norm_w: &Buffer<bf16>,
    base: &Buffer<bf16>,
    w_delta: &Buffer<bf16>,
    prepared: &mut Buffer<bf16>,
    finish_delta: &mut Buffer<bf16>,
    scratch: &mut PrepareScratch,
    p: &ConvParams,
) -> Result<()> {
    let (act, fd, wd) = sizes(p)?;
    let (split_len, raw_len) = PrepareScratch::lens(p)?;
    check_len(OP, "scratch.split", scratch.split.len(), split_len, || {
        "[2 * rows * cols, hidden] (PrepareScratch::new for this shape)".into()
    })?;
    check_len(OP, "scratch.raw", scratch.raw.len(), raw_len, || {
        "[2 * rows * cols * 4G + rows * cols] (PrepareScratch::new for this shape)".into()
    })?;
    let (r, w, h, g) = (p.rows, p.cols, p.hidden, p.groups());
    check_len(OP, "x", x.len(), act, || {
        format!("[rows={r}, cols={w}, hidden={h}]")
    })?;
    check_len(OP, "norm_w", norm_w.len(), h, || format!("[hidden={h}]"))?;
    check_len(OP, "base", base.len(), 4 * h, || {
        format!("[2 sides, 2 taps, hidden={h}]")
    })?;
    check_len(OP, "w_delta", w_delta.len(), wd, || {
        format!("[4 * G={}, hidden={h}]", 4 * g)
    })?;
    check_len(OP, "prepared", prepared.len(), act, || {
        format!("[rows={r}, cols={w}, hidden={h}]")
    })?;
    check_len(OP, "finish_delta", finish_delta.len(), fd, || {
        format!("[rows={r}, cols={w}, 2 taps, G={g}]")
    })?;
    match be {
        Backend::Cpu => {
            reference::prepare(
                x.host(OP, "x")?,
                norm_w.host(OP, "norm_w")?,
                base.host(OP, "base")?,
                w_delta.host(OP, "w_delta")?,
                prepared.host_mut(OP, "prepared")?,
                finish_delta.host_mut(OP, "finish_delta")?,
                p,
            );
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(c) => cuda::prepare(
            c,
            x,
            norm_w,
            base,
            w_delta,
            prepared,
            finish_delta,
            &mut scratch.split,
            &mut scratch.raw,
            p,
        ),
    }
}

/// The output side: convolve the branch output `z` with `base + finish_delta` and add it
/// into `residual`, writing `out` (see the module contract).
pub fn finish(
    be: &Backend,
    z: &Buffer<bf16>,
    finish_delta: &Buffer<bf16>,
    base: &Buffer<bf16>,
    residual: &Buffer<bf16>,
    out: &mut Buffer<bf16>,
    p: &ConvParams,
) -> Result<()> {
    let (act, fd, _) = sizes(p)?;
    let (r, w, h, g) = (p.rows, p.cols, p.hidden, p.groups());
    let shape = || format!("[rows={r}, cols={w}, hidden={h}]");
    check_len(OP, "z", z.len(), act, shape)?;
    check_len(OP, "finish_delta", finish_delta.len(), fd, || {
        format!("[rows={r}, cols={w}, 2 taps, G={g}]")
    })?;
    check_len(OP, "base", base.len(), 4 * h, || {
        format!("[2 sides, 2 taps, hidden={h}]")
    })?;
    check_len(OP, "residual", residual.len(), act, shape)?;
    check_len(OP, "out", out.len(), act, shape)?;
    match be {
        Backend::Cpu => {
            reference::finish(
                z.host(OP, "z")?,
                finish_delta.host(OP, "finish_delta")?,
                base.host(OP, "base")?,
                residual.host(OP, "residual")?,
                out.host_mut(OP, "out")?,
                p,
            );
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(c) => cuda::finish(c, z, finish_delta, base, residual, out, p),
    }
}

/// Deterministic inputs of a case: the branch input x (a residual stream), norm weights
/// around 1, base coefficients, and W_delta scaled so that the increments are O(0.5).
#[cfg(any(test, feature = "conformance"))]
pub(crate) struct CaseInputs {
    pub(crate) x: Vec<bf16>,
    pub(crate) norm_w: Vec<bf16>,
    pub(crate) base: Vec<bf16>,
    pub(crate) w_delta: Vec<bf16>,
}

#[cfg(any(test, feature = "conformance"))]
pub(crate) fn case_inputs(p: &ConvParams, seed: u64) -> CaseInputs {
    let (h, g) = (p.hidden, p.groups());
    let n = p.rows * p.cols * h;
    CaseInputs {
        x: bf16_values(seed, n, 3.0),
        norm_w: bf16_values(seed ^ 1, h, 0.5)
            .into_iter()
            .map(|v| bf16::from_f32(1.0 + v.to_f32()))
            .collect(),
        base: bf16_values(seed ^ 2, 4 * h, 1.0),
        w_delta: bf16_values(seed ^ 3, 4 * g * h, 1.5 / (h as f32).sqrt()),
    }
}

#[cfg(any(test, feature = "conformance"))]
fn prepare_case(p: ConvParams, seed: u64) -> impl Fn(&Backend) -> Result<CaseRun> + Send + Sync {
    move |be: &Backend| {
        let d = case_inputs(&p, seed);
        let act = p.rows * p.cols * p.hidden;
        let fdn = p.rows * p.cols * 2 * p.groups();
        let mut inputs = InputCheck::default();
        let x = inputs.upload(be, "x", &d.x)?;
        let nw = inputs.upload(be, "norm_w", &d.norm_w)?;
        let base = inputs.upload(be, "base", &d.base)?;
        let wd = inputs.upload(be, "w_delta", &d.w_delta)?;
        let mut prepared = be.filled(act, bf16::POISON)?;
        let mut fd = be.filled(fdn, bf16::POISON)?;
        let mut scratch = PrepareScratch::new(be, &p)?;
        prepare(
            be,
            &x,
            &nw,
            &base,
            &wd,
            &mut prepared,
            &mut fd,
            &mut scratch,
            &p,
        )?;
        let mut modified = Vec::new();
        inputs.verify(be, "x", &x, &mut modified)?;
        inputs.verify(be, "norm_w", &nw, &mut modified)?;
        inputs.verify(be, "base", &base, &mut modified)?;
        inputs.verify(be, "w_delta", &wd, &mut modified)?;
        Ok(CaseRun {
            outputs: vec![
                output(
                    "prepared",
                    CRITERION,
                    &vec![bf16::POISON; act],
                    &be.download(&prepared)?,
                    |_| true,
                ),
                output(
                    "finish_delta",
                    CRITERION,
                    &vec![bf16::POISON; fdn],
                    &be.download(&fd)?,
                    |_| true,
                ),
            ],
            modified_inputs: modified,
        })
    }
}

#[cfg(any(test, feature = "conformance"))]
fn finish_case(p: ConvParams, seed: u64) -> impl Fn(&Backend) -> Result<CaseRun> + Send + Sync {
    move |be: &Backend| {
        let act = p.rows * p.cols * p.hidden;
        let fdn = p.rows * p.cols * 2 * p.groups();
        let mut inputs = InputCheck::default();
        let z = inputs.upload(be, "z", &bf16_values(seed, act, 1.0))?;
        let fd = inputs.upload(be, "finish_delta", &bf16_values(seed ^ 1, fdn, 0.5))?;
        let base = inputs.upload(be, "base", &bf16_values(seed ^ 2, 4 * p.hidden, 1.0))?;
        let res = inputs.upload(be, "residual", &bf16_values(seed ^ 3, act, 4.0))?;
        let mut out = be.filled(act, bf16::POISON)?;
        finish(be, &z, &fd, &base, &res, &mut out, &p)?;
        let mut modified = Vec::new();
        inputs.verify(be, "z", &z, &mut modified)?;
        inputs.verify(be, "finish_delta", &fd, &mut modified)?;
        inputs.verify(be, "base", &base, &mut modified)?;
        inputs.verify(be, "residual", &res, &mut modified)?;
        Ok(CaseRun {
            outputs: vec![output(
                "out",
                CRITERION,
                &vec![bf16::POISON; act],
                &be.download(&out)?,
                |_| true,
            )],
            modified_inputs: modified,
        })
    }
}

#[cfg(any(test, feature = "conformance"))]
fn params(rows: usize, cols: usize, hidden: usize) -> ConvParams {
    ConvParams {
        rows,
        cols,
        hidden,
        group: GROUP,
        eps: 1e-6,
    }
}

/// Conformance cases: the official 27B DFlash2 width (H 5120, G 320) with rows 1 and 8 and
/// cols 2, 8 and 16 (the largest prepare runs are heavy on the CPU), a tiny H = 32 case, and
/// the cols = 1 edge (no preceding tap anywhere), for both entries.
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn cases() -> Vec<Case> {
    vec![
        Case::new(
            OP,
            "prepare_h32_rows2_cols3",
            prepare_case(params(2, 3, 32), 1),
        ),
        Case::new(
            OP,
            "prepare_h32_rows3_cols1",
            prepare_case(params(3, 1, 32), 2),
        ),
        Case::new(
            OP,
            "prepare_27b_rows1_cols2",
            prepare_case(params(1, 2, 5120), 3),
        ),
        Case::new(
            OP,
            "prepare_27b_rows1_cols8",
            prepare_case(params(1, 8, 5120), 4),
        )
        .heavy(),
        Case::new(
            OP,
            "prepare_27b_rows8_cols1",
            prepare_case(params(8, 1, 5120), 5),
        ),
        Case::new(
            OP,
            "prepare_27b_rows1_cols16",
            prepare_case(params(1, 16, 5120), 6),
        )
        .heavy(),
        Case::new(
            OP,
            "prepare_27b_rows8_cols8",
            prepare_case(params(8, 8, 5120), 7),
        )
        .heavy(),
        Case::new(
            OP,
            "prepare_27b_rows8_cols16",
            prepare_case(params(8, 16, 5120), 8),
        )
        .heavy(),
        Case::new(
            OP,
            "finish_h32_rows2_cols3",
            finish_case(params(2, 3, 32), 11),
        ),
        Case::new(
            OP,
            "finish_h32_rows3_cols1",
            finish_case(params(3, 1, 32), 12),
        ),
        Case::new(
            OP,
            "finish_27b_rows1_cols2",
            finish_case(params(1, 2, 5120), 13),
        ),
        Case::new(
            OP,
            "finish_27b_rows1_cols16",
            finish_case(params(1, 16, 5120), 14),
        ),
        Case::new(
            OP,
            "finish_27b_rows8_cols16",
            finish_case(params(8, 16, 5120), 15),
        ),
        Case::new(
            OP,
            "finish_27b_rows8_cols1",
            finish_case(params(8, 1, 5120), 16),
        ),
    ]
}
