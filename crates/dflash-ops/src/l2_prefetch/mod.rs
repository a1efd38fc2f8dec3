//! L2 prefetch: ask the device to bring the first bytes of a buffer into its L2 cache, so that
//! a later kernel that reads them (the next weight GEMM of the draft block) finds them there
//! instead of waiting for DRAM.
//!
//! Why. A draft layer at small batch is a chain of short dependent kernels: the weight GEMMs
//! stream their weights from DRAM, and between them norms, RoPE and attention leave the DRAM
//! mostly idle. Prefetching the next GEMM's weight while those run moves part of its stream
//! off the chain (`dflash_draft`'s block issues one after each weight GEMM, for the next one,
//! up to [`budget`] bytes).
//!
//! Semantics. `run(be, buf, max_bytes)` asks for bytes `0 .. min(max_bytes, size_of(buf))`
//! of `buf`, rounded down to a multiple of 16, to be loaded into the L2. It computes nothing
//! and writes nothing: every result of every op is the same, bit for bit, whether it runs or
//! not, and whoever writes `buf` before or after it (a prefetch returns no data; the L2 is the
//! device's point of coherence). The device may drop any part of the request; a line it
//! loads may be evicted before it is read. `max_bytes` is a cap, so a larger value than the
//! buffer is not an error; 0 (or a range under 16 bytes) launches nothing.
//! Backends. CPU: nothing happens (the buffer must be a host buffer). CUDA: one launch of
//! `l2_prefetch_kernel` (`kernels/l2_prefetch.cu`): chunks of [`CHUNK`] bytes, one thread
//! each, a warp a block ([`plan`]); a bulk L2 prefetch a chunk on compute capability 9.0 and
//! later, a line prefetch every 128 bytes below. On 9.0 and later (unless
//! `KernelVariants::Portable`) it is launched as a programmatic dependent of the kernel ahead
//! of it and lets the next kernel launch as it starts, so it costs the chain no more than
//! waiting for the kernel ahead (see the kernel file); otherwise it is an ordinary launch.
//! Caller guarantees. The buffer is live until the launch has been queued (the prefetch
//! reads no element into the program, so its data may change at any time). A device buffer
//! starts 16-byte aligned (every allocation and [`crate::Buffer::view`] does; checked).
//! Errors. A buffer of another backend: [`crate::OpsError::WrongBackend`]; a device buffer not
//! 16-byte aligned: [`crate::OpsError::Param`] (`buf`).
//! Comparison. The op has no output. Its conformance cases run a GEMM after prefetching its
//! weight (the whole weight, a cap that is not a multiple of 16 nor of a chunk, a view at an
//! offset) and compare that GEMM's output with the CPU's under the `gemm` criterion, and
//! check that the weight is unchanged.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
#[cfg(test)]
mod tests;

#[cfg(any(test, feature = "conformance"))]
use crate::registry::{Case, CaseRun, InputCheck, output};
use crate::{Backend, Buffer, Element, Result};

/// Registry id.
pub const OP: &str = "l2_prefetch";

/// Bytes one thread prefetches (`L2P_CHUNK` of the kernel).
pub const CHUNK: usize = 16384;

/// Threads a block (one warp).
pub const BLOCK_THREADS: usize = 32;

/// The launch of one prefetch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Bytes asked for: `min(max_bytes, buffer bytes)` rounded down to a multiple of 16.
    pub bytes: usize,
    /// Chunks of [`CHUNK`] bytes (the last may be shorter).
    pub chunks: usize,
    /// Blocks of [`BLOCK_THREADS`] threads, one chunk a thread (0: nothing to launch).
    pub blocks: usize,
}

/// The launch that prefetches at most `max_bytes` of a buffer of `buffer_bytes` bytes.
pub fn plan(buffer_bytes: usize, max_bytes: usize) -> Plan {
    let bytes = buffer_bytes.min(max_bytes) / 16 * 16;
    let chunks = bytes.div_ceil(CHUNK);
    Plan {
        bytes,
        chunks,
        blocks: chunks.div_ceil(BLOCK_THREADS),
    }
}

/// The CUDA backend's default budget: 0, no prefetch, because that is what was measured
/// (`docs/performance-l2-prefetch-h100.md`, an H100 80GB HBM3, graph replays of the round):
/// at 16 and at 40 MiB a weight every round was slower than without the chain (35B-A3B
/// DFlash, B = 1, K = 15, T = 2048: 933.4 us without, 953.0 and 965.2 us with; B = 8 and the
/// 27B DFlash2 alike). The GEMMs did read faster (Nsight Compute, one block: 49 us less in
/// the weight GEMMs at 16 MiB), but each prefetch is one more kernel on the block's chain of
/// dependent kernels, and the 25 of a block cost more than they saved.
pub const DEFAULT_BUDGET: usize = 0;

/// The backend's prefetch budget in bytes, what the draft block prefetches of each next
/// weight at most: the CUDA backend's `l2_prefetch_budget` (set with
/// `CudaBackend::set_l2_prefetch_budget`), 0 on the CPU.
pub fn budget(be: &Backend) -> usize {
    match be {
        Backend::Cpu => 0,
        #[cfg(feature = "cuda")]
        Backend::Cuda(c) => c.l2_prefetch_budget(),
    }
}

/// Prefetch the first `min(max_bytes, size_of(buf))` bytes of `buf` into the L2 (see the
/// module contract): nothing on the CPU.
pub fn run<T: Element>(be: &Backend, buf: &Buffer<T>, max_bytes: usize) -> Result<()> {
    let p = plan(
        buf.len().saturating_mul(std::mem::size_of::<T>()),
        max_bytes,
    );
    match be {
        // No L2 to fill (the plan is a device launch's); the buffer must still be the
        // backend's.
        Backend::Cpu => {
            let _ = p;
            buf.host(OP, "buf").map(|_| ())
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(c) => cuda::run(c, buf, &p),
    }
}

/// A case: prefetch at most `cap` bytes of the weight (or of its view from row `view_row`),
/// then `out = a w^T` (BF16 out) reading that weight; `out` is compared under the `gemm`
/// criterion and the weight must be unchanged.
#[cfg(any(test, feature = "conformance"))]
fn case(
    (m, n, k): (usize, usize, usize),
    cap: usize,
    view_row: usize,
    seed: u64,
) -> impl Fn(&Backend) -> Result<CaseRun> + Send + Sync {
    use crate::gemm::{self, GemmParams, data};
    move |be: &Backend| {
        let mut g = data::SplitMix::new(seed);
        let a = g.bf16_vec(m * k, -2.0, 2.0);
        let wscale = 1.0 / (k as f64).sqrt();
        let w = g.bf16_vec((n + view_row) * k, -wscale, wscale);
        let crit = gemm::criterion(k, data::max_abs_bf16(&a), data::max_abs_bf16(&w), true);
        let mut inputs = InputCheck::default();
        let ab = inputs.upload(be, "a", &a)?;
        let wb = inputs.upload(be, "w", &w)?;
        let mut o = be.filled(m * n, crate::bf16::POISON)?;
        {
            let wv = wb.view(view_row * k, n * k)?;
            run(be, &wv, cap)?;
            gemm::run_bf16(be, &ab, &wv, &mut o, &GemmParams { m, n, k })?;
        }
        let out = output(
            "out",
            crit,
            &vec![crate::bf16::POISON; m * n],
            &be.download(&o)?,
            |_| true,
        );
        let mut modified = Vec::new();
        inputs.verify(be, "a", &ab, &mut modified)?;
        inputs.verify(be, "w", &wb, &mut modified)?;
        Ok(CaseRun {
            outputs: vec![out],
            modified_inputs: modified,
        })
    }
}

/// Conformance cases: a GEMM after the prefetch of its whole weight (the 35B-A3B's k/v
/// projection at 16 rows, 4 MB: 256 chunks), after a cap that is neither a multiple of 16
/// nor of a chunk, and after the prefetch of a view that starts inside the weight.
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn cases() -> Vec<Case> {
    vec![
        Case::new(
            OP,
            "whole_n1024_k2048_m16",
            case((16, 1024, 2048), usize::MAX, 0, 1),
        ),
        Case::new(
            OP,
            "cap_40009_n256_k520_m3",
            case((3, 256, 520), 40_009, 0, 2),
        ),
        Case::new(
            OP,
            "view_from_row_37_n96_k64_m5",
            case((5, 96, 64), 8_000, 37, 3),
        ),
    ]
}
