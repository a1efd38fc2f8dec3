//! GPU benchmark of one draft block (the per-round forward: embedding of [anchor, MASK x K],
//! every draft layer over a populated context, final norm, proposal head / DFlash2 selector)
//! on the official geometries with synthetic weights, eager and replayed as one CUDA graph,
//! against the weight-streaming floor.
//!
//! `dflash-bench [--out DIR] [--iters N]`: prints a table and writes `DIR/bench.md`.
//! Floor = (bytes the block must read: every draft layer's weights, the final norm, the
//! output head `[V, H]`, DFlash2's `W_hidden`) / 4.1 TB/s (the practical H200 copy rate of
//! GPU.md). Timing: wall clock around `iters` back-to-back blocks after warm-up, with a
//! device synchronize before and after (median of 5 such batches).

use std::time::Instant;

use anyhow::{Context, Result, anyhow};
use dflash_config::{Backend as DraftBackend, Geometry};
use dflash_context::{Capacity, ContextStore};
use dflash_draft::synthetic;
use dflash_draft::{
    BindOptions, DraftModel, HeadParts, HeadShape, RowRequest, TargetParts, Workspace,
    WorkspaceSpec,
};
use dflash_ops::Backend;
use dflash_ops::cuda::CudaBackend;
use dflash_ops::proposal_argmax::ProposalHead as OpsHead;

const FLOOR_BYTES_PER_S: f64 = 4.1e12;

fn block_bytes(g: &Geometry) -> u64 {
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

struct Row {
    name: String,
    rows: usize,
    k: usize,
    context: usize,
    eager_ms: f64,
    graph_ms: f64,
    floor_ms: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One official draft on the device with its synthetic target parts.
struct Setup {
    backend: DraftBackend,
    g: Geometry,
    model: DraftModel,
    embedding: dflash_ops::Buffer<dflash_ops::bf16>,
    head: dflash_ops::Buffer<dflash_ops::bf16>,
}

fn setup(be: &Backend, backend: DraftBackend) -> Result<Setup> {
    let (cfg, target) = synthetic::official_pair(backend)?;
    let d = dflash_config::DraftConfig::from_json_str(&cfg, dflash_config::ParseMode::Lenient)?;
    let g = dflash_config::validate_pair(&d.value, &target)?;
    let weights = synthetic::weights(be, &g, 1, &BindOptions::default())?;
    let model = DraftModel::from_parts(be, g.clone(), weights);
    let parts = synthetic::target_parts(g.vocab_rows as usize, g.hidden as usize, 7);
    let embedding = be.upload(&parts.embedding)?;
    let head = be.upload(&parts.output_head)?;
    Ok(Setup {
        backend,
        g,
        model,
        embedding,
        head,
    })
}

fn bench_one(
    cuda: &CudaBackend,
    s: &Setup,
    rows: usize,
    k: usize,
    context: usize,
    iters: usize,
) -> Result<Row> {
    let be = Backend::Cuda(cuda.clone());
    let (backend, g, model) = (s.backend, &s.g, &s.model);
    let (h, v) = (g.hidden as usize, g.vocab_rows as usize);
    let _ = h;
    let public = g.public_vocab_size.unwrap_or(g.vocab_rows) as usize;
    let max_ctx = context + k + 1;
    let mut store = ContextStore::new(
        be.clone(),
        model.context_geometry()?,
        Capacity::new(rows, max_ctx, 64),
    )?;
    let mut reqs = Vec::new();
    for r in 0..rows {
        let handle = store.admit(max_ctx)?;
        let f = synthetic::features(context, g.feature_width as usize, 11 + r as u64);
        model.prefill(&mut store, handle, be.upload(&f)?)?;
        reqs.push(RowRequest {
            handle,
            anchor: (1000 + r) as u32,
            usable: k,
            temperature: if g.dflash2.is_some() { 0.7 } else { 0.0 },
            seed: 5 + r as u64,
        });
    }
    let tp = TargetParts {
        vocab_rows: v,
        public_vocab: public,
        embedding: &s.embedding,
        head: HeadParts::Full {
            output_head: &s.head,
        },
    };
    let spec = WorkspaceSpec {
        rows,
        draft_count: k,
        mask_token_id: g.mask_token_id.unwrap_or(0),
        head: HeadShape {
            kind: OpsHead::Full,
            rows: v,
            public_vocab: public,
        },
    };
    let mut ws = Workspace::new(model, &store, &spec)?;
    model.stage(&store, &reqs, &mut ws)?;
    for _ in 0..3 {
        model.run_block(&store, &tp, &mut ws)?;
    }
    be.synchronize()?;
    let mut eager = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        for _ in 0..iters {
            model.run_block(&store, &tp, &mut ws)?;
        }
        be.synchronize()?;
        eager.push(t.elapsed().as_secs_f64() * 1e3 / iters as f64);
    }
    let stream = cuda.stream().clone();
    stream
        .begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .map_err(|e| anyhow!("begin_capture: {e}"))?;
    let queued = model.run_block(&store, &tp, &mut ws);
    let graph = stream
        .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
        .map_err(|e| anyhow!("end_capture: {e}"))?;
    queued.context("queuing the block during capture")?;
    let graph = graph.context("capture produced no graph")?;
    graph.launch().map_err(|e| anyhow!("graph launch: {e}"))?;
    be.synchronize()?;
    let mut replay = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        for _ in 0..iters {
            graph.launch().map_err(|e| anyhow!("graph launch: {e}"))?;
        }
        be.synchronize()?;
        replay.push(t.elapsed().as_secs_f64() * 1e3 / iters as f64);
    }
    Ok(Row {
        name: match backend {
            DraftBackend::DFlash => "35B-A3B DFlash".into(),
            DraftBackend::DFlash2 => "27B DFlash2".into(),
        },
        rows,
        k,
        context,
        eager_ms: median(eager),
        graph_ms: median(replay),
        floor_ms: block_bytes(g) as f64 / FLOOR_BYTES_PER_S * 1e3,
    })
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let out = args
        .iter()
        .position(|a| a == "--out")
        .and_then(|i| args.get(i + 1))
        .cloned();
    let iters: usize = match args
        .iter()
        .position(|a| a == "--iters")
        .and_then(|i| args.get(i + 1))
    {
        Some(s) => s.parse().context("--iters")?,
        None => 20,
    };
    let cuda = CudaBackend::new(0).context("opening CUDA device 0")?;
    let info = cuda.device_info()?;
    let mut rows = Vec::new();
    let be = Backend::Cuda(cuda.clone());
    for backend in [DraftBackend::DFlash, DraftBackend::DFlash2] {
        let s = setup(&be, backend)?;
        for (b, k) in [(1, 7), (1, 15), (8, 7)] {
            let r = bench_one(&cuda, &s, b, k, 2048, iters)?;
            eprintln!(
                "{} B={} K={}: eager {:.3} ms, graph {:.3} ms",
                r.name, r.rows, r.k, r.eager_ms, r.graph_ms
            );
            rows.push(r);
        }
    }
    let mut md = format!(
        "# Draft block benchmark\n\n- GPU: {} ({}), CUDA {}\n- command: `{}`\n- one block = embedding of [anchor, MASK x K], every draft layer over a context of 2048 committed positions, final norm, head (DFlash argmax over the full 248320-row head; DFlash2 top-16 + selector at T = 0.7); synthetic weights\n- floor = bytes the block must read (layer weights + output head [+ W_hidden]) / 4.1 TB/s\n- time: median over 5 batches of {iters} back-to-back blocks\n\n| draft | B | K | context | eager ms | graph replay ms | floor ms | graph / floor |\n|---|---|---|---|---|---|---|---|\n",
        info.name,
        info.arch,
        info.driver_cuda_version,
        args.join(" ")
    );
    for r in &rows {
        md.push_str(&format!(
            "| {} | {} | {} | {} | {:.3} | {:.3} | {:.3} | {:.2}x |\n",
            r.name,
            r.rows,
            r.k,
            r.context,
            r.eager_ms,
            r.graph_ms,
            r.floor_ms,
            r.graph_ms / r.floor_ms
        ));
    }
    println!("{md}");
    if let Some(dir) = out {
        std::fs::create_dir_all(&dir)?;
        std::fs::write(format!("{dir}/bench.md"), md)?;
    }
    Ok(())
}
