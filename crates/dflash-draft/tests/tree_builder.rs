//! The DFlash2 tree builder (`dflash_draft::tree`) on small host lattices: the spine against
//! `candidate_selector`'s CPU walk, structural invariants, a seed-independent shape, dropped
//! children under small support, greedy order, the without-replacement law of a second draw
//! and hand-computed best-first shapes. Every lattice comes from a fixed seed.

use dflash_draft::DraftError;
use dflash_draft::tree::{self, Chain, DraftTree, EdgeScores, HostLattice, TreeOptions};
use dflash_ops::Backend;
use dflash_ops::bf16;
use dflash_ops::candidate_selector::{self, Inputs, Outputs, Params, TOP_K};

/// splitmix64: the test's only source of randomness (fixed seeds).
struct Mix(u64);

impl Mix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    fn f32_in(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.unit()
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// One request's lattice as host tensors.
struct Lattice {
    k: usize,
    rank: usize,
    vocab: usize,
    g: Vec<bf16>,
    unary: Vec<f32>,
    cand: Vec<i32>,
    w_pred: Vec<bf16>,
    w_succ: Vec<bf16>,
}

impl Lattice {
    /// Random g and codebooks in (-1, 1), 16 distinct candidates per column, unary scores
    /// descending by ~`spread` per rank: edge terms and unary scores both matter.
    fn random(k: usize, rank: usize, vocab: usize, spread: f32, seed: u64) -> Self {
        let mut mix = Mix(seed);
        let mut book = |n: usize| -> Vec<bf16> {
            (0..n)
                .map(|_| bf16::from_f32(mix.f32_in(-1.0, 1.0)))
                .collect()
        };
        let g = book(k * rank);
        let (w_pred, w_succ) = (book(vocab * rank), book(vocab * rank));
        let mut cand = Vec::new();
        let mut unary = Vec::new();
        for _ in 0..k {
            let mut ids: Vec<i32> = Vec::new();
            while ids.len() < TOP_K {
                let id = mix.below(vocab) as i32;
                if !ids.contains(&id) {
                    ids.push(id);
                }
            }
            cand.extend(ids);
            let mut u = 0.0;
            for _ in 0..TOP_K {
                unary.push(u);
                u -= spread * mix.f32_in(0.0, 2.0);
            }
        }
        Lattice {
            k,
            rank,
            vocab,
            g,
            unary,
            cand,
            w_pred,
            w_succ,
        }
    }

    /// W_pred = 0, so `E_i[p, c] = unary[i][c]` exactly for every predecessor p; the
    /// candidates of column i are `100 * i + c`.
    fn unary_only(unary: &[[f32; TOP_K]]) -> Self {
        let (k, rank, vocab) = (unary.len(), 2, 100 * unary.len() + TOP_K);
        Lattice {
            k,
            rank,
            vocab,
            g: vec![bf16::from_f32(1.0); k * rank],
            unary: unary.concat(),
            cand: (0..k)
                .flat_map(|i| (0..TOP_K).map(move |c| (100 * i + c) as i32))
                .collect(),
            w_pred: vec![bf16::from_f32(0.0); vocab * rank],
            w_succ: vec![bf16::from_f32(0.5); vocab * rank],
        }
    }

    fn host(&self) -> HostLattice<'_> {
        HostLattice::new(
            self.k,
            self.rank,
            &self.g,
            &self.unary,
            &self.cand,
            &self.w_pred,
            &self.w_succ,
        )
        .expect("a valid lattice")
    }
}

/// The selector's CPU walk of one row: (proposals, q, chosen).
struct Walk {
    proposals: Vec<i32>,
    q: Vec<f32>,
    chosen: Vec<i32>,
}

fn select(l: &Lattice, anchor: u32, t: f32, seed: u64, frontier: u64) -> Walk {
    let be = Backend::cpu();
    let up_i = |x: &[i32]| be.upload(x).expect("upload");
    let (g, unary) = (be.upload(&l.g).expect("g"), be.upload(&l.unary).expect("u"));
    let (wp, ws) = (
        be.upload(&l.w_pred).expect("wp"),
        be.upload(&l.w_succ).expect("ws"),
    );
    let cand = up_i(&l.cand);
    let anchors = up_i(&[anchor as i32]);
    let seeds = up_i(&[seed as u32 as i32, (seed >> 32) as u32 as i32]);
    let start = up_i(&[frontier as i32]);
    let temp = be.upload(&[t]).expect("t");
    let mut proposals = be.filled(l.k, -1i32).expect("p");
    let mut q = be.filled(l.k * TOP_K, -1f32).expect("q");
    let mut chosen = be.filled(l.k, -1i32).expect("c");
    candidate_selector::run(
        &be,
        &Inputs {
            g: &g,
            cand_ids: &cand,
            unary: &unary,
            w_pred: &wp,
            w_succ: &ws,
            anchors: &anchors,
            seeds: &seeds,
            start_pos: &start,
            temperature: &temp,
        },
        &mut Outputs {
            proposals: &mut proposals,
            q: &mut q,
            chosen: &mut chosen,
        },
        &Params {
            rows: 1,
            k: l.k,
            rank: l.rank,
            vocab: l.vocab,
        },
    )
    .expect("the selector walk");
    Walk {
        proposals: be.download(&proposals).expect("p"),
        q: be.download(&q).expect("q"),
        chosen: be.download(&chosen).expect("c"),
    }
}

fn chain<'a>(l: &'a Lattice, w: &'a Walk, anchor: u32) -> Chain<'a> {
    Chain {
        anchor,
        proposals: &w.proposals,
        chosen: &w.chosen,
        q: &w.q,
        cand_ids: &l.cand,
    }
}

fn opts(nodes: usize, temperature: f32, seed: u64, frontier: u64) -> TreeOptions {
    TreeOptions {
        nodes,
        temperature,
        seed,
        frontier,
    }
}

/// Select, then build (returns both).
fn grow(l: &Lattice, anchor: u32, o: &TreeOptions) -> (Walk, DraftTree) {
    let w = select(l, anchor, o.temperature, o.seed, o.frontier);
    let t = tree::build(&chain(l, &w, anchor), &mut l.host(), o).expect("a tree");
    (w, t)
}

/// Ranks by descending score, exact ties by lower rank (written independently of the
/// builder: repeated selection of the first maximum).
fn descending(e: &[f32; TOP_K]) -> Vec<usize> {
    let mut left: Vec<usize> = (0..TOP_K).collect();
    let mut out = Vec::new();
    while !left.is_empty() {
        let mut b = 0;
        for i in 1..left.len() {
            if e[left[i]] > e[left[b]] {
                b = i;
            }
        }
        out.push(left.remove(b));
    }
    out
}

/// Structural invariants of every tree (K the chain's length, `w` its walk).
fn check_invariants(t: &DraftTree, l: &Lattice, w: &Walk, temperature: f32) {
    let n = t.nodes();
    let k = l.k;
    assert!(n > k && n <= 32, "node count {n}");
    assert_eq!(t.parents.len(), n - 1);
    for v in [
        t.depth.len(),
        t.sibling.len(),
        t.ancestors.len(),
        t.rank.len(),
    ] {
        assert_eq!(v, n);
    }
    assert_eq!((t.child_ids.len(), t.child_q.len()), (n, n));
    assert_eq!(
        (t.depth[0], t.ancestors[0], t.rank[0], t.sibling[0]),
        (0, 1, 0, 0)
    );
    let mut lattice = l.host();
    for i in 1..n {
        let p = t.parents[i - 1] as usize;
        assert!(p < i, "parent of {i} is {p}");
        assert_eq!(t.depth[i], t.depth[p] + 1);
        assert!(t.depth[i] as usize <= k);
        assert_eq!(t.ancestors[i], t.ancestors[p] | 1 << i);
        assert_eq!(
            t.tokens[i] as i32, t.child_ids[p][t.rank[i] as usize],
            "node {i}'s token is its parent's candidate of its rank"
        );
        if i <= k {
            assert_eq!(p, i - 1, "the spine");
            assert_eq!(t.tokens[i] as i32, w.proposals[i - 1]);
        }
        if temperature > 0.0 && i > k {
            assert!(
                t.child_q[p][t.rank[i] as usize] > 0.0,
                "a drawn child has mass"
            );
        }
    }
    for m in 0..n {
        let kids: Vec<usize> = t.children(m).collect();
        let sib: Vec<u8> = kids.iter().map(|&c| t.sibling[c]).collect();
        assert_eq!(sib, (0..kids.len() as u8).collect::<Vec<_>>(), "node {m}");
        let mut toks: Vec<u32> = kids.iter().map(|&c| t.tokens[c]).collect();
        toks.sort_unstable();
        toks.dedup();
        assert_eq!(toks.len(), kids.len(), "sibling tokens distinct under {m}");
        let d = t.depth[m] as usize;
        if d == k {
            assert_eq!(t.child_ids[m], [0; TOP_K]);
            assert_eq!(t.child_q[m], [0.0; TOP_K]);
            continue;
        }
        assert_eq!(t.child_ids[m][..], l.cand[d * TOP_K..][..TOP_K]);
        if m < k {
            let q = &w.q[m * TOP_K..][..TOP_K];
            assert_eq!(
                t.child_q[m].map(f32::to_bits)[..],
                q.iter().map(|x| x.to_bits()).collect::<Vec<_>>()[..]
            );
        } else {
            let e = lattice.row(d, t.tokens[m]).expect("row");
            let want = candidate_selector::step_q(&e, temperature);
            assert_eq!(t.child_q[m].map(f32::to_bits), want.map(f32::to_bits));
        }
    }
    // The last node is always a leaf (no row in the accept layout).
    assert_eq!(t.children(n - 1).count(), 0);
}

/// Whether every q that can have children has all 16 entries nonzero (then nothing drops).
fn full_support(t: &DraftTree, k: usize) -> bool {
    (0..t.nodes())
        .filter(|&m| (t.depth[m] as usize) < k)
        .all(|m| t.child_q[m].iter().all(|&x| x > 0.0))
}

#[test]
fn tree_spine_is_the_selector_chain_bit_for_bit() {
    for (case, &t) in [0.0f32, 0.7, 1.3, -1.0, 0.05].iter().enumerate() {
        for s in 0..6u64 {
            let l = Lattice::random(7, 24, 300, 0.08, 100 + s);
            let anchor = (s * 37 % 300) as u32;
            let o = opts(32, t, 1000 * case as u64 + s, 50 + s);
            let (w, tr) = grow(&l, anchor, &o);
            let k = l.k;
            assert_eq!(tr.tokens[0], anchor);
            for i in 0..k {
                assert_eq!(tr.tokens[i + 1] as i32, w.proposals[i], "T {t} seed {s}");
                assert_eq!(i32::from(tr.rank[i + 1]), w.chosen[i]);
                let q: Vec<u32> = w.q[i * TOP_K..][..TOP_K]
                    .iter()
                    .map(|x| x.to_bits())
                    .collect();
                assert_eq!(tr.child_q[i].map(f32::to_bits)[..], q[..]);
                // The builder's formula on the host lattice's row reproduces the op's q.
                let e = l.host().row(i, tr.tokens[i]).expect("row");
                assert_eq!(
                    candidate_selector::step_q(&e, t).map(f32::to_bits)[..],
                    q[..]
                );
            }
            check_invariants(&tr, &l, &w, t);
            if t <= 0.0 {
                // The CPU greedy chain is the proxy spine: the whole tree is the proxy tree.
                let sh = tree::shape(anchor, &l.cand, 32, t, &mut l.host()).expect("shape");
                assert_eq!(tr.tokens, sh.proxy);
                assert_eq!(tr.parents, sh.parents);
            }
        }
    }
}

#[test]
fn tree_accept_layout_of_a_chain_is_the_selector_layout() {
    for t in [0.0f32, 0.9] {
        let l = Lattice::random(5, 16, 200, 0.1, 7);
        let (w, tr) = grow(&l, 3, &opts(6, t, 11, 20));
        let lay = tr.accept_layout();
        assert_eq!(lay.tokens, w.proposals);
        assert_eq!(lay.parents, vec![0, 1, 2, 3, 4]);
        assert_eq!(lay.ids, l.cand);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&lay.q), bits(&w.q));
    }
    // A larger tree: one row per node but the last, indexed by parent node.
    let l = Lattice::random(3, 16, 200, 0.1, 8);
    let (_, tr) = grow(&l, 3, &opts(20, 0.9, 11, 20));
    let lay = tr.accept_layout();
    let n = tr.nodes();
    assert_eq!(
        (lay.ids.len(), lay.q.len()),
        ((n - 1) * TOP_K, (n - 1) * TOP_K)
    );
    assert_eq!(lay.ids[TOP_K * 4..][..TOP_K], tr.child_ids[4]);
}

#[test]
fn tree_structure_invariants_hold_on_random_lattices() {
    let mut mix = Mix(5);
    let mut full = 0;
    for s in 0..120u64 {
        let k = 1 + mix.below(8);
        let most = if k == 1 { 17 } else { 32 };
        let nodes = k + 1 + mix.below(most - k);
        let t = [0.0f32, 0.5, 1.0, 2.0, -0.5, 0.02][s as usize % 6];
        let l = Lattice::random(k, 8 + mix.below(40), 64 + mix.below(200), 0.2, 900 + s);
        let anchor = mix.below(l.vocab) as u32;
        let (w, tr) = grow(&l, anchor, &opts(nodes, t, mix.next(), mix.next() >> 34));
        check_invariants(&tr, &l, &w, t);
        if t <= 0.0 || full_support(&tr, k) {
            assert_eq!(tr.nodes(), nodes, "N nodes when the support allows (T {t})");
            full += 1;
        }
    }
    assert!(full > 80, "most cases have full support ({full})");
}

#[test]
fn tree_shape_is_independent_of_the_seed() {
    let l = Lattice::random(6, 32, 400, 0.1, 42);
    let anchor = 17;
    let t = 0.8;
    let sh = tree::shape(anchor, &l.cand, 32, t, &mut l.host()).expect("shape");
    let mut side_tokens = std::collections::BTreeSet::new();
    let mut chains = std::collections::BTreeSet::new();
    for seed in 0..200u64 {
        let (w, tr) = grow(&l, anchor, &opts(32, t, seed * 7919 + 1, 1000 + seed));
        assert!(full_support(&tr, l.k));
        assert_eq!(tr.parents, sh.parents, "seed {seed}");
        assert_eq!(tr.depth, sh.depth);
        assert_eq!(tr.sibling, sh.sibling);
        check_invariants(&tr, &l, &w, t);
        side_tokens.insert(tr.tokens[l.k + 1..].to_vec());
        chains.insert(w.proposals.clone());
    }
    // Only the tokens differ: the chain itself and the side draws vary with the seed.
    assert!(chains.len() > 20, "{} distinct chains", chains.len());
    assert!(
        side_tokens.len() > 20,
        "{} distinct side sets",
        side_tokens.len()
    );
}

#[test]
fn tree_small_support_drops_children() {
    // Two ranks carry all the mass at T = 1 (exp(-1000) is 0 in F32): a node has at most two
    // children, so K = 2 holds 1 + 2 + 4 nodes whatever N asks; the planned shape keeps N.
    let mut u = [-1000.0f32; TOP_K];
    (u[0], u[1]) = (0.0, -0.5);
    let l = Lattice::unary_only(&[u, u]);
    let sh = tree::shape(5, &l.cand, 10, 1.0, &mut l.host()).expect("shape");
    assert_eq!(sh.parents.len(), 9);
    for seed in 0..50 {
        let (w, tr) = grow(&l, 5, &opts(10, 1.0, seed, 3));
        check_invariants(&tr, &l, &w, 1.0);
        assert_eq!(tr.nodes(), 7, "seed {seed}");
        for m in 0..tr.nodes() {
            assert!(tr.children(m).count() <= 2);
            assert_eq!(tr.child_q[m][2..], [0.0; TOP_K - 2]);
        }
        assert_eq!(tr.depth, vec![0, 1, 2, 1, 2, 2, 2]);
    }
    // Greedy never drops: children follow E whatever q says.
    let (w, tr) = grow(&l, 5, &opts(10, 0.0, 1, 3));
    check_invariants(&tr, &l, &w, 0.0);
    assert_eq!(tr.nodes(), 10);
}

#[test]
fn tree_greedy_side_children_follow_descending_scores() {
    for s in 0..10u64 {
        let l = Lattice::random(4, 32, 500, 0.05, 300 + s);
        let anchor = 9 + s as u32;
        let (w, tr) = grow(&l, anchor, &opts(32, 0.0, s, 40));
        check_invariants(&tr, &l, &w, 0.0);
        let mut lat = l.host();
        for m in 0..tr.nodes() {
            let d = tr.depth[m] as usize;
            if d == l.k {
                continue;
            }
            let e = lat.row(d, tr.tokens[m]).expect("row");
            let want = descending(&e);
            let got: Vec<usize> = tr.children(m).map(|c| tr.rank[c] as usize).collect();
            assert_eq!(got[..], want[..got.len()], "node {m}");
            let mut one_hot = [0f32; TOP_K];
            one_hot[want[0]] = 1.0;
            assert_eq!(tr.child_q[m], one_hot);
        }
        // Deterministic: neither the seed nor the frontier matters at T = 0.
        let (_, again) = grow(&l, anchor, &opts(32, 0.0, s + 99, 7));
        assert_eq!(again, tr);
    }
}

/// `P(second = c) = sum_{b != c} q_b q_c / (1 - q_b)` in f64.
fn second_draw_law(q: &[f32; TOP_K]) -> [f64; TOP_K] {
    let q = q.map(f64::from);
    std::array::from_fn(|c| {
        (0..TOP_K)
            .filter(|&b| b != c)
            .map(|b| q[b] * q[c] / (1.0 - q[b]))
            .sum()
    })
}

fn chi_square(counts: &[u64; TOP_K], law: &[f64; TOP_K], n: u64) -> f64 {
    (0..TOP_K)
        .map(|c| {
            let e = law[c] * n as f64;
            (counts[c] as f64 - e).powi(2) / e
        })
        .sum()
}

/// Chi-square threshold for 15 degrees of freedom: P(chi2 > 60) = 2.5e-7, the probability
/// that a correct builder fails on a random seed set (the seed sets here are fixed; they
/// score 15.4 and 25.6). A with-replacement draw (second ~ q, the drawn ranks left in the
/// pool, sibling checks removed) scored 190 and 328: checked by breaking the builder.
const CHI2_15_LIMIT: f64 = 60.0;

#[test]
fn tree_second_draw_is_without_replacement() {
    // A side node: K = 2, E = unary for every predecessor, column 0 splits its mass between
    // ranks 0 and 1, so the root's second child (a side node at depth 1) always exists; its
    // children are drawn from q = softmax(-0.25 c) over 16 ranks, independent of its token.
    // 20000 seeds (fixed); the node's draw number 1 against the without-replacement law.
    let mut u0 = [-40.0f32; TOP_K];
    (u0[0], u0[1]) = (0.0, 0.0);
    let u1: [f32; TOP_K] = std::array::from_fn(|c| -0.25 * c as f32);
    let l = Lattice::unary_only(&[u0, u1]);
    let q = candidate_selector::step_q(&u1, 1.0);
    let law = second_draw_law(&q);
    let n = 20_000u64;
    let mut counts = [0u64; TOP_K];
    for seed in 0..n {
        let (_, tr) = grow(&l, 1, &opts(7, 1.0, seed, 100));
        assert_eq!(tr.parents, vec![0, 1, 0, 3, 1, 3]);
        assert_eq!(tr.child_q[3], q);
        assert_ne!(tr.tokens[4], tr.tokens[6]);
        counts[tr.rank[6] as usize] += 1;
    }
    let chi2 = chi_square(&counts, &law, n);
    assert!(chi2 < CHI2_15_LIMIT, "chi2 {chi2}, counts {counts:?}");
}

#[test]
fn tree_second_draw_after_the_chain_is_without_replacement() {
    // The root of a K = 1 tree: its first child is the selector's own draw, its second a
    // TreeChild draw without the chain's rank. Over 20000 fixed seeds the second child's
    // marginal follows the without-replacement law.
    let u: [f32; TOP_K] = std::array::from_fn(|c| -0.3 * c as f32 + 0.01 * (c % 3) as f32);
    let l = Lattice::unary_only(&[u]);
    let q = candidate_selector::step_q(&u, 1.0);
    let law = second_draw_law(&q);
    let n = 20_000u64;
    let mut counts = [0u64; TOP_K];
    for seed in 0..n {
        let (w, tr) = grow(&l, 2, &opts(3, 1.0, seed ^ 0x5eed, 77));
        assert_eq!(tr.child_q[0][..], w.q[..]);
        assert_ne!(tr.rank[2], tr.rank[1]);
        counts[tr.rank[2] as usize] += 1;
    }
    let chi2 = chi_square(&counts, &law, n);
    assert!(chi2 < CHI2_15_LIMIT, "chi2 {chi2}, counts {counts:?}");
}

#[test]
fn tree_best_first_shape_by_hand() {
    // E = unary (any predecessor). Ts = 1 at T = 0, so the child log-probabilities are
    // ln of: column 0 [.5, .4, .1/14 ..], column 1 [.8, .15, .05/14 ..].
    let col = |a: f32, b: f32, rest: f32| {
        let mut u = [(rest / 14.0).ln(); TOP_K];
        (u[0], u[1]) = (a.ln(), b.ln());
        u
    };
    let l = Lattice::unary_only(&[col(0.5, 0.4, 0.1), col(0.8, 0.15, 0.05)]);
    // Spine 0-1-2. Open: root#1 ln.4 = -0.92, node1#1 ln.5+ln.15 = -2.59 -> node 3 = root#1.
    // Open: root#2 -4.94, node3#0 ln.4+ln.8 = -1.14, node1#1 -> node 4 = node3#0.
    // Open: root#2, node1#1 -2.59, node3#1 ln.4+ln.15 = -2.81 -> node 5 = node1#1.
    let sh = tree::shape(7, &l.cand, 6, 0.0, &mut l.host()).expect("shape");
    assert_eq!(sh.parents, vec![0, 1, 0, 3, 1]);
    assert_eq!(sh.sibling, vec![0, 0, 0, 1, 0, 1]);
    assert_eq!(sh.depth, vec![0, 1, 2, 1, 2, 2]);
    let (_, tr) = grow(&l, 7, &opts(6, 0.0, 1, 1));
    assert_eq!(tr.parents, sh.parents);
    assert_eq!(tr.tokens, vec![7, 0, 100, 1, 100, 101]);
    assert_eq!(tr.rank, vec![0, 0, 0, 1, 0, 1]);
    // The budget's next node: root#2 -4.94 < node3#1 -2.81.
    let sh7 = tree::shape(7, &l.cand, 7, 0.0, &mut l.host()).expect("shape");
    assert_eq!(sh7.parents, vec![0, 1, 0, 3, 1, 3]);

    // Exact ties go to the lower parent: column 0 [.5, .5, ~0], so node1#1 and node3#1
    // score exactly alike.
    let mut u0 = [-30.0f32; TOP_K];
    (u0[0], u0[1]) = (0.0, 0.0);
    let mut u1 = [-30.0f32; TOP_K];
    (u1[0], u1[1]) = (0.0, -1.0);
    let l = Lattice::unary_only(&[u0, u1]);
    let sh = tree::shape(7, &l.cand, 7, 0.0, &mut l.host()).expect("shape");
    assert_eq!(sh.parents, vec![0, 1, 0, 3, 1, 3]);
    // T scales the scores (Ts = T), not the ranking within a node; here the same shape.
    let sh = tree::shape(7, &l.cand, 7, 2.0, &mut l.host()).expect("shape");
    assert_eq!(sh.parents, vec![0, 1, 0, 3, 1, 3]);
}

/// An edge-score source that returns one fixed row, NaN at rank 3 for column 1.
struct Poisoned;

impl EdgeScores for Poisoned {
    fn row(&mut self, column: usize, _pred: u32) -> dflash_draft::Result<[f32; TOP_K]> {
        let mut e = std::array::from_fn(|c| -(c as f32));
        if column == 1 {
            e[3] = f32::NAN;
        }
        Ok(e)
    }
}

fn refused(r: dflash_draft::Result<DraftTree>) -> String {
    match r {
        Err(e @ DraftError::Invalid { .. }) => e.to_string(),
        Err(e) => panic!("unexpected error kind: {e}"),
        Ok(_) => panic!("accepted"),
    }
}

#[test]
fn tree_refuses_bad_inputs_naming_the_field() {
    let l = Lattice::random(3, 8, 100, 0.1, 1);
    let w = select(&l, 4, 0.5, 1, 1);
    let good = chain(&l, &w, 4);
    let o = opts(10, 0.5, 1, 1);
    assert!(tree::build(&good, &mut l.host(), &o).is_ok());
    let err = |c: &Chain<'_>, o: &TreeOptions| refused(tree::build(c, &mut l.host(), o));

    assert!(err(&good, &opts(3, 0.5, 1, 1)).contains("`nodes` = 3"));
    assert!(err(&good, &opts(33, 0.5, 1, 1)).contains("`nodes` = 33"));
    assert!(err(&good, &opts(10, f32::NAN, 1, 1)).contains("`temperature`"));
    assert!(err(&good, &opts(10, 0.5, 1, u64::MAX - 2)).contains("`frontier`"));
    let short = Chain {
        chosen: &w.chosen[..2],
        ..good
    };
    assert!(err(&short, &o).contains("`chain.chosen.len()` = 2"));
    let bad_rank = [w.chosen[0], 16, w.chosen[2]];
    let c = Chain {
        chosen: &bad_rank,
        ..good
    };
    assert!(err(&c, &o).contains("`chain.chosen[1]` = 16"));
    let other = [w.chosen[0], (w.chosen[1] + 1) % 16, w.chosen[2]];
    let c = Chain {
        chosen: &other,
        ..good
    };
    assert!(err(&c, &o).contains("`chain.proposals[1]`"));
    let mut q = w.q.clone();
    q[20] = f32::INFINITY;
    let c = Chain { q: &q, ..good };
    assert!(err(&c, &o).contains("`chain.q[1][4]` = inf"));
    let mut ids = l.cand.clone();
    ids[35] = ids[33];
    let c = Chain {
        cand_ids: &ids,
        ..good
    };
    assert!(err(&c, &o).contains("`cand_ids[2][3]`"));
    // K = 1 holds at most 17 nodes.
    let one = Lattice::random(1, 8, 100, 0.1, 2);
    let w1 = select(&one, 4, 0.0, 1, 1);
    let c1 = chain(&one, &w1, 4);
    let e = refused(tree::build(&c1, &mut one.host(), &opts(18, 0.0, 1, 1)));
    assert!(e.contains("`nodes` = 18"), "{e}");
    assert!(tree::build(&c1, &mut one.host(), &opts(17, 0.0, 1, 1)).is_ok());
    // A non-finite edge score from the source.
    let e = refused(tree::build(&good, &mut Poisoned, &o));
    assert!(e.contains("edge_scores[column 1"), "{e}");
    // The host lattice refuses an anchor outside the vocabulary (through the op's check).
    let far = Chain {
        anchor: 100,
        ..good
    };
    let r = tree::build(&far, &mut l.host(), &o);
    assert!(matches!(r, Err(DraftError::Ops(_))), "{r:?}");
    // ... and a lattice whose lengths disagree.
    let e = HostLattice::new(3, 8, &l.g[1..], &l.unary, &l.cand, &l.w_pred, &l.w_succ);
    assert!(
        e.expect_err("short g")
            .to_string()
            .contains("lattice.g.len()")
    );
}

#[test]
fn tree_edge_row_wrapper_checks_its_inputs() {
    let l = Lattice::random(2, 8, 50, 0.1, 3);
    let row = |g: &[bf16], pred: usize, cand: &[i32], unary: &[f32]| {
        candidate_selector::edge_row(g, &l.w_pred, &l.w_succ, pred, cand, unary)
    };
    let (g, cand, unary) = (&l.g[8..16], &l.cand[16..32], &l.unary[16..32]);
    let e = row(g, 49, cand, unary).expect("a valid row");
    assert_eq!(e, l.host().row(1, 49).expect("the lattice's row"));
    assert!(row(g, 50, cand, unary).is_err(), "pred past vocab");
    assert!(
        row(&g[1..], 4, cand, unary).is_err(),
        "ragged codebook for R = 7"
    );
    assert!(row(g, 4, &cand[1..], unary).is_err(), "15 candidates");
    assert!(row(g, 4, cand, &unary[1..]).is_err(), "15 unary scores");
    let mut bad = cand.to_vec();
    bad[7] = 50;
    assert!(row(g, 4, &bad, unary).is_err(), "candidate past vocab");
    assert!(row(&[], 4, cand, unary).is_err(), "R = 0");
}
