//! The `colibri` binary as a user runs it: `run` and `perplexity` against
//! the transformers references, and the messages users see.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The binary, with its cache (demo model, usage history) in a temporary
/// directory rather than the user's home.
fn bin() -> Command {
    static CACHE: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    let cache = CACHE.get_or_init(|| tempfile::tempdir().unwrap());
    let mut c = Command::new(env!("CARGO_BIN_EXE_colibri"));
    c.env("RUST_LOG", "warn")
        .env("XDG_CACHE_HOME", cache.path());
    c
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name)
}

fn reference(name: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("reference.json")).unwrap())
        .unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
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

#[test]
fn run_reproduces_the_greedy_continuation_of_every_fixture() {
    for name in [
        "qwen3_moe",
        "qwen2_moe",
        "mixtral",
        "olmoe",
        "deepseek_v3",
        "deepseek_v3_fp8",
        "qwen3_moe_bf16_sharded",
    ] {
        let r = reference(name);
        let prompt: Vec<String> = ids(&r["prompt"]).iter().map(|t| t.to_string()).collect();
        let want = ids(&r["greedy"]);
        let v = json_out(bin().args(["run", "--model"]).arg(fixture(name)).args([
            "--prompt-tokens",
            &prompt.join(","),
            "--max-tokens",
            &want.len().to_string(),
            "--ignore-eos",
            "--json",
            "--threads",
            "2",
        ]));
        assert_eq!(ids(&v["tokens"]), want, "{name}");
        assert_eq!(v["finish_reason"], "length");
        assert!(v.get("text").is_none(), "no tokenizer, no text");
    }
}

#[test]
fn perplexity_matches_transformers_per_position() {
    for name in ["qwen3_moe", "deepseek_v3_fp8"] {
        let r = reference(name);
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("tokens.txt");
        // Mixed separators, as the flag's help allows.
        let toks: Vec<String> = ids(&r["tokens"]).iter().map(|t| t.to_string()).collect();
        std::fs::write(
            &f,
            format!("{}\n{}", toks[..10].join(", "), toks[10..].join(" ")),
        )
        .unwrap();
        let v = json_out(
            bin()
                .args(["perplexity", "--model"])
                .arg(fixture(name))
                .arg("--token-file")
                .arg(&f)
                .args(["--json", "--per-token"]),
        );
        let want: Vec<f64> = r["nll"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        let got: Vec<f64> = v["nll"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(got.len(), want.len());
        assert_eq!(v["tokens_scored"], want.len());
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() / w < 1e-4, "{name}: {g} vs {w}");
        }
        let mean = want.iter().sum::<f64>() / want.len() as f64;
        assert!((v["mean_nll"].as_f64().unwrap() - mean).abs() < 1e-4);
        assert!((v["ppl"].as_f64().unwrap() - mean.exp()).abs() / mean.exp() < 1e-3);
    }
}

#[test]
fn text_without_a_tokenizer_says_so() {
    let out = bin()
        .args(["run", "--model"])
        .arg(fixture("olmoe"))
        .args(["--prompt", "hi", "--max-tokens", "2"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("text needs a tokenizer") && err.contains("--prompt-tokens"),
        "{err}"
    );
}

#[test]
fn demo_model_runs_text_and_chat_and_seeded_sampling_repeats() {
    let cache = tempfile::tempdir().unwrap();
    let run = |extra: &[&str]| {
        let mut c = bin();
        c.env("XDG_CACHE_HOME", cache.path())
            .args(["run", "--prompt", "Hello", "--max-tokens", "12", "--json"])
            .args(extra);
        json_out(&mut c)
    };
    let greedy = run(&[]);
    assert_eq!(greedy["tokens"].as_array().unwrap().len(), 12);
    assert!(greedy["text"].is_string());
    let a = run(&["--temperature", "1.0", "--seed", "5"]);
    let b = run(&["--temperature", "1.0", "--seed", "5"]);
    let c = run(&[
        "--temperature",
        "1.0",
        "--seed",
        "6",
        "--top-k",
        "40",
        "--top-p",
        "0.9",
    ]);
    assert_eq!(a["tokens"], b["tokens"]);
    assert_ne!(a["tokens"], c["tokens"]);
    let chat = run(&["--chat", "--system", "Be brief."]);
    assert!(chat["prompt_tokens"].as_u64().unwrap() > greedy["prompt_tokens"].as_u64().unwrap());
}

#[test]
fn bad_flags_fail_with_a_message_not_a_panic() {
    for args in [
        vec!["run", "--prompt-tokens", "1,2,x", "--max-tokens", "2"],
        vec![
            "run",
            "--prompt-tokens",
            "1,2",
            "--max-tokens",
            "2",
            "--temperature",
            "-1",
        ],
        vec!["run", "--prompt-tokens", "1,2", "--max-tokens", "0"],
        vec!["perplexity"],
    ] {
        let cache = tempfile::tempdir().unwrap();
        let out = bin()
            .env("XDG_CACHE_HOME", cache.path())
            .args(&args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("error:") && !err.contains("panicked"),
            "{args:?}: {err}"
        );
    }
    let out = bin()
        .args([
            "run",
            "--model",
            "/nonexistent/model",
            "--prompt-tokens",
            "1",
            "--max-tokens",
            "1",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("/nonexistent/model"),
        "{err}"
    );
}
