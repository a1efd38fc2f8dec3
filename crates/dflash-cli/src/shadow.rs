//! [`ShadowProposer`]: a test and demonstration [`Proposer`] that sees the target through a
//! private *shadow* copy of the reference target (loaded from the same checkpoint) and
//! proposes by a [`Strategy`]: the target's own greedy tokens with a chosen probability
//! (random public tokens otherwise), or a 16-candidate distribution reported truthfully or
//! deliberately wrongly. Its "context" is bookkeeping only (coverage counts), so the engine's
//! coverage protocol is still checked through it.

use std::collections::HashMap;

use dflash_engine::{
    Commit, Coverage, EngineError, MemoryPlan, Proposal, ProposalKind, ProposeRow, Proposer,
    RetainedQ, SeqHandle, Target, TargetInfo, VerifyBatch, VerifyRow,
};
use dflash_ops::target_distribution::Logits;
use dflash_ops::{Backend, Buffer, bf16};
use dflash_testkit::ReferenceTarget;
use dflash_testkit::fixtures::SplitMix64;

/// How a [`ShadowProposer`] proposes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Strategy {
    /// One-hot proposals: with probability `rho` the target's own greedy token for the
    /// position (given the proposals before it), otherwise a uniformly random public token.
    Oracle {
        /// Probability of proposing the target's own token.
        rho: f64,
    },
    /// Top-16 proposals: the candidates are the target's 3 most likely tokens (by raw logit,
    /// in descending order) and 13 further distinct public tokens; the proposal is drawn from
    /// `r = [0.1, 0.1, 0.7, 0.1/13 x 13]`. With `misreport` the retained q handed to
    /// verification is uniform (1/16 each) instead of `r`: a deliberately wrong proposer.
    Top16 {
        /// Report a uniform q instead of the actual `r`.
        misreport: bool,
    },
}

/// The actual proposal distribution of [`Strategy::Top16`] over its 16 candidate slots.
pub fn top16_r() -> [f32; 16] {
    let mut r = [0.1f32 / 13.0; 16];
    r[0] = 0.1;
    r[1] = 0.1;
    r[2] = 0.7;
    r
}

#[derive(Debug)]
struct Slot {
    materialized: usize,
    pending: usize,
    max_context: usize,
    /// The shadow sequence and its frontier (created lazily from the history).
    shadow: Option<SeqHandle>,
}

/// A test proposer over a shadow reference target (see the crate docs). Its "context" is
/// bookkeeping only (coverage counts), so the engine's coverage protocol is still checked.
pub struct ShadowProposer {
    shadow: ReferenceTarget,
    be: Backend,
    strategy: Strategy,
    k: usize,
    b: usize,
    seed: u64,
    slots: HashMap<u64, Slot>,
    next: u64,
}

impl std::fmt::Debug for ShadowProposer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShadowProposer")
            .field("strategy", &self.strategy)
            .field("k", &self.k)
            .field("b", &self.b)
            .field("slots", &self.slots.len())
            .finish_non_exhaustive()
    }
}

fn perr(reason: impl Into<String>) -> EngineError {
    EngineError::Proposer {
        reason: reason.into(),
    }
}

/// A proposer image: the coverage only (the shadow state is rebuilt from the history).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShadowImage(pub usize);

impl ShadowProposer {
    /// A proposer for K, B with `strategy`; `shadow` is a private copy of the target;
    /// `seed` keys the proposer's own random choices.
    pub fn new(
        shadow: ReferenceTarget,
        strategy: Strategy,
        k: usize,
        b: usize,
        seed: u64,
    ) -> Result<Self, EngineError> {
        let be = Backend::cpu();
        Ok(ShadowProposer {
            shadow,
            be,
            strategy,
            k,
            b,
            seed,
            slots: HashMap::new(),
            next: 1,
        })
    }

    fn slot_mut(&mut self, s: u64) -> Result<&mut Slot, EngineError> {
        self.slots
            .get_mut(&s)
            .ok_or_else(|| perr(format!("unknown slot {s}")))
    }

    /// Bring the slot's shadow sequence to frontier `f = history.len() - 1` (tokens
    /// `history[..f]` processed) and return it.
    fn synced(&mut self, s: u64, history: &[u32]) -> Result<SeqHandle, EngineError> {
        let f = history.len() - 1;
        let seq = match self.slot_mut(s)?.shadow {
            Some(seq) => seq,
            None => {
                let seq = self.shadow.create()?;
                self.slot_mut(s)?.shadow = Some(seq);
                seq
            }
        };
        let at = self.shadow.frontier(seq)?;
        if at > f {
            return Err(perr(format!("shadow at {at} is past the frontier {f}")));
        }
        if at < f {
            self.shadow.prefill(&self.be, seq, &history[at..f])?;
        }
        Ok(seq)
    }

    /// Logits of one column `token` on top of `seq` (committed when `commit`).
    fn step(&mut self, seq: SeqHandle, token: u32) -> Result<Vec<f32>, EngineError> {
        let input = [token];
        self.shadow.verify(
            &self.be,
            &VerifyBatch {
                rows: &[VerifyRow::chain(seq, &input)],
                cols: 1,
            },
        )?;
        self.shadow.commit(&[Commit::prefix(seq, 1)])?;
        // Column 0 of the verify (padded and packed alike), widened to f32.
        let v = self.shadow.info().vocab_rows;
        Ok(match self.shadow.verified()?.logits.values {
            Logits::F32(b) => self.be.read(b, 0, v)?,
            Logits::Bf16(b) => self.be.read(b, 0, v)?.iter().map(|x| x.to_f32()).collect(),
        })
    }

    /// The proposer's own random stream for proposal `i` of a row: keyed by the proposer
    /// seed, the request seed and the whole history (so rows of different requests never
    /// share decisions), and `i`.
    fn rng(&self, row: &ProposeRow<'_, u64>, i: usize) -> SplitMix64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ self.seed ^ row.seed.rotate_left(17);
        for &t in row.history.iter().chain(std::iter::once(&(i as u32))) {
            h ^= u64::from(t);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        SplitMix64::new(h)
    }

    fn propose_row(&mut self, row: &ProposeRow<'_, u64>) -> Result<Proposal, EngineError> {
        let public = self.shadow.info().public_vocab;
        let seq = self.synced(row.slot, row.history)?;
        let walk = self.shadow.fork(seq)?;
        let mut tokens = Vec::with_capacity(row.usable);
        let mut qs = Vec::new();
        let mut last = row.anchor;
        let result = (|| -> Result<(), EngineError> {
            for i in 0..row.usable {
                let logits = self.step(walk, last)?;
                let mut rng = self.rng(row, i);
                let mut order: Vec<u32> = (0..public as u32).collect();
                order.sort_by(|&a, &b| {
                    logits[b as usize]
                        .total_cmp(&logits[a as usize])
                        .then(a.cmp(&b))
                });
                let d = match self.strategy {
                    Strategy::Oracle { rho } => {
                        let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
                        if u < rho {
                            order[0]
                        } else {
                            rng.below(public as u64) as u32
                        }
                    }
                    Strategy::Top16 { misreport } => {
                        // Candidates: top 3, then 13 distinct tokens from the rest.
                        let mut ids = [0u32; 16];
                        ids[..3].copy_from_slice(&order[..3]);
                        let mut rest: Vec<u32> = order[3..].to_vec();
                        for id in ids.iter_mut().skip(3) {
                            let pick = rng.below(rest.len() as u64) as usize;
                            *id = rest.swap_remove(pick);
                        }
                        let r = top16_r();
                        let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
                        let mut acc = 0.0f64;
                        let mut slot = 15;
                        for (j, &x) in r.iter().enumerate() {
                            acc += f64::from(x);
                            if u < acc {
                                slot = j;
                                break;
                            }
                        }
                        let q = if misreport { [1.0f32 / 16.0; 16] } else { r };
                        qs.push(RetainedQ { ids, q });
                        ids[slot]
                    }
                };
                tokens.push(d);
                last = d;
            }
            Ok(())
        })();
        self.shadow.release(walk)?;
        result?;
        let q = match self.strategy {
            Strategy::Oracle { .. } => None,
            Strategy::Top16 { .. } => Some(qs),
        };
        Ok(Proposal { tokens, q })
    }
}

impl Proposer for ShadowProposer {
    type Slot = u64;
    type Image = ShadowImage;
    type HostImage = ShadowImage;

    fn kind(&self) -> ProposalKind {
        match self.strategy {
            Strategy::Oracle { .. } => ProposalKind::OneHot,
            Strategy::Top16 { .. } => ProposalKind::Top16,
        }
    }

    fn draft_count(&self) -> usize {
        self.k
    }

    fn rows(&self) -> usize {
        self.b
    }

    fn memory_plan(&self) -> MemoryPlan {
        MemoryPlan::default()
    }

    fn check_target(&self, info: &TargetInfo) -> Result<(), EngineError> {
        if info != self.shadow.info() {
            return Err(EngineError::TargetMismatch {
                what: "target info",
                target: format!("{info:?}"),
                draft: format!("{:?}", self.shadow.info()),
            });
        }
        Ok(())
    }

    fn admit(&mut self, max_context: usize) -> Result<u64, EngineError> {
        if self.slots.len() >= self.b {
            return Err(perr("no free slot"));
        }
        let s = self.next;
        self.next += 1;
        self.slots.insert(
            s,
            Slot {
                materialized: 0,
                pending: 0,
                max_context,
                shadow: None,
            },
        );
        Ok(s)
    }

    fn release(&mut self, slot: u64) -> Result<(), EngineError> {
        let s = self
            .slots
            .remove(&slot)
            .ok_or_else(|| perr(format!("release of unknown slot {slot}")))?;
        if let Some(seq) = s.shadow {
            self.shadow.release(seq)?;
        }
        Ok(())
    }

    fn live_slots(&self) -> usize {
        self.slots.len()
    }

    fn push_prefill(
        &mut self,
        slot: u64,
        start: usize,
        features: Buffer<bf16>,
    ) -> Result<(), EngineError> {
        let fw = self.shadow.info().feature_width();
        let s = self.slot_mut(slot)?;
        if start != s.materialized + s.pending || !features.len().is_multiple_of(fw) {
            return Err(perr("prefill push out of order or misshaped"));
        }
        s.pending += features.len() / fw;
        Ok(())
    }

    fn push_verified(
        &mut self,
        slot: u64,
        start: usize,
        features: &Buffer<bf16>,
        first_row: usize,
        rows: usize,
    ) -> Result<(), EngineError> {
        let fw = self.shadow.info().feature_width();
        let k = self.k;
        let s = self.slot_mut(slot)?;
        if start != s.materialized + s.pending {
            return Err(perr(format!(
                "verified push at {start}, coverage is {}",
                s.materialized + s.pending
            )));
        }
        if rows > k + 1 || (first_row + rows) * fw > features.len() {
            return Err(perr("verified push outside the verify block"));
        }
        if start + rows > s.max_context {
            return Err(perr("verified push past the maximum context"));
        }
        s.pending += rows;
        Ok(())
    }

    fn materialize(&mut self, slot: u64) -> Result<(), EngineError> {
        let s = self.slot_mut(slot)?;
        s.materialized += s.pending;
        s.pending = 0;
        Ok(())
    }

    fn coverage(&self, slot: u64) -> Result<Coverage, EngineError> {
        let s = self
            .slots
            .get(&slot)
            .ok_or_else(|| perr(format!("unknown slot {slot}")))?;
        Ok(Coverage {
            materialized: s.materialized,
            pending: s.pending,
        })
    }

    fn propose(&mut self, rows: &[ProposeRow<'_, u64>]) -> Result<Vec<Proposal>, EngineError> {
        for r in rows {
            let cov = self.coverage(r.slot)?;
            if cov.pending != 0 || cov.materialized != r.frontier {
                return Err(perr(format!(
                    "propose on an unmaterialized slot: {cov:?}, frontier {}",
                    r.frontier
                )));
            }
        }
        rows.iter().map(|r| self.propose_row(r)).collect()
    }

    fn checkpoint(&self, slot: u64) -> Result<ShadowImage, EngineError> {
        let c = self.coverage(slot)?;
        if c.pending != 0 {
            return Err(perr("checkpoint with pending features"));
        }
        Ok(ShadowImage(c.materialized))
    }

    fn host_replica(&self, slot: u64) -> Result<ShadowImage, EngineError> {
        self.checkpoint(slot)
    }

    fn image_frontier(image: &ShadowImage) -> usize {
        image.0
    }

    fn host_image_frontier(image: &ShadowImage) -> usize {
        image.0
    }

    fn fork(&mut self, slot: u64) -> Result<u64, EngineError> {
        let img = self.checkpoint(slot)?;
        let max = self.slots.get(&slot).map_or(0, |s| s.max_context);
        self.admit_restored(max, &img, img.0)
    }

    fn admit_restored(
        &mut self,
        max_context: usize,
        image: &ShadowImage,
        target_frontier: usize,
    ) -> Result<u64, EngineError> {
        if image.0 != target_frontier {
            return Err(perr(format!(
                "image coverage {} != target frontier {target_frontier}",
                image.0
            )));
        }
        let s = self.admit(max_context)?;
        self.slot_mut(s)?.materialized = image.0;
        Ok(s)
    }

    fn admit_restored_host(
        &mut self,
        max_context: usize,
        image: &ShadowImage,
        target_frontier: usize,
    ) -> Result<u64, EngineError> {
        self.admit_restored(max_context, image, target_frontier)
    }
}
