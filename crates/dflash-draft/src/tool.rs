//! The `propose` inspection tool (library side): prefill a draft's context from captured
//! features, run one block, and write everything a peer implementation needs to compare.
//!
//! `propose --model DIR --inputs FILE --out FILE [--device cpu|cuda]`
//!
//! Inputs: a safetensors file with exactly these tensors:
//!
//! | name | dtype | shape | meaning |
//! |---|---|---|---|
//! | `features` | BF16 | `[T, n_ids*H]` | captured target features of positions `0..T` |
//! | `embedding` | BF16 | `[V, H]` | the target's token embedding |
//! | `output_head` | BF16 | `[V, H]` | the target's full output head |
//! | `anchor` | I32 | `[1]` | the token at position `F = T` |
//! | `draft_tokens` | I32 | `[1]` | K, `1..=15` |
//! | `temperature` | F32 | `[1]` | selector temperature (DFlash2; `<= 0` greedy) |
//! | `seed` | I64 | `[1]` | request seed (bit pattern of the u64) |
//! | `public_vocab` | I32 | `[1]` | public vocabulary size, `1..=V` |
//!
//! The draft's `config.json` must state the mask token id. The target config the draft is
//! validated against is formed from the inputs: H and V from `embedding`, the target layer
//! count from the draft's `num_target_layers` (else the largest target id + 1).
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

use dflash_config::{Backend as DraftBackend, DraftConfig, ParseMode, TargetTextConfig};
use dflash_context::{Capacity, ContextStore};
use dflash_ops::proposal_argmax::ProposalHead as OpsHead;
use dflash_ops::{Backend, bf16};
use safetensors::{Dtype, SafeTensors, View};

use crate::model::{DraftModel, RowRequest, TOP_K, Workspace, WorkspaceSpec};
use crate::target::{HeadParts, HeadShape, TargetParts};
use crate::weights::{BindOptions, Checkpoint};
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
}

/// Usage text.
pub const USAGE: &str = "usage: propose --model DIR --inputs FILE --out FILE [--device cpu|cuda]";

/// Parse the arguments after the program name.
pub fn parse_args(args: &[String]) -> Result<ProposeArgs> {
    let (mut model, mut inputs, mut out, mut device) = (None, None, None, Device::Cpu);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = |flag: &str| {
            it.next()
                .cloned()
                .ok_or_else(|| DraftError::invalid(flag, "a value", "nothing"))
        };
        match a.as_str() {
            "--model" => model = Some(PathBuf::from(val("--model")?)),
            "--inputs" => inputs = Some(PathBuf::from(val("--inputs")?)),
            "--out" => out = Some(PathBuf::from(val("--out")?)),
            "--device" => {
                device = match val("--device")?.as_str() {
                    "cpu" => Device::Cpu,
                    "cuda" => Device::Cuda,
                    other => return Err(DraftError::invalid("--device", "cpu or cuda", other)),
                }
            }
            other => return Err(DraftError::invalid("argument", USAGE, other)),
        }
    }
    let need = |v: Option<PathBuf>, flag: &str| {
        v.ok_or_else(|| DraftError::invalid(flag, format!("present ({USAGE})"), "missing"))
    };
    Ok(ProposeArgs {
        model: need(model, "--model")?,
        inputs: need(inputs, "--inputs")?,
        out: need(out, "--out")?,
        device,
    })
}

/// The backend of `device`.
pub fn backend(device: Device) -> Result<Backend> {
    match device {
        Device::Cpu => Ok(Backend::cpu()),
        #[cfg(feature = "cuda")]
        Device::Cuda => Ok(Backend::Cuda(dflash_ops::cuda::CudaBackend::new(0)?)),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda => Err(dflash_ops::OpsError::CudaNotCompiled.into()),
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

/// The inputs of one tool run (see the module doc).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolInputs {
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
    /// Anchor.
    pub anchor: i32,
    /// K.
    pub draft_tokens: i32,
    /// Temperature.
    pub temperature: f32,
    /// Seed (bit pattern).
    pub seed: i64,
    /// Public vocabulary.
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

/// Parse and check an inputs file's bytes (`path` only names it in errors).
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
    let get = |name: &str, dtype: Dtype| -> Result<safetensors::tensor::TensorView<'_>> {
        let t = st
            .tensor(name)
            .map_err(|_| err(format!("tensor `{name}` is missing")))?;
        if t.dtype() != dtype {
            return Err(DraftError::TensorDType {
                name: name.to_owned(),
                expected: format!("{dtype:?}"),
                found: format!("{:?}", t.dtype()),
            });
        }
        Ok(t)
    };
    let shape_err = |name: &str, expected: Vec<usize>, found: &[usize]| DraftError::TensorShape {
        name: name.to_owned(),
        expected,
        found: found.to_vec(),
    };
    let emb = get("embedding", Dtype::BF16)?;
    let (vocab_rows, hidden) = match emb.shape() {
        [v, h] if *v >= 1 && *h >= 1 => (*v, *h),
        s => return Err(shape_err("embedding", vec![0, 0], s)),
    };
    let head = get("output_head", Dtype::BF16)?;
    if head.shape() != [vocab_rows, hidden] {
        return Err(shape_err(
            "output_head",
            vec![vocab_rows, hidden],
            head.shape(),
        ));
    }
    let feats = get("features", Dtype::BF16)?;
    let tokens = match feats.shape() {
        [t, w] if *w >= 1 && w % hidden == 0 => *t,
        s => return Err(shape_err("features", vec![0, hidden], s)),
    };
    let scalar = |name: &str, dtype: Dtype| -> Result<Vec<u8>> {
        let t = get(name, dtype)?;
        if t.shape() != [1] {
            return Err(shape_err(name, vec![1], t.shape()));
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
    Ok(ToolInputs {
        features: bf(feats.data()),
        tokens,
        embedding: bf(emb.data()),
        output_head: bf(head.data()),
        vocab_rows,
        hidden,
        anchor: i32_of(scalar("anchor", Dtype::I32)?),
        draft_tokens: i32_of(scalar("draft_tokens", Dtype::I32)?),
        temperature: f32::from_le_bytes({
            let b = scalar("temperature", Dtype::F32)?;
            [b[0], b[1], b[2], b[3]]
        }),
        seed: i64::from_le_bytes(s8),
        public_vocab: i32_of(scalar("public_vocab", Dtype::I32)?),
    })
}

/// Run the tool on parsed inputs with the checkpoint `ck` on `be`; returns the output
/// tensors by name.
pub fn propose(
    be: &Backend,
    ck: &Checkpoint,
    inp: &ToolInputs,
) -> Result<BTreeMap<String, OutTensor>> {
    let draft = DraftConfig::from_json_str(ck.config_json(), ParseMode::Lenient)?.value;
    let target_layers = draft.num_target_layers.unwrap_or_else(|| {
        draft
            .target_layer_ids
            .iter()
            .copied()
            .max()
            .map_or(1, |m| m + 1)
    });
    let as_u32 = |what: &str, v: usize| {
        u32::try_from(v).map_err(|_| DraftError::invalid(what, "at most u32::MAX", v))
    };
    if inp.public_vocab < 1 || inp.public_vocab as usize > inp.vocab_rows {
        return Err(DraftError::invalid(
            "public_vocab",
            format!("1..={}", inp.vocab_rows),
            inp.public_vocab,
        ));
    }
    let target = TargetTextConfig {
        model_type: None,
        hidden_size: as_u32("hidden", inp.hidden)?,
        num_hidden_layers: target_layers,
        vocab_size: as_u32("vocab rows", inp.vocab_rows)?,
        eos_token_ids: Vec::new(),
        public_vocab_size: Some(inp.public_vocab as u32),
    };
    let k = usize::try_from(inp.draft_tokens)
        .ok()
        .filter(|k| (1..=dflash_config::MAX_DRAFT_COUNT as usize).contains(k))
        .ok_or_else(|| DraftError::invalid("draft_tokens", "1..=15", inp.draft_tokens))?;
    if inp.anchor < 0 || inp.anchor as usize >= inp.vocab_rows {
        return Err(DraftError::invalid(
            "anchor",
            format!("0..{}", inp.vocab_rows),
            inp.anchor,
        ));
    }
    let model = DraftModel::from_checkpoint(be, ck, &target, &BindOptions::default())?;
    let g = model.geometry().clone();
    let mask = g.mask_token_id.ok_or_else(|| {
        DraftError::invalid(
            "dflash_config.mask_token_id",
            "a mask token id in the draft config (the inputs file carries none)",
            "null",
        )
    })?;
    let fw = g.feature_width as usize;
    if inp.features.len() != inp.tokens * fw {
        return Err(DraftError::TensorShape {
            name: "features".into(),
            expected: vec![inp.tokens, fw],
            found: vec![inp.tokens, inp.features.len() / inp.tokens.max(1)],
        });
    }
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
        mask_token_id: mask,
        head: HeadShape {
            kind: OpsHead::Full,
            rows: inp.vocab_rows,
            public_vocab: inp.public_vocab as usize,
        },
    };
    let mut ws = Workspace::new(&model, &store, &spec)?;
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

/// Serialize output tensors to `path`.
pub fn write_output(path: &Path, out: &BTreeMap<String, OutTensor>) -> Result<()> {
    safetensors::serialize_to_file(out.iter(), None, path).map_err(|e| DraftError::Safetensors {
        path: path.display().to_string(),
        message: e.to_string(),
    })
}

/// The whole tool: read the inputs (memory-mapped), run, write the output.
pub fn run(args: &ProposeArgs) -> Result<()> {
    let be = backend(args.device)?;
    let ck = Checkpoint::open(&args.model)?;
    let f = std::fs::File::open(&args.inputs).map_err(|e| DraftError::io(&args.inputs, e))?;
    // SAFETY: read-only private map; the inputs file must not change while the tool runs.
    let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| DraftError::io(&args.inputs, e))?;
    let inp = parse_inputs(&args.inputs.display().to_string(), &map)?;
    let out = propose(&be, &ck, &inp)?;
    write_output(&args.out, &out)
}
