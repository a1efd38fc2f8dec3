//! CUDA launcher of `rms_norm` (kernels/rms_norm.cu); also used by `feature_projection`.

use cudarc::driver::{CudaSlice, LaunchConfig};
use half::bf16;

use crate::cuda::{CudaBackend, RawArg, eight_wide_threads, kernel_int, slice_address, vec_ok};
use crate::{Element, Result};

use super::{OP, RowMap};

pub(crate) const SOURCE: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../kernels/rms_norm.cu"
));

/// Threads per row block of the one-element-a-step form.
const THREADS: u32 = 256;

/// An input element type of the norm kernels.
pub(crate) trait RmsInput: Element {
    /// The kernel reading this input type.
    const KERNEL: &'static str;
}

impl RmsInput for bf16 {
    const KERNEL: &'static str = "rms_norm_bf16";
}

impl RmsInput for f32 {
    const KERNEL: &'static str = "rms_norm_f32";
}

/// One block per row (8 elements a thread and step with `vec`: one step for rows up to 8192
/// elements; else [`THREADS`]), and `h` as the kernels' int; None when there is no work.
fn row_config(
    caller: &'static str,
    rows: usize,
    h: usize,
    vec: bool,
) -> Result<Option<(LaunchConfig, i32)>> {
    if rows == 0 || h == 0 {
        return Ok(None);
    }
    let grid = kernel_int(caller, "rows", rows)? as u32;
    let h_i = kernel_int(caller, "hidden", h)?;
    let threads = if vec { eight_wide_threads(h) } else { THREADS };
    let cfg = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    Ok(Some((cfg, h_i)))
}

/// Queue the norm of `rows` rows of `h` elements: `y = bf16_rne(w * x / sqrt(mean(x^2)+eps))`,
/// output row i from x row `map.source(i)`. The caller has checked `x` holds every source row,
/// `w.len() >= h`, `y.len() >= rows*h` and the map ([`RowMap::check`]); `caller` names the op
/// in errors.
pub(crate) fn launch<T: RmsInput>(
    c: &CudaBackend,
    caller: &'static str,
    x: &CudaSlice<T>,
    w: &CudaSlice<bf16>,
    y: &mut CudaSlice<bf16>,
    rows: usize,
    h: usize,
    eps: f32,
    map: &RowMap,
) -> Result<()> {
    let (group, stride, offset) = (
        kernel_int(caller, "map.group", map.group)?,
        kernel_int(caller, "map.stride", map.stride)?,
        kernel_int(caller, "map.offset", map.offset)?,
    );
    let vec = vec_ok(h, &[slice_address(x), slice_address(w), slice_address(y)]);
    let Some((cfg, h_i)) = row_config(caller, rows, h, vec)? else {
        return Ok(());
    };
    let f = c.function(OP, SOURCE, T::KERNEL)?;
    let mut args = [
        RawArg::Ptr(slice_address(x)),
        RawArg::Ptr(slice_address(w)),
        RawArg::Ptr(slice_address(y)),
        RawArg::I32(h_i),
        RawArg::F32(eps),
        RawArg::I32(i32::from(vec)),
        RawArg::I32(group),
        RawArg::I32(stride),
        RawArg::I32(offset),
    ];
    // SAFETY: argument types and order match rms_norm_bf16 / rms_norm_f32; the caller checked
    // every length and the map (every source row lies in x); each block writes only its own
    // output row; every thread calls df_pdl_wait before it reads or writes anything.
    unsafe { c.launch_ex(&f, cfg, &mut args, T::KERNEL, true, 1) }
}

/// Queue the residual form: `x <- bf16_rne(x + delta)`, `y = norm(x)`, over `rows` rows of
/// `h` elements (lengths checked by the caller).
pub(super) fn launch_residual(
    c: &CudaBackend,
    x: &mut CudaSlice<bf16>,
    delta: &CudaSlice<bf16>,
    w: &CudaSlice<bf16>,
    y: &mut CudaSlice<bf16>,
    rows: usize,
    h: usize,
    eps: f32,
) -> Result<()> {
    let vec = vec_ok(
        h,
        &[
            slice_address(x),
            slice_address(delta),
            slice_address(w),
            slice_address(y),
        ],
    );
    let Some((cfg, h_i)) = row_config(OP, rows, h, vec)? else {
        return Ok(());
    };
    let f = c.function(OP, SOURCE, "rms_norm_residual_bf16")?;
    let mut args = [
        RawArg::Ptr(slice_address(x)),
        RawArg::Ptr(slice_address(delta)),
        RawArg::Ptr(slice_address(w)),
        RawArg::Ptr(slice_address(y)),
        RawArg::I32(h_i),
        RawArg::F32(eps),
        RawArg::I32(i32::from(vec)),
    ];
    // SAFETY: argument types and order match rms_norm_residual_bf16; the caller checked every
    // length; each block reads and writes only its own row of x, delta and y; every thread
    // calls df_pdl_wait before it reads or writes anything.
    unsafe { c.launch_ex(&f, cfg, &mut args, "rms_norm_residual_bf16", true, 1) }
}
