//! CUDA launcher of `embedding_gather` (kernels/embedding_gather.cu).

use cudarc::driver::{LaunchConfig, PushKernelArg};

use crate::cuda::{CudaBackend, cuda_err};
use crate::{Buffer, OpsError, Result, bf16};

use super::OP;

pub(crate) const SOURCE: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../kernels/embedding_gather.cu"
));

pub(super) fn run(
    c: &CudaBackend,
    ids: &Buffer<i32>,
    table: &Buffer<bf16>,
    out: &mut Buffer<bf16>,
    n: usize,
    vocab: usize,
    hidden: usize,
) -> Result<()> {
    if n == 0 || hidden == 0 {
        return Ok(());
    }
    // One block per output row: the grid's x extent bounds n.
    if n > i32::MAX as usize {
        return Err(OpsError::Param {
            op: OP,
            param: "n",
            expected: format!("at most {} rows on CUDA", i32::MAX),
            found: n.to_string(),
        });
    }
    let f = c.function(OP, SOURCE, "embedding_gather_kernel")?;
    let (vocab_u64, hidden_u64) = (vocab as u64, hidden as u64);
    let cfg = LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = c.stream().launch_builder(&f);
    b.arg(ids.device(OP, "ids")?);
    b.arg(table.device(OP, "table")?);
    b.arg(out.device_mut(OP, "out")?);
    b.arg(&vocab_u64);
    b.arg(&hidden_u64);
    // SAFETY: argument types and count match embedding_gather_kernel; `run` checked
    // table = vocab * hidden and out = n * hidden, and the kernel bounds-checks each id.
    unsafe { b.launch(cfg) }.map_err(cuda_err("launching embedding_gather_kernel"))?;
    Ok(())
}
