//! Real geometries: the `config.json` values of released checkpoints, so a
//! synthetic model has their exact shapes, layer pattern, routing and RoPE.
//!
//! Values are the ones the checkpoints ship on the Hugging Face Hub
//! (`Qwen/Qwen3-30B-A3B`, `Qwen/Qwen3-235B-A22B`, `deepseek-ai/DeepSeek-V3`,
//! `mistralai/Mixtral-8x7B-v0.1`), without the fields colibri does not read
//! and without DeepSeek-V3's FP8 `quantization_config` (synth writes
//! f32/bf16/q8_0/q4_0, never FP8).

use serde_json::{Value, json};

/// The preset names.
pub const PRESETS: [&str; 4] = [
    "qwen3-30b-a3b",
    "qwen3-235b-a22b",
    "deepseek-v3",
    "mixtral-8x7b",
];

/// The `config.json` of preset `name`.
pub fn preset(name: &str) -> Option<Value> {
    Some(match name {
        "qwen3-30b-a3b" => json!({
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "attention_bias": false,
            "bos_token_id": 151643,
            "decoder_sparse_step": 1,
            "eos_token_id": 151645,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "max_position_embeddings": 40960,
            "max_window_layers": 48,
            "mlp_only_layers": [],
            "moe_intermediate_size": 768,
            "norm_topk_prob": true,
            "num_attention_heads": 32,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "num_hidden_layers": 48,
            "num_key_value_heads": 4,
            "rms_norm_eps": 1e-06,
            "rope_scaling": null,
            "rope_theta": 1000000.0,
            "sliding_window": null,
            "tie_word_embeddings": false,
            "torch_dtype": "bfloat16",
            "use_sliding_window": false,
            "vocab_size": 151936
        }),
        "qwen3-235b-a22b" => json!({
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "attention_bias": false,
            "bos_token_id": 151643,
            "decoder_sparse_step": 1,
            "eos_token_id": 151645,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "max_position_embeddings": 40960,
            "max_window_layers": 94,
            "mlp_only_layers": [],
            "moe_intermediate_size": 1536,
            "norm_topk_prob": true,
            "num_attention_heads": 64,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "num_hidden_layers": 94,
            "num_key_value_heads": 4,
            "rms_norm_eps": 1e-06,
            "rope_scaling": null,
            "rope_theta": 1000000.0,
            "sliding_window": null,
            "tie_word_embeddings": false,
            "torch_dtype": "bfloat16",
            "use_sliding_window": false,
            "vocab_size": 151936
        }),
        "deepseek-v3" => json!({
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "attention_bias": false,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "first_k_dense_replace": 3,
            "hidden_act": "silu",
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "kv_lora_rank": 512,
            "max_position_embeddings": 163840,
            "moe_intermediate_size": 2048,
            "moe_layer_freq": 1,
            "n_group": 8,
            "n_routed_experts": 256,
            "n_shared_experts": 1,
            "norm_topk_prob": true,
            "num_attention_heads": 128,
            "num_experts_per_tok": 8,
            "num_hidden_layers": 61,
            "num_key_value_heads": 128,
            "num_nextn_predict_layers": 1,
            "q_lora_rank": 1536,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "rms_norm_eps": 1e-06,
            "rope_scaling": {
                "beta_fast": 32,
                "beta_slow": 1,
                "factor": 40,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 4096,
                "type": "yarn"
            },
            "rope_theta": 10000,
            "routed_scaling_factor": 2.5,
            "scoring_func": "sigmoid",
            "tie_word_embeddings": false,
            "topk_group": 4,
            "topk_method": "noaux_tc",
            "torch_dtype": "bfloat16",
            "v_head_dim": 128,
            "vocab_size": 129280
        }),
        "mixtral-8x7b" => json!({
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "bos_token_id": 1,
            "eos_token_id": 2,
            "hidden_act": "silu",
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "max_position_embeddings": 32768,
            "num_attention_heads": 32,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "num_local_experts": 8,
            "rms_norm_eps": 1e-05,
            "rope_theta": 1000000.0,
            "sliding_window": null,
            "tie_word_embeddings": false,
            "torch_dtype": "bfloat16",
            "vocab_size": 32000
        }),
        _ => return None,
    })
}

/// `config` with `num_hidden_layers = layers`, keeping at least one MoE
/// layer: layer lists are cut to the new depth and DeepSeek's
/// `first_k_dense_replace` is capped at `layers - 1`.
pub fn with_layers(config: &Value, layers: usize) -> Value {
    let mut c = config.clone();
    c["num_hidden_layers"] = json!(layers);
    if let Some(k) = c.get("first_k_dense_replace").and_then(Value::as_u64) {
        c["first_k_dense_replace"] = json!(k.min(layers.saturating_sub(1) as u64));
    }
    for key in ["mlp_only_layers"] {
        if let Some(a) = c.get(key).and_then(Value::as_array) {
            let kept: Vec<Value> = a
                .iter()
                .filter(|v| v.as_u64().is_some_and(|i| (i as usize) < layers))
                .cloned()
                .collect();
            c[key] = json!(kept);
        }
    }
    if let Some(a) = c.get("layer_types").and_then(Value::as_array) {
        let kept: Vec<Value> = a.iter().take(layers).cloned().collect();
        c["layer_types"] = json!(kept);
    }
    c
}
