//! The embedded default of the `dflash` binary, shared with the end-to-end tests: a synthetic
//! DFlash / DFlash2 draft checkpoint matched to the reference hybrid target of
//! `dflash-testkit` (tiny geometry), written into a scratch directory and loaded on a backend;
//! demo prompts; and the readable per-round trace.
//!
//! The pairing: the target is [`TargetGeometry::tiny`] (H 64, 8 blocks, 512 vocabulary rows
//! of which 500 public, EOS 499); the draft has the target's hidden width and vocabulary, two
//! layers (DFlash: one sliding-window layer with S = 8 and one full layer; DFlash2: two
//! sliding-window layers), 4 query / 2 KV heads of 16, MLP width 128, captured target blocks
//! `[1, 4, 6]` and mask token 503 (a padding row of the target's embedding).
//!
//! [`shadow::ShadowProposer`] is a proposer over a private copy of the target (the oracle the
//! tests and `dflash --oracle` use to drive long acceptances).

#![deny(missing_docs)]

pub mod shadow;

use std::path::{Path, PathBuf};

use dflash_config::{AttentionType, Backend as DraftBackend};
use dflash_draft::synthetic::{self, Layout, TinySpec};
use dflash_draft::{BindOptions, DraftError, DraftModel};
use dflash_engine::{DraftHead, DraftTargetParts, EngineError, RowReport, StepReport};
use dflash_ops::{Backend, OpsError, bf16};
use dflash_testkit::fixtures::{SplitMix64, write_reference_target};
use dflash_testkit::{ReferenceTarget, TEXT_PREFIX, TargetGeometry, TestkitError};

/// Captured target block ids of the default draft (recorded order).
pub const CAPTURE_IDS: [u32; 3] = [1, 4, 6];
/// The default draft's mask token (a non-public padding row of the tiny target).
pub const MASK_TOKEN: u32 = 503;
/// Seed of the reference target's weights.
pub const TARGET_SEED: u64 = 0x00d1_a5e5;
/// Seed of the synthetic draft's weights.
pub const DRAFT_SEED: u64 = 0x0dfa_2002;

/// Everything that can go wrong while building the embedded default.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// A scratch file or directory could not be made.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The reference target could not be written or loaded.
    #[error(transparent)]
    Testkit(#[from] TestkitError),
    /// The synthetic draft could not be written or loaded.
    #[error(transparent)]
    Draft(#[from] DraftError),
    /// A backend operation failed.
    #[error(transparent)]
    Ops(#[from] OpsError),
    /// The engine refused.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// A target tensor the draft borrows is missing or malformed.
    #[error("target tensor `{name}`: {problem}")]
    Tensor {
        /// The tensor name.
        name: String,
        /// What is wrong.
        problem: String,
    },
}

/// Result alias of the harness.
pub type Result<T, E = HarnessError> = std::result::Result<T, E>;

/// The target geometry of the embedded default.
pub fn target_geometry() -> TargetGeometry {
    TargetGeometry::tiny()
}

/// The synthetic draft spec matched to [`target_geometry`] for `backend`.
pub fn draft_spec(backend: DraftBackend) -> TinySpec {
    let g = target_geometry();
    let layers = match backend {
        DraftBackend::DFlash => vec![AttentionType::Sliding, AttentionType::Full],
        DraftBackend::DFlash2 => vec![AttentionType::Sliding, AttentionType::Sliding],
    };
    TinySpec {
        backend,
        hidden: g.hidden as u32,
        layers,
        q_heads: 4,
        kv_heads: 2,
        head_dim: 16,
        intermediate: 128,
        window: 8,
        target_layer_ids: CAPTURE_IDS.to_vec(),
        target_layers: g.layers() as u32,
        vocab_rows: g.vocab_rows as u32,
        public_vocab: g.public_vocab as u32,
        mask_token_id: MASK_TOKEN,
        selector_rank: 16,
    }
}

/// A scratch directory removed on drop.
#[derive(Debug)]
pub struct ScratchDir(PathBuf);

impl ScratchDir {
    /// A fresh directory under the system temp dir named after `tag`, the process and a
    /// counter.
    pub fn new(tag: &str) -> Result<Self> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("dflash-{tag}-{}-{n}", std::process::id()));
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(|source| HarnessError::Io {
                path: dir.clone(),
                source,
            })?;
        }
        std::fs::create_dir_all(&dir).map_err(|source| HarnessError::Io {
            path: dir.clone(),
            source,
        })?;
        Ok(ScratchDir(dir))
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        // Best effort: a leftover scratch directory is harmless.
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The embedded default written to disk: the reference target and the synthetic draft
/// checkpoints of one backend.
#[derive(Debug)]
pub struct Fixture {
    dir: ScratchDir,
    backend: DraftBackend,
}

impl Fixture {
    /// Write both checkpoints into a fresh scratch directory.
    pub fn write(backend: DraftBackend) -> Result<Self> {
        let dir = ScratchDir::new(match backend {
            DraftBackend::DFlash => "dflash",
            DraftBackend::DFlash2 => "dflash2",
        })?;
        write_reference_target(&dir.path().join("target"), &target_geometry(), TARGET_SEED)?;
        let spec = draft_spec(backend);
        synthetic::write_checkpoint(
            &dir.path().join("draft"),
            &spec.draft_config_json(),
            &spec.target(),
            DRAFT_SEED,
            Layout::Single,
        )?;
        Ok(Fixture { dir, backend })
    }

    /// The draft backend of the fixture.
    pub fn backend(&self) -> DraftBackend {
        self.backend
    }

    /// The reference target directory.
    pub fn target_dir(&self) -> PathBuf {
        self.dir.path().join("target")
    }

    /// The draft checkpoint directory.
    pub fn draft_dir(&self) -> PathBuf {
        self.dir.path().join("draft")
    }

    /// Load the reference target (capturing the draft's block ids).
    pub fn target(&self) -> Result<ReferenceTarget> {
        let ids: Vec<usize> = CAPTURE_IDS.iter().map(|&i| i as usize).collect();
        Ok(ReferenceTarget::load(
            &self.target_dir(),
            &ids,
            target_geometry().public_vocab,
        )?)
    }

    /// Load the draft model on `be`.
    pub fn draft(&self, be: &Backend) -> Result<DraftModel> {
        let spec = draft_spec(self.backend);
        Ok(DraftModel::load(
            be,
            self.draft_dir(),
            &spec.target(),
            &BindOptions::default(),
        )?)
    }

    /// The target parts the draft borrows (the target's embedding and full output head), read
    /// from the target checkpoint and uploaded to `be`.
    pub fn parts(&self, be: &Backend) -> Result<DraftTargetParts> {
        let g = target_geometry();
        let path = self.target_dir().join("model.safetensors");
        let bytes = std::fs::read(&path).map_err(|source| HarnessError::Io {
            path: path.clone(),
            source,
        })?;
        let st =
            safetensors::SafeTensors::deserialize(&bytes).map_err(|e| HarnessError::Tensor {
                name: path.display().to_string(),
                problem: e.to_string(),
            })?;
        let read = |name: &str| -> Result<Vec<bf16>> {
            let t = st.tensor(name).map_err(|e| HarnessError::Tensor {
                name: name.to_owned(),
                problem: e.to_string(),
            })?;
            let want = [g.vocab_rows, g.hidden];
            if t.dtype() != safetensors::Dtype::BF16 || t.shape() != want {
                return Err(HarnessError::Tensor {
                    name: name.to_owned(),
                    problem: format!(
                        "expected BF16 {want:?}, found {:?} {:?}",
                        t.dtype(),
                        t.shape()
                    ),
                });
            }
            Ok(t.data()
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]))
                .collect())
        };
        let embedding = read(&format!("{TEXT_PREFIX}embed_tokens.weight"))?;
        let head = read("lm_head.weight")?;
        Ok(DraftTargetParts {
            vocab_rows: g.vocab_rows,
            public_vocab: g.public_vocab,
            embedding: be.upload(&embedding)?,
            head: DraftHead::Full {
                output_head: be.upload(&head)?,
            },
        })
    }
}

/// `count` demo prompts of 6 to 20 public tokens (below the EOS id), deterministic in `seed`.
pub fn demo_prompts(count: usize, seed: u64) -> Vec<Vec<u32>> {
    let g = target_geometry();
    let mut rng = SplitMix64::new(seed ^ 0x005e_ed0f_d1a5);
    (0..count)
        .map(|_| {
            let len = 6 + rng.below(15) as usize;
            (0..len)
                .map(|_| rng.below(g.eos_token_id as u64) as u32)
                .collect()
        })
        .collect()
}

fn list(tokens: &[u32]) -> String {
    let s: Vec<String> = tokens.iter().map(u32::to_string).collect();
    format!("[{}]", s.join(" "))
}

/// The trace line of one row of a round:
/// `r<id> F=<frontier> ctx=<materialized>+<pending> P=<P> d=[..] A=<A> L=<L> N=<N> out=[..]`
/// (`ctx` is the draft coverage before materialize; ` end=<reason>` when the request ended).
pub fn format_row(r: &RowReport) -> String {
    let mut s = format!(
        "{} F={} ctx={}+{} P={} d={} A={} L={} N={} out={}",
        r.id,
        r.frontier,
        r.context_before.materialized,
        r.context_before.pending,
        r.proposed.len(),
        list(&r.proposed),
        r.accepted,
        r.licensed.len(),
        r.committed,
        list(&r.licensed[..r.committed]),
    );
    if let Some(f) = r.finish {
        s.push_str(&format!(" end={f}"));
    }
    s
}

/// The trace lines of one step: one `admit` line per admission, then `round <n> | <row>` for
/// the first row and `          | <row>` for the others.
pub fn format_step(step: &StepReport) -> Vec<String> {
    let mut lines = Vec::new();
    for a in &step.admitted {
        lines.push(format!(
            "admit {}: prompt {} tokens, first token {}",
            a.id, a.prompt_len, a.anchor
        ));
    }
    for (i, r) in step.rows.iter().enumerate() {
        let head = if i == 0 {
            format!("round {:>4}", step.round)
        } else {
            " ".repeat(10)
        };
        lines.push(format!("{head} | {}", format_row(r)));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflash_engine::{Coverage, FinishReason, RequestId};

    #[test]
    fn trace_line_names_every_quantity_of_the_round() {
        let r = RowReport {
            id: RequestId(3),
            frontier: 12,
            context_before: Coverage {
                materialized: 9,
                pending: 3,
            },
            anchor: 7,
            proposed: vec![4, 5, 6],
            accepted: 1,
            licensed: vec![4, 8],
            committed: 2,
            finish: Some(FinishReason::StopToken(8)),
        };
        assert_eq!(
            format_row(&r),
            "r3 F=12 ctx=9+3 P=3 d=[4 5 6] A=1 L=2 N=2 out=[4 8] end=stop token 8"
        );
        let step = StepReport {
            round: 5,
            admitted: Vec::new(),
            rows: vec![r.clone(), r],
        };
        let lines = format_step(&step);
        assert!(lines[0].starts_with("round    5 | r3 F=12"));
        assert!(lines[1].starts_with("           | r3"));
    }

    #[test]
    fn the_default_draft_fits_the_default_target() {
        let spec = draft_spec(DraftBackend::DFlash2);
        let g = target_geometry();
        assert_eq!(spec.hidden as usize, g.hidden);
        assert_eq!(spec.vocab_rows as usize, g.vocab_rows);
        assert!(
            spec.target_layer_ids
                .iter()
                .all(|&i| (i as usize) < g.layers())
        );
        assert!((spec.mask_token_id as usize) < g.vocab_rows);
        let prompts = demo_prompts(5, 1);
        assert!(prompts.iter().all(|p| (6..=20).contains(&p.len())));
        assert!(prompts.iter().flatten().all(|&t| t < g.eos_token_id));
    }
}
