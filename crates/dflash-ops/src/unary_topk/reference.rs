//! CPU reference of `unary_topk`: gather each column's candidates as (score, global id),
//! partially select the 16 best under the contract's total order, then sort those 16.

use std::cmp::Ordering;

use crate::proposal_argmax::reference_beats as beats;

use super::TOP_K;

/// The contract's order: `Less` means "ranks earlier" (higher score, then lower id).
fn rank_order(a: &(f32, i32), b: &(f32, i32)) -> Ordering {
    if beats(a.0, a.1, b.0, b.1) {
        Ordering::Less
    } else if beats(b.0, b.1, a.0, a.1) {
        Ordering::Greater
    } else {
        Ordering::Equal
    }
}

/// `logits` is `[n, rows]` (validated: no NaN among the first `considered` entries of a row,
/// `considered >= 16`); `map` is the indexed head's `token_ids` (then `considered == rows`) or
/// `None` for the full head (candidates `0..considered`, id = row).
pub(super) fn run(
    logits: &[f32],
    map: Option<&[i32]>,
    scores: &mut [f32],
    ids: &mut [i32],
    rows: usize,
    considered: usize,
) {
    let mut cand: Vec<(f32, i32)> = Vec::with_capacity(considered);
    for ((row, s), d) in logits
        .chunks_exact(rows)
        .zip(scores.chunks_exact_mut(TOP_K))
        .zip(ids.chunks_exact_mut(TOP_K))
    {
        cand.clear();
        cand.extend((0..considered).map(|k| (row[k], map.map_or(k as i32, |m| m[k]))));
        cand.select_nth_unstable_by(TOP_K - 1, rank_order);
        let top = &mut cand[..TOP_K];
        top.sort_unstable_by(rank_order);
        for (j, &(v, id)) in top.iter().enumerate() {
            s[j] = v;
            d[j] = id;
        }
    }
}
