//! CUDA launcher of `target_distribution` (kernels/target_distribution.cu).

use cudarc::driver::{LaunchConfig, PushKernelArg};

use crate::cuda::{CudaBackend, cuda_err};
use crate::{Buffer, Result};

use super::{Columns, Logits, OP, Outputs, Params, Sampling};

pub(crate) const SOURCE: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../kernels/target_distribution.cu"
));

/// Threads per block (must match `TD_THREADS` in the kernel).
const THREADS: u32 = 512;

pub(super) fn run(
    c: &CudaBackend,
    logits: Logits<'_>,
    columns: Columns<'_>,
    live: &Buffer<i32>,
    counts: &Buffer<i32>,
    proposals: &Buffer<i32>,
    s: &Sampling<'_>,
    out: Outputs<'_>,
    params: &Params,
) -> Result<()> {
    let blocks = params.rows * params.cols;
    if blocks == 0 {
        return Ok(());
    }
    let grid = u32::try_from(blocks).map_err(|_| crate::OpsError::Param {
        op: OP,
        param: "rows",
        expected: "rows * cols below 2^32 blocks".into(),
        found: params.rows.to_string(),
    })?;
    let entry = match logits {
        Logits::F32(_) => "target_distribution_kernel",
        Logits::Bf16(_) => "target_distribution_bf16_kernel",
    };
    let f = c.function(OP, SOURCE, entry)?;
    // Static shapes, validated by `run_with` (cols <= 256, vocab <= 2^30, the logits a whole
    // number of vocab-columns).
    let rows = params.rows as i32;
    let cols = params.cols as i32;
    let vocab = params.vocab as i32;
    let public_vocab = params.public_vocab as i32;
    let logit_cols = (logits.len() / params.vocab) as i64;
    // Padded: the kernel computes r * cols + i and never reads `col_start` (the live counts
    // are a well-typed placeholder).
    let (col_start, starts) = match columns {
        Columns::Padded => (live, 0i32),
        Columns::Starts(b) => (b, 1i32),
    };
    // Full: the kernel never writes `greedy` (live_form = 0); the live counts are a
    // well-typed placeholder that is never written.
    let (p, greedy, live_form) = match out {
        Outputs::Full(p) => (p, None, 0i32),
        Outputs::Live { p, greedy } => (p, Some(greedy), 1i32),
    };
    let cfg = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = c.stream().launch_builder(&f);
    match logits {
        Logits::F32(l) => b.arg(l.device(OP, "logits")?),
        Logits::Bf16(l) => b.arg(l.device(OP, "logits")?),
    };
    b.arg(&logit_cols);
    b.arg(col_start.device(OP, "col_start")?);
    b.arg(&starts);
    b.arg(live.device(OP, "live")?);
    b.arg(counts.device(OP, "counts")?);
    b.arg(proposals.device(OP, "proposals")?);
    b.arg(s.temperature.device(OP, "temperature")?);
    b.arg(s.top_k.device(OP, "top_k")?);
    b.arg(s.top_p.device(OP, "top_p")?);
    b.arg(s.min_p.device(OP, "min_p")?);
    b.arg(s.repetition_penalty.device(OP, "repetition_penalty")?);
    b.arg(s.frequency_penalty.device(OP, "frequency_penalty")?);
    b.arg(s.presence_penalty.device(OP, "presence_penalty")?);
    b.arg(p.device_mut(OP, "p")?);
    match greedy {
        Some(g) => b.arg(g.device_mut(OP, "greedy")?),
        None => b.arg(live.device(OP, "live")?),
    };
    b.arg(&live_form);
    b.arg(&rows);
    b.arg(&cols);
    b.arg(&vocab);
    b.arg(&public_vocab);
    // SAFETY: argument types and order match target_distribution_kernel and
    // target_distribution_bf16_kernel; every length was checked by `run_with` against the
    // static shape the kernel indexes with (logits columns bounded by `logit_cols`).
    unsafe { b.launch(cfg) }.map_err(cuda_err(format!("launching {entry}")))?;
    Ok(())
}
