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
//! Records and folding: a verify keeps, per Gated DeltaNet block, the recurrent state after
//! every column and every column's conv input, and per attention block the K/V of every
//! column. `commit(N)` sets the recurrent state to the record after column `N-1`, advances the
//! conv window by the first `N` inputs, appends the first `N` K/V rows and moves the frontier
//! by `N`. Prefill is the same forward followed by the same fold of all its columns.
//!
//! Trees: this target verifies chains only ([`TargetInfo::supports_trees`] is false); a row
//! whose parents are not the chain gets [`TargetError::TreeUnsupported`].

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
            supports_trees: false,
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

    fn check_capacity(
        &self,
        seq: SeqHandle,
        frontier: usize,
        columns: usize,
    ) -> std::result::Result<(), TargetError> {
        let max = self.info.max_positions;
        if frontier.checked_add(columns).is_none_or(|e| e > max) {
            return Err(TargetError::CapacityExceeded {
                seq,
                frontier,
                columns,
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
        self.model.commit(&mut s.state, &fwd.records, tokens.len());
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
                if !row.is_chain() {
                    return Err(TargetError::TreeUnsupported { row: r });
                }
            }
            self.check_capacity(row.seq, s.state.frontier, q)?;
        }
        let total = rows.len() * cols;

        let mut logits = vec![0.0f32; total * v];
        let mut features = vec![bf16::ZERO; total * fw];
        let mut records = Vec::with_capacity(rows.len());
        for (r, row) in rows.iter().enumerate() {
            let s = self.seq(row.seq)?;
            let fwd = self
                .model
                .forward(&s.state, row.tokens, &self.info.capture_ids, 0, None);
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
            let n = match &c.accepted {
                Accepted::Prefix(n) => *n,
                Accepted::Path(p) => {
                    if let Some(i) = p.iter().enumerate().position(|(i, &col)| col as usize != i) {
                        return Err(TargetError::InvalidPath {
                            seq: c.seq,
                            path: p.clone(),
                            reason: format!(
                                "entry {i} is column {}, a chain verify's path is 0, 1, 2, ..",
                                p[i]
                            ),
                        });
                    }
                    p.len()
                }
            };
            if n > rec.q {
                return Err(TargetError::CommitTooLong {
                    seq: c.seq,
                    rows: n,
                    columns: rec.q,
                });
            }
            plan.push((c.seq, n));
        }
        for (seq, n) in plan {
            if let Some(s) = self.seqs.get_mut(&seq)
                && let Some(rec) = s.pending.take()
            {
                self.model.commit(&mut s.state, &rec, n);
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
