use super::*;
use proptest::prelude::*;

fn gather(ids: &[i32], table: &[bf16], vocab: usize, hidden: usize) -> Result<Vec<bf16>> {
    let be = Backend::cpu();
    let idb = be.upload(ids)?;
    let tb = be.upload(table)?;
    let mut out = be.filled(ids.len() * hidden, bf16::POISON)?;
    run(
        &be,
        &idb,
        &tb,
        &mut out,
        &EmbeddingGatherParams { vocab, hidden },
    )?;
    be.download(&out)
}

#[test]
fn copies_rows_bit_exactly_including_nan_payloads_and_repeats() {
    // vocab 3, hidden 2; row 1 holds a NaN with a payload and a negative zero.
    let table = [
        bf16::from_f32(1.0),
        bf16::from_f32(2.0),
        bf16::from_bits(0x7fc3),
        bf16::from_bits(0x8000),
        bf16::from_f32(-5.5),
        bf16::from_f32(0.25),
    ];
    let out = gather(&[2, 1, 1, 0], &table, 3, 2).expect("gather");
    let bits: Vec<u16> = out.iter().map(|v| v.to_bits()).collect();
    let t: Vec<u16> = table.iter().map(|v| v.to_bits()).collect();
    assert_eq!(bits, vec![t[4], t[5], t[2], t[3], t[2], t[3], t[0], t[1]]);
}

#[test]
fn out_of_range_ids_are_refused_naming_the_index_and_nothing_is_written() {
    let be = Backend::cpu();
    let table = be.upload(&[bf16::from_f32(1.0); 8]).expect("upload");
    let p = EmbeddingGatherParams {
        vocab: 4,
        hidden: 2,
    };
    for (ids, index, found) in [(vec![0, 3, 4], 2, "4"), (vec![1, -1, 9], 1, "-1")] {
        let idb = be.upload(&ids).expect("upload");
        let mut out = be.filled(6, bf16::POISON).expect("alloc");
        let e = run(&be, &idb, &table, &mut out, &p).expect_err("bad id");
        match &e {
            OpsError::Value {
                tensor: "ids",
                index: i,
                found: f,
                ..
            } => {
                assert_eq!((*i, f.as_str()), (index, found), "{e}");
            }
            _ => panic!("unexpected error {e}"),
        }
        assert!(e.to_string().contains("0..4"), "{e}");
        assert!(
            be.download(&out)
                .expect("dl")
                .iter()
                .all(|v| v.to_bits() == bf16::POISON.to_bits())
        );
    }
}

#[test]
fn wrong_shapes_are_refused() {
    let be = Backend::cpu();
    let ids = be.upload(&[0, 1]).expect("upload");
    let table = be.upload(&[bf16::from_f32(1.0); 8]).expect("upload");
    let mut out = be.filled(4, bf16::POISON).expect("alloc");
    let e = run(
        &be,
        &ids,
        &table,
        &mut out,
        &EmbeddingGatherParams {
            vocab: 3,
            hidden: 2,
        },
    )
    .expect_err("table");
    assert!(
        matches!(
            e,
            OpsError::Length {
                tensor: "table",
                expected: 6,
                found: 8,
                ..
            }
        ),
        "{e}"
    );
    let mut out5 = be.filled(5, bf16::POISON).expect("alloc");
    let e = run(
        &be,
        &ids,
        &table,
        &mut out5,
        &EmbeddingGatherParams {
            vocab: 4,
            hidden: 2,
        },
    )
    .expect_err("out");
    assert!(
        matches!(
            e,
            OpsError::Length {
                tensor: "out",
                expected: 4,
                found: 5,
                ..
            }
        ),
        "{e}"
    );
    let e = run(
        &be,
        &ids,
        &table,
        &mut out,
        &EmbeddingGatherParams {
            vocab: usize::MAX,
            hidden: 2,
        },
    )
    .expect_err("vocab");
    assert!(matches!(e, OpsError::Param { param: "vocab", .. }), "{e}");
}

#[test]
fn case_table_values_are_finite_and_rows_distinct() {
    let row = |r: u64| -> Vec<u16> {
        (0..64)
            .map(|h| table_value(0x7ab1e, r * 64 + h).to_bits())
            .collect()
    };
    assert_ne!(row(0), row(1));
    assert!((0..10_000).all(|i| table_value(3, i).is_finite()));
}

proptest! {
    #[test]
    fn every_output_row_is_the_named_table_row(vocab in 1usize..50, hidden in 1usize..20, n in 0usize..30, seed in any::<u64>()) {
        let table: Vec<bf16> = (0..(vocab * hidden) as u64).map(|i| table_value(seed, i)).collect();
        let ids: Vec<i32> = (0..n).map(|r| ((seed as usize).wrapping_add(r * 31) % vocab) as i32).collect();
        let out = gather(&ids, &table, vocab, hidden).expect("gather");
        prop_assert_eq!(out.len(), n * hidden);
        for r in 0..n {
            for h in 0..hidden {
                prop_assert_eq!(out[r * hidden + h].to_bits(), table[ids[r] as usize * hidden + h].to_bits());
            }
        }
    }
}
