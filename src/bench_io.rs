//! `colibri bench-io`: how fast this drive feeds this engine.
//!
//! - `--raw FILE`: random reads of one file through colibri's reader (same
//!   backend, `O_DIRECT` decision and pinned slots as the engine):
//!   throughput, IOPS, latency percentiles.
//! - `--model DIR`: a cold-cache decode benchmark. A fresh tier (empty
//!   cache, no pinned experts, no usage history read or written, `O_DIRECT`
//!   where the file system allows it, so the page cache does not help)
//!   prefills a prompt and decodes `--tokens` tokens. It reports tokens/s,
//!   time to first token, disk bytes and MB/s during decode, hit rates, how
//!   much of the decode time `fetch` spent blocked on reads, read latency
//!   percentiles, and — measured in the same run, over the model's largest
//!   file, at the typical expert read size and the same queue depth and
//!   backend — the raw disk bandwidth, their ratio, and the physical bound
//!   `raw bandwidth / disk bytes per token` in tokens/s beside the measured
//!   tokens/s (DESIGN.md, "Performance model").

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use colibri_io::bench::{AccessPattern, BenchLimit, RawBenchConfig, RawReport, raw_with};
use colibri_io::{Backend, IoBackendChoice};
use colibri_model::sampling::SamplingParams;
use colibri_sched::tier::{ByteSize, DEFAULT_QUEUE_DEPTH, TierOptions, TierStats, UsageMode};
use colibri_sched::{Engine, EngineOptions, GenRequest, Sequence};
use serde_json::json;

use crate::common::parse_token_ids;

#[derive(Args, Debug)]
pub struct BenchIoArgs {
    /// Raw disk benchmark: random reads of this file.
    #[arg(long, value_name = "FILE", required_unless_present = "model")]
    pub raw: Option<PathBuf>,
    /// Cold-cache decode benchmark of this model directory.
    #[arg(long, short = 'm', value_name = "DIR", conflicts_with = "raw")]
    pub model: Option<PathBuf>,
    /// Bytes per read of the raw benchmark (a multiple of the file's
    /// direct-I/O alignment).
    #[arg(long, value_name = "SIZE", default_value = "1MiB")]
    pub block_size: ByteSize,
    /// Reads in flight (default: 32 for --raw, the engine's 16 for --model).
    #[arg(long)]
    pub queue_depth: Option<usize>,
    /// I/O backend.
    #[arg(long, value_name = "auto|uring|pread", default_value = "auto")]
    pub io: IoBackendChoice,
    /// Raw benchmark: read consecutive blocks instead of random ones.
    #[arg(long)]
    pub sequential: bool,
    /// Length of the raw measurement, in seconds (also the one --model runs
    /// after decoding).
    #[arg(long, default_value_t = 3.0)]
    pub seconds: f64,
    /// --model: RAM for cached experts (default: automatic, as `run`). Use a
    /// budget below the model's expert bytes to measure streaming.
    #[arg(long, value_name = "SIZE")]
    pub ram_budget: Option<ByteSize>,
    /// --model: tokens to generate (the first ends the prefill).
    #[arg(long, default_value_t = 32)]
    pub tokens: usize,
    /// --model: prompt token ids (default: 1..=16).
    #[arg(long)]
    pub prompt_tokens: Option<String>,
    /// --model: compute threads (default: one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

pub fn main(args: BenchIoArgs) -> Result<()> {
    if !(args.seconds > 0.0 && args.seconds.is_finite()) {
        bail!("--seconds must be a positive number");
    }
    match (&args.raw, &args.model) {
        (Some(file), None) => raw(&args, file),
        (None, Some(dir)) => model(&args, dir),
        _ => bail!("give --raw FILE or --model DIR"),
    }
}

fn raw(args: &BenchIoArgs, file: &Path) -> Result<()> {
    let config = RawBenchConfig {
        block_size: usize::try_from(args.block_size.bytes()).context("--block-size")?,
        queue_depth: args.queue_depth.unwrap_or(32),
        backend: args.io,
        limit: BenchLimit {
            max_bytes: None,
            max_duration: Some(Duration::from_secs_f64(args.seconds)),
        },
        pattern: if args.sequential {
            AccessPattern::Sequential
        } else {
            AccessPattern::Random
        },
        ..RawBenchConfig::default()
    };
    let report = raw_with(file, &config).with_context(|| format!("reading {}", file.display()))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!("{}", report.summary());
        if !report.o_direct {
            println!("note: O_DIRECT was refused: these figures include the page cache");
        }
    }
    Ok(())
}

/// Per-phase measurements of the decode run.
struct Phase {
    at: Instant,
    stats: TierStats,
    bytes_read: u64,
}

fn model(args: &BenchIoArgs, dir: &Path) -> Result<()> {
    if args.tokens < 2 {
        bail!("--tokens must be at least 2 (the first token ends the prefill)");
    }
    let queue_depth = args.queue_depth.unwrap_or(DEFAULT_QUEUE_DEPTH);
    let options = TierOptions {
        ram_budget: args.ram_budget.map(ByteSize::bytes),
        pin_budget: Some(0),
        io: args.io,
        queue_depth,
        // A cold benchmark: nothing learned is used, nothing is recorded.
        usage: UsageMode::Off,
        ..TierOptions::default()
    };
    let engine = Engine::load(
        dir,
        &EngineOptions {
            threads: args.threads,
            ctx: 0,
            tier: options,
            ..EngineOptions::default()
        },
    )
    .with_context(|| format!("loading model {}", dir.display()))?;
    let Some(tier) = engine.tier.clone() else {
        bail!(
            "{}: its experts are not streamed from disk (no routed experts, or a layout \
             they cannot be located in), so there is no disk path to measure",
            dir.display()
        );
    };
    let vocab = engine.model.spec.vocab_size as u32;
    let prompt = match &args.prompt_tokens {
        Some(text) => parse_token_ids(text)?,
        None => (1..=16u32).map(|t| t % vocab.max(1)).collect(),
    };
    let prompt_len = prompt.len();
    let mut seq = Sequence::new(
        &engine.model,
        GenRequest {
            prompt,
            max_tokens: args.tokens,
            sampling: SamplingParams::default(),
            stop: vec![],
            eos: vec![],
            ignore_eos: true,
            top_logprobs: None,
        },
        engine.context_len(),
        None,
    )?;
    let snapshot = || Phase {
        at: Instant::now(),
        stats: tier.stats(),
        bytes_read: tier.reader_counters().bytes_read,
    };
    let start = snapshot();
    let mut first: Option<Phase> = None;
    let mut generated = 0usize;
    engine.generate(&mut seq, |_| {
        generated += 1;
        if first.is_none() {
            first = Some(snapshot());
            // Latencies from here on are the decode's.
            tier.read_latency(true);
        }
        true
    })?;
    let end = snapshot();
    let Some(first) = first else {
        bail!("no token was generated");
    };
    let decode_tokens = generated.saturating_sub(1).max(1) as f64;
    let decode_s = end.at.duration_since(first.at).as_secs_f64().max(1e-9);
    let ttft_s = first.at.duration_since(start.at).as_secs_f64();
    let decode = end.stats.since(&first.stats);
    let prefill = first.stats.since(&start.stats);
    let decode_bytes = end.bytes_read - first.bytes_read;
    let bytes_per_token = decode_bytes as f64 / decode_tokens;
    let tok_s = (generated - 1) as f64 / decode_s;
    let disk_mb_s = decode_bytes as f64 / decode_s / 1e6;
    let io_wait_fraction = decode.io_wait().as_secs_f64() / decode_s;
    let latency = tier.read_latency(false);

    // The raw disk, now, over the same file(s), at the same read size.
    let files = tier.files();
    let largest = files
        .infos()
        .max_by_key(|i| i.len_at_open)
        .map(|i| i.path.clone())
        .context("the model has no expert files")?;
    let unit = files
        .infos()
        .map(|i| i.alignment.unit())
        .max()
        .unwrap_or(4096)
        .max(1);
    let block = tier.layout().typical_read_bytes().max(1).div_ceil(unit) * unit;
    let backend = tier.backend().backend;
    let raw_report: RawReport = raw_with(
        &largest,
        &RawBenchConfig {
            block_size: usize::try_from(block).context("read size")?,
            queue_depth,
            backend: match backend {
                Backend::Uring => IoBackendChoice::Uring,
                Backend::Pread => IoBackendChoice::Pread,
            },
            limit: BenchLimit {
                max_bytes: None,
                max_duration: Some(Duration::from_secs_f64(args.seconds)),
            },
            ..RawBenchConfig::default()
        },
    )
    .with_context(|| format!("raw benchmark of {}", largest.display()))?;
    let raw_mb_s = raw_report.mb_per_s;
    let utilization = if raw_mb_s > 0.0 {
        disk_mb_s / raw_mb_s
    } else {
        0.0
    };
    // missed expert bytes per token / raw bandwidth, as tokens per second.
    let bound_tok_s = (bytes_per_token > 0.0).then(|| raw_mb_s * 1e6 / bytes_per_token);
    let plan = tier.plan();
    let o_direct = files.all_direct();

    if args.json {
        let v = json!({
            "model": dir.display().to_string(),
            "prompt_tokens": prompt_len,
            "tokens": generated,
            "tok_s": tok_s,
            "ttft_s": ttft_s,
            "disk_bytes_per_token": bytes_per_token,
            "disk_read_mb_s": disk_mb_s,
            "raw_disk_mb_s": raw_mb_s,
            "disk_utilization": utilization,
            "bound_tok_s": bound_tok_s,
            "tok_s_of_bound": bound_tok_s.map(|b| tok_s / b),
            "ram_hit_rate": decode.hit_rate(),
            "prefill_hit_rate": prefill.hit_rate(),
            "io_backend": backend.to_string(),
            "o_direct": o_direct,
            "queue_depth": queue_depth,
            "io_wait_s": decode.io_wait().as_secs_f64(),
            "io_wait_fraction": io_wait_fraction,
            "decode_s": decode_s,
            "read_latency_us": latency,
            "decode": decode,
            "prefill": prefill,
            "prefill_disk_bytes": first.bytes_read - start.bytes_read,
            "ram_budget_bytes": plan.ram_budget_bytes,
            "cache_slots": plan.cache_slots(),
            "staging_bytes": plan.staging_bytes,
            "all_experts_bytes": plan.all_experts_bytes,
            "raw": raw_report,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!(
            "model {}: {} prompt tokens, {} generated; {} {}, queue depth {}",
            dir.display(),
            prompt_len,
            generated,
            backend,
            if o_direct {
                "O_DIRECT"
            } else {
                "buffered (O_DIRECT refused; ranges dropped after each read)"
            },
            queue_depth
        );
        println!(
            "budget {} for experts ({} cache slots; all experts {}), staging {}",
            ByteSize(plan.ram_budget_bytes),
            plan.cache_slots(),
            ByteSize(plan.all_experts_bytes),
            ByteSize(plan.staging_bytes)
        );
        println!(
            "time to first token {:.3} s ({} read, hit rate {:.1}%)",
            ttft_s,
            ByteSize(first.bytes_read - start.bytes_read),
            prefill.hit_rate() * 100.0
        );
        println!(
            "decode {:.2} tok/s; {} read per token at {:.1} MB/s; RAM hit rate {:.1}%",
            tok_s,
            ByteSize(bytes_per_token as u64),
            disk_mb_s,
            decode.hit_rate() * 100.0
        );
        println!(
            "blocked on reads {:.1}% of decode time; read latency p50 {:.0} us, p90 {:.0} us, \
             p99 {:.0} us, max {:.0} us ({} reads)",
            io_wait_fraction * 100.0,
            latency.p50_us,
            latency.p90_us,
            latency.p99_us,
            latency.max_us,
            latency.reads
        );
        println!(
            "raw disk {:.1} MB/s ({} blocks of {}, queue depth {}, {}): decode used {:.1}% of it",
            raw_mb_s,
            raw_report.reads,
            ByteSize(block),
            queue_depth,
            largest.display(),
            utilization * 100.0
        );
        match bound_tok_s {
            Some(bound) => println!(
                "physical bound (disk bytes per token / raw bandwidth): {:.2} tok/s; measured \
                 {:.2} tok/s = {:.1}% of it",
                bound,
                tok_s,
                tok_s / bound * 100.0
            ),
            None => println!(
                "physical bound: none from the disk (nothing was read during decode: every \
                 expert was in RAM); decode is compute-bound at {tok_s:.2} tok/s"
            ),
        }
    }
    Ok(())
}
