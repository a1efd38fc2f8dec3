//! When the `gemm` op's own skinny kernel (`kernels/gemm.cu`) takes a product, and how it
//! runs it (pure arithmetic on shapes and addresses; the CUDA launcher in `cuda.rs` asks).

/// The most rows of A the skinny kernel takes (8 n8 tiles).
pub(crate) const SKINNY_MAX_M: usize = 64;

/// How the skinny kernel runs one product: which entry (index into
/// `GemmOutElem::SKINNY`), how many blocks (16 weight rows each) and warps per block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SkinnyPlan {
    /// Index of the entry point: n8 tiles of A's rows = `1 << tiles_log2`.
    pub tiles_log2: usize,
    /// Blocks: one per 16 weight rows.
    pub blocks: usize,
    /// Warps per block (they split the reduction axis).
    pub warps: usize,
}

/// The skinny kernel's plan for `C[m, n] (+)= A[m, k] W[n, k]^T` on a device of `sm_count`
/// SMs, with A and W at device addresses `a` and `w` (bytes) and row strides `lda`, `ldw`
/// (elements), or `None` where it does not take the product: no row or more than
/// [`SKINNY_MAX_M`] rows, `k` not a multiple of 32, or A or W not 16-byte aligned at every row
/// (address and stride). Every other product `gemm_bf16_device` accepts (it checked the
/// spans), it takes. Entry: the fewest n8 tiles (1, 2, 4 or 8) that hold m rows. Warps per
/// block: 16 (8 for 8 n8 tiles, the kernel's `GEMM_WARPS_CAP`) when 8 warps a block would give
/// fewer than 16 warps an SM (small weights: more warps split each block's rows), else 8,
/// never more than the 32-element chunks of the reduction axis.
pub(crate) fn skinny_plan(
    (m, n, k): (usize, usize, usize),
    (a, lda): (u64, usize),
    (w, ldw): (u64, usize),
    sm_count: usize,
) -> Option<SkinnyPlan> {
    let aligned = |addr: u64, ld: usize| addr.is_multiple_of(16) && ld.is_multiple_of(8);
    if m == 0 || m > SKINNY_MAX_M || !k.is_multiple_of(32) || !aligned(a, lda) || !aligned(w, ldw) {
        return None;
    }
    let tiles = m.div_ceil(8).next_power_of_two();
    let blocks = n.div_ceil(16);
    let chunks = k / 32;
    let cap = if tiles >= 8 { 8 } else { 16 }; // GEMM_WARPS_CAP
    let warps = if blocks * 8 < sm_count * 16 { cap } else { 8 };
    Some(SkinnyPlan {
        tiles_log2: tiles.trailing_zeros() as usize,
        blocks,
        warps: warps.min(chunks).max(1),
    })
}
