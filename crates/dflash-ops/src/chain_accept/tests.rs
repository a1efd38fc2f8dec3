#![allow(clippy::needless_range_loop, clippy::type_complexity)] // reason: index loops mirror the formulas; test helpers return tuples

use super::reference::{ColumnQ, PColumn, blocked_draw};
use super::*;
use crate::OpsError;
use crate::rng::{Purpose, uniform};
use crate::target_distribution::Gen;
use proptest::prelude::*;

/// Inputs of a CPU call.
#[derive(Clone)]
struct In {
    rows: usize,
    cols: usize,
    vocab: usize,
    p: Vec<f32>,
    proposals: Vec<i32>,
    live: Vec<i32>,
    top16: Option<(Vec<f32>, Vec<i32>)>,
    seeds: Vec<i32>,
    start_pos: Vec<i32>,
}

/// (accepted, out_tokens, out_len) or the error (after checking nothing was written).
fn run_cpu(x: &In) -> std::result::Result<(Vec<i32>, Vec<i32>, Vec<i32>), OpsError> {
    run_form(x, None, x.rows)
}

fn seed_words(s: u64) -> [i32; 2] {
    [s as u32 as i32, (s >> 32) as u32 as i32]
}

/// Independent plain inverse CDF: sequential f64 prefix over ids (no tiles).
fn plain_draw(w: &[f64], u: f32) -> Option<usize> {
    let total: f64 = w.iter().sum();
    if total.is_nan() || total <= 0.0 {
        return None;
    }
    let target = f64::from(u) * total;
    let mut run = 0.0;
    let mut last = None;
    for (v, &x) in w.iter().enumerate() {
        run += x;
        if x > 0.0 {
            last = Some(v);
        }
        if run > target {
            return Some(v);
        }
    }
    last
}

/// Independent chain verification of one row, from the spec's formulas.
fn plain_chain(
    p: &[Vec<f64>],
    d: &[usize],
    q: &[Vec<f64>],
    seed: u64,
    f: u64,
) -> (usize, Vec<usize>) {
    let mut out = Vec::new();
    for i in 0..d.len() {
        let u = uniform(seed, f + 1 + i as u64, Purpose::Accept, 0);
        if f64::from(u) * q[i][d[i]] < p[i][d[i]] {
            out.push(d[i]);
        } else {
            let u = uniform(seed, f + 1 + i as u64, Purpose::Correction, 0);
            let w: Vec<f64> = p[i]
                .iter()
                .zip(&q[i])
                .map(|(a, b)| (a - b).max(0.0))
                .collect();
            out.push(
                plain_draw(&w, u)
                    .or_else(|| plain_draw(&p[i], u))
                    .unwrap_or(0),
            );
            return (i, out);
        }
    }
    let pp = d.len();
    let u = uniform(seed, f + 1 + pp as u64, Purpose::Bonus, 0);
    out.push(plain_draw(&p[pp], u).unwrap_or(0));
    (pp, out)
}

fn one_hot(vocab: usize, at: usize) -> Vec<f32> {
    let mut v = vec![0.0; vocab];
    v[at] = 1.0;
    v
}

#[test]
fn greedy_target_accepts_the_matching_prefix_then_corrects_with_the_argmax() {
    // p one-hot at argmax a_i; proposals match for the first 2, then mismatch.
    let (vocab, cols) = (50, 5);
    let argmax = [7usize, 3, 44, 12, 0];
    let p: Vec<f32> = argmax.iter().flat_map(|&a| one_hot(vocab, a)).collect();
    for top16 in [false, true] {
        let proposals = vec![7, 3, 45, 12];
        let q16 = top16.then(|| {
            // Soft q over 16 ids containing each proposal (and not the argmax of column 2).
            let mut q = Vec::new();
            let mut ids = Vec::new();
            for &d in &proposals {
                for s in 0..16 {
                    ids.push(((d as usize + s * 3) % vocab) as i32);
                    q.push(if s == 0 { 0.4 } else { 0.04 });
                }
            }
            (q, ids)
        });
        for seed in 0..200u64 {
            let x = In {
                rows: 1,
                cols,
                vocab,
                p: p.clone(),
                proposals: proposals.clone(),
                live: vec![5],
                top16: q16.clone(),
                seeds: seed_words(seed * 7919).to_vec(),
                start_pos: vec![seed as i32 * 3],
            };
            let (a, t, l) = run_cpu(&x).expect("run");
            assert_eq!((a[0], l[0]), (2, 3), "seed {seed}");
            assert_eq!(t, vec![7, 3, 44, -1, -1], "seed {seed}");
        }
    }
}

#[test]
fn greedy_all_accept_emits_the_bonus_argmax_and_p0_selects_the_target_output() {
    let (vocab, cols) = (30, 3);
    let p: Vec<f32> = [4usize, 9, 29]
        .iter()
        .flat_map(|&a| one_hot(vocab, a))
        .collect();
    let x = In {
        rows: 2,
        cols,
        vocab,
        p: [p.clone(), p].concat(),
        proposals: vec![4, 9, 4, 9],
        live: vec![3, 1],
        top16: None,
        seeds: [seed_words(1), seed_words(2)].concat(),
        start_pos: vec![10, 20],
    };
    let (a, t, l) = run_cpu(&x).expect("run");
    assert_eq!(a, vec![2, 0]);
    assert_eq!(l, vec![3, 1]);
    assert_eq!(
        t,
        vec![4, 9, 29, 4, -1, -1],
        "P = 0 emits the argmax of p_0"
    );
}

#[test]
fn acceptance_boundary_is_strict_and_exact() {
    // One-hot q: accept iff u < p(x). Put p(x) exactly at u (reject) and one ulp above
    // (accept).
    let seed = 99u64;
    let f = 5u64;
    let u = uniform(seed, f + 1, Purpose::Accept, 0);
    assert!(u > 0.0 && u < 0.999);
    for (px, want) in [(u, 0), (f32::from_bits(u.to_bits() + 1), 1)] {
        let mut p0 = vec![0.0f32; 4];
        p0[2] = px;
        p0[1] = 1.0 - px;
        let x = In {
            rows: 1,
            cols: 2,
            vocab: 4,
            p: [p0, vec![0.25; 4]].concat(),
            proposals: vec![2],
            live: vec![2],
            top16: None,
            seeds: seed_words(seed).to_vec(),
            start_pos: vec![f as i32],
        };
        let (a, t, _) = run_cpu(&x).expect("run");
        assert_eq!(a[0], want, "p(x) = {px}, u = {u}");
        if want == 0 {
            assert_eq!(t[0], 1, "the residual puts all mass on token 1");
        }
    }
}

#[test]
fn zero_weight_tokens_are_never_drawn_and_the_residual_fallback_samples_p() {
    let mut p = vec![0.0f32; 3000];
    p[0] = 0.25;
    p[1500] = 0.5;
    p[2999] = 0.25;
    for k in 0..2000u32 {
        let u = (k as f32) / 2000.0;
        let v = blocked_draw(&PColumn::Row(&p), &ColumnQ::None, u).expect("positive total");
        assert!(p[v] > 0.0, "u {u} drew zero-weight token {v}");
        let want = if u < 0.25 {
            0
        } else if u < 0.75 {
            1500
        } else {
            2999
        };
        assert_eq!(v, want, "u {u}");
    }
    // q == p on its support: the residual is zero everywhere -> None, and `draw` samples p.
    let ids: Vec<i32> = (0..16)
        .map(|s| match s {
            0 => 0,
            1 => 1500,
            2 => 2999,
            _ => 100 + s,
        })
        .collect();
    let mut q = vec![0.0f32; 16];
    q[0] = 0.25;
    q[1] = 0.5;
    q[2] = 0.25;
    let cq = ColumnQ::Top16 { q: &q, ids: &ids };
    assert_eq!(blocked_draw(&PColumn::Row(&p), &cq, 0.5), None);
    assert_eq!(super::reference::draw(&PColumn::Row(&p), &cq, 0.5), 1500);
}

#[test]
fn a_row_result_depends_only_on_its_own_data() {
    let d = case_data(8, 6, 700, true, 5);
    let x = In {
        rows: 8,
        cols: 6,
        vocab: 700,
        p: d.p.clone(),
        proposals: d.proposals.clone(),
        live: d.live.clone(),
        top16: Some((d.q.clone(), d.ids.clone())),
        seeds: d.seeds.clone(),
        start_pos: d.start_pos.clone(),
    };
    let (a, t, l) = run_cpu(&x).expect("run");
    // Reverse the rows.
    let rev = |v: &[i32], w: usize| -> Vec<i32> { v.chunks(w).rev().flatten().copied().collect() };
    let revf = |v: &[f32], w: usize| -> Vec<f32> { v.chunks(w).rev().flatten().copied().collect() };
    let y = In {
        p: revf(&d.p, 6 * 700),
        proposals: rev(&d.proposals, 5),
        live: rev(&d.live, 1),
        top16: Some((revf(&d.q, 5 * 16), rev(&d.ids, 5 * 16))),
        seeds: rev(&d.seeds, 2),
        start_pos: rev(&d.start_pos, 1),
        ..x.clone()
    };
    let (a2, t2, l2) = run_cpu(&y).expect("run");
    assert_eq!(rev(&a2, 1), a);
    assert_eq!(rev(&l2, 1), l);
    assert_eq!(rev(&t2, 6), t);
    // The mix exercises P = 0, early rejects and full accepts.
    assert!(a.contains(&0) && a.iter().any(|&x| x > 0), "{a:?}");
}

#[test]
fn bad_inputs_are_refused_with_typed_errors_and_no_writes() {
    let base = In {
        rows: 1,
        cols: 2,
        vocab: 20,
        p: [one_hot(20, 3), one_hot(20, 4)].concat(),
        proposals: vec![3],
        live: vec![2],
        top16: Some((
            (0..16)
                .map(|s| if s == 0 { 0.5 } else { 0.5 / 15.0 })
                .collect(),
            (3..19).collect(),
        )),
        seeds: vec![1, 2],
        start_pos: vec![0],
    };
    run_cpu(&base).expect("valid");
    let value = |x: In| match run_cpu(&x) {
        Err(OpsError::Value { tensor, index, .. }) => (tensor, index),
        other => panic!("expected a Value error, got {other:?}"),
    };
    assert_eq!(
        value(In {
            live: vec![0],
            ..base.clone()
        }),
        ("live", 0)
    );
    assert_eq!(
        value(In {
            live: vec![3],
            ..base.clone()
        }),
        ("live", 0)
    );
    assert_eq!(
        value(In {
            start_pos: vec![-1],
            ..base.clone()
        }),
        ("start_pos", 0)
    );
    assert_eq!(
        value(In {
            proposals: vec![20],
            ..base.clone()
        }),
        ("proposals", 0)
    );
    let mut p = base.p.clone();
    p[25] = -0.5;
    assert_eq!(value(In { p, ..base.clone() }), ("p", 25));
    let mut p = base.p.clone();
    p[1] = f32::NAN;
    assert_eq!(value(In { p, ..base.clone() }), ("p", 1));
    let mut p = base.p.clone();
    p[24] = 0.0;
    assert_eq!(
        value(In { p, ..base.clone() }),
        ("p", 20),
        "column 1 without mass"
    );
    let (q, ids) = base.top16.clone().expect("top16");
    let mut dup = ids.clone();
    dup[5] = dup[2];
    assert_eq!(
        value(In {
            top16: Some((q.clone(), dup)),
            ..base.clone()
        }),
        ("ids", 5)
    );
    let mut bad_q = q.clone();
    bad_q[7] = -0.1;
    assert_eq!(
        value(In {
            top16: Some((bad_q, ids.clone())),
            ..base.clone()
        }),
        ("q", 7)
    );
    let mut zero_q = q.clone();
    zero_q[0] = 0.0;
    assert_eq!(
        value(In {
            top16: Some((zero_q, ids.clone())),
            ..base.clone()
        }),
        ("proposals", 0),
        "the proposal must carry q > 0"
    );
    // A dead column's p and proposals are not read.
    let mut p = base.p.clone();
    p[25] = f32::NAN;
    run_cpu(&In {
        p,
        live: vec![1],
        proposals: vec![999],
        ..base.clone()
    })
    .expect("dead ignored");
    let e = run_cpu(&In {
        seeds: vec![1],
        ..base.clone()
    })
    .expect_err("short seeds");
    assert!(
        matches!(
            e,
            OpsError::Length {
                tensor: "seeds",
                ..
            }
        ),
        "{e}"
    );
    let e = run_cpu(&In {
        vocab: MAX_VOCAB + 1,
        ..base.clone()
    })
    .expect_err("vocab");
    assert!(matches!(e, OpsError::Param { param: "vocab", .. }), "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// The op agrees with the independent sequential chain on random soft and greedy inputs,
    /// for one-hot and top-16 q (the blocked sums differ from the sequential ones only in the
    /// last bits, which these random inputs never straddle).
    #[test]
    fn matches_an_independent_plain_chain(
        vocab in 16usize..2500,
        cols in 1usize..6,
        top16 in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let mut g = Gen::new(seed);
        let k = cols - 1;
        let greedy = g.below(3) == 0;
        let mut p = Vec::new();
        let mut pf = Vec::new();
        for _ in 0..cols {
            let mut w = vec![0f64; vocab];
            if greedy {
                w[g.below(vocab)] = 1.0;
            } else {
                for _ in 0..(3 + g.below(20)) {
                    w[g.below(vocab)] += f64::from(g.unit()) + 0.01;
                }
            }
            let t: f64 = w.iter().sum();
            let col: Vec<f32> = w.iter().map(|x| (x / t) as f32).collect();
            pf.push(col.iter().map(|&x| f64::from(x)).collect::<Vec<f64>>());
            p.extend(col);
        }
        let mut proposals = Vec::new();
        let mut qs = Vec::new();
        let mut ids = Vec::new();
        let mut qf = Vec::new();
        for i in 0..k {
            // Half the time propose the mode of p_i.
            let mode = (0..vocab).max_by(|&a, &b| pf[i][a].total_cmp(&pf[i][b]).then(b.cmp(&a))).unwrap_or(0);
            let d = if g.below(2) == 0 { mode } else { g.below(vocab) };
            proposals.push(d as i32);
            let mut qd = vec![0f64; vocab];
            if top16 {
                let mut chosen = vec![d];
                while chosen.len() < 16 {
                    let v = g.below(vocab);
                    if !chosen.contains(&v) { chosen.push(v); }
                }
                let w: Vec<f64> = (0..16).map(|_| f64::from(g.unit()) + 0.05).collect();
                let t: f64 = w.iter().sum();
                for s in 0..16 {
                    let qq = (w[s] / t) as f32;
                    ids.push(chosen[s] as i32);
                    qs.push(qq);
                    qd[chosen[s]] = f64::from(qq);
                }
            } else {
                qd[d] = 1.0;
            }
            qf.push(qd);
        }
        let live = 1 + g.below(cols);
        let s = g.next_u64();
        let f = g.below(1 << 20) as u64;
        let x = In {
            rows: 1, cols, vocab, p,
            proposals: proposals.clone(),
            live: vec![live as i32],
            top16: top16.then(|| (qs.clone(), ids.clone())),
            seeds: seed_words(s).to_vec(),
            start_pos: vec![f as i32],
        };
        let (a, t, l) = run_cpu(&x).expect("run");
        let d: Vec<usize> = proposals[..live - 1].iter().map(|&v| v as usize).collect();
        let (wa, wout) = plain_chain(&pf, &d, &qf, s, f);
        prop_assert_eq!(a[0] as usize, wa);
        prop_assert_eq!(l[0] as usize, wa + 1);
        let mut want: Vec<i32> = wout.iter().map(|&v| v as i32).collect();
        want.resize(cols, -1);
        prop_assert_eq!(t, want);
        if greedy {
            // Greedy verification: accepted prefix = matching argmax prefix.
            let argmax = |c: &Vec<f64>| c.iter().position(|&x| x == 1.0).unwrap_or(0);
            let m = d.iter().enumerate().take_while(|&(i, &v)| v == argmax(&pf[i])).count();
            prop_assert_eq!(wa, m);
            prop_assert_eq!(wout[m], argmax(&pf[m]));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The `Live` form: greedy columns as ids, their p rows never read.

/// (accepted, out_tokens, out_len) of a call reading `target` (buffers of `out_rows` rows, a
/// call of `x.rows`), or the error after checking that nothing was written.
fn run_form(
    x: &In,
    greedy: Option<&[i32]>,
    out_rows: usize,
) -> std::result::Result<(Vec<i32>, Vec<i32>, Vec<i32>), OpsError> {
    let be = Backend::cpu();
    let p = be.upload(&x.p).expect("upload");
    let g = be.upload(greedy.unwrap_or(&[])).expect("upload");
    let target = match greedy {
        Some(_) => Distributions::Live { p: &p, greedy: &g },
        None => Distributions::Full(&p),
    };
    let d = be.upload(&x.proposals).expect("upload");
    let live = be.upload(&x.live).expect("upload");
    let seeds = be.upload(&x.seeds).expect("upload");
    let sp = be.upload(&x.start_pos).expect("upload");
    let (q, ids) = match &x.top16 {
        Some((q, ids)) => (be.upload(q).expect("up"), be.upload(ids).expect("up")),
        None => (be.upload(&[]).expect("up"), be.upload(&[]).expect("up")),
    };
    let proposal = if x.top16.is_some() {
        Proposal::Top16 { q: &q, ids: &ids }
    } else {
        Proposal::OneHot
    };
    let mut a = be.filled(out_rows, i32::POISON).expect("alloc");
    let mut t = be.filled(out_rows * x.cols, i32::POISON).expect("alloc");
    let mut l = be.filled(out_rows, i32::POISON).expect("alloc");
    let r = run_with(
        &be,
        target,
        &d,
        &live,
        proposal,
        &seeds,
        &sp,
        Outputs {
            accepted: &mut a,
            out_tokens: &mut t,
            out_len: &mut l,
        },
        &Params {
            rows: x.rows,
            cols: x.cols,
            vocab: x.vocab,
        },
    );
    let (a, t, l) = (
        be.download(&a).expect("dl"),
        be.download(&t).expect("dl"),
        be.download(&l).expect("dl"),
    );
    match r {
        Ok(()) => Ok((a, t, l)),
        Err(e) => {
            assert!(
                a.iter().chain(&t).chain(&l).all(|&v| v == i32::POISON),
                "a refused call wrote an output: {e}"
            );
            Err(e)
        }
    }
}

fn from_case(d: &CaseData, rows: usize, cols: usize, vocab: usize, top16: bool) -> In {
    In {
        rows,
        cols,
        vocab,
        p: d.p.clone(),
        proposals: d.proposals.clone(),
        live: d.live.clone(),
        top16: top16.then(|| (d.q.clone(), d.ids.clone())),
        seeds: d.seeds.clone(),
        start_pos: d.start_pos.clone(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Greedy columns given as ids over a poisoned p (NaN: any read would change or refuse
    /// the decision) decide exactly as their stored one-hot rows do, for every behaviour of
    /// the case mix, one-hot and top-16 q.
    #[test]
    fn live_greedy_columns_decide_like_one_hot_rows_without_reading_p(
        vocab in 16usize..3000,
        cols in 1usize..7,
        rows in 1usize..7,
        top16 in any::<bool>(),
        first_kind in 0usize..5,
        seed in any::<u64>(),
    ) {
        let d = case_data_from(rows, cols, vocab, top16, seed, first_kind);
        let full = run_form(&from_case(&d, rows, cols, vocab, top16), None, rows).expect("full");
        let (p_live, greedy) = live_distributions(&d, cols, vocab);
        let x = In { p: p_live, ..from_case(&d, rows, cols, vocab, top16) };
        let live = run_form(&x, Some(&greedy), rows).expect("live");
        prop_assert_eq!(live, full);
    }
}

#[test]
fn the_live_case_mix_has_greedy_and_sampled_columns_and_poisoned_greedy_rows() {
    let (rows, cols, vocab) = (8, 16, 4096);
    let d = case_data_from(rows, cols, vocab, true, 27, 0);
    let (p, greedy) = live_distributions(&d, cols, vocab);
    let live_greedy = greedy.iter().filter(|&&g| g >= 0).count();
    let live_sampled = greedy.iter().filter(|&&g| g == -1).count();
    assert!(
        live_greedy > 0 && live_sampled > 0,
        "{live_greedy} {live_sampled}"
    );
    for (rc, &g) in greedy.iter().enumerate() {
        let row = &p[rc * vocab..(rc + 1) * vocab];
        let poisoned = row.iter().all(|x| x.to_bits() == f32::POISON.to_bits());
        assert_eq!(
            poisoned,
            g != -1,
            "column {rc}: only sampled columns keep p"
        );
    }
    let full = run_form(&from_case(&d, rows, cols, vocab, true), None, rows).expect("full");
    let x = In {
        p,
        ..from_case(&d, rows, cols, vocab, true)
    };
    assert_eq!(run_form(&x, Some(&greedy), rows).expect("live"), full);
    assert!(full.0.iter().any(|&a| a > 0), "the mix accepts something");
}

#[test]
fn greedy_entries_are_checked_and_only_for_live_columns() {
    let (rows, cols, vocab) = (2, 3, 20);
    let d = case_data_from(rows, cols, vocab, false, 9, 0);
    let (p, greedy) = live_distributions(&d, cols, vocab);
    assert!(greedy[0] >= 0, "row 0 is greedy");
    let x = In {
        p,
        ..from_case(&d, rows, cols, vocab, false)
    };
    run_form(&x, Some(&greedy), rows).expect("valid");
    let value = |g: Vec<i32>| match run_form(&x, Some(&g), rows) {
        Err(OpsError::Value { tensor, index, .. }) => (tensor, index),
        other => panic!("expected a Value error, got {other:?}"),
    };
    let mut big = greedy.clone();
    big[1] = vocab as i32;
    assert_eq!(value(big), ("greedy", 1));
    let mut neg = greedy.clone();
    neg[0] = -2;
    assert_eq!(value(neg), ("greedy", 0));
    // A greedy column whose id is -1 reads its (poisoned) p row: refused on the CPU.
    let mut sampled = greedy.clone();
    sampled[0] = -1;
    assert!(matches!(
        run_form(&x, Some(&sampled), rows),
        Err(OpsError::Value { tensor: "p", .. })
    ));
    let e = run_form(&x, Some(&greedy[..5]), rows).expect_err("short greedy");
    assert!(
        matches!(
            e,
            OpsError::Length {
                tensor: "greedy",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn a_call_of_fewer_rows_than_its_buffers_leaves_the_extra_rows_untouched() {
    let (cols, vocab) = (5, 300);
    let d = case_data(6, cols, vocab, true, 13);
    let all = from_case(&d, 6, cols, vocab, true);
    let (a6, t6, l6) = run_form(&all, None, 6).expect("6 rows");
    // Inputs and outputs planned for 6 rows, a call of 4.
    let (a, t, l) = run_form(
        &In {
            rows: 4,
            ..all.clone()
        },
        None,
        6,
    )
    .expect("4 of 6 rows");
    assert_eq!(
        (&a[..4], &t[..4 * cols], &l[..4]),
        (&a6[..4], &t6[..4 * cols], &l6[..4])
    );
    assert!(
        a[4..]
            .iter()
            .chain(&t[4 * cols..])
            .chain(&l[4..])
            .all(|&v| v == i32::POISON)
    );
}
