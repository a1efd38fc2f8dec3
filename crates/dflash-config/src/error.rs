//! The crate's one error type.
//!
//! Every variant carries `path`: where the offending value sits. For a JSON document the path is
//! written the way a reader would look it up (`dflash_config.target_layer_ids[3]`,
//! `text_config.hidden_size`); the empty path is the document itself. Startup options use the
//! prefix `startup.` (`startup.draft_count`), and a pair check names the draft field it found
//! wrong. Variants also carry what was expected and what was found, so the message alone tells a
//! user what to change.

use thiserror::Error;

/// Everything that can be wrong with a draft config, a target config, a tokenizer file, the
/// pair of them, or the startup options.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The text is not JSON (syntax error, truncated text, a number outside the f64 range).
    #[error("invalid JSON at line {line}, column {column}: {message}")]
    Json {
        /// Always empty: the document itself.
        path: String,
        /// 1-based line of the syntax error.
        line: usize,
        /// 1-based column of the syntax error.
        column: usize,
        /// The JSON parser's description (without its position, which `line` and `column`
        /// give).
        message: String,
    },

    /// A required field is absent (or `null` where a value is required).
    #[error("`{path}`: missing; expected {expected}")]
    Missing {
        /// Where the field should be.
        path: String,
        /// What should be there, and why it is required.
        expected: String,
    },

    /// A field has the wrong JSON type (a string where a number belongs, a float where an
    /// integer belongs, ...).
    #[error("{}: expected {expected}, found {found}", shown(path))]
    WrongType {
        /// The field.
        path: String,
        /// The JSON type required.
        expected: &'static str,
        /// A short rendering of the value found.
        found: String,
    },

    /// A value has the right type but lies outside the accepted range (zero heads, a negative
    /// count, K = 16, a number that does not fit 32 bits, ...).
    #[error("`{path}`: expected {expected}, found {found}")]
    OutOfRange {
        /// The field.
        path: String,
        /// The accepted range, in words.
        expected: String,
        /// The value found.
        found: String,
    },

    /// `architectures` does not name exactly one supported draft class.
    #[error("`{path}`: expected \"DFlashDraftModel\" or \"DFlash2DraftModel\", found {found}")]
    Architecture {
        /// `architectures` or `architectures[i]`.
        path: String,
        /// The value found.
        found: String,
    },

    /// `model_type` is not `"qwen3"`.
    #[error("`{path}`: expected \"qwen3\", found {found}")]
    ModelType {
        /// `model_type`.
        path: String,
        /// The value found.
        found: String,
    },

    /// `hidden_act` is not SiLU (the draft MLP is SwiGLU with SiLU by specification).
    #[error("`{path}`: expected \"silu\", found {found}")]
    Activation {
        /// `hidden_act`.
        path: String,
        /// The value found.
        found: String,
    },

    /// A field that would change the model mathematics is active. The specified draft is
    /// non-causal, bias-free, uncapped and unscaled; computing such a checkpoint as if the field
    /// were absent would silently produce wrong proposals.
    #[error(
        "`{path}`: {found} changes the draft mathematics and is not supported; expected {expected}"
    )]
    UnsupportedFeature {
        /// The field, e.g. `is_causal`, `dflash_config.causal`, `attention_bias`.
        path: String,
        /// The neutral values accepted.
        expected: &'static str,
        /// The active value found.
        found: String,
    },

    /// A value the format can express but the specified ops do not implement (a convolution
    /// with other than two taps, a group width other than 16, a selector top-k other than 16,
    /// a RoPE type other than default).
    #[error(
        "`{path}`: expected {expected} (the only geometry the specified ops implement), found {found}"
    )]
    Unsupported {
        /// The field.
        path: String,
        /// The supported value.
        expected: String,
        /// The value found.
        found: String,
    },

    /// The query head count is not a multiple of the KV head count (GQA maps query head h to KV
    /// head h / (Hq/Hkv)).
    #[error("`{path}`: {q_heads} query heads are not a multiple of {kv_heads} KV heads")]
    HeadsNotDivisible {
        /// `num_attention_heads`.
        path: String,
        /// Query heads found.
        q_heads: u32,
        /// KV heads found.
        kv_heads: u32,
    },

    /// The head dimension is odd (split-half RoPE pairs channel i with i + D/2).
    #[error("`{path}`: expected an even head dimension, found {found}")]
    OddHeadDim {
        /// `head_dim`.
        path: String,
        /// The value found.
        found: u32,
    },

    /// A float that must be finite and positive (norm epsilon, RoPE theta) is not.
    #[error("`{path}`: expected a finite number > 0, found {found}")]
    NonPositiveFloat {
        /// `rms_norm_eps`, `rope_theta` or `rope_parameters.rope_theta`.
        path: String,
        /// The value found.
        found: f64,
    },

    /// `layer_types` does not have one entry per draft layer.
    #[error("`{path}`: expected {expected} entries (num_hidden_layers), found {found}")]
    LayerTypesLength {
        /// `layer_types`.
        path: String,
        /// `num_hidden_layers`.
        expected: usize,
        /// Entries found.
        found: usize,
    },

    /// A `layer_types` entry is neither `"full_attention"` nor `"sliding_attention"`.
    #[error("`{path}`: expected \"full_attention\" or \"sliding_attention\", found {found}")]
    UnknownLayerType {
        /// `layer_types[i]`.
        path: String,
        /// The value found.
        found: String,
    },

    /// `target_layer_ids` is present but empty.
    #[error("`{path}`: expected at least one target block id, found an empty list")]
    EmptyTargetLayerIds {
        /// `dflash_config.target_layer_ids`.
        path: String,
    },

    /// A target block id is not below the target's layer count.
    #[error(
        "`{path}`: expected a block id below {num_target_layers} (target layers), found {found}"
    )]
    TargetLayerIdOutOfRange {
        /// `dflash_config.target_layer_ids[i]`.
        path: String,
        /// The target's decoder block count.
        num_target_layers: u32,
        /// The id found.
        found: u32,
    },

    /// A target block id appears twice.
    #[error(
        "`{path}`: block id {found} already appears at index {first_index}; expected distinct ids"
    )]
    DuplicateTargetLayerId {
        /// `dflash_config.target_layer_ids[i]` of the second occurrence.
        path: String,
        /// The repeated id.
        found: u32,
        /// Index of its first occurrence.
        first_index: usize,
    },

    /// The mask token id is not below the target's embedding rows.
    #[error(
        "`{path}`: expected a token id below {vocab_rows} (target embedding rows), found {found}"
    )]
    MaskTokenOutOfRange {
        /// `dflash_config.mask_token_id` or `startup.mask_token_id`.
        path: String,
        /// The target's embedding row count.
        vocab_rows: u32,
        /// The id found.
        found: u32,
    },

    /// No mask token id: the config has `null` (or none) and no startup override was given.
    #[error("`{path}`: the config gives no mask token id; expected a startup mask token id")]
    MaskTokenUnknown {
        /// `startup.mask_token_id`.
        path: String,
    },

    /// The DFlash2 convolution group width does not divide the hidden width.
    #[error("`{path}`: group width {group} does not divide the hidden width {hidden}")]
    ConvGroupNotDividing {
        /// `dflash_config.conv_group_size`.
        path: String,
        /// Group width.
        group: u32,
        /// Hidden width H (from the target).
        hidden: u32,
    },

    /// A draft field disagrees with the target it is paired with (hidden width, vocabulary
    /// rows, target layer count).
    #[error("`{path}`: the draft says {draft}, the target says {target}")]
    PairMismatch {
        /// The draft field, e.g. `hidden_size`, `vocab_size`, `dflash_config.num_target_layers`.
        path: String,
        /// Draft value.
        draft: u64,
        /// Target value.
        target: u64,
    },

    /// The same quantity is given twice with different values (e.g. `rope_theta` and
    /// `rope_parameters.rope_theta`, top-level and nested `block_size`, a config mask token and a
    /// different startup override).
    #[error("`{path}` = {found} contradicts `{other_path}` = {other}")]
    Conflict {
        /// One place.
        path: String,
        /// Its value.
        found: String,
        /// The other place.
        other_path: String,
        /// Its value.
        other: String,
    },

    /// Strict mode: the document has fields this crate does not know.
    #[error("`{path}`: unknown field (strict mode); all unknown fields: {all:?}")]
    UnknownFields {
        /// The first unknown field.
        path: String,
        /// Paths of every unknown field, in document order.
        all: Vec<String>,
    },

    /// The public vocabulary size is needed (proposal heads, target verification) but was never
    /// given, neither explicitly nor counted from a `tokenizer.json`.
    #[error(
        "`{path}`: the public vocabulary size is unknown; expected it from the caller or a tokenizer.json"
    )]
    PublicVocabUnknown {
        /// `public_vocab_size`.
        path: String,
    },

    /// The startup backend differs from the one the checkpoint's `architectures` names.
    #[error("`{path}`: the checkpoint is {expected:?}, the startup options ask for {found:?}")]
    BackendMismatch {
        /// `startup.backend`.
        path: String,
        /// The checkpoint's backend.
        expected: crate::Backend,
        /// The requested backend.
        found: crate::Backend,
    },

    /// Tree verification was requested with the DFlash backend; trees are DFlash2 only.
    #[error("`{path}`: tree verification requires DFlash2, found {found} nodes with DFlash")]
    TreeNeedsDFlash2 {
        /// `startup.tree_nodes`.
        path: String,
        /// The node count requested.
        found: u32,
    },

    /// A sampling temperature is NaN, infinite or negative (the rule: finite and >= 0, 0 is
    /// greedy; [`crate::check_temperature`]).
    #[error("`{path}`: expected {rule}, found {found}", rule = crate::TEMPERATURE_RULE)]
    InvalidTemperature {
        /// The option, flag or field as the user wrote it (`--temperature`, `temperature`).
        path: String,
        /// The value found (`NaN`, `inf`, `-1`).
        found: String,
    },

    /// A derived size does not fit in 64 bits (only reachable with absurd dimensions).
    #[error("`{path}`: derived size overflows 64 bits")]
    SizeOverflow {
        /// The derived quantity, e.g. `geometry.ring_image_bytes`.
        path: String,
    },
}

/// A path as messages show it: in backticks, or "the document" for the root.
fn shown(path: &str) -> String {
    if path.is_empty() {
        "the document".to_owned()
    } else {
        format!("`{path}`")
    }
}

impl ConfigError {
    /// Where the error is: a JSON path, `startup.<option>`, or the empty path for the document.
    pub fn path(&self) -> &str {
        match self {
            Self::Json { path, .. }
            | Self::Missing { path, .. }
            | Self::WrongType { path, .. }
            | Self::OutOfRange { path, .. }
            | Self::Architecture { path, .. }
            | Self::ModelType { path, .. }
            | Self::Activation { path, .. }
            | Self::UnsupportedFeature { path, .. }
            | Self::Unsupported { path, .. }
            | Self::HeadsNotDivisible { path, .. }
            | Self::OddHeadDim { path, .. }
            | Self::NonPositiveFloat { path, .. }
            | Self::LayerTypesLength { path, .. }
            | Self::UnknownLayerType { path, .. }
            | Self::EmptyTargetLayerIds { path }
            | Self::TargetLayerIdOutOfRange { path, .. }
            | Self::DuplicateTargetLayerId { path, .. }
            | Self::MaskTokenOutOfRange { path, .. }
            | Self::MaskTokenUnknown { path }
            | Self::ConvGroupNotDividing { path, .. }
            | Self::PairMismatch { path, .. }
            | Self::Conflict { path, .. }
            | Self::UnknownFields { path, .. }
            | Self::PublicVocabUnknown { path }
            | Self::BackendMismatch { path, .. }
            | Self::TreeNeedsDFlash2 { path, .. }
            | Self::InvalidTemperature { path, .. }
            | Self::SizeOverflow { path } => path,
        }
    }
}

/// Shorthand used throughout the crate.
pub type Result<T, E = ConfigError> = std::result::Result<T, E>;
