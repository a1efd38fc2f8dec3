//! `dflash-context`: the draft context storage of the DFlash and DFlash2 backends.
//!
//! Per request (an opaque [`ContextHandle`] naming a lane), the store holds:
//! - one cyclic ring per local draft layer (K BF16, V FP16, `[S, Hkv, D]` per lane): absolute
//!   position p lives in slot `p mod S`; the live interval is `[max(0, F_ctx - S), F_ctx)`;
//!   bytes outside it are unreachable through this crate's read API and never enter images;
//! - for drafts with full-attention layers only, pages of a paged pool (pages of a fixed token
//!   count shared by all lanes, per-request page tables, reserved at admission for the
//!   declared maximum context and returned at release); no full pool exists otherwise;
//! - the context frontier F_ctx (positions `[0, F_ctx)` materialized) and the pending
//!   features (captured target features of `[F_ctx, F_ctx + pending)`, queued in order until
//!   [`ContextStore::materialize`] runs feature projection and context K/V materialize).
//!
//! State images ([`ContextStore::checkpoint`], [`ContextStore::fork`],
//! [`ContextStore::host_replica`], [`ContextStore::restore`]) need the pending features
//! materialized first (otherwise [`ContextError::PendingFeatures`]: the caller materializes,
//! then retries) and carry their coverage F_ctx, which must equal the frontier of the target
//! state they are attached to ([`ContextError::CoverageMismatch`]). Payload per image: the
//! live ring slots (at most [`ContextGeometry::ring_image_bytes`]: 40 MiB for the official
//! 27B DFlash2, whatever K or B) plus the full-layer positions; see [`image`].
//!
//! Nothing here holds request or session state beyond storage bookkeeping; the engine owns
//! the requests and calls, per round: [`ContextStore::materialize`],
//! [`ContextStore::batch_metadata`] (lanes, frontiers, page-table rows of the compact batch
//! for the attention ops, with [`ContextStore::layer`] for the pools), then, after a commit
//! of N rows, [`ContextStore::push_pending`] with the first N captured feature columns.
//!
//! The same code runs on the CPU backend and, through the [`dflash_ops::Backend`] interface,
//! on CUDA (feature `cuda`).
//!
//! ```
//! use dflash_context::{Capacity, ContextGeometry, ContextLayerKind, ContextStore};
//! use dflash_ops::Backend;
//!
//! let geometry = ContextGeometry {
//!     hidden: 32, n_ids: 2, kv_heads: 2, head_dim: 8, eps: 1e-6, theta: 1e7,
//!     layers: vec![ContextLayerKind::Local { window: 8 }, ContextLayerKind::Full],
//! };
//! let mut store = ContextStore::new(Backend::cpu(), geometry, Capacity::new(2, 64, 4))?;
//! let h = store.admit(64)?;
//! assert_eq!(store.pages(h)?.len(), 16);
//! let features = store.backend().zeros(3 * 64)?; // 3 captured rows of n_ids * H
//! store.push_pending(h, 0, &features, 3)?;
//! assert_eq!(store.pending_target_frontier(h)?, 3);
//! assert!(store.checkpoint(h).is_err()); // pending features: materialize first
//! store.release(h)?;
//! assert_eq!(store.free_pages(), 32);
//! # Ok::<(), dflash_context::ContextError>(())
//! ```

#![deny(missing_docs)]

mod error;
mod geometry;
pub mod image;
mod store;

pub use error::{ContextError, Result};
pub use geometry::{
    Capacity, ContextGeometry, ContextLayerKind, DEFAULT_CHUNK_COLS, MAX_LANES, PoolBytes,
};
pub use image::{ContextImage, HostContextImage};
pub use store::{
    BatchMetadata, ContextHandle, ContextStore, LayerKvWeights, LayerPool, LiveWindow,
    MaterializeWeights, NO_PAGE,
};
