// l2_prefetch: ask the memory system to bring bytes [0, bytes) of a buffer into the L2
// (contract: crates/dflash-ops/src/l2_prefetch/mod.rs). Reads nothing into registers, writes
// nothing: every result of every kernel is the same whether this kernel runs or not.
//
// Work split. The range is cut into chunks of L2P_CHUNK bytes (the last one shorter, every
// length a multiple of 16); thread t of block b issues chunk 32 b + t, so a block is one warp
// and the grid ceil(chunks / 32) blocks (`l2_prefetch::plan`). On sm_90 and later a chunk is
// one bulk prefetch (`cp.async.bulk.prefetch.L2`, handled by the SM's copy engine; the thread
// does not wait for it); below, one `prefetch.global.L2` per 128-byte line of the chunk.
//
// Dependent launch (`CudaBackend::launch_ex`, sm_90 and later). The kernel lets its own
// dependents launch as it starts, issues its prefetches before df_pdl_wait (a prefetch
// returns nothing, so it may run while the kernel ahead still writes anything), then waits
// for the kernel ahead: work queued after it still follows that kernel, and a dependent
// launch of the next kernel costs the chain no more than this kernel's wait. Launched as an
// ordinary kernel, the wait is a no-op.

// Bytes a thread prefetches (mirrored by `l2_prefetch::CHUNK`).
#define L2P_CHUNK 16384

extern "C" __global__ void __launch_bounds__(32) l2_prefetch_kernel(const char* base, u64 bytes) {
    df_pdl_launch_dependents();
    const u64 start = ((u64)blockIdx.x * 32 + threadIdx.x) * L2P_CHUNK;
    if (start < bytes) {
        const u64 len = bytes - start < L2P_CHUNK ? bytes - start : L2P_CHUNK;
        const char* p = base + start;
#if __CUDA_ARCH__ >= 900
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"((unsigned)len)
                     : "memory");
#else
        for (u64 o = 0; o < len; o += 128) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p + o));
#endif
    }
    df_pdl_wait();
}
