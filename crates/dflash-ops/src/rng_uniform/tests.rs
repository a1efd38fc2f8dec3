use super::*;
use crate::rng::{Purpose, uniform, word};

#[test]
fn cpu_matches_the_identity_and_splits_seed_words() {
    let be = Backend::cpu();
    let seed = 0x0000_0005_ffff_fffe_u64;
    let seeds = be
        .upload(&[seed as u32 as i32, (seed >> 32) as i32])
        .expect("upload");
    let pos = be.upload(&[123]).expect("upload");
    let pur = be.upload(&[Purpose::Correction as i32]).expect("upload");
    let sub = be.upload(&[2]).expect("upload");
    let mut w = be.filled(1, i32::POISON).expect("alloc");
    let mut u = be.filled(1, f32::POISON).expect("alloc");
    run(&be, &seeds, &pos, &pur, &sub, &mut w, &mut u).expect("run");
    assert_eq!(
        be.download(&w).expect("dl")[0] as u32,
        word(seed, 123, Purpose::Correction, 2)
    );
    assert_eq!(
        be.download(&u).expect("dl")[0],
        uniform(seed, 123, Purpose::Correction, 2)
    );
}

#[test]
fn bad_purpose_and_negative_position_are_refused_without_writing() {
    let be = Backend::cpu();
    let seeds = be.upload(&[1, 0, 1, 0]).expect("upload");
    let sub = be.upload(&[0, 0]).expect("upload");
    let mut w = be.filled(2, i32::POISON).expect("alloc");
    let mut u = be.filled(2, f32::POISON).expect("alloc");
    let pos = be.upload(&[0, 1]).expect("upload");
    let pur = be.upload(&[2, 9]).expect("upload");
    let e = run(&be, &seeds, &pos, &pur, &sub, &mut w, &mut u).expect_err("bad purpose");
    assert!(
        matches!(
            e,
            crate::OpsError::Value {
                tensor: "purposes",
                index: 1,
                ..
            }
        ),
        "{e}"
    );
    let pos = be.upload(&[0, -1]).expect("upload");
    let pur = be.upload(&[2, 2]).expect("upload");
    let e = run(&be, &seeds, &pos, &pur, &sub, &mut w, &mut u).expect_err("negative position");
    assert!(
        matches!(
            e,
            crate::OpsError::Value {
                tensor: "positions",
                index: 1,
                ..
            }
        ),
        "{e}"
    );
    assert!(
        be.download(&w)
            .expect("dl")
            .iter()
            .all(|&x| x == i32::POISON)
    );
    let short = be.upload(&[1]).expect("upload");
    let e = run(&be, &short, &pos, &pur, &sub, &mut w, &mut u).expect_err("short seeds");
    assert!(
        matches!(
            e,
            crate::OpsError::Length {
                tensor: "seeds",
                expected: 4,
                found: 1,
                ..
            }
        ),
        "{e}"
    );
}
