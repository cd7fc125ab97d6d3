//! What every command shares: the model flags and loading.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use colibri_io::IoBackendChoice;
use colibri_sched::tier::{ByteSize, TierOptions};
use colibri_sched::{Engine, EngineOptions};

#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// Model directory (Hugging Face checkpoint: config.json + *.safetensors).
    #[arg(long, short = 'm')]
    pub model: PathBuf,
    /// Compute threads (default: one per available core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Context length cap (default: the model's max_position_embeddings).
    #[arg(long, default_value_t = 0)]
    pub ctx: usize,
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
    /// How experts are read: io_uring, a pread thread pool, or io_uring with a
    /// fallback to pread where the kernel refuses it.
    #[arg(long, value_name = "auto|uring|pread", default_value = "auto")]
    pub io: IoBackendChoice,
}

impl ModelArgs {
    /// The expert tier's settings from these flags.
    pub fn tier_options(&self) -> TierOptions {
        TierOptions {
            ram_budget: self.ram_budget.map(ByteSize::bytes),
            pin_budget: self.pin_budget.map(ByteSize::bytes),
            io: self.io,
            ..TierOptions::default()
        }
    }
}

pub fn load_engine(args: &ModelArgs) -> Result<Engine> {
    let t0 = std::time::Instant::now();
    let engine = Engine::load(
        &args.model,
        &EngineOptions {
            threads: args.threads,
            ctx: args.ctx,
            tier: args.tier_options(),
        },
    )
    .with_context(|| format!("loading model {}", args.model.display()))?;
    tracing::info!(
        "loaded {} ({} layers) from {} in {:.2}s, {} threads, context {}",
        engine.model.spec.family.model_type(),
        engine.model.spec.num_layers(),
        args.model.display(),
        t0.elapsed().as_secs_f64(),
        engine.threads(),
        engine.context_len()
    );
    Ok(engine)
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
