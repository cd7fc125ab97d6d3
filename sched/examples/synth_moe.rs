//! Writes a random-weight Qwen3-MoE checkpoint (config.json + one bf16
//! safetensors file) of a chosen geometry, to benchmark the disk path on a
//! model far larger than the test fixtures without downloading one.
//!
//! ```text
//! cargo run --release -p colibri-sched --example synth_moe -- OUT_DIR \
//!     [--hidden 1024] [--layers 8] [--experts 64] [--top-k 8] \
//!     [--moe-intermediate 768] [--vocab 1024] [--seed 1]
//! colibri bench-io --model OUT_DIR --ram-budget 0
//! ```
//!
//! The weights are uniform random bf16 values (small, so activations stay
//! finite); the text it generates is meaningless, the reads it makes are
//! those of a real model of this geometry. Tensors are written in name
//! order, as safetensors writers do, so each expert's three matrices are
//! adjacent in the file. The file is written to a temporary name and
//! renamed when complete.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;

struct Geometry {
    hidden: usize,
    layers: usize,
    experts: usize,
    top_k: usize,
    moe_intermediate: usize,
    vocab: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    seed: u64,
}

/// xorshift64*: fast, seeded, good enough for random weights.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Four bf16 values uniform in (-scale, scale).
    fn bf16x4(&mut self, scale: f32, out: &mut Vec<u8>) {
        let bits = self.next();
        for i in 0..4 {
            let u = ((bits >> (16 * i)) & 0xffff) as f32 / 65535.0;
            let v = (u * 2.0 - 1.0) * scale;
            out.extend_from_slice(&((v.to_bits() >> 16) as u16).to_le_bytes());
        }
    }
}

enum Fill {
    Random(f32),
    Ones,
}

struct Tensor {
    name: String,
    shape: Vec<usize>,
    fill: Fill,
}

fn tensors(g: &Geometry) -> Vec<Tensor> {
    let h = g.hidden;
    let scale = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
    let mut t = vec![
        Tensor {
            name: "model.embed_tokens.weight".into(),
            shape: vec![g.vocab, h],
            fill: Fill::Random(1.0),
        },
        Tensor {
            name: "model.norm.weight".into(),
            shape: vec![h],
            fill: Fill::Ones,
        },
        Tensor {
            name: "lm_head.weight".into(),
            shape: vec![g.vocab, h],
            fill: Fill::Random(scale(h)),
        },
    ];
    for l in 0..g.layers {
        let p = format!("model.layers.{l}.");
        let (q, kv) = (g.heads * g.head_dim, g.kv_heads * g.head_dim);
        for (name, shape, fill) in [
            ("input_layernorm.weight", vec![h], Fill::Ones),
            ("post_attention_layernorm.weight", vec![h], Fill::Ones),
            (
                "self_attn.q_proj.weight",
                vec![q, h],
                Fill::Random(scale(h)),
            ),
            (
                "self_attn.k_proj.weight",
                vec![kv, h],
                Fill::Random(scale(h)),
            ),
            (
                "self_attn.v_proj.weight",
                vec![kv, h],
                Fill::Random(scale(h)),
            ),
            (
                "self_attn.o_proj.weight",
                vec![h, q],
                Fill::Random(scale(q)),
            ),
            ("self_attn.q_norm.weight", vec![g.head_dim], Fill::Ones),
            ("self_attn.k_norm.weight", vec![g.head_dim], Fill::Ones),
            (
                "mlp.gate.weight",
                vec![g.experts, h],
                Fill::Random(scale(h)),
            ),
        ] {
            t.push(Tensor {
                name: format!("{p}{name}"),
                shape,
                fill,
            });
        }
        let i = g.moe_intermediate;
        for e in 0..g.experts {
            for (name, shape, fan_in) in [
                ("gate_proj", vec![i, h], h),
                ("up_proj", vec![i, h], h),
                ("down_proj", vec![h, i], i),
            ] {
                t.push(Tensor {
                    name: format!("{p}mlp.experts.{e}.{name}.weight"),
                    shape,
                    fill: Fill::Random(scale(fan_in)),
                });
            }
        }
    }
    t.sort_by(|a, b| a.name.cmp(&b.name));
    t
}

fn config(g: &Geometry) -> String {
    format!(
        r#"{{
  "architectures": ["Qwen3MoeForCausalLM"],
  "model_type": "qwen3_moe",
  "attention_bias": false,
  "bos_token_id": 1,
  "eos_token_id": 2,
  "decoder_sparse_step": 1,
  "mlp_only_layers": [],
  "dtype": "bfloat16",
  "head_dim": {head_dim},
  "hidden_act": "silu",
  "hidden_size": {hidden},
  "intermediate_size": {dense},
  "max_position_embeddings": 4096,
  "moe_intermediate_size": {moe},
  "norm_topk_prob": true,
  "num_attention_heads": {heads},
  "num_experts": {experts},
  "num_experts_per_tok": {top_k},
  "num_hidden_layers": {layers},
  "num_key_value_heads": {kv_heads},
  "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0,
  "tie_word_embeddings": false,
  "vocab_size": {vocab}
}}
"#,
        head_dim = g.head_dim,
        hidden = g.hidden,
        dense = g.moe_intermediate * 4,
        moe = g.moe_intermediate,
        heads = g.heads,
        experts = g.experts,
        top_k = g.top_k,
        layers = g.layers,
        kv_heads = g.kv_heads,
        vocab = g.vocab,
    )
}

fn parse_args() -> Result<(PathBuf, Geometry), String> {
    let mut args = std::env::args().skip(1);
    let out = PathBuf::from(
        args.next()
            .ok_or("usage: synth_moe OUT_DIR [--hidden N] ...")?,
    );
    let mut g = Geometry {
        hidden: 1024,
        layers: 8,
        experts: 64,
        top_k: 8,
        moe_intermediate: 768,
        vocab: 1024,
        heads: 8,
        kv_heads: 2,
        head_dim: 128,
        seed: 1,
    };
    while let Some(flag) = args.next() {
        let value = args.next().ok_or(format!("{flag} needs a value"))?;
        let n: u64 = value
            .parse()
            .map_err(|_| format!("{flag}: `{value}` is not a number"))?;
        let n_usize = usize::try_from(n).map_err(|_| format!("{flag}: too large"))?;
        match flag.as_str() {
            "--hidden" => g.hidden = n_usize,
            "--layers" => g.layers = n_usize,
            "--experts" => g.experts = n_usize,
            "--top-k" => g.top_k = n_usize,
            "--moe-intermediate" => g.moe_intermediate = n_usize,
            "--vocab" => g.vocab = n_usize,
            "--seed" => g.seed = n.max(1),
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok((out, g))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (out, g) = parse_args()?;
    std::fs::create_dir_all(&out)?;
    let list = tensors(&g);
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for t in &list {
        let bytes = t.shape.iter().product::<usize>() * 2;
        header.insert(
            t.name.clone(),
            serde_json::json!({
                "dtype": "BF16",
                "shape": t.shape,
                "data_offsets": [offset, offset + bytes],
            }),
        );
        offset += bytes;
    }
    let mut text = serde_json::to_string(&header)?;
    while !(8 + text.len()).is_multiple_of(64) {
        text.push(' ');
    }
    let path = out.join("model.safetensors");
    let tmp = out.join(".model.safetensors.partial");
    let mut w = BufWriter::with_capacity(8 << 20, File::create(&tmp)?);
    w.write_all(&(text.len() as u64).to_le_bytes())?;
    w.write_all(text.as_bytes())?;
    let mut rng = Rng(g.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let mut buf = Vec::with_capacity(8 << 20);
    for t in &list {
        let n: usize = t.shape.iter().product();
        let mut left = n;
        while left > 0 {
            buf.clear();
            let chunk = left.min(4 << 20);
            match t.fill {
                Fill::Ones => {
                    for _ in 0..chunk {
                        buf.extend_from_slice(&0x3f80u16.to_le_bytes());
                    }
                }
                Fill::Random(scale) => {
                    for _ in 0..chunk.div_ceil(4) {
                        rng.bf16x4(scale, &mut buf);
                    }
                    buf.truncate(chunk * 2);
                }
            }
            w.write_all(&buf)?;
            left -= chunk;
        }
    }
    let file = w.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()?;
    std::fs::rename(&tmp, &path)?;
    std::fs::write(out.join("config.json"), config(&g))?;
    let expert_bytes = 3 * g.hidden * g.moe_intermediate * 2;
    eprintln!(
        "{}: {:.2} GiB, {} routed experts of {:.2} MiB, {:.1} MiB of experts per token",
        path.display(),
        (8 + text.len() + offset) as f64 / (1u64 << 30) as f64,
        g.layers * g.experts,
        expert_bytes as f64 / (1 << 20) as f64,
        (g.layers * g.top_k * expert_bytes) as f64 / (1 << 20) as f64
    );
    Ok(())
}
