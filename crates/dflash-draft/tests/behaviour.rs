//! Behaviour of the block forward: W-dependence, the anchor not sampled, chunked prefill,
//! batching independence, proposal extents, role binding and refusals.

mod common;

use common::{fixture, req};
use dflash_draft::synthetic::TinySpec;
use dflash_draft::{BindOptions, DraftError, RoleBinding, Workspace};

/// Changing K changes W and, through non-causal attention, every column: the K=3 block must
/// not be assumed to be a prefix of the K=5 block. The mask hidden of column 0 differs
/// between the two widths (so the block is recomputed), and the test reports whether the
/// first proposal differs too.
#[test]
fn changing_k_recomputes_the_whole_block() {
    let f = fixture(TinySpec::dflash(), 51, "wdep");
    let mut store = f.store(1, 64);
    let h = f.admit(&mut store, 5, 300);
    let (a, ha) = f.round(&store, &[req(h, 4, 3, 0.0, 1)], 1, 3);
    let (b, hb) = f.round(&store, &[req(h, 4, 5, 0.0, 1)], 1, 5);
    let hid = f.spec.hidden as usize;
    assert_ne!(
        &ha[..hid],
        &hb[..hid],
        "column F+1's hidden must depend on the block width"
    );
    assert_eq!(a[0].tokens.len(), 3);
    assert_eq!(b[0].tokens.len(), 5);
}

/// Scanning seeds for a fixture where K = 3 and K = 5 differ in the FIRST proposal: this is
/// what "no prefix stability" means, and the forward must produce it.
#[test]
fn a_fixture_exists_where_the_first_proposal_depends_on_k() {
    let f = fixture(TinySpec::dflash(), 52, "wdep2");
    let mut store = f.store(1, 64);
    let h = f.admit(&mut store, 6, 301);
    let mut found = false;
    for anchor in 0..72u32 {
        let (a, _) = f.round(&store, &[req(h, anchor, 3, 0.0, 1)], 1, 3);
        let (b, _) = f.round(&store, &[req(h, anchor, 5, 0.0, 1)], 1, 5);
        if a[0].tokens[0] != b[0].tokens[0] {
            found = true;
            break;
        }
    }
    assert!(found, "no anchor gave a K-dependent first proposal");
}

/// The anchor column is never sampled: the outputs have K entries (mask columns only), and
/// the mask hidden is unchanged if only the anchor column's head row were different; here we
/// check that changing the anchor changes the proposals through conditioning, while the
/// proposal count stays K and no entry is the anchor column's own prediction slot.
#[test]
fn anchor_conditions_but_is_not_sampled() {
    let f = fixture(TinySpec::dflash2(), 53, "anchor");
    let mut store = f.store(1, 64);
    let h = f.admit(&mut store, 7, 302);
    let k = 4;
    let (a, ha) = f.round(&store, &[req(h, 3, k, 0.0, 1)], 1, k);
    let (b, hb) = f.round(&store, &[req(h, 50, k, 0.0, 1)], 1, k);
    assert_eq!(a[0].tokens.len(), k);
    assert_eq!(a[0].q.len(), k * 16);
    assert_eq!(
        ha.len(),
        k * f.spec.hidden as usize,
        "mask hidden has K columns, no anchor"
    );
    assert_ne!(ha, hb, "the anchor conditions the block");
    let _ = b;
}

/// The mask hidden equals the final norm of the block's columns 1..=K: with K = 1 the
/// single proposal comes from column 1 (position F+1), and its hidden differs from what the
/// anchor column would give (checked against a block whose anchor equals the mask token:
/// then columns 0 and 1 get the same input; non-causal attention still differs by position).
#[test]
fn single_proposal_uses_the_mask_column() {
    let f = fixture(TinySpec::dflash(), 54, "k1");
    let mut store = f.store(1, 64);
    let h = f.admit(&mut store, 4, 303);
    let (out, mh) = f.round(&store, &[req(h, 9, 1, 0.0, 1)], 1, 1);
    assert_eq!(out[0].tokens.len(), 1);
    assert_eq!(mh.len(), f.spec.hidden as usize);
    assert!(
        (0..72).contains(&out[0].tokens[0]),
        "proposal is a public id"
    );
}

#[test]
fn context_is_identical_whether_prefilled_at_once_or_in_chunks() {
    for spec in [TinySpec::dflash(), TinySpec::dflash2()] {
        let f = fixture(spec, 55, "chunks");
        let mut store = f.store(2, 64);
        let feats = f.features(13, 304);
        let whole = store.admit(64).expect("admit");
        f.model
            .prefill(&mut store, whole, f.be.upload(&feats).expect("up"))
            .expect("prefill");
        let parts = store.admit(64).expect("admit");
        let fw = f.g.feature_width as usize;
        for (a, b) in [(0, 2), (2, 9), (9, 10), (10, 13)] {
            let chunk = f.be.upload(&feats[a * fw..b * fw]).expect("up");
            f.model
                .prefill(&mut store, parts, chunk)
                .expect("prefill chunk");
        }
        for l in 0..f.g.layers.len() {
            let x = store.read_window(whole, l).expect("window");
            let y = store.read_window(parts, l).expect("window");
            assert_eq!(x, y, "layer {l}");
            assert!(x.k.iter().any(|v| v.to_f32() != 0.0));
        }
        let (pa, ha) = f.round(&store, &[req(whole, 2, 3, 0.0, 1)], 1, 3);
        let (pb, hb) = f.round(&store, &[req(parts, 2, 3, 0.0, 1)], 1, 3);
        assert_eq!(pa, pb);
        assert_eq!(ha, hb);
    }
}

/// A row's results depend only on its own request: not on the other rows, its row index,
/// or padding rows of a larger workspace.
#[test]
fn rows_are_independent_of_batch_neighbours_and_row_index() {
    for spec in [TinySpec::dflash(), TinySpec::dflash2()] {
        let f = fixture(spec, 56, "batch");
        let mut store = f.store(3, 64);
        let h0 = f.admit(&mut store, 8, 305);
        let h1 = f.admit(&mut store, 3, 306);
        let h2 = f.admit(&mut store, 11, 307);
        let r0 = req(h0, 5, 4, 0.0, 11);
        let r1 = req(h1, 6, 2, 0.7, 12);
        let r2 = req(h2, 70, 4, 1.3, 13);
        let k = 4;
        let hid = k * f.spec.hidden as usize;
        let (all, hall) = f.round(&store, &[r0, r1, r2], 3, k);
        let (perm, hperm) = f.round(&store, &[r2, r0, r1], 3, k);
        assert_eq!(all[0], perm[1]);
        assert_eq!(all[1], perm[2]);
        assert_eq!(all[2], perm[0]);
        assert_eq!(&hall[..hid], &hperm[hid..2 * hid]);
        for (i, r) in [r0, r1, r2].into_iter().enumerate() {
            let (alone, ha) = f.round(&store, &[r], 1, k);
            assert_eq!(alone[0], all[i], "row {i} alone");
            assert_eq!(&ha[..], &hall[i * hid..(i + 1) * hid]);
            let (padded, hp) = f.round(&store, &[r], 3, k);
            assert_eq!(padded.len(), 1, "padding rows are not reported");
            assert_eq!(padded[0], all[i], "row {i} in a padded workspace");
            assert_eq!(&hp[..], &hall[i * hid..(i + 1) * hid]);
        }
    }
}

/// DFlash attends only the P + 1 live columns: the first P proposals do not depend on the
/// dead columns, so a tail with P < K gives a block that differs from the P = K block;
/// DFlash2 computes all W columns whatever P is.
#[test]
fn proposal_extents_follow_the_specification_table() {
    let f = fixture(TinySpec::dflash(), 57, "extent1");
    let mut store = f.store(1, 64);
    let h = f.admit(&mut store, 6, 308);
    let (_, full) = f.round(&store, &[req(h, 1, 4, 0.0, 1)], 1, 4);
    let (tail, part) = f.round(&store, &[req(h, 1, 1, 0.0, 1)], 1, 4);
    assert_eq!(tail[0].usable, 1);
    assert_ne!(full, part, "DFlash: fewer live columns change the block");

    let f = fixture(TinySpec::dflash2(), 58, "extent2");
    let mut store = f.store(1, 64);
    let h = f.admit(&mut store, 6, 309);
    let (a, ha) = f.round(&store, &[req(h, 1, 4, 0.0, 1)], 1, 4);
    let (b, hb) = f.round(&store, &[req(h, 1, 0, 0.0, 1)], 1, 4);
    assert_eq!(ha, hb, "DFlash2 computes all W columns whatever P is");
    assert_eq!(a[0].tokens, b[0].tokens);
    assert_eq!(b[0].usable, 0);
}

#[test]
fn separate_context_role_binding_computes_the_same_context() {
    let dir = common::temp_dir("roles");
    let spec = TinySpec::dflash();
    let (cfg, target) = dflash_draft::synthetic::tiny_pair(&spec);
    dflash_draft::synthetic::write_checkpoint(
        &dir,
        &cfg,
        &target,
        59,
        dflash_draft::synthetic::Layout::Single,
    )
    .expect("write");
    let be = dflash_ops::Backend::cpu();
    let shared =
        dflash_draft::DraftModel::load(&be, &dir, &target, &BindOptions::default()).expect("load");
    let sep = dflash_draft::DraftModel::load(
        &be,
        &dir,
        &target,
        &BindOptions {
            context_kv: RoleBinding::Separate,
        },
    )
    .expect("load");
    assert!(shared.weights().layers[0].context_kv.is_none());
    assert!(sep.weights().layers[0].context_kv.is_some());
    let feats = dflash_draft::synthetic::features(9, 64, 1);
    let mut windows = Vec::new();
    for m in [&shared, &sep] {
        let mut store = dflash_context::ContextStore::new(
            be.clone(),
            m.context_geometry().expect("g"),
            dflash_context::Capacity::new(1, 32, 4),
        )
        .expect("store");
        let h = store.admit(32).expect("admit");
        m.prefill(&mut store, h, be.upload(&feats).expect("up"))
            .expect("prefill");
        windows.push((
            store.read_window(h, 0).expect("w"),
            store.read_window(h, 1).expect("w"),
        ));
    }
    assert_eq!(windows[0], windows[1]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn stage_refuses_bad_rows_and_leaves_nothing_staged() {
    let f = fixture(TinySpec::dflash(), 60, "refuse");
    let mut store = f.store(2, 64);
    let h = f.admit(&mut store, 4, 310);
    let mut ws = Workspace::new(&f.model, &store, &f.ws_spec(2, 3)).expect("ws");
    let cases = [
        (vec![req(h, 80, 3, 0.0, 1)], "anchor"),
        (vec![req(h, 1, 4, 0.0, 1)], "usable"),
        (vec![req(h, 1, 3, f32::NAN, 1)], "temperature"),
        (vec![req(h, 1, 3, -1.0, 1)], "temperature"),
        (vec![req(h, 1, 3, f32::INFINITY, 1)], "temperature"),
        (vec![req(h, 1, 3, 0.0, 1), req(h, 1, 3, 0.0, 1)], "handle"),
    ];
    for (rows, field) in cases {
        match f.model.stage(&store, &rows, &mut ws) {
            Err(DraftError::Row { field: got, .. }) => assert_eq!(got, field),
            other => panic!("{field}: {other:?}"),
        }
        assert_eq!(ws.staged_rows(), 0);
    }
    assert!(f.model.stage(&store, &[], &mut ws).is_err());
    let h2 = store.admit(64).expect("admit");
    let x = f.be.upload(&f.features(2, 1)).expect("up");
    store.push_pending(h2, 0, &x, 2).expect("push");
    assert!(matches!(
        f.model.stage(&store, &[req(h2, 1, 1, 0.0, 1)], &mut ws),
        Err(DraftError::Row {
            field: "handle",
            ..
        })
    ));
    // Running without staging is refused too.
    assert!(f.model.run_block(&store, &f.parts(), &mut ws).is_err());
}

#[test]
fn target_parts_of_the_wrong_shape_are_refused() {
    let f = fixture(TinySpec::dflash(), 61, "parts");
    let mut store = f.store(1, 64);
    let h = f.admit(&mut store, 3, 311);
    let mut ws = Workspace::new(&f.model, &store, &f.ws_spec(1, 2)).expect("ws");
    f.model
        .stage(&store, &[req(h, 1, 2, 0.0, 1)], &mut ws)
        .expect("stage");
    let short = f.be.upload(&f.host.embedding[..32 * 79]).expect("up");
    let mut parts = f.parts();
    parts.embedding = &short;
    assert!(matches!(
        f.model.run_block(&store, &parts, &mut ws),
        Err(DraftError::TargetPart {
            part: "embedding",
            ..
        })
    ));
    let mut parts = f.parts();
    parts.public_vocab = 81;
    assert!(matches!(
        f.model.run_block(&store, &parts, &mut ws),
        Err(DraftError::TargetPart {
            part: "public_vocab",
            ..
        })
    ));
    // An indexed head where the workspace planned a full head.
    let rows = f.be.upload(&f.host.output_head[..32 * 20]).expect("up");
    let ids = f.be.upload(&(0..20).collect::<Vec<i32>>()).expect("up");
    let mut parts = f.parts();
    parts.head = dflash_draft::HeadParts::Indexed {
        rows: &rows,
        token_ids: &ids,
    };
    assert!(matches!(
        f.model.run_block(&store, &parts, &mut ws),
        Err(DraftError::TargetPart { part: "head", .. })
    ));
}

#[test]
fn indexed_head_remaps_shortlist_rows_to_global_ids() {
    let f = fixture(TinySpec::dflash(), 62, "indexed");
    let mut store = f.store(1, 64);
    let h = f.admit(&mut store, 5, 312);
    let (rows, ids) = dflash_draft::synthetic::shortlist(&f.host.output_head, 32, 72, 20, 3);
    let rows_b = f.be.upload(&rows).expect("up");
    let ids_b = f.be.upload(&ids).expect("up");
    let mut spec = f.ws_spec(1, 4);
    spec.head = dflash_draft::HeadShape {
        kind: dflash_ops::proposal_argmax::ProposalHead::Indexed,
        rows: 20,
        public_vocab: 72,
    };
    let mut ws = Workspace::new(&f.model, &store, &spec).expect("ws");
    let mut parts = f.parts();
    parts.head = dflash_draft::HeadParts::Indexed {
        rows: &rows_b,
        token_ids: &ids_b,
    };
    let out = f
        .model
        .propose(&store, &[req(h, 2, 4, 0.0, 1)], &parts, &mut ws)
        .expect("propose");
    let mh = ws.read_mask_hidden().expect("mh");
    for (i, &t) in out[0].tokens.iter().enumerate() {
        assert!(ids.contains(&t), "proposal {t} is a shortlist id");
        // Recompute the indexed argmax from the mask hidden (f64 over the shortlist rows).
        let hcol = &mh[i * 32..(i + 1) * 32];
        let best = (0..20)
            .map(|r| {
                let s: f64 = (0..32)
                    .map(|c| f64::from(rows[r * 32 + c].to_f32()) * f64::from(hcol[c]))
                    .sum();
                (s, ids[r])
            })
            .max_by(|a, b| a.0.total_cmp(&b.0).then(b.1.cmp(&a.1)))
            .map(|x| x.1);
        assert_eq!(Some(t), best);
    }
}

/// A round of n requests computes n rows on a workspace planned for more (its buffers are
/// resized in place, no allocation), padded rounds (a graph bucket) report the same
/// proposals, and the workspace goes back and forth between row counts.
#[test]
fn live_rows_compute_only_the_requests_and_match_padded_rounds() {
    for (spec, seed) in [(TinySpec::dflash(), 70), (TinySpec::dflash2(), 71)] {
        let f = fixture(spec, seed, "live-rows");
        let mut store = f.store(4, 64);
        let hs: Vec<_> = (0..3)
            .map(|i| f.admit(&mut store, 3 + 2 * i, 400 + i as u64))
            .collect();
        let rows: Vec<_> = hs
            .iter()
            .enumerate()
            .map(|(i, &h)| req(h, 1 + i as u32, 3 - i, 0.7 * i as f32, 9 + i as u64))
            .collect();
        let mut ws = Workspace::new(&f.model, &store, &f.ws_spec(4, 3)).expect("ws");
        assert_eq!(ws.physical_rows(), 4);
        let allocations = f.be.allocations();
        let mut by_count = Vec::new();
        for n in [1, 3, 2, 1, 3] {
            let out = f
                .model
                .propose(&store, &rows[..n], &f.parts(), &mut ws)
                .expect("propose");
            assert_eq!(ws.physical_rows(), n, "{n} requests compute {n} rows");
            assert_eq!(out.len(), n);
            let padded = {
                f.model
                    .stage_padded(&store, &rows[..n], 4, &mut ws)
                    .expect("stage padded");
                assert_eq!(ws.physical_rows(), 4);
                f.model.run_block(&store, &f.parts(), &mut ws).expect("run");
                ws.read().expect("read")
            };
            assert_eq!(out, padded, "{n} requests: exact rows vs a bucket of 4");
            by_count.push((n, out));
        }
        assert_eq!(
            f.be.allocations(),
            allocations,
            "resizing allocates nothing"
        );
        // Each request's proposal does not depend on how many rows ran beside it.
        for (n, out) in &by_count {
            for (r, p) in out.iter().enumerate() {
                let (_, full) = by_count.iter().find(|(m, _)| *m == 3).expect("3 rows");
                assert_eq!(p, &full[r], "row {r} of a {n}-row round");
            }
        }
        // Physical rows outside requests..=workspace rows are refused and change nothing.
        for bad in [1, 5] {
            assert!(matches!(
                f.model.stage_padded(&store, &rows[..2], bad, &mut ws),
                Err(DraftError::Invalid { .. })
            ));
            assert_eq!(ws.physical_rows(), 4);
            assert_eq!(ws.staged_rows(), 3, "the last good stage stays staged");
        }
    }
}
