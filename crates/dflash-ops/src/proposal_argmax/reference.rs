//! CPU reference of `proposal_argmax`: a plain scan per column keeping the best
//! (value, global id) pair under the contract's total order.

/// True when candidate `(v, id)` beats `(bv, bid)`: larger value, or equal value and lower id.
#[inline]
pub(crate) fn beats(v: f32, id: i32, bv: f32, bid: i32) -> bool {
    v > bv || (v == bv && id < bid)
}

/// `logits` is `[n, rows]` (validated: no NaN among the first `considered` entries of a row);
/// `map` is the indexed head's `token_ids` (then `considered == rows`) or `None` for the
/// full head (candidates `0..considered`, id = row).
pub(super) fn run(
    logits: &[f32],
    map: Option<&[i32]>,
    ids: &mut [i32],
    rows: usize,
    considered: usize,
) {
    for (out, row) in ids.iter_mut().zip(logits.chunks_exact(rows)) {
        let global = |k: usize| map.map_or(k as i32, |m| m[k]);
        let (mut bv, mut bid) = (row[0], global(0));
        for (k, &v) in row.iter().enumerate().take(considered).skip(1) {
            let id = global(k);
            if beats(v, id, bv, bid) {
                (bv, bid) = (v, id);
            }
        }
        *out = bid;
    }
}
