"""Decode speed with one core busy: explicit thread counts against the adaptive default.

    python tools/bench_load.py --model m.gguf --write                 # results into docs
    python tools/bench_load.py --model m.gguf --baseline /tmp/old-tree  # before/after
    python tools/bench_load.py --model m.gguf --variant spin1k:2:GOMP_SPINCOUNT=1000

Each variant (a thread setting, environment variables, a source tree) runs in a worker
process of its own that loads the model once and then decodes ``--tokens`` greedy tokens on
request, so every variant is measured in turn, idle and with a competitor: a process spinning
on one core (``while True: pass``), started before the busy rounds and killed after them.
Rounds interleave: idle round of every variant, busy round of every variant, ``--repeat``
times, so drifting load hits all variants alike.

Contention: each measurement records the CPU that other processes (not the worker, not the
competitor) took during it, from ``/proc/stat`` minus the two processes' own counters, in
cores. One above ``--max-other`` cores is measured again (up to ``--retries`` times) and
marked if it stays contended; medians use uncontended measurements where there are any.
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
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SECTION = "Decode with one core busy (explicit thread counts)"
MSG = "@@load "
PROMPT = [1, 450, 3303, 310, 20680, 338, 263, 5828]
TICK = os.sysconf("SC_CLK_TCK")


# -- the worker: one model, decode on request ---------------------------------------------------
def worker(model: str, threads: int | None, tokens: int) -> None:
    from bitformat.runtime import load

    with load(model, backend="cpu", threads=threads) as m:
        for _ in range(2):  # compile, fault the weights in, let the thread picker settle
            m.generate(PROMPT, tokens)
        print(MSG + json.dumps({"ready": True, "omp": os.environ.get("OMP_WAIT_POLICY")}),
              flush=True)
        for line in sys.stdin:
            n = int(line)
            c0 = _self_cpu()
            r = m.generate(PROMPT, n)
            print(MSG + json.dumps({"tps": r.stats.generation_tps, "cpu": _self_cpu() - c0,
                                    "layer": _layer()}), flush=True)


def _layer() -> str:
    import numba

    return numba.threading_layer()


def _self_cpu() -> float:
    t = os.times()
    return t.user + t.system


# -- the parent ------------------------------------------------------------------------------
def busy_ticks() -> int:
    """Jiffies every CPU spent not idle (user, nice, system, irq, softirq, steal)."""
    with open("/proc/stat") as fh:
        v = [int(x) for x in fh.readline().split()[1:]]
    return sum(v[:8]) - v[3] - v[4]


class TreeWorker:
    """A benchmark's worker process running ``args`` (a script and its options) with another
    source tree ``tree`` on its path: it prints ``msg`` + a JSON object when ready and after
    each request (one line on its stdin), the CPU seconds it used in ``"cpu"``. :meth:`ask`
    adds ``"other"``: the cores other processes took meanwhile (/proc/stat)."""

    def __init__(self, name: str, tree: Path, args: list[str], msg: str):
        self.name, self.msg = name, msg
        env = {**os.environ, "PYTHONPATH": str(tree)}
        self.proc = subprocess.Popen([sys.executable, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=tree)
        self.read()

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(self.msg):
                return json.loads(line[len(self.msg):])
        raise RuntimeError(f"worker {self.name} ended (exit {self.proc.wait()})")

    def ask(self, request: str) -> dict:
        b0, t0 = busy_ticks(), time.perf_counter()
        self.proc.stdin.write(request + "\n")
        self.proc.stdin.flush()
        r = self.read()
        wall = time.perf_counter() - t0
        r["other"] = max(0.0, ((busy_ticks() - b0) / TICK - r["cpu"]) / wall)
        return r

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()



def proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        f = fh.read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / TICK


@dataclass
class Variant:
    label: str
    threads: int | None
    env: dict[str, str] = field(default_factory=dict)
    tree: Path = ROOT
    proc: subprocess.Popen | None = None
    runs: dict[str, list[tuple[float, float, bool]]] = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: str) -> Variant:
        """``label:threads[:ENV=V,ENV=V[:tree]]``; threads ``auto`` is the adaptive default."""
        parts = spec.split(":")
        env = dict(kv.split("=", 1) for kv in parts[2].split(",") if kv) if len(parts) > 2 else {}
        tree = Path(parts[3]) if len(parts) > 3 else ROOT
        return cls(parts[0], None if parts[1] == "auto" else int(parts[1]), env, tree)

    def start(self, model: str, tokens: int) -> None:
        env = dict(os.environ, PYTHONPATH=str(self.tree), **self.env)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", model,
               "--tokens", str(tokens)] + ([] if self.threads is None else
                                            ["--threads", str(self.threads)])
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env, cwd=self.tree)
        self.info = self.read()

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MSG):
                return json.loads(line[len(MSG):])
        raise RuntimeError(f"worker {self.label} exited with {self.proc.wait()}")

    def measure(self, tokens: int, competitor: int | None) -> tuple[float, float]:
        """(tokens/s, cores other processes used meanwhile)."""
        comp0 = proc_cpu(competitor) if competitor else 0.0
        b0, t0 = busy_ticks(), time.perf_counter()
        self.proc.stdin.write(f"{tokens}\n")
        self.proc.stdin.flush()
        res = self.read()
        self.layer = res["layer"]
        wall = time.perf_counter() - t0
        busy = (busy_ticks() - b0) / TICK
        comp = proc_cpu(competitor) - comp0 if competitor else 0.0
        return res["tps"], max(0.0, busy - res["cpu"] - comp) / wall

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait()


def run(variants: list[Variant], model: str, tokens: int, repeat: int, max_other: float,
        retries: int) -> None:
    for v in variants:
        v.start(model, tokens)
        print(f"{v.label}: ready (OMP_WAIT_POLICY={v.info['omp']})", file=sys.stderr)
    for rep in range(repeat):
        for load in ("idle", "busy"):
            comp = (subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    if load == "busy" else None)
            time.sleep(0.3)
            try:
                for v in variants:
                    for attempt in range(retries + 1):
                        tps, other = v.measure(tokens, comp.pid if comp else None)
                        ok = other <= max_other
                        if ok or attempt == retries:
                            break
                    v.runs.setdefault(load, []).append((tps, other, ok))
                    print(f"round {rep + 1} {load:4} {v.label:24} {tps:6.2f} tok/s  "
                          f"others {other:.2f} cores{'' if ok else ' (contended)'}",
                          file=sys.stderr)
            finally:
                if comp is not None:
                    comp.kill()
                    comp.wait()
    for v in variants:
        v.stop()


def median_tps(runs: list[tuple[float, float, bool]]) -> tuple[float, int, float]:
    """(median tokens/s over uncontended runs, or all if none is; runs used; max others)."""
    good = [r for r in runs if r[2]] or runs
    return statistics.median(r[0] for r in good), len(good), max(r[1] for r in good)


def render(variants: list[Variant], args, cpu: str) -> str:
    ref = next((v for v in variants if v.threads is None and v.tree == ROOT and not v.env),
               variants[0])
    ref_busy = median_tps(ref.runs["busy"])[0]
    lines = [f"## {SECTION}", "",
             f"Command: `python tools/bench_load.py {' '.join(args.argv)}` ({cpu}, "
             f"{os.cpu_count()} cores, Python {platform.python_version()}). Model: `bitformat "
             f"synth --preset 2b4t` as i2_s. Greedy decode of {args.tokens} tokens after an "
             f"{len(PROMPT)}-token prompt, median of {args.repeat} interleaved rounds. "
             "Busy: another process spins on one core. 'others' is the most CPU any other "
             "process took during a counted measurement (from /proc/stat, in cores).", "",
             "| variant | threads | numba layer | environment | idle tok/s | busy tok/s | "
             f"busy / {ref.label} busy | others (cores) |", "|---|---|---|---|---|---|---|---|"]
    for v in variants:
        idle, ni, oi = median_tps(v.runs["idle"])
        busy, nb, ob = median_tps(v.runs["busy"])
        env = ", ".join(f"{k}={x}" for k, x in v.env.items()) or "-"
        lines.append(f"| {v.label} | {v.threads or 'adaptive'} | {v.layer} | {env} | "
                     f"{idle:.2f} ({ni}) "
                     f"| {busy:.2f} ({nb}) | {busy / ref_busy:.2f} | {max(oi, ob):.2f} |")
    lines += ["", "(n): measurements in the median (uncontended ones where there were any)."]
    by_label = {v.label: v for v in variants}
    for v in variants:
        before = by_label.get(f"{v.label}, before")
        if before is None:
            continue
        for load in ("idle", "busy"):
            ratios = [a[0] / b[0] for a, b in zip(v.runs[load], before.runs[load], strict=False)]
            lines.append(f"{v.label}, {load}: this tree / before, per round: "
                         f"{', '.join(f'{r:.2f}' for r in ratios)} (median "
                         f"{statistics.median(ratios):.2f})." if ratios else "")
    lines.append("")
    return "\n".join(lines) + "\n"


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(ln.split(":", 1)[1].strip() for ln in out.splitlines()
                    if ln.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a full-size model (bitformat synth 2b4t)")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--max-other", type=float, default=0.15,
                    help="cores other processes may take before a run counts as contended")
    ap.add_argument("--retries", type=int, default=2)
    ap.add_argument("--baseline", type=Path,
                    help="another source tree (e.g. the commit before) to run as well")
    ap.add_argument("--variant", action="append", default=[],
                    help="extra variant label:threads[:ENV=V,...[:tree]]")
    ap.add_argument("--write", action="store_true", help="write docs/benchmarks.md's section")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.model, args.threads, args.tokens)
        return
    args.argv = [a for a in sys.argv[1:] if a != "--write"]
    variants = [Variant("adaptive", None), Variant("threads 2", 2)]
    if args.baseline:
        variants += [Variant("adaptive, before", None, tree=args.baseline),
                     Variant("threads 2, before", 2, tree=args.baseline)]
    variants += [Variant.parse(s) for s in args.variant]
    cpu = cpu_model()
    print(f"CPU: {cpu}", file=sys.stderr)
    try:
        run(variants, args.model, args.tokens, args.repeat, args.max_other, args.retries)
    finally:
        for v in variants:
            if v.proc is not None and v.proc.poll() is None:
                v.proc.kill()
    text = render(variants, args, cpu)
    print(text)
    if args.write:
        sys.path.insert(0, str(ROOT / "tools"))
        from benchdoc import DOC, replace_section

        replace_section(DOC, SECTION, text)


if __name__ == "__main__":
    main()
