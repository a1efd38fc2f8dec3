//! The CUDA conformance runner: every registry case on the GPU against the CPU reference.
//!
//! `dflash-conformance [--out DIR] [--only SUBSTRING[,SUBSTRING..]] [--skip-heavy] [--exclude SUBSTRING]`
//! (`--exclude` skips the heavy cases whose `op/case` contains the substring): prints a table, writes
//! `DIR/conformance.md` and `DIR/conformance.json`. Exit status 0 when every case passes,
//! 1 when one fails, 3 when there is no usable CUDA device (driver missing, no GPU).
//!
//! On a device where ops of `ARCH_SPECIFIC_OPS` use their sm_90a variant (or those of
//! `DEPENDENT_LAUNCH_OPS` their programmatic dependent launch, or those of `CLUSTER_OPS` their
//! thread-block clusters), their cases run twice: on the default backend and on one restricted
//! to the portable kernels and ordinary launches (rows `case [portable]`).

// First: its macros serve the modules below.
#[macro_use]
#[path = "../../stand_in.rs"]
mod stand_in;
mod graph;
mod host;
mod replay_target;
#[path = "../../report.rs"]
mod report;
mod round_graph;

use report::{driver_version, utc_now};

use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result};
use dflash_ops::Backend;
use dflash_ops::cuda::{
    ARCH_SPECIFIC_OPS, CLUSTER_OPS, CudaBackend, CudaOptions, DEPENDENT_LAUNCH_OPS, KernelVariants,
};
use dflash_ops::registry::{self, Case, CaseRun, Comparison};

struct Row {
    cmp: Comparison,
    cpu_ms: f64,
    gpu_ms: f64,
    error: Option<String>,
}

/// Run `case` on `gpu`, compare with the CPU `reference` and append the rows (their case
/// names get `suffix`).
fn run_case(
    case: &Case,
    reference: &dflash_ops::Result<CaseRun>,
    cpu_ms: f64,
    gpu: &Backend,
    suffix: &str,
    rows: &mut Vec<Row>,
) {
    let first_row = rows.len();
    let t1 = Instant::now();
    let device = (case.run)(gpu).and_then(|r| gpu.synchronize().map(|()| r));
    let gpu_ms = t1.elapsed().as_secs_f64() * 1e3;
    let name = format!("{}{suffix}", case.name);
    match (reference, device) {
        (Ok(r), Ok(d)) => {
            for mut cmp in registry::compare(case, r, &d) {
                cmp.case = name.clone();
                rows.push(Row {
                    cmp,
                    cpu_ms,
                    gpu_ms,
                    error: None,
                });
            }
        }
        (r, d) => {
            let error = Some(format!(
                "cpu: {}; cuda: {}",
                r.as_ref().err().map_or("ok".into(), |e| e.to_string()),
                d.err().map_or("ok".into(), |e| e.to_string())
            ));
            rows.push(Row {
                cmp: Comparison {
                    op: case.op,
                    case: name.clone(),
                    output: "<run>".into(),
                    criterion: registry::Criterion::Exact,
                    max_abs: f64::NAN,
                    max_rel: f64::NAN,
                    mismatches: 1,
                    elements: 0,
                    footprint_ok: false,
                    inputs_unchanged: false,
                    nondegenerate: false,
                    pass: false,
                },
                cpu_ms,
                gpu_ms,
                error,
            });
        }
    }
    // `ok` only when every output row of the case passed.
    let case_rows = &rows[first_row..];
    let all = !case_rows.is_empty() && case_rows.iter().all(|r| r.cmp.pass);
    eprintln!(
        "{:>5} {}/{name} ({cpu_ms:.0} ms cpu, {gpu_ms:.1} ms cuda)",
        if all { "ok" } else { "FAIL" },
        case.op,
    );
}

fn main() -> ExitCode {
    match run() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("dflash-conformance: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn run() -> Result<ExitCode> {
    let args: Vec<String> = std::env::args().collect();
    let out_dir = args
        .iter()
        .position(|a| a == "--out")
        .and_then(|i| args.get(i + 1))
        .cloned();
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1))
        .cloned();
    let skip_heavy = args.iter().any(|a| a == "--skip-heavy");
    let heavy_only = args.iter().any(|a| a == "--heavy-only");
    let exclude = args
        .iter()
        .position(|a| a == "--exclude")
        .and_then(|i| args.get(i + 1))
        .cloned();
    let cuda = match CudaBackend::new(0) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("dflash-conformance: no usable CUDA device: {e}");
            return Ok(ExitCode::from(3));
        }
    };
    let info = cuda.device_info().context("reading device info")?;
    let gpu = Backend::Cuda(cuda.clone());
    // On a device where some ops use an architecture-specific variant, a dependent launch or
    // clusters, their cases run a second time on a backend restricted to the portable kernels.
    let portable = if cuda.uses_sm90a() || cuda.uses_dependent_launch() || cuda.uses_clusters() {
        let options = CudaOptions {
            kernels: KernelVariants::Portable,
            ..Default::default()
        };
        Some(Backend::Cuda(
            CudaBackend::with_options(0, options).context("opening the portable backend")?,
        ))
    } else {
        None
    };
    let cpu = Backend::cpu();
    let mut rows: Vec<Row> = Vec::new();
    let mut cases = registry::cases();
    cases.extend(dflash_draft::conformance_cases());
    for case in cases {
        // `--only A,B`: the cases whose `op/case` contains any of the substrings.
        if let Some(o) = &only
            && !o
                .split(',')
                .any(|part| format!("{}/{}", case.op, case.name).contains(part))
        {
            continue;
        }
        if let Some(x) = &exclude
            && case.heavy
            && format!("{}/{}", case.op, case.name).contains(x.as_str())
        {
            continue;
        }
        if (skip_heavy && case.heavy) || (heavy_only && !case.heavy) {
            continue;
        }
        let t0 = Instant::now();
        let reference = (case.run)(&cpu);
        let cpu_ms = t0.elapsed().as_secs_f64() * 1e3;
        run_case(&case, &reference, cpu_ms, &gpu, "", &mut rows);
        if let Some(p) = &portable
            && (ARCH_SPECIFIC_OPS.contains(&case.op)
                || DEPENDENT_LAUNCH_OPS.contains(&case.op)
                || CLUSTER_OPS.contains(&case.op))
        {
            run_case(&case, &reference, cpu_ms, p, " [portable]", &mut rows);
        }
    }
    let mut failed = rows.iter().filter(|r| !r.cmp.pass).count();
    let graph_md = match graph::check(&cuda) {
        Ok(g) => {
            let ok = g.mismatches.iter().all(Vec::is_empty) && g.varied.len() >= 8;
            if !ok {
                failed += 1;
            }
            let mut s = format!(
                "## CUDA-graph replay\n\nThe per-round ops (context_kv_materialize, sliding_window_attention, candidate_selector, \
target_distribution, chain_accept) captured once into one CUDA graph, replayed under {} different device-metadata sets \
(context start, counts, lanes, live columns, seeds, temperatures rewritten between replays) and compared bit for bit with \
eager runs of the same metadata.\n\n| replay | outputs differing from eager |\n|---|---|\n",
                g.replays
            );
            for (i, m) in g.mismatches.iter().enumerate() {
                s.push_str(&format!(
                    "| {i} | {} |\n",
                    if m.is_empty() {
                        "none".to_string()
                    } else {
                        m.join(", ")
                    }
                ));
            }
            s.push_str(&format!(
                "\nOutputs that changed across metadata sets (the metadata mattered): {}.\n\nVerdict: {}.\n",
                g.varied.join(", "),
                if ok { "pass" } else { "FAIL" }
            ));
            s
        }
        Err(e) => {
            failed += 1;
            format!("## CUDA-graph replay\n\nFAILED to run: {e:#}\n")
        }
    };
    let (host_md, host_ok) = host::section(&host::check());
    if !host_ok {
        failed += 1;
    }
    let (round_graph_md, round_graph_ok) = round_graph::section(&round_graph::check());
    if !round_graph_ok {
        failed += 1;
    }
    let command = args.join(" ");
    let mut md = String::new();
    md.push_str("# Conformance report: CUDA vs the CPU reference\n\n");
    md.push_str(&format!(
        "- date: {}\n- GPU: {} ({})\n- driver: {}\n- CUDA (driver API): {}\n- NVRTC: {}\n- command: `{}`\n- result: {} rows, {} failed\n\n",
        utc_now(),
        info.name,
        info.arch,
        driver_version(),
        info.driver_cuda_version,
        info.nvrtc_version,
        command,
        rows.len(),
        failed
    ));
    md.push_str("Criteria: `exact` = bit-identical; `close(abs a, rel r, n bf16 ulp)` = |d - r| <= max(a + r*|ref|, n ulp_bf16(ref)). \
Footprint = outputs were poisoned first, every contracted element was written and nothing else changed. \
Inputs = every input downloaded after the run equals what was uploaded.\n\n");
    md.push_str("| op | case | output | criterion | elements | max abs | max rel | footprint | inputs unchanged | pass |\n|---|---|---|---|---|---|---|---|---|---|\n");
    let mut json_rows = Vec::new();
    for r in &rows {
        let c = &r.cmp;
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {:.3e} | {:.3e} | {} | {} | {} |\n",
            c.op,
            c.case,
            c.output,
            c.criterion,
            c.elements,
            c.max_abs,
            c.max_rel,
            if c.footprint_ok { "ok" } else { "FAIL" },
            if c.inputs_unchanged { "ok" } else { "FAIL" },
            if c.pass { "pass" } else { "FAIL" }
        ));
        json_rows.push(serde_json::json!({
            "op": c.op, "case": c.case, "output": c.output, "criterion": c.criterion.to_string(),
            "elements": c.elements, "max_abs": c.max_abs, "max_rel": c.max_rel,
            "mismatches": c.mismatches, "footprint_ok": c.footprint_ok,
            "inputs_unchanged": c.inputs_unchanged, "nondegenerate": c.nondegenerate,
            "pass": c.pass, "cpu_ms": r.cpu_ms, "gpu_ms": r.gpu_ms, "error": r.error,
        }));
    }
    md.push('\n');
    md.push_str(&graph_md);
    md.push('\n');
    md.push_str(&host_md);
    md.push('\n');
    md.push_str(&round_graph_md);
    for r in rows.iter().filter(|r| r.error.is_some()) {
        md.push_str(&format!(
            "\n- error in {}/{}: {}\n",
            r.cmp.op,
            r.cmp.case,
            r.error.as_deref().unwrap_or("")
        ));
    }
    println!("{md}");
    if let Some(dir) = out_dir {
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {dir}"))?;
        std::fs::write(format!("{dir}/conformance.md"), &md)?;
        let json = serde_json::json!({
            "date": utc_now(), "gpu": info.name, "arch": info.arch, "driver": driver_version(),
            "driver_cuda_version": info.driver_cuda_version, "nvrtc_version": info.nvrtc_version,
            "command": command, "rows": json_rows,
        });
        std::fs::write(
            format!("{dir}/conformance.json"),
            serde_json::to_string_pretty(&json)?,
        )?;
    }
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
