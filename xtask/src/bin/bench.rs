//! GPU benchmark of the draft's hot ops, of one whole draft block and of one whole round
//! (materialize + block) on the official geometries (synthetic weights), replayed as CUDA
//! graphs and timed with CUDA events, against the memory floor.
//!
//! `dflash-bench [--out DIR] [--commit HASH] [--quick] [--only SUBSTRING] [--shape B,K,CTX]
//! [--portable] [--gemm-rule M,N,W,WMANY,DEP[,WIDE]] [--l2-prefetch MIB[,MIB...]]`:
//! prints a table and writes `DIR/performance.json` (an array of `{"op", "draft", "B", "K",
//! "context", "median_us", "floor_us"}`) and `DIR/performance.md`. `--portable` restricts the
//! backend to the portable kernel variants (no sm_90a variants of the heads and attention), for
//! comparison. `--gemm-rule` sets the skinny GEMM's rule (`gemm::SkinnyRule`: the most rows,
//! the most weight rows, warps a block on grids of at most two blocks an SM and on larger
//! ones, 1 to launch it as a dependent or 0, and optionally the wide kernel's most rows on
//! sm_90a, 0 for none) instead of the default, to measure another. `--l2-prefetch MIB` sets
//! the backend's L2 prefetch budget (`CudaBackend::set_l2_prefetch_budget`: what the draft
//! block prefetches of each next weight GEMM's weight, in MiB; 0 for none); with several
//! values the round rows are measured once per budget, in the order given (a sweep: the
//! log names each budget; every other row runs at the first).
//! `--shape B,K,CTX` runs that one shape instead of the list (for Nsight Compute on one shape).
//! `--only SUBSTRING` keeps the groups whose name contains it: `attention`, `head`, `gemm`
//! (its own report, below), `block`, `round` (`--only round`: the round rows alone, over B in
//! {1, 8}, K in {7, 15}, context in {2048, 4096}; `--quick`: B in {1, 8} at K = 15, 2048).
//! `dflash-bench --profile dflash|dflash2 [--shape B,K,CTX]`: two eager draft blocks (default
//! B=1, K=7, 2048 context) after a warm-up, for Nsight Compute (`ncu --clock-control none ...`).
//! `dflash-bench --engine-round [--shape B,K,CTX] [--out DIR] [--commit HASH]`: whole engine
//! rounds over a GPU-resident stand-in target against the draft block alone (default shapes
//! B in {1, 8}, K = 15, context 2048; writes `DIR/engine-round.{md,json}`; see
//! `engine_round.rs`).
//!
//! Rows:
//! - `sliding_window_attention`, `softmax_attention`: one call of the op over B requests of
//!   W = K + 1 live columns at context frontier `context` (the draft's head geometry, its
//!   window S for the ring). Each replay reads a different copy of the context (several copies
//!   whose total exceeds the L2 cache), so the time is a DRAM time. Floor: the visible K + V
//!   context bytes (local: min(context, S - 1) positions per request) plus q, the block's K/V
//!   and the output.
//! - `proposal_argmax`, `unary_topk`: the fused head over the full 248320-row Text head for
//!   B * K mask columns; `cublas_head_gemm`: the logits alone by cuBLAS (the unfused path's
//!   GEMM). Floor: the head weight read (rows * H * 2 bytes) plus the hidden columns.
//! - `block`: one draft block (embedding, every layer over a populated context, final norm,
//!   head; DFlash2 with its selector at T = 0.7). Floor: every weight the block reads plus the
//!   visible context K/V of every layer. `block_cublas_gemm`: the same with cuBLAS for every
//!   GEMM.
//! - `round`: one graph of a round's draft side: the push and batched materialize of 8 pending
//!   context rows per request, then the block (head, DFlash2 selector); `cublas_chain`: every
//!   weight GEMM of that round by plain cuBLAS over weights of the same shapes, one graph.
//!   Floor: every weight the round reads (the block's and the materialize's) plus the visible
//!   context K/V. The report adds a table of round / cublas_chain (see `round.rs`).
//!
//! Timing: each graph holds `reps` back-to-back calls (inputs rotating), replayed after a
//! warm-up; the time per call is the median over 7 timed replays (CUDA events).
//! Floor rate: 4.1 TB/s (the practical H200 copy rate of GPU.md).

// First: its macros serve the modules below.
#[macro_use]
#[path = "../stand_in.rs"]
mod stand_in;
#[path = "../engine_round.rs"]
mod engine_round;
#[path = "../report.rs"]
mod report;
#[path = "../round.rs"]
mod round;

use anyhow::{Context, Result, anyhow, bail};
use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use dflash_config::{Backend as DraftBackend, Geometry};
use dflash_context::{Capacity, ContextStore};
use dflash_draft::synthetic;
use dflash_draft::{
    BindOptions, DraftModel, HeadParts, HeadShape, RowRequest, TargetParts, Workspace,
    WorkspaceSpec,
};
use dflash_ops::cuda::{CudaBackend, GemmKernels};
use dflash_ops::proposal_argmax::{self, ProposalHead};
use dflash_ops::sliding_window_attention::{self as swa, LocalAttentionParams};
use dflash_ops::softmax_attention::{self as fa, FullAttentionParams};
use dflash_ops::{Backend, Buffer, Element, bf16, f16, gemm, unary_topk};
use report::{driver_version, utc_now};

const FLOOR_BYTES_PER_S: f64 = 4.1e12;
/// Total bytes of rotating input copies an op benchmark spreads its reads over (> L2).
const ROTATE_BYTES: usize = 256 << 20;
const HEAD_ROWS: usize = 248_320;
const PUBLIC: usize = 248_077;
const PAGE_SIZE: usize = 64;

#[derive(Clone, Debug)]
struct Row {
    op: &'static str,
    draft: &'static str,
    b: usize,
    k: usize,
    context: usize,
    median_us: f64,
    floor_us: f64,
}

/// The op of a round row measured under L2 prefetch budget `bytes` in a `--l2-prefetch`
/// sweep (after the first budget): `round@l2=N MiB`. Leaked: once per budget of a run.
fn sweep_label(bytes: usize) -> &'static str {
    Box::leak(format!("{}@l2={} MiB", round::ROUND, bytes >> 20).into_boxed_str())
}

fn floor_us(bytes: f64) -> f64 {
    bytes / FLOOR_BYTES_PER_S * 1e6
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Capture `reps` calls of `body(i)` (i = 0..reps) into one graph, replay it, and return
/// the median time per call in microseconds (7 timed replays after 3 warm-ups).
fn time_graph(
    cuda: &CudaBackend,
    reps: usize,
    mut body: impl FnMut(usize) -> Result<()>,
) -> Result<f64> {
    // Eager warm-up (module loads, cuBLAS handles and workspaces) before the capture.
    for i in 0..reps.min(2) {
        body(i)?;
    }
    cuda.synchronize()?;
    let stream = cuda.stream().clone();
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .map_err(|e| anyhow!("begin_capture: {e}"))?;
    let mut queued = Ok(());
    for i in 0..reps {
        queued = body(i);
        if queued.is_err() {
            break;
        }
    }
    let graph = stream
        .end_capture(CUgraphInstantiate_flags(0))
        .map_err(|e| anyhow!("end_capture: {e}"))?;
    queued.context("queuing during capture")?;
    let graph = graph.context("capture produced no graph")?;
    for _ in 0..3 {
        graph.launch().map_err(|e| anyhow!("graph launch: {e}"))?;
    }
    cuda.synchronize()?;
    let ctx = cuda.context();
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let mut times = Vec::new();
    for _ in 0..7 {
        let start = ctx.new_event(flags).map_err(|e| anyhow!("event: {e}"))?;
        let end = ctx.new_event(flags).map_err(|e| anyhow!("event: {e}"))?;
        start.record(&stream).map_err(|e| anyhow!("record: {e}"))?;
        graph.launch().map_err(|e| anyhow!("graph launch: {e}"))?;
        end.record(&stream).map_err(|e| anyhow!("record: {e}"))?;
        let ms = start
            .elapsed_ms(&end)
            .map_err(|e| anyhow!("elapsed: {e}"))?;
        times.push(f64::from(ms) * 1e3 / reps as f64);
    }
    Ok(median(times))
}

/// A device buffer of `len` pseudo-random values in [-amp, amp): a 4M-element host pattern
/// tiled by device copies, copy k rotated by k * 1031 elements. 1031 is odd, so for fewer than
/// 1024 copies no row of one copy starts where a row of another does, for any row width that
/// is a multiple of 1024 (an unrotated tiling repeated the head's rows every 2048, and then
/// every tile a top-16 warpgroup saw held copies of its current best logits, work a trained
/// head never causes). The values only need to be realistic, not independent.
fn random_buf<T: Element>(
    be: &Backend,
    len: usize,
    seed: u64,
    conv: impl Fn(f32) -> T,
) -> Result<Buffer<T>> {
    let pat = len.clamp(1, 1 << 22);
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let host: Vec<T> = (0..pat)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            conv(((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0)
        })
        .collect();
    let src = be.upload(&host)?;
    let mut buf = be.zeros::<T>(len)?;
    let (mut off, mut k) = (0, 0usize);
    while off < len {
        let n = pat.min(len - off);
        // Copy k: pattern[rot..] then pattern[..rot], the first n elements of that.
        let rot = k.wrapping_mul(1031) % pat;
        let first = n.min(pat - rot);
        be.copy(&src, rot, &mut buf, off, first)?;
        if n > first {
            be.copy(&src, 0, &mut buf, off + first, n - first)?;
        }
        off += n;
        k += 1;
    }
    Ok(buf)
}

fn bf(x: f32) -> bf16 {
    bf16::from_f32(x)
}

struct Draft {
    name: &'static str,
    backend: DraftBackend,
    hidden: usize,
    window: usize,
    /// MLP intermediate size.
    inter: usize,
}

const DRAFTS: [Draft; 2] = [
    Draft {
        name: "35B-A3B DFlash",
        backend: DraftBackend::DFlash,
        hidden: 2048,
        window: 4096,
        inter: 6144,
    },
    Draft {
        name: "27B DFlash2",
        backend: DraftBackend::DFlash2,
        hidden: 5120,
        window: 2048,
        inter: 17408,
    },
];

const HQ: usize = 32;
const HKV: usize = 8;
const D: usize = 128;

fn attention_io_bytes(b: usize, w: usize) -> f64 {
    (b * w * (HQ * D * 2 * 2 + HKV * D * 2 * 2)) as f64
}

/// How many copies of the context one attention benchmark rotates over so that its reads
/// exceed the L2 cache (`per_set` bytes per copy).
fn rotation_sets(per_set: usize) -> usize {
    (ROTATE_BYTES / per_set.max(1)).clamp(1, 16)
}

/// The block-side tensors of one attention call over B requests of W live columns at
/// frontier `ctx`: q, the block's K and V, start positions, live counts, output, workspace.
struct AttnIo {
    q: Buffer<bf16>,
    kb: Buffer<bf16>,
    vb: Buffer<bf16>,
    sp: Buffer<i32>,
    lv: Buffer<i32>,
    out: Buffer<bf16>,
    ws: Buffer<f32>,
}

fn attn_io(
    be: &Backend,
    b: usize,
    w: usize,
    ctx: usize,
    ws_len: usize,
    seed: u64,
) -> Result<AttnIo> {
    Ok(AttnIo {
        q: random_buf(be, b * w * HQ * D, seed, |x| bf(2.0 * x))?,
        kb: random_buf(be, b * w * HKV * D, seed + 1, |x| bf(2.0 * x))?,
        vb: random_buf(be, b * w * HKV * D, seed + 2, bf)?,
        sp: be.upload(&vec![ctx as i32; b])?,
        lv: be.upload(&vec![w as i32; b])?,
        out: be.zeros::<bf16>(b * w * HQ * D)?,
        ws: be.zeros::<f32>(ws_len)?,
    })
}

fn bench_sliding(cuda: &CudaBackend, d: &Draft, b: usize, k: usize, ctx: usize) -> Result<Row> {
    let be = Backend::Cuda(cuda.clone());
    let w = k + 1;
    let s = d.window;
    let vis = ctx.min(s - 1);
    let per_set = b * vis * HKV * D * 4;
    let sets = rotation_sets(per_set);
    let p = LocalAttentionParams {
        rows: b,
        cols: w,
        q_heads: HQ,
        kv_heads: HKV,
        head_dim: D,
        lanes: b * sets,
        window: s,
    };
    let ring = p.lanes * s * HKV * D;
    let rk = random_buf(&be, ring, 1, bf)?;
    let rv = random_buf(&be, ring, 2, f16::from_f32)?;
    let mut io = attn_io(&be, b, w, ctx, swa::workspace_len(&p), 3)?;
    let lanes: Vec<Buffer<i32>> = (0..sets)
        .map(|st| be.upload(&(0..b).map(|r| (st * b + r) as i32).collect::<Vec<_>>()))
        .collect::<dflash_ops::Result<_>>()?;
    let t = time_graph(cuda, 4 * sets.max(4), |i| {
        let AttnIo {
            q,
            kb,
            vb,
            sp,
            lv,
            out,
            ws,
        } = &mut io;
        swa::run(
            &be,
            q,
            kb,
            vb,
            &rk,
            &rv,
            &lanes[i % sets],
            sp,
            lv,
            out,
            ws,
            &p,
        )
        .map_err(Into::into)
    })?;
    Ok(Row {
        op: swa::OP,
        draft: d.name,
        b,
        k,
        context: ctx,
        median_us: t,
        floor_us: floor_us(per_set as f64 + attention_io_bytes(b, w)),
    })
}

fn bench_full(cuda: &CudaBackend, d: &Draft, b: usize, k: usize, ctx: usize) -> Result<Row> {
    let be = Backend::Cuda(cuda.clone());
    let w = k + 1;
    let per_set = b * ctx * HKV * D * 4;
    let sets = rotation_sets(per_set);
    let ppr = ctx.div_ceil(PAGE_SIZE);
    let p = FullAttentionParams {
        rows: b,
        cols: w,
        q_heads: HQ,
        kv_heads: HKV,
        head_dim: D,
        pages: b * sets * ppr,
        page_size: PAGE_SIZE,
        max_pages: ppr,
    };
    let slots = p.pages * PAGE_SIZE * HKV * D;
    let pk = random_buf(&be, slots, 11, bf)?;
    let pv = random_buf(&be, slots, 12, f16::from_f32)?;
    let mut io = attn_io(&be, b, w, ctx, fa::workspace_len(&p), 13)?;
    let tables: Vec<Buffer<i32>> = (0..sets)
        .map(|st| {
            // Page j of request r in set st is page (j * b + r) * sets + st: the requests'
            // and the sets' pages interleave (a scattered table).
            let t: Vec<i32> = (0..b)
                .flat_map(|r| (0..ppr).map(move |j| ((j * b + r) * sets + st) as i32))
                .collect();
            be.upload(&t)
        })
        .collect::<dflash_ops::Result<_>>()?;
    let t = time_graph(cuda, 4 * sets.max(4), |i| {
        let AttnIo {
            q,
            kb,
            vb,
            sp,
            lv,
            out,
            ws,
        } = &mut io;
        fa::run(
            &be,
            q,
            kb,
            vb,
            &pk,
            &pv,
            &tables[i % sets],
            sp,
            lv,
            out,
            ws,
            &p,
        )
        .map_err(Into::into)
    })?;
    Ok(Row {
        op: fa::OP,
        draft: d.name,
        b,
        k,
        context: ctx,
        median_us: t,
        floor_us: floor_us(per_set as f64 + attention_io_bytes(b, w)),
    })
}

/// The two fused heads and the cuBLAS logits GEMM over the full Text head.
fn bench_heads(cuda: &CudaBackend, d: &Draft, b: usize, k: usize) -> Result<Vec<Row>> {
    let be = Backend::Cuda(cuda.clone());
    let (n, h) = (b * k, d.hidden);
    let head = random_buf(&be, HEAD_ROWS * h, 21, |x| bf(0.05 * x))?;
    let hidden = random_buf(&be, n * h, 22, |x| bf(2.0 * x))?;
    let p = proposal_argmax::Params {
        n,
        rows: HEAD_ROWS,
        hidden: h,
        public_vocab: PUBLIC,
        head: ProposalHead::Full,
    };
    let floor = floor_us((HEAD_ROWS * h * 2 + n * h * 2) as f64);
    let mut rows = Vec::new();
    let row = |op, t| Row {
        op,
        draft: d.name,
        b,
        k,
        context: 0,
        median_us: t,
        floor_us: floor,
    };
    {
        let mut ids = be.zeros::<i32>(n)?;
        let mut ws = be.zeros::<f32>(proposal_argmax::workspace_len(&p))?;
        let t = time_graph(cuda, 4, |_| {
            proposal_argmax::run(&be, &hidden, &head, None, &mut ids, &mut ws, &p)
                .map_err(Into::into)
        })?;
        rows.push(row(proposal_argmax::OP, t));
    }
    {
        let mut s = be.zeros::<f32>(n * 16)?;
        let mut ids = be.zeros::<i32>(n * 16)?;
        let mut ws = be.zeros::<f32>(unary_topk::workspace_len(&p))?;
        let t = time_graph(cuda, 4, |_| {
            unary_topk::run(&be, &hidden, &head, None, &mut s, &mut ids, &mut ws, &p)
                .map_err(Into::into)
        })?;
        rows.push(row(unary_topk::OP, t));
    }
    {
        let mut logits = be.zeros::<f32>(n * HEAD_ROWS)?;
        let gp = gemm::GemmParams {
            m: n,
            n: HEAD_ROWS,
            k: h,
        };
        let t = time_graph(cuda, 4, |_| {
            gemm::run_f32(&be, &hidden, &head, &mut logits, &gp).map_err(Into::into)
        })?;
        rows.push(row("cublas_head_gemm", t));
    }
    Ok(rows)
}

/// One row of the GEMM report: a draft weight shape `[n, k]` at `m` rows of A.
#[derive(Clone, Debug)]
struct GemmRow {
    op: &'static str,
    draft: &'static str,
    weight: &'static str,
    m: usize,
    n: usize,
    k: usize,
    median_us: f64,
    floor_us: f64,
}

/// Bytes an `m x n x k` BF16 product must move: the weight, A and C.
fn gemm_bytes(m: usize, n: usize, k: usize) -> f64 {
    ((n * k + m * (k + n)) * 2) as f64
}

impl GemmRow {
    /// Effective rate: [`gemm_bytes`] over the time.
    fn tb_s(&self) -> f64 {
        gemm_bytes(self.m, self.n, self.k) / self.median_us * 1e-6
    }
}

/// The rows of A the GEMM report times: B x (K + 1) at (B, K) = (1, 7), (1, 15), (2, 15),
/// (4, 15), (8, 15).
const GEMM_ROWS: [usize; 5] = [8, 16, 32, 64, 128];

/// Every distinct layer weight shape of draft `d` (`[n, k]`, the checkpoint's layout) at each
/// of [`GEMM_ROWS`]: `gemm` (the backend's choice, see `gemm::plan`) and
/// `cublas_gemm` (cuBLAS alone) in the same run. Each graph rotates over copies of the weight
/// whose total exceeds the L2 cache. Floor: weight + A + C bytes / 4.1 TB/s.
fn bench_gemm(cuda: &CudaBackend, d: &Draft) -> Result<Vec<GemmRow>> {
    let be = Backend::Cuda(cuda.clone());
    let (h, inter) = (d.hidden, d.inter);
    // (weight, n, k, output): the checkpoint's weights (the context K/V role still multiplies
    // k_proj / v_proj alone) and the block's fused ones (Q/K/V with F32 output, the raw Q and
    // K being normalized unrounded; gate/up with the SwiGLU applied, `gemm::run_swiglu`, whose
    // cuBLAS side is the product and the `swiglu` kernel).
    #[derive(Clone, Copy, PartialEq)]
    enum Out {
        Bf16,
        F32,
        Swiglu,
    }
    let shapes: [(&'static str, usize, usize, Out); 8] = [
        ("q_proj", HQ * D, h, Out::Bf16),
        ("k_proj / v_proj", HKV * D, h, Out::Bf16),
        ("qkv_proj (fused, F32 out)", (HQ + 2 * HKV) * D, h, Out::F32),
        ("o_proj", h, HQ * D, Out::Bf16),
        ("gate_proj / up_proj", inter, h, Out::Bf16),
        ("gate_up_proj (fused)", 2 * inter, h, Out::Bf16),
        ("gate_up_proj + SwiGLU", 2 * inter, h, Out::Swiglu),
        ("down_proj", h, inter, Out::Bf16),
    ];
    let mut rows = Vec::new();
    for (si, &(weight, n, k, kind)) in shapes.iter().enumerate() {
        let bytes = n * k * 2;
        let copies = (ROTATE_BYTES / bytes).clamp(1, 16);
        let ws: Vec<Buffer<bf16>> = (0..copies)
            .map(|c| random_buf(&be, n * k, 31 + (si * 16 + c) as u64, |x| bf(0.02 * x)))
            .collect::<Result<_>>()?;
        for &m in &GEMM_ROWS {
            let a = random_buf(&be, m * k, 7, |x| bf(2.0 * x))?;
            let mut out = be.zeros::<bf16>(if kind == Out::F32 { 0 } else { m * n })?;
            let mut out_f32 = be.zeros::<f32>(if kind == Out::F32 { m * n } else { 0 })?;
            let mut act = be.zeros::<bf16>(if kind == Out::Swiglu { m * n / 2 } else { 0 })?;
            let gp = gemm::GemmParams { m, n, k };
            let floor = floor_us(gemm_bytes(m, n, k));
            for (op, kernels) in [
                ("gemm", GemmKernels::Auto),
                ("cublas_gemm", GemmKernels::Cublas),
            ] {
                cuda.set_gemm_kernels(kernels);
                let reps = copies.max(4);
                let t = time_graph(cuda, reps, |i| {
                    let w = &ws[i % copies];
                    match kind {
                        Out::F32 => gemm::run_f32(&be, &a, w, &mut out_f32, &gp),
                        Out::Bf16 => gemm::run_bf16(&be, &a, w, &mut out, &gp),
                        Out::Swiglu => gemm::run_swiglu(&be, &a, w, &mut out, &mut act, &gp),
                    }
                    .map_err(Into::into)
                });
                cuda.set_gemm_kernels(GemmKernels::Auto);
                rows.push(GemmRow {
                    op,
                    draft: d.name,
                    weight,
                    m,
                    n,
                    k,
                    median_us: t?,
                    floor_us: floor,
                });
            }
        }
    }
    Ok(rows)
}

/// The GEMM report: `gemm` and `cublas_gemm` side by side per draft, weight and rows.
fn gemm_report(rows: &[GemmRow], head: &str) -> (String, Vec<serde_json::Value>) {
    let mut md = format!(
        "{head}\n| draft | weight [n, k] | m | gemm us | TB/s | cublas_gemm us | TB/s | floor us | \
         gemm x floor |\n|---|---|---|---|---|---|---|---|---|\n"
    );
    for pair in rows.chunks(2) {
        if let [own, blas] = pair {
            md.push_str(&format!(
                "| {} | {} [{}, {}] | {} | {:.1} | {:.2} | {:.1} | {:.2} | {:.1} | {:.2} |\n",
                own.draft,
                own.weight,
                own.n,
                own.k,
                own.m,
                own.median_us,
                own.tb_s(),
                blas.median_us,
                blas.tb_s(),
                own.floor_us,
                own.median_us / own.floor_us
            ));
        }
    }
    let json = rows
        .iter()
        .map(|r| {
            serde_json::json!({
                "op": r.op, "draft": r.draft, "weight": r.weight, "m": r.m, "n": r.n, "k": r.k,
                "median_us": (r.median_us * 10.0).round() / 10.0,
                "floor_us": (r.floor_us * 10.0).round() / 10.0,
                "tb_s": (r.tb_s() * 100.0).round() / 100.0,
            })
        })
        .collect();
    (md, json)
}

/// Bytes every block reads: the layer weights, the final norm, the output head [V, H] and
/// DFlash2's W_hidden.
fn weight_bytes(g: &Geometry) -> u64 {
    let (h, hq, hkv, d, i) = (
        u64::from(g.hidden),
        u64::from(g.q_heads),
        u64::from(g.kv_heads),
        u64::from(g.head_dim),
        u64::from(g.intermediate),
    );
    let mut per_layer = h * hq * d * 2 + 2 * h * hkv * d + 3 * h * i + 2 * h + 2 * d;
    if g.dflash2.is_some() {
        let groups = h / 16;
        per_layer += 2 * (4 * groups * h + 4 * h);
    }
    let mut elems = per_layer * g.layers.len() as u64 + h + u64::from(g.vocab_rows) * h;
    if let Some(p) = &g.dflash2 {
        elems += u64::from(p.selector_rank) * h;
    }
    elems * 2
}

/// Bytes of the context K (BF16) and V (F16) that every layer's attention reads for `rows`
/// requests at frontier `context`: a local layer sees min(context, S - 1) positions, a full
/// layer all of them.
fn kv_bytes(g: &Geometry, rows: usize, context: usize) -> u64 {
    let per_pos = u64::from(g.kv_heads) * u64::from(g.head_dim) * 4;
    let visible = |lt: &dflash_config::LayerKind| match lt {
        dflash_config::LayerKind::Local { window } => {
            context.min((*window as usize).saturating_sub(1))
        }
        dflash_config::LayerKind::Full => context,
    };
    g.layers
        .iter()
        .map(|lt| rows as u64 * visible(lt) as u64 * per_pos)
        .sum()
}

/// One official draft on the device with its synthetic target parts.
struct Setup {
    g: Geometry,
    model: DraftModel,
    embedding: Buffer<bf16>,
    head: Buffer<bf16>,
}

/// Weight values for timing: the synthetic values of small tensors (norms, base kernels), a
/// tiled 64K-element pattern of the same scale for the large matrices (values do not change
/// the timing; generating gigabytes of independent values would dominate the run).
fn fast_values(s: &dflash_draft::weights::TensorSpec) -> Vec<bf16> {
    let n: usize = s.shape.iter().product();
    if n <= 1 << 20 {
        return synthetic::tensor_values(s, 1);
    }
    let fan_in = *s.shape.last().unwrap_or(&1) as f32;
    let scale = 1.732_050_8 / fan_in.sqrt();
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let pat: Vec<bf16> = (0..1 << 16)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            bf((((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0) * scale)
        })
        .collect();
    pat.iter().copied().cycle().take(n).collect()
}

/// The geometry of the official draft of `backend` with its target (no device needed).
fn official_geometry(backend: DraftBackend) -> Result<Geometry> {
    let (cfg, target) = synthetic::official_pair(backend)?;
    let d = dflash_config::DraftConfig::from_json_str(&cfg, dflash_config::ParseMode::Lenient)?;
    Ok(dflash_config::validate_pair(&d.value, &target)?)
}

fn setup(be: &Backend, backend: DraftBackend) -> Result<Setup> {
    let g = official_geometry(backend)?;
    let weights = dflash_draft::DraftWeights::from_source(be, &g, &BindOptions::default(), |s| {
        Ok(fast_values(s))
    })?;
    let model = DraftModel::from_parts(be, g.clone(), weights);
    let (v, h) = (g.vocab_rows as usize, g.hidden as usize);
    let embedding = random_buf(be, v * h, 31, bf)?;
    let head = random_buf(be, v * h, 32, |x| bf(0.05 * x))?;
    Ok(Setup {
        g,
        model,
        embedding,
        head,
    })
}

/// A populated context store at frontier `context` and a workspace staged there, for one block
/// shape. `round: Some(n)`: the store also has round staging for `n` pushed rows per request
/// ([`ContextStore::with_round_staging`]) and room for two such rounds past the block (the
/// round benchmark's warm-up and captured materialize).
fn block_state(
    be: &Backend,
    s: &Setup,
    rows: usize,
    k: usize,
    context: usize,
    round: Option<usize>,
) -> Result<(ContextStore, Workspace, Vec<RowRequest>)> {
    let g = &s.g;
    let model = &s.model;
    let max_ctx = context + k + 1 + 2 * round.unwrap_or(0);
    let (geometry, capacity) = (
        model.context_geometry()?,
        Capacity::new(rows, max_ctx, PAGE_SIZE),
    );
    let mut store = match round {
        None => ContextStore::new(be.clone(), geometry, capacity)?,
        Some(n) => ContextStore::with_round_staging(be.clone(), geometry, capacity, n)
            .with_context(|| format!("round staging for {n} rows per request"))?,
    };
    // Prefill in chunks from one device feature block (copied per chunk: prefill takes the
    // features by value).
    let chunk = context.min(4096);
    let width = g.feature_width as usize;
    let template = random_buf(be, chunk * width, 41, bf)?;
    let mut reqs = Vec::new();
    for r in 0..rows {
        let handle = store.admit(max_ctx)?;
        let mut done = 0;
        while done < context {
            let n = chunk.min(context - done);
            let mut f = be.zeros::<bf16>(n * width)?;
            be.copy(&template, 0, &mut f, 0, n * width)?;
            model.prefill(&mut store, handle, f)?;
            done += n;
        }
        reqs.push(RowRequest {
            handle,
            anchor: (1000 + r) as u32,
            usable: k,
            temperature: if g.dflash2.is_some() { 0.7 } else { 0.0 },
            seed: 5 + r as u64,
        });
    }
    let spec = WorkspaceSpec {
        rows,
        draft_count: k,
        mask_token_id: g.mask_token_id.unwrap_or(0),
        head: HeadShape {
            kind: ProposalHead::Full,
            rows: g.vocab_rows as usize,
            public_vocab: g.public_vocab_size.unwrap_or(g.vocab_rows) as usize,
        },
    };
    let mut ws = Workspace::new(model, &store, &spec)?;
    model.stage(&store, &reqs, &mut ws)?;
    Ok((store, ws, reqs))
}

fn target_parts(s: &Setup) -> TargetParts<'_> {
    TargetParts {
        vocab_rows: s.g.vocab_rows as usize,
        public_vocab: s.g.public_vocab_size.unwrap_or(s.g.vocab_rows) as usize,
        embedding: &s.embedding,
        head: HeadParts::Full {
            output_head: &s.head,
        },
    }
}

/// One draft block over `rows` requests of K mask columns at frontier `context`, replayed as
/// a graph: the `block` row, and with `with_cublas` also `block_cublas_gemm` (the same block
/// with cuBLAS for every GEMM, `GemmKernels::Cublas`).
fn bench_block(
    cuda: &CudaBackend,
    s: &Setup,
    d: &Draft,
    rows: usize,
    k: usize,
    context: usize,
    with_cublas: bool,
) -> Result<Vec<Row>> {
    let be = Backend::Cuda(cuda.clone());
    let (store, mut ws, _reqs) = block_state(&be, s, rows, k, context, None)?;
    let tp = target_parts(s);
    let t = time_graph(cuda, 1, |_| {
        s.model.run_block(&store, &tp, &mut ws).map_err(Into::into)
    })?;
    let t_blas = if with_cublas {
        cuda.set_gemm_kernels(GemmKernels::Cublas);
        let t = time_graph(cuda, 1, |_| {
            s.model.run_block(&store, &tp, &mut ws).map_err(Into::into)
        });
        cuda.set_gemm_kernels(GemmKernels::Auto);
        Some(t?)
    } else {
        None
    };
    let g = &s.g;
    let row = |op, median_us| Row {
        op,
        draft: d.name,
        b: rows,
        k,
        context,
        median_us,
        floor_us: floor_us((weight_bytes(g) + kv_bytes(g, rows, context)) as f64),
    };
    let mut out = vec![row("block", t)];
    out.extend(t_blas.map(|t| row("block_cublas_gemm", t)));
    Ok(out)
}

fn profile(cuda: &CudaBackend, which: &str, shape: Option<(usize, usize, usize)>) -> Result<()> {
    let be = Backend::Cuda(cuda.clone());
    let backend = match which {
        "dflash" => DraftBackend::DFlash,
        "dflash2" => DraftBackend::DFlash2,
        other => bail!("--profile takes dflash or dflash2, not `{other}`"),
    };
    let s = setup(&be, backend)?;
    let (b, k, ctx) = shape.unwrap_or((1, 7, 2048));
    let (store, mut ws, _reqs) = block_state(&be, &s, b, k, ctx, None)?;
    let tp = target_parts(&s);
    for _ in 0..2 {
        s.model.run_block(&store, &tp, &mut ws)?;
    }
    cuda.synchronize()?;
    eprintln!("profiled 2 blocks of {which} (B={b}, K={k}, context {ctx})");
    Ok(())
}

/// `--engine-round`: per draft and shape, the draft block's graph replay and the engine's
/// whole round over the stand-in target.
fn engine_rounds(
    cuda: &CudaBackend,
    shape: Option<(usize, usize, usize)>,
    out: Option<&str>,
    commit: &str,
    command: &str,
) -> Result<()> {
    let be = Backend::Cuda(cuda.clone());
    let shapes = shape.map_or_else(|| vec![(1, 15, 2048), (8, 15, 2048)], |s| vec![s]);
    let info = cuda.device_info()?;
    let mut md = format!(
        "# Engine rounds over a GPU-resident stand-in target\n\n\
         - date: {}\n- GPU: {} ({}), driver {}, CUDA (driver API) {}\n- commit: {commit}\n\
         - command: `{command}`\n\
         - round: median `Engine::step` wall time of 30 rounds of B live rows after 3 warm-up \
         rounds (graph profiles; the stand-in target lends fixed device logits and features, \
         its verify is bookkeeping); block: the draft block alone, CUDA-graph replay (CUDA \
         events); rest = round - block: the batched materialize, the verification ops, the \
         round's one read and the engine's host work; the parts alone (each queued, then \
         waited for; median of 20): propose = stage + block graph + verify-input assembly, \
         materialize = the batched materialize of one verified row per request, verify = the \
         verification ops and the round's read (greedy, as the rounds; sampled: every row at \
         T = 0.8, top-p 0.95); host = round - (propose + materialize + verify): the engine's \
         own work; replayed: the draft block / the verification ops replayed a graph in every \
         timed round\n\n\
         | draft | B | K | context | block us | round us | rest us | rest / round | \
         propose us | materialize us | verify us | verify sampled us | host us | host / round | \
         allocations / round | synchronizations / round | every round replayed |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        utc_now(),
        info.name,
        info.arch,
        driver_version(),
        info.driver_cuda_version,
    );
    let mut json = Vec::new();
    for d in &DRAFTS {
        for &(b, k, ctx) in &shapes {
            let s = setup(&be, d.backend)?;
            let block = bench_block(cuda, &s, d, b, k, ctx, false)?.remove(0);
            let Setup {
                g,
                model,
                embedding,
                head,
            } = s;
            let f32s = |n: usize, seed: u64| random_buf(&be, n, seed, |x| 4.0 * x);
            let bf16s = |n: usize, seed: u64| random_buf(&be, n, seed, bf);
            let r = engine_round::time_rounds(
                &be,
                &g,
                model,
                embedding,
                head,
                &engine_round::RoundSpec {
                    backend: d.backend,
                    rows: b,
                    k,
                    context: ctx,
                    eager: false,
                },
                &f32s,
                &bf16s,
            )?;
            let rest = r.median_us - block.median_us;
            let host = r.median_us - (r.propose_us + r.materialize_us + r.verify_us);
            let line = format!(
                "| {} | {b} | {k} | {ctx} | {:.1} | {:.1} | {:.1} | {:.2} | {:.1} | {:.1} | \
                 {:.1} | {:.1} | {:.1} | {:.2} | {:.2} | {:.2} | {} / {} |\n",
                d.name,
                block.median_us,
                r.median_us,
                rest,
                rest / r.median_us,
                r.propose_us,
                r.materialize_us,
                r.verify_us,
                r.verify_sampled_us,
                host,
                host / r.median_us,
                r.allocations_per_round,
                r.syncs_per_round,
                if r.replayed { "yes" } else { "NO" },
                if r.verify_replayed { "yes" } else { "NO" }
            );
            eprint!("{line}");
            md.push_str(&line);
            json.push(serde_json::json!({
                "draft": d.name, "B": b, "K": k, "context": ctx,
                "block_us": (block.median_us * 10.0).round() / 10.0,
                "round_us": (r.median_us * 10.0).round() / 10.0,
                "rest_us": (rest * 10.0).round() / 10.0,
                "propose_us": (r.propose_us * 10.0).round() / 10.0,
                "materialize_us": (r.materialize_us * 10.0).round() / 10.0,
                "verify_us": (r.verify_us * 10.0).round() / 10.0,
                "verify_sampled_us": (r.verify_sampled_us * 10.0).round() / 10.0,
                "host_us": (host * 10.0).round() / 10.0,
                "allocations_per_round": r.allocations_per_round,
                "synchronizations_per_round": r.syncs_per_round,
                "rounds": r.rounds, "replayed": r.replayed,
                "verify_replayed": r.verify_replayed,
            }));
        }
    }
    println!("{md}");
    if let Some(dir) = out {
        write_report(dir, "engine-round", &md, &json)?;
    }
    Ok(())
}

/// Write `DIR/STEM.md` and `DIR/STEM.json` (pretty-printed), creating `dir`.
fn write_report(dir: &str, stem: &str, md: &str, json: &[serde_json::Value]) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {dir}"))?;
    std::fs::write(format!("{dir}/{stem}.md"), md)?;
    std::fs::write(
        format!("{dir}/{stem}.json"),
        serde_json::to_string_pretty(json)?,
    )?;
    Ok(())
}

/// The target for a row (description, met?), or None.
fn target(r: &Row, rows: &[Row]) -> Option<(String, bool)> {
    match r.op {
        "sliding_window_attention" | "softmax_attention" => {
            let bound = 2.0 * r.floor_us + 6.0;
            Some((
                format!("<= 2 x floor + 6 = {bound:.1} us"),
                r.median_us <= bound,
            ))
        }
        "proposal_argmax" | "unary_topk" => {
            let head = HEAD_ROWS as f64
                * if r.draft.starts_with("35B") {
                    2048.0
                } else {
                    5120.0
                }
                * 2.0;
            let bound = 1.10 * floor_us(head);
            Some((
                format!("<= 1.10 x head read = {bound:.1} us"),
                r.median_us <= bound,
            ))
        }
        "block" => {
            let fixed = match (r.draft.starts_with("35B"), r.b, r.k, r.context) {
                (true, 1, 7, 2048) => Some(900.0),
                (false, 1, 7, 2048) => Some(2300.0),
                (true, 1, 7, 131_072) => Some(1300.0),
                _ => None,
            };
            if let Some(b) = fixed {
                return Some((format!("<= {b:.0} us"), r.median_us <= b));
            }
            // B = 8 scales with the extra KV bytes: the time over B = 1 at the same K and
            // context, against the floor difference.
            let base = rows.iter().find(|x| {
                x.op == "block"
                    && x.draft == r.draft
                    && x.b == 1
                    && x.k == r.k
                    && x.context == r.context
            })?;
            if r.b == 1 {
                return None;
            }
            let extra = r.median_us - base.median_us;
            let extra_floor = r.floor_us - base.floor_us;
            Some((
                format!(
                    "B={} - B=1: {extra:.0} us for {extra_floor:.0} us of extra KV floor ({:.1}x)",
                    r.b,
                    extra / extra_floor.max(1e-9)
                ),
                extra <= 2.0 * extra_floor + 50.0,
            ))
        }
        round::ROUND => round::target(r, rows),
        _ => None,
    }
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let value = |flag: &str| -> Result<Option<String>> {
        match args.iter().position(|a| a == flag) {
            None => Ok(None),
            Some(i) => args
                .get(i + 1)
                .cloned()
                .map(Some)
                .ok_or_else(|| anyhow!("{flag} needs a value")),
        }
    };
    // `--portable`: only the portable kernel variants (no sm_90a variants).
    let options = dflash_ops::cuda::CudaOptions {
        kernels: if args.iter().any(|a| a == "--portable") {
            dflash_ops::cuda::KernelVariants::Portable
        } else {
            dflash_ops::cuda::KernelVariants::Auto
        },
        ..Default::default()
    };
    let cuda = CudaBackend::with_options(0, options).context("opening CUDA device 0")?;
    // `--gemm-rule M,N,W,WMANY,DEP[,WIDE]`: the own GEMMs' rule instead of the default
    // (WIDE, the wide kernel's most rows, defaults to the default rule's).
    if let Some(v) = value("--gemm-rule")? {
        let n: Vec<usize> = v
            .split(',')
            .map(|x| x.trim().parse::<usize>())
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| {
                anyhow!("--gemm-rule {v}: expected M,N,W,WMANY,DEP[,WIDE] as integers ({e})")
            })?;
        let (max_m, max_n, warps, warps_many, dep, wide) = match n[..] {
            [m, n, w, wm, d @ (0 | 1)] => (m, n, w, wm, d, gemm::SkinnyRule::default().wide_max_m),
            [m, n, w, wm, d @ (0 | 1), x] => (m, n, w, wm, d, x),
            _ => bail!(
                "--gemm-rule {v}: expected five or six integers M,N,W,WMANY,DEP[,WIDE] (DEP 0 or 1)"
            ),
        };
        cuda.set_gemm_rule(gemm::SkinnyRule {
            max_m,
            max_n,
            warps,
            warps_many,
            dependent: dep == 1,
            wide_max_m: wide,
        });
    }
    // `--l2-prefetch MIB[,MIB...]`: the draft block's L2 prefetch budget(s) instead of the
    // default (bytes).
    let budgets: Vec<usize> = match value("--l2-prefetch")? {
        None => vec![cuda.l2_prefetch_budget()],
        Some(v) => v
            .split(',')
            .map(|x| {
                x.trim()
                    .parse::<usize>()
                    .ok()
                    .and_then(|mib| mib.checked_mul(1 << 20))
                    .ok_or_else(|| anyhow!("--l2-prefetch {v}: expected MiB as integers"))
            })
            .collect::<Result<_>>()?,
    };
    cuda.set_l2_prefetch_budget(budgets[0]);
    // The op of each budget's round rows: the first budget's is the report's `round` (the
    // header names that budget), each further one's `round@l2=N MiB`.
    let round_ops: Vec<&'static str> = budgets
        .iter()
        .enumerate()
        .map(|(i, &b)| if i == 0 { round::ROUND } else { sweep_label(b) })
        .collect();
    let out = value("--out")?;
    let commit = value("--commit")?.unwrap_or_else(|| "unknown".into());
    let only = value("--only")?;
    let quick = args.iter().any(|a| a == "--quick");
    let info = cuda.device_info()?;
    let be = Backend::Cuda(cuda.clone());
    let shape = match value("--shape")? {
        None => None,
        Some(v) => {
            let n: Vec<usize> = v
                .split(',')
                .map(|x| x.trim().parse::<usize>())
                .collect::<std::result::Result<_, _>>()
                .map_err(|e| anyhow!("--shape {v}: expected B,K,CTX as integers ({e})"))?;
            match n[..] {
                [b, k, c] if (1..=8).contains(&b) && (1..=15).contains(&k) && c >= 1 => {
                    Some((b, k, c))
                }
                _ => bail!("--shape {v}: expected B,K,CTX with B in 1..=8, K in 1..=15, CTX >= 1"),
            }
        }
    };
    if let Some(which) = value("--profile")? {
        return profile(&cuda, &which, shape);
    }
    if args.iter().any(|a| a == "--engine-round") {
        return engine_rounds(&cuda, shape, out.as_deref(), &commit, &args.join(" "));
    }
    let listed: &[(usize, usize, usize)] = if quick {
        &[(1, 7, 2048), (8, 15, 4096)]
    } else {
        &[(1, 7, 2048), (1, 15, 4096), (8, 15, 4096)]
    };
    let shapes: Vec<(usize, usize, usize)> = shape.map_or_else(|| listed.to_vec(), |s| vec![s]);
    let wanted = |name: &str| only.as_deref().is_none_or(|o| name.contains(o));
    let mut rows: Vec<Row> = Vec::new();
    let t0 = std::time::Instant::now();
    let log = |r: Row, rows: &mut Vec<Row>| {
        eprintln!(
            "[{:6.1} s] {:>24} {:>15} B={} K={:>2} ctx={:>6}: {:>9.1} us (floor {:>8.1} us, {:.2}x)",
            t0.elapsed().as_secs_f64(),
            r.op,
            r.draft,
            r.b,
            r.k,
            r.context,
            r.median_us,
            r.floor_us,
            r.median_us / r.floor_us
        );
        rows.push(r);
    };
    for d in &DRAFTS {
        for &(b, k, ctx) in &shapes {
            if wanted("attention") {
                log(bench_sliding(&cuda, d, b, k, ctx)?, &mut rows);
                log(bench_full(&cuda, d, b, k, ctx)?, &mut rows);
            }
            if wanted("head") {
                for r in bench_heads(&cuda, d, b, k)? {
                    log(r, &mut rows);
                }
            }
        }
    }
    if wanted("gemm") {
        let mut grows = Vec::new();
        for d in &DRAFTS {
            for r in bench_gemm(&cuda, d)? {
                eprintln!(
                    "[{:6.1} s] {:>12} {:>15} {:>20} m={:>3}: {:>8.1} us ({:.2} TB/s, floor {:.1} us)",
                    t0.elapsed().as_secs_f64(),
                    r.op,
                    r.draft,
                    r.weight,
                    r.m,
                    r.median_us,
                    r.tb_s(),
                    r.floor_us
                );
                grows.push(r);
            }
        }
        let head = format!(
            "# Performance report: the draft's layer GEMMs\n\n- date: {}\n- GPU: {} ({}), driver {}\n\
             - commit: {commit}\n- command: `{}`\n- time: CUDA events around CUDA-graph replays \
             (each graph rotates over copies of the weight larger than the L2 cache), median of 7\n\
             - `gemm`: the backend's choice (the skinny kernel of kernels/gemm.cu where \
             gemm::plan takes the product under the backend's rule, {rule:?}, then on sm_90a its \
             wide kernel up to the rule's wide_max_m rows (sm_90a variants: {}); cuBLAS \
             elsewhere); \
             `cublas_gemm`: cuBLAS alone; TB/s: weight + A + C bytes / time; \
             floor: those bytes / 4.1 TB/s\n",
            utc_now(),
            info.name,
            info.arch,
            driver_version(),
            args.join(" "),
            cuda.uses_sm90a(),
            rule = cuda.gemm_rule(),
        );
        let (md, json) = gemm_report(&grows, &head);
        if let Some(dir) = &out {
            write_report(dir, "gemm", &md, &json)?;
        }
        println!("{md}");
    }
    if wanted("attention") && shape.is_none() {
        log(bench_full(&cuda, &DRAFTS[0], 1, 7, 131_072)?, &mut rows);
    }
    if wanted("block") || wanted(round::ROUND) {
        for d in &DRAFTS {
            let s = setup(&be, d.backend)?;
            if wanted("block") {
                for &(b, k, ctx) in &shapes {
                    for r in bench_block(&cuda, &s, d, b, k, ctx, true)? {
                        log(r, &mut rows);
                    }
                }
                if d.backend == DraftBackend::DFlash && shape.is_none() {
                    for r in bench_block(&cuda, &s, d, 1, 7, 131_072, true)? {
                        log(r, &mut rows);
                    }
                }
            }
            if wanted(round::ROUND) {
                let chain = round::Chain::new(&be, &s.g)
                    .with_context(|| format!("cuBLAS chain weights of {}", d.name))?;
                for (b, k, ctx) in round::shapes(shape, quick) {
                    for (i, (&budget, &op)) in budgets.iter().zip(&round_ops).enumerate() {
                        cuda.set_l2_prefetch_budget(budget);
                        if budgets.len() > 1 {
                            eprintln!("[l2 prefetch budget {} MiB]", budget >> 20);
                        }
                        // The chain has no prefetch: timed once a shape, with the first budget.
                        let chain = (i == 0).then_some(&chain);
                        for r in round::bench_round(&cuda, &s, (op, chain), d, b, k, ctx)? {
                            log(r, &mut rows);
                        }
                    }
                    cuda.set_l2_prefetch_budget(budgets[0]);
                }
            }
        }
    }
    let command = args.join(" ");
    let mut md = format!(
        "# Performance report: draft attention, proposal heads, the whole block and the round\n\n\
         - date: {}\n- GPU: {} ({}), driver {}, CUDA (driver API) {}\n- commit: {commit}\n\
         - command: `{command}`\n\
         - GEMMs: {:?}; L2 prefetch budget {} MiB a weight (`l2_prefetch`)\n\
         - time: CUDA events around CUDA-graph replays (each graph holds several back-to-back \
         calls; attention inputs rotate over copies of the context larger than the L2 cache); \
         median of 7 replays\n- floor: bytes the op must move / 4.1 TB/s (attention: the visible \
         context K + V plus q, block K/V and output; heads: the head weight read; block: every \
         weight read plus every layer's visible context K/V)\n{}\n\
         | op | draft | B | K | context | median us | floor us | x floor | target | met |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
        utc_now(),
        info.name,
        info.arch,
        driver_version(),
        info.driver_cuda_version,
        cuda.gemm_rule(),
        cuda.l2_prefetch_budget() as f64 / f64::from(1 << 20),
        if rows.iter().any(|r| r.op == round::ROUND) {
            round::HEADER
        } else {
            ""
        },
    );
    for r in &rows {
        let (t, ok) = target(r, &rows).unwrap_or_else(|| ("-".into(), true));
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {:.1} | {:.1} | {:.2} | {} | {} |\n",
            r.op,
            r.draft,
            r.b,
            r.k,
            r.context,
            r.median_us,
            r.floor_us,
            r.median_us / r.floor_us,
            t,
            if t == "-" {
                ""
            } else if ok {
                "yes"
            } else {
                "NO"
            }
        ));
    }
    md.push_str(&round::ratio_table(&rows));
    let json: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            serde_json::json!({
                "op": r.op, "draft": r.draft, "B": r.b, "K": r.k, "context": r.context,
                "median_us": (r.median_us * 10.0).round() / 10.0,
                "floor_us": (r.floor_us * 10.0).round() / 10.0,
            })
        })
        .collect();
    if let Some(dir) = out {
        write_report(&dir, "performance", &md, &json)?;
    }
    println!("{md}");
    Ok(())
}
