//! `VerifyWorkspace::verify_tree` through the public API: a chain-shaped tree verifies exactly
//! as `verify` (penalties and filters active, greedy and sampled rows, padded and packed
//! logits); a tree's penalties count only a node's own root path; greedy trees follow the
//! argmax child; bad trees are refused with typed errors and nothing written.

use dflash_ops::Backend;
use dflash_verify::{
    ProposalDist, ProposalKind, RetainedQ, SamplingSettings, TOP, TargetLogits, TokenHistory,
    TreeRow, VerifyError, VerifyRow, VerifyShape, VerifyWorkspace,
};

const V: usize = 96;
const PV: usize = 90;

struct Mix(u64);

impl Mix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn workspace(b: usize, w: usize) -> VerifyWorkspace {
    VerifyWorkspace::new(
        &Backend::cpu(),
        VerifyShape {
            max_rows: b,
            cols: w,
            vocab_rows: V,
            public_vocab: PV,
            kind: ProposalKind::Top16,
        },
    )
    .expect("workspace")
}

/// A retained q over 16 distinct public ids holding `must` (with q > 0).
fn retained(m: &mut Mix, must: u32) -> RetainedQ {
    let mut ids = [0u32; TOP];
    ids[0] = must;
    let mut n = 1;
    while n < TOP {
        let v = m.below(PV) as u32;
        if !ids[..n].contains(&v) {
            ids[n] = v;
            n += 1;
        }
    }
    let w: Vec<f64> = (0..TOP).map(|_| 1.0 + m.below(9) as f64).collect();
    let t: f64 = w.iter().sum();
    let mut q = [0f32; TOP];
    for (x, y) in q.iter_mut().zip(&w) {
        *x = (y / t) as f32;
    }
    let s = m.below(TOP);
    ids.swap(0, s);
    q.swap(0, s);
    RetainedQ { ids, q }
}

/// Logits with a few strong tokens per column (so acceptances happen).
fn logits(m: &mut Mix, cols: usize, strong: &[u32]) -> Vec<f32> {
    let mut l: Vec<f32> = (0..cols * V).map(|_| m.below(100) as f32 / 50.0).collect();
    for c in 0..cols {
        for &s in strong {
            l[c * V + s as usize] += 3.0;
        }
    }
    l
}

#[test]
fn tree_chain_shaped_trees_verify_exactly_as_chains() {
    let settings = [
        SamplingSettings::GREEDY,
        SamplingSettings::sampling(0.9),
        SamplingSettings {
            top_k: 20,
            top_p: 0.9,
            min_p: 0.01,
            repetition_penalty: 1.3,
            frequency_penalty: 0.2,
            presence_penalty: 0.1,
            ..SamplingSettings::sampling(1.1)
        },
    ];
    for seed in 0..24u64 {
        let mut m = Mix(seed);
        let (b, w) = (3, 6);
        let mut hists = Vec::new();
        let mut rows_tokens = Vec::new();
        let mut qs = Vec::new();
        let mut all_logits = Vec::new();
        for _ in 0..b {
            let p = 1 + m.below(w - 1);
            let hist: Vec<u32> = (0..5).map(|_| m.below(PV) as u32).collect();
            let toks: Vec<u32> = (0..p).map(|_| m.below(PV) as u32).collect();
            let q: Vec<RetainedQ> = toks.iter().map(|&t| retained(&mut m, t)).collect();
            all_logits.extend(logits(&mut m, w, &toks));
            hists.push(TokenHistory::with_tokens(V, &hist).expect("history"));
            rows_tokens.push(toks);
            qs.push(q);
        }
        let be = Backend::cpu();
        let lg = be.upload(&all_logits).expect("upload");
        let parents: Vec<Vec<u32>> = rows_tokens
            .iter()
            .map(|t| (0..t.len() as u32).collect())
            .collect();
        let chain_rows: Vec<VerifyRow<'_>> = (0..b)
            .map(|r| VerifyRow {
                anchor: hists[r].last().expect("anchor"),
                proposals: &rows_tokens[r],
                dist: ProposalDist::Top16(&qs[r]),
                settings: settings[r % settings.len()],
                seed: seed * 7 + r as u64,
                frontier: 4,
                history: &hists[r],
            })
            .collect();
        let tree_rows: Vec<TreeRow<'_>> = (0..b)
            .map(|r| TreeRow {
                anchor: hists[r].last().expect("anchor"),
                tokens: &rows_tokens[r],
                parents: &parents[r],
                child_q: &qs[r],
                settings: settings[r % settings.len()],
                seed: seed * 7 + r as u64,
                frontier: 4,
                history: &hists[r],
            })
            .collect();
        let chain = workspace(b, w)
            .verify(&be, &chain_rows, TargetLogits::padded(&lg))
            .expect("chain");
        let tree = workspace(b, w)
            .verify_tree(&be, &tree_rows, TargetLogits::padded(&lg))
            .expect("tree");
        for r in 0..b {
            assert_eq!(tree[r].outputs(), chain[r].outputs(), "seed {seed} row {r}");
            assert_eq!(tree[r].accepted(), chain[r].accepted());
            let path: Vec<usize> = (0..=chain[r].accepted()).collect();
            assert_eq!(tree[r].path(), path.as_slice());
            assert_eq!(tree[r].continuation_column(1), Some(0));
        }
    }
}

/// Root with children 1 (token 11) and 2 (token 9); node 2's child 3 (token 11). Greedy with
/// repetition penalty 2 over logits where 9 (4.0) beats 11 (3.0): at the root 9 wins (node 2);
/// at node 2 its own path holds 9, so 9 drops to 2.0 and 11 wins (node 3, accepted); a
/// history that also counted the sibling branch's 11 (the chain prefix 11, 9) would drop 11
/// to 1.5 and pick 9 there instead. At node 3 (path 9, 11) both drop and 9 (2.0) is the bonus.
#[test]
fn tree_penalties_count_only_the_nodes_root_path() {
    let be = Backend::cpu();
    let w = 4;
    let mut l = vec![0.0f32; w * V];
    for c in 0..w {
        l[c * V + 9] = 4.0;
        l[c * V + 11] = 3.0;
    }
    let lg = be.upload(&l).expect("upload");
    let hist = TokenHistory::with_tokens(V, &[1, 2, 3]).expect("history");
    let mut m = Mix(3);
    let with = |rq: RetainedQ, t: u32| {
        let mut rq = rq;
        if !rq.ids.contains(&t) {
            let s = rq
                .ids
                .iter()
                .position(|&x| x != 9 && x != 11)
                .expect("slot");
            rq.ids[s] = t;
        }
        rq
    };
    let q0 = with(with(retained(&mut m, 11), 9), 11);
    let child_q = [q0, retained(&mut m, 5), retained(&mut m, 11)];
    let settings = SamplingSettings {
        repetition_penalty: 2.0,
        ..SamplingSettings::GREEDY
    };
    let row = TreeRow {
        anchor: 3,
        tokens: &[11, 9, 11],
        parents: &[0, 0, 2],
        child_q: &child_q,
        settings,
        seed: 1,
        frontier: 2,
        history: &hist,
    };
    let out = workspace(1, w)
        .verify_tree(&be, &[row], TargetLogits::padded(&lg))
        .expect("tree");
    assert_eq!(out[0].path(), &[0, 2, 3]);
    assert_eq!(out[0].outputs(), &[9, 11, 9]);
    assert!(out[0].ended_at_leaf());
    assert_eq!(out[0].continuation_column(3), Some(3));
}

#[test]
fn tree_bad_trees_are_refused() {
    let be = Backend::cpu();
    let w = 4;
    let lg = be.upload(&vec![0.5f32; w * V]).expect("upload");
    let hist = TokenHistory::with_tokens(V, &[1, 2, 3]).expect("history");
    let mut m = Mix(5);
    let qs = [
        retained(&mut m, 7),
        retained(&mut m, 9),
        retained(&mut m, 5),
    ];
    let good_tokens = [7u32, qs[0].ids[if qs[0].ids[0] == 7 { 1 } else { 0 }], 9];
    let base = TreeRow {
        anchor: 3,
        tokens: &good_tokens,
        parents: &[0, 0, 1],
        child_q: &qs,
        settings: SamplingSettings::GREEDY,
        seed: 1,
        frontier: 2,
        history: &hist,
    };
    workspace(1, w)
        .verify_tree(&be, &[base], TargetLogits::padded(&lg))
        .expect("the good tree");
    let repeated = [7u32, 7, 9];
    let outside = [7u32, 95, 9];
    let cases: Vec<(TreeRow<'_>, &str)> = vec![
        (
            TreeRow {
                parents: &[0, 2, 1],
                ..base
            },
            "BadTree",
        ),
        (
            TreeRow {
                parents: &[0, 0],
                ..base
            },
            "BadTree",
        ),
        (
            TreeRow {
                tokens: &repeated,
                ..base
            },
            "BadTree",
        ),
        (
            TreeRow {
                tokens: &outside,
                ..base
            },
            "TokenOutOfRange|NonPublic",
        ),
        (
            TreeRow {
                child_q: &qs[..2],
                ..base
            },
            "BadTree",
        ),
    ];
    for (row, want) in cases {
        let err = workspace(1, w)
            .verify_tree(&be, &[row], TargetLogits::padded(&lg))
            .expect_err(want);
        let name = format!("{err:?}");
        assert!(
            want.split('|').any(|x| name.contains(x)),
            "{want}: got {err:?}"
        );
    }
    // A child whose token is not among its parent's ids.
    let mut q_bad = qs;
    q_bad[1]
        .ids
        .iter_mut()
        .filter(|x| **x == 9)
        .for_each(|x| *x = 60);
    let err = workspace(1, w)
        .verify_tree(
            &be,
            &[TreeRow {
                child_q: &q_bad,
                ..base
            }],
            TargetLogits::padded(&lg),
        )
        .expect_err("not a candidate");
    assert!(
        matches!(err, VerifyError::QNotDistribution { column: 1, .. }),
        "{err:?}"
    );
    // Too many nodes for the workspace's columns.
    let narrow = be.upload(&vec![0.5f32; 3 * V]).expect("upload");
    let err = workspace(1, 3)
        .verify_tree(&be, &[base], TargetLogits::padded(&narrow))
        .expect_err("too wide");
    assert!(
        matches!(err, VerifyError::TooManyProposals { .. }),
        "{err:?}"
    );
}
