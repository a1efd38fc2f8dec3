//! The one CUDA launcher of both attention ops (kernels/softmax_attention.cu, whose split and
//! merge bodies `sliding_window_attention` compiles with its own entry points): the ops differ
//! only in the [`AttnContext`] they pass.

use std::sync::OnceLock;

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig};
use half::{bf16, f16};

use super::attend::{self, Geometry};
use super::{FullAttentionParams, OP};
use crate::cuda::{CudaBackend, RawArg, SM90A};
use crate::{Buffer, OpsError, Result};

/// Source of the full layer's kernels and of the shared device bodies.
pub(crate) const SOURCE: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../kernels/softmax_attention.cu"
));

/// Module name of the full layer's sm_90a variant.
pub(crate) const SM90A_MODULE: &str = "softmax_attention.sm_90a";

/// Source of the full layer's sm_90a variant: [`SOURCE`] compiled with `ATTN_WGMMA` (its
/// `_d128` and `_d128_ks2` splits are the warpgroup-MMA forms, see [`attend::SplitForm`]).
pub(crate) fn sm90a_source() -> &'static str {
    static SRC: OnceLock<String> = OnceLock::new();
    SRC.get_or_init(|| wgmma_source(SOURCE))
}

/// A module source compiled as the sm_90a variant of an attention op.
pub(crate) fn wgmma_source(source: &str) -> String {
    format!("#define ATTN_WGMMA 1\n{source}")
}

/// The modules of one attention op: the portable one (compiled for the device's own
/// architecture) and the sm_90a variant (used for the split where [`attend::SplitForm`] is a
/// warpgroup form).
pub(crate) struct AttnModules {
    /// Portable module name (the op id) and source.
    pub(crate) module: &'static str,
    /// See [`Self::module`].
    pub(crate) source: &'static str,
    /// sm_90a module name and source.
    pub(crate) sm90a_module: &'static str,
    /// See [`Self::sm90a_module`].
    pub(crate) sm90a_source: &'static str,
}

/// Warps of a merge block (`ATTN_MERGE_WARPS`): the warps of one item (`_merge_s64`) or one
/// item each (`_merge_w8`, `_merge_w16`).
const MERGE_WARPS: u32 = 4;

/// Where a row's context lives: the only thing that differs between the two ops.
pub(crate) enum AttnContext<'a> {
    /// Full layer: a paged pool and per-row page tables.
    Paged {
        pages_k: &'a Buffer<bf16>,
        pages_v: &'a Buffer<f16>,
        page_table: &'a Buffer<i32>,
        pages: usize,
        page_size: usize,
        max_pages: usize,
    },
    /// Local layer: ring lanes of capacity `window` and the window itself.
    Ring {
        ring_k: &'a Buffer<bf16>,
        ring_v: &'a Buffer<f16>,
        lanes: &'a Buffer<i32>,
        n_lanes: usize,
        window: usize,
    },
}

/// The split entry point of `op` for padded head dim `dp`, with key-split pairs or not: the
/// names `ATTN_SPLIT_ENTRIES` instantiates (kernels/softmax_attention.cu), in its order.
fn split_name(op: &str, dp: usize, pairs: bool) -> &'static str {
    const FULL: [&str; 9] = [
        "softmax_attention_split_d16",
        "softmax_attention_split_d32",
        "softmax_attention_split_d64",
        "softmax_attention_split_d128",
        "softmax_attention_split_d256",
        "softmax_attention_split_d16_ks2",
        "softmax_attention_split_d32_ks2",
        "softmax_attention_split_d64_ks2",
        "softmax_attention_split_d128_ks2",
    ];
    const RING: [&str; 9] = [
        "sliding_window_attention_split_d16",
        "sliding_window_attention_split_d32",
        "sliding_window_attention_split_d64",
        "sliding_window_attention_split_d128",
        "sliding_window_attention_split_d256",
        "sliding_window_attention_split_d16_ks2",
        "sliding_window_attention_split_d32_ks2",
        "sliding_window_attention_split_d64_ks2",
        "sliding_window_attention_split_d128_ks2",
    ];
    let i = [16, 32, 64, 128, 256]
        .iter()
        .position(|&d| d == dp)
        .unwrap_or(4);
    // `_ks2` entries exist only for dp <= 128 (see `SplitForm::choose`).
    let i = if pairs && i < 4 { 5 + i } else { i };
    if op == "softmax_attention" {
        FULL[i]
    } else {
        RING[i]
    }
}

/// The merge entry point of `op` for `splits` launched splits and its items per block: the
/// names `ATTN_MERGE_ENTRIES` instantiates. `_merge_w8` / `_merge_w16` (a warp per item,
/// [`MERGE_WARPS`] items per block, at most 8 / 16 splits: calls with few splits keep many
/// items' loads in flight per SM) or `_merge_s64` (a block per item, its warps sharing the
/// splits, up to [`attend::MAX_SPLITS`]).
fn merge_entry(op: &str, splits: usize) -> (&'static str, u32) {
    let full = op == OP;
    match splits {
        0..=8 if full => ("softmax_attention_merge_w8", MERGE_WARPS),
        0..=8 => ("sliding_window_attention_merge_w8", MERGE_WARPS),
        9..=16 if full => ("softmax_attention_merge_w16", MERGE_WARPS),
        9..=16 => ("sliding_window_attention_merge_w16", MERGE_WARPS),
        _ if full => ("softmax_attention_merge_s64", 1),
        _ => ("sliding_window_attention_merge_s64", 1),
    }
}

/// The tensors of one attention call besides the context.
pub(crate) struct AttnCall<'a> {
    pub(crate) q: &'a Buffer<bf16>,
    pub(crate) k_blk: &'a Buffer<bf16>,
    pub(crate) v_blk: &'a Buffer<bf16>,
    pub(crate) start_pos: &'a Buffer<i32>,
    pub(crate) live: &'a Buffer<i32>,
}

/// Launch the split kernel `{op}_split_d{DP}` or `_d{DP}_ks2` of the form
/// [`attend::SplitForm::choose`] picks (from the sm_90a module for the warpgroup forms, else
/// from the portable one; threads, shared memory and tile keys from the form) and the merge
/// `{op}_merge_w8`, `_w16` or `_s64` (see [`merge_entry`]) from the portable module. Shapes
/// were validated by the op's `run`.
///
/// Grid of the split: (Hkv * row_blocks, rows, splits), a split-major block order (every
/// item's split 0 first, so the blocks with work spread evenly over the SMs), with row_blocks
/// = ceil(G * cols / 64) and splits = [`attend::launched_splits`] for the device's resident
/// blocks of that kernel: the batch plus its splits fill the device once, never more than the
/// workspace was sized for. Each row then uses only the splits its visible key range needs
/// (the others exit at once).
pub(crate) fn launch(
    c: &CudaBackend,
    modules: &AttnModules,
    g: &Geometry,
    key_capacity: usize,
    ctx: &AttnContext<'_>,
    t: &AttnCall<'_>,
    out: &mut Buffer<bf16>,
    workspace: &mut Buffer<f32>,
) -> Result<()> {
    let (op, source) = (modules.module, modules.source);
    let dp = attend::padded_head_dim(g.head_dim);
    // The split's form (its module: the sm_90a variant or the portable one); the merge always
    // comes from the portable module.
    let form = attend::SplitForm::choose(g, c.uses_sm90a(), c.limits().sm_count, key_capacity);
    let name = split_name(op, dp, form.key_split());
    let (smem, threads) = (form.smem_bytes(dp), form.threads());
    let kernel = if form.sm90a() {
        let (m, src) = (modules.sm90a_module, modules.sm90a_source);
        c.kernel_for(m, Some(SM90A), src, name, threads, smem)?
    } else {
        c.kernel(op, source, name, threads, smem)?
    };
    let row_blocks = (g.group() * g.cols).div_ceil(attend::BLOCK_QUERY_ROWS);
    let limit = 65_535usize;
    let grid_y = g.kv_heads.saturating_mul(row_blocks);
    if grid_y > limit || g.rows > limit || g.cols > limit || g.q_heads > i32::MAX as usize {
        return Err(OpsError::Param {
            op,
            param: "rows/kv_heads/cols",
            expected: format!(
                "rows, cols and kv_heads * ceil(q_heads / kv_heads * cols / 64), rows and cols <= {limit} on CUDA"
            ),
            found: format!("rows {}, cols {}, grid y {grid_y}", g.rows, g.cols),
        });
    }
    // The kernels address context slots in 32 bits.
    let slots = match ctx {
        AttnContext::Paged {
            pages, page_size, ..
        } => pages.saturating_mul(*page_size),
        AttnContext::Ring {
            n_lanes, window, ..
        } => n_lanes.saturating_mul(*window),
    };
    if slots > i32::MAX as usize {
        return Err(OpsError::Param {
            op,
            param: "pages/lanes",
            expected:
                "at most 2^31 - 1 context slots (pages * page_size or lanes * window) on CUDA"
                    .into(),
            found: slots.to_string(),
        });
    }
    let resident = kernel.blocks_per_sm * c.limits().sm_count;
    let splits = attend::launched_splits(g, key_capacity, resident);
    // Split-major block order (kernels/softmax_attention.cu): the items in x, the splits in z.
    let split_cfg = LaunchConfig {
        grid_dim: (grid_y as u32, g.rows as u32, splits as u32),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    // All shapes were checked to fit in i32 by `run`.
    let (rows, cols, hq, hkv, d, sp, rb) = (
        g.rows as i32,
        g.cols as i32,
        g.q_heads as i32,
        g.kv_heads as i32,
        g.head_dim as i32,
        splits as i32,
        row_blocks as i32,
    );
    // Context scalars: paged (pages, page_size, max_pages); ring (n_lanes, window).
    let (ctx_k, ctx_v, map, scalars): (_, _, _, Vec<i32>) = match ctx {
        AttnContext::Paged {
            pages_k,
            pages_v,
            page_table,
            pages,
            page_size,
            max_pages,
        } => (
            pages_k.device(op, "pages_k")?,
            pages_v.device(op, "pages_v")?,
            page_table.device(op, "page_table")?,
            vec![*pages as i32, *page_size as i32, *max_pages as i32],
        ),
        AttnContext::Ring {
            ring_k,
            ring_v,
            lanes,
            n_lanes,
            window,
        } => (
            ring_k.device(op, "ring_k")?,
            ring_v.device(op, "ring_v")?,
            lanes.device(op, "lanes")?,
            vec![*n_lanes as i32, *window as i32],
        ),
    };
    let stream = c.stream();
    {
        let (q_p, _q) = t.q.device(op, "q")?.device_ptr(stream);
        let (kb_p, _kb) = t.k_blk.device(op, "k_blk")?.device_ptr(stream);
        let (vb_p, _vb) = t.v_blk.device(op, "v_blk")?.device_ptr(stream);
        let (ck_p, _ck) = ctx_k.device_ptr(stream);
        let (cv_p, _cv) = ctx_v.device_ptr(stream);
        let (map_p, _map) = map.device_ptr(stream);
        let (start_p, _start) = t.start_pos.device(op, "start_pos")?.device_ptr(stream);
        let (live_p, _live) = t.live.device(op, "live")?.device_ptr(stream);
        let (ws_p, _ws) = workspace
            .device_mut(op, "workspace")?
            .device_ptr_mut(stream);
        let mut split_args: Vec<RawArg> =
            [q_p, kb_p, vb_p, ck_p, cv_p, map_p, start_p, live_p, ws_p]
                .map(RawArg::Ptr)
                .into_iter()
                .chain([rows, cols, hq, hkv, d].map(RawArg::I32))
                .chain(scalars.iter().copied().map(RawArg::I32))
                .chain([sp, rb].map(RawArg::I32))
                .collect();
        // SAFETY: `split_args` matches the `{op}_split_d{DP}[_ks2]` entry points in order and
        // type (paged: pages, page_size, max_pages; ring: n_lanes, window); every length was
        // checked by `run` (workspace >= workspace_len, whose split bound covers `splits`);
        // the kernel clamps device metadata so it stays in bounds; the pointers' guards live
        // to the end of this block. Every split block calls df_pdl_wait before it reads
        // anything (its first statement), so the kernel ahead has finished by then.
        let dependent = form.dependent_launch();
        unsafe { c.launch_ex(&kernel.func, split_cfg, &mut split_args, name, dependent, 1) }?;
    }
    let (ws_p, _ws) = workspace.device(op, "workspace")?.device_ptr(stream);
    let (start_p, _start) = t.start_pos.device(op, "start_pos")?.device_ptr(stream);
    let (live_p, _live) = t.live.device(op, "live")?.device_ptr(stream);
    let (out_p, _out) = out.device_mut(op, "out")?.device_ptr_mut(stream);
    let (merge_name, items) = merge_entry(op, splits);
    let merge = c.function(op, source, merge_name)?;
    let merge_cfg = LaunchConfig {
        grid_dim: (
            (g.q_heads as u32).div_ceil(items),
            g.cols as u32,
            g.rows as u32,
        ),
        block_dim: (32 * MERGE_WARPS, 1, 1),
        shared_mem_bytes: 0,
    };
    let kt = form.tile_keys(dp) as i32;
    // The merge's parameters: (ws, start_pos, live, [lanes,] out) then (rows, cols, Hq, D,
    // [max_pages, page_size | n_lanes, window], splits, kt).
    let (lanes_p, ctx_ints) = match ctx {
        AttnContext::Paged {
            page_size,
            max_pages,
            ..
        } => (None, [*max_pages as i32, *page_size as i32]),
        AttnContext::Ring {
            lanes,
            n_lanes,
            window,
            ..
        } => (
            Some(lanes.device(op, "lanes")?.device_ptr(stream)),
            [*n_lanes as i32, *window as i32],
        ),
    };
    let mut merge_args: Vec<RawArg> = [ws_p, start_p, live_p]
        .into_iter()
        .chain(lanes_p.as_ref().map(|(p, _)| *p))
        .chain([out_p])
        .map(RawArg::Ptr)
        .chain([rows, cols, hq, d, ctx_ints[0], ctx_ints[1], sp, kt].map(RawArg::I32))
        .collect();
    // SAFETY: `merge_args` matches `{op}_merge_w8` / `_w16` / `_s64`
    // (kernels/softmax_attention.cu and sliding_window_attention.cu) in order and type;
    // lengths were checked by `run` (out = rows*cols*Hq*D, start_pos = live = lanes = rows,
    // workspace >= workspace_len); the pointers' guards live to the end of this function.
    // Before df_pdl_wait the merge reads only row metadata, which the split never writes and
    // whose writers finished before the split let the merge start (each split block triggers
    // only after its own df_pdl_wait); every block waits.
    unsafe { c.launch_ex(&merge, merge_cfg, &mut merge_args, merge_name, true, 1) }
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
    launch(
        c,
        &AttnModules {
            module: OP,
            source: SOURCE,
            sm90a_module: SM90A_MODULE,
            sm90a_source: sm90a_source(),
        },
        &p.geometry(),
        p.key_capacity(),
        &AttnContext::Paged {
            pages_k,
            pages_v,
            page_table,
            pages: p.pages,
            page_size: p.page_size,
            max_pages: p.max_pages,
        },
        &AttnCall {
            q,
            k_blk,
            v_blk,
            start_pos,
            live,
        },
        out,
        workspace,
    )
}
