#![allow(clippy::needless_range_loop)] // reason: index loops mirror the contract formulas

use super::*;
use crate::bf16_rne_f64;
use proptest::prelude::*;

fn b(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

fn bits(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Every element of `y` still holds the poison (nothing was written).
fn all_poison(be: &Backend, y: &Buffer<bf16>) -> bool {
    be.download(y)
        .expect("dl")
        .iter()
        .all(|v| v.to_bits() == bf16::POISON.to_bits())
}

fn norm(x: &[bf16], w: &[bf16], rows: usize, eps: f32) -> Vec<bf16> {
    let be = Backend::cpu();
    let xb = be.upload(x).expect("upload");
    let wb = be.upload(w).expect("upload");
    let mut y = be.filled(x.len(), bf16::POISON).expect("alloc");
    let p = RmsNormParams {
        rows,
        hidden: w.len(),
        eps,
    };
    run(&be, &xb, &wb, &mut y, &p).expect("run");
    be.download(&y).expect("dl")
}

#[test]
fn hand_computed_row_is_plain_not_zero_centred() {
    // x = [3, 4], w = [1, 2], eps 0: rms = sqrt(12.5) = 3.5355339;
    // y = [0.84852814, 2.2627417] -> bf16 RNE [0.84765625 (0x3f59), 2.265625 (0x4011)].
    assert_eq!(
        bits(&norm(&b(&[3.0, 4.0]), &b(&[1.0, 2.0]), 1, 0.0)),
        vec![0x3f59, 0x4011]
    );
    // A zero weight gives zero (plain `w * ...`; a zero-centred norm would give x / rms).
    assert_eq!(bits(&norm(&b(&[3.0, 4.0]), &b(&[0.0, 1.0]), 1, 0.0))[0], 0);
}

#[test]
fn power_of_two_scaling_of_a_row_is_invisible_with_zero_eps() {
    let mut g = SplitMix::new(4);
    let x = g.bf16_vec(37, -1.0, 1.0);
    let x4: Vec<bf16> = x.iter().map(|v| bf16::from_f32(v.to_f32() * 4.0)).collect();
    let w = g.bf16_vec(37, -2.0, 2.0);
    assert_eq!(bits(&norm(&x, &w, 1, 0.0)), bits(&norm(&x4, &w, 1, 0.0)));
}

#[test]
fn f32_and_bf16_inputs_agree_on_representable_values() {
    let be = Backend::cpu();
    let mut g = SplitMix::new(5);
    let x = g.bf16_vec(3 * 20, -3.0, 3.0);
    let w = g.bf16_vec(20, -1.0, 1.0);
    let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    let p = RmsNormParams {
        rows: 3,
        hidden: 20,
        eps: 1e-6,
    };
    let (xfb, wb) = (be.upload(&xf).expect("up"), be.upload(&w).expect("up"));
    let mut y = be.filled(60, bf16::POISON).expect("alloc");
    run_f32(&be, &xfb, &wb, &mut y, &p).expect("run");
    assert_eq!(
        bits(&be.download(&y).expect("dl")),
        bits(&norm(&x, &w, 3, 1e-6))
    );
}

#[test]
fn bad_inputs_are_refused_without_writing() {
    let be = Backend::cpu();
    let x = be.upload(&b(&[1.0; 6])).expect("up");
    let w = be.upload(&b(&[1.0; 3])).expect("up");
    let mut y = be.filled(6, bf16::POISON).expect("alloc");
    let p = |rows, hidden, eps| RmsNormParams { rows, hidden, eps };
    let e = run(&be, &x, &w, &mut y, &p(3, 3, 1e-6)).expect_err("x short");
    assert!(
        matches!(
            e,
            OpsError::Length {
                tensor: "x",
                expected: 9,
                ..
            }
        ),
        "{e}"
    );
    let e = run(&be, &x, &w, &mut y, &p(2, 3, f32::NAN)).expect_err("eps");
    assert!(matches!(e, OpsError::Param { param: "eps", .. }), "{e}");
    let e = run(&be, &x, &w, &mut y, &p(6, 0, 1e-6)).expect_err("hidden 0");
    assert!(
        matches!(
            e,
            OpsError::Param {
                param: "hidden",
                ..
            }
        ),
        "{e}"
    );
    let mut short = be.filled(5, bf16::POISON).expect("alloc");
    let e = run(&be, &x, &w, &mut short, &p(2, 3, 1e-6)).expect_err("y short");
    assert!(matches!(e, OpsError::Length { tensor: "y", .. }), "{e}");
    assert!(all_poison(&be, &y));
}

#[test]
fn residual_form_is_the_add_then_the_norm_bit_for_bit() {
    let be = Backend::cpu();
    let mut g = SplitMix::new(9);
    let (rows, h) = (3, 41);
    let x0 = g.bf16_vec(rows * h, -4.0, 4.0);
    let delta = g.bf16_vec(rows * h, -4.0, 4.0);
    let w = g.bf16_vec(h, -2.0, 2.0);
    let p = RmsNormParams {
        rows,
        hidden: h,
        eps: 1e-6,
    };
    let (db, wb) = (be.upload(&delta).expect("up"), be.upload(&w).expect("up"));
    let mut x = be.upload(&x0).expect("up");
    let mut y = be.filled(rows * h, bf16::POISON).expect("alloc");
    run_residual(&be, &mut x, &db, &wb, &mut y, &p).expect("run");
    // The unfused sequence.
    let mut x2 = be.upload(&x0).expect("up");
    crate::residual_add::run_inplace(
        &be,
        &mut x2,
        &db,
        &crate::residual_add::ResidualAddParams { n: rows * h },
    )
    .expect("add");
    let x2h = be.download(&x2).expect("dl");
    assert_eq!(bits(&be.download(&x).expect("dl")), bits(&x2h));
    assert_eq!(
        bits(&be.download(&y).expect("dl")),
        bits(&norm(&x2h, &w, rows, 1e-6))
    );
    // The sum really happened (a wrong form that normalized x0 would differ).
    assert_ne!(bits(&x2h), bits(&x0));
}

#[test]
fn residual_form_refuses_a_short_delta_without_writing() {
    let be = Backend::cpu();
    let x0 = b(&[1.0; 6]);
    let mut x = be.upload(&x0).expect("up");
    let delta = be.upload(&b(&[1.0; 5])).expect("up");
    let w = be.upload(&b(&[1.0; 3])).expect("up");
    let mut y = be.filled(6, bf16::POISON).expect("alloc");
    let p = RmsNormParams {
        rows: 2,
        hidden: 3,
        eps: 1e-6,
    };
    let e = run_residual(&be, &mut x, &delta, &w, &mut y, &p).expect_err("delta short");
    assert!(
        matches!(
            e,
            OpsError::Length {
                tensor: "delta",
                expected: 6,
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(bits(&be.download(&x).expect("dl")), bits(&x0));
    assert!(all_poison(&be, &y));
}

#[test]
fn row_map_form_normalizes_the_selected_rows_as_the_plain_form_does() {
    let be = Backend::cpu();
    let mut g = SplitMix::new(12);
    let (reqs, k, h) = (3, 4, 19);
    let x = g.bf16_vec(reqs * (k + 1) * h, -3.0, 3.0);
    let w = g.bf16_vec(h, -2.0, 2.0);
    let map = RowMap::mask_columns(k);
    let p = RmsNormParams {
        rows: reqs * k,
        hidden: h,
        eps: 1e-6,
    };
    let (xb, wb) = (be.upload(&x).expect("up"), be.upload(&w).expect("up"));
    let mut y = be.filled(reqs * k * h, bf16::POISON).expect("alloc");
    run_rows(&be, &xb, &wb, &mut y, &p, &map).expect("run");
    // Rows 1..=k of each block of k + 1, gathered by hand.
    let picked: Vec<bf16> = (0..reqs)
        .flat_map(|r| (1..=k).map(move |c| r * (k + 1) + c))
        .flat_map(|row| x[row * h..(row + 1) * h].to_vec())
        .collect();
    assert_eq!(
        bits(&be.download(&y).expect("dl")),
        bits(&norm(&picked, &w, reqs * k, 1e-6))
    );
    // The identity map is the plain form.
    let mut y2 = be.filled(x.len(), bf16::POISON).expect("alloc");
    let all = RmsNormParams {
        rows: reqs * (k + 1),
        ..p
    };
    run_rows(&be, &xb, &wb, &mut y2, &all, &RowMap::IDENTITY).expect("identity");
    assert_eq!(
        bits(&be.download(&y2).expect("dl")),
        bits(&norm(&x, &w, reqs * (k + 1), 1e-6))
    );
}

#[test]
fn row_map_form_refuses_bad_maps_and_short_tensors_without_writing() {
    let be = Backend::cpu();
    let x = be.upload(&b(&[1.0; 12])).expect("up");
    let w = be.upload(&b(&[1.0; 2])).expect("up");
    let mut y = be.filled(8, bf16::POISON).expect("alloc");
    let p = RmsNormParams {
        rows: 4,
        hidden: 2,
        eps: 1e-6,
    };
    let map = |group, stride, offset| RowMap {
        group,
        stride,
        offset,
    };
    for (m, param) in [
        (map(0, 3, 1), "map.group"),
        (map(3, 3, 0), "map.group"),  // 4 rows are not whole groups of 3
        (map(2, 2, 1), "map.stride"), // offset + group passes the block
    ] {
        let e = run_rows(&be, &x, &w, &mut y, &p, &m).expect_err(param);
        assert!(
            matches!(e, OpsError::Param { param: got, .. } if got == param),
            "{e}"
        );
    }
    // 2 blocks of 3 rows hold the 4 mask rows: x needs 6 rows, not 5.
    let short = be.upload(&b(&[1.0; 10])).expect("up");
    let e = run_rows(&be, &short, &w, &mut y, &p, &map(2, 3, 1)).expect_err("x short");
    assert!(
        matches!(
            e,
            OpsError::Length {
                tensor: "x",
                expected: 12,
                ..
            }
        ),
        "{e}"
    );
    assert!(all_poison(&be, &y));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Against an independent f64 recomputation (reversed summation), exact bits: grid inputs
    /// make the sum of squares exact in any order.
    #[test]
    fn matches_plain_f64_recomputation(seed in any::<u64>(), rows in 1usize..4, h in 1usize..50) {
        let mut g = SplitMix::new(seed);
        let x: Vec<bf16> = (0..rows * h).map(|_| bf16::from_f32((g.below(97) as f32 - 48.0) / 16.0)).collect();
        let w = g.bf16_vec(h, -2.0, 2.0);
        let y = norm(&x, &w, rows, 1e-6);
        for r in 0..rows {
            let row: Vec<f64> = x[r * h..(r + 1) * h].iter().map(|v| f64::from(v.to_f32())).collect();
            let ss: f64 = row.iter().rev().map(|v| v * v).sum();
            let rms = (ss / h as f64 + f64::from(1e-6f32)).sqrt();
            for j in 0..h {
                let want = f64::from(w[j].to_f32()) * row[j] / rms;
                let got = f64::from(y[r * h + j].to_f32());
                // Division vs multiplication by the reciprocal differ in the last f64 bit:
                // allow the neighbouring BF16 value only when the exact value is that close.
                let exact = bf16_rne_f64(want);
                prop_assert!(
                    y[r * h + j] == exact || (got - want).abs() <= want.abs() * 2f64.powi(-8) * (1.0 + 1e-12),
                    "row {} j {}: {} vs {}", r, j, got, want
                );
            }
        }
    }
}
