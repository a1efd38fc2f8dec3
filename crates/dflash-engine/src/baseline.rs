//! Plain target decoding: the baseline every speculative run is checked against.
//!
//! One token per step through the [`Target`] alone: prefill the prompt, sample the token at
//! position `T` from the last logits, then repeatedly verify the single column `[x_t]` and
//! commit it, sampling `x_(t+1)` from that column's logits. Every token is drawn by
//! [`Sampler`] (`Purpose::Decode` at its own position, the request's settings and seed; greedy
//! at temperature 0) and the request ends by the same preview rule the engine uses (stop
//! token, stop sequence, budget). At temperature 0 the speculative engine must publish exactly
//! these tokens; at positive temperature it must publish tokens with the same distribution.

use dflash_ops::Backend;
use dflash_verify::TokenHistory;

use crate::error::Result;
use crate::request::{FinishReason, Request, preview};
use crate::sampling::Sampler;
use crate::target::{Commit, Target, VerifyBatch, VerifyRow};

/// The result of a plain decode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Generation {
    /// Output tokens (after the prompt).
    pub tokens: Vec<u32>,
    /// Why decoding ended.
    pub finish: FinishReason,
}

/// Decode `request` with the target alone (see the module docs). The target sequence is
/// released before returning, on success and on error.
pub fn plain_decode<T: Target>(
    target: &mut T,
    be: &Backend,
    request: &Request,
) -> Result<Generation> {
    let info = target.info().clone();
    request.validate(
        info.vocab_rows,
        info.public_vocab,
        info.max_positions,
        "target max_positions",
    )?;
    let mut sampler = Sampler::new(be, info.vocab_rows, info.public_vocab)?;
    let (seq, pre) = target.create_with_prompt(be, &request.prompt)?;
    let mut run = || -> Result<Generation> {
        let mut history = TokenHistory::with_tokens(info.vocab_rows, &request.prompt)?;
        let mut pos = request.prompt.len();
        let mut tokens = Vec::new();
        let mut next = sampler.sample(
            be,
            (&pre.last_logits).into(),
            &history,
            &request.sampling,
            request.seed,
            pos as u64,
        )?;
        loop {
            let left = request.max_new_tokens - tokens.len();
            let (_, finish) = preview(&request.stop, &tokens, &[next], left, false);
            tokens.push(next);
            history.push(next)?;
            if let Some(finish) = finish {
                return Ok(Generation { tokens, finish });
            }
            let input = [next];
            target.verify(
                be,
                &VerifyBatch {
                    rows: &[VerifyRow::chain(seq, &input)],
                    cols: 1,
                },
            )?;
            target.commit(&[Commit::prefix(seq, 1)])?;
            pos += 1;
            next = sampler.sample(
                be,
                target.verified()?.logits.values,
                &history,
                &request.sampling,
                request.seed,
                pos as u64,
            )?;
        }
    };
    let result = run();
    let released = target.release(seq);
    let generation = result?;
    released?;
    Ok(generation)
}
