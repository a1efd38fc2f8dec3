use super::*;
use proptest::prelude::*;

fn full(n: usize, rows: usize, public_vocab: usize) -> Params {
    Params {
        n,
        rows,
        public_vocab,
        head: ProposalHead::Full,
    }
}

fn indexed(n: usize, rows: usize, public_vocab: usize) -> Params {
    Params {
        n,
        rows,
        public_vocab,
        head: ProposalHead::Indexed,
    }
}

fn argmax(logits: &[f32], map: Option<&[i32]>, p: &Params) -> Result<Vec<i32>> {
    let be = Backend::cpu();
    let l = be.upload(logits)?;
    let t = match map {
        Some(m) => Some(be.upload(m)?),
        None => None,
    };
    let mut ids = be.filled(p.n, i32::POISON)?;
    run(&be, &l, t.as_ref(), &mut ids, p)?;
    be.download(&ids)
}

#[test]
fn full_head_ties_go_to_the_lowest_id_and_the_tail_is_ignored() {
    let inf = f32::INFINITY;
    #[rustfmt::skip]
    let logits = [
        1.0, 3.0, 3.0, 0.0, 2.0, 9.0,          // tie 1/2 -> 1; 9.0 sits in the tail
        -inf, -inf, -inf, -inf, -inf, 0.0,     // all -inf among public rows -> 0
        0.0, -0.0, 0.0, -1.0, -0.0, f32::NAN,  // -0.0 == +0.0 -> 0; NaN in the tail is allowed
        -5.0, -4.0, -3.0, inf, inf, 1.0,       // +inf tie 3/4 -> 3
    ];
    let ids = argmax(&logits, None, &full(4, 6, 5)).expect("run");
    assert_eq!(ids, vec![1, 0, 0, 3]);
}

#[test]
fn indexed_head_ties_go_to_the_lower_global_id_not_the_lower_row() {
    let map = [7, 3, 9, 1];
    #[rustfmt::skip]
    let logits = [
        2.0, 5.0, 1.0, 5.0,   // rows 1 (id 3) and 3 (id 1) tie -> 1
        6.0, 5.0, 1.0, 5.0,   // unique max at row 0 -> 7
        0.5, 0.5, 0.5, 0.25,  // rows 0,1,2 tie (ids 7,3,9) -> 3
    ];
    let ids = argmax(&logits, Some(&map), &indexed(3, 4, 10)).expect("run");
    assert_eq!(ids, vec![1, 7, 3]);
}

#[test]
fn nan_in_a_considered_logit_is_refused_and_ids_stay_untouched() {
    let be = Backend::cpu();
    let l = be
        .upload(&[0.0, 1.0, 2.0, 3.0, 0.0, f32::NAN, 2.0, 3.0])
        .expect("upload");
    let mut ids = be.filled(2, i32::POISON).expect("alloc");
    let e = run(&be, &l, None, &mut ids, &full(2, 4, 4)).expect_err("NaN");
    assert!(
        matches!(
            e,
            OpsError::Value {
                tensor: "logits",
                index: 5,
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(be.download(&ids).expect("dl"), vec![i32::POISON; 2]);
    let t = be.upload(&[0, 1, 2, 3]).expect("upload");
    let e = run(&be, &l, Some(&t), &mut ids, &indexed(2, 4, 4)).expect_err("NaN");
    assert!(matches!(e, OpsError::Value { index: 5, .. }), "{e}");
    assert_eq!(be.download(&ids).expect("dl"), vec![i32::POISON; 2]);
}

#[test]
fn bad_token_maps_are_refused_without_writing() {
    let be = Backend::cpu();
    let l = be.upload(&[0.0f32, 1.0, 2.0]).expect("upload");
    let mut ids = be.filled(1, i32::POISON).expect("alloc");
    for (map, index) in [([0, 5, 1], 1), ([0, -1, 1], 1), ([2, 0, 2], 2)] {
        let t = be.upload(&map).expect("upload");
        let e = run(&be, &l, Some(&t), &mut ids, &indexed(1, 3, 5)).expect_err("bad map");
        assert!(
            matches!(e, OpsError::Value { tensor: "token_ids", index: i, .. } if i == index),
            "{map:?}: {e}"
        );
    }
    assert_eq!(be.download(&ids).expect("dl"), vec![i32::POISON]);
}

#[test]
fn bad_shapes_and_head_mismatches_are_refused() {
    let be = Backend::cpu();
    let l = be.upload(&[0.0f32; 6]).expect("upload");
    let t = be.upload(&[0, 1, 2]).expect("upload");
    let mut ids = be.filled(2, i32::POISON).expect("alloc");
    let e = run(&be, &l, None, &mut ids, &full(2, 3, 4)).expect_err("public > rows");
    assert!(
        matches!(
            e,
            OpsError::Param {
                param: "public_vocab",
                ..
            }
        ),
        "{e}"
    );
    let e = run(&be, &l, None, &mut ids, &full(2, 3, 0)).expect_err("public 0");
    assert!(
        matches!(
            e,
            OpsError::Param {
                param: "public_vocab",
                ..
            }
        ),
        "{e}"
    );
    let e = run(&be, &l, Some(&t), &mut ids, &full(2, 3, 3)).expect_err("map on full");
    assert!(
        matches!(
            e,
            OpsError::Param {
                param: "token_ids",
                ..
            }
        ),
        "{e}"
    );
    let e = run(&be, &l, None, &mut ids, &indexed(2, 3, 3)).expect_err("no map");
    assert!(
        matches!(
            e,
            OpsError::Param {
                param: "token_ids",
                ..
            }
        ),
        "{e}"
    );
    let e = run(&be, &l, None, &mut ids, &full(3, 3, 3)).expect_err("logits short");
    assert!(
        matches!(
            e,
            OpsError::Length {
                tensor: "logits",
                ..
            }
        ),
        "{e}"
    );
    let e = run(&be, &l, None, &mut ids, &full(1, 6, 6)).expect_err("ids long");
    assert!(
        matches!(
            e,
            OpsError::Length {
                tensor: "ids",
                expected: 1,
                found: 2,
                ..
            }
        ),
        "{e}"
    );
    let short = be.upload(&[0, 1]).expect("upload");
    let e = run(&be, &l, Some(&short), &mut ids, &indexed(2, 3, 3)).expect_err("map short");
    assert!(
        matches!(
            e,
            OpsError::Length {
                tensor: "token_ids",
                ..
            }
        ),
        "{e}"
    );
    let e = run(&be, &l, None, &mut ids, &full(usize::MAX, 2, 2)).expect_err("overflow");
    assert!(matches!(e, OpsError::Param { param: "n", .. }), "{e}");
    assert_eq!(be.download(&ids).expect("dl"), vec![i32::POISON; 2]);
}

#[test]
fn zero_columns_is_a_no_op() {
    assert_eq!(
        argmax(&[], None, &full(0, 4, 3)).expect("run"),
        Vec::<i32>::new()
    );
}

#[test]
fn planted_fixture_decisions_match_the_plan() {
    // The conformance fixture's plan, checked independently on a small shortlist: ties are
    // broken to the lower global id, which for i % 3 == 2 is the LATER shortlist row.
    let mut mix = Mix(11);
    let (n, rows, public_vocab) = (9, 64, 200);
    let map = mix.distinct_shuffled(public_vocab, rows);
    let l = planted_logits(&mut mix, n, rows, public_vocab, Some(&map));
    let ids = argmax(&l, Some(&map), &indexed(n, rows, public_vocab)).expect("run");
    for i in 0..n {
        let row = &l[i * rows..(i + 1) * rows];
        let m = row.iter().copied().fold(f32::MIN, f32::max);
        let at: Vec<usize> = (0..rows).filter(|&k| row[k] == m).collect();
        assert_eq!(at.len(), if i % 3 == 0 { 1 } else { 2 }, "column {i}");
        if i % 3 == 2 {
            assert!(map[at[0]] > map[at[1]], "column {i}: reverse-ordered tie");
            assert_eq!(ids[i], map[at[1]], "column {i}");
        } else {
            assert_eq!(
                ids[i],
                at.iter().map(|&k| map[k]).min().expect("max"),
                "column {i}"
            );
        }
    }
    // Full head: the tail holds a larger value than every public row and is ignored.
    let l = planted_logits(&mut mix, n, 50, 40, None);
    let ids = argmax(&l, None, &full(n, 50, 40)).expect("run");
    for i in 0..n {
        let row = &l[i * 50..(i + 1) * 50];
        let tail_max = row[40..].iter().copied().fold(f32::MIN, f32::max);
        let pub_max = row[..40].iter().copied().fold(f32::MIN, f32::max);
        assert!(tail_max > pub_max, "column {i}: the tail must tempt");
        assert_eq!(
            ids[i],
            row.iter().position(|&v| v == pub_max).expect("max") as i32
        );
    }
}

/// Independent recomputation: sort all candidates by (value desc in f64, id asc).
fn oracle(logits: &[f32], map: Option<&[i32]>, rows: usize, considered: usize) -> Vec<i32> {
    logits
        .chunks_exact(rows)
        .map(|row| {
            let mut c: Vec<(f64, i32)> = (0..considered)
                .map(|k| (f64::from(row[k]), map.map_or(k as i32, |m| m[k])))
                .collect();
            c.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            // total_cmp orders -0.0 below +0.0; the contract treats them as equal, so
            // canonicalize zeros before sorting (done by the generator: no -0.0 below).
            c[0].1
        })
        .collect()
}

proptest! {
    #[test]
    fn matches_an_independent_sort(
        n in 1usize..6,
        rows in 1usize..40,
        cut in 0usize..40,
        indexed_head in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let mut mix = Mix(seed);
        // Small integer values: many exact ties. No -0.0 (see the oracle).
        let logits: Vec<f32> = (0..n * rows).map(|_| mix.below(7) as f32 - 3.0).collect();
        if indexed_head {
            let public_vocab = rows + cut;
            let map = mix.distinct_shuffled(public_vocab, rows);
            let got = argmax(&logits, Some(&map), &indexed(n, rows, public_vocab)).expect("run");
            prop_assert_eq!(got, oracle(&logits, Some(&map), rows, rows));
        } else {
            let public_vocab = 1 + cut % rows;
            let got = argmax(&logits, None, &full(n, rows, public_vocab)).expect("run");
            prop_assert_eq!(got, oracle(&logits, None, rows, public_vocab));
        }
    }
}
