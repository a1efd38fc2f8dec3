//! CPU reference of `gemm`: f64 dot products of the represented BF16 inputs, rounded once.
//!
//! Also the shared oracle helpers of the dense ops: [`matmul_f64`] (used by
//! `feature_projection` and `context_kv_materialize`) and [`bf16_rne_f64`] (the one
//! correctly rounded f64 -> BF16 cast of every reference in this crate).

use half::bf16;

use crate::bf16_rne_f64;

/// The number of worker threads the CPU references use for `work` independent items.
pub(crate) fn threads_for(work: usize) -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .clamp(1, work.max(1))
}

/// `C[i, j] = sum_l A[i, l] * W[j, l]` in f64 over the represented BF16 inputs
/// (A: `[m, k]`, W: `[n, k]`, C: `[m, n]`, all row-major). The caller checks the lengths.
///
/// Each product of two BF16 values is exact in f64 and the f64 sum of `k` of them has a
/// relative error far below any tolerance of this crate (k <= 2^20), so this is the
/// contract's "naive FP64 evaluation".
pub(crate) fn matmul_f64(a: &[bf16], w: &[bf16], m: usize, n: usize, k: usize) -> Vec<f64> {
    // Small products run on the calling thread (spawning costs more than the arithmetic).
    let threads = if m * n * k < (1 << 22) {
        1
    } else {
        threads_for(n)
    };
    matmul_f64_threads(a, w, m, n, k, threads)
}

/// [`matmul_f64`] with an explicit worker count (any count >= 1 gives the same result).
pub(crate) fn matmul_f64_threads(
    a: &[bf16],
    w: &[bf16],
    m: usize,
    n: usize,
    k: usize,
    threads: usize,
) -> Vec<f64> {
    let mut c = vec![0f64; m * n];
    if m == 0 || n == 0 {
        return c;
    }
    let af: Vec<f64> = a[..m * k].iter().map(|x| f64::from(x.to_f32())).collect();
    let chunk = n.div_ceil(threads.clamp(1, n));
    // Only as many workers as there are non-empty row ranges (t * chunk < n).
    let threads = n.div_ceil(chunk);
    // Each thread owns a range of weight rows j and returns the [m, range] block.
    let blocks: Vec<(usize, Vec<f64>)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (j0, j1) = (t * chunk, ((t + 1) * chunk).min(n));
                let af = &af;
                s.spawn(move || {
                    let len = j1.saturating_sub(j0);
                    let mut block = vec![0f64; m * len];
                    let mut wrow = vec![0f64; k];
                    for j in j0..j1 {
                        for (dst, src) in wrow.iter_mut().zip(&w[j * k..(j + 1) * k]) {
                            *dst = f64::from(src.to_f32());
                        }
                        for i in 0..m {
                            let arow = &af[i * k..(i + 1) * k];
                            // Start from +0.0 (as an accumulator on the device does): `Sum` starts from -0.0.
                            let dot: f64 = arow.iter().zip(&wrow).fold(0.0, |s, (x, y)| s + x * y);
                            block[i * len + (j - j0)] = dot;
                        }
                    }
                    (j0, block)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    for (j0, block) in blocks {
        let len = block.len() / m;
        for i in 0..m {
            c[i * n + j0..i * n + j0 + len].copy_from_slice(&block[i * len..(i + 1) * len]);
        }
    }
    c
}

/// F32 output: the f64 sum rounded once to f32 (RNE).
pub(crate) fn run_f32(a: &[bf16], w: &[bf16], out: &mut [f32], m: usize, n: usize, k: usize) {
    let c = matmul_f64(a, w, m, n, k);
    for (o, v) in out.iter_mut().zip(c) {
        *o = v as f32;
    }
}

/// BF16 output: the f64 sum rounded once to BF16 (RNE).
pub(super) fn run_bf16(a: &[bf16], w: &[bf16], out: &mut [bf16], m: usize, n: usize, k: usize) {
    let c = matmul_f64(a, w, m, n, k);
    for (o, v) in out.iter_mut().zip(c) {
        *o = bf16_rne_f64(v);
    }
}
