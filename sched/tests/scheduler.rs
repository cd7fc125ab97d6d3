//! Continuous batching: concurrent sequences produce exactly what they
//! produce alone, share expert fetches, and leave on cancel.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use colibri_model::config::FfnKind;
use colibri_model::sampling::SamplingParams;
use colibri_sched::scheduler::{Event, Scheduler, SchedulerConfig, SubmitError};
use colibri_sched::{Engine, EngineOptions, GenRequest, Sequence};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/models")
        .join(name)
}

fn req(prompt: Vec<u32>, max_tokens: usize, seed: Option<u64>) -> GenRequest {
    GenRequest {
        prompt,
        max_tokens,
        sampling: SamplingParams {
            temperature: if seed.is_some() { 0.9 } else { 0.0 },
            seed,
            ..Default::default()
        },
        stop: vec![],
        eos: vec![2],
        ignore_eos: true,
        top_logprobs: None,
    }
}

type Collected = Arc<Mutex<(Vec<u32>, bool)>>;

fn collector() -> (Collected, Box<dyn colibri_sched::scheduler::EventSink>) {
    let out: Collected = Arc::new(Mutex::new((Vec::new(), false)));
    let o = out.clone();
    let sink = move |ev: Event| {
        let mut g = o.lock().unwrap();
        match ev {
            Event::Token(t) => g.0.push(t.token),
            Event::Done(_) => g.1 = true,
            Event::Error(e) => panic!("{e}"),
        }
        true
    };
    (out, Box::new(sink))
}

fn wait_all(outs: &[Collected]) {
    for _ in 0..20_000 {
        if outs.iter().all(|o| o.lock().unwrap().1) {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    panic!("sequences did not finish");
}

fn prompts() -> Vec<Vec<u32>> {
    (0..8)
        .map(|i| {
            (0..(3 + i * 5))
                .map(|j| ((i * 37 + j * 11) % 250 + 3) as u32)
                .collect()
        })
        .collect()
}

#[test]
fn eight_concurrent_sequences_equal_their_single_runs_and_share_expert_fetches() {
    let engine = Arc::new(
        Engine::load(
            &fixture("qwen3_moe"),
            &EngineOptions {
                threads: 2,
                ctx: 0,
                tier: no_usage(),
                ..EngineOptions::default()
            },
        )
        .unwrap(),
    );
    // Alone, one after the other (greedy and seeded sampling).
    let mut alone = Vec::new();
    for (i, p) in prompts().into_iter().enumerate() {
        let seed = (i % 2 == 1).then_some(i as u64);
        let mut seq = Sequence::new(&engine.model, req(p, 20, seed), 256, None).unwrap();
        engine.generate(&mut seq, |_| true).unwrap();
        alone.push(seq.generated().to_vec());
    }
    let before = engine.expert_counters.snapshot();

    // Together.
    let sched = Scheduler::start(
        engine.clone(),
        SchedulerConfig {
            max_batch: 8,
            max_queue: 8,
            step_tokens: 64,
        },
    );
    let mut outs = Vec::new();
    for (i, p) in prompts().into_iter().enumerate() {
        let seed = (i % 2 == 1).then_some(i as u64);
        let seq = Sequence::new(&engine.model, req(p, 20, seed), 256, None).unwrap();
        let (o, sink) = collector();
        sched.submit(seq, sink).unwrap();
        outs.push(o);
    }
    wait_all(&outs);
    for (i, (o, a)) in outs.iter().zip(&alone).enumerate() {
        assert_eq!(&o.lock().unwrap().0, a, "sequence {i} differs when batched");
    }

    // Shared reads: one fetch per MoE layer per step serves every row.
    let after = engine.expert_counters.snapshot();
    let stats = sched.stats();
    let steps = stats.steps_total.load(std::sync::atomic::Ordering::Relaxed);
    let rows = stats.rows_total.load(std::sync::atomic::Ordering::Relaxed);
    let spec = &engine.model.spec;
    let moe_layers = spec.layers.iter().filter(|l| l.ffn == FfnKind::Moe).count() as u64;
    let top_k = spec.moe.as_ref().unwrap().top_k as u64;
    let calls = after.fetch_calls - before.fetch_calls;
    let fetched = after.experts_fetched - before.experts_fetched;
    assert_eq!(
        calls,
        steps * moe_layers,
        "one fetch per MoE layer per step"
    );
    assert!(
        rows > steps,
        "steps must batch several rows ({rows} rows in {steps} steps)"
    );
    assert!(
        fetched < rows * top_k * moe_layers,
        "expert fetches {fetched} not shared across {rows} rows"
    );
}

#[test]
fn a_sink_that_goes_away_cancels_its_sequence() {
    let engine = Arc::new(
        Engine::load(
            &fixture("mixtral"),
            &EngineOptions {
                threads: 1,
                ctx: 0,
                tier: no_usage(),
                ..EngineOptions::default()
            },
        )
        .unwrap(),
    );
    let sched = Scheduler::start(engine.clone(), SchedulerConfig::default());
    let count = Arc::new(Mutex::new(0usize));
    let c = count.clone();
    let sink = move |ev: Event| {
        if let Event::Token(_) = ev {
            *c.lock().unwrap() += 1;
        }
        *c.lock().unwrap() < 3 // gone after the third token
    };
    let seq = Sequence::new(&engine.model, req(vec![5, 6, 7], 200, None), 256, None).unwrap();
    sched.submit(seq, Box::new(sink)).unwrap();
    // A normal request afterwards still completes.
    let (o, sink) = collector();
    sched
        .submit(
            Sequence::new(&engine.model, req(vec![9, 10], 5, None), 256, None).unwrap(),
            sink,
        )
        .unwrap();
    wait_all(std::slice::from_ref(&o));
    for _ in 0..2000 {
        if sched
            .stats()
            .running
            .load(std::sync::atomic::Ordering::Relaxed)
            == 0
        {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(
        *count.lock().unwrap(),
        3,
        "no tokens after the sink went away"
    );
    assert_eq!(
        sched
            .stats()
            .requests_cancelled
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    assert_eq!(o.lock().unwrap().0.len(), 5);
}

#[test]
fn a_full_queue_refuses_new_requests() {
    let engine = Arc::new(
        Engine::load(
            &fixture("olmoe"),
            &EngineOptions {
                threads: 1,
                ctx: 0,
                tier: no_usage(),
                ..EngineOptions::default()
            },
        )
        .unwrap(),
    );
    let sched = Scheduler::start(
        engine.clone(),
        SchedulerConfig {
            max_batch: 1,
            max_queue: 1,
            step_tokens: 8,
        },
    );
    let mut accepted = 0;
    let mut refused = 0;
    for _ in 0..6 {
        let seq = Sequence::new(&engine.model, req(vec![4, 5, 6], 100, None), 256, None).unwrap();
        let (_o, sink) = collector();
        match sched.submit(seq, sink) {
            Ok(()) => accepted += 1,
            Err(SubmitError::QueueFull) => refused += 1,
            Err(e) => panic!("{e:?}"),
        }
    }
    assert_eq!(accepted, 2);
    assert_eq!(refused, 4);
}

/// Tests never write a usage history to the user's cache.
fn no_usage() -> colibri_sched::tier::TierOptions {
    colibri_sched::tier::TierOptions {
        usage: colibri_sched::tier::UsageMode::Off,
        ..Default::default()
    }
}
