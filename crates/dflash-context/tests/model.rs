//! Model-based test: random sequences of admit, prefill (short and longer than the ring),
//! commit N in 0..=W (W = 16), materialize, checkpoint, fork, host replica, restore (device and
//! host, into live requests and fresh admissions, with matching and mismatching coverage),
//! release and stale-handle use, checked after every step against a naive model that keeps
//! every position's K/V per layer per request in plain vectors (computed when the features are
//! captured, by a direct call of the ops on that push's rows into a scratch ring with one slot
//! per position: no chunking, no window, no pages; see `common::oracle_kv_rows`).
//!
//! After every step: the live window of every layer of every request matches the model
//! bit for bit, positions just outside it are unreachable, coverage (F_ctx, pending, pending
//! target frontier) agrees, lane and page counts agree; an expected error has the expected
//! type and leaves every pool byte, the page table and all bookkeeping unchanged; an
//! unexpected success or error fails the case.
//!
//! Cases: 2000 in release builds (`cargo test --release`), 150 in debug builds; override with
//! `DFLASH_CONTEXT_MODEL_CASES`. Proptest seeds are random per run (failures print a
//! reproducible seed and persist it under `proptest-regressions/`).

mod common;

use common::{
    PosKv, Rng, Weights, feature_rows, oracle_kv_rows, snapshot, tiny_capacity,
    tiny_geometry_rings_only, tiny_geometry_with_full,
};
use dflash_context::{
    ContextError, ContextHandle, ContextImage, ContextLayerKind, ContextStore, HostContextImage,
    NO_PAGE,
};
use dflash_ops::Backend;
use proptest::prelude::*;

/// Block width W = K + 1 with K = 15.
const W: usize = 16;

#[derive(Debug, Clone)]
enum Step {
    Admit {
        max_context: usize,
    },
    /// A prefill chunk of `len` rows (often longer than a ring), taken without a copy.
    Prefill {
        who: usize,
        len: usize,
    },
    /// A commit: the first `n` of `cols` captured columns.
    Commit {
        who: usize,
        n: usize,
        cols: usize,
    },
    /// A push at the wrong place (`skew` != 0 positions off).
    BadPush {
        who: usize,
        skew: i64,
    },
    Materialize {
        who: usize,
    },
    Checkpoint {
        who: usize,
    },
    HostReplica {
        who: usize,
    },
    Fork {
        who: usize,
    },
    /// Restore image `image` (device or host) into a live request, attached at the image's
    /// frontier plus `skew`.
    Restore {
        who: usize,
        image: usize,
        host: bool,
        skew: i64,
    },
    /// Admit a new request holding image `image`.
    AdmitRestored {
        image: usize,
        host: bool,
        max_context: usize,
        skew: i64,
    },
    Release {
        who: usize,
    },
    /// Use a released handle.
    Stale {
        which: usize,
    },
    /// Batch metadata over a subset of the live requests.
    Batch {
        mask: u8,
    },
}

fn skew() -> impl Strategy<Value = i64> {
    prop_oneof![6 => Just(0i64), 1 => -3i64..=3]
}

fn step() -> impl Strategy<Value = Step> {
    let who = 0usize..8;
    prop_oneof![
        3 => (0usize..=80).prop_map(|max_context| Step::Admit { max_context }),
        2 => (who.clone(), 1usize..=40).prop_map(|(who, len)| Step::Prefill { who, len }),
        6 => (who.clone(), 0usize..=W, 0usize..=2)
            .prop_map(|(who, n, extra)| Step::Commit { who, n, cols: n + extra }),
        1 => (who.clone(), prop_oneof![-5i64..=-1, 1i64..=5])
            .prop_map(|(who, skew)| Step::BadPush { who, skew }),
        5 => who.clone().prop_map(|who| Step::Materialize { who }),
        2 => who.clone().prop_map(|who| Step::Checkpoint { who }),
        2 => who.clone().prop_map(|who| Step::HostReplica { who }),
        2 => who.clone().prop_map(|who| Step::Fork { who }),
        2 => (who.clone(), 0usize..8, any::<bool>(), skew())
            .prop_map(|(who, image, host, skew)| Step::Restore { who, image, host, skew }),
        1 => (0usize..8, any::<bool>(), 0usize..=80, skew()).prop_map(
            |(image, host, max_context, skew)| Step::AdmitRestored { image, host, max_context, skew }
        ),
        2 => who.clone().prop_map(|who| Step::Release { who }),
        1 => (0usize..8).prop_map(|which| Step::Stale { which }),
        1 => any::<u8>().prop_map(|mask| Step::Batch { mask }),
    ]
}

/// The model of one request: every position's K/V (materialized or pending) in order.
#[derive(Debug, Clone)]
struct ModelRequest {
    handle: ContextHandle,
    max_context: usize,
    frontier: usize,
    /// K/V of positions `0..frontier + pending`, per layer.
    kv: Vec<Vec<PosKv>>,
    pages: usize,
}

impl ModelRequest {
    fn pending(&self) -> usize {
        self.kv.len() - self.frontier
    }
}

/// The model of an image: its frontier and the K/V of positions `0..frontier`.
#[derive(Debug, Clone)]
struct ModelImage {
    frontier: usize,
    kv: Vec<Vec<PosKv>>,
}

struct Harness {
    store: ContextStore,
    weights: Weights,
    rng: Rng,
    live: Vec<ModelRequest>,
    released: Vec<ContextHandle>,
    images: Vec<(ModelImage, ContextImage, HostContextImage)>,
    free_pages: usize,
    page_size: usize,
    full: bool,
}

/// What the model predicts for a step.
enum Expect {
    Ok,
    Err(fn(&ContextError) -> bool),
}

impl Harness {
    fn new(full: bool, chunk: usize, seed: u64) -> Harness {
        let be = Backend::cpu();
        let g = if full {
            tiny_geometry_with_full()
        } else {
            tiny_geometry_rings_only()
        };
        let weights = Weights::random(&be, &g, seed ^ 0xABCD);
        let cap = tiny_capacity(chunk);
        let store = ContextStore::new(be, g, cap).expect("store");
        Harness {
            free_pages: if full { cap.pages } else { 0 },
            page_size: cap.page_size,
            store,
            weights,
            rng: Rng(seed),
            live: Vec::new(),
            released: Vec::new(),
            images: Vec::new(),
            full,
        }
    }

    fn limit(&self) -> usize {
        if self.full { 64 } else { i32::MAX as usize }
    }

    fn pages_for(&self, max_context: usize) -> usize {
        if self.full {
            max_context.div_ceil(self.page_size)
        } else {
            0
        }
    }

    /// The model's admission verdict: `Ok(pages)` or the expected error.
    fn admission(&self, max_context: usize) -> Result<usize, fn(&ContextError) -> bool> {
        if max_context > self.limit() {
            return Err(|e| matches!(e, ContextError::ContextTooLong { .. }));
        }
        if self.live.len() == 3 {
            return Err(|e| matches!(e, ContextError::NoFreeLane { .. }));
        }
        let pages = self.pages_for(max_context);
        if pages > self.free_pages {
            return Err(|e| matches!(e, ContextError::InsufficientPages { .. }));
        }
        Ok(pages)
    }

    /// Fresh feature rows for positions `at..at + n` and their oracle K/V.
    fn features(&mut self, at: usize, n: usize) -> (Vec<dflash_ops::bf16>, Vec<Vec<PosKv>>) {
        let g = self.store.geometry().clone();
        let rows = feature_rows(&mut self.rng, &g, n);
        let kv = oracle_kv_rows(self.store.backend(), &g, &self.weights, &rows, at);
        (rows, kv)
    }

    /// Run one step, checking the store's answer against the model's prediction.
    fn step(&mut self, step: &Step) -> Result<(), TestCaseError> {
        let before = snapshot(&self.store);
        let pick = |who: usize, n: usize| if n == 0 { None } else { Some(who % n) };
        let (expect, result): (Expect, Result<(), ContextError>) = match *step {
            Step::Admit { max_context } => match self.admission(max_context) {
                Err(e) => (Expect::Err(e), self.store.admit(max_context).map(|_| ())),
                Ok(pages) => {
                    let h = self.store.admit(max_context);
                    if let Ok(h) = h {
                        self.free_pages -= pages;
                        self.live.push(ModelRequest {
                            handle: h,
                            max_context,
                            frontier: 0,
                            kv: Vec::new(),
                            pages,
                        });
                    }
                    (Expect::Ok, h.map(|_| ()))
                }
            },
            Step::Prefill { who, len } | Step::Commit { who, n: len, .. } => {
                let Some(i) = pick(who, self.live.len()) else {
                    return Ok(());
                };
                let cols = match *step {
                    Step::Commit { cols, .. } => cols,
                    _ => len,
                };
                let at = self.live[i].kv.len();
                let (rows, kv) = self.features(at, cols);
                let h = self.live[i].handle;
                let be = self.store.backend().clone();
                let buf = be.upload(&rows).expect("upload");
                let result = match *step {
                    Step::Commit { .. } => self.store.push_pending(h, at, &buf, len),
                    _ => self.store.push_pending_owned(h, at, buf),
                };
                if at + len > self.live[i].max_context {
                    (
                        Expect::Err(|e| matches!(e, ContextError::ContextOverflow { .. })),
                        result,
                    )
                } else {
                    if result.is_ok() {
                        self.live[i].kv.extend(kv.into_iter().take(len));
                    }
                    (Expect::Ok, result)
                }
            }
            Step::BadPush { who, skew } => {
                let Some(i) = pick(who, self.live.len()) else {
                    return Ok(());
                };
                let at = self.live[i].kv.len() as i64 + skew;
                if at < 0 {
                    return Ok(());
                }
                let (rows, _) = self.features(at as usize, 1);
                let buf = self.store.backend().upload(&rows).expect("upload");
                (
                    Expect::Err(|e| matches!(e, ContextError::OutOfOrder { .. })),
                    self.store
                        .push_pending(self.live[i].handle, at as usize, &buf, 1),
                )
            }
            Step::Materialize { who } => {
                let Some(i) = pick(who, self.live.len()) else {
                    return Ok(());
                };
                let r = self
                    .store
                    .materialize(self.live[i].handle, &self.weights.view());
                if r.is_ok() {
                    self.live[i].frontier = self.live[i].kv.len();
                }
                (Expect::Ok, r)
            }
            Step::Checkpoint { who } | Step::HostReplica { who } => {
                let Some(i) = pick(who, self.live.len()) else {
                    return Ok(());
                };
                let m = &self.live[i];
                let device = self.store.checkpoint(m.handle);
                let host = self.store.host_replica(m.handle);
                if m.pending() > 0 {
                    let refused = matches!(host, Err(ContextError::PendingFeatures { .. }));
                    prop_assert!(refused, "host replica with pending features");
                    (
                        Expect::Err(|e| matches!(e, ContextError::PendingFeatures { .. })),
                        device.map(|_| ()),
                    )
                } else {
                    let (device, host) = match (device, host) {
                        (Ok(d), Ok(h)) => (d, h),
                        (d, h) => {
                            return Err(TestCaseError::fail(format!(
                                "image refused: {:?} {:?}",
                                d.err(),
                                h.err()
                            )));
                        }
                    };
                    let model = ModelImage {
                        frontier: m.frontier,
                        kv: m.kv[..m.frontier].to_vec(),
                    };
                    self.check_image(&model, &device, &host)?;
                    self.images.push((model, device, host));
                    (Expect::Ok, Ok(()))
                }
            }
            Step::Fork { who } => {
                let Some(i) = pick(who, self.live.len()) else {
                    return Ok(());
                };
                let m = self.live[i].clone();
                let r = self.store.fork(m.handle);
                if m.pending() > 0 {
                    (
                        Expect::Err(|e| matches!(e, ContextError::PendingFeatures { .. })),
                        r.map(|_| ()),
                    )
                } else {
                    match self.admission(m.max_context) {
                        Err(e) => (Expect::Err(e), r.map(|_| ())),
                        Ok(pages) => {
                            if let Ok(h) = r {
                                self.free_pages -= pages;
                                self.live.push(ModelRequest { handle: h, ..m });
                            }
                            (Expect::Ok, r.map(|_| ()))
                        }
                    }
                }
            }
            Step::Restore {
                who,
                image,
                host,
                skew,
            } => {
                let (Some(i), Some(j)) =
                    (pick(who, self.live.len()), pick(image, self.images.len()))
                else {
                    return Ok(());
                };
                let (model, dev, hst) = &self.images[j];
                let target = model.frontier as i64 + skew;
                if target < 0 {
                    return Ok(());
                }
                let h = self.live[i].handle;
                let r = if host {
                    self.store.restore_host(h, hst, target as usize)
                } else {
                    self.store.restore(h, dev, target as usize)
                };
                let m = &self.live[i];
                if m.pending() > 0 {
                    (
                        Expect::Err(|e| matches!(e, ContextError::PendingFeatures { .. })),
                        r,
                    )
                } else if skew != 0 {
                    (
                        Expect::Err(|e| matches!(e, ContextError::CoverageMismatch { .. })),
                        r,
                    )
                } else if model.frontier > m.max_context {
                    (
                        Expect::Err(|e| matches!(e, ContextError::ImageTooLong { .. })),
                        r,
                    )
                } else {
                    if r.is_ok() {
                        let model = model.clone();
                        self.live[i].frontier = model.frontier;
                        self.live[i].kv = model.kv;
                    }
                    (Expect::Ok, r)
                }
            }
            Step::AdmitRestored {
                image,
                host,
                max_context,
                skew,
            } => {
                let Some(j) = pick(image, self.images.len()) else {
                    return Ok(());
                };
                let model = self.images[j].0.clone();
                let target = model.frontier as i64 + skew;
                if target < 0 {
                    return Ok(());
                }
                let r = if host {
                    self.store
                        .admit_restored_host(max_context, &self.images[j].2, target as usize)
                } else {
                    self.store
                        .admit_restored(max_context, &self.images[j].1, target as usize)
                };
                if skew != 0 {
                    (
                        Expect::Err(|e| matches!(e, ContextError::CoverageMismatch { .. })),
                        r.map(|_| ()),
                    )
                } else if model.frontier > max_context {
                    (
                        Expect::Err(|e| matches!(e, ContextError::ImageTooLong { .. })),
                        r.map(|_| ()),
                    )
                } else {
                    match self.admission(max_context) {
                        Err(e) => (Expect::Err(e), r.map(|_| ())),
                        Ok(pages) => {
                            if let Ok(h) = r {
                                self.free_pages -= pages;
                                self.live.push(ModelRequest {
                                    handle: h,
                                    max_context,
                                    frontier: model.frontier,
                                    kv: model.kv,
                                    pages,
                                });
                            }
                            (Expect::Ok, r.map(|_| ()))
                        }
                    }
                }
            }
            Step::Release { who } => {
                let Some(i) = pick(who, self.live.len()) else {
                    return Ok(());
                };
                let m = self.live.swap_remove(i);
                let r = self.store.release(m.handle);
                if r.is_ok() {
                    self.free_pages += m.pages;
                    self.released.push(m.handle);
                }
                (Expect::Ok, r)
            }
            Step::Stale { which } => {
                let Some(i) = pick(which, self.released.len()) else {
                    return Ok(());
                };
                let h = self.released[i];
                let weights = self.weights.view();
                let r = match which % 5 {
                    0 => self.store.release(h),
                    1 => self.store.materialize(h, &weights),
                    2 => self.store.fork(h).map(|_| ()),
                    3 => self.store.read_window(h, 0).map(|_| ()),
                    _ => self.store.frontier(h).map(|_| ()),
                };
                (
                    Expect::Err(|e| matches!(e, ContextError::UnknownHandle { .. })),
                    r,
                )
            }
            Step::Batch { mask } => {
                let chosen: Vec<&ModelRequest> = self
                    .live
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| mask & (1 << i) != 0)
                    .map(|(_, m)| m)
                    .collect();
                let handles: Vec<ContextHandle> = chosen.iter().map(|m| m.handle).collect();
                let r = self.store.batch_metadata(&handles);
                if chosen.iter().any(|m| m.pending() > 0) {
                    (
                        Expect::Err(|e| matches!(e, ContextError::PendingFeatures { .. })),
                        r.map(|_| ()),
                    )
                } else {
                    let meta = match r {
                        Ok(meta) => meta,
                        Err(e) => return Err(TestCaseError::fail(format!("batch: {e:?}"))),
                    };
                    let be = self.store.backend();
                    let lanes: Vec<i32> = handles.iter().map(|h| h.lane() as i32).collect();
                    let fronts: Vec<i32> = chosen.iter().map(|m| m.frontier as i32).collect();
                    prop_assert_eq!(be.download(&meta.lanes).expect("lanes"), lanes);
                    prop_assert_eq!(be.download(&meta.frontiers).expect("f"), fronts);
                    if let Some(t) = &meta.page_table {
                        let t = be.download(t).expect("table");
                        for (row, m) in chosen.iter().enumerate() {
                            let got = &t[row * 16..(row + 1) * 16];
                            prop_assert_eq!(
                                &got[..m.pages],
                                self.store.pages(m.handle).expect("p")
                            );
                            prop_assert!(got[m.pages..].iter().all(|&p| p == NO_PAGE));
                        }
                    } else {
                        prop_assert!(!self.full);
                    }
                    (Expect::Ok, Ok(()))
                }
            }
        };
        match (expect, result) {
            (Expect::Ok, Ok(())) => {}
            (Expect::Ok, Err(e)) => {
                return Err(TestCaseError::fail(format!(
                    "{step:?}: unexpected error {e:?}"
                )));
            }
            (Expect::Err(_), Ok(())) => {
                return Err(TestCaseError::fail(format!(
                    "{step:?}: accepted, error expected"
                )));
            }
            (Expect::Err(check), Err(e)) => {
                prop_assert!(check(&e), "{:?}: wrong error {:?}", step, e);
                prop_assert!(
                    snapshot(&self.store) == before,
                    "{:?}: error changed state",
                    step
                );
            }
        }
        self.check_all()
    }

    /// A fresh image matches the model: frontier, payload size, ring slots and full positions.
    fn check_image(
        &self,
        model: &ModelImage,
        device: &ContextImage,
        host: &HostContextImage,
    ) -> Result<(), TestCaseError> {
        let g = self.store.geometry();
        let f = model.frontier;
        prop_assert_eq!(device.frontier(), f);
        prop_assert_eq!(host.frontier(), f);
        prop_assert_eq!(device.payload_bytes(), g.image_bytes(f));
        prop_assert_eq!(host.payload_bytes(), g.image_bytes(f));
        prop_assert!(&device.to_host(self.store.backend()).expect("to host") == host);
        let kvw = g.kv_width();
        for (l, kind) in g.layers.iter().enumerate() {
            let (k, v) = host.layer(l).expect("layer");
            let positions: Vec<usize> = match *kind {
                // Slot s holds the live position p with p mod S = s.
                ContextLayerKind::Local { window } => (0..f.min(window))
                    .map(|s| {
                        (f.saturating_sub(window)..f)
                            .find(|p| p % window == s)
                            .unwrap_or(usize::MAX)
                    })
                    .collect(),
                ContextLayerKind::Full => (0..f).collect(),
            };
            prop_assert_eq!(k.len(), positions.len() * kvw);
            for (i, &p) in positions.iter().enumerate() {
                prop_assert!(
                    k[i * kvw..(i + 1) * kvw] == model.kv[p][l].0[..],
                    "image K layer {} pos {}",
                    l,
                    p
                );
                prop_assert!(
                    v[i * kvw..(i + 1) * kvw] == model.kv[p][l].1[..],
                    "image V layer {} pos {}",
                    l,
                    p
                );
            }
        }
        Ok(())
    }

    /// Every live request agrees with the model; lanes and pages are accounted for.
    fn check_all(&self) -> Result<(), TestCaseError> {
        let s = &self.store;
        prop_assert_eq!(s.free_lanes(), 3 - self.live.len());
        prop_assert_eq!(s.free_pages(), self.free_pages);
        prop_assert_eq!(s.handles().len(), self.live.len());
        let kvw = s.geometry().kv_width();
        for m in &self.live {
            let h = m.handle;
            prop_assert_eq!(s.frontier(h).expect("f"), m.frontier);
            prop_assert_eq!(s.pending(h).expect("p"), m.pending());
            prop_assert_eq!(s.pending_target_frontier(h).expect("ptf"), m.kv.len());
            prop_assert_eq!(s.max_context(h).expect("m"), m.max_context);
            prop_assert_eq!(s.pages(h).expect("pages").len(), m.pages);
            prop_assert!(s.check_coverage(h, m.kv.len()).is_ok());
            for (l, kind) in s.geometry().layers.iter().enumerate() {
                let start = match *kind {
                    ContextLayerKind::Local { window } => m.frontier.saturating_sub(window),
                    ContextLayerKind::Full => 0,
                };
                let win = s.read_window(h, l).expect("window");
                prop_assert_eq!((win.start, win.end), (start, m.frontier));
                for p in start..m.frontier {
                    let i = (p - start) * kvw;
                    prop_assert!(
                        win.k[i..i + kvw] == m.kv[p][l].0[..],
                        "K layer {} pos {}",
                        l,
                        p
                    );
                    prop_assert!(
                        win.v[i..i + kvw] == m.kv[p][l].1[..],
                        "V layer {} pos {}",
                        l,
                        p
                    );
                }
                // Dead and unmaterialized positions are unreachable.
                let dead = |p: usize| {
                    matches!(
                        s.read_position(h, l, p),
                        Err(ContextError::DeadPosition { .. })
                    )
                };
                prop_assert!(dead(m.frontier));
                if start > 0 {
                    prop_assert!(dead(start - 1));
                    prop_assert!(dead(0));
                }
                if m.frontier > start {
                    let p = start + (m.frontier - start) / 2;
                    let (k, v) = s.read_position(h, l, p).expect("live position");
                    prop_assert!(k == m.kv[p][l].0 && v == m.kv[p][l].1);
                }
            }
        }
        Ok(())
    }
}

fn cases() -> u32 {
    std::env::var("DFLASH_CONTEXT_MODEL_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(if cfg!(debug_assertions) { 150 } else { 2000 })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn storage_matches_the_naive_model(
        full in prop_oneof![3 => Just(true), 1 => Just(false)],
        chunk in prop_oneof![Just(1usize), Just(3), Just(5), Just(2048)],
        seed in any::<u64>(),
        steps in prop::collection::vec(step(), 1..40),
    ) {
        let mut h = Harness::new(full, chunk, seed);
        for s in &steps {
            h.step(s)?;
        }
        // Releasing everything returns every lane and page.
        for m in std::mem::take(&mut h.live) {
            h.store.release(m.handle).expect("release");
        }
        prop_assert_eq!(h.store.free_lanes(), 3);
        prop_assert_eq!(h.store.free_pages(), if full { 24 } else { 0 });
    }
}
