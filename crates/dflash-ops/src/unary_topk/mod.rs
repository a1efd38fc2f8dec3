//! Unary top-16: the DFlash2 selector's candidate list per mask column, the proposal head
//! fused with a stable top-16 (global token ids and their FP32 scores); the `[n, rows]`
//! logits are never stored.
//!
//! Semantics. For each column `i < n`, with the logits `l[i, k] = sum_h hidden[i, h] *
//!   head[k, h]` of [`crate::proposal_argmax`] (FP32 values), the candidates are the pairs
//!   `(l[i, k], id(k))` for the full head ([`ProposalHead::Full`]): `k < public_vocab`,
//!   `id(k) = k` (rows `public_vocab..rows` are never candidates); for the indexed head
//!   ([`ProposalHead::Indexed`]): every `k < rows`, `id(k) = token_ids[k]`. Order the
//!   candidates by score descending, exact ties by LOWER global id (a total order). `scores[i,
//!   j]` and `ids[i, j]` are the `j`-th candidate, `j < 16`. No penalties, temperature,
//!   top-k/top-p/min-p or other target sampling controls apply.
//! Shapes. hidden: `[n, H]` BF16; head: `[rows, H]` BF16; token_ids: `[rows]` I32 (indexed
//!   head only); scores: `[n, 16]` F32; ids: `[n, 16]` I32; workspace: at least
//!   [`workspace_len`] f32.
//! Dtypes and rounding. `scores` are the selected FP32 logits (CPU: the f64 dot product
//!   rounded once; CUDA: FP32 accumulation), not rounded further.
//! Non-finite values. As [`crate::proposal_argmax`]: the CPU refuses a column whose candidate
//!   logits contain NaN; CUDA ranks a NaN logit as `-inf` (and stores `-inf` if such a
//!   candidate is selected).
//! Caller guarantees. At least 16 candidates (`public_vocab >= 16` for the full head,
//!   `rows >= 16` for the indexed head; checked on both backends as static shapes). `H` a
//!   multiple of 8 in `8..=65536`. Indexed: `token_ids` unique, each in `0..public_vocab`
//!   (checked on the CPU; CUDA only copies them to the output).
//! Writes. Exactly `scores[0..16n]` and `ids[0..16n]`; on CUDA also the first
//!   [`workspace_len`] elements of `workspace` (scratch; its content on entry does not
//!   matter). Inputs are never written.
//! Accumulation. Implementation choice (FP32); the oracle is f64 from the represented inputs.
//! Comparison. scores: exact (bits); ids: exact, on inputs whose logits are exact in FP32 for
//!   any summation order (see [`crate::proposal_argmax`]); real-valued inputs are covered by
//!   the whole-draft-block cases.
//!
//! CUDA (kernels/unary_topk.cu, compiled after kernels/proposal_argmax.cu whose fused head
//! GEMM drivers, portable and sm_90a, it shares). Each GEMM warpgroup keeps a running top-16
//! per column in shared memory, whose 16th entry is the column's threshold. A column's 128
//! logits of a tile are held by 32 threads, 4 each. A list that still has empty entries (a
//! warpgroup's first tile) first gets a floor from the tile: f, the 16th largest of the 32
//! holders' best candidate logits; 16 distinct candidates score at least f, so nothing below
//! f can end in the top 16, and the list's entries that do not beat (f, no id) become (f, no
//! id): the list is full at threshold f (its floor entries rank after every candidate scoring
//! f, and the tile's at least 16 candidates at f or above push them all out). The columns
//! past `n` of the last column chunk (padding, all-zero logits) keep no list. Shared floors:
//! after each tile a warpgroup publishes its full list's 16th value per column (`atomicMax`
//! of an order-preserving key in the workspace, after the partials, zeroed before each
//! launch), and before each tile it raises its lists to the largest value published (the
//! entries that do not beat (g, no id) become (g, no id)); such a value is backed by 16
//! distinct candidates scoring at least it, so this is exact, and a warpgroup's threshold
//! follows the best rows all warpgroups have seen. Floor entries may stay in a partial list,
//! but never reach the merged result (16 candidates beat each). After every tile, passes run until no holder has a logit left that beats its
//! column's threshold: a holder skips the column with one compare when the max of its 4
//! logits is below a full list's threshold (or equals it while none of its ids is below the
//! threshold's: ties, as zero or duplicate head rows give, beat it only with a lower id); it
//! appends all its winners at once (one atomic reserves their slots of the column's 32-slot
//! candidate buffer; winners past the 32 slots wait for another pass, at a higher threshold),
//! so a tile takes one pass for spread logits (about 20 candidates on a first tile, a few on
//! later ones). Only a list whose floor is -inf (fewer than 16 holders with a candidate) stays
//! with empty entries; there a holder appends only its best logit that beats the threshold
//! and asks for another pass if a second one does. The candidates are then merged into the
//! list: from 64 columns on by the column's own thread (the list in registers, one
//! compare-and-shift insertion each, all columns at once), below that by one warp per
//! column, by rank. This is exact because thresholds only rise.
//! Each warpgroup writes its list per column; the merge (one block of 16 warps per column)
//! takes the top 16 of the P * 16 partials: a warp holds a list one entry a lane and folds the
//! partial lists into it one at a time (the next list reversed in the upper 16 lanes, then a
//! bitonic merge across the lanes in 5 shuffle stages), skipping a list whose best entry does
//! not beat its 16th; the warps' lists are then folded pairwise the same way.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod reference;
#[cfg(test)]
mod tests;

use half::bf16;

#[cfg(any(test, feature = "conformance"))]
use crate::Element;
use crate::proposal_argmax::head;
#[cfg(any(test, feature = "conformance"))]
use crate::proposal_argmax::{
    Mix, OFFICIAL_HIDDEN_27B, OFFICIAL_HIDDEN_35B, OFFICIAL_PUBLIC, OFFICIAL_ROWS,
    OFFICIAL_SHORTLIST, exact_head_inputs,
};
pub use crate::proposal_argmax::{Params, ProposalHead};
#[cfg(any(test, feature = "conformance"))]
use crate::registry::{Case, CaseRun, Criterion, InputCheck, output};
use crate::{Backend, Buffer, OpsError, Result, check_len};

/// Registry id.
pub const OP: &str = "unary_topk";

/// Candidates kept per column (fixed by the DFlash2 contract).
pub const TOP_K: usize = 16;

/// Candidate slots per column and pass of the CUDA epilogue (`UT_CAP`: one per holder while
/// the list is not full).
#[cfg(any(feature = "cuda", test))]
const CANDIDATE_SLOTS: usize = 32;

/// The top-16 epilogue of the fused head GEMM: the running lists, the candidate counts and
/// the candidate buffers (`PhTopk<NT>::SMEM_BYTES`), 4 wgmma pipeline stages so that two
/// states fit beside them (`PhTopk<NT>::WG_STAGES`).
#[cfg(any(feature = "cuda", test))]
pub(crate) const EPILOGUE: crate::proposal_argmax::head::Epilogue =
    crate::proposal_argmax::head::Epilogue {
        bytes: |nt| 8 * nt * (TOP_K * 8 + 4 + CANDIDATE_SLOTS * 8),
        wgmma_stages: 4,
    };

/// f32 elements the `workspace` of [`run`] must have at least: `n * 1024 * 32 + n` (a top-16
/// list of (value, id) partials per column for each of at most 1024 GEMM blocks, then one
/// shared floor word per column).
pub fn workspace_len(p: &Params) -> usize {
    head::workspace_len(p, TOP_K, FLOOR_WORDS)
}

/// Workspace words per column after the partials: the column's shared floor key
/// (kernels/unary_topk.cu, `ut_key`; the launcher zeroes them before each launch).
const FLOOR_WORDS: usize = 1;

/// Select the top-16 candidates of each of `n` columns (see the module contract).
/// `token_ids` is `None` for the full head and the `[rows]` map for the indexed head. A
/// refused call leaves `scores` and `ids` untouched.
pub fn run(
    be: &Backend,
    hidden: &Buffer<bf16>,
    head_w: &Buffer<bf16>,
    token_ids: Option<&Buffer<i32>>,
    scores: &mut Buffer<f32>,
    ids: &mut Buffer<i32>,
    workspace: &mut Buffer<f32>,
    params: &Params,
) -> Result<()> {
    head::check(OP, params, hidden, head_w, token_ids, TOP_K)?;
    let n = params.n;
    let out_len = n.checked_mul(TOP_K).ok_or_else(|| OpsError::Param {
        op: OP,
        param: "n",
        expected: "n * 16 to fit in usize".into(),
        found: n.to_string(),
    })?;
    check_len(OP, "scores", scores.len(), out_len, || {
        format!("[n={n}, 16]")
    })?;
    check_len(OP, "ids", ids.len(), out_len, || format!("[n={n}, 16]"))?;
    head::check_workspace(OP, params, TOP_K, FLOOR_WORDS, workspace)?;
    if n == 0 {
        return Ok(());
    }
    match be {
        Backend::Cpu => {
            let h = head::host_logits(OP, params, hidden, head_w, token_ids)?;
            workspace.host(OP, "workspace")?;
            // Both outputs are validated to exist before either is written.
            let s = scores.host_mut(OP, "scores")?;
            let d = ids.host_mut(OP, "ids")?;
            reference::run(&h.logits, h.map, s, d, params.rows, h.considered);
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(c) => cuda::run(c, hidden, head_w, token_ids, scores, ids, workspace, params),
    }
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
        let p = Params {
            n,
            rows,
            hidden,
            public_vocab,
            head: kind,
        };
        run_case(be, &p, &x, &w, map.as_deref())
    }
}

/// Builds a case's hidden `[n, H]` and head `[rows, H]` from `(n, rows, H)`.
#[cfg(any(test, feature = "conformance"))]
type Inputs = fn(usize, usize, usize) -> (Vec<bf16>, Vec<bf16>);

/// A full-head case of `n` columns over `rows` head rows of width `hidden` whose inputs
/// `make(n, rows, hidden)` builds.
#[cfg(any(test, feature = "conformance"))]
fn full_case(
    n: usize,
    rows: usize,
    hidden: usize,
    public_vocab: usize,
    make: Inputs,
) -> impl Fn(&Backend) -> Result<CaseRun> + Send + Sync {
    move |be: &Backend| {
        let (x, w) = make(n, rows, hidden);
        let p = Params {
            n,
            rows,
            hidden,
            public_vocab,
            head: ProposalHead::Full,
        };
        run_case(be, &p, &x, &w, None)
    }
}

/// Logits that rise with the row in every column (column i: 2^(i % 5) times the row index,
/// negated for every third column, so those columns' best rows come first): every later tile
/// of a block beats everything before it, so each tile's 128 winners of a rising column
/// overflow the epilogue's candidate buffer and must come in several passes. Exact: head row r
/// is (r's top, middle and low 8 bits, 0...), each a BF16, and the hidden columns hold one
/// power of two in their first three entries (so `rows` < 2^24 and `hidden` >= 3).
#[cfg(any(test, feature = "conformance"))]
fn rising_inputs(n: usize, rows: usize, hidden: usize) -> (Vec<bf16>, Vec<bf16>) {
    let mut x = vec![bf16::ZERO; n * hidden];
    for i in 0..n {
        let s = f32::from(1u8 << (i % 5)) * if i % 3 == 2 { -1.0 } else { 1.0 };
        x[i * hidden..i * hidden + 3].fill(bf16::from_f32(s));
    }
    let mut w = vec![bf16::ZERO; rows * hidden];
    for r in 0..rows {
        let v = r as u32;
        for (k, part) in [v & 0xff_0000, v & 0xff00, v & 0xff]
            .into_iter()
            .enumerate()
        {
            w[r * hidden + k] = bf16::from_f32(part as f32);
        }
    }
    (x, w)
}

/// Logits all equal within a column (column i: 2^(i % 5)): every block's lists fill with
/// exact ties, every later logit ties with the threshold, and the top 16 of every column must
/// still be ids 0..15 (ties to the lower id across blocks, tiles, holders and the merge).
#[cfg(any(test, feature = "conformance"))]
fn equal_inputs(n: usize, rows: usize, hidden: usize) -> (Vec<bf16>, Vec<bf16>) {
    let mut x = vec![bf16::ZERO; n * hidden];
    for i in 0..n {
        x[i * hidden] = bf16::from_f32(f32::from(1u8 << (i % 5)));
    }
    let mut w = vec![bf16::ZERO; rows * hidden];
    for r in 0..rows {
        w[r * hidden] = bf16::ONE;
    }
    (x, w)
}

/// Run one conformance case of shape `params` on `be` with these inputs: poisoned outputs
/// and workspace, the inputs checked unchanged afterwards.
#[cfg(any(test, feature = "conformance"))]
fn run_case(
    be: &Backend,
    params: &Params,
    x: &[bf16],
    w: &[bf16],
    map: Option<&[i32]>,
) -> Result<CaseRun> {
    let n = params.n;
    let mut inputs = InputCheck::default();
    let hx = inputs.upload(be, "hidden", x)?;
    let hw = inputs.upload(be, "head", w)?;
    let t = match map {
        Some(m) => Some(inputs.upload(be, "token_ids", m)?),
        None => None,
    };
    let mut scores = be.filled(n * TOP_K, f32::POISON)?;
    let mut ids = be.filled(n * TOP_K, i32::POISON)?;
    let mut ws = be.filled(workspace_len(params), f32::POISON)?;
    run(
        be,
        &hx,
        &hw,
        t.as_ref(),
        &mut scores,
        &mut ids,
        &mut ws,
        params,
    )?;
    let mut modified = Vec::new();
    inputs.verify(be, "hidden", &hx, &mut modified)?;
    inputs.verify(be, "head", &hw, &mut modified)?;
    if let Some(t) = &t {
        inputs.verify(be, "token_ids", t, &mut modified)?;
    }
    let s = output(
        "scores",
        Criterion::Exact,
        &vec![f32::POISON; n * TOP_K],
        &be.download(&scores)?,
        |_| true,
    );
    let d = output(
        "ids",
        Criterion::Exact,
        &vec![i32::POISON; n * TOP_K],
        &be.download(&ids)?,
        |_| true,
    );
    Ok(CaseRun {
        outputs: vec![s, d],
        modified_inputs: modified,
    })
}

/// Conformance cases: the official Text head (248320 rows, 248077 public) with the 27B width
/// at 7 and 15 columns, 120 columns (the widest column tile) at the 35B width, the official
/// 131072-row shortlist with a shuffled map, coarse fills with many ties among the 16, rising
/// and all-equal logits (60000 rows; rising also with only 1500 or 3000 public rows, so most
/// GEMM blocks have no candidate at all), and small odd shapes (100 columns for the wgmma
/// driver).
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn cases() -> Vec<Case> {
    use ProposalHead::{Full, Indexed};
    let (v, pv, sl) = (OFFICIAL_ROWS, OFFICIAL_PUBLIC, OFFICIAL_SHORTLIST);
    let (h35, h27) = (OFFICIAL_HIDDEN_35B, OFFICIAL_HIDDEN_27B);
    let mut cases = vec![
        Case::new(
            OP,
            "full_small_rows_100_public_77_h16_n9_coarse",
            case(9, 100, 16, 77, Full, true, 1),
        ),
        Case::new(
            OP,
            "indexed_small_rows_50_public_300_h40_n9",
            case(9, 50, 40, 300, Indexed, false, 2),
        ),
        // 100 columns: the wgmma driver's 128-column tile on sm_90a, with many ties.
        Case::new(
            OP,
            "indexed_rows_20000_public_30000_h136_n100_coarse",
            case(100, 20_000, 136, 30_000, Indexed, true, 9),
        ),
    ];
    // 60000 rows of width 64, at 120 columns (the thread merge) and 9 (the warp merge): rising
    // logits (every tile's winners overflow the candidate buffer) and logits all equal within
    // a column (ties with every threshold).
    let fixtures: [(&str, Inputs); 2] = [("rising", rising_inputs), ("equal", equal_inputs)];
    for (kind, make) in fixtures {
        for n in [120, 9] {
            cases.push(Case::new(
                OP,
                format!("full_{kind}_rows_60000_h64_n{n}"),
                full_case(n, 60_000, 64, 59_993, make),
            ));
        }
    }
    // Rising logits with only the first 1500 or 3000 of 60000 rows public, at 120 columns:
    // most blocks' rows hold no candidate (their lists stay empty, each tile's floor -inf),
    // and the negated columns' top 16 are in the first block's first tile.
    for public in [1500, 3000] {
        cases.push(Case::new(
            OP,
            format!("full_rising_rows_60000_public_{public}_h64_n120"),
            full_case(120, 60_000, 64, public, rising_inputs),
        ));
    }
    cases.extend([
        Case::new(
            OP,
            "full_official_h5120_n7",
            case(7, v, h27, pv, Full, false, 3),
        )
        .heavy(),
        Case::new(
            OP,
            "full_official_h5120_n15_coarse",
            case(15, v, h27, pv, Full, true, 4),
        )
        .heavy(),
        Case::new(
            OP,
            "full_official_h2048_n120",
            case(120, v, h35, pv, Full, false, 5),
        )
        .heavy(),
        Case::new(
            OP,
            "full_official_h2048_n33_coarse",
            case(33, v, h35, pv, Full, true, 6),
        )
        .heavy(),
        Case::new(
            OP,
            "indexed_official_shortlist_h5120_n15",
            case(15, sl, h27, pv, Indexed, false, 7),
        )
        .heavy(),
        Case::new(
            OP,
            "indexed_official_shortlist_h2048_n64_coarse",
            case(64, sl, h35, pv, Indexed, true, 8),
        )
        .heavy(),
    ]);
    cases
}
