//! Logits to tokens: penalties, temperature, top-k, top-p, min-p, and a
//! seeded generator so the same seed always gives the same tokens.
//!
//! Order (as transformers and vLLM apply them): repetition penalty over the
//! whole context, frequency/presence penalties over the generated tokens,
//! banned tokens masked, then greedy (temperature 0) or temperature →
//! top-k → top-p → min-p → draw.
//!
//! None of the paths sorts the vocabulary (152K entries for Qwen3, where a
//! full sort costs 10-20 ms a token):
//!
//! - greedy: [`argmax`], a vectorized maximum then its first index;
//! - top-k: only the logits at or above a floor known to be at most the
//!   k-th largest are gathered, then the k best selected and sorted; from
//!   there the arithmetic is the sort-based one, so the candidates, their
//!   probabilities and the token a seed gives are bit for bit as before;
//! - top-p without top-k: one vectorized pass for the normalizer, then a
//!   sorted prefix grown until it holds `top_p` of the mass (see
//!   `Sampler::nucleus`); the draw walks that list, most probable first;
//! - plain temperature (top-k off, top-p 1, with or without min-p): no
//!   list at all: a vectorized pass sums the weights per block, and the
//!   draw walks the tokens in index order (`Sampler::draw_plain`). The
//!   distribution is the same as a sorted list's, up to rounding (weights
//!   within 8.2e-8 relative of f64 `exp`); a seed gives the same tokens run
//!   to run, though not the tokens the former sort-based walk gave.
//!
//! Candidates are ordered by logit descending (`f32::total_cmp`), then
//! token id ascending; candidates are the tokens whose logit is above -inf
//! (so neither banned nor NaN).

use std::collections::HashMap;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};
use crate::ops::fast_exp;

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
    /// top-p, min-p), most probable first (ties: lower token id first).
    /// Greedy gives one candidate, the argmax; so does a temperature when no
    /// token is left (every logit -inf or NaN).
    ///
    /// With top-k or top-p this is the short list `sample` draws from. With
    /// plain temperature (top-k off, top-p 1, min-p or not) it is every token
    /// min-p keeps, sorted: `sample` draws from the same distribution without
    /// building it (see the module notes).
    pub fn candidates(&self, logits: &[f32]) -> Vec<Candidate> {
        let p = &self.params;
        let m = max_value(logits);
        if p.is_greedy() || m == f32::NEG_INFINITY {
            return vec![Candidate {
                token: argmax(logits),
                prob: 1.0,
            }];
        }
        let inv_t = 1.0 / p.temperature;
        if p.top_k > 0 {
            finish(
                logits,
                &top_k_keys(logits, p.top_k),
                inv_t,
                p.top_p,
                p.min_p,
            )
        } else if p.top_p < 1.0 {
            self.nucleus(logits, inv_t, m * inv_t)
        } else {
            // The tokens `draw_plain` can pick: min-p is applied here by the
            // same threshold as there, so `finish` gets it off.
            let mx = m * inv_t;
            let x_min = min_p_threshold(p.min_p);
            let mut keys = collect_keys(logits, |l| l * inv_t - mx >= x_min);
            keys.sort_unstable();
            finish(logits, &keys, inv_t, 1.0, 0.0)
        }
    }

    /// Top-p without top-k: the shortest prefix of the candidates, most
    /// probable first, whose probabilities (normalized over all candidates)
    /// sum to `top_p` or more; then min-p. `mx` is the largest logit times
    /// `inv_t`.
    ///
    /// The normalizer comes from one pass of [`fast_exp`] over the
    /// vocabulary. The tokens whose scaled logit is below
    /// `ln((1 - top_p) * Z / count)` hold less than `1 - top_p` of the mass
    /// together, so the prefix lies among the others: they alone are
    /// gathered, then sorted a growing slice at a time (select, then sort
    /// the slice) until the mass is reached. Each weight in the prefix is
    /// the sort-based code's f64 `exp`; where the prefix's end would move
    /// if the normalizer moved by [`Z_REL_ERR`], the exact normalizer (f64
    /// `exp` over all candidates, in index order) decides.
    fn nucleus(&self, logits: &[f32], inv_t: f32, mx: f32) -> Vec<Candidate> {
        let p = &self.params;
        let top_p = p.top_p as f64;
        let (blocks, count) = weight_blocks(logits, inv_t, mx, f32::NEG_INFINITY);
        let mut z: f64 = blocks.iter().sum();
        let theta = ((1.0 - top_p) * z / count.max(1) as f64).ln() as f32;
        let theta = if theta.is_nan() {
            f32::NEG_INFINITY
        } else {
            theta
        };
        // These and the rest (`x < theta`) split the candidates in two,
        // NaN included.
        let mut keys = collect_keys(logits, |l| {
            let x = l * inv_t - mx;
            x >= theta || x.is_nan()
        });
        let mut rest_added = false;
        let mut exact = false;
        // Exact weights of keys[..weights.len()], which are sorted.
        let mut weights: Vec<f64> = Vec::new();
        let mut walked = 0;
        let mut cum = 0.0f64;
        let keep = loop {
            let mut crossed = None;
            while walked < weights.len() {
                let before = cum;
                cum += weights[walked] / z;
                walked += 1;
                if cum >= top_p {
                    crossed = Some(before);
                    break;
                }
            }
            let ambiguous = match crossed {
                Some(before) => {
                    cum * (1.0 - Z_REL_ERR) < top_p || before * (1.0 + Z_REL_ERR) >= top_p
                }
                None => cum * (1.0 + Z_REL_ERR) >= top_p,
            };
            let done = crossed.is_some() || (rest_added && weights.len() == keys.len());
            if done {
                if ambiguous && !exact {
                    z = exact_normalizer(logits, inv_t, mx);
                    exact = true;
                    walked = 0;
                    cum = 0.0;
                    continue;
                }
                break walked;
            }
            let sorted = weights.len();
            if sorted == keys.len() {
                rest_added = true;
                keys.extend(collect_keys(logits, |l| l * inv_t - mx < theta));
                continue;
            }
            // Each further weight is at most the last one walked, so at
            // least `(top_p - cum) * z / last` more are needed.
            let last = weights.last().copied().unwrap_or(1.0);
            let need = ((top_p - cum) * z / last * 1.25) as usize;
            let rest = &mut keys[sorted..];
            let take = if rest.len() <= SORT_ALL {
                rest.len()
            } else {
                need.max(sorted).clamp(SORT_ALL / 4, rest.len())
            };
            if take < rest.len() {
                rest.select_nth_unstable(take - 1);
            }
            rest[..take].sort_unstable();
            weights.extend(
                rest[..take]
                    .iter()
                    .map(|&k| exact_weight(logits[key_token(k) as usize], inv_t, mx)),
            );
        };
        let probs: Vec<f64> = weights[..keep].iter().map(|&e| e / z).collect();
        min_p_and_normalize(logits, &keys[..keep], &probs, p.min_p)
    }

    /// Picks the next token from raw `logits` (modified in place by the
    /// penalties) and records it as generated.
    pub fn sample(&mut self, logits: &mut [f32], context: &[u32], banned: &[u32]) -> u32 {
        self.apply_penalties(logits, context, banned);
        let p = &self.params;
        let token = if p.is_greedy() {
            argmax(logits)
        } else if p.top_k > 0 || p.top_p < 1.0 {
            let cands = self.candidates(logits);
            match cands.as_slice() {
                [] => argmax(logits),
                [only] => only.token,
                [.., last] => {
                    let u: f64 = self.rng.random();
                    let mut cum = 0.0f64;
                    let mut pick = last.token;
                    for c in &cands {
                        cum += c.prob as f64;
                        if u < cum {
                            pick = c.token;
                            break;
                        }
                    }
                    pick
                }
            }
        } else {
            self.draw_plain(logits)
        };
        *self.generated.entry(token).or_insert(0) += 1;
        token
    }

    /// Plain temperature (top-k off, top-p 1), with or without min-p: one
    /// pass sums the weights per block of [`BLOCK`] tokens, then `u * Z`
    /// (`u` uniform in [0, 1)) is found among the block sums and walked
    /// token by token, in index order, inside its block. No sort.
    fn draw_plain(&mut self, logits: &[f32]) -> u32 {
        let m = max_value(logits);
        if m == f32::NEG_INFINITY {
            return argmax(logits);
        }
        let inv_t = 1.0 / self.params.temperature;
        let mx = m * inv_t;
        let x_min = min_p_threshold(self.params.min_p);
        let (blocks, count) = weight_blocks(logits, inv_t, mx, x_min);
        if count <= 1 {
            // Only the most probable token is left (min-p always keeps it).
            return argmax(logits);
        }
        let z: f64 = blocks.iter().sum();
        let u: f64 = self.rng.random();
        let target = u * z;
        let mut cum = 0.0f64;
        let mut start = blocks.len();
        for (b, &s) in blocks.iter().enumerate() {
            if target < cum + s {
                start = b;
                break;
            }
            cum += s;
        }
        let mut buf = [0.0f32; BLOCK];
        for (b, block) in logits.chunks(BLOCK).enumerate().skip(start) {
            let w = &mut buf[..block.len()];
            block_weights(block, w, inv_t, mx, x_min);
            for (j, &e) in w.iter().enumerate() {
                if e > 0.0 {
                    cum += e as f64;
                    if target < cum {
                        return (b * BLOCK + j) as u32;
                    }
                }
            }
        }
        // Rounding left `target` past the last weight: the last token that
        // has one.
        (0..logits.len())
            .rev()
            .find(|&i| weight(logits[i], inv_t, mx, x_min).0 > 0.0)
            .map_or_else(|| argmax(logits), |i| i as u32)
    }
}

/// Tokens per block of the weight sums of the plain-temperature draw.
const BLOCK: usize = 1024;

/// Independent accumulators of the vectorized loops.
const LANES: usize = 8;

/// Gathered candidates up to this many are sorted at once by top-p.
const SORT_ALL: usize = 2048;

/// Bound on the relative error of the normalizer summed with [`fast_exp`]:
/// its largest relative error over every f32 in [-87, 0] is 8.2e-8 (the
/// terms it sets to 0 below -87 weigh under 2e-38 each, against a sum of at
/// least 1).
const Z_REL_ERR: f64 = 1.5e-7;

/// A candidate's weight as the sort-based code computes it: `exp` in f64 of
/// the scaled logit minus the scaled maximum.
#[inline]
fn exact_weight(l: f32, inv_t: f32, max: f32) -> f64 {
    ((l * inv_t - max) as f64).exp()
}

/// The plain-temperature weight of one logit: [`fast_exp`] of `x = l *
/// inv_t - mx` if the token is a candidate (`l > -inf`) and `x >= x_min`
/// (min-p), else 0; and whether it is kept.
#[inline(always)]
fn weight(l: f32, inv_t: f32, mx: f32, x_min: f32) -> (f32, bool) {
    let x = l * inv_t - mx;
    let kept = l > f32::NEG_INFINITY && x >= x_min;
    (if kept { fast_exp(x) } else { 0.0 }, kept)
}

/// Writes the [`weight`] of each logit of `block` to `out` (as long as
/// `block`) and returns how many are kept.
#[inline(always)]
fn block_weights(block: &[f32], out: &mut [f32], inv_t: f32, mx: f32, x_min: f32) -> usize {
    let mut kept = 0u32;
    for (o, &l) in out.iter_mut().zip(block) {
        let (w, k) = weight(l, inv_t, mx, x_min);
        *o = w;
        kept += k as u32;
    }
    kept as usize
}

/// Per block of [`BLOCK`] logits, the sum of their [`weight`]s (in f64,
/// over [`LANES`] interleaved partial sums); and how many tokens are kept
/// in all. The same on every CPU: the AVX2 build runs the same operations
/// (Rust never fuses a multiply and an add).
fn weight_blocks(logits: &[f32], inv_t: f32, mx: f32, x_min: f32) -> (Vec<f64>, usize) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        return unsafe { weight_blocks_avx2(logits, inv_t, mx, x_min) };
    }
    weight_blocks_any(logits, inv_t, mx, x_min)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn weight_blocks_avx2(logits: &[f32], inv_t: f32, mx: f32, x_min: f32) -> (Vec<f64>, usize) {
    weight_blocks_any(logits, inv_t, mx, x_min)
}

#[inline(always)]
fn weight_blocks_any(logits: &[f32], inv_t: f32, mx: f32, x_min: f32) -> (Vec<f64>, usize) {
    let mut count = 0usize;
    let mut buf = [0.0f32; BLOCK];
    let mut sums = Vec::with_capacity(logits.len().div_ceil(BLOCK));
    // Plain loops, not iterator adapters: their closures would not be
    // compiled for AVX2.
    for block in logits.chunks(BLOCK) {
        let w = &mut buf[..block.len()];
        count += block_weights(block, w, inv_t, mx, x_min);
        let mut acc = [0.0f64; LANES];
        let lanes = w.chunks_exact(LANES);
        let rest = lanes.remainder();
        for c in lanes {
            for j in 0..LANES {
                acc[j] += c[j] as f64;
            }
        }
        let mut sum = 0.0f64;
        for a in acc {
            sum += a;
        }
        for &e in rest {
            sum += e as f64;
        }
        sums.push(sum);
    }
    (sums, count)
}

/// The sum of [`exact_weight`] over every candidate, in index order.
fn exact_normalizer(logits: &[f32], inv_t: f32, mx: f32) -> f64 {
    logits
        .iter()
        .filter(|&&l| l > f32::NEG_INFINITY)
        .map(|&l| exact_weight(l, inv_t, mx))
        .sum()
}

/// The smallest f32 `x` with `exp(x as f64) >= min_p`: a token passes min-p
/// when its scaled logit minus the largest one is at least this (its
/// probability is then at least `min_p` times the largest). -inf when min-p
/// is off.
fn min_p_threshold(min_p: f32) -> f32 {
    if min_p.is_nan() || min_p <= 0.0 {
        return f32::NEG_INFINITY;
    }
    let passes = |x: f32| (x as f64).exp() >= min_p as f64;
    // Bisect over the f32s in order: exp(-inf) = 0 fails, exp(inf) passes.
    let (mut lo, mut hi) = (order_bits(f32::NEG_INFINITY), order_bits(f32::INFINITY));
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if passes(from_order_bits(mid)) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    from_order_bits(hi)
}

/// `x`'s bits mapped so that unsigned order is `f32::total_cmp`'s order.
#[inline(always)]
fn order_bits(x: f32) -> u32 {
    let b = x.to_bits();
    b ^ ((((b as i32) >> 31) as u32) | 0x8000_0000)
}

fn from_order_bits(o: u32) -> f32 {
    f32::from_bits(if o & 0x8000_0000 != 0 {
        o ^ 0x8000_0000
    } else {
        !o
    })
}

/// A candidate as one integer: ascending order of keys is the candidates'
/// order (logit descending by `total_cmp`, then token id ascending).
#[inline(always)]
fn sort_key(l: f32, token: usize) -> u64 {
    ((!order_bits(l) as u64) << 32) | token as u64
}

#[inline(always)]
fn key_token(key: u64) -> u32 {
    key as u32
}

/// Keys of the candidates (`l > -inf`, so not NaN) that `keep` accepts, in
/// token order. Usually few pass: each slice of 64 logits is first tested
/// as a whole (a loop that vectorizes), and only the slices with a passing
/// logit are gathered.
#[inline(always)]
fn collect_keys(logits: &[f32], keep: impl Fn(f32) -> bool) -> Vec<u64> {
    const W: usize = 64;
    let pass = |l: f32| (l > f32::NEG_INFINITY) & keep(l);
    let mut keys = Vec::new();
    for (c, slice) in logits.chunks(W).enumerate() {
        if slice.iter().fold(false, |any, &l| any | pass(l)) {
            // Branch-free: every key is written, the count moves on only
            // past those that pass.
            let mut buf = [0u64; W];
            let mut n = 0;
            for (j, &l) in slice.iter().enumerate() {
                buf[n] = sort_key(l, c * W + j);
                n += pass(l) as usize;
            }
            keys.extend_from_slice(&buf[..n]);
        }
    }
    keys
}

/// The first `k` candidates in order (`k >= 1`), sorted. Whatever is at
/// least the k-th largest of the maxima of `4k` slices of the logits is at
/// least the k-th largest logit, so only the logits at or above it (about
/// `k` of them on most data) are gathered, selected and sorted.
fn top_k_keys(logits: &[f32], k: usize) -> Vec<u64> {
    let n = logits.len();
    let floor = if k.saturating_mul(8) <= n {
        let slice = n / (4 * k);
        let mut maxima: Vec<f32> = logits.chunks(slice).map(max_value).collect();
        *maxima
            .select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a))
            .1
    } else {
        f32::NEG_INFINITY
    };
    let mut keys = collect_keys(logits, |l| l >= floor);
    if keys.len() > k {
        keys.select_nth_unstable(k - 1);
        keys.truncate(k);
    }
    keys.sort_unstable();
    keys
}

/// The sort-based arithmetic from the sorted candidates `keys` on:
/// probabilities normalized over `keys`, then top-p and min-p, then
/// normalized again.
fn finish(logits: &[f32], keys: &[u64], inv_t: f32, top_p: f32, min_p: f32) -> Vec<Candidate> {
    let Some(&first) = keys.first() else {
        return vec![Candidate {
            token: argmax(logits),
            prob: 1.0,
        }];
    };
    let max = logits[key_token(first) as usize] * inv_t;
    let mut probs: Vec<f64> = keys
        .iter()
        .map(|&k| exact_weight(logits[key_token(k) as usize], inv_t, max))
        .collect();
    let sum: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|q| *q /= sum);
    let mut keep = probs.len();
    if top_p < 1.0 {
        let mut cum = 0.0;
        for (i, q) in probs.iter().enumerate() {
            cum += q;
            if cum >= top_p as f64 {
                keep = i + 1;
                break;
            }
        }
    }
    min_p_and_normalize(logits, &keys[..keep], &probs[..keep], min_p)
}

/// Min-p over sorted candidates and their probabilities, then the
/// probabilities normalized to sum to 1.
fn min_p_and_normalize(logits: &[f32], keys: &[u64], probs: &[f64], min_p: f32) -> Vec<Candidate> {
    let Some(&top) = probs.first() else {
        return vec![Candidate {
            token: argmax(logits),
            prob: 1.0,
        }];
    };
    let mut keep = probs.len();
    if min_p > 0.0 {
        let floor = top * min_p as f64;
        keep = probs.iter().take_while(|&&q| q >= floor).count().max(1);
    }
    let sum: f64 = probs[..keep].iter().sum();
    keys[..keep]
        .iter()
        .zip(&probs[..keep])
        .map(|(&k, &q)| Candidate {
            token: key_token(k),
            prob: (q / sum) as f32,
        })
        .collect()
}

/// The largest value that is not NaN; -inf if there is none.
fn max_value(v: &[f32]) -> f32 {
    const W: usize = 16;
    let mut acc = [f32::NEG_INFINITY; W];
    let chunks = v.chunks_exact(W);
    let rest = chunks.remainder();
    for c in chunks {
        for j in 0..W {
            // `x > m` is false for NaN: NaN never enters.
            acc[j] = if c[j] > acc[j] { c[j] } else { acc[j] };
        }
    }
    let mut m = f32::NEG_INFINITY;
    for &x in acc.iter().chain(rest) {
        if x > m {
            m = x;
        }
    }
    m
}

/// Index of the largest value; the first one on ties (as torch.argmax).
/// NaN entries are skipped: the result is the first index of the largest
/// non-NaN value, and 0 when there is none (all NaN, or empty). -0.0 and
/// 0.0 count as equal.
pub fn argmax(v: &[f32]) -> u32 {
    const W: usize = 64;
    let m = max_value(v);
    let mut base = 0;
    for c in v.chunks(W) {
        if c.iter().fold(false, |any, &x| any | (x == m)) {
            return c
                .iter()
                .position(|&x| x == m)
                .map_or(0, |i| (base + i) as u32);
        }
        base += c.len();
    }
    0
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

    // ---- The sort-everything implementation this module replaced, kept
    // as the reference the fast paths are compared with.

    /// The former `argmax` (picks index 0 if it holds a NaN).
    fn reference_argmax(v: &[f32]) -> u32 {
        let mut best = 0usize;
        for (i, &x) in v.iter().enumerate() {
            if x > v[best] {
                best = i;
            }
        }
        best as u32
    }

    /// The former `candidates`: sort every candidate, then cut.
    fn reference_candidates(p: &SamplingParams, logits: &[f32]) -> Vec<Candidate> {
        if p.is_greedy() {
            return vec![Candidate {
                token: reference_argmax(logits),
                prob: 1.0,
            }];
        }
        let mut idx: Vec<u32> = (0..logits.len() as u32)
            .filter(|&i| logits[i as usize] > f32::NEG_INFINITY)
            .collect();
        if idx.is_empty() {
            return vec![Candidate {
                token: reference_argmax(logits),
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

    /// The former `sample`, on `s`'s parameters, generator and counts.
    fn reference_sample(
        s: &mut Sampler,
        logits: &mut [f32],
        context: &[u32],
        banned: &[u32],
    ) -> u32 {
        s.apply_penalties(logits, context, banned);
        let cands = reference_candidates(&s.params, logits);
        let token = if cands.len() == 1 {
            cands[0].token
        } else {
            let u: f64 = s.rng.random();
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
        *s.generated.entry(token).or_insert(0) += 1;
        token
    }

    // ---- Test data.

    fn normal(rng: &mut ChaCha8Rng) -> f32 {
        let u1: f64 = 1.0 - rng.random::<f64>();
        let u2: f64 = rng.random();
        ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
    }

    const KINDS: [&str; 7] = ["model", "peaked", "flat", "ties", "banned", "zeros", "wide"];

    /// Seeded logits of one kind: "model" (a normal bulk and a few tokens
    /// far above it), "peaked" (one token 40 above a uniform bulk), "flat"
    /// (uniform in [-1, 1]), "ties" (six distinct values), "banned" (a
    /// third -inf, a few NaN, never at index 0), "zeros" (+0.0, -0.0 and
    /// ±1: ties that `total_cmp` orders), "wide" (uniform in [-200, 200],
    /// so that most weights underflow).
    fn make(kind: &str, n: usize, seed: u64) -> Vec<f32> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut l: Vec<f32> = match kind {
            "model" => (0..n).map(|_| -2.0 + 2.5 * normal(&mut rng)).collect(),
            "peaked" => (0..n).map(|_| rng.random_range(-5.0f32..5.0)).collect(),
            "flat" => (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect(),
            "ties" => (0..n)
                .map(|_| rng.random_range(0..6) as f32 * 0.75)
                .collect(),
            "banned" => (0..n)
                .map(|i| match rng.random_range(0..30) {
                    0..10 if i > 0 => f32::NEG_INFINITY,
                    10 if i > 0 => f32::NAN,
                    _ => normal(&mut rng) * 3.0,
                })
                .collect(),
            "zeros" => (0..n)
                .map(|_| [0.0, -0.0, 1.0, -1.0][rng.random_range(0..4)])
                .collect(),
            "wide" => (0..n).map(|_| rng.random_range(-200.0f32..200.0)).collect(),
            other => panic!("no kind {other}"),
        };
        match kind {
            "model" => {
                for _ in 0..n / 1000 + 2 {
                    let i = rng.random_range(0..n);
                    l[i] = rng.random_range(12.0f32..20.0);
                }
            }
            "peaked" => {
                let i = rng.random_range(0..n);
                l[i] = 45.0;
            }
            _ => {}
        }
        l
    }

    /// Relative distance, with values below f32's normal range taken as
    /// equal to 0 (their relative precision is gone).
    fn rel(a: f32, b: f32) -> f64 {
        let (a, b) = (a as f64, b as f64);
        let tiny = f32::MIN_POSITIVE as f64;
        if a.abs() < tiny && b.abs() < tiny {
            return 0.0;
        }
        (a - b).abs() / a.abs().max(b.abs())
    }

    /// Probabilities of the fast paths may differ from the reference's by
    /// this much, relatively (top-k's are bit-identical).
    const PROB_REL: f64 = 1e-6;

    fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            seed: Some(seed),
            ..Default::default()
        }
    }

    /// The plain-temperature draw as specified: with the generator's next
    /// `u`, the first token in index order where the running sum of the
    /// reference probabilities passes `u` (no draw for a single candidate).
    fn index_order_draw(cands: &[Candidate], rng: &mut ChaCha8Rng) -> u32 {
        if cands.len() == 1 {
            return cands[0].token;
        }
        let mut by_token = cands.to_vec();
        by_token.sort_by_key(|c| c.token);
        let u: f64 = rng.random();
        let mut cum = 0.0f64;
        for c in &by_token {
            cum += c.prob as f64;
            if u < cum {
                return c.token;
            }
        }
        by_token
            .iter()
            .rev()
            .find(|c| c.prob > 0.0)
            .map_or(0, |c| c.token)
    }

    /// Compares candidates and draws with the reference for one case.
    /// Returns the largest relative probability difference.
    fn check_case(what: &str, l: &[f32], p: &SamplingParams, draws: usize) -> f64 {
        let want = reference_candidates(p, l);
        let got = Sampler::new(p.clone()).candidates(l);
        let tokens = |c: &[Candidate]| c.iter().map(|c| c.token).collect::<Vec<_>>();
        assert_eq!(tokens(&got), tokens(&want), "{what}: candidates");
        let mut worst = 0.0f64;
        for (g, w) in got.iter().zip(&want) {
            worst = worst.max(rel(g.prob, w.prob));
        }
        if p.top_k > 0 || p.is_greedy() {
            assert_eq!(got, want, "{what}: probabilities not bit-identical");
        } else {
            assert!(
                worst <= PROB_REL,
                "{what}: probabilities differ by {worst:e}"
            );
        }
        // Draws: same seed, same tokens, run to run.
        let run = || {
            let mut s = Sampler::new(p.clone());
            (0..draws)
                .map(|_| s.sample(&mut l.to_vec(), &[], &[]))
                .collect::<Vec<_>>()
        };
        let ours = run();
        assert_eq!(ours, run(), "{what}: same seed, different tokens");
        let listed = p.top_k > 0 || p.top_p < 1.0;
        if !p.is_greedy() && !listed {
            // Plain temperature walks the tokens in index order.
            let mut rng = ChaCha8Rng::seed_from_u64(p.seed.unwrap_or(0));
            let spec: Vec<u32> = (0..draws)
                .map(|_| index_order_draw(&want, &mut rng))
                .collect();
            assert_eq!(ours, spec, "{what}: index-order draw");
        } else {
            // Top-k (bit-identical lists) and top-p draw from the sorted
            // list as before: the same tokens as the reference.
            let mut s = Sampler::new(p.clone());
            let theirs: Vec<u32> = (0..draws)
                .map(|_| reference_sample(&mut s, &mut l.to_vec(), &[], &[]))
                .collect();
            assert_eq!(ours, theirs, "{what}: draws differ from the reference");
        }
        worst
    }

    #[test]
    fn small_vocabularies_match_the_reference() {
        let mut worst = 0.0f64;
        for n in [1, 2, 7, 64, 1000] {
            for (k, kind) in KINDS.iter().enumerate() {
                let l = make(kind, n, 100 + k as u64 + n as u64);
                for t in [0.0, 0.3, 1.0, 1.7] {
                    for top_k in [0, 1, 3, 40, 5000] {
                        for top_p in [1.0, 0.999, 0.9, 0.5, 0.1] {
                            for min_p in [0.0, 0.05, 0.6, 1.0] {
                                let p = params(t, top_k, top_p, min_p, n as u64 + 7);
                                let what = format!("n {n} {kind} {p:?}");
                                worst = worst.max(check_case(&what, &l, &p, 6));
                            }
                        }
                    }
                }
            }
        }
        eprintln!("largest relative probability difference: {worst:e}");
    }

    #[test]
    fn qwen3_sized_vocabulary_matches_the_reference() {
        let n = 151_936;
        let mut worst = 0.0f64;
        for (k, kind) in KINDS.iter().enumerate() {
            let l = make(kind, n, 900 + k as u64);
            for (t, top_k, top_p, min_p) in [
                (0.0, 0, 1.0, 0.0),
                (1.0, 0, 1.0, 0.0),
                (0.7, 0, 0.9, 0.0),
                (1.0, 0, 0.95, 0.05),
                (0.7, 40, 1.0, 0.0),
                (1.0, 50, 0.9, 0.1),
                (0.8, 0, 1.0, 0.05),
                (1.3, 0, 1.0, 0.5),
            ] {
                let p = params(t, top_k, top_p, min_p, 3);
                let what = format!("n {n} {kind} {p:?}");
                worst = worst.max(check_case(&what, &l, &p, 3));
            }
        }
        eprintln!("largest relative probability difference: {worst:e}");
    }

    #[test]
    fn top_p_boundaries_on_equal_logits_match_the_reference() {
        // Equal weights put the running sum within rounding of top_p at
        // every multiple of 1/n: the exact normalizer must decide.
        for n in [10, 1000, 5000] {
            let l: Vec<f32> = (0..n)
                .map(|i| if i % 3 == 0 { 2.0 } else { -1.0 })
                .collect();
            for top_p in [0.1, 0.25, 0.3, 0.5, 0.7, 0.9, 0.99, 0.999_999] {
                let p = params(1.0, 0, top_p, 0.0, 5);
                let what = format!("n {n} top_p {top_p}");
                check_case(&what, &l, &p, 4);
                let l = vec![0.5f32; n];
                check_case(&what, &l, &p, 4);
            }
        }
    }

    #[test]
    fn top_p_boundary_inside_the_fast_normalizer_error_is_decided_exactly() {
        // One token at 0 and many at x, where fast_exp is off by ~8e-8: the
        // fast normalizer is then off by nearly as much, and some top_p
        // (an f32) falls between the running sums the two normalizers give.
        let mut x = -0.5f32;
        let mut worst = (0.0f64, x);
        while x > -3.0 {
            let err = (fast_exp(x) as f64 / (x as f64).exp() - 1.0).abs();
            if err > worst.0 {
                worst = (err, x);
            }
            x = x.next_down();
        }
        let x = worst.1;
        let mut found = 0;
        for n in [300usize, 1000, 3000] {
            let mut l = vec![x; n];
            l[n / 2] = 0.0;
            let (blocks, _) = weight_blocks(&l, 1.0, 0.0, f32::NEG_INFINITY);
            let z_fast: f64 = blocks.iter().sum();
            let z_exact = exact_normalizer(&l, 1.0, 0.0);
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by(|&a, &b| l[b].total_cmp(&l[a]).then(a.cmp(&b)));
            let (mut cf, mut ce) = (0.0f64, 0.0f64);
            for &i in &order {
                let e = exact_weight(l[i], 1.0, 0.0);
                cf += e / z_fast;
                ce += e / z_exact;
                let (lo, hi) = (cf.min(ce), cf.max(ce));
                let mut t = lo as f32;
                while t as f64 <= lo {
                    t = t.next_up();
                }
                if t as f64 <= hi && t < 1.0 {
                    // The fast normalizer alone would end the nucleus a
                    // token off here.
                    found += 1;
                    let p = params(1.0, 0, t, 0.0, 9);
                    check_case(&format!("n {n} x {x} top_p {t}"), &l, &p, 4);
                }
            }
        }
        assert!(found > 0, "no top_p inside the error at x {x}");
    }

    #[test]
    fn penalties_and_bans_apply_as_before() {
        let n = 20_000;
        for (k, (t, top_k, top_p, min_p)) in [
            (1.0, 0, 1.0, 0.0),
            (0.8, 0, 1.0, 0.05),
            (0.7, 0, 0.9, 0.0),
            (0.7, 40, 1.0, 0.0),
            (1.0, 20, 0.8, 0.02),
        ]
        .into_iter()
        .enumerate()
        {
            let p = SamplingParams {
                repetition_penalty: 1.3,
                frequency_penalty: 0.5,
                presence_penalty: 0.25,
                ..params(t, top_k, top_p, min_p, 11)
            };
            let base = make("model", n, 50 + k as u64);
            let banned: Vec<u32> = (0..n as u32).step_by(97).collect();
            let (mut ours, mut theirs) = (Sampler::new(p.clone()), Sampler::new(p.clone()));
            let mut rng = ChaCha8Rng::seed_from_u64(11);
            let mut context: Vec<u32> = (0..50).map(|i| i * 31).collect();
            for step in 0..40 {
                // A fresh distribution each step, shifted by the tokens so far.
                let l: Vec<f32> = base
                    .iter()
                    .enumerate()
                    .map(|(i, &x)| x + ((i + step) % 13) as f32 * 0.1)
                    .collect();
                let a = ours.sample(&mut l.clone(), &context, &banned);
                assert!(!banned.contains(&a), "banned token {a} drawn");
                let b = if top_k == 0 && top_p == 1.0 {
                    // The reference's penalized logits and candidates,
                    // walked in index order with the same generator.
                    let mut pl = l.clone();
                    theirs.apply_penalties(&mut pl, &context, &banned);
                    let cands = reference_candidates(&theirs.params, &pl);
                    let tok = index_order_draw(&cands, &mut rng);
                    *theirs.generated.entry(tok).or_insert(0) += 1;
                    tok
                } else {
                    reference_sample(&mut theirs, &mut l.clone(), &context, &banned)
                };
                assert_eq!(a, b, "{p:?} step {step}");
                assert_eq!(ours.generated, theirs.generated);
                context.push(a);
            }
        }
    }

    #[test]
    fn argmax_is_the_first_largest_and_skips_nan() {
        for n in [1, 7, 15, 16, 17, 63, 64, 65, 1000, 151_936] {
            for (k, kind) in ["model", "ties", "zeros", "flat"].iter().enumerate() {
                let l = make(kind, n, k as u64 * 1000 + n as u64);
                assert_eq!(argmax(&l), reference_argmax(&l), "n {n} {kind}");
            }
            // The largest value last, then first.
            let mut l = make("flat", n, 3);
            l[n - 1] = 5.0;
            assert_eq!(argmax(&l), (n - 1) as u32);
            l[0] = 5.0;
            assert_eq!(argmax(&l), 0);
        }
        let nan = f32::NAN;
        let inf = f32::INFINITY;
        let ninf = f32::NEG_INFINITY;
        let cases: [(&[f32], u32); 10] = [
            (&[], 0),
            (&[nan], 0),
            (&[nan, nan, nan], 0),
            (&[nan, 1.0, 3.0, 3.0], 2), // the former code answered 0 here
            (&[1.0, nan, 5.0, nan], 2),
            (&[nan, ninf, ninf], 1),
            (&[ninf, ninf], 0),
            (&[-0.0, 0.0, -1.0], 0),
            (&[1.0, inf, nan, inf], 1),
            (&[-3.0, -2.0, nan, -2.0], 1),
        ];
        for (v, want) in cases {
            assert_eq!(argmax(v), want, "{v:?}");
        }
        // A NaN anywhere in a long vector is skipped too.
        let mut l = make("model", 151_936, 8);
        let best = reference_argmax(&l);
        // Including NaNs right after the largest, in the same lane of the
        // vectorized maximum.
        let b = best as usize;
        for i in [0, 1, 5000, 151_935, b + 16, b + 32, b + 64] {
            if i != b && i < l.len() {
                l[i] = nan;
            }
        }
        assert_eq!(argmax(&l), best);
    }

    #[test]
    fn sort_keys_order_as_total_cmp_then_token() {
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        let mut vals = vec![
            0.0f32,
            -0.0,
            1.0,
            -1.0,
            f32::INFINITY,
            f32::MIN_POSITIVE,
            -f32::MIN_POSITIVE,
            1e-45,
            -1e-45,
            f32::MAX,
            f32::MIN,
        ];
        vals.extend((0..300).map(|_| normal(&mut rng) * 10.0));
        vals.extend((0..40).map(|_| f32::from_bits(rng.random::<u32>() & 0xff7f_ffff)));
        let keyed: Vec<(f32, usize)> = vals
            .iter()
            .enumerate()
            .flat_map(|(i, &v)| [(v, i), (v, i + 1000)])
            .collect();
        for &(a, i) in &keyed {
            for &(b, j) in &keyed {
                let want = b.total_cmp(&a).then(i.cmp(&j));
                assert_eq!(sort_key(a, i).cmp(&sort_key(b, j)), want, "{a} {i} {b} {j}");
                assert_eq!(key_token(sort_key(a, i)), i as u32);
            }
        }
        for &v in &vals {
            assert_eq!(from_order_bits(order_bits(v)).to_bits(), v.to_bits());
        }
    }

    #[test]
    fn fast_exp_is_within_its_bound() {
        // A stride through every f32 in [-87, 0] (the exhaustive sweep
        // gives 8.13e-8), and the ends.
        let mut worst = 0.0f64;
        let last = (-87.0f32).to_bits();
        let mut bits = (-0.0f32).to_bits();
        while bits <= last {
            let x = f32::from_bits(bits);
            let want = (x as f64).exp();
            worst = worst.max((fast_exp(x) as f64 - want).abs() / want);
            bits += 97;
        }
        for x in [
            0.0f32,
            -0.0,
            -1e-30,
            -0.5,
            -1.0,
            -f32::EPSILON,
            -86.999,
            -87.0,
        ] {
            let want = (x as f64).exp();
            worst = worst.max((fast_exp(x) as f64 - want).abs() / want);
        }
        assert!(worst <= 8.2e-8, "{worst:e}");
        assert!(worst * 1.5 < Z_REL_ERR);
        assert_eq!(fast_exp(0.0), 1.0);
        for x in [-87.01f32, -100.0, -1e30, f32::NEG_INFINITY, f32::NAN] {
            assert_eq!(fast_exp(x), 0.0, "{x}");
        }
    }

    #[test]
    fn fast_normalizer_is_within_its_bound() {
        for (k, kind) in KINDS.iter().enumerate() {
            for n in [1, 1000, 151_936] {
                let l = make(kind, n, 70 + k as u64);
                let m = max_value(&l);
                if m == f32::NEG_INFINITY {
                    continue;
                }
                for t in [0.3f32, 1.0, 2.0] {
                    let inv_t = 1.0 / t;
                    let mx = m * inv_t;
                    let (blocks, count) = weight_blocks(&l, inv_t, mx, f32::NEG_INFINITY);
                    let z: f64 = blocks.iter().sum();
                    let exact = exact_normalizer(&l, inv_t, mx);
                    assert!(
                        (z - exact).abs() <= Z_REL_ERR * exact,
                        "{kind} {n} {t}: {z} {exact}"
                    );
                    let candidates = l.iter().filter(|&&x| x > f32::NEG_INFINITY).count();
                    assert_eq!(count, candidates);
                    assert_eq!(
                        weight_blocks_any(&l, inv_t, mx, f32::NEG_INFINITY),
                        (blocks, count)
                    );
                }
            }
        }
    }

    #[test]
    fn min_p_threshold_is_the_smallest_passing_value() {
        assert_eq!(min_p_threshold(0.0), f32::NEG_INFINITY);
        assert_eq!(min_p_threshold(f32::NAN), f32::NEG_INFINITY);
        for m in [1e-30f32, 1e-6, 0.01, 0.05, 0.1, 0.3, 0.5, 0.6, 0.99, 1.0] {
            let t = min_p_threshold(m);
            assert!((t as f64).exp() >= m as f64, "{m}: {t}");
            assert!((t.next_down() as f64).exp() < m as f64, "{m}: {t}");
            assert!((t - m.ln()).abs() < 1e-5, "{m}: {t}");
        }
    }

    #[test]
    fn degenerate_logits_do_not_panic() {
        let nan = f32::NAN;
        let inf = f32::INFINITY;
        let ninf = f32::NEG_INFINITY;
        let inputs: [Vec<f32>; 7] = [
            vec![],
            vec![ninf; 5],
            vec![nan; 5],
            vec![nan, ninf, nan],
            vec![1.0, inf, 2.0, inf],
            vec![1e38, -1e38, 0.0, 3e38],
            vec![f32::MAX, 1.0, f32::MIN],
        ];
        for l in &inputs {
            for t in [0.0, 1e-30, 1e-3, 1.0, 1e30] {
                for (top_k, top_p, min_p) in [
                    (0, 1.0, 0.0),
                    (0, 0.9, 0.0),
                    (0, 1.0, 0.1),
                    (2, 1.0, 0.0),
                    (0, 0.5, 0.5),
                ] {
                    let p = params(t, top_k, top_p, min_p, 1);
                    let mut s = Sampler::new(p.clone());
                    let tok = s.sample(&mut l.clone(), &[], &[]);
                    assert!(
                        l.is_empty() && tok == 0 || (tok as usize) < l.len(),
                        "{l:?} {p:?}"
                    );
                    assert!(!s.candidates(l).is_empty());
                }
            }
        }
        // Everything banned: the argmax of what is left, as before.
        let mut s = Sampler::new(params(1.0, 0, 1.0, 0.0, 1));
        assert_eq!(s.sample(&mut [1.0, 2.0, 3.0], &[], &[0, 1, 2]), 0);
    }

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
