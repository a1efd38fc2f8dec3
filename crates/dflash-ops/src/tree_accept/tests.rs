//! Unit tests of `tree_accept` on the CPU backend: hand-computed walks whose decisions do not
//! depend on the uniforms, chain equivalence with `chain_accept`, the chain never accepting
//! more than the tree on the same seed, the greedy rule, validation, and the write footprint.
//! (Statistical losslessness: `tests/tree_acceptance.rs`; CUDA: the conformance cases.)

use proptest::prelude::*;

use super::*;
use crate::chain_accept::{self, Proposal};
use crate::{Element, OpsError};

const CPU: Backend = Backend::Cpu;

/// Host inputs of a call.
#[derive(Clone, Debug)]
struct Call {
    rows: usize,
    cols: usize,
    vocab: usize,
    d: CaseData,
    greedy: Option<Vec<i32>>,
}

/// Host outputs: accepted, out_tokens, out_len, path.
type Out = (Vec<i32>, Vec<i32>, Vec<i32>, Vec<i32>);

fn run_call(c: &Call) -> Result<Out> {
    let Call {
        rows, cols, vocab, ..
    } = *c;
    let up = |v: &[i32]| CPU.upload(v).expect("upload");
    let p = CPU.upload(&c.d.p)?;
    let greedy = c.greedy.as_deref().map(up);
    let (nodes, tokens, parents) = (up(&c.d.nodes), up(&c.d.tokens), up(&c.d.parents));
    let (q, ids) = (CPU.upload(&c.d.q)?, up(&c.d.ids));
    let (seeds, start_pos) = (up(&c.d.seeds), up(&c.d.start_pos));
    let mut accepted = CPU.filled(rows, i32::POISON)?;
    let mut out_tokens = CPU.filled(rows * cols, i32::POISON)?;
    let mut out_len = CPU.filled(rows, i32::POISON)?;
    let mut path = CPU.filled(rows * cols, i32::POISON)?;
    let target = match &greedy {
        None => Distributions::Full(&p),
        Some(g) => Distributions::Live { p: &p, greedy: g },
    };
    run(
        &CPU,
        target,
        &Trees {
            nodes: &nodes,
            tokens: &tokens,
            parents: &parents,
            q: &q,
            ids: &ids,
        },
        &seeds,
        &start_pos,
        Outputs {
            accepted: &mut accepted,
            out_tokens: &mut out_tokens,
            out_len: &mut out_len,
            path: &mut path,
        },
        &Params { rows, cols, vocab },
    )?;
    Ok((
        CPU.download(&accepted)?,
        CPU.download(&out_tokens)?,
        CPU.download(&out_len)?,
        CPU.download(&path)?,
    ))
}

/// A one-row call over `vocab = 32` with node distributions `p[i]` (sparse `(id, mass)`),
/// parents, tokens, and the slots of each parent: ids 0..16 and `q` given sparsely.
fn one_row(p: &[&[(usize, f32)]], parents: &[i32], tokens: &[i32], q: &[&[(usize, f32)]]) -> Call {
    const V: usize = 32;
    let cols = p.len();
    let k = cols - 1;
    let mut d = CaseData {
        p: vec![0.0; cols * V],
        nodes: vec![cols as i32],
        tokens: tokens.to_vec(),
        parents: parents.to_vec(),
        q: vec![0.0; k * TOP],
        ids: (0..k).flat_map(|_| 0..TOP as i32).collect(),
        seeds: vec![7, 0],
        start_pos: vec![100],
    };
    for (i, col) in p.iter().enumerate() {
        for &(v, m) in *col {
            d.p[i * V + v] = m;
        }
    }
    for (n, slots) in q.iter().enumerate() {
        for &(s, m) in *slots {
            d.q[n * TOP + s] = m;
        }
    }
    Call {
        rows: 1,
        cols,
        vocab: V,
        d,
        greedy: None,
    }
}

#[test]
fn a_child_the_first_residual_exhausted_is_rejected_and_the_correction_is_the_rest() {
    // Root p = {1: 0.5, 20: 0.5} (20 is outside the slots 0..16); q = {2: 0.5, 1: 0.5}.
    // Child 1 (token 2, p = 0) always fails; the residual max(p - q, 0) is 0 at token 1
    // (q(1) = p(1)) and 0.5 at 20, so child 2 (token 1) always fails too (a rule that tested
    // it against p instead of the residual would accept it half of the time), and the
    // correction is 20, the only positive weight.
    for seed in 0..64 {
        let mut c = one_row(
            &[&[(1, 0.5), (20, 0.5)], &[(3, 1.0)], &[(3, 1.0)]],
            &[0, 0],
            &[2, 1],
            &[&[(2, 0.5), (1, 0.5)], &[]],
        );
        c.d.seeds = vec![seed, 0];
        let (a, t, l, path) = run_call(&c).expect("run");
        assert_eq!((a[0], l[0]), (0, 1), "seed {seed}");
        assert_eq!(t, vec![20, -1, -1], "seed {seed}");
        assert_eq!(path, vec![0, -1, -1], "seed {seed}");
    }
}

#[test]
fn a_side_child_holding_the_whole_residual_is_accepted() {
    // Root p = {1: 1.0}; q = {5: 0.5, 1: 0.5}; children 5 (p = 0: fails), then 1: residual
    // w(1) = 0.5, Z = 0.5, Q_2(1) = 0.5 / 0.5 = 1, so the test u * 0.5 * 0.5 < 0.5 * 0.5
    // always holds. Node 2 (token 1) is a leaf whose p is one-hot at 9: the bonus.
    for seed in 0..64 {
        let mut c = one_row(
            &[&[(1, 1.0)], &[(3, 1.0)], &[(9, 1.0)]],
            &[0, 0],
            &[5, 1],
            &[&[(5, 0.5), (1, 0.5)], &[]],
        );
        c.d.seeds = vec![seed, 1];
        let (a, t, l, path) = run_call(&c).expect("run");
        assert_eq!((a[0], l[0]), (1, 2), "seed {seed}");
        assert_eq!(t, vec![1, 9, -1], "seed {seed}");
        assert_eq!(path, vec![0, 2, -1], "seed {seed}");
    }
}

#[test]
fn a_greedy_target_follows_the_child_equal_to_its_argmax() {
    // Greedy tree: first child q = 1, side children q = 0 (chosen deterministically). The
    // target's argmax at the root is the third child's token; at that node it is 11, which no
    // child (node 4's only child holds 12) matches: the correction is 11.
    let c = one_row(
        &[
            &[(3, 1.0)],
            &[(7, 1.0)],
            &[(7, 1.0)],
            &[(11, 1.0)],
            &[(7, 1.0)],
        ],
        &[0, 0, 0, 3],
        &[1, 2, 3, 12],
        &[&[(1, 1.0)], &[], &[], &[(12, 1.0)]],
    );
    for live in [false, true] {
        let mut c = c.clone();
        if live {
            c.greedy = Some(vec![3, 7, 7, 11, 7]);
            c.d.p = vec![f32::POISON; c.d.p.len()];
        }
        let (a, t, l, path) = run_call(&c).expect("run");
        assert_eq!((a[0], l[0]), (1, 2), "live {live}");
        assert_eq!(t, vec![3, 11, -1, -1, -1], "live {live}");
        assert_eq!(path, vec![0, 3, -1, -1, -1], "live {live}");
    }
}

/// A chain case of `chain_accept` as a tree: parents `i - 1`.
fn chain_as_tree(c: &chain_accept::CaseData, rows: usize, cols: usize) -> CaseData {
    let k = cols - 1;
    CaseData {
        p: c.p.clone(),
        nodes: c.live.clone(),
        tokens: c.proposals.clone(),
        parents: (0..rows).flat_map(|_| 0..k as i32).collect(),
        q: c.q.clone(),
        ids: c.ids.clone(),
        seeds: c.seeds.clone(),
        start_pos: c.start_pos.clone(),
    }
}

fn chain_run(
    c: &chain_accept::CaseData,
    rows: usize,
    cols: usize,
    vocab: usize,
) -> (Vec<i32>, Vec<i32>, Vec<i32>) {
    let up = |v: &[i32]| CPU.upload(v).expect("upload");
    let p = CPU.upload(&c.p).expect("upload");
    let q = CPU.upload(&c.q).expect("upload");
    let ids = up(&c.ids);
    let mut accepted = CPU.filled(rows, i32::POISON).expect("alloc");
    let mut out_tokens = CPU.filled(rows * cols, i32::POISON).expect("alloc");
    let mut out_len = CPU.filled(rows, i32::POISON).expect("alloc");
    chain_accept::run(
        &CPU,
        &p,
        &up(&c.proposals),
        &up(&c.live),
        Proposal::Top16 { q: &q, ids: &ids },
        &up(&c.seeds),
        &up(&c.start_pos),
        chain_accept::Outputs {
            accepted: &mut accepted,
            out_tokens: &mut out_tokens,
            out_len: &mut out_len,
        },
        &chain_accept::Params { rows, cols, vocab },
    )
    .expect("chain_accept");
    (
        CPU.download(&accepted).expect("dl"),
        CPU.download(&out_tokens).expect("dl"),
        CPU.download(&out_len).expect("dl"),
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// A chain-shaped tree decides bit for bit as `chain_accept` on the same inputs, and its
    /// path is `0, 1, .., A`.
    #[test]
    fn a_chain_shaped_tree_decides_as_chain_accept(
        seed in any::<u64>(),
        rows in 1usize..6,
        cols in 1usize..17,
        vocab in 16usize..300,
    ) {
        let c = chain_accept::case_data(rows, cols, vocab, true, seed);
        let (ca, ct, cl) = chain_run(&c, rows, cols, vocab);
        let call = Call { rows, cols, vocab, d: chain_as_tree(&c, rows, cols), greedy: None };
        let (a, t, l, path) = run_call(&call).expect("tree_accept");
        prop_assert_eq!(&a, &ca);
        prop_assert_eq!(&t, &ct);
        prop_assert_eq!(&l, &cl);
        for r in 0..rows {
            for j in 0..cols {
                let want = if j as i32 <= a[r] { j as i32 } else { -1 };
                prop_assert_eq!(path[r * cols + j], want);
            }
        }
    }

    /// Side nodes never make a row accept less than its chain on the same seed: the first
    /// children's tests are the chain's (same uniforms, `Z = D = 1`).
    #[test]
    fn a_tree_never_accepts_less_than_its_chain(seed in any::<u64>(), rows in 1usize..6) {
        let cols = 24;
        let vocab = 64;
        let d = case_data(rows, cols, vocab, seed, (seed % 5) as usize);
        let k = cols - 1;
        // The chain of each row: node 0's first child, its first child, ...
        let mut chain = chain_accept::CaseData {
            p: vec![0.0; rows * cols * vocab],
            proposals: vec![0; rows * k],
            live: vec![1; rows],
            q: vec![0.0; rows * k * TOP],
            ids: vec![0; rows * k * TOP],
            seeds: d.seeds.clone(),
            start_pos: d.start_pos.clone(),
        };
        for r in 0..rows {
            let n = d.nodes[r] as usize;
            let mut node = 0usize;
            let mut depth = 0usize;
            loop {
                let col = |i: usize| (r * cols + i) * vocab;
                chain.p[col(depth)..col(depth) + vocab]
                    .copy_from_slice(&d.p[col(node)..col(node) + vocab]);
                let Some(first) = (node + 1..n).find(|&i| d.parents[r * k + i - 1] as usize == node)
                else {
                    break;
                };
                let (src, dst) = ((r * k + node) * TOP, (r * k + depth) * TOP);
                chain.q[dst..dst + TOP].copy_from_slice(&d.q[src..src + TOP]);
                chain.ids[dst..dst + TOP].copy_from_slice(&d.ids[src..src + TOP]);
                chain.proposals[r * k + depth] = d.tokens[r * k + first - 1];
                node = first;
                depth += 1;
            }
            chain.live[r] = depth as i32 + 1;
        }
        let (ca, _, _) = chain_run(&chain, rows, cols, vocab);
        let call = Call { rows, cols, vocab, d, greedy: None };
        let (a, _, _, _) = run_call(&call).expect("tree_accept");
        for r in 0..rows {
            prop_assert!(a[r] >= ca[r], "row {}: tree {} < chain {}", r, a[r], ca[r]);
        }
    }

    /// Outputs are consistent with the tree: the path follows parents from 0, the emitted
    /// tokens are the path's tokens, every entry past the footprint is -1, and the `Live`
    /// form decides as the full form.
    #[test]
    fn outputs_follow_the_tree_and_both_forms_agree(seed in any::<u64>(), first in 0usize..5) {
        let (rows, cols, vocab) = (5, 32, 128);
        let d = case_data(rows, cols, vocab, seed, first);
        let full = Call { rows, cols, vocab, d: d.clone(), greedy: None };
        let (a, t, l, path) = run_call(&full).expect("full");
        let (p_live, greedy) = live_distributions(&d, cols, vocab);
        let mut live = full.clone();
        live.d.p = p_live;
        live.greedy = Some(greedy);
        prop_assert_eq!(run_call(&live).expect("live"), (a.clone(), t.clone(), l.clone(), path.clone()));
        let k = cols - 1;
        for r in 0..rows {
            let ar = a[r] as usize;
            prop_assert_eq!(l[r], a[r] + 1);
            prop_assert_eq!(path[r * cols], 0);
            for j in 1..=ar {
                let v = path[r * cols + j] as usize;
                prop_assert!(v < d.nodes[r] as usize);
                prop_assert_eq!(d.parents[r * k + v - 1], path[r * cols + j - 1]);
                prop_assert_eq!(t[r * cols + j - 1], d.tokens[r * k + v - 1]);
            }
            prop_assert!(t[r * cols + ar] >= 0 && (t[r * cols + ar] as usize) < vocab);
            for j in ar + 1..cols {
                prop_assert_eq!(t[r * cols + j], -1);
                prop_assert_eq!(path[r * cols + j], -1);
            }
        }
    }
}

#[test]
fn a_row_decides_the_same_in_any_batch_position() {
    let (rows, cols, vocab) = (6, 32, 96);
    let d = case_data(rows, cols, vocab, 99, 0);
    let (a, t, l, path) = run_call(&Call {
        rows,
        cols,
        vocab,
        d: d.clone(),
        greedy: None,
    })
    .expect("batch");
    for r in 0..rows {
        let k = cols - 1;
        let one = CaseData {
            p: d.p[r * cols * vocab..(r + 1) * cols * vocab].to_vec(),
            nodes: vec![d.nodes[r]],
            tokens: d.tokens[r * k..(r + 1) * k].to_vec(),
            parents: d.parents[r * k..(r + 1) * k].to_vec(),
            q: d.q[r * k * TOP..(r + 1) * k * TOP].to_vec(),
            ids: d.ids[r * k * TOP..(r + 1) * k * TOP].to_vec(),
            seeds: d.seeds[2 * r..2 * r + 2].to_vec(),
            start_pos: vec![d.start_pos[r]],
        };
        let got = run_call(&Call {
            rows: 1,
            cols,
            vocab,
            d: one,
            greedy: None,
        })
        .expect("one");
        assert_eq!(got.0[0], a[r]);
        assert_eq!(got.1, t[r * cols..(r + 1) * cols]);
        assert_eq!(got.2[0], l[r]);
        assert_eq!(got.3, path[r * cols..(r + 1) * cols]);
    }
}

/// Every refused input names its tensor and leaves the outputs untouched.
#[test]
fn bad_trees_are_refused_before_any_write() {
    let base = one_row(
        &[&[(1, 1.0)], &[(3, 1.0)], &[(9, 1.0)]],
        &[0, 0],
        &[5, 1],
        &[&[(5, 0.5), (1, 0.5)], &[]],
    );
    type Edit = Box<dyn Fn(&mut Call)>;
    let cases: Vec<(&str, Edit)> = vec![
        ("nodes", Box::new(|c| c.d.nodes[0] = 4)),
        ("nodes", Box::new(|c| c.d.nodes[0] = 0)),
        ("parents", Box::new(|c| c.d.parents[1] = 2)),
        ("parents", Box::new(|c| c.d.parents[0] = -1)),
        ("tokens", Box::new(|c| c.d.tokens[1] = 32)),
        ("tokens", Box::new(|c| c.d.tokens[1] = 5)), // a repeated sibling
        ("tokens", Box::new(|c| c.d.ids[1] = 30)),   // token 1 no longer a slot id
        ("ids", Box::new(|c| c.d.ids[3] = 2)),
        ("q", Box::new(|c| c.d.q[4] = f32::NAN)),
        ("p", Box::new(|c| c.d.p[32 + 3] = -0.5)),
        ("p", Box::new(|c| c.d.p[64 + 9] = 0.0)),
        ("start_pos", Box::new(|c| c.d.start_pos[0] = -1)),
        ("greedy", Box::new(|c| c.greedy = Some(vec![-2, -1, -1]))),
    ];
    for (tensor, f) in cases {
        let mut c = base.clone();
        f(&mut c);
        match run_call(&c) {
            Err(OpsError::Value { op, tensor: t, .. }) => {
                assert_eq!((op, t), (OP, tensor));
            }
            other => panic!("{tensor}: expected a refusal, got {other:?}"),
        }
    }
    // Lengths: a short path buffer.
    let up = |v: &[i32]| CPU.upload(v).expect("upload");
    let d = &base.d;
    let p = CPU.upload(&d.p).expect("upload");
    let (q, ids) = (CPU.upload(&d.q).expect("upload"), up(&d.ids));
    let (nodes, tokens, parents) = (up(&d.nodes), up(&d.tokens), up(&d.parents));
    let mut accepted = CPU.filled(1, i32::POISON).expect("alloc");
    let mut out_tokens = CPU.filled(3, i32::POISON).expect("alloc");
    let mut out_len = CPU.filled(1, i32::POISON).expect("alloc");
    let mut path = CPU.filled(2, i32::POISON).expect("alloc");
    let err = run(
        &CPU,
        Distributions::Full(&p),
        &Trees {
            nodes: &nodes,
            tokens: &tokens,
            parents: &parents,
            q: &q,
            ids: &ids,
        },
        &up(&d.seeds),
        &up(&d.start_pos),
        Outputs {
            accepted: &mut accepted,
            out_tokens: &mut out_tokens,
            out_len: &mut out_len,
            path: &mut path,
        },
        &Params {
            rows: 1,
            cols: 3,
            vocab: 32,
        },
    )
    .expect_err("short path");
    assert!(
        matches!(err, OpsError::Length { tensor: "path", .. }),
        "{err:?}"
    );
    assert_eq!(CPU.download(&accepted).expect("dl"), vec![i32::POISON]);
    assert_eq!(CPU.download(&out_tokens).expect("dl"), vec![i32::POISON; 3]);
}

#[test]
fn more_than_32_nodes_are_refused() {
    let mut c = one_row(
        &[&[(1, 1.0)], &[(3, 1.0)], &[(9, 1.0)]],
        &[0, 0],
        &[5, 1],
        &[&[(5, 0.5), (1, 0.5)], &[]],
    );
    c.cols = 33;
    assert!(matches!(
        run_call(&c),
        Err(OpsError::Param { param: "cols", .. })
    ));
}

/// Every light case runs on the CPU reference and passes its own comparison (footprint, inputs
/// unchanged, outputs not constant), and its trees do more than a chain: some row accepts a
/// side node.
#[test]
fn light_cases_run_cleanly_on_the_cpu_and_reach_side_nodes() {
    for case in super::cases().iter().filter(|c| !c.heavy) {
        let run = (case.run)(&Backend::Cpu).unwrap_or_else(|e| panic!("{}: {e}", case.name));
        for row in crate::registry::compare(case, &run, &run) {
            assert!(row.pass, "{}: {row:?}", case.name);
        }
    }
    let (rows, cols, vocab) = (8, 32, 4096);
    let d = case_data(rows, cols, vocab, 41, 0);
    let (a, _, _, path) = run_call(&Call {
        rows,
        cols,
        vocab,
        d,
        greedy: None,
    })
    .expect("run");
    let side = (0..rows)
        .any(|r| (1..=a[r] as usize).any(|j| path[r * cols + j] != path[r * cols + j - 1] + 1));
    assert!(side, "no row accepted a side node: {path:?}");
}
