//! `colibri plan`, `colibri bench-io` and the tier flags of `run`, run as
//! the real binary on the fixtures.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name)
}

/// Runs the binary with a private cache directory (no usage history of the
/// user's is read or written).
fn colibri(args: &[&str], cache: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_colibri"))
        .args(args)
        .env("XDG_CACHE_HOME", cache)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run colibri")
}

fn ok_json(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "exit {:?}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON on stdout")
}

#[test]
fn plan_prints_where_everything_lives() {
    let cache = tempfile::tempdir().unwrap();
    let model = fixture("deepseek_v3");
    let m = model.to_str().unwrap();
    let v = ok_json(&colibri(
        &["plan", "-m", m, "--ram-budget", "100KiB", "--json"],
        cache.path(),
    ));
    let plan = &v["plan"];
    assert_eq!(plan["ram_budget_bytes"], 100 * 1024);
    let committed = plan["pinned_bytes"].as_u64().unwrap() + plan["cache_bytes"].as_u64().unwrap();
    assert!(committed <= 100 * 1024);
    assert!(plan["staging_bytes"].as_u64().unwrap() > 0);
    assert!(plan["dense_bytes"].as_u64().unwrap() > 0);
    assert!(plan["expected"]["bytes_read_per_token"].as_f64().unwrap() > 0.0);
    assert_eq!(plan["expected"]["basis"], "uniform_routing");
    assert_eq!(plan["layers"].as_array().unwrap().len(), 2);
    assert!(v["io"]["backend"].is_string());

    let out = colibri(&["plan", "-m", m, "--ram-budget", "1.5G"], cache.path());
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "dense weights",
        "KV cache reserve",
        "staging slots",
        "expert budget 1.50 GiB",
        "experts per MoE layer",
        "uniform routing assumed",
        "I/O:",
    ] {
        assert!(text.contains(needle), "{needle} missing:\n{text}");
    }

    let out = colibri(&["plan", "-m", m, "--ram-budget", "12XB"], cache.path());
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("invalid size `12XB`"), "{err}");
}

#[test]
fn bench_io_model_reports_decode_against_the_raw_disk() {
    let cache = tempfile::tempdir().unwrap();
    let model = fixture("deepseek_v3_fp8");
    let v = ok_json(&colibri(
        &[
            "bench-io",
            "--model",
            model.to_str().unwrap(),
            "--ram-budget",
            "0",
            "--tokens",
            "8",
            "--seconds",
            "0.3",
            "--threads",
            "1",
            "--json",
        ],
        cache.path(),
    ));
    for key in [
        "tok_s",
        "ttft_s",
        "disk_bytes_per_token",
        "disk_read_mb_s",
        "raw_disk_mb_s",
        "disk_utilization",
        "ram_hit_rate",
        "io_backend",
        "io_wait_fraction",
        "bound_tok_s",
    ] {
        assert!(!v[key].is_null(), "{key} missing: {v}");
    }
    assert_eq!(v["tokens"], 8);
    assert!(v["tok_s"].as_f64().unwrap() > 0.0);
    // Nothing cached: every decode selection was read.
    assert_eq!(v["ram_hit_rate"].as_f64().unwrap(), 0.0);
    assert!(v["disk_bytes_per_token"].as_f64().unwrap() > 0.0);
    assert!(v["raw_disk_mb_s"].as_f64().unwrap() > 0.0);
    let wait = v["io_wait_fraction"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&wait), "{wait}");
    assert!(v["read_latency_us"]["reads"].as_u64().unwrap() > 0);
    // Nothing was recorded in the usage cache by a cold benchmark.
    assert!(!cache.path().join("colibri").exists());
}

#[test]
fn bench_io_raw_measures_a_file() {
    let cache = tempfile::tempdir().unwrap();
    let file = fixture("deepseek_v3").join("model.safetensors");
    let v = ok_json(&colibri(
        &[
            "bench-io",
            "--raw",
            file.to_str().unwrap(),
            "--block-size",
            "64KiB",
            "--queue-depth",
            "4",
            "--seconds",
            "0.2",
            "--io",
            "pread",
            "--json",
        ],
        cache.path(),
    ));
    assert_eq!(v["block_size"], 65536);
    assert_eq!(v["queue_depth"], 4);
    assert_eq!(v["backend"], "Pread");
    assert!(v["mb_per_s"].as_f64().unwrap() > 0.0);
}

#[test]
fn run_with_no_expert_cache_reproduces_the_reference() {
    let cache = tempfile::tempdir().unwrap();
    let model = fixture("qwen3_moe");
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("reference.json")).unwrap())
            .unwrap();
    let prompt: Vec<String> = r["prompt"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.to_string())
        .collect();
    let greedy = r["greedy"].as_array().unwrap();
    for io in ["uring", "pread"] {
        let v = ok_json(&colibri(
            &[
                "run",
                "-m",
                model.to_str().unwrap(),
                "--prompt-tokens",
                &prompt.join(","),
                "-n",
                &greedy.len().to_string(),
                "--ignore-eos",
                "--ram-budget",
                "0",
                "--io",
                io,
                "--json",
            ],
            cache.path(),
        ));
        assert_eq!(v["tokens"].as_array().unwrap(), greedy, "--io {io}");
    }
    // run records what it used, for the next start to pin.
    let usage = cache.path().join("colibri/usage");
    assert_eq!(std::fs::read_dir(usage).unwrap().count(), 1);
}
