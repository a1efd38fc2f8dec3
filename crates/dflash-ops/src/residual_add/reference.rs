//! CPU reference of `residual_add`: the exact f64 sum, rounded once to BF16.

use crate::bf16;

use crate::bf16_rne_f64;

pub(super) fn add(x: &[bf16], y: &[bf16], out: &mut [bf16]) {
    for ((o, a), b) in out.iter_mut().zip(x).zip(y) {
        *o = bf16_rne_f64(f64::from(a.to_f32()) + f64::from(b.to_f32()));
    }
}

pub(crate) fn add_inplace(x: &mut [bf16], y: &[bf16]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a = bf16_rne_f64(f64::from(a.to_f32()) + f64::from(b.to_f32()));
    }
}
