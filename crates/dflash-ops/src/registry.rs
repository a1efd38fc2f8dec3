//! The registry of op contracts and conformance cases (feature `conformance`).
//!
//! Every op contributes [`Case`]s: a named, deterministic input set at a concrete shape (at
//! least two per op, including the official geometries) and a closure that runs the op on a
//! given [`Backend`] and returns what it wrote. The conformance runner (`cargo xtask
//! conformance`) runs each case on the CPU reference and on CUDA and compares them with
//! [`compare`]; `cargo test` runs every light case on the CPU against itself, which checks the
//! footprint and input checks of the case.
//!
//! Comparison criteria are data ([`Criterion`]):
//! - [`Criterion::Exact`]: every element's bit pattern equal (token ids, counts, stored cache
//!   bits where the contract fixes them, RNG words).
//! - [`Criterion::Close`]: `|dev - ref| <= max(abs + rel * |ref|, bf16_ulps * ulp_bf16(ref))`
//!   elementwise, NaN never equal to anything. The BF16 floor admits a rounding-boundary flip
//!   of a BF16-stored value; `bf16_ulps = 0` disables it.
//!
//! Every case also proves the output was written and nothing else was: outputs are poisoned
//! ([`Element::POISON`]) before the run; an element the contract says is written must not
//! still hold the poison, an element it says is left alone must still hold its old bits. Every
//! input is downloaded again after the run and must be bit-identical to what was uploaded.

use crate::{Backend, Buffer, Element, Result};

/// How a device output is compared with the CPU reference.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Criterion {
    /// Bit-identical.
    Exact,
    /// Elementwise `|d - r| <= max(abs + rel*|r|, bf16_ulps * ulp_bf16(r))`.
    Close {
        /// Absolute tolerance.
        abs: f64,
        /// Relative tolerance.
        rel: f64,
        /// BF16 gross-error floor in units of the reference value's BF16 ulp (0 = none).
        bf16_ulps: u32,
    },
}

impl std::fmt::Display for Criterion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Criterion::Exact => f.write_str("exact"),
            Criterion::Close {
                abs,
                rel,
                bf16_ulps,
            } => {
                write!(f, "close(abs {abs:e}, rel {rel:e}, {bf16_ulps} bf16 ulp)")
            }
        }
    }
}

/// One output of a case run, as the host sees it.
#[derive(Clone, Debug)]
pub struct CaseOutput {
    /// Output name (as in the op's contract).
    pub name: String,
    /// How it is compared.
    pub criterion: Criterion,
    /// Values, widened to f64.
    pub values: Vec<f64>,
    /// Raw bit patterns (for exact comparison).
    pub bits: Vec<u32>,
    /// Elements the contract writes that still hold the poison.
    pub unwritten: usize,
    /// Elements the contract leaves alone that changed.
    pub clobbered: usize,
    /// True when the output may legitimately be constant (otherwise a constant reference
    /// output fails the case as degenerate).
    pub allow_constant: bool,
}

/// Everything a case run produced.
#[derive(Clone, Debug)]
pub struct CaseRun {
    /// The checked outputs.
    pub outputs: Vec<CaseOutput>,
    /// Inputs whose contents changed during the run (names); must be empty.
    pub modified_inputs: Vec<String>,
}

/// A runnable conformance case.
pub struct Case {
    /// The op's registry id (= module name = kernel file stem where the op has a kernel file).
    pub op: &'static str,
    /// The case name, unique within the op.
    pub name: String,
    /// True for cases too large for the CPU in CI (official-geometry heads); the
    /// conformance runner runs them, `cargo test` skips them.
    pub heavy: bool,
    /// Runs the case on a backend.
    #[allow(clippy::type_complexity)] // reason: one boxed closure type, named once here
    pub run: Box<dyn Fn(&Backend) -> Result<CaseRun> + Send + Sync>,
}

impl std::fmt::Debug for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Case")
            .field("op", &self.op)
            .field("name", &self.name)
            .finish()
    }
}

impl Case {
    /// A light case.
    pub fn new(
        op: &'static str,
        name: impl Into<String>,
        run: impl Fn(&Backend) -> Result<CaseRun> + Send + Sync + 'static,
    ) -> Self {
        Case {
            op,
            name: name.into(),
            heavy: false,
            run: Box::new(run),
        }
    }

    /// Mark the case heavy (skipped by `cargo test`, run by the conformance runner).
    pub fn heavy(mut self) -> Self {
        self.heavy = true;
        self
    }
}

/// Records the bits of a case's inputs before the run and checks them after it.
///
/// Each input is kept as a copy of its own elements (the official heads are over a billion
/// of them: no widening) and compared element by element, bit for bit; on the CPU the
/// buffer is compared in place, on CUDA after one download.
#[derive(Debug, Default)]
pub struct InputCheck {
    recorded: Vec<(String, Box<dyn std::any::Any>)>,
}

impl InputCheck {
    /// Upload `data` as the input `name` and remember its bits.
    pub fn upload<T: Element + 'static>(
        &mut self,
        be: &Backend,
        name: &str,
        data: &[T],
    ) -> Result<Buffer<T>> {
        let buf = be.upload(data)?;
        self.recorded
            .push((name.to_string(), Box::new(data.to_vec())));
        Ok(buf)
    }

    /// Compare `buf` with the bits recorded under `name`; push the name to `modified` if
    /// they differ (or if nothing of this element type was recorded under that name).
    pub fn verify<T: Element + 'static>(
        &self,
        be: &Backend,
        name: &str,
        buf: &Buffer<T>,
        modified: &mut Vec<String>,
    ) -> Result<()> {
        let same = |now: &[T]| {
            self.recorded
                .iter()
                .find(|(n, _)| n == name)
                .and_then(|(_, data)| data.downcast_ref::<Vec<T>>())
                .is_some_and(|was| {
                    was.len() == now.len() && was.iter().zip(now).all(|(a, b)| a.bits() == b.bits())
                })
        };
        let unchanged = match be {
            Backend::Cpu => same(buf.host("input check", "input")?),
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => same(&be.download(buf)?),
        };
        if !unchanged {
            modified.push(name.to_string());
        }
        Ok(())
    }
}

/// Build a [`CaseOutput`] from a downloaded output.
///
/// `before` is what the buffer held before the run (the poison, or prior state for in-place
/// ops); `written(i)` says whether the contract writes element `i`. A written element that
/// still has the poison bits counts as unwritten; an element not written whose bits differ
/// from `before` counts as clobbered.
pub fn output<T: Element>(
    name: &str,
    criterion: Criterion,
    before: &[T],
    after: &[T],
    written: impl Fn(usize) -> bool,
) -> CaseOutput {
    let mut unwritten = 0;
    let mut clobbered = 0;
    for (i, (b, a)) in before.iter().zip(after).enumerate() {
        if written(i) {
            if a.bits() == T::POISON.bits() {
                unwritten += 1;
            }
        } else if a.bits() != b.bits() {
            clobbered += 1;
        }
    }
    if before.len() != after.len() {
        clobbered += before.len().abs_diff(after.len());
    }
    CaseOutput {
        name: name.to_string(),
        criterion,
        values: after.iter().map(|x| x.to_f64()).collect(),
        bits: after.iter().map(|x| x.bits()).collect(),
        unwritten,
        clobbered,
        allow_constant: false,
    }
}

/// The result of comparing one output of one case.
#[derive(Clone, Debug)]
pub struct Comparison {
    /// Op id.
    pub op: &'static str,
    /// Case name.
    pub case: String,
    /// Output name.
    pub output: String,
    /// Criterion applied.
    pub criterion: Criterion,
    /// Largest absolute difference (0 for exact matches).
    pub max_abs: f64,
    /// Largest relative difference `|d - r| / |r|` over elements with `r != 0`.
    pub max_rel: f64,
    /// Elements outside the criterion.
    pub mismatches: usize,
    /// Number of elements compared.
    pub elements: usize,
    /// The device wrote exactly its footprint (no poison left, nothing else touched).
    pub footprint_ok: bool,
    /// Neither run modified an input.
    pub inputs_unchanged: bool,
    /// The reference output is not constant (or may be).
    pub nondegenerate: bool,
    /// Overall verdict.
    pub pass: bool,
}

/// One BF16 ulp at the magnitude of `r` (2^(e-7) for |r| in [2^e, 2^(e+1))).
pub fn ulp_bf16(r: f64) -> f64 {
    let a = r.abs();
    if a == 0.0 || !a.is_finite() {
        return 0.0;
    }
    let e = a.log2().floor();
    2f64.powf(e - 7.0)
}

/// Does `d` satisfy `criterion` against reference `r` (values and bits)?
pub fn element_ok(criterion: Criterion, r: f64, d: f64, rbits: u32, dbits: u32) -> bool {
    match criterion {
        Criterion::Exact => rbits == dbits,
        Criterion::Close {
            abs,
            rel,
            bf16_ulps,
        } => {
            if r.is_nan() || d.is_nan() {
                return false;
            }
            if r == d {
                return true;
            }
            let tol = (abs + rel * r.abs()).max(f64::from(bf16_ulps) * ulp_bf16(r));
            (d - r).abs() <= tol
        }
    }
}

/// Compare a device run with the reference run of the same case.
pub fn compare(case: &Case, reference: &CaseRun, device: &CaseRun) -> Vec<Comparison> {
    let inputs_unchanged =
        reference.modified_inputs.is_empty() && device.modified_inputs.is_empty();
    let mut rows = Vec::new();
    for r in &reference.outputs {
        let d = device.outputs.iter().find(|d| d.name == r.name);
        let (mut max_abs, mut max_rel, mut mismatches) = (0f64, 0f64, 0usize);
        let footprint_ok;
        match d {
            Some(d) if d.values.len() == r.values.len() => {
                for i in 0..r.values.len() {
                    let (rv, dv) = (r.values[i], d.values[i]);
                    if !element_ok(r.criterion, rv, dv, r.bits[i], d.bits[i]) {
                        mismatches += 1;
                    }
                    let diff = (dv - rv).abs();
                    if diff.is_finite() {
                        max_abs = max_abs.max(diff);
                        if rv != 0.0 {
                            max_rel = max_rel.max(diff / rv.abs());
                        }
                    } else if r.bits[i] != d.bits[i] {
                        max_abs = f64::INFINITY;
                    }
                }
                footprint_ok =
                    d.unwritten == 0 && d.clobbered == 0 && r.unwritten == 0 && r.clobbered == 0;
            }
            _ => {
                mismatches = r.values.len().max(1);
                footprint_ok = false;
            }
        }
        let nondegenerate = r.allow_constant
            || r.values
                .windows(2)
                .any(|w| w[0].to_bits() != w[1].to_bits());
        let pass = mismatches == 0 && footprint_ok && inputs_unchanged && nondegenerate;
        rows.push(Comparison {
            op: case.op,
            case: case.name.clone(),
            output: r.name.clone(),
            criterion: r.criterion,
            max_abs,
            max_rel,
            mismatches,
            elements: r.values.len(),
            footprint_ok,
            inputs_unchanged,
            nondegenerate,
            pass,
        });
    }
    if reference.outputs.is_empty() {
        rows.push(Comparison {
            op: case.op,
            case: case.name.clone(),
            output: "<none>".into(),
            criterion: Criterion::Exact,
            max_abs: 0.0,
            max_rel: 0.0,
            mismatches: 1,
            elements: 0,
            footprint_ok: false,
            inputs_unchanged,
            nondegenerate: false,
            pass: false,
        });
    }
    rows
}

/// Every conformance case of every op, in registry order.
pub fn cases() -> Vec<Case> {
    let mut all = Vec::new();
    for collect in crate::OP_CASES {
        all.extend(collect());
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_check_finds_any_changed_bit_and_nothing_else() -> Result<()> {
        use half::bf16;
        let be = Backend::cpu();
        let data = [
            bf16::from_f32(0.0),
            bf16::from_f32(1.5),
            bf16::from_bits(0x7fc1),
        ];
        let mut check = InputCheck::default();
        let mut kept = check.upload(&be, "x", &data)?;
        let mut other = check.upload(&be, "ids", &[3i32, 4])?;
        let mut modified = Vec::new();
        check.verify(&be, "x", &kept, &mut modified)?;
        check.verify(&be, "ids", &other, &mut modified)?;
        assert!(modified.is_empty(), "unchanged inputs: {modified:?}");
        // -0.0 equals 0.0 and another NaN payload is still NaN, but neither has the same bits.
        for (i, changed) in [(0, bf16::from_f32(-0.0)), (2, bf16::from_bits(0x7fc2))] {
            let mut buf = check.upload(&be, "y", &data)?;
            buf.host_mut("test", "y")?[i] = changed;
            let mut modified = Vec::new();
            check.verify(&be, "y", &buf, &mut modified)?;
            assert_eq!(modified, ["y"], "element {i}");
            check.recorded.pop();
        }
        other.host_mut("test", "ids")?[1] = 5;
        kept.host_mut("test", "x")?[1] = bf16::from_f32(1.5);
        let mut modified = Vec::new();
        check.verify(&be, "ids", &other, &mut modified)?;
        check.verify(&be, "x", &kept, &mut modified)?;
        // Not recorded under that name, or recorded with another element type.
        check.verify(&be, "z", &kept, &mut modified)?;
        let as_f32 = be.upload(&[0f32, 0.0])?;
        check.verify(&be, "ids", &as_f32, &mut modified)?;
        assert_eq!(modified, ["ids", "z", "ids"]);
        Ok(())
    }

    #[test]
    fn close_criterion_uses_bf16_floor() {
        let c = Criterion::Close {
            abs: 0.0,
            rel: 0.0,
            bf16_ulps: 1,
        };
        assert!(element_ok(c, 1.0, 1.0 + 1.0 / 128.0, 0, 0));
        assert!(!element_ok(c, 1.0, 1.0 + 1.0 / 64.0, 0, 0));
        assert!(
            !element_ok(c, f64::NAN, f64::NAN, 1, 1),
            "NaN never matches under Close"
        );
        assert!(element_ok(Criterion::Exact, f64::NAN, f64::NAN, 7, 7));
        assert!(!element_ok(Criterion::Exact, 0.0, -0.0, 0, 0x8000_0000));
    }

    #[test]
    fn footprint_counts_unwritten_and_clobbered() {
        let before = [f32::POISON, f32::POISON, 5.0, 6.0];
        let after = [1.0, f32::POISON, 5.0, 7.0];
        let o = output("y", Criterion::Exact, &before, &after, |i| i < 2);
        assert_eq!((o.unwritten, o.clobbered), (1, 1));
    }

    #[test]
    fn every_op_has_at_least_two_cases_and_unique_names() {
        let all = cases();
        let mut ops: Vec<&str> = all.iter().map(|c| c.op).collect();
        ops.dedup();
        for op in crate::OPS {
            let n = all.iter().filter(|c| c.op == *op).count();
            assert!(
                n >= 2,
                "op `{op}` has {n} conformance cases, needs at least 2"
            );
        }
        let mut names: Vec<(&str, &str)> = all.iter().map(|c| (c.op, c.name.as_str())).collect();
        names.sort_unstable();
        let before = names.len();
        names.dedup();
        assert_eq!(before, names.len(), "duplicate case names");
        for c in &all {
            assert!(
                crate::OPS.contains(&c.op),
                "case {} names unknown op {}",
                c.name,
                c.op
            );
        }
    }

    #[test]
    fn every_registered_light_case_passes_on_the_cpu_against_itself() {
        let be = Backend::cpu();
        let all = cases();
        for case in all.iter().filter(|c| !c.heavy) {
            let a = (case.run)(&be).unwrap_or_else(|e| panic!("{}/{}: {e}", case.op, case.name));
            let b = (case.run)(&be).unwrap_or_else(|e| panic!("{}/{}: {e}", case.op, case.name));
            for row in compare(case, &a, &b) {
                assert!(row.pass, "{row:?}");
            }
        }
    }
}
