//! The dense weights of a GGUF model, with llama.cpp's conversions undone
//! so the engine computes exactly what transformers computes:
//!
//! - `llama` (Mixtral): `convert_hf_to_gguf.py` permutes the rows of
//!   `q_proj`/`k_proj` (and their biases) within each head from the
//!   halves layout HF's RoPE uses to the adjacent-pairs layout llama.cpp's
//!   RoPE uses (`reshape(n_head, 2, hd/2, …).swapaxes(1, 2)`). Rows are
//!   stored (and quantized) independently, so moving them back is a byte
//!   copy: exact for every format.
//! - `deepseek2`: the converter no longer writes `kv_b_proj`; it writes
//!   `attn_k_b` (per head, the k rows *transposed*: `[n_head, kv_lora,
//!   nope]`) and `attn_v_b` (`[n_head, v_head, kv_lora]`). `kv_b_proj` is
//!   rebuilt from them: 16/32-bit elements are moved as they are; block
//!   formats are widened to f32 (exact values; the block kernels equal the
//!   f32 kernel on dequantized rows, so nothing changes numerically).
//!   Files from before the split carry `attn_kv_b` and load directly.
//!
//! Everything else runs as stored.

use super::GgufFile;
use crate::config::{AttentionSpec, Family, FfnKind, ModelSpec, QkNorm, RouterKind};
use crate::error::{ModelError, Result};
use crate::format::WeightFormat;
use crate::tensor::{Bytes, QMatrix};
use crate::weights::{
    AttnWeights, DenseWeights, FfnWeights, GlobalWeights, GqaWeights, LayerWeights, Linear,
    MlaQuery, MlaWeights, MlpWeights, MoeWeights,
};

/// The permutation llama.cpp applied: stored row `h·hd + 2i + a` holds HF
/// row `h·hd + a·hd/2 + i`. Returns, for each HF row, its stored row.
fn llama_rope_rows(n_head: usize, head_dim: usize) -> Vec<usize> {
    let half = head_dim / 2;
    let mut src = vec![0; n_head * head_dim];
    for h in 0..n_head {
        for a in 0..2 {
            for i in 0..half {
                src[h * head_dim + a * half + i] = h * head_dim + 2 * i + a;
            }
        }
    }
    src
}

/// `m` with its rows reordered: row `r` of the result is row `src[r]`.
fn reorder_rows(name: &str, m: &QMatrix, src: &[usize]) -> Result<QMatrix> {
    let rb = m.format.row_bytes(m.cols)?;
    let data = m.data().as_slice();
    let mut out = Vec::with_capacity(data.len());
    for &s in src {
        out.extend_from_slice(&data[s * rb..(s + 1) * rb]);
    }
    QMatrix::new(name, m.rows, m.cols, m.format, Bytes::from_vec(out), None)
}

struct Loader<'a> {
    file: &'a GgufFile,
    hidden: usize,
}

impl Loader<'_> {
    fn linear(&self, name: &str, rows: usize, cols: usize, bias: bool) -> Result<Linear> {
        Ok(Linear {
            w: self.file.matrix(&format!("{name}.weight"), rows, cols)?,
            bias: if bias {
                Some(self.file.vector_f32(&format!("{name}.bias"), rows)?)
            } else {
                None
            },
        })
    }

    fn opt_bias(&self, name: &str, rows: usize) -> Result<Option<Vec<f32>>> {
        let b = format!("{name}.bias");
        if self.file.contains(&b) {
            Ok(Some(self.file.vector_f32(&b, rows)?))
        } else {
            Ok(None)
        }
    }

    fn mlp(&self, p: &str, suffix: &str, inter: usize) -> Result<MlpWeights> {
        let h = self.hidden;
        Ok(MlpWeights {
            gate: self
                .file
                .matrix(&format!("{p}ffn_gate{suffix}.weight"), inter, h)?,
            up: self
                .file
                .matrix(&format!("{p}ffn_up{suffix}.weight"), inter, h)?,
            down: self
                .file
                .matrix(&format!("{p}ffn_down{suffix}.weight"), h, inter)?,
        })
    }

    /// `kv_b_proj` (`heads·(nope + v) × kv_lora`), stored whole or split.
    fn kv_b(&self, p: &str, heads: usize, nope: usize, v: usize, r: usize) -> Result<QMatrix> {
        let f = self.file;
        let whole = format!("{p}attn_kv_b.weight");
        if f.contains(&whole) {
            return f.matrix(&whole, heads * (nope + v), r);
        }
        let kb_name = format!("{p}attn_k_b.weight");
        let vb_name = format!("{p}attn_v_b.weight");
        let kb = f.matrix_ne(&kb_name, &[nope as u64, r as u64, heads as u64])?;
        let vb = f.matrix_ne(&vb_name, &[r as u64, v as u64, heads as u64])?;
        let rows = heads * (nope + v);
        // 16/32-bit elements move as they are (no rounding); block formats
        // cannot be transposed blockwise and become their exact f32 values.
        let format = match (kb.format, vb.format) {
            (a, b) if a == b && matches!(a, WeightFormat::F16 | WeightFormat::Bf16) => a,
            _ => WeightFormat::F32,
        };
        let esize = format.row_bytes(1)?;
        let elements = |m: &QMatrix| -> Vec<u8> {
            if m.format == format {
                m.data().as_slice().to_vec()
            } else {
                m.to_f32().iter().flat_map(|x| x.to_le_bytes()).collect()
            }
        };
        let (kbe, vbe) = (elements(&kb), elements(&vb));
        let mut out = Vec::with_capacity(rows * r * esize);
        for h in 0..heads {
            // k part: kv_b[h·(nope+v) + j][c] = k_b[h][c][j].
            for j in 0..nope {
                for c in 0..r {
                    let at = ((h * r + c) * nope + j) * esize;
                    out.extend_from_slice(&kbe[at..at + esize]);
                }
            }
            // v part: kv_b[h·(nope+v) + nope + j][c] = v_b[h][j][c].
            let at = h * v * r * esize;
            out.extend_from_slice(&vbe[at..at + v * r * esize]);
        }
        QMatrix::new(
            &format!("{p}attn_kv_b (rebuilt)"),
            rows,
            r,
            format,
            Bytes::from_vec(out),
            None,
        )
    }
}

/// Loads the dense weights of `spec` from `file`.
pub fn dense_weights(spec: &ModelSpec, file: &GgufFile) -> Result<DenseWeights> {
    let g = global_weights(spec, file)?;
    let layers = (0..spec.num_layers())
        .map(|i| layer_weights(spec, file, i))
        .collect::<Result<Vec<_>>>()?;
    Ok(g.with_layers(layers))
}

/// The embedding, final norm and output head.
pub fn global_weights(spec: &ModelSpec, file: &GgufFile) -> Result<GlobalWeights> {
    let h = spec.hidden_size;
    let embed = file.matrix("token_embd.weight", spec.vocab_size, h)?;
    let lm_head = if file.contains("output.weight") {
        file.matrix("output.weight", spec.vocab_size, h)?
    } else {
        embed.clone()
    };
    Ok(GlobalWeights {
        embed,
        norm: file.vector_f32("output_norm.weight", h)?,
        lm_head,
    })
}

/// The dense weights of layer `i`.
pub fn layer_weights(spec: &ModelSpec, file: &GgufFile, i: usize) -> Result<LayerWeights> {
    let h = spec.hidden_size;
    let ld = Loader { file, hidden: h };
    let ls = spec
        .layers
        .get(i)
        .ok_or_else(|| ModelError::Invalid(format!("layer {i} is not in the model")))?;
    let p = format!("blk.{i}.");
    let attn = match &spec.attention {
        AttentionSpec::Gqa {
            num_heads,
            num_kv_heads,
            head_dim,
            qkv_bias,
            o_bias,
            qk_norm,
            ..
        } => {
            let (q_out, kv_out) = (num_heads * head_dim, num_kv_heads * head_dim);
            let mut q = ld.linear(&format!("{p}attn_q"), q_out, h, *qkv_bias)?;
            let mut k = ld.linear(&format!("{p}attn_k"), kv_out, h, *qkv_bias)?;
            if spec.family == Family::Mixtral {
                let qs = llama_rope_rows(*num_heads, *head_dim);
                let ks = llama_rope_rows(*num_kv_heads, *head_dim);
                q.w = reorder_rows(&format!("{p}attn_q.weight"), &q.w, &qs)?;
                k.w = reorder_rows(&format!("{p}attn_k.weight"), &k.w, &ks)?;
                if let Some(b) = &mut q.bias {
                    *b = qs.iter().map(|&s| b[s]).collect();
                }
                if let Some(b) = &mut k.bias {
                    *b = ks.iter().map(|&s| b[s]).collect();
                }
            }
            let (qn, kn) = match qk_norm {
                QkNorm::None => (None, None),
                QkNorm::PerHead => (Some(*head_dim), Some(*head_dim)),
                QkNorm::Full => (Some(q_out), Some(kv_out)),
            };
            AttnWeights::Gqa(GqaWeights {
                q,
                k,
                v: ld.linear(&format!("{p}attn_v"), kv_out, h, *qkv_bias)?,
                o: ld.linear(&format!("{p}attn_output"), h, q_out, *o_bias)?,
                q_norm: qn
                    .map(|n| file.vector_f32(&format!("{p}attn_q_norm.weight"), n))
                    .transpose()?,
                k_norm: kn
                    .map(|n| file.vector_f32(&format!("{p}attn_k_norm.weight"), n))
                    .transpose()?,
            })
        }
        AttentionSpec::Mla {
            num_heads,
            q_lora_rank,
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
            bias,
            ..
        } => {
            let qk = qk_nope_head_dim + qk_rope_head_dim;
            let q = match q_lora_rank {
                None => {
                    MlaQuery::Direct(ld.linear(&format!("{p}attn_q"), num_heads * qk, h, false)?)
                }
                Some(r) => MlaQuery::LowRank {
                    a: ld.linear(&format!("{p}attn_q_a"), *r, h, *bias)?,
                    norm: file.vector_f32(&format!("{p}attn_q_a_norm.weight"), *r)?,
                    b: ld.linear(&format!("{p}attn_q_b"), num_heads * qk, *r, false)?,
                },
            };
            AttnWeights::Mla(MlaWeights {
                q,
                kv_a: ld.linear(
                    &format!("{p}attn_kv_a_mqa"),
                    kv_lora_rank + qk_rope_head_dim,
                    h,
                    *bias,
                )?,
                kv_a_norm: file.vector_f32(&format!("{p}attn_kv_a_norm.weight"), *kv_lora_rank)?,
                kv_b: ld.kv_b(
                    &p,
                    *num_heads,
                    *qk_nope_head_dim,
                    *v_head_dim,
                    *kv_lora_rank,
                )?,
                o: ld.linear(&format!("{p}attn_output"), h, num_heads * v_head_dim, *bias)?,
            })
        }
    };
    let ffn = match &ls.ffn {
        FfnKind::Dense { intermediate_size } => {
            FfnWeights::Dense(ld.mlp(&p, "", *intermediate_size)?)
        }
        FfnKind::Moe => {
            let moe = spec
                .moe
                .as_ref()
                .ok_or_else(|| ModelError::Invalid("MoE layer without MoE spec".into()))?;
            let router = file.matrix(&format!("{p}ffn_gate_inp.weight"), moe.num_experts, h)?;
            let selection_bias = match moe.router {
                RouterKind::SigmoidGrouped { .. } => {
                    ld.opt_bias(&format!("{p}exp_probs_b"), moe.num_experts)?
                }
                RouterKind::Softmax { .. } => None,
            };
            let (shared, shared_gate) = match &moe.shared {
                None => (None, None),
                Some(s) => (
                    Some(ld.mlp(&p, "_shexp", s.intermediate_size)?),
                    if s.gated {
                        let name = format!("{p}ffn_gate_inp_shexp.weight");
                        // Stored as [hidden] or [hidden, 1]: one row either way.
                        Some(file.matrix_ne(&name, &[h as u64])?)
                    } else {
                        None
                    },
                ),
            };
            FfnWeights::Moe(MoeWeights {
                router,
                selection_bias,
                shared,
                shared_gate,
            })
        }
    };
    Ok(LayerWeights {
        attn_norm: file.vector_f32(&format!("{p}attn_norm.weight"), h)?,
        attn,
        ffn_norm: file.vector_f32(&format!("{p}ffn_norm.weight"), h)?,
        ffn,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The inverse of the converter's `reshape(n_head, 2, hd/2).swapaxes(1, 2)`.
    #[test]
    fn llama_permutation_round_trips() {
        let (heads, hd) = (3, 8);
        let hf: Vec<usize> = (0..heads * hd).collect();
        // What the converter writes: for stored row h·hd + 2i + a, HF row h·hd + a·hd/2 + i.
        let mut stored = vec![0; heads * hd];
        for h in 0..heads {
            for i in 0..hd / 2 {
                for a in 0..2 {
                    stored[h * hd + 2 * i + a] = hf[h * hd + a * hd / 2 + i];
                }
            }
        }
        let src = llama_rope_rows(heads, hd);
        let back: Vec<usize> = src.iter().map(|&s| stored[s]).collect();
        assert_eq!(back, hf);
    }
}
