#!/usr/bin/env bash
# Checks and measures the GPU tier (sched/src/gpu) on a machine with an
# NVIDIA GPU: the kernel tests (cuda/tests/gpu_matvec.rs, gpu_ops.rs), the
# GPU-vs-CPU and placement-invariance tests (sched/tests/gpu.rs with
# --exact-quant, sched/tests/gpu_int.rs with the default 8-bit activations;
# the #[ignore]d ones), `colibri plan`/`run` with
# --device cuda, then decode speed on a synthetic Qwen3-MoE against the
# HBM and PCIe bandwidth measured in the same run
# (sched/examples/gpu_decode.rs). Prints a summary last; exits non-zero if
# a check failed.
#
#   tools/gpu_tier_check.sh --bundle [DIR]   (where cargo is) build release
#                                            binaries into DIR (default
#                                            target/gpu-bundle-tier), to
#                                            carry to a GPU machine
#   tools/gpu_tier_check.sh [DIR]            (on the GPU machine) run them
#
# NVRTC: $COLIBRI_NVRTC_DIR, else the CUDA toolkit's /usr/local/cuda/lib64.
# Fixtures: $COLIBRI_FIXTURES, else tests/fixtures of this checkout. The
# synthetic model goes to $SYNTH_DIR (default /tmp/colibri-synth); its
# geometry is SYNTH_ARGS. If $OUT is set, logs go there too.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

if [[ "${1:-}" == "--bundle" ]]; then
  set -e
  dir="${2:-$root/target/gpu-bundle-tier}"
  mkdir -p "$dir"
  json=$(mktemp)
  cargo test -p colibri-sched --release --test gpu --test gpu_int --no-run --message-format=json >"$json"
  cargo test -p colibri-cuda --release --test gpu_batch --test gpu_matvec --test gpu_ops --no-run --message-format=json >>"$json"
  cargo build -p colibri-sched --release --example synth_moe --example gpu_decode \
    --message-format=json >>"$json"
  cargo build --release --bin colibri --message-format=json >>"$json"
  python3 - "$json" "$dir" <<'PY'
import json, shutil, sys, os
src, dest = sys.argv[1], sys.argv[2]
copied = []
for line in open(src):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    exe = m.get("executable") if m.get("reason") == "compiler-artifact" else None
    if not exe:
        continue
    name = m["target"]["name"]
    shutil.copy2(exe, os.path.join(dest, name))
    copied.append(name)
print("bundled:", " ".join(sorted(set(copied))), "->", dest)
PY
  rm -f "$json"
  strip --strip-debug "$dir"/*
  du -sh "$dir"
  exit 0
fi

bundle="${1:-$root/target/gpu-bundle-tier}"
out="${OUT:-/tmp/colibri-gpu-tier}"
mkdir -p "$out"
exec > >(tee -a "$out/gpu_tier.log") 2>&1
export COLIBRI_NVRTC_DIR="${COLIBRI_NVRTC_DIR:-/usr/local/cuda/lib64}"
export COLIBRI_FIXTURES="${COLIBRI_FIXTURES:-$root/tests/fixtures}"
export XDG_CACHE_HOME="${XDG_CACHE_HOME:-/tmp/colibri-cache}"
synth="${SYNTH_DIR:-/tmp/colibri-synth}"
synth_args="${SYNTH_ARGS:---hidden 2048 --layers 8 --experts 64 --top-k 8 --moe-intermediate 768 --vocab 32000}"

echo "== machine ($(date -u +%FT%TZ))"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.free,clocks.sm,clocks.mem,pcie.link.gen.current,pcie.link.width.current --format=csv 2>&1 || true
echo "NVRTC dir: $COLIBRI_NVRTC_DIR"

passed=()
failed=()
step() {
  local name="$1"
  shift
  echo ""
  echo "== $name"
  local t0=$SECONDS
  if "$@"; then passed+=("$name ($((SECONDS - t0))s)"); else failed+=("$name ($((SECONDS - t0))s)"); fi
}

step "colibri-cuda matvec kernels" timeout 120 "$bundle/gpu_matvec" --include-ignored --test-threads=1
step "colibri-cuda engine helpers" timeout 120 "$bundle/gpu_batch" --include-ignored --test-threads=1
step "colibri-cuda norm, rope, routing, attention kernels" timeout 180 "$bundle/gpu_ops" --include-ignored --test-threads=1
step "GPU tier tests" timeout 480 "$bundle/gpu" --include-ignored --test-threads=1
step "GPU tier tests, 8-bit activations" timeout 240 "$bundle/gpu_int" --include-ignored --test-threads=1
step "synthetic model" timeout 120 "$bundle/synth_moe" "$synth" $synth_args
step "colibri plan --device cuda" timeout 60 "$bundle/colibri" plan --model "$synth" --device cuda --vram-budget 1GiB
step "colibri run --device cuda" timeout 60 "$bundle/colibri" run --model "$COLIBRI_FIXTURES/models/qwen3_moe" --device cuda --prompt-tokens 1,2,3,4 -n 8
step "decode, all in VRAM" timeout 120 "$bundle/gpu_decode" "$synth" --tokens 128 --warmup 16
step "decode, --vram-budget 1GiB (experts from RAM)" timeout 150 "$bundle/gpu_decode" "$synth" --vram-budget 1GiB --tokens 32 --warmup 48
step "decode, --vram-budget 0" timeout 120 "$bundle/gpu_decode" "$synth" --vram-budget 0 --tokens 16 --warmup 48
# Two devices: GPUs 0 and 1 when there are two, else GPU 0 twice (the same
# split and hand-over on one device).
if [[ $(nvidia-smi -L 2>/dev/null | grep -c '^GPU') -ge 2 ]]; then two=0,1; else two=0,0; fi
step "colibri plan --devices $two" timeout 60 "$bundle/colibri" plan --model "$synth" --device cuda --devices "$two"
step "colibri run --devices $two" timeout 60 "$bundle/colibri" run --model "$COLIBRI_FIXTURES/models/qwen3_moe" --device cuda --devices "$two" --prompt-tokens 1,2,3,4 -n 8
step "decode, --devices $two, all in VRAM" timeout 120 "$bundle/gpu_decode" "$synth" --devices "$two" --tokens 128 --warmup 16
step "decode, --devices $two, --vram-budget 1GiB each" timeout 150 "$bundle/gpu_decode" "$synth" --devices "$two" --vram-budget 1GiB --tokens 32 --warmup 48

echo ""
echo "== summary"
for p in "${passed[@]}"; do echo "ok:     $p"; done
for f in "${failed[@]}"; do echo "FAILED: $f"; done
echo "${#passed[@]} passed, ${#failed[@]} failed"
[[ ${#failed[@]} -eq 0 ]]
