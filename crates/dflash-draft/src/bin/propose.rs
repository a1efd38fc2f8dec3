//! `propose --model DIR --inputs FILE --out FILE [--device cpu|cuda]`: prefill a draft's
//! context from captured features, run one block, write the results (see
//! `dflash_draft::tool` for the file formats).

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("{}", dflash_draft::tool::USAGE);
        return Ok(());
    }
    let parsed = dflash_draft::tool::parse_args(&args)?;
    dflash_draft::tool::run(&parsed)?;
    Ok(())
}
