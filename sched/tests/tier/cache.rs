//! Cache mechanics on a real fixture: eviction order, leases, single
//! flight, pinning, staging at a zero budget, prefetch limits, budgets.

use std::sync::Arc;
use std::time::{Duration, Instant};

use colibri_io::IoBackendChoice;
use colibri_model::ExpertSource;
use colibri_sched::tier::{EvictionPolicy, Residency, TierCache, TierOptions, UsageMode};
use rand::{Rng, SeedableRng};

use crate::common::*;

const NAME: &str = "olmoe";

fn layer(tier: &TierCache) -> usize {
    tier.layout().moe_layers().next().unwrap()
}

fn tier_with(slots: u64, policy: EvictionPolicy, queue_depth: usize) -> Arc<TierCache> {
    let dir = fixture(NAME);
    let slot = slot_bytes(&dir);
    let (_, tier) = open_tier(
        &dir,
        TierOptions {
            policy,
            queue_depth,
            ..options(slots * slot, IoBackendChoice::Auto)
        },
    );
    tier
}

fn idle(r: Option<Residency>) -> bool {
    matches!(
        r,
        Some(Residency::Resident {
            leases: 0,
            evictable: true,
            ..
        })
    )
}

fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "timed out: {what}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn lru_evicts_the_least_recently_used() {
    let tier = tier_with(3, EvictionPolicy::Lru, 2);
    let l = layer(&tier);
    for e in [0, 1, 2] {
        fetch_order(tier.as_ref(), l, &[e]);
    }
    fetch_order(tier.as_ref(), l, &[0]);
    fetch_order(tier.as_ref(), l, &[3]);
    assert_eq!(tier.residency(l, 1), Some(Residency::Absent));
    for e in [0, 2, 3] {
        assert!(idle(tier.residency(l, e)), "expert {e}");
    }
    fetch_order(tier.as_ref(), l, &[4]);
    assert_eq!(tier.residency(l, 2), Some(Residency::Absent));
    let stats = tier.stats();
    assert_eq!(stats.demand_reads, 5);
    assert_eq!(stats.hits, 1);
    assert_eq!(stats.evictions, 2);
    assert_eq!(tier.reader_counters().requests_submitted, 5);
}

#[test]
fn slru_keeps_reused_experts_that_lru_would_evict() {
    for (policy, survives) in [(EvictionPolicy::Slru, true), (EvictionPolicy::Lru, false)] {
        let tier = tier_with(3, policy, 2);
        let l = layer(&tier);
        fetch_order(tier.as_ref(), l, &[0]);
        fetch_order(tier.as_ref(), l, &[0]);
        // A burst of one-off experts.
        for e in 1..6 {
            fetch_order(tier.as_ref(), l, &[e]);
        }
        assert_eq!(idle(tier.residency(l, 0)), survives, "{policy}");
    }
}

#[test]
fn leased_experts_are_never_evicted() {
    let tier = tier_with(1, EvictionPolicy::Lru, 2);
    let l = layer(&tier);
    let kept = fetch_keep(tier.as_ref(), l, &[0]);
    let before = expert_bytes(&kept[0].1);
    for e in 1..8 {
        fetch_order(tier.as_ref(), l, &[e]);
        assert_eq!(
            tier.residency(l, 0),
            Some(Residency::Resident {
                leases: 1,
                pinned: false,
                evictable: false
            })
        );
    }
    // The slot under the lease was never reused: the bytes are unchanged.
    assert_eq!(expert_bytes(&kept[0].1), before);
    drop(kept);
    // Released last, so it is the newest idle expert and 7 is evicted.
    assert!(idle(tier.residency(l, 0)));
    assert_eq!(tier.residency(l, 7), Some(Residency::Absent));
    for o in tier.occupancy() {
        assert!(o.idle <= o.cache_slots, "{o:?}");
    }
}

#[test]
fn a_zero_budget_serves_more_experts_than_staging_slots() {
    let tier = tier_with(0, EvictionPolicy::Lru, 2);
    let l = layer(&tier);
    let plan = tier.plan();
    assert_eq!(plan.cache_slots(), 0);
    assert_eq!(plan.classes[0].staging_slots, 2);
    let mut order = fetch_order(tier.as_ref(), l, &[0, 1, 2, 3, 4, 5, 6, 7]);
    order.sort_unstable();
    assert_eq!(order, (0..8).collect::<Vec<_>>());
    let again = fetch_order(tier.as_ref(), l, &[1, 5]);
    assert_eq!(again.len(), 2);
    let stats = tier.stats();
    assert_eq!(stats.hits, 0);
    assert_eq!(stats.demand_reads, 10);
    for o in tier.occupancy() {
        assert_eq!(o.free_slots, o.arena_slots, "{o:?}");
        assert_eq!(o.arena_slots, 2);
    }
}

#[test]
fn a_prefetch_read_is_joined_not_repeated() {
    let tier = tier_with(8, EvictionPolicy::Lru, 4);
    let l = layer(&tier);
    tier.prefetch(l, &[5]);
    let kept = fetch_keep(tier.as_ref(), l, &[5]);
    assert_eq!(kept.len(), 1);
    let stats = tier.stats();
    assert_eq!(stats.prefetch_reads, 1);
    assert_eq!(stats.demand_reads, 0);
    assert_eq!(stats.joined_prefetch + stats.prefetch_hits, 1, "{stats:?}");
    assert_eq!(tier.reader_counters().requests_submitted, 1);
    // The bytes are the expert's.
    let resident = resident_experts(&fixture(NAME));
    let want = fetch_keep(&resident, l, &[5]);
    assert_eq!(expert_bytes(&kept[0].1), expert_bytes(&want[0].1));
}

#[test]
fn concurrent_fetches_of_one_expert_share_one_read() {
    let tier = tier_with(8, EvictionPolicy::Lru, 4);
    let l = layer(&tier);
    let hold = tier.hold_io().expect("hold");
    let a = {
        let tier = tier.clone();
        std::thread::spawn(move || fetch_keep(tier.as_ref(), l, &[2, 5]).len())
    };
    wait_until("first fetch issues its reads", || {
        tier.residency(l, 5) == Some(Residency::Loading)
    });
    let b = {
        let tier = tier.clone();
        std::thread::spawn(move || fetch_keep(tier.as_ref(), l, &[5]).len())
    };
    wait_until("second fetch joins", || tier.stats().joined_demand == 1);
    drop(hold);
    assert_eq!(a.join().unwrap(), 2);
    assert_eq!(b.join().unwrap(), 1);
    assert_eq!(tier.stats().demand_reads, 2);
    assert_eq!(tier.reader_counters().requests_submitted, 2);
}

#[test]
fn hits_are_delivered_while_misses_are_read() {
    let tier = tier_with(8, EvictionPolicy::Lru, 4);
    let l = layer(&tier);
    fetch_order(tier.as_ref(), l, &[1, 3]);
    let order = fetch_order(tier.as_ref(), l, &[0, 1, 2, 3, 4]);
    assert_eq!(&order[..2], &[1, 3]);
    let mut rest = order[2..].to_vec();
    rest.sort_unstable();
    assert_eq!(rest, vec![0, 2, 4]);
}

#[test]
fn delivered_bytes_are_the_checkpoint_bytes() {
    for name in ["olmoe", "deepseek_v3_fp8", "qwen3_moe_bf16_sharded"] {
        let dir = fixture(name);
        let (_, tier) = open_tier(&dir, options(0, IoBackendChoice::Auto));
        let resident = resident_experts(&dir);
        let layers: Vec<usize> = tier.layout().moe_layers().collect();
        let n = tier.layout().experts_per_layer;
        for l in layers {
            let ids: Vec<usize> = (0..n).collect();
            let mut got = fetch_keep(tier.as_ref(), l, &ids[..2]);
            got.extend(fetch_keep(tier.as_ref(), l, &ids[2..]));
            got.sort_by_key(|(e, _)| *e);
            let want = fetch_keep(&resident, l, &ids);
            for ((e, g), (_, w)) in got.iter().zip(&want) {
                let g = expert_bytes(g);
                assert!(g[0].iter().any(|&b| b != 0), "{name}: all-zero expert");
                assert_eq!(g, expert_bytes(w), "{name} layer {l} expert {e}");
            }
        }
    }
}

/// The GPU tier lays its slots out as `ExpertRecord::slot_offsets` says the
/// RAM slots are, and copies an expert with one copy when the bytes agree:
/// so the prediction must be where the reader really puts each matrix.
#[test]
fn matrices_land_in_the_slot_where_the_layout_says() {
    let paths = [
        gguf("qwen3_moe.q4_0.gguf"),
        gguf("mixtral.q8_0.gguf"),
        gguf("qwen3_moe.low.gguf"),
        gguf("olmoe.bf16.gguf"),
        fixture("qwen3_moe_bf16_sharded"),
        fixture("deepseek_v3_fp8"),
    ];
    let mut separate_reads = 0;
    for path in &paths {
        for budget in [0, 1 << 30] {
            let (_, tier) = if path.is_dir() {
                open_tier(path, options(budget, IoBackendChoice::Auto))
            } else {
                tier_over(path, options(budget, IoBackendChoice::Auto))
            };
            let layout = tier.layout();
            for l in layout.moe_layers().collect::<Vec<_>>() {
                let ids: Vec<usize> = (0..layout.experts_per_layer).collect();
                for (e, w) in fetch_keep(tier.as_ref(), l, &ids) {
                    let r = &layout.records[layout.entry(l, e).unwrap()];
                    separate_reads += usize::from(r.reads.len() > 1);
                    let at =
                        [&w.gate, &w.up, &w.down].map(|m| m.data().as_slice().as_ptr() as i128);
                    for i in 1..3 {
                        assert_eq!(
                            at[i] - at[0],
                            r.slot_offsets[i] as i128 - r.slot_offsets[0] as i128,
                            "{} budget {budget} layer {l} expert {e} matrix {i}",
                            path.display()
                        );
                    }
                }
            }
        }
    }
    // The GGUFs' stacked tensors are read apart: the case with gaps.
    assert!(separate_reads > 0);
}

#[test]
fn prefetch_never_evicts_cached_or_leased_experts() {
    // 2 cache slots + 2 staging; prefetch keeps 1 free slot for demand.
    let tier = tier_with(2, EvictionPolicy::Lru, 2);
    let l = layer(&tier);
    fetch_order(tier.as_ref(), l, &[0]);
    fetch_order(tier.as_ref(), l, &[1]);
    let kept = fetch_keep(tier.as_ref(), l, &[2]);
    tier.prefetch(l, &[3, 4]);
    assert_eq!(tier.stats().prefetch_reads, 0);
    for e in [0, 1] {
        assert!(idle(tier.residency(l, e)), "expert {e}");
    }
    drop(kept);
    // 2 became idle and pushed the oldest (0) out; one slot is now spare.
    assert_eq!(tier.residency(l, 0), Some(Residency::Absent));
    tier.prefetch(l, &[3, 4]);
    assert_eq!(tier.stats().prefetch_reads, 1);
    wait_until("prefetch lands", || {
        tier.residency(l, 3) != Some(Residency::Loading)
    });
    for e in [1, 2] {
        assert!(idle(tier.residency(l, e)), "expert {e}");
    }
    // A demand read may take the prefetched slot back if it must; here the
    // prefetched expert is simply used.
    fetch_order(tier.as_ref(), l, &[3]);
    assert_eq!(tier.stats().prefetch_hits, 1);
}

#[test]
fn the_budget_is_never_exceeded() {
    let dir = fixture("qwen2_moe");
    let slot = slot_bytes(&dir);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    for slots in [0u64, 1, 3, 7, 100] {
        let budget = slots * slot + slot / 2;
        let (_, tier) = open_tier(
            &dir,
            TierOptions {
                queue_depth: 3,
                ..options(budget, IoBackendChoice::Auto)
            },
        );
        let plan = tier.plan().clone();
        assert!(plan.committed_bytes() <= budget);
        let layers: Vec<usize> = tier.layout().moe_layers().collect();
        let n = tier.layout().experts_per_layer;
        let expected_arena: usize = plan.classes.iter().map(|c| c.arena_slots().max(1)).sum();
        for step in 0..200 {
            let l = layers[rng.random_range(0..layers.len())];
            let mut ids: Vec<usize> = (0..n).filter(|_| rng.random_bool(0.3)).collect();
            if ids.is_empty() {
                ids.push(rng.random_range(0..n));
            }
            if step % 7 == 0 {
                tier.prefetch(l, &[rng.random_range(0..n)]);
            }
            fetch_order(tier.as_ref(), l, &ids);
            let occupancy = tier.occupancy();
            let arena: usize = occupancy.iter().map(|o| o.arena_slots).sum();
            assert_eq!(arena, expected_arena);
            for o in &occupancy {
                assert!(o.idle <= o.cache_slots, "{slots} slots, step {step}: {o:?}");
                assert_eq!(o.leased, 0);
            }
        }
    }
}

#[test]
fn pinned_experts_are_never_evicted() {
    let dir = fixture(NAME);
    let slot = slot_bytes(&dir);
    let usage = tempfile::tempdir().unwrap();
    // A history in which expert 6 of the first MoE layer is always chosen.
    let (_, tier) = open_tier(
        &dir,
        TierOptions {
            usage: UsageMode::Dir(usage.path().to_path_buf()),
            pin_budget: Some(0),
            ..options(0, IoBackendChoice::Auto)
        },
    );
    let l = layer(&tier);
    for round in 0..20 {
        fetch_order(tier.as_ref(), l, &[round % 6, 6]);
    }
    assert!(tier.save_usage().unwrap().is_some());
    drop(tier);

    let (_, tier) = open_tier(
        &dir,
        TierOptions {
            usage: UsageMode::Dir(usage.path().to_path_buf()),
            pin_budget: Some(slot),
            ..options(2 * slot, IoBackendChoice::Auto)
        },
    );
    assert_eq!(tier.plan().pinned, vec![(l, 6)]);
    assert_eq!(tier.plan().expected.basis, "usage_history");
    let pinned = Some(Residency::Resident {
        leases: 0,
        pinned: true,
        evictable: false,
    });
    assert_eq!(tier.residency(l, 6), pinned);
    let reads = tier.reader_counters().requests_submitted;
    for e in 0..8 {
        if e != 6 {
            fetch_order(tier.as_ref(), l, &[e]);
        }
    }
    fetch_order(tier.as_ref(), l, &[6]);
    assert_eq!(tier.residency(l, 6), pinned);
    assert_eq!(tier.reader_counters().requests_submitted, reads + 7);
    assert!(tier.stats().evictions > 0);
}

#[test]
fn concurrent_fetches_under_a_tiny_budget_always_see_the_right_bytes() {
    // Four threads share one cache slot and two staging slots: they wait
    // for each other's slots, join each other's reads and evict each
    // other's experts. Every delivered expert must still hold its own bytes
    // (a slot reused under a lease would show here), and nothing hangs.
    let dir = fixture("qwen3_moe");
    let resident = resident_experts(&dir);
    let tier = {
        let slot = slot_bytes(&dir);
        let (_, tier) = open_tier(
            &dir,
            TierOptions {
                queue_depth: 2,
                ..options(slot, IoBackendChoice::Auto)
            },
        );
        tier
    };
    let layers: Vec<usize> = tier.layout().moe_layers().collect();
    let n = tier.layout().experts_per_layer;
    let mut want = std::collections::HashMap::new();
    for &l in &layers {
        let ids: Vec<usize> = (0..n).collect();
        for (e, w) in fetch_keep(&resident, l, &ids) {
            want.insert((l, e), expert_bytes(&w));
        }
    }
    let want = Arc::new(want);
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let tier = tier.clone();
            let want = want.clone();
            let layers = layers.clone();
            std::thread::spawn(move || {
                let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(t);
                for _ in 0..100 {
                    let l = layers[rng.random_range(0..layers.len())];
                    let ids: Vec<usize> = (0..n).filter(|_| rng.random_bool(0.25)).collect();
                    if rng.random_bool(0.2) {
                        tier.prefetch(l, &[rng.random_range(0..n)]);
                    }
                    tier.fetch(l, &ids, &mut |e, w| {
                        assert_eq!(expert_bytes(&w), want[&(l, e)], "layer {l} expert {e}");
                        Ok(())
                    })
                    .unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    for o in tier.occupancy() {
        assert!(o.idle <= o.cache_slots, "{o:?}");
        assert_eq!(o.leased, 0, "{o:?}");
    }
}

#[test]
fn all_resident_follows_installs_and_evictions() {
    let experts = |tier: &TierCache| -> Vec<(usize, usize)> {
        let per_layer = tier.layout().experts_per_layer;
        tier.layout()
            .moe_layers()
            .flat_map(|l| (0..per_layer).map(move |e| (l, e)))
            .collect()
    };
    let n = tier_with(1, EvictionPolicy::Lru, 2).layout().len();
    // Room for every expert: resident once the last one has been read.
    let tier = tier_with(n as u64, EvictionPolicy::Lru, 2);
    assert!(tier.plan().cache_slots() >= n);
    let all = experts(&tier);
    assert_eq!(all.len(), n);
    for (i, &(l, e)) in all.iter().enumerate() {
        assert!(!tier.all_resident(), "{i} of {n} read");
        fetch_order(tier.as_ref(), l, &[e]);
    }
    assert!(tier.all_resident());
    // One slot short: each read past the budget evicts another expert.
    let short = tier_with(n as u64 - 1, EvictionPolicy::Lru, 2);
    for &(l, e) in all.iter().chain(&all[..3]) {
        fetch_order(short.as_ref(), l, &[e]);
        assert!(!short.all_resident());
    }
    assert!(short.stats().evictions > 0);
}

#[test]
fn peek_leases_resident_experts_without_reading_or_counting() {
    let tier = tier_with(3, EvictionPolicy::Lru, 2);
    let l = layer(&tier);
    fetch_order(tier.as_ref(), l, &[0]);
    fetch_order(tier.as_ref(), l, &[1]);
    let before = tier.stats();
    let reads = tier.reader_counters().requests_submitted;

    // Absent: nothing is read, nothing waits.
    assert!(tier.peek(l, 5).is_none());
    assert_eq!(tier.residency(l, 5), Some(Residency::Absent));

    // Resident: the checkpoint's bytes, under a lease that keeps them.
    let peeked = tier.peek(l, 0).expect("expert 0 is resident");
    let resident = resident_experts(&fixture(NAME));
    let want = fetch_keep(&resident, l, &[0]);
    assert_eq!(expert_bytes(&peeked), expert_bytes(&want[0].1));
    assert_eq!(
        tier.residency(l, 0),
        Some(Residency::Resident {
            leases: 1,
            pinned: false,
            evictable: false
        })
    );
    for e in 2..6 {
        fetch_order(tier.as_ref(), l, &[e]);
    }
    assert!(matches!(
        tier.residency(l, 0),
        Some(Residency::Resident { leases: 1, .. })
    ));
    assert_eq!(expert_bytes(&peeked), expert_bytes(&want[0].1));

    // A peek is not a request: hits, requests and reads are the fetches'.
    let after = tier.stats();
    assert_eq!(after.hits, before.hits);
    assert_eq!(after.demand_reads, before.demand_reads + 4);
    assert_eq!(
        tier.reader_counters().requests_submitted,
        reads + 4,
        "a peek started a read"
    );
    drop(peeked);
    assert!(idle(tier.residency(l, 0)));
}
