//! GGUF against the Hugging Face source of the same weights.
//!
//! Fixtures (tests/fixtures/gguf, made by tools/hf_to_gguf.py with the PyPI
//! `gguf` package, llama.cpp's writer and quantizers, from the transformers
//! fixtures in tests/fixtures/models):
//! - `<family>.f32.gguf`: logits bit-identical to the safetensors source,
//!   the reference NLL and greedy continuation reproduced;
//! - `*.q8_0.gguf`, `*.q4_0.gguf`, `olmoe.bf16.gguf`: our dequantization
//!   equals gguf's numpy dequantization (hashes in `*.dequant.json`), our
//!   quantizers reproduce gguf's bytes, and the model's logits are
//!   bit-identical to an f32 twin built from the dequantized values;
//! - corrupt and truncated files give errors naming the file; the header
//!   parser survives 20k random mutations;
//! - our writer round-trips through our reader, and its output is
//!   byte-identical to `colibri_writer.gguf`, which gguf-py's GGUFReader
//!   read back (`colibri_writer.gguf.gguf-py.json`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use colibri_model::experts::ExpertSource;
use colibri_model::source::gguf::{
    GgmlType, GgufArray, GgufFile, GgufType, GgufValue, GgufWriter, header,
};
use colibri_model::source::{ExpertLocator, GgufExpertLocator, GgufExperts, load_gguf};
use colibri_model::tensor::Bytes;
use colibri_model::{KvCache, Logits, Model, ModelError, Pool, ResidentExperts, SeqInput, quant};
use rand::{Rng, SeedableRng};

const NLL_REL_TOL: f64 = 1e-4;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

fn gguf_path(name: &str) -> PathBuf {
    root().join("gguf").join(name)
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Logits after every token of `tokens`, one batch.
fn all_logits(model: &Model, experts: &dyn ExpertSource, tokens: &[u32]) -> Vec<f32> {
    let pool = Pool::new(2).unwrap();
    let mut cache = KvCache::new(&model.spec, 4096);
    let mut out = model
        .forward(
            &pool,
            experts,
            &mut [SeqInput {
                cache: &mut cache,
                tokens,
                logits: Logits::All,
            }],
        )
        .unwrap();
    out.remove(0)
}

fn greedy(model: &Model, experts: &dyn ExpertSource, prompt: &[u32], n: usize) -> Vec<u32> {
    let pool = Pool::new(2).unwrap();
    let mut cache = KvCache::new(&model.spec, 4096);
    let mut next = prompt.to_vec();
    let mut got = Vec::new();
    for _ in 0..n {
        let out = model
            .forward(
                &pool,
                experts,
                &mut [SeqInput {
                    cache: &mut cache,
                    tokens: &next,
                    logits: Logits::Last,
                }],
            )
            .unwrap();
        let l = &out[0];
        let t = (0..l.len()).fold(0, |b, i| if l[i] > l[b] { i } else { b }) as u32;
        got.push(t);
        next = vec![t];
    }
    got
}

fn nll(logits: &[f32], target: usize) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    -(logits[target] as f64 - max - sum.ln())
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// (a): an F32 GGUF computes exactly what its safetensors source computes.
fn f32_parity(family: &str) {
    let hf_dir = root().join("models").join(family);
    let r = json(&hf_dir.join("reference.json"));
    let tokens = ids(&r["tokens"]);
    let (hf, ck) = Model::load(&hf_dir).unwrap();
    let hf_experts = ResidentExperts::load(&hf.spec, &ck).unwrap();
    let path = gguf_path(&format!("{family}.f32.gguf"));
    // Model::load dispatches on the path.
    let (gg, src) = Model::load(&path).unwrap();
    let gg_experts = ResidentExperts::load(&gg.spec, &src).unwrap();
    let want = all_logits(&hf, &hf_experts, &tokens);
    let got = all_logits(&gg, &gg_experts, &tokens);
    assert_eq!(got.len(), want.len());
    assert!(
        bits(&got) == bits(&want),
        "{family}: GGUF logits differ from safetensors"
    );
    // The GGUF-native expert source gives the same.
    let (gg2, file) = load_gguf(&path).unwrap();
    let native = GgufExperts::load(&gg2.spec, &file).unwrap();
    assert!(bits(&all_logits(&gg2, &native, &tokens)) == bits(&want));

    let vocab = gg.spec.vocab_size;
    for (i, w) in r["nll"].as_array().unwrap().iter().enumerate() {
        let w = w.as_f64().unwrap();
        let g = nll(&got[i * vocab..(i + 1) * vocab], tokens[i + 1] as usize);
        assert!(
            (g - w).abs() / w.abs() < NLL_REL_TOL,
            "{family}: position {i}: {g} vs {w}"
        );
    }
    let want_greedy = ids(&r["greedy"]);
    assert_eq!(
        greedy(&gg, &gg_experts, &ids(&r["prompt"]), want_greedy.len()),
        want_greedy
    );
}

#[test]
fn qwen3_moe_f32_equals_safetensors() {
    f32_parity("qwen3_moe");
}

#[test]
fn qwen2_moe_f32_equals_safetensors() {
    f32_parity("qwen2_moe");
}

#[test]
fn mixtral_f32_equals_safetensors_after_unpermuting_q_k() {
    f32_parity("mixtral");
}

#[test]
fn olmoe_f32_equals_safetensors() {
    f32_parity("olmoe");
}

#[test]
fn deepseek_v3_f32_equals_safetensors_after_rebuilding_kv_b() {
    f32_parity("deepseek_v3");
}
