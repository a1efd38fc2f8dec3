//! The one error type of `dflash-engine`.

use dflash_config::ConfigError;
use dflash_context::ContextError;
use dflash_draft::DraftError;
use dflash_ops::OpsError;
use dflash_verify::VerifyError;

use crate::request::RequestId;
use crate::target::TargetError;

/// Everything the engine can refuse or fail with. Every refusal of a call happens before any
/// state changes (the engine, its requests, the target and the draft context are as they were),
/// except where a variant says otherwise.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// A startup option is invalid or does not fit the checkpoint (backend mismatch, K outside
    /// 1..=15, B outside 1..=8, proposal head rows, mask token, ...).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// An engine option outside what the engine supports.
    #[error("option `{option}` = {found}, expected {expected}")]
    InvalidOption {
        /// The option (`max_context`, `page_size`, ...).
        option: &'static str,
        /// What is allowed.
        expected: String,
        /// What was passed.
        found: String,
    },
    /// A startup option asks for something this engine does not implement yet (refused at
    /// startup, never silently replaced by something else).
    #[error("option `{option}` = {found} is not supported: {reason}")]
    Unsupported {
        /// The option (`startup.tree_nodes`).
        option: &'static str,
        /// What was passed.
        found: String,
        /// Why, and what works instead.
        reason: &'static str,
    },
    /// The planned memory does not fit the caller's budget (checked at startup, before any
    /// allocation of the engine's own buffers).
    #[error("memory: the plan needs {need} bytes, the budget is {budget} bytes ({plan})")]
    InsufficientMemory {
        /// Bytes the plan needs.
        need: u64,
        /// The caller's budget.
        budget: u64,
        /// The plan's items, in words.
        plan: String,
    },
    /// The draft (or a plugged-in proposer) does not fit the target: hidden width, vocabulary
    /// rows, public vocabulary, captured block ids, mask token.
    #[error("draft/target mismatch: {what}: the target has {target}, the draft needs {draft}")]
    TargetMismatch {
        /// The quantity that differs.
        what: &'static str,
        /// The target's value.
        target: String,
        /// The draft's value.
        draft: String,
    },
    /// A proposer was planned for other startup numbers than the engine's options.
    #[error("proposer mismatch: {what}: the engine needs {expected}, the proposer has {found}")]
    ProposerMismatch {
        /// The quantity that differs (`draft count K`, `concurrency B`, `proposal kind`).
        what: &'static str,
        /// The engine's value.
        expected: String,
        /// The proposer's value.
        found: String,
    },
    /// A request with an empty prompt.
    #[error("request: the prompt is empty (at least one token is needed)")]
    EmptyPrompt,
    /// A request with a zero token budget.
    #[error("request: max_new_tokens is 0 (at least the first token is generated)")]
    ZeroBudget,
    /// A prompt token is not below the target's embedding rows.
    #[error(
        "request: prompt token {index} = {token} is not below the {vocab_rows} vocabulary rows"
    )]
    PromptTokenOutOfRange {
        /// Index in the prompt.
        index: usize,
        /// The token id.
        token: u32,
        /// The target's vocabulary rows.
        vocab_rows: usize,
    },
    /// A stop token or stop-sequence token is not a public token id.
    #[error("request: stop token {token} is not below the public vocabulary {public_vocab}")]
    StopTokenOutOfRange {
        /// The token id.
        token: u32,
        /// The public vocabulary size.
        public_vocab: usize,
    },
    /// A stop sequence with no tokens.
    #[error("request: stop sequence {index} is empty")]
    EmptyStopSequence {
        /// Index of the stop sequence.
        index: usize,
    },
    /// A sampling setting outside its range.
    #[error("request: sampling `{setting}` = {found}, expected {expected}")]
    InvalidSampling {
        /// The setting.
        setting: &'static str,
        /// What is allowed.
        expected: &'static str,
        /// What was passed.
        found: String,
    },
    /// The prompt plus the token budget exceed what the engine or the target can hold.
    #[error(
        "request: prompt {prompt} + max_new_tokens {max_new} = {total} positions exceed the limit of {limit} ({which})"
    )]
    RequestTooLong {
        /// Prompt tokens.
        prompt: usize,
        /// Token budget.
        max_new: usize,
        /// Their sum.
        total: usize,
        /// The limit.
        limit: usize,
        /// Whose limit (`engine max_context`, `target max_positions`).
        which: &'static str,
    },
    /// Every slot (concurrency B) holds a request.
    #[error("no free slot: all {capacity} slots hold a request (wait for one to finish)")]
    Busy {
        /// Concurrency B.
        capacity: usize,
    },
    /// The id names no active request of this engine.
    #[error("unknown request {id} (finished, released or never admitted)")]
    UnknownRequest {
        /// The id.
        id: RequestId,
    },
    /// A request's draft context does not cover exactly its committed target frontier.
    #[error("request {id}: draft context covers [0, {context}), the target frontier is {target}")]
    CoverageMismatch {
        /// The request.
        id: RequestId,
        /// Context coverage (materialized plus pending).
        context: usize,
        /// Target frontier.
        target: usize,
    },
    /// The three coverages of a request image disagree (target state, draft context and
    /// continuation metadata must all be at the same frontier).
    #[error(
        "request image coverage mismatch: target state at {target}, draft context at {draft}, continuation at {continuation}"
    )]
    ImageCoverageMismatch {
        /// The target image's frontier.
        target: usize,
        /// The draft image's coverage.
        draft: usize,
        /// The continuation metadata's frontier.
        continuation: usize,
    },
    /// A request image does not fit this engine (other prompt/history shape, another engine's
    /// vocabulary, or inconsistent continuation metadata).
    #[error("request image does not fit: {what}")]
    ImageMismatch {
        /// What is wrong.
        what: String,
    },
    /// The processed target distribution of a plain sampling step has no positive mass
    /// (target logits that are all `-inf` or NaN on the public vocabulary).
    #[error("sampling position {position}: the processed target distribution has no mass")]
    EmptyDistribution {
        /// The position being sampled.
        position: u64,
    },
    /// A plugged-in proposer refused or failed.
    #[error("proposer: {reason}")]
    Proposer {
        /// What went wrong.
        reason: String,
    },
    /// The target refused or failed.
    #[error(transparent)]
    Target(#[from] TargetError),
    /// The draft model refused or failed.
    #[error(transparent)]
    Draft(#[from] DraftError),
    /// The draft context storage refused or failed.
    #[error(transparent)]
    Context(#[from] ContextError),
    /// Verification refused or failed.
    #[error(transparent)]
    Verify(#[from] VerifyError),
    /// A backend operation (allocation, copy, op) failed.
    #[error(transparent)]
    Ops(#[from] OpsError),
}

/// Result alias of this crate.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;
