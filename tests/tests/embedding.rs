//! What an engine that embeds these crates relies on: the target parts it lends are read in
//! place (never copied, never counted in the memory plan), and a round after warm-up makes no
//! buffer allocation on the backend.

use dflash_cli::{Fixture, demo_prompts};
use dflash_config::Backend as DraftBackend;
use dflash_e2e::{options, plain_outputs, run_checked};
use dflash_engine::{DraftHead, DraftTargetParts, Engine, Request};
use dflash_ops::{Backend, Borrowed};

/// The host keeps the embedding and the head (here host vectors, as a CPU target would);
/// the draft reads them through `Borrowed` views: the proposer's parts report the host's
/// addresses, the memory plan holds 0 bytes for them, and the greedy output equals plain
/// decoding and the owned-parts engine's output.
#[test]
fn target_parts_are_borrowed_not_copied() {
    for backend in [DraftBackend::DFlash, DraftBackend::DFlash2] {
        let fx = Fixture::write(backend).expect("fixture");
        let be = Backend::cpu();
        let owned = fx.parts(&be).expect("parts");
        let DraftHead::Full { output_head } = &owned.head else {
            panic!("the fixture lends the full head");
        };
        // The host's own copies (what a target holds).
        let host_embedding = be.download(&owned.embedding).expect("embedding");
        let host_head = be.download(output_head).expect("head");
        let parts = DraftTargetParts {
            vocab_rows: owned.vocab_rows,
            public_vocab: owned.public_vocab,
            embedding: Borrowed::host(&host_embedding).into(),
            head: DraftHead::Full {
                output_head: Borrowed::host(&host_head).into(),
            },
        };
        let reqs: Vec<Request> = demo_prompts(4, 3)
            .into_iter()
            .map(|p| Request::greedy(p, 24))
            .collect();
        let expected = plain_outputs(&fx, &reqs);
        let opts = options(backend, 7, 4, 256);
        let mut engine = Engine::with_draft(
            fx.target().expect("target"),
            fx.draft(&be).expect("draft"),
            parts,
            &opts,
        )
        .expect("engine");
        assert_eq!(
            engine.memory_plan().bytes("draft target parts"),
            0,
            "{backend:?}: borrowed parts are not planned: {}",
            engine.memory_plan()
        );
        let lent = engine.proposer().target_parts();
        assert!(lent.embedding.is_borrowed());
        assert_eq!(lent.embedding.address(), host_embedding.as_ptr() as u64);
        let DraftHead::Full { output_head } = &lent.head else {
            panic!("full head");
        };
        assert_eq!(output_head.address(), host_head.as_ptr() as u64);
        let ids: Vec<_> = reqs
            .iter()
            .map(|r| engine.submit(r.clone()).expect("submit"))
            .collect();
        let got = run_checked(&mut engine, 0);
        for (i, id) in ids.iter().enumerate() {
            assert_eq!(
                got.outputs.get(id).cloned().unwrap_or_default(),
                expected[i],
                "{backend:?} request {i}"
            );
        }
        assert!(
            got.steps
                .iter()
                .flat_map(|s| &s.rows)
                .any(|r| r.accepted > 0),
            "{backend:?}: the trained draft, reading borrowed parts, gets proposals accepted"
        );
        // The owned-parts engine's plan counts the parts (the check above can fail).
        let owned_engine = Engine::with_draft(
            fx.target().expect("target"),
            fx.draft(&be).expect("draft"),
            owned,
            &opts,
        )
        .expect("engine");
        assert_eq!(
            owned_engine.memory_plan().bytes("draft target parts"),
            2 * (host_embedding.len() + host_head.len()) as u64
        );
        drop(engine);
        // The views never wrote the host's memory.
        assert_eq!(
            host_embedding,
            be.download(&owned_engine.proposer().target_parts().embedding)
                .expect("e")
        );
    }
}

/// After the first round (warm-up; it also admits every request: a prefill allocates its
/// prompt's features, an admission is not a round), a round makes no buffer allocation on
/// the backend: not for materialize, pending verify features, verification or a batch
/// shorter than B (requests finish at different times, so later rounds run with fewer live
/// rows).
#[test]
fn round_allocates_nothing_after_warmup() {
    for backend in [DraftBackend::DFlash, DraftBackend::DFlash2] {
        let fx = Fixture::write(backend).expect("fixture");
        let be = Backend::cpu();
        let reqs: Vec<Request> = demo_prompts(4, 5)
            .into_iter()
            .enumerate()
            .map(|(i, p)| Request::greedy(p, 8 + 14 * i))
            .collect();
        let mut engine = Engine::with_draft(
            fx.target().expect("target"),
            fx.draft(&be).expect("draft"),
            fx.parts(&be).expect("parts"),
            &options(backend, 7, 4, 256),
        )
        .expect("engine");
        for r in &reqs {
            engine.submit(r.clone()).expect("submit");
        }
        let mut sink = |_: &dflash_engine::Event| {};
        engine.step(&mut sink).expect("warm-up round");
        let warm = be.allocations();
        let mut widths = std::collections::BTreeSet::new();
        while let Some(step) = engine.step(&mut sink).expect("round") {
            widths.insert(step.rows.len());
            assert_eq!(
                be.allocations(),
                warm,
                "{backend:?}: a round of {} rows allocated",
                step.rows.len()
            );
        }
        assert!(
            widths.len() >= 3,
            "{backend:?}: rounds ran with several live-row counts: {widths:?}"
        );
    }
}

/// The README's embedding block is the marked part of `tests/examples/embedding.rs`, which
/// `cargo test --workspace` builds: the example in the README compiles and runs.
#[test]
fn readme_embedding_example_is_the_built_example() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let readme = std::fs::read_to_string(format!("{root}/README.md")).expect("README");
    let example =
        std::fs::read_to_string(format!("{root}/tests/examples/embedding.rs")).expect("example");
    let section = readme
        .split("## Embedding\n")
        .nth(1)
        .expect("README has an Embedding section");
    let block = section
        .split("```rust\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("the section has a rust block");
    let marked = example
        .split("    // README begin\n")
        .nth(1)
        .and_then(|m| m.split("    // README end\n").next())
        .expect("the example marks its README part");
    let dedented: String = marked
        .lines()
        .map(|l| l.strip_prefix("    ").unwrap_or(l))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(block, dedented, "README block and example differ");
    assert!(block.contains("Borrowed::host(&embedding)"));
}
