//! GEMM: `C = A W^T` for BF16 activations and a BF16 weight stored `[out, in]`.
//!
//! Semantics. `C[i, j] = sum_l A[i, l] * W[j, l]` for `i < m`, `j < n`, over the represented
//!   BF16 inputs (the weight layout is the checkpoint's `[out_features, in_features]`).
//! Shapes. a: `[m, k]`, w: `[n, k]`, out: `[m, n]`, all flat row-major.
//! Dtypes. a, w: BF16. out: F32 ([`run_f32`]) or BF16 ([`run_bf16`]).
//! Rounding points. F32 out: the accumulated sum, unrounded beyond the accumulator (the CPU
//!   reference rounds the f64 sum to f32 once). BF16 out: the sum rounded once, RNE.
//! Accumulation. FP32 or wider (on CUDA the skinny kernel's mma.sync FP32 accumulators, or
//!   cuBLAS `CUBLAS_COMPUTE_32F`; see "CUDA" below); the oracle is the f64 sum of the
//!   represented inputs.
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
//!
//! CUDA. Three implementations, chosen per product by `gemm::plan` (`skinny_plan`, then
//! `wide_plan`) from its shape, the alignment of its operands, the device (SMs, shared memory,
//! whether it runs the sm_90a variants) and the backend's [`SkinnyRule`] (so the same shape at
//! the same alignment on the same device under the same rule always takes the same one, with
//! the same bits):
//! - the skinny kernel of `kernels/gemm.cu` for at most 32 rows (k a multiple of 32, A and W
//!   rows 16-byte aligned; the default rule: at most 16 rows on weights of at most 2048 rows):
//!   a block per 16 weight rows, its warps splitting the reduction in interleaved 32-element
//!   chunks through per-warp cp.async rings, mma.sync with FP32 accumulation, the warps'
//!   partial sums added in warp order (deterministic), one rounding at the store;
//! - on sm_90a devices (compute capability 9.0, the sm_90a variants on), where the rule's
//!   `wide_max_m` gives it the product, the wide kernel for the other products of at most 128 rows (A and W rows
//!   16-byte aligned, any k): a block per 64 weight rows and one of S ranges of the reduction
//!   (S <= 8 blocks a cluster, `plan::wide_splits`), TMA streaming the weight and A tiles
//!   through an mbarrier pipeline into wgmma (BF16, FP32 accumulation), the S partial tiles
//!   added in cluster-rank order through distributed shared memory (deterministic), one
//!   rounding at the store;
//! - cuBLAS (`cublasGemmEx`, `CUBLAS_COMPUTE_32F`) for every other product, or every product
//!   under `CudaOptions { gemm: GemmKernels::Cublas }`.
//!
//! Both kernels are launched (compute capability 9.0 and later) as programmatic dependents of
//! the kernel ahead: before they wait for it they prefetch the head of their weight stream
//! into the L2 (a prefetch returns nothing, so nothing is read early). All three keep the
//! comparison above (FP32 accumulation of BF16 products). [`run_swiglu`] takes a kernel's
//! SwiGLU form wherever that kernel takes the product (a skinny block holds 8 features' gate
//! and up rows, a wide tile 32 features'), else cuBLAS into the scratch and the `swiglu`
//! kernel.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
#[cfg(any(test, feature = "conformance"))]
pub(crate) mod data;
#[cfg_attr(not(any(test, feature = "cuda")), allow(dead_code))]
pub(crate) mod plan;
pub(crate) mod reference;
#[cfg(test)]
mod tests;

use half::bf16;

pub use plan::SkinnyRule;

#[cfg(any(test, feature = "conformance"))]
use crate::Element;
#[cfg(any(test, feature = "conformance"))]
use crate::registry::{Case, CaseOutput, CaseRun, Criterion, InputCheck, output};
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

fn validate(a: usize, w: usize, (name, out): (&'static str, usize), p: &GemmParams) -> Result<()> {
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
    check_len(OP, name, out, prod(m, n, "m*n")?, || {
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
    validate(a.len(), w.len(), ("out", out.len()), p)?;
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
    validate(a.len(), w.len(), ("out", out.len()), p)?;
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

/// `out = swiglu(bf16_rne(A [gate; up]^T))`: the MLP's gate and up projections against the
/// concatenated weight `w = [gate_proj; up_proj]` (`[2 I, k]`, `p.n = 2 I`) with the SwiGLU
/// applied on the way out, `out[i, j] = bf16_rne(silu(G[i, j]) * U[i, j])` for `j < I`, where
/// `G` and `U` are the two halves of [`run_bf16`]'s product (each sum rounded once to BF16)
/// and silu is `swiglu`'s (see its contract). Bit for bit [`run_bf16`] into `[m, 2 I]`
/// followed by `swiglu::run_fused` wherever both run the same product the same way.
///
/// `scratch` (`[m, 2 I]`) holds that intermediate product where the backend forms it: the
/// CPU always, CUDA when neither own kernel takes the product (cuBLAS, then the `swiglu`
/// kernel); where the skinny or the wide kernel takes it (`gemm::plan`), its SwiGLU form
/// writes `out` directly and `scratch` is not touched. Its contents after the call are
/// unspecified. Refused (nothing written): an odd `p.n`, or any operand of the wrong length.
pub fn run_swiglu(
    be: &Backend,
    a: &Buffer<bf16>,
    w: &Buffer<bf16>,
    scratch: &mut Buffer<bf16>,
    out: &mut Buffer<bf16>,
    p: &GemmParams,
) -> Result<()> {
    validate(a.len(), w.len(), ("scratch", scratch.len()), p)?;
    check_param(OP, "n", p.n.is_multiple_of(2), p.n, || {
        "an even n (the [gate; up] rows)".into()
    })?;
    let inter = p.n / 2;
    check_len(OP, "out", out.len(), p.m * inter, || {
        format!("[m={}, n/2={inter}]", p.m)
    })?;
    let sp = crate::swiglu::SwigluParams { rows: p.m, inter };
    match be {
        Backend::Cpu => {
            run_bf16(be, a, w, scratch, p)?;
            crate::swiglu::run_fused(be, scratch, out, &sp)
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(c) => {
            if cuda::run_swiglu(c, a, w, out, p.m, p.n, p.k)? {
                return Ok(());
            }
            run_bf16(be, a, w, scratch, p)?;
            crate::swiglu::run_fused(be, scratch, out, &sp)
        }
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
        case_run(be, &inputs, (&ab, &wb), out)
    }
}

/// A case's result: its output, and which of the inputs `a`, `w` the run modified.
#[cfg(any(test, feature = "conformance"))]
fn case_run(
    be: &Backend,
    inputs: &InputCheck,
    (a, w): (&Buffer<bf16>, &Buffer<bf16>),
    out: CaseOutput,
) -> Result<CaseRun> {
    let mut modified = Vec::new();
    inputs.verify(be, "a", a, &mut modified)?;
    inputs.verify(be, "w", w, &mut modified)?;
    Ok(CaseRun {
        outputs: vec![out],
        modified_inputs: modified,
    })
}

#[cfg(all(any(test, feature = "conformance"), not(feature = "cuda")))]
use crate::Element as StridedOut;
/// What a strided case's output type must also be: one the CUDA device helper writes.
#[cfg(all(any(test, feature = "conformance"), feature = "cuda"))]
use cuda::GemmOutElem as StridedOut;

/// An output element a strided case rounds its f64 oracle to (once).
#[cfg(any(test, feature = "conformance"))]
pub(crate) trait RoundedOut: StridedOut {
    /// The f64 value rounded once to this type (RNE).
    fn round(v: f64) -> Self;
}

#[cfg(any(test, feature = "conformance"))]
impl RoundedOut for f32 {
    fn round(v: f64) -> Self {
        v as f32
    }
}

#[cfg(any(test, feature = "conformance"))]
impl RoundedOut for bf16 {
    fn round(v: f64) -> Self {
        crate::bf16_rne_f64(v)
    }
}

/// Shape of a strided case: `m x n x k` with row strides `k + pad` (A, W) and `n + pad` (C).
#[cfg(any(test, feature = "conformance"))]
#[derive(Clone, Copy, Debug)]
pub(crate) struct Strided {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub pad: usize,
    pub accumulate: bool,
}

/// The product of [`Strided`] the way the other ops' launchers call it (the crate's device
/// helper, operands with row padding, and with `accumulate` `C += A W^T` over a random C):
/// on the CPU the f64 sum (plus the old element) rounded once; the padding of every row of
/// C, and one more row of C after the product's, must keep their bits.
#[cfg(any(test, feature = "conformance"))]
fn strided_case<T: RoundedOut>(
    s: Strided,
    seed: u64,
) -> impl Fn(&Backend) -> Result<CaseRun> + Send + Sync {
    move |be: &Backend| {
        let Strided {
            m,
            n,
            k,
            pad,
            accumulate,
        } = s;
        let (lda, ldc) = (k + pad, n + pad);
        let mut g = data::SplitMix::new(seed);
        let a = g.bf16_vec(m * lda, -2.0, 2.0);
        let wscale = 1.0 / (k as f64).sqrt();
        let w = g.bf16_vec(n * lda, -wscale, wscale);
        // C holds one row more than the product writes: a store past row m shows there.
        let old = g.bf16_vec((m + 1) * ldc, -1.0, 1.0);
        let written = |i: usize| i < m * ldc && i % ldc < n;
        let before: Vec<T> = (0..(m + 1) * ldc)
            .map(|i| {
                if written(i) && !accumulate {
                    T::POISON
                } else {
                    T::round(f64::from(old[i].to_f32()))
                }
            })
            .collect();
        let mut crit = criterion(k, data::max_abs_bf16(&a), data::max_abs_bf16(&w), false);
        if let Criterion::Close { bf16_ulps, .. } = &mut crit {
            *bf16_ulps = u32::from(T::DTYPE == crate::DType::BF16);
        }
        let mut inputs = InputCheck::default();
        let ab = inputs.upload(be, "a", &a)?;
        let wb = inputs.upload(be, "w", &w)?;
        let mut out = be.upload(&before)?;
        match be {
            Backend::Cpu => {
                // The dense oracle over the rows' first k elements (the padding is not read).
                let dense = |x: &[bf16]| -> Vec<bf16> {
                    x.chunks(lda)
                        .flat_map(|row| row[..k].iter().copied())
                        .collect()
                };
                let dot = reference::matmul_f64(
                    &dense(ab.host(OP, "a")?),
                    &dense(wb.host(OP, "w")?),
                    m,
                    n,
                    k,
                );
                let o = out.host_mut(OP, "out")?;
                for i in 0..m {
                    for j in 0..n {
                        let prior = if accumulate {
                            o[i * ldc + j].to_f64()
                        } else {
                            0.0
                        };
                        o[i * ldc + j] = T::round(dot[i * n + j] + prior);
                    }
                }
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => cuda::gemm_bf16_device(
                c,
                OP,
                ab.device(OP, "a")?,
                wb.device(OP, "w")?,
                out.device_mut(OP, "out")?,
                &cuda::DeviceGemm {
                    m,
                    n,
                    k,
                    lda,
                    ldw: lda,
                    ldc,
                    accumulate,
                },
            )?,
        }
        let out = output("out", crit, &before, &be.download(&out)?, written);
        case_run(be, &inputs, (&ab, &wb), out)
    }
}

/// The rule the `gemm` conformance cases of the skinny kernel and of cuBLAS run under on
/// CUDA: the default's warps and launch, every weight up to 32 rows, so that the skinny
/// kernel's every entry (1, 2 and 4 n8 tiles, the SwiGLU epilogue, 8- and 16-warp blocks)
/// meets the oracle, not only the products the default rule gives it; 33 to 128 rows go to
/// the wide kernel (sm_90a).
#[cfg(any(test, all(feature = "conformance", feature = "cuda")))]
pub(crate) fn conformance_rule() -> SkinnyRule {
    SkinnyRule {
        max_m: plan::SKINNY_MAX_M,
        max_n: usize::MAX,
        wide_max_m: plan::WIDE_MAX_M,
        ..SkinnyRule::default()
    }
}

/// The rule the wide kernel's cases run under on CUDA: the skinny kernel off, so that the
/// wide kernel (sm_90a) takes every product of up to 128 rows at 16-byte aligned rows.
#[cfg(any(test, all(feature = "conformance", feature = "cuda")))]
pub(crate) fn wide_conformance_rule() -> SkinnyRule {
    SkinnyRule {
        max_m: 0,
        wide_max_m: plan::WIDE_MAX_M,
        ..SkinnyRule::default()
    }
}

/// The rule a case of `path` runs under (see [`Path`]).
#[cfg(any(test, all(feature = "conformance", feature = "cuda")))]
pub(crate) fn case_rule(path: Path) -> SkinnyRule {
    match path {
        Path::Wide => wide_conformance_rule(),
        Path::Skinny | Path::Cublas => conformance_rule(),
    }
}

/// Run `f` with the backend's GEMM rule set to [`case_rule`] of `path` (CUDA; the CPU has
/// none), restoring the backend's own rule after it.
#[cfg(any(test, feature = "conformance"))]
fn under_case_rule<R>(be: &Backend, path: Path, f: impl FnOnce() -> Result<R>) -> Result<R> {
    match be {
        #[cfg(feature = "cuda")]
        Backend::Cuda(c) => {
            let own = c.gemm_rule();
            c.set_gemm_rule(case_rule(path));
            let r = f();
            c.set_gemm_rule(own);
            r
        }
        _ => {
            let _ = path;
            f()
        }
    }
}

/// Which implementation a case exercises on an sm_90a device (at 16-byte aligned addresses,
/// under its [`case_rule`]), as `gemm::plan` decides; `tests::the_conformance_cases_cover_
/// every_side_of_the_plan` checks every row of [`CASES`] and [`SWIGLU_CASES`] against the plan.
/// Elsewhere (other devices, the portable variants) the wide cases run through cuBLAS.
#[cfg(any(test, feature = "conformance"))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Path {
    /// The skinny kernel of `kernels/gemm.cu` (under [`conformance_rule`]).
    Skinny,
    /// The wide kernel of `kernels/gemm.cu` (under [`wide_conformance_rule`], or under
    /// [`conformance_rule`] above 32 rows).
    Wide,
    /// cuBLAS (under [`conformance_rule`]: shapes or strides both kernels refuse).
    Cublas,
}

/// One case: name, (m, n, k), row padding (`None`: the public op on dense operands; `Some`:
/// the device helper over padded rows, [`strided_case`]), accumulate, BF16 output, seed, heavy,
/// and the implementation it exercises on an sm_90a device.
#[cfg(any(test, feature = "conformance"))]
pub(crate) type CaseSpec = (
    &'static str,
    (usize, usize, usize),
    Option<usize>,
    bool,
    bool,
    u64,
    bool,
    Path,
);

/// The conformance cases: the products `gemm::plan` gives the skinny kernel (m <= 32, k % 32
/// == 0, 16-byte aligned rows: every n8-tile count, n not a multiple of 16, fewer chunks a
/// warp than ring stages, strides and accumulate, grids of 8 and 16 warps a block, the drafts'
/// B = 1 and 2 shapes up to the 27B MLP); those of the wide kernel (every n8-tile count 1 to
/// 16, n not a multiple of 64, k not a multiple of 64, one chunk, fewer chunks than splits
/// would want, clusters of 1 to 8 blocks, strides and accumulate, the drafts' shapes at B = 1
/// and 8); and around them cuBLAS (k 33, an odd stride, more than 128 rows).
#[cfg(any(test, feature = "conformance"))]
#[rustfmt::skip]
pub(crate) const CASES: [CaseSpec; 36] = {
    use Path::{Cublas, Skinny, Wide};
    [
        ("odd_m3_n17_k33_f32", (3, 17, 33), None, false, false, 1, false, Cublas),
        ("odd_m3_n17_k33_bf16", (3, 17, 33), None, false, true, 2, false, Cublas),
        ("m1_n256_k512_bf16", (1, 256, 512), None, false, true, 3, false, Skinny),
        ("m8_n1000_k2048_f32", (8, 1000, 2048), None, false, false, 8, false, Skinny),
        ("m24_n333_k96_bf16", (24, 333, 96), None, false, true, 9, false, Skinny),
        ("m64_n520_k4096_bf16", (64, 520, 4096), None, false, true, 10, false, Wide),
        ("m5_n40_k64_f32", (5, 40, 64), None, false, false, 11, false, Skinny),
        ("m13_n2048_k96_bf16", (13, 2048, 96), None, false, true, 18, false, Skinny),
        ("m16_n1024_k2048_f32_35b_k", (16, 1024, 2048), None, false, false, 19, false, Skinny),
        ("m16_n2048_k6144_bf16_35b_down", (16, 2048, 6144), None, false, true, 20, false, Skinny),
        ("m8_n1024_k5120_bf16_27b_v", (8, 1024, 5120), None, false, true, 21, false, Skinny),
        ("strided_m16_n100_k256_pad8_f32", (16, 100, 256), Some(8), false, false, 12, false, Skinny),
        ("strided_accumulate_m16_n100_k256_pad8_f32", (16, 100, 256), Some(8), true, false, 13, false, Skinny),
        ("strided_accumulate_m9_n70_k512_pad16_bf16", (9, 70, 512), Some(16), true, true, 14, false, Skinny),
        ("strided_unaligned_m4_n30_k64_pad3_bf16", (4, 30, 64), Some(3), false, true, 15, false, Cublas),
        ("m136_n70_k64_bf16", (136, 70, 64), None, false, true, 22, false, Cublas),
        ("m128_n1024_k2048_f32", (128, 1024, 2048), None, false, false, 4, true, Wide),
        ("m16_n6144_k2048_f32_35b_mlp", (16, 6144, 2048), None, false, false, 5, true, Skinny),
        ("m16_n6144_k2048_bf16_35b_mlp", (16, 6144, 2048), None, false, true, 6, true, Skinny),
        ("m16_n17408_k5120_bf16_27b_mlp", (16, 17408, 5120), None, false, true, 7, true, Skinny),
        ("m16_n5120_k17408_bf16_27b_down", (16, 5120, 17408), None, false, true, 16, true, Skinny),
        ("m32_n1024_k5120_f32_27b_kv", (32, 1024, 5120), None, false, false, 17, true, Skinny),
        ("wide_m1_n64_k64_bf16", (1, 64, 64), None, false, true, 51, false, Wide),
        ("wide_m5_n100_k200_f32", (5, 100, 200), None, false, false, 52, false, Wide),
        ("wide_m13_n2048_k96_bf16", (13, 2048, 96), None, false, true, 53, false, Wide),
        ("wide_m16_n1000_k2048_f32", (16, 1000, 2048), None, false, false, 54, false, Wide),
        ("wide_m24_n333_k4096_bf16", (24, 333, 4096), None, false, true, 55, false, Wide),
        ("wide_m40_n130_k1032_bf16", (40, 130, 1032), None, false, true, 56, false, Wide),
        ("wide_m100_n200_k512_f32", (100, 200, 512), None, false, false, 57, false, Wide),
        ("wide_strided_accumulate_m16_n100_k256_pad8_f32", (16, 100, 256), Some(8), true, false, 58, false, Wide),
        ("wide_strided_accumulate_m9_n70_k520_pad16_bf16", (9, 70, 520), Some(16), true, true, 59, false, Wide),
        ("wide_strided_m72_n130_k192_pad8_bf16", (72, 130, 192), Some(8), false, true, 60, false, Wide),
        ("wide_m16_n4096_k2048_bf16_35b_q", (16, 4096, 2048), None, false, true, 61, true, Wide),
        ("wide_m16_n2048_k6144_bf16_35b_down", (16, 2048, 6144), None, false, true, 62, true, Wide),
        ("wide_m128_n2048_k4096_bf16_35b_o", (128, 2048, 4096), None, false, true, 63, true, Wide),
        ("wide_m8_n1024_k5120_f32_27b_kv", (8, 1024, 5120), None, false, false, 64, true, Wide),
    ]
};

/// Conformance cases: [`CASES`], then [`SWIGLU_CASES`].
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn cases() -> Vec<Case> {
    /// A registry case running `run` under the rule of `path`, heavy or not.
    fn ruled(
        name: &'static str,
        path: Path,
        heavy: bool,
        run: impl Fn(&Backend) -> Result<CaseRun> + Send + Sync + 'static,
    ) -> Case {
        let c = Case::new(OP, name, move |be: &Backend| {
            under_case_rule(be, path, || run(be))
        });
        if heavy { c.heavy() } else { c }
    }
    CASES
        .iter()
        .map(
            |&(name, (m, n, k), pad, accumulate, bf16_out, seed, heavy, path)| match pad {
                None => ruled(name, path, heavy, case(m, n, k, seed, bf16_out)),
                Some(pad) => {
                    let s = Strided {
                        m,
                        n,
                        k,
                        pad,
                        accumulate,
                    };
                    if bf16_out {
                        ruled(name, path, heavy, strided_case::<bf16>(s, seed))
                    } else {
                        ruled(name, path, heavy, strided_case::<f32>(s, seed))
                    }
                }
            },
        )
        .chain(
            SWIGLU_CASES
                .iter()
                .map(|&(name, (m, n, k), seed, heavy, path)| {
                    ruled(name, path, heavy, swiglu_case(m, n, k, seed))
                }),
        )
        .collect()
}

/// One [`run_swiglu`] case: name, (m, n = 2 I, k), seed, heavy, the implementation it
/// exercises on an sm_90a device (see [`Path`]).
#[cfg(any(test, feature = "conformance"))]
pub(crate) type SwigluCase = (&'static str, (usize, usize, usize), u64, bool, Path);

/// The [`run_swiglu`] cases: the skinny kernel's SwiGLU epilogue (m <= 32: each n8-tile
/// count, I not a multiple of 8, the drafts' MLP shapes at B = 1 and 2), the wide kernel's
/// (n8-tile counts 1 to 16, I not a multiple of 32, k not a multiple of 64, the 35B-A3B's MLP
/// at B = 8), and the unfused path (m = 136: cuBLAS, then the `swiglu` kernel).
#[cfg(any(test, feature = "conformance"))]
#[rustfmt::skip]
pub(crate) const SWIGLU_CASES: [SwigluCase; 10] = {
    use Path::{Cublas, Skinny, Wide};
    [
        ("swiglu_m5_n96_k64", (5, 96, 64), 41, false, Skinny),
        ("swiglu_m13_n70_k512", (13, 70, 512), 42, false, Skinny),
        ("swiglu_m32_n1000_k256", (32, 1000, 256), 43, false, Skinny),
        ("swiglu_m16_n12288_k2048_35b", (16, 12288, 2048), 44, true, Skinny),
        ("swiglu_m32_n34816_k5120_27b", (32, 34816, 5120), 45, true, Skinny),
        ("swiglu_m136_n256_k128_unfused", (136, 256, 128), 46, false, Cublas),
        ("swiglu_wide_m5_n96_k64", (5, 96, 64), 47, false, Wide),
        ("swiglu_wide_m13_n70_k520", (13, 70, 520), 48, false, Wide),
        ("swiglu_wide_m64_n1000_k256", (64, 1000, 256), 49, false, Wide),
        ("swiglu_wide_m128_n12288_k2048_35b", (128, 12288, 2048), 50, true, Wide),
    ]
};

/// A [`run_swiglu`] case. Outputs: `out` against the composition's f64 oracle (each half's
/// sum rounded once to BF16, then silu(G) U rounded once), within what one BF16 flip of G or
/// U moves it (`|silu'| <= 1.1`: `2.1 * 2^-8 * max|G| * max|U|`) plus one ulp of the output;
/// and `agrees_with_unfused`, 1 per element where `out` equals, bit for bit, [`run_bf16`]
/// followed by `swiglu::run_fused` on the same backend (exact: all ones).
#[cfg(any(test, feature = "conformance"))]
fn swiglu_case(
    m: usize,
    n: usize,
    k: usize,
    seed: u64,
) -> impl Fn(&Backend) -> Result<CaseRun> + Send + Sync {
    move |be: &Backend| {
        let inter = n / 2;
        let mut g = data::SplitMix::new(seed);
        let a = g.bf16_vec(m * k, -2.0, 2.0);
        let wscale = 2.0 / (k as f64).sqrt();
        let w = g.bf16_vec(n * k, -wscale, wscale);
        let prod = reference::matmul_f64(&a, &w, m, n, k);
        let half_max = |off: usize| {
            (0..m * inter)
                .map(|i| crate::bf16_rne_f64(prod[(i / inter) * n + off + i % inter]).to_f64())
                .fold(0.0f64, |x, v| x.max(v.abs()))
        };
        let (gmax, umax) = (half_max(0), half_max(inter));
        let crit = Criterion::Close {
            abs: 2.1 * (2.0f64).powi(-8) * gmax * umax,
            rel: 0.0,
            bf16_ulps: 1,
        };
        let p = GemmParams { m, n, k };
        let mut inputs = InputCheck::default();
        let ab = inputs.upload(be, "a", &a)?;
        let wb = inputs.upload(be, "w", &w)?;
        let mut scratch = be.filled(m * n, bf16::POISON)?;
        let mut o = be.filled(m * inter, bf16::POISON)?;
        run_swiglu(be, &ab, &wb, &mut scratch, &mut o, &p)?;
        let fused = be.download(&o)?;
        let mut o2 = be.filled(m * inter, bf16::POISON)?;
        run_bf16(be, &ab, &wb, &mut scratch, &p)?;
        crate::swiglu::run_fused(
            be,
            &scratch,
            &mut o2,
            &crate::swiglu::SwigluParams { rows: m, inter },
        )?;
        let unfused = be.download(&o2)?;
        let agree: Vec<i32> = fused
            .iter()
            .zip(&unfused)
            .map(|(x, y)| i32::from(x.to_bits() == y.to_bits()))
            .collect();
        let mut agreement = output(
            "agrees_with_unfused",
            Criterion::Exact,
            &vec![i32::POISON; m * inter],
            &agree,
            |_| true,
        );
        // All ones by design (a flag per element; the fused output itself is checked above).
        agreement.allow_constant = true;
        let poison = vec![bf16::POISON; m * inter];
        let outs = vec![output("out", crit, &poison, &fused, |_| true), agreement];
        let mut modified = Vec::new();
        inputs.verify(be, "a", &ab, &mut modified)?;
        inputs.verify(be, "w", &wb, &mut modified)?;
        Ok(CaseRun {
            outputs: outs,
            modified_inputs: modified,
        })
    }
}
