"""Benchmark the runtime: decode tokens/s on the tiny model, and ternary mat-vec bandwidth.

    python tools/bench_runtime.py                  # both parts
    python tools/bench_runtime.py --part decode    # tiny model, both backends, every container
    python tools/bench_runtime.py --part matvec    # 2560x2560 and 6912x2560 i2_s, both kernels
    python tools/bench_runtime.py --part decode --model out/2b4t-i2_s.gguf --backend cpu

The mat-vec part streams each matrix from DRAM: the calls rotate over distinct copies taken
from one buffer of ``--cold-mib`` MiB (default 1536, over the L3 the VM reports), so every call
reads its weights cold. The machine's read bandwidth is a numba ``prange`` row-wise sum over a
1 GiB array (the fastest of the read kernels we tried on these VMs). Timings on a
shared machine are noisy: each figure is the median of ``--repeat`` batches.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def median_time(fn, calls: int, repeat: int) -> float:
    """Median over ``repeat`` batches of the seconds per call."""
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for i in range(calls):
            fn(i)
        out.append((time.perf_counter() - t0) / calls)
    return statistics.median(out)


# -- decode ---------------------------------------------------------------------------------------
def decode_row(path: Path, label: str, backend: str, tokens: int, repeat: int,
               threads: int | None = None) -> None:
    from bitformat.runtime import load

    kw = {"threads": threads} if backend == "cpu" else {}
    with load(path, backend=backend, **kw) as m:
        prompt = list(range(1, 13))
        m.generate(prompt, max_new_tokens=4, stop_ids=[])  # compile, warm the page cache
        runs = [m.generate(prompt, max_new_tokens=tokens, stop_ids=[]).stats for _ in range(repeat)]
        kernel = getattr(m.backend, "kernel", "-")
    p = statistics.median(s.prompt_tps for s in runs)
    g = statistics.median(s.generation_tps for s in runs)
    gbs = g * runs[0].weight_bytes_per_token / 1e9
    print(f"{label:24} {backend:6} {kernel:9} {p:12.1f} {g:12.2f} {gbs:10.1f}")


HEADER = (f"{'model':24} {'backend':6} {'kernel':9} {'prompt tok/s':>12} {'decode tok/s':>12} "
          f"{'weight GB/s':>10}")


def bench_models(paths: list[str], backends: list[str], tokens: int, repeat: int,
                 threads: int | None) -> None:
    print(f"decode, {tokens} new tokens after a 12-token prompt")
    print(HEADER)
    for p in paths:
        for backend in backends:
            decode_row(Path(p), Path(p).name, backend, tokens, repeat, threads)


def bench_decode(tokens: int, repeat: int, threads: int | None) -> None:
    from bitformat.container import convert
    from bitformat.formats import FORMAT_IDS
    from bitformat.synth import synth

    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "tiny-i2_s.gguf"
        synth("tiny", src, seed=0)
        print(f"decode, tiny synthetic model, {tokens} new tokens after a 12-token prompt")
        print(HEADER)
        for fid in FORMAT_IDS:
            path = src if fid == "i2_s" else Path(d) / f"tiny-{fid}.gguf"
            if fid != "i2_s":
                convert(src, path, fid)
            for backend in ("numpy", "cpu"):
                decode_row(path, f"tiny {fid}", backend, tokens, repeat, threads)


# -- mat-vec bandwidth ----------------------------------------------------------------------------
def read_bandwidth(repeat: int) -> float:
    """The machine's read bandwidth (GB/s) as the fastest of two 2-thread read kernels over
    1 GiB (huge pages): numba row sums as they come, and the same sums with each thread
    prefetching 8 KiB ahead into L2 (``prefetcht1``, as the model's kernels do). On the AMD
    EPYC VMs of these benchmarks the first reached 40-43 GB/s; on an Intel Xeon
    (AMX) VM it gives 16-17 GB/s while the f16 LM head kernel streams 28-29, so without the
    second the "bandwidth floor" would be below what the model's own kernels read."""
    import numba
    from llvmlite import ir
    from numba import njit, prange, types
    from numba.extending import intrinsic

    from bitformat.runtime.cpu.kernels import L2, _prefetch

    @intrinsic
    def prefetch(typingctx, a, i):
        def codegen(context, builder, signature, args):
            ptr = context.make_array(signature.args[0])(context, builder, args[0]).data
            _prefetch(builder, builder.bitcast(ptr, ir.IntType(8).as_pointer()),
                      builder.mul(args[1], ir.Constant(args[1].type, 8)), L2)
            return context.get_dummy_value()

        return types.void(a, types.intp), codegen

    @njit(parallel=True)
    def rowsum(a, out):
        for r in prange(a.shape[0]):
            row = a[r]
            acc = np.uint64(0)
            for k in range(row.shape[0]):
                acc += row[k]
            out[r] = acc

    @njit(parallel=True)
    def rowsum_prefetch(a, out):
        flat = a.reshape(-1)
        n = a.shape[1]
        for r in prange(a.shape[0]):
            row = a[r]
            acc = np.uint64(0)
            for k0 in range(0, n, 8):  # a line of 8 values; prefetch 8 KiB ahead
                prefetch(flat, min(r * n + k0 + 1024, flat.size - 1))
                for k in range(k0, min(k0 + 8, n)):
                    acc += row[k]
            out[r] = acc

    a = np.ones((1 << 14, 1 << 13), dtype=np.uint64)  # 1 GiB
    out = np.empty(a.shape[0], np.uint64)
    best = 0.0
    # every core: numba's thread count is per calling thread, and a loaded model's cpu
    # backend may have left it at 1 (its small mat-vecs run on one thread)
    before = numba.get_num_threads()
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    try:
        for fn in (rowsum, rowsum_prefetch):
            fn(a, out)
            assert int(out[0]) == a.shape[1]
            best = max(best, a.nbytes / median_time(lambda i, fn=fn: fn(a, out), 1, repeat) / 1e9)
    finally:
        numba.set_num_threads(before)
    return best


def bench_matvec(cold_mib: int, repeat: int) -> None:
    from bitformat.runtime.cpu import kernels as K

    bw = read_bandwidth(repeat)
    print(f"read bandwidth (fastest numba read kernel, 1 GiB): {bw:.1f} GB/s")
    pool = np.empty(cold_mib << 20, dtype=np.uint8)
    pool[:] = np.arange(pool.size, dtype=np.uint64).astype(np.uint8)  # any bytes time the same
    modes = ["portable"] + (["vnni"] if K.kernel_mode() == "vnni" else [])
    print(f"{'matrix':12} {'kernel':9} {'us/matvec':>10} {'GB/s':>6} {'of read bw':>10}")
    rng = np.random.default_rng(0)
    for rows, cols in ((2560, 2560), (6912, 2560)):
        nbytes = rows * cols // 4
        copies = [pool[i * nbytes:(i + 1) * nbytes].reshape(rows, cols // 4)
                  for i in range(pool.size // nbytes)]
        q = rng.integers(-127, 128, (1, cols)).astype(np.int8)
        xg = K.slot_activations(q, "x86", cols)
        corr, s, out = q.sum(1, dtype=np.int32), np.float32([1.0]), np.empty((1, rows), np.float32)
        for mode in modes:
            fn = K.mm2_vnni if mode == "vnni" else K.mm2_portable
            args = (xg, corr, s, np.float32(1.0), K.KIND_I2S, out)
            fn(copies[0], *args)  # compile
            dt = median_time(lambda i, fn=fn, w=copies, a=args: fn(w[i % len(w)], *a),
                             len(copies), repeat)
            print(f"{rows}x{cols:<7} {mode:9} {dt * 1e6:10.0f} {nbytes / dt / 1e9:6.1f} "
                  f"{nbytes / dt / 1e9 / bw:10.0%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["all", "decode", "matvec"], default="all")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cold-mib", type=int, default=1536)
    ap.add_argument("--threads", type=int, default=None,
                    help="cpu threads (default: decode adapts between 1 and all cores)")
    ap.add_argument("--model", nargs="+", help="decode these containers instead of the tiny one")
    ap.add_argument("--backend", nargs="+", default=["cpu"], choices=["cpu", "numpy"],
                    help="backends for --model")
    a = ap.parse_args()
    from bitformat.runtime.cpu.kernels import kernel_mode

    print(f"cpu kernel build: {kernel_mode()}")
    if a.part in ("all", "decode"):
        if a.model:
            bench_models(a.model, a.backend, a.tokens, a.repeat, a.threads)
        else:
            bench_decode(a.tokens, a.repeat, a.threads)
    if a.part in ("all", "matvec"):
        if a.threads:
            import numba

            numba.set_num_threads(a.threads)
        bench_matvec(a.cold_mib, a.repeat)


if __name__ == "__main__":
    main()
