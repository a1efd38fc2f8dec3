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
//!   BF16. The result equals `residual_add::run_inplace` followed by [`run`], bit for bit on
//!   both backends (the kernel keeps `rms_norm_bf16`'s element order and block sum).
//! Rounding points. y only: once, BF16 RNE. The mean, the reciprocal root and the products
//!   are unrounded math.
//! Accumulation. Implementation choice (CUDA: FP32 block reduction); the oracle is f64 from
//!   the represented inputs.
//! Tie-breaking. None. Masking. None (every row is normalized).
//! Caller guarantees. No aliasing between y and the inputs. NaN/Inf propagate.
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

fn validate(x: usize, w: usize, y: usize, p: &RmsNormParams) -> Result<()> {
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
    check_len(OP, "x", x, n, || format!("[rows={rows}, hidden={h}]"))?;
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
    validate(x.len(), w.len(), y.len(), p)?;
    match be {
        Backend::Cpu => {
            reference::run(
                x.host(OP, "x")?,
                w.host(OP, "w")?,
                y.host_mut(OP, "y")?,
                p.hidden,
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
            p.hidden,
            p.eps,
        ),
    }
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
            let xs = x.host_mut(OP, "x")?;
            crate::residual_add::reference::add_inplace(xs, delta.host(OP, "delta")?);
            reference::run(
                xs,
                w.host(OP, "w")?,
                y.host_mut(OP, "y")?,
                p.hidden,
                p.eps,
                |v: bf16| f64::from(v.to_f32()),
            );
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

#[cfg(any(test, feature = "conformance"))]
fn case(
    rows: usize,
    hidden: usize,
    f32_input: bool,
    seed: u64,
) -> impl Fn(&Backend) -> Result<CaseRun> + Send + Sync {
    move |be: &Backend| {
        let mut g = SplitMix::new(seed);
        let p = RmsNormParams {
            rows,
            hidden,
            eps: 1e-6,
        };
        // Rows at very different scales (the norm must remove the scale), weights of both signs.
        let scales: Vec<f64> = (0..rows).map(|r| 10f64.powi((r % 7) as i32 - 3)).collect();
        let w = g.bf16_vec(hidden, -2.0, 2.0);
        let mut inputs = InputCheck::default();
        let wb = inputs.upload(be, "w", &w)?;
        let mut y = be.filled(rows * hidden, bf16::POISON)?;
        let mut modified = Vec::new();
        if f32_input {
            let x: Vec<f32> = (0..rows * hidden)
                .map(|i| (g.range(-1.0, 1.0) * scales[i / hidden]) as f32)
                .collect();
            let xb = inputs.upload(be, "x", &x)?;
            run_f32(be, &xb, &wb, &mut y, &p)?;
            inputs.verify(be, "x", &xb, &mut modified)?;
        } else {
            let x: Vec<bf16> = (0..rows * hidden)
                .map(|i| bf16::from_f64(g.range(-1.0, 1.0) * scales[i / hidden]))
                .collect();
            let xb = inputs.upload(be, "x", &x)?;
            run(be, &xb, &wb, &mut y, &p)?;
            inputs.verify(be, "x", &xb, &mut modified)?;
        }
        inputs.verify(be, "w", &wb, &mut modified)?;
        Ok(CaseRun {
            outputs: vec![output(
                "y",
                criterion(&w),
                &vec![bf16::POISON; rows * hidden],
                &be.download(&y)?,
                |_| true,
            )],
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
        let p = RmsNormParams {
            rows,
            hidden,
            eps: 1e-6,
        };
        let n = rows * hidden;
        let scales: Vec<f64> = (0..rows).map(|r| 10f64.powi((r % 7) as i32 - 3)).collect();
        let w = g.bf16_vec(hidden, -2.0, 2.0);
        let x0: Vec<bf16> = (0..n)
            .map(|i| bf16::from_f64(g.range(-1.0, 1.0) * scales[i / hidden]))
            .collect();
        let delta: Vec<bf16> = (0..n)
            .map(|i| match i % 3 {
                0 => -x0[i],
                1 => bf16::from_f64(g.range(-1.0, 1.0) * scales[i / hidden] * 1e-3),
                _ => bf16::from_f64(g.range(-1.0, 1.0) * scales[i / hidden] * 8.0),
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
                output(
                    "y",
                    criterion(&w),
                    &vec![bf16::POISON; n],
                    &be.download(&y)?,
                    |_| true,
                ),
            ],
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
