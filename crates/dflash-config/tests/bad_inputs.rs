//! Table-driven malformed and contradictory inputs: each must fail with its specific
//! `ConfigError` variant at its specific JSON path, and the message must name the path.

mod common;

use common::{del, doc, set};
use dflash_config::{
    ConfigError, DraftConfig, ParseMode, TargetTextConfig, count_tokenizer_vocab, examples,
    validate_pair,
};
use serde_json::{Value, json};

const D35: &str = examples::OFFICIAL_35B_DFLASH_DRAFT;
const D35L: &str = examples::OFFICIAL_35B_DFLASH_DRAFT_LEGACY;
const D27: &str = examples::OFFICIAL_27B_DFLASH2_DRAFT;
const D27L: &str = examples::OFFICIAL_27B_DFLASH2_DRAFT_LEGACY;
const T35: &str = examples::QWEN35_35B_A3B_TARGET;
const T27: &str = examples::QWEN35_27B_TARGET;

struct Case {
    name: &'static str,
    /// Draft fixture, or raw text when `raw` is set.
    draft: &'static str,
    /// Use `draft` verbatim as the document text (no JSON edit).
    raw: bool,
    edit_draft: fn(&mut Value),
    target: &'static str,
    edit_target: fn(&mut Value),
    mode: ParseMode,
    path: &'static str,
    check: fn(&ConfigError) -> bool,
}

fn none(_: &mut Value) {}

fn case(
    name: &'static str,
    draft: &'static str,
    edit_draft: fn(&mut Value),
    path: &'static str,
    check: fn(&ConfigError) -> bool,
) -> Case {
    let target = if draft == D27 || draft == D27L {
        T27
    } else {
        T35
    };
    Case {
        name,
        draft,
        raw: false,
        edit_draft,
        target,
        edit_target: none,
        mode: ParseMode::Lenient,
        path,
        check,
    }
}

fn pair_case(
    name: &'static str,
    draft: &'static str,
    edit_draft: fn(&mut Value),
    edit_target: fn(&mut Value),
    path: &'static str,
    check: fn(&ConfigError) -> bool,
) -> Case {
    Case {
        edit_target,
        ..case(name, draft, edit_draft, path, check)
    }
}

/// Parse draft, parse target, validate the pair; the first error wins.
fn run(c: &Case) -> Result<(), ConfigError> {
    let text = if c.raw {
        c.draft.to_owned()
    } else {
        let mut d = doc(c.draft);
        (c.edit_draft)(&mut d);
        d.to_string()
    };
    let draft = DraftConfig::from_json_str(&text, c.mode)?;
    let mut t = doc(c.target);
    (c.edit_target)(&mut t);
    let target = TargetTextConfig::from_json_str(&t.to_string())?;
    validate_pair(&draft.value, &target).map(|_| ())
}

fn cases() -> Vec<Case> {
    use ConfigError as E;
    vec![
        Case {
            raw: true,
            ..case("truncated JSON", "{\"architectures\": [", none, "", |e| {
                matches!(e, E::Json { .. })
            })
        },
        Case {
            raw: true,
            ..case("root is an array", "[1, 2]", none, "", |e| {
                matches!(e, E::WrongType { .. })
            })
        },
        case(
            "architectures missing",
            D35,
            |d| del(d, "/architectures"),
            "architectures",
            |e| matches!(e, E::Missing { .. }),
        ),
        case(
            "architecture is a causal LM",
            D35,
            |d| set(d, "/architectures/0", json!("Qwen3ForCausalLM")),
            "architectures[0]",
            |e| matches!(e, E::Architecture { .. }),
        ),
        case(
            "two architectures",
            D35,
            |d| {
                set(
                    d,
                    "/architectures",
                    json!(["DFlashDraftModel", "DFlash2DraftModel"]),
                )
            },
            "architectures",
            |e| matches!(e, E::Architecture { .. }),
        ),
        case(
            "architectures is a string",
            D35,
            |d| set(d, "/architectures", json!("DFlashDraftModel")),
            "architectures",
            |e| matches!(e, E::WrongType { .. }),
        ),
        case(
            "model_type llama",
            D35,
            |d| set(d, "/model_type", json!("llama")),
            "model_type",
            |e| matches!(e, E::ModelType { .. }),
        ),
        case(
            "query heads not a multiple of KV heads",
            D35,
            |d| set(d, "/num_attention_heads", json!(30)),
            "num_attention_heads",
            |e| {
                matches!(
                    e,
                    E::HeadsNotDivisible {
                        q_heads: 30,
                        kv_heads: 8,
                        ..
                    }
                )
            },
        ),
        case(
            "odd head dim",
            D27,
            |d| set(d, "/head_dim", json!(127)),
            "head_dim",
            |e| matches!(e, E::OddHeadDim { found: 127, .. }),
        ),
        case(
            "zero eps",
            D35,
            |d| set(d, "/rms_norm_eps", json!(0.0)),
            "rms_norm_eps",
            |e| matches!(e, E::NonPositiveFloat { .. }),
        ),
        case(
            "negative eps",
            D27L,
            |d| set(d, "/rms_norm_eps", json!(-1e-6)),
            "rms_norm_eps",
            |e| matches!(e, E::NonPositiveFloat { .. }),
        ),
        case(
            "negative nested theta",
            D35,
            |d| set(d, "/rope_parameters/rope_theta", json!(-5)),
            "rope_parameters.rope_theta",
            |e| matches!(e, E::NonPositiveFloat { .. }),
        ),
        case(
            "theta missing",
            D35L,
            |d| del(d, "/rope_theta"),
            "rope_theta",
            |e| matches!(e, E::Missing { .. }),
        ),
        case(
            "flat and nested theta disagree",
            D35,
            |d| set(d, "/rope_theta", json!(1_000_000)),
            "rope_theta",
            |e| matches!(e, E::Conflict { .. }),
        ),
        case(
            "rope type yarn",
            D35,
            |d| set(d, "/rope_parameters/rope_type", json!("yarn")),
            "rope_parameters.rope_type",
            |e| matches!(e, E::UnsupportedFeature { .. }),
        ),
        case(
            "rope scaling active",
            D35L,
            |d| {
                set(
                    d,
                    "/rope_scaling",
                    json!({"rope_type": "yarn", "factor": 4.0}),
                )
            },
            "rope_scaling",
            |e| matches!(e, E::UnsupportedFeature { found, .. } if found == "rope_type \"yarn\""),
        ),
        case(
            "sliding layers with use_sliding_window false",
            D27,
            |d| set(d, "/use_sliding_window", json!(false)),
            "use_sliding_window",
            |e| matches!(e, E::Conflict { other_path, .. } if other_path == "layer_types[0]"),
        ),
        case(
            "rope_parameters is a number",
            D35,
            |d| set(d, "/rope_parameters", json!(7)),
            "rope_parameters",
            |e| matches!(e, E::WrongType { .. }),
        ),
        case(
            "layer_types shorter than num_hidden_layers",
            D35,
            |d| del(d, "/layer_types/5"),
            "layer_types",
            |e| {
                matches!(
                    e,
                    E::LayerTypesLength {
                        expected: 6,
                        found: 5,
                        ..
                    }
                )
            },
        ),
        case(
            "unknown layer type",
            D35,
            |d| set(d, "/layer_types/2", json!("linear_attention")),
            "layer_types[2]",
            |e| matches!(e, E::UnknownLayerType { .. }),
        ),
        case(
            "sliding layers without a window",
            D35,
            |d| del(d, "/sliding_window"),
            "sliding_window",
            |e| matches!(e, E::Missing { .. }),
        ),
        case(
            "empty target ids",
            D35,
            |d| set(d, "/dflash_config/target_layer_ids", json!([])),
            "dflash_config.target_layer_ids",
            |e| matches!(e, E::EmptyTargetLayerIds { .. }),
        ),
        case(
            "duplicate target id",
            D35,
            |d| set(d, "/dflash_config/target_layer_ids/3", json!(1)),
            "dflash_config.target_layer_ids[3]",
            |e| {
                matches!(
                    e,
                    E::DuplicateTargetLayerId {
                        found: 1,
                        first_index: 0,
                        ..
                    }
                )
            },
        ),
        case(
            "target id at the stated layer count",
            D35,
            |d| set(d, "/dflash_config/target_layer_ids/7", json!(40)),
            "dflash_config.target_layer_ids[7]",
            |e| {
                matches!(
                    e,
                    E::TargetLayerIdOutOfRange {
                        found: 40,
                        num_target_layers: 40,
                        ..
                    }
                )
            },
        ),
        case(
            "negative target id",
            D27,
            |d| set(d, "/dflash_config/target_layer_ids/1", json!(-6)),
            "dflash_config.target_layer_ids[1]",
            |e| matches!(e, E::OutOfRange { .. }),
        ),
        case(
            "fractional target id",
            D27,
            |d| set(d, "/dflash_config/target_layer_ids/0", json!(1.5)),
            "dflash_config.target_layer_ids[0]",
            |e| matches!(e, E::WrongType { .. }),
        ),
        case(
            "no ids and no num_target_layers",
            D35L,
            |d| {
                del(d, "/dflash_config/target_layer_ids");
                del(d, "/num_target_layers");
            },
            "dflash_config.target_layer_ids",
            |e| matches!(e, E::Missing { .. }),
        ),
        case(
            "hidden_act gelu",
            D35,
            |d| set(d, "/hidden_act", json!("gelu")),
            "hidden_act",
            |e| matches!(e, E::Activation { .. }),
        ),
        case(
            "attention bias",
            D27,
            |d| set(d, "/attention_bias", json!(true)),
            "attention_bias",
            |e| matches!(e, E::UnsupportedFeature { .. }),
        ),
        case(
            "causal draft",
            D35,
            |d| set(d, "/is_causal", json!(true)),
            "is_causal",
            |e| matches!(e, E::UnsupportedFeature { .. }),
        ),
        case(
            "nested causal flag",
            D27,
            |d| set(d, "/dflash_config/causal", json!(true)),
            "dflash_config.causal",
            |e| matches!(e, E::UnsupportedFeature { .. }),
        ),
        case(
            "causal flag of the wrong type",
            D35,
            |d| set(d, "/is_causal", json!("no")),
            "is_causal",
            |e| matches!(e, E::WrongType { .. }),
        ),
        case(
            "logit softcapping",
            D35,
            |d| set(d, "/final_logit_softcapping", json!(30.0)),
            "final_logit_softcapping",
            |e| matches!(e, E::UnsupportedFeature { .. }),
        ),
        case(
            "output multiplier",
            D35,
            |d| set(d, "/output_multiplier", json!(2)),
            "output_multiplier",
            |e| matches!(e, E::UnsupportedFeature { .. }),
        ),
        case(
            "input embedding scale",
            D27,
            |d| set(d, "/input_embedding_scale", json!(0.5)),
            "input_embedding_scale",
            |e| matches!(e, E::UnsupportedFeature { .. }),
        ),
        case(
            "sample from anchor",
            D35,
            |d| set(d, "/dflash_config/sample_from_anchor", json!(true)),
            "dflash_config.sample_from_anchor",
            |e| matches!(e, E::UnsupportedFeature { .. }),
        ),
        case(
            "attention sink bias",
            D35,
            |d| set(d, "/attention_sink_bias", json!(true)),
            "attention_sink_bias",
            |e| matches!(e, E::UnsupportedFeature { .. }),
        ),
        case(
            "aux hidden state",
            D27,
            |d| set(d, "/dflash_config/use_aux_hidden_state", json!(true)),
            "dflash_config.use_aux_hidden_state",
            |e| matches!(e, E::UnsupportedFeature { .. }),
        ),
        case(
            "three conv taps",
            D27,
            |d| set(d, "/dflash_config/conv_kernel_size", json!(3)),
            "dflash_config.conv_kernel_size",
            |e| matches!(e, E::Unsupported { .. }),
        ),
        case(
            "selector rank missing",
            D27,
            |d| del(d, "/dflash_config/selector_rank"),
            "dflash_config.selector_rank",
            |e| matches!(e, E::Missing { .. }),
        ),
        case(
            "selector top-8",
            D27L,
            |d| set(d, "/dflash_config/selector_top_k", json!(8)),
            "dflash_config.selector_top_k",
            |e| matches!(e, E::Unsupported { .. }),
        ),
        case(
            "nested and top-level block size disagree",
            D35,
            |d| set(d, "/block_size", json!(8)),
            "dflash_config.block_size",
            |e| matches!(e, E::Conflict { .. }),
        ),
        case(
            "zero draft layers",
            D35,
            |d| set(d, "/num_hidden_layers", json!(0)),
            "num_hidden_layers",
            |e| matches!(e, E::OutOfRange { .. }),
        ),
        case(
            "layer count beyond 32 bits",
            D35,
            |d| set(d, "/num_hidden_layers", json!(4_294_967_296_u64)),
            "num_hidden_layers",
            |e| matches!(e, E::OutOfRange { .. }),
        ),
        case(
            "KV heads as a string",
            D35,
            |d| set(d, "/num_key_value_heads", json!("8")),
            "num_key_value_heads",
            |e| matches!(e, E::WrongType { .. }),
        ),
        case(
            "dflash_config is an array",
            D35,
            |d| set(d, "/dflash_config", json!([1, 2])),
            "dflash_config",
            |e| matches!(e, E::WrongType { .. }),
        ),
        Case {
            mode: ParseMode::Strict,
            ..case(
                "unknown field in strict mode",
                D27,
                |d| set(d, "/dflash_config/new_knob", json!(1)),
                "dflash_config.new_knob",
                |e| matches!(e, E::UnknownFields { all, .. } if all.len() == 1),
            )
        },
        pair_case(
            "hidden size differs from the target's",
            D27,
            none,
            |t| set(t, "/text_config/hidden_size", json!(4096)),
            "hidden_size",
            |e| {
                matches!(
                    e,
                    E::PairMismatch {
                        draft: 5120,
                        target: 4096,
                        ..
                    }
                )
            },
        ),
        pair_case(
            "vocab size differs from the target's",
            D35,
            |d| set(d, "/vocab_size", json!(151_936)),
            none,
            "vocab_size",
            |e| {
                matches!(
                    e,
                    E::PairMismatch {
                        draft: 151_936,
                        target: 248_320,
                        ..
                    }
                )
            },
        ),
        pair_case(
            "num_target_layers differs from the target's",
            D27,
            none,
            |t| set(t, "/text_config/num_hidden_layers", json!(48)),
            "num_target_layers",
            |e| {
                matches!(
                    e,
                    E::PairMismatch {
                        draft: 64,
                        target: 48,
                        ..
                    }
                )
            },
        ),
        pair_case(
            "target id beyond a shallower target",
            D27,
            |d| del(d, "/dflash_config/num_target_layers"),
            |t| set(t, "/text_config/num_hidden_layers", json!(48)),
            "dflash_config.target_layer_ids[4]",
            |e| {
                matches!(
                    e,
                    E::TargetLayerIdOutOfRange {
                        found: 61,
                        num_target_layers: 48,
                        ..
                    }
                )
            },
        ),
        pair_case(
            "mask token at the embedding row count",
            D27,
            |d| set(d, "/dflash_config/mask_token_id", json!(248_320)),
            none,
            "dflash_config.mask_token_id",
            |e| {
                matches!(
                    e,
                    E::MaskTokenOutOfRange {
                        found: 248_320,
                        vocab_rows: 248_320,
                        ..
                    }
                )
            },
        ),
        pair_case(
            "conv group does not divide the hidden width",
            D27,
            |d| del(d, "/hidden_size"),
            |t| set(t, "/text_config/hidden_size", json!(5128)),
            "dflash_config.conv_group_size",
            |e| {
                matches!(
                    e,
                    E::ConvGroupNotDividing {
                        group: 16,
                        hidden: 5128,
                        ..
                    }
                )
            },
        ),
        pair_case(
            "target hidden size missing",
            D35,
            none,
            |t| del(t, "/text_config/hidden_size"),
            "text_config.hidden_size",
            |e| matches!(e, E::Missing { .. }),
        ),
        pair_case(
            "target eos id negative",
            D35,
            none,
            |t| set(t, "/text_config/eos_token_id", json!([248_046, -1])),
            "text_config.eos_token_id[1]",
            |e| matches!(e, E::OutOfRange { .. }),
        ),
        pair_case(
            "target text_config is a string",
            D35,
            none,
            |t| set(t, "/text_config", json!("qwen3_5")),
            "text_config",
            |e| matches!(e, E::WrongType { .. }),
        ),
    ]
}

#[test]
fn every_bad_input_fails_with_its_variant_and_path() {
    let cases = cases();
    assert!(cases.len() >= 25, "the suite must keep at least 25 cases");
    let mut names = std::collections::HashSet::new();
    for c in &cases {
        assert!(names.insert(c.name), "duplicate case name {}", c.name);
        let err = match run(c) {
            Ok(()) => panic!("{}: accepted", c.name),
            Err(e) => e,
        };
        assert!((c.check)(&err), "{}: wrong variant: {err:?}", c.name);
        assert_eq!(err.path(), c.path, "{}: wrong path: {err:?}", c.name);
        let named = if c.path.is_empty() {
            let s = err.to_string();
            s.starts_with("invalid JSON at line ") || s.starts_with("the document: ")
        } else {
            err.to_string().contains(&format!("`{}`", c.path))
        };
        assert!(named, "{}: message does not name the path: {err}", c.name);
    }
}

#[test]
fn tokenizer_with_non_integer_added_id_is_refused() {
    let mut t = doc(examples::TINY_TOKENIZER);
    set(&mut t, "/added_tokens/1/id", json!("x"));
    let err = count_tokenizer_vocab(&t.to_string()).expect_err("refused");
    assert!(matches!(err, ConfigError::WrongType { .. }), "{err:?}");
    assert_eq!(err.path(), "added_tokens[1].id");
}

#[test]
fn tokenizer_without_model_is_refused() {
    let mut t = doc(examples::TINY_TOKENIZER);
    del(&mut t, "/model");
    let err = count_tokenizer_vocab(&t.to_string()).expect_err("refused");
    assert!(matches!(err, ConfigError::Missing { .. }), "{err:?}");
    assert_eq!(err.path(), "model");
}

#[test]
fn public_vocab_above_the_row_count_is_refused() {
    let t = TargetTextConfig::from_json_str(T27).expect("target parses");
    let err = t.with_public_vocab_size(248_321).expect_err("refused");
    assert!(matches!(err, ConfigError::OutOfRange { .. }), "{err:?}");
    assert_eq!(err.path(), "public_vocab_size");
}

#[test]
fn public_vocab_below_an_eos_id_is_refused() {
    let t = TargetTextConfig::from_json_str(T27).expect("target parses");
    let err = t.with_public_vocab_size(248_000).expect_err("refused");
    assert!(matches!(err, ConfigError::OutOfRange { .. }), "{err:?}");
    assert_eq!(err.path(), "eos_token_id[0]");
}
