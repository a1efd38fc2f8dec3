//! Project automation: `cargo xtask <command>`.
//!
//! - `conformance [--out DIR]`: build the CUDA conformance runner (release, feature `cuda`)
//!   and run every registry case on the GPU against the CPU reference; writes
//!   `DIR/conformance.md` and `DIR/conformance.json` (default DIR: `docs`). Exit status: 0 all
//!   cases pass, 1 a case failed, 3 no CUDA device or driver.
//! - `fixtures [--out DIR] [--seed N] [--official] [--draft-config F --target-config F
//!   --public-vocab N [--strict]]`: write synthetic checkpoints in the
//!   published layouts: the tiny reference Qwen3.5-style target (`DIR/target-tiny`) and tiny
//!   DFlash / DFlash2 drafts matched to it (`DIR/draft-tiny-dflash`, `DIR/draft-tiny-dflash2`);
//!   with `--official`, also the two official draft geometries (`DIR/draft-35b-a3b-dflash`,
//!   about 1.8 GB plus 2 GB of inputs, and `DIR/draft-27b-dflash2`, about 6 GB plus 5 GB of
//!   inputs; never committed). Default DIR: `fixtures-out`. With `--draft-config`, also a
//!   draft of any geometry a draft config.json describes (validated against the given target
//!   config; unknown fields are warnings, refused with `--strict`) into `DIR/draft-custom`.
//!   Every draft directory also gets a ready `inputs.safetensors` for `propose` (synthetic
//!   features of 24 positions, synthetic target parts, K = 7, greedy). All options and files
//!   are checked before the first file is written.
//! - `conformance --bundle DIR`: build the same runner stripped and copy it, with a short
//!   `RUN.md`, into DIR, to run on a GPU host that has no Rust toolchain.

#[cfg(test)]
mod ptxas;

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
  fixtures [--out DIR] [--seed N] [--official] [--draft-config F --target-config F --public-vocab N [--strict]]
                              write synthetic checkpoints (tiny target + drafts; official drafts;
                              any draft geometry from a config.json), each draft with a ready
                              inputs.safetensors for propose
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

/// The `fixtures` command line, checked before anything is written.
#[derive(Debug, Default)]
struct FixturesArgs {
    out: Option<PathBuf>,
    seed: Option<u64>,
    official: bool,
    draft_config: Option<PathBuf>,
    target_config: Option<PathBuf>,
    public_vocab: Option<u32>,
    strict: bool,
}

fn parse_fixtures_args(args: &[String]) -> Result<FixturesArgs> {
    let mut a = FixturesArgs::default();
    let mut seen: Vec<&str> = Vec::new();
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let flag = flag.as_str();
        if seen.contains(&flag) {
            bail!("`{flag}`: expected at most once, found it twice");
        }
        seen.push(flag);
        let mut value = || match it.next() {
            Some(v) if !v.starts_with("--") => Ok(v.clone()),
            Some(v) => bail!("`{flag}`: expected a value, found the flag `{v}`"),
            None => bail!("`{flag}`: expected a value, found the end of the command line"),
        };
        match flag {
            "--out" => a.out = Some(PathBuf::from(value()?)),
            "--seed" => {
                let v = value()?;
                a.seed = Some(v.parse().with_context(|| {
                    format!("`--seed`: expected an unsigned integer, found `{v}`")
                })?);
            }
            "--official" => a.official = true,
            "--strict" => a.strict = true,
            "--draft-config" => a.draft_config = Some(PathBuf::from(value()?)),
            "--target-config" => a.target_config = Some(PathBuf::from(value()?)),
            "--public-vocab" => {
                let v = value()?;
                a.public_vocab = Some(v.parse().with_context(|| {
                    format!("`--public-vocab`: expected an unsigned integer, found `{v}`")
                })?);
            }
            other => bail!(
                "`{other}`: expected an option of fixtures (`cargo xtask help`), found an unknown argument"
            ),
        }
    }
    Ok(a)
}

fn read_file(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))
}

/// Tokens of context and draft count of the inputs file written next to each draft.
const INPUT_TOKENS: usize = 24;
const INPUT_DRAFT_TOKENS: u32 = 7;

/// Write a synthetic checkpoint and a ready `inputs.safetensors` for `propose` inside `dir`.
fn write_draft(
    dir: &Path,
    config_json: &str,
    target: &dflash_config::TargetTextConfig,
    seed: u64,
    layout: dflash_draft::synthetic::Layout,
) -> Result<()> {
    let g = dflash_draft::synthetic::write_checkpoint(dir, config_json, target, seed, layout)
        .with_context(|| format!("writing {}", dir.display()))?;
    let public = target.public_vocab_size()?;
    let inputs =
        dflash_draft::tool::synthetic_inputs(&g, public, INPUT_TOKENS, INPUT_DRAFT_TOKENS, seed);
    dflash_draft::tool::write_inputs(&dir.join("inputs.safetensors"), &inputs)?;
    Ok(())
}

fn fixtures(args: &[String]) -> Result<ExitCode> {
    use dflash_config::{Backend as DraftBackend, ParseMode};
    use dflash_draft::synthetic::{self, Layout};
    // Everything is checked before the first file is written.
    let a = parse_fixtures_args(args)?;
    let out = a
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from("fixtures-out"));
    let seed = a.seed.unwrap_or(1);
    let custom = match (&a.draft_config, &a.target_config, a.public_vocab) {
        (None, None, None) => None,
        (Some(draft), Some(target), Some(public)) => {
            let target_text = read_file(target)?;
            let target_cfg = dflash_config::TargetTextConfig::from_json_str(&target_text)
                .with_context(|| target.display().to_string())?
                .with_public_vocab_size(public)
                .map_err(|e| anyhow::anyhow!("`--public-vocab`: {e}"))?;
            let text = read_file(draft)?;
            let mode = if a.strict {
                ParseMode::Strict
            } else {
                ParseMode::Lenient
            };
            let (_, _, report) = dflash_draft::parse_draft_config(draft, &text, &target_cfg, mode)?;
            for w in report.warnings() {
                eprintln!("warning: {w} (--strict refuses it)");
            }
            for n in report.note_lines() {
                eprintln!("note: {n}");
            }
            Some((draft.clone(), text, target_cfg))
        }
        (None, _, _) => bail!(
            "`--target-config` and `--public-vocab` describe the target of `--draft-config F`, which is missing"
        ),
        (Some(_), None, _) => {
            bail!("`--draft-config` needs `--target-config F` (the Qwen3.5 target config.json)")
        }
        (Some(_), Some(_), None) => {
            bail!("`--draft-config` needs `--public-vocab N` (the target's public vocabulary size)")
        }
    };
    let official = if a.official {
        [DraftBackend::DFlash, DraftBackend::DFlash2]
            .into_iter()
            .map(synthetic::official_pair)
            .collect::<dflash_draft::Result<Vec<_>>>()?
    } else {
        Vec::new()
    };

    let target_dir = out.join("target-tiny");
    dflash_testkit::fixtures::write_reference_target(
        &target_dir,
        &dflash_testkit::TargetGeometry::tiny(),
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
        let spec = dflash_cli::tiny_draft_spec(backend);
        let dir = out.join(name);
        write_draft(
            &dir,
            &spec.draft_config_json(),
            &spec.target(),
            seed,
            Layout::Single,
        )?;
        println!(
            "wrote {} ({backend:?}, matched to target-tiny, with inputs.safetensors)",
            dir.display()
        );
    }
    if let Some((draft, text, target)) = custom {
        let dir = out.join("draft-custom");
        write_draft(&dir, &text, &target, seed, Layout::Single)?;
        println!(
            "wrote {} (geometry of {}, with inputs.safetensors)",
            dir.display(),
            draft.display()
        );
    }
    for ((cfg, target), name) in official
        .into_iter()
        .zip(["draft-35b-a3b-dflash", "draft-27b-dflash2"])
    {
        let dir = out.join(name);
        write_draft(&dir, &cfg, &target, seed, Layout::Sharded(4))?;
        println!(
            "wrote {} (official geometry, 4 shards, with inputs.safetensors)",
            dir.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}
