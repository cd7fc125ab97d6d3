//! Faults (principle 5): a failing read, a short read, a file truncated or
//! removed while the model runs. Each failure is an error naming the file
//! and the (layer, expert); nothing panics or hangs; a transient fault does
//! not poison the expert.

use std::sync::Arc;

use colibri_io::{FaultInjector, FaultRule, IoBackendChoice};
use colibri_model::{ExpertSource, ModelError};
use colibri_sched::tier::{Residency, TierOptions};

use crate::common::*;

fn with_faults(budget: u64, faults: &FaultInjector) -> TierOptions {
    TierOptions {
        faults: Some(faults.clone()),
        ..options(budget, IoBackendChoice::Auto)
    }
}

fn fetch_err(source: &dyn ExpertSource, layer: usize, ids: &[usize]) -> ModelError {
    source
        .fetch(layer, ids, &mut |_, _| Ok(()))
        .expect_err("the fetch should fail")
}

#[test]
fn a_failing_read_names_file_layer_and_expert_and_recovers() {
    for io in [IoBackendChoice::Uring, IoBackendChoice::Pread] {
        let dir = fixture("olmoe");
        let faults = FaultInjector::new();
        let (_, tier) = open_tier(
            &dir,
            TierOptions {
                io,
                ..with_faults(1 << 30, &faults)
            },
        );
        let l = tier.layout().moe_layers().next().unwrap();
        faults.add(FaultRule::fail_nth_read(1, libc::EIO));
        let err = fetch_err(tier.as_ref(), l, &[3]);
        let text = err.to_string();
        assert!(
            matches!(err, ModelError::Expert { layer, expert: 3, .. } if layer == l),
            "{text}"
        );
        assert!(text.contains("model.safetensors"), "{text}");
        assert!(text.contains("EIO") || text.contains("I/O error"), "{text}");
        assert_eq!(tier.residency(l, 3), Some(Residency::Absent));
        // The fault was transient: the next request reads it again.
        let got = fetch_keep(tier.as_ref(), l, &[3]);
        let want = fetch_keep(&resident_experts(&dir), l, &[3]);
        assert_eq!(expert_bytes(&got[0].1), expert_bytes(&want[0].1));
        assert_eq!(tier.stats().read_errors, 1);
    }
}

#[test]
fn a_failing_file_fails_the_forward_pass_then_the_engine_recovers() {
    let name = "mixtral";
    let dir = fixture(name);
    let r = reference(&dir);
    let want = logits_all(&resident_engine(&dir, 2), &r.tokens);
    let faults = FaultInjector::new();
    let (model, tier) = open_tier(&dir, with_faults(0, &faults));
    let victim = tier.files().path(tier.layout().records[0].reads[0].file);
    faults.add(FaultRule::fail_file(&victim, libc::EIO));
    let engine = engine_with(model, tier.clone(), 2);
    let mut cache = colibri_model::KvCache::new(&engine.model.spec, 256);
    let err = engine
        .model
        .forward(
            &engine.pool,
            engine.experts.as_ref(),
            &mut [colibri_model::SeqInput {
                cache: &mut cache,
                tokens: &r.tokens,
                logits: colibri_model::Logits::All,
            }],
        )
        .expect_err("reads of that file fail");
    let text = err.to_string();
    assert!(text.contains(&victim.display().to_string()), "{text}");
    assert!(text.contains("layer") && text.contains("expert"), "{text}");
    // The pass stopped at the first failure; reads it had already queued
    // still run (and fail) on their own. Once they have settled, the fault
    // is gone and the same engine computes the right logits.
    let start = std::time::Instant::now();
    while tier.occupancy().iter().any(|o| o.loading > 0) {
        assert!(start.elapsed().as_secs() < 60, "reads never settled");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    faults.clear();
    assert!(logits_all(&engine, &r.tokens) == want);
}

#[test]
fn short_reads_are_completed_not_returned() {
    let dir = fixture("qwen3_moe_bf16_sharded");
    let r = reference(&dir);
    let want = logits_all(&resident_engine(&dir, 1), &r.tokens);
    let faults = FaultInjector::new();
    let (model, tier) = open_tier(&dir, with_faults(0, &faults));
    for path in tier
        .files()
        .infos()
        .map(|i| i.path.clone())
        .collect::<Vec<_>>()
    {
        faults.add(FaultRule::short_file(path));
    }
    let engine = engine_with(model, tier.clone(), 1);
    assert!(logits_all(&engine, &r.tokens) == want);
    let counters = tier.reader_counters();
    assert!(counters.short_reads_resubmitted > 0, "{counters:?}");
    assert_eq!(counters.requests_failed, 0);
}

#[test]
fn a_truncated_file_fails_with_its_name() {
    let tmp = copy_fixture("deepseek_v3_fp8");
    let (_, tier) = open_tier(tmp.path(), options(0, IoBackendChoice::Auto));
    let path = tmp.path().join("model.safetensors");
    // The expert whose bytes are furthest into the file.
    let record = tier
        .layout()
        .records
        .iter()
        .max_by_key(|r| r.reads[0].offset)
        .unwrap()
        .clone();
    fetch_order(tier.as_ref(), record.layer, &[record.expert]);
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    file.set_len(record.reads[0].offset).unwrap();
    drop(file);
    let err = fetch_err(tier.as_ref(), record.layer, &[record.expert]);
    let text = err.to_string();
    assert!(
        matches!(err, ModelError::Expert { layer, expert, .. }
            if layer == record.layer && expert == record.expert),
        "{text}"
    );
    assert!(text.contains(&path.display().to_string()), "{text}");
    assert!(text.contains("truncated"), "{text}");
    // Experts still inside the file keep working.
    let first = tier
        .layout()
        .records
        .iter()
        .min_by_key(|r| r.reads[0].offset)
        .unwrap();
    assert_eq!(
        fetch_order(tier.as_ref(), first.layer, &[first.expert]).len(),
        1
    );
}

#[test]
fn a_removed_file_keeps_serving_through_the_open_descriptor() {
    // Unlinking a file leaves its inode alive while colibri holds it open:
    // the bytes are still right, so the correct outcome is no error.
    let tmp = copy_fixture("qwen2_moe");
    let r = reference(tmp.path());
    let want = logits_all(&resident_engine(&fixture("qwen2_moe"), 1), &r.tokens);
    let (model, tier) = open_tier(tmp.path(), options(0, IoBackendChoice::Auto));
    let engine = engine_with(model, tier.clone() as Arc<dyn ExpertSource>, 1);
    std::fs::remove_file(tmp.path().join("model.safetensors")).unwrap();
    assert!(logits_all(&engine, &r.tokens) == want);
    assert_eq!(tier.stats().hits, 0);
}
