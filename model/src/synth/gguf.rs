//! A synthetic model as a GGUF file, laid out as llama.cpp's converter
//! lays out the real checkpoint: llama.cpp's metadata keys and tensor
//! names, experts stacked per layer in `ffn_{gate,up,down}_exps`, Mixtral's
//! q/k rows permuted to llama.cpp's RoPE layout and DeepSeek's `kv_b_proj`
//! split into `attn_k_b` (transposed per head) and `attn_v_b`.
//!
//! The values are the same generated values as the packed store's (each
//! element is drawn from its position in the Hugging Face tensor), so the
//! GGUF and the packed store of one seed load to the same model: logits are
//! bit-identical for f32 and bf16, and for q8_0/q4_0 everywhere but
//! DeepSeek's `kv_b` (quantized along other rows in GGUF).

use std::path::Path;
use std::time::Instant;

use crate::config::{AttentionSpec, Family, FfnKind, ModelSpec, RopeScaling, RouterKind};
use crate::convert::cast::{Quant, RowSource, convert_rows, target_format};
use crate::convert::memory::PeakMemory;
use crate::convert::tensors::{self, Role, Shape};
use crate::convert::{Progress, cast};
use crate::error::{ModelError, Result};
use crate::format::WeightFormat;
use crate::source::gguf::{GgmlType, GgufStreamWriter, GgufValue};
use crate::weights::TensorNames;

use super::random::{self, MappedRows, SynthMatrix};

/// llama.cpp's architecture name of a family.
pub fn arch_name(f: Family) -> &'static str {
    match f {
        Family::Qwen3Moe => "qwen3moe",
        Family::Qwen2Moe => "qwen2moe",
        Family::Mixtral => "llama",
        Family::Olmoe => "olmoe",
        Family::DeepseekV3 => "deepseek2",
    }
}

fn cannot(what: &str) -> ModelError {
    ModelError::Config(format!("cannot write this model as GGUF: {what}"))
}

/// The metadata llama.cpp (and [`crate::source::gguf::arch`]) reads.
pub fn metadata(spec: &ModelSpec) -> Result<Vec<(String, GgufValue)>> {
    let a = arch_name(spec.family);
    let mut m: Vec<(String, GgufValue)> = Vec::new();
    let mut put = |k: &str, v: GgufValue| m.push((k.to_string(), v));
    let k = |s: &str| format!("{a}.{s}");
    let u = |v: usize| GgufValue::U32(v as u32);
    put("general.architecture", GgufValue::String(a.into()));
    put(
        "general.name",
        GgufValue::String("colibri synth (random weights)".into()),
    );
    put(&k("block_count"), u(spec.num_layers()));
    put(&k("context_length"), u(spec.max_position_embeddings));
    put(&k("embedding_length"), u(spec.hidden_size));
    put(
        &k("attention.layer_norm_rms_epsilon"),
        GgufValue::F32(spec.rms_norm_eps),
    );
    put(&k("rope.freq_base"), GgufValue::F32(spec.rope.theta as f32));
    let dense_inter = spec.layers.iter().find_map(|l| match l.ffn {
        FfnKind::Dense { intermediate_size } => Some(intermediate_size),
        FfnKind::Moe => None,
    });
    match &spec.attention {
        AttentionSpec::Gqa {
            num_heads,
            num_kv_heads,
            head_dim,
            clip_qkv,
            ..
        } => {
            put(&k("attention.head_count"), u(*num_heads));
            put(&k("attention.head_count_kv"), u(*num_kv_heads));
            put(&k("attention.key_length"), u(*head_dim));
            put(&k("attention.value_length"), u(*head_dim));
            put(&k("rope.dimension_count"), u(*head_dim));
            if let Some(c) = clip_qkv {
                put(&k("attention.clamp_kqv"), GgufValue::F32(*c));
            }
        }
        AttentionSpec::Mla {
            num_heads,
            q_lora_rank,
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
            ..
        } => {
            put(&k("attention.head_count"), u(*num_heads));
            put(&k("attention.head_count_kv"), u(1));
            if let Some(r) = q_lora_rank {
                put(&k("attention.q_lora_rank"), u(*r));
            }
            put(&k("attention.kv_lora_rank"), u(*kv_lora_rank));
            put(
                &k("attention.key_length"),
                u(kv_lora_rank + qk_rope_head_dim),
            );
            put(&k("attention.value_length"), u(*kv_lora_rank));
            put(
                &k("attention.key_length_mla"),
                u(qk_nope_head_dim + qk_rope_head_dim),
            );
            put(&k("attention.value_length_mla"), u(*v_head_dim));
            put(&k("rope.dimension_count"), u(*qk_rope_head_dim));
            let leading = spec
                .layers
                .iter()
                .take_while(|l| l.ffn != FfnKind::Moe)
                .count();
            put(&k("leading_dense_block_count"), u(leading));
        }
    }
    let window = spec.layers.iter().find_map(|l| l.sliding_window);
    if let Some(w) = window {
        put(&k("attention.sliding_window"), u(w));
        if spec.layers.iter().any(|l| l.sliding_window.is_none()) {
            put(
                &k("attention.sliding_window_pattern"),
                GgufValue::Array(crate::source::gguf::GgufArray {
                    elem: crate::source::gguf::GgufType::Bool,
                    values: spec
                        .layers
                        .iter()
                        .map(|l| GgufValue::Bool(l.sliding_window.is_some()))
                        .collect(),
                }),
            );
        }
    }
    if let Some(moe) = &spec.moe {
        put(
            &k("feed_forward_length"),
            u(dense_inter.unwrap_or(moe.intermediate_size)),
        );
        put(&k("expert_count"), u(moe.num_experts));
        put(&k("expert_used_count"), u(moe.top_k));
        put(&k("expert_feed_forward_length"), u(moe.intermediate_size));
        match &moe.router {
            RouterKind::Softmax { norm_topk_prob } => {
                put(&k("expert_weights_norm"), GgufValue::Bool(*norm_topk_prob));
            }
            RouterKind::SigmoidGrouped {
                n_group,
                topk_group,
                norm_topk_prob,
                routed_scaling_factor,
            } => {
                put(&k("expert_gating_func"), u(2));
                put(&k("expert_group_count"), u(*n_group));
                put(&k("expert_group_used_count"), u(*topk_group));
                put(&k("expert_weights_norm"), GgufValue::Bool(*norm_topk_prob));
                put(
                    &k("expert_weights_scale"),
                    GgufValue::F32(*routed_scaling_factor),
                );
            }
        }
        if let Some(s) = &moe.shared {
            put(
                &k("expert_shared_feed_forward_length"),
                u(s.intermediate_size),
            );
            if spec.family == Family::DeepseekV3 && moe.intermediate_size > 0 {
                put(
                    &k("expert_shared_count"),
                    u(s.intermediate_size / moe.intermediate_size),
                );
            }
        }
    } else if let Some(d) = dense_inter {
        put(&k("feed_forward_length"), u(d));
    }
    match &spec.rope.scaling {
        RopeScaling::None => {}
        RopeScaling::Linear { factor } => {
            put(&k("rope.scaling.type"), GgufValue::String("linear".into()));
            put(&k("rope.scaling.factor"), GgufValue::F32(*factor as f32));
        }
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            mscale,
            mscale_all_dim,
            attention_factor,
            ..
        } => {
            put(&k("rope.scaling.type"), GgufValue::String("yarn".into()));
            put(&k("rope.scaling.factor"), GgufValue::F32(*factor as f32));
            put(
                &k("rope.scaling.original_context_length"),
                u(*original_max_position_embeddings as usize),
            );
            put(
                &k("rope.scaling.yarn_beta_fast"),
                GgufValue::F32(*beta_fast as f32),
            );
            put(
                &k("rope.scaling.yarn_beta_slow"),
                GgufValue::F32(*beta_slow as f32),
            );
            match (spec.family, mscale, mscale_all_dim) {
                (Family::DeepseekV3, Some(a), Some(b)) if a == b => {
                    put(
                        &k("rope.scaling.yarn_log_multiplier"),
                        GgufValue::F32((0.1 * b) as f32),
                    );
                }
                (_, None, None) => {}
                _ => return Err(cannot("YaRN mscale values GGUF cannot express")),
            }
            if let Some(f) = attention_factor {
                put(
                    &k("rope.scaling.yarn_attn_factor"),
                    GgufValue::F32(*f as f32),
                );
            }
        }
        RopeScaling::Llama3 { .. } => {
            return Err(cannot("Llama-3 RoPE scaling (needs rope_freqs)"));
        }
    }
    if let Some(b) = spec.bos_token_id {
        put("tokenizer.ggml.bos_token_id", GgufValue::U32(b));
    }
    let eos_keys = [
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ];
    if spec.eos_token_ids.len() > eos_keys.len() {
        return Err(cannot("more than three end-of-sequence ids"));
    }
    for (key, id) in eos_keys.iter().zip(&spec.eos_token_ids) {
        put(key, GgufValue::U32(*id));
    }
    Ok(m)
}

/// The GGUF name of a Hugging Face dense tensor (`kv_b_proj` excepted).
fn gguf_name(hf: &str) -> Option<String> {
    match hf {
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (i, rest) = rest.split_once('.')?;
    let rest = rest
        .strip_prefix("block_sparse_moe.")
        .map(|r| format!("mlp.{r}"))
        .unwrap_or_else(|| rest.to_string());
    let (stem, suffix) = rest.rsplit_once('.')?;
    let g = match stem {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "self_attn.q_a_proj" => "attn_q_a",
        "self_attn.q_a_layernorm" => "attn_q_a_norm",
        "self_attn.q_b_proj" => "attn_q_b",
        "self_attn.kv_a_proj_with_mqa" => "attn_kv_a_mqa",
        "self_attn.kv_a_layernorm" => "attn_kv_a_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        "mlp.gate" if suffix == "e_score_correction_bias" => {
            return Some(format!("blk.{i}.exp_probs_b.bias"));
        }
        "mlp.gate" => "ffn_gate_inp",
        "mlp.shared_expert.gate_proj" | "mlp.shared_experts.gate_proj" => "ffn_gate_shexp",
        "mlp.shared_expert.up_proj" | "mlp.shared_experts.up_proj" => "ffn_up_shexp",
        "mlp.shared_expert.down_proj" | "mlp.shared_experts.down_proj" => "ffn_down_shexp",
        "mlp.shared_expert_gate" => "ffn_gate_inp_shexp",
        _ => return None,
    };
    Some(format!("blk.{i}.{g}.{suffix}"))
}

/// How a GGUF tensor's rows come from a Hugging Face tensor.
#[derive(Clone, Copy, Debug)]
enum View {
    Plain,
    /// llama.cpp's q/k row order (adjacent rotary pairs) for `llama`.
    LlamaRope {
        head_dim: usize,
    },
    /// `attn_k_b`: per head, the k rows of `kv_b_proj` transposed.
    KvbK {
        nope: usize,
        v: usize,
        rank: usize,
    },
    /// `attn_v_b`: per head, the v rows of `kv_b_proj`.
    KvbV {
        nope: usize,
        v: usize,
    },
}

enum Data {
    Dense {
        src: SynthMatrix,
        view: View,
        format: WeightFormat,
        vector: bool,
    },
    /// Matrix `which` (gate, up, down) of every expert of a layer.
    Experts {
        layer: usize,
        which: usize,
        rows: usize,
        cols: usize,
        format: WeightFormat,
    },
}

struct Tensor {
    name: String,
    ne: Vec<u64>,
    ty: GgmlType,
    data: Data,
}

/// The formats a GGUF file stores some tensors in instead of `quant`'s, as
/// llama.cpp's mixes do (its Q4_0 and k-quant files keep the output head in
/// Q6_K; a Q4_K_M file's experts are mostly Q4_K).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GgufMix {
    /// The output head's format.
    pub head: Option<WeightFormat>,
    /// The routed experts' format.
    pub experts: Option<WeightFormat>,
    /// The experts' down projections in Q6_K in the layers llama.cpp's
    /// `_M` mixes give more bits (its `use_more_bits`: the first and last
    /// eighth of the layers and every third one between).
    pub more_bits_down: bool,
}

/// llama.cpp's `use_more_bits(layer, layers)`.
fn more_bits(layer: usize, layers: usize) -> bool {
    layer < layers / 8 || layer >= 7 * layers / 8 || (layer - layers / 8) % 3 == 2
}

fn ggml(f: WeightFormat) -> Result<GgmlType> {
    Ok(match f {
        WeightFormat::F32 => GgmlType::F32,
        WeightFormat::F16 => GgmlType::F16,
        WeightFormat::Bf16 => GgmlType::BF16,
        WeightFormat::Q8_0 => GgmlType::Q8_0,
        WeightFormat::Q4_0 => GgmlType::Q4_0,
        WeightFormat::Q6K => GgmlType::Q6_K,
        WeightFormat::Q4K => GgmlType::Q4_K,
        WeightFormat::Q5K => GgmlType::Q5_K,
        WeightFormat::Q4_1 => GgmlType::Q4_1,
        WeightFormat::Q5_0 => GgmlType::Q5_0,
        WeightFormat::Q5_1 => GgmlType::Q5_1,
        WeightFormat::Q2K => GgmlType::Q2_K,
        WeightFormat::Q3K => GgmlType::Q3_K,
        WeightFormat::Iq4Nl => GgmlType::IQ4_NL,
        WeightFormat::Iq4Xs => GgmlType::IQ4_XS,
        WeightFormat::F8E4M3 => return Err(cannot("fp8 tensors")),
    })
}

/// Stored row `s` of a `llama` q/k tensor holds Hugging Face row `hf`.
fn llama_row(s: usize, hd: usize) -> usize {
    let (h, rem) = (s / hd, s % hd);
    h * hd + (rem % 2) * (hd / 2) + rem / 2
}

/// Every tensor of the GGUF file, in file order: `quant`'s formats but
/// where `mix` names another.
fn tensors(spec: &ModelSpec, quant: Quant, mix: GgufMix, seed: u64) -> Result<Vec<Tensor>> {
    let head = mix.head;
    if let Some(h) = head {
        h.row_bytes(spec.hidden_size)?;
    }
    let mut out = Vec::new();
    let dense = |ts: Vec<tensors::DenseTensor<'_>>, out: &mut Vec<Tensor>| -> Result<()> {
        for t in ts {
            let (rows, cols, vector) = match t.shape {
                Shape::Matrix { rows, cols } => (rows, cols, false),
                Shape::Vector(n) => (1, n, true),
            };
            let src = SynthMatrix::new(seed, &t.name, t.role, rows, cols);
            let fmt = |cols: usize| match head {
                _ if vector => WeightFormat::F32,
                Some(h) if t.role == Role::OutputHead => h,
                _ => target_format(quant, t.role, WeightFormat::Bf16, cols).0,
            };
            if t.name.ends_with("self_attn.kv_b_proj.weight") {
                let AttentionSpec::Mla {
                    num_heads,
                    kv_lora_rank: r,
                    qk_nope_head_dim: nope,
                    v_head_dim: v,
                    ..
                } = spec.attention
                else {
                    return Err(cannot("kv_b_proj outside MLA"));
                };
                let blk = gguf_name(&t.name.replace("kv_b_proj", "q_a_proj"))
                    .and_then(|n| n.split_once(".attn").map(|(b, _)| b.to_string()))
                    .ok_or_else(|| cannot("kv_b_proj name"))?;
                for (which, view, ne, c) in [
                    (
                        "k_b",
                        View::KvbK { nope, v, rank: r },
                        [nope, r, num_heads],
                        nope,
                    ),
                    ("v_b", View::KvbV { nope, v }, [r, v, num_heads], r),
                ] {
                    let format = fmt(c);
                    out.push(Tensor {
                        name: format!("{blk}.attn_{which}.weight"),
                        ne: ne.iter().map(|&d| d as u64).collect(),
                        ty: ggml(format)?,
                        data: Data::Dense {
                            src: src.clone(),
                            view,
                            format,
                            vector: false,
                        },
                    });
                }
                continue;
            }
            let name = gguf_name(&t.name).ok_or_else(|| cannot(&format!("tensor `{}`", t.name)))?;
            let view = match (&spec.attention, spec.family) {
                (AttentionSpec::Gqa { head_dim, .. }, Family::Mixtral)
                    if t.name.contains("self_attn.q_proj")
                        || t.name.contains("self_attn.k_proj") =>
                {
                    View::LlamaRope {
                        head_dim: *head_dim,
                    }
                }
                _ => View::Plain,
            };
            let format = fmt(cols);
            out.push(Tensor {
                name,
                ne: if vector {
                    vec![cols as u64]
                } else {
                    vec![cols as u64, rows as u64]
                },
                ty: ggml(format)?,
                data: Data::Dense {
                    src,
                    view,
                    format,
                    vector,
                },
            });
        }
        Ok(())
    };
    let globals = tensors::global_tensors(spec, None)?;
    // token_embd first, output_norm and output last, as the converter.
    let (embed, tail): (Vec<_>, Vec<_>) =
        globals.into_iter().partition(|t| t.role == Role::Embedding);
    dense(embed, &mut out)?;
    for (i, ls) in spec.layers.iter().enumerate() {
        dense(tensors::layer_tensors(spec, i, None)?, &mut out)?;
        if let (FfnKind::Moe, Some(moe)) = (&ls.ffn, &spec.moe) {
            let (h, inter, n) = (spec.hidden_size, moe.intermediate_size, moe.num_experts);
            for (which, (name, rows, cols)) in
                [("gate", inter, h), ("up", inter, h), ("down", h, inter)]
                    .into_iter()
                    .enumerate()
            {
                let more = mix.more_bits_down && name == "down" && more_bits(i, spec.layers.len());
                let format = match mix.experts {
                    _ if more => WeightFormat::Q6K,
                    Some(f) => f,
                    None => target_format(quant, Role::RoutedExpert, WeightFormat::Bf16, cols).0,
                };
                if mix.experts.is_some() || more {
                    format.row_bytes(cols)?;
                }
                out.push(Tensor {
                    name: format!("blk.{i}.ffn_{name}_exps.weight"),
                    ne: vec![cols as u64, rows as u64, n as u64],
                    ty: ggml(format)?,
                    data: Data::Experts {
                        layer: i,
                        which,
                        rows,
                        cols,
                        format,
                    },
                });
            }
        }
    }
    dense(tail, &mut out)?;
    Ok(out)
}

fn write_rows(
    w: &mut GgufStreamWriter,
    src: &dyn RowSource,
    format: WeightFormat,
    progress: &dyn Progress,
) -> Result<u64> {
    Ok(convert_rows(src, format, &mut |b| {
        w.write(b)?;
        progress.advance(b.len() as u64);
        Ok(())
    })?
    .bytes)
}

/// `src`'s rows as random blocks of a format colibri does not quantize
/// to, a row at a time.
fn write_random_blocks(
    w: &mut GgufStreamWriter,
    src: &SynthMatrix,
    blocks: &random::RandomBlocks,
    progress: &dyn Progress,
) -> Result<u64> {
    let mut row = vec![0u8; blocks.row_bytes(src.cols)?];
    for r in 0..src.rows {
        blocks.row(r, &mut row);
        w.write(&row)?;
        progress.advance(row.len() as u64);
    }
    Ok((row.len() * src.rows) as u64)
}

/// What writing a GGUF file did.
pub struct GgufOutcome {
    pub file_bytes: u64,
    pub data_bytes: u64,
    pub expert_bytes: u64,
    pub seconds: f64,
    pub peak_rss_anon_bytes: u64,
}

/// Bytes of the file `write` would produce, and of one expert's matrices.
pub fn planned_bytes(spec: &ModelSpec, quant: Quant, mix: GgufMix) -> Result<(u64, u64)> {
    let ts = tensors(spec, quant, mix, 0)?;
    let meta = metadata(spec)?;
    let headers: Vec<_> = ts
        .iter()
        .map(|t| -> Result<_> {
            Ok(crate::source::gguf::write::TensorHeader {
                name: &t.name,
                ne: &t.ne,
                ty: t.ty,
                bytes: t.ty.tensor_bytes(&t.ne).map_err(ModelError::Invalid)?,
            })
        })
        .collect::<Result<_>>()?;
    let a = crate::source::gguf::header::DEFAULT_ALIGNMENT;
    let header = crate::source::gguf::write::header_bytes(&meta, &headers, a).len() as u64;
    let data: u64 = headers.iter().map(|h| h.bytes.div_ceil(a) * a).sum();
    let expert = expert_bytes(&ts, spec);
    Ok((header + data, expert))
}

fn expert_bytes(ts: &[Tensor], spec: &ModelSpec) -> u64 {
    let n = spec.moe.as_ref().map_or(1, |m| m.num_experts.max(1)) as u64;
    ts.iter()
        .filter_map(|t| match t.data {
            Data::Experts { layer, .. } if Some(layer) == first_moe_layer(spec) => {
                t.ty.tensor_bytes(&t.ne).ok().map(|b| b / n)
            }
            _ => None,
        })
        .sum()
}

fn first_moe_layer(spec: &ModelSpec) -> Option<usize> {
    spec.layers.iter().position(|l| l.ffn == FfnKind::Moe)
}

/// Writes the synthetic model of `spec` (values from `seed`) to `out`,
/// in `quant` but where `mix` says otherwise.
pub fn write(
    spec: &ModelSpec,
    quant: Quant,
    mix: GgufMix,
    seed: u64,
    out: &Path,
    progress: &dyn Progress,
) -> Result<GgufOutcome> {
    let t0 = Instant::now();
    let mem = PeakMemory::new();
    let ts = tensors(spec, quant, mix, seed)?;
    let meta = metadata(spec)?;
    let infos: Vec<(String, Vec<u64>, GgmlType)> = ts
        .iter()
        .map(|t| (t.name.clone(), t.ne.clone(), t.ty))
        .collect();
    let total: u64 = ts
        .iter()
        .filter_map(|t| t.ty.tensor_bytes(&t.ne).ok())
        .sum();
    let names = TensorNames::new(spec.family);
    let mut w = GgufStreamWriter::create(out, &meta, &infos)?;
    progress.begin(total, 0);
    let mut data = 0u64;
    for t in &ts {
        progress.message(&t.name);
        match &t.data {
            Data::Dense {
                src,
                view,
                format,
                vector,
            } => {
                if *vector {
                    let mut v = src.values();
                    if let View::LlamaRope { head_dim } = view {
                        v = (0..v.len()).map(|s| v[llama_row(s, *head_dim)]).collect();
                    }
                    let b = cast::vector_bytes(&v);
                    w.write(&b)?;
                    progress.advance(b.len() as u64);
                    data += b.len() as u64;
                    continue;
                }
                data += match *view {
                    View::Plain => write_rows(&mut w, src, *format, progress)?,
                    View::LlamaRope { head_dim } => {
                        let m = MappedRows {
                            inner: src,
                            rows: src.rows,
                            cols: src.cols,
                            map: move |r, c| (llama_row(r, head_dim), c),
                        };
                        write_rows(&mut w, &m, *format, progress)?
                    }
                    View::KvbK { nope, v, rank } => {
                        let heads = src.rows / (nope + v);
                        let m = MappedRows {
                            inner: src,
                            rows: heads * rank,
                            cols: nope,
                            map: move |r, j| ((r / rank) * (nope + v) + j, r % rank),
                        };
                        write_rows(&mut w, &m, *format, progress)?
                    }
                    View::KvbV { nope, v } => {
                        let heads = src.rows / (nope + v);
                        let m = MappedRows {
                            inner: src,
                            rows: heads * v,
                            cols: src.cols,
                            map: move |r, c| ((r / v) * (nope + v) + nope + r % v, c),
                        };
                        write_rows(&mut w, &m, *format, progress)?
                    }
                };
            }
            Data::Experts {
                layer,
                which,
                rows,
                cols,
                format,
            } => {
                let n = spec.moe.as_ref().map_or(0, |m| m.num_experts);
                for e in 0..n {
                    let name = &names.expert(*layer, e)[*which];
                    let m = SynthMatrix::new(seed, name, Role::RoutedExpert, *rows, *cols);
                    data += match random::RandomBlocks::new(&m, *format) {
                        Some(blocks) => write_random_blocks(&mut w, &m, &blocks, progress)?,
                        None => write_rows(&mut w, &m, *format, progress)?,
                    };
                    mem.sample();
                }
            }
        }
        mem.sample();
    }
    let file_bytes = w.finish()?;
    Ok(GgufOutcome {
        file_bytes,
        data_bytes: data,
        expert_bytes: expert_bytes(&ts, spec),
        seconds: t0.elapsed().as_secs_f64(),
        peak_rss_anon_bytes: mem.peak_anon(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_as_llama_cpp_names_them() {
        for (hf, g) in [
            ("model.layers.3.self_attn.q_proj.bias", "blk.3.attn_q.bias"),
            (
                "model.layers.0.block_sparse_moe.gate.weight",
                "blk.0.ffn_gate_inp.weight",
            ),
            (
                "model.layers.2.mlp.gate.e_score_correction_bias",
                "blk.2.exp_probs_b.bias",
            ),
            (
                "model.layers.1.mlp.shared_experts.down_proj.weight",
                "blk.1.ffn_down_shexp.weight",
            ),
            (
                "model.layers.1.mlp.shared_expert_gate.weight",
                "blk.1.ffn_gate_inp_shexp.weight",
            ),
            (
                "model.layers.4.self_attn.kv_a_layernorm.weight",
                "blk.4.attn_kv_a_norm.weight",
            ),
            ("lm_head.weight", "output.weight"),
        ] {
            assert_eq!(gguf_name(hf).as_deref(), Some(g));
        }
        // The inverse of the loader's permutation.
        let hd = 8;
        for s in 0..3 * hd {
            let hf = llama_row(s, hd);
            let (h, rem) = (hf / hd, hf % hd);
            let (a, i) = (rem / (hd / 2), rem % (hd / 2));
            assert_eq!(s, h * hd + 2 * i + a);
        }
    }
}
