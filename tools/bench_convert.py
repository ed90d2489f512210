"""Benchmark: convert the full-size synthetic 2B-4T model between containers.

Each conversion runs in its own process (``bitformat convert``), so its peak resident memory
(ru_maxrss of that child) and wall time are its own. Results go to stdout and, with
``--write``, replace the "Conversion" section of docs/benchmarks.md.

    python tools/bench_convert.py --model out/bench/2b4t.gguf --write
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchdoc import replace_section

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
CHAIN = ["tq2_0", "tq1_0", "stfma", "colpack_u32", "i2_s"]


def run_child(args: list[str]) -> tuple[float, float]:
    """(seconds, peak RSS in GiB) of one bitformat command in a fresh process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "bitformat.cli", *args])
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"bitformat {' '.join(args)} failed")
    return seconds, usage.ru_maxrss / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", type=Path, default=ROOT / "out" / "bench" / "2b4t.gguf")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = ap.parse_args()
    model = args.model
    model.parent.mkdir(parents=True, exist_ok=True)
    if not model.exists():
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "bitformat.cli", "synth", "--preset", "2b4t",
                        "-o", str(model)], check=True)
        print(f"synth 2b4t: {time.perf_counter() - t0:.1f} s")
    from bitformat import open_model

    with open_model(model) as m:
        weights = sum(e.n_elements for e in m.entries if e.ternary)
    rows = []
    src = model
    for fmt in CHAIN:
        dst = model.with_name(f"2b4t.{fmt}.gguf")
        times, peaks = [], []
        for _ in range(args.repeats):
            t, peak = run_child(["convert", str(src), "--to", fmt, "-o", str(dst)])
            times.append(t)
            peaks.append(peak)
        med = statistics.median(times)
        rows.append((f"{src.name.split('.')[1] if src != model else 'i2_s'} -> {fmt}",
                     med, weights / med / 1e6, max(peaks), dst.stat().st_size))
        print(f"{rows[-1][0]:<22} {med:6.2f} s  {rows[-1][2]:7.1f} M weights/s  "
              f"peak {max(peaks):.2f} GiB")
        src = dst
    final_same = model.read_bytes() == src.read_bytes()
    print("chain back to i2_s byte-identical:", final_same)
    for fmt in CHAIN[:-1]:
        model.with_name(f"2b4t.{fmt}.gguf").unlink(missing_ok=True)
    if args.write:
        lines = [
            "## Conversion (full-size synthetic 2B-4T)",
            "",
            f"Command: `python tools/bench_convert.py --write` ({platform.machine()}, "
            f"{os.cpu_count()} cores, Python {platform.python_version()}). Each conversion "
            f"runs in a fresh process; median of {args.repeats} runs; peak is the child's "
            f"max RSS (memory-mapped source pages included). {weights:,} ternary weights.",
            "",
            "| conversion | median s | M weights/s | peak RSS GiB | output bytes |",
            "|---|---|---|---|---|",
        ]
        for name, med, rate, peak, size in rows:
            lines.append(f"| {name} | {med:.2f} | {rate:.0f} | {peak:.2f} | {size:,} |")
        lines += ["", f"Chain i2_s -> ... -> i2_s byte-identical: {final_same}.",
                  "Targets (issue 2): >= 100 M weights/s, peak < 2.5 GiB."]
        replace_section(DOC, "Conversion (full-size synthetic 2B-4T)", "\n".join(lines))


if __name__ == "__main__":
    main()
