//! CUDA launcher of `rng_uniform` (kernels/rng_uniform.cu).

use cudarc::driver::{LaunchConfig, PushKernelArg};

use crate::cuda::{CudaBackend, cuda_err};
use crate::{Buffer, Result};

use super::OP;

pub(crate) const SOURCE: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../kernels/rng_uniform.cu"
));

pub(super) fn run(
    c: &CudaBackend,
    seeds: &Buffer<i32>,
    positions: &Buffer<i32>,
    purposes: &Buffer<i32>,
    subs: &Buffer<i32>,
    words: &mut Buffer<i32>,
    uniforms: &mut Buffer<f32>,
) -> Result<()> {
    let n = positions.len();
    if n == 0 {
        return Ok(());
    }
    let f = c.function(OP, SOURCE, "rng_uniform_kernel")?;
    let n_i32 = n as i32;
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(256) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = c.stream().launch_builder(&f);
    b.arg(seeds.device(OP, "seeds")?);
    b.arg(positions.device(OP, "positions")?);
    b.arg(purposes.device(OP, "purposes")?);
    b.arg(subs.device(OP, "subs")?);
    b.arg(words.device_mut(OP, "words")?);
    b.arg(uniforms.device_mut(OP, "uniforms")?);
    b.arg(&n_i32);
    // SAFETY: argument types and counts match kernels/rng_uniform.cu; lengths checked by `run`.
    unsafe { b.launch(cfg) }.map_err(cuda_err("launching rng_uniform_kernel"))?;
    Ok(())
}
