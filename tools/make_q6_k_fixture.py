#!/usr/bin/env python3
"""Write tests/fixtures/gguf/q6_k.gguf: random Q6_K data and gguf-py's
dequantization of it, the reference model/tests/q6_k.rs checks colibri's
Q6_K reading (dequantization, exact and integer products) against.

The file holds two tensors, both of ggml dims [768, 3] (3 rows of 3
super-blocks of 256), written by the PyPI `gguf` package's GGUFWriter:

- `q6k`: raw Q6_K bytes (ggml type 14). Every byte of `ql`, `qh` and the
  sub-block `scales` is random (seed SEED), so every 6-bit code and both
  scale signs occur (checked below; super-block 0 also holds the scale
  extremes -128, 127 and 0). The f16 `d` of the 9 super-blocks, in row
  order: ordinary positive values, negative values, a subnormal (a tiny d
  near and below f16's normal range), f16's smallest normal, and one
  super-block with d = 0 (its elements are zeros of either sign);
- `q6k.f32`: `gguf.quants.dequantize(q6k, Q6_K)` as F32.

Usage: python tools/make_q6_k_fixture.py [OUT]
(default tests/fixtures/gguf/q6_k.gguf). Needs gguf and numpy: made with
gguf 0.19.0 and numpy 2.4.6 on Python 3.11
(`python3 -m venv /tmp/gg && /tmp/gg/bin/pip install gguf numpy`).
"""

import importlib.metadata
import os
import sys

import gguf
import numpy as np

SEED = 6
ROWS, COLS = 3, 768
QK_K = 256
BLOCK = 210  # ql 128, qh 64, scales 16, d 2
QH, SCALES, D = 128, 192, 208

# The 9 super-blocks' d, row after row (row r holds super-blocks 3r..3r+2).
# None: drawn at random (ordinary positive values).
D_VALUES = [
    None,                               # row 0: ordinary
    0.0371,                             #        ordinary
    None,                               #        ordinary
    -0.0213,                            # row 1: negative
    float(np.uint16(5).view(np.float16)),  #     subnormal: 5 * 2^-24
    -float(np.float16(2.0 ** -14)),     #        -(smallest normal)
    0.0,                                # row 2: d = 0
    None,                               #        ordinary
    -1.75,                              #        negative, large
]


def codes(blocks: np.ndarray) -> np.ndarray:
    """The 6-bit codes (0..63) of Q6_K super-blocks, by ggml's layout
    (independent of gguf-py's dequantizer: only used to check coverage)."""
    out = np.empty((blocks.shape[0], QK_K), dtype=np.uint8)
    for e in range(QK_K):
        n, k, l = e // 128, (e % 128) // 32, e % 32
        ql = blocks[:, 64 * n + 32 * (k % 2) + l]
        nib = (ql >> (4 * (k // 2))) & 0x0F
        hi = (blocks[:, QH + 32 * n + l] >> (2 * k)) & 3
        out[:, e] = nib | (hi << 4)
    return out


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.normpath(os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "gguf", "q6_k.gguf"))
    rng = np.random.default_rng(SEED)
    n_blocks = ROWS * COLS // QK_K
    blocks = rng.integers(0, 256, size=(n_blocks, BLOCK), dtype=np.uint8)
    blocks[0, SCALES:SCALES + 3] = [0x80, 0x7F, 0x00]
    for i, d in enumerate(D_VALUES):
        if d is None:
            d = rng.uniform(0.005, 0.1)
        blocks[i, D:D + 2] = np.array([d], dtype="<f2").view(np.uint8)

    # The promised coverage.
    c = codes(blocks)
    assert set(np.unique(c).tolist()) == set(range(64)), "not every code occurs"
    sc = blocks[:, SCALES:D].view(np.int8)
    assert (sc < 0).any() and (sc > 0).any() and (sc == -128).any() and (sc == 127).any()
    ds = blocks[:, D:D + 2].copy().view("<f2").ravel()
    assert (ds > 0).any() and (ds < 0).any() and (ds == 0).sum() == 1
    assert (np.abs(ds[ds != 0]) < np.float16(2.0 ** -14)).any(), "no subnormal d"

    raw = blocks.reshape(ROWS, COLS // QK_K * BLOCK)
    deq = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K)
    deq = np.ascontiguousarray(deq, dtype="<f4")
    assert deq.shape == (ROWS, COLS)

    w = gguf.GGUFWriter(out, "colibri-test")
    # uint8 bytes of shape (3, 630) with a raw dtype: GGUFWriter records the
    # element shape (3, 768), i.e. ggml dims [768, 3].
    w.add_tensor("q6k", raw, raw_dtype=gguf.GGMLQuantizationType.Q6_K)
    w.add_tensor("q6k.f32", deq)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    # Read back with gguf-py's reader: what our test will see.
    r = gguf.GGUFReader(out)
    t = {x.name: x for x in r.tensors}
    assert t["q6k"].tensor_type == gguf.GGMLQuantizationType.Q6_K
    assert [int(v) for v in t["q6k"].shape] == [COLS, ROWS]
    assert bytes(t["q6k"].data.tobytes()) == raw.tobytes()
    assert t["q6k.f32"].tensor_type == gguf.GGMLQuantizationType.F32
    assert [int(v) for v in t["q6k.f32"].shape] == [COLS, ROWS]
    assert bytes(t["q6k.f32"].data.tobytes()) == deq.tobytes()
    neg0 = int((np.signbit(deq) & (deq == 0)).sum())
    print(f"{out}: {os.path.getsize(out)} bytes (gguf {importlib.metadata.version('gguf')},"
          f" numpy {np.__version__}); d = {ds.tolist()}; {neg0} negative zeros")


if __name__ == "__main__":
    sys.exit(main())
