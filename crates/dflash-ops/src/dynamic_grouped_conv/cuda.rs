//! CUDA launcher of `dynamic_grouped_conv` (kernels/dynamic_grouped_conv.cu).
//!
//! prepare = three launches on the stream: `_split` (one block per column, 8 channels a thread
//! per step) writes the inverse RMS and the exact hi/lo BF16 split of the normalized-input
//! products into the scratch; one GEMM (the gemm helper) projects those `2 * columns` rows on
//! `w_delta` (f32 increments); `_apply` (grid columns x ceil(H / 2048)) writes `prepared` and
//! `finish_delta`. finish = one elementwise kernel (grid columns x ceil(H / 2048), 8 channels
//! a thread). The split and finish kernels access 8 channels as one 16-byte word: H is a
//! multiple of 16 (checked) and every device buffer starts 16-byte aligned (allocations are
//! 256-byte aligned; borrowed views are checked for 16).

use cudarc::driver::LaunchConfig;

use crate::cuda::{CudaBackend, RawArg, slice_address};
use crate::gemm::cuda::{DeviceGemm, gemm_bf16_device};
use crate::{Buffer, OpsError, Result, bf16};

use super::{ConvParams, OP};

pub(crate) const SOURCE: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../kernels/dynamic_grouped_conv.cu"
));

/// Threads per block of the apply and finish kernels.
const THREADS: u32 = 256;
/// Channels one `_apply` or `_finish` block covers (8 per thread).
const BLOCK_CHANNELS: usize = 8 * THREADS as usize;

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

/// Launch limits of this implementation: grid extents.
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
    split: &mut Buffer<bf16>,
    raw: &mut Buffer<f32>,
    p: &ConvParams,
) -> Result<()> {
    check_limits(p)?;
    let columns = p.rows * p.cols;
    if columns == 0 {
        return Ok(());
    }
    let g = p.groups();
    let (cols_i, hidden_i, eps) = (p.cols as i32, p.hidden as i32, p.eps);
    let inc = 2 * columns * 4 * g; // f32 increments before the inverse RMS words
    {
        let f = c.function(OP, SOURCE, "dynamic_grouped_conv_split_kernel")?;
        let cfg = LaunchConfig {
            grid_dim: (columns as u32, 1, 1),
            block_dim: (crate::cuda::eight_wide_threads(p.hidden), 1, 1),
            shared_mem_bytes: 0,
        };
        let inv = slice_address(raw.device_mut(OP, "scratch.raw")?) + 4 * inc as u64;
        let mut args = [
            RawArg::Ptr(slice_address(x.device(OP, "x")?)),
            RawArg::Ptr(slice_address(norm_w.device(OP, "norm_w")?)),
            RawArg::Ptr(slice_address(split.device_mut(OP, "scratch.split")?)),
            RawArg::Ptr(inv),
            RawArg::I32(hidden_i),
            RawArg::F32(eps),
        ];
        // SAFETY: argument types and count match dynamic_grouped_conv_split_kernel; x has
        // columns*H elements, split 2*columns*H, raw at least inc + columns f32 (the inverse
        // RMS words from element inc; checked by `prepare` through PrepareScratch::lens);
        // every thread calls df_pdl_wait before it reads or writes anything.
        unsafe {
            c.launch_ex(
                &f,
                cfg,
                &mut args,
                "dynamic_grouped_conv_split_kernel",
                true,
                1,
            )
        }?;
    }
    {
        let raw_d = raw.device_mut(OP, "scratch.raw")?;
        let mut inc_view = raw_d.slice_mut(0..inc);
        gemm_bf16_device(
            c,
            OP,
            split.device(OP, "scratch.split")?,
            w_delta.device(OP, "w_delta")?,
            &mut inc_view,
            &DeviceGemm::contiguous(2 * columns, 4 * g, p.hidden),
        )?;
    }
    let f = c.function(OP, SOURCE, "dynamic_grouped_conv_apply_kernel")?;
    let cfg = LaunchConfig {
        grid_dim: (columns as u32, p.hidden.div_ceil(BLOCK_CHANNELS) as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let raw_p = slice_address(raw.device(OP, "scratch.raw")?);
    let mut args = [
        RawArg::Ptr(slice_address(x.device(OP, "x")?)),
        RawArg::Ptr(slice_address(norm_w.device(OP, "norm_w")?)),
        RawArg::Ptr(slice_address(base.device(OP, "base")?)),
        RawArg::Ptr(raw_p),
        RawArg::Ptr(raw_p + 4 * inc as u64),
        RawArg::Ptr(slice_address(prepared.device_mut(OP, "prepared")?)),
        RawArg::Ptr(slice_address(finish_delta.device_mut(OP, "finish_delta")?)),
        RawArg::I32(cols_i),
        RawArg::I32(hidden_i),
    ];
    // SAFETY: argument types and count match dynamic_grouped_conv_apply_kernel; lengths
    // checked by `prepare` (raw: inc increments, then the inverse RMS words); the split
    // kernel and the GEMM above wrote every increment and inverse RMS this kernel reads, and
    // every thread calls df_pdl_wait before it reads or writes anything.
    unsafe {
        c.launch_ex(
            &f,
            cfg,
            &mut args,
            "dynamic_grouped_conv_apply_kernel",
            true,
            1,
        )
    }
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
    let (cols_i, hidden_i) = (p.cols as i32, p.hidden as i32);
    let cfg = LaunchConfig {
        grid_dim: (
            (p.rows * p.cols) as u32,
            p.hidden.div_ceil(BLOCK_CHANNELS) as u32,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut args = [
        RawArg::Ptr(slice_address(z.device(OP, "z")?)),
        RawArg::Ptr(slice_address(finish_delta.device(OP, "finish_delta")?)),
        RawArg::Ptr(slice_address(base.device(OP, "base")?)),
        RawArg::Ptr(slice_address(residual.device(OP, "residual")?)),
        RawArg::Ptr(slice_address(out.device_mut(OP, "out")?)),
        RawArg::I32(cols_i),
        RawArg::I32(hidden_i),
    ];
    // SAFETY: argument types and count match dynamic_grouped_conv_finish_kernel; lengths
    // checked by `finish`; every thread calls df_pdl_wait before it reads or writes anything.
    unsafe {
        c.launch_ex(
            &f,
            cfg,
            &mut args,
            "dynamic_grouped_conv_finish_kernel",
            true,
            1,
        )
    }
}
