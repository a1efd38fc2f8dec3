//! One op, one name: every op of [`dflash_ops::OPS`] is its Rust module (`src/<op>/mod.rs`,
//! whose `OP` is the same string). An op with a kernel of its own also has `kernels/<op>.cu`,
//! which its launcher `src/<op>/cuda.rs` compiles and whose entry points are prefixed `<op>_`;
//! an op without one (`feature_projection` calls the gemm helper) is named by its module
//! alone. Every kernel file is named after an op. Entry points whose names a macro builds are
//! not read here.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// The stems of `kernels/*.cu`.
fn kernel_files() -> BTreeSet<String> {
    let dir = crate_dir().join("../../kernels");
    let entries =
        std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()));
    entries
        .map(|e| {
            e.unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()))
                .path()
        })
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .filter_map(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .collect()
}

/// The end of the parenthesized group that `s` starts with (just past its `)`).
fn balanced_end(s: &str) -> usize {
    let mut depth = 0usize;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return i + 1;
                }
            }
            _ => {}
        }
    }
    s.len()
}

/// The names of the `__global__` entry points written out in `src` (a name that a macro
/// parameter supplies, all capitals, is skipped).
fn literal_entry_points(src: &str) -> Vec<String> {
    let mut names = Vec::new();
    for (at, _) in src.match_indices("__global__") {
        let mut rest = src[at + "__global__".len()..].trim_start_matches([' ', '\t', '\n', '\\']);
        loop {
            if let Some(r) = rest.strip_prefix("void") {
                rest = r;
            } else if let Some(r) = rest.strip_prefix("__launch_bounds__") {
                rest = &r[balanced_end(r)..];
            } else {
                break;
            }
            rest = rest.trim_start_matches([' ', '\t', '\n', '\\']);
        }
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if name.chars().any(|c| c.is_ascii_lowercase()) {
            names.push(name);
        }
    }
    names
}

/// The kernel names `src` loads by string literal (`c.function(OP, SOURCE, "name")`).
fn loaded_names(src: &str) -> Vec<String> {
    src.match_indices(".function(")
        .filter_map(|(at, _)| {
            let call = &src[at + ".function".len()..];
            let call = &call[..balanced_end(call)];
            let open = call.find('"')?;
            let close = call[open + 1..].find('"')?;
            Some(call[open + 1..open + 1 + close].to_string())
        })
        .collect()
}

#[test]
fn every_op_is_its_module_and_every_kernel_file_is_an_op() {
    let ops: BTreeSet<&str> = dflash_ops::OPS.iter().copied().collect();
    assert_eq!(ops.len(), dflash_ops::OPS.len(), "duplicate op ids");
    for op in &ops {
        let module = read(&crate_dir().join(format!("src/{op}/mod.rs")));
        assert!(
            module.contains(&format!("pub const OP: &str = \"{op}\";")),
            "src/{op}/mod.rs must declare `pub const OP: &str = \"{op}\";`"
        );
    }
    let kernels = kernel_files();
    assert!(!kernels.is_empty(), "no kernels/*.cu found");
    for stem in &kernels {
        assert!(
            ops.contains(stem.as_str()),
            "kernels/{stem}.cu is not named after an op of OPS"
        );
        let launcher = read(&crate_dir().join(format!("src/{stem}/cuda.rs")));
        assert!(
            launcher.contains(&format!("kernels/{stem}.cu\"")),
            "src/{stem}/cuda.rs does not compile kernels/{stem}.cu"
        );
        let source = read(&crate_dir().join(format!("../../kernels/{stem}.cu")));
        let prefix = format!("{stem}_");
        let entries = literal_entry_points(&source);
        for name in entries.iter().chain(&loaded_names(&launcher)) {
            assert!(
                name.starts_with(&prefix),
                "kernel entry point `{name}` of op {stem} is not prefixed `{prefix}`"
            );
        }
    }
}

#[test]
fn entry_point_names_are_read_through_launch_bounds_and_skip_macro_parameters() {
    let src = "extern \"C\" __global__ void __launch_bounds__((A<1, 2>::t), 1)\n\
               op_a(int x) {}\n\
               #define E(NAME) extern \"C\" __global__ void \\\n    NAME(int x) {}\n\
               extern \"C\" __global__ void op_b(int x) {}\n";
    assert_eq!(literal_entry_points(src), ["op_a", "op_b"]);
    assert_eq!(
        loaded_names("c.function(OP, source(), \"op_a\")?; c.function(OP, S, T::K)?; \"x\""),
        ["op_a"]
    );
}

/// With the CUDA backend compiled in: the modules it compiles are exactly the kernel files.
#[cfg(feature = "cuda")]
#[test]
fn the_compiled_kernel_modules_are_the_kernel_files() {
    let modules: BTreeSet<String> = dflash_ops::cuda::kernel_modules()
        .into_iter()
        .map(|(name, _)| name.to_string())
        .collect();
    assert_eq!(modules, kernel_files());
}
