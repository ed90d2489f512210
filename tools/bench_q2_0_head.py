"""The LM head of Ternary Bonsai 8B (151936 x 4096) on the cpu backend: its q2_0 head
(llama.cpp's Q2_0 x Q8_0 sums, :func:`bitformat.runtime.cpu.head.lm_head_q2_0`) against the
f16 head of the same shape, one token, median of ``--repeat`` after a warm-up.

    flock /tmp/bitformat-cpu.lock python tools/bench_q2_0_head.py [--vocab 151936 --dim 4096]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    from bitformat.runtime.backend import q8_0_activations
    from bitformat.runtime.cpu import head as H

    rng = np.random.default_rng(0)
    nb = a.dim // 64
    E = np.empty((a.vocab, nb * 18), np.uint8)
    E.reshape(a.vocab, nb, 18)[:, :, 2:] = rng.choice(np.uint8([0x55, 0x15, 0x94, 0x61]),
                                                      (a.vocab, nb, 16))
    E.reshape(a.vocab, nb, 18)[:, :, :2] = np.array([0.02], np.float16).view(np.uint8)
    F = (rng.standard_normal((a.vocab, a.dim), np.float32) * 0.02).astype(np.float16)
    F = F.view(np.uint16)
    x = rng.standard_normal((1, a.dim)).astype(np.float32)
    lut = H.lut16("F16")
    out = np.empty((1, a.vocab), np.float32)

    def q2():
        q, d = q8_0_activations(x)
        H.lm_head_q2_0(E, lut, q, d, out)

    def f16():
        H.lm_head_f16(F, x, out)

    for name, fn, nbytes in (("q2_0", q2, E.nbytes), ("f16", f16, F.nbytes)):
        fn()
        ts = []
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        t = statistics.median(ts)
        print(f"{name:5s} head {a.vocab}x{a.dim}: {nbytes / 1e6:7.1f} MB, {t * 1e3:7.1f} ms "
              f"per token ({nbytes / t / 1e9:5.1f} GB/s)")


if __name__ == "__main__":
    main()
