//! DFlash2 tree rounds (`startup.tree_nodes`) end to end on the trained pair: greedy tree
//! decoding publishes exactly plain greedy decoding for several node budgets, K and B; every
//! round's committed path follows the tree and the draft coverage stays equal to the target
//! frontier; on the same prompts and seeds a 32-node tree accepts at least as much per
//! row-round as the chain; sampled tree rounds run with the same invariants.

use dflash_cli::{Fixture, demo_prompts};
use dflash_config::Backend as DraftBackend;
use dflash_e2e::{
    Collected, assert_no_context_leak, options, plain_outputs, run_checked, tree_draft_engine,
};
use dflash_engine::{DraftProposer, Engine, Request, SamplingSettings, StopConditions};
use dflash_ops::Backend;
use dflash_testkit::ReferenceTarget;

/// A DFlash2 draft engine on the CPU with `nodes` tree nodes (`None`: chain rounds).
fn tree_engine(
    fx: &Fixture,
    k: u32,
    b: u32,
    nodes: Option<u32>,
    max_context: usize,
) -> Engine<ReferenceTarget, DraftProposer<'static>> {
    tree_draft_engine(fx, k, b, nodes, max_context).expect("engine")
}

fn requests(n: usize, seed: u64, budget: usize, sampling: Option<f32>) -> Vec<Request> {
    let eos = dflash_cli::target_geometry().eos_token_id;
    demo_prompts(n, seed)
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            let mut r = Request::greedy(p, budget + (i * 5) % 7);
            r.stop = StopConditions::eos(eos);
            if let Some(t) = sampling {
                r.sampling = SamplingSettings::sampling(t);
                r.seed = seed.wrapping_mul(31).wrapping_add(i as u64);
            }
            r
        })
        .collect()
}

/// Run `reqs` through `engine` (coverage checked after every step); every row's committed
/// path must follow its tree: node 0 first, each committed node the child of the previous.
fn run(
    engine: &mut Engine<ReferenceTarget, DraftProposer<'static>>,
    reqs: &[Request],
) -> (Collected, Vec<dflash_engine::RequestId>) {
    let ids: Vec<_> = reqs
        .iter()
        .map(|r| engine.submit(r.clone()).expect("submit"))
        .collect();
    let c = run_checked(engine, 3);
    for row in c.steps.iter().flat_map(|s| &s.rows) {
        assert_eq!(row.licensed.len(), row.accepted + 1);
        if row.tree_path.is_empty() {
            continue;
        }
        assert_eq!(row.tree_path.len(), row.accepted + 1, "{row:?}");
        assert_eq!(row.tree_path[0], 0);
        for (j, &v) in row.tree_path.iter().enumerate().skip(1) {
            assert_eq!(
                row.proposed[v - 1],
                row.licensed[j - 1],
                "the licensed token of node {v}"
            );
        }
    }
    assert_no_context_leak(engine.proposer());
    (c, ids)
}

/// Mean accepted proposals per row-round.
fn mean_accepted(c: &Collected) -> f64 {
    let rows: Vec<_> = c.steps.iter().flat_map(|s| &s.rows).collect();
    rows.iter().map(|r| r.accepted as f64).sum::<f64>() / rows.len().max(1) as f64
}

#[test]
fn tree_greedy_decoding_equals_plain_greedy_decoding() {
    let fx = Fixture::write(DraftBackend::DFlash2).expect("fixture");
    for (k, b, nodes) in [(4u32, 1u32, 5u32), (4, 3, 16), (7, 2, 32), (2, 1, 17)] {
        let reqs = requests(4, u64::from(k * 10 + nodes), 10, None);
        let expected = plain_outputs(&fx, &reqs);
        let max_context = reqs
            .iter()
            .map(|r| r.prompt.len() + r.max_new_tokens)
            .max()
            .unwrap_or(1);
        let mut engine = tree_engine(&fx, k, b, Some(nodes), max_context);
        let (c, ids) = run(&mut engine, &reqs);
        for (i, id) in ids.iter().enumerate() {
            assert_eq!(
                c.outputs.get(id).cloned().unwrap_or_default(),
                expected[i],
                "K={k} B={b} N={nodes} request {i}: tree output differs from plain greedy"
            );
        }
        let side = c
            .steps
            .iter()
            .flat_map(|s| &s.rows)
            .any(|r| r.tree_path.windows(2).any(|w| w[1] != w[0] + 1));
        if nodes > k + 1 {
            assert!(side, "K={k} N={nodes}: no round accepted a side node");
        }
    }
}

#[test]
fn tree_of_32_nodes_accepts_at_least_the_chain() {
    let fx = Fixture::write(DraftBackend::DFlash2).expect("fixture");
    let k = 7;
    let reqs = requests(6, 5, 16, None);
    let max_context = reqs
        .iter()
        .map(|r| r.prompt.len() + r.max_new_tokens)
        .max()
        .unwrap_or(1);
    let mut means = Vec::new();
    for nodes in [None, Some(k + 1), Some(16), Some(32)] {
        let mut engine = tree_engine(&fx, k, 2, nodes, max_context);
        let (c, _) = run(&mut engine, &reqs);
        means.push((nodes, mean_accepted(&c)));
    }
    eprintln!("mean accepted per row-round (nodes, mean): {means:?}");
    let chain = means[0].1;
    assert_eq!(
        means[1].1, chain,
        "a tree of K + 1 nodes is the chain: {means:?}"
    );
    assert!(
        means[3].1 >= chain,
        "32 nodes accept less than the chain: {means:?}"
    );
}

#[test]
fn tree_sampled_rounds_keep_the_invariants() {
    let fx = Fixture::write(DraftBackend::DFlash2).expect("fixture");
    let reqs = requests(3, 9, 12, Some(0.8));
    let max_context = reqs
        .iter()
        .map(|r| r.prompt.len() + r.max_new_tokens)
        .max()
        .unwrap_or(1);
    let mut a = tree_engine(&fx, 5, 3, Some(24), max_context);
    let (ca, ids_a) = run(&mut a, &reqs);
    // The same requests again: the same outputs (every draw is keyed by seed and position).
    let mut b = tree_engine(&fx, 5, 3, Some(24), max_context);
    let (cb, ids_b) = run(&mut b, &reqs);
    for (x, y) in ids_a.iter().zip(&ids_b) {
        assert_eq!(ca.outputs.get(x), cb.outputs.get(y));
        assert!(ca.finished.contains_key(x));
    }
}

#[test]
fn tree_options_are_checked_at_startup() {
    let fx = Fixture::write(DraftBackend::DFlash).expect("fixture");
    let be = Backend::cpu();
    let mut o = options(fx.backend(), 4, 1, 64);
    o.startup.tree_nodes = Some(8);
    let Err(err) = Engine::with_draft(
        fx.target().expect("target"),
        fx.draft(&be).expect("draft"),
        fx.parts(&be).expect("parts"),
        &o,
    ) else {
        panic!("a DFlash tree is refused");
    };
    assert!(err.to_string().contains("tree"), "{err}");
    let fx2 = Fixture::write(DraftBackend::DFlash2).expect("fixture");
    let mut o = options(fx2.backend(), 4, 1, 64);
    o.startup.tree_nodes = Some(4); // below K + 1
    let Err(err) = Engine::with_draft(
        fx2.target().expect("target"),
        fx2.draft(&be).expect("draft"),
        fx2.parts(&be).expect("parts"),
        &o,
    ) else {
        panic!("fewer nodes than the chain is refused");
    };
    assert!(err.to_string().contains("tree_nodes"), "{err}");
}

/// Forks and checkpoints between tree rounds keep the coverage invariant, and every copy
/// continues exactly as plain greedy decoding of its request does.
#[test]
fn tree_forks_and_checkpoints_continue_as_plain_greedy() {
    let fx = Fixture::write(DraftBackend::DFlash2).expect("fixture");
    let reqs = requests(1, 21, 24, None);
    let expected = plain_outputs(&fx, &reqs);
    let max_context = reqs[0].prompt.len() + reqs[0].max_new_tokens;
    let mut engine = tree_engine(&fx, 5, 3, Some(20), max_context);
    let id = engine.submit(reqs[0].clone()).expect("submit");
    let mut outputs: std::collections::HashMap<_, Vec<u32>> = Default::default();
    // One step; its published tokens into `outputs`; whether a round or admission ran.
    let step = |engine: &mut Engine<ReferenceTarget, DraftProposer<'static>>,
                outputs: &mut std::collections::HashMap<_, Vec<u32>>| {
        let mut events = Vec::new();
        let ran = engine
            .step(&mut |e: &dflash_engine::Event| events.push(e.clone()))
            .expect("step")
            .is_some();
        for e in events {
            if let dflash_engine::Event::Tokens { id, tokens, .. } = e {
                outputs.entry(id).or_default().extend(tokens);
            }
        }
        ran
    };
    // The admission step and one tree round at least, then a fork and an image.
    for _ in 0..2 {
        step(&mut engine, &mut outputs);
    }
    dflash_e2e::check_coverage(&mut engine);
    let fork = engine.fork(id, None).expect("fork");
    let image = engine.checkpoint(id).expect("checkpoint");
    let restored = engine.restore(&image).expect("restore");
    let before = outputs.get(&id).cloned().unwrap_or_default();
    outputs.insert(fork, before.clone());
    outputs.insert(restored, before);
    while step(&mut engine, &mut outputs) {
        dflash_e2e::check_coverage(&mut engine);
    }
    for r in [id, fork, restored] {
        assert_eq!(outputs.get(&r), Some(&expected[0]), "{r}");
    }
    assert_no_context_leak(engine.proposer());
}

/// After a warm-up round a tree round allocates nothing on the backend: the lattice gather,
/// the verification buffers (sized for N columns) and the path's feature compaction are all
/// planned at startup.
#[test]
fn tree_rounds_allocate_nothing_after_warmup() {
    let fx = Fixture::write(DraftBackend::DFlash2).expect("fixture");
    let reqs = requests(4, 17, 12, Some(0.9));
    let mut engine = tree_engine(&fx, 7, 4, Some(24), 256);
    for r in &reqs {
        engine.submit(r.clone()).expect("submit");
    }
    let be = engine.backend().clone();
    let mut sink = |_: &dflash_engine::Event| {};
    engine.step(&mut sink).expect("warm-up round");
    let warm = be.allocations();
    let mut rounds = 0;
    while let Some(step) = engine.step(&mut sink).expect("round") {
        rounds += 1;
        assert_eq!(
            be.allocations(),
            warm,
            "a tree round of {} rows allocated",
            step.rows.len()
        );
    }
    assert!(rounds >= 3, "{rounds} rounds");
}
