//! `dflash-engine`: the DFlash / DFlash2 round transaction, startup selection, concurrency and
//! the boundary to the embedding engine's target model.
//!
//! - [`target`]: the [`Target`] trait a real engine implements for its Qwen3.5 (prefill with
//!   feature capture, batched verify with per-column records, commit N, fork, checkpoint,
//!   restore, release) and its typed errors.
//! - [`Proposer`]: what the round needs from a drafter; [`DraftProposer`] is the DFlash /
//!   DFlash2 draft model with its context storage, tests plug in others.
//! - [`Engine`]: startup ([`Engine::with_draft`]: backend, K in 1..=15, B in 1..=8, proposal
//!   head, every workspace planned and the memory need checked against a budget before the
//!   first request), admission, the round, concurrency, fork / checkpoint / host replica /
//!   restore of whole requests.
//! - [`plain_decode`]: plain target decoding, the baseline of every check.
//!
//! # The round
//!
//! For every active request (at most B, one compact batch; rows in admission order), with
//! committed target frontier `F` and unprocessed anchor `a = x_F`:
//!
//! 1. materialize the request's pending target features, so its draft context covers `[0, F)`
//!    (checked: [`EngineError::CoverageMismatch`]);
//! 2. `P = min(K, budget_left - 1)`: the proposals that can be verified this round (the
//!    `L <= P + 1` licensed outputs then fit the token budget; admission refuses requests whose
//!    prompt plus budget exceed the target's or the engine's positions, so no position limit
//!    cuts `P` further);
//! 3. one masked draft block for the batch (DFlash: per-column argmax, q a point mass;
//!    DFlash2: the conditional selector with its retained q, at the request's temperature);
//! 4. the target verifies `Q = P + 1` columns `[a, d_1 .. d_P]` per row, causally, keeping
//!    per-column records;
//! 5. `dflash-verify` processes the target distributions (mask, penalties with the history
//!    plus accepted proposals, temperature, filters) and accepts (greedy prefix match, or
//!    `min(1, p/q)` with the actual q), emitting the correction or bonus: `L = A + 1` licensed
//!    outputs `y`;
//! 6. the frontend preview chooses `N` in `0..=L` ([`preview`]): the first stop token or
//!    completed stop sequence (published), else the budget; a cancelled request gets `N = 0`;
//! 7. the target commits `N` input rows `[a, d_1 .. d_(N-1)]` (continuation from column
//!    `N - 1`, `y_N` the next anchor); `N = 0` commits nothing;
//! 8. the first `N` captured feature columns of the verify block become the request's pending
//!    context work (materialized at the start of its next round or before an image), and the
//!    `N` tokens are published ([`Event::Tokens`]); a request that ended is released (target
//!    sequence and draft slot; [`Event::Finished`]).
//!
//! The target stays the output authority: every published token is a target decision.
//!
//! # Admission
//!
//! The prompt is prefilled through the target; the captured features of every prompt
//! position become the request's pending context and are materialized at once (so at most
//! one prompt's features are ever held); the first output token (the anchor) is sampled from
//! the prompt's last logits with the request's settings and seed, `Purpose::Decode` at
//! position `T` (the prompt length) — the argmax at temperature 0 — and published. A request
//! whose first token already ends it never enters a round.
//!
//! # Randomness and independence
//!
//! Every random decision is keyed by the request seed and the absolute position (and a
//! purpose code), never by the batch row: a request's tokens are the same whichever requests
//! share its rounds, and the same after a fork (same seed), checkpoint or restore.

pub mod target;

mod baseline;
mod draft_proposer;
mod engine;
mod error;
mod options;
mod proposer;
mod request;
mod sampling;

pub use baseline::{Generation, plain_decode};
pub use draft_proposer::{DraftHead, DraftProposer, DraftTargetParts, live_row_buckets};
pub use engine::{
    AdmissionReport, Continuation, Engine, EngineStats, Event, Finished, RequestImage, RowReport,
    StepReport,
};
pub use error::{EngineError, Result};
pub use options::{EngineOptions, MemoryItem, MemoryPlan};
pub use proposer::{Coverage, DeviceRound, Proposal, ProposeRow, Proposer};
pub use request::{CancelHandle, FinishReason, Request, RequestId, StopConditions, preview};
pub use sampling::{Sampler, inverse_cdf};
pub use target::{
    Accepted, Commit, DeviceVerifyBatch, PrefillOutput, SeqHandle, Target, TargetCheckpoint,
    TargetError, TargetInfo, VerifyBatch, VerifyOutputs, VerifyRow, VerifyView,
};

pub use dflash_verify::{
    DeviceProposals, DeviceTop16, LogitsLayout, ProposalKind, RetainedQ, SamplingSettings,
    TargetLogits,
};
