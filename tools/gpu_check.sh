#!/usr/bin/env bash
# The GPU measurements of docs/benchmarks.md ("The wgpu backend on a real GPU") in one run on a
# lent machine, from the repository root:
#
#   tools/gpu_check.sh [OUT_DIR]          (OUT_DIR default out/gpu; $OUT on the device tool)
#
# Needs .gl/ and .whl/ (tools/gpu_env.sh) and, for the before/after comparison, the tree of the
# commit to compare against in .base/ (git archive BASE bitformat | tar -x -C .base); without
# .base only the current code runs. Steps: synthesize the full-size 2B-4T (i2_s), time decode
# (full and screened head), a 512-token prompt and one profiled step for the base code and the
# current code (with BITFORMAT_GPU_TUNING's configurations, ';'-separated, each a ','-separated
# list of GpuDevice.tuning keys: "fold=0;tpw=0;gate_up.passes=1"), BENCH_CONTAINERS' containers
# (comma-separated), then check every family and container of the tiny models against numpy on
# the device. With five configurations and three containers: about 3 minutes, plus about half a
# minute to start the machine (the H200 runs of docs/benchmarks.md, second session).
set -u
out="${1:-${OUT:-out/gpu}}"
mkdir -p "$out"
. tools/gpu_env.sh || exit 1
log="$out/gpu_check.log"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  t0=$(date +%s)
  python3 -c "from bitformat.synth import synth; synth('2b4t', '/tmp/2b4t.gguf', seed=0)"
  echo "synth: $(( $(date +%s) - t0 )) s"
  if [ -d .base/bitformat ]; then
    PYTHONPATH="$PWD/.base:/tmp/site" timeout 240 python3 tools/bench_gpu.py /tmp/2b4t.gguf \
      --label before --json "$out/before.json" ${BENCH_ARGS:-}
  fi
  timeout 420 python3 tools/bench_gpu.py /tmp/2b4t.gguf --label after \
    --containers "${BENCH_CONTAINERS:-}" \
    --tuning "${BITFORMAT_GPU_TUNING:-}" --json "$out/after.json" ${BENCH_ARGS:-}
  timeout 150 python3 tools/bench_gpu.py --check-tiny
  echo "total: $(( $(date +%s) - t0 )) s"
} 2>&1 | grep -v XDG_RUNTIME | tee "$log"
