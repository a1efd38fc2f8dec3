//! DFlash2 tree builder (host side): grow one request's proposal tree around the selector's
//! chain, with a shape fixed before any draw, so that the target's tree verification
//! (recursive rejection sampling, `dflash_ops::tree_accept`) stays lossless.
//!
//! Inputs (one request). The draft count K (`1..=31`) and the node budget N (`K+1..=32`, and
//! at most 17 when K = 1: a root has 16 candidates); the anchor a; the chain of
//! `candidate_selector`: proposals `d_1..d_K`, chosen ranks `j_0..j_(K-1)` and `q_chain[i]`, the
//! `[16]` F32 distribution `d_(i+1)` was drawn from; the candidate ids `C [K, 16]` (distinct
//! within a column); the temperature T; the request seed and frontier F; and the edge scores
//! `E_i[p, ·]` ([`EdgeScores::row`]: column i, predecessor p; [`HostLattice`] computes them on
//! the host with `candidate_selector`'s own code). `softmax_T` below is
//! [`candidate_selector::step_q`]: the selector's F32 q formula.
//!
//! 1. Shape (deterministic: no seed, frontier or chain draw enters it). A proxy tree: the root's
//!    proxy token is a. A proxy node of token t at depth `d < K` orders column d's ranks by
//!    `E_d[t, ·]` descending (exact F32 ties: lower rank first); its child number s
//!    (`s = 0..15`) is the rank at position s of that order, with proxy token `C_d[rank]` and
//!    `score = score(parent) + ln(softmax(E_d[t, ·] / Ts)[rank])`, computed in f64 from the
//!    F32 scores (`x = f64(E) / Ts`, `m = max x`, `lp = (x - m) - ln(sum exp(x - m))`, the sum
//!    in rank order), `Ts = T` if `T > 0` else 1, root score 0. The spine is the first
//!    children from the root down to depth K: nodes `0..=K`, node i at depth i. Best-first: a
//!    set of candidate slots, initially child `s = 1` of every spine node of depth `< K`; take
//!    the best slot (highest score; ties: lower parent node index, then lower s); it becomes
//!    the next node (index = current count); add that parent's child `s + 1` (if `s + 1 <
//!    16`) and the new node's child 0 (if its depth `< K`); repeat until N nodes. The shape is
//!    each node's parent, depth and sibling index s (its draw number among its parent's
//!    children); children of a node appear in increasing index with s = 0, 1, ...
//! 2. Fill (the actual tokens). Node 0 is a. In index order, every node n of depth `d < K`
//!    gets the candidates `C_d` and a child distribution `q_n`: `q_chain[n]` for a spine node
//!    (`n < K`; as given, never recomputed), else `softmax_T(E_d[token_n, ·])` (for `T <= 0`:
//!    the one-hot at the lowest rank attaining the max). Its children, in draw order s:
//!    - a spine node's child `s = 0` is the chain's own `d_(n+1)` (rank `j_n`);
//!    - `T <= 0`, otherwise: the ranks in descending `E_d[token_n, ·]` order (ties: lower rank
//!      first), for a spine node with `j_n` taken out (its later children are the other ranks
//!      in that order);
//!    - `T > 0`, otherwise: a draw without replacement from `q_n`:
//!      `u = rng::uniform(seed, F + 1 + d, Purpose::TreeChild, s)`; `R` = the ranks not yet
//!      drawn for n (`j_n` counts as drawn for a spine node); `D = sum_{c in R} f64(q_n[c])`
//!      in increasing c; the child is the first `c in R` (increasing) whose running f64 sum
//!      (same order) exceeds `f64(u) * D`, else the last `c in R` with `q_n[c] > 0`. If
//!      `D == 0` the node's q has no mass left: this child slot and every later one of n are
//!      dropped with their whole would-be subtrees.
//!
//!    A child's token is `C_d[rank]`.
//! 3. Compaction. Dropped nodes are removed and the rest renumbered in their order (parents
//!    remapped), so a tree has `N' <= N` nodes; only `T > 0` drops, and only where a q has
//!    fewer nonzero entries than the shape gives its node children. The spine (nodes `0..=K`)
//!    is never dropped: it is exactly the chain.
//!
//! Why this is lossless with `tree_accept`: (a) at `T > 0` every node's children are successive
//! draws without replacement from its `q_n` (the spine's first child by the selector's own
//! draw, the rest by the `TreeChild` draws), in index order; (b) the number of children of a
//! node never depends on the identities of those children, of their descendants, or on any
//! other draw: the shape is a function of the lattice alone, and a node loses children only
//! through its own q's support. Two nodes of one depth share their draws' uniforms (same
//! position, purpose and sub, as the RNG table fixes them); verification reads the children
//! of one node per depth (the path's), and nothing that led it to that node used them.
//!
//! Outputs ([`DraftTree`]): tokens, parents, depths, sibling indices, candidate ranks, ancestor
//! bitmasks and per node the `[16]` ids and q its children are drawn from (zeros at depth K);
//! [`DraftTree::accept_layout`] gives `tree_accept`'s row layout. For a chain-only tree
//! (`N = K + 1`) the layout is exactly `candidate_selector`'s proposals, cand ids and q.
//!
//! 4. Depth truncation ([`DraftTree::truncated`]): a row that can verify only `P < K`
//!    proposals keeps the nodes of depth `<= P` (the spine's `0..=P` among them). Which nodes
//!    go is a function of the shape alone and a kept node keeps all its children or none,
//!    so (a) and (b) above still hold: the truncated tree is as lossless as the full one.
//!
//! Edge scores of an engine round: [`Workspace::read_lattice`](crate::Workspace) reads back
//! each staged request's chain, g, unary scores and only the codebook rows a tree can read
//! (gathered on the backend), as a [`RowLattice`]; its [`GatheredLattice`] gives exactly
//! [`HostLattice`]'s scores (the same `edge_row` over the same row values).
//!
//! Errors ([`DraftError::Invalid`], naming the field): N out of range, chain lengths that
//! disagree with K, a NaN temperature, a chosen rank outside `0..16`, a proposal that is not
//! `C_i[j_i]`, a negative or repeated candidate id, a non-finite or negative `q_chain` entry,
//! `F + 1 + K` past `u64::MAX`, or a non-finite edge score; plus whatever the edge-score
//! source refuses. A refused call returns no tree.

use std::cmp::Ordering;

use dflash_ops::candidate_selector::{self, TOP_K};
use dflash_ops::rng::{self, Purpose};
use dflash_ops::{Backend, Buffer, bf16};

use crate::{DraftError, Result};

/// The largest tree: node sets are `u32` bitmasks ([`DraftTree::ancestors`]).
pub const MAX_NODES: usize = 32;

/// A source of DFlash2 edge scores: one row of column `column`'s lattice at a time.
pub trait EdgeScores {
    /// `E_column[pred, c]` for the 16 ranks c of the column (`candidate_selector`'s E, over
    /// the same candidate ids the tree's chain carries). Scores must be finite (the builder
    /// refuses others).
    fn row(&mut self, column: usize, pred: u32) -> Result<[f32; TOP_K]>;
}

/// A lattice's length error: `lattice.<what>.len()`.
fn lattice_len(what: &str, expected: String, found: usize) -> DraftError {
    DraftError::invalid(format!("lattice.{what}.len()"), expected, found)
}

/// The checks every lattice source makes: `K, R >= 1`, `g` of `K * R` and `unary`, `cand` of
/// `K * 16` elements.
fn check_columns(k: usize, rank: usize, g: usize, unary: usize, cand: usize) -> Result<()> {
    if k == 0 {
        return Err(DraftError::invalid("lattice.k", ">= 1", k));
    }
    if rank == 0 {
        return Err(DraftError::invalid("lattice.rank", ">= 1", rank));
    }
    if Some(g) != k.checked_mul(rank) {
        return Err(lattice_len("g", format!("K * R = {k} * {rank}"), g));
    }
    for (what, n) in [("unary", unary), ("cand", cand)] {
        if n != k * TOP_K {
            return Err(lattice_len(what, format!("K * 16 = {}", k * TOP_K), n));
        }
    }
    Ok(())
}

/// Edge scores from host tensors, computed by [`candidate_selector::edge_row`] (the
/// selector's own code, so a spine row reproduces the selector's E bit for bit).
#[derive(Clone, Copy, Debug)]
pub struct HostLattice<'a> {
    k: usize,
    rank: usize,
    g: &'a [bf16],
    unary: &'a [f32],
    cand: &'a [i32],
    w_pred: &'a [bf16],
    w_succ: &'a [bf16],
}

impl<'a> HostLattice<'a> {
    /// A lattice of K columns with selector rank R: `g [K, R]` BF16, `unary` and `cand`
    /// `[K, 16]`, `w_pred` and `w_succ` `[vocab, R]` BF16. Checks every length, `K, R >= 1`,
    /// and that every candidate id is in `0..vocab`.
    pub fn new(
        k: usize,
        rank: usize,
        g: &'a [bf16],
        unary: &'a [f32],
        cand: &'a [i32],
        w_pred: &'a [bf16],
        w_succ: &'a [bf16],
    ) -> Result<Self> {
        check_columns(k, rank, g.len(), unary.len(), cand.len())?;
        let len = lattice_len;
        if w_pred.is_empty() || !w_pred.len().is_multiple_of(rank) {
            let expected = format!("a positive multiple of R = {rank}");
            return Err(len("w_pred", expected, w_pred.len()));
        }
        if w_succ.len() != w_pred.len() {
            let expected = format!("w_pred.len() = {}", w_pred.len());
            return Err(len("w_succ", expected, w_succ.len()));
        }
        let vocab = w_pred.len() / rank;
        if let Some(i) = cand
            .iter()
            .position(|&x| !usize::try_from(x).is_ok_and(|x| x < vocab))
        {
            return Err(DraftError::invalid(
                format!("lattice.cand[{}][{}]", i / TOP_K, i % TOP_K),
                format!("an id in 0..{vocab}"),
                cand[i],
            ));
        }
        Ok(HostLattice {
            k,
            rank,
            g,
            unary,
            cand,
            w_pred,
            w_succ,
        })
    }

    /// The candidate ids `[K, 16]` (pass the same to [`Chain::cand_ids`]).
    pub fn cand_ids(&self) -> &'a [i32] {
        self.cand
    }
}

impl EdgeScores for HostLattice<'_> {
    fn row(&mut self, column: usize, pred: u32) -> Result<[f32; TOP_K]> {
        if column >= self.k {
            let expected = format!("a column in 0..{}", self.k);
            return Err(DraftError::invalid("lattice column", expected, column));
        }
        let cells = column * TOP_K..(column + 1) * TOP_K;
        Ok(candidate_selector::edge_row(
            &self.g[column * self.rank..][..self.rank],
            self.w_pred,
            self.w_succ,
            pred as usize,
            &self.cand[cells.clone()],
            &self.unary[cells],
        )?)
    }
}

/// The codebook rows one request's tree can read, in the order [`GatheredLattice`] takes
/// them: `K * 16 + 1` ids as predecessors (the anchor, then the candidates of columns
/// `0..K-1`: a node of depth d holds the anchor (d = 0) or a candidate of column d - 1, and
/// depth-K nodes are never predecessors) and `K * 16` as successors (every candidate).
const fn pred_rows_per_request(k: usize) -> usize {
    1 + (k - 1) * TOP_K
}

/// Edge scores over gathered codebook rows (one request): exactly [`HostLattice`]'s (and so
/// `candidate_selector`'s), computed by [`candidate_selector::edge_row`] over a two-part
/// table of the rows it reads, for every predecessor the lattice has a row for: the anchor
/// and the candidate ids of columns `0..K-1` (any column). Another predecessor is refused
/// ([`DraftError::Invalid`], `lattice predecessor`).
#[derive(Clone, Debug)]
pub struct GatheredLattice<'a> {
    k: usize,
    rank: usize,
    anchor: u32,
    g: &'a [bf16],
    unary: &'a [f32],
    cand: &'a [i32],
    pred_rows: &'a [bf16],
    succ_rows: &'a [bf16],
    /// `[17, R]`: the predecessor's row, then the column's 16 successor rows.
    table: Vec<bf16>,
}

/// The local ids of a column's 16 successors in [`GatheredLattice`]'s table (row 0 is the
/// predecessor).
const LOCAL_SUCC: [i32; TOP_K] = {
    let mut ids = [0i32; TOP_K];
    let mut c = 0;
    while c < TOP_K {
        ids[c] = c as i32 + 1;
        c += 1;
    }
    ids
};

impl<'a> GatheredLattice<'a> {
    /// A lattice of K columns with selector rank R: `g [K, R]` BF16, `unary` and `cand`
    /// `[K, 16]`, `pred_rows [1 + (K-1) * 16, R]` (W_pred of the anchor, then of
    /// `cand[0..K-1]` in order) and `succ_rows [K * 16, R]` (W_succ of `cand` in order).
    /// Checks every length, `K, R >= 1` and that no candidate id is negative (the rows'
    /// ids themselves are the caller's: [`Workspace::read_lattice`](crate::Workspace) gathers
    /// them).
    #[allow(clippy::too_many_arguments)] // reason: the lattice's tensors, each named
    pub fn new(
        k: usize,
        rank: usize,
        anchor: u32,
        g: &'a [bf16],
        unary: &'a [f32],
        cand: &'a [i32],
        pred_rows: &'a [bf16],
        succ_rows: &'a [bf16],
    ) -> Result<Self> {
        check_columns(k, rank, g.len(), unary.len(), cand.len())?;
        let len = lattice_len;
        let preds = pred_rows_per_request(k);
        if Some(pred_rows.len()) != preds.checked_mul(rank) {
            let expected = format!("(1 + (K - 1) * 16) * R = {preds} * {rank}");
            return Err(len("pred_rows", expected, pred_rows.len()));
        }
        if Some(succ_rows.len()) != (k * TOP_K).checked_mul(rank) {
            let expected = format!("K * 16 * R = {} * {rank}", k * TOP_K);
            return Err(len("succ_rows", expected, succ_rows.len()));
        }
        if let Some(i) = cand.iter().position(|&x| x < 0) {
            return Err(DraftError::invalid(
                format!("lattice.cand[{}][{}]", i / TOP_K, i % TOP_K),
                "a non-negative id",
                cand[i],
            ));
        }
        Ok(GatheredLattice {
            k,
            rank,
            anchor,
            g,
            unary,
            cand,
            pred_rows,
            succ_rows,
            table: vec![bf16::ZERO; (1 + TOP_K) * rank],
        })
    }

    /// The candidate ids `[K, 16]` (pass the same to [`Chain::cand_ids`]).
    pub fn cand_ids(&self) -> &'a [i32] {
        self.cand
    }

    /// The predecessors the lattice has a row for: the anchor, then the candidate ids of
    /// columns `0..K-1` (repeats included), in `pred_rows` order.
    pub fn predecessors(&self) -> impl Iterator<Item = u32> + '_ {
        let preds = &self.cand[..(self.k - 1) * TOP_K];
        std::iter::once(self.anchor).chain(preds.iter().map(|&id| id as u32))
    }
}

impl EdgeScores for GatheredLattice<'_> {
    fn row(&mut self, column: usize, pred: u32) -> Result<[f32; TOP_K]> {
        if column >= self.k {
            let expected = format!("a column in 0..{}", self.k);
            return Err(DraftError::invalid("lattice column", expected, column));
        }
        // Equal ids have equal codebook rows: any gathered row of `pred` is its row.
        let Some(at) = self.predecessors().position(|p| p == pred) else {
            let expected = "the anchor or a candidate id of columns 0..K-1 (a gathered row)";
            return Err(DraftError::invalid("lattice predecessor", expected, pred));
        };
        let r = self.rank;
        let (head, succ) = self.table.split_at_mut(r);
        head.copy_from_slice(&self.pred_rows[at * r..][..r]);
        succ.copy_from_slice(&self.succ_rows[column * TOP_K * r..][..TOP_K * r]);
        let cells = column * TOP_K..(column + 1) * TOP_K;
        // The selector's inputs over the table: predecessor id 0, successor ids 1..=16 (the
        // rows `edge_row` reads are the same values as in the full codebooks).
        Ok(candidate_selector::edge_row(
            &self.g[column * r..][..r],
            &self.table,
            &self.table,
            0,
            &LOCAL_SUCC,
            &self.unary[cells],
        )?)
    }
}

/// One staged request's tree inputs, read back by
/// [`Workspace::read_lattice`](crate::Workspace): its chain, lattice and gathered codebook
/// rows.
#[derive(Clone, Debug, PartialEq)]
pub struct RowLattice {
    /// The anchor a.
    pub anchor: u32,
    /// P (from the request).
    pub usable: usize,
    /// Selector rank R.
    pub rank: usize,
    /// Proposals `[K]`.
    pub proposals: Vec<i32>,
    /// Chosen ranks `[K]`.
    pub chosen: Vec<i32>,
    /// The proposals' distributions `[K, 16]`.
    pub q: Vec<f32>,
    /// Candidate ids `[K, 16]`.
    pub candidate_ids: Vec<i32>,
    /// Unary scores `[K, 16]`.
    pub unary: Vec<f32>,
    /// Projected hidden g `[K, R]`.
    pub g: Vec<bf16>,
    /// `W_pred` rows `[1 + (K-1) * 16, R]`: the anchor's, then those of the candidates of
    /// columns `0..K-1`.
    pub pred_rows: Vec<bf16>,
    /// `W_succ` rows `[K * 16, R]`: those of every candidate.
    pub succ_rows: Vec<bf16>,
}

impl RowLattice {
    /// The chain ([`build`]'s input).
    pub fn chain(&self) -> Chain<'_> {
        Chain {
            anchor: self.anchor,
            proposals: &self.proposals,
            chosen: &self.chosen,
            q: &self.q,
            cand_ids: &self.candidate_ids,
        }
    }

    /// The edge scores over the gathered rows.
    pub fn lattice(&self) -> Result<GatheredLattice<'_>> {
        GatheredLattice::new(
            self.proposals.len(),
            self.rank,
            self.anchor,
            &self.g,
            &self.unary,
            &self.candidate_ids,
            &self.pred_rows,
            &self.succ_rows,
        )
    }

    /// This request's tree: [`build`] over [`RowLattice::chain`] and
    /// [`RowLattice::lattice`].
    pub fn build(&self, opts: &TreeOptions) -> Result<DraftTree> {
        build(&self.chain(), &mut self.lattice()?, opts)
    }
}

/// Device scratch of [`Workspace::read_lattice`](crate::Workspace): the predecessor ids and
/// the gathered codebook rows of up to the workspace's rows (allocated once by
/// [`Workspace::lattice_scratch`](crate::Workspace); [`LatticeScratch::bytes_for`] plans
/// it).
#[derive(Debug)]
pub struct LatticeScratch {
    pub(crate) rows: usize,
    pub(crate) k: usize,
    pub(crate) rank: usize,
    /// Predecessor ids `[rows, 1 + (K-1) * 16]` I32.
    pub(crate) ids: Buffer<i32>,
    /// Gathered `W_pred` rows `[rows, 1 + (K-1) * 16, R]` BF16.
    pub(crate) pred: Buffer<bf16>,
    /// Gathered `W_succ` rows `[rows, K * 16, R]` BF16.
    pub(crate) succ: Buffer<bf16>,
}

impl LatticeScratch {
    /// Bytes of the scratch for `rows` requests, K and R (what [`LatticeScratch::bytes`]
    /// gives once allocated).
    pub fn bytes_for(rows: usize, k: usize, rank: usize) -> u64 {
        let (preds, succs) = (rows * pred_rows_per_request(k.max(1)), rows * k * TOP_K);
        (4 * preds + 2 * (preds + succs) * rank) as u64
    }

    /// Bytes allocated (the buffers' capacities).
    pub fn bytes(&self) -> u64 {
        (4 * self.ids.capacity() + 2 * (self.pred.capacity() + self.succ.capacity())) as u64
    }

    pub(crate) fn new(be: &Backend, rows: usize, k: usize, rank: usize) -> Result<Self> {
        let preds = rows * pred_rows_per_request(k);
        Ok(LatticeScratch {
            rows,
            k,
            rank,
            ids: be.zeros(preds)?,
            pred: be.zeros(preds * rank)?,
            succ: be.zeros(rows * k * TOP_K * rank)?,
        })
    }

    pub(crate) fn preds_per_request(&self) -> usize {
        pred_rows_per_request(self.k)
    }
}

/// One request's chain, as `candidate_selector` wrote it (one row of its outputs).
#[derive(Clone, Copy, Debug)]
pub struct Chain<'a> {
    /// The anchor a (node 0).
    pub anchor: u32,
    /// Proposals `d_1..d_K` `[K]` (the selector's `proposals` row).
    pub proposals: &'a [i32],
    /// Chosen ranks `[K]` (`proposals[i] = cand_ids[i][chosen[i]]`).
    pub chosen: &'a [i32],
    /// The distributions the proposals were drawn from, `[K, 16]` F32 over ranks.
    pub q: &'a [f32],
    /// Candidate ids `[K, 16]`, distinct within a column (the lattice's own candidates).
    pub cand_ids: &'a [i32],
}

/// The tree's size and the request's sampling identity.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TreeOptions {
    /// Node budget N, anchor included: `K+1..=32` (`..=17` for K = 1).
    pub nodes: usize,
    /// Sampling temperature (`<= 0`: greedy; NaN refused).
    pub temperature: f32,
    /// The request seed.
    pub seed: u64,
    /// The frontier F (the anchor's position).
    pub frontier: u64,
}

/// A tree's shape (step 1 of the module contract): no token, only structure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TreeShape {
    /// Parent of node i at `[i - 1]`, always `< i`; nodes `0..=K` are the spine (`i - 1`).
    pub parents: Vec<u32>,
    /// Depth per node (root 0).
    pub depth: Vec<u32>,
    /// Draw number per node among its parent's children (root 0).
    pub sibling: Vec<u8>,
    /// The proxy tokens the shape was planned with (root a). At `T <= 0` with a chain that
    /// follows the host lattice's greedy choices they are exactly the tree's tokens.
    pub proxy: Vec<u32>,
}

/// A DFlash2 proposal tree of `N' <= N` nodes (node 0 the anchor), ready for verification.
#[derive(Clone, Debug, PartialEq)]
pub struct DraftTree {
    /// Token per node, `[0]` = the anchor; nodes `1..=K` are the chain's proposals.
    pub tokens: Vec<u32>,
    /// Parent of node i at `[i - 1]` (`N' - 1` entries), always `< i`.
    pub parents: Vec<u32>,
    /// Depth per node (root 0, at most K).
    pub depth: Vec<u32>,
    /// Draw number per node among its parent's children: children of a node, in increasing
    /// index, are its draws 0, 1, ... (root 0).
    pub sibling: Vec<u8>,
    /// Bit j of `ancestors[n]` is set iff node j is n or an ancestor of n.
    pub ancestors: Vec<u32>,
    /// Per node, the candidate ids its children are drawn from (column `depth`'s; zeros at
    /// depth K).
    pub child_ids: Vec<[i32; TOP_K]>,
    /// Per node, the distribution its children are drawn from over those ranks (`q_chain`
    /// for the spine; zeros at depth K).
    pub child_q: Vec<[f32; TOP_K]>,
    /// Per node, its rank among its parent's candidates (root 0).
    pub rank: Vec<u8>,
}

/// One request's row of `tree_accept`'s inputs ([`DraftTree::accept_layout`]).
#[derive(Clone, Debug, PartialEq)]
pub struct AcceptLayout {
    /// Tokens of nodes `1..N'` `[N' - 1]`.
    pub tokens: Vec<i32>,
    /// Parents of nodes `1..N'` `[N' - 1]`.
    pub parents: Vec<i32>,
    /// Slot ids `[N' - 1, 16]`, row n = node n's `child_ids` (the last node, always a leaf,
    /// has no row).
    pub ids: Vec<i32>,
    /// Slot probabilities `[N' - 1, 16]`, row n = node n's `child_q`.
    pub q: Vec<f32>,
}

impl DraftTree {
    /// The node count N'.
    pub fn nodes(&self) -> usize {
        self.tokens.len()
    }

    /// The children of node n, in draw order (increasing index).
    pub fn children(&self, n: usize) -> impl Iterator<Item = usize> + '_ {
        (1..self.tokens.len()).filter(move |&i| self.parents[i - 1] as usize == n)
    }

    /// `tree_accept`'s layout of this tree: tokens and parents of nodes `1..N'`, slot ids and
    /// q rows `[N' - 1, 16]` indexed by parent node. For a chain (`N' = K + 1`) these are the
    /// selector's proposals, cand ids and q.
    pub fn accept_layout(&self) -> AcceptLayout {
        let rows = self.tokens.len() - 1;
        AcceptLayout {
            tokens: self.tokens[1..].iter().map(|&t| t as i32).collect(),
            parents: self.parents.iter().map(|&p| p as i32).collect(),
            ids: self.child_ids[..rows].concat(),
            q: self.child_q[..rows].concat(),
        }
    }

    /// The tree without its nodes deeper than `max_depth` (a row that can verify only P < K
    /// proposals: `truncated(P)`): the kept nodes in their order, renumbered, parents
    /// remapped, ancestors recomputed; tokens, depths, sibling indices, ranks and every kept
    /// node's `child_ids` / `child_q` unchanged (a node at depth `max_depth` keeps its
    /// distribution, though its children are gone). `max_depth >= K` gives the tree itself.
    ///
    /// Still lossless with `tree_accept`: which nodes go depends on their depths alone (the
    /// shape, fixed before any draw), and a kept node keeps either all its children (depth
    /// `< max_depth`) or none (depth `max_depth`), in their draw order. So (a) and (b) of the
    /// module contract hold for the truncated tree: every node's children are still the
    /// first of its successive draws, their number independent of any draw's outcome.
    pub fn truncated(&self, max_depth: usize) -> DraftTree {
        let n = self.tokens.len();
        let keep: Vec<usize> = (0..n)
            .filter(|&m| self.depth[m] as usize <= max_depth)
            .collect();
        if keep.len() == n {
            return self.clone();
        }
        // Depth is monotone along a path, so every kept node's parent is kept, and precedes it.
        let mut index = vec![u32::MAX; n];
        for (new, &m) in keep.iter().enumerate() {
            index[m] = new as u32;
        }
        let parents: Vec<u32> = keep[1..]
            .iter()
            .map(|&m| index[self.parents[m - 1] as usize])
            .collect();
        let mut ancestors = Vec::with_capacity(keep.len());
        ancestors.push(1u32);
        for (i, &p) in parents.iter().enumerate() {
            ancestors.push(ancestors[p as usize] | 1 << (i + 1));
        }
        DraftTree {
            tokens: keep.iter().map(|&m| self.tokens[m]).collect(),
            parents,
            depth: keep.iter().map(|&m| self.depth[m]).collect(),
            sibling: keep.iter().map(|&m| self.sibling[m]).collect(),
            ancestors,
            child_ids: keep.iter().map(|&m| self.child_ids[m]).collect(),
            child_q: keep.iter().map(|&m| self.child_q[m]).collect(),
            rank: keep.iter().map(|&m| self.rank[m]).collect(),
        }
    }
}

/// The shape of the tree for a lattice (step 1 of the module contract): K = `cand_ids.len() /
/// 16`, `nodes` = N, `temperature` only sets the score temperature Ts. Nothing random enters.
pub fn shape<L: EdgeScores + ?Sized>(
    anchor: u32,
    cand_ids: &[i32],
    nodes: usize,
    temperature: f32,
    lattice: &mut L,
) -> Result<TreeShape> {
    if cand_ids.is_empty() || !cand_ids.len().is_multiple_of(TOP_K) {
        let expected = "a positive multiple of 16 ([K, 16])";
        return Err(DraftError::invalid(
            "cand_ids.len()",
            expected,
            cand_ids.len(),
        ));
    }
    let k = cand_ids.len() / TOP_K;
    check_common(k, nodes, temperature, cand_ids)?;
    let plan = plan(
        k,
        nodes,
        anchor,
        cand_ids,
        temperature,
        &mut Rows::new(lattice),
    )?;
    Ok(TreeShape {
        parents: plan[1..].iter().map(|p| p.parent as u32).collect(),
        depth: plan.iter().map(|p| p.depth as u32).collect(),
        sibling: plan.iter().map(|p| p.sibling as u8).collect(),
        proxy: plan.iter().map(|p| p.proxy).collect(),
    })
}

/// Build one request's tree (the module contract: shape, then fill).
pub fn build<L: EdgeScores + ?Sized>(
    chain: &Chain<'_>,
    lattice: &mut L,
    opts: &TreeOptions,
) -> Result<DraftTree> {
    let k = chain.proposals.len();
    check_chain(chain, opts)?;
    let t = opts.temperature;
    let cand = chain.cand_ids;
    let mut rows = Rows::new(lattice);
    let plan = plan(k, opts.nodes, chain.anchor, cand, t, &mut rows)?;
    let n = plan.len();
    let chosen = |i: usize| chain.chosen[i] as usize;

    // Fill, in index order: a node's parent is filled (and its child state set) before it.
    let mut tokens = vec![chain.anchor; n];
    let mut rank = vec![0u8; n];
    let mut alive = vec![true; n];
    let mut child_ids = vec![[0i32; TOP_K]; n];
    let mut child_q = vec![[0f32; TOP_K]; n];
    // Per node: ranks already drawn, and (T <= 0) its children's ranks in draw order.
    let mut drawn = vec![[false; TOP_K]; n];
    let mut greedy_order = vec![[0u8; TOP_K]; n];
    for m in 0..n {
        if m > 0 {
            let (p, s) = (plan[m].parent, plan[m].sibling);
            if !alive[p] {
                alive[m] = false;
                continue;
            }
            let r = if p < k && s == 0 {
                chosen(p)
            } else if t > 0.0 {
                let pos = opts.frontier + 1 + plan[p].depth as u64;
                let u = rng::uniform(opts.seed, pos, Purpose::TreeChild, s as u32);
                match draw_without_replacement(&child_q[p], &drawn[p], u) {
                    Some(r) => r,
                    None => {
                        alive[m] = false;
                        continue;
                    }
                }
            } else {
                greedy_order[p][s] as usize
            };
            drawn[p][r] = true;
            rank[m] = r as u8;
            tokens[m] = cand[plan[p].depth * TOP_K + r] as u32;
        }
        let d = plan[m].depth;
        if d == k {
            continue;
        }
        child_ids[m].copy_from_slice(&cand[d * TOP_K..][..TOP_K]);
        if m < k {
            // A spine node: the chain's q as given; its first child is the chain's token.
            child_q[m].copy_from_slice(&chain.q[m * TOP_K..][..TOP_K]);
            drawn[m][chosen(m)] = true;
            if t <= 0.0 {
                let order = desc_order(&rows.get(m, tokens[m])?);
                greedy_order[m][0] = chosen(m) as u8;
                let rest = order.iter().filter(|&&r| r as usize != chosen(m));
                for (slot, &r) in greedy_order[m][1..].iter_mut().zip(rest) {
                    *slot = r;
                }
            }
        } else {
            let e = rows.get(d, tokens[m])?;
            child_q[m] = candidate_selector::step_q(&e, t);
            if t <= 0.0 {
                greedy_order[m] = desc_order(&e);
            }
        }
    }

    // Compact: drop the removed nodes, renumber the rest in order.
    let keep: Vec<usize> = (0..n).filter(|&m| alive[m]).collect();
    let mut index = vec![u32::MAX; n];
    for (new, &m) in keep.iter().enumerate() {
        index[m] = new as u32;
    }
    let parents: Vec<u32> = keep[1..].iter().map(|&m| index[plan[m].parent]).collect();
    let mut ancestors = Vec::with_capacity(keep.len());
    ancestors.push(1u32);
    for (i, &p) in parents.iter().enumerate() {
        ancestors.push(ancestors[p as usize] | 1 << (i + 1));
    }
    Ok(DraftTree {
        tokens: keep.iter().map(|&m| tokens[m]).collect(),
        parents,
        depth: keep.iter().map(|&m| plan[m].depth as u32).collect(),
        sibling: keep.iter().map(|&m| plan[m].sibling as u8).collect(),
        ancestors,
        child_ids: keep.iter().map(|&m| child_ids[m]).collect(),
        child_q: keep.iter().map(|&m| child_q[m]).collect(),
        rank: keep.iter().map(|&m| rank[m]).collect(),
    })
}

/// A draw without replacement (the module contract's `T > 0` rule): `None` when the ranks
/// not yet drawn have no mass.
fn draw_without_replacement(q: &[f32; TOP_K], drawn: &[bool; TOP_K], u: f32) -> Option<usize> {
    let left = || (0..TOP_K).filter(|&c| !drawn[c]);
    let mass: f64 = left().map(|c| f64::from(q[c])).sum();
    // q is finite and >= 0 (checked for the chain; a softmax otherwise), so mass >= 0.
    if mass <= 0.0 {
        return None;
    }
    let target = f64::from(u) * mass;
    let mut run = 0f64;
    let mut last = None;
    for c in left() {
        run += f64::from(q[c]);
        if q[c] > 0.0 {
            last = Some(c);
        }
        if run > target {
            return Some(c);
        }
    }
    last
}

/// Checks shared by [`shape`] and [`build`].
fn check_common(k: usize, nodes: usize, temperature: f32, cand: &[i32]) -> Result<()> {
    let most = if k == 1 { 1 + TOP_K } else { MAX_NODES };
    if !(k < MAX_NODES && (k + 1..=most).contains(&nodes)) {
        let expected = format!("K + 1..={most} (K = {k}, at most {MAX_NODES} nodes)");
        return Err(DraftError::invalid("nodes", expected, nodes));
    }
    if temperature.is_nan() {
        return Err(DraftError::invalid("temperature", "not NaN", "NaN"));
    }
    for (i, col) in cand.chunks_exact(TOP_K).enumerate() {
        for (c, &id) in col.iter().enumerate() {
            if id < 0 || col[..c].contains(&id) {
                return Err(DraftError::invalid(
                    format!("cand_ids[{i}][{c}]"),
                    "a non-negative id, distinct within its column",
                    id,
                ));
            }
        }
    }
    Ok(())
}

fn check_chain(chain: &Chain<'_>, opts: &TreeOptions) -> Result<()> {
    let k = chain.proposals.len();
    if k == 0 {
        return Err(DraftError::invalid("chain.proposals.len()", "K >= 1", 0));
    }
    for (what, len, want) in [
        ("chain.chosen.len()", chain.chosen.len(), k),
        ("chain.q.len()", chain.q.len(), k * TOP_K),
        ("chain.cand_ids.len()", chain.cand_ids.len(), k * TOP_K),
    ] {
        if len != want {
            return Err(DraftError::invalid(what, format!("{want} (K = {k})"), len));
        }
    }
    check_common(k, opts.nodes, opts.temperature, chain.cand_ids)?;
    for i in 0..k {
        let j = chain.chosen[i];
        if !(0..TOP_K as i32).contains(&j) {
            return Err(DraftError::invalid(
                format!("chain.chosen[{i}]"),
                "0..16",
                j,
            ));
        }
        let id = chain.cand_ids[i * TOP_K + j as usize];
        if chain.proposals[i] != id {
            return Err(DraftError::invalid(
                format!("chain.proposals[{i}]"),
                format!("cand_ids[{i}][chosen = {j}] = {id}"),
                chain.proposals[i],
            ));
        }
    }
    if let Some(i) = chain.q.iter().position(|&x| !(x.is_finite() && x >= 0.0)) {
        return Err(DraftError::invalid(
            format!("chain.q[{}][{}]", i / TOP_K, i % TOP_K),
            "a finite probability >= 0",
            chain.q[i],
        ));
    }
    if opts.frontier.checked_add(1 + k as u64).is_none() {
        let expected = format!("F + 1 + K <= u64::MAX (K = {k})");
        return Err(DraftError::invalid("frontier", expected, opts.frontier));
    }
    Ok(())
}

/// The edge rows one build reads, each fetched once and checked finite.
struct Rows<'l, L: ?Sized> {
    lattice: &'l mut L,
    seen: Vec<(usize, u32, [f32; TOP_K])>,
}

impl<'l, L: EdgeScores + ?Sized> Rows<'l, L> {
    fn new(lattice: &'l mut L) -> Self {
        Rows {
            lattice,
            seen: Vec::new(),
        }
    }

    fn get(&mut self, column: usize, pred: u32) -> Result<[f32; TOP_K]> {
        if let Some((.., e)) = self.seen.iter().find(|s| s.0 == column && s.1 == pred) {
            return Ok(*e);
        }
        let e = self.lattice.row(column, pred)?;
        if let Some(c) = e.iter().position(|x| !x.is_finite()) {
            return Err(DraftError::invalid(
                format!("edge_scores[column {column}, pred {pred}][{c}]"),
                "a finite edge score",
                e[c],
            ));
        }
        self.seen.push((column, pred, e));
        Ok(e)
    }
}

/// One node of the planned (proxy) tree.
struct Planned {
    parent: usize,
    depth: usize,
    sibling: usize,
    proxy: u32,
    score: f64,
    /// Ranks by descending E of the proxy's row (depth `< K`).
    order: [u8; TOP_K],
    /// `ln softmax(E / Ts)` of that row (depth `< K`).
    logp: [f64; TOP_K],
}

/// A candidate slot of the best-first search: child number `s` of node `parent`.
struct Slot {
    score: f64,
    parent: usize,
    s: usize,
}

/// Ranks ordered by descending score, exact ties (also `-0 == +0`) by lower rank.
fn desc_order(e: &[f32; TOP_K]) -> [u8; TOP_K] {
    let mut o: [u8; TOP_K] = std::array::from_fn(|c| c as u8);
    o.sort_by(|&a, &b| {
        let (x, y) = (e[a as usize], e[b as usize]);
        y.partial_cmp(&x).unwrap_or(Ordering::Equal).then(a.cmp(&b))
    });
    o
}

/// `ln softmax(f64(e) / ts)` in f64, the sum in rank order.
fn log_softmax(e: &[f32; TOP_K], ts: f64) -> [f64; TOP_K] {
    let x: [f64; TOP_K] = std::array::from_fn(|c| f64::from(e[c]) / ts);
    let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = x.iter().map(|&v| (v - m).exp()).sum();
    let ln_sum = sum.ln();
    std::array::from_fn(|c| (x[c] - m) - ln_sum)
}

/// The shape (step 1): the spine, then best-first growth to `nodes` nodes.
fn plan<L: EdgeScores + ?Sized>(
    k: usize,
    nodes: usize,
    anchor: u32,
    cand: &[i32],
    temperature: f32,
    rows: &mut Rows<'_, L>,
) -> Result<Vec<Planned>> {
    let ts = if temperature > 0.0 {
        f64::from(temperature)
    } else {
        1.0
    };
    let node = |rows: &mut Rows<'_, L>, parent, depth, sibling, proxy, score| {
        let (mut order, mut logp) = ([0u8; TOP_K], [0f64; TOP_K]);
        if depth < k {
            let e = rows.get(depth, proxy)?;
            (order, logp) = (desc_order(&e), log_softmax(&e, ts));
        }
        Ok::<_, DraftError>(Planned {
            parent,
            depth,
            sibling,
            proxy,
            score,
            order,
            logp,
        })
    };
    let child = |plan: &[Planned], parent: usize, s: usize| {
        let p = &plan[parent];
        let r = p.order[s] as usize;
        (cand[p.depth * TOP_K + r] as u32, p.score + p.logp[r])
    };
    let slot = |plan: &[Planned], parent: usize, s: usize| Slot {
        score: child(plan, parent, s).1,
        parent,
        s,
    };
    let mut plan = Vec::with_capacity(nodes);
    plan.push(node(rows, 0, 0, 0, anchor, 0.0)?);
    for d in 0..k {
        let (proxy, score) = child(&plan, d, 0);
        plan.push(node(rows, d, d + 1, 0, proxy, score)?);
    }
    let mut open: Vec<Slot> = (0..k).map(|d| slot(&plan, d, 1)).collect();
    while plan.len() < nodes {
        // Highest score; ties: lower parent, then lower s (a total order over open slots).
        let better = |a: &Slot, b: &Slot| match a.score.partial_cmp(&b.score) {
            Some(Ordering::Greater) => true,
            Some(Ordering::Equal) | None => (a.parent, a.s) < (b.parent, b.s),
            Some(Ordering::Less) => false,
        };
        let Some(best) =
            (0..open.len()).reduce(|i, j| if better(&open[j], &open[i]) { j } else { i })
        else {
            let expected = "a tree of at most 1 + 16 + .. + 16^K nodes";
            return Err(DraftError::invalid("nodes", expected, nodes));
        };
        let Slot { parent, s, .. } = open.swap_remove(best);
        let (proxy, score) = child(&plan, parent, s);
        let depth = plan[parent].depth + 1;
        let new = plan.len();
        plan.push(node(rows, parent, depth, s, proxy, score)?);
        if s + 1 < TOP_K {
            open.push(slot(&plan, parent, s + 1));
        }
        if depth < k {
            open.push(slot(&plan, new, 0));
        }
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hand-made tree of depth 3: 0 -> 1 -> 2 -> 3 (the spine), 0 -> 4 -> 5, 4 -> 6.
    fn hand_tree() -> DraftTree {
        let ids = |n: i32| std::array::from_fn(|c| 100 * n + c as i32);
        let q = |n: usize| std::array::from_fn(|c| if c == n { 1.0 } else { 0.0 });
        DraftTree {
            tokens: vec![7, 1, 2, 3, 10, 11, 20],
            parents: vec![0, 1, 2, 0, 4, 4],
            depth: vec![0, 1, 2, 3, 1, 2, 2],
            sibling: vec![0, 0, 0, 0, 1, 0, 1],
            ancestors: vec![0b1, 0b11, 0b111, 0b1111, 0b1_0001, 0b11_0001, 0b101_0001],
            child_ids: (0..7).map(ids).collect(),
            child_q: (0..7).map(q).collect(),
            rank: vec![0, 3, 4, 5, 6, 7, 8],
        }
    }

    #[test]
    fn tree_truncated_renumbers_and_recomputes_ancestors() {
        let t = hand_tree();
        assert_eq!(t.truncated(3), t);
        assert_eq!(t.truncated(9), t);
        // Depth <= 2: nodes 0, 1, 2, 4, 5, 6 become 0..6; node 6 (old) had parent 4 (old 4 ->
        // new 3).
        let t2 = t.truncated(2);
        assert_eq!(t2.tokens, [7, 1, 2, 10, 11, 20]);
        assert_eq!(t2.parents, [0, 1, 0, 3, 3]);
        assert_eq!(t2.depth, [0, 1, 2, 1, 2, 2]);
        assert_eq!(t2.sibling, [0, 0, 0, 1, 0, 1]);
        assert_eq!(t2.rank, [0, 3, 4, 6, 7, 8]);
        assert_eq!(
            t2.ancestors,
            [0b1, 0b11, 0b111, 0b1001, 0b1_1001, 0b10_1001]
        );
        assert_eq!(t2.child_ids[3], t.child_ids[4], "child ids kept");
        assert_eq!(t2.child_q[5], t.child_q[6], "child q kept");
        let t1 = t.truncated(1);
        assert_eq!(t1.tokens, [7, 1, 10]);
        assert_eq!(t1.parents, [0, 0]);
        assert_eq!(t1.ancestors, [0b1, 0b11, 0b101]);
        assert_eq!(t1.children(0).collect::<Vec<_>>(), [1, 2]);
        let t0 = t.truncated(0);
        assert_eq!(t0.tokens, [7]);
        assert!(t0.parents.is_empty());
        assert_eq!(t0.ancestors, [1]);
        assert_eq!(t0.accept_layout().tokens, Vec::<i32>::new());
    }

    #[test]
    fn tree_truncated_is_idempotent_and_composes() {
        let t = hand_tree();
        for a in 0..4 {
            for b in 0..4 {
                assert_eq!(
                    t.truncated(a).truncated(b),
                    t.truncated(a.min(b)),
                    "{a} {b}"
                );
            }
        }
    }

    #[test]
    fn tree_draw_skips_drawn_and_massless_ranks() {
        let mut q = [0f32; TOP_K];
        (q[2], q[5], q[9]) = (0.5, 0.25, 0.25);
        let mut drawn = [false; TOP_K];
        drawn[5] = true;
        // Left: ranks 2 and 9, D = 0.75; u * D below 0.5 picks 2, at or above picks 9.
        assert_eq!(draw_without_replacement(&q, &drawn, 0.0), Some(2));
        assert_eq!(draw_without_replacement(&q, &drawn, 0.66), Some(2));
        assert_eq!(draw_without_replacement(&q, &drawn, 0.67), Some(9));
        assert_eq!(draw_without_replacement(&q, &drawn, 0.999_999_94), Some(9));
        drawn[2] = true;
        assert_eq!(draw_without_replacement(&q, &drawn, 0.0), Some(9));
        drawn[9] = true;
        assert_eq!(
            draw_without_replacement(&q, &drawn, 0.5),
            None,
            "no mass left"
        );
    }

    #[test]
    fn tree_descending_order_ties_by_rank_signed_zeros_included() {
        let mut e = [-1f32; TOP_K];
        (e[3], e[7], e[1]) = (-0.0, 0.0, 2.0);
        let o = desc_order(&e);
        assert_eq!(o[..4], [1, 3, 7, 0]);
        assert_eq!(usize::from(o[0]), candidate_selector::greedy_rank(&e));
    }

    #[test]
    fn tree_log_softmax_is_normalized_in_f64() {
        let e: [f32; TOP_K] = std::array::from_fn(|c| 0.3 * c as f32 - 2.0);
        for ts in [0.25, 1.0, 3.0] {
            let lp = log_softmax(&e, ts);
            let total: f64 = lp.iter().map(|x| x.exp()).sum();
            assert!((total - 1.0).abs() < 1e-12, "{total}");
            assert!(lp.windows(2).all(|w| w[0] < w[1]));
        }
    }
}
