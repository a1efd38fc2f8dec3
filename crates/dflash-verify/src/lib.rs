//! `dflash-verify`: what an engine calls after the target's verify forward. It turns the
//! target's per-column logits into the processed target distributions, verifies every row's
//! proposal chain against them (greedy, or stochastic with the actual proposal q), and returns
//! each row's [`RoundOutcome`].
//!
//! # The round (specification, "verification")
//!
//! A row is one request with frontier `F` (positions `[0, F)` processed), anchor `a = x_F` and
//! `P` proposals `d_1 .. d_P` (`0 <= P <= K = W - 1`). The target verified the `Q = P + 1` live
//! columns `[a, d_1, .., d_P]` at positions `F .. F + P`; column `i` predicts position
//! `F + 1 + i`. For every live column `i` the processed target distribution `p_i` is (the
//! `target_distribution` op of `dflash-ops`, whose contract fixes every rounding point):
//!
//! - public vocabulary mask (rows `>= public_vocab` get probability 0);
//! - penalties (repetition, frequency, presence) from the counts of the row's [`TokenHistory`]
//!   (prompt and published tokens through the anchor) **plus `d_1 ..= d_i`**: the accepted
//!   proposals are added to the history as the scan advances;
//! - temperature (finite and `>= 0`, the one rule of `dflash_config::check_temperature`; 0:
//!   greedy, `p_i` is the one-hot argmax, ties to the lowest id, kept as that id alone), then
//!   top-k, top-p, min-p.
//!
//! Acceptance (the `chain_accept` op): for `i = 0, 1, ..` test `d_(i+1)` against `p_i` with
//! probability `min(1, p_i(d) / q_i(d))`; at the first rejection emit the correction drawn from
//! `max(p_i - q_i, 0)` (normalized); if all `P` are accepted emit the bonus drawn from `p_P`.
//! `q_i` is the actual proposal distribution: one-hot at `d_(i+1)` for DFlash
//! ([`ProposalKind::OneHot`]), the retained FP32 conditional q over 16 global candidate ids for
//! DFlash2 ([`ProposalKind::Top16`], [`RetainedQ`]). With a greedy target this is exactly greedy
//! verification: accept the matching argmax prefix, then the argmax as correction or bonus.
//!
//! The outcome licenses `y = [d_1, .., d_A, correction_or_bonus]`, `L = A + 1` outputs. Output
//! `j` (1-based) continues from verify column `j - 1`
//! ([`RoundOutcome::continuation_column`]): committing `N` outputs commits the `N` target input
//! rows `[a, d_1, .., d_(N-1)]`, whose last column `N - 1` holds the continuation hidden/features.
//!
//! # Random draws (the RNG identity of `dflash_ops::rng`)
//!
//! Every draw is `rng::uniform(seed, position, purpose, 0)` with the row's own seed; the batch
//! row, the batch size and the other rows never enter it, so a row's outcome is a function of
//! that row's inputs alone.
//!
//! | draw | purpose | position | sub |
//! |---|---|---|---|
//! | acceptance test of `d_(i+1)` (predicts position `F+1+i`), `i = 0..A` (`A+1` tests when a rejection stops the scan) | `Accept` (2) | `F+1+i` | 0 |
//! | correction after rejecting `d_(A+1)` | `Correction` (3) | `F+1+A` | 0 |
//! | bonus after accepting all `P` | `Bonus` (4) | `F+P+1` | 0 |
//!
//! So the token emitted for position `t` is always drawn at position `t`. The DFlash2
//! selector's own draw for position `F+1+i` uses `(F+i, Dflash2Proposal)`, and plain decoding
//! of position `t` uses `(t, Decode)`: no draw of a round ever reuses another decision's
//! counter.
//!
//! # Device use
//!
//! [`VerifyWorkspace`] holds every device buffer of the round, allocated once in
//! [`VerifyWorkspace::new`] for `(B, W, vocab_rows)` ([`VerifyWorkspace::bytes`]); a call
//! allocates nothing on the device. It writes the round's metadata of its `n <= B` rows (live
//! counts, logits column starts, proposals, q and ids, settings, seeds, frontiers, history
//! counts) into the first `n` rows of those buffers, runs the two ops on exactly `n` rows
//! (nothing is padded: rows `n..B` are neither read nor written) and reads back only the
//! outcome (`n * (W + 2)` integers). History counts are synchronized incrementally: the
//! workspace keeps a host mirror of each row slot's device counts and rewrites only the
//! changed id range of a slot.
//!
//! The target's logits ([`TargetLogits`]) are F32 or BF16 (a BF16 logit is widened exactly to
//! F32 when it is read, so BF16 logits verify exactly like their F32 widening) and padded
//! (`[n, W, vocab_rows]`, dead columns never read) or packed (only the `P + 1` live columns of
//! each row, row after row). The workspace writes row `r`'s first logits column (`r * W`, or
//! the live columns of the rows before it) into a device buffer with the round's metadata, so
//! a captured graph replays with new values. Greedy rows (temperature 0) write no vocabulary
//! row: `target_distribution` records each greedy column's argmax id (`[B, W]` integers) and
//! `chain_accept` verifies against its one-hot from that id; only sampled columns write their
//! F32 `p` row.
//!
//! # Validation
//!
//! Everything is checked before anything is written ([`VerifyError`]): shapes, `P <= K`,
//! token ids (below the vocabulary rows and public), the history (length `F + 1`, last token
//! = anchor), settings, every retained q (finite, `>= 0`, sum within [`Q_SUM_TOLERANCE`] of 1,
//! distinct ids, the proposal among them with `q > 0`), that the logits hold every live column
//! in their layout and, on the CPU backend, the logits themselves (no NaN or `+inf` public
//! logit, at least one finite public logit per live column). On the
//! CUDA backend the logits are the caller's guarantee (reading them back would stall the
//! stream); the ops clamp so that they never access out of bounds.

#![deny(missing_docs)]

mod error;
mod history;
mod tree;

pub use error::{QFault, Result, TokenRole, VerifyError};
pub use history::{MAX_COUNT, TokenHistory};
pub use tree::{TreeOutcome, TreeRow};

pub use dflash_ops::target_distribution::Logits;
pub use dflash_ops::target_distribution::Settings as SamplingSettings;

use dflash_ops::target_distribution::{self, SamplingBuffers};
use dflash_ops::{Backend, Buffer, Element, Graph, PendingRead, chain_accept};

/// Retained candidates per DFlash2 proposal column.
pub const TOP: usize = chain_accept::TOP;

/// Largest `|sum(q) - 1|` (f64 sum of the 16 f32 values) accepted for a retained q. The
/// selector's softmax rounds each of 16 values once to f32 (relative error `2^-24`) and sums
/// them in f32, so a genuine q is within about `2e-6` of 1; `1e-4` leaves ample room while
/// still refusing unnormalized scores or a truncated distribution.
pub const Q_SUM_TOLERANCE: f64 = 1e-4;

/// Which proposal distribution the rows of a workspace carry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProposalKind {
    /// DFlash: per-column argmax proposals, q a point mass at the proposal.
    OneHot,
    /// DFlash2: the conditional selector's retained FP32 q over 16 global candidate ids.
    Top16,
}

impl ProposalKind {
    fn name(self) -> &'static str {
        match self {
            ProposalKind::OneHot => "one-hot (DFlash)",
            ProposalKind::Top16 => "top-16 (DFlash2)",
        }
    }
}

/// The retained proposal distribution of one proposal column (DFlash2): `q[s]` is the
/// probability of global token `ids[s]`. The q that proposed `d_(i+1)` is the row's
/// `i`-th [`RetainedQ`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RetainedQ {
    /// Global candidate token ids, distinct, public.
    pub ids: [u32; TOP],
    /// FP32 probabilities, finite, `>= 0`, summing to 1 (within [`Q_SUM_TOLERANCE`]).
    pub q: [f32; TOP],
}

/// A row's proposal distribution.
#[derive(Clone, Copy, Debug)]
pub enum ProposalDist<'a> {
    /// One-hot q (DFlash).
    OneHot,
    /// One retained q per proposal (DFlash2), `P` entries.
    Top16(&'a [RetainedQ]),
}

impl ProposalDist<'_> {
    fn kind(&self) -> ProposalKind {
        match self {
            ProposalDist::OneHot => ProposalKind::OneHot,
            ProposalDist::Top16(_) => ProposalKind::Top16,
        }
    }
}

/// One row of a verification batch: one request after its verify forward.
#[derive(Clone, Copy, Debug)]
pub struct VerifyRow<'a> {
    /// The anchor `a = x_F` (the last token of `history`).
    pub anchor: u32,
    /// The proposals `d_1 .. d_P` that were verified (`P <= K`).
    pub proposals: &'a [u32],
    /// Their proposal distribution.
    pub dist: ProposalDist<'a>,
    /// The request's sampling settings (temperature finite and `>= 0`; 0 is greedy).
    pub settings: SamplingSettings,
    /// The request seed (the key of every draw).
    pub seed: u64,
    /// The frontier `F` (the anchor's position).
    pub frontier: u64,
    /// Tokens `x_0 ..= x_F` (see [`TokenHistory`]).
    pub history: &'a TokenHistory,
}

/// What a licensed output is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OutputKind {
    /// An accepted proposal.
    Accepted,
    /// The target's correction after the first rejection.
    Correction,
    /// The bonus token after every proposal was accepted.
    Bonus,
}

/// The outcome of one row's round: `A` accepted proposals and the `L = A + 1` licensed outputs
/// `y_1 .. y_L = [d_1, .., d_A, correction_or_bonus]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoundOutcome {
    accepted: usize,
    proposals: usize,
    outputs: Vec<u32>,
}

impl RoundOutcome {
    /// `A`, the accepted proposals.
    pub fn accepted(&self) -> usize {
        self.accepted
    }

    /// `P`, the proposals that were verified.
    pub fn proposals(&self) -> usize {
        self.proposals
    }

    /// `y_1 .. y_L`.
    pub fn outputs(&self) -> &[u32] {
        &self.outputs
    }

    /// `L = A + 1` (never 0).
    pub fn len(&self) -> usize {
        self.outputs.len()
    }

    /// Always false: a round licenses at least one output.
    pub fn is_empty(&self) -> bool {
        self.outputs.is_empty()
    }

    /// The kind of the last output: [`OutputKind::Bonus`] when all `P` were accepted,
    /// otherwise [`OutputKind::Correction`].
    pub fn last_kind(&self) -> OutputKind {
        if self.accepted == self.proposals {
            OutputKind::Bonus
        } else {
            OutputKind::Correction
        }
    }

    /// The kind of output `j` (1-based, `1..=L`); `None` outside.
    pub fn kind(&self, j: usize) -> Option<OutputKind> {
        match j {
            0 => None,
            j if j <= self.accepted => Some(OutputKind::Accepted),
            j if j == self.accepted + 1 => Some(self.last_kind()),
            _ => None,
        }
    }

    /// The verify column whose captured hidden/features continue the sequence after
    /// committing `j` outputs (`j` in `1..=L`): `j - 1`. `None` outside `1..=L`.
    pub fn continuation_column(&self, j: usize) -> Option<usize> {
        (1..=self.len()).contains(&j).then(|| j - 1)
    }
}

/// How the target laid out its verify logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LogitsLayout {
    /// `[n, W, vocab_rows]`: row `r`'s column `i` at logits column `r * W + i` (dead columns
    /// are never read). The buffer holds whole `[W, vocab_rows]` rows, at least `n`.
    Padded,
    /// Only the live columns: row `r`'s `P_r + 1` columns follow the previous row's
    /// (`[sum_r (P_r + 1), vocab_rows]`). The buffer holds whole vocabulary columns, at least
    /// that many.
    Packed,
}

impl std::fmt::Display for LogitsLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LogitsLayout::Padded => "padded",
            LogitsLayout::Packed => "packed",
        })
    }
}

/// The target's verify logits of a batch: the buffer (F32 or BF16) and its layout.
#[derive(Clone, Copy, Debug)]
pub struct TargetLogits<'a> {
    /// The logits, on the workspace's backend.
    pub values: Logits<'a>,
    /// Where each row's columns lie.
    pub layout: LogitsLayout,
}

impl<'a> TargetLogits<'a> {
    /// Padded logits `[n, W, vocab_rows]` (`&Buffer<f32>` or `&Buffer<bf16>`).
    pub fn padded(values: impl Into<Logits<'a>>) -> Self {
        TargetLogits {
            values: values.into(),
            layout: LogitsLayout::Padded,
        }
    }

    /// Packed logits: only the live columns, row after row.
    pub fn packed(values: impl Into<Logits<'a>>) -> Self {
        TargetLogits {
            values: values.into(),
            layout: LogitsLayout::Packed,
        }
    }
}

/// The static shape of a [`VerifyWorkspace`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VerifyShape {
    /// Row capacity B (the most requests one call verifies).
    pub max_rows: usize,
    /// Verify columns W = K + 1 (the logits' column axis).
    pub cols: usize,
    /// Vocabulary rows of the logits (padded vocabulary, e.g. 248320).
    pub vocab_rows: usize,
    /// Public vocabulary (e.g. 248077).
    pub public_vocab: usize,
    /// The proposal distribution every row carries.
    pub kind: ProposalKind,
}

/// Device buffers of the round plus their host staging, sized once for a [`VerifyShape`]
/// (every device buffer is allocated by [`VerifyWorkspace::new`]; a call of `n <= B` rows uses
/// the first `n` rows of each).
#[derive(Debug)]
pub struct VerifyWorkspace {
    shape: VerifyShape,
    live: Buffer<i32>,
    /// `[B]`: each row's first logits column.
    col_start: Buffer<i32>,
    counts: Buffer<i32>,
    proposals: Buffer<i32>,
    q: Buffer<f32>,
    ids: Buffer<i32>,
    sampling: SamplingBuffers,
    seeds: Buffer<i32>,
    start_pos: Buffer<i32>,
    /// `[B, W, V]`: the distributions of sampled columns (greedy columns leave it alone).
    p: Buffer<f32>,
    /// `[B, W]`: each greedy column's argmax, -1 for a sampled column.
    greedy: Buffer<i32>,
    accepted: Buffer<i32>,
    out_tokens: Buffer<i32>,
    out_len: Buffer<i32>,
    /// `[B, W-1]`: a tree's parents ([`VerifyWorkspace::verify_tree`]).
    parents: Buffer<i32>,
    /// `[B, W]`: a tree's accepted path.
    path: Buffer<i32>,
    /// Host mirror of `counts` and, per slot, the ids that are nonzero there.
    counts_mirror: Vec<i32>,
    slot_ids: Vec<Vec<u32>>,
    /// False when a device write of the counts may have failed half-way: the next call
    /// rewrites every count.
    counts_synced: bool,
    staging: Staging,
    graphs: Graphs,
}

/// The device verifications recorded as CUDA graphs ([`VerifyWorkspace::use_graphs`]).
///
/// A graph replays with the addresses it was recorded with, and the target's logits are lent
/// anew by every verify (a target may move them), so a graph is keyed by everything whose
/// address or shape it holds: the row count, the logits buffer (address, length, dtype) and
/// the draft's proposal buffers. A key is recorded the second time it is seen (a target whose
/// logits never repeat an address runs eagerly and never pays for a capture); at most
/// [`GRAPH_KEYS`] graphs and as many once-seen keys are kept, the oldest dropped first.
#[derive(Debug, Default)]
struct Graphs {
    on: bool,
    /// Why recording stopped (a capture failed; the verifications run eagerly).
    refused: Option<String>,
    recorded: Vec<(GraphKey, Graph)>,
    seen: Vec<GraphKey>,
    replays: u64,
    captures: u64,
}

/// Most graphs (and once-seen keys) a workspace keeps.
pub const GRAPH_KEYS: usize = 32;

/// What a recorded device verification holds fixed (see [`Graphs`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct GraphKey {
    rows: usize,
    logits: (u64, usize, bool),
    ids: (u64, usize),
    top16: Option<(u64, usize, u64, usize)>,
}

impl GraphKey {
    fn of(rows: usize, logits: &Logits<'_>, proposals: &DeviceProposals<'_>) -> Self {
        let logits = match logits {
            Logits::F32(b) => (b.address(), b.len(), false),
            Logits::Bf16(b) => (b.address(), b.len(), true),
        };
        GraphKey {
            rows,
            logits,
            ids: (proposals.ids.address(), proposals.ids.len()),
            top16: proposals.top16.map(|t| {
                (
                    t.candidates.address(),
                    t.candidates.len(),
                    t.q.address(),
                    t.q.len(),
                )
            }),
        }
    }
}

/// How [`VerifyWorkspace::verify_device`] runs its device work this time.
enum Run {
    Eager,
    Capture,
    Replay(usize),
}

impl Graphs {
    fn plan(&mut self, key: GraphKey) -> Run {
        if !self.on || self.refused.is_some() {
            return Run::Eager;
        }
        if let Some(i) = self.recorded.iter().position(|(k, _)| *k == key) {
            return Run::Replay(i);
        }
        if let Some(i) = self.seen.iter().position(|k| *k == key) {
            self.seen.remove(i);
            return Run::Capture;
        }
        if self.seen.len() == GRAPH_KEYS {
            self.seen.remove(0);
        }
        self.seen.push(key);
        Run::Eager
    }

    fn keep(&mut self, key: GraphKey, graph: Graph) {
        if self.recorded.len() == GRAPH_KEYS {
            self.recorded.remove(0);
        }
        self.recorded.push((key, graph));
        self.captures += 1;
    }
}

/// Reused host staging of the per-round metadata.
#[derive(Debug, Default)]
struct Staging {
    live: Vec<i32>,
    col_start: Vec<i32>,
    proposals: Vec<i32>,
    parents: Vec<i32>,
    q: Vec<f32>,
    ids: Vec<i32>,
    temperature: Vec<f32>,
    top_k: Vec<i32>,
    top_p: Vec<f32>,
    min_p: Vec<f32>,
    rep: Vec<f32>,
    freq: Vec<f32>,
    pres: Vec<f32>,
    seeds: Vec<i32>,
    start_pos: Vec<i32>,
}

fn shape_err(param: &'static str, found: usize, expected: String) -> VerifyError {
    VerifyError::Shape {
        param,
        found,
        expected,
    }
}

impl VerifyWorkspace {
    /// Allocate every buffer for `shape` on `be` ([`Self::bytes`] of device memory); no call
    /// allocates afterwards.
    pub fn new(be: &Backend, shape: VerifyShape) -> Result<Self> {
        let VerifyShape {
            max_rows: b,
            cols: w,
            vocab_rows: v,
            public_vocab,
            kind,
        } = shape;
        let max_cols = target_distribution::MAX_COLS.min(chain_accept::MAX_COLS);
        if b == 0 || b > u32::MAX as usize {
            return Err(shape_err("max_rows", b, "1..2^32".into()));
        }
        if !(1..=max_cols).contains(&w) {
            return Err(shape_err("cols", w, format!("1..={max_cols}")));
        }
        let max_vocab = target_distribution::MAX_VOCAB.min(chain_accept::MAX_VOCAB);
        if !(1..=max_vocab).contains(&v) {
            return Err(shape_err("vocab_rows", v, format!("1..={max_vocab}")));
        }
        if !(1..=v).contains(&public_vocab) {
            return Err(shape_err(
                "public_vocab",
                public_vocab,
                format!("1..=vocab_rows ({v})"),
            ));
        }
        let total = b
            .checked_mul(w)
            .and_then(|n| n.checked_mul(v))
            .ok_or_else(|| shape_err("max_rows", b, "B * W * vocab_rows within usize".into()))?;
        if b * w > i32::MAX as usize {
            // Logits column starts (up to B * W) are i32 device metadata.
            return Err(shape_err("max_rows", b, "B * W below 2^31".into()));
        }
        let k = w - 1;
        let top_len = if kind == ProposalKind::Top16 {
            b * k * TOP
        } else {
            0
        };
        let greedy = vec![SamplingSettings::GREEDY; b];
        Ok(VerifyWorkspace {
            shape,
            live: be.filled(b, 1)?,
            col_start: be.zeros(b)?,
            counts: be.zeros(b * v)?,
            proposals: be.zeros(b * k)?,
            q: be.zeros(top_len)?,
            ids: be.zeros(top_len)?,
            sampling: SamplingBuffers::upload(be, &greedy)?,
            seeds: be.zeros(2 * b)?,
            start_pos: be.zeros(b)?,
            p: be.zeros(total)?,
            greedy: be.zeros(b * w)?,
            accepted: be.zeros(b)?,
            out_tokens: be.zeros(b * w)?,
            out_len: be.zeros(b)?,
            parents: be.zeros(b * k)?,
            path: be.zeros(b * w)?,
            counts_mirror: vec![0; b * v],
            slot_ids: vec![Vec::new(); b],
            counts_synced: true,
            staging: Staging::default(),
            graphs: Graphs::default(),
        })
    }

    /// The shape the workspace was sized for.
    pub fn shape(&self) -> &VerifyShape {
        &self.shape
    }

    /// Device bytes a workspace of `shape` allocates (all of it in [`Self::new`]): history
    /// counts and `p` (`B * vocab_rows` and `B * W * vocab_rows` elements), the greedy ids and
    /// output tokens (`B * W` each), proposals, retained q and ids (top-16 only), and the
    /// per-row metadata and outcome (seven settings, two seed words, frontier, live count,
    /// column start, accepted count, output length). Every element is 4 bytes.
    pub fn bytes(shape: &VerifyShape) -> u64 {
        let (b, w, v) = (
            shape.max_rows as u64,
            shape.cols as u64,
            shape.vocab_rows as u64,
        );
        let k = w - 1;
        let top = if shape.kind == ProposalKind::Top16 {
            2 * b * k * TOP as u64
        } else {
            0
        };
        // counts, p, greedy + out_tokens + path, proposals + parents, q + ids, and per row
        // the 7 settings, 2 seed words, live, col_start, start_pos, accepted, out_len.
        4 * (b * v + b * w * v + 3 * b * w + 2 * b * k + top + b * (7 + 2 + 1 + 1 + 1 + 1 + 1))
    }

    /// Device bytes this workspace holds now (always [`Self::bytes`] of its shape: nothing is
    /// allocated after [`Self::new`]).
    pub fn device_bytes(&self) -> u64 {
        fn bytes<T: Element>(b: &Buffer<T>) -> u64 {
            (b.len() * std::mem::size_of::<T>()) as u64
        }
        let s = &self.sampling;
        bytes(&self.live)
            + bytes(&self.col_start)
            + bytes(&self.counts)
            + bytes(&self.proposals)
            + bytes(&self.q)
            + bytes(&self.ids)
            + bytes(&s.temperature)
            + bytes(&s.top_k)
            + bytes(&s.top_p)
            + bytes(&s.min_p)
            + bytes(&s.repetition_penalty)
            + bytes(&s.frequency_penalty)
            + bytes(&s.presence_penalty)
            + bytes(&self.seeds)
            + bytes(&self.start_pos)
            + bytes(&self.p)
            + bytes(&self.greedy)
            + bytes(&self.accepted)
            + bytes(&self.out_tokens)
            + bytes(&self.out_len)
            + bytes(&self.parents)
            + bytes(&self.path)
    }

    /// The largest frontier a row may have (`F + W` stays below 2^31, the device position
    /// format).
    pub fn max_frontier(&self) -> u64 {
        i32::MAX as u64 - self.shape.cols as u64
    }

    /// Verify a batch of `rows.len() <= B` rows against the target's logits (F32 or BF16,
    /// padded `[rows.len(), W, vocab_rows]` or packed, on `be`, from `Target::verify`; dead
    /// columns are never read) and return each row's outcome, in row order.
    ///
    /// Validates everything first (see the crate docs); a refused call writes nothing. An
    /// empty batch returns an empty vector. The ops run on exactly `rows.len()` rows of the
    /// workspace's buffers; nothing is allocated.
    pub fn verify(
        &mut self,
        be: &Backend,
        rows: &[VerifyRow<'_>],
        logits: TargetLogits<'_>,
    ) -> Result<Vec<RoundOutcome>> {
        let metas: Vec<Meta<'_>> = rows.iter().map(Meta::of).collect();
        self.validate(be, &metas, &logits)?;
        for (r, row) in rows.iter().enumerate() {
            self.validate_proposals(r, row)?;
        }
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        self.stage(be, &metas, logits.layout)?;
        self.stage_proposals(be, rows)?;
        self.launch(be, rows.len(), logits.values)?;
        let pending = self.queue_outcomes(be, &metas, None)?;
        let props: Vec<&[u32]> = rows.iter().map(|r| r.proposals).collect();
        pending.finish(&props)
    }

    /// [`Self::verify`] of a device-resident round: the proposals (and DFlash2's candidates
    /// and q) stay in the draft's device buffers ([`DeviceProposals`]; copied on the device
    /// into the workspace), nothing is read before the ops run, and the outcome comes back
    /// with the proposals in one queued read ([`PendingOutcomes::wait`]), so the round's
    /// only synchronize can be that read (together with any other read queued before it).
    ///
    /// The host checks of [`Self::verify`] that need no proposal value run first (a refused
    /// call writes nothing); the proposals' ids are checked when read back
    /// ([`PendingOutcomes::wait`]: public, as the draft ops guarantee). The retained q are
    /// the selector op's output and are trusted (its contract: a distribution over 16
    /// distinct public ids holding the proposal).
    pub fn verify_device(
        &mut self,
        be: &Backend,
        rows: &[DeviceRow<'_>],
        proposals: &DeviceProposals<'_>,
        logits: TargetLogits<'_>,
    ) -> Result<PendingOutcomes> {
        let metas: Vec<Meta<'_>> = rows.iter().map(Meta::of_device).collect();
        self.validate(be, &metas, &logits)?;
        let VerifyShape { cols, kind, .. } = self.shape;
        let (n, k) = (rows.len(), cols - 1);
        let found = if proposals.top16.is_some() {
            ProposalKind::Top16
        } else {
            ProposalKind::OneHot
        };
        if found != kind {
            return Err(VerifyError::ProposalKind {
                row: 0,
                expected: kind.name(),
                found: found.name(),
            });
        }
        let short = |tensor: &'static str, len: usize, need: usize| {
            if len < need {
                Err(VerifyError::DeviceProposals {
                    tensor,
                    expected: need,
                    found: len,
                })
            } else {
                Ok(())
            }
        };
        short("ids", proposals.ids.len(), n * k)?;
        if let Some(t) = &proposals.top16 {
            short("candidates", t.candidates.len(), n * k * TOP)?;
            short("q", t.q.len(), n * k * TOP)?;
        }
        if rows.is_empty() {
            return self.queue_outcomes(be, &metas, Some(n * k));
        }
        self.stage(be, &metas, logits.layout)?;
        let key = GraphKey::of(n, &logits.values, proposals);
        match self.graphs.plan(key) {
            Run::Eager => self.device_work(be, n, proposals, logits.values)?,
            Run::Replay(i) => {
                self.graphs.recorded[i].1.launch()?;
                self.graphs.replays += 1;
            }
            Run::Capture => {
                // The device work only fails with an op's error (everything else was checked).
                let record = || {
                    self.device_work(be, n, proposals, logits.values)
                        .map_err(|e| match e {
                            VerifyError::Ops(o) => o,
                            other => dflash_ops::OpsError::Capture {
                                problem: other.to_string(),
                            },
                        })
                };
                match be.capture(record) {
                    Ok(graph) => {
                        graph.launch()?;
                        self.graphs.keep(key, graph);
                        self.graphs.replays += 1;
                    }
                    Err(e) => {
                        // Nothing was run: run it eagerly, and from now on every time.
                        self.graphs.refused = Some(e.to_string());
                        self.device_work(be, n, proposals, logits.values)?;
                    }
                }
            }
        }
        self.queue_outcomes(be, &metas, Some(n * k))
    }

    /// Replay device verifications from CUDA graphs (`on`, on a backend that can record:
    /// [`Backend::can_capture`]) or run them op by op (the default). A graph holds the
    /// copies of the draft's proposals and the two ops of [`Self::verify_device`]; the
    /// metadata is written before each replay. See [`Self::graph_state`].
    pub fn use_graphs(&mut self, be: &Backend, on: bool) {
        self.graphs.on = on && be.can_capture().is_ok();
    }

    /// Device verifications so far that replayed a graph, graphs recorded, and why
    /// recording stopped (a capture failed: every verification runs op by op since).
    pub fn graph_state(&self) -> (u64, u64, Option<&str>) {
        (
            self.graphs.replays,
            self.graphs.captures,
            self.graphs.refused.as_deref(),
        )
    }

    /// The device work of [`Self::verify_device`] after its metadata: the draft's proposals
    /// (and DFlash2's candidates and q) copied into the workspace, then the two ops.
    fn device_work(
        &mut self,
        be: &Backend,
        n: usize,
        proposals: &DeviceProposals<'_>,
        logits: Logits<'_>,
    ) -> Result<()> {
        let k = self.shape.cols - 1;
        be.copy(proposals.ids, 0, &mut self.proposals, 0, n * k)?;
        if let Some(t) = &proposals.top16 {
            be.copy(t.candidates, 0, &mut self.ids, 0, n * k * TOP)?;
            be.copy(t.q, 0, &mut self.q, 0, n * k * TOP)?;
        }
        self.launch(be, n, logits)
    }

    /// Each row's first logits column in `layout` with `w` columns a row (`r * w` padded; the
    /// `P + 1` live columns of the rows before it, packed).
    fn first_columns<'r>(
        w: usize,
        rows: &'r [Meta<'_>],
        layout: LogitsLayout,
    ) -> impl Iterator<Item = usize> + 'r {
        rows.iter().enumerate().scan(0usize, move |next, (r, row)| {
            let start = match layout {
                LogitsLayout::Padded => r * w,
                LogitsLayout::Packed => *next,
            };
            *next += row.np + 1;
            Some(start)
        })
    }

    /// The checks every row and the logits pass, whichever side holds the proposals.
    fn validate(&self, be: &Backend, rows: &[Meta<'_>], logits: &TargetLogits<'_>) -> Result<()> {
        let VerifyShape {
            max_rows,
            cols,
            vocab_rows,
            public_vocab,
            ..
        } = self.shape;
        let n = rows.len();
        if n > max_rows {
            return Err(VerifyError::BatchTooLarge { rows: n, max_rows });
        }
        // Whole units (padded rows or vocabulary columns), at least the batch's.
        let (unit, units) = match logits.layout {
            LogitsLayout::Padded => (cols * vocab_rows, n),
            LogitsLayout::Packed => (vocab_rows, rows.iter().map(|r| r.np + 1).sum()),
        };
        let found = logits.values.len();
        if !found.is_multiple_of(unit) || found / unit < units {
            return Err(VerifyError::LogitsLength {
                found,
                expected: units * unit,
                unit,
                layout: logits.layout,
                rows: n,
                cols,
                vocab_rows,
            });
        }
        for (r, row) in rows.iter().enumerate() {
            self.validate_meta(r, row)?;
        }
        if be.is_cpu() && n > 0 {
            let starts = Self::first_columns(cols, rows, logits.layout);
            for ((r, row), first) in rows.iter().enumerate().zip(starts) {
                for i in 0..=row.np {
                    let base = (first + i) * vocab_rows;
                    match logits.values {
                        Logits::F32(b) => {
                            let host = b.host("dflash-verify", "logits")?;
                            check_logits(r, i, &host[base..base + public_vocab], |x| x)?;
                        }
                        Logits::Bf16(b) => {
                            let host = b.host("dflash-verify", "logits")?;
                            check_logits(r, i, &host[base..base + public_vocab], |x| x.to_f32())?;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Row `r`'s token `t` in `role`: below the vocabulary rows and public.
    fn check_token(&self, r: usize, role: TokenRole, t: u32) -> Result<()> {
        let VerifyShape {
            vocab_rows,
            public_vocab,
            ..
        } = self.shape;
        if t as usize >= vocab_rows {
            Err(VerifyError::TokenOutOfRange {
                row: r,
                role,
                token: t,
                vocab_rows,
            })
        } else if t as usize >= public_vocab {
            Err(VerifyError::NonPublicToken {
                row: r,
                role,
                token: t,
                public_vocab,
            })
        } else {
            Ok(())
        }
    }

    /// The host proposals of row `r`: the distribution's kind, every token, every q.
    fn validate_proposals(&self, r: usize, row: &VerifyRow<'_>) -> Result<()> {
        let kind = self.shape.kind;
        let np = row.proposals.len();
        if row.dist.kind() != kind {
            return Err(VerifyError::ProposalKind {
                row: r,
                expected: kind.name(),
                found: row.dist.kind().name(),
            });
        }
        for (j, &d) in row.proposals.iter().enumerate() {
            self.check_token(r, TokenRole::Proposal(j + 1), d)?;
        }
        if let ProposalDist::Top16(qs) = row.dist {
            if qs.len() != np {
                return Err(VerifyError::QColumns {
                    row: r,
                    proposals: np,
                    found: qs.len(),
                });
            }
            for (i, rq) in qs.iter().enumerate() {
                for (s, &id) in rq.ids.iter().enumerate() {
                    self.check_token(r, TokenRole::Candidate { column: i, slot: s }, id)?;
                }
                validate_q(rq, row.proposals[i]).map_err(|fault| {
                    VerifyError::QNotDistribution {
                        row: r,
                        column: i,
                        fault,
                    }
                })?;
            }
        }
        Ok(())
    }

    /// Row `r`'s proposal count, anchor, history, frontier and settings.
    fn validate_meta(&self, r: usize, row: &Meta<'_>) -> Result<()> {
        let VerifyShape {
            cols, vocab_rows, ..
        } = self.shape;
        let np = row.np;
        if np + 1 > cols {
            return Err(VerifyError::TooManyProposals {
                row: r,
                proposals: np,
                max: cols - 1,
            });
        }
        self.check_token(r, TokenRole::Anchor, row.anchor)?;
        let h = row.history;
        if h.vocab_rows() != vocab_rows {
            return Err(VerifyError::HistoryVocab {
                row: r,
                expected: vocab_rows,
                found: h.vocab_rows(),
            });
        }
        if row.frontier > self.max_frontier() {
            return Err(VerifyError::FrontierTooLarge {
                row: r,
                frontier: row.frontier,
                max: self.max_frontier(),
            });
        }
        if h.len() != row.frontier + 1 {
            return Err(VerifyError::HistoryLength {
                row: r,
                len: h.len(),
                expected: row.frontier + 1,
            });
        }
        if h.last() != Some(row.anchor) {
            return Err(VerifyError::AnchorMismatch {
                row: r,
                anchor: row.anchor,
                last: h.last(),
            });
        }
        validate_settings(r, &row.settings)
    }

    /// Write the round's metadata of the `rows.len()` rows (all validated) into the first rows
    /// of the device buffers.
    fn stage(&mut self, be: &Backend, rows: &[Meta<'_>], layout: LogitsLayout) -> Result<()> {
        let w = self.shape.cols;
        let s = &mut self.staging;
        s.live.clear();
        s.col_start.clear();
        s.proposals.clear();
        s.q.clear();
        s.ids.clear();
        s.temperature.clear();
        s.top_k.clear();
        s.top_p.clear();
        s.min_p.clear();
        s.rep.clear();
        s.freq.clear();
        s.pres.clear();
        s.seeds.clear();
        s.start_pos.clear();
        for (row, first) in rows.iter().zip(Self::first_columns(w, rows, layout)) {
            s.live.push(row.np as i32 + 1);
            // At most B * W < 2^31 (checked in `new`).
            s.col_start.push(first as i32);
            let st = row.settings;
            s.temperature.push(st.temperature);
            s.top_k.push(st.top_k);
            s.top_p.push(st.top_p);
            s.min_p.push(st.min_p);
            s.rep.push(st.repetition_penalty);
            s.freq.push(st.frequency_penalty);
            s.pres.push(st.presence_penalty);
            s.seeds.push(row.seed as u32 as i32);
            s.seeds.push((row.seed >> 32) as u32 as i32);
            // Validated: frontier <= max_frontier < 2^31.
            s.start_pos.push(row.frontier as i32);
        }
        be.write(&mut self.live, 0, &s.live)?;
        be.write(&mut self.col_start, 0, &s.col_start)?;
        let sb = &mut self.sampling;
        be.write(&mut sb.temperature, 0, &s.temperature)?;
        be.write(&mut sb.top_k, 0, &s.top_k)?;
        be.write(&mut sb.top_p, 0, &s.top_p)?;
        be.write(&mut sb.min_p, 0, &s.min_p)?;
        be.write(&mut sb.repetition_penalty, 0, &s.rep)?;
        be.write(&mut sb.frequency_penalty, 0, &s.freq)?;
        be.write(&mut sb.presence_penalty, 0, &s.pres)?;
        be.write(&mut self.seeds, 0, &s.seeds)?;
        be.write(&mut self.start_pos, 0, &s.start_pos)?;
        self.sync_counts(be, rows)
    }

    /// Write the host rows' proposals (and DFlash2's q and ids), zero past each row's `P`.
    fn stage_proposals(&mut self, be: &Backend, rows: &[VerifyRow<'_>]) -> Result<()> {
        let k = self.shape.cols - 1;
        let s = &mut self.staging;
        s.proposals.clear();
        s.q.clear();
        s.ids.clear();
        for row in rows {
            for j in 0..k {
                s.proposals
                    .push(row.proposals.get(j).map_or(0, |&d| d as i32));
            }
            if let ProposalDist::Top16(qs) = row.dist {
                for j in 0..k {
                    match qs.get(j) {
                        Some(rq) => {
                            s.q.extend_from_slice(&rq.q);
                            s.ids.extend(rq.ids.iter().map(|&id| id as i32));
                        }
                        None => {
                            s.q.extend_from_slice(&[0.0; TOP]);
                            s.ids.extend_from_slice(&[0; TOP]);
                        }
                    }
                }
            }
        }
        be.write(&mut self.proposals, 0, &s.proposals)?;
        if self.shape.kind == ProposalKind::Top16 {
            be.write(&mut self.q, 0, &s.q)?;
            be.write(&mut self.ids, 0, &s.ids)?;
        }
        Ok(())
    }

    /// Bring slot `r`'s device counts to `rows[r].history` for every row, rewriting only the
    /// id range that changed.
    fn sync_counts(&mut self, be: &Backend, rows: &[Meta<'_>]) -> Result<()> {
        let v = self.shape.vocab_rows;
        if !self.counts_synced {
            self.counts_mirror.fill(0);
            self.slot_ids.iter_mut().for_each(Vec::clear);
            be.fill(&mut self.counts, 0)?;
            self.counts_synced = true;
        }
        self.counts_synced = false;
        for (r, row) in rows.iter().enumerate() {
            let mirror = &mut self.counts_mirror[r * v..(r + 1) * v];
            let ids = &mut self.slot_ids[r];
            let (mut lo, mut hi) = (usize::MAX, 0usize);
            let mut touch = |id: usize| {
                lo = lo.min(id);
                hi = hi.max(id);
            };
            for &id in ids.iter() {
                if row.history.count(id) == 0 {
                    mirror[id as usize] = 0;
                    touch(id as usize);
                }
            }
            ids.clear();
            for (id, c) in row.history.iter() {
                // Counts are at most MAX_COUNT = i32::MAX (TokenHistory).
                let c = c as i32;
                if mirror[id as usize] != c {
                    mirror[id as usize] = c;
                    touch(id as usize);
                }
                ids.push(id);
            }
            if lo <= hi {
                be.write(&mut self.counts, r * v + lo, &mirror[lo..=hi])?;
            }
        }
        self.counts_synced = true;
        Ok(())
    }

    /// Run `target_distribution` over the first `n` rows into the `Live` outputs (`p` of the
    /// sampled columns, `greedy`), the history of a column being the chain prefix of
    /// `proposals` or (`tree`) the root path of `proposals` and `parents`.
    fn distributions(
        &mut self,
        be: &Backend,
        n: usize,
        logits: Logits<'_>,
        tree: bool,
    ) -> Result<()> {
        let VerifyShape {
            cols,
            vocab_rows,
            public_vocab,
            ..
        } = self.shape;
        let history = if tree {
            target_distribution::History::Tree {
                tokens: &self.proposals,
                parents: &self.parents,
            }
        } else {
            target_distribution::History::Chain(&self.proposals)
        };
        target_distribution::run_with(
            be,
            logits,
            target_distribution::Columns::Starts(&self.col_start),
            &self.live,
            &self.counts,
            history,
            &self.sampling.view(),
            target_distribution::Outputs::Live {
                p: &mut self.p,
                greedy: &mut self.greedy,
            },
            &target_distribution::Params {
                rows: n,
                cols,
                vocab: vocab_rows,
                public_vocab,
            },
        )?;
        Ok(())
    }

    /// Run `target_distribution` and `chain_accept` over the first `n` rows.
    fn launch(&mut self, be: &Backend, n: usize, logits: Logits<'_>) -> Result<()> {
        let VerifyShape {
            cols,
            vocab_rows,
            kind,
            ..
        } = self.shape;
        self.distributions(be, n, logits, false)?;
        let proposal = match kind {
            ProposalKind::OneHot => chain_accept::Proposal::OneHot,
            ProposalKind::Top16 => chain_accept::Proposal::Top16 {
                q: &self.q,
                ids: &self.ids,
            },
        };
        chain_accept::run_with(
            be,
            chain_accept::Distributions::Live {
                p: &self.p,
                greedy: &self.greedy,
            },
            &self.proposals,
            &self.live,
            proposal,
            &self.seeds,
            &self.start_pos,
            chain_accept::Outputs {
                accepted: &mut self.accepted,
                out_tokens: &mut self.out_tokens,
                out_len: &mut self.out_len,
            },
            &chain_accept::Params {
                rows: n,
                cols,
                vocab: vocab_rows,
            },
        )?;
        Ok(())
    }

    /// Queue the reads of the first `rows.len()` outcomes (and, for a device round, of the
    /// first `proposals` proposal ids): one synchronize for all of them.
    fn queue_outcomes(
        &self,
        be: &Backend,
        rows: &[Meta<'_>],
        proposals: Option<usize>,
    ) -> Result<PendingOutcomes> {
        let n = rows.len();
        let w = self.shape.cols;
        Ok(PendingOutcomes {
            accepted: be.read_async(&self.accepted, 0, n)?,
            out_len: be.read_async(&self.out_len, 0, n)?,
            tokens: be.read_async(&self.out_tokens, 0, n * w)?,
            proposals: match proposals {
                Some(len) => Some(be.read_async(&self.proposals, 0, len)?),
                None => None,
            },
            np: rows.iter().map(|r| r.np).collect(),
            cols: w,
            vocab_rows: self.shape.vocab_rows,
            public_vocab: self.shape.public_vocab,
        })
    }
}

/// The outcomes of a verification, queued ([`VerifyWorkspace::verify_device`]): their reads
/// complete with the next synchronize of the backend, which [`PendingOutcomes::wait`] makes
/// if none happened since (reads queued together with them share it).
#[derive(Debug)]
pub struct PendingOutcomes {
    accepted: PendingRead<i32>,
    out_len: PendingRead<i32>,
    tokens: PendingRead<i32>,
    proposals: Option<PendingRead<i32>>,
    np: Vec<usize>,
    cols: usize,
    vocab_rows: usize,
    public_vocab: usize,
}

impl PendingOutcomes {
    /// Each row's outcome and its `P` verified proposals `d_1 .. d_P`, in row order.
    ///
    /// Errors: [`VerifyError::TokenOutOfRange`] / [`VerifyError::NonPublicToken`] for a
    /// proposal the device held, [`VerifyError::DeviceOutcome`] for an inconsistent outcome.
    pub fn wait(self) -> Result<(Vec<RoundOutcome>, Vec<Vec<u32>>)> {
        let k = self.cols - 1;
        let raw = match self.proposals {
            Some(pending) => pending.wait()?,
            // Outcomes of a host round: its proposals are the caller's, not read back.
            None => Vec::new(),
        };
        if raw.len() < self.np.len() * k {
            return Err(VerifyError::DeviceProposals {
                tensor: "ids",
                expected: self.np.len() * k,
                found: raw.len(),
            });
        }
        let mut props = Vec::with_capacity(self.np.len());
        for (r, &np) in self.np.iter().enumerate() {
            let mut row = Vec::with_capacity(np);
            for (j, &d) in raw[r * k..r * k + np].iter().enumerate() {
                let role = TokenRole::Proposal(j + 1);
                let t = u32::try_from(d).unwrap_or(u32::MAX);
                if t as usize >= self.vocab_rows {
                    return Err(VerifyError::TokenOutOfRange {
                        row: r,
                        role,
                        token: t,
                        vocab_rows: self.vocab_rows,
                    });
                }
                if t as usize >= self.public_vocab {
                    return Err(VerifyError::NonPublicToken {
                        row: r,
                        role,
                        token: t,
                        public_vocab: self.public_vocab,
                    });
                }
                row.push(t);
            }
            props.push(row);
        }
        let rest = PendingOutcomes {
            proposals: None,
            ..self
        };

        let refs: Vec<&[u32]> = props.iter().map(Vec::as_slice).collect();
        let outcomes = rest.finish(&refs)?;
        Ok((outcomes, props))
    }

    /// The outcomes against the rows' verified proposals.
    fn finish(self, proposals: &[&[u32]]) -> Result<Vec<RoundOutcome>> {
        let w = self.cols;
        let public = self.public_vocab;
        let (accepted, out_len, tokens) = (
            self.accepted.wait()?,
            self.out_len.wait()?,
            self.tokens.wait()?,
        );
        let mut out = Vec::with_capacity(proposals.len());
        for (r, props) in proposals.iter().enumerate() {
            let np = props.len();
            let bad = |reason: String| VerifyError::DeviceOutcome { row: r, reason };
            let a = usize::try_from(accepted[r])
                .ok()
                .filter(|&a| a <= np)
                .ok_or_else(|| bad(format!("accepted = {} with P = {np}", accepted[r])))?;
            if out_len[r] != a as i32 + 1 {
                return Err(bad(format!("out_len = {} with A = {a}", out_len[r])));
            }
            let ys = &tokens[r * w..r * w + a + 1];
            for (j, (&y, &d)) in ys.iter().zip(*props).take(a).enumerate() {
                if y != d as i32 {
                    return Err(bad(format!(
                        "output {} = {y}, proposal d_{} = {d}",
                        j + 1,
                        j + 1
                    )));
                }
            }
            let last = ys[a];
            if !(last >= 0 && (last as usize) < public) {
                return Err(bad(format!(
                    "correction/bonus {last} is not a public token (< {public})"
                )));
            }
            out.push(RoundOutcome {
                accepted: a,
                proposals: np,
                outputs: ys.iter().map(|&y| y as u32).collect(),
            });
        }
        Ok(out)
    }
}

/// What the checks and the staging read of a row, whichever side holds its proposals.
struct Meta<'a> {
    anchor: u32,
    /// `P`.
    np: usize,
    settings: SamplingSettings,
    seed: u64,
    frontier: u64,
    history: &'a TokenHistory,
}

impl<'a> Meta<'a> {
    fn of(r: &VerifyRow<'a>) -> Self {
        Meta {
            anchor: r.anchor,
            np: r.proposals.len(),
            settings: r.settings,
            seed: r.seed,
            frontier: r.frontier,
            history: r.history,
        }
    }

    fn of_device(r: &DeviceRow<'a>) -> Self {
        Meta {
            anchor: r.anchor,
            np: r.proposals,
            settings: r.settings,
            seed: r.seed,
            frontier: r.frontier,
            history: r.history,
        }
    }
}

/// One row of a device-resident verification ([`VerifyWorkspace::verify_device`]): a
/// [`VerifyRow`] whose proposals (and q) stay on the device.
#[derive(Clone, Copy, Debug)]
pub struct DeviceRow<'a> {
    /// The anchor `a = x_F` (the last token of `history`).
    pub anchor: u32,
    /// `P <= K`: the first `P` of the row's `K` device proposals are verified.
    pub proposals: usize,
    /// The request's sampling settings.
    pub settings: SamplingSettings,
    /// The request seed.
    pub seed: u64,
    /// The frontier `F`.
    pub frontier: u64,
    /// Tokens `x_0 ..= x_F`.
    pub history: &'a TokenHistory,
}

/// A round's proposals on the device, as the draft left them: row `r` of the batch is row
/// `r` of these buffers (rows past the batch are ignored).
#[derive(Clone, Copy, Debug)]
pub struct DeviceProposals<'a> {
    /// Proposals `[rows, K]` I32: row `r`'s `d_1 .. d_K` at `r * K`.
    pub ids: &'a Buffer<i32>,
    /// DFlash2: the retained distributions (`None` for DFlash's one-hot q).
    pub top16: Option<DeviceTop16<'a>>,
}

/// DFlash2's retained q on the device: column `j` of row `r` at `(r * K + j) * 16`.
#[derive(Clone, Copy, Debug)]
pub struct DeviceTop16<'a> {
    /// Global candidate ids `[rows, K, 16]` I32.
    pub candidates: &'a Buffer<i32>,
    /// Their probabilities `[rows, K, 16]` F32.
    pub q: &'a Buffer<f32>,
}

/// The logits checks of the `target_distribution` contract for live column `i` of row `r`
/// (its public logits, widened to f32), as typed errors.
fn check_logits<T: Copy>(r: usize, i: usize, col: &[T], f32_of: impl Fn(T) -> f32) -> Result<()> {
    if let Some(v) = col
        .iter()
        .position(|&x| f32_of(x).is_nan() || f32_of(x) == f32::INFINITY)
    {
        return Err(VerifyError::BadLogit {
            row: r,
            column: i,
            token: v,
            value: f32_of(col[v]),
        });
    }
    if !col.iter().any(|&x| f32_of(x).is_finite()) {
        return Err(VerifyError::BadLogit {
            row: r,
            column: i,
            token: 0,
            value: col.first().map_or(f32::NAN, |&x| f32_of(x)),
        });
    }
    Ok(())
}

/// The settings checks of the `target_distribution` contract, as typed errors.
fn validate_settings(r: usize, s: &SamplingSettings) -> Result<()> {
    let bad = |setting: &'static str, value: f64, expected: &'static str| {
        Err(VerifyError::BadSetting {
            row: r,
            setting,
            value,
            expected,
        })
    };
    let t = s.temperature;
    if !(t.is_finite() && t >= 0.0) {
        return bad("temperature", t.into(), "finite and >= 0 (0 = greedy)");
    }
    if s.top_k < 0 {
        return bad("top_k", s.top_k.into(), ">= 0 (0 = off)");
    }
    if !(s.top_p > 0.0 && s.top_p <= 1.0) {
        return bad("top_p", s.top_p.into(), "in (0, 1] (1 = off)");
    }
    if !(0.0..1.0).contains(&s.min_p) {
        return bad("min_p", s.min_p.into(), "in [0, 1) (0 = off)");
    }
    let rep = s.repetition_penalty;
    if !(rep.is_finite() && rep > 0.0) {
        return bad("repetition_penalty", rep.into(), "finite and > 0 (1 = off)");
    }
    if !s.frequency_penalty.is_finite() {
        return bad(
            "frequency_penalty",
            s.frequency_penalty.into(),
            "finite (0 = off)",
        );
    }
    if !s.presence_penalty.is_finite() {
        return bad(
            "presence_penalty",
            s.presence_penalty.into(),
            "finite (0 = off)",
        );
    }
    Ok(())
}

/// The retained-q checks: a distribution ([`validate_q_distribution`]) holding the proposal
/// among its ids with `q > 0`.
fn validate_q(rq: &RetainedQ, proposal: u32) -> std::result::Result<(), QFault> {
    validate_q_distribution(rq)?;
    match rq.ids.iter().position(|&id| id == proposal) {
        None => Err(QFault::ProposalNotCandidate { token: proposal }),
        Some(slot) if rq.q[slot] == 0.0 => Err(QFault::ProposalZeroMass {
            token: proposal,
            slot,
        }),
        Some(_) => Ok(()),
    }
}

/// A retained q as a distribution: finite, non-negative, summing to 1, distinct ids.
fn validate_q_distribution(rq: &RetainedQ) -> std::result::Result<(), QFault> {
    for (s, &x) in rq.q.iter().enumerate() {
        if !x.is_finite() {
            return Err(QFault::NonFinite { slot: s, value: x });
        }
        if x < 0.0 {
            return Err(QFault::Negative { slot: s, value: x });
        }
    }
    for s in 0..TOP {
        if let Some(first) = rq.ids[..s].iter().position(|&id| id == rq.ids[s]) {
            return Err(QFault::DuplicateId {
                token: rq.ids[s],
                first,
                second: s,
            });
        }
    }
    let sum: f64 = rq.q.iter().map(|&x| f64::from(x)).sum();
    if (sum - 1.0).abs() > Q_SUM_TOLERANCE {
        return Err(QFault::Sum { sum });
    }
    Ok(())
}

#[cfg(test)]
mod graph_tests {
    use super::*;

    fn key(rows: usize, addr: u64) -> GraphKey {
        GraphKey {
            rows,
            logits: (addr, 4096, false),
            ids: (7, 16),
            top16: None,
        }
    }

    #[test]
    fn a_verification_key_is_recorded_the_second_time_it_is_seen() {
        let mut g = Graphs::default();
        // Off (the default, the CPU, eager mode): always eager, nothing remembered.
        assert!(matches!(g.plan(key(1, 10)), Run::Eager));
        assert!(matches!(g.plan(key(1, 10)), Run::Eager));
        assert!(g.seen.is_empty());
        g.on = true;
        assert!(matches!(g.plan(key(1, 10)), Run::Eager));
        assert!(
            matches!(g.plan(key(2, 10)), Run::Eager),
            "rows are part of the key"
        );
        assert!(
            matches!(g.plan(key(1, 11)), Run::Eager),
            "so is the logits address"
        );
        assert!(matches!(g.plan(key(1, 10)), Run::Capture));
        // A capture that did not keep a graph starts over (seen once more).
        assert!(matches!(g.plan(key(1, 10)), Run::Eager));
        assert!(matches!(g.plan(key(1, 10)), Run::Capture));
        // A refused capture turns recording off for good.
        g.refused = Some("driver said no".into());
        assert!(matches!(g.plan(key(2, 10)), Run::Eager));
        assert!(matches!(g.plan(key(2, 10)), Run::Eager));
    }

    #[test]
    fn a_target_whose_logits_never_repeat_an_address_never_records() {
        let mut g = Graphs {
            on: true,
            ..Graphs::default()
        };
        for addr in 0..4 * GRAPH_KEYS as u64 {
            assert!(matches!(g.plan(key(1, addr)), Run::Eager));
        }
        assert_eq!(g.seen.len(), GRAPH_KEYS, "once-seen keys are bounded");
        // The oldest once-seen keys were dropped: seeing one again starts over.
        assert!(matches!(g.plan(key(1, 0)), Run::Eager));
        let last = 4 * GRAPH_KEYS as u64 - 1;
        assert!(matches!(g.plan(key(1, last)), Run::Capture));
    }
}
