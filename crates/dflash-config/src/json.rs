//! Small, panic-free readers over `serde_json::Value` that report errors with JSON paths.

use serde_json::{Map, Value};

use crate::error::{ConfigError, Result};

/// A field of the document that this crate does not recognise. It is handed back to the caller
/// (never dropped silently); in [`ParseMode::Strict`] its presence is an error.
#[derive(Debug, Clone, PartialEq)]
pub struct UnknownField {
    /// JSON path of the field, e.g. `dflash_config.new_knob`.
    pub path: String,
    /// Its value, as found.
    pub value: Value,
}

/// How to treat fields the parser does not recognise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ParseMode {
    /// Accept them and return them in [`Parsed::unknown_fields`].
    #[default]
    Lenient,
    /// Refuse the document with [`ConfigError::UnknownFields`] if there is any.
    Strict,
}

impl std::fmt::Display for UnknownField {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "`{}` = {}: unknown field, not read",
            self.path,
            describe(&self.value)
        )
    }
}

/// Something the parser decided on the reader's behalf that a user should know about: a value
/// it derived or a default it chose for an absent field where public implementations differ.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigNote {
    /// JSON path of the field the note is about, e.g. `is_causal`.
    pub path: String,
    /// What the parser assumed, and why it says so.
    pub message: String,
}

impl std::fmt::Display for ConfigNote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "`{}`: {}", self.path, self.message)
    }
}

/// A parsed value together with its report: the fields that were not recognised and the
/// notes on what the parser assumed.
#[derive(Debug, Clone, PartialEq)]
pub struct Parsed<T> {
    /// The parsed and validated value.
    pub value: T,
    /// Unrecognised fields in document order (always empty in strict mode).
    pub unknown_fields: Vec<UnknownField>,
    /// Notes on derived values and defaults, in the order the parser made them.
    pub notes: Vec<ConfigNote>,
}

pub(crate) fn parse_document(text: &str) -> Result<Value> {
    serde_json::from_str(text).map_err(|e| {
        let full = e.to_string();
        let position = format!(" at line {} column {}", e.line(), e.column());
        ConfigError::Json {
            path: String::new(),
            line: e.line(),
            column: e.column(),
            message: full.strip_suffix(&position).unwrap_or(&full).to_owned(),
        }
    })
}

/// Join a parent path and a key.
pub(crate) fn join(parent: &str, key: &str) -> String {
    if parent.is_empty() {
        key.to_owned()
    } else {
        format!("{parent}.{key}")
    }
}

pub(crate) fn index(parent: &str, i: usize) -> String {
    format!("{parent}[{i}]")
}

/// A short, bounded rendering of a value for error messages.
pub(crate) fn describe(v: &Value) -> String {
    const MAX: usize = 64;
    let s = match v {
        Value::Null => "null".to_owned(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => format!("{s:?}"),
        Value::Array(a) => format!("an array of {} elements", a.len()),
        Value::Object(o) => format!("an object with {} fields", o.len()),
    };
    if s.chars().count() > MAX {
        let mut t: String = s.chars().take(MAX).collect();
        t.push('…');
        t
    } else {
        s
    }
}

/// The document root (or a nested config) as an object.
pub(crate) fn as_object<'a>(v: &'a Value, path: &str) -> Result<&'a Map<String, Value>> {
    v.as_object().ok_or_else(|| ConfigError::WrongType {
        path: path.to_owned(),
        expected: "an object",
        found: describe(v),
    })
}

/// The value of `key` unless it is absent or `null`.
pub(crate) fn present<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

pub(crate) fn missing(path: String, expected: &str) -> ConfigError {
    ConfigError::Missing {
        path,
        expected: expected.to_owned(),
    }
}

/// A non-negative integer that fits in `u32`.
pub(crate) fn to_u32(v: &Value, path: &str) -> Result<u32> {
    match v {
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                u32::try_from(u).map_err(|_| ConfigError::OutOfRange {
                    path: path.to_owned(),
                    expected: format!("an integer at most {}", u32::MAX),
                    found: n.to_string(),
                })
            } else if n.is_i64() {
                Err(ConfigError::OutOfRange {
                    path: path.to_owned(),
                    expected: "a non-negative integer".to_owned(),
                    found: n.to_string(),
                })
            } else {
                Err(ConfigError::WrongType {
                    path: path.to_owned(),
                    expected: "an integer",
                    found: n.to_string(),
                })
            }
        }
        other => Err(ConfigError::WrongType {
            path: path.to_owned(),
            expected: "an integer",
            found: describe(other),
        }),
    }
}

/// Like [`to_u32`] but also refuses zero.
pub(crate) fn to_positive_u32(v: &Value, path: &str) -> Result<u32> {
    let x = to_u32(v, path)?;
    if x == 0 {
        return Err(ConfigError::OutOfRange {
            path: path.to_owned(),
            expected: "an integer > 0".to_owned(),
            found: "0".to_owned(),
        });
    }
    Ok(x)
}

pub(crate) fn to_f64(v: &Value, path: &str) -> Result<f64> {
    v.as_f64().ok_or_else(|| ConfigError::WrongType {
        path: path.to_owned(),
        expected: "a number",
        found: describe(v),
    })
}

pub(crate) fn to_bool(v: &Value, path: &str) -> Result<bool> {
    v.as_bool().ok_or_else(|| ConfigError::WrongType {
        path: path.to_owned(),
        expected: "a boolean",
        found: describe(v),
    })
}

pub(crate) fn to_str<'a>(v: &'a Value, path: &str) -> Result<&'a str> {
    v.as_str().ok_or_else(|| ConfigError::WrongType {
        path: path.to_owned(),
        expected: "a string",
        found: describe(v),
    })
}

pub(crate) fn to_array<'a>(v: &'a Value, path: &str) -> Result<&'a [Value]> {
    v.as_array()
        .map(Vec::as_slice)
        .ok_or_else(|| ConfigError::WrongType {
            path: path.to_owned(),
            expected: "an array",
            found: describe(v),
        })
}

/// Required positive integer field.
pub(crate) fn req_positive_u32(obj: &Map<String, Value>, parent: &str, key: &str) -> Result<u32> {
    let path = join(parent, key);
    match present(obj, key) {
        Some(v) => to_positive_u32(v, &path),
        None => Err(missing(path, "a positive integer")),
    }
}

/// Optional positive integer field (`null` counts as absent).
pub(crate) fn opt_positive_u32(
    obj: &Map<String, Value>,
    parent: &str,
    key: &str,
) -> Result<Option<u32>> {
    present(obj, key)
        .map(|v| to_positive_u32(v, &join(parent, key)))
        .transpose()
}

/// Optional non-negative integer field (`null` counts as absent).
pub(crate) fn opt_u32(obj: &Map<String, Value>, parent: &str, key: &str) -> Result<Option<u32>> {
    present(obj, key)
        .map(|v| to_u32(v, &join(parent, key)))
        .transpose()
}

/// Apply the parse mode to the collected unknown fields.
pub(crate) fn finish<T>(
    value: T,
    unknown_fields: Vec<UnknownField>,
    notes: Vec<ConfigNote>,
    mode: ParseMode,
) -> Result<Parsed<T>> {
    if mode == ParseMode::Strict
        && let Some(first) = unknown_fields.first()
    {
        return Err(ConfigError::UnknownFields {
            path: first.path.clone(),
            all: unknown_fields.iter().map(|u| u.path.clone()).collect(),
        });
    }
    Ok(Parsed {
        value,
        unknown_fields,
        notes,
    })
}
