//! Parse and validate DFlash / DFlash2 draft configs, the Qwen3.5 target fields the draft
//! needs, and the engine's startup options; derive the geometry and memory sizes.
//!
//! No tensors here: this crate turns JSON and a handful of options into checked numbers.
//!
//! ```
//! use dflash_config::{examples, Backend, DraftConfig, ParseMode, StartupOptions, TargetTextConfig};
//!
//! let draft = DraftConfig::from_json_str(examples::OFFICIAL_27B_DFLASH2_DRAFT, ParseMode::Strict)?;
//! let target = TargetTextConfig::from_json_str(examples::QWEN35_27B_TARGET)?
//!     .with_public_vocab_size(examples::QWEN35_PUBLIC_VOCAB_SIZE)?;
//! let geometry = dflash_config::validate_pair(&draft.value, &target)?;
//! assert_eq!(geometry.ring_image_bytes, 40 << 20);
//!
//! let startup = StartupOptions { concurrency: 4, ..StartupOptions::new(Backend::DFlash2, 7) }
//!     .validate(&geometry)?;
//! assert_eq!(startup.block_width, 8);
//! # Ok::<(), dflash_config::ConfigError>(())
//! ```
//!
//! Flow: [`DraftConfig::from_json_str`] and [`TargetTextConfig::from_json_str`] parse each file
//! on its own (a draft config's fields are classified by one table, [`draft_field_class`]:
//! parsed, harmless, math-changing and refused unless neutral, or unknown and returned in the
//! [`Parsed`] report with the parser's [`ConfigNote`]s); [`validate_pair`] cross-checks them
//! and returns the [`Geometry`]; [`StartupOptions::validate`] checks the startup choices
//! against that geometry. Every failure is a [`ConfigError`] that names the JSON path (or
//! `startup.<option>`) and what was expected. [`check_temperature`] is the one temperature
//! rule of every crate and tool. Nothing in this crate panics on any input.

mod draft;
mod error;
pub mod examples;
mod fields;
mod geometry;
mod json;
mod startup;
mod target;
mod temperature;

pub use draft::{
    AttentionType, Backend, DFlash2Params, DraftConfig, MAX_DRAFT_LAYERS, TargetLayerIdsSource,
    legacy_target_layer_ids,
};
pub use error::{ConfigError, Result};
pub use fields::{FieldClass, Neutral, draft_field_class};
pub use geometry::{Geometry, LayerKind, TransientSizes, validate_pair};
pub use json::{ConfigNote, ParseMode, Parsed, UnknownField};
pub use startup::{
    MAX_CONCURRENCY, MAX_DRAFT_COUNT, MAX_TREE_NODES, ProposalHead, Startup, StartupOptions,
};
pub use target::{TargetTextConfig, count_tokenizer_vocab};
pub use temperature::{TEMPERATURE_RULE, check_temperature, is_valid_temperature};
