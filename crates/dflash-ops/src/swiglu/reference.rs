//! CPU reference of `swiglu`: f64 silu and product from the represented inputs, one rounding.

use crate::bf16;
use crate::bf16_rne_f64;

/// `silu(x) = x / (1 + exp(-x))` in f64.
pub(super) fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// Row r of gate starts at `g_off + r * stride`, of up at `u_off + r * stride`.
pub(super) fn run(
    gate: &[bf16],
    g_off: usize,
    up: &[bf16],
    u_off: usize,
    stride: usize,
    inter: usize,
    out: &mut [bf16],
) {
    if inter == 0 {
        return;
    }
    for (r, orow) in out.chunks_exact_mut(inter).enumerate() {
        for (c, o) in orow.iter_mut().enumerate() {
            let g = f64::from(gate[g_off + r * stride + c].to_f32());
            let u = f64::from(up[u_off + r * stride + c].to_f32());
            *o = bf16_rne_f64(silu(g) * u);
        }
    }
}
