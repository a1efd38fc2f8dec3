// rng_uniform: the RNG identity for n decisions (contract: crates/dflash-ops/src/rng_uniform/mod.rs).
extern "C" __global__ void rng_uniform_kernel(const int* seeds, const int* positions, const int* purposes,
                                              const int* subs, int* words, float* uniforms, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    u64 seed = (u64)(u32)seeds[2 * i] | ((u64)(u32)seeds[2 * i + 1] << 32);
    u32 w = dflash_rng_word(seed, (u64)(u32)positions[i], (u32)purposes[i], (u32)subs[i]);
    words[i] = (int)w;
    uniforms[i] = dflash_unit_f32(w);
}
