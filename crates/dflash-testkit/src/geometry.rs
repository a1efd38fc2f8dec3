//! The reference target's geometry and its Qwen3.5-style `config.json`.
//!
//! The config is the multimodal Qwen3.5 layout (`model_type: "qwen3_5"`, the text model's
//! fields nested in `text_config`), so [`dflash_config`]'s target parser and any Qwen3.5
//! tooling read it as they read a real checkpoint's. Only text fields are written.

use serde_json::{Map, Value, json};

use crate::error::{Result, TestkitError};

/// The mixer of one decoder block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayerKind {
    /// Gated DeltaNet (`"linear_attention"`).
    LinearAttention,
    /// Gated full attention (`"full_attention"`).
    FullAttention,
}

impl LayerKind {
    /// The `layer_types` string of the config.
    pub fn as_str(self) -> &'static str {
        match self {
            LayerKind::LinearAttention => "linear_attention",
            LayerKind::FullAttention => "full_attention",
        }
    }
}

/// Geometry of a Qwen3.5-style hybrid text model.
#[derive(Clone, Debug, PartialEq)]
pub struct TargetGeometry {
    /// Hidden width H.
    pub hidden: usize,
    /// Dense SwiGLU intermediate width.
    pub intermediate: usize,
    /// Mixer of every block (length = block count).
    pub layer_types: Vec<LayerKind>,
    /// Full-attention query heads.
    pub attn_heads: usize,
    /// Full-attention key/value heads (GQA: query head h uses KV head h / (heads / kv_heads)).
    pub kv_heads: usize,
    /// Full-attention head dimension D.
    pub head_dim: usize,
    /// Fraction of each head that RoPE rotates (Qwen3.5: 0.25); the rotary dim
    /// `floor(D * factor)` must be even and positive.
    pub partial_rotary_factor: f64,
    /// RoPE theta.
    pub rope_theta: f64,
    /// Gated DeltaNet key (and query) heads.
    pub linear_key_heads: usize,
    /// Gated DeltaNet value heads (a multiple of the key heads).
    pub linear_value_heads: usize,
    /// Gated DeltaNet key head dimension Dk.
    pub linear_key_dim: usize,
    /// Gated DeltaNet value head dimension Dv.
    pub linear_value_dim: usize,
    /// Causal depthwise conv kernel width (Qwen3.5: 4).
    pub conv_kernel: usize,
    /// Embedding / output-head rows (padded vocabulary).
    pub vocab_rows: usize,
    /// Public vocabulary size (`<= vocab_rows`); written to `tokenizer.json`, not to the config.
    pub public_vocab: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f64,
    /// Position capacity (`max_position_embeddings`).
    pub max_positions: usize,
    /// End-of-sequence token id (below `public_vocab`).
    pub eos_token_id: u32,
}

/// `layers` block kinds in the Qwen3.5 pattern: every `interval`-th block (1-based) is full
/// attention, the others Gated DeltaNet.
pub fn hybrid_layer_types(layers: usize, interval: usize) -> Vec<LayerKind> {
    (0..layers)
        .map(|i| {
            if interval > 0 && (i + 1) % interval == 0 {
                LayerKind::FullAttention
            } else {
                LayerKind::LinearAttention
            }
        })
        .collect()
}

fn cfg_err(field: &str, expected: impl Into<String>, found: impl ToString) -> TestkitError {
    TestkitError::Config {
        field: field.to_owned(),
        expected: expected.into(),
        found: found.to_string(),
    }
}

impl TargetGeometry {
    /// The CI geometry: H 64, 8 blocks = 2 x [3 Gated DeltaNet + 1 full attention], attention
    /// 4 query / 2 KV heads of 32 (rotary dim 8), Gated DeltaNet 2 key / 4 value heads of 16,
    /// conv kernel 4, intermediate 128, 512 vocabulary rows with 500 public.
    pub fn tiny() -> Self {
        TargetGeometry {
            hidden: 64,
            intermediate: 128,
            layer_types: hybrid_layer_types(8, 4),
            attn_heads: 4,
            kv_heads: 2,
            head_dim: 32,
            partial_rotary_factor: 0.25,
            rope_theta: 1.0e7,
            linear_key_heads: 2,
            linear_value_heads: 4,
            linear_key_dim: 16,
            linear_value_dim: 16,
            conv_kernel: 4,
            vocab_rows: 512,
            public_vocab: 500,
            rms_eps: 1e-6,
            max_positions: 4096,
            eos_token_id: 499,
        }
    }

    /// Decoder block count.
    pub fn layers(&self) -> usize {
        self.layer_types.len()
    }

    /// RoPE rotary dimension, `floor(head_dim * partial_rotary_factor)`.
    pub fn rotary_dim(&self) -> usize {
        (self.head_dim as f64 * self.partial_rotary_factor).floor() as usize
    }

    /// Gated DeltaNet conv channels: `2 * key_heads * Dk + value_heads * Dv` (q, k, v).
    pub fn conv_dim(&self) -> usize {
        2 * self.linear_key_heads * self.linear_key_dim
            + self.linear_value_heads * self.linear_value_dim
    }

    /// Check every constraint the model math relies on.
    pub fn validate(&self) -> Result<()> {
        let pos = |field: &str, v: usize| -> Result<()> {
            if v == 0 {
                Err(cfg_err(field, "a positive integer", v))
            } else {
                Ok(())
            }
        };
        pos("hidden_size", self.hidden)?;
        pos("intermediate_size", self.intermediate)?;
        pos("num_hidden_layers", self.layers())?;
        pos("num_attention_heads", self.attn_heads)?;
        pos("num_key_value_heads", self.kv_heads)?;
        pos("head_dim", self.head_dim)?;
        pos("linear_num_key_heads", self.linear_key_heads)?;
        pos("linear_num_value_heads", self.linear_value_heads)?;
        pos("linear_key_head_dim", self.linear_key_dim)?;
        pos("linear_value_head_dim", self.linear_value_dim)?;
        pos("linear_conv_kernel_dim", self.conv_kernel)?;
        pos("vocab_size", self.vocab_rows)?;
        pos("max_position_embeddings", self.max_positions)?;
        if !self.attn_heads.is_multiple_of(self.kv_heads) {
            return Err(cfg_err(
                "num_attention_heads",
                format!("a multiple of num_key_value_heads ({})", self.kv_heads),
                self.attn_heads,
            ));
        }
        if !self
            .linear_value_heads
            .is_multiple_of(self.linear_key_heads)
        {
            return Err(cfg_err(
                "linear_num_value_heads",
                format!(
                    "a multiple of linear_num_key_heads ({})",
                    self.linear_key_heads
                ),
                self.linear_value_heads,
            ));
        }
        let rd = self.rotary_dim();
        if !(self.partial_rotary_factor > 0.0 && self.partial_rotary_factor <= 1.0)
            || rd == 0
            || !rd.is_multiple_of(2)
        {
            return Err(cfg_err(
                "rope_parameters.partial_rotary_factor",
                format!(
                    "a factor in (0, 1] giving an even positive rotary dim of head_dim {}",
                    self.head_dim
                ),
                self.partial_rotary_factor,
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(cfg_err(
                "rope_parameters.rope_theta",
                "a finite positive number",
                self.rope_theta,
            ));
        }
        if !(self.rms_eps.is_finite() && self.rms_eps > 0.0) {
            return Err(cfg_err(
                "rms_norm_eps",
                "a finite positive number",
                self.rms_eps,
            ));
        }
        if self.public_vocab == 0 || self.public_vocab > self.vocab_rows {
            return Err(cfg_err(
                "public_vocab_size",
                format!("1 ..= {} (the embedding rows)", self.vocab_rows),
                self.public_vocab,
            ));
        }
        if self.eos_token_id as usize >= self.public_vocab {
            return Err(cfg_err(
                "eos_token_id",
                format!(
                    "a token id below the public vocabulary {}",
                    self.public_vocab
                ),
                self.eos_token_id,
            ));
        }
        if self.vocab_rows > i32::MAX as usize || self.max_positions > i32::MAX as usize {
            return Err(cfg_err(
                "vocab_size",
                "sizes that fit in i32",
                self.vocab_rows,
            ));
        }
        Ok(())
    }

    /// The `config.json` document (Qwen3.5 layout with `text_config`).
    pub fn to_config_json(&self) -> Value {
        let rd = self.rotary_dim();
        // Text-only positions give all three MRoPE axes the same position, so the sections do
        // not change the result; they are written (summing to rd / 2) for realism.
        let half = rd / 2;
        let s1 = half / 4;
        let s2 = half / 4;
        let mrope = [half - s1 - s2, s1, s2];
        let types: Vec<&str> = self.layer_types.iter().map(|k| k.as_str()).collect();
        json!({
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "model_type": "qwen3_5",
            "tie_word_embeddings": false,
            "transformers_version": "4.57.0",
            "text_config": {
                "model_type": "qwen3_5_text",
                "dtype": "bfloat16",
                "hidden_size": self.hidden,
                "intermediate_size": self.intermediate,
                "num_hidden_layers": self.layers(),
                "layer_types": types,
                "num_attention_heads": self.attn_heads,
                "num_key_value_heads": self.kv_heads,
                "head_dim": self.head_dim,
                "attention_bias": false,
                "attention_dropout": 0.0,
                "hidden_act": "silu",
                "rms_norm_eps": self.rms_eps,
                "vocab_size": self.vocab_rows,
                "max_position_embeddings": self.max_positions,
                "linear_conv_kernel_dim": self.conv_kernel,
                "linear_key_head_dim": self.linear_key_dim,
                "linear_value_head_dim": self.linear_value_dim,
                "linear_num_key_heads": self.linear_key_heads,
                "linear_num_value_heads": self.linear_value_heads,
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": self.rope_theta,
                    "partial_rotary_factor": self.partial_rotary_factor,
                    "mrope_section": mrope,
                    "mrope_interleaved": true
                },
                "tie_word_embeddings": false,
                "eos_token_id": self.eos_token_id
            }
        })
    }

    /// Parse a Qwen3.5 `config.json` document (fields from `text_config` when present, else
    /// from the top level); `public_vocab` is stated by the caller (it is not a config field).
    /// Also returns whether the output head is tied to the embedding.
    pub fn from_config_json(doc: &Value, public_vocab: usize) -> Result<(Self, bool)> {
        let top = doc
            .as_object()
            .ok_or_else(|| cfg_err("", "a JSON object", describe(doc)))?;
        let (obj, prefix): (&Map<String, Value>, &str) = match top.get("text_config") {
            Some(Value::Object(o)) => (o, "text_config."),
            Some(other) => return Err(cfg_err("text_config", "an object", describe(other))),
            None => (top, ""),
        };
        let path = |k: &str| format!("{prefix}{k}");
        let get_usize = |k: &str| -> Result<usize> {
            match obj.get(k) {
                Some(v) => v
                    .as_u64()
                    .and_then(|u| usize::try_from(u).ok())
                    .ok_or_else(|| cfg_err(&path(k), "a non-negative integer", describe(v))),
                None => Err(cfg_err(&path(k), "a non-negative integer", "nothing")),
            }
        };
        let get_f64 = |o: &Map<String, Value>, p: &str, k: &str| -> Result<Option<f64>> {
            match o.get(k) {
                Some(v) => v
                    .as_f64()
                    .map(Some)
                    .ok_or_else(|| cfg_err(&format!("{p}{k}"), "a number", describe(v))),
                None => Ok(None),
            }
        };
        if let Some(v) = obj.get("hidden_act")
            && v.as_str() != Some("silu")
        {
            return Err(cfg_err(&path("hidden_act"), "\"silu\"", describe(v)));
        }
        if let Some(v) = obj.get("attention_bias")
            && v.as_bool() != Some(false)
        {
            return Err(cfg_err(&path("attention_bias"), "false", describe(v)));
        }
        let layers = get_usize("num_hidden_layers")?;
        let layer_types = match obj.get("layer_types") {
            Some(Value::Array(a)) => {
                if a.len() != layers {
                    return Err(cfg_err(
                        &path("layer_types"),
                        format!("{layers} entries (num_hidden_layers)"),
                        a.len(),
                    ));
                }
                a.iter()
                    .enumerate()
                    .map(|(i, v)| match v.as_str() {
                        Some("linear_attention") => Ok(LayerKind::LinearAttention),
                        Some("full_attention") => Ok(LayerKind::FullAttention),
                        _ => Err(cfg_err(
                            &format!("{prefix}layer_types[{i}]"),
                            "\"linear_attention\" or \"full_attention\"",
                            describe(v),
                        )),
                    })
                    .collect::<Result<Vec<_>>>()?
            }
            Some(other) => {
                return Err(cfg_err(
                    &path("layer_types"),
                    "an array of strings",
                    describe(other),
                ));
            }
            None => {
                let interval = match obj.get("full_attention_interval") {
                    Some(_) => get_usize("full_attention_interval")?,
                    None => 4,
                };
                hybrid_layer_types(layers, interval)
            }
        };
        let rope_obj = match obj.get("rope_parameters") {
            Some(Value::Object(o)) => Some(o),
            Some(other) => {
                return Err(cfg_err(
                    &path("rope_parameters"),
                    "an object",
                    describe(other),
                ));
            }
            None => None,
        };
        let rp = path("rope_parameters.");
        let rope_theta = match rope_obj {
            Some(o) => get_f64(o, &rp, "rope_theta")?,
            None => None,
        }
        .or(get_f64(obj, prefix, "rope_theta")?)
        .ok_or_else(|| cfg_err(&format!("{rp}rope_theta"), "a number", "nothing"))?;
        let partial = match rope_obj {
            Some(o) => get_f64(o, &rp, "partial_rotary_factor")?,
            None => None,
        }
        .or(get_f64(obj, prefix, "partial_rotary_factor")?)
        .unwrap_or(0.25);
        let tie = match (
            obj.get("tie_word_embeddings"),
            top.get("tie_word_embeddings"),
        ) {
            (Some(v), _) | (None, Some(v)) => v
                .as_bool()
                .ok_or_else(|| cfg_err("tie_word_embeddings", "a boolean", describe(v)))?,
            (None, None) => false,
        };
        let eos = match obj.get("eos_token_id").or(top.get("eos_token_id")) {
            Some(Value::Array(a)) => a.first().and_then(Value::as_u64),
            Some(v) => v.as_u64(),
            None => Some(0),
        }
        .and_then(|e| u32::try_from(e).ok())
        .ok_or_else(|| cfg_err(&path("eos_token_id"), "a token id", "something else"))?;
        let geo = TargetGeometry {
            hidden: get_usize("hidden_size")?,
            intermediate: get_usize("intermediate_size")?,
            layer_types,
            attn_heads: get_usize("num_attention_heads")?,
            kv_heads: get_usize("num_key_value_heads")?,
            head_dim: get_usize("head_dim")?,
            partial_rotary_factor: partial,
            rope_theta,
            linear_key_heads: get_usize("linear_num_key_heads")?,
            linear_value_heads: get_usize("linear_num_value_heads")?,
            linear_key_dim: get_usize("linear_key_head_dim")?,
            linear_value_dim: get_usize("linear_value_head_dim")?,
            conv_kernel: get_usize("linear_conv_kernel_dim")?,
            vocab_rows: get_usize("vocab_size")?,
            public_vocab,
            rms_eps: get_f64(obj, prefix, "rms_norm_eps")?.unwrap_or(1e-6),
            max_positions: get_usize("max_position_embeddings")?,
            eos_token_id: eos,
        };
        geo.validate()?;
        Ok((geo, tie))
    }
}

fn describe(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 60 {
        format!("{}...", s.chars().take(57).collect::<String>())
    } else {
        s
    }
}
