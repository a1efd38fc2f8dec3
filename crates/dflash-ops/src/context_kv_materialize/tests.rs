#![allow(clippy::needless_range_loop)] // reason: index loops mirror the contract formulas

use super::*;
use crate::OpsError;
use proptest::prelude::*;

fn b(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

/// Everything one call needs, on the CPU.
struct Setup {
    features: Vec<bf16>,
    w_k: Vec<bf16>,
    w_v: Vec<bf16>,
    key_norm: Vec<bf16>,
    start_pos: Vec<i32>,
    counts: Vec<i32>,
    slots: Vec<i32>,
    cache_k: Vec<bf16>,
    cache_v: Vec<f16>,
    p: MaterializeParams,
}

impl Setup {
    /// Run on the CPU; returns the result and the caches afterwards.
    fn run(&self) -> (Result<()>, Vec<bf16>, Vec<f16>) {
        let be = Backend::cpu();
        let up = |v: &[bf16]| be.upload(v).expect("upload");
        let (f, k, v, n) = (
            up(&self.features),
            up(&self.w_k),
            up(&self.w_v),
            up(&self.key_norm),
        );
        let sp = be.upload(&self.start_pos).expect("upload");
        let ct = be.upload(&self.counts).expect("upload");
        let sl = be.upload(&self.slots).expect("upload");
        let mut ck = be.upload(&self.cache_k).expect("upload");
        let mut cv = be.upload(&self.cache_v).expect("upload");
        let r = run(
            &be, &f, &k, &v, &n, &sp, &ct, &sl, &mut ck, &mut cv, &self.p,
        );
        (
            r,
            be.download(&ck).expect("dl"),
            be.download(&cv).expect("dl"),
        )
    }
}

fn ring(lanes: usize, capacity: usize) -> CacheLayout {
    CacheLayout::Ring { lanes, capacity }
}

fn params(
    rows: usize,
    cols: usize,
    hidden: usize,
    heads: usize,
    d: usize,
    layout: CacheLayout,
) -> MaterializeParams {
    MaterializeParams {
        rows,
        cols,
        hidden,
        kv_heads: heads,
        head_dim: d,
        eps: 1e-6,
        theta: 1e7,
        layout,
    }
}

fn cache_slots(layout: &CacheLayout) -> usize {
    match *layout {
        CacheLayout::Ring { lanes, capacity } => lanes * capacity,
        CacheLayout::Paged {
            pages, page_size, ..
        } => pages * page_size,
    }
}

/// A random setup with sentinel-filled caches (distinct finite prior values).
fn random_setup(
    seed: u64,
    rows: usize,
    cols: usize,
    hidden: usize,
    heads: usize,
    d: usize,
    layout: CacheLayout,
    start_pos: Vec<i32>,
    counts: Vec<i32>,
    slots: Vec<i32>,
) -> Setup {
    let mut g = SplitMix::new(seed);
    let kvd = heads * d;
    let n = cache_slots(&layout) * kvd;
    Setup {
        features: g.bf16_vec(rows * cols * hidden, -2.0, 2.0),
        w_k: g.bf16_vec(kvd * hidden, -0.5, 0.5),
        w_v: g.bf16_vec(kvd * hidden, -0.5, 0.5),
        key_norm: g.bf16_vec(d, 0.5, 1.5),
        start_pos,
        counts,
        slots,
        cache_k: (0..n).map(|i| bf16::from_f32(-100.0 - i as f32)).collect(),
        cache_v: (0..n)
            .map(|i| f16::from_f32(-1000.0 - (i % 1000) as f32))
            .collect(),
        p: params(rows, cols, hidden, heads, d, layout),
    }
}

#[test]
fn hand_built_case_stores_exact_bits() {
    // hidden 2, one KV head of D = 2, eps 0, theta irrelevant for D = 2 (inv_freq_0 = 1).
    // c = [1, 1] in both columns; W_k = [[2, 0], [0, 0]] -> k_raw = [2, 0];
    // mean square 2 -> n = [w0 * 2 / sqrt(2), 0] = [0.70710678, 0] (key_norm = [0.5, 1]).
    // Column 0 at position 0: K = bf16([0.70710678, 0]) = [0x3f35, 0x0000].
    // Column 1 at position 1 (angle 1 rad): K = bf16([a cos 1, a sin 1])
    //   = bf16([0.38205142, 0.59500984]) = [0x3ec4, 0x3f18].
    // W_v = [[1, 2^-8 + 2^-10], [0, 1]] -> v_raw = [1 + 2^-8 + 2^-10, 1]:
    //   bf16 RNE -> 1 + 2^-7 (f16 0x3c08), whereas f16(v_raw) directly would be 0x3c05.
    let mut s = Setup {
        features: b(&[1.0, 1.0, 1.0, 1.0]),
        w_k: b(&[2.0, 0.0, 0.0, 0.0]),
        w_v: b(&[1.0, 2f32.powi(-8) + 2f32.powi(-10), 0.0, 1.0]),
        key_norm: b(&[0.5, 1.0]),
        start_pos: vec![0],
        counts: vec![2],
        slots: vec![0],
        cache_k: vec![bf16::from_f32(9.0); 8],
        cache_v: vec![f16::from_f32(9.0); 8],
        p: params(1, 2, 2, 1, 2, ring(1, 4)),
    };
    s.p.eps = 0.0;
    let (r, k, v) = s.run();
    r.expect("run");
    let kb: Vec<u16> = k.iter().map(|x| x.to_bits()).collect();
    let vb: Vec<u16> = v.iter().map(|x| x.to_bits()).collect();
    let nine_b = bf16::from_f32(9.0).to_bits();
    let nine_h = f16::from_f32(9.0).to_bits();
    assert_eq!(
        kb,
        vec![
            0x3f35, 0x0000, 0x3ec4, 0x3f18, nine_b, nine_b, nine_b, nine_b
        ]
    );
    assert_eq!(
        vb,
        vec![
            0x3c08, 0x3c00, 0x3c08, 0x3c00, nine_h, nine_h, nine_h, nine_h
        ]
    );
}

#[test]
fn ring_wraps_and_a_long_chunk_stores_exactly_its_final_window() {
    // capacity 4, a chunk of 10 live columns starting at 3: columns 6..10 (positions 9..=12)
    // are stored, in slots 1, 2, 3, 0. The result must equal storing only those 4 columns.
    let (cap, cols, hidden, heads, d) = (4, 10, 8, 2, 4);
    let long = random_setup(
        7,
        1,
        cols,
        hidden,
        heads,
        d,
        ring(2, cap),
        vec![3],
        vec![10],
        vec![1],
    );
    let (r, k_long, v_long) = long.run();
    r.expect("run");
    let mut short = random_setup(
        7,
        1,
        cols,
        hidden,
        heads,
        d,
        ring(2, cap),
        vec![9],
        vec![4],
        vec![1],
    );
    short.features = long.features[6 * hidden..].to_vec();
    short.features.extend(vec![bf16::from_f32(5.0); 6 * hidden]); // dead tail
    let (r, k_short, v_short) = short.run();
    r.expect("run");
    assert_eq!(k_long, k_short);
    assert_eq!(v_long, v_short);
    // Lane 0 (slots 0..4) untouched; every slot of lane 1 written.
    let kvd = heads * d;
    assert_eq!(&k_long[..cap * kvd], &long.cache_k[..cap * kvd]);
    assert_eq!(&v_long[..cap * kvd], &long.cache_v[..cap * kvd]);
    for i in cap * kvd..2 * cap * kvd {
        assert_ne!(
            k_long[i].to_bits(),
            long.cache_k[i].to_bits(),
            "K element {i} not written"
        );
    }
}

#[test]
fn dead_columns_and_untouched_slots_keep_prior_contents() {
    // Row 0: lane 0, 2 live of 5 columns at 6 -> slots 6, 7 of a ring of 8.
    // Row 1: lane 2, no live column. Lane 1 is never named.
    let s = random_setup(
        3,
        2,
        5,
        8,
        1,
        4,
        ring(3, 8),
        vec![6, 0],
        vec![2, 0],
        vec![0, 2],
    );
    let (r, k, v) = s.run();
    r.expect("run");
    let kvd = 4;
    for slot in 0..24 {
        let written = slot == 6 || slot == 7;
        let same_k = k[slot * kvd..(slot + 1) * kvd] == s.cache_k[slot * kvd..(slot + 1) * kvd];
        let same_v = v[slot * kvd..(slot + 1) * kvd] == s.cache_v[slot * kvd..(slot + 1) * kvd];
        assert_eq!(same_k, !written, "K slot {slot}");
        assert_eq!(same_v, !written, "V slot {slot}");
    }
}

#[test]
fn paged_and_ring_store_the_same_bits_for_the_same_positions() {
    // Paged: page size 3, positions 4..=11 of one row through a scattered table.
    let (hidden, heads, d) = (8, 2, 4);
    let kvd = heads * d;
    let paged = CacheLayout::Paged {
        pages: 6,
        page_size: 3,
        max_pages: 4,
    };
    let table = vec![-1, 4, 0, 2]; // position 4,5 -> page 4; 6..8 -> page 0; 9..11 -> page 2
    let s = random_setup(
        5,
        1,
        8,
        hidden,
        heads,
        d,
        paged,
        vec![4],
        vec![8],
        table.clone(),
    );
    let (r, kp, vp) = s.run();
    r.expect("run");
    let mut t = random_setup(
        5,
        1,
        8,
        hidden,
        heads,
        d,
        ring(1, 16),
        vec![4],
        vec![8],
        vec![0],
    );
    t.features = s.features.clone();
    let (r, kr, vr) = t.run();
    r.expect("run");
    for pos in 4..12usize {
        let page = table[pos / 3] as usize;
        let ps = (page * 3 + pos % 3) * kvd;
        let rs = (pos % 16) * kvd;
        assert_eq!(kp[ps..ps + kvd], kr[rs..rs + kvd], "K at position {pos}");
        assert_eq!(vp[ps..ps + kvd], vr[rs..rs + kvd], "V at position {pos}");
    }
    // Pages 1, 3, 5 and slot 0 of page 4 (position 3) untouched.
    for slot in [3, 4, 5, 9, 10, 11, 15, 16, 17, 12] {
        assert_eq!(
            kp[slot * kvd..(slot + 1) * kvd],
            s.cache_k[slot * kvd..(slot + 1) * kvd]
        );
    }
}

#[test]
fn bad_metadata_is_refused_without_writing() {
    let base = || {
        random_setup(
            9,
            2,
            4,
            8,
            1,
            4,
            ring(2, 8),
            vec![0, 0],
            vec![4, 4],
            vec![0, 1],
        )
    };
    let check = |s: Setup, tensor: &'static str, index: usize| {
        let (r, k, v) = s.run();
        let e = r.expect_err("must refuse");
        assert!(
            matches!(&e, OpsError::Value { tensor: t, index: i, .. } if *t == tensor && *i == index),
            "{e}"
        );
        assert_eq!(k, s.cache_k, "K written by a refused call");
        assert_eq!(v, s.cache_v, "V written by a refused call");
    };
    let mut s = base();
    s.counts = vec![4, 5];
    check(s, "counts", 1);
    let mut s = base();
    s.counts = vec![-1, 4];
    check(s, "counts", 0);
    let mut s = base();
    s.start_pos = vec![0, -3];
    check(s, "start_pos", 1);
    let mut s = base();
    s.slots = vec![0, 2];
    check(s, "slots", 1);
    // Both rows on lane 0 with overlapping positions: a slot conflict.
    let mut s = base();
    s.slots = vec![0, 0];
    s.start_pos = vec![0, 2];
    check(s, "slots", 1);
    // The same lane twice is fine when the positions do not collide (mod 8) ...
    let mut s = base();
    s.slots = vec![0, 0];
    s.start_pos = vec![0, 4];
    assert!(s.run().0.is_ok());
    // ... and when one row has no live column, its lane is never used.
    let mut s = base();
    s.slots = vec![0, 99];
    s.counts = vec![4, 0];
    assert!(s.run().0.is_ok());

    let paged = CacheLayout::Paged {
        pages: 4,
        page_size: 2,
        max_pages: 2,
    };
    let pbase = || {
        random_setup(
            9,
            2,
            4,
            8,
            1,
            4,
            paged,
            vec![0, 0],
            vec![4, 4],
            vec![0, 1, 2, 3],
        )
    };
    let mut s = pbase();
    s.slots = vec![0, 1, 2, 4];
    check(s, "slots", 3);
    let mut s = pbase();
    s.start_pos = vec![0, 1]; // row 1 position 4 -> page index 2 >= max_pages
    check(s, "start_pos", 1);
    let mut s = pbase();
    s.slots = vec![0, 1, 3, 1]; // page 1 shared by row 0 (positions 2, 3) and row 1 (6, 7)
    check(s, "slots", 2);
    assert!(pbase().run().0.is_ok());
}

#[test]
fn bad_shapes_and_params_are_refused() {
    let s = random_setup(1, 1, 2, 8, 1, 4, ring(1, 4), vec![0], vec![2], vec![0]);
    let mut t = random_setup(1, 1, 2, 8, 1, 4, ring(1, 4), vec![0], vec![2], vec![0]);
    t.w_v.pop();
    assert!(matches!(
        t.run().0,
        Err(OpsError::Length { tensor: "w_v", .. })
    ));
    let mut t = random_setup(1, 1, 2, 8, 1, 4, ring(1, 4), vec![0], vec![2], vec![0]);
    t.p.head_dim = 3;
    assert!(matches!(
        t.run().0,
        Err(OpsError::Param {
            param: "head_dim",
            ..
        })
    ));
    let mut t = random_setup(1, 1, 2, 8, 1, 4, ring(1, 4), vec![0], vec![2], vec![0]);
    t.p.layout = ring(1, 0);
    assert!(matches!(
        t.run().0,
        Err(OpsError::Param {
            param: "capacity",
            ..
        })
    ));
    let mut t = random_setup(1, 1, 2, 8, 1, 4, ring(1, 4), vec![0], vec![2], vec![0]);
    t.p.theta = f64::NAN;
    assert!(matches!(
        t.run().0,
        Err(OpsError::Param { param: "theta", .. })
    ));
    let mut t = random_setup(1, 1, 2, 8, 1, 4, ring(1, 4), vec![0], vec![2], vec![0]);
    t.cache_v.push(f16::ZERO);
    assert!(matches!(
        t.run().0,
        Err(OpsError::Length {
            tensor: "cache_v",
            ..
        })
    ));
    assert!(s.run().0.is_ok());
    assert_eq!(scratch_len(&s.p).expect("len"), 2 * 2 * 4);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Against an independent f64 recomputation (direct, unreduced angle; V exactly, on grid
    /// inputs whose projections are exact in f32).
    #[test]
    fn matches_plain_f64_recomputation(
        seed in any::<u64>(),
        rows in 1usize..4,
        cols in 1usize..7,
        heads in 1usize..3,
        half_d in 1usize..5,
        cap in 1usize..9,
        starts in proptest::collection::vec(0i32..200_000, 3),
        counts in proptest::collection::vec(0usize..7, 3),
    ) {
        let (hidden, d) = (12, 2 * half_d);
        let kvd = heads * d;
        let mut g = SplitMix::new(seed);
        let grid = |g: &mut SplitMix, n: usize, steps: u64, den: f32| -> Vec<bf16> {
            (0..n).map(|_| bf16::from_f32((g.below(2 * steps + 1) as f32 - steps as f32) / den)).collect()
        };
        let counts: Vec<i32> = counts[..rows].iter().map(|&c| c.min(cols) as i32).collect();
        let s = Setup {
            features: grid(&mut g, rows * cols * hidden, 48, 16.0),
            w_k: grid(&mut g, kvd * hidden, 64, 64.0),
            w_v: grid(&mut g, kvd * hidden, 64, 64.0),
            key_norm: grid(&mut g, d, 64, 32.0),
            start_pos: starts[..rows].to_vec(),
            counts: counts.clone(),
            slots: (0..rows as i32).collect(),
            cache_k: vec![bf16::from_f32(-7.0); rows * cap * kvd],
            cache_v: vec![f16::from_f32(-7.0); rows * cap * kvd],
            p: params(rows, cols, hidden, heads, d, ring(rows, cap)),
        };
        let (r, k, v) = s.run();
        r.expect("run");
        let val = |x: bf16| f64::from(x.to_f32());
        let mut expect_written = vec![false; rows * cap];
        for row in 0..rows {
            let count = counts[row] as usize;
            for i in count.saturating_sub(cap)..count {
                let pos = i64::from(s.start_pos[row]) + i as i64;
                let slot = row * cap + (pos as usize % cap);
                expect_written[slot] = true;
                let c = &s.features[(row * cols + i) * hidden..(row * cols + i + 1) * hidden];
                for h in 0..heads {
                    let proj = |w: &[bf16], o: usize| -> f64 {
                        (0..hidden).map(|l| val(w[o * hidden + l]) * val(c[l])).sum()
                    };
                    let kr: Vec<f64> = (0..d).map(|j| proj(&s.w_k, h * d + j)).collect();
                    let ms = kr.iter().map(|x| x * x).sum::<f64>() / d as f64;
                    let inv = 1.0 / (ms + 1e-6f32 as f64).sqrt();
                    let n: Vec<f64> = (0..d).map(|j| val(s.key_norm[j]) * kr[j] * inv).collect();
                    for j in 0..half_d {
                        let ang = pos as f64 * 1e7f64.powf(-((2 * j) as f64) / d as f64);
                        let (sn, cs) = ang.sin_cos();
                        let want = [n[j] * cs - n[j + half_d] * sn, n[j + half_d] * cs + n[j] * sn];
                        for (e, jj) in want.iter().zip([j, j + half_d]) {
                            let got = f64::from(k[slot * kvd + h * d + jj].to_f32());
                            let tol = 1e-9 + e.abs() * 2f64.powi(-7);
                            prop_assert!((got - e).abs() <= tol, "K row {} col {} head {} j {}: {} vs {}", row, i, h, jj, got, e);
                        }
                    }
                    for j in 0..d {
                        // Exact in f32 (grid inputs), so from_f32 is the single RNE rounding.
                        let vr = proj(&s.w_v, h * d + j) as f32;
                        let want = f16::from_f32(bf16::from_f32(vr).to_f32());
                        prop_assert_eq!(v[slot * kvd + h * d + j].to_bits(), want.to_bits());
                    }
                }
            }
        }
        for slot in 0..rows * cap {
            if !expect_written[slot] {
                prop_assert!(k[slot * kvd..(slot + 1) * kvd].iter().all(|x| x.to_f32() == -7.0));
                prop_assert!(v[slot * kvd..(slot + 1) * kvd].iter().all(|x| x.to_f32() == -7.0));
            }
        }
    }
}
