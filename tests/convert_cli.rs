//! `colibri convert` and `colibri synth` as a user runs them: a conversion
//! killed mid-way resumes to a byte-identical store, summaries report what
//! was kept and the peak memory, and synthetic models of the presets'
//! geometry run through `colibri run` in both formats.

use std::path::{Path, PathBuf};
use std::process::Command;

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_colibri"));
    c.env("RUST_LOG", "warn");
    c
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name)
}

fn json_out(c: &mut Command) -> serde_json::Value {
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

#[test]
fn a_killed_conversion_resumes_to_a_byte_identical_store() {
    let dir = tempfile::tempdir().unwrap();
    let whole = dir.path().join("whole");
    let s = json_out(
        bin()
            .args(["convert", "--json", "--quant", "q8_0", "-m"])
            .arg(fixture("mixtral"))
            .arg("--out")
            .arg(&whole),
    );
    assert_eq!(s["resumed_units"], 0);
    assert!(s["peak_rss_anon_bytes"].as_u64().unwrap() > 0);

    let out = dir.path().join("out");
    let killed = bin()
        .args(["convert", "--quant", "q8_0", "-m"])
        .arg(fixture("mixtral"))
        .arg("--out")
        .arg(&out)
        .env("COLIBRI_CONVERT_ABORT_AFTER_LAYERS", "1")
        .output()
        .unwrap();
    assert!(!killed.status.success());
    assert!(!out.exists());
    assert!(
        dir.path()
            .join("out.partial/progress/layer-00000.json")
            .is_file()
    );

    let s = json_out(
        bin()
            .args(["convert", "--json", "--quant", "q8_0", "-m"])
            .arg(fixture("mixtral"))
            .arg("--out")
            .arg(&out),
    );
    assert_eq!(s["resumed_units"], 2, "{s}");
    assert_eq!(s["written_units"], 1, "{s}");
    assert!(files(&whole) == files(&out), "the resumed store differs");
    assert!(!dir.path().join("out.partial").exists());

    // Running it again refuses to overwrite.
    let again = bin()
        .args(["convert", "-m"])
        .arg(fixture("mixtral"))
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("already exists"));
}

#[test]
fn convert_says_which_matrices_keep_their_format() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("q");
    let text = bin()
        .args(["convert", "--quant", "q4_0", "-m"])
        .arg(fixture("deepseek_v3_fp8"))
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        text.status.success(),
        "{}",
        String::from_utf8_lossy(&text.stderr)
    );
    let stdout = String::from_utf8_lossy(&text.stdout);
    assert!(stdout.contains("not a multiple of 32"), "{stdout}");
    assert!(stdout.contains("fp8-e4m3"), "{stdout}");
    assert!(stdout.contains("peak memory"), "{stdout}");
    // The store runs.
    let r = json_out(
        bin()
            .args(["run", "--json", "--prompt-tokens", "1,2,3", "-n", "3", "-m"])
            .arg(&out),
    );
    assert_eq!(r["tokens"].as_array().unwrap().len(), 3);
}

fn run_tokens(model: &Path) -> Vec<u64> {
    let r = json_out(
        bin()
            .args([
                "run",
                "--json",
                "--ignore-eos",
                "--prompt-tokens",
                "1,2,3",
                "-n",
                "4",
                "-m",
            ])
            .arg(model),
    );
    r["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

#[test]
fn synth_presets_report_their_geometry() {
    for (preset, hidden, experts, top_k, inter) in [
        ("qwen3-30b-a3b", 2048, 128, 8, 768),
        ("qwen3-235b-a22b", 4096, 128, 8, 1536),
        ("deepseek-v3", 7168, 256, 8, 2048),
        ("mixtral-8x7b", 4096, 8, 2, 14336),
    ] {
        let s = json_out(bin().args([
            "synth",
            "--dry-run",
            "--json",
            "--layers",
            "2",
            "--preset",
            preset,
        ]));
        let g = &s["geometry"];
        assert_eq!(g["layers"], 2, "{preset}");
        assert!(g["moe_layers"].as_u64().unwrap() >= 1);
        assert_eq!(g["hidden_size"], hidden, "{preset}");
        assert_eq!(g["experts"], experts, "{preset}");
        assert_eq!(g["experts_per_token"], top_k, "{preset}");
        assert_eq!(g["expert_intermediate_size"], inter, "{preset}");
        assert_eq!(s["written"], false);
    }
}

/// A small model of Qwen3-MoE's architecture: every quantization and both
/// formats write, load and generate, and both formats generate the same.
#[test]
fn synth_small_models_run_in_both_formats() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.json");
    let mut c: serde_json::Value = serde_json::json!({
        "model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "moe_intermediate_size": 32, "intermediate_size": 96, "num_experts": 8,
        "num_experts_per_tok": 2, "norm_topk_prob": true, "vocab_size": 512,
        "max_position_embeddings": 256, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "mlp_only_layers": [], "decoder_sparse_step": 1, "tie_word_embeddings": false,
        "eos_token_id": 2
    });
    c["bos_token_id"] = serde_json::json!(1);
    std::fs::write(&config, c.to_string()).unwrap();
    for quant in ["f32", "q4_0"] {
        let mut tokens = Vec::new();
        for (format, out) in [("packed", "m"), ("gguf", "m.gguf")] {
            let out = dir.path().join(format!("{quant}-{out}"));
            let s = json_out(
                bin()
                    .args([
                        "synth", "--json", "--layers", "2", "--quant", quant, "--format", format,
                        "--config",
                    ])
                    .arg(&config)
                    .arg("--out")
                    .arg(&out),
            );
            assert_eq!(s["geometry"]["layers"], 2);
            assert_eq!(s["written"], true);
            tokens.push(run_tokens(&out));
        }
        assert_eq!(tokens[0].len(), 4);
        assert_eq!(
            tokens[0], tokens[1],
            "{quant}: packed and GGUF generate differently"
        );
    }
}

/// The real Qwen3-30B-A3B geometry (2 layers, q4_0: ~1.8 GiB per file)
/// written in both formats and run.
#[test]
fn synth_qwen3_30b_geometry_runs_in_both_formats() {
    let dir = tempfile::tempdir().unwrap();
    let mut tokens = Vec::new();
    for (format, name) in [("packed", "q"), ("gguf", "q.gguf")] {
        let out = dir.path().join(name);
        let s = json_out(
            bin()
                .args([
                    "synth",
                    "--json",
                    "--preset",
                    "qwen3-30b-a3b",
                    "--layers",
                    "2",
                    "--quant",
                    "q4_0",
                    "--format",
                    format,
                    "--out",
                ])
                .arg(&out),
        );
        let g = &s["geometry"];
        assert_eq!(
            (g["hidden_size"].as_u64(), g["experts"].as_u64()),
            (Some(2048), Some(128))
        );
        // 3 × 768 × 2048 q4_0 elements per expert.
        let expert = 3 * 768 * 2048 / 32 * 18;
        let per = s["expert_bytes"].as_u64().unwrap();
        assert!(per >= expert && per < expert + 4096, "{per}");
        tokens.push(run_tokens(&out));
        if format == "packed" {
            // One aligned record per expert.
            let m: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap())
                    .unwrap();
            for l in m["experts"]["layers"].as_array().unwrap() {
                assert_eq!(l["record_bytes"].as_u64().unwrap() % 4096, 0);
                assert_eq!(l["xxh3"].as_array().unwrap().len(), 128);
            }
        }
        // Free the disk before the next file.
        if format == "packed" {
            std::fs::remove_dir_all(&out).unwrap();
        } else {
            std::fs::remove_file(&out).unwrap();
        }
    }
    assert_eq!(tokens[0], tokens[1]);
    assert!(tokens[0].iter().all(|&t| t < 151936));
}
