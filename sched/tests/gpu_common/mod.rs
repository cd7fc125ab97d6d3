//! What the GPU tier tests share: the fixtures, engines on either tier,
//! greedy continuations, teacher-forced logits and NLL. Each test binary
//! says whether its CPU kernels run `--exact-quant` (`crate::EXACT_QUANT`).

#![allow(dead_code)]

use std::path::PathBuf;

use colibri_cuda::CudaDevice;
use colibri_model::sampling::{SamplingParams, log_softmax};
use colibri_model::{KvCache, Logits, SeqInput};
use colibri_sched::gpu::{Attached, DeviceChoice, GpuOptions, attach};
use colibri_sched::tier::{TierOptions, UsageMode};
use colibri_sched::{Engine, EngineOptions, GenRequest, Sequence};

/// GPU vs CPU: per-position NLL within this relative difference (f32
/// everywhere, different but fixed reduction orders).
pub const NLL_REL_TOL: f64 = 1e-3;

pub fn fixtures() -> PathBuf {
    match std::env::var_os("COLIBRI_FIXTURES") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures"),
    }
}

/// Every model the GPU tier is checked on: the transformers fixtures and
/// GGUF files of each quantization.
pub fn models() -> Vec<PathBuf> {
    let f = fixtures();
    let mut out: Vec<PathBuf> = [
        "qwen3_moe",
        "qwen2_moe",
        "mixtral",
        "olmoe",
        "deepseek_v3",
        "deepseek_v3_fp8",
        "qwen3_moe_bf16_sharded",
    ]
    .iter()
    .map(|n| f.join("models").join(n))
    .collect();
    for g in [
        "qwen3_moe.q4_0.gguf",
        "qwen3_moe.q8_0.gguf",
        "mixtral.q8_0.gguf",
        "deepseek_v3.q4_0.gguf",
        "olmoe.bf16.gguf",
        // Experts in Q4_1/Q5_1/Q5_0, attention projections in Q5_0/Q4_1.
        "qwen3_moe.legacy.gguf",
        // Experts and attention in Q2_K/Q3_K/IQ4_XS/IQ4_NL (256 wide).
        "qwen3_moe.low.gguf",
    ] {
        out.push(f.join("gguf").join(g));
    }
    // `COLIBRI_GPU_MODELS=text`: only the models whose path contains it
    // (to look into one model's failure).
    if let Some(only) = std::env::var_os("COLIBRI_GPU_MODELS") {
        let only = only.to_string_lossy().into_owned();
        out.retain(|m| m.to_string_lossy().contains(&only));
    }
    out
}

pub fn reference_tokens(model: &std::path::Path) -> (Vec<u32>, Vec<u32>) {
    // GGUF files share their checkpoint's reference prompt and text.
    let name = model
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default()
        .split('.')
        .next()
        .unwrap_or_default()
        .to_string();
    let dir = fixtures().join("models").join(&name);
    let text = std::fs::read_to_string(dir.join("reference.json"))
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids = |k: &str| -> Vec<u32> {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    (ids("prompt"), ids("tokens"))
}

pub fn tier(ram_budget: Option<u64>) -> TierOptions {
    TierOptions {
        ram_budget,
        usage: UsageMode::Off,
        ..TierOptions::default()
    }
}

pub fn engine(
    model: &std::path::Path,
    device: DeviceChoice,
    vram_budget: Option<u64>,
    ram_budget: Option<u64>,
    max_rows: usize,
) -> Engine {
    engine_on(model, device, Vec::new(), vram_budget, ram_budget, max_rows)
}

pub fn engine_on(
    model: &std::path::Path,
    device: DeviceChoice,
    devices: Vec<usize>,
    vram_budget: Option<u64>,
    ram_budget: Option<u64>,
    max_rows: usize,
) -> Engine {
    engine_with(
        model,
        &GpuOptions {
            device,
            vram_budget,
            devices,
            max_rows,
            ..GpuOptions::default()
        },
        ram_budget,
    )
}

pub fn engine_with(model: &std::path::Path, opts: &GpuOptions, ram_budget: Option<u64>) -> Engine {
    engine_ctx(model, opts, ram_budget, 256)
}

/// [`engine_with`] for a context of `ctx` positions (which sizes the KV
/// cache's share of VRAM).
pub fn engine_ctx(
    model: &std::path::Path,
    opts: &GpuOptions,
    ram_budget: Option<u64>,
    ctx: usize,
) -> Engine {
    colibri_model::kernels::set_exact_quant(crate::EXACT_QUANT);
    let mut e = Engine::load(
        model,
        &EngineOptions {
            threads: 2,
            ctx,
            tier: tier(ram_budget),
            ..EngineOptions::default()
        },
    )
    .unwrap_or_else(|e| panic!("{}: {e}", model.display()));
    let got = attach(&mut e, opts).unwrap_or_else(|e| panic!("{}: {e}", model.display()));
    if opts.device == DeviceChoice::Cuda {
        assert!(matches!(got, Attached::Gpu(_)));
    }
    e
}

pub fn no_gpu() -> bool {
    !matches!(CudaDevice::count(), Ok(n) if n > 0)
}
/// Teacher-forced logits of `tokens` in one sequence, `chunk` tokens per
/// forward call.
pub fn teacher_forced(e: &Engine, tokens: &[u32], chunk: usize) -> Vec<f32> {
    let mut cache = KvCache::new(&e.model.spec, 256);
    forward_pieces(e, &mut cache, tokens.chunks(chunk))
}

/// Every position's logits of `pieces` fed to `cache` one forward call each.
pub fn forward_pieces<'t>(
    e: &Engine,
    cache: &mut KvCache,
    pieces: impl Iterator<Item = &'t [u32]>,
) -> Vec<f32> {
    let mut out = Vec::new();
    for c in pieces {
        let r = e
            .forward(&mut [SeqInput {
                cache: &mut *cache,
                tokens: c,
                logits: Logits::All,
            }])
            .unwrap();
        out.extend_from_slice(&r[0]);
    }
    out
}

pub fn greedy(e: &Engine, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut seq = Sequence::new(
        &e.model,
        GenRequest {
            prompt: prompt.to_vec(),
            max_tokens: n,
            sampling: SamplingParams::default(),
            stop: vec![],
            eos: vec![],
            ignore_eos: true,
            top_logprobs: None,
        },
        256,
        None,
    )
    .unwrap();
    let mut got = Vec::new();
    e.generate(&mut seq, |ev| {
        got.push(ev.token);
        true
    })
    .unwrap();
    got
}

pub fn nll(logits: &[f32], tokens: &[u32], vocab: usize) -> Vec<f64> {
    logits
        .chunks_exact(vocab)
        .zip(&tokens[1..])
        .map(|(row, &t)| -log_softmax(row)[t as usize])
        .collect()
}

pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}
