//! The reference model: tensor layout, loading, and the per-column forward with its records.
//!
//! Numerics. Weights are stored BF16 (F32 is also read) and widened exactly to f32. Every
//! activation, the residual stream, the Gated DeltaNet state, the conv window and the K/V
//! cache are f32; nothing is rounded between ops. The only rounding points are the outputs:
//! captured features are `bf16_rne(residual)`, logits stay f32. Reductions run in f32 in index
//! order. RoPE angles and their cos/sin are computed in f64 and rounded to f32.
//!
//! Determinism. Each column is computed by the same code whether it is one column of a long
//! verify, a node of a tree verify, a prefill position or a single decoded token: its
//! arithmetic depends only on the column's input, its position and the state left by its
//! ancestors (the committed state, then the columns of its root-to-node path: attention visits
//! the committed keys in position order, then the path's new keys in root-to-node order; the
//! Gated DeltaNet state and conv window are its parent's). A chain is the tree whose parent of
//! column `i` is `i - 1`. Hence verify-then-commit-N is bit-identical to N single-token steps,
//! and a tree node computes exactly what the last column of a chain verify of its root path
//! computes.

use half::bf16;
use safetensors::{Dtype, SafeTensors};

use crate::error::{Result, TestkitError};
use crate::geometry::{LayerKind, TargetGeometry};

/// The name prefix of the text model's tensors in a Qwen3.5 checkpoint.
pub const TEXT_PREFIX: &str = "model.language_model.";

/// How the fixture writer initializes a tensor (the loader only uses name and shape).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Init {
    /// Uniform with standard deviation `std`.
    Uniform { std: f32 },
    /// `center + uniform(-half, half)`.
    Around { center: f32, half: f32 },
    /// `ln(uniform(lo, hi))` (A_log).
    LogUniform { lo: f32, hi: f32 },
}

/// One stored tensor: name, shape and fixture initialization.
#[derive(Clone, Debug)]
pub(crate) struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub init: Init,
}

fn proj(fan_in: usize) -> Init {
    Init::Uniform {
        std: 1.0 / (fan_in as f32).sqrt(),
    }
}

/// Every tensor of the reference model, with the real Qwen3.5 names, in a fixed order.
pub(crate) fn tensor_specs(g: &TargetGeometry, tied: bool) -> Vec<TensorSpec> {
    let h = g.hidden;
    let spec = |name: String, shape: Vec<usize>, init: Init| TensorSpec { name, shape, init };
    let zc_norm = Init::Around {
        center: 0.0,
        half: 0.1,
    };
    let mut v = vec![spec(
        format!("{TEXT_PREFIX}embed_tokens.weight"),
        vec![g.vocab_rows, h],
        Init::Uniform { std: 1.0 },
    )];
    let nk_dk = g.linear_key_heads * g.linear_key_dim;
    let nv_dv = g.linear_value_heads * g.linear_value_dim;
    for (i, kind) in g.layer_types.iter().enumerate() {
        let p = format!("{TEXT_PREFIX}layers.{i}.");
        v.push(spec(format!("{p}input_layernorm.weight"), vec![h], zc_norm));
        match kind {
            LayerKind::LinearAttention => {
                let a = format!("{p}linear_attn.");
                let nv = g.linear_value_heads;
                v.push(spec(
                    format!("{a}in_proj_qkv.weight"),
                    vec![2 * nk_dk + nv_dv, h],
                    proj(h),
                ));
                v.push(spec(
                    format!("{a}in_proj_z.weight"),
                    vec![nv_dv, h],
                    proj(h),
                ));
                v.push(spec(format!("{a}in_proj_b.weight"), vec![nv, h], proj(h)));
                v.push(spec(format!("{a}in_proj_a.weight"), vec![nv, h], proj(h)));
                v.push(spec(
                    format!("{a}conv1d.weight"),
                    vec![g.conv_dim(), 1, g.conv_kernel],
                    Init::Uniform { std: 0.5 },
                ));
                v.push(spec(
                    format!("{a}A_log"),
                    vec![nv],
                    Init::LogUniform { lo: 0.1, hi: 1.0 },
                ));
                v.push(spec(
                    format!("{a}dt_bias"),
                    vec![nv],
                    Init::Around {
                        center: 0.0,
                        half: 0.5,
                    },
                ));
                v.push(spec(
                    format!("{a}norm.weight"),
                    vec![g.linear_value_dim],
                    Init::Around {
                        center: 1.0,
                        half: 0.1,
                    },
                ));
                v.push(spec(
                    format!("{a}out_proj.weight"),
                    vec![h, nv_dv],
                    proj(nv_dv),
                ));
            }
            LayerKind::FullAttention => {
                let a = format!("{p}self_attn.");
                let (hq, hkv, d) = (g.attn_heads, g.kv_heads, g.head_dim);
                v.push(spec(
                    format!("{a}q_proj.weight"),
                    vec![hq * d * 2, h],
                    proj(h),
                ));
                v.push(spec(format!("{a}k_proj.weight"), vec![hkv * d, h], proj(h)));
                v.push(spec(format!("{a}v_proj.weight"), vec![hkv * d, h], proj(h)));
                v.push(spec(
                    format!("{a}o_proj.weight"),
                    vec![h, hq * d],
                    proj(hq * d),
                ));
                v.push(spec(format!("{a}q_norm.weight"), vec![d], zc_norm));
                v.push(spec(format!("{a}k_norm.weight"), vec![d], zc_norm));
            }
        }
        v.push(spec(
            format!("{p}post_attention_layernorm.weight"),
            vec![h],
            zc_norm,
        ));
        let m = format!("{p}mlp.");
        v.push(spec(
            format!("{m}gate_proj.weight"),
            vec![g.intermediate, h],
            proj(h),
        ));
        v.push(spec(
            format!("{m}up_proj.weight"),
            vec![g.intermediate, h],
            proj(h),
        ));
        v.push(spec(
            format!("{m}down_proj.weight"),
            vec![h, g.intermediate],
            proj(g.intermediate),
        ));
    }
    v.push(spec(format!("{TEXT_PREFIX}norm.weight"), vec![h], zc_norm));
    if !tied {
        v.push(spec(
            "lm_head.weight".to_owned(),
            vec![g.vocab_rows, h],
            Init::Uniform {
                std: 2.0 / (h as f32).sqrt(),
            },
        ));
    }
    v
}

/// Gated DeltaNet weights of one block.
#[derive(Debug)]
struct GdnWeights {
    /// `[2*nk*dk + nv*dv, H]`: q, k, v channels in that order.
    in_qkv: Vec<f32>,
    /// `[nv*dv, H]`.
    in_z: Vec<f32>,
    /// `[nv, H]`.
    in_b: Vec<f32>,
    /// `[nv, H]`.
    in_a: Vec<f32>,
    /// `[conv_dim, K]` (the stored `[conv_dim, 1, K]`); tap `K-1` multiplies the current input.
    conv: Vec<f32>,
    /// `[nv]`.
    a_log: Vec<f32>,
    /// `[nv]`.
    dt_bias: Vec<f32>,
    /// `[dv]`, plain (not zero-centred) gated-norm weight shared by the value heads.
    norm: Vec<f32>,
    /// `[H, nv*dv]`.
    out: Vec<f32>,
}

/// Gated full-attention weights of one block.
#[derive(Debug)]
struct AttnWeights {
    /// `[hq * 2D, H]`: per head, D query rows then D gate rows.
    q: Vec<f32>,
    /// `[hkv*D, H]`.
    k: Vec<f32>,
    /// `[hkv*D, H]`.
    v: Vec<f32>,
    /// `[H, hq*D]`.
    o: Vec<f32>,
    /// `[D]`, zero-centred.
    q_norm: Vec<f32>,
    /// `[D]`, zero-centred.
    k_norm: Vec<f32>,
}

#[derive(Debug)]
enum Mixer {
    /// Gated DeltaNet; `slot` indexes the sequence's recurrent states.
    Gdn { slot: usize, w: GdnWeights },
    /// Gated attention; `slot` indexes the sequence's KV caches.
    Attn { slot: usize, w: AttnWeights },
}

#[derive(Debug)]
struct Layer {
    input_norm: Vec<f32>,
    post_norm: Vec<f32>,
    mixer: Mixer,
    gate: Vec<f32>,
    up: Vec<f32>,
    down: Vec<f32>,
}

/// The loaded reference model (weights widened to f32).
#[derive(Debug)]
pub(crate) struct Model {
    pub geo: TargetGeometry,
    embed: Vec<f32>,
    /// `None` when tied to the embedding.
    head: Option<Vec<f32>>,
    final_norm: Vec<f32>,
    layers: Vec<Layer>,
    gdn_layers: usize,
    attn_layers: usize,
}

/// Committed recurrent state of one Gated DeltaNet block.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct GdnState {
    /// `[nv, dk, dv]`: `s[h][i][j]`, key index i, value index j.
    pub s: Vec<f32>,
    /// `[K-1, conv_dim]`: the pre-conv inputs of the last K-1 positions, oldest first (zeros
    /// before position 0).
    pub conv: Vec<f32>,
}

/// K/V of one attention block, `[len, hkv*D]` each (K after norm and RoPE).
#[derive(Clone, Debug, PartialEq, Default)]
pub(crate) struct KvCache {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

/// The committed state of a sequence.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct SeqState {
    pub frontier: usize,
    pub gdn: Vec<GdnState>,
    pub kv: Vec<KvCache>,
}

/// Per-column records of one Gated DeltaNet block in a verify block.
#[derive(Clone, Debug, Default)]
pub(crate) struct GdnRecords {
    /// `[Q, nv*dk*dv]`: the recurrent state after each column.
    pub states: Vec<f32>,
    /// `[Q, conv_dim]`: each column's pre-conv input (what enters the conv window).
    pub conv_in: Vec<f32>,
}

/// The per-column records of one verify block (round scratch until commit), indexed by
/// column.
#[derive(Clone, Debug)]
pub(crate) struct Records {
    /// Live columns Q.
    pub q: usize,
    /// The block's shape: `parents[i - 1] < i` is the parent column of column `i`, `Q - 1`
    /// entries (a chain has `parents[i - 1] = i - 1`).
    pub parents: Vec<u32>,
    pub gdn: Vec<GdnRecords>,
    /// The K/V of the Q new columns per attention block, `[Q, hkv*D]` in column order.
    pub kv: Vec<KvCache>,
}

/// What a forward over some columns produced.
pub(crate) struct Forward {
    pub records: Records,
    /// `[Q, n_ids*H]` BF16 captured features.
    pub features: Vec<bf16>,
    /// `[Q - logits_from, V]` logits of columns `logits_from..Q`.
    pub logits: Vec<f32>,
}

fn matvec(w: &[f32], rows: usize, cols: usize, x: &[f32]) -> Vec<f32> {
    debug_assert_eq!(w.len(), rows * cols);
    debug_assert_eq!(x.len(), cols);
    w.chunks_exact(cols)
        .map(|row| {
            let mut acc = 0.0f32;
            for (a, b) in row.iter().zip(x) {
                acc += a * b;
            }
            acc
        })
        .collect()
}

/// `1 / sqrt(mean(x^2) + eps)` in f32.
fn rms_scale(x: &[f32], eps: f32) -> f32 {
    let mut ss = 0.0f32;
    for v in x {
        ss += v * v;
    }
    1.0 / (ss / x.len() as f32 + eps).sqrt()
}

/// Zero-centred RMSNorm: `x * rsqrt(mean(x^2) + eps) * (1 + w)`.
pub(crate) fn zc_rmsnorm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let r = rms_scale(x, eps);
    x.iter().zip(w).map(|(v, wi)| v * r * (1.0 + wi)).collect()
}

pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `ln(1 + e^x)`, linear above 20 (as torch's softplus).
pub(crate) fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// In-place L2 normalization `x * rsqrt(sum(x^2) + 1e-6)`.
fn l2norm(x: &mut [f32]) {
    let mut ss = 0.0f32;
    for v in x.iter() {
        ss += v * v;
    }
    let r = 1.0 / (ss + 1e-6).sqrt();
    for v in x.iter_mut() {
        *v *= r;
    }
}

fn read_tensor(st: &SafeTensors<'_>, spec: &TensorSpec) -> Result<Vec<f32>> {
    let view = st
        .tensor(&spec.name)
        .map_err(|_| TestkitError::MissingTensor {
            name: spec.name.clone(),
        })?;
    if view.shape() != spec.shape.as_slice() {
        return Err(TestkitError::TensorShape {
            name: spec.name.clone(),
            expected: spec.shape.clone(),
            found: view.shape().to_vec(),
        });
    }
    let data = view.data();
    let out: Vec<f32> = match view.dtype() {
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        other => {
            return Err(TestkitError::TensorDType {
                name: spec.name.clone(),
                found: format!("{other:?}"),
            });
        }
    };
    if let Some(index) = out.iter().position(|v| !v.is_finite()) {
        return Err(TestkitError::NonFinite {
            name: spec.name.clone(),
            index,
        });
    }
    Ok(out)
}

impl Model {
    /// Bind every tensor of `geo` from a parsed safetensors file (names not used by the text
    /// model, e.g. `visual.*` or `mtp.*`, are ignored).
    pub(crate) fn from_safetensors(
        geo: TargetGeometry,
        tied: bool,
        st: &SafeTensors<'_>,
    ) -> Result<Self> {
        geo.validate()?;
        let specs = tensor_specs(&geo, tied);
        let mut it = specs.iter();
        let mut next = || -> Result<Vec<f32>> {
            // `tensor_specs` lists exactly the tensors consumed below, in this order.
            match it.next() {
                Some(spec) => read_tensor(st, spec),
                None => Err(TestkitError::MissingTensor {
                    name: "<tensor list exhausted>".to_owned(),
                }),
            }
        };
        let embed = next()?;
        let mut layers = Vec::with_capacity(geo.layers());
        let (mut gdn_layers, mut attn_layers) = (0, 0);
        for kind in &geo.layer_types {
            let input_norm = next()?;
            let mixer = match kind {
                LayerKind::LinearAttention => {
                    let w = GdnWeights {
                        in_qkv: next()?,
                        in_z: next()?,
                        in_b: next()?,
                        in_a: next()?,
                        conv: next()?,
                        a_log: next()?,
                        dt_bias: next()?,
                        norm: next()?,
                        out: next()?,
                    };
                    gdn_layers += 1;
                    Mixer::Gdn {
                        slot: gdn_layers - 1,
                        w,
                    }
                }
                LayerKind::FullAttention => {
                    let w = AttnWeights {
                        q: next()?,
                        k: next()?,
                        v: next()?,
                        o: next()?,
                        q_norm: next()?,
                        k_norm: next()?,
                    };
                    attn_layers += 1;
                    Mixer::Attn {
                        slot: attn_layers - 1,
                        w,
                    }
                }
            };
            let post_norm = next()?;
            let gate = next()?;
            let up = next()?;
            let down = next()?;
            layers.push(Layer {
                input_norm,
                post_norm,
                mixer,
                gate,
                up,
                down,
            });
        }
        let final_norm = next()?;
        let head = if tied { None } else { Some(next()?) };
        Ok(Model {
            geo,
            embed,
            head,
            final_norm,
            layers,
            gdn_layers,
            attn_layers,
        })
    }

    /// The state of a new sequence: frontier 0, zero recurrent states and conv windows, empty
    /// caches.
    pub(crate) fn empty_state(&self) -> SeqState {
        let g = &self.geo;
        let s_len = g.linear_value_heads * g.linear_key_dim * g.linear_value_dim;
        SeqState {
            frontier: 0,
            gdn: (0..self.gdn_layers)
                .map(|_| GdnState {
                    s: vec![0.0; s_len],
                    conv: vec![0.0; (g.conv_kernel - 1) * g.conv_dim()],
                })
                .collect(),
            kv: vec![KvCache::default(); self.attn_layers],
        }
    }

    fn eps(&self) -> f32 {
        self.geo.rms_eps as f32
    }

    /// One Gated DeltaNet step for one column: updates the working state `ws` (its parent's
    /// state on entry, the column's own on return) and appends the column's records.
    fn gdn_step(
        &self,
        w: &GdnWeights,
        ws: &mut GdnState,
        n: &[f32],
        rec: &mut GdnRecords,
    ) -> Vec<f32> {
        let g = &self.geo;
        let (h, nk, nv, dk, dv, kk) = (
            g.hidden,
            g.linear_key_heads,
            g.linear_value_heads,
            g.linear_key_dim,
            g.linear_value_dim,
            g.conv_kernel,
        );
        let cd = g.conv_dim();
        let qkv = matvec(&w.in_qkv, cd, h, n);
        let z = matvec(&w.in_z, nv * dv, h, n);
        let b = matvec(&w.in_b, nv, h, n);
        let a = matvec(&w.in_a, nv, h, n);
        // Causal depthwise conv over [window (oldest first), current], then SiLU.
        let mut y = vec![0.0f32; cd];
        for (c, yc) in y.iter_mut().enumerate() {
            let wc = &w.conv[c * kk..(c + 1) * kk];
            let mut acc = 0.0f32;
            for (t, wt) in wc[..kk - 1].iter().enumerate() {
                acc += wt * ws.conv[t * cd + c];
            }
            acc += wc[kk - 1] * qkv[c];
            *yc = silu(acc);
        }
        // Advance the window by this column's input.
        if kk > 1 {
            ws.conv.copy_within(cd.., 0);
            let last = (kk - 2) * cd;
            ws.conv[last..].copy_from_slice(&qkv);
        }
        rec.conv_in.extend_from_slice(&qkv);
        let (q_all, rest) = y.split_at_mut(nk * dk);
        let (k_all, v_all) = rest.split_at_mut(nk * dk);
        let qscale = 1.0 / (dk as f32).sqrt();
        for hk in 0..nk {
            l2norm(&mut q_all[hk * dk..(hk + 1) * dk]);
            l2norm(&mut k_all[hk * dk..(hk + 1) * dk]);
            for v in &mut q_all[hk * dk..(hk + 1) * dk] {
                *v *= qscale;
            }
        }
        let group = nv / nk;
        let mut o = vec![0.0f32; nv * dv];
        for hv in 0..nv {
            let hk = hv / group;
            let q = &q_all[hk * dk..(hk + 1) * dk];
            let k = &k_all[hk * dk..(hk + 1) * dk];
            let v = &v_all[hv * dv..(hv + 1) * dv];
            let beta = sigmoid(b[hv]);
            let gate = -w.a_log[hv].exp() * softplus(a[hv] + w.dt_bias[hv]);
            let decay = gate.exp();
            let s = &mut ws.s[hv * dk * dv..(hv + 1) * dk * dv];
            for e in s.iter_mut() {
                *e *= decay;
            }
            // delta_j = beta * (v_j - sum_i S[i][j] k_i);  S[i][j] += k_i * delta_j
            let mut delta = vec![0.0f32; dv];
            for (j, dj) in delta.iter_mut().enumerate() {
                let mut mem = 0.0f32;
                for i in 0..dk {
                    mem += s[i * dv + j] * k[i];
                }
                *dj = beta * (v[j] - mem);
            }
            for i in 0..dk {
                for j in 0..dv {
                    s[i * dv + j] += k[i] * delta[j];
                }
            }
            // o_j = sum_i S[i][j] q_i (q already carries 1/sqrt(dk)), then the gated norm.
            let oh = &mut o[hv * dv..(hv + 1) * dv];
            for (j, oj) in oh.iter_mut().enumerate() {
                let mut acc = 0.0f32;
                for i in 0..dk {
                    acc += s[i * dv + j] * q[i];
                }
                *oj = acc;
            }
            let r = rms_scale(oh, self.eps());
            let zh = &z[hv * dv..(hv + 1) * dv];
            for j in 0..dv {
                oh[j] = oh[j] * r * w.norm[j] * silu(zh[j]);
            }
        }
        rec.states.extend_from_slice(&ws.s);
        matvec(&w.out, h, nv * dv, &o)
    }

    /// Rotate the first `rotary_dim` entries of a head (split-half) for position `pos`.
    fn rope(&self, x: &mut [f32], pos: usize) {
        let rd = self.geo.rotary_dim();
        let half = rd / 2;
        for i in 0..half {
            let inv = self.geo.rope_theta.powf(-((2 * i) as f64) / rd as f64);
            let ang = pos as f64 * inv;
            let (c, s) = (ang.cos() as f32, ang.sin() as f32);
            let (x1, x2) = (x[i], x[i + half]);
            x[i] = x1 * c - x2 * s;
            x[i + half] = x2 * c + x1 * s;
        }
    }

    /// One gated attention step for the column at `pos`: appends its K/V to `new` (this block's
    /// records, in column order) and attends over the committed `cache` in position order,
    /// then the new columns of `path` (the column's root-to-node path, itself last) in that
    /// order.
    fn attn_step(
        &self,
        w: &AttnWeights,
        cache: &KvCache,
        new: &mut KvCache,
        path: &[usize],
        pos: usize,
        n: &[f32],
    ) -> Vec<f32> {
        let g = &self.geo;
        let (h, hq, hkv, d) = (g.hidden, g.attn_heads, g.kv_heads, g.head_dim);
        let eps = self.eps();
        let qg = matvec(&w.q, hq * 2 * d, h, n);
        let mut k = matvec(&w.k, hkv * d, h, n);
        let v = matvec(&w.v, hkv * d, h, n);
        for kh in 0..hkv {
            let mut kn = zc_rmsnorm(&k[kh * d..(kh + 1) * d], &w.k_norm, eps);
            self.rope(&mut kn, pos);
            k[kh * d..(kh + 1) * d].copy_from_slice(&kn);
        }
        new.k.extend_from_slice(&k);
        new.v.extend_from_slice(&v);
        let kvw = hkv * d;
        debug_assert_eq!(path.last(), Some(&(new.k.len() / kvw - 1)));
        let n_cache = cache.k.len() / kvw;
        let n_total = n_cache + path.len();
        let key_at = |t: usize| -> (&[f32], &[f32]) {
            if t < n_cache {
                (
                    &cache.k[t * kvw..(t + 1) * kvw],
                    &cache.v[t * kvw..(t + 1) * kvw],
                )
            } else {
                let u = path[t - n_cache];
                (
                    &new.k[u * kvw..(u + 1) * kvw],
                    &new.v[u * kvw..(u + 1) * kvw],
                )
            }
        };
        let scale = 1.0 / (d as f32).sqrt();
        let group = hq / hkv;
        let mut out = vec![0.0f32; hq * d];
        let mut scores = vec![0.0f32; n_total];
        for qh in 0..hq {
            let mut q = zc_rmsnorm(&qg[qh * 2 * d..qh * 2 * d + d], &w.q_norm, eps);
            self.rope(&mut q, pos);
            let gate = &qg[qh * 2 * d + d..(qh + 1) * 2 * d];
            let kh = qh / group;
            let mut mx = f32::NEG_INFINITY;
            for (t, sc) in scores.iter_mut().enumerate() {
                let (kt, _) = key_at(t);
                let mut acc = 0.0f32;
                for (a, b) in q.iter().zip(&kt[kh * d..(kh + 1) * d]) {
                    acc += a * b;
                }
                *sc = acc * scale;
                mx = mx.max(*sc);
            }
            let mut sum = 0.0f32;
            for sc in scores.iter_mut() {
                *sc = (*sc - mx).exp();
                sum += *sc;
            }
            let oh = &mut out[qh * d..(qh + 1) * d];
            for (t, sc) in scores.iter().enumerate() {
                let (_, vt) = key_at(t);
                let p = sc / sum;
                for (o, vv) in oh.iter_mut().zip(&vt[kh * d..(kh + 1) * d]) {
                    *o += p * vv;
                }
            }
            for (o, gt) in oh.iter_mut().zip(gate) {
                *o *= sigmoid(*gt);
            }
        }
        matvec(&w.o, h, hq * d, &out)
    }

    /// Logits of one final residual: zero-centred final norm, then the output head.
    fn logits(&self, x: &[f32]) -> Vec<f32> {
        let g = &self.geo;
        let xf = zc_rmsnorm(x, &self.final_norm, self.eps());
        let head = self.head.as_deref().unwrap_or(&self.embed);
        matvec(head, g.vocab_rows, g.hidden, &xf)
    }

    /// Run `tokens` as the columns of a tree on top of `state` (which is not modified):
    /// `parents[i - 1] < i` is the parent column of column `i` (`None`: the chain, parent
    /// `i - 1`). Column `i` takes position `state.frontier + depth(i)` (`depth(0) = 0`, a child
    /// one deeper than its parent), starts from its parent's Gated DeltaNet state and conv
    /// window (column 0 from the committed ones) and attends to the committed cache, then its
    /// root-to-node path's new K/V in that order. Captured features use `capture` (block ids,
    /// recorded order); logits are computed for columns `logits_from ..`; when `trace` is
    /// given, the f32 residual after every block of every column is appended to it
    /// (`[Q, layers, H]`). The caller guarantees valid token ids, capture ids and parents
    /// (`Q - 1` of them, each below its column).
    pub(crate) fn forward(
        &self,
        state: &SeqState,
        tokens: &[u32],
        parents: Option<&[u32]>,
        capture: &[usize],
        logits_from: usize,
        mut trace: Option<&mut Vec<f32>>,
    ) -> Forward {
        let g = &self.geo;
        let h = g.hidden;
        let q = tokens.len();
        let eps = self.eps();
        let parents: Vec<u32> = match parents {
            Some(p) => p.to_vec(),
            None => (0..q.saturating_sub(1) as u32).collect(),
        };
        debug_assert_eq!(parents.len(), q.saturating_sub(1));
        debug_assert!(parents.iter().enumerate().all(|(i, &p)| (p as usize) <= i));
        // Per Gated DeltaNet block, the working state after each column (indexed by column).
        let mut after: Vec<Vec<GdnState>> = vec![Vec::new(); self.gdn_layers];
        // Each column's root-to-node path of columns, itself last.
        let mut paths: Vec<Vec<usize>> = Vec::with_capacity(q);
        let mut records = Records {
            q,
            parents,
            gdn: vec![GdnRecords::default(); self.gdn_layers],
            kv: vec![KvCache::default(); self.attn_layers],
        };
        let fw = capture.len() * h;
        let mut features = vec![bf16::ZERO; q * fw];
        let mut logits = Vec::with_capacity(q.saturating_sub(logits_from) * g.vocab_rows);
        for (j, &tok) in tokens.iter().enumerate() {
            let parent = j.checked_sub(1).map(|i| records.parents[i] as usize);
            let mut path = parent.map_or_else(Vec::new, |p| paths[p].clone());
            path.push(j);
            let pos = state.frontier + path.len() - 1;
            let t = tok as usize;
            let mut x = self.embed[t * h..(t + 1) * h].to_vec();
            for (li, layer) in self.layers.iter().enumerate() {
                let n = zc_rmsnorm(&x, &layer.input_norm, eps);
                let mix = match &layer.mixer {
                    Mixer::Gdn { slot, w } => {
                        let mut ws = match parent {
                            Some(p) => after[*slot][p].clone(),
                            None => state.gdn[*slot].clone(),
                        };
                        let out = self.gdn_step(w, &mut ws, &n, &mut records.gdn[*slot]);
                        after[*slot].push(ws);
                        out
                    }
                    Mixer::Attn { slot, w } => {
                        self.attn_step(w, &state.kv[*slot], &mut records.kv[*slot], &path, pos, &n)
                    }
                };
                for (xi, mi) in x.iter_mut().zip(&mix) {
                    *xi += mi;
                }
                let m = zc_rmsnorm(&x, &layer.post_norm, eps);
                let gt = matvec(&layer.gate, g.intermediate, h, &m);
                let up = matvec(&layer.up, g.intermediate, h, &m);
                let act: Vec<f32> = gt.iter().zip(&up).map(|(a, b)| silu(*a) * b).collect();
                let down = matvec(&layer.down, h, g.intermediate, &act);
                for (xi, di) in x.iter_mut().zip(&down) {
                    *xi += di;
                }
                for (c, &id) in capture.iter().enumerate() {
                    if id == li {
                        let dst = &mut features[j * fw + c * h..j * fw + (c + 1) * h];
                        for (f, v) in dst.iter_mut().zip(&x) {
                            *f = bf16::from_f32(*v);
                        }
                    }
                }
                if let Some(tr) = trace.as_deref_mut() {
                    tr.extend_from_slice(&x);
                }
            }
            if j >= logits_from {
                logits.extend(self.logits(&x));
            }
            paths.push(path);
        }
        Forward {
            records,
            features,
            logits,
        }
    }

    /// Fold the columns of `path` (a root-to-node path of `records`' tree, each entry the
    /// parent of the next, first entry 0; the chain prefix `0..n` is the path of column
    /// `n - 1`) into `state`: recurrent state = the recorded state after the path's last
    /// column, conv window advanced by the path columns' recorded inputs in path order, K/V
    /// extended by the path columns' rows in path order, frontier `+ path.len()`. An empty
    /// path changes nothing. The caller guarantees a valid path.
    pub(crate) fn commit(&self, state: &mut SeqState, records: &Records, path: &[usize]) {
        let Some(&last) = path.last() else {
            return;
        };
        debug_assert!(path.iter().all(|&c| c < records.q));
        let g = &self.geo;
        let cd = g.conv_dim();
        let s_len = g.linear_value_heads * g.linear_key_dim * g.linear_value_dim;
        let win = g.conv_kernel - 1;
        for (st, rec) in state.gdn.iter_mut().zip(&records.gdn) {
            st.s.copy_from_slice(&rec.states[last * s_len..(last + 1) * s_len]);
            let mut all = std::mem::take(&mut st.conv);
            for &c in path {
                all.extend_from_slice(&rec.conv_in[c * cd..(c + 1) * cd]);
            }
            st.conv = all[all.len() - win * cd..].to_vec();
        }
        let kvw = g.kv_heads * g.head_dim;
        for (c, rec) in state.kv.iter_mut().zip(&records.kv) {
            for &col in path {
                c.k.extend_from_slice(&rec.k[col * kvw..(col + 1) * kvw]);
                c.v.extend_from_slice(&rec.v[col * kvw..(col + 1) * kvw]);
            }
        }
        state.frontier += path.len();
    }
}
