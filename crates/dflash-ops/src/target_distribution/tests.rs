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

#[test]
fn tie_cases_tie_the_argmax_across_blocks_and_at_the_top_k_boundary() {
    // The tie data is what the CUDA cluster's cross-block merges must get right: a greedy
    // column's argmax is a tie whose lowest id is not in the first slice of the vocabulary
    // once the history has penalized the lower ones, and a top-k boundary keeps every tied id.
    let (rows, cols, vocab, public) = (6, 6, 4096, 4000);
    let d = tie_case_data(rows, cols, vocab, public, 21, &tie_settings());
    let params = Params {
        rows,
        cols,
        vocab,
        public_vocab: public,
    };
    let p = run_cpu(
        &d.logits,
        &d.live,
        &d.counts,
        &d.proposals,
        &d.settings,
        params,
    )
    .expect("run");
    let (mut greedy_past_first_block, mut topk_ties) = (0, 0);
    for r in 0..rows {
        let s = d.settings[r];
        for i in 0..d.live[r] as usize {
            let col = &p[(r * cols + i) * vocab..(r * cols + i + 1) * vocab];
            // The tied ids the history leaves unpenalized (proposals d_1..d_i, when the row
            // has penalties; all of them lower a logit of 9 below the tie).
            let penalized = s.repetition_penalty != 1.0
                || s.frequency_penalty != 0.0
                || s.presence_penalty != 0.0;
            let hist = if penalized {
                &d.proposals[r * (cols - 1)..r * (cols - 1) + i]
            } else {
                &[][..]
            };
            let free: Vec<usize> = TIE_IDS
                .iter()
                .copied()
                .filter(|&v| v < public && !hist.contains(&(v as i32)))
                .collect();
            if free.is_empty() {
                continue; // every tied id penalized (the row's proposals took them all)
            }
            if s.temperature <= 0.0 {
                let g = col.iter().position(|&x| x == 1.0).expect("one-hot");
                assert_eq!(
                    g, free[0],
                    "row {r} column {i}: the lowest unpenalized tied id"
                );
                if g >= 512 {
                    greedy_past_first_block += 1;
                }
            } else if s.top_k > 0 && (s.top_k as usize) < free.len() {
                assert!(
                    free.iter().all(|&v| col[v] > 0.0),
                    "row {r} column {i}: top-k {} keeps the whole tie {free:?}",
                    s.top_k
                );
                topk_ties += 1;
            }
        }
    }
    assert!(
        greedy_past_first_block > 0 && topk_ties > 0,
        "{greedy_past_first_block} {topk_ties}"
    );
}

// ---------------------------------------------------------------------------------------------
// The `Live` form, dtypes and column layouts.

/// Inputs of one CPU call in any form.
struct Call<'a> {
    /// Stored logits (f32 values; `bf16` stores their bf16 rounding).
    logits: &'a [f32],
    bf16: bool,
    /// `None`: [`Columns::Padded`].
    col_start: Option<&'a [i32]>,
    live: &'a [i32],
    counts: &'a [i32],
    /// The nodes' tokens (a chain's proposals, a tree's tokens).
    proposals: &'a [i32],
    /// `Some`: [`History::Tree`] with these parents; `None`: [`History::Chain`].
    parents: Option<&'a [i32]>,
    settings: &'a [Settings],
    params: Params,
    /// Rows the p and greedy buffers hold (`>= params.rows`).
    out_rows: usize,
    /// `Live` (else `Full`).
    live_form: bool,
}

/// (p, greedy) after the call (both poisoned before it), or the error after checking that
/// nothing was written.
fn call(c: &Call<'_>) -> std::result::Result<(Vec<f32>, Vec<i32>), OpsError> {
    let be = Backend::cpu();
    let Params { cols, vocab, .. } = c.params;
    let lf = be.upload(c.logits).expect("upload");
    let widened: Vec<bf16> = c.logits.iter().map(|&x| bf16::from_f32(x)).collect();
    let lb = be.upload(&widened).expect("upload");
    let logits = if c.bf16 {
        Logits::Bf16(&lb)
    } else {
        Logits::F32(&lf)
    };
    let cs = be.upload(c.col_start.unwrap_or(&[])).expect("upload");
    let columns = match c.col_start {
        Some(_) => Columns::Starts(&cs),
        None => Columns::Padded,
    };
    let lv = be.upload(c.live).expect("upload");
    let ct = be.upload(c.counts).expect("upload");
    let d = be.upload(c.proposals).expect("upload");
    let par = be.upload(c.parents.unwrap_or(&[])).expect("upload");
    let history = match c.parents {
        Some(_) => History::Tree {
            tokens: &d,
            parents: &par,
        },
        None => History::Chain(&d),
    };
    let s = SamplingBuffers::upload(&be, c.settings).expect("upload");
    let mut p = be
        .filled(c.out_rows * cols * vocab, f32::POISON)
        .expect("alloc");
    let mut g = be.filled(c.out_rows * cols, i32::POISON).expect("alloc");
    let out = if c.live_form {
        Outputs::Live {
            p: &mut p,
            greedy: &mut g,
        }
    } else {
        Outputs::Full(&mut p)
    };
    let r = run_with(
        &be,
        logits,
        columns,
        &lv,
        &ct,
        history,
        &s.view(),
        out,
        &c.params,
    );
    let (p, g) = (be.download(&p).expect("dl"), be.download(&g).expect("dl"));
    match r {
        Ok(()) => Ok((p, g)),
        Err(e) => {
            assert!(
                p.iter().all(|x| x.to_bits() == f32::POISON.to_bits())
                    && g.iter().all(|&x| x == i32::POISON),
                "a refused call wrote an output: {e}"
            );
            Err(e)
        }
    }
}

/// The mixed light case of the registry (greedy and sampled rows, dead columns), small.
fn mixed(seed: u64) -> (CaseData, Params) {
    let params = Params {
        rows: 8,
        cols: 6,
        vocab: 300,
        public_vocab: 280,
    };
    (case_data(8, 6, 300, 280, seed, &settings_mix()), params)
}

fn full_call<'a>(d: &'a CaseData, params: Params) -> Call<'a> {
    Call {
        logits: &d.logits,
        bf16: false,
        col_start: None,
        live: &d.live,
        counts: &d.counts,
        proposals: &d.proposals,
        parents: d.parents.as_deref(),
        settings: &d.settings,
        params,
        out_rows: params.rows,
        live_form: false,
    }
}

fn bits(p: &[f32]) -> Vec<u32> {
    p.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn live_greedy_columns_write_only_their_argmax_and_leave_p_untouched() {
    for seed in 0..4 {
        let (d, params) = mixed(40 + seed);
        let Params {
            rows, cols, vocab, ..
        } = params;
        let (full, _) = call(&full_call(&d, params)).expect("full");
        let (p, greedy) = call(&Call {
            live_form: true,
            ..full_call(&d, params)
        })
        .expect("live");
        let (mut greedy_cols, mut sampled_cols, mut dead_cols) = (0, 0, 0);
        for rc in 0..rows * cols {
            let (r, i) = (rc / cols, rc % cols);
            let row = rc * vocab..(rc + 1) * vocab;
            let untouched = p[row.clone()]
                .iter()
                .all(|x| x.to_bits() == f32::POISON.to_bits());
            if i >= d.live[r] as usize {
                dead_cols += 1;
                assert!(untouched, "dead column ({r}, {i}): p untouched");
                assert_eq!(
                    greedy[rc],
                    i32::POISON,
                    "dead column ({r}, {i}): greedy untouched"
                );
            } else if d.settings[r].temperature <= 0.0 {
                greedy_cols += 1;
                let one = full[row.clone()].iter().position(|&x| x == 1.0);
                assert_eq!(Some(greedy[rc] as usize), one, "greedy id ({r}, {i})");
                assert!(untouched, "greedy column ({r}, {i}) wrote p");
            } else {
                sampled_cols += 1;
                assert_eq!(greedy[rc], SAMPLED, "sampled column ({r}, {i})");
                assert_eq!(bits(&p[row.clone()]), bits(&full[row]), "p ({r}, {i})");
            }
        }
        assert!(greedy_cols > 0 && sampled_cols > 0 && dead_cols > 0);
    }
}

#[test]
fn bf16_logits_give_the_result_of_their_f32_widening() {
    let (d, params) = mixed(50);
    let widened: Vec<f32> = d
        .logits
        .iter()
        .map(|&x| bf16::from_f32(x).to_f32())
        .collect();
    assert!(
        widened.iter().zip(&d.logits).any(|(a, b)| a != b),
        "the fixture is not bf16-exact, so the rounding matters"
    );
    for live_form in [false, true] {
        let base = Call {
            live_form,
            ..full_call(&d, params)
        };
        let from_bf16 = call(&Call { bf16: true, ..base }).expect("bf16");
        let from_f32 = call(&Call {
            logits: &widened,
            ..base
        })
        .expect("f32");
        assert_eq!(
            bits(&from_bf16.0),
            bits(&from_f32.0),
            "p, live form {live_form}"
        );
        assert_eq!(from_bf16.1, from_f32.1, "greedy, live form {live_form}");
    }
}

#[test]
fn packed_logits_give_the_result_of_padded_logits() {
    let (mut d, params) = mixed(60);
    let Params {
        rows, cols, vocab, ..
    } = params;
    // Dead columns of the padded logits hold NaN: never read.
    for rc in 0..rows * cols {
        if rc % cols >= d.live[rc / cols] as usize {
            d.logits[rc * vocab..(rc + 1) * vocab].fill(f32::NAN);
        }
    }
    let (packed, starts) = stored_logits(&d, cols, vocab, CaseLayout::Packed);
    let live_cols: usize = d.live.iter().map(|&q| q as usize).sum();
    assert_eq!(
        packed.len(),
        live_cols * vocab,
        "packed holds only live columns"
    );
    let (_, padded_starts) = stored_logits(&d, cols, vocab, CaseLayout::Padded);
    for live_form in [false, true] {
        for bf16 in [false, true] {
            let base = Call {
                live_form,
                bf16,
                ..full_call(&d, params)
            };
            let padded = call(&base).expect("padded");
            let through_starts = call(&Call {
                col_start: Some(&padded_starts),
                ..base
            })
            .expect("padded starts");
            let from_packed = call(&Call {
                logits: &packed,
                col_start: Some(&starts),
                ..base
            })
            .expect("packed");
            for other in [&through_starts, &from_packed] {
                assert_eq!(bits(&padded.0), bits(&other.0), "p ({live_form}, {bf16})");
                assert_eq!(padded.1, other.1, "greedy ({live_form}, {bf16})");
            }
        }
    }
}

#[test]
fn col_start_must_place_every_live_column_inside_the_logits() {
    let (d, params) = mixed(70);
    let Params { cols, vocab, .. } = params;
    let (packed, starts) = stored_logits(&d, cols, vocab, CaseLayout::Packed);
    let base = Call {
        logits: &packed,
        col_start: Some(&starts),
        live_form: true,
        ..full_call(&d, params)
    };
    call(&base).expect("valid");
    let value = |e: OpsError| match e {
        OpsError::Value { tensor, index, .. } => (tensor, index),
        other => panic!("expected a Value error, got {other}"),
    };
    // The last row's live columns run one column past the end.
    let mut past = starts.clone();
    past[7] += 1;
    let e = call(&Call {
        col_start: Some(&past),
        ..base
    })
    .expect_err("past the end");
    assert_eq!(value(e), ("col_start", 7));
    let mut negative = starts.clone();
    negative[3] = -1;
    let e = call(&Call {
        col_start: Some(&negative),
        ..base
    })
    .expect_err("negative");
    assert_eq!(value(e), ("col_start", 3));
    // Logits that are not whole vocabulary columns, and a short col_start.
    let e = call(&Call {
        logits: &packed[..packed.len() - 1],
        ..base
    })
    .expect_err("ragged logits");
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
    let e = call(&Call {
        col_start: Some(&starts[..7]),
        ..base
    })
    .expect_err("short col_start");
    assert!(
        matches!(
            e,
            OpsError::Length {
                tensor: "col_start",
                ..
            }
        ),
        "{e}"
    );
    // Rows may overlap and columns past the live ones may be missing: each row only needs
    // its own live columns.
    let mut shared = starts.clone();
    shared[1] = 0;
    call(&Call {
        col_start: Some(&shared),
        ..base
    })
    .expect("rows reading the same columns");
}

#[test]
fn a_call_of_fewer_rows_than_its_buffers_leaves_the_extra_rows_untouched() {
    let (d, params) = mixed(80);
    let Params { cols, vocab, .. } = params;
    let n = 3;
    let small = Params { rows: n, ..params };
    for live_form in [false, true] {
        // Buffers planned for 8 rows (inputs included), a call of 3.
        let (p8, g8) = call(&Call {
            params: small,
            live_form,
            ..full_call(&d, params)
        })
        .expect("3 of 8 rows");
        // The same 3 rows with exactly sized buffers.
        let (p3, g3) = call(&Call {
            logits: &d.logits[..n * cols * vocab],
            live: &d.live[..n],
            counts: &d.counts[..n * vocab],
            proposals: &d.proposals[..n * (cols - 1)],
            settings: &d.settings[..n],
            params: small,
            out_rows: n,
            live_form,
            ..full_call(&d, params)
        })
        .expect("3 rows");
        assert_eq!(bits(&p8[..p3.len()]), bits(&p3));
        assert_eq!(&g8[..g3.len()], &g3[..]);
        assert!(
            p8[p3.len()..]
                .iter()
                .all(|x| x.to_bits() == f32::POISON.to_bits())
        );
        assert!(g8[g3.len()..].iter().all(|&x| x == i32::POISON));
    }
    // Buffers must still hold whole rows, at least `rows` of them.
    let e = call(&Call {
        out_rows: 2,
        params: small,
        ..full_call(&d, params)
    })
    .expect_err("p of 2 rows for 3");
    assert!(matches!(e, OpsError::Length { tensor: "p", .. }), "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Whatever the settings, dtype and layout: the `Live` form writes, per live column,
    /// exactly the `Full` form's one-hot id (greedy) or its p row (sampled), and nothing else.
    #[test]
    fn the_live_form_is_the_full_form_restricted_to_what_verification_reads(
        vocab in 2usize..40,
        cols in 1usize..5,
        rows in 1usize..4,
        seed in any::<u64>(),
        s in settings_strategy(),
        bf16 in any::<bool>(),
        packed in any::<bool>(),
    ) {
        let public = (vocab - vocab / 6).max(1);
        let params = Params { rows, cols, vocab, public_vocab: public };
        let mut g = Gen::new(seed);
        let settings = vec![s; rows];
        let mut d = case_data(rows, cols, vocab, public, seed, &settings);
        for x in d.logits.iter_mut() {
            *x = g.unit() * 8.0 - 4.0;
        }
        let (stored, starts) = stored_logits(
            &d,
            cols,
            vocab,
            if packed { CaseLayout::Packed } else { CaseLayout::Padded },
        );
        let full = call(&Call { bf16, ..full_call(&d, params) }).expect("full");
        let (p, greedy) = call(&Call {
            logits: &stored,
            col_start: Some(&starts),
            bf16,
            live_form: true,
            ..full_call(&d, params)
        })
        .expect("live");
        for rc in 0..rows * cols {
            let row = rc * vocab..(rc + 1) * vocab;
            let is_live = rc % cols < d.live[rc / cols] as usize;
            if !is_live {
                prop_assert_eq!(greedy[rc], i32::POISON);
                prop_assert!(p[row].iter().all(|x| x.to_bits() == f32::POISON.to_bits()));
            } else if s.temperature <= 0.0 {
                let one = full.0[row.clone()].iter().position(|&x| x == 1.0);
                prop_assert_eq!(Some(greedy[rc] as usize), one);
                prop_assert!(p[row].iter().all(|x| x.to_bits() == f32::POISON.to_bits()));
            } else {
                prop_assert_eq!(greedy[rc], SAMPLED);
                prop_assert_eq!(bits(&p[row.clone()]), bits(&full.0[row]));
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Tree histories.

/// The parents that make a chain a tree: node `j`'s parent is `j - 1`.
fn chain_parents(rows: usize, cols: usize) -> Vec<i32> {
    (0..rows * (cols - 1))
        .map(|x| (x % (cols - 1)) as i32)
        .collect()
}

/// The tokens of column `i`'s root path (node `i` up to, excluding, the anchor), written
/// independently of the reference.
fn root_path_tokens(tokens: &[i32], parents: &[i32], i: usize) -> Vec<i32> {
    let mut out = Vec::new();
    let mut j = i;
    while j != 0 {
        out.push(tokens[j - 1]);
        j = parents[j - 1] as usize;
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// A chain given as a tree (`parents[j-1] = j - 1`) gives the chain form's outputs bit for
    /// bit, in every output form, dtype and layout, over the plain and the tie case data.
    #[test]
    fn tree_chain_given_as_a_tree_equals_the_chain_form(
        vocab in 2usize..40,
        cols in 1usize..9,
        rows in 1usize..4,
        seed in any::<u64>(),
        s in settings_strategy(),
        ties in any::<bool>(),
        bf16 in any::<bool>(),
        packed in any::<bool>(),
        live_form in any::<bool>(),
    ) {
        let public = (vocab - vocab / 6).max(1);
        let params = Params { rows, cols, vocab, public_vocab: public };
        let settings = vec![s; rows];
        let d = if ties {
            tie_case_data(rows, cols, vocab, public, seed, &settings)
        } else {
            case_data(rows, cols, vocab, public, seed, &settings)
        };
        let (stored, starts) = stored_logits(
            &d,
            cols,
            vocab,
            if packed { CaseLayout::Packed } else { CaseLayout::Padded },
        );
        let chain = Call {
            logits: &stored,
            col_start: Some(&starts),
            bf16,
            live_form,
            ..full_call(&d, params)
        };
        let parents = chain_parents(rows, cols);
        let as_chain = call(&chain).expect("chain");
        let as_tree = call(&Call { parents: Some(&parents), ..chain }).expect("tree");
        prop_assert_eq!(bits(&as_chain.0), bits(&as_tree.0));
        prop_assert_eq!(as_chain.1, as_tree.1);
    }

    /// Random trees: every live column matches the independent oracle with the counts of its
    /// root path (the chain property test's oracle), dead columns are zero.
    #[test]
    fn tree_matches_an_independent_f64_oracle_on_root_paths(
        vocab in 2usize..24,
        cols in 1usize..9,
        seed in any::<u64>(),
        s in settings_strategy(),
    ) {
        let public = (vocab - vocab / 6).max(1);
        let mut g = Gen::new(seed);
        let logits: Vec<f32> = (0..cols * vocab).map(|_| g.unit() * 8.0 - 4.0).collect();
        let counts: Vec<i32> = (0..vocab).map(|_| g.below(3) as i32).collect();
        // Few distinct tokens, so that branches repeat each other's tokens.
        let tokens: Vec<i32> = (0..cols - 1).map(|_| g.below(vocab.min(4)) as i32).collect();
        let parents: Vec<i32> = (1..cols).map(|j| g.below(j) as i32).collect();
        let live = [1 + g.below(cols) as i32];
        let settings = [s];
        let params = Params { rows: 1, cols, vocab, public_vocab: public };
        let (p, _) = call(&Call {
            logits: &logits,
            bf16: false,
            col_start: None,
            live: &live,
            counts: &counts,
            proposals: &tokens,
            parents: Some(&parents),
            settings: &settings,
            params,
            out_rows: 1,
            live_form: false,
        })
        .expect("run");
        for i in 0..cols {
            let col = &p[i * vocab..(i + 1) * vocab];
            if i >= live[0] as usize {
                prop_assert!(col.iter().all(|&x| x.to_bits() == 0), "dead column {}", i);
                continue;
            }
            let mut c: Vec<i64> = counts.iter().map(|&x| i64::from(x)).collect();
            for d in root_path_tokens(&tokens, &parents, i) {
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

/// The hand-computed tree of the tests below (6 nodes, vocabulary 4):
///
/// ```text
///            0 (anchor)
///          /   \
///   1: tok 0    2: tok 0      siblings with the same token
///      |           |
///   3: tok 2    4: tok 1
///                  |
///               5: tok 0
/// ```
///
/// Root paths: 1 {0}, 2 {0}, 3 {2, 0}, 4 {1, 0}, 5 {0, 1, 0}. Read as a chain the same
/// tokens would give column 4 the history {0, 0, 2, 1}.
const TREE_TOKENS: [i32; 5] = [0, 0, 2, 1, 0];
const TREE_PARENTS: [i32; 5] = [0, 0, 1, 2, 4];

fn tree_call<'a>(
    logits: &'a [f32],
    counts: &'a [i32],
    settings: &'a [Settings],
    parents: Option<&'a [i32]>,
) -> Call<'a> {
    Call {
        logits,
        bf16: false,
        col_start: None,
        live: &[6],
        counts,
        proposals: &TREE_TOKENS,
        parents,
        settings,
        params: Params {
            rows: 1,
            cols: 6,
            vocab: 4,
            public_vocab: 4,
        },
        out_rows: 1,
        live_form: false,
    }
}

#[test]
fn tree_history_is_the_root_path_and_never_a_sibling_branch() {
    // Greedy with a repetition penalty of 2 on the logits [4, 3.9, 3, 1] of every column:
    // a penalized positive logit is halved (4 -> 2, 3.9 -> 1.95, 3 -> 1.5). The argmax is 0
    // unless 0 is penalized; then 1 (3.9) unless 1 is penalized too; then 2 (3) unless 2 is.
    let s = [Settings {
        repetition_penalty: 2.0,
        ..Settings::GREEDY
    }];
    let logits: Vec<f32> = (0..6).flat_map(|_| [4.0, 3.9, 3.0, 1.0]).collect();
    let counts = [0; 4];
    let (p, _) = call(&tree_call(&logits, &counts, &s, Some(&TREE_PARENTS))).expect("tree");
    let argmax = |p: &[f32], i: usize| {
        let col = &p[i * 4..(i + 1) * 4];
        assert_eq!(
            col.iter().filter(|&&x| x == 1.0).count(),
            1,
            "one-hot {col:?}"
        );
        col.iter().position(|&x| x == 1.0).expect("one-hot")
    };
    // Column 0: no history. Columns 1, 2: {0}. Column 3: {2, 0} (token 1 of the sibling
    // branch 2 -> 4 is not penalized). Column 4: {1, 0}: token 2 sits only in the branch
    // 1 -> 3, so it keeps its 3.0 and wins over the halved 2.0 and 1.95. Column 5: {0, 1, 0}.
    let want = [0, 1, 1, 1, 2, 2];
    for (i, &w) in want.iter().enumerate() {
        assert_eq!(argmax(&p, i), w, "column {i}");
    }
    // The same tokens read as a chain penalize token 2 at column 4 ({0, 0, 2, 1}): argmax 0
    // (2.0 beats 1.95 and 1.5).
    let (chain, _) = call(&tree_call(&logits, &counts, &s, None)).expect("chain");
    assert_eq!(argmax(&chain, 4), 0, "the chain reading differs");

    // Multiplicity along the path: T = 1, frequency penalty 1 on logits 0 gives z = -c, so
    // p is proportional to exp(-c). Column 5 counts token 0 twice (nodes 5 and 2) and token
    // 1 once (node 4), never token 2 (node 3, another branch); counts add the anchor's.
    let s = [Settings {
        frequency_penalty: 1.0,
        ..Settings::sampling(1.0)
    }];
    let logits = [0.0f32; 24];
    let counts = [0, 0, 0, 1];
    let (p, _) = call(&tree_call(&logits, &counts, &s, Some(&TREE_PARENTS))).expect("tree");
    for (i, c) in [
        [0, 0, 0, 1],
        [1, 0, 0, 1],
        [1, 0, 0, 1],
        [1, 0, 1, 1],
        [1, 1, 0, 1],
        [2, 1, 0, 1],
    ]
    .iter()
    .enumerate()
    {
        let e: Vec<f64> = c.iter().map(|&c| (-f64::from(c)).exp()).collect();
        let sum: f64 = e.iter().sum();
        for v in 0..4 {
            assert_eq!(p[i * 4 + v], (e[v] / sum) as f32, "column {i} token {v}");
        }
    }
}

#[test]
fn tree_bad_parents_and_tokens_are_refused_with_nothing_written() {
    let s = [Settings::sampling(1.0)];
    let logits = [0.5f32; 24];
    let counts = [0; 4];
    let value = |e: OpsError| match e {
        OpsError::Value { tensor, index, .. } => (tensor, index),
        other => panic!("expected a Value error, got {other}"),
    };
    call(&tree_call(&logits, &counts, &s, Some(&TREE_PARENTS))).expect("valid");
    // Node j's parent must be an earlier node, 0..j: itself, a later node, a negative one
    // are refused (`call` checks that nothing was written).
    for (node, par) in [(1, 1), (3, 3), (3, 4), (5, 5), (5, 6), (2, -1)] {
        let mut parents = TREE_PARENTS;
        parents[node - 1] = par;
        let e =
            call(&tree_call(&logits, &counts, &s, Some(&parents))).expect_err("bad parent refused");
        assert_eq!(value(e), ("parents", node - 1), "node {node} parent {par}");
    }
    // A dead node's parent (and token) is not read.
    let mut parents = TREE_PARENTS;
    parents[4] = 9;
    let mut tokens = TREE_TOKENS;
    tokens[4] = -7;
    call(&Call {
        live: &[5],
        proposals: &tokens,
        ..tree_call(&logits, &counts, &s, Some(&parents))
    })
    .expect("dead node ignored");
    // A live node's token out of range is refused under the tree's name.
    let e = call(&Call {
        proposals: &tokens,
        ..tree_call(&logits, &counts, &s, Some(&TREE_PARENTS))
    })
    .expect_err("token");
    assert_eq!(value(e), ("tokens", 4));
    // Short parents.
    let e = call(&tree_call(&logits, &counts, &s, Some(&TREE_PARENTS[..4])))
        .expect_err("short parents");
    assert!(
        matches!(
            e,
            OpsError::Length {
                tensor: "parents",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn tree_cases_share_sibling_tokens_and_differ_from_their_chain_reading() {
    // The tree case data must exercise what the tree form changes: siblings with one token,
    // and columns whose root-path history is not the prefix of the same tokens.
    let (rows, cols, vocab, public) = (8, 32, 4096, 4000);
    let d = tree_case_data(rows, cols, vocab, public, 25, &tree_settings());
    let parents = d.parents.as_deref().expect("a tree");
    let k = cols - 1;
    let mut shared_siblings = 0;
    for r in 0..rows {
        let (tok, par) = (
            &d.proposals[r * k..(r + 1) * k],
            &parents[r * k..(r + 1) * k],
        );
        for a in 0..k {
            assert!((0..=a as i32).contains(&par[a]), "parent of node {}", a + 1);
            shared_siblings += (a + 1..k)
                .filter(|&b| par[b] == par[a] && tok[b] == tok[a])
                .count();
        }
    }
    assert!(shared_siblings > 0, "no siblings share a token");
    let params = Params {
        rows,
        cols,
        vocab,
        public_vocab: public,
    };
    let tree = call(&full_call(&d, params)).expect("tree");
    let chain = call(&Call {
        parents: None,
        ..full_call(&d, params)
    })
    .expect("chain");
    let differ = (0..rows * cols)
        .filter(|&rc| {
            let row = rc * vocab..(rc + 1) * vocab;
            bits(&tree.0[row.clone()]) != bits(&chain.0[row])
        })
        .count();
    assert!(
        differ > 0,
        "every column reads its tree history as the chain prefix"
    );
}
