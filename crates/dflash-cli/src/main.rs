//! `dflash`: the README's main job — end-to-end speculative decoding on an embedded default.
//!
//! By default it writes the trained pair of `dflash-testkit` (a small Qwen3.5-style hybrid
//! target trained on real text and the DFlash or DFlash2 draft trained for it) into a scratch
//! directory, loads both, removes the scratch directory, decodes the built-in prompts (text
//! never used in training) or the `--prompt` texts with speculative decoding on the CPU,
//! prints a per-round trace (with a one-line legend), every prompt and continuation as text,
//! and a summary, times plain target decoding of the same requests, and checks at
//! temperature 0 that the output equals plain greedy decoding.
//!
//! Flags: `--backend dflash|dflash2`, `--k N` (1..=15; the drafts were trained with 7),
//! `--b N` (1..=8), `--temperature T` (finite, >= 0; 0 greedy), `--seed S`, `--prompts N`
//! (built-in prompts; default 4, or none when `--prompt` is given), `--prompt TEXT`
//! (repeatable), `--max-new N` (bounded by the run's memory plan and the target's positions),
//! `--device cpu|cuda` (cuda needs the `cuda` feature: the draft, context and verification run
//! on the GPU, the target stays the CPU reference whose outputs are uploaded), `--oracle RHO`
//! (replace the draft by the shadow oracle proposer: the target's own greedy tokens with
//! probability RHO, random ones otherwise), `--random-draft` (the default draft geometry with
//! random weights, to see an untrained draft), `--draft-config FILE` (a draft config.json of
//! any geometry that fits the target, with random weights), `--mask-token-id N` (for a config
//! whose mask token is null), `--strict` (refuse unknown config fields; by default they are
//! printed as warnings), `--eager` (run the draft block op by op instead of replaying its CUDA
//! graph profiles; debugging), `--quiet` (no per-round trace), `--geometry` (print the bundled
//! official configs' geometry instead).
//!
//! The summary line keeps its fields (`mean accepted per row-round X`, `tokens per row-round
//! Y`, ...) and appends the wall-time speedup against plain decoding, tokens per target verify
//! and the commit-length histogram.
//!
//! Every flag, the draft config and the run's size are checked before anything is written or
//! printed. Exit status: 0 success; 1 the run failed (a mismatch with plain decoding, a leak,
//! a device error); 2 a flag or a file was refused. The scratch directory is removed on every
//! exit path the process controls (success, error, panic) and, because everything is loaded
//! into memory before decoding starts, it exists only while the checkpoints are written and
//! read (a Ctrl-C during decoding leaves nothing behind).

#![allow(clippy::print_stdout)] // reason: a binary reports on stdout

mod geometry;

use std::collections::HashMap;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Result, bail};
use dflash_cli::args::{self, Args, Device, RunPlan};
use dflash_cli::shadow::{ShadowProposer, Strategy};
use dflash_cli::{
    ENGINE_MEMORY_BUDGET, Fixture, HarnessError, decode, format_step, target_geometry,
};
use dflash_engine::{
    Engine, EngineOptions, EngineStats, Event, FinishReason, Proposer, Request, RequestId,
    SamplingSettings, StopConditions, Target, plain_decode,
};
use dflash_ops::Backend;
use dflash_testkit::trained::TRAINED_K;

fn backend(device: Device) -> Result<Backend, HarnessError> {
    match device {
        Device::Cpu => Ok(Backend::cpu()),
        #[cfg(feature = "cuda")]
        Device::Cuda => Ok(Backend::Cuda(
            dflash_ops::cuda::CudaBackend::new(0).map_err(HarnessError::Ops)?,
        )),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda => Err(HarnessError::Flag {
            flag: "--device".into(),
            expected: "cpu (this build has no `cuda` feature; build with `--features cuda`)".into(),
            found: "cuda".into(),
        }),
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

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let checked = args::parse_args(&argv).and_then(|a| {
        if a.help || a.geometry {
            return Ok((a, None));
        }
        let plan = args::plan(&a)?;
        let be = backend(a.device)?;
        Ok((a, Some((plan, be))))
    });
    let (a, planned) = match checked {
        Ok(x) => x,
        Err(e) => {
            eprintln!("dflash: error: {e}");
            return ExitCode::from(e.exit_code());
        }
    };
    let result = match planned {
        None if a.help => {
            println!("{}", args::USAGE);
            Ok(())
        }
        None => geometry::report_all(),
        Some((plan, be)) => run(&a, &plan, be),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dflash: error: {e:#}");
            let code = e
                .downcast_ref::<HarnessError>()
                .map_or(1, HarnessError::exit_code);
            ExitCode::from(code)
        }
    }
}

/// The one-line legend of the trace fields.
const LEGEND: &str = "trace: r<id> F=<frontier: positions the target has processed; the anchor sits at F> \
ctx=<draft context before the round: materialized+pending> P=<proposals verified> d=[<proposed ids>] \
A=<accepted> L=<licensed outputs, A+1> N=<committed outputs> out=[<published ids>] (ids are bytes; 256 is EOS)";

fn run(args: &Args, plan: &RunPlan, be: Backend) -> Result<()> {
    for w in plan.report.warnings() {
        eprintln!("warning: {w} (--strict refuses it)");
    }
    for n in plan.report.note_lines() {
        eprintln!("note: {n}");
    }
    let g = target_geometry();
    let draft_backend = plan.startup.backend;
    println!(
        "dflash: speculative decoding on the embedded default: {:?} K={} B={} temperature {} seed {} on {}",
        draft_backend,
        args.k,
        args.b,
        args.temperature,
        args.seed,
        be.name()
    );
    if let Some(path) = &args.draft_config {
        println!("draft config: {}", path.display());
    }
    // Write the checkpoints, load everything the run needs, and remove the scratch directory
    // before decoding starts.
    let fixture = if plan.random_draft {
        Fixture::write_config(&plan.draft_config_json)?
    } else {
        Fixture::write(draft_backend)?
    };
    let target = fixture.target()?;
    let mut baseline_target = fixture.target()?;
    let model = fixture.draft(&be)?;
    let oracle = match args.oracle {
        Some(rho) => Some((
            rho,
            ShadowProposer::new(
                fixture.target()?,
                Strategy::Oracle { rho },
                args.k as usize,
                args.b as usize,
                args.seed,
            )?,
        )),
        None => None,
    };
    let parts = fixture.parts(&be)?;
    drop(fixture);
    println!(
        "target: trained reference hybrid (H {}, {} blocks: 3 Gated DeltaNet + 1 gated attention, \
byte vocabulary {} public ids in {} rows, EOS {}), on the CPU; draft: {} {:?} ({} layers, captured \
blocks {:?}), on {}",
        g.hidden,
        g.layers(),
        g.public_vocab,
        g.vocab_rows,
        g.eos_token_id,
        if plan.random_draft {
            "RANDOM-weight"
        } else {
            "trained"
        },
        draft_backend,
        model.geometry().layers.len(),
        model.geometry().target_layer_ids,
        be.name()
    );
    if plan.random_draft && args.oracle.is_none() {
        println!(
            "note: the draft has random weights on purpose ({}): it proposes noise, so almost \
nothing is accepted and speculative decoding is slower than plain decoding; without that flag \
the trained draft runs",
            if args.draft_config.is_some() {
                "--draft-config"
            } else {
                "--random-draft"
            }
        );
    }
    if !plan.random_draft && args.oracle.is_none() && args.k != TRAINED_K {
        println!(
            "note: the drafts were trained with K={TRAINED_K}; K={} runs them outside their training",
            args.k
        );
    }

    let sampling = if args.temperature > 0.0 {
        SamplingSettings::sampling(args.temperature)
    } else {
        SamplingSettings::GREEDY
    };
    let requests: Vec<Request> = plan
        .prompts
        .iter()
        .enumerate()
        .map(|(i, prompt)| Request {
            prompt: prompt.clone(),
            max_new_tokens: args.max_new,
            sampling,
            seed: args.seed.wrapping_add(i as u64),
            stop: StopConditions::eos(g.eos_token_id),
        })
        .collect();
    let max_context = requests
        .iter()
        .map(|r| r.prompt.len() + r.max_new_tokens)
        .max()
        .unwrap_or(1);
    let options = EngineOptions {
        startup: dflash_config::StartupOptions {
            concurrency: args.b,
            mask_token_id: Some(plan.startup.mask_token_id),
            tree_nodes: args.tree_nodes,
            ..dflash_config::StartupOptions::new(draft_backend, args.k)
        },
        max_context,
        page_size: 16,
        memory_budget: ENGINE_MEMORY_BUDGET,
        eager: args.eager,
    };

    // The engine (its whole memory plan checked) first, then the baseline: plain target
    // decoding on the CPU of the same requests and seeds (greedy runs are checked against it
    // token for token; sampled runs are timed against it).
    enum Built<T: Target> {
        Oracle(Box<Engine<T, ShadowProposer>>),
        Draft(Box<Engine<T, dflash_engine::DraftProposer<'static>>>),
    }
    let mut engine = match oracle {
        Some((rho, proposer)) => {
            println!(
                "proposer: shadow oracle (the target's own greedy token with probability {rho})"
            );
            Built::Oracle(Box::new(Engine::new(
                target,
                proposer,
                be.clone(),
                &options,
            )?))
        }
        None => Built::Draft(Box::new(Engine::with_draft(
            target, model, parts, &options,
        )?)),
    };
    let greedy = sampling.temperature <= 0.0;
    let t0 = Instant::now();
    let mut expected = Vec::new();
    for r in &requests {
        expected.push(plain_decode(&mut baseline_target, &Backend::cpu(), r)?.tokens);
    }
    let baseline_time = t0.elapsed();
    if !args.quiet {
        println!("{LEGEND}");
    }
    let run = match &mut engine {
        Built::Oracle(e) => drive(e, &requests, args.quiet)?,
        Built::Draft(e) => drive(e, &requests, args.quiet)?,
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
        println!("    prompt: {:?}", decode(&requests[i].prompt));
        println!("    output: {:?}", decode(out));
    }
    let row_rounds = stats.row_rounds.max(1) as f64;
    let secs = spec_time.as_secs_f64();
    let base_secs = baseline_time.as_secs_f64();
    let decoded = stats.tokens.saturating_sub(ids.len() as u64);
    let commits: Vec<String> = stats
        .commits
        .iter()
        .enumerate()
        .filter(|(_, c)| **c > 0)
        .map(|(n, c)| format!("N={n}: {c}"))
        .collect();
    println!(
        "summary: {} requests, {} tokens, {} rounds ({} row-rounds), mean accepted per row-round {:.2} \
({} of {} proposals), tokens per row-round {:.2}, time {:.3} s ({:.0} tokens/s); plain decoding {:.3} s; \
wall-time speedup {:.2}x; tokens per target verify {:.2} ({} verify row-rounds for {} decoded tokens, \
plain decoding needs one target forward per token); commit lengths [{}]",
        ids.len(),
        stats.tokens,
        stats.rounds,
        stats.row_rounds,
        stats.accepted as f64 / row_rounds,
        stats.accepted,
        stats.proposed,
        decoded as f64 / row_rounds,
        secs,
        stats.tokens as f64 / secs.max(1e-9),
        base_secs,
        base_secs / secs.max(1e-9),
        decoded as f64 / row_rounds,
        stats.row_rounds,
        decoded,
        commits.join(", ")
    );
    println!("commits: {}", commits.join(", "));
    println!(
        "note: wall time is the CPU reference target's: it computes a verify one column at a time, \
so a verify of Q columns costs about Q plain decode steps and the draft adds its own work; on an \
engine whose verify costs about one forward (a GPU), the gain is the tokens per target verify"
    );
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
