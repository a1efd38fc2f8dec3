#![allow(clippy::needless_range_loop)] // reason: index loops mirror the contract formulas

use super::*;
use proptest::prelude::*;

fn hnr(x: &[f32], w: &[bf16], start: &[i32], p: &HeadNormRopeParams) -> Result<Vec<bf16>> {
    let be = Backend::cpu();
    let xb = be.upload(x)?;
    let wb = be.upload(w)?;
    let sb = be.upload(start)?;
    let mut out = be.filled(x.len(), bf16::POISON)?;
    run(&be, &xb, &wb, &sb, &mut out, p)?;
    be.download(&out)
}

/// Every element of `b` still holds the poison (nothing was written).
fn all_poison(be: &Backend, b: &Buffer<bf16>) -> bool {
    be.download(b)
        .expect("dl")
        .iter()
        .all(|x| x.to_bits() == bf16::POISON.to_bits())
}

fn params(rows: usize, cols: usize, heads: usize, d: usize) -> HeadNormRopeParams {
    HeadNormRopeParams {
        rows,
        cols,
        heads,
        head_dim: d,
        eps: 0.0,
        theta: 1e7,
    }
}

#[test]
fn hand_computed_norm_and_rotation() {
    // D = 2, x = [3, 4], w = [1, 0.5], eps 0: rms = sqrt(12.5), n = [0.84852814, 0.56568542].
    // Column 0 at position 0: identity -> bf16 [0.84765625 (0x3f59), 0.56640625 (0x3f11)].
    // Column 1 at position 1 (angle 1 rad, inv_freq_0 = 1):
    //   [n0 cos1 - n1 sin1, n1 cos1 + n0 sin1] = [-0.01754616, 1.0196529]
    //   -> bf16 [-0.017578125 (0xbc90), 1.0234375 (0x3f83)].
    let w = [bf16::from_f32(1.0), bf16::from_f32(0.5)];
    let out = hnr(&[3.0, 4.0, 3.0, 4.0], &w, &[0], &params(1, 2, 1, 2)).expect("run");
    let bits: Vec<u16> = out.iter().map(|x| x.to_bits()).collect();
    assert_eq!(bits, vec![0x3f59, 0x3f11, 0xbc90, 0x3f83]);
}

#[test]
fn angle_is_formed_and_reduced_in_f64_at_large_positions() {
    // At position 2e9 + 5 an f32 product p * inv_freq would be off by ~100 rad; the f64
    // reduction keeps the rotation exact enough that the result equals the direct f64 one.
    let pos: i64 = 2_000_000_005;
    let a = reference::rope_angle(pos, 0, 2, 1e7);
    let direct = (pos as f64).rem_euclid(reference::TWO_PI);
    assert!((a - direct).abs() < 1e-6, "{a} vs {direct}");
    let w = [bf16::from_f32(1.0); 2];
    let out = hnr(&[1.0, 0.0], &w, &[2_000_000_005], &params(1, 1, 1, 2)).expect("run");
    // n = [sqrt(2), 0] -> out = sqrt(2) [cos p, sin p].
    let (s, c) = (pos as f64).sin_cos();
    let want = [2f64.sqrt() * c, 2f64.sqrt() * s];
    for (o, w) in out.iter().zip(want) {
        assert!(
            (f64::from(o.to_f32()) - w).abs() <= w.abs() * 2f64.powi(-8) + 1e-6,
            "{o} vs {w}"
        );
    }
}

#[test]
fn bad_inputs_are_refused_without_writing() {
    let be = Backend::cpu();
    let x = be.upload(&[1.0f32; 8]).expect("up");
    let w = be.upload(&[bf16::ONE; 4]).expect("up");
    let mut out = be.filled(8, bf16::POISON).expect("alloc");
    let sp = be.upload(&[0, -1]).expect("up");
    let e = run(&be, &x, &w, &sp, &mut out, &params(2, 1, 1, 4)).expect_err("negative pos");
    assert!(
        matches!(
            e,
            OpsError::Value {
                tensor: "start_pos",
                index: 1,
                ..
            }
        ),
        "{e}"
    );
    let sp = be.upload(&[0, 0]).expect("up");
    let e = run(&be, &x, &w, &sp, &mut out, &params(2, 1, 1, 3)).expect_err("odd D");
    assert!(
        matches!(
            e,
            OpsError::Param {
                param: "head_dim",
                ..
            }
        ),
        "{e}"
    );
    let e = run(&be, &x, &w, &sp, &mut out, &params(2, 1, 2, 4)).expect_err("x short");
    assert!(matches!(e, OpsError::Length { tensor: "x", .. }), "{e}");
    let mut p = params(2, 1, 1, 4);
    p.theta = 0.0;
    let e = run(&be, &x, &w, &sp, &mut out, &p).expect_err("theta");
    assert!(matches!(e, OpsError::Param { param: "theta", .. }), "{e}");
    assert!(all_poison(&be, &out));
    run(&be, &x, &w, &sp, &mut out, &params(2, 1, 1, 4)).expect("valid");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Against an independent f64 recomputation (unreduced angle, direct sin/cos): every
    /// output within one BF16 rounding of the exact value.
    #[test]
    fn matches_plain_f64_recomputation(
        seed in any::<u64>(),
        rows in 1usize..3,
        cols in 1usize..4,
        heads in 1usize..3,
        half_d in 1usize..9,
        starts in proptest::collection::vec(0i32..i32::MAX - 8, 2),
    ) {
        let d = 2 * half_d;
        let mut g = SplitMix::new(seed);
        let x: Vec<f32> = (0..rows * cols * heads * d).map(|_| g.range(-5.0, 5.0) as f32).collect();
        let w = g.bf16_vec(d, -2.0, 2.0);
        let p = HeadNormRopeParams { rows, cols, heads, head_dim: d, eps: 1e-6, theta: 1e7 };
        let out = hnr(&x, &w, &starts[..rows], &p).expect("run");
        for r in 0..rows {
            for c in 0..cols {
                let pos = i64::from(starts[r]) + c as i64;
                for h in 0..heads {
                    let base = ((r * cols + c) * heads + h) * d;
                    let xs: Vec<f64> = x[base..base + d].iter().map(|&v| f64::from(v)).collect();
                    let rms = (xs.iter().map(|v| v * v).sum::<f64>() / d as f64 + 1e-6f32 as f64).sqrt();
                    let n: Vec<f64> = (0..d).map(|j| f64::from(w[j].to_f32()) * xs[j] / rms).collect();
                    for j in 0..half_d {
                        let ang = pos as f64 * 1e7f64.powf(-((2 * j) as f64) / d as f64);
                        let (s, cs) = ang.sin_cos();
                        let want = [n[j] * cs - n[j + half_d] * s, n[j + half_d] * cs + n[j] * s];
                        for (e, jj) in want.iter().zip([j, j + half_d]) {
                            let got = f64::from(out[base + jj].to_f32());
                            // One BF16 ulp of the exact value, plus the f64 angle error at
                            // |pos| < 2^31 (about 2^31 * 2^-53 rad) times |n|.
                            let tol = e.abs() * 2f64.powi(-7) + 1e-6;
                            prop_assert!((got - e).abs() <= tol, "{} vs {}", got, e);
                        }
                    }
                }
            }
        }
    }

    /// Rotation preserves each pair's norm (up to the two BF16 roundings), and position 0 is
    /// the identity after the norm.
    #[test]
    fn rotation_preserves_pair_norms_and_position_zero_is_identity(
        seed in any::<u64>(), pos in 0i32..1_000_000, half_d in 1usize..65,
    ) {
        let d = 2 * half_d;
        let mut g = SplitMix::new(seed);
        let x: Vec<f32> = (0..d).map(|_| g.range(-3.0, 3.0) as f32).collect();
        let w = g.bf16_vec(d, 0.5, 1.5);
        let p = HeadNormRopeParams { rows: 2, cols: 1, heads: 1, head_dim: d, eps: 1e-6, theta: 1e7 };
        let mut xx = x.clone();
        xx.extend_from_slice(&x);
        let out = hnr(&xx, &w, &[0, pos], &p).expect("run");
        let rms = (x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / d as f64 + 1e-6f32 as f64).sqrt();
        let n: Vec<f64> = (0..d).map(|j| f64::from(w[j].to_f32()) * f64::from(x[j]) / rms).collect();
        for j in 0..d {
            prop_assert_eq!(out[j], crate::bf16_rne_f64(n[j]));
        }
        for j in 0..half_d {
            let before = n[j].hypot(n[j + half_d]);
            let after = f64::from(out[d + j].to_f32()).hypot(f64::from(out[d + j + half_d].to_f32()));
            prop_assert!((after - before).abs() <= before * 2f64.powi(-8) + 1e-12, "{} vs {}", after, before);
        }
    }
}

fn qkv_params(rows: usize, cols: usize, hq: usize, hkv: usize, d: usize) -> QkvParams {
    QkvParams {
        rows,
        cols,
        q_heads: hq,
        kv_heads: hkv,
        head_dim: d,
        eps: 1e-6,
        theta: 1e7,
    }
}

/// The fused form's outputs on the CPU: (angles, q, k, v).
type Fused = (Vec<f32>, Vec<bf16>, Vec<bf16>, Vec<bf16>);

/// The fused form on the CPU.
fn fused(x: &[f32], wq: &[bf16], wk: &[bf16], start: &[i32], p: &QkvParams) -> Result<Fused> {
    let be = Backend::cpu();
    let (_, table, nq, nkv, _) = p.sizes()?;
    let mut angles = be.filled(table, f32::NAN)?;
    rope_table(&be, &be.upload(start)?, &mut angles, p)?;
    let (mut q, mut k, mut v) = (
        be.filled(nq, bf16::POISON)?,
        be.filled(nkv, bf16::POISON)?,
        be.filled(nkv, bf16::POISON)?,
    );
    let (wqb, wkb) = (be.upload(wq)?, be.upload(wk)?);
    let out = QkvOut {
        q: &mut q,
        k: &mut k,
        v: &mut v,
    };
    run_qkv(&be, &be.upload(x)?, &wqb, &wkb, &angles, out, p)?;
    Ok((
        be.download(&angles)?,
        be.download(&q)?,
        be.download(&k)?,
        be.download(&v)?,
    ))
}

#[test]
fn rope_table_holds_the_narrowed_reduced_angles() {
    // D = 4 (pairs j = 0, 1), theta 1e4: inv_freq = [1, 1e-2]. Position 0: all zero;
    // position 7: [7 rad reduced = 7 - 2 pi = 0.71681469, 0.07].
    let p = QkvParams {
        theta: 1e4,
        ..qkv_params(2, 1, 1, 1, 4)
    };
    let x = vec![1.0f32; 2 * 3 * 4];
    let w = vec![bf16::from_f32(1.0); 4];
    let (angles, ..) = fused(&x, &w, &w, &[0, 7], &p).expect("run");
    assert_eq!(angles[..2], [0.0, 0.0]);
    assert_eq!(angles[2], (7.0 - std::f64::consts::TAU) as f32);
    assert_eq!(angles[3], (7.0f64 * 1e-2) as f32);
}

#[test]
fn qkv_form_routes_heads_and_matches_the_plain_op() {
    // 2 rows x 3 columns, Hq 3, Hkv 2, D 8: every head of every token at its own scale.
    let (rows, cols, hq, hkv, d) = (2, 3, 3, 2, 8);
    let p = qkv_params(rows, cols, hq, hkv, d);
    let heads = hq + 2 * hkv;
    let tokens = rows * cols;
    let mut g = SplitMix::new(77);
    let x: Vec<f32> = (0..tokens * heads * d)
        .map(|i| (g.range(-1.0, 1.0) * (1.0 + (i / d) as f64)) as f32)
        .collect();
    let (wq, wk) = (g.bf16_vec(d, -1.5, 1.5), g.bf16_vec(d, -1.5, 1.5));
    let start = [5, 123_456];
    let (_, q, k, v) = fused(&x, &wq, &wk, &start, &p).expect("run");
    // The heads of one role, gathered out of the fused layout.
    let part = |h0: usize, n: usize| -> Vec<f32> {
        (0..tokens)
            .flat_map(|t| x[(t * heads + h0) * d..(t * heads + h0 + n) * d].to_vec())
            .collect()
    };
    let plain = |h0: usize, n: usize, w: &[bf16]| {
        hnr(&part(h0, n), w, &start, &params(rows, cols, n, d)).expect("plain")
    };
    // The plain op forms f64 angles; the fused one narrows them to f32: at most one BF16
    // rounding flip apart (and equal almost everywhere).
    let near = |a: &[bf16], b: &[bf16]| {
        let flips = a.iter().zip(b).filter(|(x, y)| x != y).count();
        assert!(flips * 20 <= a.len(), "{flips} of {} differ", a.len());
        for (x, y) in a.iter().zip(b) {
            assert!(x.to_bits().abs_diff(y.to_bits()) <= 1, "{x} vs {y}");
        }
    };
    near(&q, &plain(0, hq, &wq));
    near(&k, &plain(hq, hkv, &wk));
    let want_v: Vec<bf16> = part(hq + hkv, hkv)
        .iter()
        .map(|&f| crate::bf16_rne_f64(f64::from(f)))
        .collect();
    assert_eq!(v, want_v);
}

#[test]
fn qkv_form_refuses_bad_shapes_and_positions_without_writing() {
    let be = Backend::cpu();
    let p = qkv_params(1, 2, 2, 1, 4);
    let x = be.upload(&[1.0f32; 2 * 4 * 4]).expect("up");
    let w = be.upload(&[bf16::from_f32(1.0); 4]).expect("up");
    let angles = be.upload(&[0.0f32; 4]).expect("up");
    let (mut q, mut k, mut v) = (
        be.filled(16, bf16::POISON).expect("alloc"),
        be.filled(7, bf16::POISON).expect("alloc"),
        be.filled(8, bf16::POISON).expect("alloc"),
    );
    let out = QkvOut {
        q: &mut q,
        k: &mut k,
        v: &mut v,
    };
    let e = run_qkv(&be, &x, &w, &w, &angles, out, &p).expect_err("k short");
    assert!(
        matches!(
            e,
            OpsError::Length {
                tensor: "k",
                expected: 8,
                ..
            }
        ),
        "{e}"
    );
    for b in [&q, &k, &v] {
        assert!(all_poison(&be, b));
    }
    // Every other tensor of the fused form, short by one, named.
    let short_f = |n: usize| be.upload(&vec![0.0f32; n]).expect("up");
    let short_b = |n: usize| be.upload(&vec![bf16::from_f32(1.0); n]).expect("up");
    let (mut q, mut k, mut v) = (
        be.filled(16, bf16::POISON).expect("alloc"),
        be.filled(8, bf16::POISON).expect("alloc"),
        be.filled(8, bf16::POISON).expect("alloc"),
    );
    let mut call = |x: &Buffer<f32>, q_w: &Buffer<bf16>, angles: &Buffer<f32>| {
        let out = QkvOut {
            q: &mut q,
            k: &mut k,
            v: &mut v,
        };
        run_qkv(&be, x, q_w, &w, angles, out, &p)
    };
    for (name, e) in [
        ("qkv", call(&short_f(31), &w, &angles)),
        ("q_norm", call(&x, &short_b(3), &angles)),
        ("angles", call(&x, &w, &short_f(3))),
    ] {
        let e = e.expect_err(name);
        assert!(
            matches!(e, OpsError::Length { tensor, .. } if tensor == name),
            "{e}"
        );
    }
    for b in [&q, &k, &v] {
        assert!(all_poison(&be, b));
    }
    let mut short_table = be.filled(3, f32::NAN).expect("alloc");
    let e =
        rope_table(&be, &be.upload(&[0]).expect("up"), &mut short_table, &p).expect_err("table");
    assert!(
        matches!(
            e,
            OpsError::Length {
                tensor: "angles",
                ..
            }
        ),
        "{e}"
    );
    let mut table = be.filled(4, f32::NAN).expect("alloc");
    let neg = be.upload(&[-1]).expect("up");
    let e = rope_table(&be, &neg, &mut table, &p).expect_err("negative");
    assert!(
        matches!(
            e,
            OpsError::Value {
                tensor: "start_pos",
                ..
            }
        ),
        "{e}"
    );
    assert!(be.download(&table).expect("dl").iter().all(|a| a.is_nan()));
    let odd = QkvParams { head_dim: 3, ..p };
    let e = rope_table(&be, &neg, &mut table, &odd).expect_err("odd d");
    assert!(
        matches!(
            e,
            OpsError::Param {
                param: "head_dim",
                ..
            }
        ),
        "{e}"
    );
}
