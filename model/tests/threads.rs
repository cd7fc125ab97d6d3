//! The thread count never changes a result: every logit of a prompt and
//! of the decode steps after it, on checkpoints transformers saved, has
//! the bits of one thread. On more threads than (row, KV head) pairs a
//! decode step's attention cuts each KV head's query heads over tasks, and
//! the products cut their rows differently; one thread runs a task per KV
//! head. (The cut over positions that long contexts take is held to the
//! same bits in `attention.rs`'s tests: these checkpoints stop at 256
//! positions.)

use std::path::{Path, PathBuf};

use colibri_model::{KvCache, Logits, Model, Pool, ResidentExperts, SeqInput};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/models")
        .join(name)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// A prompt of `len` token ids spread over the vocabulary (not a repeated
/// token: each position's key differs).
fn prompt(len: usize, vocab: usize) -> Vec<u32> {
    (0..len).map(|i| ((i * 37 + 11) % vocab) as u32).collect()
}

/// Every logit of a prompt, then of single-token steps and of a two-token
/// step, on `threads` threads against one thread.
fn check(name: &str, prompt_len: usize, threads: &[usize]) {
    let (model, ck) = Model::load(&fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    let experts = ResidentExperts::load(&model.spec, &ck).unwrap();
    let vocab = model.spec.vocab_size;
    let steps: Vec<Vec<u32>> = vec![
        prompt(prompt_len, vocab),
        vec![7],
        vec![200 % vocab as u32],
        vec![3, 90],
        vec![41],
    ];
    let run = |pool: &Pool| -> Vec<Vec<u32>> {
        let mut cache = KvCache::new(&model.spec, 4096);
        steps
            .iter()
            .map(|tokens| {
                let out = model
                    .forward(
                        pool,
                        &experts,
                        &mut [SeqInput {
                            cache: &mut cache,
                            tokens,
                            logits: Logits::All,
                        }],
                    )
                    .unwrap();
                bits(&out[0])
            })
            .collect()
    };
    let want = run(&Pool::new(1).unwrap());
    for &t in threads {
        let got = run(&Pool::new(t).unwrap());
        for (step, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(g == w, "{name}: step {step}: {t} threads differ from one");
        }
    }
}

#[test]
fn qwen3_moe_on_three_and_five_threads_has_one_threads_bits() {
    // Two KV heads of 24 floats: 3 and 5 threads cut each one's heads.
    check("qwen3_moe", 170, &[3, 5]);
}

#[test]
fn olmoe_on_five_and_seven_threads_has_one_threads_bits() {
    // Four KV heads of 16 floats, the query and key norms over every head.
    check("olmoe", 130, &[5, 7]);
}
