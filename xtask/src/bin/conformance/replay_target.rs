//! A GPU-resident stand-in target for timing the engine's round: [`Recorder`] wraps the CPU
//! reference target and keeps a device copy of every prefill and verify output it makes;
//! [`ReplayTarget`] then serves those copies in the same order from device memory: a verify
//! copies the recorded logits into the one logits buffer it lends (as a real target's forward
//! writes its own; so the engine's verification sees one address and replays its graphs) and
//! lends the recorded features in place. Replaying the recorded run's
//! requests (greedy, or sampled with the same seeds) reproduces its rounds exactly; a verify
//! whose input tokens differ from the recorded ones marks the replay as diverged.

use dflash_engine::TargetLogits;
use dflash_engine::{
    Commit, DeviceVerifyBatch, PrefillOutput, SeqHandle, Target, TargetError, TargetInfo,
    VerifyBatch, VerifyView,
};
use dflash_ops::target_distribution::Logits;
use dflash_ops::{Backend, Buffer, Element, bf16};
use dflash_testkit::ReferenceTarget;

use crate::stand_in::{NoImage, Sequences};

/// A device copy of `src` (an allocation: recording and admission only).
fn copy_of<T: Element>(be: &Backend, src: &Buffer<T>) -> Result<Buffer<T>, TargetError> {
    let mut out = be.zeros(src.len())?;
    be.copy(src, 0, &mut out, 0, src.len())?;
    Ok(out)
}

struct Prefilled {
    features: Buffer<bf16>,
    last_logits: Buffer<f32>,
}

struct Verified {
    /// Each row's input tokens, in batch order.
    tokens: Vec<Vec<u32>>,
    logits: Buffer<f32>,
    features: Buffer<bf16>,
}

/// The reference target, recording device copies of its outputs.
pub struct Recorder {
    inner: ReferenceTarget,
    prefills: Vec<Prefilled>,
    verifies: Vec<Verified>,
}

impl Recorder {
    pub fn new(inner: ReferenceTarget) -> Self {
        Recorder {
            inner,
            prefills: Vec::new(),
            verifies: Vec::new(),
        }
    }

    /// The stand-in target serving what was recorded (its lent logits buffer allocated on
    /// `be`, as long as the longest recorded logits).
    pub fn into_replay(self, be: &Backend) -> Result<ReplayTarget, TargetError> {
        let longest = self
            .verifies
            .iter()
            .map(|v| v.logits.len())
            .max()
            .unwrap_or(0);
        Ok(ReplayTarget {
            lent: be.zeros(longest)?,
            info: self.inner.info().clone(),
            prefills: self.prefills,
            next_prefill: 0,
            verifies: self.verifies,
            next: 0,
            current: None,
            seqs: Sequences::default(),
            diverged: false,
            check_ids: false,
            ids_checked: 0,
        })
    }
}

impl Target for Recorder {
    type Checkpoint = NoImage;
    fn info(&self) -> &TargetInfo {
        self.inner.info()
    }
    fn create(&mut self) -> Result<SeqHandle, TargetError> {
        self.inner.create()
    }
    fn prefill(
        &mut self,
        be: &Backend,
        seq: SeqHandle,
        tokens: &[u32],
    ) -> Result<PrefillOutput, TargetError> {
        let out = self.inner.prefill(be, seq, tokens)?;
        self.prefills.push(Prefilled {
            features: copy_of(be, &out.features)?,
            last_logits: copy_of(be, &out.last_logits)?,
        });
        Ok(out)
    }
    fn frontier(&self, seq: SeqHandle) -> Result<usize, TargetError> {
        self.inner.frontier(seq)
    }
    fn pending(&self, seq: SeqHandle) -> Result<Option<usize>, TargetError> {
        self.inner.pending(seq)
    }
    fn verify(&mut self, be: &Backend, batch: &VerifyBatch<'_>) -> Result<(), TargetError> {
        self.inner.verify(be, batch)?;
        let view = self.inner.verified()?;
        let Logits::F32(logits) = view.logits.values else {
            return Err(TargetError::OutputShape {
                tensor: "logits",
                expected: 0,
                found: 0,
            });
        };
        self.verifies.push(Verified {
            tokens: batch.rows.iter().map(|r| r.tokens.to_vec()).collect(),
            logits: copy_of(be, logits)?,
            features: copy_of(be, view.features)?,
        });
        Ok(())
    }
    fn verified(&self) -> Result<VerifyView<'_>, TargetError> {
        self.inner.verified()
    }
    fn commit(&mut self, commits: &[Commit]) -> Result<(), TargetError> {
        self.inner.commit(commits)
    }
    refuse_state_images!();
    fn release(&mut self, seq: SeqHandle) -> Result<(), TargetError> {
        self.inner.release(seq)
    }
}

/// Serves a [`Recorder`]'s outputs from device memory, in recorded order.
pub struct ReplayTarget {
    info: TargetInfo,
    prefills: Vec<Prefilled>,
    next_prefill: usize,
    verifies: Vec<Verified>,
    /// The logits buffer every verify lends (the current recording copied to its start).
    lent: Buffer<f32>,
    next: usize,
    current: Option<usize>,
    seqs: Sequences,
    diverged: bool,
    /// Whether `verify_device` reads the input ids back and compares them with the recording.
    check_ids: bool,
    /// Device verifies whose ids were read back and compared.
    ids_checked: usize,
}

impl ReplayTarget {
    /// Read every device verify's input ids back (one synchronize each) and compare them with
    /// the recorded tokens: a mismatch marks the replay diverged.
    pub fn check_ids(&mut self, on: bool) {
        self.check_ids = on;
    }

    /// Device verifies whose input ids were read back and compared.
    pub fn ids_checked(&self) -> usize {
        self.ids_checked
    }

    /// Whether a verify's inputs differed from the recording (the replay is then invalid).
    pub fn diverged(&self) -> bool {
        self.diverged
    }

    /// Serve the recording again from its start (every sequence forgotten).
    pub fn rewind(&mut self) {
        self.next_prefill = 0;
        self.next = 0;
        self.current = None;
        self.seqs.clear();
        self.diverged = false;
        self.ids_checked = 0;
    }

    /// Take the next recorded verify for `(sequence, live columns)` rows (each known, nothing
    /// pending); marks the replay diverged when the recording's rows differ (`same`).
    fn next_verify(
        &mut self,
        be: &Backend,
        rows: &[(SeqHandle, usize)],
        same: impl Fn(&Verified) -> bool,
    ) -> Result<(), TargetError> {
        let i = self.next;
        let Some(v) = self.verifies.get(i) else {
            self.diverged = true;
            return Err(TargetError::NothingVerified);
        };
        if v.tokens.len() != rows.len() || !same(v) {
            self.diverged = true;
        }
        self.seqs.verify(rows)?;
        be.copy(&v.logits, 0, &mut self.lent, 0, v.logits.len())?;
        self.next += 1;
        self.current = Some(i);
        Ok(())
    }
}

impl Target for ReplayTarget {
    type Checkpoint = NoImage;
    fn info(&self) -> &TargetInfo {
        &self.info
    }
    fn create(&mut self) -> Result<SeqHandle, TargetError> {
        Ok(self.seqs.create())
    }
    fn prefill(
        &mut self,
        be: &Backend,
        seq: SeqHandle,
        tokens: &[u32],
    ) -> Result<PrefillOutput, TargetError> {
        self.seqs.get(seq)?;
        let Some(p) = self.prefills.get(self.next_prefill) else {
            self.diverged = true;
            return Err(TargetError::EmptyPrompt { seq });
        };
        self.next_prefill += 1;
        if p.features.len() != tokens.len() * self.info.feature_width() {
            self.diverged = true;
        }
        let out = PrefillOutput {
            features: copy_of(be, &p.features)?,
            last_logits: copy_of(be, &p.last_logits)?,
        };
        self.seqs.prefill(seq, tokens.len())?;
        Ok(out)
    }
    fn frontier(&self, seq: SeqHandle) -> Result<usize, TargetError> {
        Ok(self.seqs.get(seq)?.0)
    }
    fn pending(&self, seq: SeqHandle) -> Result<Option<usize>, TargetError> {
        Ok(self.seqs.get(seq)?.1)
    }
    fn verify(&mut self, be: &Backend, batch: &VerifyBatch<'_>) -> Result<(), TargetError> {
        let rows: Vec<_> = batch.rows.iter().map(|r| (r.seq, r.tokens.len())).collect();
        self.next_verify(be, &rows, |v| {
            v.tokens.iter().zip(batch.rows).all(|(t, r)| t == r.tokens)
        })
    }
    /// A device round's verify: nothing is read (the input ids stay unread, as a target
    /// that embeds from device ids would leave them); the live column counts must match the
    /// recording (a divergence also shows in the outputs, which the check compares).
    fn verify_device(
        &mut self,
        be: &Backend,
        batch: &DeviceVerifyBatch<'_>,
    ) -> Result<(), TargetError> {
        let rows: Vec<_> = batch
            .seqs
            .iter()
            .copied()
            .zip(batch.columns.iter().copied())
            .collect();
        let ids = if self.check_ids {
            self.ids_checked += 1;
            Some(be.read(batch.ids, 0, rows.len() * batch.cols)?)
        } else {
            None
        };
        let cols = batch.cols;
        self.next_verify(be, &rows, |v| {
            v.tokens
                .iter()
                .zip(batch.columns)
                .enumerate()
                .all(|(r, (t, &q))| {
                    t.len() == q
                        && ids.as_ref().is_none_or(|ids| {
                            ids.get(r * cols..r * cols + q)
                                .is_some_and(|row| t.iter().zip(row).all(|(&a, &b)| a as i32 == b))
                        })
                })
        })
    }
    fn verified(&self) -> Result<VerifyView<'_>, TargetError> {
        let v = self
            .current
            .and_then(|i| self.verifies.get(i))
            .ok_or(TargetError::NothingVerified)?;
        Ok(VerifyView {
            logits: TargetLogits::padded(&self.lent),
            features: &v.features,
        })
    }
    fn commit(&mut self, commits: &[Commit]) -> Result<(), TargetError> {
        self.seqs.commit(commits)
    }
    refuse_state_images!();
    fn release(&mut self, seq: SeqHandle) -> Result<(), TargetError> {
        self.seqs.release(seq)
    }
}
