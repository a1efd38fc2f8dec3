//! `dflash-draft`: the DFlash / DFlash2 draft model.
//!
//! - [`weights`]: open a Hugging Face checkpoint (memory-mapped safetensors, single or
//!   sharded), check every tensor against the config, bind the logical roles on a backend.
//! - [`DraftModel::load_reported`]: load with the config parsed in a chosen
//!   [`dflash_config::ParseMode`], errors naming the config file, and the [`ConfigReport`]
//!   (unknown fields, the parser's notes) returned with the model.
//! - [`DraftModel`]: context prefill (feature projection, context norm and each layer's context
//!   K/V into [`dflash_context`] storage; no prompt token runs through the residual/MLP
//!   stack) and the block forward, written once over [`dflash_ops::Backend`] so the same code
//!   runs on the CPU reference and on CUDA.
//! - [`Workspace`]: every buffer of a round, planned once for (rows, K, head); the forward
//!   allocates nothing and reads all per-round data from device buffers (CUDA-graph safe).
//! - [`TargetParts`]: the target's embedding and proposal head, lent by the caller per call.
//! - [`synthetic`]: synthetic checkpoints and target parts for tests and benchmarks.
//! - [`tool`]: the `propose` inspection tool's library side.
//! - [`tree`]: the DFlash2 tree builder (host side): a proposal tree around the selector's
//!   chain, its shape fixed from the lattice before any draw, children drawn without
//!   replacement, laid out for `tree_accept`.
//! - `conformance_cases` (feature `conformance`): whole-block CPU-vs-device conformance cases.
//!
//! A round, per request with frontier F and anchor a (context covering `[0, F)`):
//! `x = embed([a, MASK x K])` at positions `F..F+K`, the draft layers, the final norm of the
//! K mask columns and the proposal head. DFlash proposes `argmax` per column (q is a point
//! mass); DFlash2 takes the unary top-16 per column and walks the conditional selector,
//! keeping q and the candidate ids. The anchor column is never sampled. Changing K changes
//! the block width W = K + 1 and can change every proposal (attention is non-causal): no code
//! here assumes a shorter block is a prefix of a longer one.
//!
//! ```
//! use dflash_context::{Capacity, ContextStore};
//! use dflash_draft::{synthetic, BindOptions, DraftModel, HeadParts, RowRequest, TargetParts,
//!     Workspace, WorkspaceSpec, HeadShape};
//! use dflash_ops::{Backend, proposal_argmax::ProposalHead};
//!
//! let dir = std::env::temp_dir().join(format!("dflash-draft-doc-{}", std::process::id()));
//! let spec = synthetic::TinySpec::dflash();
//! let (cfg, target) = synthetic::tiny_pair(&spec);
//! let g = synthetic::write_checkpoint(&dir, &cfg, &target, 7, synthetic::Layout::Single)?;
//! let be = Backend::cpu();
//! let model = DraftModel::load(&be, &dir, &target, &BindOptions::default())?;
//! let mut store = ContextStore::new(be.clone(), model.context_geometry()?, Capacity::new(1, 64, 8))?;
//! let h = store.admit(64)?;
//! let feats = synthetic::features(10, g.feature_width as usize, 1);
//! model.prefill(&mut store, h, be.upload(&feats)?)?;
//! let parts = synthetic::target_parts(80, 32, 3);
//! let (emb, head) = (be.upload(&parts.embedding)?, be.upload(&parts.output_head)?);
//! let tp = TargetParts { vocab_rows: 80, public_vocab: 72, embedding: &emb,
//!     head: HeadParts::Full { output_head: &head } };
//! let ws_spec = WorkspaceSpec { rows: 1, draft_count: 3, mask_token_id: 75,
//!     head: HeadShape { kind: ProposalHead::Full, rows: 80, public_vocab: 72 } };
//! let mut ws = Workspace::new(&model, &store, &ws_spec)?;
//! let out = model.propose(&store, &[RowRequest { handle: h, anchor: 5, usable: 3,
//!     temperature: 0.0, seed: 1 }], &tp, &mut ws)?;
//! assert_eq!(out[0].tokens.len(), 3);
//! assert!(out[0].tokens.iter().all(|&t| (0..72).contains(&t)));
//! # std::fs::remove_dir_all(&dir).ok();
//! # Ok::<(), dflash_draft::DraftError>(())
//! ```

#![deny(missing_docs)]

#[cfg(feature = "conformance")]
mod conformance;
mod error;
mod load;
mod model;
pub mod synthetic;
mod target;
pub mod tool;
pub mod tree;
pub mod weights;

#[cfg(feature = "conformance")]
pub use conformance::conformance_cases;
pub use error::{DraftError, Result};
pub use load::{ConfigReport, config_file_error, parse_draft_config};
pub use model::{
    DraftModel, RowProposal, RowRequest, SelectorBuffers, TOP_K, Workspace, WorkspaceSpec,
};
pub use target::{HeadParts, HeadShape, TargetParts};
pub use weights::{BindOptions, Checkpoint, DraftWeights, RoleBinding};
