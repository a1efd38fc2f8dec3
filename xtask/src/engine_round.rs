//! `dflash-bench --engine-round`: whole engine rounds (`Engine::step`) of an official draft
//! (synthetic weights) over a GPU-resident stand-in target, against the draft block alone.
//!
//! The stand-in target ([`StandIn`]) serves fixed device logits and features: its verify is
//! bookkeeping only (it never reads the device ids), so a round's time is the engine's own:
//! the batched materialize, the draft block (its graph profile), the verification ops, the
//! round's one read and the engine's host work. The logits are random, so the target rejects
//! almost every proposal (each round commits about one token); the work per round is the
//! same at any acceptance (the block always proposes K, the verify always covers K + 1
//! columns per row).

use std::time::Instant;

use anyhow::{Result, anyhow, ensure};
use dflash_engine::{
    Commit, DeviceVerifyBatch, DraftHead, DraftTargetParts, Engine, EngineOptions, PrefillOutput,
    Request, SeqHandle, Target, TargetError, TargetInfo, TargetLogits, VerifyBatch, VerifyView,
};
use dflash_ops::{Backend, Buffer, Held, bf16};

use crate::stand_in::{NoImage, Sequences};

/// A target that lends fixed device outputs: logits `[B * W, vocab_rows]` F32 and features
/// `[B * W, feature_width]` BF16 for every verify, a prompt's features from a template.
pub struct StandIn {
    info: TargetInfo,
    logits: Buffer<f32>,
    features: Buffer<bf16>,
    /// `[max prompt, feature_width]` prompt features.
    prompt_features: Buffer<bf16>,
    seqs: Sequences,
    verified: bool,
}

impl StandIn {
    /// Outputs for every verify, and prompt features for prompts of up to
    /// `prompt_features.len() / feature_width` tokens.
    pub fn new(
        info: TargetInfo,
        logits: Buffer<f32>,
        features: Buffer<bf16>,
        prompt_features: Buffer<bf16>,
    ) -> Self {
        StandIn {
            info,
            logits,
            features,
            prompt_features,
            seqs: Sequences::default(),
            verified: false,
        }
    }
}

impl Target for StandIn {
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
        let (f, _) = self.seqs.get(seq)?;
        let fw = self.info.feature_width();
        let n = tokens.len() * fw;
        if n > self.prompt_features.len() {
            return Err(TargetError::CapacityExceeded {
                seq,
                frontier: f,
                columns: tokens.len(),
                max_positions: self.prompt_features.len() / fw,
            });
        }
        let mut features = be.zeros(n)?;
        be.copy(&self.prompt_features, 0, &mut features, 0, n)?;
        let v = self.info.vocab_rows;
        let mut last_logits = be.zeros(v)?;
        be.copy(&self.logits, 0, &mut last_logits, 0, v)?;
        self.seqs.prefill(seq, tokens.len())?;
        Ok(PrefillOutput {
            features,
            last_logits,
        })
    }
    fn frontier(&self, seq: SeqHandle) -> Result<usize, TargetError> {
        Ok(self.seqs.get(seq)?.0)
    }
    fn pending(&self, seq: SeqHandle) -> Result<Option<usize>, TargetError> {
        Ok(self.seqs.get(seq)?.1)
    }
    fn verify(&mut self, _be: &Backend, batch: &VerifyBatch<'_>) -> Result<(), TargetError> {
        let rows: Vec<_> = batch.rows.iter().map(|r| (r.seq, r.tokens.len())).collect();
        self.seqs.verify(&rows)?;
        self.verified = true;
        Ok(())
    }
    /// Bookkeeping only: the device ids are never read.
    fn verify_device(
        &mut self,
        _be: &Backend,
        batch: &DeviceVerifyBatch<'_>,
    ) -> Result<(), TargetError> {
        let rows: Vec<_> = batch
            .seqs
            .iter()
            .copied()
            .zip(batch.columns.iter().copied())
            .collect();
        self.seqs.verify(&rows)?;
        self.verified = true;
        Ok(())
    }
    fn verified(&self) -> Result<VerifyView<'_>, TargetError> {
        if !self.verified {
            return Err(TargetError::NothingVerified);
        }
        Ok(VerifyView {
            logits: TargetLogits::padded(&self.logits),
            features: &self.features,
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

/// What the timed rounds of one engine cost.
pub struct RoundStats {
    /// Median `Engine::step` wall time of a round of B rows (µs).
    pub median_us: f64,
    /// Rounds timed.
    pub rounds: usize,
    /// Device allocations and host synchronizations per timed round.
    pub allocations_per_round: f64,
    pub syncs_per_round: f64,
    /// Whether the draft block and the verification ops replayed a graph in every timed
    /// round.
    pub replayed: bool,
    pub verify_replayed: bool,
    /// The round's parts alone, each queued then waited for (median µs over 20): the draft's
    /// propose (stage + block graph + verify-input assembly), the batched materialize of one
    /// verified row per request, and the verification ops with their one read.
    pub propose_us: f64,
    pub materialize_us: f64,
    pub verify_us: f64,
    /// The verification ops alone as `verify_us`, every row sampled (T = 0.8, top-p 0.95:
    /// every column streams its vocabulary through the sampled passes).
    pub verify_sampled_us: f64,
}

/// Everything an engine round needs besides the draft model and parts.
pub struct RoundSpec {
    pub backend: dflash_config::Backend,
    pub rows: usize,
    pub k: usize,
    pub context: usize,
    pub eager: bool,
}

/// Build the engine over the stand-in target, admit B requests with `context`-token prompts,
/// run 3 warm-up rounds and time 30.
pub fn time_rounds(
    be: &Backend,
    g: &dflash_config::Geometry,
    model: dflash_draft::DraftModel,
    embedding: Buffer<bf16>,
    head: Buffer<bf16>,
    spec: &RoundSpec,
    random_buf_f32: &dyn Fn(usize, u64) -> Result<Buffer<f32>>,
    random_buf_bf16: &dyn Fn(usize, u64) -> Result<Buffer<bf16>>,
) -> Result<RoundStats> {
    let (b, k, ctx) = (spec.rows, spec.k, spec.context);
    let w = k + 1;
    let public = g
        .public_vocab_size
        .ok_or_else(|| anyhow!("the official geometry names its public vocabulary"))?
        as usize;
    let info = TargetInfo {
        hidden: g.hidden as usize,
        layers: g.target_layers as usize,
        vocab_rows: g.vocab_rows as usize,
        public_vocab: public,
        capture_ids: g.target_layer_ids.iter().map(|&i| i as usize).collect(),
        max_positions: 1 << 24,
        supports_trees: false,
    };
    let fw = info.feature_width();
    let target = StandIn::new(
        info,
        random_buf_f32(b * w * g.vocab_rows as usize, 51)?,
        random_buf_bf16(b * w * fw, 52)?,
        random_buf_bf16(ctx * fw, 53)?,
    );
    let parts = DraftTargetParts {
        vocab_rows: g.vocab_rows as usize,
        public_vocab: public,
        embedding: Held::Owned(embedding),
        head: DraftHead::Full {
            output_head: Held::Owned(head),
        },
    };
    let max_new = 200;
    let options = EngineOptions {
        startup: dflash_config::StartupOptions {
            concurrency: b as u32,
            ..dflash_config::StartupOptions::new(spec.backend, k as u32)
        },
        max_context: ctx + max_new + w,
        page_size: 64,
        memory_budget: u64::MAX,
        eager: spec.eager,
    };
    let mut engine = Engine::with_draft(target, model, parts, &options)?;
    for r in 0..b {
        let prompt: Vec<u32> = (0..ctx)
            .map(|i| ((i * 7 + r * 13) % 1000 + 10) as u32)
            .collect();
        engine.submit(Request {
            seed: 3 + r as u64,
            ..Request::greedy(prompt, max_new)
        })?;
    }
    let mut sink = |_: &dflash_engine::Event| {};
    // Admission and warm-up rounds.
    for _ in 0..4 {
        engine.step(&mut sink)?;
    }
    let (a0, s0, r0, v0) = (
        be.allocations(),
        be.synchronizations(),
        engine.proposer().graph_replays(),
        engine.verify_graphs().0,
    );
    let mut times = Vec::new();
    for _ in 0..30 {
        let t0 = Instant::now();
        let step = engine.step(&mut sink)?;
        times.push(t0.elapsed().as_secs_f64() * 1e6);
        let rows = step.map_or(0, |s| s.rows.len());
        ensure!(rows == b, "a timed round ran {rows} rows, not {b}");
    }
    let n = times.len();
    let replays = engine.proposer().graph_replays() - r0;
    let verify_replays = engine.verify_graphs().0 - v0;
    let (allocations_per_round, syncs_per_round) = (
        (be.allocations() - a0) as f64 / n as f64,
        (be.synchronizations() - s0) as f64 / n as f64,
    );
    times.sort_by(f64::total_cmp);
    let (target, proposer) = engine.into_parts();
    let parts = time_parts(be, target, proposer, b, k)?;
    Ok(RoundStats {
        median_us: times[n / 2],
        rounds: n,
        allocations_per_round,
        syncs_per_round,
        replayed: replays == n as u64,
        verify_replayed: verify_replays == n as u64,
        propose_us: parts.0,
        materialize_us: parts.1,
        verify_us: parts.2,
        verify_sampled_us: parts.3,
    })
}

/// The median of `v` (sorted in place).
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Time the round's parts alone on the engine's proposer (its requests still admitted):
/// (propose, materialize, verify) medians in µs.
fn time_parts(
    be: &Backend,
    target: StandIn,
    mut proposer: dflash_engine::DraftProposer<'static>,
    b: usize,
    k: usize,
) -> Result<(f64, f64, f64, f64)> {
    use dflash_engine::{ProposeRow, Proposer};
    let info = target.info().clone();
    let slots = proposer.store().handles();
    ensure!(slots.len() == b, "{} admitted slots, not {b}", slots.len());
    let frontiers: Vec<usize> = slots
        .iter()
        .map(|&h| proposer.store().frontier(h))
        .collect::<std::result::Result<_, _>>()?;
    let histories: Vec<Vec<u32>> = frontiers
        .iter()
        .map(|&f| (0..=f).map(|i| (i % 1000 + 10) as u32).collect())
        .collect();
    let token_histories: Vec<dflash_verify::TokenHistory> = histories
        .iter()
        .map(|h| dflash_verify::TokenHistory::with_tokens(info.vocab_rows, h))
        .collect::<std::result::Result<_, _>>()?;
    let mut verify = dflash_verify::VerifyWorkspace::new(
        be,
        dflash_verify::VerifyShape {
            max_rows: b,
            cols: k + 1,
            vocab_rows: info.vocab_rows,
            public_vocab: info.public_vocab,
            kind: proposer.kind(),
        },
    )?;
    // As the engine runs it (graph profiles).
    verify.use_graphs(be, true);
    let sampled = dflash_verify::SamplingSettings {
        top_p: 0.95,
        ..dflash_verify::SamplingSettings::sampling(0.8)
    };
    let (mut tp, mut tm, mut tv, mut ts) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..20 {
        // Materialize one verified row per request (pushed first, as after a commit).
        for &h in &slots {
            let cov = proposer.coverage(h)?;
            proposer.push_verified(h, cov.frontier(), &target.features, 0, 1)?;
        }
        be.synchronize()?;
        let t0 = Instant::now();
        proposer.materialize_all(&slots)?;
        be.synchronize()?;
        tm.push(t0.elapsed().as_secs_f64() * 1e6);
        let rows: Vec<ProposeRow<'_, _>> = slots
            .iter()
            .zip(&histories)
            .map(|(&h, hist)| ProposeRow {
                slot: h,
                anchor: *hist.last().unwrap_or(&10),
                frontier: proposer.store().frontier(h).unwrap_or(0),
                usable: k,
                temperature: 0.0,
                seed: 7,
                history: hist,
            })
            .collect();
        let t0 = Instant::now();
        let round = proposer
            .propose_device(&rows)?
            .ok_or_else(|| anyhow!("the draft proposer proposes on the device"))?;
        be.synchronize()?;
        tp.push(t0.elapsed().as_secs_f64() * 1e6);
        for (settings, times) in [
            (dflash_verify::SamplingSettings::GREEDY, &mut tv),
            (sampled, &mut ts),
        ] {
            let drows: Vec<dflash_verify::DeviceRow<'_>> = token_histories
                .iter()
                .map(|h| dflash_verify::DeviceRow {
                    anchor: h.last().unwrap_or(10),
                    proposals: k,
                    settings,
                    seed: 7,
                    frontier: h.len() - 1,
                    history: h,
                })
                .collect();
            let t0 = Instant::now();
            let pending = verify.verify_device(
                be,
                &drows,
                &round.proposals,
                TargetLogits::padded(&target.logits),
            )?;
            // The proposals of random weights need not be public; only the time matters.
            let _ = pending.wait();
            times.push(t0.elapsed().as_secs_f64() * 1e6);
        }
    }
    Ok((
        median(&mut tp),
        median(&mut tm),
        median(&mut tv),
        median(&mut ts),
    ))
}
