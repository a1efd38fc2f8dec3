//! chain_accept (placeholder: contract, reference, CUDA launcher and cases to be written).

use crate::registry::Case;

/// Registry id.
pub const OP: &str = "chain_accept";

/// Conformance cases.
pub(crate) fn cases() -> Vec<Case> {
    Vec::new()
}
