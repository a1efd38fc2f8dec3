//! The engine: admission, the round transaction, concurrency, fork / checkpoint / restore.

use std::collections::{HashMap, VecDeque};

use dflash_config::{MAX_CONCURRENCY, MAX_DRAFT_COUNT};
use dflash_draft::DraftModel;
use dflash_ops::Backend;
use dflash_verify::{
    ProposalDist, ProposalKind, RetainedQ, RoundOutcome, TokenHistory, TreeOutcome, TreeRow,
    VerifyShape, VerifyWorkspace,
};

use crate::draft_proposer::{DraftProposer, DraftTargetParts};
use crate::error::{EngineError, Result};
use crate::options::{EngineOptions, MemoryPlan};
use crate::proposer::{Coverage, ProposeRow, Proposer};
use crate::request::{CancelHandle, FinishReason, Request, RequestId, preview};
use crate::sampling::Sampler;
use crate::target::{
    Accepted, Commit, SeqHandle, Target, TargetCheckpoint, TargetInfo, VerifyBatch, VerifyRow,
};

/// The draft's proposal rows of the active requests (`usable`: each one's `P`).
fn propose_rows<'a, S: Copy>(active: &'a [Active<S>], usable: &[usize]) -> Vec<ProposeRow<'a, S>> {
    active
        .iter()
        .zip(usable)
        .map(|(a, &p)| ProposeRow {
            slot: a.slot,
            anchor: a.cont.anchor().unwrap_or(0),
            frontier: a.cont.frontier,
            usable: p,
            temperature: a.cont.request.sampling.temperature,
            seed: a.cont.request.seed,
            history: &a.cont.tokens,
        })
        .collect()
}

/// A row's verification, chain or tree: what the rest of the round reads.
struct Verified {
    outputs: Vec<u32>,
    accepted: usize,
    /// `P` (a tree's depth budget: its chain's length).
    proposals: usize,
    /// A tree round's accepted root path (verify columns); `None` for a chain (`0 ..= A`).
    path: Option<Vec<usize>>,
}

impl Verified {
    fn chain(o: RoundOutcome) -> Self {
        Verified {
            accepted: o.accepted(),
            proposals: o.proposals(),
            outputs: o.outputs().to_vec(),
            path: None,
        }
    }

    fn tree(o: TreeOutcome, proposals: usize) -> Self {
        Verified {
            accepted: o.accepted(),
            proposals,
            outputs: o.outputs().to_vec(),
            path: Some(o.path().to_vec()),
        }
    }

    fn outputs(&self) -> &[u32] {
        &self.outputs
    }

    fn accepted(&self) -> usize {
        self.accepted
    }

    fn proposals(&self) -> usize {
        self.proposals
    }

    /// The verify columns of the first `n` committed rows as runs of adjacent columns:
    /// `(offset in the commit, first column, length)`.
    fn column_runs(&self, n: usize) -> Vec<(usize, usize, usize)> {
        let Some(path) = &self.path else {
            return vec![(0, 0, n)];
        };
        let mut runs: Vec<(usize, usize, usize)> = Vec::new();
        for (j, &c) in path[..n].iter().enumerate() {
            match runs.last_mut() {
                Some((_, first, len)) if *first + *len == c => *len += 1,
                _ => runs.push((j, c, 1)),
            }
        }
        runs
    }
}

/// Something a frontend sees, in publication order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// Tokens published for a request; the first one is at absolute position `position`.
    Tokens {
        /// The request.
        id: RequestId,
        /// Absolute position of `tokens[0]`.
        position: usize,
        /// The published tokens, in order.
        tokens: Vec<u32>,
    },
    /// The request ended; its slot and target sequence are released.
    Finished {
        /// The request.
        id: RequestId,
        /// Why.
        reason: FinishReason,
        /// Output tokens it published in total.
        generated: usize,
    },
}

/// One admission of a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdmissionReport {
    /// The request.
    pub id: RequestId,
    /// Prompt tokens prefilled (the frontier after admission).
    pub prompt_len: usize,
    /// The first output token, sampled from the prompt's last logits.
    pub anchor: u32,
}

/// One request's part of a round.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowReport {
    /// The request.
    pub id: RequestId,
    /// The target frontier `F` before the round (the anchor's position).
    pub frontier: usize,
    /// The draft context coverage before materialize (`materialized` may lag `F`, `pending`
    /// covers the rest).
    pub context_before: Coverage,
    /// The anchor `a`.
    pub anchor: u32,
    /// `d_1 .. d_P`, the verified proposals (a tree round: the tokens of nodes `1 .. N`, in
    /// node order; nodes `1 ..= P` are the chain).
    pub proposed: Vec<u32>,
    /// A tree round: the accepted root path of node indices (`[0, v_1, .., v_A]`); empty for
    /// a chain round (whose path is `0 ..= A`).
    pub tree_path: Vec<usize>,
    /// `A`, accepted proposals.
    pub accepted: usize,
    /// `y_1 .. y_L`, the licensed outputs.
    pub licensed: Vec<u32>,
    /// `N`, the published (and committed) prefix length.
    pub committed: usize,
    /// Set when the request ended with this round.
    pub finish: Option<FinishReason>,
}

/// What one [`Engine::step`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepReport {
    /// The round number (counts rounds that verified at least one row; 0 before the first).
    pub round: u64,
    /// Requests admitted by this step, in admission order.
    pub admitted: Vec<AdmissionReport>,
    /// The round's rows in compact-batch order (empty when no request was active).
    pub rows: Vec<RowReport>,
}

/// Counters over the engine's life.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Rounds run.
    pub rounds: u64,
    /// Row-rounds (one per request per round).
    pub row_rounds: u64,
    /// Tokens published (admission tokens included).
    pub tokens: u64,
    /// Proposals verified (sum of P).
    pub proposed: u64,
    /// Proposals accepted (sum of A).
    pub accepted: u64,
    /// `commits[n]`: row-rounds that committed `N = n` rows (`n` in `0..=W`).
    pub commits: Vec<u64>,
}

/// A finished request's result.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finished {
    /// The published output tokens (the first is the admission token).
    pub output: Vec<u32>,
    /// Why it ended.
    pub reason: FinishReason,
}

/// Continuation metadata of a request image: everything besides the target state and the
/// draft context.
#[derive(Clone, Debug, PartialEq)]
pub struct Continuation {
    /// The request (settings, seed, stop conditions, budget).
    pub request: Request,
    /// Tokens `x_0 ..= x_F`: the prompt, then every published output (the anchor last).
    pub tokens: Vec<u32>,
    /// The frontier `F`.
    pub frontier: usize,
    /// Rounds the request has taken part in.
    pub rounds: u64,
    /// Proposals it has had accepted.
    pub accepted: u64,
}

impl Continuation {
    /// The unprocessed anchor `a = x_F`.
    pub fn anchor(&self) -> Option<u32> {
        self.tokens.last().copied()
    }

    /// The published output tokens.
    pub fn output(&self) -> &[u32] {
        self.tokens
            .get(self.request.prompt.len()..)
            .unwrap_or_default()
    }
}

/// An image of a whole request: target state, draft context and continuation metadata, all at
/// the same frontier (device checkpoint: `D` = the proposer's image; host replica: its host
/// image).
#[derive(Debug)]
pub struct RequestImage<C, D> {
    /// The target state.
    pub target: C,
    /// The draft context.
    pub draft: D,
    /// The continuation metadata.
    pub continuation: Continuation,
}

impl<C: TargetCheckpoint, D> RequestImage<C, D> {
    /// The frontier every part agrees on.
    pub fn frontier(&self) -> usize {
        self.continuation.frontier
    }
}

#[derive(Debug)]
struct Active<S> {
    id: RequestId,
    seq: SeqHandle,
    slot: S,
    cont: Continuation,
    history: TokenHistory,
    cancel: CancelHandle,
}

impl<S> Active<S> {
    fn generated(&self) -> usize {
        self.cont.tokens.len() - self.cont.request.prompt.len()
    }

    fn budget_left(&self) -> usize {
        self.cont
            .request
            .max_new_tokens
            .saturating_sub(self.generated())
    }
}

/// The speculative decoding engine over a [`Target`] and a [`Proposer`].
///
/// Between rounds requests join ([`Engine::submit`], admitted by the next [`Engine::step`] while
/// a slot is free) and leave (finishing, [`Engine::cancel`], [`Engine::release`]); every round
/// runs all active requests (at most B) as one compact batch. A request's tokens depend only
/// on its own prompt, settings, seed and stop conditions, never on the other rows.
pub struct Engine<T: Target, P: Proposer> {
    target: T,
    proposer: P,
    be: Backend,
    k: usize,
    b: usize,
    kind: ProposalKind,
    /// Tree rounds with this many nodes (`startup.tree_nodes`), else chain rounds.
    tree: Option<usize>,
    /// A tree engine's scratch `[nodes, feature_width]` BF16: an accepted path's captured
    /// feature rows compacted into one run (the draft context then takes one pending entry,
    /// its round slab's, as after a chain commit).
    tree_features: Option<dflash_ops::Buffer<dflash_ops::bf16>>,
    limit: usize,
    verify: VerifyWorkspace,
    sampler: Sampler,
    active: Vec<Active<P::Slot>>,
    queue: VecDeque<(RequestId, Request, CancelHandle)>,
    finished: HashMap<RequestId, Finished>,
    pending_events: Vec<Event>,
    next_id: u64,
    plan: MemoryPlan,
    stats: EngineStats,
}

impl<T: Target, P: Proposer> std::fmt::Debug for Engine<T, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("backend", &self.be.name())
            .field("k", &self.k)
            .field("b", &self.b)
            .field("kind", &self.kind)
            .field("active", &self.active.len())
            .field("queued", &self.queue.len())
            .finish_non_exhaustive()
    }
}

/// The engine's own device allocations for a target, K, B, proposal kind and tree nodes (the
/// verify workspace holds `N` columns a row for a tree engine, `W = K + 1` otherwise).
fn engine_plan(
    info: &TargetInfo,
    k: usize,
    b: usize,
    kind: ProposalKind,
    tree: Option<usize>,
) -> MemoryPlan {
    let w = tree.unwrap_or(k + 1) as u64;
    let mut plan = MemoryPlan::default();
    // The target's verify outputs are the target's own memory (lent through
    // `Target::verified`), not the engine's.
    plan.push(
        "verify workspace",
        VerifyWorkspace::bytes(&VerifyShape {
            max_rows: b,
            cols: w as usize,
            vocab_rows: info.vocab_rows,
            public_vocab: info.public_vocab,
            kind,
        }),
    );
    plan.push("plain sampler", Sampler::bytes(info.vocab_rows));
    if let Some(n) = tree {
        // A tree path's feature rows, compacted into one run before the draft takes them.
        plan.push(
            "tree feature compaction",
            2 * (n * info.feature_width()) as u64,
        );
    }
    plan
}

/// The tree node budget of `startup.tree_nodes` (`None`: chain rounds): `K + 1 ..= 32`
/// nodes, DFlash2 only.
pub(crate) fn tree_nodes(
    startup: &dflash_config::StartupOptions,
    kind: ProposalKind,
) -> Result<Option<usize>> {
    let Some(n) = startup.tree_nodes else {
        return Ok(None);
    };
    let k = startup.draft_count as usize;
    if kind != ProposalKind::Top16 {
        return Err(EngineError::Unsupported {
            option: "startup.tree_nodes",
            found: n.to_string(),
            reason: "tree verification needs a DFlash2 draft (a top-16 lattice); a DFlash \
draft verifies chains",
        });
    }
    let n = n as usize;
    // At most 1 + 16 nodes when K = 1 (the anchor and its 16 candidates).
    let max = if k == 1 {
        17
    } else {
        dflash_config::MAX_TREE_NODES as usize
    };
    if !(k + 1..=max).contains(&n) {
        return Err(EngineError::InvalidOption {
            option: "startup.tree_nodes",
            expected: format!("{}..={max} (the K + 1 chain columns at least)", k + 1),
            found: n.to_string(),
        });
    }
    Ok(Some(n))
}

fn check_startup_numbers(k: usize, b: usize) -> Result<()> {
    if !(1..=MAX_DRAFT_COUNT as usize).contains(&k) {
        return Err(EngineError::InvalidOption {
            option: "startup.draft_count",
            expected: format!("1..={MAX_DRAFT_COUNT}"),
            found: k.to_string(),
        });
    }
    if !(1..=MAX_CONCURRENCY as usize).contains(&b) {
        return Err(EngineError::InvalidOption {
            option: "startup.concurrency",
            expected: format!("1..={MAX_CONCURRENCY}"),
            found: b.to_string(),
        });
    }
    Ok(())
}

fn check_budget(plan: &MemoryPlan, budget: u64) -> Result<()> {
    let need = plan.total();
    if need > budget {
        return Err(EngineError::InsufficientMemory {
            need,
            budget,
            plan: plan.to_string(),
        });
    }
    Ok(())
}

impl<'a, T: Target> Engine<T, DraftProposer<'a>> {
    /// Start an engine with the DFlash / DFlash2 draft `model` (bound on `model.backend()`,
    /// which becomes the engine's backend) and the target parts it borrows.
    ///
    /// Everything is planned first: the startup options are validated against the checkpoint
    /// (backend, K, B, head, mask token), the draft against the target (hidden width,
    /// vocabulary, captured block ids), and the whole memory plan (draft weights and parts,
    /// context pools, draft and verify workspaces, target verify outputs) against
    /// `options.memory_budget`; only then is anything allocated. Too little memory is
    /// [`EngineError::InsufficientMemory`] here, never a failure in a round.
    pub fn with_draft(
        target: T,
        model: DraftModel,
        parts: DraftTargetParts<'a>,
        options: &EngineOptions,
    ) -> Result<Self> {
        let (startup, _, draft_plan) = DraftProposer::plan(&model, &parts, options)?;
        let (k, b) = (startup.draft_count as usize, startup.concurrency as usize);
        let kind = if model.geometry().dflash2.is_some() {
            ProposalKind::Top16
        } else {
            ProposalKind::OneHot
        };
        let tree = tree_nodes(&options.startup, kind)?;
        let mut plan = draft_plan;
        plan.extend(&engine_plan(target.info(), k, b, kind, tree));
        check_budget(&plan, options.memory_budget)?;
        let be = model.backend().clone();
        let proposer = DraftProposer::new(model, parts, options)?;
        Self::new(target, proposer, be, options)
    }
}

impl<T: Target, P: Proposer> Engine<T, P> {
    /// Start an engine over `target` and an already built `proposer`, on backend `be` (where
    /// the target's verify outputs and the verification buffers live; the proposer's backend).
    ///
    /// Checks the proposer against the options (K, B) and the target, then the memory plan
    /// (the proposer's bytes plus the engine's) against the budget before allocating the
    /// engine's buffers.
    pub fn new(target: T, proposer: P, be: Backend, options: &EngineOptions) -> Result<Self> {
        let k = options.startup.draft_count as usize;
        let b = options.startup.concurrency as usize;
        check_startup_numbers(k, b)?;
        if proposer.draft_count() != k {
            return Err(EngineError::ProposerMismatch {
                what: "draft count K",
                expected: k.to_string(),
                found: proposer.draft_count().to_string(),
            });
        }
        if proposer.rows() != b {
            return Err(EngineError::ProposerMismatch {
                what: "concurrency B",
                expected: b.to_string(),
                found: proposer.rows().to_string(),
            });
        }
        if options.max_context == 0 {
            return Err(EngineError::InvalidOption {
                option: "max_context",
                expected: "at least 1 position".into(),
                found: "0".into(),
            });
        }
        let info = target.info().clone();
        proposer.check_target(&info)?;
        let kind = proposer.kind();
        let tree = tree_nodes(&options.startup, kind)?;
        if tree.is_some() && !proposer.drafts_trees() {
            return Err(EngineError::Unsupported {
                option: "startup.tree_nodes",
                found: options.startup.tree_nodes.unwrap_or(0).to_string(),
                reason: "the proposer drafts chains only (Proposer::drafts_trees is false)",
            });
        }
        if tree.is_some() && !info.supports_trees {
            return Err(EngineError::Unsupported {
                option: "startup.tree_nodes",
                found: options.startup.tree_nodes.unwrap_or(0).to_string(),
                reason: "the target verifies chains only (TargetInfo::supports_trees is false)",
            });
        }
        let mut plan = proposer.memory_plan();
        plan.extend(&engine_plan(&info, k, b, kind, tree));
        check_budget(&plan, options.memory_budget)?;

        let w = k + 1;
        // Pinned staging for a round's host-to-device writes (CUDA; a no-op on the CPU):
        // the largest is the first history-count upload of B rows (B * vocab i32), the
        // rest (draft and verify metadata, materialize metadata) is a few KiB.
        be.reserve_staging(4 * b * info.vocab_rows + (256 << 10))?;
        let verify = VerifyWorkspace::new(
            &be,
            VerifyShape {
                max_rows: b,
                cols: tree.unwrap_or(w),
                vocab_rows: info.vocab_rows,
                public_vocab: info.public_vocab,
                kind,
            },
        )?;
        let mut verify = verify;
        verify.use_graphs(&be, !options.eager);
        let max_frontier = usize::try_from(verify.max_frontier()).unwrap_or(usize::MAX);
        let tree_features = match tree {
            Some(n) => Some(be.zeros(n * info.feature_width())?),
            None => None,
        };
        let sampler = Sampler::new(&be, info.vocab_rows, info.public_vocab)?;
        Ok(Engine {
            limit: options
                .max_context
                .min(info.max_positions)
                .min(max_frontier),
            target,
            proposer,
            be,
            k,
            b,
            kind,
            tree,
            tree_features,
            verify,
            sampler,
            active: Vec::new(),
            queue: VecDeque::new(),
            finished: HashMap::new(),
            pending_events: Vec::new(),
            next_id: 1,
            plan,
            stats: EngineStats {
                commits: vec![0; w + 1],
                ..EngineStats::default()
            },
        })
    }

    /// The memory plan checked at startup.
    pub fn memory_plan(&self) -> &MemoryPlan {
        &self.plan
    }

    /// Draft count K.
    pub fn draft_count(&self) -> usize {
        self.k
    }

    /// Concurrency B.
    pub fn concurrency(&self) -> usize {
        self.b
    }

    /// The backend of the verify outputs and verification.
    pub fn backend(&self) -> &Backend {
        &self.be
    }

    /// The target (read access).
    pub fn target(&self) -> &T {
        &self.target
    }

    /// The proposer (read access).
    pub fn proposer(&self) -> &P {
        &self.proposer
    }

    /// The verification's CUDA graphs: device rounds whose verification ops replayed a
    /// graph, graphs recorded, and why recording stopped, if it did
    /// ([`VerifyWorkspace::graph_state`]; none on the CPU or with [`EngineOptions::eager`]).
    pub fn verify_graphs(&self) -> (u64, u64, Option<&str>) {
        self.verify.graph_state()
    }

    /// Counters.
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// The longest request (prompt + budget) the engine accepts.
    pub fn request_limit(&self) -> usize {
        self.limit
    }

    /// Give back the target and the proposer (active requests are dropped without release).
    pub fn into_parts(self) -> (T, P) {
        (self.target, self.proposer)
    }

    fn fresh_id(&mut self) -> RequestId {
        let id = RequestId(self.next_id);
        self.next_id += 1;
        id
    }

    fn validate(&self, request: &Request) -> Result<()> {
        let info = self.target.info();
        request.validate(
            info.vocab_rows,
            info.public_vocab,
            self.limit,
            "engine max_context / target max_positions",
        )
    }

    /// Queue a request; the next [`Engine::step`] with a free slot admits it. Returns its id.
    /// Refused (typed, nothing queued) when the request is invalid or too long.
    pub fn submit(&mut self, request: Request) -> Result<RequestId> {
        self.validate(&request)?;
        let id = self.fresh_id();
        self.queue.push_back((id, request, CancelHandle::default()));
        Ok(id)
    }

    /// Ids of the active requests, in compact-batch order.
    pub fn active(&self) -> Vec<RequestId> {
        self.active.iter().map(|a| a.id).collect()
    }

    /// Requests waiting for a slot.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// True when nothing is active or queued.
    pub fn is_idle(&self) -> bool {
        self.active.is_empty() && self.queue.is_empty() && self.pending_events.is_empty()
    }

    fn find(&self, id: RequestId) -> Result<usize> {
        self.active
            .iter()
            .position(|a| a.id == id)
            .ok_or(EngineError::UnknownRequest { id })
    }

    /// The continuation metadata of an active request (its output so far included).
    pub fn continuation(&self, id: RequestId) -> Result<&Continuation> {
        Ok(&self.active[self.find(id)?].cont)
    }

    /// The target sequence of an active request.
    pub fn sequence(&self, id: RequestId) -> Result<SeqHandle> {
        Ok(self.active[self.find(id)?].seq)
    }

    /// An active request's draft coverage and committed target frontier.
    pub fn coverage(&self, id: RequestId) -> Result<(Coverage, usize)> {
        let a = &self.active[self.find(id)?];
        Ok((
            self.proposer.coverage(a.slot)?,
            self.target.frontier(a.seq)?,
        ))
    }

    /// Materialize an active request's pending features; afterwards its draft context covers
    /// exactly its target frontier ([`EngineError::CoverageMismatch`] otherwise).
    pub fn materialize(&mut self, id: RequestId) -> Result<()> {
        let i = self.find(id)?;
        self.materialize_row(i)
    }

    fn materialize_row(&mut self, i: usize) -> Result<()> {
        self.proposer.materialize(self.active[i].slot)?;
        self.check_coverage(i)
    }

    /// After a materialize: the active request's draft context covers exactly its target
    /// frontier ([`EngineError::CoverageMismatch`] otherwise).
    fn check_coverage(&self, i: usize) -> Result<()> {
        let a = &self.active[i];
        let cov = self.proposer.coverage(a.slot)?;
        let target = self.target.frontier(a.seq)?;
        if cov.pending != 0 || cov.materialized != target || target != a.cont.frontier {
            return Err(EngineError::CoverageMismatch {
                id: a.id,
                context: cov.frontier(),
                target,
            });
        }
        Ok(())
    }

    /// The cancellation flag of an active or queued request.
    pub fn cancel_handle(&self, id: RequestId) -> Result<CancelHandle> {
        if let Some(a) = self.active.iter().find(|a| a.id == id) {
            return Ok(a.cancel.clone());
        }
        self.queue
            .iter()
            .find(|q| q.0 == id)
            .map(|q| q.2.clone())
            .ok_or(EngineError::UnknownRequest { id })
    }

    /// Cancel a request: a queued one is dropped at once (its `Finished` event comes with the
    /// next step); an active one publishes nothing more: its next round previews N = 0,
    /// commits nothing and releases it.
    pub fn cancel(&mut self, id: RequestId) -> Result<()> {
        if let Some(pos) = self.queue.iter().position(|q| q.0 == id) {
            self.queue.remove(pos);
            self.finished.insert(
                id,
                Finished {
                    output: Vec::new(),
                    reason: FinishReason::Cancelled,
                },
            );
            self.pending_events.push(Event::Finished {
                id,
                reason: FinishReason::Cancelled,
                generated: 0,
            });
            return Ok(());
        }
        self.cancel_handle(id)?.cancel();
        Ok(())
    }

    /// The result of a finished request (kept until [`Engine::take_finished`]).
    pub fn finished(&self, id: RequestId) -> Option<&Finished> {
        self.finished.get(&id)
    }

    /// Remove and return the result of a finished request.
    pub fn take_finished(&mut self, id: RequestId) -> Option<Finished> {
        self.finished.remove(&id)
    }

    /// Remove an active request between rounds without a round: its target sequence and
    /// draft slot are released, and its continuation (output so far) returned. No event.
    pub fn release(&mut self, id: RequestId) -> Result<Continuation> {
        let i = self.find(id)?;
        let a = self.active.remove(i);
        let t = self.target.release(a.seq);
        let p = self.proposer.release(a.slot);
        t?;
        p?;
        Ok(a.cont)
    }

    /// Sequences and slots the engine holds (both equal the active request count unless a
    /// release failed).
    pub fn held(&self) -> (usize, usize) {
        (self.active.len(), self.proposer.live_slots())
    }

    /// Admit queued requests while slots are free, then run one round over every active
    /// request. Events go to `sink` as they are published. Returns `None` when there was
    /// nothing to do.
    ///
    /// Errors: a refusal before the target commit (proposer, target verify, verification)
    /// leaves every request as it was (pending verify records are released with N = 0). A
    /// failure while queueing a request's verified features after the commit releases that
    /// request and is returned once the round has been published for the others.
    pub fn step(&mut self, sink: &mut dyn FnMut(&Event)) -> Result<Option<StepReport>> {
        for e in std::mem::take(&mut self.pending_events) {
            sink(&e);
        }
        if self.active.is_empty() && self.queue.is_empty() {
            return Ok(None);
        }
        let mut report = StepReport::default();
        while self.active.len() < self.b {
            let Some((id, request, cancel)) = self.queue.pop_front() else {
                break;
            };
            if let Some(adm) = self.admit(id, request, cancel, sink)? {
                report.admitted.push(adm);
            }
        }
        if !self.active.is_empty() {
            report.rows = self.round(sink)?;
            report.round = self.stats.rounds;
        }
        Ok(Some(report))
    }

    /// Step until nothing is active or queued; returns the step reports.
    pub fn run(&mut self, sink: &mut dyn FnMut(&Event)) -> Result<Vec<StepReport>> {
        let mut reports = Vec::new();
        while let Some(r) = self.step(sink)? {
            reports.push(r);
        }
        Ok(reports)
    }

    /// Admission: prefill the prompt through the target, queue its captured features as the
    /// request's pending context and materialize them, sample the first output token (the
    /// anchor) from the prompt's last logits with the request's settings and seed
    /// (`Purpose::Decode` at position `T`; greedy at temperature 0) and publish it.
    fn admit(
        &mut self,
        id: RequestId,
        request: Request,
        cancel: CancelHandle,
        sink: &mut dyn FnMut(&Event),
    ) -> Result<Option<AdmissionReport>> {
        if cancel.is_cancelled() {
            self.finish_event(id, Vec::new(), FinishReason::Cancelled, sink);
            return Ok(None);
        }
        let t = request.prompt.len();
        let max_context = t + request.max_new_tokens;
        let slot = self.proposer.admit(max_context)?;
        let (seq, out) = match self.target.create_with_prompt(&self.be, &request.prompt) {
            Ok(x) => x,
            Err(e) => {
                let _ = self.proposer.release(slot);
                return Err(e.into());
            }
        };
        let vocab = self.target.info().vocab_rows;
        let go = || -> Result<(TokenHistory, u32)> {
            self.proposer.push_prefill(slot, 0, out.features)?;
            self.proposer.materialize(slot)?;
            let history = TokenHistory::with_tokens(vocab, &request.prompt)?;
            let anchor = self.sampler.sample(
                &self.be,
                (&out.last_logits).into(),
                &history,
                &request.sampling,
                request.seed,
                t as u64,
            )?;
            Ok((history, anchor))
        };
        let (mut history, anchor) = match go() {
            Ok(x) => x,
            Err(e) => {
                let _ = self.target.release(seq);
                let _ = self.proposer.release(slot);
                return Err(e);
            }
        };
        let (n, finish) = preview(
            &request.stop,
            &[],
            &[anchor],
            request.max_new_tokens,
            cancel.is_cancelled(),
        );
        let mut tokens = request.prompt.clone();
        if n == 1 {
            history.push(anchor)?;
            tokens.push(anchor);
            self.stats.tokens += 1;
            sink(&Event::Tokens {
                id,
                position: t,
                tokens: vec![anchor],
            });
        }
        let adm = AdmissionReport {
            id,
            prompt_len: t,
            anchor,
        };
        if let Some(reason) = finish {
            let rt = self.target.release(seq);
            let rp = self.proposer.release(slot);
            self.finish_event(id, tokens[t..].to_vec(), reason, sink);
            rt?;
            rp?;
            return Ok(Some(adm));
        }
        self.active.push(Active {
            id,
            seq,
            slot,
            cont: Continuation {
                request,
                tokens,
                frontier: t,
                rounds: 0,
                accepted: 0,
            },
            history,
            cancel,
        });
        Ok(Some(adm))
    }

    fn finish_event(
        &mut self,
        id: RequestId,
        output: Vec<u32>,
        reason: FinishReason,
        sink: &mut dyn FnMut(&Event),
    ) {
        let generated = output.len();
        self.finished.insert(id, Finished { output, reason });
        sink(&Event::Finished {
            id,
            reason,
            generated,
        });
    }

    /// Release the pending verify records of `seqs` (commit N = 0) after a failed round.
    fn abort_verify(&mut self, seqs: &[SeqHandle]) {
        let commits: Vec<Commit> = seqs.iter().map(|&s| Commit::prefix(s, 0)).collect();
        let _ = self.target.commit(&commits);
    }

    /// Steps 3-5 on the device, when the proposer leaves its round there
    /// ([`Proposer::propose_device`]): the draft block, the target's verify from the device
    /// inputs ([`Target::verify_device`]) and the verification ops are queued, and the one
    /// read of the round brings the outcomes with the proposals, which are then checked
    /// (public ids). `None`: the proposer proposes on the host only. The verify inputs and
    /// outcomes, per row.
    #[allow(clippy::type_complexity)] // reason: (inputs, outcomes) of the round
    fn device_round(
        &mut self,
        usable: &[usize],
        seqs: &[SeqHandle],
    ) -> Result<Option<(Vec<Vec<u32>>, Vec<RoundOutcome>)>> {
        let w = self.k + 1;
        let rows = propose_rows(&self.active, usable);
        let Some(round) = self.proposer.propose_device(&rows)? else {
            return Ok(None);
        };
        drop(rows);
        let columns: Vec<usize> = usable.iter().map(|&p| p + 1).collect();
        self.target.verify_device(
            &self.be,
            &crate::target::DeviceVerifyBatch {
                seqs,
                columns: &columns,
                ids: round.inputs,
                cols: w,
            },
        )?;
        let pending = {
            let drows: Vec<dflash_verify::DeviceRow<'_>> = self
                .active
                .iter()
                .zip(usable)
                .map(|(a, &p)| dflash_verify::DeviceRow {
                    anchor: a.cont.anchor().unwrap_or(0),
                    proposals: p,
                    settings: a.cont.request.sampling,
                    seed: a.cont.request.seed,
                    frontier: a.cont.frontier as u64,
                    history: &a.history,
                })
                .collect();
            self.target
                .verified()
                .map_err(EngineError::from)
                .and_then(|view| {
                    self.verify
                        .verify_device(&self.be, &drows, &round.proposals, view.logits)
                        .map_err(EngineError::from)
                })
        };
        let read = pending.and_then(|p| p.wait().map_err(EngineError::from));
        let (outcomes, proposals) = self.settle(seqs, read)?;
        let inputs = self
            .active
            .iter()
            .zip(proposals)
            .map(|(a, p)| {
                let mut v = Vec::with_capacity(p.len() + 1);
                v.push(a.cont.anchor().unwrap_or(0));
                v.extend(p);
                v
            })
            .collect();
        Ok(Some((inputs, outcomes)))
    }

    /// Steps 3-5 through the host: the proposals are read back and checked, then the
    /// target verifies them and the verification ops run over them.
    #[allow(clippy::type_complexity)] // reason: (inputs, outcomes) of the round
    fn host_round(
        &mut self,
        usable: &[usize],
        seqs: &[SeqHandle],
    ) -> Result<(Vec<Vec<u32>>, Vec<RoundOutcome>)> {
        let n = self.active.len();
        let w = self.k + 1;
        let public = self.target.info().public_vocab;
        let rows = propose_rows(&self.active, usable);
        let proposals = self.proposer.propose(&rows)?;
        drop(rows);
        if proposals.len() != n {
            return Err(EngineError::Proposer {
                reason: format!("{} proposals for {n} rows", proposals.len()),
            });
        }
        for (i, (p, &u)) in proposals.iter().zip(usable).enumerate() {
            if p.tokens.len() < u {
                return Err(EngineError::Proposer {
                    reason: format!("row {i}: {} tokens for P = {u}", p.tokens.len()),
                });
            }
            if let Some(&t) = p.tokens[..u].iter().find(|&&t| t as usize >= public) {
                return Err(EngineError::Proposer {
                    reason: format!("row {i}: proposed token {t} is not public (< {public})"),
                });
            }
            match (self.kind, &p.q) {
                (ProposalKind::OneHot, None) => {}
                (ProposalKind::Top16, Some(q)) if q.len() >= u => {}
                _ => {
                    return Err(EngineError::Proposer {
                        reason: format!(
                            "row {i}: the proposal distribution does not match {:?} for P = {u}",
                            self.kind
                        ),
                    });
                }
            }
        }
        let inputs: Vec<Vec<u32>> = self
            .active
            .iter()
            .zip(&proposals)
            .zip(usable)
            .map(|((a, p), &u)| {
                let mut v = Vec::with_capacity(u + 1);
                v.push(a.cont.anchor().unwrap_or(0));
                v.extend_from_slice(&p.tokens[..u]);
                v
            })
            .collect();
        {
            let vrows: Vec<VerifyRow<'_>> = seqs
                .iter()
                .zip(&inputs)
                .map(|(&s, t)| VerifyRow::chain(s, t))
                .collect();
            self.target.verify(
                &self.be,
                &VerifyBatch {
                    rows: &vrows,
                    cols: w,
                },
            )?;
        }
        let outcomes: Result<Vec<RoundOutcome>> = {
            let vrows: Vec<dflash_verify::VerifyRow<'_>> = self
                .active
                .iter()
                .zip(&proposals)
                .zip(usable)
                .map(|((a, p), &u)| dflash_verify::VerifyRow {
                    anchor: a.cont.anchor().unwrap_or(0),
                    proposals: &p.tokens[..u],
                    dist: match &p.q {
                        Some(q) => ProposalDist::Top16(&q[..u]),
                        None => ProposalDist::OneHot,
                    },
                    settings: a.cont.request.sampling,
                    seed: a.cont.request.seed,
                    frontier: a.cont.frontier as u64,
                    history: &a.history,
                })
                .collect();
            // The target's own logits, read in place.
            self.target
                .verified()
                .map_err(EngineError::from)
                .and_then(|view| {
                    self.verify
                        .verify(&self.be, &vrows, view.logits)
                        .map_err(EngineError::from)
                })
        };
        let (outcomes, ()) = self.settle(seqs, outcomes.map(|o| (o, ())))?;
        Ok((inputs, outcomes))
    }

    /// Steps 3-5 of a tree round (`startup.tree_nodes`), through the host: the proposer's
    /// trees (at most `nodes` nodes, none deeper than the row's `P`) are read back and
    /// checked, the target verifies them (attention by ancestry, RoPE at `F + depth`) and
    /// `verify_tree` walks them. The verify inputs (anchor, then every node's token) and the
    /// outcomes, per row.
    #[allow(clippy::type_complexity)] // reason: (inputs, outcomes) of the round
    fn tree_round(
        &mut self,
        nodes: usize,
        usable: &[usize],
        seqs: &[SeqHandle],
    ) -> Result<(Vec<Vec<u32>>, Vec<TreeOutcome>)> {
        let n = self.active.len();
        let public = self.target.info().public_vocab;
        let rows = propose_rows(&self.active, usable);
        let trees = self.proposer.propose_tree(&rows, nodes)?;
        drop(rows);
        if trees.len() != n {
            return Err(EngineError::Proposer {
                reason: format!("{} trees for {n} rows", trees.len()),
            });
        }
        let mut child_q: Vec<Vec<RetainedQ>> = Vec::with_capacity(n);
        for (i, ((t, &u), a)) in trees.iter().zip(usable).zip(&self.active).enumerate() {
            let bad = |reason: String| EngineError::Proposer {
                reason: format!("row {i}: {reason}"),
            };
            let m = t.tokens.len();
            if !(1..=nodes).contains(&m) || t.parents.len() + 1 != m || t.depth.len() != m {
                return Err(bad(format!(
                    "a tree of {m} tokens, {} parents and {} depths (at most {nodes} nodes)",
                    t.parents.len(),
                    t.depth.len()
                )));
            }
            if t.tokens[0] != a.cont.anchor().unwrap_or(0) {
                return Err(bad(format!("node 0 holds {}, not the anchor", t.tokens[0])));
            }
            if let Some(&d) = t.depth.iter().find(|&&d| d as usize > u) {
                return Err(bad(format!("a node at depth {d} with P = {u}")));
            }
            if let Some(&tok) = t.tokens[1..].iter().find(|&&x| x as usize >= public) {
                return Err(bad(format!(
                    "proposed token {tok} is not public (< {public})"
                )));
            }
            let mut qs = Vec::with_capacity(m - 1);
            for nd in 0..m - 1 {
                let (ids, q) = match (t.child_ids.get(nd), t.child_q.get(nd)) {
                    (Some(ids), Some(q)) => (ids, q),
                    _ => return Err(bad(format!("no child distribution for node {nd}"))),
                };
                let mut rq = RetainedQ {
                    ids: [0; dflash_verify::TOP],
                    q: *q,
                };
                for (dst, &id) in rq.ids.iter_mut().zip(ids) {
                    // A node at depth K has no candidates (zeros), and no children: unread.
                    *dst = u32::try_from(id)
                        .map_err(|_| bad(format!("node {nd} has the candidate id {id}")))?;
                }
                qs.push(rq);
            }
            child_q.push(qs);
        }
        let inputs: Vec<Vec<u32>> = trees.iter().map(|t| t.tokens.clone()).collect();
        {
            let vrows: Vec<VerifyRow<'_>> = seqs
                .iter()
                .zip(&inputs)
                .zip(&trees)
                .map(|((&s, tok), t)| VerifyRow {
                    seq: s,
                    tokens: tok,
                    parents: Some(&t.parents),
                })
                .collect();
            self.target.verify(
                &self.be,
                &VerifyBatch {
                    rows: &vrows,
                    cols: nodes,
                },
            )?;
        }
        let outcomes: Result<Vec<TreeOutcome>> = {
            let trows: Vec<TreeRow<'_>> = self
                .active
                .iter()
                .zip(&inputs)
                .zip(&trees)
                .zip(&child_q)
                .map(|(((a, tok), t), qs)| TreeRow {
                    anchor: tok[0],
                    tokens: &tok[1..],
                    parents: &t.parents,
                    child_q: qs,
                    settings: a.cont.request.sampling,
                    seed: a.cont.request.seed,
                    frontier: a.cont.frontier as u64,
                    history: &a.history,
                })
                .collect();
            self.target
                .verified()
                .map_err(EngineError::from)
                .and_then(|view| {
                    self.verify
                        .verify_tree(&self.be, &trows, view.logits)
                        .map_err(EngineError::from)
                })
        };
        let (outcomes, ()) = self.settle(seqs, outcomes.map(|o| (o, ())))?;
        Ok((inputs, outcomes))
    }

    /// A verification's result: one outcome per active row, else the target's pending verify
    /// is released (nothing committed) and the error returned.
    fn settle<O, X>(
        &mut self,
        seqs: &[SeqHandle],
        read: Result<(Vec<O>, X)>,
    ) -> Result<(Vec<O>, X)> {
        let n = self.active.len();
        match read {
            Ok((o, x)) if o.len() == n => Ok((o, x)),
            Ok((o, _)) => {
                self.abort_verify(seqs);
                Err(EngineError::Proposer {
                    reason: format!("verification returned {} outcomes for {n} rows", o.len()),
                })
            }
            Err(e) => {
                self.abort_verify(seqs);
                Err(e)
            }
        }
    }

    /// One round over every active request (see the crate docs for the transaction).
    fn round(&mut self, sink: &mut dyn FnMut(&Event)) -> Result<Vec<RowReport>> {
        let n = self.active.len();
        let w = self.k + 1;
        // 1. Materialize pending target features so every context reaches its frontier (all
        //    requests in one call).
        let mut before = Vec::with_capacity(n);
        for a in &self.active {
            before.push(self.proposer.coverage(a.slot)?);
        }
        let slots: Vec<P::Slot> = self.active.iter().map(|a| a.slot).collect();
        self.proposer.materialize_all(&slots)?;
        for i in 0..n {
            self.check_coverage(i)?;
        }
        // 2. P per request: K, cut so that the L <= P + 1 outputs fit the budget.
        let usable: Vec<usize> = self
            .active
            .iter()
            .map(|a| self.k.min(a.budget_left().saturating_sub(1)))
            .collect();
        // 3-5. One masked draft block for the compact batch, the causal target verify of
        //      Q = P + 1 columns per row, acceptance and correction / bonus: on the device
        //      when the proposer can (one read, of the outcome), else through the host.
        let seqs: Vec<SeqHandle> = self.active.iter().map(|a| a.seq).collect();
        // A tree round verifies `nodes` columns a row (through the host), a chain round W.
        let (cols, inputs, outcomes): (usize, Vec<Vec<u32>>, Vec<Verified>) = match self.tree {
            Some(nodes) => {
                let (inputs, trees) = self.tree_round(nodes, &usable, &seqs)?;
                let v = trees
                    .into_iter()
                    .zip(&usable)
                    .map(|(t, &p)| Verified::tree(t, p))
                    .collect();
                (nodes, inputs, v)
            }
            None => {
                let (inputs, chains) = match self.device_round(&usable, &seqs)? {
                    Some(r) => r,
                    None => self.host_round(&usable, &seqs)?,
                };
                (w, inputs, chains.into_iter().map(Verified::chain).collect())
            }
        };
        // 6. Frontend preview: N in 0..=L per request.
        let decisions: Vec<(usize, Option<FinishReason>)> = self
            .active
            .iter()
            .zip(&outcomes)
            .map(|(a, o)| {
                preview(
                    &a.cont.request.stop,
                    a.cont.output(),
                    o.outputs(),
                    a.budget_left(),
                    a.cancel.is_cancelled(),
                )
            })
            .collect();
        // 7. Commit N target input rows per request (N = 0 releases the records): a chain's
        //    first N columns, a tree's first N accepted path nodes.
        let commits: Vec<Commit> = seqs
            .iter()
            .zip(&decisions)
            .zip(&outcomes)
            .map(|((&s, &(nn, _)), o)| match &o.path {
                None => Commit::prefix(s, nn),
                Some(path) => Commit {
                    seq: s,
                    accepted: Accepted::Path(path[..nn].iter().map(|&c| c as u32).collect()),
                },
            })
            .collect();
        if let Err(e) = self.target.commit(&commits) {
            self.abort_verify(&seqs);
            return Err(e.into());
        }
        // 8. Pending context work, state advance, publication.
        self.stats.rounds += 1;
        let mut reports = Vec::with_capacity(n);
        let mut first_error = None;
        let mut leaving = Vec::new();
        for (i, ((o, &(nn, finish)), cov)) in
            outcomes.iter().zip(&decisions).zip(before).enumerate()
        {
            let a = &mut self.active[i];
            let f = a.cont.frontier;
            let published = o.outputs()[..nn].to_vec();
            let mut failed = false;
            if nn > 0 {
                // The target's features of this verify, read in place (still lent after the
                // commit, until its next verify): the committed columns, one run of adjacent
                // columns for a chain; a tree path that leaves the chain is compacted into the
                // scratch first (one device copy per run of its columns), so the draft always
                // takes the commit's rows as one run.
                let runs = o.column_runs(nn);
                let fw = self.target.info().feature_width();
                let pushed = self
                    .target
                    .verified()
                    .map_err(EngineError::from)
                    .and_then(|view| match self.tree_features.as_mut() {
                        Some(scratch) if runs.len() > 1 => {
                            for &(at, first, len) in &runs {
                                self.be.copy(
                                    view.features,
                                    (i * cols + first) * fw,
                                    scratch,
                                    at * fw,
                                    len * fw,
                                )?;
                            }
                            self.proposer.push_verified(a.slot, f, scratch, 0, nn)
                        }
                        _ => runs.iter().try_for_each(|&(at, first, len)| {
                            self.proposer.push_verified(
                                a.slot,
                                f + at,
                                view.features,
                                i * cols + first,
                                len,
                            )
                        }),
                    });
                let hist = a.history.extend(&published);
                if let Err(e) = pushed.and(hist.map_err(EngineError::from)) {
                    failed = true;
                    first_error.get_or_insert(e);
                }
                a.cont.tokens.extend_from_slice(&published);
                a.cont.frontier += nn;
            }
            a.cont.rounds += 1;
            a.cont.accepted += o.accepted() as u64;
            self.stats.row_rounds += 1;
            self.stats.proposed += o.proposals() as u64;
            self.stats.accepted += o.accepted() as u64;
            self.stats.tokens += nn as u64;
            if let Some(c) = self.stats.commits.get_mut(nn) {
                *c += 1;
            }
            reports.push(RowReport {
                id: a.id,
                frontier: f,
                context_before: cov,
                anchor: inputs[i][0],
                proposed: inputs[i][1..].to_vec(),
                tree_path: o.path.clone().unwrap_or_default(),
                accepted: o.accepted(),
                licensed: o.outputs().to_vec(),
                committed: nn,
                finish,
            });
            if nn > 0 {
                sink(&Event::Tokens {
                    id: a.id,
                    position: f + 1,
                    tokens: published,
                });
            }
            if failed || finish.is_some() {
                leaving.push(i);
            }
        }
        // Requests that ended leave the batch (in reverse so indices stay valid).
        for &i in leaving.iter().rev() {
            let a = self.active.remove(i);
            let rt = self.target.release(a.seq);
            let rp = self.proposer.release(a.slot);
            if let Err(e) = rt {
                first_error.get_or_insert(e.into());
            }
            if let Err(e) = rp {
                first_error.get_or_insert(e);
            }
            let reason = reports[i].finish.unwrap_or(FinishReason::Cancelled);
            let output = a.cont.output().to_vec();
            self.finish_event(a.id, output, reason, sink);
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(reports),
        }
    }

    fn require_free_slot(&self) -> Result<()> {
        if self.active.len() >= self.b {
            return Err(EngineError::Busy { capacity: self.b });
        }
        Ok(())
    }

    /// Fork an active request: a new request with a copy of its target state, draft context
    /// (materialized first) and continuation metadata, optionally with another seed (the
    /// fork's later random decisions then differ). Needs a free slot.
    pub fn fork(&mut self, id: RequestId, seed: Option<u64>) -> Result<RequestId> {
        let i = self.find(id)?;
        self.require_free_slot()?;
        self.materialize_row(i)?;
        let (seq, slot) = (self.active[i].seq, self.active[i].slot);
        let seq2 = self.target.fork(seq)?;
        let slot2 = match self.proposer.fork(slot) {
            Ok(s) => s,
            Err(e) => {
                let _ = self.target.release(seq2);
                return Err(e);
            }
        };
        let new_id = self.fresh_id();
        let a = &self.active[i];
        let mut cont = a.cont.clone();
        if let Some(s) = seed {
            cont.request.seed = s;
        }
        let active = Active {
            id: new_id,
            seq: seq2,
            slot: slot2,
            cont,
            history: a.history.clone(),
            cancel: CancelHandle::default(),
        };
        self.active.push(active);
        Ok(new_id)
    }

    fn image_parts(&mut self, id: RequestId) -> Result<usize> {
        let i = self.find(id)?;
        self.materialize_row(i)?;
        Ok(i)
    }

    fn check_image_coverage(target: usize, draft: usize, cont: &Continuation) -> Result<()> {
        if target != draft || draft != cont.frontier {
            return Err(EngineError::ImageCoverageMismatch {
                target,
                draft,
                continuation: cont.frontier,
            });
        }
        Ok(())
    }

    /// A device checkpoint of a whole active request (target state, draft context after
    /// materialize, continuation metadata), all at the request's frontier.
    pub fn checkpoint(&mut self, id: RequestId) -> Result<RequestImage<T::Checkpoint, P::Image>> {
        let i = self.image_parts(id)?;
        let a = &self.active[i];
        let target = self.target.checkpoint(a.seq)?;
        let draft = self.proposer.checkpoint(a.slot)?;
        Self::check_image_coverage(target.frontier(), P::image_frontier(&draft), &a.cont)?;
        Ok(RequestImage {
            target,
            draft,
            continuation: a.cont.clone(),
        })
    }

    /// A host replica of a whole active request (the draft context copied to the host).
    pub fn host_replica(
        &mut self,
        id: RequestId,
    ) -> Result<RequestImage<T::Checkpoint, P::HostImage>> {
        let i = self.image_parts(id)?;
        let a = &self.active[i];
        let target = self.target.checkpoint(a.seq)?;
        let draft = self.proposer.host_replica(a.slot)?;
        Self::check_image_coverage(target.frontier(), P::host_image_frontier(&draft), &a.cont)?;
        Ok(RequestImage {
            target,
            draft,
            continuation: a.cont.clone(),
        })
    }

    fn check_continuation(&self, c: &Continuation) -> Result<TokenHistory> {
        self.validate(&c.request)?;
        let t = c.request.prompt.len();
        let bad = |what: String| Err(EngineError::ImageMismatch { what });
        if c.tokens.len() != c.frontier + 1 {
            return bad(format!(
                "{} tokens for frontier {} (expected F + 1)",
                c.tokens.len(),
                c.frontier
            ));
        }
        if c.frontier < t || c.tokens[..t] != c.request.prompt[..] {
            return bad("the tokens do not start with the prompt".into());
        }
        let generated = c.tokens.len() - t;
        if generated == 0 || generated >= c.request.max_new_tokens {
            return bad(format!(
                "{generated} generated tokens: a resumable request has 1..{} (its budget)",
                c.request.max_new_tokens
            ));
        }
        Ok(TokenHistory::with_tokens(
            self.target.info().vocab_rows,
            &c.tokens,
        )?)
    }

    fn restore_with<D>(
        &mut self,
        image: &RequestImage<T::Checkpoint, D>,
        draft_frontier: usize,
        admit: impl FnOnce(&mut P, usize, &D, usize) -> Result<P::Slot>,
    ) -> Result<RequestId> {
        self.require_free_slot()?;
        let cont = &image.continuation;
        Self::check_image_coverage(image.target.frontier(), draft_frontier, cont)?;
        let history = self.check_continuation(cont)?;
        let seq = self.target.create()?;
        if let Err(e) = self.target.restore(seq, &image.target) {
            let _ = self.target.release(seq);
            return Err(e.into());
        }
        let frontier = match self.target.frontier(seq) {
            Ok(f) => f,
            Err(e) => {
                let _ = self.target.release(seq);
                return Err(e.into());
            }
        };
        let max_context = cont.request.prompt.len() + cont.request.max_new_tokens;
        let slot = match admit(&mut self.proposer, max_context, &image.draft, frontier) {
            Ok(s) => s,
            Err(e) => {
                let _ = self.target.release(seq);
                return Err(e);
            }
        };
        let id = self.fresh_id();
        self.active.push(Active {
            id,
            seq,
            slot,
            cont: cont.clone(),
            history,
            cancel: CancelHandle::default(),
        });
        Ok(id)
    }

    /// Restore a device checkpoint as a new active request (needs a free slot). The three
    /// coverages must agree ([`EngineError::ImageCoverageMismatch`]).
    pub fn restore(&mut self, image: &RequestImage<T::Checkpoint, P::Image>) -> Result<RequestId> {
        let df = P::image_frontier(&image.draft);
        self.restore_with(image, df, |p, m, d, f| p.admit_restored(m, d, f))
    }

    /// Restore a host replica as a new active request (needs a free slot).
    pub fn restore_host(
        &mut self,
        image: &RequestImage<T::Checkpoint, P::HostImage>,
    ) -> Result<RequestId> {
        let df = P::host_image_frontier(&image.draft);
        self.restore_with(image, df, |p, m, d, f| p.admit_restored_host(m, d, f))
    }
}
