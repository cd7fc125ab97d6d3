#!/usr/bin/env bash
# Cross-tests the NEON kernels (model/src/kernels/neon.rs) on an x86-64
# host: builds colibri-model's lib tests for aarch64 and runs them under
# qemu-user twice, on qemu's "max" CPU (which has dotprod: the run-time
# dispatch picks NEON_DOTPROD) and as a Cortex-A53 (no dotprod: NEON), then
# lints the crate for aarch64. Exits non-zero on any failure.
#
#     tools/neon_check.sh           install what is missing, then check
#     tools/neon_check.sh --setup   only install what is missing
#
# Installs, only where missing: qemu-user, the aarch64 cross linker and
# libc (apt-get, as root) and the rustup target. Builds into
# $NEON_TARGET_DIR (default: target/aarch64), apart from the host build.
# Timings under qemu mean nothing about aarch64 hardware: this checks
# results only.
set -euo pipefail
cd "$(dirname "$0")/.."

target=aarch64-unknown-linux-gnu

if ! command -v qemu-aarch64 >/dev/null || ! command -v aarch64-linux-gnu-gcc >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "installing qemu-user and the aarch64 cross toolchain (apt-get)"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            qemu-user gcc-aarch64-linux-gnu libc6-dev-arm64-cross >/dev/null
    else
        echo "neon_check: qemu-aarch64 or aarch64-linux-gnu-gcc missing; as root:" >&2
        echo "    apt-get install qemu-user gcc-aarch64-linux-gnu libc6-dev-arm64-cross" >&2
        exit 1
    fi
fi
if ! rustup target list --installed | grep -qx "$target"; then
    rustup target add "$target"
fi
if [ "${1:-}" = --setup ]; then
    exit 0
fi

export CARGO_TARGET_DIR="${NEON_TARGET_DIR:-$PWD/target/aarch64}"
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
# Dependencies unoptimized: the build from scratch takes a quarter of the
# time (the kernels, in colibri-model, keep the dev profile's opt-level).
opts=(-p colibri-model --target "$target" --config 'profile.dev.package."*".opt-level=0')
# The sampler has no aarch64 code of its own (the same portable loops as
# on x86): its three large reference grids, seconds natively, take
# minutes each under qemu, so they run natively only.
skip=(--skip sampling::tests::qwen3_sized_vocabulary_matches_the_reference
    --skip sampling::tests::small_vocabularies_match_the_reference
    --skip sampling::tests::top_p_boundary_inside_the_fast_normalizer_error_is_decided_exactly)
# The kernel set each CPU must get (a test checks COLIBRI_EXPECT_KERNELS).
for run in max:neon+dotprod cortex-a53:neon; do
    cpu="${run%%:*}"
    echo "colibri-model lib tests on aarch64 (qemu-aarch64 -cpu $cpu: ${run#*:} kernels)"
    CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -cpu $cpu -L /usr/aarch64-linux-gnu" \
        COLIBRI_EXPECT_KERNELS="${run#*:}" \
        cargo test -q "${opts[@]}" --lib -- "${skip[@]}"
done
cargo clippy -q "${opts[@]}" --all-targets -- -D warnings
echo "neon check passed"
