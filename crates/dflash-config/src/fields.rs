//! The one list of draft `config.json` fields, in classes.
//!
//! Every direct field of the document, of `dflash_config` and of `rope_parameters` is one of:
//!
//! - [`FieldClass::Parsed`]: read and validated (identity, geometry, the DFlash / DFlash2
//!   parameters);
//! - [`FieldClass::Harmless`]: an ordinary Hugging Face field with no effect on draft inference
//!   (bookkeeping, training-only settings, the draft's own token ids); accepted and not read;
//! - [`FieldClass::MathChanging`]: a field some public DFlash / DFlash2 implementations (or the
//!   Hugging Face layers they build on) apply, and that changes the mathematics when active;
//!   accepted only when it holds its [`Neutral`] value, refused otherwise, because computing the
//!   specified draft as if it were absent would silently give other proposals;
//! - [`FieldClass::Unknown`]: anything else; returned to the caller in
//!   [`crate::Parsed::unknown_fields`], or refused in [`crate::ParseMode::Strict`].
//!
//! The table below is the only place these lists live: the parser, its unknown-field
//! collection and [`draft_field_class`] all read it.

use serde_json::{Map, Value};

use crate::draft::Backend;
use crate::error::{ConfigError, Result};
use crate::json::{describe, join, present, to_bool, to_f64, to_str};

/// What the draft parser does with a field (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FieldClass {
    /// Read and validated.
    Parsed,
    /// Accepted without effect on draft inference.
    Harmless,
    /// Changes the mathematics when active: accepted only with its neutral value.
    MathChanging(Neutral),
    /// Not known to the parser.
    Unknown,
}

/// The values of a math-changing field that leave the specified mathematics unchanged.
/// Absent and `null` are always neutral.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Neutral {
    /// A boolean flag that must be off: `false` (another type is a type error).
    False,
    /// Only `false`: any other value (a bias, a count, `true`) activates it.
    OnlyFalse,
    /// No value at all: any value activates it (a softcapping bound, an attention scale).
    Null,
    /// A multiplier or scale: the number 1.
    One,
    /// An activation: `"silu"`.
    Silu,
    /// A RoPE type: `"default"`.
    DefaultRope,
    /// A RoPE scaling object whose `rope_type` (or `type`) is `"default"`.
    DefaultRopeScaling,
}

impl Neutral {
    /// The neutral values, in words (used by error messages).
    pub fn describe(self) -> &'static str {
        match self {
            Self::False => "false or null",
            Self::OnlyFalse => "false or null",
            Self::Null => "null (absent)",
            Self::One => "1 or null",
            Self::Silu => "\"silu\"",
            Self::DefaultRope => "\"default\" or null",
            Self::DefaultRopeScaling => "null or {\"rope_type\": \"default\"}",
        }
    }

    /// Whether the (non-null) value `v` at `path` is neutral; a value of the wrong type for a
    /// typed neutral is a [`ConfigError::WrongType`].
    fn accepts(self, v: &Value, path: &str) -> Result<bool> {
        Ok(match self {
            Self::False => !to_bool(v, path)?,
            Self::OnlyFalse => v == &Value::Bool(false),
            Self::Null => false,
            Self::One => to_f64(v, path)? == 1.0,
            Self::Silu => to_str(v, path)? == "silu",
            Self::DefaultRope => to_str(v, path)? == "default",
            Self::DefaultRopeScaling => {
                let o = crate::json::as_object(v, path)?;
                let kind = o.get("rope_type").or_else(|| o.get("type"));
                kind.and_then(Value::as_str) == Some("default")
            }
        })
    }
}

/// Which object of the document a rule is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scope {
    /// The document root.
    Top,
    /// `dflash_config`.
    Nested,
    /// Both the root and `dflash_config` (the reference code reads `dflash_config` first and
    /// falls back to the root).
    Both,
    /// `rope_parameters`.
    Rope,
    /// `dflash_config`, DFlash2 checkpoints only (a DFlash config does not know them).
    NestedDFlash2,
}

use FieldClass::{Harmless, MathChanging, Parsed};
use Neutral as N;

/// The table. Order within a scope is the order math-changing fields are checked in.
const FIELDS: &[(Scope, &str, FieldClass)] = &[
    // Identity and geometry.
    (Scope::Top, "architectures", Parsed),
    (Scope::Top, "model_type", Parsed),
    (Scope::Top, "dflash_config", Parsed),
    (Scope::Top, "hidden_size", Parsed),
    (Scope::Top, "num_hidden_layers", Parsed),
    (Scope::Top, "num_attention_heads", Parsed),
    (Scope::Top, "num_key_value_heads", Parsed),
    (Scope::Top, "head_dim", Parsed),
    (Scope::Top, "intermediate_size", Parsed),
    (Scope::Top, "rms_norm_eps", Parsed),
    (Scope::Top, "rope_theta", Parsed),
    (Scope::Top, "rope_parameters", Parsed),
    (Scope::Top, "layer_types", Parsed),
    (Scope::Top, "sliding_window", Parsed),
    (Scope::Top, "use_sliding_window", Parsed),
    (Scope::Top, "max_window_layers", Parsed),
    (Scope::Top, "vocab_size", Parsed),
    // Older files keep these at top level.
    (Scope::Top, "block_size", Parsed),
    (Scope::Top, "num_target_layers", Parsed),
    (Scope::Top, "target_layer_ids", Parsed),
    (Scope::Top, "mask_token_id", Parsed),
    (Scope::Nested, "target_layer_ids", Parsed),
    (Scope::Nested, "mask_token_id", Parsed),
    (Scope::Nested, "block_size", Parsed),
    (Scope::Nested, "num_target_layers", Parsed),
    (Scope::NestedDFlash2, "conv_kernel_size", Parsed),
    (Scope::NestedDFlash2, "conv_group_size", Parsed),
    (Scope::NestedDFlash2, "selector_rank", Parsed),
    (Scope::NestedDFlash2, "selector_top_k", Parsed),
    (Scope::Rope, "rope_theta", Parsed),
    // Hugging Face bookkeeping and training-only settings. `tie_word_embeddings` is here
    // because the draft has neither a token embedding nor an output head: both are the
    // target's, passed in by the caller, so the draft's flag has nothing to tie.
    (Scope::Top, "auto_map", Harmless),
    (Scope::Top, "torch_dtype", Harmless),
    (Scope::Top, "dtype", Harmless),
    (Scope::Top, "transformers_version", Harmless),
    (Scope::Top, "_name_or_path", Harmless),
    (Scope::Top, "bos_token_id", Harmless),
    (Scope::Top, "eos_token_id", Harmless),
    (Scope::Top, "pad_token_id", Harmless),
    (Scope::Top, "attention_dropout", Harmless),
    (Scope::Top, "initializer_range", Harmless),
    (Scope::Top, "max_position_embeddings", Harmless),
    (Scope::Top, "tie_word_embeddings", Harmless),
    (Scope::Top, "use_cache", Harmless),
    // Math-changing: the layer itself.
    (Scope::Top, "hidden_act", MathChanging(N::Silu)),
    (Scope::Top, "hidden_activation", MathChanging(N::Silu)),
    (Scope::Top, "attention_bias", MathChanging(N::False)),
    (Scope::Top, "mlp_bias", MathChanging(N::False)),
    // RoPE: one-dimensional, full head, unscaled.
    (
        Scope::Top,
        "rope_scaling",
        MathChanging(N::DefaultRopeScaling),
    ),
    (Scope::Top, "partial_rotary_factor", MathChanging(N::One)),
    (Scope::Rope, "rope_type", MathChanging(N::DefaultRope)),
    (Scope::Rope, "partial_rotary_factor", MathChanging(N::One)),
    // Masking: the block is non-causal.
    (Scope::Both, "is_causal", MathChanging(N::False)),
    (Scope::Both, "causal", MathChanging(N::False)),
    (Scope::Both, "causal_mask", MathChanging(N::False)),
    // Logit and attention-score caps.
    (Scope::Both, "attn_logit_softcapping", MathChanging(N::Null)),
    (
        Scope::Both,
        "final_logit_softcapping",
        MathChanging(N::Null),
    ),
    (Scope::Both, "logit_softcapping", MathChanging(N::Null)),
    // Multipliers and scales (logits, embeddings, residuals, attention).
    (Scope::Both, "output_multiplier", MathChanging(N::One)),
    (Scope::Both, "logits_scaling", MathChanging(N::One)),
    (Scope::Both, "logit_scale", MathChanging(N::One)),
    (Scope::Both, "input_embedding_scale", MathChanging(N::One)),
    (Scope::Both, "embedding_multiplier", MathChanging(N::One)),
    (Scope::Both, "residual_multiplier", MathChanging(N::One)),
    (Scope::Both, "attention_multiplier", MathChanging(N::Null)),
    // Other proposal rules.
    (Scope::Both, "sample_from_anchor", MathChanging(N::False)),
    (
        Scope::Both,
        "attention_sink_bias",
        MathChanging(N::OnlyFalse),
    ),
    (Scope::Both, "attention_sinks", MathChanging(N::OnlyFalse)),
    (Scope::Both, "use_aux_hidden_state", MathChanging(N::False)),
];

/// Which object a field lives in, for the table lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Object {
    /// The document root.
    Top,
    /// `dflash_config`.
    Nested,
    /// `rope_parameters`.
    Rope,
}

impl Object {
    /// The JSON path of the object (`""` for the root).
    pub(crate) fn path(self) -> &'static str {
        match self {
            Self::Top => "",
            Self::Nested => "dflash_config",
            Self::Rope => "rope_parameters",
        }
    }
}

fn in_scope(scope: Scope, object: Object, backend: Backend) -> bool {
    match scope {
        Scope::Top => object == Object::Top,
        Scope::Nested => object == Object::Nested,
        Scope::Both => object != Object::Rope,
        Scope::Rope => object == Object::Rope,
        Scope::NestedDFlash2 => object == Object::Nested && backend == Backend::DFlash2,
    }
}

/// The class of `key` in `object` of a `backend` checkpoint.
pub(crate) fn class_of(object: Object, key: &str, backend: Backend) -> FieldClass {
    FIELDS
        .iter()
        .find(|(s, k, _)| *k == key && in_scope(*s, object, backend))
        .map_or(FieldClass::Unknown, |&(_, _, c)| c)
}

/// The class of the field at `path` in a draft config of `backend`.
///
/// `path` names a direct field of the document (`is_causal`), of `dflash_config`
/// (`dflash_config.causal_mask`) or of `rope_parameters` (`rope_parameters.rope_type`), the
/// way error messages write it. Deeper paths (inside a field's value) are
/// [`FieldClass::Unknown`]: the parser never looks inside a value it does not read.
///
/// ```
/// use dflash_config::{Backend, FieldClass, Neutral, draft_field_class};
/// assert_eq!(draft_field_class("torch_dtype", Backend::DFlash), FieldClass::Harmless);
/// assert_eq!(
///     draft_field_class("dflash_config.causal_mask", Backend::DFlash),
///     FieldClass::MathChanging(Neutral::False)
/// );
/// assert_eq!(draft_field_class("dflash_config.selector_rank", Backend::DFlash), FieldClass::Unknown);
/// ```
pub fn draft_field_class(path: &str, backend: Backend) -> FieldClass {
    let (object, key) = match path.split_once('.') {
        None => (Object::Top, path),
        Some(("dflash_config", k)) => (Object::Nested, k),
        Some(("rope_parameters", k)) => (Object::Rope, k),
        Some(_) => return FieldClass::Unknown,
    };
    if key.contains('.') {
        return FieldClass::Unknown;
    }
    class_of(object, key, backend)
}

/// Refuse every math-changing field of `obj` (the `object` of the document) that is present,
/// not `null` and not neutral, in table order.
pub(crate) fn check_math_fields(
    obj: &Map<String, Value>,
    object: Object,
    backend: Backend,
) -> Result<()> {
    for &(scope, key, class) in FIELDS {
        let FieldClass::MathChanging(neutral) = class else {
            continue;
        };
        if !in_scope(scope, object, backend) {
            continue;
        }
        let Some(v) = present(obj, key) else { continue };
        let path = join(object.path(), key);
        if neutral.accepts(v, &path)? {
            continue;
        }
        // A scaling object is named by its type, the part a reader recognises.
        let kind = v
            .as_object()
            .and_then(|o| o.get("rope_type").or_else(|| o.get("type")));
        let found = match (neutral, kind) {
            (N::DefaultRopeScaling, Some(k)) => format!("rope_type {}", describe(k)),
            _ => describe(v),
        };
        return Err(match neutral {
            N::Silu => ConfigError::Activation { path, found },
            _ => ConfigError::UnsupportedFeature {
                path,
                expected: neutral.describe(),
                found,
            },
        });
    }
    Ok(())
}

/// Collect the fields of `obj` (the `object` of the document) the table does not know.
pub(crate) fn collect_unknown(
    obj: &Map<String, Value>,
    object: Object,
    backend: Backend,
    out: &mut Vec<crate::UnknownField>,
) {
    for (k, v) in obj {
        if class_of(object, k, backend) == FieldClass::Unknown {
            out.push(crate::UnknownField {
                path: join(object.path(), k),
                value: v.clone(),
            });
        }
    }
}
