//! Candidate selector: DFlash2's conditional left-to-right walk over the top-16 lattice,
//! producing the K proposals and the actual proposal distributions q.
//!
//! Semantics. For each row (request) `b < rows` and step `i < k` (mask column i), with
//! `C_i = cand_ids[b, i, ..]`, `u_i = unary[b, i, ..]` (from `unary_topk`) and `g_i = g[b, i, ..]`:
//! ```text
//!   pred(0) = anchors[b];  pred(i) = proposals[b, i-1]     (the actual selected predecessor)
//!   a[r]    = f32(g_i[r] * W_pred[pred(i), r])               (exact: a product of two BF16)
//!   dot[c]  = sum_{r = 0..R-1} a[r] * W_succ[C_i[c], r]      (F32 accumulation from 0, increasing r)
//!   E[c]    = f32(dot[c] + u_i[c])
//!   T = temperature[b]
//!   T <= 0: j = lowest rank attaining max_c E[c];  q = one_hot(j) (exact 1.0 / 0.0)
//!   T >  0: m = max_c E[c];  x[c] = expf(f32(f32(E[c] - m) / T));  s = sum_c x[c] (F32, rank
//!           order);  q[c] = f32(x[c] / s);  u = rng::uniform(seed_b, F_b + i,
//!           Purpose::Dflash2Proposal, 0);  j = first rank c with u < f32 inclusive prefix sum
//!           of q[0..=c] in rank order, else the last rank with q > 0
//!   proposals[b, i] = C_i[j];  chosen[b, i] = j;  q[b, i, ..] = q   (exactly the q of the draw)
//! ```
//! `seed_b = seeds[2b] as u32 | seeds[2b+1] as u32 << 32`, `F_b = start_pos[b]` (the frontier;
//! step i proposes the token at position F+1+i and draws at counter position F+i). The compact
//! row index never enters the draw: permuting rows permutes the results. This is a
//! conditional walk, not a global path optimum.
//! Shapes. g: `[rows, k, R]` BF16; cand_ids, unary: `[rows, k, 16]` I32 / F32; W_pred,
//!   W_succ: `[vocab, R]` BF16 (indexed by global token id); anchors, start_pos: `[rows]` I32;
//!   seeds: `[rows, 2]` I32; temperature: `[rows]` F32. Outputs: proposals, chosen:
//!   `[rows, k]` I32; q: `[rows, k, 16]` F32.
//! Rounding points. `a[r]` F32 (exact), the running F32 sum, `E` F32, every softmax step F32.
//!   Since `a[r]` has at most 16 significant bits and a BF16 codebook entry 8, every product
//!   `a[r] * W_succ` is exact in F32 (barring under/overflow): fused multiply-add and
//!   multiply-then-add agree; only the order of the R additions can differ.
//! Accumulation. The CPU sums in increasing r; CUDA sums lane-strided partials (lane l takes
//!   r = l, l+32, ..., fmaf in increasing r) combined by a butterfly over the lanes at offsets
//!   16, 8, 4, 2, 1 (computed as a reduce-scatter of 16 sums at once: the same additions), a
//!   different order. Hence q is compared with a tolerance and ids exactly on fixtures whose
//!   decisions keep a margin. The CUDA walk forms every edge score a step could need (16
//!   predecessors x 16 candidates) before it decides; each is the same value whichever
//!   predecessor is chosen, so the walk's result is that of scoring only the chosen one.
//! Tie-breaking. Greedy: the lowest rank among exact F32 ties of E. Sampling: inverse CDF in
//!   rank order with a strict `u < prefix` test.
//! Non-finite values. The CPU refuses NaN temperature, non-finite unary scores and any
//!   non-finite edge score (from inf/NaN in g or a used codebook row) with
//!   [`OpsError::Value`]; the CUDA path does not check data: a NaN temperature acts as greedy,
//!   and NaN edge scores give an unspecified (in-range) rank.
//! Caller guarantees. cand_ids and anchors in `0..vocab`, start_pos >= 0 (all checked on the
//!   CPU; on CUDA ids are clamped into `0..vocab` before any codebook read, so a bad id can
//!   never read out of bounds, but its result is unspecified).
//! Writes. Exactly `proposals`, `q`, `chosen`, every element; inputs are never written. The
//!   CPU computes the whole walk before writing, so a refused call writes nothing.
//! API note. Inputs and outputs are passed as the named structs [`Inputs`] and [`Outputs`]
//!   (a departure from the positional convention: several arguments share a dtype).
//! Comparison. proposals, chosen: exact; q: close (abs 2e-6, rel 2e-5, no BF16 floor).

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod reference;
#[cfg(test)]
mod tests;

use half::bf16;

#[cfg(any(test, feature = "conformance"))]
use crate::Element;
#[cfg(any(test, feature = "conformance"))]
use crate::proposal_argmax::Mix;
#[cfg(any(test, feature = "conformance"))]
use crate::registry::{Case, CaseOutput, CaseRun, Criterion, InputCheck, output};
use crate::{Backend, Buffer, OpsError, Result, check_len, check_param};

/// Registry id.
pub const OP: &str = "candidate_selector";

/// Candidates per step (the unary top-16 width).
pub const TOP_K: usize = crate::unary_topk::TOP_K;

/// Largest selector rank R (the CUDA kernel stages one step's `a[r]` in shared memory).
pub const MAX_RANK: usize = 8192;

/// Largest codebook row count (keeps every device index far from i32 overflow).
pub const MAX_VOCAB: usize = 1 << 30;

/// Parameters of [`run`] (static shapes: launch scalars on CUDA).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Params {
    /// Requests in the compact batch; 0 is a no-op.
    pub rows: usize,
    /// Draft count K: mask columns (walk steps) per row, `>= 1`.
    pub k: usize,
    /// Selector rank R (256 for the official DFlash2), `1..=MAX_RANK`.
    pub rank: usize,
    /// Codebook rows (the target's vocab rows, 248320 officially), `1..=MAX_VOCAB`.
    pub vocab: usize,
}

/// The inputs of [`run`] (shapes in the module contract).
#[derive(Clone, Copy, Debug)]
pub struct Inputs<'a> {
    /// Projected hidden g `[rows, k, R]` BF16.
    pub g: &'a Buffer<bf16>,
    /// Candidate global ids `[rows, k, 16]`.
    pub cand_ids: &'a Buffer<i32>,
    /// Unary scores `[rows, k, 16]` F32.
    pub unary: &'a Buffer<f32>,
    /// Predecessor codebook `[vocab, R]` BF16.
    pub w_pred: &'a Buffer<bf16>,
    /// Successor codebook `[vocab, R]` BF16.
    pub w_succ: &'a Buffer<bf16>,
    /// Anchor token (the unprocessed target token at F) per row, `[rows]`.
    pub anchors: &'a Buffer<i32>,
    /// Request seeds `[rows, 2]` (low word, high word bit patterns).
    pub seeds: &'a Buffer<i32>,
    /// Frontier F per row, `[rows]`.
    pub start_pos: &'a Buffer<i32>,
    /// Sampling temperature per row, `[rows]` (`<= 0`: greedy).
    pub temperature: &'a Buffer<f32>,
}

/// The outputs of [`run`].
#[derive(Debug)]
pub struct Outputs<'a> {
    /// Proposed global ids `[rows, k]` (d_1..d_K).
    pub proposals: &'a mut Buffer<i32>,
    /// The distribution each proposal was drawn from, `[rows, k, 16]` F32 over ranks.
    pub q: &'a mut Buffer<f32>,
    /// The chosen rank `[rows, k]` (`proposals = cand_ids[chosen]`).
    pub chosen: &'a mut Buffer<i32>,
}

fn value_err(tensor: &'static str, index: usize, expected: String, found: String) -> OpsError {
    OpsError::Value {
        op: OP,
        tensor,
        index,
        expected,
        found,
    }
}

/// Run the conditional walk of every row (see the module contract). A refused call leaves
/// every output untouched.
pub fn run(
    be: &Backend,
    inputs: &Inputs<'_>,
    outputs: &mut Outputs<'_>,
    params: &Params,
) -> Result<()> {
    let Params {
        rows,
        k,
        rank,
        vocab,
    } = *params;
    check_param(OP, "k", (1..=1 << 16).contains(&k), k, || {
        "1..=65536".into()
    })?;
    check_param(OP, "rank", (1..=MAX_RANK).contains(&rank), rank, || {
        format!("1..={MAX_RANK}")
    })?;
    check_param(OP, "vocab", (1..=MAX_VOCAB).contains(&vocab), vocab, || {
        format!("1..={MAX_VOCAB}")
    })?;
    check_param(OP, "rows", rows <= 1 << 20, rows, || "0..=1048576".into())?;
    let (cols, cands) = (rows * k, rows * k * TOP_K);
    let shape_rk = || format!("[rows={rows}, k={k}]");
    let shape_rk16 = || format!("[rows={rows}, k={k}, 16]");
    check_len(OP, "g", inputs.g.len(), cols * rank, || {
        format!("[rows={rows}, k={k}, R={rank}]")
    })?;
    check_len(OP, "cand_ids", inputs.cand_ids.len(), cands, shape_rk16)?;
    check_len(OP, "unary", inputs.unary.len(), cands, shape_rk16)?;
    let book = vocab.checked_mul(rank).ok_or_else(|| OpsError::Param {
        op: OP,
        param: "vocab",
        expected: "vocab * rank to fit in usize".into(),
        found: vocab.to_string(),
    })?;
    check_len(OP, "w_pred", inputs.w_pred.len(), book, || {
        format!("[vocab={vocab}, R={rank}]")
    })?;
    check_len(OP, "w_succ", inputs.w_succ.len(), book, || {
        format!("[vocab={vocab}, R={rank}]")
    })?;
    check_len(OP, "anchors", inputs.anchors.len(), rows, || {
        format!("[rows={rows}]")
    })?;
    check_len(OP, "seeds", inputs.seeds.len(), 2 * rows, || {
        format!("[rows={rows}, 2]")
    })?;
    check_len(OP, "start_pos", inputs.start_pos.len(), rows, || {
        format!("[rows={rows}]")
    })?;
    check_len(OP, "temperature", inputs.temperature.len(), rows, || {
        format!("[rows={rows}]")
    })?;
    check_len(OP, "proposals", outputs.proposals.len(), cols, shape_rk)?;
    check_len(OP, "q", outputs.q.len(), cands, shape_rk16)?;
    check_len(OP, "chosen", outputs.chosen.len(), cols, shape_rk)?;
    if rows == 0 {
        return Ok(());
    }
    match be {
        Backend::Cpu => run_cpu(inputs, outputs, params),
        #[cfg(feature = "cuda")]
        Backend::Cuda(c) => cuda::run(c, inputs, outputs, params),
    }
}

fn run_cpu(inputs: &Inputs<'_>, outputs: &mut Outputs<'_>, p: &Params) -> Result<()> {
    let Params {
        rows,
        k,
        rank,
        vocab,
    } = *p;
    let g = inputs.g.host(OP, "g")?;
    let cand = inputs.cand_ids.host(OP, "cand_ids")?;
    let unary = inputs.unary.host(OP, "unary")?;
    let w_pred = inputs.w_pred.host(OP, "w_pred")?;
    let w_succ = inputs.w_succ.host(OP, "w_succ")?;
    let anchors = inputs.anchors.host(OP, "anchors")?;
    let seeds = inputs.seeds.host(OP, "seeds")?;
    let start = inputs.start_pos.host(OP, "start_pos")?;
    let temp = inputs.temperature.host(OP, "temperature")?;
    let in_vocab = |x: i32| usize::try_from(x).is_ok_and(|x| x < vocab);
    if let Some(i) = cand.iter().position(|&x| !in_vocab(x)) {
        return Err(value_err(
            "cand_ids",
            i,
            format!("an id in 0..{vocab}"),
            cand[i].to_string(),
        ));
    }
    if let Some(i) = anchors.iter().position(|&x| !in_vocab(x)) {
        let found = anchors[i].to_string();
        return Err(value_err(
            "anchors",
            i,
            format!("an id in 0..{vocab}"),
            found,
        ));
    }
    if let Some(i) = unary.iter().position(|x| !x.is_finite()) {
        return Err(value_err(
            "unary",
            i,
            "a finite score".into(),
            unary[i].to_string(),
        ));
    }
    if let Some(i) = start.iter().position(|&x| x < 0) {
        return Err(value_err(
            "start_pos",
            i,
            "a position >= 0".into(),
            start[i].to_string(),
        ));
    }
    if let Some(i) = temp.iter().position(|x| x.is_nan()) {
        return Err(value_err(
            "temperature",
            i,
            "a non-NaN temperature".into(),
            "NaN".into(),
        ));
    }
    let mut walk = (
        Vec::with_capacity(rows * k),
        Vec::with_capacity(rows * k * TOP_K),
        Vec::with_capacity(rows * k),
    );
    for b in 0..rows {
        let row = reference::Row {
            g: &g[b * k * rank..][..k * rank],
            cand: &cand[b * k * TOP_K..][..k * TOP_K],
            unary: &unary[b * k * TOP_K..][..k * TOP_K],
            anchor: anchors[b],
            seed: seed_of(seeds, b),
            start: start[b] as u64,
            temperature: temp[b],
        };
        reference::walk_row(b, &row, w_pred, w_succ, k, rank, &mut walk)?;
    }
    // Everything validated and computed: now write (host_mut cannot fail for CPU buffers
    // once the inputs were host buffers, but check all three before writing any).
    let pr = outputs.proposals.host_mut(OP, "proposals")?;
    pr.copy_from_slice(&walk.0);
    outputs.q.host_mut(OP, "q")?.copy_from_slice(&walk.1);
    outputs
        .chosen
        .host_mut(OP, "chosen")?
        .copy_from_slice(&walk.2);
    Ok(())
}

/// One row of the edge-score lattice: `E_i[pred, c]` for the 16 ranks `c` of column i, the
/// very code the walk uses (the contract's `a`, `dot` and `E`, F32 accumulation in
/// increasing r), for callers that score other predecessors than the walk's (the DFlash2
/// tree builder).
///
/// `g` is column i's projected hidden `[R]` (R = `g.len()`, `1..=MAX_RANK`); `w_pred` and
/// `w_succ` the codebooks `[vocab, R]`; `pred` the predecessor's global id; `cand` and `unary`
/// column i's `[16]` candidate ids and unary scores. Refuses (with [`OpsError::Length`],
/// [`OpsError::Param`] or [`OpsError::Value`]) a length that does not fit, an empty or
/// ragged codebook, and `pred` or a candidate outside `0..vocab`. The result is not checked:
/// non-finite inputs give non-finite scores (the walk refuses those; so must the caller).
pub fn edge_row(
    g: &[bf16],
    w_pred: &[bf16],
    w_succ: &[bf16],
    pred: usize,
    cand: &[i32],
    unary: &[f32],
) -> Result<[f32; TOP_K]> {
    let rank = g.len();
    check_param(OP, "rank", (1..=MAX_RANK).contains(&rank), rank, || {
        format!("g.len() in 1..={MAX_RANK}")
    })?;
    let vocab = w_pred.len() / rank;
    check_param(
        OP,
        "vocab",
        vocab >= 1 && vocab * rank == w_pred.len(),
        w_pred.len(),
        || format!("w_pred.len() a positive multiple of R = {rank}"),
    )?;
    check_len(OP, "w_succ", w_succ.len(), w_pred.len(), || {
        format!("[vocab={vocab}, R={rank}]")
    })?;
    check_len(OP, "cand_ids", cand.len(), TOP_K, || "[16]".into())?;
    check_len(OP, "unary", unary.len(), TOP_K, || "[16]".into())?;
    if pred >= vocab {
        return Err(value_err(
            "pred",
            0,
            format!("an id in 0..{vocab}"),
            pred.to_string(),
        ));
    }
    if let Some(c) = cand
        .iter()
        .position(|&x| !usize::try_from(x).is_ok_and(|x| x < vocab))
    {
        return Err(value_err(
            "cand_ids",
            c,
            format!("an id in 0..{vocab}"),
            cand[c].to_string(),
        ));
    }
    Ok(reference::edge_scores(
        g,
        &w_pred[pred * rank..][..rank],
        w_succ,
        cand,
        unary,
        rank,
    ))
}

/// The distribution a walk step draws from, given its edge scores `e` (the contract's q,
/// the walk's own code): `temperature > 0`: the F32 `softmax((E - max E) / T)`
/// (`expf(f32(f32(E[c] - m) / T))`, summed in rank order, each divided by the sum);
/// otherwise (NaN included) the exact one-hot at [`greedy_rank`].
pub fn step_q(e: &[f32; TOP_K], temperature: f32) -> [f32; TOP_K] {
    reference::step_q(e, temperature)
}

/// The greedy choice of a walk step: the lowest rank attaining `max_c e[c]` (exact F32
/// comparisons; the walk's own code).
pub fn greedy_rank(e: &[f32; TOP_K]) -> usize {
    reference::greedy_rank(e)
}

/// The u64 seed of row `b` from its `[lo, hi]` words.
pub(crate) fn seed_of(seeds: &[i32], b: usize) -> u64 {
    u64::from(seeds[2 * b] as u32) | u64::from(seeds[2 * b + 1] as u32) << 32
}

/// Host data of one conformance fixture.
#[derive(Clone, Debug)]
#[cfg(any(test, feature = "conformance"))]
pub(crate) struct Fixture {
    pub(crate) p: Params,
    pub(crate) g: Vec<bf16>,
    pub(crate) cand: Vec<i32>,
    pub(crate) unary: Vec<f32>,
    pub(crate) w_pred: Vec<bf16>,
    pub(crate) w_succ: Vec<bf16>,
    pub(crate) anchors: Vec<i32>,
    pub(crate) seeds: Vec<i32>,
    pub(crate) start: Vec<i32>,
    pub(crate) temp: Vec<f32>,
}

/// Greedy decisions keep the best edge score at least this far above the runner-up.
#[cfg(any(test, feature = "conformance"))]
pub(crate) const GREEDY_MARGIN: f32 = 1e-3;
/// Sampled decisions keep the uniform at least this far from every prefix sum of q.
#[cfg(any(test, feature = "conformance"))]
pub(crate) const DRAW_MARGIN: f32 = 1e-4;

/// A deterministic fixture: g ~ U(-1,1), codebook entries of magnitude in [1/64, 1/4) (BF16), 16 distinct
/// candidates per step with descending unary scores 0.05 apart on average (so the edge term,
/// typically ~0.1, changes decisions), temperatures cycling through `temps`.
///
/// Margins: walking the reference, a greedy step whose best edge score is within
/// [`GREEDY_MARGIN`] of the runner-up gets `2 * GREEDY_MARGIN` added to the winner's unary
/// score (which keeps the decision and every later step); a sampled row whose uniform falls
/// within [`DRAW_MARGIN`] of a prefix sum gets a new seed and is walked again. So a device
/// whose sums differ in order (~1e-6) makes the same decisions.
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn fixture(p: Params, temps: &[f32], seed: u64) -> Fixture {
    let Params {
        rows,
        k,
        rank,
        vocab,
    } = p;
    let mut mix = Mix(seed);
    let g: Vec<bf16> = (0..rows * k * rank)
        .map(|_| bf16::from_f32(mix.f32_in(-1.0, 1.0)))
        .collect();
    // Codebook entries are built from bits (4 per random word, fast at the official 63.6M
    // entries per book): random sign and 7-bit mantissa, exponent 2^-6..2^-3, so
    // |w| in [1/64, 1/4).
    let book = |mix: &mut Mix| -> Vec<bf16> {
        let mut out = Vec::with_capacity(vocab * rank + 3);
        while out.len() < vocab * rank {
            let w = mix.next_u64();
            for s in 0..4 {
                let r = (w >> (16 * s)) as u16;
                let exp = 0x79 + ((r >> 8) & 3);
                out.push(bf16::from_bits(((r & 0x80) << 8) | (exp << 7) | (r & 0x7f)));
            }
        }
        out.truncate(vocab * rank);
        out
    };
    let w_pred = book(&mut mix);
    let w_succ = book(&mut mix);
    let mut cand = Vec::with_capacity(rows * k * TOP_K);
    let mut unary = Vec::with_capacity(rows * k * TOP_K);
    for _ in 0..rows * k {
        let mut ids: Vec<i32> = Vec::with_capacity(TOP_K);
        while ids.len() < TOP_K.min(vocab) {
            let id = mix.below(vocab) as i32;
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
        while ids.len() < TOP_K {
            ids.push(mix.below(vocab) as i32);
        }
        cand.extend_from_slice(&ids);
        let mut s = mix.f32_in(-2.0, 2.0);
        for _ in 0..TOP_K {
            unary.push(s);
            s -= mix.f32_in(0.0, 0.1);
        }
    }
    let anchors: Vec<i32> = (0..rows).map(|_| mix.below(vocab) as i32).collect();
    let mut seeds: Vec<i32> = (0..2 * rows).map(|_| mix.next_u64() as i32).collect();
    let start: Vec<i32> = (0..rows).map(|_| mix.below(1 << 20) as i32).collect();
    let temp: Vec<f32> = (0..rows).map(|b| temps[b % temps.len()]).collect();
    for b in 0..rows {
        // A sampled row is re-seeded until no draw sits near a boundary (each try succeeds
        // with probability > 0.9 at k = 15; the bound only guards against a logic error).
        for _try in 0..1000 {
            if margin_walk(
                &g, &cand, &mut unary, &w_pred, &w_succ, &anchors, &seeds, &start, &temp, p, b,
            ) {
                break;
            }
            let next = seed_of(&seeds, b).wrapping_add(0x9E37_79B9);
            seeds[2 * b] = next as u32 as i32;
            seeds[2 * b + 1] = (next >> 32) as u32 as i32;
        }
    }
    Fixture {
        p,
        g,
        cand,
        unary,
        w_pred,
        w_succ,
        anchors,
        seeds,
        start,
        temp,
    }
}

/// Walk row `b` of a fixture with the reference, widening greedy margins in place; false when
/// a sampled draw lands within [`DRAW_MARGIN`] of a prefix sum (the caller re-seeds the row).
#[cfg(any(test, feature = "conformance"))]
fn margin_walk(
    g: &[bf16],
    cand: &[i32],
    unary: &mut [f32],
    w_pred: &[bf16],
    w_succ: &[bf16],
    anchors: &[i32],
    seeds: &[i32],
    start: &[i32],
    temp: &[f32],
    p: Params,
    b: usize,
) -> bool {
    let (k, rank) = (p.k, p.rank);
    let mut pred = anchors[b] as usize;
    for i in 0..k {
        let col = b * k + i;
        let cands = &cand[col * TOP_K..][..TOP_K];
        let e = reference::edge_scores(
            &g[col * rank..][..rank],
            &w_pred[pred * rank..][..rank],
            w_succ,
            cands,
            &unary[col * TOP_K..][..TOP_K],
            rank,
        );
        let u = reference::step_uniform(seed_of(seeds, b), start[b] as u64, i);
        let (j, q) = reference::choose(&e, temp[b], || u);
        if temp[b] > 0.0 {
            let mut cum = 0f32;
            for &x in &q {
                cum += x;
                if (u - cum).abs() < DRAW_MARGIN {
                    return false;
                }
            }
        } else {
            let runner_up = (0..TOP_K)
                .filter(|&c| c != j)
                .map(|c| e[c])
                .fold(f32::NEG_INFINITY, f32::max);
            if e[j] - runner_up < GREEDY_MARGIN {
                unary[col * TOP_K + j] += 2.0 * GREEDY_MARGIN;
            }
        }
        pred = cands[j] as usize;
    }
    true
}

/// Upload a fixture, run the op on poisoned outputs, check inputs and footprint.
#[cfg(any(test, feature = "conformance"))]
fn run_fixture(be: &Backend, f: &Fixture) -> Result<CaseRun> {
    let p = f.p;
    let mut ic = InputCheck::default();
    let g = ic.upload(be, "g", &f.g)?;
    let cand = ic.upload(be, "cand_ids", &f.cand)?;
    let unary = ic.upload(be, "unary", &f.unary)?;
    let w_pred = ic.upload(be, "w_pred", &f.w_pred)?;
    let w_succ = ic.upload(be, "w_succ", &f.w_succ)?;
    let anchors = ic.upload(be, "anchors", &f.anchors)?;
    let seeds = ic.upload(be, "seeds", &f.seeds)?;
    let start = ic.upload(be, "start_pos", &f.start)?;
    let temp = ic.upload(be, "temperature", &f.temp)?;
    let (cols, cands) = (p.rows * p.k, p.rows * p.k * TOP_K);
    let mut proposals = be.filled(cols, i32::POISON)?;
    let mut q = be.filled(cands, f32::POISON)?;
    let mut chosen = be.filled(cols, i32::POISON)?;
    let inputs = Inputs {
        g: &g,
        cand_ids: &cand,
        unary: &unary,
        w_pred: &w_pred,
        w_succ: &w_succ,
        anchors: &anchors,
        seeds: &seeds,
        start_pos: &start,
        temperature: &temp,
    };
    run(
        be,
        &inputs,
        &mut Outputs {
            proposals: &mut proposals,
            q: &mut q,
            chosen: &mut chosen,
        },
        &p,
    )?;
    let mut modified = Vec::new();
    ic.verify(be, "g", &g, &mut modified)?;
    ic.verify(be, "cand_ids", &cand, &mut modified)?;
    ic.verify(be, "unary", &unary, &mut modified)?;
    ic.verify(be, "w_pred", &w_pred, &mut modified)?;
    ic.verify(be, "w_succ", &w_succ, &mut modified)?;
    ic.verify(be, "anchors", &anchors, &mut modified)?;
    ic.verify(be, "seeds", &seeds, &mut modified)?;
    ic.verify(be, "start_pos", &start, &mut modified)?;
    ic.verify(be, "temperature", &temp, &mut modified)?;
    let small = |mut o: CaseOutput| {
        o.allow_constant = o.values.len() < 2;
        o
    };
    Ok(CaseRun {
        outputs: vec![
            small(output(
                "proposals",
                Criterion::Exact,
                &vec![i32::POISON; cols],
                &be.download(&proposals)?,
                |_| true,
            )),
            output(
                "q",
                Criterion::Close {
                    abs: 2e-6,
                    rel: 2e-5,
                    bf16_ulps: 0,
                },
                &vec![f32::POISON; cands],
                &be.download(&q)?,
                |_| true,
            ),
            small(output(
                "chosen",
                Criterion::Exact,
                &vec![i32::POISON; cols],
                &be.download(&chosen)?,
                |_| true,
            )),
        ],
        modified_inputs: modified,
    })
}

#[cfg(any(test, feature = "conformance"))]
fn case(
    p: Params,
    temps: &'static [f32],
    seed: u64,
) -> impl Fn(&Backend) -> Result<CaseRun> + Send + Sync {
    move |be: &Backend| run_fixture(be, &fixture(p, temps, seed))
}

/// Official DFlash2 selector geometry: R 256 over the 248320-row vocabulary.
#[cfg(any(test, feature = "conformance"))]
const fn official(rows: usize, k: usize) -> Params {
    Params {
        rows,
        k,
        rank: 256,
        vocab: 248_320,
    }
}

/// Conformance cases: official geometry (R 256, vocab 248320; K 1, 7, 15; rows 1 and 8) at
/// temperature 0, 1.0 and 0.6 (and mixed per row), plus light shapes with an odd rank.
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn cases() -> Vec<Case> {
    const GREEDY: &[f32] = &[0.0];
    const T1: &[f32] = &[1.0];
    const T06: &[f32] = &[0.6];
    const MIXED: &[f32] = &[0.0, 1.0, 0.6, -1.0];
    let small = |rows, k, rank, vocab| Params {
        rows,
        k,
        rank,
        vocab,
    };
    vec![
        Case::new(
            OP,
            "r256_vocab2048_rows8_k15_mixed",
            case(small(8, 15, 256, 2048), MIXED, 1),
        ),
        Case::new(
            OP,
            "r40_vocab300_rows5_k7_t0_6",
            case(small(5, 7, 40, 300), T06, 2),
        ),
        Case::new(
            OP,
            "r4_vocab10_rows3_k3_greedy",
            case(small(3, 3, 4, 10), GREEDY, 3),
        ),
        Case::new(
            OP,
            "official_rows1_k1_greedy",
            case(official(1, 1), GREEDY, 4),
        )
        .heavy(),
        Case::new(
            OP,
            "official_rows8_k7_greedy",
            case(official(8, 7), GREEDY, 5),
        )
        .heavy(),
        Case::new(OP, "official_rows8_k15_t1", case(official(8, 15), T1, 6)).heavy(),
        Case::new(OP, "official_rows1_k15_t0_6", case(official(1, 15), T06, 7)).heavy(),
        Case::new(
            OP,
            "official_rows8_k7_mixed",
            case(official(8, 7), MIXED, 8),
        )
        .heavy(),
        // Ranks of two and three 256-wide chunks of the CUDA walk's edge tables (the last one
        // partly used).
        Case::new(
            OP,
            "r500_vocab600_rows2_k4_mixed",
            case(small(2, 4, 500, 600), MIXED, 10),
        ),
        Case::new(
            OP,
            "r512_vocab600_rows2_k4_mixed",
            case(small(2, 4, 512, 600), MIXED, 11),
        ),
        Case::new(
            OP,
            "r520_vocab600_rows3_k5_mixed",
            case(small(3, 5, 520, 600), MIXED, 9),
        ),
        // The CUDA walk forms its edge tables 16 steps at a time: three batches (16, 16, 8),
        // each starting from the rank the previous one chose last; a rank of two chunks.
        Case::new(
            OP,
            "r300_vocab700_rows3_k40_mixed",
            case(small(3, 40, 300, 700), MIXED, 12),
        ),
    ]
}
