//! `dflash-ops`: the device abstraction, the RNG identity and every op of the DFlash and
//! DFlash2 backends, each as contract + CPU reference + CUDA launcher under one name.
//!
//! Layout: one module folder per op (`<op>/mod.rs` holds the contract and the public entry
//! `run`, `<op>/reference.rs` the CPU reference, `<op>/cuda.rs` the launcher of
//! `kernels/<op>.cu` where the op has a kernel of its own: `gemm` its skinny kernel or
//! cuBLAS, `feature_projection` the gemm helper and a `rms_norm` kernel). The op's name is its
//! module, registry id ([`OPS`]), bench id and, where it has them, its kernel file and CUDA
//! symbol prefix. The conformance registry (`registry`: every op's cases, their comparison)
//! is built only with the feature `conformance`.
//!
//! This crate depends on no other workspace crate: an engine can take one op alone.

pub mod backend;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dtype;
pub mod error;
#[cfg(any(test, feature = "conformance"))]
pub mod registry;
pub mod rng;

pub mod candidate_selector;
pub mod chain_accept;
pub mod context_kv_materialize;
pub mod dynamic_grouped_conv;
pub mod embedding_gather;
pub mod feature_projection;
pub mod gemm;
pub mod head_norm_rope;
pub mod l2_prefetch;
pub mod proposal_argmax;
pub mod residual_add;
pub mod rms_norm;
pub mod rng_uniform;
pub mod sliding_window_attention;
pub mod softmax_attention;
pub mod swiglu;
pub mod target_distribution;
pub mod tree_accept;
pub mod unary_topk;

pub use backend::{Backend, Borrowed, Buffer, Graph, Held, PendingRead};
pub use dtype::{DType, Element, bf16_rne, bf16_rne_f64, f16_rne};
pub use error::{OpsError, Result, check_len, check_param};
pub use half::{bf16, f16};

/// Every op's registry id, in registry order.
pub const OPS: &[&str] = &[
    rms_norm::OP,
    head_norm_rope::OP,
    feature_projection::OP,
    context_kv_materialize::OP,
    embedding_gather::OP,
    gemm::OP,
    l2_prefetch::OP,
    swiglu::OP,
    residual_add::OP,
    sliding_window_attention::OP,
    softmax_attention::OP,
    dynamic_grouped_conv::OP,
    proposal_argmax::OP,
    unary_topk::OP,
    candidate_selector::OP,
    target_distribution::OP,
    chain_accept::OP,
    tree_accept::OP,
    rng_uniform::OP,
];

/// The case collectors of every op, in registry order.
#[cfg(any(test, feature = "conformance"))]
pub(crate) const OP_CASES: &[fn() -> Vec<registry::Case>] = &[
    rms_norm::cases,
    head_norm_rope::cases,
    feature_projection::cases,
    context_kv_materialize::cases,
    embedding_gather::cases,
    gemm::cases,
    l2_prefetch::cases,
    swiglu::cases,
    residual_add::cases,
    sliding_window_attention::cases,
    softmax_attention::cases,
    dynamic_grouped_conv::cases,
    proposal_argmax::cases,
    unary_topk::cases,
    candidate_selector::cases,
    target_distribution::cases,
    chain_accept::cases,
    tree_accept::cases,
    rng_uniform::cases,
];
