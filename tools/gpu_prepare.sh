#!/usr/bin/env bash
# Fetches, on a machine with the package registries, what a lent GPU machine (a bare image with
# python3, numpy and numba, and no network) needs for tools/gpu_check.sh, so that none of its
# device minutes go to setup. From the repository root:
#
#   tools/gpu_prepare.sh [BASE_COMMIT]
#
# - .gl/: the Vulkan loader (Debian's libvulkan1 .deb; tools/gpu_env.sh unpacks it there);
# - .whl/cpXY/: the wheels the runtime needs beside numpy and numba, for CPython 3.10-3.13
#   (the device's Python is not known before it starts; gpu_env.sh takes its own version's);
# - .base/: with BASE_COMMIT, that commit's bitformat/ for the before/after comparison.
#
# Then run on the device (the run tool's carry: [".gl", ".whl", ".base"]):
#   tools/gpu_check.sh "$OUT"
set -eu
rm -rf .gl .whl
mkdir -p .gl .whl
(cd .gl && apt-get download libvulkan1 >/dev/null)
# what bench_gpu.py imports beside numpy and numba (pure-python wheels are the same for all)
pkgs="wgpu cffi pycparser rendercanvas sniffio constriction gguf zstandard pyyaml tqdm tokenizers"
for v in 3.10 3.11 3.12 3.13; do
  tag="cp${v/./}"
  python3 -m pip download -q --only-binary=:all: --no-deps --python-version "$v" \
    --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 -d ".whl/$tag" $pkgs
done
if [ $# -ge 1 ]; then
  rm -rf .base && mkdir -p .base
  git archive "$1" bitformat | tar -x -C .base
fi
du -sh .gl .whl ${1:+.base} | tr '\n' ' '
echo
