//! The `propose` inspection tool (library side): prefill a draft's context from captured
//! features, run one block, and write everything a peer implementation needs to compare.
//!
//! `propose --model DIR --inputs FILE --out FILE [--device cpu|cuda] [--mask-token-id N]
//! [--strict]`
//!
//! - `--mask-token-id N`: the mask token for a draft whose `config.json` has
//!   `mask_token_id: null` (the published Qwen3.5 DFlash layouts); when the config states one,
//!   `N` must equal it.
//! - `--strict`: refuse a config with fields the parser does not know (by default they are
//!   reported, [`Prepared::report`], and the `propose` binary prints them as warnings).
//!
//! Every argument, the checkpoint, the config and the inputs file are checked before anything
//! runs; the output is written to a temporary file next to `--out` and renamed over it, so a
//! failed run never leaves a partial output.
//!
//! Inputs: a safetensors file with exactly these tensors:
//!
//! | name | dtype | shape | meaning |
//! |---|---|---|---|
//! | `features` | BF16 | `[T, n_ids*H]` | captured target features of positions `0..T` |
//! | `embedding` | BF16 | `[V, H]` | the target's token embedding |
//! | `output_head` | BF16 | `[V, H]` | the target's full output head |
//! | `anchor` | I32 | `[1]` | the token at position `F = T`, `0..V` |
//! | `draft_tokens` | I32 | `[1]` | K, `1..=15` |
//! | `temperature` | F32 | `[1]` | selector temperature (DFlash2): finite and `>= 0`, `0` greedy ([`dflash_config::check_temperature`]) |
//! | `seed` | I64 | `[1]` | request seed (bit pattern of the u64) |
//! | `public_vocab` | I32 | `[1]` | public vocabulary size, `1..=V` |
//!
//! The target config the draft is validated against is formed from the inputs: H and V from
//! `embedding`, the target layer count from the draft's `num_target_layers` (else the largest
//! target id + 1). [`synthetic_inputs`] and [`write_inputs`] make a ready inputs file for any
//! draft geometry (`cargo xtask fixtures` writes one next to each draft it writes).
//!
//! Output: a safetensors file with `context_k.{l}` BF16 `[T_live, Hkv, D]` and `context_v.{l}`
//! F16 `[T_live, Hkv, D]` per draft layer l (the live window's positions in increasing order
//! as stored: the last `min(T, S)` for a local layer, all T for a full layer), `mask_hidden`
//! F32 `[K, H]` (the final-normed BF16 hidden of the mask columns, widened), `proposals` I32
//! `[K]`, and for DFlash2 `candidate_ids` I32 `[K, 16]`, `unary_scores` F32 `[K, 16]`,
//! `proposal_q` F32 `[K, 16]`. The block runs with all K proposals usable (DFlash: W live
//! columns).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use dflash_config::{
    Backend as DraftBackend, Geometry, MAX_DRAFT_COUNT, ParseMode, TargetTextConfig,
    check_temperature,
};
use dflash_context::{Capacity, ContextStore};
use dflash_ops::proposal_argmax::ProposalHead as OpsHead;
use dflash_ops::{Backend, OpsError, bf16};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors, View};

use crate::load::ConfigReport;
use crate::model::{DraftModel, RowRequest, TOP_K, Workspace, WorkspaceSpec};
use crate::synthetic;
use crate::target::{HeadParts, HeadShape, TargetParts};
use crate::weights::{BindOptions, Checkpoint, DraftWeights};
use crate::{DraftError, Result};

/// Where the tool runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// The CPU reference backend.
    Cpu,
    /// CUDA device 0 (needs the `cuda` feature).
    Cuda,
}

/// Parsed command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProposeArgs {
    /// Checkpoint directory.
    pub model: PathBuf,
    /// Inputs file.
    pub inputs: PathBuf,
    /// Output file.
    pub out: PathBuf,
    /// Device.
    pub device: Device,
    /// `--mask-token-id`: the mask token when the config has none.
    pub mask_token_id: Option<u32>,
    /// `--strict`: refuse unknown config fields.
    pub strict: bool,
}

/// Usage text.
pub const USAGE: &str = "usage: propose --model DIR --inputs FILE --out FILE [--device cpu|cuda] \
[--mask-token-id N] [--strict]";

fn arg_error(flag: &str, expected: impl Into<String>, found: impl Into<String>) -> DraftError {
    DraftError::Argument {
        flag: flag.to_owned(),
        expected: expected.into(),
        found: found.into(),
    }
}

/// Parse the arguments after the program name. Every flag may appear once; a flag that takes
/// a value needs one (a following flag is not a value); unknown arguments are refused.
pub fn parse_args(args: &[String]) -> Result<ProposeArgs> {
    let mut values: BTreeMap<&'static str, String> = BTreeMap::new();
    let mut strict = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let flag: &'static str = match a.as_str() {
            "--model" => "--model",
            "--inputs" => "--inputs",
            "--out" => "--out",
            "--device" => "--device",
            "--mask-token-id" => "--mask-token-id",
            "--strict" => {
                if strict {
                    return Err(arg_error("--strict", "at most once", "it twice"));
                }
                strict = true;
                continue;
            }
            other => {
                return Err(arg_error(
                    other,
                    "a propose flag (`propose --help` lists them)",
                    "an unknown argument",
                ));
            }
        };
        let value = match it.next() {
            Some(v) if !v.starts_with("--") => v.clone(),
            Some(v) => return Err(arg_error(flag, "a value", format!("the flag `{v}`"))),
            None => return Err(arg_error(flag, "a value", "the end of the command line")),
        };
        if values.insert(flag, value).is_some() {
            return Err(arg_error(flag, "at most once", "it twice"));
        }
    }
    let mut take_path = |flag: &str, what: &str| {
        values
            .remove(flag)
            .map(PathBuf::from)
            .ok_or_else(|| arg_error(flag, format!("{what} (required; {USAGE})"), "nothing"))
    };
    let model = take_path("--model", "the draft checkpoint directory")?;
    let inputs = take_path("--inputs", "the inputs safetensors file")?;
    let out = take_path("--out", "the output file")?;
    let device = match values.get("--device").map(String::as_str) {
        None | Some("cpu") => Device::Cpu,
        Some("cuda") => Device::Cuda,
        Some(other) => return Err(arg_error("--device", "cpu or cuda", format!("`{other}`"))),
    };
    let mask_token_id = values
        .get("--mask-token-id")
        .map(|v| {
            v.parse::<u32>().map_err(|_| {
                arg_error(
                    "--mask-token-id",
                    "a token id (an integer 0..=4294967295)",
                    format!("`{v}`"),
                )
            })
        })
        .transpose()?;
    Ok(ProposeArgs {
        model,
        inputs,
        out,
        device,
        mask_token_id,
        strict,
    })
}

/// The backend of `device`.
pub fn backend(device: Device) -> Result<Backend> {
    match device {
        Device::Cpu => Ok(Backend::cpu()),
        #[cfg(feature = "cuda")]
        Device::Cuda => Ok(Backend::Cuda(dflash_ops::cuda::CudaBackend::new(0)?)),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda => Err(OpsError::CudaNotCompiled.into()),
    }
}

/// One output tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct OutTensor {
    /// Dtype.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Little-endian bytes.
    pub data: Vec<u8>,
}

impl View for &OutTensor {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

fn out_tensor<T: bytemuck::Pod>(dtype: Dtype, shape: Vec<usize>, v: &[T]) -> OutTensor {
    OutTensor {
        dtype,
        shape,
        data: bytemuck::cast_slice(v).to_vec(),
    }
}

/// The inputs of one tool run (see the module doc), checked on their own by [`parse_inputs`]:
/// every value is in range; only the fit with a draft's geometry is checked later.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolInputs {
    /// The file the inputs came from, as named in errors.
    pub path: String,
    /// `[T, n_ids*H]`.
    pub features: Vec<bf16>,
    /// T.
    pub tokens: usize,
    /// `[V, H]`.
    pub embedding: Vec<bf16>,
    /// `[V, H]`.
    pub output_head: Vec<bf16>,
    /// V.
    pub vocab_rows: usize,
    /// H.
    pub hidden: usize,
    /// Anchor, `0..V`.
    pub anchor: i32,
    /// K, `1..=15`.
    pub draft_tokens: i32,
    /// Temperature, finite and `>= 0`.
    pub temperature: f32,
    /// Seed (bit pattern).
    pub seed: i64,
    /// Public vocabulary, `1..=V`.
    pub public_vocab: i32,
}

const INPUT_NAMES: [&str; 8] = [
    "features",
    "embedding",
    "output_head",
    "anchor",
    "draft_tokens",
    "temperature",
    "seed",
    "public_vocab",
];

/// Parse and check an inputs file's bytes (`path` only names it in errors). Every error is a
/// [`DraftError::InputFile`] naming `path` and the tensor.
pub fn parse_inputs(path: &str, bytes: &[u8]) -> Result<ToolInputs> {
    let err = |problem: String| DraftError::InputFile {
        path: path.to_owned(),
        problem,
    };
    let st = SafeTensors::deserialize(bytes).map_err(|e| err(format!("not safetensors: {e}")))?;
    let names: Vec<&str> = st.names();
    for n in &names {
        if !INPUT_NAMES.contains(n) {
            return Err(err(format!(
                "unexpected tensor `{n}` (the file holds exactly {INPUT_NAMES:?})"
            )));
        }
    }
    let get = |name: &str, dtype: Dtype| -> Result<TensorView<'_>> {
        let t = st
            .tensor(name)
            .map_err(|_| err(format!("tensor `{name}` is missing")))?;
        if t.dtype() != dtype {
            return Err(err(format!(
                "tensor `{name}`: expected dtype {dtype:?}, found {:?}",
                t.dtype()
            )));
        }
        Ok(t)
    };
    let shape_err = |name: &str, expected: &str, found: &[usize]| {
        err(format!(
            "tensor `{name}`: expected shape {expected}, found {found:?}"
        ))
    };
    let emb = get("embedding", Dtype::BF16)?;
    let (vocab_rows, hidden) = match emb.shape() {
        [v, h] if *v >= 1 && *h >= 1 => (*v, *h),
        s => return Err(shape_err("embedding", "[V >= 1, H >= 1]", s)),
    };
    let head = get("output_head", Dtype::BF16)?;
    if head.shape() != [vocab_rows, hidden] {
        return Err(shape_err(
            "output_head",
            &format!("[{vocab_rows}, {hidden}] (the embedding's)"),
            head.shape(),
        ));
    }
    let feats = get("features", Dtype::BF16)?;
    let tokens = match feats.shape() {
        [t, w] if *w >= 1 && w % hidden == 0 => *t,
        s => {
            return Err(shape_err("features", &format!("[T, n_ids * {hidden}]"), s));
        }
    };
    let scalar = |name: &str, dtype: Dtype| -> Result<Vec<u8>> {
        let t = get(name, dtype)?;
        if t.shape() != [1] {
            return Err(shape_err(name, "[1]", t.shape()));
        }
        Ok(t.data().to_vec())
    };
    let i32_of = |b: Vec<u8>| i32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let bf = |v: &[u8]| -> Vec<bf16> {
        v.chunks_exact(2)
            .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
            .collect()
    };
    let seed_b = scalar("seed", Dtype::I64)?;
    let mut s8 = [0u8; 8];
    s8.copy_from_slice(&seed_b[..8]);
    let range = |name: &str, v: i32, lo: i32, hi: usize| -> Result<i32> {
        if v >= lo && usize::try_from(v).is_ok_and(|u| u <= hi) {
            Ok(v)
        } else {
            Err(err(format!(
                "tensor `{name}`: expected {lo}..={hi}, found {v}"
            )))
        }
    };
    let anchor = range(
        "anchor",
        i32_of(scalar("anchor", Dtype::I32)?),
        0,
        vocab_rows - 1,
    )?;
    let draft_tokens = range(
        "draft_tokens",
        i32_of(scalar("draft_tokens", Dtype::I32)?),
        1,
        MAX_DRAFT_COUNT as usize,
    )?;
    let public_vocab = range(
        "public_vocab",
        i32_of(scalar("public_vocab", Dtype::I32)?),
        1,
        vocab_rows,
    )?;
    let t = scalar("temperature", Dtype::F32)?;
    let temperature =
        check_temperature("temperature", f32::from_le_bytes([t[0], t[1], t[2], t[3]]))
            .map_err(|e| err(format!("tensor {e}")))?;
    Ok(ToolInputs {
        path: path.to_owned(),
        features: bf(feats.data()),
        tokens,
        embedding: bf(emb.data()),
        output_head: bf(head.data()),
        vocab_rows,
        hidden,
        anchor,
        draft_tokens,
        temperature,
        seed: i64::from_le_bytes(s8),
        public_vocab,
    })
}

/// Synthetic inputs for a draft of geometry `g`: `tokens` positions of synthetic features,
/// synthetic target parts (`synthetic::target_parts`), anchor 1, K = `draft_tokens`,
/// temperature 0 (greedy), all deterministic in `seed`.
pub fn synthetic_inputs(
    g: &Geometry,
    public_vocab: u32,
    tokens: usize,
    draft_tokens: u32,
    seed: u64,
) -> ToolInputs {
    let (v, h) = (g.vocab_rows as usize, g.hidden as usize);
    let parts = synthetic::target_parts(v, h, seed);
    ToolInputs {
        path: "synthetic inputs".to_owned(),
        features: synthetic::features(tokens, g.feature_width as usize, seed),
        tokens,
        embedding: parts.embedding,
        output_head: parts.output_head,
        vocab_rows: v,
        hidden: h,
        anchor: 1.min(public_vocab.saturating_sub(1)) as i32,
        draft_tokens: draft_tokens as i32,
        temperature: 0.0,
        seed: seed as i64,
        public_vocab: public_vocab as i32,
    }
}

/// Write `tensors` as a safetensors file at `path`: into a temporary file next to it, renamed
/// over `path` once complete, so a failure never leaves a partial file at `path`. Errors are
/// [`DraftError::Write`] naming `path`.
fn write_safetensors<V: View>(path: &Path, tensors: Vec<(String, V)>) -> Result<()> {
    let name = path
        .file_name()
        .ok_or_else(|| DraftError::write(path, "the path names no file"))?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(".{}.partial", std::process::id()));
    let tmp = path.with_file_name(tmp_name);
    let written = safetensors::serialize_to_file(tensors, None, &tmp)
        .map_err(|e| DraftError::serialize(path, e))
        .and_then(|()| std::fs::rename(&tmp, path).map_err(|e| DraftError::write(path, e)));
    if written.is_err() {
        // Best effort: the temporary file may not exist (creating it is what failed).
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Write `inputs` as an inputs file at `path` (the format [`parse_inputs`] reads).
pub fn write_inputs(path: &Path, inputs: &ToolInputs) -> Result<()> {
    let anchor = inputs.anchor.to_le_bytes();
    let k = inputs.draft_tokens.to_le_bytes();
    let temp = inputs.temperature.to_le_bytes();
    let seed = inputs.seed.to_le_bytes();
    let public = inputs.public_vocab.to_le_bytes();
    let (t, v, h) = (inputs.tokens, inputs.vocab_rows, inputs.hidden);
    let width = inputs.features.len() / t.max(1);
    let tensors: Vec<(&str, Dtype, Vec<usize>, &[u8])> = vec![
        (
            "features",
            Dtype::BF16,
            vec![t, width],
            bytemuck::cast_slice(&inputs.features),
        ),
        (
            "embedding",
            Dtype::BF16,
            vec![v, h],
            bytemuck::cast_slice(&inputs.embedding),
        ),
        (
            "output_head",
            Dtype::BF16,
            vec![v, h],
            bytemuck::cast_slice(&inputs.output_head),
        ),
        ("anchor", Dtype::I32, vec![1], &anchor),
        ("draft_tokens", Dtype::I32, vec![1], &k),
        ("temperature", Dtype::F32, vec![1], &temp),
        ("seed", Dtype::I64, vec![1], &seed),
        ("public_vocab", Dtype::I32, vec![1], &public),
    ];
    let views = tensors
        .into_iter()
        .map(|(name, dtype, shape, data)| {
            TensorView::new(dtype, shape, data)
                .map(|view| (name.to_owned(), view))
                .map_err(|e| DraftError::write(path, format!("tensor `{name}`: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    write_safetensors(path, views)
}

/// What [`propose`] needs besides the checkpoint and the inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ToolOptions {
    /// `--mask-token-id`.
    pub mask_token_id: Option<u32>,
    /// How to treat unknown config fields.
    pub mode: ParseMode,
}

/// A draft bound and checked against one inputs file; nothing computed yet.
#[derive(Debug)]
struct Checked {
    model: DraftModel,
    report: ConfigReport,
    k: usize,
    mask: u32,
}

/// Check the checkpoint's config against the inputs, resolve the mask token, bind the weights.
fn check(be: &Backend, ck: &Checkpoint, inp: &ToolInputs, opts: &ToolOptions) -> Result<Checked> {
    let as_u32 = |what: &str, v: usize| {
        u32::try_from(v).map_err(|_| DraftError::InputFile {
            path: inp.path.clone(),
            problem: format!("{what} {v} does not fit 32 bits"),
        })
    };
    let hidden = as_u32("the hidden width", inp.hidden)?;
    let vocab_rows = as_u32("the vocabulary rows", inp.vocab_rows)?;
    // The target's layer count: the draft's statement, else enough for its ids. Parse once
    // leniently for it; the parse that counts (in the caller's mode) follows.
    let lenient = dflash_config::DraftConfig::from_json_str(ck.config_json(), ParseMode::Lenient)
        .map_err(|e| crate::config_file_error(&ck.config_path(), e))?
        .value;
    let target_layers = lenient.num_target_layers.unwrap_or_else(|| {
        lenient
            .target_layer_ids
            .iter()
            .copied()
            .max()
            .map_or(1, |m| m.saturating_add(1))
    });
    let target = TargetTextConfig {
        model_type: None,
        hidden_size: hidden,
        num_hidden_layers: target_layers,
        vocab_size: vocab_rows,
        eos_token_ids: Vec::new(),
        public_vocab_size: Some(inp.public_vocab as u32),
    };
    let (cfg, geometry, report) = ck.draft_config(&target, opts.mode)?;
    let config = report.path.display().to_string();
    let mask = match (cfg.mask_token_id, opts.mask_token_id) {
        (Some(c), None) => c,
        (Some(c), Some(o)) if c != o => {
            return Err(arg_error(
                "--mask-token-id",
                format!("{c} (the draft config {config} states dflash_config.mask_token_id {c})"),
                o.to_string(),
            ));
        }
        (_, Some(o)) if o >= vocab_rows => {
            return Err(arg_error(
                "--mask-token-id",
                format!("a token id below {vocab_rows} (the inputs' embedding rows)"),
                o.to_string(),
            ));
        }
        (_, Some(o)) => o,
        (None, None) => {
            return Err(arg_error(
                "--mask-token-id",
                format!(
                    "a mask token id, because the draft config {config} has \
                     dflash_config.mask_token_id null"
                ),
                "nothing",
            ));
        }
    };
    let fw = geometry.feature_width as usize;
    if inp.features.len() != inp.tokens * fw {
        return Err(DraftError::InputFile {
            path: inp.path.clone(),
            problem: format!(
                "tensor `features`: expected shape [{}, {fw}] (the draft's n_ids * H), found [{}, {}]",
                inp.tokens,
                inp.tokens,
                inp.features.len() / inp.tokens.max(1)
            ),
        });
    }
    let weights = DraftWeights::bind(be, ck, &geometry, &BindOptions::default())?;
    Ok(Checked {
        model: DraftModel::from_parts(be, geometry, weights),
        report,
        k: inp.draft_tokens as usize,
        mask,
    })
}

/// Prefill, run the block and collect the output tensors.
fn compute(be: &Backend, c: &Checked, inp: &ToolInputs) -> Result<BTreeMap<String, OutTensor>> {
    let (model, k) = (&c.model, c.k);
    let g = model.geometry();
    let t = inp.tokens;
    let max_context = t + k + 1;
    let mut store = ContextStore::new(
        be.clone(),
        model.context_geometry()?,
        Capacity::new(1, max_context, 64),
    )?;
    let h = store.admit(max_context)?;
    if t > 0 {
        model.prefill(&mut store, h, be.upload(&inp.features)?)?;
    }
    let embedding = be.upload(&inp.embedding)?;
    let output_head = be.upload(&inp.output_head)?;
    let parts = TargetParts {
        vocab_rows: inp.vocab_rows,
        public_vocab: inp.public_vocab as usize,
        embedding: &embedding,
        head: HeadParts::Full {
            output_head: &output_head,
        },
    };
    let spec = WorkspaceSpec {
        rows: 1,
        draft_count: k,
        mask_token_id: c.mask,
        head: HeadShape {
            kind: OpsHead::Full,
            rows: inp.vocab_rows,
            public_vocab: inp.public_vocab as usize,
        },
    };
    let mut ws = Workspace::new(model, &store, &spec)?;
    let row = RowRequest {
        handle: h,
        anchor: inp.anchor as u32,
        usable: k,
        temperature: inp.temperature,
        seed: inp.seed as u64,
    };
    let res = model.propose(&store, &[row], &parts, &mut ws)?;
    let p = res
        .into_iter()
        .next()
        .ok_or_else(|| DraftError::invalid("proposal rows", "1", 0))?;
    let (hkv, d, hid) = (g.kv_heads as usize, g.head_dim as usize, g.hidden as usize);
    let mut out = BTreeMap::new();
    for l in 0..g.layers.len() {
        let win = store.read_window(h, l)?;
        let live = win.end - win.start;
        out.insert(
            format!("context_k.{l}"),
            out_tensor(Dtype::BF16, vec![live, hkv, d], &win.k),
        );
        out.insert(
            format!("context_v.{l}"),
            out_tensor(Dtype::F16, vec![live, hkv, d], &win.v),
        );
    }
    out.insert(
        "mask_hidden".into(),
        out_tensor(Dtype::F32, vec![k, hid], &ws.read_mask_hidden()?),
    );
    out.insert(
        "proposals".into(),
        out_tensor(Dtype::I32, vec![k], &p.tokens),
    );
    if g.backend == DraftBackend::DFlash2 {
        out.insert(
            "candidate_ids".into(),
            out_tensor(Dtype::I32, vec![k, TOP_K], &p.candidate_ids),
        );
        out.insert(
            "unary_scores".into(),
            out_tensor(Dtype::F32, vec![k, TOP_K], &p.unary_scores),
        );
        out.insert(
            "proposal_q".into(),
            out_tensor(Dtype::F32, vec![k, TOP_K], &p.q),
        );
    }
    Ok(out)
}

/// Run the tool on parsed inputs with the checkpoint `ck` on `be`; returns the output
/// tensors by name and the config report.
pub fn propose(
    be: &Backend,
    ck: &Checkpoint,
    inp: &ToolInputs,
    opts: &ToolOptions,
) -> Result<(BTreeMap<String, OutTensor>, ConfigReport)> {
    let c = check(be, ck, inp, opts)?;
    let out = compute(be, &c, inp)?;
    Ok((out, c.report))
}

/// Serialize output tensors to `path` (through a temporary file renamed over it; a failure is
/// [`DraftError::Write`]: `cannot write PATH: ...`).
pub fn write_output(path: &Path, out: &BTreeMap<String, OutTensor>) -> Result<()> {
    write_safetensors(path, out.iter().map(|(n, t)| (n.clone(), t)).collect())
}

/// Check that `--out` can name an output file before any work: not a directory, in an existing
/// directory, not the inputs file.
fn check_out(args: &ProposeArgs) -> Result<()> {
    let out = &args.out;
    let shown = out.display().to_string();
    if out.is_dir() {
        return Err(arg_error(
            "--out",
            "a file path",
            format!("the directory {shown}"),
        ));
    }
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if !parent.is_dir() {
        return Err(arg_error(
            "--out",
            "a file in an existing directory",
            format!("{shown} (no directory {})", parent.display()),
        ));
    }
    if let (Ok(a), Ok(b)) = (out.canonicalize(), args.inputs.canonicalize())
        && a == b
    {
        return Err(arg_error(
            "--out",
            "a file other than the --inputs file",
            shown,
        ));
    }
    Ok(())
}

/// A tool run with every argument, the checkpoint, its config and the inputs checked and the
/// weights bound: [`Prepared::run`] computes and writes.
#[derive(Debug)]
pub struct Prepared {
    be: Backend,
    checked: Checked,
    inputs: ToolInputs,
    out: PathBuf,
}

impl Prepared {
    /// What the config parser reported (unknown fields, notes).
    pub fn report(&self) -> &ConfigReport {
        &self.checked.report
    }

    /// Prefill, run the block, write the output file.
    pub fn run(self) -> Result<()> {
        let out = compute(&self.be, &self.checked, &self.inputs)?;
        write_output(&self.out, &out)
    }
}

/// Check everything before any work: `--out`, the device, the checkpoint, the inputs file
/// (memory-mapped), the config (in `--strict` or lenient mode) against the inputs, the mask
/// token; bind the weights.
pub fn prepare(args: &ProposeArgs) -> Result<Prepared> {
    check_out(args)?;
    let be = backend(args.device).map_err(|e| match e {
        DraftError::Ops(OpsError::CudaNotCompiled) => {
            arg_error("--device", "cpu (this build has no `cuda` feature)", "cuda")
        }
        other => other,
    })?;
    let ck = Checkpoint::open(&args.model)?;
    let f = std::fs::File::open(&args.inputs).map_err(|e| DraftError::io(&args.inputs, e))?;
    // SAFETY: read-only private map; the inputs file must not change while the tool runs.
    let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| DraftError::io(&args.inputs, e))?;
    let inputs = parse_inputs(&args.inputs.display().to_string(), &map)?;
    let opts = ToolOptions {
        mask_token_id: args.mask_token_id,
        mode: if args.strict {
            ParseMode::Strict
        } else {
            ParseMode::Lenient
        },
    };
    let checked = check(&be, &ck, &inputs, &opts)?;
    Ok(Prepared {
        be,
        checked,
        inputs,
        out: args.out.clone(),
    })
}

/// The whole tool: [`prepare`], then [`Prepared::run`].
pub fn run(args: &ProposeArgs) -> Result<()> {
    prepare(args)?.run()
}

/// The `propose` binary's exit status for an error: 1 when the run failed while computing or
/// writing (a device or storage failure, a write error), 2 when an argument, the checkpoint,
/// its config or the inputs file was refused.
pub fn exit_code(e: &DraftError) -> u8 {
    match e {
        DraftError::Write { .. } | DraftError::Ops(_) | DraftError::Context(_) => 1,
        _ => 2,
    }
}
