//! The engine's generation and scoring against the transformers fixtures,
//! and batching invariance: sequences computed together give bit-identical
//! logits to sequences computed alone.

use std::path::{Path, PathBuf};

use colibri_model::sampling::SamplingParams;
use colibri_model::{KvCache, Logits, SeqInput};
use colibri_sched::{Engine, EngineOptions, FinishReason, GenRequest, Sequence};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/models")
        .join(name)
}

fn reference(name: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("reference.json")).unwrap())
        .unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn greedy_req(prompt: Vec<u32>, max_tokens: usize) -> GenRequest {
    GenRequest {
        prompt,
        max_tokens,
        sampling: SamplingParams::default(),
        stop: vec![],
        eos: vec![2],
        ignore_eos: true,
        top_logprobs: None,
    }
}

#[test]
fn generate_reproduces_transformers_greedy_and_stops_at_max_tokens() {
    for name in ["qwen3_moe", "deepseek_v3"] {
        let r = reference(name);
        let engine = Engine::load(
            &fixture(name),
            &EngineOptions {
                threads: 2,
                ctx: 0,
                tier: no_usage(),
                ..EngineOptions::default()
            },
        )
        .unwrap();
        let want = ids(&r["greedy"]);
        let mut seq = Sequence::new(
            &engine.model,
            greedy_req(ids(&r["prompt"]), want.len()),
            256,
            None,
        )
        .unwrap();
        let mut got = Vec::new();
        let mut last = None;
        engine
            .generate(&mut seq, |ev| {
                got.push(ev.token);
                last = ev.finish;
                true
            })
            .unwrap();
        assert_eq!(got, want, "{name}");
        assert_eq!(last, Some(FinishReason::Length));
    }
}

#[test]
fn resume_reuses_the_cache_of_previous_turns() {
    let name = "mixtral";
    let r = reference(name);
    let engine = Engine::load(
        &fixture(name),
        &EngineOptions {
            threads: 2,
            ctx: 0,
            tier: no_usage(),
            ..EngineOptions::default()
        },
    )
    .unwrap();
    let greedy = ids(&r["greedy"]);
    let prompt = ids(&r["prompt"]);
    // Turn 1: 10 tokens.
    let mut seq = Sequence::new(&engine.model, greedy_req(prompt.clone(), 10), 256, None).unwrap();
    engine.generate(&mut seq, |_| true).unwrap();
    assert_eq!(seq.generated(), &greedy[..10]);
    let (cache, cached) = seq.into_cache();
    assert_eq!(
        cached.len(),
        prompt.len() + 9,
        "the last sampled token is not yet in the cache"
    );
    // Turn 2 continues the same text: must equal the one-shot continuation.
    let mut turn2 = prompt.clone();
    turn2.extend_from_slice(&greedy[..10]);
    let mut seq =
        Sequence::resume(&engine.model, greedy_req(turn2, 12), cache, &cached, None).unwrap();
    engine.generate(&mut seq, |_| true).unwrap();
    assert_eq!(seq.generated(), &greedy[10..22]);
}

#[test]
fn batched_sequences_give_bit_identical_logits() {
    for name in ["qwen2_moe", "deepseek_v3_fp8", "olmoe"] {
        let r = reference(name);
        let engine = Engine::load(
            &fixture(name),
            &EngineOptions {
                threads: 3,
                ctx: 0,
                tier: no_usage(),
                ..EngineOptions::default()
            },
        )
        .unwrap();
        let toks = ids(&r["tokens"]);
        let spec = &engine.model.spec;
        let run = |batch: &mut [SeqInput<'_>]| {
            engine
                .model
                .forward(&engine.pool, engine.experts.as_ref(), batch)
                .unwrap()
        };

        // Three sequences at different depths: prefill each alone...
        let splits = [(0usize, 20usize), (5, 9), (11, 30)];
        let mut alone = Vec::new();
        let mut caches_alone = Vec::new();
        for &(a, b) in &splits {
            let mut c = KvCache::new(spec, 256);
            run(&mut [SeqInput {
                cache: &mut c,
                tokens: &toks[a..b],
                logits: Logits::None,
            }]);
            caches_alone.push(c);
        }
        for (c, &(_, b)) in caches_alone.iter_mut().zip(&splits) {
            alone.push(
                run(&mut [SeqInput {
                    cache: c,
                    tokens: &toks[b..b + 3],
                    logits: Logits::All,
                }])
                .remove(0),
            );
        }
        // ...and the same steps together in one batch.
        let mut caches: Vec<KvCache> = splits.iter().map(|_| KvCache::new(spec, 256)).collect();
        {
            let mut batch: Vec<SeqInput> = caches
                .iter_mut()
                .zip(&splits)
                .map(|(c, &(a, b))| SeqInput {
                    cache: c,
                    tokens: &toks[a..b],
                    logits: Logits::None,
                })
                .collect();
            run(&mut batch);
        }
        let mut batch: Vec<SeqInput> = caches
            .iter_mut()
            .zip(&splits)
            .map(|(c, &(_, b))| SeqInput {
                cache: c,
                tokens: &toks[b..b + 3],
                logits: Logits::All,
            })
            .collect();
        let together = run(&mut batch);
        assert_eq!(together, alone, "{name}: batching changed the logits");
    }
}

#[test]
fn thread_count_does_not_change_logits() {
    let name = "qwen3_moe";
    let toks = ids(&reference(name)["tokens"]);
    let logits = |threads| {
        let engine = Engine::load(
            &fixture(name),
            &EngineOptions {
                threads,
                ctx: 0,
                tier: no_usage(),
                ..EngineOptions::default()
            },
        )
        .unwrap();
        let mut c = KvCache::new(&engine.model.spec, 256);
        engine
            .model
            .forward(
                &engine.pool,
                engine.experts.as_ref(),
                &mut [SeqInput {
                    cache: &mut c,
                    tokens: &toks,
                    logits: Logits::All,
                }],
            )
            .unwrap()
            .remove(0)
    };
    assert_eq!(logits(1), logits(2));
    assert_eq!(logits(1), logits(5));
}

#[test]
fn score_matches_transformers_nll_and_windows_past_the_context() {
    let name = "olmoe";
    let r = reference(name);
    let toks = ids(&r["tokens"]);
    let want: Vec<f64> = r["nll"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    let engine = Engine::load(
        &fixture(name),
        &EngineOptions {
            threads: 2,
            ctx: 0,
            tier: no_usage(),
            ..EngineOptions::default()
        },
    )
    .unwrap();
    let rep = engine.score(&toks, |_, _| {}).unwrap();
    assert_eq!(rep.tokens_scored, toks.len() - 1);
    for (g, w) in rep.nll.iter().zip(&want) {
        assert!((g - w).abs() / w < 1e-4, "{g} vs {w}");
    }
    assert!((rep.ppl - rep.mean_nll.exp()).abs() < 1e-9);

    // A 16-token context: windows of 16, each window's first token unscored.
    let engine = Engine::load(
        &fixture(name),
        &EngineOptions {
            threads: 2,
            ctx: 16,
            tier: no_usage(),
            ..EngineOptions::default()
        },
    )
    .unwrap();
    let rep = engine.score(&toks, |_, _| {}).unwrap();
    assert_eq!(rep.windows, toks.len().div_ceil(16));
    assert_eq!(rep.tokens_scored, toks.len() - rep.windows);
    // The first window is scored exactly as without the cap.
    for (g, w) in rep.nll[..15].iter().zip(&want) {
        assert!((g - w).abs() / w < 1e-4);
    }
}

#[test]
fn prompt_longer_than_the_context_is_rejected_with_numbers() {
    let engine = Engine::load(
        &fixture("mixtral"),
        &EngineOptions {
            threads: 1,
            ctx: 8,
            tier: no_usage(),
            ..EngineOptions::default()
        },
    )
    .unwrap();
    let err = Sequence::new(
        &engine.model,
        greedy_req((3..20).collect(), 4),
        engine.context_len(),
        None,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("18") && err.contains('8'), "{err}");
}

/// Tests never write a usage history to the user's cache.
fn no_usage() -> colibri_sched::tier::TierOptions {
    colibri_sched::tier::TierOptions {
        usage: colibri_sched::tier::UsageMode::Off,
        ..Default::default()
    }
}
