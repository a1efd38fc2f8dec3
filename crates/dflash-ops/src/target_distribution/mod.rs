//! Target distribution: process the target's verify logits into the processed target
//! distribution `p_i` of every live verify column (public-vocabulary mask, penalties with the
//! column's own history, temperature, top-k, top-p, min-p).
//!
//! Semantics. Row `r` is one request with `Q = live[r]` live columns (`1 <= Q <= cols`); the
//! target output of verify column `i` predicts position `F+1+i`. Let `d_j = proposals[r, j-1]`
//! (`j = 1..cols-1`). For every live column `i < Q`, in this one order:
//!
//! 1. History. `c(v) = counts[r, v] + #{ j in 1..=i : d_j == v }` (the request's token counts up
//!    to and including the anchor, plus the proposals accepted before column `i`), computed in
//!    64-bit integers.
//! 2. Public mask. Only `v < public_vocab` takes part; every `v >= public_vocab` gets
//!    `p = 0` exactly and is never chosen.
//! 3. Penalties (f32, each operation rounded RNE, no fused multiply-add), only where `c > 0`:
//!    `l = logit > 0 ? logit / rep : logit * rep`, then
//!    `l = l - (freq * f32(c) + pres)` (`f32(c)` is the RNE conversion of the integer count).
//!    Where `c == 0` the logit is unchanged.
//! 4. Greedy. If `temperature <= 0`: `p = one_hot(argmax_v l)`, ties to the lowest id; no
//!    filter applies (none could remove the argmax). Greedy verification then falls out of the
//!    ordinary acceptance rule of `chain_accept`.
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
//! The argmax always survives every filter, so `S >= 1`. Columns `i >= Q` ("dead") are
//! written with exact zeros.
//!
//! Shapes. logits, p: `[rows, cols, vocab]` f32; live: `[rows]` i32; counts: `[rows, vocab]`
//!   i32; proposals: `[rows, cols-1]` i32; every setting: `[rows]` ([`Sampling`]).
//! Dtypes. Logits, settings and `p` f32; counts, ids, `top_k`, `live` i32.
//! Rounding points. The penalized logit and `z` are f32 values (RNE, as written above); `e`,
//!   masses and `S` are f64; `p` is rounded once to f32.
//! Accumulation. `S`: f64 in any order (implementation choice); `M`: exact u64.
//! Tie-breaking. Greedy argmax: lowest id. Top-k / top-p: every token tied with the boundary
//!   value is kept (a value threshold, not an id-ordered prefix).
//! Masking / live extents. Non-public rows: `p = 0`. Dead columns: all zeros. Only proposals
//!   `d_1 .. d_(Q-1)` are read.
//! Caller guarantees (checked on the CPU, trusted on CUDA, where out-of-range proposals are
//!   ignored and `live` is clamped to `0..=cols`): `1 <= live <= cols`; proposals of live
//!   columns `< vocab`; `counts >= 0`; settings valid ([`Sampling`]); public logits of live
//!   columns are not NaN or `+inf` (`-inf` is allowed and gives `p = 0`); the processed logits
//!   of a live column have a finite maximum (no `+inf` overflow from a tiny temperature or a
//!   huge penalty, not all `-inf`).
//! Writes. All of `p` (live columns: the distribution; dead columns: zeros). Inputs are never
//!   written.
//! Comparison. `p`: close (abs 1e-7, rel 1e-5): both backends compute `e`, `m`, `S` in f64 /
//!   exact integers from identical f32 `z`, so only the f64 `exp` (1 ulp) and the summation
//!   order of `S` differ; kept sets, greedy one-hot columns and zeros are exact in practice
//!   (fixtures keep decision margins far above 2^-40).
//!
//! CUDA. One block of 512 threads per (row, column). Pass 1 writes `z` into `p` (scratch) and
//! reduces the argmax; top-k and top-p thresholds are found by a 4-pass radix select (8 bits
//! per pass) on the order-preserving u32 key of `z` (counts for top-k, u64 masses with
//! integer shared-memory atomics for top-p, so the result is exact and deterministic); then one
//! f64 sum pass and one write pass. A thread only ever reads back the `p` elements it wrote
//! itself.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod reference;
#[cfg(test)]
mod tests;

use crate::registry::{Case, CaseRun, Criterion, InputCheck, output};
use crate::{Backend, Buffer, Element, Result, check_len, check_param};

/// Registry id.
pub const OP: &str = "target_distribution";

/// Most columns a call may have (the per-column history lives in shared memory on CUDA).
pub const MAX_COLS: usize = 256;

/// Largest vocabulary a call may have (2^30, so that strided i32 loops cannot overflow).
pub const MAX_VOCAB: usize = 1 << 30;

/// Static shape of a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Params {
    /// Requests in the batch.
    pub rows: usize,
    /// Verify columns per request (W = K + 1), `1..=MAX_COLS`.
    pub cols: usize,
    /// Vocabulary rows of the logits (e.g. 248320), `1..=MAX_VOCAB`.
    pub vocab: usize,
    /// Public vocabulary (e.g. 248077): rows `>= public_vocab` are never chosen.
    pub public_vocab: usize,
}

/// Per-request sampling settings, one element per row, as device buffers (so that a captured
/// CUDA graph replays with new settings).
#[derive(Clone, Copy, Debug)]
pub struct Sampling<'a> {
    /// Temperature, finite, `>= 0`; `<= 0` means greedy (exact one-hot `p`).
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

/// Compute the processed target distribution `p` of every live verify column (see the module
/// contract). Validates every shape and parameter (and, on the CPU, every value the contract
/// constrains) before writing; a refused call leaves `p` untouched.
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
    let total = rows
        .checked_mul(cols)
        .and_then(|n| n.checked_mul(vocab))
        .ok_or_else(|| crate::OpsError::Param {
            op: OP,
            param: "rows",
            expected: "rows * cols * vocab within usize".into(),
            found: rows.to_string(),
        })?;
    let shape = || format!("[rows={rows}, cols={cols}, vocab={vocab}]");
    check_len(OP, "logits", logits.len(), total, shape)?;
    check_len(OP, "p", p.len(), total, shape)?;
    check_len(OP, "live", live.len(), rows, || format!("[rows={rows}]"))?;
    check_len(OP, "counts", counts.len(), rows * vocab, || {
        format!("[rows={rows}, vocab={vocab}]")
    })?;
    check_len(OP, "proposals", proposals.len(), rows * (cols - 1), || {
        format!("[rows={rows}, cols-1={}]", cols - 1)
    })?;
    let per_row = || format!("[rows={rows}]");
    check_len(OP, "temperature", sampling.temperature.len(), rows, per_row)?;
    check_len(OP, "top_k", sampling.top_k.len(), rows, per_row)?;
    check_len(OP, "top_p", sampling.top_p.len(), rows, per_row)?;
    check_len(OP, "min_p", sampling.min_p.len(), rows, per_row)?;
    check_len(
        OP,
        "repetition_penalty",
        sampling.repetition_penalty.len(),
        rows,
        per_row,
    )?;
    check_len(
        OP,
        "frequency_penalty",
        sampling.frequency_penalty.len(),
        rows,
        per_row,
    )?;
    check_len(
        OP,
        "presence_penalty",
        sampling.presence_penalty.len(),
        rows,
        per_row,
    )?;
    if total == 0 {
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
            reference::run(
                logits.host(OP, "logits")?,
                live.host(OP, "live")?,
                counts.host(OP, "counts")?,
                proposals.host(OP, "proposals")?,
                &settings,
                p.host_mut(OP, "p")?,
                params,
            )
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(c) => cuda::run(c, logits, live, counts, proposals, sampling, p, params),
    }
}

// ---------------------------------------------------------------------------------------------
// Conformance cases.

/// A small deterministic hash generator for case inputs.
pub(crate) struct Gen(u64);

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
pub(crate) struct CaseData {
    pub(crate) logits: Vec<f32>,
    pub(crate) live: Vec<i32>,
    pub(crate) counts: Vec<i32>,
    pub(crate) proposals: Vec<i32>,
    pub(crate) settings: Vec<Settings>,
}

/// Logits on a 1/64 grid (distinct-ish values with margins), a few strong tokens per column,
/// sparse counts and proposals drawn from the strong tokens (so penalties hit them).
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
        settings: (0..rows).map(|r| settings[r % settings.len()]).collect(),
    }
}

/// The settings mix of the cases: greedy, plain sampling, every filter, penalties.
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

fn case(
    rows: usize,
    cols: usize,
    vocab: usize,
    public_vocab: usize,
    seed: u64,
    settings: Vec<Settings>,
) -> impl Fn(&Backend) -> Result<CaseRun> + Send + Sync {
    move |be: &Backend| {
        let d = case_data(rows, cols, vocab, public_vocab, seed, &settings);
        let mut inputs = InputCheck::default();
        let logits = inputs.upload(be, "logits", &d.logits)?;
        let live = inputs.upload(be, "live", &d.live)?;
        let counts = inputs.upload(be, "counts", &d.counts)?;
        let proposals = inputs.upload(be, "proposals", &d.proposals)?;
        let s = &d.settings;
        let temperature = inputs.upload(
            be,
            "temperature",
            &s.iter().map(|x| x.temperature).collect::<Vec<_>>(),
        )?;
        let top_k = inputs.upload(be, "top_k", &s.iter().map(|x| x.top_k).collect::<Vec<_>>())?;
        let top_p = inputs.upload(be, "top_p", &s.iter().map(|x| x.top_p).collect::<Vec<_>>())?;
        let min_p = inputs.upload(be, "min_p", &s.iter().map(|x| x.min_p).collect::<Vec<_>>())?;
        let rep = inputs.upload(
            be,
            "repetition_penalty",
            &s.iter().map(|x| x.repetition_penalty).collect::<Vec<_>>(),
        )?;
        let freq = inputs.upload(
            be,
            "frequency_penalty",
            &s.iter().map(|x| x.frequency_penalty).collect::<Vec<_>>(),
        )?;
        let pres = inputs.upload(
            be,
            "presence_penalty",
            &s.iter().map(|x| x.presence_penalty).collect::<Vec<_>>(),
        )?;
        let n = rows * cols * vocab;
        let mut p = be.filled(n, f32::POISON)?;
        let sampling = Sampling {
            temperature: &temperature,
            top_k: &top_k,
            top_p: &top_p,
            min_p: &min_p,
            repetition_penalty: &rep,
            frequency_penalty: &freq,
            presence_penalty: &pres,
        };
        let params = Params {
            rows,
            cols,
            vocab,
            public_vocab,
        };
        run(
            be, &logits, &live, &counts, &proposals, &sampling, &mut p, &params,
        )?;
        let mut modified = Vec::new();
        inputs.verify(be, "logits", &logits, &mut modified)?;
        inputs.verify(be, "live", &live, &mut modified)?;
        inputs.verify(be, "counts", &counts, &mut modified)?;
        inputs.verify(be, "proposals", &proposals, &mut modified)?;
        inputs.verify(be, "temperature", &temperature, &mut modified)?;
        inputs.verify(be, "top_k", &top_k, &mut modified)?;
        inputs.verify(be, "top_p", &top_p, &mut modified)?;
        inputs.verify(be, "min_p", &min_p, &mut modified)?;
        inputs.verify(be, "repetition_penalty", &rep, &mut modified)?;
        inputs.verify(be, "frequency_penalty", &freq, &mut modified)?;
        inputs.verify(be, "presence_penalty", &pres, &mut modified)?;
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

/// Official vocabulary rows and public rows (Qwen3.5).
pub(crate) const OFFICIAL_VOCAB: usize = 248_320;
/// Official public vocabulary.
pub(crate) const OFFICIAL_PUBLIC: usize = 248_077;

/// Conformance cases.
pub(crate) fn cases() -> Vec<Case> {
    vec![
        Case::new(
            OP,
            "rows8_cols16_v4096_mixed_settings",
            case(8, 16, 4096, 4000, 11, settings_mix()),
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
            ),
        ),
        Case::new(
            OP,
            "rows8_cols16_official_vocab_mixed_settings",
            case(8, 16, OFFICIAL_VOCAB, OFFICIAL_PUBLIC, 14, settings_mix()),
        )
        .heavy(),
    ]
}
