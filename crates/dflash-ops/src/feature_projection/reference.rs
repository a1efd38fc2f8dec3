//! CPU reference of `feature_projection`: f64 projection, f64 plain RMSNorm, one BF16 rounding.

use half::bf16;

use crate::bf16_rne_f64;
use crate::gemm::reference::matmul_f64;
use crate::rms_norm::reference::plain_rms_norm_f64;

pub(super) fn run(
    s: &[bf16],
    w_feature: &[bf16],
    context_norm: &[bf16],
    out: &mut [bf16],
    tokens: usize,
    k: usize,
    h: usize,
    eps: f32,
) {
    let proj = matmul_f64(s, w_feature, tokens, h, k);
    let mut n = vec![0f64; h];
    for (row, o) in proj.chunks_exact(h).zip(out.chunks_exact_mut(h)) {
        plain_rms_norm_f64(row, context_norm, eps, &mut n);
        for (dst, &v) in o.iter_mut().zip(&n) {
            *dst = bf16_rne_f64(v);
        }
    }
}
