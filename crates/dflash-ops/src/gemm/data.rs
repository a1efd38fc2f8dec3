//! Deterministic case data shared by the conformance cases and tests of the dense ops
//! (`gemm`, `rms_norm`, `head_norm_rope`, `feature_projection`, `context_kv_materialize`).
//!
//! SplitMix64 (Steele, Lea, Flood 2014): a fixed seed always gives the same values on every
//! machine, so a case's inputs are a pure function of its name and seed.

use half::bf16;

/// A SplitMix64 stream.
#[derive(Clone, Debug)]
pub(crate) struct SplitMix(u64);

impl SplitMix {
    /// A stream from `seed`.
    pub(crate) fn new(seed: u64) -> Self {
        SplitMix(seed)
    }

    /// The next 64-bit word.
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform f64 in [0, 1) with 53 bits.
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / 9_007_199_254_740_992.0)
    }

    /// A uniform f64 in [lo, hi).
    pub(crate) fn range(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }

    #[cfg(test)]
    /// A uniform integer in `0..n` (`n >= 1`; the modulo bias is irrelevant for test data).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// `n` BF16 values uniform in [lo, hi) (rounded from f32, RNE).
    pub(crate) fn bf16_vec(&mut self, n: usize, lo: f64, hi: f64) -> Vec<bf16> {
        (0..n)
            .map(|_| bf16::from_f32(self.range(lo, hi) as f32))
            .collect()
    }
}

/// Largest absolute value of a slice of BF16 values (0 for an empty slice).
pub(crate) fn max_abs_bf16(v: &[bf16]) -> f64 {
    v.iter()
        .map(|x| f64::from(x.to_f32()).abs())
        .fold(0.0, f64::max)
}
