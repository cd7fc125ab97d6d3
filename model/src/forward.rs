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
        for (l, lw) in self.weights.layers.iter().enumerate() {
            for i in 0..n {
                rms_norm(
                    &x[i * hidden..(i + 1) * hidden],
                    &lw.attn_norm,
                    spec.rms_norm_eps,
                    &mut h[i * hidden..(i + 1) * hidden],
                );
            }
            let mut caches: Vec<&mut KvCache> = batch.iter_mut().map(|s| &mut *s.cache).collect();
            let a = crate::attention::attention(self, l, pool, &h, &rows, &angles, &mut caches)?;
            for (xv, av) in x.iter_mut().zip(&a) {
                *xv += av;
            }
            for i in 0..n {
                rms_norm(
                    &x[i * hidden..(i + 1) * hidden],
                    &lw.ffn_norm,
                    spec.rms_norm_eps,
                    &mut h[i * hidden..(i + 1) * hidden],
                );
            }
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
            for (xv, fv) in x.iter_mut().zip(&f) {
                *xv += fv;
            }
        }
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
