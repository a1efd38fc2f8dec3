//! Fuzz the draft, target and tokenizer parsers, and everything downstream of them.
//!
//! Run: `cargo +nightly fuzz run parse_config` from the repository root. The invariant is that
//! nothing panics, whatever the bytes; errors are expected. The first byte selects which
//! bundled official document the input is paired with, so the pair and startup checks are
//! reached with valid partners.

#![no_main]

use dflash_config::{
    Backend, DraftConfig, ParseMode, ProposalHead, StartupOptions, TargetTextConfig,
    count_tokenizer_vocab, examples, validate_pair,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };

    let _ = count_tokenizer_vocab(text);
    for mode in [ParseMode::Lenient, ParseMode::Strict] {
        let _ = DraftConfig::from_json_str(text, mode);
    }
    let _ = TargetTextConfig::from_json_str(text);

    let (draft_text, target_text) = match selector % 4 {
        0 => (text, examples::QWEN35_27B_TARGET),
        1 => (text, examples::QWEN35_35B_A3B_TARGET),
        2 => (examples::OFFICIAL_27B_DFLASH2_DRAFT, text),
        _ => (examples::OFFICIAL_35B_DFLASH_DRAFT, text),
    };
    let Ok(draft) = DraftConfig::from_json_str(draft_text, ParseMode::Lenient) else {
        return;
    };
    let Ok(target) = TargetTextConfig::from_json_str(target_text) else {
        return;
    };
    let public = u32::from(selector).saturating_mul(977).max(1);
    let target = target
        .clone()
        .with_public_vocab_size(public)
        .unwrap_or(target);
    let Ok(geometry) = validate_pair(&draft.value, &target) else {
        return;
    };
    let k = u32::from(selector >> 4);
    for backend in [Backend::DFlash, Backend::DFlash2] {
        let options = StartupOptions {
            concurrency: u32::from(selector & 0x0f),
            tree_nodes: (selector & 1 == 1).then_some(k + 1 + u32::from(selector >> 5)),
            proposal_head: if selector & 2 == 0 {
                ProposalHead::Full
            } else {
                ProposalHead::Indexed { rows: public }
            },
            mask_token_id: (selector & 4 == 4).then_some(u32::from(selector) << 10),
            ..StartupOptions::new(backend, k)
        };
        let _ = options.validate(&geometry);
    }
    let _ = geometry.transient_sizes(k, u32::from(selector));
});
