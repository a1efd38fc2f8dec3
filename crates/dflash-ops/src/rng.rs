//! The RNG identity: every random decision of a round is one Philox4x32-10 block.
//!
//! Contract.
//! - Generator: Philox4x32-10 (Salmon et al. 2011, the Random123 rounds and constants), the
//!   block function of `rand_philox`; the CUDA kernels include `kernels/philox.cuh`, the same
//!   rounds, and must return bit-identical words.
//! - Key: the request seed `s` (u64): `key = [s as u32, (s >> 32) as u32]`.
//! - Counter: `[p as u32, (p >> 32) as u32, purpose, sub]` where `p` is the absolute token
//!   position (u64) the decision belongs to, `purpose` a [`Purpose`] code and `sub` a
//!   sub-index within that decision (0 unless a decision needs several draws).
//! - Output: word 0 of the block. The uniform is `(word >> 8) * 2^-24`, an f32 in [0, 1) with
//!   24 random bits; every value is exactly representable, so the conversion is exact on
//!   every device.
//! - Identity: nothing else enters a draw. In particular the compact batch row, the number of
//!   rows, the round number and the thread that draws never do: a request's decisions are
//!   a function of (seed, position, purpose, sub) alone.
//!
//! Positions per decision (the documented draw points):
//! | decision | purpose | position | sub |
//! |---|---|---|---|
//! | DFlash2 selector draw choosing the proposal for position F+1+i | [`Purpose::Dflash2Proposal`] | F+i | 0 |
//! | acceptance test of proposal d_(i+1) (position F+1+i) | [`Purpose::Accept`] | F+1+i | 0 |
//! | correction draw at the first rejected position F+1+i | [`Purpose::Correction`] | F+1+i | 0 |
//! | bonus draw after P accepted proposals (position F+P+1) | [`Purpose::Bonus`] | F+P+1 | 0 |
//! | tree child draw number j below a node of depth i | [`Purpose::TreeChild`] | F+1+i | j |
//! | tree acceptance test of child number j below a node of depth i | [`Purpose::Accept`] | F+1+i | j |
//! | plain sampling of one token at position t (no speculation) | [`Purpose::Decode`] | t | 0 |

use rand_philox::philox4x32_10;

/// What a random draw decides; the code enters the Philox counter (word 2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum Purpose {
    /// Sampling a token while prefilling (reserved; no op draws it today).
    Prefill = 0,
    /// Sampling one token by plain (non-speculative) decoding.
    Decode = 1,
    /// The min(1, p/q) acceptance test of a proposal.
    Accept = 2,
    /// The residual correction draw after a rejection.
    Correction = 3,
    /// The bonus draw after every proposal was accepted.
    Bonus = 4,
    /// The DFlash2 conditional selector's proposal draw.
    Dflash2Proposal = 5,
    /// A tree-verification child draw (sub-index = draw order).
    TreeChild = 6,
}

/// The Philox key of a request seed.
#[inline]
pub fn key(seed: u64) -> [u32; 2] {
    [seed as u32, (seed >> 32) as u32]
}

/// The Philox counter of a decision.
#[inline]
pub fn counter(position: u64, purpose: Purpose, sub: u32) -> [u32; 4] {
    [
        position as u32,
        (position >> 32) as u32,
        purpose as u32,
        sub,
    ]
}

/// The raw 32-bit word of a decision (word 0 of the Philox block).
#[inline]
pub fn word(seed: u64, position: u64, purpose: Purpose, sub: u32) -> u32 {
    philox4x32_10(counter(position, purpose, sub), key(seed))[0]
}

/// A word to a uniform f32 in [0, 1): `(word >> 8) * 2^-24` (24 bits, exact).
#[inline]
pub fn unit_f32(word: u32) -> f32 {
    (word >> 8) as f32 * (1.0 / 16_777_216.0)
}

/// The uniform of a decision, in [0, 1).
#[inline]
pub fn uniform(seed: u64, position: u64, purpose: Purpose, sub: u32) -> f32 {
    unit_f32(word(seed, position, purpose, sub))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random123 `kat_vectors` for philox4x32_10 (ctr, key, expected).
    #[test]
    fn random123_known_answers() {
        let cases: [([u32; 4], [u32; 2], [u32; 4]); 3] = [
            (
                [0, 0, 0, 0],
                [0, 0],
                [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8],
            ),
            (
                [0xffffffff; 4],
                [0xffffffff; 2],
                [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd],
            ),
            (
                [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
                [0xa4093822, 0x299f31d0],
                [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1],
            ),
        ];
        for (ctr, k, want) in cases {
            assert_eq!(philox4x32_10(ctr, k), want, "ctr {ctr:08x?} key {k:08x?}");
        }
    }

    #[test]
    fn identity_maps_seed_position_purpose_sub_into_key_and_counter() {
        let seed = 0x0123_4567_89ab_cdef_u64;
        assert_eq!(key(seed), [0x89ab_cdef, 0x0123_4567]);
        assert_eq!(counter(0x1_0000_0002, Purpose::Bonus, 7), [2, 1, 4, 7]);
        let w = word(seed, 0x1_0000_0002, Purpose::Bonus, 7);
        assert_eq!(
            w,
            philox4x32_10([2, 1, 4, 7], [0x89ab_cdef, 0x0123_4567])[0]
        );
    }

    #[test]
    fn uniform_has_24_bits_in_unit_interval() {
        assert_eq!(unit_f32(0), 0.0);
        assert_eq!(unit_f32(0xff), 0.0, "low 8 bits are dropped");
        assert_eq!(unit_f32(0x100), 1.0 / 16_777_216.0);
        assert_eq!(unit_f32(u32::MAX), 1.0 - 1.0 / 16_777_216.0);
        assert!(unit_f32(u32::MAX) < 1.0);
        assert_eq!(unit_f32(0x8000_0000), 0.5);
    }

    #[test]
    fn every_input_of_the_identity_changes_the_draw() {
        let base = word(7, 100, Purpose::Accept, 0);
        assert_ne!(base, word(8, 100, Purpose::Accept, 0), "seed");
        assert_ne!(base, word(7, 101, Purpose::Accept, 0), "position");
        assert_ne!(base, word(7, 100, Purpose::Correction, 0), "purpose");
        assert_ne!(base, word(7, 100, Purpose::Accept, 1), "sub");
        assert_ne!(
            base,
            word(7, 100 + (1 << 32), Purpose::Accept, 0),
            "high position word"
        );
        assert_ne!(
            base,
            word(7 + (1 << 32), 100, Purpose::Accept, 0),
            "high seed word"
        );
    }

    /// Uniformity smoke check: 65536 draws, mean within 5 sigma of 1/2
    /// (sigma = sqrt(1/12/65536) ~ 0.00113; false-failure probability < 1e-6).
    #[test]
    fn uniforms_are_balanced() {
        let n = 65_536u64;
        let mean: f64 = (0..n)
            .map(|p| f64::from(uniform(42, p, Purpose::Accept, 0)))
            .sum::<f64>()
            / n as f64;
        assert!(
            (mean - 0.5).abs() < 5.0 * (1.0f64 / 12.0 / n as f64).sqrt(),
            "mean {mean}"
        );
    }
}
