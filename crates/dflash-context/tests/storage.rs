//! Sizes of the official geometries, materialize against the per-position oracle, images,
//! batch metadata, every misuse with its typed error (state unchanged), and no leaks.

mod common;

use common::{
    Rng, Snapshot, Weights, feature_rows, oracle_kv, oracle_kv_rows, snapshot, tiny_capacity,
    tiny_geometry_rings_only, tiny_geometry_with_full,
};
use dflash_config::{DraftConfig, ParseMode, TargetTextConfig, examples, validate_pair};
use dflash_context::{
    Capacity, ContextError, ContextGeometry, ContextLayerKind, ContextStore, LayerPool, NO_PAGE,
};
use dflash_ops::{Backend, bf16};

fn official(draft: &str, target: &str) -> dflash_config::Geometry {
    let d = DraftConfig::from_json_str(draft, ParseMode::Strict).expect("draft");
    let t = TargetTextConfig::from_json_str(target).expect("target");
    validate_pair(&d.value, &t).expect("pair")
}

#[test]
fn ring_image_is_40_mib_for_official_dflash2() {
    let cfg = official(
        examples::OFFICIAL_27B_DFLASH2_DRAFT,
        examples::QWEN35_27B_TARGET,
    );
    let g = ContextGeometry::from_config(&cfg).expect("geometry");
    assert_eq!(g.layers, vec![ContextLayerKind::Local { window: 2048 }; 5]);
    assert!(!g.has_full_layers(), "official DFlash2 has no full pool");
    assert_eq!(g.ring_image_bytes(), 5 * (2 + 2) * 8 * 128 * 2048);
    assert_eq!(g.ring_image_bytes(), 41_943_040);
    assert_eq!(g.ring_image_bytes(), 40 << 20);
    assert_eq!(
        g.ring_image_bytes(),
        cfg.ring_image_bytes,
        "agrees with dflash-config"
    );
    assert_eq!(g.full_image_bytes_per_position(), 0);
    // Once the context fills the ring, the image is the whole ring, whatever the length.
    assert_eq!(g.image_bytes(2048), 40 << 20);
    assert_eq!(g.image_bytes(1_000_000), 40 << 20);
    // Before that, only the live slots travel.
    assert_eq!(g.image_bytes(100), 5 * 4 * 8 * 128 * 100);
    assert_eq!(g.image_bytes(0), 0);
    assert_eq!(g.feature_width(), 5 * 5120);
    // Pools for B = 8 (K plays no part in any storage size).
    let cap = Capacity::new(8, 1 << 20, 16);
    let bytes = cap.pool_bytes(&g);
    assert_eq!(bytes.rings, 8 * (40 << 20));
    assert_eq!((bytes.paged, bytes.page_table), (0, 0));
    assert_eq!(cap.context_limit(&g), i32::MAX as usize);
}

#[test]
fn official_35b_dflash_has_rings_and_a_full_pool() {
    let cfg = official(
        examples::OFFICIAL_35B_DFLASH_DRAFT,
        examples::QWEN35_35B_A3B_TARGET,
    );
    let g = ContextGeometry::from_config(&cfg).expect("geometry");
    let mut want = vec![ContextLayerKind::Local { window: 4096 }; 5];
    want.push(ContextLayerKind::Full);
    assert_eq!(g.layers, want);
    assert!(g.has_full_layers());
    assert_eq!(g.ring_image_bytes(), 5 * 4 * 8 * 128 * 4096);
    assert_eq!(g.ring_image_bytes(), 80 << 20);
    assert_eq!(
        g.ring_image_bytes(),
        cfg.ring_image_bytes,
        "agrees with dflash-config"
    );
    assert_eq!(g.full_image_bytes_per_position(), 4 * 8 * 128);
    assert_eq!(g.image_bytes(10_000), (80 << 20) + 10_000 * 4096);
    assert_eq!(g.image_bytes(1000), 6 * 1000 * 4096);
    let cap = Capacity::new(8, 32_768, 16);
    assert_eq!(cap.max_pages_per_lane, 2048);
    assert_eq!(cap.pages, 8 * 2048);
    let bytes = cap.pool_bytes(&g);
    assert_eq!(bytes.rings, 8 * (80 << 20));
    assert_eq!(bytes.paged, 8 * 32_768 * 4096);
    assert_eq!(bytes.page_table, 8 * 2048 * 4);
    assert_eq!(cap.context_limit(&g), 32_768);
}

#[test]
fn official_dflash2_store_allocates_exactly_its_rings() {
    let cfg = official(
        examples::OFFICIAL_27B_DFLASH2_DRAFT,
        examples::QWEN35_27B_TARGET,
    );
    let g = ContextGeometry::from_config(&cfg).expect("geometry");
    let store = ContextStore::new(Backend::cpu(), g, Capacity::new(1, 1 << 16, 16)).expect("store");
    let mut ring_bytes = 0;
    for l in 0..5 {
        match store.layer(l).expect("layer") {
            LayerPool::Ring {
                k,
                v,
                lanes,
                window,
            } => {
                assert_eq!((lanes, window), (1, 2048));
                assert_eq!(k.len(), 2048 * 8 * 128);
                assert_eq!(v.len(), 2048 * 8 * 128);
                ring_bytes += 2 * (k.len() + v.len());
            }
            LayerPool::Paged { .. } => panic!("no full layer in DFlash2"),
        }
    }
    assert_eq!(
        ring_bytes,
        40 << 20,
        "one lane's rings are exactly one image"
    );
    assert!(store.page_table().is_none(), "no full pool, no page table");
    assert_eq!(store.free_pages(), 0);
}

fn tiny_store(full: bool, chunk: usize) -> (ContextStore, Weights) {
    let be = Backend::cpu();
    let g = if full {
        tiny_geometry_with_full()
    } else {
        tiny_geometry_rings_only()
    };
    let w = Weights::random(&be, &g, 7);
    let s = ContextStore::new(be, g, tiny_capacity(chunk)).expect("store");
    (s, w)
}

/// Positions `0..n` of a stream of feature rows and their oracle K/V.
fn stream(
    store: &ContextStore,
    w: &Weights,
    seed: u64,
    n: usize,
) -> (Vec<bf16>, Vec<Vec<common::PosKv>>) {
    let g = store.geometry();
    let rows = feature_rows(&mut Rng(seed), g, n);
    let fw = g.feature_width();
    let kv = (0..n)
        .map(|p| oracle_kv(store.backend(), g, w, &rows[p * fw..(p + 1) * fw], p))
        .collect();
    (rows, kv)
}

/// The live window of every layer equals the oracle, and the positions just outside are
/// unreachable.
fn assert_matches(
    store: &ContextStore,
    h: dflash_context::ContextHandle,
    kv: &[Vec<common::PosKv>],
) {
    let f = store.frontier(h).expect("frontier");
    for (l, kind) in store.geometry().layers.iter().enumerate() {
        let start = match kind {
            ContextLayerKind::Local { window } => f.saturating_sub(*window),
            ContextLayerKind::Full => 0,
        };
        let win = store.read_window(h, l).expect("window");
        assert_eq!((win.start, win.end), (start, f), "layer {l}");
        let kvw = store.geometry().kv_width();
        for (p, pkv) in kv.iter().enumerate().take(f).skip(start) {
            let i = (p - start) * kvw;
            assert_eq!(win.k[i..i + kvw], pkv[l].0[..], "layer {l} K at {p}");
            assert_eq!(win.v[i..i + kvw], pkv[l].1[..], "layer {l} V at {p}");
        }
        assert!(matches!(
            store.read_position(h, l, f),
            Err(ContextError::DeadPosition { .. })
        ));
        if start > 0 {
            assert!(matches!(
                store.read_position(h, l, start - 1),
                Err(ContextError::DeadPosition { .. })
            ));
        }
    }
}

#[test]
fn the_batched_oracle_agrees_with_one_position_calls() {
    let (store, w) = tiny_store(true, 1);
    let (rows, kv) = stream(&store, &w, 8, 13);
    assert_eq!(
        oracle_kv_rows(store.backend(), store.geometry(), &w, &rows, 0),
        kv
    );
    // Shifted start: same rows at positions 5.. give the RoPE of those positions.
    let fw = store.geometry().feature_width();
    let shifted = oracle_kv_rows(store.backend(), store.geometry(), &w, &rows[5 * fw..], 5);
    assert_eq!(shifted[..], kv[5..]);
}

#[test]
fn prefill_longer_than_the_ring_keeps_its_final_window_and_advances_the_frontier() {
    for (full, chunk) in [
        (true, 2048),
        (true, 3),
        (false, 2048),
        (false, 5),
        (true, 1),
    ] {
        let (mut store, w) = tiny_store(full, chunk);
        let (rows, kv) = stream(&store, &w, 11, 40);
        let be = store.backend().clone();
        let h = store.admit(60).expect("admit");
        store
            .push_pending_owned(h, 0, be.upload(&rows[..37 * 64]).expect("up"))
            .expect("prefill");
        assert_eq!(store.frontier(h).expect("f"), 0);
        assert_eq!(store.pending_target_frontier(h).expect("ptf"), 37);
        store.materialize(h, &w.view()).expect("materialize");
        assert_eq!(store.frontier(h).expect("f"), 37, "whole chunk counted");
        assert_eq!(store.pending(h).expect("p"), 0);
        assert_matches(&store, h, &kv);
        // Then a round-sized commit of 3 from a 5-column capture.
        let cap = be.upload(&rows[37 * 64..40 * 64]).expect("up");
        store.push_pending(h, 37, &cap, 3).expect("push");
        store.materialize(h, &w.view()).expect("materialize");
        assert_eq!(store.frontier(h).expect("f"), 40);
        assert_matches(&store, h, &kv);
    }
}

#[test]
fn chunking_does_not_change_a_single_live_byte() {
    let (rows_a, _) = {
        let (s, w) = tiny_store(true, 2048);
        stream(&s, &w, 5, 30)
    };
    let mut windows = Vec::new();
    for chunk in [1, 2, 7, 2048] {
        let (mut store, w) = tiny_store(true, chunk);
        let be = store.backend().clone();
        let h = store.admit(30).expect("admit");
        // Several pushes of uneven sizes, materialized at once.
        let mut at = 0;
        for n in [4, 9, 1, 16] {
            let buf = be.upload(&rows_a[at * 64..(at + n) * 64]).expect("up");
            store.push_pending(h, at, &buf, n).expect("push");
            at += n;
        }
        store.materialize(h, &w.view()).expect("materialize");
        windows.push(
            (0..3)
                .map(|l| store.read_window(h, l).expect("window"))
                .collect::<Vec<_>>(),
        );
    }
    for w in &windows[1..] {
        assert_eq!(w, &windows[0]);
    }
}

#[test]
fn checkpoint_fork_replica_and_restore_carry_exactly_the_live_context() {
    let (mut store, w) = tiny_store(true, 4);
    let (rows, kv) = stream(&store, &w, 3, 21);
    let be = store.backend().clone();
    let h = store.admit(40).expect("admit");
    store
        .push_pending_owned(h, 0, be.upload(&rows[..21 * 64]).expect("up"))
        .expect("push");
    store.materialize(h, &w.view()).expect("materialize");
    let g = store.geometry().clone();
    let image = store.checkpoint(h).expect("checkpoint");
    let host = store.host_replica(h).expect("host");
    assert_eq!(image.frontier(), 21);
    assert_eq!(host.frontier(), 21);
    assert_eq!(image.payload_bytes(), g.image_bytes(21));
    assert_eq!(image.payload_bytes(), 4 * 16 * (8 + 21 + 16));
    assert_eq!(image.to_host(&be).expect("to host"), host);
    // Ring payload in slot order: slot s holds the live position p with p mod S = s.
    let (k0, _) = host.layer(0).expect("layer 0");
    for s in 0..8 {
        let p = (13..21).find(|p| p % 8 == s).expect("live");
        assert_eq!(k0[s * 16..(s + 1) * 16], kv[p][0].0[..]);
    }
    // Fork: same bytes, own lane, own pages.
    let f = store.fork(h).expect("fork");
    assert_ne!(f.lane(), h.lane());
    assert_eq!(store.frontier(f).expect("f"), 21);
    assert_eq!(store.max_context(f).expect("m"), 40);
    assert!(
        store
            .pages(f)
            .expect("p")
            .iter()
            .all(|p| !store.pages(h).expect("p").contains(p))
    );
    assert_matches(&store, f, &kv);
    // Restore the device image into a fresh admission and the host image into another.
    store.release(h).expect("release");
    let r1 = store
        .admit_restored(24, &image, 21)
        .expect("restore device");
    assert_matches(&store, r1, &kv);
    store.release(f).expect("release");
    let r2 = store
        .admit_restored_host(21, &host, 21)
        .expect("restore host");
    assert_matches(&store, r2, &kv);
    // Restoring an older image over a longer context rewinds the coverage.
    let (rows2, kv2) = stream(&store, &w, 99, 5);
    let short = {
        store.release(r2).expect("release");
        let h3 = store.admit(40).expect("admit");
        store
            .push_pending_owned(h3, 0, be.upload(&rows2).expect("up"))
            .expect("push");
        store.materialize(h3, &w.view()).expect("materialize");
        let img = store.host_replica(h3).expect("img");
        store.release(h3).expect("release");
        img
    };
    store.restore_host(r1, &short, 5).expect("rewind");
    assert_eq!(store.frontier(r1).expect("f"), 5);
    assert_matches(&store, r1, &kv2);
}

#[test]
fn batch_metadata_lists_lanes_frontiers_and_page_rows_in_batch_order() {
    let (mut store, w) = tiny_store(true, 2048);
    let be = store.backend().clone();
    let a = store.admit(8).expect("a");
    let b = store.admit(20).expect("b");
    let (rows, _) = stream(&store, &w, 1, 6);
    store
        .push_pending(b, 0, &be.upload(&rows).expect("up"), 6)
        .expect("push");
    store.materialize(b, &w.view()).expect("materialize");
    let meta = store.batch_metadata(&[b, a]).expect("meta");
    assert_eq!(meta.rows, 2);
    assert_eq!(
        be.download(&meta.lanes).expect("l"),
        vec![b.lane() as i32, a.lane() as i32]
    );
    assert_eq!(be.download(&meta.frontiers).expect("f"), vec![6, 0]);
    let table = be
        .download(meta.page_table.as_ref().expect("table"))
        .expect("t");
    let mut want = Vec::new();
    for h in [b, a] {
        let mut row = store.pages(h).expect("pages").to_vec();
        row.resize(16, NO_PAGE);
        want.extend(row);
    }
    assert_eq!(table, want);
    assert_eq!(store.pages(a).expect("p").len(), 2);
    assert_eq!(store.pages(b).expect("p").len(), 5);
    // The store's own table has the same rows, indexed by lane.
    let own = be.download(store.page_table().expect("t")).expect("t");
    assert_eq!(own[b.lane() * 16..b.lane() * 16 + 16], want[..16]);
    // In-place rewrite with a new order.
    let mut meta = meta;
    store
        .write_batch_metadata(&[a, b], &mut meta)
        .expect("rewrite");
    assert_eq!(be.download(&meta.frontiers).expect("f"), vec![0, 6]);
}

/// Run `f` (which must fail with an error `check` accepts) and prove the store is unchanged.
fn refused(
    store: &mut ContextStore,
    what: &str,
    f: impl FnOnce(&mut ContextStore) -> Result<(), ContextError>,
    check: impl FnOnce(&ContextError) -> bool,
) {
    let before: Snapshot = snapshot(store);
    match f(store) {
        Ok(()) => panic!("{what}: accepted"),
        Err(e) => assert!(check(&e), "{what}: wrong error {e:?}"),
    }
    assert_eq!(snapshot(store), before, "{what}: state changed");
}

#[test]
fn every_misuse_gets_its_typed_error_and_changes_nothing() {
    use ContextError as E;
    let (mut store, w) = tiny_store(true, 2048);
    let be = store.backend().clone();
    let (rows, _) = stream(&store, &w, 2, 12);
    let a = store.admit(64).expect("a"); // 16 pages
    let b = store.admit(20).expect("b"); // 5 pages
    let up = |n: usize| be.upload(&rows[..n * 64]).expect("up");
    store.push_pending(a, 0, &up(6), 6).expect("push");
    store.materialize(a, &w.view()).expect("materialize");
    store.push_pending(a, 6, &up(4), 2).expect("push pending 2");
    let image_a = {
        store.push_pending(b, 0, &up(3), 3).expect("push");
        store.materialize(b, &w.view()).expect("m");
        store.checkpoint(b).expect("checkpoint b")
    };

    // Admission.
    refused(
        &mut store,
        "too long",
        |s| s.admit(65).map(|_| ()),
        |e| {
            matches!(
                e,
                E::ContextTooLong {
                    requested: 65,
                    limit: 64
                }
            )
        },
    );
    refused(
        &mut store,
        "pages",
        |s| s.admit(13).map(|_| ()),
        |e| matches!(e, E::InsufficientPages { needed: 4, free: 3 }),
    );
    let c = store.admit(12).expect("c");
    refused(
        &mut store,
        "lanes",
        |s| s.admit(0).map(|_| ()),
        |e| matches!(e, E::NoFreeLane { lanes: 3 }),
    );
    refused(
        &mut store,
        "fork without lane",
        |s| s.fork(b).map(|_| ()),
        |e| matches!(e, E::NoFreeLane { .. }),
    );
    store.release(c).expect("release c");

    // Stale handles (released, lane reused by a newer generation).
    let c2 = store.admit(0).expect("c2");
    assert_eq!(c2.lane(), c.lane());
    for (name, f) in [
        (
            "release",
            Box::new(move |s: &mut ContextStore| s.release(c))
                as Box<dyn FnOnce(&mut ContextStore) -> Result<(), E>>,
        ),
        (
            "push",
            Box::new(|s: &mut ContextStore| s.push_pending(c, 0, &be.zeros(64).expect("z"), 1)),
        ),
        (
            "materialize",
            Box::new(|s: &mut ContextStore| s.materialize(c, &w.view())),
        ),
        (
            "checkpoint",
            Box::new(move |s: &mut ContextStore| s.checkpoint(c).map(|_| ())),
        ),
        (
            "fork",
            Box::new(move |s: &mut ContextStore| s.fork(c).map(|_| ())),
        ),
        (
            "restore",
            Box::new(|s: &mut ContextStore| s.restore(c, &image_a, 3)),
        ),
        (
            "frontier",
            Box::new(move |s: &mut ContextStore| s.frontier(c).map(|_| ())),
        ),
        (
            "read",
            Box::new(move |s: &mut ContextStore| s.read_window(c, 0).map(|_| ())),
        ),
        (
            "batch",
            Box::new(move |s: &mut ContextStore| s.batch_metadata(&[c]).map(|_| ())),
        ),
    ] {
        refused(&mut store, name, f, |e| {
            matches!(e, E::UnknownHandle { .. })
        });
    }
    store.release(c2).expect("release c2");

    // Pushes: gap, overlap, shape, rows, overflow, backend.
    refused(
        &mut store,
        "gap",
        |s| s.push_pending(a, 9, &up(1), 1),
        |e| {
            matches!(
                e,
                E::OutOfOrder {
                    expected: 8,
                    found: 9
                }
            )
        },
    );
    refused(
        &mut store,
        "overlap",
        |s| s.push_pending(a, 6, &up(1), 1),
        |e| {
            matches!(
                e,
                E::OutOfOrder {
                    expected: 8,
                    found: 6
                }
            )
        },
    );
    refused(
        &mut store,
        "gap with n = 0",
        |s| s.push_pending(a, 3, &up(1), 0),
        |e| matches!(e, E::OutOfOrder { .. }),
    );
    refused(
        &mut store,
        "ragged",
        |s| s.push_pending(a, 8, &be.zeros(65).expect("z"), 1),
        |e| {
            matches!(
                e,
                E::FeatureShape {
                    width: 64,
                    len: 65,
                    rows: 1
                }
            )
        },
    );
    refused(
        &mut store,
        "too few rows",
        |s| s.push_pending(a, 8, &up(2), 3),
        |e| matches!(e, E::FeatureShape { rows: 3, .. }),
    );
    refused(
        &mut store,
        "overflow",
        |s| s.push_pending_owned(b, 3, be.zeros(18 * 64).expect("z")),
        |e| {
            matches!(
                e,
                E::ContextOverflow {
                    end: 21,
                    max_context: 20
                }
            )
        },
    );
    // N = 0 at the right place: accepted, nothing changes.
    let before = snapshot(&store);
    store.push_pending(a, 8, &up(2), 0).expect("n = 0");
    store
        .push_pending_owned(a, 8, be.zeros(0).expect("z"))
        .expect("empty owned");
    assert_eq!(snapshot(&store), before, "N = 0 commits nothing");

    // Images need materialized context; coverage must agree.
    refused(
        &mut store,
        "checkpoint pending",
        |s| s.checkpoint(a).map(|_| ()),
        |e| matches!(e, E::PendingFeatures { pending: 2 }),
    );
    refused(
        &mut store,
        "replica pending",
        |s| s.host_replica(a).map(|_| ()),
        |e| matches!(e, E::PendingFeatures { pending: 2 }),
    );
    refused(
        &mut store,
        "fork pending",
        |s| s.fork(a).map(|_| ()),
        |e| matches!(e, E::PendingFeatures { pending: 2 }),
    );
    refused(
        &mut store,
        "restore pending",
        |s| s.restore(a, &image_a, 3),
        |e| matches!(e, E::PendingFeatures { pending: 2 }),
    );
    refused(
        &mut store,
        "batch pending",
        |s| s.batch_metadata(&[a]).map(|_| ()),
        |e| matches!(e, E::PendingFeatures { pending: 2 }),
    );
    refused(
        &mut store,
        "coverage",
        |s| s.restore(b, &image_a, 4),
        |e| {
            matches!(
                e,
                E::CoverageMismatch {
                    context: 3,
                    target: 4
                }
            )
        },
    );
    refused(
        &mut store,
        "check coverage",
        |s| s.check_coverage(a, 6),
        |e| {
            matches!(
                e,
                E::CoverageMismatch {
                    context: 8,
                    target: 6
                }
            )
        },
    );
    store.check_coverage(a, 8).expect("F_ctx + pending agrees");
    refused(
        &mut store,
        "admit restored coverage",
        |s| s.admit_restored(8, &image_a, 2).map(|_| ()),
        |e| matches!(e, E::CoverageMismatch { .. }),
    );
    refused(
        &mut store,
        "admit restored too short",
        |s| s.admit_restored(2, &image_a, 3).map(|_| ()),
        |e| {
            matches!(
                e,
                E::ImageTooLong {
                    frontier: 3,
                    max_context: 2
                }
            )
        },
    );
    refused(
        &mut store,
        "admit restored too long",
        |s| s.admit_restored(100, &image_a, 3).map(|_| ()),
        |e| matches!(e, E::ContextTooLong { .. }),
    );
    refused(
        &mut store,
        "admit restored no pages",
        |s| s.admit_restored(40, &image_a, 3).map(|_| ()),
        |e| matches!(e, E::InsufficientPages { .. }),
    );
    let foreign = {
        let (mut other, ow) = tiny_store(false, 2048);
        let h = other.admit(10).expect("admit");
        other.push_pending(h, 0, &up(3), 3).expect("push");
        other.materialize(h, &ow.view()).expect("m");
        (
            other.checkpoint(h).expect("c"),
            other.host_replica(h).expect("r"),
        )
    };
    refused(
        &mut store,
        "foreign image",
        |s| s.restore(b, &foreign.0, 3),
        |e| matches!(e, E::ImageMismatch { .. }),
    );
    refused(
        &mut store,
        "foreign host image",
        |s| s.restore_host(b, &foreign.1, 3),
        |e| matches!(e, E::ImageMismatch { .. }),
    );

    // Materialize with bad weights.
    let mut bad = w.view();
    bad.layers.pop();
    refused(
        &mut store,
        "layer count",
        |s| s.materialize(a, &bad),
        |e| matches!(e, E::Weight { .. }),
    );
    let short = be.zeros::<bf16>(7).expect("z");
    let mut bad = w.view();
    bad.layers[1].key_norm = &short;
    refused(
        &mut store,
        "key norm",
        |s| s.materialize(a, &bad),
        |e| matches!(e, E::Weight { name, .. } if name == "layers[1].key_norm"),
    );
    let mut bad = w.view();
    bad.fc = &short;
    refused(
        &mut store,
        "fc",
        |s| s.materialize(a, &bad),
        |e| matches!(e, E::Weight { name, .. } if name == "fc"),
    );

    // Batches and reads.
    refused(
        &mut store,
        "duplicate",
        |s| s.batch_metadata(&[b, b]).map(|_| ()),
        |e| {
            matches!(
                e,
                E::DuplicateHandle {
                    first: 0,
                    second: 1,
                    ..
                }
            )
        },
    );
    let mut meta = store.batch_metadata(&[b]).expect("meta");
    let before_meta = be.download(&meta.lanes).expect("l");
    refused(
        &mut store,
        "rows",
        |s| s.write_batch_metadata(&[b, b], &mut meta),
        |e| {
            matches!(
                e,
                E::BatchRows {
                    capacity: 1,
                    rows: 2
                }
            )
        },
    );
    assert_eq!(be.download(&meta.lanes).expect("l"), before_meta);
    refused(
        &mut store,
        "layer",
        |s| s.read_window(b, 3).map(|_| ()),
        |e| matches!(e, E::Layer { layer: 3, .. }),
    );
    refused(
        &mut store,
        "unmaterialized position",
        |s| s.read_position(a, 1, 6).map(|_| ()),
        |e| {
            matches!(
                e,
                E::DeadPosition {
                    position: 6,
                    start: 0,
                    end: 6,
                    ..
                }
            )
        },
    );

    // The pending features survive all of that and still materialize.
    store.materialize(a, &w.view()).expect("materialize");
    assert_eq!(store.frontier(a).expect("f"), 8);
}

#[test]
fn invalid_geometry_and_capacity_are_refused() {
    let g = tiny_geometry_with_full();
    let bad = |g: ContextGeometry, c: Capacity| {
        matches!(
            ContextStore::new(Backend::cpu(), g, c),
            Err(ContextError::InvalidGeometry { .. })
        )
    };
    for lanes in [0, 9] {
        assert!(bad(
            g.clone(),
            Capacity {
                lanes,
                ..tiny_capacity(4)
            }
        ));
    }
    assert!(bad(
        g.clone(),
        Capacity {
            page_size: 0,
            ..tiny_capacity(4)
        }
    ));
    assert!(bad(
        g.clone(),
        Capacity {
            pages: 0,
            ..tiny_capacity(4)
        }
    ));
    assert!(bad(
        g.clone(),
        Capacity {
            max_pages_per_lane: 25,
            ..tiny_capacity(4)
        }
    ));
    assert!(bad(
        g.clone(),
        Capacity {
            chunk_cols: 0,
            ..tiny_capacity(4)
        }
    ));
    assert!(bad(
        ContextGeometry {
            head_dim: 7,
            ..g.clone()
        },
        tiny_capacity(4)
    ));
    assert!(bad(
        ContextGeometry {
            kv_heads: 0,
            ..g.clone()
        },
        tiny_capacity(4)
    ));
    assert!(bad(
        ContextGeometry {
            eps: f32::NAN,
            ..g.clone()
        },
        tiny_capacity(4)
    ));
    assert!(bad(
        ContextGeometry {
            layers: vec![],
            ..g.clone()
        },
        tiny_capacity(4)
    ));
    assert!(bad(
        ContextGeometry {
            layers: vec![ContextLayerKind::Local { window: 0 }],
            ..g.clone()
        },
        tiny_capacity(4)
    ));
    // Page fields are ignored without full layers.
    let rings = tiny_geometry_rings_only();
    assert!(
        ContextStore::new(
            Backend::cpu(),
            rings,
            Capacity {
                page_size: 0,
                pages: 0,
                ..tiny_capacity(4)
            }
        )
        .is_ok()
    );
    for lanes in 1..=8 {
        assert!(ContextStore::new(Backend::cpu(), g.clone(), Capacity::new(lanes, 64, 4)).is_ok());
    }
}

#[test]
fn thousands_of_admit_release_cycles_leak_nothing() {
    // Fixed seed 42: random max contexts, forks, pushes and releases.
    let (mut store, w) = tiny_store(true, 3);
    let be = store.backend().clone();
    let mut rng = Rng(42);
    let mut live = Vec::new();
    let feats = be
        .upload(&feature_rows(&mut Rng(1), store.geometry(), 4))
        .expect("up");
    for _ in 0..5000 {
        match rng.next_u64() % 4 {
            0 | 1 => {
                if let Ok(h) = store.admit((rng.next_u64() % 70) as usize) {
                    live.push(h);
                }
            }
            2 if !live.is_empty() => {
                let h = live[(rng.next_u64() % live.len() as u64) as usize];
                let at = store.pending_target_frontier(h).expect("ptf");
                let n = (rng.next_u64() % 5) as usize;
                let _ = store.push_pending(h, at, &feats, n);
                if rng.next_u64().is_multiple_of(2) {
                    store.materialize(h, &w.view()).expect("m");
                    if let Ok(f) = store.fork(h) {
                        live.push(f);
                    }
                }
            }
            _ if !live.is_empty() => {
                let i = (rng.next_u64() % live.len() as u64) as usize;
                store.release(live.swap_remove(i)).expect("release");
            }
            _ => {}
        }
        let reserved: usize = live.iter().map(|&h| store.pages(h).expect("p").len()).sum();
        assert_eq!(store.free_pages() + reserved, 24, "pages conserved");
        assert_eq!(store.free_lanes() + live.len(), 3, "lanes conserved");
    }
    for h in live.drain(..) {
        store.release(h).expect("release");
    }
    assert_eq!((store.free_lanes(), store.free_pages()), (3, 24));
    // Every page is free exactly once: one request can take 16, a second the other 8.
    let x = store.admit(64).expect("x");
    let y = store.admit(32).expect("y");
    let mut all: Vec<i32> = store.pages(x).expect("p").to_vec();
    all.extend(store.pages(y).expect("p"));
    all.sort_unstable();
    assert_eq!(all, (0..24).collect::<Vec<_>>());
    let table = be.download(store.page_table().expect("t")).expect("t");
    assert!(
        table[2 * 16..].iter().all(|&p| p == NO_PAGE),
        "free lane row is empty"
    );
}

/// A store with round staging materializes a round's pushes (at most `round_cols` rows, an
/// empty queue) through its slab and fixed-shape scratch: every live byte equals the oracle
/// and the plain store's, for rings and pages, rounds of 1 to `round_cols` rows, a push longer
/// than the slab (the general path) and two pushes before one materialize; after the first
/// round nothing is allocated. `round_cols` outside `1..=chunk_cols` is refused.
#[test]
fn round_staging_materializes_like_the_plain_store_and_allocates_nothing() {
    for full in [true, false] {
        let (plain, w) = tiny_store(full, 2048);
        let (rows, kv) = stream(&plain, &w, 11, 34);
        let be = plain.backend().clone();
        let g = plain.geometry().clone();
        let fw = g.feature_width();
        let mut staged =
            ContextStore::with_round_staging(be.clone(), g.clone(), tiny_capacity(2048), 5)
                .expect("store");
        let mut plain = plain;
        let (hs, hp) = (
            staged.admit(40).expect("admit"),
            plain.admit(40).expect("admit"),
        );
        // Prefill 3, then rounds of 5, 1, 4, 2 rows, one of 8 (past the slab), two pushes
        // (2 + 3) before one materialize, then 5 and 1.
        let schedule: [&[usize]; 9] = [&[3], &[5], &[1], &[4], &[2], &[8], &[2, 3], &[5], &[1]];
        let mut at = 0;
        let mut after_first = None;
        for (round, pushes) in schedule.iter().enumerate() {
            for &n in *pushes {
                let buf = be.upload(&rows[at * fw..(at + n) * fw]).expect("up");
                let before = be.allocations();
                staged.push_pending(hs, at, &buf, n).expect("push staged");
                if n <= 5 && staged.pending(hs).expect("pending") == n {
                    assert_eq!(be.allocations(), before, "a slab push allocates nothing");
                }
                plain.push_pending(hp, at, &buf, n).expect("push plain");
                at += n;
            }
            let before = be.allocations();
            staged
                .materialize(hs, &w.view())
                .expect("materialize staged");
            if round >= 1 && pushes.len() == 1 && pushes[0] <= 5 {
                assert_eq!(be.allocations(), before, "round {round} allocated");
                after_first.get_or_insert(round);
            }
            plain.materialize(hp, &w.view()).expect("materialize plain");
            for l in 0..g.layers.len() {
                assert_eq!(
                    staged.read_window(hs, l).expect("staged"),
                    plain.read_window(hp, l).expect("plain"),
                    "full={full} round {round} layer {l}"
                );
            }
        }
        assert_eq!(after_first, Some(1), "the slab path ran");
        assert_eq!(at, 34);
        assert_matches(&staged, hs, &kv);
    }
    let (s, _) = tiny_store(true, 4);
    for bad in [0, 5] {
        let e = ContextStore::with_round_staging(
            s.backend().clone(),
            s.geometry().clone(),
            tiny_capacity(4),
            bad,
        )
        .expect_err("round_cols");
        assert!(
            matches!(
                e,
                ContextError::InvalidGeometry {
                    field: "round_cols",
                    ..
                }
            ),
            "{e}"
        );
    }
}

/// `materialize_round` over several requests at once (one projection of every lane's slab,
/// one K/V write per layer with a row per lane) equals materializing each alone on a plain
/// store: rings and pages, lanes with unequal rounds (5, 1, 3 rows; a lane with nothing
/// pending), a request whose queue is not one slab entry (a prefill, two pushes) beside
/// slab ones; no allocation for an all-slab round; duplicate and unknown handles are
/// refused before anything is written; the CPU never captures a graph.
#[test]
fn materialize_round_batches_every_lane_like_one_at_a_time() {
    for full in [true, false] {
        let (plain, w) = tiny_store(full, 2048);
        let be = plain.backend().clone();
        let g = plain.geometry().clone();
        let fw = g.feature_width();
        let streams: Vec<_> = (0..3).map(|i| stream(&plain, &w, 40 + i, 30)).collect();
        let mut staged =
            ContextStore::with_round_staging(be.clone(), g.clone(), tiny_capacity(2048), 5)
                .expect("store");
        assert!(
            !staged.capture_round(&w.view()).expect("capture"),
            "CPU: no graph"
        );
        let mut plain = plain;
        let hs: Vec<_> = (0..3).map(|_| staged.admit(30).expect("admit")).collect();
        let hp: Vec<_> = (0..3).map(|_| plain.admit(30).expect("admit")).collect();
        // Per round, per lane: the pushes before the materialize.
        let schedule: [[&[usize]; 3]; 5] = [
            [&[4], &[2], &[7]],
            [&[5], &[1], &[3]],
            [&[1], &[], &[2, 2]],
            [&[3], &[5], &[8]],
            [&[2], &[4], &[1]],
        ];
        let mut at = [0usize; 3];
        for (round, pushes) in schedule.iter().enumerate() {
            let mut all_slab = true;
            for lane in 0..3 {
                for &n in pushes[lane] {
                    let rows = &streams[lane].0;
                    let buf = be
                        .upload(&rows[at[lane] * fw..(at[lane] + n) * fw])
                        .expect("up");
                    staged
                        .push_pending(hs[lane], at[lane], &buf, n)
                        .expect("push");
                    plain
                        .push_pending(hp[lane], at[lane], &buf, n)
                        .expect("push");
                    at[lane] += n;
                }
                all_slab &= pushes[lane].len() <= 1 && pushes[lane].iter().all(|&n| n <= 5);
            }
            let before = be.allocations();
            staged
                .materialize_round(&hs, &w.view())
                .expect("materialize round");
            if round > 0 && all_slab {
                assert_eq!(be.allocations(), before, "round {round} allocated");
            }
            for lane in 0..3 {
                plain.materialize(hp[lane], &w.view()).expect("plain");
                assert_eq!(staged.pending(hs[lane]).expect("pending"), 0);
                assert_eq!(staged.frontier(hs[lane]).expect("f"), at[lane]);
                for l in 0..g.layers.len() {
                    assert_eq!(
                        staged.read_window(hs[lane], l).expect("staged"),
                        plain.read_window(hp[lane], l).expect("plain"),
                        "full={full} round {round} lane {lane} layer {l}"
                    );
                }
            }
        }
        for lane in 0..3 {
            assert_matches(&staged, hs[lane], &streams[lane].1);
        }
        // Refusals come before any work: a pending push stays pending.
        let buf = be
            .upload(&streams[0].0[at[0] * fw..(at[0] + 2) * fw])
            .expect("up");
        staged.push_pending(hs[0], at[0], &buf, 2).expect("push");
        assert!(matches!(
            staged.materialize_round(&[hs[0], hs[1], hs[0]], &w.view()),
            Err(ContextError::DuplicateHandle {
                first: 0,
                second: 2,
                ..
            })
        ));
        staged.release(hs[2]).expect("release");
        assert!(matches!(
            staged.materialize_round(&[hs[0], hs[2]], &w.view()),
            Err(ContextError::UnknownHandle { .. })
        ));
        assert_eq!(staged.pending(hs[0]).expect("pending"), 2, "nothing ran");
    }
}
