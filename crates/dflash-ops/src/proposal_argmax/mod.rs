//! Proposal argmax: the DFlash proposal head's decision, one global token id per mask column.
//!
//! The caller computes the head logits with a GEMM (mask hidden `[n, H]` times the head
//! `[rows, H]^T`); this op takes those F32 logits as given and decides exactly from the
//! represented values.
//!
//! Semantics. For each column `i < n`, with `l = logits[i, ..]`:
//! - Full head ([`ProposalHead::Full`]): `ids[i] = argmax_{v < public_vocab} l[v]`. Rows
//!   `public_vocab..rows` (the padded, never-real tail of the Text head) are never proposed,
//!   whatever they hold.
//! - Indexed head ([`ProposalHead::Indexed`], a shortlist gathered from the Text head):
//!   every shortlist row `k < rows` stands for the global id `token_ids[k]`;
//!   `ids[i] = token_ids[argmax_k l[k]]`.
//!
//! Shapes. logits: `[n, rows]` F32 row-major; token_ids: `[rows]` I32 (indexed head only);
//!   ids: `[n]` I32 (global token ids).
//! Dtypes. F32 in, I32 out. No rounding: the decision compares represented F32 values.
//! Tie-breaking. Exact ties (`==` in F32, so `-0.0 == +0.0`) go to the LOWER GLOBAL id (for
//!   the indexed head this is the lower `token_ids[k]`, not the lower shortlist row). The
//!   order is total, so the result does not depend on the reduction order.
//! Non-finite values. `+inf` and `-inf` are ordinary values (a row of `-inf` yields the lowest
//!   considered id). NaN: the CPU refuses a NaN in a considered logit with
//!   [`OpsError::Value`] (NaN in the ignored tail `public_vocab..rows` of a full head is
//!   allowed); the CUDA path, which never reads data back, treats a NaN logit as `-inf`.
//! Caller guarantees. Indexed: `token_ids` unique, each in `0..public_vocab` (checked on the
//!   CPU; on CUDA the ids are only copied to the output, never used as addresses).
//!   `public_vocab` is a per-deployment launch scalar (static shape), not per-round data.
//! Writes. Exactly `ids[0..n]`; logits and token_ids are never written.
//! Accumulation. None (comparisons only).
//! Comparison. ids: exact.

#[cfg(feature = "cuda")]
mod cuda;
mod reference;
#[cfg(test)]
mod tests;

use crate::registry::{Case, CaseRun, Criterion, InputCheck, output};
use crate::{Backend, Buffer, Element, OpsError, Result, check_len, check_param};
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

/// Parameters of [`run`] (static shapes: launch scalars on CUDA).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Params {
    /// Number of logit columns (mask columns over the batch); 0 is a no-op.
    pub n: usize,
    /// Logit rows per column: the head's row count (`V_rows`, e.g. 248320 for the Text head
    /// or 131072 for a shortlist).
    pub rows: usize,
    /// The public vocabulary size (248077 for Qwen3.5): full-head candidates are rows
    /// `0..public_vocab`; indexed-head ids must lie below it. `1 <= public_vocab`, and
    /// `public_vocab <= rows` for the full head.
    pub public_vocab: usize,
    /// Which head.
    pub head: ProposalHead,
}

/// Largest head row count (and public vocabulary) the proposal ops accept: 2^30.
pub const MAX_ROWS: usize = 1 << 30;

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

/// CPU check that no considered logit is NaN (the first offending flat index is reported).
pub(crate) fn validate_logits(
    op: &'static str,
    logits: &[f32],
    rows: usize,
    considered: usize,
) -> Result<()> {
    for (i, row) in logits.chunks_exact(rows).enumerate() {
        if let Some(v) = row[..considered].iter().position(|x| x.is_nan()) {
            return Err(OpsError::Value {
                op,
                tensor: "logits",
                index: i * rows + v,
                expected: "a non-NaN logit".into(),
                found: "NaN".into(),
            });
        }
    }
    Ok(())
}

/// Validated CPU inputs of a proposal head (see [`host_head_inputs`]).
pub(crate) struct HostHead<'a> {
    /// The logits `[n, rows]`.
    pub(crate) logits: &'a [f32],
    /// The indexed head's row -> global id map.
    pub(crate) map: Option<&'a [i32]>,
    /// Candidate rows per column (a prefix of each column).
    pub(crate) considered: usize,
}

/// The CPU view of a head's inputs, validated: the logits, the indexed head's id map (checked
/// unique and public), and how many leading rows of each column are candidates (the public
/// rows of a full head, every shortlist row of an indexed head), with no NaN among them.
pub(crate) fn host_head_inputs<'a>(
    op: &'static str,
    logits: &'a Buffer<f32>,
    token_ids: Option<&'a Buffer<i32>>,
    rows: usize,
    public_vocab: usize,
    head: ProposalHead,
) -> Result<HostHead<'a>> {
    let l = logits.host(op, "logits")?;
    let map = match token_ids {
        Some(t) => {
            let t = t.host(op, "token_ids")?;
            validate_token_ids(op, t, public_vocab)?;
            Some(t)
        }
        None => None,
    };
    let considered = match head {
        ProposalHead::Full => public_vocab,
        ProposalHead::Indexed => rows,
    };
    validate_logits(op, l, rows, considered)?;
    Ok(HostHead {
        logits: l,
        map,
        considered,
    })
}

/// Pick, for each of `n` logit columns, the best candidate's global id (see the module
/// contract). `token_ids` is `None` for [`ProposalHead::Full`] and the `[rows]` map for
/// [`ProposalHead::Indexed`]. A refused call leaves `ids` untouched.
pub fn run(
    be: &Backend,
    logits: &Buffer<f32>,
    token_ids: Option<&Buffer<i32>>,
    ids: &mut Buffer<i32>,
    params: &Params,
) -> Result<()> {
    let Params {
        n,
        rows,
        public_vocab,
        head,
    } = *params;
    check_head_params(OP, rows, public_vocab, head, token_ids, 1)?;
    let total = n.checked_mul(rows).ok_or_else(|| OpsError::Param {
        op: OP,
        param: "n",
        expected: "n * rows to fit in usize".into(),
        found: n.to_string(),
    })?;
    check_len(OP, "logits", logits.len(), total, || {
        format!("[n={n}, rows={rows}]")
    })?;
    check_len(OP, "ids", ids.len(), n, || format!("[n={n}]"))?;
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
            reference::run(l, map, ids.host_mut(OP, "ids")?, rows, considered);
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(c) => cuda::run(c, logits, token_ids, ids, params),
    }
}

/// Deterministic fixture generator (SplitMix64), shared by this module's sibling ops.
#[derive(Clone, Debug)]
pub(crate) struct Mix(pub(crate) u64);

impl Mix {
    /// The next 64 random bits.
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
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
pub(crate) const OFFICIAL_ROWS: usize = 248_320;
/// Official public vocabulary (tokenizer ids).
pub(crate) const OFFICIAL_PUBLIC: usize = 248_077;
/// Official shortlist rows of the indexed head.
pub(crate) const OFFICIAL_SHORTLIST: usize = 131_072;

/// Logits with planted decisions for the conformance cases.
///
/// Values are multiples of 1/16 in [-8, 8) (so natural ties are common). Row `i` gets a
/// planted maximum `M = 20 + i/8`: for `i % 3 == 0` a unique one, for `i % 3 != 0` two equal
/// maxima; for `i % 3 == 2` on an indexed head the later shortlist row of the pair has the
/// lower global id. A full head also gets a larger value `M + 100` in the ignored tail
/// `public_vocab..rows` of every row. Needs at least 2 candidates.
pub(crate) fn planted_logits(
    mix: &mut Mix,
    n: usize,
    rows: usize,
    public_vocab: usize,
    token_ids: Option<&[i32]>,
) -> Vec<f32> {
    let mut l: Vec<f32> = (0..n * rows)
        .map(|_| (mix.below(256) as f32 - 128.0) / 16.0)
        .collect();
    let considered = if token_ids.is_some() {
        rows
    } else {
        public_vocab
    };
    for i in 0..n {
        let row = &mut l[i * rows..(i + 1) * rows];
        let m = 20.0 + (i / 8) as f32;
        let a = mix.below(considered);
        let mut b = (a + 1 + mix.below(considered - 1)) % considered;
        if let (Some(t), 2) = (token_ids, i % 3) {
            // Redraw until the later shortlist row has the lower global id (half of all
            // pairs qualify; the loop is bounded for safety).
            for _ in 0..1000 {
                if (a < b) == (t[a] > t[b]) {
                    break;
                }
                b = (a + 1 + mix.below(considered - 1)) % considered;
            }
        }
        row[a] = m;
        if i % 3 != 0 {
            row[b] = m;
        }
        if token_ids.is_none() && public_vocab < rows {
            let t = public_vocab + mix.below(rows - public_vocab);
            row[t] = m + 100.0;
        }
    }
    l
}

fn case(
    n: usize,
    rows: usize,
    public_vocab: usize,
    head: ProposalHead,
    seed: u64,
) -> impl Fn(&Backend) -> Result<CaseRun> + Send + Sync {
    move |be: &Backend| {
        let mut mix = Mix(seed);
        let map = match head {
            ProposalHead::Full => None,
            ProposalHead::Indexed => Some(mix.distinct_shuffled(public_vocab, rows)),
        };
        let logits = planted_logits(&mut mix, n, rows, public_vocab, map.as_deref());
        let mut inputs = InputCheck::default();
        let l = inputs.upload(be, "logits", &logits)?;
        let t = match &map {
            Some(m) => Some(inputs.upload(be, "token_ids", m)?),
            None => None,
        };
        let mut ids = be.filled(n, i32::POISON)?;
        let params = Params {
            n,
            rows,
            public_vocab,
            head,
        };
        run(be, &l, t.as_ref(), &mut ids, &params)?;
        let mut modified = Vec::new();
        inputs.verify(be, "logits", &l, &mut modified)?;
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

/// Conformance cases: the official Text head (248320 rows, 248077 public) at 1, 15 and 120
/// columns, the official 131072-row shortlist with a shuffled map, and small odd shapes.
pub(crate) fn cases() -> Vec<Case> {
    use ProposalHead::{Full, Indexed};
    vec![
        Case::new(
            OP,
            "full_small_rows_37_public_29_n9",
            case(9, 37, 29, Full, 1),
        ),
        Case::new(
            OP,
            "indexed_small_rows_40_public_97_n9",
            case(9, 40, 97, Indexed, 2),
        ),
        Case::new(
            OP,
            "full_official_n1",
            case(1, OFFICIAL_ROWS, OFFICIAL_PUBLIC, Full, 3),
        ),
        Case::new(
            OP,
            "full_official_n15",
            case(15, OFFICIAL_ROWS, OFFICIAL_PUBLIC, Full, 4),
        ),
        Case::new(
            OP,
            "full_official_n120",
            case(120, OFFICIAL_ROWS, OFFICIAL_PUBLIC, Full, 5),
        )
        .heavy(),
        Case::new(
            OP,
            "indexed_official_shortlist_n15",
            case(15, OFFICIAL_SHORTLIST, OFFICIAL_PUBLIC, Indexed, 6),
        ),
        Case::new(
            OP,
            "indexed_official_shortlist_n120",
            case(120, OFFICIAL_SHORTLIST, OFFICIAL_PUBLIC, Indexed, 7),
        )
        .heavy(),
    ]
}
