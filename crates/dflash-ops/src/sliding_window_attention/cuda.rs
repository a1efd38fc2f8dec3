//! CUDA entry of `sliding_window_attention`: the shared attention launcher
//! ([`crate::softmax_attention::cuda::launch`]) with the ring as context map. The module is
//! kernels/softmax_attention.cu (the shared split and merge bodies) followed by
//! kernels/sliding_window_attention.cu (this op's entry points).

use std::sync::OnceLock;

use half::{bf16, f16};

use super::{LocalAttentionParams, OP};
use crate::cuda::CudaBackend;
use crate::softmax_attention::cuda::{
    AttnCall, AttnContext, AttnModules, SOURCE as SHARED, launch, wgmma_source,
};
use crate::{Buffer, Result};

const OWN: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../kernels/sliding_window_attention.cu"
));

/// The module source: the shared bodies, then this op's entry points (built once).
pub(crate) fn source() -> &'static str {
    static SRC: OnceLock<String> = OnceLock::new();
    SRC.get_or_init(|| format!("{SHARED}\n{OWN}"))
}

/// Module name of the sm_90a variant.
pub(crate) const SM90A_MODULE: &str = "sliding_window_attention.sm_90a";

/// Source of the sm_90a variant: [`source`] compiled with `ATTN_WGMMA`.
pub(crate) fn sm90a_source() -> &'static str {
    static SRC: OnceLock<String> = OnceLock::new();
    SRC.get_or_init(|| wgmma_source(source()))
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
    launch(
        c,
        &AttnModules {
            module: OP,
            source: source(),
            sm90a_module: SM90A_MODULE,
            sm90a_source: sm90a_source(),
        },
        &p.geometry(),
        p.key_capacity(),
        &AttnContext::Ring {
            ring_k,
            ring_v,
            lanes,
            n_lanes: p.lanes,
            window: p.window,
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
