//! Every architecture against transformers: per-position NLL within 1e-4
//! relative and identical greedy continuations, on checkpoints transformers
//! saved (tools/make_fixtures.py).

use std::path::{Path, PathBuf};

use colibri_model::{KvCache, Logits, Model, Pool, ResidentExperts, SeqInput};

const NLL_REL_TOL: f64 = 1e-4;

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models")
}

struct Reference {
    tokens: Vec<u32>,
    nll: Vec<f64>,
    prompt: Vec<u32>,
    greedy: Vec<u32>,
    /// Tokens masked during the greedy decode (EOS, as min_new_tokens does).
    eos_masked: Vec<u32>,
}

fn reference(dir: &Path) -> Reference {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let ids = |k: &str| {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    Reference {
        tokens: ids("tokens"),
        nll: v["nll"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect(),
        prompt: ids("prompt"),
        greedy: ids("greedy"),
        eos_masked: ids("eos_masked"),
    }
}

fn log_softmax_at(logits: &[f32], target: usize) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    logits[target] as f64 - max - sum.ln()
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

fn check(name: &str, threads: usize) {
    let dir = fixtures_dir().join(name);
    let r = reference(&dir);
    let (model, ck) = Model::load(&dir).unwrap_or_else(|e| panic!("{name}: {e}"));
    let experts = ResidentExperts::load(&model.spec, &ck).unwrap();
    let pool = Pool::new(threads).unwrap();
    let vocab = model.spec.vocab_size;

    // Teacher-forced NLL, the whole sequence in one batch.
    let mut cache = KvCache::new(&model.spec, 4096);
    let out = model
        .forward(
            &pool,
            &experts,
            &mut [SeqInput {
                cache: &mut cache,
                tokens: &r.tokens,
                logits: Logits::All,
            }],
        )
        .unwrap();
    let logits = &out[0];
    assert_eq!(logits.len(), r.tokens.len() * vocab);
    let mut worst = 0.0f64;
    for (i, want) in r.nll.iter().enumerate() {
        let got = -log_softmax_at(
            &logits[i * vocab..(i + 1) * vocab],
            r.tokens[i + 1] as usize,
        );
        let rel = (got - want).abs() / want.abs();
        worst = worst.max(rel);
        assert!(
            rel < NLL_REL_TOL,
            "{name}: position {i}: nll {got} vs transformers {want} (rel {rel:.2e})"
        );
    }

    // Greedy continuation: prefill the prompt, then one token at a time.
    let mut cache = KvCache::new(&model.spec, 4096);
    let mut next = r.prompt.clone();
    let mut got = Vec::new();
    for _ in 0..r.greedy.len() {
        let out = model
            .forward(
                &pool,
                &experts,
                &mut [SeqInput {
                    cache: &mut cache,
                    tokens: &next,
                    logits: Logits::Last,
                }],
            )
            .unwrap();
        let mut logits = out[0].clone();
        for &e in &r.eos_masked {
            logits[e as usize] = f32::NEG_INFINITY;
        }
        let t = argmax(&logits);
        got.push(t);
        next = vec![t];
    }
    assert_eq!(
        got, r.greedy,
        "{name}: greedy continuation differs from transformers"
    );
    eprintln!(
        "{name}: worst NLL rel err {worst:.2e}, greedy {} tokens identical",
        got.len()
    );
}

#[test]
fn qwen3_moe() {
    check("qwen3_moe", 2);
}

#[test]
fn qwen3_moe_bf16_sharded() {
    check("qwen3_moe_bf16_sharded", 2);
}

#[test]
fn qwen2_moe() {
    check("qwen2_moe", 2);
}

#[test]
fn mixtral_sliding_window_sharded() {
    check("mixtral", 2);
}

#[test]
fn olmoe_clip_qkv() {
    check("olmoe", 2);
}

#[test]
fn deepseek_v3_mla_yarn() {
    check("deepseek_v3", 2);
}

#[test]
fn deepseek_v3_fp8_block_scales() {
    check("deepseek_v3_fp8", 2);
}
