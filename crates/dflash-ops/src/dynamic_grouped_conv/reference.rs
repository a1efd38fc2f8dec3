//! CPU reference of `dynamic_grouped_conv`: the contract in f64, column by column.

use crate::bf16;
use crate::bf16_rne_f64;

use super::ConvParams;

fn f(v: bf16) -> f64 {
    f64::from(v.to_f32())
}

/// `n = norm_w * x / sqrt(mean(x^2) + eps)` of one column, unrounded.
pub(super) fn plain_rmsnorm(x: &[bf16], w: &[bf16], eps: f32, n: &mut [f64]) {
    let ms = x.iter().map(|&v| f(v) * f(v)).sum::<f64>() / x.len() as f64;
    let denom = (ms + f64::from(eps)).sqrt();
    for ((o, &xv), &wv) in n.iter_mut().zip(x).zip(w) {
        *o = f(wv) * f(xv) / denom;
    }
}

pub(super) fn prepare(
    x: &[bf16],
    norm_w: &[bf16],
    base: &[bf16],
    w_delta: &[bf16],
    prepared: &mut [bf16],
    finish_delta: &mut [bf16],
    p: &ConvParams,
) {
    let (h, g_n) = (p.hidden, p.groups());
    let mut n_prev = vec![0f64; h];
    let mut n_cur = vec![0f64; h];
    let mut delta = vec![0f64; 4 * g_n];
    for row in 0..p.rows {
        for i in 0..p.cols {
            let col = row * p.cols + i;
            plain_rmsnorm(&x[col * h..(col + 1) * h], norm_w, p.eps, &mut n_cur);
            for (k, d) in delta.iter_mut().enumerate() {
                let wk = &w_delta[k * h..(k + 1) * h];
                *d = wk
                    .iter()
                    .zip(&n_cur)
                    .fold(0.0, |s, (&wv, &nv)| s + f(wv) * nv);
            }
            for c in 0..h {
                let g = c / p.group;
                let mut v = (f(base[c]) + delta[g]) * n_cur[c];
                if i >= 1 {
                    v += (f(base[h + c]) + delta[g_n + g]) * n_prev[c];
                }
                prepared[col * h + c] = bf16_rne_f64(v);
            }
            for (j, o) in finish_delta[col * 2 * g_n..(col + 1) * 2 * g_n]
                .iter_mut()
                .enumerate()
            {
                *o = bf16_rne_f64(delta[2 * g_n + j]);
            }
            std::mem::swap(&mut n_prev, &mut n_cur);
        }
    }
}

pub(super) fn finish(
    z: &[bf16],
    finish_delta: &[bf16],
    base: &[bf16],
    residual: &[bf16],
    out: &mut [bf16],
    p: &ConvParams,
) {
    let (h, g_n) = (p.hidden, p.groups());
    for row in 0..p.rows {
        for i in 0..p.cols {
            let col = row * p.cols + i;
            let fd = &finish_delta[col * 2 * g_n..(col + 1) * 2 * g_n];
            for c in 0..h {
                let g = c / p.group;
                let e = col * h + c;
                let mut v = (f(base[2 * h + c]) + f(fd[g])) * f(z[e]);
                if i >= 1 {
                    v += (f(base[3 * h + c]) + f(fd[g_n + g])) * f(z[e - h]);
                }
                out[e] = bf16_rne_f64(f(residual[e]) + v);
            }
        }
    }
}
