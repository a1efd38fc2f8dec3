//! SwiGLU: `out = bf16_rne(silu(gate) * up)` elementwise (the draft MLP's
//! `SiLU(W_gate m) * (W_up m)`, between the gate/up and down projections).
//!
//! Semantics. For each row r < rows and column c < inter:
//!   `out[r, c] = bf16_rne(silu(g) * u)` with `g = gate[r, c]`, `u = up[r, c]` and
//!   `silu(g) = g / (1 + exp(-g))`, evaluated without intermediate rounding from the
//!   represented BF16 inputs.
//! Layouts. Separate ([`run`]): `gate`, `up`: `[rows, inter]` bf16. Fused
//!   ([`run_fused`]): `gate_up`: `[rows, 2 * inter]` bf16, row r holding `gate[r, :]` in
//!   columns `0..inter` and `up[r, :]` in columns `inter..2 * inter` (what one GEMM against
//!   the row-concatenated `[gate_proj; up_proj]` weight `[2 * inter, H]` produces).
//!   out: `[rows, inter]` bf16 in both.
//! Dtypes. BF16 in, BF16 out.
//! Rounding points. One: the stored output. silu and the product are unrounded.
//! Accumulation. None. The device evaluates silu and the product in f32 (`expf`, IEEE
//!   division); the oracle is f64 from the represented inputs.
//! Tie-breaking. RNE at the rounding point. Non-finite inputs propagate by IEEE rules
//!   (silu(+inf) = +inf, silu(-inf) = NaN as in the formula); they are not refused.
//! Caller guarantees. Nothing beyond the lengths (all checked). `out` never aliases an
//!   input (enforced by borrowing).
//! Writes. Every element of `out`; nothing else.
//! Comparison. out: close(abs 1e-12, rel 0, 1 bf16 ulp): the f32 device evaluation may land
//!   on the other side of a BF16 rounding boundary than the f64 oracle, never further.

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
use crate::{Backend, Buffer, Result, bf16, check_len, check_param};

/// Registry id.
pub const OP: &str = "swiglu";

/// The comparison criterion of `out`.
#[cfg(any(test, feature = "conformance"))]
pub const CRITERION: Criterion = Criterion::Close {
    abs: 1e-12,
    rel: 0.0,
    bf16_ulps: 1,
};

/// Shape of a SwiGLU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SwigluParams {
    /// Number of token rows (e.g. `rows * cols` of the draft block).
    pub rows: usize,
    /// Intermediate width I (17408 for the official 27B, 6144 for the 35B-A3B draft).
    pub inter: usize,
}

fn total(p: &SwigluParams, factor: usize) -> Result<usize> {
    p.rows
        .checked_mul(p.inter)
        .and_then(|n| n.checked_mul(factor))
        .ok_or_else(|| crate::OpsError::Param {
            op: OP,
            param: "rows * inter",
            expected: "a product that fits in usize".into(),
            found: format!("{} * {}", p.rows, p.inter),
        })
}

/// `out = bf16_rne(silu(gate) * up)` with separate `gate` and `up` (see the module contract).
pub fn run(
    be: &Backend,
    gate: &Buffer<bf16>,
    up: &Buffer<bf16>,
    out: &mut Buffer<bf16>,
    p: &SwigluParams,
) -> Result<()> {
    let n = total(p, 1)?;
    let shape = || format!("[rows={}, inter={}]", p.rows, p.inter);
    check_len(OP, "gate", gate.len(), n, shape)?;
    check_len(OP, "up", up.len(), n, shape)?;
    check_len(OP, "out", out.len(), n, shape)?;
    match be {
        Backend::Cpu => {
            let (g, u) = (gate.host(OP, "gate")?, up.host(OP, "up")?);
            reference::run(g, 0, u, 0, p.inter, p.inter, out.host_mut(OP, "out")?);
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(c) => cuda::run(c, gate, up, 0, p.inter, out, p),
    }
}

/// `out = bf16_rne(silu(gate) * up)` from the fused `[rows, 2 * inter]` layout (see the
/// module contract).
pub fn run_fused(
    be: &Backend,
    gate_up: &Buffer<bf16>,
    out: &mut Buffer<bf16>,
    p: &SwigluParams,
) -> Result<()> {
    let n = total(p, 2)?;
    check_len(OP, "gate_up", gate_up.len(), n, || {
        format!("[rows={}, 2 * inter={}]", p.rows, 2 * p.inter)
    })?;
    check_len(OP, "out", out.len(), n / 2, || {
        format!("[rows={}, inter={}]", p.rows, p.inter)
    })?;
    check_param(OP, "inter", p.inter <= usize::MAX / 2, p.inter, || {
        "inter * 2 fits in usize".into()
    })?;
    match be {
        Backend::Cpu => {
            let gu = gate_up.host(OP, "gate_up")?;
            reference::run(
                gu,
                0,
                gu,
                p.inter,
                2 * p.inter,
                p.inter,
                out.host_mut(OP, "out")?,
            );
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(c) => cuda::run(c, gate_up, gate_up, p.inter, 2 * p.inter, out, p),
    }
}

#[cfg(any(test, feature = "conformance"))]
fn case(
    rows: usize,
    inter: usize,
    fused: bool,
    seed: u64,
) -> impl Fn(&Backend) -> Result<CaseRun> + Send + Sync {
    move |be: &Backend| {
        let n = rows * inter;
        let p = SwigluParams { rows, inter };
        let mut inputs = InputCheck::default();
        let mut modified = Vec::new();
        let mut out = be.filled(n, bf16::POISON)?;
        // Gate values cover the saturated tails of silu as well as the bend near 0.
        let gate: Vec<bf16> = bf16_values(seed, n, 6.0)
            .into_iter()
            .enumerate()
            .map(|(i, v)| {
                if i % 97 == 0 {
                    bf16::from_f32(v.to_f32() * 16.0)
                } else {
                    v
                }
            })
            .collect();
        let upv = bf16_values(seed ^ 0x5151, n, 3.0);
        if fused {
            let mut gu = Vec::with_capacity(2 * n);
            for r in 0..rows {
                gu.extend_from_slice(&gate[r * inter..(r + 1) * inter]);
                gu.extend_from_slice(&upv[r * inter..(r + 1) * inter]);
            }
            let b = inputs.upload(be, "gate_up", &gu)?;
            run_fused(be, &b, &mut out, &p)?;
            inputs.verify(be, "gate_up", &b, &mut modified)?;
        } else {
            let g = inputs.upload(be, "gate", &gate)?;
            let u = inputs.upload(be, "up", &upv)?;
            run(be, &g, &u, &mut out, &p)?;
            inputs.verify(be, "gate", &g, &mut modified)?;
            inputs.verify(be, "up", &u, &mut modified)?;
        }
        Ok(CaseRun {
            outputs: vec![output(
                "out",
                CRITERION,
                &vec![bf16::POISON; n],
                &be.download(&out)?,
                |_| true,
            )],
            modified_inputs: modified,
        })
    }
}

/// Conformance cases: the official MLP widths (27B DFlash2 I = 17408 with 8 x 16 rows,
/// 35B-A3B DFlash I = 6144), one K = 1 request, the fused layout and an odd width.
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn cases() -> Vec<Case> {
    vec![
        Case::new(OP, "dflash2_27b_rows128_i17408", case(128, 17408, false, 1)),
        Case::new(OP, "dflash_35b_rows16_i6144", case(16, 6144, false, 2)),
        Case::new(OP, "rows2_i6144", case(2, 6144, false, 3)),
        Case::new(OP, "fused_rows16_i17408", case(16, 17408, true, 4)),
        Case::new(OP, "fused_rows3_i37", case(3, 37, true, 5)),
        // 16-byte groups over two channel blocks of the launch grid; an odd width's tail.
        Case::new(OP, "fused_rows4_i2056", case(4, 2056, true, 6)),
        Case::new(OP, "rows5_i2049", case(5, 2049, false, 7)),
    ]
}
