//! CUDA launcher of `candidate_selector` (kernels/candidate_selector.cu): one 512-thread block
//! per row. Per batch of up to 16 steps the block first forms every edge score the walk could
//! need (16 predecessors x 16 candidates a step, none waiting on a decision; each warp a 4 x 4
//! tile), then one warp walks the steps over those tables.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use crate::Result;
use crate::cuda::{CudaBackend, cuda_err};
use crate::rng::Purpose;

use super::{Inputs, OP, Outputs, Params, TOP_K};

pub(crate) const SOURCE: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../kernels/candidate_selector.cu"
));

/// Threads per block: 16 warps (`CS_THREADS` in the kernel).
const THREADS: u32 = (TOP_K * 32) as u32;

/// The rank chunk of the kernel's edge tables (`CS_RC`) and the steps of one batch (`CS_SB`).
const RANK_CHUNK: usize = 256;
const STEP_BATCH: usize = 16;

/// Dynamic shared memory of a block (`CS_SMEM_BYTES` in the kernel): one rank chunk of the 16
/// `a` rows (`[16, RANK_CHUNK]` f32), the edge tables of a batch (`[STEP_BATCH, 16, 16]` f32),
/// the batch's clamped ids (`[STEP_BATCH + 1, 16]` i32), its candidate ids as given
/// (`[STEP_BATCH, 16]` i32) and its uniforms (`[STEP_BATCH]` f32): 34944 bytes.
const SMEM_BYTES: u32 =
    ((TOP_K * RANK_CHUNK + STEP_BATCH * TOP_K * TOP_K + (2 * STEP_BATCH + 1) * TOP_K + STEP_BATCH)
        * 4) as u32;
// Under the 48 KiB every device gives a block without opting in.
const _: () = assert!(SMEM_BYTES as usize <= 48 * 1024);

/// Shapes were validated by `super::run` (rows >= 1, rank <= MAX_RANK, vocab <= MAX_VOCAB).
pub(super) fn run(c: &CudaBackend, i: &Inputs<'_>, o: &mut Outputs<'_>, p: &Params) -> Result<()> {
    let f = c.function(OP, SOURCE, "candidate_selector_walk")?;
    let cfg = LaunchConfig {
        grid_dim: (p.rows as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: SMEM_BYTES,
    };
    let (k, rank, vocab) = (p.k as i32, p.rank as i32, p.vocab as i32);
    let purpose = Purpose::Dflash2Proposal as u32;
    let mut b = c.stream().launch_builder(&f);
    b.arg(i.g.device(OP, "g")?);
    b.arg(i.cand_ids.device(OP, "cand_ids")?);
    b.arg(i.unary.device(OP, "unary")?);
    b.arg(i.w_pred.device(OP, "w_pred")?);
    b.arg(i.w_succ.device(OP, "w_succ")?);
    b.arg(i.anchors.device(OP, "anchors")?);
    b.arg(i.seeds.device(OP, "seeds")?);
    b.arg(i.start_pos.device(OP, "start_pos")?);
    b.arg(i.temperature.device(OP, "temperature")?);
    b.arg(o.proposals.device_mut(OP, "proposals")?);
    b.arg(o.q.device_mut(OP, "q")?);
    b.arg(o.chosen.device_mut(OP, "chosen")?);
    b.arg(&k);
    b.arg(&rank);
    b.arg(&vocab);
    b.arg(&purpose);
    // SAFETY: argument types and order match candidate_selector_walk; every buffer length was
    // checked against [rows, k, R] / [rows, k, 16] / [vocab, R] / [rows] by `super::run`, and
    // the kernel clamps ids into [0, vocab) before addressing a codebook.
    unsafe { b.launch(cfg) }.map_err(cuda_err("launching candidate_selector_walk"))?;
    Ok(())
}
