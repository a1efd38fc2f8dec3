//! `--geometry`: validate the bundled official example configs and print their derived
//! geometry (layers, ring capacity, ring image bytes, per-round transient sizes).

use anyhow::{Context, Result, ensure};
use dflash_config::{
    DraftConfig, Geometry, LayerKind, ParseMode, StartupOptions, TargetTextConfig, examples,
    validate_pair,
};

const MIB: f64 = 1024.0 * 1024.0;

fn mib(bytes: u64) -> String {
    #[allow(clippy::cast_precision_loss)] // reason: display only
    let m = bytes as f64 / MIB;
    format!("{bytes} B ({m:.2} MiB)")
}

fn report(name: &str, draft_json: &str, target_json: &str) -> Result<Geometry> {
    let draft = DraftConfig::from_json_str(draft_json, ParseMode::Strict)
        .with_context(|| format!("{name}: draft config"))?;
    let target = TargetTextConfig::from_json_str(target_json)
        .and_then(|t| t.with_public_vocab_size(examples::QWEN35_PUBLIC_VOCAB_SIZE))
        .with_context(|| format!("{name}: target config"))?;
    let g = validate_pair(&draft.value, &target).with_context(|| format!("{name}: pair"))?;

    println!("== {name}");
    println!(
        "backend {:?}; H {} Hq {} Hkv {} D {} I {}; eps {:e} theta {:e}",
        g.backend,
        g.hidden,
        g.q_heads,
        g.kv_heads,
        g.head_dim,
        g.intermediate,
        g.rms_norm_eps,
        g.rope_theta
    );
    println!(
        "target: {} layers, ids {:?} (feature width {}), vocab rows {}, public {}, mask {:?}",
        g.target_layers,
        g.target_layer_ids,
        g.feature_width,
        g.vocab_rows,
        examples::QWEN35_PUBLIC_VOCAB_SIZE,
        g.mask_token_id
    );
    let kinds: Vec<String> = g
        .layers
        .iter()
        .map(|l| match l {
            LayerKind::Local { window } => format!("local(S={window})"),
            LayerKind::Full => "full".to_owned(),
        })
        .collect();
    println!("layers: [{}]", kinds.join(", "));
    println!(
        "ring capacity S {:?}; {} local, {} full; full-layer pool: {}",
        g.ring_capacity,
        g.local_layers,
        g.full_layers,
        if g.has_full_pool { "yes" } else { "no" }
    );
    println!("ring state image: {}", mib(g.ring_image_bytes));
    if let Some(p) = g.dflash2 {
        println!(
            "conv: {} taps, group {}; selector: rank {}, top-{}",
            p.conv_kernel_size, p.conv_group_size, p.selector_rank, p.selector_top_k
        );
    }
    for (k, b) in [(7, 1), (15, 8)] {
        let s = StartupOptions {
            concurrency: b,
            ..StartupOptions::new(g.backend, k)
        }
        .validate(&g)
        .with_context(|| format!("{name}: startup K={k} B={b}"))?;
        let t = s.transient;
        println!(
            "round scratch K={k} (W={}) B={b}: total {}",
            s.block_width,
            mib(t.total())
        );
        println!(
            "  hidden {} | query {} | query-block K/V {} | MLP {} | verify features {}",
            t.block_hidden, t.block_query, t.query_block_kv, t.mlp_activations, t.verify_features
        );
        if g.dflash2.is_some() {
            println!(
                "  candidates ids {} scores {} q {} | selector hidden {} | conv input {} delta {}",
                t.candidate_ids,
                t.candidate_scores,
                t.candidate_q,
                t.selector_hidden,
                t.conv_prepared_input,
                t.conv_finish_delta
            );
        }
    }
    println!();
    Ok(g)
}

/// Validate the bundled official example configs and print their derived geometry.
pub fn report_all() -> Result<()> {
    let cases = [
        (
            "Qwen3.5-35B-A3B DFlash (nested config)",
            examples::OFFICIAL_35B_DFLASH_DRAFT,
            examples::QWEN35_35B_A3B_TARGET,
        ),
        (
            "Qwen3.5-35B-A3B DFlash (legacy config)",
            examples::OFFICIAL_35B_DFLASH_DRAFT_LEGACY,
            examples::QWEN35_35B_A3B_TARGET,
        ),
        (
            "Qwen3.5-27B DFlash2 (nested config)",
            examples::OFFICIAL_27B_DFLASH2_DRAFT,
            examples::QWEN35_27B_TARGET,
        ),
        (
            "Qwen3.5-27B DFlash2 (legacy config)",
            examples::OFFICIAL_27B_DFLASH2_DRAFT_LEGACY,
            examples::QWEN35_27B_TARGET,
        ),
    ];
    for (name, draft, target) in cases {
        let g = report(name, draft, target)?;
        if g.dflash2.is_some() {
            ensure!(
                g.ring_image_bytes == 40 << 20,
                "{name}: ring image must be 40 MiB"
            );
        }
    }
    println!("all example configs validated");
    Ok(())
}
