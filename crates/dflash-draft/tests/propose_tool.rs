//! The `propose` inspection tool end to end: write an inputs file for a tiny synthetic
//! checkpoint, run the tool's library entry, check every output tensor.

mod common;

use std::collections::HashMap;
use std::path::Path;

use dflash_draft::DraftError;
use dflash_draft::synthetic::{self, Layout, TinySpec};
use dflash_draft::tool::{self, Device, ProposeArgs};
use half::bf16;
use safetensors::{Dtype, SafeTensors};

fn bytes<T: bytemuck::Pod>(v: &[T]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

struct Inputs {
    tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)>,
}

impl Inputs {
    fn new(spec: &TinySpec, t: usize, k: i32, temperature: f32) -> Self {
        let h = spec.hidden as usize;
        let v = spec.vocab_rows as usize;
        let parts = synthetic::target_parts(v, h, 77);
        let feats = synthetic::features(t, 2 * h, 5);
        Inputs {
            tensors: vec![
                (
                    "features".into(),
                    Dtype::BF16,
                    vec![t, 2 * h],
                    bytes(&feats),
                ),
                (
                    "embedding".into(),
                    Dtype::BF16,
                    vec![v, h],
                    bytes(&parts.embedding),
                ),
                (
                    "output_head".into(),
                    Dtype::BF16,
                    vec![v, h],
                    bytes(&parts.output_head),
                ),
                ("anchor".into(), Dtype::I32, vec![1], bytes(&[7i32])),
                ("draft_tokens".into(), Dtype::I32, vec![1], bytes(&[k])),
                (
                    "temperature".into(),
                    Dtype::F32,
                    vec![1],
                    bytes(&[temperature]),
                ),
                ("seed".into(), Dtype::I64, vec![1], bytes(&[-5i64])),
                (
                    "public_vocab".into(),
                    Dtype::I32,
                    vec![1],
                    bytes(&[spec.public_vocab as i32]),
                ),
            ],
        }
    }

    fn write(&self, path: &Path) {
        let views: Vec<_> = self
            .tensors
            .iter()
            .map(|(n, d, s, b)| {
                (
                    n.clone(),
                    safetensors::tensor::TensorView::new(*d, s.clone(), b).expect("view"),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, path).expect("write inputs");
    }
}

fn run_tool(
    name: &str,
    spec: TinySpec,
    t: usize,
    k: i32,
    temp: f32,
) -> HashMap<String, (Dtype, Vec<usize>, Vec<u8>)> {
    let dir = common::temp_dir(name);
    let model = dir.join("model");
    let (cfg, target) = synthetic::tiny_pair(&spec);
    synthetic::write_checkpoint(&model, &cfg, &target, 3, Layout::Single).expect("ckpt");
    let inputs = dir.join("inputs.safetensors");
    Inputs::new(&spec, t, k, temp).write(&inputs);
    let out = dir.join("out.safetensors");
    let args = args(&model, &inputs, &out, &[]);
    assert_eq!(args.device, Device::Cpu);
    tool::run(&args).expect("tool run");
    let b = std::fs::read(&out).expect("read out");
    let st = SafeTensors::deserialize(&b).expect("out is safetensors");
    let m = st
        .iter()
        .map(|(n, v)| {
            (
                n.to_owned(),
                (v.dtype(), v.shape().to_vec(), v.data().to_vec()),
            )
        })
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    m
}

#[test]
fn dflash_tool_writes_exactly_the_documented_tensors() {
    let spec = TinySpec::dflash();
    let (t, k) = (9usize, 4usize);
    let m = run_tool("tool1", spec.clone(), t, k as i32, 0.0);
    let mut names: Vec<&str> = m.keys().map(String::as_str).collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            "context_k.0",
            "context_k.1",
            "context_v.0",
            "context_v.1",
            "mask_hidden",
            "proposals"
        ]
    );
    // Layer 0 slides (S = 6): the live window is the last 6 positions; layer 1 is full.
    assert_eq!(m["context_k.0"].0, Dtype::BF16);
    assert_eq!(m["context_k.0"].1, vec![6, 2, 8]);
    assert_eq!(m["context_v.0"].0, Dtype::F16);
    assert_eq!(m["context_v.1"].1, vec![t, 2, 8]);
    assert_eq!(m["mask_hidden"].0, Dtype::F32);
    assert_eq!(m["mask_hidden"].1, vec![k, 32]);
    assert_eq!(m["proposals"].0, Dtype::I32);
    assert_eq!(m["proposals"].1, vec![k]);
    let props: Vec<i32> = bytemuck::pod_collect_to_vec(&m["proposals"].2);
    assert!(props.iter().all(|&p| (0..72).contains(&p)), "{props:?}");
    let mh: Vec<f32> = bytemuck::pod_collect_to_vec(&m["mask_hidden"].2);
    assert!(mh.iter().all(|v| v.is_finite()) && mh.iter().any(|v| v.abs() > 0.1));
    // Every mask hidden value is a BF16 value widened.
    assert!(mh.iter().all(|v| f32::from(bf16::from_f32(*v)) == *v));
    // The full layer's window ends with the sliding layer's window? No: different weights;
    // but the last 6 positions of the full layer are stored for the same positions.
    let k1: Vec<u16> = bytemuck::pod_collect_to_vec(&m["context_k.1"].2);
    assert!(k1.iter().any(|&b| b != 0));
}

#[test]
fn dflash2_tool_adds_selector_outputs() {
    let spec = TinySpec::dflash2();
    let k = 3usize;
    let m = run_tool("tool2", spec, 4, k as i32, 0.9);
    for (name, dt) in [
        ("candidate_ids", Dtype::I32),
        ("unary_scores", Dtype::F32),
        ("proposal_q", Dtype::F32),
    ] {
        assert_eq!(m[name].0, dt, "{name}");
        assert_eq!(m[name].1, vec![k, 16], "{name}");
    }
    // T = 4 < S = 6: both local layers hold all 4 positions.
    assert_eq!(m["context_k.1"].1, vec![4, 2, 8]);
    let q: Vec<f32> = bytemuck::pod_collect_to_vec(&m["proposal_q"].2);
    for row in q.chunks(16) {
        let s: f32 = row.iter().sum();
        assert!((s - 1.0).abs() < 1e-5, "q sums to {s}");
    }
    let c: Vec<i32> = bytemuck::pod_collect_to_vec(&m["candidate_ids"].2);
    let p: Vec<i32> = bytemuck::pod_collect_to_vec(&m["proposals"].2);
    for i in 0..k {
        assert!(
            c[i * 16..(i + 1) * 16].contains(&p[i]),
            "proposal {i} is one of its candidates"
        );
    }
}

#[test]
fn bad_inputs_files_get_clear_errors() {
    let spec = TinySpec::dflash();
    let dir = common::temp_dir("toolbad");
    let model = dir.join("model");
    let (cfg, target) = synthetic::tiny_pair(&spec);
    synthetic::write_checkpoint(&model, &cfg, &target, 3, Layout::Single).expect("ckpt");
    let ck = dflash_draft::Checkpoint::open(&model).expect("open");
    let attempt = |edit: &dyn Fn(&mut Inputs)| -> DraftError {
        let mut i = Inputs::new(&spec, 5, 3, 0.0);
        edit(&mut i);
        let p = dir.join("bad.safetensors");
        i.write(&p);
        let b = std::fs::read(&p).expect("read");
        match tool::parse_inputs("bad", &b).and_then(|inp| {
            tool::propose(
                &dflash_ops::Backend::cpu(),
                &ck,
                &inp,
                &tool::ToolOptions::default(),
            )
        }) {
            Err(e) => e,
            Ok(_) => panic!("accepted a bad file"),
        }
    };
    let e = attempt(&|i| i.tensors.retain(|t| t.0 != "seed"));
    assert!(e.to_string().contains("`seed` is missing"), "{e}");
    let e = attempt(&|i| {
        i.tensors
            .push(("extra".into(), Dtype::I32, vec![1], bytes(&[1i32])))
    });
    assert!(e.to_string().contains("unexpected tensor `extra`"), "{e}");
    // Every refusal names the file and the tensor.
    let named = |e: &DraftError, what: &str| {
        assert!(
            matches!(e, DraftError::InputFile { path, .. } if path == "bad"),
            "{e:?}"
        );
        assert!(
            e.to_string()
                .starts_with(&format!("inputs file bad: tensor `{what}`")),
            "{e}"
        );
    };
    let e = attempt(&|i| {
        i.tensors[3] = ("anchor".into(), Dtype::I64, vec![1], bytes(&[7i64]));
    });
    named(&e, "anchor");
    assert!(
        e.to_string().contains("expected dtype I32, found I64"),
        "{e}"
    );
    let e = attempt(&|i| {
        i.tensors[4] = (
            "draft_tokens".into(),
            Dtype::I32,
            vec![2],
            bytes(&[3i32, 3]),
        );
    });
    named(&e, "draft_tokens");
    assert!(
        e.to_string().contains("expected shape [1], found [2]"),
        "{e}"
    );
    let e = attempt(&|i| {
        i.tensors[4] = ("draft_tokens".into(), Dtype::I32, vec![1], bytes(&[16i32]));
    });
    named(&e, "draft_tokens");
    assert!(e.to_string().contains("expected 1..=15, found 16"), "{e}");
    let e = attempt(&|i| {
        let f = synthetic::features(5, 48, 1);
        i.tensors[0] = ("features".into(), Dtype::BF16, vec![5, 48], bytes(&f));
    });
    named(&e, "features");
    assert!(
        e.to_string().contains("expected shape [T, n_ids * 32]"),
        "{e}"
    );
    // A multiple of H, but three captured blocks where the draft has two.
    let e = attempt(&|i| {
        let f = synthetic::features(5, 96, 1);
        i.tensors[0] = ("features".into(), Dtype::BF16, vec![5, 96], bytes(&f));
    });
    named(&e, "features");
    assert!(e.to_string().contains("expected shape [5, 64]"), "{e}");
    let e = attempt(&|i| {
        i.tensors[7] = ("public_vocab".into(), Dtype::I32, vec![1], bytes(&[81i32]));
    });
    named(&e, "public_vocab");
    let e = attempt(&|i| {
        i.tensors[3] = ("anchor".into(), Dtype::I32, vec![1], bytes(&[80i32]));
    });
    named(&e, "anchor");
    for (t, shown) in [(f32::NAN, "NaN"), (-1.0, "-1"), (f32::INFINITY, "inf")] {
        let e = attempt(&|i| {
            i.tensors[5] = ("temperature".into(), Dtype::F32, vec![1], bytes(&[t]));
        });
        named(&e, "temperature");
        assert!(
            e.to_string().ends_with(&format!(
                "expected a finite temperature >= 0 (0: greedy), found {shown}"
            )),
            "{e}"
        );
    }
    assert!(tool::parse_inputs("x", b"nope").is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn arguments_are_checked() {
    assert!(tool::parse_args(&["--model".into()]).is_err());
    assert!(tool::parse_args(&["--bogus".into()]).is_err());
    let a: Vec<String> = [
        "--model", "m", "--inputs", "i", "--out", "o", "--device", "cuda",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let p: ProposeArgs = tool::parse_args(&a).expect("parse");
    assert_eq!(p.device, Device::Cuda);
    #[cfg(not(feature = "cuda"))]
    assert!(matches!(
        tool::backend(Device::Cuda),
        Err(DraftError::Ops(dflash_ops::OpsError::CudaNotCompiled))
    ));
    let mut b = a.clone();
    b[7] = "tpu".into();
    assert!(tool::parse_args(&b).is_err());
}

/// A tiny DFlash checkpoint whose config.json is the tiny spec's with `edit` applied, an inputs
/// file for it, in a fresh temp dir. Returns (dir, model dir, inputs file).
fn edited_checkpoint(
    name: &str,
    edit: &dyn Fn(&mut serde_json::Value),
) -> (std::path::PathBuf, std::path::PathBuf, std::path::PathBuf) {
    let spec = TinySpec::dflash();
    let dir = common::temp_dir(name);
    let model = dir.join("model");
    let (cfg, target) = synthetic::tiny_pair(&spec);
    synthetic::write_checkpoint(&model, &cfg, &target, 3, Layout::Single).expect("ckpt");
    let mut v: serde_json::Value = serde_json::from_str(&cfg).expect("json");
    edit(&mut v);
    std::fs::write(model.join("config.json"), v.to_string()).expect("config");
    let inputs = dir.join("inputs.safetensors");
    Inputs::new(&spec, 6, 3, 0.0).write(&inputs);
    (dir, model, inputs)
}

fn args(model: &Path, inputs: &Path, out: &Path, extra: &[&str]) -> ProposeArgs {
    let mut a: Vec<String> = vec![
        "--model".into(),
        model.display().to_string(),
        "--inputs".into(),
        inputs.display().to_string(),
        "--out".into(),
        out.display().to_string(),
    ];
    a.extend(extra.iter().map(|s| s.to_string()));
    tool::parse_args(&a).expect("args")
}

#[test]
fn null_mask_token_needs_the_flag_and_the_flag_gives_the_config_result() {
    let (dir, model, inputs) = edited_checkpoint("toolmask", &|v| {
        v["dflash_config"]["mask_token_id"] = serde_json::Value::Null;
    });
    let out = dir.join("out.safetensors");
    let e = tool::prepare(&args(&model, &inputs, &out, &[])).expect_err("no mask");
    assert!(
        matches!(&e, DraftError::Argument { flag, found, .. } if flag == "--mask-token-id" && found == "nothing"),
        "{e:?}"
    );
    assert!(e.to_string().contains("mask_token_id null"), "{e}");
    tool::run(&args(&model, &inputs, &out, &["--mask-token-id", "75"])).expect("runs");
    let with_flag = std::fs::read(&out).expect("out");

    // The same draft with the mask stated in its config gives the same bytes.
    let (dir2, model2, inputs2) = edited_checkpoint("toolmask2", &|_| {});
    let out2 = dir2.join("out.safetensors");
    tool::run(&args(&model2, &inputs2, &out2, &[])).expect("runs");
    assert_eq!(with_flag, std::fs::read(&out2).expect("out"));
    // A flag that contradicts the config is refused.
    let e = tool::prepare(&args(&model2, &inputs2, &out2, &["--mask-token-id", "74"]))
        .expect_err("conflict");
    assert!(
        e.to_string().starts_with("`--mask-token-id`: expected 75"),
        "{e}"
    );
    let e =
        tool::prepare(&args(&model, &inputs, &out, &["--mask-token-id", "80"])).expect_err("range");
    assert!(e.to_string().contains("below 80"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&dir2);
}

#[test]
fn unknown_config_fields_are_reported_and_refused_in_strict_mode() {
    let (dir, model, inputs) = edited_checkpoint("toolunknown", &|v| {
        v["new_knob"] = serde_json::json!(3);
        v["dflash_config"]["other_knob"] = serde_json::json!(true);
    });
    let out = dir.join("out.safetensors");
    let p = tool::prepare(&args(&model, &inputs, &out, &[])).expect("lenient");
    let w = p.report().warnings();
    assert_eq!(w.len(), 2, "{w:?}");
    assert!(
        w[0].contains("config.json: `new_knob` = 3: unknown field"),
        "{w:?}"
    );
    assert!(w[1].contains("`dflash_config.other_knob` = true"), "{w:?}");
    let e = tool::prepare(&args(&model, &inputs, &out, &["--strict"])).expect_err("strict");
    assert!(
        matches!(&e, DraftError::ConfigFile { source, .. }
            if matches!(**source, dflash_config::ConfigError::UnknownFields { .. })),
        "{e:?}"
    );
    assert!(
        e.to_string()
            .contains("config.json: `new_knob`: unknown field"),
        "{e}"
    );
    assert!(!out.exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn math_changing_config_fields_are_refused_naming_the_file() {
    for (field, value) in [
        ("attn_logit_softcapping", serde_json::json!(30)),
        ("partial_rotary_factor", serde_json::json!(0.5)),
        ("dflash_config.causal_mask", serde_json::json!(true)),
    ] {
        let (dir, model, inputs) =
            edited_checkpoint("toolmath", &|v| match field.split_once('.') {
                Some((a, b)) => v[a][b] = value.clone(),
                None => v[field] = value.clone(),
            });
        let out = dir.join("out.safetensors");
        let e = tool::prepare(&args(&model, &inputs, &out, &[])).expect_err(field);
        let cfg = model.join("config.json").display().to_string();
        assert!(
            e.to_string().starts_with(&format!("{cfg}: `{field}`: ")),
            "{e}"
        );
        assert!(
            e.to_string().contains("changes the draft mathematics"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn synthetic_inputs_round_trip_through_the_file_and_run() {
    let spec = TinySpec::dflash2();
    let dir = common::temp_dir("toolsynth");
    let model = dir.join("model");
    let (cfg, target) = synthetic::tiny_pair(&spec);
    let g = synthetic::write_checkpoint(&model, &cfg, &target, 3, Layout::Single).expect("ckpt");
    let inp = tool::synthetic_inputs(&g, spec.public_vocab, 9, 5, 11);
    let path = dir.join("inputs.safetensors");
    tool::write_inputs(&path, &inp).expect("write");
    let back = tool::parse_inputs("synthetic inputs", &std::fs::read(&path).expect("read"))
        .expect("parses");
    assert_eq!(back, inp);
    let out = dir.join("out.safetensors");
    tool::run(&args(&model, &path, &out, &[])).expect("runs");
    let b = std::fs::read(&out).expect("out");
    let st = SafeTensors::deserialize(&b).expect("safetensors");
    assert_eq!(st.tensor("proposals").expect("proposals").shape(), [5]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn failed_output_write_says_cannot_write_and_leaves_no_file() {
    let dir = common::temp_dir("toolwrite");
    let missing = dir.join("no-such-dir").join("out.safetensors");
    let e = tool::write_output(&missing, &Default::default()).expect_err("no directory");
    assert!(
        e.to_string()
            .starts_with(&format!("cannot write {}: ", missing.display())),
        "{e}"
    );
    assert!(matches!(e, DraftError::Write { .. }));
    // Over an existing directory: the rename fails; the temporary file is removed.
    let target_dir = dir.join("a-directory");
    std::fs::create_dir_all(&target_dir).expect("dir");
    let e = tool::write_output(&target_dir, &Default::default()).expect_err("a directory");
    assert!(e.to_string().starts_with("cannot write "), "{e}");
    let left: Vec<_> = std::fs::read_dir(&dir).expect("ls").collect();
    assert_eq!(left.len(), 1, "only the directory remains: {left:?}");
    // The fixture writers say the same: a checkpoint or an inputs file under a plain file.
    let file = dir.join("a-file");
    std::fs::write(&file, b"x").expect("file");
    let (cfg, target) = synthetic::tiny_pair(&TinySpec::dflash());
    let under = file.join("ckpt");
    let e = synthetic::write_checkpoint(&under, &cfg, &target, 1, Layout::Single)
        .expect_err("not a directory");
    assert!(
        e.to_string()
            .starts_with(&format!("cannot write {}: ", under.display())),
        "{e}"
    );
    let g = synthetic::write_checkpoint(&dir.join("ok"), &cfg, &target, 1, Layout::Single)
        .expect("checkpoint");
    let inp = tool::synthetic_inputs(&g, 72, 2, 2, 1);
    let e = tool::write_inputs(&file.join("in.safetensors"), &inp).expect_err("not a directory");
    assert!(e.to_string().starts_with("cannot write "), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}
