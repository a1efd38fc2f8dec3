//! CUDA launcher of `chain_accept` (kernels/chain_accept.cu).

use cudarc::driver::{LaunchConfig, PushKernelArg};

use crate::cuda::{CudaBackend, cuda_err};
use crate::{Buffer, Result};

use super::{Distributions, OP, Outputs, Params, Proposal};

pub(crate) const SOURCE: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../kernels/chain_accept.cu"
));

/// Threads per block (must match `CA_THREADS` in the kernel).
const THREADS: u32 = 1024;

pub(super) fn run(
    c: &CudaBackend,
    target: Distributions<'_>,
    proposals: &Buffer<i32>,
    live: &Buffer<i32>,
    proposal: Proposal<'_>,
    seeds: &Buffer<i32>,
    start_pos: &Buffer<i32>,
    out: Outputs<'_>,
    params: &Params,
) -> Result<()> {
    if params.rows == 0 {
        return Ok(());
    }
    let f = c.function(OP, SOURCE, "chain_accept_kernel")?;
    // Static shapes, validated by `run_with` (rows < 2^32, cols <= 256, vocab <= 2^20).
    let rows = params.rows as i32;
    let cols = params.cols as i32;
    let vocab = params.vocab as i32;
    let cfg = LaunchConfig {
        grid_dim: (params.rows as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // Full: the kernel never reads `greedy` (has_greedy = 0); `live` is a well-typed
    // placeholder.
    let (p, greedy, has_greedy) = match target {
        Distributions::Full(p) => (p, live, 0i32),
        Distributions::Live { p, greedy } => (p, greedy, 1i32),
    };
    // OneHot: the kernel never reads q / ids (top16 = 0); pass `p` / `proposals` as
    // well-typed placeholders.
    let (q, ids, top16) = match proposal {
        Proposal::OneHot => (p, proposals, 0i32),
        Proposal::Top16 { q, ids } => (q, ids, 1i32),
    };
    let mut b = c.stream().launch_builder(&f);
    b.arg(p.device(OP, "p")?);
    b.arg(greedy.device(OP, "greedy")?);
    b.arg(&has_greedy);
    b.arg(proposals.device(OP, "proposals")?);
    b.arg(live.device(OP, "live")?);
    b.arg(q.device(OP, "q")?);
    b.arg(ids.device(OP, "ids")?);
    b.arg(&top16);
    b.arg(seeds.device(OP, "seeds")?);
    b.arg(start_pos.device(OP, "start_pos")?);
    b.arg(out.accepted.device_mut(OP, "accepted")?);
    b.arg(out.out_tokens.device_mut(OP, "out_tokens")?);
    b.arg(out.out_len.device_mut(OP, "out_len")?);
    b.arg(&rows);
    b.arg(&cols);
    b.arg(&vocab);
    // SAFETY: argument types and order match chain_accept_kernel; every length was checked by
    // `run_with` against the static shape the kernel indexes with.
    unsafe { b.launch(cfg) }.map_err(cuda_err("launching chain_accept_kernel"))?;
    Ok(())
}
