#!/usr/bin/env bash
# The whole test suite: formatting, lints, every Rust test, the Python
# client tests. Run tools/setup.sh once first.
set -euo pipefail
cd "$(dirname "$0")/.."
export COLIBRI_TOKENIZER_DIR="${COLIBRI_TOKENIZER_DIR:-$PWD/target/tokenizer-wheels}"

cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
cargo test --workspace
if ls tests/python/test_*.py >/dev/null 2>&1; then
    cargo build --release --bin colibri
    COLIBRI_BIN="$PWD/target/release/colibri" .venv/bin/python -m pytest -q tests/python
fi
echo "all checks passed"
