#!/usr/bin/env python3
"""Read a GGUF file written by colibri's writer with the PyPI `gguf`
package's GGUFReader and record what it saw (every key with its type and
value, every tensor with its type, dims and an FNV-1a 64 hash of its bytes)
next to it as `<file>.gguf-py.json`. model/tests/gguf.rs checks that our
writer still produces that exact file and that our reader agrees with
what gguf-py read.

Usage: python tools/check_gguf_writer.py tests/fixtures/gguf/colibri_writer.gguf
"""

import json
import sys

import gguf


def fnv1a64(b: bytes) -> str:
    h = 0xcbf29ce484222325
    for x in b:
        h = ((h ^ x) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def plain(x):
    """numpy scalars and arrays as JSON-ready Python values."""
    if isinstance(x, list):
        return [plain(v) for v in x]
    return x.tolist() if hasattr(x, "tolist") else x


def main():
    path = sys.argv[1]
    r = gguf.GGUFReader(path)
    meta = {}
    for name, field in r.fields.items():
        if name.startswith("GGUF."):
            continue
        t = field.types[0]
        if t == gguf.GGUFValueType.ARRAY:
            if field.types[1] == gguf.GGUFValueType.ARRAY:
                value = None
            else:
                value = field.contents()
        else:
            value = field.contents()
        meta[name] = {"type": int(t), "value": plain(value)}
    tensors = {}
    for t in r.tensors:
        tensors[t.name] = {"type": int(t.tensor_type), "ne": [int(x) for x in t.shape],
                           "fnv1a64": fnv1a64(bytes(t.data.tobytes()))}
    out = {"reader": f"gguf-py {getattr(gguf, '__version__', '')}".strip(), "alignment": int(r.alignment),
           "metadata": meta, "tensors": tensors}
    with open(path + ".gguf-py.json", "w") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
    print(f"{path}: {len(meta)} keys, {len(tensors)} tensors read by gguf-py")


if __name__ == "__main__":
    sys.exit(main())
