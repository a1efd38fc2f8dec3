//! The trained pair: a small Qwen3.5-style hybrid target trained on real text and a DFlash
//! and a DFlash2 draft trained for it, committed under `crates/dflash-testkit/trained/` and
//! embedded in this crate, so that the main job and the end-to-end tests see real
//! acceptances (a random draft accepts almost nothing, which hides errors in feature offsets,
//! layer ids, positions or the block layout).
//!
//! How they were made: `tools/train/train.py` (PyTorch, CPU, fixed seed; [`MADE_BY`] holds
//! the exact command and versions, `tools/train/README.md` the stages and the corpus, the
//! docstrings of the Python standard library under the PSF license).
//!
//! The vocabulary is byte-level: ids `0..256` are bytes, [`EOS`] ends a document, rows
//! `257..320` are padding (never real tokens; [`MASK_TOKEN`] is one of them). [`encode`] and
//! [`decode`] convert between text and ids.
//!
//! [`REFERENCE`] holds values the training tool exported on a few fixed held-out inputs (the
//! target's last logits and captured features, each draft's greedy proposals with their
//! decision margins); the test `trained_checkpoints` checks the Rust forward against them,
//! two separate implementations of the same mathematics.

use std::path::Path;

use dflash_config::Backend as DraftBackend;

use crate::error::{Result, TestkitError};
use crate::geometry::{LayerKind, TargetGeometry};

/// The target's `config.json` (Qwen3.5 layout).
pub const TARGET_CONFIG: &str = include_str!("../trained/target/config.json");
/// The target's `model.safetensors` (BF16, real Qwen3.5 tensor names).
pub const TARGET_WEIGHTS: &[u8] = include_bytes!("../trained/target/model.safetensors");
/// The DFlash draft's `config.json`.
pub const DFLASH_CONFIG: &str = include_str!("../trained/dflash/config.json");
/// The DFlash draft's `model.safetensors` (BF16, published names).
pub const DFLASH_WEIGHTS: &[u8] = include_bytes!("../trained/dflash/model.safetensors");
/// The DFlash2 draft's `config.json`.
pub const DFLASH2_CONFIG: &str = include_str!("../trained/dflash2/config.json");
/// The DFlash2 draft's `model.safetensors` (BF16, published names).
pub const DFLASH2_WEIGHTS: &[u8] = include_bytes!("../trained/dflash2/model.safetensors");
/// Values exported by the training tool for the independence check (safetensors).
pub const REFERENCE: &[u8] = include_bytes!("../trained/reference.safetensors");
/// How the checkpoints were made: the command, seed and tool versions (one line).
pub const MADE_BY: &str = include_str!("../trained/MADE_BY");

/// Public vocabulary: 256 bytes and [`EOS`].
pub const PUBLIC_VOCAB: usize = 257;
/// End of a document (the drafts' training stream put it between docstrings).
pub const EOS: u32 = 256;
/// The drafts' mask token: a padding row of the target's embedding.
pub const MASK_TOKEN: u32 = 300;
/// The target block ids whose residuals the drafts condition on (recorded order).
pub const CAPTURE_IDS: [u32; 3] = [0, 2, 3];
/// The block width the drafts were trained with (anchor + 7 masks): K = 7.
pub const TRAINED_K: u32 = 7;
/// Positions of the training sequences: prompts plus outputs beyond this run past what the
/// models saw (still correct, less predictable).
pub const TRAINED_POSITIONS: usize = 128;

/// The trained target's geometry (the content of [`TARGET_CONFIG`], checked by a test).
pub fn target_geometry() -> TargetGeometry {
    TargetGeometry {
        hidden: 128,
        intermediate: 384,
        layer_types: vec![
            LayerKind::LinearAttention,
            LayerKind::LinearAttention,
            LayerKind::LinearAttention,
            LayerKind::FullAttention,
        ],
        attn_heads: 4,
        kv_heads: 2,
        head_dim: 32,
        partial_rotary_factor: 0.25,
        rope_theta: 10000.0,
        linear_key_heads: 2,
        linear_value_heads: 4,
        linear_key_dim: 32,
        linear_value_dim: 32,
        conv_kernel: 4,
        vocab_rows: 320,
        public_vocab: PUBLIC_VOCAB,
        rms_eps: 1e-6,
        max_positions: 4096,
        eos_token_id: EOS,
    }
}

/// The committed draft `config.json` of `backend`.
pub fn draft_config(backend: DraftBackend) -> &'static str {
    match backend {
        DraftBackend::DFlash => DFLASH_CONFIG,
        DraftBackend::DFlash2 => DFLASH2_CONFIG,
    }
}

/// The committed draft `model.safetensors` of `backend`.
pub fn draft_weights(backend: DraftBackend) -> &'static [u8] {
    match backend {
        DraftBackend::DFlash => DFLASH_WEIGHTS,
        DraftBackend::DFlash2 => DFLASH2_WEIGHTS,
    }
}

fn write(path: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::write(path, bytes).map_err(|source| TestkitError::Io {
        path: path.to_owned(),
        source,
    })
}

fn create(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|source| TestkitError::Io {
        path: dir.to_owned(),
        source,
    })
}

/// Write the trained target (`config.json`, `model.safetensors`) into `dir` (created if
/// missing), loadable by [`crate::ReferenceTarget::load`] with [`PUBLIC_VOCAB`].
pub fn write_target(dir: &Path) -> Result<()> {
    create(dir)?;
    write(&dir.join("config.json"), TARGET_CONFIG.as_bytes())?;
    write(&dir.join("model.safetensors"), TARGET_WEIGHTS)
}

/// Write the trained draft of `backend` (`config.json`, `model.safetensors`) into `dir`
/// (created if missing), in the published layout.
pub fn write_draft(dir: &Path, backend: DraftBackend) -> Result<()> {
    create(dir)?;
    write(&dir.join("config.json"), draft_config(backend).as_bytes())?;
    write(&dir.join("model.safetensors"), draft_weights(backend))
}

/// The ids of `text`: its UTF-8 bytes.
pub fn encode(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

/// The text of `tokens`: bytes decoded as UTF-8 (invalid sequences as U+FFFD), [`EOS`] as
/// nothing, padding ids (never produced by decoding, which is confined to the public
/// vocabulary) as U+FFFD.
pub fn decode(tokens: &[u32]) -> String {
    let mut bytes = Vec::with_capacity(tokens.len());
    for &t in tokens {
        match u8::try_from(t) {
            Ok(b) => bytes.push(b),
            Err(_) if t == EOS => {}
            Err(_) => bytes.extend_from_slice("\u{fffd}".as_bytes()),
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_geometry_is_the_committed_config() {
        let doc: serde_json::Value = serde_json::from_str(TARGET_CONFIG).expect("JSON");
        let (g, tied) = TargetGeometry::from_config_json(&doc, PUBLIC_VOCAB).expect("config");
        assert_eq!(g, target_geometry());
        assert!(!tied);
        assert!((MASK_TOKEN as usize) >= PUBLIC_VOCAB && (MASK_TOKEN as usize) < g.vocab_rows);
    }

    #[test]
    fn text_round_trips_through_byte_ids() {
        let s = "Return the sum, or None.\n\u{e9}";
        assert_eq!(decode(&encode(s)), s);
        assert_eq!(encode("ab"), vec![97, 98]);
        assert_eq!(decode(&[104, 105, EOS]), "hi");
        assert_eq!(decode(&[104, 301]), "h\u{fffd}");
    }

    #[test]
    fn the_committed_weights_fit_the_size_limit() {
        let total = TARGET_WEIGHTS.len() + DFLASH_WEIGHTS.len() + DFLASH2_WEIGHTS.len();
        assert!(total <= 16 << 20, "{total} bytes of weights");
        assert!(MADE_BY.contains("tools/train/train.py") && MADE_BY.contains("seed"));
    }
}
