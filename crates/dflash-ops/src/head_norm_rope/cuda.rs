//! CUDA launcher of `head_norm_rope` (kernels/head_norm_rope.cu).

use cudarc::driver::{LaunchConfig, PushKernelArg};
use half::bf16;

use crate::cuda::{CudaBackend, RawArg, cuda_err, kernel_int, slice_address};
use crate::{Buffer, Result};

use super::{HeadNormRopeParams, OP, QkvOut, QkvParams};

pub(crate) const SOURCE: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../kernels/head_norm_rope.cu"
));

/// Warps (one (row, col, head) item each) per block.
const WARPS_PER_BLOCK: usize = 4;

/// `v` as the kernels' int, or the op's error naming `param`.
fn int(param: &'static str, v: usize) -> Result<i32> {
    kernel_int(OP, param, v)
}

/// One warp per item, [`WARPS_PER_BLOCK`] warps a block.
fn warp_config(items: usize) -> Result<LaunchConfig> {
    let blocks = int("items / 4", items.div_ceil(WARPS_PER_BLOCK))? as u32;
    Ok(LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: ((32 * WARPS_PER_BLOCK) as u32, 1, 1),
        shared_mem_bytes: 0,
    })
}

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
    let (rows, cols) = (int("rows", p.rows)?, int("cols", p.cols)?);
    let (heads, d) = (int("heads", p.heads)?, int("head_dim", p.head_dim)?);
    let cfg = warp_config(items)?;
    let f = c.function(OP, SOURCE, "head_norm_rope_kernel")?;
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

/// The block's angle table (lengths checked by `rope_table`).
pub(super) fn table(
    c: &CudaBackend,
    start_pos: &Buffer<i32>,
    angles: &mut Buffer<f32>,
    p: &QkvParams,
) -> Result<()> {
    let n = angles.len();
    if n == 0 {
        return Ok(());
    }
    let (rows, cols, d) = (
        int("rows", p.rows)?,
        int("cols", p.cols)?,
        int("head_dim", p.head_dim)?,
    );
    let blocks = int("angles / 256", n.div_ceil(256))? as u32;
    let f = c.function(OP, SOURCE, "head_norm_rope_table")?;
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = c.stream().launch_builder(&f);
    b.arg(start_pos.device(OP, "start_pos")?);
    b.arg(angles.device_mut(OP, "angles")?);
    b.arg(&rows);
    b.arg(&cols);
    b.arg(&d);
    b.arg(&p.theta);
    // SAFETY: argument types and order match head_norm_rope_table; `angles` holds rows * cols
    // * d/2 elements and start_pos rows (checked by `rope_table`); one thread per element.
    unsafe { b.launch(cfg) }.map_err(cuda_err("launching head_norm_rope_table"))?;
    Ok(())
}

/// The fused Q/K/V form (lengths checked by `run_qkv`).
pub(super) fn qkv(
    c: &CudaBackend,
    qkv: &Buffer<f32>,
    q_norm: &Buffer<bf16>,
    k_norm: &Buffer<bf16>,
    angles: &Buffer<f32>,
    out: QkvOut<'_>,
    p: &QkvParams,
) -> Result<()> {
    let items = qkv.len() / p.head_dim; // tokens * (Hq + 2 Hkv), validated
    if items == 0 {
        return Ok(());
    }
    let tokens = int("rows*cols", p.rows * p.cols)?;
    let (hq, hkv, d) = (
        int("q_heads", p.q_heads)?,
        int("kv_heads", p.kv_heads)?,
        int("head_dim", p.head_dim)?,
    );
    // The kernel forms q_heads + 2 * kv_heads as an int.
    int("q_heads + 2 * kv_heads", p.q_heads + 2 * p.kv_heads)?;
    let cfg = warp_config(items)?;
    let f = c.function(OP, SOURCE, "head_norm_rope_qkv")?;
    let mut args = [
        RawArg::Ptr(slice_address(qkv.device(OP, "qkv")?)),
        RawArg::Ptr(slice_address(q_norm.device(OP, "q_norm")?)),
        RawArg::Ptr(slice_address(k_norm.device(OP, "k_norm")?)),
        RawArg::Ptr(slice_address(angles.device(OP, "angles")?)),
        RawArg::Ptr(slice_address(out.q.device_mut(OP, "q")?)),
        RawArg::Ptr(slice_address(out.k.device_mut(OP, "k")?)),
        RawArg::Ptr(slice_address(out.v.device_mut(OP, "v")?)),
        RawArg::I32(tokens),
        RawArg::I32(hq),
        RawArg::I32(hkv),
        RawArg::I32(d),
        RawArg::F32(p.eps),
    ];
    // SAFETY: argument types and order match head_norm_rope_qkv; every length validated by
    // `run_qkv`; each warp writes only its own head of q, k or v; every thread calls
    // df_pdl_wait before it reads or writes anything.
    unsafe { c.launch_ex(&f, cfg, &mut args, "head_norm_rope_qkv", true, 1) }
}
