//! CPU reference of `rng_uniform`: the RNG identity of `crate::rng`, one decision at a time.

use crate::rng::{Purpose, unit_f32};
use crate::{OpsError, Result};

use super::OP;

fn purpose(code: i32, index: usize) -> Result<Purpose> {
    Ok(match code {
        0 => Purpose::Prefill,
        1 => Purpose::Decode,
        2 => Purpose::Accept,
        3 => Purpose::Correction,
        4 => Purpose::Bonus,
        5 => Purpose::Dflash2Proposal,
        6 => Purpose::TreeChild,
        _ => {
            return Err(OpsError::Value {
                op: OP,
                tensor: "purposes",
                index,
                expected: "a Purpose code in 0..=6".into(),
                found: code.to_string(),
            });
        }
    })
}

pub(super) fn run(
    seeds: &[i32],
    positions: &[i32],
    purposes: &[i32],
    subs: &[i32],
    words: &mut [i32],
    uniforms: &mut [f32],
) -> Result<()> {
    // Validate everything before writing anything.
    let mut decoded = Vec::with_capacity(positions.len());
    for (i, &p) in positions.iter().enumerate() {
        if p < 0 {
            return Err(OpsError::Value {
                op: OP,
                tensor: "positions",
                index: i,
                expected: "a position >= 0".into(),
                found: p.to_string(),
            });
        }
        decoded.push(purpose(purposes[i], i)?);
    }
    for i in 0..positions.len() {
        let seed = u64::from(seeds[2 * i] as u32) | u64::from(seeds[2 * i + 1] as u32) << 32;
        let w = crate::rng::word(seed, positions[i] as u64, decoded[i], subs[i] as u32);
        words[i] = w as i32;
        uniforms[i] = unit_f32(w);
    }
    Ok(())
}
