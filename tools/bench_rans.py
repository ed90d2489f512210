"""Throughput and size of the numba rANS coder (developer benchmark, not a test).

    python bench_rans.py [--rows 2560] [--cols 6912] [--p0 0.42] [--threads 2] [--reps 5]

Trits are i.i.d. with P(0) = p0 (a 2560 x 6912 FFN matrix has 17,694,720 of them). Times are
the best of ``reps`` runs after a warm-up; bpw counts the stream words only (no offsets,
tables or header).
"""
from __future__ import annotations

import argparse
import time

import numba
import numpy as np

from bitformat.codecs import rans_tables as rt
from bitformat.codecs.rans_streams import (
    RansTables,
    decode_trit_streams,
    encode_trit_streams,
    row_segment_offsets,
    segment_offsets,
)


def best(fn, reps):
    """(best wall time, best CPU time of the whole process, result) over ``reps`` runs.

    CPU time is what a single-threaded run costs even on a loaded machine; with threads it is
    the sum over threads."""
    wall, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        r = fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return min(wall), min(cpu), r


def info_bits(trits, off, units, group):
    """Information content of the symbols actually coded (padding included) under the table."""
    cost = -np.log2(units / rt.UNITS)
    if group == 1:
        return float(cost[trits + 1].sum())
    lens = np.diff(off)
    pad = (-lens) % 5
    codes = np.ones(trits.size + int(pad.sum()), dtype=np.int64)
    dest = np.arange(trits.size) + np.repeat(np.cumsum(pad) - pad, lens)
    codes[dest] = trits + 1
    return float(cost[codes.reshape(-1, 5) @ np.array([81, 27, 9, 3, 1])].sum())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2560)
    ap.add_argument("--cols", type=int, default=6912)
    ap.add_argument("--p0", type=float, default=0.42)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    n = a.rows * a.cols
    rng = np.random.default_rng(0)
    trits = rng.choice(np.int8([-1, 0, 1]), size=n, p=[(1 - a.p0) / 2, a.p0, (1 - a.p0) / 2])
    counts = rt.count_trits(trits)
    h0 = rt.entropy_bits(counts)
    print(f"{n} trits ({a.rows} x {a.cols}), zero share {counts[1] / n:.4f}, order-0 entropy "
          f"{h0:.4f} bits; numba {numba.__version__}, {numba.config.NUMBA_NUM_THREADS} CPUs")
    layouts = [("1 stream", np.array([0, n], dtype=np.int64)),
               ("flat 4096", segment_offsets(n, 4096)),
               ("flat 4095", segment_offsets(n, 4095)),
               (f"rows {a.cols}", row_segment_offsets(a.rows, a.cols, 4096))]
    print(f"{'mode':7} {'layout':12} {'streams':>7} {'thr':>3} {'enc Mtrit/s':>11} "
          f"{'dec Mtrit/s':>11} {'enc/CPU-s':>9} {'dec/CPU-s':>9} {'bpw':>7} {'bpw-H0':>7} {'bits/stream':>11}")
    for mode in ("trit", "group5"):
        tables = RansTables.fit(trits, mode)
        for name, off in layouts:
            for par, threads in ((False, 1), (True, a.threads)):
                if off.size == 2 and par:
                    continue
                numba.set_num_threads(threads)
                warm = segment_offsets(50_000, 4096)
                encode_trit_streams(trits[:50_000], warm, tables, parallel=par)
                te, ce, (words, woff) = best(
                    lambda: encode_trit_streams(trits, off, tables, parallel=par), a.reps)
                out = np.empty(n, dtype=np.int8)
                td, cd, back = best(lambda: decode_trit_streams(words, woff, off, tables, out=out,
                                                            parallel=par), a.reps)
                assert np.array_equal(back, trits)
                bits = words.size * 32
                over = (bits - info_bits(trits, off, tables.units[0], tables.group)) / (off.size - 1)
                print(f"{mode:7} {name:12} {off.size - 1:>7} {threads:>3} {n / te / 1e6:>11.1f} "
                      f"{n / td / 1e6:>11.1f} {n / ce / 1e6:>9.1f} {n / cd / 1e6:>9.1f} "
                      f"{bits / n:>7.4f} {bits / n - h0:>+7.4f} "
                      f"{over:>11.1f}")


if __name__ == "__main__":
    main()
