//! `dflash-engine`: the DFlash round transaction and the boundary to the embedding engine's
//! target model.
//!
//! - [`target`]: the [`Target`] trait a real engine implements for its Qwen3.5 (prefill with
//!   feature capture, batched verify with per-column records, commit N, fork, checkpoint,
//!   restore, release) and its typed errors.

pub mod target;

pub use target::{
    Accepted, Commit, PrefillOutput, SeqHandle, Target, TargetCheckpoint, TargetError, TargetInfo,
    VerifyBatch, VerifyOutputs, VerifyRow,
};
