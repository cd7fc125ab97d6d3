#!/usr/bin/env bash
# Runs a command inside a fresh memory cgroup with a hard limit, as the
# acceptance checks of the disk path do ("under an 8 GiB memory cgroup …").
# The page cache the command causes is charged to the cgroup too, so the
# limit caps everything the process makes resident. Needs root (or a
# delegated cgroup). Works on cgroup v2 and on v1's memory controller.
#
#   tools/cgroup_run.sh 8G target/release/colibri run --model …
set -euo pipefail
limit="$1"; shift
name="colibri-$$"
if [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then
    dir="/sys/fs/cgroup/$name"
    mkdir "$dir"
    echo "$limit" > "$dir/memory.max"
    echo 0 > "$dir/memory.swap.max" 2>/dev/null || true
else
    dir="/sys/fs/cgroup/memory/$name"
    mkdir "$dir"
    echo "$limit" > "$dir/memory.limit_in_bytes"
fi
cleanup() { rmdir "$dir" 2>/dev/null || true; }
trap cleanup EXIT
# Drop clean page cache first so the run starts cold and cached pages of
# earlier runs are not charged elsewhere.
sync; echo 1 > /proc/sys/vm/drop_caches 2>/dev/null || true
set +e
bash -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' _ "$dir" "$@"
status=$?
# What the cap did to the page cache: file-backed pages charged, major
# faults, and file pages refaulted after reclaim (mapped weights re-read).
if [[ -f "$dir/memory.stat" ]]; then
    grep -E '^(anon|file|file_mapped|pgmajfault|workingset_refault_file|workingset_refault) ' \
        "$dir/memory.stat" | tr '\n' ' ' | sed 's/^/cgroup memory.stat: /' >&2
    echo >&2
fi
if [[ -f "$dir/memory.max_usage_in_bytes" ]]; then
    echo "cgroup peak memory: $(cat "$dir/memory.max_usage_in_bytes") bytes (limit $limit)" >&2
elif [[ -f "$dir/memory.peak" ]]; then
    echo "cgroup peak memory: $(cat "$dir/memory.peak") bytes (limit $limit)" >&2
fi
exit $status
