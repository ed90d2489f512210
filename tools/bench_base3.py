"""tq1_0 and iq1_bn against i2_s on a CPU: base-3 digits cost more to take apart than the bytes
they save; a table lookup per three trits (lut3) does not take them apart.

    python tools/bench_base3.py [--rows 6912 --cols 2560] [--copies 30] [--rounds 3]
                                [--tokens 1] [--write]

tq1_0 packs five trits in a byte (1.6 bits a weight in its 5-trit bytes, 1.69 with the block
scales) where i2_s takes 2 bits, so a mat-vec that streams its weights from memory reads 16 %
fewer bytes. That helps only if the kernel is bound by memory. This times the vnni build's
one-token kernels on one matrix shape (2B-4T's FFN up projection by default):

- ``cold``: ``--copies`` distinct random matrices in turn (several times the L3), so the bytes
  come from memory, as in a decode step;
- ``hot``: the same matrix every call, so it stays in L2/L3 and the time is the kernel's
  arithmetic alone.

``i2_s`` is :func:`bitformat.runtime.cpu.kernels.mm2_vnni` (2-bit codes: a mask and a
vpdpbusd per 64 trits); ``tq1_0`` is :func:`~bitformat.runtime.cpu.kernels.tq1_vnni` (each
base-3 digit made from the byte by adds and two compares before its vpdpbusd); ``lut3`` is
:func:`~bitformat.runtime.cpu.kernels.mm_lut3` on the same trits repacked at load as the cpu
backend holds tq1_0 and iq1_bn on CPUs with AVX-512 VBMI (:mod:`bitformat.runtime.cpu.lut3`:
a vpermb table lookup per three trits, 1.67 bits a weight). ``--tokens`` above 1 times a
prompt's mat-mul instead (i2_s's batched kernel; lut3 passes over a tile two tokens at a
time), per token, in a section of its own. Reported: time,
GB/s of the weights' bytes and G trits/s, medians over ``--rounds``, and the CPU time other
processes took meanwhile (``/proc/stat``). ``--write`` puts the table into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from bench_cold_start import cpu_name  # noqa: E402
from bench_containers import cpu_ticks  # noqa: E402

SECTION = "Base-3 digits against 2-bit codes (one mat-vec, cpu)"
#: what the figures mean (kept under the table when ``--write`` rewrites it)
AFTER_TABLE = """
From memory, i2_s's kernel streams at most of the machine's read bandwidth (~32 GB/s), and in
cache it runs 1.5-1.9x faster still: its arithmetic has room to spare. The base-3 kernel runs
at the same speed cold and hot: it is bound by its arithmetic, not by memory, so reading 16 %
fewer bytes buys nothing. Counting vector instructions per 64 weight bytes on AVX-512: i2_s's
256 trits take a load, four masks, four activation loads and four vpdpbusd (13, 0.05 a trit);
320 base-3 trits take, per digit, two byte adds (times 3), two compares, two masked moves that
make the digit, an activation load and a vpdpbusd (40 in all, 0.125 a trit), 2.5x as many.

lut3 (`runtime/cpu/lut3.py`) never makes digits: each group of three columns gets a table, per
token, of the 14 values three trits can give with the first nonzero one +1, and each row holds
a 4-bit index and a sign per group (1.67 bits a weight). One vpermb looks up 64 (row, group)
pairs of 16 rows and four groups, for the low bytes and again for the high bytes of the table's
16-bit values, and one vpdpbusd per half sums a row's four groups with their signs: 16 vector
instructions for 384 trits (0.042 a trit), plus the tables' loads. In cache it runs about as
fast as i2_s's kernel; from memory it reads 16 % fewer bytes, and with tiles of 64 rows
interleaved block by block (one stream, prefetched 16 KB ahead into L2) it streams faster than
i2_s's two-row kernel does. The whole model, and where the cpu backend holds tq1_0 and iq1_bn
as lut3 tiles: "lut3 tiles for tq1_0 and iq1_bn" below.
"""


def matrices(rows: int, cols: int, copies: int, rng) -> dict[str, list[np.ndarray]]:
    """``copies`` random ternary matrices in each layout: i2_s rows (codes 0..2, 4 a byte)
    and tq1_0 rows (54-byte blocks of 256 trits, scale 1.0), and those trits as lut3 tiles."""
    from bitformat.formats.tq1_0 import pack_blocks
    from bitformat.runtime.cpu import lut3

    nb = cols // 256
    out: dict[str, list[np.ndarray]] = {"i2_s": [], "tq1_0": [], "lut3": []}
    for _ in range(copies):
        w = rng.integers(0, 256, (rows, cols // 4), dtype=np.uint8)
        w[w & 3 == 3] ^= 1  # code 3 is not a trit
        out["i2_s"].append(w)
        digits = rng.integers(0, 3, (rows * nb, 256)).astype(np.uint8)
        blk = np.empty((rows * nb, 54), np.uint8)
        blk[:, :52] = pack_blocks(digits)
        blk[:, 52:] = np.array([1.0], "<f2").view(np.uint8)
        out["tq1_0"].append(blk.reshape(rows, nb * 54))
        tiles = lut3.pack(digits.reshape(rows, cols).astype(np.int8) - 1)
        tiles.setflags(write=False)
        out["lut3"].append(tiles)
    return out


def kernels(rows: int, cols: int, rng, tokens: int = 1) -> dict:
    """Each layout's mat-vec (``tokens`` 1) or mat-mul of ``tokens`` rows of activations, as
    the cpu backend runs it, as a function of its matrix: i2_s's batched kernel for 2-16 tokens
    (:func:`~bitformat.runtime.cpu.batch.mm2_vnni_tokens`) and its prompt kernel beyond."""
    from bitformat.runtime.backend import quantize_activations
    from bitformat.runtime.cpu import batch as B
    from bitformat.runtime.cpu import kernels as K
    from bitformat.runtime.cpu import lut3

    qa = quantize_activations(rng.standard_normal((tokens, cols)).astype(np.float32))
    xg = K.slot_activations(qa.q, "x86", cols)
    corr = qa.q.sum(axis=1, dtype=np.int32)
    bsum = K.block_sums(qa.q)
    out = np.empty((tokens, rows), np.float32)
    ws = np.ones(rows, np.float32)
    tb = np.empty((tokens, lut3.table_bytes(cols)), np.uint8)
    K.lut3_tables(qa.q, tb)
    mm2 = K.mm2_vnni if tokens == 1 else B.mm2_vnni_tokens if tokens <= 16 else K.mm2_vnni_prompt
    return {"i2_s": lambda w: mm2(w, xg, corr, qa.s, ws, K.KIND_I2S, out),
            "tq1_0": lambda w: K.tq1_vnni(w, qa.q, bsum, qa.s, out),
            "lut3": lambda w: K.mm_lut3(w, tb, qa.s, ws, out)}


def timed(f, ws: list[np.ndarray], hot: bool, passes: int = 5) -> float:
    """Seconds a call: ``passes`` times over ``ws`` (or its first matrix, ``hot``)."""
    t0 = time.perf_counter()
    for _ in range(passes):
        for w in ws:
            f(ws[0] if hot else w)
    return (time.perf_counter() - t0) / (passes * len(ws))


class Others:
    """Cores' worth of CPU time that other processes took while the block ran (/proc/stat
    less this process's own time; a block should last a good many clock ticks)."""

    def __enter__(self) -> Others:
        self.b0, self.t0, self.own0 = cpu_ticks()[0], time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        busy = (cpu_ticks()[0] - self.b0) / os.sysconf("SC_CLK_TCK")
        wall = time.perf_counter() - self.t0
        self.cores = max(0.0, (busy - (time.process_time() - self.own0)) / wall)


def section(tokens: int) -> str:
    """The docs section of a run with ``tokens`` rows of activations."""
    return SECTION if tokens == 1 else SECTION.replace(
        " (one mat-vec", f", a prompt of {tokens} tokens (one mat-mul")


def render(a, res: dict, other: float) -> str:
    trits = a.rows * a.cols * a.tokens
    per = "" if a.tokens == 1 else " a token"
    lines = [f"## {section(a.tokens)}", "",
             f"Command: `python tools/bench_base3.py --rows {a.rows} --cols {a.cols} --copies "
             f"{a.copies} --rounds {a.rounds}"
             + (f" --tokens {a.tokens}" if a.tokens > 1 else "")
             + f"`. Machine: {cpu_name()}, vnni build, 2 threads. Medians of {a.rounds} "
             f"interleaved rounds of 5 passes each; other processes took at most {other:.2f} "
             "cores.", "",
             f"| kernel | bytes | cold us{per} | cold GB/s | cold G trits/s | hot us{per} | "
             "hot G trits/s |",
             "|---|---|---|---|---|---|---|"]
    for name, r in res.items():
        cold, hot = statistics.median(r["cold"]), statistics.median(r["hot"])
        lines.append(f"| {name} | {r['bytes'] / 1e6:.2f} MB | {cold * 1e6 / a.tokens:.0f} | "
                     f"{r['bytes'] / cold / 1e9:.1f} | {trits / cold / 1e9:.0f} | "
                     f"{hot * 1e6 / a.tokens:.0f} | {trits / hot / 1e9:.0f} |")
    def ratio(name: str, mode: str) -> float:
        return statistics.median(res[name][mode]) / statistics.median(res["i2_s"][mode])

    lines += ["", f"tq1_0's base-3 kernel takes {ratio('tq1_0', 'cold'):.2f}x i2_s's time from "
              f"memory and {ratio('tq1_0', 'hot'):.2f}x in cache, where only the arithmetic "
              f"counts; lut3 {ratio('lut3', 'cold'):.2f}x and {ratio('lut3', 'hot'):.2f}x.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=6912)
    ap.add_argument("--cols", type=int, default=2560)
    ap.add_argument("--copies", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=1,
                    help="rows of activations: 1 a decode step, more a prompt's")
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args()
    from bitformat.runtime.cpu import kernels as K

    if K.kernel_mode() != "vnni" or "avx512vbmi" not in K.host_features():
        raise SystemExit("this compares the vnni build's kernels and lut3: it needs AVX-512 "
                         "VNNI and VBMI")
    rng = np.random.default_rng(0)
    mats = matrices(a.rows, a.cols, a.copies, rng)
    fs = kernels(a.rows, a.cols, rng, a.tokens)
    res = {n: {"cold": [], "hot": [], "bytes": mats[n][0].nbytes} for n in fs}
    for n, f in fs.items():
        f(mats[n][0])  # compile
    other = 0.0
    for _ in range(a.rounds):
        with Others() as o:
            for n, f in fs.items():
                for mode in ("cold", "hot"):
                    res[n][mode].append(timed(f, mats[n], mode == "hot"))
        other = max(other, o.cores)
    text = render(a, res, other)
    print(text)
    if a.write:
        from benchdoc import DOC, replace_section, section_tail

        if a.tokens == 1:
            replace_section(DOC, SECTION, text + AFTER_TABLE,
                            after="Decode of every container (full-size synthetic 2B-4T, cpu)")
        else:
            replace_section(DOC, section(a.tokens), text + section_tail(DOC, section(a.tokens)),
                            after=SECTION)


if __name__ == "__main__":
    main()
