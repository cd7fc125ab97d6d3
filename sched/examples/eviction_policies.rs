//! Which eviction policy serves the fixtures' routing better: LRU or
//! segmented LRU (the frequency-aware variant), measured with the real tier
//! and compared with Belady's optimum on the same trace.
//!
//! ```text
//! cargo run --release -p colibri-sched --example eviction_policies
//! ```
//!
//! Each fixture decodes several sampled continuations (one after another,
//! the cache staying warm between them, as a server's would) at cache sizes
//! of 25%, 50% and 75% of its routed experts. The fixtures are tiny random
//! models: their routing is what it is, not a real model's; the point is to
//! choose on measured routing rather than on i.i.d. assumptions.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};

use colibri_io::IoBackendChoice;
use colibri_model::experts::ExpertWeights;
use colibri_model::sampling::SamplingParams;
use colibri_model::{ExpertSource, Model, ModelError};
use colibri_sched::tier::{
    EvictionPolicy, Footprint, MemoryLimits, TierCache, TierOptions, TierSetup, UsageMode,
};
use colibri_sched::{Engine, EngineOptions, GenRequest, Sequence};

const FIXTURES: [&str; 7] = [
    "deepseek_v3",
    "deepseek_v3_fp8",
    "qwen3_moe",
    "qwen3_moe_bf16_sharded",
    "qwen2_moe",
    "mixtral",
    "olmoe",
];
const SEQUENCES: u64 = 6;
const TOKENS: usize = 200;

/// Records every fetch (layer, ids) and passes it on.
struct Recorder {
    inner: Arc<TierCache>,
    trace: Mutex<Vec<(usize, Vec<usize>)>>,
}

impl ExpertSource for Recorder {
    fn fetch(
        &self,
        layer: usize,
        ids: &[usize],
        ready: &mut dyn FnMut(usize, Arc<ExpertWeights>) -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        if let Ok(mut t) = self.trace.lock() {
            t.push((layer, ids.to_vec()));
        }
        self.inner.fetch(layer, ids, ready)
    }
}

/// Hit rate of (approximately) Belady's optimum: after each fetch, keep the
/// `capacity` experts whose next use is soonest.
fn belady(trace: &[(usize, Vec<usize>)], capacity: usize) -> f64 {
    let keys: Vec<Vec<(usize, usize)>> = trace
        .iter()
        .map(|(l, ids)| ids.iter().map(|&e| (*l, e)).collect())
        .collect();
    // next_use[i][j]: the fetch index where keys[i][j] is used next.
    let mut next_seen: HashMap<(usize, usize), usize> = HashMap::new();
    let mut next_use = vec![Vec::new(); keys.len()];
    for i in (0..keys.len()).rev() {
        next_use[i] = keys[i]
            .iter()
            .map(|k| next_seen.get(k).copied().unwrap_or(usize::MAX))
            .collect();
        for k in &keys[i] {
            next_seen.insert(*k, i);
        }
    }
    let mut cache: HashMap<(usize, usize), usize> = HashMap::new();
    let (mut hits, mut total) = (0u64, 0u64);
    for (i, ks) in keys.iter().enumerate() {
        for (j, k) in ks.iter().enumerate() {
            total += 1;
            if cache.contains_key(k) {
                hits += 1;
            }
            cache.insert(*k, next_use[i][j]);
        }
        while cache.len() > capacity {
            let (&victim, _) = cache
                .iter()
                .max_by_key(|(k, n)| (**n, **k))
                .unwrap_or_else(|| unreachable!("non-empty cache"));
            cache.remove(&victim);
        }
    }
    hits as f64 / total.max(1) as f64
}

fn run(dir: &Path, policy: EvictionPolicy, slots: usize) -> (f64, Vec<(usize, Vec<usize>)>) {
    let (model, ck) = Model::load(dir).expect("model");
    let locator = ck.locator(&model.spec).expect("locator");
    let options = TierOptions {
        ram_budget: Some(0),
        policy,
        usage: UsageMode::Off,
        io: IoBackendChoice::Auto,
        memory: Some(MemoryLimits {
            mem_available: Some(8 << 30),
            ..MemoryLimits::default()
        }),
        ..TierOptions::default()
    };
    let setup = TierSetup {
        footprint: Footprint::of(&model.spec, &model.weights, 0),
        config_json: std::fs::read(dir.join("config.json")).expect("config"),
        options: options.clone(),
    };
    // Size the budget in slots of the (single) class.
    let probe = TierCache::open(&model.spec, Arc::from(locator), &setup).expect("tier");
    let slot = probe.plan().classes[0].slot_bytes;
    drop(probe);
    let locator = ck.locator(&model.spec).expect("locator");
    let setup = TierSetup {
        options: TierOptions {
            ram_budget: Some(slot * slots as u64),
            ..options
        },
        ..setup
    };
    let tier = Arc::new(TierCache::open(&model.spec, Arc::from(locator), &setup).expect("tier"));
    let recorder = Arc::new(Recorder {
        inner: tier.clone(),
        trace: Mutex::new(Vec::new()),
    });
    let engine = Engine::new(
        model,
        recorder.clone(),
        &EngineOptions {
            threads: 1,
            ..EngineOptions::default()
        },
    )
    .expect("engine");
    let reference: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("reference.json")).expect("reference"),
    )
    .expect("json");
    let prompt: Vec<u32> = reference["prompt"]
        .as_array()
        .expect("prompt")
        .iter()
        .filter_map(|v| v.as_u64().map(|x| x as u32))
        .collect();
    for seed in 0..SEQUENCES {
        let mut seq = Sequence::new(
            &engine.model,
            GenRequest {
                prompt: prompt.clone(),
                max_tokens: TOKENS,
                sampling: SamplingParams {
                    temperature: 1.0,
                    seed: Some(seed),
                    ..SamplingParams::default()
                },
                stop: vec![],
                eos: vec![],
                ignore_eos: true,
                top_logprobs: None,
            },
            256,
            None,
        )
        .expect("sequence");
        engine.generate(&mut seq, |_| true).expect("generate");
    }
    let stats = tier.stats();
    let trace = recorder.trace.lock().map(|t| t.clone()).unwrap_or_default();
    (stats.hit_rate(), trace)
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models");
    println!("fixture                 experts  cache   LRU     SLRU    Belady  distinct/step");
    let mut sums = [0.0f64; 3];
    let mut n = 0;
    for name in FIXTURES {
        let dir = root.join(name);
        let (model, _) = Model::load(&dir).expect("model");
        let moe = model.spec.moe.as_ref().expect("moe");
        let layers = model
            .spec
            .layers
            .iter()
            .filter(|l| l.ffn == colibri_model::config::FfnKind::Moe)
            .count();
        let routed = layers * moe.num_experts;
        for share in [0.25, 0.5, 0.75] {
            let slots = ((routed as f64) * share).round() as usize;
            let (lru, trace) = run(&dir, EvictionPolicy::Lru, slots);
            let (slru, _) = run(&dir, EvictionPolicy::Slru, slots);
            let opt = belady(&trace, slots);
            let distinct: HashSet<(usize, usize)> = trace
                .iter()
                .flat_map(|(l, ids)| ids.iter().map(|&e| (*l, e)))
                .collect();
            let per_step =
                trace.iter().map(|(_, ids)| ids.len()).sum::<usize>() as f64 / trace.len() as f64;
            println!(
                "{name:<22} {routed:>7} {:>5.0}%  {:>6.1}% {:>6.1}% {:>6.1}%  {}/{per_step:.2}",
                share * 100.0,
                lru * 100.0,
                slru * 100.0,
                opt * 100.0,
                distinct.len()
            );
            sums[0] += lru;
            sums[1] += slru;
            sums[2] += opt;
            n += 1;
        }
    }
    let n = n as f64;
    println!(
        "mean                                    {:>6.1}% {:>6.1}% {:>6.1}%",
        sums[0] / n * 100.0,
        sums[1] / n * 100.0,
        sums[2] / n * 100.0
    );
}
