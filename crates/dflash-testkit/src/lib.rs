//! `dflash-testkit`: synthetic checkpoints and a small reference Qwen3.5-style hybrid target.
//!
//! - [`ReferenceTarget`]: a host implementation of [`dflash_engine::Target`] (Gated DeltaNet
//!   and gated full-attention blocks, zero-centred RMSNorm, SwiGLU, padded vocabulary), loaded
//!   from a Hugging Face style directory with the real Qwen3.5 tensor names. It is the test
//!   oracle and CI target of the round transaction.
//! - [`fixtures::write_reference_target`]: writes such a directory with random BF16 weights,
//!   deterministically from a seed.
//! - [`trained`]: the committed trained pair (a target trained on real text, a DFlash and a
//!   DFlash2 draft trained for it), embedded, with the training tool's reference values.

pub mod error;
pub mod fixtures;
pub mod geometry;
pub mod reference;
pub mod trained;

pub use error::{Result, TestkitError};
pub use geometry::{LayerKind, TargetGeometry, hybrid_layer_types};
pub use reference::{ReferenceCheckpoint, ReferenceTarget, TEXT_PREFIX};
