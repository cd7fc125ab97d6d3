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
//!
//!   Time is accounted three ways: computing alone, blocked on reads, and
//!   computing while reads were in flight (the overlap prefetch buys):
//!   `io_wait` is the time `fetch` was blocked, `io_busy` the time the
//!   reader had a read in the kernel, and the reader's busy time sampled
//!   around each wait says how much of the blocked time the drive was
//!   busy; busy time outside the waits ran under compute. Prefetch is judged by its recall (the
//!   share of demand misses a prefetch had covered or started) and waste
//!   (bytes prefetched and never used, per prefetched byte used), and, with
//!   `--compare-prefetch`, by tokens/s against the same run without it and
//!   with each other predictor (each a fresh, cold tier). With
//!   `--compare-prefetch` the main run also scores every predictor as sets
//!   (how many of each layer's experts it guessed), at the cost of the
//!   router products the active one does not need; without it the main
//!   run does only what serving does, so its tokens/s are a user's.
//! - `--model DIR --warm`: the same decode with every routed expert read
//!   into RAM first, against the memory-bandwidth roofline: weight bytes a
//!   decode token reads (dense weights + top-k experts per MoE layer) over
//!   the read bandwidth of the compute threads, measured in the same run:
//!   a read pass every `--bandwidth-window` tokens (their time left out of
//!   the decode's), so that each window of tokens is also compared with the
//!   bandwidth measured on either side of it. Shared hosts drift by tens of
//!   percent within minutes; a pass taken once after the decode compares
//!   the decode with another minute's memory.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use colibri_io::bench::{AccessPattern, BenchLimit, RawBenchConfig, RawReport, raw_with};
use colibri_io::{Backend, IoBackendChoice};
use colibri_model::kernels::pool::PoolTimes;
use colibri_model::sampling::SamplingParams;
use colibri_sched::gpu::{Attached, DeviceChoice, GpuOptions};
use colibri_sched::prefetch::{Predictor, PrefetchOptions, PrefetcherStats};
use colibri_sched::tier::plan::decode_bytes_per_token;
use colibri_sched::tier::{
    ByteSize, LatencySummary, QueueDepthMode, TierCache, TierOptions, TierStats, UsageMode,
};
use colibri_sched::{Engine, EngineOptions, GenRequest, Sequence};
use serde::Serialize;
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
    /// Reads in flight (default: 32 for --raw; for --model the engine's
    /// measured depth, as `run`).
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
    /// --model: block-quantized products on the exact dequantized weights, as
    /// `run --exact-quant` (default: 8-bit activations).
    #[arg(long)]
    pub exact_quant: bool,
    /// --model: decode without reading predicted experts ahead.
    #[arg(long, conflicts_with = "compare_prefetch")]
    pub no_prefetch: bool,
    /// --model: how cached experts are chosen for eviction (lru or slru,
    /// as on the model commands).
    #[arg(long, value_name = "lru|slru", default_value = "lru")]
    pub eviction: colibri_sched::tier::EvictionPolicy,
    /// --model: the predictor of the main run.
    #[arg(
        long,
        value_name = "next|next-two|cross-token|union",
        default_value = "next"
    )]
    pub predictor: Predictor,
    /// --model: also decode without prefetch and with every other predictor
    /// (each on a fresh, cold tier) and compare tokens/s.
    #[arg(long)]
    pub compare_prefetch: bool,
    /// --model: read every routed expert into RAM first (the RAM budget
    /// must hold them all) and measure decode against the memory-bandwidth
    /// roofline instead of the disk.
    #[arg(long, conflicts_with = "compare_prefetch")]
    pub warm: bool,
    /// --model: leave the engine idle this many seconds after the first
    /// token, as between a server's requests, before the decode (the idle
    /// filler reads favoured experts into free RAM meanwhile; the decode's
    /// figures and the time to first token leave the pause out).
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 0.0,
        conflicts_with = "warm"
    )]
    pub idle: f64,
    /// --warm: bytes of the memory bandwidth measurement (well above the
    /// last-level cache).
    #[arg(long, value_name = "SIZE", default_value = "512MiB")]
    pub bandwidth_bytes: ByteSize,
    /// --warm: decode tokens between two memory bandwidth measurements.
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..))]
    pub bandwidth_window: u64,
    /// --model: where the forward pass runs, as `run`: `cpu` (the
    /// default here), `cuda` (the GPU tier; experts still come from disk
    /// through the RAM tier and its staging ring), or `auto`.
    #[arg(long, value_name = "auto|cpu|cuda", default_value = "cpu")]
    pub device: DeviceChoice,
    /// --model with a GPU: device memory for dense weights, the KV cache
    /// and cached experts, as `run` (default: free VRAM minus a reserve).
    #[arg(long, value_name = "SIZE")]
    pub vram_budget: Option<ByteSize>,
    /// --model with GPUs: device ids, as `run` (several split the layers).
    #[arg(long, value_name = "IDS", value_delimiter = ',')]
    pub devices: Vec<usize>,
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
        (None, Some(dir)) => {
            colibri_model::kernels::set_exact_quant(args.exact_quant);
            model(&args, dir)
        }
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
#[derive(Clone)]
struct Phase {
    at: Instant,
    stats: TierStats,
    bytes_read: u64,
    busy_ns: u64,
    kernel_bytes: Option<u64>,
}

/// Where decode time went.
#[derive(Clone, Copy, Debug, Serialize)]
struct TimeSplit {
    /// Decode wall time.
    decode_s: f64,
    /// Computing with no read in flight.
    compute_only_s: f64,
    /// Computing while reads were in flight (I/O hidden under compute).
    overlap_s: f64,
    /// Blocked waiting for reads (or slots).
    io_wait_s: f64,
    /// Of the blocked time, the part with a read in the kernel; the rest is
    /// the hand-over from a finished read to the computing thread (or a
    /// wait for a slot).
    io_wait_drive_busy_s: f64,
    /// With at least one read in the kernel.
    io_busy_s: f64,
}

impl TimeSplit {
    fn of(decode_s: f64, io_wait_s: f64, io_wait_busy_s: f64, io_busy_s: f64) -> TimeSplit {
        let overlap_s = (io_busy_s - io_wait_busy_s).max(0.0);
        TimeSplit {
            decode_s,
            compute_only_s: (decode_s - io_wait_s - overlap_s).max(0.0),
            overlap_s,
            io_wait_s,
            io_wait_drive_busy_s: io_wait_busy_s,
            io_busy_s,
        }
    }
}

/// One cold decode run.
#[derive(Clone, Debug, Serialize)]
struct DecodeRun {
    /// Where the forward pass ran (`cpu`, or the GPU tier's summary).
    compute: String,
    /// `None`: prefetch off.
    predictor: Option<Predictor>,
    tokens: usize,
    tok_s: f64,
    /// Tokens in the prompt (its prefill is `ttft_s`).
    prompt_tokens: usize,
    ttft_s: f64,
    disk_bytes_per_token: f64,
    disk_read_mb_s: f64,
    ram_hit_rate: f64,
    prefill_hit_rate: f64,
    io_wait_fraction: f64,
    prefetch_recall: Option<f64>,
    prefetch_waste: Option<f64>,
    time: TimeSplit,
    read_latency_us: LatencySummary,
    decode: TierStats,
    prefill: TierStats,
    prefill_disk_bytes: u64,
    /// --idle: what the tier did during the pause.
    idle: TierStats,
    prefetcher: Option<PrefetcherStats>,
    /// What the kernel counted as read from the model's block device
    /// during the decode (None where /proc/diskstats does not say).
    kernel_decode_bytes: Option<u64>,
    /// --warm: the memory bandwidth measured between decode tokens.
    #[serde(skip)]
    bandwidth: Vec<BandwidthMark>,
    /// Milliseconds from each generated token to the next (the read
    /// passes between tokens left out): a decode step's stalls.
    #[serde(skip)]
    token_gaps_ms: Vec<f64>,
    /// Times a compute worker parked during the decode: each costs a
    /// wake-up at the next job (docs/benchmarks.md).
    pool_parks: u64,
    /// The decode thread's time between its pool jobs and at their ends
    /// (the bandwidth probe's passes left out).
    #[serde(skip)]
    pool_times: colibri_model::kernels::pool::PoolTimes,
    /// The GPU tier's counters over the decode (None on the CPU tier).
    gpu: Option<colibri_sched::gpu::GpuStats>,
}

impl DecodeRun {
    /// Compute workers' parks per decode token (the first token ends the
    /// prefill).
    fn parks_per_token(&self) -> f64 {
        self.pool_parks as f64 / self.tokens.saturating_sub(1).max(1) as f64
    }

    /// Shares of the decode's time the decode thread spent alone between
    /// its pool jobs, and waiting at their ends for other threads' last
    /// tasks.
    fn pool_shares(&self) -> (f64, f64) {
        let decode_s = (self.tokens.saturating_sub(1).max(1) as f64 / self.tok_s).max(1e-9);
        (
            self.pool_times.between.as_secs_f64() / decode_s,
            self.pool_times.end_wait.as_secs_f64() / decode_s,
        )
    }
}

/// Where the decode thread's time went around its compute jobs: on many
/// cores, its serial work between jobs and the jobs' uneven ends, not the
/// kernels, set the pace (docs/benchmarks.md).
fn print_pool_shares(run: &DecodeRun) {
    let (between, end_wait) = run.pool_shares();
    println!(
        "the decode thread alone between its compute jobs {:.1}% of the decode (its serial work, \
         and any wait for a read there); waiting at the jobs' ends for other threads' last tasks {:.1}%",
        between * 100.0,
        end_wait * 100.0
    );
}

/// One memory bandwidth measurement taken between two decode tokens.
#[derive(Clone, Debug)]
struct BandwidthMark {
    /// Tokens generated when it was taken.
    generated: usize,
    gb_s: f64,
    began: Instant,
    ended: Instant,
}

/// Tokens between two bandwidth marks against the bandwidth measured on
/// either side of them.
#[derive(Serialize)]
struct BandwidthWindow {
    /// Tokens generated before it began.
    first: usize,
    tokens: usize,
    tok_s: f64,
    gb_s: f64,
}

fn bandwidth_windows(marks: &[BandwidthMark]) -> Vec<BandwidthWindow> {
    marks
        .windows(2)
        .filter(|w| w[1].generated > w[0].generated)
        .map(|w| {
            let tokens = w[1].generated - w[0].generated;
            let secs = w[1].began.duration_since(w[0].ended).as_secs_f64();
            BandwidthWindow {
                first: w[0].generated,
                tokens,
                tok_s: tokens as f64 / secs.max(1e-9),
                gb_s: (w[0].gb_s + w[1].gb_s) / 2.0,
            }
        })
        .collect()
}

/// What every run shares.
struct Setup<'a> {
    dir: &'a Path,
    prompt: Vec<u32>,
}

fn decode_run(
    args: &BenchIoArgs,
    setup: &Setup<'_>,
    predictor: Option<Predictor>,
    evaluate: bool,
) -> Result<(DecodeRun, Engine)> {
    let dir = setup.dir;
    let gpu = GpuOptions {
        device: args.device,
        vram_budget: args.vram_budget.map(ByteSize::bytes),
        devices: args.devices.clone(),
        ahead: if args.no_prefetch {
            0
        } else {
            colibri_sched::gpu::DEFAULT_AHEAD
        },
        ..GpuOptions::default()
    };
    let options = TierOptions {
        ram_budget: args.ram_budget.map(ByteSize::bytes),
        pin_budget: Some(0),
        io: args.io,
        queue_depth: args
            .queue_depth
            .unwrap_or(TierOptions::default().queue_depth),
        queue_depth_mode: match args.queue_depth {
            Some(_) => QueueDepthMode::Fixed,
            None => QueueDepthMode::measured(),
        },
        // A cold benchmark: nothing learned is used, nothing is recorded.
        usage: UsageMode::Off,
        // CPU tiles only for experts the CPU will compute.
        tile_q4_0: !colibri_sched::gpu::likely(&gpu),
        policy: args.eviction,
        ..TierOptions::default()
    };
    colibri_sched::gpu::preflight(&gpu).with_context(|| format!("--device {}", args.device))?;
    let mut engine = Engine::load(
        dir,
        &EngineOptions {
            threads: args.threads,
            // The KV reserve the planner sets aside is what this run
            // uses, not the model's default reserve (3 GiB of f32 keys
            // for 16 Ki positions of Qwen3-30B-A3B), which would be taken
            // from the expert cache.
            ctx: setup.prompt.len() + args.tokens,
            tier: options,
            prefetch: PrefetchOptions {
                enabled: predictor.is_some(),
                predictor: predictor.unwrap_or_default(),
                evaluate,
                ..PrefetchOptions::default()
            },
        },
    )
    .with_context(|| format!("loading model {}", dir.display()))?;
    let compute = match colibri_sched::gpu::attach(&mut engine, &gpu)
        .with_context(|| format!("--device {}", args.device))?
    {
        Attached::Gpu(summary) => format!("cuda: {summary}"),
        Attached::Cpu { reason: Some(why) } => format!("cpu (no usable GPU tier: {why})"),
        Attached::Cpu { reason: None } => "cpu".to_string(),
    };
    let Some(tier) = engine.tier.clone() else {
        bail!(
            "{}: its experts are not streamed from disk (no routed experts, or a layout \
             they cannot be located in), so there is no disk path to measure",
            dir.display()
        );
    };
    if args.warm {
        warm_up(&tier)?;
    }
    let mut seq = Sequence::new(
        &engine.model,
        GenRequest {
            prompt: setup.prompt.clone(),
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
    let device = block_device_of(dir);
    let snapshot = || {
        let reader = tier.reader_counters();
        Phase {
            at: Instant::now(),
            stats: tier.stats(),
            bytes_read: reader.bytes_read,
            busy_ns: reader.busy_ns,
            kernel_bytes: device.and_then(kernel_bytes_read),
        }
    };
    // --warm: a read pass at the first token, every `bandwidth_window`
    // tokens and at the last; the decode's time leaves them out.
    let probe = args.warm.then(|| {
        let bytes = usize::try_from(args.bandwidth_bytes.bytes()).unwrap_or(usize::MAX);
        colibri_model::kernels::BandwidthProbe::new(bytes)
    });
    let window = usize::try_from(args.bandwidth_window).unwrap_or(usize::MAX);
    let mut marks = Vec::new();
    let gpu_stats = || engine.gpu.as_ref().map(|g| g.stats());
    let start = snapshot();
    let mut first: Option<Phase> = None;
    let mut gpu_first = None;
    let mut generated = 0usize;
    let idle = Duration::try_from_secs_f64(args.idle)
        .with_context(|| format!("--idle {}: not a number of seconds", args.idle))?;
    // --idle: the prompt's end, before the pause.
    let mut prompt_end: Option<Phase> = None;
    let mut last_token: Option<Instant> = None;
    let mut token_gaps_ms = Vec::new();
    let mut parks_first = 0;
    let mut times_first = PoolTimes::default();
    let mut probe_times = PoolTimes::default();
    engine.generate(&mut seq, |_| {
        generated += 1;
        if let Some(last) = last_token {
            token_gaps_ms.push(last.elapsed().as_secs_f64() * 1e3);
        }
        if first.is_none() {
            if !idle.is_zero() {
                prompt_end = Some(snapshot());
                std::thread::sleep(idle);
            }
            first = Some(snapshot());
            parks_first = engine.pool.parks();
            times_first = engine.pool.times();
            gpu_first = gpu_stats();
            // Latencies from here on are the decode's.
            tier.read_latency(true);
        }
        if let Some(probe) = &probe
            && ((generated - 1).is_multiple_of(window) || generated == args.tokens)
        {
            let began = Instant::now();
            let before = engine.pool.times();
            let gb_s = probe.measure(&engine.pool, 3);
            let t = engine.pool.times().since(&before);
            probe_times.jobs += t.jobs;
            probe_times.between += t.between;
            probe_times.end_wait += t.end_wait;
            marks.push(BandwidthMark {
                generated,
                gb_s,
                began,
                ended: Instant::now(),
            });
        }
        last_token = Some(Instant::now());
        true
    })?;
    let end = snapshot();
    let Some(first) = first else {
        bail!("no token was generated");
    };
    let decode_tokens = generated.saturating_sub(1).max(1) as f64;
    let probing: Duration = marks.iter().map(|m| m.ended - m.began).sum();
    let decode_s = (end.at.duration_since(first.at).saturating_sub(probing))
        .as_secs_f64()
        .max(1e-9);
    let decode = end.stats.since(&first.stats);
    let prompt_end = prompt_end.unwrap_or_else(|| first.clone());
    let prefill = prompt_end.stats.since(&start.stats);
    let idle_stats = first.stats.since(&prompt_end.stats);
    let decode_bytes = end.bytes_read - first.bytes_read;
    let time = TimeSplit::of(
        decode_s,
        decode.io_wait().as_secs_f64(),
        Duration::from_nanos(decode.io_wait_busy_ns).as_secs_f64(),
        Duration::from_nanos(end.busy_ns - first.busy_ns).as_secs_f64(),
    );
    let run = DecodeRun {
        compute,
        predictor,
        tokens: generated,
        tok_s: (generated - 1) as f64 / decode_s,
        prompt_tokens: setup.prompt.len(),
        ttft_s: prompt_end.at.duration_since(start.at).as_secs_f64(),
        disk_bytes_per_token: decode_bytes as f64 / decode_tokens,
        disk_read_mb_s: decode_bytes as f64 / decode_s / 1e6,
        ram_hit_rate: decode.hit_rate(),
        prefill_hit_rate: prefill.hit_rate(),
        io_wait_fraction: time.io_wait_s / decode_s,
        prefetch_recall: decode.prefetch_recall(),
        prefetch_waste: decode.prefetch_waste(),
        time,
        read_latency_us: tier.read_latency(false),
        decode,
        prefill,
        prefill_disk_bytes: prompt_end.bytes_read - start.bytes_read,
        idle: idle_stats,
        prefetcher: engine.prefetcher.as_ref().map(|p| p.stats()),
        kernel_decode_bytes: match (first.kernel_bytes, end.kernel_bytes) {
            (Some(a), Some(b)) => Some(b.saturating_sub(a)),
            _ => None,
        },
        bandwidth: marks,
        token_gaps_ms,
        pool_parks: engine.pool.parks().saturating_sub(parks_first),
        pool_times: engine.pool.times().since(&times_first).since(&probe_times),
        gpu: match (gpu_first, gpu_stats()) {
            (Some(a), Some(b)) => Some(b.since(&a)),
            _ => None,
        },
    };
    Ok((run, engine))
}

/// The median and the longest of a decode's gaps between tokens (0 when
/// there was none).
struct TokenGaps {
    median: f64,
    max: f64,
}

impl TokenGaps {
    fn of(gaps_ms: &[f64]) -> TokenGaps {
        let mut sorted = gaps_ms.to_vec();
        sorted.sort_by(f64::total_cmp);
        TokenGaps {
            median: sorted.get(sorted.len() / 2).copied().unwrap_or(0.0),
            max: sorted.last().copied().unwrap_or(0.0),
        }
    }
}

/// Reads every routed expert into the RAM tier: the warm benchmark's
/// starting state. Fails, saying what is needed, if the budget cannot hold
/// them all.
fn warm_up(tier: &TierCache) -> Result<()> {
    let plan = tier.plan();
    let layout = tier.layout();
    let held = plan.cache_slots() + plan.pinned.len();
    if held < layout.len() {
        bail!(
            "--warm needs every routed expert in RAM, but the budget of {} holds {} of {} \
             (all experts: {}); pass a larger --ram-budget on a machine with the memory",
            ByteSize(plan.ram_budget_bytes),
            held,
            layout.len(),
            ByteSize(plan.all_experts_bytes)
        );
    }
    let started = Instant::now();
    let ids: Vec<usize> = (0..layout.experts_per_layer).collect();
    for (layer, base) in layout.base.iter().enumerate() {
        if base.is_none() {
            continue;
        }
        for chunk in ids.chunks(32) {
            tier.fetch_with_prefetch(layer, chunk, &[], &mut |_, _| Ok(()))
                .with_context(|| format!("reading the experts of layer {layer} into RAM"))?;
        }
    }
    tracing::info!(
        "--warm: {} experts ({}) read into RAM in {:.1} s",
        layout.len(),
        ByteSize(plan.all_experts_bytes),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The warm benchmark's report: decode against the memory roofline.
fn report_warm(args: &BenchIoArgs, dir: &Path, run: &DecodeRun, engine: &Engine) -> Result<()> {
    let Some(tier) = engine.tier.as_ref() else {
        bail!("no tier");
    };
    let bytes = args.bandwidth_bytes.bytes();
    let marks = &run.bandwidth;
    if marks.is_empty() {
        bail!("no memory bandwidth was measured during the decode");
    }
    let bandwidth_gb_s = marks.iter().map(|m| m.gb_s).sum::<f64>() / marks.len() as f64;
    let per_token = decode_bytes_per_token(&engine.model.weights, tier.layout());
    let per_token_f = per_token.max(1) as f64;
    let roofline = bandwidth_gb_s * 1e9 / per_token_f;
    // The KV cache a decode step reads besides the weights: the weights'
    // bound leaves it out, and after a long prompt it is a few percent of
    // the bytes (a second bound counts it).
    let kv = |tokens: std::ops::RangeInclusive<usize>| {
        kv_bytes_per_token(&engine.model.spec, run.prompt_tokens, tokens)
    };
    let kv_per_token = kv(2..=run.tokens);
    let roofline_kv = bandwidth_gb_s * 1e9 / (per_token_f + kv_per_token);
    let windows = bandwidth_windows(marks);
    let spread = |bytes: &dyn Fn(&BandwidthWindow) -> f64| {
        let mut ratios: Vec<f64> = windows
            .iter()
            .map(|w| w.tok_s / (w.gb_s * 1e9 / bytes(w)))
            .collect();
        ratios.sort_by(f64::total_cmp);
        (
            ratios.get(ratios.len() / 2).copied().unwrap_or(f64::NAN),
            ratios.first().copied().unwrap_or(f64::NAN),
            ratios.last().copied().unwrap_or(f64::NAN),
        )
    };
    let (median, lowest, highest) = spread(&|_| per_token_f);
    let (median_kv, _, _) = spread(&|w| per_token_f + kv(w.first + 1..=w.first + w.tokens));
    let (bw_low, bw_high) = marks.iter().fold((f64::MAX, 0.0f64), |(lo, hi), m| {
        (lo.min(m.gb_s), hi.max(m.gb_s))
    });
    let decode_disk = run.disk_bytes_per_token * (run.tokens.saturating_sub(1).max(1)) as f64;
    let prefill_tok_s = run.prompt_tokens as f64 / run.ttft_s;
    let token_ms = TokenGaps::of(&run.token_gaps_ms);
    if args.json {
        let v = json!({
            "model": dir.display().to_string(),
            "warm": true,
            "tokens": run.tokens,
            "threads": engine.pool.threads(),
            "kernels": colibri_model::kernels::kernels().name,
            "tok_s": run.tok_s,
            "prompt_tokens": run.prompt_tokens,
            "ttft_s": run.ttft_s,
            "prefill_tok_s": prefill_tok_s,
            "prefill_over_decode": prefill_tok_s / run.tok_s,
            "weight_bytes_per_token": per_token,
            "memory_read_gb_s": bandwidth_gb_s,
            "memory_read_gb_s_range": [bw_low, bw_high],
            "roofline_tok_s": roofline,
            "tok_s_of_roofline": run.tok_s / roofline,
            "kv_bytes_per_token": kv_per_token,
            "roofline_with_kv_tok_s": roofline_kv,
            "tok_s_of_roofline_with_kv": run.tok_s / roofline_kv,
            "window_of_roofline_with_kv_median": median_kv,
            "windows": windows,
            "window_of_roofline_median": median,
            "window_of_roofline_range": [lowest, highest],
            "token_ms_median": token_ms.median,
            "token_ms_max": token_ms.max,
            "pool_parks_per_token": run.parks_per_token(),
            "pool_between_jobs_fraction": run.pool_shares().0,
            "pool_end_wait_fraction": run.pool_shares().1,
            "ram_hit_rate": run.ram_hit_rate,
            "decode_disk_bytes": decode_disk,
            "time": run.time,
            "decode": run.decode,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "model {} (warm: every expert in RAM), {} tokens, {} threads, {} kernels",
        dir.display(),
        run.tokens,
        engine.pool.threads(),
        colibri_model::kernels::kernels().name
    );
    println!(
        "prefill {} prompt tokens in {:.2} s: {:.2} tok/s, {:.2}× the decode per token",
        run.prompt_tokens,
        run.ttft_s,
        prefill_tok_s,
        prefill_tok_s / run.tok_s
    );
    println!(
        "decode {:.2} tok/s; RAM hit rate {:.1}%, {} read from disk during decode",
        run.tok_s,
        run.ram_hit_rate * 100.0,
        ByteSize(decode_disk as u64)
    );
    println!(
        "from token to token: median {:.1} ms, longest {:.1} ms; compute workers parked {:.1} times a token",
        token_ms.median,
        token_ms.max,
        run.parks_per_token()
    );
    print_pool_shares(run);
    println!(
        "memory read bandwidth {:.2} GB/s (mean of {} passes between tokens, {:.2}–{:.2}; \
         {} threads, {}); weights read per token {}",
        bandwidth_gb_s,
        marks.len(),
        bw_low,
        bw_high,
        engine.pool.threads(),
        ByteSize(bytes),
        ByteSize(per_token)
    );
    println!(
        "physical bound (weight bytes per token / memory bandwidth): {:.2} tok/s; measured \
         {:.2} tok/s = {:.1}% of it",
        roofline,
        run.tok_s,
        run.tok_s / roofline * 100.0
    );
    println!(
        "per window of {} tokens against the bandwidth measured on either side of it: \
         median {:.1}% of the bound ({:.1}–{:.1}% over {} windows)",
        args.bandwidth_window,
        median * 100.0,
        lowest * 100.0,
        highest * 100.0,
        windows.len()
    );
    println!(
        "with the KV cache the decode reads ({} per token in the mean, f32, positions {}–{}): \
         bound {:.2} tok/s; measured {:.1}% of it, windows' median {:.1}%",
        ByteSize(kv_per_token as u64),
        run.prompt_tokens,
        (run.prompt_tokens + run.tokens).saturating_sub(2),
        roofline_kv,
        run.tok_s / roofline_kv * 100.0,
        median_kv * 100.0
    );
    Ok(())
}

/// The mean KV cache bytes read by the decode steps that produced
/// generated tokens `tokens` (1-based; the first ends the prefill, so
/// token `g ≥ 2` came from the step at position `prompt + g − 2`).
fn kv_bytes_per_token(
    spec: &colibri_model::ModelSpec,
    prompt: usize,
    tokens: std::ops::RangeInclusive<usize>,
) -> f64 {
    let steps: Vec<u64> = tokens
        .filter(|&g| g >= 2)
        .map(|g| spec.kv_bytes_read_at(prompt + g - 2))
        .collect();
    steps.iter().sum::<u64>() as f64 / steps.len().max(1) as f64
}

fn name(predictor: Option<Predictor>) -> &'static str {
    predictor.map_or("off", Predictor::name)
}

fn percent(x: Option<f64>) -> String {
    x.map_or("-".into(), |x| format!("{:.1}%", x * 100.0))
}

fn model(args: &BenchIoArgs, dir: &Path) -> Result<()> {
    if args.tokens < 2 {
        bail!("--tokens must be at least 2 (the first token ends the prefill)");
    }
    if args.warm && args.device != DeviceChoice::Cpu {
        bail!(
            "--warm measures the CPU tier against the host's memory bandwidth; \
             use it with --device cpu (GPU decode speed: `cargo run -p colibri-sched \
             --release --example gpu_decode`)"
        );
    }
    // The prompt needs the vocabulary size; the spec is enough (any source).
    let (spec, _) = colibri_model::source::open_source(dir)
        .with_context(|| format!("reading the spec of {}", dir.display()))?;
    let vocab = spec.vocab_size as u32;
    let prompt = match &args.prompt_tokens {
        Some(text) => parse_token_ids(text)?,
        None => (1..=16u32).map(|t| t % vocab.max(1)).collect(),
    };
    let prompt_len = prompt.len();
    let setup = Setup { dir, prompt };
    let main_predictor = (!args.no_prefetch).then_some(args.predictor);
    // With --compare-prefetch the main run scores every predictor's
    // guesses (extra router products per layer); the comparison runs do
    // not, so their tokens/s are what each setting costs. Without it the
    // main run is the setting as served.
    let evaluate = main_predictor.is_some() && args.compare_prefetch;
    let (run, engine) = decode_run(args, &setup, main_predictor, evaluate)?;
    if args.warm {
        return report_warm(args, dir, &run, &engine);
    }
    let Some(tier) = engine.tier.clone() else {
        bail!("no tier");
    };

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
    let queue_depth = tier.backend().queue_depth;
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
        run.disk_read_mb_s / raw_mb_s
    } else {
        0.0
    };
    // missed expert bytes per token / raw bandwidth, as tokens per second.
    let bytes_per_token = run.disk_bytes_per_token;
    let bound_tok_s = (bytes_per_token > 0.0).then(|| raw_mb_s * 1e6 / bytes_per_token);
    let tok_s = run.tok_s;
    let token_ms = TokenGaps::of(&run.token_gaps_ms);
    let plan = tier.plan().clone();
    let measured_depth = tier.measured_depth().cloned();
    let o_direct = files.all_direct();
    // Each comparison loads the model again with a fresh, cold tier: the
    // main run's tier must be gone first, or a memory cap that fits one
    // tier would kill the process holding two.
    drop((tier, engine));
    let mut compared = Vec::new();
    if args.compare_prefetch {
        let others = std::iter::once(None).chain(Predictor::ALL.into_iter().map(Some));
        for predictor in others {
            let (r, _) = decode_run(args, &setup, predictor, false)?;
            compared.push(r);
        }
    }
    let off_tok_s = compared
        .iter()
        .find(|r| r.predictor.is_none())
        .map(|r| r.tok_s);

    if args.json {
        let mut v = json!({
            "model": dir.display().to_string(),
            "compute": run.compute,
            "prompt_tokens": prompt_len,
            "tokens": run.tokens,
            "tok_s": tok_s,
            "ttft_s": run.ttft_s,
            "disk_bytes_per_token": bytes_per_token,
            "disk_read_mb_s": run.disk_read_mb_s,
            "raw_disk_mb_s": raw_mb_s,
            "disk_utilization": utilization,
            "bound_tok_s": bound_tok_s,
            "tok_s_of_bound": bound_tok_s.map(|b| tok_s / b),
            "ram_hit_rate": run.ram_hit_rate,
            "prefill_hit_rate": run.prefill_hit_rate,
            "io_backend": backend.to_string(),
            "o_direct": o_direct,
            "queue_depth": queue_depth,
            "queue_depth_measured": measured_depth.as_ref(),
            "io_wait_s": run.time.io_wait_s,
            "io_wait_fraction": run.io_wait_fraction,
            "time": run.time,
            "decode_s": run.time.decode_s,
            "prefetch": name(run.predictor),
            "prefetch_recall": run.prefetch_recall,
            "prefetch_waste": run.prefetch_waste,
            "prefetcher": run.prefetcher,
            "gpu_decode": run.gpu,
            "read_latency_us": run.read_latency_us,
            "decode": run.decode,
            "prefill": run.prefill,
            "prefill_disk_bytes": run.prefill_disk_bytes,
            "ram_budget_bytes": plan.ram_budget_bytes,
            "cache_slots": plan.cache_slots(),
            "staging_bytes": plan.staging_bytes,
            "all_experts_bytes": plan.all_experts_bytes,
            "raw": raw_report,
            "compare_prefetch": args.compare_prefetch.then_some(&compared),
            "prefetch_speedup": off_tok_s.map(|off| tok_s / off),
            "kernel_decode_disk_bytes": run.kernel_decode_bytes,
            "decode_disk_bytes": run.disk_bytes_per_token * (run.tokens.saturating_sub(1).max(1)) as f64,
            "kernel_over_counted": run.kernel_decode_bytes.map(|k| {
                k as f64 / (run.disk_bytes_per_token * (run.tokens.saturating_sub(1).max(1)) as f64).max(1.0)
            }),
        });
        // Beside the rest (one json! of all of it nests too deep).
        v["idle"] = json!({ "seconds": args.idle, "tier": run.idle });
        v["token_ms_median"] = json!(token_ms.median);
        v["token_ms_max"] = json!(token_ms.max);
        v["pool_parks_per_token"] = json!(run.parks_per_token());
        v["pool_between_jobs_fraction"] = json!(run.pool_shares().0);
        v["pool_end_wait_fraction"] = json!(run.pool_shares().1);
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "model {}: {} prompt tokens, {} generated; {} {}, queue depth {}{}",
        dir.display(),
        prompt_len,
        run.tokens,
        backend,
        if o_direct {
            "O_DIRECT"
        } else {
            "buffered (O_DIRECT refused; ranges dropped after each read)"
        },
        queue_depth,
        match measured_depth.as_ref() {
            Some(m) => format!(
                " (measured: {} MB/s at depths {})",
                m.points
                    .iter()
                    .map(|(_, mb, _)| format!("{mb:.0}"))
                    .collect::<Vec<_>>()
                    .join("/"),
                m.points
                    .iter()
                    .map(|(d, _, _)| d.to_string())
                    .collect::<Vec<_>>()
                    .join("/")
            ),
            None => String::new(),
        }
    );
    println!("compute: {}", run.compute);
    println!(
        "budget {} for experts ({} cache slots; all experts {}), staging {}",
        ByteSize(plan.ram_budget_bytes),
        plan.cache_slots(),
        ByteSize(plan.all_experts_bytes),
        ByteSize(plan.staging_bytes)
    );
    println!(
        "time to first token {:.3} s ({} prompt tokens, {:.2} tok/s; {} read, hit rate {:.1}%)",
        run.ttft_s,
        run.prompt_tokens,
        run.prompt_tokens as f64 / run.ttft_s,
        ByteSize(run.prefill_disk_bytes),
        run.prefill_hit_rate * 100.0
    );
    println!(
        "decode {:.2} tok/s; {} read per token at {:.1} MB/s; RAM hit rate {:.1}%",
        tok_s,
        ByteSize(bytes_per_token as u64),
        run.disk_read_mb_s,
        run.ram_hit_rate * 100.0
    );
    println!(
        "from token to token: median {:.1} ms, longest {:.1} ms; compute workers parked {:.1} times a token",
        token_ms.median,
        token_ms.max,
        run.parks_per_token()
    );
    print_pool_shares(&run);
    if let Some(k) = run.kernel_decode_bytes {
        let counted = bytes_per_token * (run.tokens.saturating_sub(1).max(1)) as f64;
        println!(
            "kernel disk counters during decode: {} read from the model's device ({:.2}× what colibri counted)",
            ByteSize(k),
            k as f64 / counted.max(1.0)
        );
    }
    let t = &run.time;
    println!(
        "decode time {:.2} s: computing alone {:.1}%, computing with reads in flight {:.1}%, \
         blocked on reads {:.1}% (drive busy for {:.1}% of it)",
        t.decode_s,
        t.compute_only_s / t.decode_s * 100.0,
        t.overlap_s / t.decode_s * 100.0,
        t.io_wait_s / t.decode_s * 100.0,
        if t.io_wait_s > 0.0 {
            t.io_wait_drive_busy_s / t.io_wait_s * 100.0
        } else {
            0.0
        }
    );
    if let Some(g) = &run.gpu {
        let tokens = run.tokens.saturating_sub(1).max(1) as u64;
        let lookups = (g.cache.hits + g.cache.misses).max(1);
        println!(
            "VRAM expert hits {:.1}%; host-to-device {} per token; copied ahead {:.1} experts \
             per token, {} of them used",
            100.0 * g.cache.hits as f64 / lookups as f64,
            ByteSize((g.expert_h2d_bytes + g.dense_h2d_bytes) / tokens),
            g.ahead_copied as f64 / tokens as f64,
            percent((g.ahead_copied > 0).then(|| g.ahead_used as f64 / g.ahead_copied as f64))
        );
        if g.in_place_passes > 0 || g.route_switches > 0 {
            println!(
                "read in place from pinned RAM: {:.1} experts ({}) per token, in {} of {} steps \
                 ({} route switches)",
                g.in_place_reads as f64 / tokens as f64,
                ByteSize(g.in_place_bytes / tokens),
                g.in_place_passes,
                g.passes,
                g.route_switches
            );
        }
    }
    let l = &run.read_latency_us;
    println!(
        "expert read latency, requested to usable (all its matrices' reads, the queue, \
         tiling): p50 {:.0} us, p90 {:.0} us, p99 {:.0} us, max {:.0} us ({} experts)",
        l.p50_us, l.p90_us, l.p99_us, l.max_us, l.reads
    );
    match &run.prefetcher {
        Some(p) => {
            println!(
                "prefetch ({}): recall {} of demand misses covered or started; waste {} \
                 (bytes never used per byte used); {} stale predictions dropped; paused in \
                 {} of {} passes (reads ahead mostly unused)",
                p.predictor,
                percent(run.prefetch_recall),
                run.prefetch_waste.map_or("-".into(), |w| format!("{w:.2}")),
                p.stale_dropped,
                p.paused_steps,
                p.steps
            );
            println!(
                "router products for the guesses: {} in {} passes, {:.3} ms per pass \
                 (none while paused)",
                p.guess_calls,
                p.steps,
                p.guess_ns as f64 / 1e6 / p.steps.max(1) as f64
            );
            println!("predictor guesses as sets (cache-independent), decode and prefill:");
            for s in &p.scores {
                println!(
                    "  {:<12} recall {:>6}  precision {:>6}  ({} of {} used experts guessed, \
                     {} guesses)",
                    s.predictor.name(),
                    percent(s.recall()),
                    percent(s.precision()),
                    s.correct,
                    s.actual,
                    s.predicted
                );
            }
        }
        None => println!("prefetch off"),
    }
    let (i, d) = (&run.idle, &run.decode);
    if i.fill_reads + d.fill_reads > 0 {
        println!(
            "filled while idle (free cache room, the experts the routers favour): {} reads \
             ({}) before the decode, {} during it; {} used by the decode ({} hits, {} joined \
             in flight), {} evicted unused",
            i.fill_reads,
            ByteSize(i.fill_read_bytes),
            d.fill_reads,
            d.fill_used(),
            d.fill_hits,
            d.fill_joined,
            d.fill_unused
        );
    }
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
    if !compared.is_empty() {
        println!("prefetch compared (fresh cold tier each):");
        for r in &compared {
            println!(
                "  {:<12} {:>7.2} tok/s{}  recall {:>6}  waste {:>5}  blocked on reads {:>5.1}%  \
                 {} read per token",
                name(r.predictor),
                r.tok_s,
                match off_tok_s {
                    Some(off) if r.predictor.is_some() =>
                        format!(" ({:+.1}%)", (r.tok_s / off - 1.0) * 100.0),
                    _ => "         ".into(),
                },
                percent(r.prefetch_recall),
                r.prefetch_waste.map_or("-".into(), |w| format!("{w:.2}")),
                r.io_wait_fraction * 100.0,
                ByteSize(r.disk_bytes_per_token as u64)
            );
        }
    }
    Ok(())
}

/// The block device (major, minor) holding `path`.
fn block_device_of(path: &Path) -> Option<(u32, u32)> {
    use std::os::unix::fs::MetadataExt;
    let dev = std::fs::metadata(path).ok()?.dev();
    Some((libc::major(dev), libc::minor(dev)))
}

/// Bytes the kernel has read from block device `(major, minor)` since boot
/// (`/proc/diskstats`: sectors read × 512). The whole disk's line is used
/// when the path sits on a partition, since reads of a partition count
/// toward its disk too.
fn kernel_bytes_read((major, minor): (u32, u32)) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/diskstats").ok()?;
    text.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        let (ma, mi) = (
            f.first()?.parse::<u32>().ok()?,
            f.get(1)?.parse::<u32>().ok()?,
        );
        if (ma, mi) == (major, minor) {
            f.get(5)?.parse::<u64>().ok().map(|s| s * 512)
        } else {
            None
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_leave_out_the_passes_and_average_the_bandwidth_around_them() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mark = |generated, gb_s, began, ended| BandwidthMark {
            generated,
            gb_s,
            began: at(began),
            ended: at(ended),
        };
        // Passes of 100 ms between 16 tokens in 800 ms, then 8 in 400 ms.
        let marks = [
            mark(1, 30.0, 0, 100),
            mark(17, 40.0, 900, 1000),
            mark(25, 20.0, 1400, 1500),
        ];
        let w = bandwidth_windows(&marks);
        assert_eq!(w.len(), 2);
        assert_eq!(w[0].tokens, 16);
        assert!((w[0].tok_s - 20.0).abs() < 1e-9);
        assert!((w[0].gb_s - 35.0).abs() < 1e-9);
        assert_eq!(w[1].tokens, 8);
        assert!((w[1].tok_s - 20.0).abs() < 1e-9);
        assert!((w[1].gb_s - 30.0).abs() < 1e-9);
        // A last mark at the token of the one before adds no window.
        let same = [mark(1, 30.0, 0, 100), mark(1, 30.0, 100, 200)];
        assert!(bandwidth_windows(&same).is_empty());
    }
}
