"""The whole file compressed and run at full speed (issue 10), on the full-size synthetic 2B-4T.

    python tools/bench_whole_file.py --model /tmp/x/2b4t.gguf --work /tmp/x --write

1. The model (``bitformat synth --preset 2b4t``: bf16 values stored in the F16 embedding, as
   the official file) is made if missing, and converted i2_s -> rans in a fresh process:
   seconds, ternary weights per second, peak RSS.
2. Sizes: every container's file, the rans head's bits per value against the order-0 entropy
   of its values, and rans -> every other container compared byte for byte with a conversion
   straight from i2_s (hf: file by file).
3. Running: each run is a fresh process that loads the model (``bitformat.load``, timed),
   reads an 8-token prompt, takes one warm-up step and times ``--tokens`` greedy decode steps;
   it reports its peak RSS (VmHWM) and how much CPU other processes took during the timed steps
   (/proc/stat busy time minus its own). i2_s and rans (decode at load) alternate
   ``--repeat`` times; rans with the fused decode runs once after them.

``--write`` replaces the section "Whole file: coded LM head, rans decoded at load" of
docs/benchmarks.md. Run it under the shared CPU lock (flock /tmp/bitformat-cpu.lock ...).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

PROMPT = [1, 5, 17, 300, 42, 7, 99, 128]
TITLE = "Whole file: coded LM head, rans decoded at load (full-size synthetic 2B-4T)"
CONTENDED = 0.25  # other processes' CPU-seconds per second of a timed run that drop it
TARGETS = {"rans_file_gb": 0.86, "head_bits": 11.0, "speed_ratio": 0.95, "load_s": 8.0,
           "convert_mws": 80.0}


# -- the measuring child ---------------------------------------------------------------------------
def cpu_busy() -> tuple[float, float]:
    """(busy CPU-seconds of the whole machine, of this process) so far."""
    tick = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    busy = sum(v) - v[3] - v[4]  # all but idle and iowait
    with open("/proc/self/stat") as f:
        s = f.read().rsplit(")", 1)[1].split()
    return busy / tick, (int(s[11]) + int(s[12])) / tick  # utime, stime


def peak_rss_gib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / (1 << 20)
    return float("nan")


def child(path: str, decode: str, tokens: int) -> None:
    import numpy as np

    from bitformat.runtime import load

    with load(path, backend="cpu", decode=decode) as m:
        net = m.net
        cache = net.new_cache(len(PROMPT) + 1 + tokens)
        tok = int(np.argmax(net.forward(PROMPT, cache)[-1]))
        tok = int(np.argmax(net.forward([tok], cache)[-1]))  # warm-up
        out = []
        b0, o0 = cpu_busy()
        t0 = time.perf_counter()
        for _ in range(tokens):
            tok = int(np.argmax(net.forward([tok], cache)[-1]))
            out.append(tok)
        wall = time.perf_counter() - t0
        b1, o1 = cpu_busy()
        print(json.dumps({"load_s": m.load_seconds, "tok_s": tokens / wall, "wall_s": wall,
                          "other_cpu_s": max(0.0, (b1 - b0) - (o1 - o0)),
                          "peak_rss_gib": peak_rss_gib(), "tokens": out,
                          "bytes_per_token": m.weight_bytes_per_token}))


def run_child(path: Path, decode: str, tokens: int) -> dict:
    r = subprocess.run([sys.executable, __file__, "--child", str(path), decode, str(tokens)],
                       capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads(r.stdout.strip().splitlines()[-1])


# -- conversions ----------------------------------------------------------------------------------
def convert_timed(src: Path, dst: Path, fid: str) -> dict:
    """``bitformat convert`` in a fresh process: seconds, peak RSS, and the CPU time other
    processes took meanwhile."""
    import resource

    b0 = cpu_busy()[0]
    c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    code = ("import json, time; from bitformat.container import convert;"
            " t = time.perf_counter();"
            f" convert({str(src)!r}, {str(dst)!r}, {fid!r}); s = time.perf_counter() - t;"
            " hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0];"
            " print(json.dumps({'s': s, 'peak_rss_gib': int(hwm.split()[1]) / 2**20}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    out = json.loads(r.stdout.strip().splitlines()[-1])
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    mine = (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime)
    out["other_cpu_s"] = max(0.0, cpu_busy()[0] - b0 - mine)
    return out


def same_bytes(a: Path, b: Path) -> bool:
    if a.is_dir():
        names = sorted(p.name for p in a.iterdir())
        return names == sorted(p.name for p in b.iterdir()) and all(
            (a / n).read_bytes() == (b / n).read_bytes() for n in names)
    return a.stat().st_size == b.stat().st_size and a.read_bytes() == b.read_bytes()


def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.iterdir()) if p.is_dir() else p.stat().st_size


def sizes_and_round_trips(src: Path, rans: Path, work: Path) -> dict:
    import shutil

    import numpy as np

    from bitformat.container import convert, open_model
    from bitformat.formats import FORMAT_IDS
    from bitformat.formats.rans_float import RansFloat

    out = {"files": {"i2_s": src.stat().st_size, "rans": rans.stat().st_size}, "identical": {}}
    for fid in [f for f in FORMAT_IDS if f not in ("i2_s", "rans")] + ["hf", "i2_s"]:
        suffix = "" if fid == "hf" else ".gguf"
        direct, back = work / f"direct.{fid}{suffix}", work / f"back.{fid}{suffix}"
        if fid != "i2_s":
            convert(src, direct, fid)
            out["files"][fid] = dir_bytes(direct)
        convert(rans, back, fid)
        out["identical"][fid] = same_bytes(src if fid == "i2_s" else direct, back)
        for p in (direct, back):
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
    with open_model(rans) as m:
        e = m.entry("token_embd.weight")
        raw = m.plain(e.name)[1]
        from bitformat.summary import order0_entropy

        out["head"] = {"values": e.n_elements, "bytes": e.nbytes, "f16_bytes": e.plain_nbytes,
                       "bits_per_value": e.nbytes * 8 / e.n_elements,
                       "entropy_bits": order0_entropy(RansFloat.histogram(raw))}
        v = raw.view(np.uint16)
        out["head"]["low3_zero_share"] = float(((v & 7) == 0).mean())
    return out


# -- report ---------------------------------------------------------------------------------------
def med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def render(conv: dict, sz: dict, runs: dict[str, list[dict]], args, started: float) -> str:
    from bitformat.summary import human_bytes

    try:
        cpu = [ln.split(":", 1)[1].strip() for ln in subprocess.run(
            ["lscpu"], capture_output=True, text=True).stdout.splitlines()
            if ln.startswith("Model name")][0]
    except (OSError, IndexError):
        cpu = platform.processor()
    n = 2_084_044_800
    mws = n / conv["s"] / 1e6
    i2s, load_, fused = runs["i2_s"], runs["load"], runs["fused"]
    ratio = med(load_, "tok_s") / med(i2s, "tok_s")
    per_pair = [b["tok_s"] / a["tok_s"] for a, b in zip(i2s, load_, strict=False)]
    hd = sz["head"]
    rans_gb = sz["files"]["rans"] / 1e9
    lines = [f"## {TITLE}", "",
             f"Command: `flock /tmp/bitformat-cpu.lock python tools/bench_whole_file.py --model "
             f"{args.model} --work {args.work} --tokens {args.tokens} --repeat {args.repeat} "
             f"--write` on `bitformat synth --preset 2b4t` (seed 0; the F16 embedding holds bf16 "
             f"values, as the official file). CPU: {cpu}, {os.cpu_count()} cores; Python "
             f"{platform.python_version()}. The run took {(time.time() - started) / 60:.1f} min.",
             "", "| quantity | value | target |", "|---|---|---|",
             f"| rans file | {sz['files']['rans']:,} bytes ({rans_gb:.3f} GB) | <= "
             f"{TARGETS['rans_file_gb']} GB |",
             f"| LM head in rans (`rans_float`) | {hd['bits_per_value']:.4f} bits per value "
             f"({hd['bytes']:,} of {hd['f16_bytes']:,} bytes) | <= {TARGETS['head_bits']} |",
             f"| order-0 entropy of the head's 16-bit values | {hd['entropy_bits']:.4f} bits | |",
             f"| head values whose low 3 mantissa bits are 0 | {hd['low3_zero_share']:.4%} | |",
             f"| i2_s -> rans (`convert`, fresh process) | {conv['s']:.1f} s, {mws:.0f} M ternary "
             f"weights/s, peak RSS {conv['peak_rss_gib']:.2f} GiB; other processes "
             f"{conv['other_cpu_s'] / conv['s']:.0%} of a CPU meanwhile | >= "
             f"{TARGETS['convert_mws']:.0f} M/s |",
             f"| decode tok/s, rans (load) / i2_s, same run | {ratio:.3f} (median of each; per "
             f"pair {', '.join(f'{r:.3f}' for r in per_pair)}) | >= {TARGETS['speed_ratio']} |",
             f"| load, rans (decode at load) | {med(load_, 'load_s'):.2f} s (median; i2_s "
             f"{med(i2s, 'load_s'):.2f} s) | < {TARGETS['load_s']:.0f} s |", "",
             "Whole files (tensor data and metadata) and the round trips rans -> X compared byte "
             "for byte with i2_s -> X (hf: every file of the folder):", "",
             "| container | file bytes | rans -> it identical |", "|---|---|---|"]
    for fid, b in sz["files"].items():
        same = sz["identical"].get(fid)
        lines.append(f"| {fid} | {b:,} ({human_bytes(b)}) | "
                     f"{'-' if same is None else same} |")
    lines += ["", f"Running (`bitformat.load(..., backend='cpu')`, each run a fresh process: "
              f"load, 8-token prompt, 1 warm-up step, {args.tokens} timed greedy steps; i2_s and "
              "rans (load) alternate, rans (fused) runs once after them). *Other CPU* is the "
              "CPU time other processes took during the timed steps, per second of them; a run "
              f"above {CONTENDED:.0%} is dropped and repeated.", "",
              "| run | container | load s | decode tok/s | peak RSS GiB | bytes/token MB | "
              "other CPU |", "|---|---|---|---|---|---|---|"]
    names = {"i2_s": "i2_s", "load": "rans (load)", "fused": "rans (fused)"}
    order = sorted(i2s + load_ + fused + runs["dropped"], key=lambda r: r["at"])
    for i, r in enumerate(order, 1):
        share = r["other_cpu_s"] / r["wall_s"]
        label = names[r["key"]] + (" (dropped: contended)" if r in runs["dropped"] else "")
        lines.append(f"| {i} | {label} | {r['load_s']:.2f} | {r['tok_s']:.2f} | "
                     f"{r['peak_rss_gib']:.2f} | {r['bytes_per_token'] / 1e6:,.1f} | "
                     f"{share:.0%} |")
    same = all(r["tokens"] == i2s[0]["tokens"] for r in i2s + load_ + fused)
    lines += ["", f"Every run decoded the same tokens: {same}. Medians: i2_s "
              f"{med(i2s, 'tok_s'):.2f} tok/s, rans (load) {med(load_, 'tok_s'):.2f}, rans "
              f"(fused) {med(fused, 'tok_s'):.2f}; peak RSS i2_s {med(i2s, 'peak_rss_gib'):.2f}"
              f" GiB, rans (load) {med(load_, 'peak_rss_gib'):.2f} GiB (the decoded copy does "
              "not double it: each tensor is decoded into its place and its mapped words are "
              "given back).", "",
              "`rans (fused)` is what `run` did for rans before this: the rANS decode inside "
              "every mat-vec (the 2.00 tok/s of the rans row under \"Decode on the CPU\" was "
              "that, on an Intel Xeon). It stays available as `--decode fused`, reading "
              f"{1 - med(fused, 'bytes_per_token') / med(load_, 'bytes_per_token'):.0%} fewer "
              f"bytes a token, {med(load_, 'tok_s') / med(fused, 'tok_s'):.0f} times slower "
              "here."]
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="the 2b4t i2_s file (made if "
                    "missing)")
    ap.add_argument("--work", type=Path, required=True, help="folder for the converted files")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = ap.parse_args()
    started = time.time()
    args.work.mkdir(parents=True, exist_ok=True)
    if not args.model.exists():
        subprocess.run([sys.executable, "-m", "bitformat.cli", "synth", "--preset", "2b4t",
                        "-o", str(args.model)], check=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    rans = args.work / "2b4t.rans.gguf"
    conv = convert_timed(args.model, rans, "rans")
    print("convert", conv, flush=True)
    sz = sizes_and_round_trips(args.model, rans, args.work)
    print("sizes", json.dumps(sz), flush=True)
    runs: dict[str, list[dict]] = {"i2_s": [], "load": [], "fused": [], "dropped": []}

    def measured(key: str, path: Path, decode: str) -> None:
        """One kept run; a run during which other processes took more than CONTENDED of the
        CPU is dropped and repeated (three tries)."""
        for _ in range(3):
            r = run_child(path, decode, args.tokens)
            r["at"], r["key"] = time.time(), key
            print(key, {k: v for k, v in r.items() if k != "tokens"}, flush=True)
            if r["other_cpu_s"] / r["wall_s"] <= CONTENDED:
                runs[key].append(r)
                return
            runs["dropped"].append(r)
        runs[key].append(r)  # kept after three tries, and marked as contended in the table

    for _ in range(args.repeat):
        measured("i2_s", args.model, "load")
        measured("load", rans, "load")
    measured("fused", rans, "fused")
    text = render(conv, sz, runs, args, started)
    print(text)
    if args.write:
        from benchdoc import DOC, replace_section

        replace_section(DOC, TITLE, text)


if __name__ == "__main__":
    main()
