//! CPU reference of `tree_accept`: the walk, the residual updates and the draws in exactly the
//! f64 operation order the module contract fixes (the CUDA kernel performs the same operations
//! in the same order, so decisions are bit-identical). The blocked draw is `chain_accept`'s.

#![allow(clippy::needless_range_loop)] // reason: index loops mirror the contract's formulas

use crate::chain_accept::reference::{
    PColumn, blocked_draw_by, blocked_total, check_slots, check_target_column,
};
use crate::rng::{Purpose, uniform};
use crate::{OpsError, Result};

use super::{OP, Params};
use crate::chain_accept::TOP;

/// Host views of the trees (shapes in the module contract).
pub(super) struct HostTrees<'a> {
    pub nodes: &'a [i32],
    pub tokens: &'a [i32],
    pub parents: &'a [i32],
    pub q: &'a [f32],
    pub ids: &'a [i32],
}

/// Host views of the outputs.
pub(super) struct HostOutputs<'a> {
    pub accepted: &'a mut [i32],
    pub out_tokens: &'a mut [i32],
    pub out_len: &'a mut [i32],
    pub path: &'a mut [i32],
}

fn bad(tensor: &'static str, index: usize, expected: String, found: impl ToString) -> OpsError {
    OpsError::Value {
        op: OP,
        tensor,
        index,
        expected,
        found: found.to_string(),
    }
}

/// The walk's result for one row: the visited nodes (from 0) and the correction or bonus.
struct Walk {
    /// `0, v_1, .., v_A`.
    path: Vec<usize>,
    /// The correction (all children of the last node rejected) or bonus (a leaf).
    token: usize,
}

/// One row's tree, validated: `parent[i]` for `i >= 1`, `token[i]` for `i >= 1`, the slots of
/// node `n` at `slots(n)`.
struct RowTree<'a> {
    /// Live nodes.
    pub n: usize,
    /// Parent of node `i` at `i - 1`.
    pub parents: &'a [i32],
    /// Token of node `i` at `i - 1`.
    pub tokens: &'a [i32],
    /// q of node `n`'s children at `n * 16 ..`.
    pub q: &'a [f32],
    /// Slot ids of node `n`'s children at `n * 16 ..`.
    pub ids: &'a [i32],
}

/// The walk of item 1 over one row, `p(n)` giving node `n`'s target distribution.
fn walk<'p>(
    t: &RowTree<'_>,
    p: impl Fn(usize) -> PColumn<'p>,
    vocab: usize,
    seed: u64,
    start: u64,
) -> Walk {
    let mut path = vec![0usize];
    let mut depth = 0u64;
    let mut n = 0usize;
    loop {
        let pn = p(n);
        let kids: Vec<usize> = (n + 1..t.n)
            .filter(|&i| t.parents[i - 1] as usize == n)
            .collect();
        let pos = start + 1 + depth;
        if kids.is_empty() {
            let u = uniform(seed, pos, Purpose::Bonus, 0);
            let token = blocked_draw_by(vocab, |v| f64::from(pn.at(v)), u).unwrap_or(0);
            return Walk { path, token };
        }
        let ids = &t.ids[n * TOP..(n + 1) * TOP];
        let q = &t.q[n * TOP..(n + 1) * TOP];
        let slot_of = |v: usize| ids.iter().position(|&id| id as usize == v);
        let mut w = [0f64; TOP];
        for j in 0..TOP {
            w[j] = f64::from(pn.at(ids[j] as usize));
        }
        let (mut z, mut d) = (1.0f64, 1.0f64);
        let mut tried = [false; TOP];
        // M: the blocked sum of p over the ids outside the slots (computed when first needed).
        let mut m_out: Option<f64> = None;
        let mut next = None;
        for (k, &c) in kids.iter().enumerate() {
            let x = t.tokens[c - 1] as usize;
            let u = f64::from(uniform(seed, pos, Purpose::Accept, k as u32));
            // A token outside the slots, or a repeated slot (refused by validation; the CUDA
            // kernel's rule for unchecked input): rejected without changing the residual.
            let Some(j) = slot_of(x).filter(|&j| !tried[j]) else {
                continue;
            };
            let qx = f64::from(q[j]);
            let accept = if qx > 0.0 {
                u * qx * z < w[j] * d
            } else {
                u * z < w[j]
            };
            if accept {
                next = Some(c);
                break;
            }
            if qx > 0.0 {
                for s in 0..TOP {
                    if !tried[s] {
                        w[s] = (w[s] - z * f64::from(q[s]) / d).max(0.0);
                    }
                }
            } else {
                w[j] = (w[j] - z).max(0.0);
            }
            tried[j] = true;
            d = 0.0;
            for s in 0..TOP {
                if !tried[s] {
                    d += f64::from(q[s]);
                }
            }
            if k + 1 == kids.len() {
                break; // no further test needs Z
            }
            let m = *m_out.get_or_insert_with(|| {
                blocked_total(vocab, |v| {
                    if slot_of(v).is_some() {
                        0.0
                    } else {
                        f64::from(pn.at(v))
                    }
                })
            });
            z = m;
            for s in 0..TOP {
                z += w[s];
            }
        }
        match next {
            Some(c) => {
                path.push(c);
                n = c;
                depth += 1;
            }
            None => {
                let u = uniform(seed, pos, Purpose::Correction, 0);
                let weight = |v: usize| match slot_of(v) {
                    Some(s) => w[s],
                    None => f64::from(pn.at(v)),
                };
                let token = blocked_draw_by(vocab, weight, u)
                    .or_else(|| blocked_draw_by(vocab, |v| f64::from(pn.at(v)), u))
                    .unwrap_or(0);
                return Walk { path, token };
            }
        }
    }
}

/// Validate one row's caller guarantees (contract), reporting flat indices.
fn validate_row(
    r: usize,
    p: &[f32],
    greedy: Option<&[i32]>,
    t: &HostTrees<'_>,
    start_pos: &[i32],
    params: &Params,
) -> Result<()> {
    let Params { cols, vocab, .. } = *params;
    let k = cols - 1;
    let n = t.nodes[r];
    if !(n >= 1 && n as usize <= cols) {
        return Err(bad("nodes", r, format!("a node count in 1..={cols}"), n));
    }
    let n = n as usize;
    if start_pos[r] < 0 {
        return Err(bad("start_pos", r, "a position >= 0".into(), start_pos[r]));
    }
    let mut has_kids = vec![false; n];
    for i in 1..n {
        let at = r * k + i - 1;
        let par = t.parents[at];
        if !(par >= 0 && (par as usize) < i) {
            return Err(bad(
                "parents",
                at,
                format!("an earlier node in 0..{i} (row {r}, node {i})"),
                par,
            ));
        }
        has_kids[par as usize] = true;
        let x = t.tokens[at];
        if !(x >= 0 && (x as usize) < vocab) {
            return Err(bad(
                "tokens",
                at,
                format!("a token id in 0..{vocab} (row {r}, node {i})"),
                x,
            ));
        }
    }
    for par in (0..n).filter(|&par| has_kids[par]) {
        let base = (r * k + par) * TOP;
        let (qs, is) = (&t.q[base..base + TOP], &t.ids[base..base + TOP]);
        check_slots(OP, qs, is, base, vocab, &format!("row {r}, node {par}"))?;
        let mut seen: Vec<i32> = Vec::new();
        for i in (par + 1..n).filter(|&i| t.parents[r * k + i - 1] as usize == par) {
            let x = t.tokens[r * k + i - 1];
            if !is.contains(&x) {
                return Err(bad(
                    "tokens",
                    r * k + i - 1,
                    format!("one of node {par}'s 16 slot ids (row {r}, node {i})"),
                    x,
                ));
            }
            if seen.contains(&x) {
                return Err(bad(
                    "tokens",
                    r * k + i - 1,
                    format!("a token no earlier sibling has (row {r}, node {i}, parent {par})"),
                    x,
                ));
            }
            seen.push(x);
        }
    }
    for i in 0..n {
        check_target_column(OP, p, greedy, r, i, cols, vocab, "node")?;
    }
    Ok(())
}

pub(super) fn run(
    p: &[f32],
    greedy: Option<&[i32]>,
    t: &HostTrees<'_>,
    seeds: &[i32],
    start_pos: &[i32],
    out: HostOutputs<'_>,
    params: &Params,
) -> Result<()> {
    let Params { rows, cols, vocab } = *params;
    let k = cols - 1;
    // Validate everything before writing anything.
    for r in 0..rows {
        validate_row(r, p, greedy, t, start_pos, params)?;
    }
    for r in 0..rows {
        let row = RowTree {
            n: t.nodes[r] as usize,
            parents: &t.parents[r * k..(r + 1) * k],
            tokens: &t.tokens[r * k..(r + 1) * k],
            q: &t.q[r * k * TOP..(r + 1) * k * TOP],
            ids: &t.ids[r * k * TOP..(r + 1) * k * TOP],
        };
        let col = |i: usize| match greedy.map(|g| g[r * cols + i]) {
            Some(g) if g >= 0 => PColumn::OneHot {
                id: g as usize,
                vocab,
            },
            _ => PColumn::Row(&p[(r * cols + i) * vocab..(r * cols + i + 1) * vocab]),
        };
        let seed = u64::from(seeds[2 * r] as u32) | u64::from(seeds[2 * r + 1] as u32) << 32;
        let walk = walk(&row, col, vocab, seed, start_pos[r] as u64);
        let a = walk.path.len() - 1;
        out.accepted[r] = a as i32;
        out.out_len[r] = a as i32 + 1;
        for j in 0..cols {
            out.out_tokens[r * cols + j] = match j.cmp(&a) {
                std::cmp::Ordering::Less => row.tokens[walk.path[j + 1] - 1],
                std::cmp::Ordering::Equal => walk.token as i32,
                std::cmp::Ordering::Greater => -1,
            };
            out.path[r * cols + j] = walk.path.get(j).map_or(-1, |&v| v as i32);
        }
    }
    Ok(())
}
