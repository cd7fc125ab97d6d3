//! The RAM tier: routed experts streamed from disk through a budgeted cache
//! of pinned RAM slots, for any [`ExpertLocator`].
//!
//! - [`size`]: `--ram-budget 8GiB` parsing and printing ([`ByteSize`]).
//! - [`depth`]: the reader's queue depth, measured on the model's drive and
//!   cached per device ([`MeasuredDepth`]).
//! - [`memory`]: what the machine and the cgroup allow ([`MemoryLimits`]).
//! - [`layout`]: each expert's reads and slot size, size classes
//!   ([`ExpertLayout`]).
//! - [`usage`]: the persisted selection counts ([`UsageHistory`]).
//! - [`plan`]: the residency planner ([`Plan`]), also behind `colibri plan`.
//! - [`lists`]: O(1) intrusive eviction lists, LRU and segmented LRU.
//! - [`cache`]: the [`TierCache`] itself, an [`ExpertSource`].
//! - [`stats`]: its counters and read latencies.
//!
//! One hierarchy, not a threshold (DESIGN.md principle 1): every model with
//! located experts goes through the tier; a budget that holds every expert
//! simply caches every expert, a budget of zero still runs through a small
//! staging area. Placement never changes what is computed (principle 2):
//! the tier hands out views of exactly the bytes a memory map would.

pub mod cache;
pub mod depth;
pub mod layout;
pub mod lists;
pub mod memory;
pub mod plan;
pub mod size;
pub mod stats;
pub mod usage;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use colibri_io::{DirectIo, FaultInjector, FileSet, IoBackendChoice, IoError};
use colibri_model::source::WeightSource;
use colibri_model::{ExpertSource, Model, ModelError, ModelSpec, ResidentExperts};
use serde::Serialize;

pub use self::cache::{ClassOccupancy, Residency, TierCache};
pub use self::depth::MeasuredDepth;
pub use self::layout::{ExpertLayout, ExpertRecord, FileFacts, SizeClass};
pub use self::lists::EvictionPolicy;
pub use self::memory::MemoryLimits;
pub use self::plan::{BudgetSource, Footprint, Plan, PlanRequest};
pub use self::size::ByteSize;
pub use self::stats::{LatencySummary, TierStats};
pub use self::usage::UsageHistory;

/// Reads in flight when the depth is neither given nor measured: enough
/// for one layer's misses of a fine-grained model plus prefetch (LESSONS.md:
/// queue depth ≥ 8 reaches near-sequential speed), few enough that staging
/// stays small. The command line measures the drive instead
/// ([`QueueDepthMode::Measured`]).
pub const DEFAULT_QUEUE_DEPTH: usize = 16;

/// How the reader's queue depth is chosen.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum QueueDepthMode {
    /// [`TierOptions::queue_depth`] as given.
    #[default]
    Fixed,
    /// The knee of the drive's latency–throughput curve at the experts'
    /// read size ([`depth`]), cached per device in this directory (`None`:
    /// measured every time); `queue_depth` if the measurement fails.
    Measured { cache: Option<PathBuf> },
}

impl QueueDepthMode {
    /// Measured, cached in the default place.
    pub fn measured() -> QueueDepthMode {
        QueueDepthMode::Measured {
            cache: depth::default_dir(),
        }
    }
}

/// Where the usage history lives.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum UsageMode {
    /// `$XDG_CACHE_HOME/colibri/usage` (or `~/.cache/colibri/usage`).
    #[default]
    Auto,
    /// This directory.
    Dir(PathBuf),
    /// Neither read nor written (nothing is pinned).
    Off,
}

/// User settings of the tier (`--ram-budget`, `--pin-budget`, `--io`).
#[derive(Clone, Debug)]
pub struct TierOptions {
    /// Bytes for pinned + cached experts; `None`: automatic.
    pub ram_budget: Option<u64>,
    /// Bytes for pinned experts; `None`: a share of the RAM budget when a
    /// usage history exists.
    pub pin_budget: Option<u64>,
    /// I/O backend.
    pub io: IoBackendChoice,
    /// Reads in flight at most (with [`QueueDepthMode::Fixed`]).
    pub queue_depth: usize,
    /// Whether `queue_depth` is used as given or measured.
    pub queue_depth_mode: QueueDepthMode,
    /// Eviction policy of the cache.
    pub policy: EvictionPolicy,
    /// Usage history location.
    pub usage: UsageMode,
    /// Whether to try `O_DIRECT`.
    pub direct: DirectIo,
    /// Fault injection (tests).
    pub faults: Option<FaultInjector>,
    /// Memory limits to plan with; `None`: probe the machine (tests fix them).
    pub memory: Option<MemoryLimits>,
    /// Prefetch reads in the kernel at most (`None`: the reader's default,
    /// three quarters of the queue depth).
    pub prefetch_limit: Option<usize>,
    /// Room for experts read ahead by the prefetcher: staging slots for
    /// this many MoE layers' worth of experts (`top_k` each) are added per
    /// size class. 0: none (prefetch only uses free slots beyond half the
    /// staging area).
    pub prefetch_layers: usize,
    /// Tile the Q4_0 matrices of experts for the CPU's tile kernel as they
    /// arrive, where one runs ([`TierCache::set_tile_q4_0`]), and pack
    /// their Q2_K, Q3_K, Q4_K and Q5_K matrices into panels where a panel
    /// kernel runs (`colibri_model::kernels::panels_run_here`): for experts
    /// computed on this CPU. The GPU tier turns it off when it attaches;
    /// leaving it off where a GPU will attach saves the work. The engine
    /// also lays its dense matrices out for the CPU only when it is on
    /// (`DenseWeights::set_cpu_layouts`).
    pub tile_q4_0: bool,
}

impl TierOptions {
    /// Staging slots per size class added for prefetch.
    pub fn prefetch_slots(&self, layout: &ExpertLayout) -> usize {
        self.prefetch_layers * layout.top_k
    }

    /// The queue depth to read `layout`'s experts from `files` with, and
    /// the measurement behind it when measured.
    pub fn resolve_queue_depth(
        &self,
        files: &FileSet,
        layout: &ExpertLayout,
    ) -> (usize, Option<MeasuredDepth>) {
        match &self.queue_depth_mode {
            QueueDepthMode::Fixed => (self.queue_depth, None),
            QueueDepthMode::Measured { cache } => {
                match depth::measured_queue_depth(files, layout, self.io, cache.as_deref()) {
                    Ok(m) => (m.queue_depth, Some(m)),
                    Err(error) => {
                        tracing::warn!(
                            "queue depth not measured ({error}); using {}",
                            self.queue_depth
                        );
                        (self.queue_depth, None)
                    }
                }
            }
        }
    }
}

impl Default for TierOptions {
    fn default() -> Self {
        TierOptions {
            ram_budget: None,
            pin_budget: None,
            io: IoBackendChoice::Auto,
            queue_depth: DEFAULT_QUEUE_DEPTH,
            queue_depth_mode: QueueDepthMode::Fixed,
            policy: EvictionPolicy::default(),
            usage: UsageMode::Auto,
            direct: DirectIo::Auto,
            faults: None,
            memory: None,
            prefetch_layers: 0,
            prefetch_limit: None,
            tile_q4_0: true,
        }
    }
}

/// Everything [`TierCache::open`] needs besides the spec and locator.
#[derive(Clone, Debug, Default)]
pub struct TierSetup {
    pub options: TierOptions,
    /// Dense weights and KV reserve (outside the expert budget).
    pub footprint: Footprint,
    /// The bytes of `config.json` (part of the usage-history key).
    pub config_json: Vec<u8>,
}

/// Errors of the tier.
#[derive(Debug, thiserror::Error)]
pub enum TierError {
    #[error(transparent)]
    Io(#[from] IoError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("expert tier budget: {0}")]
    Budget(String),
}

impl From<TierError> for ModelError {
    fn from(error: TierError) -> ModelError {
        match error {
            TierError::Model(e) => e,
            other => ModelError::Invalid(format!("expert tier: {other}")),
        }
    }
}

/// The I/O side of a plan: what would read, with which alignment.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct IoSummary {
    /// `--io` as given.
    pub choice: IoBackendChoice,
    /// The backend that runs (`io_uring` or `pread`).
    pub backend: String,
    /// Why not io_uring, when not.
    pub fallback_reason: Option<String>,
    /// Files read with `O_DIRECT`, of all files.
    pub direct_files: usize,
    pub files: usize,
    /// Distinct alignment granules (bytes; 1 = buffered).
    pub alignments: Vec<u64>,
    pub queue_depth: usize,
}

impl IoSummary {
    /// What `choice` would give on this machine for `files`, without
    /// starting a reader.
    pub fn probe(choice: IoBackendChoice, files: &FileSet, queue_depth: usize) -> IoSummary {
        let (backend, fallback_reason) = match choice {
            IoBackendChoice::Pread => ("pread".to_string(), None),
            IoBackendChoice::Uring | IoBackendChoice::Auto => {
                match colibri_io::probe_uring().unavailable {
                    None => ("io_uring".to_string(), None),
                    Some(why) if choice == IoBackendChoice::Auto => {
                        ("pread".to_string(), Some(why))
                    }
                    Some(why) => (format!("none (io_uring required: {why})"), Some(why)),
                }
            }
        };
        let mut alignments: Vec<u64> = files.infos().map(|i| i.alignment.unit()).collect();
        alignments.sort_unstable();
        alignments.dedup();
        IoSummary {
            choice,
            backend,
            fallback_reason,
            direct_files: files.infos().filter(|i| i.direct).count(),
            files: files.len(),
            alignments,
            queue_depth,
        }
    }

    /// One line for humans.
    pub fn render(&self) -> String {
        format!(
            "I/O: {} (--io {}), O_DIRECT on {} of {} files, alignment {} bytes, queue depth {}{}",
            self.backend,
            self.choice,
            self.direct_files,
            self.files,
            self.alignments
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join("/"),
            self.queue_depth,
            self.fallback_reason
                .as_ref()
                .map_or(String::new(), |r| format!(" (io_uring unavailable: {r})"))
        )
    }
}

/// What [`open_source`] gives: the source to compute with, and the tier
/// behind it when there is one.
pub struct OpenedSource {
    pub experts: Arc<dyn ExpertSource>,
    pub tier: Option<Arc<TierCache>>,
}

/// The expert source for a loaded checkpoint: the tier over its located
/// experts. Checkpoints whose experts cannot be located one by one
/// (transformers 5's fused per-layer tensors) and models without routed
/// experts are served from the memory map instead, with a warning for the
/// former.
pub fn open_source(
    model: &Model,
    src: &WeightSource,
    path: &Path,
    ctx: usize,
    options: &TierOptions,
) -> Result<OpenedSource, ModelError> {
    let spec = &model.spec;
    let resident = || -> Result<OpenedSource, ModelError> {
        Ok(OpenedSource {
            experts: Arc::new(ResidentExperts::load(spec, src)?),
            tier: None,
        })
    };
    if spec.moe.is_none() {
        return resident();
    }
    let locator = match src.locator(spec) {
        Ok(locator) => locator,
        Err(ModelError::MissingTensor(name)) => {
            tracing::warn!(
                "experts of {} cannot be located one by one (no tensor `{name}`: fused \
                 layout?); serving them from the memory map without a RAM budget",
                path.display()
            );
            return resident();
        }
        Err(e) => return Err(e),
    };
    let setup = TierSetup {
        options: options.clone(),
        footprint: Footprint::of(spec, &model.weights, ctx),
        config_json: model_identity(path, spec)?,
    };
    let tier = Arc::new(TierCache::open(spec, Arc::from(locator), &setup)?);
    Ok(OpenedSource {
        experts: tier.clone(),
        tier: Some(tier),
    })
}

/// Bytes that identify a model for its usage history: the checkpoint's
/// config.json, or (a GGUF file, a store without one) the parsed spec.
fn model_identity(path: &Path, spec: &ModelSpec) -> Result<Vec<u8>, ModelError> {
    let config_path = path.join("config.json");
    if path.is_dir() && config_path.is_file() {
        return std::fs::read(&config_path).map_err(|e| ModelError::io(&config_path, e));
    }
    Ok(format!("{spec:?}").into_bytes())
}

/// A plan and the I/O it would use, for `colibri plan`.
#[derive(Clone, Debug, Serialize)]
pub struct PlanReport {
    pub model: String,
    pub model_key: String,
    pub usage_history: Option<PathBuf>,
    pub plan: Plan,
    pub io: IoSummary,
    /// Where every routed expert is read from and how its RAM slot is laid
    /// out (the GPU tier's slots follow it).
    #[serde(skip)]
    pub layout: ExpertLayout,
}

impl PlanReport {
    /// For humans.
    pub fn render(&self) -> String {
        format!(
            "model {} (key {})\nusage history: {}\n{}\n{}",
            self.model,
            self.model_key,
            self.usage_history
                .as_ref()
                .map_or("none".to_string(), |p| p.display().to_string()),
            self.io.render(),
            self.plan.render()
        )
    }
}

/// Plans a checkpoint directory without loading any expert.
pub fn plan_checkpoint(
    dir: &Path,
    ctx: usize,
    options: &TierOptions,
) -> Result<PlanReport, TierError> {
    let (model, src) = Model::load(dir)?;
    let spec: &ModelSpec = &model.spec;
    let locator = src.locator(spec)?;
    let files = FileSet::open(locator.files(), options.direct)?;
    let layout = ExpertLayout::build(spec, locator.as_ref(), &FileFacts::of(&files))?;
    let config_json = model_identity(dir, spec)?;
    let key = usage::model_key(&config_json, &layout, locator.files());
    let usage_dir = match &options.usage {
        UsageMode::Off => None,
        UsageMode::Auto => usage::default_dir(),
        UsageMode::Dir(d) => Some(d.clone()),
    };
    let history = usage_dir
        .as_ref()
        .map(|d| UsageHistory::load(d, &key, &layout))
        .filter(|h| h.total_steps() > 0);
    let (queue_depth, _) = options.resolve_queue_depth(&files, &layout);
    let plan = Plan::compute(&PlanRequest {
        layout: &layout,
        footprint: Footprint::of(spec, &model.weights, ctx),
        memory: options.memory.clone().unwrap_or_else(MemoryLimits::probe),
        ram_budget: options.ram_budget,
        pin_budget: options.pin_budget,
        usage: history.as_ref(),
        queue_depth,
        prefetch_slots: options.prefetch_slots(&layout),
    });
    Ok(PlanReport {
        model: dir.display().to_string(),
        usage_history: history
            .as_ref()
            .and(usage_dir.as_ref())
            .map(|d| UsageHistory::path(d, &key)),
        model_key: key,
        plan,
        io: IoSummary::probe(options.io, &files, queue_depth),
        layout,
    })
}
