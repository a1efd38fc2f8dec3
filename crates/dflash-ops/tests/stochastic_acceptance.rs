//! Seeded, deterministic statistical test: chain stochastic acceptance with residual correction
//! (`chain_accept`) reproduces the processed target distribution (`target_distribution`), for
//! one-hot q (DFlash) and non-degenerate top-16 q (DFlash2), at temperatures 0.7 and 1.3 with
//! top-k, top-p, min-p and all three penalties active; and the same statistic rejects
//! deliberately wrong variants of the rule (the y1 statistic must reject each of them; the
//! joint statistic, whose cells dilute the same bias, must at least grow).
//!
//! Procedure (per configuration): N = 20000 independent trajectories (distinct request seeds).
//! Round 1 verifies a 2-proposal chain (cols = 3). If it emits at least two tokens, `(y1, y2)`
//! are its first two outputs; otherwise a second round with anchor `y1` (history + y1) and
//! `P = 0` draws `y2` from its bonus. The target law is `p0(y1) * p1(y2 | history + y1)`,
//! computed with `target_distribution` itself. Statistic: Pearson chi-square over cells with
//! expected count >= 10 (the rest pooled into one cell), plus: any draw in a cell of
//! probability exactly 0 fails at once. Threshold: the chi-square quantile at false-failure
//! probability 1e-6 per statistic (Wilson-Hilferty with z = 4.7534). Eight correct-variant
//! statistics are asserted, so the family-wise false-failure probability of a fresh seed is
//! below 1e-5; the seeds are fixed, so the test is deterministic.

use dflash_ops::Backend;
use dflash_ops::chain_accept::{self, Outputs, Proposal};
use dflash_ops::rng::{Purpose, uniform};
use dflash_ops::target_distribution::{self, SamplingBuffers, Settings};

const V: usize = 20;
const PUBLIC: usize = 18;
const N: usize = 20_000;
const F: u64 = 1000;

fn logits(pos: usize) -> Vec<f32> {
    // Deterministic, position-dependent; tokens 18, 19 (non-public) are the strongest.
    (0..V)
        .map(|v| {
            if v >= PUBLIC {
                9.0
            } else {
                (((v * 7 + pos * 5) % 11) as f32) * 0.35 - 1.2 + if v == 4 { 1.0 } else { 0.0 }
            }
        })
        .collect()
}

fn base_counts() -> Vec<i32> {
    let mut c = vec![0; V];
    c[1] = 2;
    c[5] = 1;
    c[9] = 3;
    c[18] = 4;
    c
}

fn settings(temperature: f32) -> Settings {
    Settings {
        temperature,
        top_k: 12,
        top_p: 0.93,
        min_p: 0.03,
        repetition_penalty: 1.15,
        frequency_penalty: 0.05,
        presence_penalty: 0.1,
    }
}

/// p for `rows` rows of `cols` columns with per-row proposals and counts.
fn target(
    be: &Backend,
    rows: usize,
    cols: usize,
    counts: &[i32],
    proposals: &[i32],
    s: Settings,
) -> Vec<f32> {
    let mut lg = Vec::with_capacity(rows * cols * V);
    for _ in 0..rows {
        for i in 0..cols {
            lg.extend(logits(i));
        }
    }
    let sb = SamplingBuffers::upload(be, &vec![s; rows]).expect("settings");
    let mut p = be.zeros::<f32>(rows * cols * V).expect("alloc");
    target_distribution::run(
        be,
        &be.upload(&lg).expect("up"),
        &be.upload(&vec![cols as i32; rows]).expect("up"),
        &be.upload(counts).expect("up"),
        &be.upload(proposals).expect("up"),
        &sb.view(),
        &mut p,
        &target_distribution::Params {
            rows,
            cols,
            vocab: V,
            public_vocab: PUBLIC,
        },
    )
    .expect("target_distribution");
    be.download(&p).expect("dl")
}

/// Shifted-logit targets for round 2: column 0 predicts the position after y1, so use the
/// logits of column 1.
fn target_round2(be: &Backend, y1: &[usize], s: Settings) -> Vec<f32> {
    let rows = y1.len();
    let mut counts = Vec::with_capacity(rows * V);
    let mut lg = Vec::with_capacity(rows * V);
    for &y in y1 {
        let mut c = base_counts();
        c[y] += 1;
        counts.extend(c);
        lg.extend(logits(1));
    }
    let sb = SamplingBuffers::upload(be, &vec![s; rows]).expect("settings");
    let mut p = be.zeros::<f32>(rows * V).expect("alloc");
    target_distribution::run(
        be,
        &be.upload(&lg).expect("up"),
        &be.upload(&vec![1; rows]).expect("up"),
        &be.upload(&counts).expect("up"),
        &be.upload(&[]).expect("up"),
        &sb.view(),
        &mut p,
        &target_distribution::Params {
            rows,
            cols: 1,
            vocab: V,
            public_vocab: PUBLIC,
        },
    )
    .expect("target_distribution");
    be.download(&p).expect("dl")
}

/// The draft: DFlash proposes a point mass (its q is one-hot) from a draft distribution that
/// differs from p; DFlash2 draws from a soft top-16 q that depends on the previous proposal.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Draft {
    OneHot,
    Top16,
}

/// Draft q of column i given the previous token: (ids, q).
fn draft_q(i: usize, prev: usize) -> (Vec<i32>, Vec<f32>) {
    let ids: Vec<i32> = (0..16)
        .map(|s| ((s + prev + 3 * i) % PUBLIC) as i32)
        .collect();
    let w: Vec<f64> = (0..16)
        .map(|s| (-0.25 * ((s * 5 + i) % 9) as f64).exp())
        .collect();
    let t: f64 = w.iter().sum();
    (ids, w.iter().map(|x| (x / t) as f32).collect())
}

fn inverse_cdf(w: &[f64], u: f32) -> usize {
    let t: f64 = w.iter().sum();
    let target = f64::from(u) * t;
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

/// One round-1 batch: proposals and top-16 q (for DFlash2).
struct Batch {
    proposals: Vec<i32>,
    q: Vec<f32>,
    ids: Vec<i32>,
}

fn draft(kind: Draft, seeds: &[u64]) -> Batch {
    let mut b = Batch {
        proposals: Vec::new(),
        q: Vec::new(),
        ids: Vec::new(),
    };
    for &s in seeds {
        let mut prev = 4; // the anchor
        for i in 0..2 {
            let (ids, q) = draft_q(i, prev);
            let u = uniform(s, F + i as u64, Purpose::Dflash2Proposal, 0);
            let slot = inverse_cdf(&q.iter().map(|&x| f64::from(x)).collect::<Vec<_>>(), u);
            let d = ids[slot] as usize;
            b.proposals.push(d as i32);
            b.q.extend(&q);
            b.ids.extend(&ids);
            prev = d;
        }
    }
    if kind == Draft::OneHot {
        b.q.clear();
        b.ids.clear();
    }
    b
}

/// The variants of the verification rule: the op, and wrong ones written here.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Rule {
    /// `chain_accept::run` (the op under test).
    Op,
    /// Wrong: the correction is drawn from p instead of the residual max(p - q, 0).
    CorrectionFromP,
    /// Wrong: accept with probability min(1, p(x)) ignoring q(x) (a DFlash rule applied to
    /// DFlash2 proposals).
    IgnoreQInAcceptance,
}

/// Wrong chain rules, plain f64, same RNG draws as the op.
fn wrong_chain(rule: Rule, p: &[f32], d: &[i32], q: &[Vec<f64>], seed: u64) -> Vec<i32> {
    let col = |i: usize| -> Vec<f64> {
        p[i * V..(i + 1) * V]
            .iter()
            .map(|&x| f64::from(x))
            .collect()
    };
    let mut out = Vec::new();
    for i in 0..2 {
        let x = d[i] as usize;
        let pi = col(i);
        let u = uniform(seed, F + 1 + i as u64, Purpose::Accept, 0);
        let qx = if rule == Rule::IgnoreQInAcceptance {
            1.0
        } else {
            q[i][x]
        };
        if f64::from(u) * qx < pi[x] {
            out.push(x as i32);
            continue;
        }
        let u = uniform(seed, F + 1 + i as u64, Purpose::Correction, 0);
        let w: Vec<f64> = if rule == Rule::CorrectionFromP {
            pi.clone()
        } else {
            pi.iter()
                .zip(&q[i])
                .map(|(a, b)| (a - b).max(0.0))
                .collect()
        };
        out.push(inverse_cdf(&w, u) as i32);
        return out;
    }
    let u = uniform(seed, F + 3, Purpose::Bonus, 0);
    out.push(inverse_cdf(&col(2), u) as i32);
    out
}

/// Draw (y1, y2) for every seed with `rule`.
fn sample(
    be: &Backend,
    kind: Draft,
    rule: Rule,
    s: Settings,
    seeds: &[u64],
) -> Vec<(usize, usize)> {
    let rows = seeds.len();
    let b = draft(kind, seeds);
    let counts: Vec<i32> = (0..rows).flat_map(|_| base_counts()).collect();
    let p = target(be, rows, 3, &counts, &b.proposals, s);
    let mut first: Vec<Vec<i32>> = Vec::with_capacity(rows);
    if rule == Rule::Op {
        let seed_words: Vec<i32> = seeds
            .iter()
            .flat_map(|&x| [x as u32 as i32, (x >> 32) as u32 as i32])
            .collect();
        let qb = be.upload(&b.q).expect("up");
        let ib = be.upload(&b.ids).expect("up");
        let proposal = match kind {
            Draft::OneHot => Proposal::OneHot,
            Draft::Top16 => Proposal::Top16 { q: &qb, ids: &ib },
        };
        let mut acc = be.zeros::<i32>(rows).expect("alloc");
        let mut toks = be.zeros::<i32>(rows * 3).expect("alloc");
        let mut len = be.zeros::<i32>(rows).expect("alloc");
        chain_accept::run(
            be,
            &be.upload(&p).expect("up"),
            &be.upload(&b.proposals).expect("up"),
            &be.upload(&vec![3; rows]).expect("up"),
            proposal,
            &be.upload(&seed_words).expect("up"),
            &be.upload(&vec![F as i32; rows]).expect("up"),
            Outputs {
                accepted: &mut acc,
                out_tokens: &mut toks,
                out_len: &mut len,
            },
            &chain_accept::Params {
                rows,
                cols: 3,
                vocab: V,
            },
        )
        .expect("chain_accept");
        let toks = be.download(&toks).expect("dl");
        let len = be.download(&len).expect("dl");
        for r in 0..rows {
            first.push(toks[r * 3..r * 3 + len[r] as usize].to_vec());
        }
    } else {
        for r in 0..rows {
            let q: Vec<Vec<f64>> = (0..2)
                .map(|i| {
                    let mut qd = vec![0f64; V];
                    match kind {
                        Draft::OneHot => qd[b.proposals[r * 2 + i] as usize] = 1.0,
                        Draft::Top16 => {
                            for s in 0..16 {
                                let k = (r * 2 + i) * 16 + s;
                                qd[b.ids[k] as usize] = f64::from(b.q[k]);
                            }
                        }
                    }
                    qd
                })
                .collect();
            let pr = &p[r * 3 * V..(r + 1) * 3 * V];
            first.push(wrong_chain(
                rule,
                pr,
                &b.proposals[r * 2..r * 2 + 2],
                &q,
                seeds[r],
            ));
        }
    }
    // Round 2 for the rows that emitted a single token: anchor y1 at F+1, P = 0.
    let short: Vec<usize> = (0..rows).filter(|&r| first[r].len() < 2).collect();
    let y1s: Vec<usize> = short.iter().map(|&r| first[r][0] as usize).collect();
    let mut y2 = vec![0usize; rows];
    if !short.is_empty() {
        let p2 = target_round2(be, &y1s, s);
        for (k, &r) in short.iter().enumerate() {
            let col: Vec<f64> = p2[k * V..(k + 1) * V]
                .iter()
                .map(|&x| f64::from(x))
                .collect();
            // The op with P = 0 draws the bonus at F+2 by the same inverse CDF; use the op.
            let be2 = Backend::cpu();
            let mut acc = be2.zeros::<i32>(1).expect("alloc");
            let mut toks = be2.zeros::<i32>(1).expect("alloc");
            let mut len = be2.zeros::<i32>(1).expect("alloc");
            let sw = [seeds[r] as u32 as i32, (seeds[r] >> 32) as u32 as i32];
            chain_accept::run(
                &be2,
                &be2.upload(&p2[k * V..(k + 1) * V]).expect("up"),
                &be2.upload(&[]).expect("up"),
                &be2.upload(&[1]).expect("up"),
                Proposal::OneHot,
                &be2.upload(&sw).expect("up"),
                &be2.upload(&[F as i32 + 1]).expect("up"),
                Outputs {
                    accepted: &mut acc,
                    out_tokens: &mut toks,
                    out_len: &mut len,
                },
                &chain_accept::Params {
                    rows: 1,
                    cols: 1,
                    vocab: V,
                },
            )
            .expect("round 2");
            let t = be2.download(&toks).expect("dl")[0] as usize;
            assert!(col[t] > 0.0, "round 2 drew a zero-probability token");
            y2[r] = t;
        }
    }
    (0..rows)
        .map(|r| {
            let y1 = first[r][0] as usize;
            let y2 = if first[r].len() >= 2 {
                first[r][1] as usize
            } else {
                y2[r]
            };
            (y1, y2)
        })
        .collect()
}

/// Chi-square quantile at upper tail 1e-6 (Wilson-Hilferty).
fn chi2_threshold(df: usize) -> f64 {
    let k = df as f64;
    let z = 4.7534;
    let a = 2.0 / (9.0 * k);
    k * (1.0 - a + z * a.sqrt()).powi(3)
}

/// Pearson chi-square with pooling of cells below 10 expected; `Err` if a draw landed in a
/// cell of probability 0. Returns (statistic, threshold).
fn chi_square(counts: &[usize], probs: &[f64], n: usize) -> Result<(f64, f64), String> {
    let mut stat = 0.0;
    let mut cells = 0usize;
    let (mut pooled_o, mut pooled_e) = (0usize, 0f64);
    for (i, (&o, &p)) in counts.iter().zip(probs).enumerate() {
        if p == 0.0 {
            if o > 0 {
                return Err(format!("{o} draws in zero-probability cell {i}"));
            }
            continue;
        }
        let e = p * n as f64;
        if e < 10.0 {
            pooled_o += o;
            pooled_e += e;
            continue;
        }
        stat += (o as f64 - e).powi(2) / e;
        cells += 1;
    }
    if pooled_e > 0.0 {
        stat += (pooled_o as f64 - pooled_e).powi(2) / pooled_e.max(1e-12);
        cells += 1;
    }
    Ok((stat, chi2_threshold(cells.saturating_sub(1).max(1))))
}

/// A chi-square outcome: `Ok((statistic, threshold))`, or `Err` on an impossible draw.
type Outcome = Result<(f64, f64), String>;

/// (y1 statistic, joint statistic): `Ok((stat, threshold))` each, or `Err` on an impossible draw.
fn statistics(be: &Backend, draws: &[(usize, usize)], s: Settings) -> (Outcome, Outcome) {
    let p0: Vec<f64> = target(be, 1, 1, &base_counts(), &[], s)
        .iter()
        .map(|&x| f64::from(x))
        .collect();
    let p1 = target_round2(be, &(0..V).collect::<Vec<_>>(), s);
    let mut c1 = vec![0usize; V];
    let mut cj = vec![0usize; V * V];
    for &(a, b) in draws {
        c1[a] += 1;
        cj[a * V + b] += 1;
    }
    let joint: Vec<f64> = (0..V * V)
        .map(|k| p0[k / V] * f64::from(p1[(k / V) * V + k % V]))
        .collect();
    (
        chi_square(&c1, &p0, draws.len()),
        chi_square(&cj, &joint, draws.len()),
    )
}

fn seeds(config: u64) -> Vec<u64> {
    (0..N as u64)
        .map(|i| (config << 40) ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .collect()
}

fn passes(r: &Result<(f64, f64), String>) -> bool {
    matches!(r, Ok((stat, thr)) if stat <= thr)
}

fn check(kind: Draft, temperature: f32, wrong: Rule, config: u64) {
    let be = Backend::cpu();
    let s = settings(temperature);
    let sd = seeds(config);
    let good = sample(&be, kind, Rule::Op, s, &sd);
    let (y1, joint) = statistics(&be, &good, s);
    assert!(passes(&y1), "{kind:?} T={temperature}: y1 {y1:?}");
    assert!(passes(&joint), "{kind:?} T={temperature}: joint {joint:?}");
    let bad = sample(&be, kind, wrong, s, &sd);
    let (y1w, jointw) = statistics(&be, &bad, s);
    assert!(
        !passes(&y1w),
        "{kind:?} T={temperature}: {wrong:?} not rejected by y1: {y1w:?}"
    );
    // The joint statistic spreads the same bias over ~100 cells, so it is only required to
    // grow (or to reject outright).
    let grows = match (&joint, &jointw) {
        (Ok((good, _)), Ok((bad, _))) => bad > good,
        _ => jointw.is_err(),
    };
    assert!(
        grows || !passes(&jointw),
        "{kind:?} T={temperature}: {wrong:?} joint {jointw:?} vs correct {joint:?}"
    );
}

#[test]
fn dflash_one_hot_q_reproduces_the_target_at_t07_and_a_p_correction_fails() {
    check(Draft::OneHot, 0.7, Rule::CorrectionFromP, 1);
}

#[test]
fn dflash_one_hot_q_reproduces_the_target_at_t13_and_a_p_correction_fails() {
    check(Draft::OneHot, 1.3, Rule::CorrectionFromP, 2);
}

#[test]
fn dflash2_top16_q_reproduces_the_target_at_t07_and_ignoring_q_fails() {
    check(Draft::Top16, 0.7, Rule::IgnoreQInAcceptance, 3);
}

#[test]
fn dflash2_top16_q_reproduces_the_target_at_t13_and_a_p_correction_fails() {
    check(Draft::Top16, 1.3, Rule::CorrectionFromP, 4);
}

#[test]
fn greedy_target_makes_the_chain_exactly_greedy() {
    // T = 0 with penalties: every trajectory emits the penalized argmax path.
    let be = Backend::cpu();
    let s = Settings {
        temperature: 0.0,
        ..settings(1.0)
    };
    for kind in [Draft::OneHot, Draft::Top16] {
        let draws = sample(&be, kind, Rule::Op, s, &seeds(9)[..500]);
        let p0 = target(&be, 1, 1, &base_counts(), &[], s);
        let a = p0.iter().position(|&x| x == 1.0).expect("one-hot");
        let p1 = target_round2(&be, &[a], s);
        let b = p1.iter().position(|&x| x == 1.0).expect("one-hot");
        assert!(
            draws.iter().all(|&d| d == (a, b)),
            "{kind:?}: {:?}",
            &draws[..5]
        );
    }
}
