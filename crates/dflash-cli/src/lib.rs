//! The embedded default of the `dflash` binary, shared with the end-to-end tests: the trained
//! pair of `dflash-testkit` ([`dflash_testkit::trained`]: a small Qwen3.5-style hybrid target
//! trained on real text, a DFlash and a DFlash2 draft trained for it), written into a scratch
//! directory and loaded on a backend; the built-in prompts (text never used in training); and
//! the readable per-round trace.
//!
//! The pairing: the target is [`target_geometry`] (H 128, 4 blocks = 3 Gated DeltaNet + 1
//! gated attention, byte-level vocabulary of 257 public ids in 320 rows, EOS 256); the drafts
//! have the target's hidden width and vocabulary, two layers (DFlash: a sliding-window layer
//! with S = 32 and a full layer; DFlash2: two sliding-window layers), 4 query / 2 KV heads of
//! 32, MLP width 384, captured target blocks [`CAPTURE_IDS`] and mask token [`MASK_TOKEN`] (a
//! padding row of the target's embedding). A draft config given on purpose
//! ([`Fixture::write_config`]) gets synthetic random weights instead.
//!
//! [`shadow::ShadowProposer`] is a proposer over a private copy of the target (the oracle the
//! tests and `dflash --oracle` use to drive long acceptances). [`args`] is the `dflash` command
//! line and its run plan, checked before anything runs; [`check_run_size`] bounds the prompts
//! and `--max-new` by the run's memory plan.

#![deny(missing_docs)]

pub mod args;
pub mod shadow;

use std::path::{Path, PathBuf};

use dflash_config::{AttentionType, Backend as DraftBackend, ParseMode, TargetTextConfig};
use dflash_draft::synthetic::{self, Layout, TinySpec};
use dflash_draft::{BindOptions, DraftError, DraftModel};
use dflash_engine::{DraftHead, DraftTargetParts, EngineError, RowReport, StepReport};
use dflash_ops::{Backend, OpsError, bf16};
use dflash_testkit::trained;
use dflash_testkit::{ReferenceTarget, TEXT_PREFIX, TargetGeometry, TestkitError};

pub use dflash_testkit::trained::{CAPTURE_IDS, MASK_TOKEN, decode, encode};

/// Seed of a synthetic (random) draft's weights ([`Fixture::write_config`]).
pub const DRAFT_SEED: u64 = 0x0dfa_2002;

/// Everything that can go wrong in the `dflash` command's library: a refused flag or file,
/// a run too large for its memory plan, building the embedded default.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// A command-line flag is unknown, repeated, missing its value or out of range.
    #[error("`{flag}`: expected {expected}, found {found}")]
    Flag {
        /// The flag as the user typed it (`--k`, `--temperature`).
        flag: String,
        /// What is accepted.
        expected: String,
        /// What was given.
        found: String,
    },
    /// A startup option refused by the config crate, reported under the flag that set it.
    #[error("{}", startup_message(flag, source))]
    Startup {
        /// The flag (`--backend`, `--mask-token-id`, `--k`, `--b`).
        flag: &'static str,
        /// The refusal, whose path (`startup.<option>`) the message replaces by the flag.
        source: dflash_config::ConfigError,
    },
    /// A file named on the command line could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// `--max-new` exceeds what the reference target can hold after the longest prompt.
    #[error(
        "`--max-new`: expected 1..={max} (the reference target holds {positions} positions and a prompt has up to {MAX_PROMPT_TOKENS} tokens), found {found}"
    )]
    MaxNewTooLarge {
        /// The value given.
        found: usize,
        /// The largest accepted value.
        max: usize,
        /// The target's positions.
        positions: usize,
    },
    /// `--prompts` asks for more requests than the run's host memory plan admits.
    #[error(
        "`--prompts`: expected 1..={max} (the run's memory plan admits {max} requests of up to {MAX_PROMPT_TOKENS} + {max_new} tokens, {per_request} bytes each, in its {budget}-byte host budget), found {found}"
    )]
    TooManyPrompts {
        /// The value given.
        found: usize,
        /// The largest accepted value for this `--max-new`.
        max: usize,
        /// `--max-new`.
        max_new: usize,
        /// Host bytes one request may hold ([`request_host_bytes`]).
        per_request: u64,
        /// [`HOST_MEMORY_BUDGET`].
        budget: u64,
    },
    /// A `--prompt` text is empty or longer than [`MAX_PROMPT_TOKENS`] bytes.
    #[error(
        "`--prompt`: expected a text of 1..={MAX_PROMPT_TOKENS} bytes (one token per byte), found {found} bytes"
    )]
    PromptTooLong {
        /// Its length in bytes.
        found: usize,
    },
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
    /// The draft could not be written or loaded.
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

fn startup_message(flag: &str, source: &dflash_config::ConfigError) -> String {
    let text = source.to_string();
    let path = format!("`{}`", source.path());
    text.replacen(&path, &format!("`{flag}`"), 1)
}

impl HarnessError {
    /// The `dflash` binary's exit status for this error: 2 when a flag or a file was refused
    /// before anything ran, 1 when building or running the job failed.
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Flag { .. }
            | Self::Startup { .. }
            | Self::Read { .. }
            | Self::MaxNewTooLarge { .. }
            | Self::TooManyPrompts { .. }
            | Self::PromptTooLong { .. }
            | Self::Draft(DraftError::ConfigFile { .. }) => 2,
            _ => 1,
        }
    }
}

/// The target geometry of the embedded default (the trained target).
pub fn target_geometry() -> TargetGeometry {
    trained::target_geometry()
}

/// The reference target's text config as the draft sees it (H, blocks, rows, EOS, public
/// vocabulary): every draft config of the main job is validated against it.
pub fn target_text_config() -> TargetTextConfig {
    let g = target_geometry();
    TargetTextConfig {
        model_type: None,
        hidden_size: g.hidden as u32,
        num_hidden_layers: g.layers() as u32,
        vocab_size: g.vocab_rows as u32,
        eos_token_ids: vec![g.eos_token_id],
        public_vocab_size: Some(g.public_vocab as u32),
    }
}

/// Tokens (bytes) of the longest prompt, built-in or `--prompt`.
pub const MAX_PROMPT_TOKENS: usize = 256;

/// Host bytes the main job may plan for its requests (prompts, requests, published outputs
/// and the plain-decoding baseline).
pub const HOST_MEMORY_BUDGET: u64 = 1 << 30;

/// Device bytes the main job's engine may plan (`EngineOptions::memory_budget`).
pub const ENGINE_MEMORY_BUDGET: u64 = 1 << 30;

/// Host bytes one request of the main job may hold with a budget of `max_new` tokens: three
/// copies of the request (the demo prompt, the submitted request, the engine's queue entry),
/// each with its prompt of up to [`MAX_PROMPT_TOKENS`] ids, and three copies of the
/// output (the engine's finished record, the collected events, the plain-decoding baseline),
/// each with its vector and map entry; 256 bytes cover allocator rounding.
pub fn request_host_bytes(max_new: usize) -> u64 {
    let request = (std::mem::size_of::<dflash_engine::Request>() + 4 * MAX_PROMPT_TOKENS) as u64;
    let output = 4 * max_new as u64 + 64;
    3 * request + 3 * output + 256
}

/// Check `--prompts` and `--max-new` against what the run can hold: every request (prompt
/// plus budget) within the reference target's positions, and all requests within
/// [`HOST_MEMORY_BUDGET`]. Both must be at least 1.
pub fn check_run_size(prompts: usize, max_new: usize) -> Result<()> {
    let positions = target_geometry().max_positions;
    let max = positions.saturating_sub(MAX_PROMPT_TOKENS);
    if max_new == 0 || max_new > max {
        return Err(HarnessError::MaxNewTooLarge {
            found: max_new,
            max,
            positions,
        });
    }
    let per_request = request_host_bytes(max_new);
    let max_prompts = usize::try_from(HOST_MEMORY_BUDGET / per_request).unwrap_or(usize::MAX);
    if prompts == 0 || prompts > max_prompts {
        return Err(HarnessError::TooManyPrompts {
            found: prompts,
            max: max_prompts,
            max_new,
            per_request,
            budget: HOST_MEMORY_BUDGET,
        });
    }
    Ok(())
}

/// The committed (trained) draft `config.json` of `backend`: the embedded default.
pub fn default_draft_config(backend: DraftBackend) -> &'static str {
    trained::draft_config(backend)
}

/// A synthetic draft spec of `backend` matched to [`TargetGeometry::tiny`] (captured blocks
/// `[1, 4, 6]`, mask token 503), for random-weight fixtures (`cargo xtask fixtures`).
pub fn tiny_draft_spec(backend: DraftBackend) -> TinySpec {
    let g = TargetGeometry::tiny();
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
        target_layer_ids: vec![1, 4, 6],
        target_layers: g.layers() as u32,
        vocab_rows: g.vocab_rows as u32,
        public_vocab: g.public_vocab as u32,
        mask_token_id: 503,
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

/// The embedded default written to disk: the trained target and a draft checkpoint (the
/// trained draft of one backend, or synthetic random weights for any draft config that fits
/// the target), in a scratch directory removed when the fixture is dropped. Everything a run
/// needs can be loaded into memory first and the fixture dropped before the run.
#[derive(Debug)]
pub struct Fixture {
    dir: ScratchDir,
    backend: DraftBackend,
    capture_ids: Vec<u32>,
    random: bool,
}

fn scratch_for(backend: DraftBackend) -> Result<ScratchDir> {
    ScratchDir::new(match backend {
        DraftBackend::DFlash => "dflash",
        DraftBackend::DFlash2 => "dflash2",
    })
}

impl Fixture {
    /// Write the trained target and the trained draft of `backend` ([`default_draft_config`]).
    pub fn write(backend: DraftBackend) -> Result<Self> {
        let dir = scratch_for(backend)?;
        trained::write_target(&dir.path().join("target"))?;
        trained::write_draft(&dir.path().join("draft"), backend)?;
        Ok(Fixture {
            dir,
            backend,
            capture_ids: CAPTURE_IDS.to_vec(),
            random: false,
        })
    }

    /// Write the trained target and a synthetic draft with random weights (seed
    /// [`DRAFT_SEED`]) of the geometry `draft_config_json` describes (validated against
    /// [`target_text_config`]; the config is written verbatim). The target captures the
    /// draft's target block ids. A random draft accepts almost nothing: use it on purpose.
    pub fn write_config(draft_config_json: &str) -> Result<Self> {
        let (draft, _, _) = dflash_draft::parse_draft_config(
            Path::new("the draft config"),
            draft_config_json,
            &target_text_config(),
            ParseMode::Lenient,
        )?;
        let backend = draft.backend;
        let dir = scratch_for(backend)?;
        trained::write_target(&dir.path().join("target"))?;
        synthetic::write_checkpoint(
            &dir.path().join("draft"),
            draft_config_json,
            &target_text_config(),
            DRAFT_SEED,
            Layout::Single,
        )?;
        Ok(Fixture {
            dir,
            backend,
            capture_ids: draft.target_layer_ids,
            random: true,
        })
    }

    /// Whether the draft has synthetic random weights ([`Fixture::write_config`]) rather than
    /// the trained ones.
    pub fn random_draft(&self) -> bool {
        self.random
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
        let ids: Vec<usize> = self.capture_ids.iter().map(|&i| i as usize).collect();
        Ok(ReferenceTarget::load(
            &self.target_dir(),
            &ids,
            target_geometry().public_vocab,
        )?)
    }

    /// Load the draft model on `be`. The config is parsed leniently: it is the one the run
    /// plan already checked in the user's mode, with its unknown fields reported then.
    pub fn draft(&self, be: &Backend) -> Result<DraftModel> {
        let (model, _already_reported) = DraftModel::load_reported(
            be,
            self.draft_dir(),
            &target_text_config(),
            &BindOptions::default(),
            ParseMode::Lenient,
        )?;
        Ok(model)
    }

    /// The target parts the draft borrows (the target's embedding and full output head), read
    /// from the target checkpoint and uploaded to `be`.
    pub fn parts(&self, be: &Backend) -> Result<DraftTargetParts<'static>> {
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
            embedding: be.upload(&embedding)?.into(),
            head: DraftHead::Full {
                output_head: be.upload(&head)?.into(),
            },
        })
    }
}

/// The built-in prompts (`data/prompts.txt`, one a line): docstring-like sentences written
/// for this project, none of them in the training corpus (the training tool checks this).
pub const PROMPTS_TEXT: &str = include_str!("../data/prompts.txt");

/// The built-in prompt texts, in file order.
pub fn prompt_texts() -> Vec<&'static str> {
    PROMPTS_TEXT.lines().filter(|l| !l.is_empty()).collect()
}

/// `count` built-in prompts as token ids, deterministic in `seed`: the texts of
/// [`prompt_texts`] in order starting at `seed % len`; after one pass every repeat is cut to a
/// shorter prefix (at least 8 bytes), so that `count` may exceed the number of texts and still
/// give distinct prompts.
pub fn demo_prompts(count: usize, seed: u64) -> Vec<Vec<u32>> {
    let texts = prompt_texts();
    let n = texts.len().max(1);
    (0..count)
        .map(|i| {
            let k = (seed as usize % n + i) % n;
            let ids = encode(texts.get(k).copied().unwrap_or("Return the"));
            let pass = i / n;
            let keep = ids.len().saturating_sub(5 * pass).max(8).min(ids.len());
            ids[..keep].to_vec()
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
/// A tree round (`--draft-tree-nodes`) lists every node's token in `d` (`P` counts them) and
/// adds ` path=[0 v_1 .. v_A]`, the accepted nodes.
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
    if !r.tree_path.is_empty() {
        let path: Vec<u32> = r.tree_path.iter().map(|&v| v as u32).collect();
        s.push_str(&format!(" path={}", list(&path)));
    }
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
            tree_path: Vec::new(),
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
    fn the_default_drafts_fit_the_default_target() {
        for backend in [DraftBackend::DFlash, DraftBackend::DFlash2] {
            let (draft, geo, _) = dflash_draft::parse_draft_config(
                Path::new("default"),
                default_draft_config(backend),
                &target_text_config(),
                ParseMode::Strict,
            )
            .expect("the committed draft config fits the target");
            assert_eq!(draft.backend, backend);
            assert_eq!(draft.target_layer_ids, CAPTURE_IDS.to_vec());
            assert_eq!(geo.hidden as usize, target_geometry().hidden);
        }
        let g = target_geometry();
        let prompts = demo_prompts(40, 3);
        assert!(
            prompts
                .iter()
                .all(|p| (8..=MAX_PROMPT_TOKENS).contains(&p.len()))
        );
        assert!(prompts.iter().flatten().all(|&t| t < g.eos_token_id));
        let distinct: std::collections::HashSet<_> = prompts.iter().collect();
        assert_eq!(distinct.len(), prompts.len(), "repeats are cut shorter");
        assert_eq!(decode(&demo_prompts(1, 0)[0]), prompt_texts()[0]);
    }
}
