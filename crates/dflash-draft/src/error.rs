//! The one error type of `dflash-draft`.

use dflash_config::ConfigError;
use dflash_context::ContextError;
use dflash_ops::OpsError;

/// Everything that can go wrong when loading a draft, binding its weights, prefilling its
/// context, running its block forward or using the inspection tool.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DraftError {
    /// A file could not be read, mapped or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// A file could not be written (the inspection tool's output, a generated inputs file).
    #[error("cannot write {path}: {message}")]
    Write {
        /// The file.
        path: String,
        /// The operating system's (or serializer's) error.
        message: String,
    },
    /// A draft `config.json` is invalid or does not fit the target; `path` names the file,
    /// `source` the field.
    #[error("{path}: {source}")]
    ConfigFile {
        /// The config file.
        path: String,
        /// What is wrong, at which JSON path.
        source: Box<ConfigError>,
    },
    /// A command-line argument of the inspection tool is missing, repeated, unknown or
    /// malformed.
    #[error("`{flag}`: expected {expected}, found {found}")]
    Argument {
        /// The flag as the user typed it (`--model`, `--mask-token-id`).
        flag: String,
        /// What is accepted.
        expected: String,
        /// What was given.
        found: String,
    },
    /// A safetensors file is malformed (header, offsets, dtype tags).
    #[error("{path}: not a valid safetensors file: {message}")]
    Safetensors {
        /// The file.
        path: String,
        /// The parser's message.
        message: String,
    },
    /// `model.safetensors.index.json` is malformed or disagrees with its shards.
    #[error("{path}: {problem}")]
    ShardIndex {
        /// The index file.
        path: String,
        /// What is wrong.
        problem: String,
    },
    /// The checkpoint has neither `model.safetensors` nor `model.safetensors.index.json`.
    #[error("{dir}: no `model.safetensors` or `model.safetensors.index.json`")]
    NoWeights {
        /// The checkpoint directory.
        dir: String,
    },
    /// The draft or target config is invalid, or does not fit the checkpoint.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A tensor the config requires is absent from the checkpoint.
    #[error("tensor `{name}` is missing (expected {dtype} {shape:?})")]
    MissingTensor {
        /// The published (canonical) tensor name.
        name: String,
        /// The expected dtype.
        dtype: &'static str,
        /// The expected shape.
        shape: Vec<usize>,
    },
    /// A stored tensor is not one the config expects.
    #[error("unexpected tensor `{stored}` in {file}{}", canonical_note(.stored, .canonical))]
    UnexpectedTensor {
        /// The name as stored.
        stored: String,
        /// The name after prefix normalization.
        canonical: String,
        /// The file holding it.
        file: String,
    },
    /// Two stored tensors map to the same published name (e.g. `fc.weight` and
    /// `model.fc.weight`).
    #[error("tensor `{name}` is stored twice: as `{first}` and as `{second}`")]
    DuplicateTensor {
        /// The published name.
        name: String,
        /// The first stored name.
        first: String,
        /// The second stored name.
        second: String,
    },
    /// A tensor does not have the shape the config implies.
    #[error("tensor `{name}`: expected shape {expected:?}, found {found:?}")]
    TensorShape {
        /// The tensor (published name, or the tool's input/output name).
        name: String,
        /// The expected shape.
        expected: Vec<usize>,
        /// The stored shape.
        found: Vec<usize>,
    },
    /// A tensor does not have the dtype it must have.
    #[error("tensor `{name}`: expected dtype {expected}, found {found}")]
    TensorDType {
        /// The tensor.
        name: String,
        /// The required dtype (`BF16`, `I32`, ...).
        expected: String,
        /// The stored dtype.
        found: String,
    },
    /// A target part (embedding, output head, shortlist) passed by the caller does not fit.
    #[error("target part `{part}`: {problem}")]
    TargetPart {
        /// Which part.
        part: &'static str,
        /// What is wrong (expected vs found).
        problem: String,
    },
    /// A per-round request (anchor, usable count, temperature, handle) or a batch is invalid.
    #[error("batch row {row}: `{field}` = {found}, expected {expected}")]
    Row {
        /// The row in the compact batch.
        row: usize,
        /// The offending field.
        field: &'static str,
        /// What is allowed.
        expected: String,
        /// What was passed.
        found: String,
    },
    /// A workspace, batch or tool argument is out of range.
    #[error("`{what}` = {found}, expected {expected}")]
    Invalid {
        /// The argument.
        what: String,
        /// What is allowed.
        expected: String,
        /// What was passed.
        found: String,
    },
    /// A tensor of the inspection tool's input file is missing, extra or malformed.
    #[error("inputs file {path}: {problem}")]
    InputFile {
        /// The inputs file.
        path: String,
        /// What is wrong.
        problem: String,
    },
    /// The context store refused an operation.
    #[error(transparent)]
    Context(#[from] ContextError),
    /// An op or buffer operation failed (shape, backend, device).
    #[error(transparent)]
    Ops(#[from] OpsError),
}

fn canonical_note(stored: &str, canonical: &str) -> String {
    if stored == canonical {
        String::new()
    } else {
        format!(" (read as `{canonical}`)")
    }
}

/// Result alias of this crate.
pub type Result<T, E = DraftError> = std::result::Result<T, E>;

impl DraftError {
    pub(crate) fn io(path: impl AsRef<std::path::Path>, source: std::io::Error) -> Self {
        DraftError::Io {
            path: path.as_ref().display().to_string(),
            source,
        }
    }

    /// [`DraftError::Write`] for `path`.
    pub(crate) fn write(
        path: impl AsRef<std::path::Path>,
        message: impl std::fmt::Display,
    ) -> Self {
        DraftError::Write {
            path: path.as_ref().display().to_string(),
            message: message.to_string(),
        }
    }

    /// [`DraftError::Write`] for a failed safetensors serialization to `path` (an I/O error
    /// is shown as the operating system's message).
    pub(crate) fn serialize(
        path: impl AsRef<std::path::Path>,
        e: safetensors::SafeTensorError,
    ) -> Self {
        match e {
            safetensors::SafeTensorError::IoError(io) => Self::write(path, io),
            other => Self::write(path, other),
        }
    }

    pub(crate) fn invalid(
        what: impl Into<String>,
        expected: impl Into<String>,
        found: impl std::fmt::Display,
    ) -> Self {
        DraftError::Invalid {
            what: what.into(),
            expected: expected.into(),
            found: found.to_string(),
        }
    }
}
