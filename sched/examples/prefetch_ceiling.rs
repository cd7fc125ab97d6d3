//! What prefetch can buy on this machine at best: cold decode with prefetch
//! off, with the router-aware predictor, and with an *oracle* that
//! prefetches exactly the experts the next MoE layer will use (recorded
//! from an earlier identical greedy run), each on a fresh cold tier,
//! interleaved over several repetitions.
//!
//! ```text
//! cargo run --release -p colibri-sched --example prefetch_ceiling -- MODEL_DIR \
//!     [--ram-budget-mib 0] [--tokens 16] [--reps 4] [--threads 0] [--queue-depth 16] \
//!     [--prefetch-limit N]
//! ```
//!
//! The oracle has perfect recall and no waste, so the gap between it and
//! prefetch off is the most any predictor could gain here; the gap between
//! it and the router predictor is what that predictor's misses and waste
//! cost. On a drive-bound run (compute a small share of the time) the
//! ceiling is small: prefetch can only hide compute, never read fewer bytes.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use colibri_model::experts::{ExpertSource, ExpertWeights};
use colibri_model::sampling::SamplingParams;
use colibri_model::{Model, ModelError, Pool};
use colibri_sched::prefetch::{PrefetchOptions, Prefetcher};
use colibri_sched::tier::{TierCache, TierOptions, UsageMode, open_source};
use colibri_sched::{Engine, EngineOptions, GenRequest, Sequence};

/// Records the experts of every fetch, in order.
struct Recorder {
    inner: Arc<dyn ExpertSource>,
    fetches: Mutex<Fetches>,
}

impl ExpertSource for Recorder {
    fn fetch(
        &self,
        layer: usize,
        ids: &[usize],
        ready: &mut dyn FnMut(usize, Arc<ExpertWeights>) -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        if let Ok(mut f) = self.fetches.lock() {
            f.push((layer, ids.to_vec()));
        }
        self.inner.fetch(layer, ids, ready)
    }
}

/// Prefetches, with each fetch, exactly what the next fetch of the same
/// step will ask for (as recorded).
struct Oracle {
    tier: Arc<TierCache>,
    script: Fetches,
    next: AtomicUsize,
}

impl ExpertSource for Oracle {
    fn fetch(
        &self,
        layer: usize,
        ids: &[usize],
        ready: &mut dyn FnMut(usize, Arc<ExpertWeights>) -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        let guess: Vec<(usize, Vec<usize>)> = self
            .script
            .get(i + 1)
            .filter(|(l, _)| *l > layer)
            .cloned()
            .into_iter()
            .collect();
        self.tier.fetch_with_prefetch(layer, ids, &guess, ready)
    }
}

struct Args {
    model: PathBuf,
    budget: u64,
    tokens: usize,
    reps: usize,
    threads: usize,
    queue_depth: usize,
    prefetch_limit: Option<usize>,
}

fn parse_args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let mut a = Args {
        model: PathBuf::new(),
        budget: 0,
        tokens: 16,
        reps: 4,
        threads: 0,
        queue_depth: 16,
        prefetch_limit: None,
    };
    let mut model = None;
    while let Some(arg) = it.next() {
        let mut num = |name: &str| -> Result<u64, String> {
            let v = it.next().ok_or(format!("{name} needs a number"))?;
            v.parse().map_err(|e| format!("{name} {v}: {e}"))
        };
        match arg.as_str() {
            "--ram-budget-mib" => a.budget = num("--ram-budget-mib")? << 20,
            "--tokens" => a.tokens = num("--tokens")?.max(2) as usize,
            "--reps" => a.reps = num("--reps")?.max(1) as usize,
            "--threads" => a.threads = num("--threads")? as usize,
            "--queue-depth" => a.queue_depth = num("--queue-depth")?.max(1) as usize,
            "--prefetch-limit" => a.prefetch_limit = Some(num("--prefetch-limit")?.max(1) as usize),
            other if model.is_none() && !other.starts_with('-') => {
                model = Some(PathBuf::from(other))
            }
            other => return Err(format!("unexpected argument {other}")),
        }
    }
    a.model = model.ok_or("give a model directory")?;
    Ok(a)
}

enum Mode {
    Off,
    Router,
    Oracle(Fetches),
    Record,
}

/// Every fetch of a run: (layer, experts).
type Fetches = Vec<(usize, Vec<usize>)>;

/// One run's decode tok/s, the tier's decode counters and, when recording,
/// the fetches.
type RunResult = Result<(f64, colibri_sched::tier::TierStats, Fetches), Box<dyn std::error::Error>>;

/// One cold greedy decode.
fn run(a: &Args, mode: &Mode) -> RunResult {
    let dir: &Path = &a.model;
    let (model, src) = Model::load(dir)?;
    let options = TierOptions {
        ram_budget: Some(a.budget),
        pin_budget: Some(0),
        usage: UsageMode::Off,
        queue_depth: a.queue_depth,
        prefetch_limit: a.prefetch_limit,
        prefetch_layers: match mode {
            Mode::Off | Mode::Record => 0,
            _ => colibri_sched::engine::PREFETCH_LAYERS,
        },
        ..TierOptions::default()
    };
    let opened = open_source(&model, &src, dir, 0, &options)?;
    let tier = opened.tier.ok_or("experts are not streamed from disk")?;
    let pool = Arc::new(Pool::new(a.threads)?);
    let recorder = Arc::new(Recorder {
        inner: tier.clone(),
        fetches: Mutex::new(Vec::new()),
    });
    let experts: Arc<dyn ExpertSource> = match mode {
        Mode::Off => tier.clone(),
        Mode::Record => recorder.clone(),
        Mode::Router => Arc::new(Prefetcher::new(
            tier.clone(),
            &model,
            pool.clone(),
            &PrefetchOptions::default(),
        )?),
        Mode::Oracle(script) => Arc::new(Oracle {
            tier: tier.clone(),
            script: script.clone(),
            next: AtomicUsize::new(0),
        }),
    };
    let engine = Engine::with_pool(
        model,
        experts,
        pool,
        Default::default(),
        &EngineOptions::default(),
    )?;
    let mut seq = Sequence::new(
        &engine.model,
        GenRequest {
            prompt: (1..=16).collect(),
            max_tokens: a.tokens,
            sampling: SamplingParams::default(),
            stop: vec![],
            eos: vec![],
            ignore_eos: true,
            top_logprobs: None,
        },
        engine.context_len(),
        None,
    )?;
    let mut first = None;
    let mut n = 0;
    engine.generate(&mut seq, |_| {
        n += 1;
        if first.is_none() {
            first = Some((Instant::now(), tier.stats()));
        }
        true
    })?;
    let (t0, s0) = first.ok_or("no token")?;
    let tok_s = (n - 1) as f64 / t0.elapsed().as_secs_f64();
    let fetches = recorder
        .fetches
        .lock()
        .map(|f| f.clone())
        .unwrap_or_default();
    Ok((tok_s, tier.stats().since(&s0), fetches))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = parse_args()?;
    let (_, _, script) = run(&a, &Mode::Record)?;
    let oracle = Mode::Oracle(script);
    let modes: [(&str, &Mode); 3] = [
        ("off", &Mode::Off),
        ("router", &Mode::Router),
        ("oracle", &oracle),
    ];
    let mut results: Vec<(&str, Vec<f64>)> = modes.iter().map(|(n, _)| (*n, Vec::new())).collect();
    for rep in 0..a.reps {
        // Rotate the order so a drive that slows down over time favours
        // none of them.
        for k in 0..modes.len() {
            let (name, mode) = modes[(k + rep) % modes.len()];
            let (tok_s, s, _) = run(&a, mode)?;
            println!(
                "rep {rep} {name:<7} {tok_s:>6.2} tok/s  reads {} demand + {} prefetch, recall {}, \
                 waste {}",
                s.demand_reads,
                s.prefetch_reads,
                s.prefetch_recall()
                    .map_or("-".into(), |r| format!("{:.1}%", r * 100.0)),
                s.prefetch_waste().map_or("-".into(), |w| format!("{w:.2}"))
            );
            if let Some(r) = results.iter_mut().find(|(n, _)| *n == name) {
                r.1.push(tok_s);
            }
        }
    }
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let off = median(&results[0].1);
    for (name, v) in &results {
        println!(
            "{name:<7} median {:>6.2} tok/s ({:+.1}% vs off)",
            median(v),
            (median(v) / off - 1.0) * 100.0
        );
    }
    Ok(())
}
