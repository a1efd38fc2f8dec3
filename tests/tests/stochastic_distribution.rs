//! Seeded stochastic speculative decoding reproduces plain target sampling's distribution.
//!
//! Setup ([`drafts_setup`]): one held-out prompt of 16 bytes, temperature 0.7 with top-k 2 (so
//! every position has at most 2 tokens), a budget of 5 output tokens: the output
//! `(y_0, .., y_4)` takes at most 32 values. Its exact probability under plain target sampling
//! is computed from the target itself (`p_0(y_0) p_1(y_1 | y_0) ...`, each `p` the
//! `target_distribution` op over the target's logits). The speculative runs use the trained
//! drafts with K = 4, so one round can finish a request; their proposals must really be
//! accepted (at least one per row-round on average), so that acceptance, the residual and the
//! bonus all carry mass. `N` requests with seeds `1..=N` are decoded and the counts compared
//! with Pearson's chi-square statistic (cells with an expected count below 5 pooled).
//!
//! Threshold: the chi-square quantile of `df = cells - 1` at upper tail `1e-6` (Wilson-Hilferty
//! approximation with `z = 4.753`), so a correct implementation fails with probability about
//! `1e-6` per check (the seeds are fixed, so a run is deterministic; this is the chance that the
//! fixed seeds happen to be unlucky). The trained DFlash2 draft reporting a uniform q must
//! exceed the threshold by far. The shadow proposer's test ([`shadow_setup`]: temperature 1,
//! top-k 3, 3 tokens) checks its wrong variant — a proposer that draws its proposals
//! from `r = [0.1, 0.1, 0.7, ...]` over 16 candidates but reports a uniform q — moves most mass
//! onto the target's third-best token and must exceed the same threshold by far.

use std::collections::HashMap;

use dflash_cli::{Fixture, demo_prompts};
use dflash_config::Backend as DraftBackend;
use dflash_e2e::{
    Strategy, draft_engine, misreporting_draft_engine, shadow_engine, tree_draft_engine,
};
use dflash_engine::{
    Commit, Engine, Event, Proposer, Request, SamplingSettings, Target, VerifyBatch, VerifyRow,
    plain_decode,
};
use dflash_ops::Backend;
use dflash_ops::target_distribution::{self, Logits, SamplingBuffers};
use dflash_testkit::ReferenceTarget;

/// Samples per variant.
const N: u64 = 1000;
/// Draft count of the speculative runs (a row of `LEN` outputs can finish in one round).
const K: u32 = 4;

/// One statistical setup: prompt, sampling settings and output length.
#[derive(Clone)]
struct Setup {
    prompt: Vec<u32>,
    settings: SamplingSettings,
    len: usize,
}

/// The trained drafts' setup: a short held-out prompt, "Create a fresh i" (the reference
/// target's prefill dominates the cost of a sample), temperature 0.7, top-k 2, 5 tokens: the
/// target's next tokens are uncertain enough for a non-degenerate support and predictable
/// enough for the drafts to be accepted.
fn drafts_setup() -> Setup {
    Setup {
        prompt: demo_prompts(1, 5).remove(0)[..16].to_vec(),
        settings: SamplingSettings {
            top_k: 2,
            ..SamplingSettings::sampling(0.7)
        },
        len: 5,
    }
}

/// The shadow proposer's setup: temperature 1, top-k 3 (its wrong variant moves mass onto the
/// third-best token), 3 tokens, after the held-out prompt "Write the buffer".
fn shadow_setup() -> Setup {
    Setup {
        prompt: demo_prompts(1, 9).remove(0)[..16].to_vec(),
        settings: SamplingSettings {
            top_k: 3,
            ..SamplingSettings::sampling(1.0)
        },
        len: 3,
    }
}

/// The processed target distribution of one logits column (no penalties are set, so the
/// history counts do not matter).
fn processed(su: &Setup, be: &Backend, logits: &[f32], public: usize) -> Vec<f32> {
    let v = logits.len();
    let s = SamplingBuffers::upload(be, &[su.settings]).expect("settings");
    let mut p = be.zeros(v).expect("p");
    target_distribution::run(
        be,
        &be.upload(logits).expect("logits"),
        &be.filled(1, 1).expect("live"),
        &be.zeros(v).expect("counts"),
        &be.zeros(0).expect("proposals"),
        &s.view(),
        &mut p,
        &target_distribution::Params {
            rows: 1,
            cols: 1,
            vocab: v,
            public_vocab: public,
        },
    )
    .expect("target distribution");
    be.download(&p).expect("download")
}

/// Exact probabilities of every output sequence of length `su.len` under plain sampling.
fn exact(su: &Setup, target: &mut ReferenceTarget) -> HashMap<Vec<u32>, f64> {
    let be = Backend::cpu();
    let public = target.info().public_vocab;
    let (seq, pre) = target.create_with_prompt(&be, &su.prompt).expect("prefill");
    let first = processed(
        su,
        &be,
        &be.download(&pre.last_logits).expect("logits"),
        public,
    );
    let mut out = HashMap::new();
    let mut stack = vec![(seq, Vec::<u32>::new(), 1.0f64, first)];
    while let Some((s, prefix, prob, p)) = stack.pop() {
        for (t, &pt) in p.iter().enumerate() {
            if pt <= 0.0 {
                continue;
            }
            let mut seqv = prefix.clone();
            seqv.push(t as u32);
            let pr = prob * f64::from(pt);
            if seqv.len() == su.len {
                out.insert(seqv, pr);
                continue;
            }
            let f = target.fork(s).expect("fork");
            let input = [t as u32];
            target
                .verify(
                    &be,
                    &VerifyBatch {
                        rows: &[VerifyRow::chain(f, &input)],
                        cols: 1,
                    },
                )
                .expect("verify");
            target.commit(&[Commit::prefix(f, 1)]).expect("commit");
            let vocab = target.info().vocab_rows;
            let view = target.verified().expect("verified");
            let Logits::F32(l) = view.logits.values else {
                panic!("F32 logits");
            };
            let next = processed(su, &be, &be.read(l, 0, vocab).expect("logits"), public);
            stack.push((f, seqv, pr, next));
        }
        target.release(s).expect("release");
    }
    out
}

fn requests(su: &Setup) -> Vec<Request> {
    (1..=N)
        .map(|seed| Request {
            sampling: su.settings,
            seed,
            ..Request::greedy(su.prompt.clone(), su.len)
        })
        .collect()
}

fn engine_samples<T: Target, P: Proposer>(su: &Setup, engine: &mut Engine<T, P>) -> Vec<Vec<u32>> {
    let reqs = requests(su);
    let ids: Vec<_> = reqs
        .iter()
        .map(|r| engine.submit(r.clone()).expect("submit"))
        .collect();
    let mut outs: HashMap<_, Vec<u32>> = HashMap::new();
    engine
        .run(&mut |e: &Event| {
            if let Event::Tokens { id, tokens, .. } = e {
                outs.entry(*id).or_default().extend(tokens);
            }
        })
        .expect("run");
    ids.iter()
        .map(|id| outs.remove(id).unwrap_or_default())
        .collect()
}

/// Pearson's chi-square of `samples` against `exact` (expected counts below 5 pooled into one
/// cell, together with any sample outside the support) and its df.
fn chi_square(samples: &[Vec<u32>], exact: &HashMap<Vec<u32>, f64>) -> (f64, usize) {
    let n = samples.len() as f64;
    let mut counts: HashMap<&[u32], f64> = HashMap::new();
    for s in samples {
        *counts.entry(s.as_slice()).or_default() += 1.0;
    }
    let (mut chi, mut cells) = (0.0, 0usize);
    let (mut pooled_obs, mut pooled_exp) = (0.0, 0.0);
    let mut seen = 0.0;
    for (k, &p) in exact {
        let e = n * p;
        let o = counts.get(k.as_slice()).copied().unwrap_or(0.0);
        seen += o;
        if e >= 5.0 {
            chi += (o - e) * (o - e) / e;
            cells += 1;
        } else {
            pooled_obs += o;
            pooled_exp += e;
        }
    }
    // Samples outside the exact support (impossible under plain sampling) join the pool.
    pooled_obs += n - seen;
    if pooled_exp > 0.0 || pooled_obs > 0.0 {
        let e = pooled_exp.max(1e-9);
        chi += (pooled_obs - e) * (pooled_obs - e) / e;
        cells += 1;
    }
    (chi, cells.saturating_sub(1))
}

/// Upper `1e-6` quantile of chi-square with `df` degrees of freedom (Wilson-Hilferty).
fn threshold(df: usize) -> f64 {
    let k = df.max(1) as f64;
    let z = 4.753;
    let a = 2.0 / (9.0 * k);
    k * (1.0 - a + z * a.sqrt()).powi(3)
}

fn check(
    su: &Setup,
    name: &str,
    samples: &[Vec<u32>],
    exact: &HashMap<Vec<u32>, f64>,
) -> (f64, f64) {
    assert!(
        samples.iter().all(|s| s.len() == su.len),
        "{name}: every output has {} tokens",
        su.len
    );
    let (chi, df) = chi_square(samples, exact);
    let t = threshold(df);
    assert!(df >= 5, "{name}: a non-degenerate support ({df} df)");
    (chi, t)
}

#[test]
fn plain_sampling_matches_the_exact_distribution() {
    let fx = Fixture::write(DraftBackend::DFlash).expect("fixture");
    let mut target = fx.target().expect("target");
    let su = drafts_setup();
    let ex = exact(&su, &mut target);
    let total: f64 = ex.values().sum();
    assert!(
        (total - 1.0).abs() < 1e-5,
        "exact probabilities sum to {total}"
    );
    let samples: Vec<Vec<u32>> = requests(&su)
        .iter()
        .map(|r| {
            plain_decode(&mut target, &Backend::cpu(), r)
                .expect("plain")
                .tokens
        })
        .collect();
    let (chi, t) = check(&su, "plain", &samples, &ex);
    assert!(chi < t, "plain sampling: chi2 {chi:.1} >= threshold {t:.1}");
}

/// Mean accepted proposals per row-round of an engine's run.
fn mean_accepted<T: Target, P: Proposer>(engine: &Engine<T, P>) -> f64 {
    let s = engine.stats();
    s.accepted as f64 / s.row_rounds.max(1) as f64
}

/// The trained draft's proposals are really accepted (at least one per row-round on average,
/// so the accept, residual and bonus paths all carry mass) and the output distribution is
/// still the target's.
fn speculative_sampling_matches(backend: DraftBackend) {
    let fx = Fixture::write(backend).expect("fixture");
    let su = drafts_setup();
    let ex = exact(&su, &mut fx.target().expect("target"));
    let mut engine = draft_engine(&fx, K, 8, 64).expect("engine");
    let samples = engine_samples(&su, &mut engine);
    let (chi, t) = check(&su, &format!("{backend:?}"), &samples, &ex);
    assert!(chi < t, "{backend:?}: chi2 {chi:.1} >= threshold {t:.1}");
    let m = mean_accepted(&engine);
    assert!(
        m >= 1.0,
        "{backend:?}: mean accepted per row-round {m:.2} < 1"
    );
}

#[test]
fn dflash_speculative_sampling_matches_plain_sampling() {
    speculative_sampling_matches(DraftBackend::DFlash);
}

#[test]
fn dflash2_speculative_sampling_matches_plain_sampling() {
    speculative_sampling_matches(DraftBackend::DFlash2);
}

/// DFlash2 tree rounds (16 nodes, K = 4: side children below the chain, drawn without
/// replacement, tested by recursive rejection sampling) keep the target's distribution, and
/// really accept proposals (at least one per row-round on average; the gain over the chain is
/// `tree_of_32_nodes_accepts_at_least_the_chain`'s).
#[test]
fn tree_dflash2_speculative_sampling_matches_plain_sampling() {
    let fx = Fixture::write(DraftBackend::DFlash2).expect("fixture");
    let su = drafts_setup();
    let ex = exact(&su, &mut fx.target().expect("target"));
    let mut engine = tree_draft_engine(&fx, K, 8, Some(16), 64).expect("engine");
    let samples = engine_samples(&su, &mut engine);
    let (chi, t) = check(&su, "DFlash2 tree", &samples, &ex);
    assert!(chi < t, "DFlash2 tree: chi2 {chi:.1} >= threshold {t:.1}");
    let m = mean_accepted(&engine);
    assert!(
        m >= 1.0,
        "DFlash2 tree: mean accepted per row-round {m:.2} < 1"
    );
}

/// The trained DFlash2 draft reporting a uniform q instead of its retained q (its proposals
/// still drawn from the true q) must fail the same statistic by far.
#[test]
fn dflash2_draft_with_a_misreported_q_fails() {
    let fx = Fixture::write(DraftBackend::DFlash2).expect("fixture");
    let su = drafts_setup();
    let ex = exact(&su, &mut fx.target().expect("target"));
    let mut engine = misreporting_draft_engine(&fx, K, 8, 64).expect("engine");
    let samples = engine_samples(&su, &mut engine);
    let (chi, t) = check(&su, "misreported DFlash2", &samples, &ex);
    assert!(
        chi > 10.0 * t,
        "the misreported q must fail the statistic by far: chi2 {chi:.1}, threshold {t:.1}"
    );
}

/// A truthful 16-candidate proposer (which proposes the target's likely tokens, so many
/// proposals are accepted) passes; the same proposer misreporting q fails the same statistic.
#[test]
fn truthful_top16_passes_and_misreported_q_fails() {
    let fx = Fixture::write(DraftBackend::DFlash2).expect("fixture");
    let su = shadow_setup();
    let ex = exact(&su, &mut fx.target().expect("target"));
    let mut honest =
        shadow_engine(&fx, Strategy::Top16 { misreport: false }, 2, 8, 64, 3).expect("engine");
    let samples = engine_samples(&su, &mut honest);
    let accepted = honest.stats().accepted;
    let (chi, t) = check(&su, "truthful top16", &samples, &ex);
    assert!(chi < t, "truthful q: chi2 {chi:.1} >= threshold {t:.1}");
    assert!(
        accepted > N / 4,
        "the truthful proposer gets proposals accepted ({accepted})"
    );

    let mut wrong =
        shadow_engine(&fx, Strategy::Top16 { misreport: true }, 2, 8, 64, 3).expect("engine");
    let samples = engine_samples(&su, &mut wrong);
    let (chi, t) = check(&su, "misreported top16", &samples, &ex);
    assert!(
        chi > 10.0 * t,
        "the misreported q must fail the statistic by far: chi2 {chi:.1}, threshold {t:.1}"
    );
}
