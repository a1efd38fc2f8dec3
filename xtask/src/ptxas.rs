//! What ptxas reports per kernel entry point (`--ptxas-options=-v` through NVRTC): registers,
//! stack frame and spill bytes, parsed from the compile log (`dflash-kernels --resources`).

/// One entry point's resources for one architecture.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EntryUse {
    /// The entry point's name.
    pub entry: String,
    /// The architecture ptxas compiled for (as the log names it).
    pub arch: String,
    /// Registers per thread.
    pub registers: u32,
    /// Stack frame bytes per thread.
    pub stack: u32,
    /// Spill store bytes per thread.
    pub spill_stores: u32,
    /// Spill load bytes per thread.
    pub spill_loads: u32,
}

impl EntryUse {
    /// Whether ptxas spilled registers to local memory for this entry.
    pub fn spills(&self) -> bool {
        self.spill_stores > 0 || self.spill_loads > 0
    }
}

/// The number just before `unit` in `line` (`"320 bytes spill stores"`).
fn before(line: &str, unit: &str) -> Option<u32> {
    let head = &line[..line.find(unit)?];
    head.split(|c: char| !c.is_ascii_digit())
        .rfind(|w| !w.is_empty())?
        .parse()
        .ok()
}

/// Parse a ptxas `-v` log: one [`EntryUse`] per "Compiling entry function" line, filled from
/// the lines that follow it (the stack / spill line and the "Used N registers" line).
pub fn parse(log: &str) -> Vec<EntryUse> {
    let mut out: Vec<EntryUse> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let mut it = rest.split('\'');
            let entry = it.next().unwrap_or_default().to_string();
            let arch = it.nth(1).unwrap_or_default().to_string();
            out.push(EntryUse {
                entry,
                arch,
                ..EntryUse::default()
            });
            continue;
        }
        let Some(cur) = out.last_mut() else { continue };
        if line.contains("bytes stack frame") {
            cur.stack = before(line, "bytes stack frame").unwrap_or(0);
            cur.spill_stores = before(line, "bytes spill stores").unwrap_or(0);
            cur.spill_loads = before(line, "bytes spill loads").unwrap_or(0);
        } else if line.contains(" registers") {
            cur.registers = before(line, " registers").unwrap_or(0);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A log as NVRTC 13.0 printed it for two entries, the second spilling.
    const LOG: &str = "ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'residual_add_kernel' for 'sm_90'
ptxas info    : Function properties for residual_add_kernel
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 13 registers, used 0 barriers
ptxas info    : Compile time = 2.295 ms
ptxas info    : Compiling entry function 'unary_topk_gemm_nt16' for 'sm_90a'
ptxas info    : Function properties for unary_topk_gemm_nt16
ptxas         .     320 bytes stack frame, 360 bytes spill stores, 152 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 320 bytes cumulative stack size
";

    #[test]
    fn every_entry_gets_its_registers_stack_and_spills() {
        let got = parse(LOG);
        assert_eq!(
            got,
            vec![
                EntryUse {
                    entry: "residual_add_kernel".into(),
                    arch: "sm_90".into(),
                    registers: 13,
                    stack: 0,
                    spill_stores: 0,
                    spill_loads: 0,
                },
                EntryUse {
                    entry: "unary_topk_gemm_nt16".into(),
                    arch: "sm_90a".into(),
                    registers: 168,
                    stack: 320,
                    spill_stores: 360,
                    spill_loads: 152,
                },
            ]
        );
        assert_eq!(
            got.iter().map(EntryUse::spills).collect::<Vec<_>>(),
            [false, true]
        );
    }

    #[test]
    fn lines_before_any_entry_and_unknown_lines_are_ignored() {
        assert!(parse("ptxas info    : Used 9 registers\nwhatever\n").is_empty());
        assert!(parse("").is_empty());
    }
}
