//! The context store: pools, lanes, pages, frontiers, pending features and images.

use std::collections::VecDeque;

use dflash_ops::context_kv_materialize::{self, CacheLayout, MaterializeParams};
use dflash_ops::feature_projection::{self, FeatureProjectionParams};
use dflash_ops::{Backend, Borrowed, Buffer, Graph, OpsError, bf16, f16};

use crate::image::ImageShape;
use crate::{
    Capacity, ContextError, ContextGeometry, ContextImage, ContextLayerKind, HostContextImage,
    Result,
};

/// The value of a page-table entry that names no page.
pub const NO_PAGE: i32 = -1;

/// An opaque handle to one admitted request's context. It names a lane and a generation: a
/// handle stays invalid after [`ContextStore::release`], even when its lane is reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ContextHandle {
    lane: usize,
    generation: u64,
}

impl ContextHandle {
    /// The lane (ring row `lanes[r]` for the attention ops, page-table row of the store).
    pub fn lane(&self) -> usize {
        self.lane
    }
}

/// The weights [`ContextStore::materialize`] needs, bound by the caller (the draft crate).
#[derive(Debug)]
pub struct MaterializeWeights<'a> {
    /// `fc.weight`: `[H, n_ids * H]` BF16.
    pub fc: &'a Buffer<bf16>,
    /// `hidden_norm.weight` (the context norm): `[H]` BF16.
    pub hidden_norm: &'a Buffer<bf16>,
    /// Per draft layer, in order.
    pub layers: Vec<LayerKvWeights<'a>>,
}

/// One draft layer's context K/V weights. The projections are views ([`Buffer::view`]), so
/// they may be rows of a larger bound weight (the draft binds `[q_proj; k_proj; v_proj]` as
/// one).
#[derive(Debug)]
pub struct LayerKvWeights<'a> {
    /// `layers.{i}.self_attn.k_proj.weight`: `[Hkv * D, H]` BF16.
    pub w_k: Borrowed<'a, bf16>,
    /// `layers.{i}.self_attn.v_proj.weight`: `[Hkv * D, H]` BF16.
    pub w_v: Borrowed<'a, bf16>,
    /// `layers.{i}.self_attn.k_norm.weight`: `[D]` BF16.
    pub key_norm: &'a Buffer<bf16>,
}

/// One draft layer's pool, borrowed for the attention ops.
#[derive(Debug, Clone, Copy)]
pub enum LayerPool<'a> {
    /// A local layer's rings: K `[lanes, S, Hkv, D]` BF16, V the same in FP16; a request's
    /// lane is [`ContextHandle::lane`] (or [`BatchMetadata::lanes`]).
    Ring {
        /// K rings.
        k: &'a Buffer<bf16>,
        /// V rings.
        v: &'a Buffer<f16>,
        /// Lanes (concurrency B).
        lanes: usize,
        /// Ring capacity S (the window).
        window: usize,
    },
    /// A full layer's pages: K `[pages, page_size, Hkv, D]` BF16, V the same in FP16; a
    /// request's page-table row is in [`BatchMetadata::page_table`].
    Paged {
        /// K pages.
        k: &'a Buffer<bf16>,
        /// V pages.
        v: &'a Buffer<f16>,
        /// Pages in the pool.
        pages: usize,
        /// Tokens per page.
        page_size: usize,
        /// Page-table row width.
        max_pages: usize,
    },
}

impl LayerPool<'_> {
    /// The layout in the ops' terms.
    pub fn layout(&self) -> CacheLayout {
        match *self {
            LayerPool::Ring { lanes, window, .. } => CacheLayout::Ring {
                lanes,
                capacity: window,
            },
            LayerPool::Paged {
                pages,
                page_size,
                max_pages,
                ..
            } => CacheLayout::Paged {
                pages,
                page_size,
                max_pages,
            },
        }
    }
}

/// Device metadata of a compact batch, rows in the order of the handles passed to
/// [`ContextStore::batch_metadata`]. All I32.
#[derive(Debug)]
pub struct BatchMetadata {
    /// Rows (requests) in the batch.
    pub rows: usize,
    /// `[rows]`: each row's lane (the ring row for local layers).
    pub lanes: Buffer<i32>,
    /// `[rows]`: each row's context frontier F_ctx, which is also the absolute position of its
    /// block's anchor (`start_pos` of the attention ops).
    pub frontiers: Buffer<i32>,
    /// `[rows, max_pages]`: each row's page table (entries past its reservation are
    /// [`NO_PAGE`]); `None` when the draft has no full layer.
    pub page_table: Option<Buffer<i32>>,
}

/// A request's live interval of one layer, downloaded in position order.
#[derive(Debug, Clone, PartialEq)]
pub struct LiveWindow {
    /// First live position: `max(0, F_ctx - S)` for a local layer, 0 for a full layer.
    pub start: usize,
    /// One past the last live position: F_ctx.
    pub end: usize,
    /// K of positions `start..end`, `[end - start, Hkv, D]`.
    pub k: Vec<bf16>,
    /// V of positions `start..end`, `[end - start, Hkv, D]`.
    pub v: Vec<f16>,
}

/// Pending features of one push: positions `start..start + rows`.
#[derive(Debug)]
struct Pending {
    start: usize,
    rows: usize,
    features: Rows,
}

/// Where a pending entry's feature rows live.
#[derive(Debug)]
enum Rows {
    /// A buffer of exactly `rows` rows (a prefill chunk, or a push the round staging could
    /// not take).
    Owned(Buffer<bf16>),
    /// Rows `0..rows` of the lane's slab in [`RoundStaging`].
    Slab,
}

/// Buffers planned at startup for the context work of a round
/// ([`ContextStore::with_round_staging`]): a lane's verified rows are pushed into its slab
/// and materialized through fixed-shape scratch (the projection runs over the whole slab,
/// the cache writes over the live count), so a round allocates nothing.
#[derive(Debug)]
struct RoundStaging {
    /// Columns a lane's slab holds (at least one round's commit: W).
    cols: usize,
    /// The lanes' slabs `[lanes, cols, n_ids * H]` BF16 (lane `l` at `l * cols` rows).
    slab: Buffer<bf16>,
    /// Projected vectors `[lanes, cols, H]` BF16.
    c: Buffer<bf16>,
    /// Scratch of the projection and of the K/V materialize (F32; unused on the CPU).
    fp: Buffer<f32>,
    kv: Buffer<f32>,
    /// Per lane: first position and count of the materialize (`[lanes]`; 0: nothing).
    start: Buffer<i32>,
    count: Buffer<i32>,
    /// Lane ids `0..lanes` (row `l` of a round materialize writes lane `l`'s rings).
    lane_ids: Buffer<i32>,
    /// The round materialize captured as a CUDA graph, with the addresses of the weights
    /// it was captured with (it replays only for those).
    graph: Option<(Graph, Vec<u64>)>,
}

#[derive(Debug)]
struct Request {
    generation: u64,
    max_context: usize,
    /// F_ctx: positions `[0, frontier)` are materialized.
    frontier: usize,
    /// Pending columns: positions `[frontier, frontier + pending_cols)` are queued.
    pending_cols: usize,
    pending: VecDeque<Pending>,
    /// Reserved pages in page-table order (empty without full layers).
    pages: Vec<i32>,
    poisoned: bool,
}

#[derive(Debug)]
enum Pool {
    Ring {
        window: usize,
        k: Buffer<bf16>,
        v: Buffer<f16>,
    },
    Paged {
        k: Buffer<bf16>,
        v: Buffer<f16>,
    },
}

/// One contiguous run of elements between an image (or a host vector) and a pool.
#[derive(Debug, Clone, Copy)]
struct Segment {
    image: usize,
    pool: usize,
    len: usize,
}

/// The per-call metadata of phase 2 of a materialize: the lane (`[1]`) and the lane's
/// page-table row (full layers).
struct WriteMeta<'b> {
    lane: &'b Buffer<i32>,
    table: Option<&'b Buffer<i32>>,
}

/// The K/V materialize parameters of a chunk of `rows` requests' `cols` columns (the layout
/// is set per layer).
fn chunk_params(g: &ContextGeometry, rows: usize, cols: usize) -> MaterializeParams {
    MaterializeParams {
        rows,
        cols,
        hidden: g.hidden,
        kv_heads: g.kv_heads,
        head_dim: g.head_dim,
        eps: g.eps,
        theta: g.theta,
        layout: CacheLayout::Ring {
            lanes: 1,
            capacity: 1,
        },
    }
}

/// A slab entry without round staging: cannot happen (only a store with round staging makes
/// them); refused rather than assumed.
fn unreachable_slab<T>() -> Result<T> {
    Err(ContextError::Ops(OpsError::Param {
        op: "materialize",
        param: "round_cols",
        expected: "a store with round staging".into(),
        found: "a slab entry without one".into(),
    }))
}

/// Phase 2 of a materialize: write the store's `pools`, chunk by chunk in position order,
/// layer by layer. `(wrote anything, result)`.
#[allow(clippy::too_many_arguments)] // reason: the store's fields phase 2 reads, split from its staging
fn write_chunks(
    be: &Backend,
    g: &ContextGeometry,
    capacity: &Capacity,
    pools: &mut [Pool],
    chunks: &[Chunk<'_>],
    meta: &WriteMeta<'_>,
    kv_scratch: &mut Buffer<f32>,
    w: &MaterializeWeights<'_>,
    target: usize,
) -> (bool, Result<()>) {
    let lanes = capacity.lanes;
    let (pages, page_size, max_pages) = (
        capacity.pages,
        capacity.page_size,
        capacity.max_pages_per_lane,
    );
    let mut wrote = false;
    for chunk in chunks {
        let params = chunk_params(g, chunk.rows, chunk.cols);
        for (l, pool) in pools.iter_mut().enumerate() {
            let (layout, slots, k, v) = match pool {
                Pool::Ring { window, k, v } => {
                    // A ring keeps only positions >= target - S; earlier chunks would be
                    // overwritten before anyone could read them.
                    if chunk.end + *window <= target {
                        continue;
                    }
                    (
                        CacheLayout::Ring {
                            lanes,
                            capacity: *window,
                        },
                        meta.lane,
                        k,
                        v,
                    )
                }
                Pool::Paged { k, v } => match meta.table {
                    Some(t) => (
                        CacheLayout::Paged {
                            pages,
                            page_size,
                            max_pages,
                        },
                        t,
                        k,
                        v,
                    ),
                    None => continue,
                },
            };
            let p = MaterializeParams { layout, ..params };
            let lw = &w.layers[l];
            let res = context_kv_materialize::run_with_scratch(
                be,
                chunk.c,
                &lw.w_k,
                &lw.w_v,
                lw.key_norm,
                chunk.start_buf,
                chunk.count_buf,
                slots,
                k,
                v,
                kv_scratch,
                &p,
            );
            if let Err(e) = res {
                return (wrote, Err(ContextError::Ops(e)));
            }
            wrote = true;
        }
    }
    (wrote, Ok(()))
}

/// The addresses of the weights a round materialize reads (a captured graph replays only
/// for the same ones).
fn weight_key(w: &MaterializeWeights<'_>) -> Vec<u64> {
    let mut key = vec![w.fc.address(), w.hidden_norm.address()];
    for l in &w.layers {
        key.extend([l.w_k.address(), l.w_v.address(), l.key_norm.address()]);
    }
    key
}

/// Projected context vectors of one chunk, ready to be written: `rows` requests' columns
/// (`cols` each; how many are live and where they start is in the device metadata), ending
/// at position `end` (a round's chunk: at the target).
struct Chunk<'b> {
    end: usize,
    rows: usize,
    cols: usize,
    c: &'b Buffer<bf16>,
    start_buf: &'b Buffer<i32>,
    count_buf: &'b Buffer<i32>,
}

/// A chunk's buffers made by the general materialize path.
struct Projected {
    start: usize,
    n: usize,
    c: Buffer<bf16>,
    start_buf: Buffer<i32>,
    count_buf: Buffer<i32>,
}

/// Draft context storage on one [`Backend`]: per local layer a ring pool, per full layer a
/// paged pool (only when the draft has full layers), lanes and pages with their free lists,
/// and per admitted request its frontier, pending features and page table.
///
/// Every method validates everything before changing anything: an error other than
/// [`ContextError::Ops`] leaves the store exactly as it was. A device failure in the middle of
/// a multi-step update (materialize, restore) poisons that one request
/// ([`ContextError::Poisoned`]); it can then only be released.
#[derive(Debug)]
pub struct ContextStore {
    be: Backend,
    geometry: ContextGeometry,
    capacity: Capacity,
    pools: Vec<Pool>,
    /// `[lanes, max_pages]` on the device (full layers only).
    page_table: Option<Buffer<i32>>,
    /// Host mirror of `page_table` (empty without full layers).
    host_table: Vec<i32>,
    /// Free page ids (a stack; the next page taken is the last one).
    free_pages: Vec<i32>,
    lanes: Vec<Option<Request>>,
    next_generation: u64,
    round: Option<RoundStaging>,
}

fn wrong_backend(
    tensor: &'static str,
    expected: &'static str,
    found: &'static str,
) -> ContextError {
    ContextError::Ops(OpsError::WrongBackend {
        op: "dflash-context",
        tensor,
        expected,
        found,
    })
}

/// An i32 of a value the store has already bounded by `i32::MAX`.
fn to_i32(x: usize) -> i32 {
    i32::try_from(x).unwrap_or(i32::MAX)
}

impl ContextStore {
    /// Allocate the pools for `geometry` and `capacity` on `be` (all bytes zero, all lanes and
    /// pages free). See [`Capacity::pool_bytes`] for the sizes.
    pub fn new(be: Backend, geometry: ContextGeometry, capacity: Capacity) -> Result<Self> {
        geometry.validate()?;
        capacity.validate(&geometry)?;
        let kvw = geometry.kv_width();
        let full = geometry.has_full_layers();
        let mut pools = Vec::with_capacity(geometry.layers.len());
        for l in &geometry.layers {
            pools.push(match *l {
                ContextLayerKind::Local { window } => {
                    let len = capacity.lanes * window * kvw;
                    Pool::Ring {
                        window,
                        k: be.zeros(len)?,
                        v: be.zeros(len)?,
                    }
                }
                ContextLayerKind::Full => {
                    let len = capacity.pages * capacity.page_size * kvw;
                    Pool::Paged {
                        k: be.zeros(len)?,
                        v: be.zeros(len)?,
                    }
                }
            });
        }
        let (page_table, host_table, free_pages) = if full {
            let host = vec![NO_PAGE; capacity.lanes * capacity.max_pages_per_lane];
            let dev = be.upload(&host)?;
            // Reversed so that pages are handed out in ascending order.
            let free = (0..to_i32(capacity.pages)).rev().collect();
            (Some(dev), host, free)
        } else {
            (None, Vec::new(), Vec::new())
        };
        Ok(ContextStore {
            lanes: (0..capacity.lanes).map(|_| None).collect(),
            be,
            geometry,
            capacity,
            pools,
            page_table,
            host_table,
            free_pages,
            next_generation: 1,
            round: None,
        })
    }

    /// [`ContextStore::new`] plus the round staging: buffers for pushing up to `round_cols`
    /// verified rows per lane and materializing them with no allocation (a round's push and
    /// materialize then allocate nothing; longer queues, such as a prefill, still allocate
    /// their projections). `round_cols` is at least one round's commit (W = K + 1) and at
    /// most [`Capacity::chunk_cols`]. Bytes: [`ContextStore::round_staging_bytes`].
    pub fn with_round_staging(
        be: Backend,
        geometry: ContextGeometry,
        capacity: Capacity,
        round_cols: usize,
    ) -> Result<Self> {
        if round_cols == 0 || round_cols > capacity.chunk_cols {
            return Err(ContextError::InvalidGeometry {
                field: "round_cols",
                expected: format!("1..=capacity.chunk_cols ({})", capacity.chunk_cols),
                found: round_cols.to_string(),
            });
        }
        let mut store = Self::new(be, geometry, capacity)?;
        let g = &store.geometry;
        let be = &store.be;
        let lanes = store.capacity.lanes;
        let (fw, hidden) = (g.feature_width(), g.hidden);
        let (fp_len, kv_len) = Self::round_scratch_lens(g, lanes, round_cols)?;
        store.round = Some(RoundStaging {
            cols: round_cols,
            slab: be.zeros(lanes * round_cols * fw)?,
            c: be.zeros(lanes * round_cols * hidden)?,
            fp: be.zeros(fp_len)?,
            kv: be.zeros(kv_len)?,
            start: be.zeros(lanes)?,
            count: be.zeros(lanes)?,
            lane_ids: be.upload(&(0..to_i32(lanes)).collect::<Vec<i32>>())?,
            graph: None,
        });
        Ok(store)
    }

    /// F32 scratch lengths of a round's projection and K/V materialize over `lanes` lanes of
    /// `cols` columns (0 on neither: the CPU paths accept any length, the plan counts the
    /// CUDA ones).
    fn round_scratch_lens(
        g: &ContextGeometry,
        lanes: usize,
        cols: usize,
    ) -> Result<(usize, usize)> {
        let fp = feature_projection::scratch_len(&FeatureProjectionParams {
            tokens: lanes * cols,
            n_ids: g.n_ids,
            hidden: g.hidden,
            eps: g.eps,
        })?;
        let kv = context_kv_materialize::scratch_len(&chunk_params(g, lanes, cols))?;
        Ok((fp, kv))
    }

    /// Device bytes [`ContextStore::with_round_staging`] adds for `round_cols` columns.
    pub fn round_staging_bytes(
        geometry: &ContextGeometry,
        capacity: &Capacity,
        round_cols: usize,
    ) -> u64 {
        let (fw, h) = (geometry.feature_width() as u64, geometry.hidden as u64);
        let (lanes, cols) = (capacity.lanes as u64, round_cols as u64);
        let (fp, kv) =
            Self::round_scratch_lens(geometry, capacity.lanes, round_cols).unwrap_or((0, 0));
        2 * lanes * cols * (fw + h) + 4 * (fp + kv) as u64 + 4 * 3 * lanes
    }

    /// The backend the pools live on.
    pub fn backend(&self) -> &Backend {
        &self.be
    }

    /// The geometry.
    pub fn geometry(&self) -> &ContextGeometry {
        &self.geometry
    }

    /// The capacity.
    pub fn capacity(&self) -> &Capacity {
        &self.capacity
    }

    /// Lanes not holding a request.
    pub fn free_lanes(&self) -> usize {
        self.lanes.iter().filter(|l| l.is_none()).count()
    }

    /// Pages of the full-layer pool not reserved by a request (0 without full layers).
    pub fn free_pages(&self) -> usize {
        self.free_pages.len()
    }

    /// The handles of every admitted request, in lane order.
    pub fn handles(&self) -> Vec<ContextHandle> {
        self.lanes
            .iter()
            .enumerate()
            .filter_map(|(lane, r)| {
                r.as_ref().map(|r| ContextHandle {
                    lane,
                    generation: r.generation,
                })
            })
            .collect()
    }

    /// The longest maximum context [`ContextStore::admit`] accepts.
    pub fn context_limit(&self) -> usize {
        self.capacity.context_limit(&self.geometry)
    }

    fn pages_for(&self, max_context: usize) -> usize {
        if self.geometry.has_full_layers() {
            max_context.div_ceil(self.capacity.page_size)
        } else {
            0
        }
    }

    fn lookup(&self, h: ContextHandle) -> Result<&Request> {
        match self.lanes.get(h.lane).and_then(|r| r.as_ref()) {
            Some(r) if r.generation == h.generation => {
                if r.poisoned {
                    Err(ContextError::Poisoned)
                } else {
                    Ok(r)
                }
            }
            _ => Err(ContextError::UnknownHandle {
                lane: h.lane,
                generation: h.generation,
            }),
        }
    }

    fn lookup_mut(&mut self, h: ContextHandle) -> Result<&mut Request> {
        self.lookup(h)?;
        match self.lanes.get_mut(h.lane).and_then(|r| r.as_mut()) {
            Some(r) => Ok(r),
            None => Err(ContextError::UnknownHandle {
                lane: h.lane,
                generation: h.generation,
            }),
        }
    }

    /// Checks of an admission that change nothing: the limit, a free lane, enough pages.
    /// Returns the free lane and the page count.
    fn admission(&self, max_context: usize) -> Result<(usize, usize)> {
        let limit = self.context_limit();
        if max_context > limit {
            return Err(ContextError::ContextTooLong {
                requested: max_context,
                limit,
            });
        }
        let lane = self
            .lanes
            .iter()
            .position(|l| l.is_none())
            .ok_or(ContextError::NoFreeLane {
                lanes: self.capacity.lanes,
            })?;
        let needed = self.pages_for(max_context);
        if needed > self.free_pages.len() {
            return Err(ContextError::InsufficientPages {
                needed,
                free: self.free_pages.len(),
            });
        }
        Ok((lane, needed))
    }

    /// Admit a request that may reach `max_context` context positions: takes a free lane and,
    /// for drafts with full layers, reserves `ceil(max_context / page_size)` pages (written
    /// into the lane's page-table row). The context starts empty (F_ctx = 0, nothing pending).
    ///
    /// Errors: [`ContextError::ContextTooLong`] past [`ContextStore::context_limit`],
    /// [`ContextError::NoFreeLane`], [`ContextError::InsufficientPages`].
    pub fn admit(&mut self, max_context: usize) -> Result<ContextHandle> {
        let (lane, needed) = self.admission(max_context)?;
        let pages: Vec<i32> = self.free_pages[self.free_pages.len() - needed..]
            .iter()
            .rev()
            .copied()
            .collect();
        if let Some(table) = &mut self.page_table {
            let w = self.capacity.max_pages_per_lane;
            let mut row = vec![NO_PAGE; w];
            row[..needed].copy_from_slice(&pages);
            self.be.write(table, lane * w, &row)?;
            self.host_table[lane * w..(lane + 1) * w].copy_from_slice(&row);
        }
        let new_len = self.free_pages.len() - needed;
        self.free_pages.truncate(new_len);
        let generation = self.next_generation;
        self.next_generation += 1;
        self.lanes[lane] = Some(Request {
            generation,
            max_context,
            frontier: 0,
            pending_cols: 0,
            pending: VecDeque::new(),
            pages,
            poisoned: false,
        });
        Ok(ContextHandle { lane, generation })
    }

    /// Release a request: its lane, its pages and its pending features return to the store;
    /// the handle becomes invalid. Works on a poisoned request too.
    pub fn release(&mut self, h: ContextHandle) -> Result<()> {
        match self.lanes.get(h.lane).and_then(|r| r.as_ref()) {
            Some(r) if r.generation == h.generation => {}
            _ => {
                return Err(ContextError::UnknownHandle {
                    lane: h.lane,
                    generation: h.generation,
                });
            }
        }
        if let Some(table) = &mut self.page_table {
            let w = self.capacity.max_pages_per_lane;
            self.be.write(table, h.lane * w, &vec![NO_PAGE; w])?;
            self.host_table[h.lane * w..(h.lane + 1) * w].fill(NO_PAGE);
        }
        if let Some(r) = self.lanes[h.lane].take() {
            // Pages go back so that the next admission takes them in the same order.
            self.free_pages.extend(r.pages.iter().rev());
        }
        Ok(())
    }

    /// The request's context frontier F_ctx: positions `[0, F_ctx)` are materialized.
    pub fn frontier(&self, h: ContextHandle) -> Result<usize> {
        Ok(self.lookup(h)?.frontier)
    }

    /// Pending feature columns (positions `[F_ctx, F_ctx + pending)`).
    pub fn pending(&self, h: ContextHandle) -> Result<usize> {
        Ok(self.lookup(h)?.pending_cols)
    }

    /// `F_ctx + pending`: the target frontier the request's storage agrees with.
    pub fn pending_target_frontier(&self, h: ContextHandle) -> Result<usize> {
        let r = self.lookup(h)?;
        Ok(r.frontier + r.pending_cols)
    }

    /// The pushes still pending, as `(start position, columns)` in order.
    pub fn pending_ranges(&self, h: ContextHandle) -> Result<Vec<(usize, usize)>> {
        Ok(self
            .lookup(h)?
            .pending
            .iter()
            .map(|p| (p.start, p.rows))
            .collect())
    }

    /// The request's declared maximum context.
    pub fn max_context(&self, h: ContextHandle) -> Result<usize> {
        Ok(self.lookup(h)?.max_context)
    }

    /// The request's reserved pages in page-table order (empty without full layers).
    pub fn pages(&self, h: ContextHandle) -> Result<&[i32]> {
        Ok(&self.lookup(h)?.pages)
    }

    /// Check that the request's storage (materialized plus pending) agrees with a target
    /// state at `target_frontier`: `F_ctx + pending == target_frontier`, else
    /// [`ContextError::CoverageMismatch`].
    pub fn check_coverage(&self, h: ContextHandle, target_frontier: usize) -> Result<()> {
        let r = self.lookup(h)?;
        let context = r.frontier + r.pending_cols;
        if context != target_frontier {
            return Err(ContextError::CoverageMismatch {
                context,
                target: target_frontier,
            });
        }
        Ok(())
    }

    /// Validate a push of `n` rows from a feature buffer of `len` elements on `backend`.
    fn check_push(
        &self,
        h: ContextHandle,
        start_pos: usize,
        len: usize,
        backend: &'static str,
        first_row: usize,
        n: usize,
    ) -> Result<()> {
        let r = self.lookup(h)?;
        let fw = self.geometry.feature_width();
        // `n` rows from row `first_row`: the buffer must hold `first_row + n` rows.
        let rows = first_row.saturating_add(n);
        if !len.is_multiple_of(fw) || len / fw < rows {
            return Err(ContextError::FeatureShape {
                width: fw,
                len,
                rows,
            });
        }
        if backend != self.be.name() {
            return Err(wrong_backend("features", self.be.name(), backend));
        }
        let expected = r.frontier + r.pending_cols;
        if start_pos != expected {
            return Err(ContextError::OutOfOrder {
                expected,
                found: start_pos,
            });
        }
        let end = start_pos.saturating_add(n);
        if end > r.max_context {
            return Err(ContextError::ContextOverflow {
                end,
                max_context: r.max_context,
            });
        }
        Ok(())
    }

    /// Queue the first `n` rows of `features` (`[rows >= n, n_ids * H]` BF16, captured target
    /// features of positions `start_pos..start_pos + n`) as pending context work; the store
    /// keeps a device copy, so `features` may be reused at once. This is what the engine calls
    /// after committing N rows. `n = 0` changes nothing (after the same checks).
    ///
    /// Errors: [`ContextError::FeatureShape`], [`ContextError::OutOfOrder`] unless
    /// `start_pos == F_ctx + pending` (no gap, no overlap), [`ContextError::ContextOverflow`]
    /// past the declared maximum context, a wrong-backend [`ContextError::Ops`].
    pub fn push_pending(
        &mut self,
        h: ContextHandle,
        start_pos: usize,
        features: &Buffer<bf16>,
        n: usize,
    ) -> Result<()> {
        self.push_pending_rows(h, start_pos, features, 0, n)
    }

    /// [`ContextStore::push_pending`] of rows `first_row .. first_row + n` of `features`
    /// (e.g. one request's rows of a verify batch's features, copied straight into the
    /// request's slab).
    pub fn push_pending_rows(
        &mut self,
        h: ContextHandle,
        start_pos: usize,
        features: &Buffer<bf16>,
        first_row: usize,
        n: usize,
    ) -> Result<()> {
        self.check_push(
            h,
            start_pos,
            features.len(),
            features.backend_name(),
            first_row,
            n,
        )?;
        if n == 0 {
            return Ok(());
        }
        let fw = self.geometry.feature_width();
        let (from, len) = (first_row * fw, n * fw);
        let empty_queue = self.lookup(h)?.pending.is_empty();
        if let Some(rs) = &mut self.round
            && empty_queue
            && n <= rs.cols
        {
            let at = h.lane * rs.cols * fw;
            self.be.copy(features, from, &mut rs.slab, at, len)?;
            return self.enqueue(h, start_pos, n, Rows::Slab);
        }
        let mut copy = self.be.zeros(len)?;
        self.be.copy(features, from, &mut copy, 0, len)?;
        self.enqueue(h, start_pos, n, Rows::Owned(copy))
    }

    /// Queue every row of `features` (`[n, n_ids * H]` BF16, positions
    /// `start_pos..start_pos + n`) as pending context work, taking the buffer without a copy
    /// (a prefill chunk). Same checks as [`ContextStore::push_pending`].
    pub fn push_pending_owned(
        &mut self,
        h: ContextHandle,
        start_pos: usize,
        features: Buffer<bf16>,
    ) -> Result<()> {
        let fw = self.geometry.feature_width();
        let n = features.len() / fw;
        self.check_push(h, start_pos, features.len(), features.backend_name(), 0, n)?;
        if n == 0 {
            return Ok(());
        }
        self.enqueue(h, start_pos, n, Rows::Owned(features))
    }

    fn enqueue(
        &mut self,
        h: ContextHandle,
        start: usize,
        rows: usize,
        features: Rows,
    ) -> Result<()> {
        let r = self.lookup_mut(h)?;
        r.pending.push_back(Pending {
            start,
            rows,
            features,
        });
        r.pending_cols += rows;
        Ok(())
    }

    fn check_weights(&self, w: &MaterializeWeights<'_>) -> Result<()> {
        let g = &self.geometry;
        let name = self.be.name();
        let check = |n: String, buf: &Buffer<bf16>, expected: usize, shape: String| {
            if buf.len() != expected {
                return Err(ContextError::Weight {
                    name: n,
                    problem: format!(
                        "expected {expected} elements ({shape}), found {}",
                        buf.len()
                    ),
                });
            }
            if buf.backend_name() != name {
                return Err(ContextError::Weight {
                    name: n,
                    problem: format!(
                        "lives on the {} backend, the store on {name}",
                        buf.backend_name()
                    ),
                });
            }
            Ok(())
        };
        let (h, fw, kvw, d) = (g.hidden, g.feature_width(), g.kv_width(), g.head_dim);
        check("fc".into(), w.fc, h * fw, format!("[H={h}, n_ids*H={fw}]"))?;
        check("hidden_norm".into(), w.hidden_norm, h, format!("[H={h}]"))?;
        if w.layers.len() != g.layers.len() {
            return Err(ContextError::Weight {
                name: "layers".into(),
                problem: format!(
                    "expected {} layers, found {}",
                    g.layers.len(),
                    w.layers.len()
                ),
            });
        }
        for (i, l) in w.layers.iter().enumerate() {
            let shape = format!("[Hkv*D={kvw}, H={h}]");
            check(format!("layers[{i}].w_k"), &l.w_k, kvw * h, shape.clone())?;
            check(format!("layers[{i}].w_v"), &l.w_v, kvw * h, shape)?;
            check(
                format!("layers[{i}].key_norm"),
                l.key_norm,
                d,
                format!("[D={d}]"),
            )?;
        }
        Ok(())
    }

    fn f32_scratch(&self, len: usize) -> Result<Buffer<f32>> {
        // The CPU paths never touch their scratch and accept any length.
        Ok(self.be.zeros(if self.be.is_cpu() { 0 } else { len })?)
    }

    /// Materialize the request's pending features: feature projection, then per layer the
    /// context K/V materialize, in chunks of at most [`Capacity::chunk_cols`] columns, in
    /// position order; then F_ctx advances to `F_ctx + pending` and the queue empties.
    ///
    /// Columns that no layer keeps are skipped: without full layers, only the final
    /// `max window` positions of the queue are projected (a prefill longer than the ring
    /// stores only its final window, yet the frontier advances by the whole chunk); with full
    /// layers every column is projected and every column reaches the pages, while each ring
    /// keeps its final window. Nothing pending: nothing happens.
    ///
    /// Transactional: all projections (and their scratch) are made before the first cache
    /// write, so an error there leaves the store unchanged; a device failure during the cache
    /// writes poisons the request. Scratch: `columns * H` BF16 for the projected vectors.
    ///
    /// Errors: [`ContextError::Weight`] for a weight of the wrong length or backend; device
    /// errors as [`ContextError::Ops`].
    pub fn materialize(&mut self, h: ContextHandle, w: &MaterializeWeights<'_>) -> Result<()> {
        let r = self.lookup(h)?;
        self.check_weights(w)?;
        if r.pending_cols == 0 {
            return Ok(());
        }
        let g = &self.geometry;
        let (fw, hidden) = (g.feature_width(), g.hidden);
        let target = r.frontier + r.pending_cols;
        let need_from = if g.has_full_layers() {
            r.frontier
        } else {
            target
                .saturating_sub(g.max_window().unwrap_or(0))
                .max(r.frontier)
        };

        // Phase 1: project every needed chunk (no cache write yet).
        let max_chunk = self.capacity.chunk_cols;
        let mut plan: Vec<(usize, usize, usize)> = Vec::new(); // (entry, offset, n)
        for (e, p) in r.pending.iter().enumerate() {
            let from = need_from.max(p.start);
            let end = p.start + p.rows;
            let mut at = from;
            while at < end {
                let n = (end - at).min(max_chunk);
                plan.push((e, at - p.start, n));
                at += n;
            }
        }
        // A round's queue: one slab entry, projected whole through the round staging.
        if let [(0, 0, n)] = plan[..]
            && matches!(r.pending[0].features, Rows::Slab)
            && n == r.pending[0].rows
        {
            return self.materialize_slabs(&[h], w);
        }
        let widest = plan.iter().map(|c| c.2).max().unwrap_or(0);
        let mut fp_scratch = self.f32_scratch(widest * hidden)?;
        let mut projected = Vec::with_capacity(plan.len());
        for &(e, offset, n) in &plan {
            let entry = &r.pending[e];
            let params = FeatureProjectionParams {
                tokens: n,
                n_ids: g.n_ids,
                hidden,
                eps: g.eps,
            };
            let mut c = self.be.zeros(n * hidden)?;
            // The entry's rows: its own buffer, or the lane's part of the slab.
            let (source, at) = match &entry.features {
                Rows::Owned(b) => (b, offset),
                Rows::Slab => match &self.round {
                    Some(rs) => (&rs.slab, h.lane * rs.cols + offset),
                    None => unreachable_slab()?,
                },
            };
            if offset == 0 && n == entry.rows && matches!(entry.features, Rows::Owned(_)) {
                feature_projection::run_with_scratch(
                    &self.be,
                    source,
                    w.fc,
                    w.hidden_norm,
                    &mut c,
                    &mut fp_scratch,
                    &params,
                )?;
            } else {
                let mut s = self.be.zeros(n * fw)?;
                self.be.copy(source, at * fw, &mut s, 0, n * fw)?;
                feature_projection::run_with_scratch(
                    &self.be,
                    &s,
                    w.fc,
                    w.hidden_norm,
                    &mut c,
                    &mut fp_scratch,
                    &params,
                )?;
            }
            let start = entry.start + offset;
            projected.push(Projected {
                start,
                n,
                c,
                start_buf: self.be.upload(&[to_i32(start)])?,
                count_buf: self.be.upload(&[to_i32(n)])?,
            });
        }
        let lane = self.be.upload(&[to_i32(h.lane)])?;
        let table = match self.page_table {
            Some(_) => {
                let wdt = self.capacity.max_pages_per_lane;
                Some(
                    self.be
                        .upload(&self.host_table[h.lane * wdt..(h.lane + 1) * wdt])?,
                )
            }
            None => None,
        };
        let mut kv_scratch = self.f32_scratch(context_kv_materialize::scratch_len(
            &chunk_params(&self.geometry, 1, widest),
        )?)?;
        let chunks: Vec<Chunk<'_>> = projected
            .iter()
            .map(|p| Chunk {
                end: p.start + p.n,
                rows: 1,
                cols: p.n,
                c: &p.c,
                start_buf: &p.start_buf,
                count_buf: &p.count_buf,
            })
            .collect();
        let meta = WriteMeta {
            lane: &lane,
            table: table.as_ref(),
        };
        let res = write_chunks(
            &self.be,
            &self.geometry,
            &self.capacity,
            &mut self.pools,
            &chunks,
            &meta,
            &mut kv_scratch,
            w,
            target,
        );
        self.finish_materialize(h, target, res)
    }

    /// Materialize the pending features of every request in `handles` (distinct, each live):
    /// the same result as [`ContextStore::materialize`] of each, in one batched call where
    /// it can. Requests whose queue is one round's slab entry (what the engine pushes after
    /// a commit) are materialized together through the round staging: one projection over
    /// every lane's slab and one K/V materialize per layer with a row per lane (lanes with
    /// nothing to write have count 0), with fixed shapes, so it allocates nothing and
    /// replays as a CUDA graph once [`ContextStore::capture_round`] recorded one for `w`;
    /// any other queue (a prefill, several pushes) goes through [`ContextStore::materialize`]
    /// first. Nothing pending: nothing happens.
    ///
    /// Errors: those of [`ContextStore::materialize`], plus [`ContextError::DuplicateHandle`]
    /// (checked, with every handle's validity, before any work). A device failure during the
    /// batched cache writes poisons the batched requests.
    pub fn materialize_round(
        &mut self,
        handles: &[ContextHandle],
        w: &MaterializeWeights<'_>,
    ) -> Result<()> {
        self.check_weights(w)?;
        for (row, &h) in handles.iter().enumerate() {
            self.lookup(h)?;
            if let Some(first) = handles[..row].iter().position(|o| o.lane == h.lane) {
                return Err(ContextError::DuplicateHandle {
                    lane: h.lane,
                    first,
                    second: row,
                });
            }
        }
        let mut slabs = Vec::with_capacity(handles.len());
        for &h in handles {
            let r = self.lookup(h)?;
            let slab_only = self.round.is_some()
                && r.pending.len() == 1
                && matches!(r.pending[0].features, Rows::Slab);
            if slab_only {
                slabs.push(h);
            } else {
                self.materialize(h, w)?;
            }
        }
        self.materialize_slabs(&slabs, w)
    }

    /// Record the batched part of [`ContextStore::materialize_round`] for weights `w` as a
    /// CUDA graph (after one eager run with nothing to write, which loads its kernels): later
    /// rounds with the same weights replay it after writing the lanes' counts. A store
    /// without round staging, or a backend that cannot capture, keeps running it eagerly
    /// (`Ok(false)`); `Ok(true)` when a graph was recorded.
    pub fn capture_round(&mut self, w: &MaterializeWeights<'_>) -> Result<bool> {
        self.check_weights(w)?;
        if self.round.is_none() || self.be.can_capture().is_err() {
            return Ok(false);
        }
        let zeros = vec![0; self.capacity.lanes];
        self.write_round_meta(&zeros, &zeros)?;
        self.write_round(w).1?;
        let be = self.be.clone();
        let graph = be.capture(|| {
            self.write_round(w).1.map_err(|e| match e {
                ContextError::Ops(e) => e,
                other => OpsError::Capture {
                    problem: other.to_string(),
                },
            })
        })?;
        if let Some(rs) = &mut self.round {
            rs.graph = Some((graph, weight_key(w)));
        }
        Ok(true)
    }

    /// Write the lanes' first positions and counts of a round materialize (`[lanes]` each;
    /// count 0: nothing). A store without round staging: refused.
    fn write_round_meta(&mut self, start: &[i32], count: &[i32]) -> Result<()> {
        let Some(rs) = self.round.as_mut() else {
            return unreachable_slab();
        };
        self.be.write(&mut rs.start, 0, start)?;
        self.be.write(&mut rs.count, 0, count)?;
        Ok(())
    }

    /// The device work of a round materialize, for every lane at once (fixed shapes): the
    /// projection of all slabs, then per layer the K/V materialize of a row per lane, reading
    /// the lanes' starts and counts written before. `(wrote, result)`.
    fn write_round(&mut self, w: &MaterializeWeights<'_>) -> (bool, Result<()>) {
        let ContextStore {
            be,
            geometry: g,
            capacity,
            pools,
            page_table,
            round,
            ..
        } = self;
        let Some(rs) = round.as_mut() else {
            return (false, unreachable_slab());
        };
        let params = FeatureProjectionParams {
            tokens: capacity.lanes * rs.cols,
            n_ids: g.n_ids,
            hidden: g.hidden,
            eps: g.eps,
        };
        if let Err(e) = feature_projection::run_with_scratch(
            be,
            &rs.slab,
            w.fc,
            w.hidden_norm,
            &mut rs.c,
            &mut rs.fp,
            &params,
        ) {
            return (false, Err(ContextError::Ops(e)));
        }
        let chunk = Chunk {
            // Each lane's chunk ends at its target: no ring skips it.
            end: usize::MAX / 2,
            rows: capacity.lanes,
            cols: rs.cols,
            c: &rs.c,
            start_buf: &rs.start,
            count_buf: &rs.count,
        };
        let meta = WriteMeta {
            lane: &rs.lane_ids,
            table: page_table.as_ref(),
        };
        write_chunks(be, g, capacity, pools, &[chunk], &meta, &mut rs.kv, w, 0)
    }

    /// Materialize requests whose queue is one slab entry, together through the round
    /// staging (see [`ContextStore::materialize_round`]).
    fn materialize_slabs(
        &mut self,
        handles: &[ContextHandle],
        w: &MaterializeWeights<'_>,
    ) -> Result<()> {
        if handles.is_empty() {
            return Ok(());
        }
        let lanes = self.capacity.lanes;
        let (mut start, mut count) = (vec![0i32; lanes], vec![0i32; lanes]);
        let mut targets = Vec::with_capacity(handles.len());
        for &h in handles {
            let r = self.lookup(h)?;
            let Some(p) = r.pending.front() else {
                continue;
            };
            start[h.lane] = to_i32(p.start);
            count[h.lane] = to_i32(p.rows);
            targets.push((h, r.frontier + r.pending_cols));
        }
        let (wrote, res) = match self.write_round_meta(&start, &count) {
            Err(e) => (false, Err(e)),
            Ok(()) => {
                let replayed = match self.round.as_ref().and_then(|rs| rs.graph.as_ref()) {
                    Some((graph, key)) if *key == weight_key(w) => Some(graph.launch()),
                    _ => None,
                };
                match replayed {
                    // A launch failure may have written some of the caches.
                    Some(r) => (true, r.map_err(ContextError::Ops)),
                    None => self.write_round(w),
                }
            }
        };
        let mut first_error = res.err();
        for (h, target) in targets {
            let outcome = match &first_error {
                None => Ok(()),
                Some(_) => Err(ContextError::Poisoned),
            };
            if let Err(e) = self.finish_materialize(h, target, (wrote, outcome))
                && first_error.is_none()
            {
                first_error = Some(e);
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Advance the request to `target` on success; on a failure after a cache write, poison
    /// it.
    fn finish_materialize(
        &mut self,
        h: ContextHandle,
        target: usize,
        (wrote, outcome): (bool, Result<()>),
    ) -> Result<()> {
        let r = self.lookup_mut(h)?;
        match outcome {
            Ok(()) => {
                r.frontier = target;
                r.pending_cols = 0;
                r.pending.clear();
                Ok(())
            }
            Err(e) => {
                if wrote {
                    r.poisoned = true;
                }
                Err(e)
            }
        }
    }

    /// The segments of layer `l` of request `r` in image order (see [`crate::image`]).
    fn segments(&self, lane: usize, r: &Request, l: usize, frontier: usize) -> Vec<Segment> {
        let kvw = self.geometry.kv_width();
        match &self.pools[l] {
            Pool::Ring { window, .. } => {
                let live = frontier.min(*window);
                if live == 0 {
                    return Vec::new();
                }
                vec![Segment {
                    image: 0,
                    pool: lane * window * kvw,
                    len: live * kvw,
                }]
            }
            Pool::Paged { .. } => {
                let ps = self.capacity.page_size;
                let mut out = Vec::new();
                let mut pos = 0;
                while pos < frontier {
                    let j = pos / ps;
                    let n = (frontier - pos).min(ps);
                    let page = usize::try_from(r.pages[j]).unwrap_or(0);
                    out.push(Segment {
                        image: pos * kvw,
                        pool: page * ps * kvw,
                        len: n * kvw,
                    });
                    pos += n;
                }
                out
            }
        }
    }

    fn require_no_pending(r: &Request) -> Result<()> {
        if r.pending_cols > 0 {
            return Err(ContextError::PendingFeatures {
                pending: r.pending_cols,
            });
        }
        Ok(())
    }

    /// A device copy of the request's materialized context (a checkpoint) carrying its
    /// coverage F_ctx. The payload is exactly the live bytes ([`crate::image`]).
    ///
    /// Errors: [`ContextError::PendingFeatures`] when features are pending (the caller
    /// materializes first, then retries); the store is unchanged either way.
    pub fn checkpoint(&self, h: ContextHandle) -> Result<ContextImage> {
        let r = self.lookup(h)?;
        Self::require_no_pending(r)?;
        let shape = ImageShape::of(&self.geometry);
        let mut layers = Vec::with_capacity(self.pools.len());
        for (l, pool) in self.pools.iter().enumerate() {
            let len = shape.layer_len(l, r.frontier);
            let mut k = self.be.zeros::<bf16>(len)?;
            let mut v = self.be.zeros::<f16>(len)?;
            let (pk, pv) = match pool {
                Pool::Ring { k, v, .. } | Pool::Paged { k, v } => (k, v),
            };
            for s in self.segments(h.lane, r, l, r.frontier) {
                self.be.copy(pk, s.pool, &mut k, s.image, s.len)?;
                self.be.copy(pv, s.pool, &mut v, s.image, s.len)?;
            }
            layers.push((k, v));
        }
        Ok(ContextImage {
            shape,
            frontier: r.frontier,
            backend: self.be.name(),
            layers,
        })
    }

    /// A host copy of the request's materialized context (a Host replica) carrying its
    /// coverage F_ctx. Errors as [`ContextStore::checkpoint`].
    pub fn host_replica(&self, h: ContextHandle) -> Result<HostContextImage> {
        let r = self.lookup(h)?;
        Self::require_no_pending(r)?;
        let shape = ImageShape::of(&self.geometry);
        let mut layers = Vec::with_capacity(self.pools.len());
        for (l, pool) in self.pools.iter().enumerate() {
            let len = shape.layer_len(l, r.frontier);
            let mut k = Vec::with_capacity(len);
            let mut v = Vec::with_capacity(len);
            let (pk, pv) = match pool {
                Pool::Ring { k, v, .. } | Pool::Paged { k, v } => (k, v),
            };
            for s in self.segments(h.lane, r, l, r.frontier) {
                k.extend(self.be.read(pk, s.pool, s.len)?);
                v.extend(self.be.read(pv, s.pool, s.len)?);
            }
            layers.push((k, v));
        }
        Ok(HostContextImage {
            shape,
            frontier: r.frontier,
            layers,
        })
    }

    /// Fork the request into a fresh lane on the device: the new request has the same
    /// declared maximum context (and reserves its own pages), the same F_ctx and a copy of
    /// every live byte; nothing pending. The source is unchanged.
    ///
    /// Errors: [`ContextError::PendingFeatures`] (materialize first),
    /// [`ContextError::NoFreeLane`], [`ContextError::InsufficientPages`]; the store is
    /// unchanged on any of them.
    pub fn fork(&mut self, h: ContextHandle) -> Result<ContextHandle> {
        let r = self.lookup(h)?;
        Self::require_no_pending(r)?;
        let (max_context, frontier) = (r.max_context, r.frontier);
        self.admission(max_context)?;
        // The pools are single buffers; copy through an image (two device copies).
        let image = self.checkpoint(h)?;
        self.admit_restored(max_context, &image, frontier)
    }

    fn check_restore(
        &self,
        shape: &ImageShape,
        frontier: usize,
        target_frontier: usize,
        max_context: usize,
    ) -> Result<()> {
        if let Some(what) = shape.difference(&ImageShape::of(&self.geometry)) {
            return Err(ContextError::ImageMismatch { what });
        }
        if frontier != target_frontier {
            return Err(ContextError::CoverageMismatch {
                context: frontier,
                target: target_frontier,
            });
        }
        if frontier > max_context {
            return Err(ContextError::ImageTooLong {
                frontier,
                max_context,
            });
        }
        Ok(())
    }

    /// Write an already validated image into request `h` (lane, pages); F_ctx becomes the
    /// image's frontier. A device failure after the first write poisons the request.
    fn write_image<F>(&mut self, h: ContextHandle, frontier: usize, mut put: F) -> Result<()>
    where
        F: FnMut(&Backend, usize, Segment, &mut Buffer<bf16>, &mut Buffer<f16>) -> Result<()>,
    {
        let r = self.lookup(h)?;
        let segments: Vec<Vec<Segment>> = (0..self.pools.len())
            .map(|l| self.segments(h.lane, r, l, frontier))
            .collect();
        let mut wrote = false;
        let mut outcome = Ok(());
        'write: for (l, pool) in self.pools.iter_mut().enumerate() {
            let (pk, pv) = match pool {
                Pool::Ring { k, v, .. } | Pool::Paged { k, v } => (k, v),
            };
            for &s in &segments[l] {
                if let Err(e) = put(&self.be, l, s, pk, pv) {
                    outcome = Err(e);
                    break 'write;
                }
                wrote = true;
            }
        }
        let r = self.lookup_mut(h)?;
        match outcome {
            Ok(()) => {
                r.frontier = frontier;
                Ok(())
            }
            Err(e) => {
                if wrote {
                    r.poisoned = true;
                }
                Err(e)
            }
        }
    }

    fn device_put(
        image: &ContextImage,
    ) -> impl FnMut(&Backend, usize, Segment, &mut Buffer<bf16>, &mut Buffer<f16>) -> Result<()> + '_
    {
        move |be, l, s, pk, pv| {
            let (k, v) = &image.layers[l];
            be.copy(k, s.image, pk, s.pool, s.len)?;
            be.copy(v, s.image, pv, s.pool, s.len)?;
            Ok(())
        }
    }

    fn host_put(
        image: &HostContextImage,
    ) -> impl FnMut(&Backend, usize, Segment, &mut Buffer<bf16>, &mut Buffer<f16>) -> Result<()> + '_
    {
        move |be, l, s, pk, pv| {
            let (k, v) = &image.layers[l];
            be.write(pk, s.pool, &k[s.image..s.image + s.len])?;
            be.write(pv, s.pool, &v[s.image..s.image + s.len])?;
            Ok(())
        }
    }

    fn check_image_backend(&self, image: &ContextImage) -> Result<()> {
        if image.backend != self.be.name() {
            return Err(wrong_backend("image", self.be.name(), image.backend));
        }
        Ok(())
    }

    /// Replace request `h`'s context with a device image, attached to a target state at
    /// `target_frontier`. Afterwards F_ctx is the image's frontier and the live bytes are the
    /// image's.
    ///
    /// Errors (store unchanged): [`ContextError::PendingFeatures`] when `h` has pending
    /// features; [`ContextError::ImageMismatch`] for an image of another geometry (or
    /// backend: [`ContextError::Ops`]); [`ContextError::CoverageMismatch`] unless the image's
    /// frontier equals `target_frontier`; [`ContextError::ImageTooLong`] past `h`'s maximum
    /// context.
    pub fn restore(
        &mut self,
        h: ContextHandle,
        image: &ContextImage,
        target_frontier: usize,
    ) -> Result<()> {
        let r = self.lookup(h)?;
        Self::require_no_pending(r)?;
        self.check_image_backend(image)?;
        self.check_restore(&image.shape, image.frontier, target_frontier, r.max_context)?;
        self.write_image(h, image.frontier, Self::device_put(image))
    }

    /// [`ContextStore::restore`] from a host image.
    pub fn restore_host(
        &mut self,
        h: ContextHandle,
        image: &HostContextImage,
        target_frontier: usize,
    ) -> Result<()> {
        let r = self.lookup(h)?;
        Self::require_no_pending(r)?;
        self.check_restore(&image.shape, image.frontier, target_frontier, r.max_context)?;
        self.write_image(h, image.frontier, Self::host_put(image))
    }

    /// Admit a new request (as [`ContextStore::admit`]) holding a device image, attached to a
    /// target state at `target_frontier`. Errors of both; on any error the store is unchanged
    /// (a device failure while writing releases the new request).
    pub fn admit_restored(
        &mut self,
        max_context: usize,
        image: &ContextImage,
        target_frontier: usize,
    ) -> Result<ContextHandle> {
        self.check_image_backend(image)?;
        self.check_restore(&image.shape, image.frontier, target_frontier, max_context)?;
        let h = self.admit(max_context)?;
        match self.write_image(h, image.frontier, Self::device_put(image)) {
            Ok(()) => Ok(h),
            Err(e) => {
                let _ = self.release(h);
                Err(e)
            }
        }
    }

    /// [`ContextStore::admit_restored`] from a host image.
    pub fn admit_restored_host(
        &mut self,
        max_context: usize,
        image: &HostContextImage,
        target_frontier: usize,
    ) -> Result<ContextHandle> {
        self.check_restore(&image.shape, image.frontier, target_frontier, max_context)?;
        let h = self.admit(max_context)?;
        match self.write_image(h, image.frontier, Self::host_put(image)) {
            Ok(()) => Ok(h),
            Err(e) => {
                let _ = self.release(h);
                Err(e)
            }
        }
    }

    /// Layer `l`'s pool, for the attention ops.
    pub fn layer(&self, l: usize) -> Result<LayerPool<'_>> {
        match self.pools.get(l) {
            Some(Pool::Ring { window, k, v }) => Ok(LayerPool::Ring {
                k,
                v,
                lanes: self.capacity.lanes,
                window: *window,
            }),
            Some(Pool::Paged { k, v }) => Ok(LayerPool::Paged {
                k,
                v,
                pages: self.capacity.pages,
                page_size: self.capacity.page_size,
                max_pages: self.capacity.max_pages_per_lane,
            }),
            None => Err(ContextError::Layer {
                layer: l,
                problem: format!("the draft has {} layers", self.pools.len()),
            }),
        }
    }

    /// The store's page table `[lanes, max_pages]` I32 on the device (row = lane; entries
    /// past a request's reservation, and rows of free lanes, are [`NO_PAGE`]); `None` without
    /// full layers.
    pub fn page_table(&self) -> Option<&Buffer<i32>> {
        self.page_table.as_ref()
    }

    /// Host values of the batch metadata for `handles` (checks included).
    fn batch_values(&self, handles: &[ContextHandle]) -> Result<(Vec<i32>, Vec<i32>, Vec<i32>)> {
        let w = self.capacity.max_pages_per_lane;
        let (mut lanes, mut frontiers, mut table) = (Vec::new(), Vec::new(), Vec::new());
        for (row, &h) in handles.iter().enumerate() {
            let r = self.lookup(h)?;
            Self::require_no_pending(r)?;
            if let Some(first) = handles[..row].iter().position(|o| o.lane == h.lane) {
                return Err(ContextError::DuplicateHandle {
                    lane: h.lane,
                    first,
                    second: row,
                });
            }
            lanes.push(to_i32(h.lane));
            frontiers.push(to_i32(r.frontier));
            if self.page_table.is_some() {
                table.extend_from_slice(&self.host_table[h.lane * w..(h.lane + 1) * w]);
            }
        }
        Ok((lanes, frontiers, table))
    }

    /// Device metadata for a compact batch, rows in the order of `handles`: lanes, context
    /// frontiers (the anchors' positions) and page-table rows. Every request must have
    /// nothing pending (its context reaches its target frontier).
    ///
    /// Errors: [`ContextError::UnknownHandle`], [`ContextError::PendingFeatures`],
    /// [`ContextError::DuplicateHandle`].
    pub fn batch_metadata(&self, handles: &[ContextHandle]) -> Result<BatchMetadata> {
        let (lanes, frontiers, table) = self.batch_values(handles)?;
        Ok(BatchMetadata {
            rows: handles.len(),
            lanes: self.be.upload(&lanes)?,
            frontiers: self.be.upload(&frontiers)?,
            page_table: match self.page_table {
                Some(_) => Some(self.be.upload(&table)?),
                None => None,
            },
        })
    }

    /// Rewrite existing batch metadata buffers in place (for captured CUDA graphs, whose
    /// buffers must stay the same). Errors as [`ContextStore::batch_metadata`], plus
    /// [`ContextError::BatchRows`] when `meta` was made for another row count; `meta` is
    /// unchanged on any check error.
    pub fn write_batch_metadata(
        &self,
        handles: &[ContextHandle],
        meta: &mut BatchMetadata,
    ) -> Result<()> {
        if meta.rows != handles.len() {
            return Err(ContextError::BatchRows {
                capacity: meta.rows,
                rows: handles.len(),
            });
        }
        let (lanes, frontiers, table) = self.batch_values(handles)?;
        self.be.write(&mut meta.lanes, 0, &lanes)?;
        self.be.write(&mut meta.frontiers, 0, &frontiers)?;
        if let Some(t) = &mut meta.page_table {
            self.be.write(t, 0, &table)?;
        }
        Ok(())
    }

    /// The live interval `[start, F_ctx)` of layer `l`, downloaded in position order
    /// (`start = max(0, F_ctx - S)` for a local layer, 0 for a full layer). Pending features
    /// are not part of it.
    pub fn read_window(&self, h: ContextHandle, l: usize) -> Result<LiveWindow> {
        let r = self.lookup(h)?;
        let pool = self.layer(l)?;
        let start = match pool {
            LayerPool::Ring { window, .. } => r.frontier.saturating_sub(window),
            LayerPool::Paged { .. } => 0,
        };
        let (mut k, mut v) = (Vec::new(), Vec::new());
        self.read_positions(h.lane, r, l, start, r.frontier, &mut k, &mut v)?;
        Ok(LiveWindow {
            start,
            end: r.frontier,
            k,
            v,
        })
    }

    /// K and V (`[Hkv, D]` each) of one live position of layer `l`.
    ///
    /// Errors: [`ContextError::DeadPosition`] for a position outside the live interval
    /// (dead ring bytes and unmaterialized positions are unreachable).
    pub fn read_position(
        &self,
        h: ContextHandle,
        l: usize,
        position: usize,
    ) -> Result<(Vec<bf16>, Vec<f16>)> {
        let r = self.lookup(h)?;
        let pool = self.layer(l)?;
        let start = match pool {
            LayerPool::Ring { window, .. } => r.frontier.saturating_sub(window),
            LayerPool::Paged { .. } => 0,
        };
        if position < start || position >= r.frontier {
            return Err(ContextError::DeadPosition {
                layer: l,
                position,
                start,
                end: r.frontier,
            });
        }
        let (mut k, mut v) = (Vec::new(), Vec::new());
        self.read_positions(h.lane, r, l, position, position + 1, &mut k, &mut v)?;
        Ok((k, v))
    }

    /// Append K/V of live positions `from..to` of layer `l` in position order.
    #[allow(clippy::too_many_arguments)] // reason: a private helper over the request's parts
    fn read_positions(
        &self,
        lane: usize,
        r: &Request,
        l: usize,
        from: usize,
        to: usize,
        k: &mut Vec<bf16>,
        v: &mut Vec<f16>,
    ) -> Result<()> {
        let kvw = self.geometry.kv_width();
        let mut read = |pk: &Buffer<bf16>, pv: &Buffer<f16>, at: usize, n: usize| -> Result<()> {
            k.extend(self.be.read(pk, at * kvw, n * kvw)?);
            v.extend(self.be.read(pv, at * kvw, n * kvw)?);
            Ok(())
        };
        let mut pos = from;
        match &self.pools[l] {
            Pool::Ring {
                window,
                k: pk,
                v: pv,
            } => {
                while pos < to {
                    let slot = pos % window;
                    let n = (to - pos).min(window - slot);
                    read(pk, pv, lane * window + slot, n)?;
                    pos += n;
                }
            }
            Pool::Paged { k: pk, v: pv } => {
                let ps = self.capacity.page_size;
                while pos < to {
                    let slot = pos % ps;
                    let n = (to - pos).min(ps - slot);
                    let page = usize::try_from(r.pages[pos / ps]).unwrap_or(0);
                    read(pk, pv, page * ps + slot, n)?;
                    pos += n;
                }
            }
        }
        Ok(())
    }
}
