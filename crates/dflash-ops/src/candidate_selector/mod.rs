//! candidate_selector (placeholder: contract, reference, CUDA launcher and cases to be written).

use crate::registry::Case;

/// Registry id.
pub const OP: &str = "candidate_selector";

/// Conformance cases.
pub(crate) fn cases() -> Vec<Case> {
    Vec::new()
}
