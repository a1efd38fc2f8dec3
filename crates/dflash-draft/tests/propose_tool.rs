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
    let args = tool::parse_args(&[
        "--model".into(),
        model.display().to_string(),
        "--inputs".into(),
        inputs.display().to_string(),
        "--out".into(),
        out.display().to_string(),
    ])
    .expect("args");
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
        match tool::parse_inputs("bad", &b)
            .and_then(|inp| tool::propose(&dflash_ops::Backend::cpu(), &ck, &inp))
        {
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
    let e = attempt(&|i| {
        i.tensors[3] = ("anchor".into(), Dtype::I64, vec![1], bytes(&[7i64]));
    });
    assert!(
        matches!(e, DraftError::TensorDType { ref name, .. } if name == "anchor"),
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
    assert!(
        matches!(e, DraftError::TensorShape { ref name, .. } if name == "draft_tokens"),
        "{e}"
    );
    let e = attempt(&|i| {
        i.tensors[4] = ("draft_tokens".into(), Dtype::I32, vec![1], bytes(&[16i32]));
    });
    assert!(e.to_string().contains("draft_tokens"), "{e}");
    let e = attempt(&|i| {
        let f = synthetic::features(5, 48, 1);
        i.tensors[0] = ("features".into(), Dtype::BF16, vec![5, 48], bytes(&f));
    });
    assert!(
        matches!(e, DraftError::TensorShape { ref name, .. } if name == "features"),
        "{e}"
    );
    let e = attempt(&|i| {
        i.tensors[7] = ("public_vocab".into(), Dtype::I32, vec![1], bytes(&[81i32]));
    });
    assert!(e.to_string().contains("public_vocab"), "{e}");
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
