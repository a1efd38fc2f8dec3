//! CUDA launcher of `unary_topk` (kernels/unary_topk.cu): one 256-thread block per column.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use crate::cuda::{CudaBackend, cuda_err};
use crate::{Buffer, Result};

use super::{OP, Params, ProposalHead};

const SOURCE: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../kernels/unary_topk.cu"
));

/// Threads per block; must equal `UT_THREADS` in the kernel (its shared arrays are sized by it).
const THREADS: u32 = 256;

/// Shapes were validated by `super::run` (n >= 1, at least 16 candidates, sizes fit in i32).
pub(super) fn run(
    c: &CudaBackend,
    logits: &Buffer<f32>,
    token_ids: Option<&Buffer<i32>>,
    scores: &mut Buffer<f32>,
    ids: &mut Buffer<i32>,
    p: &Params,
) -> Result<()> {
    let cfg = LaunchConfig {
        grid_dim: (p.n as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let rows = p.rows as i32;
    let public_vocab = p.public_vocab as i32;
    match (p.head, token_ids) {
        (ProposalHead::Indexed, Some(t)) => {
            let f = c.function(OP, SOURCE, "unary_topk_indexed")?;
            let mut b = c.stream().launch_builder(&f);
            b.arg(logits.device(OP, "logits")?);
            b.arg(t.device(OP, "token_ids")?);
            b.arg(scores.device_mut(OP, "scores")?);
            b.arg(ids.device_mut(OP, "ids")?);
            b.arg(&rows);
            // SAFETY: argument types and order match unary_topk_indexed; logits has n*rows
            // elements, token_ids rows >= 16, scores and ids 16n (checked by `super::run`).
            unsafe { b.launch(cfg) }.map_err(cuda_err("launching unary_topk_indexed"))?;
        }
        _ => {
            let f = c.function(OP, SOURCE, "unary_topk_full")?;
            let mut b = c.stream().launch_builder(&f);
            b.arg(logits.device(OP, "logits")?);
            b.arg(scores.device_mut(OP, "scores")?);
            b.arg(ids.device_mut(OP, "ids")?);
            b.arg(&rows);
            b.arg(&public_vocab);
            // SAFETY: argument types and order match unary_topk_full; logits has n*rows
            // elements, 16 <= public_vocab <= rows, scores and ids 16n (checked by `super::run`).
            unsafe { b.launch(cfg) }.map_err(cuda_err("launching unary_topk_full"))?;
        }
    }
    Ok(())
}
