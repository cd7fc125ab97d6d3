//! `ModelSpec::kv_bytes_read_at` (the KV cache bytes `bench-io --warm`
//! adds to a decode step's bound) against the bytes a real cache holds.

use std::path::{Path, PathBuf};

use colibri_model::{KvCache, Logits, Model, Pool, ResidentExperts, SeqInput};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/models")
        .join(name)
}

/// The cache of `name` after a forward pass over `n` tokens.
fn cache_after(name: &str, n: usize) -> (Model, KvCache) {
    let (model, ck) = Model::load(&fixture(name)).unwrap();
    let experts = ResidentExperts::load(&model.spec, &ck).unwrap();
    let pool = Pool::new(1).unwrap();
    let mut cache = KvCache::new(&model.spec, 64);
    let tokens: Vec<u32> = (0..n as u32).map(|i| 3 + i % 50).collect();
    model
        .forward(
            &pool,
            &experts,
            &mut [SeqInput {
                cache: &mut cache,
                tokens: &tokens,
                logits: Logits::Last,
            }],
        )
        .unwrap();
    (model, cache)
}

#[test]
fn a_step_reads_every_cached_position_of_full_attention_layers() {
    // GQA (Qwen3-MoE, OLMoE) and MLA (DeepSeek-V3).
    for name in ["qwen3_moe", "olmoe", "deepseek_v3"] {
        for n in [1, 7, 20] {
            let (model, cache) = cache_after(name, n);
            assert!(model.spec.layers.iter().all(|l| l.sliding_window.is_none()));
            assert_eq!(
                model.spec.kv_bytes_read_at(n - 1),
                cache.bytes() as u64,
                "{name}, {n} positions"
            );
        }
    }
}

#[test]
fn a_sliding_layer_reads_its_window_only() {
    // The Mixtral fixture's layers all slide over 12 positions.
    let (model, cache) = cache_after("mixtral", 20);
    let window = model.spec.layers[0].sliding_window.unwrap();
    assert_eq!(window, 12);
    let per_position = cache.bytes() as u64 / 20;
    assert_eq!(model.spec.kv_bytes_read_at(19), per_position * 12);
    assert_eq!(model.spec.kv_bytes_read_at(11), per_position * 12);
    assert_eq!(model.spec.kv_bytes_read_at(4), per_position * 5);
}
