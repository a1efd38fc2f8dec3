//! CPU reference of `embedding_gather`: validate every id, then copy rows.

use crate::{OpsError, Result, bf16};

use super::OP;

pub(super) fn run(
    ids: &[i32],
    table: &[bf16],
    out: &mut [bf16],
    vocab: usize,
    hidden: usize,
) -> Result<()> {
    // Validate everything before writing anything.
    for (r, &id) in ids.iter().enumerate() {
        if id < 0 || id as usize >= vocab {
            return Err(OpsError::Value {
                op: OP,
                tensor: "ids",
                index: r,
                expected: format!("a token id in 0..{vocab}"),
                found: id.to_string(),
            });
        }
    }
    if hidden == 0 {
        return Ok(());
    }
    for (row, &id) in out.chunks_exact_mut(hidden).zip(ids) {
        let s = id as usize * hidden;
        row.copy_from_slice(&table[s..s + hidden]);
    }
    Ok(())
}
