//! `colibri synth`: a synthetic model (random weights, fixed seed) with
//! the real geometry of a preset or a config.json, as a packed store or a
//! GGUF file. The work is in `colibri_model::synth`.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use colibri_model::convert::cast::Quant;
use colibri_model::format::WeightFormat;
use colibri_model::synth::{self, SynthFormat, SynthSource, SynthSummary};

use crate::convert::{Bar, human_bytes};

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum SynthQuant {
    F32,
    Bf16,
    #[value(name = "q8_0")]
    Q8_0,
    #[value(name = "q4_0")]
    Q4_0,
}

/// The output head's format, when not `--quant`'s.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum HeadArg {
    /// ggml Q6_K, as llama.cpp stores the head of its Q4_0 and k-quant
    /// files.
    #[value(name = "q6_k")]
    Q6K,
}

/// The routed experts' format, when not `--quant`'s.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum ExpertsArg {
    /// ggml Q4_K, the bulk of llama.cpp's Q4_K_M files.
    #[value(name = "q4_k")]
    Q4K,
    /// ggml Q5_K (llama.cpp's Q5_K mixes).
    #[value(name = "q5_k")]
    Q5K,
    /// ggml Q6_K.
    #[value(name = "q6_k")]
    Q6K,
    /// As llama.cpp's Q4_K_M files: Q4_K, with the down projections of
    /// the first and last eighth of the layers and every third between in
    /// Q6_K.
    #[value(name = "q4_k_m")]
    Q4KM,
    // The formats below colibri reads but has no quantizer for: synth
    // writes random blocks of the same spread (the weights are noise
    // anyway).
    /// ggml Q4_1 (random blocks).
    #[value(name = "q4_1")]
    Q4_1,
    /// ggml Q5_0 (random blocks).
    #[value(name = "q5_0")]
    Q5_0,
    /// ggml Q5_1 (random blocks).
    #[value(name = "q5_1")]
    Q5_1,
    /// ggml Q2_K, the bulk of llama.cpp's Q2_K files (random blocks).
    #[value(name = "q2_k")]
    Q2K,
    /// ggml Q3_K, the bulk of llama.cpp's Q3_K_S/M/L files (random blocks).
    #[value(name = "q3_k")]
    Q3K,
    /// ggml IQ4_NL (random blocks).
    #[value(name = "iq4_nl")]
    Iq4Nl,
    /// ggml IQ4_XS, llama.cpp's IQ4_XS files (random blocks).
    #[value(name = "iq4_xs")]
    Iq4Xs,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum FormatArg {
    /// A packed expert store (a directory).
    Packed,
    /// A GGUF file (llama.cpp's layout).
    Gguf,
}

#[derive(Args, Debug)]
pub struct SynthArgs {
    /// A released model's geometry: qwen3-30b-a3b, qwen3-235b-a22b,
    /// deepseek-v3, mixtral-8x7b.
    #[arg(long, conflicts_with = "config", required_unless_present = "config")]
    pub preset: Option<String>,
    /// Take the geometry from this config.json instead.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Weight format. The synthetic checkpoint is bf16 (as released
    /// models are); q8_0/q4_0 quantize experts and projections and keep
    /// embeddings, norms and routers in bf16.
    #[arg(long, value_enum, default_value = "q4_0")]
    pub quant: SynthQuant,
    /// Store the output head in this format instead (GGUF only): `q6_k`
    /// with `--quant q4_0` gives llama.cpp's Q4_0 file layout.
    #[arg(long, value_enum)]
    pub head: Option<HeadArg>,
    /// Store the routed experts in this format instead (GGUF only):
    /// `--experts q4_k_m --head q6_k` gives the bulk of llama.cpp's Q4_K_M
    /// layout. (The k-quants are written by a plain quantizer, not
    /// llama.cpp's error-minimizing one: the weights are noise anyway.)
    #[arg(long, value_enum)]
    pub experts: Option<ExpertsArg>,
    /// Output format.
    #[arg(long, value_enum, default_value = "packed")]
    pub format: FormatArg,
    /// Where to write (a directory for packed, a file for gguf; must not
    /// exist). Written under OUT.partial and renamed when complete.
    #[arg(long, short = 'o', required_unless_present = "dry_run")]
    pub out: Option<PathBuf>,
    /// Override the number of layers (small test models). DeepSeek keeps
    /// at least one MoE layer: first_k_dense_replace is capped at N-1.
    #[arg(long)]
    pub layers: Option<usize>,
    /// Seed of the random weights (same seed, same files).
    #[arg(long, default_value_t = synth::DEFAULT_SEED)]
    pub seed: u64,
    /// Print the geometry and the output's size without writing anything.
    #[arg(long)]
    pub dry_run: bool,
    /// Print the summary as one JSON object.
    #[arg(long)]
    pub json: bool,
}

fn print(s: &SynthSummary, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string(s)?);
        return Ok(());
    }
    let g = &s.geometry;
    println!(
        "{} {}: {} layers ({} MoE), hidden {}, {} {} heads, {} experts (top {}) of width {}, vocab {}; {:.2} B parameters, {:.2} B active per token",
        if s.written { "wrote" } else { "would write" },
        s.out.display(),
        g.layers,
        g.moe_layers,
        g.hidden_size,
        g.heads,
        g.attention,
        g.experts,
        g.experts_per_token,
        g.expert_intermediate_size,
        g.vocab_size,
        g.total_params as f64 / 1e9,
        g.active_params as f64 / 1e9
    );
    println!(
        "{:?} {}: {}, {} per expert{}",
        s.format,
        s.quant.name(),
        human_bytes(s.file_bytes),
        human_bytes(s.expert_bytes),
        if s.written {
            format!(
                "; {:.1} s, {}/s, peak memory {} anonymous ({} resident)",
                s.seconds,
                human_bytes(s.bytes_per_second as u64),
                human_bytes(s.peak_rss_anon_bytes),
                human_bytes(s.peak_rss_bytes)
            )
        } else {
            String::new()
        }
    );
    Ok(())
}

pub fn main(args: SynthArgs) -> Result<()> {
    let config = match &args.config {
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            Some(serde_json::from_str(&text).with_context(|| format!("parsing {}", p.display()))?)
        }
        None => None,
    };
    let config = synth::config(args.preset.as_deref(), config, args.layers)?;
    let mut source = SynthSource::new(config, args.seed).context("the model's config")?;
    if let Some(HeadArg::Q6K) = args.head {
        source = source.with_head(WeightFormat::Q6K);
    }
    source = match args.experts {
        None => source,
        Some(ExpertsArg::Q4KM) => source.with_q4_k_m_experts(),
        Some(ExpertsArg::Q4K) => source.with_experts(WeightFormat::Q4K),
        Some(ExpertsArg::Q5K) => source.with_experts(WeightFormat::Q5K),
        Some(ExpertsArg::Q6K) => source.with_experts(WeightFormat::Q6K),
        Some(ExpertsArg::Q4_1) => source.with_experts(WeightFormat::Q4_1),
        Some(ExpertsArg::Q5_0) => source.with_experts(WeightFormat::Q5_0),
        Some(ExpertsArg::Q5_1) => source.with_experts(WeightFormat::Q5_1),
        Some(ExpertsArg::Q2K) => source.with_experts(WeightFormat::Q2K),
        Some(ExpertsArg::Q3K) => source.with_experts(WeightFormat::Q3K),
        Some(ExpertsArg::Iq4Nl) => source.with_experts(WeightFormat::Iq4Nl),
        Some(ExpertsArg::Iq4Xs) => source.with_experts(WeightFormat::Iq4Xs),
    };
    let quant = match args.quant {
        SynthQuant::F32 => Quant::F32,
        SynthQuant::Bf16 => Quant::Bf16,
        SynthQuant::Q8_0 => Quant::Q8_0,
        SynthQuant::Q4_0 => Quant::Q4_0,
    };
    let format = match args.format {
        FormatArg::Packed => SynthFormat::Packed,
        FormatArg::Gguf => SynthFormat::Gguf,
    };
    let out = args.out.clone().unwrap_or_else(|| PathBuf::from("-"));
    if args.dry_run {
        return print(&synth::plan(&source, quant, format, &out)?, args.json);
    }
    if out.exists() {
        bail!(
            "{} already exists; remove it or choose another --out",
            out.display()
        );
    }
    let planned = synth::plan(&source, quant, format, &out)?;
    tracing::info!(
        "synth: writing {} ({:?}, {}) to {}",
        human_bytes(planned.file_bytes),
        format,
        quant.name(),
        out.display()
    );
    let bar = Bar::new();
    let result = synth::write(&source, quant, format, &out, &bar);
    bar.finish();
    let s = result.with_context(|| format!("writing {}", out.display()))?;
    tracing::info!(
        "synth: {} at {}/s, peak anonymous memory {}, peak resident {}",
        human_bytes(s.file_bytes),
        human_bytes(s.bytes_per_second as u64),
        human_bytes(s.peak_rss_anon_bytes),
        human_bytes(s.peak_rss_bytes)
    );
    print(&s, args.json)
}
