use proptest::prelude::*;

use super::*;
use crate::registry::ulp_bf16;
use crate::sliding_window_attention::{self as swa, LocalAttentionParams};

/// Host-side inputs of one call.
#[derive(Clone)]
struct Fx {
    p: FullAttentionParams,
    q: Vec<bf16>,
    k_blk: Vec<bf16>,
    v_blk: Vec<bf16>,
    pages_k: Vec<bf16>,
    pages_v: Vec<f16>,
    table: Vec<i32>,
    start_pos: Vec<i32>,
    live: Vec<i32>,
}

impl Fx {
    /// Random data (fixed seed); every row's used pages are drawn from a random permutation
    /// of the pool (scattered), unused table entries are -1.
    fn random(
        rows: usize,
        cols: usize,
        hq: usize,
        hkv: usize,
        d: usize,
        page_size: usize,
        start_pos: Vec<i32>,
        live: Vec<i32>,
        seed: u64,
    ) -> Fx {
        let used: Vec<usize> = start_pos
            .iter()
            .map(|&f| (f as usize).div_ceil(page_size))
            .collect();
        let max_pages = used.iter().copied().max().unwrap_or(0) + 1;
        let pages = used.iter().sum::<usize>() + 2;
        let p = FullAttentionParams {
            rows,
            cols,
            q_heads: hq,
            kv_heads: hkv,
            head_dim: d,
            pages,
            page_size,
            max_pages,
        };
        let mut rng = CaseRng::new(seed);
        let perm = rng.permutation(pages);
        let mut table = vec![-1; rows * max_pages];
        let mut next = 0;
        for (r, &u) in used.iter().enumerate() {
            for k in 0..u {
                table[r * max_pages + k] = perm[next] as i32;
                next += 1;
            }
        }
        let g = p.geometry();
        let slots = pages * page_size * hkv * d;
        Fx {
            q: rng.bf16s(g.q_len(), 2.0),
            k_blk: rng.bf16s(g.kv_len(), 2.0),
            v_blk: rng.bf16s(g.kv_len(), 1.0),
            pages_k: rng.bf16s(slots, 2.0),
            pages_v: rng.ctx_v(slots, 1.0),
            table,
            start_pos,
            live,
            p,
        }
    }

    fn try_run_into(&self, out: &mut Buffer<bf16>, ws_len: usize) -> Result<()> {
        let be = Backend::cpu();
        let mut ws = be.filled(ws_len, f32::POISON)?;
        run(
            &be,
            &be.upload(&self.q)?,
            &be.upload(&self.k_blk)?,
            &be.upload(&self.v_blk)?,
            &be.upload(&self.pages_k)?,
            &be.upload(&self.pages_v)?,
            &be.upload(&self.table)?,
            &be.upload(&self.start_pos)?,
            &be.upload(&self.live)?,
            out,
            &mut ws,
            &self.p,
        )
    }

    fn out(&self) -> Vec<bf16> {
        let be = Backend::cpu();
        let mut out = be.filled(self.q.len(), bf16::POISON).expect("alloc");
        self.try_run_into(&mut out, workspace_len(&self.p))
            .expect("run");
        be.download(&out).expect("download")
    }

    fn qi(&self, r: usize, i: usize, h: usize, e: usize) -> usize {
        ((r * self.p.cols + i) * self.p.q_heads + h) * self.p.head_dim + e
    }

    fn bi(&self, r: usize, j: usize, kvh: usize, e: usize) -> usize {
        ((r * self.p.cols + j) * self.p.kv_heads + kvh) * self.p.head_dim + e
    }

    /// Flat index in the pool of context position `pos` of row r.
    fn ci(&self, r: usize, pos: usize, kvh: usize, e: usize) -> usize {
        let ps = self.p.page_size;
        let page = self.table[r * self.p.max_pages + pos / ps] as usize;
        ((page * ps + pos % ps) * self.p.kv_heads + kvh) * self.p.head_dim + e
    }
}

/// Independent plain f64 evaluation from the definition (all context positions [0, F) and
/// the live block columns; no window).
fn naive(fx: &Fx) -> Vec<Option<f64>> {
    let p = &fx.p;
    let group = p.q_heads / p.kv_heads;
    let mut res = vec![None; fx.q.len()];
    for r in 0..p.rows {
        let f = fx.start_pos[r] as usize;
        let live = fx.live[r] as usize;
        for i in 0..live {
            for h in 0..p.q_heads {
                let kvh = h / group;
                let mut sc = Vec::new();
                let mut vs: Vec<Vec<f64>> = Vec::new();
                let dot = |kf: &dyn Fn(usize) -> f64| -> f64 {
                    (0..p.head_dim)
                        .map(|e| f64::from(fx.q[fx.qi(r, i, h, e)].to_f32()) * kf(e))
                        .sum::<f64>()
                        / (p.head_dim as f64).sqrt()
                };
                for pos in 0..f {
                    sc.push(dot(&|e| {
                        f64::from(fx.pages_k[fx.ci(r, pos, kvh, e)].to_f32())
                    }));
                    vs.push(
                        (0..p.head_dim)
                            .map(|e| f64::from(fx.pages_v[fx.ci(r, pos, kvh, e)].to_f32()))
                            .collect(),
                    );
                }
                for j in 0..live {
                    sc.push(dot(&|e| f64::from(fx.k_blk[fx.bi(r, j, kvh, e)].to_f32())));
                    vs.push(
                        (0..p.head_dim)
                            .map(|e| f64::from(fx.v_blk[fx.bi(r, j, kvh, e)].to_f32()))
                            .collect(),
                    );
                }
                let mx = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = sc.iter().map(|x| (x - mx).exp()).sum();
                for e in 0..p.head_dim {
                    let num: f64 = sc.iter().zip(&vs).map(|(x, v)| (x - mx).exp() * v[e]).sum();
                    res[fx.qi(r, i, h, e)] = Some(num / z);
                }
            }
        }
    }
    res
}

fn assert_matches_naive(fx: &Fx, out: &[bf16]) {
    for (idx, (o, n)) in out.iter().zip(naive(fx)).enumerate() {
        match n {
            None => assert_eq!(o.to_bits(), 0, "dead element {idx} must be +0.0"),
            Some(v) => {
                let tol = 0.5 * ulp_bf16(v) * (1.0 + 1e-9) + 1e-300;
                assert!(
                    (o.to_f64() - v).abs() <= tol,
                    "element {idx}: {o} vs naive {v}"
                );
            }
        }
    }
}

fn b(x: f32) -> bf16 {
    bf16::from_f32(x)
}

#[test]
fn hand_computed_one_head_over_scattered_pages() {
    // D = 2, page_size 1, F = 2: context positions 0 and 1 live in pages table[0] and
    // table[1] (scattered), plus block column 0; one live column.
    let mut fx = Fx::random(1, 1, 1, 1, 2, 1, vec![2], vec![1], 1);
    fx.q = vec![b(2.0), b(0.0)];
    fx.k_blk = vec![b(0.0), b(0.0)];
    fx.v_blk = vec![b(0.0), b(0.5)];
    for (pos, k, v) in [(0, (1.0, 0.0), (1.0, 0.0)), (1, (-1.0, 0.0), (0.0, 1.0))] {
        let i = fx.ci(0, pos, 0, 0);
        fx.pages_k[i] = b(k.0);
        fx.pages_k[i + 1] = b(k.1);
        fx.pages_v[i] = f16::from_f32(v.0);
        fx.pages_v[i + 1] = f16::from_f32(v.1);
    }
    assert_ne!(fx.table[0], 0, "seed 1 scatters the first page");
    // Scores (2, -2, 0) / sqrt 2 = (s, -s, 0) with s = sqrt 2.
    let s = 2f64.sqrt();
    let (a, c, e) = (s.exp(), (-s).exp(), 1.0);
    let z = a + c + e;
    let want = [a / z, (c + 0.5 * e) / z];
    let out = fx.out();
    let got: Vec<u16> = out.iter().map(|x| x.to_bits()).collect();
    let want_bits: Vec<u16> = want.iter().map(|&x| bf16::from_f64(x).to_bits()).collect();
    assert_eq!(got, want_bits);
    // By hand: a = 4.11325, c = 0.24312, z = 5.35637: (0.76792, 0.13873) ->
    // nearest bf16: 0.769531 (197/256) and 0.138672 (142/1024).
    assert_eq!(out[0], b(0.76953125));
    assert_eq!(out[1], b(142.0 / 1024.0));
}

#[test]
fn no_context_attends_only_live_block_keys() {
    // F = 0 everywhere: the output depends only on the live block columns.
    let fx = Fx::random(3, 4, 2, 2, 8, 16, vec![0, 0, 0], vec![4, 1, 3], 2);
    let out = fx.out();
    assert_matches_naive(&fx, &out);
    // A single live column attends only to itself: out = its own V (rounded once).
    for h in 0..2 {
        for e in 0..8 {
            let v = fx.v_blk[fx.bi(1, 0, h, e)];
            assert_eq!(out[fx.qi(1, 0, h, e)], v, "row 1 head {h} elem {e}");
        }
    }
}

#[test]
fn only_used_pages_are_read_and_every_context_position_counts() {
    let fx = Fx::random(2, 2, 2, 1, 4, 4, vec![6, 9], vec![2, 2], 3);
    let base = fx.out();
    // Garbage in unused table entries and in pages no row uses changes nothing.
    let mut f = fx.clone();
    let used: Vec<i32> = fx.table.iter().copied().filter(|&x| x >= 0).collect();
    for e in f.table.iter_mut().filter(|e| **e < 0) {
        *e = 1_000_000;
    }
    for page in 0..f.p.pages {
        if !used.contains(&(page as i32)) {
            let n = f.p.page_size * 4;
            f.pages_v[page * n..(page + 1) * n].fill(f16::from_f32(500.0));
        }
    }
    // Slots past F in the last used page are not context either.
    let tail = f.ci(0, 7, 0, 0);
    f.pages_v[tail..tail + 4].fill(f16::from_f32(500.0));
    assert_eq!(f.out(), base);
    // The last context position (F - 1) counts, for every live column.
    let mut f = fx.clone();
    let last = f.ci(1, 8, 0, 0);
    f.pages_v[last..last + 4].fill(f16::from_f32(9.0));
    let o = f.out();
    for i in 0..2 {
        let s = fx.qi(1, i, 0, 0);
        assert_ne!(o[s..s + 4], base[s..s + 4], "column {i}");
        let s0 = fx.qi(0, i, 0, 0);
        assert_eq!(o[s0..s0 + 8], base[s0..s0 + 8], "row 0 unaffected");
    }
}

#[test]
fn dead_columns_are_exact_zeros_and_dead_block_keys_have_no_effect() {
    let fx = Fx::random(2, 6, 4, 2, 4, 2, vec![5, 0], vec![2, 6], 4);
    let base = fx.out();
    assert_matches_naive(&fx, &base);
    let mut f = fx.clone();
    for j in 2..6 {
        for kvh in 0..2 {
            for e in 0..4 {
                let k = f.bi(0, j, kvh, e);
                f.k_blk[k] = b(30.0);
                f.v_blk[k] = b(-3.0);
            }
        }
        for h in 0..4 {
            let s = f.qi(0, j, h, 0);
            f.q[s..s + 4].fill(b(5.0));
        }
    }
    assert_eq!(f.out(), base);
}

#[test]
fn gqa_and_row_isolation() {
    // Hq 4, Hkv 1 (group 4): a KV change moves every head of its row and nothing in others.
    let fx = Fx::random(2, 2, 4, 1, 4, 2, vec![3, 3], vec![2, 2], 5);
    let base = fx.out();
    let mut f = fx.clone();
    let i = f.ci(0, 1, 0, 0);
    f.pages_v[i..i + 4].fill(f16::from_f32(7.0));
    let o = f.out();
    let row = 2 * 4 * 4;
    for c in 0..2 {
        for h in 0..4 {
            let s = fx.qi(0, c, h, 0);
            assert_ne!(o[s..s + 4], base[s..s + 4], "column {c} head {h}");
        }
    }
    assert_eq!(o[row..], base[row..], "row 1 never sees row 0's context");
}

#[test]
fn permuting_rows_permutes_outputs() {
    let fx = Fx::random(3, 3, 2, 1, 4, 2, vec![5, 0, 8], vec![3, 2, 1], 6);
    let base = fx.out();
    let perm = [1usize, 2, 0];
    let mut f = fx.clone();
    let (qrow, krow, mp) = (3 * 2 * 4, 3 * 4, fx.p.max_pages);
    for (n, &o) in perm.iter().enumerate() {
        f.q[n * qrow..(n + 1) * qrow].copy_from_slice(&fx.q[o * qrow..(o + 1) * qrow]);
        f.k_blk[n * krow..(n + 1) * krow].copy_from_slice(&fx.k_blk[o * krow..(o + 1) * krow]);
        f.v_blk[n * krow..(n + 1) * krow].copy_from_slice(&fx.v_blk[o * krow..(o + 1) * krow]);
        f.table[n * mp..(n + 1) * mp].copy_from_slice(&fx.table[o * mp..(o + 1) * mp]);
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
fn local_layer_with_a_window_past_the_block_equals_the_full_layer() {
    // The two ops share their math: with S > F + cols nothing is clipped, so a ring holding
    // the same context gives bit-identical outputs.
    let fx = Fx::random(2, 3, 4, 2, 8, 4, vec![7, 2], vec![3, 2], 7);
    let s = 16;
    let lp = LocalAttentionParams {
        rows: 2,
        cols: 3,
        q_heads: 4,
        kv_heads: 2,
        head_dim: 8,
        lanes: 2,
        window: s,
    };
    let ring_len = 2 * s * 2 * 8;
    let mut ring_k = vec![b(0.0); ring_len];
    let mut ring_v = vec![f16::from_f32(0.0); ring_len];
    for r in 0..2 {
        for pos in 0..fx.start_pos[r] as usize {
            for kvh in 0..2 {
                for e in 0..8 {
                    let dst = ((r * s + pos) * 2 + kvh) * 8 + e;
                    ring_k[dst] = fx.pages_k[fx.ci(r, pos, kvh, e)];
                    ring_v[dst] = fx.pages_v[fx.ci(r, pos, kvh, e)];
                }
            }
        }
    }
    let be = Backend::cpu();
    let mut out = be.filled(fx.q.len(), bf16::POISON).expect("alloc");
    let mut ws = be.filled(swa::workspace_len(&lp), 0f32).expect("alloc");
    swa::run(
        &be,
        &be.upload(&fx.q).expect("up"),
        &be.upload(&fx.k_blk).expect("up"),
        &be.upload(&fx.v_blk).expect("up"),
        &be.upload(&ring_k).expect("up"),
        &be.upload(&ring_v).expect("up"),
        &be.upload(&[0, 1]).expect("up"),
        &be.upload(&fx.start_pos).expect("up"),
        &be.upload(&fx.live).expect("up"),
        &mut out,
        &mut ws,
        &lp,
    )
    .expect("local run");
    assert_eq!(be.download(&out).expect("dl"), fx.out());
}

#[test]
fn bad_inputs_are_refused_without_writing() {
    let fx = Fx::random(2, 3, 2, 1, 4, 4, vec![5, 8], vec![3, 1], 8);
    let be = Backend::cpu();
    let check = |f: &Fx, ws_len: usize, want: &dyn Fn(&OpsError) -> bool| {
        let mut out = be.filled(fx.q.len(), bf16::POISON).expect("alloc");
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
    let wl = workspace_len(&fx.p);
    let cap = (fx.p.max_pages * fx.p.page_size) as i32;
    let mut f = fx.clone();
    f.start_pos[1] = cap + 1;
    check(&f, wl, &|e| {
        matches!(
            e,
            OpsError::Value {
                tensor: "start_pos",
                index: 1,
                ..
            }
        )
    });
    let mut f = fx.clone();
    f.start_pos[0] = -3;
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
    f.table[f.p.max_pages + 1] = f.p.pages as i32; // row 1 uses 2 pages: entry 1 is used
    check(&f, wl, &|e| {
        matches!(
            e,
            OpsError::Value {
                tensor: "page_table",
                ..
            }
        )
    });
    let mut f = fx.clone();
    f.table[1] = -1; // row 0 uses 2 pages
    check(&f, wl, &|e| {
        matches!(
            e,
            OpsError::Value {
                tensor: "page_table",
                index: 1,
                ..
            }
        )
    });
    let mut f = fx.clone();
    f.live[0] = 4;
    check(&f, wl, &|e| {
        matches!(
            e,
            OpsError::Value {
                tensor: "live",
                index: 0,
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
    f.table.pop();
    check(&f, wl, &|e| {
        matches!(
            e,
            OpsError::Length {
                tensor: "page_table",
                ..
            }
        )
    });
    let mut f = fx.clone();
    f.pages_k.pop();
    check(&f, wl, &|e| {
        matches!(
            e,
            OpsError::Length {
                tensor: "pages_k",
                ..
            }
        )
    });
    let mut f = fx.clone();
    f.p.page_size = 0;
    check(&f, wl, &|e| {
        matches!(
            e,
            OpsError::Param {
                param: "page_size",
                ..
            }
        )
    });
    let mut f = fx.clone();
    f.p.kv_heads = 0;
    check(&f, wl, &|e| {
        matches!(
            e,
            OpsError::Param {
                param: "kv_heads",
                ..
            }
        )
    });
    // A frontier exactly at capacity is fine when the table covers it.
    let mut f = fx.clone();
    f.start_pos[0] = cap;
    for k in 0..f.p.max_pages {
        f.table[k] = k as i32;
    }
    let mut out = be.filled(fx.q.len(), bf16::POISON).expect("alloc");
    f.try_run_into(&mut out, wl).expect("F = capacity accepted");
}

#[test]
fn workspace_size_and_split_count_are_static() {
    let p = FullAttentionParams {
        rows: 8,
        cols: 16,
        q_heads: 32,
        kv_heads: 8,
        head_dim: 128,
        pages: 4096,
        page_size: 16,
        max_pages: 320,
    };
    // min(ceil((5120 + 16) / 64), 512 / (8 rows * 8 KV heads)) = 8
    assert_eq!(split_count(&p), 8);
    assert_eq!(workspace_len(&p), 8 * 16 * 32 * 8 * 130); // the partials, nothing else
    let small = FullAttentionParams {
        rows: 1,
        cols: 4,
        max_pages: 3,
        ..p
    };
    assert_eq!(split_count(&small), 1); // ceil((48 + 4) / 64)
    assert_eq!(workspace_len(&small), 4 * 32 * 130);
    let big = FullAttentionParams {
        rows: 1,
        max_pages: 1 << 16,
        ..p
    };
    assert_eq!(split_count(&big), 64);
}

/// Scores that grow by far more than the lazy margin late in the key list (the last used page
/// of every row holds keys 64 times larger): the base is raised mid-row and mid-split, and the
/// rescaled partials still match the definition, at every split count and tile size.
#[test]
fn split_kv_port_matches_reference_when_scores_jump() {
    let mut fx = Fx::random(2, 3, 4, 2, 8, 4, vec![37, 22], vec![3, 2], 0x5eed);
    for r in 0..2 {
        let f = fx.start_pos[r] as usize;
        for pos in (f - f % 4).min(f - 1)..f {
            for kvh in 0..2 {
                for e in 0..8 {
                    let i = fx.ci(r, pos, kvh, e);
                    fx.pages_k[i] = bf16::from_f32(fx.pages_k[i].to_f32() * 64.0);
                }
            }
        }
    }
    for (splits, kt) in [(1, 1), (1, 4), (3, 2), (7, 16), (64, 1)] {
        assert_port_matches(&fx, splits, kt);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// The reference equals an independent f64 evaluation rounded once, for random
    /// geometries, page sizes, scattered tables, frontiers (including 0) and live counts.
    #[test]
    fn matches_independent_f64(
        rows in 1usize..=3,
        cols in 1usize..=5,
        hkv in 1usize..=2,
        group in 1usize..=3,
        d in prop::sample::select(vec![2usize, 4, 8, 16]),
        page_size in 1usize..=5,
        fs in prop::collection::vec(0i32..=25, 3),
        lives in prop::collection::vec(1usize..=5, 3),
        seed in any::<u64>(),
    ) {
        let live: Vec<i32> = lives[..rows].iter().map(|&l| l.min(cols) as i32).collect();
        let fs = fs[..rows].to_vec();
        let fx = Fx::random(rows, cols, hkv * group, hkv, d, page_size, fs, live, seed);
        let out = fx.out();
        assert_matches_naive(&fx, &out);
    }
}

/// The f32 port of the CUDA split/merge agrees with the reference within the conformance
/// criterion for any split count (more splits than keys gives neutral partials).
fn assert_port_matches(fx: &Fx, splits: usize, kt: usize) {
    let g = fx.p.geometry();
    let cap = (fx.p.max_pages * fx.p.page_size) as i64;
    let x = attend::Inputs {
        q: &fx.q,
        k_blk: &fx.k_blk,
        v_blk: &fx.v_blk,
        ctx_k: &fx.pages_k,
        ctx_v: &fx.pages_v,
        start_pos: &fx.start_pos,
        live: &fx.live,
    };
    let emu = attend::emulate_split_kv(
        &g,
        0,
        splits,
        kt,
        &x,
        |r| (i64::from(fx.start_pos[r]).clamp(0, cap), 0),
        |r, p| {
            let ps = fx.p.page_size as i64;
            let pg = fx.table[r * fx.p.max_pages + (p / ps) as usize];
            if pg < 0 || pg as usize >= fx.p.pages {
                -1
            } else {
                i64::from(pg) * ps + p % ps
            }
        },
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
        cols in 1usize..=5,
        group in 1usize..=3,
        page_size in 1usize..=4,
        fs in prop::collection::vec(0i32..=40, 3),
        lives in prop::collection::vec(1usize..=5, 3),
        splits in prop::sample::select(vec![1usize, 2, 3, 7, 64]),
        kt in prop::sample::select(vec![1usize, 2, 4, 16, 64]),
        seed in any::<u64>(),
    ) {
        let live: Vec<i32> = lives[..rows].iter().map(|&l| l.min(cols) as i32).collect();
        let fs = fs[..rows].to_vec();
        let fx = Fx::random(rows, cols, 2 * group, 2, 8, page_size, fs, live, seed);
        assert_port_matches(&fx, splits, kt);
        assert_port_matches(&fx, split_count(&fx.p), 64);
    }
}
