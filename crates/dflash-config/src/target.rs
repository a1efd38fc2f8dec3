//! The target fields the draft depends on, from a Qwen3.5 `config.json` and optionally its
//! `tokenizer.json`.

use serde_json::{Map, Value};

use crate::error::{ConfigError, Result};
use crate::json::{
    as_object, describe, index, join, parse_document, present, req_positive_u32, to_array, to_str,
    to_u32,
};

/// The target's text-model fields that the draft needs.
///
/// Only these fields are read; the rest of a target config (vision tower, MoE routing, Gated
/// DeltaNet sizes, ...) belongs to the embedding engine that owns the target and is ignored
/// here by design.
///
/// Two vocabulary sizes are kept apart. `vocab_size` is the number of rows of the target's
/// embedding and output head (Qwen3.5: 248320, padded). The *public* vocabulary is the number
/// of real token ids (Qwen3.5: 248077); rows at or above it are never tokens and are masked out
/// of every proposal and target distribution. The public size is never assumed equal to the
/// row count: it is `None` until the caller states it ([`TargetTextConfig::with_public_vocab_size`])
/// or counts it from the tokenizer ([`TargetTextConfig::with_tokenizer_json`]), and anything
/// that needs it ([`TargetTextConfig::public_vocab_size`], [`crate::StartupOptions::validate`])
/// returns [`ConfigError::PublicVocabUnknown`] while it is unknown.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetTextConfig {
    /// `model_type` of the text config (e.g. `"qwen3_5_text"`), if stated. Informational.
    pub model_type: Option<String>,
    /// Hidden width H (`hidden_size`).
    pub hidden_size: u32,
    /// Decoder block count (`num_hidden_layers`); target block ids must be below it.
    pub num_hidden_layers: u32,
    /// Embedding / output-head rows (`vocab_size`), including padding rows.
    pub vocab_size: u32,
    /// End-of-sequence ids (`eos_token_id`, an integer or a list; empty when absent). Each is
    /// below `vocab_size`, and below the public size once that is known.
    pub eos_token_ids: Vec<u32>,
    /// Public vocabulary size: see the type's documentation.
    pub public_vocab_size: Option<u32>,
}

fn parse_eos(v: &Value, path: &str) -> Result<Vec<u32>> {
    match v {
        Value::Array(a) => a
            .iter()
            .enumerate()
            .map(|(i, e)| to_u32(e, &index(path, i)))
            .collect(),
        other => Ok(vec![to_u32(other, path)?]),
    }
}

impl TargetTextConfig {
    /// Parse the target's `config.json`.
    ///
    /// Fields are read from the nested `text_config` object when there is one (the multimodal
    /// Qwen3.5 layout; error paths then start with `text_config.`), otherwise from the top level.
    /// `eos_token_id` is taken from `text_config`, falling back to the top level.
    pub fn from_json_str(text: &str) -> Result<Self> {
        Self::from_json_value(&parse_document(text)?)
    }

    /// [`TargetTextConfig::from_json_str`] on an already parsed document.
    pub fn from_json_value(doc: &Value) -> Result<Self> {
        let top = as_object(doc, "")?;
        let (obj, prefix): (&Map<String, Value>, &str) = match present(top, "text_config") {
            Some(v) => (as_object(v, "text_config")?, "text_config"),
            None => (top, ""),
        };
        let model_type = present(obj, "model_type")
            .map(|v| to_str(v, &join(prefix, "model_type")).map(str::to_owned))
            .transpose()?;
        let hidden_size = req_positive_u32(obj, prefix, "hidden_size")?;
        let num_hidden_layers = req_positive_u32(obj, prefix, "num_hidden_layers")?;
        let vocab_size = req_positive_u32(obj, prefix, "vocab_size")?;
        let eos_path = join(prefix, "eos_token_id");
        let (eos_token_ids, eos_path) =
            match (present(obj, "eos_token_id"), present(top, "eos_token_id")) {
                (Some(v), _) => (parse_eos(v, &eos_path)?, eos_path),
                (None, Some(v)) => (parse_eos(v, "eos_token_id")?, "eos_token_id".to_owned()),
                (None, None) => (Vec::new(), eos_path),
            };
        let cfg = Self {
            model_type,
            hidden_size,
            num_hidden_layers,
            vocab_size,
            eos_token_ids,
            public_vocab_size: None,
        };
        cfg.check_eos(cfg.vocab_size, "embedding rows", &eos_path)?;
        Ok(cfg)
    }

    fn check_eos(&self, bound: u32, what: &str, path: &str) -> Result<()> {
        for (i, &e) in self.eos_token_ids.iter().enumerate() {
            if e >= bound {
                return Err(ConfigError::OutOfRange {
                    path: index(path, i),
                    expected: format!("a token id below {bound} ({what})"),
                    found: e.to_string(),
                });
            }
        }
        Ok(())
    }

    /// Set the public vocabulary size explicitly (Qwen3.5: 248077).
    ///
    /// Errors with [`ConfigError::OutOfRange`] (path `public_vocab_size`) unless
    /// `1 <= n <= vocab_size`, or (path `eos_token_id[i]`, indexing
    /// [`TargetTextConfig::eos_token_ids`]) if an eos id is not below `n`.
    pub fn with_public_vocab_size(mut self, n: u32) -> Result<Self> {
        if n == 0 || n > self.vocab_size {
            return Err(ConfigError::OutOfRange {
                path: "public_vocab_size".to_owned(),
                expected: format!("1 ..= {} (the target's embedding rows)", self.vocab_size),
                found: n.to_string(),
            });
        }
        self.check_eos(n, "public vocabulary", "eos_token_id")?;
        self.public_vocab_size = Some(n);
        Ok(self)
    }

    /// Set the public vocabulary size to [`count_tokenizer_vocab`] of `tokenizer_json`.
    pub fn with_tokenizer_json(self, tokenizer_json: &str) -> Result<Self> {
        let n = count_tokenizer_vocab(tokenizer_json)?;
        self.with_public_vocab_size(n)
    }

    /// The public vocabulary size, or [`ConfigError::PublicVocabUnknown`] if it was never given.
    pub fn public_vocab_size(&self) -> Result<u32> {
        self.public_vocab_size
            .ok_or_else(|| ConfigError::PublicVocabUnknown {
                path: "public_vocab_size".to_owned(),
            })
    }
}

/// Count the token ids of a Hugging Face `tokenizer.json`.
///
/// The count is `max id + 1` over the ids of `model.vocab` (an object mapping token to id, as
/// in BPE, WordPiece and WordLevel models) and `added_tokens[*].id`. For a Unigram model,
/// whose `model.vocab` is an array of `[piece, score]` pairs, the ids of `model.vocab` are the
/// array positions `0..len`. Taking the maximum (not the number of entries) means a hole in the
/// id space still counts, and a token listed both in the vocab and in `added_tokens` counts once.
/// For Qwen3.5 this gives 248077 (BPE ids 0..248043 and 33 added tokens 248044..248076).
pub fn count_tokenizer_vocab(tokenizer_json: &str) -> Result<u32> {
    let doc = parse_document(tokenizer_json)?;
    let top = as_object(&doc, "")?;
    let model = present(top, "model")
        .ok_or_else(|| crate::json::missing("model".to_owned(), "the tokenizer model object"))?;
    let model = as_object(model, "model")?;
    let vocab = present(model, "vocab").ok_or_else(|| {
        crate::json::missing("model.vocab".to_owned(), "the tokenizer vocabulary")
    })?;
    // `count` is max id + 1 so far.
    let mut count: u64 = match vocab {
        Value::Object(map) => {
            let mut c = 0u64;
            for (tok, id) in map {
                let id = to_u32(id, &format!("model.vocab[{tok:?}]"))?;
                c = c.max(u64::from(id) + 1);
            }
            c
        }
        Value::Array(a) => a.len() as u64,
        other => {
            return Err(ConfigError::WrongType {
                path: "model.vocab".to_owned(),
                expected: "an object (token to id) or an array (Unigram pieces)",
                found: describe(other),
            });
        }
    };
    if let Some(added) = present(top, "added_tokens") {
        for (i, t) in to_array(added, "added_tokens")?.iter().enumerate() {
            let p = index("added_tokens", i);
            let t = as_object(t, &p)?;
            let id_path = join(&p, "id");
            let id = present(t, "id")
                .ok_or_else(|| crate::json::missing(id_path.clone(), "a token id"))?;
            let id = to_u32(id, &id_path)?;
            count = count.max(u64::from(id) + 1);
        }
    }
    if count == 0 {
        return Err(ConfigError::OutOfRange {
            path: "model.vocab".to_owned(),
            expected: "at least one token".to_owned(),
            found: "none".to_owned(),
        });
    }
    u32::try_from(count).map_err(|_| ConfigError::OutOfRange {
        path: "model.vocab".to_owned(),
        expected: format!("at most {} token ids", u32::MAX),
        found: count.to_string(),
    })
}
