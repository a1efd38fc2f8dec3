//! Project automation. Run `cargo xtask help`.

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        None | Some("help") | Some("--help") => {
            println!("cargo xtask <command>\n\ncommands:\n  help    this text");
            ExitCode::SUCCESS
        }
        Some(other) => {
            eprintln!("unknown xtask command `{other}` (try `cargo xtask help`)");
            ExitCode::from(2)
        }
    }
}
