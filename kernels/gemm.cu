// gemm: no kernel of its own. C = A W^T (BF16 inputs, FP32 accumulation, F32 or BF16 out) is
// one cublasGemmEx call (CUBLAS_COMPUTE_32F); see crates/dflash-ops/src/gemm/cuda.rs, which
// also exposes the crate-wide device helper gemm_bf16_device used by other launchers.
// This file exists so that every op id has its kernels/<op>.cu; it is never compiled.
