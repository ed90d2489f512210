"""The cpu backend's threading layer (runtime/cpu/threadpool.py): TBB where installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bitformat.runtime.cpu.threadpool import installed_libtbb

CODE = """
import json, sys, numba
import bitformat.runtime.cpu.backend as B
from bitformat.runtime import load
B.SERIAL_BYTES = 0  # every mat-vec in parallel, however small the tiny model's matrices
with load(sys.argv[1], backend="cpu", threads=2) as m:
    logits = m.logits([1, 2, 3, 4])
print(json.dumps({"layer": numba.threading_layer(), "logits": logits[-1, :64].tolist()}))
"""


def run_model(path, **env):
    base = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"}
    out = subprocess.run([sys.executable, "-c", CODE, str(path)], env={**base, **env},
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


@pytest.mark.skipif(installed_libtbb() is None, reason="the tbb package is not installed")
def test_cpu_backend_runs_on_tbb_and_gives_the_same_logits_as_openmp(tiny_gguf):
    """TBB is picked where installed (the loader would not find pip's libtbb by itself), the
    user's NUMBA_THREADING_LAYER wins, and the layer changes nothing in the results."""
    tbb = run_model(tiny_gguf)
    omp = run_model(tiny_gguf, NUMBA_THREADING_LAYER="omp")
    assert (tbb["layer"], omp["layer"]) == ("tbb", "omp")
    assert tbb["logits"] == omp["logits"]
