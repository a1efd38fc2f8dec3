//! CUDA launcher of `head_norm_rope` (kernels/head_norm_rope.cu).

use cudarc::driver::{LaunchConfig, PushKernelArg};
use half::bf16;

use crate::cuda::{CudaBackend, cuda_err};
use crate::{Buffer, OpsError, Result};

use super::{HeadNormRopeParams, OP};

pub(crate) const SOURCE: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../kernels/head_norm_rope.cu"
));

/// Warps (one (row, col, head) item each) per block.
const WARPS_PER_BLOCK: usize = 4;

pub(super) fn run(
    c: &CudaBackend,
    x: &Buffer<f32>,
    w: &Buffer<bf16>,
    start_pos: &Buffer<i32>,
    out: &mut Buffer<bf16>,
    p: &HeadNormRopeParams,
) -> Result<()> {
    let items = p.rows * p.cols * p.heads; // validated product
    if items == 0 {
        return Ok(());
    }
    let int = |param: &'static str, v: usize| {
        i32::try_from(v).map_err(|_| OpsError::Param {
            op: OP,
            param,
            expected: "at most i32::MAX on CUDA".into(),
            found: v.to_string(),
        })
    };
    let (rows, cols) = (int("rows", p.rows)?, int("cols", p.cols)?);
    let (heads, d) = (int("heads", p.heads)?, int("head_dim", p.head_dim)?);
    let blocks = int("rows*cols*heads / 4", items.div_ceil(WARPS_PER_BLOCK))? as u32;
    let f = c.function(OP, SOURCE, "head_norm_rope_kernel")?;
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: ((32 * WARPS_PER_BLOCK) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = c.stream().launch_builder(&f);
    b.arg(x.device(OP, "x")?);
    b.arg(w.device(OP, "norm")?);
    b.arg(start_pos.device(OP, "start_pos")?);
    b.arg(out.device_mut(OP, "out")?);
    b.arg(&rows);
    b.arg(&cols);
    b.arg(&heads);
    b.arg(&d);
    b.arg(&p.theta);
    b.arg(&p.eps);
    // SAFETY: argument types and order match head_norm_rope_kernel; lengths validated by
    // `run`; each warp writes only its own head.
    unsafe { b.launch(cfg) }.map_err(cuda_err("launching head_norm_rope_kernel"))?;
    Ok(())
}
