//! The CUDA backend (feature `cuda`): context, stream, NVRTC module cache, cuBLAS handle.
//!
//! Everything is loaded at run time (cudarc `dynamic-loading`): a machine without a driver
//! gets [`OpsError::Cuda`] from [`CudaBackend::new`], never a panic. Kernel sources live in
//! `kernels/<op>.cu` (plus the shared `kernels/common.cuh`), are compiled by NVRTC for the
//! device's compute capability on first use and cached per backend. NVRTC needs the CUDA
//! headers (`cuda_bf16.h`): their folder is `$CUDA_HOME/include`, else `$CUDA_PATH/include`,
//! else `/usr/local/cuda/include`.
//!
//! Kernel variants. Every kernel has a portable variant that NVRTC compiles for the device's
//! own architecture (sm_80 and later). A few ops also have an architecture-specific variant
//! ([`ARCH_SPECIFIC_OPS`]: `gemm`'s wide kernel, the proposal heads' wgmma GEMM and the attention
//! ops' wgmma split,
//! compiled for `sm_90a`), used on a
//! device of compute capability 9.0 unless [`CudaOptions::kernels`] asks for
//! [`KernelVariants::Portable`]; both variants keep the same contract and pass the same
//! conformance cases. On compute capability 9.0 and later the ops of
//! [`DEPENDENT_LAUNCH_OPS`] also launch kernels as programmatic dependents of the kernel
//! queued before each, and the ops of [`CLUSTER_OPS`] launch thread-block clusters (neither
//! under [`KernelVariants::Portable`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};

use crate::{Buffer, Element, OpsError, PendingRead, Result, backend::Storage};

/// Shared device helpers prepended to every kernel source (bf16/f16 casts, Philox).
pub const COMMON_CUH: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../kernels/common.cuh"
));

/// Map a cudarc error into [`OpsError::Cuda`] with context.
pub(crate) fn cuda_err(
    context: impl Into<String>,
) -> impl FnOnce(cudarc::driver::DriverError) -> OpsError {
    let context = context.into();
    move |e| OpsError::Cuda {
        context,
        message: e.to_string(),
    }
}

/// Which kernel variants a [`CudaBackend`] may use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KernelVariants {
    /// The fastest variant the device supports: the `sm_90a` variants of
    /// [`ARCH_SPECIFIC_OPS`] on compute capability 9.0 (H100, H200), the portable ones
    /// elsewhere.
    #[default]
    Auto,
    /// Only the portable variants (what every sm_80+ device runs), launched as ordinary
    /// kernels (no programmatic dependent launch and no clusters, see `CudaBackend::launch_ex`), e.g.
    /// to compare the two on a Hopper GPU.
    Portable,
}

/// Which implementation the GEMMs of a [`CudaBackend`] use (every product through the `gemm`
/// device helper: the `gemm` op, the layer projections and the other ops' products; the heads
/// fuse their own).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GemmKernels {
    /// The `gemm` op's own kernel for the products its plan takes (at most 32 rows, under
    /// the backend's [`crate::gemm::SkinnyRule`], see `crates/dflash-ops/src/gemm/mod.rs`),
    /// cuBLAS for every other product.
    #[default]
    Auto,
    /// cuBLAS for every product (the plain-cuBLAS reference of the benchmarks).
    Cublas,
}

/// Options of [`CudaBackend::with_options`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CudaOptions {
    /// Which kernel variants to use.
    pub kernels: KernelVariants,
    /// Which GEMM implementation to use.
    pub gemm: GemmKernels,
}

/// Ops with an architecture-specific (`sm_90a`) kernel variant besides the portable one.
pub const ARCH_SPECIFIC_OPS: [&str; 5] = [
    crate::gemm::OP,
    crate::proposal_argmax::OP,
    crate::unary_topk::OP,
    crate::softmax_attention::OP,
    crate::sliding_window_attention::OP,
];

/// Ops that launch kernels as programmatic dependents of the kernel queued before each on
/// compute capability 9.0 and later (`CudaBackend::launch_ex`), unless
/// [`KernelVariants::Portable`]: the attention merge, and the warpgroup-pair split, whose
/// blocks wait for the kernel ahead before anything else; `gemm`'s skinny and wide kernels,
/// which prefetch the head of their weight into the L2 first; `l2_prefetch`, which issues its
/// prefetches first; and the draft layer's elementwise kernels (`rms_norm`'s, the fused
/// `head_norm_rope_qkv`, `swiglu`, the `dynamic_grouped_conv` kernels), which wait at once,
/// so that only their launch overlaps the kernel ahead; they let their own dependents launch
/// as they start (a no-op unless the next kernel is one).
pub const DEPENDENT_LAUNCH_OPS: [&str; 8] = [
    crate::softmax_attention::OP,
    crate::sliding_window_attention::OP,
    crate::gemm::OP,
    crate::l2_prefetch::OP,
    crate::rms_norm::OP,
    crate::head_norm_rope::OP,
    crate::swiglu::OP,
    crate::dynamic_grouped_conv::OP,
];

/// Ops that launch thread-block clusters on compute capability 9.0 and later
/// (`CudaBackend::launch_ex`: `target_distribution` spreads each verify column over a cluster
/// of blocks, `gemm`'s wide kernel splits a weight tile's reduction over one), unless
/// [`KernelVariants::Portable`].
pub const CLUSTER_OPS: [&str; 2] = [crate::target_distribution::OP, crate::gemm::OP];

/// Modules whose kernels prefer as much of the SM's L1 / shared memory as shared memory
/// (a carveout hint the driver keeps unless a kernel cannot run with it), set once when a
/// kernel is prepared: `gemm`'s wide kernel, whose split counts on several blocks an SM.
const PREFER_SHARED_MODULES: [&str; 1] = [crate::gemm::cuda::SM90A_MODULE];

/// The architecture the `sm_90a` variants are compiled for.
pub(crate) const SM90A: &str = "sm_90a";

struct Inner {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: String,
    sm90a: bool,
    /// [`GemmKernels::Auto`] (see [`CudaBackend::set_gemm_kernels`]).
    own_gemm: std::sync::atomic::AtomicBool,
    gemm_rule: Mutex<crate::gemm::SkinnyRule>,
    /// [`CudaBackend::l2_prefetch_budget`].
    l2_prefetch_budget: std::sync::atomic::AtomicUsize,
    dependent_launch: bool,
    clusters: bool,
    include_dir: String,
    limits: DeviceLimits,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    kernels: Mutex<KernelCache>,
    clusters_cache: Mutex<ClusterCache>,
    blas: Mutex<Option<Arc<cudarc::cublas::CudaBlas>>>,
    staging: Mutex<Staging>,
    readback: Mutex<Readback>,
    counters: Counters,
    /// True while [`CudaBackend::capture`] records the stream.
    capturing: std::sync::atomic::AtomicBool,
}

/// What a backend has done that an embedding engine budgets: device allocations and host
/// synchronizations (see [`CudaBackend::allocations`], [`CudaBackend::synchronizations`]).
#[derive(Debug, Default)]
struct Counters {
    allocations: AtomicU64,
    synchronizations: AtomicU64,
}

/// Pinned host memory that host-to-device writes are staged through, so that a write is
/// queued on the stream and returns without waiting ([`CudaBackend::reserve_staging`]).
/// `used` bytes hold copies that may still be in flight; every synchronize of the stream
/// completes them and resets `used` to 0.
#[derive(Debug, Default)]
struct Staging {
    ptr: Option<std::ptr::NonNull<u8>>,
    capacity: usize,
    used: usize,
}

// SAFETY: the pinned block is only touched under the `Mutex<Staging>`.
unsafe impl Send for Staging {}

impl Drop for Staging {
    fn drop(&mut self) {
        if let Some(p) = self.ptr.take() {
            // SAFETY: `p` came from cuMemHostAlloc and is freed once; every copy from it was
            // queued on the backend's stream, which the owner synchronizes before dropping
            // (`Inner::drop`).
            let _ = unsafe { cudarc::driver::result::free_host(p.as_ptr().cast()) };
        }
    }
}

/// Pinned host memory that device-to-host reads are queued into ([`CudaBackend::read_async`]),
/// so that several reads complete with one synchronize. `used` bytes are handed out to
/// `outstanding` pending reads; the block is reused from its start once none is outstanding.
#[derive(Debug, Default)]
struct Readback {
    block: Staging,
    outstanding: usize,
    /// Synchronizes so far: a read queued in epoch e has landed once `epoch > e`.
    epoch: u64,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Copies staged from pinned memory must finish before that memory is freed (on a
        // host's stream this waits for the host's work queued there too).
        let _ = self.stream.synchronize();
    }
}

/// Staging capacity reserved at the first write when none was planned (bytes).
pub const DEFAULT_STAGING_BYTES: usize = 1 << 20;

/// Device memory a [`crate::Borrowed`] view lends: a cudarc slice over the caller's
/// allocation, handed back (never freed) when dropped.
#[derive(Debug)]
pub(crate) struct BorrowedSlice<T>(std::mem::ManuallyDrop<cudarc::driver::CudaSlice<T>>);

impl<T> BorrowedSlice<T> {
    /// The slice ops read through.
    pub(crate) fn slice(&self) -> &cudarc::driver::CudaSlice<T> {
        &self.0
    }
}

impl<T> Drop for BorrowedSlice<T> {
    fn drop(&mut self) {
        // SAFETY: taken once, here; `leak` hands the address back without freeing it.
        let s = unsafe { std::mem::ManuallyDrop::take(&mut self.0) };
        let _ = s.leak();
    }
}

/// A non-owning slice of elements `offset..offset + len` of `d` (the caller checked the range
/// lies inside `d`), on `d`'s own stream: no driver query, the memory being `d`'s. Refused
/// ([`OpsError::Borrow`]) unless it starts 16-byte aligned, what the kernels assume of every
/// device buffer.
pub(crate) fn sub_slice<T>(
    d: &cudarc::driver::CudaSlice<T>,
    offset: usize,
    len: usize,
) -> Result<BorrowedSlice<T>> {
    let addr = slice_address(d) + (offset * std::mem::size_of::<T>()) as u64;
    if len > 0 && !addr.is_multiple_of(16) {
        return Err(OpsError::Borrow {
            problem: format!("a view at element {offset} starts at {addr:#x}, not 16-byte aligned"),
        });
    }
    // SAFETY: the range lies inside `d`'s allocation (checked by the caller), which outlives
    // the view (the view borrows the buffer holding `d`); `BorrowedSlice` never frees it.
    let slice = unsafe { d.stream().upgrade_device_ptr::<T>(addr, len) };
    Ok(BorrowedSlice(std::mem::ManuallyDrop::new(slice)))
}

/// `v` as a kernel's `int` argument, or the op's [`OpsError::Param`] naming `param`.
pub(crate) fn kernel_int(op: &'static str, param: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| OpsError::Param {
        op,
        param,
        expected: "at most i32::MAX on CUDA".into(),
        found: v.to_string(),
    })
}

/// Whether a kernel may take 8 elements a step as 16-byte words: `h` a multiple of 8 and
/// every tensor at a 16-byte aligned address (then every row start is: 8 BF16 or F32
/// elements are 16 or 32 bytes).
pub(crate) fn vec_ok(h: usize, addresses: &[u64]) -> bool {
    h.is_multiple_of(8) && addresses.iter().all(|a| a.is_multiple_of(16))
}

/// Threads of a block whose threads take 8 elements a step over a row of `h`: one step for
/// rows up to 8192 elements (whole warps, 32 to 1024).
pub(crate) fn eight_wide_threads(h: usize) -> u32 {
    (h.div_ceil(8).div_ceil(32) * 32).clamp(32, 1024) as u32
}

/// The device address of a cudarc slice.
pub(crate) fn slice_address<T>(d: &cudarc::driver::CudaSlice<T>) -> u64 {
    use cudarc::driver::DevicePtr;
    d.device_ptr(d.stream()).0
}

/// The launch attribute of clusters of `cluster` consecutive blocks along x.
fn cluster_attribute(cluster: u32) -> cudarc::driver::sys::CUlaunchAttribute {
    use cudarc::driver::sys;
    sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
        pad: [0; 4],
        value: sys::CUlaunchAttributeValue {
            clusterDim: sys::CUlaunchAttributeValue_union__bindgen_ty_1 {
                x: cluster,
                y: 1,
                z: 1,
            },
        },
    }
}

/// [`CudaBackend::max_active_clusters`] per (function handle, dynamic shared memory, threads,
/// cluster size).
type ClusterCache = HashMap<(usize, usize, u32, u32), usize>;

/// Prepared kernels by (module, function, dynamic shared memory bytes).
type KernelCache = HashMap<(&'static str, &'static str, usize), Kernel>;

/// Device limits the launchers size their grids and tiles by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceLimits {
    /// Streaming multiprocessors.
    pub sm_count: usize,
    /// Shared memory one block may opt in to (bytes).
    pub smem_per_block_optin: usize,
}

/// A kernel ready to launch with a given dynamic shared memory size: its function (the
/// shared-memory limit raised when above 48 KiB) and how many of its blocks fit on one SM.
#[derive(Clone, Debug)]
pub(crate) struct Kernel {
    /// The function.
    pub(crate) func: CudaFunction,
    /// Resident blocks per SM at the threads and shared memory it was prepared for.
    pub(crate) blocks_per_sm: usize,
}

/// One parameter of a kernel launched by [`CudaBackend::launch_ex`].
#[derive(Clone, Copy, Debug)]
pub(crate) enum RawArg {
    /// A device pointer (`T*` in the kernel).
    Ptr(u64),
    /// An `int`.
    I32(i32),
    /// A `long long`.
    I64(i64),
    /// A `float`.
    F32(f32),
    /// A TMA descriptor (`const __grid_constant__ DfTmap`).
    Map(TensorMap),
}

/// A TMA descriptor passed by value to the sm_90a kernels (`DfTmap` of `kernels/common.cuh`).
#[repr(transparent)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct TensorMap(cudarc::driver::sys::CUtensorMap);

// SAFETY: plain old data (the driver's opaque 128-byte descriptor), passed by value as the
// kernels' `const __grid_constant__ DfTmap` parameters.
unsafe impl cudarc::driver::DeviceRepr for TensorMap {}

/// The TMA map of a row-major BF16 matrix of `outer` rows of `inner` elements, row `r`
/// starting at element `r * stride` of device address `ptr`, read in boxes of `box_inner`
/// elements (at most 64: one 128-byte swizzled row) x `box_outer` rows with the 128-byte
/// swizzle; reads past the matrix (either axis) are zero-filled. `op` and `tensor` name it in
/// errors. The caller guarantees `ptr` is 16-byte aligned and `stride` a multiple of 8
/// (the driver refuses anything else).
pub(crate) fn tensor_map(
    op: &'static str,
    tensor: &'static str,
    ptr: cudarc::driver::sys::CUdeviceptr,
    (inner, outer, stride): (usize, usize, usize),
    (box_inner, box_outer): (u32, u32),
) -> Result<TensorMap> {
    use cudarc::driver::sys;
    let dims = [inner as u64, outer as u64];
    let strides = [stride as u64 * 2];
    let boxes = [box_inner, box_outer];
    let steps = [1u32, 1];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    // SAFETY: every pointer is valid for the rank (2) the call reads; the driver checks the
    // address's and the stride's alignment and the box sizes, and reports what it refuses.
    let status = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            2,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            steps.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if status != sys::CUresult::CUDA_SUCCESS {
        return Err(OpsError::Cuda {
            context: format!(
                "encoding the TMA map of {op}'s {tensor} [{outer}, {inner}] (row stride {stride})"
            ),
            message: format!("{status:?}"),
        });
    }
    // SAFETY: cuTensorMapEncodeTiled succeeded, so it wrote the whole descriptor.
    Ok(TensorMap(unsafe { map.assume_init() }))
}

/// Identification of a CUDA device and its software stack.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    /// The device name (e.g. "NVIDIA H200").
    pub name: String,
    /// The NVRTC target (`sm_90`).
    pub arch: String,
    /// The CUDA version the driver supports (cuDriverGetVersion), "major.minor".
    pub driver_cuda_version: String,
    /// The NVRTC library version, "major.minor".
    pub nvrtc_version: String,
}

/// A CUDA device with one stream on which every op is queued in order.
#[derive(Clone)]
pub struct CudaBackend {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("arch", &self.inner.arch)
            .field("sm90a", &self.inner.sm90a)
            .finish()
    }
}

/// The folder holding the CUDA headers NVRTC needs, from `CUDA_HOME`, `CUDA_PATH`, then
/// `/usr/local/cuda`.
pub fn cuda_include_dir() -> Result<String> {
    let mut tried = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(root) = std::env::var(var) {
            let inc = format!("{root}/include");
            if std::path::Path::new(&inc).join("cuda_bf16.h").exists() {
                return Ok(inc);
            }
            tried.push(format!("${var}/include = {inc}"));
        } else {
            tried.push(format!("${var} (unset)"));
        }
    }
    let default = "/usr/local/cuda/include";
    if std::path::Path::new(default).join("cuda_bf16.h").exists() {
        return Ok(default.to_string());
    }
    tried.push(default.to_string());
    Err(OpsError::Cuda {
        context: "locating cuda_bf16.h for NVRTC".into(),
        message: format!(
            "not found in any of: {}; set CUDA_HOME to the CUDA toolkit root",
            tried.join(", ")
        ),
    })
}

/// The NVRTC options every kernel module is compiled with, for `arch`.
fn nvrtc_options(arch: &str, include_dir: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        format!("--include-path={include_dir}"),
    ]
}

/// The error of compiling `module` for `arch` (`what` adds to the context).
fn nvrtc_err(module: &str, arch: &str, what: &str, message: String) -> OpsError {
    OpsError::Cuda {
        context: format!("NVRTC compiling kernels/{module}.cu for {arch}{what}"),
        message,
    }
}

/// Compile one kernel module (`COMMON_CUH` + `source`) with NVRTC for `arch` (`sm_XY`), with
/// the options every backend uses; the error carries NVRTC's log.
pub fn compile_module(
    module: &str,
    source: &str,
    arch: &str,
    include_dir: &str,
) -> Result<cudarc::nvrtc::Ptx> {
    let opts = cudarc::nvrtc::CompileOptions {
        options: nvrtc_options(arch, include_dir),
        name: Some(format!("{module}.cu")),
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(format!("{COMMON_CUH}\n{source}"), opts)
        .map_err(|e| nvrtc_err(module, arch, "", e.to_string()))
}

/// Compile one kernel module as [`compile_module`] does, for a real architecture (`sm_XY` or
/// `sm_90a`), through ptxas with `-v`, and return NVRTC's log: per entry point its
/// registers, stack frame and spill bytes (`dflash-kernels --resources`). No GPU needed.
pub fn ptxas_log(module: &str, source: &str, arch: &str, include_dir: &str) -> Result<String> {
    use cudarc::nvrtc::result;
    let err = |e: String| nvrtc_err(module, arch, " (ptxas -v)", e);
    let src = std::ffi::CString::new(format!("{COMMON_CUH}\n{source}"))
        .map_err(|_| err("the source holds a NUL byte".into()))?;
    let name = std::ffi::CString::new(format!("{module}.cu")).unwrap_or_default();
    let prog = result::create_program(&src, Some(&name)).map_err(|e| err(format!("{e:?}")))?;
    let mut opts = nvrtc_options(arch, include_dir);
    opts.push("--ptxas-options=-v".into());
    // SAFETY: `prog` was created above and is destroyed once, after its log was read.
    let compiled = unsafe { result::compile_program(prog, &opts) };
    // SAFETY: as above.
    let log = unsafe { result::get_program_log(prog) };
    // SAFETY: as above; `prog` is not used afterwards.
    unsafe { result::destroy_program(prog) }.map_err(|e| err(format!("{e:?}")))?;
    let text: String = log
        .map_err(|e| err(format!("{e:?}")))?
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8 as char)
        .collect();
    compiled.map_err(|e| err(format!("{e:?}\n{text}")))?;
    Ok(text)
}

/// Every kernel module the ops compile: (module name = op id, its source without
/// `COMMON_CUH`). `sliding_window_attention` is the shared attention body followed by its
/// own entry points.
pub fn kernel_modules() -> Vec<(&'static str, String)> {
    vec![
        (
            crate::candidate_selector::OP,
            crate::candidate_selector::cuda::SOURCE.into(),
        ),
        (
            crate::chain_accept::OP,
            crate::chain_accept::cuda::SOURCE.into(),
        ),
        (
            crate::context_kv_materialize::OP,
            crate::context_kv_materialize::cuda::SOURCE.into(),
        ),
        (
            crate::dynamic_grouped_conv::OP,
            crate::dynamic_grouped_conv::cuda::SOURCE.into(),
        ),
        (
            crate::embedding_gather::OP,
            crate::embedding_gather::cuda::SOURCE.into(),
        ),
        (crate::gemm::OP, crate::gemm::cuda::SOURCE.into()),
        (
            crate::head_norm_rope::OP,
            crate::head_norm_rope::cuda::SOURCE.into(),
        ),
        (
            crate::l2_prefetch::OP,
            crate::l2_prefetch::cuda::SOURCE.into(),
        ),
        (
            crate::proposal_argmax::OP,
            crate::proposal_argmax::cuda::SOURCE.into(),
        ),
        (
            crate::residual_add::OP,
            crate::residual_add::cuda::SOURCE.into(),
        ),
        (crate::rms_norm::OP, crate::rms_norm::cuda::SOURCE.into()),
        (
            crate::rng_uniform::OP,
            crate::rng_uniform::cuda::SOURCE.into(),
        ),
        (
            crate::sliding_window_attention::OP,
            crate::sliding_window_attention::cuda::source().into(),
        ),
        (
            crate::softmax_attention::OP,
            crate::softmax_attention::cuda::SOURCE.into(),
        ),
        (crate::swiglu::OP, crate::swiglu::cuda::SOURCE.into()),
        (
            crate::target_distribution::OP,
            crate::target_distribution::cuda::SOURCE.into(),
        ),
        (
            crate::tree_accept::OP,
            crate::tree_accept::cuda::source().into(),
        ),
        (
            crate::unary_topk::OP,
            crate::unary_topk::cuda::source().into(),
        ),
    ]
}

/// Every architecture-specific kernel module: (module name, source without `COMMON_CUH`,
/// the architecture it is compiled for).
pub fn arch_specific_modules() -> Vec<(&'static str, String, &'static str)> {
    vec![
        (
            crate::gemm::cuda::SM90A_MODULE,
            crate::gemm::cuda::sm90a_source().into(),
            SM90A,
        ),
        (
            crate::proposal_argmax::cuda::SM90A_MODULE,
            crate::proposal_argmax::cuda::sm90a_source().into(),
            SM90A,
        ),
        (
            crate::unary_topk::cuda::SM90A_MODULE,
            crate::unary_topk::cuda::sm90a_source().into(),
            SM90A,
        ),
        (
            crate::softmax_attention::cuda::SM90A_MODULE,
            crate::softmax_attention::cuda::sm90a_source().into(),
            SM90A,
        ),
        (
            crate::sliding_window_attention::cuda::SM90A_MODULE,
            crate::sliding_window_attention::cuda::sm90a_source().into(),
            SM90A,
        ),
    ]
}

impl CudaBackend {
    /// Open device `ordinal` with the default [`CudaOptions`] (see [`Self::with_options`]).
    pub fn new(ordinal: usize) -> Result<Self> {
        Self::with_options(ordinal, CudaOptions::default())
    }

    /// Open device `ordinal`: a context, a non-default stream, and the NVRTC include path;
    /// `options` selects the kernel variants.
    ///
    /// Event tracking is disabled (all work is ordered on the one stream), which keeps every
    /// op capturable into a CUDA graph.
    pub fn with_options(ordinal: usize, options: CudaOptions) -> Result<Self> {
        // SAFETY: only probes whether the driver library can be loaded (no driver call).
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(OpsError::Cuda {
                context: "loading the CUDA driver".into(),
                message: "libcuda could not be loaded (no NVIDIA driver on this machine?)".into(),
            });
        }
        let count = CudaContext::device_count().map_err(cuda_err("counting CUDA devices"))?;
        if ordinal >= usize::try_from(count).unwrap_or(0) {
            return Err(OpsError::Cuda {
                context: format!("opening CUDA device {ordinal}"),
                message: format!("this machine has {count} CUDA device(s)"),
            });
        }
        let ctx = CudaContext::new(ordinal)
            .map_err(cuda_err(format!("creating a context on device {ordinal}")))?;
        // SAFETY: we order all work on one stream ourselves; no event-based sync is relied on.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(cuda_err("creating a stream"))?;
        Self::build(stream, options)
    }

    /// A backend on the host engine's own stream (and so its context and device): every op,
    /// copy and allocation of this backend is queued on `stream`, in order with the host's
    /// own work there, so the host never synchronizes around a call. The context's settings
    /// are left as the host made them; with cudarc event tracking on (its default) cudarc
    /// records events around each buffer use, which costs launches but stays correct. To
    /// capture these ops into a CUDA graph, turn event tracking off on the host's context
    /// (`CudaContext::disable_event_tracking`).
    pub fn on_stream(stream: Arc<CudaStream>, options: CudaOptions) -> Result<Self> {
        Self::build(stream, options)
    }

    /// [`Self::on_stream`] for a host that holds a raw driver stream (`CUstream`, e.g. from
    /// the CUDA runtime or another binding) of the context `ctx` (e.g.
    /// `CudaContext::new(ordinal)`, the device's primary context, which the runtime API also
    /// uses).
    ///
    /// # Safety
    ///
    /// `cu_stream` is a valid stream of `ctx` (or the null / per-thread stream handle), and
    /// the host keeps it alive (does not destroy it) while this backend or anything made from
    /// it may use it.
    pub unsafe fn on_raw_stream(
        ctx: Arc<CudaContext>,
        cu_stream: cudarc::driver::sys::CUstream,
        options: CudaOptions,
    ) -> Result<Self> {
        // SAFETY: forwarded from this function's contract.
        let stream = unsafe { ctx.wrap_borrowed_stream(cu_stream) };
        Self::build(stream, options)
    }

    /// The backend over `stream`: the device's limits and architecture, the NVRTC include
    /// path, empty caches and counters.
    fn build(stream: Arc<CudaStream>, options: CudaOptions) -> Result<Self> {
        let ctx = stream.context().clone();
        ctx.bind_to_thread()
            .map_err(cuda_err("binding the stream's context"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(cuda_err("reading compute capability"))?;
        let include_dir = cuda_include_dir()?;
        let attr = |a, what: &str| -> Result<usize> {
            ctx.attribute(a)
                .map(|v| usize::try_from(v).unwrap_or(0))
                .map_err(cuda_err(format!("reading the device's {what}")))
        };
        use cudarc::driver::sys::CUdevice_attribute as A;
        let limits = DeviceLimits {
            sm_count: attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, "SM count")?.max(1),
            smem_per_block_optin: attr(
                A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                "shared memory per block",
            )?,
        };
        Ok(CudaBackend {
            inner: Arc::new(Inner {
                ctx,
                stream,
                arch: format!("sm_{major}{minor}"),
                sm90a: options.kernels == KernelVariants::Auto && (major, minor) == (9, 0),
                own_gemm: std::sync::atomic::AtomicBool::new(options.gemm == GemmKernels::Auto),
                gemm_rule: Mutex::new(crate::gemm::SkinnyRule::default()),
                l2_prefetch_budget: std::sync::atomic::AtomicUsize::new(
                    crate::l2_prefetch::DEFAULT_BUDGET,
                ),
                dependent_launch: options.kernels == KernelVariants::Auto && major >= 9,
                clusters: options.kernels == KernelVariants::Auto && major >= 9,
                include_dir,
                limits,
                modules: Mutex::new(HashMap::new()),
                kernels: Mutex::new(HashMap::new()),
                clusters_cache: Mutex::new(HashMap::new()),
                blas: Mutex::new(None),
                staging: Mutex::new(Staging::default()),
                readback: Mutex::new(Readback::default()),
                counters: Counters::default(),
                capturing: std::sync::atomic::AtomicBool::new(false),
            }),
        })
    }

    /// Device allocations this backend has made (buffers from `zeros`, `filled`, `upload`,
    /// and op scratch), since it was created: an engine checks that a round after warm-up
    /// adds none. Views of caller memory ([`crate::Borrowed`]) and the pinned staging block
    /// are not device allocations and do not count.
    pub fn allocations(&self) -> u64 {
        self.inner.counters.allocations.load(Ordering::Relaxed)
    }

    /// Times this backend has waited for its stream (each `synchronize`, each read back to
    /// the host, and a write that found the staging block full), since it was created.
    pub fn synchronizations(&self) -> u64 {
        self.inner.counters.synchronizations.load(Ordering::Relaxed)
    }

    /// Reserve `bytes` of pinned host memory for staging host-to-device writes (at least
    /// what one round writes between two reads; the engine plans it at startup). Writes
    /// are then queued without waiting; a write that does not fit in what is left
    /// synchronizes once and starts over, a write larger than the whole block is copied
    /// directly and waited for. Growing replaces the block (after a synchronize); a smaller
    /// request keeps the current one.
    pub fn reserve_staging(&self, bytes: usize) -> Result<()> {
        if bytes <= self.lock_staging()?.capacity {
            return Ok(());
        }
        // Every copy from the current block completes first (this also resets `used`); the
        // staging lock is not held across it (`synchronize` takes it).
        self.synchronize()?;
        let mut st = self.lock_staging()?;
        if bytes <= st.capacity {
            return Ok(());
        }
        let p = self.alloc_pinned(bytes, "staging")?;
        if let Some(old) = st.ptr.replace(p) {
            // SAFETY: the stream was synchronized above and the lock has been held since the
            // block was last read by nothing queued after (writes take the lock), so no
            // copy reads the old block.
            unsafe { cudarc::driver::result::free_host(old.as_ptr().cast()) }
                .map_err(cuda_err("freeing the previous pinned staging"))?;
        }
        st.capacity = bytes;
        st.used = 0;
        Ok(())
    }

    /// A fresh block of `bytes` bytes of pinned host memory (`what`: its use, for errors),
    /// freed by the [`Staging`] that takes it.
    fn alloc_pinned(&self, bytes: usize, what: &str) -> Result<std::ptr::NonNull<u8>> {
        self.inner
            .ctx
            .bind_to_thread()
            .map_err(cuda_err(format!("binding the context for pinned {what}")))?;
        // SAFETY: a fresh pinned block, only ever used as bytes.
        let p = unsafe { cudarc::driver::result::malloc_host(bytes, 0) }.map_err(cuda_err(
            format!("allocating {bytes} bytes of pinned {what}"),
        ))?;
        std::ptr::NonNull::new(p.cast::<u8>()).ok_or_else(|| OpsError::Cuda {
            context: format!("allocating pinned {what}"),
            message: "cuMemHostAlloc returned null".into(),
        })
    }

    fn lock_staging(&self) -> Result<std::sync::MutexGuard<'_, Staging>> {
        self.inner.staging.lock().map_err(|_| OpsError::Cuda {
            context: "pinned staging".into(),
            message: "lock poisoned".into(),
        })
    }

    /// The device range `[addr, addr + bytes)` as a slice of `len` `T` that is never freed
    /// here, after checking it: non-null, 16-byte aligned, device memory of this backend's
    /// device, inside one allocation (cuPointerGetAttribute).
    ///
    /// # Safety
    ///
    /// The contract of [`crate::Borrowed::from_raw`].
    pub(crate) unsafe fn borrow_range<T: Element>(
        &self,
        addr: u64,
        len: usize,
        bytes: usize,
    ) -> Result<BorrowedSlice<T>> {
        use cudarc::driver::sys;
        let refuse = |problem: String| Err(OpsError::Borrow { problem });
        if len > 0 {
            if addr == 0 || !addr.is_multiple_of(16) {
                return refuse(format!(
                    "device address {addr:#x} is null or not aligned to 16 bytes"
                ));
            }
            self.inner
                .ctx
                .bind_to_thread()
                .map_err(cuda_err("binding the context to borrow memory"))?;
            let attr = |a: sys::CUpointer_attribute, out: *mut std::ffi::c_void| {
                // SAFETY: `out` points at a value of the attribute's documented type.
                unsafe { sys::cuPointerGetAttribute(out, a, addr) }
            };
            use sys::CUpointer_attribute as P;
            let mut ordinal: std::ffi::c_int = -1;
            let mut start: sys::CUdeviceptr = 0;
            let mut size: usize = 0;
            for (a, out) in [
                (
                    P::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                    (&mut ordinal as *mut std::ffi::c_int).cast(),
                ),
                (
                    P::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                    (&mut start as *mut sys::CUdeviceptr).cast(),
                ),
                (
                    P::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                    (&mut size as *mut usize).cast(),
                ),
            ] {
                let status = attr(a, out);
                if status != sys::CUresult::CUDA_SUCCESS {
                    return refuse(format!(
                        "the driver does not know {addr:#x} as device memory ({a:?}: {status:?})"
                    ));
                }
            }
            if usize::try_from(ordinal).ok() != Some(self.inner.ctx.ordinal()) {
                return refuse(format!(
                    "{addr:#x} is memory of device {ordinal}, the backend runs on device {}",
                    self.inner.ctx.ordinal()
                ));
            }
            let inside = addr
                .checked_sub(start)
                .and_then(|o| o.checked_add(bytes as u64))
                .is_some_and(|e| e <= size as u64);
            if !inside {
                return refuse(format!(
                    "{bytes} bytes at {addr:#x} exceed the allocation [{start:#x}, +{size})"
                ));
            }
        }
        // SAFETY: the range was checked above (or is empty and never dereferenced); the
        // caller guarantees it stays valid while borrowed; `BorrowedSlice` never frees it.
        let slice = unsafe { self.inner.stream.upgrade_device_ptr::<T>(addr, len) };
        Ok(BorrowedSlice(std::mem::ManuallyDrop::new(slice)))
    }

    /// The device's SM count and shared-memory limit.
    pub fn limits(&self) -> DeviceLimits {
        self.inner.limits
    }

    /// Function `name` of `module` prepared for blocks of `threads` threads using
    /// `dyn_smem` bytes of dynamic shared memory (cached): refuses a size above the device's
    /// opt-in limit, raises the function's limit to the largest size it was prepared for, and
    /// reports how many such blocks fit on one SM.
    pub(crate) fn kernel(
        &self,
        module: &'static str,
        source: &str,
        name: &'static str,
        threads: u32,
        dyn_smem: usize,
    ) -> Result<Kernel> {
        self.kernel_for(module, None, source, name, threads, dyn_smem)
    }

    /// [`Self::kernel`] of a module compiled for `arch` (`None`: the device's own); a module
    /// name must always be compiled for the same architecture.
    pub(crate) fn kernel_for(
        &self,
        module: &'static str,
        arch: Option<&str>,
        source: &str,
        name: &'static str,
        threads: u32,
        dyn_smem: usize,
    ) -> Result<Kernel> {
        let key = (module, name, dyn_smem);
        if let Some(k) = self.lock_kernels(module)?.get(&key) {
            return Ok(k.clone());
        }
        if dyn_smem > self.inner.limits.smem_per_block_optin {
            return Err(OpsError::Cuda {
                context: format!("preparing {name}"),
                message: format!(
                    "needs {dyn_smem} bytes of shared memory per block; this device allows {}",
                    self.inner.limits.smem_per_block_optin
                ),
            });
        }
        let func = self.function_for(module, arch, source, name)?;
        // One guard from here to the insert: the limit is the function's, shared by every
        // size it was prepared for, so it is raised to the largest of them and never lowered
        // (a launch of a larger size prepared before would fail), also when two threads
        // prepare sizes of one function at once.
        let mut cache = self.lock_kernels(module)?;
        if let Some(k) = cache.get(&key) {
            return Ok(k.clone());
        }
        let limit = cache
            .keys()
            .filter(|(m, n, _)| *m == module && *n == name)
            .map(|&(_, _, s)| s)
            .fold(dyn_smem, usize::max);
        use cudarc::driver::sys::CUfunction_attribute_enum as F;
        func.set_attribute(
            F::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            i32::try_from(limit).unwrap_or(i32::MAX),
        )
        .map_err(cuda_err(format!(
            "raising the shared memory limit of {name}"
        )))?;
        if PREFER_SHARED_MODULES.contains(&module) {
            // Before the occupancy below, which reads it.
            func.set_attribute(F::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)
                .map_err(cuda_err(format!("preferring shared memory for {name}")))?;
        }
        let blocks = func
            .occupancy_max_active_blocks_per_multiprocessor(threads, dyn_smem, None)
            .map_err(cuda_err(format!("occupancy of {name}")))?;
        if blocks == 0 {
            return Err(OpsError::Cuda {
                context: format!("preparing {name}"),
                message: format!(
                    "no block of {threads} threads with {dyn_smem} bytes of shared memory fits on an SM"
                ),
            });
        }
        let k = Kernel {
            func,
            blocks_per_sm: blocks as usize,
        };
        cache.insert(key, k.clone());
        Ok(k)
    }

    fn lock_kernels(&self, module: &str) -> Result<std::sync::MutexGuard<'_, KernelCache>> {
        self.inner.kernels.lock().map_err(|_| OpsError::Cuda {
            context: format!("kernel cache ({module})"),
            message: "lock poisoned".into(),
        })
    }

    /// The device context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.inner.ctx
    }

    /// The stream every op is queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.inner.stream
    }

    /// The `sm_XY` target NVRTC compiles for.
    pub fn arch(&self) -> &str {
        &self.inner.arch
    }

    /// Whether the `sm_90a` variants of [`ARCH_SPECIFIC_OPS`] are used (compute capability
    /// 9.0 and [`KernelVariants::Auto`]).
    pub fn uses_sm90a(&self) -> bool {
        self.inner.sm90a
    }

    /// Whether GEMMs may use the `gemm` op's own kernel
    /// ([`GemmKernels::Auto`]); otherwise every GEMM is a cuBLAS call.
    pub fn uses_own_gemm(&self) -> bool {
        self.inner
            .own_gemm
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Switch the GEMM implementation of work queued from now on (every clone of this backend
    /// shares it; a recorded CUDA graph keeps the kernels it recorded), e.g. to time the same
    /// model with cuBLAS alone in one process.
    pub fn set_gemm_kernels(&self, gemm: GemmKernels) {
        self.inner.own_gemm.store(
            gemm == GemmKernels::Auto,
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// Which products the `gemm` op's own kernel takes, and with how many warps a block
    /// (while [`Self::uses_own_gemm`]).
    pub fn gemm_rule(&self) -> crate::gemm::SkinnyRule {
        *self
            .inner
            .gemm_rule
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Set [`Self::gemm_rule`] for work queued from now on (every clone of this backend
    /// shares it; a recorded CUDA graph keeps the kernels it recorded), e.g. to measure
    /// another rule in one process. The default is the measured one.
    pub fn set_gemm_rule(&self, rule: crate::gemm::SkinnyRule) {
        *self
            .inner
            .gemm_rule
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = rule;
    }

    /// What the draft block prefetches into the L2 of each next weight at most, in bytes
    /// (`crate::l2_prefetch`; 0: no prefetch). The default is
    /// [`crate::l2_prefetch::DEFAULT_BUDGET`], 0 (see there for what was measured).
    pub fn l2_prefetch_budget(&self) -> usize {
        self.inner.l2_prefetch_budget.load(Ordering::Relaxed)
    }

    /// Set [`Self::l2_prefetch_budget`] for work queued from now on (every clone of this
    /// backend shares it; a recorded CUDA graph keeps the launches it recorded), e.g. to
    /// measure another budget in one process.
    pub fn set_l2_prefetch_budget(&self, bytes: usize) {
        self.inner
            .l2_prefetch_budget
            .store(bytes, Ordering::Relaxed);
    }

    /// Whether the ops of [`DEPENDENT_LAUNCH_OPS`] launch kernels as programmatic
    /// dependents of the kernel queued before each (compute capability 9.0 and later,
    /// [`KernelVariants::Auto`]); otherwise every kernel is an ordinary launch.
    pub fn uses_dependent_launch(&self) -> bool {
        self.inner.dependent_launch
    }

    /// Whether the ops of [`CLUSTER_OPS`] launch thread-block clusters, several blocks
    /// sharing one work item through distributed shared memory (compute capability 9.0 and
    /// later, [`KernelVariants::Auto`]); otherwise each of their work items is one block.
    pub fn uses_clusters(&self) -> bool {
        self.inner.clusters
    }

    /// How many clusters of `cluster` blocks of `kernel` (entry `name`, blocks of `threads`
    /// threads and `dyn_smem` bytes of dynamic shared memory, as it was prepared) can be
    /// resident on the device at once (`cuOccupancyMaxActiveClusters`; cached): fewer than
    /// `blocks_per_sm * SMs / cluster` where a cluster's blocks must share a GPC. A cluster of
    /// one is `blocks_per_sm * SMs`.
    pub(crate) fn max_active_clusters(
        &self,
        kernel: &Kernel,
        name: &'static str,
        (threads, dyn_smem): (u32, usize),
        cluster: u32,
    ) -> Result<usize> {
        if cluster <= 1 {
            return Ok(kernel.blocks_per_sm * self.inner.limits.sm_count);
        }
        let key = (
            kernel.func.cu_function() as usize,
            dyn_smem,
            threads,
            cluster,
        );
        let lock = || {
            self.inner
                .clusters_cache
                .lock()
                .map_err(|_| OpsError::Cuda {
                    context: "the cluster occupancy cache".into(),
                    message: "lock poisoned".into(),
                })
        };
        if let Some(&n) = lock()?.get(&key) {
            return Ok(n);
        }
        use cudarc::driver::sys;
        let mut attr = [cluster_attribute(cluster)];
        let cfg = sys::CUlaunchConfig {
            gridDimX: cluster,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: threads,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: u32::try_from(dyn_smem).unwrap_or(u32::MAX),
            // No stream: the query must not depend on whether the backend's is capturing.
            hStream: std::ptr::null_mut(),
            attrs: attr.as_mut_ptr(),
            numAttrs: 1,
        };
        let mut n: std::ffi::c_int = 0;
        // SAFETY: `cfg` and its one attribute outlive the call, which only reads them and
        // writes `n`; the function is a live function of this context.
        unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, kernel.func.cu_function(), &cfg) }
            .result()
            .map_err(cuda_err(format!(
                "occupancy of {name} in clusters of {cluster}"
            )))?;
        let n = usize::try_from(n).unwrap_or(0);
        lock()?.insert(key, n);
        Ok(n)
    }

    /// Launch `func` on the stream (`cfg`: grid, block, dynamic shared memory) through
    /// cuLaunchKernelEx, in clusters of `cluster` consecutive blocks along x when
    /// `cluster > 1` (the caller checks [`Self::uses_clusters`] and that `cluster` divides
    /// the grid's x; at most 8), and as a programmatic dependent of the kernel queued before it
    /// (programmatic stream serialization) when `dependent` and
    /// [`Self::uses_dependent_launch`], else as an ordinary launch. A dependent launch may
    /// start as soon as every block of the kernel
    /// ahead has called `df_pdl_launch_dependents` (kernels/common.cuh), and since kernels
    /// trigger early, kernels further back may still run then too: `func` must call
    /// `df_pdl_wait` before it reads anything any earlier kernel of the stream may still
    /// write, and before it writes anything, and every block of it must call it before
    /// exiting (so that work queued after `func` also follows the kernel ahead). The same
    /// holds inside a captured CUDA graph (a programmatic edge).
    ///
    /// # Safety
    ///
    /// `args` are the kernel's parameters in order and type (device pointers of live
    /// allocations of this context); the kernel's memory accesses stay within the buffers
    /// passed; `func` follows the waiting rule above.
    pub(crate) unsafe fn launch_ex(
        &self,
        func: &CudaFunction,
        cfg: cudarc::driver::LaunchConfig,
        args: &mut [RawArg],
        what: &str,
        dependent: bool,
        cluster: u32,
    ) -> Result<()> {
        use cudarc::driver::sys;
        let mut params: Vec<*mut std::ffi::c_void> = args
            .iter_mut()
            .map(|a| match a {
                RawArg::Ptr(p) => (p as *mut u64).cast(),
                RawArg::I32(v) => (v as *mut i32).cast(),
                RawArg::I64(v) => (v as *mut i64).cast(),
                RawArg::F32(v) => (v as *mut f32).cast(),
                RawArg::Map(m) => (m as *mut TensorMap).cast(),
            })
            .collect();
        let mut attrs = Vec::with_capacity(2);
        if dependent && self.inner.dependent_launch {
            attrs.push(sys::CUlaunchAttribute {
                id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                pad: [0; 4],
                value: sys::CUlaunchAttributeValue {
                    programmaticStreamSerializationAllowed: 1,
                },
            });
        }
        if cluster > 1 {
            if !self.inner.clusters || cluster > 8 || !cfg.grid_dim.0.is_multiple_of(cluster) {
                return Err(OpsError::Cuda {
                    context: format!("launching {what}"),
                    message: format!(
                        "a cluster of {cluster} blocks (grid x {}; clusters {}): needs \
                         compute capability 9.0, at most 8 blocks, dividing the grid",
                        cfg.grid_dim.0,
                        if self.inner.clusters { "on" } else { "off" }
                    ),
                });
            }
            attrs.push(cluster_attribute(cluster));
        }
        let launch = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.inner.stream.cu_stream(),
            attrs: attrs.as_mut_ptr(),
            numAttrs: attrs.len() as u32,
        };
        self.inner
            .ctx
            .bind_to_thread()
            .map_err(cuda_err(format!("binding the context for {what}")))?;
        // SAFETY: the caller guarantees `args`, which `params` points into (both outlive the
        // call, as do `launch` and its attributes).
        let status = unsafe {
            sys::cuLaunchKernelEx(
                &launch,
                func.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        if status != sys::CUresult::CUDA_SUCCESS {
            return Err(OpsError::Cuda {
                context: format!("launching {what}"),
                message: format!("{status:?}"),
            });
        }
        Ok(())
    }

    /// The shared cuBLAS handle bound to [`Self::stream`].
    pub fn blas(&self) -> Result<Arc<cudarc::cublas::CudaBlas>> {
        let mut guard = self.inner.blas.lock().map_err(|_| OpsError::Cuda {
            context: "cuBLAS handle".into(),
            message: "lock poisoned".into(),
        })?;
        if let Some(b) = guard.as_ref() {
            return Ok(b.clone());
        }
        let blas = Arc::new(
            cudarc::cublas::CudaBlas::new(self.inner.stream.clone()).map_err(|e| {
                OpsError::Cuda {
                    context: "creating the cuBLAS handle".into(),
                    message: e.to_string(),
                }
            })?,
        );
        // Reductions in the compute type (FP32), never in the output's: with BF16 output
        // cuBLAS may otherwise split the reduction and add BF16-rounded partial sums, which
        // breaks the `gemm` contract's single rounding (found by the conformance case
        // `gemm/wide_m40_n130_k1032_bf16` on the portable variants, H100: 608 of 5200
        // elements a BF16 ulp off).
        // The mode is the default math (0) with the reduction flag (16) set.
        // SAFETY: the handle was just created and is not yet shared.
        let status = unsafe {
            cudarc::cublas::sys::cublasSetMathMode(
                *blas.handle(),
                cudarc::cublas::sys::cublasMath_t::CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION,
            )
        };
        if status != cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(OpsError::Cuda {
                context: "setting the cuBLAS math mode (FP32 reductions)".into(),
                message: format!("{status:?}"),
            });
        }
        *guard = Some(blas.clone());
        Ok(blas)
    }

    /// Function `name` of module `module` (compiled from `COMMON_CUH` + `source` on first use).
    pub fn function(&self, module: &'static str, source: &str, name: &str) -> Result<CudaFunction> {
        self.function_for(module, None, source, name)
    }

    /// [`Self::function`] of a module compiled for `arch` (`None`: the device's own).
    pub(crate) fn function_for(
        &self,
        module: &'static str,
        arch: Option<&str>,
        source: &str,
        name: &str,
    ) -> Result<CudaFunction> {
        let m = {
            let mut cache = self.inner.modules.lock().map_err(|_| OpsError::Cuda {
                context: format!("module cache ({module})"),
                message: "lock poisoned".into(),
            })?;
            if let Some(m) = cache.get(module) {
                m.clone()
            } else {
                let arch = arch.unwrap_or(&self.inner.arch);
                let ptx = compile_module(module, source, arch, &self.inner.include_dir)?;
                let m = self
                    .inner
                    .ctx
                    .load_module(ptx)
                    .map_err(cuda_err(format!("loading module {module}")))?;
                cache.insert(module, m.clone());
                m
            }
        };
        m.load_function(name)
            .map_err(cuda_err(format!("loading function {name} of {module}")))
    }

    /// What the conformance report records about the device and its software.
    pub fn device_info(&self) -> Result<DeviceInfo> {
        let name = self
            .inner
            .ctx
            .name()
            .map_err(cuda_err("reading the device name"))?;
        let mut driver: std::ffi::c_int = 0;
        // SAFETY: cuDriverGetVersion writes one int through a valid pointer.
        let status = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver) };
        if status != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            return Err(OpsError::Cuda {
                context: "cuDriverGetVersion".into(),
                message: format!("{status:?}"),
            });
        }
        let (mut nvrtc_major, mut nvrtc_minor): (std::ffi::c_int, std::ffi::c_int) = (0, 0);
        // SAFETY: nvrtcVersion writes two ints through valid pointers.
        let status =
            unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut nvrtc_major, &mut nvrtc_minor) };
        if status != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
            return Err(OpsError::Cuda {
                context: "nvrtcVersion".into(),
                message: format!("{status:?}"),
            });
        }
        Ok(DeviceInfo {
            name,
            arch: self.inner.arch.clone(),
            driver_cuda_version: format!("{}.{}", driver / 1000, (driver % 1000) / 10),
            nvrtc_version: format!("{nvrtc_major}.{nvrtc_minor}"),
        })
    }

    /// Wait for the stream (counted in [`Self::synchronizations`]); every staged write
    /// has then completed, so the staging block is free again.
    pub fn synchronize(&self) -> Result<()> {
        self.not_capturing("a synchronize")?;
        // Both held across the wait (in this order; nothing takes them the other way), so
        // that no write stages a copy and no read is queued between the wait and the reset:
        // such a copy would be in flight while its bytes count as free, such a read would
        // count as landed.
        let staging = self.inner.staging.lock();
        let readback = self.inner.readback.lock();
        self.inner
            .stream
            .synchronize()
            .map_err(cuda_err("synchronizing the stream"))?;
        self.inner
            .counters
            .synchronizations
            .fetch_add(1, Ordering::Relaxed);
        if let Ok(mut st) = staging {
            st.used = 0;
        }
        if let Ok(mut rb) = readback {
            rb.epoch += 1;
        }
        Ok(())
    }

    /// Queue a copy of `buf[offset..offset + len]` to the host and return at once; the
    /// elements are the buffer's at this point of the stream, and arrive with the next
    /// synchronize, which [`PendingRead::wait`] makes if none happened since. So several reads
    /// queued together cost one synchronize. A read that does not fit the pinned readback
    /// block is made at once (waiting).
    pub fn read_async<T: Element>(
        &self,
        buf: &Buffer<T>,
        offset: usize,
        len: usize,
    ) -> Result<PendingRead<T>> {
        crate::backend::check_range("read", "buf", offset, len, buf.len())?;
        self.not_capturing("a read to the host")?;
        let bytes = len * std::mem::size_of::<T>();
        let direct = |me: &Self| -> Result<PendingRead<T>> {
            Ok(PendingRead::ready(me.read(buf, offset, len)?))
        };
        if len == 0 {
            return Ok(PendingRead::ready(Vec::new()));
        }
        let d = buf.device("read", "buf")?;
        let view = d.slice(offset..offset + len);
        let mut rb = self.lock_readback()?;
        if rb.block.ptr.is_none() {
            rb.block.ptr = Some(self.alloc_pinned(DEFAULT_STAGING_BYTES, "readback")?);
            rb.block.capacity = DEFAULT_STAGING_BYTES;
        }
        if rb.outstanding == 0 {
            rb.block.used = 0;
        }
        let at = rb.block.used.next_multiple_of(16);
        let Some(base) = rb.block.ptr else {
            drop(rb);
            return direct(self);
        };
        if at + bytes > rb.block.capacity {
            drop(rb);
            return direct(self);
        }
        use cudarc::driver::DevicePtr;
        let (src, _order) = view.device_ptr(&self.inner.stream);
        self.inner
            .ctx
            .bind_to_thread()
            .map_err(cuda_err("binding the context for a read"))?;
        // SAFETY: `[at, at + bytes)` lies in the pinned block and belongs to this read alone
        // until it is waited for or dropped (`outstanding`); `src` is `len` elements of a live
        // buffer of this context.
        let status = unsafe {
            cudarc::driver::sys::cuMemcpyDtoHAsync_v2(
                base.as_ptr().add(at).cast(),
                src,
                bytes,
                self.inner.stream.cu_stream(),
            )
        };
        if status != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            return Err(OpsError::Cuda {
                context: "queueing a device-to-host read".into(),
                message: format!("{status:?}"),
            });
        }
        rb.block.used = at + bytes;
        rb.outstanding += 1;
        Ok(PendingRead::queued(self.clone(), at, len, rb.epoch))
    }

    /// The elements of a queued read at byte `at` of the readback block, queued in epoch
    /// `epoch` (synchronizes first if no synchronize happened since); gives its bytes back.
    pub(crate) fn take_read<T: Element>(
        &self,
        at: usize,
        len: usize,
        epoch: u64,
    ) -> Result<Vec<T>> {
        let landed = self.lock_readback()?.epoch > epoch;
        if !landed {
            self.synchronize()?;
        }
        let mut rb = self.lock_readback()?;
        let Some(base) = rb.block.ptr else {
            return Err(OpsError::Cuda {
                context: "reading back".into(),
                message: "no pinned readback block".into(),
            });
        };
        let mut out = vec![T::default(); len];
        // SAFETY: the copy into `[at, at + len * size)` completed (a synchronize after it was
        // queued), and these bytes belong to this read alone until it is given back here.
        unsafe {
            std::ptr::copy_nonoverlapping(
                base.as_ptr().add(at),
                out.as_mut_ptr().cast::<u8>(),
                len * std::mem::size_of::<T>(),
            );
        }
        rb.outstanding = rb.outstanding.saturating_sub(1);
        Ok(out)
    }

    /// Give back the bytes of a queued read dropped unread (after its copy has landed).
    pub(crate) fn release_read(&self, epoch: u64) {
        let landed = self
            .lock_readback()
            .map(|r| r.epoch > epoch)
            .unwrap_or(false);
        if (landed || self.synchronize().is_ok())
            && let Ok(mut rb) = self.lock_readback()
        {
            rb.outstanding = rb.outstanding.saturating_sub(1);
        }
    }

    /// [`OpsError::Capture`] while a capture records the stream: `what` cannot be recorded.
    fn not_capturing(&self, what: &str) -> Result<()> {
        if self.inner.capturing.load(Ordering::Acquire) {
            return Err(OpsError::Capture {
                problem: format!(
                    "{what} cannot be recorded into a graph (stage it before the capture)"
                ),
            });
        }
        Ok(())
    }

    /// Record the device work `f` queues on this backend's stream (kernels, cuBLAS calls,
    /// device-to-device copies) into an instantiated CUDA graph, without running it; see
    /// [`crate::Backend::capture`]. Refused when cudarc event tracking is on for the
    /// context (its event records would be captured too) or a capture is already running.
    pub(crate) fn capture(
        &self,
        f: impl FnOnce() -> Result<()>,
    ) -> Result<cudarc::driver::CudaGraph> {
        use cudarc::driver::sys;
        let refuse = |problem: String| Err(OpsError::Capture { problem });
        if self.inner.ctx.is_event_tracking() {
            return refuse(
                "cudarc event tracking is on for this context (turn it off with \
                 CudaContext::disable_event_tracking, or run eagerly)"
                    .into(),
            );
        }
        if self.inner.capturing.swap(true, Ordering::AcqRel) {
            return refuse("a capture is already recording this backend's stream".into());
        }
        /// Ends a capture `f` left open (it panicked) and clears the flag, on every exit.
        struct Recording<'a> {
            inner: &'a Inner,
            open: std::cell::Cell<bool>,
        }
        impl Drop for Recording<'_> {
            fn drop(&mut self) {
                if self.open.get() {
                    let _ = self
                        .inner
                        .stream
                        .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
                }
                self.inner.capturing.store(false, Ordering::Release);
            }
        }
        let recording = Recording {
            inner: &self.inner,
            open: std::cell::Cell::new(false),
        };
        let stream = &self.inner.stream;
        let recorded = stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(cuda_err("beginning a stream capture"))
            .and_then(|()| {
                recording.open.set(true);
                let queued = f();
                // Always end the capture, so the stream is usable again whatever `f` did.
                let ended = stream
                    .end_capture(sys::CUgraphInstantiate_flags(0))
                    .map_err(cuda_err("ending the stream capture"));
                recording.open.set(false);
                queued?;
                ended?.ok_or_else(|| OpsError::Capture {
                    problem: "the capture recorded no work".into(),
                })
            });
        drop(recording);
        let graph = recorded?;
        graph
            .upload()
            .map_err(cuda_err("uploading the captured graph"))?;
        Ok(graph)
    }

    fn lock_readback(&self) -> Result<std::sync::MutexGuard<'_, Readback>> {
        self.inner.readback.lock().map_err(|_| OpsError::Cuda {
            context: "pinned readback".into(),
            message: "lock poisoned".into(),
        })
    }

    pub(crate) fn zeros<T: Element>(&self, len: usize) -> Result<Buffer<T>> {
        self.not_capturing("an allocation")?;
        let d = self
            .inner
            .stream
            .alloc_zeros::<T>(len.max(1))
            .map_err(cuda_err(format!("allocating {len} x {}", T::DTYPE)))?;
        Ok(self.counted(d, len))
    }

    /// An allocated slice as a buffer of `len` elements, counted in [`Self::allocations`].
    fn counted<T: Element>(&self, d: cudarc::driver::CudaSlice<T>, len: usize) -> Buffer<T> {
        self.inner
            .counters
            .allocations
            .fetch_add(1, Ordering::Relaxed);
        Buffer {
            storage: Storage::Device(d, len),
        }
    }

    pub(crate) fn upload<T: Element>(&self, data: &[T]) -> Result<Buffer<T>> {
        if data.is_empty() {
            return self.zeros(0);
        }
        self.not_capturing("an allocation")?;
        // SAFETY: every element is written by the copy below before anything reads it (the
        // copy is queued on the same stream ahead of any use).
        let d = unsafe { self.inner.stream.alloc::<T>(data.len()) }.map_err(cuda_err(format!(
            "allocating {} x {}",
            data.len(),
            T::DTYPE
        )))?;
        let mut buf = self.counted(d, data.len());
        self.write(&mut buf, 0, data)?;
        Ok(buf)
    }

    pub(crate) fn read<T: Element>(
        &self,
        buf: &Buffer<T>,
        offset: usize,
        len: usize,
    ) -> Result<Vec<T>> {
        let d = buf.device("read", "buf")?;
        if len == 0 {
            return Ok(Vec::new());
        }
        self.not_capturing("a read to the host")?;
        let mut out = vec![T::default(); len];
        self.inner
            .stream
            .memcpy_dtoh(&d.slice(offset..offset + len), &mut out)
            .map_err(cuda_err("copying device to host"))?;
        self.synchronize()?;
        Ok(out)
    }

    /// Queue a copy of `data` into `buf[offset..]`: through the pinned staging block when it
    /// has room (no wait: the host slice is copied into pinned memory first, so the caller
    /// may drop or reuse it at once), else after one synchronize frees the block, else (a
    /// write larger than the block) directly, waiting for it.
    pub(crate) fn write<T: Element>(
        &self,
        buf: &mut Buffer<T>,
        offset: usize,
        data: &[T],
    ) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        // A captured copy would replay the staged bytes of the capture, not the caller's.
        self.not_capturing("a write from the host")?;
        use cudarc::driver::DevicePtrMut;
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let d = buf.device_mut("write", "buf")?;
        let mut view = d.slice_mut(offset..offset + data.len());
        // `_order` (cudarc event tracking) records the write once the copy is queued.
        let (dst, _order) = view.device_ptr_mut(&self.inner.stream);
        self.inner
            .ctx
            .bind_to_thread()
            .map_err(cuda_err("binding the context for a write"))?;
        // Bounded retries: another thread may fill the block between our synchronize and
        // the next lock; after that, copy directly.
        for _ in 0..4 {
            let mut st = self.lock_staging()?;
            let Some(base) = st.ptr else {
                drop(st);
                self.reserve_staging(DEFAULT_STAGING_BYTES)?;
                continue;
            };
            if bytes.len() > st.capacity {
                break;
            }
            let at = st.used.next_multiple_of(16);
            if at + bytes.len() > st.capacity {
                drop(st);
                self.synchronize()?;
                continue;
            }
            // SAFETY: `at + len <= capacity` (checked under the lock we hold), so the range
            // lies in the pinned block, and no queued copy reads it (`used` covers every
            // byte a copy queued since the last synchronize reads).
            let staged = unsafe {
                let p = base.as_ptr().add(at);
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), p, bytes.len());
                std::slice::from_raw_parts(p.cast_const(), bytes.len())
            };
            // SAFETY: `dst` is `data.len()` elements of a live device buffer of this
            // context; `staged` is pinned and stays untouched until a synchronize completes
            // the copy.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    dst,
                    staged,
                    self.inner.stream.cu_stream(),
                )
            }
            .map_err(cuda_err("copying host to device (staged)"))?;
            st.used = at + bytes.len();
            return Ok(());
        }
        self.write_direct(dst, bytes)
    }

    /// A host-to-device copy from pageable memory, waited for (the host slice may be freed
    /// when we return).
    fn write_direct(&self, dst: u64, bytes: &[u8]) -> Result<()> {
        self.inner
            .ctx
            .bind_to_thread()
            .map_err(cuda_err("binding the context for a write"))?;
        // SAFETY: `dst` is `bytes.len()` bytes of a live device buffer of this context;
        // `bytes` outlives the copy, which the synchronize below waits for.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(dst, bytes, self.inner.stream.cu_stream())
        }
        .map_err(cuda_err("copying host to device"))?;
        self.synchronize()
    }

    /// A strided device-to-device copy (`cuMemcpy2DAsync`); the caller checked the ranges.
    #[allow(clippy::too_many_arguments)] // reason: a 2-D copy's source and destination geometry
    pub(crate) fn copy_rows<T: Element>(
        &self,
        src: &Buffer<T>,
        src_offset: usize,
        src_stride: usize,
        dst: &mut Buffer<T>,
        dst_offset: usize,
        dst_stride: usize,
        len: usize,
        rows: usize,
    ) -> Result<()> {
        use cudarc::driver::{DevicePtr, DevicePtrMut, sys};
        let size = std::mem::size_of::<T>();
        let s = src.device("copy_rows", "src")?;
        let (src_ptr, _order) = s.device_ptr(&self.inner.stream);
        let d = dst.device_mut("copy_rows", "dst")?;
        let (dst_ptr, _order2) = d.device_ptr_mut(&self.inner.stream);
        let desc = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: src_ptr + (src_offset * size) as u64,
            srcArray: std::ptr::null_mut(),
            srcPitch: src_stride * size,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: dst_ptr + (dst_offset * size) as u64,
            dstArray: std::ptr::null_mut(),
            dstPitch: dst_stride * size,
            WidthInBytes: len * size,
            Height: rows,
        };
        self.inner
            .ctx
            .bind_to_thread()
            .map_err(cuda_err("binding the context for a strided copy"))?;
        // SAFETY: both ranges lie in live allocations of this context (checked by
        // `Backend::copy_rows`); the copy is queued on the backend's stream.
        let r = unsafe { sys::cuMemcpy2DAsync_v2(&desc, self.inner.stream.cu_stream()) };
        r.result()
            .map_err(cuda_err("copying device to device (strided)"))
    }

    pub(crate) fn copy<T: Element>(
        &self,
        src: &Buffer<T>,
        src_offset: usize,
        dst: &mut Buffer<T>,
        dst_offset: usize,
        len: usize,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let s = src.device("copy", "src")?;
        let d = dst.device_mut("copy", "dst")?;
        let sv = s.slice(src_offset..src_offset + len);
        let mut dv = d.slice_mut(dst_offset..dst_offset + len);
        self.inner
            .stream
            .memcpy_dtod(&sv, &mut dv)
            .map_err(cuda_err("copying device to device"))
    }
}
