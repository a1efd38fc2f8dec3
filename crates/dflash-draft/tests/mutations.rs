//! Mutations of a whole draft checkpoint, `config.json` and `model.safetensors` bytes: loading
//! never panics, and never silently accepts a math-changing config field or drops an unknown
//! one.
//!
//! 2400 cases (1200 per backend) from a fixed SplitMix64 seed (`SEED`), so a failure
//! reproduces exactly and names its case. Each case writes the mutated files and runs the
//! reporting loader (`DraftModel::load_reported`, lenient or strict); a checkpoint that loads
//! also runs a prefill and a block, so the accepted values are exercised too. The oracle for
//! "math-changing" is this file's own list (independent of the crate's table): whenever the
//! mutated config holds one of those fields with a value that is not neutral, the load must
//! fail.

mod common;

use std::path::Path;

use dflash_config::{Backend as DraftBackend, FieldClass, ParseMode, draft_field_class};
use dflash_context::{Capacity, ContextStore};
use dflash_draft::synthetic::{self, Layout, Stream, TinySpec};
use dflash_draft::{
    BindOptions, DraftModel, HeadParts, HeadShape, RowRequest, TargetParts, Workspace,
    WorkspaceSpec,
};
use dflash_ops::Backend;
use dflash_ops::proposal_argmax::ProposalHead;
use serde_json::{Map, Value, json};

/// The case stream's seed.
const SEED: u64 = 0x0d1f_1a5b_0012;
/// Cases per backend.
const CASES: usize = 1200;

/// Where a math-changing field may sit.
#[derive(Clone, Copy, PartialEq)]
enum At {
    Top,
    Both,
    Rope,
}

/// Neutral values, as a predicate on the (non-null) value.
type NeutralFn = fn(&Value) -> bool;
/// Values to insert (active and neutral ones).
type Values = &'static [fn() -> Value];

fn is_false(v: &Value) -> bool {
    v == &Value::Bool(false)
}
fn never(_: &Value) -> bool {
    false
}
fn is_one(v: &Value) -> bool {
    v.as_f64() == Some(1.0)
}
fn is_silu(v: &Value) -> bool {
    v == "silu"
}
fn is_default(v: &Value) -> bool {
    v == "default"
}
fn is_default_scaling(v: &Value) -> bool {
    v.as_object()
        .and_then(|o| o.get("rope_type").or_else(|| o.get("type")))
        .is_some_and(|t| t == "default")
}

/// Fields that change the draft mathematics (public DFlash / DFlash2 code and Hugging Face
/// layers apply them), with their neutral values.
const MATH: &[(At, &str, NeutralFn, Values)] = &[
    (
        At::Top,
        "hidden_act",
        is_silu,
        &[|| json!("gelu"), || json!("silu")],
    ),
    (At::Top, "hidden_activation", is_silu, &[|| json!("relu")]),
    (
        At::Top,
        "attention_bias",
        is_false,
        &[|| json!(true), || json!(false)],
    ),
    (At::Top, "mlp_bias", is_false, &[|| json!(true)]),
    (
        At::Top,
        "rope_scaling",
        is_default_scaling,
        &[
            || json!({"rope_type": "yarn", "factor": 4}),
            || json!({"type": "default"}),
        ],
    ),
    (
        At::Top,
        "partial_rotary_factor",
        is_one,
        &[|| json!(0.5), || json!(1)],
    ),
    (
        At::Rope,
        "rope_type",
        is_default,
        &[|| json!("linear"), || json!("default")],
    ),
    (At::Rope, "partial_rotary_factor", is_one, &[|| json!(0.25)]),
    (
        At::Both,
        "is_causal",
        is_false,
        &[|| json!(true), || json!(false)],
    ),
    (At::Both, "causal", is_false, &[|| json!(true)]),
    (
        At::Both,
        "causal_mask",
        is_false,
        &[|| json!(true), || json!(false)],
    ),
    (At::Both, "attn_logit_softcapping", never, &[|| json!(30)]),
    (
        At::Both,
        "final_logit_softcapping",
        never,
        &[|| json!(20.0)],
    ),
    (At::Both, "logit_softcapping", never, &[|| json!(50)]),
    (
        At::Both,
        "output_multiplier",
        is_one,
        &[|| json!(0.196), || json!(1.0)],
    ),
    (At::Both, "logits_scaling", is_one, &[|| json!(8)]),
    (At::Both, "logit_scale", is_one, &[|| json!(0.0625)]),
    (
        At::Both,
        "input_embedding_scale",
        is_one,
        &[|| json!(2.0), || json!(1)],
    ),
    (At::Both, "embedding_multiplier", is_one, &[|| json!(12)]),
    (At::Both, "residual_multiplier", is_one, &[|| json!(0.22)]),
    (
        At::Both,
        "attention_multiplier",
        never,
        &[|| json!(0.0078125)],
    ),
    (At::Both, "sample_from_anchor", is_false, &[|| json!(true)]),
    (
        At::Both,
        "attention_sink_bias",
        is_false,
        &[|| json!(true), || json!(0.0)],
    ),
    (At::Both, "attention_sinks", is_false, &[|| json!(4)]),
    (
        At::Both,
        "use_aux_hidden_state",
        is_false,
        &[|| json!(true)],
    ),
];

/// The first active (present, not null, not neutral) math-changing field of `doc`, as a path.
fn active_math(doc: &Value) -> Option<String> {
    let top = doc.as_object()?;
    let nested = top.get("dflash_config").and_then(Value::as_object);
    let rope = top.get("rope_parameters").and_then(Value::as_object);
    for &(at, key, neutral, _) in MATH {
        let places: Vec<(Option<&Map<String, Value>>, String)> = match at {
            At::Top => vec![(Some(top), key.to_owned())],
            At::Both => vec![
                (Some(top), key.to_owned()),
                (nested, format!("dflash_config.{key}")),
            ],
            At::Rope => vec![(rope, format!("rope_parameters.{key}"))],
        };
        for (obj, path) in places {
            if let Some(v) = obj.and_then(|o| o.get(key))
                && !v.is_null()
                && !neutral(v)
            {
                return Some(path);
            }
        }
    }
    None
}

/// Direct fields of the document, `dflash_config` and `rope_parameters`, as paths.
fn field_paths(doc: &Value) -> Vec<String> {
    let mut out = Vec::new();
    let Some(top) = doc.as_object() else {
        return out;
    };
    for (k, v) in top {
        out.push(k.clone());
        if k == "dflash_config" || k == "rope_parameters" {
            for kk in v.as_object().into_iter().flat_map(Map::keys) {
                out.push(format!("{k}.{kk}"));
            }
        }
    }
    out
}

struct Rng(Stream);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        (self.0.next_u64() % n.max(1) as u64) as usize
    }
    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
}

fn random_value(r: &mut Rng) -> Value {
    match r.below(9) {
        0 => Value::Null,
        1 => json!(r.chance(50)),
        2 => json!(r.below(70_000) as i64 - 1000),
        3 => json!([0.0, 0.5, 1.0, 1e-6, -3.0, 1e300][r.below(6)]),
        4 => json!(u64::MAX - r.below(3) as u64),
        5 => json!(["silu", "default", "yarn", "sliding_attention", "", "qwen3"][r.below(6)]),
        6 => json!([1, 3]),
        7 => json!({"rope_type": "default"}),
        _ => json!({}),
    }
}

fn all_pointers(v: &Value, here: String, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, c) in m {
                all_pointers(
                    c,
                    format!("{here}/{}", k.replace('~', "~0").replace('/', "~1")),
                    out,
                );
            }
        }
        Value::Array(a) => {
            for (i, c) in a.iter().enumerate() {
                all_pointers(c, format!("{here}/{i}"), out);
            }
        }
        _ => {}
    }
    out.push(here);
}

/// Insert one math-changing field (active or neutral) where it may sit.
fn insert_math(doc: &mut Value, r: &mut Rng) {
    let (at, key, _, values) = MATH[r.below(MATH.len())];
    let v = values[r.below(values.len())]();
    let obj = match (at, r.chance(50)) {
        (At::Top, _) | (At::Both, false) => doc.as_object_mut(),
        (At::Both, true) => doc.get_mut("dflash_config").and_then(Value::as_object_mut),
        (At::Rope, _) => {
            if let Some(o) = doc.as_object_mut() {
                o.entry("rope_parameters").or_insert_with(|| json!({}));
            }
            doc.get_mut("rope_parameters")
                .and_then(Value::as_object_mut)
        }
    };
    if let Some(o) = obj {
        o.insert(key.to_owned(), v);
    }
}

/// Edit the config document: insert a math-changing field, insert an unknown field, replace
/// or delete a node.
fn edit_config(doc: &mut Value, r: &mut Rng) {
    for _ in 0..1 + r.below(3) {
        match r.below(4) {
            0 => insert_math(doc, r),
            1 => {
                let name = format!("knob_{}", r.below(1000));
                let v = random_value(r);
                let target = if r.chance(50) {
                    doc.get_mut("dflash_config")
                } else {
                    Some(&mut *doc)
                };
                if let Some(Value::Object(o)) = target {
                    o.insert(name, v);
                }
            }
            2 => {
                let mut ptrs = Vec::new();
                all_pointers(doc, String::new(), &mut ptrs);
                let p = ptrs[r.below(ptrs.len())].clone();
                let v = random_value(r);
                if let Some(slot) = doc.pointer_mut(&p) {
                    *slot = v;
                }
            }
            _ => {
                let mut ptrs = Vec::new();
                all_pointers(doc, String::new(), &mut ptrs);
                let p = ptrs[r.below(ptrs.len())].clone();
                if let Some((parent, last)) = p.rsplit_once('/') {
                    let last = last.replace("~1", "/").replace("~0", "~");
                    match doc.pointer_mut(parent) {
                        Some(Value::Object(m)) => {
                            m.shift_remove(&last);
                        }
                        Some(Value::Array(a)) => {
                            if let Ok(i) = last.parse::<usize>()
                                && i < a.len()
                            {
                                a.remove(i);
                            }
                        }
                        _ => {}
                    }
                }
            }
        }
    }
}

/// Flip, insert, delete or truncate bytes of `b` (the whole file or its first `limit` bytes).
fn edit_bytes(b: &mut Vec<u8>, limit: usize, r: &mut Rng) {
    let span = limit.min(b.len()).max(1);
    match r.below(4) {
        0 => {
            for _ in 0..1 + r.below(4) {
                let i = r.below(span);
                if let Some(x) = b.get_mut(i) {
                    *x ^= 1 << r.below(8);
                }
            }
        }
        1 => {
            let i = r.below(span + 1).min(b.len());
            b.insert(i, [b'{', b'"', b',', b'0', b']', 0xff][r.below(6)]);
        }
        2 => {
            let i = r.below(span);
            if i < b.len() {
                b.remove(i);
            }
        }
        _ => b.truncate(r.below(b.len() + 1)),
    }
}

/// Edit the safetensors header (dtype, shape, offsets, names, entries, its length field) and
/// re-encode it, or mutate raw bytes.
fn edit_weights(b: &mut Vec<u8>, r: &mut Rng) {
    let n = u64::from_le_bytes(b[..8].try_into().expect("8 bytes")) as usize;
    let header_end = 8 + n;
    if r.chance(35) {
        let limit = if r.chance(60) { header_end } else { b.len() };
        edit_bytes(b, limit, r);
        return;
    }
    let mut h: Value = serde_json::from_slice(&b[8..header_end]).expect("header is JSON");
    let names: Vec<String> = h
        .as_object()
        .expect("object")
        .keys()
        .filter(|k| *k != "__metadata__")
        .cloned()
        .collect();
    let name = names[r.below(names.len())].clone();
    let o = h.as_object_mut().expect("object");
    match r.below(7) {
        0 => o[&name]["dtype"] = json!(["F16", "F32", "I8", "BOOL", "Q4"][r.below(5)]),
        1 => {
            if let Some(Value::Array(s)) = o[&name].get_mut("shape")
                && !s.is_empty()
            {
                let i = r.below(s.len());
                s[i] = json!([0_u64, 1, 3, 1 << 40][r.below(4)]);
            }
        }
        2 => {
            if let Some(Value::Array(off)) = o[&name].get_mut("data_offsets") {
                let i = r.below(2);
                let d = off[i].as_u64().unwrap_or(0);
                off[i] = json!([d + 2, d.saturating_sub(2), u64::MAX, 0][r.below(4)]);
            }
        }
        3 => {
            let v = o.shift_remove(&name).expect("entry");
            let renamed = [
                format!("model.{name}"),
                format!("{name}.bias"),
                "x".to_owned(),
            ];
            o.insert(renamed[r.below(3)].clone(), v);
        }
        4 => {
            o.shift_remove(&name);
        }
        5 => {
            let v = o[&name].clone();
            o.insert(format!("model.{name}"), v);
        }
        _ => {
            o.insert("__metadata__".into(), json!({"format": [1]}));
        }
    }
    let text = serde_json::to_vec(&h).expect("encode");
    let mut out = Vec::with_capacity(b.len());
    let len = if r.chance(15) {
        text.len() as u64 + 1
    } else {
        text.len() as u64
    };
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&text);
    out.extend_from_slice(&b[header_end..]);
    *b = out;
}

/// Run one block on a loaded model: exercises whatever the loader accepted.
fn exercise(model: &DraftModel, spec: &TinySpec, be: &Backend) {
    let mut store = ContextStore::new(
        be.clone(),
        model.context_geometry().expect("geometry"),
        Capacity::new(1, 16, 4),
    )
    .expect("store");
    let h = store.admit(16).expect("admit");
    let feats = synthetic::features(3, model.geometry().feature_width as usize, 1);
    model
        .prefill(&mut store, h, be.upload(&feats).expect("upload"))
        .expect("prefill");
    let host = synthetic::target_parts(spec.vocab_rows as usize, spec.hidden as usize, 2);
    let emb = be.upload(&host.embedding).expect("upload");
    let head = be.upload(&host.output_head).expect("upload");
    let parts = TargetParts {
        vocab_rows: spec.vocab_rows as usize,
        public_vocab: spec.public_vocab as usize,
        embedding: &emb,
        head: HeadParts::Full { output_head: &head },
    };
    let ws_spec = WorkspaceSpec {
        rows: 1,
        draft_count: 2,
        mask_token_id: spec.mask_token_id,
        head: HeadShape {
            kind: ProposalHead::Full,
            rows: spec.vocab_rows as usize,
            public_vocab: spec.public_vocab as usize,
        },
    };
    let mut ws = Workspace::new(model, &store, &ws_spec).expect("workspace");
    let row = RowRequest {
        handle: h,
        anchor: 3,
        usable: 2,
        temperature: 0.5,
        seed: 9,
    };
    let p = model
        .propose(&store, &[row], &parts, &mut ws)
        .expect("propose");
    assert!(p[0].tokens.iter().all(|&t| t < spec.public_vocab as i32));
}

/// Counts of what the cases did, to show the mutations reach every outcome.
#[derive(Default, Debug)]
struct Tally {
    loaded: usize,
    refused_math: usize,
    refused_other: usize,
    reported_unknown: usize,
}

fn run_cases(spec: TinySpec, seed: u64, dir: &Path) -> Tally {
    let be = Backend::cpu();
    let (cfg, target) = synthetic::tiny_pair(&spec);
    synthetic::write_checkpoint(dir, &cfg, &target, 3, Layout::Single).expect("checkpoint");
    let weights_path = dir.join("model.safetensors");
    let config_path = dir.join("config.json");
    let clean_weights = std::fs::read(&weights_path).expect("weights");
    let clean_doc: Value = serde_json::from_str(&cfg).expect("config");
    let mut r = Rng(Stream::new(seed, "mutations"));
    let mut tally = Tally::default();
    for case in 0..CASES {
        let mut doc = clean_doc.clone();
        let mut weights = clean_weights.clone();
        // 0..=2: one math-changing field in an otherwise clean config (loads iff neutral);
        // 3, 4, 9: random config edits; 5, 6: config bytes; 7..=9: weight bytes.
        let kind = r.below(10);
        let mut config_text = None;
        if kind <= 2 {
            insert_math(&mut doc, &mut r);
        }
        if kind == 3 || kind == 4 || kind == 9 {
            edit_config(&mut doc, &mut r);
        }
        if kind == 5 || kind == 6 {
            let mut t = doc.to_string().into_bytes();
            edit_bytes(&mut t, usize::MAX, &mut r);
            config_text = Some(t);
        }
        if kind >= 7 {
            edit_weights(&mut weights, &mut r);
        }
        let text = config_text.unwrap_or_else(|| doc.to_string().into_bytes());
        std::fs::write(&config_path, &text).expect("write config");
        std::fs::write(&weights_path, &weights).expect("write weights");
        // What the oracle sees: the document as the file now holds it, if it is JSON.
        let seen: Option<Value> = serde_json::from_slice(&text).ok();
        let mode = if r.chance(25) {
            ParseMode::Strict
        } else {
            ParseMode::Lenient
        };
        let loaded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            DraftModel::load_reported(&be, dir, &target, &BindOptions::default(), mode)
        }))
        .unwrap_or_else(|_| panic!("case {case} (seed {seed:#x}) panicked while loading"));
        let active = seen.as_ref().and_then(active_math);
        match loaded {
            Ok((model, report)) => {
                if let Some(path) = active {
                    panic!("case {case} (seed {seed:#x}): `{path}` silently accepted");
                }
                let doc = seen.expect("a loaded config is JSON");
                let backend = model.geometry().backend;
                for p in field_paths(&doc) {
                    if draft_field_class(&p, backend) == FieldClass::Unknown {
                        assert!(
                            report.unknown_fields.iter().any(|u| u.path == p),
                            "case {case}: unknown field `{p}` dropped silently"
                        );
                        tally.reported_unknown += 1;
                    }
                }
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    exercise(&model, &spec, &be)
                }))
                .unwrap_or_else(|_| panic!("case {case} (seed {seed:#x}) panicked in a block"));
                tally.loaded += 1;
            }
            Err(e) => {
                let message = e.to_string();
                assert!(!message.is_empty(), "case {case}: empty error");
                if active.is_some() {
                    tally.refused_math += 1;
                } else {
                    tally.refused_other += 1;
                }
            }
        }
    }
    tally
}

#[test]
fn mutated_checkpoints_never_panic_and_never_silently_accept_math_changing_fields() {
    for (spec, seed, name) in [
        (TinySpec::dflash(), SEED, "mut-dflash"),
        (TinySpec::dflash2(), SEED ^ 0x2, "mut-dflash2"),
    ] {
        assert_eq!(spec.backend == DraftBackend::DFlash2, name.ends_with('2'));
        let dir = common::temp_dir(name);
        let t = run_cases(spec, seed, &dir);
        let _ = std::fs::remove_dir_all(&dir);
        // The mutations must reach every outcome, or the test proves little.
        assert!(t.loaded >= 100, "{name}: {t:?}");
        assert!(t.refused_math >= 100, "{name}: {t:?}");
        assert!(t.refused_other >= 100, "{name}: {t:?}");
        assert!(t.reported_unknown >= 50, "{name}: {t:?}");
        assert_eq!(t.loaded + t.refused_math + t.refused_other, CASES);
    }
}
