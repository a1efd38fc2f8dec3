//! CPU reference of `sliding_window_attention`: validate the row metadata and lanes, then
//! evaluate the shared f64 attention with the ring context map and window S.

use half::bf16;

use super::{LocalAttentionParams, OP};
use crate::softmax_attention::attend::{self, ContextMap, Geometry, Inputs};
use crate::{OpsError, Result};

/// Context position `p` of row `r` lives in ring slot `lanes[r] * S + p mod S`.
struct Ring<'a> {
    lanes: &'a [i32],
    window: usize,
}

impl ContextMap for Ring<'_> {
    fn window(&self) -> Option<usize> {
        Some(self.window)
    }

    fn slot(&self, r: usize, p: usize) -> usize {
        self.lanes[r] as usize * self.window + p % self.window
    }
}

pub(super) fn run(
    g: &Geometry,
    p: &LocalAttentionParams,
    x: Inputs<'_>,
    lanes: &[i32],
    out: &mut [bf16],
) -> Result<()> {
    attend::check_rows(OP, g.cols, x.start_pos, x.live)?;
    for (r, &lane) in lanes.iter().enumerate() {
        if lane < 0 || lane as usize >= p.lanes {
            return Err(OpsError::Value {
                op: OP,
                tensor: "lanes",
                index: r,
                expected: format!("a ring lane in 0..{}", p.lanes),
                found: lane.to_string(),
            });
        }
    }
    let ctx = Ring {
        lanes,
        window: p.window,
    };
    attend::reference(g, &ctx, &x, out);
    Ok(())
}
