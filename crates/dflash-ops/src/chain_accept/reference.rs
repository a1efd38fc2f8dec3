//! CPU reference of `chain_accept`: the acceptance scan and the blocked inverse-CDF draw, in
//! exactly the f64 operation order the module contract fixes (the CUDA kernel performs the
//! same operations in the same order, so decisions are bit-identical).

#![allow(clippy::needless_range_loop)] // reason: index loops mirror the contract's formulas

use crate::rng::{Purpose, uniform};
use crate::{OpsError, Result};

use super::{OP, Params, TILE, TOP};

/// Host view of the proposal distribution.
pub(super) enum HostProposal<'a> {
    /// Point mass at the proposal.
    OneHot,
    /// Retained top-16 conditional q and global ids, `[rows, cols-1, 16]`.
    Top16 { q: &'a [f32], ids: &'a [i32] },
}

/// The proposal mass `q(v)` of one column: a point mass at `x`, or the q of the first of the 16
/// slots holding `v` (0 when none does).
#[derive(Clone, Copy)]
pub(crate) enum ColumnQ<'a> {
    /// No proposal mass (the bonus draw samples `p` itself).
    None,
    /// Point mass at the rejected proposal.
    OneHot(usize),
    /// Top-16 slots of the column.
    Top16 { q: &'a [f32], ids: &'a [i32] },
}

impl ColumnQ<'_> {
    pub(crate) fn at(&self, v: usize) -> f64 {
        match *self {
            ColumnQ::None => 0.0,
            ColumnQ::OneHot(x) => {
                if v == x {
                    1.0
                } else {
                    0.0
                }
            }
            ColumnQ::Top16 { q, ids } => ids
                .iter()
                .position(|&id| usize::try_from(id).ok() == Some(v))
                .map_or(0.0, |s| f64::from(q[s])),
        }
    }
}

/// The target distribution `p_i` of one column: a stored row, or the one-hot of a greedy
/// column's argmax (1 at `id`, +0 elsewhere: exactly the row `target_distribution` stores).
#[derive(Clone, Copy)]
pub(crate) enum PColumn<'a> {
    /// A stored `p` row (`vocab` elements).
    Row(&'a [f32]),
    /// A greedy column: `p(v) = 1` at `v == id`, else 0 (`id` may lie outside the vocabulary:
    /// then `p = 0` everywhere).
    OneHot {
        /// The argmax.
        id: usize,
        /// Vocabulary rows.
        vocab: usize,
    },
}

impl PColumn<'_> {
    pub(crate) fn len(&self) -> usize {
        match *self {
            PColumn::Row(p) => p.len(),
            PColumn::OneHot { vocab, .. } => vocab,
        }
    }

    pub(crate) fn at(&self, v: usize) -> f32 {
        match *self {
            PColumn::Row(p) => p[v],
            PColumn::OneHot { id, .. } => {
                if v == id {
                    1.0
                } else {
                    0.0
                }
            }
        }
    }
}

/// The draw weight `w(v)`: `p(v)` for the bonus, `max(p(v) - q(v), 0)` for a correction.
fn weight(p: &PColumn<'_>, q: &ColumnQ<'_>, v: usize) -> f64 {
    match q {
        ColumnQ::None => f64::from(p.at(v)),
        _ => (f64::from(p.at(v)) - q.at(v)).max(0.0),
    }
}

/// The blocked inverse-CDF draw of the contract: `None` when the weights have no positive
/// total (or the draw falls past it).
pub(crate) fn blocked_draw(p: &PColumn<'_>, q: &ColumnQ<'_>, u: f32) -> Option<usize> {
    blocked_draw_by(p.len(), |v| weight(p, q, v), u)
}

/// The tile sums of item 3 over weights `w(v)` of ids `v < vocab` (ids past it weigh 0):
/// per tile 32 lane sums over k (sequential), then the shuffle-down tree over lanes.
pub(crate) fn tile_sums(vocab: usize, w: impl Fn(usize) -> f64) -> Vec<f64> {
    let w = |v: usize| if v < vocab { w(v) } else { 0.0 };
    let mut sums = vec![0f64; vocab.div_ceil(TILE)];
    for (j, s) in sums.iter_mut().enumerate() {
        let mut lanes = [0f64; 32];
        for (l, lane) in lanes.iter_mut().enumerate() {
            let mut a = 0.0f64;
            for k in 0..32 {
                a += w(j * TILE + k * 32 + l);
            }
            *lane = a;
        }
        for off in [16usize, 8, 4, 2, 1] {
            for l in 0..off {
                lanes[l] += lanes[l + off];
            }
        }
        *s = lanes[0];
    }
    sums
}

/// The blocked total of item 3: the tile sums added in tile order from 0.
pub(crate) fn blocked_total(vocab: usize, w: impl Fn(usize) -> f64) -> f64 {
    tile_sums(vocab, w).iter().fold(0.0, |t, &s| t + s)
}

/// The blocked inverse-CDF draw of item 3 over weights `w(v)` of ids `v < vocab`.
pub(crate) fn blocked_draw_by(vocab: usize, w: impl Fn(usize) -> f64, u: f32) -> Option<usize> {
    let sums = tile_sums(vocab, &w);
    let mut total = 0.0f64;
    for &s in &sums {
        total += s;
    }
    if total.is_nan() || total <= 0.0 {
        return None;
    }
    let target = f64::from(u) * total;
    let mut c = 0.0f64;
    for (j, &s) in sums.iter().enumerate() {
        let next = c + s;
        if next > target {
            let mut run = c;
            let mut last = None;
            for v in j * TILE..((j + 1) * TILE).min(vocab) {
                let x = w(v);
                run += x;
                if x > 0.0 {
                    last = Some(v);
                }
                if run > target {
                    return Some(v);
                }
            }
            return last;
        }
        c = next;
    }
    None
}

/// The correction or bonus token: the draw over `w`, else over `p` itself, else token 0.
pub(crate) fn draw(p: &PColumn<'_>, q: &ColumnQ<'_>, u: f32) -> usize {
    blocked_draw(p, q, u)
        .or_else(|| blocked_draw(p, &ColumnQ::None, u))
        .unwrap_or(0)
}

/// The caller guarantees on live column `i` of row `r` of the target distributions (shared
/// by `chain_accept` and `tree_accept`, `op` naming the refusing op and `unit` the column's
/// name in messages): a `greedy` entry is `-1` or an id below `vocab` (a greedy column's `p`
/// row is never read); a sampled column's `p` row is finite, `>= 0` and has positive mass.
#[allow(clippy::too_many_arguments)] // reason: the column's address and the message's words
pub(crate) fn check_target_column(
    op: &'static str,
    p: &[f32],
    greedy: Option<&[i32]>,
    r: usize,
    i: usize,
    cols: usize,
    vocab: usize,
    unit: &str,
) -> Result<()> {
    let bad = |tensor, index, expected, found: String| OpsError::Value {
        op,
        tensor,
        index,
        expected,
        found,
    };
    if let Some(g) = greedy {
        let gi = g[r * cols + i];
        if gi >= 0 && (gi as usize) < vocab {
            return Ok(()); // a greedy column: its p row is never read
        }
        if gi != -1 {
            return Err(bad(
                "greedy",
                r * cols + i,
                format!("-1 (sampled) or an argmax id in 0..{vocab} (row {r}, {unit} {i})"),
                gi.to_string(),
            ));
        }
    }
    let base = (r * cols + i) * vocab;
    let col = &p[base..base + vocab];
    if let Some(v) = col.iter().position(|x| !(x.is_finite() && *x >= 0.0)) {
        return Err(bad(
            "p",
            base + v,
            format!("a finite probability >= 0 (row {r}, {unit} {i}, token {v})"),
            col[v].to_string(),
        ));
    }
    if !col.iter().any(|&x| x > 0.0) {
        return Err(bad(
            "p",
            base,
            format!("a distribution with positive mass (row {r}, {unit} {i})"),
            "all zero".to_string(),
        ));
    }
    Ok(())
}

/// The caller guarantees on one set of 16 slots (ids `is`, probabilities `qs`, at flat index
/// `base` of their tensors; shared by `chain_accept` and `tree_accept`, `op` naming the
/// refusing op, `at` the slots in messages): ids below `vocab` and distinct, q finite and
/// `>= 0`.
pub(crate) fn check_slots(
    op: &'static str,
    qs: &[f32],
    is: &[i32],
    base: usize,
    vocab: usize,
    at: &str,
) -> Result<()> {
    let bad = |tensor, s: usize, expected, found: String| OpsError::Value {
        op,
        tensor,
        index: base + s,
        expected,
        found,
    };
    for s in 0..TOP {
        if !(is[s] >= 0 && (is[s] as usize) < vocab) {
            let expected = format!("a token id in 0..{vocab} ({at})");
            return Err(bad("ids", s, expected, is[s].to_string()));
        }
        if is[..s].contains(&is[s]) {
            let expected = format!("16 distinct ids ({at})");
            return Err(bad("ids", s, expected, is[s].to_string()));
        }
        if !(qs[s].is_finite() && qs[s] >= 0.0) {
            let expected = format!("a finite probability >= 0 ({at})");
            return Err(bad("q", s, expected, qs[s].to_string()));
        }
    }
    Ok(())
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

pub(super) fn run(
    p: &[f32],
    greedy: Option<&[i32]>,
    proposals: &[i32],
    live: &[i32],
    proposal: &HostProposal<'_>,
    seeds: &[i32],
    start_pos: &[i32],
    accepted: &mut [i32],
    out_tokens: &mut [i32],
    out_len: &mut [i32],
    params: &Params,
) -> Result<()> {
    let Params { rows, cols, vocab } = *params;
    let k = cols - 1;
    // Validate everything before writing anything.
    for r in 0..rows {
        let q = live[r];
        if !(q >= 1 && q as usize <= cols) {
            return Err(bad(
                "live",
                r,
                format!("a live column count in 1..={cols}"),
                q,
            ));
        }
        if start_pos[r] < 0 {
            return Err(bad("start_pos", r, "a position >= 0".into(), start_pos[r]));
        }
        let np = q as usize - 1;
        for j in 0..np {
            let d = proposals[r * k + j];
            if !(d >= 0 && (d as usize) < vocab) {
                return Err(bad(
                    "proposals",
                    r * k + j,
                    format!("a token id in 0..{vocab}"),
                    d,
                ));
            }
        }
        for i in 0..=np {
            check_target_column(OP, p, greedy, r, i, cols, vocab, "column")?;
        }
        if let HostProposal::Top16 { q, ids } = proposal {
            for i in 0..np {
                let base = (r * k + i) * TOP;
                let (qs, is) = (&q[base..base + TOP], &ids[base..base + TOP]);
                check_slots(OP, qs, is, base, vocab, &format!("row {r}, slot {i}"))?;
                let d = proposals[r * k + i];
                if !is.iter().zip(qs).any(|(&id, &qq)| id == d && qq > 0.0) {
                    return Err(bad(
                        "proposals",
                        r * k + i,
                        format!("one of the 16 ids with q > 0 (row {r}, slot {i})"),
                        d,
                    ));
                }
            }
        }
    }
    for r in 0..rows {
        let np = live[r] as usize - 1;
        let seed = u64::from(seeds[2 * r] as u32) | u64::from(seeds[2 * r + 1] as u32) << 32;
        let f = start_pos[r] as u64;
        let col = |i: usize| match greedy.map(|g| g[r * cols + i]) {
            Some(g) if g >= 0 => PColumn::OneHot {
                id: g as usize,
                vocab,
            },
            _ => PColumn::Row(&p[(r * cols + i) * vocab..(r * cols + i + 1) * vocab]),
        };
        let slot_q = |i: usize| match proposal {
            HostProposal::OneHot => ColumnQ::OneHot(proposals[r * k + i] as usize),
            HostProposal::Top16 { q, ids } => {
                let base = (r * k + i) * TOP;
                ColumnQ::Top16 {
                    q: &q[base..base + TOP],
                    ids: &ids[base..base + TOP],
                }
            }
        };
        let mut a = 0usize;
        let mut rejected = false;
        while a < np {
            let x = proposals[r * k + a] as usize;
            let px = f64::from(col(a).at(x));
            let qx = slot_q(a).at(x);
            let u = uniform(seed, f + 1 + a as u64, Purpose::Accept, 0);
            if f64::from(u) * qx < px {
                a += 1;
            } else {
                rejected = true;
                break;
            }
        }
        let token = if rejected {
            let u = uniform(seed, f + 1 + a as u64, Purpose::Correction, 0);
            draw(&col(a), &slot_q(a), u)
        } else {
            let u = uniform(seed, f + 1 + a as u64, Purpose::Bonus, 0);
            draw(&col(a), &ColumnQ::None, u)
        };
        accepted[r] = a as i32;
        out_len[r] = a as i32 + 1;
        for j in 0..cols {
            out_tokens[r * cols + j] = match j.cmp(&a) {
                std::cmp::Ordering::Less => proposals[r * k + j],
                std::cmp::Ordering::Equal => token as i32,
                std::cmp::Ordering::Greater => -1,
            };
        }
    }
    Ok(())
}
