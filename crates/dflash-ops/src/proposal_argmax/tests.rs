use super::*;
use proptest::prelude::*;

fn full(n: usize, rows: usize, hidden: usize, public_vocab: usize) -> Params {
    Params {
        n,
        rows,
        hidden,
        public_vocab,
        head: ProposalHead::Full,
    }
}

fn indexed(n: usize, rows: usize, hidden: usize, public_vocab: usize) -> Params {
    Params {
        n,
        rows,
        hidden,
        public_vocab,
        head: ProposalHead::Indexed,
    }
}

/// Inputs whose logits are exactly `logits` (`[n, rows]`, finite BF16 values, n <= 8):
/// column i's hidden vector is the unit vector e_i (H = 8) and head row k holds
/// `logits[i][k]` at coordinate i, so `l[i, k] = logits[i][k] * 1 + 0 + ...` exactly.
pub(crate) fn unit_inputs(logits: &[f32], n: usize, rows: usize) -> (Vec<bf16>, Vec<bf16>) {
    assert!(n <= 8 && logits.len() == n * rows);
    let h = 8;
    let mut x = vec![bf16::ZERO; n * h];
    for i in 0..n {
        x[i * h + i] = bf16::ONE;
    }
    let mut w = vec![bf16::ZERO; rows * h];
    for i in 0..n {
        for k in 0..rows {
            let v = bf16::from_f32(logits[i * rows + k]);
            assert_eq!(
                v.to_f32(),
                logits[i * rows + k],
                "test logits must be BF16 values"
            );
            w[k * h + i] = v;
        }
    }
    (x, w)
}

fn argmax_inputs(x: &[bf16], w: &[bf16], map: Option<&[i32]>, p: &Params) -> Result<Vec<i32>> {
    let be = Backend::cpu();
    let hx = be.upload(x)?;
    let hw = be.upload(w)?;
    let t = match map {
        Some(m) => Some(be.upload(m)?),
        None => None,
    };
    let mut ids = be.filled(p.n, i32::POISON)?;
    let mut ws = be.filled(workspace_len(p), f32::POISON)?;
    run(&be, &hx, &hw, t.as_ref(), &mut ids, &mut ws, p)?;
    assert!(
        be.download(&ws)?
            .iter()
            .all(|v| v.to_bits() == f32::POISON.to_bits()),
        "the CPU never touches the workspace"
    );
    be.download(&ids)
}

fn argmax(logits: &[f32], map: Option<&[i32]>, p: &Params) -> Result<Vec<i32>> {
    let (x, w) = unit_inputs(logits, p.n, p.rows);
    argmax_inputs(&x, &w, map, p)
}

#[test]
fn full_head_ties_go_to_the_lowest_id_and_the_tail_is_ignored() {
    #[rustfmt::skip]
    let logits = [
        1.0, 3.0, 3.0, 0.0, 2.0, 9.0,          // tie 1/2 -> 1; 9.0 sits in the tail
        -7.0, -7.0, -7.0, -7.0, -7.0, 0.0,     // all equal among public rows -> 0
        0.0, 0.0, 0.0, -1.0, 0.0, 100.0,       // tie of zeros -> 0
        -5.0, -4.0, -3.0, 8.0, 8.0, 1.0,       // tie 3/4 -> 3
    ];
    let ids = argmax(&logits, None, &full(4, 6, 8, 5)).expect("run");
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
    let ids = argmax(&logits, Some(&map), &indexed(3, 4, 8, 10)).expect("run");
    assert_eq!(ids, vec![1, 7, 3]);
}

#[test]
fn the_decision_uses_the_whole_dot_product() {
    // Two columns over H = 16: row 0 wins on the first half, row 1 only on the sum.
    let h = 16;
    let mut x = vec![bf16::ZERO; 2 * h];
    let mut w = vec![bf16::ZERO; 2 * h];
    for e in 0..h {
        x[e] = bf16::ONE; // column 0: all ones
        x[h + e] = bf16::from_f32(if e < 8 { 1.0 } else { -1.0 }); // column 1: + then -
        w[e] = bf16::from_f32(if e < 8 { 1.0 } else { 0.0 }); // row 0: 8 ones
        w[h + e] = bf16::from_f32(if e < 8 { 0.75 } else { 0.5 }); // row 1: 6 + 4
    }
    // column 0: row 0 = 8, row 1 = 10 -> 1; column 1: row 0 = 8, row 1 = 6 - 4 = 2 -> 0.
    let ids = argmax_inputs(&x, &w, None, &full(2, 2, h, 2)).expect("run");
    assert_eq!(ids, vec![1, 0]);
}

#[test]
fn nan_logits_are_refused_naming_the_column_and_ids_stay_untouched() {
    let be = Backend::cpu();
    let (mut x, w) = unit_inputs(&[0.0, 1.0, 2.0, 3.0, 0.0, 1.0, 2.0, 3.0], 2, 4);
    x[8 + 1] = bf16::NAN; // column 1
    let hx = be.upload(&x).expect("upload");
    let hw = be.upload(&w).expect("upload");
    let p = full(2, 4, 8, 4);
    let mut ids = be.filled(2, i32::POISON).expect("alloc");
    let mut ws = be.filled(workspace_len(&p), 0f32).expect("alloc");
    let e = run(&be, &hx, &hw, None, &mut ids, &mut ws, &p).expect_err("NaN");
    assert!(
        matches!(
            e,
            OpsError::Value {
                tensor: "hidden",
                index: 1,
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(be.download(&ids).expect("dl"), vec![i32::POISON; 2]);
    // NaN only in the ignored tail of a full head is allowed.
    let (x, mut w) = unit_inputs(&[0.0, 1.0, 2.0, 3.0], 1, 4);
    w[3 * 8] = bf16::NAN;
    let got = argmax_inputs(&x, &w, None, &full(1, 4, 8, 3)).expect("tail NaN ignored");
    assert_eq!(got, vec![2]);
}

#[test]
fn bad_token_maps_are_refused_without_writing() {
    let be = Backend::cpu();
    let (x, w) = unit_inputs(&[0.0, 1.0, 2.0], 1, 3);
    let hx = be.upload(&x).expect("upload");
    let hw = be.upload(&w).expect("upload");
    let p = indexed(1, 3, 8, 5);
    let mut ids = be.filled(1, i32::POISON).expect("alloc");
    let mut ws = be.filled(workspace_len(&p), 0f32).expect("alloc");
    for (map, index) in [([0, 5, 1], 1), ([0, -1, 1], 1), ([2, 0, 2], 2)] {
        let t = be.upload(&map).expect("upload");
        let e = run(&be, &hx, &hw, Some(&t), &mut ids, &mut ws, &p).expect_err("bad map");
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
    let hx = be.upload(&[bf16::ZERO; 16]).expect("upload"); // [2, 8]
    let hw = be.upload(&[bf16::ZERO; 24]).expect("upload"); // [3, 8]
    let t = be.upload(&[0, 1, 2]).expect("upload");
    let mut ids = be.filled(2, i32::POISON).expect("alloc");
    let mut ws = be
        .filled(workspace_len(&full(2, 3, 8, 3)), 0f32)
        .expect("alloc");
    let mut go = |p: Params, map: Option<&Buffer<i32>>| {
        run(&be, &hx, &hw, map, &mut ids, &mut ws, &p).expect_err("refused")
    };
    let param = |e: &OpsError| match e {
        OpsError::Param { param, .. } => Some(*param),
        _ => None,
    };
    let tensor = |e: &OpsError| match e {
        OpsError::Length { tensor, .. } => Some(*tensor),
        _ => None,
    };
    assert_eq!(param(&go(full(2, 3, 8, 4), None)), Some("public_vocab")); // > rows
    assert_eq!(param(&go(full(2, 3, 8, 0), None)), Some("public_vocab"));
    assert_eq!(param(&go(full(2, 3, 8, 3), Some(&t))), Some("token_ids")); // map on full
    assert_eq!(param(&go(indexed(2, 3, 8, 3), None)), Some("token_ids")); // no map
    assert_eq!(param(&go(full(2, 3, 12, 3), None)), Some("hidden")); // not a multiple of 8
    assert_eq!(param(&go(full(2, 3, 0, 3), None)), Some("hidden"));
    assert_eq!(tensor(&go(full(2, 3, 16, 3), None)), Some("hidden")); // lengths for H = 16
    assert_eq!(tensor(&go(full(1, 3, 8, 3), None)), Some("hidden"));
    assert_eq!(tensor(&go(full(2, 2, 8, 2), None)), Some("head"));
    assert_eq!(param(&go(full(usize::MAX, 3, 8, 3), None)), Some("n"));
    let short = be.upload(&[0, 1]).expect("upload");
    assert_eq!(
        tensor(&go(indexed(2, 3, 8, 3), Some(&short))),
        Some("token_ids")
    );
    // ids and workspace lengths.
    let mut long_ids = be.filled(3, i32::POISON).expect("alloc");
    let e = run(
        &be,
        &hx,
        &hw,
        None,
        &mut long_ids,
        &mut ws,
        &full(2, 3, 8, 3),
    )
    .expect_err("ids");
    assert!(
        matches!(
            e,
            OpsError::Length {
                tensor: "ids",
                expected: 2,
                found: 3,
                ..
            }
        ),
        "{e}"
    );
    let mut small_ws = be
        .filled(workspace_len(&full(2, 3, 8, 3)) - 1, 0f32)
        .expect("alloc");
    let e = run(
        &be,
        &hx,
        &hw,
        None,
        &mut ids,
        &mut small_ws,
        &full(2, 3, 8, 3),
    )
    .expect_err("workspace");
    assert!(
        matches!(
            e,
            OpsError::Length {
                tensor: "workspace",
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(be.download(&ids).expect("dl"), vec![i32::POISON; 2]);
}

#[test]
fn zero_columns_is_a_no_op() {
    let be = Backend::cpu();
    let hx = be.upload::<bf16>(&[]).expect("upload");
    let hw = be.upload(&[bf16::ONE; 32]).expect("upload");
    let p = full(0, 4, 8, 3);
    let mut ids = be.filled(0, i32::POISON).expect("alloc");
    let mut ws = be.filled(workspace_len(&p), 0f32).expect("alloc");
    run(&be, &hx, &hw, None, &mut ids, &mut ws, &p).expect("no-op");
}

#[test]
fn exact_fixture_plants_dominant_twins_and_a_tempting_tail() {
    // The conformance fixture's plan, checked on the CPU: for each column the top logits are
    // the planted twins of hidden[i] (exactly tied: the lower id wins), and the full head's
    // tail holds a larger logit that must be ignored.
    let (n, rows, h, public) = (4, 200, 64, 150);
    let mut mix = Mix(5);
    let (x, w) = exact_head_inputs(&mut mix, n, rows, h, public, ProposalHead::Full, false);
    let mut logits = vec![0f32; n * rows];
    crate::gemm::reference::run_f32(&x, &w, &mut logits, n, rows, h);
    let ids = argmax_inputs(&x, &w, None, &full(n, rows, h, public)).expect("run");
    for i in 0..n {
        let row = &logits[i * rows..(i + 1) * rows];
        let best = row[..public].iter().copied().fold(f32::MIN, f32::max);
        let at: Vec<usize> = (0..public).filter(|&k| row[k] == best).collect();
        assert_eq!(at.len(), 2, "column {i}: twins tie at the top");
        assert_eq!(ids[i], at[0] as i32, "column {i}: lower id");
        let tail = row[public..].iter().copied().fold(f32::MIN, f32::max);
        assert!(tail > best, "column {i}: the tail must tempt");
        // Exact in f32 whatever the order: every logit is a multiple of 2^-8 below 2^13.
        assert!(
            row.iter()
                .all(|v| (v * 256.0).fract() == 0.0 && v.abs() < 8192.0)
        );
    }
}

/// Independent recomputation: sort all candidates by (value desc, id asc).
fn oracle(logits: &[f32], map: Option<&[i32]>, rows: usize, considered: usize) -> Vec<i32> {
    logits
        .chunks_exact(rows)
        .map(|row| {
            let mut c: Vec<(f64, i32)> = (0..considered)
                .map(|k| (f64::from(row[k]) + 0.0, map.map_or(k as i32, |m| m[k])))
                .collect();
            c.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
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
        // Small integer values: many exact ties.
        let logits: Vec<f32> = (0..n * rows).map(|_| mix.below(7) as f32 - 3.0).collect();
        if indexed_head {
            let public_vocab = rows + cut;
            let map = mix.distinct_shuffled(public_vocab, rows);
            let got = argmax(&logits, Some(&map), &indexed(n, rows, 8, public_vocab)).expect("run");
            prop_assert_eq!(got, oracle(&logits, Some(&map), rows, rows));
        } else {
            let public_vocab = 1 + cut % rows;
            let got = argmax(&logits, None, &full(n, rows, 8, public_vocab)).expect("run");
            prop_assert_eq!(got, oracle(&logits, None, rows, public_vocab));
        }
    }

    /// Random exact-data GEMMs (the conformance generator at small sizes): the decision is
    /// the oracle's over the f64 logits.
    #[test]
    fn fused_decision_matches_the_f64_logits(
        n in 1usize..10,
        rows in 16usize..300,
        h8 in 1usize..12,
        coarse in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let h = 8 * h8;
        let public = rows - rows / 5;
        let mut mix = Mix(seed);
        let (x, w) = exact_head_inputs(&mut mix, n, rows, h, public, ProposalHead::Full, coarse);
        let exact = crate::gemm::reference::matmul_f64(&x, &w, n, rows, h);
        let logits: Vec<f32> = exact.iter().map(|&v| v as f32).collect();
        prop_assert!(exact.iter().zip(&logits).all(|(e, l)| f64::from(*l) == *e));
        let got = argmax_inputs(&x, &w, None, &full(n, rows, h, public)).expect("run");
        prop_assert_eq!(got, oracle(&logits, None, rows, public));
    }
}

#[test]
fn head_fixture_fill_is_the_same_stream_for_any_thread_count() {
    // The sequential definition: one SplitMix64 word per 8 entries, bytes in little-endian
    // order, the last word's unused bytes skipped; the stream continues after that word.
    let levels: Vec<bf16> = (0..17).map(|k| bf16::from_f32(k as f32)).collect();
    for (len, modulus) in [(0usize, 17usize), (5, 3), (8 * 1000 + 3, 17), (8 * 4096, 3)] {
        let mut seq = super::Mix(11);
        let mut want = Vec::new();
        while want.len() < len {
            let word = seq.next_u64().to_le_bytes();
            for b in word.into_iter().take(len - want.len()) {
                want.push(levels[usize::from(b) % modulus]);
            }
        }
        for threads in [1, 2, 3, 7, 64] {
            let mut mix = super::Mix(11);
            let got = super::fill_levels_threads(&mut mix, len, &levels[..modulus], threads);
            assert_eq!(got, want, "len {len}, {threads} threads");
            assert_eq!(
                mix.next_u64(),
                seq.clone().next_u64(),
                "len {len}: the stream after"
            );
        }
    }
}
