"""What makes the same decode run at two speeds: each core's vector and scalar rate over time.

    python tools/probe_cpu_rate.py [MODEL.gguf] [--rounds 6] [--gap SECONDS] [--write]

On the 2-core VMs of these benchmarks, separate ``bitformat`` processes decoded the same
file at ~33 or ~42 tokens/s (issue 23), and within one process the rate moved too. This probe
alternates, per round and per core (the process pinned to it with ``sched_setaffinity``):

- ``vector``: a mat-vec that stays in L2 (512 x 2,560 trits, one thread, the cpu backend's
  2-bit kernel of this build): the core's vector units alone, no memory traffic;
- ``scalar``: a chain of dependent float64 multiply-adds (one thread): the core's clock;

and, where MODEL is given, 32 greedy decode steps of it on both cores. If the decode rate
moves with ``vector`` while ``scalar`` stays put, the cores' vector units are shared with work
outside this VM (another tenant's thread on the same physical core), which no setting inside
the VM changes. CPU time other processes of this VM took is reported (/proc/stat).
``--write`` puts the table into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from bench_base3 import Others  # noqa: E402
from bench_cold_start import cpu_name  # noqa: E402

SECTION = "Two decode speeds: the cores' vector rate over time (cpu)"


def probes():
    """(vector, scalar): callables returning seconds a call of each probe on this thread."""
    from numba import njit

    from bitformat.runtime.backend import quantize_activations
    from bitformat.runtime.cpu import kernels as K

    rng = np.random.default_rng(0)
    rows, cols = 512, 2560
    w = rng.integers(0, 256, (rows, cols // 4), dtype=np.uint8)
    w[w & 3 == 3] ^= 1
    qa = quantize_activations(rng.standard_normal((1, cols)).astype(np.float32))
    xg = K.slot_activations(qa.q, "x86", cols)
    corr = qa.q.sum(axis=1, dtype=np.int32)
    out = np.empty((1, rows), np.float32)
    ws = np.ones(rows, np.float32)
    mode = K.kernel_mode()
    mv = {"vnni": K.mm2_vnni, "avx2": K.MM2_AVX2[K.KIND_I2S]}.get(
        mode, K.MM2_PORTABLE[K.KIND_I2S])

    @njit(cache=False)
    def chain(n):
        a = 1.0
        for _ in range(n):
            a = a * 1.0000001 + 1e-9
        return a

    def vector(calls: int = 3000) -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            mv(w, xg, corr, qa.s, ws, K.KIND_I2S, out)
        return (time.perf_counter() - t0) / calls

    def scalar(n: int = 30_000_000) -> float:
        t0 = time.perf_counter()
        chain(n)
        return time.perf_counter() - t0

    vector(10), scalar(10)  # compile
    return vector, scalar


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--gap", type=float, default=0.0, help="seconds idle between rounds")
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args()
    from numba import set_num_threads

    cpus = sorted(os.sched_getaffinity(0))
    vector, scalar = probes()
    m = None
    if a.model:
        from bitformat.runtime import load

        m = load(a.model, backend="cpu", threads=len(cpus))
        m.warmup(parts=("prompt", "step"))
    rows, other = [], 0.0
    for r in range(a.rounds):
        with Others() as o:
            row = {"round": r + 1, "time": time.strftime("%H:%M:%S")}
            set_num_threads(1)
            for c in cpus:
                os.sched_setaffinity(0, {c})
                row[f"vector{c}"], row[f"scalar{c}"] = vector(), scalar()
            os.sched_setaffinity(0, set(cpus))
            set_num_threads(len(cpus))
            if m is not None:
                row["decode"] = m.generate(list(range(1, 9)), max_new_tokens=33,
                                           stop_ids=[]).stats.generation_tps
        other = max(other, o.cores)
        rows.append(row)
        print(row, flush=True)
        if r + 1 < a.rounds:
            time.sleep(a.gap)
    head = ["round", "time"] + [f"core {c}: vector us, scalar ms" for c in cpus] + (
        ["decode tok/s (both cores)"] if m is not None else [])
    lines = [f"## {SECTION}", "",
             f"Command: `python tools/probe_cpu_rate.py{' 2b4t.gguf' if m else ''} --rounds "
             f"{a.rounds} --gap {a.gap:g}`. Machine: {cpu_name()}. Vector: one thread's "
             "in-cache 2-bit mat-vec (512 x 2,560), per call; scalar: 30 M dependent float64 "
             "multiply-adds; decode: 32 greedy steps after 8 tokens (the model's rate with the "
             "cache warm). Other "
             f"processes took at most {other:.2f} cores.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [str(row["round"]), row["time"]] + [
            f"{row[f'vector{c}'] * 1e6:.1f}, {row[f'scalar{c}'] * 1e3:.0f}" for c in cpus]
        if m is not None:
            cells.append(f"{row['decode']:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.write:
        from benchdoc import DOC, replace_section

        replace_section(DOC, SECTION, text, after="Serving concurrent clients (full-size "
                                                  "synthetic 2B-4T)")


if __name__ == "__main__":
    main()
