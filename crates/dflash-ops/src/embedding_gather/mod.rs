//! embedding_gather (placeholder: contract, reference, CUDA launcher and cases to be written).

use crate::registry::Case;

/// Registry id.
pub const OP: &str = "embedding_gather";

/// Conformance cases.
pub(crate) fn cases() -> Vec<Case> {
    Vec::new()
}
