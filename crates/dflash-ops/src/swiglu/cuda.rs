//! CUDA launcher of `swiglu` (kernels/swiglu.cu).

use cudarc::driver::{LaunchConfig, PushKernelArg};

use crate::cuda::{CudaBackend, cuda_err};
use crate::{Buffer, Result, bf16};

use super::{OP, SwigluParams};

pub(crate) const SOURCE: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../kernels/swiglu.cu"
));

/// Element (r, c) of gate is `gate[r * stride + c]`, of up `up[up_off + r * stride + c]`.
pub(super) fn run(
    c: &CudaBackend,
    gate: &Buffer<bf16>,
    up: &Buffer<bf16>,
    up_off: usize,
    stride: usize,
    out: &mut Buffer<bf16>,
    p: &SwigluParams,
) -> Result<()> {
    let n = p.rows * p.inter; // checked by `run`
    if n == 0 {
        return Ok(());
    }
    let f = c.function(OP, SOURCE, "swiglu_kernel")?;
    let (n_u64, inter_u64, stride_u64, off_u64) =
        (n as u64, p.inter as u64, stride as u64, up_off as u64);
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(256).clamp(1, 65_536) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = c.stream().launch_builder(&f);
    b.arg(gate.device(OP, "gate")?);
    b.arg(up.device(OP, "up")?);
    b.arg(out.device_mut(OP, "out")?);
    b.arg(&n_u64);
    b.arg(&inter_u64);
    b.arg(&stride_u64);
    b.arg(&off_u64);
    // SAFETY: argument types and count match swiglu_kernel; lengths checked by the caller
    // (the largest index read is up_off + (rows - 1) * stride + inter - 1 < input length).
    unsafe { b.launch(cfg) }.map_err(cuda_err("launching swiglu_kernel"))?;
    Ok(())
}
