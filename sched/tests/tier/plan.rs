//! The planner on real layouts: never over-commits, sizes staging from the
//! queue depth, derives the automatic budget from the machine, and predicts
//! disk bytes per token.

use colibri_io::IoBackendChoice;
use colibri_sched::tier::{BudgetSource, MemoryLimits, TierOptions, UsageMode, plan_checkpoint};

use crate::common::*;

#[test]
fn plans_never_over_commit_and_predict_uniform_reads() {
    for name in ["deepseek_v3_fp8", "mixtral", "qwen3_moe_bf16_sharded"] {
        let dir = fixture(name);
        let all = plan_checkpoint(&dir, 0, &options(u64::MAX / 4, IoBackendChoice::Auto))
            .unwrap()
            .plan;
        assert_eq!(all.committed_bytes(), all.all_experts_bytes, "{name}");
        assert_eq!(all.staging_bytes, 0, "{name}: nothing to stage");
        assert_eq!(all.expected.bytes_read_per_token, 0.0);
        for budget in [0, 1, all.all_experts_bytes / 3, all.all_experts_bytes - 1] {
            let report = plan_checkpoint(&dir, 0, &options(budget, IoBackendChoice::Auto)).unwrap();
            let plan = &report.plan;
            assert!(plan.committed_bytes() <= budget, "{name} {budget}");
            assert_eq!(plan.ram_budget_source, BudgetSource::User);
            assert!(plan.staging_bytes > 0, "{name} {budget}");
            // Uniform routing: the hit rate is the cached fraction.
            let cached = plan.cache_slots() as f64 / plan.routed_experts as f64;
            assert!(
                (plan.expected.hit_rate - cached).abs() < 1e-9,
                "{name} {budget}"
            );
            let want = plan.expected.cold_bytes_per_token * (1.0 - cached);
            assert!(
                (plan.expected.bytes_read_per_token - want).abs() <= 1e-6 * want.max(1.0),
                "{name} {budget}"
            );
            assert!(plan.expected.note.contains("uniform routing"));
            let text = report.render();
            for needle in [
                "dense weights",
                "KV cache reserve",
                "staging",
                "cache slots",
            ] {
                assert!(text.contains(needle), "{name}: {needle} missing:\n{text}");
            }
        }
    }
}

#[test]
fn the_automatic_budget_is_what_the_machine_has_left() {
    let dir = fixture("olmoe");
    let memory = MemoryLimits {
        mem_available: Some(64 << 30),
        cgroup_limit: Some(1 << 30),
        cgroup_file: None,
    };
    let report = plan_checkpoint(
        &dir,
        0,
        &TierOptions {
            memory: Some(memory),
            usage: UsageMode::Off,
            queue_depth: 4,
            ..TierOptions::default()
        },
    )
    .unwrap();
    let p = &report.plan;
    assert_eq!(p.ram_budget_source, BudgetSource::Auto);
    assert_eq!(p.usable_bytes, Some(1 << 30));
    assert_eq!(p.safety_margin_bytes, 256 << 20);
    let staging_max: u64 = p.classes.iter().map(|c| c.slot_bytes * 4).sum();
    assert_eq!(
        p.ram_budget_bytes,
        (1u64 << 30) - p.dense_bytes - p.kv_reserve_bytes - staging_max - p.safety_margin_bytes
    );
    assert!(p.dense_bytes > 0 && p.kv_reserve_bytes > 0);
    // No history: nothing pinned, no pin budget.
    assert_eq!(p.pin_budget_bytes, 0);
    assert!(report.io.files >= 1);
}

#[test]
fn an_oversized_budget_is_reported() {
    let dir = fixture("olmoe");
    let report = plan_checkpoint(&dir, 0, &options(64 << 30, IoBackendChoice::Auto)).unwrap();
    assert!(
        report.plan.warnings.iter().any(|w| w.contains("exceeds")),
        "{:?}",
        report.plan.warnings
    );
}
