//! The architecture a packed store records: the source's own
//! `config.json` (and `generation_config.json`) when it has them, or a
//! `config.json` rebuilt from the [`ModelSpec`] (GGUF sources), such that
//! [`ModelSpec::from_json`] gives the same spec back.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value, json};

use crate::config::{AttentionSpec, Family, FfnKind, ModelSpec, QkNorm, RopeScaling, RouterKind};
use crate::error::{ModelError, Result};

/// Tokenizer files copied into a store when the source has them.
pub const TOKENIZER_FILES: [&str; 9] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
];

/// The tokenizer files present in a checkpoint directory.
pub fn tokenizer_files(dir: &Path) -> Vec<PathBuf> {
    TOKENIZER_FILES
        .iter()
        .map(|n| dir.join(n))
        .filter(|p| p.is_file())
        .collect()
}

/// Reads `dir/name` as JSON, `None` when absent.
pub fn read_json(dir: &Path, name: &str) -> Result<Option<Value>> {
    let p = dir.join(name);
    match std::fs::read_to_string(&p) {
        Ok(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| ModelError::Json { path: p, source: e }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(ModelError::io(&p, e)),
    }
}

/// An f32 as the shortest decimal that rounds to it (1e-6, not
/// 9.99999997e-7), as config files write it.
fn decimal(v: f32) -> Value {
    let d: f64 = format!("{v}").parse().unwrap_or(v as f64);
    json!(d)
}

fn cannot(what: String) -> ModelError {
    ModelError::Config(format!(
        "this model cannot be described by a config.json colibri reads: {what}"
    ))
}

/// A `config.json` for `spec`.
pub fn config_json(spec: &ModelSpec) -> Result<Value> {
    let f = spec.family;
    let mut c = Map::new();
    let mut put = |k: &str, v: Value| {
        c.insert(k.to_string(), v);
    };
    let class = match f {
        Family::Qwen3Moe => "Qwen3MoeForCausalLM",
        Family::Qwen2Moe => "Qwen2MoeForCausalLM",
        Family::Mixtral => "MixtralForCausalLM",
        Family::Olmoe => "OlmoeForCausalLM",
        Family::DeepseekV3 => "DeepseekV3ForCausalLM",
    };
    put("architectures", json!([class]));
    put("model_type", json!(f.model_type()));
    put("hidden_act", json!("silu"));
    put("vocab_size", json!(spec.vocab_size));
    put("hidden_size", json!(spec.hidden_size));
    put("num_hidden_layers", json!(spec.num_layers()));
    put("rms_norm_eps", decimal(spec.rms_norm_eps));
    put(
        "max_position_embeddings",
        json!(spec.max_position_embeddings),
    );
    put("tie_word_embeddings", json!(spec.tie_word_embeddings));
    put("bos_token_id", json!(spec.bos_token_id));
    put(
        "eos_token_id",
        match spec.eos_token_ids.as_slice() {
            [] => Value::Null,
            [one] => json!(one),
            many => json!(many),
        },
    );
    put("rope_theta", json!(spec.rope.theta));
    put(
        "rope_scaling",
        match &spec.rope.scaling {
            RopeScaling::None => Value::Null,
            RopeScaling::Linear { factor } => json!({"rope_type": "linear", "factor": factor}),
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                mscale,
                mscale_all_dim,
                attention_factor,
                truncate,
            } => {
                let mut y = json!({
                    "rope_type": "yarn",
                    "factor": factor,
                    "original_max_position_embeddings": original_max_position_embeddings,
                    "beta_fast": beta_fast,
                    "beta_slow": beta_slow,
                    "truncate": truncate,
                });
                for (k, v) in [
                    ("mscale", mscale),
                    ("mscale_all_dim", mscale_all_dim),
                    ("attention_factor", attention_factor),
                ] {
                    if let Some(v) = v {
                        y[k] = json!(v);
                    }
                }
                y
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => json!({
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor,
                "original_max_position_embeddings": original_max_position_embeddings,
            }),
        },
    );
    if spec.fp8_block != 128 {
        put(
            "quantization_config",
            json!({"quant_method": "fp8", "weight_block_size": [spec.fp8_block, spec.fp8_block]}),
        );
    }
    match &spec.attention {
        AttentionSpec::Gqa {
            num_heads,
            num_kv_heads,
            head_dim,
            qkv_bias,
            o_bias,
            qk_norm,
            clip_qkv,
        } => {
            put("num_attention_heads", json!(num_heads));
            put("num_key_value_heads", json!(num_kv_heads));
            put("head_dim", json!(head_dim));
            if f == Family::Qwen2Moe {
                if *o_bias {
                    return Err(cannot("Qwen2-MoE with an o_proj bias".into()));
                }
                put("qkv_bias", json!(qkv_bias));
            } else {
                if qkv_bias != o_bias {
                    return Err(cannot("q/k/v and o biases that differ".into()));
                }
                put("attention_bias", json!(qkv_bias));
            }
            let implied = match f {
                Family::Qwen3Moe => QkNorm::PerHead,
                Family::Olmoe => QkNorm::Full,
                _ => QkNorm::None,
            };
            if *qk_norm != implied {
                return Err(cannot(format!(
                    "q/k norms {qk_norm:?} in a {} model",
                    f.model_type()
                )));
            }
            match (f, clip_qkv) {
                (Family::Olmoe, c) => put("clip_qkv", c.map_or(Value::Null, decimal)),
                (_, Some(_)) => return Err(cannot("clip_qkv outside OLMoE".into())),
                _ => {}
            }
        }
        AttentionSpec::Mla {
            num_heads,
            q_lora_rank,
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
            rope_interleave,
            bias,
        } => {
            if f != Family::DeepseekV3 {
                return Err(cannot("MLA outside DeepSeek-V3".into()));
            }
            put("num_attention_heads", json!(num_heads));
            put("num_key_value_heads", json!(num_heads));
            put("q_lora_rank", json!(q_lora_rank));
            put("kv_lora_rank", json!(kv_lora_rank));
            put("qk_nope_head_dim", json!(qk_nope_head_dim));
            put("qk_rope_head_dim", json!(qk_rope_head_dim));
            put("v_head_dim", json!(v_head_dim));
            put("rope_interleave", json!(rope_interleave));
            put("attention_bias", json!(bias));
        }
    }

    let dense: Vec<(usize, usize)> = spec
        .layers
        .iter()
        .enumerate()
        .filter_map(|(i, l)| match l.ffn {
            FfnKind::Dense { intermediate_size } => Some((i, intermediate_size)),
            FfnKind::Moe => None,
        })
        .collect();
    if let Some(&(_, inter)) = dense.first() {
        if dense.iter().any(|&(_, n)| n != inter) {
            return Err(cannot("dense layers of different widths".into()));
        }
        if matches!(f, Family::Mixtral | Family::Olmoe) {
            return Err(cannot(format!(
                "dense layers in a {} model",
                f.model_type()
            )));
        }
        put("intermediate_size", json!(inter));
    }
    let dense_ids: Vec<usize> = dense.iter().map(|d| d.0).collect();
    match f {
        Family::Qwen3Moe | Family::Qwen2Moe => {
            put("mlp_only_layers", json!(dense_ids));
            put("decoder_sparse_step", json!(1));
        }
        Family::DeepseekV3 => {
            if dense_ids.iter().enumerate().any(|(k, &i)| k != i) {
                return Err(cannot("dense layers that are not the first ones".into()));
            }
            put("first_k_dense_replace", json!(dense_ids.len()));
        }
        Family::Mixtral | Family::Olmoe => {}
    }

    match &spec.moe {
        None => put(
            match f {
                Family::DeepseekV3 => "n_routed_experts",
                Family::Mixtral => "num_local_experts",
                _ => "num_experts",
            },
            json!(0),
        ),
        Some(moe) => {
            let experts_key = match f {
                Family::DeepseekV3 => "n_routed_experts",
                Family::Mixtral => "num_local_experts",
                _ => "num_experts",
            };
            put(experts_key, json!(moe.num_experts));
            put("num_experts_per_tok", json!(moe.top_k));
            match f {
                Family::Mixtral | Family::Olmoe => {
                    put("intermediate_size", json!(moe.intermediate_size))
                }
                _ => put("moe_intermediate_size", json!(moe.intermediate_size)),
            }
            match (&moe.router, f) {
                (RouterKind::Softmax { norm_topk_prob }, Family::Mixtral) => {
                    if !norm_topk_prob {
                        return Err(cannot("Mixtral without top-k renormalisation".into()));
                    }
                }
                (
                    RouterKind::Softmax { norm_topk_prob },
                    Family::Qwen3Moe | Family::Qwen2Moe | Family::Olmoe,
                ) => {
                    put("norm_topk_prob", json!(norm_topk_prob));
                }
                (
                    RouterKind::SigmoidGrouped {
                        n_group,
                        topk_group,
                        norm_topk_prob,
                        routed_scaling_factor,
                    },
                    Family::DeepseekV3,
                ) => {
                    put("n_group", json!(n_group));
                    put("topk_group", json!(topk_group));
                    put("norm_topk_prob", json!(norm_topk_prob));
                    put("routed_scaling_factor", decimal(*routed_scaling_factor));
                    put("scoring_func", json!("sigmoid"));
                }
                (r, _) => {
                    return Err(cannot(format!(
                        "router {r:?} in a {} model",
                        f.model_type()
                    )));
                }
            }
            match (&moe.shared, f) {
                (None, Family::Qwen2Moe) => put("shared_expert_intermediate_size", json!(0)),
                (None, Family::DeepseekV3) => put("n_shared_experts", json!(0)),
                (None, _) => {}
                (Some(s), Family::Qwen2Moe) if s.gated => put(
                    "shared_expert_intermediate_size",
                    json!(s.intermediate_size),
                ),
                (Some(s), Family::DeepseekV3)
                    if !s.gated
                        && moe.intermediate_size > 0
                        && s.intermediate_size.is_multiple_of(moe.intermediate_size) =>
                {
                    put(
                        "n_shared_experts",
                        json!(s.intermediate_size / moe.intermediate_size),
                    )
                }
                (Some(s), _) => {
                    return Err(cannot(format!(
                        "shared expert {s:?} in a {} model",
                        f.model_type()
                    )));
                }
            }
        }
    }

    let windows: Vec<Option<usize>> = spec.layers.iter().map(|l| l.sliding_window).collect();
    let window = windows.iter().flatten().next().copied();
    if windows.iter().flatten().any(|&w| Some(w) != window) {
        return Err(cannot("sliding windows of different sizes".into()));
    }
    match (f, window) {
        (_, None) => {}
        (Family::Mixtral, Some(w)) if windows.iter().all(Option::is_some) => {
            put("sliding_window", json!(w))
        }
        (Family::Qwen3Moe, Some(w)) if windows.iter().all(Option::is_some) => {
            put("use_sliding_window", json!(true));
            put("sliding_window", json!(w));
        }
        (Family::Qwen2Moe, Some(w)) => {
            put("use_sliding_window", json!(true));
            put("sliding_window", json!(w));
            let types: Vec<&str> = windows
                .iter()
                .map(|w| {
                    if w.is_some() {
                        "sliding_attention"
                    } else {
                        "full_attention"
                    }
                })
                .collect();
            put("layer_types", json!(types));
        }
        _ => return Err(cannot("this pattern of sliding-window layers".into())),
    }
    Ok(Value::Object(c))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_fixture_config_round_trips() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models");
        for entry in std::fs::read_dir(&root).unwrap() {
            let dir = entry.unwrap().path();
            let spec = ModelSpec::from_dir(&dir).unwrap();
            let back = ModelSpec::from_json(&config_json(&spec).unwrap()).unwrap();
            assert_eq!(back, spec, "{}", dir.display());
        }
    }
}
