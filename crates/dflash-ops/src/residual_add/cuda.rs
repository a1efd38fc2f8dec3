//! CUDA launcher of `residual_add` (kernels/residual_add.cu).

use cudarc::driver::{LaunchConfig, PushKernelArg};

use crate::cuda::{CudaBackend, cuda_err};
use crate::{Buffer, Result, bf16};

use super::OP;

pub(crate) const SOURCE: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../kernels/residual_add.cu"
));

/// Grid of a grid-stride elementwise kernel over `n` elements (256 threads a block).
fn config(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 65_536) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub(super) fn run(
    c: &CudaBackend,
    x: &Buffer<bf16>,
    y: &Buffer<bf16>,
    out: &mut Buffer<bf16>,
    n: usize,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let f = c.function(OP, SOURCE, "residual_add_kernel")?;
    let n_u64 = n as u64;
    let mut b = c.stream().launch_builder(&f);
    b.arg(x.device(OP, "x")?);
    b.arg(y.device(OP, "y")?);
    b.arg(out.device_mut(OP, "out")?);
    b.arg(&n_u64);
    // SAFETY: argument types and count match residual_add_kernel; lengths checked by `run`.
    unsafe { b.launch(config(n)) }.map_err(cuda_err("launching residual_add_kernel"))?;
    Ok(())
}

pub(super) fn run_inplace(
    c: &CudaBackend,
    x: &mut Buffer<bf16>,
    y: &Buffer<bf16>,
    n: usize,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let f = c.function(OP, SOURCE, "residual_add_inplace_kernel")?;
    let n_u64 = n as u64;
    let mut b = c.stream().launch_builder(&f);
    b.arg(x.device_mut(OP, "x")?);
    b.arg(y.device(OP, "y")?);
    b.arg(&n_u64);
    // SAFETY: argument types and count match residual_add_inplace_kernel; lengths checked.
    unsafe { b.launch(config(n)) }.map_err(cuda_err("launching residual_add_inplace_kernel"))?;
    Ok(())
}
