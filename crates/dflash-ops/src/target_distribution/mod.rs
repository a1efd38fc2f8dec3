//! Target distribution: process the target's verify logits into the processed target
//! distribution `p_i` of every live verify column (public-vocabulary mask, penalties with the
//! column's own history, temperature, top-k, top-p, min-p); for a greedy row, into the argmax
//! alone.
//!
//! Semantics. Row `r` is one request with `Q = live[r]` live columns (`1 <= Q <= cols`); the
//! target output of verify column `i` predicts position `F+1+i` and is the logits column
//! `c(r, i)` (`r * cols + i` for [`Columns::Padded`], `col_start[r] + i` for
//! [`Columns::Starts`]): `logit(v) = logits[c(r, i), v]`. The columns are the nodes of the
//! row's proposal, given as a [`History`]: node 0 is the anchor; node `j = 1..cols-1` has the
//! input token `x_j` and the parent `par(j) < j`. [`History::Chain`]: `x_j = proposals[r,
//! j-1]`, `par(j) = j - 1`. [`History::Tree`] (DFlash2 tree verification): `x_j = tokens[r,
//! j-1]`, `par(j) = parents[r, j-1]`. The root path of column `i` is `path(i) = { i, par(i),
//! par(par(i)), .. }` down to but EXCLUDING node 0 (the anchor is already in `counts`); for a
//! chain `path(i) = { 1, .., i }`. For every live column `i < Q`, in this one order:
//!
//! 1. History. `c(v) = counts[r, v] + #{ j in path(i) : x_j == v }` (the request's token counts
//!    up to and including the anchor, plus the tokens that column `i`'s input follows: for a
//!    chain the proposals `x_1 .. x_i`; a tree's other branches never count), computed in
//!    64-bit integers.
//! 2. Public mask. Only `v < public_vocab` takes part; every `v >= public_vocab` gets
//!    `p = 0` exactly and is never chosen.
//! 3. Penalties (f32, each operation rounded RNE, no fused multiply-add), only where `c > 0`:
//!    `l = logit > 0 ? logit / rep : logit * rep`, then
//!    `l = l - (freq * f32(c) + pres)` (`f32(c)` is the RNE conversion of the integer count).
//!    Where `c == 0` the logit is unchanged.
//! 4. Greedy. If `temperature <= 0`: the column's token is `g = argmax_v l` over the public
//!    rows, ties to the lowest id, and its distribution is `p = one_hot(g)`; no filter applies
//!    (none could remove the argmax). Greedy verification then falls out of the ordinary
//!    acceptance rule of `chain_accept`.
//! 5. Scaling. Otherwise `z = l / temperature` (f32, RNE), then `z = z + 0.0` (so that `-0.0`
//!    and `+0.0` are one value). `zmax = max_v z`, `e(v) = exp(f64(z) - f64(zmax))` (f64).
//! 6. Top-k (`top_k > 0` and `top_k < public_vocab`): `t_k` = the `top_k`-th largest `z`
//!    counting multiplicity; the top-k set is `K = { v : z_v >= t_k }`. Ties at the boundary are
//!    all kept (so `|K|` can exceed `top_k`). Otherwise `K` is every public token.
//! 7. Top-p (`top_p < 1`; `top_p == 1` disables it). Masses are fixed point:
//!    `m(v) = floor(e(v) * 2^40)` (u64), `M(t) = sum { m(v) : v in K, z_v >= t }` (exact
//!    integer sum), `target = f64(top_p) * f64(M(-inf))`. `t_p` is the largest value `t` among
//!    the `z_v`, `v in K`, with `f64(M(t)) >= target`: the smallest prefix of `K` in
//!    descending `z` whose mass reaches `top_p`, with every token tied with its last element
//!    kept. Otherwise `t_p = -inf`.
//! 8. Min-p: keep only tokens with `e(v) >= f64(min_p)` (that is `p(v) >= min_p * max p`;
//!    `min_p == 0` keeps everything).
//! 9. Normalization: `kept = { v in K : z_v >= t_p, e(v) >= min_p }`,
//!    `S = sum_{kept} e(v)` (f64), `p(v) = f32_rne(e(v) / S)` for `v` in `kept`, else `0`.
//!
//! The argmax always survives every filter, so `S >= 1`. What is stored depends on the
//! [`Outputs`] form:
//!
//! - [`Outputs::Full`]: `p[r, i, :]` for every column: a live column's distribution (a greedy
//!   column's one-hot row), exact zeros for a dead column (`i >= Q`).
//! - [`Outputs::Live`] (what verification reads, sized for the round): a live greedy column
//!   writes `greedy[r, i] = g` and no element of `p`; a live sampled column writes
//!   `greedy[r, i] = -1` ([`SAMPLED`]) and its whole row `p[r, i, :]`; a dead column writes
//!   nothing. `chain_accept` reads either form ([`crate::chain_accept::Distributions`]) and
//!   decides identically from both.
//!
//! Shapes. logits: `[n, vocab]` (`n` logits columns): [`Columns::Padded`] is
//!   `[rows, cols, vocab]`; [`Columns::Starts`] takes `col_start: [rows]` i32, device metadata
//!   written with the round (never a launch scalar), e.g. packed (only live columns stored,
//!   row `r`'s `Q_r` columns after the previous row's: `col_start[0] = 0`,
//!   `col_start[r+1] = col_start[r] + Q_r`) or padded (`col_start[r] = r * cols`).
//!   p: `[rows, cols, vocab]` f32; greedy: `[rows, cols]` i32; live: `[rows]` i32;
//!   counts: `[rows, vocab]` i32; history ([`History`]): proposals, or tokens and parents,
//!   each `[rows, cols-1]` i32; every setting: `[rows]` ([`Sampling`]).
//!   Row capacity: a tensor indexed by row may hold more rows than `rows` (a workspace planned
//!   once for B rows runs a round of `n <= B` rows with its B-row buffers): its length is a
//!   whole number of its rows, at least `rows`; padded logits likewise (rows of
//!   `[cols, vocab]`); logits with starts hold a whole number of `vocab`-columns. Rows at or
//!   past `rows` are never read or written.
//! Dtypes. Logits f32 or bf16 ([`Logits`]); settings and `p` f32; counts, ids (proposals,
//!   tokens), parents, `top_k`, `live`, `col_start`, `greedy` i32.
//! Rounding points. A bf16 logit is widened exactly to f32 when it is loaded (the f32 with the
//!   same sign, exponent and 7 fraction bits; no rounding), so bf16 logits give bit for bit
//!   the result of their f32 widening. The penalized logit and `z` are f32 values (RNE, as
//!   written above); `e`, masses and `S` are f64; `p` is rounded once to f32.
//! Accumulation. `S`: f64 in any order (implementation choice); `M`: exact u64.
//! Tie-breaking. Greedy argmax: lowest id. Top-k / top-p: every token tied with the boundary
//!   value is kept (a value threshold, not an id-ordered prefix).
//! Masking / live extents. Non-public rows: `p = 0`. Dead columns: zeros (`Full`) or untouched
//!   (`Live`). Only the history of live nodes (`x_j` and, for a tree, `par(j)`, `j = 1 ..
//!   Q-1`: a live node's root path holds live nodes only) and only the public rows of the
//!   logits columns `c(r, i)`, `i < Q`, are read (a dead column's logits, tokens and parents
//!   need not be valid). On CUDA a row whose penalties are neutral reads no history at all.
//! Caller guarantees (checked on the CPU, trusted on CUDA, where out-of-range tokens are
//!   ignored, a parent that is not an earlier node (outside `0..j` for node `j`) ends the
//!   root path walk there as if it were the anchor (node `j`'s own token still counts), so a
//!   bad tree can never make the walk loop or leave the row, `live` is clamped to `0..=cols`
//!   and a live column whose logits column `c(r, i)` lies outside the buffer is treated as
//!   dead: nothing read, zeros (`Full`) or nothing (`Live`) written): `1 <= live <= cols`;
//!   with starts, `col_start[r] >= 0` and `(col_start[r] + Q) * vocab <= logits.len()` (the
//!   logits cover every live column); tokens (proposals) of live nodes in `0..vocab`; for a
//!   tree, parents of live nodes `0 <= parents[r, j-1] < j`; `counts >= 0`; settings valid
//!   ([`Sampling`]); public logits of live columns are not NaN or `+inf` (`-inf` is allowed
//!   and gives `p = 0`); the processed logits of a live column have a finite maximum (no
//!   `+inf` overflow from a tiny temperature or a huge penalty, not all `-inf`).
//! Writes. `Full`: every element of `p` in rows `< rows` (live columns: the distribution;
//!   dead columns: zeros). `Live`: `greedy[r, i]` of every live column and `p[r, i, :]` of
//!   every live sampled column, nothing else: the `p` rows of greedy and dead columns and the
//!   `greedy` entries of dead columns keep their bits. Inputs (the history included) are
//!   never written.
//! Comparison. `p`: close (abs 1e-7, rel 1e-5): both backends compute `e`, `m`, `S` in f64 /
//!   exact integers from identical f32 `z`, so only the f64 `exp` (1 ulp) and the summation
//!   order of `S` differ; kept sets, greedy one-hot columns and zeros are exact in practice
//!   (fixtures keep decision margins far above 2^-40). `greedy`: exact. The `p` elements a
//!   `Live` call leaves alone: exact (still the poison).
//!
//! CUDA. One cluster of 8 blocks of 512 threads per (row, column) on compute capability 9.0
//! and later (`CudaBackend::uses_clusters`), one block elsewhere and under
//! `KernelVariants::Portable`; entries `target_distribution_kernel` (f32 logits) and
//! `target_distribution_bf16_kernel` (bf16 logits, each widened by a 16-bit shift of its
//! bits). A row with non-neutral penalties first stages column `i`'s history in shared memory
//! with a 1024-bit filter of its ids: a chain's prefix `x_1 .. x_i`; a tree's tokens and
//! parents of nodes `1..=i` (loaded by the whole block), then one thread walks the root path
//! in shared memory (at most `i` steps, each to a smaller node) and writes its tokens as the
//! history. Block `k` of a column's cluster owns the 512-id chunks at `k * 512 + j * 4096`, in
//! every pass. Pass 1 reduces each block's argmax: where the vocabulary is a multiple of 4 and
//! the logits and counts start 16-byte aligned, thread `t` loads 4 consecutive ids of a chunk
//! with one load (16 ids a thread in flight), else one id `t` of each chunk (8 in flight); a
//! row whose penalties are neutral reads neither counts nor history (every step that reads
//! them is then the identity, exactly). The blocks' results are merged with the lowest-id rule
//! through distributed shared memory, so every block holds the same argmax. A greedy column
//! then writes its one-hot row (`Full`) or its id (`Live`). A sampled column's pass 1 writes
//! `z` into its own `p` row (scratch; the later passes, where thread `t` owns id `t` of each
//! chunk, read it after a barrier, each thread its next 8 ids at once); top-k and top-p
//! thresholds are found by a 4-pass radix select (8 bits per pass) on the order-preserving
//! u32 key of `z`: each block counts its ids (u32 counts for top-k, u64 masses for top-p,
//! shared-memory integer atomics, a thread's run of ids in one bin added at once; an id whose
//! mass is 0, `z - zmax <= -27.75`, spends neither its `exp` nor an add) and every block sums
//! the cluster's histograms, so the thresholds are exact, deterministic and the same in every
//! block; then each block's f64 part of `S`, summed in block order by every block (a column's
//! `S`, so its `p`, never depends on the batch it is in), and one write pass. A block only
//! reads back `p` elements it wrote itself; every logits read is inside the checked column
//! `c(r, i)`. Measured on the H200 (K = 15, official vocabulary): see
//! `docs/performance-engine_round.md`.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod reference;
#[cfg(test)]
mod tests;

#[cfg(any(test, feature = "conformance"))]
use crate::Element;
#[cfg(any(test, feature = "conformance"))]
use crate::registry::{Case, CaseRun, Criterion, InputCheck, output};
use crate::{Backend, Buffer, DType, OpsError, Result, bf16, check_param};

/// Registry id.
pub const OP: &str = "target_distribution";

/// Most columns a call may have (the per-column history lives in shared memory on CUDA).
pub const MAX_COLS: usize = 256;

/// Largest vocabulary a call may have (2^30, so that strided i32 loops cannot overflow).
pub const MAX_VOCAB: usize = 1 << 30;

/// The `greedy` entry of a live sampled column in [`Outputs::Live`].
pub const SAMPLED: i32 = -1;

/// Static shape of a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Params {
    /// Requests in the call (the launch rows; buffers may hold more, see the contract's row
    /// capacity).
    pub rows: usize,
    /// Verify columns per request (W = K + 1), `1..=MAX_COLS`.
    pub cols: usize,
    /// Vocabulary rows of the logits (e.g. 248320), `1..=MAX_VOCAB`.
    pub vocab: usize,
    /// Public vocabulary (e.g. 248077): rows `>= public_vocab` are never chosen.
    pub public_vocab: usize,
}

/// The target's verify logits in the dtype it computed them in.
#[derive(Clone, Copy, Debug)]
pub enum Logits<'a> {
    /// F32 logits.
    F32(&'a Buffer<f32>),
    /// BF16 logits (widened exactly to f32 on load).
    Bf16(&'a Buffer<bf16>),
}

impl Logits<'_> {
    /// Elements of the buffer.
    pub fn len(&self) -> usize {
        match self {
            Logits::F32(b) => b.len(),
            Logits::Bf16(b) => b.len(),
        }
    }

    /// True when the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The stored dtype.
    pub fn dtype(&self) -> DType {
        match self {
            Logits::F32(_) => DType::F32,
            Logits::Bf16(_) => DType::BF16,
        }
    }
}

impl<'a> From<&'a Buffer<f32>> for Logits<'a> {
    fn from(b: &'a Buffer<f32>) -> Self {
        Logits::F32(b)
    }
}

impl<'a> From<&'a Buffer<bf16>> for Logits<'a> {
    fn from(b: &'a Buffer<bf16>) -> Self {
        Logits::Bf16(b)
    }
}

/// Where verify column `i` of row `r` lies in the logits (see the contract's Shapes).
#[derive(Clone, Copy, Debug)]
pub enum Columns<'a> {
    /// `[rows, cols, vocab]`: logits column `r * cols + i`.
    Padded,
    /// Logits column `col_start[r] + i`; `col_start: [rows]` i32, device metadata (packed:
    /// the prefix sums of the live counts; padded: `r * cols`).
    Starts(&'a Buffer<i32>),
}

/// What a call writes (see the contract's Writes).
#[derive(Debug)]
pub enum Outputs<'a> {
    /// `p: [rows, cols, vocab]`, every element: greedy columns one-hot, dead columns zero.
    Full(&'a mut Buffer<f32>),
    /// Only what verification reads: `greedy: [rows, cols]` (the argmax of a live greedy
    /// column, [`SAMPLED`] for a live sampled column) and the `p` rows of live sampled
    /// columns.
    Live {
        /// `[rows, cols, vocab]` f32; only rows of live sampled columns are written.
        p: &'a mut Buffer<f32>,
        /// `[rows, cols]` i32; only live columns are written.
        greedy: &'a mut Buffer<i32>,
    },
}

/// The proposal whose tokens make each column's history (see the contract's step 1).
#[derive(Clone, Copy, Debug)]
pub enum History<'a> {
    /// A chain: `proposals: [rows, cols-1]`; node `j >= 1` has token `proposals[r, j-1]` and
    /// parent `j - 1`, so column `i`'s history is the prefix `proposals[r, 0..i]`.
    Chain(&'a Buffer<i32>),
    /// A tree (DFlash2 tree verification): node `j >= 1` has token `tokens[r, j-1]` and parent
    /// `parents[r, j-1] < j`; column `i`'s history is the tokens of its root path.
    Tree {
        /// `[rows, cols-1]` i32: the input token of each node `1..cols`.
        tokens: &'a Buffer<i32>,
        /// `[rows, cols-1]` i32: the parent of each node `1..cols`, an earlier node.
        parents: &'a Buffer<i32>,
    },
}

impl<'a> History<'a> {
    /// The buffer of the nodes' tokens (a chain's proposals).
    fn tokens(&self) -> &'a Buffer<i32> {
        match *self {
            History::Chain(d) => d,
            History::Tree { tokens, .. } => tokens,
        }
    }

    /// The tensor name of the nodes' tokens in errors.
    fn tokens_name(&self) -> &'static str {
        match self {
            History::Chain(_) => "proposals",
            History::Tree { .. } => "tokens",
        }
    }
}

/// Per-request sampling settings, one element per row, as device buffers (so that a captured
/// CUDA graph replays with new settings).
#[derive(Clone, Copy, Debug)]
pub struct Sampling<'a> {
    /// Temperature, finite, `>= 0`; `<= 0` means greedy (the argmax: an exact one-hot `p`, or
    /// its id alone in [`Outputs::Live`]).
    pub temperature: &'a Buffer<f32>,
    /// Top-k, `>= 0`; `0` (or `>= public_vocab`) disables it.
    pub top_k: &'a Buffer<i32>,
    /// Top-p, in `(0, 1]`; `1` disables it.
    pub top_p: &'a Buffer<f32>,
    /// Min-p, in `[0, 1)`; `0` disables it.
    pub min_p: &'a Buffer<f32>,
    /// Repetition penalty, finite, `> 0`; `1` disables it.
    pub repetition_penalty: &'a Buffer<f32>,
    /// Frequency penalty (finite, any sign); `0` disables it.
    pub frequency_penalty: &'a Buffer<f32>,
    /// Presence penalty (finite, any sign); `0` disables it.
    pub presence_penalty: &'a Buffer<f32>,
}

/// One request's sampling settings on the host (convenience for building [`SamplingBuffers`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Settings {
    /// Temperature (`<= 0`: greedy).
    pub temperature: f32,
    /// Top-k (`0`: off).
    pub top_k: i32,
    /// Top-p (`1`: off).
    pub top_p: f32,
    /// Min-p (`0`: off).
    pub min_p: f32,
    /// Repetition penalty (`1`: off).
    pub repetition_penalty: f32,
    /// Frequency penalty (`0`: off).
    pub frequency_penalty: f32,
    /// Presence penalty (`0`: off).
    pub presence_penalty: f32,
}

impl Settings {
    /// Greedy decoding with every filter and penalty off.
    pub const GREEDY: Settings = Settings {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        repetition_penalty: 1.0,
        frequency_penalty: 0.0,
        presence_penalty: 0.0,
    };

    /// Plain sampling at `temperature` with every filter and penalty off.
    pub const fn sampling(temperature: f32) -> Settings {
        Settings {
            temperature,
            ..Settings::GREEDY
        }
    }
}

/// Owned per-row setting buffers (see [`Sampling`]).
#[derive(Debug)]
pub struct SamplingBuffers {
    /// Temperatures.
    pub temperature: Buffer<f32>,
    /// Top-k values.
    pub top_k: Buffer<i32>,
    /// Top-p values.
    pub top_p: Buffer<f32>,
    /// Min-p values.
    pub min_p: Buffer<f32>,
    /// Repetition penalties.
    pub repetition_penalty: Buffer<f32>,
    /// Frequency penalties.
    pub frequency_penalty: Buffer<f32>,
    /// Presence penalties.
    pub presence_penalty: Buffer<f32>,
}

impl SamplingBuffers {
    /// Upload one [`Settings`] per row.
    pub fn upload(be: &Backend, rows: &[Settings]) -> Result<Self> {
        let col = |f: fn(&Settings) -> f32| rows.iter().map(f).collect::<Vec<f32>>();
        Ok(SamplingBuffers {
            temperature: be.upload(&col(|s| s.temperature))?,
            top_k: be.upload(&rows.iter().map(|s| s.top_k).collect::<Vec<i32>>())?,
            top_p: be.upload(&col(|s| s.top_p))?,
            min_p: be.upload(&col(|s| s.min_p))?,
            repetition_penalty: be.upload(&col(|s| s.repetition_penalty))?,
            frequency_penalty: be.upload(&col(|s| s.frequency_penalty))?,
            presence_penalty: be.upload(&col(|s| s.presence_penalty))?,
        })
    }

    /// The borrowed view the op takes.
    pub fn view(&self) -> Sampling<'_> {
        Sampling {
            temperature: &self.temperature,
            top_k: &self.top_k,
            top_p: &self.top_p,
            min_p: &self.min_p,
            repetition_penalty: &self.repetition_penalty,
            frequency_penalty: &self.frequency_penalty,
            presence_penalty: &self.presence_penalty,
        }
    }
}

/// Compute the processed target distribution `p` of every live verify column from padded f32
/// logits of a chain proposal, writing every element of `p` ([`Outputs::Full`]); the same as
/// [`run_with`] with [`Logits::F32`], [`Columns::Padded`] and [`History::Chain`]. Validates
/// every shape and parameter (and, on the CPU, every value the contract constrains) before
/// writing; a refused call leaves `p` untouched.
pub fn run(
    be: &Backend,
    logits: &Buffer<f32>,
    live: &Buffer<i32>,
    counts: &Buffer<i32>,
    proposals: &Buffer<i32>,
    sampling: &Sampling<'_>,
    p: &mut Buffer<f32>,
    params: &Params,
) -> Result<()> {
    run_with(
        be,
        Logits::F32(logits),
        Columns::Padded,
        live,
        counts,
        History::Chain(proposals),
        sampling,
        Outputs::Full(p),
        params,
    )
}

/// Check that a tensor indexed by row holds a whole number of rows of `stride` elements, at
/// least `rows` (the contract's row capacity; `stride == 0`: empty).
pub(crate) fn check_rows(
    op: &'static str,
    tensor: &'static str,
    found: usize,
    rows: usize,
    stride: usize,
    row_shape: impl FnOnce() -> String,
) -> Result<()> {
    let ok = if stride == 0 {
        found == 0
    } else {
        found.is_multiple_of(stride) && found / stride >= rows
    };
    if ok {
        Ok(())
    } else {
        Err(OpsError::Length {
            op,
            tensor,
            expected: rows.saturating_mul(stride),
            shape: format!("a whole number >= {rows} of rows {}", row_shape()),
            found,
        })
    }
}

/// Compute what verification needs of the processed target distributions (see the module
/// contract): logits in either dtype and either column layout, the history of a chain or a
/// tree, written in the [`Outputs`] form asked for. Validates every shape and parameter (and,
/// on the CPU, every value the contract constrains, `col_start` and a tree's parents
/// included) before writing; a refused call leaves the outputs untouched.
pub fn run_with(
    be: &Backend,
    logits: Logits<'_>,
    columns: Columns<'_>,
    live: &Buffer<i32>,
    counts: &Buffer<i32>,
    history: History<'_>,
    sampling: &Sampling<'_>,
    out: Outputs<'_>,
    params: &Params,
) -> Result<()> {
    let Params {
        rows,
        cols,
        vocab,
        public_vocab,
    } = *params;
    check_param(OP, "cols", (1..=MAX_COLS).contains(&cols), cols, || {
        format!("1..={MAX_COLS}")
    })?;
    check_param(OP, "vocab", (1..=MAX_VOCAB).contains(&vocab), vocab, || {
        format!("1..={MAX_VOCAB}")
    })?;
    check_param(
        OP,
        "public_vocab",
        public_vocab >= 1 && public_vocab <= vocab,
        public_vocab,
        || format!("1..=vocab ({vocab})"),
    )?;
    rows.checked_mul(cols)
        .and_then(|n| n.checked_mul(vocab))
        .ok_or_else(|| OpsError::Param {
            op: OP,
            param: "rows",
            expected: "rows * cols * vocab within usize".into(),
            found: rows.to_string(),
        })?;
    let column = || format!("[cols={cols}, vocab={vocab}]");
    match columns {
        Columns::Padded => check_rows(OP, "logits", logits.len(), rows, cols * vocab, column)?,
        Columns::Starts(col_start) => {
            check_rows(OP, "logits", logits.len(), 0, vocab, || {
                format!("[vocab={vocab}]")
            })?;
            check_rows(OP, "col_start", col_start.len(), rows, 1, || "[1]".into())?;
        }
    }
    match &out {
        Outputs::Full(p) => check_rows(OP, "p", p.len(), rows, cols * vocab, column)?,
        Outputs::Live { p, greedy } => {
            check_rows(OP, "p", p.len(), rows, cols * vocab, column)?;
            check_rows(OP, "greedy", greedy.len(), rows, cols, || {
                format!("[cols={cols}]")
            })?;
        }
    }
    let one = || "[1]".to_string();
    check_rows(OP, "live", live.len(), rows, 1, one)?;
    check_rows(OP, "counts", counts.len(), rows, vocab, || {
        format!("[vocab={vocab}]")
    })?;
    let node_row = || format!("[cols-1={}]", cols - 1);
    check_rows(
        OP,
        history.tokens_name(),
        history.tokens().len(),
        rows,
        cols - 1,
        node_row,
    )?;
    if let History::Tree { parents, .. } = history {
        check_rows(OP, "parents", parents.len(), rows, cols - 1, node_row)?;
    }
    check_rows(OP, "temperature", sampling.temperature.len(), rows, 1, one)?;
    check_rows(OP, "top_k", sampling.top_k.len(), rows, 1, one)?;
    check_rows(OP, "top_p", sampling.top_p.len(), rows, 1, one)?;
    check_rows(OP, "min_p", sampling.min_p.len(), rows, 1, one)?;
    check_rows(
        OP,
        "repetition_penalty",
        sampling.repetition_penalty.len(),
        rows,
        1,
        one,
    )?;
    check_rows(
        OP,
        "frequency_penalty",
        sampling.frequency_penalty.len(),
        rows,
        1,
        one,
    )?;
    check_rows(
        OP,
        "presence_penalty",
        sampling.presence_penalty.len(),
        rows,
        1,
        one,
    )?;
    if rows == 0 {
        return Ok(());
    }
    match be {
        Backend::Cpu => {
            let settings = reference::HostSampling {
                temperature: sampling.temperature.host(OP, "temperature")?,
                top_k: sampling.top_k.host(OP, "top_k")?,
                top_p: sampling.top_p.host(OP, "top_p")?,
                min_p: sampling.min_p.host(OP, "min_p")?,
                repetition_penalty: sampling.repetition_penalty.host(OP, "repetition_penalty")?,
                frequency_penalty: sampling.frequency_penalty.host(OP, "frequency_penalty")?,
                presence_penalty: sampling.presence_penalty.host(OP, "presence_penalty")?,
            };
            let logits = match logits {
                Logits::F32(b) => reference::HostLogits::F32(b.host(OP, "logits")?),
                Logits::Bf16(b) => reference::HostLogits::Bf16(b.host(OP, "logits")?),
            };
            let col_start = match columns {
                Columns::Padded => None,
                Columns::Starts(b) => Some(b.host(OP, "col_start")?),
            };
            let out = match out {
                Outputs::Full(p) => reference::HostOutputs::Full(p.host_mut(OP, "p")?),
                Outputs::Live { p, greedy } => reference::HostOutputs::Live {
                    p: p.host_mut(OP, "p")?,
                    greedy: greedy.host_mut(OP, "greedy")?,
                },
            };
            let history = match history {
                History::Chain(d) => reference::HostHistory::Chain(d.host(OP, "proposals")?),
                History::Tree { tokens, parents } => reference::HostHistory::Tree {
                    tokens: tokens.host(OP, "tokens")?,
                    parents: parents.host(OP, "parents")?,
                },
            };
            reference::run(
                &logits,
                col_start,
                live.host(OP, "live")?,
                counts.host(OP, "counts")?,
                &history,
                &settings,
                out,
                params,
            )
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(c) => cuda::run(
            c, logits, columns, live, counts, history, sampling, out, params,
        ),
    }
}

// ---------------------------------------------------------------------------------------------
// Conformance cases.

/// A small deterministic hash generator for case inputs.
#[cfg(any(test, feature = "conformance"))]
pub(crate) struct Gen(u64);

#[cfg(any(test, feature = "conformance"))]
impl Gen {
    pub(crate) fn new(seed: u64) -> Self {
        Gen(seed ^ 0x5851_f42d_4c95_7f2d)
    }
    pub(crate) fn next_u64(&mut self) -> u64 {
        // SplitMix64.
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1) with 24 bits.
    pub(crate) fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / 16_777_216.0)
    }
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// Deterministic inputs of one case.
#[cfg(any(test, feature = "conformance"))]
pub(crate) struct CaseData {
    pub(crate) logits: Vec<f32>,
    pub(crate) live: Vec<i32>,
    pub(crate) counts: Vec<i32>,
    /// The nodes' tokens: a chain's proposals, or a tree's tokens.
    pub(crate) proposals: Vec<i32>,
    /// A tree's parents (`None`: a chain).
    pub(crate) parents: Option<Vec<i32>>,
    pub(crate) settings: Vec<Settings>,
}

/// Logits on a 1/64 grid (distinct-ish values with margins), a few strong tokens per column,
/// sparse counts and proposals drawn from the strong tokens (so penalties hit them).
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn case_data(
    rows: usize,
    cols: usize,
    vocab: usize,
    public_vocab: usize,
    seed: u64,
    settings: &[Settings],
) -> CaseData {
    let mut g = Gen::new(seed);
    let mut logits = vec![0f32; rows * cols * vocab];
    for (k, x) in logits.iter_mut().enumerate() {
        let v = k % vocab;
        // Background in [-6, 2), quantized to 1/64 so that differences are exact.
        let mut l = (g.unit() * 512.0).floor() / 64.0 - 6.0;
        if v >= public_vocab {
            l += 20.0; // the mask must remove strong non-public rows
        }
        *x = l;
    }
    // A few strong tokens per column.
    for rc in 0..rows * cols {
        for s in 0..6 {
            let v = g.below(public_vocab);
            logits[rc * vocab + v] = 4.0 + s as f32 * 0.75 + (g.below(8) as f32) / 64.0;
        }
    }
    let mut counts = vec![0i32; rows * vocab];
    for r in 0..rows {
        for _ in 0..16 {
            let v = g.below(public_vocab);
            counts[r * vocab + v] += 1 + g.below(3) as i32;
        }
    }
    let mut proposals = vec![0i32; rows * (cols - 1)];
    for r in 0..rows {
        for j in 0..cols - 1 {
            // Proposal d_(j+1) is one of the strong tokens of column j (or random).
            let col = &logits[(r * cols + j) * vocab..(r * cols + j + 1) * vocab];
            let mut best = 0usize;
            for v in 0..public_vocab {
                if col[v] > col[best] {
                    best = v;
                }
            }
            proposals[r * (cols - 1) + j] = if g.below(4) == 0 {
                g.below(public_vocab) as i32
            } else {
                best as i32
            };
        }
    }
    let live = (0..rows)
        .map(|r| {
            if r == 0 {
                cols as i32
            } else {
                1 + g.below(cols) as i32
            }
        })
        .collect();
    CaseData {
        logits,
        live,
        counts,
        proposals,
        parents: None,
        settings: (0..rows).map(|r| settings[r % settings.len()]).collect(),
    }
}

/// [`case_data`] as a tree: node `j`'s parent is `j - 1` or (two times in three) a random
/// earlier node, and its token the argmax of its parent's column (three times in four, so
/// that siblings often carry the same token, as a drafter's branches from one node would)
/// or a random public id. Logits, counts and live counts are [`case_data`]'s.
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn tree_case_data(
    rows: usize,
    cols: usize,
    vocab: usize,
    public_vocab: usize,
    seed: u64,
    settings: &[Settings],
) -> CaseData {
    let mut d = case_data(rows, cols, vocab, public_vocab, seed, settings);
    let mut g = Gen::new(seed ^ 0x7472_6565); // "tree"
    let k = cols - 1;
    let mut parents = vec![0i32; rows * k];
    for r in 0..rows {
        for j in 1..cols {
            let par = if g.below(3) == 0 { j - 1 } else { g.below(j) };
            parents[r * k + j - 1] = par as i32;
            let col = &d.logits[(r * cols + par) * vocab..(r * cols + par) * vocab + public_vocab];
            let mut best = 0usize;
            for (v, &x) in col.iter().enumerate() {
                if x > col[best] {
                    best = v;
                }
            }
            d.proposals[r * k + j - 1] = if g.below(4) == 0 {
                g.below(public_vocab) as i32
            } else {
                best as i32
            };
        }
    }
    d.parents = Some(parents);
    d
}

/// What a conformance case's inputs are.
#[cfg(any(test, feature = "conformance"))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Data {
    /// [`case_data`].
    Plain,
    /// [`tie_case_data`].
    Ties,
    /// [`tree_case_data`].
    Tree,
}

#[cfg(any(test, feature = "conformance"))]
impl Data {
    fn make(
        self,
        rows: usize,
        cols: usize,
        vocab: usize,
        public_vocab: usize,
        seed: u64,
        settings: &[Settings],
    ) -> CaseData {
        match self {
            Data::Plain => case_data(rows, cols, vocab, public_vocab, seed, settings),
            Data::Ties => tie_case_data(rows, cols, vocab, public_vocab, seed, settings),
            Data::Tree => tree_case_data(rows, cols, vocab, public_vocab, seed, settings),
        }
    }
}

/// Ids [`tie_case_data`] ties at the top of every column: spread over the vocabulary so that
/// on CUDA they fall in different blocks of a column's cluster (block `k` of 8 owns the ids
/// `k * 512 .. k * 512 + 511` modulo 4096), the lowest in block 0.
#[cfg(any(test, feature = "conformance"))]
pub(crate) const TIE_IDS: [usize; 5] = [37, 600, 1100, 1450, 3900];

/// [`case_data`] with every column's largest logit (9.0, above the strong tokens) at each of
/// the [`TIE_IDS`] below `public_vocab` and a count of zero there: the greedy argmax is a tie
/// broken by the lowest id, and a small top-k keeps the whole tie. The proposals of the plain
/// data (mostly the column's argmax, now the lowest tied id) then penalize that id in the
/// later columns of the row, moving the tie to the next ids.
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn tie_case_data(
    rows: usize,
    cols: usize,
    vocab: usize,
    public_vocab: usize,
    seed: u64,
    settings: &[Settings],
) -> CaseData {
    let mut d = case_data(rows, cols, vocab, public_vocab, seed, settings);
    let ids = TIE_IDS.iter().copied().filter(|&v| v < public_vocab);
    for rc in 0..rows * cols {
        for v in ids.clone() {
            d.logits[rc * vocab + v] = 9.0;
        }
    }
    for r in 0..rows {
        for v in ids.clone() {
            d.counts[r * vocab + v] = 0;
        }
        for j in 0..cols - 1 {
            // The plain proposal of column j was its argmax: now the lowest tied id that
            // the history has not penalized (the row's earlier proposals), as a drafter
            // that agrees with the target would propose.
            let taken = &d.proposals[r * (cols - 1)..r * (cols - 1) + j];
            if let Some(v) = ids.clone().find(|&v| !taken.contains(&(v as i32))) {
                d.proposals[r * (cols - 1) + j] = v as i32;
            }
        }
    }
    d
}

/// The settings mix of the cases: greedy, plain sampling, every filter, penalties.
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn settings_mix() -> Vec<Settings> {
    vec![
        Settings {
            repetition_penalty: 1.3,
            frequency_penalty: 0.25,
            presence_penalty: 0.5,
            ..Settings::GREEDY
        },
        Settings::sampling(1.0),
        Settings {
            temperature: 0.7,
            top_k: 20,
            top_p: 0.9,
            min_p: 0.05,
            repetition_penalty: 1.1,
            frequency_penalty: 0.1,
            presence_penalty: 0.2,
        },
        Settings {
            temperature: 1.3,
            top_k: 0,
            top_p: 0.8,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: -0.1,
            presence_penalty: 0.0,
        },
        Settings::GREEDY,
        Settings {
            temperature: 0.6,
            top_k: 5,
            top_p: 1.0,
            min_p: 0.1,
            repetition_penalty: 2.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
        },
    ]
}

/// The settings of the tree cases: [`settings_mix`] with penalties in every row (greedy and
/// sampled), so that every column's history is read.
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn tree_settings() -> Vec<Settings> {
    let mut s = settings_mix();
    s[1].repetition_penalty = 1.2;
    s[4].presence_penalty = 0.75;
    s
}

/// The settings of the tie cases: [`settings_mix`] with top-k values (3 and 2) below the
/// number of tied ids, so that the boundary falls inside the tie.
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn tie_settings() -> Vec<Settings> {
    let mut s = settings_mix();
    s[2].top_k = 3;
    s[5].top_k = 2;
    s
}

/// A case's history uploaded (`proposals`, or `tokens` and `parents`; checked unchanged after
/// the run).
#[cfg(any(test, feature = "conformance"))]
struct CaseHistory {
    tokens: Buffer<i32>,
    parents: Option<Buffer<i32>>,
}

#[cfg(any(test, feature = "conformance"))]
impl CaseHistory {
    fn upload(inputs: &mut InputCheck, be: &Backend, d: &CaseData) -> Result<Self> {
        Ok(match &d.parents {
            None => CaseHistory {
                tokens: inputs.upload(be, "proposals", &d.proposals)?,
                parents: None,
            },
            Some(parents) => CaseHistory {
                tokens: inputs.upload(be, "tokens", &d.proposals)?,
                parents: Some(inputs.upload(be, "parents", parents)?),
            },
        })
    }

    fn history(&self) -> History<'_> {
        match &self.parents {
            None => History::Chain(&self.tokens),
            Some(parents) => History::Tree {
                tokens: &self.tokens,
                parents,
            },
        }
    }

    fn verify(&self, inputs: &InputCheck, be: &Backend, modified: &mut Vec<String>) -> Result<()> {
        match &self.parents {
            None => inputs.verify(be, "proposals", &self.tokens, modified),
            Some(parents) => {
                inputs.verify(be, "tokens", &self.tokens, modified)?;
                inputs.verify(be, "parents", parents, modified)
            }
        }
    }
}

/// A case's sampling settings uploaded as the seven per-row buffers (checked unchanged after
/// the run).
#[cfg(any(test, feature = "conformance"))]
struct CaseSettings {
    temperature: Buffer<f32>,
    top_k: Buffer<i32>,
    top_p: Buffer<f32>,
    min_p: Buffer<f32>,
    rep: Buffer<f32>,
    freq: Buffer<f32>,
    pres: Buffer<f32>,
}

#[cfg(any(test, feature = "conformance"))]
impl CaseSettings {
    fn upload(inputs: &mut InputCheck, be: &Backend, s: &[Settings]) -> Result<Self> {
        let col = |f: fn(&Settings) -> f32| s.iter().map(f).collect::<Vec<f32>>();
        Ok(CaseSettings {
            temperature: inputs.upload(be, "temperature", &col(|x| x.temperature))?,
            top_k: inputs.upload(be, "top_k", &s.iter().map(|x| x.top_k).collect::<Vec<_>>())?,
            top_p: inputs.upload(be, "top_p", &col(|x| x.top_p))?,
            min_p: inputs.upload(be, "min_p", &col(|x| x.min_p))?,
            rep: inputs.upload(be, "repetition_penalty", &col(|x| x.repetition_penalty))?,
            freq: inputs.upload(be, "frequency_penalty", &col(|x| x.frequency_penalty))?,
            pres: inputs.upload(be, "presence_penalty", &col(|x| x.presence_penalty))?,
        })
    }

    fn sampling(&self) -> Sampling<'_> {
        Sampling {
            temperature: &self.temperature,
            top_k: &self.top_k,
            top_p: &self.top_p,
            min_p: &self.min_p,
            repetition_penalty: &self.rep,
            frequency_penalty: &self.freq,
            presence_penalty: &self.pres,
        }
    }

    fn verify(&self, inputs: &InputCheck, be: &Backend, modified: &mut Vec<String>) -> Result<()> {
        inputs.verify(be, "temperature", &self.temperature, modified)?;
        inputs.verify(be, "top_k", &self.top_k, modified)?;
        inputs.verify(be, "top_p", &self.top_p, modified)?;
        inputs.verify(be, "min_p", &self.min_p, modified)?;
        inputs.verify(be, "repetition_penalty", &self.rep, modified)?;
        inputs.verify(be, "frequency_penalty", &self.freq, modified)?;
        inputs.verify(be, "presence_penalty", &self.pres, modified)
    }
}

#[cfg(any(test, feature = "conformance"))]
fn case(
    rows: usize,
    cols: usize,
    vocab: usize,
    public_vocab: usize,
    seed: u64,
    settings: Vec<Settings>,
    data: Data,
) -> impl Fn(&Backend) -> Result<CaseRun> + Send + Sync {
    move |be: &Backend| {
        let d = data.make(rows, cols, vocab, public_vocab, seed, &settings);
        let mut inputs = InputCheck::default();
        let logits = inputs.upload(be, "logits", &d.logits)?;
        let live = inputs.upload(be, "live", &d.live)?;
        let counts = inputs.upload(be, "counts", &d.counts)?;
        let history = CaseHistory::upload(&mut inputs, be, &d)?;
        let settings = CaseSettings::upload(&mut inputs, be, &d.settings)?;
        let n = rows * cols * vocab;
        let mut p = be.filled(n, f32::POISON)?;
        let sampling = settings.sampling();
        let params = Params {
            rows,
            cols,
            vocab,
            public_vocab,
        };
        run_with(
            be,
            Logits::F32(&logits),
            Columns::Padded,
            &live,
            &counts,
            history.history(),
            &sampling,
            Outputs::Full(&mut p),
            &params,
        )?;
        let mut modified = Vec::new();
        inputs.verify(be, "logits", &logits, &mut modified)?;
        inputs.verify(be, "live", &live, &mut modified)?;
        inputs.verify(be, "counts", &counts, &mut modified)?;
        history.verify(&inputs, be, &mut modified)?;
        settings.verify(&inputs, be, &mut modified)?;
        Ok(CaseRun {
            outputs: vec![output(
                "p",
                Criterion::Close {
                    abs: 1e-7,
                    rel: 1e-5,
                    bf16_ulps: 0,
                },
                &vec![f32::POISON; n],
                &be.download(&p)?,
                |_| true,
            )],
            modified_inputs: modified,
        })
    }
}

/// How a [`live_case`] stores its logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg(any(test, feature = "conformance"))]
pub(crate) enum CaseLayout {
    /// `[rows, cols, vocab]`, `col_start[r] = r * cols` (dead columns stored, never read).
    Padded,
    /// Only the live columns, `col_start` the prefix sums of the live counts.
    Packed,
}

/// The stored logits of a case in `layout` (f32 values) and its `col_start`.
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn stored_logits(
    d: &CaseData,
    cols: usize,
    vocab: usize,
    layout: CaseLayout,
) -> (Vec<f32>, Vec<i32>) {
    match layout {
        CaseLayout::Padded => (
            d.logits.clone(),
            (0..d.live.len()).map(|r| (r * cols) as i32).collect(),
        ),
        CaseLayout::Packed => {
            let mut values = Vec::new();
            let mut starts = Vec::with_capacity(d.live.len());
            for (r, &q) in d.live.iter().enumerate() {
                starts.push((values.len() / vocab) as i32);
                let base = r * cols * vocab;
                values.extend_from_slice(&d.logits[base..base + q as usize * vocab]);
            }
            (values, starts)
        }
    }
}

/// The logits buffer a case owns, in its dtype.
#[cfg(any(test, feature = "conformance"))]
enum CaseLogits {
    F32(Buffer<f32>),
    Bf16(Buffer<bf16>),
}

/// A case of the `Live` form: logits in `dtype` (f32, or the bf16 rounding of the case's f32
/// logits) stored in `layout` and read through `col_start`; `p` and `greedy` poisoned before
/// the run. Outputs: `greedy` (exact, live columns written, dead ones untouched), `p` of the
/// live sampled columns (close) and `p_untouched`, every other element of `p` (exact: the
/// greedy and dead columns' rows must keep the poison).
#[cfg(any(test, feature = "conformance"))]
fn live_case(
    rows: usize,
    cols: usize,
    vocab: usize,
    public_vocab: usize,
    seed: u64,
    settings: Vec<Settings>,
    dtype: DType,
    layout: CaseLayout,
    data: Data,
) -> impl Fn(&Backend) -> Result<CaseRun> + Send + Sync {
    move |be: &Backend| {
        let d = data.make(rows, cols, vocab, public_vocab, seed, &settings);
        let (values, col_start) = stored_logits(&d, cols, vocab, layout);
        let mut inputs = InputCheck::default();
        let held = if dtype == DType::BF16 {
            let bits: Vec<bf16> = values.iter().map(|&x| bf16::from_f32(x)).collect();
            CaseLogits::Bf16(inputs.upload(be, "logits", &bits)?)
        } else {
            CaseLogits::F32(inputs.upload(be, "logits", &values)?)
        };
        let logits = match &held {
            CaseLogits::F32(l) => Logits::F32(l),
            CaseLogits::Bf16(l) => Logits::Bf16(l),
        };
        let starts = inputs.upload(be, "col_start", &col_start)?;
        let live = inputs.upload(be, "live", &d.live)?;
        let counts = inputs.upload(be, "counts", &d.counts)?;
        let history = CaseHistory::upload(&mut inputs, be, &d)?;
        let s = &d.settings;
        let settings = CaseSettings::upload(&mut inputs, be, s)?;
        let n = rows * cols * vocab;
        let mut p = be.filled(n, f32::POISON)?;
        let mut greedy = be.filled(rows * cols, i32::POISON)?;
        let sampling = settings.sampling();
        run_with(
            be,
            logits,
            Columns::Starts(&starts),
            &live,
            &counts,
            history.history(),
            &sampling,
            Outputs::Live {
                p: &mut p,
                greedy: &mut greedy,
            },
            &Params {
                rows,
                cols,
                vocab,
                public_vocab,
            },
        )?;
        let mut modified = Vec::new();
        match &held {
            CaseLogits::F32(l) => inputs.verify(be, "logits", l, &mut modified)?,
            CaseLogits::Bf16(l) => inputs.verify(be, "logits", l, &mut modified)?,
        }
        inputs.verify(be, "col_start", &starts, &mut modified)?;
        inputs.verify(be, "live", &live, &mut modified)?;
        inputs.verify(be, "counts", &counts, &mut modified)?;
        history.verify(&inputs, be, &mut modified)?;
        settings.verify(&inputs, be, &mut modified)?;
        // The footprint: live columns write `greedy`; live sampled columns write their p row.
        let is_live = |rc: usize| (rc % cols) < d.live[rc / cols] as usize;
        let sampled = |rc: usize| is_live(rc) && s[rc / cols].temperature > 0.0;
        let p_all = be.download(&p)?;
        let (mut p_written, mut p_left) = (Vec::new(), Vec::new());
        for (rc, row) in p_all.chunks(vocab).enumerate() {
            if sampled(rc) {
                p_written.extend_from_slice(row);
            } else {
                p_left.extend_from_slice(row);
            }
        }
        let any_greedy = (0..rows * cols).any(|rc| is_live(rc) && !sampled(rc));
        let mut greedy_out = output(
            "greedy",
            Criterion::Exact,
            &vec![i32::POISON; rows * cols],
            &be.download(&greedy)?,
            is_live,
        );
        // Without a greedy row every live entry is -1 by contract.
        greedy_out.allow_constant = !any_greedy;
        let mut outputs = vec![greedy_out];
        if !p_written.is_empty() {
            outputs.push(output(
                "p",
                Criterion::Close {
                    abs: 1e-7,
                    rel: 1e-5,
                    bf16_ulps: 0,
                },
                &vec![f32::POISON; p_written.len()],
                &p_written,
                |_| true,
            ));
        }
        let mut left = output(
            "p_untouched",
            Criterion::Exact,
            &vec![f32::POISON; p_left.len()],
            &p_left,
            |_| false,
        );
        left.allow_constant = true; // the poison, by contract
        outputs.push(left);
        Ok(CaseRun {
            outputs,
            modified_inputs: modified,
        })
    }
}

/// Official vocabulary rows and public rows (Qwen3.5).
#[cfg(any(test, feature = "conformance"))]
pub(crate) const OFFICIAL_VOCAB: usize = 248_320;
/// Official public vocabulary.
#[cfg(any(test, feature = "conformance"))]
pub(crate) const OFFICIAL_PUBLIC: usize = 248_077;

/// Conformance cases.
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn cases() -> Vec<Case> {
    vec![
        Case::new(
            OP,
            "rows8_cols16_v4096_mixed_settings",
            case(8, 16, 4096, 4000, 11, settings_mix(), Data::Plain),
        ),
        Case::new(
            OP,
            "rows1_cols2_official_vocab_filters",
            case(
                1,
                2,
                OFFICIAL_VOCAB,
                OFFICIAL_PUBLIC,
                12,
                vec![settings_mix()[2]],
                Data::Plain,
            ),
        ),
        Case::new(
            OP,
            "rows1_cols2_official_vocab_greedy_penalties",
            case(
                1,
                2,
                OFFICIAL_VOCAB,
                OFFICIAL_PUBLIC,
                13,
                vec![settings_mix()[0]],
                Data::Plain,
            ),
        ),
        Case::new(
            OP,
            "rows8_cols16_official_vocab_mixed_settings",
            case(
                8,
                16,
                OFFICIAL_VOCAB,
                OFFICIAL_PUBLIC,
                14,
                settings_mix(),
                Data::Plain,
            ),
        )
        .heavy(),
        // The `Live` form (greedy ids, p rows of sampled columns only, p poisoned), logits
        // read through `col_start`.
        Case::new(
            OP,
            "rows8_cols16_v4096_live_f32_padded_mixed",
            live_case(
                8,
                16,
                4096,
                4000,
                15,
                settings_mix(),
                DType::F32,
                CaseLayout::Padded,
                Data::Plain,
            ),
        ),
        Case::new(
            OP,
            "rows8_cols16_v4096_live_bf16_packed_mixed",
            live_case(
                8,
                16,
                4096,
                4000,
                16,
                settings_mix(),
                DType::BF16,
                CaseLayout::Packed,
                Data::Plain,
            ),
        ),
        Case::new(
            OP,
            "rows1_cols16_official_vocab_live_bf16_packed_greedy_penalties",
            live_case(
                1,
                16,
                OFFICIAL_VOCAB,
                OFFICIAL_PUBLIC,
                17,
                vec![settings_mix()[0]],
                DType::BF16,
                CaseLayout::Packed,
                Data::Plain,
            ),
        ),
        Case::new(
            OP,
            "rows1_cols16_official_vocab_live_f32_packed_filters",
            live_case(
                1,
                16,
                OFFICIAL_VOCAB,
                OFFICIAL_PUBLIC,
                18,
                vec![settings_mix()[2]],
                DType::F32,
                CaseLayout::Packed,
                Data::Plain,
            ),
        ),
        Case::new(
            OP,
            "rows8_cols16_official_vocab_live_bf16_packed_mixed",
            live_case(
                8,
                16,
                OFFICIAL_VOCAB,
                OFFICIAL_PUBLIC,
                19,
                settings_mix(),
                DType::BF16,
                CaseLayout::Packed,
                Data::Plain,
            ),
        )
        .heavy(),
        Case::new(
            OP,
            "rows8_cols16_official_vocab_live_f32_padded_mixed",
            live_case(
                8,
                16,
                OFFICIAL_VOCAB,
                OFFICIAL_PUBLIC,
                20,
                settings_mix(),
                DType::F32,
                CaseLayout::Padded,
                Data::Plain,
            ),
        )
        .heavy(),
        // Ties at the top of every column across the blocks of a CUDA column's cluster (the
        // argmax's lowest id, a top-k boundary keeping the whole tie), and a vocabulary that
        // leaves most of a cluster's blocks without a public id.
        Case::new(
            OP,
            "rows6_cols6_v4096_ties_mixed",
            case(6, 6, 4096, 4000, 21, tie_settings(), Data::Ties),
        ),
        Case::new(
            OP,
            "rows6_cols6_v1500_live_f32_padded_ties_mixed",
            live_case(
                6,
                6,
                1500,
                1460,
                22,
                tie_settings(),
                DType::F32,
                CaseLayout::Padded,
                Data::Ties,
            ),
        ),
        // A vocabulary that is not a multiple of 4: the first pass's scalar loads (CUDA).
        Case::new(
            OP,
            "rows6_cols6_v1499_live_bf16_packed_mixed",
            live_case(
                6,
                6,
                1499,
                1457,
                24,
                settings_mix(),
                DType::BF16,
                CaseLayout::Packed,
                Data::Plain,
            ),
        ),
        Case::new(
            OP,
            "rows6_cols16_official_vocab_live_bf16_packed_ties_mixed",
            live_case(
                6,
                16,
                OFFICIAL_VOCAB,
                OFFICIAL_PUBLIC,
                23,
                tie_settings(),
                DType::BF16,
                CaseLayout::Packed,
                Data::Ties,
            ),
        ),
        // Tree histories (DFlash2 tree verification): random trees whose siblings often share
        // a token, penalties in every row, so that each column's history is its root path
        // alone (CUDA: the one-thread walk in shared memory).
        Case::new(
            OP,
            "rows8_cols32_v4096_tree_penalties_mixed",
            case(8, 32, 4096, 4000, 25, tree_settings(), Data::Tree),
        ),
        Case::new(
            OP,
            "rows8_cols32_v4096_live_bf16_packed_tree_penalties_mixed",
            live_case(
                8,
                32,
                4096,
                4000,
                26,
                tree_settings(),
                DType::BF16,
                CaseLayout::Packed,
                Data::Tree,
            ),
        ),
        Case::new(
            OP,
            "rows1_cols16_official_vocab_live_f32_packed_tree_filters_penalties",
            live_case(
                1,
                16,
                OFFICIAL_VOCAB,
                OFFICIAL_PUBLIC,
                27,
                vec![tree_settings()[2]],
                DType::F32,
                CaseLayout::Packed,
                Data::Tree,
            ),
        ),
        Case::new(
            OP,
            "rows1_cols16_official_vocab_live_bf16_packed_tree_greedy_penalties",
            live_case(
                1,
                16,
                OFFICIAL_VOCAB,
                OFFICIAL_PUBLIC,
                28,
                vec![tree_settings()[0]],
                DType::BF16,
                CaseLayout::Packed,
                Data::Tree,
            ),
        ),
    ]
}
