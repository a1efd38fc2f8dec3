//! CPU reference of `target_distribution`: the contract, one column at a time, written to be
//! checked line by line against the module doc.

#![allow(clippy::needless_range_loop)] // reason: index loops mirror the contract's formulas

use std::borrow::Cow;

use crate::{OpsError, Result, bf16};

use super::{OP, Params, SAMPLED};

/// Host views of the per-row settings.
pub(super) struct HostSampling<'a> {
    pub(super) temperature: &'a [f32],
    pub(super) top_k: &'a [i32],
    pub(super) top_p: &'a [f32],
    pub(super) min_p: &'a [f32],
    pub(super) repetition_penalty: &'a [f32],
    pub(super) frequency_penalty: &'a [f32],
    pub(super) presence_penalty: &'a [f32],
}

/// One row's settings.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RowSettings {
    pub(crate) temperature: f32,
    pub(crate) top_k: i32,
    pub(crate) top_p: f32,
    pub(crate) min_p: f32,
    pub(crate) rep: f32,
    pub(crate) freq: f32,
    pub(crate) pres: f32,
}

/// Fixed-point scale of the top-p masses: `m(v) = floor(e(v) * 2^40)`.
pub(crate) const MASS_SCALE: f64 = 1_099_511_627_776.0;

fn bad(tensor: &'static str, index: usize, expected: &str, found: impl ToString) -> OpsError {
    OpsError::Value {
        op: OP,
        tensor,
        index,
        expected: expected.into(),
        found: found.to_string(),
    }
}

fn row_settings(s: &HostSampling<'_>, r: usize) -> Result<RowSettings> {
    let t = s.temperature[r];
    if !(t.is_finite() && t >= 0.0) {
        return Err(bad("temperature", r, "a finite temperature >= 0", t));
    }
    let k = s.top_k[r];
    if k < 0 {
        return Err(bad("top_k", r, "top_k >= 0 (0 = off)", k));
    }
    let tp = s.top_p[r];
    if !(tp > 0.0 && tp <= 1.0) {
        return Err(bad("top_p", r, "top_p in (0, 1] (1 = off)", tp));
    }
    let mp = s.min_p[r];
    if !(0.0..1.0).contains(&mp) {
        return Err(bad("min_p", r, "min_p in [0, 1) (0 = off)", mp));
    }
    let rep = s.repetition_penalty[r];
    if !(rep.is_finite() && rep > 0.0) {
        return Err(bad(
            "repetition_penalty",
            r,
            "a finite repetition penalty > 0 (1 = off)",
            rep,
        ));
    }
    let freq = s.frequency_penalty[r];
    if !freq.is_finite() {
        return Err(bad("frequency_penalty", r, "a finite value", freq));
    }
    let pres = s.presence_penalty[r];
    if !pres.is_finite() {
        return Err(bad("presence_penalty", r, "a finite value", pres));
    }
    Ok(RowSettings {
        temperature: t,
        top_k: k,
        top_p: tp,
        min_p: mp,
        rep,
        freq,
        pres,
    })
}

/// Steps 1-5 of the contract for one column: the processed logits of the public rows
/// (`z` when `temperature > 0`, the penalized logits `l` when greedy).
pub(crate) fn processed_logits(
    logits: &[f32],
    counts: &[i32],
    history: &[i32],
    public_vocab: usize,
    s: &RowSettings,
) -> Vec<f32> {
    let mut c: Vec<i64> = counts[..public_vocab]
        .iter()
        .map(|&x| i64::from(x))
        .collect();
    for &d in history {
        if let Some(slot) = usize::try_from(d).ok().and_then(|d| c.get_mut(d)) {
            *slot += 1;
        }
    }
    (0..public_vocab)
        .map(|v| {
            let mut l = logits[v];
            if c[v] > 0 {
                l = if l > 0.0 { l / s.rep } else { l * s.rep };
                l -= s.freq * (c[v] as f32) + s.pres;
            }
            if s.temperature > 0.0 {
                l / s.temperature + 0.0
            } else {
                l + 0.0
            }
        })
        .collect()
}

/// Lowest id attaining the maximum of `z` (`None` when the maximum is not finite or absent).
pub(crate) fn argmax(z: &[f32]) -> Option<usize> {
    let mut best: Option<usize> = None;
    for (v, &x) in z.iter().enumerate() {
        match best {
            Some(b) if x.partial_cmp(&z[b]) != Some(std::cmp::Ordering::Greater) => {}
            _ => best = Some(v),
        }
    }
    best.filter(|&b| z[b].is_finite())
}

/// Steps 4-9 for one column: write `p` (length `vocab`) from processed logits `z` (length
/// `public_vocab`). Requires a finite maximum.
pub(crate) fn distribution(z: &[f32], s: &RowSettings, amax: usize, p: &mut [f32]) {
    let public = z.len();
    p.fill(0.0);
    if s.temperature <= 0.0 {
        p[amax] = 1.0;
        return;
    }
    let zmax = f64::from(z[amax]);
    let e: Vec<f64> = z.iter().map(|&x| (f64::from(x) - zmax).exp()).collect();
    // Top-k: the k-th largest value, multiplicity counted.
    let k = s.top_k as usize;
    let top_k_on = k > 0 && k < public;
    let mut desc: Vec<usize> = Vec::new();
    if top_k_on || s.top_p < 1.0 {
        desc = (0..public).collect();
        desc.sort_by(|&a, &b| z[b].total_cmp(&z[a]).then(a.cmp(&b)));
    }
    let t_k = if top_k_on {
        z[desc[k - 1]]
    } else {
        f32::NEG_INFINITY
    };
    // Top-p on fixed-point masses over the top-k set, in descending z, groups of equal z.
    let mut t_p = f32::NEG_INFINITY;
    if s.top_p < 1.0 {
        let in_k: Vec<usize> = desc.iter().copied().filter(|&v| z[v] >= t_k).collect();
        let mass = |v: usize| (e[v] * MASS_SCALE).floor() as u64;
        let m_k: u64 = in_k.iter().map(|&v| mass(v)).sum();
        let target = f64::from(s.top_p) * m_k as f64;
        let mut cum = 0u64;
        let mut i = 0;
        while i < in_k.len() {
            let value = z[in_k[i]];
            while i < in_k.len() && z[in_k[i]] == value {
                cum += mass(in_k[i]);
                i += 1;
            }
            if cum as f64 >= target {
                t_p = value;
                break;
            }
        }
    }
    let min_p = f64::from(s.min_p);
    let kept = |v: usize| z[v] >= t_k && z[v] >= t_p && e[v] >= min_p;
    let sum: f64 = (0..public).filter(|&v| kept(v)).map(|v| e[v]).sum();
    for v in 0..public {
        if kept(v) {
            p[v] = (e[v] / sum) as f32;
        }
    }
}

/// Host view of the logits.
pub(super) enum HostLogits<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
}

impl HostLogits<'_> {
    fn len(&self) -> usize {
        match self {
            HostLogits::F32(x) => x.len(),
            HostLogits::Bf16(x) => x.len(),
        }
    }

    /// `len` logits from flat index `start`, as f32 (a bf16 logit widened exactly).
    fn column(&self, start: usize, len: usize) -> Cow<'_, [f32]> {
        match self {
            HostLogits::F32(x) => Cow::Borrowed(&x[start..start + len]),
            HostLogits::Bf16(x) => {
                Cow::Owned(x[start..start + len].iter().map(|v| v.to_f32()).collect())
            }
        }
    }
}

/// Host view of the history (see [`super::History`]).
pub(super) enum HostHistory<'a> {
    /// `proposals: [rows, cols-1]`.
    Chain(&'a [i32]),
    /// `tokens, parents: [rows, cols-1]`.
    Tree {
        tokens: &'a [i32],
        parents: &'a [i32],
    },
}

impl HostHistory<'_> {
    /// The nodes' tokens and their tensor name.
    fn tokens(&self) -> (&[i32], &'static str) {
        match self {
            HostHistory::Chain(d) => (d, "proposals"),
            HostHistory::Tree { tokens, .. } => (tokens, "tokens"),
        }
    }

    /// Step 1's tokens of column `i` of row `r`: the tokens `x_j` of the nodes `j` on the root
    /// path `i, par(i), ..` down to but excluding the anchor (a chain: `x_1 .. x_i`). Requires
    /// validated parents (each an earlier node).
    fn path(&self, r: usize, cols: usize, i: usize) -> Cow<'_, [i32]> {
        let row = r * (cols - 1);
        match self {
            HostHistory::Chain(d) => Cow::Borrowed(&d[row..row + i]),
            HostHistory::Tree { tokens, parents } => {
                let mut path = Vec::new();
                let mut j = i;
                while j >= 1 {
                    path.push(tokens[row + j - 1]);
                    j = parents[row + j - 1] as usize;
                }
                Cow::Owned(path)
            }
        }
    }
}

/// Host views of the outputs.
pub(super) enum HostOutputs<'a> {
    Full(&'a mut [f32]),
    Live {
        p: &'a mut [f32],
        greedy: &'a mut [i32],
    },
}

pub(super) fn run(
    logits: &HostLogits<'_>,
    col_start: Option<&[i32]>,
    live: &[i32],
    counts: &[i32],
    history: &HostHistory<'_>,
    s: &HostSampling<'_>,
    out: HostOutputs<'_>,
    params: &Params,
) -> Result<()> {
    let Params {
        rows,
        cols,
        vocab,
        public_vocab,
    } = *params;
    // Validate everything before writing anything.
    let mut settings = Vec::with_capacity(rows);
    let mut first = Vec::with_capacity(rows); // logits column of (r, 0)
    for r in 0..rows {
        settings.push(row_settings(s, r)?);
        let q = live[r];
        if !(q >= 1 && q as usize <= cols) {
            return Err(bad(
                "live",
                r,
                &format!("a live column count in 1..={cols}"),
                q,
            ));
        }
        let start = match col_start {
            None => r * cols,
            Some(cs) => {
                let have = logits.len() / vocab;
                let c = cs[r];
                if !(c >= 0 && (c as usize).saturating_add(q as usize) <= have) {
                    return Err(bad(
                        "col_start",
                        r,
                        &format!(
                            "a first logits column with its {q} live columns inside the {have} columns of the logits"
                        ),
                        c,
                    ));
                }
                c as usize
            }
        };
        first.push(start);
        // The live nodes 1..q: their tokens and (a tree) their parents.
        let (tokens, name) = history.tokens();
        for j in 1..q as usize {
            let idx = r * (cols - 1) + j - 1;
            let d = tokens[idx];
            if !(d >= 0 && (d as usize) < vocab) {
                return Err(bad(name, idx, &format!("a token id in 0..{vocab}"), d));
            }
            if let HostHistory::Tree { parents, .. } = history {
                let par = parents[idx];
                if !(par >= 0 && (par as usize) < j) {
                    return Err(bad(
                        "parents",
                        idx,
                        &format!("the parent of node {j} (row {r}): an earlier node in 0..{j}"),
                        par,
                    ));
                }
            }
        }
    }
    if let Some(i) = counts[..rows * vocab].iter().position(|&c| c < 0) {
        return Err(bad("counts", i, "a token count >= 0", counts[i]));
    }
    // The processed logits of every live column, validated (then recomputed when writing:
    // this keeps one column in memory at a time).
    let processed = |r: usize, i: usize| {
        let base = (first[r] + i) * vocab;
        let col = logits.column(base, public_vocab);
        let hist = history.path(r, cols, i);
        let z = processed_logits(
            &col,
            &counts[r * vocab..(r + 1) * vocab],
            &hist,
            public_vocab,
            &settings[r],
        );
        (base, col, z)
    };
    for r in 0..rows {
        for i in 0..live[r] as usize {
            let (base, col, z) = processed(r, i);
            if let Some(v) = col.iter().position(|x| x.is_nan() || *x == f32::INFINITY) {
                return Err(bad(
                    "logits",
                    base + v,
                    &format!(
                        "a public logit (row {r}, column {i}, token {v}) that is not NaN or +inf"
                    ),
                    col[v],
                ));
            }
            if let Some(v) = z.iter().position(|x| *x == f32::INFINITY || x.is_nan()) {
                return Err(bad(
                    "logits",
                    base + v,
                    &format!(
                        "a processed logit below +inf and not NaN (row {r}, column {i}, token {v}: the temperature or a penalty overflows f32)"
                    ),
                    col[v],
                ));
            }
            if argmax(&z).is_none() {
                return Err(bad(
                    "logits",
                    base,
                    &format!("at least one finite processed public logit (row {r}, column {i})"),
                    "all -inf",
                ));
            }
        }
    }
    match out {
        HostOutputs::Full(p) => {
            for r in 0..rows {
                let q = live[r] as usize;
                for i in 0..cols {
                    let base = (r * cols + i) * vocab;
                    let out = &mut p[base..base + vocab];
                    if i >= q {
                        out.fill(0.0);
                        continue;
                    }
                    let (_, _, z) = processed(r, i);
                    let amax = argmax(&z).unwrap_or(0); // validated above
                    distribution(&z, &settings[r], amax, out);
                }
            }
        }
        HostOutputs::Live { p, greedy } => {
            for r in 0..rows {
                for i in 0..live[r] as usize {
                    let (_, _, z) = processed(r, i);
                    let amax = argmax(&z).unwrap_or(0); // validated above
                    if settings[r].temperature <= 0.0 {
                        greedy[r * cols + i] = amax as i32;
                    } else {
                        greedy[r * cols + i] = SAMPLED;
                        let base = (r * cols + i) * vocab;
                        distribution(&z, &settings[r], amax, &mut p[base..base + vocab]);
                    }
                }
            }
        }
    }
    Ok(())
}
