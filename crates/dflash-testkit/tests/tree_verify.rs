//! The reference target verifies trees: every node computes, bit for bit, what the last column
//! of a chain verify of its root path computes (its own position `F + depth`, its parent's
//! recurrent state and conv window, attention over its ancestors only); committing an accepted
//! path equals a chain verify of the path's tokens committed in full; malformed paths and
//! non-chain prefixes are refused before anything changes; capacity counts depth, not columns.
//!
//! Every random choice is seeded (SplitMix64 with the seed named in each test).

use dflash_engine::{Accepted, Commit, SeqHandle, Target, TargetError, VerifyBatch, VerifyRow};
use dflash_ops::target_distribution::Logits;
use dflash_ops::{Backend, bf16};
use dflash_testkit::fixtures::{SplitMix64, write_reference_target};
use dflash_testkit::{ReferenceTarget, TargetGeometry};
use dflash_verify::LogitsLayout;

const CAPTURE: &[usize] = &[1, 3, 6];

/// The interleaved tree of the brief: columns 1, 2, 6 at depth 1 (children of the root),
/// 3, 5 at depth 2 under column 1, 4 at depth 2 under column 2. Siblings (1, 2, 6) and (3, 5)
/// interleave with deeper nodes in column order.
const INTERLEAVED: [u32; 6] = [0, 0, 1, 2, 1, 0];

fn load_geometry(name: &str, seed: u64, geo: &TargetGeometry) -> ReferenceTarget {
    let dir = std::env::temp_dir().join(format!(
        "dflash-testkit-{}-tree-{name}-{seed}",
        std::process::id()
    ));
    write_reference_target(&dir, geo, seed).expect("write fixture");
    let t = ReferenceTarget::load(&dir, CAPTURE, 500).expect("load fixture");
    let _ = std::fs::remove_dir_all(&dir);
    t
}

fn load(name: &str, seed: u64) -> ReferenceTarget {
    load_geometry(name, seed, &TargetGeometry::tiny())
}

fn tokens(rng: &mut SplitMix64, n: usize, below: u64) -> Vec<u32> {
    (0..n).map(|_| rng.below(below) as u32).collect()
}

/// A random tree of `q` columns: each column's parent uniform among the earlier columns.
fn random_parents(rng: &mut SplitMix64, q: usize) -> Vec<u32> {
    (1..q).map(|i| rng.below(i as u64) as u32).collect()
}

/// Column `i`'s root-to-node path of columns (`[0, .., i]`).
fn root_path(parents: &[u32], i: usize) -> Vec<u32> {
    let mut path = vec![i as u32];
    let mut c = i;
    while c > 0 {
        c = parents[c - 1] as usize;
        path.push(c as u32);
    }
    path.reverse();
    path
}

/// Verify one row (chain when `parents` is `None`); returns (logits [Q, V], features [Q, FW]).
fn verify_row(
    t: &mut ReferenceTarget,
    seq: SeqHandle,
    toks: &[u32],
    parents: Option<&[u32]>,
) -> (Vec<f32>, Vec<bf16>) {
    let be = Backend::cpu();
    let rows = [VerifyRow {
        seq,
        tokens: toks,
        parents,
    }];
    t.verify(
        &be,
        &VerifyBatch {
            rows: &rows,
            cols: toks.len(),
        },
    )
    .expect("verify");
    lent(t, &be, toks.len())
}

/// The first `cols` columns of the target's lent verify outputs, as host vectors.
fn lent(t: &ReferenceTarget, be: &Backend, cols: usize) -> (Vec<f32>, Vec<bf16>) {
    let (v, fw) = (t.info().vocab_rows, t.info().feature_width());
    let view = t.verified().expect("verified");
    let Logits::F32(l) = view.logits.values else {
        panic!("the reference target lends F32 logits");
    };
    assert_eq!(view.logits.layout, LogitsLayout::Padded);
    (
        be.read(l, 0, cols * v).expect("read"),
        be.read(view.features, 0, cols * fw).expect("read"),
    )
}

fn bits_f32(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn bits_bf16(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn path_commit(seq: SeqHandle, path: &[u32]) -> Commit {
    Commit {
        seq,
        accepted: Accepted::Path(path.to_vec()),
    }
}

fn assert_same_state(t: &ReferenceTarget, a: SeqHandle, b: SeqHandle, what: &str) {
    let ca = t.checkpoint(a).expect("checkpoint a");
    let cb = t.checkpoint(b).expect("checkpoint b");
    if let Some(d) = ca.first_difference(&cb) {
        panic!("{what}: states differ: {d}");
    }
}

/// Check every column of a tree verify of `toks` / `parents` on top of `base` against the last
/// column of a chain verify of its root path's tokens on a fork of `base`. The tree row runs in
/// a two-row batch beside a chain row, padded past its width (rows are independent, dead
/// columns zero).
fn check_tree_against_chains(
    t: &mut ReferenceTarget,
    base: SeqHandle,
    toks: &[u32],
    parents: &[u32],
    what: &str,
) {
    let be = Backend::cpu();
    let (vr, fw) = (t.info().vocab_rows, t.info().feature_width());
    let q = toks.len();
    let cols = q + 2;
    let a = t.fork(base).expect("fork");
    let other = t.fork(base).expect("fork");
    let rows = [
        VerifyRow::chain(other, &[7, 8, 9]),
        VerifyRow {
            seq: a,
            tokens: toks,
            parents: Some(parents),
        },
    ];
    t.verify(&be, &VerifyBatch { rows: &rows, cols })
        .expect("tree verify");
    assert_eq!(t.pending(a).expect("pending"), Some(q));
    let (l, f) = lent(t, &be, 2 * cols);
    let (l, f) = (&l[cols * vr..], &f[cols * fw..]);
    assert!(
        l[q * vr..].iter().all(|v| v.to_bits() == 0),
        "{what}: dead logits"
    );
    assert!(
        f[q * fw..].iter().all(|v| v.to_bits() == 0),
        "{what}: dead features"
    );
    t.commit(&[Commit::prefix(a, 0), Commit::prefix(other, 0)])
        .expect("release");
    for i in 0..q {
        let path = root_path(parents, i);
        let path_toks: Vec<u32> = path.iter().map(|&c| toks[c as usize]).collect();
        let c = t.fork(base).expect("fork");
        let (lc, fc) = verify_row(t, c, &path_toks, None);
        let last = path.len() - 1;
        assert_eq!(
            bits_f32(&l[i * vr..(i + 1) * vr]),
            bits_f32(&lc[last * vr..]),
            "{what}: column {i} (path {path:?}) logits differ from its chain"
        );
        assert_eq!(
            bits_bf16(&f[i * fw..(i + 1) * fw]),
            bits_bf16(&fc[last * fw..]),
            "{what}: column {i} (path {path:?}) features differ from its chain"
        );
        t.release(c).expect("release");
    }
    t.release(a).expect("release");
    t.release(other).expect("release");
}

/// Every node of a tree verify equals, bit for bit, the last column of a chain verify of its
/// root path's tokens on an identical fork: the interleaved tree, a star, and random trees
/// (seed 0x7EE5), on top of a prompt (F > 0) and of an empty sequence (F = 0).
#[test]
fn tree_every_node_equals_the_chain_of_its_root_path() {
    let mut t = load("nodes", 31);
    let be = Backend::cpu();
    let mut rng = SplitMix64::new(0x7EE5);
    let v = t.info().vocab_rows as u64;
    let prompt = tokens(&mut rng, 6, v);
    let (base, _) = t.create_with_prompt(&be, &prompt).expect("prefill");
    let empty = t.create().expect("create");
    let toks = tokens(&mut rng, 7, v);
    check_tree_against_chains(&mut t, base, &toks, &INTERLEAVED, "interleaved");
    check_tree_against_chains(&mut t, empty, &toks, &INTERLEAVED, "interleaved at F = 0");
    check_tree_against_chains(&mut t, base, &toks[..5], &[0, 0, 0, 0], "star");
    for case in 0..3 {
        let q = 6 + case;
        let toks = tokens(&mut rng, q, v);
        let parents = random_parents(&mut rng, q);
        check_tree_against_chains(
            &mut t,
            base,
            &toks,
            &parents,
            &format!("random {parents:?}"),
        );
    }
}

/// Chain-shaped parents (`i - 1`) are the chain: bitwise the same outputs as `parents: None`,
/// and the same state after committing every column.
#[test]
fn tree_chain_shaped_parents_equal_no_parents() {
    let mut t = load("chain", 32);
    let be = Backend::cpu();
    let mut rng = SplitMix64::new(0xC4A1);
    let v = t.info().vocab_rows as u64;
    let prompt = tokens(&mut rng, 5, v);
    let (base, _) = t.create_with_prompt(&be, &prompt).expect("prefill");
    let toks = tokens(&mut rng, 6, v);
    let chain: Vec<u32> = (0..5).collect();
    let a = t.fork(base).expect("fork");
    let b = t.fork(base).expect("fork");
    let (la, fa) = verify_row(&mut t, a, &toks, Some(&chain));
    let (lb, fb) = verify_row(&mut t, b, &toks, None);
    assert_eq!(bits_f32(&la), bits_f32(&lb), "logits");
    assert_eq!(bits_bf16(&fa), bits_bf16(&fb), "features");
    t.commit(&[path_commit(a, &[0, 1, 2, 3, 4, 5]), Commit::prefix(b, 6)])
        .expect("commit");
    assert_eq!(t.frontier(a).expect("frontier"), 11);
    assert_same_state(&t, a, b, "chain-shaped parents vs none");
}

/// Committing an accepted path of a tree verify equals a chain verify of the path's tokens
/// committed in full: same frontier, bit-identical state image, and bitwise the same logits
/// and features of a further chain verify. Paths: the root alone, depth-1 and depth-2 nodes of
/// the interleaved tree (including column 5, a depth-2 node placed after a deeper branch), a
/// chain `Prefix` of the tree's chain part, and the empty path (no change).
#[test]
fn tree_commit_path_equals_chain_verify_and_prefix_commit() {
    let mut t = load("commit", 33);
    let be = Backend::cpu();
    let mut rng = SplitMix64::new(0xF01D);
    let v = t.info().vocab_rows as u64;
    let prompt = tokens(&mut rng, 4, v);
    let (base, _) = t.create_with_prompt(&be, &prompt).expect("prefill");
    let toks = tokens(&mut rng, 7, v);
    let next = tokens(&mut rng, 3, v);
    let cases: [Accepted; 7] = [
        Accepted::Path(vec![0]),
        Accepted::Path(vec![0, 2]),
        Accepted::Path(vec![0, 6]),
        Accepted::Path(vec![0, 1, 5]),
        Accepted::Path(vec![0, 2, 4]),
        Accepted::Prefix(2),
        Accepted::Path(vec![]),
    ];
    for accepted in cases {
        let path: Vec<u32> = match &accepted {
            Accepted::Path(p) => p.clone(),
            Accepted::Prefix(n) => (0..*n as u32).collect(),
        };
        let a = t.fork(base).expect("fork");
        verify_row(&mut t, a, &toks, Some(&INTERLEAVED));
        t.commit(&[Commit {
            seq: a,
            accepted: accepted.clone(),
        }])
        .expect("tree commit");
        assert_eq!(t.pending(a).expect("pending"), None);
        let b = t.fork(base).expect("fork");
        if !path.is_empty() {
            let path_toks: Vec<u32> = path.iter().map(|&c| toks[c as usize]).collect();
            verify_row(&mut t, b, &path_toks, None);
            t.commit(&[Commit::prefix(b, path.len())])
                .expect("chain commit");
        }
        assert_eq!(
            t.frontier(a).expect("frontier"),
            prompt.len() + path.len(),
            "{accepted:?}: frontier"
        );
        assert_eq!(t.frontier(a).expect("f"), t.frontier(b).expect("f"));
        assert_same_state(&t, a, b, &format!("{accepted:?}"));
        let (la, fa) = verify_row(&mut t, a, &next, None);
        let (lb, fb) = verify_row(&mut t, b, &next, None);
        assert_eq!(bits_f32(&la), bits_f32(&lb), "{accepted:?}: next logits");
        assert_eq!(
            bits_bf16(&fa),
            bits_bf16(&fb),
            "{accepted:?}: next features"
        );
        t.release(a).expect("release");
        t.release(b).expect("release");
    }
    // The paths above really moved the state differently (so the equality is a real check).
    let x = t.fork(base).expect("fork");
    let y = t.fork(base).expect("fork");
    verify_row(&mut t, x, &toks, Some(&INTERLEAVED));
    verify_row(&mut t, y, &toks, Some(&INTERLEAVED));
    t.commit(&[path_commit(x, &[0, 1, 5]), path_commit(y, &[0, 1, 3])])
        .expect("commit");
    let (cx, cy) = (t.checkpoint(x).expect("cp"), t.checkpoint(y).expect("cp"));
    assert!(
        cx.first_difference(&cy).is_some(),
        "sibling paths fold differently"
    );
}

/// Siblings do not see each other and positions use depth: in the interleaved tree, two
/// children of the same parent with the same token compute bit-identical outputs wherever
/// they sit in column order (columns 1 and 6 at depth 1, columns 3 and 5 at depth 2, with the
/// branch of column 2 and 4 between them). Seeing an earlier sibling, taking position
/// `F + column`, or continuing the previous column's recurrent state would break it. Column
/// 5 also equals a three-column chain of its path (position F + 2), and a chain that puts its
/// token at F + 5 gives something else.
#[test]
fn tree_interleaved_siblings_are_independent_and_positioned_by_depth() {
    let mut t = load("siblings", 34);
    let be = Backend::cpu();
    let (vr, fw) = (t.info().vocab_rows, t.info().feature_width());
    let (base, _) = t
        .create_with_prompt(&be, &[17, 4, 250, 9, 33])
        .expect("prefill");
    // Column:        0   1   2   3   4   5   6
    let toks = [40u32, 41, 42, 43, 44, 43, 41];
    let a = t.fork(base).expect("fork");
    let (l, f) = verify_row(&mut t, a, &toks, Some(&INTERLEAVED));
    let col = |i: usize| {
        (
            bits_f32(&l[i * vr..(i + 1) * vr]),
            bits_bf16(&f[i * fw..(i + 1) * fw]),
        )
    };
    assert_eq!(col(1), col(6), "depth-1 siblings 1 and 6");
    assert_eq!(col(3), col(5), "depth-2 siblings 3 and 5");
    assert_ne!(col(1), col(2), "different tokens differ");
    assert_ne!(col(3), col(4), "cousins under different parents differ");
    t.commit(&[Commit::prefix(a, 0)]).expect("release");

    let b = t.fork(base).expect("fork");
    let (lb, _) = verify_row(&mut t, b, &[40, 41, 43], None);
    t.commit(&[Commit::prefix(b, 0)]).expect("release");
    assert_eq!(
        col(5).0,
        bits_f32(&lb[2 * vr..]),
        "column 5 is position F + 2"
    );
    let (lc, _) = verify_row(&mut t, b, &[40, 41, 42, 44, 41, 43], None);
    assert_ne!(col(5).0, bits_f32(&lc[5 * vr..]), "not position F + 5");
}

/// Malformed commits are `InvalidPath` (a path not starting at 0, a step to a non-child, the
/// root twice, an entry at or above Q, `Prefix(n)` over a non-chain prefix) or
/// `CommitTooLong` (more entries than columns); each refusal, even beside a valid commit of
/// another sequence, changes nothing: frontiers and pending records stay, and the valid
/// commit made afterwards folds exactly what a chain verify of the path would.
#[test]
fn tree_invalid_paths_are_refused_and_change_nothing() {
    let mut t = load("refuse", 35);
    let be = Backend::cpu();
    let (s, _) = t.create_with_prompt(&be, &[1, 2, 3]).expect("prefill");
    let (o, _) = t.create_with_prompt(&be, &[4, 5, 6, 7]).expect("prefill");
    let s_ref = t.fork(s).expect("fork");
    let o_ref = t.fork(o).expect("fork");
    let toks = [60u32, 61, 62, 63, 64, 65, 66];
    verify_row(&mut t, o, &[70, 71, 72], None);
    verify_row(&mut t, s, &toks, Some(&INTERLEAVED));
    let unchanged = |t: &ReferenceTarget, what: &str| {
        assert_eq!(t.pending(s).expect("pending"), Some(7), "{what}: s records");
        assert_eq!(t.pending(o).expect("pending"), Some(3), "{what}: o records");
        assert_eq!(t.frontier(s).expect("f"), 3, "{what}: s frontier");
        assert_eq!(t.frontier(o).expect("f"), 4, "{what}: o frontier");
    };
    let bad_paths: [(&[u32], &str); 5] = [
        (&[1, 3], "entry 0"),
        (&[0, 1, 4], "entry 2"),
        (&[0, 0], "entry 1"),
        (&[0, 7], "entry 1"),
        (&[2], "entry 0"),
    ];
    for (path, names) in bad_paths {
        // The valid commit of `o` comes first: it must not be applied either.
        let err = t
            .commit(&[Commit::prefix(o, 2), path_commit(s, path)])
            .expect_err("invalid path");
        match err {
            TargetError::InvalidPath {
                seq,
                path: p,
                reason,
            } => {
                assert_eq!(seq, s);
                assert_eq!(p, path);
                assert!(reason.contains(names), "{path:?}: reason {reason:?}");
            }
            other => panic!("{path:?}: expected InvalidPath, got {other:?}"),
        }
        unchanged(&t, &format!("{path:?}"));
    }
    for n in [3usize, 7] {
        match t.commit(&[Commit::prefix(o, 1), Commit::prefix(s, n)]) {
            Err(TargetError::InvalidPath { seq, reason, .. }) => {
                assert_eq!(seq, s);
                assert!(reason.contains("not a chain"), "Prefix({n}): {reason:?}");
            }
            other => panic!("Prefix({n}): expected InvalidPath, got {other:?}"),
        }
        unchanged(&t, &format!("Prefix({n})"));
    }
    assert!(matches!(
        t.commit(&[path_commit(s, &[0, 1, 3, 4, 5, 6, 2, 0])]),
        Err(TargetError::CommitTooLong {
            rows: 8,
            columns: 7,
            ..
        })
    ));
    unchanged(&t, "too long");
    // The records survived: a valid commit now folds the path [0, 1, 5] exactly.
    t.commit(&[path_commit(s, &[0, 1, 5]), Commit::prefix(o, 2)])
        .expect("valid commit");
    assert_eq!(t.frontier(s).expect("f"), 6);
    assert_eq!(t.frontier(o).expect("f"), 6);
    verify_row(&mut t, s_ref, &[60, 61, 65], None);
    verify_row(&mut t, o_ref, &[70, 71, 72], None);
    t.commit(&[Commit::prefix(s_ref, 3), Commit::prefix(o_ref, 2)])
        .expect("reference commits");
    assert_same_state(&t, s, s_ref, "s after the refusals");
    assert_same_state(&t, o, o_ref, "o after the refusals");
    // Prefix over the tree's chain part is allowed.
    verify_row(&mut t, s, &toks, Some(&INTERLEAVED));
    t.commit(&[Commit::prefix(s, 2)])
        .expect("chain prefix of a tree");
    assert_eq!(t.frontier(s).expect("f"), 8);
}

/// Capacity counts the positions a tree uses (F + max depth + 1), not its columns: with 10
/// positions and F = 6, a 7-column tree of depth 3 is accepted (its deepest path commits up
/// to the capacity), a 5-column chain is refused, and so is a tree one level too deep.
#[test]
fn tree_capacity_counts_depth_not_columns() {
    let geo = TargetGeometry {
        max_positions: 10,
        ..TargetGeometry::tiny()
    };
    let mut t = load_geometry("capacity", 36, &geo);
    let be = Backend::cpu();
    let (s, _) = t
        .create_with_prompt(&be, &[1, 2, 3, 4, 5, 6])
        .expect("prefill");
    let deep = [0u32, 0, 1, 2, 1, 3];
    let toks = [10u32, 11, 12, 13, 14, 15, 16];
    assert_eq!(root_path(&deep, 6), vec![0, 1, 3, 6]);
    verify_row(&mut t, s, &toks, Some(&INTERLEAVED));
    t.commit(&[Commit::prefix(s, 0)]).expect("release");
    verify_row(&mut t, s, &toks, Some(&deep));
    t.commit(&[Commit::prefix(s, 0)]).expect("release");
    let refused = |t: &mut ReferenceTarget, toks: &[u32], parents: Option<&[u32]>| {
        let rows = [VerifyRow {
            seq: s,
            tokens: toks,
            parents,
        }];
        t.verify(
            &be,
            &VerifyBatch {
                rows: &rows,
                cols: 8,
            },
        )
    };
    assert!(matches!(
        refused(&mut t, &toks[..5], None),
        Err(TargetError::CapacityExceeded {
            frontier: 6,
            columns: 5,
            max_positions: 10,
            ..
        })
    ));
    // Six columns, five positions (depth 4): refused, and the error counts positions.
    let too_deep = [0u32, 1, 2, 3, 0];
    assert!(matches!(
        refused(&mut t, &toks[..6], Some(&too_deep[..])),
        Err(TargetError::CapacityExceeded {
            frontier: 6,
            columns: 5,
            ..
        })
    ));
    assert_eq!(t.pending(s).expect("pending"), None);
    verify_row(&mut t, s, &toks, Some(&deep));
    t.commit(&[path_commit(s, &[0, 1, 3, 6])])
        .expect("deepest path");
    assert_eq!(t.frontier(s).expect("f"), 10);
    assert!(matches!(
        refused(&mut t, &[1], None),
        Err(TargetError::CapacityExceeded { .. })
    ));
}
