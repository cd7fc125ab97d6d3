//! `colibri convert`: any model (Hugging Face directory, GGUF file, packed
//! store) to a packed expert store, optionally re-quantized, with a
//! progress bar. The work is in `colibri_model::convert`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use colibri_model::ModelError;
use colibri_model::convert::cast::Quant;
use colibri_model::convert::{ConvertOptions, ConvertSummary, Progress};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// `--quant` of convert.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum QuantArg {
    /// Every tensor in its stored format (bytes copied).
    Keep,
    /// Every weight matrix widened to f32 (exact).
    F32,
    /// Every weight matrix in bf16, rounded to nearest, ties to even
    /// (exact for bf16 sources; the summary counts rounded matrices).
    Bf16,
    /// ggml Q8_0: routed and shared experts, dense MLPs and attention
    /// projections; embeddings, norms and routers keep their format.
    #[value(name = "q8_0")]
    Q8_0,
    /// ggml Q4_0, on the same tensors as q8_0.
    #[value(name = "q4_0")]
    Q4_0,
}

impl From<QuantArg> for Quant {
    fn from(q: QuantArg) -> Quant {
        match q {
            QuantArg::Keep => Quant::Keep,
            QuantArg::F32 => Quant::F32,
            QuantArg::Bf16 => Quant::Bf16,
            QuantArg::Q8_0 => Quant::Q8_0,
            QuantArg::Q4_0 => Quant::Q4_0,
        }
    }
}

#[derive(Args, Debug)]
pub struct ConvertArgs {
    /// The model to convert: a Hugging Face checkpoint directory
    /// (config.json + *.safetensors), a .gguf file or a packed store.
    #[arg(long, short = 'm')]
    pub model: PathBuf,
    /// Weight format of the output. Matrices whose rows are not whole
    /// 32-element blocks stay in their format under q8_0/q4_0 (the summary
    /// lists them); FP8 weights are dequantized exactly first.
    #[arg(long, value_enum, default_value = "keep")]
    pub quant: QuantArg,
    /// The packed store to write (a directory that must not exist). It is
    /// written as OUT.partial and renamed when complete; after an
    /// interruption the same command resumes, keeping finished layers
    /// whose bytes still match their checksums.
    #[arg(long, short = 'o')]
    pub out: PathBuf,
    /// Print the summary as one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Bytes for people (binary units).
pub fn human_bytes(b: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", units[u])
    }
}

/// A progress bar on stderr (hidden when stderr is not a terminal).
pub struct Bar(ProgressBar);

impl Bar {
    pub fn new() -> Bar {
        let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] [{wide_bar}] {binary_bytes}/{binary_total_bytes} ({binary_bytes_per_sec}, ETA {eta}) {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        Bar(bar)
    }

    pub fn finish(&self) {
        self.0.finish_and_clear();
    }
}

impl Progress for Bar {
    fn begin(&self, total: u64, done: u64) {
        self.0.set_length(total);
        self.0.set_position(done);
        self.0.reset_eta();
    }

    fn advance(&self, bytes: u64) {
        self.0.inc(bytes);
    }

    fn message(&self, msg: &str) {
        self.0.set_message(msg.to_string());
    }
}

/// Test hook: abort the process (as a kill would) after this many layers,
/// leaving OUT.partial to resume from.
const ABORT_HOOK: &str = "COLIBRI_CONVERT_ABORT_AFTER_LAYERS";

fn print_summary(s: &ConvertSummary, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string(s)?);
        return Ok(());
    }
    println!(
        "wrote {}: {} in {} dense tensors and {} expert records of {}{}; {:.1} s, {}/s, peak memory {} (anonymous; {} resident with mapped source pages){}",
        s.out.display(),
        human_bytes(s.file_bytes),
        s.dense_tensors,
        s.experts,
        human_bytes(s.record_bytes.1),
        if s.record_bytes.0 != s.record_bytes.1 {
            format!(" (smallest {})", human_bytes(s.record_bytes.0))
        } else {
            String::new()
        },
        s.seconds,
        human_bytes(s.bytes_per_second as u64),
        human_bytes(s.peak_rss_anon_bytes),
        human_bytes(s.peak_rss_bytes),
        if s.resumed_units > 0 {
            format!(", resumed: {} units kept", s.resumed_units)
        } else {
            String::new()
        }
    );
    for k in &s.kept {
        println!("note: {k}");
    }
    if s.rounded_matrices > 0 {
        println!(
            "note: {} matrices were rounded to the target format (round to nearest, ties to even)",
            s.rounded_matrices
        );
    }
    Ok(())
}

pub fn main(args: ConvertArgs) -> Result<()> {
    let mut opts = ConvertOptions::new(args.quant.into());
    let abort_after = std::env::var(ABORT_HOOK)
        .ok()
        .map(|v| v.parse::<usize>())
        .transpose()
        .with_context(|| format!("{ABORT_HOOK} must be a number"))?;
    opts.stop_after_layers = abort_after;
    let bar = Bar::new();
    let result = colibri_model::convert::convert(&args.model, &args.out, &opts, &bar);
    bar.finish();
    let summary = match result {
        Err(ModelError::Interrupted(n)) if abort_after.is_some() => {
            eprintln!("{ABORT_HOOK}: aborting after {n} layers");
            std::process::abort();
        }
        r => r.with_context(|| {
            format!(
                "converting {} to {}",
                args.model.display(),
                args.out.display()
            )
        })?,
    };
    tracing::info!(
        "convert: {} written at {}/s, peak anonymous memory {}, peak resident {}",
        human_bytes(summary.written_bytes),
        human_bytes(summary.bytes_per_second as u64),
        human_bytes(summary.peak_rss_anon_bytes),
        human_bytes(summary.peak_rss_bytes)
    );
    print_summary(&summary, args.json)
}
