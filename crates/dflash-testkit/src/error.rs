//! The one error type of `dflash-testkit` (loading and writing reference checkpoints).

use std::path::PathBuf;

/// Everything that can go wrong loading or writing a reference target checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum TestkitError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A JSON file is not valid JSON.
    #[error("{path}: invalid JSON: {message}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// A config field is missing, of the wrong type or out of range.
    #[error("config `{field}`: expected {expected}, found {found}")]
    Config {
        /// JSON path of the field (e.g. `text_config.hidden_size`), or the option name.
        field: String,
        /// What is allowed.
        expected: String,
        /// What was found.
        found: String,
    },
    /// The safetensors file could not be parsed.
    #[error("{path}: safetensors: {message}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// The library's message.
        message: String,
    },
    /// A tensor the config implies is not in the checkpoint.
    #[error("tensor `{name}` is missing from the checkpoint")]
    MissingTensor {
        /// The tensor name.
        name: String,
    },
    /// A tensor does not have the shape the config implies.
    #[error("tensor `{name}`: expected shape {expected:?}, found {found:?}")]
    TensorShape {
        /// The tensor name.
        name: String,
        /// The shape the config implies.
        expected: Vec<usize>,
        /// The stored shape.
        found: Vec<usize>,
    },
    /// A tensor is stored in a dtype the loader does not read (BF16 and F32 are read).
    #[error("tensor `{name}`: dtype {found} is not supported (expected BF16 or F32)")]
    TensorDType {
        /// The tensor name.
        name: String,
        /// The stored dtype.
        found: String,
    },
    /// A tensor holds a non-finite value.
    #[error("tensor `{name}`[{index}] is not finite")]
    NonFinite {
        /// The tensor name.
        name: String,
        /// Flat index of the first non-finite element.
        index: usize,
    },
}

/// Result alias of this crate.
pub type Result<T, E = TestkitError> = std::result::Result<T, E>;
