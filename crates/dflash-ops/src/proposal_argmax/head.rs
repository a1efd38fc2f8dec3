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

/// f32 elements of the partials of a head op keeping `keep` candidates per column:
/// `n * MAX_PARTIAL_BLOCKS * keep * 2` (saturating); the op's own per-column words follow.
pub(crate) fn partial_len(p: &Params, keep: usize) -> usize {
    [p.n, MAX_PARTIAL_BLOCKS, keep, 2]
        .iter()
        .fold(1usize, |a, &f| a.saturating_mul(f))
}

/// f32 elements of the workspace of a head op keeping `keep` candidates per column: the
/// partials ([`partial_len`]), then `words` per column for the op's own use (saturating).
pub(crate) fn workspace_len(p: &Params, keep: usize, words: usize) -> usize {
    partial_len(p, keep).saturating_add(p.n.saturating_mul(words))
}

/// Check that `workspace` holds at least [`workspace_len`] elements.
pub(crate) fn check_workspace(
    op: &'static str,
    p: &Params,
    keep: usize,
    words: usize,
    workspace: &Buffer<f32>,
) -> Result<()> {
    let need = workspace_len(p, keep, words);
    if workspace.len() < need {
        return Err(OpsError::Length {
            op,
            tensor: "workspace",
            expected: need,
            shape: match words {
                0 => format!("at least [n={}, {MAX_PARTIAL_BLOCKS}, {keep}, 2]", p.n),
                w => format!(
                    "at least [n={}, {MAX_PARTIAL_BLOCKS}, {keep}, 2] + [n={}, {w}]",
                    p.n, p.n
                ),
            },
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
    /// mma.sync m16n8k16 over a 3-stage cp.async pipeline, one warpgroup (sm_80 and later).
    Portable,
    /// wgmma m64nNk16 over TMA stages in the 128-byte swizzled layout, fed by a producer
    /// warpgroup through mbarriers, two consumer warpgroups taking the tiles in turn (sm_90a;
    /// the module is compiled with `PH_WGMMA`).
    Wgmma,
}

/// What the launch plan needs to know about a head op's epilogue.
#[cfg(any(feature = "cuda", test))]
#[derive(Clone, Copy, Debug)]
pub(crate) struct Epilogue {
    /// Shared memory of one epilogue state for `nt` column tiles (`Epi<NT>::SMEM_BYTES`).
    pub(crate) bytes: fn(usize) -> usize,
    /// The wgmma driver's pipeline depth (`Epi<NT>::WG_STAGES`).
    pub(crate) wgmma_stages: usize,
}

/// Consumer warpgroups of a block, each with its own epilogue state and partial
/// (`PH_CONSUMERS`).
#[cfg(any(feature = "cuda", test))]
pub(crate) fn consumers(driver: Driver) -> usize {
    match driver {
        Driver::Portable => 1,
        Driver::Wgmma => 2,
    }
}

/// Bytes of the fused GEMM's shared memory pipeline for `nt` column tiles
/// (`PhCfg<NT, S>::PIPE_BYTES`): portable, 3 stages of a 128 x 64 head tile and an 8*nt x 64
/// hidden tile with rows padded to 72 elements; wgmma, `stages` unpadded stages ((128 + 8 nt)
/// rows of 128 bytes: a multiple of the 1024 bytes the swizzled boxes need) plus 1024 bytes of
/// alignment slack, the stages' two mbarriers and one ticket each.
#[cfg(any(feature = "cuda", test))]
pub(crate) fn pipe_bytes(nt: usize, driver: Driver, stages: usize) -> usize {
    match driver {
        Driver::Portable => 3 * (128 * 72 + 8 * nt * 72) * 2,
        Driver::Wgmma => {
            stages * ((128 * 64 + 8 * nt * 64) * 2).next_multiple_of(1024)
                + 1024
                + 2 * stages * 8
                + stages * 4
        }
    }
}

/// The whole dynamic shared memory of a launch: the pipeline and one epilogue state per
/// consumer warpgroup.
#[cfg(any(feature = "cuda", test))]
pub(crate) fn smem_bytes(nt: usize, driver: Driver, epi: &Epilogue) -> usize {
    pipe_bytes(nt, driver, epi.wgmma_stages) + consumers(driver) * (epi.bytes)(nt)
}

/// Column tiles the kernels of both drivers are instantiated for (8 columns each; the same
/// entry-point names in both modules).
#[cfg(any(feature = "cuda", test))]
pub(crate) const NT_CHOICES: [usize; 5] = [1, 2, 4, 8, 16];

/// The driver on a backend that may (`sm90a`) use the wgmma one: wgmma whenever it is
/// available, at any column count (its producer and the second warpgroup keep the head read
/// streaming during the epilogues).
#[cfg(any(feature = "cuda", test))]
pub(crate) fn choose_driver(sm90a: bool) -> Driver {
    if sm90a {
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
/// [`choose_driver`] picks it and its tile (under `limit` bytes of shared memory, see
/// [`smem_bytes`]) is at least as wide as the portable one's (a narrower tile would read the
/// head more often), else the portable one; `None` when not even the portable driver's
/// smallest tile fits.
#[cfg(any(feature = "cuda", test))]
pub(crate) fn plan_tiles(
    n: usize,
    sm90a: bool,
    limit: usize,
    epi: &Epilogue,
) -> Option<(Driver, usize)> {
    let fit = |driver: Driver| {
        choose_nt(n, &NT_CHOICES, limit, |nt| smem_bytes(nt, driver, epi)).map(|nt| (driver, nt))
    };
    let portable = fit(Driver::Portable);
    if choose_driver(sm90a) == Driver::Wgmma
        && let Some(plan) = fit(Driver::Wgmma)
        && portable.is_none_or(|(_, nt)| plan.1 >= nt)
    {
        return Some(plan);
    }
    portable
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
    /// Entry points `{op}_gemm_nt{NT}`, one per [`NT_CHOICES`] entry (in both modules).
    pub(crate) names: [&'static str; 5],
    /// The epilogue's shared memory and the wgmma pipeline depth.
    pub(crate) epilogue: Epilogue,
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    //! Launch of the fused head GEMM (`{op}_gemm_nt{NT}`), shared by both head ops.

    use cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};
    use half::bf16;

    use super::{
        Driver, HeadKernels, MAX_PARTIAL_BLOCKS, NT_CHOICES, Params, consumers, plan_tiles,
        smem_bytes,
    };
    use crate::cuda::{CudaBackend, SM90A, cuda_err, tensor_map};
    use crate::{Buffer, OpsError, Result};

    /// Threads of a GEMM block (`PH_BLOCK_THREADS`): one warpgroup; for the wgmma driver two
    /// consumer warpgroups and the TMA producer warpgroup.
    fn threads(driver: Driver) -> u32 {
        match driver {
            Driver::Portable => 128,
            Driver::Wgmma => 384,
        }
    }

    /// Launch the fused GEMM of `k` (the wgmma driver on an sm_90a backend, the portable one
    /// otherwise); returns the number of partials written per column (the merge's `P`:
    /// blocks times consumer warpgroups).
    ///
    /// Grid: x = min(ceil(rows / 16), resident blocks, 1024 / consumers) row ranges of equal
    /// length (a multiple of 16 rows), y = ceil(n / (8 * nt)) column chunks.
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
        let (driver, nt) = plan_tiles(p.n, c.uses_sm90a(), limit, &k.epilogue)
            .ok_or_else(|| OpsError::Cuda {
                context: format!("preparing {op}"),
                message: format!(
                    "the smallest head tile needs {} bytes of shared memory; this device allows {limit}",
                    smem_bytes(NT_CHOICES[0], Driver::Portable, &k.epilogue)
                ),
            })?;
        let idx = NT_CHOICES.iter().position(|&x| x == nt).unwrap_or(0);
        let name = k.names[idx];
        let bytes = smem_bytes(nt, driver, &k.epilogue);
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
        let per_block = consumers(driver);
        let resident = kernel.blocks_per_sm * c.limits().sm_count;
        let blocks = p
            .rows
            .div_ceil(16)
            .min(resident)
            .clamp(1, MAX_PARTIAL_BLOCKS / per_block);
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
                    tensor_map(
                        op,
                        "hidden",
                        hp,
                        (p.hidden, p.n, p.hidden),
                        (64, 8 * nt as u32),
                    )?,
                    tensor_map(op, "head", wp, (p.hidden, p.rows, p.hidden), (64, 128))?,
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
        // the workspace holds n * MAX_PARTIAL_BLOCKS * keep pairs and blocks * consumers <=
        // MAX_PARTIAL_BLOCKS.
        unsafe { b.launch(cfg) }.map_err(cuda_err(format!("launching {name}")))?;
        Ok(blocks * per_block)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn column_tiling_is_the_smallest_that_holds_n_within_the_device_limit() {
        let big = usize::MAX;
        let pb = |nt| pipe_bytes(nt, Driver::Portable, 0);
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
    }

    /// The two epilogues the launchers use.
    const ARGMAX: Epilogue = crate::proposal_argmax::EPILOGUE;
    const TOPK: Epilogue = crate::unary_topk::EPILOGUE;

    #[test]
    fn both_epilogues_fit_an_h200_block_at_every_wgmma_tile() {
        // 227 KiB: the opt-in limit per block of sm_90.
        for nt in NT_CHOICES {
            for epi in [ARGMAX, TOPK] {
                let b = smem_bytes(nt, Driver::Wgmma, &epi);
                assert!(b <= 232_448, "nt {nt}: {b}");
            }
        }
        assert_eq!(
            plan_tiles(120, true, 232_448, &TOPK),
            Some((Driver::Wgmma, 16))
        );
        assert_eq!(
            plan_tiles(8, true, 232_448, &TOPK),
            Some((Driver::Wgmma, 1))
        );
        // Two epilogue states: the top-16's at 128 columns is 49664 bytes.
        assert_eq!(
            smem_bytes(16, Driver::Wgmma, &TOPK),
            4 * 32768 + 1024 + 64 + 16 + 2 * 49_664
        );
    }

    #[test]
    fn a_wgmma_tile_that_does_not_fit_falls_back_to_the_portable_driver() {
        let big = 227 * 1024;
        assert_eq!(
            plan_tiles(120, true, big, &ARGMAX),
            Some((Driver::Wgmma, 16))
        );
        assert_eq!(
            plan_tiles(120, false, big, &ARGMAX),
            Some((Driver::Portable, 16))
        );
        assert_eq!(plan_tiles(7, true, big, &ARGMAX), Some((Driver::Wgmma, 1)));
        // Room for the portable 128-column tile but only for narrower wgmma tiles (which
        // would read the head twice or more): portable.
        let limit = smem_bytes(16, Driver::Portable, &TOPK);
        assert!(smem_bytes(16, Driver::Wgmma, &TOPK) > limit);
        assert!(smem_bytes(8, Driver::Wgmma, &TOPK) <= limit);
        assert_eq!(
            plan_tiles(120, true, limit, &TOPK),
            Some((Driver::Portable, 16))
        );
        // Narrow calls still take the wgmma driver there.
        assert_eq!(plan_tiles(16, true, limit, &TOPK), Some((Driver::Wgmma, 2)));
        // No wgmma tile fits at all.
        let tiny = smem_bytes(1, Driver::Portable, &TOPK);
        assert!(smem_bytes(1, Driver::Wgmma, &TOPK) > tiny);
        assert_eq!(
            plan_tiles(7, true, tiny, &TOPK),
            Some((Driver::Portable, 1))
        );
        assert_eq!(plan_tiles(120, true, 1000, &TOPK), None);
    }

    #[test]
    fn wgmma_driver_only_on_sm90a() {
        assert_eq!(choose_driver(true), Driver::Wgmma);
        assert_eq!(choose_driver(false), Driver::Portable);
        assert_eq!(
            plan_tiles(1, true, 232_448, &ARGMAX),
            Some((Driver::Wgmma, 1))
        );
        assert_eq!(
            (consumers(Driver::Portable), consumers(Driver::Wgmma)),
            (1, 2)
        );
        // The wgmma stages stay 1024-byte aligned (the swizzled descriptors need it).
        for nt in NT_CHOICES {
            let stage = pipe_bytes(nt, Driver::Wgmma, 1) - 1024 - 16 - 4;
            assert_eq!(stage % 1024, 0, "{nt}");
            assert_eq!(stage, (128 + 8 * nt) * 64 * 2, "{nt}: no padding needed");
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
        assert_eq!(workspace_len(&p, 1, 0), 120 * 1024 * 2);
        assert_eq!(workspace_len(&p, 16, 1), 120 * 1024 * 32 + 120);
    }
}
