//! The `dflash` command line and the run plan built from it, both checked before anything is
//! written or printed: every flag's syntax and range, the draft config (read, parsed in
//! `--strict` or lenient mode, validated against the reference target), the startup options
//! against the draft, and the run's size against its memory plan. Errors name the flag or the
//! file as the user typed it.

use std::path::PathBuf;

use dflash_config::{
    Backend as DraftBackend, Geometry, MAX_CONCURRENCY, MAX_DRAFT_COUNT, ParseMode, Startup,
    StartupOptions, TEMPERATURE_RULE, is_valid_temperature,
};
use dflash_draft::{ConfigReport, parse_draft_config};

use crate::{
    HarnessError, MAX_PROMPT_TOKENS, Result, check_run_size, default_draft_config,
    target_text_config,
};

/// Where the draft, context and verification run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// The CPU reference backend.
    Cpu,
    /// CUDA device 0 (a build with the `cuda` feature).
    Cuda,
}

/// The parsed command line.
#[derive(Debug, Clone, PartialEq)]
pub struct Args {
    /// `--backend`; `None`: the draft config's (the embedded default: DFlash).
    pub backend: Option<DraftBackend>,
    /// `--k`, 1..=15.
    pub k: u32,
    /// `--b`, 1..=8.
    pub b: u32,
    /// `--draft-tree-nodes N`: DFlash2 tree verification with N nodes a request (K+1..=32,
    /// checked against K and the backend by [`plan`]); `None`: chain rounds.
    pub tree_nodes: Option<u32>,
    /// `--temperature`, finite and >= 0.
    pub temperature: f32,
    /// `--seed`.
    pub seed: u64,
    /// `--prompts`: how many built-in prompts; `None`: 4 without `--prompt`, none with it.
    pub prompts: Option<usize>,
    /// `--prompt TEXT` (repeatable): prompts of the user's own, run before any built-in ones.
    pub prompt_texts: Vec<String>,
    /// `--random-draft`: the embedded default's draft geometry with random weights instead of
    /// the trained ones (to see what an untrained draft does).
    pub random_draft: bool,
    /// `--max-new`.
    pub max_new: usize,
    /// `--device`.
    pub device: Device,
    /// `--oracle RHO`, in [0, 1].
    pub oracle: Option<f64>,
    /// `--quiet`.
    pub quiet: bool,
    /// `--geometry`.
    pub geometry: bool,
    /// `--draft-config FILE`: a draft config.json to use instead of the embedded default's.
    pub draft_config: Option<PathBuf>,
    /// `--mask-token-id N`.
    pub mask_token_id: Option<u32>,
    /// `--strict`: refuse unknown draft config fields.
    pub strict: bool,
    /// `--eager`: run the draft block op by op instead of replaying its CUDA graph profiles
    /// (debugging; the CPU always runs eagerly).
    pub eager: bool,
    /// `-h` / `--help`.
    pub help: bool,
}

impl Default for Args {
    fn default() -> Self {
        Args {
            backend: None,
            k: 7,
            b: 4,
            tree_nodes: None,
            temperature: 0.0,
            seed: 1,
            prompts: None,
            prompt_texts: Vec::new(),
            random_draft: false,
            max_new: 64,
            device: Device::Cpu,
            oracle: None,
            quiet: false,
            geometry: false,
            draft_config: None,
            mask_token_id: None,
            strict: false,
            eager: false,
            help: false,
        }
    }
}

/// Usage text.
pub const USAGE: &str = "usage: dflash [--backend dflash|dflash2] [--k N] [--b N] [--draft-tree-nodes N] [--temperature T] \
[--seed S] [--prompts N] [--prompt TEXT]... [--max-new N] [--device cpu|cuda] [--oracle RHO] \
[--random-draft] [--quiet] [--geometry] [--draft-config FILE] [--mask-token-id N] [--strict] [--eager]";

fn flag_error(flag: &str, expected: impl Into<String>, found: impl Into<String>) -> HarnessError {
    HarnessError::Flag {
        flag: flag.to_owned(),
        expected: expected.into(),
        found: found.into(),
    }
}

fn number<T: std::str::FromStr>(flag: &str, value: &str, what: &str) -> Result<T> {
    value
        .parse()
        .map_err(|_| flag_error(flag, what, format!("`{value}`")))
}

/// Parse the arguments after the program name. Every flag may appear once (`--prompt` as
/// often as wanted); a flag that takes a value needs one; values are checked for range here
/// (K, B, temperature, RHO), the rest (prompt lengths, run size) by [`plan`].
pub fn parse_args(args: &[String]) -> Result<Args> {
    let mut a = Args::default();
    let mut seen: Vec<&str> = Vec::new();
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let flag = flag.as_str();
        if flag != "--prompt" && seen.contains(&flag) {
            return Err(flag_error(flag, "at most once", "it twice"));
        }
        let mut value = || match it.next() {
            Some(v) if !v.starts_with("--") => Ok(v.as_str()),
            Some(v) => Err(flag_error(flag, "a value", format!("the flag `{v}`"))),
            None => Err(flag_error(flag, "a value", "the end of the command line")),
        };
        match flag {
            "--backend" => {
                a.backend = Some(match value()? {
                    "dflash" => DraftBackend::DFlash,
                    "dflash2" => DraftBackend::DFlash2,
                    other => {
                        return Err(flag_error(flag, "dflash or dflash2", format!("`{other}`")));
                    }
                });
            }
            "--k" => {
                let range = format!("an integer 1..={MAX_DRAFT_COUNT} (the draft count K)");
                a.k = number(flag, value()?, &range)?;
                if !(1..=MAX_DRAFT_COUNT).contains(&a.k) {
                    return Err(flag_error(flag, range, a.k.to_string()));
                }
            }
            "--b" => {
                let range = format!("an integer 1..={MAX_CONCURRENCY} (the concurrency B)");
                a.b = number(flag, value()?, &range)?;
                if !(1..=MAX_CONCURRENCY).contains(&a.b) {
                    return Err(flag_error(flag, range, a.b.to_string()));
                }
            }
            "--draft-tree-nodes" => {
                let what = "an integer (the tree's nodes a request, K+1..=32, DFlash2)";
                a.tree_nodes = Some(number(flag, value()?, what)?);
            }
            "--temperature" => {
                let t: f32 = number(flag, value()?, TEMPERATURE_RULE)?;
                if !is_valid_temperature(t) {
                    return Err(flag_error(flag, TEMPERATURE_RULE, t.to_string()));
                }
                a.temperature = t;
            }
            "--seed" => a.seed = number(flag, value()?, "an integer 0..=18446744073709551615")?,
            "--prompts" => a.prompts = Some(number(flag, value()?, "a positive integer")?),
            // A text starting with `--` is taken for a missing value (write it with a
            // leading space).
            "--prompt" => a.prompt_texts.push(value()?.to_owned()),
            "--random-draft" => a.random_draft = true,
            "--max-new" => a.max_new = number(flag, value()?, "a positive integer")?,
            "--device" => {
                a.device = match value()? {
                    "cpu" => Device::Cpu,
                    "cuda" => Device::Cuda,
                    other => return Err(flag_error(flag, "cpu or cuda", format!("`{other}`"))),
                }
            }
            "--oracle" => {
                let what = "a probability in [0, 1]";
                let rho: f64 = number(flag, value()?, what)?;
                if !(0.0..=1.0).contains(&rho) {
                    return Err(flag_error(flag, what, rho.to_string()));
                }
                a.oracle = Some(rho);
            }
            "--draft-config" => a.draft_config = Some(PathBuf::from(value()?)),
            "--mask-token-id" => {
                a.mask_token_id = Some(number(
                    flag,
                    value()?,
                    "a token id (an integer 0..=4294967295)",
                )?)
            }
            "--quiet" => a.quiet = true,
            "--geometry" => a.geometry = true,
            "--strict" => a.strict = true,
            "--eager" => a.eager = true,
            "-h" | "--help" => a.help = true,
            other => {
                return Err(flag_error(
                    other,
                    "a dflash flag (`dflash --help` lists them)",
                    "an unknown argument",
                ));
            }
        }
        seen.push(flag);
    }
    Ok(a)
}

/// Everything a run needs that the command line decides, checked.
#[derive(Debug, Clone)]
pub struct RunPlan {
    /// The draft config text (the embedded default's or `--draft-config`'s).
    pub draft_config_json: String,
    /// What the config parser reported.
    pub report: ConfigReport,
    /// The draft/target geometry.
    pub geometry: Geometry,
    /// The startup options (K, B, mask token) checked against the draft.
    pub startup: Startup,
    /// The prompts of the run, as token ids: the `--prompt` texts, then the built-in ones.
    pub prompts: Vec<Vec<u32>>,
    /// Whether the draft has random weights (`--draft-config` or `--random-draft`).
    pub random_draft: bool,
}

impl Args {
    /// How many built-in prompts the run uses.
    pub fn builtin_prompts(&self) -> usize {
        self.prompts
            .unwrap_or(if self.prompt_texts.is_empty() { 4 } else { 0 })
    }
}

/// Map a startup refusal to the flag that set the option (`config` names the draft config).
fn startup_error(e: dflash_config::ConfigError, config: &std::path::Path) -> HarnessError {
    if let dflash_config::ConfigError::MaskTokenUnknown { .. } = e {
        return flag_error(
            "--mask-token-id",
            format!(
                "a mask token id, because {} has dflash_config.mask_token_id null",
                config.display()
            ),
            "nothing",
        );
    }
    let flag = match e.path() {
        "startup.backend" => "--backend",
        "startup.draft_count" => "--k",
        "startup.concurrency" => "--b",
        "startup.tree_nodes" => "--draft-tree-nodes",
        "startup.mask_token_id" => "--mask-token-id",
        _ => return HarnessError::Draft(dflash_draft::DraftError::Config(e)),
    };
    HarnessError::Startup { flag, source: e }
}

/// Check everything the command line decides before anything is written: the run's size
/// ([`check_run_size`]), the draft config (read from `--draft-config`, else the embedded
/// default of `--backend`), parsed in `--strict` or lenient mode and validated against the
/// reference target, and the startup options (backend, K, B, mask token) against it.
pub fn plan(args: &Args) -> Result<RunPlan> {
    if let (Some(n), Some(_)) = (args.tree_nodes, args.oracle) {
        return Err(flag_error(
            "--draft-tree-nodes",
            "no --oracle with it (the oracle proposer drafts chains only)",
            n.to_string(),
        ));
    }
    let mut prompts = Vec::new();
    for t in &args.prompt_texts {
        if t.is_empty() || t.len() > MAX_PROMPT_TOKENS {
            return Err(HarnessError::PromptTooLong { found: t.len() });
        }
        prompts.push(crate::encode(t));
    }
    prompts.extend(crate::demo_prompts(args.builtin_prompts(), args.seed));
    check_run_size(prompts.len(), args.max_new)?;
    let (path, text) = match &args.draft_config {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|source| HarnessError::Read {
                path: path.clone(),
                source,
            })?;
            (path.clone(), text)
        }
        None => (
            PathBuf::from("the embedded default draft config"),
            default_draft_config(args.backend.unwrap_or(DraftBackend::DFlash)).to_owned(),
        ),
    };
    let mode = if args.strict {
        ParseMode::Strict
    } else {
        ParseMode::Lenient
    };
    let (draft, geometry, report) = parse_draft_config(&path, &text, &target_text_config(), mode)?;
    let options = StartupOptions {
        concurrency: args.b,
        mask_token_id: args.mask_token_id,
        tree_nodes: args.tree_nodes,
        ..StartupOptions::new(args.backend.unwrap_or(draft.backend), args.k)
    };
    let startup = options
        .validate(&geometry)
        .map_err(|e| startup_error(e, &path))?;
    Ok(RunPlan {
        random_draft: args.random_draft || args.draft_config.is_some(),
        draft_config_json: text,
        report,
        geometry,
        startup,
        prompts,
    })
}
