//! Routing traces replayed through the real tier and prefetch logic, without
//! the model and without its disk: recall, waste and hit rate of every
//! predictor at any cache size, offline.
//!
//! [`SyntheticExperts`] writes a small file with one tiny expert per
//! (layer, expert) of the trace's geometry and locates them, so a
//! [`TierCache`] runs over it exactly as over a checkpoint: same slots,
//! eviction, single flight, leases, prefetch slots, cancellation and
//! counters. [`replay`] then feeds it the trace the way the forward pass
//! feeds the prefetcher: per MoE layer, the guesses ([`PrefetchLogic::observe`]
//! on the recorded router outputs), the stale ones dropped
//! ([`PrefetchLogic::routed`]), and the fetch with the guesses riding along.
//!
//! With `settle`, each layer's prefetch reads are waited for before the
//! next layer's fetch: the case where compute fully hides the reads, which
//! makes the figures deterministic and an upper bound of what prefetch can
//! do. Without it, the reads race the fetches as fast as the replay runs
//! (no compute at all): a lower bound.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use colibri_io::{DirectIo, IoBackendChoice};
use colibri_model::format::WeightFormat;
use colibri_model::source::{ExpertLocation, ExpertLocator, Extent, MatrixLocation};
use colibri_model::{ModelError, ModelSpec};
use serde::Serialize;

use super::logic::{Predictor, PredictorScore, PrefetchLogic};
use super::trace::{Trace, TraceHeader};
use crate::tier::{
    ExpertLayout, FileFacts, Footprint, MemoryLimits, TierCache, TierError, TierOptions, TierSetup,
    TierStats, UsageMode,
};

/// Rows and columns of each synthetic matrix (f32): 3 × 1 KiB per expert.
const SYNTHETIC_DIM: usize = 16;

/// How long settling waits for reads before giving up (a stuck read is a
/// bug, never a silent hang).
const SETTLE_LIMIT: Duration = Duration::from_secs(60);

/// Locates the experts of a synthetic file: expert `(l, x)` is three
/// `SYNTHETIC_DIM²` f32 matrices at a fixed place.
struct SyntheticLocator {
    files: Vec<PathBuf>,
    base: Vec<Option<usize>>,
    experts: usize,
}

impl ExpertLocator for SyntheticLocator {
    fn files(&self) -> &[PathBuf] {
        &self.files
    }

    fn locate(&self, layer: usize, expert: usize) -> Result<ExpertLocation, ModelError> {
        let missing = || ModelError::Expert {
            layer,
            expert,
            reason: "not in the synthetic expert file".into(),
        };
        let base = self
            .base
            .get(layer)
            .copied()
            .flatten()
            .ok_or_else(missing)?;
        if expert >= self.experts {
            return Err(missing());
        }
        let matrix = (SYNTHETIC_DIM * SYNTHETIC_DIM * 4) as u64;
        let start = (base + expert) as u64 * 3 * matrix;
        let m = |i: u64| MatrixLocation {
            extent: Extent {
                file: 0,
                offset: start + i * matrix,
                len: matrix,
            },
            rows: SYNTHETIC_DIM,
            cols: SYNTHETIC_DIM,
            format: WeightFormat::F32,
            scales: None,
        };
        Ok(ExpertLocation {
            layer,
            expert,
            gate: m(0),
            up: m(1),
            down: m(2),
            record: None,
        })
    }
}

/// A file of tiny experts with a trace's geometry, for replays and tests.
pub struct SyntheticExperts {
    spec: ModelSpec,
    locator: Arc<SyntheticLocator>,
}

impl SyntheticExperts {
    /// Writes `dir/synthetic-experts.bin` for `num_layers` layers whose MoE
    /// layers are `moe_layers`, `experts` experts each, `top_k` chosen per
    /// token.
    pub fn create(
        dir: &Path,
        num_layers: usize,
        moe_layers: &[usize],
        experts: usize,
        top_k: usize,
    ) -> Result<SyntheticExperts, TierError> {
        let invalid = |why: String| TierError::Model(ModelError::Invalid(why));
        if num_layers == 0 || experts == 0 || top_k == 0 || top_k > experts {
            return Err(invalid(format!(
                "synthetic experts: {num_layers} layers, {experts} experts, top-k {top_k}"
            )));
        }
        if moe_layers.is_empty() || moe_layers.iter().any(|&l| l >= num_layers) {
            return Err(invalid(format!(
                "synthetic experts: MoE layers {moe_layers:?} of {num_layers}"
            )));
        }
        let dense: Vec<usize> = (0..num_layers)
            .filter(|l| !moe_layers.contains(l))
            .collect();
        let config = serde_json::json!({
            "model_type": "qwen3_moe",
            "hidden_size": SYNTHETIC_DIM,
            "intermediate_size": SYNTHETIC_DIM,
            "moe_intermediate_size": SYNTHETIC_DIM,
            "num_hidden_layers": num_layers,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "num_experts": experts,
            "num_experts_per_tok": top_k,
            "mlp_only_layers": dense,
            "vocab_size": 16,
            "max_position_embeddings": 64,
        });
        let spec = ModelSpec::from_json(&config)?;
        let mut base = vec![None; num_layers];
        for (i, &l) in moe_layers.iter().enumerate() {
            base[l] = Some(i * experts);
        }
        let path = dir.join("synthetic-experts.bin");
        let matrix = SYNTHETIC_DIM * SYNTHETIC_DIM * 4;
        let len = moe_layers.len() * experts * 3 * matrix;
        // Distinct bytes per expert (never zeros), so a test can tell them
        // apart.
        let bytes: Vec<u8> = (0..len)
            .map(|i| {
                ((i / (3 * matrix)) as u8)
                    .wrapping_mul(31)
                    .wrapping_add((i as u8).wrapping_add(7))
            })
            .collect();
        std::fs::write(&path, bytes).map_err(|e| TierError::Model(ModelError::io(&path, e)))?;
        Ok(SyntheticExperts {
            spec,
            locator: Arc::new(SyntheticLocator {
                files: vec![path],
                base,
                experts,
            }),
        })
    }

    /// The geometry of a trace.
    pub fn for_trace(dir: &Path, header: &TraceHeader) -> Result<SyntheticExperts, TierError> {
        Self::create(
            dir,
            header.num_layers,
            &header.moe_layers,
            header.experts_per_layer,
            header.top_k,
        )
    }

    /// The spec of the synthetic model.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// Slot bytes of one expert.
    pub fn slot_bytes(&self) -> Result<u64, TierError> {
        let files = colibri_io::FileSet::open(self.locator.files(), DirectIo::Off)?;
        let layout =
            ExpertLayout::build(&self.spec, self.locator.as_ref(), &FileFacts::of(&files))?;
        Ok(layout.classes.first().map_or(0, |c| c.slot_bytes))
    }

    /// A tier over the synthetic file with room for `cache_slots` cached
    /// experts (buffered reads, no usage history, memory not probed).
    pub fn open_tier(
        &self,
        cache_slots: usize,
        options: TierOptions,
    ) -> Result<TierCache, TierError> {
        let slot = self.slot_bytes()?;
        let setup = TierSetup {
            options: TierOptions {
                ram_budget: Some(cache_slots as u64 * slot),
                pin_budget: Some(0),
                usage: UsageMode::Off,
                direct: DirectIo::Off,
                memory: Some(MemoryLimits {
                    mem_available: Some(1 << 40),
                    cgroup_limit: None,
                    cgroup_file: None,
                }),
                ..options
            },
            footprint: Footprint::default(),
            config_json: Vec::new(),
        };
        TierCache::open(&self.spec, self.locator.clone(), &setup)
    }
}

/// One replay's settings.
#[derive(Clone, Debug)]
pub struct ReplayConfig {
    /// `None`: no prefetch (the baseline).
    pub predictor: Option<Predictor>,
    /// Cached experts, as a share of all routed experts.
    pub cache_fraction: f64,
    /// Reader queue depth (also the demand staging slots).
    pub queue_depth: usize,
    /// MoE layers' worth of prefetch slots (as the engine plans them).
    pub prefetch_layers: usize,
    /// Wait for each layer's prefetch reads before the next fetch.
    pub settle: bool,
    pub io: IoBackendChoice,
}

impl Default for ReplayConfig {
    fn default() -> Self {
        ReplayConfig {
            predictor: Some(Predictor::default()),
            cache_fraction: 0.0,
            queue_depth: 16,
            prefetch_layers: 2,
            settle: true,
            io: IoBackendChoice::Auto,
        }
    }
}

/// What one replay measured.
#[derive(Clone, Debug, Serialize)]
pub struct ReplayReport {
    /// `None`: prefetch off.
    pub predictor: Option<Predictor>,
    pub cache_fraction: f64,
    pub cache_slots: usize,
    pub settle: bool,
    pub steps: u64,
    /// Experts requested, and the share found in RAM (cached or
    /// prefetched).
    pub requests: u64,
    pub hit_rate: f64,
    /// The share found cached without prefetch's help.
    pub cache_hit_rate: f64,
    /// Expert reads per step (demand + prefetch).
    pub reads_per_step: f64,
    pub prefetch_recall: Option<f64>,
    pub prefetch_waste: Option<f64>,
    pub stats: TierStats,
    /// Set scores of every predictor on this trace (cache-independent).
    pub scores: Vec<PredictorScore>,
}

/// Replays `trace` through a fresh tier over `experts` (created for the
/// trace's geometry).
pub fn replay(
    trace: &Trace,
    experts: &SyntheticExperts,
    config: &ReplayConfig,
) -> Result<ReplayReport, TierError> {
    let h = &trace.header;
    let all = h.moe_layers.len() * h.experts_per_layer;
    let cache_slots = ((all as f64) * config.cache_fraction.clamp(0.0, 1.0)).round() as usize;
    let tier = experts.open_tier(
        cache_slots,
        TierOptions {
            io: config.io,
            queue_depth: config.queue_depth.max(1),
            prefetch_layers: if config.predictor.is_some() {
                config.prefetch_layers
            } else {
                0
            },
            ..TierOptions::default()
        },
    )?;
    let mut logic = PrefetchLogic::new(
        h.num_layers,
        &h.moe_layers,
        config.predictor.unwrap_or_default(),
        true,
    );
    for r in &trace.records {
        let guesses = logic.observe(
            r.layer,
            r.router_next.as_deref(),
            r.router_second.as_deref(),
        );
        let stale = logic.routed(r.layer, &r.experts);
        let guesses = match config.predictor {
            Some(_) => {
                tier.cancel_prefetch(r.layer, &stale);
                guesses
            }
            None => Vec::new(),
        };
        tier.fetch_with_prefetch(r.layer, &r.experts, &guesses, &mut |_, _| Ok(()))?;
        if config.settle {
            settle(&tier)?;
        }
    }
    let stats = tier.stats();
    let steps = logic.steps();
    Ok(ReplayReport {
        predictor: config.predictor,
        cache_fraction: config.cache_fraction,
        cache_slots: tier.plan().cache_slots(),
        settle: config.settle,
        steps,
        requests: stats.requests,
        hit_rate: stats.hit_rate(),
        cache_hit_rate: if stats.requests > 0 {
            (stats.hits - stats.prefetch_hits) as f64 / stats.requests as f64
        } else {
            0.0
        },
        reads_per_step: (stats.demand_reads + stats.prefetch_reads) as f64 / steps.max(1) as f64,
        prefetch_recall: stats.prefetch_recall(),
        prefetch_waste: stats.prefetch_waste(),
        stats,
        scores: logic.scores(),
    })
}

/// Waits until no expert of the tier is being read.
fn settle(tier: &TierCache) -> Result<(), TierError> {
    let start = Instant::now();
    while tier.occupancy().iter().any(|c| c.loading > 0) {
        if start.elapsed() > SETTLE_LIMIT {
            return Err(TierError::Model(ModelError::Invalid(format!(
                "replay: reads still in flight after {}s",
                SETTLE_LIMIT.as_secs()
            ))));
        }
        std::thread::sleep(Duration::from_micros(50));
    }
    Ok(())
}
