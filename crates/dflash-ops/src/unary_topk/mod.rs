//! Unary top-16: the DFlash2 selector's candidate list per mask column (stable top-16 of the
//! proposal head's logits, mapped to global token ids).
//!
//! The caller computes the head logits of the final-normed mask columns (the anchor column is
//! dropped) with a GEMM; this op selects exactly from the represented F32 values.
//!
//! Semantics. For each column `i < n`, let the candidates be the pairs `(l[i, k], id(k))` for
//!   the full head ([`ProposalHead::Full`]): `k < public_vocab`, `id(k) = k` (rows
//!   `public_vocab..rows` are never candidates); for the indexed head
//!   ([`ProposalHead::Indexed`]): every `k < rows`, `id(k) = token_ids[k]`.
//!   Order the candidates by score descending, exact ties by LOWER global id (a total order;
//!   `-0.0 == +0.0`). `scores[i, j]` and `ids[i, j]` are the `j`-th candidate, `j < 16`.
//!   No penalties, temperature, top-k/top-p/min-p or other target sampling controls apply.
//! Shapes. logits: `[n, rows]` F32; token_ids: `[rows]` I32 (indexed head only);
//!   scores: `[n, 16]` F32; ids: `[n, 16]` I32.
//! Dtypes and rounding. None: `scores` are bit copies of the selected logits.
//! Non-finite values. `+-inf` are ordinary values. NaN: the CPU refuses a NaN among the
//!   candidates with [`OpsError::Value`] (NaN in the ignored full-head tail is allowed); the
//!   CUDA path treats a NaN logit as `-inf` (and stores `-inf` if such a candidate is selected).
//! Caller guarantees. At least 16 candidates (`public_vocab >= 16` for the full head,
//!   `rows >= 16` for the indexed head; checked on both backends as static shapes).
//!   Indexed: `token_ids` unique, each in `0..public_vocab` (checked on the CPU; the CUDA path
//!   only copies them to the output).
//! Writes. Exactly `scores[0..16n]` and `ids[0..16n]`; inputs are never written.
//! Accumulation. None (comparisons only).
//! Comparison. scores: exact (bits); ids: exact.

#[cfg(feature = "cuda")]
mod cuda;
mod reference;
#[cfg(test)]
mod tests;

pub use crate::proposal_argmax::ProposalHead;
use crate::proposal_argmax::{
    HostHead, Mix, OFFICIAL_PUBLIC, OFFICIAL_ROWS, OFFICIAL_SHORTLIST, check_head_params,
    host_head_inputs, planted_logits,
};
use crate::registry::{Case, CaseRun, Criterion, InputCheck, output};
use crate::{Backend, Buffer, Element, OpsError, Result, check_len, check_param};

/// Registry id.
pub const OP: &str = "unary_topk";

/// Candidates kept per column (fixed by the DFlash2 contract).
pub const TOP_K: usize = 16;

/// Parameters of [`run`] (static shapes: launch scalars on CUDA).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Params {
    /// Number of logit columns (mask columns over the batch); 0 is a no-op.
    pub n: usize,
    /// Logit rows per column (the head's row count, e.g. 248320 or a 131072-row shortlist).
    pub rows: usize,
    /// Public vocabulary size: full-head candidates are rows `0..public_vocab`; indexed-head
    /// ids must lie below it.
    pub public_vocab: usize,
    /// Which head.
    pub head: ProposalHead,
}

/// Select the top-16 candidates of each of `n` logit columns (see the module contract).
/// `token_ids` is `None` for the full head and the `[rows]` map for the indexed head. A
/// refused call leaves `scores` and `ids` untouched.
pub fn run(
    be: &Backend,
    logits: &Buffer<f32>,
    token_ids: Option<&Buffer<i32>>,
    scores: &mut Buffer<f32>,
    ids: &mut Buffer<i32>,
    params: &Params,
) -> Result<()> {
    let Params {
        n,
        rows,
        public_vocab,
        head,
    } = *params;
    check_head_params(OP, rows, public_vocab, head, token_ids, TOP_K)?;
    let too_big = || OpsError::Param {
        op: OP,
        param: "n",
        expected: "n * rows and n * 16 to fit in usize".into(),
        found: n.to_string(),
    };
    let total = n.checked_mul(rows).ok_or_else(too_big)?;
    let out_len = n.checked_mul(TOP_K).ok_or_else(too_big)?;
    check_len(OP, "logits", logits.len(), total, || {
        format!("[n={n}, rows={rows}]")
    })?;
    check_len(OP, "scores", scores.len(), out_len, || {
        format!("[n={n}, 16]")
    })?;
    check_len(OP, "ids", ids.len(), out_len, || format!("[n={n}, 16]"))?;
    check_param(OP, "n", n <= i32::MAX as usize, n, || "<= 2^31-1".into())?;
    if n == 0 {
        return Ok(());
    }
    match be {
        Backend::Cpu => {
            let HostHead {
                logits: l,
                map,
                considered,
            } = host_head_inputs(OP, logits, token_ids, rows, public_vocab, head)?;
            // Both outputs are validated to exist before either is written.
            let s = scores.host_mut(OP, "scores")?;
            let d = ids.host_mut(OP, "ids")?;
            reference::run(l, map, s, d, rows, considered);
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(c) => cuda::run(c, logits, token_ids, scores, ids, params),
    }
}

/// How a case's logits are made.
#[derive(Clone, Copy, Debug)]
enum Fill {
    /// [`planted_logits`]: quantized values with planted (tied) maxima and a tempting tail.
    Planted,
    /// Every logit equal (the top 16 are the 16 lowest candidate ids).
    AllEqual,
    /// Few distinct values (multiples of 1/2 in [-2, 2)): the 16th place always falls inside
    /// a large tie group, so the id tie-break decides most of the list.
    CoarseTies,
}

fn case(
    n: usize,
    rows: usize,
    public_vocab: usize,
    head: ProposalHead,
    fill: Fill,
    seed: u64,
) -> impl Fn(&Backend) -> Result<CaseRun> + Send + Sync {
    move |be: &Backend| {
        let mut mix = Mix(seed);
        let map = match head {
            ProposalHead::Full => None,
            ProposalHead::Indexed => Some(mix.distinct_shuffled(public_vocab, rows)),
        };
        let logits = match fill {
            Fill::Planted => planted_logits(&mut mix, n, rows, public_vocab, map.as_deref()),
            Fill::AllEqual => vec![0.75f32; n * rows],
            Fill::CoarseTies => (0..n * rows)
                .map(|_| (mix.below(8) as f32 - 4.0) / 2.0)
                .collect(),
        };
        let mut inputs = InputCheck::default();
        let l = inputs.upload(be, "logits", &logits)?;
        let t = match &map {
            Some(m) => Some(inputs.upload(be, "token_ids", m)?),
            None => None,
        };
        let mut scores = be.filled(n * TOP_K, f32::POISON)?;
        let mut ids = be.filled(n * TOP_K, i32::POISON)?;
        let params = Params {
            n,
            rows,
            public_vocab,
            head,
        };
        run(be, &l, t.as_ref(), &mut scores, &mut ids, &params)?;
        let mut modified = Vec::new();
        inputs.verify(be, "logits", &l, &mut modified)?;
        if let Some(t) = &t {
            inputs.verify(be, "token_ids", t, &mut modified)?;
        }
        let mut s = output(
            "scores",
            Criterion::Exact,
            &vec![f32::POISON; n * TOP_K],
            &be.download(&scores)?,
            |_| true,
        );
        // All-equal and coarse fills may put 16 equal values on top: constant scores are legitimate
        // there (the ids still vary).
        s.allow_constant = matches!(fill, Fill::AllEqual | Fill::CoarseTies);
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
}

/// Conformance cases: official Text head (248320 rows, 248077 public) at 1, 15 and 120
/// columns, the official 131072-row shortlist with a shuffled map, all-equal and coarse-tie
/// fills, and small odd shapes.
pub(crate) fn cases() -> Vec<Case> {
    use Fill::{AllEqual, CoarseTies, Planted};
    use ProposalHead::{Full, Indexed};
    vec![
        Case::new(
            OP,
            "full_small_rows_100_public_77_n9_coarse_ties",
            case(9, 100, 77, Full, CoarseTies, 1),
        ),
        Case::new(
            OP,
            "indexed_small_rows_50_public_300_n9_planted",
            case(9, 50, 300, Indexed, Planted, 2),
        ),
        Case::new(
            OP,
            "full_official_n1_planted",
            case(1, OFFICIAL_ROWS, OFFICIAL_PUBLIC, Full, Planted, 3),
        ),
        Case::new(
            OP,
            "full_official_n15_planted",
            case(15, OFFICIAL_ROWS, OFFICIAL_PUBLIC, Full, Planted, 4),
        ),
        Case::new(
            OP,
            "full_official_n120_planted",
            case(120, OFFICIAL_ROWS, OFFICIAL_PUBLIC, Full, Planted, 5),
        )
        .heavy(),
        Case::new(
            OP,
            "full_official_n15_coarse_ties",
            case(15, OFFICIAL_ROWS, OFFICIAL_PUBLIC, Full, CoarseTies, 6),
        ),
        Case::new(
            OP,
            "full_official_n15_all_equal",
            case(15, OFFICIAL_ROWS, OFFICIAL_PUBLIC, Full, AllEqual, 7),
        ),
        Case::new(
            OP,
            "indexed_official_shortlist_n15_planted",
            case(15, OFFICIAL_SHORTLIST, OFFICIAL_PUBLIC, Indexed, Planted, 8),
        ),
        Case::new(
            OP,
            "indexed_official_shortlist_n15_all_equal",
            case(
                15,
                OFFICIAL_SHORTLIST,
                OFFICIAL_PUBLIC,
                Indexed,
                AllEqual,
                9,
            ),
        ),
        Case::new(
            OP,
            "indexed_official_shortlist_n120_coarse_ties",
            case(
                120,
                OFFICIAL_SHORTLIST,
                OFFICIAL_PUBLIC,
                Indexed,
                CoarseTies,
                10,
            ),
        )
        .heavy(),
    ]
}
