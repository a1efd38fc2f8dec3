//! CUDA launcher of `l2_prefetch` (kernels/l2_prefetch.cu).

use cudarc::driver::DevicePtr;

use crate::cuda::{CudaBackend, RawArg};
use crate::{Buffer, Element, OpsError, Result};

use super::{BLOCK_THREADS, OP, Plan};

pub(crate) const SOURCE: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../kernels/l2_prefetch.cu"
));

pub(super) fn run<T: Element>(c: &CudaBackend, buf: &Buffer<T>, p: &Plan) -> Result<()> {
    // Checked before the empty plan returns: a host buffer is an error at any size.
    let dev = buf.device(OP, "buf")?;
    if p.blocks == 0 {
        // Nothing is read, so an empty view may start anywhere.
        return Ok(());
    }
    let address = buf.address();
    if !address.is_multiple_of(16) {
        return Err(OpsError::Param {
            op: OP,
            param: "buf",
            expected: "a device buffer starting 16-byte aligned".into(),
            found: format!("address {address:#x}"),
        });
    }
    // A grid's x dimension holds at most 2^31 - 1 blocks.
    let blocks = u32::try_from(p.blocks)
        .ok()
        .filter(|&b| b <= i32::MAX as u32)
        .ok_or_else(|| OpsError::Param {
            op: OP,
            param: "max_bytes",
            expected: format!("at most {} chunks", i32::MAX as u64 * BLOCK_THREADS as u64),
            found: p.chunks.to_string(),
        })?;
    let kernel = c.kernel(OP, SOURCE, "l2_prefetch_kernel", BLOCK_THREADS as u32, 0)?;
    let (ptr, _guard) = dev.device_ptr(c.stream());
    let mut args = [RawArg::Ptr(ptr), RawArg::I64(p.bytes as i64)];
    let cfg = cudarc::driver::LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match l2_prefetch_kernel (a pointer, an unsigned long long);
    // `p.bytes` is at most the buffer's size, so every prefetched byte lies inside the live
    // allocation `ptr` points into (a prefetch reads nothing into the program and writes
    // nothing); the kernel calls df_pdl_wait in every thread before it exits.
    unsafe { c.launch_ex(&kernel.func, cfg, &mut args, "l2_prefetch_kernel", true, 1) }
}
