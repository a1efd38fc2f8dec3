//! CUDA launcher of `softmax_attention` (kernels/softmax_attention.cu), and the launch
//! helpers shared with `sliding_window_attention` (whose module compiles the same bodies).

use cudarc::driver::{LaunchConfig, PushKernelArg};
use half::{bf16, f16};

use super::attend::Geometry;
use super::{FullAttentionParams, OP, split_count};
use crate::cuda::{CudaBackend, cuda_err};
use crate::{Buffer, OpsError, Result};

/// Source of the full layer's kernels and of the shared device bodies.
pub(crate) const SOURCE: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../kernels/softmax_attention.cu"
));

/// Most warps per split block (one warp per (column, head) item, looping when there are more).
const MAX_WARPS: usize = 16;

/// Threads of the merge block.
const MERGE_THREADS: u32 = 256;

/// Launch configuration of a split kernel: grid (splits, Hkv, rows), 32 x min(G*cols, 16)
/// threads. Refuses shapes the grid cannot express (checked before any launch).
pub(crate) fn split_config(op: &'static str, g: &Geometry, splits: usize) -> Result<LaunchConfig> {
    let limit = 65_535usize;
    if g.kv_heads > limit || g.rows > limit {
        return Err(OpsError::Param {
            op,
            param: "rows/kv_heads",
            expected: format!("rows and kv_heads <= {limit} on CUDA (grid y/z)"),
            found: format!("rows {}, kv_heads {}", g.rows, g.kv_heads),
        });
    }
    let warps = g.group().saturating_mul(g.cols).clamp(1, MAX_WARPS);
    Ok(LaunchConfig {
        grid_dim: (splits as u32, g.kv_heads as u32, g.rows as u32),
        block_dim: (32 * warps as u32, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// Launch configuration of a merge kernel: one block per (row, column).
pub(crate) fn merge_config(op: &'static str, g: &Geometry) -> Result<LaunchConfig> {
    let blocks = g
        .rows
        .checked_mul(g.cols)
        .filter(|&b| b <= i32::MAX as usize);
    let Some(blocks) = blocks else {
        return Err(OpsError::Param {
            op,
            param: "rows*cols",
            expected: "rows * cols <= i32::MAX on CUDA".into(),
            found: format!("{} x {}", g.rows, g.cols),
        });
    };
    Ok(LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (MERGE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// Launch the merge kernel `name` of module `module` (compiled from `source`).
pub(crate) fn launch_merge(
    c: &CudaBackend,
    op: &'static str,
    source: &str,
    name: &'static str,
    cfg: LaunchConfig,
    g: &Geometry,
    splits: usize,
    workspace: &Buffer<f32>,
    live: &Buffer<i32>,
    out: &mut Buffer<bf16>,
) -> Result<()> {
    let f = c.function(op, source, name)?;
    let (rows, cols, hq, d, sp) = (
        g.rows as i32,
        g.cols as i32,
        g.q_heads as i32,
        g.head_dim as i32,
        splits as i32,
    );
    let mut b = c.stream().launch_builder(&f);
    b.arg(workspace.device(op, "workspace")?);
    b.arg(live.device(op, "live")?);
    b.arg(out.device_mut(op, "out")?);
    b.arg(&rows);
    b.arg(&cols);
    b.arg(&hq);
    b.arg(&d);
    b.arg(&sp);
    // SAFETY: argument types and order match attn merge kernels; lengths checked by `run`
    // (workspace >= workspace_len, out = rows*cols*Hq*D, live = rows).
    unsafe { b.launch(cfg) }.map_err(cuda_err(format!("launching {name}")))?;
    Ok(())
}

pub(super) fn run(
    c: &CudaBackend,
    q: &Buffer<bf16>,
    k_blk: &Buffer<bf16>,
    v_blk: &Buffer<bf16>,
    pages_k: &Buffer<bf16>,
    pages_v: &Buffer<f16>,
    page_table: &Buffer<i32>,
    start_pos: &Buffer<i32>,
    live: &Buffer<i32>,
    out: &mut Buffer<bf16>,
    workspace: &mut Buffer<f32>,
    p: &FullAttentionParams,
) -> Result<()> {
    let g = p.geometry();
    let splits = split_count(p);
    let split_cfg = split_config(OP, &g, splits)?;
    let merge_cfg = merge_config(OP, &g)?;
    let f = c.function(OP, SOURCE, "softmax_attention_split")?;
    // All shapes were checked to fit in i32 by `run`.
    let (rows, cols, hq, hkv, d) = (
        p.rows as i32,
        p.cols as i32,
        p.q_heads as i32,
        p.kv_heads as i32,
        p.head_dim as i32,
    );
    let (pages, ps, mp, sp) = (
        p.pages as i32,
        p.page_size as i32,
        p.max_pages as i32,
        splits as i32,
    );
    {
        let mut b = c.stream().launch_builder(&f);
        b.arg(q.device(OP, "q")?);
        b.arg(k_blk.device(OP, "k_blk")?);
        b.arg(v_blk.device(OP, "v_blk")?);
        b.arg(pages_k.device(OP, "pages_k")?);
        b.arg(pages_v.device(OP, "pages_v")?);
        b.arg(page_table.device(OP, "page_table")?);
        b.arg(start_pos.device(OP, "start_pos")?);
        b.arg(live.device(OP, "live")?);
        b.arg(workspace.device_mut(OP, "workspace")?);
        b.arg(&rows);
        b.arg(&cols);
        b.arg(&hq);
        b.arg(&hkv);
        b.arg(&d);
        b.arg(&pages);
        b.arg(&ps);
        b.arg(&mp);
        b.arg(&sp);
        // SAFETY: argument types and order match softmax_attention_split; every length was
        // checked by `run`; the kernel clamps device metadata so it stays in bounds.
        unsafe { b.launch(split_cfg) }.map_err(cuda_err("launching softmax_attention_split"))?;
    }
    launch_merge(
        c,
        OP,
        SOURCE,
        "softmax_attention_merge",
        merge_cfg,
        &g,
        splits,
        workspace,
        live,
        out,
    )
}
