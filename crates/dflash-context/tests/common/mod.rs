//! Fixtures shared by the integration tests: tiny geometries, deterministic weights and
//! features, an independent per-position K/V oracle, and full-state snapshots.

#![allow(dead_code)] // reason: each test binary uses a different subset of the fixtures

use dflash_context::{
    Capacity, ContextGeometry, ContextHandle, ContextLayerKind, ContextStore, LayerKvWeights,
    LayerPool, MaterializeWeights,
};
use dflash_ops::context_kv_materialize::{self, CacheLayout, MaterializeParams};
use dflash_ops::feature_projection::{self, FeatureProjectionParams};
use dflash_ops::{Backend, Buffer, bf16, f16};

/// SplitMix64: a tiny deterministic generator for fixtures.
#[derive(Clone, Debug)]
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-a, a), rounded to bf16.
    pub fn bf16(&mut self, a: f32) -> bf16 {
        let u = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        bf16::from_f32((2.0 * u - 1.0) * a)
    }

    pub fn vec(&mut self, n: usize, a: f32) -> Vec<bf16> {
        (0..n).map(|_| self.bf16(a)).collect()
    }
}

/// H 32, n_ids 2, Hkv 2, D 8; layers: ring S = 8, full, ring S = 16.
pub fn tiny_geometry_with_full() -> ContextGeometry {
    ContextGeometry {
        hidden: 32,
        n_ids: 2,
        kv_heads: 2,
        head_dim: 8,
        eps: 1e-6,
        theta: 10_000.0,
        layers: vec![
            ContextLayerKind::Local { window: 8 },
            ContextLayerKind::Full,
            ContextLayerKind::Local { window: 16 },
        ],
    }
}

/// H 32, n_ids 2, Hkv 2, D 8; two ring layers with S = 8 (no full pool).
pub fn tiny_geometry_rings_only() -> ContextGeometry {
    ContextGeometry {
        layers: vec![
            ContextLayerKind::Local { window: 8 },
            ContextLayerKind::Local { window: 8 },
        ],
        ..tiny_geometry_with_full()
    }
}

/// 3 lanes, pages of 4 tokens, 16 pages per lane (64 tokens), 24 pages in all (so three
/// maximal requests do not fit), chunks of `chunk_cols`.
pub fn tiny_capacity(chunk_cols: usize) -> Capacity {
    Capacity {
        lanes: 3,
        page_size: 4,
        pages: 24,
        max_pages_per_lane: 16,
        chunk_cols,
    }
}

/// Owned context weights for a geometry.
pub struct Weights {
    pub fc: Buffer<bf16>,
    pub hidden_norm: Buffer<bf16>,
    pub layers: Vec<(Buffer<bf16>, Buffer<bf16>, Buffer<bf16>)>,
}

impl Weights {
    pub fn random(be: &Backend, g: &ContextGeometry, seed: u64) -> Weights {
        let mut r = Rng(seed);
        let (h, fw, kvw) = (g.hidden, g.feature_width(), g.kv_width());
        let up = |v: Vec<bf16>| be.upload(&v).expect("upload weights");
        let fc = up(r.vec(h * fw, 0.3));
        let hidden_norm = up((0..h).map(|_| bf16::from_f32(0.5) + r.bf16(0.4)).collect());
        let layers = g
            .layers
            .iter()
            .map(|_| {
                (
                    up(r.vec(kvw * h, 0.4)),
                    up(r.vec(kvw * h, 0.4)),
                    up((0..g.head_dim)
                        .map(|_| bf16::from_f32(1.0) + r.bf16(0.5))
                        .collect()),
                )
            })
            .collect();
        Weights {
            fc,
            hidden_norm,
            layers,
        }
    }

    pub fn view(&self) -> MaterializeWeights<'_> {
        MaterializeWeights {
            fc: &self.fc,
            hidden_norm: &self.hidden_norm,
            layers: self
                .layers
                .iter()
                .map(|(w_k, w_v, key_norm)| LayerKvWeights {
                    w_k: w_k.view(0, w_k.len()).expect("view w_k"),
                    w_v: w_v.view(0, w_v.len()).expect("view w_v"),
                    key_norm,
                })
                .collect(),
        }
    }
}

/// K and V (`[Hkv * D]` each) of one position in one layer.
pub type PosKv = (Vec<bf16>, Vec<f16>);

/// The oracle: every layer's K/V of one position, computed from its feature row alone by a
/// direct one-column call of the ops into a one-slot scratch ring (no chunking, no paging).
pub fn oracle_kv(
    be: &Backend,
    g: &ContextGeometry,
    w: &Weights,
    feature_row: &[bf16],
    pos: usize,
) -> Vec<PosKv> {
    oracle_kv_rows(be, g, w, feature_row, pos)
        .pop()
        .expect("one position")
}

/// The oracle for consecutive positions `at..at + n` (`rows` holds n feature rows): one
/// projection of all rows (row-independent), then per layer one materialize into a scratch
/// ring of exactly n slots, so every position gets its own slot (no chunking, no paging, no
/// window). Returns per position, per layer, its K/V.
pub fn oracle_kv_rows(
    be: &Backend,
    g: &ContextGeometry,
    w: &Weights,
    rows: &[bf16],
    at: usize,
) -> Vec<Vec<PosKv>> {
    let kvw = g.kv_width();
    let n = rows.len() / g.feature_width();
    if n == 0 {
        return Vec::new();
    }
    let s = be.upload(rows).expect("upload rows");
    let mut c = be.zeros::<bf16>(n * g.hidden).expect("c");
    feature_projection::run(
        be,
        &s,
        &w.fc,
        &w.hidden_norm,
        &mut c,
        &FeatureProjectionParams {
            tokens: n,
            n_ids: g.n_ids,
            hidden: g.hidden,
            eps: g.eps,
        },
    )
    .expect("feature_projection");
    let start = be.upload(&[at as i32]).expect("start");
    let count = be.upload(&[n as i32]).expect("count");
    let lane = be.upload(&[0i32]).expect("lane");
    let per_layer: Vec<(Vec<bf16>, Vec<f16>)> = w
        .layers
        .iter()
        .map(|(w_k, w_v, key_norm)| {
            let mut k = be.filled::<bf16>(n * kvw, bf16::NAN).expect("k");
            let mut v = be.filled::<f16>(n * kvw, f16::NAN).expect("v");
            context_kv_materialize::run(
                be,
                &c,
                w_k,
                w_v,
                key_norm,
                &start,
                &count,
                &lane,
                &mut k,
                &mut v,
                &MaterializeParams {
                    rows: 1,
                    cols: n,
                    hidden: g.hidden,
                    kv_heads: g.kv_heads,
                    head_dim: g.head_dim,
                    eps: g.eps,
                    theta: g.theta,
                    layout: CacheLayout::Ring {
                        lanes: 1,
                        capacity: n,
                    },
                },
            )
            .expect("context_kv_materialize");
            (be.download(&k).expect("k"), be.download(&v).expect("v"))
        })
        .collect();
    (0..n)
        .map(|i| {
            let slot = (at + i) % n;
            per_layer
                .iter()
                .map(|(k, v)| {
                    (
                        k[slot * kvw..(slot + 1) * kvw].to_vec(),
                        v[slot * kvw..(slot + 1) * kvw].to_vec(),
                    )
                })
                .collect()
        })
        .collect()
}

/// Everything observable about a store: every pool byte, the page table, the free counts and
/// each live request's bookkeeping (pending feature contents included).
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    pub pools: Vec<(Vec<u16>, Vec<u16>)>,
    pub page_table: Option<Vec<i32>>,
    pub free_lanes: usize,
    pub free_pages: usize,
    pub requests: Vec<RequestSnapshot>,
}

/// One request's bookkeeping.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestSnapshot {
    pub handle: ContextHandle,
    pub frontier: usize,
    pub pending: usize,
    pub pending_ranges: Vec<(usize, usize)>,
    pub max_context: usize,
    pub pages: Vec<i32>,
}

pub fn snapshot(store: &ContextStore) -> Snapshot {
    let be = store.backend();
    let pools = (0..store.geometry().layers.len())
        .map(|l| {
            let (k, v) = match store.layer(l).expect("layer") {
                LayerPool::Ring { k, v, .. } | LayerPool::Paged { k, v, .. } => (k, v),
            };
            (
                be.download(k)
                    .expect("k")
                    .iter()
                    .map(|x| x.to_bits())
                    .collect(),
                be.download(v)
                    .expect("v")
                    .iter()
                    .map(|x| x.to_bits())
                    .collect(),
            )
        })
        .collect();
    let requests = store
        .handles()
        .into_iter()
        .map(|h| RequestSnapshot {
            handle: h,
            frontier: store.frontier(h).expect("frontier"),
            pending: store.pending(h).expect("pending"),
            pending_ranges: store.pending_ranges(h).expect("ranges"),
            max_context: store.max_context(h).expect("max_context"),
            pages: store.pages(h).expect("pages").to_vec(),
        })
        .collect();
    Snapshot {
        pools,
        page_table: store.page_table().map(|t| be.download(t).expect("table")),
        free_lanes: store.free_lanes(),
        free_pages: store.free_pages(),
        requests,
    }
}

/// `n` random feature rows (`[n, n_ids * H]`).
pub fn feature_rows(rng: &mut Rng, g: &ContextGeometry, n: usize) -> Vec<bf16> {
    rng.vec(n * g.feature_width(), 2.0)
}
