#!/usr/bin/env bash
# Runs colibri-cuda's GPU checks on a machine with an NVIDIA GPU: every
# kernel against its reference (cuda/tests/gpu_*.rs, the #[ignore]d tests),
# the no-GPU tests, the NVRTC compile test, then the matvec benchmark
# (cuda/examples/bench_kernels.rs). Prints a summary last; exits non-zero if
# anything failed.
#
#   tools/gpu_check.sh --bundle [DIR]   (where cargo is) build the test and
#                                       bench binaries in release mode and
#                                       copy them to DIR (default
#                                       target/gpu-bundle), to carry to a GPU
#                                       machine that has no cargo
#   tools/gpu_check.sh [DIR]            (on the GPU machine) run them: with
#                                       cargo if it is there, else the
#                                       prebuilt binaries in DIR
#
# NVRTC: $COLIBRI_NVRTC_DIR if set, else the CUDA toolkit's
# (/usr/local/cuda/lib64), else the nvidia-cuda-nvrtc Python wheel if
# python3 has it. Compiled kernels are cached in $XDG_CACHE_HOME/colibri/cuda
# (or ~/.cache/colibri/cuda). If $OUT is set, the full log goes to
# $OUT/gpu_check.log too.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

if [[ "${1:-}" == "--bundle" ]]; then
  set -e
  dir="${2:-$root/target/gpu-bundle}"
  mkdir -p "$dir"
  json=$(mktemp)
  cargo test -p colibri-cuda --release --no-run --message-format=json >"$json"
  cargo build -p colibri-cuda --release --example bench_kernels --message-format=json >>"$json"
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
    if m["target"]["kind"] == ["lib"]:
        name = "unit"
    shutil.copy2(exe, os.path.join(dest, name))
    copied.append(name)
print("bundled:", " ".join(sorted(copied)), "->", dest)
PY
  rm -f "$json"
  # Debug info would take the bundle past what can be carried (64 MiB);
  # symbols stay, so backtraces still name functions.
  if command -v strip >/dev/null; then
    strip --strip-debug "$dir"/*
  fi
  du -sh "$dir"
  exit 0
fi

bundle="${1:-$root/target/gpu-bundle}"
log() { echo "$@"; }
if [[ -n "${OUT:-}" ]]; then
  exec > >(tee -a "$OUT/gpu_check.log") 2>&1
fi

log "== machine"
nvidia-smi -L 2>&1 || log "(nvidia-smi not available)"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv 2>&1 || true

if [[ -z "${COLIBRI_NVRTC_DIR:-}" ]]; then
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    if [[ -f "$d/libnvrtc.so.13" ]]; then
      export COLIBRI_NVRTC_DIR="$d"
      break
    fi
  done
fi
if [[ -z "${COLIBRI_NVRTC_DIR:-}" ]] && command -v python3 >/dev/null; then
  d=$(python3 - <<'PY' 2>/dev/null
import glob, os, site
for base in site.getsitepackages() + [site.getusersitepackages()]:
    for lib in glob.glob(os.path.join(base, "nvidia", "*", "lib", "libnvrtc.so.13")):
        print(os.path.dirname(lib)); raise SystemExit
PY
  )
  [[ -n "$d" ]] && export COLIBRI_NVRTC_DIR="$d"
fi
log "NVRTC dir: ${COLIBRI_NVRTC_DIR:-<none found; colibri will search the linker path>}"

passed=()
failed=()
step() {
  local name="$1"
  shift
  log ""
  log "== $name"
  if "$@"; then passed+=("$name"); else failed+=("$name"); fi
}

if command -v cargo >/dev/null; then
  step "gpu tests (cargo)" cargo test -p colibri-cuda --release -- --include-ignored --test-threads=1
  step "bench (cargo)" cargo run -p colibri-cuda --release --example bench_kernels
else
  if [[ ! -d "$bundle" ]]; then
    log "no cargo and no bundle at $bundle: build one where cargo is with"
    log "  tools/gpu_check.sh --bundle $bundle"
    exit 2
  fi
  # GPU numerics first, then the bench, then the compile test (which CI
  # also runs; here it checks the machine's own NVRTC for all four archs).
  for t in unit unavailable gpu_matvec gpu_ops bench_kernels compile; do
    if [[ ! -x "$bundle/$t" ]]; then
      failed+=("$t (missing from $bundle)")
    elif [[ "$t" == bench_kernels ]]; then
      step "bench" "$bundle/$t"
    else
      step "test $t" "$bundle/$t" --include-ignored --test-threads=1
    fi
  done
fi

log ""
log "== summary"
for p in "${passed[@]}"; do log "ok:     $p"; done
for f in "${failed[@]}"; do log "FAILED: $f"; done
log "${#passed[@]} passed, ${#failed[@]} failed"
[[ ${#failed[@]} -eq 0 ]]
