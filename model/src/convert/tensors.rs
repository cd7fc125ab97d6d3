//! The dense tensors of a model, by their Hugging Face names (the names
//! [`crate::weights`] loads and a packed store keeps), with the role that
//! decides how `--quant` treats each.
//!
//! One walk over the spec gives names, roles and shapes; given loaded
//! weights it also hands out their data. Convert walks loaded weights, synth
//! walks the spec alone and generates the data, and both name every tensor
//! exactly as [`crate::weights::DenseWeights::load`] reads it.

use crate::config::{AttentionSpec, Family, FfnKind, ModelSpec, QkNorm, RouterKind};
use crate::error::{ModelError, Result};
use crate::tensor::QMatrix;
use crate::weights::{
    AttnWeights, FfnWeights, GlobalWeights, LayerWeights, Linear, MlaQuery, MlpWeights, TensorNames,
};

/// What a tensor is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Embedding,
    OutputHead,
    Norm,
    Bias,
    Router,
    /// Qwen2-MoE's shared expert gate (a 1-row router).
    SharedGate,
    Attention,
    DenseMlp,
    SharedExpert,
    RoutedExpert,
}

impl Role {
    /// Whether q8_0/q4_0 quantize it: projections and experts, never
    /// embeddings, norms or routers (what decides routing stays exact).
    pub fn quantizable(self) -> bool {
        matches!(
            self,
            Role::Attention | Role::DenseMlp | Role::SharedExpert | Role::RoutedExpert
        )
    }

    pub fn name(self) -> &'static str {
        match self {
            Role::Embedding => "embedding",
            Role::OutputHead => "output head",
            Role::Norm => "norm",
            Role::Bias => "bias",
            Role::Router => "router",
            Role::SharedGate => "shared expert gate",
            Role::Attention => "attention projection",
            Role::DenseMlp => "dense MLP",
            Role::SharedExpert => "shared expert",
            Role::RoutedExpert => "routed expert",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    Matrix { rows: usize, cols: usize },
    Vector(usize),
}

impl Shape {
    pub fn dims(self) -> Vec<usize> {
        match self {
            Shape::Matrix { rows, cols } => vec![rows, cols],
            Shape::Vector(n) => vec![n],
        }
    }
}

/// A tensor's loaded data.
#[derive(Clone, Copy, Debug)]
pub enum TensorRef<'a> {
    Matrix(&'a QMatrix),
    Vector(&'a [f32]),
}

/// One dense tensor.
#[derive(Clone, Debug)]
pub struct DenseTensor<'a> {
    pub name: String,
    pub role: Role,
    pub shape: Shape,
    /// `None` when walking the spec alone.
    pub data: Option<TensorRef<'a>>,
}

struct Walk<'a> {
    out: Vec<DenseTensor<'a>>,
    with_data: bool,
}

impl<'a> Walk<'a> {
    fn push(
        &mut self,
        name: String,
        role: Role,
        shape: Shape,
        data: Option<TensorRef<'a>>,
    ) -> Result<()> {
        if self.with_data && data.is_none() {
            return Err(ModelError::Invalid(format!(
                "tensor `{name}`: the spec has it, the loaded weights do not"
            )));
        }
        if let (Some(TensorRef::Matrix(m)), Shape::Matrix { rows, cols }) = (&data, shape)
            && (m.rows, m.cols) != (rows, cols)
        {
            return Err(ModelError::Shape {
                name,
                got: vec![m.rows, m.cols],
                expected: vec![rows, cols],
            });
        }
        self.out.push(DenseTensor {
            name,
            role,
            shape,
            data,
        });
        Ok(())
    }

    fn matrix(
        &mut self,
        name: String,
        role: Role,
        rows: usize,
        cols: usize,
        m: Option<&'a QMatrix>,
    ) -> Result<()> {
        self.push(
            name,
            role,
            Shape::Matrix { rows, cols },
            m.map(TensorRef::Matrix),
        )
    }

    fn vector(&mut self, name: String, role: Role, n: usize, v: Option<&'a [f32]>) -> Result<()> {
        self.push(name, role, Shape::Vector(n), v.map(TensorRef::Vector))
    }

    /// `{name}.weight` and, when `bias`, `{name}.bias`.
    fn linear(
        &mut self,
        name: &str,
        role: Role,
        rows: usize,
        cols: usize,
        bias: bool,
        l: Option<&'a Linear>,
    ) -> Result<()> {
        self.matrix(format!("{name}.weight"), role, rows, cols, l.map(|l| &l.w))?;
        if bias {
            let b = match l {
                Some(l) => Some(l.bias.as_deref().ok_or_else(|| {
                    ModelError::Invalid(format!(
                        "`{name}`: the spec has a bias, the weights do not"
                    ))
                })?),
                None => None,
            };
            self.vector(format!("{name}.bias"), Role::Bias, rows, b)?;
        }
        Ok(())
    }

    fn mlp(
        &mut self,
        prefix: &str,
        role: Role,
        h: usize,
        i: usize,
        w: Option<&'a MlpWeights>,
    ) -> Result<()> {
        self.matrix(
            format!("{prefix}gate_proj.weight"),
            role,
            i,
            h,
            w.map(|w| &w.gate),
        )?;
        self.matrix(
            format!("{prefix}up_proj.weight"),
            role,
            i,
            h,
            w.map(|w| &w.up),
        )?;
        self.matrix(
            format!("{prefix}down_proj.weight"),
            role,
            h,
            i,
            w.map(|w| &w.down),
        )
    }
}

fn mismatch(i: usize) -> ModelError {
    ModelError::Invalid(format!("layer {i}: loaded weights do not match the spec"))
}

/// Embedding, final norm and, unless tied, the output head.
pub fn global_tensors<'a>(
    spec: &ModelSpec,
    g: Option<&'a GlobalWeights>,
) -> Result<Vec<DenseTensor<'a>>> {
    let h = spec.hidden_size;
    let mut w = Walk {
        out: Vec::new(),
        with_data: g.is_some(),
    };
    w.matrix(
        "model.embed_tokens.weight".into(),
        Role::Embedding,
        spec.vocab_size,
        h,
        g.map(|g| &g.embed),
    )?;
    w.vector(
        "model.norm.weight".into(),
        Role::Norm,
        h,
        g.map(|g| g.norm.as_slice()),
    )?;
    let tied = match g {
        Some(g) => g.lm_head_is_embed(),
        None => spec.tie_word_embeddings,
    };
    if !tied {
        w.matrix(
            "lm_head.weight".into(),
            Role::OutputHead,
            spec.vocab_size,
            h,
            g.map(|g| &g.lm_head),
        )?;
    }
    Ok(w.out)
}

/// The dense tensors of layer `i`, in a fixed order.
pub fn layer_tensors<'a>(
    spec: &ModelSpec,
    i: usize,
    lw: Option<&'a LayerWeights>,
) -> Result<Vec<DenseTensor<'a>>> {
    let h = spec.hidden_size;
    let names = TensorNames::new(spec.family);
    let p = names.layer(i);
    let ls = spec
        .layers
        .get(i)
        .ok_or_else(|| ModelError::Invalid(format!("layer {i} is not in the model")))?;
    let mut w = Walk {
        out: Vec::new(),
        with_data: lw.is_some(),
    };
    w.vector(
        format!("{p}input_layernorm.weight"),
        Role::Norm,
        h,
        lw.map(|l| l.attn_norm.as_slice()),
    )?;
    let a = format!("{p}self_attn.");
    match &spec.attention {
        AttentionSpec::Gqa {
            num_heads,
            num_kv_heads,
            head_dim,
            qkv_bias,
            o_bias,
            qk_norm,
            ..
        } => {
            let g = match lw.map(|l| &l.attn) {
                None => None,
                Some(AttnWeights::Gqa(g)) => Some(g),
                Some(_) => return Err(mismatch(i)),
            };
            let (q_out, kv_out) = (num_heads * head_dim, num_kv_heads * head_dim);
            let r = Role::Attention;
            w.linear(
                &format!("{a}q_proj"),
                r,
                q_out,
                h,
                *qkv_bias,
                g.map(|g| &g.q),
            )?;
            w.linear(
                &format!("{a}k_proj"),
                r,
                kv_out,
                h,
                *qkv_bias,
                g.map(|g| &g.k),
            )?;
            w.linear(
                &format!("{a}v_proj"),
                r,
                kv_out,
                h,
                *qkv_bias,
                g.map(|g| &g.v),
            )?;
            w.linear(&format!("{a}o_proj"), r, h, q_out, *o_bias, g.map(|g| &g.o))?;
            let (qn, kn) = match qk_norm {
                QkNorm::None => (None, None),
                QkNorm::PerHead => (Some(*head_dim), Some(*head_dim)),
                QkNorm::Full => (Some(q_out), Some(kv_out)),
            };
            let norm = |v: Option<&'a Vec<f32>>| -> Result<Option<&'a [f32]>> {
                match (g, v) {
                    (None, _) => Ok(None),
                    (Some(_), Some(v)) => Ok(Some(v.as_slice())),
                    (Some(_), None) => Err(mismatch(i)),
                }
            };
            if let Some(n) = qn {
                let v = norm(g.and_then(|g| g.q_norm.as_ref()))?;
                w.vector(format!("{a}q_norm.weight"), Role::Norm, n, v)?;
            }
            if let Some(n) = kn {
                let v = norm(g.and_then(|g| g.k_norm.as_ref()))?;
                w.vector(format!("{a}k_norm.weight"), Role::Norm, n, v)?;
            }
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
            let m = match lw.map(|l| &l.attn) {
                None => None,
                Some(AttnWeights::Mla(m)) => Some(m),
                Some(_) => return Err(mismatch(i)),
            };
            let r = Role::Attention;
            let qk = qk_nope_head_dim + qk_rope_head_dim;
            match q_lora_rank {
                None => {
                    let q = match m.map(|m| &m.q) {
                        None => None,
                        Some(MlaQuery::Direct(l)) => Some(l),
                        Some(_) => return Err(mismatch(i)),
                    };
                    w.linear(&format!("{a}q_proj"), r, num_heads * qk, h, false, q)?;
                }
                Some(rank) => {
                    let q = match m.map(|m| &m.q) {
                        None => None,
                        Some(MlaQuery::LowRank { a, norm, b }) => Some((a, norm, b)),
                        Some(_) => return Err(mismatch(i)),
                    };
                    w.linear(&format!("{a}q_a_proj"), r, *rank, h, *bias, q.map(|q| q.0))?;
                    w.vector(
                        format!("{a}q_a_layernorm.weight"),
                        Role::Norm,
                        *rank,
                        q.map(|q| q.1.as_slice()),
                    )?;
                    w.linear(
                        &format!("{a}q_b_proj"),
                        r,
                        num_heads * qk,
                        *rank,
                        false,
                        q.map(|q| q.2),
                    )?;
                }
            }
            w.linear(
                &format!("{a}kv_a_proj_with_mqa"),
                r,
                kv_lora_rank + qk_rope_head_dim,
                h,
                *bias,
                m.map(|m| &m.kv_a),
            )?;
            w.vector(
                format!("{a}kv_a_layernorm.weight"),
                Role::Norm,
                *kv_lora_rank,
                m.map(|m| m.kv_a_norm.as_slice()),
            )?;
            w.matrix(
                format!("{a}kv_b_proj.weight"),
                r,
                num_heads * (qk_nope_head_dim + v_head_dim),
                *kv_lora_rank,
                m.map(|m| &m.kv_b),
            )?;
            w.linear(
                &format!("{a}o_proj"),
                r,
                h,
                num_heads * v_head_dim,
                *bias,
                m.map(|m| &m.o),
            )?;
        }
    }
    w.vector(
        format!("{p}post_attention_layernorm.weight"),
        Role::Norm,
        h,
        lw.map(|l| l.ffn_norm.as_slice()),
    )?;
    match &ls.ffn {
        FfnKind::Dense { intermediate_size } => {
            let d = match lw.map(|l| &l.ffn) {
                None => None,
                Some(FfnWeights::Dense(d)) => Some(d),
                Some(_) => return Err(mismatch(i)),
            };
            w.mlp(
                &format!("{p}mlp."),
                Role::DenseMlp,
                h,
                *intermediate_size,
                d,
            )?;
        }
        FfnKind::Moe => {
            let moe = spec
                .moe
                .as_ref()
                .ok_or_else(|| ModelError::Invalid("MoE layer without MoE spec".into()))?;
            let mw = match lw.map(|l| &l.ffn) {
                None => None,
                Some(FfnWeights::Moe(m)) => Some(m),
                Some(_) => return Err(mismatch(i)),
            };
            let blk = names.moe_block(i);
            w.matrix(
                names.router(i),
                Role::Router,
                moe.num_experts,
                h,
                mw.map(|m| &m.router),
            )?;
            if let RouterKind::SigmoidGrouped { .. } = moe.router {
                let b = match mw {
                    None => None,
                    Some(m) => Some(m.selection_bias.as_deref().ok_or_else(|| mismatch(i))?),
                };
                w.vector(
                    format!("{blk}gate.e_score_correction_bias"),
                    Role::Bias,
                    moe.num_experts,
                    b,
                )?;
            }
            if let Some(s) = &moe.shared {
                let sw = match mw {
                    None => None,
                    Some(m) => Some(m.shared.as_ref().ok_or_else(|| mismatch(i))?),
                };
                let prefix = if spec.family == Family::Qwen2Moe {
                    format!("{blk}shared_expert.")
                } else {
                    format!("{blk}shared_experts.")
                };
                w.mlp(&prefix, Role::SharedExpert, h, s.intermediate_size, sw)?;
                if spec.family == Family::Qwen2Moe && s.gated {
                    let g = match mw {
                        None => None,
                        Some(m) => Some(m.shared_gate.as_ref().ok_or_else(|| mismatch(i))?),
                    };
                    w.matrix(
                        format!("{blk}shared_expert_gate.weight"),
                        Role::SharedGate,
                        1,
                        h,
                        g,
                    )?;
                }
            }
        }
    }
    Ok(w.out)
}
