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

/// A parsed value together with the fields that were not recognised.
#[derive(Debug, Clone, PartialEq)]
pub struct Parsed<T> {
    /// The parsed and validated value.
    pub value: T,
    /// Unrecognised fields in document order (always empty in strict mode).
    pub unknown_fields: Vec<UnknownField>,
}

pub(crate) fn parse_document(text: &str) -> Result<Value> {
    serde_json::from_str(text).map_err(|e| ConfigError::Json {
        path: String::new(),
        line: e.line(),
        column: e.column(),
        message: e.to_string(),
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

/// Collect the keys of `obj` not listed in `known`, in document order.
pub(crate) fn collect_unknown(
    obj: &Map<String, Value>,
    parent: &str,
    known: &[&str],
    out: &mut Vec<UnknownField>,
) {
    for (k, v) in obj {
        if !known.contains(&k.as_str()) {
            out.push(UnknownField {
                path: join(parent, k),
                value: v.clone(),
            });
        }
    }
}

/// Apply the parse mode to the collected unknown fields.
pub(crate) fn finish<T>(
    value: T,
    unknown_fields: Vec<UnknownField>,
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
    })
}
