//! A Hugging Face `config.json` turned into a [`ModelSpec`]: the
//! architecture as data. The five supported families differ in a handful of
//! pieces (attention kind, q/k norms, router, shared experts, tensor names);
//! everything else is one engine.
//!
//! Both config spellings are accepted: the Hub's (`rope_theta`,
//! `rope_scaling`, `num_experts`) and the one transformers 5 writes
//! (`rope_parameters`, `num_local_experts`).

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{ModelError, Result};

/// The model families colibri runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Qwen3Moe,
    Qwen2Moe,
    Mixtral,
    Olmoe,
    DeepseekV3,
}

impl Family {
    pub fn from_model_type(t: &str) -> Result<Family> {
        Ok(match t {
            "qwen3_moe" => Family::Qwen3Moe,
            "qwen2_moe" => Family::Qwen2Moe,
            "mixtral" => Family::Mixtral,
            "olmoe" => Family::Olmoe,
            // Kimi K2 ships model_type "kimi_k2" with the DeepSeek-V3 layout.
            "deepseek_v3" | "kimi_k2" => Family::DeepseekV3,
            other => return Err(ModelError::UnsupportedArchitecture(other.to_string())),
        })
    }

    pub fn model_type(self) -> &'static str {
        match self {
            Family::Qwen3Moe => "qwen3_moe",
            Family::Qwen2Moe => "qwen2_moe",
            Family::Mixtral => "mixtral",
            Family::Olmoe => "olmoe",
            Family::DeepseekV3 => "deepseek_v3",
        }
    }
}

/// Where q/k RMS norms apply in grouped-query attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// Qwen3: one norm of `head_dim` applied to every head.
    PerHead,
    /// OLMoE: one norm over the whole q (resp. k) projection.
    Full,
}

#[derive(Clone, Debug, PartialEq)]
pub enum AttentionSpec {
    /// Multi-head / grouped-query attention.
    Gqa {
        num_heads: usize,
        num_kv_heads: usize,
        head_dim: usize,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: QkNorm,
        /// OLMoE's clamp of q, k, v (applied after the q/k norms).
        clip_qkv: Option<f32>,
    },
    /// DeepSeek multi-head latent attention.
    Mla {
        num_heads: usize,
        q_lora_rank: Option<usize>,
        kv_lora_rank: usize,
        qk_nope_head_dim: usize,
        qk_rope_head_dim: usize,
        v_head_dim: usize,
        /// Rotary pairs are (x0,x1),(x2,x3)… instead of halves.
        rope_interleave: bool,
        bias: bool,
    },
}

impl AttentionSpec {
    pub fn num_heads(&self) -> usize {
        match self {
            AttentionSpec::Gqa { num_heads, .. } | AttentionSpec::Mla { num_heads, .. } => {
                *num_heads
            }
        }
    }

    /// Width of the rotary part of a head.
    pub fn rope_dim(&self) -> usize {
        match self {
            AttentionSpec::Gqa { head_dim, .. } => *head_dim,
            AttentionSpec::Mla {
                qk_rope_head_dim, ..
            } => *qk_rope_head_dim,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    Linear {
        factor: f64,
    },
    Yarn {
        factor: f64,
        original_max_position_embeddings: f64,
        beta_fast: f64,
        beta_slow: f64,
        mscale: Option<f64>,
        mscale_all_dim: Option<f64>,
        attention_factor: Option<f64>,
        truncate: bool,
    },
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct RopeSpec {
    pub theta: f64,
    pub scaling: RopeScaling,
}

#[derive(Clone, Debug, PartialEq)]
pub enum RouterKind {
    /// Softmax over all experts, top-k, optionally renormalised.
    Softmax { norm_topk_prob: bool },
    /// DeepSeek-V3: sigmoid scores, a per-expert selection bias, top-k
    /// within the best `topk_group` of `n_group` groups, scaled weights.
    SigmoidGrouped {
        n_group: usize,
        topk_group: usize,
        norm_topk_prob: bool,
        routed_scaling_factor: f32,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct SharedExpertSpec {
    pub intermediate_size: usize,
    /// Qwen2-MoE: the shared expert's output is scaled by
    /// `sigmoid(shared_expert_gate · x)`.
    pub gated: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct MoeSpec {
    pub num_experts: usize,
    pub top_k: usize,
    pub intermediate_size: usize,
    pub router: RouterKind,
    pub shared: Option<SharedExpertSpec>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum FfnKind {
    Dense { intermediate_size: usize },
    Moe,
}

#[derive(Clone, Debug, PartialEq)]
pub struct LayerSpec {
    pub ffn: FfnKind,
    /// Keys older than this many positions are masked (Mistral-style).
    pub sliding_window: Option<usize>,
}

/// The architecture of one checkpoint, as data.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSpec {
    pub family: Family,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub rms_norm_eps: f32,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub attention: AttentionSpec,
    pub rope: RopeSpec,
    pub layers: Vec<LayerSpec>,
    pub moe: Option<MoeSpec>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// FP8 block size from `quantization_config.weight_block_size`.
    pub fp8_block: usize,
}

struct Cfg<'a> {
    map: &'a Map<String, Value>,
}

impl<'a> Cfg<'a> {
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?
            .ok_or_else(|| ModelError::Config(format!("missing required field `{key}`")))
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_u64().map(|n| Some(n as usize)).ok_or_else(|| {
                ModelError::Config(format!("`{key}` must be a non-negative integer, got {v}"))
            }),
        }
    }

    fn usize_or(&self, key: &str, default: usize) -> Result<usize> {
        Ok(self.opt_usize(key)?.unwrap_or(default))
    }

    fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| ModelError::Config(format!("`{key}` must be a number, got {v}"))),
        }
    }

    fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| {
                ModelError::Config(format!("`{key}` must be true or false, got {v}"))
            }),
        }
    }

    fn usize_list(&self, key: &str) -> Result<Vec<usize>> {
        match self.get(key) {
            None => Ok(vec![]),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.as_u64().map(|n| n as usize).ok_or_else(|| {
                        ModelError::Config(format!("`{key}` must hold integers, got {v}"))
                    })
                })
                .collect(),
            Some(v) => Err(ModelError::Config(format!(
                "`{key}` must be a list, got {v}"
            ))),
        }
    }

    /// An id or a list of ids (eos_token_id is either).
    fn ids(&self, key: &str) -> Result<Vec<u32>> {
        match self.get(key) {
            None => Ok(vec![]),
            Some(Value::Array(_)) => Ok(self
                .usize_list(key)?
                .into_iter()
                .map(|n| n as u32)
                .collect()),
            Some(_) => Ok(vec![self.usize(key)? as u32]),
        }
    }
}

fn parse_rope(cfg: &Cfg, max_pos: usize) -> Result<RopeSpec> {
    // transformers 5 writes `rope_parameters`; Hub configs carry
    // `rope_theta` plus an optional `rope_scaling` dict.
    let params = cfg
        .get("rope_parameters")
        .or_else(|| cfg.get("rope_scaling"))
        .and_then(Value::as_object);
    let empty = Map::new();
    let p = Cfg {
        map: params.unwrap_or(&empty),
    };
    let theta = match p.get("rope_theta") {
        Some(_) => p.f64_or("rope_theta", 10000.0)?,
        None => cfg.f64_or("rope_theta", 10000.0)?,
    };
    let kind = p
        .get("rope_type")
        .or_else(|| p.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    if p.get("partial_rotary_factor").is_some() || cfg.get("partial_rotary_factor").is_some() {
        return Err(ModelError::Config(
            "partial_rotary_factor is not supported".into(),
        ));
    }
    let orig = |p: &Cfg| -> Result<f64> {
        // As transformers: a top-level original_max_position_embeddings wins,
        // else the rope dict's, else max_position_embeddings.
        match cfg.get("original_max_position_embeddings") {
            Some(_) => cfg.f64_or("original_max_position_embeddings", max_pos as f64),
            None => p.f64_or("original_max_position_embeddings", max_pos as f64),
        }
    };
    let scaling = match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: p.f64_or("factor", 1.0)?,
        },
        "yarn" => {
            let o = orig(&p)?;
            let factor = match p.get("factor") {
                Some(_) => p.f64_or("factor", 1.0)?,
                None => max_pos as f64 / o,
            };
            let opt = |k: &str| -> Result<Option<f64>> {
                match p.get(k) {
                    None => Ok(None),
                    Some(_) => p.f64_or(k, 0.0).map(Some),
                }
            };
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: o,
                // transformers: `get("beta_fast") or 32`, so 0 means default.
                beta_fast: opt("beta_fast")?.filter(|v| *v != 0.0).unwrap_or(32.0),
                beta_slow: opt("beta_slow")?.filter(|v| *v != 0.0).unwrap_or(1.0),
                mscale: opt("mscale")?,
                mscale_all_dim: opt("mscale_all_dim")?,
                attention_factor: opt("attention_factor")?,
                truncate: p.bool_or("truncate", true)?,
            }
        }
        "llama3" => RopeScaling::Llama3 {
            factor: p.f64_or("factor", 8.0)?,
            low_freq_factor: p.f64_or("low_freq_factor", 1.0)?,
            high_freq_factor: p.f64_or("high_freq_factor", 4.0)?,
            original_max_position_embeddings: orig(&p)?,
        },
        other => {
            return Err(ModelError::Config(format!(
                "rope type `{other}` is not supported (supported: default, linear, yarn, llama3)"
            )));
        }
    };
    Ok(RopeSpec { theta, scaling })
}

impl ModelSpec {
    /// Reads `config.json` (and `generation_config.json` for extra EOS ids)
    /// from a checkpoint directory.
    pub fn from_dir(dir: &Path) -> Result<ModelSpec> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
        let value: Value = serde_json::from_str(&text).map_err(|e| ModelError::Json {
            path: path.clone(),
            source: e,
        })?;
        let gen_path = dir.join("generation_config.json");
        let gen_cfg = match std::fs::read_to_string(&gen_path) {
            Ok(text) => Some(serde_json::from_str(&text).map_err(|e| ModelError::Json {
                path: gen_path.clone(),
                source: e,
            })?),
            Err(_) => None,
        };
        ModelSpec::from_parts(&value, gen_cfg.as_ref())
    }

    /// The spec from a parsed `config.json` and, when there is one,
    /// `generation_config.json` (which may add EOS ids).
    pub fn from_parts(config: &Value, generation: Option<&Value>) -> Result<ModelSpec> {
        let mut spec = ModelSpec::from_json(config)?;
        if let Some(map) = generation.and_then(Value::as_object) {
            for id in (Cfg { map }).ids("eos_token_id")? {
                if !spec.eos_token_ids.contains(&id) {
                    spec.eos_token_ids.push(id);
                }
            }
        }
        Ok(spec)
    }

    pub fn from_json(value: &Value) -> Result<ModelSpec> {
        let map = value
            .as_object()
            .ok_or_else(|| ModelError::Config("top level must be an object".into()))?;
        let cfg = Cfg { map };
        let model_type = cfg
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| ModelError::Config("missing `model_type`".into()))?;
        let family = Family::from_model_type(model_type)?;

        let act = cfg
            .get("hidden_act")
            .and_then(Value::as_str)
            .unwrap_or("silu");
        if act != "silu" {
            return Err(ModelError::Config(format!(
                "hidden_act `{act}` is not supported (supported: silu)"
            )));
        }

        let hidden_size = cfg.usize("hidden_size")?;
        let num_layers = cfg.usize("num_hidden_layers")?;
        let num_heads = cfg.usize("num_attention_heads")?;
        let max_pos = cfg.usize_or("max_position_embeddings", 4096)?;
        let rms_norm_eps = cfg.f64_or(
            "rms_norm_eps",
            if matches!(family, Family::Mixtral | Family::Olmoe) {
                1e-5
            } else {
                1e-6
            },
        )? as f32;

        let attention = match family {
            Family::DeepseekV3 => AttentionSpec::Mla {
                num_heads,
                q_lora_rank: cfg.opt_usize("q_lora_rank")?,
                kv_lora_rank: cfg.usize("kv_lora_rank")?,
                qk_nope_head_dim: cfg.usize("qk_nope_head_dim")?,
                qk_rope_head_dim: cfg.usize("qk_rope_head_dim")?,
                v_head_dim: cfg.usize("v_head_dim")?,
                rope_interleave: cfg.bool_or("rope_interleave", true)?,
                bias: cfg.bool_or("attention_bias", false)?,
            },
            _ => {
                let head_dim = match cfg.opt_usize("head_dim")? {
                    Some(d) if d > 0 => d,
                    _ => hidden_size / num_heads,
                };
                let bias_flag = match family {
                    Family::Qwen2Moe => cfg.bool_or("qkv_bias", true)?,
                    _ => cfg.bool_or("attention_bias", false)?,
                };
                AttentionSpec::Gqa {
                    num_heads,
                    num_kv_heads: cfg.usize_or("num_key_value_heads", num_heads)?,
                    head_dim,
                    qkv_bias: bias_flag,
                    // Qwen2-MoE biases q/k/v only; Qwen3/OLMoE bias o too.
                    o_bias: bias_flag && family != Family::Qwen2Moe,
                    qk_norm: match family {
                        Family::Qwen3Moe => QkNorm::PerHead,
                        Family::Olmoe => QkNorm::Full,
                        _ => QkNorm::None,
                    },
                    clip_qkv: match family {
                        Family::Olmoe => cfg
                            .get("clip_qkv")
                            .and_then(Value::as_f64)
                            .map(|v| v as f32),
                        _ => None,
                    },
                }
            }
        };
        if let AttentionSpec::Gqa {
            num_heads,
            num_kv_heads,
            ..
        } = &attention
            && (*num_kv_heads == 0 || num_heads % num_kv_heads != 0)
        {
            return Err(ModelError::Config(format!(
                "num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}"
            )));
        }
        if attention.rope_dim() % 2 != 0 {
            return Err(ModelError::Config(format!(
                "rotary dimension {} must be even",
                attention.rope_dim()
            )));
        }

        let rope = parse_rope(&cfg, max_pos)?;

        let num_experts = match family {
            Family::DeepseekV3 => cfg.opt_usize("n_routed_experts")?,
            Family::Mixtral => cfg.opt_usize("num_local_experts")?,
            _ => match cfg.opt_usize("num_experts")? {
                Some(n) => Some(n),
                None => cfg.opt_usize("num_local_experts")?,
            },
        }
        .unwrap_or(0);
        let top_k = cfg.usize_or("num_experts_per_tok", 2)?;
        let intermediate = cfg.opt_usize("intermediate_size")?;
        let moe_intermediate = match family {
            Family::Mixtral | Family::Olmoe => intermediate,
            _ => cfg.opt_usize("moe_intermediate_size")?,
        };

        let moe = if num_experts > 0 {
            let router = match family {
                Family::DeepseekV3 => {
                    let n_group = cfg.usize_or("n_group", 1)?;
                    let topk_group = cfg.usize_or("topk_group", 1)?;
                    if n_group == 0 || num_experts % n_group != 0 || num_experts / n_group < 2 {
                        return Err(ModelError::Config(format!(
                            "n_group {n_group} must divide n_routed_experts {num_experts} into groups of at least 2"
                        )));
                    }
                    if topk_group == 0 || topk_group > n_group {
                        return Err(ModelError::Config(format!(
                            "topk_group {topk_group} must be in 1..={n_group}"
                        )));
                    }
                    let scoring = cfg
                        .get("scoring_func")
                        .and_then(Value::as_str)
                        .unwrap_or("sigmoid");
                    if scoring != "sigmoid" {
                        return Err(ModelError::Config(format!(
                            "scoring_func `{scoring}` is not supported for deepseek_v3 (supported: sigmoid)"
                        )));
                    }
                    RouterKind::SigmoidGrouped {
                        n_group,
                        topk_group,
                        norm_topk_prob: cfg.bool_or("norm_topk_prob", true)?,
                        routed_scaling_factor: cfg.f64_or("routed_scaling_factor", 1.0)? as f32,
                    }
                }
                Family::Mixtral => RouterKind::Softmax {
                    norm_topk_prob: true,
                },
                _ => RouterKind::Softmax {
                    norm_topk_prob: cfg.bool_or("norm_topk_prob", false)?,
                },
            };
            let moe_i = moe_intermediate
                .ok_or_else(|| ModelError::Config("missing `moe_intermediate_size`".into()))?;
            let shared = match family {
                Family::Qwen2Moe => match cfg.usize_or("shared_expert_intermediate_size", 0)? {
                    0 => None,
                    n => Some(SharedExpertSpec {
                        intermediate_size: n,
                        gated: true,
                    }),
                },
                Family::DeepseekV3 => match cfg.usize_or("n_shared_experts", 0)? {
                    0 => None,
                    n => Some(SharedExpertSpec {
                        intermediate_size: moe_i * n,
                        gated: false,
                    }),
                },
                _ => None,
            };
            if top_k == 0 || top_k > num_experts {
                return Err(ModelError::Config(format!(
                    "num_experts_per_tok {top_k} must be in 1..={num_experts}"
                )));
            }
            Some(MoeSpec {
                num_experts,
                top_k,
                intermediate_size: moe_i,
                router,
                shared,
            })
        } else {
            None
        };

        let dense_ffn = |what: &str| -> Result<FfnKind> {
            Ok(FfnKind::Dense {
                intermediate_size: intermediate.ok_or_else(|| {
                    ModelError::Config(format!("missing `intermediate_size` ({what})"))
                })?,
            })
        };
        let mlp_only = cfg.usize_list("mlp_only_layers")?;
        let sparse_step = cfg.usize_or("decoder_sparse_step", 1)?.max(1);
        let first_dense = cfg.usize_or("first_k_dense_replace", 0)?;
        let layer_types: Option<Vec<String>> =
            cfg.get("layer_types").and_then(Value::as_array).map(|a| {
                a.iter()
                    .map(|v| v.as_str().unwrap_or("full_attention").to_string())
                    .collect()
            });
        let use_sliding = cfg.bool_or("use_sliding_window", false)?;
        let sliding = cfg.opt_usize("sliding_window")?.filter(|w| *w > 0);
        let mut layers = Vec::with_capacity(num_layers);
        for i in 0..num_layers {
            let is_moe = moe.is_some()
                && match family {
                    Family::Qwen3Moe | Family::Qwen2Moe => {
                        !mlp_only.contains(&i) && (i + 1) % sparse_step == 0
                    }
                    Family::DeepseekV3 => i >= first_dense,
                    Family::Mixtral | Family::Olmoe => true,
                };
            let ffn = if is_moe {
                FfnKind::Moe
            } else {
                dense_ffn("dense layer")?
            };
            let sliding_window = match family {
                Family::Mixtral => sliding,
                // Qwen2/3: only when use_sliding_window, and (Qwen2) only on
                // layers marked sliding_attention.
                Family::Qwen3Moe if use_sliding => sliding,
                Family::Qwen2Moe if use_sliding => match &layer_types {
                    Some(t) if t.get(i).map(String::as_str) == Some("sliding_attention") => sliding,
                    Some(_) => None,
                    None => {
                        let max_window_layers = cfg.usize_or("max_window_layers", 28)?;
                        if (i + 1) % 2 == 1 && i < max_window_layers {
                            sliding
                        } else {
                            None
                        }
                    }
                },
                _ => None,
            };
            layers.push(LayerSpec {
                ffn,
                sliding_window,
            });
        }

        let fp8_block = match cfg.get("quantization_config").and_then(Value::as_object) {
            None => 128,
            Some(q) => {
                let qc = Cfg { map: q };
                let method = qc.get("quant_method").and_then(Value::as_str).unwrap_or("");
                if method != "fp8" {
                    return Err(ModelError::Config(format!(
                        "quantization_config.quant_method `{method}` is not supported (supported: fp8 block-scaled)"
                    )));
                }
                let b = qc.usize_list("weight_block_size")?;
                match b.as_slice() {
                    [r, c] if r == c && *r > 0 => *r,
                    [] => 128,
                    other => {
                        return Err(ModelError::Config(format!(
                            "weight_block_size {other:?} is not supported (square blocks only)"
                        )));
                    }
                }
            }
        };

        Ok(ModelSpec {
            family,
            vocab_size: cfg.usize("vocab_size")?,
            hidden_size,
            rms_norm_eps,
            max_position_embeddings: max_pos,
            tie_word_embeddings: cfg.bool_or("tie_word_embeddings", false)?,
            attention,
            rope,
            layers,
            moe,
            bos_token_id: cfg.opt_usize("bos_token_id")?.map(|v| v as u32),
            eos_token_ids: cfg.ids("eos_token_id")?,
            fp8_block,
        })
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Bytes of the CPU tier's KV cache (f32) that one token at position
    /// `pos` reads over every layer: the keys and values (MLA: latents and
    /// rotary keys) of positions `0..=pos`, a sliding layer's last
    /// `window` of them.
    pub fn kv_bytes_read_at(&self, pos: usize) -> u64 {
        let per_position = 4 * match &self.attention {
            AttentionSpec::Gqa {
                num_kv_heads,
                head_dim,
                ..
            } => 2 * num_kv_heads * head_dim,
            AttentionSpec::Mla {
                kv_lora_rank,
                qk_rope_head_dim,
                ..
            } => kv_lora_rank + qk_rope_head_dim,
        } as u64;
        self.layers
            .iter()
            .map(|l| l.sliding_window.map_or(pos + 1, |w| (pos + 1).min(w)) as u64)
            .sum::<u64>()
            * per_position
    }
}
