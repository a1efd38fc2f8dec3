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

/// A target that lends its verify logits as BF16 in the packed layout (only each row's live
/// columns, row after row), from its own buffer: the reference target's F32 logits rounded to
/// BF16 and packed after each verify.
struct Bf16Packed {
    inner: dflash_testkit::ReferenceTarget,
    logits: Option<dflash_ops::Buffer<dflash_ops::bf16>>,
}

impl dflash_engine::Target for Bf16Packed {
    type Checkpoint = <dflash_testkit::ReferenceTarget as dflash_engine::Target>::Checkpoint;
    fn info(&self) -> &dflash_engine::TargetInfo {
        self.inner.info()
    }
    fn create(&mut self) -> Result<dflash_engine::SeqHandle, dflash_engine::TargetError> {
        self.inner.create()
    }
    fn prefill(
        &mut self,
        be: &Backend,
        seq: dflash_engine::SeqHandle,
        tokens: &[u32],
    ) -> Result<dflash_engine::PrefillOutput, dflash_engine::TargetError> {
        self.inner.prefill(be, seq, tokens)
    }
    fn frontier(&self, seq: dflash_engine::SeqHandle) -> Result<usize, dflash_engine::TargetError> {
        self.inner.frontier(seq)
    }
    fn pending(
        &self,
        seq: dflash_engine::SeqHandle,
    ) -> Result<Option<usize>, dflash_engine::TargetError> {
        self.inner.pending(seq)
    }
    fn verify(
        &mut self,
        be: &Backend,
        batch: &dflash_engine::VerifyBatch<'_>,
    ) -> Result<(), dflash_engine::TargetError> {
        self.inner.verify(be, batch)?;
        let v = self.inner.info().vocab_rows;
        let dflash_ops::target_distribution::Logits::F32(l) = self.inner.verified()?.logits.values
        else {
            unreachable!("the reference target lends F32");
        };
        let all = be.read(l, 0, batch.rows.len() * batch.cols * v)?;
        let mut packed = Vec::new();
        for (r, row) in batch.rows.iter().enumerate() {
            let base = r * batch.cols * v;
            packed.extend(
                all[base..base + row.tokens.len() * v]
                    .iter()
                    .map(|&x| dflash_ops::bf16::from_f32(x)),
            );
        }
        // Poison what the packed columns do not cover, so a read past them shows.
        let cap = batch.rows.len() * batch.cols * v;
        packed.resize(cap, dflash_ops::bf16::NAN);
        self.logits = Some(be.upload(&packed)?);
        Ok(())
    }
    fn verified(&self) -> Result<dflash_engine::VerifyView<'_>, dflash_engine::TargetError> {
        let logits = self
            .logits
            .as_ref()
            .ok_or(dflash_engine::TargetError::NothingVerified)?;
        Ok(dflash_engine::VerifyView {
            logits: dflash_verify::TargetLogits::packed(logits),
            features: self.inner.verified()?.features,
        })
    }
    fn commit(
        &mut self,
        commits: &[dflash_engine::Commit],
    ) -> Result<(), dflash_engine::TargetError> {
        self.inner.commit(commits)
    }
    fn fork(
        &mut self,
        seq: dflash_engine::SeqHandle,
    ) -> Result<dflash_engine::SeqHandle, dflash_engine::TargetError> {
        self.inner.fork(seq)
    }
    fn checkpoint(
        &self,
        seq: dflash_engine::SeqHandle,
    ) -> Result<Self::Checkpoint, dflash_engine::TargetError> {
        self.inner.checkpoint(seq)
    }
    fn restore(
        &mut self,
        seq: dflash_engine::SeqHandle,
        image: &Self::Checkpoint,
    ) -> Result<(), dflash_engine::TargetError> {
        self.inner.restore(seq, image)
    }
    fn release(&mut self, seq: dflash_engine::SeqHandle) -> Result<(), dflash_engine::TargetError> {
        self.inner.release(seq)
    }
}

/// The engine reads whatever the target lends: BF16 logits in the packed layout verify like
/// plain decoding over the same target (which samples from the same BF16 logits), for both
/// drafts, greedy and sampled.
#[test]
fn target_logits_lent_as_bf16_packed_verify_like_plain_decoding() {
    for backend in [DraftBackend::DFlash, DraftBackend::DFlash2] {
        let fx = Fixture::write(backend).expect("fixture");
        let be = Backend::cpu();
        let target = || Bf16Packed {
            inner: fx.target().expect("target"),
            logits: None,
        };
        let mut reqs: Vec<Request> = demo_prompts(3, 7)
            .into_iter()
            .map(|p| Request::greedy(p, 20))
            .collect();
        reqs[2].sampling.temperature = 0.7;
        reqs[2].seed = 5;
        let mut engine = Engine::with_draft(
            target(),
            fx.draft(&be).expect("draft"),
            fx.parts(&be).expect("parts"),
            &options(backend, 7, 3, 256),
        )
        .expect("engine");
        let ids: Vec<_> = reqs
            .iter()
            .map(|r| engine.submit(r.clone()).expect("submit"))
            .collect();
        let got = run_checked(&mut engine, 0);
        let mut plain_target = target();
        for (i, id) in ids.iter().enumerate() {
            if reqs[i].sampling.temperature > 0.0 {
                // A sampled request's output is a draw: the statistical tests check those.
                continue;
            }
            let want = dflash_engine::plain_decode(&mut plain_target, &be, &reqs[i])
                .expect("plain")
                .tokens;
            assert_eq!(
                got.outputs.get(id).cloned().unwrap_or_default(),
                want,
                "{backend:?} {i}"
            );
        }
        assert!(got.finished.len() == reqs.len(), "every request finished");
    }
}

/// A round of n live requests runs the draft block on n rows (not B): on the CPU, which
/// cannot capture graphs, every round is eager and computes exactly its live rows; the
/// live-row buckets a CUDA engine captures are the powers of two below B, then B.
#[test]
fn a_round_of_n_live_requests_computes_n_draft_rows() {
    assert_eq!(dflash_engine::live_row_buckets(1), vec![1]);
    assert_eq!(dflash_engine::live_row_buckets(4), vec![1, 2, 4]);
    assert_eq!(dflash_engine::live_row_buckets(6), vec![1, 2, 4, 6]);
    assert_eq!(dflash_engine::live_row_buckets(8), vec![1, 2, 4, 8]);
    for backend in [DraftBackend::DFlash, DraftBackend::DFlash2] {
        let fx = Fixture::write(backend).expect("fixture");
        let be = Backend::cpu();
        let mut engine = Engine::with_draft(
            fx.target().expect("target"),
            fx.draft(&be).expect("draft"),
            fx.parts(&be).expect("parts"),
            &options(backend, 7, 4, 256),
        )
        .expect("engine");
        assert!(engine.proposer().graph_profiles().is_empty());
        assert!(
            engine
                .proposer()
                .eager_reason()
                .is_some_and(|r| r.contains("CPU")),
            "{:?}",
            engine.proposer().eager_reason()
        );
        for (i, p) in demo_prompts(4, 7).into_iter().enumerate() {
            engine
                .submit(Request::greedy(p, 6 + 9 * i))
                .expect("submit");
        }
        let mut sink = |_: &dflash_engine::Event| {};
        let mut seen = std::collections::BTreeSet::new();
        while let Some(step) = engine.step(&mut sink).expect("round") {
            if step.rows.is_empty() {
                continue;
            }
            seen.insert(step.rows.len());
            assert_eq!(
                engine.proposer().last_block_rows(),
                step.rows.len(),
                "{backend:?}: the draft block ran on the live rows only"
            );
        }
        assert!(seen.len() >= 3, "{backend:?}: live rows shrank: {seen:?}");
        assert_eq!(engine.proposer().graph_replays(), 0);
    }
}

/// `Target::verify_device`'s default (a target that verifies host tokens) reads the device
/// ids back and verifies exactly what `Target::verify` would; a bad batch is refused with a
/// typed error before anything is verified.
#[test]
fn verify_device_default_reads_the_ids_and_verifies_like_verify() {
    use dflash_engine::{DeviceVerifyBatch, Target, TargetError, VerifyBatch, VerifyRow};
    let fx = Fixture::write(DraftBackend::DFlash).expect("fixture");
    let be = Backend::cpu();
    let prompt = demo_prompts(1, 3).remove(0);
    let (mut a, mut b) = (fx.target().expect("target"), fx.target().expect("target"));
    let (sa, _) = a.create_with_prompt(&be, &prompt).expect("prefill");
    let (sb, _) = b.create_with_prompt(&be, &prompt).expect("prefill");
    let tokens = [prompt[0], 5, 9];
    // Device ids `[1, W = 4]`: the three live tokens, then junk.
    let ids = be.upload(&[tokens[0] as i32, 5, 9, -7]).expect("ids");
    a.verify_device(
        &be,
        &DeviceVerifyBatch {
            seqs: &[sa],
            columns: &[3],
            ids: &ids,
            cols: 4,
        },
    )
    .expect("device verify");
    b.verify(
        &be,
        &VerifyBatch {
            rows: &[VerifyRow::chain(sb, &tokens)],
            cols: 4,
        },
    )
    .expect("verify");
    let read = |t: &dflash_testkit::ReferenceTarget| {
        let v = t.verified().expect("view");
        let dflash_ops::target_distribution::Logits::F32(l) = v.logits.values else {
            panic!("F32 logits");
        };
        (
            be.download(l).expect("l"),
            be.download(v.features).expect("f"),
        )
    };
    assert_eq!(read(&a), read(&b));
    assert_eq!(a.pending(sa).expect("pending"), Some(3));
    a.commit(&[dflash_engine::Commit::prefix(sa, 0)])
        .expect("release");
    let mut bad = |columns: &[usize], ids: &dflash_ops::Buffer<i32>, cols: usize| {
        a.verify_device(
            &be,
            &DeviceVerifyBatch {
                seqs: &[sa],
                columns,
                ids,
                cols,
            },
        )
        .expect_err("refused")
    };
    let short = be.upload(&[1i32, 2]).expect("short");
    assert!(matches!(
        bad(&[2], &short, 4),
        TargetError::OutputShape { tensor: "ids", .. }
    ));
    assert!(matches!(
        bad(&[5], &ids, 4),
        TargetError::WidthTooSmall { .. }
    ));
    assert!(matches!(
        bad(&[4], &ids, 4),
        TargetError::TokenOutOfRange { column: 3, .. }
    ));
    assert!(matches!(bad(&[1, 2], &ids, 4), TargetError::EmptyBatch));
    assert_eq!(
        a.pending(sa).expect("pending"),
        None,
        "nothing was verified"
    );
}
