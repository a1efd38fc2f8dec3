//! feature_projection (placeholder: contract, reference, CUDA launcher and cases to be written).

use crate::registry::Case;

/// Registry id.
pub const OP: &str = "feature_projection";

/// Conformance cases.
pub(crate) fn cases() -> Vec<Case> {
    Vec::new()
}
