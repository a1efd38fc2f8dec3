//! The token history the penalties read.

use std::collections::BTreeMap;

use crate::{Result, TokenRole, VerifyError};

/// Counts of the tokens a request's penalties apply to, maintained incrementally.
///
/// Which tokens count: every token of the sequence at positions `0 ..= F`, that is the prompt
/// (all of it, in order) and then every published output token; the last token pushed is the
/// current unprocessed anchor `a = x_F`. So before a round the engine has pushed exactly
/// `F + 1` tokens ([`VerifyError::HistoryLength`] otherwise) and the last one is the row's
/// anchor ([`VerifyError::AnchorMismatch`] otherwise). After a round that publishes
/// `y_1 ..= y_N`, the engine pushes those `N` tokens (the new anchor `y_N` included) and the
/// frontier becomes `F + N`. The verification itself never changes a history: the accepted
/// proposals are added per column inside the round (column `i` sees the history plus
/// `d_1 ..= d_i`).
///
/// One count drives all three penalties (repetition, frequency, presence), as in the
/// `target_distribution` op: a token with count `c > 0` is penalized, the frequency penalty is
/// scaled by `c`.
///
/// Storage is sparse (one entry per distinct token), so a history costs memory in proportion to
/// its distinct tokens, not to the vocabulary.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenHistory {
    vocab_rows: usize,
    counts: BTreeMap<u32, u32>,
    len: u64,
    last: Option<u32>,
}

/// The largest count one token may reach (the device count format is i32).
pub const MAX_COUNT: u32 = i32::MAX as u32;

impl TokenHistory {
    /// An empty history for a vocabulary of `vocab_rows` rows (the padded vocabulary of the
    /// target's logits).
    pub fn new(vocab_rows: usize) -> Self {
        TokenHistory {
            vocab_rows,
            counts: BTreeMap::new(),
            len: 0,
            last: None,
        }
    }

    /// A history holding `tokens` (e.g. the prompt), in order.
    pub fn with_tokens(vocab_rows: usize, tokens: &[u32]) -> Result<Self> {
        let mut h = TokenHistory::new(vocab_rows);
        h.extend(tokens)?;
        Ok(h)
    }

    /// Append one token. Refused (history unchanged) when it is not below the vocabulary
    /// rows or its count would exceed [`MAX_COUNT`].
    pub fn push(&mut self, token: u32) -> Result<()> {
        self.extend(std::slice::from_ref(&token))
    }

    /// Append `tokens` in order; all or nothing (a refused call leaves the history unchanged).
    pub fn extend(&mut self, tokens: &[u32]) -> Result<()> {
        for &t in tokens {
            if t as usize >= self.vocab_rows {
                return Err(VerifyError::TokenOutOfRange {
                    row: 0,
                    role: TokenRole::History,
                    token: t,
                    vocab_rows: self.vocab_rows,
                });
            }
        }
        // Overflow check with the additions of this call counted (a token may repeat in it).
        let mut added: BTreeMap<u32, u64> = BTreeMap::new();
        for &t in tokens {
            *added.entry(t).or_insert(0) += 1;
        }
        for (&t, &n) in &added {
            if u64::from(self.count(t)) + n > u64::from(MAX_COUNT) {
                return Err(VerifyError::CountOverflow {
                    token: t,
                    max: MAX_COUNT,
                });
            }
        }
        for (t, n) in added {
            // n fits: checked above against MAX_COUNT.
            *self.counts.entry(t).or_insert(0) += n as u32;
        }
        self.len += tokens.len() as u64;
        if let Some(&t) = tokens.last() {
            self.last = Some(t);
        }
        Ok(())
    }

    /// Vocabulary rows this history was made for.
    pub fn vocab_rows(&self) -> usize {
        self.vocab_rows
    }

    /// Tokens pushed so far (with multiplicity): `F + 1` when the anchor at `F` is the last.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True when nothing was pushed.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The last token pushed (the anchor, between rounds).
    pub fn last(&self) -> Option<u32> {
        self.last
    }

    /// How often `token` occurs.
    pub fn count(&self, token: u32) -> u32 {
        self.counts.get(&token).copied().unwrap_or(0)
    }

    /// Number of distinct tokens.
    pub fn distinct(&self) -> usize {
        self.counts.len()
    }

    /// `(token, count)` of every distinct token, in increasing token order.
    pub fn iter(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.counts.iter().map(|(&t, &c)| (t, c))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn push_counts_tracks_len_and_last() {
        let mut h = TokenHistory::with_tokens(10, &[3, 4, 3]).expect("prompt");
        assert_eq!(
            (h.len(), h.last(), h.count(3), h.count(4), h.count(5)),
            (3, Some(3), 2, 1, 0)
        );
        h.push(9).expect("push");
        assert_eq!((h.len(), h.last(), h.distinct()), (4, Some(9), 3));
        assert_eq!(h.iter().collect::<Vec<_>>(), vec![(3, 2), (4, 1), (9, 1)]);
    }

    #[test]
    fn refused_extend_leaves_history_unchanged() {
        let mut h = TokenHistory::with_tokens(10, &[1, 2]).expect("prompt");
        let before = h.clone();
        assert!(matches!(
            h.extend(&[5, 10]),
            Err(VerifyError::TokenOutOfRange {
                token: 10,
                vocab_rows: 10,
                ..
            })
        ));
        assert_eq!(h, before);
    }

    #[test]
    fn count_overflow_is_refused() {
        let mut h = TokenHistory::new(4);
        h.counts.insert(2, MAX_COUNT - 1);
        h.push(2).expect("reaches the maximum");
        let before = h.clone();
        assert!(matches!(
            h.push(2),
            Err(VerifyError::CountOverflow { token: 2, .. })
        ));
        assert_eq!(h, before);
        let mut g = TokenHistory::new(4);
        g.counts.insert(1, MAX_COUNT - 1);
        assert!(g.extend(&[1, 1]).is_err(), "repeats within one call count");
        assert_eq!(g.count(1), MAX_COUNT - 1);
    }
}
