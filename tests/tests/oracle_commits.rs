//! A test proposer that proposes the target's own greedy tokens with a chosen probability
//! (random public tokens otherwise) drives long acceptances: every commit length N in 1..=W
//! happens, the output still equals plain greedy decoding, and cancellation commits N = 0.

use dflash_cli::{Fixture, demo_prompts};
use dflash_config::Backend as DraftBackend;
use dflash_e2e::{Strategy, plain_outputs, run_checked, shadow_engine};
use dflash_engine::{EngineError, Event, FinishReason, Request, Target, TargetError};

fn every_n(k: u32, rho: f64, max_new: usize) {
    let fx = Fixture::write(DraftBackend::DFlash).expect("fixture");
    let reqs: Vec<Request> = demo_prompts(6, 77 + u64::from(k))
        .into_iter()
        .map(|p| Request::greedy(p, max_new))
        .collect();
    let expected = plain_outputs(&fx, &reqs);
    let mut engine = shadow_engine(&fx, Strategy::Oracle { rho }, k, 3, 200, 5).expect("engine");
    let ids: Vec<_> = reqs
        .iter()
        .map(|r| engine.submit(r.clone()).expect("submit"))
        .collect();
    let c = run_checked(&mut engine, 0);
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(c.outputs[id], expected[i], "request {i}");
    }
    let w = k as usize + 1;
    let commits = &engine.stats().commits;
    for n in 1..=w {
        assert!(commits[n] > 0, "K={k}: no commit of N={n}: {commits:?}");
    }
    assert_eq!(commits[0], 0, "no cancellation, no N = 0");
    // Long acceptances really happened: the mean accepted per row-round is well above 0.
    let s = engine.stats();
    assert!(
        s.accepted as f64 / s.row_rounds as f64 > 1.0,
        "mean accepted {}",
        s.accepted as f64 / s.row_rounds as f64
    );
    assert_eq!(engine.held(), (0, 0));
}

#[test]
fn oracle_k4_commits_every_n_from_1_to_5() {
    every_n(4, 0.7, 80);
}

#[test]
fn oracle_k15_commits_every_n_from_1_to_16() {
    every_n(15, 0.88, 120);
}

#[test]
fn cancellation_commits_nothing_and_releases_the_request() {
    let fx = Fixture::write(DraftBackend::DFlash).expect("fixture");
    let reqs: Vec<Request> = demo_prompts(4, 3)
        .into_iter()
        .map(|p| Request::greedy(p, 40))
        .collect();
    let expected = plain_outputs(&fx, &reqs);
    let mut engine =
        shadow_engine(&fx, Strategy::Oracle { rho: 0.8 }, 4, 2, 100, 9).expect("engine");
    let ids: Vec<_> = reqs
        .iter()
        .map(|r| engine.submit(r.clone()).expect("submit"))
        .collect();
    // Request 3 is cancelled while queued: it never runs.
    engine.cancel(ids[3]).expect("cancel queued");
    let mut outputs: std::collections::HashMap<_, Vec<u32>> = Default::default();
    let mut finished = std::collections::HashMap::new();
    let mut sink = |e: &Event| match e {
        Event::Tokens { id, tokens, .. } => outputs.entry(*id).or_default().extend(tokens),
        Event::Finished { id, reason, .. } => {
            finished.insert(*id, *reason);
        }
    };
    // Two rounds, then cancel request 0 from a "frontend" handle.
    engine.step(&mut sink).expect("step");
    engine.step(&mut sink).expect("step");
    let seq0 = engine.sequence(ids[0]).expect("active");
    let frontier_before = engine.target().frontier(seq0).expect("frontier");
    let published_before = engine.continuation(ids[0]).expect("cont").output().to_vec();
    engine.cancel_handle(ids[0]).expect("handle").cancel();
    let step = engine.step(&mut sink).expect("step").expect("work");
    let row = step
        .rows
        .iter()
        .find(|r| r.id == ids[0])
        .expect("row of the cancelled request");
    assert_eq!(row.committed, 0, "cancellation previews N = 0");
    assert_eq!(row.finish, Some(FinishReason::Cancelled));
    assert!(!row.licensed.is_empty(), "the round still verified");
    assert!(matches!(
        engine.target().frontier(seq0),
        Err(TargetError::UnknownSequence { .. })
    ));
    assert!(frontier_before > 0);
    assert!(matches!(
        engine.continuation(ids[0]),
        Err(EngineError::UnknownRequest { .. })
    ));
    while engine.step(&mut sink).expect("step").is_some() {}
    assert_eq!(
        outputs[&ids[0]], published_before,
        "nothing published after cancel"
    );
    assert_eq!(finished[&ids[0]], FinishReason::Cancelled);
    assert_eq!(finished[&ids[3]], FinishReason::Cancelled);
    assert!(!outputs.contains_key(&ids[3]));
    for i in [1, 2] {
        assert_eq!(outputs[&ids[i]], expected[i], "request {i} is unaffected");
    }
    assert_eq!(engine.stats().commits[0], 1);
    assert_eq!(engine.held(), (0, 0));
}
