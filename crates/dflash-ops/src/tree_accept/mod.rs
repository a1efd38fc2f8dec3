//! Tree accept: greedy and stochastic verification of a DFlash2 proposal tree against the
//! processed target distributions, for a batch of requests (recursive rejection sampling over
//! each visited node's children, lossless at every temperature).
//!
//! Semantics. Row `r` has `N = nodes[r]` live nodes (verify columns): node 0 is the anchor
//! (the root, depth 0); node `i >= 1` has token `x_i = tokens[r, i-1]` and parent
//! `par(i) = parents[r, i-1] < i`; `depth(i) = depth(par(i)) + 1`. The children of a node are
//! the nodes naming it as parent, in increasing index: the caller drew them in that order from
//! the node's child distribution, the 16 slots `S_n = ids[r, n, :]` with probabilities
//! `q_n = q[r, n, :]` (slot `n` of the `[cols-1, 16]` layout belongs to PARENT node `n`: for a
//! chain this is exactly `chain_accept`'s Top16 layout), without replacement. `p_n` is the
//! processed target distribution of node `n` (column `n` of `p`, read from the
//! [`Distributions`] form `target_distribution` wrote, as in `chain_accept`), predicting
//! position `F + 1 + depth(n)`. `F = start_pos[r]`, `s` = the row's seed. All arithmetic below
//! is f64 (every operation rounded, written order, no contraction); `p` and `q` are f32 values
//! widened exactly.
//!
//! 1. Walk from `n = 0`. At node `n` with children `c_1 .. c_m` (`m >= 1`; token `x_k` of
//!    `c_k`, slot `j_k` of `x_k` in `S_n`, `q(x) = q_n[j]` for `x = S_n[j]`):
//!    - residual weights over the slots `w[j] = f64(p_n(S_n[j]))` (outside the slots the
//!      residual weight of `v` stays `p_n(v)` throughout), `Z = 1`, `D = 1` (the first child
//!      is tested against `p_n` and `q_n` as given, exactly `chain_accept`'s test);
//!    - for `k = 1 .. m`: `u = rng::uniform(s, F + 1 + depth(n), Accept, k - 1)`. If
//!      `q(x_k) > 0`: accept iff `(u * q(x_k)) * Z < w[j_k] * D`; on rejection, for every
//!      untried slot `j` (not `j_1 .. j_(k-1)`, `j_k` included) `w[j] = max(w[j] - (Z *
//!      q_n[j]) / D, 0)`. If `q(x_k) == 0` (a child chosen deterministically, e.g. a greedy
//!      side child, whose proposal is the point mass at `x_k`): accept iff `u * Z < w[j_k]`;
//!      on rejection `w[j_k] = max(w[j_k] - Z, 0)`. After a rejection slot `j_k` is tried,
//!      `D = ((0 + q_n[j]) + ..)` over the untried slots in increasing `j`, and
//!      `Z = ((M + w[0]) + w[1]) + .. + w[15]` with `M` the blocked sum (item 3's tile order)
//!      of `p_n(v)` over the ids `v` that are not in `S_n`. This is `r <- norm(max(r - Q,
//!      0))` with `Q` the proposal renormalized without the earlier children, kept unnormalized
//!      (`r = w / Z`, `Q = q / D`), so that no division by `Z` ever happens.
//!    - The first accepted child becomes `n` (the walk continues there); if all `m` are
//!      rejected, the correction is the blocked draw (item 3) over the weights `w(v)`
//!      (`w[j]` at `v = S_n[j]`, `p_n(v)` elsewhere) with `u = rng::uniform(s, F + 1 +
//!      depth(n), Correction, 0)`, and the walk ends.
//!
//!    At a node without children (a leaf) the walk ends with the bonus: the blocked draw over
//!    `w(v) = p_n(v)` with `u = rng::uniform(s, F + 1 + depth(n), Bonus, 0)`.
//! 2. Outputs: the visited path `0 = v_0, v_1, .., v_A` (`A` accepted nodes, `A` = the final
//!    node's depth), `accepted[r] = A`, `out_len[r] = A + 1`, `out_tokens[r, :] = [x_(v_1),
//!    .., x_(v_A), correction_or_bonus, -1, ..]`, `path[r, :] = [0, v_1, .., v_A, -1, ..]`.
//! 3. The blocked draw and its fallbacks are `chain_accept`'s (items 3 and 4 of its contract:
//!    tiles of 1024 ids, lane sums, shuffle tree, sequential tile walk; a draw whose weights
//!    have no positive total is repeated over `p_n` with the same `u`, then token 0).
//!
//! A chain-shaped tree (`par(i) = i - 1`, one child per node) decides exactly as
//! `chain_accept` with the same inputs: every tested child is a first child (the test above
//! with `Z = D = 1`), a rejection's correction weights are `max(p - q, 0)`. A one-hot `p`
//! (a greedy target column, stored or given as its id in the `Live` form) accepts exactly the
//! first child whose token is its argmax `g` (every other child has `w = 0` and fails; `g`'s
//! weight stays the whole residual mass), and its correction or bonus is `g`. A row's result
//! depends only on its own data, never on its row index.
//!
//! Why it is lossless (the caller's part). For each node the test above is one step of
//! rejection sampling with proposal `Q_k` and residual `r_k`; its output follows `r_k`
//! whenever `x_k` is distributed as `Q_k` given everything that decided it is tested, so the
//! caller must (a) draw a node's children from `q_n` without replacement in index order (or
//! choose a `q = 0` child deterministically), and (b) never let whether a node HAS a k-th
//! child depend on which token that child is (it may depend on the earlier siblings and the
//! ancestors; what comes after a rejection is drawn from the same residual whatever was
//! rejected). A best-first expansion over each child's own score breaks (b); the DFlash2 tree
//! builder (`dflash_draft::tree`) fixes the shape from the lattice before any draw.
//! `tests/tree_acceptance.rs` checks both ways statistically.
//!
//! Shapes. p: `[rows, cols, vocab]` f32; greedy: `[rows, cols]` i32; tokens, parents:
//!   `[rows, cols-1]` i32; q: `[rows, cols-1, 16]` f32, ids: `[rows, cols-1, 16]` i32;
//!   nodes, start_pos, accepted, out_len: `[rows]` i32; seeds: `[rows, 2]` i32; out_tokens,
//!   path: `[rows, cols]` i32. Row capacity as in `chain_accept`: a tensor may hold more rows
//!   than `rows`; rows at or past `rows` are never read or written.
//! Rounding points. None: `u` is an exact 24-bit f32; every value is an f64 operation above.
//! Accumulation. Fixed (above and `chain_accept` item 3), so CPU and CUDA decide identically.
//! Tie-breaking. The blocked draw's: increasing id, strict `>` against the target.
//! Masking / live extents. Nodes `>= N`: never read (their p, tokens, parents, slots). Only the
//!   slots of visited nodes that have children and the `p` rows of visited nodes are read.
//! Caller guarantees (checked on the CPU, trusted on CUDA, where `nodes` is clamped to
//!   `1..=cols`, a node whose parent is not an earlier node is nobody's child, a child whose
//!   token is not among its parent's slot ids or repeats an earlier sibling's slot is rejected
//!   without changing the residual, any negative `greedy` entry reads the `p` row and an entry
//!   `>= vocab` is a one-hot outside the vocabulary, and the draw falls back to token 0):
//!   `1 <= nodes <= cols`; `start_pos >= 0`; `0 <= parents[i-1] < i`; tokens `< vocab`; for
//!   every node with children: slot ids `< vocab` and distinct, `q` finite `>= 0`, every
//!   child's token one of the slot ids, siblings' tokens distinct; `greedy` of live nodes `-1`
//!   or an id `< vocab`; `p` of live sampled nodes finite, `>= 0`, with positive mass.
//! Writes. Every element of `accepted`, `out_len`, `out_tokens` and `path` in rows `< rows`
//!   (entries past `A + 1` (path) or past `L` (tokens) are -1). Inputs are never written.
//! Comparison. All outputs exact.
//!
//! CUDA. One block of 1024 threads per row (kernels/tree_accept.cu, compiled after
//! kernels/chain_accept.cu, whose blocked draw it shares: one draw, one place). Thread 0 walks
//! the tree (a node's children found by a scan of the at most [`MAX_COLS`] parents); the
//! vocabulary passes (`M`, the correction or bonus draw) use the whole block. A greedy
//! column's `M` is `0` or `1` (`g` in the slots or not) without a pass, and its correction or
//! bonus is `g` itself (as in `chain_accept`). All f64 operations are `_rn` intrinsics.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
pub(crate) mod reference;
#[cfg(test)]
mod tests;

pub use crate::chain_accept::Distributions;
use crate::chain_accept::{MAX_VOCAB, TOP};
#[cfg(any(test, feature = "conformance"))]
use crate::registry::{Case, CaseRun, Criterion, InputCheck, output};
use crate::target_distribution::check_rows;
use crate::{Backend, Buffer, Result, check_param};

/// Registry id.
pub const OP: &str = "tree_accept";

/// Most nodes (columns) a row may have: the largest DFlash2 tree, anchor included
/// (`dflash_config::MAX_TREE_NODES`).
pub const MAX_COLS: usize = 32;

/// Static shape of a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Params {
    /// Requests in the call (buffers may hold more rows, see the contract's row capacity).
    pub rows: usize,
    /// Node columns per request, `1..=MAX_COLS`.
    pub cols: usize,
    /// Vocabulary rows of `p`, `1..=chain_accept::MAX_VOCAB`.
    pub vocab: usize,
}

/// The tree of every row: shape, tokens and the distributions the children were drawn from.
#[derive(Clone, Copy, Debug)]
pub struct Trees<'a> {
    /// Live nodes `N` per row, `[rows]`.
    pub nodes: &'a Buffer<i32>,
    /// Token of node `i >= 1` at `i - 1`, `[rows, cols-1]`.
    pub tokens: &'a Buffer<i32>,
    /// Parent of node `i >= 1` at `i - 1` (an earlier node), `[rows, cols-1]`.
    pub parents: &'a Buffer<i32>,
    /// Child distribution of node `n` (its children's slots), `[rows, cols-1, 16]` f32.
    pub q: &'a Buffer<f32>,
    /// Candidate ids of node `n`'s child distribution, `[rows, cols-1, 16]` i32.
    pub ids: &'a Buffer<i32>,
}

/// Outputs of [`run`].
#[derive(Debug)]
pub struct Outputs<'a> {
    /// Accepted nodes `A` (the final node's depth), `[rows]`.
    pub accepted: &'a mut Buffer<i32>,
    /// Licensed outputs `y_1..y_L` then -1, `[rows, cols]`.
    pub out_tokens: &'a mut Buffer<i32>,
    /// `L = A + 1`, `[rows]`.
    pub out_len: &'a mut Buffer<i32>,
    /// The visited nodes `0, v_1, .., v_A` then -1, `[rows, cols]` (the commit's path).
    pub path: &'a mut Buffer<i32>,
}

/// Verify the trees of a batch (see the module contract). Validates every shape and parameter
/// (and, on the CPU, every value the contract constrains) before writing; a refused call
/// leaves the outputs untouched.
pub fn run(
    be: &Backend,
    target: Distributions<'_>,
    trees: &Trees<'_>,
    seeds: &Buffer<i32>,
    start_pos: &Buffer<i32>,
    out: Outputs<'_>,
    params: &Params,
) -> Result<()> {
    let Params { rows, cols, vocab } = *params;
    check_param(OP, "cols", (1..=MAX_COLS).contains(&cols), cols, || {
        format!("1..={MAX_COLS}")
    })?;
    check_param(OP, "vocab", (1..=MAX_VOCAB).contains(&vocab), vocab, || {
        format!("1..={MAX_VOCAB}")
    })?;
    check_param(OP, "rows", rows <= u32::MAX as usize, rows, || {
        "rows below 2^32".into()
    })?;
    let column = || format!("[cols={cols}, vocab={vocab}]");
    let one = || "[1]".to_string();
    let per_col = || format!("[cols={cols}]");
    let per_child = || format!("[cols-1={}]", cols - 1);
    let slots = || format!("[cols-1={}, 16]", cols - 1);
    match target {
        Distributions::Full(p) => check_rows(OP, "p", p.len(), rows, cols * vocab, column)?,
        Distributions::Live { p, greedy } => {
            check_rows(OP, "p", p.len(), rows, cols * vocab, column)?;
            check_rows(OP, "greedy", greedy.len(), rows, cols, per_col)?;
        }
    }
    check_rows(OP, "nodes", trees.nodes.len(), rows, 1, one)?;
    check_rows(OP, "tokens", trees.tokens.len(), rows, cols - 1, per_child)?;
    check_rows(
        OP,
        "parents",
        trees.parents.len(),
        rows,
        cols - 1,
        per_child,
    )?;
    check_rows(OP, "q", trees.q.len(), rows, (cols - 1) * TOP, slots)?;
    check_rows(OP, "ids", trees.ids.len(), rows, (cols - 1) * TOP, slots)?;
    check_rows(OP, "start_pos", start_pos.len(), rows, 1, one)?;
    check_rows(OP, "seeds", seeds.len(), rows, 2, || "[2]".into())?;
    check_rows(OP, "accepted", out.accepted.len(), rows, 1, one)?;
    check_rows(OP, "out_len", out.out_len.len(), rows, 1, one)?;
    check_rows(OP, "out_tokens", out.out_tokens.len(), rows, cols, per_col)?;
    check_rows(OP, "path", out.path.len(), rows, cols, per_col)?;
    if rows == 0 {
        return Ok(());
    }
    match be {
        Backend::Cpu => {
            let (p, greedy) = match target {
                Distributions::Full(p) => (p.host(OP, "p")?, None),
                Distributions::Live { p, greedy } => {
                    (p.host(OP, "p")?, Some(greedy.host(OP, "greedy")?))
                }
            };
            let host = reference::HostTrees {
                nodes: trees.nodes.host(OP, "nodes")?,
                tokens: trees.tokens.host(OP, "tokens")?,
                parents: trees.parents.host(OP, "parents")?,
                q: trees.q.host(OP, "q")?,
                ids: trees.ids.host(OP, "ids")?,
            };
            reference::run(
                p,
                greedy,
                &host,
                seeds.host(OP, "seeds")?,
                start_pos.host(OP, "start_pos")?,
                reference::HostOutputs {
                    accepted: out.accepted.host_mut(OP, "accepted")?,
                    out_tokens: out.out_tokens.host_mut(OP, "out_tokens")?,
                    out_len: out.out_len.host_mut(OP, "out_len")?,
                    path: out.path.host_mut(OP, "path")?,
                },
                params,
            )
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(c) => cuda::run(c, target, trees, seeds, start_pos, out, params),
    }
}

// ---------------------------------------------------------------------------------------------
// Conformance cases.

#[cfg(any(test, feature = "conformance"))]
use crate::target_distribution::Gen;

/// Deterministic inputs of one case.
#[cfg(any(test, feature = "conformance"))]
#[derive(Clone, Debug)]
pub(crate) struct CaseData {
    pub(crate) p: Vec<f32>,
    pub(crate) nodes: Vec<i32>,
    pub(crate) tokens: Vec<i32>,
    pub(crate) parents: Vec<i32>,
    pub(crate) q: Vec<f32>,
    pub(crate) ids: Vec<i32>,
    pub(crate) seeds: Vec<i32>,
    pub(crate) start_pos: Vec<i32>,
}

/// Rows cycle through behaviours (kind = (row + first_kind) % 5): 0 greedy target with
/// one-hot q and greedy side children (the target's argmax sometimes a side child, sometimes
/// absent), 1 sampled target whose mass sits on the candidates (many acceptances, deep
/// walks), 2 sampled target and random q (rejections, renormalized side tests, corrections
/// from the residual), 3 sampled target with one child per node (a chain), 4 a lone anchor
/// (`N = 1`). Every row's tree is valid: side children are sampled without replacement from
/// their parent's q (or greedy order), shapes are random (bushy near the root), tokens are
/// the slot ids.
#[cfg(any(test, feature = "conformance"))]
#[allow(clippy::needless_range_loop)] // reason: node indices address several parallel arrays
pub(crate) fn case_data(
    rows: usize,
    cols: usize,
    vocab: usize,
    seed: u64,
    first_kind: usize,
) -> CaseData {
    let mut g = Gen::new(seed);
    let k = cols - 1;
    let mut d = CaseData {
        p: vec![0f32; rows * cols * vocab],
        nodes: vec![0; rows],
        tokens: vec![0; rows * k],
        parents: vec![0; rows * k],
        q: vec![0f32; rows * k * TOP],
        ids: vec![0; rows * k * TOP],
        seeds: vec![0; 2 * rows],
        start_pos: vec![0; rows],
    };
    for r in 0..rows {
        let kind = (r + first_kind) % 5;
        let n = match kind {
            4 => 1,
            _ if r == 0 => cols,
            _ => 1 + g.below(cols),
        };
        let s = g.next_u64();
        d.seeds[2 * r] = s as u32 as i32;
        d.seeds[2 * r + 1] = (s >> 32) as u32 as i32;
        d.start_pos[r] = g.below(100_000) as i32;
        // Shape: node i's parent is i - 1 for a chain, else an earlier node (biased to the
        // root and to recent nodes).
        let mut parent = vec![0usize; n];
        for i in 1..n {
            parent[i] = if kind == 3 || g.below(3) == 0 {
                i - 1
            } else {
                g.below(i)
            };
        }
        // Slots of every node that has children: 16 distinct ids and a q.
        let greedy = kind == 0;
        for par in 0..n.min(k) {
            let base = (r * k + par) * TOP;
            let mut chosen: Vec<i32> = Vec::with_capacity(TOP);
            while chosen.len() < TOP {
                let v = g.below(vocab) as i32;
                if !chosen.contains(&v) {
                    chosen.push(v);
                }
            }
            let mut w: Vec<f64> = (0..TOP).map(|_| 0.02 + f64::from(g.unit())).collect();
            if kind == 1 {
                w[g.below(TOP)] += 6.0;
            }
            if greedy {
                w = vec![0.0; TOP];
                w[g.below(TOP)] = 1.0;
            } else if g.below(4) == 0 {
                // Small support: a few slots carry all the mass.
                for (s, x) in w.iter_mut().enumerate() {
                    if s % 5 != 0 {
                        *x = 0.0;
                    }
                }
            }
            let total: f64 = w.iter().sum();
            for s in 0..TOP {
                d.ids[base + s] = chosen[s];
                d.q[base + s] = (w[s] / total) as f32;
            }
        }
        // Children: draws without replacement from the parent's q (greedy: descending q,
        // then slot order, so the first child is the one-hot's slot and later ones have
        // q = 0). A node whose q has no draw left hangs the new node under the nearest
        // earlier node that has one.
        let mut used: Vec<Vec<usize>> = vec![Vec::new(); n];
        let mut live_n = n;
        for i in 1..n {
            let order = std::iter::once(parent[i]).chain((0..i).rev());
            let mut pick = None;
            for par in order {
                let base = (r * k + par) * TOP;
                let qs = &d.q[base..base + TOP];
                let free: Vec<usize> = (0..TOP).filter(|s| !used[par].contains(s)).collect();
                let slot = if greedy {
                    let mut order = free;
                    order.sort_by(|&a, &b| qs[b].total_cmp(&qs[a]).then(a.cmp(&b)));
                    order.first().copied()
                } else {
                    let mass: f64 = free.iter().map(|&s| f64::from(qs[s])).sum();
                    let t = f64::from(g.unit()) * mass;
                    let mut c = 0.0;
                    let mut last = None;
                    for &s in &free {
                        c += f64::from(qs[s]);
                        if qs[s] > 0.0 {
                            last = Some(s);
                            if c > t {
                                break;
                            }
                        }
                    }
                    last
                };
                if let Some(s) = slot {
                    pick = Some((par, s));
                    break;
                }
            }
            let Some((par, s)) = pick else {
                live_n = i;
                break;
            };
            parent[i] = par;
            used[par].push(s);
            d.parents[r * k + i - 1] = par as i32;
            d.tokens[r * k + i - 1] = d.ids[(r * k + par) * TOP + s];
        }
        let n = live_n;
        d.nodes[r] = n as i32;
        // Target distributions per node.
        for i in 0..n {
            let col = &mut d.p[(r * cols + i) * vocab..(r * cols + i + 1) * vocab];
            let kids: Vec<usize> = (i + 1..n).filter(|&c| parent[c] == i).collect();
            let slot_ids: Vec<i32> = if i < k {
                let base = (r * k + i) * TOP;
                d.ids[base..base + TOP].to_vec()
            } else {
                Vec::new()
            };
            if greedy {
                // The argmax: one of the children (often the first, sometimes a side child)
                // or some other id.
                let mode = match (kids.is_empty(), g.below(3)) {
                    (false, 0) => d.tokens[r * k + kids[0] - 1] as usize,
                    (false, 1) => d.tokens[r * k + kids[g.below(kids.len())] - 1] as usize,
                    _ => g.below(vocab),
                };
                col[mode] = 1.0;
                continue;
            }
            let mut w = vec![0f64; vocab];
            if kind == 1 && !slot_ids.is_empty() {
                for &v in &slot_ids {
                    w[v as usize] += 0.2 + f64::from(g.unit());
                }
            } else {
                w[g.below(vocab)] = 3.0;
                for &v in slot_ids.iter().take(6) {
                    w[v as usize] += f64::from(g.unit());
                }
            }
            for _ in 0..(vocab / 64).max(4) {
                w[g.below(vocab)] += f64::from(g.unit()) * 0.05;
            }
            let total: f64 = w.iter().sum();
            for (o, x) in col.iter_mut().zip(&w) {
                *o = (x / total) as f32;
            }
        }
    }
    d
}

/// The `Live` form of a case's distributions (as `chain_accept`'s: one-hot columns become
/// their ids over a poisoned `p`).
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn live_distributions(d: &CaseData, cols: usize, vocab: usize) -> (Vec<f32>, Vec<i32>) {
    let chain = crate::chain_accept::CaseData {
        p: d.p.clone(),
        proposals: Vec::new(),
        live: d.nodes.clone(),
        q: Vec::new(),
        ids: Vec::new(),
        seeds: Vec::new(),
        start_pos: Vec::new(),
    };
    crate::chain_accept::live_distributions(&chain, cols, vocab)
}

/// A case in the full form (`live_from = None`) or the `Live` form, rows from kind `first`.
#[cfg(any(test, feature = "conformance"))]
fn case(
    rows: usize,
    cols: usize,
    vocab: usize,
    seed: u64,
    first: usize,
    live: bool,
) -> impl Fn(&Backend) -> Result<CaseRun> + Send + Sync {
    use crate::Element;
    move |be: &Backend| {
        let d = case_data(rows, cols, vocab, seed, first);
        let mut inputs = InputCheck::default();
        let (p, greedy) = if live {
            let (p_live, greedy_ids) = live_distributions(&d, cols, vocab);
            (
                inputs.upload(be, "p", &p_live)?,
                Some(inputs.upload(be, "greedy", &greedy_ids)?),
            )
        } else {
            (inputs.upload(be, "p", &d.p)?, None)
        };
        let nodes = inputs.upload(be, "nodes", &d.nodes)?;
        let tokens = inputs.upload(be, "tokens", &d.tokens)?;
        let parents = inputs.upload(be, "parents", &d.parents)?;
        let q = inputs.upload(be, "q", &d.q)?;
        let ids = inputs.upload(be, "ids", &d.ids)?;
        let seeds = inputs.upload(be, "seeds", &d.seeds)?;
        let start_pos = inputs.upload(be, "start_pos", &d.start_pos)?;
        let mut accepted = be.filled(rows, i32::POISON)?;
        let mut out_tokens = be.filled(rows * cols, i32::POISON)?;
        let mut out_len = be.filled(rows, i32::POISON)?;
        let mut path = be.filled(rows * cols, i32::POISON)?;
        let target = match &greedy {
            None => Distributions::Full(&p),
            Some(g) => Distributions::Live { p: &p, greedy: g },
        };
        run(
            be,
            target,
            &Trees {
                nodes: &nodes,
                tokens: &tokens,
                parents: &parents,
                q: &q,
                ids: &ids,
            },
            &seeds,
            &start_pos,
            Outputs {
                accepted: &mut accepted,
                out_tokens: &mut out_tokens,
                out_len: &mut out_len,
                path: &mut path,
            },
            &Params { rows, cols, vocab },
        )?;
        let mut modified = Vec::new();
        inputs.verify(be, "p", &p, &mut modified)?;
        if let Some(g) = &greedy {
            inputs.verify(be, "greedy", g, &mut modified)?;
        }
        for (name, buf) in [
            ("nodes", &nodes),
            ("tokens", &tokens),
            ("parents", &parents),
            ("ids", &ids),
            ("seeds", &seeds),
            ("start_pos", &start_pos),
        ] {
            inputs.verify(be, name, buf, &mut modified)?;
        }
        inputs.verify(be, "q", &q, &mut modified)?;
        let poison = |n: usize| vec![i32::POISON; n];
        let mut outputs = vec![
            output(
                "accepted",
                Criterion::Exact,
                &poison(rows),
                &be.download(&accepted)?,
                |_| true,
            ),
            output(
                "out_tokens",
                Criterion::Exact,
                &poison(rows * cols),
                &be.download(&out_tokens)?,
                |_| true,
            ),
            output(
                "out_len",
                Criterion::Exact,
                &poison(rows),
                &be.download(&out_len)?,
                |_| true,
            ),
            output(
                "path",
                Criterion::Exact,
                &poison(rows * cols),
                &be.download(&path)?,
                |_| true,
            ),
        ];
        if rows == 1 {
            // A single row's A and L are one element each: constant by construction.
            outputs[0].allow_constant = true;
            outputs[2].allow_constant = true;
        }
        Ok(CaseRun {
            outputs,
            modified_inputs: modified,
        })
    }
}

/// Conformance cases.
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn cases() -> Vec<Case> {
    use crate::target_distribution::OFFICIAL_VOCAB as V;
    vec![
        Case::new(OP, "rows8_nodes32_v4096", case(8, 32, 4096, 41, 0, false)),
        Case::new(OP, "rows8_nodes16_v4096", case(8, 16, 4096, 42, 1, false)),
        Case::new(
            OP,
            "rows8_nodes32_v4096_live",
            case(8, 32, 4096, 43, 0, true),
        ),
        Case::new(
            OP,
            "rows1_nodes32_official_vocab_sampled",
            case(1, 32, V, 44, 2, false),
        ),
        Case::new(
            OP,
            "rows1_nodes32_official_vocab_live_greedy",
            case(1, 32, V, 45, 0, true),
        ),
        Case::new(
            OP,
            "rows8_nodes32_official_vocab",
            case(8, 32, V, 46, 0, false),
        )
        .heavy(),
        Case::new(
            OP,
            "rows8_nodes32_official_vocab_live",
            case(8, 32, V, 47, 1, true),
        )
        .heavy(),
    ]
}
