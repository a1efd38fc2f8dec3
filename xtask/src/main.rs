//! Project automation: `cargo xtask <command>`.
//!
//! - `conformance [--out DIR]`: build the CUDA conformance runner (release, feature `cuda`)
//!   and run every registry case on the GPU against the CPU reference; writes
//!   `DIR/conformance.md` and `DIR/conformance.json` (default DIR: `docs`). Exit status: 0 all
//!   cases pass, 1 a case failed, 3 no CUDA device or driver.
//! - `fixtures [--out DIR] [--seed N] [--official] [--draft-config F --target-config F
//!   --public-vocab N]`: write synthetic checkpoints in the
//!   published layouts: the tiny reference Qwen3.5-style target (`DIR/target-tiny`) and tiny
//!   DFlash / DFlash2 drafts matched to it (`DIR/draft-tiny-dflash`, `DIR/draft-tiny-dflash2`);
//!   with `--official`, also the two official draft geometries (`DIR/draft-35b-a3b-dflash`,
//!   about 1.8 GB, and `DIR/draft-27b-dflash2`, about 6 GB; never committed). Default DIR:
//!   `fixtures-out`. With `--draft-config`, also a draft of any geometry a draft config.json
//!   describes (validated against the given target config) into `DIR/draft-custom`.
//! - `conformance --bundle DIR`: build the same runner stripped and copy it, with a short
//!   `RUN.md`, into DIR, to run on a GPU host that has no Rust toolchain.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{Context, Result, bail};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("xtask: {e:#}");
            ExitCode::from(2)
        }
    }
}

const HELP: &str = "cargo xtask <command>

commands:
  conformance [--out DIR]     run every op's conformance cases on CUDA vs the CPU reference
  conformance --bundle DIR    build a stripped runner into DIR for a GPU host without Rust
  fixtures [--out DIR] [--seed N] [--official] [--draft-config F --target-config F --public-vocab N]
                              write synthetic checkpoints (tiny target + drafts; official drafts;
                              any draft geometry from a config.json)
  help                        this text";

fn run(args: &[String]) -> Result<ExitCode> {
    match args.first().map(String::as_str) {
        None | Some("help") | Some("--help") => {
            println!("{HELP}");
            Ok(ExitCode::SUCCESS)
        }
        Some("conformance") => conformance(&args[1..]),
        Some("fixtures") => fixtures(&args[1..]),
        Some(other) => bail!("unknown command `{other}`\n\n{HELP}"),
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

fn flag_value(args: &[String], flag: &str) -> Result<Option<String>> {
    match args.iter().position(|a| a == flag) {
        None => Ok(None),
        Some(i) => match args.get(i + 1) {
            Some(v) if !v.starts_with("--") => Ok(Some(v.clone())),
            _ => bail!("{flag} needs a value"),
        },
    }
}

fn build_runner(root: &Path) -> Result<PathBuf> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .current_dir(root)
        .args([
            "build",
            "--release",
            "-p",
            "xtask",
            "--features",
            "cuda",
            "--bin",
            "dflash-conformance",
        ])
        .status()
        .context("running cargo build for the conformance runner")?;
    if !status.success() {
        bail!("building dflash-conformance failed ({status})");
    }
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| root.join("target"));
    Ok(target.join("release").join("dflash-conformance"))
}

fn conformance(args: &[String]) -> Result<ExitCode> {
    for a in args.iter().filter(|a| a.starts_with("--")) {
        if a != "--bundle" && a != "--out" {
            bail!("unknown option `{a}` for conformance");
        }
    }
    let root = workspace_root();
    let runner = build_runner(&root)?;
    if let Some(dir) = flag_value(args, "--bundle")? {
        let dir = PathBuf::from(dir);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let dest = dir.join("dflash-conformance");
        std::fs::copy(&runner, &dest)
            .with_context(|| format!("copying the runner to {}", dest.display()))?;
        std::fs::write(
            dir.join("RUN.md"),
            "Run on a GPU host (CUDA driver, NVRTC and cuBLAS present; no Rust needed):\n\n    \
             ./dflash-conformance --out OUTDIR\n\nExit status: 0 all pass, 1 a case failed, 3 no CUDA device.\n",
        )?;
        println!("bundled {}", dest.display());
        return Ok(ExitCode::SUCCESS);
    }
    let out = flag_value(args, "--out")?.unwrap_or_else(|| root.join("docs").display().to_string());
    let status = Command::new(&runner)
        .args(["--out", &out])
        .status()
        .with_context(|| format!("running {}", runner.display()))?;
    Ok(ExitCode::from(
        u8::try_from(status.code().unwrap_or(1)).unwrap_or(1),
    ))
}

fn fixtures(args: &[String]) -> Result<ExitCode> {
    use dflash_config::Backend as DraftBackend;
    use dflash_draft::synthetic::{self, Layout};
    for a in args.iter().filter(|a| a.starts_with("--")) {
        if !matches!(
            a.as_str(),
            "--out"
                | "--seed"
                | "--official"
                | "--draft-config"
                | "--target-config"
                | "--public-vocab"
        ) {
            bail!("unknown option `{a}` for fixtures");
        }
    }
    let out = PathBuf::from(flag_value(args, "--out")?.unwrap_or_else(|| "fixtures-out".into()));
    let seed: u64 = match flag_value(args, "--seed")? {
        Some(s) => s
            .parse()
            .with_context(|| format!("--seed `{s}` is not an unsigned integer"))?,
        None => 1,
    };
    let target_dir = out.join("target-tiny");
    dflash_testkit::fixtures::write_reference_target(
        &target_dir,
        &dflash_cli::target_geometry(),
        seed,
    )
    .with_context(|| format!("writing {}", target_dir.display()))?;
    println!(
        "wrote {} (reference Qwen3.5-style hybrid target)",
        target_dir.display()
    );
    for (name, backend) in [
        ("draft-tiny-dflash", DraftBackend::DFlash),
        ("draft-tiny-dflash2", DraftBackend::DFlash2),
    ] {
        let spec = dflash_cli::draft_spec(backend);
        let dir = out.join(name);
        synthetic::write_checkpoint(
            &dir,
            &spec.draft_config_json(),
            &spec.target(),
            seed,
            Layout::Single,
        )
        .with_context(|| format!("writing {}", dir.display()))?;
        println!(
            "wrote {} ({backend:?}, matched to target-tiny)",
            dir.display()
        );
    }
    if let Some(draft_cfg) = flag_value(args, "--draft-config")? {
        let target_cfg = flag_value(args, "--target-config")?
            .context("--draft-config needs --target-config (the Qwen3.5 target config.json)")?;
        let public: u32 = flag_value(args, "--public-vocab")?
            .context("--draft-config needs --public-vocab N (the target's public vocabulary size)")?
            .parse()
            .context("--public-vocab is not an unsigned integer")?;
        let cfg =
            std::fs::read_to_string(&draft_cfg).with_context(|| format!("reading {draft_cfg}"))?;
        let target_text = std::fs::read_to_string(&target_cfg)
            .with_context(|| format!("reading {target_cfg}"))?;
        let target = dflash_config::TargetTextConfig::from_json_str(&target_text)?
            .with_public_vocab_size(public)?;
        let dir = out.join("draft-custom");
        synthetic::write_checkpoint(&dir, &cfg, &target, seed, Layout::Single)
            .with_context(|| format!("writing {}", dir.display()))?;
        println!("wrote {} (geometry of {draft_cfg})", dir.display());
    }
    if args.iter().any(|a| a == "--official") {
        for (name, backend) in [
            ("draft-35b-a3b-dflash", DraftBackend::DFlash),
            ("draft-27b-dflash2", DraftBackend::DFlash2),
        ] {
            let (cfg, target) = synthetic::official_pair(backend)?;
            let dir = out.join(name);
            synthetic::write_checkpoint(&dir, &cfg, &target, seed, Layout::Sharded(4))
                .with_context(|| format!("writing {}", dir.display()))?;
            println!(
                "wrote {} ({backend:?}, official geometry, 4 shards)",
                dir.display()
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
