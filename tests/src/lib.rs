//! Shared pieces of the cross-crate end-to-end tests (the tests live in `tests/tests/`).
//!
//! - [`ShadowProposer`] (from `dflash-cli`'s harness): a test [`Proposer`] that sees the target through a private *shadow*
//!   copy of the reference target (loaded from the same checkpoint) and proposes by a
//!   [`Strategy`]: the target's own greedy tokens with a chosen probability (random tokens
//!   otherwise), or a 16-candidate distribution reported truthfully or deliberately wrongly.
//! - helpers to build engines on the embedded default, run them while checking the coverage
//!   invariant after every step, and compute plain-decoding baselines.

#![deny(missing_docs)]

use std::collections::HashMap;

use dflash_cli::Fixture;
use dflash_config::{Backend as DraftBackend, StartupOptions};
use dflash_draft::DraftModel;
use dflash_engine::{
    DraftProposer, Engine, EngineOptions, Event, FinishReason, Proposer, Request, RequestId,
    StepReport, Target, plain_decode,
};
use dflash_ops::Backend;
use dflash_testkit::ReferenceTarget;

pub use dflash_cli::shadow::{ShadowImage, ShadowProposer, Strategy, top16_r};

/// Engine options for backend, K, B with `max_context` positions per request.
pub fn options(backend: DraftBackend, k: u32, b: u32, max_context: usize) -> EngineOptions {
    EngineOptions {
        startup: StartupOptions {
            concurrency: b,
            ..StartupOptions::new(backend, k)
        },
        max_context,
        page_size: 8,
        memory_budget: 1 << 30,
        eager: false,
    }
}

/// A draft engine on the CPU over the fixture.
pub fn draft_engine(
    fx: &Fixture,
    k: u32,
    b: u32,
    max_context: usize,
) -> Result<Engine<ReferenceTarget, DraftProposer<'static>>, dflash_cli::HarnessError> {
    let be = Backend::cpu();
    let model: DraftModel = fx.draft(&be)?;
    let parts = fx.parts(&be)?;
    Ok(Engine::with_draft(
        fx.target()?,
        model,
        parts,
        &options(fx.backend(), k, b, max_context),
    )?)
}

/// A DFlash2 draft engine on the CPU over the fixture verifying trees of `nodes` nodes
/// (`startup.tree_nodes`; `None`: chain rounds).
pub fn tree_draft_engine(
    fx: &Fixture,
    k: u32,
    b: u32,
    nodes: Option<u32>,
    max_context: usize,
) -> Result<Engine<ReferenceTarget, DraftProposer<'static>>, dflash_cli::HarnessError> {
    let be = Backend::cpu();
    let model: DraftModel = fx.draft(&be)?;
    let parts = fx.parts(&be)?;
    let mut o = options(fx.backend(), k, b, max_context);
    o.startup.tree_nodes = nodes;
    Ok(Engine::with_draft(fx.target()?, model, parts, &o)?)
}

/// A shadow-proposer engine on the CPU over the fixture.
pub fn shadow_engine(
    fx: &Fixture,
    strategy: Strategy,
    k: u32,
    b: u32,
    max_context: usize,
    seed: u64,
) -> Result<Engine<ReferenceTarget, ShadowProposer>, dflash_cli::HarnessError> {
    let proposer = ShadowProposer::new(fx.target()?, strategy, k as usize, b as usize, seed)?;
    Ok(Engine::new(
        fx.target()?,
        proposer,
        Backend::cpu(),
        &options(fx.backend(), k, b, max_context),
    )?)
}

/// Plain decoding of every request with a target loaded from the fixture.
pub fn plain_outputs(fx: &Fixture, requests: &[Request]) -> Vec<Vec<u32>> {
    let mut t = fx.target().expect("target");
    requests
        .iter()
        .map(|r| {
            plain_decode(&mut t, &Backend::cpu(), r)
                .expect("plain decode")
                .tokens
        })
        .collect()
}

/// What [`run_checked`] collected.
#[derive(Debug, Default)]
pub struct Collected {
    /// Published tokens per request, in order.
    pub outputs: HashMap<RequestId, Vec<u32>>,
    /// Finish reasons.
    pub finished: HashMap<RequestId, FinishReason>,
    /// Every step report.
    pub steps: Vec<StepReport>,
}

/// Check the coverage invariant of every active request: the draft coverage (materialized
/// plus pending) equals the committed target frontier; after an explicit materialize the
/// materialized part alone does, with nothing pending.
pub fn check_coverage<T: Target, P: Proposer>(engine: &mut Engine<T, P>) {
    for id in engine.active() {
        let (cov, f) = engine.coverage(id).expect("coverage");
        assert_eq!(
            cov.frontier(),
            f,
            "{id}: coverage {cov:?} vs target frontier {f}"
        );
        assert_eq!(
            f,
            engine.continuation(id).expect("cont").frontier,
            "{id}: target frontier vs continuation"
        );
    }
}

/// Run the engine until idle, checking the coverage invariant after every step (and, every
/// `materialize_every` steps, after an explicit materialize of every active request).
pub fn run_checked<T: Target, P: Proposer>(
    engine: &mut Engine<T, P>,
    materialize_every: usize,
) -> Collected {
    let mut c = Collected::default();
    let mut n = 0usize;
    loop {
        let mut events = Vec::new();
        let step = engine
            .step(&mut |e: &Event| events.push(e.clone()))
            .expect("step");
        for e in events {
            match e {
                Event::Tokens { id, tokens, .. } => c.outputs.entry(id).or_default().extend(tokens),
                Event::Finished { id, reason, .. } => {
                    c.finished.insert(id, reason);
                }
            }
        }
        let Some(step) = step else { break };
        c.steps.push(step);
        check_coverage(engine);
        n += 1;
        if materialize_every > 0 && n.is_multiple_of(materialize_every) {
            for id in engine.active() {
                engine.materialize(id).expect("materialize");
                let (cov, f) = engine.coverage(id).expect("coverage");
                assert_eq!(
                    (cov.materialized, cov.pending),
                    (f, 0),
                    "{id} after materialize"
                );
            }
        }
    }
    c
}

/// The draft context store's leak check: every lane free and (with full layers) every page.
pub fn assert_no_context_leak(p: &DraftProposer) {
    let s = p.store();
    assert_eq!(s.free_lanes(), s.capacity().lanes, "context lanes leaked");
    if s.geometry().has_full_layers() {
        assert_eq!(s.free_pages(), s.capacity().pages, "context pages leaked");
    }
    assert!(s.handles().is_empty(), "context handles leaked");
}

/// A proposer that delegates everything to `inner` but reports every retained q as the
/// uniform distribution over its 16 candidates: a deliberately wrong DFlash2 (its proposals
/// are still drawn from the true q). Speculative sampling with it must fail the
/// distribution test.
#[derive(Debug)]
pub struct MisreportQ<P>(pub P);

impl<P: Proposer> Proposer for MisreportQ<P> {
    type Slot = P::Slot;
    type Image = P::Image;
    type HostImage = P::HostImage;

    fn kind(&self) -> dflash_verify::ProposalKind {
        self.0.kind()
    }
    fn draft_count(&self) -> usize {
        self.0.draft_count()
    }
    fn rows(&self) -> usize {
        self.0.rows()
    }
    fn memory_plan(&self) -> dflash_engine::MemoryPlan {
        self.0.memory_plan()
    }
    fn check_target(&self, info: &dflash_engine::TargetInfo) -> dflash_engine::Result<()> {
        self.0.check_target(info)
    }
    fn admit(&mut self, max_context: usize) -> dflash_engine::Result<Self::Slot> {
        self.0.admit(max_context)
    }
    fn release(&mut self, slot: Self::Slot) -> dflash_engine::Result<()> {
        self.0.release(slot)
    }
    fn live_slots(&self) -> usize {
        self.0.live_slots()
    }
    fn push_prefill(
        &mut self,
        slot: Self::Slot,
        start: usize,
        features: dflash_ops::Buffer<dflash_ops::bf16>,
    ) -> dflash_engine::Result<()> {
        self.0.push_prefill(slot, start, features)
    }
    fn push_verified(
        &mut self,
        slot: Self::Slot,
        start: usize,
        features: &dflash_ops::Buffer<dflash_ops::bf16>,
        first_row: usize,
        rows: usize,
    ) -> dflash_engine::Result<()> {
        self.0.push_verified(slot, start, features, first_row, rows)
    }
    fn materialize(&mut self, slot: Self::Slot) -> dflash_engine::Result<()> {
        self.0.materialize(slot)
    }
    fn coverage(&self, slot: Self::Slot) -> dflash_engine::Result<dflash_engine::Coverage> {
        self.0.coverage(slot)
    }
    fn propose(
        &mut self,
        rows: &[dflash_engine::ProposeRow<'_, Self::Slot>],
    ) -> dflash_engine::Result<Vec<dflash_engine::Proposal>> {
        let mut out = self.0.propose(rows)?;
        for p in &mut out {
            for q in p.q.iter_mut().flatten() {
                q.q = [1.0 / 16.0; 16];
            }
        }
        Ok(out)
    }
    fn checkpoint(&self, slot: Self::Slot) -> dflash_engine::Result<Self::Image> {
        self.0.checkpoint(slot)
    }
    fn host_replica(&self, slot: Self::Slot) -> dflash_engine::Result<Self::HostImage> {
        self.0.host_replica(slot)
    }
    fn image_frontier(image: &Self::Image) -> usize {
        P::image_frontier(image)
    }
    fn host_image_frontier(image: &Self::HostImage) -> usize {
        P::host_image_frontier(image)
    }
    fn fork(&mut self, slot: Self::Slot) -> dflash_engine::Result<Self::Slot> {
        self.0.fork(slot)
    }
    fn admit_restored(
        &mut self,
        max_context: usize,
        image: &Self::Image,
        target_frontier: usize,
    ) -> dflash_engine::Result<Self::Slot> {
        self.0.admit_restored(max_context, image, target_frontier)
    }
    fn admit_restored_host(
        &mut self,
        max_context: usize,
        image: &Self::HostImage,
        target_frontier: usize,
    ) -> dflash_engine::Result<Self::Slot> {
        self.0
            .admit_restored_host(max_context, image, target_frontier)
    }
}

/// A DFlash2 draft engine over the fixture whose proposer misreports q ([`MisreportQ`]).
pub fn misreporting_draft_engine(
    fx: &Fixture,
    k: u32,
    b: u32,
    max_context: usize,
) -> Result<Engine<ReferenceTarget, MisreportQ<DraftProposer<'static>>>, dflash_cli::HarnessError> {
    let be = Backend::cpu();
    let proposer = DraftProposer::new(
        fx.draft(&be)?,
        fx.parts(&be)?,
        &options(fx.backend(), k, b, max_context),
    )?;
    Ok(Engine::new(
        fx.target()?,
        MisreportQ(proposer),
        be,
        &options(fx.backend(), k, b, max_context),
    )?)
}
