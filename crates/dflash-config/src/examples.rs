//! The official geometries as bundled example configs (see `data/README.md` in this crate).
//!
//! Each draft comes in the newer nested layout and the older layout; both parse to the same
//! [`crate::DraftConfig`].
//! The target configs are the matching Qwen3.5 `config.json` files (multimodal layout, with
//! `text_config`). Other crates' tests and the `dflash` binary use these.

/// Official 35B-A3B DFlash draft `config.json`, nested `dflash_config` layout.
pub const OFFICIAL_35B_DFLASH_DRAFT: &str =
    include_str!("../data/qwen3.5-35b-a3b-dflash.draft.nested.json");
/// Official 35B-A3B DFlash draft `config.json`, older layout (top-level `block_size`).
pub const OFFICIAL_35B_DFLASH_DRAFT_LEGACY: &str =
    include_str!("../data/qwen3.5-35b-a3b-dflash.draft.legacy.json");
/// Official 27B DFlash2 draft `config.json`, nested `dflash_config` layout.
pub const OFFICIAL_27B_DFLASH2_DRAFT: &str =
    include_str!("../data/qwen3.5-27b-dflash2.draft.nested.json");
/// Official 27B DFlash2 draft `config.json`, older layout (top-level `block_size`).
pub const OFFICIAL_27B_DFLASH2_DRAFT_LEGACY: &str =
    include_str!("../data/qwen3.5-27b-dflash2.draft.legacy.json");
/// Qwen3.5-35B-A3B target `config.json` (H 2048, 40 layers, 248320 rows).
pub const QWEN35_35B_A3B_TARGET: &str = include_str!("../data/qwen3.5-35b-a3b.target.json");
/// Qwen3.5-27B target `config.json` (H 5120, 64 layers, 248320 rows).
pub const QWEN35_27B_TARGET: &str = include_str!("../data/qwen3.5-27b.target.json");
/// A tiny synthetic `tokenizer.json` whose counted public vocabulary is
/// [`TINY_TOKENIZER_VOCAB_SIZE`].
pub const TINY_TOKENIZER: &str = include_str!("../data/tiny.tokenizer.json");
/// The token count of [`TINY_TOKENIZER`] (ids 0..=11).
pub const TINY_TOKENIZER_VOCAB_SIZE: u32 = 12;
/// Qwen3.5's public vocabulary size (248044 BPE ranks + 33 added tokens); its embedding has
/// 248320 rows.
pub const QWEN35_PUBLIC_VOCAB_SIZE: u32 = 248_077;
/// Qwen3.5's mask token id as used by the published DFlash2 config.
pub const QWEN35_MASK_TOKEN_ID: u32 = 248_070;
