use super::*;
use crate::bf16_rne_f64;
use proptest::prelude::*;

fn b(v: f32) -> bf16 {
    bf16::from_f32(v)
}

fn p(rows: usize, cols: usize, hidden: usize, eps: f32) -> ConvParams {
    ConvParams {
        rows,
        cols,
        hidden,
        group: GROUP,
        eps,
    }
}

struct Prepared {
    prepared: Vec<bf16>,
    fd: Vec<bf16>,
}

fn run_prepare(x: &[bf16], w: &[bf16], base: &[bf16], wd: &[bf16], q: &ConvParams) -> Prepared {
    let be = Backend::cpu();
    let act = q.rows * q.cols * q.hidden;
    let mut pr = be.filled(act, bf16::POISON).expect("alloc");
    let mut fd = be
        .filled(q.rows * q.cols * 2 * q.groups(), bf16::POISON)
        .expect("alloc");
    let up = |v: &[bf16]| be.upload(v).expect("upload");
    let mut sc = PrepareScratch::new(&be, q).expect("scratch");
    prepare(
        &be,
        &up(x),
        &up(w),
        &up(base),
        &up(wd),
        &mut pr,
        &mut fd,
        &mut sc,
        q,
    )
    .expect("prepare");
    Prepared {
        prepared: be.download(&pr).expect("dl"),
        fd: be.download(&fd).expect("dl"),
    }
}

fn run_finish(z: &[bf16], fd: &[bf16], base: &[bf16], res: &[bf16], q: &ConvParams) -> Vec<bf16> {
    let be = Backend::cpu();
    let mut out = be.filled(z.len(), bf16::POISON).expect("alloc");
    let up = |v: &[bf16]| be.upload(v).expect("upload");
    finish(&be, &up(z), &up(fd), &up(base), &up(res), &mut out, q).expect("finish");
    be.download(&out).expect("dl")
}

fn f32s(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// H = 16 column with twelve ones: with eps = 0.25, mean(x^2) + eps = 1, so n = norm_w * x.
fn ones(first: usize) -> Vec<bf16> {
    (0..16)
        .map(|c| {
            b(if c >= first && c < first + 12 {
                1.0
            } else {
                0.0
            })
        })
        .collect()
}

fn unit(c: usize, v: f32) -> Vec<bf16> {
    (0..16).map(|j| b(if j == c { v } else { 0.0 })).collect()
}

#[test]
fn hand_computed_h16_two_columns() {
    // x col0 = ones at 0..12, col1 = ones at 4..16; norm_w = 1 except w[5] = 0.5.
    let x: Vec<bf16> = [ones(0), ones(4)].concat();
    let mut w = vec![b(1.0); 16];
    w[5] = b(0.5);
    // W_delta rows k = s*2 + t (G = 1):
    //   k0 (in, tap 0) = e0             -> col0: n0[0] = 1, col1: n1[0] = 0
    //   k1 (in, tap 1) = 0.25 e5        -> col0: 0.125,      col1: 0.125
    //   k2 (out, tap 0) = e0 + 2^-9 e1 + 3 e15 -> col0: 1 + 2^-9 (bf16: 1), col1: 3
    //   k3 (out, tap 1) = -0.5 e4       -> -0.5 in both columns
    let mut k2 = unit(0, 1.0);
    k2[1] = b(1.0 / 512.0);
    k2[15] = b(3.0);
    let wd = [unit(0, 1.0), unit(5, 0.25), k2, unit(4, -0.5)].concat();
    // base: input side tap 0 = 0, tap 1 = 0.5; output side unused here.
    let base = [vec![b(0.0); 16], vec![b(0.5); 16], vec![b(9.0); 32]].concat();
    let r = run_prepare(&x, &w, &base, &wd, &p(1, 2, 16, 0.25));
    // col0 (no tap): (0 + 1) * n0 = n0 = [1 x5, 0.5, 1 x6, 0 x4]
    let mut want0 = vec![1.0f32; 12];
    want0[5] = 0.5;
    want0.extend([0.0; 4]);
    // col1: (0 + 0) * n1 + (0.5 + 0.125) * n0 = 0.625 * n0
    let want1: Vec<f32> = want0.iter().map(|v| 0.625 * v).collect();
    assert_eq!(f32s(&r.prepared), [want0, want1].concat());
    assert_eq!(f32s(&r.fd), vec![1.0, -0.5, 3.0, -0.5]);
}

#[test]
fn input_side_delta_is_not_rounded_but_finish_delta_is() {
    // delta[0,0] = n[0] + 2^-8 n[1] = 1 + 2^-8, a BF16 tie (rounds to 1). With base 2^-10:
    // unrounded (1 + 2^-8 + 2^-10) * 1 -> 1 + 2^-7; rounding delta first would give 1.
    let x = ones(0);
    let w = vec![b(1.0); 16];
    let mut k0 = unit(0, 1.0);
    k0[1] = b(1.0 / 256.0);
    let wd = [k0.clone(), unit(0, 0.0), k0, unit(0, 0.0)].concat();
    let mut base = vec![b(0.0); 64];
    base[0] = b(1.0 / 1024.0);
    let r = run_prepare(&x, &w, &base, &wd, &p(1, 1, 16, 0.25));
    assert_eq!(r.prepared[0].to_f32(), 1.0 + 1.0 / 128.0);
    // Channel 1 (same group): (0 + 1 + 2^-8) * 1 is itself a tie -> to even, 1.
    assert_eq!(r.prepared[1].to_f32(), 1.0);
    assert_eq!(
        f32s(&r.fd),
        vec![1.0, 0.0],
        "the stored output-side delta is BF16 (tie to even)"
    );
}

#[test]
fn finish_adds_the_unrounded_convolution_and_rounds_once() {
    // Column 0: conv = (2^-8 + 2^-17) * 1, residual 1 -> 1 + 2^-8 + 2^-17 -> 1 + 2^-7.
    // Rounding the branch value first (to 2^-8) would give the tie 1 + 2^-8 -> 1.
    // Column 1: (b10 + fd0) z1 + (b11 + fd1) z0 = (0.5 + 0.25) 2 + (1 - 0.5) 1 = 2; + 1 = 3.
    // Column 1, channel 0: (2^-8 + 0.25) 2 + 0.5 + 1 = 2 + 2^-7, a tie at spacing 2^-6 -> 2.
    let q = p(1, 2, 16, 1e-6);
    let mut base = vec![b(0.0); 64];
    for c in 0..16 {
        base[32 + c] = b(if c == 0 { 1.0 / 256.0 } else { 0.5 });
        base[48 + c] = b(1.0);
    }
    let fd = [b(1.0 / 131_072.0), b(0.0), b(0.25), b(-0.5)];
    let z = [vec![b(1.0); 16], vec![b(2.0); 16]].concat();
    let res = vec![b(1.0); 32];
    let out = f32s(&run_finish(&z, &fd, &base, &res, &q));
    assert_eq!(out[0], 1.0 + 1.0 / 128.0);
    // other column-0 channels: (0.5 + 2^-17) * 1 + 1 -> 1.5
    assert!(out[1..16].iter().all(|&v| v == 1.5), "{out:?}");
    assert_eq!(out[16], 2.0);
    assert!(out[17..].iter().all(|&v| v == 3.0), "{out:?}");
}

/// An independent f64 evaluation of prepare (same arithmetic order as the contract states),
/// optionally rounding n or the input-side delta to BF16 (the cast points the contract
/// forbids), to prove the tests can tell them apart.
fn oracle_prepare(
    d: &CaseInputs,
    q: &ConvParams,
    round_n: bool,
    round_delta: bool,
) -> (Vec<bf16>, Vec<bf16>) {
    let (h, g) = (q.hidden, q.groups());
    let rd = |v: f64, on: bool| {
        if on {
            f64::from(bf16_rne_f64(v).to_f32())
        } else {
            v
        }
    };
    let norm = |col: usize| -> Vec<f64> {
        let xs: Vec<f64> = (0..h).map(|c| d.x[col * h + c].to_f64()).collect();
        let denom = (xs.iter().map(|v| v * v).sum::<f64>() / h as f64 + f64::from(q.eps)).sqrt();
        (0..h)
            .map(|c| rd(d.norm_w[c].to_f64() * xs[c] / denom, round_n))
            .collect()
    };
    let mut prepared = Vec::new();
    let mut fd = Vec::new();
    for row in 0..q.rows {
        for i in 0..q.cols {
            let col = row * q.cols + i;
            let n = norm(col);
            let delta = |s: usize, t: usize, gg: usize| -> f64 {
                let k = s * 2 * g + t * g + gg;
                (0..h).map(|c| d.w_delta[k * h + c].to_f64() * n[c]).sum()
            };
            let prev = if i >= 1 { Some(norm(col - 1)) } else { None };
            for c in 0..h {
                let gg = c / 16;
                let mut v = (d.base[c].to_f64() + rd(delta(0, 0, gg), round_delta)) * n[c];
                if let Some(pn) = &prev {
                    v += (d.base[h + c].to_f64() + rd(delta(0, 1, gg), round_delta)) * pn[c];
                }
                prepared.push(bf16_rne_f64(v));
            }
            for t in 0..2 {
                for gg in 0..g {
                    fd.push(bf16_rne_f64(delta(1, t, gg)));
                }
            }
        }
    }
    (prepared, fd)
}

fn bits(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn matches_independent_oracle_and_the_forbidden_cast_points_are_detectable() {
    let q = p(2, 3, 64, 1e-6);
    let d = case_inputs(&q, 42);
    let r = run_prepare(&d.x, &d.norm_w, &d.base, &d.w_delta, &q);
    let (want_p, want_fd) = oracle_prepare(&d, &q, false, false);
    assert_eq!(bits(&r.prepared), bits(&want_p));
    assert_eq!(bits(&r.fd), bits(&want_fd));
    let (rn, _) = oracle_prepare(&d, &q, true, false);
    let (rdl, _) = oracle_prepare(&d, &q, false, true);
    let differ = |a: &[bf16]| {
        a.iter()
            .zip(&r.prepared)
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count()
    };
    assert!(
        differ(&rn) > 3,
        "rounding n would change {} outputs",
        differ(&rn)
    );
    assert!(
        differ(&rdl) > 3,
        "rounding delta would change {} outputs",
        differ(&rdl)
    );
}

#[test]
fn position_zero_has_no_tap_and_rows_are_independent() {
    let q = p(3, 4, 32, 1e-6);
    let d = case_inputs(&q, 7);
    let r = run_prepare(&d.x, &d.norm_w, &d.base, &d.w_delta, &q);
    let (h, fdw) = (32, 2 * q.groups());
    // Permute rows [0, 1, 2] -> [2, 0, 1]: outputs permute the same way, bit for bit.
    let perm = [2usize, 0, 1];
    let row_slice = |v: &[bf16], r: usize, w: usize| v[r * 4 * w..(r + 1) * 4 * w].to_vec();
    let xp: Vec<bf16> = perm.iter().flat_map(|&r| row_slice(&d.x, r, h)).collect();
    let rp = run_prepare(&xp, &d.norm_w, &d.base, &d.w_delta, &q);
    for (k, &r0) in perm.iter().enumerate() {
        assert_eq!(
            bits(&row_slice(&rp.prepared, k, h)),
            bits(&row_slice(&r.prepared, r0, h))
        );
        assert_eq!(
            bits(&row_slice(&rp.fd, k, fdw)),
            bits(&row_slice(&r.fd, r0, fdw))
        );
    }
    // Column 0 of each row equals a cols = 1 run of that column alone (no tap, no history
    // from the previous row's last column).
    for row in 0..3 {
        let q1 = p(1, 1, 32, 1e-6);
        let x1 = d.x[row * 4 * h..row * 4 * h + h].to_vec();
        let r1 = run_prepare(&x1, &d.norm_w, &d.base, &d.w_delta, &q1);
        assert_eq!(
            bits(&r1.prepared),
            bits(&r.prepared[row * 4 * h..row * 4 * h + h])
        );
    }
    // finish: column 0 ignores z of the previous row's last column.
    let z = bf16_values(1, 3 * 4 * h, 1.0);
    let res = bf16_values(2, 3 * 4 * h, 1.0);
    let out = run_finish(&z, &r.fd, &d.base, &res, &q);
    let mut z2 = z.clone();
    for v in &mut z2[3 * h..4 * h] {
        *v = b(100.0); // last column of row 0
    }
    let out2 = run_finish(&z2, &r.fd, &d.base, &res, &q);
    assert_eq!(
        bits(&out[4 * h..]),
        bits(&out2[4 * h..]),
        "row 1 and 2 unaffected"
    );
    assert_ne!(bits(&out[3 * h..4 * h]), bits(&out2[3 * h..4 * h]));
}

#[test]
fn zero_w_delta_reduces_to_a_fixed_depthwise_conv() {
    let q = p(2, 3, 32, 1e-6);
    let mut d = case_inputs(&q, 9);
    d.w_delta = vec![b(0.0); d.w_delta.len()];
    let r = run_prepare(&d.x, &d.norm_w, &d.base, &d.w_delta, &q);
    assert!(r.fd.iter().all(|v| v.to_f32() == 0.0));
    let h = 32;
    for row in 0..2 {
        for i in 0..3 {
            let col = row * 3 + i;
            let n = |cc: usize| {
                let xs = &d.x[cc * h..(cc + 1) * h];
                let ms = xs.iter().map(|v| v.to_f64() * v.to_f64()).sum::<f64>() / h as f64;
                let s = (ms + 1e-6f32 as f64).sqrt();
                (0..h)
                    .map(|c| d.norm_w[c].to_f64() * xs[c].to_f64() / s)
                    .collect::<Vec<_>>()
            };
            let (nc, np) = (n(col), if i > 0 { n(col - 1) } else { vec![0.0; h] });
            for c in 0..h {
                let v = d.base[c].to_f64() * nc[c] + d.base[h + c].to_f64() * np[c];
                assert_eq!(
                    r.prepared[col * h + c].to_bits(),
                    bf16_rne_f64(v).to_bits(),
                    "col {col} c {c}"
                );
            }
        }
    }
    let z = bf16_values(3, 6 * h, 1.0);
    let res = bf16_values(4, 6 * h, 2.0);
    let out = run_finish(&z, &r.fd, &d.base, &res, &q);
    for e in 0..6 * h {
        let (col, c) = (e / h, e % h);
        let mut v = d.base[2 * h + c].to_f64() * z[e].to_f64();
        if col % 3 > 0 {
            v += d.base[3 * h + c].to_f64() * z[e - h].to_f64();
        }
        assert_eq!(
            out[e].to_bits(),
            bf16_rne_f64(res[e].to_f64() + v).to_bits(),
            "e {e}"
        );
    }
}

#[test]
fn bad_params_and_lengths_are_refused_without_writing() {
    let be = Backend::cpu();
    let q = p(1, 2, 32, 1e-6);
    let d = case_inputs(&q, 1);
    let up = |v: &[bf16]| be.upload(v).expect("upload");
    let (x, w, base, wd) = (up(&d.x), up(&d.norm_w), up(&d.base), up(&d.w_delta));
    let mut pr = be.filled(64, bf16::POISON).expect("alloc");
    let mut fd = be.filled(8, bf16::POISON).expect("alloc");
    let bad = [
        (ConvParams { group: 8, ..q }, "group"),
        (ConvParams { group: 0, ..q }, "group"),
        (ConvParams { hidden: 24, ..q }, "hidden"),
        (ConvParams { hidden: 0, ..q }, "hidden"),
        (ConvParams { eps: 0.0, ..q }, "eps"),
        (ConvParams { eps: f32::NAN, ..q }, "eps"),
        (
            ConvParams {
                rows: usize::MAX,
                ..q
            },
            "rows * cols * hidden",
        ),
    ];
    let mut sc = PrepareScratch::new(&be, &q).expect("scratch");
    for (bq, name) in bad {
        let e = prepare(&be, &x, &w, &base, &wd, &mut pr, &mut fd, &mut sc, &bq).expect_err(name);
        assert!(
            matches!(e, OpsError::Param { param, .. } if param == name),
            "{e}"
        );
        let e = finish(&be, &x, &fd, &base, &x, &mut pr, &bq).expect_err(name);
        assert!(
            matches!(e, OpsError::Param { param, .. } if param == name),
            "{e}"
        );
    }
    let short = up(&d.w_delta[1..]);
    let e =
        prepare(&be, &x, &w, &base, &short, &mut pr, &mut fd, &mut sc, &q).expect_err("w_delta");
    assert!(
        matches!(
            e,
            OpsError::Length {
                tensor: "w_delta",
                expected: 256,
                ..
            }
        ),
        "{e}"
    );
    let e = prepare(&be, &x, &w, &wd, &wd, &mut pr, &mut fd, &mut sc, &q).expect_err("base");
    assert!(
        matches!(
            e,
            OpsError::Length {
                tensor: "base",
                expected: 128,
                ..
            }
        ),
        "{e}"
    );
    let mut fd_long = be.filled(9, bf16::POISON).expect("alloc");
    let e = prepare(&be, &x, &w, &base, &wd, &mut pr, &mut fd_long, &mut sc, &q).expect_err("fd");
    assert!(
        matches!(
            e,
            OpsError::Length {
                tensor: "finish_delta",
                expected: 8,
                ..
            }
        ),
        "{e}"
    );
    let e = finish(&be, &x, &fd, &base, &w, &mut pr, &q).expect_err("residual");
    assert!(
        matches!(
            e,
            OpsError::Length {
                tensor: "residual",
                ..
            }
        ),
        "{e}"
    );
    // A scratch planned for another shape is refused.
    let mut other = PrepareScratch::new(
        &be,
        &ConvParams {
            cols: q.cols + 1,
            ..q
        },
    )
    .expect("scratch");
    let e =
        prepare(&be, &x, &w, &base, &wd, &mut pr, &mut fd, &mut other, &q).expect_err("scratch");
    assert!(
        matches!(
            e,
            OpsError::Length {
                tensor: "scratch.split",
                ..
            }
        ),
        "{e}"
    );
    let poisoned = |v: Vec<bf16>| v.iter().all(|x| x.to_bits() == bf16::POISON.to_bits());
    assert!(poisoned(be.download(&pr).expect("dl")));
    assert!(poisoned(be.download(&fd).expect("dl")));
}

proptest! {
    // prepare against the independent oracle, at random shapes and seeds (bit-exact: both
    // evaluate the same f64 expression).
    #[test]
    fn prepare_matches_oracle(rows in 1usize..3, cols in 1usize..5, groups in 1usize..4, seed in any::<u64>()) {
        let q = p(rows, cols, 16 * groups, 1e-6);
        let d = case_inputs(&q, seed);
        let r = run_prepare(&d.x, &d.norm_w, &d.base, &d.w_delta, &q);
        let (want_p, want_fd) = oracle_prepare(&d, &q, false, false);
        prop_assert_eq!(bits(&r.prepared), bits(&want_p));
        prop_assert_eq!(bits(&r.fd), bits(&want_fd));
    }

    // finish against a plain recomputation, and a f32 device-style evaluation stays within
    // the criterion.
    #[test]
    fn finish_matches_recomputation(rows in 1usize..3, cols in 1usize..5, groups in 1usize..4, seed in any::<u64>()) {
        let q = p(rows, cols, 16 * groups, 1e-6);
        let (h, g) = (q.hidden, q.groups());
        let act = rows * cols * h;
        let z = bf16_values(seed, act, 2.0);
        let fd = bf16_values(seed ^ 5, rows * cols * 2 * g, 0.5);
        let base = bf16_values(seed ^ 6, 4 * h, 1.0);
        let res = bf16_values(seed ^ 7, act, 4.0);
        let out = run_finish(&z, &fd, &base, &res, &q);
        for e in 0..act {
            let (col, c) = (e / h, e % h);
            let i = col % cols;
            let gi = c / 16;
            let tap0 = (base[2 * h + c].to_f64() + fd[col * 2 * g + gi].to_f64()) * z[e].to_f64();
            let tap1 = if i == 0 { 0.0 } else {
                (base[3 * h + c].to_f64() + fd[col * 2 * g + g + gi].to_f64()) * z[e - h].to_f64()
            };
            let want = bf16_rne_f64(res[e].to_f64() + (tap0 + tap1));
            prop_assert_eq!(out[e].to_bits(), want.to_bits(), "e={}", e);
            let mut dv = (base[2 * h + c].to_f32() + fd[col * 2 * g + gi].to_f32()) * z[e].to_f32();
            if i > 0 {
                dv = (base[3 * h + c].to_f32() + fd[col * 2 * g + g + gi].to_f32()).mul_add(z[e - h].to_f32(), dv);
            }
            let dev = bf16::from_f32(res[e].to_f32() + dv);
            prop_assert!(crate::registry::element_ok(CRITERION, want.to_f64(), dev.to_f64(), 0, 0));
        }
    }
}
