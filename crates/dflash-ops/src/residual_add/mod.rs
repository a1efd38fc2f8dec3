//! Residual add: `out = bf16_rne(x + y)` elementwise (the draft layer's `y = x + W_o a` and
//! `x_next = y + W_down(..)` in DFlash).
//!
//! Semantics. For each i < n: `out[i] = bf16_rne(x[i] + y[i])`, the sum taken exactly (in
//!   f64) from the represented BF16 inputs and rounded once, round-to-nearest-even.
//!   [`run_inplace`] computes the same value into `x`: `x[i] <- bf16_rne(x[i] + y[i])`.
//! Shapes. x, y, out: `[n]` bf16 (flat; callers pass `[rows, cols, H]` activations as
//!   `n = rows * cols * H`).
//! Dtypes. BF16 in, BF16 out.
//! Rounding points. One: the stored output. The sum of two BF16 values rounded to f32 and
//!   then to BF16 equals the directly rounded sum (f32 has more than 2 * 8 + 2 significant
//!   bits, so the double rounding is innocuous), so the device result is bit-exact.
//! Accumulation. None (one addition).
//! Tie-breaking. RNE at the one rounding point. Non-finite inputs propagate by IEEE rules
//!   (inf + -inf = NaN); a NaN result's payload is not part of the contract.
//! Aliasing. [`run`] writes a separate `out`; Rust's borrow rules forbid passing `x` or `y`
//!   as `out` through it. The in-place form is [`run_inplace`] (`x` is read and written
//!   element by element by the same thread, so it is race-free). `y` may not alias `x` in
//!   either form (again enforced by borrowing).
//! Caller guarantees. Nothing beyond the lengths (all checked).
//! Writes. Every element of `out` (or of `x` for [`run_inplace`]); nothing else.
//! Comparison. out: exact (bit-identical), inputs unchanged.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
pub(crate) mod reference;
#[cfg(test)]
mod tests;

#[cfg(any(test, feature = "conformance"))]
use crate::Element;
#[cfg(any(test, feature = "conformance"))]
use crate::registry::{Case, CaseRun, Criterion, InputCheck, output};
use crate::{Backend, Buffer, Result, bf16, check_len};

/// Registry id.
pub const OP: &str = "residual_add";

/// Shape of a residual add.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResidualAddParams {
    /// Number of elements of `x`, `y` and `out`.
    pub n: usize,
}

fn check(
    x: &Buffer<bf16>,
    y: &Buffer<bf16>,
    out_len: Option<usize>,
    p: &ResidualAddParams,
) -> Result<()> {
    let n = p.n;
    check_len(OP, "x", x.len(), n, || format!("[n={n}]"))?;
    check_len(OP, "y", y.len(), n, || format!("[n={n}]"))?;
    if let Some(len) = out_len {
        check_len(OP, "out", len, n, || format!("[n={n}]"))?;
    }
    Ok(())
}

/// `out = bf16_rne(x + y)` elementwise (see the module contract).
pub fn run(
    be: &Backend,
    x: &Buffer<bf16>,
    y: &Buffer<bf16>,
    out: &mut Buffer<bf16>,
    p: &ResidualAddParams,
) -> Result<()> {
    check(x, y, Some(out.len()), p)?;
    match be {
        Backend::Cpu => {
            reference::add(x.host(OP, "x")?, y.host(OP, "y")?, out.host_mut(OP, "out")?);
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(c) => cuda::run(c, x, y, out, p.n),
    }
}

/// `x <- bf16_rne(x + y)` elementwise, in place (see the module contract).
pub fn run_inplace(
    be: &Backend,
    x: &mut Buffer<bf16>,
    y: &Buffer<bf16>,
    p: &ResidualAddParams,
) -> Result<()> {
    check(x, y, None, p)?;
    match be {
        Backend::Cpu => {
            reference::add_inplace(x.host_mut(OP, "x")?, y.host(OP, "y")?);
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(c) => cuda::run_inplace(c, x, y, p.n),
    }
}

/// Deterministic BF16 test values: a SplitMix64 stream mapped to `[-scale, scale)`.
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn bf16_values(seed: u64, n: usize, scale: f32) -> Vec<bf16> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            let u = (z >> 40) as f32 * (1.0 / 16_777_216.0); // [0, 1)
            bf16::from_f32((2.0 * u - 1.0) * scale)
        })
        .collect()
}

#[cfg(any(test, feature = "conformance"))]
fn case(n: usize, seed: u64, inplace: bool) -> impl Fn(&Backend) -> Result<CaseRun> + Send + Sync {
    move |be: &Backend| {
        let xs = bf16_values(seed, n, 8.0);
        // Mix magnitudes so that some sums cancel, some round, some are exact.
        let ys: Vec<bf16> = bf16_values(seed ^ 0xabcd, n, 1.0)
            .into_iter()
            .enumerate()
            .map(|(i, v)| match i % 4 {
                0 => -xs[i],
                1 => bf16::from_f32(v.to_f32() * 1e-3),
                _ => bf16::from_f32(v.to_f32() * 16.0),
            })
            .collect();
        let p = ResidualAddParams { n };
        let mut inputs = InputCheck::default();
        let y = inputs.upload(be, "y", &ys)?;
        let mut modified = Vec::new();
        let (before, after) = if inplace {
            // In-place: the prior state is x itself; every element must change from it
            // or equal the sum, so the footprint check is against the prior bits.
            let mut x = be.upload(&xs)?;
            run_inplace(be, &mut x, &y, &p)?;
            (xs.clone(), be.download(&x)?)
        } else {
            let x = inputs.upload(be, "x", &xs)?;
            let mut out = be.filled(n, bf16::POISON)?;
            run(be, &x, &y, &mut out, &p)?;
            inputs.verify(be, "x", &x, &mut modified)?;
            (vec![bf16::POISON; n], be.download(&out)?)
        };
        inputs.verify(be, "y", &y, &mut modified)?;
        Ok(CaseRun {
            outputs: vec![output(
                if inplace { "x" } else { "out" },
                Criterion::Exact,
                &before,
                &after,
                |_| true,
            )],
            modified_inputs: modified,
        })
    }
}

/// Conformance cases: the official residual streams (35B-A3B DFlash `[8, 16, 2048]`,
/// 27B DFlash2 `[8, 16, 5120]`), one request with K = 1, and the in-place form.
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn cases() -> Vec<Case> {
    vec![
        Case::new(
            OP,
            "dflash_35b_rows8_cols16_h2048",
            case(8 * 16 * 2048, 1, false),
        ),
        Case::new(
            OP,
            "dflash2_27b_rows8_cols16_h5120",
            case(8 * 16 * 5120, 2, false),
        ),
        Case::new(OP, "rows1_cols2_h2048", case(2 * 2048, 3, false)),
        Case::new(OP, "inplace_rows4_cols8_h5120", case(4 * 8 * 5120, 4, true)),
        Case::new(OP, "odd_length_1001", case(1001, 5, false)),
    ]
}
