//! CPU reference of `context_kv_materialize`: validate every caller guarantee, then project,
//! normalize, rotate and store the stored columns in f64, rounding once per stored value.

use half::{bf16, f16};

use crate::bf16_rne_f64;
use crate::gemm::reference::matmul_f64;
use crate::head_norm_rope::reference::head_norm_rope_f64;
use crate::{OpsError, Result};

use super::{CacheLayout, MaterializeParams, OP, slot_of, stored_columns};

fn value_err(tensor: &'static str, index: usize, expected: String, found: String) -> OpsError {
    OpsError::Value {
        op: OP,
        tensor,
        index,
        expected,
        found,
    }
}

/// Every (row, column, position, slot) the call stores, after checking the metadata.
fn plan(
    start_pos: &[i32],
    counts: &[i32],
    slots: &[i32],
    p: &MaterializeParams,
) -> Result<Vec<(usize, usize, u64, usize)>> {
    for (r, &c) in counts.iter().enumerate() {
        if c < 0 || c as usize > p.cols {
            return Err(value_err(
                "counts",
                r,
                format!("a live count in 0..={}", p.cols),
                c.to_string(),
            ));
        }
    }
    for (r, &s) in start_pos.iter().enumerate() {
        if s < 0 {
            return Err(value_err(
                "start_pos",
                r,
                "a position >= 0".into(),
                s.to_string(),
            ));
        }
    }
    let mut out = Vec::new();
    for r in 0..p.rows {
        for i in stored_columns(&p.layout, counts[r] as usize) {
            let pos = (i64::from(start_pos[r]) + i as i64) as u64;
            let Some(slot) = slot_of(&p.layout, slots, r, pos) else {
                return Err(match p.layout {
                    CacheLayout::Ring { lanes, .. } => value_err(
                        "slots",
                        r,
                        format!("a lane in 0..{lanes} (row {r} has live columns)"),
                        slots[r].to_string(),
                    ),
                    CacheLayout::Paged {
                        pages,
                        page_size,
                        max_pages,
                    } => {
                        let idx = pos / page_size as u64;
                        if idx >= max_pages as u64 {
                            value_err(
                                "start_pos",
                                r,
                                format!(
                                    "positions whose page index p / {page_size} < max_pages \
                                     {max_pages} (column {i} is at {pos})"
                                ),
                                start_pos[r].to_string(),
                            )
                        } else {
                            let flat = r * max_pages + idx as usize;
                            value_err(
                                "slots",
                                flat,
                                format!("a page id in 0..{pages} (row {r}, position {pos})"),
                                slots[flat].to_string(),
                            )
                        }
                    }
                });
            };
            out.push((r, i, pos, slot));
        }
    }
    // No two stored columns may share a slot (on CUDA they would race).
    let mut by_slot: Vec<(usize, usize, u64)> = out.iter().map(|&(r, _, p, s)| (s, r, p)).collect();
    by_slot.sort_unstable();
    for w in by_slot.windows(2) {
        if w[0].0 == w[1].0 {
            let (slot, r0, p0) = w[0];
            let (_, r1, p1) = w[1];
            return Err(value_err(
                "slots",
                match p.layout {
                    CacheLayout::Ring { .. } => r1,
                    CacheLayout::Paged { max_pages, .. } => r1 * max_pages,
                },
                format!(
                    "distinct slots for every stored column (row {r0} position {p0} also writes slot {slot})"
                ),
                format!("row {r1} position {p1} -> slot {slot}"),
            ));
        }
    }
    Ok(out)
}

#[allow(clippy::too_many_arguments)] // reason: mirrors the op's tensor list
pub(super) fn run(
    features: &[bf16],
    w_k: &[bf16],
    w_v: &[bf16],
    key_norm: &[bf16],
    start_pos: &[i32],
    counts: &[i32],
    slots: &[i32],
    cache_k: &mut [bf16],
    cache_v: &mut [f16],
    p: &MaterializeParams,
) -> Result<()> {
    let plan = plan(start_pos, counts, slots, p)?; // validates before any write
    if plan.is_empty() {
        return Ok(());
    }
    let (h, d) = (p.hidden, p.head_dim);
    let kvd = p.kv_heads * d;
    // Gather the stored feature columns and project them all at once.
    let mut c = Vec::with_capacity(plan.len() * h);
    for &(r, i, _, _) in &plan {
        let at = (r * p.cols + i) * h;
        c.extend_from_slice(&features[at..at + h]);
    }
    let k_raw = matmul_f64(&c, w_k, plan.len(), kvd, h);
    let v_raw = matmul_f64(&c, w_v, plan.len(), kvd, h);
    let mut k = vec![0f64; d];
    for (n, &(_, _, pos, slot)) in plan.iter().enumerate() {
        for head in 0..p.kv_heads {
            let src = n * kvd + head * d;
            let dst = slot * kvd + head * d;
            head_norm_rope_f64(
                &k_raw[src..src + d],
                key_norm,
                pos as i64,
                p.theta,
                p.eps,
                &mut k,
            );
            for j in 0..d {
                cache_k[dst + j] = bf16_rne_f64(k[j]);
                cache_v[dst + j] = f16::from_f32(bf16_rne_f64(v_raw[src + j]).to_f32());
            }
        }
    }
    Ok(())
}
