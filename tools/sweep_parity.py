#!/usr/bin/env python3
"""Randomised parity sweep: many random configurations of every supported
architecture, saved by transformers in float32 without tokenizer files,
checked through the `colibri` CLI exactly as a user would run it:

    colibri perplexity --model DIR --token-file F --json --per-token
    colibri run --model DIR --prompt-tokens IDS --max-tokens N --ignore-eos --json

Per-position NLL must be within 1e-4 relative of transformers and greedy
continuations identical (steps whose top-2 logit margin is below 1e-4 in
transformers are reported as near-ties rather than failures).

Usage: python tools/sweep_parity.py --colibri target/release/colibri [--n 20] [--seed 0] [--default-init]
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

import torch
from transformers import (AutoModelForCausalLM, DeepseekV3Config, MixtralConfig, OlmoeConfig, Qwen2MoeConfig,
                          Qwen3MoeConfig)


def rope(rng, max_pos):
    kind = rng.choice(["default", "default", "yarn", "linear"])
    if kind == "default":
        return {"rope_theta": rng.choice([10000.0, 1e6])}
    if kind == "linear":
        return {"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": rng.choice([2.0, 4.0])}}
    sc = {"type": "yarn", "factor": rng.choice([2.0, 4.0, 8.0]), "original_max_position_embeddings": max_pos // 4}
    if rng.random() < 0.5:
        sc.update(mscale=rng.choice([0.707, 1.0]), mscale_all_dim=rng.choice([0.707, 1.0]))
    return {"rope_theta": 10000.0, "rope_scaling": sc}


def random_config(rng, family):
    H = rng.choice([32, 48, 64, 96])
    heads = rng.choice([2, 4, 8])
    kv = rng.choice([h for h in [1, 2, 4, 8] if heads % h == 0])
    L = rng.choice([1, 2, 3, 4])
    E = rng.choice([4, 8, 16])
    k = rng.choice([1, 2, 3, 4])
    k = min(k, E)
    common = dict(vocab_size=rng.choice([97, 256, 300]), hidden_size=H, num_hidden_layers=L,
                  num_attention_heads=heads, max_position_embeddings=256,
                  tie_word_embeddings=rng.random() < 0.3, bos_token_id=1, eos_token_id=2, pad_token_id=None)
    common.update(rope(rng, 256))
    if family == "qwen3_moe":
        step = rng.choice([1, 1, 2])
        return Qwen3MoeConfig(num_key_value_heads=kv, head_dim=rng.choice([8, 16, 24]), intermediate_size=rng.choice([40, 64]),
                              moe_intermediate_size=rng.choice([16, 24]), num_experts=E, num_experts_per_tok=k,
                              norm_topk_prob=rng.random() < 0.5, decoder_sparse_step=step,
                              mlp_only_layers=[i for i in range(L) if rng.random() < 0.25],
                              attention_bias=rng.random() < 0.3, use_sliding_window=rng.random() < 0.3,
                              sliding_window=rng.choice([4, 9]), **common)
    if family == "qwen2_moe":
        return Qwen2MoeConfig(num_key_value_heads=kv, intermediate_size=rng.choice([40, 64]),
                              moe_intermediate_size=rng.choice([16, 24]),
                              shared_expert_intermediate_size=rng.choice([16, 32]), num_experts=E,
                              num_experts_per_tok=k, norm_topk_prob=rng.random() < 0.5,
                              decoder_sparse_step=rng.choice([1, 2]), qkv_bias=rng.random() < 0.8,
                              use_sliding_window=rng.random() < 0.3, sliding_window=rng.choice([4, 9]),
                              max_window_layers=rng.choice([1, 2, 28]), **common)
    if family == "mixtral":
        return MixtralConfig(num_key_value_heads=kv, intermediate_size=rng.choice([24, 40]), num_local_experts=E,
                             num_experts_per_tok=k, sliding_window=rng.choice([None, None, 5, 11]),
                             head_dim=rng.choice([H // heads, 8, 16]), **common)
    if family == "olmoe":
        return OlmoeConfig(num_key_value_heads=kv, intermediate_size=rng.choice([16, 32]), num_experts=E,
                           num_experts_per_tok=k, norm_topk_prob=rng.random() < 0.5,
                           clip_qkv=rng.choice([None, 0.5, 2.0]), **common)
    if family == "deepseek_v3":
        groups = [g for g in [1, 2, 4] if E % g == 0 and E // g >= 2]
        g = rng.choice(groups)
        tg = rng.randint(1, g)
        k = min(k, tg * (E // g))
        common.pop("num_attention_heads")
        return DeepseekV3Config(num_attention_heads=heads, num_key_value_heads=heads,
                                intermediate_size=rng.choice([40, 64]), moe_intermediate_size=rng.choice([16, 24]),
                                n_routed_experts=E, num_experts_per_tok=k, n_group=g, topk_group=tg,
                                n_shared_experts=rng.choice([1, 2]), routed_scaling_factor=rng.choice([1.0, 2.5]),
                                norm_topk_prob=rng.random() < 0.7, first_k_dense_replace=rng.randint(0, min(2, L)),
                                q_lora_rank=rng.choice([None, 16, 24]), kv_lora_rank=rng.choice([16, 32]),
                                qk_nope_head_dim=rng.choice([8, 16]), qk_rope_head_dim=rng.choice([4, 8]),
                                v_head_dim=rng.choice([8, 16]), rope_interleave=rng.random() < 0.7,
                                attention_bias=rng.random() < 0.2, **common)
    raise ValueError(family)


FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3"]


@torch.no_grad()
def check(colibri, family, cfg, seed, default_init, workdir):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    if not default_init:
        g = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))
    d = os.path.join(workdir, f"{family}_{seed}")
    model.save_pretrained(d)
    V = cfg.vocab_size
    toks = torch.randint(3, V, (40,), generator=torch.Generator().manual_seed(seed))
    logp = torch.log_softmax(model(toks[None]).logits[0].float(), -1)
    nll = [-logp[i, toks[i + 1]].item() for i in range(len(toks) - 1)]
    prompt = toks[:6].tolist()
    seq, margins = list(prompt), []
    for _ in range(24):
        lg = model(torch.tensor([seq])).logits[0, -1].float()
        lg[cfg.eos_token_id] = float("-inf")  # what min_new_tokens does, and --ignore-eos
        top = torch.topk(lg, 2).values
        margins.append((top[0] - top[1]).item())
        seq.append(int(lg.argmax()))
    greedy = seq[len(prompt):]

    tf = os.path.join(d, "tokens.txt")
    with open(tf, "w") as f:
        f.write(" ".join(map(str, toks.tolist())))
    p = subprocess.run([colibri, "perplexity", "--model", d, "--token-file", tf, "--json", "--per-token"],
                       capture_output=True, text=True)
    if p.returncode != 0:
        return f"perplexity failed: {p.stderr.strip()}"
    got = json.loads(p.stdout)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got["nll"], nll))
    p = subprocess.run([colibri, "run", "--model", d, "--prompt-tokens", ",".join(map(str, prompt)),
                        "--max-tokens", "24", "--ignore-eos", "--json"], capture_output=True, text=True)
    if p.returncode != 0:
        return f"run failed: {p.stderr.strip()}"
    gen = json.loads(p.stdout)["tokens"]
    msg = []
    if worst >= 1e-4:
        msg.append(f"NLL rel err {worst:.2e}")
    if gen != greedy:
        first = next(i for i, (a, b) in enumerate(zip(gen, greedy)) if a != b)
        if min(margins[:first + 1]) < 1e-4:
            print(f"  {family} seed {seed}: near-tie at step {first} (margin {margins[first]:.1e}), not counted")
        else:
            msg.append(f"greedy differs at step {first} (margin {margins[first]:.2e})")
    return "; ".join(msg) or None, worst


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--colibri", required=True)
    ap.add_argument("--n", type=int, default=10, help="configs per family")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--default-init", action="store_true", help="keep transformers' own init (std 0.02)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    failures = 0
    with tempfile.TemporaryDirectory() as work:
        for family in FAMILIES:
            worst_f = 0.0
            for i in range(args.n):
                seed = args.seed * 1000 + i
                cfg = random_config(rng, family)
                res = check(args.colibri, family, cfg, seed, args.default_init, work)
                if isinstance(res, str):
                    err, w = res, 0
                else:
                    err, w = res
                worst_f = max(worst_f, w)
                if err:
                    failures += 1
                    print(f"FAIL {family} seed {seed}: {err}\n  config: {cfg.to_json_string()}")
            print(f"{family}: {args.n} configs, worst NLL rel err {worst_f:.2e}")
    print("failures:", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
