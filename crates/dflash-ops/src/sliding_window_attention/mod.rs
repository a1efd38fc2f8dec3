//! sliding_window_attention (placeholder: contract, reference, CUDA launcher and cases to be written).

use crate::registry::Case;

/// Registry id.
pub const OP: &str = "sliding_window_attention";

/// Conformance cases.
pub(crate) fn cases() -> Vec<Case> {
    Vec::new()
}
