# Source this on a lent GPU machine (bare image with python3, numpy, numba; no network) from the
# repository root, after copying in .gl/ (Vulkan loader .debs: apt-get download libvulkan1 ...)
# and .whl/ (wgpu, cffi, pycparser, rendercanvas, constriction, gguf, zstandard, sniffio,
# tokenizers wheels for the machine's Python; tools/gpu_prepare.sh fetches both): unpacks the
# loader, installs the wheels under /tmp/site and points Python at them and at this checkout.
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
# tools/gpu_prepare.sh keeps a folder per Python version (.whl/cp311/...); older copies had one
whl=".whl/cp$(python3 -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')"
[ -d "$whl" ] || whl=.whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "$whl"/*.whl || return 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
[ -f "$icd" ] && export VK_DRIVER_FILES="$icd"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
lscpu | grep -m1 "Model name" || true
