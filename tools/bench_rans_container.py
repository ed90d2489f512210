"""Benchmark the ``rans`` container on the full-size synthetic 2B-4T model (developer tool).

    python tools/bench_rans_container.py --model out/bench/2b4t.gguf [--choices 0,1,5,15,29]
                                         [--convert] [--write]

* Size and speed: every ternary tensor of the model is encoded and decoded by the rans format
  (timed per tensor, best of ``--repeats``, with 1 numba thread and with all of them),
  decode-verified, and its bytes split into stream words and everything else (header, maps,
  tables, row classes, word counts). Compared with the model's own order-0 floors.
* ``--convert``: ``bitformat convert`` i2_s -> rans -> i2_s in child processes (wall time,
  peak RSS, byte identity of the round trip).
* ``--choices``: the layout options (symbol size, row classes, stream length) measured on the
  tensors of the listed layers, drawn exactly as ``synth`` draws them.
* ``--write``: replace the section "## rans container (full-size synthetic 2B-4T)" of
  docs/benchmarks.md (other sections are left alone).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numba
import numpy as np
from benchdoc import replace_section

from bitformat import open_model
from bitformat.formats.rans import Rans, describe, section_words
from bitformat.report import entropy_bits, row_counts, row_entropy_bits
from bitformat.ternary import TernaryTensor

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
TITLE = "rans container (full-size synthetic 2B-4T)"
KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def best_of(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def size_and_speed(model: Path, repeats: int, threads: list[int]) -> dict:
    fmt = Rans()
    fmt.encode(TernaryTensor(np.ones((4, 4), np.int8), np.float32([1])))  # compile
    res = {"weights": 0, "bytes": 0, "stream_words": 0, "tensors": 0, "enc": {}, "dec": {},
           "h_tensor": 0.0, "h_row": 0.0, "counts": np.zeros(3, np.int64), "tables": [],
           "streams": 0, "live": 0}
    for th in threads:
        res["enc"][th] = res["dec"][th] = 0.0
    with open_model(model) as m:
        for e in m.entries:
            if not e.ternary:
                continue
            t, _ = fmt.prepare(m.ternary(e.name))
            rows, cols = t.shape
            raw = None
            for th in threads:
                numba.set_num_threads(th)
                te, raw = best_of(lambda t=t: fmt.encode(t), repeats)
                td, back = best_of(lambda raw=raw, t=t: fmt.decode(
                    raw, *t.shape, scale=float(t.scales[0])), repeats)
                assert np.array_equal(back.trits, t.trits), e.name
                res["enc"][th] += te
                res["dec"][th] += td
            h = describe(raw)
            counts = row_counts(t.trits)
            n = rows * cols
            res["weights"] += n
            res["bytes"] += raw.size
            res["stream_words"] += h["stream_words"]
            res["tensors"] += 1
            res["streams"] += h["streams"]
            res["live"] += h["live_rows"] * h["live_cols"]
            res["tables"].append(h["tables"])
            res["h_tensor"] += entropy_bits(counts.sum(axis=0)) * n
            res["h_row"] += row_entropy_bits(counts)
            res["counts"] += counts.sum(axis=0)
            assert raw.size == 4 * sum(section_words(rows, cols, h["live_rows"], h["tables"],
                                                     h["streams"], h["stream_words"]).values())
            print(f"{e.name:<26} {raw.size * 8 / n:.4f} bpw  {h['tables']:>2} tables  "
                  f"{h['streams']:>5} streams", flush=True)
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    return res


def run_child(args: list[str]) -> tuple[float, float]:
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "bitformat.cli", *args])
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"bitformat {' '.join(args)} failed")
    return time.perf_counter() - t0, usage.ru_maxrss / 2**20


def convert_round_trip(model: Path) -> dict:
    mid = model.with_name(model.stem + ".rans.gguf")
    back = model.with_name(model.stem + ".back.gguf")
    t1, m1 = run_child(["convert", str(model), "--to", "rans", "-o", str(mid)])
    t2, m2 = run_child(["convert", str(mid), "--to", "i2_s", "-o", str(back)])
    same = back.read_bytes() == model.read_bytes()
    out = {"to": (t1, m1), "back": (t2, m2), "identical": same, "size": mid.stat().st_size,
           "source_size": model.stat().st_size}
    mid.unlink()
    back.unlink()
    return out


OPTIONS = {  # label -> (mode, min_stream, max_tables)
    "group5, <=16 row classes, streams >= 4096 (chosen)": ("group5", 4096, 16),
    "group5, 1 table per tensor": ("group5", 4096, 1),
    "group5, <=4 row classes": ("group5", 4096, 4),
    "trit symbols, <=16 row classes": ("trit", 4096, 16),
    "group5, one stream per row (2560 or 6912)": ("group5", 2560, 16),
    "group5, streams >= 8192": ("group5", 8192, 16),
}


def choices(layers: list[int], repeats: int) -> tuple[list[tuple], dict]:
    from bitformat.synth import draw_trits, trit_spec

    fmts = {k: Rans(*v) for k, v in OPTIONS.items()}
    size = dict.fromkeys(fmts, 0)
    tenc = dict.fromkeys(fmts, 0.0)
    tdec = dict.fromkeys(fmts, 0.0)
    floors = {"n": 0, "tensor": 0.0, "row": 0.0, "live": 0.0}
    numba.set_num_threads(1)
    for f in fmts.values():
        f.encode(TernaryTensor(np.ones((4, 4), np.int8), np.float32([1])))
    for layer in layers:
        for kind in KINDS:
            name = f"blk.{layer}.{kind}.weight"
            trits = draw_trits(trit_spec("2b4t", name))
            t = TernaryTensor(trits, np.float32([1.5]), 0, name)
            counts = row_counts(trits)
            n = trits.size
            floors["n"] += n
            floors["tensor"] += entropy_bits(counts.sum(axis=0)) * n
            floors["row"] += row_entropy_bits(counts)
            live = trits[trits.any(axis=1)][:, trits.any(axis=0)]
            floors["live"] += entropy_bits(np.bincount(live.reshape(-1) + 1, minlength=3))\
                * live.size
            for k, f in fmts.items():
                te, raw = best_of(lambda f=f, t=t: f.encode(t), repeats)
                td, back = best_of(lambda f=f, raw=raw, t=t: f.decode(raw, *t.shape, scale=1.5),
                                   repeats)
                assert np.array_equal(back.trits, trits)
                size[k] += raw.size
                tenc[k] += te
                tdec[k] += td
            print(f"{name} done", flush=True)
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    n = floors["n"]
    rows = [(k, size[k] * 8 / n, n / tenc[k] / 1e6, n / tdec[k] / 1e6) for k in fmts]
    return rows, {k: v / n for k, v in floors.items() if k != "n"} | {"n": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "out" / "bench" / "2b4t.gguf")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", default=f"1,{numba.config.NUMBA_NUM_THREADS}")
    ap.add_argument("--convert", action="store_true", help="time bitformat convert both ways")
    ap.add_argument("--choices", default="", help="layers for the layout comparison, e.g. "
                    "0,1,5,15,29")
    ap.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = ap.parse_args()
    threads = sorted({int(x) for x in args.threads.split(",")})
    if not args.model.exists():
        args.model.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "bitformat.cli", "synth", "--preset", "2b4t",
                        "-o", str(args.model)], check=True)
    r = size_and_speed(args.model, args.repeats, threads)
    n = r["weights"]
    bpw = r["bytes"] * 8 / n
    h_tensor, h_row = r["h_tensor"] / n, r["h_row"] / n
    h_global = entropy_bits(r["counts"])
    lines = [f"## {TITLE}", "",
             f"Command: `python tools/bench_rans_container.py --convert --choices "
             f"{args.choices or '-'} --write` ({platform.machine()}, {os.cpu_count()} cores "
             f"shared with other work, Python {platform.python_version()}, numba "
             f"{numba.__version__}). Model: `bitformat synth --preset 2b4t` (seed 0), "
             f"{r['tensors']} ternary tensors, {n:,} weights.", "",
             "| quantity | value |", "|---|---|",
             f"| rans bytes (every table, map, count, header, checksum) | {r['bytes']:,} |",
             f"| **bits per weight, all included** | **{bpw:.4f}** |",
             f"| of which stream words | {r['stream_words'] * 32 / n:.4f} |",
             f"| of which everything else | {(r['bytes'] - 4 * r['stream_words']) * 8 / n:.4f} |",
             f"| order-0 entropy: global / per tensor / per row | {h_global:.4f} / "
             f"{h_tensor:.4f} / {h_row:.4f} |",
             f"| target: min(1.57, per-tensor H0 + 1 % = {1.01 * h_tensor:.4f}) | "
             f"{'met' if bpw <= min(1.57, 1.01 * h_tensor) else 'MISSED'} |",
             f"| live share (weights outside dead rows and columns) | {r['live'] / n:.4f} |",
             f"| streams / tables per tensor (min..max) | {r['streams']:,} / "
             f"{min(r['tables'])}..{max(r['tables'])} |"]
    for th in threads:
        lines.append(f"| encode / decode, {th} thread{'s' if th > 1 else ''} (M weights/s, "
                     f"best of {args.repeats} per tensor) | {n / r['enc'][th] / 1e6:.0f} / "
                     f"{n / r['dec'][th] / 1e6:.0f} |")
    lines.append("")
    lines.append("Targets (issue 3): <= 1.57 bpw and <= the per-tensor order-0 entropy + 1 %; "
                 "encode >= 20 M weights/s, CPU decode >= 100 M weights/s.")
    print("\n".join(lines))
    if args.convert:
        c = convert_round_trip(args.model)
        extra = ["", "| conversion (`bitformat convert`, fresh process) | seconds | "
                 "M weights/s | peak RSS GiB |", "|---|---|---|---|",
                 f"| i2_s -> rans (encodes twice: size pre-pass, then streaming) | "
                 f"{c['to'][0]:.1f} | {n / c['to'][0] / 1e6:.0f} | {c['to'][1]:.2f} |",
                 f"| rans -> i2_s | {c['back'][0]:.1f} | {n / c['back'][0] / 1e6:.0f} | "
                 f"{c['back'][1]:.2f} |", "",
                 f"File sizes: i2_s {c['source_size']:,} bytes, rans {c['size']:,} bytes "
                 f"(embedding and norms unchanged). i2_s -> rans -> i2_s byte-identical: "
                 f"{c['identical']}."]
        print("\n".join(extra))
        lines += extra
    if args.choices:
        rows, fl = choices([int(x) for x in args.choices.split(",")], args.repeats)
        extra = ["", f"Layout choices, measured on the 7 ternary tensors of layers "
                 f"{args.choices} ({fl['n']:,} weights, drawn as synth draws them; 1 thread; "
                 f"floors: per tensor {fl['tensor']:.4f}, per row {fl['row']:.4f}, live "
                 f"sub-matrix per tensor {fl['live']:.4f}):", "",
                 "| layout | bpw | encode M/s | decode M/s |", "|---|---|---|---|"]
        extra += [f"| {k} | {b:.4f} | {e:.0f} | {d:.0f} |" for k, b, e, d in rows]
        print("\n".join(extra))
        lines += extra
    if args.write:
        replace_section(DOC, TITLE, "\n".join(lines))


if __name__ == "__main__":
    main()
