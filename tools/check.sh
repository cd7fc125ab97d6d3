#!/usr/bin/env bash
# The whole test suite: formatting, lints, every Rust test, the Python
# client tests. Run tools/setup.sh once first.
set -euo pipefail
cd "$(dirname "$0")/.."
export COLIBRI_TOKENIZER_DIR="${COLIBRI_TOKENIZER_DIR:-$PWD/target/tokenizer-wheels}"
export COLIBRI_NVRTC_DIR="${COLIBRI_NVRTC_DIR:-$PWD/target/nvrtc/lib}"

cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
cargo test --workspace
# The topology read through hwloc (`--features hwloc`), against sysfs's.
if pkg-config --exists hwloc 2>/dev/null; then
    cargo clippy -p colibri-io --features hwloc --all-targets -- -D warnings
    cargo test -p colibri-io --features hwloc topology
    cargo check --features hwloc --bin colibri
else
    echo "NOTE: the hwloc topology reader not tested (no libhwloc-dev)"
fi
# The NEON kernels, cross-built for aarch64 and run under qemu-user.
if command -v qemu-aarch64 >/dev/null && command -v aarch64-linux-gnu-gcc >/dev/null; then
    tools/neon_check.sh
else
    echo "NOTE: NEON kernels not tested (no qemu-aarch64/aarch64 linker)"
fi
# The client tests drive the binary `cargo test` just built (the dev
# profile optimises dependencies and is plenty for the demo model).
cargo build --bin colibri
COLIBRI_BIN="$PWD/target/debug/colibri" .venv/bin/python -m pytest -q tests/python
echo "all checks passed"
