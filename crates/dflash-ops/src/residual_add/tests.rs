use super::*;
use crate::{OpsError, bf16_rne_f64};
use proptest::prelude::*;

fn b(v: f32) -> bf16 {
    bf16::from_f32(v)
}

fn add(x: &[bf16], y: &[bf16]) -> Vec<bf16> {
    let be = Backend::cpu();
    let xb = be.upload(x).expect("upload");
    let yb = be.upload(y).expect("upload");
    let mut out = be.filled(x.len(), bf16::POISON).expect("alloc");
    run(&be, &xb, &yb, &mut out, &ResidualAddParams { n: x.len() }).expect("run");
    be.download(&out).expect("download")
}

#[test]
fn hand_computed_sums_round_once_to_nearest_even() {
    // bf16 spacing at 1 is 2^-7.
    let x = [b(1.0), b(1.0), b(1.0), b(-2.5), b(256.0), b(3.0)];
    let y = [
        b(1.0 / 256.0),                // 1 + 2^-8: tie, even -> 1
        b(3.0 / 256.0),                // 1 + 3*2^-8: tie, even -> 1 + 2^-6
        b(1.0 / 256.0 + 1.0 / 2048.0), // 1 + 2^-8 + 2^-11: above the tie -> 1 + 2^-7
        b(2.5),                        // exact cancellation -> +0
        b(1.0),                        // 257 is a tie between 256 and 258 -> 256
        b(-0.5),
    ];
    let got: Vec<f32> = add(&x, &y).iter().map(|v| v.to_f32()).collect();
    assert_eq!(
        got,
        vec![1.0, 1.0 + 1.0 / 64.0, 1.0 + 1.0 / 128.0, 0.0, 256.0, 2.5]
    );
}

#[test]
fn bf16_rne_f64_rounds_correctly_where_truncating_conversions_fail() {
    // 1 + 2^-8 + 2^-40: above the tie only through bits a 32-bit truncation drops.
    let v = 1.0 + 2f64.powi(-8) + 2f64.powi(-40);
    assert_eq!(bf16_rne_f64(v).to_f32(), 1.0 + 1.0 / 128.0);
    assert_eq!(bf16_rne_f64(-v).to_f32(), -(1.0 + 1.0 / 128.0));
    // Exactly the tie: to even.
    assert_eq!(bf16_rne_f64(1.0 + 2f64.powi(-8)).to_f32(), 1.0);
    // Rounding to f32 first would give the tie 1 + 2^-8 (then to even, 1).
    let w = 1.0 + 2f64.powi(-8) + 2f64.powi(-30);
    assert_eq!(
        (w as f32),
        1.0 + 1.0 / 256.0,
        "f32 rounding lands on the tie"
    );
    assert_eq!(bf16_rne_f64(w).to_f32(), 1.0 + 1.0 / 128.0);
    // Overflow, tiny values and NaN.
    assert!(bf16_rne_f64(1e300).to_f32().is_infinite());
    assert_eq!(bf16_rne_f64(1e-300).to_bits(), 0);
    assert_eq!(bf16_rne_f64(-1e-300).to_bits(), 0x8000);
    assert!(bf16_rne_f64(f64::NAN).is_nan());
    assert_eq!(bf16_rne_f64(3.0).to_f32(), 3.0);
}

#[test]
fn inplace_matches_out_of_place_and_leaves_y() {
    let be = Backend::cpu();
    let xs = bf16_values(7, 333, 4.0);
    let ys = bf16_values(8, 333, 4.0);
    let want = add(&xs, &ys);
    let mut x = be.upload(&xs).expect("upload");
    let y = be.upload(&ys).expect("upload");
    run_inplace(&be, &mut x, &y, &ResidualAddParams { n: 333 }).expect("run");
    assert_eq!(be.download(&x).expect("dl"), want);
    assert_eq!(be.download(&y).expect("dl"), ys);
}

#[test]
fn wrong_lengths_are_refused_without_writing() {
    let be = Backend::cpu();
    let x = be.upload(&[b(1.0); 4]).expect("upload");
    let y = be.upload(&[b(1.0); 3]).expect("upload");
    let mut out = be.filled(4, bf16::POISON).expect("alloc");
    let e = run(&be, &x, &y, &mut out, &ResidualAddParams { n: 4 }).expect_err("short y");
    assert!(
        matches!(
            e,
            OpsError::Length {
                tensor: "y",
                expected: 4,
                found: 3,
                ..
            }
        ),
        "{e}"
    );
    let y = be.upload(&[b(1.0); 4]).expect("upload");
    let mut short = be.filled(5, bf16::POISON).expect("alloc");
    let e = run(&be, &x, &y, &mut short, &ResidualAddParams { n: 4 }).expect_err("long out");
    assert!(matches!(e, OpsError::Length { tensor: "out", .. }), "{e}");
    assert!(
        be.download(&short)
            .expect("dl")
            .iter()
            .all(|v| v.to_bits() == bf16::POISON.to_bits())
    );
    let mut xm = be.upload(&[b(2.0); 4]).expect("upload");
    let e = run_inplace(&be, &mut xm, &y, &ResidualAddParams { n: 3 }).expect_err("n mismatch");
    assert!(matches!(e, OpsError::Length { tensor: "x", .. }), "{e}");
    assert_eq!(be.download(&xm).expect("dl"), vec![b(2.0); 4]);
}

fn any_finite_bf16() -> impl Strategy<Value = bf16> {
    any::<u16>()
        .prop_map(bf16::from_bits)
        .prop_filter("finite", |v| v.is_finite())
}

proptest! {
    // The device method (f32 sum, then RNE to bf16) equals the correctly rounded f64 sum
    // for every pair of finite bf16 values, including overflow to infinity.
    #[test]
    fn reference_equals_f32_sum_rounded_once(pairs in proptest::collection::vec((any_finite_bf16(), any_finite_bf16()), 1..64)) {
        let (x, y): (Vec<bf16>, Vec<bf16>) = pairs.into_iter().unzip();
        let got = add(&x, &y);
        for i in 0..x.len() {
            let f32_way = bf16::from_f32(x[i].to_f32() + y[i].to_f32());
            let exact = x[i].to_f64() + y[i].to_f64();
            prop_assert_eq!(got[i].to_bits(), f32_way.to_bits(), "x={} y={}", x[i], y[i]);
            // Independent check: the result is a nearest bf16 of the exact sum.
            if got[i].is_finite() {
                let g = got[i].to_f64();
                let up = bf16::from_bits(got[i].to_bits().wrapping_add(1)).to_f64();
                prop_assert!((g - exact).abs() <= (up - g).abs() / 2.0 + 1e-300 || exact == g);
            }
        }
    }
}
