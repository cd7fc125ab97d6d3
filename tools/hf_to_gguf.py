#!/usr/bin/env python3
"""Convert colibri's transformers fixtures to GGUF, the way llama.cpp's
convert_hf_to_gguf.py lays them out, with the PyPI `gguf` package's
GGUFWriter (llama.cpp's own writer) and quantizers.

What the converter does, and this script does likewise (written from the
converter's behaviour, not its code):

- architecture names: qwen3_moe -> qwen3moe, qwen2_moe -> qwen2moe,
  mixtral -> llama (with expert_count), olmoe -> olmoe,
  deepseek_v3 -> deepseek2;
- tensor names: token_embd, output_norm, output, blk.N.{attn_norm,
  attn_q, attn_k, attn_v, attn_output, attn_q_norm, attn_k_norm, ffn_norm,
  ffn_gate_inp, ffn_{gate,up,down}_exps (experts stacked [n_expert, ...]),
  ffn_{gate,up,down}_shexp, ffn_gate_inp_shexp, exp_probs_b.bias,
  ffn_{gate,up,down} (dense layers), attn_q_a, attn_q_a_norm, attn_q_b,
  attn_kv_a_mqa, attn_kv_a_norm, attn_k_b, attn_v_b};
- `llama`: q_proj/k_proj rows permuted per head from HF's halves layout to
  llama.cpp's adjacent-pair RoPE layout;
- `deepseek2`: kv_b_proj split into attn_k_b (k rows, transposed per head)
  and attn_v_b; head_count_kv = 1; key/value_length describe the MLA cache
  (kv_lora_rank + rope, kv_lora_rank), key/value_length_mla the heads;
  yarn_log_multiplier = 0.1 * mscale_all_dim;
- 1-D tensors and the router (ffn_gate_inp) stay F32; quantized types apply
  to the other weights whose rows are whole 32-element blocks (others stay
  F32 here, where llama.cpp would fall back to F16).

Where transformers computes something llama.cpp's converter does not
record, this script writes the standard key so the GGUF computes what
transformers computes (colibri honours these keys):
`{arch}.expert_weights_norm` when norm_topk_prob differs from llama.cpp's
per-arch default, `llama.attention.sliding_window` (Mixtral),
`olmoe.attention.clamp_kqv` (clip_qkv), `deepseek2.expert_gating_func`
(sigmoid, which transformers' DeepSeek-V3 always uses), and
`deepseek2.rope.scaling.yarn_attn_factor` when mscale != mscale_all_dim.

For quantized and 16-bit outputs it also writes `<out>.dequant.json`:
per tensor, the FNV-1a 64 hash of gguf's numpy dequantization (float32,
little-endian), the oracle colibri's dequantization is checked against.

Usage: python tools/hf_to_gguf.py FIXTURE_DIR OUT.gguf [--type f32|f16|bf16|q8_0|q4_0]
"""

import argparse
import json
import math
import os
import sys

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama", "olmoe": "olmoe",
        "deepseek_v3": "deepseek2"}
QTYPE = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
         "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0,
         "q4_0": gguf.GGMLQuantizationType.Q4_0}


def fnv1a64(b: bytes) -> str:
    h = 0xcbf29ce484222325
    for x in b:
        h = ((h ^ x) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def load_state(d):
    state = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            for k, v in load_file(os.path.join(d, f)).items():
                state[k] = v.float().numpy()
    return state


def rope_params(cfg):
    p = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    p.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return p


def byte_vocab(n):
    """A byte-level (GPT-2 style) vocabulary of the fixture's n tokens."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[i] for i in range(min(n, 256))] + [f"[PAD{i}]" for i in range(256, n)]


def llama_permute(w, n_head):
    """convert_hf_to_gguf's q/k permutation: halves -> adjacent pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensors(cfg, state):
    """(gguf name, float32 array in HF/numpy order) in converter order."""
    mt = cfg["model_type"]
    L = cfg["num_hidden_layers"]
    out = [("token_embd.weight", state["model.embed_tokens.weight"])]
    for i in range(L):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        a = p + "self_attn."
        out.append((b + "attn_norm.weight", state[p + "input_layernorm.weight"]))
        if mt == "deepseek_v3":
            if cfg.get("q_lora_rank"):
                out += [(b + "attn_q_a.weight", state[a + "q_a_proj.weight"]),
                        (b + "attn_q_a_norm.weight", state[a + "q_a_layernorm.weight"]),
                        (b + "attn_q_b.weight", state[a + "q_b_proj.weight"])]
            else:
                out.append((b + "attn_q.weight", state[a + "q_proj.weight"]))
            out += [(b + "attn_kv_a_mqa.weight", state[a + "kv_a_proj_with_mqa.weight"]),
                    (b + "attn_kv_a_norm.weight", state[a + "kv_a_layernorm.weight"])]
            H, dn, dv = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
            kv_b = state[a + "kv_b_proj.weight"].reshape(H, dn + dv, -1)
            out += [(b + "attn_k_b.weight", np.ascontiguousarray(kv_b[:, :dn, :].transpose(0, 2, 1))),
                    (b + "attn_v_b.weight", np.ascontiguousarray(kv_b[:, dn:, :]))]
            out.append((b + "attn_output.weight", state[a + "o_proj.weight"]))
        else:
            q, k = state[a + "q_proj.weight"], state[a + "k_proj.weight"]
            qb, kb = state.get(a + "q_proj.bias"), state.get(a + "k_proj.bias")
            if mt == "mixtral":
                nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
                q, k = llama_permute(q, nh), llama_permute(k, nkv)
                qb = None if qb is None else llama_permute(qb, nh)
                kb = None if kb is None else llama_permute(kb, nkv)
            out += [(b + "attn_q.weight", q), (b + "attn_k.weight", k), (b + "attn_v.weight", state[a + "v_proj.weight"])]
            for n, t in (("attn_q.bias", qb), ("attn_k.bias", kb), ("attn_v.bias", state.get(a + "v_proj.bias"))):
                if t is not None:
                    out.append((b + n, t))
            out.append((b + "attn_output.weight", state[a + "o_proj.weight"]))
            if a + "o_proj.bias" in state:
                out.append((b + "attn_output.bias", state[a + "o_proj.bias"]))
            if a + "q_norm.weight" in state:
                out += [(b + "attn_q_norm.weight", state[a + "q_norm.weight"]),
                        (b + "attn_k_norm.weight", state[a + "k_norm.weight"])]
        out.append((b + "ffn_norm.weight", state[p + "post_attention_layernorm.weight"]))
        m = p + ("block_sparse_moe." if mt == "mixtral" else "mlp.")
        if m + "gate.weight" in state:
            out.append((b + "ffn_gate_inp.weight", state[m + "gate.weight"]))
            if m + "gate.e_score_correction_bias" in state:
                out.append((b + "exp_probs_b.bias", state[m + "gate.e_score_correction_bias"]))
            n = sum(1 for key in state if key.startswith(m + "experts.") and key.endswith(
                ("w1.weight", "gate_proj.weight")))
            names = ("w1", "w3", "w2") if mt == "mixtral" else ("gate_proj", "up_proj", "down_proj")
            for gname, hname in zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), names):
                out.append((b + gname + ".weight", np.stack([state[f"{m}experts.{e}.{hname}.weight"] for e in range(n)])))
            for sh in ("shared_expert.", "shared_experts."):
                if m + sh + "gate_proj.weight" in state:
                    for gname, hname in (("ffn_gate_shexp", "gate_proj"), ("ffn_up_shexp", "up_proj"), ("ffn_down_shexp", "down_proj")):
                        out.append((b + gname + ".weight", state[m + sh + hname + ".weight"]))
            if m + "shared_expert_gate.weight" in state:
                out.append((b + "ffn_gate_inp_shexp.weight", state[m + "shared_expert_gate.weight"]))
        else:
            for gname, hname in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")):
                out.append((b + gname + ".weight", state[m + hname + ".weight"]))
    out.append(("output_norm.weight", state["model.norm.weight"]))
    if "lm_head.weight" in state:
        out.append(("output.weight", state["lm_head.weight"]))
    return out


def metadata(w, cfg, gen, arch):
    mt = cfg["model_type"]
    rp = rope_params(cfg)
    w.add_name(f"colibri fixture {mt}")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    if "intermediate_size" in cfg:
        w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_rope_freq_base(rp["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-5 if mt == "olmoe" else 1e-6))
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    n_exp = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    w.add_expert_count(n_exp)
    if mt == "deepseek_v3":
        kv, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
        w.add_head_count_kv(1)
        w.add_vocab_size(cfg["vocab_size"])
        w.add_leading_dense_block_count(cfg.get("first_k_dense_replace", 0))
        if cfg.get("q_lora_rank"):
            w.add_q_lora_rank(cfg["q_lora_rank"])
        w.add_kv_lora_rank(kv)
        w.add_key_length(kv + rope)
        w.add_value_length(kv)
        w.add_key_length_mla(cfg["qk_nope_head_dim"] + rope)
        w.add_value_length_mla(cfg["v_head_dim"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_count(cfg.get("n_shared_experts", 0))
        w.add_expert_weights_scale(cfg.get("routed_scaling_factor", 1.0))
        if cfg.get("norm_topk_prob"):
            w.add_expert_weights_norm(True)
        w.add_expert_group_count(cfg.get("n_group", 1))
        w.add_expert_group_used_count(cfg.get("topk_group", 1))
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_rope_dimension_count(rope)
        if rp.get("rope_type", rp.get("type")) == "yarn":
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(rp["factor"])
            w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
            for k, f in (("beta_fast", w.add_rope_scaling_yarn_beta_fast), ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
                if rp.get(k) is not None:
                    f(rp[k])
            ms, msa = rp.get("mscale"), rp.get("mscale_all_dim")
            if msa is not None:
                w.add_rope_scaling_yarn_log_mul(0.1 * msa)
            if ms and msa and ms != msa:
                # transformers' attention factor; llama.cpp assumes it is 1.
                f = rp["factor"]
                af = (0.1 * ms * math.log(f) + 1.0) / (0.1 * msa * math.log(f) + 1.0)
                w.add_rope_scaling_yarn_attn_factor(af)
    else:
        w.add_head_count_kv(cfg.get("num_key_value_heads", cfg["num_attention_heads"]))
        hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        if cfg.get("head_dim"):
            w.add_key_length(hd)
            w.add_value_length(hd)
        if mt == "mixtral":
            w.add_vocab_size(cfg["vocab_size"])
            w.add_rope_dimension_count(hd)
            if cfg.get("sliding_window"):
                w.add_sliding_window(cfg["sliding_window"])
        if mt in ("qwen2_moe", "qwen3_moe"):
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
            if cfg.get("shared_expert_intermediate_size"):
                w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
        if mt == "olmoe" and cfg.get("clip_qkv"):
            w.add_clamp_kqv(cfg["clip_qkv"])
        default_norm = mt in ("qwen3_moe", "mixtral")
        norm = True if mt == "mixtral" else bool(cfg.get("norm_topk_prob", False))
        if norm != default_norm:
            w.add_expert_weights_norm(norm)
    # A byte-level vocabulary and a ChatML template, so the tokenizer keys
    # are exercised (the fixtures' token ids are random).
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    toks = byte_vocab(cfg["vocab_size"])
    w.add_token_list(toks)
    w.add_token_types([gguf.TokenType.CONTROL if i in (1, 2) else gguf.TokenType.NORMAL for i in range(len(toks))])
    if cfg.get("bos_token_id") is not None:
        w.add_bos_token_id(cfg["bos_token_id"])
    eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
    if isinstance(eos, list):
        eos = eos[0]
    if eos is not None:
        w.add_eos_token_id(eos)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--type", default="f32", choices=list(QTYPE))
    args = ap.parse_args()
    with open(os.path.join(args.src, "config.json")) as f:
        cfg = json.load(f)
    gen = {}
    gp = os.path.join(args.src, "generation_config.json")
    if os.path.exists(gp):
        with open(gp) as f:
            gen = json.load(f)
    arch = ARCH[cfg["model_type"]]
    state = load_state(args.src)
    qtype = QTYPE[args.type]
    w = gguf.GGUFWriter(args.out, arch)
    metadata(w, cfg, gen, arch)
    w.add_file_type({"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7, "q4_0": 2}[args.type])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    hashes = {}
    for name, t in tensors(cfg, state):
        t = np.ascontiguousarray(t.astype(np.float32))
        keep_f32 = t.ndim == 1 or "ffn_gate_inp" in name or name.endswith(".bias")
        ty = qtype
        if keep_f32 or (ty in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0) and t.shape[-1] % 32):
            ty = gguf.GGMLQuantizationType.F32
        if ty == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, t)
        else:
            q = gguf.quants.quantize(t, ty)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=ty)
            deq = gguf.quants.dequantize(q, ty).astype("<f4")
            hashes[name] = {"type": ty.name, "fnv1a64": fnv1a64(deq.tobytes())}
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if hashes:
        with open(args.out + ".dequant.json", "w") as f:
            json.dump(hashes, f, indent=1, sort_keys=True)
    print(f"{args.out}: {os.path.getsize(args.out) / 1e3:.0f} kB, {len(hashes)} tensors {args.type}")


if __name__ == "__main__":
    sys.exit(main())
