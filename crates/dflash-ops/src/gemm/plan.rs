//! When the `gemm` op's own skinny kernel (`kernels/gemm.cu`) takes a product, and how it
//! runs it (pure arithmetic on shapes and addresses; the CUDA launcher in `cuda.rs` asks).
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
    /// overlaps that kernel's end.
    pub dependent: bool,
}

impl Default for SkinnyRule {
    /// The measured rule: at most 16 rows on weights of at most 2048 rows (the drafts' k / v
    /// projections and the 35B-A3B's o and down at B = 1), 16 warps a block, launched as a dependent.
    /// Wider weights and 17-32 rows stay with cuBLAS: under the same run's measurement
    /// (H100, 1e0e7a6, `docs/performance-gemm-rules-h100.md`) the skinny kernel took
    /// 1.1-1.5x cuBLAS's time there (27B gate/up at 16 rows: 147.0 against 130.5 us; the
    /// 35B-A3B's: 26.2 against 21.6), so its SwiGLU epilogue is left to rules that give it
    /// those weights.
    fn default() -> Self {
        SkinnyRule {
            max_m: 16,
            max_n: 2048,
            warps: 16,
            warps_many: 8,
            dependent: true,
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
