use super::*;
use crate::OpsError;
use proptest::prelude::*;

fn b(v: f32) -> bf16 {
    bf16::from_f32(v)
}

fn swiglu(gate: &[bf16], up: &[bf16], rows: usize, inter: usize) -> Vec<bf16> {
    let be = Backend::cpu();
    let g = be.upload(gate).expect("upload");
    let u = be.upload(up).expect("upload");
    let mut out = be.filled(rows * inter, bf16::POISON).expect("alloc");
    run(&be, &g, &u, &mut out, &SwigluParams { rows, inter }).expect("run");
    be.download(&out).expect("download")
}

#[test]
fn hand_computed_values() {
    // silu(0) = 0; silu(x) for large x is x; silu(-large) underflows to -0 * up.
    // silu(2) * 1 = 2 / (1 + e^-2) = 1.7615941559557646; bf16 spacing 2^-7: 1.7578125
    // (|diff| 0.00378) vs 1.765625 (0.00403) -> 1.7578125.
    // silu(-1) * 4 = -4 / (1 + e) = -1.0757656854...; bf16 spacing 2^-7: -1.078125
    // (|diff| 0.00236) vs -1.0703125 (0.0054) -> -1.078125.
    let gate = [b(0.0), b(2.0), b(-1.0), b(100.0), b(-200.0), b(1.0)];
    let up = [b(5.0), b(1.0), b(4.0), b(0.5), b(3.0), b(-2.0)];
    let got: Vec<f32> = swiglu(&gate, &up, 2, 3)
        .iter()
        .map(|v| v.to_f32())
        .collect();
    // silu(1) * -2 = -2 / (1 + e^-1) = -1.4621171572600098 -> spacing 2^-7: -1.4609375
    // (0.00118) vs -1.46875 (0.0066) -> -1.4609375.
    assert_eq!(got, vec![0.0, 1.7578125, -1.078125, 50.0, -0.0, -1.4609375]);
}

#[test]
fn product_is_rounded_once_not_silu_first() {
    // silu(g) * u where rounding silu(g) to bf16 first changes the result: search a fixed
    // grid for such a pair and check the reference follows the unrounded path there.
    let mut found = 0;
    for gi in 1..200u16 {
        let g = b(gi as f32 * 0.0371);
        let u = b(3.0 + gi as f32 * 0.013);
        let got = swiglu(&[g], &[u], 1, 1)[0];
        let s = reference::silu(g.to_f64());
        let once = crate::bf16_rne_f64(s * u.to_f64());
        let twice = crate::bf16_rne_f64(crate::bf16_rne_f64(s).to_f64() * u.to_f64());
        assert_eq!(got.to_bits(), once.to_bits(), "g={g} u={u}");
        if once != twice {
            found += 1;
        }
    }
    assert!(
        found > 5,
        "the grid must exercise the rounding point ({found} pairs)"
    );
}

#[test]
fn fused_layout_matches_separate() {
    let (rows, inter) = (3, 5);
    let gate = bf16_values(11, rows * inter, 4.0);
    let up = bf16_values(12, rows * inter, 4.0);
    let want = swiglu(&gate, &up, rows, inter);
    let mut gu = Vec::new();
    for r in 0..rows {
        gu.extend_from_slice(&gate[r * inter..(r + 1) * inter]);
        gu.extend_from_slice(&up[r * inter..(r + 1) * inter]);
    }
    let be = Backend::cpu();
    let gub = be.upload(&gu).expect("upload");
    let mut out = be.filled(rows * inter, bf16::POISON).expect("alloc");
    run_fused(&be, &gub, &mut out, &SwigluParams { rows, inter }).expect("run");
    assert_eq!(be.download(&out).expect("dl"), want);
    assert_eq!(be.download(&gub).expect("dl"), gu, "input unchanged");
}

#[test]
fn wrong_lengths_are_refused_without_writing() {
    let be = Backend::cpu();
    let p = SwigluParams { rows: 2, inter: 3 };
    let g = be.upload(&[b(1.0); 6]).expect("upload");
    let u = be.upload(&[b(1.0); 5]).expect("upload");
    let mut out = be.filled(6, bf16::POISON).expect("alloc");
    let e = run(&be, &g, &u, &mut out, &p).expect_err("short up");
    assert!(
        matches!(
            e,
            OpsError::Length {
                tensor: "up",
                expected: 6,
                found: 5,
                ..
            }
        ),
        "{e}"
    );
    let gu = be.upload(&[b(1.0); 6]).expect("upload");
    let e = run_fused(&be, &gu, &mut out, &p).expect_err("fused needs 2 * inter");
    assert!(
        matches!(
            e,
            OpsError::Length {
                tensor: "gate_up",
                expected: 12,
                ..
            }
        ),
        "{e}"
    );
    assert!(
        be.download(&out)
            .expect("dl")
            .iter()
            .all(|v| v.to_bits() == bf16::POISON.to_bits())
    );
    let huge = SwigluParams {
        rows: usize::MAX,
        inter: 2,
    };
    assert!(matches!(
        run(&be, &g, &g, &mut out, &huge),
        Err(OpsError::Param { .. })
    ));
}

fn finite_bf16(scale: f32) -> impl Strategy<Value = bf16> {
    (-1.0f32..1.0).prop_map(move |v| bf16::from_f32(v * scale))
}

proptest! {
    // Against an independent f64 recomputation (logistic form) and within the device
    // criterion of the f32 device formula.
    #[test]
    fn matches_f64_recomputation(rows in 1usize..4, inter in 1usize..40, seed in any::<u64>(), scale in prop_oneof![Just(1.0f32), Just(8.0), Just(90.0)]) {
        let n = rows * inter;
        let gate: Vec<bf16> = bf16_values(seed, n, scale);
        let up: Vec<bf16> = bf16_values(seed ^ 1, n, 4.0);
        let got = swiglu(&gate, &up, rows, inter);
        for i in 0..n {
            let g = gate[i].to_f64();
            let sig = 1.0 / (1.0 + (-g).exp());
            let want = crate::bf16_rne_f64(g * sig * up[i].to_f64());
            // g * sigmoid and g / (1 + e^-g) may differ in the last f64 bit: allow only a
            // one-ulp disagreement, and only at a bf16 rounding boundary.
            prop_assert!(
                crate::registry::element_ok(CRITERION, want.to_f64(), got[i].to_f64(), 0, 0),
                "i={} g={} u={} got={} want={}", i, gate[i], up[i], got[i], want
            );
            // The f32 device formula stays within the criterion.
            let gf = gate[i].to_f32();
            let e = (-gf.abs()).exp();
            let s = if gf >= 0.0 { 1.0 / (1.0 + e) } else { e / (1.0 + e) };
            let dev = bf16::from_f32(gf * s * up[i].to_f32());
            prop_assert!(
                crate::registry::element_ok(CRITERION, got[i].to_f64(), dev.to_f64(), 0, 0),
                "device formula g={} u={} dev={} ref={}", gate[i], up[i], dev, got[i]
            );
        }
    }

    #[test]
    fn fused_equals_separate_for_any_values(g in proptest::collection::vec(finite_bf16(20.0), 12), u in proptest::collection::vec(finite_bf16(20.0), 12)) {
        let want = swiglu(&g, &u, 3, 4);
        let mut gu = Vec::new();
        for r in 0..3 {
            gu.extend_from_slice(&g[r * 4..r * 4 + 4]);
            gu.extend_from_slice(&u[r * 4..r * 4 + 4]);
        }
        let be = Backend::cpu();
        let gub = be.upload(&gu).expect("upload");
        let mut out = be.filled(12, bf16::POISON).expect("alloc");
        run_fused(&be, &gub, &mut out, &SwigluParams { rows: 3, inter: 4 }).expect("run");
        prop_assert_eq!(be.download(&out).expect("dl"), want);
    }
}
