use super::*;
use crate::rng::{Purpose, uniform};
use proptest::prelude::*;

fn bf(x: f32) -> bf16 {
    bf16::from_f32(x)
}

/// Run the op on the CPU from host data; returns (proposals, q, chosen).
fn select(f: &Fixture) -> Result<(Vec<i32>, Vec<f32>, Vec<i32>)> {
    let be = Backend::cpu();
    let p = f.p;
    let (g, cand, unary) = (be.upload(&f.g)?, be.upload(&f.cand)?, be.upload(&f.unary)?);
    let (wp, ws) = (be.upload(&f.w_pred)?, be.upload(&f.w_succ)?);
    let (an, se, st) = (
        be.upload(&f.anchors)?,
        be.upload(&f.seeds)?,
        be.upload(&f.start)?,
    );
    let te = be.upload(&f.temp)?;
    let mut pr = be.filled(p.rows * p.k, i32::POISON)?;
    let mut q = be.filled(p.rows * p.k * TOP_K, f32::POISON)?;
    let mut ch = be.filled(p.rows * p.k, i32::POISON)?;
    let inputs = Inputs {
        g: &g,
        cand_ids: &cand,
        unary: &unary,
        w_pred: &wp,
        w_succ: &ws,
        anchors: &an,
        seeds: &se,
        start_pos: &st,
        temperature: &te,
    };
    let mut out = Outputs {
        proposals: &mut pr,
        q: &mut q,
        chosen: &mut ch,
    };
    let r = run(&be, &inputs, &mut out, &p);
    let got = (be.download(&pr)?, be.download(&q)?, be.download(&ch)?);
    r.map(|()| got)
}

/// The hand-computable table fixture: R = 4, vocab 10, g = 1, W_pred[v] = one-hot(v % 4),
/// W_succ[v][r] = 0.25 * ((v + r) % 4). So with predecessor v the edge term of candidate c is
/// 0.25 * ((c + v) % 4), and E = that + u. All values are exact in BF16/F32.
fn table(rows: usize, k: usize) -> Fixture {
    let (rank, vocab) = (4, 10);
    let mut w_pred = vec![bf(0.0); vocab * rank];
    let mut w_succ = vec![bf(0.0); vocab * rank];
    for v in 0..vocab {
        w_pred[v * rank + v % 4] = bf(1.0);
        for r in 0..rank {
            w_succ[v * rank + r] = bf(0.25 * ((v + r) % 4) as f32);
        }
    }
    let cand: Vec<i32> = (0..rows * k).flat_map(|_| (0..10).chain(0..6)).collect();
    let unary: Vec<f32> = (0..rows * k)
        .flat_map(|_| (0..16).map(|c| -0.0625 * c as f32))
        .collect();
    Fixture {
        p: Params {
            rows,
            k,
            rank,
            vocab,
        },
        g: vec![bf(1.0); rows * k * rank],
        cand,
        unary,
        w_pred,
        w_succ,
        anchors: vec![1; rows],
        seeds: [7, 0].repeat(rows),
        start: vec![100; rows],
        temp: vec![0.0; rows],
    }
}

#[test]
fn hand_computed_greedy_walk() {
    // Step 0, predecessor 1: E[c] = 0.25*((C+1)%4) - c/16 = [.25, .4375, .625, -.1875, 0,
    // .1875, .375, ...] -> rank 2 (id 2). Step 1, predecessor 2: E = [.5, .6875, -.125,
    // .0625, .25, .4375, ...] -> rank 1 (id 1). Step 2, predecessor 1 again -> rank 2 (id 2).
    let (pr, q, ch) = select(&table(1, 3)).expect("run");
    assert_eq!(pr, vec![2, 1, 2]);
    assert_eq!(ch, vec![2, 1, 2]);
    for (i, &j) in ch.iter().enumerate() {
        for c in 0..TOP_K {
            let want: f32 = if c == j as usize { 1.0 } else { 0.0 };
            assert_eq!(
                q[i * TOP_K + c].to_bits(),
                want.to_bits(),
                "q one-hot exactly"
            );
        }
    }
}

#[test]
fn greedy_ties_go_to_the_lowest_rank_not_the_lowest_id() {
    // Swap ids at ranks 2 and 6 (both have edge term .75 after predecessor 1) and lift
    // u[6] so E[2] = .75 - .125 = E[6] = .75 - .125: rank 2 (id 6) must win over rank 6 (id 2).
    let mut f = table(1, 1);
    f.cand.swap(2, 6);
    f.unary[6] = -0.125;
    let (pr, _, ch) = select(&f).expect("run");
    assert_eq!((pr[0], ch[0]), (6, 2));
}

/// Independent f64 edge scores of one step.
fn e64(f: &Fixture, b: usize, i: usize, pred: usize) -> Vec<f64> {
    let (k, rank) = (f.p.k, f.p.rank);
    let col = b * k + i;
    (0..TOP_K)
        .map(|c| {
            let v = f.cand[col * TOP_K + c] as usize;
            let dot: f64 = (0..rank)
                .map(|r| {
                    f64::from(f.g[col * rank + r].to_f32())
                        * f64::from(f.w_pred[pred * rank + r].to_f32())
                        * f64::from(f.w_succ[v * rank + r].to_f32())
                })
                .sum();
            dot + f64::from(f.unary[col * TOP_K + c])
        })
        .collect()
}

#[test]
fn the_walk_uses_the_actual_selected_predecessor_not_the_global_optimum() {
    // Step 0 (predecessor = anchor 1): rank 0 id 2 (E .75), rank 1 id 4 (E .625), rest -10.
    // Step 1: rank 0 id 3, rank 1 id 2, rank 2 id 1, u = [-1/16, 0, -1/2, -10...].
    //   after id 2 (r* = 2): E = [.1875, 0, .25]   -> rank 2 (id 1)   path total 1.0
    //   after id 4 (r* = 0): E = [.6875, .5, -.25] -> rank 0 (id 3)   path total 1.3125
    //   after the anchor 1 (r* = 1): E = [-.0625, .75, 0] -> rank 1 (id 2)
    // The global optimum is [4, 3]; the conditional walk must give [2, 1].
    let mut f = table(1, 2);
    f.cand[..3].copy_from_slice(&[2, 4, 0]);
    f.unary[..16].copy_from_slice(&[&[0.0, 0.375][..], &[-10.0; 14][..]].concat());
    f.cand[16..19].copy_from_slice(&[3, 2, 1]);
    f.unary[16..32].copy_from_slice(&[&[-0.0625, 0.0, -0.5][..], &[-10.0; 13][..]].concat());
    let (pr, _, ch) = select(&f).expect("run");
    assert_eq!(pr, vec![2, 1]);
    assert_eq!(ch, vec![0, 2]);
    // Brute-force global optimum over all 16 x 16 paths (f64), to prove the fixture's point.
    let mut best = (f64::NEG_INFINITY, 0, 0);
    let e0 = e64(&f, 0, 0, 1);
    for (j0, s0) in e0.iter().enumerate() {
        let e1 = e64(&f, 0, 1, f.cand[j0] as usize);
        for (j1, s1) in e1.iter().enumerate() {
            if s0 + s1 > best.0 {
                best = (s0 + s1, f.cand[j0], f.cand[16 + j1]);
            }
        }
    }
    assert_eq!(
        (best.1, best.2),
        (4, 3),
        "global optimum differs from the walk"
    );
}

/// The inverse-CDF rank for uniform `u` over `q` in rank order with F32 prefix sums.
fn icdf(q: &[f32], u: f32) -> usize {
    let mut cum = 0f32;
    for (c, &x) in q.iter().enumerate() {
        cum += x;
        if u < cum {
            return c;
        }
    }
    TOP_K - 1
}

#[test]
fn sampled_q_is_the_f32_softmax_and_the_draw_follows_it() {
    // Table fixture at T = 0.5, 15 steps: every step's q is checked against an f64 softmax,
    // sums to 1 within 1e-6, and the chosen rank is the inverse CDF of the stored q at
    // uniform(seed, F + i, Dflash2Proposal, 0).
    let mut f = table(1, 15);
    f.temp = vec![0.5];
    f.seeds = vec![0x1234_5678, 0x0bad_cafe];
    let (pr, q, ch) = select(&f).expect("run");
    let mut pred = 1usize;
    for i in 0..15 {
        let qi = &q[i * TOP_K..][..TOP_K];
        let e = e64(&f, 0, i, pred);
        let m = e.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = e.iter().map(|x| ((x - m) / 0.5).exp()).collect();
        let s: f64 = w.iter().sum();
        for c in 0..TOP_K {
            assert!(
                (f64::from(qi[c]) - w[c] / s).abs() < 1e-6,
                "step {i} rank {c}"
            );
        }
        let sum: f64 = qi.iter().map(|&x| f64::from(x)).sum();
        assert!((sum - 1.0).abs() < 1e-6, "step {i}: sum {sum}");
        let seed = 0x0bad_cafe_1234_5678_u64;
        let u = uniform(seed, 100 + i as u64, Purpose::Dflash2Proposal, 0);
        assert_eq!(ch[i] as usize, icdf(qi, u), "step {i}");
        assert_eq!(pr[i], f.cand[i * TOP_K + ch[i] as usize]);
        pred = pr[i] as usize;
    }
    let distinct: std::collections::BTreeSet<i32> = ch.iter().copied().collect();
    assert!(distinct.len() >= 3, "the draws are not degenerate: {ch:?}");
}

/// Seeded frequency test. 60000 rows share one step's data (so q is the same for all) and
/// differ only in seed (row b: seed 1000 + b) and frontier. Each rank's count is Binomial(N,
/// q_c); the test allows 5 standard deviations (+1 for discreteness) per rank. False-failure
/// probability (normal approximation): 16 * P(|Z| > 5) < 1e-5, and the seeds are fixed, so
/// the outcome is deterministic. The same counts must reject a uniform q (power check).
#[test]
fn draw_frequencies_follow_q() {
    let n = 60_000;
    let mut f = table(n, 1);
    f.temp = vec![1.0; n];
    f.seeds = (0..n).flat_map(|b| [1000 + b as i32, 0]).collect();
    f.start = (0..n).map(|b| (b % 977) as i32).collect();
    let (_, q, ch) = select(&f).expect("run");
    let q0 = &q[..TOP_K];
    assert!(q.chunks_exact(TOP_K).all(|x| x == q0), "same data, same q");
    let mut counts = [0usize; TOP_K];
    for &j in &ch {
        counts[j as usize] += 1;
    }
    let nf = n as f64;
    let mut chi_uniform = 0.0;
    for c in 0..TOP_K {
        let p = f64::from(q0[c]);
        let sd = (nf * p * (1.0 - p)).sqrt();
        let dev = (counts[c] as f64 - nf * p).abs();
        assert!(
            dev <= 5.0 * sd + 1.0,
            "rank {c}: count {} expected {}",
            counts[c],
            nf * p
        );
        let e = nf / TOP_K as f64;
        chi_uniform += (counts[c] as f64 - e).powi(2) / e;
    }
    assert!(
        chi_uniform > 1000.0,
        "q is far from uniform, the test has power"
    );
}

#[test]
fn the_draw_depends_on_seed_and_position_not_on_the_row() {
    // Six different rows; running them in a permuted order permutes every output.
    let base = fixture(
        Params {
            rows: 6,
            k: 5,
            rank: 12,
            vocab: 40,
        },
        &[1.0, 0.6, 0.0, 2.0],
        99,
    );
    let (pr, q, ch) = select(&base).expect("run");
    let perm = [3usize, 0, 5, 1, 4, 2];
    let mut f = base.clone();
    let (k, rank) = (5, 12);
    for (to, &from) in perm.iter().enumerate() {
        f.g[to * k * rank..][..k * rank].copy_from_slice(&base.g[from * k * rank..][..k * rank]);
        f.cand[to * k * 16..][..k * 16].copy_from_slice(&base.cand[from * k * 16..][..k * 16]);
        f.unary[to * k * 16..][..k * 16].copy_from_slice(&base.unary[from * k * 16..][..k * 16]);
        f.anchors[to] = base.anchors[from];
        f.seeds[2 * to..2 * to + 2].copy_from_slice(&base.seeds[2 * from..2 * from + 2]);
        f.start[to] = base.start[from];
        f.temp[to] = base.temp[from];
    }
    let (pr2, q2, ch2) = select(&f).expect("run");
    for (to, &from) in perm.iter().enumerate() {
        assert_eq!(pr2[to * k..][..k], pr[from * k..][..k]);
        assert_eq!(ch2[to * k..][..k], ch[from * k..][..k]);
        assert_eq!(q2[to * k * 16..][..k * 16], q[from * k * 16..][..k * 16]);
    }
    // With step data independent of the predecessor (all W_pred rows equal), the draw of step
    // i at frontier F equals the draw of step i-1 at frontier F+1: the counter is F+i.
    let mut f = table(2, 8);
    f.w_pred = vec![bf(0.5); f.w_pred.len()];
    f.temp = vec![1.0, 1.0];
    f.start = vec![500, 501];
    let (_, _, ch) = select(&f).expect("run");
    assert_eq!(ch[1..8], ch[8..15], "row F step i == row F+1 step i-1");
    let distinct: std::collections::BTreeSet<i32> = ch.iter().copied().collect();
    assert!(distinct.len() >= 2, "non-degenerate draws: {ch:?}");
}

#[test]
fn bad_values_are_refused_and_nothing_is_written() {
    let base = table(2, 2);
    type Mutation = Box<dyn Fn(&mut Fixture)>;
    let cases: Vec<(Mutation, &str, usize)> = vec![
        (Box::new(|f| f.cand[20] = 10), "cand_ids", 20),
        (Box::new(|f| f.cand[3] = -1), "cand_ids", 3),
        (Box::new(|f| f.anchors[1] = 10), "anchors", 1),
        (Box::new(|f| f.start[1] = -5), "start_pos", 1),
        (Box::new(|f| f.temp[0] = f32::NAN), "temperature", 0),
        (Box::new(|f| f.unary[40] = f32::INFINITY), "unary", 40),
        // An infinite g entry on row 1 step 0 (g = 1 with W_pred one-hot at r = 1 for the
        // anchor 1) makes every edge score of that step infinite: flat index (1*2+0)*16.
        (
            Box::new(|f| f.g[2 * 4 + 1] = bf(f32::INFINITY)),
            "edge_scores",
            32,
        ),
    ];
    for (mutate, tensor, index) in cases {
        let mut f = base.clone();
        mutate(&mut f);
        let be = Backend::cpu();
        let e = select(&f).expect_err(tensor);
        assert!(
            matches!(&e, OpsError::Value { tensor: t, index: i, .. } if *t == tensor && *i == index),
            "{tensor}: {e}"
        );
        let _ = be;
    }
    // `select` returns the outputs only on success; check untouched outputs directly too.
    let mut f = base.clone();
    f.cand[31] = 99;
    let be = Backend::cpu();
    let up = |x: &[i32]| be.upload(x).expect("upload");
    let (g, unary) = (be.upload(&f.g).expect("u"), be.upload(&f.unary).expect("u"));
    let (wp, ws) = (
        be.upload(&f.w_pred).expect("u"),
        be.upload(&f.w_succ).expect("u"),
    );
    let (cand, an, se, st) = (up(&f.cand), up(&f.anchors), up(&f.seeds), up(&f.start));
    let te = be.upload(&f.temp).expect("u");
    let mut pr = be.filled(4, i32::POISON).expect("a");
    let mut q = be.filled(64, f32::POISON).expect("a");
    let mut ch = be.filled(4, i32::POISON).expect("a");
    let inputs = Inputs {
        g: &g,
        cand_ids: &cand,
        unary: &unary,
        w_pred: &wp,
        w_succ: &ws,
        anchors: &an,
        seeds: &se,
        start_pos: &st,
        temperature: &te,
    };
    let mut out = Outputs {
        proposals: &mut pr,
        q: &mut q,
        chosen: &mut ch,
    };
    assert!(run(&be, &inputs, &mut out, &f.p).is_err());
    let p = f.p;
    // Shape errors: R mismatch (g built for R = 4, params say 5) and a short q.
    let e = run(&be, &inputs, &mut out, &Params { rank: 5, ..p }).expect_err("R mismatch");
    assert!(matches!(e, OpsError::Length { tensor: "g", .. }), "{e}");
    let e = run(&be, &inputs, &mut out, &Params { k: 0, ..p }).expect_err("k 0");
    assert!(matches!(e, OpsError::Param { param: "k", .. }), "{e}");
    assert!(
        be.download(&pr)
            .expect("dl")
            .iter()
            .all(|&x| x == i32::POISON)
    );
    assert!(
        be.download(&ch)
            .expect("dl")
            .iter()
            .all(|&x| x == i32::POISON)
    );
    assert!(
        be.download(&q)
            .expect("dl")
            .iter()
            .all(|x| x.to_bits() == f32::POISON.to_bits())
    );
}

#[test]
fn fixtures_keep_their_decision_margins() {
    let f = fixture(
        Params {
            rows: 4,
            k: 15,
            rank: 64,
            vocab: 500,
        },
        &[0.0, 1.0, 0.6, -1.0],
        3,
    );
    let (pr, q, ch) = select(&f).expect("run");
    for b in 0..4 {
        let mut pred = f.anchors[b] as usize;
        for i in 0..15 {
            let col = b * 15 + i;
            let e = e64(&f, b, i, pred);
            let j = ch[col] as usize;
            if f.temp[b] <= 0.0 {
                for c in (0..TOP_K).filter(|&c| c != j) {
                    assert!(
                        e[j] - e[c] > 0.9 * f64::from(GREEDY_MARGIN),
                        "row {b} step {i}"
                    );
                }
            } else {
                let u = uniform(
                    seed_of(&f.seeds, b),
                    f.start[b] as u64 + i as u64,
                    Purpose::Dflash2Proposal,
                    0,
                );
                let mut cum = 0f32;
                for &x in &q[col * TOP_K..][..TOP_K] {
                    cum += x;
                    assert!((u - cum).abs() >= DRAW_MARGIN, "row {b} step {i}");
                }
            }
            pred = pr[col] as usize;
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn matches_an_independent_f64_walk(
        rows in 1usize..4,
        k in 1usize..6,
        rank in 1usize..40,
        vocab in 1usize..50,
        t_pick in 0usize..4,
        seed in any::<u64>(),
    ) {
        let temp = [0.0f32, 0.5, 1.0, 2.0][t_pick];
        let p = Params { rows, k, rank, vocab };
        let mut mix = Mix(seed);
        // A fixture without margin fixing: raw random data.
        let mut f = fixture(p, &[temp], seed);
        f.seeds = (0..2 * rows).map(|_| mix.next_u64() as i32).collect();
        let (pr, q, ch) = select(&f).expect("run");
        for b in 0..rows {
            let mut pred = f.anchors[b] as usize;
            for i in 0..k {
                let col = b * k + i;
                let e = e64(&f, b, i, pred);
                let j = ch[col] as usize;
                let qi = &q[col * TOP_K..][..TOP_K];
                prop_assert_eq!(pr[col], f.cand[col * TOP_K + j]);
                let m = e.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                if temp <= 0.0 {
                    // F32 rounding of E is far below 1e-4 at these magnitudes.
                    prop_assert!(e[j] >= m - 1e-4);
                    for c in 0..j {
                        prop_assert!(e[c] < e[j] + 1e-4, "a lower rank is clearly better");
                    }
                    for (c, &x) in qi.iter().enumerate() {
                        prop_assert_eq!(x, if c == j { 1.0 } else { 0.0 });
                    }
                } else {
                    let w: Vec<f64> = e.iter().map(|x| ((x - m) / f64::from(temp)).exp()).collect();
                    let s: f64 = w.iter().sum();
                    for c in 0..TOP_K {
                        prop_assert!((f64::from(qi[c]) - w[c] / s).abs() < 1e-5);
                    }
                    let sum: f64 = qi.iter().map(|&x| f64::from(x)).sum();
                    prop_assert!((sum - 1.0).abs() < 1e-6);
                    let u = uniform(seed_of(&f.seeds, b), f.start[b] as u64 + i as u64, Purpose::Dflash2Proposal, 0);
                    prop_assert_eq!(j, icdf(qi, u));
                }
                pred = pr[col] as usize;
            }
        }
    }
}

/// A draw past the F32 total of q (which can fall a few ulps short of 1) takes the last rank
/// with mass, never a rank of zero mass: with the last edge score far below the others its q
/// underflows to 0, and a uniform at (or past) the total picks rank 14, not 15.
#[test]
fn a_draw_past_the_total_takes_the_last_rank_with_mass() {
    let mut e = [0.0f32; TOP_K];
    e[TOP_K - 1] = -1.0e4;
    let (j, q) = super::reference::choose(&e, 1.0, || 1.0);
    assert_eq!(q[TOP_K - 1], 0.0);
    assert_eq!(j, TOP_K - 2);
    assert!(q[j] > 0.0);
    // Inside the total the ordinary inverse CDF decides.
    let (j, _) = super::reference::choose(&e, 1.0, || 0.0);
    assert_eq!(j, 0);
}
