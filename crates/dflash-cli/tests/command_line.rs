//! The `dflash` binary on a table of bad command lines and files: each row must exit with
//! status 2, print nothing on stdout (no banner: every check comes before anything is written
//! or printed), name the flag or the file in its message, and leave no scratch directory
//! behind. Then the accepted runs: unknown config fields are warned about and the job runs;
//! a null mask token runs with `--mask-token-id`.
//!
//! Each test runs the binary with `TMPDIR` set to a fresh directory of its own, so "no scratch
//! directory left" is checked exactly.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use dflash_config::Backend as DraftBackend;
use serde_json::{Value, json};

/// A fresh, empty directory for one test.
fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("dflash-cli-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// Run `dflash args` in `dir` with `dir/tmp` as its temp directory.
fn dflash(dir: &Path, args: &[&str]) -> Output {
    let tmp = dir.join("tmp");
    std::fs::create_dir_all(&tmp).expect("tmp");
    Command::new(env!("CARGO_BIN_EXE_dflash"))
        .args(args)
        .current_dir(dir)
        .env("TMPDIR", &tmp)
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("run dflash")
}

fn leftover_scratch(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir.join("tmp"))
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// The embedded default draft config of `backend`, edited by `edit`, written to `dir/name`.
fn config_file(dir: &Path, name: &str, backend: DraftBackend, edit: fn(&mut Value)) -> String {
    let mut v: Value = serde_json::from_str(dflash_cli::default_draft_config(backend))
        .expect("default config is JSON");
    edit(&mut v);
    std::fs::write(dir.join(name), v.to_string()).expect("write config");
    name.to_owned()
}

/// One refused command line: the arguments and the substrings its error must contain.
struct Row {
    args: Vec<String>,
    expect: Vec<String>,
}

fn row(args: &[&str], expect: &[&str]) -> Row {
    Row {
        args: args.iter().map(|s| s.to_string()).collect(),
        expect: expect.iter().map(|s| s.to_string()).collect(),
    }
}

#[test]
fn bad_command_lines_and_files_are_refused_before_anything_is_written() {
    let dir = temp_dir("refused");
    let d = DraftBackend::DFlash;
    let softcap = config_file(&dir, "softcap.json", d, |v| {
        v["attn_logit_softcapping"] = json!(30)
    });
    let rotary = config_file(&dir, "rotary.json", d, |v| {
        v["partial_rotary_factor"] = json!(0.5)
    });
    let causal = config_file(&dir, "causal.json", d, |v| {
        v["dflash_config"]["causal_mask"] = json!(true)
    });
    let final_cap = config_file(&dir, "final.json", d, |v| {
        v["dflash_config"]["final_logit_softcapping"] = json!(20.0)
    });
    let unknown = config_file(&dir, "unknown.json", d, |v| v["new_knob"] = json!(1));
    let null_mask = config_file(&dir, "nullmask.json", d, |v| {
        v["dflash_config"]["mask_token_id"] = Value::Null
    });
    let wide = config_file(&dir, "wide.json", d, |v| v["hidden_size"] = json!(256));
    let far = config_file(&dir, "far.json", d, |v| {
        v["dflash_config"]["target_layer_ids"] = json!([1, 9])
    });
    let sliding_off = config_file(&dir, "sliding_off.json", d, |v| {
        v["use_sliding_window"] = json!(false)
    });
    let dflash2 = config_file(&dir, "dflash2.json", DraftBackend::DFlash2, |_| {});
    std::fs::write(dir.join("broken.json"), "{\n  \"architectures\": [,\n}").expect("write");
    std::fs::create_dir_all(dir.join("a-directory")).expect("dir");

    let temp = "`--temperature`: expected a finite temperature >= 0 (0: greedy), found";
    let mut rows = vec![
        row(&["--temperature", "nan"], &[temp, "found NaN"]),
        row(&["--temperature", "-1"], &[temp, "found -1"]),
        row(&["--temperature", "inf"], &[temp, "found inf"]),
        row(&["--temperature", "warm"], &[temp, "found `warm`"]),
        row(
            &["--k", "16"],
            &["`--k`: expected an integer 1..=15", "found 16"],
        ),
        row(
            &["--k", "0"],
            &["`--k`: expected an integer 1..=15", "found 0"],
        ),
        row(
            &["--k"],
            &["`--k`: expected a value, found the end of the command line"],
        ),
        row(
            &["--k", "--b", "2"],
            &["`--k`: expected a value, found the flag `--b`"],
        ),
        row(
            &["--b", "9"],
            &["`--b`: expected an integer 1..=8", "found 9"],
        ),
        row(
            &["--b", "two"],
            &["`--b`: expected an integer 1..=8", "found `two`"],
        ),
        row(
            &["--draft-tree-nodes", "16"],
            &["--draft-tree-nodes", "DFlash2"],
        ),
        row(
            &["--backend", "dflash2", "--draft-tree-nodes", "5"],
            &["--draft-tree-nodes", "8..=32"],
        ),
        row(
            &["--backend", "dflash2", "--draft-tree-nodes", "many"],
            &["`--draft-tree-nodes`: expected an integer", "found `many`"],
        ),
        row(
            &[
                "--backend",
                "dflash2",
                "--draft-tree-nodes",
                "16",
                "--oracle",
                "0.5",
            ],
            &["`--draft-tree-nodes`: expected no --oracle"],
        ),
        row(
            &["--prompts", "100000000", "--max-new", "1"],
            &[
                "`--prompts`: expected 1..=",
                "memory plan",
                "found 100000000",
            ],
        ),
        row(
            &["--prompts", "0"],
            &["`--prompts`: expected 1..=", "found 0"],
        ),
        row(
            &["--prompt", ""],
            &[
                "`--prompt`: expected a text of 1..=256 bytes",
                "found 0 bytes",
            ],
        ),
        row(
            &["--prompt", &"x".repeat(257)],
            &[
                "`--prompt`: expected a text of 1..=256 bytes",
                "found 257 bytes",
            ],
        ),
        row(&["--prompt"], &["`--prompt`: expected a value"]),
        row(
            &["--max-new", "5000"],
            &[
                "`--max-new`: expected 1..=3840",
                "4096 positions",
                "found 5000",
            ],
        ),
        row(
            &["--max-new", "0"],
            &["`--max-new`: expected 1..=3840", "found 0"],
        ),
        row(
            &["--seed", "-1"],
            &["`--seed`: expected an integer", "found `-1`"],
        ),
        row(
            &["--oracle", "1.5"],
            &["`--oracle`: expected a probability in [0, 1], found 1.5"],
        ),
        row(
            &["--oracle", "nan"],
            &["`--oracle`: expected a probability in [0, 1], found NaN"],
        ),
        row(
            &["--backend", "dflash3"],
            &["`--backend`: expected dflash or dflash2, found `dflash3`"],
        ),
        row(
            &["--device", "tpu"],
            &["`--device`: expected cpu or cuda, found `tpu`"],
        ),
        row(
            &["--bogus"],
            &[
                "`--bogus`: expected a dflash flag",
                "found an unknown argument",
            ],
        ),
        row(&["extra"], &["`extra`: expected a dflash flag"]),
        row(
            &["--k", "3", "--k", "4"],
            &["`--k`: expected at most once, found it twice"],
        ),
        row(
            &["--eager", "--eager"],
            &["`--eager`: expected at most once, found it twice"],
        ),
        row(
            &["--mask-token-id", "x"],
            &["`--mask-token-id`: expected a token id", "found `x`"],
        ),
        row(
            &["--mask-token-id", "7"],
            &["`--mask-token-id` = 7 contradicts `dflash_config.mask_token_id` = 300"],
        ),
        row(
            &["--draft-config", "missing.json"],
            &["cannot read missing.json: "],
        ),
        row(
            &["--draft-config", "a-directory"],
            &["cannot read a-directory: "],
        ),
        row(
            &["--draft-config", "broken.json"],
            &["broken.json: invalid JSON at line 2, column 21"],
        ),
        row(
            &["--draft-config", &softcap],
            &["softcap.json: `attn_logit_softcapping`: 30 changes the draft mathematics"],
        ),
        row(
            &["--draft-config", &rotary],
            &["rotary.json: `partial_rotary_factor`: 0.5 changes the draft mathematics"],
        ),
        row(
            &["--draft-config", &causal],
            &["causal.json: `dflash_config.causal_mask`: true changes the draft mathematics"],
        ),
        row(
            &["--draft-config", &final_cap],
            &["final.json: `dflash_config.final_logit_softcapping`: 20.0 changes"],
        ),
        row(
            &["--draft-config", &sliding_off],
            &["sliding_off.json: `use_sliding_window` = false contradicts `layer_types[0]`"],
        ),
        row(
            &["--draft-config", &unknown, "--strict"],
            &["unknown.json: `new_knob`: unknown field (strict mode)"],
        ),
        row(
            &["--draft-config", &null_mask],
            &[
                "`--mask-token-id`: expected a mask token id, because nullmask.json has dflash_config.mask_token_id null",
            ],
        ),
        row(
            &["--draft-config", &null_mask, "--mask-token-id", "600"],
            &["`--mask-token-id`: expected a token id below 320"],
        ),
        row(
            &["--draft-config", &wide],
            &["wide.json: `hidden_size`: the draft says 256, the target says 128"],
        ),
        row(
            &["--draft-config", &far],
            &["far.json: `dflash_config.target_layer_ids[1]`: expected a block id below 4"],
        ),
        row(
            &["--draft-config", &dflash2, "--backend", "dflash"],
            &["`--backend`: the checkpoint is DFlash2, the startup options ask for DFlash"],
        ),
    ];
    // A build with the `cuda` feature would try (or, on a GPU host, succeed) to open the device.
    if cfg!(not(feature = "cuda")) {
        rows.push(row(
            &["--device", "cuda"],
            &["`--device`: expected cpu (this build has no `cuda` feature"],
        ));
    }
    assert!(rows.len() >= 30, "keep the table at 30 rows or more");
    for r in &rows {
        let args: Vec<&str> = r.args.iter().map(String::as_str).collect();
        let out = dflash(&dir, &args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stdout.is_empty(),
            "{args:?} printed before refusing: {stdout}"
        );
        assert!(stderr.starts_with("dflash: error: "), "{args:?}: {stderr}");
        for e in &r.expect {
            assert!(
                stderr.contains(e.as_str()),
                "{args:?}: `{e}` not in: {stderr}"
            );
        }
        assert_eq!(leftover_scratch(&dir), Vec::<String>::new(), "{args:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn unknown_fields_are_warned_about_and_a_null_mask_runs_with_the_flag() {
    let dir = temp_dir("accepted");
    let d = DraftBackend::DFlash2;
    let unknown = config_file(&dir, "unknown.json", d, |v| {
        v["new_knob"] = json!(1);
        v["dflash_config"]["other_knob"] = json!("x");
    });
    let null_mask = config_file(&dir, "nullmask.json", d, |v| {
        v["dflash_config"]["mask_token_id"] = Value::Null
    });
    let quick = ["--prompts", "1", "--max-new", "3", "--quiet"];
    let run = |extra: &[&str]| {
        let mut args: Vec<&str> = extra.to_vec();
        args.extend(quick);
        dflash(&dir, &args)
    };

    // `--eager` (no graph profiles; the CPU runs eagerly anyway) changes nothing else.
    let out = run(&["--eager"]);
    assert_eq!(out.status.code(), Some(0));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("check: speculative output == plain greedy"),
        "--eager runs"
    );

    let out = run(&["--draft-config", &unknown]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains(
            "warning: unknown.json: `new_knob` = 1: unknown field, not read (--strict refuses it)"
        ),
        "{stderr}"
    );
    assert!(
        stderr.contains("`dflash_config.other_knob` = \"x\""),
        "{stderr}"
    );
    assert!(stdout.contains("draft config: unknown.json"), "{stdout}");
    assert!(
        stdout.contains("check: speculative output == plain greedy"),
        "{stdout}"
    );
    assert_eq!(leftover_scratch(&dir), Vec::<String>::new());

    let out = run(&["--draft-config", &null_mask, "--mask-token-id", "300"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("note: nullmask.json: `dflash_config.mask_token_id`: null"),
        "{stderr}"
    );
    assert_eq!(leftover_scratch(&dir), Vec::<String>::new());

    // The embedded default states everything: no warning, no note; the summary line keeps
    // its fields.
    let out = run(&["--temperature", "0.8"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.is_empty(), "{stderr}");
    assert!(
        stdout.contains("temperature 0.8 seed 1 on cpu"),
        "the banner shows the temperature: {stdout}"
    );
    let summary = stdout
        .lines()
        .find(|l| l.starts_with("summary: "))
        .expect("summary line");
    for field in [
        "requests, ",
        " tokens, ",
        " rounds (",
        "mean accepted per row-round",
        "tokens/s",
    ] {
        assert!(summary.contains(field), "{summary}");
    }
    assert_eq!(leftover_scratch(&dir), Vec::<String>::new());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn prompts_and_continuations_are_text_and_the_summary_keeps_its_fields() {
    let dir = temp_dir("prompt");
    let out = dflash(
        &dir,
        &[
            "--prompt",
            "Return the number of",
            "--prompt",
            "Open the file and",
            "--max-new",
            "24",
            "--b",
            "2",
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert!(
        stdout.contains("prompt: \"Return the number of\""),
        "{stdout}"
    );
    assert!(stdout.contains("prompt: \"Open the file and\""), "{stdout}");
    assert_eq!(stdout.matches("    output: \"").count(), 2, "{stdout}");
    assert!(stdout.contains("summary: 2 requests"), "{stdout}");
    assert!(stdout.contains("trace: r<id> F=<frontier"), "{stdout}");
    let summary = stdout
        .lines()
        .find(|l| l.starts_with("summary: "))
        .expect("summary line");
    for field in [
        "mean accepted per row-round ",
        "tokens per row-round ",
        "plain decoding ",
        "wall-time speedup ",
        "tokens per target verify ",
        "commit lengths [N=",
    ] {
        assert!(summary.contains(field), "`{field}` in {summary}");
    }
    // The trained draft gets proposals accepted on these (held-out) prompts.
    let mean: f64 = summary
        .split("mean accepted per row-round ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|x| x.parse().ok())
        .expect("a number");
    assert!(mean >= 1.0, "{summary}");
    assert!(!stdout.contains("random weights"), "{stdout}");

    let out = dflash(
        &dir,
        &[
            "--random-draft",
            "--prompts",
            "1",
            "--max-new",
            "4",
            "--quiet",
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert!(
        stdout.contains("note: the draft has random weights on purpose (--random-draft)"),
        "{stdout}"
    );
    assert!(!stdout.contains("trace: r<id>"), "--quiet prints no legend");

    // Tree rounds keep the summary line's fields; trace rows show the accepted path.
    let out = dflash(
        &dir,
        &[
            "--backend",
            "dflash2",
            "--draft-tree-nodes",
            "16",
            "--prompts",
            "2",
            "--max-new",
            "16",
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    let summary = stdout
        .lines()
        .find(|l| l.starts_with("summary: "))
        .expect("summary line");
    for field in [
        "mean accepted per row-round ",
        "tokens per row-round ",
        "commit lengths [N=",
    ] {
        assert!(summary.contains(field), "`{field}` in {summary}");
    }
    assert!(stdout.contains(" path=[0"), "{stdout}");
    assert!(
        stdout.contains("speculative output == plain greedy target decoding")
            && stdout.contains("OK"),
        "{stdout}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
