//! Principle 2: the tier never changes what is computed. Every fixture, at
//! budgets from zero cached experts through partial to everything cached,
//! with io_uring and pread, with 1 and 2 compute threads (and with a
//! prefetching caller), gives bit-identical logits to the memory-mapped
//! oracle and reproduces transformers' greedy continuation and NLL.

use std::sync::Arc;

use colibri_io::IoBackendChoice;
use colibri_model::experts::ExpertWeights;
use colibri_model::sampling::SamplingParams;
use colibri_model::{ExpertSource, ModelError};
use colibri_sched::tier::TierCache;
use colibri_sched::{GenRequest, Sequence};

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

const NLL_REL_TOL: f64 = 1e-4;

/// A caller that guesses the next MoE layer will want the same experts and
/// prefetches them before fetching this layer's: exercises prefetch reads
/// joined by demand, and prefetches nobody uses.
struct SameIdsPrefetcher {
    tier: Arc<TierCache>,
    next_moe: Vec<Option<usize>>,
}

impl ExpertSource for SameIdsPrefetcher {
    fn fetch(
        &self,
        layer: usize,
        ids: &[usize],
        ready: &mut dyn FnMut(usize, Arc<ExpertWeights>) -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        if let Some(Some(next)) = self.next_moe.get(layer) {
            self.tier.prefetch(*next, ids);
        }
        self.tier.fetch(layer, ids, ready)
    }
}

fn greedy(engine: &colibri_sched::Engine, prompt: &[u32], n: usize, eos: &[u32]) -> Vec<u32> {
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

#[test]
fn every_budget_backend_and_thread_count_gives_identical_logits() {
    for name in FIXTURES {
        let dir = fixture(name);
        let r = reference(&dir);
        let want = logits_all(&resident_engine(&dir, 1), &r.tokens);
        let (_, probe) = open_tier(&dir, options(0, IoBackendChoice::Auto));
        let all = probe.plan().all_experts_bytes;
        let routed = probe.plan().routed_experts;
        drop(probe);
        for budget in [0, all * 2 / 5, all, 1 << 40] {
            for io in [IoBackendChoice::Uring, IoBackendChoice::Pread] {
                for threads in [1, 2] {
                    let what = format!("{name} budget {budget} of {all} {io} {threads} threads");
                    let (model, tier) = open_tier(&dir, options(budget, io));
                    let plan = tier.plan().clone();
                    assert!(plan.committed_bytes() <= budget, "{what}");
                    let engine = engine_with(model, tier.clone(), threads);
                    let got = logits_all(&engine, &r.tokens);
                    assert!(
                        got == want,
                        "{what}: logits differ from the resident oracle"
                    );

                    let tokens = greedy(&engine, &r.prompt, r.greedy.len(), &r.eos_masked);
                    assert_eq!(tokens, r.greedy, "{what}: greedy continuation");

                    let score = engine.score(&r.tokens, |_, _| {}).unwrap();
                    for (i, (g, w)) in score.nll.iter().zip(&r.nll).enumerate() {
                        assert!(
                            (g - w).abs() / w.abs() < NLL_REL_TOL,
                            "{what}: position {i}: nll {g} vs {w}"
                        );
                    }

                    let stats = tier.stats();
                    assert!(stats.requests > 0, "{what}");
                    if budget == 0 {
                        // Nothing is kept: every request is a read.
                        assert_eq!(stats.hits, 0, "{what}");
                        assert_eq!(stats.demand_reads, stats.requests, "{what}");
                    }
                    if budget >= all {
                        // Everything is kept: each expert is read once.
                        assert!(stats.demand_reads as usize <= routed, "{what}");
                        assert_eq!(stats.evictions, 0, "{what}");
                    }
                    let occupancy = tier.occupancy();
                    for (c, o) in occupancy.iter().enumerate() {
                        assert!(o.idle <= o.cache_slots, "{what}: class {c}: {o:?}");
                        assert_eq!(o.leased + o.loading, 0, "{what}: class {c}: {o:?}");
                    }
                    assert_eq!(tier.reader_counters().requests_failed, 0, "{what}");
                    drop(engine);
                }
            }
        }
        eprintln!("{name}: identical at 4 budgets x 2 backends x 2 thread counts");
    }
}

#[test]
fn prefetching_callers_get_identical_logits() {
    for name in FIXTURES {
        let dir = fixture(name);
        let r = reference(&dir);
        let want = logits_all(&resident_engine(&dir, 2), &r.tokens);
        let (_, probe) = open_tier(&dir, options(0, IoBackendChoice::Auto));
        let all = probe.plan().all_experts_bytes;
        drop(probe);
        for budget in [0, all / 3] {
            let (model, tier) = open_tier(&dir, options(budget, IoBackendChoice::Auto));
            let layers = model.spec.num_layers();
            let moe: Vec<usize> = tier.layout().moe_layers().collect();
            let next_moe = (0..layers)
                .map(|l| moe.iter().copied().find(|&m| m > l))
                .collect();
            let source = Arc::new(SameIdsPrefetcher {
                tier: tier.clone(),
                next_moe,
            });
            let engine = engine_with(model, source, 2);
            let got = logits_all(&engine, &r.tokens);
            assert!(
                got == want,
                "{name} budget {budget}: prefetch changed the logits"
            );
            assert_eq!(
                greedy(&engine, &r.prompt, r.greedy.len(), &r.eos_masked),
                r.greedy,
                "{name} budget {budget}"
            );
            let stats = tier.stats();
            if moe.len() > 1 {
                assert!(
                    stats.prefetch_reads > 0,
                    "{name} budget {budget}: {stats:?}"
                );
            }
        }
    }
}

/// A source that hands out its inner source's experts one per group (the
/// trait's default `fetch_groups`), as a tier does for reads completing
/// one at a time.
struct OneByOne(Arc<dyn ExpertSource>);

impl ExpertSource for OneByOne {
    fn fetch(
        &self,
        layer: usize,
        ids: &[usize],
        ready: &mut dyn FnMut(usize, Arc<ExpertWeights>) -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        self.0.fetch(layer, ids, ready)
    }
}

/// A decode step computes a group of experts in two pool jobs, or one
/// expert at a time as they arrive: the same bits either way, on dense
/// float, FP8 and Q4_0 (tiled) experts, with 1 and 3 threads.
#[test]
fn grouped_and_one_by_one_experts_decode_the_same_bits() {
    let gguf = |n: &str| {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/gguf")
            .join(n)
    };
    for path in [
        fixture("qwen3_moe"),
        fixture("deepseek_v3_fp8"),
        gguf("qwen3_moe.q4_0.gguf"),
    ] {
        for threads in [1, 3] {
            let steps = |one_by_one: bool| {
                let (model, src) = colibri_model::Model::load(&path).unwrap();
                let resident: Arc<dyn ExpertSource> =
                    Arc::new(colibri_model::ResidentExperts::load(&model.spec, &src).unwrap());
                let experts: Arc<dyn ExpertSource> = if one_by_one {
                    Arc::new(OneByOne(resident))
                } else {
                    resident
                };
                let engine = engine_with(model, experts, threads);
                let mut cache = colibri_model::KvCache::new(&engine.model.spec, 64);
                let mut out = Vec::new();
                for t in [5u32, 17, 2, 9, 30, 4] {
                    let logits = engine
                        .model
                        .forward(
                            &engine.pool,
                            engine.experts.as_ref(),
                            &mut [colibri_model::SeqInput {
                                cache: &mut cache,
                                tokens: &[t],
                                logits: colibri_model::Logits::All,
                            }],
                        )
                        .unwrap()
                        .remove(0);
                    out.extend(logits.iter().map(|v| v.to_bits()));
                }
                out
            };
            assert_eq!(
                steps(false),
                steps(true),
                "{}, {threads} threads",
                path.display()
            );
        }
    }
}

/// llama.cpp's k-quant layouts (experts in Q2_K to Q5_K or IQ4_XS, the head in Q6_K,
/// a synthetic Qwen3-MoE GGUF): streamed through the tier at every budget,
/// with either reader and thread count, the logits are the memory-mapped
/// oracle's bit for bit.
#[test]
fn k_quant_experts_stream_with_identical_logits() {
    use colibri_model::convert::{Silent, cast::Quant};
    use colibri_model::format::WeightFormat;
    use colibri_model::source::ExpertLocator;
    use colibri_model::synth::{self, SynthFormat, SynthSource};
    use colibri_model::{Model, ResidentExperts};
    use colibri_sched::tier::{Footprint, TierSetup};

    let mut config = synth::config(Some("qwen3-30b-a3b"), None, Some(2)).unwrap();
    for (k, v) in [
        ("hidden_size", 256),
        ("intermediate_size", 512),
        ("moe_intermediate_size", 256),
        ("num_experts", 8),
        ("num_experts_per_tok", 2),
        ("num_attention_heads", 4),
        ("num_key_value_heads", 2),
        ("head_dim", 64),
        ("vocab_size", 1024),
    ] {
        config[k] = serde_json::json!(v);
    }
    let dir = tempfile::tempdir().unwrap();
    let tokens: Vec<u32> = (0..24).map(|i| (i * 37 + 11) % 1024).collect();
    // Q4_K_M: layer 1's down projections in Q6_K, so the layers' experts
    // differ in size and an expert mixes formats.
    // Q2_K, Q3_K, Q4_K and Q5_K experts go into panels in place
    // (`panels_run_here`); the others (IQ4_XS, and Q4_K_M's Q6_K down
    // projections) stay row-major.
    for (name, format) in [
        ("q4_k", Some(WeightFormat::Q4K)),
        ("q5_k", Some(WeightFormat::Q5K)),
        ("q4_k_m", None),
        ("q2_k", Some(WeightFormat::Q2K)),
        ("q3_k", Some(WeightFormat::Q3K)),
        ("iq4_xs", Some(WeightFormat::Iq4Xs)),
    ] {
        let src = SynthSource::new(config.clone(), 9).unwrap();
        let src = match format {
            Some(f) => src.with_experts(f),
            None => src.with_q4_k_m_experts(),
        }
        .with_head(WeightFormat::Q6K);
        let path = dir.path().join(format!("{name}.gguf"));
        synth::write(&src, Quant::Q4_0, SynthFormat::Gguf, &path, &Silent).unwrap();
        let oracle = {
            let (model, ck) = Model::load(&path).unwrap();
            let experts = ResidentExperts::load(&model.spec, &ck).unwrap();
            logits_all(&engine_with(model, Arc::new(experts), 1), &tokens)
        };
        let open = |budget: u64, io| {
            let (model, ck) = Model::load(&path).unwrap();
            let locator: Arc<dyn ExpertLocator> = Arc::from(ck.locator(&model.spec).unwrap());
            let setup = TierSetup {
                options: options(budget, io),
                footprint: Footprint::of(&model.spec, &model.weights, 0),
                config_json: b"{}".to_vec(),
            };
            let tier = Arc::new(TierCache::open(&model.spec, locator, &setup).unwrap());
            (model, tier)
        };
        let all = open(0, IoBackendChoice::Auto).1.plan().all_experts_bytes;
        for budget in [0, all / 3, 1 << 40] {
            for io in [IoBackendChoice::Uring, IoBackendChoice::Pread] {
                for threads in [1, 2] {
                    let what = format!("{name} budget {budget} of {all} {io} {threads} threads");
                    let (model, tier) = open(budget, io);
                    let engine = engine_with(model, tier.clone(), threads);
                    assert!(
                        logits_all(&engine, &tokens) == oracle,
                        "{what}: logits differ"
                    );
                    let stats = tier.stats();
                    assert!(stats.demand_reads > 0, "{what}: nothing was read");
                    assert_eq!(tier.reader_counters().requests_failed, 0, "{what}");
                }
            }
        }
    }
}
