//! Synthetic checkpoints and target parts for tests, benchmarks and `cargo xtask fixtures`.
//!
//! A synthetic checkpoint is a directory in the published layout: `config.json` (the nested
//! `dflash_config` layout) and `model.safetensors` (or shards with
//! `model.safetensors.index.json`) holding every tensor of [`crate::weights::expected_tensors`]
//! as BF16. Values are deterministic functions of `(seed, tensor name)`
//! ([`tensor_values`]), so a tensor can be regenerated in memory without the file, and are
//! scaled for non-degenerate activations:
//!
//! | tensor | values |
//! |---|---|
//! | projections `[out, in]` (fc, q/k/v/o, gate/up/down, kernel projection, hidden projection) | uniform with standard deviation `1/sqrt(in)` (kernel projection: `0.25/sqrt(in)`) |
//! | norms (`*norm*.weight`) | `1 + U(-0.2, 0.2)` |
//! | conv `base_kernel [2, 2, H]` | tap 0: `1 + U(-0.2, 0.2)`; tap 1: `U(-0.3, 0.3)` |
//! | codebooks `[vocab, R]` | standard deviation `R^-1/4` (so an edge score is O(1)) |
//!
//! "Uniform with standard deviation s" is `U(-sqrt(3) s, sqrt(3) s)` from a SplitMix64 stream
//! seeded by `seed` and the FNV-1a hash of the name, rounded once to BF16.
//!
//! [`tiny_pair`] describes small geometries for tests; [`official_pair`] gives the two
//! official geometries (35B-A3B DFlash: 1.8 GB of weights; 27B DFlash2: 6.1 GB): generate
//! those on demand, never commit them.

use std::borrow::Cow;
use std::path::Path;

use dflash_config::{
    AttentionType, Backend as DraftBackend, DraftConfig, Geometry, ParseMode, TargetTextConfig,
    examples, validate_pair,
};
use dflash_ops::bf16;
use safetensors::{Dtype, View};

use crate::weights::{INDEX_FILE, SINGLE_FILE, TensorSpec, expected_tensors};
use crate::{DraftError, Result};

/// A deterministic stream of uniforms (SplitMix64).
#[derive(Debug, Clone)]
pub struct Stream(u64);

impl Stream {
    /// A stream for `(seed, name)`.
    pub fn new(seed: u64, name: &str) -> Self {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in name.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        Stream(seed ^ h.rotate_left(17))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform in `[-1, 1)`.
    pub fn unit(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 23) as f32) - 1.0
    }

    /// `n` BF16 values `center + U(-1, 1) * half_width`.
    pub fn bf16s(&mut self, n: usize, center: f32, half_width: f32) -> Vec<bf16> {
        (0..n)
            .map(|_| bf16::from_f32(center + self.unit() * half_width))
            .collect()
    }
}

const SQRT3: f32 = 1.732_050_8;

/// The synthetic values of tensor `s` (see the module doc).
pub fn tensor_values(s: &TensorSpec, seed: u64) -> Vec<bf16> {
    let mut st = Stream::new(seed, &s.name);
    let n: usize = s.shape.iter().product();
    let fan_in = *s.shape.last().unwrap_or(&1) as f32;
    if s.name.ends_with("norm.weight") {
        return st.bf16s(n, 1.0, 0.2);
    }
    if s.name.ends_with("base_kernel") {
        // [2 sides, 2 taps, H]: element (s, t, c) at s*2H + t*H + c.
        let h = s.shape.get(2).copied().unwrap_or(1).max(1);
        return (0..n)
            .map(|i| {
                let tap = (i / h) % 2;
                let u = st.unit();
                bf16::from_f32(if tap == 0 { 1.0 + 0.2 * u } else { 0.3 * u })
            })
            .collect();
    }
    if s.name.ends_with("_codebook") {
        let r = fan_in.max(1.0);
        return st.bf16s(n, 0.0, SQRT3 * r.powf(-0.25));
    }
    let scale = if s.name.ends_with("kernel_projection.weight") {
        0.25
    } else {
        1.0
    };
    st.bf16s(n, 0.0, SQRT3 * scale / fan_in.max(1.0).sqrt())
}

struct Lazy {
    spec: TensorSpec,
    seed: u64,
}

impl View for Lazy {
    fn dtype(&self) -> Dtype {
        Dtype::BF16
    }
    fn shape(&self) -> &[usize] {
        &self.spec.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        let v = tensor_values(&self.spec, self.seed);
        Cow::Owned(bytemuck::cast_slice::<bf16, u8>(&v).to_vec())
    }
    fn data_len(&self) -> usize {
        2 * self.spec.shape.iter().product::<usize>()
    }
}

/// How the weights are laid out on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// One `model.safetensors`.
    Single,
    /// `n` shards `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`.
    Sharded(usize),
}

/// Write a synthetic checkpoint of `draft_config_json` (validated against `target`) into
/// `dir` (created if needed): `config.json` verbatim, weights from `seed`. Returns the
/// geometry. Tensors are generated one at a time while writing. A failed write is
/// [`DraftError::Write`] (`cannot write FILE: ...`).
pub fn write_checkpoint(
    dir: &Path,
    draft_config_json: &str,
    target: &TargetTextConfig,
    seed: u64,
    layout: Layout,
) -> Result<Geometry> {
    let draft = DraftConfig::from_json_str(draft_config_json, ParseMode::Lenient)?;
    let g = validate_pair(&draft.value, target)?;
    std::fs::create_dir_all(dir).map_err(|e| DraftError::write(dir, e))?;
    let cfg = dir.join("config.json");
    std::fs::write(&cfg, draft_config_json).map_err(|e| DraftError::write(&cfg, e))?;
    let specs = expected_tensors(&g);
    let st_err = |path: &Path, e| DraftError::serialize(path, e);
    match layout {
        Layout::Single => {
            let path = dir.join(SINGLE_FILE);
            let data = specs
                .into_iter()
                .map(|s| (s.name.clone(), Lazy { spec: s, seed }));
            safetensors::serialize_to_file(data, None, &path).map_err(|e| st_err(&path, e))?;
        }
        Layout::Sharded(n) => {
            let n = n.max(1);
            let mut map = serde_json::Map::new();
            for shard in 0..n {
                let file = format!("model-{:05}-of-{:05}.safetensors", shard + 1, n);
                let path = dir.join(&file);
                let mine: Vec<TensorSpec> = specs
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| i % n == shard)
                    .map(|(_, s)| s.clone())
                    .collect();
                for s in &mine {
                    map.insert(s.name.clone(), serde_json::Value::String(file.clone()));
                }
                let data = mine
                    .into_iter()
                    .map(|s| (s.name.clone(), Lazy { spec: s, seed }));
                safetensors::serialize_to_file(data, None, &path).map_err(|e| st_err(&path, e))?;
            }
            let index = serde_json::json!({"metadata": {}, "weight_map": map});
            let path = dir.join(INDEX_FILE);
            std::fs::write(&path, index.to_string()).map_err(|e| DraftError::write(&path, e))?;
        }
    }
    Ok(g)
}

/// A small geometry to describe a synthetic draft and its target.
#[derive(Debug, Clone, PartialEq)]
pub struct TinySpec {
    /// DFlash or DFlash2.
    pub backend: DraftBackend,
    /// Hidden width H (a multiple of 16 for DFlash2).
    pub hidden: u32,
    /// Per draft layer: `Full` or `Sliding` (window [`TinySpec::window`]).
    pub layers: Vec<AttentionType>,
    /// Query heads.
    pub q_heads: u32,
    /// KV heads.
    pub kv_heads: u32,
    /// Head dimension (even).
    pub head_dim: u32,
    /// MLP width.
    pub intermediate: u32,
    /// Sliding window S.
    pub window: u32,
    /// Target block ids (n_ids of them).
    pub target_layer_ids: Vec<u32>,
    /// Target layer count.
    pub target_layers: u32,
    /// Embedding rows.
    pub vocab_rows: u32,
    /// Public vocabulary.
    pub public_vocab: u32,
    /// Mask token id.
    pub mask_token_id: u32,
    /// DFlash2 selector rank R.
    pub selector_rank: u32,
}

impl TinySpec {
    /// A tiny DFlash draft: H 32, layers [sliding, full], 4/2 heads of 8, I 48, S 6, two
    /// target ids, 80 vocab rows (72 public).
    pub fn dflash() -> Self {
        TinySpec {
            backend: DraftBackend::DFlash,
            hidden: 32,
            layers: vec![AttentionType::Sliding, AttentionType::Full],
            q_heads: 4,
            kv_heads: 2,
            head_dim: 8,
            intermediate: 48,
            window: 6,
            target_layer_ids: vec![1, 3],
            target_layers: 5,
            vocab_rows: 80,
            public_vocab: 72,
            mask_token_id: 75,
            selector_rank: 8,
        }
    }

    /// A tiny DFlash2 draft: H 32 (two groups of 16), two sliding layers (S 6), 4/2 heads of
    /// 8, I 48, rank 8, 80 vocab rows (72 public).
    pub fn dflash2() -> Self {
        TinySpec {
            backend: DraftBackend::DFlash2,
            layers: vec![AttentionType::Sliding, AttentionType::Sliding],
            ..Self::dflash()
        }
    }

    /// The draft `config.json` text (nested layout; `is_causal: false` and, with sliding
    /// layers, `use_sliding_window: true` stated as the published configs do).
    pub fn draft_config_json(&self) -> String {
        let types: Vec<&str> = self
            .layers
            .iter()
            .map(|t| match t {
                AttentionType::Full => "full_attention",
                AttentionType::Sliding => "sliding_attention",
            })
            .collect();
        let mut dcfg = serde_json::json!({
            "block_size": 16,
            "mask_token_id": self.mask_token_id,
            "num_target_layers": self.target_layers,
            "target_layer_ids": self.target_layer_ids,
        });
        if self.backend == DraftBackend::DFlash2
            && let Some(o) = dcfg.as_object_mut()
        {
            o.insert("conv_kernel_size".into(), 2.into());
            o.insert("conv_group_size".into(), 16.into());
            o.insert("selector_rank".into(), self.selector_rank.into());
            o.insert("selector_top_k".into(), 16.into());
        }
        let mut v = serde_json::json!({
            "architectures": [self.backend.architecture()],
            "model_type": "qwen3",
            "attention_bias": false,
            "hidden_act": "silu",
            "hidden_size": self.hidden,
            "vocab_size": self.vocab_rows,
            "num_attention_heads": self.q_heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers.len(),
            "layer_types": types,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10_000_000.0,
            "is_causal": false,
            "dflash_config": dcfg,
        });
        if self.layers.contains(&AttentionType::Sliding)
            && let Some(o) = v.as_object_mut()
        {
            o.insert("sliding_window".into(), self.window.into());
            o.insert("use_sliding_window".into(), true.into());
        }
        serde_json::to_string_pretty(&v).unwrap_or_default()
    }

    /// The target's text config (public vocabulary set).
    pub fn target(&self) -> TargetTextConfig {
        TargetTextConfig {
            model_type: None,
            hidden_size: self.hidden,
            num_hidden_layers: self.target_layers,
            vocab_size: self.vocab_rows,
            eos_token_ids: Vec::new(),
            public_vocab_size: Some(self.public_vocab),
        }
    }
}

/// The draft config text and target config of a tiny spec.
pub fn tiny_pair(spec: &TinySpec) -> (String, TargetTextConfig) {
    (spec.draft_config_json(), spec.target())
}

/// The official draft config text (nested layout) and target config (public vocabulary
/// 248077) of `backend`: 35B-A3B DFlash or 27B DFlash2.
pub fn official_pair(backend: DraftBackend) -> Result<(String, TargetTextConfig)> {
    let (d, t) = match backend {
        DraftBackend::DFlash => (
            examples::OFFICIAL_35B_DFLASH_DRAFT,
            examples::QWEN35_35B_A3B_TARGET,
        ),
        DraftBackend::DFlash2 => (
            examples::OFFICIAL_27B_DFLASH2_DRAFT,
            examples::QWEN35_27B_TARGET,
        ),
    };
    let target = TargetTextConfig::from_json_str(t)?
        .with_public_vocab_size(examples::QWEN35_PUBLIC_VOCAB_SIZE)?;
    Ok((d.to_owned(), target))
}

/// Synthetic target parts (host data): embedding and full output head `[vocab_rows, H]`.
#[derive(Debug, Clone)]
pub struct SyntheticTarget {
    /// Embedding rows `[vocab_rows, H]`, values `U(-sqrt 3, sqrt 3)` (unit variance).
    pub embedding: Vec<bf16>,
    /// Output head `[vocab_rows, H]`, standard deviation `1/sqrt(H)`.
    pub output_head: Vec<bf16>,
}

/// Generate synthetic target parts.
pub fn target_parts(vocab_rows: usize, hidden: usize, seed: u64) -> SyntheticTarget {
    let n = vocab_rows * hidden;
    SyntheticTarget {
        embedding: Stream::new(seed, "target.embedding").bf16s(n, 0.0, SQRT3),
        output_head: Stream::new(seed, "target.output_head").bf16s(
            n,
            0.0,
            SQRT3 / (hidden.max(1) as f32).sqrt(),
        ),
    }
}

/// An indexed shortlist of `rows` distinct public ids (chosen from `seed`, in increasing
/// order) and their rows gathered from `output_head` (`[vocab, H]`). `rows` is clamped to
/// `public_vocab`.
pub fn shortlist(
    output_head: &[bf16],
    hidden: usize,
    public_vocab: usize,
    rows: usize,
    seed: u64,
) -> (Vec<bf16>, Vec<i32>) {
    let rows = rows.min(public_vocab);
    let mut ids: Vec<usize> = (0..public_vocab).collect();
    let mut st = Stream::new(seed, "target.shortlist");
    // Partial Fisher-Yates: the first `rows` entries are a uniform sample without replacement.
    for i in 0..rows {
        let j = i + (st.next_u64() % (public_vocab - i) as u64) as usize;
        ids.swap(i, j);
    }
    let mut ids: Vec<usize> = ids[..rows].to_vec();
    ids.sort_unstable();
    let mut w = Vec::with_capacity(rows * hidden);
    for &id in &ids {
        w.extend_from_slice(&output_head[id * hidden..(id + 1) * hidden]);
    }
    (w, ids.into_iter().map(|i| i as i32).collect())
}

/// Synthetic captured features `[tokens, width]` (unit variance).
pub fn features(tokens: usize, width: usize, seed: u64) -> Vec<bf16> {
    Stream::new(seed, "target.features").bf16s(tokens * width, 0.0, SQRT3)
}

/// Synthetic weights of geometry `g` bound on `be` directly from memory (the same values a
/// checkpoint written by [`write_checkpoint`] with `seed` holds).
pub fn weights(
    be: &dflash_ops::Backend,
    g: &Geometry,
    seed: u64,
    opts: &crate::BindOptions,
) -> Result<crate::DraftWeights> {
    crate::DraftWeights::from_source(be, g, opts, |s| Ok(tensor_values(s, seed)))
}
