//! `dflash-ops`: the device abstraction, the RNG identity and every op of the DFlash and
//! DFlash2 backends, each as contract + CPU reference + CUDA launcher under one name.
//!
//! Layout: one module folder per op (`<op>/mod.rs` holds the contract and the public entry
//! `run`, `<op>/reference.rs` the CPU reference, `<op>/cuda.rs` the launcher of
//! `kernels/<op>.cu`). The op's name is its module, kernel file, CUDA symbol prefix, registry
//! id ([`OPS`]) and bench id. [`registry::cases`] lists every conformance case.
//!
//! This crate depends on no other workspace crate: an engine can take one op alone.

pub mod backend;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dtype;
pub mod error;
pub mod registry;
pub mod rng;

pub mod rng_uniform;

pub use backend::{Backend, Buffer};
pub use dtype::{DType, Element, bf16_rne, f16_rne};
pub use error::{OpsError, Result, check_len, check_param};
pub use half::{bf16, f16};

/// Every op's registry id, in registry order.
pub const OPS: &[&str] = &[rng_uniform::OP];

/// The case collectors of every op, in registry order.
pub(crate) const OP_CASES: &[fn() -> Vec<registry::Case>] = &[rng_uniform::cases];
