//! Shared helpers: fixtures, references, tiers with fixed memory limits.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use colibri_io::IoBackendChoice;
use colibri_model::experts::ExpertWeights;
use colibri_model::source::ExpertLocator;
use colibri_model::{ExpertSource, KvCache, Logits, Model, ResidentExperts, SeqInput};
use colibri_sched::tier::{Footprint, MemoryLimits, TierCache, TierOptions, TierSetup, UsageMode};
use colibri_sched::{Engine, EngineOptions};

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/models")
        .join(name)
}

pub struct Reference {
    pub tokens: Vec<u32>,
    pub nll: Vec<f64>,
    pub prompt: Vec<u32>,
    pub greedy: Vec<u32>,
    /// Masked during the greedy decode (EOS), as `--ignore-eos` masks it.
    pub eos_masked: Vec<u32>,
}

pub fn reference(dir: &Path) -> Reference {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let ids = |k: &str| -> Vec<u32> {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    Reference {
        tokens: ids("tokens"),
        nll: v["nll"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect(),
        prompt: ids("prompt"),
        eos_masked: ids("eos_masked"),
        greedy: ids("greedy"),
    }
}

/// 8 GiB available, no cgroup: plans do not depend on the test machine.
pub fn fixed_memory() -> MemoryLimits {
    MemoryLimits {
        mem_available: Some(8 << 30),
        cgroup_limit: None,
        cgroup_file: None,
    }
}

/// Options with an explicit budget, no usage history, fixed memory.
pub fn options(budget: u64, io: IoBackendChoice) -> TierOptions {
    TierOptions {
        ram_budget: Some(budget),
        io,
        usage: UsageMode::Off,
        memory: Some(fixed_memory()),
        ..TierOptions::default()
    }
}

/// A tier over the fixture in `dir`, and the model's dense part.
/// A GGUF fixture file.
pub fn gguf(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/gguf")
        .join(name)
}

/// A tier over the model at `path` (a GGUF file or a packed store: no
/// `config.json` beside it).
pub fn tier_over(path: &Path, options: TierOptions) -> (Model, Arc<TierCache>) {
    let (model, src) = Model::load(path).unwrap();
    let locator: Arc<dyn ExpertLocator> = Arc::from(src.locator(&model.spec).unwrap());
    let setup = TierSetup {
        options,
        footprint: Footprint::of(&model.spec, &model.weights, 0),
        config_json: Vec::new(),
    };
    let tier = TierCache::open(&model.spec, locator, &setup).unwrap();
    (model, Arc::new(tier))
}

pub fn open_tier(dir: &Path, options: TierOptions) -> (Model, Arc<TierCache>) {
    let (model, src) = Model::load(dir).unwrap();
    let locator: Arc<dyn ExpertLocator> = Arc::from(src.locator(&model.spec).unwrap());
    let setup = TierSetup {
        options,
        footprint: Footprint::of(&model.spec, &model.weights, 0),
        config_json: std::fs::read(dir.join("config.json")).unwrap(),
    };
    let tier = TierCache::open(&model.spec, locator, &setup).unwrap();
    (model, Arc::new(tier))
}

pub fn engine_with(model: Model, experts: Arc<dyn ExpertSource>, threads: usize) -> Engine {
    Engine::new(
        model,
        experts,
        &EngineOptions {
            threads,
            tier: TierOptions {
                usage: UsageMode::Off,
                ..TierOptions::default()
            },
            ..EngineOptions::default()
        },
    )
    .unwrap()
}

/// The oracle: every expert memory-mapped.
pub fn resident_engine(dir: &Path, threads: usize) -> Engine {
    let (model, ck) = Model::load(dir).unwrap();
    let experts = ResidentExperts::load(&model.spec, &ck).unwrap();
    engine_with(model, Arc::new(experts), threads)
}

pub fn resident_experts(dir: &Path) -> ResidentExperts {
    let (model, ck) = Model::load(dir).unwrap();
    ResidentExperts::load(&model.spec, &ck).unwrap()
}

/// One sequence's forward pass over `tokens` with `cache`.
pub fn forward(engine: &Engine, cache: &mut KvCache, tokens: &[u32], logits: Logits) -> Vec<f32> {
    engine
        .model
        .forward(
            &engine.pool,
            engine.experts.as_ref(),
            &mut [SeqInput {
                cache,
                tokens,
                logits,
            }],
        )
        .unwrap()
        .remove(0)
}

/// Logits after every token of `tokens` in one forward pass.
pub fn logits_all(engine: &Engine, tokens: &[u32]) -> Vec<f32> {
    let mut cache = KvCache::new(&engine.model.spec, 4096);
    forward(engine, &mut cache, tokens, Logits::All)
}

/// Fetches `ids` and returns the order they were delivered in.
pub fn fetch_order(source: &dyn ExpertSource, layer: usize, ids: &[usize]) -> Vec<usize> {
    let mut order = Vec::new();
    source
        .fetch(layer, ids, &mut |e, _| {
            order.push(e);
            Ok(())
        })
        .unwrap();
    order
}

/// Fetches `ids` and keeps the weights (holding their leases).
pub fn fetch_keep(
    source: &dyn ExpertSource,
    layer: usize,
    ids: &[usize],
) -> Vec<(usize, Arc<ExpertWeights>)> {
    let mut kept = Vec::new();
    source
        .fetch(layer, ids, &mut |e, w| {
            kept.push((e, w));
            Ok(())
        })
        .unwrap();
    kept
}

/// The bytes of an expert's three matrices.
pub fn expert_bytes(w: &ExpertWeights) -> [Vec<u8>; 3] {
    [
        w.gate.data().as_slice().to_vec(),
        w.up.data().as_slice().to_vec(),
        w.down.data().as_slice().to_vec(),
    ]
}

/// Copies a fixture into a fresh temporary directory.
pub fn copy_fixture(name: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), tmp.path().join(entry.file_name())).unwrap();
    }
    tmp
}

/// Slot bytes of the fixture's (single) size class.
pub fn slot_bytes(dir: &Path) -> u64 {
    let (_, tier) = open_tier(dir, options(0, IoBackendChoice::Auto));
    let classes = &tier.plan().classes;
    assert_eq!(classes.len(), 1, "fixture with one size class expected");
    classes[0].slot_bytes
}

/// Logits after each of `tokens` fed one at a time (decode steps: the
/// one-token products).
pub fn logits_stepwise(engine: &Engine, tokens: &[u32]) -> Vec<f32> {
    let mut cache = KvCache::new(&engine.model.spec, 4096);
    tokens
        .iter()
        .flat_map(|t| forward(engine, &mut cache, std::slice::from_ref(t), Logits::Last))
        .collect()
}
