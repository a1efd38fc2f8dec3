use super::*;
use crate::proposal_argmax::tests::unit_inputs;
use proptest::prelude::*;

fn params(n: usize, rows: usize, hidden: usize, public_vocab: usize, head: ProposalHead) -> Params {
    Params {
        n,
        rows,
        hidden,
        public_vocab,
        head,
    }
}

fn topk_inputs(
    x: &[bf16],
    w: &[bf16],
    map: Option<&[i32]>,
    p: &Params,
) -> Result<(Vec<f32>, Vec<i32>)> {
    let be = Backend::cpu();
    let hx = be.upload(x)?;
    let hw = be.upload(w)?;
    let t = match map {
        Some(m) => Some(be.upload(m)?),
        None => None,
    };
    let mut s = be.filled(p.n * TOP_K, f32::POISON)?;
    let mut d = be.filled(p.n * TOP_K, i32::POISON)?;
    let mut ws = be.filled(workspace_len(p), f32::POISON)?;
    run(&be, &hx, &hw, t.as_ref(), &mut s, &mut d, &mut ws, p)?;
    Ok((be.download(&s)?, be.download(&d)?))
}

/// Top-16 of the given logits (`[n, rows]`, BF16 values, n <= 8) through the fused op.
fn topk(logits: &[f32], map: Option<&[i32]>, p: &Params) -> Result<(Vec<f32>, Vec<i32>)> {
    let (x, w) = unit_inputs(logits, p.n, p.rows);
    topk_inputs(&x, &w, map, p)
}

/// Independent recomputation: sort every candidate by (value desc, id asc) in f64, take 16.
fn oracle(
    logits: &[f32],
    map: Option<&[i32]>,
    rows: usize,
    considered: usize,
) -> (Vec<f32>, Vec<i32>) {
    let (mut s, mut d) = (Vec::new(), Vec::new());
    for row in logits.chunks_exact(rows) {
        let mut c: Vec<(f64, i32, f32)> = (0..considered)
            .map(|k| {
                (
                    f64::from(row[k]) + 0.0,
                    map.map_or(k as i32, |m| m[k]),
                    row[k],
                )
            })
            .collect();
        c.sort_by(|a, b| b.0.partial_cmp(&a.0).expect("no NaN").then(a.1.cmp(&b.1)));
        for &(_, id, v) in &c[..TOP_K] {
            s.push(v);
            d.push(id);
        }
    }
    (s, d)
}

#[test]
fn full_head_top16_is_sorted_with_ties_to_lower_ids_and_ignores_the_tail() {
    // 24 rows, 20 public. Values: row v holds (v % 5), with row 3 = 10 and the tail rows
    // 20..24 = 100 (must be ignored).
    let mut l: Vec<f32> = (0..24).map(|v| (v % 5) as f32).collect();
    l[3] = 10.0;
    for x in &mut l[20..] {
        *x = 100.0;
    }
    let (s, d) = topk(&l, None, &params(1, 24, 8, 20, ProposalHead::Full)).expect("run");
    // 10 (id 3), then the 4s: ids 4, 9, 14, 19; the 3s: 8, 13, 18; the 2s: 2, 7, 12, 17;
    // the 1s: 1, 6, 11, 16 (the 0s 0, 5, 10, 15 are cut).
    assert_eq!(
        d,
        vec![3, 4, 9, 14, 19, 8, 13, 18, 2, 7, 12, 17, 1, 6, 11, 16]
    );
    assert_eq!(
        s,
        vec![
            10.0, 4.0, 4.0, 4.0, 4.0, 3.0, 3.0, 3.0, 2.0, 2.0, 2.0, 2.0, 1.0, 1.0, 1.0, 1.0
        ]
    );
}

#[test]
fn indexed_head_orders_ties_by_global_id() {
    // 18 shortlist rows whose ids run backwards (row k -> 100 - 3k): with all scores equal
    // the winners are the 16 LOWEST global ids, i.e. the LAST 16 rows.
    let map: Vec<i32> = (0..18).map(|k| 100 - 3 * k).collect();
    let l = vec![0.5f32; 18];
    let p = params(1, 18, 8, 101, ProposalHead::Indexed);
    let (s, d) = topk(&l, Some(&map), &p).expect("run");
    let want: Vec<i32> = (2..18).rev().map(|k| 100 - 3 * k).collect();
    assert_eq!(d, want);
    assert_eq!(s, vec![0.5; 16]);
    // A large value beats every tie group; the most negative is cut.
    let mut l = vec![-1.0f32; 18];
    l[0] = 0.0; // id 100
    l[17] = 0.0; // id 49
    l[5] = 64.0; // id 85
    l[6] = -64.0; // id 82
    let (s, d) = topk(&l, Some(&map), &p).expect("run");
    assert_eq!(&d[..3], &[85, 49, 100]);
    assert_eq!(&s[..3], &[64.0, 0.0, 0.0]);
    assert!(!d.contains(&82), "the lowest is last and cut");
}

#[test]
fn all_equal_scores_give_the_lowest_ids() {
    let (s, d) = topk(
        &[2.5f32; 3 * 40],
        None,
        &params(3, 40, 8, 33, ProposalHead::Full),
    )
    .expect("run");
    assert_eq!(d, (0..3).flat_map(|_| 0..16).collect::<Vec<i32>>());
    assert!(s.iter().all(|&x| x == 2.5));
}

#[test]
fn nan_and_bad_maps_are_refused_without_writing() {
    let be = Backend::cpu();
    let (x, mut w) = unit_inputs(&[0.0f32; 2 * 20], 2, 20);
    // Row 19 (the tail with public 19): a NaN there makes row 19's logit NaN in every column
    // (NaN * 0 = NaN), which is allowed while the row is not a candidate.
    w[19 * 8 + 1] = bf16::NAN;
    let hx = be.upload(&x).expect("upload");
    let mut hw = be.upload(&w).expect("upload");
    let mut s = be.filled(32, f32::POISON).expect("alloc");
    let mut d = be.filled(32, i32::POISON).expect("alloc");
    let p19 = params(2, 20, 8, 19, ProposalHead::Full);
    let mut ws = be.filled(workspace_len(&p19), 0f32).expect("alloc");
    run(&be, &hx, &hw, None, &mut s, &mut d, &mut ws, &p19).expect("tail NaN ok");
    be.fill(&mut s, f32::POISON).expect("fill");
    be.fill(&mut d, i32::POISON).expect("fill");
    let p20 = params(2, 20, 8, 20, ProposalHead::Full);
    let e = run(&be, &hx, &hw, None, &mut s, &mut d, &mut ws, &p20).expect_err("public NaN");
    assert!(
        matches!(
            e,
            OpsError::Value {
                tensor: "hidden",
                index: 0,
                ..
            }
        ),
        "{e}"
    );
    w[19 * 8 + 1] = bf16::ZERO;
    hw = be.upload(&w).expect("upload");
    let mut map: Vec<i32> = (0..20).collect();
    map[7] = 3;
    let t = be.upload(&map).expect("upload");
    let pi = params(2, 20, 8, 20, ProposalHead::Indexed);
    let e = run(&be, &hx, &hw, Some(&t), &mut s, &mut d, &mut ws, &pi).expect_err("duplicate id");
    assert!(
        matches!(
            e,
            OpsError::Value {
                tensor: "token_ids",
                index: 7,
                ..
            }
        ),
        "{e}"
    );
    assert!(
        be.download(&s)
            .expect("dl")
            .iter()
            .all(|x| x.to_bits() == f32::POISON.to_bits())
    );
    assert!(
        be.download(&d)
            .expect("dl")
            .iter()
            .all(|&x| x == i32::POISON)
    );
}

#[test]
fn fewer_than_16_candidates_and_bad_lengths_are_refused() {
    let be = Backend::cpu();
    let hx = be.upload(&[bf16::ONE; 8]).expect("upload");
    let hw = be.upload(&[bf16::ONE; 20 * 8]).expect("upload");
    let mut s = be.filled(16, f32::POISON).expect("alloc");
    let mut d = be.filled(16, i32::POISON).expect("alloc");
    let p = params(1, 20, 8, 15, ProposalHead::Full);
    let mut ws = be.filled(workspace_len(&p), 0f32).expect("alloc");
    let e = run(&be, &hx, &hw, None, &mut s, &mut d, &mut ws, &p).expect_err("15 public");
    assert!(
        matches!(
            e,
            OpsError::Param {
                param: "public_vocab",
                ..
            }
        ),
        "{e}"
    );
    let hw15 = be.upload(&[bf16::ONE; 15 * 8]).expect("upload");
    let t = be.upload(&(0..15).collect::<Vec<i32>>()).expect("upload");
    let p = params(1, 15, 8, 99, ProposalHead::Indexed);
    let e = run(&be, &hx, &hw15, Some(&t), &mut s, &mut d, &mut ws, &p).expect_err("15 rows");
    assert!(matches!(e, OpsError::Param { param: "rows", .. }), "{e}");
    let mut short = be.filled(15, i32::POISON).expect("alloc");
    let p = params(1, 20, 8, 20, ProposalHead::Full);
    let e = run(&be, &hx, &hw, None, &mut s, &mut short, &mut ws, &p).expect_err("ids short");
    assert!(
        matches!(
            e,
            OpsError::Length {
                tensor: "ids",
                expected: 16,
                ..
            }
        ),
        "{e}"
    );
    let mut small_ws = be.filled(workspace_len(&p) - 1, 0f32).expect("alloc");
    let e = run(&be, &hx, &hw, None, &mut s, &mut d, &mut small_ws, &p).expect_err("ws");
    assert!(
        matches!(
            e,
            OpsError::Length {
                tensor: "workspace",
                ..
            }
        ),
        "{e}"
    );
    assert!(
        be.download(&s)
            .expect("dl")
            .iter()
            .all(|x| x.to_bits() == f32::POISON.to_bits())
    );
}

#[test]
fn exact_fixture_at_the_official_shortlist_shape_matches_the_oracle() {
    // Two columns at the official shortlist size with a shuffled map: the planted twins tie
    // exactly and the lower GLOBAL id must come first, whichever shortlist row holds it.
    let mut mix = Mix(5);
    let (n, rows, h) = (2, OFFICIAL_SHORTLIST, 512);
    let map = mix.distinct_shuffled(OFFICIAL_PUBLIC, rows);
    let (x, w) = exact_head_inputs(
        &mut mix,
        n,
        rows,
        h,
        OFFICIAL_PUBLIC,
        ProposalHead::Indexed,
        false,
    );
    let mut logits = vec![0f32; n * rows];
    crate::gemm::reference::run_f32(&x, &w, &mut logits, n, rows, h);
    let p = params(n, rows, h, OFFICIAL_PUBLIC, ProposalHead::Indexed);
    let got = topk_inputs(&x, &w, Some(&map), &p).expect("run");
    assert_eq!(got, oracle(&logits, Some(&map), rows, rows));
    for i in 0..n {
        // The first six are the planted twins at three levels, each pair tied.
        let s = &got.0[i * TOP_K..i * TOP_K + 6];
        assert!(s[0] == s[1] && s[2] == s[3] && s[4] == s[5] && s[1] > s[2] && s[3] > s[4]);
        let ids = &got.1[i * TOP_K..i * TOP_K + 6];
        assert!(ids[0] < ids[1] && ids[2] < ids[3] && ids[4] < ids[5]);
    }
}

proptest! {
    #[test]
    fn matches_an_independent_sort(
        n in 1usize..5,
        rows in 16usize..80,
        extra in 0usize..64,
        levels in 1u32..40,
        indexed_head in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let mut mix = Mix(seed);
        // `levels` distinct values: from all-equal (1) to mostly distinct.
        let logits: Vec<f32> = (0..n * rows)
            .map(|_| mix.below(levels as usize) as f32 * 0.25 - 3.0)
            .collect();
        if indexed_head {
            let public_vocab = rows + extra;
            let map = mix.distinct_shuffled(public_vocab, rows);
            let p = params(n, rows, 8, public_vocab, ProposalHead::Indexed);
            prop_assert_eq!(topk(&logits, Some(&map), &p).expect("run"), oracle(&logits, Some(&map), rows, rows));
        } else {
            let public_vocab = 16 + extra % (rows - 15);
            let p = params(n, rows, 8, public_vocab, ProposalHead::Full);
            prop_assert_eq!(topk(&logits, None, &p).expect("run"), oracle(&logits, None, rows, public_vocab));
        }
    }

    /// Random exact-data GEMMs (the conformance generator at small sizes) against the
    /// oracle over the f64 logits.
    #[test]
    fn fused_top16_matches_the_f64_logits(
        n in 1usize..8,
        rows in 16usize..300,
        h8 in 1usize..10,
        coarse in any::<bool>(),
        indexed_head in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let h = 8 * h8;
        let mut mix = Mix(seed);
        let (kind, public) = if indexed_head {
            (ProposalHead::Indexed, rows + 7)
        } else {
            (ProposalHead::Full, 16 + (rows - 16) * 3 / 4)
        };
        let map = indexed_head.then(|| mix.distinct_shuffled(public, rows));
        let (x, w) = exact_head_inputs(&mut mix, n, rows, h, public, kind, coarse);
        let exact = crate::gemm::reference::matmul_f64(&x, &w, n, rows, h);
        let logits: Vec<f32> = exact.iter().map(|&v| v as f32).collect();
        let considered = if indexed_head { rows } else { public };
        let got = topk_inputs(&x, &w, map.as_deref(), &params(n, rows, h, public, kind)).expect("run");
        prop_assert_eq!(got, oracle(&logits, map.as_deref(), rows, considered));
    }
}

/// What the two device models share: an entry (value, id), the empty entry and the total
/// order of the kernels (`ph_beats`: larger value, then lower id).
mod model {
    pub(super) const K: usize = 16;
    pub(super) const NO_ID: i32 = i32::MAX;
    pub(super) type Entry = (f32, i32);
    pub(super) const EMPTY: Entry = (f32::NEG_INFINITY, NO_ID);

    pub(super) fn beats(a: Entry, b: Entry) -> bool {
        a.0 > b.0 || (a.0 == b.0 && a.1 < b.1)
    }
}

/// A model of the CUDA top-16 epilogue (`PhTopk` in kernels/unary_topk.cu), one column of
/// one block: the running list; per tile, 32 holders of 4 logits each; the floor a list with
/// empty entries takes from the tile (`fill_floor`); passes in which every
/// holder first skips the column when its max is below a full list's threshold, else appends
/// its best unappended logit that beats the threshold (in any holder order: the kernel's
/// shared-memory atomics) and asks for another pass if a second one does; both merges of the
/// candidates into the list exactly as the kernel runs them (the column's thread pushing each
/// candidate, or a warp ranking the union). Checked against a sort, so a wrong insertion step,
/// a wrong rank (ties, empty entries), a lost second candidate of a holder or a wrong skip
/// fails here without a GPU.
mod epilogue_model {
    use super::model::{EMPTY, Entry, K, NO_ID, beats};
    use proptest::prelude::*;

    const CAP: usize = 32;
    const HOLDERS: usize = 32;

    /// `ut_push` exactly as the kernel runs it: skip unless `x` beats the last entry, then one
    /// compare-and-shift step per slot from the end, each step comparing `x` with the old entry
    /// above and reusing the previous step's compare for its own slot.
    fn push(list: &mut [Entry; K], x: Entry) {
        if !beats(x, list[K - 1]) {
            return;
        }
        let mut cur = true;
        for j in (1..K).rev() {
            let prev = beats(x, list[j - 1]);
            if prev {
                list[j] = list[j - 1];
            } else if cur {
                list[j] = x;
            }
            cur = prev;
        }
        if cur {
            list[0] = x;
        }
    }

    /// `fill_floor` of one column: for a list whose 16th entry is -inf, f = the 16th largest of
    /// the holders' best candidate logits (non-candidates and NaN left out, -inf for a holder
    /// with none; the kernel's `x > m` from -inf); when f > -inf every entry that does not beat
    /// (f, NO_ID) becomes (f, NO_ID). Returns f (None: no floor taken).
    fn floor(list: &mut [Entry; K], holders: &[[Entry; 4]]) -> Option<f32> {
        if list[K - 1].0 != f32::NEG_INFINITY {
            return None;
        }
        assert_eq!(holders.len(), HOLDERS);
        let mut maxes: Vec<f32> = holders
            .iter()
            .map(|h| {
                h.iter()
                    .filter(|e| e.1 != NO_ID)
                    .fold(f32::NEG_INFINITY, |m, e| if e.0 > m { e.0 } else { m })
            })
            .collect();
        maxes.sort_by(|a, b| b.total_cmp(a));
        let f = maxes[K - 1];
        raise(list, f);
        Some(f)
    }

    /// `raise_to`: the list raised to a column's shared floor g (every entry that does not beat
    /// (g, NO_ID) becomes that); -inf, or a floor the 16th entry already beats, changes nothing.
    fn raise(list: &mut [Entry; K], g: f32) {
        if g == f32::NEG_INFINITY || !beats((g, NO_ID), list[K - 1]) {
            return;
        }
        for e in list.iter_mut() {
            if !beats(*e, (g, NO_ID)) {
                *e = (g, NO_ID);
            }
        }
    }

    /// The two merges of a pass's candidates into the list.
    #[derive(Clone, Copy, Debug)]
    enum Merge {
        /// `insert_own`: the column's thread pushes the candidates in buffer order.
        Thread,
        /// `insert_warp`: ranks over the union, counted as the warp does (per candidate k:
        /// against every list entry and candidate, and a ballot of the list entries that beat
        /// it); each element ranked below 16 is written to its slot, every slot exactly once.
        Warp,
    }

    fn merge(list: &mut [Entry; K], cands: &[Entry], how: Merge) {
        assert!(cands.len() <= CAP, "a pass appends at most CAP candidates");
        match how {
            Merge::Thread => cands.iter().for_each(|&x| push(list, x)),
            Merge::Warp => {
                let mut rank_m: Vec<usize> = (0..K).collect();
                let mut rank_x = vec![0usize; cands.len()];
                for (k, &o) in cands.iter().enumerate() {
                    for (j, &m) in list.iter().enumerate() {
                        rank_m[j] += usize::from(beats(o, m));
                    }
                    for (i, &x) in cands.iter().enumerate() {
                        rank_x[i] += usize::from(beats(o, x));
                    }
                    rank_x[k] += list.iter().filter(|&&m| beats(m, o)).count();
                }
                let mut out = [None::<Entry>; K];
                let mut put = |rank: usize, e: Entry| {
                    if rank < K {
                        assert!(out[rank].is_none(), "slot {rank} written twice");
                        out[rank] = Some(e);
                    }
                };
                for (j, &m) in list.iter().enumerate() {
                    put(rank_m[j], m);
                }
                for (i, &x) in cands.iter().enumerate() {
                    put(rank_x[i], x);
                }
                for (slot, e) in list.iter_mut().zip(out) {
                    *slot = e.expect("every slot written");
                }
            }
        }
    }

    /// `tile`: `holders[h]` are the 4 (logit, id) elements of holder h (id NO_ID: not a
    /// candidate; NaN ranks as -inf); `order(pass)` permutes the holders' appends. Returns the
    /// number of passes.
    fn tile(
        list: &mut [Entry; K],
        holders: &[[Entry; 4]],
        how: Merge,
        mut order: impl FnMut(usize) -> Vec<usize>,
    ) -> usize {
        let mut done: Vec<[bool; 4]> = holders.iter().map(|h| h.map(|e| e.1 == NO_ID)).collect();
        // A floor taken from this tile is always pushed out by the tile's candidates.
        let filled = floor(list, holders).is_some_and(|f| f != f32::NEG_INFINITY);
        for pass in 0.. {
            // While the list is not full a holder appends one element per pass (at most 4
            // such passes); after that a pass either appends all its winners or fills the
            // buffer (CAP of the tile's 128 elements: at most 4 such passes), and one more
            // ends the tile.
            assert!(pass <= 8, "at most 9 passes per tile");
            let threshold = list[K - 1];
            let full = threshold.0 != f32::NEG_INFINITY;
            let mut buf = Vec::new();
            let mut reserved = 0usize; // the column's atomic counter: may pass CAP
            let mut more = false;
            for h in order(pass) {
                let x = holders[h];
                // fmaxf: NaN ignored (the max of four NaN is NaN, and fails the compare).
                let mx = x.iter().map(|e| e.0).fold(f32::NAN, f32::max);
                // `!(mx >= t)`, which holds for NaN too, as the kernel's compare.
                let below = mx.partial_cmp(&threshold.0).is_none_or(|o| o.is_lt());
                if threshold.0 != f32::NEG_INFINITY && below {
                    continue;
                }
                // A tie beats the threshold only with a lower id (the holder's lowest id,
                // done elements included).
                let id_min = x.iter().map(|e| e.1).min().unwrap_or(NO_ID);
                if threshold.0 != f32::NEG_INFINITY && mx == threshold.0 && id_min >= threshold.1 {
                    continue;
                }
                if full {
                    // Every winner at once, in consecutive reserved slots; those past CAP
                    // stay unappended for the next pass. (NaN beats no finite threshold.)
                    let win: Vec<usize> = (0..4)
                        .filter(|&k| !done[h][k] && beats(x[k], threshold))
                        .collect();
                    for (j, &k) in win.iter().enumerate() {
                        if reserved + j < CAP {
                            buf.push(x[k]);
                            done[h][k] = true;
                        } else {
                            more = true;
                        }
                    }
                    reserved += win.len();
                    continue;
                }
                let mut best: Option<(usize, Entry)> = None;
                let mut passing = 0;
                for k in 0..4 {
                    let e = (
                        if x[k].0.is_nan() {
                            f32::NEG_INFINITY
                        } else {
                            x[k].0
                        },
                        x[k].1,
                    );
                    if done[h][k] || !beats(e, threshold) {
                        continue;
                    }
                    passing += 1;
                    if best.is_none_or(|(_, b)| beats(e, b)) {
                        best = Some((k, e));
                    }
                }
                if let Some((k, e)) = best {
                    buf.push(e);
                    done[h][k] = true;
                    passing -= 1;
                }
                more |= passing > 0;
            }
            if !buf.is_empty() {
                merge(list, &buf, how);
            }
            if !more {
                assert!(
                    !filled || list.iter().all(|e| e.1 != NO_ID),
                    "a floor entry is left in the list after the tile: {list:?}"
                );
                return pass + 1;
            }
        }
        unreachable!("the pass loop ends by returning")
    }

    fn reference(all: &[Entry]) -> Vec<Entry> {
        let mut v: Vec<Entry> = all
            .iter()
            .filter(|e| e.1 != NO_ID)
            .map(|&(v, id)| (if v.is_nan() { f32::NEG_INFINITY } else { v }, id))
            .collect();
        v.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        v.resize(K.max(v.len()), EMPTY);
        v.truncate(K);
        v
    }

    fn shuffled(n: usize, next: &mut impl FnMut() -> u64) -> Vec<usize> {
        let mut p: Vec<usize> = (0..n).collect();
        for k in (1..n).rev() {
            p.swap(k, (next() % (k as u64 + 1)) as usize);
        }
        p
    }

    /// A xorshift64 stream from a proptest seed.
    fn xorshift(seed: u64) -> impl FnMut() -> u64 {
        let mut rng = seed | 1;
        move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        }
    }

    /// Tile `t`'s 128 elements: row i = 128 t + r scores `levels[i]` half steps (`nan`: NaN),
    /// its id is the row (ids ascend with the row, as the kernel's rows) unless `holes[i]` is
    /// 0 (no candidate).
    fn tile_elems(t: usize, levels: &[u8], holes: &[u8], nan: u8) -> Vec<Entry> {
        (0..128)
            .map(|r| {
                let i = t * 128 + r;
                let v = match levels[i] {
                    l if l == nan => f32::NAN,
                    l => f32::from(l) * 0.5,
                };
                (v, if holes[i] == 0 { NO_ID } else { i as i32 })
            })
            .collect()
    }

    /// Any partition of a tile's rows into the 32 holders of 4 (the kernel's is fixed).
    fn holders_of(elems: &[Entry], next: &mut impl FnMut() -> u64) -> Vec<[Entry; 4]> {
        let p = shuffled(128, next);
        (0..HOLDERS)
            .map(|h| std::array::from_fn(|k| elems[p[4 * h + k]]))
            .collect()
    }

    proptest! {
        #[test]
        fn threshold_filter_and_insertion_give_the_exact_top16(
            tiles in 1usize..6,
            // Few distinct values: many exact ties among and around the 16th entry.
            levels in prop::collection::vec(0u8..6, 128 * 5),
            holes in prop::collection::vec(0u8..16, 128 * 5),
            seed in any::<u64>(),
        ) {
            for how in MERGES {
                let mut next = xorshift(seed);
                let mut list = [EMPTY; K];
                let mut all = Vec::new();
                for t in 0..tiles {
                    let elems = tile_elems(t, &levels, &holes, 5);
                    let holders = holders_of(&elems, &mut next);
                    tile(&mut list, &holders, how, |_| shuffled(HOLDERS, &mut next));
                    all.extend_from_slice(&elems);
                }
                prop_assert_eq!(list.to_vec(), reference(&all), "merge {:?}", how);
            }
        }
    }

    proptest! {
        /// Several warpgroups of one column, their tiles run in any interleaving, each tile
        /// starting from the column's shared floor as published so far (`raise` to it, then
        /// `tile`, then publish the list's 16th value where it beats that floor, as atomicMax):
        /// the top 16 of the union of the final lists (the merge) is the exact top 16. Floors
        /// published a quarter step above the 16th value (half the levels' spacing) fail here.
        #[test]
        fn shared_floors_keep_the_merged_top16_exact(
            groups in 2usize..6,
            tiles in 1usize..5,
            levels in prop::collection::vec(0u8..7, 128 * 20),
            holes in prop::collection::vec(0u8..16, 128 * 20),
            seed in any::<u64>(),
        ) {
            for how in MERGES {
                let mut next = xorshift(seed);
                let mut lists = vec![[EMPTY; K]; groups];
                let mut left = vec![tiles; groups];
                let mut shared = f32::NEG_INFINITY;
                let mut all = Vec::new();
                let mut t = 0usize;
                while left.iter().any(|&l| l > 0) {
                    let live: Vec<usize> = (0..groups).filter(|&w| left[w] > 0).collect();
                    let w = live[(next() % live.len() as u64) as usize];
                    left[w] -= 1;
                    let elems = tile_elems(t, &levels, &holes, 6);
                    t += 1;
                    let holders = holders_of(&elems, &mut next);
                    let g = shared;
                    raise(&mut lists[w], g);
                    tile(&mut lists[w], &holders, how, |_| shuffled(HOLDERS, &mut next));
                    let v16 = lists[w][K - 1].0;
                    if v16 > g {
                        shared = shared.max(v16);
                    }
                    all.extend_from_slice(&elems);
                }
                let union: Vec<Entry> = lists.iter().flatten().copied().collect();
                let mut merged = union.clone();
                merged.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
                merged.truncate(K);
                prop_assert_eq!(merged, reference(&all), "merge {:?}", how);
            }
        }
    }

    #[test]
    fn a_raised_list_keeps_the_entries_above_the_floor_and_ties_still_enter() {
        for how in MERGES {
            // A first tile fills the list with rows 112..127 (logit = row).
            let order: Vec<usize> = (0..HOLDERS).collect();
            let mut list = [EMPTY; K];
            tile_into(&mut list, how, &order, |_, r| (r as f32, r));
            // Another warpgroup's floor 120: entries 120..127 stay, the rest become the floor.
            raise(&mut list, 120.0);
            let ids: Vec<i32> = list.iter().map(|e| e.1).collect();
            let mut want: Vec<i32> = (120..128).rev().collect();
            want.resize(K, NO_ID);
            assert_eq!(ids, want, "merge {how:?}");
            assert!(list[8..].iter().all(|e| e.0 == 120.0));
            // A tile whose logits tie the floor at lower ids enters above the floor entries;
            // one below the floor does not.
            tile_into(&mut list, how, &order, |h, r| {
                if h == 0 {
                    (120.0, r)
                } else if h == 1 {
                    (119.5, r)
                } else {
                    (0.0, 200 + r)
                }
            });
            let ids: Vec<i32> = list.iter().map(|e| e.1).collect();
            let mut want: Vec<i32> = (121..128).rev().collect();
            want.extend([0, 1, 2, 3, 120]);
            want.resize(K, NO_ID);
            assert_eq!(ids, want, "merge {how:?}");
            // A floor below the 16th entry changes nothing.
            let before = list;
            raise(&mut list, 119.0);
            assert_eq!(list, before);
        }
    }

    /// One tile whose holder h holds the elements `elem(h, row)` of rows 4h..4h+3, merged by
    /// `how` into `list` with holders appending in `order`: the number of passes.
    fn tile_into(
        list: &mut [Entry; K],
        how: Merge,
        order: &[usize],
        elem: impl Fn(usize, i32) -> Entry,
    ) -> usize {
        let holders: Vec<[Entry; 4]> = (0..HOLDERS)
            .map(|h| std::array::from_fn(|k| elem(h, (4 * h + k) as i32)))
            .collect();
        tile(list, &holders, how, |_| order.to_vec())
    }

    /// Two tiles into an empty list (`first` fills it): the second tile's passes and the
    /// list's ids afterwards.
    fn second_tile(
        how: Merge,
        first: impl Fn(usize, i32) -> Entry,
        second: impl Fn(usize, i32) -> Entry,
    ) -> (usize, Vec<i32>) {
        let order: Vec<usize> = (0..HOLDERS).collect();
        let mut list = [EMPTY; K];
        tile_into(&mut list, how, &order, first);
        assert!(
            list.iter().all(|e| e.1 != NO_ID),
            "the first tile fills the list"
        );
        let passes = tile_into(&mut list, how, &order, second);
        (passes, list.iter().map(|e| e.1).collect())
    }

    /// [`tile_into`] an empty list: the list's ids afterwards, and the list.
    fn one_tile(
        how: Merge,
        order: &[usize],
        elem: impl Fn(usize, i32) -> Entry,
    ) -> (Vec<i32>, [Entry; K]) {
        let mut list = [EMPTY; K];
        tile_into(&mut list, how, order, elem);
        (list.iter().map(|e| e.1).collect(), list)
    }

    const MERGES: [Merge; 2] = [Merge::Thread, Merge::Warp];

    #[test]
    fn fewer_candidates_than_sixteen_leave_empty_entries_last() {
        let reversed: Vec<usize> = (0..HOLDERS).rev().collect();
        for how in MERGES {
            let (got, _) = one_tile(how, &reversed, |_, r| {
                if r % 20 == 3 { (1.0, r) } else { (9.0, NO_ID) }
            });
            let mut want = vec![3, 23, 43, 63, 83, 103, 123];
            want.resize(K, NO_ID);
            assert_eq!(got, want, "merge {how:?}");
        }
    }

    #[test]
    fn a_first_tile_takes_its_floor_and_then_one_pass() {
        // Holder h holds rows h, h + 32, h + 64, h + 96 (the logit is the row): the holders'
        // best are 96..127, their 16th largest is 112, and exactly rows 112..127 reach it, so
        // one pass appends those 16 (and no floor entry is left: `tile` checks).
        for how in MERGES {
            let holders: Vec<[Entry; 4]> = (0..HOLDERS)
                .map(|h| std::array::from_fn(|k| ((h + 32 * k) as f32, (h + 32 * k) as i32)))
                .collect();
            let mut probe = [EMPTY; K];
            assert_eq!(floor(&mut probe, &holders), Some(112.0));
            assert!(probe.iter().all(|&e| e == (112.0, NO_ID)));
            let mut list = [EMPTY; K];
            let passes = tile(&mut list, &holders, how, |_| (0..HOLDERS).collect());
            assert_eq!(passes, 1, "merge {how:?}");
            let ids: Vec<i32> = list.iter().map(|e| e.1).collect();
            assert_eq!(ids, (112..128).rev().collect::<Vec<i32>>(), "merge {how:?}");
            // A full list takes no floor.
            assert_eq!(floor(&mut list, &holders), None);
        }
    }

    #[test]
    fn a_floor_keeps_the_entries_that_beat_it_and_ties_still_enter() {
        // A list with two real entries, one above the floor and one below; the tile's holders
        // all have 1.0 (ids 1000 + row): f = 1.0; (3.0, 7) stays, (0.5, 9) goes, and the
        // 1.0s with the lowest ids fill the rest.
        for how in MERGES {
            let mut list = [EMPTY; K];
            list[0] = (3.0, 7);
            list[1] = (0.5, 9);
            let holders: Vec<[Entry; 4]> = (0..HOLDERS)
                .map(|h| std::array::from_fn(|k| (1.0, 1000 + (4 * h + k) as i32)))
                .collect();
            tile(&mut list, &holders, how, |_| (0..HOLDERS).rev().collect());
            let mut want = vec![(3.0, 7)];
            want.extend((1000..1015).map(|r| (1.0, r)));
            assert_eq!(list.to_vec(), want, "merge {how:?}");
        }
    }

    #[test]
    fn nan_logits_enter_a_list_that_is_not_full_as_minus_infinity() {
        // Holder 0's four logits are NaN (max NaN: the skip must not apply while the list
        // still has empty entries); holder 1 has four real ones; the rest are no candidates.
        let order: Vec<usize> = (0..HOLDERS).collect();
        for how in MERGES {
            let (got, list) = one_tile(how, &order, |h, r| match h {
                0 => (f32::NAN, r),
                1 => (1.0, r),
                _ => (5.0, NO_ID),
            });
            let mut want = vec![4, 5, 6, 7, 0, 1, 2, 3];
            want.resize(K, NO_ID);
            assert_eq!(got, want, "merge {how:?}");
            assert!(list[4..8].iter().all(|e| e.0 == f32::NEG_INFINITY));
        }
    }

    #[test]
    fn more_winners_than_buffer_slots_wait_for_the_next_pass() {
        // A full list of sixteen 1.0s, then a tile whose 128 logits all beat it (ascending
        // with the row, ids 128..255): 128 winners of one column and 32 slots per pass, so
        // the first pass overflows and the overflowed winners must come in later passes at a
        // higher threshold (dropping them, or marking them appended, loses the best ones).
        for how in MERGES {
            let (passes, ids) = second_tile(how, |_, r| (1.0, r), |_, r| (2.0 + r as f32, 128 + r));
            assert!(passes >= 2, "merge {how:?}: {passes} passes");
            assert_eq!(ids, (240..256).rev().collect::<Vec<i32>>(), "merge {how:?}");
        }
    }

    #[test]
    fn a_full_list_takes_a_holders_winners_in_one_pass() {
        // After a first tile fills the list with 0.5s, holder 5 holds the four best logits of
        // the second tile: one pass appends all four (a second is only the final check).
        for how in MERGES {
            let (passes, ids) = second_tile(
                how,
                |_, r| (0.5, r),
                |h, r| (if h == 5 { 9.0 - (r % 4) as f32 } else { 0.25 }, 128 + r),
            );
            assert_eq!(passes, 1, "merge {how:?}");
            let mut want = vec![148, 149, 150, 151];
            want.extend(0..12);
            assert_eq!(ids, want, "merge {how:?}");
        }
    }

    #[test]
    fn a_holder_with_several_winners_gets_them_all_in_later_passes() {
        // Holder 0 holds the four best logits; every other holder holds worse ones. The first
        // pass appends one of holder 0's (its best), so the rest must come in passes 2..4.
        let order: Vec<usize> = (0..HOLDERS).collect();
        for how in MERGES {
            let (got, _) = one_tile(how, &order, |h, r| {
                (if h == 0 { 100.0 + (r % 4) as f32 } else { 1.0 }, r)
            });
            assert_eq!(&got[..4], &[3, 2, 1, 0], "merge {how:?}");
            assert_eq!(
                &got[4..],
                &(4..16).collect::<Vec<i32>>()[..],
                "merge {how:?}"
            );
        }
    }
}

#[test]
fn rising_fixture_puts_the_last_public_rows_first_and_negated_columns_reversed() -> Result<()> {
    // The conformance fixture whose later tiles beat everything before them: its reference
    // top-16 must be the last 16 public rows (rising columns) or the first 16 (columns 2, 5,
    // .. negated), with the scores the row index times the column's power of two.
    let run = full_case(9, 1000, 8, 990, rising_inputs)(&Backend::cpu())?;
    let (scores, ids) = (&run.outputs[0].values, &run.outputs[1].values);
    for i in 0..9 {
        let s = f64::from(1u8 << (i % 5)) * if i % 3 == 2 { -1.0 } else { 1.0 };
        let want: Vec<i32> = if s > 0.0 {
            (974..990).rev().collect()
        } else {
            (0..16).collect()
        };
        let got: Vec<i32> = ids[i * TOP_K..(i + 1) * TOP_K]
            .iter()
            .map(|&v| v as i32)
            .collect();
        assert_eq!(got, want, "column {i}");
        for (j, &r) in want.iter().enumerate() {
            assert_eq!(
                scores[i * TOP_K + j],
                s * f64::from(r),
                "column {i} entry {j}"
            );
        }
    }
    Ok(())
}

#[test]
fn equal_fixture_takes_the_lowest_16_ids_at_the_columns_power_of_two() -> Result<()> {
    // The conformance fixture whose logits tie everywhere: ids 0..15 in every column, every
    // score the column's power of two (rows past the public vocabulary are never candidates,
    // so a public vocabulary of 16 still gives 0..15).
    for public in [990, 16] {
        let run = full_case(9, 1000, 8, public, equal_inputs)(&Backend::cpu())?;
        let (scores, ids) = (&run.outputs[0].values, &run.outputs[1].values);
        for i in 0..9 {
            let got: Vec<i32> = ids[i * TOP_K..(i + 1) * TOP_K]
                .iter()
                .map(|&v| v as i32)
                .collect();
            assert_eq!(got, (0..16).collect::<Vec<i32>>(), "column {i}");
            let s = f64::from(1u8 << (i % 5));
            assert!(
                scores[i * TOP_K..(i + 1) * TOP_K].iter().all(|&x| x == s),
                "column {i}"
            );
        }
    }
    Ok(())
}

/// A model of the CUDA merge of the partial lists (`unary_topk_merge`: the warps' folds by
/// `ut_lane_merge`, the skip of a list that cannot enter, then the pairwise folds of the
/// warps' lists), checked against a sort of the union: a list loaded in the wrong order, a wrong
/// half-cleaner (which lane keeps the better entry, a missing stride), a skip that drops a
/// list that could enter or a warp's list left out of the pairwise folds fails here without a
/// GPU.
mod merge_model {
    use super::model::{EMPTY, Entry, K, NO_ID, beats};
    use proptest::prelude::*;

    /// Warps of a merge block (`UT_MERGE_WARPS`).
    const WARPS: usize = 16;

    /// `ut_lane_merge`: lanes 0..15 best first, 16..31 worst first (a bitonic sequence); the
    /// half-cleaners of stride 16, 8, 4, 2, 1, the lower lane of each pair keeping the better
    /// entry (every lane's result of a stage computed from the stage's inputs).
    fn lane_merge(lanes: &mut [Entry; 32]) {
        let mut s = 16;
        while s > 0 {
            let before = *lanes;
            for (i, slot) in lanes.iter_mut().enumerate() {
                let (me, other) = (before[i], before[i ^ s]);
                let take = if i & s == 0 {
                    beats(other, me)
                } else {
                    beats(me, other)
                };
                if take {
                    *slot = other;
                }
            }
            s /= 2;
        }
    }

    /// Lanes 16..31 take `list` reversed, then [`lane_merge`]: lanes 0..15 are the top 16.
    fn fold(lanes: &mut [Entry; 32], list: &[Entry; K]) {
        for (lane, slot) in lanes.iter_mut().enumerate().skip(K) {
            *slot = list[31 - lane];
        }
        lane_merge(lanes);
    }

    /// Lanes 0..15 of `lanes` as a list.
    fn head(lanes: &[Entry; 32]) -> [Entry; K] {
        let mut out = [EMPTY; K];
        out.copy_from_slice(&lanes[..K]);
        out
    }

    /// The kernel's block: warp w folds lists w, w + WARPS, ... in that order, skipping a list
    /// whose best entry does not beat its 16th; then at strides WARPS / 2, .., 1 warp w < h
    /// folds warp w + h's list the same way (skip included).
    fn block_merge(lists: &[[Entry; K]]) -> [Entry; K] {
        let mut warps = [[EMPTY; 32]; WARPS];
        for (w, lanes) in warps.iter_mut().enumerate() {
            for list in lists.iter().skip(w).step_by(WARPS) {
                if beats(list[0], lanes[K - 1]) {
                    fold(lanes, list);
                }
            }
        }
        let mut h = WARPS / 2;
        while h > 0 {
            for w in 0..h {
                let other = head(&warps[w + h]);
                if beats(other[0], warps[w][K - 1]) {
                    fold(&mut warps[w], &other);
                }
            }
            h /= 2;
        }
        head(&warps[0])
    }

    /// A sorted (best first) partial list of distinct ids with `len` real entries, the rest
    /// empty, as the epilogue writes it.
    fn sorted(mut xs: Vec<Entry>) -> [Entry; K] {
        xs.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut out = [EMPTY; K];
        for (slot, x) in out.iter_mut().zip(xs) {
            *slot = x;
        }
        out
    }

    /// The top 16 of the union's real entries, by a sort.
    fn want(lists: &[[Entry; K]]) -> [Entry; K] {
        sorted(
            lists
                .iter()
                .flatten()
                .copied()
                .filter(|e| e.1 != NO_ID)
                .collect(),
        )
    }

    /// `p` lists with 0..=16 entries each, in a random order; values from a small set (many
    /// exact ties, broken by the lower id), ids distinct across lists.
    fn lists(p: usize, seed: u64) -> Vec<[Entry; K]> {
        let mut s = seed | 1;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let mut id = 0i32;
        let mut out: Vec<[Entry; K]> = (0..p)
            .map(|_| {
                let len = (next() % (K as u64 + 1)) as usize;
                let xs = (0..len)
                    .map(|_| {
                        id += 1 + (next() % 3) as i32;
                        ((next() % 7) as f32 - 3.0, id)
                    })
                    .collect();
                sorted(xs)
            })
            .collect();
        // Shuffle, so the lowest ids (which win the ties) are not all in the first lists.
        for i in (1..out.len()).rev() {
            out.swap(i, (next() % (i as u64 + 1)) as usize);
        }
        out
    }

    #[test]
    fn lane_merge_keeps_the_top_16_of_two_lists_hand_checked() {
        // a = 15, 13, .., -15 (odd), b = 16, 14, .., -14 (even): the top 16 are 16 down to 1.
        let a = sorted((0..16).map(|k| (15.0 - 2.0 * k as f32, 2 * k)).collect());
        let b = sorted(
            (0..16)
                .map(|k| (16.0 - 2.0 * k as f32, 2 * k + 1))
                .collect(),
        );
        let mut lanes = [EMPTY; 32];
        lanes[..K].copy_from_slice(&a);
        fold(&mut lanes, &b);
        let got: Vec<f32> = lanes[..K].iter().map(|e| e.0).collect();
        assert_eq!(got, (1..=16).rev().map(|v| v as f32).collect::<Vec<_>>());
        // Equal values: the lower id first, across the two lists.
        let mut lanes = [EMPTY; 32];
        lanes[..K].copy_from_slice(&sorted(vec![(1.0, 4), (1.0, 8)]));
        fold(&mut lanes, &sorted(vec![(1.0, 2), (1.0, 6)]));
        let ids: Vec<i32> = lanes.iter().take(5).map(|e| e.1).collect();
        assert_eq!(ids, vec![2, 4, 6, 8, NO_ID]);
    }

    proptest! {
        #[test]
        fn block_merge_is_the_top_16_of_the_union(p in 1usize..=300, seed in any::<u64>()) {
            let lists = lists(p, seed);
            prop_assert_eq!(block_merge(&lists), want(&lists));
        }
    }
}
