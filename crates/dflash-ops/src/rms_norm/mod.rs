//! Plain RMSNorm over the last axis: `y = w * x / sqrt(mean(x^2) + eps)`.
//!
//! Semantics. For each row r < rows and j < hidden:
//!   `y[r, j] = w[j] * x[r, j] / sqrt(mean_j' x[r, j']^2 + eps)`
//!   This is the draft's PLAIN norm (`w * ...`), not Qwen3.5's zero-centred `(1 + w) * ...`.
//! Shapes. x: `[rows, hidden]`; w: `[hidden]`; y: `[rows, hidden]`.
//! Dtypes. x: BF16 ([`run`]) or F32 ([`run_f32`], for an unrounded producer such as an F32
//!   GEMM output); w: BF16; y: BF16.
//! Residual form ([`run_residual`], the layer's residual add fused with the norm after it):
//!   x is the BF16 residual stream and is first updated in place,
//!   `x[r, j] <- bf16_rne(x[r, j] + delta[r, j])` (the exact sum rounded once, as
//!   `residual_add`), then y is the norm of the updated rows as above. delta: `[rows, hidden]`
//!   BF16. The result equals `residual_add::run_inplace` followed by [`run`], bit for bit: on
//!   the CPU by construction, on CUDA because both kernels run one row template with the same
//!   access path and block size (the launchers take the 8-wide path whenever hidden is a
//!   multiple of 8 and the tensors are 16-byte aligned, as every device buffer is).
//! Rounding points. y only: once, BF16 RNE. The mean, the reciprocal root and the products
//!   are unrounded math.
//! Accumulation. Implementation choice (CUDA: FP32 block reduction); the oracle is f64 from
//!   the represented inputs.
//! Tie-breaking. None. Masking. None (every row is normalized).
//! Caller guarantees. No aliasing between y and the inputs. NaN/Inf propagate.
//! Row-map form ([`run_rows`]): output row i normalizes x row
//!   `(i / group) * stride + offset + i % group` ([`RowMap`]), e.g. the K mask columns of each
//!   request's block of W = K + 1 columns (group K, stride W, offset 1): the draft's final norm
//!   reads them in place. x: `[rows / group * stride, hidden]`; y: `[rows, hidden]`.
//! Writes. Every element of y (and of x in the residual form), nothing else.
//! Parameters. `hidden >= 1`, `eps` finite and >= 0.
//! Comparison. `close(abs = 1e-7 * max|w|, rel = 1e-5, 1 bf16 ulp)`: every output is a
//!   product, so its FP32 error is relative (a few 2^-24); the floor admits one rounding flip.
//!   The residual form's updated x: exact.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
pub(crate) mod reference;
#[cfg(test)]
mod tests;

use half::bf16;

#[cfg(any(test, feature = "conformance"))]
use crate::Element;
#[cfg(any(test, feature = "conformance"))]
use crate::gemm::data::{SplitMix, max_abs_bf16};
#[cfg(any(test, feature = "conformance"))]
use crate::registry::{Case, CaseRun, Criterion, InputCheck, output};
use crate::{Backend, Buffer, OpsError, Result, check_len, check_param};

/// Registry id.
pub const OP: &str = "rms_norm";

/// Parameters of [`run`] / [`run_f32`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RmsNormParams {
    /// Rows to normalize.
    pub rows: usize,
    /// Row length (the normalized axis), >= 1.
    pub hidden: usize,
    /// Epsilon added to the mean square (finite, >= 0).
    pub eps: f32,
}

/// Which x row feeds output row i of [`run_rows`]: `(i / group) * stride + offset + i % group`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowMap {
    /// Consecutive output rows taken from one block of x rows (>= 1).
    pub group: usize,
    /// x rows per block (>= offset + group).
    pub stride: usize,
    /// First x row a block's group starts at.
    pub offset: usize,
}

impl RowMap {
    /// Output row i from x row i.
    pub const IDENTITY: RowMap = RowMap {
        group: 1,
        stride: 1,
        offset: 0,
    };

    /// The draft block's mask columns: of each block of `k + 1` rows (the anchor, then `k`
    /// mask columns), the last `k`.
    pub const fn mask_columns(k: usize) -> RowMap {
        RowMap {
            group: k,
            stride: k + 1,
            offset: 1,
        }
    }

    /// The x row of output row `i` (a checked map: group >= 1).
    fn source(&self, i: usize) -> usize {
        (i / self.group) * self.stride + self.offset + i % self.group
    }

    /// Check the map against `rows` output rows; the x rows it reads (`rows / group * stride`).
    fn check(&self, rows: usize) -> Result<usize> {
        let RowMap {
            group,
            stride,
            offset,
        } = *self;
        check_param(
            OP,
            "map.group",
            group >= 1 && rows.is_multiple_of(group),
            group,
            || format!(">= 1 and dividing rows = {rows}"),
        )?;
        check_param(
            OP,
            "map.stride",
            offset.checked_add(group).is_some_and(|e| e <= stride),
            stride,
            || format!(">= offset + group = {offset} + {group}"),
        )?;
        (rows / group)
            .checked_mul(stride)
            .ok_or_else(|| OpsError::Param {
                op: OP,
                param: "map.stride",
                expected: "rows / group * stride fits in usize".into(),
                found: stride.to_string(),
            })
    }
}

/// `x` rows of `p.hidden` against `w` and `y` (rows of the output: `p.rows`).
fn validate(x: usize, w: usize, y: usize, p: &RmsNormParams) -> Result<()> {
    validate_rows(x, p.rows, w, y, p)
}

/// As [`validate`] with x holding `x_rows` rows.
fn validate_rows(x: usize, x_rows: usize, w: usize, y: usize, p: &RmsNormParams) -> Result<()> {
    check_param(OP, "hidden", p.hidden >= 1, p.hidden, || ">= 1".into())?;
    check_param(OP, "eps", p.eps.is_finite() && p.eps >= 0.0, p.eps, || {
        "finite and >= 0".into()
    })?;
    let n = p
        .rows
        .checked_mul(p.hidden)
        .ok_or_else(|| OpsError::Param {
            op: OP,
            param: "rows*hidden",
            expected: "a size that fits in usize".into(),
            found: format!("{} x {}", p.rows, p.hidden),
        })?;
    let (rows, h) = (p.rows, p.hidden);
    let xn = x_rows.checked_mul(h).ok_or_else(|| OpsError::Param {
        op: OP,
        param: "x rows*hidden",
        expected: "a size that fits in usize".into(),
        found: format!("{x_rows} x {h}"),
    })?;
    check_len(OP, "x", x, xn, || format!("[rows={x_rows}, hidden={h}]"))?;
    check_len(OP, "w", w, h, || format!("[hidden={h}]"))?;
    check_len(OP, "y", y, n, || format!("[rows={rows}, hidden={h}]"))?;
    Ok(())
}

/// Plain RMSNorm of BF16 rows (see the module contract).
pub fn run(
    be: &Backend,
    x: &Buffer<bf16>,
    w: &Buffer<bf16>,
    y: &mut Buffer<bf16>,
    p: &RmsNormParams,
) -> Result<()> {
    run_rows(be, x, w, y, p, &RowMap::IDENTITY)
}

/// Plain RMSNorm of F32 rows (an unrounded producer), BF16 output (see the module contract).
pub fn run_f32(
    be: &Backend,
    x: &Buffer<f32>,
    w: &Buffer<bf16>,
    y: &mut Buffer<bf16>,
    p: &RmsNormParams,
) -> Result<()> {
    validate(x.len(), w.len(), y.len(), p)?;
    match be {
        Backend::Cpu => {
            reference::run(
                x.host(OP, "x")?,
                w.host(OP, "w")?,
                y.host_mut(OP, "y")?,
                p.hidden,
                p.eps,
                f64::from,
            );
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(c) => cuda::launch(
            c,
            OP,
            x.device(OP, "x")?,
            w.device(OP, "w")?,
            y.device_mut(OP, "y")?,
            p.rows,
            p.hidden,
            p.eps,
            &RowMap::IDENTITY,
        ),
    }
}

/// Plain RMSNorm of the BF16 x rows `map` selects (see the module contract); refused before
/// anything is written.
pub fn run_rows(
    be: &Backend,
    x: &Buffer<bf16>,
    w: &Buffer<bf16>,
    y: &mut Buffer<bf16>,
    p: &RmsNormParams,
    map: &RowMap,
) -> Result<()> {
    let x_rows = map.check(p.rows)?;
    validate_rows(x.len(), x_rows, w.len(), y.len(), p)?;
    let h = p.hidden;
    match be {
        Backend::Cpu => {
            let xs = x.host(OP, "x")?;
            // The selected rows, gathered (the identity map reads x as it is).
            let rows: std::borrow::Cow<'_, [bf16]> = if *map == RowMap::IDENTITY {
                xs.into()
            } else {
                (0..p.rows)
                    .flat_map(|i| {
                        xs[map.source(i) * h..(map.source(i) + 1) * h]
                            .iter()
                            .copied()
                    })
                    .collect::<Vec<_>>()
                    .into()
            };
            reference::run(
                &rows,
                w.host(OP, "w")?,
                y.host_mut(OP, "y")?,
                h,
                p.eps,
                |v: bf16| f64::from(v.to_f32()),
            );
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(c) => cuda::launch(
            c,
            OP,
            x.device(OP, "x")?,
            w.device(OP, "w")?,
            y.device_mut(OP, "y")?,
            p.rows,
            h,
            p.eps,
            map,
        ),
    }
}

/// The residual add fused with the norm after it: `x <- bf16_rne(x + delta)`, then
/// `y = norm(x)` (see the module contract). Refused before anything is written.
pub fn run_residual(
    be: &Backend,
    x: &mut Buffer<bf16>,
    delta: &Buffer<bf16>,
    w: &Buffer<bf16>,
    y: &mut Buffer<bf16>,
    p: &RmsNormParams,
) -> Result<()> {
    validate(x.len(), w.len(), y.len(), p)?;
    check_len(OP, "delta", delta.len(), x.len(), || {
        format!("[rows={}, hidden={}]", p.rows, p.hidden)
    })?;
    match be {
        Backend::Cpu => {
            // Every tensor is taken before anything is written (a device buffer here is
            // refused with x untouched).
            let (ds, ws) = (delta.host(OP, "delta")?, w.host(OP, "w")?);
            let ys = y.host_mut(OP, "y")?;
            let xs = x.host_mut(OP, "x")?;
            crate::residual_add::reference::add_inplace(xs, ds);
            reference::run(xs, ws, ys, p.hidden, p.eps, |v: bf16| f64::from(v.to_f32()));
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(c) => cuda::launch_residual(
            c,
            x.device_mut(OP, "x")?,
            delta.device(OP, "delta")?,
            w.device(OP, "w")?,
            y.device_mut(OP, "y")?,
            p.rows,
            p.hidden,
            p.eps,
        ),
    }
}

/// The comparison criterion of the module contract.
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn criterion(w: &[bf16]) -> Criterion {
    Criterion::Close {
        abs: 1e-7 * max_abs_bf16(w),
        rel: 1e-5,
        bf16_ulps: 1,
    }
}

/// `rows * hidden` values in [-1, 1) scaled per row by 1e-3 .. 1e3 (row r: 10^(r % 7 - 3)):
/// the norm must remove the scale.
#[cfg(any(test, feature = "conformance"))]
fn scaled_rows(g: &mut SplitMix, rows: usize, hidden: usize) -> Vec<f64> {
    (0..rows * hidden)
        .map(|i| g.range(-1.0, 1.0) * row_scale(i / hidden))
        .collect()
}

/// [`scaled_rows`] rounded to BF16.
#[cfg(any(test, feature = "conformance"))]
fn scaled_bf16_rows(g: &mut SplitMix, rows: usize, hidden: usize) -> Vec<bf16> {
    scaled_rows(g, rows, hidden)
        .into_iter()
        .map(bf16::from_f64)
        .collect()
}

/// The cases' parameters (eps 1e-6).
#[cfg(any(test, feature = "conformance"))]
fn case_params(rows: usize, hidden: usize) -> RmsNormParams {
    RmsNormParams {
        rows,
        hidden,
        eps: 1e-6,
    }
}

/// Row r's scale in the cases: 10^(r % 7 - 3).
#[cfg(any(test, feature = "conformance"))]
fn row_scale(r: usize) -> f64 {
    10f64.powi((r % 7) as i32 - 3)
}

/// A case's `y` output: poisoned before the run, every element written.
#[cfg(any(test, feature = "conformance"))]
fn y_output(be: &Backend, w: &[bf16], y: &Buffer<bf16>) -> Result<crate::registry::CaseOutput> {
    Ok(output(
        "y",
        criterion(w),
        &vec![bf16::POISON; y.len()],
        &be.download(y)?,
        |_| true,
    ))
}

#[cfg(any(test, feature = "conformance"))]
fn case(
    rows: usize,
    hidden: usize,
    f32_input: bool,
    seed: u64,
) -> impl Fn(&Backend) -> Result<CaseRun> + Send + Sync {
    move |be: &Backend| {
        let mut g = SplitMix::new(seed);
        let p = case_params(rows, hidden);
        // Weights of both signs, rows at very different scales.
        let w = g.bf16_vec(hidden, -2.0, 2.0);
        let mut inputs = InputCheck::default();
        let wb = inputs.upload(be, "w", &w)?;
        let mut y = be.filled(rows * hidden, bf16::POISON)?;
        let mut modified = Vec::new();
        if f32_input {
            let x: Vec<f32> = scaled_rows(&mut g, rows, hidden)
                .into_iter()
                .map(|v| v as f32)
                .collect();
            let xb = inputs.upload(be, "x", &x)?;
            run_f32(be, &xb, &wb, &mut y, &p)?;
            inputs.verify(be, "x", &xb, &mut modified)?;
        } else {
            let x = scaled_bf16_rows(&mut g, rows, hidden);
            let xb = inputs.upload(be, "x", &x)?;
            run(be, &xb, &wb, &mut y, &p)?;
            inputs.verify(be, "x", &xb, &mut modified)?;
        }
        inputs.verify(be, "w", &wb, &mut modified)?;
        Ok(CaseRun {
            outputs: vec![y_output(be, &w, &y)?],
            modified_inputs: modified,
        })
    }
}

/// A residual-form case: x (updated in place) at row scales 1e-3..1e3, a delta that cancels,
/// shrinks or dominates x element by element.
#[cfg(any(test, feature = "conformance"))]
fn residual_case(
    rows: usize,
    hidden: usize,
    seed: u64,
) -> impl Fn(&Backend) -> Result<CaseRun> + Send + Sync {
    move |be: &Backend| {
        let mut g = SplitMix::new(seed);
        let p = case_params(rows, hidden);
        let n = rows * hidden;
        let w = g.bf16_vec(hidden, -2.0, 2.0);
        let x0 = scaled_bf16_rows(&mut g, rows, hidden);
        let delta: Vec<bf16> = (0..n)
            .map(|i| match i % 3 {
                0 => -x0[i],
                1 => bf16::from_f64(g.range(-1.0, 1.0) * row_scale(i / hidden) * 1e-3),
                _ => bf16::from_f64(g.range(-1.0, 1.0) * row_scale(i / hidden) * 8.0),
            })
            .collect();
        let mut inputs = InputCheck::default();
        let wb = inputs.upload(be, "w", &w)?;
        let db = inputs.upload(be, "delta", &delta)?;
        let mut x = be.upload(&x0)?;
        let mut y = be.filled(n, bf16::POISON)?;
        run_residual(be, &mut x, &db, &wb, &mut y, &p)?;
        let mut modified = Vec::new();
        inputs.verify(be, "w", &wb, &mut modified)?;
        inputs.verify(be, "delta", &db, &mut modified)?;
        Ok(CaseRun {
            outputs: vec![
                output("x", Criterion::Exact, &x0, &be.download(&x)?, |_| true),
                y_output(be, &w, &y)?,
            ],
            modified_inputs: modified,
        })
    }
}

/// A row-map case: `reqs` blocks of `k + 1` rows, the last `k` of each normalized (the draft's
/// mask columns), rows at scales 1e-3..1e3.
#[cfg(any(test, feature = "conformance"))]
fn rows_case(
    reqs: usize,
    k: usize,
    hidden: usize,
    seed: u64,
) -> impl Fn(&Backend) -> Result<CaseRun> + Send + Sync {
    move |be: &Backend| {
        let mut g = SplitMix::new(seed);
        let map = RowMap::mask_columns(k);
        let p = case_params(reqs * k, hidden);
        let x = scaled_bf16_rows(&mut g, reqs * (k + 1), hidden);
        let w = g.bf16_vec(hidden, -2.0, 2.0);
        let mut inputs = InputCheck::default();
        let xb = inputs.upload(be, "x", &x)?;
        let wb = inputs.upload(be, "w", &w)?;
        let n = p.rows * hidden;
        let mut y = be.filled(n, bf16::POISON)?;
        run_rows(be, &xb, &wb, &mut y, &p, &map)?;
        let mut modified = Vec::new();
        inputs.verify(be, "x", &xb, &mut modified)?;
        inputs.verify(be, "w", &wb, &mut modified)?;
        Ok(CaseRun {
            outputs: vec![y_output(be, &w, &y)?],
            modified_inputs: modified,
        })
    }
}

/// Conformance cases.
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn cases() -> Vec<Case> {
    vec![
        Case::new(OP, "odd_rows3_h33_bf16", case(3, 33, false, 21)),
        Case::new(
            OP,
            "official_35b_rows16_h2048_bf16",
            case(16, 2048, false, 22),
        ),
        Case::new(
            OP,
            "official_27b_rows128_h5120_bf16",
            case(128, 5120, false, 23),
        ),
        Case::new(OP, "official_35b_rows8_h2048_f32", case(8, 2048, true, 24)),
        Case::new(
            OP,
            "official_27b_rows16_h5120_f32",
            case(16, 5120, true, 25),
        ),
        Case::new(OP, "residual_odd_rows5_h33", residual_case(5, 33, 26)),
        Case::new(OP, "mask_rows_reqs3_k2_h33", rows_case(3, 2, 33, 32)),
        Case::new(
            OP,
            "mask_rows_official_35b_reqs8_k15_h2048",
            rows_case(8, 15, 2048, 33),
        ),
        Case::new(
            OP,
            "mask_rows_official_27b_reqs1_k7_h5120",
            rows_case(1, 7, 5120, 34),
        ),
        // Past 8192 elements a thread of the 8-wide form takes a second step.
        Case::new(OP, "rows3_h8200_bf16", case(3, 8200, false, 29)),
        Case::new(OP, "rows3_h8200_f32", case(3, 8200, true, 30)),
        Case::new(OP, "residual_rows3_h8200", residual_case(3, 8200, 31)),
        Case::new(
            OP,
            "residual_official_35b_rows16_h2048",
            residual_case(16, 2048, 27),
        ),
        Case::new(
            OP,
            "residual_official_27b_rows128_h5120",
            residual_case(128, 5120, 28),
        ),
    ]
}
