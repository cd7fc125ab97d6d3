//! The router-aware prefetcher and the tier's speculative reads: exactness
//! with every predictor (principle 2), promotion of a queued prefetch that
//! a demand joins, cancellation of stale predictions, recall and waste on
//! scripted routing where the truth is known, leases under prefetch
//! pressure, routing traces and their replay. Counters and issue order
//! only, never time.

use std::sync::Arc;

use colibri_io::IoBackendChoice;
use colibri_model::{ExpertSource, Model, Pool};
use colibri_sched::prefetch::replay::{ReplayConfig, SyntheticExperts, replay};
use colibri_sched::prefetch::{
    Predictor, PrefetchOptions, Prefetcher, Trace, TraceHeader, TraceRecord,
};
use colibri_sched::tier::{EvictionPolicy, Residency, TierCache, TierOptions, TierStats};
use colibri_sched::{Engine, EngineOptions};

use crate::common::*;

const FIXTURES: [&str; 7] = [
    "deepseek_v3_fp8",
    "qwen3_moe_bf16_sharded",
    "deepseek_v3",
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
];

/// An engine whose experts come from `tier` through a prefetcher.
fn prefetch_engine(
    model: Model,
    tier: &Arc<TierCache>,
    predictor: Predictor,
    threads: usize,
    trace: Option<std::path::PathBuf>,
) -> (Engine, Arc<Prefetcher>) {
    let pool = Arc::new(Pool::new(threads).unwrap());
    let options = PrefetchOptions {
        predictor,
        evaluate: true,
        trace,
        model_name: "test".into(),
        ..PrefetchOptions::default()
    };
    let prefetcher =
        Arc::new(Prefetcher::new(tier.clone(), &model, pool.clone(), &options).unwrap());
    let engine = Engine::with_pool(
        model,
        prefetcher.clone(),
        pool,
        Default::default(),
        &EngineOptions {
            threads,
            ..EngineOptions::default()
        },
    )
    .unwrap();
    (engine, prefetcher)
}

/// Waits until no read of the tier is in flight.
fn settle(tier: &TierCache) {
    let start = std::time::Instant::now();
    while tier.occupancy().iter().any(|o| o.loading > 0) {
        assert!(start.elapsed().as_secs() < 60, "reads never finished");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Every prefetch read ends used, wasted, cancelled before reaching the
/// drive, or still unclaimed in RAM (no read failed in these tests).
fn assert_prefetch_accounted(tier: &TierCache, what: &str) {
    settle(tier);
    let s = tier.stats();
    let unclaimed: usize = tier.occupancy().iter().map(|o| o.unclaimed).sum();
    assert_eq!(
        s.prefetch_reads,
        s.prefetch_used + s.prefetch_wasted + s.prefetch_cancelled_unissued + unclaimed as u64,
        "{what}: {s:?}, {unclaimed} unclaimed"
    );
    assert!(s.prefetch_used <= s.covered_misses(), "{what}: {s:?}");
    assert_eq!(s.read_errors, 0, "{what}");
}

#[test]
fn every_predictor_gives_identical_logits_and_tokens() {
    for name in FIXTURES {
        let dir = fixture(name);
        let r = reference(&dir);
        let want = logits_all(&resident_engine(&dir, 1), &r.tokens);
        let (_, probe) = open_tier(&dir, options(0, IoBackendChoice::Auto));
        let all = probe.plan().all_experts_bytes;
        drop(probe);
        let moe_layers = {
            let (_, t) = open_tier(&dir, options(0, IoBackendChoice::Auto));
            t.layout().moe_layers().count()
        };
        for budget in [0, all * 2 / 5, all] {
            for io in [IoBackendChoice::Uring, IoBackendChoice::Pread] {
                for threads in [1, 2] {
                    for predictor in Predictor::ALL {
                        let what =
                            format!("{name} budget {budget} {io} {threads} threads {predictor}");
                        let (model, tier) = open_tier(
                            &dir,
                            TierOptions {
                                prefetch_layers: 2,
                                ..options(budget, io)
                            },
                        );
                        let (engine, prefetcher) =
                            prefetch_engine(model, &tier, predictor, threads, None);
                        let got = logits_all(&engine, &r.tokens);
                        assert!(
                            got == want,
                            "{what}: logits differ from the resident oracle"
                        );
                        let tokens = greedy(&engine, &r.prompt, r.greedy.len(), &r.eos_masked);
                        assert_eq!(tokens, r.greedy, "{what}: greedy continuation");
                        let s = tier.stats();
                        // Nothing cached: every guess must be read (with a
                        // cache, the cross-token guesses may all be cached).
                        if moe_layers > 1 && budget == 0 {
                            assert!(s.prefetch_reads > 0, "{what}: {s:?}");
                        }
                        assert_eq!(
                            prefetcher.stats().scores.len(),
                            Predictor::ALL.len(),
                            "{what}: every predictor scored"
                        );
                        assert_prefetch_accounted(&tier, &what);
                        for o in tier.occupancy() {
                            assert_eq!(o.leased, 0, "{what}: {o:?}");
                            assert!(o.idle <= o.cache_slots, "{what}: {o:?}");
                        }
                        assert_eq!(tier.reader_counters().requests_failed, 0, "{what}");
                    }
                }
            }
        }
        eprintln!("{name}: identical with 4 predictors x 3 budgets x 2 backends x 2 thread counts");
    }
}

#[test]
fn engine_load_prefetches_by_default_and_not_when_off() {
    let dir = fixture("olmoe");
    let r = reference(&dir);
    let want = logits_all(&resident_engine(&dir, 1), &r.tokens);
    for enabled in [true, false] {
        let engine = Engine::load(
            &dir,
            &EngineOptions {
                threads: 2,
                tier: options(0, IoBackendChoice::Auto),
                prefetch: PrefetchOptions {
                    enabled,
                    ..PrefetchOptions::default()
                },
                ..EngineOptions::default()
            },
        )
        .unwrap();
        assert_eq!(engine.prefetcher.is_some(), enabled);
        let tier = engine.tier.clone().unwrap();
        let got = logits_all(&engine, &r.tokens);
        assert!(got == want, "prefetch {enabled}: logits differ");
        assert_eq!(
            greedy(&engine, &r.prompt, r.greedy.len(), &r.eos_masked),
            r.greedy
        );
        let s = tier.stats();
        assert_eq!(s.prefetch_reads > 0, enabled, "{s:?}");
        let source = engine.experts.stats();
        assert_eq!(
            source.prefetch_covered_misses + source.uncovered_misses,
            s.requests - (s.hits - s.prefetch_hits),
            "{source:?} {s:?}"
        );
        assert_eq!(source.prefetch_covered_misses > 0, enabled, "{source:?}");
    }
}

#[test]
fn a_demand_for_a_queued_prefetch_is_promoted() {
    let dir = fixture("olmoe");
    let slot = slot_bytes(&dir);
    let (_, tier) = open_tier(
        &dir,
        TierOptions {
            queue_depth: 1,
            ..options(8 * slot, IoBackendChoice::Auto)
        },
    );
    let l = tier.layout().moe_layers().next().unwrap();
    let hold = tier.hold_io().expect("hold");
    tier.prefetch(l, &[1, 2, 3]);
    assert_eq!(tier.stats().prefetch_reads, 3);
    let fetch = {
        let tier = tier.clone();
        std::thread::spawn(move || fetch_keep(tier.as_ref(), l, &[3]).len())
    };
    // The demand joins the queued prefetch read and has it promoted.
    let start = std::time::Instant::now();
    while tier.reader_counters().requests_promoted == 0 {
        assert!(start.elapsed().as_secs() < 60, "never promoted");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    drop(hold);
    assert_eq!(fetch.join().unwrap(), 1);
    let s = tier.stats();
    assert_eq!(s.prefetch_promoted, 1, "{s:?}");
    assert_eq!(s.joined_prefetch, 1, "{s:?}");
    assert_eq!(s.demand_reads, 0, "no second read of the expert: {s:?}");
    let reader = tier.reader_counters();
    assert_eq!(reader.requests_promoted, 1, "{reader:?}");
    assert_eq!(reader.reads_promoted, 1, "{reader:?}");
    assert_eq!(reader.requests_submitted, 3, "{reader:?}");
    // A prefetch nobody queued behind is not promoted; nor is one whose
    // read has finished.
    settle(&tier);
    fetch_keep(tier.as_ref(), l, &[1]);
    assert_eq!(tier.reader_counters().requests_promoted, 1);
    assert_eq!(tier.stats().prefetch_promoted, 1);
    assert_prefetch_accounted(&tier, "promotion");
}

#[test]
fn stale_predictions_are_cancelled_or_evicted() {
    let dir = fixture("olmoe");
    let slot = slot_bytes(&dir);
    let (_, tier) = open_tier(
        &dir,
        TierOptions {
            queue_depth: 1,
            ..options(8 * slot, IoBackendChoice::Auto)
        },
    );
    let l = tier.layout().moe_layers().next().unwrap();
    let read_bytes = tier.layout().records[tier.layout().entry(l, 1).unwrap()].read_bytes;
    // Queued (held) predictions are cancelled before reaching the drive.
    let hold = tier.hold_io().expect("hold");
    tier.prefetch(l, &[1, 2, 3]);
    assert_eq!(tier.cancel_prefetch(l, &[1, 2]), 2);
    drop(hold);
    settle(&tier);
    let s = tier.stats();
    assert_eq!(s.prefetch_cancelled, 2, "{s:?}");
    assert_eq!(s.prefetch_cancelled_unissued, 2, "{s:?}");
    assert_eq!(s.prefetch_wasted_bytes, 0, "{s:?}");
    assert_eq!(tier.reader_counters().requests_cancelled, 2);
    assert_eq!(tier.residency(l, 1), Some(Residency::Absent));
    assert_eq!(tier.residency(l, 2), Some(Residency::Absent));
    assert!(matches!(
        tier.residency(l, 3),
        Some(Residency::Resident { leases: 0, .. })
    ));
    // A landed, unused prediction is evicted: its bytes were wasted.
    assert_eq!(tier.cancel_prefetch(l, &[3]), 1);
    assert_eq!(tier.residency(l, 3), Some(Residency::Absent));
    let s = tier.stats();
    assert_eq!(s.prefetch_stale_evicted, 1, "{s:?}");
    assert_eq!(s.prefetch_wasted, 1, "{s:?}");
    assert_eq!(s.prefetch_wasted_bytes, read_bytes, "{s:?}");
    // Cached, leased and demanded experts are not predictions.
    fetch_order(tier.as_ref(), l, &[4]);
    let kept = fetch_keep(tier.as_ref(), l, &[5]);
    assert_eq!(tier.cancel_prefetch(l, &[4, 5, 6]), 0);
    assert!(matches!(
        tier.residency(l, 4),
        Some(Residency::Resident { leases: 0, .. })
    ));
    assert!(matches!(
        tier.residency(l, 5),
        Some(Residency::Resident { leases: 1, .. })
    ));
    drop(kept);
    // A prefetch a demand has joined is the demand's now.
    let hold = tier.hold_io().expect("hold");
    tier.prefetch(l, &[7]);
    let fetch = {
        let tier = tier.clone();
        std::thread::spawn(move || fetch_keep(tier.as_ref(), l, &[7]).len())
    };
    let start = std::time::Instant::now();
    while tier.stats().joined_prefetch == 0 {
        assert!(start.elapsed().as_secs() < 60, "never joined");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(tier.cancel_prefetch(l, &[7]), 0);
    drop(hold);
    assert_eq!(fetch.join().unwrap(), 1);
    // An expert wanted right after its prediction was cancelled is read on
    // demand, with its own bytes, whether or not the cancelled read was
    // still in flight.
    let resident = resident_experts(&dir);
    let want = fetch_keep(&resident, l, &[0]);
    tier.prefetch(l, &[0]);
    tier.cancel_prefetch(l, &[0]);
    let got = fetch_keep(tier.as_ref(), l, &[0]);
    assert_eq!(expert_bytes(&got[0].1), expert_bytes(&want[0].1));
    drop(got);
    assert_prefetch_accounted(&tier, "cancellation");
}

#[test]
fn prefetch_never_evicts_or_overwrites_what_the_current_layer_holds() {
    // One cache slot, two staging slots and two for prefetch: every
    // prediction competes for very few slots while the current layer's
    // experts are leased.
    let dir = fixture("qwen3_moe");
    let slot = slot_bytes(&dir);
    let (_, tier) = open_tier(
        &dir,
        TierOptions {
            queue_depth: 2,
            prefetch_layers: 1,
            policy: EvictionPolicy::Lru,
            ..options(slot, IoBackendChoice::Auto)
        },
    );
    let resident = resident_experts(&dir);
    let layers: Vec<usize> = tier.layout().moe_layers().collect();
    let n = tier.layout().experts_per_layer;
    let (l, other) = (layers[0], *layers.last().unwrap());
    let all: Vec<usize> = (0..n).collect();
    let want: Vec<_> = fetch_keep(&resident, l, &all)
        .into_iter()
        .map(|(_, w)| expert_bytes(&w))
        .collect();
    for round in 0..4 {
        let ids = [round % n, (round + 3) % n];
        let mut held = Vec::new();
        tier.fetch_with_prefetch(l, &ids, &[(other, all.clone())], &mut |e, w| {
            // While this layer "computes", more predictions arrive.
            tier.prefetch(other, &all);
            held.push((e, w));
            Ok(())
        })
        .unwrap();
        settle(&tier);
        tier.prefetch(other, &all);
        settle(&tier);
        for (e, w) in &held {
            assert_eq!(
                tier.residency(l, *e),
                Some(Residency::Resident {
                    leases: 1,
                    pinned: false,
                    evictable: false
                }),
                "round {round} expert {e}"
            );
            assert_eq!(expert_bytes(w), want[*e], "round {round} expert {e}");
        }
        // Stale predictions of the other layer go, as the prefetcher does
        // once that layer's routing is known.
        tier.cancel_prefetch(other, &all);
    }
    assert!(tier.stats().prefetch_reads > 0);
    assert_prefetch_accounted(&tier, "lease pressure");
}

fn header(moe_layers: Vec<usize>, num_layers: usize) -> TraceHeader {
    TraceHeader {
        colibri_routing_trace: 1,
        model: "scripted".into(),
        num_layers,
        moe_layers,
        experts_per_layer: 8,
        top_k: 2,
    }
}

fn record(step: u64, layer: usize, experts: &[usize], next: Option<&[usize]>) -> TraceRecord {
    TraceRecord {
        step,
        layer,
        rows: 1,
        experts: experts.to_vec(),
        router_next: next.map(<[usize]>::to_vec),
        router_second: None,
    }
}

#[test]
fn recall_and_waste_are_counted_exactly_on_scripted_routing() {
    // Three MoE layers, 8 experts, top-2, nothing cached; every prefetch
    // lands before the next fetch (settle), so the truth is known:
    //   layer 0 uses {0,1}; guesses {2,3} for layer 1
    //   layer 1 uses {2,4}: 2 covered, 4 not, 3 stale; guesses {5,6}
    //   layer 2 uses {5,6}: both covered.
    let trace = Trace {
        header: header(vec![0, 1, 2], 3),
        records: vec![
            record(1, 0, &[0, 1], Some(&[2, 3])),
            record(1, 1, &[2, 4], Some(&[5, 6])),
            record(1, 2, &[5, 6], None),
        ],
    };
    let work = tempfile::tempdir().unwrap();
    let experts = SyntheticExperts::for_trace(work.path(), &trace.header).unwrap();
    let config = ReplayConfig {
        predictor: Some(Predictor::Next),
        queue_depth: 4,
        ..ReplayConfig::default()
    };
    let report = replay(&trace, &experts, &config).unwrap();
    let s: TierStats = report.stats;
    assert_eq!(s.requests, 6);
    assert_eq!(s.prefetch_reads, 4, "{s:?}");
    assert_eq!(s.covered_misses(), 3, "{s:?}");
    assert_eq!(s.uncovered_misses(), 3, "{s:?}");
    assert_eq!(report.prefetch_recall, Some(0.5));
    assert_eq!(s.prefetch_used, 3, "{s:?}");
    assert_eq!(s.prefetch_wasted, 1, "{s:?}");
    assert_eq!(s.prefetch_stale_evicted, 1, "{s:?}");
    // All experts are the same size: one wasted byte per three used.
    assert_eq!(s.prefetch_wasted_bytes * 3, s.prefetch_used_bytes, "{s:?}");
    assert_eq!(report.prefetch_waste, Some(1.0 / 3.0));
    let next = report
        .scores
        .iter()
        .find(|x| x.predictor == Predictor::Next)
        .unwrap();
    assert_eq!((next.actual, next.predicted, next.correct), (4, 4, 3));

    // The same routing without prefetch: every miss uncovered.
    let off = replay(
        &trace,
        &experts,
        &ReplayConfig {
            predictor: None,
            ..config.clone()
        },
    )
    .unwrap();
    assert_eq!(off.stats.prefetch_reads, 0);
    assert_eq!(off.stats.demand_reads, 6);
    assert_eq!(off.prefetch_recall, Some(0.0));

    // Cross-token over two identical steps: step 2 is fully covered
    // (layers 1 and 2; layer 0 has no layer before it).
    let mut records = Vec::new();
    for step in 1..=2 {
        records.push(record(step, 0, &[0, 1], None));
        records.push(record(step, 1, &[2, 4], None));
        records.push(record(step, 2, &[5, 6], None));
    }
    let trace = Trace {
        header: trace.header.clone(),
        records,
    };
    let cross = replay(
        &trace,
        &experts,
        &ReplayConfig {
            predictor: Some(Predictor::CrossToken),
            ..config
        },
    )
    .unwrap();
    let s = cross.stats;
    assert_eq!(s.covered_misses(), 4, "{s:?}");
    assert_eq!(s.uncovered_misses(), 8, "{s:?}");
    assert_eq!(s.prefetch_wasted, 0, "{s:?}");
    assert_eq!(cross.prefetch_waste, Some(0.0));
}

#[test]
fn a_recorded_trace_replays_with_the_engines_routing() {
    let dir = fixture("qwen3_moe");
    let r = reference(&dir);
    let work = tempfile::tempdir().unwrap();
    let path = work.path().join("trace.jsonl");
    let (model, tier) = open_tier(
        &dir,
        TierOptions {
            prefetch_layers: 2,
            ..options(0, IoBackendChoice::Auto)
        },
    );
    let (engine, prefetcher) =
        prefetch_engine(model, &tier, Predictor::Next, 2, Some(path.clone()));
    let tokens = greedy(&engine, &r.prompt, r.greedy.len(), &r.eos_masked);
    assert_eq!(tokens, r.greedy);
    let live = prefetcher.stats();
    let requests = tier.stats().requests;
    drop(engine);
    drop(prefetcher);

    let trace = Trace::read(&path).unwrap();
    let moe: Vec<usize> = tier.layout().moe_layers().collect();
    assert_eq!(trace.header.moe_layers, moe);
    assert_eq!(trace.records.len() as u64, live.steps * moe.len() as u64);
    let routed: usize = trace.records.iter().map(|x| x.experts.len()).sum();
    assert_eq!(routed as u64, requests);
    for x in &trace.records {
        let last = x.layer == *moe.last().unwrap();
        assert_eq!(x.router_next.is_none(), last, "{x:?}");
    }
    // Replayed, the predictors score exactly as they did live.
    let experts = SyntheticExperts::for_trace(work.path(), &trace.header).unwrap();
    let report = replay(&trace, &experts, &ReplayConfig::default()).unwrap();
    assert_eq!(report.scores, live.scores);
    assert_eq!(report.steps, live.steps);
    assert_eq!(report.requests, requests);
}

#[test]
fn the_queue_depth_is_measured_once_per_device_and_cached() {
    use colibri_sched::tier::depth::{SWEEP_DEPTHS, measured_queue_depth};
    let work = tempfile::tempdir().unwrap();
    let experts = SyntheticExperts::create(work.path(), 4, &[1, 2, 3], 32, 4).unwrap();
    let tier = experts.open_tier(0, TierOptions::default()).unwrap();
    let cache = work.path().join("io");
    // Staging has room for two layers' guesses beside the queue depth.
    let planned = experts
        .open_tier(
            0,
            TierOptions {
                queue_depth: 4,
                prefetch_layers: 2,
                ..TierOptions::default()
            },
        )
        .unwrap();
    for c in &planned.plan().classes {
        assert_eq!(
            (c.staging_slots, c.prefetch_slots),
            (4 + 2 * 4, 2 * 4),
            "{c:?}"
        );
    }
    let first = measured_queue_depth(
        tier.files(),
        tier.layout(),
        IoBackendChoice::Auto,
        Some(&cache),
    )
    .unwrap();
    assert!(SWEEP_DEPTHS.contains(&first.queue_depth), "{first:?}");
    assert_eq!(first.points.len(), SWEEP_DEPTHS.len());
    let files: Vec<_> = std::fs::read_dir(&cache).unwrap().collect();
    assert_eq!(files.len(), 1);
    // The second time it is read from the cache (changed here to tell).
    let path = files[0].as_ref().unwrap().path();
    let mut cached: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    cached["queue_depth"] = 3.into();
    std::fs::write(&path, serde_json::to_vec(&cached).unwrap()).unwrap();
    let second = measured_queue_depth(
        tier.files(),
        tier.layout(),
        IoBackendChoice::Auto,
        Some(&cache),
    )
    .unwrap();
    assert_eq!(second.queue_depth, 3);
}

/// Greedy tokens of `prompt`.
fn greedy(engine: &Engine, prompt: &[u32], n: usize, eos: &[u32]) -> Vec<u32> {
    use colibri_model::sampling::SamplingParams;
    use colibri_sched::{GenRequest, Sequence};
    let mut seq = Sequence::new(
        &engine.model,
        GenRequest {
            prompt: prompt.to_vec(),
            max_tokens: n,
            sampling: SamplingParams::default(),
            stop: vec![],
            eos: eos.to_vec(),
            ignore_eos: true,
            top_logprobs: None,
        },
        4096,
        None,
    )
    .unwrap();
    let mut got = Vec::new();
    engine
        .generate(&mut seq, |ev| {
            got.push(ev.token);
            true
        })
        .unwrap();
    got
}
