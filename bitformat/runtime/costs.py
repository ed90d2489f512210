"""What each container costs to run on the cpu backend, as measured: decode and prefill speed
relative to i2_s on the full-size synthetic 2B-4T, per CPU and kernel build
(``tools/bench_containers.py --write`` fills ``data/container_costs.json``; docs/benchmarks.md
has the runs). ``bitformat inspect`` quotes them, so nobody picks a slow path by accident.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

COSTS_FILE = Path(__file__).resolve().parent.parent / "data" / "container_costs.json"

#: what each cpu kernel build is, for a reader who has not met our names
BUILD_NAMES = {"vnni": "AVX-512 VNNI kernels", "avx2": "AVX2 kernels (no AVX-512)",
               "portable": "portable kernels (no SIMD intrinsics)"}


#: Base-3 containers, and the 2-bit container with the same scales that the cpu backend's
#: avx2 and portable builds repack them into at load (``CpuBackend._repacks``): the same
#: trits and scales, so the same bits (docs/model.md §2). Without AVX-512 a decode step is
#: bound by arithmetic, not by the 8-9 % more bytes the 2-bit rows take, and a base-3 digit
#: costs several instructions where a 2-bit code costs a shift and a mask (docs/benchmarks.md,
#: "Decode of every container"). The vnni build reads them as they are. (On the vnni and avx2
#: builds a matrix whose rows have one scale each is held as stfma rows before any of this,
#: or, on the vnni build where the CPU has AVX-512 VBMI (and no AMX, unless asked for),
#: tq1_0 and iq1_bn as lut3 tiles:
#: ``ONE_SCALE_ROWS`` and ``LUT3_ROWS`` in ``cpu/backend.py``; a measurement's ``held`` says
#: what its build held.)
REPACKED = {"tq1_0": "tq2_0", "iq1_bn": "iq2_bn"}


def measured() -> list[dict[str, Any]]:
    """Every measured CPU and build (empty where the file is missing)."""
    try:
        return json.loads(COSTS_FILE.read_text())["measured"]
    except (OSError, ValueError, KeyError):
        return []


def container_costs(fid: str) -> list[dict[str, Any]]:
    """Container ``fid``'s decode and prefill speed relative to i2_s on each measured CPU and
    build: ``cpu``, ``build``, ``decode``, ``prefill``, ``i2_s_decode_tps``, ``date``."""
    out = []
    for m in measured():
        c = m["containers"].get(fid)
        if c is not None:
            out.append({"cpu": m["cpu"], "cpu_features": m.get("cpu_features", ""),
                        "build": m["build"], "decode": c["decode"], "prefill": c["prefill"],
                        "held": c.get("held"),
                        "i2_s_decode_tps": m["i2_s_decode_tps"], "date": m["date"]})
    return out


def describe(fid: str) -> list[str]:
    """Lines for ``inspect``: per measured CPU and build, how fast ``fid`` decodes against
    i2_s, with a word where it is much slower."""
    lines = []
    for c in container_costs(fid):
        slow = "  (slow here: pick i2_s, tq2_0 or stfma)" if c["decode"] < 0.7 else ""
        held = (f", held as {c['held']} {'tiles' if c['held'] == 'lut3' else 'rows'}"
                if c.get("held") else "")
        lines.append(f"{c['decode']:.2f}x i2_s's decode, {c['prefill']:.2f}x its prefill on "
                     f"{c['cpu']} ({BUILD_NAMES.get(c['build'], c['build'])}{held}; i2_s "
                     f"{c['i2_s_decode_tps']:.1f} tok/s on 2B-4T){slow}")
    return lines
