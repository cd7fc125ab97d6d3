//! `--device`, `--vram-budget` and `--devices` as a user meets them. On a
//! machine without a GPU (CI): `auto` runs on the CPU tier and says so
//! once, `cuda` fails naming why, `plan` says there is no GPU tier. With a
//! GPU the same commands must take it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn bin() -> Command {
    static CACHE: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    let cache = CACHE.get_or_init(|| tempfile::tempdir().unwrap());
    let mut c = Command::new(env!("CARGO_BIN_EXE_colibri"));
    c.env("RUST_LOG", "info")
        .env("XDG_CACHE_HOME", cache.path());
    c
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name)
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn run(device: &str) -> Output {
    bin()
        .args(["run", "--model"])
        .arg(fixture("olmoe"))
        .args([
            "--prompt-tokens",
            "1,2,3",
            "--max-tokens",
            "2",
            "--threads",
            "1",
            "--device",
            device,
        ])
        .output()
        .unwrap()
}

#[test]
fn device_cuda_takes_the_gpu_or_fails_naming_why() {
    let o = run("cuda");
    let (_, err) = text(&o);
    if o.status.success() {
        assert!(err.contains("GPU tier on"), "{err}");
    } else {
        assert!(err.contains("--device cuda"), "{err}");
        assert!(err.contains("CUDA unavailable"), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn device_auto_runs_and_says_once_where() {
    let o = run("auto");
    let (_, err) = text(&o);
    assert!(o.status.success(), "{err}");
    let cpu = err.matches("running on the CPU tier").count();
    let gpu = err.matches("GPU tier on").count();
    assert_eq!(cpu + gpu, 1, "said once where it runs: {err}");
    let o = run("cpu");
    let (_, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(!err.contains("GPU tier"), "{err}");
}

#[test]
fn plan_shows_the_gpu_placement_or_why_there_is_none() {
    let o = bin()
        .args(["plan", "--model"])
        .arg(fixture("qwen3_moe"))
        .args(["--vram-budget", "1MiB"])
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        out.contains("GPU tier: none (") || out.contains("VRAM budget"),
        "{out}"
    );
    let o = bin()
        .args(["plan", "--json", "--device", "cpu", "--model"])
        .arg(fixture("qwen3_moe"))
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["gpu"]["none"], "--device cpu");
}

#[test]
fn several_devices_take_both_gpus_or_say_why_not() {
    let two = |device: &str| {
        bin()
            .args(["run", "--model"])
            .arg(fixture("olmoe"))
            .args(["--prompt-tokens", "1", "-n", "1", "--devices", "0,1"])
            .args(["--device", device])
            .output()
            .unwrap()
    };
    // Two GPUs: both take part; fewer: auto runs on the CPU tier and
    // says why, cuda fails naming why.
    let o = two("auto");
    let (_, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("GPU tier on 2 devices") || err.contains("CUDA unavailable"),
        "{err}"
    );
    let o = two("cuda");
    let (_, err) = text(&o);
    if o.status.success() {
        assert!(err.contains("GPU tier on 2 devices"), "{err}");
    } else {
        assert!(err.contains("CUDA unavailable"), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn a_bad_device_name_is_refused() {
    let o = run("tpu");
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(err.contains("auto, cpu or cuda"), "{err}");
}
