//! Weight binding: published layouts and name variants load; every bad tensor is a typed
//! error naming it.

mod common;

use std::path::Path;

use dflash_draft::synthetic::{self, Layout, TinySpec};
use dflash_draft::{BindOptions, Checkpoint, DraftError, DraftModel};
use dflash_ops::Backend;
use safetensors::{Dtype, SafeTensors};

type Entry = (String, Dtype, Vec<usize>, Vec<u8>);

fn read_all(path: &Path) -> Vec<Entry> {
    let bytes = std::fs::read(path).expect("read");
    let st = SafeTensors::deserialize(&bytes).expect("parse");
    st.iter()
        .map(|(n, v)| {
            (
                n.to_owned(),
                v.dtype(),
                v.shape().to_vec(),
                v.data().to_vec(),
            )
        })
        .collect()
}

fn write_all(path: &Path, entries: Vec<Entry>) {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = entries
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).expect("view"),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).expect("write");
}

/// Write a tiny checkpoint into a fresh dir, let `edit` rewrite its tensors, and load it.
fn load_edited(name: &str, edit: impl FnOnce(&mut Vec<Entry>)) -> Result<DraftModel, DraftError> {
    let dir = common::temp_dir(name);
    let spec = TinySpec::dflash2();
    let (cfg, target) = synthetic::tiny_pair(&spec);
    synthetic::write_checkpoint(&dir, &cfg, &target, 5, Layout::Single).expect("write");
    let path = dir.join("model.safetensors");
    let mut entries = read_all(&path);
    edit(&mut entries);
    write_all(&path, entries);
    let r = DraftModel::load(&Backend::cpu(), &dir, &target, &BindOptions::default());
    let _ = std::fs::remove_dir_all(&dir);
    r
}

fn rename(entries: &mut [Entry], from: &str, to: &str) {
    for e in entries.iter_mut() {
        if e.0 == from {
            e.0 = to.to_owned();
        }
    }
}

#[test]
fn single_and_sharded_checkpoints_bind_the_same_weights() {
    let spec = TinySpec::dflash();
    let (cfg, target) = synthetic::tiny_pair(&spec);
    let be = Backend::cpu();
    let mut loaded = Vec::new();
    for layout in [Layout::Single, Layout::Sharded(3)] {
        let dir = common::temp_dir(&format!("layout-{layout:?}"));
        synthetic::write_checkpoint(&dir, &cfg, &target, 9, layout).expect("write");
        if let Layout::Sharded(_) = layout {
            assert!(dir.join("model.safetensors.index.json").exists());
            assert!(!dir.join("model.safetensors").exists());
        }
        let m = DraftModel::load(&be, &dir, &target, &BindOptions::default()).expect("load");
        let ck = Checkpoint::open(&dir).expect("open");
        assert_eq!(ck.tensor_names().len(), 3 + 2 * 11);
        loaded.push(m);
        let _ = std::fs::remove_dir_all(&dir);
    }
    let (a, b) = (&loaded[0].weights(), &loaded[1].weights());
    assert_eq!(
        be.download(&a.fc).expect("d"),
        be.download(&b.fc).expect("d")
    );
    assert_eq!(
        be.download(&a.layers[1].down_proj).expect("d"),
        be.download(&b.layers[1].down_proj).expect("d")
    );
}

#[test]
fn published_name_variants_are_recognized() {
    let m = load_edited("variants", |e| {
        for x in e.iter_mut() {
            x.0 = format!("model.{}", x.0);
        }
        rename(e, "model.fc.weight", "encoder.fc.weight");
        rename(
            e,
            "model.hidden_norm.weight",
            "encoder.output_norm_enc.weight",
        );
        for x in e.iter_mut() {
            if let Some(rest) = x.0.strip_prefix("model.layers.0.") {
                x.0 = format!("midlayer.{rest}");
            }
        }
    })
    .expect("variants load");
    assert_eq!(m.weights().layers.len(), 2);
    assert_eq!(
        dflash_draft::weights::canonical_name("model.norm.weight"),
        "norm.weight"
    );
    assert_eq!(
        dflash_draft::weights::canonical_name("midlayer.mlp.up_proj.weight"),
        "layers.0.mlp.up_proj.weight"
    );
}

#[test]
fn missing_tensor_is_named() {
    let e = load_edited("missing", |e| {
        e.retain(|x| x.0 != "layers.1.self_attn.k_norm.weight")
    });
    match e {
        Err(DraftError::MissingTensor { name, shape, .. }) => {
            assert_eq!(name, "layers.1.self_attn.k_norm.weight");
            assert_eq!(shape, vec![8]);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn unexpected_tensor_is_named() {
    let e = load_edited("unexpected", |e| {
        e.push(("lm_head.weight".into(), Dtype::BF16, vec![2], vec![0; 4]));
    });
    assert!(
        matches!(e, Err(DraftError::UnexpectedTensor { ref stored, .. }) if stored == "lm_head.weight"),
        "{e:?}"
    );
}

#[test]
fn misshaped_tensor_reports_expected_and_found() {
    let e = load_edited("shape", |e| {
        for x in e.iter_mut() {
            if x.0 == "candidate_selector.hidden_projection.weight" {
                x.2 = vec![32, 8]; // transposed [H, R] instead of [R, H]
            }
        }
    });
    match e {
        Err(DraftError::TensorShape {
            name,
            expected,
            found,
        }) => {
            assert_eq!(name, "candidate_selector.hidden_projection.weight");
            assert_eq!((expected, found), (vec![8, 32], vec![32, 8]));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn non_bf16_tensor_is_refused() {
    let e = load_edited("dtype", |e| {
        for x in e.iter_mut() {
            if x.0 == "norm.weight" {
                x.1 = Dtype::F16;
            }
        }
    });
    assert!(
        matches!(e, Err(DraftError::TensorDType { ref name, ref found, .. }) if name == "norm.weight" && found == "F16"),
        "{e:?}"
    );
}

#[test]
fn duplicate_published_name_is_refused() {
    let e = load_edited("dup", |e| {
        let copy = e
            .iter()
            .find(|x| x.0 == "norm.weight")
            .cloned()
            .expect("norm");
        e.push(("model.norm.weight".into(), copy.1, copy.2, copy.3));
    });
    assert!(
        matches!(e, Err(DraftError::DuplicateTensor { ref name, .. }) if name == "norm.weight"),
        "{e:?}"
    );
}

#[test]
fn missing_weights_and_bad_index_are_reported() {
    let dir = common::temp_dir("noweights");
    std::fs::write(dir.join("config.json"), "{}").expect("write");
    assert!(matches!(
        Checkpoint::open(&dir),
        Err(DraftError::NoWeights { .. })
    ));
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        r#"{"weight_map": {"fc.weight": "../x.safetensors"}}"#,
    )
    .expect("write");
    assert!(matches!(
        Checkpoint::open(&dir),
        Err(DraftError::ShardIndex { .. })
    ));
    std::fs::write(dir.join("model.safetensors.index.json"), "not json").expect("write");
    assert!(matches!(
        Checkpoint::open(&dir),
        Err(DraftError::ShardIndex { .. })
    ));
    std::fs::remove_file(dir.join("model.safetensors.index.json")).expect("rm");
    std::fs::write(dir.join("model.safetensors"), b"garbage").expect("write");
    assert!(matches!(
        Checkpoint::open(&dir),
        Err(DraftError::Safetensors { .. })
    ));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn index_listing_a_tensor_in_the_wrong_shard_is_refused() {
    let dir = common::temp_dir("badindex");
    let spec = TinySpec::dflash();
    let (cfg, target) = synthetic::tiny_pair(&spec);
    synthetic::write_checkpoint(&dir, &cfg, &target, 9, Layout::Sharded(2)).expect("write");
    let p = dir.join("model.safetensors.index.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).expect("r")).expect("json");
    let wm = v["weight_map"].as_object_mut().expect("map");
    let first = wm["fc.weight"].as_str().expect("s").to_owned();
    let other = if first.contains("00001") {
        "model-00002-of-00002.safetensors"
    } else {
        "model-00001-of-00002.safetensors"
    };
    wm.insert("fc.weight".into(), other.into());
    std::fs::write(&p, v.to_string()).expect("w");
    assert!(matches!(
        Checkpoint::open(&dir),
        Err(DraftError::ShardIndex { .. })
    ));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn config_that_does_not_fit_the_target_is_refused() {
    let dir = common::temp_dir("pair");
    let spec = TinySpec::dflash();
    let (cfg, target) = synthetic::tiny_pair(&spec);
    synthetic::write_checkpoint(&dir, &cfg, &target, 9, Layout::Single).expect("write");
    let mut other = target.clone();
    other.hidden_size = 48;
    // The error names the config file and carries the config error.
    match DraftModel::load(&Backend::cpu(), &dir, &other, &BindOptions::default()) {
        Err(DraftError::ConfigFile { path, .. }) => {
            assert!(path.ends_with("config.json"), "{path}");
        }
        other => panic!("expected a config-file error, got {other:?}"),
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Distinct values per tensor and element: the tensor's index in the spec list and the element
/// index, so a view at a wrong offset or a concatenation in the wrong order shows.
fn tagged(
    specs: &[dflash_draft::weights::TensorSpec],
    s: &dflash_draft::weights::TensorSpec,
) -> Vec<half::bf16> {
    let t = specs.iter().position(|x| x.name == s.name).expect("listed") as f32;
    let n: usize = s.shape.iter().product();
    (0..n)
        .map(|i| half::bf16::from_f32(t + (i % 97) as f32 / 128.0))
        .collect()
}

#[test]
fn bound_qkv_and_gate_up_hold_the_published_tensors_and_their_views_read_them_back() {
    use dflash_draft::DraftWeights;
    use dflash_draft::weights::{RoleBinding, expected_tensors};
    for spec in [TinySpec::dflash(), TinySpec::dflash2()] {
        let (cfg, target) = synthetic::tiny_pair(&spec);
        let d = dflash_config::DraftConfig::from_json_str(&cfg, dflash_config::ParseMode::Lenient)
            .expect("config");
        let g = dflash_config::validate_pair(&d.value, &target).expect("pair");
        let specs = expected_tensors(&g);
        let be = Backend::cpu();
        let published = |name: String| {
            let s = specs.iter().find(|s| s.name == name).expect("spec");
            tagged(&specs, s)
        };
        let bind = |binding| {
            DraftWeights::from_source(
                &be,
                &g,
                &BindOptions {
                    context_kv: binding,
                },
                |s| Ok(tagged(&specs, s)),
            )
            .expect("bind")
        };
        let (shared, separate) = (bind(RoleBinding::Shared), bind(RoleBinding::Separate));
        for (l, lw) in shared.layers.iter().enumerate() {
            let p = |s: &str| published(format!("layers.{l}.{s}"));
            let dl = |b: &dflash_ops::Buffer<half::bf16>| be.download(b).expect("download");
            let (q, k, v) = (
                p("self_attn.q_proj.weight"),
                p("self_attn.k_proj.weight"),
                p("self_attn.v_proj.weight"),
            );
            assert_eq!(dl(&lw.qkv_proj), [q.clone(), k.clone(), v.clone()].concat());
            assert_eq!(dl(&lw.q_proj().expect("q")), q);
            assert_eq!(dl(&lw.k_proj().expect("k")), k);
            assert_eq!(dl(&lw.v_proj().expect("v")), v);
            assert_eq!(
                dl(&lw.gate_up_proj),
                [p("mlp.gate_proj.weight"), p("mlp.up_proj.weight")].concat()
            );
            // The context role: the block role's rows (Shared) or a copy (Separate), equal.
            let sep = &separate.layers[l];
            assert_eq!(dl(&lw.context_k().expect("ck")), k);
            assert_eq!(dl(&lw.context_v().expect("cv")), v);
            assert_eq!(dl(&sep.context_k().expect("ck")), k);
            assert_eq!(dl(&sep.context_v().expect("cv")), v);
            assert_eq!(
                lw.context_k().expect("ck").address(),
                lw.k_proj().expect("k").address()
            );
            assert_ne!(
                sep.context_k().expect("ck").address(),
                sep.k_proj().expect("k").address()
            );
        }
        let mw = shared.materialize_weights().expect("views");
        assert_eq!(mw.layers.len(), shared.layers.len());
    }
}
