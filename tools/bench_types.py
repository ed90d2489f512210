"""Decode speed of the ternary GGUF types (q2_0, iq2_bn, iq1_bn) against i2_s on the
full-size synthetic 2B-4T, cpu backend, interleaved rounds (tools/bench_decode.py's workers).

    python tools/bench_types.py --model out/bench/2b4t.gguf --write

The new types run portable numba kernels (no VNNI build yet), i2_s its usual best kernel;
the CPU time other processes took during the run is read from /proc/stat and reported.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

SECTION = "Decode of the ternary GGUF types (full-size synthetic 2B-4T)"
TYPES = ("q2_0", "iq2_bn", "iq1_bn")


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = f[3] + f[4]
    return sum(f) - idle, sum(f)


def main() -> None:
    import bench_decode as bd

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="out/bench/2b4t.gguf", help="an i2_s 2B-4T synth")
    ap.add_argument("--out", default="out/bench", help="folder for the converted files")
    ap.add_argument("--types", nargs="+", default=list(TYPES), choices=TYPES)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    a = ap.parse_args()
    src = Path(a.model)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    paths, made = bd.convert_missing(src, out, ["i2_s", *a.types], "types")
    prompt = bd.make_prompt(src, a.prompt)
    busy0, total0 = cpu_ticks()
    t0 = time.perf_counter()
    try:
        specs = [(fid, "bitformat", paths[fid], a.threads) for fid in paths]
        rows = bd.run_group(specs, prompt, a.tokens, a.repeat, 0)
    finally:
        if not a.keep:
            for p in made:
                p.unlink(missing_ok=True)
    busy1, total1 = cpu_ticks()
    elapsed = time.perf_counter() - t0
    share = (busy1 - busy0) / max(1, total1 - total0)
    cmd = (f"python tools/bench_types.py --model {a.model} --write --threads {a.threads} "
           f"--prompt {a.prompt} --tokens {a.tokens} --repeat {a.repeat}")
    lines = [f"## {SECTION}", "",
             f"Command: `{cmd}`, under `flock /tmp/bitformat-cpu.lock`, on {bd.machine()} "
             f"(lscpu's name; the project notes call this shared VM an AMD EPYC); "
             f"{elapsed:.0f} s, machine CPU busy "
             f"{100 * share:.0f}% over the run (/proc/stat; {a.threads} threads are "
             f"{100 * a.threads / max(1, os.cpu_count() or 1):.0f}% of it). "
             "Rounds interleave the containers. q2_0, iq2_bn and iq1_bn run portable numba "
             "kernels (runtime/cpu/kernels.py); i2_s its usual kernel.", "",
             "| container | bytes read a token | prefill tok/s | decode tok/s: median (rounds) |",
             "|---|---|---|---|"]
    for r in rows:
        runs = ", ".join(f"{x:.2f}" for x in r["decode_all"])
        lines.append(f"| {r['label']} | {r['bytes'] / 1e9:.3f} GB | {r['prefill_tps']:.1f} | "
                     f"{r['decode_tps']:.2f} ({runs}) |")
    report = "\n".join(lines) + "\n"
    print(report)
    if a.write:
        from benchdoc import DOC, replace_section

        replace_section(DOC, SECTION, report)
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
