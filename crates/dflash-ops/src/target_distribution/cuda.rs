//! CUDA launcher of `target_distribution` (kernels/target_distribution.cu).

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig};

use crate::cuda::{CudaBackend, RawArg};
use crate::{Buffer, Result};

use super::{Columns, History, Logits, OP, Outputs, Params, Sampling};

pub(crate) const SOURCE: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../kernels/target_distribution.cu"
));

/// Threads per block (must match `TD_THREADS` in the kernel, whose 16-byte first pass maps
/// 128 threads to each 512-id chunk).
const THREADS: u32 = 512;
const _: () = assert!(THREADS == 512);

/// Blocks per verify column when the backend launches clusters (`CudaBackend::uses_clusters`:
/// one cluster a column, each block streaming an eighth of the vocabulary); one block a column
/// otherwise. Fixed, not chosen per call, so that a column's `p` never depends on the batch
/// it is verified in (the blocks' parts of `S` are summed in rank order).
const CLUSTER: u32 = 8;

pub(super) fn run(
    c: &CudaBackend,
    logits: Logits<'_>,
    columns: Columns<'_>,
    live: &Buffer<i32>,
    counts: &Buffer<i32>,
    history: History<'_>,
    s: &Sampling<'_>,
    out: Outputs<'_>,
    params: &Params,
) -> Result<()> {
    let cluster = if c.uses_clusters() { CLUSTER } else { 1 };
    let blocks = params.rows * params.cols * cluster as usize;
    if blocks == 0 {
        return Ok(());
    }
    let grid = u32::try_from(blocks).map_err(|_| crate::OpsError::Param {
        op: OP,
        param: "rows",
        expected: format!("rows * cols * {cluster} below 2^32 blocks"),
        found: params.rows.to_string(),
    })?;
    let entry = match logits {
        Logits::F32(_) => "target_distribution_kernel",
        Logits::Bf16(_) => "target_distribution_bf16_kernel",
    };
    let f = c.function(OP, SOURCE, entry)?;
    // Static shapes, validated by `run_with` (cols <= 256, vocab <= 2^30, the logits a whole
    // number of vocab-columns).
    let rows = params.rows as i32;
    let cols = params.cols as i32;
    let vocab = params.vocab as i32;
    let public_vocab = params.public_vocab as i32;
    let logit_cols = (logits.len() / params.vocab) as i64;
    // Padded: the kernel computes r * cols + i and never reads `col_start` (the live counts
    // are a well-typed placeholder).
    let (col_start, starts) = match columns {
        Columns::Padded => (live, 0i32),
        Columns::Starts(b) => (b, 1i32),
    };
    // Chain: the kernel never reads `parents` (has_parents = 0; the proposals are a
    // well-typed placeholder).
    let (tokens, parents, has_parents) = match history {
        History::Chain(d) => (d, d, 0i32),
        History::Tree { tokens, parents } => (tokens, parents, 1i32),
    };
    // Full: the kernel never writes `greedy` (live_form = 0); the live counts are a
    // well-typed placeholder that is never written.
    let (p, greedy, live_form) = match out {
        Outputs::Full(p) => (p, None, 0i32),
        Outputs::Live { p, greedy } => (p, Some(greedy), 1i32),
    };
    let cfg = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let stream = c.stream();
    let (logits_p, _l) = match logits {
        Logits::F32(l) => l.device(OP, "logits")?.device_ptr(stream),
        Logits::Bf16(l) => l.device(OP, "logits")?.device_ptr(stream),
    };
    let (start_p, _cs) = col_start.device(OP, "col_start")?.device_ptr(stream);
    let (live_p, _lv) = live.device(OP, "live")?.device_ptr(stream);
    let (counts_p, _ct) = counts.device(OP, "counts")?.device_ptr(stream);
    let (tok_p, _tk) = tokens.device(OP, history.tokens_name())?.device_ptr(stream);
    let (par_p, _pa) = parents.device(OP, "parents")?.device_ptr(stream);
    let (t_p, _t) = s.temperature.device(OP, "temperature")?.device_ptr(stream);
    let (k_p, _k) = s.top_k.device(OP, "top_k")?.device_ptr(stream);
    let (tp_p, _tp) = s.top_p.device(OP, "top_p")?.device_ptr(stream);
    let (mp_p, _mp) = s.min_p.device(OP, "min_p")?.device_ptr(stream);
    let (rep_p, _rep) = s
        .repetition_penalty
        .device(OP, "repetition_penalty")?
        .device_ptr(stream);
    let (freq_p, _freq) = s
        .frequency_penalty
        .device(OP, "frequency_penalty")?
        .device_ptr(stream);
    let (pres_p, _pres) = s
        .presence_penalty
        .device(OP, "presence_penalty")?
        .device_ptr(stream);
    let (p_p, _p) = p.device_mut(OP, "p")?.device_ptr_mut(stream);
    let (greedy_p, _g) = match greedy {
        Some(g) => g.device_mut(OP, "greedy")?.device_ptr_mut(stream),
        None => live.device(OP, "live")?.device_ptr(stream),
    };
    let mut args = vec![
        RawArg::Ptr(logits_p),
        RawArg::I64(logit_cols),
        RawArg::Ptr(start_p),
        RawArg::I32(starts),
    ];
    args.extend(
        [
            live_p, counts_p, tok_p, par_p, t_p, k_p, tp_p, mp_p, rep_p, freq_p, pres_p, p_p,
            greedy_p,
        ]
        .map(RawArg::Ptr),
    );
    // 16-byte loads in the first pass where every logits and counts row starts 16-byte
    // aligned.
    let vec4 = i32::from(
        params.vocab.is_multiple_of(4)
            && logits_p.is_multiple_of(16)
            && counts_p.is_multiple_of(16),
    );
    args.extend(
        [
            live_form,
            rows,
            cols,
            vocab,
            public_vocab,
            vec4,
            has_parents,
        ]
        .map(RawArg::I32),
    );
    // SAFETY: argument types and order match target_distribution_kernel and
    // target_distribution_bf16_kernel; every length was checked by `run_with` against the
    // static shape the kernel indexes with (logits columns bounded by `logit_cols`); the
    // pointers' guards live to the end of this function; `grid` is a multiple of `cluster`.
    unsafe { c.launch_ex(&f, cfg, &mut args, entry, false, cluster) }
}
