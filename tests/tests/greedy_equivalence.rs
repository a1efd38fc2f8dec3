//! Greedy speculative decoding publishes exactly the tokens of plain greedy target decoding,
//! for both backends, K in {1, 4, 15} and B in {1, 3, 8}, over many prompts with stop tokens,
//! stop sequences and budgets that cut rounds in the middle; the draft context coverage equals
//! the committed target frontier after every step and after every materialize; nothing leaks.
//!
//! The drafts are the trained ones, so the real proposer drives multi-row commits: with K >= 4
//! at least 30% of the row-rounds commit N >= 3 rows (a random draft commits N = 1 almost
//! always, which would leave the commit of several rows, the pending features of several
//! columns and the draft positions after a long commit untested).

use dflash_cli::{Fixture, demo_prompts};
use dflash_config::Backend as DraftBackend;
use dflash_e2e::{assert_no_context_leak, draft_engine, plain_outputs, run_checked};
use dflash_engine::{Request, StopConditions};

const PROMPTS: usize = 10;

/// Requests with budgets 4..=23 tokens; a third stop at a token taken from the middle of
/// their plain output, a third at a two-token sequence from it (so stops land inside rounds).
fn requests(fx: &Fixture, seed: u64) -> Vec<Request> {
    let eos = dflash_cli::target_geometry().eos_token_id;
    let mut reqs: Vec<Request> = demo_prompts(PROMPTS, seed)
        .into_iter()
        .enumerate()
        .map(|(i, p)| Request {
            stop: StopConditions::eos(eos),
            ..Request::greedy(p, 12 + (i * 7 + seed as usize) % 20)
        })
        .collect();
    let plain = plain_outputs(fx, &reqs);
    for (i, (r, out)) in reqs.iter_mut().zip(&plain).enumerate() {
        let mid = out.len() / 2;
        if out.len() >= 4 {
            match i % 3 {
                1 => r.stop.stop_tokens.push(out[mid]),
                2 => r.stop.stop_sequences.push(out[mid..mid + 2].to_vec()),
                _ => {}
            }
        }
    }
    reqs
}

fn check(backend: DraftBackend, k: u32) {
    let fx = Fixture::write(backend).expect("fixture");
    let (mut long, mut row_rounds) = (0usize, 0usize);
    for (bi, b) in [1u32, 3, 8].into_iter().enumerate() {
        let reqs = requests(&fx, 11 * u64::from(k) + bi as u64);
        let expected = plain_outputs(&fx, &reqs);
        let max_context = reqs
            .iter()
            .map(|r| r.prompt.len() + r.max_new_tokens)
            .max()
            .unwrap_or(1);
        let mut engine = draft_engine(&fx, k, b, max_context).expect("engine");
        let ids: Vec<_> = reqs
            .iter()
            .map(|r| engine.submit(r.clone()).expect("submit"))
            .collect();
        let c = run_checked(&mut engine, 2);
        let mut stopped_mid = 0;
        for (i, id) in ids.iter().enumerate() {
            let got = c.outputs.get(id).cloned().unwrap_or_default();
            assert_eq!(
                got, expected[i],
                "{backend:?} K={k} B={b} request {i}: speculative output differs from plain greedy"
            );
            assert!(c.finished.contains_key(id), "request {i} finished");
            if got.len() < reqs[i].max_new_tokens {
                stopped_mid += 1;
            }
        }
        assert!(stopped_mid > 0, "some requests stop before their budget");
        assert!(
            c.steps.iter().all(|s| s.rows.len() <= b as usize),
            "a round holds at most B rows"
        );
        assert!(
            c.steps
                .iter()
                .any(|s| s.rows.len() == (b as usize).min(PROMPTS)),
            "rounds fill up to B rows"
        );
        // P never exceeds K, and the budget bounds every commit.
        for s in &c.steps {
            for r in &s.rows {
                assert!(r.proposed.len() <= k as usize);
                assert_eq!(r.licensed.len(), r.accepted + 1);
                assert!(r.committed >= 1 && r.committed <= r.licensed.len());
                row_rounds += 1;
                long += usize::from(r.committed >= 3);
            }
        }
        assert_eq!(engine.held(), (0, 0), "sequences and slots released");
        assert_no_context_leak(engine.proposer());
    }
    if k >= 4 {
        assert!(
            10 * long >= 3 * row_rounds,
            "{backend:?} K={k}: only {long} of {row_rounds} row-rounds commit N >= 3"
        );
    }
}

#[test]
fn dflash_k1_greedy_equals_plain_decoding() {
    check(DraftBackend::DFlash, 1);
}

#[test]
fn dflash_k4_greedy_equals_plain_decoding() {
    check(DraftBackend::DFlash, 4);
}

#[test]
fn dflash_k15_greedy_equals_plain_decoding() {
    check(DraftBackend::DFlash, 15);
}

#[test]
fn dflash2_k1_greedy_equals_plain_decoding() {
    check(DraftBackend::DFlash2, 1);
}

#[test]
fn dflash2_k4_greedy_equals_plain_decoding() {
    check(DraftBackend::DFlash2, 4);
}

#[test]
fn dflash2_k15_greedy_equals_plain_decoding() {
    check(DraftBackend::DFlash2, 15);
}

/// The indexed (shortlist) proposal head: proposals come from 128 of the 257 public rows,
/// remapped to global ids; the output is still exactly plain greedy decoding.
fn indexed_head(backend: DraftBackend) {
    use dflash_config::ProposalHead;
    use dflash_engine::{DraftHead, Engine};
    use dflash_ops::Backend;
    let fx = Fixture::write(backend).expect("fixture");
    let be = Backend::cpu();
    let full = fx.parts(&be).expect("parts");
    let DraftHead::Full { output_head } = &full.head else {
        panic!("the fixture lends the full head");
    };
    let g = dflash_cli::target_geometry();
    let head = be.download(output_head).expect("head");
    let (rows, ids) = dflash_draft::synthetic::shortlist(&head, g.hidden, g.public_vocab, 128, 17);
    let parts = dflash_engine::DraftTargetParts {
        head: DraftHead::Indexed {
            // Lent, not copied: the engine reads this function's vectors.
            rows: dflash_ops::Borrowed::host(&rows).into(),
            token_ids: dflash_ops::Borrowed::host(&ids).into(),
        },
        ..full
    };
    let mut opts = dflash_e2e::options(backend, 4, 3, 128);
    opts.startup.proposal_head = ProposalHead::Indexed { rows: 128 };
    let mut engine = Engine::with_draft(
        fx.target().expect("target"),
        fx.draft(&be).expect("draft"),
        parts,
        &opts,
    )
    .expect("engine");
    let reqs = requests(&fx, 5);
    let expected = plain_outputs(&fx, &reqs);
    let ids: Vec<_> = reqs
        .iter()
        .map(|r| engine.submit(r.clone()).expect("submit"))
        .collect();
    let c = run_checked(&mut engine, 1);
    let shortlisted: std::collections::HashSet<u32> = ids_of(&c);
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(
            c.outputs[id], expected[i],
            "{backend:?} indexed head, request {i}"
        );
    }
    let allowed: std::collections::HashSet<u32> =
        dflash_draft::synthetic::shortlist(&head, g.hidden, g.public_vocab, 128, 17)
            .1
            .into_iter()
            .map(|t| t as u32)
            .collect();
    assert!(
        shortlisted.is_subset(&allowed),
        "every proposal is a shortlisted global id"
    );
    assert_no_context_leak(engine.proposer());
}

fn ids_of(c: &dflash_e2e::Collected) -> std::collections::HashSet<u32> {
    c.steps
        .iter()
        .flat_map(|s| s.rows.iter().flat_map(|r| r.proposed.iter().copied()))
        .collect()
}

#[test]
fn dflash_indexed_head_greedy_equals_plain_decoding() {
    indexed_head(DraftBackend::DFlash);
}

#[test]
fn dflash2_indexed_head_greedy_equals_plain_decoding() {
    indexed_head(DraftBackend::DFlash2);
}
