//! CUDA launcher of `sliding_window_attention` (kernels/sliding_window_attention.cu, compiled
//! after kernels/softmax_attention.cu, whose shared split and merge bodies it instantiates).

use std::sync::OnceLock;

use cudarc::driver::PushKernelArg;
use half::{bf16, f16};

use super::{LocalAttentionParams, OP, split_count};
use crate::cuda::{CudaBackend, cuda_err};
use crate::softmax_attention::cuda::{SOURCE as SHARED, launch_merge, merge_config, split_config};
use crate::{Buffer, Result};

const OWN: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../kernels/sliding_window_attention.cu"
));

/// The module source: the shared bodies, then this op's entry points (built once).
fn source() -> &'static str {
    static SRC: OnceLock<String> = OnceLock::new();
    SRC.get_or_init(|| format!("{SHARED}\n{OWN}"))
}

pub(super) fn run(
    c: &CudaBackend,
    q: &Buffer<bf16>,
    k_blk: &Buffer<bf16>,
    v_blk: &Buffer<bf16>,
    ring_k: &Buffer<bf16>,
    ring_v: &Buffer<f16>,
    lanes: &Buffer<i32>,
    start_pos: &Buffer<i32>,
    live: &Buffer<i32>,
    out: &mut Buffer<bf16>,
    workspace: &mut Buffer<f32>,
    p: &LocalAttentionParams,
) -> Result<()> {
    let g = p.geometry();
    let splits = split_count(p);
    let split_cfg = split_config(OP, &g, splits)?;
    let merge_cfg = merge_config(OP, &g)?;
    let f = c.function(OP, source(), "sliding_window_attention_split")?;
    // All shapes were checked to fit in i32 by `run`.
    let (rows, cols, hq, hkv, d) = (
        p.rows as i32,
        p.cols as i32,
        p.q_heads as i32,
        p.kv_heads as i32,
        p.head_dim as i32,
    );
    let (n_lanes, window, sp) = (p.lanes as i32, p.window as i32, splits as i32);
    {
        let mut b = c.stream().launch_builder(&f);
        b.arg(q.device(OP, "q")?);
        b.arg(k_blk.device(OP, "k_blk")?);
        b.arg(v_blk.device(OP, "v_blk")?);
        b.arg(ring_k.device(OP, "ring_k")?);
        b.arg(ring_v.device(OP, "ring_v")?);
        b.arg(lanes.device(OP, "lanes")?);
        b.arg(start_pos.device(OP, "start_pos")?);
        b.arg(live.device(OP, "live")?);
        b.arg(workspace.device_mut(OP, "workspace")?);
        b.arg(&rows);
        b.arg(&cols);
        b.arg(&hq);
        b.arg(&hkv);
        b.arg(&d);
        b.arg(&n_lanes);
        b.arg(&window);
        b.arg(&sp);
        // SAFETY: argument types and order match sliding_window_attention_split; every length
        // was checked by `run`; the kernel clamps device metadata so it stays in bounds.
        unsafe { b.launch(split_cfg) }
            .map_err(cuda_err("launching sliding_window_attention_split"))?;
    }
    launch_merge(
        c,
        OP,
        source(),
        "sliding_window_attention_merge",
        merge_cfg,
        &g,
        splits,
        workspace,
        live,
        out,
    )
}
