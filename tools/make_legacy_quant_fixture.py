#!/usr/bin/env python3
"""Write tests/fixtures/gguf/legacy_quants.gguf: random Q4_1, Q5_0 and Q5_1
data and gguf-py's dequantization of it, the reference
model/tests/legacy_quants.rs checks colibri's reading of these formats
against. llama.cpp writes them where a k-quant cannot go: a tensor whose
rows are not whole 256-element super-blocks (DeepSeek-V2-Lite's and
Qwen1.5-MoE's 1408-wide down projections in a Q4_K_M file), and in the
older whole-file types.

For each format F in q4_1 (ggml type 3, 20-byte blocks of 32), q5_0 (6,
22 bytes) and q5_1 (7, 24 bytes), three raw tensors (ggml dims [cols,
rows]): `F.a` [32, 5], `F.b` [96, 3], `F.c` [1408, 2]; 102 blocks in all,
and beside each `F.x.f32`: `gguf.quants.dequantize(F.x, type)` as F32.

Coverage (asserted here; the Rust test checks it again): the nibbles and
the fifth bits (`qh`) are random bytes (seed SEED), so every 4-/5-bit code
occurs; the f16 scale `d` (and min `m` of Q4_1/Q5_1) of the first blocks
are set to zeros of both signs, subnormals (f16's smallest among them),
the smallest normal and ±65504, the rest ordinary values of both signs.

Usage: python tools/make_legacy_quant_fixture.py [OUT]. Deterministic.
Made with gguf 0.19.0 and numpy (`python3 -m venv /tmp/gg &&
/tmp/gg/bin/pip install gguf==0.19.0 numpy`).
"""

import importlib.metadata
import os
import sys

import gguf
import numpy as np

SEED = 46
QK = 32
FORMATS = [
    # name, ggml type, bytes per block, has a min, bits
    ("q4_1", gguf.GGMLQuantizationType.Q4_1, 20, True, 4),
    ("q5_0", gguf.GGMLQuantizationType.Q5_0, 22, False, 5),
    ("q5_1", gguf.GGMLQuantizationType.Q5_1, 24, True, 5),
]
SHAPES = [("a", 5, 32), ("b", 3, 96), ("c", 2, 1408)]
N_BLOCKS = sum(r * c // QK for _, r, c in SHAPES)  # 102

F16_SUB = float(np.uint16(5).view(np.float16))
F16_TINY = float(np.uint16(1).view(np.float16))
F16_NORM = float(np.float16(2.0 ** -14))
F16_MAX = 65504.0
# (d, m) of blocks FIRST_SPECIAL.. (file order: `.a`'s 5 rows of one
# block, then `.b`'s 3 rows of 3): in `.b`, so a row whose scale is zero
# still has other blocks and no row is all zeros.
FIRST_SPECIAL = 5
SPECIAL = [
    (0.0, 0.5), (-0.0, -0.0), (F16_SUB, -F16_TINY), (F16_TINY, F16_MAX),
    (-F16_NORM, F16_NORM), (F16_MAX, -0.25), (-F16_MAX, 0.0), (-0.03, F16_SUB),
]


def codes(blocks, bits, has_min):
    """Every element's code by ggml's layout: element j < 16 the low
    nibble of qs[j], element j >= 16 the high nibble of qs[j - 16], with
    bit j of qh (a little-endian u32) as the fifth bit."""
    qs_at = (4 if has_min else 2) + (4 if bits == 5 else 0)
    out = np.empty((blocks.shape[0], QK), dtype=np.uint32)
    qh = None
    if bits == 5:
        at = 4 if has_min else 2
        qh = blocks[:, at:at + 4].copy().view("<u4").ravel()
    for j in range(QK):
        byte = blocks[:, qs_at + j % 16].astype(np.uint32)
        v = (byte & 0x0F) if j < 16 else (byte >> 4)
        if qh is not None:
            v = v | (((qh >> j) & 1) << 4)
        out[:, j] = v
    return out


def make_blocks(rng, size, has_min, bits):
    blocks = rng.integers(0, 256, size=(N_BLOCKS, size), dtype=np.uint8)
    d = rng.uniform(0.005, 0.1, size=N_BLOCKS) * rng.choice([-1, 1], size=N_BLOCKS)
    m = rng.uniform(-1.0, 1.0, size=N_BLOCKS)
    for i, (dv, mv) in enumerate(SPECIAL):
        d[FIRST_SPECIAL + i], m[FIRST_SPECIAL + i] = dv, mv
    blocks[:, 0:2] = d.astype("<f2").view(np.uint8).reshape(N_BLOCKS, 2)
    if has_min:
        blocks[:, 2:4] = m.astype("<f2").view(np.uint8).reshape(N_BLOCKS, 2)
    c = codes(blocks, bits, has_min)
    assert set(np.unique(c).tolist()) == set(range(1 << bits)), "not every code occurs"
    for at in ((0, 2) if has_min else (0,)):
        v = blocks[:, at:at + 2].copy().view("<f2").ravel()
        b16 = blocks[:, at:at + 2].copy().view("<u2").ravel()
        assert (v > 0).any() and (v < 0).any()
        assert (b16 == 0x0000).any() and (b16 == 0x8000).any(), "zeros of both signs"
        assert ((v != 0) & (np.abs(v) < F16_NORM)).any(), "no subnormal"
        assert (np.abs(v) == F16_MAX).any(), "no large value"
    return blocks


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.normpath(os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "gguf",
        "legacy_quants.gguf"))
    rng = np.random.default_rng(SEED)
    w = gguf.GGUFWriter(out, "colibri-test")
    expect = {}
    for name, qtype, size, has_min, bits in FORMATS:
        blocks = make_blocks(rng, size, has_min, bits)
        first = 0
        for suffix, rows, cols in SHAPES:
            n = rows * cols // QK
            raw = blocks[first:first + n].reshape(rows, cols // QK * size)
            first += n
            deq = np.ascontiguousarray(gguf.quants.dequantize(raw, qtype), dtype="<f4")
            assert deq.shape == (rows, cols) and np.isfinite(deq).all()
            assert (np.abs(deq).max(axis=1) > 0).all(), "a zero row"
            t = f"{name}.{suffix}"
            w.add_tensor(t, raw, raw_dtype=qtype)
            w.add_tensor(t + ".f32", deq)
            expect[t] = (qtype, rows, cols, raw.tobytes())
            expect[t + ".f32"] = (gguf.GGMLQuantizationType.F32, rows, cols, deq.tobytes())
        assert first == N_BLOCKS
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
