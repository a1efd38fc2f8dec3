use super::*;
use proptest::prelude::*;

fn params(n: usize, rows: usize, public_vocab: usize, head: ProposalHead) -> Params {
    Params {
        n,
        rows,
        public_vocab,
        head,
    }
}

fn topk(logits: &[f32], map: Option<&[i32]>, p: &Params) -> Result<(Vec<f32>, Vec<i32>)> {
    let be = Backend::cpu();
    let l = be.upload(logits)?;
    let t = match map {
        Some(m) => Some(be.upload(m)?),
        None => None,
    };
    let mut s = be.filled(p.n * TOP_K, f32::POISON)?;
    let mut d = be.filled(p.n * TOP_K, i32::POISON)?;
    run(&be, &l, t.as_ref(), &mut s, &mut d, p)?;
    Ok((be.download(&s)?, be.download(&d)?))
}

/// Independent recomputation: sort every candidate by (value desc, id asc) in f64, take 16.
/// Zeros are compared as equal (the generators below never produce -0.0 except where a test
/// says so).
fn oracle(
    logits: &[f32],
    map: Option<&[i32]>,
    rows: usize,
    considered: usize,
) -> (Vec<f32>, Vec<i32>) {
    let (mut s, mut d) = (Vec::new(), Vec::new());
    for row in logits.chunks_exact(rows) {
        let mut c: Vec<(f64, i32, f32)> = (0..considered)
            .map(|k| {
                (
                    f64::from(row[k]) + 0.0,
                    map.map_or(k as i32, |m| m[k]),
                    row[k],
                )
            })
            .collect();
        c.sort_by(|a, b| b.0.partial_cmp(&a.0).expect("no NaN").then(a.1.cmp(&b.1)));
        for &(_, id, v) in &c[..TOP_K] {
            s.push(v);
            d.push(id);
        }
    }
    (s, d)
}

#[test]
fn full_head_top16_is_sorted_with_ties_to_lower_ids_and_ignores_the_tail() {
    // 24 rows, 20 public. Values: row v holds (v % 5) as f32, with row 3 = 10 and the tail
    // rows 20..24 = 100 (must be ignored).
    let mut l: Vec<f32> = (0..24).map(|v| (v % 5) as f32).collect();
    l[3] = 10.0;
    for x in &mut l[20..] {
        *x = 100.0;
    }
    let (s, d) = topk(&l, None, &params(1, 24, 20, ProposalHead::Full)).expect("run");
    // 10 (id 3), then the 4s: ids 4, 9, 14, 19; the 3s: 8, 13, 18; the 2s: 2, 7, 12, 17;
    // the 1s: 1, 6, 11, 16 (the 0s 0, 5, 10, 15 are cut).
    assert_eq!(
        d,
        vec![3, 4, 9, 14, 19, 8, 13, 18, 2, 7, 12, 17, 1, 6, 11, 16]
    );
    assert_eq!(
        s,
        vec![
            10.0, 4.0, 4.0, 4.0, 4.0, 3.0, 3.0, 3.0, 2.0, 2.0, 2.0, 2.0, 1.0, 1.0, 1.0, 1.0
        ]
    );
}

#[test]
fn indexed_head_orders_ties_by_global_id_and_keeps_score_bits() {
    // 18 shortlist rows whose ids run backwards (row k -> 100 - 3k): with all scores equal
    // the winners are the 16 LOWEST global ids, i.e. the LAST 16 rows.
    let map: Vec<i32> = (0..18).map(|k| 100 - 3 * k).collect();
    let l = vec![0.5f32; 18];
    let (s, d) = topk(&l, Some(&map), &params(1, 18, 101, ProposalHead::Indexed)).expect("run");
    let want: Vec<i32> = (2..18).rev().map(|k| 100 - 3 * k).collect();
    assert_eq!(d, want);
    assert_eq!(s, vec![0.5; 16]);
    // -0.0 and +0.0 tie (lower id first) and keep their own bits; -inf and +inf are ordinary.
    let mut l = vec![-1.0f32; 18];
    l[0] = -0.0; // id 100
    l[17] = 0.0; // id 49
    l[5] = f32::INFINITY; // id 85
    l[6] = f32::NEG_INFINITY; // id 82
    let (s, d) = topk(&l, Some(&map), &params(1, 18, 101, ProposalHead::Indexed)).expect("run");
    assert_eq!(&d[..3], &[85, 49, 100]);
    assert_eq!(s[0], f32::INFINITY);
    assert_eq!(
        (s[1].to_bits(), s[2].to_bits()),
        (0.0f32.to_bits(), (-0.0f32).to_bits())
    );
    assert!(!d.contains(&82), "-inf is last and cut");
}

#[test]
fn all_equal_scores_give_the_lowest_ids() {
    let (s, d) = topk(
        &[2.5f32; 3 * 40],
        None,
        &params(3, 40, 33, ProposalHead::Full),
    )
    .expect("run");
    assert_eq!(d, (0..3).flat_map(|_| 0..16).collect::<Vec<i32>>());
    assert!(s.iter().all(|&x| x == 2.5));
}

#[test]
fn nan_and_bad_maps_are_refused_without_writing() {
    let be = Backend::cpu();
    let mut l = vec![0.0f32; 2 * 20];
    l[20 + 19] = f32::NAN; // tail of row 1 with public 19: allowed
    let mut s = be.filled(32, f32::POISON).expect("alloc");
    let mut d = be.filled(32, i32::POISON).expect("alloc");
    let lb = be.upload(&l).expect("upload");
    run(
        &be,
        &lb,
        None,
        &mut s,
        &mut d,
        &params(2, 20, 19, ProposalHead::Full),
    )
    .expect("tail NaN ok");
    be.fill(&mut s, f32::POISON).expect("fill");
    be.fill(&mut d, i32::POISON).expect("fill");
    let e = run(
        &be,
        &lb,
        None,
        &mut s,
        &mut d,
        &params(2, 20, 20, ProposalHead::Full),
    )
    .expect_err("public NaN");
    assert!(
        matches!(
            e,
            OpsError::Value {
                tensor: "logits",
                index: 39,
                ..
            }
        ),
        "{e}"
    );
    let mut map: Vec<i32> = (0..20).collect();
    map[7] = 3;
    let t = be.upload(&map).expect("upload");
    let l0 = be.upload(&[0.0f32; 40]).expect("upload");
    let e = run(
        &be,
        &l0,
        Some(&t),
        &mut s,
        &mut d,
        &params(2, 20, 20, ProposalHead::Indexed),
    )
    .expect_err("duplicate id");
    assert!(
        matches!(
            e,
            OpsError::Value {
                tensor: "token_ids",
                index: 7,
                ..
            }
        ),
        "{e}"
    );
    assert!(
        be.download(&s)
            .expect("dl")
            .iter()
            .all(|x| x.to_bits() == f32::POISON.to_bits())
    );
    assert!(
        be.download(&d)
            .expect("dl")
            .iter()
            .all(|&x| x == i32::POISON)
    );
}

#[test]
fn fewer_than_16_candidates_and_bad_lengths_are_refused() {
    let be = Backend::cpu();
    let l = be.upload(&[0.0f32; 20]).expect("upload");
    let mut s = be.filled(16, f32::POISON).expect("alloc");
    let mut d = be.filled(16, i32::POISON).expect("alloc");
    let e = run(
        &be,
        &l,
        None,
        &mut s,
        &mut d,
        &params(1, 20, 15, ProposalHead::Full),
    )
    .expect_err("15 public");
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
    let l15 = be.upload(&[0.0f32; 15]).expect("upload");
    let t = be.upload(&(0..15).collect::<Vec<i32>>()).expect("upload");
    let e = run(
        &be,
        &l15,
        Some(&t),
        &mut s,
        &mut d,
        &params(1, 15, 99, ProposalHead::Indexed),
    )
    .expect_err("15 rows");
    assert!(matches!(e, OpsError::Param { param: "rows", .. }), "{e}");
    let mut short = be.filled(15, i32::POISON).expect("alloc");
    let e = run(
        &be,
        &l,
        None,
        &mut s,
        &mut short,
        &params(1, 20, 20, ProposalHead::Full),
    )
    .expect_err("ids short");
    assert!(
        matches!(
            e,
            OpsError::Length {
                tensor: "ids",
                expected: 16,
                ..
            }
        ),
        "{e}"
    );
    assert!(
        be.download(&s)
            .expect("dl")
            .iter()
            .all(|x| x.to_bits() == f32::POISON.to_bits())
    );
}

#[test]
fn planted_official_shortlist_shape_matches_the_oracle() {
    // One column at the official shortlist size: the planted reverse-ordered tie and the
    // shuffled map exercise the id tie-break at full scale.
    let mut mix = Mix(5);
    let map = mix.distinct_shuffled(OFFICIAL_PUBLIC, OFFICIAL_SHORTLIST);
    let l = planted_logits(&mut mix, 3, OFFICIAL_SHORTLIST, OFFICIAL_PUBLIC, Some(&map));
    let p = params(
        3,
        OFFICIAL_SHORTLIST,
        OFFICIAL_PUBLIC,
        ProposalHead::Indexed,
    );
    let got = topk(&l, Some(&map), &p).expect("run");
    assert_eq!(
        got,
        oracle(&l, Some(&map), OFFICIAL_SHORTLIST, OFFICIAL_SHORTLIST)
    );
    // Column 2's planted tie: the later row has the lower id and must come first.
    let row = &l[2 * OFFICIAL_SHORTLIST..3 * OFFICIAL_SHORTLIST];
    let at: Vec<usize> = (0..row.len()).filter(|&k| row[k] == got.0[32]).collect();
    assert_eq!(at.len(), 2);
    assert!(map[at[0]] > map[at[1]]);
    assert_eq!(got.1[32..34], [map[at[1]], map[at[0]]]);
}

proptest! {
    #[test]
    fn matches_an_independent_sort(
        n in 1usize..5,
        rows in 16usize..80,
        extra in 0usize..64,
        levels in 1u32..40,
        indexed_head in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let mut mix = Mix(seed);
        // `levels` distinct values: from all-equal (1) to mostly distinct.
        let logits: Vec<f32> = (0..n * rows)
            .map(|_| mix.below(levels as usize) as f32 * 0.25 - 3.0)
            .collect();
        if indexed_head {
            let public_vocab = rows + extra;
            let map = mix.distinct_shuffled(public_vocab, rows);
            let p = params(n, rows, public_vocab, ProposalHead::Indexed);
            prop_assert_eq!(topk(&logits, Some(&map), &p).expect("run"), oracle(&logits, Some(&map), rows, rows));
        } else {
            let public_vocab = 16 + extra % (rows - 15);
            let p = params(n, rows, public_vocab, ProposalHead::Full);
            prop_assert_eq!(topk(&logits, None, &p).expect("run"), oracle(&logits, None, rows, public_vocab));
        }
    }
}
