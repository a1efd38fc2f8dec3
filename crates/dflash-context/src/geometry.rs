//! What the storage needs to know about the draft, how much of it to allocate, and what it
//! costs in bytes.

use crate::{ContextError, Result};

/// Bytes of one stored K element (BF16) plus one stored V element (FP16).
const KV_ELEMENT_BYTES: u64 = 2 + 2;

/// How one draft layer stores its context K/V.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ContextLayerKind {
    /// Sliding-window layer: a cyclic ring of `window` slots per lane (position p in slot
    /// p mod window).
    Local {
        /// The sliding-window scalar S, also the ring capacity.
        window: usize,
    },
    /// Full-attention layer: the paged full-layer pool.
    Full,
}

/// The draft geometry the context storage depends on.
///
/// Build it from a validated config with [`ContextGeometry::from_config`], or by hand (tests,
/// other engines). [`ContextGeometry::validate`] states the accepted ranges.
#[derive(Debug, Clone, PartialEq)]
pub struct ContextGeometry {
    /// Hidden width H (the target's).
    pub hidden: usize,
    /// Number of target block ids n_ids: a captured feature row has `n_ids * H` elements.
    pub n_ids: usize,
    /// KV heads Hkv.
    pub kv_heads: usize,
    /// Head dimension D (even).
    pub head_dim: usize,
    /// Plain RMSNorm epsilon (context norm and key norm).
    pub eps: f32,
    /// RoPE theta.
    pub theta: f64,
    /// Per draft layer, in order.
    pub layers: Vec<ContextLayerKind>,
}

impl ContextGeometry {
    /// The storage geometry of a validated draft/target pair.
    pub fn from_config(g: &dflash_config::Geometry) -> Result<Self> {
        let layers = g
            .layers
            .iter()
            .map(|l| match *l {
                dflash_config::LayerKind::Local { window } => ContextLayerKind::Local {
                    window: window as usize,
                },
                dflash_config::LayerKind::Full => ContextLayerKind::Full,
            })
            .collect();
        let geometry = ContextGeometry {
            hidden: g.hidden as usize,
            n_ids: g.n_ids(),
            kv_heads: g.kv_heads as usize,
            head_dim: g.head_dim as usize,
            eps: g.rms_norm_eps as f32,
            theta: g.rope_theta,
            layers,
        };
        geometry.validate()?;
        Ok(geometry)
    }

    /// Check the ranges: H, n_ids, Hkv >= 1; D >= 2 and even; eps > 0 and finite (also as
    /// f32); theta > 0 and finite; at least one layer; every window >= 1; and the per-layer
    /// sizes fit in `usize`.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &'static str, expected: &str, found: String| {
            Err(ContextError::InvalidGeometry {
                field,
                expected: expected.to_owned(),
                found,
            })
        };
        if self.hidden == 0 {
            return bad("geometry.hidden", ">= 1", self.hidden.to_string());
        }
        if self.n_ids == 0 {
            return bad("geometry.n_ids", ">= 1", self.n_ids.to_string());
        }
        if self.kv_heads == 0 {
            return bad("geometry.kv_heads", ">= 1", self.kv_heads.to_string());
        }
        if self.head_dim < 2 || !self.head_dim.is_multiple_of(2) {
            return bad(
                "geometry.head_dim",
                "even and >= 2",
                self.head_dim.to_string(),
            );
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return bad("geometry.eps", "finite and > 0", self.eps.to_string());
        }
        if !(self.theta.is_finite() && self.theta > 0.0) {
            return bad("geometry.theta", "finite and > 0", self.theta.to_string());
        }
        if self.layers.is_empty() {
            return bad("geometry.layers", "at least one layer", "none".to_owned());
        }
        if self.hidden.checked_mul(self.n_ids).is_none()
            || self.kv_heads.checked_mul(self.head_dim).is_none()
        {
            return bad(
                "geometry",
                "sizes that fit in usize",
                "an overflowing product".to_owned(),
            );
        }
        for l in &self.layers {
            if let ContextLayerKind::Local { window } = *l {
                if window == 0 || window > i32::MAX as usize {
                    return bad(
                        "geometry.layers[].window",
                        "1..=i32::MAX",
                        window.to_string(),
                    );
                }
                if window.checked_mul(self.kv_width()).is_none() {
                    return bad(
                        "geometry.layers[].window",
                        "a ring size that fits in usize",
                        window.to_string(),
                    );
                }
            }
        }
        Ok(())
    }

    /// Width of one captured feature row, `n_ids * H`.
    pub fn feature_width(&self) -> usize {
        self.n_ids * self.hidden
    }

    /// Elements of one position's K (or V) in one layer, `Hkv * D`.
    pub fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Whether the draft has full-attention layers (and so a paged pool).
    pub fn has_full_layers(&self) -> bool {
        self.layers.contains(&ContextLayerKind::Full)
    }

    /// The largest local window, or `None` without local layers.
    pub fn max_window(&self) -> Option<usize> {
        self.layers
            .iter()
            .filter_map(|l| match *l {
                ContextLayerKind::Local { window } => Some(window),
                ContextLayerKind::Full => None,
            })
            .max()
    }

    /// Bytes of the ring payload of a state image once the context fills every ring
    /// (`F_ctx >= S`): the sum over local layers of `(2-byte K + 2-byte V) * Hkv * D * S`.
    /// This is the most ring bytes an image ever carries. Official 27B DFlash2:
    /// `5 * 4 * 8 * 128 * 2048 = 41943040` (40 MiB); official 35B-A3B DFlash:
    /// `5 * 4 * 8 * 128 * 4096 = 83886080` (80 MiB). The draft count K and the concurrency B do
    /// not change it.
    pub fn ring_image_bytes(&self) -> u64 {
        self.layers
            .iter()
            .map(|l| match *l {
                ContextLayerKind::Local { window } => {
                    KV_ELEMENT_BYTES * self.kv_width() as u64 * window as u64
                }
                ContextLayerKind::Full => 0,
            })
            .sum()
    }

    /// Bytes one context position adds to an image's full-layer payload:
    /// `full layers * (2 + 2) * Hkv * D` (0 without full layers; 4096 for the official
    /// 35B-A3B DFlash).
    pub fn full_image_bytes_per_position(&self) -> u64 {
        let full = self
            .layers
            .iter()
            .filter(|l| **l == ContextLayerKind::Full)
            .count() as u64;
        full * KV_ELEMENT_BYTES * self.kv_width() as u64
    }

    /// Exact payload bytes of a state image of a request whose context frontier is
    /// `frontier`: per local layer the live slots `min(F_ctx, S)`, per full layer the `F_ctx`
    /// materialized positions, each `(2 + 2) * Hkv * D` bytes. Equals
    /// [`ContextGeometry::ring_image_bytes`] plus `F_ctx *`
    /// [`ContextGeometry::full_image_bytes_per_position`] once `F_ctx` reaches every window.
    pub fn image_bytes(&self, frontier: usize) -> u64 {
        let per = KV_ELEMENT_BYTES * self.kv_width() as u64;
        self.layers
            .iter()
            .map(|l| match *l {
                ContextLayerKind::Local { window } => per * frontier.min(window) as u64,
                ContextLayerKind::Full => per * frontier as u64,
            })
            .sum()
    }
}

/// How much storage a [`crate::ContextStore`] allocates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Capacity {
    /// Concurrency B: lanes (requests held at once), 1..=8.
    pub lanes: usize,
    /// Tokens per page of the full-layer pool (>= 1; ignored without full layers).
    pub page_size: usize,
    /// Pages in the full-layer pool, shared by all lanes (each full layer has its own K/V
    /// pool with this many pages, indexed by the same page ids; ignored without full layers).
    pub pages: usize,
    /// Width of a page table row: the most pages one request may hold (>= 1; ignored without
    /// full layers). A request's maximum context is at most `max_pages_per_lane * page_size`.
    pub max_pages_per_lane: usize,
    /// The most pending columns projected and written by one op call during
    /// [`crate::ContextStore::materialize`] (>= 1); longer queues are processed in chunks.
    pub chunk_cols: usize,
}

/// Default [`Capacity::chunk_cols`].
pub const DEFAULT_CHUNK_COLS: usize = 2048;

/// The largest concurrency B.
pub const MAX_LANES: usize = 8;

impl Capacity {
    /// `lanes` lanes, each able to hold `max_context` tokens in the full-layer pool with pages
    /// of `page_size` tokens (`pages = lanes * ceil(max_context / page_size)`), chunks of
    /// [`DEFAULT_CHUNK_COLS`]. A `page_size` of 0 is kept as is (and refused by
    /// [`crate::ContextStore::new`] for drafts with full layers).
    pub fn new(lanes: usize, max_context: usize, page_size: usize) -> Self {
        let max_pages_per_lane = max_context.div_ceil(page_size.max(1)).max(1);
        Capacity {
            lanes,
            page_size,
            pages: lanes.saturating_mul(max_pages_per_lane),
            max_pages_per_lane,
            chunk_cols: DEFAULT_CHUNK_COLS,
        }
    }

    /// Check the ranges against `geometry` (see each field).
    pub fn validate(&self, geometry: &ContextGeometry) -> Result<()> {
        let bad = |field: &'static str, expected: &str, found: usize| {
            Err(ContextError::InvalidGeometry {
                field,
                expected: expected.to_owned(),
                found: found.to_string(),
            })
        };
        if !(1..=MAX_LANES).contains(&self.lanes) {
            return bad("capacity.lanes", "1..=8", self.lanes);
        }
        if self.chunk_cols == 0 || self.chunk_cols > i32::MAX as usize {
            return bad("capacity.chunk_cols", "1..=i32::MAX", self.chunk_cols);
        }
        if geometry.has_full_layers() {
            if self.page_size == 0 || self.page_size > i32::MAX as usize {
                return bad("capacity.page_size", "1..=i32::MAX", self.page_size);
            }
            if self.pages == 0 || self.pages > i32::MAX as usize {
                return bad("capacity.pages", "1..=i32::MAX", self.pages);
            }
            if self.max_pages_per_lane == 0 || self.max_pages_per_lane > self.pages {
                return bad(
                    "capacity.max_pages_per_lane",
                    "1..=capacity.pages",
                    self.max_pages_per_lane,
                );
            }
            let pool = self
                .pages
                .checked_mul(self.page_size)
                .and_then(|x| x.checked_mul(geometry.kv_width()));
            let table = self.lanes.checked_mul(self.max_pages_per_lane);
            if pool.is_none() || table.is_none() {
                return bad(
                    "capacity.pages",
                    "a pool size that fits in usize",
                    self.pages,
                );
            }
        }
        for l in &geometry.layers {
            if let ContextLayerKind::Local { window } = *l
                && window
                    .checked_mul(geometry.kv_width())
                    .and_then(|x| x.checked_mul(self.lanes))
                    .is_none()
            {
                return bad(
                    "capacity.lanes",
                    "a ring size that fits in usize",
                    self.lanes,
                );
            }
        }
        Ok(())
    }

    /// The longest context one request may declare: `max_pages_per_lane * page_size` (capped
    /// at `i32::MAX`) with full layers, `i32::MAX` (positions are i32) without.
    pub fn context_limit(&self, geometry: &ContextGeometry) -> usize {
        let positions = i32::MAX as usize;
        if geometry.has_full_layers() {
            self.max_pages_per_lane
                .saturating_mul(self.page_size)
                .min(positions)
        } else {
            positions
        }
    }

    /// Device bytes the store allocates for this capacity: rings, paged pools and the page
    /// table.
    pub fn pool_bytes(&self, geometry: &ContextGeometry) -> PoolBytes {
        let per = KV_ELEMENT_BYTES * geometry.kv_width() as u64;
        let full = geometry.has_full_layers();
        let mut bytes = PoolBytes::default();
        for l in &geometry.layers {
            match *l {
                ContextLayerKind::Local { window } => {
                    bytes.rings += per * window as u64 * self.lanes as u64;
                }
                ContextLayerKind::Full => {
                    bytes.paged += per * self.page_size as u64 * self.pages as u64;
                }
            }
        }
        if full {
            bytes.page_table = 4 * (self.lanes * self.max_pages_per_lane) as u64;
        }
        bytes
    }
}

/// Device bytes of a store's pools (see [`Capacity::pool_bytes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct PoolBytes {
    /// All rings: local layers * lanes * S * Hkv * D * (2 + 2).
    pub rings: u64,
    /// All paged pools: full layers * pages * page_size * Hkv * D * (2 + 2).
    pub paged: u64,
    /// The page table: lanes * max_pages_per_lane * 4 (0 without full layers).
    pub page_table: u64,
}

impl PoolBytes {
    /// The sum.
    pub fn total(&self) -> u64 {
        self.rings + self.paged + self.page_table
    }
}
