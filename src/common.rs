//! What every command shares: the model flags and loading.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
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
}

pub fn load_engine(args: &ModelArgs) -> Result<Engine> {
    let t0 = std::time::Instant::now();
    let engine = Engine::load(
        &args.model,
        &EngineOptions {
            threads: args.threads,
            ctx: args.ctx,
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
