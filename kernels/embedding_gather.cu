// embedding_gather: out[r, :] = table[ids[r], :] (contract: crates/dflash-ops/src/embedding_gather/mod.rs).
// One block per output row r (gridDim.x = n). Bit copies (unsigned short / uint4), so NaN
// payloads survive. An id outside [0, vocab) writes a +0.0 row and reads nothing.

extern "C" __global__ void embedding_gather_kernel(const int* ids, const unsigned short* table,
                                                   unsigned short* out, u64 vocab, u64 hidden) {
    u64 r = blockIdx.x;
    int id = ids[r];
    unsigned short* dst = out + r * hidden;
    if (id < 0 || (u64)id >= vocab) {
        for (u64 c = threadIdx.x; c < hidden; c += blockDim.x) dst[c] = 0;
        return;
    }
    const unsigned short* src = table + (u64)id * hidden;
    // 16-byte copies when both row starts are 16-byte aligned and the row is whole uint4s.
    if ((hidden % 8) == 0 && (((u64)src | (u64)dst) % 16) == 0) {
        const uint4* s4 = (const uint4*)src;
        uint4* d4 = (uint4*)dst;
        u64 n4 = hidden / 8;
        for (u64 v = threadIdx.x; v < n4; v += blockDim.x) d4[v] = s4[v];
    } else {
        for (u64 c = threadIdx.x; c < hidden; c += blockDim.x) dst[c] = src[c];
    }
}
