//! Random mutations of the bundled fixtures never make a parser or validator panic.
//!
//! Fixed seed (`RngSeed::Fixed`), 512 cases per property: a failure reproduces exactly.

use dflash_config::{
    Backend, DraftConfig, ParseMode, ProposalHead, StartupOptions, TargetTextConfig,
    count_tokenizer_vocab, examples, validate_pair,
};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, RngSeed};
use serde_json::{Map, Number, Value};

const FIXTURES: &[&str] = &[
    examples::OFFICIAL_35B_DFLASH_DRAFT,
    examples::OFFICIAL_35B_DFLASH_DRAFT_LEGACY,
    examples::OFFICIAL_27B_DFLASH2_DRAFT,
    examples::OFFICIAL_27B_DFLASH2_DRAFT_LEGACY,
    examples::QWEN35_35B_A3B_TARGET,
    examples::QWEN35_27B_TARGET,
    examples::TINY_TOKENIZER,
];

/// Numbers that stress conversions: huge, tiny, negative, fractional, boundary.
fn arb_number() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| Number::from_f64(f).map_or(Value::Null, Value::Number)),
        prop::sample::select(vec![
            0.0,
            -0.0,
            -1.0,
            0.5,
            1e-320,
            f64::MIN_POSITIVE,
            f64::MAX,
            -f64::MAX,
            4_294_967_295.0,
            4_294_967_296.0,
        ])
        .prop_map(|f| Number::from_f64(f).map_or(Value::Null, Value::Number)),
        prop::sample::select(vec![0_u64, 1, 2, 15, 16, 17, 4_294_967_295, 4_294_967_296])
            .prop_map(Value::from),
    ]
}

fn arb_leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        arb_number(),
        ".{0,12}".prop_map(Value::String),
        prop::sample::select(vec![
            "silu",
            "qwen3",
            "DFlashDraftModel",
            "DFlash2DraftModel",
            "sliding_attention",
            "full_attention",
            "default",
        ])
        .prop_map(|s| Value::String(s.to_owned())),
    ]
}

fn arb_value() -> impl Strategy<Value = Value> {
    arb_leaf().prop_recursive(2, 16, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec(("[a-z_]{1,8}", inner), 0..3)
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

#[derive(Debug, Clone)]
enum Edit {
    Delete(Index),
    Replace(Index, Value),
    Insert(Index, String, Value),
}

fn arb_edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        any::<Index>().prop_map(Edit::Delete),
        (any::<Index>(), arb_value()).prop_map(|(i, v)| Edit::Replace(i, v)),
        (
            any::<Index>(),
            prop_oneof![
                "[a-z_]{1,12}",
                prop::sample::select(vec![
                    "is_causal".to_owned(),
                    "rope_theta".to_owned(),
                    "target_layer_ids".to_owned(),
                    "dflash_config".to_owned(),
                    "text_config".to_owned(),
                    "layer_types".to_owned(),
                ]),
            ],
            arb_value()
        )
            .prop_map(|(i, k, v)| Edit::Insert(i, k, v)),
    ]
}

/// JSON pointers of every node (the root included).
fn pointers(v: &Value, here: String, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, c) in m {
                pointers(
                    c,
                    format!("{here}/{}", k.replace('~', "~0").replace('/', "~1")),
                    out,
                );
            }
        }
        Value::Array(a) => {
            for (i, c) in a.iter().enumerate() {
                pointers(c, format!("{here}/{i}"), out);
            }
        }
        _ => {}
    }
    out.push(here);
}

fn apply(doc: &mut Value, edit: &Edit) {
    let mut all = Vec::new();
    pointers(doc, String::new(), &mut all);
    match edit {
        Edit::Delete(i) | Edit::Replace(i, _) => {
            let ptr = i.get::<String>(&all).clone();
            if let Edit::Replace(_, v) = edit {
                if let Some(slot) = doc.pointer_mut(&ptr) {
                    *slot = v.clone();
                }
                return;
            }
            let Some((parent, last)) = ptr.rsplit_once('/') else {
                return;
            };
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
        Edit::Insert(i, k, v) => match doc.pointer_mut(i.get::<String>(&all)) {
            Some(Value::Object(m)) => {
                m.insert(k.clone(), v.clone());
            }
            Some(Value::Array(a)) => a.push(v.clone()),
            _ => {}
        },
    }
}

/// Run everything that can consume the text; only panics matter, errors are expected.
fn exercise(text: &str) {
    for mode in [ParseMode::Lenient, ParseMode::Strict] {
        let _ = DraftConfig::from_json_str(text, mode);
    }
    let _ = TargetTextConfig::from_json_str(text);
    let _ = count_tokenizer_vocab(text);
    let pairs = [
        (text, examples::QWEN35_27B_TARGET),
        (text, examples::QWEN35_35B_A3B_TARGET),
        (examples::OFFICIAL_27B_DFLASH2_DRAFT, text),
        (examples::OFFICIAL_35B_DFLASH_DRAFT, text),
    ];
    for (d, t) in pairs {
        let Ok(d) = DraftConfig::from_json_str(d, ParseMode::Lenient) else {
            continue;
        };
        let Ok(t) = TargetTextConfig::from_json_str(t) else {
            continue;
        };
        let t = t.clone().with_public_vocab_size(t.vocab_size).unwrap_or(t);
        let Ok(g) = validate_pair(&d.value, &t) else {
            continue;
        };
        for backend in [Backend::DFlash, Backend::DFlash2] {
            for (k, b, tree, head) in [
                (7, 1, None, ProposalHead::Full),
                (15, 8, Some(32), ProposalHead::Indexed { rows: 131_072 }),
                (0, 0, Some(0), ProposalHead::Indexed { rows: 0 }),
            ] {
                let o = StartupOptions {
                    concurrency: b,
                    tree_nodes: tree,
                    proposal_head: head,
                    ..StartupOptions::new(backend, k)
                };
                let _ = o.validate(&g);
            }
        }
        let _ = g.transient_sizes(u32::MAX, u32::MAX);
    }
}

fn config() -> Config {
    Config {
        cases: 512,
        rng_seed: RngSeed::Fixed(0xDF1A_5C0F),
        failure_persistence: None,
        ..Config::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn json_edits_never_panic(
        which in any::<Index>(),
        edits in prop::collection::vec(arb_edit(), 1..4),
    ) {
        let mut doc: Value = serde_json::from_str(which.get::<&str>(FIXTURES)).expect("fixture");
        for e in &edits {
            apply(&mut doc, e);
        }
        exercise(&doc.to_string());
    }

    #[test]
    fn text_truncation_and_splices_never_panic(
        which in any::<Index>(),
        cut in any::<Index>(),
        splice in prop_oneof![Just(String::new()), ".{0,8}", Just("1e999".to_owned()), Just("-".to_owned())],
    ) {
        let text: &str = which.get::<&str>(FIXTURES);
        let chars: Vec<char> = text.chars().collect();
        let at = cut.index(chars.len() + 1);
        let head: String = chars.iter().take(at).collect();
        let tail: String = chars.iter().skip(at + 1).collect();
        exercise(&head);
        exercise(&format!("{head}{splice}{tail}"));
    }
}
