//! CUDA launcher of `proposal_argmax`: the fused head GEMM with the argmax epilogue
//! (kernels/proposal_argmax.cu, launched through [`super::head::cuda::launch_gemm`]), then
//! the merge of the per-block partials.

use std::sync::OnceLock;

use cudarc::driver::{LaunchConfig, PushKernelArg};
use half::bf16;

use super::head::{HeadKernels, cuda::launch_gemm};
use super::{OP, Params};
use crate::cuda::{CudaBackend, cuda_err};
use crate::{Buffer, Result};

/// Source of the fused head GEMM driver and the argmax epilogue and merge.
pub(crate) const SOURCE: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../kernels/proposal_argmax.cu"
));

/// Module name of the sm_90a (wgmma) variant.
pub(crate) const SM90A_MODULE: &str = "proposal_argmax.sm_90a";

/// Source of the sm_90a variant: [`SOURCE`] compiled with `PH_WGMMA`.
pub(crate) fn sm90a_source() -> &'static str {
    static SRC: OnceLock<String> = OnceLock::new();
    SRC.get_or_init(|| format!("#define PH_WGMMA 1\n{SOURCE}"))
}

fn kernels() -> HeadKernels {
    HeadKernels {
        op: OP,
        source: SOURCE,
        sm90a_module: SM90A_MODULE,
        sm90a_source: sm90a_source(),
        names: [
            "proposal_argmax_gemm_nt1",
            "proposal_argmax_gemm_nt2",
            "proposal_argmax_gemm_nt4",
            "proposal_argmax_gemm_nt8",
            "proposal_argmax_gemm_nt16",
        ],
        epilogue: super::EPILOGUE,
    }
}

/// Shapes were validated by `super::run` (n >= 1).
pub(super) fn run(
    c: &CudaBackend,
    hidden: &Buffer<bf16>,
    head_w: &Buffer<bf16>,
    token_ids: Option<&Buffer<i32>>,
    ids: &mut Buffer<i32>,
    workspace: &mut Buffer<f32>,
    p: &Params,
) -> Result<()> {
    let blocks = launch_gemm(c, &kernels(), hidden, head_w, token_ids, workspace, p)?;
    let f = c.function(OP, SOURCE, "proposal_argmax_merge")?;
    let cfg = LaunchConfig {
        grid_dim: (p.n as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let parts = blocks as i32;
    let mut b = c.stream().launch_builder(&f);
    b.arg(workspace.device(OP, "workspace")?);
    b.arg(ids.device_mut(OP, "ids")?);
    b.arg(&parts);
    // SAFETY: argument types and order match proposal_argmax_merge; the GEMM above wrote
    // `blocks` partials for each of the n columns; ids has n elements.
    unsafe { b.launch(cfg) }.map_err(cuda_err("launching proposal_argmax_merge"))?;
    Ok(())
}
