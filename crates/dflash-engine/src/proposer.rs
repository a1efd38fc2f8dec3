//! The proposal interface of the round: what the engine needs from a drafter.
//!
//! [`crate::DraftProposer`] implements it with the DFlash / DFlash2 draft model and its context
//! storage; tests plug in their own proposers (an oracle that proposes the target's own tokens,
//! a deliberately wrong one) through the same trait.
//!
//! A proposer owns one *slot* per admitted request: its draft context (materialized coverage
//! plus pending target features). The engine keeps every slot's coverage equal to the
//! request's committed target frontier:
//! - at admission it pushes the prompt's captured features ([`Proposer::push_prefill`]);
//! - after a commit of `N` rows it pushes the first `N` captured feature columns of the verify
//!   block ([`Proposer::push_verified`]);
//! - before a proposal, checkpoint, fork or host replica it calls [`Proposer::materialize`].
//!
//! Images ([`Proposer::checkpoint`], [`Proposer::host_replica`]) carry their coverage; an
//! admission from an image ([`Proposer::admit_restored`]) must refuse an image whose coverage
//! differs from the target frontier it is attached to.

use dflash_draft::tree::DraftTree;
use dflash_ops::{Buffer, bf16};
use dflash_verify::{ProposalKind, RetainedQ};

use crate::error::Result;
use crate::options::MemoryPlan;
use crate::target::TargetInfo;

/// A slot's draft-context coverage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Coverage {
    /// Positions `[0, materialized)` are in the draft context.
    pub materialized: usize,
    /// Positions `[materialized, materialized + pending)` are queued target features.
    pub pending: usize,
}

impl Coverage {
    /// `materialized + pending`: the target frontier the slot agrees with.
    pub fn frontier(&self) -> usize {
        self.materialized + self.pending
    }
}

/// One request of a proposal round (its context must be materialized: coverage = `frontier`,
/// nothing pending).
#[derive(Clone, Copy, Debug)]
pub struct ProposeRow<'a, S> {
    /// The request's slot.
    pub slot: S,
    /// The unprocessed anchor `a = x_F`.
    pub anchor: u32,
    /// The frontier `F` (the anchor's position).
    pub frontier: usize,
    /// `P`: proposals that can be verified this round (`0..=K`).
    pub usable: usize,
    /// The request's sampling temperature (the DFlash2 selector's temperature).
    pub temperature: f32,
    /// The request seed.
    pub seed: u64,
    /// Tokens `x_0 ..= x_F` (prompt, then every published output; the anchor last).
    pub history: &'a [u32],
}

/// One request's proposal.
#[derive(Clone, Debug, PartialEq)]
pub struct Proposal {
    /// Proposed tokens `d_1 ..`: at least `P` (the first `P` are verified), each a public id.
    pub tokens: Vec<u32>,
    /// The retained proposal distributions (one per proposal, at least `P`) for
    /// [`ProposalKind::Top16`]; `None` for [`ProposalKind::OneHot`].
    pub q: Option<Vec<RetainedQ>>,
}

/// A proposal round left on the device ([`Proposer::propose_device`]).
#[derive(Clone, Copy, Debug)]
pub struct DeviceRound<'a> {
    /// The proposals (and DFlash2's retained q), row `r` of the batch at row `r`.
    pub proposals: dflash_verify::DeviceProposals<'a>,
    /// The target's verify input `[rows, W]` I32: row `r`'s anchor, then its `K` proposals.
    pub inputs: &'a Buffer<i32>,
}

/// A drafter: per-request context slots and one batched proposal per round.
pub trait Proposer {
    /// A request's context slot.
    type Slot: Copy + Eq + std::fmt::Debug;
    /// A device image of a slot's context (checkpoint).
    type Image;
    /// A host image of a slot's context (host replica).
    type HostImage;

    /// The proposal distribution the proposals carry.
    fn kind(&self) -> ProposalKind;
    /// Draft count K (the block has W = K + 1 columns).
    fn draft_count(&self) -> usize;
    /// Rows a proposal round may hold (concurrency B).
    fn rows(&self) -> usize;
    /// The device allocations the proposer holds (weights, context pools, workspaces).
    fn memory_plan(&self) -> MemoryPlan;
    /// Check that the proposer fits the target (hidden width, vocabulary, captured block ids).
    fn check_target(&self, info: &TargetInfo) -> Result<()>;

    /// A new, empty slot for a request that may reach `max_context` positions.
    fn admit(&mut self, max_context: usize) -> Result<Self::Slot>;
    /// Free a slot (its pending features included).
    fn release(&mut self, slot: Self::Slot) -> Result<()>;
    /// Slots currently held (for leak checks).
    fn live_slots(&self) -> usize;

    /// Queue captured prompt features `[T, feature_width]` of positions `start .. start + T`.
    fn push_prefill(
        &mut self,
        slot: Self::Slot,
        start: usize,
        features: Buffer<bf16>,
    ) -> Result<()>;
    /// Queue `rows` captured feature rows of positions `start .. start + rows`, read from row
    /// `first_row` of `features` (`[.., feature_width]` BF16, e.g. the verify outputs
    /// `[batch rows * W, feature_width]`).
    fn push_verified(
        &mut self,
        slot: Self::Slot,
        start: usize,
        features: &Buffer<bf16>,
        first_row: usize,
        rows: usize,
    ) -> Result<()>;
    /// Materialize pending features so the context reaches its coverage frontier.
    fn materialize(&mut self, slot: Self::Slot) -> Result<()>;
    /// [`Proposer::materialize`] every slot of a round (distinct slots); a proposer may do
    /// it in one batched call. The default materializes them one by one.
    fn materialize_all(&mut self, slots: &[Self::Slot]) -> Result<()> {
        for &s in slots {
            self.materialize(s)?;
        }
        Ok(())
    }
    /// The slot's coverage.
    fn coverage(&self, slot: Self::Slot) -> Result<Coverage>;

    /// One batched proposal round (rows in compact-batch order; every slot materialized).
    /// A row's proposal must not depend on the other rows.
    fn propose(&mut self, rows: &[ProposeRow<'_, Self::Slot>]) -> Result<Vec<Proposal>>;

    /// [`Proposer::propose`] left on the device (nothing read back): the engine then
    /// verifies from the returned buffers ([`Target::verify_device`](crate::Target),
    /// `VerifyWorkspace::verify_device`) and reads the proposals with the round's outcome,
    /// so the round synchronizes once. `None` (the default): this proposer proposes on the
    /// host only, and the engine calls [`Proposer::propose`].
    fn propose_device(
        &mut self,
        rows: &[ProposeRow<'_, Self::Slot>],
    ) -> Result<Option<DeviceRound<'_>>> {
        let _ = rows;
        Ok(None)
    }

    /// Whether [`Proposer::propose_tree`] drafts trees (checked at startup when
    /// `startup.tree_nodes` is set, so that a chain-only proposer is refused then and not
    /// at its first round). The default: false.
    fn drafts_trees(&self) -> bool {
        false
    }

    /// One batched DFlash2 tree proposal round (`startup.tree_nodes`): per row a tree of at
    /// most `nodes` nodes (anchor included) whose nodes `0..=P` are exactly the chain
    /// [`Proposer::propose`] would give, no node deeper than the row's `usable` P, shaped and
    /// drawn as `dflash_draft::tree` says (so that `tree_accept` stays lossless). The default
    /// refuses: this proposer drafts chains only.
    fn propose_tree(
        &mut self,
        rows: &[ProposeRow<'_, Self::Slot>],
        nodes: usize,
    ) -> Result<Vec<DraftTree>> {
        let _ = (rows, nodes);
        Err(crate::EngineError::Proposer {
            reason: "this proposer drafts chains only (no tree proposals)".into(),
        })
    }

    /// A device image of a materialized slot.
    fn checkpoint(&self, slot: Self::Slot) -> Result<Self::Image>;
    /// A host image of a materialized slot.
    fn host_replica(&self, slot: Self::Slot) -> Result<Self::HostImage>;
    /// The coverage an image carries.
    fn image_frontier(image: &Self::Image) -> usize;
    /// The coverage a host image carries.
    fn host_image_frontier(image: &Self::HostImage) -> usize;
    /// A new slot with a copy of a materialized slot's context.
    fn fork(&mut self, slot: Self::Slot) -> Result<Self::Slot>;
    /// A new slot holding `image`, attached to a target state at `target_frontier` (refused
    /// unless the image's coverage equals it).
    fn admit_restored(
        &mut self,
        max_context: usize,
        image: &Self::Image,
        target_frontier: usize,
    ) -> Result<Self::Slot>;
    /// [`Proposer::admit_restored`] from a host image.
    fn admit_restored_host(
        &mut self,
        max_context: usize,
        image: &Self::HostImage,
        target_frontier: usize,
    ) -> Result<Self::Slot>;
}
