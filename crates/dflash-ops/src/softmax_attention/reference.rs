//! CPU reference of `softmax_attention`: validate the row metadata and the used page-table
//! entries, then evaluate the shared f64 attention with the paged context map.

use half::bf16;

use super::attend::{self, ContextMap, Geometry, Inputs};
use super::{FullAttentionParams, OP};
use crate::{OpsError, Result};

/// Context position `p` of row `r` lives in page `table[r][p / page_size]`, slot
/// `p % page_size`.
struct Paged<'a> {
    table: &'a [i32],
    max_pages: usize,
    page_size: usize,
}

impl ContextMap for Paged<'_> {
    fn window(&self) -> Option<usize> {
        None
    }

    fn slot(&self, r: usize, p: usize) -> usize {
        let page = self.table[r * self.max_pages + p / self.page_size] as usize;
        page * self.page_size + p % self.page_size
    }
}

pub(super) fn run(
    g: &Geometry,
    p: &FullAttentionParams,
    x: Inputs<'_>,
    table: &[i32],
    out: &mut [bf16],
) -> Result<()> {
    attend::check_rows(OP, g.cols, x.start_pos, x.live)?;
    let capacity = p.max_pages * p.page_size;
    for (r, &f) in x.start_pos.iter().enumerate() {
        let f = f as usize;
        if f > capacity {
            return Err(OpsError::Value {
                op: OP,
                tensor: "start_pos",
                index: r,
                expected: format!("a context frontier <= max_pages * page_size = {capacity}"),
                found: f.to_string(),
            });
        }
        for k in 0..f.div_ceil(p.page_size) {
            let e = table[r * p.max_pages + k];
            if e < 0 || e as usize >= p.pages {
                return Err(OpsError::Value {
                    op: OP,
                    tensor: "page_table",
                    index: r * p.max_pages + k,
                    expected: format!(
                        "a page id in 0..{} (row {r} uses {} pages for its {f} positions)",
                        p.pages,
                        f.div_ceil(p.page_size)
                    ),
                    found: e.to_string(),
                });
            }
        }
    }
    let ctx = Paged {
        table,
        max_pages: p.max_pages,
        page_size: p.page_size,
    };
    attend::reference(g, &ctx, &x, out);
    Ok(())
}
