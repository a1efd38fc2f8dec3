//! CPU reference of `head_norm_rope`: per-head plain RMSNorm and split-half RoPE in f64.

use half::bf16;

use crate::bf16_rne_f64;

/// 2*pi as the f64 constant both the reference and the kernels reduce angles with.
pub(crate) const TWO_PI: f64 = std::f64::consts::TAU;

/// The RoPE angle of pair `j` of a head of dimension `d` at position `pos`, reduced into
/// `[0, 2*pi]`: `a = pos * theta^(-2j/d)` formed in f64, then `a - 2*pi * floor(a / 2*pi)` in
/// f64 (the contract's reduction; the kernels evaluate exactly these f64 operations).
pub(crate) fn rope_angle(pos: i64, j: usize, d: usize, theta: f64) -> f64 {
    let inv_freq = theta.powf(-((2 * j) as f64) / d as f64);
    let a = pos as f64 * inv_freq;
    a - TWO_PI * (a / TWO_PI).floor()
}

/// One head: `n = w * x / sqrt(mean(x^2) + eps)` over all `d = x.len()` elements, then for
/// `j < d/2` with angle `rope_angle(pos, j, d, theta)`:
/// `out[j] = n[j] cos - n[j + d/2] sin`, `out[j + d/2] = n[j + d/2] cos + n[j] sin`, in f64
/// (unrounded).
///
/// The shared oracle of `head_norm_rope` and `context_kv_materialize` (K).
pub(crate) fn head_norm_rope_f64(
    x: &[f64],
    w: &[bf16],
    pos: i64,
    theta: f64,
    eps: f32,
    out: &mut [f64],
) {
    let d = x.len();
    let half = d / 2;
    let ss: f64 = x.iter().map(|v| v * v).sum();
    let inv = 1.0 / (ss / d as f64 + f64::from(eps)).sqrt();
    let n = |j: usize| f64::from(w[j].to_f32()) * x[j] * inv;
    for j in 0..half {
        let (a, b) = (n(j), n(j + half));
        let (s, c) = rope_angle(pos, j, d, theta).sin_cos();
        out[j] = a * c - b * s;
        out[j + half] = b * c + a * s;
    }
}

/// The op on `[rows, cols, heads, d]`: position of column `c` of row `r` is
/// `start_pos[r] + c`; every element rounded once to BF16.
pub(super) fn run(
    x: &[f32],
    w: &[bf16],
    start_pos: &[i32],
    out: &mut [bf16],
    cols: usize,
    heads: usize,
    d: usize,
    theta: f64,
    eps: f32,
) {
    let mut xf = vec![0f64; d];
    let mut of = vec![0f64; d];
    let per_row = cols * heads * d;
    if per_row == 0 {
        return;
    }
    for (r, (xr, yr)) in x
        .chunks_exact(per_row)
        .zip(out.chunks_exact_mut(per_row))
        .enumerate()
    {
        for c in 0..cols {
            let pos = i64::from(start_pos[r]) + c as i64;
            for h in 0..heads {
                let base = (c * heads + h) * d;
                for (dst, &s) in xf.iter_mut().zip(&xr[base..base + d]) {
                    *dst = f64::from(s);
                }
                head_norm_rope_f64(&xf, w, pos, theta, eps, &mut of);
                for (o, &v) in yr[base..base + d].iter_mut().zip(&of) {
                    *o = bf16_rne_f64(v);
                }
            }
        }
    }
}
