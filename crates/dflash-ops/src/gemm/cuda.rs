//! CUDA path of `gemm`: the skinny kernel of `kernels/gemm.cu` for the few-row products on
//! small weights its plan takes (`plan::skinny_plan`), on sm_90a devices its wide kernel
//! (`plan::wide_plan`) for the other products of up to 128 rows, one `cublasGemmEx` (BF16
//! inputs, FP32 compute) otherwise, and the crate-wide device GEMM helper
//! [`gemm_bf16_device`] that other launchers call on slices or views.

use cudarc::cublas::sys;
use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;

use crate::cuda::{CudaBackend, Kernel, RawArg, SM90A, tensor_map};
use crate::{Buffer, Element, OpsError, Result};

use super::OP;
use super::plan::{
    SkinnyPlan, WIDE_KC, WIDE_MAX_SPLITS, WidePlan, skinny_plan, wide_plan, wide_splits,
};

pub(crate) const SOURCE: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../kernels/gemm.cu"
));

/// Module name of the sm_90a variant (the wide kernel beside the skinny one).
pub(crate) const SM90A_MODULE: &str = "gemm.sm_90a";

/// Source of the sm_90a variant: [`SOURCE`] compiled with `GEMM_WGMMA`.
pub(crate) fn sm90a_source() -> &'static str {
    static SRC: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SRC.get_or_init(|| format!("#define GEMM_WGMMA 1\n{SOURCE}"))
}

/// Threads of a wide block (`GW_THREADS`): the consumer warpgroup and the producer warp.
const WIDE_THREADS: u32 = 160;

/// An output element type cuBLAS can write from an FP32 accumulator (f32 or bf16).
pub(crate) trait GemmOutElem: Element {
    /// The cuBLAS data type of the output.
    const CUDA_TYPE: sys::cudaDataType_t;
    /// The skinny kernel's entry points for 1, 2 and 4 n8 tiles of A's rows.
    const SKINNY: [&'static str; 3];
    /// The wide kernel's entry points for 1, 2, 4, 8 and 16 n8 tiles of A's rows.
    const WIDE: [&'static str; 5];
}

impl GemmOutElem for f32 {
    const CUDA_TYPE: sys::cudaDataType_t = sys::cudaDataType_t::CUDA_R_32F;
    const SKINNY: [&'static str; 3] = [
        "gemm_skinny_nt1_f32",
        "gemm_skinny_nt2_f32",
        "gemm_skinny_nt4_f32",
    ];
    const WIDE: [&'static str; 5] = [
        "gemm_wide_nt1_f32",
        "gemm_wide_nt2_f32",
        "gemm_wide_nt4_f32",
        "gemm_wide_nt8_f32",
        "gemm_wide_nt16_f32",
    ];
}

impl GemmOutElem for bf16 {
    const CUDA_TYPE: sys::cudaDataType_t = sys::cudaDataType_t::CUDA_R_16BF;
    const SKINNY: [&'static str; 3] = [
        "gemm_skinny_nt1_bf16",
        "gemm_skinny_nt2_bf16",
        "gemm_skinny_nt4_bf16",
    ];
    const WIDE: [&'static str; 5] = [
        "gemm_wide_nt1_bf16",
        "gemm_wide_nt2_bf16",
        "gemm_wide_nt4_bf16",
        "gemm_wide_nt8_bf16",
        "gemm_wide_nt16_bf16",
    ];
}

/// Shape and strides of one device GEMM `C[i, j] (+)= sum_l A[i, l] * W[j, l]`, row-major:
/// row `i` of A starts at element `i * lda` of the A slice, row `j` of W at `j * ldw`, row `i`
/// of C at `i * ldc`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DeviceGemm {
    /// Rows of A and C.
    pub m: usize,
    /// Rows of W (= columns of C).
    pub n: usize,
    /// Reduction length.
    pub k: usize,
    /// Row stride of A in elements (>= k).
    pub lda: usize,
    /// Row stride of W in elements (>= k).
    pub ldw: usize,
    /// Row stride of C in elements (>= n).
    pub ldc: usize,
    /// `C += A W^T` (beta = 1) instead of `C = A W^T` (beta = 0, C not read).
    pub accumulate: bool,
}

impl DeviceGemm {
    /// Dense row-major operands (`lda = ldw = k`, `ldc = n`), overwriting C.
    pub(crate) fn contiguous(m: usize, n: usize, k: usize) -> Self {
        DeviceGemm {
            m,
            n,
            k,
            lda: k,
            ldw: k,
            ldc: n,
            accumulate: false,
        }
    }
}

fn blas_err(context: String) -> impl FnOnce(cudarc::cublas::result::CublasError) -> OpsError {
    move |e| OpsError::Cuda {
        context,
        message: e.to_string(),
    }
}

fn as_c_int(op: &'static str, what: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| OpsError::Param {
        op,
        param: what,
        expected: "at most i32::MAX (a cuBLAS dimension)".into(),
        found: v.to_string(),
    })
}

/// Elements a row-major operand of `rows` rows of `cols` used elements at stride `ld` spans.
fn span(rows: usize, cols: usize, ld: usize) -> Option<usize> {
    if rows == 0 {
        return Some(0);
    }
    (rows - 1).checked_mul(ld)?.checked_add(cols)
}

/// The device's SM count and per-block shared memory, as `skinny_plan` takes them.
fn device_limits(c: &CudaBackend) -> (usize, usize) {
    let l = c.limits();
    (l.sm_count, l.smem_per_block_optin)
}

/// Queue `C = A W^T` (or `C += A W^T`) on the backend's stream: BF16 A and W, FP32
/// accumulation (`CUBLAS_COMPUTE_32F`), output `T` (f32 unrounded, or bf16 rounded once, RNE).
///
/// `op` names the calling op in errors. `a`, `w`, `out` may be whole slices or views at any
/// offset. Refuses (without queueing anything) operands shorter than the strides imply,
/// strides below the row length, `k = 0` and dimensions above `i32::MAX`; `m = 0` or `n = 0`
/// queue nothing.
///
/// Row-major `C[m, n] = A[m, k] W[n, k]^T` is column-major `C^T[n, m] = op_T(W) A^T`: cuBLAS
/// is called with `transa = T` on W (column-major `[k, n]`, ld `ldw`), `transb = N` on A
/// (column-major `[k, m]`, ld `lda`) and C column-major `[n, m]` with ld `ldc`.
pub(crate) fn gemm_bf16_device<T, A, W, C>(
    c: &CudaBackend,
    op: &'static str,
    a: &A,
    w: &W,
    out: &mut C,
    g: &DeviceGemm,
) -> Result<()>
where
    T: GemmOutElem,
    A: DevicePtr<bf16>,
    W: DevicePtr<bf16>,
    C: DevicePtrMut<T>,
{
    let bad = |param: &'static str, expected: String, found: String| OpsError::Param {
        op,
        param,
        expected,
        found,
    };
    if g.m == 0 || g.n == 0 {
        return Ok(());
    }
    if g.k == 0 {
        return Err(bad("k", "k >= 1".into(), "0".into()));
    }
    if g.lda < g.k || g.ldw < g.k || g.ldc < g.n {
        return Err(bad(
            "gemm strides",
            format!("lda >= k, ldw >= k, ldc >= n (k = {}, n = {})", g.k, g.n),
            format!("lda {}, ldw {}, ldc {}", g.lda, g.ldw, g.ldc),
        ));
    }
    for (name, need, have) in [
        ("gemm A", span(g.m, g.k, g.lda), a.len()),
        ("gemm W", span(g.n, g.k, g.ldw), w.len()),
        ("gemm C", span(g.m, g.n, g.ldc), out.len()),
    ] {
        match need {
            Some(need) if need <= have => {}
            _ => {
                return Err(OpsError::Range {
                    op,
                    tensor: name,
                    start: 0,
                    end: need.unwrap_or(usize::MAX),
                    len: have,
                });
            }
        }
    }
    let (m, n, k) = (
        as_c_int(op, "m", g.m)?,
        as_c_int(op, "n", g.n)?,
        as_c_int(op, "k", g.k)?,
    );
    let (lda, ldw, ldc) = (
        as_c_int(op, "lda", g.lda)?,
        as_c_int(op, "ldw", g.ldw)?,
        as_c_int(op, "ldc", g.ldc)?,
    );
    let stream = c.stream();
    let (a_ptr, _ra) = a.device_ptr(stream);
    let (w_ptr, _rw) = w.device_ptr(stream);
    let (c_ptr, _rc) = out.device_ptr_mut(stream);
    let ptrs = (a_ptr, w_ptr, c_ptr);
    match own_plan(c, (g.m, g.n, g.k), (a_ptr, g.lda), (w_ptr, g.ldw)) {
        Some(OwnPlan::Skinny(plan)) => return launch_skinny::<T>(c, ptrs, (m, n, k), g, &plan),
        Some(OwnPlan::Wide(plan)) => {
            return launch_wide(c, T::WIDE[plan.tiles_log2], ptrs, g, &plan, false);
        }
        None => {}
    }
    let blas = c.blas()?;
    let alpha: f32 = 1.0;
    let beta: f32 = if g.accumulate { 1.0 } else { 0.0 };
    // SAFETY: the handle is bound to `stream`, on which every op of this backend is queued;
    // the three pointers are live device allocations (borrowed for the duration of this call,
    // and the work is stream-ordered before any later free) whose lengths were checked above
    // against the spans the dimensions and strides imply; alpha and beta are host f32 as
    // CUBLAS_COMPUTE_32F requires (default host pointer mode).
    unsafe {
        cudarc::cublas::result::gemm_ex(
            *blas.handle(),
            sys::cublasOperation_t::CUBLAS_OP_T,
            sys::cublasOperation_t::CUBLAS_OP_N,
            n,
            m,
            k,
            (&alpha) as *const f32 as *const _,
            w_ptr as *const _,
            sys::cudaDataType_t::CUDA_R_16BF,
            ldw,
            a_ptr as *const _,
            sys::cudaDataType_t::CUDA_R_16BF,
            lda,
            (&beta) as *const f32 as *const _,
            c_ptr as *mut _,
            T::CUDA_TYPE,
            ldc,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(blas_err(format!(
        "{op}: cublasGemmEx m={} n={} k={} -> {}",
        g.m,
        g.n,
        g.k,
        T::DTYPE
    )))
}

/// The skinny kernel's SwiGLU entry points for 1, 2 and 4 n8 tiles of A's rows.
const SWIGLU: [&str; 3] = [
    "gemm_skinny_swiglu_nt1",
    "gemm_skinny_swiglu_nt2",
    "gemm_skinny_swiglu_nt4",
];

/// Queue the skinny kernel for a product [`gemm_bf16_device`] checked, at device addresses
/// `(a, w, c)`, with its dimensions as the kernel's ints.
fn launch_skinny<T: GemmOutElem>(
    c: &CudaBackend,
    ptrs: (u64, u64, u64),
    dims: (i32, i32, i32),
    g: &DeviceGemm,
    plan: &SkinnyPlan,
) -> Result<()> {
    launch_skinny_entry(c, T::SKINNY[plan.tiles_log2], ptrs, dims, g, plan)
}

/// Queue entry `name` of the skinny kernel (see [`launch_skinny`]; the SwiGLU entries take
/// the same parameters, C being `[m, n / 2]` at stride `ldc`).
fn launch_skinny_entry(
    c: &CudaBackend,
    name: &'static str,
    (a, w, out): (u64, u64, u64),
    (m, n, k): (i32, i32, i32),
    g: &DeviceGemm,
    plan: &SkinnyPlan,
) -> Result<()> {
    // Checked for blocks of the most warps (the strictest occupancy) at this ring size.
    let kernel = c.kernel(
        OP,
        SOURCE,
        name,
        (super::plan::MAX_WARPS * 32) as u32,
        plan.smem,
    )?;
    let mut args = [
        RawArg::Ptr(a),
        RawArg::Ptr(w),
        RawArg::Ptr(out),
        RawArg::I32(m),
        RawArg::I32(n),
        RawArg::I32(k),
        RawArg::I64(g.lda as i64),
        RawArg::I64(g.ldw as i64),
        RawArg::I64(g.ldc as i64),
        RawArg::I32(i32::from(g.accumulate)),
    ];
    // The plan bounds every size: a block per 16 weight rows (n <= i32::MAX) of at most 16
    // warps, and a ring no larger than the device's opt-in shared memory.
    let cfg = cudarc::driver::LaunchConfig {
        grid_dim: (plan.blocks as u32, 1, 1),
        block_dim: ((plan.warps * 32) as u32, 1, 1),
        shared_mem_bytes: plan.smem as u32,
    };
    // SAFETY: the arguments match the entry's parameters (three pointers, three ints, three
    // long longs, an int); `gemm_bf16_device` checked that every operand holds the span its
    // dimensions and strides imply and that m, n >= 1 (rows past m or n are read at row 0),
    // and `skinny_plan` that A and W rows are 16-byte aligned and k a multiple of 32 (the
    // kernel's 16-byte loads never pass a row's k-th element); C is not aliased with A or W
    // (the op's contract; the kernel's pointers are `__restrict__`); the shared memory is
    // the warps' cp.async rings (`GemmCfg::WARP_BYTES` each), which the reduction's
    // `[warps][NT][4][32]` floats reuse, within the limit `kernel` raised the entry to.
    unsafe { c.launch_ex(&kernel.func, cfg, &mut args, name, plan.dependent, 1) }
}

/// The wide kernel's entry points of the SwiGLU form for 1, 2, 4, 8 and 16 n8 tiles.
const WIDE_SWIGLU: [&str; 5] = [
    "gemm_wide_swiglu_nt1",
    "gemm_wide_swiglu_nt2",
    "gemm_wide_swiglu_nt4",
    "gemm_wide_swiglu_nt8",
    "gemm_wide_swiglu_nt16",
];

/// Which own kernel takes a product, and how.
enum OwnPlan {
    Skinny(SkinnyPlan),
    Wide(WidePlan),
}

/// The one place that decides which own kernel takes a product (so a plain product and its
/// SwiGLU form always choose alike): the skinny kernel where [`skinny_plan`] takes it, else
/// on a backend that runs the sm_90a variants the wide kernel where [`wide_plan`] does, both
/// under the backend's rule; `None` (cuBLAS) otherwise or when own GEMMs are off.
fn own_plan(
    c: &CudaBackend,
    shape: (usize, usize, usize),
    a: (u64, usize),
    w: (u64, usize),
) -> Option<OwnPlan> {
    if !c.uses_own_gemm() {
        return None;
    }
    let rule = c.gemm_rule();
    if let Some(plan) = skinny_plan(shape, a, w, device_limits(c), &rule) {
        return Some(OwnPlan::Skinny(plan));
    }
    if !c.uses_sm90a() {
        return None;
    }
    wide_plan(shape, a, w, c.limits().smem_per_block_optin, &rule).map(OwnPlan::Wide)
}

/// Queue wide entry `name` for a product [`gemm_bf16_device`] checked (or `run_swiglu`'s,
/// `swiglu`: the SwiGLU form, C `[m, n / 2]` at stride `g.ldc`), at device addresses
/// `(a, w, c)`: a block per (64-row weight tile, split), the splits of a tile in one cluster
/// ([`wide_splits`] for the clusters of each size the device holds at once; one where the
/// backend launches no clusters).
fn launch_wide(
    c: &CudaBackend,
    name: &'static str,
    (a, w, out): (u64, u64, u64),
    g: &DeviceGemm,
    plan: &WidePlan,
    swiglu: bool,
) -> Result<()> {
    // Each entry prepared at the plan's shared memory (the module's kernels prefer shared
    // memory, `PREFER_SHARED_MODULES`: the split counts on several blocks an SM).
    let prepare = |entry: &'static str| -> Result<Kernel> {
        c.kernel_for(
            SM90A_MODULE,
            Some(SM90A),
            sm90a_source(),
            entry,
            WIDE_THREADS,
            plan.smem,
        )
    };
    let kernel = prepare(name)?;
    let splits = if c.uses_clusters() {
        // Resident clusters of each size (cached by the backend), of one entry for every form
        // of this tile count (the plain BF16 one): the split, hence the rounding, depends only
        // on the shape, the plan and the device, so the SwiGLU form's sums are the plain
        // product's bit for bit. A failed query fails the launch (no silent other split).
        let canonical = <bf16 as GemmOutElem>::WIDE[plan.tiles_log2];
        let occupancy = if canonical == name {
            kernel.clone()
        } else {
            prepare(canonical)?
        };
        let sizes = WIDE_MAX_SPLITS.min(g.k.div_ceil(WIDE_KC).max(1));
        let mut placed = [0usize; WIDE_MAX_SPLITS];
        for (s, p) in placed.iter_mut().enumerate().take(sizes) {
            *p = c.max_active_clusters(
                &occupancy,
                canonical,
                (WIDE_THREADS, plan.smem),
                s as u32 + 1,
            )?;
        }
        wide_splits(plan.tiles, g.k, |s| placed[s - 1])
    } else {
        1
    };
    let blocks = u32::try_from(plan.tiles * splits)
        .ok()
        .filter(|&b| b <= i32::MAX as u32)
        .ok_or_else(|| OpsError::Param {
            op: OP,
            param: "n",
            expected: "at most 2^31 - 1 wide blocks".into(),
            found: g.n.to_string(),
        })?;
    let nc = 8u32 << plan.tiles_log2;
    let tm_a = tensor_map(OP, "a", a, (g.k, g.m, g.lda), (64, nc))?;
    let tm_w = tensor_map(
        OP,
        "w",
        w,
        (g.k, g.n, g.ldw),
        (64, if swiglu { 32 } else { 64 }),
    )?;
    let mut args = [
        RawArg::Map(tm_a),
        RawArg::Map(tm_w),
        RawArg::Ptr(out),
        RawArg::I32(as_c_int(OP, "m", g.m)?),
        RawArg::I32(as_c_int(OP, "n", g.n)?),
        RawArg::I32(as_c_int(OP, "k", g.k)?),
        RawArg::I64(g.ldc as i64),
        RawArg::I32(i32::from(g.accumulate)),
        RawArg::I32(plan.stages as i32),
    ];
    let cfg = cudarc::driver::LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (WIDE_THREADS, 1, 1),
        shared_mem_bytes: plan.smem as u32,
    };
    // SAFETY: the arguments match the entry's parameters (two TMA maps by value, a pointer,
    // three ints, a long long, two ints); the maps were encoded over the A and W spans that
    // `gemm_bf16_device` (or `run_swiglu`) checked (`[m, k]` at stride lda, `[n, k]` at ldw;
    // TMA reads nothing outside them: the rest of a box is zero-filled), and the kernel stores
    // only C elements of rows below m and columns below n (n / 2 for SwiGLU) at stride ldc,
    // within the span checked; C is not aliased with A or W (the op's contract); the shared
    // memory is the plan's (its stages hold the 64 x 8 nt partial tile the reduction reuses
    // them for), within the limit `kernel_for` raised the entry to; `splits` divides the grid
    // and is at most 8 (`wide_splits`), and `launch_ex` checks both.
    unsafe {
        c.launch_ex(
            &kernel.func,
            cfg,
            &mut args,
            name,
            plan.dependent,
            splits as u32,
        )
    }
}

/// `gemm::run_swiglu` on CUDA where the skinny or the wide kernel takes the product (its
/// SwiGLU form writes `out`, `[m, n / 2]`): `Ok(true)` once queued, `Ok(false)` (nothing
/// queued) where neither does (own GEMMs off, or both plans refuse the shape, the alignment
/// or the device), and the caller forms the product and the SwiGLU apart. Lengths already checked (n even).
pub(super) fn run_swiglu(
    c: &CudaBackend,
    a: &Buffer<bf16>,
    w: &Buffer<bf16>,
    out: &mut Buffer<bf16>,
    m: usize,
    n: usize,
    k: usize,
) -> Result<bool> {
    if m == 0 || n == 0 {
        return Ok(true);
    }
    if !c.uses_own_gemm() {
        return Ok(false);
    }
    let stream = c.stream();
    let (a_ptr, _ra) = a.device(OP, "a")?.device_ptr(stream);
    let (w_ptr, _rw) = w.device(OP, "w")?.device_ptr(stream);
    let (o_ptr, _ro) = out.device_mut(OP, "out")?.device_ptr_mut(stream);
    let g = DeviceGemm {
        ldc: n / 2,
        ..DeviceGemm::contiguous(m, n, k)
    };
    let ptrs = (a_ptr, w_ptr, o_ptr);
    match own_plan(c, (m, n, k), (a_ptr, k), (w_ptr, k)) {
        None => return Ok(false),
        // A skinny block's 16 weight rows are 8 features' gate and up rows: the plan's block
        // count (n / 16) is the SwiGLU form's (I / 8).
        Some(OwnPlan::Skinny(plan)) => {
            let dims = (
                as_c_int(OP, "m", m)?,
                as_c_int(OP, "n", n)?,
                as_c_int(OP, "k", k)?,
            );
            launch_skinny_entry(c, SWIGLU[plan.tiles_log2], ptrs, dims, &g, &plan)?;
        }
        // A wide tile of 64 weight rows is 32 features' gate and up rows: its tile count
        // (n / 64 rounded up) is the SwiGLU form's (I / 32 rounded up), and its split the
        // plain product's (`launch_wide`).
        Some(OwnPlan::Wide(plan)) => {
            launch_wide(c, WIDE_SWIGLU[plan.tiles_log2], ptrs, &g, &plan, true)?;
        }
    }
    Ok(true)
}

/// The `gemm` op on whole buffers (lengths already checked by `run_*`).
pub(super) fn run<T: GemmOutElem>(
    c: &CudaBackend,
    a: &Buffer<bf16>,
    w: &Buffer<bf16>,
    out: &mut Buffer<T>,
    m: usize,
    n: usize,
    k: usize,
) -> Result<()> {
    gemm_bf16_device(
        c,
        OP,
        a.device(OP, "a")?,
        w.device(OP, "w")?,
        out.device_mut(OP, "out")?,
        &DeviceGemm::contiguous(m, n, k),
    )
}
