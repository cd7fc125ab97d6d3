//! Replays a routing trace (`colibri run --routing-trace FILE ...`) through
//! the real RAM tier and prefetch logic, over a synthetic file of tiny
//! experts: hit rate, prefetch recall and waste of every predictor at
//! several cache sizes, offline, without the model or its disk.
//!
//! ```text
//! colibri run -m MODEL --prompt ... -n 256 --routing-trace trace.jsonl
//! cargo run --release -p colibri-sched --example prefetch_replay -- trace.jsonl \
//!     [--cache 0,0.1,0.25,0.5] [--queue-depth 16] [--no-settle] [--json]
//! ```
//!
//! `--cache` lists cache sizes as shares of all routed experts. By default
//! each layer's prefetch reads are waited for before the next layer's
//! fetch (compute hides them fully: an upper bound of what prefetch can
//! do); `--no-settle` lets them race the fetches with no compute at all (a
//! lower bound). The predictors' set scores (how many of each layer's
//! experts they guessed) do not depend on the cache and are printed once.
//!
//! A trace from a random-weight model says little about a real one: real
//! routers are trained, and real routing is far from i.i.d. (LESSONS.md).

use std::path::PathBuf;

use colibri_sched::prefetch::Predictor;
use colibri_sched::prefetch::replay::{ReplayConfig, ReplayReport, SyntheticExperts, replay};
use colibri_sched::prefetch::trace::Trace;

struct Args {
    trace: PathBuf,
    cache: Vec<f64>,
    queue_depth: usize,
    settle: bool,
    json: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let mut args = Args {
        trace: PathBuf::new(),
        cache: vec![0.0, 0.1, 0.25, 0.5],
        queue_depth: 16,
        settle: true,
        json: false,
    };
    let mut trace = None;
    while let Some(a) = it.next() {
        match a.as_str() {
            "--cache" => {
                let v = it.next().ok_or("--cache needs a list")?;
                args.cache = v
                    .split(',')
                    .map(|x| {
                        x.trim()
                            .parse::<f64>()
                            .map_err(|e| format!("--cache {x}: {e}"))
                    })
                    .collect::<Result<_, _>>()?;
            }
            "--queue-depth" => {
                let v = it.next().ok_or("--queue-depth needs a number")?;
                args.queue_depth = v.parse().map_err(|e| format!("--queue-depth {v}: {e}"))?;
            }
            "--no-settle" => args.settle = false,
            "--json" => args.json = true,
            "-h" | "--help" => {
                return Err("usage: prefetch_replay TRACE [--cache 0,0.1,0.25,0.5] \
                            [--queue-depth 16] [--no-settle] [--json]"
                    .into());
            }
            other if trace.is_none() && !other.starts_with('-') => {
                trace = Some(PathBuf::from(other))
            }
            other => return Err(format!("unexpected argument {other}")),
        }
    }
    args.trace = trace.ok_or("give a trace file")?;
    Ok(args)
}

fn percent(x: Option<f64>) -> String {
    x.map_or("-".into(), |x| format!("{:.1}%", x * 100.0))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse_args()?;
    let trace = Trace::read(&args.trace)?;
    let h = &trace.header;
    let work = tempfile::Builder::new()
        .prefix("colibri-replay")
        .tempdir_in(if std::path::Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        })?;
    let experts = SyntheticExperts::for_trace(work.path(), h)?;
    let mut reports: Vec<ReplayReport> = Vec::new();
    for &fraction in &args.cache {
        for predictor in std::iter::once(None).chain(Predictor::ALL.into_iter().map(Some)) {
            reports.push(replay(
                &trace,
                &experts,
                &ReplayConfig {
                    predictor,
                    cache_fraction: fraction,
                    queue_depth: args.queue_depth,
                    settle: args.settle,
                    ..ReplayConfig::default()
                },
            )?);
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&reports)?);
        return Ok(());
    }
    println!(
        "{}: {} records, {} MoE layers x {} experts (top-{}), model {}",
        args.trace.display(),
        trace.records.len(),
        h.moe_layers.len(),
        h.experts_per_layer,
        h.top_k,
        h.model
    );
    if let Some(first) = reports.first() {
        println!("guesses as sets (cache-independent):");
        for s in &first.scores {
            println!(
                "  {:<12} recall {:>6}  precision {:>6}  wrong per right {}",
                s.predictor.name(),
                percent(s.recall()),
                percent(s.precision()),
                s.wrong_per_right()
                    .map_or("-".into(), |w| format!("{w:.2}"))
            );
        }
    }
    println!(
        "through the tier ({}):",
        if args.settle {
            "each layer's prefetch lands before the next fetch"
        } else {
            "prefetch races the fetches, no compute"
        }
    );
    println!(
        "  {:>6} {:<12} {:>8} {:>9} {:>8} {:>7} {:>11}",
        "cache", "prefetch", "hit rate", "cache hit", "recall", "waste", "reads/step"
    );
    for r in &reports {
        println!(
            "  {:>5.0}% {:<12} {:>8} {:>9} {:>8} {:>7} {:>11.1}",
            r.cache_fraction * 100.0,
            r.predictor.map_or("off", Predictor::name),
            percent(Some(r.hit_rate)),
            percent(Some(r.cache_hit_rate)),
            percent(r.prefetch_recall),
            r.prefetch_waste.map_or("-".into(), |w| format!("{w:.2}")),
            r.reads_per_step
        );
    }
    Ok(())
}
