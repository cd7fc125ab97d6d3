#!/usr/bin/env bash
# Cold-from-disk decode through the GPU tier (#6's disk target): a small
# VRAM budget and a small RAM budget, so most experts are read from disk
# (O_DIRECT), staged through pinned RAM and copied to the device; bench-io
# prints disk_utilization against a raw read pass of the same file in the
# same run. The CPU tier runs the same model beside it for comparison.
#
#   tools/gpu_disk_check.sh COLIBRI_BINARY [LAYERS]
#
# Writes a synthetic Qwen3-30B-A3B-geometry Q4_0 GGUF with LAYERS layers
# (default 12) to $SYNTH (default /tmp/q30-synth.gguf); logs to $OUT if set.
set -uo pipefail
bin="$1"; layers="${2:-12}"
model="${SYNTH:-/tmp/q30-synth.gguf}"
out="${OUT:-/tmp}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
[[ -f "$model" ]] || "$bin" synth --preset qwen3-30b-a3b --quant q4_0 --format gguf \
  --layers "$layers" --out "$model" >"$out/synth.log" 2>&1 || { tail "$out/synth.log"; exit 1; }
ls -la "$model"
for dev in cuda cpu; do
  for budget in 1GiB; do
    "$bin" bench-io --model "$model" --device "$dev" --vram-budget "$budget" \
      --ram-budget 256MiB --tokens 24 --seconds 4 --json >"$out/bench-$dev.json" 2>"$out/bench-$dev.err"
    echo "== $dev (exit $?)"
    python3 - "$out/bench-$dev.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print("no JSON:", e); sys.exit(0)
keys = ["compute", "tok_s", "ttft_s", "disk_bytes_per_token", "disk_read_mb_s", "raw_disk_mb_s",
        "disk_utilization", "bound_tok_s", "ram_hit_rate", "io_wait_fraction", "kernel_over_counted",
        "prefetch_recall", "prefetch_waste", "queue_depth"]
for k in keys:
    print(f"  {k}: {d.get(k)}")
PY
    tail -3 "$out/bench-$dev.err"
  done
done
