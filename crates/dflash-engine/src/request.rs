//! Requests: what a caller submits, its stop conditions and the frontend preview that chooses
//! how many licensed tokens a round publishes.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use dflash_verify::SamplingSettings;

use crate::error::{EngineError, Result};

/// An engine-wide request id (never reused by one engine).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "r{}", self.0)
    }
}

/// One generation request.
///
/// Output tokens are the tokens after the prompt: the first one (the anchor) is sampled from the
/// prompt's last logits at admission, the rest are published by rounds. `max_new_tokens`
/// counts all of them. A stop token or a completed stop sequence ends the request *including*
/// the token(s) that matched (they are published).
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    /// Prompt token ids (at least one, each below the target's vocabulary rows).
    pub prompt: Vec<u32>,
    /// Token budget (at least 1).
    pub max_new_tokens: usize,
    /// Target sampling settings (temperature finite and `>= 0`, `0`: greedy; see
    /// [`dflash_config::check_temperature`]).
    pub sampling: SamplingSettings,
    /// The request seed: the key of every random decision of this request (sampling, the
    /// DFlash2 selector, acceptance); never the batch row.
    pub seed: u64,
    /// Stop conditions.
    pub stop: StopConditions,
}

impl Request {
    /// A greedy request with no stop condition besides the budget.
    pub fn greedy(prompt: Vec<u32>, max_new_tokens: usize) -> Self {
        Request {
            prompt,
            max_new_tokens,
            sampling: SamplingSettings::GREEDY,
            seed: 0,
            stop: StopConditions::default(),
        }
    }

    /// A request sampling at `temperature` (no filters) with `seed`.
    pub fn sampled(prompt: Vec<u32>, max_new_tokens: usize, temperature: f32, seed: u64) -> Self {
        Request {
            sampling: SamplingSettings::sampling(temperature),
            seed,
            ..Request::greedy(prompt, max_new_tokens)
        }
    }

    /// Check the request against the target's vocabulary (`vocab_rows`, `public_vocab`) and
    /// the position limit `limit` (named `which` in the error).
    pub(crate) fn validate(
        &self,
        vocab_rows: usize,
        public_vocab: usize,
        limit: usize,
        which: &'static str,
    ) -> Result<()> {
        if self.prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if self.max_new_tokens == 0 {
            return Err(EngineError::ZeroBudget);
        }
        if let Some(index) = self.prompt.iter().position(|&t| t as usize >= vocab_rows) {
            return Err(EngineError::PromptTokenOutOfRange {
                index,
                token: self.prompt[index],
                vocab_rows,
            });
        }
        let total = self.prompt.len().saturating_add(self.max_new_tokens);
        if total > limit {
            return Err(EngineError::RequestTooLong {
                prompt: self.prompt.len(),
                max_new: self.max_new_tokens,
                total,
                limit,
                which,
            });
        }
        validate_sampling(&self.sampling)?;
        self.stop.validate(public_vocab)
    }
}

/// Check sampling settings (the ranges of the `target_distribution` op).
pub(crate) fn validate_sampling(s: &SamplingSettings) -> Result<()> {
    let bad = |setting: &'static str, expected: &'static str, found: String| {
        Err(EngineError::InvalidSampling {
            setting,
            expected,
            found,
        })
    };
    if !dflash_config::is_valid_temperature(s.temperature) {
        return bad(
            "temperature",
            dflash_config::TEMPERATURE_RULE,
            s.temperature.to_string(),
        );
    }
    if s.top_k < 0 {
        return bad("top_k", ">= 0 (0: off)", s.top_k.to_string());
    }
    if !(s.top_p > 0.0 && s.top_p <= 1.0) {
        return bad("top_p", "in (0, 1] (1: off)", s.top_p.to_string());
    }
    if !(s.min_p >= 0.0 && s.min_p < 1.0) {
        return bad("min_p", "in [0, 1) (0: off)", s.min_p.to_string());
    }
    if !(s.repetition_penalty.is_finite() && s.repetition_penalty > 0.0) {
        return bad(
            "repetition_penalty",
            "finite and > 0 (1: off)",
            s.repetition_penalty.to_string(),
        );
    }
    if !s.frequency_penalty.is_finite() {
        return bad(
            "frequency_penalty",
            "finite (0: off)",
            s.frequency_penalty.to_string(),
        );
    }
    if !s.presence_penalty.is_finite() {
        return bad(
            "presence_penalty",
            "finite (0: off)",
            s.presence_penalty.to_string(),
        );
    }
    Ok(())
}

/// When a request stops before its budget.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StopConditions {
    /// Tokens that end the request when generated (EOS); the token is published.
    pub stop_tokens: Vec<u32>,
    /// Token sequences that end the request when the generated output ends with one of them
    /// (a match may span rounds; prompt tokens never take part); the sequence is published.
    pub stop_sequences: Vec<Vec<u32>>,
}

impl StopConditions {
    /// Stop at `eos` only.
    pub fn eos(eos: u32) -> Self {
        StopConditions {
            stop_tokens: vec![eos],
            stop_sequences: Vec::new(),
        }
    }

    fn validate(&self, public_vocab: usize) -> Result<()> {
        for (index, s) in self.stop_sequences.iter().enumerate() {
            if s.is_empty() {
                return Err(EngineError::EmptyStopSequence { index });
            }
        }
        let all = self
            .stop_tokens
            .iter()
            .chain(self.stop_sequences.iter().flatten());
        for &token in all {
            if token as usize >= public_vocab {
                return Err(EngineError::StopTokenOutOfRange {
                    token,
                    public_vocab,
                });
            }
        }
        Ok(())
    }

    /// The stop reason if `output` (every generated token so far, the newest last) has just
    /// reached a stop condition with its last token.
    pub fn hit(&self, output: &[u32]) -> Option<FinishReason> {
        let last = *output.last()?;
        if self.stop_tokens.contains(&last) {
            return Some(FinishReason::StopToken(last));
        }
        self.stop_sequences
            .iter()
            .position(|s| output.ends_with(s))
            .map(FinishReason::StopSequence)
    }
}

/// Why a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// A stop token (EOS) was generated (and published).
    StopToken(u32),
    /// Stop sequence `i` was completed (and published).
    StopSequence(usize),
    /// The token budget is spent.
    Budget,
    /// The request was cancelled; a round that sees the cancellation publishes nothing
    /// (N = 0).
    Cancelled,
}

impl std::fmt::Display for FinishReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FinishReason::StopToken(t) => write!(f, "stop token {t}"),
            FinishReason::StopSequence(i) => write!(f, "stop sequence {i}"),
            FinishReason::Budget => f.write_str("budget"),
            FinishReason::Cancelled => f.write_str("cancelled"),
        }
    }
}

/// A cancellation flag shared with a frontend: setting it (from any thread) makes the
/// request's next round preview choose N = 0.
#[derive(Clone, Debug, Default)]
pub struct CancelHandle(Arc<AtomicBool>);

impl CancelHandle {
    /// Request cancellation.
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Release);
    }

    /// Whether cancellation was requested.
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// The frontend preview of one round: how many of the `L` licensed tokens to publish.
///
/// `output` is the request's generated output before the round, `licensed` the round's
/// `y_1 .. y_L`, `budget_left` the tokens the budget still allows. Returns `N` in `0..=L` and
/// the finish reason if the request ends with this round: cancellation gives `N = 0`;
/// otherwise `N` is the first `j` at which a stop condition is hit (the stop token or the
/// sequence's last token included), else `min(L, budget_left)` (ending with
/// [`FinishReason::Budget`] when that spends the budget).
pub fn preview(
    stop: &StopConditions,
    output: &[u32],
    licensed: &[u32],
    budget_left: usize,
    cancelled: bool,
) -> (usize, Option<FinishReason>) {
    if cancelled {
        return (0, Some(FinishReason::Cancelled));
    }
    let cap = licensed.len().min(budget_left);
    let mut scratch: Vec<u32> = Vec::with_capacity(output.len() + cap);
    scratch.extend_from_slice(output);
    for (j, &y) in licensed[..cap].iter().enumerate() {
        scratch.push(y);
        if let Some(reason) = stop.hit(&scratch) {
            return (j + 1, Some(reason));
        }
    }
    let finish = (cap == budget_left).then_some(FinishReason::Budget);
    (cap, finish)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preview_stops_at_eos_sequence_budget_and_cancel() {
        let stop = StopConditions {
            stop_tokens: vec![9],
            stop_sequences: vec![vec![4, 5, 6]],
        };
        // EOS in the middle: publish through it.
        assert_eq!(
            preview(&stop, &[1], &[2, 9, 3], 10, false),
            (2, Some(FinishReason::StopToken(9)))
        );
        // A stop sequence spanning the previous output and this round.
        assert_eq!(
            preview(&stop, &[1, 4, 5], &[6, 7], 10, false),
            (1, Some(FinishReason::StopSequence(0)))
        );
        // Budget cuts the licensed tokens.
        assert_eq!(
            preview(&stop, &[], &[1, 2, 3], 2, false),
            (2, Some(FinishReason::Budget))
        );
        // Budget exactly spent by L.
        assert_eq!(
            preview(&stop, &[], &[1, 2], 2, false),
            (2, Some(FinishReason::Budget))
        );
        // Nothing ends: all L published.
        assert_eq!(preview(&stop, &[], &[1, 2], 5, false), (2, None));
        // Cancellation publishes nothing.
        assert_eq!(
            preview(&stop, &[], &[9], 5, true),
            (0, Some(FinishReason::Cancelled))
        );
        // A stop token past the budget is never reached.
        assert_eq!(
            preview(&stop, &[], &[1, 9], 1, false),
            (1, Some(FinishReason::Budget))
        );
    }

    #[test]
    fn validation_names_the_bad_field() {
        let ok = Request::greedy(vec![1, 2], 3);
        assert!(ok.validate(10, 8, 100, "x").is_ok());
        let mut r = ok.clone();
        r.prompt.clear();
        assert!(matches!(
            r.validate(10, 8, 100, "x"),
            Err(EngineError::EmptyPrompt)
        ));
        let mut r = ok.clone();
        r.max_new_tokens = 0;
        assert!(matches!(
            r.validate(10, 8, 100, "x"),
            Err(EngineError::ZeroBudget)
        ));
        let mut r = ok.clone();
        r.prompt.push(10);
        assert!(matches!(
            r.validate(10, 8, 100, "x"),
            Err(EngineError::PromptTokenOutOfRange {
                index: 2,
                token: 10,
                ..
            })
        ));
        assert!(matches!(
            ok.validate(10, 8, 4, "x"),
            Err(EngineError::RequestTooLong {
                total: 5,
                limit: 4,
                ..
            })
        ));
        for t in [f32::NAN, f32::INFINITY, -1.0, -1e-30] {
            let mut r = ok.clone();
            r.sampling.temperature = t;
            assert!(
                matches!(
                    r.validate(10, 8, 100, "x"),
                    Err(EngineError::InvalidSampling {
                        setting: "temperature",
                        ..
                    })
                ),
                "temperature {t} accepted"
            );
        }
        let mut r = ok.clone();
        r.sampling.temperature = 0.0;
        assert!(r.validate(10, 8, 100, "x").is_ok(), "0 is greedy");
        let mut r = ok.clone();
        r.sampling.top_p = 0.0;
        assert!(matches!(
            r.validate(10, 8, 100, "x"),
            Err(EngineError::InvalidSampling {
                setting: "top_p",
                ..
            })
        ));
        let mut r = ok.clone();
        r.stop.stop_tokens.push(8);
        assert!(matches!(
            r.validate(10, 8, 100, "x"),
            Err(EngineError::StopTokenOutOfRange { token: 8, .. })
        ));
        let mut r = ok;
        r.stop.stop_sequences.push(Vec::new());
        assert!(matches!(
            r.validate(10, 8, 100, "x"),
            Err(EngineError::EmptyStopSequence { index: 0 })
        ));
    }
}
