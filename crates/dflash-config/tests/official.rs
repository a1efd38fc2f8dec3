//! The official geometries in both layouts, the legacy id derivation, unknown fields, layer-type
//! defaults and the public vocabulary.

mod common;

use common::{del, doc, set};
use dflash_config::{
    AttentionType, Backend, ConfigError, DraftConfig, Geometry, LayerKind, ParseMode,
    TargetLayerIdsSource, TargetTextConfig, UnknownField, count_tokenizer_vocab, examples,
    legacy_target_layer_ids, validate_pair,
};
use serde_json::json;

fn geometry(draft: &str, target: &str) -> Geometry {
    let d = DraftConfig::from_json_str(draft, ParseMode::Strict).expect("draft parses strictly");
    assert!(d.unknown_fields.is_empty());
    let t = TargetTextConfig::from_json_str(target)
        .expect("target parses")
        .with_public_vocab_size(examples::QWEN35_PUBLIC_VOCAB_SIZE)
        .expect("public vocab fits");
    validate_pair(&d.value, &t).expect("pair validates")
}

#[test]
fn ring_image_is_40_mib_for_official_dflash2() {
    for draft in [
        examples::OFFICIAL_27B_DFLASH2_DRAFT,
        examples::OFFICIAL_27B_DFLASH2_DRAFT_LEGACY,
    ] {
        let g = geometry(draft, examples::QWEN35_27B_TARGET);
        assert_eq!(g.backend, Backend::DFlash2);
        assert_eq!(
            (g.hidden, g.q_heads, g.kv_heads, g.head_dim, g.intermediate),
            (5120, 32, 8, 128, 17408)
        );
        assert_eq!(g.layers, vec![LayerKind::Local { window: 2048 }; 5]);
        assert_eq!(g.target_layer_ids, [5, 19, 33, 47, 61]);
        assert_eq!(g.n_ids(), 5);
        assert_eq!(g.feature_width, 5 * 5120);
        assert_eq!(g.ring_capacity, Some(2048));
        assert_eq!(
            (g.local_layers, g.full_layers, g.has_full_pool),
            (5, 0, false)
        );
        assert_eq!(g.ring_image_bytes, 41_943_040);
        assert_eq!(g.ring_image_bytes, 40 << 20);
        assert_eq!((g.rms_norm_eps, g.rope_theta), (1e-6, 1e7));
        assert_eq!(g.mask_token_id, Some(248_070));
        let p = g.dflash2.expect("DFlash2 parameters");
        assert_eq!(
            (
                p.conv_kernel_size,
                p.conv_group_size,
                p.selector_rank,
                p.selector_top_k
            ),
            (2, 16, 256, 16)
        );
    }
}

#[test]
fn official_dflash_has_five_rings_and_a_full_pool() {
    for draft in [
        examples::OFFICIAL_35B_DFLASH_DRAFT,
        examples::OFFICIAL_35B_DFLASH_DRAFT_LEGACY,
    ] {
        let g = geometry(draft, examples::QWEN35_35B_A3B_TARGET);
        assert_eq!(g.backend, Backend::DFlash);
        assert_eq!(
            (g.hidden, g.q_heads, g.kv_heads, g.head_dim, g.intermediate),
            (2048, 32, 8, 128, 6144)
        );
        let mut want = vec![LayerKind::Local { window: 4096 }; 5];
        want.push(LayerKind::Full);
        assert_eq!(g.layers, want);
        assert_eq!(g.target_layer_ids, [1, 6, 11, 16, 22, 27, 32, 37]);
        assert_eq!(g.feature_width, 8 * 2048);
        assert_eq!(g.ring_capacity, Some(4096));
        assert_eq!(
            (g.local_layers, g.full_layers, g.has_full_pool),
            (5, 1, true)
        );
        assert_eq!(g.ring_image_bytes, 83_886_080);
        assert_eq!(g.target_layers, 40);
        assert_eq!(
            (g.vocab_rows, g.public_vocab_size),
            (248_320, Some(248_077))
        );
        assert!(g.dflash2.is_none());
    }
}

#[test]
fn nested_and_legacy_layouts_parse_to_the_same_config() {
    for (nested, legacy) in [
        (
            examples::OFFICIAL_35B_DFLASH_DRAFT,
            examples::OFFICIAL_35B_DFLASH_DRAFT_LEGACY,
        ),
        (
            examples::OFFICIAL_27B_DFLASH2_DRAFT,
            examples::OFFICIAL_27B_DFLASH2_DRAFT_LEGACY,
        ),
    ] {
        let a = DraftConfig::from_json_str(nested, ParseMode::Strict).expect("nested");
        let b = DraftConfig::from_json_str(legacy, ParseMode::Strict).expect("legacy");
        assert_eq!(a.value, b.value);
        assert_eq!(a.value.block_size, Some(16));
    }
}

#[test]
fn transient_sizes_follow_k_and_b() {
    let g = geometry(
        examples::OFFICIAL_27B_DFLASH2_DRAFT,
        examples::QWEN35_27B_TARGET,
    );
    let t = g.transient_sizes(7, 1).expect("sizes");
    assert_eq!((t.block_width, t.concurrency), (8, 1));
    assert_eq!(t.block_token_ids, 8 * 4);
    assert_eq!(t.block_hidden, 8 * 5120 * 2);
    assert_eq!(t.block_query, 8 * 32 * 128 * 2);
    assert_eq!(t.query_block_kv, 5 * 8 * 8 * 128 * 4);
    assert_eq!(t.mlp_activations, 8 * 17408 * 4);
    assert_eq!(t.proposal_ids, 7 * 4);
    assert_eq!(t.verify_features, 8 * 5 * 5120 * 2);
    assert_eq!(t.candidate_ids, 7 * 16 * 4);
    assert_eq!(t.candidate_q, 7 * 16 * 4);
    assert_eq!(t.selector_hidden, 7 * 256 * 2);
    assert_eq!(t.conv_finish_delta, 8 * 2 * 320 * 2);
    let big = g.transient_sizes(15, 8).expect("sizes");
    assert_eq!(big.candidate_scores, 8 * 15 * 16 * 4);
    assert_eq!(big.block_hidden, 8 * 16 * 5120 * 2);
    assert!(big.total() > t.total());
    // Increasing K never changes the ring image.
    assert_eq!(g.ring_image_bytes, 40 << 20);

    let g35 = geometry(
        examples::OFFICIAL_35B_DFLASH_DRAFT,
        examples::QWEN35_35B_A3B_TARGET,
    );
    let t35 = g35.transient_sizes(7, 1).expect("sizes");
    assert_eq!(
        (
            t35.candidate_ids,
            t35.selector_hidden,
            t35.conv_prepared_input,
            t35.conv_finish_delta
        ),
        (0, 0, 0, 0)
    );
    assert_eq!(t35.query_block_kv, 6 * 8 * 8 * 128 * 4);
}

#[test]
fn legacy_ids_follow_the_reference_rule() {
    // Qwen3-8B-style: 36 target layers, 5 draft layers.
    assert_eq!(
        legacy_target_layer_ids(36, 5).expect("ids"),
        [1, 9, 17, 25, 33]
    );
    assert_eq!(
        legacy_target_layer_ids(40, 6).expect("ids"),
        [1, 8, 15, 23, 30, 37]
    );
    assert_eq!(
        legacy_target_layer_ids(64, 5).expect("ids"),
        [1, 16, 31, 46, 61]
    );
    assert_eq!(legacy_target_layer_ids(40, 1).expect("ids"), [20]);
    assert_eq!(legacy_target_layer_ids(41, 1).expect("ids"), [20]);
    assert!(legacy_target_layer_ids(40, 0).expect("ids").is_empty());
}

#[test]
fn legacy_ids_round_half_to_even_like_python() {
    // 7 layers, 3 draft layers: 1 + 3/2 = 2.5 -> 2 (half-away-from-zero would give 3).
    assert_eq!(legacy_target_layer_ids(7, 3).expect("ids"), [1, 2, 4]);
    // 9 layers, 3 draft layers: 1 + 5/2 = 3.5 -> 4.
    assert_eq!(legacy_target_layer_ids(9, 3).expect("ids"), [1, 4, 6]);
}

#[test]
fn legacy_ids_refuse_negative_values() {
    // 2 layers: end = -1, the third id would be 1 - 2 = -1.
    let err = legacy_target_layer_ids(2, 3).expect_err("negative id");
    assert!(matches!(err, ConfigError::OutOfRange { .. }), "{err:?}");
    assert_eq!(err.path(), "dflash_config.target_layer_ids[2]");
}

#[test]
fn official_ids_are_not_the_rule_applied_to_the_draft_layer_count() {
    // 35B-A3B: the published ids are the rule with 8 ids, not with its 6 draft layers.
    assert_eq!(
        legacy_target_layer_ids(40, 8).expect("ids"),
        [1, 6, 11, 16, 22, 27, 32, 37]
    );
    assert_ne!(
        legacy_target_layer_ids(40, 6).expect("ids"),
        [1, 6, 11, 16, 22, 27, 32, 37]
    );
    // 27B: no id count reproduces [5, 19, 33, 47, 61].
    for n in 1..=64 {
        assert_ne!(
            legacy_target_layer_ids(64, n).expect("ids"),
            [5, 19, 33, 47, 61]
        );
    }
}

#[test]
fn missing_dflash_config_derives_ids_from_the_draft_layer_count() {
    let mut d = doc(examples::OFFICIAL_35B_DFLASH_DRAFT_LEGACY);
    let mask = d["dflash_config"]["mask_token_id"].clone();
    del(&mut d, "/dflash_config");
    set(&mut d, "/mask_token_id", mask);
    let p = DraftConfig::from_json_str(&d.to_string(), ParseMode::Strict).expect("parses");
    assert_eq!(p.value.target_layer_ids, [1, 8, 15, 23, 30, 37]);
    assert_eq!(
        p.value.target_layer_ids_source,
        TargetLayerIdsSource::Derived
    );
    assert_eq!(p.value.mask_token_id, Some(248_070));
}

#[test]
fn top_level_ids_are_accepted_and_must_agree_with_nested_ones() {
    let mut d = doc(examples::OFFICIAL_27B_DFLASH2_DRAFT_LEGACY);
    let ids = d["dflash_config"]["target_layer_ids"].clone();
    del(&mut d, "/dflash_config/target_layer_ids");
    set(&mut d, "/target_layer_ids", ids);
    let p = DraftConfig::from_json_str(&d.to_string(), ParseMode::Strict).expect("parses");
    assert_eq!(p.value.target_layer_ids, [5, 19, 33, 47, 61]);
    assert_eq!(
        p.value.target_layer_ids_source,
        TargetLayerIdsSource::TopLevel
    );
    set(
        &mut d,
        "/dflash_config/target_layer_ids",
        json!([5, 19, 33, 47, 60]),
    );
    let err = DraftConfig::from_json_str(&d.to_string(), ParseMode::Lenient).expect_err("conflict");
    assert!(matches!(err, ConfigError::Conflict { .. }), "{err:?}");
    assert_eq!(err.path(), "dflash_config.target_layer_ids");
}

#[test]
fn unknown_fields_are_returned_in_lenient_mode_and_refused_in_strict_mode() {
    let mut d = doc(examples::OFFICIAL_35B_DFLASH_DRAFT);
    set(&mut d, "/new_top", json!(1));
    set(&mut d, "/dflash_config/new_nested", json!("x"));
    set(&mut d, "/rope_parameters/new_rope", json!([1]));
    // DFlash2-only fields in a DFlash config are not known either.
    set(&mut d, "/dflash_config/selector_rank", json!(256));
    let text = d.to_string();
    let p = DraftConfig::from_json_str(&text, ParseMode::Lenient).expect("lenient parses");
    let want = vec![
        UnknownField {
            path: "new_top".into(),
            value: json!(1),
        },
        UnknownField {
            path: "rope_parameters.new_rope".into(),
            value: json!([1]),
        },
        UnknownField {
            path: "dflash_config.new_nested".into(),
            value: json!("x"),
        },
        UnknownField {
            path: "dflash_config.selector_rank".into(),
            value: json!(256),
        },
    ];
    assert_eq!(p.unknown_fields, want);
    let err = DraftConfig::from_json_str(&text, ParseMode::Strict).expect_err("strict refuses");
    match err {
        ConfigError::UnknownFields { path, all } => {
            assert_eq!(path, "new_top");
            assert_eq!(all.len(), 4);
        }
        other => panic!("wrong variant {other:?}"),
    }
}

#[test]
fn neutral_math_fields_are_accepted() {
    let mut d = doc(examples::OFFICIAL_27B_DFLASH2_DRAFT);
    set(&mut d, "/is_causal", json!(false));
    set(&mut d, "/dflash_config/causal", json!(false));
    set(&mut d, "/final_logit_softcapping", json!(null));
    set(&mut d, "/output_multiplier", json!(1));
    set(&mut d, "/input_embedding_scale", json!(1.0));
    set(&mut d, "/sample_from_anchor", json!(false));
    set(&mut d, "/attention_sink_bias", json!(false));
    set(&mut d, "/use_aux_hidden_state", json!(false));
    let p = DraftConfig::from_json_str(&d.to_string(), ParseMode::Strict).expect("parses");
    assert_eq!(p.value.backend, Backend::DFlash2);
}

#[test]
fn absent_layer_types_follow_the_hugging_face_default() {
    let mut d = doc(examples::OFFICIAL_35B_DFLASH_DRAFT);
    del(&mut d, "/layer_types");
    set(&mut d, "/use_sliding_window", json!(false));
    let p = DraftConfig::from_json_str(&d.to_string(), ParseMode::Strict).expect("parses");
    assert_eq!(p.value.layer_types, vec![AttentionType::Full; 6]);

    set(&mut d, "/use_sliding_window", json!(true));
    set(&mut d, "/max_window_layers", json!(4));
    let p = DraftConfig::from_json_str(&d.to_string(), ParseMode::Strict).expect("parses");
    let mut want = vec![AttentionType::Full; 4];
    want.extend([AttentionType::Sliding; 2]);
    assert_eq!(p.value.layer_types, want);
}

#[test]
fn null_mask_token_parses_as_none() {
    let mut d = doc(examples::OFFICIAL_27B_DFLASH2_DRAFT);
    set(&mut d, "/dflash_config/mask_token_id", json!(null));
    let p = DraftConfig::from_json_str(&d.to_string(), ParseMode::Strict).expect("parses");
    assert_eq!(p.value.mask_token_id, None);
}

#[test]
fn tokenizer_count_is_max_id_plus_one() {
    assert_eq!(
        count_tokenizer_vocab(examples::TINY_TOKENIZER).expect("counts"),
        examples::TINY_TOKENIZER_VOCAB_SIZE
    );
    // A hole in the id space still counts; a duplicate listing counts once.
    let mut t = doc(examples::TINY_TOKENIZER);
    set(&mut t, "/added_tokens/2/id", json!(20));
    set(&mut t, "/model/vocab/abc", json!(9));
    assert_eq!(count_tokenizer_vocab(&t.to_string()).expect("counts"), 21);
    // Unigram: ids are array positions.
    let unigram =
        json!({"model": {"type": "Unigram", "vocab": [["a", -1.0], ["b", -2.0], ["c", -3.0]]}});
    assert_eq!(
        count_tokenizer_vocab(&unigram.to_string()).expect("counts"),
        3
    );
}

#[test]
fn public_vocab_is_unknown_until_given() {
    let t = TargetTextConfig::from_json_str(examples::QWEN35_27B_TARGET).expect("parses");
    assert_eq!(
        (t.hidden_size, t.num_hidden_layers, t.vocab_size),
        (5120, 64, 248_320)
    );
    assert_eq!(t.eos_token_ids, [248_046]);
    assert_eq!(t.model_type.as_deref(), Some("qwen3_5_text"));
    let err = t.public_vocab_size().expect_err("unknown");
    assert!(matches!(err, ConfigError::PublicVocabUnknown { .. }));
    let t = t
        .with_public_vocab_size(examples::QWEN35_PUBLIC_VOCAB_SIZE)
        .expect("fits");
    assert_eq!(t.public_vocab_size().expect("known"), 248_077);
}

#[test]
fn public_vocab_from_tokenizer_json() {
    let target = json!({"hidden_size": 64, "num_hidden_layers": 4, "vocab_size": 16, "eos_token_id": [10, 11]});
    let t = TargetTextConfig::from_json_str(&target.to_string())
        .expect("flat layout parses")
        .with_tokenizer_json(examples::TINY_TOKENIZER)
        .expect("counts");
    assert_eq!(t.public_vocab_size, Some(12));
    assert_eq!(t.eos_token_ids, [10, 11]);
}

#[test]
fn hand_built_configs_get_the_same_checks() {
    let mut d = DraftConfig::from_json_str(examples::OFFICIAL_35B_DFLASH_DRAFT, ParseMode::Strict)
        .expect("parses")
        .value;
    d.num_key_value_heads = 0;
    let t = TargetTextConfig::from_json_str(examples::QWEN35_35B_A3B_TARGET).expect("parses");
    let err = validate_pair(&d, &t).expect_err("refused");
    assert!(matches!(err, ConfigError::OutOfRange { .. }), "{err:?}");
    assert_eq!(err.path(), "num_key_value_heads");
    d.num_key_value_heads = 8;
    d.rope_theta = f64::NAN;
    let err = validate_pair(&d, &t).expect_err("refused");
    assert!(
        matches!(err, ConfigError::NonPositiveFloat { .. }),
        "{err:?}"
    );
}
