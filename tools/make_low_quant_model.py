#!/usr/bin/env python3
"""Write tests/fixtures/gguf/qwen3_moe.low.gguf and qwen3_moe.low.f32.gguf:
a small random Qwen3-MoE whose experts and some attention projections are
stored in the formats of llama.cpp's Q2_K, Q3_K and IQ4 files, and its
twin holding gguf-py's dequantization of those tensors in F32.
model/tests/low_quants.rs runs both: the same values, one stored in the
block formats.

Q2_K, Q3_K and IQ4_XS rows are whole 256-element super-blocks, so the
model is the qwen3_moe fixture's (tokenizer, heads, expert width; its
metadata is copied from qwen3_moe.f32.gguf) made 256 wide, with 2 layers
of 4 experts to stay small. gguf-py has no quantizer for these formats:
the block-format tensors are random blocks (random codes and sub-block
scales, f16 scales of both signs sized for weights of about
QUANT_STD), the others random F16 (embeddings, output, attn_k/attn_v of
layer 0) or F32 (norms, routers), the same in both files:

    blk.0: attn_q IQ4_XS, attn_output IQ4_NL,
           ffn_gate_exps Q2_K, ffn_up_exps Q3_K, ffn_down_exps IQ4_NL
    blk.1: attn_q Q3_K, attn_k Q2_K, attn_v IQ4_XS, attn_output IQ4_NL,
           ffn_gate_exps IQ4_XS, ffn_up_exps Q2_K, ffn_down_exps IQ4_NL

(the down projections, 32 wide, take IQ4_NL, as llama.cpp gives a tensor
whose rows are not whole super-blocks in these files).

Usage: python tools/make_low_quant_model.py. Deterministic. Made with
gguf 0.19.0 and numpy (see tools/make_kquant_low_fixture.py).
"""

import os
import sys

import gguf
import numpy as np

SEED = 48
T = gguf.GGMLQuantizationType
EMBD, EXPERTS, LAYERS = 256, 4, 2
QUANT_STD = 0.1
QUANT = {
    "blk.0.attn_q": T.IQ4_XS,
    "blk.0.attn_output": T.IQ4_NL,
    "blk.0.ffn_gate_exps": T.Q2_K,
    "blk.0.ffn_up_exps": T.Q3_K,
    "blk.0.ffn_down_exps": T.IQ4_NL,
    "blk.1.attn_q": T.Q3_K,
    "blk.1.attn_k": T.Q2_K,
    "blk.1.attn_v": T.IQ4_XS,
    "blk.1.attn_output": T.IQ4_NL,
    "blk.1.ffn_gate_exps": T.IQ4_XS,
    "blk.1.ffn_up_exps": T.Q2_K,
    "blk.1.ffn_down_exps": T.IQ4_NL,
}
# Where each format's f16 scales lie in its block (Q2_K: d and dmin).
SCALES_AT = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.IQ4_NL: (0,), T.IQ4_XS: (0,)}


def shapes(meta):
    """name -> numpy shape (ggml's dims reversed) of every tensor."""
    hd, nh, nkv = meta["attention.key_length"], meta["attention.head_count"], \
        meta["attention.head_count_kv"]
    ff, vocab = meta["expert_feed_forward_length"], meta["vocab"]
    out = {"token_embd": (vocab, EMBD)}
    for b in range(LAYERS):
        out.update({
            f"blk.{b}.attn_norm": (EMBD,),
            f"blk.{b}.attn_q": (nh * hd, EMBD),
            f"blk.{b}.attn_k": (nkv * hd, EMBD),
            f"blk.{b}.attn_v": (nkv * hd, EMBD),
            f"blk.{b}.attn_output": (EMBD, nh * hd),
            f"blk.{b}.attn_q_norm": (hd,),
            f"blk.{b}.attn_k_norm": (hd,),
            f"blk.{b}.ffn_norm": (EMBD,),
            f"blk.{b}.ffn_gate_inp": (EXPERTS, EMBD),
            f"blk.{b}.ffn_gate_exps": (EXPERTS, ff, EMBD),
            f"blk.{b}.ffn_up_exps": (EXPERTS, ff, EMBD),
            f"blk.{b}.ffn_down_exps": (EXPERTS, EMBD, ff),
        })
    out["output_norm"] = (EMBD,)
    out["output"] = (vocab, EMBD)
    return out


def random_blocks(rng, qtype, shape):
    """Random blocks of `qtype` for a tensor of `shape`, their f16 scales
    set so that the values' standard deviation is about QUANT_STD."""
    elems, size = gguf.GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape)) // elems
    blocks = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    unit = blocks.copy()
    for at in SCALES_AT[qtype]:
        unit[:, at:at + 2] = np.array([1.0], dtype="<f2").view(np.uint8)
    std = float(gguf.quants.dequantize(unit, qtype).std())
    for at in SCALES_AT[qtype]:
        d = QUANT_STD / std * rng.uniform(0.5, 1.5, size=n) * rng.choice([-1, 1], size=n)
        blocks[:, at:at + 2] = d.astype("<f2").view(np.uint8).reshape(n, 2)
    return blocks.reshape(*shape[:-1], shape[-1] // elems * size)


def plain(rng, name, shape):
    if len(shape) == 1:  # norms
        return (1.0 + rng.normal(0.0, 0.1, size=shape)).astype(np.float32)
    w = rng.normal(0.0, 1.0 / np.sqrt(shape[-1]) * 2.0, size=shape)
    if name.endswith("ffn_gate_inp"):
        return w.astype(np.float32)
    return w.astype(np.float16)


def metadata(src):
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    kv = []
    meta = {}
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        v = f.contents()
        short = name.removeprefix(f"{arch}.")
        meta[short] = v
        v = {"embedding_length": EMBD, "expert_count": EXPERTS, "block_count": LAYERS}.get(short, v)
        if name == "general.name":
            v = "colibri fixture qwen3_moe low quants"
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        kv.append((name, v, f.types[0], sub))
    meta["vocab"] = len(meta["tokenizer.ggml.tokens"])
    return arch, kv, meta


def write(out, arch, kv, tensors, dequantized):
    w = gguf.GGUFWriter(out, arch)
    for name, v, ty, sub in kv:
        w.add_key_value(name, v, ty, sub_type=sub)
    n = 0
    for name, (data, qtype) in tensors.items():
        if qtype is None:
            w.add_tensor(name, data)
            continue
        n += 1
        if dequantized:
            w.add_tensor(name, np.ascontiguousarray(gguf.quants.dequantize(data, qtype), dtype="<f4"))
        else:
            w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{out}: {os.path.getsize(out)} bytes, {n} tensors in block formats"
          f"{' (dequantized)' if dequantized else ''}")


def main():
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                        "fixtures", "gguf")
    arch, kv, meta = metadata(os.path.join(here, "qwen3_moe.f32.gguf"))
    rng = np.random.default_rng(SEED)
    tensors = {}
    for name, shape in shapes(meta).items():
        qtype = QUANT.get(name)
        if qtype is None:
            tensors[name + ".weight"] = (plain(rng, name, shape), None)
            continue
        blocks = random_blocks(rng, qtype, shape)
        deq = gguf.quants.dequantize(blocks, qtype)
        assert deq.shape == shape and np.isfinite(deq).all(), name
        assert 0.5 * QUANT_STD < deq.std() < 2 * QUANT_STD, (name, deq.std())
        tensors[name + ".weight"] = (blocks, qtype)
    write(os.path.join(here, "qwen3_moe.low.gguf"), arch, kv, tensors, False)
    write(os.path.join(here, "qwen3_moe.low.f32.gguf"), arch, kv, tensors, True)


if __name__ == "__main__":
    sys.exit(main())
