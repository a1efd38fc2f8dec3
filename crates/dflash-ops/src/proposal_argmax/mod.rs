//! Proposal argmax: the DFlash proposal head fused with its decision, one global token id per
//! mask column; the `[n, rows]` logits are never stored.
//!
//! Semantics. For each column `i < n` and head row `k < rows`, the logit is
//!   `l[i, k] = sum_h hidden[i, h] * head[k, h]` over the represented BF16 values.
//! - Full head ([`ProposalHead::Full`], the Text head `[V_rows, H]`): `ids[i] = argmax_{k <
//!   public_vocab} l[i, k]`. Rows `public_vocab..rows` (the padded, never-real tail) are never
//!   proposed, whatever they hold.
//! - Indexed head ([`ProposalHead::Indexed`], a shortlist gathered from the Text head): every
//!   shortlist row `k < rows` stands for the global id `token_ids[k]`; `ids[i] =
//!   token_ids[argmax_k l[i, k]]`.
//!
//! Shapes. hidden: `[n, H]` BF16 (the final-normed mask columns); head: `[rows, H]` BF16
//!   (row-major, the checkpoint's `[out, in]`); token_ids: `[rows]` I32 (indexed head only);
//!   ids: `[n]` I32 (global token ids); workspace: at least [`workspace_len`] f32.
//! Dtypes and rounding points. The logit is an FP32 value: the CPU reference rounds the f64 dot
//!   product once to f32; CUDA accumulates it in FP32 (tensor cores). The decision compares
//!   those FP32 values; nothing else is rounded.
//! Tie-breaking. Exact ties (`==` in FP32) go to the LOWER GLOBAL id (for the indexed head the
//!   lower `token_ids[k]`, not the lower shortlist row). The order is total, so the result does
//!   not depend on the reduction order.
//! Non-finite values. Only non-finite inputs make non-finite logits. NaN: the CPU refuses a
//!   column whose candidate logits contain NaN ([`OpsError::Value`] on `hidden`, index = the
//!   column; NaN in the ignored tail of a full head is allowed); CUDA, which never reads data
//!   back, ranks a NaN logit as `-inf`. `+-inf` are ordinary values.
//! Caller guarantees. `H` a multiple of 8 in `8..=65536`. Indexed: `token_ids` unique, each in
//!   `0..public_vocab` (checked on the CPU; on CUDA the ids are only copied to the output,
//!   never used as addresses). `public_vocab` is a per-deployment launch scalar.
//! Writes. Exactly `ids[0..n]`; on CUDA also the first [`workspace_len`] elements of
//!   `workspace` (scratch, contents unspecified afterwards; the CPU does not touch it). Inputs
//!   are never written.
//! Accumulation. Implementation choice (FP32); the oracle is f64 from the represented inputs.
//! Comparison. ids: exact. The conformance cases use inputs whose logits are exact in FP32 for
//!   any summation order (every product a multiple of 2^-8 of magnitude <= 1 and H <= 5120,
//!   so every partial sum needs at most 21 significant bits), so every decision, tie-breaks
//!   included, is compared exactly; real-valued inputs are covered by the whole-draft-block
//!   cases.
//!
//! CUDA (kernels/proposal_argmax.cu, whose GEMM drivers `unary_topk` shares; see
//! [`head`]). Fused head GEMM: the head's rows are streamed once; each of the blocks (as many
//! as are resident on the device) owns an equal contiguous range of rows (a multiple of 16)
//! and walks it in tiles of 128 rows x up to 128 columns, BF16 in, FP32 accumulate, over
//! 64-wide K chunks. Two drivers compute a tile (same work split, same epilogue):
//! - portable (sm_80 and later): one warpgroup, mma.m16n8k16 over a 3-stage cp.async pipeline
//!   that runs across tiles;
//! - sm_90a (compute capability 9.0 and `CudaOptions::kernels` = `Auto`, any column count):
//!   a producer warpgroup (one thread issuing TMA, its registers handed to the consumers with
//!   setmaxnreg) streams the chunks through 5 stages (4 for the top-16), each announced full
//!   and handed back by mbarriers, with a ticket per stage naming the chunk it holds; two
//!   consumer warpgroups take the tiles in turn, each running two m64nNk16 wgmma chains per
//!   tile (N = 8 to 128 columns) from 128-byte swizzled shared memory and handing each
//!   stage back as soon as its chunk's wgmma group has completed (before waiting for the
//!   next), so one runs its epilogue while the other consumes the stream.
//!   `KernelVariants::Portable` forces the first.
//!
//! After each tile the warpgroup folds the tile's logits into its running best per column in
//! shared memory (warp shuffles, then the four warps); at the end it writes one (value, id)
//! partial per column (P = blocks x warpgroups <= 1024 partials), and a merge kernel (one
//! block per column) picks the best of the P partials.
//! Columns beyond 128 (or beyond what the device's shared memory allows) use more column
//! chunks, each streaming the head again.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
pub mod head;
mod reference;
#[cfg(test)]
pub(crate) mod tests;

use half::bf16;

#[cfg(any(test, feature = "conformance"))]
use crate::Element;
#[cfg(any(test, feature = "conformance"))]
use crate::registry::{Case, CaseRun, Criterion, InputCheck, output};
use crate::{Backend, Buffer, OpsError, Result, check_len, check_param};
pub(crate) use reference::beats as reference_beats;

/// Registry id.
pub const OP: &str = "proposal_argmax";

/// Which proposal head produced the logits (shared with [`crate::unary_topk`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProposalHead {
    /// The full Text head: logit row `v` is global token `v`; only rows `0..public_vocab`
    /// are candidates. No `token_ids` buffer is passed.
    Full,
    /// A shortlist head: logit row `k` is global token `token_ids[k]`; every row is a
    /// candidate. A `token_ids` buffer of `rows` unique ids below `public_vocab` is passed.
    Indexed,
}

/// Parameters of [`run`] and of [`crate::unary_topk::run`] (static shapes: launch scalars on
/// CUDA).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Params {
    /// Number of columns (mask columns over the batch); 0 is a no-op.
    pub n: usize,
    /// The head's row count (`V_rows`, e.g. 248320 for the Text head or 131072 for a
    /// shortlist).
    pub rows: usize,
    /// The hidden width H (a multiple of 8).
    pub hidden: usize,
    /// The public vocabulary size (248077 for Qwen3.5): full-head candidates are rows
    /// `0..public_vocab`; indexed-head ids must lie below it. `1 <= public_vocab`, and
    /// `public_vocab <= rows` for the full head.
    pub public_vocab: usize,
    /// Which head.
    pub head: ProposalHead,
}

/// Largest head row count (and public vocabulary) the proposal ops accept: 2^30.
pub const MAX_ROWS: usize = 1 << 30;

/// The argmax epilogue of the fused head GEMM: warp bests and running bests per column
/// (`PhArgmax<NT>::SMEM_BYTES`), 5 wgmma pipeline stages (`PhArgmax<NT>::WG_STAGES`).
#[cfg(any(feature = "cuda", test))]
pub(crate) const EPILOGUE: head::Epilogue = head::Epilogue {
    bytes: |nt| 5 * 8 * nt * 8,
    wgmma_stages: 5,
};

/// Check the shape parameters shared by `proposal_argmax` and `unary_topk`.
pub(crate) fn check_head_params(
    op: &'static str,
    rows: usize,
    public_vocab: usize,
    head: ProposalHead,
    token_ids: Option<&Buffer<i32>>,
    min_candidates: usize,
) -> Result<()> {
    // 2^30 keeps every device index and loop bound far from i32 overflow.
    check_param(op, "rows", (1..=MAX_ROWS).contains(&rows), rows, || {
        format!("1..={MAX_ROWS}")
    })?;
    check_param(
        op,
        "public_vocab",
        (1..=MAX_ROWS).contains(&public_vocab),
        public_vocab,
        || format!("1..={MAX_ROWS}"),
    )?;
    match head {
        ProposalHead::Full => {
            check_param(
                op,
                "public_vocab",
                public_vocab <= rows,
                public_vocab,
                || format!("<= rows ({rows}) for the full head"),
            )?;
            check_param(
                op,
                "public_vocab",
                public_vocab >= min_candidates,
                public_vocab,
                || format!(">= {min_candidates} candidates"),
            )?;
            check_param(op, "token_ids", token_ids.is_none(), "a buffer", || {
                "None for the full head".into()
            })?;
        }
        ProposalHead::Indexed => {
            check_param(op, "rows", rows >= min_candidates, rows, || {
                format!(">= {min_candidates} shortlist rows")
            })?;
            match token_ids {
                Some(t) => check_len(op, "token_ids", t.len(), rows, || format!("[rows={rows}]"))?,
                None => {
                    return Err(OpsError::Param {
                        op,
                        param: "token_ids",
                        expected: "a [rows] buffer for the indexed head".into(),
                        found: "None".into(),
                    });
                }
            }
        }
    }
    Ok(())
}

/// CPU check of an indexed head's map: every id in `0..public_vocab`, no duplicate.
pub(crate) fn validate_token_ids(
    op: &'static str,
    token_ids: &[i32],
    public_vocab: usize,
) -> Result<()> {
    let mut seen = vec![false; public_vocab];
    for (k, &t) in token_ids.iter().enumerate() {
        let slot = usize::try_from(t)
            .ok()
            .filter(|&t| t < public_vocab)
            .ok_or_else(|| OpsError::Value {
                op,
                tensor: "token_ids",
                index: k,
                expected: format!("a global id in 0..{public_vocab}"),
                found: t.to_string(),
            })?;
        if std::mem::replace(&mut seen[slot], true) {
            return Err(OpsError::Value {
                op,
                tensor: "token_ids",
                index: k,
                expected: "ids unique across the shortlist".into(),
                found: format!("{t} (repeated)"),
            });
        }
    }
    Ok(())
}

/// f32 elements the `workspace` of [`run`] must have at least: `n * 1024 * 2` (one
/// (value, id) partial per column for each of at most 1024 GEMM blocks).
pub fn workspace_len(p: &Params) -> usize {
    head::workspace_len(p, 1, 0)
}

/// Pick, for each of `n` columns, the best candidate's global id (see the module contract).
/// `token_ids` is `None` for [`ProposalHead::Full`] and the `[rows]` map for
/// [`ProposalHead::Indexed`]. A refused call leaves `ids` untouched.
pub fn run(
    be: &Backend,
    hidden: &Buffer<bf16>,
    head_w: &Buffer<bf16>,
    token_ids: Option<&Buffer<i32>>,
    ids: &mut Buffer<i32>,
    workspace: &mut Buffer<f32>,
    params: &Params,
) -> Result<()> {
    head::check(OP, params, hidden, head_w, token_ids, 1)?;
    let n = params.n;
    check_len(OP, "ids", ids.len(), n, || format!("[n={n}]"))?;
    head::check_workspace(OP, params, 1, 0, workspace)?;
    if n == 0 {
        return Ok(());
    }
    match be {
        Backend::Cpu => {
            let h = head::host_logits(OP, params, hidden, head_w, token_ids)?;
            // The workspace must still live on this backend.
            workspace.host(OP, "workspace")?;
            reference::run(
                &h.logits,
                h.map,
                ids.host_mut(OP, "ids")?,
                params.rows,
                h.considered,
            );
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(c) => cuda::run(c, hidden, head_w, token_ids, ids, workspace, params),
    }
}

/// Deterministic fixture generator (SplitMix64), shared by this module's sibling ops.
#[derive(Clone, Debug)]
#[cfg(any(test, feature = "conformance"))]
pub(crate) struct Mix(pub(crate) u64);

#[cfg(any(test, feature = "conformance"))]
impl Mix {
    /// SplitMix64's state increment: the stream after `k` words is `Mix(seed + k * GAMMA)`.
    const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

    /// The next 64 random bits.
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(Self::GAMMA);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform f32 in [lo, hi) (24-bit resolution).
    pub(crate) fn f32_in(&mut self, lo: f32, hi: f32) -> f32 {
        let u = (self.next_u64() >> 40) as f32 * (1.0 / 16_777_216.0);
        lo + (hi - lo) * u
    }

    /// A uniform integer in 0..n (n >= 1; the tiny modulo bias is irrelevant for fixtures).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// `count` distinct ids drawn from `0..universe`, in shuffled order (partial Fisher-Yates).
    pub(crate) fn distinct_shuffled(&mut self, universe: usize, count: usize) -> Vec<i32> {
        let mut all: Vec<i32> = (0..universe as i32).collect();
        for i in 0..count.min(universe) {
            let j = i + self.below(universe - i);
            all.swap(i, j);
        }
        all.truncate(count);
        all
    }
}

/// Official Text head rows (Qwen3.5, padded).
#[cfg(any(test, feature = "conformance"))]
pub(crate) const OFFICIAL_ROWS: usize = 248_320;
/// Official public vocabulary (tokenizer ids).
#[cfg(any(test, feature = "conformance"))]
pub(crate) const OFFICIAL_PUBLIC: usize = 248_077;
/// Official shortlist rows of the indexed head.
#[cfg(any(test, feature = "conformance"))]
pub(crate) const OFFICIAL_SHORTLIST: usize = 131_072;

/// Conformance inputs of a head case whose logits are exact in FP32 for any summation order
/// (see the module contract): hidden `[n, H]` and head `[rows, H]` with entries that are
/// multiples of 1/8 in [-1, 1], plus planted rows per column: twins (equal content, hence
/// exactly tied logits in every column) at three levels, `hidden[i]`, `hidden[i] / 2` and
/// `hidden[i] / 4` (multiples of 1/32), whose logits dominate every random row. A full head
/// also gets a row `2 * hidden[i]` (clipped to [-1, 1]) in the ignored tail for each column.
/// With `coarse`, every random entry is -1/2, 0 or 1/2, so random logits are multiples of
/// 1/4 and the random rows among a top-16 tie often too.
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn exact_head_inputs(
    mix: &mut Mix,
    n: usize,
    rows: usize,
    hidden: usize,
    public_vocab: usize,
    head: ProposalHead,
    coarse: bool,
) -> (Vec<bf16>, Vec<bf16>) {
    // Eight entries per 64 random bits (one byte each, reduced mod 17 or 3: the slight bias
    // is irrelevant for fixtures; the official heads hold over a billion entries).
    let levels: [bf16; 17] = std::array::from_fn(|k| {
        bf16::from_f32(if coarse {
            (k % 3) as f32 / 2.0 - 0.5
        } else {
            (k as f32 - 8.0) / 8.0
        })
    });
    let modulus = if coarse { 3 } else { 17 };
    let x: Vec<bf16> = fill_levels(mix, n * hidden, &levels[..modulus]);
    let mut w: Vec<bf16> = fill_levels(mix, rows * hidden, &levels[..modulus]);
    let candidates = match head {
        ProposalHead::Full => public_vocab,
        ProposalHead::Indexed => rows,
    };
    // Six distinct candidate rows per column (as long as there are enough rows).
    let mut planted = mix.distinct_shuffled(candidates, (6 * n).min(candidates));
    planted.reverse();
    for i in 0..n {
        let xi = &x[i * hidden..(i + 1) * hidden];
        for (j, scale) in [1.0f32, 1.0, 0.5, 0.5, 0.25, 0.25].into_iter().enumerate() {
            let Some(&row) = planted.get(6 * i + j) else {
                break;
            };
            let row = row as usize;
            for (dst, v) in w[row * hidden..(row + 1) * hidden].iter_mut().zip(xi) {
                *dst = bf16::from_f32(v.to_f32() * scale);
            }
        }
        if head == ProposalHead::Full && public_vocab < rows {
            let row = public_vocab + mix.below(rows - public_vocab);
            for (dst, v) in w[row * hidden..(row + 1) * hidden].iter_mut().zip(xi) {
                *dst = bf16::from_f32((2.0 * v.to_f32()).clamp(-1.0, 1.0));
            }
        }
    }
    (x, w)
}

/// `len` entries `levels[b % levels.len()]`, one per byte `b` of the stream's words (8 per
/// word, little-endian; the last word's unused bytes are skipped), leaving `mix` after the
/// ceil(len / 8) words it used. Fills of a million words and more (the official heads) run
/// on every core (see [`fill_levels_threads`]).
#[cfg(any(test, feature = "conformance"))]
fn fill_levels(mix: &mut Mix, len: usize, levels: &[bf16]) -> Vec<bf16> {
    let words = len.div_ceil(8);
    let threads = if words < 1 << 20 {
        1
    } else {
        crate::gemm::reference::threads_for(words >> 20)
    };
    fill_levels_threads(mix, len, levels, threads)
}

/// [`fill_levels`] with the words split into `threads` ranges, each generated from its own
/// start (SplitMix64 jumps: word k comes from state seed + (k + 1) GAMMA), so any count gives
/// the same entries; one range runs on the calling thread.
#[cfg(any(test, feature = "conformance"))]
fn fill_levels_threads(mix: &mut Mix, len: usize, levels: &[bf16], threads: usize) -> Vec<bf16> {
    let words = len.div_ceil(8);
    let per = words.div_ceil(threads.max(1)).max(1);
    let start = mix.0;
    let fill = |c: usize, chunk: &mut [bf16]| {
        let mut m = Mix(start.wrapping_add(((c * per) as u64).wrapping_mul(Mix::GAMMA)));
        for dst in chunk.chunks_mut(8) {
            let word = m.next_u64().to_le_bytes();
            for (d, b) in dst.iter_mut().zip(word) {
                *d = levels[usize::from(b) % levels.len()];
            }
        }
    };
    let mut out = vec![bf16::ZERO; len];
    if per >= words {
        fill(0, &mut out);
    } else {
        std::thread::scope(|s| {
            for (c, chunk) in out.chunks_mut(per * 8).enumerate() {
                s.spawn(move || fill(c, chunk));
            }
        });
    }
    mix.0 = start.wrapping_add((words as u64).wrapping_mul(Mix::GAMMA));
    out
}

#[cfg(any(test, feature = "conformance"))]
fn case(
    n: usize,
    rows: usize,
    hidden: usize,
    public_vocab: usize,
    kind: ProposalHead,
    coarse: bool,
    seed: u64,
) -> impl Fn(&Backend) -> Result<CaseRun> + Send + Sync {
    move |be: &Backend| {
        let mut mix = Mix(seed);
        let map = match kind {
            ProposalHead::Full => None,
            ProposalHead::Indexed => Some(mix.distinct_shuffled(public_vocab, rows)),
        };
        let (x, w) = exact_head_inputs(&mut mix, n, rows, hidden, public_vocab, kind, coarse);
        let mut inputs = InputCheck::default();
        let hx = inputs.upload(be, "hidden", &x)?;
        let hw = inputs.upload(be, "head", &w)?;
        let t = match &map {
            Some(m) => Some(inputs.upload(be, "token_ids", m)?),
            None => None,
        };
        let params = Params {
            n,
            rows,
            hidden,
            public_vocab,
            head: kind,
        };
        let mut ids = be.filled(n, i32::POISON)?;
        let mut ws = be.filled(workspace_len(&params), f32::POISON)?;
        run(be, &hx, &hw, t.as_ref(), &mut ids, &mut ws, &params)?;
        let mut modified = Vec::new();
        inputs.verify(be, "hidden", &hx, &mut modified)?;
        inputs.verify(be, "head", &hw, &mut modified)?;
        if let Some(t) = &t {
            inputs.verify(be, "token_ids", t, &mut modified)?;
        }
        let mut out = output(
            "ids",
            Criterion::Exact,
            &vec![i32::POISON; n],
            &be.download(&ids)?,
            |_| true,
        );
        out.allow_constant = n == 1;
        Ok(CaseRun {
            outputs: vec![out],
            modified_inputs: modified,
        })
    }
}

/// Official 35B-A3B hidden width (the DFlash head).
#[cfg(any(test, feature = "conformance"))]
pub(crate) const OFFICIAL_HIDDEN_35B: usize = 2048;
/// Official 27B hidden width (the DFlash2 head).
#[cfg(any(test, feature = "conformance"))]
pub(crate) const OFFICIAL_HIDDEN_27B: usize = 5120;

/// Conformance cases: the official Text head (248320 rows, 248077 public) at 1, 7, 15 and
/// 120 columns (every column tiling of the CUDA kernel), the official 131072-row shortlist
/// with a shuffled map, coarse fills with many ties, and small odd shapes (fewer rows than one
/// tile, a hidden width that is not a multiple of the K chunk, 72 columns for the wgmma
/// driver).
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn cases() -> Vec<Case> {
    use ProposalHead::{Full, Indexed};
    let (v, pv, sl) = (OFFICIAL_ROWS, OFFICIAL_PUBLIC, OFFICIAL_SHORTLIST);
    let h35 = OFFICIAL_HIDDEN_35B;
    vec![
        Case::new(
            OP,
            "full_small_rows_37_public_29_h24_n9",
            case(9, 37, 24, 29, Full, false, 1),
        ),
        Case::new(
            OP,
            "indexed_small_rows_300_public_997_h72_n3_coarse",
            case(3, 300, 72, 997, Indexed, true, 2),
        ),
        // 72 columns: the wgmma driver's 64-column tile twice on sm_90a (three 128-row tiles
        // per block; the hidden width is not a multiple of the 64-element K chunk).
        Case::new(
            OP,
            "full_rows_20000_public_19000_h136_n72",
            case(72, 20_000, 136, 19_000, Full, false, 10),
        ),
        Case::new(
            OP,
            "full_official_h2048_n1",
            case(1, v, h35, pv, Full, false, 3),
        )
        .heavy(),
        Case::new(
            OP,
            "full_official_h2048_n7",
            case(7, v, h35, pv, Full, false, 4),
        )
        .heavy(),
        Case::new(
            OP,
            "full_official_h2048_n15_coarse",
            case(15, v, h35, pv, Full, true, 5),
        )
        .heavy(),
        Case::new(
            OP,
            "full_official_h2048_n120",
            case(120, v, h35, pv, Full, false, 6),
        )
        .heavy(),
        Case::new(
            OP,
            "full_official_h5120_n7",
            case(7, v, OFFICIAL_HIDDEN_27B, pv, Full, false, 7),
        )
        .heavy(),
        Case::new(
            OP,
            "indexed_official_shortlist_h2048_n15",
            case(15, sl, h35, pv, Indexed, false, 8),
        )
        .heavy(),
        Case::new(
            OP,
            "indexed_official_shortlist_h2048_n40_coarse",
            case(40, sl, h35, pv, Indexed, true, 9),
        )
        .heavy(),
    ]
}
