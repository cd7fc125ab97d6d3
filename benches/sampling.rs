//! Time per token of `Sampler::sample` over a Qwen3-sized vocabulary.
//!
//! `cargo bench --bench sampling [-- --reps N]`
//!
//! The logits look like a real model's: a normal-ish bulk and a handful of
//! tokens well above it (the likely continuations), so top-p's nucleus is
//! short. A second table repeats the settings on flat logits (uniform in
//! [-10, 10]), the worst case for top-p, whose nucleus then spans most of
//! the vocabulary. Each draw samples from a fresh copy of the logits; the
//! copy is made outside the timed region. Prints the mean and the median
//! milliseconds per token; asserts nothing.

use std::time::{Duration, Instant};

use colibri_model::sampling::{Sampler, SamplingParams};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const VOCAB: usize = 151_936;

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A standard normal draw (Box–Muller).
fn normal(rng: &mut impl Rng) -> f32 {
    let u1: f64 = 1.0 - rng.random::<f64>();
    let u2: f64 = rng.random();
    ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
}

/// Bulk around -2 with spread 2.5, and 8 tokens between 12 and 20.
fn model_like(rng: &mut impl Rng) -> Vec<f32> {
    let mut l: Vec<f32> = (0..VOCAB).map(|_| -2.0 + 2.5 * normal(rng)).collect();
    for _ in 0..8 {
        let i = rng.random_range(0..VOCAB);
        l[i] = rng.random_range(12.0f32..20.0);
    }
    l
}

fn flat(rng: &mut impl Rng) -> Vec<f32> {
    (0..VOCAB)
        .map(|_| rng.random_range(-10.0f32..10.0))
        .collect()
}

fn settings() -> Vec<(&'static str, SamplingParams)> {
    let t = |temperature| SamplingParams {
        temperature,
        seed: Some(7),
        ..Default::default()
    };
    vec![
        ("greedy", t(0.0)),
        ("temperature 1", t(1.0)),
        (
            "temperature 0.7, top_p 0.9",
            SamplingParams {
                top_p: 0.9,
                ..t(0.7)
            },
        ),
        (
            "temperature 0.7, top_k 40",
            SamplingParams {
                top_k: 40,
                ..t(0.7)
            },
        ),
        (
            "temperature 0.8, min_p 0.05",
            SamplingParams {
                min_p: 0.05,
                ..t(0.8)
            },
        ),
    ]
}

fn run(title: &str, inputs: &[Vec<f32>], reps: usize) {
    println!("{title}; vocab {VOCAB}, {reps} draws each");
    let mut buf = vec![0.0f32; VOCAB];
    for (name, params) in settings() {
        let mut sampler = Sampler::new(params);
        let mut times = Vec::with_capacity(reps);
        for r in 0..reps + 3 {
            buf.copy_from_slice(&inputs[r % inputs.len()]);
            let t = Instant::now();
            std::hint::black_box(sampler.sample(std::hint::black_box(&mut buf), &[], &[]));
            let dt = t.elapsed();
            if r >= 3 {
                times.push(dt);
            }
        }
        times.sort();
        let mean = times.iter().sum::<Duration>().as_secs_f64() / reps as f64;
        let median = times[reps / 2].as_secs_f64();
        println!(
            "  {name:<28} {:>8.3} ms per token (median {:.3})",
            mean * 1e3,
            median * 1e3
        );
    }
}

fn main() {
    let reps = arg("--reps", 200).max(1);
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let model: Vec<Vec<f32>> = (0..8).map(|_| model_like(&mut rng)).collect();
    let flat: Vec<Vec<f32>> = (0..8).map(|_| flat(&mut rng)).collect();
    run("model-like logits", &model, reps);
    run("flat logits (top-p's worst case)", &flat, reps);
}
