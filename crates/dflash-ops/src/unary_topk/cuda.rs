//! CUDA launcher of `unary_topk`: the fused head GEMM of `proposal_argmax` with the top-16
//! epilogue (kernels/proposal_argmax.cu followed by kernels/unary_topk.cu as one module), then
//! the merge of the per-block lists.

use std::sync::OnceLock;

use cudarc::driver::{LaunchConfig, PushKernelArg};
use half::bf16;

use super::{FLOOR_WORDS, OP, Params, TOP_K};
use crate::cuda::{CudaBackend, cuda_err};
use crate::proposal_argmax::cuda::SOURCE as SHARED;
use crate::proposal_argmax::head::{self, HeadKernels, cuda::launch_gemm};
use crate::{Buffer, Result};

/// Threads of a merge block (`UT_MERGE_THREADS`, its launch bound).
const MERGE_THREADS: u32 = 512;

const OWN: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../kernels/unary_topk.cu"
));

/// The module source: the shared head GEMM driver, then this op's epilogue (built once).
pub(crate) fn source() -> &'static str {
    static SRC: OnceLock<String> = OnceLock::new();
    SRC.get_or_init(|| format!("{SHARED}\n{OWN}"))
}

/// Module name of the sm_90a (wgmma) variant.
pub(crate) const SM90A_MODULE: &str = "unary_topk.sm_90a";

/// Source of the sm_90a variant: [`source`] compiled with `PH_WGMMA`.
pub(crate) fn sm90a_source() -> &'static str {
    static SRC: OnceLock<String> = OnceLock::new();
    SRC.get_or_init(|| format!("#define PH_WGMMA 1\n{}", source()))
}

fn kernels() -> HeadKernels {
    HeadKernels {
        op: OP,
        source: source(),
        sm90a_module: SM90A_MODULE,
        sm90a_source: sm90a_source(),
        names: [
            "unary_topk_gemm_nt1",
            "unary_topk_gemm_nt2",
            "unary_topk_gemm_nt4",
            "unary_topk_gemm_nt8",
            "unary_topk_gemm_nt16",
        ],
        epilogue: super::EPILOGUE,
    }
}

pub(super) fn run(
    c: &CudaBackend,
    hidden: &Buffer<bf16>,
    head_w: &Buffer<bf16>,
    token_ids: Option<&Buffer<i32>>,
    scores: &mut Buffer<f32>,
    ids: &mut Buffer<i32>,
    workspace: &mut Buffer<f32>,
    p: &Params,
) -> Result<()> {
    // The per-column floor keys start at zero (no floor) in every launch.
    let floors = head::partial_len(p, TOP_K);
    let ws = workspace.device_mut(OP, "workspace")?;
    c.stream()
        .memset_zeros(&mut ws.slice_mut(floors..floors + p.n * FLOOR_WORDS))
        .map_err(cuda_err("clearing the unary_topk floor keys"))?;
    let blocks = launch_gemm(c, &kernels(), hidden, head_w, token_ids, workspace, p)?;
    let f = c.function(OP, source(), "unary_topk_merge")?;
    let cfg = LaunchConfig {
        grid_dim: (p.n as u32, 1, 1),
        block_dim: (MERGE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let parts = blocks as i32;
    let mut b = c.stream().launch_builder(&f);
    b.arg(workspace.device(OP, "workspace")?);
    b.arg(scores.device_mut(OP, "scores")?);
    b.arg(ids.device_mut(OP, "ids")?);
    b.arg(&parts);
    // SAFETY: argument types and order match unary_topk_merge (launched with its launch
    // bound's thread count, which it assumes); the GEMM above wrote `blocks` lists of 16 partials
    // for each of the n columns; scores and ids have 16n elements.
    unsafe { b.launch(cfg) }.map_err(cuda_err("launching unary_topk_merge"))?;
    Ok(())
}
