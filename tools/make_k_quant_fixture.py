#!/usr/bin/env python3
"""Write tests/fixtures/gguf/k_quants.gguf: random Q4_K and Q5_K data and
gguf-py's dequantization of it, the reference model/tests/k_quants.rs
checks colibri's Q4_K/Q5_K reading (dequantization, integer products)
against.

The file holds, written by the PyPI `gguf` package's GGUFWriter, for each
format F in q4k (ggml type 12, 144-byte super-blocks) and q5k (type 13,
176 bytes) three raw tensors of awkward shapes (ggml dims [cols, rows]):

- `F.a`: [256, 5], 5 rows of 1 super-block of 256;
- `F.b`: [512, 3], 3 rows of 2 super-blocks;
- `F.c`: [768, 3], 3 rows of 3 super-blocks;

20 super-blocks (160 sub-blocks of 32) per format, and beside each raw
tensor `F.x.f32`: `gguf.quants.dequantize(F.x, type)` as F32.

Coverage (asserted below, independently of gguf-py's dequantizer; the
Rust test checks it again):
- every byte of the nibbles `qs` and of Q5_K's fifth bits `qh` is random
  (seed SEED), so every 4-bit (Q4_K) and 5-bit (Q5_K) code occurs;
- the 12 packed bytes of sub-block scales and mins are packed here, in
  ggml's layout, from 6-bit values: the first 64 sub-blocks of each
  format take every scale 0..63 once (shuffled), the mins another
  shuffle of 0..63, the rest random; so every scale and min value occurs,
  0 and 63 included, and j >= 4 sub-blocks (whose values straddle the
  packing) hold both high bits;
- the f16 `d` and `dmin` of the 20 super-blocks (D_DMIN below):
  ordinary positive and negative values of both, subnormal ones (f16's
  smallest 2^-24 among them), f16's smallest normal, zeros of both signs,
  and f16's largest finite value 65504 (positive and negative). Every row
  holds a non-zero super-block (the products are never trivially 0).

Usage: python tools/make_k_quant_fixture.py [OUT]
(default tests/fixtures/gguf/k_quants.gguf). Deterministic: the same
gguf and numpy give the same bytes. Needs gguf and numpy: made with gguf
0.19.0 and numpy 2.4.6 on Python 3.11
(`python3 -m venv /tmp/gg && /tmp/gg/bin/pip install gguf==0.19.0 numpy`,
then `/tmp/gg/bin/python tools/make_k_quant_fixture.py`).
"""

import importlib.metadata
import os
import sys

import gguf
import numpy as np

SEED = 45
QK_K = 256
K_SCALES = 4  # d (f16), dmin (f16), then the 12 packed scale bytes
QS4 = K_SCALES + 12  # Q4_K: the 128 bytes of nibbles
QH5 = K_SCALES + 12  # Q5_K: 32 bytes of fifth bits, then the nibbles
QS5 = QH5 + 32
FORMATS = [
    # name, ggml type, bytes per super-block, bits per code
    ("q4k", gguf.GGMLQuantizationType.Q4_K, 144, 4),
    ("q5k", gguf.GGMLQuantizationType.Q5_K, 176, 5),
]
# name suffix, rows, columns
SHAPES = [("a", 5, 256), ("b", 3, 512), ("c", 3, 768)]
N_SUPER = sum(r * c // QK_K for _, r, c in SHAPES)  # 20

F16_SUB = float(np.uint16(5).view(np.float16))   # 5 * 2^-24, subnormal
F16_TINY = float(np.uint16(1).view(np.float16))  # 2^-24, the smallest
F16_NORM = float(np.float16(2.0 ** -14))         # the smallest normal
F16_MAX = 65504.0                                # the largest finite
R, NR = "R", "-R"  # an ordinary value drawn at random, positive or negated

# (d, dmin) of the super-blocks, in file order: `.a`'s 5 rows of 1, `.b`'s
# 3 rows of 2, `.c`'s 3 rows of 3.
D_DMIN = [
    (R, R),                   # a row 0: ordinary
    (NR, R),                  # a row 1: d negative
    (R, NR),                  # a row 2: dmin negative
    (-1.75, NR),              # a row 3: both negative
    (F16_SUB, R),             # a row 4: d subnormal
    (R, F16_TINY),            # b row 0: dmin subnormal (smallest)
    (0.0, R),                 #          d = 0
    (R, 0.0),                 # b row 1: dmin = 0
    (F16_MAX, R),             #          d large
    (R, F16_MAX),             # b row 2: dmin large
    (-F16_NORM, F16_NORM),    #          smallest normals
    (0.0, -0.0),              # c row 0: all +0
    (-0.0, 0.0),              #          all -0
    (R, R),                   #          ordinary
    (-F16_MAX, -F16_MAX),     # c row 1: both large, negative
    (R, R),                   #          ordinary
    (-F16_SUB, F16_SUB),      #          both subnormal
    (NR, NR),                 # c row 2: both negative
    (R, -F16_NORM),           #          ordinary, -(smallest normal)
    (F16_TINY, NR),           #          d smallest subnormal
]
assert len(D_DMIN) == N_SUPER


def pack_scales(sc, mn):
    """ggml's 12-byte packing of 8 six-bit scales and mins (the inverse of
    `get_scale_min_k4`): bytes 0..3 hold scales 0..3 and bytes 4..7 mins
    0..3 in their low 6 bits, with the top 2 bits of scales 4..7 (bytes
    0..3) and of mins 4..7 (bytes 4..7) above; bytes 8..11 hold the low
    nibbles of scale j (low) and min j (high) for j = 4..7."""
    s = [0] * 12
    for j in range(8):
        if j < 4:
            s[j] |= sc[j]
            s[j + 4] |= mn[j]
        else:
            s[j + 4] = (sc[j] & 0x0F) | ((mn[j] & 0x0F) << 4)
            s[j - 4] |= (sc[j] >> 4) << 6
            s[j] |= (mn[j] >> 4) << 6
    return s


def unpack_scales(s):
    """ggml's `get_scale_min_k4`, written out (used to check the packing
    against gguf-py's own unpacking)."""
    out = []
    for j in range(8):
        if j < 4:
            out.append((s[j] & 63, s[j + 4] & 63))
        else:
            out.append(((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4),
                        (s[j + 4] >> 4) | ((s[j] >> 6) << 4)))
    return out


def codes(blocks, bits):
    """The codes (0..2^bits - 1) of Q4_K/Q5_K super-blocks, by ggml's
    layout: element e takes the low (e / 32 even) or high nibble of
    byte 32 (e / 64) + e % 32 of `qs`, and for Q5_K bit e / 32 of
    qh[e % 32] as its fifth bit."""
    qs = QS4 if bits == 4 else QS5
    out = np.empty((blocks.shape[0], QK_K), dtype=np.uint8)
    for e in range(QK_K):
        byte = blocks[:, qs + 32 * (e // 64) + e % 32]
        v = (byte >> (4 * ((e // 32) % 2))) & 0x0F
        if bits == 5:
            v = v | (((blocks[:, QH5 + e % 32] >> (e // 32)) & 1) << 4)
        out[:, e] = v
    return out


def make_blocks(rng, size, bits):
    blocks = rng.integers(0, 256, size=(N_SUPER, size), dtype=np.uint8)
    n_sub = N_SUPER * 8
    sc = rng.integers(0, 64, size=n_sub)
    mn = rng.integers(0, 64, size=n_sub)
    sc[:64] = rng.permutation(64)
    mn[:64] = rng.permutation(64)
    for i in range(N_SUPER):
        blocks[i, K_SCALES:K_SCALES + 12] = pack_scales(
            sc[8 * i:8 * i + 8].tolist(), mn[8 * i:8 * i + 8].tolist())
    for i, pair in enumerate(D_DMIN):
        for at, v in zip((0, 2), pair):
            if v in (R, NR):
                v = rng.uniform(0.005, 0.1) * (1 if v == R else -1)
            blocks[i, at:at + 2] = np.array([v], dtype="<f2").view(np.uint8)

    # The promised coverage.
    c = codes(blocks, bits)
    assert set(np.unique(c).tolist()) == set(range(1 << bits)), "not every code occurs"
    got_sc, got_mn = gguf.quants.Q4_K.get_scale_min(blocks[:, K_SCALES:K_SCALES + 12].copy())
    assert (got_sc.ravel() == sc).all() and (got_mn.ravel() == mn).all(), "packing != gguf-py's"
    for i in range(N_SUPER):
        mine = unpack_scales(blocks[i, K_SCALES:K_SCALES + 12].tolist())
        assert mine == list(zip(sc[8 * i:8 * i + 8].tolist(), mn[8 * i:8 * i + 8].tolist()))
    assert set(sc.tolist()) == set(range(64)) and set(mn.tolist()) == set(range(64))
    hi = [(sc[8 * i + j], mn[8 * i + j]) for i in range(N_SUPER) for j in range(4, 8)]
    assert {s >> 4 for s, _ in hi} == {0, 1, 2, 3} and {m >> 4 for _, m in hi} == {0, 1, 2, 3}
    for at in (0, 2):
        v = blocks[:, at:at + 2].copy().view("<f2").ravel()
        bits16 = blocks[:, at:at + 2].copy().view("<u2").ravel()
        assert (v > 0).any() and (v < 0).any()
        assert (bits16 == 0x0000).any() and (bits16 == 0x8000).any(), "zeros of both signs"
        assert ((v != 0) & (np.abs(v) < F16_NORM)).any(), "no subnormal"
        assert (np.abs(v) == F16_MAX).any(), "no large value"
        assert np.isfinite(v).all()
    return blocks


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.normpath(os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "gguf",
        "k_quants.gguf"))
    rng = np.random.default_rng(SEED)
    w = gguf.GGUFWriter(out, "colibri-test")
    expect = {}
    summary = []
    for name, qtype, size, bits in FORMATS:
        blocks = make_blocks(rng, size, bits)
        first = 0
        for suffix, rows, cols in SHAPES:
            n = rows * cols // QK_K
            raw = blocks[first:first + n].reshape(rows, cols // QK_K * size)
            first += n
            deq = gguf.quants.dequantize(raw, qtype)
            deq = np.ascontiguousarray(deq, dtype="<f4")
            assert deq.shape == (rows, cols) and np.isfinite(deq).all()
            # Every row non-zero: the products never degenerate to 0.
            assert (np.abs(deq).max(axis=1) > 0).all()
            t = f"{name}.{suffix}"
            # uint8 bytes of shape (rows, bytes per row) with a raw dtype:
            # GGUFWriter records the element shape (rows, cols), i.e. ggml
            # dims [cols, rows].
            w.add_tensor(t, raw, raw_dtype=qtype)
            w.add_tensor(t + ".f32", deq)
            expect[t] = (qtype, rows, cols, raw.tobytes())
            expect[t + ".f32"] = (gguf.GGMLQuantizationType.F32, rows, cols, deq.tobytes())
            neg0 = int((np.signbit(deq) & (deq == 0)).sum())
            pos0 = int((~np.signbit(deq) & (deq == 0)).sum())
            summary.append(f"{t} [{cols}, {rows}]: {pos0} +0, {neg0} -0,"
                           f" max |v| {float(np.abs(deq).max()):.6g}")
        assert first == N_SUPER
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    # Read back with gguf-py's reader: what our test will see.
    r = gguf.GGUFReader(out)
    t = {x.name: x for x in r.tensors}
    assert set(t) == set(expect)
    for k, (qtype, rows, cols, data) in expect.items():
        assert t[k].tensor_type == qtype, k
        assert [int(v) for v in t[k].shape] == [cols, rows], k
        assert bytes(t[k].data.tobytes()) == data, k
    print(f"{out}: {os.path.getsize(out)} bytes (gguf {importlib.metadata.version('gguf')},"
          f" numpy {np.__version__})")
    for s in summary:
        print("  " + s)


if __name__ == "__main__":
    sys.exit(main())
