//! The one error type of `dflash-verify`.

use dflash_ops::OpsError;

/// Which input a refused token id came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenRole {
    /// The row's anchor `a`.
    Anchor,
    /// Proposal `d_j` (1-based, as in the specification).
    Proposal(usize),
    /// Candidate `slot` (0..16) of the retained top-16 q of proposal column `column` (0-based:
    /// the q that proposed `d_(column+1)`).
    Candidate {
        /// Proposal column (0-based).
        column: usize,
        /// Slot within the 16 retained candidates.
        slot: usize,
    },
    /// A token pushed into a [`TokenHistory`](crate::TokenHistory).
    History,
}

impl std::fmt::Display for TokenRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenRole::Anchor => f.write_str("anchor"),
            TokenRole::Proposal(j) => write!(f, "proposal d_{j}"),
            TokenRole::Candidate { column, slot } => {
                write!(f, "candidate slot {slot} of proposal column {column}")
            }
            TokenRole::History => f.write_str("history token"),
        }
    }
}

/// What is wrong with a retained top-16 proposal distribution.
#[derive(Clone, Debug, PartialEq)]
pub enum QFault {
    /// A probability is negative.
    Negative {
        /// The slot.
        slot: usize,
        /// The value.
        value: f32,
    },
    /// A probability is NaN or infinite.
    NonFinite {
        /// The slot.
        slot: usize,
        /// The value.
        value: f32,
    },
    /// The 16 probabilities do not sum to 1 within [`Q_SUM_TOLERANCE`](crate::Q_SUM_TOLERANCE).
    Sum {
        /// The f64 sum of the 16 values.
        sum: f64,
    },
    /// Two slots hold the same candidate id.
    DuplicateId {
        /// The repeated id.
        token: u32,
        /// The first slot holding it.
        first: usize,
        /// The later slot holding it again.
        second: usize,
    },
    /// The proposal is not among the candidate ids.
    ProposalNotCandidate {
        /// The proposal.
        token: u32,
    },
    /// The proposal is a candidate but its q is 0 (it could not have been drawn).
    ProposalZeroMass {
        /// The proposal.
        token: u32,
        /// Its slot.
        slot: usize,
    },
}

impl std::fmt::Display for QFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            QFault::Negative { slot, value } => write!(f, "q[{slot}] = {value} is negative"),
            QFault::NonFinite { slot, value } => write!(f, "q[{slot}] = {value} is not finite"),
            QFault::Sum { sum } => write!(
                f,
                "q sums to {sum}, not 1 within {}",
                crate::Q_SUM_TOLERANCE
            ),
            QFault::DuplicateId {
                token,
                first,
                second,
            } => write!(
                f,
                "candidate id {token} appears in slots {first} and {second}"
            ),
            QFault::ProposalNotCandidate { token } => {
                write!(f, "the proposal {token} is not one of the 16 candidate ids")
            }
            QFault::ProposalZeroMass { token, slot } => {
                write!(f, "the proposal {token} (slot {slot}) has q = 0")
            }
        }
    }
}

/// Everything a verification call (or a [`TokenHistory`](crate::TokenHistory) update) can
/// refuse. Every refusal happens before anything is written: the workspace's device data and
/// every caller-owned value are as they were.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    /// A tree row's shape is wrong (parents, sizes, a repeated sibling token).
    #[error("row {row}: bad tree: {reason}")]
    BadTree {
        /// The row.
        row: usize,
        /// What is wrong.
        reason: String,
    },
    /// A device proposal buffer of [`crate::VerifyWorkspace::verify_device`] is too short
    /// for the batch.
    #[error("device proposals: `{tensor}` must hold at least {expected} elements, found {found}")]
    DeviceProposals {
        /// The buffer (`ids`, `candidates`, `q`).
        tensor: &'static str,
        /// Elements the batch reads.
        expected: usize,
        /// Elements it holds.
        found: usize,
    },
    /// A workspace shape parameter is out of range.
    #[error("verify workspace: `{param}` = {found}, expected {expected}")]
    Shape {
        /// The parameter.
        param: &'static str,
        /// What was passed.
        found: usize,
        /// What is allowed.
        expected: String,
    },
    /// The batch has more rows than the workspace was sized for.
    #[error("verify batch has {rows} rows, the workspace holds at most {max_rows}")]
    BatchTooLarge {
        /// Rows passed.
        rows: usize,
        /// The workspace's row capacity B.
        max_rows: usize,
    },
    /// The logits buffer does not hold the batch's live columns in its layout: padded, whole
    /// `[cols, vocab_rows]` rows, at least `rows` of them; packed, whole `vocab_rows` columns,
    /// at least the rows' `P + 1` live columns together.
    #[error(
        "{layout} logits hold {found} elements, expected a whole number of {unit}-element units, at least {expected} (rows={rows}, cols={cols}, vocab_rows={vocab_rows})"
    )]
    LogitsLength {
        /// Elements found.
        found: usize,
        /// The fewest elements the batch needs.
        expected: usize,
        /// Elements of one unit (a padded row or a vocabulary column).
        unit: usize,
        /// The layout the logits were passed in.
        layout: crate::LogitsLayout,
        /// Batch rows.
        rows: usize,
        /// Workspace columns W.
        cols: usize,
        /// Vocabulary rows.
        vocab_rows: usize,
    },
    /// A row has more proposals than the workspace's `K = W - 1` (so `P + 1` live columns do
    /// not fit in the `W` verify columns).
    #[error("row {row}: {proposals} proposals, at most K = {max} fit the {max}+1 verify columns")]
    TooManyProposals {
        /// Batch row.
        row: usize,
        /// P passed.
        proposals: usize,
        /// K = W - 1.
        max: usize,
    },
    /// A token id is not below the vocabulary rows.
    #[error("row {row}: {role} {token} is not below the {vocab_rows} vocabulary rows")]
    TokenOutOfRange {
        /// Batch row (0 for a history update).
        row: usize,
        /// Which input.
        role: TokenRole,
        /// The id.
        token: u32,
        /// Vocabulary rows.
        vocab_rows: usize,
    },
    /// A token id lies in the padded, non-public tail of the vocabulary (never a real token).
    #[error(
        "row {row}: {role} {token} is in the non-public tail (public vocabulary {public_vocab})"
    )]
    NonPublicToken {
        /// Batch row.
        row: usize,
        /// Which input.
        role: TokenRole,
        /// The id.
        token: u32,
        /// The public vocabulary size.
        public_vocab: usize,
    },
    /// The row's history was built for another vocabulary size.
    #[error(
        "row {row}: token history is for {found} vocabulary rows, the workspace has {expected}"
    )]
    HistoryVocab {
        /// Batch row.
        row: usize,
        /// The workspace's vocabulary rows.
        expected: usize,
        /// The history's vocabulary rows.
        found: usize,
    },
    /// The history does not hold exactly the `F + 1` tokens `x_0 ..= x_F`.
    #[error(
        "row {row}: token history holds {len} tokens, expected frontier + 1 = {expected} (prompt and published outputs through the anchor)"
    )]
    HistoryLength {
        /// Batch row.
        row: usize,
        /// Tokens in the history.
        len: u64,
        /// `F + 1`.
        expected: u64,
    },
    /// The anchor is not the last token of the history.
    #[error("row {row}: anchor {anchor} is not the history's last token {last:?}")]
    AnchorMismatch {
        /// Batch row.
        row: usize,
        /// The anchor passed.
        anchor: u32,
        /// The history's last token.
        last: Option<u32>,
    },
    /// The frontier does not fit the device position format (`F + W` must stay below 2^31).
    #[error("row {row}: frontier {frontier} is too large (at most {max})")]
    FrontierTooLarge {
        /// Batch row.
        row: usize,
        /// The frontier.
        frontier: u64,
        /// The largest frontier the workspace accepts.
        max: u64,
    },
    /// A row's proposal distribution is of the other kind than the workspace's.
    #[error("row {row}: proposal distribution is {found}, the workspace verifies {expected}")]
    ProposalKind {
        /// Batch row.
        row: usize,
        /// The workspace's kind.
        expected: &'static str,
        /// The row's kind.
        found: &'static str,
    },
    /// A top-16 row does not carry exactly one retained q per proposal.
    #[error("row {row}: {found} retained q columns for {proposals} proposals")]
    QColumns {
        /// Batch row.
        row: usize,
        /// P.
        proposals: usize,
        /// q columns passed.
        found: usize,
    },
    /// A retained top-16 q is not a distribution, or could not have produced the proposal.
    #[error("row {row}, proposal column {column}: {fault}")]
    QNotDistribution {
        /// Batch row.
        row: usize,
        /// Proposal column (0-based; the q that proposed `d_(column+1)`).
        column: usize,
        /// What is wrong.
        fault: QFault,
    },
    /// A sampling setting is out of range.
    #[error("row {row}: {setting} = {value}, expected {expected}")]
    BadSetting {
        /// Batch row.
        row: usize,
        /// The setting's name.
        setting: &'static str,
        /// The value (widened).
        value: f64,
        /// What is allowed.
        expected: &'static str,
    },
    /// A public logit of a live column is NaN or `+inf`, or every public logit of a live
    /// column is `-inf` (then `token` is 0). Checked on the CPU backend only.
    #[error(
        "row {row}, column {column}: logit of token {token} is {value} (NaN and +inf are refused)"
    )]
    BadLogit {
        /// Batch row.
        row: usize,
        /// Verify column.
        column: usize,
        /// The token.
        token: usize,
        /// The value.
        value: f32,
    },
    /// A token history count would exceed the device count format (`i32::MAX`).
    #[error("token history: count of token {token} would exceed {max}")]
    CountOverflow {
        /// The token.
        token: u32,
        /// The largest count.
        max: u32,
    },
    /// The device returned an outcome that breaks the acceptance contract (a backend bug).
    #[error("row {row}: inconsistent device outcome: {reason}")]
    DeviceOutcome {
        /// Batch row.
        row: usize,
        /// What is inconsistent.
        reason: String,
    },
    /// An op or buffer operation failed (a CUDA error, or an op-level refusal such as processed
    /// logits overflowing f32 under a tiny temperature).
    #[error(transparent)]
    Ops(#[from] OpsError),
}

/// Result alias of this crate.
pub type Result<T, E = VerifyError> = std::result::Result<T, E>;
