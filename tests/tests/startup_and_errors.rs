//! Startup selection and planning, typed refusals (options, memory, draft/target fit,
//! requests, slots, images) that leave the engine unchanged, and the event stream.

use dflash_cli::{Fixture, demo_prompts, target_geometry};
use dflash_config::{Backend as DraftBackend, ConfigError, ProposalHead, StartupOptions};
use dflash_e2e::{draft_engine, options, run_checked};
use dflash_engine::{
    DraftProposer, Engine, EngineError, EngineOptions, Event, FinishReason, Request,
    SamplingSettings, StopConditions,
};
use dflash_ops::Backend;
use dflash_testkit::ReferenceTarget;

fn try_engine(
    fx: &Fixture,
    opts: &EngineOptions,
) -> Result<Engine<ReferenceTarget, DraftProposer<'static>>, EngineError> {
    let be = Backend::cpu();
    Engine::with_draft(
        fx.target().expect("target"),
        fx.draft(&be).expect("draft"),
        fx.parts(&be).expect("parts"),
        opts,
    )
}

#[test]
fn startup_refuses_bad_options_with_typed_errors() {
    let fx = Fixture::write(DraftBackend::DFlash).expect("fixture");
    let ok = options(DraftBackend::DFlash, 4, 2, 64);
    let e = try_engine(&fx, &options(DraftBackend::DFlash2, 4, 2, 64)).expect_err("backend");
    assert!(
        matches!(e, EngineError::Config(ConfigError::BackendMismatch { .. })),
        "{e}"
    );
    for (k, b, path) in [
        (0, 2, "startup.draft_count"),
        (16, 2, "startup.draft_count"),
        (4, 0, "startup.concurrency"),
        (4, 9, "startup.concurrency"),
    ] {
        let e = try_engine(&fx, &options(DraftBackend::DFlash, k, b, 64)).expect_err("range");
        match e {
            EngineError::Config(ConfigError::OutOfRange { path: p, .. }) => assert_eq!(p, path),
            other => panic!("K={k} B={b}: {other}"),
        }
    }
    let e = try_engine(
        &fx,
        &EngineOptions {
            max_context: 0,
            ..ok
        },
    )
    .expect_err("max_context");
    assert!(
        matches!(
            e,
            EngineError::InvalidOption {
                option: "max_context",
                ..
            }
        ),
        "{e}"
    );
    let e = try_engine(
        &fx,
        &EngineOptions {
            startup: StartupOptions {
                proposal_head: ProposalHead::Indexed { rows: 64 },
                ..ok.startup
            },
            ..ok
        },
    )
    .expect_err("head");
    assert!(
        matches!(
            e,
            EngineError::TargetMismatch {
                what: "proposal head",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn memory_is_planned_up_front_and_checked_against_the_budget() {
    let fx = Fixture::write(DraftBackend::DFlash).expect("fixture");
    let small = try_engine(&fx, &options(DraftBackend::DFlash, 1, 1, 64)).expect("engine");
    let big = try_engine(&fx, &options(DraftBackend::DFlash, 15, 8, 64)).expect("engine");
    let (ps, pb) = (small.memory_plan(), big.memory_plan());
    for item in [
        "draft weights",
        "draft target parts",
        "context pools",
        "draft workspace",
        "verify workspace",
    ] {
        assert!(pb.bytes(item) > 0, "{item} planned");
    }
    // The target's verify outputs are the target's own (lent through Target::verified).
    assert_eq!(pb.bytes("target verify logits"), 0);
    assert_eq!(
        ps.bytes("draft weights"),
        pb.bytes("draft weights"),
        "K, B do not change weights"
    );
    assert!(pb.bytes("draft workspace") > ps.bytes("draft workspace"));
    assert!(
        pb.bytes("context pools") > ps.bytes("context pools"),
        "B lanes"
    );
    let need = pb.total();
    let e = try_engine(
        &fx,
        &EngineOptions {
            memory_budget: need - 1,
            ..options(DraftBackend::DFlash, 15, 8, 64)
        },
    )
    .expect_err("budget");
    match e {
        EngineError::InsufficientMemory {
            need: n, budget, ..
        } => {
            assert_eq!((n, budget), (need, need - 1))
        }
        other => panic!("{other}"),
    }
    try_engine(
        &fx,
        &EngineOptions {
            memory_budget: need,
            ..options(DraftBackend::DFlash, 15, 8, 64)
        },
    )
    .expect("exactly enough memory");
}

#[test]
fn a_draft_that_does_not_fit_the_target_is_refused() {
    let fx = Fixture::write(DraftBackend::DFlash2).expect("fixture");
    let be = Backend::cpu();
    let other_ids =
        ReferenceTarget::load(&fx.target_dir(), &[0, 1, 3], target_geometry().public_vocab)
            .expect("target");
    let e = Engine::with_draft(
        other_ids,
        fx.draft(&be).expect("draft"),
        fx.parts(&be).expect("parts"),
        &options(DraftBackend::DFlash2, 4, 2, 64),
    )
    .expect_err("capture ids");
    assert!(
        matches!(
            e,
            EngineError::TargetMismatch {
                what: "captured block ids (in recorded order)",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn bad_requests_are_refused_and_nothing_is_queued() {
    let fx = Fixture::write(DraftBackend::DFlash).expect("fixture");
    let mut e = draft_engine(&fx, 4, 2, 32).expect("engine");
    let p = demo_prompts(1, 1).remove(0)[..8].to_vec();
    let cases: Vec<(Request, &str)> = vec![
        (Request::greedy(Vec::new(), 4), "empty"),
        (Request::greedy(p.clone(), 0), "budget"),
        (Request::greedy(p.clone(), 40), "too long"),
        (Request::greedy(vec![1, 512], 4), "token"),
        (
            Request {
                stop: StopConditions::eos(500),
                ..Request::greedy(p.clone(), 4)
            },
            "stop token",
        ),
        (
            Request {
                sampling: SamplingSettings::sampling(-1.0),
                ..Request::greedy(p.clone(), 4)
            },
            "temperature",
        ),
    ];
    for (r, what) in cases {
        let err = e.submit(r).expect_err(what);
        let ok = match what {
            "empty" => matches!(err, EngineError::EmptyPrompt),
            "budget" => matches!(err, EngineError::ZeroBudget),
            "too long" => matches!(err, EngineError::RequestTooLong { limit: 32, .. }),
            "token" => matches!(
                err,
                EngineError::PromptTokenOutOfRange {
                    index: 1,
                    token: 512,
                    ..
                }
            ),
            "stop token" => matches!(err, EngineError::StopTokenOutOfRange { token: 500, .. }),
            _ => matches!(
                err,
                EngineError::InvalidSampling {
                    setting: "temperature",
                    ..
                }
            ),
        };
        assert!(ok, "{what}: {err}");
    }
    assert_eq!(e.queued(), 0);
    assert!(e.is_idle());
}

#[test]
fn slots_images_and_unknown_ids_are_typed_errors_without_state_change() {
    let fx = Fixture::write(DraftBackend::DFlash).expect("fixture");
    let mut e = draft_engine(&fx, 4, 2, 64).expect("engine");
    let ps: Vec<Vec<u32>> = demo_prompts(2, 5)
        .into_iter()
        .map(|p| p[..20].to_vec())
        .collect();
    let a = e.submit(Request::greedy(ps[0].clone(), 30)).expect("a");
    let b = e.submit(Request::greedy(ps[1].clone(), 30)).expect("b");
    e.step(&mut |_| {}).expect("step");
    e.step(&mut |_| {}).expect("step");
    // Both slots are taken.
    assert!(matches!(
        e.fork(a, None),
        Err(EngineError::Busy { capacity: 2 })
    ));
    let img = e.checkpoint(a).expect("checkpoint");
    assert!(matches!(e.restore(&img), Err(EngineError::Busy { .. })));
    let held = e.held();
    let cont_b = e.release(b).expect("release b");
    assert!(matches!(
        e.checkpoint(b),
        Err(EngineError::UnknownRequest { .. })
    ));
    assert!(cont_b.output().len() >= 2);

    // Coverage disagreement between the parts of an image is refused.
    e.step(&mut |_| {}).expect("step");
    let later = e.checkpoint(a).expect("later checkpoint");
    assert!(later.frontier() > img.frontier());
    let mut mixed = e.checkpoint(a).expect("checkpoint");
    mixed.continuation = img.continuation.clone();
    let before = e.held();
    let err = e.restore(&mixed).expect_err("mixed image");
    assert!(
        matches!(err, EngineError::ImageCoverageMismatch { .. }),
        "{err}"
    );
    // Continuation metadata that does not match the prompt is refused.
    let mut bad = e.checkpoint(a).expect("checkpoint");
    bad.continuation.tokens[0] ^= 1;
    let err = e.restore(&bad).expect_err("bad tokens");
    assert!(matches!(err, EngineError::ImageMismatch { .. }), "{err}");
    assert_eq!(e.held(), before, "refused restores hold nothing");
    assert!(held.0 == 2 && before.0 == 1);

    // A good image restores and continues exactly as the original.
    let r = e.restore(&img).expect("restore");
    let c = run_checked(&mut e, 0);
    let fin_a = e.finished(a).expect("a").output.clone();
    let fin_r = e.finished(r).expect("r").output.clone();
    assert_eq!(fin_a, fin_r, "restored request continues identically");
    assert!(c.finished.contains_key(&r));
    assert_eq!(e.held(), (0, 0));
}

#[test]
fn events_stream_every_token_in_position_order() {
    let fx = Fixture::write(DraftBackend::DFlash2).expect("fixture");
    let mut e = draft_engine(&fx, 3, 3, 64).expect("engine");
    let eos = target_geometry().eos_token_id;
    let reqs: Vec<Request> = demo_prompts(5, 8)
        .into_iter()
        .map(|p| Request {
            stop: StopConditions::eos(eos),
            ..Request::sampled(p, 12, 0.8, 3)
        })
        .collect();
    let ids: Vec<_> = reqs
        .iter()
        .map(|r| e.submit(r.clone()).expect("submit"))
        .collect();
    let mut events = Vec::new();
    e.run(&mut |ev: &Event| events.push(ev.clone()))
        .expect("run");
    for (i, id) in ids.iter().enumerate() {
        let mut next = reqs[i].prompt.len();
        let mut ended = false;
        let mut out = Vec::new();
        for ev in &events {
            match ev {
                Event::Tokens {
                    id: x,
                    position,
                    tokens,
                } if x == id => {
                    assert!(!ended, "no token after Finished");
                    assert_eq!(*position, next, "{id}: contiguous positions");
                    next += tokens.len();
                    out.extend_from_slice(tokens);
                }
                Event::Finished {
                    id: x,
                    reason,
                    generated,
                } if x == id => {
                    assert!(!ended);
                    ended = true;
                    assert_eq!(*generated, out.len());
                    assert!(matches!(
                        reason,
                        FinishReason::Budget | FinishReason::StopToken(_)
                    ));
                }
                _ => {}
            }
        }
        assert!(ended, "{id} finished");
        assert_eq!(e.finished(*id).expect("finished").output, out);
    }
}

/// `startup.tree_nodes` starts a DFlash2 draft engine (tree rounds), and is refused at
/// startup, naming the option, for a proposer that drafts chains only (never a chain run in
/// its place, never a failure at the first round).
#[test]
fn tree_nodes_start_a_tree_engine_and_are_refused_for_a_chain_only_proposer() {
    let fx = Fixture::write(DraftBackend::DFlash2).expect("fixture");
    let mut opts = options(DraftBackend::DFlash2, 7, 2, 64);
    opts.startup.tree_nodes = Some(16);
    try_engine(&fx, &opts).expect("a DFlash2 tree engine starts");
    let shadow = dflash_e2e::ShadowProposer::new(
        fx.target().expect("target"),
        dflash_e2e::Strategy::Oracle { rho: 1.0 },
        7,
        2,
        1,
    )
    .expect("shadow");
    let e = Engine::new(fx.target().expect("target"), shadow, Backend::cpu(), &opts)
        .expect_err("tree, a chain-only proposer");
    assert!(
        matches!(
            e,
            EngineError::Unsupported {
                option: "startup.tree_nodes",
                ..
            }
        ),
        "{e}"
    );
    opts.startup.tree_nodes = None;
    try_engine(&fx, &opts).expect("the same options without a tree start");
}

#[test]
fn the_memory_plan_counts_exactly_the_draft_workspace_it_allocates() {
    for backend in [DraftBackend::DFlash, DraftBackend::DFlash2] {
        let fx = Fixture::write(backend).expect("fixture");
        let be = Backend::cpu();
        for (k, b) in [(1, 1), (7, 3), (15, 8)] {
            let opts = options(backend, k, b, 96);
            let (model, parts) = (fx.draft(&be).expect("draft"), fx.parts(&be).expect("parts"));
            let (_, _, plan) = DraftProposer::plan(&model, &parts, &opts).expect("plan");
            let proposer = DraftProposer::new(model, parts, &opts).expect("proposer");
            assert_eq!(
                plan.bytes("draft workspace"),
                proposer.workspace().bytes(),
                "{backend:?} K={k} B={b}"
            );
        }
    }
}
