//! Chain accept: greedy and stochastic verification of a proposal chain against the processed
//! target distributions, for a batch of requests.
//!
//! Semantics. Row `r` has `Q = live[r]` live verify columns and `P = Q - 1` proposals
//! `d_1..d_P` (`d_j = proposals[r, j-1]`), start position `F = start_pos[r]` and seed
//! `s = seeds[r, 0] as u32 | (seeds[r, 1] as u32) << 32`. `p_i` is the processed target
//! distribution of verify column `i` (from `target_distribution`), read from the
//! [`Distributions`] form that op wrote: [`Distributions::Full`] `p_i = p[r, i, :]`;
//! [`Distributions::Live`] `p_i = one_hot(g)` when `g = greedy[r, i] >= 0` (a greedy column:
//! no element of `p` is read for it), else `p_i = p[r, i, :]` (`greedy[r, i] == -1`, a
//! sampled column). The proposal mass `q_i(v)` is a point mass at `d_(i+1)`
//! ([`Proposal::OneHot`], DFlash) or the retained conditional q of the first of the 16 slots
//! `ids[r, i, :]` holding `v`, 0 when none does ([`Proposal::Top16`], DFlash2).
//!
//! 1. Acceptance scan, `i = 0, 1, .., P-1`: `x = d_(i+1)`,
//!    `u = rng::uniform(s, F+1+i, Accept, 0)`; accept iff `f64(u) * f64(q_i(x)) < f64(p_i(x))`
//!    (this is `u < min(1, p/q)`, exactly, in f64). Stop at the first rejection.
//!    `A` = the number accepted.
//! 2. Correction (first rejection at `i = A < P`): weights `w(v) = max(f64(p_A(v)) - f64(q_A(v)),
//!    0)` over every `v < vocab`, `u = rng::uniform(s, F+1+A, Correction, 0)`.
//!    Bonus (all `P` accepted, `A = P`): `w(v) = f64(p_P(v))`, `u = rng::uniform(s, F+P+1,
//!    Bonus, 0)`.
//! 3. Blocked inverse CDF (every operation an f64 add in this order):
//!    tiles of [`TILE`] = 1024 ids, tile `j` covers ids `[1024 j, 1024 j + 1024)` (ids
//!    `>= vocab` weigh 0). Lane sums `a_l = (..((0 + w(1024j + l)) + w(1024j + 32 + l)) + ..)
//!    + w(1024j + 992 + l)` for `l = 0..32`; the tile sum `s_j` is the tree
//!    `for off in 16, 8, 4, 2, 1: a_l = a_l + a_(l+off) for l < off`, `s_j = a_0`.
//!    `total = (..(0 + s_0) + s_1) + ..`; `target = f64(u) * total`;
//!    `C_j = (..(0 + s_0) + ..) + s_(j-1)`. The chosen tile is the first `j` with
//!    `C_j + s_j > target`; inside it the token is the first id `v` (increasing) whose running
//!    sum `(..(C_j + w(first)) + ..) + w(v) > target`, else the last id of the tile with
//!    `w > 0`. A token of weight 0 is never chosen.
//! 4. Fallbacks. If `total` is not `> 0` (a correction where `p <= q` everywhere, possible only
//!    through rounding when `p == q`) the draw is repeated with `w = p_A` (same `u`). If that
//!    fails too (invalid `p`, refused on the CPU) the token is 0.
//! 5. Outputs: `accepted[r] = A`, `out_len[r] = L = A + 1`,
//!    `out_tokens[r, :] = [d_1, .., d_A, correction_or_bonus, -1, .., -1]`.
//!
//! A one-hot `p` (greedy target) makes this exactly greedy verification: `d` is accepted iff
//! `p(d) = 1` (`u * q < 1` always holds, `u * q < 0` never), and the correction or bonus is the
//! argmax (the only positive weight). The one-hot of a `Live` greedy column is the same `p`
//! (1 at `g`, +0 elsewhere), taken through the same steps, so both forms decide bit for bit
//! alike. `P = 0` verifies only the anchor: the bonus is drawn from `p_0`. A row's result
//! depends only on its own data, never on its row index.
//!
//! Shapes. p: `[rows, cols, vocab]` f32; greedy: `[rows, cols]` i32; proposals:
//!   `[rows, cols-1]` i32; live, start_pos, accepted, out_len: `[rows]` i32; seeds: `[rows, 2]`
//!   i32; Top16 q: `[rows, cols-1, 16]` f32, ids: `[rows, cols-1, 16]` i32; out_tokens:
//!   `[rows, cols]` i32. Row capacity: every tensor may hold more rows than `rows` (a
//!   workspace planned once for B rows runs a round of `n <= B` rows with its B-row buffers):
//!   its length is a whole number of its rows, at least `rows`; rows at or past `rows` are
//!   never read or written.
//! Rounding points. None: `u` is an exact 24-bit f32, `p` and `q` are read as f32 and widened
//!   exactly (a greedy column's one-hot is exactly 1 and 0); every comparison and sum is the
//!   f64 operation written above.
//! Accumulation. Fixed (item 3): part of the contract, so CPU and CUDA decide identically.
//! Tie-breaking. Inverse CDF in increasing id order; strict `>` against the target.
//! Masking / live extents. Columns `> P` of `p` and of `greedy`, the `p` row of a greedy
//!   column, proposals past `d_P` and Top16 slots past `P-1` are never read.
//! Caller guarantees (checked on the CPU, trusted on CUDA, where `live` is clamped to
//!   `1..=cols`, out-of-range proposals are treated as `p(x) = 0`, any negative `greedy`
//!   entry reads the `p` row and an entry `>= vocab` is a one-hot outside the vocabulary,
//!   `p = 0` everywhere, so its draw falls back to token 0): `1 <= live <= cols`;
//!   `start_pos >= 0`; proposals of live columns `< vocab`; `greedy` of live columns `-1` or
//!   an id `< vocab`; `p` of live non-greedy columns finite, `>= 0`, with positive mass; Top16
//!   slots of live proposals: ids `< vocab` and distinct, q finite `>= 0`, and `d_(i+1)` is
//!   one of the ids with `q > 0`.
//! Writes. Every element of `accepted`, `out_len` and `out_tokens` in rows `< rows` (entries
//!   past `L` are -1). Inputs are never written.
//! Comparison. All outputs exact.
//!
//! CUDA. One block of 1024 threads per row. Thread `i` runs column `i`'s acceptance test (its
//! loads and random word depend on no other column), then thread 0 scans the results in
//! column order and stops at the first rejection. The draw uses one warp per tile for the
//! tile sums (each lane issues its loads 16 at a time, then adds them in the contract's
//! order; shuffle-down tree), thread 0 for the sequential `total`/`C_j` walk and for the
//! running sum inside the chosen tile (staged in shared memory). A greedy column's `p(v)` is
//! computed from its id (`v == g`), never loaded, and its correction or bonus is `g` itself
//! (for `g` below the vocabulary) without the scan (the blocked draw over weights that are 0
//! except at `g` returns `g` for any `u`; a correction's weight at `g` is positive, the
//! rejected proposal not being `g`, and a zero total falls back to `p`, the one-hot at `g`).
//! All f64 operations are `_rn` intrinsics (no contraction).

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
pub(crate) mod reference;
#[cfg(test)]
mod tests;

#[cfg(any(test, feature = "conformance"))]
use crate::Element;
#[cfg(any(test, feature = "conformance"))]
use crate::registry::{Case, CaseRun, Criterion, InputCheck, output};
use crate::target_distribution::check_rows;
use crate::{Backend, Buffer, Result, check_param};

/// Registry id.
pub const OP: &str = "chain_accept";

/// Ids per tile of the blocked inverse CDF.
pub const TILE: usize = 1024;
/// Largest vocabulary (1024 tiles of 1024 ids; the tile sums live in shared memory on CUDA).
pub const MAX_VOCAB: usize = 1 << 20;
/// Retained candidates per DFlash2 proposal column.
pub const TOP: usize = 16;
/// Most columns a call may have.
pub const MAX_COLS: usize = 256;

/// Static shape of a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Params {
    /// Requests in the call (the launch rows; buffers may hold more, see the contract's row
    /// capacity).
    pub rows: usize,
    /// Verify columns per request (W = K + 1), `1..=MAX_COLS`.
    pub cols: usize,
    /// Vocabulary rows of `p`, `1..=MAX_VOCAB`.
    pub vocab: usize,
}

/// The proposal distribution `q` the chain was drawn from.
#[derive(Clone, Copy, Debug)]
pub enum Proposal<'a> {
    /// DFlash: `q_i` is a point mass at `d_(i+1)`.
    OneHot,
    /// DFlash2: the retained conditional `q_i` over 16 global ids.
    Top16 {
        /// Probabilities, `[rows, cols-1, 16]` f32.
        q: &'a Buffer<f32>,
        /// Global token ids, `[rows, cols-1, 16]` i32.
        ids: &'a Buffer<i32>,
    },
}

/// Where the processed target distributions are read from: the two output forms of
/// `target_distribution` ([`crate::target_distribution::Outputs`]).
#[derive(Clone, Copy, Debug)]
pub enum Distributions<'a> {
    /// `p: [rows, cols, vocab]` f32 of every live column (greedy columns one-hot).
    Full(&'a Buffer<f32>),
    /// `greedy: [rows, cols]` i32 (a greedy column's argmax, `-1` for a sampled column) and
    /// `p: [rows, cols, vocab]` f32, read only for sampled columns.
    Live {
        /// Distributions of the sampled columns.
        p: &'a Buffer<f32>,
        /// Argmax of each greedy column, `-1` for each sampled one.
        greedy: &'a Buffer<i32>,
    },
}

/// Outputs of [`run`] and [`run_with`].
#[derive(Debug)]
pub struct Outputs<'a> {
    /// Accepted proposals `A`, `[rows]`.
    pub accepted: &'a mut Buffer<i32>,
    /// Licensed outputs `y_1..y_L` then -1, `[rows, cols]`.
    pub out_tokens: &'a mut Buffer<i32>,
    /// `L = A + 1`, `[rows]`.
    pub out_len: &'a mut Buffer<i32>,
}

/// Verify the proposal chains of a batch against `p` of every live column (the same as
/// [`run_with`] with [`Distributions::Full`]). Validates every shape and parameter (and, on
/// the CPU, every value the contract constrains) before writing; a refused call leaves the
/// outputs untouched.
pub fn run(
    be: &Backend,
    p: &Buffer<f32>,
    proposals: &Buffer<i32>,
    live: &Buffer<i32>,
    proposal: Proposal<'_>,
    seeds: &Buffer<i32>,
    start_pos: &Buffer<i32>,
    out: Outputs<'_>,
    params: &Params,
) -> Result<()> {
    run_with(
        be,
        Distributions::Full(p),
        proposals,
        live,
        proposal,
        seeds,
        start_pos,
        out,
        params,
    )
}

/// Verify the proposal chains of a batch (see the module contract), reading the target
/// distributions in either form. Validates every shape and parameter (and, on the CPU, every
/// value the contract constrains) before writing; a refused call leaves the outputs
/// untouched.
pub fn run_with(
    be: &Backend,
    target: Distributions<'_>,
    proposals: &Buffer<i32>,
    live: &Buffer<i32>,
    proposal: Proposal<'_>,
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
    match target {
        Distributions::Full(p) => check_rows(OP, "p", p.len(), rows, cols * vocab, column)?,
        Distributions::Live { p, greedy } => {
            check_rows(OP, "p", p.len(), rows, cols * vocab, column)?;
            check_rows(OP, "greedy", greedy.len(), rows, cols, per_col)?;
        }
    }
    check_rows(OP, "proposals", proposals.len(), rows, cols - 1, || {
        format!("[cols-1={}]", cols - 1)
    })?;
    check_rows(OP, "live", live.len(), rows, 1, one)?;
    check_rows(OP, "start_pos", start_pos.len(), rows, 1, one)?;
    check_rows(OP, "seeds", seeds.len(), rows, 2, || "[2]".into())?;
    check_rows(OP, "accepted", out.accepted.len(), rows, 1, one)?;
    check_rows(OP, "out_len", out.out_len.len(), rows, 1, one)?;
    check_rows(OP, "out_tokens", out.out_tokens.len(), rows, cols, per_col)?;
    if let Proposal::Top16 { q, ids } = proposal {
        let slots = || format!("[cols-1={}, 16]", cols - 1);
        check_rows(OP, "q", q.len(), rows, (cols - 1) * TOP, slots)?;
        check_rows(OP, "ids", ids.len(), rows, (cols - 1) * TOP, slots)?;
    }
    if rows == 0 {
        return Ok(());
    }
    match be {
        Backend::Cpu => {
            let hp = match proposal {
                Proposal::OneHot => reference::HostProposal::OneHot,
                Proposal::Top16 { q, ids } => reference::HostProposal::Top16 {
                    q: q.host(OP, "q")?,
                    ids: ids.host(OP, "ids")?,
                },
            };
            let (p, greedy) = match target {
                Distributions::Full(p) => (p.host(OP, "p")?, None),
                Distributions::Live { p, greedy } => {
                    (p.host(OP, "p")?, Some(greedy.host(OP, "greedy")?))
                }
            };
            reference::run(
                p,
                greedy,
                proposals.host(OP, "proposals")?,
                live.host(OP, "live")?,
                &hp,
                seeds.host(OP, "seeds")?,
                start_pos.host(OP, "start_pos")?,
                out.accepted.host_mut(OP, "accepted")?,
                out.out_tokens.host_mut(OP, "out_tokens")?,
                out.out_len.host_mut(OP, "out_len")?,
                params,
            )
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(c) => cuda::run(
            c, target, proposals, live, proposal, seeds, start_pos, out, params,
        ),
    }
}

// ---------------------------------------------------------------------------------------------
// Conformance cases.

#[cfg(any(test, feature = "conformance"))]
use crate::target_distribution::Gen;

/// Deterministic inputs of one case.
#[cfg(any(test, feature = "conformance"))]
pub(crate) struct CaseData {
    pub(crate) p: Vec<f32>,
    pub(crate) proposals: Vec<i32>,
    pub(crate) live: Vec<i32>,
    pub(crate) q: Vec<f32>,
    pub(crate) ids: Vec<i32>,
    pub(crate) seeds: Vec<i32>,
    pub(crate) start_pos: Vec<i32>,
}

/// Rows cycle through behaviours: greedy one-hot `p` with matching proposals (all accept),
/// greedy with a mismatch (early reject), soft `p` with proposals at the mode, soft `p` with
/// random proposals, and `P = 0`. Soft columns put most mass on a few strong tokens and the
/// rest on a sparse background; every row's live columns are valid distributions.
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn case_data(
    rows: usize,
    cols: usize,
    vocab: usize,
    top16: bool,
    seed: u64,
) -> CaseData {
    case_data_from(rows, cols, vocab, top16, seed, 0)
}

/// [`case_data`] with row `r` of behaviour `(r + first_kind) % 5` (so that a one-row case can
/// be any of them; row 0 is always fully live unless its behaviour is `P = 0`).
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn case_data_from(
    rows: usize,
    cols: usize,
    vocab: usize,
    top16: bool,
    seed: u64,
    first_kind: usize,
) -> CaseData {
    let mut g = Gen::new(seed);
    let k = cols - 1;
    let mut p = vec![0f32; rows * cols * vocab];
    let mut proposals = vec![0i32; rows * k];
    let mut q = vec![0f32; rows * k * TOP];
    let mut ids = vec![0i32; rows * k * TOP];
    let mut live = vec![0i32; rows];
    let mut seeds = vec![0i32; 2 * rows];
    let mut start_pos = vec![0i32; rows];
    for r in 0..rows {
        let kind = (r + first_kind) % 5;
        live[r] = match kind {
            4 => 1,
            _ if r == 0 => cols as i32,
            _ => 1 + g.below(cols) as i32,
        };
        let s = g.next_u64();
        seeds[2 * r] = s as u32 as i32;
        seeds[2 * r + 1] = (s >> 32) as u32 as i32;
        start_pos[r] = g.below(100_000) as i32;
        let greedy = kind < 2;
        let mut modes = vec![0usize; cols];
        for i in 0..cols {
            let col = &mut p[(r * cols + i) * vocab..(r * cols + i + 1) * vocab];
            let mode = g.below(vocab);
            modes[i] = mode;
            if greedy {
                col[mode] = 1.0;
            } else {
                // Strong tokens and a sparse background, normalized in f64, stored f32.
                let mut w = vec![0f64; vocab];
                w[mode] = 4.0;
                for s in 0..6 {
                    w[g.below(vocab)] += 0.5 + s as f64 * 0.25;
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
        for i in 0..k {
            let d = match kind {
                0 | 2 => modes[i],
                1 if i + 1 == k.max(1) / 2 + 1 => (modes[i] + 1) % vocab,
                1 => modes[i],
                _ => {
                    if g.below(2) == 0 {
                        modes[i]
                    } else {
                        g.below(vocab)
                    }
                }
            };
            proposals[r * k + i] = d as i32;
            if top16 {
                // 16 distinct ids containing d, q a softmax-like spread with q(d) > 0.
                let base = (r * k + i) * TOP;
                let mut chosen: Vec<i32> = vec![d as i32];
                while chosen.len() < TOP {
                    let v = g.below(vocab) as i32;
                    if !chosen.contains(&v) {
                        chosen.push(v);
                    }
                }
                let pos = g.below(TOP);
                chosen.swap(0, pos);
                let mut w: Vec<f64> = (0..TOP).map(|_| 0.05 + f64::from(g.unit())).collect();
                if kind == 0 {
                    w[pos] += 8.0;
                }
                let total: f64 = w.iter().sum();
                for s in 0..TOP {
                    ids[base + s] = chosen[s];
                    q[base + s] = (w[s] / total) as f32;
                }
            }
        }
    }
    CaseData {
        p,
        proposals,
        live,
        q,
        ids,
        seeds,
        start_pos,
    }
}

/// The `Live` form of a case's distributions: a column whose `p` is one-hot (the greedy rows)
/// becomes its id in `greedy` and the poison in `p` (never read); every other live column
/// keeps its `p` row with `greedy = -1`; dead columns hold the poison in both.
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn live_distributions(d: &CaseData, cols: usize, vocab: usize) -> (Vec<f32>, Vec<i32>) {
    let mut p = vec![f32::POISON; d.p.len()];
    let mut greedy = vec![i32::POISON; d.live.len() * cols];
    for (r, &q) in d.live.iter().enumerate() {
        for i in 0..q as usize {
            let rc = r * cols + i;
            let col = &d.p[rc * vocab..(rc + 1) * vocab];
            let mut nonzero = col.iter().enumerate().filter(|(_, x)| **x != 0.0);
            match (nonzero.next(), nonzero.next()) {
                (Some((id, 1.0)), None) => greedy[rc] = id as i32,
                _ => {
                    greedy[rc] = -1;
                    p[rc * vocab..(rc + 1) * vocab].copy_from_slice(col);
                }
            }
        }
    }
    (p, greedy)
}

/// A case of the full form (`run`, every column's `p` row stored).
#[cfg(any(test, feature = "conformance"))]
fn case(
    rows: usize,
    cols: usize,
    vocab: usize,
    top16: bool,
    seed: u64,
) -> impl Fn(&Backend) -> Result<CaseRun> + Send + Sync {
    case_in(rows, cols, vocab, top16, seed, None)
}

/// A case of the `Live` form ([`Distributions::Live`]): greedy rows carry only their ids and
/// a poisoned `p` (the kernel must never read it), rows start at kind `first_kind` of
/// [`case_data`]'s cycle.
#[cfg(any(test, feature = "conformance"))]
fn live_case(
    rows: usize,
    cols: usize,
    vocab: usize,
    top16: bool,
    seed: u64,
    first_kind: usize,
) -> impl Fn(&Backend) -> Result<CaseRun> + Send + Sync {
    case_in(rows, cols, vocab, top16, seed, Some(first_kind))
}

/// A case in the full form (`live = None`) or the `Live` form starting at kind `first_kind`.
#[cfg(any(test, feature = "conformance"))]
fn case_in(
    rows: usize,
    cols: usize,
    vocab: usize,
    top16: bool,
    seed: u64,
    live_from: Option<usize>,
) -> impl Fn(&Backend) -> Result<CaseRun> + Send + Sync {
    move |be: &Backend| {
        let d = match live_from {
            None => case_data(rows, cols, vocab, top16, seed),
            Some(first) => case_data_from(rows, cols, vocab, top16, seed, first),
        };
        let mut inputs = InputCheck::default();
        let (p, greedy) = match live_from {
            None => (inputs.upload(be, "p", &d.p)?, None),
            Some(_) => {
                let (p_live, greedy_ids) = live_distributions(&d, cols, vocab);
                (
                    inputs.upload(be, "p", &p_live)?,
                    Some(inputs.upload(be, "greedy", &greedy_ids)?),
                )
            }
        };
        let proposals = inputs.upload(be, "proposals", &d.proposals)?;
        let live = inputs.upload(be, "live", &d.live)?;
        let q = inputs.upload(be, "q", &d.q)?;
        let ids = inputs.upload(be, "ids", &d.ids)?;
        let seeds = inputs.upload(be, "seeds", &d.seeds)?;
        let start_pos = inputs.upload(be, "start_pos", &d.start_pos)?;
        let mut accepted = be.filled(rows, i32::POISON)?;
        let mut out_tokens = be.filled(rows * cols, i32::POISON)?;
        let mut out_len = be.filled(rows, i32::POISON)?;
        let proposal = if top16 {
            Proposal::Top16 { q: &q, ids: &ids }
        } else {
            Proposal::OneHot
        };
        let outs = Outputs {
            accepted: &mut accepted,
            out_tokens: &mut out_tokens,
            out_len: &mut out_len,
        };
        let params = Params { rows, cols, vocab };
        match &greedy {
            None => run(
                be, &p, &proposals, &live, proposal, &seeds, &start_pos, outs, &params,
            )?,
            Some(g) => run_with(
                be,
                Distributions::Live { p: &p, greedy: g },
                &proposals,
                &live,
                proposal,
                &seeds,
                &start_pos,
                outs,
                &params,
            )?,
        }
        let mut modified = Vec::new();
        inputs.verify(be, "p", &p, &mut modified)?;
        if let Some(g) = &greedy {
            inputs.verify(be, "greedy", g, &mut modified)?;
        }
        inputs.verify(be, "proposals", &proposals, &mut modified)?;
        inputs.verify(be, "live", &live, &mut modified)?;
        inputs.verify(be, "q", &q, &mut modified)?;
        inputs.verify(be, "ids", &ids, &mut modified)?;
        inputs.verify(be, "seeds", &seeds, &mut modified)?;
        inputs.verify(be, "start_pos", &start_pos, &mut modified)?;
        let mut outputs = vec![
            output(
                "accepted",
                Criterion::Exact,
                &vec![i32::POISON; rows],
                &be.download(&accepted)?,
                |_| true,
            ),
            output(
                "out_tokens",
                Criterion::Exact,
                &vec![i32::POISON; rows * cols],
                &be.download(&out_tokens)?,
                |_| true,
            ),
            output(
                "out_len",
                Criterion::Exact,
                &vec![i32::POISON; rows],
                &be.download(&out_len)?,
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
        Case::new(
            OP,
            "rows8_cols16_v4096_onehot",
            case(8, 16, 4096, false, 21),
        ),
        Case::new(OP, "rows8_cols16_v4096_top16", case(8, 16, 4096, true, 22)),
        Case::new(
            OP,
            "rows1_cols2_official_vocab_onehot",
            case(1, 2, V, false, 23),
        ),
        Case::new(
            OP,
            "rows1_cols2_official_vocab_top16",
            case(1, 2, V, true, 24),
        ),
        Case::new(
            OP,
            "rows8_cols16_official_vocab_top16",
            case(8, 16, V, true, 25),
        )
        .heavy(),
        Case::new(
            OP,
            "rows8_cols16_official_vocab_onehot",
            case(8, 16, V, false, 26),
        )
        .heavy(),
        // The `Live` form: greedy columns as ids over a poisoned p, sampled columns as p rows.
        Case::new(
            OP,
            "rows8_cols16_v4096_live_onehot",
            live_case(8, 16, 4096, false, 27, 0),
        ),
        Case::new(
            OP,
            "rows8_cols16_v4096_live_top16",
            live_case(8, 16, 4096, true, 28, 0),
        ),
        Case::new(
            OP,
            "rows1_cols16_official_vocab_live_greedy_correction_top16",
            live_case(1, 16, V, true, 29, 1),
        ),
        Case::new(
            OP,
            "rows1_cols16_official_vocab_live_sampled_onehot",
            live_case(1, 16, V, false, 30, 3),
        ),
        Case::new(
            OP,
            "rows8_cols16_official_vocab_live_onehot",
            live_case(8, 16, V, false, 31, 0),
        )
        .heavy(),
        Case::new(
            OP,
            "rows8_cols16_official_vocab_live_top16",
            live_case(8, 16, V, true, 32, 0),
        )
        .heavy(),
    ]
}
