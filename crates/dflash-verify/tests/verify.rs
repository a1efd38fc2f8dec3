//! Tests of `dflash-verify` through its public API (issue 7 item 4): greedy against a plainly
//! written scan, seeded statistical tests of one stochastic round (first token and the joint
//! first two tokens, one-hot and top-16 q, penalties and filters active, each with a wrong
//! variant that must fail the same statistic), row permutation, RNG draw points, bad inputs.

#![allow(clippy::needless_range_loop)] // reason: index loops mirror the formulas

use dflash_ops::rng::{self, Purpose};
use dflash_ops::{Backend, Buffer};
use dflash_verify::{
    OutputKind, ProposalDist, ProposalKind, QFault, RetainedQ, RoundOutcome, SamplingSettings, TOP,
    TargetLogits, TokenHistory, TokenRole, VerifyError, VerifyRow, VerifyShape, VerifyWorkspace,
};
use proptest::prelude::*;

// ---------------------------------------------------------------------------------------------
// Helpers.

/// SplitMix64: the test's own randomness (independent of the Philox draws under test).
struct Mix(u64);

impl Mix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn workspace(b: usize, w: usize, v: usize, pv: usize, kind: ProposalKind) -> VerifyWorkspace {
    VerifyWorkspace::new(
        &Backend::cpu(),
        VerifyShape {
            max_rows: b,
            cols: w,
            vocab_rows: v,
            public_vocab: pv,
            kind,
        },
    )
    .expect("workspace")
}

/// Dense counts of a history (test side).
fn dense_counts(h: &TokenHistory) -> Vec<u32> {
    let mut c = vec![0u32; h.vocab_rows()];
    for (t, n) in h.iter() {
        c[t as usize] = n;
    }
    c
}

/// The penalized logit of the contract in f32 (each operation rounded, no FMA).
fn penalize_f32(l: f32, c: u32, s: &SamplingSettings) -> f32 {
    if c == 0 {
        return l;
    }
    let l = if l > 0.0 {
        l / s.repetition_penalty
    } else {
        l * s.repetition_penalty
    };
    l - (s.frequency_penalty * c as f32 + s.presence_penalty)
}

/// Plain greedy target token: argmax over public ids of the penalized logits, lowest id wins.
fn plain_argmax(logits: &[f32], counts: &[u32], pv: usize, s: &SamplingSettings) -> u32 {
    let mut best = 0usize;
    let mut best_l = f32::NEG_INFINITY;
    let mut found = false;
    for v in 0..pv {
        let l = penalize_f32(logits[v], counts[v], s);
        if !found || l > best_l {
            best = v;
            best_l = l;
            found = true;
        }
    }
    best as u32
}

/// Plain processed target distribution in f64 (penalties, public mask, temperature, top-k,
/// top-p, min-p). Asserts that every filter decision has a margin of at least 1e-4, so that the
/// op's f32 rounding cannot change the kept set (a fixture failing this is a bad fixture).
fn plain_dist(logits: &[f32], counts: &[u32], pv: usize, s: &SamplingSettings) -> Vec<f64> {
    let t = f64::from(s.temperature);
    assert!(t > 0.0);
    let z: Vec<f64> = (0..pv)
        .map(|v| {
            let mut l = f64::from(logits[v]);
            let c = counts[v];
            if c > 0 {
                let rep = f64::from(s.repetition_penalty);
                l = if l > 0.0 { l / rep } else { l * rep };
                l -= f64::from(s.frequency_penalty) * f64::from(c) + f64::from(s.presence_penalty);
            }
            l / t
        })
        .collect();
    let zmax = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = z.iter().map(|&x| (x - zmax).exp()).collect();
    let mut order: Vec<usize> = (0..pv).collect();
    order.sort_by(|&a, &b| z[b].total_cmp(&z[a]));
    let mut keep = vec![true; pv];
    let k = s.top_k as usize;
    if k > 0 && k < pv {
        assert!(
            z[order[k - 1]] - z[order[k]] > 1e-4,
            "top-k boundary margin"
        );
        for &v in &order[k..] {
            keep[v] = false;
        }
    }
    if s.top_p < 1.0 {
        let total: f64 = (0..pv).filter(|&v| keep[v]).map(|v| e[v]).sum();
        let mut cum = 0.0;
        let mut done = false;
        for &v in &order {
            if !keep[v] {
                continue;
            }
            if done {
                keep[v] = false;
                continue;
            }
            cum += e[v] / total;
            assert!(
                (cum - f64::from(s.top_p)).abs() > 1e-4,
                "top-p boundary margin: cum {cum}, z {:?}",
                order.iter().map(|&v| z[v]).collect::<Vec<_>>()
            );
            if cum >= f64::from(s.top_p) {
                done = true;
            }
        }
    }
    for v in 0..pv {
        if !keep[v] {
            continue;
        }
        assert!(
            (e[v] - f64::from(s.min_p)).abs() > 1e-4,
            "min-p boundary margin"
        );
        if e[v] < f64::from(s.min_p) {
            keep[v] = false;
        }
    }
    let sum: f64 = (0..pv).filter(|&v| keep[v]).map(|v| e[v]).sum();
    (0..pv)
        .map(|v| if keep[v] { e[v] / sum } else { 0.0 })
        .collect()
}

/// Inverse-CDF draw over nonnegative weights (f64, increasing id order).
fn draw(w: &[f64], u: f64) -> usize {
    let total: f64 = w.iter().sum();
    let target = u * total;
    let mut run = 0.0;
    let mut last = 0;
    for (v, &x) in w.iter().enumerate() {
        run += x;
        if x > 0.0 {
            last = v;
        }
        if run > target {
            return v;
        }
    }
    last
}

// ---------------------------------------------------------------------------------------------
// Chi-square machinery.

/// Upper quantile of chi-square with `df` degrees of freedom at tail probability 1e-6
/// (Wilson-Hilferty: `df (1 - 2/(9 df) + z sqrt(2/(9 df)))^3`, z = 4.7534 the standard normal
/// 1 - 1e-6 quantile; accurate to a few percent for df >= 3, which is all the tests use).
fn chi2_threshold_1e6(df: usize) -> f64 {
    let d = df as f64;
    let z = 4.7534;
    d * (1.0 - 2.0 / (9.0 * d) + z * (2.0 / (9.0 * d)).sqrt()).powi(3)
}

/// Pearson chi-square of observed counts against expected probabilities, pooling every cell
/// with an expected count below 5 into one cell. Cells of zero expected probability are left
/// out of the statistic and counted apart: an observation there is an impossible outcome.
#[derive(Debug)]
struct Chi2 {
    stat: f64,
    df: usize,
    impossible: u64,
}

impl Chi2 {
    fn threshold(&self) -> f64 {
        chi2_threshold_1e6(self.df)
    }
    /// Consistent with the reference at tail probability 1e-6.
    fn passes(&self) -> bool {
        self.impossible == 0 && self.stat < self.threshold()
    }
}

fn chi2(observed: &[u64], expected_p: &[f64], n: u64) -> Chi2 {
    let n = n as f64;
    let (mut stat, mut cells, mut impossible) = (0.0, 0usize, 0u64);
    let (mut pool_o, mut pool_e) = (0.0, 0.0);
    for (&o, &p) in observed.iter().zip(expected_p) {
        let e = p * n;
        if p == 0.0 {
            impossible += o;
            continue;
        }
        if e < 5.0 {
            pool_o += o as f64;
            pool_e += e;
        } else {
            stat += (o as f64 - e).powi(2) / e;
            cells += 1;
        }
    }
    if pool_e > 0.0 {
        stat += (pool_o - pool_e).powi(2) / pool_e;
        cells += 1;
    }
    Chi2 {
        stat,
        df: cells.saturating_sub(1).max(1),
        impossible,
    }
}

// ---------------------------------------------------------------------------------------------
// Hand-computed cases.

fn settings_greedy_penalized() -> SamplingSettings {
    SamplingSettings {
        repetition_penalty: 2.0,
        frequency_penalty: 0.5,
        presence_penalty: 1.0,
        ..SamplingSettings::GREEDY
    }
}

#[test]
fn greedy_accepts_matching_prefix_then_corrects() {
    // V = 6, public 5 (token 5 is the padded tail and has the largest logit everywhere).
    let (v, pv, w) = (6, 5, 4);
    let mut ws = workspace(1, w, v, pv, ProposalKind::OneHot);
    let hist = TokenHistory::with_tokens(v, &[0, 1]).expect("history"); // F = 1, anchor 1
    let s = settings_greedy_penalized();
    // Column 0: argmax 2. Column 1: raw argmax 2 (3.0) but 2 is now in the history:
    // 3.0 / 2 - (0.5 + 1) = 0 < 2.5 of token 3, so the target says 3. Column 2: argmax 4.
    let logits: Vec<f32> = [
        [0.0, 0.0, 3.0, 1.0, 0.0, 9.0],
        [0.0, 0.0, 3.0, 2.5, 0.0, 9.0],
        [0.0, 0.0, 0.0, 0.0, 1.0, 9.0],
        [0.0; 6],
    ]
    .concat();
    let be = Backend::cpu();
    let logits = be.upload(&logits).expect("upload");
    let run = |ws: &mut VerifyWorkspace, props: &[u32]| -> RoundOutcome {
        let row = VerifyRow {
            anchor: 1,
            proposals: props,
            dist: ProposalDist::OneHot,
            settings: s,
            seed: 7,
            frontier: 1,
            history: &hist,
        };
        ws.verify(&be, &[row], TargetLogits::padded(&logits))
            .expect("verify")
            .remove(0)
    };
    // d = [2, 2, ..]: d_1 matches, d_2 = 2 is rejected (penalized), correction 3.
    let o = run(&mut ws, &[2, 2, 4]);
    assert_eq!((o.accepted(), o.outputs()), (1, &[2, 3][..]));
    assert_eq!(o.last_kind(), OutputKind::Correction);
    assert_eq!(o.kind(1), Some(OutputKind::Accepted));
    assert_eq!(o.kind(2), Some(OutputKind::Correction));
    assert_eq!((o.kind(0), o.kind(3)), (None, None));
    assert_eq!(
        (1..=3)
            .map(|j| o.continuation_column(j))
            .collect::<Vec<_>>(),
        vec![Some(0), Some(1), None]
    );
    // All three match: bonus from column 3? Only P = 3 fits W = 4; column 3 logits are all
    // zero: the argmax among public rows is 0 (lowest id), but 2 and 3 and 4 are in the history
    // now (penalized below 0), so the bonus is 0.
    let o = run(&mut ws, &[2, 3, 4]);
    assert_eq!((o.accepted(), o.outputs()), (3, &[2, 3, 4, 0][..]));
    assert_eq!(o.last_kind(), OutputKind::Bonus);
    assert_eq!(o.continuation_column(4), Some(3));
    // P = 0: bonus from p_0.
    let o = run(&mut ws, &[]);
    assert_eq!(
        (o.accepted(), o.outputs(), o.last_kind()),
        (0, &[2][..], OutputKind::Bonus)
    );
    // First proposal wrong: correction at column 0.
    let o = run(&mut ws, &[4, 3]);
    assert_eq!(
        (o.accepted(), o.outputs(), o.last_kind()),
        (0, &[2][..], OutputKind::Correction)
    );
}

/// The draws are exactly the documented (position, purpose) of the RNG identity: with one-hot
/// q and p_0 = [1/2, 1/4, 1/4, 0], d_1 = 0 is accepted iff u(F+1, Accept) < 1/2; the correction
/// (residual [0, 1/4, 1/4, 0]) is 1 iff u(F+1, Correction) < 1/2; with d_1 accepted the bonus
/// from p_1 = [0, 0, 1/2, 1/2]... uses u(F+2, Bonus). Draws within 1e-5 of a boundary are
/// skipped (f32 rounding of p).
#[test]
fn draws_use_the_documented_positions_and_purposes() {
    let (v, w) = (4, 2);
    let be = Backend::cpu();
    let ln = |x: f64| x.ln() as f32;
    let logits: Vec<f32> = vec![
        ln(0.5),
        ln(0.25),
        ln(0.25),
        f32::NEG_INFINITY,
        f32::NEG_INFINITY,
        f32::NEG_INFINITY,
        0.0,
        0.0,
    ];
    let logits = be.upload(&logits).expect("upload");
    let mut ws = workspace(1, w, v, v, ProposalKind::OneHot);
    let f = 41u64;
    let mut toks: Vec<u32> = vec![3; f as usize];
    toks.push(3);
    let hist = TokenHistory::with_tokens(v, &toks).expect("history");
    let s = SamplingSettings::sampling(1.0);
    let mut checked = 0;
    for seed in 0..400u64 {
        let o = ws
            .verify(
                &be,
                &[VerifyRow {
                    anchor: 3,
                    proposals: &[0],
                    dist: ProposalDist::OneHot,
                    settings: s,
                    seed,
                    frontier: f,
                    history: &hist,
                }],
                TargetLogits::padded(&logits),
            )
            .expect("verify")
            .remove(0);
        let ua = rng::uniform(seed, f + 1, Purpose::Accept, 0);
        let uc = rng::uniform(seed, f + 1, Purpose::Correction, 0);
        let ub = rng::uniform(seed, f + 2, Purpose::Bonus, 0);
        let near = |u: f32, b: f32| (u - b).abs() < 1e-5;
        if near(ua, 0.5) || near(uc, 0.5) || near(ub, 0.5) {
            continue;
        }
        checked += 1;
        if ua < 0.5 {
            let bonus = if ub < 0.5 { 2 } else { 3 };
            assert_eq!(o.outputs(), &[0, bonus], "seed {seed}");
        } else {
            let corr = if uc < 0.5 { 1 } else { 2 };
            assert_eq!(o.outputs(), &[corr], "seed {seed}");
        }
    }
    assert!(checked > 390);
}

// ---------------------------------------------------------------------------------------------
// Greedy against a plain scan.

/// A random greedy case: logits on a coarse grid (many ties), -inf entries, a non-public tail
/// with large logits, random penalties, filters that greedy must ignore, proposals that follow
/// the plain argmax with probability 3/4.
struct GreedyCase {
    v: usize,
    pv: usize,
    w: usize,
    b: usize,
    logits: Vec<f32>,
    rows: Vec<(Vec<u32>, TokenHistory, SamplingSettings, u64)>, // proposals, history, s, seed
}

fn greedy_case(seed: u64) -> GreedyCase {
    let mut g = Mix(seed);
    let v = 2 + g.below(30);
    let pv = 1 + g.below(v);
    let w = 1 + g.below(6);
    let n = 1 + g.below(4);
    let b = n + g.below(3);
    let mut logits = vec![0f32; n * w * v];
    for x in logits.iter_mut() {
        *x = match g.below(16) {
            0 => f32::NEG_INFINITY,
            _ => (g.below(9) as f32 - 4.0) * 0.5,
        };
    }
    let mut rows = Vec::new();
    for r in 0..n {
        // At least one finite public logit per column.
        for i in 0..w {
            logits[(r * w + i) * v] = (g.below(5) as f32) - 2.0;
            for t in pv..v {
                logits[(r * w + i) * v + t] = 50.0;
            }
        }
        let prompt: Vec<u32> = (0..1 + g.below(6)).map(|_| g.below(pv) as u32).collect();
        let hist = TokenHistory::with_tokens(v, &prompt).expect("history");
        let s = SamplingSettings {
            temperature: 0.0,
            top_k: g.below(3) as i32,
            top_p: [1.0, 0.5, 0.1][g.below(3)],
            min_p: [0.0, 0.5, 0.9][g.below(3)],
            repetition_penalty: [1.0, 1.5, 0.5, 3.0][g.below(4)],
            frequency_penalty: [0.0, 0.5, -0.25][g.below(3)],
            presence_penalty: [0.0, 1.0, -0.5][g.below(3)],
        };
        let np = g.below(w);
        let mut counts = dense_counts(&hist);
        let mut props = Vec::new();
        for i in 0..np {
            let col = &logits[(r * w + i) * v..(r * w + i + 1) * v];
            let d = if g.below(4) != 0 {
                plain_argmax(col, &counts, pv, &s)
            } else {
                g.below(pv) as u32
            };
            counts[d as usize] += 1;
            props.push(d);
        }
        rows.push((props, hist, s, g.next()));
    }
    GreedyCase {
        v,
        pv,
        w,
        b,
        logits,
        rows,
    }
}

/// The plainly written greedy scan.
fn plain_greedy_scan(c: &GreedyCase, r: usize) -> (usize, Vec<u32>, OutputKind) {
    let (props, hist, s, _) = &c.rows[r];
    let mut counts = dense_counts(hist);
    let mut out = Vec::new();
    for i in 0..=props.len() {
        let col = &c.logits[(r * c.w + i) * c.v..(r * c.w + i + 1) * c.v];
        let t = plain_argmax(col, &counts, c.pv, s);
        if i == props.len() {
            out.push(t);
            return (i, out, OutputKind::Bonus);
        }
        if props[i] != t {
            out.push(t);
            return (i, out, OutputKind::Correction);
        }
        out.push(t);
        counts[t as usize] += 1;
    }
    unreachable!("the loop returns at i = P")
}

fn run_greedy(c: &GreedyCase, ws: &mut VerifyWorkspace) -> Vec<RoundOutcome> {
    let be = Backend::cpu();
    let logits = be.upload(&c.logits).expect("upload");
    let rows: Vec<VerifyRow<'_>> = c
        .rows
        .iter()
        .map(|(props, hist, s, seed)| VerifyRow {
            anchor: hist.last().expect("non-empty"),
            proposals: props,
            dist: ProposalDist::OneHot,
            settings: *s,
            seed: *seed,
            frontier: hist.len() - 1,
            history: hist,
        })
        .collect();
    ws.verify(&be, &rows, TargetLogits::padded(&logits))
        .expect("verify")
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Greedy verification equals the plain scan (argmax of the penalized public logits per
    /// column with accepted proposals added to the history, match prefix, correction or
    /// bonus), whatever the filters, seeds and batch padding.
    #[test]
    fn greedy_equals_plain_scan(seed in any::<u64>()) {
        let c = greedy_case(seed);
        let mut ws = workspace(c.b, c.w, c.v, c.pv, ProposalKind::OneHot);
        let got = run_greedy(&c, &mut ws);
        for r in 0..c.rows.len() {
            let (a, ys, kind) = plain_greedy_scan(&c, r);
            prop_assert_eq!(got[r].accepted(), a);
            prop_assert_eq!(got[r].outputs(), &ys[..]);
            prop_assert_eq!(got[r].last_kind(), kind);
            prop_assert_eq!(got[r].proposals(), c.rows[r].0.len());
            prop_assert_eq!(got[r].continuation_column(ys.len()), Some(ys.len() - 1));
        }
        // The same workspace again (counts already synchronized) gives the same result.
        prop_assert_eq!(run_greedy(&c, &mut ws), got);
    }
}

// ---------------------------------------------------------------------------------------------
// Statistical tests of one stochastic round.

const SV: usize = 24; // vocabulary rows
const SPV: usize = 20; // public vocabulary (rows 20..24 carry logit 8 and must never appear)
const SW: usize = 3; // W = K + 1, P = 2 proposals

fn stat_settings() -> SamplingSettings {
    SamplingSettings {
        temperature: 0.9,
        top_k: 9,
        top_p: 0.92,
        min_p: 0.03,
        repetition_penalty: 1.3,
        frequency_penalty: 0.4,
        presence_penalty: 0.3,
    }
}

/// The synthetic target: logits of position F+1 (column 0) and of position F+2 given the token
/// x at F+1 (column 1, with a pull towards repeating x, so the penalties on x matter), and of
/// F+3 (column 2; it never influences the first two tokens).
fn target_logits(col: usize, x: u32) -> Vec<f32> {
    (0..SV)
        .map(|v| {
            if v >= SPV {
                return 8.0;
            }
            let vv = v as u32;
            match col {
                0 => ((v * 7) % 11) as f32 * 0.37 - 1.0 + (v as f32) * 0.013,
                1 => {
                    let base = ((vv * 5 + x * 3) % 13) as f32 * 0.31 - 1.0 + (v as f32) * 0.011;
                    if vv == x { base + 1.6 } else { base }
                }
                _ => ((vv * 3 + x) % 7) as f32 * 0.5,
            }
        })
        .collect()
}

fn stat_history() -> TokenHistory {
    // Tokens 1 and 6 (likely first tokens) are absent, so accepting them changes column 1's
    // penalties from none to full.
    TokenHistory::with_tokens(SV, &[3, 5, 3, 17, 9, 12, 5, 2]).expect("history")
}

/// Exact reference: p_0 and p_1(. | y1) with y1 added to the history.
fn reference(s: &SamplingSettings, hist: &TokenHistory) -> (Vec<f64>, Vec<Vec<f64>>) {
    let counts = dense_counts(hist);
    let p0 = plain_dist(&target_logits(0, 0), &counts, SPV, s);
    let p1 = (0..SPV as u32)
        .map(|y1| {
            let mut c = counts.clone();
            c[y1 as usize] += 1;
            plain_dist(&target_logits(1, y1), &c, SPV, s)
        })
        .collect();
    (p0, p1)
}

/// The proposal process of one sample (the draft's own randomness, independent of the
/// verification draws): d_1, d_2 and, for top-16, the retained q of each column.
struct Draft {
    d: [u32; 2],
    q: Option<[RetainedQ; 2]>,
}

fn retained(ids: [u32; TOP], scores: [f64; TOP]) -> RetainedQ {
    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
    let sum: f64 = e.iter().sum();
    let mut q = [0f32; TOP];
    for s in 0..TOP {
        q[s] = (e[s] / sum) as f32;
    }
    RetainedQ { ids, q }
}

fn draw_from_q(rq: &RetainedQ, u: f64) -> u32 {
    let w: Vec<f64> = rq.q.iter().map(|&x| f64::from(x)).collect();
    rq.ids[draw(&w, u)]
}

fn draft(kind: ProposalKind, sample: u64) -> Draft {
    let mut g = Mix(0xd4af_7000 ^ sample.wrapping_mul(0x2545_F491_4F6C_DD1D));
    match kind {
        ProposalKind::OneHot => {
            // A deterministic-given-the-draft proposal: mostly likely tokens, sometimes any.
            let pick = |g: &mut Mix, likely: &[u32]| {
                if g.below(4) == 0 {
                    g.below(SPV) as u32
                } else {
                    likely[g.below(likely.len())]
                }
            };
            let d1 = pick(&mut g, &[1, 6, 8]);
            let d2 = pick(&mut g, &[d1, (d1 + 3) % SPV as u32, 4]);
            Draft {
                d: [d1, d2],
                q: None,
            }
        }
        ProposalKind::Top16 => {
            // Column 0: candidates are all public tokens but 0, 10, 15, 19, in a scrambled
            // order, scores unlike p_0 (so q > p on some tokens and q < p on others).
            let mut ids0 = [0u32; TOP];
            let mut n = 0;
            for j in 0..SPV as u32 {
                let t = (j * 7 + 3) % SPV as u32;
                if ![0, 10, 15, 19].contains(&t) {
                    ids0[n] = t;
                    n += 1;
                }
            }
            let mut sc0 = [0f64; TOP];
            for s in 0..TOP {
                sc0[s] = ((ids0[s] * 5) % 9) as f64 * 0.45 - (s as f64) * 0.05;
            }
            let q0 = retained(ids0, sc0);
            let d1 = draw_from_q(&q0, g.unit());
            // Column 1: the conditional q given the actual d_1.
            let mut ids1 = [0u32; TOP];
            for s in 0..TOP {
                ids1[s] = (d1 + 1 + s as u32) % SPV as u32;
            }
            let mut sc1 = [0f64; TOP];
            for s in 0..TOP {
                sc1[s] = ((ids1[s] * 3 + d1) % 7) as f64 * 0.5;
            }
            let q1 = retained(ids1, sc1);
            let d2 = draw_from_q(&q1, g.unit());
            Draft {
                d: [d1, d2],
                q: Some([q0, q1]),
            }
        }
    }
}

/// First two tokens of the stream of every sample, from the library: one verify round per
/// sample (seed = sample index + a base), and when the round emitted only y_1, a plain decode
/// step for position F+2 from the target given y_1 (history + y_1, uniform (F+2, Decode)).
fn library_streams(kind: ProposalKind, n: u64) -> Vec<(u32, u32)> {
    let be = Backend::cpu();
    let s = stat_settings();
    let hist = stat_history();
    let f = hist.len() - 1;
    let anchor = hist.last().expect("history");
    let counts = dense_counts(&hist);
    let batch = 500usize;
    let mut ws = workspace(batch, SW, SV, SPV, kind);
    let mut out = Vec::with_capacity(n as usize);
    let mut start = 0u64;
    while start < n {
        let m = batch.min((n - start) as usize);
        let drafts: Vec<Draft> = (0..m as u64).map(|i| draft(kind, start + i)).collect();
        let mut logits = Vec::with_capacity(m * SW * SV);
        for d in &drafts {
            logits.extend(target_logits(0, anchor));
            logits.extend(target_logits(1, d.d[0]));
            logits.extend(target_logits(2, d.d[1]));
        }
        let logits: Buffer<f32> = be.upload(&logits).expect("upload");
        let rows: Vec<VerifyRow<'_>> = drafts
            .iter()
            .enumerate()
            .map(|(i, d)| VerifyRow {
                anchor,
                proposals: &d.d,
                dist: match &d.q {
                    None => ProposalDist::OneHot,
                    Some(q) => ProposalDist::Top16(q),
                },
                settings: s,
                seed: 0x5eed_0000_0000 + start + i as u64,
                frontier: f,
                history: &hist,
            })
            .collect();
        let outcomes = ws
            .verify(&be, &rows, TargetLogits::padded(&logits))
            .expect("verify");
        for (i, o) in outcomes.iter().enumerate() {
            let y1 = o.outputs()[0];
            let y2 = if o.len() >= 2 {
                o.outputs()[1]
            } else {
                let mut c = counts.clone();
                c[y1 as usize] += 1;
                let p1 = plain_dist(&target_logits(1, y1), &c, SPV, &s);
                let u = rng::uniform(rows[i].seed, f + 2, Purpose::Decode, 0);
                draw(&p1, f64::from(u)) as u32
            };
            out.push((y1, y2));
        }
        start += m as u64;
    }
    out
}

/// Variants of the round, simulated plainly in the test with the same uniforms.
#[derive(Clone, Copy, PartialEq)]
enum Variant {
    /// The specified algorithm (a sanity check of the simulation itself).
    Correct,
    /// Wrong: column 1 processed without the accepted d_1 in the history.
    NoHistoryUpdate,
    /// Wrong: the correction drawn from p itself instead of the clipped residual max(p - q, 0).
    CorrectionFromP,
    /// Wrong (DFlash2): acceptance with the actual q, but the DFlash residual max(p - 1{d}, 0)
    /// (a point mass subtracted instead of the retained q).
    OneHotResidual,
}

fn simulated_streams(kind: ProposalKind, n: u64, variant: Variant) -> Vec<(u32, u32)> {
    let s = stat_settings();
    let hist = stat_history();
    let f = hist.len() - 1;
    let anchor = hist.last().expect("history");
    let counts = dense_counts(&hist);
    let mut out = Vec::with_capacity(n as usize);
    for k in 0..n {
        let d = draft(kind, k);
        let seed = 0x5eed_0000_0000 + k;
        let mut c = counts.clone();
        let mut ys = Vec::new();
        for i in 0..=2usize {
            if i == 2 {
                // Both proposals accepted: the bonus would be y_3, outside the statistic.
                break;
            }
            let x = if i == 0 { anchor } else { d.d[i - 1] };
            let p = plain_dist(&target_logits(i, x), &c, SPV, &s);
            let dd = d.d[i];
            let point = |v: u32| f64::from(u8::from(v == dd));
            let qv = |v: u32| -> f64 {
                match &d.q {
                    Some(q) => q[i]
                        .ids
                        .iter()
                        .position(|&id| id == v)
                        .map_or(0.0, |sl| f64::from(q[i].q[sl])),
                    None => point(v),
                }
            };
            let u = f64::from(rng::uniform(seed, f + 1 + i as u64, Purpose::Accept, 0));
            if u * qv(dd) < p[dd as usize] {
                ys.push(dd);
                if variant != Variant::NoHistoryUpdate {
                    c[dd as usize] += 1;
                }
                continue;
            }
            let u = f64::from(rng::uniform(seed, f + 1 + i as u64, Purpose::Correction, 0));
            let wts: Vec<f64> = (0..SPV)
                .map(|v| match variant {
                    Variant::CorrectionFromP => p[v],
                    Variant::OneHotResidual => (p[v] - point(v as u32)).max(0.0),
                    _ => (p[v] - qv(v as u32)).max(0.0),
                })
                .collect();
            ys.push(draw(&wts, u) as u32);
            break;
        }
        if ys.len() == 1 {
            let mut c2 = counts.clone();
            c2[ys[0] as usize] += 1;
            let p1 = plain_dist(&target_logits(1, ys[0]), &c2, SPV, &s);
            let u = rng::uniform(seed, f + 2, Purpose::Decode, 0);
            ys.push(draw(&p1, f64::from(u)) as u32);
        }
        out.push((ys[0], ys[1]));
    }
    out
}

/// (first-token statistic, joint statistic).
fn statistics(streams: &[(u32, u32)], p0: &[f64], p1: &[Vec<f64>]) -> (Chi2, Chi2) {
    let n = streams.len() as u64;
    let mut first = vec![0u64; SV];
    let mut joint = vec![0u64; SV * SV];
    for &(a, b) in streams {
        first[a as usize] += 1;
        joint[a as usize * SV + b as usize] += 1;
    }
    let mut pf = vec![0.0; SV];
    pf[..SPV].copy_from_slice(p0);
    let mut pj = vec![0.0; SV * SV];
    for a in 0..SPV {
        for b in 0..SPV {
            pj[a * SV + b] = p0[a] * p1[a][b];
        }
    }
    (chi2(&first, &pf, n), chi2(&joint, &pj, n))
}

/// One stochastic round reproduces the processed target distribution of the first emitted
/// token and of the joint first two tokens of the stream.
///
/// Design: P = 2 proposals per round. The round emits y_2 itself when d_1 is accepted (y_2 is
/// then d_2 accepted at column 1 or the correction drawn at column 1); when d_1 is rejected the
/// round emits only y_1, and the test continues the stream with one plain decode step for
/// position F+2 (from the target given y_1, history + y_1, uniform (F+2, Decode)). The
/// reference is exact: P(y1, y2) = p_0(y1) p_1(y2 | history + y1), computed in f64 by a plain
/// implementation of the processing (penalties, public mask with a strong non-public tail,
/// temperature 0.9, top-k 9, top-p 0.92, min-p 0.03, every boundary with a margin > 1e-4). The
/// joint statistic therefore tests the acceptance and correction at column 1 and the history
/// update of column 1; the first-token statistic tests column 0's acceptance and correction.
///
/// Statistic: Pearson chi-square, cells with expected count < 5 pooled, threshold the 1 - 1e-6
/// quantile of chi-square with the resulting df (Wilson-Hilferty), and no observation in a cell
/// of probability 0. Samples: N = 40000 rounds, one fixed seed per round
/// (0x5eed_0000_0000 + index), so the run is deterministic; for a correct implementation the
/// false-failure probability of each statistic is about 1e-6 (< 1e-5 over the 8 statistics of
/// the two tests). The wrong variants ([`Variant`]) are simulated with the same uniforms and
/// must fail the same statistics (their chi-square on the possible cells alone exceeds the
/// threshold too, so the failure is not only an impossible outcome).
fn statistical_round(kind: ProposalKind, wrong_first: Variant) {
    const N: u64 = 40_000;
    let s = stat_settings();
    let hist = stat_history();
    let (p0, p1) = reference(&s, &hist);
    // The fixture exercises the filters and penalties.
    assert!(
        p0.iter().filter(|&&x| x == 0.0).count() >= 5,
        "filters cut p_0"
    );
    let no_update = plain_dist(&target_logits(1, 1), &dense_counts(&hist), SPV, &s);
    assert!(
        (no_update[1] - p1[1][1]).abs() > 0.05,
        "history update matters"
    );

    let lib = library_streams(kind, N);
    let (first, joint) = statistics(&lib, &p0, &p1);
    eprintln!(
        "{kind:?} library: first {first:?} thr {:.1}; joint {joint:?} thr {:.1}",
        first.threshold(),
        joint.threshold()
    );
    assert!(first.passes(), "first token: {first:?}");
    assert!(joint.passes(), "joint: {joint:?}");

    // The plain simulation of the specified algorithm passes as well (so the statistic and
    // the simulation agree), and the wrong variants fail the same statistics.
    let sim = simulated_streams(kind, N, Variant::Correct);
    let (cf, cj) = statistics(&sim, &p0, &p1);
    assert!(cf.passes() && cj.passes(), "simulation: {cf:?} {cj:?}");
    // With the same uniforms the library and the plain simulation decide alike sample by
    // sample (they may differ only where f32 rounding of p moves a draw across a boundary).
    let differ = lib.iter().zip(&sim).filter(|(a, b)| a != b).count();
    assert!(
        differ <= N as usize / 1000,
        "{differ} of {N} streams differ from the simulation"
    );
    let bad = simulated_streams(kind, N, wrong_first);
    let (wf, _) = statistics(&bad, &p0, &p1);
    eprintln!(
        "{kind:?} wrong first-token variant: {wf:?} thr {:.1}",
        wf.threshold()
    );
    assert!(
        wf.stat > wf.threshold(),
        "the wrong first-token variant passes: {wf:?}"
    );
    let bad = simulated_streams(kind, N, Variant::NoHistoryUpdate);
    let (hf, hj) = statistics(&bad, &p0, &p1);
    eprintln!(
        "{kind:?} no-history-update variant: first {hf:?}; joint {hj:?} thr {:.1}",
        hj.threshold()
    );
    assert!(hf.passes(), "the history bug does not touch y_1");
    assert!(
        hj.stat > hj.threshold(),
        "the no-history-update variant passes: {hj:?}"
    );
}

#[test]
fn one_round_reproduces_target_distribution_one_hot_q() {
    statistical_round(ProposalKind::OneHot, Variant::CorrectionFromP);
}

#[test]
fn one_round_reproduces_target_distribution_top16_q() {
    statistical_round(ProposalKind::Top16, Variant::OneHotResidual);
}

// ---------------------------------------------------------------------------------------------
// Batch independence.

struct MixedRow {
    props: Vec<u32>,
    q: Vec<RetainedQ>,
    hist: TokenHistory,
    s: SamplingSettings,
    seed: u64,
    logits: Vec<f32>, // [W, V]
}

fn mixed_rows(n: usize, w: usize, v: usize, pv: usize, seed: u64) -> Vec<MixedRow> {
    let mut g = Mix(seed);
    (0..n)
        .map(|r| {
            let prompt: Vec<u32> = (0..1 + g.below(9)).map(|_| g.below(pv) as u32).collect();
            let hist = TokenHistory::with_tokens(v, &prompt).expect("history");
            let np = g.below(w);
            let mut props = Vec::new();
            let mut q = Vec::new();
            for _ in 0..np {
                let mut ids = [0u32; TOP];
                let off = g.below(pv);
                for s in 0..TOP {
                    ids[s] = ((off + s * 3) % pv) as u32;
                }
                let mut sc = [0f64; TOP];
                for s in 0..TOP {
                    sc[s] = g.unit() * 3.0;
                }
                let rq = retained(ids, sc);
                props.push(rq.ids[g.below(TOP)]);
                q.push(rq);
            }
            let s = match r % 3 {
                0 => SamplingSettings::GREEDY,
                1 => SamplingSettings {
                    temperature: 0.8,
                    top_k: 12,
                    top_p: 0.9,
                    min_p: 0.02,
                    repetition_penalty: 1.2,
                    frequency_penalty: 0.3,
                    presence_penalty: 0.2,
                },
                _ => SamplingSettings::sampling(1.1),
            };
            let mut logits: Vec<f32> = (0..w * v).map(|_| (g.unit() * 6.0 - 3.0) as f32).collect();
            // Most proposals are strong target tokens, so that rows accept some of them.
            for (i, &d) in props.iter().enumerate() {
                if g.below(3) != 0 {
                    logits[i * v + d as usize] += 6.0;
                }
            }
            MixedRow {
                props,
                q,
                hist,
                s,
                seed: g.next(),
                logits,
            }
        })
        .collect()
}

fn run_mixed(
    ws: &mut VerifyWorkspace,
    rows: &[&MixedRow],
    kind: ProposalKind,
) -> Vec<RoundOutcome> {
    let logits: Vec<f32> = rows.iter().flat_map(|r| r.logits.iter().copied()).collect();
    let padded = dflash_verify::LogitsLayout::Padded;
    run_with_logits(ws, rows, kind, padded, false, &logits).expect("verify")
}

/// Permuting batch rows permutes the outcomes and changes nothing else: each row's outcome is
/// also what it gets alone (in a one-row workspace and padded in a larger one), and reusing a
/// workspace across batches (rows moving between slots) changes nothing.
#[test]
fn permuting_rows_permutes_outcomes_and_changes_nothing_else() {
    let (w, v, pv) = (6, 80, 70);
    for kind in [ProposalKind::OneHot, ProposalKind::Top16] {
        let rows = mixed_rows(7, w, v, pv, 99);
        let mut ws = workspace(8, w, v, pv, kind);
        let all: Vec<&MixedRow> = rows.iter().collect();
        let base = run_mixed(&mut ws, &all, kind);
        assert!(
            base.iter().any(|o| o.accepted() > 0),
            "fixture accepts something"
        );
        let mut g = Mix(5);
        for _ in 0..6 {
            let mut perm: Vec<usize> = (0..rows.len()).collect();
            for i in (1..perm.len()).rev() {
                perm.swap(i, g.below(i + 1));
            }
            let take = 1 + g.below(rows.len());
            let sub: Vec<&MixedRow> = perm[..take].iter().map(|&i| &rows[i]).collect();
            let got = run_mixed(&mut ws, &sub, kind);
            for (j, &i) in perm[..take].iter().enumerate() {
                assert_eq!(got[j], base[i], "{kind:?}: row {i} at batch position {j}");
            }
        }
        for (i, r) in rows.iter().enumerate() {
            let mut one = workspace(1, w, v, pv, kind);
            assert_eq!(
                run_mixed(&mut one, &[r], kind)[0],
                base[i],
                "{kind:?}: row {i} alone"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Bad inputs.

/// A valid top-16 batch of two rows and a way to corrupt it.
struct BadFixture {
    w: usize,
    v: usize,
    pv: usize,
    rows: Vec<MixedRow>,
}

fn bad_fixture() -> BadFixture {
    let (w, v, pv) = (4, 40, 32);
    let mut rows = mixed_rows(2, w, v, pv, 3);
    // Make sure both rows have 2 proposals.
    let mut g = Mix(11);
    for r in rows.iter_mut() {
        r.props.clear();
        r.q.clear();
        for _ in 0..2 {
            let mut ids = [0u32; TOP];
            for s in 0..TOP {
                ids[s] = (s * 2) as u32;
            }
            let rq = retained(ids, [0.0; TOP].map(|_: f64| g.unit()));
            r.props.push(rq.ids[g.below(TOP)]);
            r.q.push(rq);
        }
    }
    BadFixture { w, v, pv, rows }
}

fn try_verify<'a>(
    ws: &mut VerifyWorkspace,
    fx: &'a BadFixture,
    edit: impl Fn(&mut Vec<VerifyRow<'a>>, &mut Vec<f32>),
) -> Result<Vec<RoundOutcome>, VerifyError> {
    let be = Backend::cpu();
    let mut logits: Vec<f32> = fx
        .rows
        .iter()
        .flat_map(|r| r.logits.iter().copied())
        .collect();
    let mut vr: Vec<VerifyRow<'a>> = fx
        .rows
        .iter()
        .map(|r| VerifyRow {
            anchor: r.hist.last().expect("history"),
            proposals: &r.props,
            dist: ProposalDist::Top16(&r.q),
            settings: r.s,
            seed: r.seed,
            frontier: r.hist.len() - 1,
            history: &r.hist,
        })
        .collect();
    edit(&mut vr, &mut logits);
    let logits = be.upload(&logits).expect("upload");
    ws.verify(&be, &vr, TargetLogits::padded(&logits))
}

#[test]
fn bad_inputs_give_typed_errors_and_change_nothing() {
    let fx = bad_fixture();
    let (w, v, pv) = (fx.w, fx.v, fx.pv);
    let mut ws = workspace(2, w, v, pv, ProposalKind::Top16);
    let good = try_verify(&mut ws, &fx, |_, _| {}).expect("valid fixture");
    let q0 = fx.rows[1].q.clone();
    let with_q = |f: fn(&mut RetainedQ)| {
        let mut q = q0.clone();
        f(&mut q[1]);
        q
    };
    let neg = with_q(|q| q.q[3] = -q.q[3]);
    let nan = with_q(|q| q.q[5] = f32::NAN);
    let unnorm = with_q(|q| q.q.iter_mut().for_each(|x| *x *= 0.9));
    let dup = with_q(|q| q.ids[7] = q.ids[2]);
    let tail = with_q(|q| q.ids[4] = 33);
    let over = with_q(|q| q.ids[4] = 40);
    let props1 = fx.rows[1].props.clone();
    let slot = q0[1]
        .ids
        .iter()
        .position(|&id| id == props1[1])
        .expect("in ids");
    let zero_mass = {
        let mut q = q0.clone();
        let m = q[1].q[slot];
        q[1].q[slot] = 0.0;
        q[1].q[(slot + 1) % TOP] += m;
        q
    };
    let not_cand = [props1[0], 1]; // odd ids are not candidates
    let big = [0u32, 0, 0, 0];
    let bad_d = [props1[0], 45];
    let tail_d = [props1[0], 35];
    let short_q = [q0[0]];
    let other_hist = TokenHistory::with_tokens(v + 1, &[1]).expect("history");

    macro_rules! refused {
        ($edit:expr, $pat:pat) => {{
            let r = try_verify(&mut ws, &fx, $edit);
            assert!(matches!(r, Err($pat)), "got {r:?}");
            // Nothing half-updated: the next valid call gives the same outcomes.
            assert_eq!(try_verify(&mut ws, &fx, |_, _| {}).expect("valid"), good);
        }};
    }
    refused!(
        |r, _| r[1].dist = ProposalDist::Top16(&neg),
        VerifyError::QNotDistribution {
            row: 1,
            column: 1,
            fault: QFault::Negative { slot: 3, .. }
        }
    );
    refused!(
        |r, _| r[1].dist = ProposalDist::Top16(&nan),
        VerifyError::QNotDistribution {
            row: 1,
            column: 1,
            fault: QFault::NonFinite { slot: 5, .. }
        }
    );
    refused!(
        |r, _| r[1].dist = ProposalDist::Top16(&unnorm),
        VerifyError::QNotDistribution {
            fault: QFault::Sum { .. },
            ..
        }
    );
    refused!(
        |r, _| r[1].dist = ProposalDist::Top16(&dup),
        VerifyError::QNotDistribution {
            fault: QFault::DuplicateId {
                first: 2,
                second: 7,
                ..
            },
            ..
        }
    );
    refused!(
        |r, _| r[1].dist = ProposalDist::Top16(&zero_mass),
        VerifyError::QNotDistribution {
            fault: QFault::ProposalZeroMass { .. },
            ..
        }
    );
    refused!(
        |r, _| r[1].dist = ProposalDist::Top16(&tail),
        VerifyError::NonPublicToken {
            row: 1,
            role: TokenRole::Candidate { column: 1, slot: 4 },
            token: 33,
            ..
        }
    );
    refused!(
        |r, _| r[1].dist = ProposalDist::Top16(&over),
        VerifyError::TokenOutOfRange {
            row: 1,
            role: TokenRole::Candidate { column: 1, slot: 4 },
            token: 40,
            ..
        }
    );
    refused!(
        |r, _| r[1].proposals = &not_cand,
        VerifyError::QNotDistribution {
            fault: QFault::ProposalNotCandidate { token: 1 },
            ..
        }
    );
    refused!(
        |r, _| r[1].proposals = &bad_d,
        VerifyError::TokenOutOfRange {
            row: 1,
            role: TokenRole::Proposal(2),
            token: 45,
            ..
        }
    );
    refused!(
        |r, _| r[1].proposals = &tail_d,
        VerifyError::NonPublicToken {
            row: 1,
            role: TokenRole::Proposal(2),
            token: 35,
            ..
        }
    );
    refused!(
        |r, _| r[0].proposals = &big,
        VerifyError::TooManyProposals {
            row: 0,
            proposals: 4,
            max: 3
        }
    );
    refused!(
        |r, _| r[1].dist = ProposalDist::Top16(&short_q),
        VerifyError::QColumns {
            row: 1,
            proposals: 2,
            found: 1
        }
    );
    refused!(
        |r, _| r[0].dist = ProposalDist::OneHot,
        VerifyError::ProposalKind { row: 0, .. }
    );
    refused!(
        |r, _| r[0].anchor = 40,
        VerifyError::TokenOutOfRange {
            role: TokenRole::Anchor,
            ..
        }
    );
    refused!(
        |r, _| r[0].anchor = (r[0].anchor + 1) % 32,
        VerifyError::AnchorMismatch { row: 0, .. }
    );
    refused!(
        |r, _| r[1].frontier += 1,
        VerifyError::HistoryLength { row: 1, .. }
    );
    refused!(
        |r, _| r[1].frontier = u64::from(u32::MAX),
        VerifyError::FrontierTooLarge { row: 1, .. }
    );
    refused!(
        |r, _| r[1].history = &other_hist,
        VerifyError::HistoryVocab { row: 1, .. }
    );
    refused!(
        |r, _| r[0].settings.temperature = f32::NAN,
        VerifyError::BadSetting {
            setting: "temperature",
            ..
        }
    );
    refused!(
        |r, _| r[0].settings.top_p = 0.0,
        VerifyError::BadSetting {
            setting: "top_p",
            ..
        }
    );
    refused!(
        |r, _| r[0].settings.min_p = 1.0,
        VerifyError::BadSetting {
            setting: "min_p",
            ..
        }
    );
    refused!(
        |r, _| r[0].settings.top_k = -1,
        VerifyError::BadSetting {
            setting: "top_k",
            ..
        }
    );
    refused!(
        |r, _| r[0].settings.repetition_penalty = 0.0,
        VerifyError::BadSetting {
            setting: "repetition_penalty",
            ..
        }
    );
    refused!(
        |r, _| r[1].settings.frequency_penalty = f32::INFINITY,
        VerifyError::BadSetting {
            row: 1,
            setting: "frequency_penalty",
            ..
        }
    );
    // Logits: NaN or +inf in a live public entry; all public entries -inf.
    refused!(
        |_, l| l[(w + 2) * v + 5] = f32::NAN,
        VerifyError::BadLogit {
            row: 1,
            column: 2,
            token: 5,
            ..
        }
    );
    refused!(
        |_, l| l[3] = f32::INFINITY,
        VerifyError::BadLogit {
            row: 0,
            column: 0,
            token: 3,
            ..
        }
    );
    refused!(
        |_, l| l[v..v + pv].fill(f32::NEG_INFINITY),
        VerifyError::BadLogit {
            row: 0,
            column: 1,
            ..
        }
    );
    // An op-level refusal (processed logits overflow f32) is typed too.
    refused!(
        |r, l| {
            r[0].settings = SamplingSettings::sampling(1e-38);
            l[0] = 100.0;
        },
        VerifyError::Ops(_)
    );
    // Batch-level shapes.
    refused!(
        |r, _| r.push(r[0]),
        VerifyError::BatchTooLarge {
            rows: 3,
            max_rows: 2
        }
    );
    refused!(
        |_, l| {
            l.pop();
        },
        VerifyError::LogitsLength { .. }
    );

    // NaN where nothing reads it (non-public tail, dead column past Q) is not an error.
    let mut fx2 = bad_fixture();
    fx2.rows[0].props.truncate(1);
    fx2.rows[0].q.truncate(1);
    fx2.rows[0].logits[v - 1] = f32::NAN; // tail of column 0
    fx2.rows[0].logits[3 * v] = f32::NAN; // column 3 is dead (Q = 2)
    let mut ws2 = workspace(2, w, v, pv, ProposalKind::Top16);
    try_verify(&mut ws2, &fx2, |_, _| {}).expect("unread NaN is fine");

    // Workspace shapes.
    let be = Backend::cpu();
    let shape = VerifyShape {
        max_rows: 2,
        cols: 4,
        vocab_rows: 40,
        public_vocab: 32,
        kind: ProposalKind::OneHot,
    };
    for (bad, param) in [
        (
            VerifyShape {
                max_rows: 0,
                ..shape
            },
            "max_rows",
        ),
        (VerifyShape { cols: 0, ..shape }, "cols"),
        (VerifyShape { cols: 257, ..shape }, "cols"),
        (
            VerifyShape {
                vocab_rows: 0,
                public_vocab: 0,
                ..shape
            },
            "vocab_rows",
        ),
        (
            VerifyShape {
                public_vocab: 41,
                ..shape
            },
            "public_vocab",
        ),
        (
            VerifyShape {
                public_vocab: 0,
                ..shape
            },
            "public_vocab",
        ),
    ] {
        assert!(
            matches!(VerifyWorkspace::new(&be, bad), Err(VerifyError::Shape { param: p, .. }) if p == param),
            "{bad:?}"
        );
    }
    // An empty batch is fine.
    let mut ws3 = VerifyWorkspace::new(&be, shape).expect("workspace");
    let empty = be.upload::<f32>(&[]).expect("upload");
    assert!(
        ws3.verify(&be, &[], TargetLogits::padded(&empty))
            .expect("empty")
            .is_empty()
    );
}

// ---------------------------------------------------------------------------------------------
// Logits dtypes and layouts, live rows only.

/// Verify `rows` against logits built by `logits_of` (the rows' `[W, V]` logits in, the
/// buffer's f32 values out) in `layout`, as f32 or as the bf16 rounding of those values.
fn run_with_logits(
    ws: &mut VerifyWorkspace,
    rows: &[&MixedRow],
    kind: ProposalKind,
    layout: dflash_verify::LogitsLayout,
    bf16: bool,
    values: &[f32],
) -> Result<Vec<RoundOutcome>, VerifyError> {
    let be = Backend::cpu();
    let vr: Vec<VerifyRow<'_>> = rows
        .iter()
        .map(|r| VerifyRow {
            anchor: r.hist.last().expect("history"),
            proposals: &r.props,
            dist: match kind {
                ProposalKind::OneHot => ProposalDist::OneHot,
                ProposalKind::Top16 => ProposalDist::Top16(&r.q),
            },
            settings: r.s,
            seed: r.seed,
            frontier: r.hist.len() - 1,
            history: &r.hist,
        })
        .collect();
    let lf = be.upload(values).expect("upload");
    let rounded: Vec<dflash_ops::bf16> = values
        .iter()
        .map(|&x| dflash_ops::bf16::from_f32(x))
        .collect();
    let lb = be.upload(&rounded).expect("upload");
    let values = if bf16 {
        dflash_verify::Logits::Bf16(&lb)
    } else {
        dflash_verify::Logits::F32(&lf)
    };
    ws.verify(&be, &vr, TargetLogits { values, layout })
}

/// Padded `[n, W, V]` logits of `rows` (dead columns hold `dead`) and the packed logits of
/// their live columns.
fn padded_and_packed(rows: &[&MixedRow], v: usize, dead: f32) -> (Vec<f32>, Vec<f32>) {
    let (mut padded, mut packed) = (Vec::new(), Vec::new());
    for r in rows {
        let q = r.props.len() + 1;
        packed.extend_from_slice(&r.logits[..q * v]);
        padded.extend_from_slice(&r.logits[..q * v]);
        padded.extend(std::iter::repeat_n(dead, r.logits.len() - q * v));
    }
    (padded, packed)
}

#[test]
fn bf16_logits_verify_like_their_f32_widening() {
    use dflash_verify::LogitsLayout::{Packed, Padded};
    let (w, v, pv) = (6, 80, 70);
    for kind in [ProposalKind::OneHot, ProposalKind::Top16] {
        let rows = mixed_rows(7, w, v, pv, 123);
        let all: Vec<&MixedRow> = rows.iter().collect();
        let (padded, packed) = padded_and_packed(&all, v, 0.0);
        let widen = |x: &[f32]| -> Vec<f32> {
            x.iter()
                .map(|&l| dflash_ops::bf16::from_f32(l).to_f32())
                .collect()
        };
        assert!(
            widen(&padded).iter().zip(&padded).any(|(a, b)| a != b),
            "the rounding to bf16 changes the logits"
        );
        let mut ws = workspace(8, w, v, pv, kind);
        for (layout, values) in [(Padded, &padded), (Packed, &packed)] {
            let from_bf16 =
                run_with_logits(&mut ws, &all, kind, layout, true, values).expect("bf16");
            let widened =
                run_with_logits(&mut ws, &all, kind, layout, false, &widen(values)).expect("f32");
            assert_eq!(from_bf16, widened, "{kind:?}, {layout}");
            assert!(
                from_bf16.iter().any(|o| o.accepted() > 0),
                "fixture accepts"
            );
        }
    }
}

#[test]
fn packed_logits_verify_like_padded_logits() {
    use dflash_verify::LogitsLayout::{Packed, Padded};
    let (w, v, pv) = (6, 80, 70);
    for kind in [ProposalKind::OneHot, ProposalKind::Top16] {
        let rows = mixed_rows(8, w, v, pv, 321);
        let all: Vec<&MixedRow> = rows.iter().collect();
        assert!(
            all.iter().any(|r| r.props.len() + 1 < w),
            "some row has dead columns"
        );
        // Dead padded columns hold NaN: never read.
        let (padded, packed) = padded_and_packed(&all, v, f32::NAN);
        let mut ws = workspace(8, w, v, pv, kind);
        let base = run_mixed(&mut ws, &all, kind);
        for bf16 in [false, true] {
            let a = run_with_logits(&mut ws, &all, kind, Padded, bf16, &padded).expect("padded");
            let b = run_with_logits(&mut ws, &all, kind, Packed, bf16, &packed).expect("packed");
            assert_eq!(a, b, "{kind:?}, bf16 {bf16}");
            if !bf16 {
                assert_eq!(
                    a, base,
                    "{kind:?}: NaN in dead padded columns is never read"
                );
            }
        }
        // Every sub-batch, packed, gives each row its outcome of the full batch.
        for n in 1..=all.len() {
            let sub = &all[all.len() - n..];
            let (_, packed) = padded_and_packed(sub, v, 0.0);
            let got = run_with_logits(&mut ws, sub, kind, Packed, false, &packed).expect("sub");
            assert_eq!(
                got[..],
                base[all.len() - n..],
                "{kind:?}: last {n} rows packed"
            );
        }
    }
}

#[test]
fn logits_must_hold_every_live_column_in_their_layout() {
    use dflash_verify::LogitsLayout::{Packed, Padded};
    let (w, v, pv) = (6, 80, 70);
    let rows = mixed_rows(3, w, v, pv, 77);
    let all: Vec<&MixedRow> = rows.iter().collect();
    let (padded, packed) = padded_and_packed(&all, v, 0.0);
    let mut ws = workspace(4, w, v, pv, ProposalKind::OneHot);
    let good = run_with_logits(&mut ws, &all, ProposalKind::OneHot, Packed, false, &packed)
        .expect("packed");
    let refused = |ws: &mut VerifyWorkspace, layout, values: &[f32]| {
        let r = run_with_logits(ws, &all, ProposalKind::OneHot, layout, false, values);
        assert!(
            matches!(r, Err(VerifyError::LogitsLength { layout: l, .. }) if l == layout),
            "{layout}: {r:?}"
        );
    };
    refused(&mut ws, Packed, &packed[..packed.len() - v]); // one live column short
    refused(&mut ws, Packed, &packed[..packed.len() - 1]); // not whole columns
    refused(&mut ws, Padded, &padded[..padded.len() - w * v]); // one row short
    refused(&mut ws, Padded, &packed); // packed data passed as padded: not whole rows
    // A buffer planned for more (whole units) is fine: only the batch's columns are read.
    let mut longer = packed.clone();
    longer.extend(std::iter::repeat_n(f32::NAN, 2 * v));
    let got = run_with_logits(&mut ws, &all, ProposalKind::OneHot, Packed, false, &longer)
        .expect("longer packed");
    assert_eq!(got, good);
    let mut longer = padded.clone();
    longer.extend(std::iter::repeat_n(f32::NAN, w * v));
    let got = run_with_logits(&mut ws, &all, ProposalKind::OneHot, Padded, false, &longer)
        .expect("longer padded");
    assert_eq!(got, good);
    // The CPU checks of live logits follow the layout: NaN in row 1's first packed column.
    let mut bad = packed.clone();
    let first1 = all[0].props.len() + 1;
    bad[first1 * v + 2] = f32::NAN;
    let r = run_with_logits(&mut ws, &all, ProposalKind::OneHot, Packed, false, &bad);
    assert!(
        matches!(
            r,
            Err(VerifyError::BadLogit {
                row: 1,
                column: 0,
                token: 2,
                ..
            })
        ),
        "{r:?}"
    );
}

/// The workspace allocates everything in `new` (no padded logits copy: the Debug listing of
/// its fields has none) and a batch of any size `n <= B` leaves its device buffers as they
/// were planned, while each row gets the outcome it gets in any other batch.
#[test]
fn batches_of_every_size_run_on_their_rows_with_buffers_planned_once() {
    let (w, v, pv) = (5, 64, 60);
    for kind in [ProposalKind::OneHot, ProposalKind::Top16] {
        let shape = VerifyShape {
            max_rows: 8,
            cols: w,
            vocab_rows: v,
            public_vocab: pv,
            kind,
        };
        let mut ws = VerifyWorkspace::new(&Backend::cpu(), shape).expect("workspace");
        let planned = VerifyWorkspace::bytes(&shape);
        assert_eq!(ws.device_bytes(), planned);
        assert!(
            !format!("{ws:?}").contains("padded"),
            "no padded logits buffer"
        );
        let rows = mixed_rows(8, w, v, pv, 4242);
        let all: Vec<&MixedRow> = rows.iter().collect();
        let base = run_mixed(&mut ws, &all, kind);
        assert_eq!(ws.device_bytes(), planned);
        for n in (1..=8).rev() {
            let got = run_mixed(&mut ws, &all[8 - n..], kind);
            assert_eq!(got[..], base[8 - n..], "{kind:?}, n = {n}");
            assert_eq!(ws.device_bytes(), planned, "{kind:?}, n = {n}");
        }
    }
    // The plan: p and counts dominate; 8 x 16 x 248320 f32 for p is the official worst case.
    let official = VerifyShape {
        max_rows: 8,
        cols: 16,
        vocab_rows: 248_320,
        public_vocab: 248_077,
        kind: ProposalKind::Top16,
    };
    let bytes = VerifyWorkspace::bytes(&official);
    let p = 8 * 16 * 248_320 * 4;
    assert!(
        bytes > p && bytes < p + 8 * 248_320 * 4 + 100_000,
        "{bytes}"
    );
}

/// A device-resident verification (proposals, candidates and q left in device buffers laid
/// out as the draft writes them, `[rows, K]` and `[rows, K, 16]`, with spare rows past the
/// batch) gives exactly the host path's outcomes and returns the verified proposals; the
/// buffers' kind and length are checked first, a non-public proposal on the device is a
/// typed error at `wait`.
#[test]
fn device_proposals_verify_like_host_proposals() {
    let (w, v, pv) = (6, 80, 70);
    let k = w - 1;
    let be = Backend::cpu();
    for kind in [ProposalKind::OneHot, ProposalKind::Top16] {
        let rows = mixed_rows(5, w, v, pv, 1234);
        let refs: Vec<&MixedRow> = rows.iter().collect();
        let mut host_ws = workspace(8, w, v, pv, kind);
        let want = run_mixed(&mut host_ws, &refs, kind);
        // The draft's layout, one spare row (a padded bucket), junk past each row's P.
        let spare = rows.len() + 1;
        let (mut ids, mut cand, mut q) = (
            vec![7i32; spare * k],
            vec![0i32; spare * k * TOP],
            vec![0f32; spare * k * TOP],
        );
        for (r, row) in rows.iter().enumerate() {
            for (j, &d) in row.props.iter().enumerate() {
                ids[r * k + j] = d as i32;
                let rq = &row.q[j];
                for s in 0..TOP {
                    cand[(r * k + j) * TOP + s] = rq.ids[s] as i32;
                    q[(r * k + j) * TOP + s] = rq.q[s];
                }
            }
        }
        let (ids_b, cand_b, q_b) = (
            be.upload(&ids).expect("up"),
            be.upload(&cand).expect("up"),
            be.upload(&q).expect("up"),
        );
        let dp = dflash_verify::DeviceProposals {
            ids: &ids_b,
            top16: match kind {
                ProposalKind::OneHot => None,
                ProposalKind::Top16 => Some(dflash_verify::DeviceTop16 {
                    candidates: &cand_b,
                    q: &q_b,
                }),
            },
        };
        let drows: Vec<dflash_verify::DeviceRow<'_>> = rows
            .iter()
            .map(|r| dflash_verify::DeviceRow {
                anchor: r.hist.last().expect("history"),
                proposals: r.props.len(),
                settings: r.s,
                seed: r.seed,
                frontier: r.hist.len() - 1,
                history: &r.hist,
            })
            .collect();
        let logits: Vec<f32> = rows.iter().flat_map(|r| r.logits.iter().copied()).collect();
        let lb = be.upload(&logits).expect("up");
        let mut ws = workspace(8, w, v, pv, kind);
        let pending = ws
            .verify_device(&be, &drows, &dp, TargetLogits::padded(&lb))
            .expect("device verify");
        let (got, props) = pending.wait().expect("wait");
        assert_eq!(
            got, want,
            "{kind:?}: device proposals verify like host ones"
        );
        let want_props: Vec<Vec<u32>> = rows.iter().map(|r| r.props.clone()).collect();
        assert_eq!(props, want_props);
        // The wrong kind and short buffers are refused before anything runs.
        let other = dflash_verify::DeviceProposals {
            ids: &ids_b,
            top16: match kind {
                ProposalKind::OneHot => Some(dflash_verify::DeviceTop16 {
                    candidates: &cand_b,
                    q: &q_b,
                }),
                ProposalKind::Top16 => None,
            },
        };
        assert!(matches!(
            ws.verify_device(&be, &drows, &other, TargetLogits::padded(&lb)),
            Err(VerifyError::ProposalKind { .. })
        ));
        let short = be.upload(&ids[..rows.len() * k - 1]).expect("up");
        assert!(matches!(
            ws.verify_device(
                &be,
                &drows,
                &dflash_verify::DeviceProposals { ids: &short, ..dp },
                TargetLogits::padded(&lb)
            ),
            Err(VerifyError::DeviceProposals { tensor: "ids", .. })
        ));
        // A non-public id on the device (row 0 needs a proposal for the check to bite).
        if let Some(r) = rows.iter().position(|r| !r.props.is_empty()) {
            let mut bad = ids.clone();
            bad[r * k] = pv as i32 + 1;
            let bad_b = be.upload(&bad).expect("up");
            match ws.verify_device(
                &be,
                &drows,
                &dflash_verify::DeviceProposals { ids: &bad_b, ..dp },
                TargetLogits::padded(&lb),
            ) {
                // The CPU chain_accept checks its caller guarantee (the proposal among the
                // candidates) itself.
                Err(VerifyError::Ops(_)) => assert_eq!(kind, ProposalKind::Top16),
                Ok(pending) => assert!(matches!(
                    pending.wait(),
                    Err(VerifyError::NonPublicToken {
                        role: TokenRole::Proposal(1),
                        ..
                    })
                )),
                Err(other) => panic!("{other}"),
            }
        }
    }
}
