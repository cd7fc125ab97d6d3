//! The dense (always resident) weights of a model and the tensor names each
//! family uses on the Hub. Routed experts are not here: they come through an
//! [`crate::experts::ExpertSource`], which decides where they live.
//!
//! Loading reads tensors by their Hub names through a [`TensorReader`]
//! (a safetensors [`Checkpoint`] or a packed store, which keeps the Hub
//! names), one layer at a time so that `colibri convert` can stream.

use crate::config::{AttentionSpec, Family, FfnKind, ModelSpec, QkNorm, RouterKind};
use crate::error::{ModelError, Result};
use crate::format::WeightFormat;
use crate::quant::QK;
use crate::source::Checkpoint;
use crate::tensor::{Layout, QMatrix};

/// A linear layer `y = W x (+ b)`.
#[derive(Clone, Debug)]
pub struct Linear {
    pub w: QMatrix,
    pub bias: Option<Vec<f32>>,
}

#[derive(Clone, Debug)]
pub struct GqaWeights {
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
}

#[derive(Clone, Debug)]
pub enum MlaQuery {
    Direct(Linear),
    LowRank {
        a: Linear,
        norm: Vec<f32>,
        b: Linear,
    },
}

#[derive(Clone, Debug)]
pub struct MlaWeights {
    pub q: MlaQuery,
    /// hidden → kv_lora_rank + rope dim.
    pub kv_a: Linear,
    pub kv_a_norm: Vec<f32>,
    /// kv_lora_rank → heads × (nope + v); used in absorbed form.
    pub kv_b: QMatrix,
    pub o: Linear,
}

#[derive(Clone, Debug)]
pub enum AttnWeights {
    Gqa(GqaWeights),
    Mla(MlaWeights),
}

/// A SwiGLU MLP: `down(silu(gate x) * up x)`. Routed experts, shared
/// experts and dense layers all have this shape.
#[derive(Clone, Debug)]
pub struct MlpWeights {
    pub gate: QMatrix,
    pub up: QMatrix,
    pub down: QMatrix,
}

impl MlpWeights {
    pub fn stored_bytes(&self) -> usize {
        self.gate.stored_bytes() + self.up.stored_bytes() + self.down.stored_bytes()
    }
}

#[derive(Clone, Debug)]
pub struct MoeWeights {
    pub router: QMatrix,
    /// DeepSeek's `e_score_correction_bias` (selection only).
    pub selection_bias: Option<Vec<f32>>,
    pub shared: Option<MlpWeights>,
    /// Qwen2-MoE's `shared_expert_gate` (1 × hidden).
    pub shared_gate: Option<QMatrix>,
}

#[derive(Clone, Debug)]
pub enum FfnWeights {
    Dense(MlpWeights),
    Moe(MoeWeights),
}

#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub attn: AttnWeights,
    pub ffn_norm: Vec<f32>,
    pub ffn: FfnWeights,
}

#[derive(Clone, Debug)]
pub struct DenseWeights {
    pub embed: QMatrix,
    pub layers: Vec<LayerWeights>,
    pub norm: Vec<f32>,
    pub lm_head: QMatrix,
    /// Whether [`DenseWeights::set_cpu_layouts`] has laid the product
    /// matrices out for the CPU's kernels.
    cpu_layouts: bool,
}

/// Hub tensor names of a family.
pub struct TensorNames {
    family: Family,
}

impl TensorNames {
    pub fn new(family: Family) -> Self {
        TensorNames { family }
    }

    pub fn layer(&self, i: usize) -> String {
        format!("model.layers.{i}.")
    }

    /// The MoE block's module name.
    pub fn moe_block(&self, i: usize) -> String {
        match self.family {
            Family::Mixtral => format!("model.layers.{i}.block_sparse_moe."),
            _ => format!("model.layers.{i}.mlp."),
        }
    }

    /// Names of (gate, up, down) of routed expert `e` of layer `i`.
    pub fn expert(&self, i: usize, e: usize) -> [String; 3] {
        let p = format!("{}experts.{e}.", self.moe_block(i));
        match self.family {
            Family::Mixtral => [
                format!("{p}w1.weight"),
                format!("{p}w3.weight"),
                format!("{p}w2.weight"),
            ],
            _ => [
                format!("{p}gate_proj.weight"),
                format!("{p}up_proj.weight"),
                format!("{p}down_proj.weight"),
            ],
        }
    }

    /// Names of the fused per-layer expert tensors transformers 5 uses
    /// internally (`gate_up_proj` `[E, 2I, H]`, `down_proj` `[E, H, I]`).
    pub fn fused_experts(&self, i: usize) -> [String; 2] {
        let p = format!("{}experts.", self.moe_block(i));
        [format!("{p}gate_up_proj"), format!("{p}down_proj")]
    }

    pub fn router(&self, i: usize) -> String {
        format!("{}gate.weight", self.moe_block(i))
    }
}

/// Tensors by Hub name: what dense weights are loaded from.
pub trait TensorReader {
    fn contains(&self, name: &str) -> bool;
    /// A `rows × cols` weight matrix in its stored format (FP8 with its
    /// `block × block` scales).
    fn matrix(&self, name: &str, rows: usize, cols: usize, fp8_block: usize) -> Result<QMatrix>;
    /// A small tensor (norm weights, biases) widened to f32.
    fn vector_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>>;
}

impl TensorReader for Checkpoint {
    fn contains(&self, name: &str) -> bool {
        Checkpoint::contains(self, name)
    }

    fn matrix(&self, name: &str, rows: usize, cols: usize, fp8_block: usize) -> Result<QMatrix> {
        Checkpoint::matrix(self, name, rows, cols, fp8_block)
    }

    fn vector_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        Checkpoint::vector_f32(self, name, shape)
    }
}

fn linear(
    ck: &(impl TensorReader + ?Sized),
    name: &str,
    rows: usize,
    cols: usize,
    bias: bool,
    block: usize,
) -> Result<Linear> {
    Ok(Linear {
        w: ck.matrix(&format!("{name}.weight"), rows, cols, block)?,
        bias: if bias {
            Some(ck.vector_f32(&format!("{name}.bias"), &[rows])?)
        } else {
            None
        },
    })
}

pub(crate) fn mlp(
    ck: &(impl TensorReader + ?Sized),
    names: [&str; 3],
    hidden: usize,
    inter: usize,
    block: usize,
) -> Result<MlpWeights> {
    Ok(MlpWeights {
        gate: ck.matrix(names[0], inter, hidden, block)?,
        up: ck.matrix(names[1], inter, hidden, block)?,
        down: ck.matrix(names[2], hidden, inter, block)?,
    })
}

/// The weights outside the layers.
#[derive(Clone, Debug)]
pub struct GlobalWeights {
    pub embed: QMatrix,
    pub norm: Vec<f32>,
    /// The output head; a clone of `embed` (same bytes) when tied.
    pub lm_head: QMatrix,
}

impl GlobalWeights {
    pub fn load(spec: &ModelSpec, ck: &(impl TensorReader + ?Sized)) -> Result<GlobalWeights> {
        let h = spec.hidden_size;
        let b = spec.fp8_block;
        let embed = ck.matrix("model.embed_tokens.weight", spec.vocab_size, h, b)?;
        let lm_head = if ck.contains("lm_head.weight") {
            ck.matrix("lm_head.weight", spec.vocab_size, h, b)?
        } else if spec.tie_word_embeddings {
            embed.clone()
        } else {
            return Err(ModelError::MissingTensor("lm_head.weight".into()));
        };
        Ok(GlobalWeights {
            embed,
            norm: ck.vector_f32("model.norm.weight", &[h])?,
            lm_head,
        })
    }

    /// Whether the output head is the embedding itself (tied weights).
    pub fn lm_head_is_embed(&self) -> bool {
        let (a, b) = (self.embed.data().as_slice(), self.lm_head.data().as_slice());
        a.as_ptr() == b.as_ptr() && a.len() == b.len()
    }

    pub fn with_layers(self, layers: Vec<LayerWeights>) -> DenseWeights {
        DenseWeights {
            embed: self.embed,
            layers,
            norm: self.norm,
            lm_head: self.lm_head,
            cpu_layouts: false,
        }
    }
}

impl DenseWeights {
    pub fn load(spec: &ModelSpec, ck: &(impl TensorReader + ?Sized)) -> Result<DenseWeights> {
        let g = GlobalWeights::load(spec, ck)?;
        let layers = (0..spec.num_layers())
            .map(|i| load_layer(spec, ck, i))
            .collect::<Result<Vec<_>>>()?;
        Ok(g.with_layers(layers))
    }

    /// The matrices that only whole-matrix products read: attention
    /// projections and dense or shared-expert MLPs. Not the embedding and
    /// MLA's `kv_b` (read row by row), the output head (it may be the
    /// embedding) or the routers.
    fn product_matrices(layers: &mut [LayerWeights]) -> Vec<&mut QMatrix> {
        let mut out = Vec::new();
        for l in layers {
            match &mut l.attn {
                AttnWeights::Gqa(a) => {
                    out.extend([&mut a.q.w, &mut a.k.w, &mut a.v.w, &mut a.o.w]);
                }
                AttnWeights::Mla(a) => {
                    match &mut a.q {
                        MlaQuery::Direct(q) => out.push(&mut q.w),
                        MlaQuery::LowRank { a, b, .. } => out.extend([&mut a.w, &mut b.w]),
                    }
                    out.extend([&mut a.kv_a.w, &mut a.o.w]);
                }
            }
            let mlp = match &mut l.ffn {
                FfnWeights::Dense(m) => Some(m),
                FfnWeights::Moe(m) => m.shared.as_mut(),
            };
            if let Some(m) = mlp {
                out.extend([&mut m.gate, &mut m.up, &mut m.down]);
            }
        }
        out
    }

    /// The matrices [`set_cpu_layouts`](Self::set_cpu_layouts) rewrites:
    /// for `on`, the products' Q4_0 and 16-bit matrices (where this CPU
    /// has the kernels) and a 16-bit output head that is not the
    /// embedding (the embedding is read row by row; an owned copy of a
    /// tied head would double its memory); for `!on`, every matrix not
    /// row-major.
    fn cpu_layout_matrices(&mut self, on: bool) -> Vec<&mut QMatrix> {
        let tiles = crate::kernels::q4_0_tiles_run_here();
        let quads = crate::kernels::quads16_run_here();
        let wanted = |m: &QMatrix| match m.format {
            _ if !on => m.layout() != Layout::RowMajor,
            WeightFormat::Q4_0 => tiles,
            WeightFormat::Bf16 | WeightFormat::F16 => {
                quads && crate::kernels::quads16::fits(m.rows, m.cols)
            }
            _ => false,
        };
        let tied = {
            let (a, b) = (self.embed.data().as_slice(), self.lm_head.data().as_slice());
            a.as_ptr() == b.as_ptr()
        };
        let head = if on {
            !tied && self.lm_head.format != WeightFormat::Q4_0
        } else {
            true
        } && wanted(&self.lm_head);
        let mut out: Vec<&mut QMatrix> = Self::product_matrices(&mut self.layers)
            .into_iter()
            .filter(|m| wanted(m))
            .collect();
        if head {
            out.push(&mut self.lm_head);
        }
        out
    }

    /// Bytes of the matrices that [`set_cpu_layouts`](Self::set_cpu_layouts)
    /// rewrites.
    pub fn cpu_layout_bytes(&mut self) -> u64 {
        self.cpu_layout_matrices(true)
            .iter()
            .map(|m| m.stored_bytes() as u64)
            .sum()
    }

    /// Rewrites the matrices of `cpu_layout_matrices` into the CPU's
    /// layouts (`on`): Q4_0 into tiles ([`crate::kernels::q4_0_tiles`]),
    /// bf16 and f16 into quads ([`crate::kernels::quads16`]); or back to
    /// row-major rows (`!on`, for a GPU that copies the bytes). The
    /// rewritten matrices share one owned storage (memory the page cache no
    /// longer backs), which starts on a huge page: copied one by one, each
    /// matrix's own mapping got huge pages only for its whole, aligned 2 MiB
    /// stretches (half of Qwen3-30B-A3B's 4.7 MB projections, none of its
    /// 0.6 MB ones), and its q/k/v and o products streamed 0.71 of the
    /// read pass instead of 0.84 (docs/benchmarks.md). Products give the
    /// same bits either way.
    /// Returns the bytes rewritten.
    pub fn set_cpu_layouts(&mut self, on: bool) -> Result<u64> {
        use crate::kernels::{q4_0_tiles, quads16};
        if self.cpu_layouts == on {
            return Ok(0);
        }
        let mut ms: Vec<&mut QMatrix> = self
            .cpu_layout_matrices(on)
            .into_iter()
            .filter(|m| (m.layout() != Layout::RowMajor) != on)
            .collect();
        // Each matrix at a cache line of the shared storage.
        let mut starts = Vec::with_capacity(ms.len());
        let mut total = 0usize;
        for m in &ms {
            starts.push(total);
            total += m.stored_bytes().next_multiple_of(64);
        }
        let mut owned = crate::tensor::AnonStorage::zeroed(total)?;
        let (mut scratch, mut scratch16) = (Vec::new(), Vec::new());
        for (m, &at) in ms.iter().zip(&starts) {
            let bytes = &mut owned.bytes_mut()[at..at + m.stored_bytes()];
            bytes.copy_from_slice(m.data().as_slice());
            let sixteen = m.format != WeightFormat::Q4_0;
            match (sixteen, on) {
                (false, true) => {
                    q4_0_tiles::tile_in_place(bytes, m.rows, m.cols / QK, &mut scratch)
                }
                (false, false) => {
                    q4_0_tiles::untile_in_place(bytes, m.rows, m.cols / QK, &mut scratch)
                }
                (true, true) => quads16::to_quads(
                    bytemuck::cast_slice_mut(bytes),
                    m.rows,
                    m.cols,
                    &mut scratch16,
                ),
                (true, false) => quads16::from_quads(
                    bytemuck::cast_slice_mut(bytes),
                    m.rows,
                    m.cols,
                    &mut scratch16,
                ),
            }
        }
        let owner: std::sync::Arc<dyn crate::tensor::ByteStorage> = std::sync::Arc::new(owned);
        let mut done = 0u64;
        for (m, &at) in ms.iter_mut().zip(&starts) {
            let fresh = QMatrix::new(
                "cpu layout",
                m.rows,
                m.cols,
                m.format,
                crate::tensor::Bytes::new(owner.clone(), at, m.stored_bytes())?,
                None,
            )?;
            let sixteen = m.format != WeightFormat::Q4_0;
            **m = match (sixteen, on) {
                (_, false) => fresh,
                (false, true) => fresh.tiled_q4_0()?,
                (true, true) => fresh.quads16()?,
            };
            done += m.stored_bytes() as u64;
        }
        self.cpu_layouts = on;
        Ok(done)
    }

    /// Whether the matrices are in the CPU's layouts
    /// ([`Self::set_cpu_layouts`]).
    pub fn cpu_layouts(&self) -> bool {
        self.cpu_layouts
    }
}

/// The dense weights of layer `i`, by Hub names.
pub fn load_layer(
    spec: &ModelSpec,
    ck: &(impl TensorReader + ?Sized),
    i: usize,
) -> Result<LayerWeights> {
    let h = spec.hidden_size;
    let b = spec.fp8_block;
    let names = TensorNames::new(spec.family);
    let ls = spec
        .layers
        .get(i)
        .ok_or_else(|| ModelError::Invalid(format!("layer {i} is not in the model")))?;
    let p = names.layer(i);
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
            let a = format!("{p}self_attn.");
            let (qn, kn) = match qk_norm {
                QkNorm::None => (None, None),
                QkNorm::PerHead => (Some(*head_dim), Some(*head_dim)),
                QkNorm::Full => (Some(q_out), Some(kv_out)),
            };
            AttnWeights::Gqa(GqaWeights {
                q: linear(ck, &format!("{a}q_proj"), q_out, h, *qkv_bias, b)?,
                k: linear(ck, &format!("{a}k_proj"), kv_out, h, *qkv_bias, b)?,
                v: linear(ck, &format!("{a}v_proj"), kv_out, h, *qkv_bias, b)?,
                o: linear(ck, &format!("{a}o_proj"), h, q_out, *o_bias, b)?,
                q_norm: qn
                    .map(|n| ck.vector_f32(&format!("{a}q_norm.weight"), &[n]))
                    .transpose()?,
                k_norm: kn
                    .map(|n| ck.vector_f32(&format!("{a}k_norm.weight"), &[n]))
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
            let a = format!("{p}self_attn.");
            let qk = qk_nope_head_dim + qk_rope_head_dim;
            let q = match q_lora_rank {
                None => MlaQuery::Direct(linear(
                    ck,
                    &format!("{a}q_proj"),
                    num_heads * qk,
                    h,
                    false,
                    b,
                )?),
                Some(r) => MlaQuery::LowRank {
                    a: linear(ck, &format!("{a}q_a_proj"), *r, h, *bias, b)?,
                    norm: ck.vector_f32(&format!("{a}q_a_layernorm.weight"), &[*r])?,
                    b: linear(ck, &format!("{a}q_b_proj"), num_heads * qk, *r, false, b)?,
                },
            };
            AttnWeights::Mla(MlaWeights {
                q,
                kv_a: linear(
                    ck,
                    &format!("{a}kv_a_proj_with_mqa"),
                    kv_lora_rank + qk_rope_head_dim,
                    h,
                    *bias,
                    b,
                )?,
                kv_a_norm: ck.vector_f32(&format!("{a}kv_a_layernorm.weight"), &[*kv_lora_rank])?,
                kv_b: ck.matrix(
                    &format!("{a}kv_b_proj.weight"),
                    num_heads * (qk_nope_head_dim + v_head_dim),
                    *kv_lora_rank,
                    b,
                )?,
                o: linear(
                    ck,
                    &format!("{a}o_proj"),
                    h,
                    num_heads * v_head_dim,
                    *bias,
                    b,
                )?,
            })
        }
    };
    let ffn = match &ls.ffn {
        FfnKind::Dense { intermediate_size } => {
            let m = format!("{p}mlp.");
            FfnWeights::Dense(mlp(
                ck,
                [
                    &format!("{m}gate_proj.weight"),
                    &format!("{m}up_proj.weight"),
                    &format!("{m}down_proj.weight"),
                ],
                h,
                *intermediate_size,
                b,
            )?)
        }
        FfnKind::Moe => {
            let moe = spec
                .moe
                .as_ref()
                .ok_or_else(|| ModelError::Invalid("MoE layer without MoE spec".into()))?;
            let blk = names.moe_block(i);
            let router = ck.matrix(&names.router(i), moe.num_experts, h, b)?;
            let selection_bias = match moe.router {
                RouterKind::SigmoidGrouped { .. } => Some(ck.vector_f32(
                    &format!("{blk}gate.e_score_correction_bias"),
                    &[moe.num_experts],
                )?),
                RouterKind::Softmax { .. } => None,
            };
            let (shared, shared_gate) = match (&moe.shared, spec.family) {
                (None, _) => (None, None),
                (Some(s), Family::Qwen2Moe) => {
                    let m = format!("{blk}shared_expert.");
                    (
                        Some(mlp(
                            ck,
                            [
                                &format!("{m}gate_proj.weight"),
                                &format!("{m}up_proj.weight"),
                                &format!("{m}down_proj.weight"),
                            ],
                            h,
                            s.intermediate_size,
                            b,
                        )?),
                        if s.gated {
                            Some(ck.matrix(&format!("{blk}shared_expert_gate.weight"), 1, h, b)?)
                        } else {
                            None
                        },
                    )
                }
                (Some(s), _) => {
                    let m = format!("{blk}shared_experts.");
                    (
                        Some(mlp(
                            ck,
                            [
                                &format!("{m}gate_proj.weight"),
                                &format!("{m}up_proj.weight"),
                                &format!("{m}down_proj.weight"),
                            ],
                            h,
                            s.intermediate_size,
                            b,
                        )?),
                        None,
                    )
                }
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
        attn_norm: ck.vector_f32(&format!("{p}input_layernorm.weight"), &[h])?,
        attn,
        ffn_norm: ck.vector_f32(&format!("{p}post_attention_layernorm.weight"), &[h])?,
        ffn,
    })
}
