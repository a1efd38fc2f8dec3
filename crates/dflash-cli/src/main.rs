//! `dflash`: the README's main job — end-to-end speculative decoding on an embedded default.
//!
//! By default it writes a synthetic DFlash (or DFlash2) draft checkpoint matched to the
//! reference hybrid target of `dflash-testkit` into a scratch directory, decodes a few prompts
//! with speculative decoding on the CPU, prints a per-round trace and a summary, and checks
//! that the output equals plain greedy target decoding (exit status 1 on a mismatch).
//!
//! Flags: `--backend dflash|dflash2`, `--k N` (1..=15), `--b N` (1..=8), `--temperature T`,
//! `--seed S`, `--prompts N`, `--max-new N`, `--device cpu|cuda` (cuda needs the `cuda`
//! feature: the draft, context and verification run on the GPU, the target stays the CPU
//! reference whose outputs are uploaded), `--oracle RHO` (replace the draft by the shadow
//! oracle proposer: the target's own greedy tokens with probability RHO, random ones otherwise,
//! to show long acceptances), `--quiet` (no per-round trace), `--geometry` (print the bundled
//! official configs' geometry instead).

#![allow(clippy::print_stdout)] // reason: a binary reports on stdout

mod geometry;

use std::collections::HashMap;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use dflash_cli::shadow::{ShadowProposer, Strategy};
use dflash_cli::{Fixture, demo_prompts, format_step, target_geometry};
use dflash_config::{Backend as DraftBackend, StartupOptions};
use dflash_engine::{
    Engine, EngineOptions, EngineStats, Event, FinishReason, Proposer, Request, RequestId,
    SamplingSettings, StopConditions, Target, plain_decode,
};
use dflash_ops::Backend;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Device {
    Cpu,
    Cuda,
}

#[derive(Debug, Clone)]
struct Args {
    backend: DraftBackend,
    k: u32,
    b: u32,
    temperature: f32,
    seed: u64,
    prompts: usize,
    max_new: usize,
    device: Device,
    oracle: Option<f64>,
    quiet: bool,
    geometry: bool,
}

const USAGE: &str = "usage: dflash [--backend dflash|dflash2] [--k N] [--b N] [--temperature T] \
[--seed S] [--prompts N] [--max-new N] [--device cpu|cuda] [--oracle RHO] [--quiet] [--geometry]";

fn parse_args() -> Result<Args> {
    let mut a = Args {
        backend: DraftBackend::DFlash,
        k: 7,
        b: 4,
        temperature: 0.0,
        seed: 1,
        prompts: 4,
        max_new: 32,
        device: Device::Cpu,
        oracle: None,
        quiet: false,
        geometry: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .with_context(|| format!("{name} needs a value\n{USAGE}"))
        };
        match flag.as_str() {
            "--backend" => {
                a.backend = match value("--backend")?.as_str() {
                    "dflash" => DraftBackend::DFlash,
                    "dflash2" => DraftBackend::DFlash2,
                    other => bail!("--backend: `{other}` is not dflash or dflash2"),
                }
            }
            "--k" => a.k = value("--k")?.parse().context("--k: not a number")?,
            "--b" => a.b = value("--b")?.parse().context("--b: not a number")?,
            "--temperature" => {
                a.temperature = value("--temperature")?
                    .parse()
                    .context("--temperature: not a number")?
            }
            "--seed" => a.seed = value("--seed")?.parse().context("--seed: not a number")?,
            "--prompts" => {
                a.prompts = value("--prompts")?
                    .parse()
                    .context("--prompts: not a number")?
            }
            "--max-new" => {
                a.max_new = value("--max-new")?
                    .parse()
                    .context("--max-new: not a number")?
            }
            "--device" => {
                a.device = match value("--device")?.as_str() {
                    "cpu" => Device::Cpu,
                    "cuda" => Device::Cuda,
                    other => bail!("--device: `{other}` is not cpu or cuda"),
                }
            }
            "--oracle" => {
                let rho: f64 = value("--oracle")?
                    .parse()
                    .context("--oracle: not a number")?;
                if !(0.0..=1.0).contains(&rho) {
                    bail!("--oracle: {rho} is not a probability in [0, 1]");
                }
                a.oracle = Some(rho);
            }
            "--quiet" => a.quiet = true,
            "--geometry" => a.geometry = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => bail!("unknown flag `{other}`\n{USAGE}"),
        }
    }
    if a.prompts == 0 {
        bail!("--prompts must be at least 1");
    }
    Ok(a)
}

fn backend(device: Device) -> Result<Backend> {
    match device {
        Device::Cpu => Ok(Backend::cpu()),
        #[cfg(feature = "cuda")]
        Device::Cuda => Ok(Backend::Cuda(
            dflash_ops::cuda::CudaBackend::new(0).context("opening CUDA device 0")?,
        )),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda => bail!("--device cuda needs a build with `--features cuda`"),
    }
}

/// What one engine run produced.
struct Run {
    ids: Vec<RequestId>,
    outputs: HashMap<RequestId, Vec<u32>>,
    finishes: HashMap<RequestId, FinishReason>,
    stats: EngineStats,
    held: (usize, usize),
    unfinished: usize,
    time: std::time::Duration,
}

/// Submit every request, step until idle printing the trace, and collect the results.
fn drive<T: Target, P: Proposer>(
    engine: &mut Engine<T, P>,
    requests: &[Request],
    quiet: bool,
) -> Result<Run> {
    println!(
        "memory plan: {} bytes ({})",
        engine.memory_plan().total(),
        engine.memory_plan()
    );
    let mut ids = Vec::new();
    for r in requests {
        ids.push(engine.submit(r.clone())?);
    }
    let mut outputs: HashMap<RequestId, Vec<u32>> = HashMap::new();
    let mut finishes: HashMap<RequestId, FinishReason> = HashMap::new();
    let t = Instant::now();
    let mut sink = |e: &Event| match e {
        Event::Tokens { id, tokens, .. } => outputs.entry(*id).or_default().extend(tokens),
        Event::Finished { id, reason, .. } => {
            finishes.insert(*id, *reason);
        }
    };
    while let Some(step) = engine.step(&mut sink)? {
        if !quiet {
            for line in format_step(&step) {
                println!("{line}");
            }
        }
    }
    let time = t.elapsed();
    let unfinished = ids
        .iter()
        .filter(|id| engine.finished(**id).is_none())
        .count();
    Ok(Run {
        ids,
        outputs,
        finishes,
        stats: engine.stats().clone(),
        held: engine.held(),
        unfinished,
        time,
    })
}

fn first_difference(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

fn main() -> Result<()> {
    let args = parse_args()?;
    if args.geometry {
        return geometry::report_all();
    }
    let be = backend(args.device)?;
    let g = target_geometry();
    println!(
        "dflash: speculative decoding on the embedded default: {:?} K={} B={} temperature {} seed {} on {}",
        args.backend,
        args.k,
        args.b,
        args.temperature,
        args.seed,
        be.name()
    );
    let fixture = Fixture::write(args.backend).context("writing the embedded default")?;
    let mut target = fixture.target()?;
    let model = fixture.draft(&be)?;
    println!(
        "target: reference hybrid (H {}, {} blocks, vocab {} rows / {} public, EOS {}), on the CPU; \
draft: synthetic {:?} ({} layers, captured blocks {:?}), on {}",
        g.hidden,
        g.layers(),
        g.vocab_rows,
        g.public_vocab,
        g.eos_token_id,
        args.backend,
        model.geometry().layers.len(),
        model.geometry().target_layer_ids,
        be.name()
    );

    let sampling = if args.temperature > 0.0 {
        SamplingSettings::sampling(args.temperature)
    } else {
        SamplingSettings::GREEDY
    };
    let requests: Vec<Request> = demo_prompts(args.prompts, args.seed)
        .into_iter()
        .enumerate()
        .map(|(i, prompt)| Request {
            prompt,
            max_new_tokens: args.max_new,
            sampling,
            seed: args.seed.wrapping_add(i as u64),
            stop: StopConditions::eos(g.eos_token_id),
        })
        .collect();

    // The baseline: plain target decoding on the CPU (greedy runs are checked against it).
    let greedy = sampling.temperature <= 0.0;
    let t0 = Instant::now();
    let mut expected = Vec::new();
    if greedy {
        for r in &requests {
            expected.push(plain_decode(&mut target, &Backend::cpu(), r)?.tokens);
        }
    }
    let baseline_time = t0.elapsed();

    let max_context = requests
        .iter()
        .map(|r| r.prompt.len() + r.max_new_tokens)
        .max()
        .unwrap_or(1);
    let options = EngineOptions {
        startup: StartupOptions {
            concurrency: args.b,
            ..StartupOptions::new(args.backend, args.k)
        },
        max_context,
        page_size: 16,
        memory_budget: 1 << 30,
    };
    let run = if let Some(rho) = args.oracle {
        let proposer = ShadowProposer::new(
            fixture.target()?,
            Strategy::Oracle { rho },
            args.k as usize,
            args.b as usize,
            args.seed,
        )?;
        println!("proposer: shadow oracle (the target's own greedy token with probability {rho})");
        let mut engine = Engine::new(target, proposer, be.clone(), &options)?;
        drive(&mut engine, &requests, args.quiet)?
    } else {
        let parts = fixture.parts(&be)?;
        let mut engine = Engine::with_draft(target, model, parts, &options)?;
        drive(&mut engine, &requests, args.quiet)?
    };
    let Run {
        ids,
        outputs,
        finishes,
        stats,
        held: (held_seqs, held_slots),
        unfinished,
        time: spec_time,
    } = run;

    println!();
    for (i, id) in ids.iter().enumerate() {
        let out = outputs.get(id).map(Vec::as_slice).unwrap_or_default();
        let reason = finishes
            .get(id)
            .map_or_else(|| "unfinished".to_owned(), ToString::to_string);
        println!(
            "{id}: prompt {} tokens -> {} tokens ({reason})",
            requests[i].prompt.len(),
            out.len()
        );
    }
    let row_rounds = stats.row_rounds.max(1) as f64;
    let secs = spec_time.as_secs_f64();
    println!(
        "summary: {} requests, {} tokens, {} rounds ({} row-rounds), mean accepted per row-round {:.2} \
({} of {} proposals), tokens per row-round {:.2}, time {:.3} s ({:.0} tokens/s); plain decoding {:.3} s",
        ids.len(),
        stats.tokens,
        stats.rounds,
        stats.row_rounds,
        stats.accepted as f64 / row_rounds,
        stats.accepted,
        stats.proposed,
        (stats.tokens as f64 - ids.len() as f64) / row_rounds,
        secs,
        stats.tokens as f64 / secs.max(1e-9),
        baseline_time.as_secs_f64()
    );
    let commits: Vec<String> = stats
        .commits
        .iter()
        .enumerate()
        .filter(|(_, c)| **c > 0)
        .map(|(n, c)| format!("N={n}: {c}"))
        .collect();
    println!("commits: {}", commits.join(", "));
    if held_seqs != 0 || held_slots != 0 {
        bail!("leak: {held_seqs} sequences and {held_slots} draft slots still held");
    }
    if unfinished != 0 {
        bail!("{unfinished} requests did not finish");
    }

    if greedy {
        let mut bad = 0;
        for (i, id) in ids.iter().enumerate() {
            let got = outputs.get(id).map(Vec::as_slice).unwrap_or_default();
            if got != expected[i].as_slice() {
                bad += 1;
                let at = first_difference(got, &expected[i]);
                println!(
                    "MISMATCH {id}: speculative {} tokens, plain {} tokens, first difference at output {at}",
                    got.len(),
                    expected[i].len()
                );
            }
        }
        if bad > 0 {
            bail!(
                "{bad} of {} requests differ from plain greedy target decoding",
                ids.len()
            );
        }
        println!(
            "check: speculative output == plain greedy target decoding for all {} requests: OK",
            ids.len()
        );
    } else {
        println!(
            "check: temperature > 0: outputs are seeded samples (their distribution is checked by \
the statistical end-to-end tests); no token-for-token comparison"
        );
    }
    Ok(())
}
