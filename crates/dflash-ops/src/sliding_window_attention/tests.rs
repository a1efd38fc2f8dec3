use proptest::prelude::*;

use super::*;
use crate::registry::ulp_bf16;

/// Host-side inputs of one call.
#[derive(Clone)]
struct Fx {
    p: LocalAttentionParams,
    q: Vec<bf16>,
    k_blk: Vec<bf16>,
    v_blk: Vec<bf16>,
    ring_k: Vec<bf16>,
    ring_v: Vec<f16>,
    lanes: Vec<i32>,
    start_pos: Vec<i32>,
    live: Vec<i32>,
}

impl Fx {
    /// Random data (fixed seed) for `p`; row r uses lane `r` unless changed.
    fn random(p: LocalAttentionParams, start_pos: Vec<i32>, live: Vec<i32>, seed: u64) -> Fx {
        let mut rng = CaseRng::new(seed);
        let g = p.geometry();
        let ring = p.lanes * p.window * p.kv_heads * p.head_dim;
        Fx {
            q: rng.bf16s(g.q_len(), 2.0),
            k_blk: rng.bf16s(g.kv_len(), 2.0),
            v_blk: rng.bf16s(g.kv_len(), 1.0),
            ring_k: rng.bf16s(ring, 2.0),
            ring_v: rng.ctx_v(ring, 1.0),
            lanes: (0..p.rows as i32).collect(),
            start_pos,
            live,
            p,
        }
    }

    fn try_run(&self) -> Result<Vec<bf16>> {
        let be = Backend::cpu();
        let mut out = be.filled(
            self.p.rows * self.p.cols * self.p.q_heads * self.p.head_dim,
            bf16::POISON,
        )?;
        self.try_run_into(&mut out, workspace_len(&self.p))?;
        be.download(&out)
    }

    fn try_run_into(&self, out: &mut Buffer<bf16>, ws_len: usize) -> Result<()> {
        let be = Backend::cpu();
        let mut ws = be.filled(ws_len, f32::POISON)?;
        run(
            &be,
            &be.upload(&self.q)?,
            &be.upload(&self.k_blk)?,
            &be.upload(&self.v_blk)?,
            &be.upload(&self.ring_k)?,
            &be.upload(&self.ring_v)?,
            &be.upload(&self.lanes)?,
            &be.upload(&self.start_pos)?,
            &be.upload(&self.live)?,
            out,
            &mut ws,
            &self.p,
        )?;
        assert!(
            be.download(&ws)?
                .iter()
                .all(|x| x.to_bits() == f32::POISON.to_bits()),
            "the CPU leaves the workspace alone"
        );
        Ok(())
    }

    fn out(&self) -> Vec<bf16> {
        self.try_run().expect("run")
    }

    /// Flat index of element e of (row, col, head) in q/out.
    fn qi(&self, r: usize, i: usize, h: usize, e: usize) -> usize {
        ((r * self.p.cols + i) * self.p.q_heads + h) * self.p.head_dim + e
    }

    /// Flat index in the block K/V.
    fn bi(&self, r: usize, j: usize, kvh: usize, e: usize) -> usize {
        ((r * self.p.cols + j) * self.p.kv_heads + kvh) * self.p.head_dim + e
    }

    /// Flat index in the ring of absolute position `pos` of row r.
    fn ri(&self, r: usize, pos: usize, kvh: usize, e: usize) -> usize {
        let slot = self.lanes[r] as usize * self.p.window + pos % self.p.window;
        (slot * self.p.kv_heads + kvh) * self.p.head_dim + e
    }
}

/// An independent plain f64 evaluation: every candidate key by absolute position, filtered
/// by the spec's predicate `|p_key - p_query| < S` and the populated bounds.
fn naive(fx: &Fx) -> Vec<Option<f64>> {
    let p = &fx.p;
    let s = p.window as i64;
    let group = p.q_heads / p.kv_heads;
    let mut res = vec![None; fx.q.len()];
    for r in 0..p.rows {
        let f = i64::from(fx.start_pos[r]);
        let live = fx.live[r] as usize;
        for i in 0..live {
            let pq = f + i as i64;
            for h in 0..p.q_heads {
                let kvh = h / group;
                let mut keys: Vec<(Vec<f64>, Vec<f64>)> = Vec::new();
                for pk in 0..f {
                    let in_ring = pk >= (f - s).max(0);
                    if in_ring && (pk - pq).abs() < s {
                        let k = (0..p.head_dim)
                            .map(|e| f64::from(fx.ring_k[fx.ri(r, pk as usize, kvh, e)].to_f32()))
                            .collect();
                        let v = (0..p.head_dim)
                            .map(|e| f64::from(fx.ring_v[fx.ri(r, pk as usize, kvh, e)].to_f32()))
                            .collect();
                        keys.push((k, v));
                    }
                }
                for j in 0..live {
                    if (f + j as i64 - pq).abs() < s {
                        let k = (0..p.head_dim)
                            .map(|e| f64::from(fx.k_blk[fx.bi(r, j, kvh, e)].to_f32()))
                            .collect();
                        let v = (0..p.head_dim)
                            .map(|e| f64::from(fx.v_blk[fx.bi(r, j, kvh, e)].to_f32()))
                            .collect();
                        keys.push((k, v));
                    }
                }
                let sc: Vec<f64> = keys
                    .iter()
                    .map(|(k, _)| {
                        let dot: f64 = (0..p.head_dim)
                            .map(|e| f64::from(fx.q[fx.qi(r, i, h, e)].to_f32()) * k[e])
                            .sum();
                        dot / (p.head_dim as f64).sqrt()
                    })
                    .collect();
                let mx = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = sc.iter().map(|x| (x - mx).exp()).sum();
                for e in 0..p.head_dim {
                    let num: f64 = sc
                        .iter()
                        .zip(&keys)
                        .map(|(x, (_, v))| (x - mx).exp() * v[e])
                        .sum();
                    res[fx.qi(r, i, h, e)] = Some(num / z);
                }
            }
        }
    }
    res
}

/// The reference output equals the independent value rounded once (within half a bf16 ulp;
/// a tiny slack for f64 summation-order differences), and dead elements are +0.0.
fn assert_matches_naive(fx: &Fx, out: &[bf16]) {
    for (idx, (o, n)) in out.iter().zip(naive(fx)).enumerate() {
        match n {
            None => assert_eq!(o.to_bits(), 0, "dead element {idx} must be +0.0"),
            Some(v) => {
                let tol = 0.5 * ulp_bf16(v) * (1.0 + 1e-9) + 1e-300;
                assert!(
                    (o.to_f64() - v).abs() <= tol,
                    "element {idx}: reference {o} vs naive {v}"
                );
            }
        }
    }
}

fn params(
    rows: usize,
    cols: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    lanes: usize,
    s: usize,
) -> LocalAttentionParams {
    LocalAttentionParams {
        rows,
        cols,
        q_heads: hq,
        kv_heads: hkv,
        head_dim: d,
        lanes,
        window: s,
    }
}

fn b(x: f32) -> bf16 {
    bf16::from_f32(x)
}

#[test]
fn hand_computed_one_head_two_columns() {
    // D = 2, one head, S = 4096, F = 1: keys are context p = 0 and block columns 0 and 1.
    let p = params(1, 2, 1, 1, 2, 1, 4096);
    let mut fx = Fx::random(p, vec![1], vec![2], 1);
    fx.q = vec![b(1.0), b(0.0), b(0.0), b(1.0)]; // q0 = (1, 0), q1 = (0, 1)
    fx.k_blk = vec![b(0.0), b(0.0), b(2.0), b(0.0)]; // kb0 = (0, 0), kb1 = (2, 0)
    fx.v_blk = vec![b(0.0), b(1.0), b(1.0), b(1.0)]; // vb0 = (0, 1), vb1 = (1, 1)
    let i0 = fx.ri(0, 0, 0, 0);
    fx.ring_k[i0] = b(1.0);
    fx.ring_k[i0 + 1] = b(1.0); // kc = (1, 1)
    fx.ring_v[i0] = f16::from_f32(1.0);
    fx.ring_v[i0 + 1] = f16::from_f32(0.0); // vc = (1, 0)
    let out = fx.out();
    let r2 = 2f64.sqrt();
    // Column 0: scores (kc, kb0, kb1) = (1, 0, 2) / sqrt 2.
    let (a, c, e) = ((1.0 / r2).exp(), 1.0, (2.0 / r2).exp());
    let z = a + c + e;
    let col0 = [(a + e) / z, (c + e) / z];
    // Column 1: scores (1, 0, 0) / sqrt 2.
    let (a, c, e) = ((1.0 / r2).exp(), 1.0, 1.0);
    let z = a + c + e;
    let col1 = [(a + e) / z, (c + e) / z];
    let want: Vec<u16> = col0
        .iter()
        .chain(&col1)
        .map(|&x| bf16::from_f64(x).to_bits())
        .collect();
    let got: Vec<u16> = out.iter().map(|x| x.to_bits()).collect();
    assert_eq!(got, want);
    // By hand: col 0 = (6.14137, 5.11325) / 7.14137, col 1 = (3.02812, 2) / 4.02812, each
    // rounded to the nearest bf16 (spacing 2^-8 in [0.5, 1), 2^-9 below).
    let hand: Vec<u16> = [0.859375f32, 0.71484375, 0.75, 0.49609375]
        .iter()
        .map(|&x| bf16::from_f32(x).to_bits())
        .collect();
    assert_eq!(got, hand);
}

#[test]
fn window_includes_distance_s_minus_1_and_excludes_s_for_context_keys() {
    // S = 8, F = 20: the ring's live interval is [12, 20); column 0 (p_q = 20) sees 13..19,
    // column 1 (p_q = 21) sees 14..19.
    let p = params(1, 2, 1, 1, 4, 1, 8);
    let fx = Fx::random(p, vec![20], vec![2], 2);
    let base = fx.out();
    let col = |o: &[bf16], i: usize| -> Vec<u16> {
        o[i * 4..i * 4 + 4].iter().map(|x| x.to_bits()).collect()
    };
    // Position 13 (distance 7 = S - 1 from column 0, S from column 1).
    let mut f13 = fx.clone();
    for e in 0..4 {
        let k = f13.ri(0, 13, 0, e);
        f13.ring_v[k] = f16::from_f32(f13.ring_v[k].to_f32() + 8.0);
    }
    let o13 = f13.out();
    assert_ne!(col(&o13, 0), col(&base, 0), "distance S-1 is visible");
    assert_eq!(col(&o13, 1), col(&base, 1), "distance S is not");
    // Position 12 (distance 8 = S from column 0): in the ring's live interval, never visible.
    let mut f12 = fx.clone();
    for e in 0..4 {
        let k = f12.ri(0, 12, 0, e);
        f12.ring_v[k] = f16::from_f32(-30.0);
        f12.ring_k[k] = b(50.0);
    }
    assert_eq!(f12.out(), base, "distance S excluded");
}

#[test]
fn window_clips_block_keys_too() {
    // S = 8, cols 16: block column j is visible from column i only when |j - i| < 8.
    let p = params(1, 16, 1, 1, 2, 1, 8);
    let fx = Fx::random(p, vec![5], vec![16], 3);
    let base = fx.out();
    let mut f = fx.clone();
    for e in 0..2 {
        let k = f.bi(0, 8, 0, e);
        f.v_blk[k] = b(f.v_blk[k].to_f32() + 16.0);
    }
    let o = f.out();
    for i in 0..16usize {
        let changed = o[i * 2..i * 2 + 2] != base[i * 2..i * 2 + 2];
        assert_eq!(changed, i.abs_diff(8) < 8, "column {i}");
    }
    assert_matches_naive(&fx, &base);
}

#[test]
fn dead_columns_are_exact_zeros_and_dead_block_keys_have_no_effect() {
    let p = params(2, 8, 2, 1, 4, 2, 64);
    let fx = Fx::random(p, vec![30, 3], vec![5, 8], 4);
    let base = fx.out();
    let per_col = 2 * 4;
    for (c, chunk) in base.chunks(per_col).enumerate() {
        let (r, i) = (c / 8, c % 8);
        if i >= fx.live[r] as usize {
            assert!(
                chunk.iter().all(|x| x.to_bits() == 0),
                "dead column {r},{i}"
            );
        } else {
            assert!(chunk.iter().any(|x| x.to_bits() != 0));
        }
    }
    let mut f = fx.clone();
    for i in 5..8 {
        for e in 0..4 {
            let k = f.bi(0, i, 0, e);
            f.k_blk[k] = b(40.0);
            f.v_blk[k] = b(-7.0);
            for h in 0..2 {
                let qk = f.qi(0, i, h, e);
                f.q[qk] = b(3.0);
            }
        }
    }
    assert_eq!(f.out(), base, "dead block columns have no effect");
    assert_matches_naive(&fx, &base);
}

#[test]
fn gqa_maps_query_heads_to_their_kv_group() {
    // Hq 4, Hkv 2: heads 0, 1 read KV head 0; heads 2, 3 read KV head 1.
    let p = params(1, 3, 4, 2, 4, 1, 16);
    let fx = Fx::random(p, vec![6], vec![3], 5);
    let base = fx.out();
    let mut f = fx.clone();
    for pos in 0..6 {
        for e in 0..4 {
            let k = f.ri(0, pos, 1, e);
            f.ring_v[k] = f16::from_f32(f.ring_v[k].to_f32() + 4.0);
        }
    }
    for j in 0..3 {
        for e in 0..4 {
            let k = f.bi(0, j, 1, e);
            f.v_blk[k] = b(f.v_blk[k].to_f32() + 4.0);
        }
    }
    let o = f.out();
    for i in 0..3 {
        for h in 0..4 {
            let s = fx.qi(0, i, h, 0);
            let same = o[s..s + 4] == base[s..s + 4];
            assert_eq!(same, h < 2, "column {i} head {h}");
        }
    }
}

#[test]
fn permuting_rows_permutes_outputs() {
    let p = params(3, 4, 2, 1, 8, 4, 6);
    let mut fx = Fx::random(p, vec![9, 0, 4], vec![4, 2, 3], 6);
    fx.lanes = vec![3, 0, 2];
    let base = fx.out();
    let perm = [2usize, 0, 1]; // new row n holds old row perm[n]
    let mut f = fx.clone();
    let qrow = 4 * 2 * 8;
    let krow = 4 * 8;
    for (n, &o) in perm.iter().enumerate() {
        f.q[n * qrow..(n + 1) * qrow].copy_from_slice(&fx.q[o * qrow..(o + 1) * qrow]);
        f.k_blk[n * krow..(n + 1) * krow].copy_from_slice(&fx.k_blk[o * krow..(o + 1) * krow]);
        f.v_blk[n * krow..(n + 1) * krow].copy_from_slice(&fx.v_blk[o * krow..(o + 1) * krow]);
        f.lanes[n] = fx.lanes[o];
        f.start_pos[n] = fx.start_pos[o];
        f.live[n] = fx.live[o];
    }
    let o = f.out();
    for (n, &old) in perm.iter().enumerate() {
        assert_eq!(
            o[n * qrow..(n + 1) * qrow],
            base[old * qrow..(old + 1) * qrow],
            "row {n}"
        );
    }
}

#[test]
fn ring_bytes_outside_the_live_interval_are_never_read() {
    // F = 3 < S = 8: slots 3..8 hold old bytes; F = 13: positions 5..13 live, slot of 5 is
    // position 5 (distance 8 from column 0), never visible.
    let p = params(2, 2, 1, 1, 2, 2, 8);
    let fx = Fx::random(p, vec![3, 13], vec![2, 2], 7);
    let base = fx.out();
    let mut f = fx.clone();
    for slot in 3..8 {
        for e in 0..2 {
            let k = (slot * 2) + e; // lane 0
            f.ring_k[k] = b(60.0);
            f.ring_v[k] = f16::from_f32(100.0);
        }
    }
    for e in 0..2 {
        let k = f.ri(1, 5, 0, e);
        f.ring_k[k] = b(60.0);
        f.ring_v[k] = f16::from_f32(100.0);
    }
    assert_eq!(f.out(), base);
    assert_matches_naive(&fx, &base);
}

#[test]
fn full_left_context_column_i_sees_s_minus_1_minus_i_positions() {
    // With all scores equal (q = 0), the output is the plain mean of the visible V: give each
    // context V the value 1 and each block V the value 0, so out = n_ctx / (n_ctx + n_blk).
    let s = 6;
    let p = params(1, 3, 1, 1, 2, 1, s);
    let mut fx = Fx::random(p, vec![50], vec![3], 8);
    fx.q.fill(b(0.0));
    fx.ring_v.fill(f16::from_f32(1.0));
    fx.v_blk.fill(b(0.0));
    let out = fx.out();
    for i in 0..3 {
        let n_ctx = (s - 1 - i) as f64;
        let want = bf16::from_f64(n_ctx / (n_ctx + 3.0));
        assert_eq!(out[i * 2], want, "column {i}");
    }
}

#[test]
fn workspace_size_and_split_count_are_static() {
    let p = params(8, 16, 32, 8, 128, 9, 4096);
    // min(ceil((4095 + 16) / 64), 512 / (8 rows * 8 KV heads)) = 8
    assert_eq!(split_count(&p), 8);
    // the partials of 8 splits (nothing else)
    assert_eq!(workspace_len(&p), 8 * 16 * 32 * 8 * 130);
    assert_eq!(split_count(&params(1, 16, 32, 8, 128, 2, 4096)), 64); // ceil(4111 / 64) = 65
    let small = params(1, 2, 2, 1, 8, 2, 40);
    assert_eq!(split_count(&small), 1); // ceil((39 + 2) / 64)
    assert_eq!(workspace_len(&small), 2 * 2 * 10);
}

#[test]
fn bad_inputs_are_refused_without_writing() {
    let p = params(2, 4, 2, 1, 4, 2, 8);
    let fx = Fx::random(p, vec![3, 9], vec![4, 2], 9);
    let be = Backend::cpu();
    let check = |f: &Fx, ws_len: usize, want: &dyn Fn(&OpsError) -> bool| {
        let mut out = be.filled(2 * 4 * 2 * 4, bf16::POISON).expect("alloc");
        let e = f
            .try_run_into(&mut out, ws_len)
            .expect_err("must be refused");
        assert!(want(&e), "{e}");
        assert!(
            be.download(&out)
                .expect("dl")
                .iter()
                .all(|x| x.to_bits() == bf16::POISON.to_bits()),
            "refused call wrote the output: {e}"
        );
    };
    let wl = workspace_len(&p);
    let mut f = fx.clone();
    f.live[1] = 0;
    check(&f, wl, &|e| {
        matches!(
            e,
            OpsError::Value {
                tensor: "live",
                index: 1,
                ..
            }
        )
    });
    f.live[1] = 5;
    check(&f, wl, &|e| {
        matches!(
            e,
            OpsError::Value {
                tensor: "live",
                index: 1,
                ..
            }
        )
    });
    let mut f = fx.clone();
    f.start_pos[0] = -1;
    check(&f, wl, &|e| {
        matches!(
            e,
            OpsError::Value {
                tensor: "start_pos",
                index: 0,
                ..
            }
        )
    });
    let mut f = fx.clone();
    f.lanes[1] = 2;
    check(&f, wl, &|e| {
        matches!(
            e,
            OpsError::Value {
                tensor: "lanes",
                index: 1,
                ..
            }
        )
    });
    f.lanes[1] = -1;
    check(&f, wl, &|e| {
        matches!(
            e,
            OpsError::Value {
                tensor: "lanes",
                index: 1,
                ..
            }
        )
    });
    check(&fx, wl - 1, &|e| {
        matches!(
            e,
            OpsError::Length {
                tensor: "workspace",
                ..
            }
        )
    });
    let mut f = fx.clone();
    f.ring_v.pop();
    check(&f, wl, &|e| {
        matches!(
            e,
            OpsError::Length {
                tensor: "ring_v",
                ..
            }
        )
    });
    let mut f = fx.clone();
    f.q.push(b(0.0));
    check(&f, wl, &|e| {
        matches!(e, OpsError::Length { tensor: "q", .. })
    });
    let mut f = fx.clone();
    f.p.q_heads = 3;
    f.p.kv_heads = 2;
    check(&f, wl, &|e| {
        matches!(
            e,
            OpsError::Param {
                param: "q_heads",
                ..
            }
        )
    });
    let mut f = fx.clone();
    f.p.head_dim = 3;
    check(&f, wl, &|e| {
        matches!(
            e,
            OpsError::Param {
                param: "head_dim",
                ..
            }
        )
    });
    let mut f = fx.clone();
    f.p.window = 0;
    check(&f, wl, &|e| {
        matches!(
            e,
            OpsError::Param {
                param: "window",
                ..
            }
        )
    });
    // A longer workspace is fine (it is scratch, shared between layers).
    let mut out = be.filled(2 * 4 * 2 * 4, bf16::POISON).expect("alloc");
    fx.try_run_into(&mut out, wl + 7)
        .expect("longer workspace accepted");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// The reference equals an independent f64 evaluation, rounded once, for random
    /// geometries, windows (including S smaller than the block), frontiers and live counts.
    #[test]
    fn matches_independent_f64(
        rows in 1usize..=3,
        cols in 1usize..=6,
        hkv in 1usize..=2,
        group in 1usize..=3,
        d in prop::sample::select(vec![2usize, 4, 8, 16]),
        s in 1usize..=10,
        fs in prop::collection::vec(0i32..=30, 3),
        lives in prop::collection::vec(1usize..=6, 3),
        seed in any::<u64>(),
    ) {
        let p = params(rows, cols, hkv * group, hkv, d, rows + 1, s);
        let live: Vec<i32> = lives[..rows].iter().map(|&l| l.min(cols) as i32).collect();
        let mut fx = Fx::random(p, fs[..rows].to_vec(), live, seed);
        fx.lanes = (0..rows).map(|r| (rows - r) as i32).collect();
        let out = fx.out();
        assert_matches_naive(&fx, &out);
    }
}

/// The f32 port of the CUDA split/merge (with the ring's key list starting at
/// max(0, F - S + 1)) agrees with the reference within the conformance criterion.
fn assert_port_matches(fx: &Fx, splits: usize, kt: usize) {
    let g = fx.p.geometry();
    let s = fx.p.window as i64;
    let x = attend::Inputs {
        q: &fx.q,
        k_blk: &fx.k_blk,
        v_blk: &fx.v_blk,
        ctx_k: &fx.ring_k,
        ctx_v: &fx.ring_v,
        start_pos: &fx.start_pos,
        live: &fx.live,
    };
    let emu = attend::emulate_split_kv(
        &g,
        s,
        splits,
        kt,
        &x,
        |r| {
            let f = i64::from(fx.start_pos[r]).max(0);
            (f, (f - s + 1).max(0))
        },
        |r, p| i64::from(fx.lanes[r]) * s + p % s,
    );
    let reference = fx.out();
    for (k, (e, r)) in emu.iter().zip(&reference).enumerate() {
        assert!(
            crate::registry::element_ok(
                attend::OUT_CRITERION,
                r.to_f64(),
                e.to_f64(),
                r.bits(),
                e.bits()
            ),
            "splits {splits} kt {kt} element {k}: port {e} vs reference {r}"
        );
        if r.to_bits() == 0 {
            assert_eq!(e.to_bits(), 0, "element {k}");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn split_kv_port_matches_reference(
        rows in 1usize..=3,
        cols in 1usize..=6,
        group in 1usize..=3,
        s in 1usize..=12,
        fs in prop::collection::vec(0i32..=40, 3),
        lives in prop::collection::vec(1usize..=6, 3),
        splits in prop::sample::select(vec![1usize, 2, 3, 7, 64]),
        kt in prop::sample::select(vec![1usize, 2, 4, 16, 64]),
        seed in any::<u64>(),
    ) {
        let p = params(rows, cols, 2 * group, 2, 8, rows, s);
        let live: Vec<i32> = lives[..rows].iter().map(|&l| l.min(cols) as i32).collect();
        let mut fx = Fx::random(p, fs[..rows].to_vec(), live, seed);
        fx.lanes.reverse();
        assert_port_matches(&fx, splits, kt);
        assert_port_matches(&fx, split_count(&fx.p), 64);
    }
}
