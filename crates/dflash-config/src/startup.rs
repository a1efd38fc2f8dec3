//! Startup options: backend, draft count K, concurrency B, proposal head, tree nodes, mask token.

use crate::draft::Backend;
use crate::error::{ConfigError, Result};
use crate::geometry::{Geometry, TransientSizes};

/// Largest draft count K the engine accepts (W = K + 1 <= 16).
pub const MAX_DRAFT_COUNT: u32 = 15;
/// Largest concurrency B the engine accepts.
pub const MAX_CONCURRENCY: u32 = 8;
/// Largest DFlash2 tree (columns per request, one ancestor bitmask each).
pub const MAX_TREE_NODES: u32 = 32;

/// Which head turns final mask hidden columns into proposals.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ProposalHead {
    /// The target's full output head, restricted to the public vocabulary rows.
    Full,
    /// A shortlist of `rows` rows gathered from the target's output head, with an int32
    /// row-to-global-id map (ids unique and below the public vocabulary size).
    Indexed {
        /// Shortlist rows (e.g. 131072).
        rows: u32,
    },
}

/// What the embedder asks for at startup. Build with [`StartupOptions::new`] and adjust fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StartupOptions {
    /// Must equal the checkpoint's backend.
    pub backend: Backend,
    /// Draft count K, 1..=15 ([`MAX_DRAFT_COUNT`]).
    pub draft_count: u32,
    /// Concurrency B, 1..=8 ([`MAX_CONCURRENCY`]).
    pub concurrency: u32,
    /// Proposal head.
    pub proposal_head: ProposalHead,
    /// DFlash2 tree verification with this many nodes per request, or `None` for chain
    /// verification. Accepted: `K + 1 <= n <= 32`; columns 0..=K are the chain path, the rest
    /// side nodes (`n = K + 1` is a tree with no side nodes, verified like a chain).
    /// Refused for DFlash.
    pub tree_nodes: Option<u32>,
    /// Mask token id. Required when the config's `mask_token_id` is `null`; when the config
    /// has one, an override must equal it (the draft was trained with that token; a different
    /// one would silently change every proposal).
    pub mask_token_id: Option<u32>,
}

/// Validated startup options together with the geometry-dependent numbers they imply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Startup {
    /// The backend.
    pub backend: Backend,
    /// Draft count K.
    pub draft_count: u32,
    /// Physical block width W = K + 1.
    pub block_width: u32,
    /// Concurrency B.
    pub concurrency: u32,
    /// Proposal head.
    pub proposal_head: ProposalHead,
    /// Rows the proposal head scores: the public vocabulary size (full head) or the shortlist
    /// rows (indexed head).
    pub proposal_rows: u32,
    /// Tree nodes per request (DFlash2 only), `None` for chains.
    pub tree_nodes: Option<u32>,
    /// The resolved mask token id.
    pub mask_token_id: u32,
    /// Public vocabulary size.
    pub public_vocab_size: u32,
    /// Per-round transient sizes for this K and B.
    pub transient: TransientSizes,
}

fn out_of_range(path: &str, expected: String, found: u32) -> ConfigError {
    ConfigError::OutOfRange {
        path: path.to_owned(),
        expected,
        found: found.to_string(),
    }
}

impl StartupOptions {
    /// Options for `backend` with draft count `draft_count`, concurrency 1, the full proposal
    /// head, chain verification and the config's mask token.
    pub fn new(backend: Backend, draft_count: u32) -> Self {
        Self {
            backend,
            draft_count,
            concurrency: 1,
            proposal_head: ProposalHead::Full,
            tree_nodes: None,
            mask_token_id: None,
        }
    }

    /// Check the options against a validated geometry (from [`crate::validate_pair`]).
    ///
    /// Errors (all paths start with `startup.`): [`ConfigError::BackendMismatch`];
    /// [`ConfigError::OutOfRange`] for K outside 1..=15, B outside 1..=8, tree nodes outside
    /// K+1..=32 (K+1..=17 for K = 1), indexed-head rows outside `1..=public vocabulary` (at least `selector_top_k`
    /// for DFlash2, which also needs a public vocabulary of at least that many rows);
    /// [`ConfigError::TreeNeedsDFlash2`]; [`ConfigError::PublicVocabUnknown`] when the target's
    /// public vocabulary size was never given (every head and target verification need it);
    /// [`ConfigError::MaskTokenUnknown`], [`ConfigError::Conflict`] (override differs from the
    /// config) and [`ConfigError::MaskTokenOutOfRange`] for the mask token.
    pub fn validate(&self, geometry: &Geometry) -> Result<Startup> {
        if self.backend != geometry.backend {
            return Err(ConfigError::BackendMismatch {
                path: "startup.backend".to_owned(),
                expected: geometry.backend,
                found: self.backend,
            });
        }
        let k = self.draft_count;
        if !(1..=MAX_DRAFT_COUNT).contains(&k) {
            return Err(out_of_range(
                "startup.draft_count",
                format!("1..={MAX_DRAFT_COUNT}"),
                k,
            ));
        }
        let b = self.concurrency;
        if !(1..=MAX_CONCURRENCY).contains(&b) {
            return Err(out_of_range(
                "startup.concurrency",
                format!("1..={MAX_CONCURRENCY}"),
                b,
            ));
        }
        if let Some(n) = self.tree_nodes {
            if self.backend != Backend::DFlash2 {
                return Err(ConfigError::TreeNeedsDFlash2 {
                    path: "startup.tree_nodes".to_owned(),
                    found: n,
                });
            }
            // A tree of depth K over 16 candidates a column holds at most 1 + 16 + 16^2 + ..
            // nodes: 17 for K = 1, more than MAX_TREE_NODES from K = 2 on.
            let max = if k == 1 { 17 } else { MAX_TREE_NODES };
            if !(k + 1..=max).contains(&n) {
                return Err(out_of_range(
                    "startup.tree_nodes",
                    format!(
                        "{}..={max} (K + 1 chain columns at least; at most 1 + 16 candidates a \
node below the anchor when K = 1)",
                        k + 1
                    ),
                    n,
                ));
            }
        }
        let public = geometry
            .public_vocab_size
            .ok_or_else(|| ConfigError::PublicVocabUnknown {
                path: "public_vocab_size".to_owned(),
            })?;
        let min_rows = geometry.dflash2.map_or(1, |d| d.selector_top_k.max(1));
        let proposal_rows = match self.proposal_head {
            ProposalHead::Full => {
                if public < min_rows {
                    return Err(out_of_range(
                        "public_vocab_size",
                        format!("at least {min_rows} rows for the selector's top-{min_rows}"),
                        public,
                    ));
                }
                public
            }
            ProposalHead::Indexed { rows } => {
                if !(min_rows..=public).contains(&rows) {
                    return Err(out_of_range(
                        "startup.proposal_head.rows",
                        format!("{min_rows}..={public} (shortlist ids are unique public ids)"),
                        rows,
                    ));
                }
                rows
            }
        };
        let mask_token_id = match (geometry.mask_token_id, self.mask_token_id) {
            (None, None) => {
                return Err(ConfigError::MaskTokenUnknown {
                    path: "startup.mask_token_id".to_owned(),
                });
            }
            (Some(c), Some(o)) if c != o => {
                return Err(ConfigError::Conflict {
                    path: "startup.mask_token_id".to_owned(),
                    found: o.to_string(),
                    other_path: "dflash_config.mask_token_id".to_owned(),
                    other: c.to_string(),
                });
            }
            (_, Some(m)) | (Some(m), None) => m,
        };
        if mask_token_id >= geometry.vocab_rows {
            return Err(ConfigError::MaskTokenOutOfRange {
                path: "startup.mask_token_id".to_owned(),
                vocab_rows: geometry.vocab_rows,
                found: mask_token_id,
            });
        }
        Ok(Startup {
            backend: self.backend,
            draft_count: k,
            block_width: k + 1,
            concurrency: b,
            proposal_head: self.proposal_head,
            proposal_rows,
            tree_nodes: self.tree_nodes,
            mask_token_id,
            public_vocab_size: public,
            transient: geometry.transient_sizes(k, b)?,
        })
    }
}
