//! Context K/V materialize: project committed context features into a local layer's ring (or a
//! full layer's pages) as RoPE'd BF16 K and FP16 V.
//!
//! Semantics. For row `r` and each stored column `i` (below), with position
//! `p = start_pos[r] + i` and `c = features[r, i, :]`:
//!   k_raw = W_k c                      (no cast: raw K is not rounded before the norm)
//!   k     = rope(plain_head_rmsnorm(k_raw, key_norm), p)   per KV head, split-half,
//!           exactly the math of `head_norm_rope` (shared oracle), theta and eps from params
//!   v_raw = W_v c
//!   cache_k[slot(r, p), h, :] = bf16_rne(k[h, :])
//!   cache_v[slot(r, p), h, :] = f16_rne(bf16_rne(v_raw[h, :]))
//!   Ring:  `slot = slots[r] * capacity + p mod capacity` (`slots[r]` is the row's lane).
//!   Paged: slot = slots[r, p / page_size] * page_size + p mod page_size.
//! Stored columns. Ring: `i` in `[max(0, counts[r] - capacity), counts[r])` — a chunk longer
//!   than the ring stores only its final `capacity` columns (the earlier ones would be
//!   overwritten within the same chunk; the op never writes them, so the write footprint is
//!   exactly the final window; the caller still advances its frontier by `counts[r]`).
//!   Paged: every `i < counts[r]`. Columns `>= counts[r]` have no effect.
//! Shapes. features: `[rows, cols, hidden]`; w_k, w_v: `[kv_heads*head_dim, hidden]`
//!   (checkpoint `[out, in]`); key_norm: `[head_dim]`; start_pos, counts: `[rows]`;
//!   slots: Ring `[rows]` (lane per row), Paged `[rows, max_pages]` (page table);
//!   cache_k, cache_v: Ring `[lanes, capacity, kv_heads, head_dim]`, Paged
//!   `[pages, page_size, kv_heads, head_dim]`. Scratch ([`run_with_scratch`]): `[scratch_len]`.
//! Dtypes. features, w_k, w_v, key_norm: BF16; start_pos, counts, slots: I32; cache_k: BF16;
//!   cache_v: F16; scratch: F32.
//! Rounding points. K: once, BF16 RNE, after norm and RoPE (k_raw, the norm and the rotation
//!   are unrounded). V: BF16 RNE of v_raw, then F16 RNE of that BF16 value.
//! Accumulation. Implementation choice (CUDA: the gemm helper, FP32, into an F32 scratch,
//!   FP32 norm, RoPE angle formed and reduced mod 2*pi in f64, sin/cos in f32); the oracle
//!   is f64 from the represented inputs.
//! Tie-breaking. None.
//! Caller guarantees (checked on the CPU, which refuses a violating call with
//!   [`OpsError::Value`](crate::OpsError) before writing; trusted on CUDA, where the kernel
//!   skips any column whose metadata is out of range instead of writing out of bounds):
//!   `counts[r]` in `0..=cols`; `start_pos[r] >= 0`; Ring: `slots[r]` in `0..lanes` for rows with a
//!   live column; Paged: `p / page_size < max_pages` and the page id in `0..pages` for every
//!   stored column; no two stored columns (of any rows) map to the same slot (on CUDA two such
//!   writers would race). No aliasing between caches, scratch and inputs.
//! Writes. Exactly the slots of the stored columns, all `kv_heads * head_dim` elements of each
//!   in both caches; nothing else in the caches changes (an in-place op); the scratch is
//!   overwritten on CUDA and untouched on the CPU.
//! Workspace. [`run`] allocates its F32 scratch (`scratch_len` elements) on CUDA for each call
//!   (fine at prefill; not CUDA-graph capturable); [`run_with_scratch`] takes a caller-owned
//!   scratch and allocates nothing.
//! Comparison. K: `close(abs = 1e-4 * max|key_norm|, rel = 0, 1 bf16 ulp)` (normalized values
//!   are O(max|key_norm|); the floor admits one rounding flip). V:
//!   `close(abs = 1e-4 * sqrt(hidden) * max|c| * max|W_v|, rel = 1e-5, 1 bf16 ulp)` (the gemm
//!   criterion). Written footprint and untouched slots: exact.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod reference;
#[cfg(test)]
mod tests;

use half::{bf16, f16};

#[cfg(any(test, feature = "conformance"))]
use crate::Element;
#[cfg(any(test, feature = "conformance"))]
use crate::gemm::data::{SplitMix, max_abs_bf16};
#[cfg(any(test, feature = "conformance"))]
use crate::registry::{Case, CaseRun, Criterion, InputCheck, output};
use crate::{Backend, Buffer, OpsError, Result, check_len, check_param};

/// Registry id.
pub const OP: &str = "context_kv_materialize";

/// Where the K/V of one layer live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheLayout {
    /// A cyclic ring per lane (local layers): position `p` lives in slot `p mod capacity` of
    /// the row's lane; caches are `[lanes, capacity, kv_heads, head_dim]`.
    Ring {
        /// Number of lanes (request slots) the caches hold.
        lanes: usize,
        /// Ring capacity in positions (the sliding-window scalar S), >= 1.
        capacity: usize,
    },
    /// Paged storage (full layers): position `p` lives in page `table[row][p / page_size]`,
    /// slot `p % page_size`; caches are `[pages, page_size, kv_heads, head_dim]`.
    Paged {
        /// Number of pages the caches hold.
        pages: usize,
        /// Positions per page, >= 1.
        page_size: usize,
        /// Page-table entries per row.
        max_pages: usize,
    },
}

/// Parameters of [`run`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MaterializeParams {
    /// Requests in the batch.
    pub rows: usize,
    /// Feature columns per row (the chunk width).
    pub cols: usize,
    /// Hidden width H of the features.
    pub hidden: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Head dimension D (even).
    pub head_dim: usize,
    /// Norm epsilon (finite, >= 0).
    pub eps: f32,
    /// RoPE theta (finite, > 0).
    pub theta: f64,
    /// Cache layout.
    pub layout: CacheLayout,
}

fn mul(a: usize, b: usize, what: &'static str) -> Result<usize> {
    a.checked_mul(b).ok_or_else(|| OpsError::Param {
        op: OP,
        param: what,
        expected: "a size that fits in usize".into(),
        found: format!("{a} x {b}"),
    })
}

/// F32 scratch elements [`run_with_scratch`] needs: `2 * rows * cols * kv_heads * head_dim`
/// (k_raw then v_raw of every column).
pub fn scratch_len(p: &MaterializeParams) -> Result<usize> {
    let kvd = mul(p.kv_heads, p.head_dim, "kv_heads*head_dim")?;
    mul(
        mul(mul(p.rows, p.cols, "rows*cols")?, kvd, "rows*cols*kvd")?,
        2,
        "scratch",
    )
}

/// Cache elements and slot-table length implied by the layout.
fn layout_sizes(p: &MaterializeParams, kvd: usize) -> Result<(usize, usize)> {
    match p.layout {
        CacheLayout::Ring { lanes, capacity } => {
            check_param(OP, "capacity", capacity >= 1, capacity, || ">= 1".into())?;
            Ok((
                mul(mul(lanes, capacity, "lanes*capacity")?, kvd, "cache")?,
                p.rows,
            ))
        }
        CacheLayout::Paged {
            pages,
            page_size,
            max_pages,
        } => {
            check_param(OP, "page_size", page_size >= 1, page_size, || ">= 1".into())?;
            Ok((
                mul(mul(pages, page_size, "pages*page_size")?, kvd, "cache")?,
                mul(p.rows, max_pages, "rows*max_pages")?,
            ))
        }
    }
}

#[allow(clippy::too_many_arguments)] // reason: mirrors the op's tensor list
fn validate(
    features: usize,
    w_k: usize,
    w_v: usize,
    key_norm: usize,
    start_pos: usize,
    counts: usize,
    slots: usize,
    cache_k: usize,
    cache_v: usize,
    p: &MaterializeParams,
) -> Result<()> {
    check_param(OP, "hidden", p.hidden >= 1, p.hidden, || ">= 1".into())?;
    check_param(OP, "kv_heads", p.kv_heads >= 1, p.kv_heads, || {
        ">= 1".into()
    })?;
    check_param(
        OP,
        "head_dim",
        p.head_dim >= 2 && p.head_dim.is_multiple_of(2),
        p.head_dim,
        || "an even number >= 2 (split-half RoPE)".into(),
    )?;
    check_param(OP, "eps", p.eps.is_finite() && p.eps >= 0.0, p.eps, || {
        "finite and >= 0".into()
    })?;
    check_param(
        OP,
        "theta",
        p.theta.is_finite() && p.theta > 0.0,
        p.theta,
        || "finite and > 0".into(),
    )?;
    let kvd = mul(p.kv_heads, p.head_dim, "kv_heads*head_dim")?;
    let (rows, cols, h) = (p.rows, p.cols, p.hidden);
    let (cache, table) = layout_sizes(p, kvd)?;
    check_len(
        OP,
        "features",
        features,
        mul(mul(rows, cols, "rows*cols")?, h, "features")?,
        || format!("[rows={rows}, cols={cols}, hidden={h}]"),
    )?;
    let w = mul(kvd, h, "w")?;
    check_len(OP, "w_k", w_k, w, || {
        format!("[kv_heads*head_dim={kvd}, hidden={h}]")
    })?;
    check_len(OP, "w_v", w_v, w, || {
        format!("[kv_heads*head_dim={kvd}, hidden={h}]")
    })?;
    check_len(OP, "key_norm", key_norm, p.head_dim, || {
        format!("[head_dim={}]", p.head_dim)
    })?;
    check_len(OP, "start_pos", start_pos, rows, || {
        format!("[rows={rows}]")
    })?;
    check_len(OP, "counts", counts, rows, || format!("[rows={rows}]"))?;
    check_len(OP, "slots", slots, table, || match p.layout {
        CacheLayout::Ring { .. } => format!("[rows={rows}] (lane per row)"),
        CacheLayout::Paged { max_pages, .. } => {
            format!("[rows={rows}, max_pages={max_pages}] (page table)")
        }
    })?;
    let shape = || match p.layout {
        CacheLayout::Ring { lanes, capacity } => format!(
            "[lanes={lanes}, capacity={capacity}, kv_heads={}, head_dim={}]",
            p.kv_heads, p.head_dim
        ),
        CacheLayout::Paged {
            pages, page_size, ..
        } => format!(
            "[pages={pages}, page_size={page_size}, kv_heads={}, head_dim={}]",
            p.kv_heads, p.head_dim
        ),
    };
    check_len(OP, "cache_k", cache_k, cache, shape)?;
    check_len(OP, "cache_v", cache_v, cache, shape)?;
    Ok(())
}

/// Materialize context K/V into the caches (see the module contract). On CUDA this allocates
/// its F32 scratch for the call; use [`run_with_scratch`] to avoid that (CUDA graphs).
#[allow(clippy::too_many_arguments)] // reason: the op's tensor list, fixed by its callers
pub fn run(
    be: &Backend,
    features: &Buffer<bf16>,
    w_k: &Buffer<bf16>,
    w_v: &Buffer<bf16>,
    key_norm: &Buffer<bf16>,
    start_pos: &Buffer<i32>,
    counts: &Buffer<i32>,
    slots: &Buffer<i32>,
    cache_k: &mut Buffer<bf16>,
    cache_v: &mut Buffer<f16>,
    p: &MaterializeParams,
) -> Result<()> {
    validate(
        features.len(),
        w_k.len(),
        w_v.len(),
        key_norm.len(),
        start_pos.len(),
        counts.len(),
        slots.len(),
        cache_k.len(),
        cache_v.len(),
        p,
    )?;
    let mut scratch = match be {
        Backend::Cpu => Buffer::from_vec(Vec::new()),
        #[cfg(feature = "cuda")]
        Backend::Cuda(_) => be.zeros::<f32>(scratch_len(p)?)?,
    };
    run_with_scratch(
        be,
        features,
        w_k,
        w_v,
        key_norm,
        start_pos,
        counts,
        slots,
        cache_k,
        cache_v,
        &mut scratch,
        p,
    )
}

/// [`run`] with a caller-owned F32 scratch of at least [`scratch_len`] elements (allocates
/// nothing; the scratch is overwritten on CUDA and not touched on the CPU, where any length is
/// accepted).
#[allow(clippy::too_many_arguments)] // reason: the op's tensor list plus its workspace
pub fn run_with_scratch(
    be: &Backend,
    features: &Buffer<bf16>,
    w_k: &Buffer<bf16>,
    w_v: &Buffer<bf16>,
    key_norm: &Buffer<bf16>,
    start_pos: &Buffer<i32>,
    counts: &Buffer<i32>,
    slots: &Buffer<i32>,
    cache_k: &mut Buffer<bf16>,
    cache_v: &mut Buffer<f16>,
    scratch: &mut Buffer<f32>,
    p: &MaterializeParams,
) -> Result<()> {
    validate(
        features.len(),
        w_k.len(),
        w_v.len(),
        key_norm.len(),
        start_pos.len(),
        counts.len(),
        slots.len(),
        cache_k.len(),
        cache_v.len(),
        p,
    )?;
    match be {
        Backend::Cpu => {
            let _ = scratch;
            reference::run(
                features.host(OP, "features")?,
                w_k.host(OP, "w_k")?,
                w_v.host(OP, "w_v")?,
                key_norm.host(OP, "key_norm")?,
                start_pos.host(OP, "start_pos")?,
                counts.host(OP, "counts")?,
                slots.host(OP, "slots")?,
                cache_k.host_mut(OP, "cache_k")?,
                cache_v.host_mut(OP, "cache_v")?,
                p,
            )
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(c) => {
            let need = scratch_len(p)?;
            check_param(OP, "scratch", scratch.len() >= need, scratch.len(), || {
                format!("at least {need} elements (scratch_len)")
            })?;
            cuda::run(
                c, features, w_k, w_v, key_norm, start_pos, counts, slots, cache_k, cache_v,
                scratch, p,
            )
        }
    }
}

/// The stored columns of a row as a half-open range (see "Stored columns").
pub(crate) fn stored_columns(layout: &CacheLayout, count: usize) -> std::ops::Range<usize> {
    match *layout {
        CacheLayout::Ring { capacity, .. } => count.saturating_sub(capacity)..count,
        CacheLayout::Paged { .. } => 0..count,
    }
}

/// The slot of position `pos` of row `r`, or `None` when the metadata is out of range.
pub(crate) fn slot_of(layout: &CacheLayout, slots: &[i32], r: usize, pos: u64) -> Option<usize> {
    match *layout {
        CacheLayout::Ring { lanes, capacity } => {
            let lane = usize::try_from(slots[r]).ok().filter(|&l| l < lanes)?;
            Some(lane * capacity + (pos % capacity as u64) as usize)
        }
        CacheLayout::Paged {
            pages,
            page_size,
            max_pages,
        } => {
            let idx = usize::try_from(pos / page_size as u64)
                .ok()
                .filter(|&i| i < max_pages)?;
            let page = usize::try_from(slots[r * max_pages + idx])
                .ok()
                .filter(|&pg| pg < pages)?;
            Some(page * page_size + (pos % page_size as u64) as usize)
        }
    }
}

#[cfg(any(test, feature = "conformance"))]
struct CaseSpec {
    rows: usize,
    cols: usize,
    hidden: usize,
    kv_heads: usize,
    head_dim: usize,
    layout: CacheLayout,
    counts: Vec<i32>,
    start_pos: Vec<i32>,
    slots: Vec<i32>,
    seed: u64,
}

#[cfg(any(test, feature = "conformance"))]
fn case(spec: CaseSpec) -> impl Fn(&Backend) -> Result<CaseRun> + Send + Sync {
    move |be: &Backend| {
        let s = &spec;
        let kvd = s.kv_heads * s.head_dim;
        let p = MaterializeParams {
            rows: s.rows,
            cols: s.cols,
            hidden: s.hidden,
            kv_heads: s.kv_heads,
            head_dim: s.head_dim,
            eps: 1e-6,
            theta: 1e7,
            layout: s.layout,
        };
        let mut g = SplitMix::new(s.seed);
        let features = g.bf16_vec(s.rows * s.cols * s.hidden, -2.0, 2.0);
        let wscale = 1.0 / (s.hidden as f64).sqrt();
        let w_k = g.bf16_vec(kvd * s.hidden, -wscale, wscale);
        let w_v = g.bf16_vec(kvd * s.hidden, -wscale, wscale);
        let key_norm = g.bf16_vec(s.head_dim, 0.25, 2.0);
        let slots_total = match s.layout {
            CacheLayout::Ring { lanes, capacity } => lanes * capacity,
            CacheLayout::Paged {
                pages, page_size, ..
            } => pages * page_size,
        };
        // Which slots the contract writes; they are poisoned, every other slot holds prior
        // (finite, random) state that must survive bit for bit.
        let mut written = vec![false; slots_total];
        for r in 0..s.rows {
            for i in stored_columns(&s.layout, s.counts[r] as usize) {
                let pos = (s.start_pos[r] as i64 + i as i64) as u64;
                if let Some(slot) = slot_of(&s.layout, &s.slots, r, pos) {
                    written[slot] = true;
                }
            }
        }
        let mut prior_k = g.bf16_vec(slots_total * kvd, -3.0, 3.0);
        let mut prior_v: Vec<f16> = (0..slots_total * kvd)
            .map(|_| f16::from_f64(g.range(-3.0, 3.0)))
            .collect();
        for (slot, _) in written.iter().enumerate().filter(|(_, w)| **w) {
            prior_k[slot * kvd..(slot + 1) * kvd].fill(bf16::POISON);
            prior_v[slot * kvd..(slot + 1) * kvd].fill(f16::POISON);
        }
        let crit_k = Criterion::Close {
            abs: 1e-4 * max_abs_bf16(&key_norm),
            rel: 0.0,
            bf16_ulps: 1,
        };
        let crit_v =
            crate::gemm::criterion(s.hidden, max_abs_bf16(&features), max_abs_bf16(&w_v), true);
        let mut inputs = InputCheck::default();
        let fb = inputs.upload(be, "features", &features)?;
        let kb = inputs.upload(be, "w_k", &w_k)?;
        let vb = inputs.upload(be, "w_v", &w_v)?;
        let nb = inputs.upload(be, "key_norm", &key_norm)?;
        let sb = inputs.upload(be, "start_pos", &s.start_pos)?;
        let cb = inputs.upload(be, "counts", &s.counts)?;
        let lb = inputs.upload(be, "slots", &s.slots)?;
        let mut ck = be.upload(&prior_k)?;
        let mut cv = be.upload(&prior_v)?;
        run(be, &fb, &kb, &vb, &nb, &sb, &cb, &lb, &mut ck, &mut cv, &p)?;
        let mut modified = Vec::new();
        for (name, buf) in [
            ("features", &fb),
            ("w_k", &kb),
            ("w_v", &vb),
            ("key_norm", &nb),
        ] {
            inputs.verify(be, name, buf, &mut modified)?;
        }
        for (name, buf) in [("start_pos", &sb), ("counts", &cb), ("slots", &lb)] {
            inputs.verify(be, name, buf, &mut modified)?;
        }
        let wr = |i: usize| written[i / kvd];
        Ok(CaseRun {
            outputs: vec![
                output("cache_k", crit_k, &prior_k, &be.download(&ck)?, wr),
                output("cache_v", crit_v, &prior_v, &be.download(&cv)?, wr),
            ],
            modified_inputs: modified,
        })
    }
}

/// Conformance cases.
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn cases() -> Vec<Case> {
    let ring = |lanes, capacity| CacheLayout::Ring { lanes, capacity };
    vec![
        // Small geometry: ring wrap, a chunk longer than the ring (final window only), a
        // short row with a dead tail, an empty row, rows on non-adjacent lanes.
        Case::new(
            OP,
            "ring_cap16_cols40_wrap_final_window_tails",
            case(CaseSpec {
                rows: 4,
                cols: 40,
                hidden: 64,
                kv_heads: 2,
                head_dim: 16,
                layout: ring(6, 16),
                counts: vec![40, 7, 0, 16],
                start_pos: vec![5, 13, 3, 100_003],
                slots: vec![4, 0, 1, 2],
                seed: 11,
            }),
        ),
        // Paged, scattered page table, positions crossing page boundaries, a dead tail.
        Case::new(
            OP,
            "paged_scattered_table_tails",
            case(CaseSpec {
                rows: 3,
                cols: 12,
                hidden: 48,
                kv_heads: 2,
                head_dim: 8,
                layout: CacheLayout::Paged {
                    pages: 12,
                    page_size: 4,
                    max_pages: 5,
                },
                counts: vec![12, 5, 9],
                start_pos: vec![0, 6, 11],
                slots: vec![
                    7, 2, 9, -1, -1, //
                    -1, 0, 11, -1, -1, //
                    -1, -1, 3, 10, 5,
                ],
                seed: 12,
            }),
        ),
        // Official 35B-A3B DFlash geometry: H 2048, Hkv 8, D 128, S 4096; one decode-size
        // chunk at a large position.
        Case::new(
            OP,
            "official_35b_ring_rows1_w4",
            case(CaseSpec {
                rows: 1,
                cols: 4,
                hidden: 2048,
                kv_heads: 8,
                head_dim: 128,
                layout: ring(1, 4096),
                counts: vec![3],
                start_pos: vec![131_070],
                slots: vec![0],
                seed: 13,
            }),
        )
        .heavy(),
        Case::new(
            OP,
            "official_35b_ring_rows8_w16_tails",
            case(CaseSpec {
                rows: 8,
                cols: 16,
                hidden: 2048,
                kv_heads: 8,
                head_dim: 128,
                layout: ring(8, 4096),
                counts: vec![16, 1, 8, 16, 0, 15, 2, 16],
                start_pos: vec![0, 4095, 4090, 99_999, 7, 1, 65_536, 300],
                slots: vec![7, 6, 5, 4, 3, 2, 1, 0],
                seed: 14,
            }),
        )
        .heavy(),
        // Official 27B DFlash2 geometry: H 5120, Hkv 8, D 128, S 2048.
        // A full prefill chunk at the 27B ring capacity (S 2048, Hkv 8, D 128); the hidden width
        // is cut to 512 to keep the f64 CPU reference affordable (the projection shape is
        // covered at full width by the rows-8 cases).
        Case::new(
            OP,
            "ring2048_h512_chunk_eq_capacity",
            case(CaseSpec {
                rows: 1,
                cols: 2048,
                hidden: 512,
                kv_heads: 8,
                head_dim: 128,
                layout: ring(1, 2048),
                counts: vec![2048],
                start_pos: vec![1000],
                slots: vec![0],
                seed: 15,
            }),
        )
        .heavy(),
        // Small chunk exactly filling a small ring, starting mid-ring (wraps once).
        Case::new(
            OP,
            "ring_cap8_chunk_eq_capacity_wrap",
            case(CaseSpec {
                rows: 2,
                cols: 8,
                hidden: 32,
                kv_heads: 2,
                head_dim: 8,
                layout: ring(2, 8),
                counts: vec![8, 8],
                start_pos: vec![5, 16],
                slots: vec![1, 0],
                seed: 18,
            }),
        ),
        Case::new(
            OP,
            "official_27b_ring_rows8_w8_tails",
            case(CaseSpec {
                rows: 8,
                cols: 8,
                hidden: 5120,
                kv_heads: 8,
                head_dim: 128,
                layout: ring(8, 2048),
                counts: vec![8, 3, 8, 0, 1, 8, 5, 8],
                start_pos: vec![2044, 0, 77_777, 5, 2047, 4096, 123_456, 9],
                slots: vec![0, 1, 2, 3, 4, 5, 6, 7],
                seed: 16,
            }),
        )
        .heavy(),
        Case::new(
            OP,
            "ring2048_h256_chunk_gt_capacity",
            case(CaseSpec {
                rows: 1,
                cols: 2600,
                hidden: 256,
                kv_heads: 8,
                head_dim: 128,
                layout: ring(1, 2048),
                counts: vec![2500],
                start_pos: vec![17],
                slots: vec![0],
                seed: 17,
            }),
        )
        .heavy(),
    ]
}
