//! GEMM: `C = A W^T` for BF16 activations and a BF16 weight stored `[out, in]`.
//!
//! Semantics. `C[i, j] = sum_l A[i, l] * W[j, l]` for `i < m`, `j < n`, over the represented
//!   BF16 inputs (the weight layout is the checkpoint's `[out_features, in_features]`).
//! Shapes. a: `[m, k]`, w: `[n, k]`, out: `[m, n]`, all flat row-major.
//! Dtypes. a, w: BF16. out: F32 ([`run_f32`]) or BF16 ([`run_bf16`]).
//! Rounding points. F32 out: the accumulated sum, unrounded beyond the accumulator (the CPU
//!   reference rounds the f64 sum to f32 once). BF16 out: the sum rounded once, RNE.
//! Accumulation. FP32 or wider (cuBLAS `CUBLAS_COMPUTE_32F` on CUDA); the oracle is the f64
//!   sum of the represented inputs.
//! Tie-breaking. None.
//! Masking/live extents. None: every row of A is multiplied (callers slice live rows).
//! Caller guarantees. No aliasing between `out` and the inputs. NaN/Inf inputs propagate.
//! Writes. Every element of `out`, nothing else.
//! Parameters. `m, n >= 0` (an empty product writes nothing), `k >= 1`, every dimension
//!   at most `i32::MAX` (cuBLAS).
//! Comparison. `close(abs = 1e-4 * sqrt(k) * max|A| * max|W|, rel = 1e-5)`, plus a floor of
//!   one BF16 ulp for BF16 output. Rationale: every term is bounded by `max|A| max|W|` and the
//!   outputs of the cases are O(sqrt(k) max|A| max|W| / 3); an FP32 accumulation of `k` such
//!   terms errs by about `sqrt(k) * 2^-24` of that scale in random-sign data (and by at most
//!   `k/16 * 2^-24` of it with 16-wide tensor-core tiles), so the absolute term is more than
//!   100x the expected error while any indexing error (an O(sqrt(k)) change) is far outside
//!   it; a BF16 output may additionally flip once at a rounding boundary.
//!
//! Device helper. `gemm::cuda::gemm_bf16_device` (crate-private, feature `cuda`) queues the
//! same product on any device slices or views with explicit row strides and an optional
//! accumulate (`beta = 1`), for the launchers of the other ops.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
#[cfg(any(test, feature = "conformance"))]
pub(crate) mod data;
pub(crate) mod reference;
#[cfg(test)]
mod tests;

use half::bf16;

#[cfg(any(test, feature = "conformance"))]
use crate::Element;
#[cfg(any(test, feature = "conformance"))]
use crate::registry::{Case, CaseRun, Criterion, InputCheck, output};
use crate::{Backend, Buffer, Result, check_len, check_param};

/// Registry id.
pub const OP: &str = "gemm";

/// Dimensions of one GEMM (see the module contract).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmParams {
    /// Rows of A and of the output.
    pub m: usize,
    /// Rows of the weight (output features) = columns of the output.
    pub n: usize,
    /// Reduction length (input features), >= 1.
    pub k: usize,
}

fn validate(a: usize, w: usize, out: usize, p: &GemmParams) -> Result<()> {
    let GemmParams { m, n, k } = *p;
    check_param(OP, "k", k >= 1, k, || "k >= 1".into())?;
    for (name, v) in [("m", m), ("n", n), ("k", k)] {
        check_param(OP, name, i32::try_from(v).is_ok(), v, || {
            "at most i32::MAX".into()
        })?;
    }
    let prod = |x: usize, y: usize, what: &'static str| {
        x.checked_mul(y).ok_or_else(|| crate::OpsError::Param {
            op: OP,
            param: what,
            expected: "a product that fits in usize".into(),
            found: format!("{x} x {y}"),
        })
    };
    check_len(OP, "a", a, prod(m, k, "m*k")?, || format!("[m={m}, k={k}]"))?;
    check_len(OP, "w", w, prod(n, k, "n*k")?, || format!("[n={n}, k={k}]"))?;
    check_len(OP, "out", out, prod(m, n, "m*n")?, || {
        format!("[m={m}, n={n}]")
    })?;
    Ok(())
}

/// `out = A W^T` with F32 output, unrounded (see the module contract).
pub fn run_f32(
    be: &Backend,
    a: &Buffer<bf16>,
    w: &Buffer<bf16>,
    out: &mut Buffer<f32>,
    p: &GemmParams,
) -> Result<()> {
    validate(a.len(), w.len(), out.len(), p)?;
    match be {
        Backend::Cpu => {
            reference::run_f32(
                a.host(OP, "a")?,
                w.host(OP, "w")?,
                out.host_mut(OP, "out")?,
                p.m,
                p.n,
                p.k,
            );
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(c) => cuda::run(c, a, w, out, p.m, p.n, p.k),
    }
}

/// `out = bf16_rne(A W^T)` with BF16 output, rounded once (see the module contract).
pub fn run_bf16(
    be: &Backend,
    a: &Buffer<bf16>,
    w: &Buffer<bf16>,
    out: &mut Buffer<bf16>,
    p: &GemmParams,
) -> Result<()> {
    validate(a.len(), w.len(), out.len(), p)?;
    match be {
        Backend::Cpu => {
            reference::run_bf16(
                a.host(OP, "a")?,
                w.host(OP, "w")?,
                out.host_mut(OP, "out")?,
                p.m,
                p.n,
                p.k,
            );
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(c) => cuda::run(c, a, w, out, p.m, p.n, p.k),
    }
}

/// The comparison criterion of the module contract for operands bounded by `amax`, `wmax`.
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn criterion(k: usize, amax: f64, wmax: f64, bf16_out: bool) -> Criterion {
    Criterion::Close {
        abs: 1e-4 * (k as f64).sqrt() * amax * wmax,
        rel: 1e-5,
        bf16_ulps: u32::from(bf16_out),
    }
}

#[cfg(any(test, feature = "conformance"))]
fn case(
    m: usize,
    n: usize,
    k: usize,
    seed: u64,
    bf16_out: bool,
) -> impl Fn(&Backend) -> Result<CaseRun> + Send + Sync {
    move |be: &Backend| {
        let mut g = data::SplitMix::new(seed);
        let a = g.bf16_vec(m * k, -2.0, 2.0);
        let wscale = 1.0 / (k as f64).sqrt();
        let w = g.bf16_vec(n * k, -wscale, wscale);
        let crit = criterion(k, data::max_abs_bf16(&a), data::max_abs_bf16(&w), bf16_out);
        let p = GemmParams { m, n, k };
        let mut inputs = InputCheck::default();
        let ab = inputs.upload(be, "a", &a)?;
        let wb = inputs.upload(be, "w", &w)?;
        let out = if bf16_out {
            let mut o = be.filled(m * n, bf16::POISON)?;
            run_bf16(be, &ab, &wb, &mut o, &p)?;
            output(
                "out",
                crit,
                &vec![bf16::POISON; m * n],
                &be.download(&o)?,
                |_| true,
            )
        } else {
            let mut o = be.filled(m * n, f32::POISON)?;
            run_f32(be, &ab, &wb, &mut o, &p)?;
            output(
                "out",
                crit,
                &vec![f32::POISON; m * n],
                &be.download(&o)?,
                |_| true,
            )
        };
        let mut modified = Vec::new();
        inputs.verify(be, "a", &ab, &mut modified)?;
        inputs.verify(be, "w", &wb, &mut modified)?;
        Ok(CaseRun {
            outputs: vec![out],
            modified_inputs: modified,
        })
    }
}

/// Conformance cases.
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn cases() -> Vec<Case> {
    vec![
        Case::new(OP, "odd_m3_n17_k33_f32", case(3, 17, 33, 1, false)),
        Case::new(OP, "odd_m3_n17_k33_bf16", case(3, 17, 33, 2, true)),
        Case::new(OP, "m1_n256_k512_bf16", case(1, 256, 512, 3, true)),
        Case::new(OP, "m128_n1024_k2048_f32", case(128, 1024, 2048, 4, false)).heavy(),
        Case::new(
            OP,
            "m16_n6144_k2048_f32_35b_mlp",
            case(16, 6144, 2048, 5, false),
        )
        .heavy(),
        Case::new(
            OP,
            "m16_n6144_k2048_bf16_35b_mlp",
            case(16, 6144, 2048, 6, true),
        )
        .heavy(),
        Case::new(
            OP,
            "m16_n17408_k5120_bf16_27b_mlp",
            case(16, 17408, 5120, 7, true),
        )
        .heavy(),
    ]
}
