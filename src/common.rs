//! What every command shares: the model flags, loading, the tokenizer.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;
use colibri_io::IoBackendChoice;
use colibri_model::Tokenizer;
use colibri_sched::gpu::{Attached, DeviceChoice, GpuOptions};
use colibri_sched::prefetch::{Predictor, PrefetchOptions};
use colibri_sched::tier::{ByteSize, QueueDepthMode, TierOptions};
use colibri_sched::{Engine, EngineOptions};

#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// Model directory (Hugging Face checkpoint: config.json + *.safetensors).
    /// Without it, colibri uses its bundled demo model (random weights).
    #[arg(long, short = 'm')]
    pub model: Option<PathBuf>,
    /// Compute threads (default: one per available core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Context length cap (default: the model's max_position_embeddings).
    #[arg(long, default_value_t = 0)]
    pub ctx: usize,
    /// Block-quantized weights (every ggml format): dequantize exactly
    /// instead of quantizing each matrix product's input to 8-bit blocks
    /// as llama.cpp does (the default; faster, and a small approximation
    /// of the exact product).
    #[arg(long)]
    pub exact_quant: bool,
    /// RAM for routed experts, pinned and cached: 8GiB, 512MiB, 1.5G (K/M/G/T
    /// and KiB..TiB are powers of 1024, KB..TB of 1000) or bytes. 0 caches
    /// nothing (experts are read for every use). Default: the lower of
    /// MemAvailable and the cgroup memory limit, minus the dense weights, the
    /// KV cache reserve, the staging slots and a safety margin (`colibri plan`
    /// shows the result).
    #[arg(long, value_name = "SIZE")]
    pub ram_budget: Option<ByteSize>,
    /// Part of the RAM budget for the hottest experts of the usage history,
    /// loaded at start and never evicted. Default: a quarter of the RAM
    /// budget when a usage history exists, else nothing.
    #[arg(long, value_name = "SIZE")]
    pub pin_budget: Option<ByteSize>,
    /// How cached experts are chosen for eviction: least recently used, or
    /// segmented LRU (experts used again while cached are protected from
    /// one-off uses).
    #[arg(long, value_name = "lru|slru", default_value = "lru")]
    pub eviction: colibri_sched::tier::EvictionPolicy,
    /// How experts are read: io_uring, a pread thread pool, or io_uring with a
    /// fallback to pread where the kernel refuses it.
    #[arg(long, value_name = "auto|uring|pread", default_value = "auto")]
    pub io: IoBackendChoice,
    /// Expert reads in flight at most. Default: the knee of the drive's
    /// latency–throughput curve at the experts' read size, measured once
    /// per drive (about two seconds) and cached under
    /// $XDG_CACHE_HOME/colibri/io/.
    #[arg(long, value_name = "N")]
    pub queue_depth: Option<usize>,
    /// Do not read the coming layers' predicted experts ahead (from disk
    /// into RAM, and with a GPU from RAM into VRAM). Prefetch never changes
    /// results, only speed.
    #[arg(long)]
    pub no_prefetch: bool,
    /// How the coming layers' experts are predicted: the next MoE layer's
    /// router applied to this layer's input (next), the next two layers'
    /// (next-two), the experts the previous token used there (cross-token),
    /// or next and cross-token together (union).
    #[arg(
        long,
        value_name = "next|next-two|cross-token|union",
        default_value = "next"
    )]
    pub prefetch_predictor: Predictor,
    /// Record every routing decision and router prediction to FILE (JSON
    /// lines), to evaluate predictors and cache sizes offline
    /// (`cargo run -p colibri-sched --example prefetch_replay -- FILE`).
    #[arg(long, value_name = "FILE")]
    pub routing_trace: Option<PathBuf>,
    /// Where the forward pass runs: `cuda` (fails if no usable GPU), `cpu`,
    /// or `auto` (CUDA when a usable GPU and NVRTC are there, else the CPU
    /// tier, said once).
    #[arg(long, value_name = "auto|cpu|cuda", default_value = "auto")]
    pub device: DeviceChoice,
    /// Device memory for dense weights, the KV cache and cached experts
    /// (same units as --ram-budget). What does not fit streams from RAM:
    /// 0 keeps nothing resident and still runs. Default: the device's free
    /// memory minus the GPU tier's working set and a reserve (`colibri
    /// plan` shows the placement).
    #[arg(long, value_name = "SIZE")]
    pub vram_budget: Option<ByteSize>,
    /// GPU ids to use (default 0). Several (`0,1`): the layers are split
    /// between them by bytes, each device holding its layers' dense
    /// weights, routed experts and KV cache (the last one the output head),
    /// each with its own --vram-budget; the output is the same as on one
    /// device.
    #[arg(long, value_name = "IDS", value_delimiter = ',')]
    pub devices: Vec<usize>,
}

impl ModelArgs {
    /// The GPU tier's settings from these flags.
    pub fn gpu_options(&self) -> GpuOptions {
        GpuOptions {
            device: self.device,
            vram_budget: self.vram_budget.map(ByteSize::bytes),
            devices: self.devices.clone(),
            ahead: if self.no_prefetch {
                0
            } else {
                colibri_sched::gpu::DEFAULT_AHEAD
            },
            ..GpuOptions::default()
        }
    }

    /// The expert tier's settings from these flags.
    pub fn tier_options(&self) -> TierOptions {
        TierOptions {
            ram_budget: self.ram_budget.map(ByteSize::bytes),
            pin_budget: self.pin_budget.map(ByteSize::bytes),
            io: self.io,
            queue_depth: self
                .queue_depth
                .unwrap_or(TierOptions::default().queue_depth),
            queue_depth_mode: match self.queue_depth {
                Some(_) => QueueDepthMode::Fixed,
                None => QueueDepthMode::measured(),
            },
            // What the engine plans when it prefetches (so `plan` shows it).
            prefetch_layers: if self.no_prefetch {
                0
            } else {
                colibri_sched::engine::PREFETCH_LAYERS
            },
            // CPU tiles only for experts the CPU will compute.
            tile_q4_0: !colibri_sched::gpu::likely(&self.gpu_options()),
            policy: self.eviction,
            ..TierOptions::default()
        }
    }

    /// The prefetcher's settings from these flags.
    pub fn prefetch_options(&self) -> PrefetchOptions {
        PrefetchOptions {
            enabled: !self.no_prefetch,
            predictor: self.prefetch_predictor,
            trace: self.routing_trace.clone(),
            ..PrefetchOptions::default()
        }
    }
}

/// Where colibri keeps generated files (demo model, usage history).
pub fn cache_dir() -> PathBuf {
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(x).join("colibri");
    }
    match std::env::var_os("HOME").filter(|v| !v.is_empty()) {
        Some(h) => PathBuf::from(h).join(".cache/colibri"),
        None => std::env::temp_dir().join("colibri"),
    }
}

impl ModelArgs {
    /// The model path, or the demo model (written on first use).
    pub fn resolve(&self) -> Result<(PathBuf, bool)> {
        match &self.model {
            Some(p) => Ok((p.clone(), false)),
            None => {
                let dir = colibri_model::demo::ensure_demo_model(&cache_dir())
                    .context("writing the bundled demo model")?;
                tracing::warn!(
                    "no --model given: using the bundled demo model `{}` — RANDOM WEIGHTS, it produces noise ({})",
                    colibri_model::demo::DEMO_MODEL_NAME,
                    dir.display()
                );
                Ok((dir, true))
            }
        }
    }
}

pub struct Loaded {
    pub engine: Engine,
    pub tokenizer: Option<Arc<Tokenizer>>,
    pub path: PathBuf,
    pub is_demo: bool,
}

pub fn load(args: &ModelArgs) -> Result<Loaded> {
    colibri_model::kernels::set_exact_quant(args.exact_quant);
    let gpu = args.gpu_options();
    colibri_sched::gpu::preflight(&gpu).with_context(|| format!("--device {}", args.device))?;
    let (path, is_demo) = args.resolve()?;
    let t0 = std::time::Instant::now();
    let mut engine = Engine::load(
        &path,
        &EngineOptions {
            threads: args.threads,
            ctx: args.ctx,
            tier: args.tier_options(),
            prefetch: args.prefetch_options(),
        },
    )
    .with_context(|| format!("loading model {}", path.display()))?;
    match colibri_sched::gpu::attach(&mut engine, &gpu)
        .with_context(|| format!("--device {}", args.device))?
    {
        Attached::Gpu(summary) => tracing::info!("{summary}"),
        Attached::Cpu { reason: Some(why) } => {
            tracing::info!("no usable GPU tier ({why}): running on the CPU tier")
        }
        Attached::Cpu { reason: None } => {}
    }
    let tokenizer = Tokenizer::from_dir(&path)
        .with_context(|| format!("loading the tokenizer of {}", path.display()))?
        .map(Arc::new);
    if tokenizer.is_none() {
        tracing::warn!(
            "{} has no tokenizer.json: colibri runs on token ids only (text needs a tokenizer)",
            path.display()
        );
    }
    tracing::info!(
        "loaded {} ({} layers) from {} in {:.2}s, {} threads, context {}",
        engine.model.spec.family.model_type(),
        engine.model.spec.num_layers(),
        path.display(),
        t0.elapsed().as_secs_f64(),
        engine.threads(),
        engine.context_len()
    );
    Ok(Loaded {
        engine,
        tokenizer,
        path,
        is_demo,
    })
}

impl Loaded {
    /// The tokenizer, or an error telling the user text needs one.
    pub fn require_tokenizer(&self, alternative: &str) -> Result<&Arc<Tokenizer>> {
        self.tokenizer.as_ref().with_context(|| {
            format!(
                "{} has no tokenizer.json, and text needs a tokenizer: {alternative}",
                self.path.display()
            )
        })
    }
}

/// Parses token ids separated by commas and/or whitespace.
pub fn parse_token_ids(text: &str) -> Result<Vec<u32>> {
    text.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<u32>()
                .with_context(|| format!("`{s}` is not a token id"))
        })
        .collect()
}
