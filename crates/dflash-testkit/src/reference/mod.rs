//! The reference target: a small Qwen3.5-style hybrid text model on the host, implementing
//! [`Target`].
//!
//! Model (per decoder block `l`, residual `x`):
//! ```text
//! n = zc_rmsnorm(x, input_layernorm)            zc_rmsnorm(x, w) = x * rsqrt(mean(x^2)+eps) * (1 + w)
//! x = x + mixer_l(n)                            Gated DeltaNet or gated full attention
//! x = x + down(silu(gate(m)) * up(m)),  m = zc_rmsnorm(x, post_attention_layernorm)
//! ```
//! then `logits = lm_head(zc_rmsnorm(x, norm))` over all `vocab_rows` (padded) rows.
//!
//! Gated DeltaNet (`linear_attn.*`): `qkv = in_proj_qkv n`, `z = in_proj_z n`,
//! `b = in_proj_b n`, `a = in_proj_a n`; a causal depthwise conv1d (kernel K, no bias) over the
//! qkv channels followed by SiLU; q and k L2-normalized per key head (`x * rsqrt(sum x^2 + 1e-6)`),
//! q scaled by `1/sqrt(Dk)`; value head `h` uses key head `h / (nv/nk)`; per value head
//! `g = -exp(A_log) * softplus(a + dt_bias)`, `beta = sigmoid(b)`,
//! `S <- S * exp(g); S += k (beta * (v - S^T k))^T; o = S^T q`; the output passes a *plain*
//! gated RMSNorm `norm(o) * w * silu(z)` (per head, weight `[Dv]`, as the real model's
//! `Qwen3_5RMSNormGated`) and `out_proj`.
//!
//! Gated attention (`self_attn.*`): `q_proj` gives per head D query rows then D gate rows;
//! q and k get the zero-centred per-head RMSNorm, then split-half RoPE on the first
//! `floor(D * partial_rotary_factor)` dims at the column's position (text positions make the
//! three MRoPE axes equal, so this is Qwen3.5's text RoPE); causal softmax attention with
//! scale `1/sqrt(D)` and GQA; the output is multiplied by `sigmoid(gate)` before `o_proj`.
//!
//! Numerics: see the `model` module: BF16-stored weights widened to f32, all math and state in
//! f32, features rounded once to BF16, logits f32. It runs on the host; outputs are written to
//! the caller's backend (uploaded when that is a device).
//!
//! Records and folding: a verify keeps, indexed by column, per Gated DeltaNet block the
//! recurrent state after every column and every column's conv input, per attention block the
//! K/V of every column, and the row's parents (the chain's when it has none). A commit folds a
//! root-to-node path of columns (`Accepted::Prefix(N)` is the path `0, 1, .., N-1`): the
//! recurrent state becomes the record after the path's last column, the conv window advances
//! by the path columns' inputs in path order, their K/V rows are appended in path order and
//! the frontier moves by the path's length. Prefill is the same forward (a chain) followed by
//! the same fold of all its columns.
//!
//! Trees: this target verifies trees ([`TargetInfo::supports_trees`] is true). A row with
//! parents computes column `i` on top of its parent `parents[i-1]`: its Gated DeltaNet state
//! and conv window continue the parent's (column 0 continues the committed state), it attends
//! to the committed cache and then to its ancestors' new K/V in root-to-node order (itself
//! last; siblings and other branches are invisible), and it takes the RoPE position
//! `F + depth(i)`. So every node computes, bit for bit, what the last column of a chain verify
//! of its root path computes; a chain (`parents[i-1] = i-1`, or `None`) is the special case.
//! Parents are checked ([`TargetError::BadParents`]: `Q - 1` of them, each an earlier column).
//! Capacity counts positions, not columns: a row needs `F + max depth + 1 <= max_positions`
//! ([`TargetError::CapacityExceeded`] reports `max depth + 1` as its columns), since no commit
//! can adopt more than a root-to-leaf path. A commit's [`Accepted::Path`] (on a tree or a
//! chain verify) must start at column 0, each next entry a child of the previous one and every
//! entry below `Q`; `Accepted::Prefix(N)` on a tree verify is allowed only when columns `0..N`
//! form a chain. Anything else is [`TargetError::InvalidPath`] naming the offending entry (or,
//! for more entries than `Q`, [`TargetError::CommitTooLong`]), refused like every commit
//! refusal before any sequence changes.

mod model;

use std::collections::{HashMap, HashSet};
use std::path::Path;

use dflash_engine::{
    Accepted, Commit, PrefillOutput, SeqHandle, Target, TargetCheckpoint, TargetError, TargetInfo,
    VerifyBatch, VerifyOutputs, VerifyView,
};
use dflash_ops::{Backend, bf16};

use crate::error::{Result, TestkitError};
use crate::geometry::TargetGeometry;
use model::{Model, Records, SeqState};

pub use model::TEXT_PREFIX;
pub(crate) use model::{Init, tensor_specs};

#[derive(Debug)]
struct Seq {
    state: SeqState,
    pending: Option<Records>,
}

/// The reference Qwen3.5-style hybrid target (host f32, BF16 weights).
#[derive(Debug)]
pub struct ReferenceTarget {
    model: Model,
    info: TargetInfo,
    seqs: HashMap<SeqHandle, Seq>,
    next: u64,
    /// The target's own verify outputs (lent by `verified`), sized by the largest batch.
    outputs: Option<VerifyOutputs>,
}

/// A checkpoint image of a [`ReferenceTarget`] sequence: its complete committed state.
#[derive(Clone, Debug)]
pub struct ReferenceCheckpoint {
    geometry: TargetGeometry,
    state: SeqState,
}

impl TargetCheckpoint for ReferenceCheckpoint {
    fn frontier(&self) -> usize {
        self.state.frontier
    }

    fn size_bytes(&self) -> usize {
        let f = |v: &Vec<f32>| v.len() * 4;
        self.state
            .gdn
            .iter()
            .map(|g| f(&g.s) + f(&g.conv))
            .chain(self.state.kv.iter().map(|c| f(&c.k) + f(&c.v)))
            .sum()
    }
}

impl ReferenceCheckpoint {
    /// Number of Gated DeltaNet blocks in the image.
    pub fn gdn_blocks(&self) -> usize {
        self.state.gdn.len()
    }

    /// Number of attention blocks in the image.
    pub fn attention_blocks(&self) -> usize {
        self.state.kv.len()
    }

    /// Recurrent state of the `i`-th Gated DeltaNet block, `[nv, Dk, Dv]` f32.
    pub fn gdn_state(&self, i: usize) -> Option<&[f32]> {
        self.state.gdn.get(i).map(|g| g.s.as_slice())
    }

    /// Conv window of the `i`-th Gated DeltaNet block, `[K-1, conv_dim]` f32, oldest first.
    pub fn conv_window(&self, i: usize) -> Option<&[f32]> {
        self.state.gdn.get(i).map(|g| g.conv.as_slice())
    }

    /// K (after norm and RoPE) and V of the `i`-th attention block, `[F, hkv*D]` f32 each.
    pub fn kv(&self, i: usize) -> Option<(&[f32], &[f32])> {
        self.state
            .kv
            .get(i)
            .map(|c| (c.k.as_slice(), c.v.as_slice()))
    }

    /// The first difference from `other` in bit patterns (`None` when bit-identical), named.
    pub fn first_difference(&self, other: &ReferenceCheckpoint) -> Option<String> {
        fn cmp(what: String, a: &[f32], b: &[f32]) -> Option<String> {
            if a.len() != b.len() {
                return Some(format!("{what}: length {} vs {}", a.len(), b.len()));
            }
            a.iter()
                .zip(b)
                .position(|(x, y)| x.to_bits() != y.to_bits())
                .map(|i| format!("{what}[{i}]: {} vs {}", a[i], b[i]))
        }
        if self.state.frontier != other.state.frontier {
            return Some(format!(
                "frontier {} vs {}",
                self.state.frontier, other.state.frontier
            ));
        }
        if self.state.gdn.len() != other.state.gdn.len()
            || self.state.kv.len() != other.state.kv.len()
        {
            return Some("block counts differ".to_owned());
        }
        for (i, (a, b)) in self.state.gdn.iter().zip(&other.state.gdn).enumerate() {
            if let Some(d) = cmp(format!("gdn[{i}].state"), &a.s, &b.s)
                .or_else(|| cmp(format!("gdn[{i}].conv"), &a.conv, &b.conv))
            {
                return Some(d);
            }
        }
        for (i, (a, b)) in self.state.kv.iter().zip(&other.state.kv).enumerate() {
            if let Some(d) = cmp(format!("attn[{i}].k"), &a.k, &b.k)
                .or_else(|| cmp(format!("attn[{i}].v"), &a.v, &b.v))
            {
                return Some(d);
            }
        }
        None
    }
}

fn read_file(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|source| TestkitError::Io {
        path: path.to_owned(),
        source,
    })
}

impl ReferenceTarget {
    /// Load `config.json` and `model.safetensors` from `dir`.
    ///
    /// `capture_ids` are the zero-based block ids whose residual outputs are captured, in
    /// recorded order (non-empty, distinct, below the block count); `public_vocab` is the
    /// public vocabulary size (`1 ..= vocab_size`), which a Hugging Face config does not state.
    pub fn load(dir: &Path, capture_ids: &[usize], public_vocab: usize) -> Result<Self> {
        let cfg_path = dir.join("config.json");
        let text = read_file(&cfg_path)?;
        let doc: serde_json::Value =
            serde_json::from_slice(&text).map_err(|e| TestkitError::Json {
                path: cfg_path.clone(),
                message: e.to_string(),
            })?;
        let (geo, tied) = TargetGeometry::from_config_json(&doc, public_vocab)?;
        let st_path = dir.join("model.safetensors");
        let bytes = read_file(&st_path)?;
        let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| {
            TestkitError::Safetensors {
                path: st_path.clone(),
                message: e.to_string(),
            }
        })?;
        let model = Model::from_safetensors(geo, tied, &st)?;
        Self::from_model(model, capture_ids)
    }

    fn from_model(model: Model, capture_ids: &[usize]) -> Result<Self> {
        let layers = model.geo.layers();
        let bad = |expected: String| TestkitError::Config {
            field: "capture_ids".to_owned(),
            expected,
            found: format!("{capture_ids:?}"),
        };
        if capture_ids.is_empty() {
            return Err(bad("at least one block id".to_owned()));
        }
        let mut seen = HashSet::new();
        for &id in capture_ids {
            if id >= layers {
                return Err(bad(format!("block ids below {layers}")));
            }
            if !seen.insert(id) {
                return Err(bad("distinct block ids".to_owned()));
            }
        }
        let g = &model.geo;
        let info = TargetInfo {
            hidden: g.hidden,
            layers,
            vocab_rows: g.vocab_rows,
            public_vocab: g.public_vocab,
            capture_ids: capture_ids.to_vec(),
            max_positions: g.max_positions,
            supports_trees: true,
        };
        Ok(ReferenceTarget {
            model,
            info,
            seqs: HashMap::new(),
            next: 1,
            outputs: None,
        })
    }

    /// The model geometry.
    pub fn geometry(&self) -> &TargetGeometry {
        &self.model.geo
    }

    /// The f32 residual after every block for `tokens` run as chain columns on top of `seq`'s
    /// committed state, `[Q, layers, H]` (no state change, no records): the hook the capture
    /// tests use. Refused like a one-row verify.
    pub fn trace_residuals(
        &self,
        seq: SeqHandle,
        tokens: &[u32],
    ) -> std::result::Result<Vec<f32>, TargetError> {
        let s = self.seq(seq)?;
        self.check_tokens_row(0, tokens)?;
        self.check_capacity(seq, s.state.frontier, tokens.len())?;
        let mut trace = Vec::new();
        let _ = self.model.forward(
            &s.state,
            tokens,
            None,
            &self.info.capture_ids,
            tokens.len(),
            Some(&mut trace),
        );
        Ok(trace)
    }

    fn seq(&self, seq: SeqHandle) -> std::result::Result<&Seq, TargetError> {
        self.seqs
            .get(&seq)
            .ok_or(TargetError::UnknownSequence { seq })
    }

    fn idle_seq(&self, seq: SeqHandle) -> std::result::Result<&Seq, TargetError> {
        let s = self.seq(seq)?;
        match &s.pending {
            Some(r) => Err(TargetError::VerifyPending { seq, columns: r.q }),
            None => Ok(s),
        }
    }

    fn check_tokens_row(&self, row: usize, tokens: &[u32]) -> std::result::Result<(), TargetError> {
        if tokens.is_empty() {
            return Err(TargetError::EmptyRow { row });
        }
        let v = self.info.vocab_rows;
        match tokens.iter().position(|&t| t as usize >= v) {
            Some(column) => Err(TargetError::TokenOutOfRange {
                row,
                column,
                token: tokens[column],
                vocab_rows: v,
            }),
            None => Ok(()),
        }
    }

    /// `frontier + positions` must fit `max_positions`; `positions` is what the row uses (its
    /// column count for a chain or prefill, max depth + 1 for a tree).
    fn check_capacity(
        &self,
        seq: SeqHandle,
        frontier: usize,
        positions: usize,
    ) -> std::result::Result<(), TargetError> {
        let max = self.info.max_positions;
        if frontier.checked_add(positions).is_none_or(|e| e > max) {
            return Err(TargetError::CapacityExceeded {
                seq,
                frontier,
                columns: positions,
                max_positions: max,
            });
        }
        Ok(())
    }

    fn new_handle(&mut self) -> SeqHandle {
        let h = SeqHandle::from_raw(self.next);
        self.next += 1;
        h
    }
}

/// Positions a tree row with these (checked) parents uses: its maximum depth + 1.
fn tree_positions(parents: &[u32]) -> usize {
    let mut depth = Vec::with_capacity(parents.len() + 1);
    depth.push(0usize);
    for &p in parents {
        depth.push(depth[p as usize] + 1);
    }
    depth.into_iter().max().map_or(1, |d| d + 1)
}

/// The columns `c` adopts from its pending verify `rec`, in fold order, or why it may not.
fn accepted_path(c: &Commit, rec: &Records) -> std::result::Result<Vec<usize>, TargetError> {
    let seq = c.seq;
    let rows = c.rows();
    if rows > rec.q {
        return Err(TargetError::CommitTooLong {
            seq,
            rows,
            columns: rec.q,
        });
    }
    // The parent column of column `i >= 1`.
    let parent = |i: usize| rec.parents[i - 1] as usize;
    match &c.accepted {
        Accepted::Prefix(n) => {
            if let Some(i) = (1..*n).find(|&i| parent(i) != i - 1) {
                return Err(TargetError::InvalidPath {
                    seq,
                    path: (0..*n as u32).collect(),
                    reason: format!(
                        "Prefix({n}) of a tree verify: the prefix is not a chain path (column \
{i}'s parent is column {}, not {})",
                        parent(i),
                        i - 1
                    ),
                });
            }
            Ok((0..*n).collect())
        }
        Accepted::Path(p) => {
            let invalid = |reason: String| TargetError::InvalidPath {
                seq,
                path: p.clone(),
                reason,
            };
            for (k, &col) in p.iter().enumerate() {
                let col = col as usize;
                if col >= rec.q {
                    return Err(invalid(format!(
                        "entry {k} is column {col}, not below the verify's {} live columns",
                        rec.q
                    )));
                }
                if k == 0 {
                    if col != 0 {
                        return Err(invalid(format!(
                            "entry 0 is column {col}, a path starts at the root column 0"
                        )));
                    }
                } else if col == 0 || parent(col) != p[k - 1] as usize {
                    let has = if col == 0 {
                        "no parent (it is the root)".to_owned()
                    } else {
                        format!("parent {}", parent(col))
                    };
                    return Err(invalid(format!(
                        "entry {k} is column {col}, which has {has}, not entry {} (column {})",
                        k - 1,
                        p[k - 1]
                    )));
                }
            }
            Ok(p.iter().map(|&col| col as usize).collect())
        }
    }
}

impl Target for ReferenceTarget {
    type Checkpoint = ReferenceCheckpoint;

    fn info(&self) -> &TargetInfo {
        &self.info
    }

    fn create(&mut self) -> std::result::Result<SeqHandle, TargetError> {
        let h = self.new_handle();
        self.seqs.insert(
            h,
            Seq {
                state: self.model.empty_state(),
                pending: None,
            },
        );
        Ok(h)
    }

    fn prefill(
        &mut self,
        be: &Backend,
        seq: SeqHandle,
        tokens: &[u32],
    ) -> std::result::Result<PrefillOutput, TargetError> {
        let s = self.idle_seq(seq)?;
        if tokens.is_empty() {
            return Err(TargetError::EmptyPrompt { seq });
        }
        let v = self.info.vocab_rows;
        if let Some(index) = tokens.iter().position(|&t| t as usize >= v) {
            return Err(TargetError::PromptTokenOutOfRange {
                index,
                token: tokens[index],
                vocab_rows: v,
            });
        }
        self.check_capacity(seq, s.state.frontier, tokens.len())?;
        let fwd = self.model.forward(
            &s.state,
            tokens,
            None,
            &self.info.capture_ids,
            tokens.len() - 1,
            None,
        );
        let out = PrefillOutput {
            features: be.upload(&fwd.features)?,
            last_logits: be.upload(&fwd.logits)?,
        };
        // Outputs exist: now fold every column (the same fold a verify's commit uses).
        let Some(s) = self.seqs.get_mut(&seq) else {
            return Err(TargetError::UnknownSequence { seq });
        };
        let all: Vec<usize> = (0..tokens.len()).collect();
        self.model.commit(&mut s.state, &fwd.records, &all);
        Ok(out)
    }

    fn frontier(&self, seq: SeqHandle) -> std::result::Result<usize, TargetError> {
        Ok(self.seq(seq)?.state.frontier)
    }

    fn pending(&self, seq: SeqHandle) -> std::result::Result<Option<usize>, TargetError> {
        Ok(self.seq(seq)?.pending.as_ref().map(|r| r.q))
    }

    fn verify(
        &mut self,
        be: &Backend,
        batch: &VerifyBatch<'_>,
    ) -> std::result::Result<(), TargetError> {
        let rows = batch.rows;
        if rows.is_empty() {
            return Err(TargetError::EmptyBatch);
        }
        let cols = batch.cols;
        let (v, fw) = (self.info.vocab_rows, self.info.feature_width());
        let mut seen = HashSet::new();
        for (r, row) in rows.iter().enumerate() {
            let s = self.idle_seq(row.seq)?;
            if !seen.insert(row.seq) {
                return Err(TargetError::DuplicateSequence { seq: row.seq });
            }
            self.check_tokens_row(r, row.tokens)?;
            let q = row.tokens.len();
            if q > cols {
                return Err(TargetError::WidthTooSmall {
                    row: r,
                    columns: q,
                    width: cols,
                });
            }
            // Positions the row uses: max depth + 1 (Q for a chain).
            let mut positions = q;
            if let Some(p) = row.parents {
                if p.len() != q - 1 {
                    return Err(TargetError::BadParents {
                        row: r,
                        reason: format!("{} parents for {q} columns (expected {})", p.len(), q - 1),
                    });
                }
                if let Some(i) = p.iter().enumerate().position(|(i, &pa)| pa as usize > i) {
                    return Err(TargetError::BadParents {
                        row: r,
                        reason: format!(
                            "column {} has parent {}, which is not an earlier column",
                            i + 1,
                            p[i]
                        ),
                    });
                }
                positions = tree_positions(p);
            }
            self.check_capacity(row.seq, s.state.frontier, positions)?;
        }
        let total = rows.len() * cols;

        let mut logits = vec![0.0f32; total * v];
        let mut features = vec![bf16::ZERO; total * fw];
        let mut records = Vec::with_capacity(rows.len());
        for (r, row) in rows.iter().enumerate() {
            let s = self.seq(row.seq)?;
            let fwd = self.model.forward(
                &s.state,
                row.tokens,
                row.parents,
                &self.info.capture_ids,
                0,
                None,
            );
            let q = row.tokens.len();
            logits[r * cols * v..(r * cols + q) * v].copy_from_slice(&fwd.logits);
            features[r * cols * fw..(r * cols + q) * fw].copy_from_slice(&fwd.features);
            records.push(fwd.records);
        }
        let out = VerifyOutputs::fit(&mut self.outputs, be, &self.info, rows.len(), cols)?;
        be.write(&mut out.logits, 0, &logits)?;
        be.write(&mut out.features, 0, &features)?;
        for (row, rec) in rows.iter().zip(records) {
            if let Some(s) = self.seqs.get_mut(&row.seq) {
                s.pending = Some(rec);
            }
        }
        Ok(())
    }

    fn verified(&self) -> std::result::Result<VerifyView<'_>, TargetError> {
        self.outputs
            .as_ref()
            .map(VerifyOutputs::view)
            .ok_or(TargetError::NothingVerified)
    }

    fn commit(&mut self, commits: &[Commit]) -> std::result::Result<(), TargetError> {
        let mut seen = HashSet::new();
        let mut plan = Vec::with_capacity(commits.len());
        for c in commits {
            let s = self.seq(c.seq)?;
            if !seen.insert(c.seq) {
                return Err(TargetError::DuplicateSequence { seq: c.seq });
            }
            let Some(rec) = &s.pending else {
                return Err(TargetError::NoPendingVerify { seq: c.seq });
            };
            let path = accepted_path(c, rec)?;
            plan.push((c.seq, path));
        }
        // Every commit is valid: only now does any sequence change.
        for (seq, path) in plan {
            if let Some(s) = self.seqs.get_mut(&seq)
                && let Some(rec) = s.pending.take()
            {
                self.model.commit(&mut s.state, &rec, &path);
            }
        }
        Ok(())
    }

    fn fork(&mut self, seq: SeqHandle) -> std::result::Result<SeqHandle, TargetError> {
        let state = self.idle_seq(seq)?.state.clone();
        let h = self.new_handle();
        self.seqs.insert(
            h,
            Seq {
                state,
                pending: None,
            },
        );
        Ok(h)
    }

    fn checkpoint(&self, seq: SeqHandle) -> std::result::Result<ReferenceCheckpoint, TargetError> {
        Ok(ReferenceCheckpoint {
            geometry: self.model.geo.clone(),
            state: self.idle_seq(seq)?.state.clone(),
        })
    }

    fn restore(
        &mut self,
        seq: SeqHandle,
        image: &ReferenceCheckpoint,
    ) -> std::result::Result<(), TargetError> {
        self.idle_seq(seq)?;
        if image.geometry != self.model.geo {
            return Err(TargetError::IncompatibleCheckpoint {
                reason: "the image was taken from a target of another geometry".to_owned(),
            });
        }
        if image.state.frontier > self.info.max_positions {
            return Err(TargetError::IncompatibleCheckpoint {
                reason: format!(
                    "frontier {} exceeds the capacity {}",
                    image.state.frontier, self.info.max_positions
                ),
            });
        }
        if let Some(s) = self.seqs.get_mut(&seq) {
            s.state = image.state.clone();
        }
        Ok(())
    }

    fn release(&mut self, seq: SeqHandle) -> std::result::Result<(), TargetError> {
        self.seqs
            .remove(&seq)
            .map(|_| ())
            .ok_or(TargetError::UnknownSequence { seq })
    }
}
