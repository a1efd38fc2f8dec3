//! A GPU-resident stand-in target for timing the engine's round: [`Recorder`] wraps the CPU
//! reference target and keeps a device copy of every prefill and verify output it makes;
//! [`ReplayTarget`] then serves those copies in the same order, lending them in place from
//! device memory (a verify costs nothing but bookkeeping). Replaying the recorded run's
//! requests (greedy, or sampled with the same seeds) reproduces its rounds exactly; a verify
//! whose input tokens differ from the recorded ones marks the replay as diverged.

use std::collections::HashMap;

use dflash_engine::TargetLogits;
use dflash_engine::{
    Commit, DeviceVerifyBatch, PrefillOutput, SeqHandle, Target, TargetCheckpoint, TargetError,
    TargetInfo, VerifyBatch, VerifyView,
};
use dflash_ops::target_distribution::Logits;
use dflash_ops::{Backend, Buffer, Element, bf16};
use dflash_testkit::ReferenceTarget;

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

    /// The stand-in target serving what was recorded.
    pub fn into_replay(self) -> ReplayTarget {
        ReplayTarget {
            info: self.inner.info().clone(),
            prefills: self.prefills,
            next_prefill: 0,
            verifies: self.verifies,
            next: 0,
            current: None,
            seqs: HashMap::new(),
            next_handle: 1,
            diverged: false,
        }
    }
}

/// The image type of the stand-ins: they keep no state images (checkpoints are refused).
pub struct NoImage;

impl TargetCheckpoint for NoImage {
    fn frontier(&self) -> usize {
        0
    }
    fn size_bytes(&self) -> usize {
        0
    }
}

fn no_images() -> TargetError {
    TargetError::IncompatibleCheckpoint {
        reason: "the recording stand-in target keeps no state images".into(),
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
    fn fork(&mut self, _seq: SeqHandle) -> Result<SeqHandle, TargetError> {
        Err(no_images())
    }
    fn checkpoint(&self, _seq: SeqHandle) -> Result<NoImage, TargetError> {
        Err(no_images())
    }
    fn restore(&mut self, _seq: SeqHandle, _image: &NoImage) -> Result<(), TargetError> {
        Err(no_images())
    }
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
    next: usize,
    current: Option<usize>,
    /// Per live sequence: frontier and pending live columns.
    seqs: HashMap<u64, (usize, Option<usize>)>,
    next_handle: u64,
    diverged: bool,
}

impl ReplayTarget {
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
        self.next_handle = 1;
        self.diverged = false;
    }

    fn seq(&self, seq: SeqHandle) -> Result<(usize, Option<usize>), TargetError> {
        self.seqs
            .get(&seq.raw())
            .copied()
            .ok_or(TargetError::UnknownSequence { seq })
    }
}

impl Target for ReplayTarget {
    type Checkpoint = NoImage;
    fn info(&self) -> &TargetInfo {
        &self.info
    }
    fn create(&mut self) -> Result<SeqHandle, TargetError> {
        let h = SeqHandle::from_raw(self.next_handle);
        self.next_handle += 1;
        self.seqs.insert(h.raw(), (0, None));
        Ok(h)
    }
    fn prefill(
        &mut self,
        be: &Backend,
        seq: SeqHandle,
        tokens: &[u32],
    ) -> Result<PrefillOutput, TargetError> {
        let (f, _) = self.seq(seq)?;
        let Some(p) = self.prefills.get(self.next_prefill) else {
            self.diverged = true;
            return Err(TargetError::EmptyPrompt { seq });
        };
        self.next_prefill += 1;
        if p.features.len() != tokens.len() * self.info.feature_width() {
            self.diverged = true;
        }
        self.seqs.insert(seq.raw(), (f + tokens.len(), None));
        Ok(PrefillOutput {
            features: copy_of(be, &p.features)?,
            last_logits: copy_of(be, &p.last_logits)?,
        })
    }
    fn frontier(&self, seq: SeqHandle) -> Result<usize, TargetError> {
        Ok(self.seq(seq)?.0)
    }
    fn pending(&self, seq: SeqHandle) -> Result<Option<usize>, TargetError> {
        Ok(self.seq(seq)?.1)
    }
    fn verify(&mut self, _be: &Backend, batch: &VerifyBatch<'_>) -> Result<(), TargetError> {
        for r in batch.rows {
            self.seq(r.seq)?;
        }
        let i = self.next;
        match self.verifies.get(i) {
            Some(v)
                if v.tokens.len() == batch.rows.len()
                    && v.tokens.iter().zip(batch.rows).all(|(t, r)| t == r.tokens) => {}
            _ => self.diverged = true,
        }
        if i >= self.verifies.len() {
            return Err(TargetError::NothingVerified);
        }
        for r in batch.rows {
            if let Some(s) = self.seqs.get_mut(&r.seq.raw()) {
                s.1 = Some(r.tokens.len());
            }
        }
        self.next += 1;
        self.current = Some(i);
        Ok(())
    }
    /// A device round's verify: nothing is read (the input ids stay unread, as a target
    /// that embeds from device ids would leave them); the live column counts must match the
    /// recording (a divergence shows in the outputs, which the check compares).
    fn verify_device(
        &mut self,
        _be: &Backend,
        batch: &DeviceVerifyBatch<'_>,
    ) -> Result<(), TargetError> {
        for &seq in batch.seqs {
            self.seq(seq)?;
        }
        let i = self.next;
        match self.verifies.get(i) {
            Some(v)
                if v.tokens.len() == batch.seqs.len()
                    && v.tokens
                        .iter()
                        .zip(batch.columns)
                        .all(|(t, &q)| t.len() == q) => {}
            _ => self.diverged = true,
        }
        if i >= self.verifies.len() {
            return Err(TargetError::NothingVerified);
        }
        for (&seq, &q) in batch.seqs.iter().zip(batch.columns) {
            if let Some(s) = self.seqs.get_mut(&seq.raw()) {
                s.1 = Some(q);
            }
        }
        self.next += 1;
        self.current = Some(i);
        Ok(())
    }

    fn verified(&self) -> Result<VerifyView<'_>, TargetError> {
        let v = self
            .current
            .and_then(|i| self.verifies.get(i))
            .ok_or(TargetError::NothingVerified)?;
        Ok(VerifyView {
            logits: TargetLogits::padded(&v.logits),
            features: &v.features,
        })
    }
    fn commit(&mut self, commits: &[Commit]) -> Result<(), TargetError> {
        for c in commits {
            let (f, pending) = self.seq(c.seq)?;
            if pending.is_none() {
                return Err(TargetError::NoPendingVerify { seq: c.seq });
            }
            self.seqs.insert(c.seq.raw(), (f + c.rows(), None));
        }
        Ok(())
    }
    fn fork(&mut self, _seq: SeqHandle) -> Result<SeqHandle, TargetError> {
        Err(no_images())
    }
    fn checkpoint(&self, _seq: SeqHandle) -> Result<NoImage, TargetError> {
        Err(no_images())
    }
    fn restore(&mut self, _seq: SeqHandle, _image: &NoImage) -> Result<(), TargetError> {
        Err(no_images())
    }
    fn release(&mut self, seq: SeqHandle) -> Result<(), TargetError> {
        self.seqs
            .remove(&seq.raw())
            .map(|_| ())
            .ok_or(TargetError::UnknownSequence { seq })
    }
}
