//! Compile every kernel module through NVRTC for a list of GPU architectures, without a GPU
//! (NVRTC and the CUDA headers are enough): proof that the kernels build for every
//! architecture the crates support, sm_80 and later.
//!
//! `dflash-kernels [--arch sm_80,sm_86,...] [--only NAME] [--resources]` (default: sm_80,
//! sm_86, sm_89, sm_90, sm_100, sm_120), plus every architecture-specific module for its own
//! architecture (the wgmma heads and attention splits for sm_90a); `--only` keeps the modules
//! whose name contains NAME (e.g. `attention`). Prints one line per (module, arch) and
//! exits 1 when any compile fails, 3 when NVRTC or the headers cannot be found.
//! `--resources` compiles each (module, arch) through ptxas with `-v` instead and prints one
//! line per entry point (registers, stack frame, spill bytes per thread, `SPILLS` where ptxas
//! spilled registers to local memory), ptxas's warnings as they are, and a count of the
//! spilling entries and of the warnings; it exits 1 only
//! when a compile fails (some spills are known and small: the report is for comparing builds).
//!
//! No GPU and no CUDA toolkit install are needed: NVRTC and the headers of the PyPI wheels
//! `nvidia-cuda-nvrtc==13.0.*` and `nvidia-cuda-runtime==13.0.*`, unpacked (`unzip`), serve
//! with `LD_LIBRARY_PATH=<unpacked>/nvidia/cu13/lib CUDA_HOME=<unpacked>/nvidia/cu13`.

#[path = "../ptxas.rs"]
mod ptxas;

use std::process::ExitCode;

/// The value after `flag`: `Ok(None)` when the flag is absent, `Err` (exit status 2, the
/// message printed) when it is the last argument.
fn flag_value(args: &[String], flag: &str, what: &str) -> Result<Option<String>, ExitCode> {
    match args.iter().position(|a| a == flag) {
        None => Ok(None),
        Some(i) => args.get(i + 1).cloned().map(Some).ok_or_else(|| {
            eprintln!("dflash-kernels: {flag} needs {what}");
            ExitCode::from(2)
        }),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let (archs, only) = match (
        flag_value(&args, "--arch", "a comma-separated list"),
        flag_value(&args, "--only", "a module name (or part of one)"),
    ) {
        (Ok(a), Ok(o)) => (a, o),
        (Err(e), _) | (_, Err(e)) => return e,
    };
    let archs: Vec<String> = match archs {
        Some(v) => v.split(',').map(str::to_string).collect(),
        None => ["sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120"]
            .map(str::to_string)
            .to_vec(),
    };
    let mut jobs: Vec<(&'static str, String, String)> = Vec::new();
    for (module, source) in dflash_ops::cuda::kernel_modules() {
        for arch in &archs {
            jobs.push((module, source.clone(), arch.clone()));
        }
    }
    for (module, source, arch) in dflash_ops::cuda::arch_specific_modules() {
        jobs.push((module, source, arch.to_string()));
    }
    if let Some(only) = &only {
        jobs.retain(|(module, _, _)| module.contains(only.as_str()));
        if jobs.is_empty() {
            eprintln!("dflash-kernels: --only {only}: no kernel module's name contains it");
            return ExitCode::from(2);
        }
    }
    // SAFETY: only probes whether the NVRTC library can be loaded.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        eprintln!("dflash-kernels: libnvrtc could not be loaded");
        return ExitCode::from(3);
    }
    let include = match dflash_ops::cuda::cuda_include_dir() {
        Ok(i) => i,
        Err(e) => {
            eprintln!("dflash-kernels: {e}");
            return ExitCode::from(3);
        }
    };
    if args.iter().any(|a| a == "--resources") {
        return resources(jobs, &include);
    }
    let mut failed = 0;
    for (module, source, arch) in jobs {
        let t = std::time::Instant::now();
        match dflash_ops::cuda::compile_module(module, &source, &arch, &include) {
            Ok(_) => println!(
                "ok   {module:<26} {arch:<7} {:>6.0} ms",
                t.elapsed().as_secs_f64() * 1e3
            ),
            Err(e) => {
                failed += 1;
                println!("FAIL {module:<26} {arch:<7} {e}");
            }
        }
    }
    if failed > 0 {
        eprintln!("dflash-kernels: {failed} compile(s) failed");
        return ExitCode::from(1);
    }
    ExitCode::SUCCESS
}

/// `--resources`: every entry point's registers, stack frame and spills per (module, arch).
fn resources(jobs: Vec<(&'static str, String, String)>, include: &str) -> ExitCode {
    let (mut failed, mut spilling, mut warnings) = (0, 0, 0);
    println!(
        "{:<26} {:<7} {:<44} {:>4} {:>6} {:>7} {:>7}",
        "module", "arch", "entry", "regs", "stack", "spill>", "spill<"
    );
    for (module, source, arch) in jobs {
        match dflash_ops::cuda::ptxas_log(module, &source, &arch, include) {
            Ok(log) => {
                // ptxas's warnings and performance notes (a serialized wgmma chain) name no entry point
                // in a form `parse` reads: shown as they are.
                for w in log
                    .lines()
                    .filter(|l| l.contains("warning") || l.contains("Performance Loss"))
                {
                    warnings += 1;
                    println!("{module:<26} {arch:<7} {}", w.trim());
                }
                for u in ptxas::parse(&log) {
                    spilling += usize::from(u.spills());
                    println!(
                        "{module:<26} {:<7} {:<44} {:>4} {:>6} {:>7} {:>7}{}",
                        u.arch,
                        u.entry,
                        u.registers,
                        u.stack,
                        u.spill_stores,
                        u.spill_loads,
                        if u.spills() { "  SPILLS" } else { "" }
                    );
                }
            }
            Err(e) => {
                failed += 1;
                println!("FAIL {module:<26} {arch:<7} {e}");
            }
        }
    }
    println!(
        "{spilling} entry point(s) spill registers to local memory; {warnings} ptxas warning(s)"
    );
    if failed > 0 {
        eprintln!("dflash-kernels: {failed} compile(s) failed");
        return ExitCode::from(1);
    }
    ExitCode::SUCCESS
}
