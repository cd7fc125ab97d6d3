//! Runs the raw disk benchmark from the command line until the CLI's
//! `colibri bench-io --raw` exists:
//!
//! ```text
//! cargo run --release -p colibri-io --example bench_raw -- FILE \
//!     [--block-size BYTES] [--queue-depth Q] [--io auto|uring|pread] \
//!     [--sequential] [--seconds S] [--max-mib M] [--sweep 1,2,4,8] [--json]
//! ```

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use colibri_io::IoBackendChoice;
use colibri_io::bench::{self, AccessPattern, RawBenchConfig};

fn usage() -> ExitCode {
    eprintln!(
        "usage: bench_raw FILE [--block-size BYTES] [--queue-depth Q] [--io auto|uring|pread] \
         [--sequential] [--seconds S] [--max-mib M] [--sweep 1,2,4,8] [--json]"
    );
    ExitCode::from(2)
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let mut args = std::env::args().skip(1);
    let mut path = None;
    let mut config = RawBenchConfig::default();
    let mut sweep: Option<Vec<usize>> = None;
    let mut json = false;
    while let Some(arg) = args.next() {
        let mut value = || args.next().unwrap_or_default();
        match arg.as_str() {
            "--block-size" => match value().parse() {
                Ok(v) => config.block_size = v,
                Err(_) => return usage(),
            },
            "--queue-depth" => match value().parse() {
                Ok(v) => config.queue_depth = v,
                Err(_) => return usage(),
            },
            "--io" => match value().parse::<IoBackendChoice>() {
                Ok(v) => config.backend = v,
                Err(_) => return usage(),
            },
            "--sequential" => config.pattern = AccessPattern::Sequential,
            "--seconds" => match value().parse::<f64>() {
                Ok(v) => config.limit.max_duration = Some(Duration::from_secs_f64(v)),
                Err(_) => return usage(),
            },
            "--max-mib" => match value().parse::<u64>() {
                Ok(v) => config.limit.max_bytes = Some(v << 20),
                Err(_) => return usage(),
            },
            "--sweep" => {
                let depths: Result<Vec<usize>, _> = value().split(',').map(str::parse).collect();
                match depths {
                    Ok(d) if !d.is_empty() => sweep = Some(d),
                    _ => return usage(),
                }
            }
            "--json" => json = true,
            _ if path.is_none() && !arg.starts_with("--") => path = Some(PathBuf::from(arg)),
            _ => return usage(),
        }
    }
    let Some(path) = path else { return usage() };
    let result = match sweep {
        Some(depths) => bench::sweep_queue_depths(&path, &depths, &config).map(|sweep| {
            for point in &sweep.points {
                if json {
                    println!("{}", serde_json::to_string(point).unwrap_or_default());
                } else {
                    println!("{}", point.summary());
                }
            }
            println!("picked queue depth (95% of best): {:?}", sweep.pick(0.95));
        }),
        None => bench::raw_with(&path, &config).map(|report| {
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&report).unwrap_or_default()
                );
            } else {
                println!("{}", report.summary());
            }
        }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}
