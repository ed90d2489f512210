"""The cpu backend's attention kernels by themselves, at a long context: what a decode step's and
a prompt chunk's attention cost, apart from the rest of the model.

    python tools/bench_attention.py [--positions 3072] [--rounds 5] [--baseline DIR] [--json F]

Shapes of 2B-4T (20 query heads, 5 KV heads of 128, 30 layers), the caches random float16 (or
``--kv-cache``) of ``--positions`` positions per layer, every layer its own array: 30 layers at
3,072 positions are 236 MB, more than the CPU's caches, as in a real step. Measured:

- decode: one token's attention in each of the 30 layers (the split kernel, its runs of
  positions among threads), ms per step;
- prompt: a 64-token chunk's attention ending at the last position, in each layer, ms per
  chunk.

Each variant runs in a worker process of its own (this tree, and ``--baseline DIR``, another
source tree, e.g. a ``git worktree`` of an older commit; a tree from before
``ops.attend_split`` runs ``attend_one_split`` and, for prompts, numpy's matrix products on one
thread, as its cpu backend did). Rounds alternate the variants; each round's figure is the
median of ``--reps`` calls; the table gives the medians over rounds. The CPU other processes took
during each measurement is recorded (/proc/stat less the worker's own time, in cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from bench_cold_start import cpu_name  # noqa: E402
from bench_load import TreeWorker, _self_cpu  # noqa: E402

MSG = "@@attn "
LAYERS, HEADS, KV_HEADS, HEAD_DIM, CHUNK = 30, 20, 5, 128, 64


# -- the worker --------------------------------------------------------------------------------
class Kernels:
    """This tree's attention on random caches of the 2B-4T shapes."""

    def __init__(self, positions: int, kv: str):
        import numpy as np

        from bitformat.runtime import kvquant
        from bitformat.runtime.cpu import ops

        self.np, self.ops, self.kvquant, self.kv = np, ops, kvquant, kv
        rng = np.random.default_rng(0)
        n = positions
        self.n = n
        shape = (n, KV_HEADS, kvquant.row_width(kv, HEAD_DIM))
        self.kc, self.vc = [], []
        for _ in range(LAYERS):
            for caches in (self.kc, self.vc):
                c = np.zeros(shape, kvquant.storage_dtype(kv))
                kvquant.store(c, 0, rng.standard_normal((n, KV_HEADS, HEAD_DIM))
                              .astype(np.float32))
                caches.append(c)
        self.q = rng.standard_normal((CHUNK, HEADS, HEAD_DIM)).astype(np.float32)
        self.k = rng.standard_normal((CHUNK, KV_HEADS, HEAD_DIM)).astype(np.float32)
        ang = rng.uniform(0, 6, (CHUNK, HEAD_DIM // 2))
        self.cos, self.sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        self.out = np.empty((CHUNK, HEADS * HEAD_DIM), np.float32)
        self.split = getattr(ops, "attend_split", None)
        self.decode(), self.prompt()  # compiled, or read from numba's cache

    def decode(self) -> None:
        ops, pos, q, k = self.ops, self.n - 1, self.q, self.k
        for layer in range(LAYERS):
            kc, vc = ops.kernel_cache(self.kc[layer]), ops.kernel_cache(self.vc[layer])
            if self.split is not None:
                self.split(q[:1], k[:1], k[:1], self.cos[:1], self.sin[:1], kc, vc, pos,
                           self.out[:1])
            else:  # a tree from before attend_split
                ops.attend_one_split(q[0], k[0], k[0], self.cos[0], self.sin[0], kc, vc, pos,
                                     self.out[0])

    def prompt(self) -> None:
        ops, start = self.ops, self.n - CHUNK
        for layer in range(LAYERS):
            if self.split is not None:
                self.split(self.q, self.k, self.k, self.cos, self.sin,
                           ops.kernel_cache(self.kc[layer]), ops.kernel_cache(self.vc[layer]),
                           start, self.out)
            else:  # numpy's matrix products on one thread, as the cpu backend ran prompts
                from threadpoolctl import threadpool_limits  # (that tree's dependency)

                from bitformat.runtime.backend import Backend

                with threadpool_limits(limits=1, user_api="blas"):
                    Backend.attend(None, self.q, self.k, self.k, self.kc[layer],
                                   self.vc[layer], start, self.cos, self.sin)

    def measure(self, what: str, reps: int) -> float:
        run = self.decode if what == "decode" else self.prompt
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3


def worker(positions: int, kv: str) -> None:
    k = Kernels(positions, kv)
    print(MSG + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        what, reps = line.split()
        c0 = _self_cpu()
        ms = k.measure(what, int(reps))
        print(MSG + json.dumps({"ms": ms, "cpu": _self_cpu() - c0}), flush=True)


# -- the parent --------------------------------------------------------------------------------
class Worker(TreeWorker):
    def __init__(self, name: str, tree: Path, positions: int, kv: str):
        super().__init__(name, tree, [str(Path(__file__).resolve()), "--worker", "--positions",
                                      str(positions), "--kv-cache", kv], MSG)

    def measure(self, what: str, reps: int) -> dict:
        return self.ask(f"{what} {reps}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--positions", type=int, default=3072)
    ap.add_argument("--kv-cache", default="f16", choices=["f16", "f32", "q8_0"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=7, help="calls per measurement (median)")
    ap.add_argument("--baseline", type=Path, help="another source tree to compare against")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.worker:
        worker(a.positions, a.kv_cache)
        return
    trees = [("this tree", ROOT)] + ([("before", a.baseline.resolve())] if a.baseline else [])
    workers = [Worker(name, tree, a.positions, a.kv_cache) for name, tree in trees]
    results: dict[str, dict[str, list[dict]]] = {w.name: {"decode": [], "prompt": []}
                                                 for w in workers}
    t0 = time.time()
    try:
        for r in range(a.rounds):
            for what in ("decode", "prompt"):
                for w in workers if r % 2 == 0 else workers[::-1]:
                    m = w.measure(what, a.reps)
                    results[w.name][what].append(m)
                    print(f"round {r} {w.name:<10} {what:<7} {m['ms']:8.2f} ms "
                          f"(other {m['other']:.2f})", file=sys.stderr, flush=True)
    finally:
        for w in workers:
            w.close()
    kv_mb = LAYERS * a.positions * KV_HEADS * 2 * {"f16": 2, "f32": 4, "q8_0": 1.0625}[
        a.kv_cache] * HEAD_DIM / 1e6
    print(f"\nMachine: {cpu_name()}. {a.positions} positions of 2B-4T's {a.kv_cache} cache, "
          f"{LAYERS} layers ({kv_mb:.0f} MB); medians over {a.rounds} rounds of the median of "
          f"{a.reps} calls; other processes at most "
          f"{max(m['other'] for v in results.values() for x in v.values() for m in x):.2f} "
          f"cores during a measurement.\n")
    print("| tree | decode step, 30 layers (ms) | 64-token prompt chunk, 30 layers (ms) |")
    print("|---|---|---|")
    for name, v in results.items():
        d, p = (statistics.median(m["ms"] for m in v[k]) for k in ("decode", "prompt"))
        print(f"| {name} | {d:.2f} ({kv_mb / d:.0f} GB/s) | {p:.1f} |")
    if a.json:
        a.json.write_text(json.dumps({"cpu": cpu_name(), "positions": a.positions,
                                      "kv": a.kv_cache, "rounds": a.rounds, "reps": a.reps,
                                      "minutes": (time.time() - t0) / 60, "results": results},
                                     indent=1) + "\n")


if __name__ == "__main__":
    main()
