//! `propose --model DIR --inputs FILE --out FILE [--device cpu|cuda] [--mask-token-id N]
//! [--strict]`: prefill a draft's context from captured features, run one block, write the
//! results (see `dflash_draft::tool` for the file formats).
//!
//! Unknown config fields are printed as warnings (refused with `--strict`), the config
//! parser's notes as notes, both on stderr. Exit status: 0 written; 1 the run failed while
//! computing or writing; 2 an argument, the checkpoint, its config or the inputs were refused
//! (nothing was written).

use std::process::ExitCode;

use dflash_draft::tool;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("{}", tool::USAGE);
        return ExitCode::SUCCESS;
    }
    let result = tool::parse_args(&args)
        .and_then(|parsed| tool::prepare(&parsed))
        .and_then(|prepared| {
            let report = prepared.report();
            for w in report.warnings() {
                eprintln!("warning: {w} (--strict refuses it)");
            }
            for n in report.note_lines() {
                eprintln!("note: {n}");
            }
            prepared.run()
        });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("propose: error: {e}");
            ExitCode::from(tool::exit_code(&e))
        }
    }
}
