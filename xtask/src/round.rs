//! `dflash-bench --only round`: the draft's side of one speculative round as one CUDA graph,
//! against a chain of plain cuBLAS GEMMs over weights of the same shapes (issue 14, item 4).
//!
//! - `round`: one graph holding, per replay, (a) the push of [`NEW`] = 8 verified feature rows
//!   per request into the store's round slab (device copies, as the engine's commit makes),
//!   (b) the batched materialize of those rows (`DraftModel::materialize_round`: the lanes'
//!   starts and counts, one feature projection of B x 8 rows, one context K/V materialize per
//!   layer) and (c) the draft block (`DraftModel::run_block`: every layer, final norm, head;
//!   DFlash2 with its selector at T = 0.7) over B requests of K mask columns at frontier T.
//!   The block is staged at frontier T (the store prefilled to T); the materialize takes the
//!   store's next positions: `time_graph`'s eager warm-up materializes T .. T + 8, the captured
//!   call T + 8 .. T + 16, which every replay rewrites. So each replay does a round's work, the
//!   materialize ahead of the block, except that the rows it writes lie past the block's
//!   frontier instead of just before it (the projection and the K/V writes do the same work
//!   at any position). The materialize's two metadata writes (host to device) are captured as
//!   copies of the captured round's values.
//! - `cublas_chain`: one graph of every weight GEMM the round makes, by cuBLAS alone
//!   (`GemmKernels::Cublas`), one GEMM per weight as the checkpoint stores it (no fused
//!   projections), over weights of its own (allocated from the geometry, not the draft's
//!   buffers) and the setup's output head: the materialize's `fc` at B x 8 rows (F32 out) and
//!   per layer the context K and V projections at B x 8 rows (F32 out); per layer at
//!   B x (K + 1) rows q and k (F32 out), v, o, gate, up, down (BF16 out), DFlash2 also the two
//!   convolution projections at 2 x B x (K + 1) rows (the split's two taps, F32 out); the head
//!   `[vocab_rows, H]` at B x K rows (F32 logits); DFlash2 the selector's `W_hidden` at B x K
//!   rows (BF16 out).
//! - Floor (both rows): every weight byte the round reads (the block's, [`crate::weight_bytes`],
//!   plus the materialize's `fc`, `hidden_norm`, context K/V projections and key norms) plus the
//!   visible context K/V of every layer ([`crate::kv_bytes`]), at 4.1 TB/s.

use anyhow::{Context, Result};
use dflash_config::Geometry;
use dflash_context::ContextHandle;
use dflash_ops::cuda::{CudaBackend, GemmKernels};
use dflash_ops::gemm::{self, GemmParams};
use dflash_ops::{Backend, Buffer, bf16};

use crate::{
    DRAFTS, Draft, Row, Setup, bf, block_state, floor_us, kv_bytes, random_buf, target_parts,
    time_graph, weight_bytes,
};

/// The `op` of a round row.
pub const ROUND: &str = "round";
/// The `op` of a cuBLAS chain row.
pub const CHAIN: &str = "cublas_chain";
/// Pending context rows per request that a round materializes.
pub const NEW: usize = 8;

/// The round shapes `(B, K, T)`: the `--shape` alone; with `--quick` B in {1, 8} at K = 15,
/// T = 2048; else every B in {1, 8}, K in {7, 15}, T in {2048, 4096}.
pub fn shapes(shape: Option<(usize, usize, usize)>, quick: bool) -> Vec<(usize, usize, usize)> {
    match (shape, quick) {
        (Some(s), _) => vec![s],
        (None, true) => vec![(1, 15, 2048), (8, 15, 2048)],
        (None, false) => [2048, 4096]
            .into_iter()
            .flat_map(|t| {
                [1, 8]
                    .into_iter()
                    .flat_map(move |b| [(b, 7, t), (b, 15, t)])
            })
            .collect(),
    }
}

/// The round row (named `op`) of one shape, and its `cublas_chain` row when `chain` is
/// given: `rows` requests of `k` mask columns at frontier `context` (see the module doc).
pub fn bench_round(
    cuda: &CudaBackend,
    s: &Setup,
    (op, chain): (&'static str, Option<&Chain>),
    d: &Draft,
    rows: usize,
    k: usize,
    context: usize,
) -> Result<Vec<Row>> {
    let shape = format!("{} B={rows} K={k} context {context}", d.name);
    let be = Backend::Cuda(cuda.clone());
    let (mut store, mut ws, reqs) = block_state(&be, s, rows, k, context, Some(NEW))
        .with_context(|| format!("round state, {shape}"))?;
    let handles: Vec<ContextHandle> = reqs.iter().map(|r| r.handle).collect();
    let features = random_buf(&be, NEW * s.g.feature_width as usize, 43, bf)?;
    let tp = target_parts(s);
    let round = time_graph(cuda, 1, |_| {
        for &h in &handles {
            let at = store.pending_target_frontier(h)?;
            store.push_pending(h, at, &features, NEW)?;
        }
        s.model.materialize_round(&mut store, &handles)?;
        s.model.run_block(&store, &tp, &mut ws)?;
        Ok(())
    })
    .with_context(|| format!("round graph, {shape}"))?;
    let blas = chain
        .map(|c| time_chain(cuda, c, &s.head, rows, k))
        .transpose()
        .with_context(|| format!("cuBLAS chain, {shape}"))?;
    // The round also reads the context K/V; the chain reads only the weights.
    let weights = round_weight_bytes(&s.g);
    let row = |op, median_us, bytes: u64| Row {
        op,
        draft: d.name,
        b: rows,
        k,
        context,
        median_us,
        floor_us: floor_us(bytes as f64),
    };
    let mut rows = vec![row(op, round, weights + kv_bytes(&s.g, rows, context))];
    rows.extend(blas.map(|us| row(CHAIN, us, weights)));
    Ok(rows)
}

/// Weight bytes a round reads: the block's ([`weight_bytes`]) plus the materialize's `fc`
/// `[H, n_ids * H]`, `hidden_norm` `[H]` and per layer the context K and V projections
/// `[Hkv * D, H]` (the layer's k_proj and v_proj, read a second time) and key norm `[D]`.
fn round_weight_bytes(g: &Geometry) -> u64 {
    let (h, d) = (u64::from(g.hidden), u64::from(g.head_dim));
    let kvd = u64::from(g.kv_heads) * d;
    let per_layer = 2 * kvd * h + d;
    weight_bytes(g) + (h * g.feature_width + h + per_layer * g.layers.len() as u64) * 2
}

/// Which rows of A one chain GEMM multiplies, per round shape (B requests, K masks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ChainRows {
    /// The materialize's B x [`NEW`] pending rows.
    New,
    /// The block's B x (K + 1) columns.
    Block,
    /// The DFlash2 convolution's split: both taps of every block column, 2 x B x (K + 1).
    ConvSplit,
    /// The head's B x K mask columns.
    Mask,
}

impl ChainRows {
    /// The rows of A (m) for B requests of K mask columns.
    fn m(self, b: usize, k: usize) -> usize {
        match self {
            ChainRows::New => b * NEW,
            ChainRows::Block => b * (k + 1),
            ChainRows::ConvSplit => 2 * b * (k + 1),
            ChainRows::Mask => b * k,
        }
    }
}

/// One GEMM of the chain: a weight `[n, k]` (the checkpoint's layout) at some rows of A.
#[derive(Clone, Copy, Debug)]
struct ChainGemm {
    /// Output features (rows of the weight).
    n: usize,
    /// Input features (the reduction).
    k: usize,
    rows: ChainRows,
    /// F32 output (else BF16), as the round's op writes it.
    f32_out: bool,
    /// The weight is the output head `[vocab_rows, H]` (the setup's; no copy).
    head: bool,
}

/// Every weight GEMM of a round, in the round's order (see the module doc).
fn chain_plan(g: &Geometry) -> Vec<ChainGemm> {
    let (h, i) = (g.hidden as usize, g.intermediate as usize);
    let (qd, kvd) = (
        (g.q_heads * g.head_dim) as usize,
        (g.kv_heads * g.head_dim) as usize,
    );
    let gemm = |n, k, rows, f32_out| ChainGemm {
        n,
        k,
        rows,
        f32_out,
        head: false,
    };
    let (new, block) = (ChainRows::New, ChainRows::Block);
    let conv = g.dflash2.as_ref().map(|p| {
        let groups = h / (p.conv_group_size as usize).max(1);
        gemm(4 * groups, h, ChainRows::ConvSplit, true)
    });
    let mut plan = vec![gemm(h, g.feature_width as usize, new, true)];
    for _ in &g.layers {
        plan.extend([gemm(kvd, h, new, true), gemm(kvd, h, new, true)]);
    }
    for _ in &g.layers {
        plan.extend(conv);
        plan.extend([
            gemm(qd, h, block, true),
            gemm(kvd, h, block, true),
            gemm(kvd, h, block, false),
            gemm(h, qd, block, false),
        ]);
        plan.extend(conv);
        plan.extend([
            gemm(i, h, block, false),
            gemm(i, h, block, false),
            gemm(h, i, block, false),
        ]);
    }
    plan.push(ChainGemm {
        head: true,
        ..gemm(g.vocab_rows as usize, h, ChainRows::Mask, true)
    });
    if let Some(p) = &g.dflash2 {
        plan.push(gemm(p.selector_rank as usize, h, ChainRows::Mask, false));
    }
    plan
}

/// The cuBLAS chain of one draft: [`chain_plan`] with a weight of its own for every GEMM but
/// the head's (a few GB for the 27B draft; far above the L2 cache, so no rotation).
pub struct Chain {
    /// Each GEMM with its weight (`None`: the setup's output head).
    gemms: Vec<(ChainGemm, Option<Buffer<bf16>>)>,
}

impl Chain {
    /// Allocate the chain's weights for geometry `g` on `be` (pseudo-random values).
    pub fn new(be: &Backend, g: &Geometry) -> Result<Self> {
        let gemms = chain_plan(g)
            .into_iter()
            .enumerate()
            .map(|(at, c)| {
                let w = (!c.head)
                    .then(|| random_buf(be, c.n * c.k, 100 + at as u64, |x| bf(0.02 * x)))
                    .transpose()
                    .with_context(|| format!("chain weight {at}: [{}, {}]", c.n, c.k))?;
                Ok((c, w))
            })
            .collect::<Result<_>>()?;
        Ok(Chain { gemms })
    }
}

/// The chain at B = `b`, K = `k` as one graph by cuBLAS alone: the median time of a replay.
/// A and the outputs are one buffer each, sized for the largest product and resized per GEMM
/// in place (`Buffer::set_len`, no allocation).
fn time_chain(
    cuda: &CudaBackend,
    chain: &Chain,
    head: &Buffer<bf16>,
    b: usize,
    k: usize,
) -> Result<f64> {
    let be = Backend::Cuda(cuda.clone());
    let params: Vec<GemmParams> = chain
        .gemms
        .iter()
        .map(|(c, _)| GemmParams {
            m: c.rows.m(b, k),
            n: c.n,
            k: c.k,
        })
        .collect();
    let most = |f32_out: Option<bool>, len: fn(&GemmParams) -> usize| {
        chain
            .gemms
            .iter()
            .zip(&params)
            .filter(|((c, _), _)| f32_out.is_none_or(|f| c.f32_out == f))
            .map(|(_, p)| len(p))
            .max()
            .unwrap_or(0)
    };
    let mut a = random_buf(&be, most(None, |p| p.m * p.k), 51, |x| bf(2.0 * x))?;
    let mut out_f32 = be.zeros::<f32>(most(Some(true), |p| p.m * p.n))?;
    let mut out_bf16 = be.zeros::<bf16>(most(Some(false), |p| p.m * p.n))?;
    cuda.set_gemm_kernels(GemmKernels::Cublas);
    let t = time_graph(cuda, 1, |_| {
        for ((c, w), p) in chain.gemms.iter().zip(&params) {
            let w = w.as_ref().unwrap_or(head);
            a.set_len(p.m * p.k)?;
            if c.f32_out {
                out_f32.set_len(p.m * p.n)?;
                gemm::run_f32(&be, &a, w, &mut out_f32, p)?;
            } else {
                out_bf16.set_len(p.m * p.n)?;
                gemm::run_bf16(&be, &a, w, &mut out_bf16, p)?;
            }
        }
        Ok(())
    });
    cuda.set_gemm_kernels(GemmKernels::Auto);
    t
}

/// The issue's fixed round targets at context 2048, K = 15: (draft, B, microseconds).
const FIXED_TARGETS: [(&str, usize, f64); 4] = [
    (DRAFTS[0].name, 1, 550.0),
    (DRAFTS[0].name, 8, 900.0),
    (DRAFTS[1].name, 1, 1800.0),
    (DRAFTS[1].name, 8, 2400.0),
];

/// The `cublas_chain` row of `r`'s draft and shape, if measured.
fn chain_of<'a>(r: &Row, rows: &'a [Row]) -> Option<&'a Row> {
    rows.iter().find(|x| {
        x.op == CHAIN && x.draft == r.draft && x.b == r.b && x.k == r.k && x.context == r.context
    })
}

/// The target of a `round` row (description, met?): the fixed bound at context 2048, K = 15,
/// and at B = 1 a time below the `cublas_chain` of the same shape; both where both apply.
pub fn target(r: &Row, rows: &[Row]) -> Option<(String, bool)> {
    let fixed = FIXED_TARGETS
        .iter()
        .find(|&&(draft, b, _)| (r.k, r.context) == (15, 2048) && (draft, b) == (r.draft, r.b))
        .map(|&(_, _, us)| (format!("<= {us:.0} us"), r.median_us <= us));
    let chain = chain_of(r, rows).filter(|_| r.b == 1).map(|c| {
        (
            format!("< cublas_chain {:.1} us", c.median_us),
            r.median_us < c.median_us,
        )
    });
    let parts: Vec<(String, bool)> = fixed.into_iter().chain(chain).collect();
    if parts.is_empty() {
        return None;
    }
    let text = parts.iter().map(|p| p.0.as_str()).collect::<Vec<_>>();
    Some((text.join(", "), parts.iter().all(|p| p.1)))
}

/// A Markdown table of every round against its cuBLAS chain (empty without round rows).
pub fn ratio_table(rows: &[Row]) -> String {
    let mut md = String::new();
    for r in rows.iter().filter(|r| r.op == ROUND) {
        let Some(c) = chain_of(r, rows) else {
            continue;
        };
        if md.is_empty() {
            md.push_str(
                "\n| draft | B | K | context | round us | cublas_chain us | round / cublas_chain \
                 | round x floor | cublas_chain x floor |\n|---|---|---|---|---|---|---|---|---|\n",
            );
        }
        md.push_str(&format!(
            "| {} | {} | {} | {} | {:.1} | {:.1} | {:.2} | {:.2} | {:.2} |\n",
            r.draft,
            r.b,
            r.k,
            r.context,
            r.median_us,
            c.median_us,
            r.median_us / c.median_us,
            r.median_us / r.floor_us,
            c.median_us / c.floor_us,
        ));
    }
    md
}

/// The report header's line on the round rows.
pub const HEADER: &str = "- round: one CUDA graph of a round's draft side: the push of 8 \
     verified feature rows per request into the store's round slab, their batched materialize \
     (one feature projection of B x 8 rows, one context K/V materialize per layer; its two \
     metadata writes captured) and the draft block at frontier T (head; DFlash2 selector at \
     T = 0.7); the materialize writes the store's next positions (T + 8 .. T + 16, the eager \
     warm-up took T .. T + 8), past the block's frontier; cublas_chain: one graph of every \
     weight GEMM of that round by cuBLAS alone over weights of the same shapes (one GEMM per \
     checkpoint weight: fc and the context K/V projections at B x 8 rows, per layer q, k, v, o, \
     gate, up, down at B x (K + 1) rows and DFlash2's two convolution projections at \
     2 x B x (K + 1), the head at B x K with F32 logits, DFlash2's selector W_hidden at B x K); \
     floor: every weight the round reads (the block's plus the materialize's fc, hidden norm \
     and context K/V projections), plus for the round every layer's visible context K/V. The \
     round leaves out the draft's per-round staging (the rows' metadata written to the device) \
     and the verify-input assembly, which an engine round's propose also does \
     (`docs/performance-engine_round.md` times whole rounds); the chain stores the head's \
     F32 logits, [B x K, vocab rows], which the fused head never does\n";

#[cfg(test)]
mod tests {
    use super::*;

    /// The chain multiplies by every matrix the floor counts: the two differ by the norms and
    /// DFlash2's convolution base kernels alone (vectors: well under 1 MiB for both drafts).
    #[test]
    fn cublas_chain_reads_every_floor_matrix() -> Result<()> {
        for d in &DRAFTS {
            let g = crate::official_geometry(d.backend)?;
            let chain: u64 = chain_plan(&g).iter().map(|c| (c.n * c.k * 2) as u64).sum();
            let floor = round_weight_bytes(&g);
            assert!(
                floor >= chain && floor - chain < 1 << 20,
                "{}: floor weights {floor} B, chain weights {chain} B",
                d.name
            );
        }
        Ok(())
    }

    #[test]
    fn round_shapes_cover_the_issue_grid() {
        let all = shapes(None, false);
        assert_eq!(all.len(), 8);
        for t in [2048, 4096] {
            for b in [1, 8] {
                for k in [7, 15] {
                    assert!(all.contains(&(b, k, t)), "missing B={b} K={k} T={t}");
                }
            }
        }
        assert_eq!(shapes(None, true), vec![(1, 15, 2048), (8, 15, 2048)]);
        assert_eq!(shapes(Some((2, 3, 100)), true), vec![(2, 3, 100)]);
    }

    #[test]
    fn b1_round_target_needs_the_fixed_bound_and_the_chain() {
        let row = |op, b, us| Row {
            op,
            draft: DRAFTS[0].name,
            b,
            k: 15,
            context: 2048,
            median_us: us,
            floor_us: 100.0,
        };
        let rows = [
            row(ROUND, 1, 500.0),
            row(CHAIN, 1, 450.0),
            row(ROUND, 8, 800.0),
        ];
        let (text, met) = target(&rows[0], &rows).expect("a B = 1 target");
        assert_eq!(text, "<= 550 us, < cublas_chain 450.0 us");
        assert!(!met);
        let (text, met) = target(&rows[2], &rows).expect("a B = 8 target");
        assert_eq!(text, "<= 900 us");
        assert!(met);
        assert!(target(&row(ROUND, 8, 1.0), &[]).is_some());
        let other_k = Row {
            k: 7,
            ..row(ROUND, 8, 1.0)
        };
        assert!(target(&other_k, &rows).is_none());
    }
}
