#!/usr/bin/env bash
# GPU decode under several environment settings, taking turns, on one
# machine in one call: the way to compare kernel variants that a variable
# selects (COLIBRI_PDL, COLIBRI_PDL_RELEASE, COLIBRI_MV_STREAM, ...).
#
#   tools/gpu_ab.sh BUNDLE MODEL ROUNDS "GPU_DECODE_ARGS" SETTING...
#
# BUNDLE: tools/gpu_tier_check.sh --bundle's directory (gpu_decode in it).
# SETTING: "VAR=VALUE[,VAR=VALUE...]", or "-" for the environment as it is.
# Each round runs every setting once, in the order given. Prints one line
# per run (graph ms per token = GPU time in graph replays, tok/s, share of
# the HBM roofline measured in the same run) and, last, the medians per
# setting. Full output under $OUT (or /tmp/colibri-ab) as ab-*.log.
set -uo pipefail
if [[ $# -lt 5 ]]; then
  sed -n 2,14p "$0" >&2
  exit 2
fi
bundle="$1" model="$2" rounds="$3" args="$4"
shift 4
out="${OUT:-/tmp/colibri-ab}"
mkdir -p "$out"
results="$out/ab-results.tsv"
: >"$results"
for ((r = 1; r <= rounds; r++)); do
  for setting in "$@"; do
    envs=()
    [[ "$setting" != "-" ]] && IFS=',' read -r -a envs <<<"$setting"
    log="$out/ab-r$r-${setting//[^A-Za-z0-9_=]/_}.log"
    # shellcheck disable=SC2086
    env "${envs[@]}" "$bundle/gpu_decode" "$model" $args >"$log" 2>&1
    rc=$?
    json=$(tail -n 1 "$log")
    line=$(python3 - "$json" "$rc" <<'PY'
import json, sys
try:
    j = json.loads(sys.argv[1])
    print(f"{j['graph_gpu_ms_per_token']:.3f}\t{j['decode_tok_s']:.1f}\t{100 * j['decode_tok_s'] / j['hbm_roofline_tok_s']:.1f}")
except Exception:
    print(f"failed (exit {sys.argv[2]})\t-\t-")
PY
)
    printf '%s\t%s\t%s\n' "$r" "$setting" "$line" | tee -a "$results"
  done
done
echo "== medians (graph ms per token, tok/s, % of the HBM roofline)"
python3 - "$results" "$@" <<'PY'
import statistics, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])]
for s in sys.argv[2:]:
    got = [r for r in rows if r[1] == s and r[3] != "-"]
    if not got:
        print(f"{s}: no result")
        continue
    med = [statistics.median(float(r[i]) for r in got) for i in (2, 3, 4)]
    print(f"{s}: {med[0]:.3f} ms, {med[1]:.1f} tok/s, {med[2]:.1f}% ({len(got)} runs)")
PY
