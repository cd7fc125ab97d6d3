#!/usr/bin/env python3
"""Build the model fixtures colibri is tested against.

For every supported architecture this writes a tiny random checkpoint,
saved by `transformers` itself (FP8 variants are written the way DeepSeek
ships them: e4m3 weights with 128x128 `weight_scale_inv` block scales), and
`reference.json` with what transformers computes in float32:

- `tokens` and `nll`: teacher-forced negative log-likelihood of every
  predicted position of a random token sequence;
- `prompt` and `greedy`: a greedy continuation decoded with the KV cache,
  with the end-of-sequence token masked as transformers' `min_new_tokens`
  (and `colibri run --ignore-eos`) do (`eos_masked`), and the smallest
  top-1/top-2 logit margin seen (`min_margin`), so a test failure can never
  be blamed on a near-tie.

Weights are drawn wider than transformers' default init (and norms, biases
and DeepSeek's selection bias are randomised) so that every code path
matters and greedy choices are clear.

Usage: python tools/make_fixtures.py [OUT_DIR] [--only NAME ...]
Needs torch and transformers (tested with transformers 5.17).
"""

import argparse
import json
import math
import os
import shutil
import sys

import torch
import transformers
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    MixtralConfig,
    OlmoeConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

VOCAB = 256
PROMPT_LEN = 8
GREEDY_LEN = 32
NLL_LEN = 48
MIN_MARGIN = 2e-3


def fixtures():
    """name -> (config, options)."""
    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=None, tie_word_embeddings=False)
    return {
        # Qwen3: per-head q/k norm, head_dim != hidden/heads, one dense
        # layer via mlp_only_layers, renormalised top-k.
        "qwen3_moe": (
            Qwen3MoeConfig(
                hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_experts=8,
                num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=256,
                rope_theta=10000.0, **common),
            dict(std=0.25),
        ),
        # The same architecture stored in bf16 and split over several shards.
        "qwen3_moe_bf16_sharded": (
            Qwen3MoeConfig(
                hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=1, head_dim=16, num_experts=8,
                num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=1, max_position_embeddings=256,
                rope_theta=1000000.0, **common),
            dict(std=0.25, dtype=torch.bfloat16, shard="60KB"),
        ),
        # Qwen2-MoE: q/k/v biases, gated shared expert, a dense layer from
        # decoder_sparse_step=2.
        "qwen2_moe": (
            Qwen2MoeConfig(
                hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                shared_expert_intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                decoder_sparse_step=2, max_position_embeddings=256, **common),
            dict(std=0.25),
        ),
        # Mixtral: renormalised softmax top-2, a sliding window short enough
        # to matter inside the test sequences, sharded.
        "mixtral": (
            MixtralConfig(
                hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, sliding_window=12,
                max_position_embeddings=256, rope_theta=1000000.0, **common),
            dict(std=0.25, shard="100KB"),
        ),
        # OLMoE: q/k norm over the full projections and clip_qkv low enough
        # to clip.
        "olmoe": (
            OlmoeConfig(
                hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                clip_qkv=1.5, max_position_embeddings=256, **common),
            dict(std=0.25, expect_clip=1.5),
        ),
        # DeepSeek-V3: MLA with q LoRA, YaRN with mscale/mscale_all_dim,
        # sigmoid group-limited routing with a selection bias, scaling
        # factor, a shared expert, one dense first layer.
        "deepseek_v3": (
            DeepseekV3Config(
                hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16, num_experts_per_tok=3,
                n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=256,
                rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                              "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8},
                **common),
            dict(std=0.25),
        ),
        # DeepSeek-V3 as the real checkpoints ship it: FP8-e4m3 weights with
        # 128x128 block scales (several blocks per matrix, ragged edges), no
        # q LoRA (V2-Lite style), plain RoPE.
        "deepseek_v3_fp8": (
            DeepseekV3Config(
                hidden_size=160, intermediate_size=192, moe_intermediate_size=136, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                n_group=2, topk_group=1, n_shared_experts=2, routed_scaling_factor=1.5, norm_topk_prob=True,
                first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=64, qk_nope_head_dim=32,
                qk_rope_head_dim=16, v_head_dim=32, max_position_embeddings=256, **common),
            dict(std=0.08, fp8=True),
        ),
    }


def randomise(model, std, gen):
    """Wider weights than the default init, and random norms/biases."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(std * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))


def fp8_quantize(w, block=128):
    """Block-quantize an f32 matrix to e4m3 the way DeepSeek's weights are:
    returns (e4m3 tensor, f32 scales [ceil(r/b), ceil(c/b)], dequantized f32)."""
    rows, cols = w.shape
    gr, gc = math.ceil(rows / block), math.ceil(cols / block)
    scales = torch.empty(gr, gc, dtype=torch.float32)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    deq = torch.empty(rows, cols, dtype=torch.float32)
    for i in range(gr):
        for j in range(gc):
            blk = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            s = blk.abs().max().clamp(min=1e-12) / 448.0
            qb = (blk / s).to(torch.float8_e4m3fn)
            scales[i, j] = s
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = qb
            deq[i * block:(i + 1) * block, j * block:(j + 1) * block] = qb.to(torch.float32) * s
    return q, scales, deq


FP8_SKIP = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "e_score_correction_bias")


def save_fp8(model, out):
    """Write `model` the way DeepSeek ships its weights (every projection as
    e4m3 with 128x128 `weight_scale_inv` block scales, Hub tensor names) and
    return a float32 model holding exactly the dequantized values."""
    import tempfile
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)  # Hub layout: one tensor per expert projection
        state = {}
        for f in sorted(os.listdir(tmp)):
            if f.endswith(".safetensors"):
                state.update(load_file(os.path.join(tmp, f)))
        tensors, deq_state = {}, {}
        for name, p in state.items():
            if p.dim() == 2 and not any(s in name for s in FP8_SKIP):
                q, s, deq = fp8_quantize(p.float())
                tensors[name] = q.contiguous()
                tensors[name + "_scale_inv"] = s.contiguous()
                deq_state[name] = deq
            else:
                tensors[name] = p.contiguous()
                deq_state[name] = p
        os.makedirs(out, exist_ok=True)
        save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        save_file(deq_state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        deq_model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    model.config.save_pretrained(out)
    with open(os.path.join(out, "config.json")) as f:
        c = json.load(f)
    c["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    return deq_model


@torch.no_grad()
def reference(model, gen, eos):
    tokens = torch.randint(3, VOCAB, (NLL_LEN,), generator=gen)
    logits = model(tokens[None]).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    nll = [-logp[i, tokens[i + 1]].item() for i in range(NLL_LEN - 1)]

    prompt = tokens[:PROMPT_LEN].tolist()
    out = model(torch.tensor([prompt]), use_cache=True)
    past = out.past_key_values
    last = out.logits[0, -1].float()
    greedy, margins = [], []
    for _ in range(GREEDY_LEN):
        last[eos] = float("-inf")
        top = torch.topk(last, 2).values
        margins.append((top[0] - top[1]).item())
        nxt = int(torch.argmax(last))
        greedy.append(nxt)
        out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        last = out.logits[0, -1].float()
    # The cached decode must agree with a full recompute (sanity of the oracle).
    full = model(torch.tensor([prompt + greedy[:-1]])).logits[0].float()
    full[:, eos] = float("-inf")
    assert full[PROMPT_LEN - 1:].argmax(-1).tolist() == greedy, "cache/no-cache disagree"
    return {
        "tokens": tokens.tolist(),
        "nll": nll,
        "prompt": prompt,
        "greedy": greedy,
        "eos_masked": [eos],
        "min_margin": min(margins),
    }


def count_clipped(model, clip):
    """How many q/k/v activations the clip actually changes (the fixture
    must exercise it)."""
    hits = []

    def hook(mod, inp, outp):
        hits.append(int((outp.abs() > clip).sum()))

    hs = [m.register_forward_hook(hook) for n, m in model.named_modules() if n.endswith(("q_norm", "k_norm", "v_proj"))]
    return hs, hits


def build(name, cfg, opts, root, refs_only=False):
    """Builds one fixture. With `refs_only`, rebuilds the model from the
    seed recorded in its reference.json (the weights come out identical:
    checked by reproducing the recorded NLL exactly) and rewrites only
    reference.json, leaving the weight files (and fixtures derived from
    them, such as the GGUF ones) untouched."""
    out = os.path.join(root, name)
    old = None
    if refs_only:
        with open(os.path.join(out, "reference.json")) as f:
            old = json.load(f)
        seeds = [old["seed"] - 1000]
    else:
        shutil.rmtree(out, ignore_errors=True)
        seeds = range(100)
    for seed in seeds:
        gen = torch.Generator().manual_seed(1000 + seed)
        torch.manual_seed(1000 + seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        randomise(model, opts["std"], gen)
        dtype = opts.get("dtype")
        if dtype is not None:
            # Round the weights (parameters only: buffers such as RoPE's
            # inv_freq stay float32, as they do when transformers loads a
            # bf16 checkpoint for float32 compute) to the stored dtype; the
            # float32 model then computes with exactly the stored values.
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(p.to(dtype).to(torch.float32))
        if opts.get("fp8"):
            if refs_only:
                import tempfile
                with tempfile.TemporaryDirectory() as scratch:
                    model = save_fp8(model, scratch)
            else:
                model = save_fp8(model, out)
        hooks, hits = ([], [])
        if opts.get("expect_clip"):
            hooks, hits = count_clipped(model, opts["expect_clip"])
        ref = reference(model, gen, cfg.eos_token_id)
        if old is not None and ref["nll"] != old["nll"]:
            raise SystemExit(f"{name}: rebuilt weights differ from the saved ones (NLL changed)")
        for h in hooks:
            h.remove()
        if opts.get("expect_clip") and sum(hits) == 0:
            raise SystemExit(f"{name}: clip_qkv never clips; raise std")
        if ref["min_margin"] < MIN_MARGIN:
            if refs_only:
                raise SystemExit(f"{name}: near-tie ({ref['min_margin']:.2e}) with the saved weights")
            print(f"  {name}: seed {seed} has a near-tie ({ref['min_margin']:.2e}), retrying")
            shutil.rmtree(out, ignore_errors=True)
            continue
        if not opts.get("fp8") and not refs_only:
            save_model = model.to(dtype) if dtype is not None else model
            kw = {"max_shard_size": opts["shard"]} if "shard" in opts else {}
            save_model.save_pretrained(out, **kw)
        ref["model_type"] = cfg.model_type
        ref["transformers_version"] = transformers.__version__
        ref["torch_version"] = torch.__version__
        ref["seed"] = 1000 + seed
        if opts.get("expect_clip"):
            ref["clipped_activations"] = sum(hits)
        with open(os.path.join(out, "reference.json"), "w") as f:
            json.dump(ref, f, indent=1)
        files = sorted(os.listdir(out))
        size = sum(os.path.getsize(os.path.join(out, f)) for f in files)
        print(f"{name}: seed {1000 + seed}, min margin {ref['min_margin']:.3f}, "
              f"mean nll {sum(ref['nll']) / len(ref['nll']):.3f}, {size / 1e6:.2f} MB, {files}")
        return
    raise SystemExit(f"{name}: no seed without near-ties")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "models"))
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--refs-only", action="store_true", help="rewrite reference.json only, keep the weights")
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    for name, (cfg, opts) in fixtures().items():
        if args.only and name not in args.only:
            continue
        build(name, cfg, opts, args.out, args.refs_only)


if __name__ == "__main__":
    sys.exit(main())
