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
    norm_rotate_f64(x, w, eps, |j| rope_angle(pos, j, d, theta), out);
}

/// [`head_norm_rope_f64`] with the angle of pair `j` given by `angle(j)` (the fused form
/// reads the block's angle table).
pub(crate) fn norm_rotate_f64(
    x: &[f64],
    w: &[bf16],
    eps: f32,
    angle: impl Fn(usize) -> f64,
    out: &mut [f64],
) {
    let d = x.len();
    let half = d / 2;
    let ss: f64 = x.iter().map(|v| v * v).sum();
    let inv = 1.0 / (ss / d as f64 + f64::from(eps)).sqrt();
    let n = |j: usize| f64::from(w[j].to_f32()) * x[j] * inv;
    for j in 0..half {
        let (a, b) = (n(j), n(j + half));
        let (s, c) = angle(j).sin_cos();
        out[j] = a * c - b * s;
        out[j + half] = b * c + a * s;
    }
}

/// The angle table of a block: `angles[(r * cols + c) * d/2 + j]` = the reduced angle of pair
/// `j` at position `start_pos[r] + c`, narrowed to f32 (start positions checked >= 0).
pub(super) fn table(start_pos: &[i32], angles: &mut [f32], cols: usize, d: usize, theta: f64) {
    let half = d / 2;
    for (i, a) in angles.iter_mut().enumerate() {
        let (rc, j) = (i / half, i % half);
        let pos = i64::from(start_pos[rc / cols]) + (rc % cols) as i64;
        *a = rope_angle(pos, j, d, theta) as f32;
    }
}

/// The fused form: token `t`, head `h` of `qkv` `[tokens, hq + 2 hkv, d]`; Q and K heads
/// normalized and rotated with the table's angles (widened), V heads rounded.
#[allow(clippy::too_many_arguments)] // reason: the contract's tensors, one each
pub(super) fn qkv(
    qkv: &[f32],
    q_norm: &[bf16],
    k_norm: &[bf16],
    angles: &[f32],
    q: &mut [bf16],
    k: &mut [bf16],
    v: &mut [bf16],
    hq: usize,
    hkv: usize,
    d: usize,
    eps: f32,
) {
    let heads = hq + 2 * hkv;
    let half = d / 2;
    let mut xf = vec![0f64; d];
    let mut of = vec![0f64; d];
    for (i, x) in qkv.chunks_exact(d).enumerate() {
        let (t, h) = (i / heads, i % heads);
        let (norm, dst) = if h < hq {
            (Some(q_norm), &mut q[(t * hq + h) * d..(t * hq + h + 1) * d])
        } else if h < hq + hkv {
            let kh = t * hkv + h - hq;
            (Some(k_norm), &mut k[kh * d..(kh + 1) * d])
        } else {
            let vh = t * hkv + h - hq - hkv;
            (None, &mut v[vh * d..(vh + 1) * d])
        };
        match norm {
            Some(w) => {
                for (dst, &s) in xf.iter_mut().zip(x) {
                    *dst = f64::from(s);
                }
                let row = &angles[t * half..(t + 1) * half];
                norm_rotate_f64(&xf, w, eps, |j| f64::from(row[j]), &mut of);
                for (o, &val) in dst.iter_mut().zip(&of) {
                    *o = bf16_rne_f64(val);
                }
            }
            None => {
                for (o, &val) in dst.iter_mut().zip(x) {
                    *o = bf16_rne_f64(f64::from(val));
                }
            }
        }
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
