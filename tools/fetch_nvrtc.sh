#!/usr/bin/env bash
# Fetches NVIDIA's NVRTC (the CUDA runtime compiler) from PyPI and unpacks
# it into DIR (default: target/nvrtc), so that colibri-cuda's kernels can be
# compiled on a machine with no GPU and no CUDA toolkit (CI does this on
# every run: cuda/tests/compile.rs).
#
# Afterwards DIR/lib holds libnvrtc.so.13 and libnvrtc-builtins.so.13.0;
# point colibri at it with
#
#     export COLIBRI_NVRTC_DIR="$DIR/lib"
#
# The version is pinned to the CUDA release of the lent GPU machines
# (13.0), so CI compiles with the same compiler the GPU tests ran with.
#
# Idempotent: a wheel already unpacked (marker file present) is skipped, so a
# second run costs nothing and needs no network.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${1:-$root/target/nvrtc}"
version="13.0.88"
spec="nvidia-cuda-nvrtc==$version"
marker="$dir/.unpacked-$version"

if [[ -f "$marker" && -f "$dir/lib/libnvrtc.so.13" ]]; then
  exit 0
fi

case "$(uname -m)" in
  x86_64) platform=manylinux2014_x86_64 ;;
  aarch64) platform=manylinux2014_aarch64 ;;
  *) echo "fetch_nvrtc.sh: no NVRTC wheel for $(uname -m)" >&2; exit 1 ;;
esac

pip_cmd=()
if command -v pip >/dev/null 2>&1; then
  pip_cmd=(pip)
elif command -v pip3 >/dev/null 2>&1; then
  pip_cmd=(pip3)
else
  pip_cmd=(python3 -m pip)
fi

rm -rf "$dir"
mkdir -p "$dir/.download"
# The wheel is tagged for several manylinux levels; asking for the oldest
# one that NVIDIA publishes keeps the download independent of this
# machine's glibc.
"${pip_cmd[@]}" download --quiet --disable-pip-version-check --no-deps \
  --only-binary=:all: --platform "$platform" --platform manylinux_2_17_"$(uname -m)" \
  --platform manylinux_2_27_"$(uname -m)" --platform manylinux_2_28_"$(uname -m)" \
  --dest "$dir/.download" "$spec"
whl=$(ls "$dir/.download"/*.whl)
# A wheel is a zip; python is always there where pip is, unzip may not be.
python3 - "$whl" "$dir" <<'PY'
import os, shutil, sys, zipfile
whl, dest = sys.argv[1], sys.argv[2]
lib = os.path.join(dest, "lib")
os.makedirs(lib, exist_ok=True)
with zipfile.ZipFile(whl) as z:
    for name in z.namelist():
        base = os.path.basename(name)
        # Only the shared libraries are needed (headers are not: the
        # kernels include none), and not the ".alt" variants.
        if base.startswith("libnvrtc") and ".so" in base and ".alt." not in base:
            with z.open(name) as src, open(os.path.join(lib, base), "wb") as dst:
                shutil.copyfileobj(src, dst)
PY
rm -rf "$dir/.download"
if [[ ! -f "$dir/lib/libnvrtc.so.13" ]]; then
  echo "fetch_nvrtc.sh: $spec did not contain libnvrtc.so.13" >&2
  ls -l "$dir/lib" >&2
  exit 1
fi
touch "$marker"
echo "unpacked $spec into $dir/lib (export COLIBRI_NVRTC_DIR=$dir/lib)"
