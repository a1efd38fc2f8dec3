//! The tree readback of a DFlash2 round (`Workspace::read_lattice`) on the CPU backend: the
//! chain it reads is `Workspace::read`'s, its gathered edge scores equal the full host
//! codebooks' (`HostLattice`) bit for bit for every (column, predecessor) they serve, a
//! padded (graph-profile) staging reports only the live rows, and depth truncation keeps
//! the chain and whole levels. Synthetic weights and features from fixed seeds.

mod common;

use common::{Fixture, fixture, req};
use dflash_context::ContextStore;
use dflash_draft::synthetic::TinySpec;
use dflash_draft::tree::{
    DraftTree, EdgeScores, GatheredLattice, HostLattice, MAX_NODES, RowLattice, TreeOptions,
};
use dflash_draft::{DraftError, RowProposal, RowRequest, TOP_K, Workspace};

const K: usize = 4;

/// Three requests of different contexts, anchors, temperatures and seeds.
fn requests(f: &Fixture, store: &mut ContextStore) -> Vec<RowRequest> {
    let h: Vec<_> = [7, 12, 3]
        .iter()
        .enumerate()
        .map(|(i, &t)| f.admit(store, t, 40 + i as u64))
        .collect();
    vec![
        req(h[0], 5, K, 0.0, 11),
        req(h[1], 33, 2, 0.9, 12),
        req(h[2], 70, K, 1.7, 13),
    ]
}

/// Stage `rows` onto `physical` rows, run the block, read the proposals and the lattice.
fn round(
    f: &Fixture,
    store: &ContextStore,
    rows: &[RowRequest],
    physical: usize,
) -> (Vec<RowProposal>, Vec<RowLattice>) {
    let mut ws = Workspace::new(&f.model, store, &f.ws_spec(4, K)).expect("workspace");
    f.model
        .stage_padded(store, rows, physical, &mut ws)
        .expect("stage");
    f.model
        .run_block(store, &f.parts(), &mut ws)
        .expect("block");
    let mut scratch = ws.lattice_scratch().expect("scratch");
    assert_eq!(
        scratch.bytes(),
        dflash_draft::tree::LatticeScratch::bytes_for(4, K, f.spec.selector_rank as usize)
    );
    let lat = ws.read_lattice(&f.model, &mut scratch).expect("lattice");
    (ws.read().expect("read"), lat)
}

fn codebooks(f: &Fixture) -> (&[dflash_ops::bf16], &[dflash_ops::bf16]) {
    let sw = f
        .model
        .weights()
        .selector
        .as_ref()
        .expect("a DFlash2 selector");
    (
        sw.predecessor.host("test", "pred").expect("host"),
        sw.successor.host("test", "succ").expect("host"),
    )
}

fn host_lattice<'a>(
    f: &Fixture,
    row: &'a RowLattice,
    books: (&'a [dflash_ops::bf16], &'a [dflash_ops::bf16]),
) -> HostLattice<'a> {
    HostLattice::new(
        K,
        f.spec.selector_rank as usize,
        &row.g,
        &row.unary,
        &row.candidate_ids,
        books.0,
        books.1,
    )
    .expect("host lattice")
}

#[test]
fn tree_lattice_readback_is_the_chain_of_read() {
    let f = fixture(TinySpec::dflash2(), 21, "tree-lattice-chain");
    let mut store = f.store(4, 64);
    let rows = requests(&f, &mut store);
    let (props, lat) = round(&f, &store, &rows, rows.len());
    assert_eq!(lat.len(), rows.len());
    for ((p, l), r) in props.iter().zip(&lat).zip(&rows) {
        assert_eq!(l.anchor, r.anchor);
        assert_eq!(l.usable, r.usable);
        assert_eq!(l.proposals, p.tokens);
        assert_eq!(l.candidate_ids, p.candidate_ids);
        assert_eq!(l.unary, p.unary_scores);
        assert_eq!(l.q, p.q);
        for i in 0..K {
            let j = l.chosen[i] as usize;
            assert_eq!(l.candidate_ids[i * TOP_K + j], l.proposals[i], "column {i}");
        }
    }
}

#[test]
fn tree_gathered_lattice_equals_host_lattice_bit_for_bit() {
    let f = fixture(TinySpec::dflash2(), 22, "tree-lattice-bits");
    let mut store = f.store(4, 64);
    let rows = requests(&f, &mut store);
    let (_, lat) = round(&f, &store, &rows, rows.len());
    let books = codebooks(&f);
    let vocab = f.spec.vocab_rows;
    for row in &lat {
        let mut host = host_lattice(&f, row, books);
        let mut gathered = row.lattice().expect("gathered lattice");
        let preds: Vec<u32> = gathered.predecessors().collect();
        assert_eq!(preds.len(), 1 + (K - 1) * TOP_K);
        for column in 0..K {
            for &p in &preds {
                let (a, b) = (
                    gathered.row(column, p).expect("gathered"),
                    host.row(column, p).expect("host"),
                );
                assert_eq!(
                    a.map(f32::to_bits),
                    b.map(f32::to_bits),
                    "column {column}, predecessor {p}"
                );
            }
        }
        // A predecessor without a gathered row is refused, not scored from a wrong row.
        let missing = (0..vocab)
            .find(|id| !preds.contains(id))
            .expect("an id outside the lattice");
        assert!(matches!(
            gathered.row(1, missing),
            Err(DraftError::Invalid { ref what, .. }) if what == "lattice predecessor"
        ));
        assert!(gathered.row(K, row.anchor).is_err(), "column K is refused");
    }
}

#[test]
fn tree_gathered_and_host_lattices_build_the_same_trees() {
    let f = fixture(TinySpec::dflash2(), 23, "tree-lattice-trees");
    let mut store = f.store(4, 64);
    let rows = requests(&f, &mut store);
    let (_, lat) = round(&f, &store, &rows, rows.len());
    let books = codebooks(&f);
    for (row, r) in lat.iter().zip(&rows) {
        for nodes in [K + 1, 12, MAX_NODES] {
            let opts = TreeOptions {
                nodes,
                temperature: r.temperature,
                seed: r.seed,
                frontier: 9,
            };
            let a = row.build(&opts).expect("gathered tree");
            let b =
                dflash_draft::tree::build(&row.chain(), &mut host_lattice(&f, row, books), &opts)
                    .expect("host tree");
            assert_eq!(a, b, "nodes {nodes}");
            assert!(a.nodes() <= nodes);
            assert_eq!(
                a.tokens[1..=K]
                    .iter()
                    .map(|&t| t as i32)
                    .collect::<Vec<_>>(),
                row.proposals
            );
        }
    }
}

#[test]
fn tree_lattice_of_a_padded_staging_reports_only_the_live_rows() {
    let f = fixture(TinySpec::dflash2(), 24, "tree-lattice-padded");
    let mut store = f.store(4, 64);
    let rows = requests(&f, &mut store);
    let (_, live) = round(&f, &store, &rows[..2], 2);
    let (_, padded) = round(&f, &store, &rows[..2], 4);
    assert_eq!(padded.len(), 2);
    assert_eq!(padded, live);
}

#[test]
fn tree_lattice_is_refused_for_dflash_and_a_foreign_scratch() {
    let f = fixture(TinySpec::dflash(), 25, "tree-lattice-dflash");
    let mut store = f.store(1, 64);
    let h = f.admit(&mut store, 5, 1);
    let mut ws = Workspace::new(&f.model, &store, &f.ws_spec(1, K)).expect("workspace");
    f.model
        .propose(&store, &[req(h, 5, K, 0.0, 1)], &f.parts(), &mut ws)
        .expect("propose");
    assert!(ws.lattice_scratch().is_err());

    let f2 = fixture(TinySpec::dflash2(), 26, "tree-lattice-foreign");
    let mut store2 = f2.store(1, 64);
    let h2 = f2.admit(&mut store2, 5, 1);
    let mut ws2 = Workspace::new(&f2.model, &store2, &f2.ws_spec(1, K)).expect("workspace");
    let mut other = Workspace::new(&f2.model, &store2, &f2.ws_spec(1, K - 1))
        .expect("workspace")
        .lattice_scratch()
        .expect("scratch");
    f2.model
        .propose(&store2, &[req(h2, 5, K, 0.0, 1)], &f2.parts(), &mut ws2)
        .expect("propose");
    assert!(ws2.read_lattice(&f2.model, &mut other).is_err());
    assert!(ws2.read_lattice(&f.model, &mut other).is_err());
}

/// Parent of node i (`i >= 1`).
fn parent(t: &DraftTree, i: usize) -> usize {
    t.parents[i - 1] as usize
}

#[test]
fn tree_truncated_keeps_the_chain_prefix_and_whole_levels() {
    let f = fixture(TinySpec::dflash2(), 27, "tree-truncated");
    let mut store = f.store(4, 64);
    let rows = requests(&f, &mut store);
    let (_, lat) = round(&f, &store, &rows, rows.len());
    for (row, r) in lat.iter().zip(&rows) {
        let opts = TreeOptions {
            nodes: MAX_NODES,
            temperature: r.temperature,
            seed: r.seed,
            frontier: 3,
        };
        let full = row.build(&opts).expect("tree");
        assert_eq!(full.truncated(K), full);
        assert_eq!(full.truncated(K + 5), full);
        for p in 0..K {
            let t = full.truncated(p);
            let kept: Vec<usize> = (0..full.nodes())
                .filter(|&m| full.depth[m] as usize <= p)
                .collect();
            assert_eq!(t.nodes(), kept.len(), "P = {p}");
            assert!(t.depth.iter().all(|&d| d as usize <= p));
            // Nodes 0..=P are the chain's prefix.
            assert_eq!(t.tokens[..=p], full.tokens[..=p]);
            assert_eq!(t.depth[..=p], (0..=p as u32).collect::<Vec<_>>());
            for (new, &old) in kept.iter().enumerate() {
                assert_eq!(t.tokens[new], full.tokens[old]);
                assert_eq!(t.sibling[new], full.sibling[old]);
                assert_eq!(t.rank[new], full.rank[old]);
                assert_eq!(t.child_ids[new], full.child_ids[old]);
                assert_eq!(t.child_q[new], full.child_q[old]);
                if new > 0 {
                    assert!((parent(&t, new)) < new);
                    assert_eq!(kept[parent(&t, new)], parent(&full, old));
                }
                // Whole levels: a kept node above depth P keeps every child, in order.
                let children: Vec<usize> = t.children(new).map(|c| kept[c]).collect();
                if (t.depth[new] as usize) < p {
                    assert_eq!(children, full.children(old).collect::<Vec<_>>());
                } else {
                    assert!(children.is_empty());
                }
                // Ancestors: the node and its root path.
                let mut want = 1u32 << new;
                let mut m = new;
                while m > 0 {
                    m = parent(&t, m);
                    want |= 1 << m;
                }
                assert_eq!(t.ancestors[new], want);
            }
            let layout = t.accept_layout();
            assert_eq!(layout.tokens.len(), t.nodes() - 1);
        }
        let root = full.truncated(0);
        assert_eq!(root.tokens, vec![row.anchor]);
        assert!(root.parents.is_empty());
        assert_eq!(root.ancestors, vec![1]);
    }
}

#[test]
fn tree_gathered_lattice_checks_its_lengths() {
    let (g, unary, cand) = (
        vec![dflash_ops::bf16::ZERO; 2 * 3],
        vec![0f32; 2 * TOP_K],
        (0..2 * TOP_K as i32).collect::<Vec<_>>(),
    );
    let pred = vec![dflash_ops::bf16::ZERO; (1 + TOP_K) * 3];
    let succ = vec![dflash_ops::bf16::ZERO; 2 * TOP_K * 3];
    assert!(GatheredLattice::new(2, 3, 0, &g, &unary, &cand, &pred, &succ).is_ok());
    assert!(GatheredLattice::new(2, 3, 0, &g, &unary, &cand, &pred[3..], &succ).is_err());
    assert!(GatheredLattice::new(2, 3, 0, &g, &unary, &cand, &pred, &succ[3..]).is_err());
    assert!(GatheredLattice::new(2, 3, 0, &g[1..], &unary, &cand, &pred, &succ).is_err());
    let mut neg = cand.clone();
    neg[5] = -1;
    assert!(GatheredLattice::new(2, 3, 0, &g, &unary, &neg, &pred, &succ).is_err());
}

/// The CUDA readback (strided id copies, two device gathers, one batch of reads: one
/// synchronize) against the full host codebooks: every (column, predecessor) bit for bit,
/// for a padded staging (3 requests on 4 rows) with K = 4 and for K = 1 (no candidate
/// predecessors). Skipped without a device.
#[cfg(feature = "cuda")]
#[test]
fn tree_lattice_on_cuda_equals_the_host_codebooks() {
    use dflash_draft::synthetic::{self, Layout};
    use dflash_draft::{BindOptions, DraftModel};
    use dflash_ops::Backend;

    let cuda = match dflash_ops::cuda::CudaBackend::new(0) {
        Ok(c) => Backend::Cuda(c),
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            return;
        }
    };
    let f = fixture(TinySpec::dflash2(), 28, "tree-lattice-cuda");
    let dir = common::temp_dir("tree-lattice-cuda-model");
    let (cfg, target) = synthetic::tiny_pair(&f.spec);
    synthetic::write_checkpoint(&dir, &cfg, &target, f.seed, Layout::Single).expect("write");
    let model = DraftModel::load(&cuda, &dir, &target, &BindOptions::default()).expect("load");
    let _ = std::fs::remove_dir_all(&dir);
    let emb = cuda.upload(&f.host.embedding).expect("upload");
    let head = cuda.upload(&f.host.output_head).expect("upload");
    let parts = dflash_draft::TargetParts {
        embedding: &emb,
        head: dflash_draft::HeadParts::Full { output_head: &head },
        ..f.parts()
    };
    let mut store = ContextStore::new(
        cuda.clone(),
        model.context_geometry().expect("geometry"),
        dflash_context::Capacity::new(4, 64, 4),
    )
    .expect("store");
    let mut handles = Vec::new();
    for (i, t) in [7usize, 12, 3].into_iter().enumerate() {
        let h = store.admit(64).expect("admit");
        let feats = cuda.upload(&f.features(t, 40 + i as u64)).expect("upload");
        model.prefill(&mut store, h, feats).expect("prefill");
        handles.push(h);
    }
    let rows = [
        req(handles[0], 5, K, 0.0, 11),
        req(handles[1], 33, 2, 0.9, 12),
        req(handles[2], 70, K, 1.7, 13),
    ];
    let books = codebooks(&f);
    for k in [K, 1] {
        let mut ws = Workspace::new(&model, &store, &f.ws_spec(4, k)).expect("workspace");
        let rows: Vec<RowRequest> = rows
            .iter()
            .map(|r| RowRequest {
                usable: r.usable.min(k),
                ..*r
            })
            .collect();
        model
            .stage_padded(&store, &rows, 4, &mut ws)
            .expect("stage");
        model.run_block(&store, &parts, &mut ws).expect("block");
        let mut scratch = ws.lattice_scratch().expect("scratch");
        let syncs = cuda.synchronizations();
        let lat = ws.read_lattice(&model, &mut scratch).expect("lattice");
        // Every read fits the readback block here: the whole readback waits once.
        assert_eq!(
            cuda.synchronizations() - syncs,
            1,
            "K = {k}: one synchronize"
        );
        let props = ws.read().expect("read");
        assert_eq!(lat.len(), 3, "only the live rows");
        for ((row, p), r) in lat.iter().zip(&props).zip(&rows) {
            assert_eq!(row.anchor, r.anchor);
            assert_eq!(row.proposals, p.tokens);
            assert_eq!(row.q, p.q);
            let mut host = HostLattice::new(
                k,
                f.spec.selector_rank as usize,
                &row.g,
                &row.unary,
                &row.candidate_ids,
                books.0,
                books.1,
            )
            .expect("host lattice");
            let mut gathered = row.lattice().expect("gathered");
            let preds: Vec<u32> = gathered.predecessors().collect();
            for column in 0..k {
                for &pr in &preds {
                    assert_eq!(
                        gathered
                            .row(column, pr)
                            .expect("gathered")
                            .map(f32::to_bits),
                        host.row(column, pr).expect("host").map(f32::to_bits),
                        "K = {k}, column {column}, predecessor {pr}"
                    );
                }
            }
            let most = if k == 1 { 1 + TOP_K } else { MAX_NODES };
            let t = row
                .build(&TreeOptions {
                    nodes: most,
                    temperature: r.temperature,
                    seed: r.seed,
                    frontier: 7,
                })
                .expect("tree")
                .truncated(r.usable);
            assert!(t.depth.iter().all(|&d| d as usize <= r.usable));
        }
    }
}
