//! Startup option checks against the official geometries.

mod common;

use common::{doc, set};
use dflash_config::{
    Backend, ConfigError, DraftConfig, Geometry, ParseMode, ProposalHead, StartupOptions,
    TargetTextConfig, examples, validate_pair,
};
use serde_json::json;

fn geometry(draft: &str, target: &str, public: Option<u32>) -> Geometry {
    let d = DraftConfig::from_json_str(draft, ParseMode::Strict).expect("draft parses");
    let mut t = TargetTextConfig::from_json_str(target).expect("target parses");
    if let Some(n) = public {
        t = t.with_public_vocab_size(n).expect("fits");
    }
    validate_pair(&d.value, &t).expect("pair validates")
}

fn dflash2() -> Geometry {
    geometry(
        examples::OFFICIAL_27B_DFLASH2_DRAFT,
        examples::QWEN35_27B_TARGET,
        Some(examples::QWEN35_PUBLIC_VOCAB_SIZE),
    )
}

fn dflash() -> Geometry {
    geometry(
        examples::OFFICIAL_35B_DFLASH_DRAFT,
        examples::QWEN35_35B_A3B_TARGET,
        Some(examples::QWEN35_PUBLIC_VOCAB_SIZE),
    )
}

fn err_of(opts: StartupOptions, g: &Geometry) -> ConfigError {
    opts.validate(g).expect_err("options must be refused")
}

#[test]
fn defaults_validate_and_resolve_the_config_mask() {
    let s = StartupOptions::new(Backend::DFlash2, 7)
        .validate(&dflash2())
        .expect("valid");
    assert_eq!((s.draft_count, s.block_width, s.concurrency), (7, 8, 1));
    assert_eq!(s.mask_token_id, 248_070);
    assert_eq!(s.proposal_rows, 248_077);
    assert_eq!(s.transient.candidate_ids, 7 * 16 * 4);
}

#[test]
fn extremes_of_every_range_are_accepted() {
    let g = dflash2();
    for (k, b, tree) in [
        (1, 1, None),
        (15, 8, Some(16)),
        (7, 4, Some(8)),
        (7, 4, Some(32)),
    ] {
        let o = StartupOptions {
            concurrency: b,
            tree_nodes: tree,
            proposal_head: ProposalHead::Indexed { rows: 131_072 },
            ..StartupOptions::new(Backend::DFlash2, k)
        };
        let s = o.validate(&g).expect("valid");
        assert_eq!(s.proposal_rows, 131_072);
    }
}

#[test]
fn draft_count_outside_1_to_15_is_refused() {
    for k in [0, 16, u32::MAX] {
        let e = err_of(StartupOptions::new(Backend::DFlash, k), &dflash());
        assert!(matches!(e, ConfigError::OutOfRange { .. }), "{e:?}");
        assert_eq!(e.path(), "startup.draft_count");
    }
}

#[test]
fn concurrency_outside_1_to_8_is_refused() {
    for b in [0, 9] {
        let o = StartupOptions {
            concurrency: b,
            ..StartupOptions::new(Backend::DFlash, 7)
        };
        let e = err_of(o, &dflash());
        assert!(matches!(e, ConfigError::OutOfRange { .. }), "{e:?}");
        assert_eq!(e.path(), "startup.concurrency");
    }
}

#[test]
fn backend_must_match_the_checkpoint() {
    let e = err_of(StartupOptions::new(Backend::DFlash2, 7), &dflash());
    assert!(
        matches!(
            e,
            ConfigError::BackendMismatch {
                expected: Backend::DFlash,
                found: Backend::DFlash2,
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(e.path(), "startup.backend");
}

#[test]
fn trees_are_dflash2_only_and_bounded() {
    let o = StartupOptions {
        tree_nodes: Some(16),
        ..StartupOptions::new(Backend::DFlash, 7)
    };
    let e = err_of(o, &dflash());
    assert!(
        matches!(e, ConfigError::TreeNeedsDFlash2 { found: 16, .. }),
        "{e:?}"
    );
    assert_eq!(e.path(), "startup.tree_nodes");
    for (k, n) in [(7, 7), (7, 33), (1, 18), (1, 1)] {
        let o = StartupOptions {
            tree_nodes: Some(n),
            ..StartupOptions::new(Backend::DFlash2, k)
        };
        let e = err_of(o, &dflash2());
        assert!(
            matches!(e, ConfigError::OutOfRange { .. }),
            "K={k} N={n}: {e:?}"
        );
        assert_eq!(e.path(), "startup.tree_nodes");
    }
    for (k, n) in [(1, 2), (1, 17), (2, 32), (15, 16), (7, 8)] {
        let o = StartupOptions {
            tree_nodes: Some(n),
            ..StartupOptions::new(Backend::DFlash2, k)
        };
        assert!(o.validate(&dflash2()).is_ok(), "K={k} N={n}");
    }
}

#[test]
fn indexed_head_rows_must_fit_the_public_vocabulary() {
    for (g, rows) in [(dflash(), 0), (dflash(), 248_078), (dflash2(), 15)] {
        let backend = g.backend;
        let o = StartupOptions {
            proposal_head: ProposalHead::Indexed { rows },
            ..StartupOptions::new(backend, 7)
        };
        let e = err_of(o, &g);
        assert!(matches!(e, ConfigError::OutOfRange { .. }), "{e:?}");
        assert_eq!(e.path(), "startup.proposal_head.rows");
    }
    let o = StartupOptions {
        proposal_head: ProposalHead::Indexed { rows: 1 },
        ..StartupOptions::new(Backend::DFlash, 7)
    };
    assert!(
        o.validate(&dflash()).is_ok(),
        "DFlash takes a 1-row shortlist"
    );
}

#[test]
fn unknown_public_vocabulary_is_a_typed_error() {
    let g = geometry(
        examples::OFFICIAL_35B_DFLASH_DRAFT,
        examples::QWEN35_35B_A3B_TARGET,
        None,
    );
    let e = err_of(StartupOptions::new(Backend::DFlash, 7), &g);
    assert!(matches!(e, ConfigError::PublicVocabUnknown { .. }), "{e:?}");
}

#[test]
fn mask_token_override_resolves_null_and_must_not_contradict() {
    let mut d = doc(examples::OFFICIAL_27B_DFLASH2_DRAFT);
    set(&mut d, "/dflash_config/mask_token_id", json!(null));
    let g = geometry(
        &d.to_string(),
        examples::QWEN35_27B_TARGET,
        Some(examples::QWEN35_PUBLIC_VOCAB_SIZE),
    );
    let e = err_of(StartupOptions::new(Backend::DFlash2, 7), &g);
    assert!(matches!(e, ConfigError::MaskTokenUnknown { .. }), "{e:?}");
    assert_eq!(e.path(), "startup.mask_token_id");

    let o = StartupOptions {
        mask_token_id: Some(248_070),
        ..StartupOptions::new(Backend::DFlash2, 7)
    };
    assert_eq!(o.validate(&g).expect("valid").mask_token_id, 248_070);

    let o = StartupOptions {
        mask_token_id: Some(248_320),
        ..StartupOptions::new(Backend::DFlash2, 7)
    };
    let e = err_of(o, &g);
    assert!(
        matches!(e, ConfigError::MaskTokenOutOfRange { .. }),
        "{e:?}"
    );
    assert_eq!(e.path(), "startup.mask_token_id");

    // The official config states 248070: an equal override is fine, a different one is not.
    let o = StartupOptions {
        mask_token_id: Some(248_070),
        ..StartupOptions::new(Backend::DFlash2, 7)
    };
    assert!(o.validate(&dflash2()).is_ok());
    let o = StartupOptions {
        mask_token_id: Some(248_069),
        ..StartupOptions::new(Backend::DFlash2, 7)
    };
    let e = err_of(o, &dflash2());
    assert!(matches!(e, ConfigError::Conflict { .. }), "{e:?}");
    assert_eq!(e.path(), "startup.mask_token_id");
}
