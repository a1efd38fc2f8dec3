//! CUDA launcher of `dynamic_grouped_conv` (kernels/dynamic_grouped_conv.cu).
//!
//! prepare = two kernels on the stream: `_delta` (grid `[ceil(4G / 8), rows]`, 8 warps, one
//! projection row k per warp, all columns of its request) writes the output-side delta as
//! BF16 `finish_delta` and the input-side delta as f32 into the head of each column's own
//! row of `prepared`; `_prepare` (one block per column) reads that back into shared memory,
//! synchronizes, then overwrites the row with the convolved BF16 values. finish = one
//! elementwise kernel.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use crate::cuda::{CudaBackend, cuda_err};
use crate::{Buffer, OpsError, Result, bf16};

use super::{ConvParams, OP};

const SOURCE: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../kernels/dynamic_grouped_conv.cu"
));

/// Threads per block of every kernel (8 warps; `_delta` assigns one projection row per warp).
const THREADS: u32 = 256;
const WARPS: usize = 8;

fn limit(param: &'static str, ok: bool, found: usize, expected: &str) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(OpsError::Param {
            op: OP,
            param,
            expected: format!("{expected} on CUDA"),
            found: found.to_string(),
        })
    }
}

/// Launch limits of this implementation: grid extents and the dynamic shared memory
/// (`cols` f32 in `_delta`, `2G = H / 8` f32 in `_prepare`) within 48 KiB.
fn check_limits(p: &ConvParams) -> Result<()> {
    limit("rows", p.rows <= 65_535, p.rows, "at most 65535")?;
    limit("cols", p.cols <= 8192, p.cols, "at most 8192")?;
    limit("hidden", p.hidden <= 65_536, p.hidden, "at most 65536")?;
    let columns = p.rows * p.cols; // checked by `sizes`
    limit(
        "rows * cols",
        columns <= i32::MAX as usize,
        columns,
        "at most 2^31 - 1",
    )
}

pub(super) fn prepare(
    c: &CudaBackend,
    x: &Buffer<bf16>,
    norm_w: &Buffer<bf16>,
    base: &Buffer<bf16>,
    w_delta: &Buffer<bf16>,
    prepared: &mut Buffer<bf16>,
    finish_delta: &mut Buffer<bf16>,
    p: &ConvParams,
) -> Result<()> {
    check_limits(p)?;
    let columns = p.rows * p.cols;
    if columns == 0 {
        return Ok(());
    }
    let g = p.groups();
    let (cols_i, hidden_i, eps) = (p.cols as i32, p.hidden as i32, p.eps);

    let f = c.function(OP, SOURCE, "dynamic_grouped_conv_delta_kernel")?;
    let cfg = LaunchConfig {
        grid_dim: ((4 * g).div_ceil(WARPS) as u32, p.rows as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: (p.cols * 4) as u32,
    };
    let mut b = c.stream().launch_builder(&f);
    b.arg(x.device(OP, "x")?);
    b.arg(norm_w.device(OP, "norm_w")?);
    b.arg(w_delta.device(OP, "w_delta")?);
    b.arg(finish_delta.device_mut(OP, "finish_delta")?);
    // The input-side delta goes to the scratch words at the head of each column's row of
    // `prepared` (H / 8 f32 = H / 4 bf16 slots, inside the row).
    b.arg(prepared.device_mut(OP, "prepared")?);
    b.arg(&cols_i);
    b.arg(&hidden_i);
    b.arg(&eps);
    // SAFETY: argument types and count match dynamic_grouped_conv_delta_kernel; lengths
    // checked by `prepare`; dynamic shared memory holds `cols` f32.
    unsafe { b.launch(cfg) }.map_err(cuda_err("launching dynamic_grouped_conv_delta_kernel"))?;

    let f = c.function(OP, SOURCE, "dynamic_grouped_conv_prepare_kernel")?;
    let cfg = LaunchConfig {
        grid_dim: (columns as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: (2 * g * 4) as u32,
    };
    let mut b = c.stream().launch_builder(&f);
    b.arg(x.device(OP, "x")?);
    b.arg(norm_w.device(OP, "norm_w")?);
    b.arg(base.device(OP, "base")?);
    b.arg(prepared.device_mut(OP, "prepared")?);
    b.arg(&cols_i);
    b.arg(&hidden_i);
    b.arg(&eps);
    // SAFETY: argument types and count match dynamic_grouped_conv_prepare_kernel; lengths
    // checked by `prepare`; dynamic shared memory holds 2G f32.
    unsafe { b.launch(cfg) }.map_err(cuda_err("launching dynamic_grouped_conv_prepare_kernel"))?;
    Ok(())
}

pub(super) fn finish(
    c: &CudaBackend,
    z: &Buffer<bf16>,
    finish_delta: &Buffer<bf16>,
    base: &Buffer<bf16>,
    residual: &Buffer<bf16>,
    out: &mut Buffer<bf16>,
    p: &ConvParams,
) -> Result<()> {
    check_limits(p)?;
    let total = p.rows * p.cols * p.hidden;
    if total == 0 {
        return Ok(());
    }
    let f = c.function(OP, SOURCE, "dynamic_grouped_conv_finish_kernel")?;
    let (total_u64, cols_u64, hidden_u64) = (total as u64, p.cols as u64, p.hidden as u64);
    let cfg = LaunchConfig {
        grid_dim: (
            total.div_ceil(THREADS as usize).clamp(1, 65_536) as u32,
            1,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = c.stream().launch_builder(&f);
    b.arg(z.device(OP, "z")?);
    b.arg(finish_delta.device(OP, "finish_delta")?);
    b.arg(base.device(OP, "base")?);
    b.arg(residual.device(OP, "residual")?);
    b.arg(out.device_mut(OP, "out")?);
    b.arg(&total_u64);
    b.arg(&cols_u64);
    b.arg(&hidden_u64);
    // SAFETY: argument types and count match dynamic_grouped_conv_finish_kernel; lengths
    // checked by `finish`.
    unsafe { b.launch(cfg) }.map_err(cuda_err("launching dynamic_grouped_conv_finish_kernel"))?;
    Ok(())
}
