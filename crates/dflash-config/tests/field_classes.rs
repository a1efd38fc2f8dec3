//! The three classes of draft config fields, one table each: ordinary Hugging Face fields are
//! accepted without effect; math-changing fields are refused unless they hold their neutral
//! value; unknown fields are returned to the caller (lenient) or refused (strict). Plus the
//! notes the parser writes for what it assumed.

mod common;

use common::{del, doc, set};
use dflash_config::{
    Backend, ConfigError, DraftConfig, FieldClass, ParseMode, draft_field_class, examples,
};
use serde_json::{Value, json};

/// The fixtures every row runs on: both backends, both layouts.
const FIXTURES: [&str; 4] = [
    examples::OFFICIAL_35B_DFLASH_DRAFT,
    examples::OFFICIAL_35B_DFLASH_DRAFT_LEGACY,
    examples::OFFICIAL_27B_DFLASH2_DRAFT,
    examples::OFFICIAL_27B_DFLASH2_DRAFT_LEGACY,
];

/// `path` (as error messages write it) to a JSON pointer, creating `dflash_config` when
/// needed.
fn pointer(d: &mut Value, path: &str) -> String {
    if path.starts_with("dflash_config.") && d.get("dflash_config").is_none() {
        set(d, "/dflash_config", json!({}));
    }
    if path.starts_with("rope_parameters.") && d.get("rope_parameters").is_none() {
        set(d, "/rope_parameters", json!({}));
    }
    format!("/{}", path.replace('.', "/"))
}

fn with(fixture: &str, path: &str, value: &Value) -> String {
    let mut d = doc(fixture);
    let p = pointer(&mut d, path);
    set(&mut d, &p, value.clone());
    d.to_string()
}

fn backend_of(fixture: &str) -> Backend {
    DraftConfig::from_json_str(fixture, ParseMode::Strict)
        .expect("fixture parses")
        .value
        .backend
}

#[test]
fn ordinary_hugging_face_fields_are_accepted_without_effect() {
    let table: &[(&str, Value)] = &[
        ("auto_map", json!({"AutoModel": "dflash.DFlashDraftModel"})),
        ("torch_dtype", json!("bfloat16")),
        ("dtype", json!("float16")),
        ("transformers_version", json!("5.0.0")),
        ("_name_or_path", json!("z-lab/some-draft")),
        ("bos_token_id", json!(248_044)),
        ("eos_token_id", json!([248_046, 248_044])),
        ("pad_token_id", json!(null)),
        ("attention_dropout", json!(0.1)),
        ("initializer_range", json!(0.5)),
        ("max_position_embeddings", json!(4096)),
        ("tie_word_embeddings", json!(true)),
        ("use_cache", json!(false)),
    ];
    for fixture in FIXTURES {
        let clean = DraftConfig::from_json_str(fixture, ParseMode::Strict).expect("clean");
        for (path, value) in table {
            assert_eq!(
                draft_field_class(path, clean.value.backend),
                FieldClass::Harmless,
                "{path}"
            );
            let p = DraftConfig::from_json_str(&with(fixture, path, value), ParseMode::Strict)
                .unwrap_or_else(|e| panic!("{path} = {value}: refused: {e}"));
            assert!(
                p.unknown_fields.is_empty(),
                "{path}: {:?}",
                p.unknown_fields
            );
            assert_eq!(p.value, clean.value, "{path} changed the parsed config");
        }
    }
}

/// A math-changing field: active values (each must be refused at `path`) and neutral values
/// (each must parse to the clean config).
struct MathRow {
    path: &'static str,
    active: Vec<Value>,
    neutral: Vec<Value>,
}

fn row(path: &'static str, active: Vec<Value>, neutral: Vec<Value>) -> MathRow {
    MathRow {
        path,
        active,
        neutral,
    }
}

fn math_rows() -> Vec<MathRow> {
    let flag = || (vec![json!(true)], vec![json!(false), json!(null)]);
    let cap = || (vec![json!(30.0), json!(50)], vec![json!(null)]);
    let scale = || {
        (
            vec![json!(2.0), json!(0.5), json!(0)],
            vec![json!(1), json!(1.0)],
        )
    };
    let mut rows = Vec::new();
    for (path, (active, neutral)) in [
        (
            "hidden_act",
            (vec![json!("gelu"), json!("relu")], vec![json!("silu")]),
        ),
        (
            "hidden_activation",
            (vec![json!("gelu_pytorch_tanh")], vec![json!("silu")]),
        ),
        ("attention_bias", flag()),
        ("mlp_bias", flag()),
        (
            "rope_scaling",
            (
                vec![
                    json!({"rope_type": "yarn", "factor": 4.0}),
                    json!({"type": "linear", "factor": 2.0}),
                    json!({"factor": 2.0}),
                ],
                vec![json!(null), json!({"rope_type": "default"})],
            ),
        ),
        (
            "partial_rotary_factor",
            (vec![json!(0.5), json!(0.25)], vec![json!(1.0)]),
        ),
        (
            "rope_parameters.rope_type",
            (
                vec![json!("yarn"), json!("dynamic")],
                vec![json!("default")],
            ),
        ),
        (
            "rope_parameters.partial_rotary_factor",
            (vec![json!(0.5)], vec![json!(1)]),
        ),
        ("attn_logit_softcapping", cap()),
        ("dflash_config.attn_logit_softcapping", cap()),
        ("final_logit_softcapping", cap()),
        ("dflash_config.final_logit_softcapping", cap()),
        ("logit_softcapping", cap()),
        ("output_multiplier", scale()),
        ("dflash_config.output_multiplier", scale()),
        ("logits_scaling", scale()),
        ("logit_scale", scale()),
        ("input_embedding_scale", scale()),
        ("dflash_config.input_embedding_scale", scale()),
        ("embedding_multiplier", scale()),
        ("residual_multiplier", scale()),
        (
            "attention_multiplier",
            (vec![json!(0.0078125)], vec![json!(null)]),
        ),
        ("is_causal", flag()),
        ("dflash_config.is_causal", flag()),
        ("causal", flag()),
        ("dflash_config.causal", flag()),
        ("dflash_config.causal_mask", flag()),
        ("sample_from_anchor", flag()),
        ("dflash_config.sample_from_anchor", flag()),
        (
            "attention_sink_bias",
            (vec![json!(true), json!(0.0)], vec![json!(false)]),
        ),
        (
            "attention_sinks",
            (vec![json!(true), json!(16)], vec![json!(false)]),
        ),
        ("use_aux_hidden_state", flag()),
        ("dflash_config.use_aux_hidden_state", flag()),
    ] {
        rows.push(row(path, active, neutral));
    }
    rows
}

#[test]
fn math_changing_fields_are_refused_unless_neutral() {
    let rows = math_rows();
    assert!(rows.len() >= 30, "keep the table complete");
    for fixture in FIXTURES {
        let clean = DraftConfig::from_json_str(fixture, ParseMode::Strict).expect("clean");
        for r in &rows {
            assert!(
                matches!(
                    draft_field_class(r.path, clean.value.backend),
                    FieldClass::MathChanging(_)
                ),
                "{} is not classified math-changing",
                r.path
            );
            for v in &r.active {
                for mode in [ParseMode::Lenient, ParseMode::Strict] {
                    let e = DraftConfig::from_json_str(&with(fixture, r.path, v), mode)
                        .expect_err(&format!("{} = {v} accepted", r.path));
                    assert!(
                        matches!(
                            e,
                            ConfigError::UnsupportedFeature { .. } | ConfigError::Activation { .. }
                        ),
                        "{} = {v}: wrong variant {e:?}",
                        r.path
                    );
                    assert_eq!(e.path(), r.path, "{e}");
                    assert!(e.to_string().starts_with(&format!("`{}`", r.path)), "{e}");
                }
            }
            for v in &r.neutral {
                let p = DraftConfig::from_json_str(&with(fixture, r.path, v), ParseMode::Strict)
                    .unwrap_or_else(|e| panic!("{} = {v}: neutral refused: {e}", r.path));
                assert_eq!(p.value, clean.value, "{} = {v}", r.path);
            }
        }
    }
}

#[test]
fn math_changing_fields_of_the_wrong_type_are_type_errors() {
    for (path, v) in [
        ("is_causal", json!("no")),
        ("dflash_config.causal_mask", json!(1)),
        ("output_multiplier", json!("2")),
        ("hidden_act", json!(3)),
        ("rope_scaling", json!("yarn")),
    ] {
        let e = DraftConfig::from_json_str(
            &with(examples::OFFICIAL_27B_DFLASH2_DRAFT, path, &v),
            ParseMode::Lenient,
        )
        .expect_err("refused");
        assert!(matches!(e, ConfigError::WrongType { .. }), "{path}: {e:?}");
        assert_eq!(e.path(), path);
    }
}

#[test]
fn unknown_fields_are_returned_in_lenient_mode_and_refused_in_strict_mode() {
    let table: &[(&str, Value)] = &[
        ("new_knob", json!(1)),
        ("quantization_config", json!({"quant_method": "fp8"})),
        ("target_hidden_size", json!(4096)),
        ("layer_norm_eps", json!(1e-5)),
        ("dflash_config.new_knob", json!("x")),
        ("dflash_config.num_denoising_steps", json!(2)),
        ("rope_parameters.factor", json!(8.0)),
        ("rope_parameters.mrope_section", json!([16, 24, 24])),
    ];
    for fixture in FIXTURES {
        let backend = backend_of(fixture);
        let clean = DraftConfig::from_json_str(fixture, ParseMode::Strict).expect("clean");
        for (path, value) in table {
            assert_eq!(
                draft_field_class(path, backend),
                FieldClass::Unknown,
                "{path}"
            );
            let text = with(fixture, path, value);
            let p = DraftConfig::from_json_str(&text, ParseMode::Lenient).expect("lenient");
            assert_eq!(p.unknown_fields.len(), 1, "{path}: {:?}", p.unknown_fields);
            assert_eq!(p.unknown_fields[0].path, *path);
            assert_eq!(&p.unknown_fields[0].value, value);
            assert!(
                p.unknown_fields[0]
                    .to_string()
                    .starts_with(&format!("`{path}` = "))
            );
            assert_eq!(p.value, clean.value);
            let e = DraftConfig::from_json_str(&text, ParseMode::Strict).expect_err("strict");
            assert!(
                matches!(&e, ConfigError::UnknownFields { path: p, all } if p == path && all.len() == 1),
                "{path}: {e:?}"
            );
        }
    }
}

#[test]
fn dflash2_parameters_are_unknown_in_a_dflash_config() {
    for key in [
        "conv_kernel_size",
        "conv_group_size",
        "selector_rank",
        "selector_top_k",
    ] {
        let path = format!("dflash_config.{key}");
        assert_eq!(
            draft_field_class(&path, Backend::DFlash),
            FieldClass::Unknown
        );
        assert_eq!(
            draft_field_class(&path, Backend::DFlash2),
            FieldClass::Parsed
        );
    }
    assert_eq!(
        draft_field_class("auto_map.AutoModel", Backend::DFlash),
        FieldClass::Unknown
    );
    assert_eq!(
        draft_field_class("num_hidden_layers", Backend::DFlash),
        FieldClass::Parsed
    );
}

fn note_paths(text: &str) -> Vec<String> {
    DraftConfig::from_json_str(text, ParseMode::Strict)
        .expect("parses")
        .notes
        .into_iter()
        .map(|n| n.path)
        .collect()
}

#[test]
fn missing_causal_flag_is_computed_non_causal_and_noted() {
    let text = examples::OFFICIAL_35B_DFLASH_DRAFT;
    let p = DraftConfig::from_json_str(text, ParseMode::Strict).expect("parses");
    let note = p
        .notes
        .iter()
        .find(|n| n.path == "is_causal")
        .expect("the report notes the absent flag");
    assert!(note.message.contains("non-causal"), "{note}");
    assert!(
        note.to_string().starts_with("`is_causal`: absent"),
        "{note}"
    );
    for (path, v) in [
        ("is_causal", json!(false)),
        ("dflash_config.causal", json!(false)),
        ("dflash_config.causal_mask", json!(false)),
    ] {
        let stated = with(text, path, &v);
        assert!(
            !note_paths(&stated).contains(&"is_causal".to_owned()),
            "{path} states the flag"
        );
        let q = DraftConfig::from_json_str(&stated, ParseMode::Strict).expect("parses");
        assert_eq!(q.value, p.value, "stating the neutral flag changes nothing");
    }
}

#[test]
fn derived_values_and_null_mask_are_noted() {
    let mut d = doc(examples::OFFICIAL_35B_DFLASH_DRAFT_LEGACY);
    del(&mut d, "/layer_types");
    del(&mut d, "/dflash_config");
    let paths = note_paths(&d.to_string());
    for want in [
        "layer_types",
        "dflash_config.target_layer_ids",
        "dflash_config.mask_token_id",
    ] {
        assert!(paths.contains(&want.to_owned()), "{want}: {paths:?}");
    }
    let mut d = doc(examples::OFFICIAL_27B_DFLASH2_DRAFT);
    del(&mut d, "/use_sliding_window");
    assert!(note_paths(&d.to_string()).contains(&"use_sliding_window".to_owned()));
    // The official files state everything else.
    assert_eq!(
        note_paths(examples::OFFICIAL_27B_DFLASH2_DRAFT),
        Vec::<String>::new()
    );
}
