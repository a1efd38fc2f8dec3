#![allow(clippy::needless_range_loop)] // reason: index loops mirror the contract formulas

use super::*;
use crate::OpsError;
use proptest::prelude::*;

fn b(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

#[test]
fn hand_computed_product_uses_out_in_weight_layout() {
    let be = Backend::cpu();
    // A = [[1, 2], [3, 4]], W = [[1, 0], [0.5, -1], [2, 2]] (3 output features).
    let a = be.upload(&b(&[1.0, 2.0, 3.0, 4.0])).expect("upload");
    let w = be
        .upload(&b(&[1.0, 0.0, 0.5, -1.0, 2.0, 2.0]))
        .expect("upload");
    let mut out = be.filled(6, f32::POISON).expect("alloc");
    let p = GemmParams { m: 2, n: 3, k: 2 };
    run_f32(&be, &a, &w, &mut out, &p).expect("run");
    assert_eq!(
        be.download(&out).expect("dl"),
        vec![1.0, -1.5, 6.0, 3.0, -2.5, 14.0]
    );
}

#[test]
fn f32_output_is_unrounded_and_bf16_output_rounds_once_to_nearest_even() {
    let be = Backend::cpu();
    let p = GemmParams { m: 1, n: 2, k: 3 };
    // Row 0 of W sums to 1 + 2^-8 (an exact BF16 tie: RNE keeps 1.0);
    // row 1 sums to 1 + 2^-8 + 2^-16 (just above the tie: rounds up to 1 + 2^-7).
    let a = be.upload(&b(&[1.0, 1.0, 1.0])).expect("upload");
    let w = be
        .upload(&b(&[
            1.0,
            2f32.powi(-8),
            0.0,
            1.0,
            2f32.powi(-8),
            2f32.powi(-16),
        ]))
        .expect("upload");
    let mut o32 = be.filled(2, f32::POISON).expect("alloc");
    run_f32(&be, &a, &w, &mut o32, &p).expect("run");
    assert_eq!(
        be.download(&o32).expect("dl"),
        vec![1.0 + 2f32.powi(-8), 1.0 + 2f32.powi(-8) + 2f32.powi(-16)]
    );
    let mut o16 = be.filled(2, bf16::POISON).expect("alloc");
    run_bf16(&be, &a, &w, &mut o16, &p).expect("run");
    let got: Vec<u16> = be
        .download(&o16)
        .expect("dl")
        .iter()
        .map(|x| x.to_bits())
        .collect();
    assert_eq!(got, vec![0x3f80, 0x3f81]);
}

#[test]
fn bf16_from_f64_rounds_once_not_twice() {
    use crate::bf16_rne_f64;
    // 1 + 2^-8 + 2^-40: f64 -> f32 would round to the tie 1 + 2^-8 and then to 1.0; the
    // correct single rounding is up, to 1 + 2^-7.
    let x = 1.0 + 2f64.powi(-8) + 2f64.powi(-40);
    assert_eq!(bf16_rne_f64(x).to_bits(), 0x3f81);
    assert_eq!(bf16_rne_f64(-x).to_bits(), 0xbf81);
    assert_eq!(bf16_rne_f64(1.0 + 2f64.powi(-8)).to_bits(), 0x3f80);
    assert_eq!(bf16_rne_f64(1.0 + 3.0 * 2f64.powi(-8)).to_bits(), 0x3f82);
    assert_eq!(bf16_rne_f64(0.0).to_bits(), 0);
    assert_eq!(bf16_rne_f64(-0.0).to_bits(), 0x8000);
    assert!(bf16_rne_f64(1e39).is_infinite());
    assert!(bf16_rne_f64(f64::NAN).is_nan());
    // Just below the overflow threshold of bf16 stays finite.
    assert_eq!(bf16_rne_f64(3.389e38).to_bits(), 0x7f7f);
}

#[test]
fn bad_shapes_are_refused_without_writing() {
    let be = Backend::cpu();
    let a = be.upload(&b(&[1.0; 6])).expect("upload");
    let w = be.upload(&b(&[1.0; 8])).expect("upload");
    let mut out = be.filled(8, f32::POISON).expect("alloc");
    // k = 2 implies a = [3, 2], w = [4, 2], out = [3, 4] = 12 elements: out is short.
    let e = run_f32(&be, &a, &w, &mut out, &GemmParams { m: 3, n: 4, k: 2 }).expect_err("short");
    assert!(
        matches!(
            e,
            OpsError::Length {
                tensor: "out",
                expected: 12,
                found: 8,
                ..
            }
        ),
        "{e}"
    );
    let e = run_f32(&be, &a, &w, &mut out, &GemmParams { m: 3, n: 4, k: 0 }).expect_err("k=0");
    assert!(matches!(e, OpsError::Param { param: "k", .. }), "{e}");
    let e = run_f32(&be, &a, &w, &mut out, &GemmParams { m: 2, n: 4, k: 3 }).expect_err("w");
    assert!(matches!(e, OpsError::Length { tensor: "w", .. }), "{e}");
    assert!(
        be.download(&out)
            .expect("dl")
            .iter()
            .all(|x| x.to_bits() == f32::POISON.to_bits())
    );
}

/// `run_swiglu` is `run_bf16` then `swiglu::run_fused`, bit for bit, on the CPU (hand-checked
/// on one element), and refuses an odd n or a wrong scratch / out length before writing.
#[test]
fn swiglu_form_is_the_product_then_the_fused_swiglu() {
    let be = Backend::cpu();
    let (m, n, k) = (3, 8, 4);
    // A = [[1, 0, 0, 0], ...], gate row 0 = [2, 0, 0, 0], up row 0 (= weight row 4) = [3, 0, 0, 0].
    let mut av = vec![0.0f32; m * k];
    av[0] = 1.0;
    av[k + 1] = -1.5;
    av[2 * k + 3] = 0.25;
    let mut wv: Vec<f32> = (0..n * k)
        .map(|i| ((i * 7) % 11) as f32 * 0.125 - 0.5)
        .collect();
    wv[..k].copy_from_slice(&[2.0, 0.0, 0.0, 0.0]);
    wv[4 * k..5 * k].copy_from_slice(&[3.0, 0.0, 0.0, 0.0]);
    let a = be.upload(&b(&av)).expect("upload");
    let w = be.upload(&b(&wv)).expect("upload");
    let p = GemmParams { m, n, k };
    let mut scratch = be.filled(m * n, bf16::POISON).expect("alloc");
    let mut out = be.filled(m * n / 2, bf16::POISON).expect("alloc");
    run_swiglu(&be, &a, &w, &mut scratch, &mut out, &p).expect("swiglu form");
    let got = be.download(&out).expect("dl");
    // out[0, 0] = silu(2) * 3 = 6 / (1 + e^-2) = 5.2838..., rounded to BF16.
    assert_eq!(got[0], crate::bf16_rne_f64(6.0 / (1.0 + (-2.0f64).exp())));
    let mut prod = be.filled(m * n, bf16::POISON).expect("alloc");
    run_bf16(&be, &a, &w, &mut prod, &p).expect("product");
    let mut want = be.filled(m * n / 2, bf16::POISON).expect("alloc");
    let sp = crate::swiglu::SwigluParams {
        rows: m,
        inter: n / 2,
    };
    crate::swiglu::run_fused(&be, &prod, &mut want, &sp).expect("swiglu");
    let want = be.download(&want).expect("dl");
    assert!(
        got.iter()
            .zip(&want)
            .all(|(x, y)| x.to_bits() == y.to_bits())
    );

    let poisoned = |out: &Buffer<bf16>| {
        be.download(out)
            .expect("dl")
            .iter()
            .all(|x| x.to_bits() == bf16::POISON.to_bits())
    };
    let mut out = be.filled(m * n / 2, bf16::POISON).expect("alloc");
    let odd = GemmParams { m, n: 7, k };
    let mut s7 = be.filled(m * 7, bf16::POISON).expect("alloc");
    let w7 = be.upload(&b(&wv[..7 * k])).expect("upload");
    let e = run_swiglu(&be, &a, &w7, &mut s7, &mut out, &odd).expect_err("odd n");
    assert!(matches!(e, OpsError::Param { param: "n", .. }), "{e}");
    let mut short = be.filled(m * n - 1, bf16::POISON).expect("alloc");
    let e = run_swiglu(&be, &a, &w, &mut short, &mut out, &p).expect_err("scratch");
    assert!(
        matches!(
            e,
            OpsError::Length {
                tensor: "scratch",
                ..
            }
        ),
        "{e}"
    );
    let mut long = be.filled(m * n / 2 + 1, bf16::POISON).expect("alloc");
    let e = run_swiglu(&be, &a, &w, &mut scratch, &mut long, &p).expect_err("out");
    assert!(matches!(e, OpsError::Length { tensor: "out", .. }), "{e}");
    assert!(poisoned(&out) && poisoned(&long) && poisoned(&short));
}

#[test]
fn empty_product_writes_nothing_and_succeeds() {
    let be = Backend::cpu();
    let a = be.upload::<bf16>(&[]).expect("upload");
    let w = be.upload(&b(&[1.0; 4])).expect("upload");
    let mut out = be.filled::<f32>(0, f32::POISON).expect("alloc");
    run_f32(&be, &a, &w, &mut out, &GemmParams { m: 0, n: 2, k: 2 }).expect("m = 0");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Against an independent triple loop in f64, in a different summation order (reversed).
    #[test]
    fn matches_plain_f64_triple_loop(
        m in 1usize..6, n in 1usize..9, k in 1usize..40, seed in any::<u64>(), bf in any::<bool>()
    ) {
        let be = Backend::cpu();
        // Multiples of 1/16 in [-3, 3] and of 1/64 in [-1, 1]: exact in BF16, and every partial
        // sum is a multiple of 2^-10 below 2^7 in magnitude, so any summation order is exact.
        let mut g = data::SplitMix::new(seed);
        let a: Vec<bf16> =
            (0..m * k).map(|_| bf16::from_f32((g.below(97) as f32 - 48.0) / 16.0)).collect();
        let w: Vec<bf16> =
            (0..n * k).map(|_| bf16::from_f32((g.below(129) as f32 - 64.0) / 64.0)).collect();
        let ab = be.upload(&a).expect("upload");
        let wb = be.upload(&w).expect("upload");
        let p = GemmParams { m, n, k };
        let mut want = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = 0f64;
                for l in (0..k).rev() {
                    s += f64::from(a[i * k + l].to_f32()) * f64::from(w[j * k + l].to_f32());
                }
                want[i * n + j] = s;
            }
        }
        if bf {
            let mut o = be.filled(m * n, bf16::POISON).expect("alloc");
            run_bf16(&be, &ab, &wb, &mut o, &p).expect("run");
            for (got, want) in be.download(&o).expect("dl").iter().zip(&want) {
                prop_assert_eq!(got.to_bits(), crate::bf16_rne_f64(*want).to_bits());
            }
        } else {
            let mut o = be.filled(m * n, f32::POISON).expect("alloc");
            run_f32(&be, &ab, &wb, &mut o, &p).expect("run");
            for (got, want) in be.download(&o).expect("dl").iter().zip(&want) {
                prop_assert_eq!(got.to_bits(), (*want as f32).to_bits());
            }
        }
    }

    /// Threaded reference blocks reassemble in the right place for every n.
    #[test]
    fn matmul_f64_is_independent_of_thread_split(n in 1usize..70, seed in any::<u64>()) {
        let mut g = data::SplitMix::new(seed);
        let (m, k) = (3, 5);
        let a = g.bf16_vec(m * k, -1.0, 1.0);
        let w = g.bf16_vec(n * k, -1.0, 1.0);
        let c = reference::matmul_f64(&a, &w, m, n, k);
        for i in 0..m {
            for j in 0..n {
                let s: f64 = (0..k)
                    .map(|l| f64::from(a[i * k + l].to_f32()) * f64::from(w[j * k + l].to_f32()))
                    .sum();
                prop_assert_eq!(c[i * n + j], s);
            }
        }
    }
}

/// Regression: with more workers than the last chunk boundary allows (16 workers, n = 51:
/// chunk 4, so workers 13..16 would start past n) the reference once indexed out of range.
#[test]
fn reference_is_independent_of_the_worker_count() {
    use crate::bf16;
    let (m, n, k) = (3usize, 51usize, 7usize);
    let a: Vec<bf16> = (0..m * k)
        .map(|i| bf16::from_f32((i % 5) as f32 - 2.0))
        .collect();
    let w: Vec<bf16> = (0..n * k)
        .map(|i| bf16::from_f32((i % 7) as f32 * 0.5 - 1.5))
        .collect();
    let one = super::reference::matmul_f64_threads(&a, &w, m, n, k, 1);
    for threads in [2, 3, 13, 16, 51, 64] {
        assert_eq!(
            super::reference::matmul_f64_threads(&a, &w, m, n, k, threads),
            one,
            "{threads} workers"
        );
    }
}

/// The skinny kernel's plan: which products it takes, with which entry and how many warps.
#[test]
fn skinny_plan_takes_aligned_products_of_few_rows() {
    use super::plan::{SKINNY_MAX_M, SkinnyPlan, SkinnyRule, skinny_plan};
    let dev = (132, 232_448); // H200: SMs, shared memory a block may use
    let rule = SkinnyRule::default();
    let plan = |m, n, k, a, lda, w, ldw| skinny_plan((m, n, k), (a, lda), (w, ldw), dev, &rule);
    // Refused: no rows, too many rows, k not a multiple of 32, misaligned address or stride.
    assert_eq!(plan(0, 64, 64, 0, 64, 0, 64), None);
    assert_eq!(plan(SKINNY_MAX_M + 1, 64, 64, 0, 64, 0, 64), None);
    assert_eq!(plan(16, 64, 48, 0, 48, 0, 48), None);
    assert_eq!(plan(16, 64, 64, 8, 64, 0, 64), None);
    assert_eq!(plan(16, 64, 64, 0, 64, 2, 64), None);
    assert_eq!(plan(16, 64, 64, 0, 68, 0, 64), None);
    assert_eq!(plan(16, 64, 64, 0, 64, 0, 76), None);
    // The default rule: at most 16 rows, at most 2048 weight rows.
    assert_eq!(plan(17, 64, 64, 0, 64, 0, 64), None);
    assert_eq!(plan(16, 2049, 64, 0, 64, 0, 64), None);
    let all = SkinnyRule {
        max_m: 32,
        max_n: usize::MAX,
        ..rule
    };
    // The conformance rule: this, with the wide kernel taking 33 to 128 rows.
    assert_eq!(
        SkinnyRule {
            wide_max_m: 128,
            ..all
        },
        super::conformance_rule()
    );
    let plan = |m, n, k, a, lda, w, ldw| skinny_plan((m, n, k), (a, lda), (w, ldw), dev, &all);
    let taken = |m, n, k| plan(m, n, k, 0, k, 0, k).expect("taken by the skinny kernel");
    // A rule that gives it every weight up to 32 rows (the 27B's fused gate/up included).
    assert!(plan(32, 34816, 5120, 0, 5120, 0, 5120).is_some());
    // Entries by n8 tiles: m 1..8 -> 1 tile, 9..16 -> 2, 17..32 -> 4 (never 3).
    for (m, log2) in [(1, 0), (8, 0), (9, 1), (16, 1), (17, 2), (24, 2), (32, 2)] {
        let p = plan(m, 2048, 2048, 256, 2048, 4096, 2048).expect("aligned, m <= 32");
        assert_eq!(p.tiles_log2, log2, "m = {m}");
    }
    // A block per 16 weight rows (rounding up), 16 warps on grids of at most two blocks an
    // SM where the reduction axis has at least 16 chunks, each warp a 4-stage ring of 2 + NT
    // slots of 512 bytes.
    assert_eq!(
        taken(16, 1024, 2048),
        SkinnyPlan {
            tiles_log2: 1,
            blocks: 64,
            warps: 16,
            smem: 16 * 4 * 4 * 512,
            dependent: true,
        }
    );
    assert_eq!(taken(16, 1001, 2048).blocks, 63);
    assert_eq!(taken(16, 16 * 264, 2048).warps, 16);
    // Larger grids: the rule's warps_many.
    assert_eq!(taken(16, 16 * 265, 2048).warps, 8);
    assert_eq!(taken(16, 12288, 2048).warps, 8);
    // Never more warps than chunks, nor than rings fit in the block's shared memory; none
    // when not one fits.
    assert_eq!(taken(16, 1000, 96).warps, 3);
    let small = skinny_plan(
        (16, 1024, 2048),
        (0, 2048),
        (0, 2048),
        (132, 100 * 1024),
        &rule,
    )
    .expect("fits");
    assert_eq!(small.warps, 100 * 1024 / (4 * 4 * 512));
    assert_eq!(
        skinny_plan((16, 1024, 2048), (0, 2048), (0, 2048), (132, 1024), &all),
        None
    );
    // Another rule: its row and weight-row limits, its warps (clamped to 1..=16).
    let narrow = SkinnyRule {
        max_m: 16,
        max_n: 2048,
        warps: 40,
        warps_many: 0,
        dependent: true,
        wide_max_m: 128,
    };
    let with = |m, n, r: &SkinnyRule| skinny_plan((m, n, 2048), (0, 2048), (0, 2048), dev, r);
    assert_eq!(with(17, 64, &narrow), None);
    assert_eq!(with(16, 2049, &narrow), None);
    assert_eq!(with(16, 2048, &narrow).map(|p| p.warps), Some(16));
    // The plan carries the rule's launch: a dependent by default, ordinary when it says so.
    assert_eq!(with(16, 2048, &narrow).map(|p| p.dependent), Some(true));
    let ordinary = SkinnyRule {
        dependent: false,
        ..narrow
    };
    assert_eq!(with(16, 2048, &ordinary).map(|p| p.dependent), Some(false));
    let wide = SkinnyRule {
        max_n: usize::MAX,
        ..narrow
    };
    assert_eq!(with(16, 65536, &wide).map(|p| p.warps), Some(1));
    let over = SkinnyRule {
        max_m: 64,
        ..SkinnyRule::default()
    };
    assert_eq!(with(33, 64, &over), None, "never more than 32 rows");
}

/// The plan mirrors the kernel's constants: its launch bound and its ring depth.
#[test]
fn the_plans_mirror_the_kernel_constants() {
    use super::plan::{MAX_WARPS, STAGES, WIDE_KC, WIDE_ROWS};
    let src = include_str!("../../../../kernels/gemm.cu");
    let define = |name: &str| -> usize {
        let line = src
            .lines()
            .find(|l| l.starts_with(&format!("#define {name} ")))
            .unwrap_or_else(|| panic!("kernels/gemm.cu defines {name}"));
        line[format!("#define {name} ").len()..]
            .split("//")
            .next()
            .unwrap_or_default()
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("{line}: {e}"))
    };
    assert_eq!(define("GEMM_MAX_WARPS"), MAX_WARPS);
    assert_eq!(define("GEMM_STAGES"), STAGES);
    assert_eq!(define("GW_ROWS"), WIDE_ROWS);
    assert_eq!(define("GW_KC"), WIDE_KC);
}

#[test]
fn wide_plan_takes_aligned_products_of_up_to_128_rows() {
    use super::plan::{WIDE_MAX_M, WidePlan, wide_plan, wide_stage_bytes};
    let optin = 232_448; // H200: shared memory a block may use
    // The default rule leaves the wide kernel off; a rule that gives it every row count.
    assert_eq!(
        wide_plan(
            (16, 64, 64),
            (0, 64),
            (0, 64),
            optin,
            &SkinnyRule::default()
        ),
        None
    );
    let rule = SkinnyRule {
        wide_max_m: WIDE_MAX_M,
        ..SkinnyRule::default()
    };
    let plan = |m, n, k, a, lda, w, ldw| wide_plan((m, n, k), (a, lda), (w, ldw), optin, &rule);
    // Refused: no rows, too many rows, no weight rows, misaligned address or stride, the
    // rule's `wide_max_m` below the rows.
    assert_eq!(plan(0, 64, 64, 0, 64, 0, 64), None);
    assert_eq!(plan(WIDE_MAX_M + 1, 64, 64, 0, 64, 0, 64), None);
    assert_eq!(plan(16, 0, 64, 0, 64, 0, 64), None);
    assert_eq!(plan(16, 64, 64, 8, 64, 0, 64), None);
    assert_eq!(plan(16, 64, 64, 0, 64, 2, 64), None);
    assert_eq!(plan(16, 64, 60, 0, 60, 0, 64), None);
    assert_eq!(plan(16, 64, 64, 0, 64, 0, 68), None);
    let off = SkinnyRule {
        wide_max_m: 0,
        ..rule
    };
    assert_eq!(wide_plan((16, 64, 64), (0, 64), (0, 64), optin, &off), None);
    let few = SkinnyRule {
        wide_max_m: 16,
        ..rule
    };
    assert!(wide_plan((16, 64, 64), (0, 64), (0, 64), optin, &few).is_some());
    assert_eq!(wide_plan((17, 64, 64), (0, 64), (0, 64), optin, &few), None);
    let over = SkinnyRule {
        wide_max_m: 1000,
        ..rule
    };
    assert_eq!(
        wide_plan((129, 64, 64), (0, 64), (0, 64), optin, &over),
        None
    );
    // Any k (the tail past it reads as zero), any n; n8 tiles 1, 2, 4, 8, 16 (never 3).
    for (m, log2) in [
        (1, 0),
        (8, 0),
        (9, 1),
        (16, 1),
        (17, 2),
        (32, 2),
        (33, 3),
        (64, 3),
        (65, 4),
        (128, 4),
    ] {
        let p = plan(m, 100, 200, 256, 200, 4096, 200).expect("aligned, m <= 128");
        assert_eq!(p.tiles_log2, log2, "m = {m}");
    }
    // A tile per 64 weight rows (rounding up); stages within the 72 KB budget (2 to 8), the
    // smem their boxes, 1024 bytes of slack and two mbarriers each.
    let p = plan(16, 4096, 2048, 0, 2048, 0, 2048).expect("taken");
    assert_eq!(wide_stage_bytes(2), (64 + 16) * 128);
    assert_eq!(
        p,
        WidePlan {
            tiles_log2: 1,
            tiles: 64,
            stages: 7,
            smem: 1024 + 7 * 80 * 128 + 7 * 16,
            dependent: true,
        }
    );
    assert_eq!(
        plan(16, 4097, 2048, 0, 2048, 0, 2048).map(|p| p.tiles),
        Some(65)
    );
    assert_eq!(plan(1, 64, 64, 0, 64, 0, 64).map(|p| p.stages), Some(8));
    assert_eq!(plan(128, 64, 64, 0, 64, 0, 64).map(|p| p.stages), Some(3));
    // The reduction's partial tile (8 nt columns of 68 floats) always fits the stages.
    for m in [1, 16, 32, 64, 128] {
        let p = plan(m, 64, 64, 0, 64, 0, 64).expect("taken");
        let nc = 8 << p.tiles_log2;
        assert!(
            nc * 68 * 4 <= p.stages * wide_stage_bytes(1 << p.tiles_log2),
            "m = {m}"
        );
    }
    // Fewer stages where the device allows less shared memory; none below two.
    let small = wide_plan((128, 64, 64), (0, 64), (0, 64), 60 * 1024, &rule).expect("two fit");
    assert_eq!(small.stages, 2);
    assert_eq!(
        wide_plan((128, 64, 64), (0, 64), (0, 64), 40 * 1024, &rule),
        None
    );
    // The launch follows the rule.
    let ordinary = SkinnyRule {
        dependent: false,
        ..rule
    };
    assert_eq!(
        wide_plan((16, 64, 64), (0, 64), (0, 64), optin, &ordinary).map(|p| p.dependent),
        Some(false)
    );
}

#[test]
fn wide_splits_fill_the_device_without_more_waves() {
    use super::plan::wide_splits;
    // Three blocks an SM on 132 SMs, every cluster placeable: 396 / s clusters of s.
    let blocks = |s: usize| 396 / s;
    assert_eq!(
        wide_splits(192, 2048, blocks),
        2,
        "gate/up fused: 384 blocks in one wave"
    );
    assert_eq!(wide_splits(64, 2048, blocks), 6, "q: 384 blocks");
    assert_eq!(wide_splits(32, 4096, blocks), 8, "o: at most 8 a cluster");
    assert_eq!(wide_splits(8, 2048, blocks), 8, "k / v");
    // Never more splits than 64-element chunks; one for a single chunk or a full device.
    assert_eq!(wide_splits(1, 64, blocks), 1);
    assert_eq!(wide_splits(1, 200, blocks), 4);
    assert_eq!(wide_splits(1, 65, blocks), 2);
    assert_eq!(wide_splits(396, 2048, blocks), 1);
    // More tiles than slots: the split that wastes the least of the last wave.
    assert_eq!(wide_splits(544, 5120, blocks), 2, "27B gate/up fused");
    // The H100's cluster placement: 62 clusters of 6, not 66; q's 64 tiles then take 5
    // splits (one wave of 64 clusters of 5), not 6 (two waves).
    let placed = |s: usize| match s {
        6 => 62,
        _ => 396 / s,
    };
    assert_eq!(wide_splits(64, 2048, placed), 5);
    // A size of which no cluster can be placed is never chosen, even for a single tile
    // (where it would otherwise win); none placeable at all: 1.
    let none_of_8 = |s: usize| if s == 8 { 0 } else { 396 / s };
    assert_eq!(wide_splits(8, 2048, none_of_8), 7);
    assert_eq!(wide_splits(1, 2048, none_of_8), 7);
    assert_eq!(wide_splits(1, 2048, blocks), 8);
    assert_eq!(wide_splits(4, 2048, |_| 0), 1);
    // Degenerate inputs stay in range.
    assert_eq!(wide_splits(0, 0, |_| 0), 1);
    for tiles in [1, 7, 100, 1000] {
        for k in [1, 64, 1000, 17408] {
            let s = wide_splits(tiles, k, blocks);
            assert!((1..=8).contains(&s) && s <= k.div_ceil(64), "{tiles} {k}");
        }
    }
}

/// Which implementation each conformance case exercises on CUDA (at aligned addresses) is
/// the one its row of `CASES` names: the skinny kernel's cases must stay on it, or a plan that
/// refused everything would let every case pass on cuBLAS alone.
#[test]
fn the_conformance_cases_cover_every_side_of_the_plan() {
    use super::Path;
    use super::plan::{skinny_plan, wide_plan};
    // The path a product takes on an sm_90a device (an H200) under a case's rule.
    let path = |(m, n, k): (usize, usize, usize), ld: usize, p: Path| {
        let rule = super::case_rule(p);
        if skinny_plan((m, n, k), (0, ld), (0, ld), (132, 232_448), &rule).is_some() {
            Path::Skinny
        } else if wide_plan((m, n, k), (0, ld), (0, ld), 232_448, &rule).is_some() {
            Path::Wide
        } else {
            Path::Cublas
        }
    };
    for (name, shape, pad, .., p) in super::CASES {
        assert_eq!(path(shape, shape.2 + pad.unwrap_or(0), p), p, "{name}");
    }
    for (name, shape, .., p) in super::SWIGLU_CASES {
        assert_eq!(path(shape, shape.2, p), p, "{name}");
    }
    for side in [Path::Skinny, Path::Wide, Path::Cublas] {
        assert!(super::CASES.iter().any(|c| c.7 == side), "no {side:?} case");
        assert!(
            super::SWIGLU_CASES.iter().any(|c| c.4 == side),
            "no {side:?} SwiGLU case"
        );
    }
}

/// Every light case runs on the CPU reference: its outputs are all written, nothing outside
/// them (the padding and the extra row of a strided case) changes, and no input is modified.
#[test]
fn light_cases_run_cleanly_on_the_cpu() {
    for case in super::cases().iter().filter(|c| !c.heavy) {
        let run = (case.run)(&Backend::Cpu).unwrap_or_else(|e| panic!("{}: {e}", case.name));
        assert!(run.modified_inputs.is_empty(), "{}", case.name);
        for out in &run.outputs {
            assert_eq!((out.unwritten, out.clobbered), (0, 0), "{}", case.name);
            assert!(out.values.iter().all(|v| v.is_finite()), "{}", case.name);
        }
    }
}
