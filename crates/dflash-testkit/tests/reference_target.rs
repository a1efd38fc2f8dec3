//! The reference target against its contract: fold exactness (verify Q then commit N equals N
//! single-token steps, bit for bit), prefill = verify, capture points, fork / checkpoint /
//! restore, typed refusals that leave state unchanged, and loader errors.
//!
//! Every random choice is seeded (SplitMix64 with the seed named in each test).

use std::path::PathBuf;

use dflash_engine::{
    Accepted, Commit, SeqHandle, Target, TargetCheckpoint, TargetError, VerifyBatch, VerifyRow,
};
use dflash_ops::target_distribution::Logits;
use dflash_ops::{Backend, bf16};
use dflash_testkit::fixtures::{SplitMix64, write_reference_target};
use dflash_testkit::{LayerKind, ReferenceTarget, TargetGeometry, TestkitError};
use dflash_verify::LogitsLayout;

const CAPTURE: &[usize] = &[1, 3, 6];

fn fixture_dir(name: &str, seed: u64) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "dflash-testkit-{}-{name}-{seed}",
        std::process::id()
    ));
    write_reference_target(&dir, &TargetGeometry::tiny(), seed).expect("write fixture");
    dir
}

fn load(name: &str, seed: u64, capture: &[usize]) -> ReferenceTarget {
    let dir = fixture_dir(name, seed);
    let t = ReferenceTarget::load(&dir, capture, 500).expect("load fixture");
    let _ = std::fs::remove_dir_all(&dir);
    t
}

fn tokens(rng: &mut SplitMix64, n: usize, below: u64) -> Vec<u32> {
    (0..n).map(|_| rng.below(below) as u32).collect()
}

/// One chain verify of one row; returns (logits [Q, V], features [Q, FW]) as host vectors.
fn verify1(t: &mut ReferenceTarget, seq: SeqHandle, toks: &[u32]) -> (Vec<f32>, Vec<bf16>) {
    let be = Backend::cpu();
    let rows = [VerifyRow::chain(seq, toks)];
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

fn assert_same_state(t: &ReferenceTarget, a: SeqHandle, b: SeqHandle, what: &str) {
    let ca = t.checkpoint(a).expect("checkpoint a");
    let cb = t.checkpoint(b).expect("checkpoint b");
    if let Some(d) = ca.first_difference(&cb) {
        panic!("{what}: states differ: {d}");
    }
}

/// Activations are not degenerate: logits vary and are finite, and the distribution is not a
/// point mass (so exact equality below is a real check).
#[test]
fn fixture_activations_are_not_degenerate() {
    let mut t = load("nondegenerate", 11, CAPTURE);
    let be = Backend::cpu();
    let (seq, out) = t
        .create_with_prompt(&be, &[1, 2, 3, 4, 5, 6, 7, 8])
        .expect("prefill");
    let logits = be.download(&out.last_logits).expect("download");
    assert!(logits.iter().all(|v| v.is_finite()));
    let mx = logits.iter().cloned().fold(f32::MIN, f32::max);
    let mn = logits.iter().cloned().fold(f32::MAX, f32::min);
    assert!(mx - mn > 1.0 && mx - mn < 100.0, "logit spread {mn}..{mx}");
    let p_max = 1.0 / logits.iter().map(|v| f64::from(v - mx).exp()).sum::<f64>();
    assert!(p_max < 0.9, "top probability {p_max}");
    let feats = be.download(&out.features).expect("download");
    let rms = (feats
        .iter()
        .map(|v| f64::from(v.to_f32()).powi(2))
        .sum::<f64>()
        / feats.len() as f64)
        .sqrt();
    assert!(rms > 0.1 && rms < 100.0, "feature rms {rms}");
    assert_eq!(t.frontier(seq).expect("frontier"), 8);
}

/// THE fold test: for random prompts and Q in 1..=16, for every N in 0..=Q, verify Q columns
/// then commit N is bit-identical (GDN recurrent state, conv window, attention K/V, frontier) to
/// feeding the N tokens one at a time, and so are the next verify's logits and features. The
/// Q-column verify's column j also equals the j-th single-token step (causality).
#[test]
fn verify_q_then_commit_n_equals_sequential_decode() {
    let mut t = load("fold", 21, CAPTURE);
    let be = Backend::cpu();
    let mut rng = SplitMix64::new(0xF01D);
    let v = t.info().vocab_rows as u64;
    let started = std::time::Instant::now();
    let mut checked = 0;
    for (case, q) in [1usize, 2, 3, 5, 8, 16].into_iter().enumerate() {
        let prompt_len = 1 + rng.below(12) as usize;
        let prompt = tokens(&mut rng, prompt_len, v);
        let (base, _) = t.create_with_prompt(&be, &prompt).expect("prefill");
        let block = tokens(&mut rng, q, v);
        let next = tokens(&mut rng, 3, v);
        // Sequential reference: one token at a time, keeping each step's outputs and states.
        let seqr = t.fork(base).expect("fork");
        let mut step_logits = Vec::new();
        let mut step_features = Vec::new();
        let mut step_states = vec![t.checkpoint(seqr).expect("checkpoint")];
        for &tok in &block {
            let (l, f) = verify1(&mut t, seqr, &[tok]);
            step_logits.push(l);
            step_features.push(f);
            t.commit(&[Commit::prefix(seqr, 1)]).expect("commit 1");
            step_states.push(t.checkpoint(seqr).expect("checkpoint"));
        }
        let vr = t.info().vocab_rows;
        let fw = t.info().feature_width();
        for n in 0..=q {
            let a = t.fork(base).expect("fork");
            let (l, f) = verify1(&mut t, a, &block);
            for j in 0..q {
                assert_eq!(
                    bits_f32(&l[j * vr..(j + 1) * vr]),
                    bits_f32(&step_logits[j]),
                    "case {case} Q {q}: column {j} logits differ from step {j}"
                );
                assert_eq!(
                    bits_bf16(&f[j * fw..(j + 1) * fw]),
                    bits_bf16(&step_features[j]),
                    "case {case} Q {q}: column {j} features differ"
                );
            }
            assert_eq!(t.pending(a).expect("pending"), Some(q));
            t.commit(&[Commit::prefix(a, n)]).expect("commit n");
            assert_eq!(t.pending(a).expect("pending"), None);
            assert_eq!(t.frontier(a).expect("frontier"), prompt_len + n);
            let ca = t.checkpoint(a).expect("checkpoint");
            assert_eq!(ca.frontier(), prompt_len + n);
            if let Some(d) = ca.first_difference(&step_states[n]) {
                panic!("case {case} Q {q} N {n}: state differs from {n} single steps: {d}");
            }
            // The next verify after the commit agrees with the same verify after n steps.
            let b = t.fork(base).expect("fork");
            for &tok in &block[..n] {
                verify1(&mut t, b, &[tok]);
                t.commit(&[Commit::prefix(b, 1)]).expect("commit 1");
            }
            let (la, fa) = verify1(&mut t, a, &next);
            let (lb, fb) = verify1(&mut t, b, &next);
            assert_eq!(
                bits_f32(&la),
                bits_f32(&lb),
                "case {case} Q {q} N {n}: next logits"
            );
            assert_eq!(
                bits_bf16(&fa),
                bits_bf16(&fb),
                "case {case} Q {q} N {n}: next features"
            );
            t.release(a).expect("release");
            t.release(b).expect("release");
            checked += 1;
        }
        t.release(seqr).expect("release");
        t.release(base).expect("release");
    }
    assert_eq!(checked, 2 + 3 + 4 + 6 + 9 + 17);
    eprintln!(
        "fold test: {checked} (Q, N) cases in {:.2?}",
        started.elapsed()
    );
}

/// The GDN state and conv window really change with every committed token (so the fold test
/// above would notice a fold of the wrong column), and commit 0 changes nothing.
#[test]
fn commit_zero_releases_records_without_state_change() {
    let mut t = load("commit0", 22, CAPTURE);
    let be = Backend::cpu();
    let (seq, _) = t.create_with_prompt(&be, &[5, 6, 7]).expect("prefill");
    let before = t.checkpoint(seq).expect("checkpoint");
    verify1(&mut t, seq, &[8, 9, 10, 11]);
    t.commit(&[Commit {
        seq,
        accepted: Accepted::Path(vec![]),
    }])
    .expect("commit 0");
    let after = t.checkpoint(seq).expect("checkpoint");
    assert_eq!(after.first_difference(&before), None);
    verify1(&mut t, seq, &[8, 9]);
    t.commit(&[Commit {
        seq,
        accepted: Accepted::Path(vec![0]),
    }])
    .expect("commit path [0]");
    let one = t.checkpoint(seq).expect("checkpoint");
    for i in 0..one.gdn_blocks() {
        assert_ne!(one.gdn_state(i), before.gdn_state(i), "gdn {i} state moved");
        assert_ne!(
            one.conv_window(i),
            before.conv_window(i),
            "gdn {i} window moved"
        );
    }
    for i in 0..one.attention_blocks() {
        let (k, _) = one.kv(i).expect("kv");
        assert_eq!(k.len(), 4 * 2 * 32, "attention {i} holds 4 positions");
    }
}

/// Prefill is verify + commit of every column: one prefill, chunked prefills, and prefill of a
/// prefix followed by a verify of the rest give bit-identical features, logits and states.
#[test]
fn prefill_equals_verify_of_the_same_tokens() {
    let mut t = load("prefill", 23, CAPTURE);
    let be = Backend::cpu();
    let mut rng = SplitMix64::new(0x9E);
    let prompt = tokens(&mut rng, 13, 512);
    let (x, out) = t.create_with_prompt(&be, &prompt).expect("prefill");
    let fx = be.download(&out.features).expect("download");
    let lx = be.download(&out.last_logits).expect("download");
    let fw = t.info().feature_width();
    let vr = t.info().vocab_rows;
    assert_eq!(fx.len(), 13 * fw);
    assert_eq!(lx.len(), vr);

    let (y, out_y) = t
        .create_with_prompt(&be, &prompt[..5])
        .expect("prefill prefix");
    let fy0 = be.download(&out_y.features).expect("download");
    let (ly, fy) = verify1(&mut t, y, &prompt[5..]);
    t.commit(&[Commit::prefix(y, 8)]).expect("commit all");
    assert_eq!(bits_bf16(&fy0), bits_bf16(&fx[..5 * fw]));
    assert_eq!(bits_bf16(&fy), bits_bf16(&fx[5 * fw..]));
    assert_eq!(bits_f32(&ly[7 * vr..]), bits_f32(&lx));
    assert_same_state(&t, x, y, "prefill vs prefill+verify");

    let z = t.create().expect("create");
    let mut fz = Vec::new();
    for chunk in prompt.chunks(4) {
        let o = t.prefill(&be, z, chunk).expect("chunk");
        fz.extend(be.download(&o.features).expect("download"));
    }
    assert_eq!(bits_bf16(&fz), bits_bf16(&fx));
    assert_same_state(&t, x, z, "prefill vs chunked prefill");
}

/// Captured block l is the residual after block l (after the MLP add), in recorded order,
/// rounded once to BF16; the trace hook is checked against the last block through the logits.
#[test]
fn captured_features_are_block_residuals_in_recorded_order() {
    let capture = [6usize, 0, 3, 7];
    let mut t = load("capture", 24, &capture);
    let be = Backend::cpu();
    let (seq, _) = t
        .create_with_prompt(&be, &[3, 1, 4, 1, 5])
        .expect("prefill");
    let cols = [9u32, 2, 6];
    let trace = t.trace_residuals(seq, &cols).expect("trace");
    let (h, layers) = (t.info().hidden, t.info().layers);
    assert_eq!(trace.len(), cols.len() * layers * h);
    let (_, f) = verify1(&mut t, seq, &cols);
    let fw = t.info().feature_width();
    assert_eq!(fw, capture.len() * h);
    for j in 0..cols.len() {
        for (c, &l) in capture.iter().enumerate() {
            let res = &trace[(j * layers + l) * h..(j * layers + l + 1) * h];
            let want: Vec<u16> = res.iter().map(|v| bf16::from_f32(*v).to_bits()).collect();
            assert_eq!(
                bits_bf16(&f[j * fw + c * h..j * fw + (c + 1) * h]),
                want,
                "column {j}, capture slot {c} (block {l})"
            );
        }
        // Different blocks give different residuals (a wrong block id would be visible).
        let r0 = &trace[(j * layers) * h..(j * layers + 1) * h];
        let r1 = &trace[(j * layers + 1) * h..(j * layers + 2) * h];
        assert_ne!(bits_f32(r0), bits_f32(r1));
    }
    t.commit(&[Commit::prefix(seq, 0)]).expect("release");
}

/// Fork copies the state; checkpoint and restore round-trip it with the frontier, into the
/// same or another handle; the next verify agrees bit for bit.
#[test]
fn fork_checkpoint_restore_round_trip() {
    let mut t = load("fork", 25, CAPTURE);
    let be = Backend::cpu();
    let (a, _) = t
        .create_with_prompt(&be, &[10, 20, 30, 40])
        .expect("prefill");
    let image = t.checkpoint(a).expect("checkpoint");
    assert_eq!(image.frontier(), 4);
    assert!(image.size_bytes() > 0);
    let f = t.fork(a).expect("fork");
    assert_same_state(&t, a, f, "fork");
    // Move a forward, then restore it.
    verify1(&mut t, a, &[1, 2, 3]);
    t.commit(&[Commit::prefix(a, 3)]).expect("commit");
    assert_eq!(t.frontier(a).expect("frontier"), 7);
    t.restore(a, &image).expect("restore");
    assert_eq!(t.frontier(a).expect("frontier"), 4);
    assert_same_state(&t, a, f, "restore");
    // Restore into another handle (a fresh, empty one).
    let b = t.create().expect("create");
    t.restore(b, &image).expect("restore into b");
    assert_eq!(t.frontier(b).expect("frontier"), 4);
    let (la, fa) = verify1(&mut t, a, &[7, 8]);
    let (lb, fb) = verify1(&mut t, b, &[7, 8]);
    let (lf, ff) = verify1(&mut t, f, &[7, 8]);
    assert_eq!(bits_f32(&la), bits_f32(&lb));
    assert_eq!(bits_f32(&la), bits_f32(&lf));
    assert_eq!(bits_bf16(&fa), bits_bf16(&fb));
    assert_eq!(bits_bf16(&fa), bits_bf16(&ff));
    // An image of another geometry is refused.
    let mut g = TargetGeometry::tiny();
    g.layer_types = vec![LayerKind::LinearAttention, LayerKind::FullAttention];
    let dir =
        std::env::temp_dir().join(format!("dflash-testkit-{}-fork-other", std::process::id()));
    write_reference_target(&dir, &g, 1).expect("fixture");
    let mut other = ReferenceTarget::load(&dir, &[0], 500).expect("load");
    let _ = std::fs::remove_dir_all(&dir);
    let o = other.create().expect("create");
    let other_image = other.checkpoint(o).expect("checkpoint");
    t.commit(&[Commit::prefix(b, 0)]).expect("commit 0");
    let before = t.checkpoint(b).expect("checkpoint");
    assert!(matches!(
        t.restore(b, &other_image),
        Err(TargetError::IncompatibleCheckpoint { .. })
    ));
    assert_eq!(t.checkpoint(b).expect("cp").first_difference(&before), None);
}

/// Rows of one batch are independent: a two-row batch equals two one-row verifies, and dead
/// columns (past a row's Q) are exact zeros.
#[test]
fn batch_rows_are_independent_and_dead_columns_zero() {
    let mut t = load("batch", 26, CAPTURE);
    let be = Backend::cpu();
    let (a, _) = t.create_with_prompt(&be, &[1, 2, 3]).expect("prefill");
    let (b, _) = t
        .create_with_prompt(&be, &[4, 5, 6, 7, 8])
        .expect("prefill");
    let a2 = t.fork(a).expect("fork");
    let b2 = t.fork(b).expect("fork");
    let (ta, tb) = ([11u32, 12], [21u32, 22, 23, 24]);
    let cols = 6;
    // A larger batch first, so the outputs the two-row batch reuses hold stale values.
    let c = t.fork(a).expect("fork");
    let d = t.fork(b).expect("fork");
    let wide = [VerifyRow::chain(c, &[5; 8]), VerifyRow::chain(d, &[6; 8])];
    t.verify(
        &be,
        &VerifyBatch {
            rows: &wide,
            cols: 8,
        },
    )
    .expect("verify");
    t.commit(&[Commit::prefix(c, 0), Commit::prefix(d, 0)])
        .expect("release records");
    let rows = [VerifyRow::chain(b, &tb), VerifyRow::chain(a, &ta)];
    t.verify(&be, &VerifyBatch { rows: &rows, cols })
        .expect("verify");
    let (l, f) = lent(&t, &be, 2 * cols);
    let (la, fa) = verify1(&mut t, a2, &ta);
    let (lb, fb) = verify1(&mut t, b2, &tb);
    let (vr, fw) = (t.info().vocab_rows, t.info().feature_width());
    assert_eq!(bits_f32(&l[..4 * vr]), bits_f32(&lb));
    assert_eq!(bits_f32(&l[cols * vr..(cols + 2) * vr]), bits_f32(&la));
    assert_eq!(bits_bf16(&f[..4 * fw]), bits_bf16(&fb));
    assert_eq!(bits_bf16(&f[cols * fw..(cols + 2) * fw]), bits_bf16(&fa));
    assert!(l[4 * vr..cols * vr].iter().all(|v| v.to_bits() == 0));
    assert!(l[(cols + 2) * vr..].iter().all(|v| v.to_bits() == 0));
    assert!(f[4 * fw..cols * fw].iter().all(|v| v.to_bits() == 0));
    assert!(f[(cols + 2) * fw..].iter().all(|v| v.to_bits() == 0));
    // Different commits per row in one call.
    t.commit(&[Commit::prefix(a, 1), Commit::prefix(b, 4)])
        .expect("commit");
    assert_eq!(t.frontier(a).expect("f"), 4);
    assert_eq!(t.frontier(b).expect("f"), 9);
}

/// Every misuse is a typed error and leaves every sequence (state and pending records) as it
/// was.
#[test]
fn misuse_is_refused_with_typed_errors_and_no_state_change() {
    let mut t = load("misuse", 27, CAPTURE);
    let be = Backend::cpu();
    let (s, _) = t.create_with_prompt(&be, &[1, 2, 3]).expect("prefill");
    let (idle, _) = t.create_with_prompt(&be, &[4, 5]).expect("prefill");
    let cp_s = t.checkpoint(s).expect("cp");
    let cp_idle = t.checkpoint(idle).expect("cp");
    let unchanged = |t: &ReferenceTarget, what: &str| {
        assert_eq!(
            t.checkpoint(idle).expect("cp").first_difference(&cp_idle),
            None,
            "{what}: idle sequence changed"
        );
    };
    let ghost = SeqHandle::from_raw(999_999);
    let info = t.info().clone();
    assert!(matches!(t.verified(), Err(TargetError::NothingVerified)));
    let run = |t: &mut ReferenceTarget, rows: &[VerifyRow<'_>], cols| {
        t.verify(&be, &VerifyBatch { rows, cols })
    };

    // Commit without a verify.
    assert!(matches!(
        t.commit(&[Commit::prefix(s, 1)]),
        Err(TargetError::NoPendingVerify { .. })
    ));
    // Unknown handles everywhere.
    assert!(matches!(
        t.frontier(ghost),
        Err(TargetError::UnknownSequence { .. })
    ));
    assert!(matches!(
        t.fork(ghost),
        Err(TargetError::UnknownSequence { .. })
    ));
    assert!(matches!(
        t.checkpoint(ghost),
        Err(TargetError::UnknownSequence { .. })
    ));
    assert!(matches!(
        t.release(ghost),
        Err(TargetError::UnknownSequence { .. })
    ));
    assert!(matches!(
        t.prefill(&be, ghost, &[1]),
        Err(TargetError::UnknownSequence { .. })
    ));
    assert!(matches!(
        run(
            &mut t,
            &[VerifyRow::chain(idle, &[1]), VerifyRow::chain(ghost, &[1])],
            4
        ),
        Err(TargetError::UnknownSequence { .. })
    ));
    // Bad batches.
    assert!(matches!(run(&mut t, &[], 4), Err(TargetError::EmptyBatch)));
    assert!(matches!(
        run(
            &mut t,
            &[VerifyRow::chain(idle, &[1]), VerifyRow::chain(s, &[])],
            4
        ),
        Err(TargetError::EmptyRow { row: 1 })
    ));
    assert!(matches!(
        run(
            &mut t,
            &[VerifyRow::chain(idle, &[1]), VerifyRow::chain(s, &[1, 512])],
            4
        ),
        Err(TargetError::TokenOutOfRange {
            row: 1,
            column: 1,
            token: 512,
            vocab_rows: 512
        })
    ));
    assert!(matches!(
        run(
            &mut t,
            &[VerifyRow::chain(idle, &[1]), VerifyRow::chain(idle, &[2])],
            4
        ),
        Err(TargetError::DuplicateSequence { .. })
    ));
    assert!(matches!(
        run(
            &mut t,
            &[
                VerifyRow::chain(idle, &[1]),
                VerifyRow::chain(s, &[1, 2, 3, 4, 5])
            ],
            4
        ),
        Err(TargetError::WidthTooSmall {
            row: 1,
            columns: 5,
            width: 4
        })
    ));
    // A valid tree row does not save a batch whose other row has a bad parent.
    let tree = [0u32, 0];
    let self_parent = [1u32];
    assert!(matches!(
        run(
            &mut t,
            &[
                VerifyRow {
                    seq: s,
                    tokens: &[1, 2, 3],
                    parents: Some(&tree)
                },
                VerifyRow {
                    seq: idle,
                    tokens: &[1, 2],
                    parents: Some(&self_parent)
                }
            ],
            4
        ),
        Err(TargetError::BadParents { row: 1, .. })
    ));
    let forward_parent = [1u32, 1];
    assert!(matches!(
        run(
            &mut t,
            &[
                VerifyRow {
                    seq: s,
                    tokens: &[1, 2, 3],
                    parents: Some(&forward_parent)
                },
                VerifyRow::chain(idle, &[1])
            ],
            4
        ),
        Err(TargetError::BadParents { row: 0, .. })
    ));
    let short = [0u32];
    assert!(matches!(
        run(
            &mut t,
            &[
                VerifyRow {
                    seq: s,
                    tokens: &[1, 2, 3],
                    parents: Some(&short)
                },
                VerifyRow::chain(idle, &[1])
            ],
            4
        ),
        Err(TargetError::BadParents { row: 0, .. })
    ));
    assert!(
        matches!(t.verified(), Err(TargetError::NothingVerified)),
        "refused verifies lend nothing"
    );
    let long = vec![1u32; info.max_positions];
    assert!(matches!(
        t.prefill(&be, s, &long),
        Err(TargetError::CapacityExceeded { .. })
    ));
    assert!(matches!(
        t.prefill(&be, s, &[]),
        Err(TargetError::EmptyPrompt { .. })
    ));
    assert!(matches!(
        t.prefill(&be, s, &[3, 600]),
        Err(TargetError::PromptTokenOutOfRange {
            index: 1,
            token: 600,
            ..
        })
    ));
    assert_eq!(t.checkpoint(s).expect("cp").first_difference(&cp_s), None);
    assert_eq!(t.pending(s).expect("pending"), None);
    unchanged(&t, "bad batches");

    // A pending verify: everything that needs an idle sequence is refused.
    let parents_chain = [0u32, 1, 2];
    let rows = [VerifyRow {
        seq: s,
        tokens: &[7, 8, 9, 10],
        parents: Some(&parents_chain),
    }];
    run(&mut t, &rows, 4).expect("chain written with explicit parents");
    let pending = |t: &ReferenceTarget| t.pending(s).expect("pending");
    assert!(matches!(
        run(&mut t, &[VerifyRow::chain(s, &[1])], 4),
        Err(TargetError::VerifyPending { columns: 4, .. })
    ));
    assert!(matches!(t.fork(s), Err(TargetError::VerifyPending { .. })));
    assert!(matches!(
        t.checkpoint(s),
        Err(TargetError::VerifyPending { .. })
    ));
    assert!(matches!(
        t.restore(s, &cp_s),
        Err(TargetError::VerifyPending { .. })
    ));
    assert!(matches!(
        t.prefill(&be, s, &[1]),
        Err(TargetError::VerifyPending { .. })
    ));
    assert!(matches!(
        t.commit(&[Commit::prefix(s, 5)]),
        Err(TargetError::CommitTooLong {
            rows: 5,
            columns: 4,
            ..
        })
    ));
    assert!(matches!(
        t.commit(&[Commit {
            seq: s,
            accepted: Accepted::Path(vec![0, 2])
        }]),
        Err(TargetError::InvalidPath { .. })
    ));
    // A refused commit list applies nothing, not even its valid entries.
    assert!(matches!(
        t.commit(&[Commit::prefix(s, 2), Commit::prefix(idle, 1)]),
        Err(TargetError::NoPendingVerify { .. })
    ));
    assert!(matches!(
        t.commit(&[Commit::prefix(s, 2), Commit::prefix(s, 2)]),
        Err(TargetError::DuplicateSequence { .. })
    ));
    assert_eq!(pending(&t), Some(4));
    assert_eq!(t.frontier(s).expect("f"), 3);
    unchanged(&t, "pending refusals");
    t.commit(&[Commit::prefix(s, 0)]).expect("release records");
    assert_eq!(t.checkpoint(s).expect("cp").first_difference(&cp_s), None);
    // Release forgets the handle, pending records included.
    verify1(&mut t, s, &[1]);
    t.release(s).expect("release");
    assert!(matches!(
        t.pending(s),
        Err(TargetError::UnknownSequence { .. })
    ));
    unchanged(&t, "release");
}

/// Loader errors name the problem: a missing tensor, a misshaped tensor, a bad config field,
/// bad capture ids or public size.
#[test]
fn loader_reports_missing_and_misshaped_tensors_and_bad_config() {
    let dir = fixture_dir("loader", 28);
    let cfg_path = dir.join("config.json");
    let original = std::fs::read_to_string(&cfg_path).expect("read config");
    let edit = |f: &dyn Fn(&mut serde_json::Value)| {
        let mut doc: serde_json::Value = serde_json::from_str(&original).expect("json");
        f(&mut doc);
        std::fs::write(&cfg_path, doc.to_string()).expect("write");
    };
    // Block 0 declared full attention: its self_attn tensors are missing.
    edit(&|d| d["text_config"]["layer_types"][0] = "full_attention".into());
    match ReferenceTarget::load(&dir, CAPTURE, 500) {
        Err(TestkitError::MissingTensor { name }) => {
            assert_eq!(
                name,
                "model.language_model.layers.0.self_attn.q_proj.weight"
            )
        }
        other => panic!("expected MissingTensor, got {other:?}"),
    }
    edit(&|d| d["text_config"]["intermediate_size"] = 96.into());
    match ReferenceTarget::load(&dir, CAPTURE, 500) {
        Err(TestkitError::TensorShape {
            name,
            expected,
            found,
        }) => {
            assert_eq!(name, "model.language_model.layers.0.mlp.gate_proj.weight");
            assert_eq!(expected, vec![96, 64]);
            assert_eq!(found, vec![128, 64]);
        }
        other => panic!("expected TensorShape, got {other:?}"),
    }
    edit(&|d| d["text_config"]["hidden_act"] = "gelu".into());
    assert!(matches!(
        ReferenceTarget::load(&dir, CAPTURE, 500),
        Err(TestkitError::Config { field, .. }) if field == "text_config.hidden_act"
    ));
    edit(&|d| d["text_config"]["layer_types"][2] = "sliding_attention".into());
    assert!(matches!(
        ReferenceTarget::load(&dir, CAPTURE, 500),
        Err(TestkitError::Config { field, .. }) if field == "text_config.layer_types[2]"
    ));
    edit(&|_| {});
    for (ids, public) in [
        (&[8usize][..], 500),
        (&[1, 1][..], 500),
        (&[][..], 500),
        (CAPTURE, 513),
    ] {
        assert!(
            matches!(
                ReferenceTarget::load(&dir, ids, public),
                Err(TestkitError::Config { .. })
            ),
            "capture {ids:?} public {public}"
        );
    }
    ReferenceTarget::load(&dir, CAPTURE, 500).expect("restored config loads");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The writer is deterministic in its seed, and its config and tokenizer read as a Qwen3.5
/// target's through `dflash-config`.
#[test]
fn fixtures_are_deterministic_and_read_as_a_qwen35_target() {
    let a = fixture_dir("det-a", 5);
    let b = fixture_dir("det-b", 5);
    let c = fixture_dir("det-c", 6);
    let read = |d: &PathBuf, f: &str| std::fs::read(d.join(f)).expect("read");
    assert_eq!(read(&a, "model.safetensors"), read(&b, "model.safetensors"));
    assert_ne!(read(&a, "model.safetensors"), read(&c, "model.safetensors"));
    let cfg = String::from_utf8(read(&a, "config.json")).expect("utf8");
    let tok = String::from_utf8(read(&a, "tokenizer.json")).expect("utf8");
    let tc = dflash_config::TargetTextConfig::from_json_str(&cfg)
        .expect("target config")
        .with_tokenizer_json(&tok)
        .expect("tokenizer");
    assert_eq!(tc.hidden_size, 64);
    assert_eq!(tc.num_hidden_layers, 8);
    assert_eq!(tc.vocab_size, 512);
    assert_eq!(tc.public_vocab_size().expect("public"), 500);
    for d in [a, b, c] {
        let _ = std::fs::remove_dir_all(d);
    }
}
