//! `engine_round_graph`: the engine's draft block replayed from its CUDA graph profiles (one
//! per live-row bucket, captured at startup) must give exactly the rounds of the same engine
//! run eagerly (`EngineOptions::eager`): every request's output, and every row-round's
//! proposals, acceptance and licensed tokens, greedy and sampled, while requests finish and
//! the live rows shrink through the buckets. Also times the draft's propose (stage, block,
//! read) replayed and eager, at 1 and B live rows.
//!
//! The stand-in target is the CPU reference target of the trained pair.

use std::time::Instant;

use anyhow::{Result, anyhow, ensure};
use dflash_cli::{Fixture, demo_prompts};
use dflash_config::{Backend as DraftBackend, StartupOptions};
use dflash_engine::{
    DraftProposer, Engine, EngineOptions, Event, ProposeRow, Proposer, Request, RowReport,
    SamplingSettings, Target,
};
use dflash_ops::Backend;
use dflash_ops::cuda::CudaBackend;

use crate::replay_target::Recorder;

const B: u32 = 4;
const K: u32 = 7;

/// The engine options of the embedding checks: K = 7, B = 4, 256 positions, pages of 8.
pub fn options(backend: DraftBackend, eager: bool) -> EngineOptions {
    EngineOptions {
        startup: StartupOptions {
            concurrency: B,
            ..StartupOptions::new(backend, K)
        },
        max_context: 256,
        page_size: 8,
        memory_budget: 1 << 32,
        eager,
    }
}

fn requests(temperature: f32) -> Vec<Request> {
    demo_prompts(B as usize, 9)
        .into_iter()
        .enumerate()
        .map(|(i, p)| Request {
            sampling: if temperature > 0.0 {
                SamplingSettings::sampling(temperature)
            } else {
                SamplingSettings::GREEDY
            },
            seed: 11 + i as u64,
            ..Request::greedy(p, 12 + 10 * i)
        })
        .collect()
}

/// One row-round as reported: (proposed, accepted, licensed, committed).
type RowRound = (Vec<u32>, usize, Vec<u32>, usize);

/// What one engine run produced.
#[derive(PartialEq)]
struct Run {
    outputs: Vec<Vec<u32>>,
    /// Per round, per row.
    rounds: Vec<Vec<RowRound>>,
}

/// What a run cost on the backend after its first round (which admits every request):
/// rounds, device allocations and host synchronizations.
#[derive(Clone, Copy, Default)]
struct Costs {
    rounds: u64,
    allocations: u64,
    synchronizations: u64,
}

/// Run `requests` to the end; also the wall time of each step (µs), the live rows of each and
/// the costs after the first round.
fn drive<T: Target, P: Proposer>(
    engine: &mut Engine<T, P>,
    requests: Vec<Request>,
) -> Result<(Run, Vec<f64>, Vec<usize>, Costs)> {
    let be = engine.backend().clone();
    let mut warm: Option<(u64, u64)> = None;
    let mut costs = Costs::default();
    let ids: Vec<_> = requests
        .into_iter()
        .map(|r| engine.submit(r))
        .collect::<std::result::Result<_, _>>()?;
    let mut outputs = vec![Vec::new(); ids.len()];
    let (mut rounds, mut times, mut live) = (Vec::new(), Vec::new(), Vec::new());
    loop {
        let mut events = Vec::new();
        let t0 = Instant::now();
        let step = engine.step(&mut |e: &Event| events.push(e.clone()))?;
        let us = t0.elapsed().as_secs_f64() * 1e6;
        for e in events {
            if let Event::Tokens { id, tokens, .. } = e
                && let Some(i) = ids.iter().position(|&x| x == id)
            {
                outputs[i].extend(tokens);
            }
        }
        let Some(step) = step else { break };
        if step.rows.is_empty() {
            continue;
        }
        times.push(us);
        live.push(step.rows.len());
        match warm {
            None => warm = Some((be.allocations(), be.synchronizations())),
            Some((a, s)) => {
                costs = Costs {
                    rounds: costs.rounds + 1,
                    allocations: be.allocations() - a,
                    synchronizations: be.synchronizations() - s,
                };
            }
        }
        rounds.push(
            step.rows
                .iter()
                .map(|r: &RowReport| {
                    (
                        r.proposed.clone(),
                        r.accepted,
                        r.licensed.clone(),
                        r.committed,
                    )
                })
                .collect(),
        );
    }
    Ok((Run { outputs, rounds }, times, live, costs))
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One (draft, temperature) comparison.
pub struct Comparison {
    pub backend: &'static str,
    pub temperature: f32,
    /// Requests whose outputs are equal between graph and eager.
    pub equal_outputs: usize,
    pub requests: usize,
    /// Whether every row-round (proposals, acceptance, licensed, committed) is equal.
    pub equal_rounds: bool,
    /// Rounds run, and rounds replayed from a graph profile.
    pub rounds: usize,
    pub replays: u64,
    /// Rounds whose verification ops replayed a graph, graphs recorded, why recording
    /// stopped (if it did), and verification replays of the eager engine (must be 0).
    pub verify_replays: u64,
    pub verify_captures: u64,
    pub verify_refused: Option<String>,
    pub verify_replays_eager: u64,
    /// The live-row counts seen (distinct, descending).
    pub live_rows: Vec<usize>,
    /// The captured buckets, and why the eager engine was eager.
    pub profiles: Vec<usize>,
    pub eager_reason: String,
    /// Proposals accepted (the trained pair drafts for real).
    pub accepted: usize,
    /// Median engine step wall time, graph and eager (µs).
    pub step_graph_us: f64,
    pub step_eager_us: f64,
}

/// Median propose time (µs) of one draft at `rows` live rows, graph and eager.
pub struct ProposeTiming {
    pub backend: &'static str,
    pub rows: usize,
    pub graph_us: f64,
    pub eager_us: f64,
    /// The graph and eager proposals were identical in every iteration.
    pub equal: bool,
}

/// Engine rounds over the GPU-resident stand-in target (recorded outputs served from device
/// memory), graph profiles and eager.
pub struct RoundTiming {
    pub backend: &'static str,
    /// Rounds timed, and whether the replayed runs reproduced the recorded outputs.
    pub rounds: usize,
    pub reproduced: bool,
    /// Medians over the rounds (µs): the engine round (`Engine::step`), the draft's propose
    /// at the round's live rows (graph), and the rest (round minus propose).
    pub round_graph_us: f64,
    pub round_eager_us: f64,
    pub propose_us: f64,
    pub rest_us: f64,
    /// Over the replayed (graph) rounds after the first: device allocations and host
    /// synchronizations per round.
    pub allocations_per_round: f64,
    pub syncs_per_round: f64,
    /// Graph rounds whose verification ops replayed a graph.
    pub verify_replays: u64,
}

pub struct RoundGraphResult {
    pub comparisons: Vec<Comparison>,
    pub timings: Vec<ProposeTiming>,
    pub rounds: Vec<RoundTiming>,
}

/// The check for both drafts.
pub fn check() -> Result<RoundGraphResult> {
    let mut comparisons = Vec::new();
    let mut timings = Vec::new();
    let mut rounds = Vec::new();
    for (backend, name) in [
        (DraftBackend::DFlash, "DFlash"),
        (DraftBackend::DFlash2, "DFlash2"),
    ] {
        let fx = Fixture::write(backend).map_err(|e| anyhow!("fixture: {e}"))?;
        let be = Backend::Cuda(CudaBackend::new(0)?);
        let engine = |eager: bool| -> Result<Engine<_, DraftProposer<'static>>> {
            Ok(Engine::with_draft(
                fx.target().map_err(|e| anyhow!("target: {e}"))?,
                fx.draft(&be).map_err(|e| anyhow!("draft: {e}"))?,
                fx.parts(&be).map_err(|e| anyhow!("parts: {e}"))?,
                &options(backend, eager),
            )?)
        };
        for temperature in [0.0f32, 0.8] {
            let mut graph = engine(false)?;
            let mut eager = engine(true)?;
            let profiles = graph.proposer().graph_profiles();
            let eager_reason = eager
                .proposer()
                .eager_reason()
                .unwrap_or("NOT EAGER")
                .to_string();
            ensure!(
                eager.proposer().graph_profiles().is_empty(),
                "the eager engine captured graphs"
            );
            let (g, mut gt, live, _) = drive(&mut graph, requests(temperature))?;
            let (e, mut et, _, _) = drive(&mut eager, requests(temperature))?;
            let (verify_replays, verify_captures, refused) = graph.verify_graphs();
            let verify_refused = refused.map(str::to_string);
            let verify_replays_eager = eager.verify_graphs().0;
            let mut distinct = live.clone();
            distinct.sort_unstable_by(|a, b| b.cmp(a));
            distinct.dedup();
            comparisons.push(Comparison {
                backend: name,
                temperature,
                equal_outputs: g
                    .outputs
                    .iter()
                    .zip(&e.outputs)
                    .filter(|(a, b)| a == b)
                    .count(),
                requests: g.outputs.len(),
                equal_rounds: g.rounds == e.rounds,
                rounds: g.rounds.len(),
                replays: graph.proposer().graph_replays(),
                verify_replays,
                verify_captures,
                verify_refused,
                verify_replays_eager,
                live_rows: distinct,
                profiles,
                eager_reason,
                accepted: g.rounds.iter().flatten().map(|r| r.1).sum(),
                step_graph_us: median(&mut gt),
                step_eager_us: median(&mut et),
            });
        }
        let propose = propose_timings(&fx, &be, backend, name)?;
        rounds.push(round_timing(&fx, &be, backend, name, &propose)?);
        timings.extend(propose);
    }
    Ok(RoundGraphResult {
        comparisons,
        timings,
        rounds,
    })
}

/// Record a greedy run over the reference target, then replay it (graph profiles, then
/// eager) over the stand-in target serving the recording from device memory.
fn round_timing(
    fx: &Fixture,
    be: &Backend,
    backend: DraftBackend,
    name: &'static str,
    propose: &[ProposeTiming],
) -> Result<RoundTiming> {
    fn engine<T: Target>(
        fx: &Fixture,
        be: &Backend,
        backend: DraftBackend,
        target: T,
        eager: bool,
    ) -> Result<Engine<T, DraftProposer<'static>>> {
        Ok(Engine::with_draft(
            target,
            fx.draft(be).map_err(|e| anyhow!("draft: {e}"))?,
            fx.parts(be).map_err(|e| anyhow!("parts: {e}"))?,
            &options(backend, eager),
        )?)
    }
    let recorder = Recorder::new(fx.target().map_err(|e| anyhow!("target: {e}"))?);
    let mut rec = engine(fx, be, backend, recorder, false)?;
    let (want, _, _, _) = drive(&mut rec, requests(0.0))?;
    let mut replay = rec.into_parts().0.into_replay(be)?;
    let mut medians = Vec::new();
    let mut reproduced = true;
    let mut rests = Vec::new();
    let mut proposes = Vec::new();
    let mut rounds = 0;
    let (mut allocations_per_round, mut syncs_per_round) = (f64::NAN, f64::NAN);
    let mut verify_replays = 0;
    // First a replay that also reads back every device round's verify input ids and
    // compares them with the recorded tokens (the draft's assembly of [anchor, proposals]):
    // untimed, since the read is an extra synchronize.
    replay.rewind();
    replay.check_ids(true);
    let mut e = engine(fx, be, backend, replay, false)?;
    let (got, ..) = drive(&mut e, requests(0.0))?;
    replay = e.into_parts().0;
    reproduced &= got == want && !replay.diverged() && replay.ids_checked() > 0;
    replay.check_ids(false);
    for eager in [false, true] {
        replay.rewind();
        let mut e = engine(fx, be, backend, replay, eager)?;
        let (got, mut times, live, costs) = drive(&mut e, requests(0.0))?;
        if !eager {
            let per = |x: u64| x as f64 / costs.rounds.max(1) as f64;
            allocations_per_round = per(costs.allocations);
            syncs_per_round = per(costs.synchronizations);
            verify_replays = e.verify_graphs().0;
        }
        replay = e.into_parts().0;
        reproduced &= got == want && !replay.diverged();
        if !eager {
            rounds = times.len();
            for (t, n) in times.iter().zip(&live) {
                let p = propose
                    .iter()
                    .find(|p| p.rows == *n)
                    .map_or(f64::NAN, |p| p.graph_us);
                proposes.push(p);
                rests.push(t - p);
            }
        }
        medians.push(median(&mut times));
    }
    Ok(RoundTiming {
        backend: name,
        rounds,
        reproduced,
        round_graph_us: medians[0],
        round_eager_us: medians[1],
        propose_us: median(&mut proposes),
        rest_us: median(&mut rests),
        allocations_per_round,
        syncs_per_round,
        verify_replays,
    })
}

/// Time `propose` on standalone proposers (graph and eager) over B materialized requests.
fn propose_timings(
    fx: &Fixture,
    be: &Backend,
    backend: DraftBackend,
    name: &'static str,
) -> Result<Vec<ProposeTiming>> {
    let mut target = fx.target().map_err(|e| anyhow!("target: {e}"))?;
    let prompts = demo_prompts(B as usize, 9);
    let mut proposers = Vec::new();
    for eager in [false, true] {
        let mut p = DraftProposer::new(
            fx.draft(be).map_err(|e| anyhow!("draft: {e}"))?,
            fx.parts(be).map_err(|e| anyhow!("parts: {e}"))?,
            &options(backend, eager),
        )?;
        let mut slots = Vec::new();
        for prompt in &prompts {
            let (_, out) = target.create_with_prompt(be, prompt)?;
            let slot = p.admit(256)?;
            p.push_prefill(slot, 0, out.features)?;
            p.materialize(slot)?;
            slots.push(slot);
        }
        proposers.push((p, slots));
    }
    let mut out = Vec::new();
    for rows in 1..=B as usize {
        let mut times = [Vec::new(), Vec::new()];
        let mut equal = true;
        for _ in 0..60 {
            let mut results = Vec::new();
            for (i, (p, slots)) in proposers.iter_mut().enumerate() {
                let reqs: Vec<ProposeRow<'_, _>> = slots[..rows]
                    .iter()
                    .zip(&prompts)
                    .enumerate()
                    .map(|(r, (&slot, prompt))| ProposeRow {
                        slot,
                        anchor: prompt[prompt.len() - 1],
                        frontier: prompt.len() - 1,
                        usable: K as usize,
                        temperature: 0.5 * r as f32,
                        seed: 3 + r as u64,
                        history: prompt,
                    })
                    .collect();
                let t0 = Instant::now();
                results.push(p.propose(&reqs)?);
                times[i].push(t0.elapsed().as_secs_f64() * 1e6);
            }
            equal &= results[0] == results[1];
        }
        let [mut g, mut e] = times;
        // The first iterations warm caches; the medians are over all 60 regardless.
        out.push(ProposeTiming {
            backend: name,
            rows,
            graph_us: median(&mut g),
            eager_us: median(&mut e),
            equal,
        });
    }
    Ok(out)
}

/// The report section and whether it passed.
pub fn section(results: &Result<RoundGraphResult>) -> (String, bool) {
    let mut s = format!(
        "## engine_round_graph\n\nThe engine's draft block (block forward, head, DFlash2 selector) replayed \
from its CUDA graph profiles (one per live-row bucket, captured at startup) against the same engine run \
eagerly (`EngineOptions::eager`): {B} requests of different lengths (the live rows shrink through the \
buckets), K = {K}, B = {B}, the trained pair with the CPU reference target as the stand-in target, greedy and \
sampled. Every output and every row-round (proposals, accepted count, licensed tokens, committed count) \
must be equal, and every round must replay a graph. The verification ops replay graphs too, recorded the \
second time a (live rows, lent logits, proposal buffers) key is seen: some rounds must replay one, none may \
in the eager engine, and no capture may fail.\n\n| draft | T | outputs equal | row-rounds equal | \
rounds | replayed | verify replayed | verify graphs | live rows seen | profiles | accepted | eager because | step graph (µs) | step eager (µs) | pass |\n\
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    match results {
        Ok(r) => {
            let mut ok = !r.comparisons.is_empty();
            for c in &r.comparisons {
                let pass = c.equal_outputs == c.requests
                    && c.equal_rounds
                    && c.replays == c.rounds as u64
                    && c.rounds > 0
                    && c.accepted > 0
                    && c.live_rows.len() > 1
                    && c.eager_reason != "NOT EAGER"
                    && c.verify_replays > 0
                    && c.verify_refused.is_none()
                    && c.verify_replays_eager == 0;
                ok &= pass;
                s.push_str(&format!(
                    "| {} | {} | {}/{} | {} | {} | {} | {} | {}{} | {:?} | {:?} | {} | {} | {:.0} | {:.0} | {} |\n",
                    c.backend,
                    c.temperature,
                    c.equal_outputs,
                    c.requests,
                    if c.equal_rounds { "yes" } else { "NO" },
                    c.rounds,
                    c.replays,
                    c.verify_replays,
                    c.verify_captures,
                    c.verify_refused
                        .as_deref()
                        .map_or(String::new(), |r| format!(" (refused: {r})")),
                    c.live_rows,
                    c.profiles,
                    c.accepted,
                    c.eager_reason,
                    c.step_graph_us,
                    c.step_eager_us,
                    if pass { "pass" } else { "FAIL" }
                ));
            }
            s.push_str(
                "\nThe draft's propose (stage the rows' metadata, the block, one read of the results) on \
standalone proposers, median of 60 calls:\n\n| draft | live rows | graph (µs) | eager (µs) | eager / graph | \
proposals equal | pass |\n|---|---|---|---|---|---|---|\n",
            );
            for t in &r.timings {
                ok &= t.equal;
                s.push_str(&format!(
                    "| {} | {} | {:.1} | {:.1} | {:.2} | {} | {} |\n",
                    t.backend,
                    t.rows,
                    t.graph_us,
                    t.eager_us,
                    t.eager_us / t.graph_us,
                    if t.equal { "yes" } else { "NO" },
                    if t.equal { "pass" } else { "FAIL" }
                ));
            }
            s.push_str(
                "\nEngine rounds over a GPU-resident stand-in target (the reference target's recorded \
prefill and verify outputs, served in place from device memory in recorded order: its verify costs only \
bookkeeping), greedy, medians over the rounds: the round (`Engine::step`), the draft's propose at the \
round's live rows (graph, from the table above), and the rest of the round (round minus propose: \
materialize, the verification ops, the round's reads and the engine's host work).\n\n| draft | rounds | \
replay reproduces the recording | round graph (µs) | round eager (µs) | propose (µs) | rest (µs) | \
rest / round | allocations / round | synchronizations / round | verify replayed | pass |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n",
            );
            for t in &r.rounds {
                let pass = t.reproduced
                    && t.allocations_per_round == 0.0
                    && t.syncs_per_round <= 1.0
                    && t.verify_replays > 0;
                ok &= pass;
                s.push_str(&format!(
                    "| {} | {} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.2} | {:.2} | {:.2} | {} | {} |\n",
                    t.backend,
                    t.rounds,
                    if t.reproduced { "yes" } else { "NO" },
                    t.round_graph_us,
                    t.round_eager_us,
                    t.propose_us,
                    t.rest_us,
                    t.rest_us / t.round_graph_us,
                    t.allocations_per_round,
                    t.syncs_per_round,
                    t.verify_replays,
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
