//! Head norm + RoPE: plain per-head RMSNorm over the full head dimension, then split-half
//! one-dimensional RoPE at absolute positions (the draft's Q/K path).
//!
//! Semantics. For row r, column c, head h, with position `p = start_pos[r] + c` and `x` the
//!   head's `D` raw values:
//!   `n[j]   = w[j] * x[j] / sqrt(mean_j' x[j']^2 + eps)`          (plain: `w * ...`)
//!   for j < D/2:  inv_freq_j = theta^(-2j/D),  a_j = p * inv_freq_j
//!   `out[j]       = n[j] cos a_j - n[j + D/2] sin a_j`
//!   `out[j + D/2] = n[j + D/2] cos a_j + n[j] sin a_j`
//! Shapes. x, out: `[rows, cols, heads, D]`; norm: `[D]`; start_pos: `[rows]`.
//! Dtypes. x: F32 (the raw projection output: raw Q/K have no BF16 cast before the norm);
//!   norm: BF16; start_pos: I32; out: BF16. Fused form: qkv F32, q_norm / k_norm BF16,
//!   angles F32, q / k / v BF16.
//! Rounding points. out only: once, BF16 RNE. Norm and rotation are unrounded math.
//! Angle precision (contract, positions reach 1e5 and beyond). `a_j` is formed in f64
//!   (`p as f64 * theta.powf(-2j/D)`) and reduced to `[0, 2*pi]` in f64 as
//!   `a - 2*pi*floor(a / 2*pi)`; only the reduced angle may be narrowed (CUDA: `sincosf` of
//!   the reduced angle as f32). An f32 angle product would be off by up to ~0.01 rad at
//!   p = 1e5 and is not allowed.
//! Accumulation. Implementation choice (CUDA: FP32 warp reduction); the oracle is f64 from
//!   the represented inputs with f64 sin/cos.
//! Tie-breaking. None. Masking/live extents. None: every column is computed (live-count
//!   masking is the caller's business).
//! Caller guarantees. start_pos >= 0 (checked on the CPU; CUDA clamps a negative one to 0).
//!   No aliasing between outputs and inputs (enforced by borrowing). Fused form: `angles`
//!   is [`rope_table`]'s output for the same rows, cols, D and theta (its length is checked,
//!   its values are the caller's).
//! Writes. [`run`]: every element of out; [`rope_table`]: every element of angles;
//!   [`run_qkv`]: every element of q, k and v. Nothing else.
//! Parameters. `D` even and >= 2; eps finite >= 0; theta finite > 0. Fused form: Hq and Hkv
//!   ([`QkvParams`]; [`rope_table`] reads only rows, cols, D and theta of them).
//! Fused Q/K/V form (the draft layer's projections as one GEMM against the row-concatenated
//!   `[q_proj; k_proj; v_proj]` weight). [`rope_table`] writes a block's angles once for every
//!   layer: `angles[(r * cols + c) * D/2 + j]` = the reduced angle of pair j at position
//!   `start_pos[r] + c` as above, narrowed to f32 (the narrowing the contract allows).
//!   [`run_qkv`] reads `qkv`: `[rows * cols, Hq + 2 Hkv, D]` F32 (token-major: token t, head h)
//!   and writes `q`: `[rows * cols, Hq, D]` (heads 0..Hq, `q_norm`, rotated), `k`:
//!   `[rows * cols, Hkv, D]` (the next Hkv heads, `k_norm`, rotated) and `v`:
//!   `[rows * cols, Hkv, D]` (the last Hkv heads, each value rounded once to BF16 and nothing
//!   else), all BF16. The rotation uses the table's f32 angles on both backends (the CPU
//!   widens them to f64), so its result equals [`run`]'s up to that narrowing, which the CUDA
//!   kernels of both forms share: on CUDA both forms run the same per-head device code on
//!   the same reduced angle, so their results are bit-identical.
//! Properties. RoPE preserves each pair's norm (so the head's norm) up to rounding;
//!   position 0 is the identity after the norm.
//! Comparison. `close(abs = 1e-4 * max|norm|, rel = 0, 1 bf16 ulp)`: normalized values are
//!   O(max|norm|) and a rotated value may cancel to near zero, so the error is absolute at
//!   that scale (FP32 norm and f32 sin/cos of a correctly reduced angle: a few 1e-7); the
//!   floor admits one rounding flip. The fused form's v: exact. The table: `close(abs 1e-6,
//!   rel 0)` (the device's f64 `pow` may differ from the host's in the last bit, which the f32
//!   narrowing almost always hides; 1e-6 rad is far below the error the norm criterion
//!   admits).

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
pub const OP: &str = "head_norm_rope";

/// Parameters of [`run`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HeadNormRopeParams {
    /// Requests in the batch.
    pub rows: usize,
    /// Columns per row (column `c` of row `r` is at position `start_pos[r] + c`).
    pub cols: usize,
    /// Heads per column.
    pub heads: usize,
    /// Head dimension D (even, >= 2).
    pub head_dim: usize,
    /// Norm epsilon (finite, >= 0).
    pub eps: f32,
    /// RoPE theta (finite, > 0).
    pub theta: f64,
}

/// The scalar parameters of either form: head_dim even >= 2, eps, theta.
fn check_scalars(p: &HeadNormRopeParams) -> Result<()> {
    check_param(
        OP,
        "head_dim",
        p.head_dim >= 2 && p.head_dim.is_multiple_of(2),
        p.head_dim,
        || "an even number >= 2 (split-half RoPE)".into(),
    )?;
    check_param(OP, "eps", p.eps.is_finite() && p.eps >= 0.0, p.eps, || {
        "finite and >= 0".into()
    })?;
    check_param(
        OP,
        "theta",
        p.theta.is_finite() && p.theta > 0.0,
        p.theta,
        || "finite and > 0".into(),
    )?;
    Ok(())
}

fn validate(x: usize, w: usize, sp: usize, out: usize, p: &HeadNormRopeParams) -> Result<()> {
    check_scalars(p)?;
    let n = [p.cols, p.heads, p.head_dim]
        .iter()
        .try_fold(p.rows, |a, &b| a.checked_mul(b))
        .ok_or_else(|| OpsError::Param {
            op: OP,
            param: "rows*cols*heads*head_dim",
            expected: "a size that fits in usize".into(),
            found: format!("{} x {} x {} x {}", p.rows, p.cols, p.heads, p.head_dim),
        })?;
    let shape = || {
        format!(
            "[rows={}, cols={}, heads={}, head_dim={}]",
            p.rows, p.cols, p.heads, p.head_dim
        )
    };
    check_len(OP, "x", x, n, shape)?;
    check_len(OP, "norm", w, p.head_dim, || {
        format!("[head_dim={}]", p.head_dim)
    })?;
    check_len(OP, "start_pos", sp, p.rows, || format!("[rows={}]", p.rows))?;
    check_len(OP, "out", out, n, shape)?;
    Ok(())
}

/// Normalize and rotate every head (see the module contract).
pub fn run(
    be: &Backend,
    x: &Buffer<f32>,
    norm: &Buffer<bf16>,
    start_pos: &Buffer<i32>,
    out: &mut Buffer<bf16>,
    p: &HeadNormRopeParams,
) -> Result<()> {
    validate(x.len(), norm.len(), start_pos.len(), out.len(), p)?;
    match be {
        Backend::Cpu => {
            let sp = start_pos.host(OP, "start_pos")?;
            check_positions(sp)?;
            reference::run(
                x.host(OP, "x")?,
                norm.host(OP, "norm")?,
                sp,
                out.host_mut(OP, "out")?,
                p.cols,
                p.heads,
                p.head_dim,
                p.theta,
                p.eps,
            );
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(c) => cuda::run(c, x, norm, start_pos, out, p),
    }
}

/// Parameters of the fused form ([`rope_table`], [`run_qkv`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QkvParams {
    /// Requests in the batch.
    pub rows: usize,
    /// Columns per row (column `c` of row `r` is at position `start_pos[r] + c`).
    pub cols: usize,
    /// Query heads Hq.
    pub q_heads: usize,
    /// Key/value heads Hkv.
    pub kv_heads: usize,
    /// Head dimension D (even, >= 2).
    pub head_dim: usize,
    /// Norm epsilon (finite, >= 0).
    pub eps: f32,
    /// RoPE theta (finite, > 0).
    pub theta: f64,
}

impl QkvParams {
    /// Checked sizes: (tokens, angle table length, q length, k/v length, qkv length).
    fn sizes(&self) -> Result<(usize, usize, usize, usize, usize)> {
        let one = HeadNormRopeParams {
            rows: self.rows,
            cols: self.cols,
            heads: 1,
            head_dim: self.head_dim,
            eps: self.eps,
            theta: self.theta,
        };
        check_scalars(&one)?;
        let overflow = || OpsError::Param {
            op: OP,
            param: "rows*cols*(q_heads+2*kv_heads)*head_dim",
            expected: "a size that fits in usize".into(),
            found: format!(
                "{} x {} x ({} + 2 x {}) x {}",
                self.rows, self.cols, self.q_heads, self.kv_heads, self.head_dim
            ),
        };
        let d = self.head_dim;
        let tokens = self.rows.checked_mul(self.cols).ok_or_else(overflow)?;
        let heads = self
            .kv_heads
            .checked_mul(2)
            .and_then(|x| x.checked_add(self.q_heads))
            .ok_or_else(overflow)?;
        let n = |h: usize| {
            tokens
                .checked_mul(h)
                .and_then(|x| x.checked_mul(d))
                .ok_or_else(overflow)
        };
        let table = tokens.checked_mul(d / 2).ok_or_else(overflow)?;
        Ok((
            tokens,
            table,
            n(self.q_heads)?,
            n(self.kv_heads)?,
            n(heads)?,
        ))
    }
}

/// Refuse a negative start position (CPU; CUDA clamps it to 0).
fn check_positions(sp: &[i32]) -> Result<()> {
    if let Some((i, &s)) = sp.iter().enumerate().find(|(_, s)| **s < 0) {
        return Err(OpsError::Value {
            op: OP,
            tensor: "start_pos",
            index: i,
            expected: "a position >= 0".into(),
            found: s.to_string(),
        });
    }
    Ok(())
}

/// The block's RoPE angles, once for every layer (see the module contract).
pub fn rope_table(
    be: &Backend,
    start_pos: &Buffer<i32>,
    angles: &mut Buffer<f32>,
    p: &QkvParams,
) -> Result<()> {
    let (_, table, ..) = p.sizes()?;
    check_len(OP, "start_pos", start_pos.len(), p.rows, || {
        format!("[rows={}]", p.rows)
    })?;
    check_len(OP, "angles", angles.len(), table, || {
        format!(
            "[rows={}, cols={}, head_dim/2={}]",
            p.rows,
            p.cols,
            p.head_dim / 2
        )
    })?;
    match be {
        Backend::Cpu => {
            let sp = start_pos.host(OP, "start_pos")?;
            check_positions(sp)?;
            reference::table(
                sp,
                angles.host_mut(OP, "angles")?,
                p.cols,
                p.head_dim,
                p.theta,
            );
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(c) => cuda::table(c, start_pos, angles, p),
    }
}

/// The outputs of [`run_qkv`].
pub struct QkvOut<'a> {
    /// `[tokens, Hq, D]` BF16.
    pub q: &'a mut Buffer<bf16>,
    /// `[tokens, Hkv, D]` BF16.
    pub k: &'a mut Buffer<bf16>,
    /// `[tokens, Hkv, D]` BF16.
    pub v: &'a mut Buffer<bf16>,
}

/// The fused form: Q and K heads of `qkv` normalized and rotated with `angles` (from
/// [`rope_table`]), V heads rounded (see the module contract).
pub fn run_qkv(
    be: &Backend,
    qkv: &Buffer<f32>,
    q_norm: &Buffer<bf16>,
    k_norm: &Buffer<bf16>,
    angles: &Buffer<f32>,
    out: QkvOut<'_>,
    p: &QkvParams,
) -> Result<()> {
    let (tokens, table, nq, nkv, n) = p.sizes()?;
    let d = p.head_dim;
    let shape = |h: usize| move || format!("[tokens={tokens}, heads={h}, head_dim={d}]");
    let heads = p.q_heads + 2 * p.kv_heads;
    check_len(OP, "qkv", qkv.len(), n, shape(heads))?;
    check_len(OP, "q_norm", q_norm.len(), d, || format!("[head_dim={d}]"))?;
    check_len(OP, "k_norm", k_norm.len(), d, || format!("[head_dim={d}]"))?;
    check_len(OP, "angles", angles.len(), table, || {
        format!("[tokens={tokens}, head_dim/2={}]", d / 2)
    })?;
    check_len(OP, "q", out.q.len(), nq, shape(p.q_heads))?;
    check_len(OP, "k", out.k.len(), nkv, shape(p.kv_heads))?;
    check_len(OP, "v", out.v.len(), nkv, shape(p.kv_heads))?;
    match be {
        Backend::Cpu => {
            reference::qkv(
                qkv.host(OP, "qkv")?,
                q_norm.host(OP, "q_norm")?,
                k_norm.host(OP, "k_norm")?,
                angles.host(OP, "angles")?,
                out.q.host_mut(OP, "q")?,
                out.k.host_mut(OP, "k")?,
                out.v.host_mut(OP, "v")?,
                p.q_heads,
                p.kv_heads,
                d,
                p.eps,
            );
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(c) => cuda::qkv(c, qkv, q_norm, k_norm, angles, out, p),
    }
}

/// The comparison criterion of the module contract.
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn criterion(norm: &[bf16]) -> Criterion {
    Criterion::Close {
        abs: 1e-4 * max_abs_bf16(norm),
        rel: 0.0,
        bf16_ulps: 1,
    }
}

/// `n` raw projection values in heads of `d`, each head at its own scale (10^(h % 5 - 2)):
/// raw projections are not normalized.
#[cfg(any(test, feature = "conformance"))]
fn raw_heads(g: &mut SplitMix, n: usize, d: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (g.range(-1.0, 1.0) * 10f64.powi(((i / d) % 5) as i32 - 2)) as f32)
        .collect()
}

#[cfg(any(test, feature = "conformance"))]
fn case(
    rows: usize,
    cols: usize,
    heads: usize,
    start_pos: Vec<i32>,
    seed: u64,
) -> impl Fn(&Backend) -> Result<CaseRun> + Send + Sync {
    move |be: &Backend| {
        let d = 128;
        let p = HeadNormRopeParams {
            rows,
            cols,
            heads,
            head_dim: d,
            eps: 1e-6,
            theta: 1e7,
        };
        let mut g = SplitMix::new(seed);
        let n = rows * cols * heads * d;
        let x = raw_heads(&mut g, n, d);
        let w = g.bf16_vec(d, -1.5, 1.5);
        let mut inputs = InputCheck::default();
        let xb = inputs.upload(be, "x", &x)?;
        let wb = inputs.upload(be, "norm", &w)?;
        let sb = inputs.upload(be, "start_pos", &start_pos)?;
        let mut out = be.filled(n, bf16::POISON)?;
        run(be, &xb, &wb, &sb, &mut out, &p)?;
        let mut modified = Vec::new();
        inputs.verify(be, "x", &xb, &mut modified)?;
        inputs.verify(be, "norm", &wb, &mut modified)?;
        inputs.verify(be, "start_pos", &sb, &mut modified)?;
        Ok(CaseRun {
            outputs: vec![output(
                "out",
                criterion(&w),
                &vec![bf16::POISON; n],
                &be.download(&out)?,
                |_| true,
            )],
            modified_inputs: modified,
        })
    }
}

/// A fused-form case: the angle table of `start_pos` and the Q/K/V form over it (official
/// head geometry D 128, theta 1e7), heads at different scales.
#[cfg(any(test, feature = "conformance"))]
fn qkv_case(
    rows: usize,
    cols: usize,
    q_heads: usize,
    kv_heads: usize,
    start_pos: Vec<i32>,
    seed: u64,
) -> impl Fn(&Backend) -> Result<CaseRun> + Send + Sync {
    move |be: &Backend| {
        let d = 128;
        let p = QkvParams {
            rows,
            cols,
            q_heads,
            kv_heads,
            head_dim: d,
            eps: 1e-6,
            theta: 1e7,
        };
        let (_, table, nq, nkv, n) = p.sizes()?;
        let mut g = SplitMix::new(seed);
        let x = raw_heads(&mut g, n, d);
        let (wq, wk) = (g.bf16_vec(d, -1.5, 1.5), g.bf16_vec(d, -1.5, 1.5));
        // The table is an input of the Q/K/V form here (the CPU's, uploaded to both backends),
        // so the two outputs are compared independently of each other.
        let cpu = Backend::cpu();
        let mut host_angles = cpu.filled(table, f32::NAN)?;
        rope_table(&cpu, &cpu.upload(&start_pos)?, &mut host_angles, &p)?;
        let host_angles = cpu.download(&host_angles)?;
        let mut inputs = InputCheck::default();
        let sb = inputs.upload(be, "start_pos", &start_pos)?;
        let xb = inputs.upload(be, "qkv", &x)?;
        let wqb = inputs.upload(be, "q_norm", &wq)?;
        let wkb = inputs.upload(be, "k_norm", &wk)?;
        let ab = inputs.upload(be, "angles_in", &host_angles)?;
        let mut angles = be.filled(table, f32::POISON)?;
        rope_table(be, &sb, &mut angles, &p)?;
        let (mut q, mut k, mut v) = (
            be.filled(nq, bf16::POISON)?,
            be.filled(nkv, bf16::POISON)?,
            be.filled(nkv, bf16::POISON)?,
        );
        let out = QkvOut {
            q: &mut q,
            k: &mut k,
            v: &mut v,
        };
        run_qkv(be, &xb, &wqb, &wkb, &ab, out, &p)?;
        let mut modified = Vec::new();
        for (name, b) in [("qkv", &xb), ("angles_in", &ab)] {
            inputs.verify(be, name, b, &mut modified)?;
        }
        for (name, b) in [("q_norm", &wqb), ("k_norm", &wkb)] {
            inputs.verify(be, name, b, &mut modified)?;
        }
        inputs.verify(be, "start_pos", &sb, &mut modified)?;
        let poison_bf = |len: usize| vec![bf16::POISON; len];
        Ok(CaseRun {
            outputs: vec![
                output(
                    "angles",
                    Criterion::Close {
                        abs: 1e-6,
                        rel: 0.0,
                        bf16_ulps: 0,
                    },
                    &vec![f32::POISON; table],
                    &be.download(&angles)?,
                    |_| true,
                ),
                output(
                    "q",
                    criterion(&wq),
                    &poison_bf(nq),
                    &be.download(&q)?,
                    |_| true,
                ),
                output(
                    "k",
                    criterion(&wk),
                    &poison_bf(nkv),
                    &be.download(&k)?,
                    |_| true,
                ),
                output(
                    "v",
                    Criterion::Exact,
                    &poison_bf(nkv),
                    &be.download(&v)?,
                    |_| true,
                ),
            ],
            modified_inputs: modified,
        })
    }
}

/// Conformance cases (official head geometry: D 128, 32 Q heads / 8 KV heads, theta 1e7).
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn cases() -> Vec<Case> {
    vec![
        Case::new(OP, "q_rows1_w8_h32_pos0", case(1, 8, 32, vec![0], 31)),
        Case::new(
            OP,
            "k_rows8_w16_h8_large_positions",
            case(
                8,
                16,
                8,
                vec![0, 1, 4095, 4096, 99_990, 131_072, 1_000_000, 2_000_000_000],
                32,
            ),
        ),
        Case::new(
            OP,
            "q_rows8_w16_h32_mixed_positions",
            case(
                8,
                16,
                32,
                vec![5, 2047, 2048, 65_535, 123_456, 7, 300_000, 42],
                33,
            ),
        ),
        Case::new(
            OP,
            "qkv_rows1_w16_hq32_hkv8_pos0",
            qkv_case(1, 16, 32, 8, vec![0], 34),
        ),
        Case::new(
            OP,
            "qkv_rows8_w16_hq32_hkv8_large_positions",
            qkv_case(
                8,
                16,
                32,
                8,
                vec![0, 1, 4095, 4096, 99_990, 131_072, 1_000_000, 2_000_000_000],
                35,
            ),
        ),
        Case::new(
            OP,
            "qkv_rows3_w5_hq4_hkv2_odd",
            qkv_case(3, 5, 4, 2, vec![7, 300_000, 42], 36),
        ),
    ]
}
