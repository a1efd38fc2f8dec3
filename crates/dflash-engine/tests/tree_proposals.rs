//! `DraftProposer::propose_tree` on the CPU backend over a tiny synthetic DFlash2 draft
//! (weights, target parts and features from fixed seeds): a tree of K + 1 nodes is exactly
//! `propose`'s chain (tokens, candidate ids and q), larger trees keep that chain as nodes
//! `0..=P` with parents before children, no node is deeper than the row's P, greedy and
//! sampled rows, independence from batch neighbours, and the refusals (a DFlash draft, a
//! node budget outside `K + 1 ..= 32`).

use dflash_config::{DraftConfig, ParseMode, StartupOptions};
use dflash_context::ContextHandle;
use dflash_draft::synthetic::{self, TinySpec};
use dflash_draft::tree::{DraftTree, LatticeScratch, MAX_NODES};
use dflash_draft::{BindOptions, DraftModel, TOP_K};
use dflash_engine::{
    DraftHead, DraftProposer, DraftTargetParts, EngineError, EngineOptions, Proposal, ProposeRow,
    Proposer,
};
use dflash_ops::{Backend, Held};

const K: usize = 4;
const SEED: u64 = 0x7ee5;

/// A CPU proposer of the tiny `spec` draft (K = 4, B = 4) with `tree_nodes`.
fn proposer(spec: &TinySpec, tree_nodes: Option<u32>) -> DraftProposer<'static> {
    proposer_on(&Backend::cpu(), spec, tree_nodes)
}

/// [`proposer`] on `be` (on CUDA: with its graph profiles).
fn proposer_on(be: &Backend, spec: &TinySpec, tree_nodes: Option<u32>) -> DraftProposer<'static> {
    let be = be.clone();
    let (cfg, target) = synthetic::tiny_pair(spec);
    let draft = DraftConfig::from_json_str(&cfg, ParseMode::Lenient).expect("draft config");
    let g = dflash_config::validate_pair(&draft.value, &target).expect("geometry");
    let weights = synthetic::weights(&be, &g, SEED, &BindOptions::default()).expect("weights");
    let model = DraftModel::from_parts(&be, g, weights);
    let host = synthetic::target_parts(spec.vocab_rows as usize, spec.hidden as usize, SEED + 1);
    let parts = DraftTargetParts {
        vocab_rows: spec.vocab_rows as usize,
        public_vocab: spec.public_vocab as usize,
        embedding: Held::Owned(be.upload(&host.embedding).expect("upload")),
        head: DraftHead::Full {
            output_head: Held::Owned(be.upload(&host.output_head).expect("upload")),
        },
    };
    let options = EngineOptions {
        page_size: 8,
        ..EngineOptions::new(
            StartupOptions {
                concurrency: 4,
                tree_nodes,
                ..StartupOptions::new(spec.backend, K as u32)
            },
            64,
        )
    };
    DraftProposer::new(model, parts, &options).expect("proposer")
}

/// A request: a slot whose context holds `prompt` synthetic feature rows of `seed`.
struct Req {
    slot: ContextHandle,
    frontier: usize,
    anchor: u32,
    history: Vec<u32>,
}

fn admit(p: &mut DraftProposer<'_>, prompt: usize, anchor: u32, seed: u64) -> Req {
    let slot = p.admit(64).expect("admit");
    let width = p.model().geometry().feature_width as usize;
    let feats = p
        .backend()
        .upload(&synthetic::features(prompt, width, seed))
        .expect("upload");
    p.push_prefill(slot, 0, feats).expect("prefill");
    p.materialize(slot).expect("materialize");
    let mut history: Vec<u32> = (0..prompt as u32).map(|t| t % 60).collect();
    history.push(anchor);
    Req {
        slot,
        frontier: prompt,
        anchor,
        history,
    }
}

/// Three requests: prompts of 9, 4 and 13 positions.
fn requests(p: &mut DraftProposer<'_>) -> Vec<Req> {
    vec![admit(p, 9, 5, 1), admit(p, 4, 41, 2), admit(p, 13, 70, 3)]
}

/// Rows of `reqs` with per-row (usable, temperature, seed).
fn rows<'a>(reqs: &'a [Req], per_row: &[(usize, f32, u64)]) -> Vec<ProposeRow<'a, ContextHandle>> {
    reqs.iter()
        .zip(per_row)
        .map(|(r, &(usable, temperature, seed))| ProposeRow {
            slot: r.slot,
            anchor: r.anchor,
            frontier: r.frontier,
            usable,
            temperature,
            seed,
            history: &r.history,
        })
        .collect()
}

/// The shared settings of the tests: one greedy, two sampled rows (seeds fixed).
const FULL: [(usize, f32, u64); 3] = [(K, 0.0, 11), (K, 0.8, 12), (K, 1.5, 13)];

/// Nodes `0..=P` are the anchor and the chain's first P proposals with its ids and q.
fn assert_chain_prefix(t: &DraftTree, anchor: u32, chain: &Proposal, p: usize, what: &str) {
    assert_eq!(t.tokens[0], anchor, "{what}: node 0 is the anchor");
    assert_eq!(
        t.tokens[1..=p],
        chain.tokens[..p],
        "{what}: the chain's tokens"
    );
    let q = chain.q.as_ref().expect("DFlash2 proposals carry q");
    for (i, qi) in q.iter().enumerate().take(p) {
        assert_eq!(t.parents[i], i as u32, "{what}: spine node {}", i + 1);
        assert_eq!(t.depth[i + 1], i as u32 + 1);
        let ids: Vec<u32> = t.child_ids[i].iter().map(|&x| x as u32).collect();
        assert_eq!(ids, qi.ids, "{what}: node {i}'s candidates");
        assert_eq!(
            t.child_q[i].map(f32::to_bits),
            qi.q.map(f32::to_bits),
            "{what}: node {i}'s q is the chain's, bit for bit"
        );
    }
}

/// Structure every tree must have: parents before children, depths from parents, at most
/// `nodes` nodes, none deeper than P, public tokens, ancestors of the root path.
fn assert_well_formed(t: &DraftTree, nodes: usize, p: usize, public: u32, what: &str) {
    let n = t.nodes();
    assert!((p + 1..=nodes).contains(&n), "{what}: {n} nodes");
    assert_eq!(t.parents.len(), n - 1);
    for i in 1..n {
        let par = t.parents[i - 1] as usize;
        assert!(par < i, "{what}: node {i}'s parent {par}");
        assert_eq!(t.depth[i], t.depth[par] + 1, "{what}: node {i}'s depth");
        assert_eq!(t.ancestors[i], t.ancestors[par] | 1 << i);
    }
    assert!(
        t.depth.iter().all(|&d| d as usize <= p),
        "{what}: depth {:?} with P = {p}",
        t.depth
    );
    assert!(t.tokens.iter().all(|&x| x < public), "{what}: public ids");
}

#[test]
fn tree_of_k_plus_one_nodes_is_the_chain_of_propose() {
    let mut p = proposer(&TinySpec::dflash2(), Some(MAX_NODES as u32));
    let reqs = requests(&mut p);
    let rs = rows(&reqs, &FULL);
    let chains = p.propose(&rs).expect("propose");
    let trees = p.propose_tree(&rs, K + 1).expect("trees");
    assert_eq!(trees.len(), rs.len());
    for (i, (t, c)) in trees.iter().zip(&chains).enumerate() {
        let what = format!("row {i}");
        assert_eq!(t.nodes(), K + 1, "{what}");
        assert_chain_prefix(t, reqs[i].anchor, c, K, &what);
        assert_eq!(
            t.child_q[K], [0.0; TOP_K],
            "{what}: depth K has no children"
        );
        assert_well_formed(t, K + 1, K, 72, &what);
    }
}

#[test]
fn tree_of_16_and_32_nodes_keeps_the_chain_as_nodes_0_to_p() {
    let mut p = proposer(&TinySpec::dflash2(), Some(MAX_NODES as u32));
    let reqs = requests(&mut p);
    let rs = rows(&reqs, &FULL);
    let chains = p.propose(&rs).expect("propose");
    for nodes in [16, MAX_NODES] {
        let trees = p.propose_tree(&rs, nodes).expect("trees");
        for (i, (t, c)) in trees.iter().zip(&chains).enumerate() {
            let what = format!("N = {nodes}, row {i}");
            assert_chain_prefix(t, reqs[i].anchor, c, K, &what);
            assert_well_formed(t, nodes, K, 72, &what);
            assert!(t.nodes() > K + 1, "{what}: side nodes");
        }
        // The greedy row drops nothing: exactly N nodes.
        assert_eq!(trees[0].nodes(), nodes);
    }
}

#[test]
fn tree_has_no_node_deeper_than_a_rows_usable_p() {
    let mut p = proposer(&TinySpec::dflash2(), None);
    let reqs = requests(&mut p);
    for (temperature, seed) in [(0.0, 21), (0.0, 22), (1.1, 23)] {
        let per_row = [
            (0, temperature, seed),
            (1, temperature, seed),
            (K - 1, temperature, seed),
        ];
        let rs = rows(&reqs, &per_row);
        let chains = p.propose(&rs).expect("propose");
        let trees = p.propose_tree(&rs, MAX_NODES).expect("trees");
        // The same rows with every proposal usable: the truncated trees are their prefixes.
        let full_rows: Vec<_> = rs.iter().map(|r| ProposeRow { usable: K, ..*r }).collect();
        let full = p.propose_tree(&full_rows, MAX_NODES).expect("full trees");
        for (i, ((t, c), &(u, ..))) in trees.iter().zip(&chains).zip(&per_row).enumerate() {
            let what = format!("T = {temperature}, row {i}, P = {u}");
            assert_well_formed(t, MAX_NODES, u, 72, &what);
            assert_chain_prefix(t, reqs[i].anchor, c, u, &what);
            assert_eq!(*t, full[i].truncated(u), "{what}");
        }
    }
}

#[test]
fn tree_rows_do_not_depend_on_their_batch_neighbours() {
    let mut p = proposer(&TinySpec::dflash2(), None);
    let reqs = requests(&mut p);
    let rs = rows(&reqs, &FULL);
    let batch = p.propose_tree(&rs, 20).expect("batch");
    for (i, r) in rs.iter().enumerate() {
        let alone = p.propose_tree(std::slice::from_ref(r), 20).expect("alone");
        assert_eq!(alone[0], batch[i], "row {i}");
    }
    // Reordered rows give the same trees, reordered.
    let rev: Vec<_> = rs.iter().rev().copied().collect();
    let reversed = p.propose_tree(&rev, 20).expect("reversed");
    assert!(reversed.iter().rev().eq(batch.iter()));
}

#[test]
fn tree_sampled_rows_follow_their_seed() {
    let mut p = proposer(&TinySpec::dflash2(), None);
    let reqs = requests(&mut p);
    let at = |p: &mut DraftProposer<'_>, seed: u64| {
        let rs = rows(&reqs[..1], &[(K, 1.5, seed)]);
        p.propose_tree(&rs, MAX_NODES).expect("tree").remove(0)
    };
    let a = at(&mut p, 5);
    assert_eq!(a, at(&mut p, 5), "one seed, one tree");
    // Different seeds give different draws somewhere (fixed seeds 5..10, T = 1.5 over the
    // synthetic draft's soft lattice: a fixed, not a statistical, outcome).
    assert!((6..10).any(|s| at(&mut p, s).tokens != a.tokens));
}

#[test]
fn tree_proposals_are_refused_for_dflash_and_bad_budgets() {
    let mut d = proposer(&TinySpec::dflash(), None);
    let reqs = requests(&mut d);
    let rs = rows(&reqs, &FULL);
    let e = d
        .propose_tree(&rs, K + 1)
        .expect_err("DFlash drafts chains only");
    assert!(
        matches!(&e, EngineError::Proposer { reason } if reason.contains("DFlash2")),
        "{e}"
    );

    let mut p = proposer(&TinySpec::dflash2(), None);
    let reqs = requests(&mut p);
    let rs = rows(&reqs, &FULL);
    for nodes in [0, K, MAX_NODES + 1] {
        let e = p
            .propose_tree(&rs, nodes)
            .expect_err("budget outside K + 1 ..= 32");
        assert!(
            matches!(&e, EngineError::Proposer { reason } if reason.contains("nodes")),
            "{e}"
        );
    }
    // The refusals ran nothing: the next round works.
    assert_eq!(p.propose_tree(&rs, K + 1).expect("trees").len(), 3);
}

#[test]
fn tree_lattice_scratch_is_planned_when_tree_nodes_are_set() {
    let spec = TinySpec::dflash2();
    let with = proposer(&spec, Some(12)).memory_plan();
    let bytes = LatticeScratch::bytes_for(4, K, spec.selector_rank as usize);
    assert_eq!(with.bytes("tree lattice scratch"), bytes);
    assert!(bytes > 0);
    let without = proposer(&spec, None).memory_plan();
    assert_eq!(without.bytes("tree lattice scratch"), 0);
    assert_eq!(with.total(), without.total() + bytes);
}

/// On CUDA the block replays a graph profile: 3 requests stage 4 padded rows, and the trees
/// report the 3 live rows, their chains exactly `propose`'s. Skipped without a device.
#[cfg(feature = "cuda")]
#[test]
fn tree_proposals_on_cuda_replay_the_padded_graph_profile() {
    let be = match dflash_ops::cuda::CudaBackend::new(0) {
        Ok(c) => Backend::Cuda(c),
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            return;
        }
    };
    let mut p = proposer_on(&be, &TinySpec::dflash2(), Some(MAX_NODES as u32));
    assert!(p.eager_reason().is_none(), "{:?}", p.eager_reason());
    let reqs = requests(&mut p);
    let per_row = [(K, 0.0, 11), (2, 0.8, 12), (K, 1.5, 13)];
    let rs = rows(&reqs, &per_row);
    let syncs = be.synchronizations();
    let chains = p.propose(&rs).expect("propose");
    let chain_syncs = be.synchronizations() - syncs;
    let replays = p.graph_replays();
    let chain_trees = p.propose_tree(&rs, K + 1).expect("chain trees");
    let syncs = be.synchronizations();
    let trees = p.propose_tree(&rs, MAX_NODES).expect("trees");
    let tree_syncs = be.synchronizations() - syncs;
    eprintln!("synchronizations per round: propose {chain_syncs}, propose_tree {tree_syncs}");
    assert_eq!(
        tree_syncs, chain_syncs,
        "a tree round waits as often as a chain round"
    );
    assert_eq!(p.graph_replays(), replays + 2);
    assert_eq!(p.last_block_rows(), 4, "a padded bucket");
    assert_eq!(trees.len(), 3);
    for (i, ((t, c), &(u, ..))) in trees.iter().zip(&chains).zip(&per_row).enumerate() {
        let what = format!("row {i}");
        assert_chain_prefix(&chain_trees[i], reqs[i].anchor, c, u, &what);
        assert_eq!(chain_trees[i].nodes(), u + 1);
        assert_chain_prefix(t, reqs[i].anchor, c, u, &what);
        assert_well_formed(t, MAX_NODES, u, 72, &what);
    }
}
