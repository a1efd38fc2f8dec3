//! Feature projection: turn captured target features into the draft's context vectors,
//! `c[t] = plain_rmsnorm(W_feature s[t], context_norm)`.
//!
//! Semantics. For each token t < tokens:
//!   proj[t, i] = sum_l W_feature[i, l] * s[t, l]                   (bias-free)
//!   `c[t, i]    = context_norm[i] * proj[t, i] / sqrt(mean_i' proj[t, i']^2 + eps)`
//!   `s[t]` is the concatenation of the captured residuals of the target block ids in recorded
//!   order (`n_ids` blocks of `hidden`); the norm is plain (`w * ...`).
//! Shapes. s: `[tokens, n_ids*hidden]`; w_feature: `[hidden, n_ids*hidden]` (`fc.weight`,
//!   `[out, in]`); context_norm: `[hidden]` (`hidden_norm.weight`); c: `[tokens, hidden]`;
//!   scratch ([`run_with_scratch`]): `[>= tokens*hidden]`.
//! Dtypes. s, w_feature, context_norm: BF16; c: BF16; scratch: F32.
//! Rounding points. c only: once, BF16 RNE. The projection is kept unrounded (F32 on CUDA)
//!   into the norm.
//! Accumulation. Implementation choice (CUDA: the gemm helper's FP32 GEMM into the F32
//!   scratch, FP32 norm reduction); the oracle is f64 from the represented inputs.
//! Tie-breaking. None. Masking. None (every token row is projected).
//! Caller guarantees. No aliasing between c, scratch and the inputs.
//! Writes. Every element of c; on CUDA the first `tokens*hidden` scratch elements (the CPU
//!   never touches the scratch).
//! Workspace. [`run`] allocates its scratch on CUDA for each call (it runs at prefill and
//!   materialize, not in the per-round graph); [`run_with_scratch`] allocates nothing.
//! Parameters. `n_ids >= 1`, `hidden >= 1`, eps finite >= 0; `n_ids*hidden` and `tokens` at
//!   most `i32::MAX` on CUDA.
//! Comparison. `close(abs = 1e-4 * max|context_norm|, rel = 0, 1 bf16 ulp)`: outputs are
//!   O(max|context_norm|); the FP32 projection error, relative to the row's RMS, is
//!   about `sqrt(k) * 2^-24` (k = n_ids*hidden), below 1e-5 at k = 25600.

#[cfg(feature = "cuda")]
mod cuda;
mod reference;
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
pub const OP: &str = "feature_projection";

/// Parameters of [`run`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FeatureProjectionParams {
    /// Token rows T to project.
    pub tokens: usize,
    /// Number of captured target blocks (target layer ids), >= 1.
    pub n_ids: usize,
    /// Hidden width H, >= 1.
    pub hidden: usize,
    /// Norm epsilon (finite, >= 0).
    pub eps: f32,
}

fn mul(a: usize, b: usize, what: &'static str) -> Result<usize> {
    a.checked_mul(b).ok_or_else(|| OpsError::Param {
        op: OP,
        param: what,
        expected: "a size that fits in usize".into(),
        found: format!("{a} x {b}"),
    })
}

/// F32 scratch elements [`run_with_scratch`] needs: `tokens * hidden`.
pub fn scratch_len(p: &FeatureProjectionParams) -> Result<usize> {
    mul(p.tokens, p.hidden, "tokens*hidden")
}

fn validate(
    s: usize,
    w: usize,
    norm: usize,
    out: usize,
    p: &FeatureProjectionParams,
) -> Result<()> {
    check_param(OP, "n_ids", p.n_ids >= 1, p.n_ids, || ">= 1".into())?;
    check_param(OP, "hidden", p.hidden >= 1, p.hidden, || ">= 1".into())?;
    check_param(OP, "eps", p.eps.is_finite() && p.eps >= 0.0, p.eps, || {
        "finite and >= 0".into()
    })?;
    let (t, n, h) = (p.tokens, p.n_ids, p.hidden);
    let k = mul(n, h, "n_ids*hidden")?;
    check_len(OP, "s", s, mul(t, k, "tokens*n_ids*hidden")?, || {
        format!("[tokens={t}, n_ids*hidden={k}]")
    })?;
    check_len(
        OP,
        "w_feature",
        w,
        mul(h, k, "hidden*n_ids*hidden")?,
        || format!("[hidden={h}, n_ids*hidden={k}]"),
    )?;
    check_len(OP, "context_norm", norm, h, || format!("[hidden={h}]"))?;
    check_len(OP, "c", out, scratch_len(p)?, || {
        format!("[tokens={t}, hidden={h}]")
    })?;
    Ok(())
}

/// Project and normalize (see the module contract). On CUDA this allocates its F32 scratch.
pub fn run(
    be: &Backend,
    s: &Buffer<bf16>,
    w_feature: &Buffer<bf16>,
    context_norm: &Buffer<bf16>,
    c: &mut Buffer<bf16>,
    p: &FeatureProjectionParams,
) -> Result<()> {
    validate(s.len(), w_feature.len(), context_norm.len(), c.len(), p)?;
    let mut scratch = match be {
        Backend::Cpu => Buffer::from_vec(Vec::new()),
        #[cfg(feature = "cuda")]
        Backend::Cuda(_) => be.zeros::<f32>(scratch_len(p)?)?,
    };
    run_with_scratch(be, s, w_feature, context_norm, c, &mut scratch, p)
}

/// [`run`] with a caller-owned F32 scratch of at least [`scratch_len`] elements (allocates
/// nothing; overwritten on CUDA, untouched on the CPU, where any length is accepted).
pub fn run_with_scratch(
    be: &Backend,
    s: &Buffer<bf16>,
    w_feature: &Buffer<bf16>,
    context_norm: &Buffer<bf16>,
    c: &mut Buffer<bf16>,
    scratch: &mut Buffer<f32>,
    p: &FeatureProjectionParams,
) -> Result<()> {
    validate(s.len(), w_feature.len(), context_norm.len(), c.len(), p)?;
    match be {
        Backend::Cpu => {
            let _ = scratch;
            reference::run(
                s.host(OP, "s")?,
                w_feature.host(OP, "w_feature")?,
                context_norm.host(OP, "context_norm")?,
                c.host_mut(OP, "c")?,
                p.tokens,
                p.n_ids * p.hidden,
                p.hidden,
                p.eps,
            );
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(cu) => {
            let need = scratch_len(p)?;
            check_param(OP, "scratch", scratch.len() >= need, scratch.len(), || {
                format!("at least {need} elements (scratch_len)")
            })?;
            cuda::run(cu, s, w_feature, context_norm, c, scratch, p)
        }
    }
}

/// The comparison criterion of the module contract.
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn criterion(context_norm: &[bf16]) -> Criterion {
    Criterion::Close {
        abs: 1e-4 * max_abs_bf16(context_norm),
        rel: 0.0,
        bf16_ulps: 1,
    }
}

#[cfg(any(test, feature = "conformance"))]
fn case(
    tokens: usize,
    n_ids: usize,
    hidden: usize,
    seed: u64,
) -> impl Fn(&Backend) -> Result<CaseRun> + Send + Sync {
    move |be: &Backend| {
        let p = FeatureProjectionParams {
            tokens,
            n_ids,
            hidden,
            eps: 1e-6,
        };
        let k = n_ids * hidden;
        let mut g = SplitMix::new(seed);
        // Captured residuals grow with depth: block i of s is scaled by 2^i.
        let s: Vec<bf16> = (0..tokens * k)
            .map(|i| {
                bf16::from_f32(
                    (g.range(-1.0, 1.0) * f64::from(1u32 << ((i % k) / hidden % 16))) as f32,
                )
            })
            .collect();
        let ws = 1.0 / (k as f64).sqrt();
        let w = g.bf16_vec(hidden * k, -ws, ws);
        let norm = g.bf16_vec(hidden, 0.1, 3.0);
        let mut inputs = InputCheck::default();
        let sb = inputs.upload(be, "s", &s)?;
        let wb = inputs.upload(be, "w_feature", &w)?;
        let nb = inputs.upload(be, "context_norm", &norm)?;
        let mut c = be.filled(tokens * hidden, bf16::POISON)?;
        run(be, &sb, &wb, &nb, &mut c, &p)?;
        let mut modified = Vec::new();
        inputs.verify(be, "s", &sb, &mut modified)?;
        inputs.verify(be, "w_feature", &wb, &mut modified)?;
        inputs.verify(be, "context_norm", &nb, &mut modified)?;
        Ok(CaseRun {
            outputs: vec![output(
                "c",
                criterion(&norm),
                &vec![bf16::POISON; tokens * hidden],
                &be.download(&c)?,
                |_| true,
            )],
            modified_inputs: modified,
        })
    }
}

/// Conformance cases (official: 35B n_ids 8 H 2048; 27B n_ids 5 H 5120).
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn cases() -> Vec<Case> {
    vec![
        Case::new(OP, "small_t5_ids3_h64", case(5, 3, 64, 41)),
        Case::new(OP, "small_t1_ids1_h96", case(1, 1, 96, 42)),
        Case::new(OP, "official_35b_t4", case(4, 8, 2048, 43)).heavy(),
        Case::new(OP, "official_35b_t64", case(64, 8, 2048, 44)).heavy(),
        Case::new(OP, "official_27b_t4", case(4, 5, 5120, 45)).heavy(),
        Case::new(OP, "official_27b_t64", case(64, 5, 5120, 46)).heavy(),
    ]
}
