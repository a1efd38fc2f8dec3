//! Seeded, deterministic statistical test: tree verification (`tree_accept`) reproduces the
//! target's distribution at T > 0, and the same statistics reject wrong ways of building the
//! tree it is given.
//!
//! Model. Vocabulary V = 24. The target is Markov: `p0` at the anchor, `p(. | x)` after token
//! `x`; the draft proposes from 16 slot ids per context with its own `q0`, `q(. | x)`, far from
//! the target's. Tree shape (fixed, so the number of children of a node never depends on what
//! was drawn): root children nodes 1, 3, 6 (three draws without replacement from q0), node 1's
//! children 2, 4, node 3's child 5; depth-2 nodes are leaves. Each trial is one row with its
//! own seed; children are drawn test-side with the rng's TreeChild uniforms (inverse CDF over
//! the renormalized remaining q, as the tree builder does). `y1` is the first output; `y2` the
//! second when the walk emitted two tokens, else a draw from `p(. | y1)` (the next round's
//! bonus with `P = 0`). Target law: `p0(y1) p(y2 | y1)`.
//!
//! Statistic: Pearson chi-square over cells with expected count >= 10 (the rest pooled), any
//! draw in a cell of probability 0 fails at once; threshold: the chi-square quantile at
//! false-failure probability 1e-6 (Wilson-Hilferty, z = 4.7534). Wrong trees that must be
//! rejected: a child after the first kept only when its own q is large (its existence then
//! depends on which token it is, the trap of a best-first over each child's own score), and
//! the deterministic top-3 of q presented as if sampled. Children drawn with replacement with
//! repeats dropped pass (the existence of the k-th distinct child does not depend on its
//! identity); with repeats kept the op refuses the tree (siblings must differ).

use dflash_ops::rng::{Purpose, uniform};
use dflash_ops::tree_accept::{self, Distributions, Outputs, Params, Trees};
use dflash_ops::{Backend, Buffer};

const V: usize = 24;
const TOP: usize = 16;
const N: usize = 40_000;
const F: u64 = 500;
const COLS: usize = 7;
/// Parent of node i at i - 1.
const PARENTS: [usize; COLS - 1] = [0, 1, 0, 1, 3, 0];

/// A normalized distribution from positive weights (f64, stored f32).
fn norm(w: &[f64]) -> Vec<f32> {
    let t: f64 = w.iter().sum();
    w.iter().map(|x| (x / t) as f32).collect()
}

/// The target after context token `x` (`None`: the anchor).
fn target(x: Option<usize>) -> Vec<f32> {
    let s = x.map_or(3, |x| x + 5);
    norm(
        &(0..V)
            .map(|v| {
                let h = (v * 7 + s * 13) % 17;
                if h < 5 { 0.0 } else { 0.2 + (h as f64) * 0.3 }
            })
            .collect::<Vec<_>>(),
    )
}

/// The draft's slots after context `x`: 16 ids and their q (zeros allowed, q != target).
fn draft(x: Option<usize>) -> (Vec<i32>, Vec<f32>) {
    let s = x.map_or(1, |x| x + 2);
    let ids: Vec<i32> = (0..TOP).map(|j| ((j * 5 + s * 3) % V) as i32).collect();
    let mut w: Vec<f64> = (0..TOP)
        .map(|j| 0.1 + ((j * 11 + s * 7) % 13) as f64 * 0.25)
        .collect();
    w[(s * 3) % TOP] += 20.0;
    (ids, norm(&w))
}

/// How a node's children are produced.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Children {
    /// Draws without replacement (the contract).
    WithoutReplacement,
    /// Draws with replacement, repeats dropped: also lossless (whether a k-th distinct child
    /// exists is independent of which token it is, given the earlier ones).
    WithReplacementDeduped,
    /// Draws without replacement, but a child after the first is kept only when its own q is
    /// large (wrong: whether it exists depends on which token it is, as a best-first by each
    /// child's own score would).
    OwnScoreGated,
    /// The top-m slots of q in order, treated as draws (wrong: not a sample).
    TopOfQ,
}

/// Draw `m` children of a node at `depth` below context `x` from the slots; returns slot
/// indices in draw order.
fn children(seed: u64, depth: u64, q: &[f32], m: usize, how: Children) -> Vec<usize> {
    let mut out: Vec<usize> = Vec::new();
    for j in 0..m {
        let u = f64::from(uniform(seed, F + 1 + depth, Purpose::TreeChild, j as u32));
        match how {
            Children::TopOfQ => {
                let mut order: Vec<usize> = (0..TOP).collect();
                order.sort_by(|&a, &b| q[b].total_cmp(&q[a]).then(a.cmp(&b)));
                return order[..m].to_vec();
            }
            Children::WithoutReplacement
            | Children::WithReplacementDeduped
            | Children::OwnScoreGated => {
                let free: Vec<usize> = (0..TOP)
                    .filter(|s| how == Children::WithReplacementDeduped || !out.contains(s))
                    .collect();
                let mass: f64 = free.iter().map(|&s| f64::from(q[s])).sum();
                let t = u * mass;
                let mut c = 0.0;
                let mut pick = *free.last().expect("slots");
                for &s in &free {
                    c += f64::from(q[s]);
                    if c > t && q[s] > 0.0 {
                        pick = s;
                        break;
                    }
                }
                if how == Children::OwnScoreGated && j > 0 && q[pick] < 0.05 {
                    return out;
                }
                if !out.contains(&pick) {
                    out.push(pick);
                }
            }
        }
    }
    out
}

/// The rows of one experiment: p, nodes, tokens, parents, q, ids, seeds, start_pos.
struct Rows {
    p: Vec<f32>,
    nodes: Vec<i32>,
    tokens: Vec<i32>,
    parents: Vec<i32>,
    q: Vec<f32>,
    ids: Vec<i32>,
    seeds: Vec<i32>,
    start_pos: Vec<i32>,
}

fn seed_of(trial: usize, salt: u64) -> u64 {
    (trial as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ salt
}

/// Build each trial's tree (the shape of `PARENTS`, trimmed where a draw variant yields fewer
/// children) and its node distributions.
fn build(how: Children, salt: u64) -> Rows {
    let k = COLS - 1;
    let mut r = Rows {
        p: vec![0.0; N * COLS * V],
        nodes: vec![0; N],
        tokens: vec![0; N * k],
        parents: vec![0; N * k],
        q: vec![0.0; N * k * TOP],
        ids: vec![0; N * k * TOP],
        seeds: vec![0; 2 * N],
        start_pos: vec![F as i32; N],
    };
    for t in 0..N {
        let seed = seed_of(t, salt);
        r.seeds[2 * t] = seed as u32 as i32;
        r.seeds[2 * t + 1] = (seed >> 32) as u32 as i32;
        // Actual nodes in index order: their tokens (the root's context is None), parents
        // and depths; `map` takes a node of the fixed shape to its actual node (None when a
        // draw variant gave its parent fewer children).
        let mut tok: Vec<Option<usize>> = vec![None];
        let mut par: Vec<usize> = vec![0];
        let mut depth: Vec<u64> = vec![0];
        let mut map: Vec<Option<usize>> = vec![Some(0)];
        let mut drawn: Vec<Option<Vec<usize>>> = vec![None; COLS];
        for i in 1..COLS {
            let ps = PARENTS[i - 1];
            let Some(pa) = map[ps] else {
                map.push(None);
                continue;
            };
            let planned = PARENTS.iter().filter(|&&p| p == ps).count();
            let (ids, q) = draft(tok[pa]);
            let kids = drawn[ps]
                .get_or_insert_with(|| children(seed, depth[pa], &q, planned, how))
                .clone();
            let sibling = PARENTS[..i - 1].iter().filter(|&&p| p == ps).count();
            match kids.get(sibling) {
                Some(&slot) => {
                    tok.push(Some(ids[slot] as usize));
                    par.push(pa);
                    depth.push(depth[pa] + 1);
                    map.push(Some(tok.len() - 1));
                }
                None => map.push(None),
            }
        }
        let n = tok.len();
        r.nodes[t] = n as i32;
        for i in 0..n {
            let p = target(tok[i]);
            r.p[(t * COLS + i) * V..(t * COLS + i + 1) * V].copy_from_slice(&p);
            if i > 0 {
                r.tokens[t * k + i - 1] = tok[i].expect("token") as i32;
                r.parents[t * k + i - 1] = par[i] as i32;
            }
            if i < k {
                let (ids, q) = draft(tok[i]);
                r.ids[(t * k + i) * TOP..(t * k + i + 1) * TOP].copy_from_slice(&ids);
                r.q[(t * k + i) * TOP..(t * k + i + 1) * TOP].copy_from_slice(&q);
            }
        }
    }
    r
}

/// Run the op on `be`; returns each trial's `(y1, y2)`.
fn outcomes(be: &Backend, rows: &Rows, salt: u64) -> Vec<(usize, usize)> {
    let up = |v: &[i32]| be.upload(v).expect("upload");
    let p: Buffer<f32> = be.upload(&rows.p).expect("upload");
    let q: Buffer<f32> = be.upload(&rows.q).expect("upload");
    let mut accepted = be.zeros::<i32>(N).expect("alloc");
    let mut out_tokens = be.zeros::<i32>(N * COLS).expect("alloc");
    let mut out_len = be.zeros::<i32>(N).expect("alloc");
    let mut path = be.zeros::<i32>(N * COLS).expect("alloc");
    tree_accept::run(
        be,
        Distributions::Full(&p),
        &Trees {
            nodes: &up(&rows.nodes),
            tokens: &up(&rows.tokens),
            parents: &up(&rows.parents),
            q: &q,
            ids: &up(&rows.ids),
        },
        &up(&rows.seeds),
        &up(&rows.start_pos),
        Outputs {
            accepted: &mut accepted,
            out_tokens: &mut out_tokens,
            out_len: &mut out_len,
            path: &mut path,
        },
        &Params {
            rows: N,
            cols: COLS,
            vocab: V,
        },
    )
    .expect("tree_accept");
    let t = be.download(&out_tokens).expect("dl");
    let l = be.download(&out_len).expect("dl");
    (0..N)
        .map(|i| {
            let y1 = t[i * COLS] as usize;
            let y2 = if l[i] >= 2 {
                t[i * COLS + 1] as usize
            } else {
                // The next round: P = 0, the bonus from p(. | y1).
                let p = target(Some(y1));
                let u = f64::from(uniform(seed_of(i, salt), F + 2, Purpose::Bonus, 0));
                let mut c = 0.0;
                let mut pick = V - 1;
                for (v, &x) in p.iter().enumerate() {
                    c += f64::from(x);
                    if c > u && x > 0.0 {
                        pick = v;
                        break;
                    }
                }
                pick
            };
            (y1, y2)
        })
        .collect()
}

/// Pearson chi-square of counts against probabilities (cells with expected < 10 pooled), its
/// 1e-6 critical value, and whether a draw fell into a probability-0 cell.
fn chi_square(counts: &[u64], probs: &[f64]) -> (f64, f64, bool) {
    let n: u64 = counts.iter().sum();
    let (mut stat, mut cells) = (0.0, 0usize);
    let (mut pool_o, mut pool_e) = (0.0, 0.0);
    let mut impossible = false;
    for (&o, &p) in counts.iter().zip(probs) {
        let e = p * n as f64;
        if p == 0.0 {
            impossible |= o > 0;
            continue;
        }
        if e >= 10.0 {
            stat += (o as f64 - e).powi(2) / e;
            cells += 1;
        } else {
            pool_o += o as f64;
            pool_e += e;
        }
    }
    if pool_e > 0.0 {
        stat += (pool_o - pool_e).powi(2) / pool_e;
        cells += 1;
    }
    let df = (cells - 1) as f64;
    let z = 4.7534;
    let a = 2.0 / (9.0 * df);
    let crit = df * (1.0 - a + z * a.sqrt()).powi(3);
    (stat, crit, impossible)
}

/// The y1 and joint statistics of one variant on `be`: `(stat1, crit1, stat2, crit2,
/// impossible)`.
fn statistics_on(be: &Backend, how: Children, salt: u64) -> (f64, f64, f64, f64, bool) {
    let rows = build(how, salt);
    let out = outcomes(be, &rows, salt);
    let p0 = target(None);
    let mut c1 = vec![0u64; V];
    let mut c2 = vec![0u64; V * V];
    for &(y1, y2) in &out {
        c1[y1] += 1;
        c2[y1 * V + y2] += 1;
    }
    let e1: Vec<f64> = p0.iter().map(|&x| f64::from(x)).collect();
    let e2: Vec<f64> = (0..V * V)
        .map(|c| f64::from(p0[c / V]) * f64::from(target(Some(c / V))[c % V]))
        .collect();
    let (s1, k1, i1) = chi_square(&c1, &e1);
    let (s2, k2, i2) = chi_square(&c2, &e2);
    (s1, k1, s2, k2, i1 || i2)
}

/// [`statistics_on`] the CPU reference.
fn statistics(how: Children, salt: u64) -> (f64, f64, f64, f64, bool) {
    statistics_on(&Backend::Cpu, how, salt)
}

/// The same statistics from the CUDA op (a build with the `cuda` feature on a machine with a
/// device; skipped otherwise): the correct trees pass, a wrong one fails, and every row's
/// outcome equals the CPU reference's.
#[cfg(feature = "cuda")]
#[test]
fn tree_acceptance_on_cuda_reproduces_the_target_distribution() {
    let cuda = match dflash_ops::cuda::CudaBackend::new(0) {
        Ok(c) => Backend::Cuda(c),
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            return;
        }
    };
    let rows = build(Children::WithoutReplacement, 0x1234);
    assert_eq!(
        outcomes(&cuda, &rows, 0x1234),
        outcomes(&Backend::Cpu, &rows, 0x1234),
        "CUDA and CPU decide alike"
    );
    let (s1, k1, s2, k2, impossible) = statistics_on(&cuda, Children::WithoutReplacement, 0x1234);
    eprintln!("cuda: y1 {s1:.1} < {k1:.1}, joint {s2:.1} < {k2:.1}");
    assert!(
        !impossible && s1 < k1 && s2 < k2,
        "y1 {s1:.1}/{k1:.1} joint {s2:.1}/{k2:.1}"
    );
    let (s1, k1, s2, k2, impossible) = statistics_on(&cuda, Children::TopOfQ, 0x1234);
    eprintln!("cuda, top of q: y1 {s1:.1} vs {k1:.1}, joint {s2:.1} vs {k2:.1}");
    assert!(
        impossible || s1 >= k1 || s2 >= k2,
        "a wrong tree passed on CUDA"
    );
}

#[test]
fn tree_acceptance_reproduces_the_target_distribution() {
    let (s1, k1, s2, k2, impossible) = statistics(Children::WithoutReplacement, 0x1234);
    assert!(!impossible, "a token of target probability 0 was emitted");
    assert!(s1 < k1, "y1: chi-square {s1:.1} >= {k1:.1}");
    assert!(s2 < k2, "(y1, y2): chi-square {s2:.1} >= {k2:.1}");
}

#[test]
fn tree_acceptance_is_lossless_for_children_drawn_with_replacement_repeats_dropped() {
    let (s1, k1, s2, k2, impossible) = statistics(Children::WithReplacementDeduped, 0x5678);
    assert!(!impossible, "a token of target probability 0 was emitted");
    assert!(s1 < k1, "y1: chi-square {s1:.1} >= {k1:.1}");
    assert!(s2 < k2, "(y1, y2): chi-square {s2:.1} >= {k2:.1}");
}

#[test]
fn tree_acceptance_statistics_reject_children_kept_by_their_own_score() {
    let (s1, k1, s2, k2, impossible) = statistics(Children::OwnScoreGated, 0x1234);
    assert!(
        impossible || s1 >= k1 || s2 >= k2,
        "a wrong tree passed: y1 {s1:.1} < {k1:.1}, joint {s2:.1} < {k2:.1}"
    );
}

#[test]
fn tree_acceptance_statistics_reject_deterministic_children_posing_as_draws() {
    let (s1, k1, s2, k2, impossible) = statistics(Children::TopOfQ, 0x1234);
    assert!(
        impossible || s1 >= k1 || s2 >= k2,
        "a wrong tree passed: y1 {s1:.1} < {k1:.1}, joint {s2:.1} < {k2:.1}"
    );
}
