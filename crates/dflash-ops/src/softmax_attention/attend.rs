//! The per-row attention math shared by [`crate::softmax_attention`] (full layers, paged
//! context) and [`crate::sliding_window_attention`] (local layers, ring context): geometry
//! checks, the split-KV workspace size, the row/data validation and the f64 CPU reference.
//!
//! The two ops differ only in where context position `p` of a row is stored (a ring slot or a
//! page slot) and in the optional window `S`; everything else lives here once.

use crate::bf16_rne_f64;
use half::{bf16, f16};

#[cfg(any(test, feature = "conformance"))]
use crate::Element;
#[cfg(any(test, feature = "conformance"))]
use crate::registry::{CaseOutput, Criterion, output};
use crate::{OpsError, Result, check_len, check_param};

/// Largest head dimension the CUDA kernels support (padded to 256 in shared memory).
pub(crate) const MAX_HEAD_DIM: usize = 256;

/// Keys per tile that the split bound is counted in (the CUDA tile of head dims <= 128).
pub(crate) const BOUND_TILE_KEYS: usize = 64;

/// Upper bound of the split count (bounds the workspace; `ATTN_MAX_SPLITS` of the merge).
pub(crate) const MAX_SPLITS: usize = 64;

/// Blocks the split count is sized to fill (rows * Hkv * row blocks * splits): more than any
/// supported device keeps resident at once (an H200 holds 3 * 132).
pub(crate) const SPLIT_FILL_BLOCKS: usize = 512;

/// Query rows one CUDA block covers: the Hq / Hkv heads of a KV head times the live columns,
/// 64 rows = four m16 MMA tiles (kernels/softmax_attention.cu, `ATTN_ROWS`).
pub(crate) const BLOCK_QUERY_ROWS: usize = 64;

/// The head dimension the CUDA kernel is instantiated for: the smallest of 16, 32, 64, 128,
/// 256 that holds `d` (the padding columns are zeros in shared memory).
#[cfg(any(feature = "cuda", test))]
pub(crate) fn padded_head_dim(d: usize) -> usize {
    [16, 32, 64, 128, 256]
        .into_iter()
        .find(|&p| d <= p)
        .unwrap_or(MAX_HEAD_DIM)
}

/// Resident blocks per SM of the one-warpgroup split (`AttnWg<128, 1>::min_blocks`, its
/// launch bound), which [`SplitForm::pairs_pay`] plans that form with.
#[cfg(any(feature = "cuda", test))]
const WARPGROUP_BLOCKS_PER_SM: usize = 3;

/// Where [`SplitForm::pairs_pay`] stops choosing warpgroup pairs: the most 32-key tiles per
/// split of the single-warpgroup plan (measured: pairs win at 2 to 3 tiles per split, lose at
/// 84).
#[cfg(any(feature = "cuda", test))]
const PAIR_MAX_TILES_PER_SPLIT: usize = 4;

/// The form of the split kernel the CUDA launcher runs for one call (`AttnWg` /
/// `ATTN_SPLIT_ENTRIES` of kernels/softmax_attention.cu). Portable forms come from the module
/// compiled for the device's own architecture, the warpgroup forms from the sm_90a module.
#[cfg(any(feature = "cuda", test))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SplitForm {
    /// Portable `_d{DP}`: one warp per m16 tile of the 64 query rows, 4 warps.
    Warps,
    /// Portable `_d{DP}_ks2`: at most 32 query rows (two m16 tiles), each taken by a pair of
    /// warps that split every 32-key tile.
    WarpPairs,
    /// sm_90a `_d128`: the 64 query rows as one warpgroup (wgmma), 32-key tiles, 3 stages.
    Warpgroup,
    /// sm_90a `_d128_ks2`: two warpgroups of one block share Q and every 64-key tile (32
    /// keys each, 4 stages) and combine their states in shared memory before the split's
    /// one partial: half the partials of [`SplitForm::Warpgroup`] for the same keys per block.
    WarpgroupPairs,
}

#[cfg(any(feature = "cuda", test))]
impl SplitForm {
    /// The form for geometry `g` whose rows see at most `key_capacity` keys, on a backend
    /// with (`sm90a`) or without the sm_90a variants, on a device of `sm_count` SMs.
    /// - Warpgroup forms: head dim exactly 128 and more than 16 query rows per KV head (`G *
    ///   cols`: K = 7 and K = 15 of the official drafts; a block of 17 to 32 rows, which the
    ///   portable kernels give to key-split pairs, leaves the rest of the 64 rows dead, zero in
    ///   Q and masked).
    /// - Pairs of warpgroups ([`Self::pairs_pay`]) where the single-warpgroup split would give
    ///   each block only a few tiles; one warpgroup per block otherwise.
    /// - Portable: warp pairs for at most 32 query rows and 32-key tiles (`dp <= 128`), else
    ///   one warp per m16 tile.
    pub(crate) fn choose(g: &Geometry, sm90a: bool, sm_count: usize, key_capacity: usize) -> Self {
        let rows_per_kv = g.group().saturating_mul(g.cols);
        if sm90a && g.head_dim == 128 && rows_per_kv > 16 {
            return if Self::pairs_pay(g, sm_count, key_capacity) {
                Self::WarpgroupPairs
            } else {
                Self::Warpgroup
            };
        }
        if rows_per_kv <= 32 && Self::WarpPairs.tile_keys(padded_head_dim(g.head_dim)) == 32 {
            Self::WarpPairs
        } else {
            Self::Warps
        }
    }

    /// Whether the warpgroup pairs beat one warpgroup per block (measured on the H200, see
    /// docs/performance.md): a full row block (more than 32 query rows per KV head, K = 15;
    /// at K = 7 half the pair's rows are dead), at most `sm_count / 4` row blocks in the batch
    /// (the pairs run one block per SM, so each row block still gets at least 4 splits), and
    /// at most [`PAIR_MAX_TILES_PER_SPLIT`] 32-key tiles per split of the single-warpgroup
    /// plan at `key_capacity` (3 blocks per SM): there each block's fixed costs (Q, the
    /// pipeline's first tiles, a 32 KiB FP32 partial written and merged) outweigh its keys,
    /// and a pair halves the partials. With many tiles per split the three independent
    /// warpgroups per SM of the single form keep more work in flight than one pair.
    fn pairs_pay(g: &Geometry, sm_count: usize, key_capacity: usize) -> bool {
        let resident = WARPGROUP_BLOCKS_PER_SM.saturating_mul(sm_count);
        let splits = launched_splits(g, key_capacity, resident);
        let tiles_per_split = key_capacity
            .div_ceil(Self::Warpgroup.tile_keys(128))
            .div_ceil(splits);
        g.group().saturating_mul(g.cols) > 32
            && split_items(g).saturating_mul(4) <= sm_count
            && tiles_per_split <= PAIR_MAX_TILES_PER_SPLIT
    }

    /// Whether the form runs from the sm_90a module.
    pub(crate) fn sm90a(self) -> bool {
        matches!(self, Self::Warpgroup | Self::WarpgroupPairs)
    }

    /// Whether the split is launched as a programmatic dependent of the kernel queued before it
    /// (where the backend uses dependent launches): the warpgroup pairs, whose one block per
    /// SM can then become resident while the kernel ahead finishes. Measured on the H200
    /// (graph replay, a sequence of calls): B=1 K=15 4096 0.4-0.9 us faster with it; the
    /// one-warpgroup split of B=1 K=7 2048 (3 blocks per SM) 0.7-1.0 us slower, so it stays
    /// an ordinary launch there.
    pub(crate) fn dependent_launch(self) -> bool {
        self == Self::WarpgroupPairs
    }

    /// Whether the entry point is the `_ks2` one (KS = 2).
    pub(crate) fn key_split(self) -> bool {
        matches!(self, Self::WarpPairs | Self::WarpgroupPairs)
    }

    /// Threads per block (`AttnWg::threads`).
    pub(crate) fn threads(self) -> u32 {
        if self == Self::WarpgroupPairs {
            256
        } else {
            128
        }
    }

    /// Keys per tile and pipeline stages for padded head dimension `dp` (`AttnWg::kt`,
    /// `AttnWg::stages`).
    fn tile_geometry(self, dp: usize) -> (usize, usize) {
        match self {
            Self::Warps | Self::WarpPairs if dp <= 128 => (32, 3),
            Self::Warps | Self::WarpPairs => (16, 2),
            Self::Warpgroup => (32, 3),
            Self::WarpgroupPairs => (64, 4),
        }
    }

    /// Keys per tile for padded head dimension `dp` (`AttnWg::kt`): what the merge needs to
    /// recompute a row's plan.
    pub(crate) fn tile_keys(self, dp: usize) -> usize {
        self.tile_geometry(dp).0
    }

    /// Dynamic shared memory of the split kernel for padded head dimension `dp`. Portable:
    /// the Q block, `stages` K and V tiles (rows padded by 8 elements), one `kpos` array and
    /// one full-tile flag per stage. Warpgroup forms (dp = 128): 1024 bytes of slack for the
    /// 1024-byte-aligned swizzled tiles, then the same without padding.
    pub(crate) fn smem_bytes(self, dp: usize) -> usize {
        let (kt, st) = self.tile_geometry(dp);
        let (slack, ld) = if self.sm90a() {
            (1024, dp)
        } else {
            (0, dp + 8)
        };
        slack + (BLOCK_QUERY_ROWS * ld + 2 * st * kt * ld) * 2 + st * kt * 4 + st * 4
    }
}

/// The shape of one attention call, common to both ops.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geometry {
    /// Requests in the batch.
    pub rows: usize,
    /// Query columns per request (W).
    pub cols: usize,
    /// Query heads (Hq).
    pub q_heads: usize,
    /// KV heads (Hkv).
    pub kv_heads: usize,
    /// Head dimension (D).
    pub head_dim: usize,
}

fn product(op: &'static str, param: &'static str, factors: &[usize]) -> Result<usize> {
    factors
        .iter()
        .try_fold(1usize, |acc, &f| acc.checked_mul(f))
        .ok_or_else(|| OpsError::Param {
            op,
            param,
            expected: "a shape whose element count fits in usize".into(),
            found: format!("{factors:?}"),
        })
}

impl Geometry {
    /// Query heads per KV head.
    pub(crate) fn group(&self) -> usize {
        self.q_heads / self.kv_heads
    }

    /// Check the static shape parameters (before any length or data check).
    pub(crate) fn validate(&self, op: &'static str) -> Result<()> {
        let i32_max = i32::MAX as usize;
        check_param(
            op,
            "rows",
            (1..=i32_max).contains(&self.rows),
            self.rows,
            || "rows >= 1".into(),
        )?;
        check_param(
            op,
            "cols",
            (1..=i32_max).contains(&self.cols),
            self.cols,
            || "cols >= 1".into(),
        )?;
        check_param(
            op,
            "kv_heads",
            (1..=i32_max).contains(&self.kv_heads),
            self.kv_heads,
            || "kv_heads >= 1".into(),
        )?;
        check_param(
            op,
            "q_heads",
            self.q_heads >= 1
                && self.q_heads <= i32_max
                && self.q_heads.is_multiple_of(self.kv_heads),
            self.q_heads,
            || format!("a positive multiple of kv_heads = {}", self.kv_heads),
        )?;
        check_param(
            op,
            "head_dim",
            self.head_dim >= 2 && self.head_dim <= MAX_HEAD_DIM && self.head_dim.is_multiple_of(2),
            self.head_dim,
            || format!("an even head_dim in 2..={MAX_HEAD_DIM}"),
        )?;
        product(
            op,
            "rows*cols*q_heads*head_dim",
            &[self.rows, self.cols, self.q_heads, self.head_dim],
        )?;
        Ok(())
    }

    /// Elements of `q` and `out`: `[rows, cols, Hq, D]`.
    pub(crate) fn q_len(&self) -> usize {
        self.rows * self.cols * self.q_heads * self.head_dim
    }

    /// Elements of the block K/V: `[rows, cols, Hkv, D]`.
    pub(crate) fn kv_len(&self) -> usize {
        self.rows * self.cols * self.kv_heads * self.head_dim
    }
}

/// The most splits the CUDA kernels launch for a layer of geometry `g` whose rows can see at
/// most `key_capacity` keys (context plus block): `clamp(min(ceil(key_capacity / 64),
/// ceil(512 / (rows * Hkv * row blocks))), 1, 64)`, where a row block is 64 query rows of a KV
/// head (`ceil(Hq / Hkv * cols / 64)`). The launched count is at most this (fewer when the
/// device holds fewer blocks); each row then uses only as many splits as its visible key
/// range needs.
pub(crate) fn split_count(g: &Geometry, key_capacity: usize) -> usize {
    key_capacity
        .div_ceil(BOUND_TILE_KEYS)
        .min(SPLIT_FILL_BLOCKS.div_ceil(split_items(g).max(1)))
        .clamp(1, MAX_SPLITS)
}

/// The (row, KV head, row block) items of a call, each one split's worth of blocks: rows *
/// Hkv * ceil(G * cols / 64), saturating.
pub(crate) fn split_items(g: &Geometry) -> usize {
    g.rows
        .saturating_mul(g.kv_heads)
        .saturating_mul(g.group().saturating_mul(g.cols).div_ceil(BLOCK_QUERY_ROWS))
}

/// The split count the CUDA launcher launches on a device holding `resident` blocks of the
/// split kernel at once: the batch's row blocks times their splits fill the device once
/// (`resident / split_items`), at least 1 and at most [`split_count`] (what the workspace was
/// sized for).
#[cfg(any(feature = "cuda", test))]
pub(crate) fn launched_splits(g: &Geometry, key_capacity: usize, resident: usize) -> usize {
    (resident / split_items(g).max(1)).clamp(1, split_count(g, key_capacity))
}

/// f32 elements of the split-KV workspace: `rows * cols * Hq * splits * (D + 2)` (the
/// partials), saturating so nonsense geometry gives a huge value rather than an overflow.
pub(crate) fn workspace_len(g: &Geometry, key_capacity: usize) -> usize {
    [
        g.rows,
        g.cols,
        g.q_heads,
        split_count(g, key_capacity),
        g.head_dim.saturating_add(2),
    ]
    .iter()
    .fold(1usize, |acc, &f| acc.saturating_mul(f))
}

/// Lengths of the tensors every attention call takes, for the length checks.
pub(crate) struct Lens {
    /// `q` length.
    pub q: usize,
    /// `k_blk` length.
    pub k_blk: usize,
    /// `v_blk` length.
    pub v_blk: usize,
    /// `start_pos` length.
    pub start_pos: usize,
    /// `live` length.
    pub live: usize,
    /// `out` length.
    pub out: usize,
    /// `workspace` length.
    pub workspace: usize,
    /// The op's key capacity (for the workspace size).
    pub key_capacity: usize,
}

/// Check the lengths of the tensors both ops share.
pub(crate) fn check_common(op: &'static str, g: &Geometry, t: &Lens) -> Result<()> {
    let (r, c, hq, hkv, d) = (g.rows, g.cols, g.q_heads, g.kv_heads, g.head_dim);
    check_len(op, "q", t.q, g.q_len(), || {
        format!("[rows={r}, cols={c}, q_heads={hq}, head_dim={d}]")
    })?;
    check_len(op, "k_blk", t.k_blk, g.kv_len(), || {
        format!("[rows={r}, cols={c}, kv_heads={hkv}, head_dim={d}]")
    })?;
    check_len(op, "v_blk", t.v_blk, g.kv_len(), || {
        format!("[rows={r}, cols={c}, kv_heads={hkv}, head_dim={d}]")
    })?;
    check_len(op, "start_pos", t.start_pos, r, || format!("[rows={r}]"))?;
    check_len(op, "live", t.live, r, || format!("[rows={r}]"))?;
    check_len(op, "out", t.out, g.q_len(), || {
        format!("[rows={r}, cols={c}, q_heads*head_dim={}]", hq * d)
    })?;
    let need = workspace_len(g, t.key_capacity);
    if t.workspace < need {
        let splits = split_count(g, t.key_capacity);
        return Err(OpsError::Length {
            op,
            tensor: "workspace",
            expected: need,
            shape: format!("at least rows*cols*q_heads*splits*(head_dim+2) with splits={splits}"),
            found: t.workspace,
        });
    }
    Ok(())
}

/// Check the per-row metadata on the host: `start_pos[r] >= 0`, `live[r]` in `1..=cols`.
pub(crate) fn check_rows(
    op: &'static str,
    cols: usize,
    start_pos: &[i32],
    live: &[i32],
) -> Result<()> {
    for (r, &f) in start_pos.iter().enumerate() {
        if f < 0 {
            return Err(OpsError::Value {
                op,
                tensor: "start_pos",
                index: r,
                expected: "a position >= 0".into(),
                found: f.to_string(),
            });
        }
    }
    for (r, &l) in live.iter().enumerate() {
        if l < 1 || l as usize > cols {
            return Err(OpsError::Value {
                op,
                tensor: "live",
                index: r,
                expected: format!("a live column count in 1..={cols}"),
                found: l.to_string(),
            });
        }
    }
    Ok(())
}

/// Where the context of a row lives and which of its positions a query column may see.
pub(crate) trait ContextMap {
    /// The window `S` (local layers) or `None` (full layers).
    fn window(&self) -> Option<usize>;
    /// The flat slot (index over the cache's `[.., Hkv, D]` leading axes) of context position
    /// `p` of row `r`; `p` is in the row's populated context range.
    fn slot(&self, r: usize, p: usize) -> usize;
}

/// Represented inputs of one attention call.
pub(crate) struct Inputs<'a> {
    /// `[rows, cols, Hq, D]`.
    pub q: &'a [bf16],
    /// `[rows, cols, Hkv, D]`.
    pub k_blk: &'a [bf16],
    /// `[rows, cols, Hkv, D]`.
    pub v_blk: &'a [bf16],
    /// Context K `[slots, Hkv, D]` (ring or pages flattened).
    pub ctx_k: &'a [bf16],
    /// Context V `[slots, Hkv, D]`.
    pub ctx_v: &'a [f16],
    /// `[rows]`.
    pub start_pos: &'a [i32],
    /// `[rows]`.
    pub live: &'a [i32],
}

/// The CPU reference of both ops (inputs already validated): f64 scores and softmax from the
/// represented inputs, one RNE rounding to bf16 per output element; dead columns are +0.0.
pub(crate) fn reference(g: &Geometry, ctx: &impl ContextMap, x: &Inputs<'_>, out: &mut [bf16]) {
    let (hq, hkv, d) = (g.q_heads, g.kv_heads, g.head_dim);
    let group = g.group();
    let scale = 1.0 / (d as f64).sqrt();
    let mut scores: Vec<f64> = Vec::new();
    let mut acc = vec![0f64; d];
    for r in 0..g.rows {
        let f = x.start_pos[r] as usize;
        let live = x.live[r] as usize;
        for i in 0..g.cols {
            for h in 0..hq {
                let o = ((r * g.cols + i) * hq + h) * d;
                if i >= live {
                    out[o..o + d].fill(bf16::ZERO);
                    continue;
                }
                let kvh = h / group;
                let qv = &x.q[o..o + d];
                // Visible keys of column i (absolute query position f + i).
                let (ctx_lo, blk_lo, blk_hi) = match ctx.window() {
                    Some(s) => (
                        (f + i + 1).saturating_sub(s),
                        (i + 1).saturating_sub(s),
                        live.min(i + s),
                    ),
                    None => (0, 0, live),
                };
                let mut keys: Vec<(&[bf16], Vals<'_>)> = Vec::new();
                for p in ctx_lo..f {
                    let b = (ctx.slot(r, p) * hkv + kvh) * d;
                    keys.push((&x.ctx_k[b..b + d], Vals::F16(&x.ctx_v[b..b + d])));
                }
                for j in blk_lo..blk_hi {
                    let b = ((r * g.cols + j) * hkv + kvh) * d;
                    keys.push((&x.k_blk[b..b + d], Vals::Bf16(&x.v_blk[b..b + d])));
                }
                scores.clear();
                scores.extend(keys.iter().map(|(k, _)| {
                    qv.iter()
                        .zip(k.iter())
                        .map(|(a, b)| f64::from(a.to_f32()) * f64::from(b.to_f32()))
                        .sum::<f64>()
                        * scale
                }));
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                acc.fill(0.0);
                let mut sum = 0.0;
                for (s, (_, v)) in scores.iter().zip(&keys) {
                    let w = (s - max).exp();
                    sum += w;
                    for (a, e) in acc.iter_mut().zip(0..d) {
                        *a += w * v.get(e);
                    }
                }
                for (dst, a) in out[o..o + d].iter_mut().zip(&acc) {
                    *dst = bf16_rne_f64(a / sum);
                }
            }
        }
    }
}

/// A value row of either storage dtype.
enum Vals<'a> {
    Bf16(&'a [bf16]),
    F16(&'a [f16]),
}

impl Vals<'_> {
    fn get(&self, e: usize) -> f64 {
        match self {
            Vals::Bf16(v) => f64::from(v[e].to_f32()),
            Vals::F16(v) => f64::from(v[e].to_f32()),
        }
    }
}

/// Comparison criterion of the attention output: FP32 device math against the f64 oracle,
/// both rounded once to bf16, may differ by a rounding-boundary flip (2 bf16 ulps admit a
/// flip next to a binade edge) or by a tiny absolute amount near zero.
#[cfg(any(test, feature = "conformance"))]
pub(crate) const OUT_CRITERION: Criterion = Criterion::Close {
    abs: 1e-4,
    rel: 0.0,
    bf16_ulps: 2,
};

/// Deterministic case data (SplitMix64), independent of any RNG crate.
#[cfg(any(test, feature = "conformance"))]
pub(crate) struct CaseRng(u64);

#[cfg(any(test, feature = "conformance"))]
impl CaseRng {
    /// A generator seeded with `seed`.
    pub(crate) fn new(seed: u64) -> Self {
        CaseRng(seed)
    }

    /// The next 64 random bits.
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[-amp, amp)`.
    pub(crate) fn symmetric(&mut self, amp: f32) -> f32 {
        let u = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        (2.0 * u - 1.0) * amp
    }

    /// `n` bf16 values uniform in `[-amp, amp)`, rounded RNE.
    pub(crate) fn bf16s(&mut self, n: usize, amp: f32) -> Vec<bf16> {
        (0..n)
            .map(|_| crate::bf16_rne(self.symmetric(amp)))
            .collect()
    }

    /// `n` context V values as the materializer stores them: `f16_rne(bf16_rne(v))`.
    pub(crate) fn ctx_v(&mut self, n: usize, amp: f32) -> Vec<f16> {
        (0..n)
            .map(|_| crate::f16_rne(crate::bf16_rne(self.symmetric(amp)).to_f32()))
            .collect()
    }

    /// A uniformly random permutation of `0..n` (Fisher-Yates).
    pub(crate) fn permutation(&mut self, n: usize) -> Vec<usize> {
        let mut v: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            let j = (self.next_u64() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
        v
    }
}

/// The case outputs of an attention run: `out` (close, every element written) and, when some
/// column is dead, `out_dead` (the dead columns' bits, exact: +0.0 everywhere).
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn case_outputs(g: &Geometry, live: &[i32], after: &[bf16]) -> Vec<CaseOutput> {
    let before = vec![bf16::POISON; after.len()];
    let mut outs = vec![output("out", OUT_CRITERION, &before, after, |_| true)];
    let per_col = g.q_heads * g.head_dim;
    let dead: Vec<bf16> = after
        .chunks(per_col)
        .enumerate()
        .filter(|(rc, _)| rc % g.cols >= live[rc / g.cols] as usize)
        .flat_map(|(_, c)| c.iter().copied())
        .collect();
    if !dead.is_empty() {
        let before = vec![bf16::POISON; dead.len()];
        let mut o = output("out_dead", Criterion::Exact, &before, &dead, |_| true);
        o.allow_constant = true;
        outs.push(o);
    }
    outs
}

/// `ATTN_LAZY`: a row's base is raised only when a tile's max exceeds it by more.
#[cfg(test)]
const LAZY: f32 = 8.0;

/// `attn_raise_base`: the base after a tile whose visible max is `t` (base-2 units).
#[cfg(test)]
fn raise_base(base: f32, t: f32) -> f32 {
    if t > base + LAZY { t.ceil() } else { base }
}

/// `attn_pow2`: 2^d for an integer-valued d <= 0, exactly; 0 below -126 and for -inf.
#[cfg(test)]
fn pow2(d: f32) -> f32 {
    if d >= -126.0 {
        f32::from_bits(((d as i32 + 127) as u32) << 23)
    } else if d.is_nan() {
        d
    } else {
        0.0
    }
}

/// `attn_scale`: 2^(m - base) moving a state of base `m` to `base` >= m, exactly; 0 when
/// `m` is -inf (a state that saw no key).
#[cfg(test)]
fn scale(m: f32, base: f32) -> f32 {
    if m == f32::NEG_INFINITY {
        0.0
    } else {
        pow2(m - base)
    }
}

/// A port of the CUDA split and merge (kernels/softmax_attention.cu) at tile granularity, for
/// tests: the same key list (context tiles, then block tiles, of `kt` keys), split plan
/// (`tps = ceil(T / splits)`, active splits), relative key positions and window tests, base-2
/// online softmax per tile (a tile's max is the raw max score times log2(e) / sqrt(D), rounded
/// once; the row's base follows [`raise_base`], so every rescale is an exact power of two; a
/// weight is 2^fma(s, log2(e) / sqrt(D), -base), flushed to 0 below 2^-126), P as two FP16
/// terms hi + lo for context keys and two BF16 terms hi + lo for block keys, with the softmax
/// sum over the represented terms, the workspace layout
/// (poisoned with NaN so reading an unwritten partial shows) and the merge, which recomputes
/// the plan as the kernel's does. Only summation orders differ from the device: inside a tile
/// (the MMA's), in the softmax sums (the device adds each thread's keys over the tiles, then
/// the four threads of a row) and in the merge (the device adds the softmax sums by
/// shuffles, and `_merge_s64` adds four warps' partial numerators).
/// `row_ctx(r)` gives the kernel's (F, ctx_lo) of row r, `slot(r, p)` the flat slot or -1;
/// `window` 0 = none.
#[cfg(test)]
pub(crate) fn emulate_split_kv(
    g: &Geometry,
    window: i64,
    splits: usize,
    kt: usize,
    x: &Inputs<'_>,
    row_ctx: impl Fn(usize) -> (i64, i64),
    slot: impl Fn(usize, i64) -> i64,
) -> Vec<bf16> {
    let (rows, cols, hq, hkv, d) = (g.rows, g.cols, g.q_heads, g.kv_heads, g.head_dim);
    let group = hq / hkv;
    let items = rows * cols * hq * splits;
    let ml_len = 2 * items;
    let mut ws = vec![f32::NAN; ml_len + items * d];
    let sl2 = std::f32::consts::LOG2_E / (d as f32).sqrt();
    let kti = kt as i64;
    // attn_plan of row r: (context tiles, tiles, tiles per split, active splits); the split
    // and the merge both evaluate it, as the kernels do.
    let plan = |r: usize| {
        let (f, lo) = row_ctx(r);
        let live = i64::from(x.live[r]).clamp(0, cols as i64);
        let t_ctx = (f - lo + kti - 1) / kti;
        let tiles = t_ctx + (live + kti - 1) / kti;
        let tps = ((tiles + splits as i64 - 1) / splits as i64).max(1);
        let active = if live > 0 { (tiles + tps - 1) / tps } else { 0 };
        (t_ctx, tiles, tps, active)
    };
    for r in 0..rows {
        let (f, lo) = row_ctx(r);
        let live = i64::from(x.live[r]).clamp(0, cols as i64);
        let (t_ctx, tiles, tps, active) = plan(r);
        for s in 0..active {
            let (t0, t1) = (s * tps, tiles.min(s * tps + tps));
            for kvh in 0..hkv {
                for m in 0..group * live as usize {
                    let (i, h) = (m / group, kvh * group + m % group);
                    let qo = ((r * cols + i) * hq + h) * d;
                    let mut acc = vec![0f32; d];
                    let (mut m_run, mut l_run) = (f32::NEG_INFINITY, 0f32);
                    for tt in t0..t1 {
                        let is_ctx = tt < t_ctx;
                        // (kpos, K row, V row as f32, V dtype is f16) of each valid key.
                        let mut keys: Vec<(i64, Vec<f32>, Vec<f32>)> = Vec::new();
                        for t in 0..kti {
                            if is_ctx {
                                let p = lo + tt * kti + t;
                                let sl = if p < f { slot(r, p) } else { -1 };
                                if sl < 0 {
                                    continue;
                                }
                                let b = (sl as usize * hkv + kvh) * d;
                                keys.push((
                                    p - f,
                                    x.ctx_k[b..b + d].iter().map(|v| v.to_f32()).collect(),
                                    x.ctx_v[b..b + d].iter().map(|v| v.to_f32()).collect(),
                                ));
                            } else {
                                let j = (tt - t_ctx) * kti + t;
                                if j >= live {
                                    continue;
                                }
                                let b = ((r * cols + j as usize) * hkv + kvh) * d;
                                keys.push((
                                    j,
                                    x.k_blk[b..b + d].iter().map(|v| v.to_f32()).collect(),
                                    x.v_blk[b..b + d].iter().map(|v| v.to_f32()).collect(),
                                ));
                            }
                        }
                        let ii = i as i64;
                        let scores: Vec<f32> = keys
                            .iter()
                            .map(|(kk, k, _)| {
                                let vis = window == 0
                                    || if is_ctx {
                                        kk - ii > -window
                                    } else {
                                        (kk - ii).abs() < window
                                    };
                                if !vis {
                                    return f32::NEG_INFINITY;
                                }
                                (0..d).map(|e| x.q[qo + e].to_f32() * k[e]).sum::<f32>()
                            })
                            .collect();
                        let mx = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                        let m_new = raise_base(m_run, mx * sl2);
                        if m_new != m_run {
                            let corr = scale(m_run, m_new);
                            l_run *= corr;
                            acc.iter_mut().for_each(|a| *a *= corr);
                        }
                        m_run = m_new;
                        let base = if m_new == f32::NEG_INFINITY {
                            0.0
                        } else {
                            m_new
                        };
                        for (sc, (_, _, v)) in scores.iter().zip(&keys) {
                            // ex2.approx.ftz: results below 2^-126 are zero.
                            let p = sc.mul_add(sl2, -base).exp2();
                            let p = if p < f32::MIN_POSITIVE { 0.0 } else { p };
                            let (hi, lo) = if is_ctx {
                                let h = f16::from_f32(p).to_f32();
                                (h, f16::from_f32(p - h).to_f32())
                            } else {
                                let h = bf16::from_f32(p).to_f32();
                                (h, bf16::from_f32(p - h).to_f32())
                            };
                            l_run += hi + lo;
                            for (a, ve) in acc.iter_mut().zip(v) {
                                *a += hi * ve + lo * ve;
                            }
                        }
                    }
                    let item = ((r * cols + i) * hq + h) * splits + s as usize;
                    ws[2 * item] = m_run;
                    ws[2 * item + 1] = l_run;
                    ws[ml_len + item * d..ml_len + (item + 1) * d].copy_from_slice(&acc);
                }
            }
        }
    }
    let mut out = vec![bf16::POISON; rows * cols * hq * d];
    for r in 0..rows {
        let live = (x.live[r].max(0) as usize).min(cols);
        let active = (plan(r).3 as usize).min(splits);
        for i in 0..cols {
            for h in 0..hq {
                let item0 = ((r * cols + i) * hq + h) * splits;
                let mx = (0..active)
                    .map(|s| ws[2 * (item0 + s)])
                    .fold(f32::NEG_INFINITY, f32::max);
                for e in 0..d {
                    let o = ((r * cols + i) * hq + h) * d + e;
                    if i >= live {
                        out[o] = bf16::from_f32(0.0);
                        continue;
                    }
                    let (mut num, mut den) = (0f32, 0f32);
                    if mx != f32::NEG_INFINITY {
                        for s in 0..active {
                            let ms = ws[2 * (item0 + s)];
                            if ms == f32::NEG_INFINITY {
                                continue;
                            }
                            let w = scale(ms, mx);
                            den += w * ws[2 * (item0 + s) + 1];
                            num += w * ws[ml_len + (item0 + s) * d + e];
                        }
                    }
                    out[o] = bf16::from_f32(if den > 0.0 { num / den } else { 0.0 });
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rescale_factors_are_exact_powers_of_two() {
        for d in -126i32..=0 {
            assert_eq!(pow2(d as f32), 2f32.powi(d), "2^{d}");
        }
        for d in [-127.0, -1.0e30, f32::NEG_INFINITY] {
            assert_eq!(pow2(d).to_bits(), 0, "{d}");
        }
        assert!(pow2(f32::NAN).is_nan());
        // Moving a state to a base: a state that saw no key weighs 0, even against -inf.
        assert_eq!(scale(f32::NEG_INFINITY, f32::NEG_INFINITY).to_bits(), 0);
        assert_eq!(scale(f32::NEG_INFINITY, 3.0).to_bits(), 0);
        assert_eq!(scale(-2.0, 3.0), 2f32.powi(-5));
        assert_eq!(scale(3.0, 3.0), 1.0);
        // The base: set by the first visible tile (ceil), kept while a max stays within
        // LAZY of it, raised past that.
        assert_eq!(
            raise_base(f32::NEG_INFINITY, f32::NEG_INFINITY),
            f32::NEG_INFINITY
        );
        assert_eq!(raise_base(f32::NEG_INFINITY, -3.5), -3.0);
        assert_eq!(raise_base(f32::NEG_INFINITY, 2.0), 2.0);
        assert_eq!(raise_base(2.0, 10.0), 2.0);
        assert_eq!(raise_base(2.0, 10.25), 11.0);
        assert_eq!(raise_base(2.0, -40.0), 2.0);
    }

    #[test]
    fn f64_rounding_is_single_rne() {
        // Exactly representable values pass through.
        for v in [0.0, 1.0, -2.5, 0.009765625, 3.0e38] {
            assert_eq!(bf16_rne_f64(v), bf16::from_f64(v), "{v}");
        }
        // 1 + 2^-8 is a tie between 1 and 1 + 2^-7: ties to even (1.0).
        assert_eq!(bf16_rne_f64(1.0 + 2f64.powi(-8)).to_bits(), 0x3f80);
        // 1 + 3 * 2^-8 ties between 1 + 2^-7 (odd) and 1 + 2^-6 (even): rounds up.
        assert_eq!(bf16_rne_f64(1.0 + 3.0 * 2f64.powi(-8)).to_bits(), 0x3f82);
        // Just above the tie by 2^-40 (lost by a 32-bit truncation): must round up.
        assert_eq!(
            bf16_rne_f64(1.0 + 2f64.powi(-8) + 2f64.powi(-40)).to_bits(),
            0x3f81
        );
        assert_eq!(
            bf16_rne_f64(-(1.0 + 2f64.powi(-8) + 2f64.powi(-40))).to_bits(),
            0xbf81
        );
        // Below the tie rounds down; mantissa carry moves to the next binade.
        assert_eq!(
            bf16_rne_f64(1.0 + 2f64.powi(-8) - 2f64.powi(-40)).to_bits(),
            0x3f80
        );
        assert_eq!(bf16_rne_f64(2.0 - 2f64.powi(-9)).to_bits(), 0x4000);
    }

    /// A geometry with head dim 128 (the official drafts').
    fn g(rows: usize, cols: usize, q_heads: usize, kv_heads: usize) -> Geometry {
        Geometry {
            rows,
            cols,
            q_heads,
            kv_heads,
            head_dim: 128,
        }
    }

    #[test]
    fn launched_splits_fill_the_device_once_within_the_bound() {
        // B = 1 K = 15 (8 row blocks) on 396 resident blocks: 49 splits; B = 8 (64): 6; more
        // row blocks than resident blocks: 1; a short capacity bounds it (4112 keys -> 65).
        assert_eq!(launched_splits(&g(1, 16, 32, 8), 4112, 396), 49);
        assert_eq!(launched_splits(&g(8, 16, 32, 8), 4112, 396), 6);
        assert_eq!(launched_splits(&g(8, 16, 32, 8), 4112, 40), 1);
        assert_eq!(launched_splits(&g(1, 16, 32, 8), 300, 396), 5);
        assert_eq!(split_items(&g(2, 16, 16, 2)), 8); // 2 rows x 2 KV heads x 2 row blocks
    }

    #[test]
    fn split_count_is_static_and_bounded() {
        let one = g(1, 8, 32, 8);
        assert_eq!(split_count(&one, 0), 1);
        assert_eq!(split_count(&one, 64), 1);
        assert_eq!(split_count(&one, 65), 2);
        assert_eq!(split_count(&one, 2047 + 8), 33); // ceil(2055 / 64)
        assert_eq!(split_count(&one, 1 << 20), MAX_SPLITS); // 512 / 8 = 64
        // Eight requests with 16 columns: 64 (row, KV head) pairs fill 512 blocks with 8.
        assert_eq!(split_count(&g(8, 16, 32, 8), 4095 + 16), 8);
        // A large GQA group adds row blocks (16 * 16 / 64 = 4 per KV head).
        assert_eq!(split_count(&g(2, 16, 16, 1), 1 << 20), 64);
        assert_eq!(split_count(&g(8, 16, 64, 2), 1 << 20), 4); // 8 * 2 * 8 = 128 per split
    }

    #[test]
    fn kernel_tiles_fit_the_smallest_supported_shared_memory() {
        // 99 KiB is the opt-in limit per block of sm_86 / sm_89 (RTX 30 / 40), the smallest
        // among the architectures the crates support (sm_80 and later).
        for d in [2, 16, 18, 32, 64, 100, 128, 130, 256] {
            let dp = padded_head_dim(d);
            assert!(dp >= d && dp.is_multiple_of(16), "{d} -> {dp}");
            for form in [SplitForm::Warps, SplitForm::WarpPairs] {
                assert!(
                    form.smem_bytes(dp) <= 99 * 1024,
                    "{dp}: {}",
                    form.smem_bytes(dp)
                );
                assert!(form.tile_keys(dp).is_multiple_of(16));
            }
        }
        assert_eq!(padded_head_dim(128), 128);
        // Q (64 rows) + 3 stages of 32 K and 32 V rows of 136 elements + 3 kpos arrays and
        // 3 full-tile flags.
        assert_eq!(
            SplitForm::Warps.smem_bytes(128),
            (64 * 136 + 2 * 3 * 32 * 136) * 2 + 3 * 32 * 4 + 3 * 4
        );
        // Three blocks fit in an H200 SM (228 KiB, 1 KiB reserved per block).
        assert!(3 * (SplitForm::Warps.smem_bytes(128) + 1024) <= 228 * 1024);
        // sm_90a: 1 KiB alignment slack + Q 64 x 128 + 3 stages of 32 K and 32 V rows of 128
        // elements + 3 kpos arrays and 3 flags (three blocks per H200 SM); the warpgroup
        // pairs: 4 stages of 64-key tiles (one block per SM, 227 KiB at most per block).
        assert_eq!(
            SplitForm::Warpgroup.smem_bytes(128),
            1024 + (64 * 128 + 2 * 3 * 32 * 128) * 2 + 3 * 32 * 4 + 3 * 4
        );
        assert!(3 * (SplitForm::Warpgroup.smem_bytes(128) + 1024) <= 228 * 1024);
        assert_eq!(
            SplitForm::WarpgroupPairs.smem_bytes(128),
            1024 + (64 * 128 + 2 * 4 * 64 * 128) * 2 + 4 * 64 * 4 + 4 * 4
        );
        assert!(SplitForm::WarpgroupPairs.smem_bytes(128) <= 227 * 1024);
        assert_eq!(SplitForm::WarpgroupPairs.tile_keys(128), 64);
        assert_eq!(SplitForm::WarpgroupPairs.threads(), 256);
        assert_eq!(SplitForm::Warpgroup.threads(), 128);
    }

    #[test]
    fn split_form_warpgroups_only_for_head_dim_128_and_two_m_tiles_on_sm90a() {
        use SplitForm::*;
        let form = |g: &Geometry, sm90a| SplitForm::choose(g, sm90a, 132, 4096 + 16);
        // K = 15 (64 query rows per KV head): a warpgroup form on sm_90a only. B = 1 at a
        // capacity of 4096 + 16 keys (8 row blocks; 49 single-warpgroup splits of 3 tiles)
        // takes the pairs; B = 4 (12 splits of 11 tiles) and B = 8 (64 row blocks) one
        // warpgroup per block.
        assert_eq!(form(&g(1, 16, 32, 8), true), WarpgroupPairs);
        assert_eq!(form(&g(4, 16, 32, 8), true), Warpgroup);
        assert_eq!(form(&g(8, 16, 32, 8), true), Warpgroup);
        assert_eq!(form(&g(1, 16, 32, 8), false), Warps);
        // The tile bound: B = 1 at 6272 keys (49 splits of 4 tiles) still pairs, at 6300 (5
        // tiles) and at 131072 + 16 (84) not; a local layer's window of 2048 (2047 + 16
        // keys) pairs.
        let pairs_at = |cap| SplitForm::choose(&g(1, 16, 32, 8), true, 132, cap);
        assert_eq!(pairs_at(49 * 4 * 32), WarpgroupPairs);
        assert_eq!(pairs_at(49 * 4 * 32 + 28), Warpgroup);
        assert_eq!(pairs_at(131_072 + 16), Warpgroup);
        assert_eq!(pairs_at(2047 + 16), WarpgroupPairs);
        // A device with fewer SMs: 8 row blocks need at least 32 of them (1024 keys: 12
        // single-warpgroup splits of 3 tiles on 32 SMs).
        assert_eq!(
            SplitForm::choose(&g(1, 16, 32, 8), true, 31, 1024),
            Warpgroup
        );
        assert_eq!(
            SplitForm::choose(&g(1, 16, 32, 8), true, 32, 1024),
            WarpgroupPairs
        );
        // K = 7 (32 rows, key-split pairs in the portable kernels): one warpgroup (half of a
        // pair's rows would be dead); K = 3 (16 rows, one m16 tile) stays portable.
        assert_eq!(form(&g(1, 8, 32, 8), true), Warpgroup);
        assert_eq!(form(&g(8, 5, 32, 8), true), Warpgroup);
        assert_eq!(form(&g(1, 8, 32, 8), false), WarpPairs);
        assert_eq!(form(&g(1, 4, 32, 8), true), WarpPairs);
        assert_eq!(form(&g(8, 2, 32, 8), true), WarpPairs);
        // Head dims padded to 128 (but not 128) stay portable.
        let mut odd = g(1, 16, 32, 8);
        odd.head_dim = 100;
        assert_eq!(form(&odd, true), Warps);
        // Only the warpgroup forms run from the sm_90a module; only the pairs take `_ks2`.
        assert!(Warpgroup.sm90a() && WarpgroupPairs.sm90a());
        assert!(!Warps.sm90a() && !WarpPairs.sm90a());
        assert!(WarpPairs.key_split() && WarpgroupPairs.key_split());
        assert!(!Warps.key_split() && !Warpgroup.key_split());
        // Only the pairs wait on the kernel ahead as a dependent launch: the B=1 K=15 shape
        // that takes them does, B=1 K=7 (one warpgroup, slower as a dependent) does not.
        assert!(form(&g(1, 16, 32, 8), true).dependent_launch());
        assert!(!form(&g(1, 8, 32, 8), true).dependent_launch());
        assert!(
            ![Warps, WarpPairs, Warpgroup]
                .iter()
                .any(|f| f.dependent_launch())
        );
    }

    #[test]
    fn key_split_pairs_only_for_two_m_tiles_of_32_key_tiles() {
        // 35B / 27B drafts: 4 query heads per KV head. K = 7 (8 columns): 32 rows -> pairs;
        // K = 15 (16 columns): 64 rows -> one warp per m16 tile.
        let form = |g: &Geometry| SplitForm::choose(g, false, 132, 4096 + 16);
        assert_eq!(form(&g(1, 8, 32, 8)), SplitForm::WarpPairs);
        assert_eq!(form(&g(1, 16, 32, 8)), SplitForm::Warps);
        let mut d64 = g(8, 1, 32, 8);
        d64.head_dim = 64;
        assert_eq!(form(&d64), SplitForm::WarpPairs);
        // 16-key tiles (head dim 256) have no pairs (a warp takes whole k16 chunks).
        let mut d256 = g(1, 8, 32, 8);
        d256.head_dim = 256;
        assert_eq!(form(&d256), SplitForm::Warps);
    }
}
