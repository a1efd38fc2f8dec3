//! `host_engine_zero_copy`: a host written directly against cudarc (its own context handle,
//! its own stream with cudarc event tracking left on, its own device copies of the target's
//! embedding and output head) embeds the DFlash / DFlash2 engine on its stream and lends it
//! those two tensors as `Borrowed` views. The engine's greedy output must equal the output
//! of the same engine with owned (uploaded) parts and plain greedy decoding; the memory plan
//! must hold no bytes for the parts; the backend's allocation and synchronization counters
//! are recorded per round after warm-up.
//!
//! The stand-in target is the CPU reference target of the trained pair (its verify writes
//! the logits and features into the engine's device buffers); a GPU-resident stand-in
//! target is the embedding issue's next step.

use anyhow::{Context, Result, anyhow};
use cudarc::driver::CudaContext;
use dflash_cli::{Fixture, demo_prompts};
use dflash_config::Backend as DraftBackend;
use dflash_engine::{DraftHead, DraftTargetParts, Engine, EngineOptions, Event, Request};
use dflash_ops::cuda::{CudaBackend, CudaOptions};
use dflash_ops::{Backend, Borrowed};

/// One draft kind's result.
pub struct HostResult {
    /// "DFlash" or "DFlash2".
    pub backend: &'static str,
    /// Requests whose output equals both plain greedy decoding and the owned-parts engine.
    pub equal: usize,
    /// Requests run.
    pub requests: usize,
    /// Proposals accepted (the trained draft works through the borrowed parts).
    pub accepted: u64,
    /// Bytes the memory plan holds for the target parts (0 when borrowed).
    pub planned_part_bytes: u64,
    /// Whether the engine's parts report the host's device addresses.
    pub addresses_are_hosts: bool,
    /// Rounds after the first, and the allocations / synchronizations they made.
    pub rounds: u64,
    /// Device allocations in those rounds.
    pub allocations: u64,
    /// Host synchronizations in those rounds.
    pub synchronizations: u64,
}

/// The engine options of the host checks (K = 7, B = 4, graph profiles where they can run).
fn options(backend: DraftBackend) -> EngineOptions {
    crate::round_graph::options(backend, false)
}

fn requests() -> Vec<Request> {
    demo_prompts(4, 9)
        .into_iter()
        .enumerate()
        .map(|(i, p)| Request::greedy(p, 16 + 8 * i))
        .collect()
}

/// What [`drive`] saw.
struct Drive {
    /// Each request's output.
    outputs: Vec<Vec<u32>>,
    /// Proposals accepted.
    accepted: u64,
    /// Rounds after the first.
    rounds: u64,
    /// Allocations and synchronizes over those rounds.
    allocations: u64,
    synchronizations: u64,
}

/// Run every request to the end: the outputs, accepted proposals, rounds after warm-up and
/// the counters' growth over them.
fn drive<P: dflash_engine::Proposer>(
    engine: &mut Engine<dflash_testkit::ReferenceTarget, P>,
    be: &Backend,
) -> Result<Drive> {
    let ids: Vec<_> = requests()
        .into_iter()
        .map(|r| engine.submit(r))
        .collect::<std::result::Result<_, _>>()?;
    let mut outputs = vec![Vec::new(); ids.len()];
    let mut accepted = 0u64;
    let (mut rounds, mut warm) = (0u64, None);
    loop {
        let mut events = Vec::new();
        let step = engine.step(&mut |e: &Event| events.push(e.clone()))?;
        for e in events {
            if let Event::Tokens { id, tokens, .. } = e
                && let Some(i) = ids.iter().position(|&x| x == id)
            {
                outputs[i].extend(tokens);
            }
        }
        let Some(step) = step else { break };
        accepted += step.rows.iter().map(|r| r.accepted as u64).sum::<u64>();
        match warm {
            None => warm = Some((be.allocations(), be.synchronizations())),
            Some(_) => rounds += 1,
        }
    }
    let (a0, s0) = warm.unwrap_or((be.allocations(), be.synchronizations()));
    Ok(Drive {
        outputs,
        accepted,
        rounds,
        allocations: be.allocations() - a0,
        synchronizations: be.synchronizations() - s0,
    })
}

/// The check for both drafts.
pub fn check() -> Result<Vec<HostResult>> {
    let mut out = Vec::new();
    for (backend, name) in [
        (DraftBackend::DFlash, "DFlash"),
        (DraftBackend::DFlash2, "DFlash2"),
    ] {
        let fx = Fixture::write(backend).map_err(|e| anyhow!("fixture: {e}"))?;
        // The host: its own context handle and stream, event tracking as cudarc defaults.
        let ctx = CudaContext::new(0).context("host context")?;
        let stream = ctx.new_stream().context("host stream")?;
        let cpu = Backend::cpu();
        let owned_cpu = fx.parts(&cpu).map_err(|e| anyhow!("parts: {e}"))?;
        let DraftHead::Full { output_head } = &owned_cpu.head else {
            return Err(anyhow!("the fixture lends the full head"));
        };
        let host_embedding = stream
            .clone_htod(&cpu.download(&owned_cpu.embedding)?)
            .context("host embedding")?;
        let host_head = stream
            .clone_htod(&cpu.download(output_head)?)
            .context("host head")?;
        let be = Backend::Cuda(CudaBackend::on_stream(
            stream.clone(),
            CudaOptions::default(),
        )?);
        let parts = DraftTargetParts {
            vocab_rows: owned_cpu.vocab_rows,
            public_vocab: owned_cpu.public_vocab,
            embedding: Borrowed::cuda(&be, &host_embedding)?.into(),
            head: DraftHead::Full {
                output_head: Borrowed::cuda(&be, &host_head)?.into(),
            },
        };
        let mut engine = Engine::with_draft(
            fx.target().map_err(|e| anyhow!("target: {e}"))?,
            fx.draft(&be).map_err(|e| anyhow!("draft: {e}"))?,
            parts,
            &options(backend),
        )?;
        let planned_part_bytes = engine.memory_plan().bytes("draft target parts");
        let lent = engine.proposer().target_parts();
        let head_addr = match &lent.head {
            DraftHead::Full { output_head } => output_head.address(),
            DraftHead::Indexed { rows, .. } => rows.address(),
        };
        let addresses_are_hosts = lent.embedding.is_borrowed()
            && lent.embedding.address() == host_address(&host_embedding)
            && head_addr == host_address(&host_head);
        let Drive {
            outputs: got,
            accepted,
            rounds,
            allocations,
            synchronizations,
        } = drive(&mut engine, &be)?;
        drop(engine);
        // The same engine with owned parts on an ordinary backend.
        let own_be = Backend::Cuda(CudaBackend::new(0)?);
        let mut owned_engine = Engine::with_draft(
            fx.target().map_err(|e| anyhow!("target: {e}"))?,
            fx.draft(&own_be).map_err(|e| anyhow!("draft: {e}"))?,
            fx.parts(&own_be).map_err(|e| anyhow!("parts: {e}"))?,
            &options(backend),
        )?;
        let want = drive(&mut owned_engine, &own_be)?.outputs;
        let mut plain_target = fx.target().map_err(|e| anyhow!("target: {e}"))?;
        let plain: Vec<Vec<u32>> = requests()
            .iter()
            .map(|r| dflash_engine::plain_decode(&mut plain_target, &cpu, r).map(|g| g.tokens))
            .collect::<std::result::Result<_, _>>()?;
        let equal = got
            .iter()
            .zip(&want)
            .zip(&plain)
            .filter(|((g, w), p)| g == w && g == p)
            .count();
        out.push(HostResult {
            backend: name,
            equal,
            requests: got.len(),
            accepted,
            planned_part_bytes,
            addresses_are_hosts,
            rounds,
            allocations,
            synchronizations,
        });
    }
    Ok(out)
}

fn host_address<T>(s: &cudarc::driver::CudaSlice<T>) -> u64 {
    use cudarc::driver::DevicePtr;
    s.device_ptr(s.stream()).0
}

/// The report section and whether it passed.
pub fn section(results: &Result<Vec<HostResult>>) -> (String, bool) {
    let mut s = String::from(
        "## host_engine_zero_copy\n\nA host written against cudarc (its own context handle and stream, \
event tracking on) embeds the engine on its stream (`CudaBackend::on_stream`) and lends its device \
embedding and output head as `Borrowed::cuda` views; 4 greedy requests, K = 7, B = 4, the trained \
pair with the CPU reference target as the stand-in target. Outputs must equal the owned-parts engine \
and plain greedy decoding; the memory plan must hold 0 bytes for the parts. Allocations and \
synchronizations are counted over the rounds after the first.\n\n| draft | outputs equal | accepted | \
planned part bytes | engine reads the host's addresses | rounds | allocations | synchronizations | pass |\n\
|---|---|---|---|---|---|---|---|---|\n",
    );
    match results {
        Ok(rs) => {
            let mut ok = !rs.is_empty();
            for r in rs {
                let pass = r.equal == r.requests
                    && r.planned_part_bytes == 0
                    && r.addresses_are_hosts
                    && r.accepted > 0;
                ok &= pass;
                s.push_str(&format!(
                    "| {} | {}/{} | {} | {} | {} | {} | {} | {} | {} |\n",
                    r.backend,
                    r.equal,
                    r.requests,
                    r.accepted,
                    r.planned_part_bytes,
                    if r.addresses_are_hosts { "yes" } else { "NO" },
                    r.rounds,
                    r.allocations,
                    r.synchronizations,
                    if pass { "pass" } else { "FAIL" }
                ));
            }
            (s, ok)
        }
        Err(e) => {
            s.push_str(&format!("\nFAILED to run: {e:#}\n"));
            (s, false)
        }
    }
}
