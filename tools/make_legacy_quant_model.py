#!/usr/bin/env python3
"""Write tests/fixtures/gguf/qwen3_moe.legacy.gguf and
qwen3_moe.legacy.f32.gguf from the f32 fixture qwen3_moe.f32.gguf: the
first with its expert matrices and two attention projections quantized
by gguf-py to the formats llama.cpp falls back to (gate_exps Q4_1,
up_exps Q5_1, down_exps Q5_0, attn_q Q5_0, attn_output Q4_1), the second
the same model with those tensors as gguf-py's dequantization of them, in
F32. model/tests/legacy_quants.rs runs both: the same values, one stored
in the block formats.

Usage: python tools/make_legacy_quant_model.py. Deterministic. Made with
gguf 0.19.0 and numpy (see tools/make_legacy_quant_fixture.py).
"""

import os
import sys

import gguf
import numpy as np

T = gguf.GGMLQuantizationType
QUANT = {
    "ffn_gate_exps": T.Q4_1,
    "ffn_up_exps": T.Q5_1,
    "ffn_down_exps": T.Q5_0,
    "attn_q": T.Q5_0,
    "attn_output": T.Q4_1,
}


def copy(src, out, dequantized):
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(out, arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    n = 0
    for t in r.tensors:
        data = np.array(t.data)
        kind = t.name.split(".")[-2] if t.name.count(".") >= 2 else ""
        qtype = QUANT.get(kind)
        if qtype is None:
            w.add_tensor(t.name, data)
            continue
        assert t.tensor_type == T.F32, t.name
        q = gguf.quants.quantize(data.astype(np.float32), qtype)
        deq = np.ascontiguousarray(gguf.quants.dequantize(q, qtype), dtype="<f4")
        assert deq.shape == data.shape and np.abs(deq - data).max() < 0.1, t.name
        if dequantized:
            w.add_tensor(t.name, deq)
        else:
            w.add_tensor(t.name, q, raw_dtype=qtype)
        n += 1
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{out}: {os.path.getsize(out)} bytes, {n} tensors in block formats"
          f"{' (dequantized)' if dequantized else ''}")


def main():
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                        "fixtures", "gguf")
    src = os.path.join(here, "qwen3_moe.f32.gguf")
    copy(src, os.path.join(here, "qwen3_moe.legacy.gguf"), False)
    copy(src, os.path.join(here, "qwen3_moe.legacy.f32.gguf"), True)


if __name__ == "__main__":
    sys.exit(main())
