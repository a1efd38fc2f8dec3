//! The draft model: loading, context prefill and the block forward (DFlash and DFlash2),
//! written once over [`dflash_ops::Backend`].

use std::path::Path;

use dflash_config::{
    Backend as DraftBackend, Geometry, LayerKind, ParseMode, Startup, TargetTextConfig,
};
use dflash_context::{ContextGeometry, ContextHandle, ContextStore, LayerPool, NO_PAGE};
use dflash_ops::proposal_argmax::{self, ProposalHead as OpsHead};
use dflash_ops::{
    Backend, Buffer, bf16, candidate_selector, dynamic_grouped_conv, embedding_gather, gemm,
    head_norm_rope, l2_prefetch, residual_add, rms_norm, sliding_window_attention,
    softmax_attention, unary_topk,
};

use crate::target::{HeadShape, TargetParts};
use crate::tree::{LatticeScratch, RowLattice};
use crate::weights::{BindOptions, Checkpoint, DraftWeights, LayerWeights};
use crate::{DraftError, Result};

/// Candidates per DFlash2 mask column (the selector's top-16).
pub const TOP_K: usize = unary_topk::TOP_K;

/// A draft model bound to one backend: validated geometry plus weights.
#[derive(Debug)]
pub struct DraftModel {
    be: Backend,
    geometry: Geometry,
    weights: DraftWeights,
}

impl DraftModel {
    /// Open the checkpoint in `dir`, parse its `config.json` strictly (every known field
    /// validated; a field this crate does not know is refused, never dropped: use
    /// [`DraftModel::load_reported`] in lenient mode to accept unknown fields and receive them
    /// with the parser's notes), validate it against the target's text config, check every
    /// tensor and bind the weights on `be`.
    pub fn load(
        be: &Backend,
        dir: impl AsRef<Path>,
        target: &TargetTextConfig,
        opts: &BindOptions,
    ) -> Result<Self> {
        let ck = Checkpoint::open(dir)?;
        Self::from_checkpoint(be, &ck, target, opts)
    }

    /// [`DraftModel::load`] from an opened checkpoint.
    pub fn from_checkpoint(
        be: &Backend,
        ck: &Checkpoint,
        target: &TargetTextConfig,
        opts: &BindOptions,
    ) -> Result<Self> {
        Self::from_checkpoint_reported(be, ck, target, opts, ParseMode::Strict).map(|(m, _)| m)
    }

    /// A model from weights bound elsewhere (tests, other loaders). The weights' lengths are
    /// checked by the ops when they run.
    pub fn from_parts(be: &Backend, geometry: Geometry, weights: DraftWeights) -> Self {
        DraftModel {
            be: be.clone(),
            geometry,
            weights,
        }
    }

    /// The backend the weights live on.
    pub fn backend(&self) -> &Backend {
        &self.be
    }

    /// The validated geometry.
    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    /// The bound weights.
    pub fn weights(&self) -> &DraftWeights {
        &self.weights
    }

    /// The storage geometry a [`ContextStore`] for this model must have.
    pub fn context_geometry(&self) -> Result<ContextGeometry> {
        Ok(ContextGeometry::from_config(&self.geometry)?)
    }

    fn check_store(&self, store: &ContextStore) -> Result<()> {
        let want = self.context_geometry()?;
        if store.geometry() != &want {
            return Err(DraftError::invalid(
                "context store geometry",
                format!("{want:?}"),
                format!("{:?}", store.geometry()),
            ));
        }
        if store.backend().name() != self.be.name() {
            return Err(DraftError::invalid(
                "context store backend",
                self.be.name(),
                store.backend().name(),
            ));
        }
        Ok(())
    }

    /// Context prefill: queue `features` (`[T, n_ids*H]` BF16, captured target features of
    /// positions `F_pending..F_pending+T`, where `F_pending` is the request's pending target
    /// frontier) and materialize the request's context: feature projection and context norm,
    /// then every layer's context K/V into the store. No prompt token runs through the
    /// residual/MLP stack. Calling it once with all T rows or several times with consecutive
    /// chunks gives the same context.
    pub fn prefill(
        &self,
        store: &mut ContextStore,
        h: ContextHandle,
        features: Buffer<bf16>,
    ) -> Result<()> {
        self.check_store(store)?;
        let start = store.pending_target_frontier(h)?;
        store.push_pending_owned(h, start, features)?;
        self.materialize(store, h)
    }

    /// Materialize the request's pending features (before a proposal, a checkpoint, a fork).
    pub fn materialize(&self, store: &mut ContextStore, h: ContextHandle) -> Result<()> {
        self.check_store(store)?;
        store.materialize(h, &self.weights.materialize_weights()?)?;
        Ok(())
    }

    /// Materialize the pending features of every request in `handles` at once
    /// ([`ContextStore::materialize_round`]: a round's pushes in one batched call, replayed
    /// from a CUDA graph after [`DraftModel::capture_materialize`]).
    pub fn materialize_round(
        &self,
        store: &mut ContextStore,
        handles: &[ContextHandle],
    ) -> Result<()> {
        self.check_store(store)?;
        store.materialize_round(handles, &self.weights.materialize_weights()?)?;
        Ok(())
    }

    /// Record the batched round materialize of `store` for this model's weights as a CUDA
    /// graph ([`ContextStore::capture_round`]); `false` where it stays eager.
    pub fn capture_materialize(&self, store: &mut ContextStore) -> Result<bool> {
        self.check_store(store)?;
        Ok(store.capture_round(&self.weights.materialize_weights()?)?)
    }

    /// Stage, run and read back one round: [`DraftModel::stage`], [`DraftModel::run_block`],
    /// [`Workspace::read`].
    pub fn propose(
        &self,
        store: &ContextStore,
        rows: &[RowRequest],
        target: &TargetParts<'_>,
        ws: &mut Workspace,
    ) -> Result<Vec<RowProposal>> {
        self.stage(store, rows, ws)?;
        self.run_block(store, target, ws)?;
        ws.read()
    }

    /// Write the round's per-row metadata into the workspace's device buffers (a host-to-device
    /// copy; everything [`DraftModel::run_block`] reads per round lives in those buffers, so a
    /// captured CUDA graph of `run_block` replays with new rows).
    ///
    /// The block then computes exactly these rows: the workspace (planned for its largest
    /// row count) is resized in place ([`Workspace::physical_rows`]). Checks: 1..=workspace
    /// rows requests, each handle live in `store` with nothing pending and not repeated,
    /// anchor below the vocab rows, usable count `P <= K`, temperature finite and `>= 0` (the
    /// one temperature rule, [`dflash_config::check_temperature`]), positions within i32.
    /// A refused call stages nothing and leaves the workspace's shape as it was.
    pub fn stage(
        &self,
        store: &ContextStore,
        rows: &[RowRequest],
        ws: &mut Workspace,
    ) -> Result<()> {
        self.stage_padded(store, rows, rows.len(), ws)
    }

    /// [`DraftModel::stage`] onto `physical` rows (`rows.len() ..= ` the workspace's rows):
    /// the rows past the requests repeat the last request (computed, never reported). A CUDA
    /// graph captured for `physical` rows replays any round of at most that many requests
    /// (a live-row bucket).
    pub fn stage_padded(
        &self,
        store: &ContextStore,
        rows: &[RowRequest],
        physical: usize,
        ws: &mut Workspace,
    ) -> Result<()> {
        self.check_store(store)?;
        ws.check_model(self)?;
        let n = rows.len();
        if n == 0 || n > ws.rows {
            return Err(DraftError::invalid(
                "rows",
                format!("1..={} (the workspace's rows)", ws.rows),
                n,
            ));
        }
        if physical < n || physical > ws.rows {
            return Err(DraftError::invalid(
                "physical rows",
                format!("{n}..={} (the requests to the workspace's rows)", ws.rows),
                physical,
            ));
        }
        let row_err =
            |row: usize, field: &'static str, expected: String, found: String| DraftError::Row {
                row,
                field,
                expected,
                found,
            };
        let (k, w) = (ws.k, ws.k + 1);
        let mut frontiers = Vec::with_capacity(n);
        for (i, r) in rows.iter().enumerate() {
            let f = store.frontier(r.handle)?;
            let pending = store.pending(r.handle)?;
            if pending != 0 {
                return Err(row_err(
                    i,
                    "handle",
                    "a request whose pending features are materialized".into(),
                    format!("{pending} pending columns"),
                ));
            }
            if let Some(j) = rows[..i].iter().position(|o| o.handle == r.handle) {
                return Err(row_err(
                    i,
                    "handle",
                    "each request once per batch".into(),
                    format!("the handle of row {j}"),
                ));
            }
            if r.anchor as usize >= ws.vocab_rows {
                return Err(row_err(
                    i,
                    "anchor",
                    format!("a token id below {}", ws.vocab_rows),
                    r.anchor.to_string(),
                ));
            }
            if r.usable > k {
                return Err(row_err(
                    i,
                    "usable",
                    format!("0..={k} (K)"),
                    r.usable.to_string(),
                ));
            }
            if !dflash_config::is_valid_temperature(r.temperature) {
                return Err(row_err(
                    i,
                    "temperature",
                    dflash_config::TEMPERATURE_RULE.into(),
                    r.temperature.to_string(),
                ));
            }
            if f.checked_add(w).is_none_or(|e| e > i32::MAX as usize) {
                return Err(row_err(
                    i,
                    "frontier",
                    "F + W within i32".into(),
                    f.to_string(),
                ));
            }
            frontiers.push(f);
        }
        let placed: Vec<Placed<'_>> = rows
            .iter()
            .zip(&frontiers)
            .map(|(r, &frontier)| {
                Ok(Placed {
                    anchor: r.anchor,
                    lane: r.handle.lane(),
                    frontier,
                    usable: r.usable,
                    seed: r.seed,
                    temperature: r.temperature,
                    pages: match ws.page_table {
                        Some(_) => store.pages(r.handle)?,
                        None => &[],
                    },
                })
            })
            .collect::<Result<_>>()?;
        // Every request is valid: resize the workspace and queue the writes.
        self.write_rows(store, &placed, physical, ws)?;
        ws.staged = rows.iter().map(|r| r.usable).collect();
        Ok(())
    }

    /// Stage `physical` placeholder rows (lane 0 at frontier 0, so no context is read;
    /// anchor 0; `P = 0`) so that a CUDA graph of [`DraftModel::run_block`] can be captured
    /// for that row count before any request exists ([`DraftModel::stage_padded`] then
    /// rewrites the rows before each replay). Their results mean nothing and are never
    /// reported: nothing counts as staged afterwards, so [`Workspace::read`] returns no rows.
    pub fn stage_idle(
        &self,
        store: &ContextStore,
        physical: usize,
        ws: &mut Workspace,
    ) -> Result<()> {
        self.check_store(store)?;
        ws.check_model(self)?;
        if physical == 0 || physical > ws.rows {
            return Err(DraftError::invalid(
                "physical rows",
                format!("1..={} (the workspace's rows)", ws.rows),
                physical,
            ));
        }
        let idle = Placed {
            anchor: 0,
            lane: 0,
            frontier: 0,
            usable: 0,
            seed: 0,
            temperature: 0.0,
            pages: &[],
        };
        self.write_rows(store, &[idle], physical, ws)?;
        ws.staged.clear();
        Ok(())
    }

    /// Resize `ws` to `physical` rows and queue the metadata of `rows` (validated), the last
    /// repeated onto the remaining physical rows. Clears what was staged.
    fn write_rows(
        &self,
        store: &ContextStore,
        rows: &[Placed<'_>],
        physical: usize,
        ws: &mut Workspace,
    ) -> Result<()> {
        let (k, w) = (ws.k, ws.k + 1);
        let n = rows.len();
        let max_pages = store.capacity().max_pages_per_lane;
        ws.staged.clear();
        ws.primed = false;
        ws.fit_rows(physical)?;
        let mut ids = Vec::with_capacity(physical * w);
        let (mut lanes, mut fr, mut live, mut anchors, mut seeds, mut temps, mut table) = (
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
        );
        for p in 0..physical {
            let r = &rows[p.min(n - 1)];
            ids.push(r.anchor as i32);
            ids.extend(std::iter::repeat_n(ws.mask_token as i32, k));
            lanes.push(r.lane as i32);
            fr.push(r.frontier as i32);
            live.push(match self.geometry.backend {
                DraftBackend::DFlash => (r.usable + 1) as i32,
                DraftBackend::DFlash2 => w as i32,
            });
            anchors.push(r.anchor as i32);
            seeds.push(r.seed as u32 as i32);
            seeds.push((r.seed >> 32) as u32 as i32);
            temps.push(r.temperature);
            if ws.page_table.is_some() {
                let mut row: Vec<i32> = r.pages.iter().copied().take(max_pages).collect();
                row.resize(max_pages, NO_PAGE);
                table.extend(row);
            }
        }
        let be = &self.be;
        be.write(&mut ws.ids, 0, &ids)?;
        be.write(&mut ws.lanes, 0, &lanes)?;
        be.write(&mut ws.frontiers, 0, &fr)?;
        be.write(&mut ws.live, 0, &live)?;
        be.write(&mut ws.anchors, 0, &anchors)?;
        be.write(&mut ws.seeds, 0, &seeds)?;
        be.write(&mut ws.temperature, 0, &temps)?;
        if let Some(t) = &mut ws.page_table {
            be.write(t, 0, &table)?;
        }
        ws.primed = true;
        Ok(())
    }

    /// Run the staged block forward: device work only (no host reads of device data, no
    /// allocation), reading every per-round value from the workspace's buffers.
    ///
    /// Per row: `x = embed([a, MASK x K])` at positions `F..F+K`; each layer (DFlash:
    /// norm, Q/K/V with head norm + RoPE, attention over context + block, residual, norm,
    /// SwiGLU MLP, residual; DFlash2: the same with the dynamic grouped convolution's prepare
    /// and finish around attention and MLP); final norm of the K mask columns; the head:
    /// DFlash per-column argmax, DFlash2 unary top-16, `g = W_hidden h`, conditional selector.
    /// Live columns: DFlash attends `P + 1` columns, DFlash2 all `W` (the specification's
    /// proposal-extent table); every column is computed either way.
    pub fn run_block(
        &self,
        store: &ContextStore,
        target: &TargetParts<'_>,
        ws: &mut Workspace,
    ) -> Result<()> {
        self.check_store(store)?;
        ws.check_model(self)?;
        let g = &self.geometry;
        let hidden = g.hidden as usize;
        target.check(hidden, g.vocab_rows as usize)?;
        if target.head_shape(hidden) != ws.head {
            return Err(DraftError::TargetPart {
                part: "head",
                problem: format!(
                    "the workspace was planned for {:?}, found {:?}",
                    ws.head,
                    target.head_shape(hidden)
                ),
            });
        }
        if !ws.primed {
            return Err(DraftError::invalid(
                "workspace",
                "rows staged by DraftModel::stage",
                "nothing staged",
            ));
        }
        let be = &self.be;
        let (rows, k) = (ws.physical, ws.k);
        let w = k + 1;
        let tokens = rows * w;
        let (hq, d, inter) = (
            g.q_heads as usize,
            g.head_dim as usize,
            g.intermediate as usize,
        );
        let eps = g.rms_norm_eps as f32;
        let norm_p = rms_norm::RmsNormParams {
            rows: tokens,
            hidden,
            eps,
        };
        let conv_p = dynamic_grouped_conv::ConvParams {
            rows,
            cols: w,
            hidden,
            group: dynamic_grouped_conv::GROUP,
            eps,
        };
        let gm = |n: usize, kk: usize| gemm::GemmParams {
            m: tokens,
            n,
            k: kk,
        };

        let layers = &self.weights.layers;
        // The L2 prefetch chain (`prefetch_next`): each weight GEMM is followed by the
        // prefetch of the next one's weight; the first layer's Q/K/V while the block starts.
        if let Some(first) = layers.first() {
            prefetch_next(be, &first.qkv_proj)?;
        }
        embedding_gather::run(
            be,
            &ws.ids,
            target.embedding,
            &mut ws.x,
            &embedding_gather::EmbeddingGatherParams {
                vocab: target.vocab_rows,
                hidden,
            },
        )?;
        // The block's RoPE angles, shared by every layer's Q/K.
        head_norm_rope::rope_table(be, &ws.frontiers, &mut ws.angles, &self.qkv_params(rows, w))?;
        // DFlash: whether `ws.n` already holds this layer's input norm (the previous layer's
        // last residual add is fused with it).
        let mut normed = false;
        for (l, lw) in layers.iter().enumerate() {
            let pool = store.layer(l)?;
            // The weight the layer's last GEMM (down) prefetches: the next layer's Q/K/V, after
            // the last layer the head's.
            let after = layers
                .get(l + 1)
                .map_or(target.head_weight(), |nl| &nl.qkv_proj);
            match (&lw.attention_conv, &lw.mlp_conv) {
                (None, None) => {
                    // DFlash: y = x + W_o attn(norm(x)); x_next = y + W_down(swiglu(...)).
                    if !normed {
                        rms_norm::run(be, &ws.x, &lw.input_norm, &mut ws.n, &norm_p)?;
                    }
                    self.attention(l, lw, pool, ws)?;
                    gemm::run_bf16(be, &ws.attn, &lw.o_proj, &mut ws.o, &gm(hidden, hq * d))?;
                    prefetch_next(be, &lw.gate_up_proj)?;
                    rms_norm::run_residual(
                        be,
                        &mut ws.x,
                        &ws.o,
                        &lw.post_attention_norm,
                        &mut ws.n,
                        &norm_p,
                    )?;
                    mlp(be, lw, ws, (tokens, hidden, inter), after)?;
                    let next = layers
                        .get(l + 1)
                        .filter(|nl| nl.attention_conv.is_none() && nl.mlp_conv.is_none());
                    normed = next.is_some();
                    match next {
                        Some(nl) => rms_norm::run_residual(
                            be,
                            &mut ws.x,
                            &ws.o,
                            &nl.input_norm,
                            &mut ws.n,
                            &norm_p,
                        )?,
                        None => residual_add::run_inplace(
                            be,
                            &mut ws.x,
                            &ws.o,
                            &residual_add::ResidualAddParams { n: tokens * hidden },
                        )?,
                    }
                }
                (Some(ac), Some(mc)) => {
                    // DFlash2: the convolution's prepare normalizes internally.
                    normed = false;
                    dynamic_grouped_conv::prepare(
                        be,
                        &ws.x,
                        &lw.input_norm,
                        &ac.base,
                        &ac.projection,
                        &mut ws.n,
                        &mut ws.finish_delta,
                        ws.conv_scratch.as_mut().ok_or_else(no_conv_scratch)?,
                        &conv_p,
                    )?;
                    self.attention(l, lw, pool, ws)?;
                    gemm::run_bf16(be, &ws.attn, &lw.o_proj, &mut ws.o, &gm(hidden, hq * d))?;
                    prefetch_next(be, &lw.gate_up_proj)?;
                    dynamic_grouped_conv::finish(
                        be,
                        &ws.o,
                        &ws.finish_delta,
                        &ac.base,
                        &ws.x,
                        &mut ws.y,
                        &conv_p,
                    )?;
                    dynamic_grouped_conv::prepare(
                        be,
                        &ws.y,
                        &lw.post_attention_norm,
                        &mc.base,
                        &mc.projection,
                        &mut ws.n,
                        &mut ws.finish_delta,
                        ws.conv_scratch.as_mut().ok_or_else(no_conv_scratch)?,
                        &conv_p,
                    )?;
                    mlp(be, lw, ws, (tokens, hidden, inter), after)?;
                    dynamic_grouped_conv::finish(
                        be,
                        &ws.o,
                        &ws.finish_delta,
                        &mc.base,
                        &ws.y,
                        &mut ws.x,
                        &conv_p,
                    )?;
                }
                _ => {
                    return Err(DraftError::invalid(
                        format!("layers[{l}] convolution weights"),
                        "both attention_conv and mlp_conv (DFlash2) or neither (DFlash)",
                        "only one",
                    ));
                }
            }
        }
        // The final norm of the K mask columns of every row, read in place (the anchor column
        // is not sampled).
        rms_norm::run_rows(
            be,
            &ws.x,
            &self.weights.norm,
            &mut ws.mask_hidden,
            &rms_norm::RmsNormParams {
                rows: rows * k,
                hidden,
                eps,
            },
            &rms_norm::RowMap::mask_columns(k),
        )?;
        let cols = rows * k;
        let head_p = proposal_argmax::Params {
            n: cols,
            rows: ws.head.rows,
            hidden,
            public_vocab: ws.head.public_vocab,
            head: ws.head.kind,
        };
        match (&self.weights.selector, &mut ws.selector) {
            (None, _) => proposal_argmax::run(
                be,
                &ws.mask_hidden,
                target.head_weight(),
                target.token_ids(),
                &mut ws.proposals,
                &mut ws.head_workspace,
                &head_p,
            )?,
            (Some(sw), Some(sel)) => {
                unary_topk::run(
                    be,
                    &ws.mask_hidden,
                    target.head_weight(),
                    target.token_ids(),
                    &mut sel.unary,
                    &mut sel.candidates,
                    &mut ws.head_workspace,
                    &head_p,
                )?;
                let rank = sw.hidden_projection.len() / hidden.max(1);
                gemm::run_bf16(
                    be,
                    &ws.mask_hidden,
                    &sw.hidden_projection,
                    &mut sel.g,
                    &gemm::GemmParams {
                        m: cols,
                        n: rank,
                        k: hidden,
                    },
                )?;
                candidate_selector::run(
                    be,
                    &candidate_selector::Inputs {
                        g: &sel.g,
                        cand_ids: &sel.candidates,
                        unary: &sel.unary,
                        w_pred: &sw.predecessor,
                        w_succ: &sw.successor,
                        anchors: &ws.anchors,
                        seeds: &ws.seeds,
                        start_pos: &ws.frontiers,
                        temperature: &ws.temperature,
                    },
                    &mut candidate_selector::Outputs {
                        proposals: &mut ws.proposals,
                        q: &mut sel.q,
                        chosen: &mut sel.chosen,
                    },
                    &candidate_selector::Params {
                        rows,
                        k,
                        rank,
                        vocab: g.vocab_rows as usize,
                    },
                )?;
            }
            (Some(_), None) => {
                return Err(DraftError::invalid(
                    "workspace",
                    "a DFlash2 workspace (selector buffers)",
                    "a DFlash workspace",
                ));
            }
        }
        Ok(())
    }

    /// The fused Q/K/V form's parameters for `rows` requests of this workspace shape.
    fn qkv_params(&self, rows: usize, w: usize) -> head_norm_rope::QkvParams {
        let g = &self.geometry;
        head_norm_rope::QkvParams {
            rows,
            cols: w,
            q_heads: g.q_heads as usize,
            kv_heads: g.kv_heads as usize,
            head_dim: g.head_dim as usize,
            eps: g.rms_norm_eps as f32,
            theta: g.rope_theta,
        }
    }

    /// Q/K/V projections of `ws.n` (one GEMM), head norms and RoPE at `F + column` (angles
    /// from `ws.angles`), and the layer's attention over context + block into `ws.attn`.
    fn attention(
        &self,
        l: usize,
        lw: &LayerWeights,
        pool: LayerPool<'_>,
        ws: &mut Workspace,
    ) -> Result<()> {
        let g = &self.geometry;
        let be = &self.be;
        let (rows, w) = (ws.physical, ws.k + 1);
        let tokens = rows * w;
        let (hidden, hq, hkv, d) = (
            g.hidden as usize,
            g.q_heads as usize,
            g.kv_heads as usize,
            g.head_dim as usize,
        );
        gemm::run_f32(
            be,
            &ws.n,
            &lw.qkv_proj,
            &mut ws.qkv_raw,
            &gemm::GemmParams {
                m: tokens,
                n: (hq + 2 * hkv) * d,
                k: hidden,
            },
        )?;
        prefetch_next(be, &lw.o_proj)?;
        head_norm_rope::run_qkv(
            be,
            &ws.qkv_raw,
            &lw.q_norm,
            &lw.k_norm,
            &ws.angles,
            head_norm_rope::QkvOut {
                q: &mut ws.q,
                k: &mut ws.k_blk,
                v: &mut ws.v,
            },
            &self.qkv_params(rows, w),
        )?;
        match (g.layers.get(l), pool) {
            (
                Some(LayerKind::Local { .. }),
                LayerPool::Ring {
                    k,
                    v,
                    lanes,
                    window,
                },
            ) => {
                sliding_window_attention::run(
                    be,
                    &ws.q,
                    &ws.k_blk,
                    &ws.v,
                    k,
                    v,
                    &ws.lanes,
                    &ws.frontiers,
                    &ws.live,
                    &mut ws.attn,
                    &mut ws.attn_workspace,
                    &sliding_window_attention::LocalAttentionParams {
                        rows,
                        cols: w,
                        q_heads: hq,
                        kv_heads: hkv,
                        head_dim: d,
                        lanes,
                        window,
                    },
                )?;
            }
            (
                Some(LayerKind::Full),
                LayerPool::Paged {
                    k,
                    v,
                    pages,
                    page_size,
                    max_pages,
                },
            ) => {
                let table = ws.page_table.as_ref().ok_or_else(|| {
                    DraftError::invalid("workspace", "a page table for full layers", "none")
                })?;
                softmax_attention::run(
                    be,
                    &ws.q,
                    &ws.k_blk,
                    &ws.v,
                    k,
                    v,
                    table,
                    &ws.frontiers,
                    &ws.live,
                    &mut ws.attn,
                    &mut ws.attn_workspace,
                    &softmax_attention::FullAttentionParams {
                        rows,
                        cols: w,
                        q_heads: hq,
                        kv_heads: hkv,
                        head_dim: d,
                        pages,
                        page_size,
                        max_pages,
                    },
                )?;
            }
            _ => {
                return Err(DraftError::invalid(
                    format!("layer {l} pool"),
                    "the storage kind of the layer's attention type",
                    "another kind",
                ));
            }
        }
        Ok(())
    }
}

/// The error of a lattice readback from a DFlash workspace or model.
fn no_lattice() -> DraftError {
    DraftError::invalid(
        "workspace",
        "a DFlash2 workspace and model (a selector lattice)",
        "DFlash (no lattice)",
    )
}

/// The error of a DFlash2 layer run with a workspace that has no convolution scratch.
fn no_conv_scratch() -> DraftError {
    DraftError::invalid(
        "workspace",
        "a DFlash2 workspace (convolution scratch)",
        "a DFlash workspace",
    )
}

/// After a weight GEMM of the block: prefetch into the L2 the first
/// `l2_prefetch::budget(be)` bytes of the next weight GEMM's weight `next`, so that its
/// stream starts while the kernels between the two (norms, RoPE, attention, SwiGLU) leave
/// the DRAM idle. Changes no result (the op's contract); nothing when the budget is 0 (the
/// CPU).
fn prefetch_next(be: &Backend, next: &Buffer<bf16>) -> Result<()> {
    let budget = l2_prefetch::budget(be);
    if budget > 0 {
        l2_prefetch::run(be, next, budget)?;
    }
    Ok(())
}

/// `ws.o = W_down(swiglu(W_gate ws.n, W_up ws.n))`: one GEMM against `[gate; up]` with the
/// SwiGLU on the way out (`gemm::run_swiglu`; `ws.gate_up` its scratch), the down projection;
/// each GEMM followed by the prefetch of the next weight (down's, then `after`).
fn mlp(
    be: &Backend,
    lw: &LayerWeights,
    ws: &mut Workspace,
    (tokens, hidden, inter): (usize, usize, usize),
    after: &Buffer<bf16>,
) -> Result<()> {
    let gi = gemm::GemmParams {
        m: tokens,
        n: 2 * inter,
        k: hidden,
    };
    gemm::run_swiglu(
        be,
        &ws.n,
        &lw.gate_up_proj,
        &mut ws.gate_up,
        &mut ws.act,
        &gi,
    )?;
    prefetch_next(be, &lw.down_proj)?;
    gemm::run_bf16(
        be,
        &ws.act,
        &lw.down_proj,
        &mut ws.o,
        &gemm::GemmParams {
            m: tokens,
            n: hidden,
            k: inter,
        },
    )?;
    prefetch_next(be, after)
}

/// A validated row as staged: where its context lives and its per-round values.
struct Placed<'a> {
    anchor: u32,
    lane: usize,
    frontier: usize,
    usable: usize,
    seed: u64,
    temperature: f32,
    /// The request's page-table row (drafts with full layers; empty otherwise).
    pages: &'a [i32],
}

/// One request of a round.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowRequest {
    /// The request's context (its frontier F is the anchor's position).
    pub handle: ContextHandle,
    /// The unprocessed anchor token a = x_F.
    pub anchor: u32,
    /// P: proposals that can be verified this round (`0..=K`). DFlash attends `P + 1` live
    /// columns; DFlash2 computes all `W` and reports all K, of which the first P are usable.
    pub usable: usize,
    /// DFlash2 selector temperature: finite and `>= 0`, 0 greedy (checked by
    /// [`DraftModel::stage`]). Ignored by DFlash (q is a point mass).
    pub temperature: f32,
    /// The request's seed (DFlash2 selector draws; the row index never enters a draw).
    pub seed: u64,
}

/// One request's proposal, read back from the workspace.
#[derive(Debug, Clone, PartialEq)]
pub struct RowProposal {
    /// Proposed global ids d_1..d_K. Only the first [`RowProposal::usable`] are usable; DFlash
    /// columns past `P` were not live in attention and carry no meaning.
    pub tokens: Vec<i32>,
    /// P (from the request).
    pub usable: usize,
    /// DFlash2: the candidate global ids `[K, 16]`; empty for DFlash.
    pub candidate_ids: Vec<i32>,
    /// DFlash2: the unary scores `[K, 16]`; empty for DFlash.
    pub unary_scores: Vec<f32>,
    /// DFlash2: the actual proposal distributions q `[K, 16]` over ranks; empty for DFlash
    /// (whose q is the point mass on `tokens[i]`).
    pub q: Vec<f32>,
}

/// What a [`Workspace`] is planned for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkspaceSpec {
    /// Physical rows (concurrency B): a round may stage 1..=rows requests.
    pub rows: usize,
    /// Draft count K (W = K + 1).
    pub draft_count: usize,
    /// The mask token id.
    pub mask_token_id: u32,
    /// The proposal head's shape.
    pub head: HeadShape,
}

impl WorkspaceSpec {
    /// The spec of a validated startup (rows = B, K, the resolved mask token, the head).
    pub fn from_startup(s: &Startup, vocab_rows: usize) -> Self {
        let head = match s.proposal_head {
            dflash_config::ProposalHead::Full => HeadShape {
                kind: OpsHead::Full,
                rows: vocab_rows,
                public_vocab: s.public_vocab_size as usize,
            },
            dflash_config::ProposalHead::Indexed { rows } => HeadShape {
                kind: OpsHead::Indexed,
                rows: rows as usize,
                public_vocab: s.public_vocab_size as usize,
            },
        };
        WorkspaceSpec {
            rows: s.concurrency as usize,
            draft_count: s.draft_count as usize,
            mask_token_id: s.mask_token_id,
            head,
        }
    }
}

/// DFlash2's selector buffers.
#[derive(Debug)]
pub struct SelectorBuffers {
    /// Unary top-16 scores `[rows*K, 16]` F32.
    pub unary: Buffer<f32>,
    /// Candidate global ids `[rows*K, 16]` I32.
    pub candidates: Buffer<i32>,
    /// Projected hidden g `[rows*K, R]` BF16.
    pub g: Buffer<bf16>,
    /// Retained q `[rows, K, 16]` F32.
    pub q: Buffer<f32>,
    /// Chosen ranks `[rows, K]` I32.
    pub chosen: Buffer<i32>,
}

/// Widths of the workspace's per-row buffers (elements per token or column).
#[derive(Clone, Copy, Debug)]
struct RowLens {
    hidden: usize,
    /// DFlash2's branch stream `y` (0 for DFlash).
    branch: usize,
    q_width: usize,
    kv_width: usize,
    head_dim: usize,
    inter: usize,
    /// DFlash2's finish delta `2 * H / 16` (0 for DFlash).
    delta: usize,
    max_pages: usize,
    rank: usize,
    eps: f32,
}

/// Every buffer of one round, allocated once for a (rows, K, head) shape; the forward
/// allocates nothing. Activations are `[rows, W, ...]` flat (`tokens = rows * W`).
///
/// Bytes (BF16 = 2, F32/I32 = 4): three `[tokens, H]` residual/normalized streams and one
/// branch output (BF16), `[tokens, (Hq + 2 Hkv) * D]` fused Q/K/V projection (F32),
/// `[tokens, D/2]` RoPE angles (F32), `[tokens, Hq*D]` Q + attention output (BF16),
/// `[tokens, Hkv*D]` K + V (BF16), `[tokens, 2 I]` gate/up and `[tokens, I]` SwiGLU (BF16),
/// DFlash2's `[tokens, 2*H/16]` finish delta and its convolution scratch (`[2*tokens, H]` BF16
/// and `[2*tokens, H/4]` F32), the `[rows*K, H]` final-normed mask columns, the head's
/// partials (`workspace_len` of `proposal_argmax` / `unary_topk`: the fused head never stores
/// its `[rows*K, head rows]` logits), the attention scratch (`workspace_len` of the ops, the
/// maximum over layers) and the small per-row metadata.
#[derive(Debug)]
pub struct Workspace {
    be: Backend,
    rows: usize,
    k: usize,
    mask_token: u32,
    vocab_rows: usize,
    head: HeadShape,
    staged: Vec<usize>,
    /// Rows the per-row buffers are sized for now (`<= rows`).
    physical: usize,
    /// Whether rows (requests or placeholders) are staged for [`DraftModel::run_block`].
    primed: bool,
    /// Per-row widths of the buffers ([`Workspace::fit_rows`]).
    lens: RowLens,
    /// Block input ids `[rows, W]`.
    pub ids: Buffer<i32>,
    /// Ring lane per row `[rows]`.
    pub lanes: Buffer<i32>,
    /// Frontier F per row `[rows]` (the anchor's position).
    pub frontiers: Buffer<i32>,
    /// Page-table rows `[rows, max_pages]` (drafts with full layers).
    pub page_table: Option<Buffer<i32>>,
    /// Live columns per row for attention `[rows]`.
    pub live: Buffer<i32>,
    /// Anchor per row `[rows]`.
    pub anchors: Buffer<i32>,
    /// Seeds `[rows, 2]` (low, high words).
    pub seeds: Buffer<i32>,
    /// Temperatures `[rows]`.
    pub temperature: Buffer<f32>,
    x: Buffer<bf16>,
    y: Buffer<bf16>,
    n: Buffer<bf16>,
    o: Buffer<bf16>,
    /// The fused Q/K/V projection `[tokens, Hq + 2 Hkv, D]` F32.
    qkv_raw: Buffer<f32>,
    /// The block's RoPE angles `[tokens, D/2]` (once per block, for every layer).
    angles: Buffer<f32>,
    q: Buffer<bf16>,
    k_blk: Buffer<bf16>,
    v: Buffer<bf16>,
    attn: Buffer<bf16>,
    attn_workspace: Buffer<f32>,
    /// The fused gate/up projection `[tokens, 2 I]` BF16.
    gate_up: Buffer<bf16>,
    act: Buffer<bf16>,
    finish_delta: Buffer<bf16>,
    /// DFlash2's convolution scratch (None for DFlash).
    conv_scratch: Option<dynamic_grouped_conv::PrepareScratch>,
    /// Final-normed hidden of the mask columns `[rows, K, H]` BF16.
    pub mask_hidden: Buffer<bf16>,
    /// Scratch of the fused proposal head (per-block partials).
    head_workspace: Buffer<f32>,
    /// Proposals `[rows, K]` I32.
    pub proposals: Buffer<i32>,
    /// DFlash2 selector buffers.
    pub selector: Option<SelectorBuffers>,
}

impl Workspace {
    /// Plan and allocate every buffer of a round of `spec` for `model` over `store`'s pools.
    pub fn new(model: &DraftModel, store: &ContextStore, spec: &WorkspaceSpec) -> Result<Self> {
        model.check_store(store)?;
        let g = &model.geometry;
        let be = &model.be;
        let (rows, k) = (spec.rows, spec.draft_count);
        if !(1..=dflash_config::MAX_CONCURRENCY as usize).contains(&rows) {
            return Err(DraftError::invalid("workspace rows", "1..=8", rows));
        }
        if !(1..=dflash_config::MAX_DRAFT_COUNT as usize).contains(&k) {
            return Err(DraftError::invalid("draft count K", "1..=15", k));
        }
        let vocab_rows = g.vocab_rows as usize;
        if spec.mask_token_id as usize >= vocab_rows {
            return Err(DraftError::invalid(
                "mask token id",
                format!("below {vocab_rows}"),
                spec.mask_token_id,
            ));
        }
        let w = k + 1;
        let tokens = rows * w;
        let (h, hq, hkv, d, inter) = (
            g.hidden as usize,
            g.q_heads as usize,
            g.kv_heads as usize,
            g.head_dim as usize,
            g.intermediate as usize,
        );
        // The scratches serve every row count up to `rows` (the ops take "at least" their
        // length, and the split counts depend on the rows).
        let mut attn_ws = 0usize;
        for (l, rows) in (0..g.layers.len()).flat_map(|l| (1..=rows).map(move |m| (l, m))) {
            let len = match store.layer(l)? {
                LayerPool::Ring { lanes, window, .. } => sliding_window_attention::workspace_len(
                    &sliding_window_attention::LocalAttentionParams {
                        rows,
                        cols: w,
                        q_heads: hq,
                        kv_heads: hkv,
                        head_dim: d,
                        lanes,
                        window,
                    },
                ),
                LayerPool::Paged {
                    pages,
                    page_size,
                    max_pages,
                    ..
                } => softmax_attention::workspace_len(&softmax_attention::FullAttentionParams {
                    rows,
                    cols: w,
                    q_heads: hq,
                    kv_heads: hkv,
                    head_dim: d,
                    pages,
                    page_size,
                    max_pages,
                }),
            };
            attn_ws = attn_ws.max(len);
        }
        let cols = rows * k;
        let dflash2 = g.dflash2.is_some();
        let head_ws = (1..=rows)
            .map(|m| {
                let head_p = proposal_argmax::Params {
                    n: m * k,
                    rows: spec.head.rows,
                    hidden: h,
                    public_vocab: spec.head.public_vocab,
                    head: spec.head.kind,
                };
                if dflash2 {
                    unary_topk::workspace_len(&head_p)
                } else {
                    proposal_argmax::workspace_len(&head_p)
                }
            })
            .max()
            .unwrap_or(0);
        let groups = h / dynamic_grouped_conv::GROUP;
        let selector = match &g.dflash2 {
            Some(p) => Some(SelectorBuffers {
                unary: be.zeros(cols * TOP_K)?,
                candidates: be.zeros(cols * TOP_K)?,
                g: be.zeros(cols * p.selector_rank as usize)?,
                q: be.zeros(cols * TOP_K)?,
                chosen: be.zeros(cols)?,
            }),
            None => None,
        };
        let page_table = if g.has_full_pool {
            Some(be.zeros(rows * store.capacity().max_pages_per_lane)?)
        } else {
            None
        };
        Ok(Workspace {
            be: be.clone(),
            rows,
            k,
            mask_token: spec.mask_token_id,
            vocab_rows,
            head: spec.head,
            staged: Vec::new(),
            physical: rows,
            primed: false,
            lens: RowLens {
                hidden: h,
                branch: if dflash2 { h } else { 0 },
                q_width: hq * d,
                kv_width: hkv * d,
                head_dim: d,
                inter,
                delta: if dflash2 { 2 * groups } else { 0 },
                max_pages: store.capacity().max_pages_per_lane,
                rank: g.dflash2.as_ref().map_or(0, |p| p.selector_rank as usize),
                eps: g.rms_norm_eps as f32,
            },
            ids: be.zeros(tokens)?,
            lanes: be.zeros(rows)?,
            frontiers: be.zeros(rows)?,
            page_table,
            live: be.zeros(rows)?,
            anchors: be.zeros(rows)?,
            seeds: be.zeros(2 * rows)?,
            temperature: be.zeros(rows)?,
            x: be.zeros(tokens * h)?,
            y: be.zeros(if dflash2 { tokens * h } else { 0 })?,
            n: be.zeros(tokens * h)?,
            o: be.zeros(tokens * h)?,
            qkv_raw: be.zeros(tokens * (hq + 2 * hkv) * d)?,
            angles: be.zeros(tokens * (d / 2))?,
            q: be.zeros(tokens * hq * d)?,
            k_blk: be.zeros(tokens * hkv * d)?,
            v: be.zeros(tokens * hkv * d)?,
            attn: be.zeros(tokens * hq * d)?,
            attn_workspace: be.zeros(attn_ws)?,
            gate_up: be.zeros(tokens * 2 * inter)?,
            act: be.zeros(tokens * inter)?,
            finish_delta: be.zeros(if dflash2 { tokens * 2 * groups } else { 0 })?,
            conv_scratch: if dflash2 {
                Some(dynamic_grouped_conv::PrepareScratch::new(
                    be,
                    &dynamic_grouped_conv::ConvParams {
                        rows,
                        cols: w,
                        hidden: h,
                        group: dynamic_grouped_conv::GROUP,
                        eps: g.rms_norm_eps as f32,
                    },
                )?)
            } else {
                None
            },
            mask_hidden: be.zeros(cols * h)?,
            head_workspace: be.zeros(head_ws)?,
            proposals: be.zeros(cols)?,
            selector,
        })
    }

    fn check_model(&self, model: &DraftModel) -> Result<()> {
        if self.be.name() != model.be.name() {
            return Err(DraftError::invalid(
                "workspace backend",
                model.be.name(),
                self.be.name(),
            ));
        }
        if self.selector.is_some() != model.geometry.dflash2.is_some() {
            return Err(DraftError::invalid(
                "workspace",
                "planned for this model's backend (DFlash or DFlash2)",
                "another backend",
            ));
        }
        Ok(())
    }

    /// Bytes of every buffer the workspace allocated (their capacities): what an engine's
    /// memory plan must count for it.
    pub fn bytes(&self) -> u64 {
        fn b<T: dflash_ops::Element>(x: &Buffer<T>) -> u64 {
            (x.capacity() * std::mem::size_of::<T>()) as u64
        }
        let mut n = [
            &self.ids,
            &self.lanes,
            &self.frontiers,
            &self.live,
            &self.anchors,
            &self.seeds,
            &self.proposals,
        ]
        .into_iter()
        .map(b)
        .sum::<u64>();
        n += self.page_table.as_ref().map_or(0, b);
        n += [
            &self.temperature,
            &self.qkv_raw,
            &self.angles,
            &self.attn_workspace,
            &self.head_workspace,
        ]
        .into_iter()
        .map(b)
        .sum::<u64>();
        n += [
            &self.x,
            &self.y,
            &self.n,
            &self.o,
            &self.q,
            &self.k_blk,
            &self.v,
            &self.attn,
            &self.gate_up,
            &self.act,
            &self.finish_delta,
            &self.mask_hidden,
        ]
        .into_iter()
        .map(b)
        .sum::<u64>();
        n += self.conv_scratch.as_ref().map_or(0, |c| c.bytes());
        if let Some(s) = &self.selector {
            n += b(&s.unary) + b(&s.candidates) + b(&s.g) + b(&s.q) + b(&s.chosen);
        }
        n
    }

    /// Rows the workspace was planned for (the most one round computes).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Rows the block computes now: those of the last [`DraftModel::stage`] (or
    /// [`DraftModel::stage_padded`]); [`Self::rows`] before the first.
    pub fn physical_rows(&self) -> usize {
        self.physical
    }

    /// Resize every per-row buffer to `m` physical rows within its allocation (no
    /// allocation; addresses stay, so graphs captured at any row count stay valid).
    fn fit_rows(&mut self, m: usize) -> Result<()> {
        let (w, k) = (self.k + 1, self.k);
        let (tokens, cols) = (m * w, m * k);
        let l = self.lens;
        for (buf, len) in [
            (&mut self.x, tokens * l.hidden),
            (&mut self.n, tokens * l.hidden),
            (&mut self.o, tokens * l.hidden),
            (&mut self.y, tokens * l.branch),
            (&mut self.q, tokens * l.q_width),
            (&mut self.attn, tokens * l.q_width),
            (&mut self.k_blk, tokens * l.kv_width),
            (&mut self.v, tokens * l.kv_width),
            (&mut self.gate_up, tokens * 2 * l.inter),
            (&mut self.act, tokens * l.inter),
            (&mut self.finish_delta, tokens * l.delta),
            (&mut self.mask_hidden, cols * l.hidden),
        ] {
            buf.set_len(len)?;
        }
        self.qkv_raw
            .set_len(tokens * (l.q_width + 2 * l.kv_width))?;
        self.angles.set_len(tokens * (l.head_dim / 2))?;
        for (buf, len) in [
            (&mut self.ids, tokens),
            (&mut self.lanes, m),
            (&mut self.frontiers, m),
            (&mut self.live, m),
            (&mut self.anchors, m),
            (&mut self.seeds, 2 * m),
            (&mut self.proposals, cols),
        ] {
            buf.set_len(len)?;
        }
        self.temperature.set_len(m)?;
        if let Some(t) = &mut self.page_table {
            t.set_len(m * l.max_pages)?;
        }
        if let Some(c) = &mut self.conv_scratch {
            c.fit(&dynamic_grouped_conv::ConvParams {
                rows: m,
                cols: w,
                hidden: l.hidden,
                group: dynamic_grouped_conv::GROUP,
                eps: l.eps,
            })?;
        }
        if let Some(s) = &mut self.selector {
            s.unary.set_len(cols * TOP_K)?;
            s.q.set_len(cols * TOP_K)?;
            s.candidates.set_len(cols * TOP_K)?;
            s.chosen.set_len(cols)?;
            s.g.set_len(cols * l.rank)?;
        }
        self.physical = m;
        Ok(())
    }

    /// Draft count K.
    pub fn draft_count(&self) -> usize {
        self.k
    }

    /// The head shape the workspace was planned for.
    pub fn head(&self) -> HeadShape {
        self.head
    }

    /// Requests staged by the last [`DraftModel::stage`].
    pub fn staged_rows(&self) -> usize {
        self.staged.len()
    }

    /// Read the staged requests' results (one synchronize: every read is queued first).
    pub fn read(&self) -> Result<Vec<RowProposal>> {
        let be = &self.be;
        let k = self.k;
        // Only the requests' rows (the padding rows are never reported).
        let (cols, kk) = (self.staged.len() * k, self.staged.len() * k * TOP_K);
        let props = be.read_async(&self.proposals, 0, cols)?;
        let selector = match &self.selector {
            Some(s) => Some((
                be.read_async(&s.candidates, 0, kk)?,
                be.read_async(&s.unary, 0, kk)?,
                be.read_async(&s.q, 0, kk)?,
            )),
            None => None,
        };
        let props = props.wait()?;
        let (cand, unary, q) = match selector {
            Some((c, u, q)) => (c.wait()?, u.wait()?, q.wait()?),
            None => (Vec::new(), Vec::new(), Vec::new()),
        };
        let kk = k * TOP_K;
        let slice = |v: &[f32], r: usize| {
            if v.is_empty() {
                Vec::new()
            } else {
                v[r * kk..(r + 1) * kk].to_vec()
            }
        };
        Ok(self
            .staged
            .iter()
            .enumerate()
            .map(|(r, &usable)| RowProposal {
                tokens: props[r * k..(r + 1) * k].to_vec(),
                usable,
                candidate_ids: if cand.is_empty() {
                    Vec::new()
                } else {
                    cand[r * kk..(r + 1) * kk].to_vec()
                },
                unary_scores: slice(&unary, r),
                q: slice(&q, r),
            })
            .collect())
    }

    /// The device scratch [`Workspace::read_lattice`] gathers codebook rows into, for this
    /// workspace's rows, K and selector rank ([`LatticeScratch::bytes_for`] bytes). Refused
    /// for a DFlash workspace (no lattice).
    pub fn lattice_scratch(&self) -> Result<LatticeScratch> {
        if self.selector.is_none() {
            return Err(no_lattice());
        }
        LatticeScratch::new(&self.be, self.rows, self.k, self.lens.rank)
    }

    /// What the staged requests' DFlash2 trees need ([`crate::tree::build`]), one
    /// [`RowLattice`] per staged request (the padding rows of a graph profile are never
    /// reported): the chain (proposals, chosen ranks, q, candidate ids), unary scores, g and
    /// the codebook rows a tree can read, gathered on the backend into `scratch`: `W_pred` of
    /// the anchor and of the candidates of columns `0..K-1`, `W_succ` of every candidate.
    ///
    /// Device work, queued after the block: two strided copies (the predecessor ids:
    /// anchor, then the candidates of columns `0..K-1` per row) and two `embedding_gather`s
    /// (one per codebook); then every read is queued (the codebook rows last) and waited for
    /// together: one synchronize on CUDA. A read that does not fit the backend's pinned
    /// readback block (1 MiB; the official B = 8, K = 15, R = 256 round needs 1.0 MB before
    /// the 0.98 MB of successor rows) is made at once, one synchronize each, the reads queued
    /// before it landing with it. Nothing is allocated but the host vectors.
    ///
    /// Refused: a DFlash workspace or model, a scratch planned for another workspace shape,
    /// and an anchor or candidate id outside the codebooks' `0..vocab` (which a device gather
    /// would have read as zeros).
    pub fn read_lattice(
        &self,
        model: &DraftModel,
        scratch: &mut LatticeScratch,
    ) -> Result<Vec<RowLattice>> {
        self.check_model(model)?;
        let (Some(sel), Some(sw)) = (&self.selector, &model.weights.selector) else {
            return Err(no_lattice());
        };
        let (n, k, rank) = (self.staged.len(), self.k, self.lens.rank);
        if (scratch.k, scratch.rank) != (k, rank) || scratch.rows < n {
            return Err(DraftError::invalid(
                "lattice scratch",
                format!("K = {k}, R = {rank}, at least {n} rows (Workspace::lattice_scratch)"),
                format!(
                    "K = {}, R = {}, {} rows",
                    scratch.k, scratch.rank, scratch.rows
                ),
            ));
        }
        if n == 0 {
            return Ok(Vec::new());
        }
        let be = &self.be;
        let vocab = model.geometry.vocab_rows as usize;
        let (kk, preds) = (k * TOP_K, scratch.preds_per_request());
        let gather = embedding_gather::EmbeddingGatherParams {
            vocab,
            hidden: rank,
        };
        // Predecessor ids [n, preds]: the anchor, then the candidates of columns 0..K-1.
        scratch.ids.set_len(n * preds)?;
        be.copy_rows(&self.anchors, 0, 1, &mut scratch.ids, 0, preds, 1, n)?;
        if k > 1 {
            be.copy_rows(
                &sel.candidates,
                0,
                kk,
                &mut scratch.ids,
                1,
                preds,
                preds - 1,
                n,
            )?;
        }
        scratch.pred.set_len(n * preds * rank)?;
        embedding_gather::run(
            be,
            &scratch.ids,
            &sw.predecessor,
            &mut scratch.pred,
            &gather,
        )?;
        scratch.succ.set_len(n * kk * rank)?;
        let cand = sel.candidates.view(0, n * kk)?;
        embedding_gather::run(be, &cand, &sw.successor, &mut scratch.succ, &gather)?;

        // Small reads first, so they share the readback block; the codebook rows last.
        let anchors = be.read_async(&self.anchors, 0, n)?;
        let props = be.read_async(&self.proposals, 0, n * k)?;
        let chosen = be.read_async(&sel.chosen, 0, n * k)?;
        let q = be.read_async(&sel.q, 0, n * kk)?;
        let cands = be.read_async(&sel.candidates, 0, n * kk)?;
        let unary = be.read_async(&sel.unary, 0, n * kk)?;
        let g = be.read_async(&sel.g, 0, n * k * rank)?;
        let pred = be.read_async(&scratch.pred, 0, n * preds * rank)?;
        let succ = be.read_async(&scratch.succ, 0, n * kk * rank)?;
        let (anchors, props, chosen, q) =
            (anchors.wait()?, props.wait()?, chosen.wait()?, q.wait()?);
        let (cands, unary, g) = (cands.wait()?, unary.wait()?, g.wait()?);
        let (pred, succ) = (pred.wait()?, succ.wait()?);

        let in_vocab = |x: i32| usize::try_from(x).is_ok_and(|x| x < vocab);
        let mut out = Vec::with_capacity(n);
        for (r, &usable) in self.staged.iter().enumerate() {
            let row_err = |field: &'static str, found: i32| DraftError::Row {
                row: r,
                field,
                expected: format!("an id in 0..{vocab} (the selector codebooks' rows)"),
                found: found.to_string(),
            };
            if !in_vocab(anchors[r]) {
                return Err(row_err("anchor", anchors[r]));
            }
            let cand = &cands[r * kk..][..kk];
            if let Some(&bad) = cand.iter().find(|&&x| !in_vocab(x)) {
                return Err(row_err("candidate id", bad));
            }
            out.push(RowLattice {
                anchor: anchors[r] as u32,
                usable,
                rank,
                proposals: props[r * k..][..k].to_vec(),
                chosen: chosen[r * k..][..k].to_vec(),
                q: q[r * kk..][..kk].to_vec(),
                candidate_ids: cand.to_vec(),
                unary: unary[r * kk..][..kk].to_vec(),
                g: g[r * k * rank..][..k * rank].to_vec(),
                pred_rows: pred[r * preds * rank..][..preds * rank].to_vec(),
                succ_rows: succ[r * kk * rank..][..kk * rank].to_vec(),
            });
        }
        Ok(out)
    }

    /// The final-normed mask hidden of the staged requests, `[staged rows, K, H]` widened to
    /// F32 (the BF16 values the head consumes).
    pub fn read_mask_hidden(&self) -> Result<Vec<f32>> {
        let be = &self.be;
        let per = self.mask_hidden.len() / self.physical.max(1);
        let v = be.read(&self.mask_hidden, 0, per * self.staged.len())?;
        Ok(v.into_iter().map(f32::from).collect())
    }
}
