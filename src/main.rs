//! `colibri`: run Mixture-of-Experts models larger than fast memory.
//!
//! Results go to stdout (`--json` where a program reads them); logs go to
//! stderr through `tracing` (`RUST_LOG=debug` for more).

mod bench_io;
mod common;
mod convert;
mod malloc;
mod perplexity;
mod plan;
mod run;
mod serve;
mod synth;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "colibri",
    version,
    about = "Runs Mixture-of-Experts LLMs larger than the machine's fast memory, streaming experts from NVMe"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a continuation of one prompt, or chat interactively.
    Run(run::RunArgs),
    /// Score a text or token file (teacher-forced perplexity).
    Perplexity(perplexity::PerplexityArgs),
    /// Serve the model over an OpenAI-compatible HTTP API.
    Serve(serve::ServeArgs),
    /// Show where a model's weights will live at the given budgets and what
    /// a decode token is expected to read from disk.
    Plan(plan::PlanArgs),
    /// Measure the disk path: raw reads of a file, or cold-cache decoding of
    /// a model against the drive's raw bandwidth.
    BenchIo(bench_io::BenchIoArgs),
    /// Convert a model (Hugging Face, GGUF or packed) to a packed expert
    /// store, optionally re-quantized (resumable, bounded memory).
    Convert(convert::ConvertArgs),
    /// Write a synthetic model (random weights) with a real model's
    /// geometry, as a packed store or a GGUF file.
    Synth(synth::SynthArgs),
}

fn main() -> std::process::ExitCode {
    malloc::tune();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "colibri=info,warn".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(a) => run::main(a),
        Command::Perplexity(a) => perplexity::main(a),
        Command::Serve(a) => serve::main(a),
        Command::Plan(a) => plan::main(a),
        Command::BenchIo(a) => bench_io::main(a),
        Command::Convert(a) => convert::main(a),
        Command::Synth(a) => synth::main(a),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
