//! When the `gemm` op's own skinny kernel (`kernels/gemm.cu`) takes a product, and how it
//! runs it (pure arithmetic on shapes and addresses; the CUDA launcher in `cuda.rs` asks).

/// The most rows of A the skinny kernel takes (8 n8 tiles).
pub(crate) const SKINNY_MAX_M: usize = 64;

/// Warps per block at most for `groups` row groups and `tiles` n8 tiles (`GEMM_MAX_WARPS` of
/// the kernel, its launch bound): 16, or 8 where a warp holds 16 or more accumulator tiles.
pub(crate) fn max_warps(groups: usize, tiles: usize) -> usize {
    if groups * tiles >= 16 { 8 } else { 16 }
}

/// Stages of a warp's cp.async ring (`GEMM_STAGES` of the kernel).
const STAGES: usize = 4;

/// 32-element sub-chunks a stage holds (`GEMM_SUB` of the kernel): the reduction axis goes
/// in steps of `32 * SUB`.
const SUB: usize = 1;

/// How the skinny kernel runs one product: which entry, how many blocks and warps per block,
/// and the dynamic shared memory of a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SkinnyPlan {
    /// Row groups of 16 weight rows a block owns: `1 << groups_log2` (1, 2 or 4).
    pub groups_log2: usize,
    /// n8 tiles of A's rows: `1 << tiles_log2` (1, 2, 4 or 8).
    pub tiles_log2: usize,
    /// Blocks: one per 16 << groups_log2 weight rows.
    pub blocks: usize,
    /// Warps per block (they split the reduction axis).
    pub warps: usize,
    /// Dynamic shared memory of a block in bytes: every warp's ring (`GemmCfg::WARP_BYTES`).
    pub smem: usize,
}

/// The skinny kernel's plan for `C[m, n] (+)= A[m, k] W[n, k]^T` on a device of `sm_count`
/// SMs and `smem_optin` bytes of shared memory a block may use, with A and W at device
/// addresses `a` and `w` (bytes) and row strides `lda`, `ldw` (elements), or `None` where it
/// does not take the product: no row or more than [`SKINNY_MAX_M`] rows, `k` not a multiple
/// of 32, or A or W not 16-byte aligned at every row (address and stride). Every other
/// product `gemm_bf16_device` accepts (it checked the spans), it takes.
///
/// - n8 tiles: the fewest (1, 2, 4 or 8) that hold m rows.
/// - Row groups a block: the most of 4, 2, 1 that still give every SM a block (each A load
///   then serves more weight rows); 1 when even that does not.
/// - Warps a block: [`max_warps`] when 8 would give fewer than 16 warps an SM (small weights:
///   more warps split each block's rows), else 8; never more than the rings that fit in
///   `smem_optin`, nor than the 32-element chunks of the reduction axis.
pub(crate) fn skinny_plan(
    (m, n, k): (usize, usize, usize),
    (a, lda): (u64, usize),
    (w, ldw): (u64, usize),
    (sm_count, smem_optin): (usize, usize),
) -> Option<SkinnyPlan> {
    let aligned = |addr: u64, ld: usize| addr.is_multiple_of(16) && ld.is_multiple_of(8);
    if m == 0
        || m > SKINNY_MAX_M
        || !k.is_multiple_of(32 * SUB)
        || !aligned(a, lda)
        || !aligned(w, ldw)
    {
        return None;
    }
    let tiles = m.div_ceil(8).next_power_of_two();
    let groups = [4usize, 2]
        .into_iter()
        .find(|&rg| n.div_ceil(16 * rg) >= sm_count)
        .unwrap_or(1);
    let blocks = n.div_ceil(16 * groups);
    let warp_bytes = STAGES * SUB * (2 * groups + tiles) * 32 * 16;
    let wanted = if blocks * 8 < sm_count * 16 {
        max_warps(groups, tiles)
    } else {
        8
    };
    let warps = wanted
        .min(smem_optin / warp_bytes)
        .min(k / (32 * SUB))
        .max(1);
    Some(SkinnyPlan {
        groups_log2: groups.trailing_zeros() as usize,
        tiles_log2: tiles.trailing_zeros() as usize,
        blocks,
        warps,
        smem: warps * warp_bytes,
    })
}
