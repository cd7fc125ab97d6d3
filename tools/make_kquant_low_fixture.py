#!/usr/bin/env python3
"""Write tests/fixtures/gguf/low_quants.gguf: random Q2_K, Q3_K, IQ4_NL and
IQ4_XS data and gguf-py's dequantization of it, the reference
model/tests/low_quants.rs checks colibri's reading of these formats
against. They make up llama.cpp's Q2_K, Q3_K_S/M/L, IQ4_NL and IQ4_XS
files, the ones a DeepSeek-V3 or a Qwen3-235B fits in (IQ4_NL is also
what those files hold where a row is not whole 256-element super-blocks).

For each format F, raw tensors (ggml dims [cols, rows]) and beside each
`F.x.f32`: `gguf.quants.dequantize(F.x, type)` as F32:

- q2_k (ggml type 10, 84-byte super-blocks of 256), q3_k (11, 110 bytes)
  and iq4_xs (23, 136 bytes): `F.a` [256, 4], `F.b` [768, 3], `F.c`
  [1536, 1]; 19 super-blocks;
- iq4_nl (20, 18-byte blocks of 32): `F.a` [32, 5], `F.b` [96, 3], `F.c`
  [1408, 2]; 102 blocks.

Coverage (asserted here; the Rust test checks it again): every byte of
codes, high bits (Q3_K's `hmask`) and packed sub-block scales is random
(seed SEED), except that the sub-block scales of the first super-blocks
are set so that every value occurs: Q2_K's 16 scale bytes of the first 16
super-blocks are a permutation of 0..=255 (every 4-bit scale with every
4-bit min), the 16 six-bit scales of Q3_K's first 4 super-blocks and the
8 of IQ4_XS's first 8 each a permutation of 0..=63. So every code occurs
(Q2_K's 2-bit, Q3_K's 3-bit as 2 low bits and `hmask`, IQ4's 4-bit
nibbles). The f16 `d` (and Q2_K's `dmin`) of the first blocks of `F.b`
are zeros of both signs, subnormals (f16's smallest among them), the
smallest normal and ±65504; the rest ordinary values of both signs. Each
value is also recomputed here from the layout, element by element, with
ggml's operation order in float32 (`dequantize_row_*` of ggml-quants.c),
and compared with gguf-py's bits.

Usage: python tools/make_kquant_low_fixture.py [OUT]. Deterministic.
Made with gguf 0.19.0 and numpy (`python3 -m venv /tmp/gg &&
/tmp/gg/bin/pip install gguf==0.19.0 numpy`, then `/tmp/gg/bin/python
tools/make_kquant_low_fixture.py`).
"""

import importlib.metadata
import os
import sys

import gguf
import numpy as np

SEED = 47
QK, QK_K = 32, 256
T = gguf.GGMLQuantizationType
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                      dtype=np.float32)

SHAPES_K = [("a", 4, 256), ("b", 3, 768), ("c", 1, 1536)]
SHAPES_NL = [("a", 5, 32), ("b", 3, 96), ("c", 2, 1408)]

F16_SUB = float(np.uint16(5).view(np.float16))   # 5 * 2^-24, subnormal
F16_TINY = float(np.uint16(1).view(np.float16))  # 2^-24, the smallest
F16_NORM = float(np.float16(2.0 ** -14))         # the smallest normal
F16_MAX = 65504.0                                # the largest finite
# (d, dmin) of the blocks from the first of `.b` on (dmin is Q2_K's only).
SPECIAL = [
    (0.0, 0.5), (-0.0, -0.0), (F16_SUB, -F16_TINY), (F16_TINY, F16_MAX),
    (-F16_NORM, F16_NORM), (F16_MAX, -0.25), (-F16_MAX, 0.0), (-0.03, F16_SUB),
]


def f16(blocks, at):
    return blocks[:, at:at + 2].copy().view("<f2").astype(np.float32).ravel()


def two_bit(qs, e):
    """ggml's 2-bit code of element e of a Q2_K/Q3_K super-block: each half
    of 128 elements takes 32 bytes, element l + 32 s of a half bits 2s and
    2s + 1 of byte l."""
    return (qs[:, 32 * (e // 128) + e % 32] >> (2 * ((e % 128) // 32))) & 3


# Q2_K: scales[16] (low nibble scale, high nibble min), qs[64], d, dmin.
def q2_k_scales(blocks):
    return blocks[:, 0:16]


def q2_k_values(blocks):
    d, dmin = f16(blocks, 80), f16(blocks, 82)
    out = np.empty((blocks.shape[0], QK_K), dtype=np.float32)
    for e in range(QK_K):
        sc = blocks[:, e // 16]
        dl = d * (sc & 0x0F).astype(np.float32)
        ml = dmin * (sc >> 4).astype(np.float32)
        out[:, e] = dl * two_bit(blocks[:, 16:80], e).astype(np.float32) - ml
    return out


def q2_k_codes(blocks):
    return np.stack([two_bit(blocks[:, 16:80], e) for e in range(QK_K)], axis=1)


# Q3_K: hmask[32], qs[64], scales[12] (16 packed 6-bit values), d.
def q3_k_pack(sc):
    """16 six-bit values into ggml's 12 bytes: value j's low nibble is the
    low (j < 8) or high nibble of byte j % 8, its top 2 bits bits 2 (j / 4)
    and 2 (j / 4) + 1 of byte 8 + j % 4."""
    s = [0] * 12
    for j, v in enumerate(sc):
        s[j % 8] |= (v & 0x0F) << (4 * (j // 8))
        s[8 + j % 4] |= (v >> 4) << (2 * (j // 4))
    return s


def q3_k_unpack(s):
    return [((s[j % 8] >> (4 * (j // 8))) & 0x0F) | (((s[8 + j % 4] >> (2 * (j // 4))) & 3) << 4)
            for j in range(16)]


def q3_k_scales(blocks):
    return np.array([q3_k_unpack(b[96:108].tolist()) for b in blocks])


def q3_k_codes(blocks):
    """Element e's code (-4..=3): the 2 low bits less 4 unless bit e / 32
    of hmask[e % 32] is set."""
    out = np.empty((blocks.shape[0], QK_K), dtype=np.int32)
    for e in range(QK_K):
        high = (blocks[:, e % 32] >> (e // 32)) & 1
        out[:, e] = two_bit(blocks[:, 32:96], e).astype(np.int32) - 4 * (1 - high.astype(np.int32))
    return out


def q3_k_values(blocks):
    d = f16(blocks, 108)
    scales = q3_k_scales(blocks).astype(np.int32) - 32
    codes = q3_k_codes(blocks)
    out = np.empty((blocks.shape[0], QK_K), dtype=np.float32)
    for e in range(QK_K):
        dl = d * scales[:, e // 16].astype(np.float32)
        out[:, e] = dl * codes[:, e].astype(np.float32)
    return out


# IQ4_NL: d, qs[16]; element j < 16 the low nibble of qs[j], j >= 16 the
# high nibble of qs[j - 16].
def nibbles(qs, n):
    return np.stack([(qs[:, (j // 32) * 16 + j % 16] >> (4 * ((j % 32) // 16))) & 0x0F
                     for j in range(n)], axis=1)


def iq4_nl_codes(blocks):
    return nibbles(blocks[:, 2:18], QK)


def iq4_nl_values(blocks):
    d = f16(blocks, 0)
    return d[:, None] * IQ4_VALUES[iq4_nl_codes(blocks)]


# IQ4_XS: d, scales_h (u16), scales_l[4], qs[128]; 8 sub-blocks of 32.
def iq4_xs_pack(sc):
    h = sum((v >> 4) << (2 * ib) for ib, v in enumerate(sc))
    low = [(sc[2 * i] & 0x0F) | ((sc[2 * i + 1] & 0x0F) << 4) for i in range(4)]
    return [h & 0xFF, h >> 8] + low


def iq4_xs_scales(blocks):
    h = blocks[:, 2:4].copy().view("<u2").ravel().astype(np.int32)
    return np.stack([((blocks[:, 4 + ib // 2] >> (4 * (ib % 2))) & 0x0F).astype(np.int32)
                     | (((h >> (2 * ib)) & 3) << 4) for ib in range(8)], axis=1)


def iq4_xs_codes(blocks):
    return nibbles(blocks[:, 8:136], QK_K)


def iq4_xs_values(blocks):
    d = f16(blocks, 0)
    scales = iq4_xs_scales(blocks) - 32
    vals = IQ4_VALUES[iq4_xs_codes(blocks)]
    out = np.empty((blocks.shape[0], QK_K), dtype=np.float32)
    for e in range(QK_K):
        dl = d * scales[:, e // 32].astype(np.float32)
        out[:, e] = dl * vals[:, e]
    return out


def set_sub_scales(name, rng, blocks):
    """Every sub-block scale value in the first super-blocks; the promised
    coverage of them checked."""
    if name == "q2_k":
        blocks[:16, 0:16] = rng.permutation(256).astype(np.uint8).reshape(16, 16)
        assert set(q2_k_scales(blocks).ravel().tolist()) == set(range(256))
    elif name == "q3_k":
        perm = rng.permutation(64).reshape(4, 16)
        for i in range(4):
            blocks[i, 96:108] = q3_k_pack(perm[i].tolist())
        for b in blocks:
            assert q3_k_pack(q3_k_unpack(b[96:108].tolist())) == b[96:108].tolist()
        assert (q3_k_scales(blocks[:4]) == perm).all()
        assert set(q3_k_scales(blocks).ravel().tolist()) == set(range(64))
    elif name == "iq4_xs":
        perm = rng.permutation(64).reshape(8, 8)
        for i in range(8):
            blocks[i, 2:8] = iq4_xs_pack(perm[i].tolist())
        assert (iq4_xs_scales(blocks[:8]) == perm).all()
        assert set(iq4_xs_scales(blocks).ravel().tolist()) == set(range(64))


FORMATS = [
    # name, ggml type, elements and bytes per block, shapes, offsets of the
    # f16 scales, code decoder, every code, value decoder
    ("q2_k", T.Q2_K, QK_K, 84, SHAPES_K, (80, 82), q2_k_codes, range(4), q2_k_values),
    ("q3_k", T.Q3_K, QK_K, 110, SHAPES_K, (108,), q3_k_codes, range(-4, 4), q3_k_values),
    ("iq4_nl", T.IQ4_NL, QK, 18, SHAPES_NL, (0,), iq4_nl_codes, range(16), iq4_nl_values),
    ("iq4_xs", T.IQ4_XS, QK_K, 136, SHAPES_K, (0,), iq4_xs_codes, range(16), iq4_xs_values),
]


def make_blocks(rng, fmt):
    name, _, elems, size, shapes, scale_at, codes, every, _ = fmt
    n = sum(r * c // elems for _, r, c in shapes)
    first_special = shapes[0][1] * shapes[0][2] // elems  # the first of `.b`
    blocks = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    set_sub_scales(name, rng, blocks)
    for k, at in enumerate(scale_at):
        v = rng.uniform(0.002, 0.05, size=n) * rng.choice([-1, 1], size=n)
        for i, pair in enumerate(SPECIAL):
            v[first_special + i] = pair[k]
        blocks[:, at:at + 2] = v.astype("<f2").view(np.uint8).reshape(n, 2)
        d = f16(blocks, at)
        d16 = blocks[:, at:at + 2].copy().view("<u2").ravel()
        assert (d > 0).any() and (d < 0).any() and np.isfinite(d).all()
        assert (d16 == 0x0000).any() and (d16 == 0x8000).any(), "zeros of both signs"
        assert ((d != 0) & (np.abs(d) < F16_NORM)).any(), "no subnormal"
        assert (np.abs(d) == F16_MAX).any(), "no large value"
    assert set(np.unique(codes(blocks)).tolist()) == set(every), "not every code occurs"
    return blocks


def write_format(w, rng, fmt, expect):
    name, qtype, elems, size, shapes, _, _, _, values = fmt
    blocks = make_blocks(rng, fmt)
    mine = values(blocks).ravel()
    first, at = 0, 0
    for suffix, rows, cols in shapes:
        n = rows * cols // elems
        raw = blocks[first:first + n].reshape(rows, cols // elems * size)
        first += n
        deq = np.ascontiguousarray(gguf.quants.dequantize(raw, qtype), dtype="<f4")
        assert deq.shape == (rows, cols) and np.isfinite(deq).all()
        assert (np.abs(deq).max(axis=1) > 0).all(), "a zero row"
        assert (deq.ravel().view("<u4") == mine[at:at + rows * cols].view("<u4")).all(), \
            f"{name}.{suffix}: ggml's arithmetic != gguf-py's"
        at += rows * cols
        t = f"{name}.{suffix}"
        w.add_tensor(t, raw, raw_dtype=qtype)
        w.add_tensor(t + ".f32", deq)
        expect[t] = (qtype, rows, cols, raw.tobytes())
        expect[t + ".f32"] = (T.F32, rows, cols, deq.tobytes())
    bits = mine.view("<u4")
    assert (bits == 0).any() and (bits == 0x8000_0000).any(), f"{name}: no zero of both signs"


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.normpath(os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "gguf",
        "low_quants.gguf"))
    rng = np.random.default_rng(SEED)
    w = gguf.GGUFWriter(out, "colibri-test")
    expect = {}
    for fmt in FORMATS:
        write_format(w, rng, fmt, expect)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = gguf.GGUFReader(out)
    t = {x.name: x for x in r.tensors}
    assert set(t) == set(expect)
    for k, (qtype, rows, cols, data) in expect.items():
        assert t[k].tensor_type == qtype, k
        assert [int(v) for v in t[k].shape] == [cols, rows], k
        assert bytes(t[k].data.tobytes()) == data, k
    print(f"{out}: {os.path.getsize(out)} bytes (gguf {importlib.metadata.version('gguf')},"
          f" numpy {np.__version__})")


if __name__ == "__main__":
    sys.exit(main())
