//! CUDA launcher of `context_kv_materialize` (kernels/context_kv_materialize.cu, prefixed by
//! kernels/head_norm_rope.cu's device code, its entry points left out): two GEMMs (the gemm
//! helper) into the F32 scratch, then one store kernel.

use cudarc::driver::{LaunchConfig, PushKernelArg};
use half::{bf16, f16};

use crate::cuda::{CudaBackend, cuda_err, kernel_int};
use crate::gemm::cuda::{DeviceGemm, gemm_bf16_device};
use crate::{Buffer, OpsError, Result};

use super::{CacheLayout, MaterializeParams, OP};

pub(crate) const SOURCE: &str = concat!(
    "#define HNR_DEVICE_ONLY\n",
    include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../kernels/head_norm_rope.cu"
    )),
    "\n",
    include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../kernels/context_kv_materialize.cu"
    ))
);

/// Warps (items) per block of the store kernel.
const WARPS_PER_BLOCK: usize = 4;

fn int(param: &'static str, v: usize) -> Result<i32> {
    kernel_int(OP, param, v)
}

#[allow(clippy::too_many_arguments)] // reason: the op's tensor list plus its workspace
pub(super) fn run(
    c: &CudaBackend,
    features: &Buffer<bf16>,
    w_k: &Buffer<bf16>,
    w_v: &Buffer<bf16>,
    key_norm: &Buffer<bf16>,
    start_pos: &Buffer<i32>,
    counts: &Buffer<i32>,
    slots: &Buffer<i32>,
    cache_k: &mut Buffer<bf16>,
    cache_v: &mut Buffer<f16>,
    scratch: &mut Buffer<f32>,
    p: &MaterializeParams,
) -> Result<()> {
    let n_cols = p.rows * p.cols; // validated products
    let kvd = p.kv_heads * p.head_dim;
    let items = n_cols * p.kv_heads;
    if items == 0 {
        return Ok(());
    }
    let (paged, units, unit_len, max_pages) = match p.layout {
        CacheLayout::Ring { lanes, capacity } => (0i32, lanes, capacity, 0),
        CacheLayout::Paged {
            pages,
            page_size,
            max_pages,
        } => (1i32, pages, page_size, max_pages),
    };
    let rows = int("rows", p.rows)?;
    let cols = int("cols", p.cols)?;
    let kv_heads = int("kv_heads", p.kv_heads)?;
    let d = int("head_dim", p.head_dim)?;
    let units = int("lanes/pages", units)?;
    let unit_len = int("capacity/page_size", unit_len)?;
    let max_pages = int("max_pages", max_pages)?;
    let blocks = u32::try_from(items.div_ceil(WARPS_PER_BLOCK)).map_err(|_| OpsError::Param {
        op: OP,
        param: "rows*cols*kv_heads",
        expected: "at most 4 * u32::MAX warps".into(),
        found: items.to_string(),
    })?;

    let half = n_cols * kvd;
    let a = features.device(OP, "features")?;
    let s = scratch.device_mut(OP, "scratch")?;
    let g = DeviceGemm::contiguous(n_cols, kvd, p.hidden);
    gemm_bf16_device(
        c,
        OP,
        a,
        w_k.device(OP, "w_k")?,
        &mut s.slice_mut(0..half),
        &g,
    )?;
    gemm_bf16_device(
        c,
        OP,
        a,
        w_v.device(OP, "w_v")?,
        &mut s.slice_mut(half..2 * half),
        &g,
    )?;

    let f = c.function(OP, SOURCE, "context_kv_materialize_store")?;
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: ((32 * WARPS_PER_BLOCK) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let k_raw = s.slice(0..half);
    let v_raw = s.slice(half..2 * half);
    let mut b = c.stream().launch_builder(&f);
    b.arg(&k_raw);
    b.arg(&v_raw);
    b.arg(key_norm.device(OP, "key_norm")?);
    b.arg(start_pos.device(OP, "start_pos")?);
    b.arg(counts.device(OP, "counts")?);
    b.arg(slots.device(OP, "slots")?);
    b.arg(cache_k.device_mut(OP, "cache_k")?);
    b.arg(cache_v.device_mut(OP, "cache_v")?);
    b.arg(&rows);
    b.arg(&cols);
    b.arg(&kv_heads);
    b.arg(&d);
    b.arg(&paged);
    b.arg(&units);
    b.arg(&unit_len);
    b.arg(&max_pages);
    b.arg(&p.theta);
    b.arg(&p.eps);
    // SAFETY: argument types and order match context_kv_materialize_store; every buffer's
    // length was validated against the shapes (scratch >= scratch_len), and the kernel skips
    // any item whose device metadata is out of range.
    unsafe { b.launch(cfg) }.map_err(cuda_err("launching context_kv_materialize_store"))?;
    Ok(())
}
