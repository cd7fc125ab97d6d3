//! A [`ModelSpec`] from GGUF metadata, for the architectures llama.cpp's
//! `convert_hf_to_gguf.py` writes our five families as:
//!
//! | GGUF arch   | family       | notes                                          |
//! |-------------|--------------|------------------------------------------------|
//! | `qwen3moe`  | Qwen3-MoE    | per-head q/k norms, top-k renormalised         |
//! | `qwen2moe`  | Qwen2-MoE    | q/k/v biases, gated shared expert              |
//! | `llama`     | Mixtral      | `expert_count > 0`; q/k rows permuted (load.rs)|
//! | `olmoe`     | OLMoE        | full-width q/k norms, `attention.clamp_kqv`    |
//! | `deepseek2` | DeepSeek-V3  | MLA, sigmoid group-limited routing, YaRN       |
//!
//! Which layers are MoE and which carry biases is read from the tensors
//! present (a layer with `ffn_gate_inp` is MoE), not from the arch name, so
//! checkpoints with dense layers in between (Qwen's `mlp_only_layers`,
//! `decoder_sparse_step`) load as they are.
//!
//! Where llama.cpp hard-codes a behaviour the converter does not write
//! (top-k renormalisation per arch, the YaRN attention factor of DeepSeek),
//! the hard-coded value is the default and the standard key, when present,
//! wins: `{arch}.expert_weights_norm`, `{arch}.rope.scaling.yarn_attn_factor`,
//! `{arch}.attention.sliding_window`, `{arch}.attention.clamp_kqv`.

use super::GgufFile;
use crate::config::{
    AttentionSpec, Family, FfnKind, LayerSpec, ModelSpec, MoeSpec, QkNorm, RopeScaling, RopeSpec,
    RouterKind, SharedExpertSpec,
};
use crate::error::Result;

/// The shortest decimal that rounds to `v`, as an f64. GGUF stores config
/// floats as f32; configs wrote them as decimals (0.08, 2.5), and this
/// recovers the decimal transformers computes with.
pub fn f32_decimal(v: f64) -> f64 {
    let s = format!("{}", v as f32);
    s.parse().unwrap_or(v)
}

fn family(file: &GgufFile, arch: &str) -> Result<Family> {
    Ok(match arch {
        "qwen3moe" => Family::Qwen3Moe,
        "qwen2moe" => Family::Qwen2Moe,
        "olmoe" => Family::Olmoe,
        "deepseek2" => Family::DeepseekV3,
        "llama" => {
            if file.opt_usize("llama.expert_count")?.unwrap_or(0) == 0 {
                return Err(file.err(
                    "architecture `llama` without experts is a dense model; colibri runs MoE models (llama with expert_count > 0 is Mixtral)",
                ));
            }
            Family::Mixtral
        }
        other => {
            return Err(file.err(format!(
                "architecture `{other}` is not supported (supported: qwen3moe, qwen2moe, llama with experts (Mixtral), olmoe, deepseek2)"
            )));
        }
    })
}

/// A per-layer count that may be stored as one integer or an array.
fn uniform_count(file: &GgufFile, key: &str) -> Result<Option<usize>> {
    match file.get(key) {
        None => Ok(None),
        Some(v) => {
            if let Some(n) = v.as_u64() {
                return file.opt_usize(key).map(|_| Some(n as usize));
            }
            let a = v
                .as_array()
                .ok_or_else(|| file.err(format!("metadata `{key}`: expected an integer")))?;
            let vals: Vec<u64> = a.values.iter().filter_map(|x| x.as_u64()).collect();
            match vals.first() {
                Some(&f)
                    if f <= super::MAX_DIM
                        && vals.len() == a.values.len()
                        && vals.iter().all(|&x| x == f) =>
                {
                    Ok(Some(f as usize))
                }
                _ => Err(file.err(format!(
                    "metadata `{key}`: per-layer values differ; colibri needs one value for every layer"
                ))),
            }
        }
    }
}

fn rope(file: &GgufFile, a: &str, family: Family, ctx: usize) -> Result<RopeSpec> {
    if file.contains("rope_freqs.weight") {
        return Err(file.err(
            "tensor `rope_freqs.weight` (per-frequency RoPE factors, e.g. Llama-3 scaling) is not supported",
        ));
    }
    let theta = file
        .opt_f64(&format!("{a}.rope.freq_base"))?
        .unwrap_or(10000.0);
    let kind = file
        .opt_str(&format!("{a}.rope.scaling.type"))?
        .unwrap_or("none")
        .to_string();
    let factor = file.opt_f64(&format!("{a}.rope.scaling.factor"))?;
    let legacy_linear = file.opt_f64(&format!("{a}.rope.scale_linear"))?;
    let scaling = match kind.as_str() {
        "none" => match legacy_linear {
            Some(f) if f != 1.0 => RopeScaling::Linear { factor: f },
            _ => RopeScaling::None,
        },
        "linear" => RopeScaling::Linear {
            factor: factor.ok_or_else(|| {
                file.err(format!("metadata `{a}.rope.scaling.factor` is missing"))
            })?,
        },
        "yarn" => {
            let key = |k: &str| format!("{a}.rope.scaling.{k}");
            let factor = factor
                .ok_or_else(|| file.err(format!("metadata `{}` is missing", key("factor"))))?;
            // DeepSeek: yarn_log_multiplier = 0.1 · mscale_all_dim. llama.cpp
            // takes mscale = mscale_all_dim (true of every DeepSeek release),
            // which makes the rotary attention factor 1.
            let (mscale, mscale_all_dim) =
                match (family, file.opt_f64(&key("yarn_log_multiplier"))?) {
                    (Family::DeepseekV3, Some(m)) if m != 0.0 => {
                        let all = f32_decimal(m) / 0.1;
                        (Some(all), Some(all))
                    }
                    _ => (None, None),
                };
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: file
                    .opt_f64(&key("original_context_length"))?
                    .unwrap_or(ctx as f64),
                beta_fast: file
                    .opt_f64(&key("yarn_beta_fast"))?
                    .filter(|v| *v != 0.0)
                    .unwrap_or(32.0),
                beta_slow: file
                    .opt_f64(&key("yarn_beta_slow"))?
                    .filter(|v| *v != 0.0)
                    .unwrap_or(1.0),
                mscale,
                mscale_all_dim,
                attention_factor: file.opt_f64(&key("yarn_attn_factor"))?,
                truncate: true,
            }
        }
        other => {
            return Err(file.err(format!(
                "metadata `{a}.rope.scaling.type` `{other}` is not supported (supported: none, linear, yarn)"
            )));
        }
    };
    Ok(RopeSpec { theta, scaling })
}

/// Builds the spec of the model in `file`.
pub fn spec(file: &GgufFile) -> Result<ModelSpec> {
    let a = file.architecture()?.to_string();
    let family = family(file, &a)?;
    let k = |s: &str| format!("{a}.{s}");
    let num_layers = file.usize(&k("block_count"))?;
    let hidden = file.usize(&k("embedding_length"))?;
    let num_heads = uniform_count(file, &k("attention.head_count"))?.ok_or_else(|| {
        file.err(format!(
            "metadata `{}` is missing",
            k("attention.head_count")
        ))
    })?;
    let num_kv_heads = uniform_count(file, &k("attention.head_count_kv"))?.unwrap_or(num_heads);
    let ctx = file.opt_usize(&k("context_length"))?.unwrap_or(4096);
    let default_eps = if matches!(family, Family::Mixtral | Family::Olmoe) {
        1e-5
    } else {
        1e-6
    };
    let rms_norm_eps = file
        .opt_f64(&k("attention.layer_norm_rms_epsilon"))?
        .unwrap_or(default_eps) as f32;
    let embd = file.tensor("token_embd.weight")?;
    if embd.ne.len() != 2 || embd.ne[0] as usize != hidden {
        return Err(file.err(format!(
            "tensor `token_embd.weight` has dims {:?}, expected [{hidden}, vocab]",
            embd.ne
        )));
    }
    let vocab_size = embd.ne[1] as usize;
    let has = |name: String| file.contains(&name);

    let attention = if family == Family::DeepseekV3 {
        let rope_dim = file.usize(&k("rope.dimension_count"))?;
        let (key_len, v_len) = match file.opt_usize(&k("attention.key_length_mla"))? {
            Some(kl) => (kl, file.usize(&k("attention.value_length_mla"))?),
            // Before llama.cpp's MLA cache, key/value_length were the MHA ones.
            None => (
                file.usize(&k("attention.key_length"))?,
                file.usize(&k("attention.value_length"))?,
            ),
        };
        if key_len <= rope_dim {
            return Err(file.err(format!(
                "key length {key_len} must exceed the rotary dimension {rope_dim}"
            )));
        }
        let q_lora_rank = file
            .opt_usize(&k("attention.q_lora_rank"))?
            .filter(|r| *r > 0);
        if q_lora_rank.is_some() != has("blk.0.attn_q_a.weight".into()) {
            return Err(file.err(
                "attention.q_lora_rank disagrees with the presence of `blk.0.attn_q_a.weight`",
            ));
        }
        AttentionSpec::Mla {
            num_heads,
            q_lora_rank,
            kv_lora_rank: file.usize(&k("attention.kv_lora_rank"))?,
            qk_nope_head_dim: key_len - rope_dim,
            qk_rope_head_dim: rope_dim,
            v_head_dim: v_len,
            // llama.cpp rotates DeepSeek with adjacent pairs, as HF's
            // `rope_interleave = true`.
            rope_interleave: true,
            bias: has("blk.0.attn_kv_a_mqa.bias".into()),
        }
    } else {
        let head_dim = file
            .opt_usize(&k("attention.key_length"))?
            .filter(|d| *d > 0)
            .unwrap_or(hidden / num_heads.max(1));
        if let Some(v) = file.opt_usize(&k("attention.value_length"))?
            && v != head_dim
        {
            return Err(file.err(format!(
                "value length {v} differs from key length {head_dim}"
            )));
        }
        if let Some(r) = file.opt_usize(&k("rope.dimension_count"))?
            && r != head_dim
        {
            return Err(file.err(format!(
                "partial rotary embeddings (rope.dimension_count {r} < head dim {head_dim}) are not supported"
            )));
        }
        let clip = file
            .opt_f64(&k("attention.clamp_kqv"))?
            .filter(|c| *c > 0.0)
            .map(|c| c as f32);
        AttentionSpec::Gqa {
            num_heads,
            num_kv_heads,
            head_dim,
            qkv_bias: has("blk.0.attn_q.bias".into()),
            o_bias: has("blk.0.attn_output.bias".into()),
            qk_norm: match family {
                Family::Qwen3Moe => QkNorm::PerHead,
                Family::Olmoe => QkNorm::Full,
                _ => QkNorm::None,
            },
            clip_qkv: if family == Family::Olmoe { clip } else { None },
        }
    };
    if let AttentionSpec::Gqa {
        num_heads,
        num_kv_heads,
        ..
    } = &attention
        && (*num_kv_heads == 0 || num_heads % num_kv_heads != 0)
    {
        return Err(file.err(format!(
            "head_count {num_heads} is not a multiple of head_count_kv {num_kv_heads}"
        )));
    }
    if attention.rope_dim() % 2 != 0 {
        return Err(file.err(format!(
            "rotary dimension {} must be even",
            attention.rope_dim()
        )));
    }

    let moe_layers: Vec<usize> = (0..num_layers)
        .filter(|i| has(format!("blk.{i}.ffn_gate_inp.weight")))
        .collect();
    let moe = match moe_layers.first() {
        None => None,
        Some(&l0) => {
            let num_experts = file.usize(&k("expert_count"))?;
            let top_k = file.usize(&k("expert_used_count"))?;
            if top_k == 0 || top_k > num_experts {
                return Err(file.err(format!(
                    "expert_used_count {top_k} must be in 1..={num_experts}"
                )));
            }
            let gate = file.tensor(&format!("blk.{l0}.ffn_gate_exps.weight"))?;
            if gate.ne.len() != 3
                || gate.ne[0] as usize != hidden
                || gate.ne[2] as usize != num_experts
            {
                return Err(file.err(format!(
                    "tensor `blk.{l0}.ffn_gate_exps.weight` has dims {:?}, expected [{hidden}, n_ff_exp, {num_experts}]",
                    gate.ne
                )));
            }
            let inter = gate.ne[1] as usize;
            if let Some(n) = file.opt_usize(&k("expert_feed_forward_length"))?
                && n != inter
            {
                return Err(file.err(format!(
                    "expert_feed_forward_length {n} disagrees with `ffn_gate_exps` ({inter})"
                )));
            }
            let norm_key = k("expert_weights_norm");
            let router = if family == Family::DeepseekV3 {
                match file.opt_u64(&k("expert_gating_func"))? {
                    Some(2) => {}
                    g => {
                        return Err(file.err(format!(
                            "expert_gating_func {g:?}: only sigmoid (2) routing is supported for deepseek2 (softmax routing of DeepSeek-V2 is not)"
                        )));
                    }
                }
                let n_group = file.opt_usize(&k("expert_group_count"))?.unwrap_or(1);
                let topk_group = file.opt_usize(&k("expert_group_used_count"))?.unwrap_or(1);
                if n_group == 0 || num_experts % n_group != 0 || num_experts / n_group < 2 {
                    return Err(file.err(format!(
                        "expert_group_count {n_group} must divide expert_count {num_experts} into groups of at least 2"
                    )));
                }
                if topk_group == 0 || topk_group > n_group {
                    return Err(file.err(format!(
                        "expert_group_used_count {topk_group} must be in 1..={n_group}"
                    )));
                }
                RouterKind::SigmoidGrouped {
                    n_group,
                    topk_group,
                    norm_topk_prob: file.opt_bool(&norm_key)?.unwrap_or(false),
                    routed_scaling_factor: file.opt_f64(&k("expert_weights_scale"))?.unwrap_or(1.0)
                        as f32,
                }
            } else {
                // llama.cpp hard-codes the renormalisation per arch.
                let default = matches!(family, Family::Qwen3Moe | Family::Mixtral);
                RouterKind::Softmax {
                    norm_topk_prob: file.opt_bool(&norm_key)?.unwrap_or(default),
                }
            };
            let shared = match family {
                Family::Qwen2Moe | Family::DeepseekV3 => {
                    let up = format!("blk.{l0}.ffn_up_shexp.weight");
                    if file.contains(&up) {
                        let t = file.tensor(&up)?;
                        Some(SharedExpertSpec {
                            intermediate_size: t.ne.get(1).copied().unwrap_or(0) as usize,
                            gated: file.contains(&format!("blk.{l0}.ffn_gate_inp_shexp.weight")),
                        })
                    } else {
                        None
                    }
                }
                _ => None,
            };
            Some(MoeSpec {
                num_experts,
                top_k,
                intermediate_size: inter,
                router,
                shared,
            })
        }
    };

    let window = file
        .opt_usize(&k("attention.sliding_window"))?
        .filter(|w| *w > 0);
    let pattern: Option<Vec<bool>> = file
        .get(&k("attention.sliding_window_pattern"))
        .and_then(|v| v.as_array())
        .map(|a| {
            a.values
                .iter()
                .map(|v| v.as_bool().unwrap_or(false))
                .collect()
        });
    let mut layers = Vec::with_capacity(num_layers);
    for i in 0..num_layers {
        let ffn = if moe_layers.contains(&i) {
            FfnKind::Moe
        } else {
            let gate = format!("blk.{i}.ffn_gate.weight");
            if !file.contains(&gate) {
                return Err(file.err(format!(
                    "layer {i} has neither `ffn_gate_inp` (MoE) nor `ffn_gate` (dense) tensors"
                )));
            }
            let t = file.tensor(&gate)?;
            FfnKind::Dense {
                intermediate_size: t.ne.get(1).copied().unwrap_or(0) as usize,
            }
        };
        let sliding_window = match &pattern {
            Some(p) => window.filter(|_| p.get(i).copied().unwrap_or(false)),
            None => window,
        };
        layers.push(LayerSpec {
            ffn,
            sliding_window,
        });
    }

    let mut eos = Vec::new();
    for key in [
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ] {
        if let Some(id) = file.opt_u64(key)?
            && !eos.contains(&(id as u32))
        {
            eos.push(id as u32);
        }
    }
    Ok(ModelSpec {
        family,
        vocab_size,
        hidden_size: hidden,
        rms_norm_eps,
        max_position_embeddings: ctx,
        tie_word_embeddings: !file.contains("output.weight"),
        rope: rope(file, &a, family, ctx)?,
        attention,
        layers,
        moe,
        bos_token_id: file
            .opt_u64("tokenizer.ggml.bos_token_id")?
            .map(|v| v as u32),
        eos_token_ids: eos,
        fp8_block: 128,
    })
}
