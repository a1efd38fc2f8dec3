//! The `propose` binary on a table of bad command lines, checkpoints, configs and inputs
//! files: each row must exit with its status (2: refused input, 1: the write failed), name
//! the flag, file or tensor in its message, and leave no output (and no partial output) behind.
//! Then the accepted runs: unknown config fields are warned about; a null mask token runs
//! with `--mask-token-id`.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use dflash_draft::synthetic::{self, Layout, TinySpec};
use dflash_draft::tool;
use serde_json::{Value, json};

fn propose(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_propose"))
        .args(args)
        .current_dir(dir)
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("run propose")
}

/// Files of `dir/out` (the directory every row writes its output to).
fn outputs(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir.join("out"))
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// The tiny DFlash checkpoint with its config edited by `edit`, at `dir/name`.
fn model(dir: &Path, name: &str, edit: fn(&mut Value)) -> String {
    let spec = TinySpec::dflash();
    let (cfg, target) = synthetic::tiny_pair(&spec);
    let m = dir.join(name);
    synthetic::write_checkpoint(&m, &cfg, &target, 3, Layout::Single).expect("checkpoint");
    let mut v: Value = serde_json::from_str(&cfg).expect("json");
    edit(&mut v);
    std::fs::write(m.join("config.json"), v.to_string()).expect("config");
    name.to_owned()
}

/// A valid inputs file for the tiny DFlash draft, edited by `edit`, at `dir/name`.
fn inputs(dir: &Path, name: &str, edit: fn(&mut tool::ToolInputs)) -> String {
    let spec = TinySpec::dflash();
    let (cfg, target) = synthetic::tiny_pair(&spec);
    let d = dflash_config::DraftConfig::from_json_str(&cfg, dflash_config::ParseMode::Strict)
        .expect("config");
    let g = dflash_config::validate_pair(&d.value, &target).expect("pair");
    let mut inp = tool::synthetic_inputs(&g, spec.public_vocab, 7, 3, 5);
    edit(&mut inp);
    tool::write_inputs(&dir.join(name), &inp).expect("inputs");
    name.to_owned()
}

struct Row {
    args: Vec<String>,
    code: i32,
    expect: Vec<String>,
}

fn row(args: &[&str], code: i32, expect: &[&str]) -> Row {
    Row {
        args: args.iter().map(|s| s.to_string()).collect(),
        code,
        expect: expect.iter().map(|s| s.to_string()).collect(),
    }
}

fn paths(m: &str, i: &str, o: &str) -> Vec<String> {
    vec![
        "--model".into(),
        m.into(),
        "--inputs".into(),
        i.into(),
        "--out".into(),
        o.into(),
    ]
}

fn with(base: Vec<String>, extra: &[&str]) -> Vec<String> {
    let mut v = base;
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

#[test]
fn bad_command_lines_and_files_are_refused_and_nothing_is_written() {
    let dir: PathBuf = common::temp_dir("propose-cli-refused");
    std::fs::create_dir_all(dir.join("out")).expect("out dir");
    let good = model(&dir, "good", |_| {});
    let softcap = model(&dir, "softcap", |v| v["attn_logit_softcapping"] = json!(30));
    let rotary = model(&dir, "rotary", |v| v["partial_rotary_factor"] = json!(0.5));
    let causal = model(&dir, "causal", |v| {
        v["dflash_config"]["causal_mask"] = json!(true)
    });
    let bias = model(&dir, "bias", |v| v["attention_bias"] = json!(true));
    let unknown = model(&dir, "unknown", |v| v["new_knob"] = json!(1));
    let null_mask = model(&dir, "nullmask", |v| {
        v["dflash_config"]["mask_token_id"] = Value::Null
    });
    let broken = model(&dir, "broken", |_| {});
    std::fs::write(
        dir.join("broken/config.json"),
        "{\n  \"model_type\": qwen3\n}",
    )
    .expect("cfg");
    let truncated = model(&dir, "truncated", |_| {});
    let w = dir.join("truncated/model.safetensors");
    let bytes = std::fs::read(&w).expect("weights");
    std::fs::write(&w, &bytes[..bytes.len() / 2]).expect("truncate");
    let no_weights = model(&dir, "noweights", |_| {});
    std::fs::remove_file(dir.join("noweights/model.safetensors")).expect("rm");

    let inp = inputs(&dir, "in.safetensors", |_| {});
    let nan = inputs(&dir, "nan.safetensors", |i| i.temperature = f32::NAN);
    let negative = inputs(&dir, "neg.safetensors", |i| i.temperature = -1.0);
    let k16 = inputs(&dir, "k16.safetensors", |i| i.draft_tokens = 16);
    let anchor = inputs(&dir, "anchor.safetensors", |i| i.anchor = 80);
    let public = inputs(&dir, "public.safetensors", |i| i.public_vocab = 0);
    let wide = inputs(&dir, "wide.safetensors", |i| {
        i.features = synthetic::features(7, 96, 1)
    });
    std::fs::write(dir.join("text.safetensors"), "not a tensor file").expect("text");

    let out = "out/o.safetensors";
    let temp = "tensor `temperature`: expected a finite temperature >= 0 (0: greedy)";
    let mut rows = vec![
        row(&[], 2, &["`--model`: expected the draft checkpoint directory (required"]),
        row(&["--model", &good], 2, &["`--inputs`: expected the inputs safetensors file"]),
        row(
            &["--model", &good, "--inputs", &inp],
            2,
            &["`--out`: expected the output file (required"],
        ),
        row(&["--model"], 2, &["`--model`: expected a value, found the end of the command line"]),
        row(&["--model", "--inputs", &inp], 2, &["`--model`: expected a value, found the flag `--inputs`"]),
        row(&["--bogus"], 2, &["`--bogus`: expected a propose flag", "found an unknown argument"]),
        row(&["--model", &good, "--model", &good], 2, &["`--model`: expected at most once"]),
        row(&["--strict", "--strict"], 2, &["`--strict`: expected at most once"]),
        Row {
            args: with(paths(&good, &inp, out), &["--device", "tpu"]),
            code: 2,
            expect: vec!["`--device`: expected cpu or cuda, found `tpu`".into()],
        },
        Row {
            args: with(paths(&good, &inp, out), &["--mask-token-id", "mask"]),
            code: 2,
            expect: vec!["`--mask-token-id`: expected a token id".into(), "found `mask`".into()],
        },
        Row { args: paths(&good, &inp, "out"), code: 2, expect: vec!["`--out`: expected a file path, found the directory out".into()] },
        Row { args: paths(&good, &inp, "nowhere/o.safetensors"), code: 2, expect: vec!["`--out`: expected a file in an existing directory".into(), "(no directory nowhere)".into()] },
        Row { args: paths(&good, &inp, &inp), code: 2, expect: vec!["`--out`: expected a file other than the --inputs file".into()] },
        Row { args: paths("missing-model", &inp, out), code: 2, expect: vec!["missing-model/config.json: ".into()] },
        Row { args: paths(&no_weights, &inp, out), code: 2, expect: vec!["noweights: no `model.safetensors`".into()] },
        Row { args: paths(&truncated, &inp, out), code: 2, expect: vec!["truncated/model.safetensors: not a valid safetensors file".into()] },
        Row { args: paths(&good, "missing.safetensors", out), code: 2, expect: vec!["missing.safetensors: No such file".into()] },
        Row { args: paths(&good, "text.safetensors", out), code: 2, expect: vec!["inputs file text.safetensors: not safetensors".into()] },
        Row { args: paths(&good, &nan, out), code: 2, expect: vec![format!("inputs file nan.safetensors: {temp}, found NaN")] },
        Row { args: paths(&good, &negative, out), code: 2, expect: vec![format!("inputs file neg.safetensors: {temp}, found -1")] },
        Row { args: paths(&good, &k16, out), code: 2, expect: vec!["inputs file k16.safetensors: tensor `draft_tokens`: expected 1..=15, found 16".into()] },
        Row { args: paths(&good, &anchor, out), code: 2, expect: vec!["inputs file anchor.safetensors: tensor `anchor`: expected 0..=79, found 80".into()] },
        Row { args: paths(&good, &public, out), code: 2, expect: vec!["inputs file public.safetensors: tensor `public_vocab`: expected 1..=80, found 0".into()] },
        Row { args: paths(&good, &wide, out), code: 2, expect: vec!["inputs file wide.safetensors: tensor `features`: expected shape [7, 64]".into()] },
        Row { args: paths(&softcap, &inp, out), code: 2, expect: vec!["softcap/config.json: `attn_logit_softcapping`: 30 changes the draft mathematics".into()] },
        Row { args: paths(&rotary, &inp, out), code: 2, expect: vec!["rotary/config.json: `partial_rotary_factor`: 0.5 changes the draft mathematics".into()] },
        Row { args: paths(&causal, &inp, out), code: 2, expect: vec!["causal/config.json: `dflash_config.causal_mask`: true changes the draft mathematics".into()] },
        Row { args: paths(&bias, &inp, out), code: 2, expect: vec!["bias/config.json: `attention_bias`: true changes the draft mathematics".into()] },
        Row { args: paths(&broken, &inp, out), code: 2, expect: vec!["broken/config.json: invalid JSON at line 2, column 17: expected value".into()] },
        Row { args: with(paths(&unknown, &inp, out), &["--strict"]), code: 2, expect: vec!["unknown/config.json: `new_knob`: unknown field (strict mode)".into()] },
        Row { args: paths(&null_mask, &inp, out), code: 2, expect: vec!["`--mask-token-id`: expected a mask token id, because the draft config nullmask/config.json has dflash_config.mask_token_id null, found nothing".into()] },
        Row { args: with(paths(&good, &inp, out), &["--mask-token-id", "74"]), code: 2, expect: vec!["`--mask-token-id`: expected 75 (the draft config good/config.json states".into()] },
        Row { args: with(paths(&null_mask, &inp, out), &["--mask-token-id", "80"]), code: 2, expect: vec!["`--mask-token-id`: expected a token id below 80".into()] },
    ];
    // A build with the `cuda` feature would try (or, on a GPU host, succeed) to open the device.
    if cfg!(not(feature = "cuda")) {
        rows.push(Row {
            args: with(paths(&good, &inp, out), &["--device", "cuda"]),
            code: 2,
            expect: vec![
                "`--device`: expected cpu (this build has no `cuda` feature), found cuda".into(),
            ],
        });
    }
    // A failed write (even root cannot create files in /proc): status 1, the file named.
    if Path::new("/proc/self").is_dir() {
        rows.push(Row {
            args: paths(&good, &inp, "/proc/dflash-propose-out.safetensors"),
            code: 1,
            expect: vec!["cannot write /proc/dflash-propose-out.safetensors: ".into()],
        });
    }
    assert!(rows.len() >= 30, "keep the table at 30 rows or more");
    for r in &rows {
        let args: Vec<&str> = r.args.iter().map(String::as_str).collect();
        let o = propose(&dir, &args);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(r.code), "{args:?}: {stderr}");
        assert!(o.stdout.is_empty(), "{args:?}");
        assert!(stderr.contains("propose: error: "), "{args:?}: {stderr}");
        for e in &r.expect {
            assert!(
                stderr.contains(e.as_str()),
                "{args:?}: `{e}` not in: {stderr}"
            );
        }
        assert_eq!(
            outputs(&dir),
            Vec::<String>::new(),
            "{args:?} wrote something"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn unknown_fields_are_warned_about_and_a_null_mask_runs_with_the_flag() {
    let dir = common::temp_dir("propose-cli-accepted");
    let unknown = model(&dir, "unknown", |v| {
        v["new_knob"] = json!(1);
        v["dflash_config"]["other_knob"] = json!(2);
    });
    let null_mask = model(&dir, "nullmask", |v| {
        v["dflash_config"]["mask_token_id"] = Value::Null
    });
    let good = model(&dir, "good", |_| {});
    let inp = inputs(&dir, "in.safetensors", |_| {});

    let o = propose(&dir, &args_of(&paths(&unknown, &inp, "a.safetensors")));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains(
            "warning: unknown/config.json: `new_knob` = 1: unknown field, not read (--strict refuses it)"
        ),
        "{stderr}"
    );
    assert!(
        stderr.contains("`dflash_config.other_knob` = 2"),
        "{stderr}"
    );

    let o = propose(
        &dir,
        &args_of(&with(
            paths(&null_mask, &inp, "b.safetensors"),
            &["--mask-token-id", "75"],
        )),
    );
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let o = propose(&dir, &args_of(&paths(&good, &inp, "c.safetensors")));
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        o.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    // The mask given by flag and the mask stated in the config give the same output; the
    // unknown fields change nothing either.
    let read = |n: &str| std::fs::read(dir.join(n)).expect("output");
    assert_eq!(read("b.safetensors"), read("c.safetensors"));
    assert_eq!(read("a.safetensors"), read("c.safetensors"));
    // No temporary file is left next to the outputs.
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .expect("ls")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("safetensors"))
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "a.safetensors",
            "b.safetensors",
            "c.safetensors",
            "in.safetensors"
        ]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

fn args_of(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}
