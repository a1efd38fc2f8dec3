//! Plain (non-speculative) sampling of one token from one column of target logits.
//!
//! Used for the first output token of a request (the anchor, sampled from the prompt's last
//! logits at admission) and by [`crate::plain_decode`], the baseline every speculative run is
//! checked against.
//!
//! Contract. For logits predicting position `t` and the request's history `x_0 .. x_(t-1)`:
//! 1. `p` = the `target_distribution` op of `dflash-ops` over one live column (public
//!    vocabulary mask, penalties from the history counts, temperature, top-k, top-p, min-p;
//!    temperature `<= 0` gives the exact one-hot argmax, ties to the lowest id) — the same
//!    processing verification applies to every verify column;
//! 2. `u = rng::uniform(seed, t, Purpose::Decode, 0)`;
//! 3. inverse CDF on the host in increasing id order: `total = sum_v f64(p(v))` (sequential
//!    f64 additions), the token is the first `v` whose running f64 sum exceeds `f64(u) * total`,
//!    else the last `v` with `p(v) > 0`. A token of probability 0 is never chosen; at
//!    temperature 0 the token is the argmax whatever `u` is.

use dflash_ops::rng::{self, Purpose};
use dflash_ops::target_distribution::{self, SamplingBuffers};
use dflash_ops::{Backend, Buffer};
use dflash_verify::{SamplingSettings, TokenHistory, VerifyError};

use crate::error::{EngineError, Result};

/// Reusable buffers for one-column sampling on a backend.
#[derive(Debug)]
pub struct Sampler {
    vocab_rows: usize,
    public_vocab: usize,
    live: Buffer<i32>,
    counts: Buffer<i32>,
    proposals: Buffer<i32>,
    p: Buffer<f32>,
    settings: SamplingBuffers,
    host_counts: Vec<i32>,
}

impl Sampler {
    /// Buffers for a vocabulary of `vocab_rows` rows (`public_vocab` of them public) on `be`.
    pub fn new(be: &Backend, vocab_rows: usize, public_vocab: usize) -> Result<Self> {
        Ok(Sampler {
            vocab_rows,
            public_vocab,
            live: be.filled(1, 1)?,
            counts: be.zeros(vocab_rows)?,
            proposals: be.zeros(0)?,
            p: be.zeros(vocab_rows)?,
            settings: SamplingBuffers::upload(be, &[SamplingSettings::GREEDY])?,
            host_counts: vec![0; vocab_rows],
        })
    }

    /// Device bytes these buffers take.
    pub fn bytes(vocab_rows: usize) -> u64 {
        // counts (i32) + p (f32) + the live count and seven settings.
        (vocab_rows as u64) * 8 + 4 * 8
    }

    /// Sample the token at position `position` from `logits` (`[vocab_rows]` f32 on `be`, the
    /// target output predicting that position) given the tokens before it (`history`); see the
    /// module contract.
    pub fn sample(
        &mut self,
        be: &Backend,
        logits: dflash_verify::Logits<'_>,
        history: &TokenHistory,
        settings: &SamplingSettings,
        seed: u64,
        position: u64,
    ) -> Result<u32> {
        if history.vocab_rows() != self.vocab_rows {
            return Err(VerifyError::HistoryVocab {
                row: 0,
                expected: self.vocab_rows,
                found: history.vocab_rows(),
            }
            .into());
        }
        self.host_counts.fill(0);
        for (t, c) in history.iter() {
            // Counts are bounded by i32::MAX (TokenHistory::MAX_COUNT).
            self.host_counts[t as usize] = i32::try_from(c).unwrap_or(i32::MAX);
        }
        be.write(&mut self.counts, 0, &self.host_counts)?;
        let st = &mut self.settings;
        be.write(&mut st.temperature, 0, &[settings.temperature])?;
        be.write(&mut st.top_k, 0, &[settings.top_k])?;
        be.write(&mut st.top_p, 0, &[settings.top_p])?;
        be.write(&mut st.min_p, 0, &[settings.min_p])?;
        be.write(
            &mut st.repetition_penalty,
            0,
            &[settings.repetition_penalty],
        )?;
        be.write(&mut st.frequency_penalty, 0, &[settings.frequency_penalty])?;
        be.write(&mut st.presence_penalty, 0, &[settings.presence_penalty])?;
        // One column: column 0 of the logits, padded or packed alike.
        target_distribution::run_with(
            be,
            logits,
            target_distribution::Columns::Padded,
            &self.live,
            &self.counts,
            target_distribution::History::Chain(&self.proposals),
            &self.settings.view(),
            target_distribution::Outputs::Full(&mut self.p),
            &target_distribution::Params {
                rows: 1,
                cols: 1,
                vocab: self.vocab_rows,
                public_vocab: self.public_vocab,
            },
        )?;
        let p = be.download(&self.p)?;
        let u = rng::uniform(seed, position, Purpose::Decode, 0);
        inverse_cdf(&p, u).ok_or(EngineError::EmptyDistribution { position })
    }
}

/// The inverse-CDF draw of the module contract; `None` when `p` has no positive entry.
pub fn inverse_cdf(p: &[f32], u: f32) -> Option<u32> {
    let total: f64 = p.iter().map(|&x| f64::from(x.max(0.0))).sum();
    let target = f64::from(u) * total;
    let mut acc = 0.0f64;
    let mut last = None;
    for (v, &x) in p.iter().enumerate() {
        if x > 0.0 {
            acc += f64::from(x);
            last = Some(v as u32);
            if acc > target {
                return last;
            }
        }
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inverse_cdf_picks_by_mass_and_skips_zeros() {
        let p = [0.0, 0.25, 0.0, 0.75];
        assert_eq!(inverse_cdf(&p, 0.0), Some(1));
        assert_eq!(inverse_cdf(&p, 0.2499), Some(1));
        assert_eq!(inverse_cdf(&p, 0.25), Some(3));
        assert_eq!(inverse_cdf(&p, 0.9999), Some(3));
        assert_eq!(inverse_cdf(&[0.0, 0.0], 0.5), None);
        // One-hot: the argmax whatever u.
        assert_eq!(inverse_cdf(&[0.0, 0.0, 1.0], 0.0), Some(2));
        assert_eq!(inverse_cdf(&[0.0, 0.0, 1.0], 0.99), Some(2));
    }

    #[test]
    fn greedy_sampling_is_the_public_argmax() {
        let be = Backend::cpu();
        let mut s = Sampler::new(&be, 6, 5).expect("sampler");
        // Row 5 is not public: its huge logit must be ignored.
        let logits = be
            .upload(&[0.1f32, 2.0, 0.3, 2.0, -1.0, 50.0])
            .expect("upload");
        let h = TokenHistory::with_tokens(6, &[0, 1]).expect("history");
        let t = s
            .sample(&be, (&logits).into(), &h, &SamplingSettings::GREEDY, 7, 2)
            .expect("sample");
        assert_eq!(t, 1, "ties go to the lowest id, padding rows never win");
        // A repetition penalty on token 1 (seen in the history) moves the argmax to 3.
        let pen = SamplingSettings {
            repetition_penalty: 2.0,
            ..SamplingSettings::GREEDY
        };
        let t = s
            .sample(&be, (&logits).into(), &h, &pen, 7, 2)
            .expect("sample");
        assert_eq!(t, 3);
    }
}
