//! The raw benchmark runs through the real reader and reports coherent
//! figures (no timing assertions: only that the numbers hang together).

mod common;

use colibri_io::bench::{self, AccessPattern, BenchLimit, RawBenchConfig};
use colibri_io::{Backend, IoBackendChoice};
use common::*;

#[test]
fn raw_benchmark_reports_coherent_figures_on_every_backend() {
    let Some(place) = direct_place().or_else(tmpfs_place) else {
        return;
    };
    let path = write_file(place.dir.path(), "bench.bin", &random_bytes(5, 8 << 20));
    for backend in backends() {
        for pattern in [AccessPattern::Random, AccessPattern::Sequential] {
            let report = bench::raw_with(
                &path,
                &RawBenchConfig {
                    block_size: 64 * 1024,
                    queue_depth: 4,
                    backend,
                    pattern,
                    limit: BenchLimit {
                        max_bytes: Some(4 << 20),
                        max_duration: None,
                    },
                    ..RawBenchConfig::default()
                },
            )
            .expect("bench");
            eprintln!("{}", report.summary());
            assert_eq!(report.reads, 64);
            assert_eq!(report.bytes, 4 << 20);
            assert_eq!(report.o_direct, place.direct);
            let expected = match backend {
                IoBackendChoice::Pread => Backend::Pread,
                _ => Backend::Uring,
            };
            assert_eq!(report.backend, expected);
            let l = report.latency_us;
            assert!(l.p50 <= l.p90 && l.p90 <= l.p99 && l.p99 <= l.p999 && l.p999 <= l.max * 1.001);
            assert!(report.mb_per_s > 0.0 && report.iops > 0.0);
            let json = serde_json::to_value(&report).expect("json");
            assert_eq!(json["block_size"], 65536);
            assert!(json["latency_us"]["p99"].is_number());
        }
    }
}

#[test]
fn queue_depth_sweep_measures_each_depth() {
    let Some(place) = direct_place().or_else(tmpfs_place) else {
        return;
    };
    let path = write_file(place.dir.path(), "sweep.bin", &random_bytes(6, 4 << 20));
    let sweep = bench::sweep_queue_depths(
        &path,
        &[1, 2, 8],
        &RawBenchConfig {
            block_size: 64 * 1024,
            limit: BenchLimit {
                max_bytes: Some(2 << 20),
                max_duration: None,
            },
            ..RawBenchConfig::default()
        },
    )
    .expect("sweep");
    let depths: Vec<usize> = sweep.points.iter().map(|p| p.queue_depth).collect();
    assert_eq!(depths, vec![1, 2, 8]);
    let picked = sweep.pick(0.9).expect("a depth");
    assert!(depths.contains(&picked));
    assert_eq!(sweep.pick(0.0), Some(1), "any depth reaches 0% of the best");
}

#[test]
fn block_sizes_that_break_alignment_are_refused_with_the_reason() {
    let Some(place) = direct_place() else {
        eprintln!("SKIP: no O_DIRECT file system here, so no alignment to break");
        return;
    };
    let path = write_file(place.dir.path(), "odd.bin", &random_bytes(7, 1 << 20));
    let error = bench::raw(&path, 1000, 1, IoBackendChoice::Auto, BenchLimit::default())
        .expect_err("1000 is not a multiple of the alignment");
    assert!(error.to_string().contains("alignment"), "{error}");
}
