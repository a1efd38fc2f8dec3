//! CUDA launcher of `tree_accept`: the module is kernels/chain_accept.cu (the shared blocked
//! draw) followed by kernels/tree_accept.cu.

use std::sync::OnceLock;

use cudarc::driver::{LaunchConfig, PushKernelArg};

use crate::cuda::{CudaBackend, cuda_err};
use crate::{Buffer, Result};

use super::{Distributions, OP, Outputs, Params, Trees};

const OWN: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../kernels/tree_accept.cu"
));

/// The module source: chain_accept's draw, then this op's kernel (built once).
pub(crate) fn source() -> &'static str {
    static SRC: OnceLock<String> = OnceLock::new();
    SRC.get_or_init(|| format!("{}\n{OWN}", crate::chain_accept::cuda::SOURCE))
}

/// Threads per block (`CA_THREADS` of chain_accept.cu).
const THREADS: u32 = 1024;

pub(super) fn run(
    c: &CudaBackend,
    target: Distributions<'_>,
    trees: &Trees<'_>,
    seeds: &Buffer<i32>,
    start_pos: &Buffer<i32>,
    out: Outputs<'_>,
    params: &Params,
) -> Result<()> {
    if params.rows == 0 {
        return Ok(());
    }
    let f = c.function(OP, source(), "tree_accept_kernel")?;
    // Static shapes, validated by `run` (rows < 2^32, cols <= 32, vocab <= 2^20).
    let rows = params.rows as i32;
    let cols = params.cols as i32;
    let vocab = params.vocab as i32;
    let cfg = LaunchConfig {
        grid_dim: (params.rows as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // Full: the kernel never reads `greedy` (has_greedy = 0); `nodes` is a well-typed
    // placeholder.
    let (p, greedy, has_greedy) = match target {
        Distributions::Full(p) => (p, trees.nodes, 0i32),
        Distributions::Live { p, greedy } => (p, greedy, 1i32),
    };
    let mut b = c.stream().launch_builder(&f);
    b.arg(p.device(OP, "p")?);
    b.arg(greedy.device(OP, "greedy")?);
    b.arg(&has_greedy);
    b.arg(trees.nodes.device(OP, "nodes")?);
    b.arg(trees.tokens.device(OP, "tokens")?);
    b.arg(trees.parents.device(OP, "parents")?);
    b.arg(trees.q.device(OP, "q")?);
    b.arg(trees.ids.device(OP, "ids")?);
    b.arg(seeds.device(OP, "seeds")?);
    b.arg(start_pos.device(OP, "start_pos")?);
    b.arg(out.accepted.device_mut(OP, "accepted")?);
    b.arg(out.out_tokens.device_mut(OP, "out_tokens")?);
    b.arg(out.out_len.device_mut(OP, "out_len")?);
    b.arg(out.path.device_mut(OP, "path")?);
    b.arg(&rows);
    b.arg(&cols);
    b.arg(&vocab);
    // SAFETY: argument types and order match tree_accept_kernel; every length was checked by
    // `run` against the static shape the kernel indexes with.
    unsafe { b.launch(cfg) }.map_err(cuda_err("launching tree_accept_kernel"))?;
    Ok(())
}
