//! Logits to tokens: penalties, temperature, top-k, top-p, min-p, and a
//! seeded generator so the same seed always gives the same tokens.
//!
//! Order (as transformers and vLLM apply them): repetition penalty over the
//! whole context, frequency/presence penalties over the generated tokens,
//! banned tokens masked, then greedy (temperature 0) or temperature →
//! top-k → top-p → min-p → draw.

use std::collections::HashMap;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means off.
    pub top_k: usize,
    /// 1 means off.
    pub top_p: f32,
    /// 0 means off.
    pub min_p: f32,
    /// 1 means off; >1 discourages tokens already in the context.
    pub repetition_penalty: f32,
    /// OpenAI's: subtracted once per occurrence in the generated text.
    pub frequency_penalty: f32,
    /// OpenAI's: subtracted once if the token occurs in the generated text.
    pub presence_penalty: f32,
    /// None: a fresh random seed per request.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed: None,
        }
    }
}

impl SamplingParams {
    /// Rejects values no sampler can honour (NaN, negative temperature,
    /// probabilities outside [0, 1], non-positive repetition penalty).
    pub fn validate(&self) -> Result<()> {
        let bad = |what: &str, v: f32| ModelError::Invalid(format!("invalid {what}: {v}"));
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(bad("temperature (must be >= 0)", self.temperature));
        }
        if !(self.top_p.is_finite() && self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(bad("top_p (must be in (0, 1])", self.top_p));
        }
        if !(self.min_p.is_finite() && (0.0..=1.0).contains(&self.min_p)) {
            return Err(bad("min_p (must be in [0, 1])", self.min_p));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(bad(
                "repetition_penalty (must be > 0)",
                self.repetition_penalty,
            ));
        }
        for (what, v) in [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ] {
            if !(v.is_finite() && (-2.0..=2.0).contains(&v)) {
                return Err(bad(&format!("{what} (must be in [-2, 2])"), v));
            }
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// Draws tokens for one sequence.
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    /// Occurrences of each generated token (frequency/presence penalties).
    generated: HashMap<u32, u32>,
}

/// One candidate token after filtering, with its probability.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    pub token: u32,
    pub prob: f32,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Sampler {
        let seed = params.seed.unwrap_or_else(|| rand::rng().random());
        Sampler {
            params,
            rng: ChaCha8Rng::seed_from_u64(seed),
            generated: HashMap::new(),
        }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Applies the penalties and bans to `logits` in place. `context` is the
    /// whole sequence so far (prompt and generated tokens).
    pub fn apply_penalties(&self, logits: &mut [f32], context: &[u32], banned: &[u32]) {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            let mut seen = vec![false; logits.len()];
            for &t in context {
                let t = t as usize;
                if t < logits.len() && !std::mem::replace(&mut seen[t], true) {
                    let l = &mut logits[t];
                    *l = if *l > 0.0 {
                        *l / p.repetition_penalty
                    } else {
                        *l * p.repetition_penalty
                    };
                }
            }
        }
        if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
            for (&t, &n) in &self.generated {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= n as f32 * p.frequency_penalty + p.presence_penalty;
                }
            }
        }
        for &b in banned {
            if let Some(l) = logits.get_mut(b as usize) {
                *l = f32::NEG_INFINITY;
            }
        }
    }

    /// The distribution the draw is taken from (after temperature, top-k,
    /// top-p, min-p), most probable first. Greedy gives one candidate.
    pub fn candidates(&self, logits: &[f32]) -> Vec<Candidate> {
        let p = &self.params;
        if p.is_greedy() {
            return vec![Candidate {
                token: argmax(logits),
                prob: 1.0,
            }];
        }
        let mut idx: Vec<u32> = (0..logits.len() as u32)
            .filter(|&i| logits[i as usize] > f32::NEG_INFINITY)
            .collect();
        if idx.is_empty() {
            return vec![Candidate {
                token: argmax(logits),
                prob: 1.0,
            }];
        }
        idx.sort_by(|&a, &b| {
            logits[b as usize]
                .total_cmp(&logits[a as usize])
                .then(a.cmp(&b))
        });
        if p.top_k > 0 {
            idx.truncate(p.top_k);
        }
        let inv_t = 1.0 / p.temperature;
        let max = logits[idx[0] as usize] * inv_t;
        let mut probs: Vec<f64> = idx
            .iter()
            .map(|&i| ((logits[i as usize] * inv_t - max) as f64).exp())
            .collect();
        let sum: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|q| *q /= sum);
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            let mut keep = probs.len();
            for (i, q) in probs.iter().enumerate() {
                cum += q;
                if cum >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            idx.truncate(keep);
            probs.truncate(keep);
        }
        if p.min_p > 0.0 {
            let floor = probs[0] * p.min_p as f64;
            let keep = probs.iter().take_while(|&&q| q >= floor).count().max(1);
            idx.truncate(keep);
            probs.truncate(keep);
        }
        let sum: f64 = probs.iter().sum();
        idx.iter()
            .zip(&probs)
            .map(|(&token, &q)| Candidate {
                token,
                prob: (q / sum) as f32,
            })
            .collect()
    }

    /// Picks the next token from raw `logits` (modified in place by the
    /// penalties) and records it as generated.
    pub fn sample(&mut self, logits: &mut [f32], context: &[u32], banned: &[u32]) -> u32 {
        self.apply_penalties(logits, context, banned);
        let cands = self.candidates(logits);
        let token = if cands.len() == 1 {
            cands[0].token
        } else {
            let u: f64 = self.rng.random();
            let mut cum = 0.0f64;
            let mut pick = cands[cands.len() - 1].token;
            for c in &cands {
                cum += c.prob as f64;
                if u < cum {
                    pick = c.token;
                    break;
                }
            }
            pick
        };
        *self.generated.entry(token).or_insert(0) += 1;
        token
    }
}

/// Index of the largest value; the first one on ties (as torch.argmax).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Log-probabilities of `logits` (for logprobs and scoring), in f64.
pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = logits
        .iter()
        .map(|&l| (l as f64 - max).exp())
        .sum::<f64>()
        .ln()
        + max;
    logits.iter().map(|&l| l as f64 - lse).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        vec![1.0, 3.0, 2.5, -1.0, 0.5, 2.9, -3.0, 0.0]
    }

    #[test]
    fn greedy_is_argmax_and_ignores_seed() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&mut logits(), &[], &[]), 1);
        let mut s = Sampler::new(SamplingParams {
            seed: Some(9),
            ..Default::default()
        });
        assert_eq!(s.sample(&mut logits(), &[], &[]), 1);
    }

    #[test]
    fn banned_tokens_are_never_drawn() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&mut logits(), &[], &[1]), 5);
    }

    #[test]
    fn same_seed_same_tokens_different_seed_differs() {
        let draw = |seed| {
            let mut s = Sampler::new(SamplingParams {
                temperature: 1.5,
                seed: Some(seed),
                ..Default::default()
            });
            (0..64)
                .map(|_| s.sample(&mut logits(), &[], &[]))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(42), draw(42));
        assert_ne!(draw(42), draw(43));
    }

    #[test]
    fn top_k_top_p_min_p_restrict_the_support() {
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 3,
            ..Default::default()
        };
        let c = Sampler::new(p).candidates(&logits());
        assert_eq!(c.iter().map(|c| c.token).collect::<Vec<_>>(), vec![1, 5, 2]);
        assert!((c.iter().map(|c| c.prob).sum::<f32>() - 1.0).abs() < 1e-6);

        // softmax of [3, 2.9, 2.5, ...]: the top two hold about 0.47 of the mass.
        let p = SamplingParams {
            temperature: 1.0,
            top_p: 0.45,
            ..Default::default()
        };
        let c = Sampler::new(p).candidates(&logits());
        assert_eq!(c.iter().map(|c| c.token).collect::<Vec<_>>(), vec![1, 5]);

        // min_p 0.5: keep tokens with p >= 0.5 * p(3.0): exp(-0.693) -> logits >= 2.307.
        let p = SamplingParams {
            temperature: 1.0,
            min_p: 0.5,
            ..Default::default()
        };
        let c = Sampler::new(p).candidates(&logits());
        assert_eq!(c.iter().map(|c| c.token).collect::<Vec<_>>(), vec![1, 5, 2]);
    }

    #[test]
    fn sampling_frequencies_follow_the_distribution() {
        let p = SamplingParams {
            temperature: 1.0,
            seed: Some(1),
            ..Default::default()
        };
        let l = vec![0.0f32, (2.0f32).ln(), (5.0f32).ln()]; // probs 1/8, 2/8, 5/8
        let mut s = Sampler::new(p);
        let mut counts = [0usize; 3];
        for _ in 0..40_000 {
            counts[s.sample(&mut l.clone(), &[], &[]) as usize] += 1;
        }
        let freq: Vec<f64> = counts.iter().map(|&c| c as f64 / 40_000.0).collect();
        for (f, want) in freq.iter().zip([0.125, 0.25, 0.625]) {
            assert!((f - want).abs() < 0.01, "{freq:?}");
        }
    }

    #[test]
    fn penalties_follow_their_definitions() {
        let p = SamplingParams {
            repetition_penalty: 2.0,
            ..Default::default()
        };
        let s = Sampler::new(p);
        let mut l = vec![4.0f32, -4.0, 1.0];
        s.apply_penalties(&mut l, &[0, 1, 0], &[]);
        assert_eq!(l, vec![2.0, -8.0, 1.0]);

        let p = SamplingParams {
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            ..Default::default()
        };
        let mut s = Sampler::new(p);
        s.generated.insert(2, 3);
        let mut l = vec![1.0f32, 1.0, 1.0];
        s.apply_penalties(&mut l, &[], &[]);
        assert_eq!(l, vec![1.0, 1.0, 1.0 - 1.5 - 0.25]);
    }

    #[test]
    fn invalid_params_are_rejected() {
        for p in [
            SamplingParams {
                temperature: f32::NAN,
                ..Default::default()
            },
            SamplingParams {
                temperature: -1.0,
                ..Default::default()
            },
            SamplingParams {
                top_p: 0.0,
                ..Default::default()
            },
            SamplingParams {
                min_p: 1.5,
                ..Default::default()
            },
            SamplingParams {
                repetition_penalty: 0.0,
                ..Default::default()
            },
            SamplingParams {
                presence_penalty: 3.0,
                ..Default::default()
            },
        ] {
            assert!(p.validate().is_err(), "{p:?}");
        }
        assert!(SamplingParams::default().validate().is_ok());
    }
}
