#!/usr/bin/env bash
# How much of a warm decode the calling thread spends outside pool jobs,
# where the other compute threads wait for it. Runs `bench-io --warm`,
# samples the main thread with perf (DWARF call graphs) part-way through
# the decode, and prints the share of its samples outside `Pool::run`
# (the bandwidth probe's samples left out), grouped by the function they
# fall in.
#
#   tools/serial_share.sh BINARY MODEL [RAM_BUDGET] [DELAY_S]
#
# DELAY_S (default 36) must cover loading every expert into RAM; the
# decode runs 300 tokens so that the 8-second sample ends inside it.
# Needs perf and python3.
set -euo pipefail
bin="$1"; model="$2"; budget="${3:-15.3GiB}"; delay="${4:-36}"
data="$(mktemp -d)"
trap 'rm -rf "$data"' EXIT
"$bin" bench-io --model "$model" --warm --ram-budget "$budget" --tokens 300 \
    > "$data/bench.log" 2>&1 &
pid=$!
sleep "$delay"
perf record -F 499 --call-graph dwarf,16384 -t "$pid" -o "$data/perf.data" -- sleep 8 \
    > /dev/null 2>&1
kill "$pid" 2>/dev/null || true
wait "$pid" 2>/dev/null || true
perf script -i "$data/perf.data" -F tid,ip,sym 2>/dev/null > "$data/stacks.txt"
python3 - "$data/stacks.txt" <<'PY'
import collections, sys

samples, cur = [], []
for line in open(sys.argv[1]):
    if not line.strip():
        if cur:
            samples.append(cur)
        cur = []
    elif line[0] not in " \t":
        cur = []
    else:
        parts = line.strip().split(None, 1)
        cur.append(parts[1] if len(parts) > 1 else "?")
if cur:
    samples.append(cur)
decode = [s for s in samples if not any("BandwidthProbe" in f for f in s)]
if not decode:
    sys.exit("no decode samples: is DELAY_S past the warm-up, and perf allowed?")
serial = [s for s in decode if not any("Pool::run" in f for f in s)]
# Innermost first: a sample counts for the first of these its stack names.
phases = ["mlp_group", "gated_products", "route_rows", "fetch_groups", "moe_rows",
          "qkv_rows", "attention::attention", "rms_norm", "sampling", "forward"]
def phase(stack):
    text = " ".join(stack)
    return next((p for p in phases if p in text), stack[0][:60])
by = collections.Counter(phase(s) for s in serial)
print(f"main thread: {len(decode)} decode samples, {100 * len(serial) / len(decode):.2f}% outside pool jobs")
for name, n in by.most_common(10):
    print(f"  {100 * n / len(decode):5.2f}%  {name}")
PY
