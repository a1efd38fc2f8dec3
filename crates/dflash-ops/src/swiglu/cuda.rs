//! CUDA launcher of `swiglu` (kernels/swiglu.cu).

use cudarc::driver::LaunchConfig;

use crate::cuda::{CudaBackend, RawArg, kernel_int, slice_address};
use crate::{Buffer, Result, bf16};

use super::{OP, SwigluParams};

pub(crate) const SOURCE: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../kernels/swiglu.cu"
));

/// Element (r, c) of gate is `gate[r * stride + c]`, of up `up[up_off + r * stride + c]`.
pub(super) fn run(
    c: &CudaBackend,
    gate: &Buffer<bf16>,
    up: &Buffer<bf16>,
    up_off: usize,
    stride: usize,
    out: &mut Buffer<bf16>,
    p: &SwigluParams,
) -> Result<()> {
    if p.rows == 0 || p.inter == 0 {
        return Ok(());
    }
    let f = c.function(OP, SOURCE, "swiglu_kernel")?;
    let inter = kernel_int(OP, "inter", p.inter)?;
    let rows = kernel_int(OP, "rows", p.rows)? as u32;
    // 8 channels a thread; 16-byte accesses where every row start of every tensor is
    // 16-byte aligned (the allocations are).
    const PER_BLOCK: usize = 256 * 8;
    let aligned = |a: u64| a.is_multiple_of(16);
    let vec = i32::from(
        [p.inter, stride, up_off]
            .iter()
            .all(|v| v.is_multiple_of(8))
            && aligned(gate.address())
            && aligned(up.address())
            && aligned(out.address()),
    );
    let (stride_u64, off_u64) = (stride as u64, up_off as u64);
    let blocks_y = p.inter.div_ceil(PER_BLOCK);
    if blocks_y > 65_535 {
        return Err(crate::OpsError::Param {
            op: OP,
            param: "inter",
            expected: "at most 65535 * 2048 channels on CUDA".into(),
            found: p.inter.to_string(),
        });
    }
    let cfg = LaunchConfig {
        grid_dim: (rows, blocks_y as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut args = [
        RawArg::Ptr(slice_address(gate.device(OP, "gate")?)),
        RawArg::Ptr(slice_address(up.device(OP, "up")?)),
        RawArg::Ptr(slice_address(out.device_mut(OP, "out")?)),
        RawArg::I32(inter),
        RawArg::I64(stride_u64 as i64),
        RawArg::I64(off_u64 as i64),
        RawArg::I32(vec),
    ];
    // SAFETY: argument types and count match swiglu_kernel; lengths checked by the caller
    // (the largest index read is up_off + (rows - 1) * stride + inter - 1 < input length);
    // `vec` only where every 8-channel group starts 16-byte aligned; every thread calls
    // df_pdl_wait before it reads or writes anything.
    unsafe { c.launch_ex(&f, cfg, &mut args, "swiglu_kernel", true, 1) }
}
