//! CUDA-graph safety check: the per-round ops (context materialize, local attention, the
//! DFlash2 selector, target distribution, chain acceptance) captured once into a graph must
//! replay bit-identically to eager runs while the device-side metadata (positions, counts,
//! lanes, live columns, seeds, temperatures) is rewritten between replays.

use anyhow::{Context, Result, ensure};
use dflash_ops::cuda::CudaBackend;
use dflash_ops::{Backend, Buffer, Element, bf16, f16};
use dflash_ops::{candidate_selector as sel, chain_accept as ca, context_kv_materialize as mat};
use dflash_ops::{sliding_window_attention as swa, target_distribution as td};

const ROWS: usize = 3;
const COLS: usize = 8; // W = K + 1
const K: usize = COLS - 1;
const H: usize = 256;
const HQ: usize = 4;
const HKV: usize = 2;
const D: usize = 64;
const S: usize = 64;
const LANES: usize = 4;
const R: usize = 32;
const VOCAB: usize = 512;
const PUBLIC: usize = 500;

/// A deterministic value stream (SplitMix64) for inputs.
struct Gen(u64);
impl Gen {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    fn bf16s(&mut self, n: usize, scale: f32) -> Vec<bf16> {
        (0..n)
            .map(|_| bf16::from_f32(self.unit() * scale))
            .collect()
    }
}

/// One round's per-request metadata.
struct Meta {
    ctx_start: [i32; ROWS],
    counts: [i32; ROWS],
    lanes: [i32; ROWS],
    live: [i32; ROWS],
    seeds: [u64; ROWS],
    temperature: [f32; ROWS],
}

impl Meta {
    fn block_pos(&self) -> Vec<i32> {
        (0..ROWS)
            .map(|r| self.ctx_start[r] + self.counts[r])
            .collect()
    }
    fn seeds(&self) -> Vec<i32> {
        self.seeds
            .iter()
            .flat_map(|s| [*s as u32 as i32, (*s >> 32) as u32 as i32])
            .collect()
    }
}

struct Round {
    // inputs
    features: Buffer<bf16>,
    w_k: Buffer<bf16>,
    w_v: Buffer<bf16>,
    key_norm: Buffer<bf16>,
    q: Buffer<bf16>,
    k_blk: Buffer<bf16>,
    v_blk: Buffer<bf16>,
    g: Buffer<bf16>,
    cand_ids: Buffer<i32>,
    unary: Buffer<f32>,
    w_pred: Buffer<bf16>,
    w_succ: Buffer<bf16>,
    anchors: Buffer<i32>,
    logits: Buffer<f32>,
    hist: Buffer<i32>,
    sampling: td::SamplingBuffers,
    // metadata (rewritten between replays)
    ctx_start: Buffer<i32>,
    counts: Buffer<i32>,
    lanes: Buffer<i32>,
    block_pos: Buffer<i32>,
    live: Buffer<i32>,
    seeds: Buffer<i32>,
    temperature: Buffer<f32>,
    // state and outputs
    pristine_k: Buffer<bf16>,
    pristine_v: Buffer<f16>,
    ring_k: Buffer<bf16>,
    ring_v: Buffer<f16>,
    scratch: Buffer<f32>,
    attn: Buffer<bf16>,
    ws: Buffer<f32>,
    proposals: Buffer<i32>,
    q_sel: Buffer<f32>,
    chosen: Buffer<i32>,
    p: Buffer<f32>,
    accepted: Buffer<i32>,
    out_tokens: Buffer<i32>,
    out_len: Buffer<i32>,
}

fn mat_params() -> mat::MaterializeParams {
    mat::MaterializeParams {
        rows: ROWS,
        cols: COLS,
        hidden: H,
        kv_heads: HKV,
        head_dim: D,
        eps: 1e-6,
        theta: 1e7,
        layout: mat::CacheLayout::Ring {
            lanes: LANES,
            capacity: S,
        },
    }
}

fn attn_params() -> swa::LocalAttentionParams {
    swa::LocalAttentionParams {
        rows: ROWS,
        cols: COLS,
        q_heads: HQ,
        kv_heads: HKV,
        head_dim: D,
        lanes: LANES,
        window: S,
    }
}

impl Round {
    fn new(be: &Backend) -> Result<Self> {
        let mut g = Gen(7);
        let mut cand = Vec::with_capacity(ROWS * K * 16);
        for i in 0..ROWS * K {
            // 16 distinct public ids per column.
            let base = (i * 37) % (PUBLIC - 16 * 3);
            cand.extend((0..16).map(|j| (base + j * 3) as i32));
        }
        let settings: Vec<td::Settings> = (0..ROWS)
            .map(|r| td::Settings {
                top_k: 40,
                top_p: 0.95,
                min_p: 0.01,
                ..td::Settings::sampling(0.8 + r as f32 * 0.2)
            })
            .collect();
        let ring_k = be.upload(&g.bf16s(LANES * S * HKV * D, 1.0))?;
        let ring_v: Vec<f16> = g
            .bf16s(LANES * S * HKV * D, 1.0)
            .iter()
            .map(|x| f16::from_f32(x.to_f32()))
            .collect();
        let ring_v = be.upload(&ring_v)?;
        Ok(Round {
            features: be.upload(&g.bf16s(ROWS * COLS * H, 1.0))?,
            w_k: be.upload(&g.bf16s(HKV * D * H, 0.06))?,
            w_v: be.upload(&g.bf16s(HKV * D * H, 0.06))?,
            key_norm: be.upload(&g.bf16s(D, 1.0))?,
            q: be.upload(&g.bf16s(ROWS * COLS * HQ * D, 1.0))?,
            k_blk: be.upload(&g.bf16s(ROWS * COLS * HKV * D, 1.0))?,
            v_blk: be.upload(&g.bf16s(ROWS * COLS * HKV * D, 1.0))?,
            g: be.upload(&g.bf16s(ROWS * K * R, 1.0))?,
            cand_ids: be.upload(&cand)?,
            unary: be.upload(
                &(0..ROWS * K * 16)
                    .map(|_| g.unit() * 2.0)
                    .collect::<Vec<f32>>(),
            )?,
            w_pred: be.upload(&g.bf16s(VOCAB * R, 0.3))?,
            w_succ: be.upload(&g.bf16s(VOCAB * R, 0.3))?,
            anchors: be.upload(&[3, 77, 401])?,
            logits: be.upload(
                &(0..ROWS * COLS * VOCAB)
                    .map(|_| g.unit() * 4.0)
                    .collect::<Vec<f32>>(),
            )?,
            hist: be.upload(
                &(0..ROWS * VOCAB)
                    .map(|i| i32::from(i % 11 == 0))
                    .collect::<Vec<i32>>(),
            )?,
            sampling: td::SamplingBuffers::upload(be, &settings)?,
            ctx_start: be.zeros(ROWS)?,
            counts: be.zeros(ROWS)?,
            lanes: be.zeros(ROWS)?,
            block_pos: be.zeros(ROWS)?,
            live: be.zeros(ROWS)?,
            seeds: be.zeros(2 * ROWS)?,
            temperature: be.zeros(ROWS)?,
            pristine_k: be.zeros(LANES * S * HKV * D)?,
            pristine_v: be.zeros(LANES * S * HKV * D)?,
            ring_k,
            ring_v,
            scratch: be.zeros(mat::scratch_len(&mat_params())?)?,
            attn: be.zeros(ROWS * COLS * HQ * D)?,
            ws: be.zeros(swa::workspace_len(&attn_params()))?,
            proposals: be.zeros(ROWS * K)?,
            q_sel: be.zeros(ROWS * K * 16)?,
            chosen: be.zeros(ROWS * K)?,
            p: be.zeros(ROWS * COLS * VOCAB)?,
            accepted: be.zeros(ROWS)?,
            out_tokens: be.zeros(ROWS * COLS)?,
            out_len: be.zeros(ROWS)?,
        })
    }

    fn set_meta(&mut self, be: &Backend, m: &Meta) -> Result<()> {
        be.write(&mut self.ctx_start, 0, &m.ctx_start)?;
        be.write(&mut self.counts, 0, &m.counts)?;
        be.write(&mut self.lanes, 0, &m.lanes)?;
        be.write(&mut self.block_pos, 0, &m.block_pos())?;
        be.write(&mut self.live, 0, &m.live)?;
        be.write(&mut self.seeds, 0, &m.seeds())?;
        be.write(&mut self.temperature, 0, &m.temperature)?;
        Ok(())
    }

    fn reset_state(&mut self, be: &Backend) -> Result<()> {
        let n = self.ring_k.len();
        be.copy(&self.pristine_k, 0, &mut self.ring_k, 0, n)?;
        be.copy(&self.pristine_v, 0, &mut self.ring_v, 0, n)?;
        be.synchronize()?;
        Ok(())
    }

    /// The per-round op sequence; queues work only (no host synchronization, no allocation).
    fn run(&mut self, be: &Backend) -> Result<()> {
        mat::run_with_scratch(
            be,
            &self.features,
            &self.w_k,
            &self.w_v,
            &self.key_norm,
            &self.ctx_start,
            &self.counts,
            &self.lanes,
            &mut self.ring_k,
            &mut self.ring_v,
            &mut self.scratch,
            &mat_params(),
        )?;
        swa::run(
            be,
            &self.q,
            &self.k_blk,
            &self.v_blk,
            &self.ring_k,
            &self.ring_v,
            &self.lanes,
            &self.block_pos,
            &self.live,
            &mut self.attn,
            &mut self.ws,
            &attn_params(),
        )?;
        sel::run(
            be,
            &sel::Inputs {
                g: &self.g,
                cand_ids: &self.cand_ids,
                unary: &self.unary,
                w_pred: &self.w_pred,
                w_succ: &self.w_succ,
                anchors: &self.anchors,
                seeds: &self.seeds,
                start_pos: &self.block_pos,
                temperature: &self.temperature,
            },
            &mut sel::Outputs {
                proposals: &mut self.proposals,
                q: &mut self.q_sel,
                chosen: &mut self.chosen,
            },
            &sel::Params {
                rows: ROWS,
                k: K,
                rank: R,
                vocab: VOCAB,
            },
        )?;
        td::run(
            be,
            &self.logits,
            &self.live,
            &self.hist,
            &self.proposals,
            &self.sampling.view(),
            &mut self.p,
            &td::Params {
                rows: ROWS,
                cols: COLS,
                vocab: VOCAB,
                public_vocab: PUBLIC,
            },
        )?;
        ca::run(
            be,
            &self.p,
            &self.proposals,
            &self.live,
            ca::Proposal::Top16 {
                q: &self.q_sel,
                ids: &self.cand_ids,
            },
            &self.seeds,
            &self.block_pos,
            ca::Outputs {
                accepted: &mut self.accepted,
                out_tokens: &mut self.out_tokens,
                out_len: &mut self.out_len,
            },
            &ca::Params {
                rows: ROWS,
                cols: COLS,
                vocab: VOCAB,
            },
        )?;
        Ok(())
    }

    fn snapshot(&self, be: &Backend) -> Result<Vec<(&'static str, Vec<u32>)>> {
        fn bits<T: Element>(be: &Backend, b: &Buffer<T>) -> Result<Vec<u32>> {
            Ok(be.download(b)?.iter().map(|x| x.bits()).collect())
        }
        Ok(vec![
            ("ring_k", bits(be, &self.ring_k)?),
            ("ring_v", bits(be, &self.ring_v)?),
            ("attention", bits(be, &self.attn)?),
            ("proposals", bits(be, &self.proposals)?),
            ("q", bits(be, &self.q_sel)?),
            ("chosen", bits(be, &self.chosen)?),
            ("p", bits(be, &self.p)?),
            ("accepted", bits(be, &self.accepted)?),
            ("out_tokens", bits(be, &self.out_tokens)?),
            ("out_len", bits(be, &self.out_len)?),
        ])
    }
}

fn metas() -> Vec<Meta> {
    vec![
        Meta {
            ctx_start: [0, 10, 100],
            counts: [8, 3, 8],
            lanes: [0, 1, 2],
            live: [8, 5, 1],
            seeds: [1, 2, 3],
            temperature: [0.0, 0.7, 1.0],
        },
        Meta {
            ctx_start: [64, 5, 700],
            counts: [2, 8, 0],
            lanes: [3, 0, 1],
            live: [2, 8, 8],
            seeds: [9, 1 << 40, 5],
            temperature: [1.3, 0.0, 0.6],
        },
        Meta {
            ctx_start: [130, 0, 4000],
            counts: [8, 1, 5],
            lanes: [2, 3, 0],
            live: [1, 3, 6],
            seeds: [77, 78, 79],
            temperature: [0.9, 0.9, 0.0],
        },
    ]
}

/// One line per replay: (metadata set, outputs compared, all bit-identical to eager).
pub struct GraphResult {
    /// Replays run.
    pub replays: usize,
    /// Per replay, the outputs that differed from the eager run (empty = identical).
    pub mismatches: Vec<Vec<&'static str>>,
    /// Outputs that changed between metadata sets (proves the metadata mattered).
    pub varied: Vec<&'static str>,
}

pub fn check(cuda: &CudaBackend) -> Result<GraphResult> {
    let be = Backend::Cuda(cuda.clone());
    let mut round = Round::new(&be).context("building graph-check inputs")?;
    let n = round.ring_k.len();
    be.copy(&round.ring_k, 0, &mut round.pristine_k, 0, n)?;
    be.copy(&round.ring_v, 0, &mut round.pristine_v, 0, n)?;
    let metas = metas();
    // Warm-up eager run: loads modules and runs every cuBLAS call once before capture.
    round.set_meta(&be, &metas[0])?;
    round.reset_state(&be)?;
    round.run(&be).context("eager warm-up")?;
    be.synchronize()?;
    round.reset_state(&be)?;
    let stream = cuda.stream().clone();
    stream
        .begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .map_err(|e| anyhow::anyhow!("begin_capture: {e}"))?;
    let captured = round.run(&be);
    let graph = stream
        .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
        .map_err(|e| anyhow::anyhow!("end_capture: {e}"))?;
    captured.context("queuing the round during capture")?;
    let graph = graph.context("capture produced no graph")?;
    let mut mismatches = Vec::new();
    let mut per_meta = Vec::new();
    for m in &metas {
        round.set_meta(&be, m)?;
        round.reset_state(&be)?;
        graph
            .launch()
            .map_err(|e| anyhow::anyhow!("graph launch: {e}"))?;
        be.synchronize()?;
        let replay = round.snapshot(&be)?;
        round.reset_state(&be)?;
        round.run(&be)?;
        be.synchronize()?;
        let eager = round.snapshot(&be)?;
        mismatches.push(
            replay
                .iter()
                .zip(&eager)
                .filter(|(a, b)| a.1 != b.1)
                .map(|(a, _)| a.0)
                .collect(),
        );
        per_meta.push(eager);
    }
    let varied = per_meta[0]
        .iter()
        .enumerate()
        .filter(|(i, (_, v))| per_meta[1..].iter().any(|o| o[*i].1 != *v))
        .map(|(_, (name, _))| *name)
        .collect();
    ensure!(per_meta.len() == metas.len(), "internal: replay count");
    Ok(GraphResult {
        replays: metas.len(),
        mismatches,
        varied,
    })
}
