//! CPU reference of `rms_norm`: the plain RMSNorm of each row in f64, rounded once to BF16.

use half::bf16;

use crate::bf16_rne_f64;

/// `out[j] = w[j] * x[j] / sqrt(mean(x^2) + eps)` in f64 (unrounded), for one row.
///
/// The shared oracle of every plain RMSNorm in this crate (`rms_norm`, `feature_projection`).
pub(crate) fn plain_rms_norm_f64(x: &[f64], w: &[bf16], eps: f32, out: &mut [f64]) {
    let h = x.len();
    let ss: f64 = x.iter().map(|v| v * v).sum();
    let inv = 1.0 / (ss / h as f64 + f64::from(eps)).sqrt();
    for ((o, &v), wj) in out.iter_mut().zip(x).zip(w) {
        *o = f64::from(wj.to_f32()) * v * inv;
    }
}

/// Normalize `rows` rows of `h` elements (input widened to f64 by `widen`), rounding once.
pub(super) fn run<T: Copy>(
    x: &[T],
    w: &[bf16],
    y: &mut [bf16],
    h: usize,
    eps: f32,
    widen: impl Fn(T) -> f64,
) {
    let mut xf = vec![0f64; h];
    let mut nf = vec![0f64; h];
    for (xr, yr) in x.chunks_exact(h).zip(y.chunks_exact_mut(h)) {
        for (d, &s) in xf.iter_mut().zip(xr) {
            *d = widen(s);
        }
        plain_rms_norm_f64(&xf, w, eps, &mut nf);
        for (o, &v) in yr.iter_mut().zip(&nf) {
            *o = bf16_rne_f64(v);
        }
    }
}
