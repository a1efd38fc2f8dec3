//! The README's embedding example, built by `cargo test --workspace` (and run by
//! `cargo run --release -p dflash-e2e --example embedding`): a host that owns a Qwen3.5-style
//! target (here the trained reference target of the embedded default), a DFlash2 draft
//! loaded from its checkpoint, and the target's embedding and output head, which it lends to
//! the engine without a copy. The test `readme_embedding_example_is_the_built_example` keeps
//! the README's block equal to the marked part below.

use dflash_cli::{Fixture, demo_prompts, target_geometry};
use dflash_ops::Backend;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // What the host engine already has: its target, a draft checkpoint bound on backend
    // `be`, the target's own embedding and output head on that backend, and a prompt.
    let fx = Fixture::write(dflash_config::Backend::DFlash2)?;
    let be = Backend::cpu();
    let target = fx.target()?;
    let draft = fx.draft(&be)?;
    let owned = fx.parts(&be)?;
    let embedding: Vec<dflash_ops::bf16> = be.download(&owned.embedding)?;
    let lm_head = match &owned.head {
        dflash_engine::DraftHead::Full { output_head } => be.download(output_head)?,
        dflash_engine::DraftHead::Indexed { .. } => unreachable!("the fixture lends the full head"),
    };
    drop(owned);
    let g = target_geometry();
    let (vocab_rows, public_vocab) = (g.vocab_rows, g.public_vocab);
    let max_context = 1024;
    let prompt_tokens = demo_prompts(1, 1).remove(0);

    // README begin
    use dflash_config::{Backend as DraftBackend, StartupOptions};
    use dflash_engine::{DraftHead, DraftTargetParts, Engine, EngineOptions, Request};
    use dflash_ops::Borrowed;

    // `target` implements dflash_engine::Target for your Qwen3.5; `draft` is a
    // dflash_draft::DraftModel loaded from a published checkpoint on backend `be`;
    // `embedding` and `lm_head` are the target's own tensors there, lent to the draft
    // (host slices on the CPU; on CUDA `Borrowed::cuda(&be, &slice)` over the target's
    // cudarc slices, with the backend on the host's stream: `CudaBackend::on_stream`).
    let parts = DraftTargetParts {
        vocab_rows,
        public_vocab,
        embedding: Borrowed::host(&embedding).into(), // read in place, never copied
        head: DraftHead::Full {
            output_head: Borrowed::host(&lm_head).into(),
        },
    };
    let mut startup = StartupOptions::new(DraftBackend::DFlash2, 7); // K = 7
    startup.concurrency = 4; // B = 4
    let options = EngineOptions::new(startup, max_context); // positions per request
    let mut engine = Engine::with_draft(target, draft, parts, &options)?; // plans all memory
    let id = engine.submit(Request::greedy(prompt_tokens, 32))?;
    engine.run(&mut |event| println!("{event:?}"))?; // streams published tokens
    // README end

    let _ = (id, &be);
    Ok(())
}
