//! CUDA launcher of `target_distribution` (kernels/target_distribution.cu).

use cudarc::driver::{LaunchConfig, PushKernelArg};

use crate::cuda::{CudaBackend, cuda_err};
use crate::{Buffer, Result};

use super::{OP, Params, Sampling};

pub(crate) const SOURCE: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../kernels/target_distribution.cu"
));

/// Threads per block (must match `TD_THREADS` in the kernel).
const THREADS: u32 = 512;

pub(super) fn run(
    c: &CudaBackend,
    logits: &Buffer<f32>,
    live: &Buffer<i32>,
    counts: &Buffer<i32>,
    proposals: &Buffer<i32>,
    s: &Sampling<'_>,
    p: &mut Buffer<f32>,
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
    let f = c.function(OP, SOURCE, "target_distribution_kernel")?;
    // Static shapes, validated by `run` (cols <= 256, vocab <= 2^30).
    let rows = params.rows as i32;
    let cols = params.cols as i32;
    let vocab = params.vocab as i32;
    let public_vocab = params.public_vocab as i32;
    let cfg = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = c.stream().launch_builder(&f);
    b.arg(logits.device(OP, "logits")?);
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
    b.arg(&rows);
    b.arg(&cols);
    b.arg(&vocab);
    b.arg(&public_vocab);
    // SAFETY: argument types and order match target_distribution_kernel; every length was
    // checked by `run` against the static shape the kernel indexes with.
    unsafe { b.launch(cfg) }.map_err(cuda_err("launching target_distribution_kernel"))?;
    Ok(())
}
