//! CUDA launcher of `proposal_argmax` (kernels/proposal_argmax.cu): one block per column.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use crate::cuda::{CudaBackend, cuda_err};
use crate::{Buffer, Result};

use super::{OP, Params, ProposalHead};

const SOURCE: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../kernels/proposal_argmax.cu"
));

/// Threads per block (16 warps; a multiple of 32, as the kernel's reduction requires).
const THREADS: u32 = 512;

/// Shapes were validated by `super::run` (n >= 1, rows and public_vocab fit in i32).
pub(super) fn run(
    c: &CudaBackend,
    logits: &Buffer<f32>,
    token_ids: Option<&Buffer<i32>>,
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
            let f = c.function(OP, SOURCE, "proposal_argmax_indexed")?;
            let mut b = c.stream().launch_builder(&f);
            b.arg(logits.device(OP, "logits")?);
            b.arg(t.device(OP, "token_ids")?);
            b.arg(ids.device_mut(OP, "ids")?);
            b.arg(&rows);
            // SAFETY: argument types and order match proposal_argmax_indexed; logits has
            // n*rows elements, token_ids rows, ids n (checked by `super::run`).
            unsafe { b.launch(cfg) }.map_err(cuda_err("launching proposal_argmax_indexed"))?;
        }
        _ => {
            let f = c.function(OP, SOURCE, "proposal_argmax_full")?;
            let mut b = c.stream().launch_builder(&f);
            b.arg(logits.device(OP, "logits")?);
            b.arg(ids.device_mut(OP, "ids")?);
            b.arg(&rows);
            b.arg(&public_vocab);
            // SAFETY: argument types and order match proposal_argmax_full; logits has n*rows
            // elements, ids n, public_vocab <= rows (checked by `super::run`).
            unsafe { b.launch(cfg) }.map_err(cuda_err("launching proposal_argmax_full"))?;
        }
    }
    Ok(())
}
