//! A request's tokens never depend on which other requests share its rounds: seeded
//! stochastic requests (temperature, top-p, repetition penalty, each with its own seed and stop
//! conditions) decoded alone with B = 1 and decoded together with B = 8 (joining and leaving
//! at different rounds) publish identical tokens, for both backends.

use std::collections::HashMap;

use dflash_cli::{Fixture, demo_prompts, target_geometry};
use dflash_config::Backend as DraftBackend;
use dflash_e2e::{assert_no_context_leak, draft_engine, run_checked};
use dflash_engine::{Request, SamplingSettings, StopConditions};

fn requests() -> Vec<Request> {
    let eos = target_geometry().eos_token_id;
    demo_prompts(12, 99)
        .into_iter()
        .enumerate()
        .map(|(i, prompt)| Request {
            prompt,
            max_new_tokens: 6 + (i * 5) % 19,
            sampling: SamplingSettings {
                temperature: [0.0, 0.7, 1.0, 1.3][i % 4],
                top_p: if i % 3 == 0 { 0.9 } else { 1.0 },
                repetition_penalty: if i % 2 == 0 { 1.2 } else { 1.0 },
                ..SamplingSettings::GREEDY
            },
            seed: 1000 + i as u64,
            stop: StopConditions {
                // Every third request stops at a common letter (so some stop early).
                stop_tokens: vec![
                    eos,
                    if i % 3 == 0 {
                        u32::from(b"etao"[(i / 3) % 4])
                    } else {
                        (i as u32 * 37) % 256
                    },
                ],
                stop_sequences: Vec::new(),
            },
        })
        .collect()
}

fn check(backend: DraftBackend) {
    let fx = Fixture::write(backend).expect("fixture");
    let reqs = requests();
    let k = 4;
    let mut alone = Vec::new();
    for r in &reqs {
        let mut e = draft_engine(&fx, k, 1, 128).expect("engine");
        let id = e.submit(r.clone()).expect("submit");
        let c = run_checked(&mut e, 0);
        alone.push(c.outputs.get(&id).cloned().unwrap_or_default());
    }
    let mut together = draft_engine(&fx, k, 8, 128).expect("engine");
    let ids: Vec<_> = reqs
        .iter()
        .map(|r| together.submit(r.clone()).expect("submit"))
        .collect();
    let c = run_checked(&mut together, 3);
    let mut sizes: HashMap<usize, usize> = HashMap::new();
    for s in &c.steps {
        *sizes.entry(s.rows.len()).or_default() += 1;
    }
    assert!(
        sizes.len() >= 3,
        "the batch changes size as requests join and leave: {sizes:?}"
    );
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(
            c.outputs.get(id).cloned().unwrap_or_default(),
            alone[i],
            "{backend:?}: request {i} alone vs in a batch of 8"
        );
    }
    assert!(
        alone
            .iter()
            .enumerate()
            .any(|(i, o)| o.len() < reqs[i].max_new_tokens),
        "some request stops early"
    );
    assert_no_context_leak(together.proposer());
}

#[test]
fn dflash_tokens_do_not_depend_on_the_batch() {
    check(DraftBackend::DFlash);
}

#[test]
fn dflash2_tokens_do_not_depend_on_the_batch() {
    check(DraftBackend::DFlash2);
}
