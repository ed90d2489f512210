"""How many candidates a screened LM head of narrower codes would leave on a Gaussian head.

    python tools/sim_screen_bits.py [--rows 128256] [--dim 2560] [--bits 6,7,8]

The screened head's bound on a row's logit error is dominated by ``||e - d c|| ||x||`` (the
row's rounding error times the hidden state's norm, Cauchy-Schwarz: docs/exact-head.md), so it
scales with the codes' step. This simulates the synthetic 2B-4T's flat case (a random Gaussian
head, a Gaussian hidden state): for each code width it picks, per row, the scale (a fraction of
``max|e|``) that minimizes that row's rounding error, and counts the greedy candidates (rows
whose upper bound reaches the largest lower bound). Only that dominant term is counted, so the
real screen leaves a few more. Numbers quoted by tools/bench_head.py come from the defaults.
"""

from __future__ import annotations

import argparse

import numpy as np

FRACTIONS = (1.0, 0.9, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5)


def simulate(rows: int, dim: int, bits: int, seed: int = 0, chunk: int = 8192) -> int:
    x = np.random.default_rng(seed).standard_normal(dim)
    nx = float(np.linalg.norm(x))
    L = 2 ** (bits - 1) - 1
    a_all, b_all = [], []
    for i, v0 in enumerate(range(0, rows, chunk)):
        E = np.random.default_rng(seed + 1 + i).standard_normal((min(chunk, rows - v0), dim))
        m = np.abs(E).max(axis=1)
        best_r = best_a = None
        for frac in FRACTIONS if bits < 8 else (1.0,):  # int8: the row's max, as at load
            d = m * frac / L
            q = np.clip(np.rint(E / d[:, None]), -L, L) * d[:, None]
            r = np.linalg.norm(E - q, axis=1)
            a = q @ x
            if best_r is None:
                best_r, best_a = r, a
            else:
                keep = r < best_r
                best_r, best_a = np.where(keep, r, best_r), np.where(keep, a, best_a)
        a_all.append(best_a)
        b_all.append(best_r * nx)
    a, b = np.concatenate(a_all), np.concatenate(b_all)
    return int((a + b >= (a - b).max()).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=128256)
    ap.add_argument("--dim", type=int, default=2560)
    ap.add_argument("--bits", default="6,7,8")
    a = ap.parse_args()
    for bits in (int(b) for b in a.bits.split(",")):
        n = simulate(a.rows, a.dim, bits)
        print(f"int{bits}: {n} greedy candidates of {a.rows} rows ({n / a.rows:.2%})")


if __name__ == "__main__":
    main()
