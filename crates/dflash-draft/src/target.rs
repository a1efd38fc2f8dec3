//! Target parts the draft uses, passed in by the embedding engine (the draft never loads or
//! owns them): the token embedding and the proposal head (the full Text output head, or an
//! indexed shortlist gathered from it with its row -> global id map).

use dflash_ops::proposal_argmax::ProposalHead as OpsHead;
use dflash_ops::{Buffer, bf16};

use crate::{DraftError, Result};

/// The proposal head the caller lends.
#[derive(Debug, Clone, Copy)]
pub enum HeadParts<'a> {
    /// The target's full output head `[vocab_rows, H]` BF16; rows `public_vocab..` are never
    /// proposed.
    Full {
        /// `lm_head.weight`.
        output_head: &'a Buffer<bf16>,
    },
    /// A shortlist `[rows, H]` BF16 gathered from the output head, with `token_ids: [rows]`
    /// I32 (unique, each below the public vocabulary).
    Indexed {
        /// The shortlist rows.
        rows: &'a Buffer<bf16>,
        /// Row -> global token id.
        token_ids: &'a Buffer<i32>,
    },
}

/// The target parts of one draft forward, borrowed from the caller.
#[derive(Debug, Clone, Copy)]
pub struct TargetParts<'a> {
    /// Rows of the embedding (and of the full output head): 248320 for Qwen3.5.
    pub vocab_rows: usize,
    /// Public vocabulary size (248077 for Qwen3.5): ids at or above it are never proposed.
    pub public_vocab: usize,
    /// The target's token embedding `[vocab_rows, H]` BF16.
    pub embedding: &'a Buffer<bf16>,
    /// The proposal head.
    pub head: HeadParts<'a>,
}

/// Shape of a proposal head, as a workspace plans it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadShape {
    /// Full or indexed.
    pub kind: OpsHead,
    /// Logit rows per column: `vocab_rows` (full) or the shortlist rows (indexed).
    pub rows: usize,
    /// Public vocabulary size.
    pub public_vocab: usize,
}

impl TargetParts<'_> {
    /// The head's shape.
    pub fn head_shape(&self, hidden: usize) -> HeadShape {
        match self.head {
            HeadParts::Full { .. } => HeadShape {
                kind: OpsHead::Full,
                rows: self.vocab_rows,
                public_vocab: self.public_vocab,
            },
            HeadParts::Indexed { rows, .. } => HeadShape {
                kind: OpsHead::Indexed,
                rows: rows.len() / hidden.max(1),
                public_vocab: self.public_vocab,
            },
        }
    }

    /// The head's weight rows.
    pub fn head_weight(&self) -> &Buffer<bf16> {
        match self.head {
            HeadParts::Full { output_head } => output_head,
            HeadParts::Indexed { rows, .. } => rows,
        }
    }

    /// The indexed head's id map (None for the full head).
    pub fn token_ids(&self) -> Option<&Buffer<i32>> {
        match self.head {
            HeadParts::Full { .. } => None,
            HeadParts::Indexed { token_ids, .. } => Some(token_ids),
        }
    }

    /// Check the lengths against hidden width `hidden` and the draft's vocabulary rows
    /// (`expected_vocab_rows`, the target's embedding rows the draft was validated against).
    /// The indexed head's ids are checked by the ops on the CPU (uniqueness, range); on CUDA
    /// they are the caller's guarantee.
    pub fn check(&self, hidden: usize, expected_vocab_rows: usize) -> Result<()> {
        let bad =
            |part: &'static str, problem: String| Err(DraftError::TargetPart { part, problem });
        if self.vocab_rows != expected_vocab_rows {
            return bad(
                "vocab_rows",
                format!(
                    "the draft was validated against {expected_vocab_rows} embedding rows, found {}",
                    self.vocab_rows
                ),
            );
        }
        if self.public_vocab == 0 || self.public_vocab > self.vocab_rows {
            return bad(
                "public_vocab",
                format!(
                    "expected 1..={}, found {}",
                    self.vocab_rows, self.public_vocab
                ),
            );
        }
        let full = self.vocab_rows.saturating_mul(hidden);
        if self.embedding.len() != full {
            return bad(
                "embedding",
                format!(
                    "expected [{}, {hidden}] = {full} elements, found {}",
                    self.vocab_rows,
                    self.embedding.len()
                ),
            );
        }
        match self.head {
            HeadParts::Full { output_head } => {
                if output_head.len() != full {
                    return bad(
                        "output_head",
                        format!(
                            "expected [{}, {hidden}] = {full} elements, found {}",
                            self.vocab_rows,
                            output_head.len()
                        ),
                    );
                }
            }
            HeadParts::Indexed { rows, token_ids } => {
                let n = token_ids.len();
                if n == 0 || n.checked_mul(hidden) != Some(rows.len()) {
                    return bad(
                        "shortlist",
                        format!(
                            "rows must be [token_ids.len() = {n} >= 1, {hidden}] BF16, found {} elements",
                            rows.len()
                        ),
                    );
                }
                if n > self.public_vocab {
                    return bad(
                        "token_ids",
                        format!(
                            "{n} unique ids cannot all lie below the public vocabulary {}",
                            self.public_vocab
                        ),
                    );
                }
            }
        }
        Ok(())
    }
}
