#![allow(clippy::needless_range_loop)] // reason: index loops mirror the contract formulas

use super::*;
use crate::bf16_rne_f64;
use proptest::prelude::*;

fn b(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

fn project(
    s: &[bf16],
    w: &[bf16],
    norm: &[bf16],
    p: &FeatureProjectionParams,
) -> Result<Vec<bf16>> {
    let be = Backend::cpu();
    let sb = be.upload(s)?;
    let wb = be.upload(w)?;
    let nb = be.upload(norm)?;
    let mut c = be.filled(p.tokens * p.hidden, bf16::POISON)?;
    run(&be, &sb, &wb, &nb, &mut c, p)?;
    be.download(&c)
}

#[test]
fn hand_computed_projection_then_plain_norm() {
    // n_ids 2, H 2: s = [1, 2 | 3, 4]; W = [[1, 0, 0, 0], [0, 0, 0, 1]] -> proj = [1, 4];
    // rms = sqrt(8.5) = 2.9154759; c = [0.34299717, 1.3719887]
    // -> bf16 RNE [0.34375 (0x3eb0), 1.375 (0x3fb0)].
    let p = FeatureProjectionParams {
        tokens: 1,
        n_ids: 2,
        hidden: 2,
        eps: 0.0,
    };
    let c = project(
        &b(&[1.0, 2.0, 3.0, 4.0]),
        &b(&[1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]),
        &b(&[1.0, 1.0]),
        &p,
    )
    .expect("run");
    assert_eq!(
        c.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        vec![0x3eb0, 0x3fb0]
    );
}

#[test]
fn projection_is_not_rounded_before_the_norm() {
    // proj = [261, 200]: BF16 would round 261 to 260 (ulp 2 at 256) before the norm, and
    // with eps 0 and weights [1, 1] that changes both rounded outputs (checked below).
    let p = FeatureProjectionParams {
        tokens: 1,
        n_ids: 1,
        hidden: 2,
        eps: 0.0,
    };
    let s = b(&[256.0, 5.0]);
    let w = b(&[1.0, 1.0, 0.0, 40.0]); // proj = [261, 200]
    let c = project(&s, &w, &b(&[1.0, 1.0]), &p).expect("run");
    let exact = |p0: f64, p1: f64| {
        let rms = ((p0 * p0 + p1 * p1) / 2.0).sqrt();
        [bf16_rne_f64(p0 / rms), bf16_rne_f64(p1 / rms)]
    };
    let want = exact(261.0, 200.0);
    let rounded_first = exact(260.0, 200.0);
    assert_eq!(c, want.to_vec());
    assert_ne!(
        want[0], rounded_first[0],
        "fixture must distinguish the rounding point"
    );
    assert_ne!(
        want[1], rounded_first[1],
        "fixture must distinguish the rounding point"
    );
}

#[test]
fn bad_shapes_are_refused_without_writing() {
    let be = Backend::cpu();
    let p = FeatureProjectionParams {
        tokens: 2,
        n_ids: 2,
        hidden: 3,
        eps: 1e-6,
    };
    let s = be.upload(&b(&[1.0; 12])).expect("up");
    let w = be.upload(&b(&[1.0; 17])).expect("up");
    let n = be.upload(&b(&[1.0; 3])).expect("up");
    let mut c = be.filled(6, bf16::POISON).expect("alloc");
    let e = run(&be, &s, &w, &n, &mut c, &p).expect_err("w short");
    assert!(
        matches!(
            e,
            OpsError::Length {
                tensor: "w_feature",
                expected: 18,
                ..
            }
        ),
        "{e}"
    );
    let w = be.upload(&b(&[1.0; 18])).expect("up");
    let bad = FeatureProjectionParams { n_ids: 0, ..p };
    let e = run(&be, &s, &w, &n, &mut c, &bad).expect_err("n_ids 0");
    assert!(matches!(e, OpsError::Param { param: "n_ids", .. }), "{e}");
    assert!(
        be.download(&c)
            .expect("dl")
            .iter()
            .all(|v| v.to_bits() == bf16::POISON.to_bits())
    );
    run(&be, &s, &w, &n, &mut c, &p).expect("valid call");
    assert_eq!(scratch_len(&p).expect("len"), 6);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Against an independent f64 recomputation on grid inputs (projection exact).
    #[test]
    fn matches_plain_f64_recomputation(seed in any::<u64>(), t in 1usize..4, n_ids in 1usize..4, h in 1usize..12) {
        let mut g = SplitMix::new(seed);
        let k = n_ids * h;
        let s: Vec<bf16> = (0..t * k).map(|_| bf16::from_f32((g.below(97) as f32 - 48.0) / 16.0)).collect();
        let w: Vec<bf16> = (0..h * k).map(|_| bf16::from_f32((g.below(129) as f32 - 64.0) / 64.0)).collect();
        let norm = g.bf16_vec(h, -2.0, 2.0);
        let p = FeatureProjectionParams { tokens: t, n_ids, hidden: h, eps: 1e-6 };
        let c = project(&s, &w, &norm, &p).expect("run");
        for tok in 0..t {
            let proj: Vec<f64> = (0..h)
                .map(|i| (0..k).rev().map(|l| f64::from(w[i * k + l].to_f32()) * f64::from(s[tok * k + l].to_f32())).sum())
                .collect();
            let ms = proj.iter().map(|v| v * v).sum::<f64>() / h as f64;
            let rms = (ms + f64::from(1e-6f32)).sqrt();
            for i in 0..h {
                let want = f64::from(norm[i].to_f32()) * proj[i] / rms;
                let got = c[tok * h + i];
                prop_assert!(
                    got == bf16_rne_f64(want)
                        || (f64::from(got.to_f32()) - want).abs() <= want.abs() * 2f64.powi(-8) * (1.0 + 1e-12),
                    "token {} i {}: {} vs {}", tok, i, got, want
                );
            }
        }
    }
}
