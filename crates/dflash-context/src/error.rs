//! The one error type of `dflash-context`.
//!
//! Every refusal is checked before any state changes: a call that returns an error other than
//! [`ContextError::Ops`] (a device failure) leaves the store exactly as it was (pools, page
//! tables, frontiers, pending queues, free lists).

use dflash_ops::OpsError;

/// Everything that can go wrong when creating or using a [`crate::ContextStore`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ContextError {
    /// The geometry or capacity handed to [`crate::ContextStore::new`] is not usable.
    #[error("invalid context geometry: `{field}` = {found}, expected {expected}")]
    InvalidGeometry {
        /// The offending field (`geometry.kv_heads`, `capacity.lanes`, ...).
        field: &'static str,
        /// What is allowed.
        expected: String,
        /// What was passed.
        found: String,
    },
    /// Every lane (concurrency slot) holds a request.
    #[error("no free lane: all {lanes} lanes hold a request; release one first")]
    NoFreeLane {
        /// The store's lane count (concurrency B).
        lanes: usize,
    },
    /// The full-layer page pool cannot reserve the pages a request's declared maximum context
    /// needs.
    #[error("not enough free pages: the request needs {needed}, {free} are free")]
    InsufficientPages {
        /// Pages the request needs (`ceil(max_context / page_size)`).
        needed: usize,
        /// Pages free now.
        free: usize,
    },
    /// A declared maximum context is longer than the store can hold for one request.
    #[error("maximum context {requested} tokens exceeds the per-request limit of {limit}")]
    ContextTooLong {
        /// The declared maximum context.
        requested: usize,
        /// The store's per-request limit (`max_pages_per_lane * page_size` for drafts with full
        /// layers, and `i32::MAX` for positions in any case).
        limit: usize,
    },
    /// The handle does not name a live request (released, or never issued by this store).
    #[error("unknown context handle (lane {lane}, generation {generation}): released or foreign")]
    UnknownHandle {
        /// The lane the handle names.
        lane: usize,
        /// The handle's generation.
        generation: u64,
    },
    /// Pending features were pushed out of order or with a gap.
    #[error(
        "pending features out of order: the next position is {expected}, the push starts at {found}"
    )]
    OutOfOrder {
        /// The request's pending target frontier (`F_ctx + pending`), where the push must start.
        expected: usize,
        /// The start position that was passed.
        found: usize,
    },
    /// A feature buffer does not hold whole rows of `n_ids * H`, or fewer rows than pushed.
    #[error(
        "feature buffer of {len} elements: expected a multiple of the feature width {width} holding at least {rows} rows"
    )]
    FeatureShape {
        /// The feature width n_ids * H.
        width: usize,
        /// The buffer's element count.
        len: usize,
        /// The rows that were to be pushed.
        rows: usize,
    },
    /// A push would take the request past its declared maximum context.
    #[error(
        "context overflow: positions up to {end} exceed the declared maximum context {max_context}"
    )]
    ContextOverflow {
        /// The end (exclusive) position the push would reach.
        end: usize,
        /// The request's declared maximum context.
        max_context: usize,
    },
    /// The operation needs the request's pending features materialized first: call
    /// [`crate::ContextStore::materialize`], then retry.
    #[error("{pending} pending feature columns: materialize the request's context first")]
    PendingFeatures {
        /// Pending columns not yet materialized.
        pending: usize,
    },
    /// Context coverage disagrees with the target state it travels with.
    #[error(
        "coverage mismatch: the draft context covers [0, {context}), the target state is at {target}"
    )]
    CoverageMismatch {
        /// The context frontier F_ctx (of the request or the image).
        context: usize,
        /// The target frontier the caller attaches it to.
        target: usize,
    },
    /// An image was made by a store of a different geometry.
    #[error("image geometry mismatch: {what}")]
    ImageMismatch {
        /// What differs.
        what: String,
    },
    /// An image's coverage is longer than the receiving request's declared maximum context.
    #[error("image covers {frontier} positions, the request's maximum context is {max_context}")]
    ImageTooLong {
        /// The image's frontier.
        frontier: usize,
        /// The receiving request's declared maximum context.
        max_context: usize,
    },
    /// The same handle appears twice in a batch.
    #[error("handle of lane {lane} appears twice in the batch (rows {first} and {second})")]
    DuplicateHandle {
        /// The lane.
        lane: usize,
        /// First row.
        first: usize,
        /// Second row.
        second: usize,
    },
    /// A caller-provided metadata buffer set has the wrong row count.
    #[error("batch metadata holds {capacity} rows, the batch has {rows}")]
    BatchRows {
        /// The metadata's row count.
        capacity: usize,
        /// The batch's row count.
        rows: usize,
    },
    /// A weight passed to [`crate::ContextStore::materialize`] has the wrong shape or lives on
    /// another backend.
    #[error("weight `{name}`: {problem}")]
    Weight {
        /// The weight's role (`fc`, `layers[2].w_k`, ...).
        name: String,
        /// What is wrong (expected vs found).
        problem: String,
    },
    /// A layer index is out of range, or names a layer of the other kind.
    #[error("layer {layer}: {problem}")]
    Layer {
        /// The draft layer index.
        layer: usize,
        /// What is wrong.
        problem: String,
    },
    /// A read asked for a position outside the request's live interval (dead or not yet
    /// materialized); its bytes are unreachable.
    #[error(
        "position {position} of layer {layer} is not live: the live interval is [{start}, {end})"
    )]
    DeadPosition {
        /// The draft layer.
        layer: usize,
        /// The position asked for.
        position: usize,
        /// Live interval start.
        start: usize,
        /// Live interval end (F_ctx).
        end: usize,
    },
    /// A device operation failed in the middle of updating a request's context; the request
    /// is poisoned (every later call on it except release returns this error).
    #[error("the request's context is poisoned by an earlier device failure; release it")]
    Poisoned,
    /// A device operation (allocation, copy, op launch) failed.
    #[error(transparent)]
    Ops(#[from] OpsError),
}

/// Result alias of this crate.
pub type Result<T, E = ContextError> = std::result::Result<T, E>;
