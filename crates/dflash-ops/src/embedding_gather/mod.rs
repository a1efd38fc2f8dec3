//! Embedding gather: `out[r, :] = table[ids[r], :]` (embeds the draft block
//! `[anchor, MASK x K]` with the target's token embedding table).
//!
//! Semantics. For each r < n: `out[r, h] = table[ids[r], h]` for every h < hidden, an exact
//!   copy of the stored BF16 bits (NaN payloads included).
//! Shapes. ids: `[n]` i32 (a device buffer: ids change every round); table:
//!   `[vocab, hidden]` bf16 row-major (Qwen3.5: `[248320, H]`,
//!   `model.language_model.embed_tokens.weight`); out: `[n, hidden]` bf16.
//! Dtypes. I32 ids, BF16 table and output.
//! Rounding points. None (a copy).
//! Caller guarantees. `0 <= ids[r] < vocab`. The CPU refuses any other id with
//!   [`OpsError::Value`] naming the first offending index, before
//!   writing anything. The CUDA path never reads ids on the host (CUDA-graph safety): a
//!   device id out of range makes the kernel write a row of +0.0 for that r and never read
//!   outside the table.
//! Writes. Every element of `out`; nothing else.
//! Comparison. out: exact (bit-identical).

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod reference;
#[cfg(test)]
mod tests;

#[cfg(any(test, feature = "conformance"))]
use crate::Element;
#[cfg(any(test, feature = "conformance"))]
use crate::registry::{Case, CaseRun, Criterion, InputCheck, output};
use crate::{Backend, Buffer, OpsError, Result, bf16, check_len, check_param};

/// Registry id.
pub const OP: &str = "embedding_gather";

/// Shape of an embedding gather (`n` is `ids.len()`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EmbeddingGatherParams {
    /// Rows of the table (248320 for Qwen3.5 targets).
    pub vocab: usize,
    /// Row width H (2048 for 35B-A3B, 5120 for 27B).
    pub hidden: usize,
}

/// Gather `ids.len()` rows of `table` into `out` (see the module contract).
pub fn run(
    be: &Backend,
    ids: &Buffer<i32>,
    table: &Buffer<bf16>,
    out: &mut Buffer<bf16>,
    p: &EmbeddingGatherParams,
) -> Result<()> {
    let n = ids.len();
    let (vocab, hidden) = (p.vocab, p.hidden);
    check_param(OP, "vocab", vocab <= i32::MAX as usize, vocab, || {
        format!("at most {} (ids are i32)", i32::MAX)
    })?;
    let table_len = vocab.checked_mul(hidden).ok_or_else(|| OpsError::Param {
        op: OP,
        param: "vocab * hidden",
        expected: "a product that fits in usize".into(),
        found: format!("{vocab} * {hidden}"),
    })?;
    let out_len = n.checked_mul(hidden).ok_or_else(|| OpsError::Param {
        op: OP,
        param: "n * hidden",
        expected: "a product that fits in usize".into(),
        found: format!("{n} * {hidden}"),
    })?;
    check_len(OP, "table", table.len(), table_len, || {
        format!("[vocab={vocab}, hidden={hidden}]")
    })?;
    check_len(OP, "out", out.len(), out_len, || {
        format!("[n={n}, hidden={hidden}]")
    })?;
    match be {
        Backend::Cpu => reference::run(
            ids.host(OP, "ids")?,
            table.host(OP, "table")?,
            out.host_mut(OP, "out")?,
            vocab,
            hidden,
        ),
        #[cfg(feature = "cuda")]
        Backend::Cuda(c) => cuda::run(c, ids, table, out, n, vocab, hidden),
    }
}

/// A cheap deterministic table value (distinct rows, finite, both signs): element `i`.
#[cfg(any(test, feature = "conformance"))]
fn table_value(seed: u64, i: u64) -> bf16 {
    let mut z = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed;
    z = (z ^ (z >> 31)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z ^= z >> 29;
    // 16 random bits: sign, an exponent in 2^-8..2^7, 7 mantissa bits.
    let sign = (z & 0x8000) as u16;
    let exp = 119 + ((z >> 7) % 16) as u16;
    bf16::from_bits(sign | (exp << 7) | (z & 0x7f) as u16)
}

#[cfg(any(test, feature = "conformance"))]
fn case(
    vocab: usize,
    hidden: usize,
    ids: Vec<i32>,
) -> impl Fn(&Backend) -> Result<CaseRun> + Send + Sync {
    move |be: &Backend| {
        let n = ids.len();
        let table: Vec<bf16> = (0..(vocab * hidden) as u64)
            .map(|i| table_value(0x7ab1e, i))
            .collect();
        let mut inputs = InputCheck::default();
        let idb = inputs.upload(be, "ids", &ids)?;
        let tb = inputs.upload(be, "table", &table)?;
        drop(table);
        let mut out = be.filled(n * hidden, bf16::POISON)?;
        run(
            be,
            &idb,
            &tb,
            &mut out,
            &EmbeddingGatherParams { vocab, hidden },
        )?;
        let mut modified = Vec::new();
        inputs.verify(be, "ids", &idb, &mut modified)?;
        inputs.verify(be, "table", &tb, &mut modified)?;
        Ok(CaseRun {
            outputs: vec![output(
                "out",
                Criterion::Exact,
                &vec![bf16::POISON; n * hidden],
                &be.download(&out)?,
                |_| true,
            )],
            modified_inputs: modified,
        })
    }
}

/// A draft block `[anchor, MASK x k]` for each of `rows` requests (anchors spread over the
/// vocabulary, including its first and last rows).
#[cfg(any(test, feature = "conformance"))]
fn block_ids(rows: usize, k: usize, vocab: usize, mask: i32) -> Vec<i32> {
    let mut ids = Vec::with_capacity(rows * (k + 1));
    for r in 0..rows {
        let anchor = match r {
            0 => 0,
            1 => vocab - 1,
            _ => (r * 7919 * 31 + 17) % vocab,
        };
        ids.push(anchor as i32);
        ids.extend(std::iter::repeat_n(mask, k));
    }
    ids
}

/// Conformance cases: the block shapes n = 16 (one request, K = 15) and n = 128 (8 requests)
/// with the official H = 2048 against a 4096-row table (light), the official 35B-A3B table
/// (vocab 248320, H 2048, mask id 248070; the 1 GiB table makes it heavy) with n = 128, a
/// 27B-width row, and a width that is not a multiple of 8 (the kernel's scalar path).
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn cases() -> Vec<Case> {
    const V: usize = 248_320;
    const MASK: i32 = 248_070;
    let mut scattered: Vec<i32> = (0..128)
        .map(|i: usize| ((i * 104_729 + 3) % 4096) as i32)
        .collect();
    scattered[5] = 4095;
    scattered[6] = 4095;
    vec![
        Case::new(
            OP,
            "v4096_h2048_n16",
            case(4096, 2048, block_ids(1, 15, 4096, 4000)),
        ),
        Case::new(
            OP,
            "v4096_h2048_n128_scattered",
            case(4096, 2048, scattered),
        ),
        Case::new(OP, "v512_h5120_n2", case(512, 5120, vec![511, 0])),
        Case::new(
            OP,
            "v1000_h37_n9",
            case(1000, 37, block_ids(3, 2, 1000, 999)),
        ),
        Case::new(
            OP,
            "official_v248320_h2048_n128",
            case(V, 2048, block_ids(8, 15, V, MASK)),
        )
        .heavy(),
    ]
}
