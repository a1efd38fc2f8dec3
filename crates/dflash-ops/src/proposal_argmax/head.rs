//! The proposal-head GEMM shared by [`crate::proposal_argmax`] and [`crate::unary_topk`]:
//! parameter and length checks, the CPU logits (the f64 oracle rounded once to f32), the
//! workspace size, and the CUDA launcher of the fused GEMM kernels (kernels/proposal_argmax.cu).
//!
//! The two ops differ only in what they keep per column (the best candidate, or the best 16).

use half::bf16;

use super::{Params, ProposalHead, check_head_params};
use crate::{Buffer, OpsError, Result, check_len, check_param};

/// Most blocks the fused GEMM launches (each writes one partial per column; bounds the
/// workspace).
pub const MAX_PARTIAL_BLOCKS: usize = 1024;

/// Largest hidden width the head ops accept.
pub const MAX_HIDDEN: usize = 1 << 16;

/// Check a head call's static shape and the lengths of hidden `[n, H]` and head `[rows, H]`
/// (plus the head-kind rules of [`check_head_params`]).
pub(crate) fn check(
    op: &'static str,
    p: &Params,
    hidden: &Buffer<bf16>,
    head: &Buffer<bf16>,
    token_ids: Option<&Buffer<i32>>,
    min_candidates: usize,
) -> Result<()> {
    let Params {
        n,
        rows,
        hidden: h,
        public_vocab,
        head: kind,
    } = *p;
    check_head_params(op, rows, public_vocab, kind, token_ids, min_candidates)?;
    check_param(
        op,
        "hidden",
        (8..=MAX_HIDDEN).contains(&h) && h.is_multiple_of(8),
        h,
        || format!("a multiple of 8 in 8..={MAX_HIDDEN}"),
    )?;
    check_param(op, "n", n <= i32::MAX as usize / 16, n, || {
        "at most (2^31 - 1) / 16 columns".into()
    })?;
    let too_big = |t: &'static str| OpsError::Param {
        op,
        param: "n",
        expected: format!("the {t} size to fit in usize"),
        found: n.to_string(),
    };
    let hidden_len = n.checked_mul(h).ok_or_else(|| too_big("hidden"))?;
    let head_len = rows.checked_mul(h).ok_or_else(|| too_big("head"))?;
    check_len(op, "hidden", hidden.len(), hidden_len, || {
        format!("[n={n}, hidden={h}]")
    })?;
    check_len(op, "head", head.len(), head_len, || {
        format!("[rows={rows}, hidden={h}]")
    })?;
    Ok(())
}

/// f32 elements of the workspace of a head op keeping `keep` candidates per column:
/// `n * MAX_PARTIAL_BLOCKS * keep * 2` (saturating).
pub(crate) fn workspace_len(p: &Params, keep: usize) -> usize {
    [p.n, MAX_PARTIAL_BLOCKS, keep, 2]
        .iter()
        .fold(1usize, |a, &f| a.saturating_mul(f))
}

/// Check that `workspace` holds at least [`workspace_len`] elements.
pub(crate) fn check_workspace(
    op: &'static str,
    p: &Params,
    keep: usize,
    workspace: &Buffer<f32>,
) -> Result<()> {
    let need = workspace_len(p, keep);
    if workspace.len() < need {
        return Err(OpsError::Length {
            op,
            tensor: "workspace",
            expected: need,
            shape: format!("at least [n={}, {MAX_PARTIAL_BLOCKS}, {keep}, 2]", p.n),
            found: workspace.len(),
        });
    }
    Ok(())
}

/// The CPU view of a head call: the f32 logits `[n, rows]` (the f64 dot products of the
/// represented inputs, rounded once), the indexed head's id map (checked unique and public)
/// and how many leading rows of each column are candidates. A NaN among the candidates
/// (only non-finite inputs produce one) is refused, naming the column.
pub(crate) struct HostLogits<'a> {
    /// `[n, rows]`.
    pub(crate) logits: Vec<f32>,
    /// The indexed head's row -> global id map.
    pub(crate) map: Option<&'a [i32]>,
    /// Candidate rows per column (a prefix of each column).
    pub(crate) considered: usize,
}

/// Compute the CPU logits of a validated head call (see [`HostLogits`]).
pub(crate) fn host_logits<'a>(
    op: &'static str,
    p: &Params,
    hidden: &Buffer<bf16>,
    head: &Buffer<bf16>,
    token_ids: Option<&'a Buffer<i32>>,
) -> Result<HostLogits<'a>> {
    let x = hidden.host(op, "hidden")?;
    let w = head.host(op, "head")?;
    let map = match token_ids {
        Some(t) => {
            let t = t.host(op, "token_ids")?;
            super::validate_token_ids(op, t, p.public_vocab)?;
            Some(t)
        }
        None => None,
    };
    let considered = match p.head {
        ProposalHead::Full => p.public_vocab,
        ProposalHead::Indexed => p.rows,
    };
    let mut logits = vec![0f32; p.n * p.rows];
    crate::gemm::reference::run_f32(x, w, &mut logits, p.n, p.rows, p.hidden);
    for (i, row) in logits.chunks_exact(p.rows).enumerate() {
        if let Some(k) = row[..considered].iter().position(|v| v.is_nan()) {
            return Err(OpsError::Value {
                op,
                tensor: "hidden",
                index: i,
                expected: "a column whose head logits are not NaN (finite hidden and head)".into(),
                found: format!("NaN logit at head row {k}"),
            });
        }
    }
    Ok(HostLogits {
        logits,
        map,
        considered,
    })
}

/// The GEMM driver of a launch (kernels/proposal_argmax.cu).
#[cfg(any(feature = "cuda", test))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Driver {
    /// mma.sync m16n8k16 over a 3-stage cp.async pipeline (sm_80 and later).
    Portable,
    /// wgmma m64nNk16 over 5 TMA stages in the 128-byte swizzled layout, fed by a producer
    /// warp through mbarriers (sm_90a; the module is compiled with `PH_WGMMA`).
    Wgmma,
}

/// Bytes of the fused GEMM's shared memory pipeline for `nt` column tiles
/// (`PhCfg<NT>::PIPE_BYTES`): portable, 3 stages of a 128 x 64 head tile and an 8*nt x 64
/// hidden tile with rows padded to 72 elements; wgmma, 5 unpadded stages plus 1024 bytes of
/// alignment slack and the stages' two mbarriers each.
#[cfg(any(feature = "cuda", test))]
pub(crate) fn pipe_bytes(nt: usize, driver: Driver) -> usize {
    match driver {
        Driver::Portable => 3 * (128 * 72 + 8 * nt * 72) * 2,
        Driver::Wgmma => 5 * (128 * 64 + 8 * nt * 64) * 2 + 1024 + 2 * 5 * 8,
    }
}

/// Column tiles the portable kernels are instantiated for (8 columns each).
#[cfg(any(feature = "cuda", test))]
pub(crate) const NT_CHOICES: [usize; 5] = [1, 2, 4, 8, 16];

/// Column tiles the wgmma kernels are instantiated for (a suffix of [`NT_CHOICES`]: the
/// entry points keep the portable names).
#[cfg(any(feature = "cuda", test))]
pub(crate) const WGMMA_NT_CHOICES: [usize; 2] = [8, 16];

/// Fewest columns the wgmma driver is used for. Below, the GEMM is bound by the head read,
/// which the portable driver already reaches; above, it is bound by the MMA rate.
#[cfg(any(feature = "cuda", test))]
pub(crate) const WGMMA_MIN_COLUMNS: usize = 33;

/// The driver for `n` columns on a backend that may (`sm90a`) use the wgmma one.
#[cfg(any(feature = "cuda", test))]
pub(crate) fn choose_driver(n: usize, sm90a: bool) -> Driver {
    if sm90a && n >= WGMMA_MIN_COLUMNS {
        Driver::Wgmma
    } else {
        Driver::Portable
    }
}

/// The column tiling for `n` columns: the smallest `nt` of `choices` with `8 * nt >= n`,
/// capped at the largest whose shared memory (`smem(nt)`) fits `limit` bytes. `None` when
/// not even the smallest fits.
#[cfg(any(feature = "cuda", test))]
pub(crate) fn choose_nt(
    n: usize,
    choices: &[usize],
    limit: usize,
    smem: impl Fn(usize) -> usize,
) -> Option<usize> {
    let mut fits = choices.iter().copied().filter(|&nt| smem(nt) <= limit);
    let mut largest = fits.next()?;
    if 8 * largest >= n {
        return Some(largest);
    }
    for nt in fits {
        largest = nt;
        if 8 * nt >= n {
            break;
        }
    }
    Some(largest)
}

/// The driver and column tiling of a launch for `n` columns: the wgmma driver where
/// [`choose_driver`] picks it and one of its tiles fits `limit` bytes of shared memory (a
/// pipeline plus `epilogue_bytes(nt)`), else the portable one; `None` when not even the
/// portable driver's smallest tile fits.
#[cfg(any(feature = "cuda", test))]
pub(crate) fn plan_tiles(
    n: usize,
    sm90a: bool,
    limit: usize,
    epilogue_bytes: impl Fn(usize) -> usize,
) -> Option<(Driver, usize)> {
    let fit = |driver: Driver, choices: &[usize]| {
        choose_nt(n, choices, limit, |nt| {
            pipe_bytes(nt, driver) + epilogue_bytes(nt)
        })
        .map(|nt| (driver, nt))
    };
    if choose_driver(n, sm90a) == Driver::Wgmma
        && let Some(plan) = fit(Driver::Wgmma, &WGMMA_NT_CHOICES)
    {
        return Some(plan);
    }
    fit(Driver::Portable, &NT_CHOICES)
}

/// What distinguishes the two head ops' fused GEMM kernels.
#[cfg(feature = "cuda")]
pub(crate) struct HeadKernels {
    /// The op (and the portable module's name).
    pub(crate) op: &'static str,
    /// The portable module's source.
    pub(crate) source: &'static str,
    /// The wgmma module's name and source (the portable source compiled with `PH_WGMMA`).
    pub(crate) sm90a_module: &'static str,
    /// See [`Self::sm90a_module`].
    pub(crate) sm90a_source: &'static str,
    /// Entry points `{op}_gemm_nt{NT}`, one per [`NT_CHOICES`] entry (the wgmma module
    /// defines those of [`WGMMA_NT_CHOICES`] under the same names).
    pub(crate) names: [&'static str; 5],
    /// The epilogue's shared memory for `nt` column tiles (after the pipeline).
    pub(crate) epilogue_bytes: fn(usize) -> usize,
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    //! Launch of the fused head GEMM (`{op}_gemm_nt{NT}`), shared by both head ops.

    use cudarc::driver::{DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg, sys};
    use half::bf16;

    use super::{
        Driver, HeadKernels, MAX_PARTIAL_BLOCKS, NT_CHOICES, Params, pipe_bytes, plan_tiles,
    };
    use crate::cuda::{CudaBackend, SM90A, cuda_err};
    use crate::{Buffer, OpsError, Result};

    /// Threads of a GEMM block (`PH_BLOCK_THREADS`): one warpgroup, plus the TMA producer
    /// warp for the wgmma driver.
    fn threads(driver: Driver) -> u32 {
        match driver {
            Driver::Portable => 128,
            Driver::Wgmma => 160,
        }
    }

    /// A TMA descriptor passed by value to the wgmma kernels (`PhTmap`).
    #[repr(transparent)]
    #[derive(Clone, Copy)]
    struct TensorMap(sys::CUtensorMap);

    // SAFETY: plain old data (the driver's opaque 128-byte descriptor), passed by value as the
    // kernels' `const __grid_constant__ PhTmap` parameters.
    unsafe impl DeviceRepr for TensorMap {}

    /// The TMA map of a row-major BF16 matrix `[outer, inner]` at device address `ptr`, read
    /// in boxes of `box_outer` rows x 64 elements with the 128-byte swizzle; reads past the
    /// matrix are zero-filled.
    fn tensor_map(
        op: &'static str,
        tensor: &'static str,
        ptr: sys::CUdeviceptr,
        inner: usize,
        outer: usize,
        box_outer: u32,
    ) -> Result<TensorMap> {
        let dims = [inner as u64, outer as u64];
        let strides = [inner as u64 * 2];
        let boxes = [64u32, box_outer];
        let steps = [1u32, 1];
        let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
        // SAFETY: every pointer is valid for the rank (2) the call reads; `ptr` is the
        // 256-byte aligned start of a device allocation of outer * inner BF16 elements
        // (checked by the op's `run`); the strides are multiples of 16 bytes (inner is a
        // multiple of 8).
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
                context: format!("encoding the TMA map of {op}'s {tensor} [{outer}, {inner}]"),
                message: format!("{status:?}"),
            });
        }
        // SAFETY: cuTensorMapEncodeTiled succeeded, so it wrote the whole descriptor.
        Ok(TensorMap(unsafe { map.assume_init() }))
    }

    /// Launch the fused GEMM of `k` (the wgmma driver on an sm_90a backend for at least
    /// [`super::WGMMA_MIN_COLUMNS`] columns, the portable one otherwise); returns the number
    /// of partial blocks written per column (the merge's `P`).
    ///
    /// Grid: x = P = min(ceil(rows / 16), resident blocks, 1024) row ranges of equal length
    /// (a multiple of 16 rows), y = ceil(n / (8 * nt)) column chunks.
    pub(crate) fn launch_gemm(
        c: &CudaBackend,
        k: &HeadKernels,
        hidden: &Buffer<bf16>,
        head: &Buffer<bf16>,
        token_ids: Option<&Buffer<i32>>,
        workspace: &mut Buffer<f32>,
        p: &Params,
    ) -> Result<usize> {
        let op = k.op;
        let limit = c.limits().smem_per_block_optin;
        let (driver, nt) = plan_tiles(p.n, c.uses_sm90a(), limit, k.epilogue_bytes)
            .ok_or_else(|| OpsError::Cuda {
                context: format!("preparing {op}"),
                message: format!(
                    "the smallest head tile needs {} bytes of shared memory; this device allows {limit}",
                    pipe_bytes(NT_CHOICES[0], Driver::Portable) + (k.epilogue_bytes)(NT_CHOICES[0])
                ),
            })?;
        let smem = |nt: usize| pipe_bytes(nt, driver) + (k.epilogue_bytes)(nt);
        let idx = NT_CHOICES.iter().position(|&x| x == nt).unwrap_or(0);
        let name = k.names[idx];
        let bytes = smem(nt);
        let threads = threads(driver);
        let kernel = match driver {
            Driver::Portable => c.kernel(op, k.source, name, threads, bytes)?,
            Driver::Wgmma => c.kernel_for(
                k.sm90a_module,
                Some(SM90A),
                k.sm90a_source,
                name,
                threads,
                bytes,
            )?,
        };
        let resident = kernel.blocks_per_sm * c.limits().sm_count;
        let blocks = p
            .rows
            .div_ceil(16)
            .min(resident)
            .clamp(1, MAX_PARTIAL_BLOCKS);
        let chunks = p.n.div_ceil(8 * nt);
        if chunks > 65_535 {
            return Err(OpsError::Param {
                op,
                param: "n",
                expected: format!("at most {} columns on CUDA", 65_535 * 8 * nt),
                found: p.n.to_string(),
            });
        }
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, chunks as u32, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: bytes as u32,
        };
        let (n, rows, h, public) = (
            p.n as i32,
            p.rows as i32,
            p.hidden as i32,
            p.public_vocab as i32,
        );
        let hidden_d = hidden.device(op, "hidden")?;
        let head_d = head.device(op, "head")?;
        let maps = match driver {
            Driver::Portable => None,
            Driver::Wgmma => {
                let (hp, _hg) = hidden_d.device_ptr(c.stream());
                let (wp, _wg) = head_d.device_ptr(c.stream());
                Some((
                    tensor_map(op, "hidden", hp, p.hidden, p.n, 8 * nt as u32)?,
                    tensor_map(op, "head", wp, p.hidden, p.rows, 128)?,
                ))
            }
        };
        let mut b = c.stream().launch_builder(&kernel.func);
        match &maps {
            None => {
                b.arg(hidden_d);
                b.arg(head_d);
            }
            Some((mx, mw)) => {
                b.arg(mx);
                b.arg(mw);
            }
        }
        // The full head passes a null map (the kernel then uses the row index as the id).
        let null: u64 = 0;
        match token_ids {
            Some(t) => b.arg(t.device(op, "token_ids")?),
            None => b.arg(&null),
        };
        b.arg(workspace.device_mut(op, "workspace")?);
        b.arg(&n);
        b.arg(&rows);
        b.arg(&h);
        b.arg(&public);
        // SAFETY: argument types and order match the `{op}_gemm_nt{NT}` entry points of the
        // module launched (portable: the hidden and head pointers; sm_90a: their TMA maps,
        // encoded above over the same allocations, which outlive the launch's stream order);
        // a null pointer is a valid `const int*` for the full head, never dereferenced there;
        // hidden has n*H, head rows*H elements, token_ids rows (checked by the op's `run`);
        // the workspace holds n * MAX_PARTIAL_BLOCKS * keep pairs and blocks <= 1024.
        unsafe { b.launch(cfg) }.map_err(cuda_err(format!("launching {name}")))?;
        Ok(blocks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn column_tiling_is_the_smallest_that_holds_n_within_the_device_limit() {
        let big = usize::MAX;
        let pb = |nt| pipe_bytes(nt, Driver::Portable);
        let c = &NT_CHOICES;
        assert_eq!(choose_nt(1, c, big, pb), Some(1));
        assert_eq!(choose_nt(7, c, big, pb), Some(1));
        assert_eq!(choose_nt(9, c, big, pb), Some(2));
        assert_eq!(choose_nt(15, c, big, pb), Some(2));
        assert_eq!(choose_nt(120, c, big, pb), Some(16));
        assert_eq!(choose_nt(1000, c, big, pb), Some(16));
        // A 99 KiB device caps the tile (more column chunks instead).
        let nt = choose_nt(120, c, 99 * 1024, pb).expect("fits");
        assert!(pb(nt) <= 99 * 1024 && nt < 16, "{nt}");
        assert_eq!(choose_nt(1, c, 1000, pb), None);
        // The wgmma tiles: 64 or 128 columns.
        let wb = |nt| pipe_bytes(nt, Driver::Wgmma);
        let w = &WGMMA_NT_CHOICES;
        assert_eq!(choose_nt(33, w, big, wb), Some(8));
        assert_eq!(choose_nt(64, w, big, wb), Some(8));
        assert_eq!(choose_nt(65, w, big, wb), Some(16));
        assert_eq!(choose_nt(120, w, big, wb), Some(16));
    }

    #[test]
    fn a_wgmma_tile_that_does_not_fit_falls_back_to_the_portable_driver() {
        let epi = |nt: usize| 8 * nt * 16 * 8;
        let big = 227 * 1024;
        assert_eq!(plan_tiles(120, true, big, epi), Some((Driver::Wgmma, 16)));
        assert_eq!(
            plan_tiles(120, false, big, epi),
            Some((Driver::Portable, 16))
        );
        assert_eq!(plan_tiles(7, true, big, epi), Some((Driver::Portable, 1)));
        // Room for the portable 128-column tile but not for any wgmma tile.
        let limit = pipe_bytes(16, Driver::Portable) + epi(16);
        assert!(pipe_bytes(8, Driver::Wgmma) + epi(8) > limit);
        assert_eq!(
            plan_tiles(120, true, limit, epi),
            Some((Driver::Portable, 16))
        );
        assert_eq!(plan_tiles(120, true, 1000, epi), None);
    }

    #[test]
    fn wgmma_driver_only_on_sm90a_for_wide_calls() {
        assert_eq!(choose_driver(120, true), Driver::Wgmma);
        assert_eq!(choose_driver(WGMMA_MIN_COLUMNS, true), Driver::Wgmma);
        assert_eq!(choose_driver(WGMMA_MIN_COLUMNS - 1, true), Driver::Portable);
        assert_eq!(choose_driver(120, false), Driver::Portable);
        // The wgmma tiles are a suffix of the portable ones (same entry-point names), and
        // their stages stay 1024-byte aligned (the swizzled descriptors need it).
        assert!(NT_CHOICES.ends_with(&WGMMA_NT_CHOICES));
        for nt in WGMMA_NT_CHOICES {
            assert_eq!((128 * 64 + 8 * nt * 64) * 2 % 1024, 0);
        }
    }

    #[test]
    fn workspace_holds_every_partial() {
        let p = Params {
            n: 120,
            rows: 248_320,
            hidden: 5120,
            public_vocab: 248_077,
            head: ProposalHead::Full,
        };
        assert_eq!(workspace_len(&p, 1), 120 * 1024 * 2);
        assert_eq!(workspace_len(&p, 16), 120 * 1024 * 32);
    }
}
