//! The `Target` boundary: what the round transaction needs from the embedding engine's model.
//!
//! A real engine implements [`Target`] for its Qwen3.5 (or any causal LM with the same
//! interface); the crates below `dflash-engine` never see it. The testkit's reference target
//! (`dflash_testkit::ReferenceTarget`) is a small host implementation used as the test oracle.
//!
//! # Model of a sequence
//!
//! A sequence (named by an opaque [`SeqHandle`]) has a *frontier* `F`: positions `[0, F)` have
//! been processed and their state (KV cache, Gated DeltaNet recurrent state and conv window,
//! counters) is committed. The round transaction then:
//!
//! 1. [`Target::verify`]s a batch of rows: each row is one sequence with its input tokens
//!    `[a, d_1, .., d_P]` (the unprocessed anchor and `P` proposals, `Q = P + 1` live columns,
//!    chain column `i` at position `F + i`). The target returns per-column logits and captured
//!    features and keeps *per-column records* (the K/V of the new columns, the recurrent state
//!    after every column, the conv inputs) without changing the committed state.
//! 2. [`Target::commit`]s `N` rows per sequence, `0 <= N <= Q`: target KV, the Gated DeltaNet
//!    fold (taken from the records of this verify block, never recomputed), counters and the
//!    frontier advance together to `F + N`. `N = 0` releases the records with no state change.
//!
//! # Captured features
//!
//! [`TargetInfo::capture_ids`] are zero-based decoder block ids. The captured feature of block
//! `l` at a position is that block's complete residual output (after both the mixer and the
//! MLP residual additions, before the next block's input norm or the final norm). The feature
//! of a position is the concatenation in recorded order, `s_t` of width `n_ids * H`, stored
//! BF16 (one RNE rounding of the residual).
//!
//! # Trees
//!
//! A row may carry parent indices ([`VerifyRow::parents`]): column `i > 0` then continues
//! column `parents[i-1] < i`, attends only to its ancestors (and the committed prefix), and
//! takes the RoPE position `F + depth(i)`. `None` is the chain (parent of `i` is `i - 1`). A
//! target that cannot verify trees refuses a non-chain row with
//! [`TargetError::TreeUnsupported`] (see [`TargetInfo::supports_trees`]). A commit then names
//! the accepted root-to-node path ([`Accepted::Path`]); a chain commit is [`Accepted::Prefix`].
//!
//! # Errors
//!
//! Every misuse (an unknown handle, a commit without a verify, `N > Q`, a verify while records
//! are pending, a token at or above the embedding rows, an empty batch or row, wrong output
//! sizes) is a typed [`TargetError`], returned before any state changes: a refused call leaves
//! every sequence exactly as it was.

use dflash_ops::{Backend, Buffer, OpsError, bf16};
use dflash_verify::TargetLogits;

/// An opaque sequence handle issued by a [`Target`].
///
/// Handles are never reused by the reference target within one instance; a handle from another
/// target instance is simply unknown (or names another sequence), so embedders must keep
/// handles with the target that issued them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqHandle(u64);

impl SeqHandle {
    /// A handle from its raw value (for [`Target`] implementations).
    pub const fn from_raw(raw: u64) -> Self {
        SeqHandle(raw)
    }

    /// The raw value (for [`Target`] implementations and logs).
    pub const fn raw(self) -> u64 {
        self.0
    }
}

impl std::fmt::Display for SeqHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "seq#{}", self.0)
    }
}

/// Static facts about a target.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TargetInfo {
    /// Hidden width H.
    pub hidden: usize,
    /// Decoder block count.
    pub layers: usize,
    /// Rows of the embedding and of the output head (the padded vocabulary). Logits have this
    /// many entries per column; token ids must be below it.
    pub vocab_rows: usize,
    /// Public vocabulary size (`<= vocab_rows`): ids at or above it are never real tokens.
    pub public_vocab: usize,
    /// Captured block ids, zero-based, in recorded order (no duplicates, each `< layers`).
    pub capture_ids: Vec<usize>,
    /// The largest frontier a sequence may reach (positions `[0, max_positions)`).
    pub max_positions: usize,
    /// Whether [`Target::verify`] accepts rows with non-chain parents.
    pub supports_trees: bool,
}

impl TargetInfo {
    /// Width of one captured feature vector, `capture_ids.len() * hidden`.
    pub fn feature_width(&self) -> usize {
        self.capture_ids.len() * self.hidden
    }
}

/// One row of a verify batch: one sequence and its live input columns.
#[derive(Clone, Copy, Debug)]
pub struct VerifyRow<'a> {
    /// The sequence (must have no pending records).
    pub seq: SeqHandle,
    /// Input tokens of the `Q = tokens.len() >= 1` live columns: the anchor, then proposals.
    pub tokens: &'a [u32],
    /// Tree shape: `parents[i - 1]` is the parent column of column `i` (`< i`), length `Q - 1`.
    /// `None` means a chain. RoPE position of column `i` is `F + depth(i)`.
    pub parents: Option<&'a [u32]>,
}

impl<'a> VerifyRow<'a> {
    /// A chain row (`parents = None`).
    pub fn chain(seq: SeqHandle, tokens: &'a [u32]) -> Self {
        VerifyRow {
            seq,
            tokens,
            parents: None,
        }
    }

    /// True when the row is a chain: no parents, or every parent is the previous column.
    pub fn is_chain(&self) -> bool {
        self.parents
            .is_none_or(|p| p.iter().enumerate().all(|(i, &pa)| pa as usize == i))
    }
}

/// A verify batch: rows of different sequences, padded to a common physical width.
#[derive(Clone, Copy, Debug)]
pub struct VerifyBatch<'a> {
    /// The rows (distinct sequences, at least one).
    pub rows: &'a [VerifyRow<'a>],
    /// Physical columns per row in the outputs (`>=` every row's `Q`). Columns at or past a
    /// row's `Q` are dead: their logits and features are written as exact zeros.
    pub cols: usize,
}

/// A verify batch whose input tokens are on the device ([`Target::verify_device`]): a
/// device-resident round, where the engine has not read the draft's proposals back.
#[derive(Clone, Copy, Debug)]
pub struct DeviceVerifyBatch<'a> {
    /// The rows' sequences (distinct, at least one).
    pub seqs: &'a [SeqHandle],
    /// Live columns `Q = P + 1` of each row (`1 ..= cols`).
    pub columns: &'a [usize],
    /// Input tokens I32 on the call's backend: row `r`'s `columns[r]` tokens (the anchor,
    /// then the proposals) at `r * cols ..` (at least `rows * cols` elements; columns past a
    /// row's count hold unspecified values). Not validated on the host (the engine has not
    /// read them): the draft's ops produce public ids, and the engine checks them with the
    /// round's outcome, but a target embedding straight from these ids must still bound its
    /// gather (clamp or skip an id at or above its embedding rows) rather than trust them.
    pub ids: &'a Buffer<i32>,
    /// Physical columns per row (as [`VerifyBatch::cols`]).
    pub cols: usize,
}

/// What the last [`Target::verify`] produced ([`Target::verified`]), lent by the target: the
/// engine reads the target's own memory in place, until the target's next verify.
#[derive(Clone, Copy, Debug)]
pub struct VerifyView<'a> {
    /// The batch's logits: F32 or BF16, padded `[rows, cols, vocab_rows]` (dead columns are
    /// never read) or packed (only each row's `Q` live columns, row after row).
    pub logits: TargetLogits<'a>,
    /// Captured features BF16, padded: row `r`, column `i` at `(r * cols + i) * feature_width`
    /// (at least `rows * cols` columns).
    pub features: &'a Buffer<bf16>,
}

/// Verify outputs a target may keep for itself ([`VerifyOutputs::fit`]) and lend through
/// [`Target::verified`] ([`VerifyOutputs::view`]): F32 padded logits and features.
#[derive(Debug)]
pub struct VerifyOutputs {
    /// Per-column logits, F32 `[rows, cols, vocab_rows]`.
    pub logits: Buffer<f32>,
    /// Per-column captured features, BF16 `[rows, cols, feature_width]`.
    pub features: Buffer<bf16>,
}

impl VerifyOutputs {
    /// Allocate zeroed outputs for `rows x cols` on `be`.
    pub fn alloc(
        be: &Backend,
        info: &TargetInfo,
        rows: usize,
        cols: usize,
    ) -> Result<Self, TargetError> {
        Ok(VerifyOutputs {
            logits: be.zeros(rows * cols * info.vocab_rows)?,
            features: be.zeros(rows * cols * info.feature_width())?,
        })
    }

    /// Columns these outputs hold.
    pub fn columns(&self, info: &TargetInfo) -> usize {
        self.logits.len() / info.vocab_rows.max(1)
    }

    /// Make `slot` hold outputs on `be` for at least `rows x cols` columns: kept when they
    /// already do (so a target that sees its largest batch first allocates once), replaced
    /// otherwise.
    pub fn fit<'s>(
        slot: &'s mut Option<VerifyOutputs>,
        be: &Backend,
        info: &TargetInfo,
        rows: usize,
        cols: usize,
    ) -> Result<&'s mut VerifyOutputs, TargetError> {
        let fits = slot.as_ref().is_some_and(|o| {
            o.logits.backend_name() == be.name() && o.columns(info) >= rows * cols
        });
        if !fits {
            *slot = Some(VerifyOutputs::alloc(be, info, rows, cols)?);
        }
        slot.as_mut().ok_or(TargetError::NothingVerified)
    }

    /// The view [`Target::verified`] lends: padded F32 logits and the features.
    pub fn view(&self) -> VerifyView<'_> {
        VerifyView {
            logits: TargetLogits::padded(&self.logits),
            features: &self.features,
        }
    }
}

/// What [`Target::prefill`] returns.
#[derive(Debug)]
pub struct PrefillOutput {
    /// Captured features of every prefilled position, BF16 `[T, feature_width]`.
    pub features: Buffer<bf16>,
    /// Logits of the last prefilled position, F32 `[vocab_rows]` (the distribution of the
    /// next, unprocessed token).
    pub last_logits: Buffer<f32>,
}

/// Which verified columns a commit adopts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Accepted {
    /// The first `N` columns (`0 ..= Q`) of a chain verify; `0` releases the records.
    Prefix(usize),
    /// A root-to-node path of column indices starting at column 0, each the parent of the
    /// next (for tree verifies; on a chain verify this must be `[0, 1, .., N-1]`). Empty is the
    /// same as `Prefix(0)`.
    Path(Vec<u32>),
}

/// One sequence's commit after a verify.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Commit {
    /// The sequence (must have pending records from a verify).
    pub seq: SeqHandle,
    /// The adopted columns.
    pub accepted: Accepted,
}

impl Commit {
    /// Commit the first `n` chain columns of `seq`.
    pub fn prefix(seq: SeqHandle, n: usize) -> Self {
        Commit {
            seq,
            accepted: Accepted::Prefix(n),
        }
    }

    /// Number of rows this commit adopts.
    pub fn rows(&self) -> usize {
        match &self.accepted {
            Accepted::Prefix(n) => *n,
            Accepted::Path(p) => p.len(),
        }
    }
}

/// An opaque state image from [`Target::checkpoint`].
pub trait TargetCheckpoint: Send + Sync {
    /// The frontier the image was taken at (restoring sets the sequence's frontier to it).
    fn frontier(&self) -> usize;
    /// Payload size in bytes (for memory accounting).
    fn size_bytes(&self) -> usize;
}

/// The target model as the round transaction sees it. See the module docs for the protocol.
pub trait Target {
    /// The checkpoint image type.
    type Checkpoint: TargetCheckpoint;

    /// Static facts (geometry, capture ids, vocabulary sizes).
    fn info(&self) -> &TargetInfo;

    /// A new empty sequence (frontier 0).
    fn create(&mut self) -> Result<SeqHandle, TargetError>;

    /// Process `tokens` (at least one) at positions `F .. F + T` and commit them (`F` becomes
    /// `F + T`): the prompt, or a further chunk of it. Returns the captured features of every
    /// processed position and the logits of the last one, on `be`. Refused while the sequence
    /// has pending verify records.
    fn prefill(
        &mut self,
        be: &Backend,
        seq: SeqHandle,
        tokens: &[u32],
    ) -> Result<PrefillOutput, TargetError>;

    /// The sequence's frontier `F` (processed positions).
    fn frontier(&self, seq: SeqHandle) -> Result<usize, TargetError>;

    /// The live column count `Q` of the sequence's pending verify records, if any.
    fn pending(&self, seq: SeqHandle) -> Result<Option<usize>, TargetError>;

    /// Verify a batch: compute every row's live columns causally on top of its committed state,
    /// keep their logits and captured features on `be` in the target's own memory (lent
    /// through [`Target::verified`]), and retain per-column records until
    /// [`Target::commit`]. No committed state changes.
    fn verify(&mut self, be: &Backend, batch: &VerifyBatch<'_>) -> Result<(), TargetError>;

    /// [`Target::verify`] of a chain batch whose input tokens are on the device (the
    /// device-resident round: the engine queues the draft, this verify and the verification
    /// ops, and reads only the round's outcome). A target that embeds from device ids
    /// overrides it and never synchronizes; the default reads the ids back (one synchronize)
    /// and calls [`Target::verify`]. Same outputs, records and errors as [`Target::verify`]
    /// (plus [`TargetError::OutputShape`] for `ids` shorter than `rows * cols` and
    /// [`TargetError::EmptyBatch`] when `columns` and `seqs` differ in length).
    fn verify_device(
        &mut self,
        be: &Backend,
        batch: &DeviceVerifyBatch<'_>,
    ) -> Result<(), TargetError> {
        let rows = batch.seqs.len();
        if batch.columns.len() != rows {
            return Err(TargetError::EmptyBatch);
        }
        let need = rows.saturating_mul(batch.cols);
        if batch.ids.len() < need {
            return Err(TargetError::OutputShape {
                tensor: "ids",
                expected: need,
                found: batch.ids.len(),
            });
        }
        let ids = be.read(batch.ids, 0, need)?;
        let mut tokens = Vec::with_capacity(rows);
        for (r, &q) in batch.columns.iter().enumerate() {
            if q > batch.cols {
                return Err(TargetError::WidthTooSmall {
                    row: r,
                    columns: q,
                    width: batch.cols,
                });
            }
            let row = &ids[r * batch.cols..r * batch.cols + q];
            let mut t = Vec::with_capacity(q);
            for (i, &id) in row.iter().enumerate() {
                t.push(u32::try_from(id).map_err(|_| TargetError::TokenOutOfRange {
                    row: r,
                    column: i,
                    token: u32::MAX,
                    vocab_rows: self.info().vocab_rows,
                })?);
            }
            tokens.push(t);
        }
        let vrows: Vec<VerifyRow<'_>> = batch
            .seqs
            .iter()
            .zip(&tokens)
            .map(|(&s, t)| VerifyRow::chain(s, t))
            .collect();
        self.verify(
            be,
            &VerifyBatch {
                rows: &vrows,
                cols: batch.cols,
            },
        )
    }

    /// The outputs of the last successful [`Target::verify`], lent in place (no copy); valid
    /// until the next verify (a commit or release does not change them).
    /// [`TargetError::NothingVerified`] before the first.
    fn verified(&self) -> Result<VerifyView<'_>, TargetError>;

    /// Adopt columns of each named sequence's pending verify (distinct sequences), folding the
    /// retained records; all commits are validated before any is applied.
    fn commit(&mut self, commits: &[Commit]) -> Result<(), TargetError>;

    /// A new sequence with a copy of `seq`'s committed state (refused while records are pending).
    fn fork(&mut self, seq: SeqHandle) -> Result<SeqHandle, TargetError>;

    /// An image of `seq`'s committed state with its frontier (refused while records are pending).
    fn checkpoint(&self, seq: SeqHandle) -> Result<Self::Checkpoint, TargetError>;

    /// Replace `seq`'s committed state by `image` (its frontier travels with it); refused while
    /// records are pending or when the image does not fit this target.
    fn restore(&mut self, seq: SeqHandle, image: &Self::Checkpoint) -> Result<(), TargetError>;

    /// Forget `seq` (pending records included); the handle becomes unknown.
    fn release(&mut self, seq: SeqHandle) -> Result<(), TargetError>;

    /// [`Target::create`] then [`Target::prefill`]; the new sequence is released again if the
    /// prefill is refused.
    fn create_with_prompt(
        &mut self,
        be: &Backend,
        prompt: &[u32],
    ) -> Result<(SeqHandle, PrefillOutput), TargetError> {
        let seq = self.create()?;
        match self.prefill(be, seq, prompt) {
            Ok(out) => Ok((seq, out)),
            Err(e) => {
                // The sequence was created by this call; releasing it cannot meaningfully fail.
                let _ = self.release(seq);
                Err(e)
            }
        }
    }
}

/// Everything a [`Target`] call can refuse.
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    /// The handle names no live sequence of this target.
    #[error("unknown sequence {seq}")]
    UnknownSequence {
        /// The handle passed.
        seq: SeqHandle,
    },
    /// The same sequence appears twice in one verify batch or commit list.
    #[error("sequence {seq} appears more than once in one call")]
    DuplicateSequence {
        /// The repeated handle.
        seq: SeqHandle,
    },
    /// A commit named a sequence that has no pending verify records.
    #[error("commit of {seq}: no pending verify")]
    NoPendingVerify {
        /// The sequence.
        seq: SeqHandle,
    },
    /// The call needs a sequence without pending verify records (commit or release first).
    #[error("{seq} has a pending verify of {columns} columns: commit it (N = 0 releases) first")]
    VerifyPending {
        /// The sequence.
        seq: SeqHandle,
        /// Live columns of the pending verify.
        columns: usize,
    },
    /// A commit asked for more rows than the verify had live columns.
    #[error("commit of {seq}: {rows} rows requested, the verify had {columns} live columns")]
    CommitTooLong {
        /// The sequence.
        seq: SeqHandle,
        /// Rows requested.
        rows: usize,
        /// Live columns `Q` of the pending verify.
        columns: usize,
    },
    /// An [`Accepted::Path`] is not a root-to-node path of the verified columns.
    #[error("commit of {seq}: invalid accepted path {path:?}: {reason}")]
    InvalidPath {
        /// The sequence.
        seq: SeqHandle,
        /// The path passed.
        path: Vec<u32>,
        /// What is wrong with it.
        reason: String,
    },
    /// A verify input token is not below the embedding rows.
    #[error(
        "verify row {row} column {column}: token {token} is not below the {vocab_rows} embedding rows"
    )]
    TokenOutOfRange {
        /// Batch row.
        row: usize,
        /// Column within the row.
        column: usize,
        /// The token id.
        token: u32,
        /// The embedding rows.
        vocab_rows: usize,
    },
    /// A prefill token is not below the embedding rows.
    #[error("prefill token {index}: {token} is not below the {vocab_rows} embedding rows")]
    PromptTokenOutOfRange {
        /// Index in the prefilled tokens.
        index: usize,
        /// The token id.
        token: u32,
        /// The embedding rows.
        vocab_rows: usize,
    },
    /// A verify batch with no rows.
    #[error("verify batch has no rows")]
    EmptyBatch,
    /// A verify row with no columns (every row has at least its anchor).
    #[error("verify row {row} has no columns (the anchor is required)")]
    EmptyRow {
        /// Batch row.
        row: usize,
    },
    /// A prefill with no tokens.
    #[error("prefill of {seq} with no tokens")]
    EmptyPrompt {
        /// The sequence.
        seq: SeqHandle,
    },
    /// A row has more live columns than the batch's physical width.
    #[error("verify row {row}: {columns} live columns exceed the batch width {width}")]
    WidthTooSmall {
        /// Batch row.
        row: usize,
        /// Live columns of the row.
        columns: usize,
        /// The batch width.
        width: usize,
    },
    /// A parent index list of the wrong length or with a parent not before its child.
    #[error("verify row {row}: bad parents: {reason}")]
    BadParents {
        /// Batch row.
        row: usize,
        /// What is wrong.
        reason: String,
    },
    /// This target verifies chains only and the row is a non-chain tree.
    #[error("verify row {row}: tree verification is not supported by this target")]
    TreeUnsupported {
        /// Batch row.
        row: usize,
    },
    /// The sequence would pass the target's position capacity.
    #[error(
        "{seq}: frontier {frontier} + {columns} columns exceeds the capacity of {max_positions} positions"
    )]
    CapacityExceeded {
        /// The sequence.
        seq: SeqHandle,
        /// Its frontier.
        frontier: usize,
        /// Columns requested.
        columns: usize,
        /// The capacity.
        max_positions: usize,
    },
    /// [`Target::verified`] before any verify.
    #[error("no verify has run yet: there are no verify outputs to lend")]
    NothingVerified,
    /// An output buffer is too short for the batch.
    #[error("output `{tensor}` must have at least {expected} elements, found {found}")]
    OutputShape {
        /// The output name.
        tensor: &'static str,
        /// The element count the batch needs.
        expected: usize,
        /// Found element count.
        found: usize,
    },
    /// An output buffer lives on another backend than the call.
    #[error("output `{tensor}` lives on the {found} backend, the call runs on {expected}")]
    WrongBackend {
        /// The output name.
        tensor: &'static str,
        /// The call's backend.
        expected: &'static str,
        /// The buffer's backend.
        found: &'static str,
    },
    /// A checkpoint image does not fit this target.
    #[error("checkpoint does not fit this target: {reason}")]
    IncompatibleCheckpoint {
        /// What differs.
        reason: String,
    },
    /// A backend operation (allocation, upload) failed.
    #[error(transparent)]
    Backend(#[from] OpsError),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_detection_and_commit_rows() {
        let s = SeqHandle::from_raw(3);
        let toks = [1u32, 2, 3];
        assert!(VerifyRow::chain(s, &toks).is_chain());
        let chain = [0u32, 1];
        let tree = [0u32, 0];
        let explicit = VerifyRow {
            seq: s,
            tokens: &toks,
            parents: Some(&chain),
        };
        assert!(explicit.is_chain());
        let branching = VerifyRow {
            parents: Some(&tree),
            ..explicit
        };
        assert!(!branching.is_chain());
        assert_eq!(Commit::prefix(s, 4).rows(), 4);
        let path = Commit {
            seq: s,
            accepted: Accepted::Path(vec![0, 1]),
        };
        assert_eq!(path.rows(), 2);
        assert_eq!(s.to_string(), "seq#3");
        let info = TargetInfo {
            hidden: 64,
            layers: 8,
            vocab_rows: 512,
            public_vocab: 500,
            capture_ids: vec![1, 3, 6],
            max_positions: 4096,
            supports_trees: false,
        };
        assert_eq!(info.feature_width(), 192);
    }
}
