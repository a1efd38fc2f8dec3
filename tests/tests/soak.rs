//! Soak: thousands of rounds with random joins, leaves, cancellations, forks, device
//! checkpoints and host replicas restored later. At the end nothing leaks (every target
//! sequence released, every context lane and page free) and nothing drifted: every request's
//! final output equals an independent replay (plain greedy decoding for greedy requests, the
//! same request decoded alone for sampled ones); cancelled and released requests published a
//! prefix of it. The coverage invariant is checked after every step. The draft is the trained
//! one, so the rounds commit several rows (every length up to W occurs) and most proposals
//! are accepted.

use std::collections::{HashMap, HashSet};

use dflash_cli::{Fixture, demo_prompts};
use dflash_config::Backend as DraftBackend;
use dflash_context::{ContextImage, HostContextImage};
use dflash_e2e::{assert_no_context_leak, check_coverage, draft_engine, run_checked};
use dflash_engine::{
    DraftProposer, Engine, EngineError, FinishReason, Request, RequestId, RequestImage,
    SamplingSettings, SeqHandle, Target, TargetError, plain_decode,
};
use dflash_ops::Backend;
use dflash_testkit::fixtures::SplitMix64;
use dflash_testkit::{ReferenceCheckpoint, ReferenceTarget};

const K: u32 = 3;
const B: u32 = 4;
const MAX_CONTEXT: usize = 64;

type Eng = Engine<ReferenceTarget, DraftProposer<'static>>;

/// Independent replays, each computed once: plain greedy decoding on a separate target, or
/// the request decoded alone (B = 1) by a separate engine.
struct Replays {
    target: ReferenceTarget,
    solo: Eng,
    cache: HashMap<(Vec<u32>, usize, u64, bool), Vec<u32>>,
}

impl Replays {
    fn new(fx: &Fixture) -> Self {
        Replays {
            target: fx.target().expect("target"),
            solo: draft_engine(fx, K, 1, MAX_CONTEXT).expect("replay engine"),
            cache: HashMap::new(),
        }
    }

    /// The independent replay of `r`.
    fn expected(&mut self, r: &Request) -> Vec<u32> {
        let greedy = r.sampling.temperature <= 0.0;
        let key = (r.prompt.clone(), r.max_new_tokens, r.seed, greedy);
        if let Some(v) = self.cache.get(&key) {
            return v.clone();
        }
        let v = if greedy {
            plain_decode(&mut self.target, &Backend::cpu(), r)
                .expect("plain decode")
                .tokens
        } else {
            let id = self.solo.submit(r.clone()).expect("submit");
            run_checked(&mut self.solo, 0)
                .outputs
                .remove(&id)
                .unwrap_or_default()
        };
        self.cache.insert(key, v.clone());
        v
    }
}

fn new_request(rng: &mut SplitMix64, n: u64) -> Request {
    // Short prompts: the reference target's prefill dominates the cost of an admission.
    let mut prompt = demo_prompts(1, n).remove(0);
    prompt.truncate(3 + rng.below(6) as usize);
    let budget = 4 + rng.below(24) as usize;
    if rng.below(5) == 0 {
        Request {
            sampling: SamplingSettings {
                top_k: 8,
                ..SamplingSettings::sampling(0.9)
            },
            seed: 10_000 + n,
            ..Request::greedy(prompt, budget)
        }
    } else {
        Request::greedy(prompt, budget)
    }
}

fn pick(rng: &mut SplitMix64, ids: &[RequestId]) -> Option<RequestId> {
    (!ids.is_empty()).then(|| ids[rng.below(ids.len() as u64) as usize])
}

fn soak(backend: DraftBackend, rounds: u64, seed: u64) {
    let fx = Fixture::write(backend).expect("fixture");
    let mut replays = Replays::new(&fx);
    let mut engine: Eng = draft_engine(&fx, K, B, MAX_CONTEXT).expect("engine");
    let mut rng = SplitMix64::new(seed);
    let mut origin: HashMap<RequestId, Request> = HashMap::new();
    let mut partial: Vec<(Request, Vec<u32>)> = Vec::new(); // released or cancelled
    let mut images: Vec<RequestImage<ReferenceCheckpoint, ContextImage>> = Vec::new();
    let mut host_images: Vec<RequestImage<ReferenceCheckpoint, HostContextImage>> = Vec::new();
    let mut seqs: HashSet<SeqHandle> = HashSet::new();
    let mut counts: HashMap<&'static str, u64> = HashMap::new();
    let mut n = 0u64;
    let mut done = 0u64;

    while engine.stats().rounds < rounds {
        let active = engine.active();
        let free = (B as usize).saturating_sub(active.len());
        let roll = rng.below(100);
        match roll {
            0..=29 if engine.queued() < 3 => {
                n += 1;
                let r = new_request(&mut rng, n);
                let id = engine.submit(r.clone()).expect("submit");
                origin.insert(id, r);
                *counts.entry("join").or_default() += 1;
            }
            30..=33 => {
                if let Some(id) = pick(&mut rng, &active) {
                    engine.cancel(id).expect("cancel");
                    *counts.entry("cancel").or_default() += 1;
                }
            }
            34..=37 => {
                if let Some(id) = pick(&mut rng, &active) {
                    let cont = engine.release(id).expect("release");
                    let r = origin.remove(&id).expect("origin");
                    partial.push((r, cont.output().to_vec()));
                    *counts.entry("leave").or_default() += 1;
                }
            }
            38..=42 if free > 0 => {
                if let Some(id) = pick(&mut rng, &active) {
                    let f = engine.fork(id, None).expect("fork");
                    origin.insert(f, origin[&id].clone());
                    *counts.entry("fork").or_default() += 1;
                }
            }
            43..=46 if images.len() < 4 => {
                if let Some(id) = pick(&mut rng, &active) {
                    images.push(engine.checkpoint(id).expect("checkpoint"));
                    *counts.entry("checkpoint").or_default() += 1;
                }
            }
            47..=49 if host_images.len() < 4 => {
                if let Some(id) = pick(&mut rng, &active) {
                    host_images.push(engine.host_replica(id).expect("host replica"));
                    *counts.entry("host replica").or_default() += 1;
                }
            }
            50..=53 if free > 0 && !images.is_empty() => {
                let img = images.swap_remove(rng.below(images.len() as u64) as usize);
                let id = engine.restore(&img).expect("restore");
                origin.insert(id, img.continuation.request.clone());
                *counts.entry("restore").or_default() += 1;
            }
            54..=56 if free > 0 && !host_images.is_empty() => {
                let img = host_images.swap_remove(rng.below(host_images.len() as u64) as usize);
                let id = engine.restore_host(&img).expect("restore host");
                origin.insert(id, img.continuation.request.clone());
                *counts.entry("restore host").or_default() += 1;
            }
            _ => {}
        }
        if engine.is_idle() {
            n += 1;
            let r = new_request(&mut rng, n);
            let id = engine.submit(r.clone()).expect("submit");
            origin.insert(id, r);
        }
        engine.step(&mut |_| {}).expect("step");
        for id in engine.active() {
            seqs.insert(engine.sequence(id).expect("seq"));
        }
        check_coverage(&mut engine);
        // Check finished requests against their replays as they finish.
        let ids: Vec<RequestId> = origin.keys().copied().collect();
        for id in ids {
            if let Some(f) = engine.take_finished(id) {
                let r = origin.remove(&id).expect("origin");
                let want = replays.expected(&r);
                match f.reason {
                    FinishReason::Cancelled => partial.push((r, f.output)),
                    _ => assert_eq!(f.output, want, "{id} drifted ({:?})", f.reason),
                }
                done += 1;
            }
        }
    }
    // Drain: everything active or queued runs to its end.
    engine.run(&mut |_| {}).expect("drain");
    for (id, r) in origin.drain() {
        let f = engine.take_finished(id).expect("finished after drain");
        let want = replays.expected(&r);
        if f.reason != FinishReason::Cancelled {
            assert_eq!(f.output, want, "{id} drifted");
        } else {
            assert!(
                want.starts_with(&f.output),
                "{id}: cancelled output is a prefix"
            );
        }
        done += 1;
    }
    for (r, out) in &partial {
        let want = replays.expected(r);
        assert!(
            want.starts_with(out),
            "a released/cancelled output is a prefix of its replay"
        );
    }
    // Unused images: restoring them still works after everything else ended.
    for img in images.drain(..).take(B as usize) {
        let id = engine.restore(&img).expect("late restore");
        let want = replays.expected(&img.continuation.request);
        engine.run(&mut |_| {}).expect("run");
        assert_eq!(engine.take_finished(id).expect("finished").output, want);
    }

    // No leaks.
    assert_eq!(engine.held(), (0, 0));
    assert_no_context_leak(engine.proposer());
    for s in &seqs {
        assert!(
            matches!(
                engine.target().frontier(*s),
                Err(TargetError::UnknownSequence { .. })
            ),
            "target sequence {s} leaked"
        );
    }
    assert!(matches!(
        engine.continuation(RequestId(u64::MAX)),
        Err(EngineError::UnknownRequest { .. })
    ));
    for key in [
        "join",
        "cancel",
        "leave",
        "fork",
        "checkpoint",
        "host replica",
        "restore",
        "restore host",
    ] {
        assert!(
            counts.get(key).copied().unwrap_or(0) > 0,
            "no {key} happened: {counts:?}"
        );
    }
    assert!(done > 50, "only {done} requests finished");
    // The trained draft gets real acceptances: multi-row commits of every length up to W and
    // at least one accepted proposal per row-round on average.
    let st = engine.stats();
    assert!(
        st.commits.iter().skip(1).all(|&c| c > 0),
        "every commit length 1..=W occurs: {:?}",
        st.commits
    );
    let mean = st.accepted as f64 / st.row_rounds.max(1) as f64;
    assert!(
        mean >= 1.0,
        "{backend:?}: mean accepted per row-round {mean:.2} ({} of {} proposals)",
        st.accepted,
        st.proposed
    );
}

#[test]
fn dflash_soak_of_1200_rounds_leaks_nothing_and_does_not_drift() {
    soak(DraftBackend::DFlash, 1200, 0x50a1);
}

#[test]
fn dflash2_soak_of_800_rounds_leaks_nothing_and_does_not_drift() {
    soak(DraftBackend::DFlash2, 800, 0x50a2);
}
