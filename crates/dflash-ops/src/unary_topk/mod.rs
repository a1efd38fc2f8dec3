//! unary_topk (placeholder: contract, reference, CUDA launcher and cases to be written).

use crate::registry::Case;

/// Registry id.
pub const OP: &str = "unary_topk";

/// Conformance cases.
pub(crate) fn cases() -> Vec<Case> {
    Vec::new()
}
