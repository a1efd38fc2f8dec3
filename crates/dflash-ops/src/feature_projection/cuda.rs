//! CUDA path of `feature_projection`: the crate's GEMM helper into the F32 scratch, then the
//! `rms_norm` F32-input kernel (kernels/rms_norm.cu) on it.

use half::bf16;

use crate::cuda::CudaBackend;
use crate::gemm::cuda::{DeviceGemm, gemm_bf16_device};
use crate::{Buffer, Result};

use super::{FeatureProjectionParams, OP};

pub(super) fn run(
    c: &CudaBackend,
    s: &Buffer<bf16>,
    w_feature: &Buffer<bf16>,
    context_norm: &Buffer<bf16>,
    out: &mut Buffer<bf16>,
    scratch: &mut Buffer<f32>,
    p: &FeatureProjectionParams,
) -> Result<()> {
    let (t, h) = (p.tokens, p.hidden);
    let k = p.n_ids * h; // validated product
    if t == 0 {
        return Ok(());
    }
    let proj = scratch.device_mut(OP, "scratch")?;
    gemm_bf16_device(
        c,
        OP,
        s.device(OP, "s")?,
        w_feature.device(OP, "w_feature")?,
        &mut proj.slice_mut(0..t * h),
        &DeviceGemm::contiguous(t, h, k),
    )?;
    crate::rms_norm::cuda::launch(
        c,
        OP,
        proj,
        context_norm.device(OP, "context_norm")?,
        out.device_mut(OP, "c")?,
        t,
        h,
        p.eps,
        &crate::rms_norm::RowMap::IDENTITY,
    )
}
