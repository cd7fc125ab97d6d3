//! The bundled demo model: a tiny Qwen3-MoE with **random weights** and a
//! byte-level tokenizer made by colibri, so `colibri serve` works on a fresh
//! machine with nothing downloaded. It produces noise, not language: it is
//! for trying the API and the tools, and says so wherever it is named.
//!
//! The files are generated deterministically (fixed seed), so every machine
//! gets the same demo model.

use std::collections::BTreeMap;
use std::path::Path;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;

use crate::error::{ModelError, Result};

/// The name the demo model is served under.
pub const DEMO_MODEL_NAME: &str = "colibri-demo-random";
/// Bump when the generated files change.
pub const DEMO_VERSION: u32 = 1;

const HIDDEN: usize = 64;
const LAYERS: usize = 4;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 16;
const EXPERTS: usize = 8;
const TOP_K: usize = 2;
const MOE_INTER: usize = 64;
const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
const VOCAB: usize = 256 + SPECIALS.len();

const CHAT_TEMPLATE: &str = "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}{%- if message['content'] is string %}{{ message['content'] }}{%- else %}{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{{ part['text'] }}{%- endif %}{%- endfor %}{%- endif %}{{ '<|im_end|>\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}";

/// GPT-2's reversible map from bytes to printable characters, which
/// byte-level BPE vocabularies are written in.
fn byte_to_unicode() -> Vec<char> {
    let mut printable: Vec<u32> = (33..=126).chain(161..=172).chain(174..=255).collect();
    let mut chars: Vec<u32> = printable.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            printable.push(b);
            chars.push(256 + n);
            n += 1;
        }
    }
    let mut map = vec!['\0'; 256];
    for (b, c) in printable.iter().zip(chars) {
        map[*b as usize] = char::from_u32(c).unwrap_or('?');
    }
    map
}

fn tokenizer_json() -> serde_json::Value {
    let vocab: BTreeMap<String, usize> = byte_to_unicode()
        .into_iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), i))
        .collect();
    let added: Vec<_> = SPECIALS
        .iter()
        .enumerate()
        .map(|(i, s)| {
            json!({"id": 256 + i, "content": s, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": true})
        })
        .collect();
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": []}
    })
}

fn config_json() -> serde_json::Value {
    json!({
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "_colibri_note": "colibri demo model: RANDOM WEIGHTS, produces noise, for trying the tools only",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "moe_intermediate_size": MOE_INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "num_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "norm_topk_prob": true,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": false,
        "bos_token_id": null,
        "eos_token_id": 258,
        "torch_dtype": "float32"
    })
}

/// A standard normal draw (Box–Muller).
fn normal(rng: &mut ChaCha8Rng) -> f32 {
    let u1: f64 = rng.random::<f64>().max(1e-12);
    let u2: f64 = rng.random();
    ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
}

fn weights() -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut rng = ChaCha8Rng::seed_from_u64(0xC011_B121);
    let mut t = Vec::new();
    let mut add = |name: String, shape: Vec<usize>, std: f32, mean: f32, rng: &mut ChaCha8Rng| {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| mean + std * normal(rng)).collect();
        t.push((name, shape, v));
    };
    add(
        "model.embed_tokens.weight".into(),
        vec![VOCAB, HIDDEN],
        0.5,
        0.0,
        &mut rng,
    );
    for l in 0..LAYERS {
        let p = format!("model.layers.{l}.");
        add(
            format!("{p}input_layernorm.weight"),
            vec![HIDDEN],
            0.1,
            1.0,
            &mut rng,
        );
        add(
            format!("{p}post_attention_layernorm.weight"),
            vec![HIDDEN],
            0.1,
            1.0,
            &mut rng,
        );
        add(
            format!("{p}self_attn.q_proj.weight"),
            vec![HEADS * HEAD_DIM, HIDDEN],
            0.15,
            0.0,
            &mut rng,
        );
        add(
            format!("{p}self_attn.k_proj.weight"),
            vec![KV_HEADS * HEAD_DIM, HIDDEN],
            0.15,
            0.0,
            &mut rng,
        );
        add(
            format!("{p}self_attn.v_proj.weight"),
            vec![KV_HEADS * HEAD_DIM, HIDDEN],
            0.15,
            0.0,
            &mut rng,
        );
        add(
            format!("{p}self_attn.o_proj.weight"),
            vec![HIDDEN, HEADS * HEAD_DIM],
            0.15,
            0.0,
            &mut rng,
        );
        add(
            format!("{p}self_attn.q_norm.weight"),
            vec![HEAD_DIM],
            0.1,
            1.0,
            &mut rng,
        );
        add(
            format!("{p}self_attn.k_norm.weight"),
            vec![HEAD_DIM],
            0.1,
            1.0,
            &mut rng,
        );
        add(
            format!("{p}mlp.gate.weight"),
            vec![EXPERTS, HIDDEN],
            0.3,
            0.0,
            &mut rng,
        );
        for e in 0..EXPERTS {
            let q = format!("{p}mlp.experts.{e}.");
            add(
                format!("{q}gate_proj.weight"),
                vec![MOE_INTER, HIDDEN],
                0.15,
                0.0,
                &mut rng,
            );
            add(
                format!("{q}up_proj.weight"),
                vec![MOE_INTER, HIDDEN],
                0.15,
                0.0,
                &mut rng,
            );
            add(
                format!("{q}down_proj.weight"),
                vec![HIDDEN, MOE_INTER],
                0.15,
                0.0,
                &mut rng,
            );
        }
    }
    add("model.norm.weight".into(), vec![HIDDEN], 0.1, 1.0, &mut rng);
    add(
        "lm_head.weight".into(),
        vec![VOCAB, HIDDEN],
        0.4,
        0.0,
        &mut rng,
    );
    // Keep the noise mostly printable: the rows of bytes that are not
    // printable ASCII are damped, so they are rarely drawn.
    if let Some((_, _, lm)) = t.last_mut() {
        for b in 0..VOCAB {
            let printable = (0x20..0x7f).contains(&b) || b == b'\n' as usize;
            if !printable && b < 256 {
                lm[b * HIDDEN..(b + 1) * HIDDEN]
                    .iter_mut()
                    .for_each(|v| *v *= 0.05);
            }
        }
    }
    t
}

/// Writes the demo model into `dir` (created if needed), atomically: files
/// go to a temporary sibling directory that is renamed into place.
pub fn write_demo_model(dir: &Path) -> Result<()> {
    let parent = dir.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| ModelError::io(parent, e))?;
    let tmp = parent.join(format!(
        ".{}.tmp-{}",
        dir.file_name().and_then(|s| s.to_str()).unwrap_or("demo"),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| ModelError::io(&tmp, e))?;
    let write_json = |name: &str, v: &serde_json::Value| -> Result<()> {
        let p = tmp.join(name);
        let text =
            serde_json::to_string_pretty(v).map_err(|e| ModelError::Invalid(e.to_string()))?;
        std::fs::write(&p, text).map_err(|e| ModelError::io(&p, e))
    };
    write_json("config.json", &config_json())?;
    write_json("tokenizer.json", &tokenizer_json())?;
    write_json(
        "tokenizer_config.json",
        &json!({
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "bos_token": null,
            "chat_template": CHAT_TEMPLATE,
            "model_max_length": 4096,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": false
        }),
    )?;
    let tensors = weights();
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(n, s, v)| (n, s, v.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bytes
        .iter()
        .map(|(n, s, b)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| ModelError::Invalid(format!("demo tensor {n}: {e}")))
        })
        .collect::<Result<_>>()?;
    let st = tmp.join("model.safetensors");
    safetensors::serialize_to_file(views, None, &st).map_err(|e| ModelError::Safetensors {
        file: st.clone(),
        reason: e.to_string(),
    })?;
    let _ = std::fs::remove_dir_all(dir);
    std::fs::rename(&tmp, dir).map_err(|e| ModelError::io(dir, e))
}

/// The demo model's directory under `cache_root`, written on first use.
pub fn ensure_demo_model(cache_root: &Path) -> Result<std::path::PathBuf> {
    let dir = cache_root.join(format!("demo-v{DEMO_VERSION}"));
    if !dir.join("model.safetensors").is_file() {
        write_demo_model(&dir)?;
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_map_is_a_bijection() {
        let m = byte_to_unicode();
        let set: std::collections::HashSet<char> = m.iter().copied().collect();
        assert_eq!(set.len(), 256);
        assert_eq!(m[b'A' as usize], 'A');
        assert_eq!(m[b' ' as usize], 'Ġ');
    }

    #[test]
    fn demo_model_loads_runs_and_is_deterministic() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        write_demo_model(&a.path().join("m")).unwrap();
        write_demo_model(&b.path().join("m")).unwrap();
        let fa = std::fs::read(a.path().join("m/model.safetensors")).unwrap();
        let fb = std::fs::read(b.path().join("m/model.safetensors")).unwrap();
        assert_eq!(fa, fb);
        let (model, ck) = crate::Model::load(&a.path().join("m")).unwrap();
        let experts = crate::ResidentExperts::load(&model.spec, &ck).unwrap();
        let pool = crate::Pool::new(1).unwrap();
        let mut cache = crate::KvCache::new(&model.spec, 64);
        let toks: Vec<u32> = b"Hello".iter().map(|&b| b as u32).collect();
        let out = model
            .forward(
                &pool,
                &experts,
                &mut [crate::SeqInput {
                    cache: &mut cache,
                    tokens: &toks,
                    logits: crate::Logits::Last,
                }],
            )
            .unwrap();
        assert_eq!(out[0].len(), VOCAB);
        assert!(out[0].iter().all(|v| v.is_finite()));
        let spread = out[0].iter().copied().fold(f32::MIN, f32::max)
            - out[0].iter().copied().fold(f32::MAX, f32::min);
        assert!(spread > 1.0, "logits should not be flat: {spread}");
    }
}
