"""How long a first run takes in a fresh environment: numba's kernels compiled from scratch.

    python tools/bench_cold_start.py MODEL.gguf [--container i2_s] [--write]

Each measurement is a new process with an empty kernel cache (``NUMBA_CACHE_DIR`` pointing at
a fresh folder): ``bitformat run MODEL --prompt-ids ... -n 4`` (time to its first generated
byte on stdout and to its end), then ``bitformat run`` again on the now-filled cache (the
warm start), and ``bitformat warmup`` (every container) from an empty cache. The child's
compile log (``BITFORMAT_COMPILE_LOG``) gives each compiled function's time; the slowest are
listed. The CPU and the CPU time other processes took meanwhile (/proc/stat) are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

SECTION = "First run: kernels compiled from scratch (cold start)"
CLI = [sys.executable, "-c", "from bitformat.cli import main; main()"]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                flags = Path("/proc/cpuinfo").read_text()
                isa = [f for f in ("avx512_vnni", "avx512vbmi", "amx_tile")
                       if f" {f}" in flags]
                return f"{name}, {os.cpu_count()} cores ({', '.join(isa) or 'no AVX-512'})"
    except OSError:
        pass
    return "unknown CPU"


def busy() -> tuple[int, int]:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v), v[3] + v[4]


def timed(args: list[str], cache: Path, log: Path | None = None) -> dict:
    """Run the CLI; seconds to the first stdout byte and to the end, the compile log."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1"}
    if log is not None:
        env["BITFORMAT_COMPILE_LOG"] = str(log)
    b0, i0 = busy()
    t0 = time.perf_counter()
    p = subprocess.Popen(CLI + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = None
    out = b""
    while True:
        chunk = p.stdout.read1(4096) if hasattr(p.stdout, "read1") else p.stdout.read(1)
        if not chunk:
            break
        if first is None:
            first = time.perf_counter() - t0
        out += chunk
    err = p.stderr.read()
    p.wait()
    end = time.perf_counter() - t0
    b1, i1 = busy()
    tck = os.sysconf("SC_CLK_TCK")
    r = {"args": args, "rc": p.returncode, "first_output_s": first, "total_s": end,
         "cpu_busy_cores": ((b1 - b0) - (i1 - i0)) / tck / end,
         "stderr_tail": err.decode(errors="replace")[-600:]}
    if log is not None and log.exists():
        r["compile"] = json.loads(log.read_text())
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--no-warmup", action="store_true", help="skip `bitformat warmup`")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    a = ap.parse_args()
    res = {"cpu": cpu_name(), "model": a.model}
    run = ["run", a.model, "--prompt-ids", "1,5,17,300,42,7,99,128", "-n", str(a.tokens)]
    with tempfile.TemporaryDirectory(prefix="cold-") as d:
        cache = Path(d) / "numba"
        cache.mkdir()
        res["cold"] = timed(run, cache, Path(d) / "log.json")
        res["warm"] = timed(run, cache)
    if not a.no_warmup:
        with tempfile.TemporaryDirectory(prefix="cold-") as d:
            cache = Path(d) / "numba"
            cache.mkdir()
            res["warmup"] = timed(["warmup"], cache, Path(d) / "log.json")
    for k in ("cold", "warm", "warmup"):
        if k in res:
            r = res[k]
            c = r.get("compile", {})
            print(f"{k}: rc {r['rc']}, first output {r['first_output_s']}, total "
                  f"{r['total_s']:.1f} s, {c.get('count', 0)} compiled in "
                  f"{c.get('seconds', 0):.1f} s, busy {r['cpu_busy_cores']:.2f} cores",
                  flush=True)
            funcs = sorted(c.get("functions", {}).items(), key=lambda kv: -kv[1][1])[:15]
            for name, (inc, own) in funcs:
                print(f"    {own:7.2f} s own ({inc:7.2f} with nested)  {name}")
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
