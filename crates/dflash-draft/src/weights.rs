//! Weight binding: open a Hugging Face draft checkpoint (memory-mapped safetensors, single file
//! or sharded), check every tensor against the config, and upload the logical roles to a
//! [`Backend`].
//!
//! Published names (FACTS.md), row-major `[out, in]`, all BF16:
//!
//! | name | shape |
//! |---|---|
//! | `fc.weight` | `[H, n_ids*H]` |
//! | `hidden_norm.weight`, `norm.weight` | `[H]` |
//! | `layers.{i}.input_layernorm.weight`, `layers.{i}.post_attention_layernorm.weight` | `[H]` |
//! | `layers.{i}.self_attn.q_proj.weight` / `o_proj.weight` | `[Hq*D, H]` / `[H, Hq*D]` |
//! | `layers.{i}.self_attn.k_proj.weight`, `v_proj.weight` | `[Hkv*D, H]` |
//! | `layers.{i}.self_attn.q_norm.weight`, `k_norm.weight` | `[D]` |
//! | `layers.{i}.mlp.gate_proj.weight`, `up_proj.weight` / `down_proj.weight` | `[I, H]` / `[H, I]` |
//! | DFlash2: `layers.{i}.{attention_conv,mlp_conv}.base_kernel` | `[2, 2, H]` |
//! | DFlash2: `layers.{i}.{attention_conv,mlp_conv}.kernel_projection.weight` | `[4*H/16, H]` |
//! | DFlash2: `candidate_selector.hidden_projection.weight` | `[R, H]` |
//! | DFlash2: `candidate_selector.{predecessor,successor}_codebook` | `[vocab, R]` |
//!
//! Name variants of published checkpoints are read as the names above ([`canonical_name`]):
//! a leading `model.` is dropped; `encoder.fc.weight` is `fc.weight`,
//! `encoder.output_norm_enc.weight` is `hidden_norm.weight`; `midlayer.` is `layers.0.`.
//! Every missing, unexpected, duplicated, misshaped or non-BF16 tensor is a typed
//! [`DraftError`] naming it.
//!
//! Bound representation. The block forward reads a layer's query, key and value projections
//! as ONE weight, the published `q_proj`, `k_proj` and `v_proj` concatenated by rows at load
//! ([`LayerWeights::qkv_proj`], `[(Hq + 2 Hkv) * D, H]`: one GEMM a layer instead of three),
//! and `gate_proj` / `up_proj` likewise ([`LayerWeights::gate_up_proj`], `[2 I, H]`). The
//! published tensors stay the source: the values are theirs, bit for bit, and each part is
//! readable on its own as a view ([`LayerWeights::k_proj`], ...).
//!
//! Logical roles. The stored `k_proj` / `v_proj` serve two roles: the query-block K/V (the
//! block forward) and the context K/V (prefill and materialize). [`RoleBinding`] chooses the
//! context role's representation on its own: [`RoleBinding::Shared`] binds it to the very
//! memory of the block role (the k / v rows of `qkv_proj`: one device copy, as the official
//! recipes do); [`RoleBinding::Separate`] uploads a second, independent device copy of the
//! same stored BF16 data. Both compute identical values; `Separate` only lets an embedder
//! place, replace or free one role's buffer without touching the other. No other
//! representation (quantized, transposed) is implemented.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use dflash_config::{Backend as DraftBackend, Geometry};
use dflash_context::{LayerKvWeights, MaterializeWeights};
use dflash_ops::{Backend, Borrowed, Buffer, bf16};
use safetensors::{Dtype, SafeTensors};

use crate::{DraftError, Result};

/// Single-file weights name.
pub const SINGLE_FILE: &str = "model.safetensors";
/// Sharded weights index name.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// Config name.
pub const CONFIG_FILE: &str = "config.json";

/// One tensor the config requires: its published name and shape (always BF16).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Published name.
    pub name: String,
    /// Row-major shape.
    pub shape: Vec<usize>,
}

fn spec(name: impl Into<String>, shape: &[usize]) -> TensorSpec {
    TensorSpec {
        name: name.into(),
        shape: shape.to_vec(),
    }
}

/// Every tensor a checkpoint of geometry `g` must hold, in a fixed order (the table in the
/// module doc).
pub fn expected_tensors(g: &Geometry) -> Vec<TensorSpec> {
    let h = g.hidden as usize;
    let (hq, hkv, d, i) = (
        g.q_heads as usize,
        g.kv_heads as usize,
        g.head_dim as usize,
        g.intermediate as usize,
    );
    let mut v = vec![
        spec("fc.weight", &[h, g.n_ids() * h]),
        spec("hidden_norm.weight", &[h]),
        spec("norm.weight", &[h]),
    ];
    for l in 0..g.layers.len() {
        let p = format!("layers.{l}.");
        v.push(spec(format!("{p}input_layernorm.weight"), &[h]));
        v.push(spec(format!("{p}post_attention_layernorm.weight"), &[h]));
        v.push(spec(format!("{p}self_attn.q_proj.weight"), &[hq * d, h]));
        v.push(spec(format!("{p}self_attn.k_proj.weight"), &[hkv * d, h]));
        v.push(spec(format!("{p}self_attn.v_proj.weight"), &[hkv * d, h]));
        v.push(spec(format!("{p}self_attn.o_proj.weight"), &[h, hq * d]));
        v.push(spec(format!("{p}self_attn.q_norm.weight"), &[d]));
        v.push(spec(format!("{p}self_attn.k_norm.weight"), &[d]));
        v.push(spec(format!("{p}mlp.gate_proj.weight"), &[i, h]));
        v.push(spec(format!("{p}mlp.up_proj.weight"), &[i, h]));
        v.push(spec(format!("{p}mlp.down_proj.weight"), &[h, i]));
        if let Some(d2) = &g.dflash2 {
            let groups = h / d2.conv_group_size.max(1) as usize;
            for branch in ["attention_conv", "mlp_conv"] {
                v.push(spec(format!("{p}{branch}.base_kernel"), &[2, 2, h]));
                v.push(spec(
                    format!("{p}{branch}.kernel_projection.weight"),
                    &[4 * groups, h],
                ));
            }
        }
    }
    if let Some(d2) = &g.dflash2 {
        let r = d2.selector_rank as usize;
        let vocab = g.vocab_rows as usize;
        v.push(spec("candidate_selector.hidden_projection.weight", &[r, h]));
        v.push(spec("candidate_selector.predecessor_codebook", &[vocab, r]));
        v.push(spec("candidate_selector.successor_codebook", &[vocab, r]));
    }
    v
}

/// The published name a stored name is read as (see the module doc). Names without a known
/// variant are returned unchanged.
pub fn canonical_name(stored: &str) -> String {
    let s = stored.strip_prefix("model.").unwrap_or(stored);
    match s {
        "encoder.fc.weight" => return "fc.weight".to_owned(),
        "encoder.output_norm_enc.weight" => return "hidden_norm.weight".to_owned(),
        _ => {}
    }
    if let Some(rest) = s.strip_prefix("midlayer.") {
        return format!("layers.0.{rest}");
    }
    s.to_owned()
}

/// A tensor entry of an opened checkpoint.
#[derive(Debug, Clone)]
struct Entry {
    file: usize,
    stored: String,
    dtype: Dtype,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

#[derive(Debug)]
struct MappedFile {
    path: PathBuf,
    map: memmap2::Mmap,
}

/// An opened draft checkpoint: its `config.json` text and its memory-mapped safetensors, with
/// every stored tensor indexed by its published name. Nothing is copied until a tensor is read.
#[derive(Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    config_json: String,
    files: Vec<MappedFile>,
    tensors: BTreeMap<String, Entry>,
}

fn map_file(path: &Path) -> Result<memmap2::Mmap> {
    let f = std::fs::File::open(path).map_err(|e| DraftError::io(path, e))?;
    // SAFETY: the map is read-only and private to this process; the checkpoint files must not
    // be truncated or rewritten while a `Checkpoint` is open (the usual contract of mapped
    // model files, documented on `Checkpoint::open`).
    unsafe { memmap2::Mmap::map(&f) }.map_err(|e| DraftError::io(path, e))
}

fn st_err(path: &Path, e: impl std::fmt::Display) -> DraftError {
    DraftError::Safetensors {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}

impl Checkpoint {
    /// Open `dir`: read `config.json` and memory-map `model.safetensors`, or the shards listed
    /// by `model.safetensors.index.json` (its `weight_map` must agree with the shards: every
    /// listed tensor in its shard, every shard tensor listed).
    ///
    /// The files must not change while the checkpoint is open (they are memory-mapped).
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let cfg_path = dir.join(CONFIG_FILE);
        let config_json =
            std::fs::read_to_string(&cfg_path).map_err(|e| DraftError::io(&cfg_path, e))?;
        let index_path = dir.join(INDEX_FILE);
        let single = dir.join(SINGLE_FILE);
        let mut ck = Checkpoint {
            dir: dir.clone(),
            config_json,
            files: Vec::new(),
            tensors: BTreeMap::new(),
        };
        if index_path.exists() {
            let weight_map = read_index(&index_path)?;
            let mut shards: Vec<String> = weight_map.values().cloned().collect();
            shards.sort();
            shards.dedup();
            for shard in &shards {
                ck.add_file(&dir.join(shard))?;
            }
            let idx_err = |problem: String| DraftError::ShardIndex {
                path: index_path.display().to_string(),
                problem,
            };
            // Every listed tensor is in its shard; every shard tensor is listed there.
            let mut stored_in: BTreeMap<&str, &str> = BTreeMap::new();
            for e in ck.tensors.values() {
                let f = &ck.files[e.file].path;
                let name = f.file_name().and_then(|n| n.to_str()).unwrap_or("");
                stored_in.insert(e.stored.as_str(), name);
            }
            for (t, shard) in &weight_map {
                match stored_in.get(t.as_str()) {
                    Some(s) if Path::new(shard).file_name().and_then(|n| n.to_str()) == Some(s) => {
                    }
                    Some(s) => {
                        return Err(idx_err(format!(
                            "`{t}` is listed in `{shard}` but stored in `{s}`"
                        )));
                    }
                    None => {
                        return Err(idx_err(format!(
                            "`{t}` is listed in `{shard}` but that shard does not hold it"
                        )));
                    }
                }
            }
            for e in ck.tensors.values() {
                if !weight_map.contains_key(&e.stored) {
                    return Err(idx_err(format!(
                        "`{}` is stored in `{}` but not listed in the weight_map",
                        e.stored,
                        ck.files[e.file].path.display()
                    )));
                }
            }
        } else if single.exists() {
            ck.add_file(&single)?;
        } else {
            return Err(DraftError::NoWeights {
                dir: dir.display().to_string(),
            });
        }
        Ok(ck)
    }

    fn add_file(&mut self, path: &Path) -> Result<()> {
        let map = map_file(path)?;
        let file = self.files.len();
        let base = map.as_ptr() as usize;
        let st = SafeTensors::deserialize(&map).map_err(|e| st_err(path, e))?;
        let mut found = Vec::new();
        for (stored, view) in st.iter() {
            let start = view.data().as_ptr() as usize - base;
            found.push(Entry {
                file,
                stored: stored.to_owned(),
                dtype: view.dtype(),
                shape: view.shape().to_vec(),
                start,
                end: start + view.data().len(),
            });
        }
        drop(st);
        self.files.push(MappedFile {
            path: path.to_path_buf(),
            map,
        });
        for e in found {
            let canonical = canonical_name(&e.stored);
            if let Some(prev) = self.tensors.get(&canonical) {
                return Err(DraftError::DuplicateTensor {
                    name: canonical,
                    first: prev.stored.clone(),
                    second: e.stored,
                });
            }
            self.tensors.insert(canonical, e);
        }
        Ok(())
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The text of `config.json`.
    pub fn config_json(&self) -> &str {
        &self.config_json
    }

    /// Published names of every stored tensor, sorted.
    pub fn tensor_names(&self) -> Vec<&str> {
        self.tensors.keys().map(String::as_str).collect()
    }

    /// Check the stored tensors against geometry `g`: exactly the [`expected_tensors`], each
    /// BF16 with the expected shape. Errors name the first offending tensor:
    /// [`DraftError::MissingTensor`], [`DraftError::UnexpectedTensor`],
    /// [`DraftError::TensorDType`], [`DraftError::TensorShape`].
    pub fn check(&self, g: &Geometry) -> Result<()> {
        let expected = expected_tensors(g);
        for s in &expected {
            self.entry(s)?;
        }
        for (canonical, e) in &self.tensors {
            if !expected.iter().any(|s| &s.name == canonical) {
                return Err(DraftError::UnexpectedTensor {
                    stored: e.stored.clone(),
                    canonical: canonical.clone(),
                    file: self.files[e.file].path.display().to_string(),
                });
            }
        }
        Ok(())
    }

    fn entry(&self, s: &TensorSpec) -> Result<&Entry> {
        let e = self
            .tensors
            .get(&s.name)
            .ok_or_else(|| DraftError::MissingTensor {
                name: s.name.clone(),
                dtype: "BF16",
                shape: s.shape.clone(),
            })?;
        if e.dtype != Dtype::BF16 {
            return Err(DraftError::TensorDType {
                name: s.name.clone(),
                expected: "BF16".into(),
                found: format!("{:?}", e.dtype),
            });
        }
        if e.shape != s.shape {
            return Err(DraftError::TensorShape {
                name: s.name.clone(),
                expected: s.shape.clone(),
                found: e.shape.clone(),
            });
        }
        Ok(e)
    }

    /// The BF16 elements of tensor `s` (checked for presence, dtype and shape), copied out of
    /// the map.
    pub fn read_bf16(&self, s: &TensorSpec) -> Result<Vec<bf16>> {
        let e = self.entry(s)?;
        let bytes = &self.files[e.file].map[e.start..e.end];
        Ok(bytes
            .chunks_exact(2)
            .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
            .collect())
    }
}

fn read_index(path: &Path) -> Result<BTreeMap<String, String>> {
    let text = std::fs::read_to_string(path).map_err(|e| DraftError::io(path, e))?;
    let err = |problem: String| DraftError::ShardIndex {
        path: path.display().to_string(),
        problem,
    };
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| err(format!("invalid JSON: {e}")))?;
    let wm = v
        .get("weight_map")
        .and_then(|w| w.as_object())
        .ok_or_else(|| err("`weight_map` is missing or not an object".into()))?;
    let mut out = BTreeMap::new();
    for (t, f) in wm {
        let f = f
            .as_str()
            .ok_or_else(|| err(format!("`weight_map.{t}` is not a file name")))?;
        let p = Path::new(f);
        if p.is_absolute()
            || p.components()
                .any(|c| !matches!(c, std::path::Component::Normal(_)))
        {
            return Err(err(format!(
                "`weight_map.{t}` = `{f}`: shard names must be relative paths inside the checkpoint"
            )));
        }
        out.insert(t.clone(), f.to_owned());
    }
    if out.is_empty() {
        return Err(err("`weight_map` lists no tensor".into()));
    }
    Ok(out)
}

/// How the context K/V role is bound to the stored `k_proj` / `v_proj` (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RoleBinding {
    /// The context role uses the query-block role's device buffers (one copy).
    #[default]
    Shared,
    /// The context role gets its own device copy of the same stored BF16 data.
    Separate,
}

/// Options of [`DraftWeights::bind`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BindOptions {
    /// Representation of the context K/V role relative to the query-block K/V role.
    pub context_kv: RoleBinding,
}

/// DFlash2's convolution weights of one branch.
#[derive(Debug)]
pub struct ConvWeights {
    /// `base_kernel`: `[2 sides, 2 taps, H]`.
    pub base: Buffer<bf16>,
    /// `kernel_projection.weight` (W_delta): `[4 * H/16, H]`.
    pub projection: Buffer<bf16>,
}

/// One draft layer's bound weights.
#[derive(Debug)]
pub struct LayerWeights {
    /// `input_layernorm.weight` `[H]`.
    pub input_norm: Buffer<bf16>,
    /// `post_attention_layernorm.weight` `[H]`.
    pub post_attention_norm: Buffer<bf16>,
    /// `q_proj.weight`, then the query-block role of `k_proj.weight` and `v_proj.weight`,
    /// concatenated by rows: `[(Hq + 2 Hkv) * D, H]`.
    pub qkv_proj: Buffer<bf16>,
    /// `o_proj.weight` `[H, Hq*D]`.
    pub o_proj: Buffer<bf16>,
    /// `q_norm.weight` `[D]`.
    pub q_norm: Buffer<bf16>,
    /// `k_norm.weight` `[D]` (both roles: the key norm is part of the same contract).
    pub k_norm: Buffer<bf16>,
    /// `gate_proj.weight` then `up_proj.weight`, concatenated by rows: `[2 I, H]`.
    pub gate_up_proj: Buffer<bf16>,
    /// `down_proj.weight` `[H, I]`.
    pub down_proj: Buffer<bf16>,
    /// Context role of `k_proj` / `v_proj` when bound [`RoleBinding::Separate`].
    pub context_kv: Option<(Buffer<bf16>, Buffer<bf16>)>,
    /// DFlash2: `attention_conv` (None for DFlash).
    pub attention_conv: Option<ConvWeights>,
    /// DFlash2: `mlp_conv` (None for DFlash).
    pub mlp_conv: Option<ConvWeights>,
    /// Elements of `q_proj` (`Hq * D * H`): where `k_proj` starts in `qkv_proj`.
    q_len: usize,
    /// Elements of `k_proj` and of `v_proj` each (`Hkv * D * H`).
    kv_len: usize,
}

impl LayerWeights {
    /// `q_proj.weight` `[Hq*D, H]`: the first rows of [`Self::qkv_proj`].
    pub fn q_proj(&self) -> Result<Borrowed<'_, bf16>> {
        Ok(self.qkv_proj.view(0, self.q_len)?)
    }

    /// The query-block role of `k_proj.weight` `[Hkv*D, H]`: rows of [`Self::qkv_proj`].
    pub fn k_proj(&self) -> Result<Borrowed<'_, bf16>> {
        Ok(self.qkv_proj.view(self.q_len, self.kv_len)?)
    }

    /// The query-block role of `v_proj.weight` `[Hkv*D, H]`: the last rows of
    /// [`Self::qkv_proj`].
    pub fn v_proj(&self) -> Result<Borrowed<'_, bf16>> {
        Ok(self.qkv_proj.view(self.q_len + self.kv_len, self.kv_len)?)
    }

    /// The context role's K projection (the block role's rows, or its own copy).
    pub fn context_k(&self) -> Result<Borrowed<'_, bf16>> {
        match &self.context_kv {
            Some((k, _)) => Ok(k.view(0, k.len())?),
            None => self.k_proj(),
        }
    }

    /// The context role's V projection (the block role's rows, or its own copy).
    pub fn context_v(&self) -> Result<Borrowed<'_, bf16>> {
        match &self.context_kv {
            Some((_, v)) => Ok(v.view(0, v.len())?),
            None => self.v_proj(),
        }
    }
}

/// DFlash2's candidate selector weights.
#[derive(Debug)]
pub struct SelectorWeights {
    /// `hidden_projection.weight` (W_hidden) `[R, H]`.
    pub hidden_projection: Buffer<bf16>,
    /// `predecessor_codebook` `[vocab, R]`.
    pub predecessor: Buffer<bf16>,
    /// `successor_codebook` `[vocab, R]`.
    pub successor: Buffer<bf16>,
}

/// Every draft weight, bound to its logical role on one backend.
#[derive(Debug)]
pub struct DraftWeights {
    /// `fc.weight` (W_feature) `[H, n_ids*H]`.
    pub fc: Buffer<bf16>,
    /// `hidden_norm.weight` (context norm) `[H]`.
    pub hidden_norm: Buffer<bf16>,
    /// `norm.weight` (final norm) `[H]`.
    pub norm: Buffer<bf16>,
    /// Per draft layer.
    pub layers: Vec<LayerWeights>,
    /// DFlash2 selector (None for DFlash).
    pub selector: Option<SelectorWeights>,
    /// How the context K/V role was bound.
    pub context_kv: RoleBinding,
}

impl DraftWeights {
    /// Check `ck` against `g` ([`Checkpoint::check`]) and upload every role to `be`.
    pub fn bind(be: &Backend, ck: &Checkpoint, g: &Geometry, opts: &BindOptions) -> Result<Self> {
        ck.check(g)?;
        Self::from_source(be, g, opts, |s| ck.read_bf16(s))
    }

    /// Bind weights whose values come from `read` (called once per role with the tensor's
    /// published name and shape; it must return exactly `shape.product()` elements). Used by
    /// [`DraftWeights::bind`] and by in-memory synthetic weights.
    pub fn from_source(
        be: &Backend,
        g: &Geometry,
        opts: &BindOptions,
        mut read: impl FnMut(&TensorSpec) -> Result<Vec<bf16>>,
    ) -> Result<Self> {
        let specs = expected_tensors(g);
        // The values of the named tensors, concatenated (one tensor: its values).
        let mut values = |names: &[&str]| -> Result<Vec<bf16>> {
            let mut out = Vec::new();
            for &name in names {
                let s = specs.iter().find(|s| s.name == name).ok_or_else(|| {
                    DraftError::MissingTensor {
                        name: name.to_owned(),
                        dtype: "BF16",
                        shape: Vec::new(),
                    }
                })?;
                let data = read(s)?;
                let n: usize = s.shape.iter().product();
                if data.len() != n {
                    return Err(DraftError::TensorShape {
                        name: name.to_owned(),
                        expected: s.shape.clone(),
                        found: vec![data.len()],
                    });
                }
                if out.is_empty() {
                    out = data;
                } else {
                    out.extend_from_slice(&data);
                }
            }
            Ok(out)
        };
        let mut up_rows =
            |names: &[&str]| -> Result<Buffer<bf16>> { Ok(be.upload(&values(names)?)?) };
        let (h, d) = (g.hidden as usize, g.head_dim as usize);
        let (q_len, kv_len) = (g.q_heads as usize * d * h, g.kv_heads as usize * d * h);
        let mut layers = Vec::with_capacity(g.layers.len());
        for l in 0..g.layers.len() {
            // Layer l's tensors `names` (without the `layers.{l}.` prefix), concatenated.
            let mut up = |names: &[&str]| -> Result<Buffer<bf16>> {
                let full: Vec<String> = names.iter().map(|s| format!("layers.{l}.{s}")).collect();
                up_rows(&full.iter().map(String::as_str).collect::<Vec<_>>())
            };
            let mut conv = |branch: &str| -> Result<Option<ConvWeights>> {
                if g.backend != DraftBackend::DFlash2 {
                    return Ok(None);
                }
                Ok(Some(ConvWeights {
                    base: up(&[&format!("{branch}.base_kernel")])?,
                    projection: up(&[&format!("{branch}.kernel_projection.weight")])?,
                }))
            };
            let attention_conv = conv("attention_conv")?;
            let mlp_conv = conv("mlp_conv")?;
            let context_kv = match opts.context_kv {
                RoleBinding::Shared => None,
                RoleBinding::Separate => Some((
                    up(&["self_attn.k_proj.weight"])?,
                    up(&["self_attn.v_proj.weight"])?,
                )),
            };
            layers.push(LayerWeights {
                input_norm: up(&["input_layernorm.weight"])?,
                post_attention_norm: up(&["post_attention_layernorm.weight"])?,
                qkv_proj: up(&[
                    "self_attn.q_proj.weight",
                    "self_attn.k_proj.weight",
                    "self_attn.v_proj.weight",
                ])?,
                o_proj: up(&["self_attn.o_proj.weight"])?,
                q_norm: up(&["self_attn.q_norm.weight"])?,
                k_norm: up(&["self_attn.k_norm.weight"])?,
                gate_up_proj: up(&["mlp.gate_proj.weight", "mlp.up_proj.weight"])?,
                down_proj: up(&["mlp.down_proj.weight"])?,
                context_kv,
                attention_conv,
                mlp_conv,
                q_len,
                kv_len,
            });
            if opts.context_kv == RoleBinding::Shared {
                // The context role reads the k / v rows of `qkv_proj` as views: refused here,
                // naming the tensor, rather than at the first materialize.
                let lw = &layers[l];
                for (name, view) in [("k_proj", lw.k_proj().err()), ("v_proj", lw.v_proj().err())] {
                    if let Some(e) = view {
                        return Err(DraftError::invalid(
                            format!("layers.{l}.self_attn.{name}.weight"),
                            "rows of the bound [q_proj; k_proj; v_proj] that start 16-byte \
                             aligned (Hq * D * H and Hkv * D * H multiples of 8), or \
                             RoleBinding::Separate",
                            e,
                        ));
                    }
                }
            }
        }
        let selector = if g.backend == DraftBackend::DFlash2 {
            Some(SelectorWeights {
                hidden_projection: up_rows(&["candidate_selector.hidden_projection.weight"])?,
                predecessor: up_rows(&["candidate_selector.predecessor_codebook"])?,
                successor: up_rows(&["candidate_selector.successor_codebook"])?,
            })
        } else {
            None
        };
        Ok(DraftWeights {
            fc: up_rows(&["fc.weight"])?,
            hidden_norm: up_rows(&["hidden_norm.weight"])?,
            norm: up_rows(&["norm.weight"])?,
            layers,
            selector,
            context_kv: opts.context_kv,
        })
    }

    /// The weights [`dflash_context::ContextStore::materialize`] needs (the context role, as
    /// views: no copy, no driver call; their alignment was checked at bind).
    pub fn materialize_weights(&self) -> Result<MaterializeWeights<'_>> {
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(LayerKvWeights {
                    w_k: l.context_k()?,
                    w_v: l.context_v()?,
                    key_norm: &l.k_norm,
                })
            })
            .collect::<Result<_>>()?;
        Ok(MaterializeWeights {
            fc: &self.fc,
            hidden_norm: &self.hidden_norm,
            layers,
        })
    }
}
