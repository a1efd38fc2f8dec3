//! When the `gemm` op's own kernels (`kernels/gemm.cu`: the skinny one, and on sm_90a the
//! wide one) take a product, and how they run it (pure arithmetic on shapes, addresses and
//! device limits; the CUDA launcher in `cuda.rs` asks).
//!
//! The rule is measured, not guessed (`dflash-bench --only gemm [--gemm-rule ...]` on the
//! H200, `docs/performance-gemm.md`): at 8 and 16 rows the skinny kernel beats or ties cuBLAS
//! on weights of at most 2048 rows, where cuBLAS has too few tiles to spread over the SMs;
//! on wider weights and at more rows cuBLAS is faster, even with several 8-warp blocks an SM
//! (see [`SkinnyRule::default`]). The kernel can take up to 32 rows and any weight under
//! another rule (`CudaBackend::set_gemm_rule`, `dflash-bench --gemm-rule`).

/// The most rows of A the skinny kernel can take (4 n8 tiles).
pub(crate) const SKINNY_MAX_M: usize = 32;

/// Which products the skinny kernel takes and how many warps a block it runs them with: the
/// backend's rule (`CudaBackend::set_gemm_rule`, for measurements; [`SkinnyRule::default`]
/// otherwise), fixed for the backend's life unless set again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SkinnyRule {
    /// The most rows of A it takes (clamped to 32, four n8 tiles).
    pub max_m: usize,
    /// The most weight rows (`n`) it takes.
    pub max_n: usize,
    /// Warps a block (at most 16) when the grid has at most twice as many blocks as the
    /// device has SMs.
    pub warps: usize,
    /// Warps a block (at most 16) on larger grids, where smaller blocks let several share an
    /// SM and hide each other's start and reduction.
    pub warps_many: usize,
    /// Launch it as a programmatic dependent of the kernel ahead (compute capability 9.0 and
    /// later, where the backend launches dependents at all), so that its weight prefetch
    /// overlaps that kernel's end (the wide kernel's launch too).
    pub dependent: bool,
    /// The most rows of A (clamped to 128; 0: none) for which the products the skinny kernel
    /// does not take go to the wide kernel (wgmma + TMA with the reduction split over a
    /// cluster; sm_90a devices only, where the backend uses the sm_90a variants) instead of
    /// cuBLAS.
    pub wide_max_m: usize,
}

impl Default for SkinnyRule {
    /// The measured rule: at most 16 rows on weights of at most 2048 rows (the drafts' k / v
    /// projections and the 35B-A3B's o and down at B = 1), 16 warps a block, launched as a dependent.
    /// Wider weights and 17-32 rows stay with cuBLAS: under the same run's measurement
    /// (H100, 1e0e7a6, `docs/performance-gemm-rules-h100.md`) the skinny kernel took
    /// 1.1-1.5x cuBLAS's time there (27B gate/up at 16 rows: 147.0 against 130.5 us; the
    /// 35B-A3B's: 26.2 against 21.6), so its SwiGLU epilogue is left to rules that give it
    /// those weights. The wide kernel is off (`wide_max_m` 0): in its first measurement (H100,
    /// 7fff05c, `docs/performance-gemm-wide-h100.md`) it took 1.2-1.7x cuBLAS's time on the
    /// 35B-A3B's weights and tied it only on the 27B's largest (gate/up fused 131.1 against
    /// 131.9 us, down 67.2 against 69.0 at 16 rows), and the rounds were no faster.
    fn default() -> Self {
        SkinnyRule {
            max_m: 16,
            max_n: 2048,
            warps: 16,
            warps_many: 8,
            dependent: true,
            wide_max_m: 0,
        }
    }
}

/// Warps per block at most (`GEMM_MAX_WARPS` of the kernel, its launch bound).
pub(crate) const MAX_WARPS: usize = 16;

/// Stages of a warp's cp.async ring (`GEMM_STAGES` of the kernel).
pub(crate) const STAGES: usize = 4;

/// Bytes of one warp's cp.async ring for `tiles` n8 tiles (`GemmCfg::WARP_BYTES` of the
/// kernel: [`STAGES`] stages of 2 + NT slots of 32 lanes x 16 bytes).
pub(crate) fn warp_bytes(tiles: usize) -> usize {
    STAGES * (2 + tiles) * 32 * 16
}

/// How the skinny kernel runs one product: which entry, how many blocks and warps per block,
/// and the dynamic shared memory of a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SkinnyPlan {
    /// n8 tiles of A's rows: `1 << tiles_log2` (1, 2 or 4).
    pub tiles_log2: usize,
    /// Blocks: one per 16 weight rows (in the SwiGLU form, `n = 2 I`: one per 8 output
    /// features, the same count).
    pub blocks: usize,
    /// Warps per block (they split the reduction axis).
    pub warps: usize,
    /// Dynamic shared memory of a block in bytes: every warp's ring.
    pub smem: usize,
    /// Launched as a programmatic dependent of the kernel ahead (the rule's `dependent`).
    pub dependent: bool,
}

/// The skinny kernel's plan for `C[m, n] (+)= A[m, k] W[n, k]^T` under `rule` on a device of
/// `sm_count` SMs whose blocks may use `smem_optin` bytes of shared memory, with A and W at
/// device addresses `a` and `w` (bytes) and row strides `lda`, `ldw` (elements), or `None`
/// where it does not take the product: no row or more rows than the rule's `max_m` (or 32),
/// more weight rows than its `max_n`, `k` not a multiple of 32, A or W not 16-byte aligned at
/// every row (address and stride), or not even one warp's ring fitting. Every other product
/// `gemm_bf16_device` accepts (it checked the spans), it takes: the fewest n8 tiles (1, 2 or
/// 4) that hold m rows, a block per 16 weight rows, and the rule's warps for that many blocks,
/// no more than the shared memory, the launch bound and the 32-element chunks of the
/// reduction axis allow (the warps split it).
pub(crate) fn skinny_plan(
    (m, n, k): (usize, usize, usize),
    (a, lda): (u64, usize),
    (w, ldw): (u64, usize),
    (sm_count, smem_optin): (usize, usize),
    rule: &SkinnyRule,
) -> Option<SkinnyPlan> {
    let aligned = |addr: u64, ld: usize| addr.is_multiple_of(16) && ld.is_multiple_of(8);
    if m == 0
        || m > rule.max_m.min(SKINNY_MAX_M)
        || n > rule.max_n
        || !k.is_multiple_of(32)
        || !aligned(a, lda)
        || !aligned(w, ldw)
    {
        return None;
    }
    let tiles = m.div_ceil(8).next_power_of_two();
    let per_warp = warp_bytes(tiles);
    let blocks = n.div_ceil(16);
    let wanted = if blocks <= 2 * sm_count {
        rule.warps
    } else {
        rule.warps_many
    };
    let warps = wanted
        .clamp(1, MAX_WARPS)
        .min(smem_optin / per_warp)
        .min(k / 32);
    if warps == 0 {
        return None;
    }
    Some(SkinnyPlan {
        tiles_log2: tiles.trailing_zeros() as usize,
        blocks,
        warps,
        smem: warps * per_warp,
        dependent: rule.dependent,
    })
}

/// The most rows of A the wide kernel takes (16 n8 tiles: one m64n128k16 wgmma).
pub(crate) const WIDE_MAX_M: usize = 128;

/// Weight rows of a wide tile (`GW_ROWS` of the kernel: one m64 wgmma).
pub(crate) const WIDE_ROWS: usize = 64;

/// Reduction elements of a wide stage (`GW_KC`: one 128-byte swizzled row).
pub(crate) const WIDE_KC: usize = 64;

/// Blocks of a wide cluster at most (the portable cluster size): the splits of a tile's
/// reduction.
pub(crate) const WIDE_MAX_SPLITS: usize = 8;

/// Pipeline bytes a wide block aims for (at most 8 stages): about three blocks an SM, each
/// with as many weight bytes in flight as its A tile leaves room for.
const WIDE_PIPE_BUDGET: usize = 72 * 1024;

/// A wide block's fixed cost in chunks of the reduction (its pipeline's fill and the
/// cluster's reduction), as [`wide_splits`] weighs it.
const WIDE_BLOCK_COST: usize = 2;

/// How the wide kernel runs one product: which entry, its pipeline and its tiles (the split
/// of the reduction, which depends on how many blocks fit an SM, is [`wide_splits`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct WidePlan {
    /// n8 tiles of A's rows: `1 << tiles_log2` (1, 2, 4, 8 or 16).
    pub tiles_log2: usize,
    /// Weight tiles: 64 rows each (the SwiGLU form, `n = 2 I`: 32 features each, the same
    /// count).
    pub tiles: usize,
    /// Shared-memory stages of the pipeline (2 to 8).
    pub stages: usize,
    /// Dynamic shared memory of a block in bytes: 1024 bytes of alignment slack, the stages,
    /// their two mbarriers each.
    pub smem: usize,
    /// Launched as a programmatic dependent of the kernel ahead (the rule's `dependent`).
    pub dependent: bool,
}

/// Bytes of one wide stage for `nt` n8 tiles: the 64 x 64 weight box and the 8 nt x 64 box
/// of A (`STAGE_BYTES` of the kernel, a multiple of the swizzle's 1024 bytes).
pub(crate) fn wide_stage_bytes(nt: usize) -> usize {
    (WIDE_ROWS + 8 * nt) * WIDE_KC * 2
}

/// The wide kernel's plan for `C[m, n] (+)= A[m, k] W[n, k]^T` under `rule`, with blocks of
/// at most `smem_optin` bytes of shared memory, or `None` where it does not take the
/// product: no row, more rows than the rule's `wide_max_m` (or 128), A or W not 16-byte aligned
/// at every row (address and stride: what TMA needs), or not even two stages fitting. It
/// takes any `n >= 1` and `k >= 1` (rows and the reduction's tail past the tensors read as
/// zero). Whether the device may run it at all (sm_90a) is the launcher's to ask.
pub(crate) fn wide_plan(
    (m, n, k): (usize, usize, usize),
    (a, lda): (u64, usize),
    (w, ldw): (u64, usize),
    smem_optin: usize,
    rule: &SkinnyRule,
) -> Option<WidePlan> {
    let aligned = |addr: u64, ld: usize| addr.is_multiple_of(16) && ld.is_multiple_of(8);
    if m == 0
        || m > rule.wide_max_m.min(WIDE_MAX_M)
        || n == 0
        || k == 0
        || !aligned(a, lda)
        || !aligned(w, ldw)
    {
        return None;
    }
    let nt = m.div_ceil(8).next_power_of_two();
    let stage = wide_stage_bytes(nt);
    let smem_of = |stages: usize| 1024 + stages * stage + 2 * stages * 8;
    let stages = (WIDE_PIPE_BUDGET / stage).clamp(2, 8);
    let stages = (2..=stages).rev().find(|&s| smem_of(s) <= smem_optin)?;
    Some(WidePlan {
        tiles_log2: nt.trailing_zeros() as usize,
        tiles: n.div_ceil(WIDE_ROWS),
        stages,
        smem: smem_of(stages),
        dependent: rule.dependent,
    })
}

/// The split of each tile's reduction (the cluster's blocks, 1 to 8) for `tiles` weight tiles
/// over `k` elements on a device where `clusters(s)` clusters of `s` wide blocks can be
/// resident at once: the split that minimizes waves x (chunks a block + [`WIDE_BLOCK_COST`]),
/// waves being how many times the grid's `tiles` clusters fill the resident ones; the smaller
/// split on a tie, never more splits than 64-element chunks, never a size of which no
/// cluster can be placed (1 if none can). (Counting resident clusters,
/// not blocks, matters: an H100 holds 3 wide blocks an SM, 396 in all, but only 62 clusters of
/// 6 (372 blocks), so the 35B-A3B's q at 16 rows, 64 clusters of 6, took two waves:
/// Nsight Compute, `docs/performance-gemm-wide-h100.md`.)
pub(crate) fn wide_splits(tiles: usize, k: usize, clusters: impl Fn(usize) -> usize) -> usize {
    let chunks = k.div_ceil(WIDE_KC).max(1);
    (1..=WIDE_MAX_SPLITS.min(chunks))
        .filter_map(|s| {
            let placed = clusters(s);
            (placed > 0).then(|| {
                (
                    s,
                    tiles.div_ceil(placed) * (chunks.div_ceil(s) + WIDE_BLOCK_COST),
                )
            })
        })
        .min_by_key(|&(_, cost)| cost)
        .map_or(1, |(s, _)| s)
}
