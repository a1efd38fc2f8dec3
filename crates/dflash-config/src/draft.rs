//! The draft checkpoint's `config.json` (DFlash and DFlash2, Hugging Face layout).

use serde_json::{Map, Value};

use crate::error::{ConfigError, Result};
use crate::fields::{Object, check_math_fields, collect_unknown};
use crate::json::{
    ConfigNote, ParseMode, Parsed, as_object, describe, finish, index, join, missing,
    opt_positive_u32, opt_u32, parse_document, present, req_positive_u32, to_array, to_bool,
    to_f64, to_str, to_u32,
};

/// Which speculative backend a checkpoint (or a startup request) is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// `DFlashDraftModel`: per-column argmax proposals.
    DFlash,
    /// `DFlash2DraftModel`: dynamic grouped convolution and the conditional candidate selector.
    DFlash2,
}

impl Backend {
    /// The `architectures` entry that names this backend.
    pub fn architecture(self) -> &'static str {
        match self {
            Self::DFlash => "DFlashDraftModel",
            Self::DFlash2 => "DFlash2DraftModel",
        }
    }
}

/// Attention type of one draft layer (`layer_types[i]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttentionType {
    /// `"full_attention"`: attends all populated context and query rows.
    Full,
    /// `"sliding_attention"`: attends keys with `|p_key - p_query| < sliding_window`.
    Sliding,
}

/// DFlash2-only parameters (`dflash_config.conv_*`, `dflash_config.selector_*`).
///
/// The parser accepts exactly the geometry the specified ops implement: two taps, group width
/// 16, top-16 candidates; the selector rank is free (positive).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DFlash2Params {
    /// Convolution taps (`conv_kernel_size`); always 2.
    pub conv_kernel_size: u32,
    /// Channels sharing one dynamic increment (`conv_group_size`); always 16.
    pub conv_group_size: u32,
    /// Selector rank R (`selector_rank`): codebooks are `[vocab, R]`, `W_hidden` is `[R, H]`.
    pub selector_rank: u32,
    /// Candidates per mask column (`selector_top_k`); always 16.
    pub selector_top_k: u32,
}

/// Where [`DraftConfig::target_layer_ids`] came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TargetLayerIdsSource {
    /// `dflash_config.target_layer_ids`.
    Nested,
    /// A top-level `target_layer_ids` (older files).
    TopLevel,
    /// Absent from the file: derived by [`legacy_target_layer_ids`] from
    /// `num_target_layers` and the draft layer count.
    Derived,
}

/// A parsed, internally consistent draft config.
///
/// Fields are public so that tests and synthetic-checkpoint generators can build one directly;
/// [`DraftConfig::validate`] (run by the parser and again by [`crate::validate_pair`]) checks
/// every invariant stated on the fields, so a hand-built value gets the same checks.
#[derive(Debug, Clone, PartialEq)]
pub struct DraftConfig {
    /// From `architectures`.
    pub backend: Backend,
    /// `hidden_size` if the file states it. H itself comes from the target; when present it
    /// must equal the target's.
    pub hidden_size: Option<u32>,
    /// `vocab_size` if the file states it; when present it must equal the target's embedding
    /// rows.
    pub vocab_size: Option<u32>,
    /// Query heads Hq (`num_attention_heads`), a multiple of `num_key_value_heads`.
    pub num_attention_heads: u32,
    /// KV heads Hkv (`num_key_value_heads`).
    pub num_key_value_heads: u32,
    /// Head dimension D (`head_dim`), even.
    pub head_dim: u32,
    /// MLP width I (`intermediate_size`).
    pub intermediate_size: u32,
    /// Plain RMSNorm epsilon (`rms_norm_eps`), finite and > 0.
    pub rms_norm_eps: f64,
    /// One-dimensional RoPE theta (`rope_theta` or `rope_parameters.rope_theta`), finite and > 0.
    pub rope_theta: f64,
    /// One entry per draft layer (`layer_types`, or derived as Hugging Face `Qwen3Config` does
    /// when absent); its length is the draft layer count (`num_hidden_layers`).
    pub layer_types: Vec<AttentionType>,
    /// Sliding-window scalar S (`sliding_window`); present whenever a layer slides.
    pub sliding_window: Option<u32>,
    /// Zero-based target decoder block ids whose residual outputs are concatenated, in order;
    /// non-empty and distinct.
    pub target_layer_ids: Vec<u32>,
    /// Where `target_layer_ids` came from.
    pub target_layer_ids_source: TargetLayerIdsSource,
    /// The mask token id; `None` when the file has `null` (a startup option must supply it).
    pub mask_token_id: Option<u32>,
    /// Training block size (`block_size`, nested or top-level). Informational: the draft count
    /// K is a startup choice, not a weight dimension.
    pub block_size: Option<u32>,
    /// The target's layer count as the draft states it (`num_target_layers`, nested or
    /// top-level); when present it must equal the target's.
    pub num_target_layers: Option<u32>,
    /// DFlash2 parameters; `Some` exactly when `backend` is DFlash2.
    pub dflash2: Option<DFlash2Params>,
}

/// The ids the reference code derives when a config gives no `target_layer_ids`.
///
/// For `n = num_draft_layers > 1`: evenly spaced from 1 to `num_target_layers - 3`,
/// `id_i = round(1 + i * (num_target_layers - 4) / (n - 1))` for `i in 0..n`, where the division
/// and the addition are IEEE-754 double operations (as Python's true division and float
/// addition) and `round` is Python's `round`: **round half to even** (banker's rounding), so
/// 2.5 becomes 2 and 3.5 becomes 4. For `n == 1` the id is `num_target_layers / 2` (integer
/// division). `n == 0` gives no ids.
///
/// Errors with [`ConfigError::OutOfRange`] (path `dflash_config.target_layer_ids[i]`) if a
/// derived id is negative, which happens only for targets with fewer than three layers.
///
/// Note: the official examples do not use this rule with their draft layer counts. The 35B-A3B
/// ids `[1,6,11,16,22,27,32,37]` are exactly this rule with `n = 8` and 40 target layers, but
/// that draft has 6 layers (the rule gives `[1,8,15,23,30,37]`); the 27B ids `[5,19,33,47,61]`
/// are not produced by the rule for any `n` (with 5 layers it gives `[1,16,31,46,61]`). Both
/// official configs therefore state their ids explicitly.
pub fn legacy_target_layer_ids(num_target_layers: u32, num_draft_layers: u32) -> Result<Vec<u32>> {
    match num_draft_layers {
        0 => Ok(Vec::new()),
        1 => Ok(vec![num_target_layers / 2]),
        n => {
            let start: i64 = 1;
            let span = i64::from(num_target_layers) - 3 - start;
            let denom = f64::from(n - 1);
            (0..n)
                .map(|i| {
                    // The product is exact in i128; converting it to f64 is exact below 2^53
                    // (every realistic size), where this equals Python's int / int.
                    #[allow(clippy::cast_precision_loss)]
                    let q = (i128::from(i) * i128::from(span)) as f64 / denom;
                    let x = (start as f64 + q).round_ties_even();
                    if x < 0.0 {
                        Err(ConfigError::OutOfRange {
                            path: index("dflash_config.target_layer_ids", i as usize),
                            expected: format!(
                                "a non-negative derived id (num_target_layers = {num_target_layers} is too small)"
                            ),
                            found: format!("{x}"),
                        })
                    } else {
                        // 0 <= x <= 1 + |span| < 2^32: the cast is exact.
                        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                        Ok(x as u32)
                    }
                })
                .collect()
        }
    }
}

/// Largest accepted `num_hidden_layers` for a draft (published drafts have 1 to 8). The bound
/// keeps a hostile config from making the parser allocate gigabytes.
pub const MAX_DRAFT_LAYERS: u32 = 1024;

/// A float that must be finite and positive.
fn positive_float(v: &Value, path: &str) -> Result<f64> {
    let x = to_f64(v, path)?;
    if x.is_finite() && x > 0.0 {
        Ok(x)
    } else {
        Err(ConfigError::NonPositiveFloat {
            path: path.to_owned(),
            found: x,
        })
    }
}

/// Read a field that may sit in `dflash_config` (newer files) or at top level (older ones);
/// when both are present they must agree.
fn nested_or_top<'a>(
    top: &'a Map<String, Value>,
    nested: Option<&'a Map<String, Value>>,
    key: &str,
) -> Result<Option<(&'a Value, String, bool)>> {
    let n = nested.and_then(|d| d.get(key)).filter(|v| !v.is_null());
    let t = present(top, key);
    match (n, t) {
        (Some(a), Some(b)) if a != b => Err(ConfigError::Conflict {
            path: join("dflash_config", key),
            found: describe(a),
            other_path: key.to_owned(),
            other: describe(b),
        }),
        (Some(a), _) => Ok(Some((a, join("dflash_config", key), true))),
        (None, Some(b)) => Ok(Some((b, key.to_owned(), false))),
        (None, None) => Ok(None),
    }
}

fn parse_backend(top: &Map<String, Value>) -> Result<Backend> {
    let path = "architectures";
    let v = present(top, path).ok_or_else(|| {
        missing(
            path.to_owned(),
            "[\"DFlashDraftModel\"] or [\"DFlash2DraftModel\"]",
        )
    })?;
    let arr = to_array(v, path)?;
    let [only] = arr else {
        return Err(ConfigError::Architecture {
            path: path.to_owned(),
            found: format!("{} entries", arr.len()),
        });
    };
    let p0 = index(path, 0);
    match to_str(only, &p0)? {
        "DFlashDraftModel" => Ok(Backend::DFlash),
        "DFlash2DraftModel" => Ok(Backend::DFlash2),
        other => Err(ConfigError::Architecture {
            path: p0,
            found: format!("{other:?}"),
        }),
    }
}

/// RoPE theta from `rope_theta` or `rope_parameters.rope_theta` (the RoPE type, scaling and
/// rotary fraction are math-changing fields checked by the field table).
fn parse_rope_theta(top: &Map<String, Value>, rope: Option<&Map<String, Value>>) -> Result<f64> {
    let flat = present(top, "rope_theta")
        .map(|v| positive_float(v, "rope_theta"))
        .transpose()?;
    let nested = rope
        .and_then(|rp| present(rp, "rope_theta"))
        .map(|v| positive_float(v, "rope_parameters.rope_theta"))
        .transpose()?;
    match (flat, nested) {
        (Some(a), Some(b)) if a != b => Err(ConfigError::Conflict {
            path: "rope_theta".to_owned(),
            found: a.to_string(),
            other_path: "rope_parameters.rope_theta".to_owned(),
            other: b.to_string(),
        }),
        (Some(a), _) | (None, Some(a)) => Ok(a),
        (None, None) => Err(missing(
            "rope_theta".to_owned(),
            "a positive number (`rope_theta` or `rope_parameters.rope_theta`)",
        )),
    }
}

fn parse_layer_types(top: &Map<String, Value>, num_layers: u32) -> Result<Vec<AttentionType>> {
    if let Some(v) = present(top, "layer_types") {
        let arr = to_array(v, "layer_types")?;
        let mut out = Vec::with_capacity(arr.len().min(4096));
        for (i, e) in arr.iter().enumerate() {
            let p = index("layer_types", i);
            out.push(match to_str(e, &p)? {
                "full_attention" => AttentionType::Full,
                "sliding_attention" => AttentionType::Sliding,
                other => {
                    return Err(ConfigError::UnknownLayerType {
                        path: p,
                        found: format!("{other:?}"),
                    });
                }
            });
        }
        return Ok(out);
    }
    // Hugging Face Qwen3Config default: layer i slides iff use_sliding_window is true, a
    // sliding_window is given and i >= max_window_layers (default 28).
    let use_sw = present(top, "use_sliding_window")
        .map(|v| to_bool(v, "use_sliding_window"))
        .transpose()?
        .unwrap_or(false);
    let has_window = present(top, "sliding_window").is_some();
    let max_window_layers = opt_u32(top, "", "max_window_layers")?.unwrap_or(28);
    Ok((0..num_layers)
        .map(|i| {
            if use_sw && has_window && i >= max_window_layers {
                AttentionType::Sliding
            } else {
                AttentionType::Full
            }
        })
        .collect())
}

/// `["sliding_attention", "full_attention", ...]` as a config would write it.
fn layer_type_names(types: &[AttentionType]) -> String {
    let names: Vec<&str> = types
        .iter()
        .map(|t| match t {
            AttentionType::Full => "\"full_attention\"",
            AttentionType::Sliding => "\"sliding_attention\"",
        })
        .collect();
    format!("[{}]", names.join(", "))
}

fn parse_ids(v: &Value, path: &str) -> Result<Vec<u32>> {
    let arr = to_array(v, path)?;
    arr.iter()
        .enumerate()
        .map(|(i, e)| to_u32(e, &index(path, i)))
        .collect()
}

fn parse_dflash2(d: Option<&Map<String, Value>>) -> Result<DFlash2Params> {
    let empty = Map::new();
    let d = d.unwrap_or(&empty);
    let p = "dflash_config";
    let exact = |key: &str, want: u32| -> Result<u32> {
        let x = req_positive_u32(d, p, key)?;
        if x == want {
            Ok(x)
        } else {
            Err(ConfigError::Unsupported {
                path: join(p, key),
                expected: want.to_string(),
                found: x.to_string(),
            })
        }
    };
    Ok(DFlash2Params {
        conv_kernel_size: exact("conv_kernel_size", 2)?,
        conv_group_size: exact("conv_group_size", 16)?,
        selector_rank: req_positive_u32(d, p, "selector_rank")?,
        selector_top_k: exact("selector_top_k", 16)?,
    })
}

impl DraftConfig {
    /// Parse and validate a draft `config.json`.
    ///
    /// Accepts the nested layout (`dflash_config` holding `target_layer_ids`, `mask_token_id`,
    /// `block_size`, `num_target_layers` and, for DFlash2, the convolution and selector fields)
    /// and the older layout (`block_size` and `num_target_layers` at top level, `dflash_config`
    /// with only ids and mask, or no `dflash_config` at all, in which case the ids are derived
    /// by [`legacy_target_layer_ids`]). A quantity given in both places must agree.
    ///
    /// Every field is classified by one table ([`crate::draft_field_class`]): fields the parser
    /// reads are validated; ordinary Hugging Face fields are accepted without effect;
    /// math-changing fields (`hidden_act`, `attention_bias`, `rope_scaling`,
    /// `partial_rotary_factor`, the causal flags, softcapping, multipliers, attention sinks, ...)
    /// are refused unless they hold their neutral value ([`ConfigError::UnsupportedFeature`],
    /// [`ConfigError::Activation`]); every other field is returned in
    /// [`Parsed::unknown_fields`], or refused in [`ParseMode::Strict`]. `layer_types` with a
    /// sliding layer and an explicit `use_sliding_window: false` is a [`ConfigError::Conflict`]
    /// (Hugging Face's `Qwen3Config` drops the window in that case).
    ///
    /// [`Parsed::notes`] says what the parser assumed: an absent causal flag (the block is
    /// computed non-causal, as specified, while several public implementations make sliding
    /// layers causal when the flag is missing), derived `layer_types` or target block ids, a
    /// `null` mask token, sliding layers without `use_sliding_window`.
    pub fn from_json_str(text: &str, mode: ParseMode) -> Result<Parsed<Self>> {
        Self::from_json_value(&parse_document(text)?, mode)
    }

    /// [`DraftConfig::from_json_str`] on an already parsed document.
    pub fn from_json_value(doc: &Value, mode: ParseMode) -> Result<Parsed<Self>> {
        let top = as_object(doc, "")?;
        let mut notes = Vec::new();

        let backend = parse_backend(top)?;
        match present(top, "model_type") {
            None => return Err(missing("model_type".to_owned(), "\"qwen3\"")),
            Some(v) => {
                let s = to_str(v, "model_type")?;
                if s != "qwen3" {
                    return Err(ConfigError::ModelType {
                        path: "model_type".to_owned(),
                        found: format!("{s:?}"),
                    });
                }
            }
        }

        let nested = present(top, "dflash_config")
            .map(|v| as_object(v, "dflash_config"))
            .transpose()?;
        let rope = present(top, "rope_parameters")
            .map(|v| as_object(v, "rope_parameters"))
            .transpose()?;
        check_math_fields(top, Object::Top, backend)?;
        if let Some(d) = nested {
            check_math_fields(d, Object::Nested, backend)?;
        }
        if let Some(r) = rope {
            check_math_fields(r, Object::Rope, backend)?;
        }
        let causal_flag_given = ["is_causal", "causal", "causal_mask"]
            .iter()
            .any(|k| present(top, k).is_some() || nested.is_some_and(|d| present(d, k).is_some()));
        if !causal_flag_given {
            notes.push(ConfigNote {
                path: "is_causal".to_owned(),
                message: "absent: the block is computed non-causal, as the specification \
                          requires (several public implementations make sliding-window layers \
                          causal when the flag is missing; state \"is_causal\": false to say so)"
                    .to_owned(),
            });
        }

        let hidden_size = opt_positive_u32(top, "", "hidden_size")?;
        let vocab_size = opt_positive_u32(top, "", "vocab_size")?;
        let num_layers = req_positive_u32(top, "", "num_hidden_layers")?;
        if num_layers > MAX_DRAFT_LAYERS {
            return Err(ConfigError::OutOfRange {
                path: "num_hidden_layers".to_owned(),
                expected: format!("at most {MAX_DRAFT_LAYERS} draft layers"),
                found: num_layers.to_string(),
            });
        }
        let num_attention_heads = req_positive_u32(top, "", "num_attention_heads")?;
        let num_key_value_heads = req_positive_u32(top, "", "num_key_value_heads")?;
        let head_dim = req_positive_u32(top, "", "head_dim")?;
        let intermediate_size = req_positive_u32(top, "", "intermediate_size")?;
        let rms_norm_eps = match present(top, "rms_norm_eps") {
            Some(v) => positive_float(v, "rms_norm_eps")?,
            None => return Err(missing("rms_norm_eps".to_owned(), "a positive number")),
        };
        let rope_theta = parse_rope_theta(top, rope)?;
        let sliding_window = opt_positive_u32(top, "", "sliding_window")?;
        // Type-check the fields that feed the layer-type default.
        let use_sliding_window = present(top, "use_sliding_window")
            .map(|v| to_bool(v, "use_sliding_window"))
            .transpose()?;
        opt_u32(top, "", "max_window_layers")?;
        let layer_types = parse_layer_types(top, num_layers)?;
        if layer_types.len() != num_layers as usize {
            return Err(ConfigError::LayerTypesLength {
                path: "layer_types".to_owned(),
                expected: num_layers as usize,
                found: layer_types.len(),
            });
        }
        let first_sliding = layer_types
            .iter()
            .position(|t| *t == AttentionType::Sliding);
        if present(top, "layer_types").is_none() {
            notes.push(ConfigNote {
                path: "layer_types".to_owned(),
                message: format!(
                    "absent: derived as Hugging Face Qwen3Config does (use_sliding_window, \
                     sliding_window, max_window_layers): {}",
                    layer_type_names(&layer_types)
                ),
            });
        } else if let Some(i) = first_sliding {
            match use_sliding_window {
                Some(false) => {
                    return Err(ConfigError::Conflict {
                        path: "use_sliding_window".to_owned(),
                        found: "false".to_owned(),
                        other_path: index("layer_types", i),
                        other: "\"sliding_attention\"".to_owned(),
                    });
                }
                Some(true) => {}
                None => notes.push(ConfigNote {
                    path: "use_sliding_window".to_owned(),
                    message: "absent: the sliding layers of layer_types use sliding_window \
                              (Hugging Face Qwen3Config drops the window unless \
                              use_sliding_window is true)"
                        .to_owned(),
                }),
            }
        }

        let block_size = nested_or_top(top, nested, "block_size")?
            .map(|(v, p, _)| crate::json::to_positive_u32(v, &p))
            .transpose()?;
        let num_target_layers = nested_or_top(top, nested, "num_target_layers")?
            .map(|(v, p, _)| crate::json::to_positive_u32(v, &p))
            .transpose()?;
        let mask_token_id = nested_or_top(top, nested, "mask_token_id")?
            .map(|(v, p, _)| to_u32(v, &p))
            .transpose()?;
        if mask_token_id.is_none() {
            notes.push(ConfigNote {
                path: "dflash_config.mask_token_id".to_owned(),
                message: "null or absent: the mask token id must come from the startup options"
                    .to_owned(),
            });
        }
        let (target_layer_ids, target_layer_ids_source) =
            match nested_or_top(top, nested, "target_layer_ids")? {
                Some((v, p, is_nested)) => (
                    parse_ids(v, &p)?,
                    if is_nested {
                        TargetLayerIdsSource::Nested
                    } else {
                        TargetLayerIdsSource::TopLevel
                    },
                ),
                None => {
                    let Some(ntl) = num_target_layers else {
                        return Err(missing(
                            "dflash_config.target_layer_ids".to_owned(),
                            "target block ids, or num_target_layers to derive them from",
                        ));
                    };
                    let ids = legacy_target_layer_ids(ntl, num_layers)?;
                    notes.push(ConfigNote {
                        path: "dflash_config.target_layer_ids".to_owned(),
                        message: format!(
                            "absent: derived from num_target_layers = {ntl} and {num_layers} \
                             draft layers by the reference rule: {ids:?}"
                        ),
                    });
                    (ids, TargetLayerIdsSource::Derived)
                }
            };

        let dflash2 = match backend {
            Backend::DFlash2 => Some(parse_dflash2(nested)?),
            Backend::DFlash => None,
        };

        let mut unknown = Vec::new();
        collect_unknown(top, Object::Top, backend, &mut unknown);
        if let Some(r) = rope {
            collect_unknown(r, Object::Rope, backend, &mut unknown);
        }
        if let Some(d) = nested {
            collect_unknown(d, Object::Nested, backend, &mut unknown);
        }

        let cfg = Self {
            backend,
            hidden_size,
            vocab_size,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            intermediate_size,
            rms_norm_eps,
            rope_theta,
            layer_types,
            sliding_window,
            target_layer_ids,
            target_layer_ids_source,
            mask_token_id,
            block_size,
            num_target_layers,
            dflash2,
        };
        cfg.validate()?;
        finish(cfg, unknown, notes, mode)
    }

    /// Check every invariant documented on the fields (the draft on its own; the pair checks
    /// are in [`crate::validate_pair`]).
    pub fn validate(&self) -> Result<()> {
        let positive = |x: u32, path: &str| {
            if x == 0 {
                Err(ConfigError::OutOfRange {
                    path: path.to_owned(),
                    expected: "an integer > 0".to_owned(),
                    found: "0".to_owned(),
                })
            } else {
                Ok(())
            }
        };
        positive(self.num_attention_heads, "num_attention_heads")?;
        positive(self.num_key_value_heads, "num_key_value_heads")?;
        positive(self.head_dim, "head_dim")?;
        positive(self.intermediate_size, "intermediate_size")?;
        if self.layer_types.is_empty() {
            return Err(ConfigError::OutOfRange {
                path: "num_hidden_layers".to_owned(),
                expected: "an integer > 0".to_owned(),
                found: "0".to_owned(),
            });
        }
        for (x, p) in [
            (self.hidden_size, "hidden_size"),
            (self.vocab_size, "vocab_size"),
            (self.block_size, "block_size"),
            (self.num_target_layers, "num_target_layers"),
            (self.sliding_window, "sliding_window"),
        ] {
            if let Some(x) = x {
                positive(x, p)?;
            }
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(ConfigError::HeadsNotDivisible {
                path: "num_attention_heads".to_owned(),
                q_heads: self.num_attention_heads,
                kv_heads: self.num_key_value_heads,
            });
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(ConfigError::OddHeadDim {
                path: "head_dim".to_owned(),
                found: self.head_dim,
            });
        }
        for (x, p) in [
            (self.rms_norm_eps, "rms_norm_eps"),
            (self.rope_theta, "rope_theta"),
        ] {
            if !(x.is_finite() && x > 0.0) {
                return Err(ConfigError::NonPositiveFloat {
                    path: p.to_owned(),
                    found: x,
                });
            }
        }
        if self.sliding_window.is_none()
            && let Some(i) = self
                .layer_types
                .iter()
                .position(|t| *t == AttentionType::Sliding)
        {
            return Err(ConfigError::Missing {
                path: "sliding_window".to_owned(),
                expected: format!(
                    "a positive integer, because layer_types[{i}] is \"sliding_attention\""
                ),
            });
        }

        let ids_path = self.ids_path();
        if self.target_layer_ids.is_empty() {
            return Err(ConfigError::EmptyTargetLayerIds {
                path: ids_path.to_owned(),
            });
        }
        for (i, &id) in self.target_layer_ids.iter().enumerate() {
            if let Some(first_index) = self.target_layer_ids.iter().take(i).position(|&x| x == id) {
                return Err(ConfigError::DuplicateTargetLayerId {
                    path: index(ids_path, i),
                    found: id,
                    first_index,
                });
            }
            if let Some(n) = self.num_target_layers
                && id >= n
            {
                return Err(ConfigError::TargetLayerIdOutOfRange {
                    path: index(ids_path, i),
                    num_target_layers: n,
                    found: id,
                });
            }
        }

        match (self.backend, &self.dflash2) {
            (Backend::DFlash, None) => {}
            (Backend::DFlash, Some(_)) => {
                return Err(ConfigError::Conflict {
                    path: "dflash_config.conv_kernel_size".to_owned(),
                    found: "DFlash2 parameters".to_owned(),
                    other_path: "architectures".to_owned(),
                    other: "\"DFlashDraftModel\"".to_owned(),
                });
            }
            (Backend::DFlash2, None) => {
                return Err(ConfigError::Missing {
                    path: "dflash_config.conv_kernel_size".to_owned(),
                    expected: "the DFlash2 convolution and selector parameters".to_owned(),
                });
            }
            (Backend::DFlash2, Some(p)) => {
                let exact = |x: u32, want: u32, key: &str| {
                    if x == want {
                        Ok(())
                    } else {
                        Err(ConfigError::Unsupported {
                            path: join("dflash_config", key),
                            expected: want.to_string(),
                            found: x.to_string(),
                        })
                    }
                };
                exact(p.conv_kernel_size, 2, "conv_kernel_size")?;
                exact(p.conv_group_size, 16, "conv_group_size")?;
                exact(p.selector_top_k, 16, "selector_top_k")?;
                positive(p.selector_rank, "dflash_config.selector_rank")?;
            }
        }
        Ok(())
    }

    /// JSON path of the target block ids (derived ids are reported where they would be).
    pub(crate) fn ids_path(&self) -> &'static str {
        match self.target_layer_ids_source {
            TargetLayerIdsSource::TopLevel => "target_layer_ids",
            TargetLayerIdsSource::Nested | TargetLayerIdsSource::Derived => {
                "dflash_config.target_layer_ids"
            }
        }
    }

    /// Number of draft layers (`num_hidden_layers`).
    pub fn num_layers(&self) -> usize {
        self.layer_types.len()
    }
}
