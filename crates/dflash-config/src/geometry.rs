//! Draft-versus-target cross-validation and the derived geometry and memory sizes.

use crate::draft::{AttentionType, Backend, DFlash2Params, DraftConfig};
use crate::error::{ConfigError, Result};
use crate::json::index;
use crate::target::TargetTextConfig;

/// Bytes of one BF16 or FP16 element.
const HALF: u64 = 2;
/// Bytes of one FP32 or int32 element.
const WORD: u64 = 4;

/// How one draft layer attends, with its storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayerKind {
    /// Sliding-window layer: context K/V live in a cyclic ring of `window` slots
    /// (position p in slot p mod S); keys with `|p_key - p_query| < window` are visible.
    Local {
        /// The sliding-window scalar S (also the ring capacity).
        window: u32,
    },
    /// Full-attention layer: context K/V live in the paged full-layer pool.
    Full,
}

/// Everything derived from a validated (draft, target) pair that storage, ops and workspace
/// planners need. Symbols follow the specification: H, Hq, Hkv, D, I, S.
#[derive(Debug, Clone, PartialEq)]
pub struct Geometry {
    /// The checkpoint's backend.
    pub backend: Backend,
    /// Hidden width H (the target's).
    pub hidden: u32,
    /// Query heads Hq.
    pub q_heads: u32,
    /// KV heads Hkv.
    pub kv_heads: u32,
    /// Head dimension D.
    pub head_dim: u32,
    /// MLP width I.
    pub intermediate: u32,
    /// Plain RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE theta.
    pub rope_theta: f64,
    /// Per draft layer, in order.
    pub layers: Vec<LayerKind>,
    /// Target block ids, in recorded (concatenation) order.
    pub target_layer_ids: Vec<u32>,
    /// Target decoder block count.
    pub target_layers: u32,
    /// Feature width n_ids * H: columns of `fc.weight`, width of one captured feature row.
    pub feature_width: u64,
    /// Ring capacity S (the sliding-window scalar) when any layer is local, else `None`.
    pub ring_capacity: Option<u32>,
    /// Number of local (ring) layers.
    pub local_layers: u32,
    /// Number of full-attention layers.
    pub full_layers: u32,
    /// Whether a paged full-layer pool exists (exactly when `full_layers > 0`).
    pub has_full_pool: bool,
    /// Bytes of one ring state image: local layers * (2-byte K + 2-byte V) * Hkv * D * S.
    /// Official 27B DFlash2: 41943040 (40 MiB); official 35B-A3B DFlash: 83886080.
    /// Independent of K and B.
    pub ring_image_bytes: u64,
    /// Target embedding / output-head rows.
    pub vocab_rows: u32,
    /// Public vocabulary size, when known.
    pub public_vocab_size: Option<u32>,
    /// Mask token id from the config (`None`: must come from a startup option).
    pub mask_token_id: Option<u32>,
    /// DFlash2 parameters; `Some` exactly for DFlash2.
    pub dflash2: Option<DFlash2Params>,
}

/// Per-round transient sizes in bytes for draft count K and concurrency B (W = K + 1).
///
/// Element sizes: token ids int32 (4 B); activations, K, V and features BF16/FP16 (2 B);
/// scores and q FP32 (4 B). These are the logical extents the specification names as round
/// scratch; a workspace planner may alias or reuse them. DFlash2-only fields are 0 for DFlash.
/// None of them enters the ring state image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct TransientSizes {
    /// Draft count K.
    pub draft_count: u32,
    /// Block width W = K + 1 (one anchor, K masks).
    pub block_width: u32,
    /// Concurrency B.
    pub concurrency: u32,
    /// Draft input ids (anchor and masks): B * W * 4.
    pub block_token_ids: u64,
    /// One residual stream of the block: B * W * H * 2.
    pub block_hidden: u64,
    /// One layer's query projection: B * W * Hq * D * 2.
    pub block_query: u64,
    /// Query-block K and V of every draft layer: layers * B * W * Hkv * D * (2 + 2).
    pub query_block_kv: u64,
    /// One layer's MLP gate and up activations: B * W * I * 2 * 2.
    pub mlp_activations: u64,
    /// Proposed ids d_1..d_K: B * K * 4.
    pub proposal_ids: u64,
    /// Captured target features of the verify block (pending context work): B * W * n_ids * H * 2.
    pub verify_features: u64,
    /// DFlash2: global candidate ids C_i of the mask columns: B * K * top_k * 4.
    pub candidate_ids: u64,
    /// DFlash2: unary candidate scores u_i (FP32): B * K * top_k * 4.
    pub candidate_scores: u64,
    /// DFlash2: retained proposal distributions q_i (FP32): B * K * top_k * 4.
    pub candidate_q: u64,
    /// DFlash2: projected selector hidden g_i (BF16): B * K * R * 2.
    pub selector_hidden: u64,
    /// DFlash2: one branch's prepared convolution input (BF16): B * W * H * 2.
    pub conv_prepared_input: u64,
    /// DFlash2: one branch's finish delta (BF16, output side): B * W * taps * (H / group) * 2.
    pub conv_finish_delta: u64,
}

impl TransientSizes {
    /// Sum of every extent (an upper bound with no reuse).
    pub fn total(&self) -> u64 {
        [
            self.block_token_ids,
            self.block_hidden,
            self.block_query,
            self.query_block_kv,
            self.mlp_activations,
            self.proposal_ids,
            self.verify_features,
            self.candidate_ids,
            self.candidate_scores,
            self.candidate_q,
            self.selector_hidden,
            self.conv_prepared_input,
            self.conv_finish_delta,
        ]
        .iter()
        .fold(0u64, |a, &b| a.saturating_add(b))
    }
}

/// Product of `factors`, or [`ConfigError::SizeOverflow`] naming `path`.
fn product(path: &str, factors: &[u64]) -> Result<u64> {
    factors
        .iter()
        .try_fold(1u64, |acc, &f| acc.checked_mul(f))
        .ok_or_else(|| ConfigError::SizeOverflow {
            path: path.to_owned(),
        })
}

/// Cross-validate a draft against its target and derive the geometry.
///
/// Runs [`DraftConfig::validate`], then checks: the draft's `hidden_size` and `vocab_size` (when
/// stated) equal the target's ([`ConfigError::PairMismatch`]); its `num_target_layers` (when
/// stated) equals the target's layer count ([`ConfigError::PairMismatch`]); every target block id
/// is below the target's layer count ([`ConfigError::TargetLayerIdOutOfRange`]); the mask token
/// (when stated) is below the target's embedding rows ([`ConfigError::MaskTokenOutOfRange`]);
/// DFlash2's convolution group divides H ([`ConfigError::ConvGroupNotDividing`]).
pub fn validate_pair(draft: &DraftConfig, target: &TargetTextConfig) -> Result<Geometry> {
    draft.validate()?;
    let h = target.hidden_size;
    for (d, t, path) in [
        (draft.hidden_size, h, "hidden_size"),
        (draft.vocab_size, target.vocab_size, "vocab_size"),
        (
            draft.num_target_layers,
            target.num_hidden_layers,
            "num_target_layers",
        ),
    ] {
        if let Some(d) = d
            && d != t
        {
            return Err(ConfigError::PairMismatch {
                path: path.to_owned(),
                draft: u64::from(d),
                target: u64::from(t),
            });
        }
    }
    let ids_path = draft.ids_path();
    for (i, &id) in draft.target_layer_ids.iter().enumerate() {
        if id >= target.num_hidden_layers {
            return Err(ConfigError::TargetLayerIdOutOfRange {
                path: index(ids_path, i),
                num_target_layers: target.num_hidden_layers,
                found: id,
            });
        }
    }
    if let Some(m) = draft.mask_token_id
        && m >= target.vocab_size
    {
        return Err(ConfigError::MaskTokenOutOfRange {
            path: "dflash_config.mask_token_id".to_owned(),
            vocab_rows: target.vocab_size,
            found: m,
        });
    }
    if let Some(p) = &draft.dflash2
        && (p.conv_group_size == 0 || !h.is_multiple_of(p.conv_group_size))
    {
        return Err(ConfigError::ConvGroupNotDividing {
            path: "dflash_config.conv_group_size".to_owned(),
            group: p.conv_group_size,
            hidden: h,
        });
    }

    let layers: Vec<LayerKind> = draft
        .layer_types
        .iter()
        .map(|t| match (t, draft.sliding_window) {
            (AttentionType::Sliding, Some(window)) => LayerKind::Local { window },
            // `validate` guarantees a window whenever a layer slides.
            (AttentionType::Sliding, None) | (AttentionType::Full, _) => LayerKind::Full,
        })
        .collect();
    let local = layers
        .iter()
        .filter(|l| matches!(l, LayerKind::Local { .. }))
        .count();
    let local_layers = u32::try_from(local).map_err(|_| ConfigError::SizeOverflow {
        path: "geometry.local_layers".to_owned(),
    })?;
    let full_layers =
        u32::try_from(layers.len() - local).map_err(|_| ConfigError::SizeOverflow {
            path: "geometry.full_layers".to_owned(),
        })?;
    let ring_capacity = if local_layers > 0 {
        draft.sliding_window
    } else {
        None
    };
    let ring_image_bytes = product(
        "geometry.ring_image_bytes",
        &[
            u64::from(local_layers),
            HALF + HALF,
            u64::from(draft.num_key_value_heads),
            u64::from(draft.head_dim),
            u64::from(ring_capacity.unwrap_or(0)),
        ],
    )?;
    let feature_width = product(
        "geometry.feature_width",
        &[draft.target_layer_ids.len() as u64, u64::from(h)],
    )?;

    Ok(Geometry {
        backend: draft.backend,
        hidden: h,
        q_heads: draft.num_attention_heads,
        kv_heads: draft.num_key_value_heads,
        head_dim: draft.head_dim,
        intermediate: draft.intermediate_size,
        rms_norm_eps: draft.rms_norm_eps,
        rope_theta: draft.rope_theta,
        layers,
        target_layer_ids: draft.target_layer_ids.clone(),
        target_layers: target.num_hidden_layers,
        feature_width,
        ring_capacity,
        local_layers,
        full_layers,
        has_full_pool: full_layers > 0,
        ring_image_bytes,
        vocab_rows: target.vocab_size,
        public_vocab_size: target.public_vocab_size,
        mask_token_id: draft.mask_token_id,
        dflash2: draft.dflash2,
    })
}

impl Geometry {
    /// Number of target block ids (n_ids).
    pub fn n_ids(&self) -> usize {
        self.target_layer_ids.len()
    }

    /// Per-round transient sizes for draft count `k` and concurrency `b`; see
    /// [`TransientSizes`] for each formula. Only arithmetic overflow is checked here; the
    /// startup ranges (K in 1..=15, B in 1..=8) are enforced by [`crate::StartupOptions::validate`].
    pub fn transient_sizes(&self, k: u32, b: u32) -> Result<TransientSizes> {
        let w = k.checked_add(1).ok_or_else(|| ConfigError::SizeOverflow {
            path: "startup.draft_count".to_owned(),
        })?;
        let (kk, ww, bb) = (u64::from(k), u64::from(w), u64::from(b));
        let h = u64::from(self.hidden);
        let layers = self.layers.len() as u64;
        let p = |name: &str, f: &[u64]| product(&format!("transient.{name}"), f);
        let (top_k, rank, taps, groups) = match &self.dflash2 {
            Some(d) => (
                u64::from(d.selector_top_k),
                u64::from(d.selector_rank),
                u64::from(d.conv_kernel_size),
                h / u64::from(d.conv_group_size.max(1)),
            ),
            None => (0, 0, 0, 0),
        };
        let is2 = u64::from(self.dflash2.is_some());
        Ok(TransientSizes {
            draft_count: k,
            block_width: w,
            concurrency: b,
            block_token_ids: p("block_token_ids", &[bb, ww, WORD])?,
            block_hidden: p("block_hidden", &[bb, ww, h, HALF])?,
            block_query: p(
                "block_query",
                &[
                    bb,
                    ww,
                    u64::from(self.q_heads),
                    u64::from(self.head_dim),
                    HALF,
                ],
            )?,
            query_block_kv: p(
                "query_block_kv",
                &[
                    layers,
                    bb,
                    ww,
                    u64::from(self.kv_heads),
                    u64::from(self.head_dim),
                    HALF + HALF,
                ],
            )?,
            mlp_activations: p(
                "mlp_activations",
                &[bb, ww, u64::from(self.intermediate), HALF, 2],
            )?,
            proposal_ids: p("proposal_ids", &[bb, kk, WORD])?,
            verify_features: p("verify_features", &[bb, ww, self.feature_width, HALF])?,
            candidate_ids: p("candidate_ids", &[bb, kk, top_k, WORD])?,
            candidate_scores: p("candidate_scores", &[bb, kk, top_k, WORD])?,
            candidate_q: p("candidate_q", &[bb, kk, top_k, WORD])?,
            selector_hidden: p("selector_hidden", &[bb, kk, rank, HALF])?,
            conv_prepared_input: p("conv_prepared_input", &[is2, bb, ww, h, HALF])?,
            conv_finish_delta: p("conv_finish_delta", &[bb, ww, taps, groups, HALF])?,
        })
    }
}
