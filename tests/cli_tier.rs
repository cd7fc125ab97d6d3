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
    // Where the threads would run, and which reader described the machine.
    let reader = if cfg!(feature = "hwloc") {
        "hwloc"
    } else {
        "sysfs"
    };
    let placement = &v["placement"];
    assert_eq!(placement["topology"], reader);
    assert!(!placement["compute_cpus"].as_array().unwrap().is_empty());

    let out = colibri(&["plan", "-m", m, "--ram-budget", "1.5G"], cache.path());
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let from = format!("(topology from {reader})");
    for needle in [
        "dense weights",
        "KV cache reserve",
        "staging slots",
        "expert budget 1.50 GiB",
        "experts per MoE layer",
        "uniform routing assumed",
        "I/O:",
        "compute thread",
        &from,
    ] {
        assert!(text.contains(needle), "{needle} missing:\n{text}");
    }

    let out = colibri(&["plan", "-m", m, "--ram-budget", "12XB"], cache.path());
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("invalid size `12XB`"), "{err}");
}

/// `token_ms_median` and `token_ms_max` of a `bench-io` report: the gaps
/// between tokens, in milliseconds, add up to the decode whose rate is
/// `tok_s`, so their mean is `1000 / tok_s`: the longest is at least that
/// and at most the whole decode, and the median at most twice it (half
/// the gaps or more are at least the median). Beside them, the compute
/// workers' parks per token: a whole count over the decode's tokens.
fn check_token_gaps(v: &serde_json::Value, threads: usize) {
    let (median, max, tok_s) = (
        v["token_ms_median"].as_f64().unwrap(),
        v["token_ms_max"].as_f64().unwrap(),
        v["tok_s"].as_f64().unwrap(),
    );
    let gaps = v["tokens"].as_f64().unwrap() - 1.0;
    let mean = 1e3 / tok_s;
    assert!(median > 0.0 && median <= max, "{v}");
    assert!(max >= 0.95 * mean && max <= 1.01 * gaps * mean, "{v}");
    assert!(median <= 2.0 * mean * 1.01, "{v}");
    let parks = v["pool_parks_per_token"].as_f64().unwrap() * gaps;
    assert!(parks >= 0.0 && (parks - parks.round()).abs() < 1e-6, "{v}");
    // Disjoint parts of the decode thread's time; with workers, every
    // token has serial work between its jobs (norms, routing, sampling).
    let between = v["pool_between_jobs_fraction"].as_f64().unwrap();
    let end_wait = v["pool_end_wait_fraction"].as_f64().unwrap();
    assert!(
        between >= 0.0 && end_wait >= 0.0 && between + end_wait <= 1.0,
        "{v}"
    );
    if threads > 1 {
        assert!(between > 0.0 && end_wait > 0.0, "{v}");
    } else {
        assert_eq!(
            (between, end_wait),
            (0.0, 0.0),
            "one thread publishes no job: {v}"
        );
    }
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
        "prefetch_recall",
        "queue_depth_measured",
        "compute",
    ] {
        assert!(!v[key].is_null(), "{key} missing: {v}");
    }
    assert_eq!(v["tokens"], 8);
    assert_eq!(
        v["compute"], "cpu",
        "bench-io runs on the CPU tier unless told"
    );
    check_token_gaps(&v, 1);
    assert!(v["tok_s"].as_f64().unwrap() > 0.0);
    // Nothing cached: every decode selection was read.
    assert_eq!(v["ram_hit_rate"].as_f64().unwrap(), 0.0);
    assert!(v["disk_bytes_per_token"].as_f64().unwrap() > 0.0);
    assert!(v["raw_disk_mb_s"].as_f64().unwrap() > 0.0);
    let wait = v["io_wait_fraction"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&wait), "{wait}");
    assert!(v["read_latency_us"]["reads"].as_u64().unwrap() > 0);
    // One MoE layer: nothing to read ahead, so no prefetched byte was used
    // (waste is null) and every miss is uncovered.
    assert!(v.as_object().unwrap().contains_key("prefetch_waste"));
    let recall = v["prefetch_recall"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&recall), "{recall}");
    assert_eq!(v["prefetch"], "next");
    let t = &v["time"];
    let parts = ["compute_only_s", "overlap_s", "io_wait_s"]
        .map(|k| t[k].as_f64().unwrap())
        .iter()
        .sum::<f64>();
    let decode = t["decode_s"].as_f64().unwrap();
    assert!((parts - decode).abs() <= 1e-6 * decode.max(1.0), "{t}");
    // Only the active predictor is scored without --compare-prefetch (the
    // others' router products would slow the run being measured).
    let scores = v["prefetcher"]["scores"].as_array().unwrap();
    assert_eq!(scores.len(), 1, "{scores:?}");
    assert_eq!(scores[0]["predictor"], "next");
    // Nothing was recorded in the usage cache by a cold benchmark; the
    // drive's measured queue depth was cached for the next start.
    assert!(!cache.path().join("colibri/usage").exists());
    assert_eq!(
        std::fs::read_dir(cache.path().join("colibri/io"))
            .unwrap()
            .count(),
        1
    );
}

/// Bytes a decode token reads from the fixture, from its safetensors
/// header alone: every tensor but the routed experts, of the (untied)
/// embedding table one row, plus top-k of each MoE layer's experts.
fn weight_bytes_per_token(dir: &Path) -> u64 {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["tie_word_embeddings"], false);
    let (experts, top_k) = (
        config["num_local_experts"].as_u64().unwrap(),
        config["num_experts_per_tok"].as_u64().unwrap(),
    );
    let mut dense = 0u64;
    let mut routed = 0u64;
    for (name, t) in header.as_object().unwrap() {
        if name == "__metadata__" {
            continue;
        }
        let off = &t["data_offsets"];
        let len = off[1].as_u64().unwrap() - off[0].as_u64().unwrap();
        if name.contains(".mlp.experts.") {
            routed += len;
        } else if name == "model.embed_tokens.weight" {
            dense += len / t["shape"][0].as_u64().unwrap();
        } else {
            dense += len;
        }
    }
    dense + routed * top_k / experts
}

#[test]
fn bench_io_warm_reads_nothing_and_reports_the_memory_roofline() {
    let cache = tempfile::tempdir().unwrap();
    let model = fixture("qwen3_moe");
    let m = model.to_str().unwrap();
    let v = ok_json(&colibri(
        &[
            "bench-io",
            "--model",
            m,
            "--warm",
            "--ram-budget",
            "64MiB",
            "--tokens",
            "6",
            "--threads",
            "2",
            "--bandwidth-bytes",
            "16MiB",
            "--json",
        ],
        cache.path(),
    ));
    assert_eq!(v["warm"], true);
    assert_eq!(v["tokens"], 6);
    // Every expert was read before the decode: nothing missed, nothing read.
    assert_eq!(v["ram_hit_rate"].as_f64().unwrap(), 1.0);
    assert_eq!(v["decode_disk_bytes"].as_f64().unwrap(), 0.0);
    assert_eq!(
        v["weight_bytes_per_token"].as_u64().unwrap(),
        weight_bytes_per_token(&model)
    );
    let (bw, roof, tok_s) = (
        v["memory_read_gb_s"].as_f64().unwrap(),
        v["roofline_tok_s"].as_f64().unwrap(),
        v["tok_s"].as_f64().unwrap(),
    );
    assert!(bw > 0.0 && roof > 0.0 && tok_s > 0.0, "{v}");
    let per_token = v["weight_bytes_per_token"].as_f64().unwrap();
    assert!((roof - bw * 1e9 / per_token).abs() <= 1e-6 * roof, "{v}");
    assert!((v["tok_s_of_roofline"].as_f64().unwrap() - tok_s / roof).abs() < 1e-9);
    // The second bound adds the KV cache the decode steps read: after the
    // 16-token prompt, 5 steps at positions 16–20 read 17–21 positions,
    // 19 in the mean, each 2 KV heads × 24 × (key, value) × f32 in each
    // of the 3 layers (the fixture's config.json).
    let kv = v["kv_bytes_per_token"].as_f64().unwrap();
    assert_eq!(kv, (19 * 2 * 24 * 2 * 4 * 3) as f64, "{v}");
    let roof_kv = v["roofline_with_kv_tok_s"].as_f64().unwrap();
    assert!(
        (roof_kv - bw * 1e9 / (per_token + kv)).abs() <= 1e-6 * roof_kv,
        "{v}"
    );
    assert!((v["tok_s_of_roofline_with_kv"].as_f64().unwrap() - tok_s / roof_kv).abs() < 1e-9);
    // The default prompt (16 tokens) and its prefill rate against the
    // decode's.
    assert_eq!(v["prompt_tokens"], 16);
    let (ttft, prefill) = (
        v["ttft_s"].as_f64().unwrap(),
        v["prefill_tok_s"].as_f64().unwrap(),
    );
    assert!(
        ttft > 0.0 && (prefill - 16.0 / ttft).abs() <= 1e-9 * prefill,
        "{v}"
    );
    assert!((v["prefill_over_decode"].as_f64().unwrap() - prefill / tok_s).abs() <= 1e-9 * prefill);
    check_token_gaps(&v, 2);

    // A budget that cannot hold every expert is refused, saying so.
    let out = colibri(
        &[
            "bench-io",
            "--model",
            m,
            "--warm",
            "--ram-budget",
            "100KiB",
            "--tokens",
            "2",
        ],
        cache.path(),
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--warm needs every routed expert in RAM"),
        "{err}"
    );
    // The memory roofline is the host's: a GPU warm run is refused.
    let out = colibri(
        &["bench-io", "--model", m, "--warm", "--device", "cuda"],
        cache.path(),
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("use it with --device cpu"), "{err}");
}

#[test]
fn bench_io_model_compares_prefetch_on_and_off() {
    let cache = tempfile::tempdir().unwrap();
    let model = fixture("olmoe");
    let v = ok_json(&colibri(
        &[
            "bench-io",
            "--model",
            model.to_str().unwrap(),
            "--ram-budget",
            "0",
            "--tokens",
            "4",
            "--seconds",
            "0.2",
            "--queue-depth",
            "4",
            "--compare-prefetch",
            "--json",
        ],
        cache.path(),
    ));
    let runs = v["compare_prefetch"].as_array().unwrap();
    let names: Vec<&str> = runs
        .iter()
        .map(|r| r["predictor"].as_str().unwrap_or("off"))
        .collect();
    assert_eq!(names, ["off", "next", "next-two", "cross-token", "union"]);
    for r in runs {
        assert!(r["tok_s"].as_f64().unwrap() > 0.0, "{r}");
        assert_eq!(r["tokens"], 4, "{r}");
    }
    assert_eq!(runs[0]["decode"]["prefetch_reads"], 0);
    assert!(v["prefetch_speedup"].as_f64().unwrap() > 0.0);
    // The main run scores every predictor (sets of guessed experts).
    let scored: Vec<&str> = v["prefetcher"]["scores"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["predictor"].as_str().unwrap())
        .collect();
    assert_eq!(scored, ["next", "next-two", "cross-token", "union"]);
    // A fixed depth is not measured.
    assert_eq!(v["queue_depth"], 4);
    assert!(v["queue_depth_measured"].is_null());
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
    let prompt = prompt.join(",");
    let trace = cache.path().join("routing.jsonl");
    let trace_arg = ["--routing-trace", trace.to_str().unwrap()];
    let prefetch: [&[&str]; 4] = [
        &[],
        &["--no-prefetch"],
        &["--prefetch-predictor", "union"],
        &trace_arg,
    ];
    for io in ["uring", "pread"] {
        for flags in prefetch {
            let n = greedy.len().to_string();
            let mut args = vec![
                "run",
                "-m",
                model.to_str().unwrap(),
                "--prompt-tokens",
                &prompt,
            ];
            args.extend(["-n", &n, "--ignore-eos", "--ram-budget", "0", "--io", io]);
            args.extend(flags);
            args.push("--json");
            let v = ok_json(&colibri(&args, cache.path()));
            assert_eq!(
                v["tokens"].as_array().unwrap(),
                greedy,
                "--io {io} {flags:?}"
            );
        }
    }
    // The trace holds a header and one line per MoE layer per step.
    let text = std::fs::read_to_string(&trace).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines[0]["colibri_routing_trace"], 1);
    assert!(lines.len() > greedy.len(), "{} lines", lines.len());
    // run records what it used, for the next start to pin.
    let usage = cache.path().join("colibri/usage");
    assert_eq!(std::fs::read_dir(usage).unwrap().count(), 1);
}
