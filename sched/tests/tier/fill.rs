//! Filling the cache's free room ahead of need (`TierCache::fill`, the
//! prefetcher's `FillScores`): which experts it reads, that it only takes
//! room no cached expert holds, that filled experts are the first to go
//! (least favoured first), that a demand joins a fill read in flight, and
//! that an engine filling its cache computes exactly what the oracle does.
//! Counters and residency only, never time.

use std::sync::Arc;

use colibri_io::IoBackendChoice;
use colibri_model::{ExpertSource, Pool};
use colibri_sched::prefetch::{PrefetchOptions, Prefetcher};
use colibri_sched::tier::{EvictionPolicy, Residency, TierCache, TierOptions};
use colibri_sched::{Engine, EngineOptions};

use crate::common::*;

fn settle(tier: &TierCache) {
    let start = std::time::Instant::now();
    while tier.occupancy().iter().any(|o| o.loading > 0) {
        assert!(start.elapsed().as_secs() < 60, "reads never finished");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

fn filled(tier: &TierCache) -> usize {
    tier.occupancy().iter().map(|o| o.filled).sum()
}

fn idle(tier: &TierCache) -> usize {
    tier.occupancy().iter().map(|o| o.idle).sum()
}

/// A tier over `fixture` with `cache` cache slots (LRU), one read at a time.
fn small_tier(fixture_name: &str, cache: u64) -> (std::path::PathBuf, Arc<TierCache>) {
    let dir = fixture(fixture_name);
    let slot = slot_bytes(&dir);
    let (_, tier) = open_tier(
        &dir,
        TierOptions {
            queue_depth: 1,
            policy: EvictionPolicy::Lru,
            ..options(cache * slot, IoBackendChoice::Auto)
        },
    );
    (dir, tier)
}

#[test]
fn fill_reads_the_most_favoured_absent_experts_into_cache_room_only() {
    let (dir, tier) = small_tier("qwen3_moe", 4);
    let cache_slots: usize = tier.occupancy().iter().map(|o| o.cache_slots).sum();
    assert_eq!(cache_slots, 4, "{:?}", tier.occupancy());
    let layout = tier.layout().clone();
    let layers: Vec<usize> = layout.moe_layers().collect();
    let (a, b) = (layers[0], *layers.last().unwrap());
    // One expert is cached already; it is also the most favoured.
    fetch_order(tier.as_ref(), a, &[0]);
    let at = |l: usize, e: usize| layout.entry(l, e).unwrap();
    let ranked: Vec<u32> = [(a, 0), (b, 3), (a, 2), (b, 1), (a, 5)]
        .iter()
        .map(|&(l, e)| at(l, e) as u32)
        .collect();
    let mut cursor = 0;

    // Two in flight: the two most favoured absent experts.
    assert_eq!(tier.fill(&ranked, &mut cursor, 2), 2);
    assert_eq!(cursor, 3, "past the cached one and the two read");
    // Reads in flight count against the limit.
    assert_eq!(tier.fill(&ranked, &mut cursor, 2), 0);
    assert_eq!(cursor, 3);
    settle(&tier);
    for (l, e) in [(b, 3), (a, 2)] {
        assert!(
            matches!(
                tier.residency(l, e),
                Some(Residency::Resident {
                    leases: 0,
                    pinned: false,
                    evictable: true
                })
            ),
            "{l}/{e}: {:?}",
            tier.residency(l, e)
        );
    }
    assert_eq!(filled(&tier), 2);
    // One more fits (1 cached + 2 filled + 1 = 4 cache slots), then none.
    assert_eq!(tier.fill(&ranked, &mut cursor, 2), 1);
    settle(&tier);
    assert!(matches!(
        tier.residency(b, 1),
        Some(Residency::Resident { leases: 0, .. })
    ));
    assert_eq!(tier.fill(&ranked, &mut cursor, 2), 0, "the cache is full");
    assert_eq!(tier.residency(a, 5), Some(Residency::Absent));
    // What is not ranked is never read.
    assert_eq!(tier.residency(a, 6), Some(Residency::Absent));
    // A walked ranking reads nothing more, room or not.
    let mut end = ranked.len();
    assert_eq!(tier.fill(&ranked, &mut end, 2), 0);
    let s = tier.stats();
    assert_eq!(s.fill_reads, 3, "{s:?}");
    let bytes: u64 = [(b, 3), (a, 2), (b, 1)]
        .iter()
        .map(|&(l, e)| layout.records[at(l, e)].read_bytes)
        .sum();
    assert_eq!(s.fill_read_bytes, bytes, "{s:?}");
    assert_eq!(s.read_bytes(), s.demand_read_bytes + bytes);
    assert_eq!((idle(&tier), filled(&tier)), (1, 3));

    // A filled expert's first use is a hit with the right bytes; it is an
    // ordinary cached expert from then on.
    let resident = resident_experts(&dir);
    let want = fetch_keep(&resident, b, &[3]);
    let got = fetch_keep(tier.as_ref(), b, &[3]);
    assert_eq!(expert_bytes(&got[0].1), expert_bytes(&want[0].1));
    drop(got);
    let s = tier.stats();
    assert_eq!((s.fill_hits, s.fill_joined), (1, 0), "{s:?}");
    assert_eq!(s.fill_used_bytes, layout.records[at(b, 3)].read_bytes);
    assert_eq!(s.demand_reads, 1, "only the first fetch read: {s:?}");
    fetch_order(tier.as_ref(), b, &[3]);
    assert_eq!(tier.stats().fill_hits, 1, "counted once");
    assert_eq!((idle(&tier), filled(&tier)), (2, 2));
}

#[test]
fn filled_experts_make_room_first_least_favoured_first() {
    let (dir, tier) = small_tier("qwen3_moe", 4);
    let layout = tier.layout().clone();
    let l = layout.moe_layers().next().unwrap();
    let at = |e: usize| layout.entry(l, e).unwrap();
    // Two cached experts, then two filled: 7 favoured over 6.
    fetch_order(tier.as_ref(), l, &[0, 1]);
    let ranked = [at(7) as u32, at(6) as u32];
    assert_eq!(tier.fill(&ranked, &mut 0, 4), 2);
    settle(&tier);
    assert_eq!((idle(&tier), filled(&tier)), (2, 2));
    // A miss needs room: the least favoured filled expert goes, not a
    // cached one.
    fetch_order(tier.as_ref(), l, &[2]);
    let resident = |e| matches!(tier.residency(l, e), Some(Residency::Resident { .. }));
    assert!(!resident(6) && resident(7), "{:?}", tier.occupancy());
    assert!(resident(0) && resident(1) && resident(2));
    let s = tier.stats();
    assert_eq!((s.fill_unused, s.evictions), (1, 0), "{s:?}");
    assert_eq!(s.fill_unused_bytes, layout.records[at(6)].read_bytes);
    // Then the other filled one, then the cached experts in LRU order.
    fetch_order(tier.as_ref(), l, &[3]);
    assert!(!resident(7) && resident(0));
    fetch_order(tier.as_ref(), l, &[4]);
    assert!(!resident(0) && resident(1) && resident(4));
    let s = tier.stats();
    assert_eq!(
        (s.fill_unused, s.evictions, s.fill_hits),
        (2, 1, 0),
        "{s:?}"
    );
    // Room held by experts in use is not room: with every cache slot
    // cached or leased, nothing is filled.
    let kept = fetch_keep(tier.as_ref(), l, &[1, 2, 3, 4]);
    let mut cursor = 0;
    assert_eq!(
        tier.fill(&ranked, &mut cursor, 4),
        0,
        "{:?}",
        tier.occupancy()
    );
    assert_eq!(cursor, 0, "nothing looked at without room");
    drop(kept);
    // What any fetch delivers is the expert's own bytes throughout.
    let want = fetch_keep(&resident_experts(&dir), l, &[6, 7]);
    let got = fetch_keep(tier.as_ref(), l, &[6, 7]);
    for (w, g) in want.iter().zip(&got) {
        assert_eq!(expert_bytes(&g.1), expert_bytes(&w.1));
    }
}

#[test]
fn a_demand_joins_and_promotes_a_fill_read() {
    let (_, tier) = small_tier("olmoe", 8);
    let layout = tier.layout().clone();
    let l = layout.moe_layers().next().unwrap();
    let ranked = [layout.entry(l, 3).unwrap() as u32];
    let hold = tier.hold_io().expect("hold");
    assert_eq!(tier.fill(&ranked, &mut 0, 1), 1);
    let fetch = {
        let tier = tier.clone();
        std::thread::spawn(move || fetch_keep(tier.as_ref(), l, &[3]).len())
    };
    let start = std::time::Instant::now();
    while tier.reader_counters().requests_promoted == 0 {
        assert!(start.elapsed().as_secs() < 60, "never promoted");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    drop(hold);
    assert_eq!(fetch.join().unwrap(), 1);
    let s = tier.stats();
    assert_eq!((s.fill_joined, s.fill_hits), (1, 0), "{s:?}");
    assert_eq!(s.demand_reads, 0, "no second read: {s:?}");
    assert_eq!(s.prefetch_promoted, 1, "{s:?}");
    // Not a stale prediction: cancelling predictions leaves it alone.
    assert_eq!(tier.cancel_prefetch(l, &[3]), 0);
    settle(&tier);
    assert_eq!(filled(&tier), 0, "used, so cached");
}

/// Waits until the idle filler has been quiet (no new fill read, none in
/// flight) for a while; the fill reads it made.
fn filled_while_idle(tier: &TierCache) -> u64 {
    let start = std::time::Instant::now();
    let mut last = (u64::MAX, std::time::Instant::now());
    loop {
        let reads = tier.stats().fill_reads;
        let loading = tier.occupancy().iter().any(|o| o.loading > 0);
        if reads != last.0 || loading {
            last = (reads, std::time::Instant::now());
        } else if last.1.elapsed() >= std::time::Duration::from_millis(600) {
            return reads;
        }
        assert!(start.elapsed().as_secs() < 60, "the filler never settled");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

#[test]
fn an_engine_fills_its_cache_while_idle_and_computes_what_the_oracle_does() {
    for name in ["qwen3_moe", "deepseek_v3"] {
        let dir = fixture(name);
        let r = reference(&dir);
        let oracle = resident_engine(&dir, 2);
        let want = logits_all(&oracle, &r.tokens);
        let want_steps = logits_stepwise(&oracle, &r.tokens[..6]);
        let slot = slot_bytes(&dir);
        let routed = {
            let (_, tier) = open_tier(&dir, options(0, IoBackendChoice::Auto));
            tier.layout().len() as u64
        };
        // Room for every expert (the filler has room until all are in),
        // and for half (filled experts make room under pressure).
        for (fill_in_flight, cache) in [(0, routed), (4, routed), (1, routed / 2)] {
            let (model, tier) = open_tier(
                &dir,
                TierOptions {
                    queue_depth: 2,
                    ..options(cache * slot, IoBackendChoice::Auto)
                },
            );
            let pool = Arc::new(Pool::new(2).unwrap());
            let prefetcher = Arc::new(
                Prefetcher::new(
                    tier.clone(),
                    &model,
                    pool.clone(),
                    &PrefetchOptions {
                        fill_in_flight,
                        ..PrefetchOptions::default()
                    },
                )
                .unwrap(),
            );
            let engine = Engine::with_pool(
                model,
                prefetcher as Arc<dyn ExpertSource>,
                pool,
                Default::default(),
                &EngineOptions {
                    threads: 2,
                    ..EngineOptions::default()
                },
            )
            .unwrap();
            let what = format!("{name}: fill {fill_in_flight}, {cache} cache slots");
            // A few tokens one at a time: each routes a few experts, so the
            // cache keeps room; then the engine idles and the filler reads.
            let got = logits_stepwise(&engine, &r.tokens[..6]);
            assert_eq!(got, want_steps, "{what}, stepwise");
            let before = tier.stats();
            let filled = filled_while_idle(&tier);
            if fill_in_flight == 0 {
                assert_eq!(filled, 0, "{what}");
            } else if cache == routed {
                assert!(filled > before.fill_reads, "{what}: {:?}", tier.stats());
            }
            let o = tier.occupancy();
            let cached: usize = o.iter().map(|c| c.idle + c.filled).sum();
            let slots: usize = o.iter().map(|c| c.cache_slots).sum();
            assert!(cached <= slots, "{what}: {o:?}");
            if fill_in_flight > 0 && cache == routed {
                // Room was left only where no expert has a score: the
                // filler read every expert the routers gave probability.
                assert!(tier.all_resident() || cached < slots, "{what}: {o:?}");
            }
            // The next pass finds filled experts, and computes exactly.
            let got = logits_all(&engine, &r.tokens);
            assert_eq!(got, want, "{what}");
            let s = tier.stats();
            if fill_in_flight > 0 && cache == routed {
                assert!(s.fill_used() > 0, "{what}: {s:?}");
            }
            assert_eq!(s.read_errors, 0, "{what}");
        }
    }
}
