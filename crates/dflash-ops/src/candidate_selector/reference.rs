//! CPU reference of `candidate_selector`: the conditional left-to-right walk, one row at a
//! time, written as the contract reads.

use half::bf16;

use crate::rng::{Purpose, uniform};
use crate::{OpsError, Result};

use super::{OP, TOP_K};

/// Edge scores of one step: `E[c] = f32(f32(sum_r f32(g[r] * pred[r]) * succ_c[r]) + u[c])`,
/// the sum accumulated in F32 in increasing `r` starting from 0.
///
/// `g` and `pred` are `[rank]`; `succ` is the whole successor codebook `[vocab, rank]`;
/// `cand` holds 16 validated ids below `vocab`.
pub(crate) fn edge_scores(
    g: &[bf16],
    pred: &[bf16],
    succ: &[bf16],
    cand: &[i32],
    unary: &[f32],
    rank: usize,
) -> [f32; TOP_K] {
    let a: Vec<f32> = g
        .iter()
        .zip(pred)
        .map(|(x, y)| x.to_f32() * y.to_f32())
        .collect();
    let mut e = [0f32; TOP_K];
    for c in 0..TOP_K {
        let s = &succ[cand[c] as usize * rank..][..rank];
        let mut acc = 0f32;
        for r in 0..rank {
            acc += a[r] * s[r].to_f32();
        }
        e[c] = acc + unary[c];
    }
    e
}

/// The lowest rank attaining `max_c E[c]` (exact F32 comparisons, `>` in rank order).
pub(crate) fn greedy_rank(e: &[f32; TOP_K]) -> usize {
    let mut j = 0;
    for c in 1..TOP_K {
        if e[c] > e[j] {
            j = c;
        }
    }
    j
}

/// The distribution a step draws from: `temperature > 0`: `q = softmax((E - max E) / T)` in
/// F32 (`expf(f32(f32(E[c] - m) / T))` each, summed in rank order from 0, each divided by the
/// sum); otherwise (also NaN) the one-hot at [`greedy_rank`] (exact 1.0 / 0.0).
pub(crate) fn step_q(e: &[f32; TOP_K], temperature: f32) -> [f32; TOP_K] {
    let mut q = [0f32; TOP_K];
    if temperature > 0.0 {
        let mut m = e[0];
        for &x in &e[1..] {
            if x > m {
                m = x;
            }
        }
        let mut s = 0f32;
        for c in 0..TOP_K {
            q[c] = ((e[c] - m) / temperature).exp();
            s += q[c];
        }
        for x in &mut q {
            *x /= s;
        }
    } else {
        q[greedy_rank(e)] = 1.0;
    }
    q
}

/// The decision of one step from its edge scores: the chosen rank and the q actually used.
///
/// `temperature <= 0`: lowest rank attaining the max, q one-hot. `temperature > 0`:
/// q = [`step_q`], then the first rank whose inclusive F32 prefix sum of q exceeds `u`, else
/// the last rank with `q > 0` (the F32 sum of q can fall short of 1 by a few ulps; the draw
/// never lands on a rank of zero mass).
pub(crate) fn choose(
    e: &[f32; TOP_K],
    temperature: f32,
    u: impl FnOnce() -> f32,
) -> (usize, [f32; TOP_K]) {
    let q = step_q(e, temperature);
    if temperature > 0.0 {
        let u = u();
        let mut cum = 0f32;
        // The fallback: the last rank with mass (the max has q = 1 / s > 0, so there is one).
        let mut j = q.iter().rposition(|&x| x > 0.0).unwrap_or(TOP_K - 1);
        for (c, &x) in q.iter().enumerate() {
            cum += x;
            if u < cum {
                j = c;
                break;
            }
        }
        (j, q)
    } else {
        (greedy_rank(e), q)
    }
}

/// The uniform of step `i` of a row: `(seed, F + i, Dflash2Proposal, 0)`.
pub(crate) fn step_uniform(seed: u64, start: u64, i: usize) -> f32 {
    uniform(seed, start + i as u64, Purpose::Dflash2Proposal, 0)
}

/// One row's validated inputs.
pub(crate) struct Row<'a> {
    /// Projected hidden `[k, rank]`.
    pub g: &'a [bf16],
    /// Candidate ids `[k, 16]` (validated below vocab).
    pub cand: &'a [i32],
    /// Unary scores `[k, 16]`.
    pub unary: &'a [f32],
    /// The anchor (validated below vocab).
    pub anchor: i32,
    /// The request seed.
    pub seed: u64,
    /// The frontier F.
    pub start: u64,
    /// The sampling temperature.
    pub temperature: f32,
}

/// The walk of one row: `proposals [k]`, `q [k, 16]`, `chosen [k]` appended to the outputs.
/// Refuses a non-finite edge score (reporting its flat `[rows, k, 16]` index).
pub(crate) fn walk_row(
    row_index: usize,
    row: &Row<'_>,
    w_pred: &[bf16],
    w_succ: &[bf16],
    k: usize,
    rank: usize,
    out: &mut (Vec<i32>, Vec<f32>, Vec<i32>),
) -> Result<()> {
    let mut pred = row.anchor;
    for i in 0..k {
        let cand = &row.cand[i * TOP_K..][..TOP_K];
        let e = edge_scores(
            &row.g[i * rank..][..rank],
            &w_pred[pred as usize * rank..][..rank],
            w_succ,
            cand,
            &row.unary[i * TOP_K..][..TOP_K],
            rank,
        );
        if let Some(c) = e.iter().position(|x| !x.is_finite()) {
            return Err(OpsError::Value {
                op: OP,
                tensor: "edge_scores",
                index: (row_index * k + i) * TOP_K + c,
                expected: "a finite edge score (finite g, codebook rows and unary)".into(),
                found: e[c].to_string(),
            });
        }
        let (j, q) = choose(&e, row.temperature, || step_uniform(row.seed, row.start, i));
        pred = cand[j];
        out.0.push(pred);
        out.1.extend_from_slice(&q);
        out.2.push(j as i32);
    }
    Ok(())
}
