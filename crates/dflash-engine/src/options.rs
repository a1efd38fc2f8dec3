//! Engine options and the startup memory plan.

use dflash_config::StartupOptions;

/// What the embedder chooses at startup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineOptions {
    /// Backend (must match the checkpoint), draft count K (1..=15), concurrency B (1..=8),
    /// proposal head, mask token.
    pub startup: StartupOptions,
    /// The most positions one request may reach (prompt + token budget); the draft context
    /// of every slot is planned for it.
    pub max_context: usize,
    /// Tokens per page of the full-layer context pool (drafts with full-attention layers).
    pub page_size: usize,
    /// Bytes of device memory the engine may plan on its backend (draft weights and target
    /// parts, context pools, every round workspace, the target verify outputs). Startup fails
    /// with [`crate::EngineError::InsufficientMemory`] when the plan needs more.
    pub memory_budget: u64,
    /// Run every round's draft block op by op instead of replaying the CUDA graph profiles
    /// captured at startup (one per live-row bucket) - for debugging; results are the same.
    /// Backends that cannot capture (the CPU) always run eagerly.
    pub eager: bool,
}

impl EngineOptions {
    /// Options for `startup` with `max_context` positions per request, pages of 256 tokens and
    /// an unlimited memory budget.
    pub fn new(startup: StartupOptions, max_context: usize) -> Self {
        EngineOptions {
            startup,
            max_context,
            page_size: 256,
            memory_budget: u64::MAX,
            eager: false,
        }
    }
}

/// One item of a [`MemoryPlan`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryItem {
    /// What the bytes are for.
    pub name: &'static str,
    /// Bytes on the engine's backend.
    pub bytes: u64,
}

/// Every device allocation the engine and its proposer plan at startup, computed from the
/// startup numbers (K, B, head, vocabulary, max context) before the first request.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemoryPlan {
    /// The items, in planning order.
    pub items: Vec<MemoryItem>,
}

impl MemoryPlan {
    /// Add an item.
    pub fn push(&mut self, name: &'static str, bytes: u64) {
        self.items.push(MemoryItem { name, bytes });
    }

    /// Append every item of `other`.
    pub fn extend(&mut self, other: &MemoryPlan) {
        self.items.extend(other.items.iter().cloned());
    }

    /// The sum of every item (saturating).
    pub fn total(&self) -> u64 {
        self.items
            .iter()
            .fold(0u64, |a, i| a.saturating_add(i.bytes))
    }

    /// Bytes of the item named `name` (0 when absent).
    pub fn bytes(&self, name: &str) -> u64 {
        self.items
            .iter()
            .filter(|i| i.name == name)
            .map(|i| i.bytes)
            .sum()
    }
}

impl std::fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, item) in self.items.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{} {}", item.name, item.bytes)?;
        }
        Ok(())
    }
}
