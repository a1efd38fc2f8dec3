//! The per-row attention math shared by [`crate::softmax_attention`] (full layers, paged
//! context) and [`crate::sliding_window_attention`] (local layers, ring context): geometry
//! checks, the split-KV workspace size, the row/data validation and the f64 CPU reference.
//!
//! The two ops differ only in where context position `p` of a row is stored (a ring slot or a
//! page slot) and in the optional window `S`; everything else lives here once.

use crate::bf16_rne_f64;
use half::{bf16, f16};

use crate::registry::{CaseOutput, Criterion, output};
use crate::{Element, OpsError, Result, check_len, check_param};

/// Largest head dimension the CUDA kernels support (each lane of a warp holds at most 4
/// bf16 pairs of a head).
pub(crate) const MAX_HEAD_DIM: usize = 256;

/// Keys per split that the static split count aims for.
pub(crate) const KEYS_PER_SPLIT: usize = 256;

/// Upper bound of the split count (bounds the workspace).
pub(crate) const MAX_SPLITS: usize = 32;

/// The shape of one attention call, common to both ops.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geometry {
    /// Requests in the batch.
    pub rows: usize,
    /// Query columns per request (W).
    pub cols: usize,
    /// Query heads (Hq).
    pub q_heads: usize,
    /// KV heads (Hkv).
    pub kv_heads: usize,
    /// Head dimension (D).
    pub head_dim: usize,
}

fn product(op: &'static str, param: &'static str, factors: &[usize]) -> Result<usize> {
    factors
        .iter()
        .try_fold(1usize, |acc, &f| acc.checked_mul(f))
        .ok_or_else(|| OpsError::Param {
            op,
            param,
            expected: "a shape whose element count fits in usize".into(),
            found: format!("{factors:?}"),
        })
}

impl Geometry {
    /// Query heads per KV head.
    pub(crate) fn group(&self) -> usize {
        self.q_heads / self.kv_heads
    }

    /// Check the static shape parameters (before any length or data check).
    pub(crate) fn validate(&self, op: &'static str) -> Result<()> {
        let i32_max = i32::MAX as usize;
        check_param(
            op,
            "rows",
            (1..=i32_max).contains(&self.rows),
            self.rows,
            || "rows >= 1".into(),
        )?;
        check_param(
            op,
            "cols",
            (1..=i32_max).contains(&self.cols),
            self.cols,
            || "cols >= 1".into(),
        )?;
        check_param(
            op,
            "kv_heads",
            (1..=i32_max).contains(&self.kv_heads),
            self.kv_heads,
            || "kv_heads >= 1".into(),
        )?;
        check_param(
            op,
            "q_heads",
            self.q_heads >= 1
                && self.q_heads <= i32_max
                && self.q_heads.is_multiple_of(self.kv_heads),
            self.q_heads,
            || format!("a positive multiple of kv_heads = {}", self.kv_heads),
        )?;
        check_param(
            op,
            "head_dim",
            self.head_dim >= 2 && self.head_dim <= MAX_HEAD_DIM && self.head_dim.is_multiple_of(2),
            self.head_dim,
            || format!("an even head_dim in 2..={MAX_HEAD_DIM}"),
        )?;
        product(
            op,
            "rows*cols*q_heads*head_dim",
            &[self.rows, self.cols, self.q_heads, self.head_dim],
        )?;
        Ok(())
    }

    /// Elements of `q` and `out`: `[rows, cols, Hq, D]`.
    pub(crate) fn q_len(&self) -> usize {
        self.rows * self.cols * self.q_heads * self.head_dim
    }

    /// Elements of the block K/V: `[rows, cols, Hkv, D]`.
    pub(crate) fn kv_len(&self) -> usize {
        self.rows * self.cols * self.kv_heads * self.head_dim
    }
}

/// The static split count of the split-KV kernels for a layer whose rows can see at most
/// `key_capacity` keys (context plus block): `clamp(ceil(key_capacity / 256), 1, 32)`.
pub(crate) fn split_count(key_capacity: usize) -> usize {
    key_capacity.div_ceil(KEYS_PER_SPLIT).clamp(1, MAX_SPLITS)
}

/// f32 elements of the split-KV workspace: `rows * cols * Hq * splits * (D + 2)` (saturating,
/// so nonsense geometry gives a huge value rather than an overflow).
pub(crate) fn workspace_len(g: &Geometry, key_capacity: usize) -> usize {
    [
        g.rows,
        g.cols,
        g.q_heads,
        split_count(key_capacity),
        g.head_dim.saturating_add(2),
    ]
    .iter()
    .fold(1usize, |acc, &f| acc.saturating_mul(f))
}

/// Lengths of the tensors every attention call takes, for the length checks.
pub(crate) struct Lens {
    /// `q` length.
    pub q: usize,
    /// `k_blk` length.
    pub k_blk: usize,
    /// `v_blk` length.
    pub v_blk: usize,
    /// `start_pos` length.
    pub start_pos: usize,
    /// `live` length.
    pub live: usize,
    /// `out` length.
    pub out: usize,
    /// `workspace` length.
    pub workspace: usize,
    /// The op's key capacity (for the workspace size).
    pub key_capacity: usize,
}

/// Check the lengths of the tensors both ops share.
pub(crate) fn check_common(op: &'static str, g: &Geometry, t: &Lens) -> Result<()> {
    let (r, c, hq, hkv, d) = (g.rows, g.cols, g.q_heads, g.kv_heads, g.head_dim);
    check_len(op, "q", t.q, g.q_len(), || {
        format!("[rows={r}, cols={c}, q_heads={hq}, head_dim={d}]")
    })?;
    check_len(op, "k_blk", t.k_blk, g.kv_len(), || {
        format!("[rows={r}, cols={c}, kv_heads={hkv}, head_dim={d}]")
    })?;
    check_len(op, "v_blk", t.v_blk, g.kv_len(), || {
        format!("[rows={r}, cols={c}, kv_heads={hkv}, head_dim={d}]")
    })?;
    check_len(op, "start_pos", t.start_pos, r, || format!("[rows={r}]"))?;
    check_len(op, "live", t.live, r, || format!("[rows={r}]"))?;
    check_len(op, "out", t.out, g.q_len(), || {
        format!("[rows={r}, cols={c}, q_heads*head_dim={}]", hq * d)
    })?;
    let need = workspace_len(g, t.key_capacity);
    if t.workspace < need {
        let splits = split_count(t.key_capacity);
        return Err(OpsError::Length {
            op,
            tensor: "workspace",
            expected: need,
            shape: format!("at least rows*cols*q_heads*splits*(head_dim+2) with splits={splits}"),
            found: t.workspace,
        });
    }
    Ok(())
}

/// Check the per-row metadata on the host: `start_pos[r] >= 0`, `live[r]` in `1..=cols`.
pub(crate) fn check_rows(
    op: &'static str,
    cols: usize,
    start_pos: &[i32],
    live: &[i32],
) -> Result<()> {
    for (r, &f) in start_pos.iter().enumerate() {
        if f < 0 {
            return Err(OpsError::Value {
                op,
                tensor: "start_pos",
                index: r,
                expected: "a position >= 0".into(),
                found: f.to_string(),
            });
        }
    }
    for (r, &l) in live.iter().enumerate() {
        if l < 1 || l as usize > cols {
            return Err(OpsError::Value {
                op,
                tensor: "live",
                index: r,
                expected: format!("a live column count in 1..={cols}"),
                found: l.to_string(),
            });
        }
    }
    Ok(())
}

/// Where the context of a row lives and which of its positions a query column may see.
pub(crate) trait ContextMap {
    /// The window `S` (local layers) or `None` (full layers).
    fn window(&self) -> Option<usize>;
    /// The flat slot (index over the cache's `[.., Hkv, D]` leading axes) of context position
    /// `p` of row `r`; `p` is in the row's populated context range.
    fn slot(&self, r: usize, p: usize) -> usize;
}

/// Represented inputs of one attention call.
pub(crate) struct Inputs<'a> {
    /// `[rows, cols, Hq, D]`.
    pub q: &'a [bf16],
    /// `[rows, cols, Hkv, D]`.
    pub k_blk: &'a [bf16],
    /// `[rows, cols, Hkv, D]`.
    pub v_blk: &'a [bf16],
    /// Context K `[slots, Hkv, D]` (ring or pages flattened).
    pub ctx_k: &'a [bf16],
    /// Context V `[slots, Hkv, D]`.
    pub ctx_v: &'a [f16],
    /// `[rows]`.
    pub start_pos: &'a [i32],
    /// `[rows]`.
    pub live: &'a [i32],
}

/// The CPU reference of both ops (inputs already validated): f64 scores and softmax from the
/// represented inputs, one RNE rounding to bf16 per output element; dead columns are +0.0.
pub(crate) fn reference(g: &Geometry, ctx: &impl ContextMap, x: &Inputs<'_>, out: &mut [bf16]) {
    let (hq, hkv, d) = (g.q_heads, g.kv_heads, g.head_dim);
    let group = g.group();
    let scale = 1.0 / (d as f64).sqrt();
    let mut scores: Vec<f64> = Vec::new();
    let mut acc = vec![0f64; d];
    for r in 0..g.rows {
        let f = x.start_pos[r] as usize;
        let live = x.live[r] as usize;
        for i in 0..g.cols {
            for h in 0..hq {
                let o = ((r * g.cols + i) * hq + h) * d;
                if i >= live {
                    out[o..o + d].fill(bf16::ZERO);
                    continue;
                }
                let kvh = h / group;
                let qv = &x.q[o..o + d];
                // Visible keys of column i (absolute query position f + i).
                let (ctx_lo, blk_lo, blk_hi) = match ctx.window() {
                    Some(s) => (
                        (f + i + 1).saturating_sub(s),
                        (i + 1).saturating_sub(s),
                        live.min(i + s),
                    ),
                    None => (0, 0, live),
                };
                let mut keys: Vec<(&[bf16], Vals<'_>)> = Vec::new();
                for p in ctx_lo..f {
                    let b = (ctx.slot(r, p) * hkv + kvh) * d;
                    keys.push((&x.ctx_k[b..b + d], Vals::F16(&x.ctx_v[b..b + d])));
                }
                for j in blk_lo..blk_hi {
                    let b = ((r * g.cols + j) * hkv + kvh) * d;
                    keys.push((&x.k_blk[b..b + d], Vals::Bf16(&x.v_blk[b..b + d])));
                }
                scores.clear();
                scores.extend(keys.iter().map(|(k, _)| {
                    qv.iter()
                        .zip(k.iter())
                        .map(|(a, b)| f64::from(a.to_f32()) * f64::from(b.to_f32()))
                        .sum::<f64>()
                        * scale
                }));
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                acc.fill(0.0);
                let mut sum = 0.0;
                for (s, (_, v)) in scores.iter().zip(&keys) {
                    let w = (s - max).exp();
                    sum += w;
                    for (a, e) in acc.iter_mut().zip(0..d) {
                        *a += w * v.get(e);
                    }
                }
                for (dst, a) in out[o..o + d].iter_mut().zip(&acc) {
                    *dst = bf16_rne_f64(a / sum);
                }
            }
        }
    }
}

/// A value row of either storage dtype.
enum Vals<'a> {
    Bf16(&'a [bf16]),
    F16(&'a [f16]),
}

impl Vals<'_> {
    fn get(&self, e: usize) -> f64 {
        match self {
            Vals::Bf16(v) => f64::from(v[e].to_f32()),
            Vals::F16(v) => f64::from(v[e].to_f32()),
        }
    }
}

/// Comparison criterion of the attention output: FP32 device math against the f64 oracle,
/// both rounded once to bf16, may differ by a rounding-boundary flip (2 bf16 ulps admit a
/// flip next to a binade edge) or by a tiny absolute amount near zero.
pub(crate) const OUT_CRITERION: Criterion = Criterion::Close {
    abs: 1e-4,
    rel: 0.0,
    bf16_ulps: 2,
};

/// Deterministic case data (SplitMix64), independent of any RNG crate.
pub(crate) struct CaseRng(u64);

impl CaseRng {
    /// A generator seeded with `seed`.
    pub(crate) fn new(seed: u64) -> Self {
        CaseRng(seed)
    }

    /// The next 64 random bits.
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[-amp, amp)`.
    pub(crate) fn symmetric(&mut self, amp: f32) -> f32 {
        let u = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        (2.0 * u - 1.0) * amp
    }

    /// `n` bf16 values uniform in `[-amp, amp)`, rounded RNE.
    pub(crate) fn bf16s(&mut self, n: usize, amp: f32) -> Vec<bf16> {
        (0..n)
            .map(|_| crate::bf16_rne(self.symmetric(amp)))
            .collect()
    }

    /// `n` context V values as the materializer stores them: `f16_rne(bf16_rne(v))`.
    pub(crate) fn ctx_v(&mut self, n: usize, amp: f32) -> Vec<f16> {
        (0..n)
            .map(|_| crate::f16_rne(crate::bf16_rne(self.symmetric(amp)).to_f32()))
            .collect()
    }

    /// A uniformly random permutation of `0..n` (Fisher-Yates).
    pub(crate) fn permutation(&mut self, n: usize) -> Vec<usize> {
        let mut v: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            let j = (self.next_u64() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
        v
    }
}

/// The case outputs of an attention run: `out` (close, every element written) and, when some
/// column is dead, `out_dead` (the dead columns' bits, exact: +0.0 everywhere).
pub(crate) fn case_outputs(g: &Geometry, live: &[i32], after: &[bf16]) -> Vec<CaseOutput> {
    let before = vec![bf16::POISON; after.len()];
    let mut outs = vec![output("out", OUT_CRITERION, &before, after, |_| true)];
    let per_col = g.q_heads * g.head_dim;
    let dead: Vec<bf16> = after
        .chunks(per_col)
        .enumerate()
        .filter(|(rc, _)| rc % g.cols >= live[rc / g.cols] as usize)
        .flat_map(|(_, c)| c.iter().copied())
        .collect();
    if !dead.is_empty() {
        let before = vec![bf16::POISON; dead.len()];
        let mut o = output("out_dead", Criterion::Exact, &before, &dead, |_| true);
        o.allow_constant = true;
        outs.push(o);
    }
    outs
}

/// A line-by-line f32 port of the CUDA split and merge bodies (kernels/softmax_attention.cu),
/// for tests: the same key list, chunking, visibility tests, online softmax, workspace layout
/// (poisoned with NaN so reading an unwritten partial shows) and merge. `row_ctx(r)` gives
/// the kernel's (F, ctx_lo) of row r, `slot(r, p)` the flat slot or -1; `window` 0 = none.
#[cfg(test)]
pub(crate) fn emulate_split_kv(
    g: &Geometry,
    window: i64,
    splits: usize,
    x: &Inputs<'_>,
    row_ctx: impl Fn(usize) -> (i64, i64),
    slot: impl Fn(usize, i64) -> i64,
) -> Vec<bf16> {
    let (rows, cols, hq, hkv, d) = (g.rows, g.cols, g.q_heads, g.kv_heads, g.head_dim);
    let group = hq / hkv;
    let ml_len = 2 * rows * cols * hq * splits;
    let mut ws = vec![f32::NAN; ml_len + rows * cols * hq * splits * d];
    let scale = 1.0f32 / (d as f32).sqrt();
    for r in 0..rows {
        let (f, lo) = row_ctx(r);
        let live = i64::from(x.live[r]).clamp(0, cols as i64);
        let n_ctx = f - lo;
        let n = n_ctx + live;
        let chunk = (n + splits as i64 - 1) / splits as i64;
        for kvh in 0..hkv {
            for s in 0..splits {
                let t0 = n.min(s as i64 * chunk);
                let t1 = n.min(t0 + chunk);
                for it in 0..group * live as usize {
                    let i = it / group;
                    let h = kvh * group + it % group;
                    let qo = ((r * cols + i) * hq + h) * d;
                    let qf: Vec<f32> = x.q[qo..qo + d].iter().map(|v| v.to_f32()).collect();
                    let mut acc = vec![0f32; d];
                    let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
                    let pq = f + i as i64;
                    for t in t0..t1 {
                        let is_ctx = t < n_ctx;
                        let off = if is_ctx {
                            let p = lo + t;
                            if window > 0 && p <= pq - window {
                                continue;
                            }
                            let sl = slot(r, p);
                            if sl < 0 {
                                continue;
                            }
                            (sl as usize * hkv + kvh) * d
                        } else {
                            let j = t - n_ctx;
                            if window > 0 && (j - i as i64).abs() >= window {
                                continue;
                            }
                            ((r * cols + j as usize) * hkv + kvh) * d
                        };
                        let kv = |e: usize| -> (f32, f32) {
                            if is_ctx {
                                (x.ctx_k[off + e].to_f32(), x.ctx_v[off + e].to_f32())
                            } else {
                                (x.k_blk[off + e].to_f32(), x.v_blk[off + e].to_f32())
                            }
                        };
                        let part: f32 = (0..d).map(|e| qf[e] * kv(e).0).sum();
                        let sc = part * scale;
                        let m_new = m.max(sc);
                        let corr = (m - m_new).exp();
                        let w = (sc - m_new).exp();
                        l = l * corr + w;
                        for (e, a) in acc.iter_mut().enumerate() {
                            *a = *a * corr + w * kv(e).1;
                        }
                        m = m_new;
                    }
                    let item = ((r * cols + i) * hq + h) * splits + s;
                    ws[2 * item] = m;
                    ws[2 * item + 1] = l;
                    ws[ml_len + item * d..ml_len + (item + 1) * d].copy_from_slice(&acc);
                }
            }
        }
    }
    let mut out = vec![bf16::POISON; rows * cols * hq * d];
    for r in 0..rows {
        let live = (x.live[r].max(0) as usize).min(cols);
        for i in 0..cols {
            for h in 0..hq {
                for e in 0..d {
                    let o = ((r * cols + i) * hq + h) * d + e;
                    if i >= live {
                        out[o] = bf16::from_f32(0.0);
                        continue;
                    }
                    let item0 = ((r * cols + i) * hq + h) * splits;
                    let mx = (0..splits)
                        .map(|s| ws[2 * (item0 + s)])
                        .fold(f32::NEG_INFINITY, f32::max);
                    let (mut num, mut den) = (0f32, 0f32);
                    if mx != f32::NEG_INFINITY {
                        for s in 0..splits {
                            let ms = ws[2 * (item0 + s)];
                            if ms == f32::NEG_INFINITY {
                                continue;
                            }
                            let w = (ms - mx).exp();
                            den += w * ws[2 * (item0 + s) + 1];
                            num += w * ws[ml_len + (item0 + s) * d + e];
                        }
                    }
                    out[o] = bf16::from_f32(if den > 0.0 { num / den } else { 0.0 });
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f64_rounding_is_single_rne() {
        // Exactly representable values pass through.
        for v in [0.0, 1.0, -2.5, 0.009765625, 3.0e38] {
            assert_eq!(bf16_rne_f64(v), bf16::from_f64(v), "{v}");
        }
        // 1 + 2^-8 is a tie between 1 and 1 + 2^-7: ties to even (1.0).
        assert_eq!(bf16_rne_f64(1.0 + 2f64.powi(-8)).to_bits(), 0x3f80);
        // 1 + 3 * 2^-8 ties between 1 + 2^-7 (odd) and 1 + 2^-6 (even): rounds up.
        assert_eq!(bf16_rne_f64(1.0 + 3.0 * 2f64.powi(-8)).to_bits(), 0x3f82);
        // Just above the tie by 2^-40 (lost by a 32-bit truncation): must round up.
        assert_eq!(
            bf16_rne_f64(1.0 + 2f64.powi(-8) + 2f64.powi(-40)).to_bits(),
            0x3f81
        );
        assert_eq!(
            bf16_rne_f64(-(1.0 + 2f64.powi(-8) + 2f64.powi(-40))).to_bits(),
            0xbf81
        );
        // Below the tie rounds down; mantissa carry moves to the next binade.
        assert_eq!(
            bf16_rne_f64(1.0 + 2f64.powi(-8) - 2f64.powi(-40)).to_bits(),
            0x3f80
        );
        assert_eq!(bf16_rne_f64(2.0 - 2f64.powi(-9)).to_bits(), 0x4000);
    }

    #[test]
    fn split_count_is_static_and_bounded() {
        assert_eq!(split_count(0), 1);
        assert_eq!(split_count(256), 1);
        assert_eq!(split_count(257), 2);
        assert_eq!(split_count(4095 + 16), 17);
        assert_eq!(split_count(1 << 20), MAX_SPLITS);
    }
}
