#![allow(clippy::needless_range_loop, clippy::type_complexity)] // reason: index loops mirror the formulas; test helpers return tuples

use super::*;
use crate::OpsError;
use proptest::prelude::*;

/// Run on the CPU; returns p or the error.
fn run_cpu(
    logits: &[f32],
    live: &[i32],
    counts: &[i32],
    proposals: &[i32],
    settings: &[Settings],
    params: Params,
) -> std::result::Result<Vec<f32>, OpsError> {
    let be = Backend::cpu();
    let l = be.upload(logits).expect("upload");
    let lv = be.upload(live).expect("upload");
    let c = be.upload(counts).expect("upload");
    let d = be.upload(proposals).expect("upload");
    let s = SamplingBuffers::upload(&be, settings).expect("upload");
    let mut p = be
        .filled(params.rows * params.cols * params.vocab, f32::POISON)
        .expect("alloc");
    let r = run(&be, &l, &lv, &c, &d, &s.view(), &mut p, &params);
    let out = be.download(&p).expect("download");
    match r {
        Ok(()) => Ok(out),
        Err(e) => {
            assert!(
                out.iter().all(|x| x.to_bits() == f32::POISON.to_bits()),
                "a refused call wrote p: {e}"
            );
            Err(e)
        }
    }
}

fn one(vocab: usize, public_vocab: usize) -> Params {
    Params {
        rows: 1,
        cols: 1,
        vocab,
        public_vocab,
    }
}

#[test]
fn softmax_of_public_rows_and_mask_of_the_rest() {
    // Public logits ln 5, ln 3, ln 2: p = 0.5, 0.3, 0.2; the strong non-public row gets 0.
    let logits = [5f32.ln(), 3f32.ln(), 2f32.ln(), 50.0];
    let p = run_cpu(
        &logits,
        &[1],
        &[0; 4],
        &[],
        &[Settings::sampling(1.0)],
        one(4, 3),
    )
    .expect("run");
    let want = [0.5, 0.3, 0.2];
    for v in 0..3 {
        assert!((f64::from(p[v]) - want[v]).abs() < 1e-6, "{p:?}");
    }
    assert_eq!(p[3].to_bits(), 0, "non-public row is exactly +0");
}

#[test]
fn penalties_apply_in_the_documented_order() {
    // counts: token 0 twice, token 1 once, token 2 never. Greedy so p is a one-hot of the
    // penalized logits; read the penalized values through the argmax by construction:
    // l0 = 3 / 2 - (0.5*2 + 0.25) = 0.25; l1 = -1 * 2 - (0.5 + 0.25) = -2.75; l2 = 0.2.
    let s = Settings {
        repetition_penalty: 2.0,
        frequency_penalty: 0.5,
        presence_penalty: 0.25,
        ..Settings::GREEDY
    };
    let p = run_cpu(&[3.0, -1.0, 0.2], &[1], &[2, 1, 0], &[], &[s], one(3, 3)).expect("run");
    assert_eq!(p, vec![1.0, 0.0, 0.0], "0.25 beats 0.2");
    let p = run_cpu(&[3.0, -1.0, 0.3], &[1], &[2, 1, 0], &[], &[s], one(3, 3)).expect("run");
    assert_eq!(p, vec![0.0, 0.0, 1.0], "0.3 beats 0.25");
    // At T = 1 the exact penalized logits give the softmax weights.
    let s1 = Settings {
        temperature: 1.0,
        ..s
    };
    let p = run_cpu(&[3.0, -1.0, 0.2], &[1], &[2, 1, 0], &[], &[s1], one(3, 3)).expect("run");
    let e = [0.25f64.exp(), (-2.75f64).exp(), 0.2f64.exp()];
    let sum: f64 = e.iter().sum();
    for v in 0..3 {
        assert_eq!(p[v], (e[v] / sum) as f32, "token {v}");
    }
}

#[test]
fn accepted_history_is_added_column_by_column() {
    // Two columns with equal logits; d_1 = 0. Column 0 (no history) prefers token 0 (ties to
    // the lowest id); column 1 sees d_1 and the presence penalty moves the argmax to token 1.
    let s = Settings {
        presence_penalty: 1.0,
        ..Settings::GREEDY
    };
    let params = Params {
        rows: 1,
        cols: 2,
        vocab: 2,
        public_vocab: 2,
    };
    let p = run_cpu(&[1.0, 1.0, 1.0, 1.0], &[2], &[0, 0], &[0], &[s], params).expect("run");
    assert_eq!(p, vec![1.0, 0.0, 0.0, 1.0]);
}

#[test]
fn greedy_ties_go_to_the_lowest_id_and_dead_columns_are_zero() {
    let params = Params {
        rows: 1,
        cols: 3,
        vocab: 3,
        public_vocab: 3,
    };
    let logits = [0.0, 2.0, 2.0, 1.0, 1.0, 1.0, 7.0, 7.0, 7.0];
    let p = run_cpu(&logits, &[2], &[0; 3], &[0, 0], &[Settings::GREEDY], params).expect("run");
    assert_eq!(p, vec![0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
}

#[test]
fn top_k_keeps_every_token_tied_with_the_kth() {
    let s = Settings {
        top_k: 2,
        ..Settings::sampling(1.0)
    };
    // Values 3, 2, 2, 1: the 2nd largest is 2, so tokens 0, 1, 2 are kept.
    let p = run_cpu(&[3.0, 2.0, 2.0, 1.0], &[1], &[0; 4], &[], &[s], one(4, 4)).expect("run");
    assert!(
        p[0] > 0.0 && p[1] > 0.0 && p[2] > 0.0 && p[3] == 0.0,
        "{p:?}"
    );
    assert_eq!(p[1], p[2]);
    let sum: f64 = p.iter().map(|&x| f64::from(x)).sum();
    assert!((sum - 1.0).abs() < 1e-6);
}

#[test]
fn top_p_keeps_the_smallest_prefix_reaching_the_mass() {
    let logits = [5f32.ln(), 3f32.ln(), 2f32.ln()];
    let at = |top_p: f32| {
        let s = Settings {
            top_p,
            ..Settings::sampling(1.0)
        };
        run_cpu(&logits, &[1], &[0; 3], &[], &[s], one(3, 3)).expect("run")
    };
    let p = at(0.45);
    assert_eq!(p, vec![1.0, 0.0, 0.0], "0.5 >= 0.45: only the mode");
    let p = at(0.79);
    assert!((p[0] - 0.625).abs() < 1e-6 && (p[1] - 0.375).abs() < 1e-6 && p[2] == 0.0);
    let p = at(0.81);
    assert!(p[2] > 0.19, "0.8 < 0.81 needs the third token: {p:?}");
}

#[test]
fn min_p_drops_tokens_below_the_fraction_of_the_max() {
    let logits = [5f32.ln(), 3f32.ln(), 2f32.ln()];
    let at = |min_p: f32| {
        let s = Settings {
            min_p,
            ..Settings::sampling(1.0)
        };
        run_cpu(&logits, &[1], &[0; 3], &[], &[s], one(3, 3)).expect("run")
    };
    assert!(at(0.39)[2] > 0.0, "0.4 >= 0.39 kept");
    let p = at(0.41);
    assert_eq!(p[2], 0.0, "0.4 < 0.41 dropped");
    assert!((p[0] - 0.625).abs() < 1e-6);
    assert_eq!(at(0.61)[1], 0.0, "0.6 < 0.61 dropped");
}

#[test]
fn temperature_scales_before_the_softmax() {
    let logits = [1.0f32, 0.0];
    let s = Settings::sampling(0.5);
    let p = run_cpu(&logits, &[1], &[0; 2], &[], &[s], one(2, 2)).expect("run");
    let e1 = (-2.0f64).exp();
    assert_eq!(p[0], (1.0 / (1.0 + e1)) as f32);
    assert_eq!(p[1], (e1 / (1.0 + e1)) as f32);
}

#[test]
fn bad_inputs_are_refused_with_typed_errors_and_no_writes() {
    let ok = Settings::sampling(1.0);
    let p1 = one(3, 3);
    let value = |e: OpsError| match e {
        OpsError::Value { tensor, index, .. } => (tensor, index),
        other => panic!("expected a Value error, got {other}"),
    };
    let logits = [0.0, f32::NAN, 1.0];
    let e = run_cpu(&logits, &[1], &[0; 3], &[], &[ok], p1).expect_err("NaN");
    assert_eq!(value(e), ("logits", 1));
    let logits = [0.0, 1.0, f32::INFINITY];
    assert_eq!(
        value(run_cpu(&logits, &[1], &[0; 3], &[], &[ok], p1).expect_err("+inf")),
        ("logits", 2)
    );
    // NaN in a non-public row is fine.
    run_cpu(&[0.0, 1.0, f32::NAN], &[1], &[0; 3], &[], &[ok], one(3, 2)).expect("masked NaN");
    let logits = [0.0, 1.0, 2.0];
    for (s, tensor) in [
        (Settings::sampling(-1.0), "temperature"),
        (Settings::sampling(f32::NAN), "temperature"),
        (Settings { top_k: -1, ..ok }, "top_k"),
        (Settings { top_p: 0.0, ..ok }, "top_p"),
        (Settings { top_p: 1.5, ..ok }, "top_p"),
        (Settings { min_p: 1.0, ..ok }, "min_p"),
        (Settings { min_p: -0.1, ..ok }, "min_p"),
        (
            Settings {
                repetition_penalty: 0.0,
                ..ok
            },
            "repetition_penalty",
        ),
        (
            Settings {
                frequency_penalty: f32::INFINITY,
                ..ok
            },
            "frequency_penalty",
        ),
        (
            Settings {
                presence_penalty: f32::NAN,
                ..ok
            },
            "presence_penalty",
        ),
    ] {
        let e = run_cpu(&logits, &[1], &[0; 3], &[], &[s], p1).expect_err(tensor);
        assert_eq!(value(e), (tensor, 0));
    }
    // Overflow of the processed logit at a tiny temperature.
    let e = run_cpu(
        &[3e38, 0.0, 0.0],
        &[1],
        &[0; 3],
        &[],
        &[Settings::sampling(1e-3)],
        p1,
    )
    .expect_err("overflow");
    assert_eq!(value(e), ("logits", 0));
    // All -inf.
    let ninf = f32::NEG_INFINITY;
    let e = run_cpu(&[ninf; 3], &[1], &[0; 3], &[], &[ok], p1).expect_err("all -inf");
    assert_eq!(value(e).0, "logits");
    let e = run_cpu(&logits, &[1], &[0, -1, 0], &[], &[ok], p1).expect_err("counts");
    assert_eq!(value(e), ("counts", 1));
    let p2 = Params {
        rows: 1,
        cols: 2,
        vocab: 3,
        public_vocab: 3,
    };
    let l2 = [0.0; 6];
    assert_eq!(
        value(run_cpu(&l2, &[0], &[0; 3], &[0], &[ok], p2).expect_err("live 0")),
        ("live", 0)
    );
    assert_eq!(
        value(run_cpu(&l2, &[3], &[0; 3], &[0], &[ok], p2).expect_err("live 3")),
        ("live", 0)
    );
    assert_eq!(
        value(run_cpu(&l2, &[2], &[0; 3], &[3], &[ok], p2).expect_err("proposal")),
        ("proposals", 0)
    );
    // A dead column's proposal is not read.
    run_cpu(&l2, &[1], &[0; 3], &[99], &[ok], p2).expect("dead proposal ignored");
    // Shapes and params.
    let e = run_cpu(&[0.0; 5], &[1], &[0; 3], &[], &[ok], p1).expect_err("short logits");
    assert!(
        matches!(
            e,
            OpsError::Length {
                tensor: "logits",
                ..
            }
        ),
        "{e}"
    );
    let e = run_cpu(&[0.0; 3], &[1], &[0; 3], &[], &[ok], one(3, 4)).expect_err("public");
    assert!(
        matches!(
            e,
            OpsError::Param {
                param: "public_vocab",
                ..
            }
        ),
        "{e}"
    );
}

// ---------------------------------------------------------------------------------------------
// Independent f64 oracle: real-valued probabilities, prefix by sorted probability.

struct Oracle {
    p: Vec<f64>,
    /// Smallest distance of a top-p / min-p decision from its boundary (relative).
    margin: f64,
}

fn oracle(logits: &[f32], counts: &[i64], public: usize, vocab: usize, s: &Settings) -> Oracle {
    // Penalties exactly as f32 operations (the contract's rounding points).
    let z: Vec<f32> = (0..public)
        .map(|v| {
            let mut l = logits[v];
            let c = counts[v];
            if c > 0 {
                l = if l > 0.0 {
                    l / s.repetition_penalty
                } else {
                    l * s.repetition_penalty
                };
                l -= s.frequency_penalty * c as f32 + s.presence_penalty;
            }
            if s.temperature > 0.0 {
                l / s.temperature
            } else {
                l
            }
        })
        .collect();
    let mut p = vec![0f64; vocab];
    let mut best = 0;
    for v in 1..public {
        if z[v] > z[best] {
            best = v;
        }
    }
    if s.temperature <= 0.0 {
        p[best] = 1.0;
        return Oracle { p, margin: 1.0 };
    }
    let zmax = f64::from(z[best]);
    let e: Vec<f64> = z.iter().map(|&x| (f64::from(x) - zmax).exp()).collect();
    let mut order: Vec<usize> = (0..public).collect();
    order.sort_by(|&a, &b| z[b].partial_cmp(&z[a]).expect("finite").then(a.cmp(&b)));
    let mut keep = vec![true; public];
    let k = s.top_k as usize;
    if k > 0 && k < public {
        let t = z[order[k - 1]];
        for v in 0..public {
            keep[v] = z[v] >= t;
        }
    }
    let mut margin = 1f64;
    if s.top_p < 1.0 {
        let total: f64 = (0..public).filter(|&v| keep[v]).map(|v| e[v]).sum();
        let target = f64::from(s.top_p) * total;
        let mut cum = 0.0;
        let mut cut = f32::NEG_INFINITY;
        for &v in order.iter().filter(|&&v| keep[v]) {
            if cum >= target {
                if z[v] < cut {
                    break;
                }
            } else {
                cut = z[v];
            }
            cum += e[v];
            margin = margin.min((cum - target).abs() / total);
        }
        for v in 0..public {
            keep[v] = keep[v] && z[v] >= cut;
        }
    }
    for v in 0..public {
        margin = margin.min((e[v] - f64::from(s.min_p)).abs().max(if s.min_p == 0.0 {
            1.0
        } else {
            0.0
        }));
        keep[v] = keep[v] && e[v] >= f64::from(s.min_p);
    }
    let sum: f64 = (0..public).filter(|&v| keep[v]).map(|v| e[v]).sum();
    for v in 0..public {
        if keep[v] {
            p[v] = e[v] / sum;
        }
    }
    Oracle { p, margin }
}

fn settings_strategy() -> impl Strategy<Value = Settings> {
    (
        prop_oneof![Just(0.0f32), 0.3f32..2.0],
        prop_oneof![Just(0i32), 1i32..8],
        prop_oneof![Just(1.0f32), 0.3f32..0.99],
        prop_oneof![Just(0.0f32), 0.01f32..0.5],
        prop_oneof![Just(1.0f32), 0.5f32..2.0],
        -0.5f32..0.5,
        -0.5f32..0.5,
    )
        .prop_map(
            |(temperature, top_k, top_p, min_p, rep, freq, pres)| Settings {
                temperature,
                top_k,
                top_p,
                min_p,
                repetition_penalty: rep,
                frequency_penalty: freq,
                presence_penalty: pres,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Every live column matches the independent oracle (history included), dead columns are
    /// zero, and the kept set is exact whenever decisions have a margin.
    #[test]
    fn matches_an_independent_f64_oracle(
        vocab in 2usize..24,
        cols in 1usize..5,
        seed in any::<u64>(),
        s in settings_strategy(),
    ) {
        let public = (vocab - vocab / 6).max(1);
        let mut g = Gen::new(seed);
        let logits: Vec<f32> = (0..cols * vocab).map(|_| g.unit() * 8.0 - 4.0).collect();
        let counts: Vec<i32> = (0..vocab).map(|_| g.below(3) as i32).collect();
        let proposals: Vec<i32> = (0..cols - 1).map(|_| g.below(vocab) as i32).collect();
        let live = 1 + g.below(cols) as i32;
        let params = Params { rows: 1, cols, vocab, public_vocab: public };
        let p = run_cpu(&logits, &[live], &counts, &proposals, &[s], params).expect("run");
        for i in 0..cols {
            let col = &p[i * vocab..(i + 1) * vocab];
            if i >= live as usize {
                prop_assert!(col.iter().all(|&x| x.to_bits() == 0), "dead column {i}");
                continue;
            }
            let mut c: Vec<i64> = counts.iter().map(|&x| i64::from(x)).collect();
            for &d in &proposals[..i] {
                c[d as usize] += 1;
            }
            let o = oracle(&logits[i * vocab..(i + 1) * vocab], &c, public, vocab, &s);
            if o.margin < 1e-6 {
                continue; // a boundary decision too close to call: skipped, not asserted
            }
            for v in 0..vocab {
                prop_assert_eq!(col[v] == 0.0, o.p[v] == 0.0, "kept set, column {} token {}", i, v);
                prop_assert!((f64::from(col[v]) - o.p[v]).abs() <= 1e-7 + 1e-6 * o.p[v],
                    "column {} token {}: {} vs {}", i, v, col[v], o.p[v]);
            }
        }
    }
}

#[test]
fn registered_light_cases_have_margins_and_mix_behaviours() {
    // The light mixed case produces greedy one-hot columns, filtered columns and dead columns.
    let d = case_data(8, 16, 4096, 4000, 11, &settings_mix());
    let be = Backend::cpu();
    let s = SamplingBuffers::upload(&be, &d.settings).expect("upload");
    let mut p = be.zeros::<f32>(8 * 16 * 4096).expect("alloc");
    run(
        &be,
        &be.upload(&d.logits).expect("up"),
        &be.upload(&d.live).expect("up"),
        &be.upload(&d.counts).expect("up"),
        &be.upload(&d.proposals).expect("up"),
        &s.view(),
        &mut p,
        &Params {
            rows: 8,
            cols: 16,
            vocab: 4096,
            public_vocab: 4000,
        },
    )
    .expect("run");
    let p = be.download(&p).expect("dl");
    let (mut onehot, mut dead, mut filtered) = (0, 0, 0);
    for rc in 0..8 * 16 {
        let col = &p[rc * 4096..(rc + 1) * 4096];
        assert!(col[4000..].iter().all(|&x| x == 0.0), "mask");
        let nz = col.iter().filter(|&&x| x > 0.0).count();
        match nz {
            0 => dead += 1,
            1 => onehot += 1,
            n if n < 4000 => filtered += 1,
            _ => {}
        }
    }
    assert!(
        onehot > 0 && dead > 0 && filtered > 0,
        "{onehot} {dead} {filtered}"
    );
}
