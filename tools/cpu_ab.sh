#!/usr/bin/env bash
# Warm CPU decodes of several builds or settings, taking turns, on one
# machine: the way to compare changes whose effect is smaller than the
# spread between runs (a VM's memory speed drifts by several percent from
# one minute to the next, so only runs that alternate compare).
#
#   tools/cpu_ab.sh MODEL ROUNDS "BENCH_ARGS" RUN...
#
# RUN: "[VAR=VALUE ...] BINARY", a colibri binary with any environment.
# BENCH_ARGS: what `colibri bench-io --model MODEL --warm --json` also
# gets (`--ram-budget 15.3GiB --tokens 128 --threads 2 --prompt-tokens
# ...`). Each round runs every RUN once, in the order given. Prints a
# line per run: decode tok/s, its share of the bound that counts the KV
# cache (whole decode, and the median of its windows), the read pass's
# GB/s, prefill tok/s, and the calling thread's shares between pool jobs
# and waiting at their ends; last, the medians per RUN. Full JSON under
# $OUT (or /tmp/colibri-cpu-ab).
set -uo pipefail
if [[ $# -lt 4 ]]; then
  sed -n 2,18p "$0" >&2
  exit 2
fi
model="$1" rounds="$2" args="$3"
shift 3
out="${OUT:-/tmp/colibri-cpu-ab}"
mkdir -p "$out"
results="$out/cpu-ab.tsv"
: >"$results"
for ((r = 1; r <= rounds; r++)); do
  for ((i = 1; i <= $#; i++)); do
    run="${!i}"
    json="$out/r$r-$i.json"
    # shellcheck disable=SC2086
    env $run bench-io --model "$model" --warm --json $args >"$json" 2>"$out/r$r-$i.err"
    rc=$?
    line=$(python3 - "$json" "$rc" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
    f = lambda k, n=3: round(d.get(k, float("nan")), n)
    print("\t".join(str(v) for v in (
        f("tok_s", 2), f("tok_s_of_roofline_with_kv"), f("window_of_roofline_with_kv_median"),
        f("memory_read_gb_s", 1), f("prefill_tok_s", 1),
        f("pool_between_jobs_fraction"), f("pool_end_wait_fraction"))))
except Exception:
    print(f"failed (exit {sys.argv[2]})" + "\t-" * 6)
PY
)
    printf '%s\t%s\t%s\n' "$r" "$i" "$line" | tee -a "$results"
  done
done
echo "== medians: tok/s, of the bound with the KV cache, window median, read GB/s, prefill tok/s, between jobs, at jobs' ends"
python3 - "$results" "$@" <<'PY'
import statistics, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])]
for i, run in enumerate(sys.argv[2:], 1):
    got = [r for r in rows if r[1] == str(i) and r[3] != "-"]
    if not got:
        print(f"{run}: no result")
        continue
    med = [statistics.median(float(r[c]) for r in got) for c in range(2, 9)]
    print(f"{run}: " + " ".join(f"{m:g}" for m in med) + f" ({len(got)} runs)")
PY
