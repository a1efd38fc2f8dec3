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

/// Bytes of the fused GEMM's shared memory pipeline for `nt` column tiles
/// (`PhCfg<NT>::PIPE_BYTES`: 3 stages of a 128 x 64 head tile and an 8*nt x 64 hidden tile,
/// rows padded to 72 elements).
#[cfg(any(feature = "cuda", test))]
pub(crate) fn pipe_bytes(nt: usize) -> usize {
    3 * (128 * 72 + 8 * nt * 72) * 2
}

/// Column tiles the kernels are instantiated for (8 columns each).
#[cfg(any(feature = "cuda", test))]
pub(crate) const NT_CHOICES: [usize; 5] = [1, 2, 4, 8, 16];

/// The column tiling for `n` columns: the smallest instantiated `nt` with `8 * nt >= n`,
/// capped at the largest whose shared memory (`smem(nt)`) fits `limit` bytes. `None` when
/// not even `nt = 1` fits.
#[cfg(any(feature = "cuda", test))]
pub(crate) fn choose_nt(n: usize, limit: usize, smem: impl Fn(usize) -> usize) -> Option<usize> {
    let mut fits = NT_CHOICES.iter().copied().filter(|&nt| smem(nt) <= limit);
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

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    //! Launch of the fused head GEMM (`{prefix}_nt{NT}`), shared by both head ops.

    use cudarc::driver::{LaunchConfig, PushKernelArg};
    use half::bf16;

    use super::{MAX_PARTIAL_BLOCKS, Params, choose_nt};
    use crate::cuda::{CudaBackend, cuda_err};
    use crate::{Buffer, OpsError, Result};

    /// Threads of a GEMM block (`PH_THREADS`).
    const THREADS: u32 = 128;

    /// Launch the fused GEMM of module `op` (source `source`) whose entry points are
    /// `names[i]` for `nt = NT_CHOICES[i]`, with `smem(nt)` bytes of dynamic shared memory;
    /// returns the number of partial blocks written per column (the merge's `P`).
    ///
    /// Grid: x = P = min(ceil(rows / 16), resident blocks, 1024) row ranges of equal length
    /// (a multiple of 16 rows), y = ceil(n / (8 * nt)) column chunks.
    pub(crate) fn launch_gemm(
        c: &CudaBackend,
        op: &'static str,
        source: &str,
        names: [&'static str; 5],
        smem: impl Fn(usize) -> usize,
        hidden: &Buffer<bf16>,
        head: &Buffer<bf16>,
        token_ids: Option<&Buffer<i32>>,
        workspace: &mut Buffer<f32>,
        p: &Params,
    ) -> Result<usize> {
        let limit = c.limits().smem_per_block_optin;
        let nt = choose_nt(p.n, limit, &smem).ok_or_else(|| OpsError::Cuda {
            context: format!("preparing {op}"),
            message: format!(
                "the smallest head tile needs {} bytes of shared memory; this device allows {limit}",
                smem(1)
            ),
        })?;
        let idx = super::NT_CHOICES.iter().position(|&x| x == nt).unwrap_or(0);
        let name = names[idx];
        let bytes = smem(nt);
        let kernel = c.kernel(op, source, name, THREADS, bytes)?;
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
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: bytes as u32,
        };
        let (n, rows, h, public) = (
            p.n as i32,
            p.rows as i32,
            p.hidden as i32,
            p.public_vocab as i32,
        );
        let mut b = c.stream().launch_builder(&kernel.func);
        b.arg(hidden.device(op, "hidden")?);
        b.arg(head.device(op, "head")?);
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
        // SAFETY: argument types and order match the `{op}_gemm_nt{NT}` entry points (a null
        // pointer is a valid `const int*` for the full head, never dereferenced there);
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
        assert_eq!(choose_nt(1, big, pipe_bytes), Some(1));
        assert_eq!(choose_nt(7, big, pipe_bytes), Some(1));
        assert_eq!(choose_nt(9, big, pipe_bytes), Some(2));
        assert_eq!(choose_nt(15, big, pipe_bytes), Some(2));
        assert_eq!(choose_nt(120, big, pipe_bytes), Some(16));
        assert_eq!(choose_nt(1000, big, pipe_bytes), Some(16));
        // A 99 KiB device caps the tile (more column chunks instead).
        let nt = choose_nt(120, 99 * 1024, pipe_bytes).expect("fits");
        assert!(pipe_bytes(nt) <= 99 * 1024 && nt < 16, "{nt}");
        assert_eq!(choose_nt(1, 1000, pipe_bytes), None);
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
