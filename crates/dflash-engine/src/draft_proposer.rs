//! [`DraftProposer`]: the DFlash / DFlash2 draft model as the engine's [`Proposer`].
//!
//! It owns the bound draft model, the target parts the draft borrows (embedding and proposal
//! head, on the draft's backend), the context store (one lane per concurrency slot) and the
//! round workspace planned for (B, K, head). Everything is allocated in [`DraftProposer::new`];
//! [`DraftProposer::plan`] computes the same bytes without allocating (the tree lattice
//! scratch of a DFlash2 draft: when `startup.tree_nodes` is set; otherwise at the first
//! [`Proposer::propose_tree`], outside the plan).
//!
//! Tree rounds ([`Proposer::propose_tree`], DFlash2): the block runs as for a chain, then
//! [`Workspace::read_lattice`] gathers the codebook rows a tree can read on the backend and
//! reads them back with the chain, and each row's tree is built on the host
//! ([`dflash_draft::tree`]) and truncated to the row's `P`.

use dflash_config::{ProposalHead, Startup};
use dflash_context::{Capacity, ContextHandle, ContextImage, ContextStore, HostContextImage};
use dflash_draft::tree::{self, DraftTree, LatticeScratch, TreeOptions};
use dflash_draft::{
    DraftModel, HeadParts, RowRequest, TOP_K, TargetParts, Workspace, WorkspaceSpec,
};
use dflash_ops::{Backend, Buffer, Graph, Held, bf16, sliding_window_attention, softmax_attention};
use dflash_verify::{ProposalKind, RetainedQ};

use crate::error::{EngineError, Result};
use crate::options::{EngineOptions, MemoryPlan};
use crate::proposer::{Coverage, Proposal, ProposeRow, Proposer};
use crate::target::TargetInfo;

/// The proposal head the draft reads from the target: the host's own memory
/// ([`Held::Borrowed`], no copy) or buffers uploaded for the draft ([`Held::Owned`]), on the
/// draft's backend.
#[derive(Debug)]
pub enum DraftHead<'a> {
    /// The target's full output head `[vocab_rows, H]` BF16.
    Full {
        /// `lm_head.weight`.
        output_head: Held<'a, bf16>,
    },
    /// A shortlist `[rows, H]` BF16 gathered from the output head, with its row -> global id
    /// map `[rows]` I32 (unique public ids).
    Indexed {
        /// The shortlist rows.
        rows: Held<'a, bf16>,
        /// Row -> global token id.
        token_ids: Held<'a, i32>,
    },
}

/// The target parts the draft uses, on the draft's backend: borrowed from the host engine
/// (`Held::Borrowed` views of the target's own embedding and head: nothing is copied and
/// the memory plan counts none of it) or owned.
#[derive(Debug)]
pub struct DraftTargetParts<'a> {
    /// Embedding rows (the target's padded vocabulary).
    pub vocab_rows: usize,
    /// Public vocabulary size.
    pub public_vocab: usize,
    /// The target's token embedding `[vocab_rows, H]` BF16.
    pub embedding: Held<'a, bf16>,
    /// The proposal head.
    pub head: DraftHead<'a>,
}

impl DraftTargetParts<'_> {
    /// The borrowed view the draft forward takes.
    pub fn view(&self) -> TargetParts<'_> {
        TargetParts {
            vocab_rows: self.vocab_rows,
            public_vocab: self.public_vocab,
            embedding: &self.embedding,
            head: match &self.head {
                DraftHead::Full { output_head } => HeadParts::Full { output_head },
                DraftHead::Indexed { rows, token_ids } => HeadParts::Indexed { rows, token_ids },
            },
        }
    }

    /// Bytes the parts allocated on the draft's backend (borrowed parts: none).
    pub fn owned_bytes(&self) -> u64 {
        let head = match &self.head {
            DraftHead::Full { output_head } => output_head.owned_bytes(),
            DraftHead::Indexed { rows, token_ids } => rows.owned_bytes() + token_ids.owned_bytes(),
        };
        self.embedding.owned_bytes() + head
    }
}

/// The draft model, its context storage and round workspace as a [`Proposer`].
#[derive(Debug)]
pub struct DraftProposer<'a> {
    model: DraftModel,
    parts: DraftTargetParts<'a>,
    startup: Startup,
    store: ContextStore,
    ws: Workspace,
    plan: MemoryPlan,
    /// The target's verify input of a device round `[B, W]` I32: per row the anchor, then the
    /// K proposals (assembled on the device after the block).
    inputs: Buffer<i32>,
    /// The draft block's CUDA graph per live-row bucket (empty when eager).
    profiles: Vec<Profile>,
    /// Why the block runs eagerly (`None` when graph profiles replay it).
    eager: Option<String>,
    /// Rounds replayed from a graph profile.
    replays: u64,
    /// The device scratch of tree rounds' lattice readback (DFlash2): allocated in
    /// [`DraftProposer::new`] when `startup.tree_nodes` is set, else at the first tree round.
    lattice: Option<LatticeScratch>,
}

/// A live-row bucket and the draft block (block forward, head / selector) captured for it.
#[derive(Debug)]
struct Profile {
    rows: usize,
    graph: Graph,
}

/// The verify input of the first `rows` rows: the block's ids (`[anchor, MASK x K]` per row)
/// with the K proposals copied over the mask columns.
fn assemble_inputs(
    be: &Backend,
    ws: &Workspace,
    inputs: &mut Buffer<i32>,
    rows: usize,
) -> dflash_ops::Result<()> {
    let k = ws.draft_count();
    let w = k + 1;
    be.copy(&ws.ids, 0, inputs, 0, rows * w)?;
    be.copy_rows(&ws.proposals, 0, k, inputs, 1, w, k, rows)
}

/// A draft refusal inside a capture, as the backend's error (the capture fails with it).
fn draft_to_ops(e: dflash_draft::DraftError) -> dflash_ops::OpsError {
    match e {
        dflash_draft::DraftError::Ops(e) => e,
        other => dflash_ops::OpsError::Capture {
            problem: format!("the draft block refused to run: {other}"),
        },
    }
}

/// The live-row buckets of a batch of `b` rows: the powers of two below `b`, then `b`. A
/// round of n requests replays the smallest bucket of at least n rows (its padding rows
/// repeat the last request and are never reported).
pub fn live_row_buckets(b: usize) -> Vec<usize> {
    let mut out: Vec<usize> = std::iter::successors(Some(1usize), |m| m.checked_mul(2))
        .take_while(|&m| m < b)
        .collect();
    out.push(b.max(1));
    out
}

fn invalid(option: &'static str, expected: impl Into<String>, found: impl ToString) -> EngineError {
    EngineError::InvalidOption {
        option,
        expected: expected.into(),
        found: found.to_string(),
    }
}

impl<'a> DraftProposer<'a> {
    /// Validate the startup options against the model's checkpoint and the target parts, and
    /// compute every device allocation the proposer makes (no allocation here).
    ///
    /// Errors: [`EngineError::Config`] (backend mismatch, K, B, head rows, mask token),
    /// [`EngineError::TargetMismatch`] for target parts that do not fit the draft,
    /// [`EngineError::InvalidOption`] for a zero `max_context` or `page_size`.
    pub fn plan(
        model: &DraftModel,
        parts: &DraftTargetParts<'_>,
        options: &EngineOptions,
    ) -> Result<(Startup, Capacity, MemoryPlan)> {
        let g = model.geometry();
        let startup = options.startup.validate(g)?;
        if options.max_context == 0 || options.max_context > i32::MAX as usize / 2 {
            return Err(invalid(
                "max_context",
                "1..=2^30 positions",
                options.max_context,
            ));
        }
        if options.page_size == 0 {
            return Err(invalid("page_size", "at least 1 token", options.page_size));
        }
        let mismatch = |what: &'static str, target: String, draft: String| {
            Err(EngineError::TargetMismatch {
                what,
                target,
                draft,
            })
        };
        if parts.vocab_rows != g.vocab_rows as usize {
            return mismatch(
                "vocabulary rows",
                parts.vocab_rows.to_string(),
                g.vocab_rows.to_string(),
            );
        }
        if parts.public_vocab != startup.public_vocab_size as usize {
            return mismatch(
                "public vocabulary",
                parts.public_vocab.to_string(),
                startup.public_vocab_size.to_string(),
            );
        }
        let hidden = g.hidden as usize;
        let view = parts.view();
        view.check(hidden, g.vocab_rows as usize)?;
        let shape = view.head_shape(hidden);
        match (startup.proposal_head, &parts.head) {
            (ProposalHead::Full, DraftHead::Full { .. }) => {}
            (ProposalHead::Indexed { rows }, DraftHead::Indexed { .. })
                if rows as usize == shape.rows => {}
            (want, _) => {
                return mismatch(
                    "proposal head",
                    format!("{:?} with {} rows", shape.kind, shape.rows),
                    format!("{want:?}"),
                );
            }
        }
        let capacity = Capacity::new(
            startup.concurrency as usize,
            options.max_context,
            options.page_size,
        );
        let cg = model.context_geometry()?;
        let fw = cg.feature_width() as u64;
        let w = startup.block_width as u64;
        let mut plan = MemoryPlan::default();
        plan.push("draft weights", weight_bytes(model));
        plan.push("draft target parts", parts.owned_bytes());
        plan.push("context pools", capacity.pool_bytes(&cg).total());
        plan.push(
            "draft workspace",
            workspace_bytes(model, &startup, &capacity, shape.rows),
        );
        if let (Some(_), Some(d2)) = (startup.tree_nodes, &g.dflash2) {
            plan.push(
                "tree lattice scratch",
                LatticeScratch::bytes_for(
                    startup.concurrency as usize,
                    startup.draft_count as usize,
                    d2.selector_rank as usize,
                ),
            );
        }
        plan.push("verify inputs", 4 * u64::from(startup.concurrency) * w);
        plan.push(
            "pending verify features and materialize scratch",
            ContextStore::round_staging_bytes(&cg, &capacity, w as usize),
        );
        plan.push(
            "admission prompt features",
            options.max_context as u64 * fw * 2,
        );
        Ok((startup, capacity, plan))
    }

    /// Plan ([`DraftProposer::plan`]) and allocate: the context store (B lanes, pages for
    /// `max_context` each when the draft has full layers), the round workspace and the
    /// feature staging, all on the model's backend.
    pub fn new(
        model: DraftModel,
        parts: DraftTargetParts<'a>,
        options: &EngineOptions,
    ) -> Result<Self> {
        let (startup, capacity, plan) = Self::plan(&model, &parts, options)?;
        let be = model.backend().clone();
        let store = ContextStore::with_round_staging(
            be.clone(),
            model.context_geometry()?,
            capacity,
            startup.block_width as usize,
        )?;
        let spec = WorkspaceSpec::from_startup(&startup, parts.vocab_rows);
        let ws = Workspace::new(&model, &store, &spec)?;
        let lattice = match startup.tree_nodes {
            Some(_) => Some(ws.lattice_scratch()?),
            None => None,
        };
        let inputs = be.zeros(startup.concurrency as usize * startup.block_width as usize)?;
        let mut me = DraftProposer {
            model,
            parts,
            startup,
            store,
            ws,
            plan,
            inputs,
            profiles: Vec::new(),
            eager: None,
            replays: 0,
            lattice,
        };
        me.eager = if options.eager {
            Some("eager mode was asked for (EngineOptions::eager)".into())
        } else {
            be.can_capture().err()
        };
        if me.eager.is_none() {
            me.capture_profiles()?;
        }
        Ok(me)
    }

    /// Capture the draft block once per live-row bucket: placeholder rows are staged, the
    /// block runs once eagerly (loading its kernels and library handles), then is recorded.
    fn capture_profiles(&mut self) -> Result<()> {
        let DraftProposer {
            model,
            parts,
            store,
            ws,
            inputs,
            profiles,
            ..
        } = self;
        let view = parts.view();
        let be = model.backend();
        for rows in live_row_buckets(ws.rows()) {
            model.stage_idle(store, rows, ws)?;
            model.run_block(store, &view, ws)?;
            assemble_inputs(be, ws, inputs, rows)?;
            let graph = be.capture(|| {
                model.run_block(store, &view, ws).map_err(draft_to_ops)?;
                assemble_inputs(be, ws, inputs, rows)
            })?;
            profiles.push(Profile { rows, graph });
        }
        model.capture_materialize(store)?;
        // The placeholder rounds' results are never read; let them finish here, at startup.
        model.backend().synchronize()?;
        Ok(())
    }

    /// The live-row buckets the draft block replays from a CUDA graph (empty when eager).
    pub fn graph_profiles(&self) -> Vec<usize> {
        self.profiles.iter().map(|p| p.rows).collect()
    }

    /// Why the draft block runs op by op (`None` when graph profiles replay it): eager mode
    /// was asked for, or the backend cannot capture (the CPU; event tracking on).
    pub fn eager_reason(&self) -> Option<&str> {
        self.eager.as_deref()
    }

    /// Stage the rows and queue the draft block (its graph profile for the smallest bucket
    /// that holds them, else op by op) and the verify input's assembly; nothing is read.
    fn queue_block(&mut self, rows: &[ProposeRow<'_, ContextHandle>]) -> Result<()> {
        let reqs: Vec<RowRequest> = rows
            .iter()
            .map(|r| RowRequest {
                handle: r.slot,
                anchor: r.anchor,
                usable: r.usable,
                temperature: r.temperature,
                seed: r.seed,
            })
            .collect();
        let n = reqs.len();
        match self.profiles.iter().find(|p| p.rows >= n) {
            Some(p) => {
                self.model
                    .stage_padded(&self.store, &reqs, p.rows, &mut self.ws)?;
                p.graph.launch()?;
                self.replays += 1;
            }
            None => {
                self.model.stage(&self.store, &reqs, &mut self.ws)?;
                self.model
                    .run_block(&self.store, &self.parts.view(), &mut self.ws)?;
                assemble_inputs(self.model.backend(), &self.ws, &mut self.inputs, n)?;
            }
        }
        Ok(())
    }

    /// The tree round after [`DraftProposer::queue_block`]: read the lattice of the staged
    /// rows and build each row's tree (checked by [`Proposer::propose_tree`]).
    fn read_trees(
        &mut self,
        rows: &[ProposeRow<'_, ContextHandle>],
        nodes: usize,
    ) -> Result<Vec<DraftTree>> {
        let scratch = match &mut self.lattice {
            Some(s) => s,
            None => self.lattice.insert(self.ws.lattice_scratch()?),
        };
        let lattices = self.ws.read_lattice(&self.model, scratch)?;
        if lattices.len() != rows.len() {
            return Err(EngineError::Proposer {
                reason: format!(
                    "the draft read {} lattices for {} rows",
                    lattices.len(),
                    rows.len()
                ),
            });
        }
        let public = self.parts.public_vocab;
        lattices
            .iter()
            .zip(rows)
            .enumerate()
            .map(|(i, (lat, row))| {
                // Every tree token is the anchor or a candidate: top-16 ids are public by
                // the head's contract; a draft that breaks it is refused, not verified.
                if let Some(&id) = lat
                    .candidate_ids
                    .iter()
                    .find(|&&id| !usize::try_from(id).is_ok_and(|id| id < public))
                {
                    return Err(EngineError::Proposer {
                        reason: format!(
                            "row {i}: the selector's candidate id {id} is not a public id \
(< {public})"
                        ),
                    });
                }
                let opts = TreeOptions {
                    nodes,
                    temperature: row.temperature,
                    seed: row.seed,
                    frontier: row.frontier as u64,
                };
                Ok(lat.build(&opts)?.truncated(row.usable))
            })
            .collect()
    }

    /// Rows the last draft block computed: the live requests when run eagerly, the
    /// bucket's rows when replayed from a graph profile.
    pub fn last_block_rows(&self) -> usize {
        self.ws.physical_rows()
    }

    /// Rounds whose draft block was replayed from a graph profile.
    pub fn graph_replays(&self) -> u64 {
        self.replays
    }

    /// The validated startup.
    pub fn startup(&self) -> &Startup {
        &self.startup
    }

    /// The context store (read access, for inspection and leak checks).
    pub fn store(&self) -> &ContextStore {
        &self.store
    }

    /// The target parts the draft reads (borrowed or owned, as they were passed).
    pub fn target_parts(&self) -> &DraftTargetParts<'a> {
        &self.parts
    }

    /// The draft model.
    pub fn model(&self) -> &DraftModel {
        &self.model
    }

    /// The round workspace (its [`Workspace::bytes`] are the plan's "draft workspace").
    pub fn workspace(&self) -> &Workspace {
        &self.ws
    }

    /// The backend everything lives on.
    pub fn backend(&self) -> &Backend {
        self.model.backend()
    }
}

/// Bytes of the bound weights (every role buffer, BF16).
fn weight_bytes(model: &DraftModel) -> u64 {
    let w = model.weights();
    let mut n = (w.fc.len() + w.hidden_norm.len() + w.norm.len()) as u64;
    for l in &w.layers {
        n += [
            &l.input_norm,
            &l.post_attention_norm,
            &l.qkv_proj,
            &l.o_proj,
            &l.q_norm,
            &l.k_norm,
            &l.gate_up_proj,
            &l.down_proj,
        ]
        .iter()
        .map(|b| b.len() as u64)
        .sum::<u64>();
        if let Some((k, v)) = &l.context_kv {
            n += (k.len() + v.len()) as u64;
        }
        for c in [&l.attention_conv, &l.mlp_conv].into_iter().flatten() {
            n += (c.base.len() + c.projection.len()) as u64;
        }
    }
    if let Some(s) = &w.selector {
        n += (s.hidden_projection.len() + s.predecessor.len() + s.successor.len()) as u64;
    }
    2 * n
}

/// Bytes of the draft [`Workspace`] for this startup (the buffers `Workspace::new` allocates).
fn workspace_bytes(model: &DraftModel, s: &Startup, cap: &Capacity, head_rows: usize) -> u64 {
    let g = model.geometry();
    let (rows, k) = (s.concurrency as u64, s.draft_count as u64);
    let w = k + 1;
    let tokens = rows * w;
    let cols = rows * k;
    let (h, hq, hkv, d, inter) = (
        u64::from(g.hidden),
        u64::from(g.q_heads),
        u64::from(g.kv_heads),
        u64::from(g.head_dim),
        u64::from(g.intermediate),
    );
    let mut bf = 3 * tokens * h // x, n, o
        + tokens * hq * d * 2 // q, attention output
        + tokens * hkv * d * 2 // k, v
        + tokens * inter * 3 // gate_up (2 I), act
        + cols * h; // mask hidden
    // The fused head keeps per-block partials, never the [cols, head rows] logits; the
    // scratches serve every row count up to the rows (live-row rounds).
    let head_ws = (1..=rows as usize)
        .map(|m| {
            let head_p = dflash_ops::proposal_argmax::Params {
                n: m * k as usize,
                rows: head_rows,
                hidden: h as usize,
                public_vocab: head_rows,
                head: dflash_ops::proposal_argmax::ProposalHead::Full,
            };
            if g.dflash2.is_some() {
                dflash_ops::unary_topk::workspace_len(&head_p)
            } else {
                dflash_ops::proposal_argmax::workspace_len(&head_p)
            }
        })
        .max()
        .unwrap_or(0);
    // The fused Q/K/V projection, the block's RoPE angles, the head's partials, temperatures.
    let mut f32s = tokens * (hq + 2 * hkv) * d + tokens * (d / 2) + head_ws as u64 + rows;
    let mut i32s = tokens + rows * 6 + cols; // ids, per-row metadata and seeds, proposals
    if g.has_full_pool {
        i32s += rows * cap.max_pages_per_lane as u64;
    }
    if let Some(p) = &g.dflash2 {
        bf += tokens * h + tokens * 2 * (h / 16) + cols * u64::from(p.selector_rank);
        // The convolution's prepare scratch: the split products and the increments.
        bf += 2 * tokens * h;
        f32s += tokens * h / 2 + tokens;
        f32s += 2 * cols * TOP_K as u64;
        i32s += cols * TOP_K as u64 + cols;
    }
    // The attention scratch (every backend allocates it).
    {
        let c = s.block_width as usize;
        let mut attn = 0usize;
        for (l, r) in g
            .layers
            .iter()
            .flat_map(|l| (1..=s.concurrency as usize).map(move |r| (l, r)))
        {
            let len = match *l {
                dflash_config::LayerKind::Local { window } => {
                    sliding_window_attention::workspace_len(
                        &sliding_window_attention::LocalAttentionParams {
                            rows: r,
                            cols: c,
                            q_heads: hq as usize,
                            kv_heads: hkv as usize,
                            head_dim: d as usize,
                            lanes: cap.lanes,
                            window: window as usize,
                        },
                    )
                }
                dflash_config::LayerKind::Full => {
                    softmax_attention::workspace_len(&softmax_attention::FullAttentionParams {
                        rows: r,
                        cols: c,
                        q_heads: hq as usize,
                        kv_heads: hkv as usize,
                        head_dim: d as usize,
                        pages: cap.pages,
                        page_size: cap.page_size,
                        max_pages: cap.max_pages_per_lane,
                    })
                }
            };
            attn = attn.max(len);
        }
        f32s += attn as u64;
    }
    bf * 2 + f32s * 4 + i32s * 4
}

impl Proposer for DraftProposer<'_> {
    type Slot = ContextHandle;
    type Image = ContextImage;
    type HostImage = HostContextImage;

    fn kind(&self) -> ProposalKind {
        if self.model.geometry().dflash2.is_some() {
            ProposalKind::Top16
        } else {
            ProposalKind::OneHot
        }
    }

    fn draft_count(&self) -> usize {
        self.startup.draft_count as usize
    }

    fn rows(&self) -> usize {
        self.startup.concurrency as usize
    }

    fn memory_plan(&self) -> MemoryPlan {
        self.plan.clone()
    }

    fn check_target(&self, info: &TargetInfo) -> Result<()> {
        let g = self.model.geometry();
        let mismatch = |what: &'static str, target: String, draft: String| {
            Err(EngineError::TargetMismatch {
                what,
                target,
                draft,
            })
        };
        if info.hidden != g.hidden as usize {
            return mismatch(
                "hidden width",
                info.hidden.to_string(),
                g.hidden.to_string(),
            );
        }
        if info.layers != g.target_layers as usize {
            return mismatch(
                "decoder blocks",
                info.layers.to_string(),
                g.target_layers.to_string(),
            );
        }
        if info.vocab_rows != g.vocab_rows as usize {
            return mismatch(
                "vocabulary rows",
                info.vocab_rows.to_string(),
                g.vocab_rows.to_string(),
            );
        }
        if info.public_vocab != self.startup.public_vocab_size as usize {
            return mismatch(
                "public vocabulary",
                info.public_vocab.to_string(),
                self.startup.public_vocab_size.to_string(),
            );
        }
        let ids: Vec<usize> = g.target_layer_ids.iter().map(|&i| i as usize).collect();
        if info.capture_ids != ids {
            return mismatch(
                "captured block ids (in recorded order)",
                format!("{:?}", info.capture_ids),
                format!("{ids:?}"),
            );
        }
        Ok(())
    }

    fn admit(&mut self, max_context: usize) -> Result<ContextHandle> {
        Ok(self.store.admit(max_context)?)
    }

    fn release(&mut self, slot: ContextHandle) -> Result<()> {
        Ok(self.store.release(slot)?)
    }

    fn live_slots(&self) -> usize {
        self.store.handles().len()
    }

    fn push_prefill(
        &mut self,
        slot: ContextHandle,
        start: usize,
        features: Buffer<bf16>,
    ) -> Result<()> {
        Ok(self.store.push_pending_owned(slot, start, features)?)
    }

    fn push_verified(
        &mut self,
        slot: ContextHandle,
        start: usize,
        features: &Buffer<bf16>,
        first_row: usize,
        rows: usize,
    ) -> Result<()> {
        let w = self.startup.block_width as usize;
        if rows > w {
            return Err(EngineError::Proposer {
                reason: format!("{rows} verified rows exceed the block width {w}"),
            });
        }
        Ok(self
            .store
            .push_pending_rows(slot, start, features, first_row, rows)?)
    }

    fn materialize(&mut self, slot: ContextHandle) -> Result<()> {
        Ok(self.model.materialize(&mut self.store, slot)?)
    }

    fn materialize_all(&mut self, slots: &[ContextHandle]) -> Result<()> {
        Ok(self.model.materialize_round(&mut self.store, slots)?)
    }

    fn coverage(&self, slot: ContextHandle) -> Result<Coverage> {
        Ok(Coverage {
            materialized: self.store.frontier(slot)?,
            pending: self.store.pending(slot)?,
        })
    }

    fn propose_device(
        &mut self,
        rows: &[ProposeRow<'_, ContextHandle>],
    ) -> Result<Option<crate::proposer::DeviceRound<'_>>> {
        self.queue_block(rows)?;
        Ok(Some(crate::proposer::DeviceRound {
            proposals: dflash_verify::DeviceProposals {
                ids: &self.ws.proposals,
                top16: self
                    .ws
                    .selector
                    .as_ref()
                    .map(|s| dflash_verify::DeviceTop16 {
                        candidates: &s.candidates,
                        q: &s.q,
                    }),
            },
            inputs: &self.inputs,
        }))
    }

    fn propose(&mut self, rows: &[ProposeRow<'_, ContextHandle>]) -> Result<Vec<Proposal>> {
        self.queue_block(rows)?;
        let out = self.ws.read()?;
        let top16 = self.model.geometry().dflash2.is_some();
        out.into_iter()
            .map(|p| {
                let tokens = p
                    .tokens
                    .iter()
                    .map(|&t| {
                        u32::try_from(t).map_err(|_| EngineError::Proposer {
                            reason: format!("the draft proposed the negative id {t}"),
                        })
                    })
                    .collect::<Result<Vec<u32>>>()?;
                let q = if top16 {
                    let mut qs = Vec::with_capacity(tokens.len());
                    for i in 0..tokens.len() {
                        let mut rq = RetainedQ {
                            ids: [0; TOP_K],
                            q: [0.0; TOP_K],
                        };
                        for s in 0..TOP_K {
                            let id = p.candidate_ids.get(i * TOP_K + s).copied().unwrap_or(-1);
                            rq.ids[s] = u32::try_from(id).map_err(|_| EngineError::Proposer {
                                reason: format!("the selector retained the negative id {id}"),
                            })?;
                            rq.q[s] = p.q.get(i * TOP_K + s).copied().unwrap_or(0.0);
                        }
                        qs.push(rq);
                    }
                    Some(qs)
                } else {
                    None
                };
                Ok(Proposal { tokens, q })
            })
            .collect()
    }

    /// DFlash2 only, `nodes` in `K + 1 ..= 32` (`..= 17` for K = 1: a root has 16
    /// candidates); refused ([`EngineError::Proposer`]) before anything runs otherwise. The
    /// block runs as for [`Proposer::propose`] (so nodes `0 ..= P` are its chain, q
    /// included), [`Workspace::read_lattice`] reads the rows' lattices, and each row's tree is
    /// [`tree::build`] with the row's temperature, seed and frontier, then
    /// [`DraftTree::truncated`] to its `P`.
    fn drafts_trees(&self) -> bool {
        self.model.geometry().dflash2.is_some()
    }

    fn propose_tree(
        &mut self,
        rows: &[ProposeRow<'_, ContextHandle>],
        nodes: usize,
    ) -> Result<Vec<DraftTree>> {
        if self.model.geometry().dflash2.is_none() {
            return Err(EngineError::Proposer {
                reason: "tree proposals need a DFlash2 draft (a top-16 lattice); this DFlash \
draft proposes chains only"
                    .into(),
            });
        }
        let k = self.draft_count();
        let most = if k == 1 { 1 + TOP_K } else { tree::MAX_NODES };
        if !(k + 1..=most).contains(&nodes) {
            return Err(EngineError::Proposer {
                reason: format!(
                    "a tree of {nodes} nodes: expected {}..={most} (the K + 1 chain nodes at \
least, K = {k})",
                    k + 1
                ),
            });
        }
        self.queue_block(rows)?;
        self.read_trees(rows, nodes)
    }

    fn checkpoint(&self, slot: ContextHandle) -> Result<ContextImage> {
        Ok(self.store.checkpoint(slot)?)
    }

    fn host_replica(&self, slot: ContextHandle) -> Result<HostContextImage> {
        Ok(self.store.host_replica(slot)?)
    }

    fn image_frontier(image: &ContextImage) -> usize {
        image.frontier()
    }

    fn host_image_frontier(image: &HostContextImage) -> usize {
        image.frontier()
    }

    fn fork(&mut self, slot: ContextHandle) -> Result<ContextHandle> {
        Ok(self.store.fork(slot)?)
    }

    fn admit_restored(
        &mut self,
        max_context: usize,
        image: &ContextImage,
        target_frontier: usize,
    ) -> Result<ContextHandle> {
        Ok(self
            .store
            .admit_restored(max_context, image, target_frontier)?)
    }

    fn admit_restored_host(
        &mut self,
        max_context: usize,
        image: &HostContextImage,
        target_frontier: usize,
    ) -> Result<ContextHandle> {
        Ok(self
            .store
            .admit_restored_host(max_context, image, target_frontier)?)
    }
}
