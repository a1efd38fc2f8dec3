//! Tree verification (DFlash2 with `--draft-tree-nodes`): the target verified a tree of
//! proposals per row; [`VerifyWorkspace::verify_tree`] processes every node's target
//! distribution (`target_distribution`, the history of a node being the tokens of its root
//! path) and walks the tree with recursive rejection sampling (`tree_accept`), returning each
//! row's accepted path and licensed outputs ([`TreeOutcome`]).
//!
//! A row's tree has `N` nodes (verify columns): node 0 the anchor, node `i >= 1` the token
//! `tokens[i-1]` continuing `parents[i-1] < i`, at position `F + depth(i)`; node `n`'s
//! children were drawn from `child_q[n]` (16 global ids and their q) in increasing index
//! order, as the DFlash2 tree builder (`dflash_draft::tree`) does. The workspace must be
//! sized with `cols >= N` columns (a tree engine sizes it with the node budget) and
//! [`ProposalKind::Top16`]. A chain (`parents[i-1] = i - 1`) verifies exactly as
//! [`VerifyWorkspace::verify`] with the same inputs.
//!
//! Random draws: `tree_accept`'s (the acceptance test of a node's `k`-th child uses
//! `(seed, F + 1 + depth, Accept, k)`, corrections and bonuses those of the chain at the
//! final node's depth): a row's outcome is a function of that row alone.

use dflash_ops::tree_accept;

use crate::{
    Meta, ProposalKind, QFault, Result, RetainedQ, SamplingSettings, TOP, TargetLogits,
    TokenHistory, TokenRole, VerifyError, VerifyWorkspace, validate_q_distribution,
};

/// One row of a tree verification.
#[derive(Clone, Copy, Debug)]
pub struct TreeRow<'a> {
    /// The anchor `a = x_F` (the last token of `history`), node 0.
    pub anchor: u32,
    /// Tokens of nodes `1 .. N` (`N - 1` entries).
    pub tokens: &'a [u32],
    /// Parent of each node `1 .. N` (an earlier node), `N - 1` entries.
    pub parents: &'a [u32],
    /// The distribution node `n`'s children were drawn from, for `n = 0 .. N - 1` (`N - 1`
    /// entries; read only for nodes that have children).
    pub child_q: &'a [RetainedQ],
    /// The request's sampling settings.
    pub settings: SamplingSettings,
    /// The request seed.
    pub seed: u64,
    /// The frontier `F` (the anchor's position).
    pub frontier: u64,
    /// Tokens `x_0 ..= x_F`.
    pub history: &'a TokenHistory,
}

/// The outcome of one row's tree verification: the accepted root path `0 = v_0, v_1, .., v_A`
/// and the `L = A + 1` licensed outputs (the path's tokens, then the correction or bonus).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TreeOutcome {
    path: Vec<usize>,
    outputs: Vec<u32>,
    nodes: usize,
    leaf: bool,
}

impl TreeOutcome {
    /// `A`: accepted nodes (the final node's depth).
    pub fn accepted(&self) -> usize {
        self.path.len() - 1
    }

    /// The tree's node count `N` (the anchor included).
    pub fn nodes(&self) -> usize {
        self.nodes
    }

    /// The accepted root path of node indices (verify columns), `path()[0] == 0`.
    pub fn path(&self) -> &[usize] {
        &self.path
    }

    /// `y_1 .. y_L`.
    pub fn outputs(&self) -> &[u32] {
        &self.outputs
    }

    /// True when the walk ended at a leaf (the last output is the bonus), false when every
    /// child of its final node was rejected (the correction).
    pub fn ended_at_leaf(&self) -> bool {
        self.leaf
    }

    /// The verify column whose captured features continue the sequence after committing `j`
    /// outputs (`j` in `1..=L`): the path's node `j - 1`. `None` outside `1..=L`.
    pub fn continuation_column(&self, j: usize) -> Option<usize> {
        (1..=self.outputs.len())
            .contains(&j)
            .then(|| self.path[j - 1])
    }
}

impl VerifyWorkspace {
    /// Verify a batch of `rows.len() <= B` trees against the target's logits of their nodes
    /// (F32 or BF16, padded `[rows.len(), W, vocab_rows]` with `W` the workspace's columns, or
    /// packed: each row's `N` node columns after the previous row's) and return each row's
    /// outcome, in row order.
    ///
    /// Validates everything first (the checks of [`Self::verify`] plus the tree's: `N <=
    /// W`, parents earlier nodes, every child's token among its parent's 16 ids, siblings
    /// distinct, each parent's q a distribution); a refused call writes nothing. Needs a
    /// [`ProposalKind::Top16`] workspace.
    pub fn verify_tree(
        &mut self,
        be: &dflash_ops::Backend,
        rows: &[TreeRow<'_>],
        logits: TargetLogits<'_>,
    ) -> Result<Vec<TreeOutcome>> {
        if self.shape.kind != ProposalKind::Top16 {
            return Err(VerifyError::ProposalKind {
                row: 0,
                expected: ProposalKind::Top16.name(),
                found: self.shape.kind.name(),
            });
        }
        let metas: Vec<Meta<'_>> = rows.iter().map(Meta::of_tree).collect();
        self.validate(be, &metas, &logits)?;
        for (r, row) in rows.iter().enumerate() {
            self.validate_tree(r, row)?;
        }
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        self.stage(be, &metas, logits.layout)?;
        self.stage_tree(be, rows)?;
        let n = rows.len();
        let crate::VerifyShape {
            cols,
            vocab_rows,
            public_vocab,
            ..
        } = self.shape;
        self.distributions(be, n, logits.values, true)?;
        tree_accept::run(
            be,
            tree_accept::Distributions::Live {
                p: &self.p,
                greedy: &self.greedy,
            },
            &tree_accept::Trees {
                nodes: &self.live,
                tokens: &self.proposals,
                parents: &self.parents,
                q: &self.q,
                ids: &self.ids,
            },
            &self.seeds,
            &self.start_pos,
            tree_accept::Outputs {
                accepted: &mut self.accepted,
                out_tokens: &mut self.out_tokens,
                out_len: &mut self.out_len,
                path: &mut self.path,
            },
            &tree_accept::Params {
                rows: n,
                cols,
                vocab: vocab_rows,
            },
        )?;
        let accepted = be.read_async(&self.accepted, 0, n)?;
        let out_len = be.read_async(&self.out_len, 0, n)?;
        let tokens = be.read_async(&self.out_tokens, 0, n * cols)?;
        let path = be.read_async(&self.path, 0, n * cols)?;
        let (accepted, out_len, tokens, path) = (
            accepted.wait()?,
            out_len.wait()?,
            tokens.wait()?,
            path.wait()?,
        );
        rows.iter()
            .enumerate()
            .map(|(r, row)| {
                let bad = |reason: String| VerifyError::DeviceOutcome { row: r, reason };
                let nodes = row.tokens.len() + 1;
                let a = usize::try_from(accepted[r])
                    .ok()
                    .filter(|&a| a < nodes)
                    .ok_or_else(|| bad(format!("accepted = {} with N = {nodes}", accepted[r])))?;
                if out_len[r] != a as i32 + 1 {
                    return Err(bad(format!("out_len = {} with A = {a}", out_len[r])));
                }
                let mut walk = Vec::with_capacity(a + 1);
                for j in 0..=a {
                    let v = path[r * cols + j];
                    let ok = match j {
                        0 => v == 0,
                        _ => {
                            v > 0
                                && (v as usize) < nodes
                                && row.parents[v as usize - 1] as usize == walk[j - 1]
                        }
                    };
                    if !ok {
                        return Err(bad(format!(
                            "path entry {j} = {v} does not follow the tree"
                        )));
                    }
                    walk.push(v as usize);
                }
                let ys = &tokens[r * cols..r * cols + a + 1];
                for j in 0..a {
                    let want = row.tokens[walk[j + 1] - 1];
                    if ys[j] != want as i32 {
                        return Err(bad(format!(
                            "output {} = {}, node token {want}",
                            j + 1,
                            ys[j]
                        )));
                    }
                }
                let last = ys[a];
                if !(last >= 0 && (last as usize) < public_vocab) {
                    return Err(bad(format!(
                        "correction/bonus {last} is not a public token (< {public_vocab})"
                    )));
                }
                let end = walk[a];
                let leaf = !row.parents.iter().any(|&p| p as usize == end);
                Ok(TreeOutcome {
                    path: walk,
                    outputs: ys.iter().map(|&y| y as u32).collect(),
                    nodes,
                    leaf,
                })
            })
            .collect()
    }

    /// Row `r`'s tree: sizes, tokens, parents, and each parent's q and children.
    fn validate_tree(&self, r: usize, row: &TreeRow<'_>) -> Result<()> {
        let np = row.tokens.len();
        let shape_err = |what: String| VerifyError::BadTree {
            row: r,
            reason: what,
        };
        if row.parents.len() != np {
            return Err(shape_err(format!(
                "{} parents for {} nodes (expected {np})",
                row.parents.len(),
                np + 1
            )));
        }
        if row.child_q.len() < np {
            return Err(shape_err(format!(
                "{} child distributions for {} nodes (expected at least {np})",
                row.child_q.len(),
                np + 1
            )));
        }
        for (j, &d) in row.tokens.iter().enumerate() {
            self.check_token(r, TokenRole::Proposal(j + 1), d)?;
        }
        for (i, &p) in row.parents.iter().enumerate() {
            if p as usize > i {
                return Err(shape_err(format!(
                    "node {} has parent {p}, which is not an earlier node",
                    i + 1
                )));
            }
        }
        for n in 0..np {
            let kids: Vec<usize> = (n + 1..=np)
                .filter(|&i| row.parents[i - 1] as usize == n)
                .collect();
            if kids.is_empty() {
                continue;
            }
            let rq = &row.child_q[n];
            for (s, &id) in rq.ids.iter().enumerate() {
                self.check_token(r, TokenRole::Candidate { column: n, slot: s }, id)?;
            }
            validate_q_distribution(rq).map_err(|fault| VerifyError::QNotDistribution {
                row: r,
                column: n,
                fault,
            })?;
            for (k, &i) in kids.iter().enumerate() {
                let t = row.tokens[i - 1];
                if !rq.ids.contains(&t) {
                    return Err(VerifyError::QNotDistribution {
                        row: r,
                        column: n,
                        fault: QFault::ProposalNotCandidate { token: t },
                    });
                }
                if kids[..k].iter().any(|&e| row.tokens[e - 1] == t) {
                    return Err(shape_err(format!(
                        "node {i} repeats the token {t} of an earlier sibling (parent {n})"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Write the trees' tokens, parents and child distributions (zeros past each row's `N`).
    fn stage_tree(&mut self, be: &dflash_ops::Backend, rows: &[TreeRow<'_>]) -> Result<()> {
        let k = self.shape.cols - 1;
        let s = &mut self.staging;
        s.proposals.clear();
        s.parents.clear();
        s.q.clear();
        s.ids.clear();
        for row in rows {
            for j in 0..k {
                s.proposals.push(row.tokens.get(j).map_or(0, |&d| d as i32));
                s.parents.push(row.parents.get(j).map_or(0, |&p| p as i32));
                match row.child_q.get(j) {
                    Some(rq) => {
                        s.q.extend_from_slice(&rq.q);
                        s.ids.extend(rq.ids.iter().map(|&id| id as i32));
                    }
                    None => {
                        s.q.extend_from_slice(&[0.0; TOP]);
                        s.ids.extend_from_slice(&[0; TOP]);
                    }
                }
            }
        }
        be.write(&mut self.proposals, 0, &s.proposals)?;
        be.write(&mut self.parents, 0, &s.parents)?;
        be.write(&mut self.q, 0, &s.q)?;
        be.write(&mut self.ids, 0, &s.ids)?;
        Ok(())
    }
}

impl<'a> Meta<'a> {
    fn of_tree(r: &TreeRow<'a>) -> Self {
        Meta {
            anchor: r.anchor,
            np: r.tokens.len(),
            settings: r.settings,
            seed: r.seed,
            frontier: r.frontier,
            history: r.history,
        }
    }
}
