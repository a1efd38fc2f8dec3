//! State images: a request's materialized draft context, copied out of the store.
//!
//! Layout of the payload, per draft layer in order (elements of `Hkv * D` per slot or
//! position; K BF16, V FP16):
//! - local layer of window S: the ring's live slots `0..min(F_ctx, S)` in slot order (slot
//!   `p mod S` holds position p; when `F_ctx >= S` every slot is live, otherwise exactly
//!   slots `0..F_ctx`, which hold positions `0..F_ctx`). Dead ring bytes never enter an image.
//! - full layer: positions `0..F_ctx` in position order (gathered from the request's pages).
//!
//! Payload bytes: [`crate::ContextGeometry::image_bytes`] of the frontier; at most
//! [`crate::ContextGeometry::ring_image_bytes`] of ring bytes (official 27B DFlash2:
//! 41943040 bytes, 40 MiB, with no full layer) plus `F_ctx * full_layers * 4 * Hkv * D`.
//! Pending features are never part of an image: images are taken only with none pending.

use dflash_ops::{Backend, Buffer, bf16, f16};

use crate::{ContextGeometry, ContextLayerKind, Result};

/// What an image must match to be restored into a store: the per-layer kinds (windows) and
/// the K/V head shape.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct ImageShape {
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) layers: Vec<ContextLayerKind>,
}

impl ImageShape {
    pub(crate) fn of(g: &ContextGeometry) -> Self {
        ImageShape {
            kv_heads: g.kv_heads,
            head_dim: g.head_dim,
            layers: g.layers.clone(),
        }
    }

    /// Where this shape differs from `other`, in words, or `None`.
    pub(crate) fn difference(&self, other: &ImageShape) -> Option<String> {
        if self.kv_heads != other.kv_heads || self.head_dim != other.head_dim {
            return Some(format!(
                "image has Hkv {} x D {}, the store {} x {}",
                self.kv_heads, self.head_dim, other.kv_heads, other.head_dim
            ));
        }
        if self.layers != other.layers {
            return Some(format!(
                "image layers {:?}, store layers {:?}",
                self.layers, other.layers
            ));
        }
        None
    }

    /// Elements of K (and of V) in layer `l` of an image at `frontier`.
    pub(crate) fn layer_len(&self, l: usize, frontier: usize) -> usize {
        let positions = match self.layers[l] {
            ContextLayerKind::Local { window } => frontier.min(window),
            ContextLayerKind::Full => frontier,
        };
        positions * self.kv_heads * self.head_dim
    }

    pub(crate) fn payload_bytes(&self, frontier: usize) -> u64 {
        (0..self.layers.len())
            .map(|l| 4 * self.layer_len(l, frontier) as u64)
            .sum()
    }
}

/// A device copy of a request's draft context (checkpoint), made by
/// [`crate::ContextStore::checkpoint`] and restored by [`crate::ContextStore::restore`] or
/// [`crate::ContextStore::admit_restored`]. See the module doc for the payload layout.
#[derive(Debug)]
pub struct ContextImage {
    pub(crate) shape: ImageShape,
    pub(crate) frontier: usize,
    pub(crate) backend: &'static str,
    pub(crate) layers: Vec<(Buffer<bf16>, Buffer<f16>)>,
}

impl ContextImage {
    /// The coverage: positions `[0, frontier)` were materialized when the image was taken.
    pub fn frontier(&self) -> usize {
        self.frontier
    }

    /// Payload bytes (K and V of every layer).
    pub fn payload_bytes(&self) -> u64 {
        self.shape.payload_bytes(self.frontier)
    }

    /// Layer `l`'s K and V payload (see the module doc for the layout), or `None` past the
    /// last layer.
    pub fn layer(&self, l: usize) -> Option<(&Buffer<bf16>, &Buffer<f16>)> {
        self.layers.get(l).map(|(k, v)| (k, v))
    }

    /// A host copy of this image (`be` is the backend its buffers live on).
    pub fn to_host(&self, be: &Backend) -> Result<HostContextImage> {
        let mut layers = Vec::with_capacity(self.layers.len());
        for (k, v) in &self.layers {
            layers.push((be.download(k)?, be.download(v)?));
        }
        Ok(HostContextImage {
            shape: self.shape.clone(),
            frontier: self.frontier,
            layers,
        })
    }
}

/// A host copy of a request's draft context (Host replica), made by
/// [`crate::ContextStore::host_replica`] or [`ContextImage::to_host`] and restored by
/// [`crate::ContextStore::restore_host`] or [`crate::ContextStore::admit_restored_host`].
/// See the module doc for the payload layout.
#[derive(Debug, Clone, PartialEq)]
pub struct HostContextImage {
    pub(crate) shape: ImageShape,
    pub(crate) frontier: usize,
    pub(crate) layers: Vec<(Vec<bf16>, Vec<f16>)>,
}

impl HostContextImage {
    /// The coverage: positions `[0, frontier)` were materialized when the image was taken.
    pub fn frontier(&self) -> usize {
        self.frontier
    }

    /// Payload bytes (K and V of every layer).
    pub fn payload_bytes(&self) -> u64 {
        self.shape.payload_bytes(self.frontier)
    }

    /// Layer `l`'s K and V payload (see the module doc for the layout), or `None` past the
    /// last layer.
    pub fn layer(&self, l: usize) -> Option<(&[bf16], &[f16])> {
        self.layers
            .get(l)
            .map(|(k, v)| (k.as_slice(), v.as_slice()))
    }
}
