//! The forward pass: a batch of sequences, each with its own KV cache and
//! some new tokens, through every layer at once.
//!
//! Rows of all sequences are stacked, so every projection and every routed
//! expert runs once per layer for the whole batch (continuous batching
//! shares expert reads); only attention looks at each sequence separately.

use std::path::Path;

use crate::config::{AttentionSpec, FfnKind, ModelSpec};
use crate::error::{ModelError, Result};
use crate::experts::ExpertSource;
use crate::kernels::{Pool, matmul};
use crate::kv::KvCache;
use crate::ops::rms_norm;
use crate::rope::{Angles, Rope, mla_softmax_scale_factor};
use crate::source::WeightSource;
use crate::weights::{DenseWeights, FfnWeights};

/// Which logits a sequence wants back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    None,
    /// Only after the last new token (generation).
    Last,
    /// After every new token (scoring).
    All,
}

/// One sequence's part of a batch.
pub struct SeqInput<'a> {
    pub cache: &'a mut KvCache,
    pub tokens: &'a [u32],
    pub logits: Logits,
}

/// Where one row of the stacked batch comes from.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RowInfo {
    pub seq: usize,
    pub pos: usize,
}

/// A model's spec and dense weights. Routed experts are supplied per call.
pub struct Model {
    pub spec: ModelSpec,
    pub weights: DenseWeights,
    pub(crate) rope: Rope,
    /// Softmax scale of MLA (YaRN-adjusted); GQA uses head_dim^-0.5.
    pub(crate) attn_scale: f32,
}

impl Model {
    pub fn new(spec: ModelSpec, weights: DenseWeights) -> Model {
        let (rope_dim, interleave) = match &spec.attention {
            AttentionSpec::Gqa { head_dim, .. } => (*head_dim, false),
            AttentionSpec::Mla {
                qk_rope_head_dim,
                rope_interleave,
                ..
            } => (*qk_rope_head_dim, *rope_interleave),
        };
        let rope = Rope::new(&spec.rope, rope_dim, interleave);
        let attn_scale = match &spec.attention {
            AttentionSpec::Mla {
                qk_nope_head_dim,
                qk_rope_head_dim,
                ..
            } => {
                (((qk_nope_head_dim + qk_rope_head_dim) as f64).powf(-0.5)
                    * mla_softmax_scale_factor(&spec.rope)) as f32
            }
            AttentionSpec::Gqa { head_dim, .. } => (*head_dim as f32).powf(-0.5),
        };
        Model {
            spec,
            weights,
            rope,
            attn_scale,
        }
    }

    /// Loads the spec and dense weights of the checkpoint directory or
    /// GGUF file at `path`.
    pub fn load(path: &Path) -> Result<(Model, WeightSource)> {
        crate::source::load_model(path)
    }

    /// Runs the new tokens of every sequence through the model, appending
    /// to their caches. Returns, per sequence, the logits asked for
    /// (`vocab` floats per row, rows in token order).
    pub fn forward(
        &self,
        pool: &Pool,
        experts: &dyn ExpertSource,
        batch: &mut [SeqInput<'_>],
    ) -> Result<Vec<Vec<f32>>> {
        // The MoE layers put off releasing their last experts
        // (`pool::defer_drop`): none stays leased past the pass.
        let _released = crate::kernels::pool::DeferredScope;
        let spec = &self.spec;
        let hidden = spec.hidden_size;
        let mut rows = Vec::new();
        for (s, seq) in batch.iter().enumerate() {
            seq.cache.check_room(seq.tokens.len())?;
            seq.cache.check_host()?;
            for (i, &t) in seq.tokens.iter().enumerate() {
                if t as usize >= spec.vocab_size {
                    return Err(ModelError::TokenOutOfRange {
                        id: t,
                        vocab: spec.vocab_size,
                    });
                }
                rows.push(RowInfo {
                    seq: s,
                    pos: seq.cache.len() + i,
                });
            }
        }
        let n = rows.len();
        let mut out: Vec<Vec<f32>> = vec![Vec::new(); batch.len()];
        if n == 0 {
            return Ok(out);
        }

        let mut x = vec![0.0f32; n * hidden];
        let mut r = 0;
        for seq in batch.iter() {
            for &t in seq.tokens {
                self.weights
                    .embed
                    .row_to_f32(t as usize, &mut x[r * hidden..(r + 1) * hidden]);
                r += 1;
            }
        }

        // Every layer rotates a row by the same angles.
        let angles: Vec<Angles> = rows.iter().map(|r| self.rope.angles(r.pos)).collect();
        let mut h = vec![0.0f32; n * hidden];
        let eps = spec.rms_norm_eps;
        // The previous layer's FFN output, added to `x` with this layer's
        // first norm.
        let mut pending: Option<Vec<f32>> = None;
        for (l, lw) in self.weights.layers.iter().enumerate() {
            let norm = Some((&lw.attn_norm[..], &mut h[..]));
            add_norm_rows(pool, hidden, &mut x, pending.as_deref(), norm, eps);
            let mut caches: Vec<&mut KvCache> = batch.iter_mut().map(|s| &mut *s.cache).collect();
            let a = crate::attention::attention(self, l, pool, &h, &rows, &angles, &mut caches)?;
            let norm = Some((&lw.ffn_norm[..], &mut h[..]));
            add_norm_rows(pool, hidden, &mut x, Some(&a), norm, eps);
            let f = match (&spec.layers[l].ffn, &lw.ffn) {
                (FfnKind::Dense { .. }, FfnWeights::Dense(w)) => {
                    crate::moe::mlp_rows(pool, w, &h, n)
                }
                (FfnKind::Moe, FfnWeights::Moe(w)) => {
                    let moe = spec
                        .moe
                        .as_ref()
                        .ok_or_else(|| ModelError::Invalid("MoE layer without MoE spec".into()))?;
                    crate::moe::moe_rows(pool, l, moe, w, experts, &h, n)?.0
                }
                _ => {
                    return Err(ModelError::Invalid(format!(
                        "layer {l}: weights do not match the spec"
                    )));
                }
            };
            pending = Some(f);
        }
        add_norm_rows(pool, hidden, &mut x, pending.as_deref(), None, eps);
        for seq in batch.iter_mut() {
            seq.cache.advance(seq.tokens.len());
        }

        // Final norm and logits for the rows that want them.
        let mut want = Vec::new();
        let mut r = 0;
        for (s, seq) in batch.iter().enumerate() {
            let len = seq.tokens.len();
            match seq.logits {
                Logits::None => {}
                Logits::Last => want.push((s, r + len - 1)),
                Logits::All => want.extend((r..r + len).map(|i| (s, i))),
            }
            r += len;
        }
        if want.is_empty() {
            return Ok(out);
        }
        let m = want.len();
        let mut hn = vec![0.0f32; m * hidden];
        for (j, &(_, i)) in want.iter().enumerate() {
            rms_norm(
                &x[i * hidden..(i + 1) * hidden],
                &self.weights.norm,
                spec.rms_norm_eps,
                &mut hn[j * hidden..(j + 1) * hidden],
            );
        }
        let vocab = spec.vocab_size;
        let mut logits = vec![0.0f32; m * vocab];
        matmul(pool, &self.weights.lm_head, &hn, m, &mut logits);
        for (j, &(s, _)) in want.iter().enumerate() {
            out[s].extend_from_slice(&logits[j * vocab..(j + 1) * vocab]);
        }
        Ok(out)
    }
}

/// `x += delta` (when given), then (`norm`: weights and output) each row
/// of `x` normalized into the output: a batch's rows split over the pool,
/// where a prompt's residual adds and norms ran on the calling thread
/// while the others waited (12% of a 512-token prefill's time, with the
/// MoE combine). Each row gets the bits it gets alone.
pub(crate) fn add_norm_rows(
    pool: &Pool,
    hidden: usize,
    x: &mut [f32],
    delta: Option<&[f32]>,
    norm: Option<(&[f32], &mut [f32])>,
    eps: f32,
) {
    let n = x.len() / hidden;
    if let Some(d) = delta {
        assert_eq!(d.len(), x.len(), "a delta per element");
    }
    let (w, out) = match norm {
        Some((w, out)) => {
            assert_eq!(out.len(), x.len(), "a norm output per element");
            (w, Some(out))
        }
        None => (&[][..], None),
    };
    let row = |i: usize, x: &mut [f32], out: Option<&mut [f32]>| {
        if let Some(d) = delta {
            for (xv, dv) in x.iter_mut().zip(&d[i * hidden..(i + 1) * hidden]) {
                *xv += dv;
            }
        }
        if let Some(out) = out {
            rms_norm(x, w, eps, out);
        }
    };
    let outs: Vec<Option<&mut [f32]>> = match out {
        Some(o) => o.chunks_exact_mut(hidden).map(Some).collect(),
        None => (0..n).map(|_| None).collect(),
    };
    let mut rows: Vec<(&mut [f32], Option<&mut [f32]>)> =
        x.chunks_exact_mut(hidden).zip(outs).collect();
    if n < 2 * pool.threads() {
        for (i, (x, out)) in rows.iter_mut().enumerate() {
            row(i, x, out.as_deref_mut());
        }
        return;
    }
    let per = n.div_ceil(4 * pool.threads());
    pool.for_each_chunk_mut(&mut rows, per, |c, rs| {
        for (j, (x, out)) in rs.iter_mut().enumerate() {
            row(c * per + j, x, out.as_deref_mut());
        }
    });
}

#[cfg(test)]
mod norm_tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The pool's rows get the serial residual add and norm, bit for bit,
    /// for batches below and above the split and any thread count; with no
    /// norm, only the add.
    #[test]
    fn split_adds_and_norms_give_the_serial_bits() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(17);
        let hidden = 160;
        let w: Vec<f32> = (0..hidden).map(|_| rng.random_range(0.5f32..1.5)).collect();
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for n in [1, 2, 5, 13, 40] {
            let x: Vec<f32> = (0..n * hidden)
                .map(|_| rng.random_range(-3.0f32..3.0))
                .collect();
            let d: Vec<f32> = (0..n * hidden)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect();
            let sum: Vec<f32> = x.iter().zip(&d).map(|(a, b)| a + b).collect();
            let mut want = vec![0.0f32; n * hidden];
            for (s, o) in sum.chunks_exact(hidden).zip(want.chunks_exact_mut(hidden)) {
                rms_norm(s, &w, 1e-6, o);
            }
            for threads in [1, 2, 3] {
                let pool = Pool::new(threads).unwrap();
                let (mut x1, mut h) = (x.clone(), vec![f32::NAN; n * hidden]);
                add_norm_rows(&pool, hidden, &mut x1, Some(&d), Some((&w, &mut h)), 1e-6);
                assert_eq!(bits(&x1), bits(&sum), "{n} rows, {threads} threads");
                assert_eq!(bits(&h), bits(&want), "{n} rows, {threads} threads");
                let mut x2 = x.clone();
                add_norm_rows(&pool, hidden, &mut x2, Some(&d), None, 1e-6);
                assert_eq!(bits(&x2), bits(&sum));
                let mut h2 = vec![f32::NAN; n * hidden];
                add_norm_rows(&pool, hidden, &mut x2, None, Some((&w, &mut h2)), 1e-6);
                assert_eq!(bits(&x2), bits(&sum), "no delta: x unchanged");
                assert_eq!(bits(&h2), bits(&want));
            }
        }
    }
}
