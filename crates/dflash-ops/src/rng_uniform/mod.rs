//! RNG uniform: evaluate the RNG identity for a batch of decisions (the device side of
//! [`crate::rng`], used to prove CPU and CUDA draw bit-identical uniforms).
//!
//! ```text
//! Semantics. For each i < n:
//!   seed_i = (seeds[2i] as u32) | (seeds[2i+1] as u32) << 32
//!   word_i = rng::word(seed_i, positions[i] as u64, purposes[i], subs[i])
//!   words[i] = word_i as i32 (bit pattern);  uniforms[i] = rng::unit_f32(word_i)
//! Shapes. seeds: [n, 2] i32 (lo, hi bit patterns); positions, purposes, subs: [n] i32;
//!   words: [n] i32; uniforms: [n] f32.
//! ```
//! Caller guarantees. positions >= 0; purposes are codes of [`crate::rng::Purpose`]
//!   (checked on the CPU; the device trusts them).
//! Writes. Exactly `words` and `uniforms`, every element.
//! Accumulation. None (integer rounds, one exact conversion).
//! Comparison. words: exact; uniforms: exact.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod reference;
#[cfg(test)]
mod tests;

#[cfg(any(test, feature = "conformance"))]
use crate::Element;
#[cfg(any(test, feature = "conformance"))]
use crate::registry::{Case, CaseRun, Criterion, InputCheck, output};
use crate::{Backend, Buffer, Result, check_len};

/// Registry id.
pub const OP: &str = "rng_uniform";

/// Evaluate the RNG identity for `n = positions.len()` decisions (see the module contract).
pub fn run(
    be: &Backend,
    seeds: &Buffer<i32>,
    positions: &Buffer<i32>,
    purposes: &Buffer<i32>,
    subs: &Buffer<i32>,
    words: &mut Buffer<i32>,
    uniforms: &mut Buffer<f32>,
) -> Result<()> {
    let n = positions.len();
    check_len(OP, "seeds", seeds.len(), 2 * n, || format!("[n={n}, 2]"))?;
    check_len(OP, "purposes", purposes.len(), n, || format!("[n={n}]"))?;
    check_len(OP, "subs", subs.len(), n, || format!("[n={n}]"))?;
    check_len(OP, "words", words.len(), n, || format!("[n={n}]"))?;
    check_len(OP, "uniforms", uniforms.len(), n, || format!("[n={n}]"))?;
    match be {
        Backend::Cpu => reference::run(
            seeds.host(OP, "seeds")?,
            positions.host(OP, "positions")?,
            purposes.host(OP, "purposes")?,
            subs.host(OP, "subs")?,
            words.host_mut(OP, "words")?,
            uniforms.host_mut(OP, "uniforms")?,
        ),
        #[cfg(feature = "cuda")]
        Backend::Cuda(c) => cuda::run(c, seeds, positions, purposes, subs, words, uniforms),
    }
}

#[cfg(any(test, feature = "conformance"))]
fn case(n: usize, seed_base: u64) -> impl Fn(&Backend) -> Result<CaseRun> + Send + Sync {
    move |be: &Backend| {
        let mut seeds = Vec::with_capacity(2 * n);
        let (mut pos, mut pur, mut sub) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..n as u64 {
            let s = seed_base
                .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                .wrapping_add(i * 0x1_0000_0001);
            seeds.push(s as u32 as i32);
            seeds.push((s >> 32) as u32 as i32);
            pos.push(((i * 7919) % 1_000_003) as i32);
            pur.push((i % 7) as i32);
            sub.push((i / 7 % 3) as i32);
        }
        let mut inputs = InputCheck::default();
        let s = inputs.upload(be, "seeds", &seeds)?;
        let p = inputs.upload(be, "positions", &pos)?;
        let u = inputs.upload(be, "purposes", &pur)?;
        let b = inputs.upload(be, "subs", &sub)?;
        let mut words = be.filled(n, i32::POISON)?;
        let mut uniforms = be.filled(n, f32::POISON)?;
        run(be, &s, &p, &u, &b, &mut words, &mut uniforms)?;
        let mut modified = Vec::new();
        inputs.verify(be, "seeds", &s, &mut modified)?;
        inputs.verify(be, "positions", &p, &mut modified)?;
        inputs.verify(be, "purposes", &u, &mut modified)?;
        inputs.verify(be, "subs", &b, &mut modified)?;
        Ok(CaseRun {
            outputs: vec![
                output(
                    "words",
                    Criterion::Exact,
                    &vec![i32::POISON; n],
                    &be.download(&words)?,
                    |_| true,
                ),
                output(
                    "uniforms",
                    Criterion::Exact,
                    &vec![f32::POISON; n],
                    &be.download(&uniforms)?,
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
        Case::new(OP, "n4096_seed1", case(4096, 1)),
        Case::new(
            OP,
            "n65536_seed_high_bits",
            case(65_536, 0xdead_beef_0000_0001),
        ),
    ]
}
