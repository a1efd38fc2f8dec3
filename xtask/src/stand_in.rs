//! What the GPU-resident stand-in targets of the conformance checks and the benchmark share:
//! their sequences' bookkeeping (frontier and pending verify columns, no model state) and the
//! refusal of state images.
#![allow(dead_code)] // reason: the benchmark and the conformance runner each use a subset

use std::collections::HashMap;

use dflash_engine::{Commit, SeqHandle, TargetCheckpoint, TargetError};

/// The image type of the stand-ins: they keep no state images.
pub struct NoImage;

impl TargetCheckpoint for NoImage {
    fn frontier(&self) -> usize {
        0
    }
    fn size_bytes(&self) -> usize {
        0
    }
}

/// The `fork`, `checkpoint` and `restore` of a stand-in target (`type Checkpoint = NoImage`):
/// refused, it keeps no state images.
macro_rules! refuse_state_images {
    () => {
        fn fork(&mut self, _seq: SeqHandle) -> Result<SeqHandle, TargetError> {
            Err($crate::stand_in::no_images())
        }
        fn checkpoint(&self, _seq: SeqHandle) -> Result<NoImage, TargetError> {
            Err($crate::stand_in::no_images())
        }
        fn restore(&mut self, _seq: SeqHandle, _image: &NoImage) -> Result<(), TargetError> {
            Err($crate::stand_in::no_images())
        }
    };
}

/// The refusal of `fork`, `checkpoint` and `restore`.
pub fn no_images() -> TargetError {
    TargetError::IncompatibleCheckpoint {
        reason: "a stand-in target keeps no state images".into(),
    }
}

/// Per live sequence: its frontier and the live columns of its pending verify.
#[derive(Default)]
pub struct Sequences {
    seqs: HashMap<u64, (usize, Option<usize>)>,
    issued: u64,
}

impl Sequences {
    /// A new sequence at frontier 0 (handles count from 1).
    pub fn create(&mut self) -> SeqHandle {
        self.issued += 1;
        let h = SeqHandle::from_raw(self.issued);
        self.seqs.insert(h.raw(), (0, None));
        h
    }

    /// `(frontier, pending columns)`, or `UnknownSequence`.
    pub fn get(&self, seq: SeqHandle) -> Result<(usize, Option<usize>), TargetError> {
        self.seqs
            .get(&seq.raw())
            .copied()
            .ok_or(TargetError::UnknownSequence { seq })
    }

    /// A prefill of `n` tokens: the frontier advances.
    pub fn prefill(&mut self, seq: SeqHandle, n: usize) -> Result<(), TargetError> {
        let (f, pending) = self.get(seq)?;
        if let Some(columns) = pending {
            return Err(TargetError::VerifyPending { seq, columns });
        }
        self.seqs.insert(seq.raw(), (f + n, None));
        Ok(())
    }

    /// A verify of `(sequence, live columns)` rows: each must be known with nothing pending
    /// (checked for all before any changes).
    pub fn verify(&mut self, rows: &[(SeqHandle, usize)]) -> Result<(), TargetError> {
        for &(seq, _) in rows {
            if let (_, Some(columns)) = self.get(seq)? {
                return Err(TargetError::VerifyPending { seq, columns });
            }
        }
        for &(seq, q) in rows {
            if let Some(s) = self.seqs.get_mut(&seq.raw()) {
                s.1 = Some(q);
            }
        }
        Ok(())
    }

    /// Commit: each named sequence's frontier advances by its rows (all checked first).
    pub fn commit(&mut self, commits: &[Commit]) -> Result<(), TargetError> {
        for c in commits {
            match self.get(c.seq)? {
                (_, None) => return Err(TargetError::NoPendingVerify { seq: c.seq }),
                (_, Some(q)) if c.rows() > q => {
                    return Err(TargetError::CommitTooLong {
                        seq: c.seq,
                        rows: c.rows(),
                        columns: q,
                    });
                }
                _ => {}
            }
        }
        for c in commits {
            if let Some(s) = self.seqs.get_mut(&c.seq.raw()) {
                *s = (s.0 + c.rows(), None);
            }
        }
        Ok(())
    }

    /// Forget a sequence.
    pub fn release(&mut self, seq: SeqHandle) -> Result<(), TargetError> {
        self.seqs
            .remove(&seq.raw())
            .map(|_| ())
            .ok_or(TargetError::UnknownSequence { seq })
    }

    /// Forget every sequence and start the handles over.
    pub fn clear(&mut self) {
        self.seqs.clear();
        self.issued = 0;
    }
}
