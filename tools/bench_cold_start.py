"""How long a first run takes in a fresh environment: numba's kernels compiled from scratch.

    python tools/bench_cold_start.py MODEL.gguf [--container i2_s] [--write]

Each measurement is a new process with an empty kernel cache (``NUMBA_CACHE_DIR`` pointing at
a fresh folder): ``bitformat run MODEL --prompt-ids ... -n 4`` (time to its first generated
byte on stdout and to its end), then ``bitformat run`` again on the now-filled cache (the
warm start), the same on the tiny synthetic model, ``bitformat warmup`` (every container) and
the demo (``tools/demo.sh``, what ``make demo`` runs) from an empty cache. The child's
compile log (``BITFORMAT_COMPILE_LOG``) gives each compiled function's time; the slowest are
listed. The CPU and the CPU time other processes took meanwhile (/proc/stat) are reported.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

SECTION = "First run: kernels compiled from scratch (cold start)"
DATA = ROOT / "docs" / "data" / "cold-start.json"
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


def timed(args: list[str], cache: Path, log: Path | None = None,
          command: list[str] | None = None, extra_env: dict | None = None) -> dict:
    """Run the CLI (or ``command``); seconds to the first stdout byte and to the end, the
    compile log."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1",
           **(extra_env or {})}
    if log is not None:
        env["BITFORMAT_COMPILE_LOG"] = str(log)
    b0, i0 = busy()
    t0 = time.perf_counter()
    p = subprocess.Popen(command or CLI + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=env, cwd=ROOT)
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
         "stderr_tail": err.decode(errors="replace")[-600:],
         "stdout": out.decode(errors="replace")}
    if log is not None and log.exists():
        r["compile"] = json.loads(log.read_text())
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--no-warmup", action="store_true", help="skip `bitformat warmup`")
    ap.add_argument("--no-demo", action="store_true", help="skip the demo (tools/demo.sh)")
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
        decode = []  # what the newcomer then gets: warm decode speed, 3 runs
        for _ in range(3):
            r = timed(["run", a.model, "--prompt-ids", "1,5,17,300,42,7,99,128", "-n", "32",
                       "--json"], cache)
            j = json.loads(r["stdout"])
            decode.append({"decode_tok_s": j["generation_tokens_per_s"],
                           "prefill_tok_s": j["prompt_tokens_per_s"],
                           "cpu_busy_cores": r["cpu_busy_cores"]})
        res["decode"] = decode
    with tempfile.TemporaryDirectory(prefix="cold-") as d:
        cache = Path(d) / "numba"
        cache.mkdir()
        tiny = Path(d) / "tiny.gguf"
        subprocess.run(CLI + ["synth", "--preset", "tiny", "--seed", "0", "-o", str(tiny)],
                       check=True, capture_output=True, env={**os.environ,
                                                             "NUMBA_CACHE_DIR": str(cache)})
        shutil.rmtree(cache)
        cache.mkdir()
        res["tiny"] = timed([*run[:1], str(tiny), *run[2:]], cache, Path(d) / "log.json")
    if not a.no_warmup:
        with tempfile.TemporaryDirectory(prefix="cold-") as d:
            cache = Path(d) / "numba"
            cache.mkdir()
            res["warmup"] = timed(["warmup"], cache, Path(d) / "log.json")
            m = re.search(r"kernels ready: (\d+) compiled", res["warmup"]["stdout"])
            res["warmup"]["compiled_both"] = int(m.group(1)) if m else None
    if not a.no_demo:
        with tempfile.TemporaryDirectory(prefix="cold-") as d:
            cache = Path(d) / "numba"
            cache.mkdir()
            venv = Path(sys.executable).parent
            res["demo"] = timed([], cache, command=["bash", "tools/demo.sh"],
                                extra_env={"DEMO_DIR": str(Path(d) / "demo"),
                                           "PATH": f"{venv}:{os.environ['PATH']}"})
    for k in ("cold", "warm", "tiny", "warmup", "demo"):
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
    if a.write:
        from benchdoc import DOC, replace_section

        machines = json.loads(DATA.read_text()) if DATA.exists() else {}
        machines[res["cpu"]] = {"date": datetime.date.today().isoformat(),
                                "lines": machine_lines(res, a), "results": res}
        DATA.write_text(json.dumps(machines, indent=1) + "\n")
        replace_section(DOC, SECTION, section(machines, res["cpu"], a, kept_notes(DOC)),
                        after="Decode on the CPU (full-size synthetic 2B-4T)")


SLOWEST = "The slowest functions the first `run` compiled itself: "


def kept_notes(doc: Path) -> dict[str, str]:
    """The hand-written text under each machine's table (after its line of slowest
    functions, up to the next subsection), by machine, so that a new run keeps it."""
    from benchdoc import section_text

    notes = {}
    for part in section_text(doc, SECTION).split("\n### ")[1:]:
        name = part.split("\n", 1)[0].rsplit(" (", 1)[0]
        nl = part.find("\n", part.find(SLOWEST)) if SLOWEST in part else -1
        rest = part[nl + 1:].strip() if nl >= 0 else ""
        if rest:
            notes[name] = rest
    return notes


def _cold_row(what: str, r: dict) -> str:
    """A table row for a run on an empty cache: first output, total, what it compiled."""
    c = r.get("compile", {})
    return (f"| {what} | {r['first_output_s']:.1f} s | {r['total_s']:.1f} s | "
            f"{c.get('count', 0)} functions, {c.get('seconds', 0):.1f} s | "
            f"{r['cpu_busy_cores']:.2f} |")


def machine_lines(res: dict, a) -> list[str]:
    """This machine's table, and the slowest functions the first run compiled itself."""
    cold, warm = res["cold"], res["warm"]
    c = cold.get("compile", {})
    funcs = sorted(c.get("functions", {}).items(), key=lambda kv: -kv[1][1])[:6]
    lines = ["| what | first output | total | compiled here | cores busy |",
             "|---|---|---|---|---|",
             _cold_row(f"`bitformat run ... -n {a.tokens}`, empty cache", cold),
             f"| the same, cache filled | {warm['first_output_s']:.1f} s | "
             f"{warm['total_s']:.1f} s | none | {warm['cpu_busy_cores']:.2f} |"]
    if "decode" in res:
        dec = sorted(d["decode_tok_s"] for d in res["decode"])
        pre = sorted(d["prefill_tok_s"] for d in res["decode"])
        lines.append(f"| the same, warm, `-n 32 --json` (3 runs): decode "
                     f"{dec[len(dec) // 2]:.1f} tok/s, prompt {pre[len(pre) // 2]:.1f} tok/s "
                     f"(medians; decode {', '.join(f'{x:.1f}' for x in dec)}) | | | | "
                     f"{max(d['cpu_busy_cores'] for d in res['decode']):.2f} |")
    if "tiny" in res:
        lines.append(_cold_row("the same on the tiny model (`synth --preset tiny`), empty "
                               "cache", res["tiny"]))
    if "warmup" in res:
        w = res["warmup"]
        wc = w.get("compile", {})
        both = w.get("compiled_both")
        lines.append(f"| `bitformat warmup` (every container), empty cache | | "
                     f"{w['total_s']:.1f} s | {wc.get('count', 0)} functions, "
                     f"{wc.get('seconds', 0):.1f} s ({both} in both processes) | "
                     f"{w['cpu_busy_cores']:.2f} |")
    if "demo" in res:
        dm = res["demo"]
        lines.append(f"| `make demo` (tools/demo.sh: synth, 7 converts, inspect, report, run), "
                     f"empty cache | | {dm['total_s']:.1f} s | | {dm['cpu_busy_cores']:.2f} |")
    lines += ["", SLOWEST +
              ", ".join(f"{n} {own:.1f} s" for n, (inc, own) in funcs) + "."]
    return lines


def section(machines: dict, cpu: str, a, notes: dict[str, str] | None = None) -> str:
    """The section: how it is measured, a table per machine measured (``DATA``; this one
    first) with the text written under it by hand (``notes``), and how a first run works."""
    lines = [f"## {SECTION}", "",
             f"Command: `python tools/bench_cold_start.py {Path(a.model).name} --write` on "
             "`bitformat synth --preset 2b4t` (i2_s). Each figure is a new process with an "
             "empty kernel cache (`NUMBA_CACHE_DIR` a fresh folder); other processes' CPU time "
             "during each is given as cores busy (this one's included). Each machine keeps its "
             "last run (docs/data/cold-start.json). Targets (issue 25): first output of `run` "
             "on 2B-4T within 30 s, `warmup` within 90 s."]
    for name in sorted(machines, key=lambda m: m != cpu):
        lines += ["", f"### {name} ({machines[name]['date']})", "", *machines[name]["lines"]]
        note = (notes or {}).get(name, "")
        if note and note not in "\n".join(machines[name]["lines"]):  # (older runs kept theirs)
            lines += ["", note]
    lines += ["", "### How a first run compiles", "",
              "On an empty cache `run` starts a second process that compiles the layer "
              "kernels on a tiny synthetic model of the same family and container while the "
              "first loads the file and compiles the screened head (`runtime/warmup.py`, "
              "`start_helper`; `BITFORMAT_COMPILE_HELPER=0` turns it off): the two cores "
              "compile at once, and the kernels reach the first process through numba's cache "
              "on disk. The helper says when the kernels of a prompt and of a decode step run "
              "op by op are cached; the first process then generates, op by op, while the "
              "helper compiles at a lower priority the one-call decode step (AVX-512 VNNI "
              "builds: `runtime/cpu/decode.py`), which the first process takes up once the "
              "helper ends (`Backend.step_compiled`), and the long-context attention "
              "(one-token attention runs on one thread, with the same bits, until then). The "
              "command waits for the helper at its end, so 'total' includes it. `bitformat "
              "warmup` runs the rANS variants in a second process while the first runs the "
              "others."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
