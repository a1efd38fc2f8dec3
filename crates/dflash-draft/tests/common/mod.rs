//! Shared fixtures of the draft tests: a synthetic checkpoint on disk, the model loaded from
//! it on the CPU, a context store and synthetic target parts.
#![allow(dead_code)] // reason: each test binary uses a different subset

use std::path::PathBuf;

use dflash_config::Geometry;
use dflash_context::{Capacity, ContextHandle, ContextStore};
use dflash_draft::synthetic::{self, Layout, SyntheticTarget, TinySpec};
use dflash_draft::{
    BindOptions, DraftModel, HeadParts, HeadShape, RowProposal, RowRequest, TargetParts, Workspace,
    WorkspaceSpec,
};
use dflash_ops::proposal_argmax::ProposalHead;
use dflash_ops::{Backend, Buffer, bf16};

/// A temp directory unique to this process and `name`, emptied.
pub fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("dflash-draft-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

pub struct Fixture {
    pub spec: TinySpec,
    pub seed: u64,
    pub g: Geometry,
    pub be: Backend,
    pub model: DraftModel,
    pub host: SyntheticTarget,
    pub emb: Buffer<bf16>,
    pub head: Buffer<bf16>,
}

pub fn fixture(spec: TinySpec, seed: u64, name: &str) -> Fixture {
    let dir = temp_dir(name);
    let (cfg, target) = synthetic::tiny_pair(&spec);
    let g = synthetic::write_checkpoint(&dir, &cfg, &target, seed, Layout::Single)
        .expect("write checkpoint");
    let be = Backend::cpu();
    let model = DraftModel::load(&be, &dir, &target, &BindOptions::default()).expect("load");
    let _ = std::fs::remove_dir_all(&dir);
    let host = synthetic::target_parts(spec.vocab_rows as usize, spec.hidden as usize, seed + 1);
    let emb = be.upload(&host.embedding).expect("upload");
    let head = be.upload(&host.output_head).expect("upload");
    Fixture {
        spec,
        seed,
        g,
        be,
        model,
        host,
        emb,
        head,
    }
}

impl Fixture {
    pub fn store(&self, lanes: usize, max_ctx: usize) -> ContextStore {
        ContextStore::new(
            self.be.clone(),
            self.model.context_geometry().expect("geometry"),
            Capacity::new(lanes, max_ctx, 4),
        )
        .expect("store")
    }

    pub fn features(&self, tokens: usize, seed: u64) -> Vec<bf16> {
        synthetic::features(tokens, self.g.feature_width as usize, seed)
    }

    /// Admit a request and prefill `tokens` features of `seed`.
    pub fn admit(&self, store: &mut ContextStore, tokens: usize, seed: u64) -> ContextHandle {
        let h = store.admit(64).expect("admit");
        if tokens > 0 {
            let f = self
                .be
                .upload(&self.features(tokens, seed))
                .expect("upload");
            self.model.prefill(store, h, f).expect("prefill");
        }
        h
    }

    pub fn parts(&self) -> TargetParts<'_> {
        TargetParts {
            vocab_rows: self.spec.vocab_rows as usize,
            public_vocab: self.spec.public_vocab as usize,
            embedding: &self.emb,
            head: HeadParts::Full {
                output_head: &self.head,
            },
        }
    }

    pub fn ws_spec(&self, rows: usize, k: usize) -> WorkspaceSpec {
        WorkspaceSpec {
            rows,
            draft_count: k,
            mask_token_id: self.spec.mask_token_id,
            head: HeadShape {
                kind: ProposalHead::Full,
                rows: self.spec.vocab_rows as usize,
                public_vocab: self.spec.public_vocab as usize,
            },
        }
    }

    /// Run one round with a fresh workspace of `ws_rows` rows; returns proposals and the mask
    /// hidden of the staged rows.
    pub fn round(
        &self,
        store: &ContextStore,
        rows: &[RowRequest],
        ws_rows: usize,
        k: usize,
    ) -> (Vec<RowProposal>, Vec<f32>) {
        let mut ws = Workspace::new(&self.model, store, &self.ws_spec(ws_rows, k)).expect("ws");
        let out = self
            .model
            .propose(store, rows, &self.parts(), &mut ws)
            .expect("propose");
        let mh = ws.read_mask_hidden().expect("mask hidden");
        (out, mh)
    }
}

pub fn req(
    handle: ContextHandle,
    anchor: u32,
    usable: usize,
    temperature: f32,
    seed: u64,
) -> RowRequest {
    RowRequest {
        handle,
        anchor,
        usable,
        temperature,
        seed,
    }
}
