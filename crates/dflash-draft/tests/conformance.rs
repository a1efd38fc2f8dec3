//! Every light whole-block conformance case runs on the CPU twice and passes the registry's
//! comparison against itself (footprint, non-degenerate hidden, enough decisive proposals).

use dflash_ops::Backend;
use dflash_ops::registry::compare;

#[test]
fn light_draft_block_cases_pass_on_the_cpu_against_themselves() {
    let be = Backend::cpu();
    let cases = dflash_draft::conformance_cases();
    assert!(
        cases.iter().filter(|c| c.heavy).count() == 2,
        "both official geometries are listed"
    );
    let mut names: Vec<&str> = cases.iter().map(|c| c.name.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), cases.len(), "unique names");
    for case in cases.iter().filter(|c| !c.heavy) {
        let a = (case.run)(&be).unwrap_or_else(|e| panic!("{}: {e}", case.name));
        let b = (case.run)(&be).unwrap_or_else(|e| panic!("{}: {e}", case.name));
        for row in compare(case, &a, &b) {
            assert!(row.pass, "{row:?}");
        }
        let props = a
            .outputs
            .iter()
            .find(|o| o.name == "proposals")
            .expect("proposals");
        let decisive = props.values.iter().filter(|v| **v >= 0.0).count();
        eprintln!(
            "{}: {decisive} of {} proposals decisive",
            case.name,
            props.values.len()
        );
        assert!(decisive >= 1, "{}: no decisive proposal", case.name);
    }
}
