//! The one error type of `dflash-ops`.

use crate::DType;

/// Everything that can go wrong when calling an op or managing buffers.
#[derive(Debug, thiserror::Error)]
pub enum OpsError {
    /// A tensor argument does not have the number of elements its shape requires.
    #[error("{op}: tensor `{tensor}` must have {expected} elements ({shape}), found {found}")]
    Length {
        /// The op (registry id) that refused the call.
        op: &'static str,
        /// The argument name, as in the op's contract.
        tensor: &'static str,
        /// The expected element count.
        expected: usize,
        /// The shape the count was derived from, in words.
        shape: String,
        /// The element count actually passed.
        found: usize,
    },
    /// A scalar parameter is out of the range the contract allows.
    #[error("{op}: parameter `{param}` = {found}, expected {expected}")]
    Param {
        /// The op (registry id) that refused the call.
        op: &'static str,
        /// The parameter name.
        param: &'static str,
        /// What the contract allows.
        expected: String,
        /// What was passed.
        found: String,
    },
    /// An element of an input tensor violates the contract (an id out of range, a NaN, ...).
    #[error("{op}: `{tensor}`[{index}] = {found}, expected {expected}")]
    Value {
        /// The op (registry id) that refused the call.
        op: &'static str,
        /// The argument name.
        tensor: &'static str,
        /// The flat index of the first offending element.
        index: usize,
        /// What the contract allows.
        expected: String,
        /// What was found.
        found: String,
    },
    /// A buffer was passed to a backend it does not live on.
    #[error("{op}: tensor `{tensor}` lives on the {found} backend, the call runs on {expected}")]
    WrongBackend {
        /// The op or buffer operation.
        op: &'static str,
        /// The argument name.
        tensor: &'static str,
        /// The backend the call runs on.
        expected: &'static str,
        /// The backend the buffer lives on.
        found: &'static str,
    },
    /// An output or written buffer is a read-only [`crate::Borrowed`] view of the caller's
    /// memory.
    #[error("{op}: tensor `{tensor}` is a borrowed read-only view; it cannot be written")]
    ReadOnly {
        /// The op or buffer operation.
        op: &'static str,
        /// The argument name.
        tensor: &'static str,
    },
    /// A CUDA graph capture ([`crate::Backend::capture`]) was refused or failed, or a call
    /// that cannot be recorded (a host read or write, a synchronize, an allocation) came
    /// while one was in progress.
    #[error("graph capture: {problem}")]
    Capture {
        /// What was refused and why.
        problem: String,
    },
    /// A [`crate::Borrowed`] view of caller memory was refused.
    #[error("borrowing caller memory: {problem}")]
    Borrow {
        /// What the address or range failed.
        problem: String,
    },
    /// A range of a buffer lies outside it.
    #[error("{op}: range {start}..{end} of `{tensor}` is outside its {len} elements")]
    Range {
        /// The op or buffer operation.
        op: &'static str,
        /// The argument name.
        tensor: &'static str,
        /// Range start.
        start: usize,
        /// Range end (exclusive).
        end: usize,
        /// The buffer length.
        len: usize,
    },
    /// A dtype other than the one the contract names was passed.
    #[error("{op}: tensor `{tensor}` must be {expected}, found {found}")]
    DType {
        /// The op.
        op: &'static str,
        /// The argument name.
        tensor: &'static str,
        /// The contracted dtype.
        expected: DType,
        /// The dtype passed.
        found: DType,
    },
    /// The CUDA backend was requested but this build has no `cuda` feature.
    #[error("the CUDA backend is not compiled in: build with `--features cuda`")]
    CudaNotCompiled,
    /// A CUDA driver, NVRTC or cuBLAS call failed.
    #[error("CUDA: {context}: {message}")]
    Cuda {
        /// What the backend was doing.
        context: String,
        /// The library's message.
        message: String,
    },
}

/// Result alias of this crate.
pub type Result<T, E = OpsError> = std::result::Result<T, E>;

/// Check that `tensor` of `op` has exactly `expected` elements.
pub fn check_len(
    op: &'static str,
    tensor: &'static str,
    found: usize,
    expected: usize,
    shape: impl FnOnce() -> String,
) -> Result<()> {
    if found == expected {
        Ok(())
    } else {
        Err(OpsError::Length {
            op,
            tensor,
            expected,
            shape: shape(),
            found,
        })
    }
}

/// Check that a parameter satisfies `ok`, describing the allowed range in `expected`.
pub fn check_param(
    op: &'static str,
    param: &'static str,
    ok: bool,
    found: impl std::fmt::Display,
    expected: impl FnOnce() -> String,
) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(OpsError::Param {
            op,
            param,
            expected: expected(),
            found: found.to_string(),
        })
    }
}
