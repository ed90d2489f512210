"""Decode and prefill speed of every container against i2_s on the full-size synthetic 2B-4T,
cpu backend, interleaved rounds (tools/bench_decode.py's workers, one process per container),
with the greedy tokens of every container checked against i2_s's.

    python tools/bench_containers.py --model out/bench/2b4t.gguf --write
    python tools/bench_containers.py --builds avx2,portable --write   # each build a row

Per round and run, the CPU time other processes took while it ran is read from /proc/stat
(the machine's busy time less the worker's own, /proc/PID/stat); a run where others took more
than ``--max-others`` of the machine is run again (up to twice). ``--write`` puts the table
into docs/benchmarks.md, the figures into docs/data/container-decode.json, and this CPU's
ratios into bitformat/data/container_costs.json, which ``bitformat inspect`` quotes. Builds
named with ``--builds`` (a build this CPU would not pick, e.g. avx2 on an AVX-512 CPU) get a
section and a JSON file of their own, so the main section keeps this CPU's default.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

SECTION = "Decode of every container (full-size synthetic 2B-4T, cpu)"
DATA = ROOT / "docs" / "data" / "container-decode.json"


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = f[3] + f[4]
    return sum(f) - idle, sum(f)


def proc_ticks(pid: int) -> int:
    """utime + stime of process ``pid`` (and its threads), in jiffies."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def cpu_flags() -> str:
    """The SIMD features the kernel builds care about, as this CPU reports them."""
    from bitformat.runtime.cpu.kernels import host_features

    have = host_features()
    names = [n for n in ("avx2", "avx512f", "avx512vnni", "avx512vbmi", "amx-int8") if n in have]
    return ", ".join(n.upper() for n in names) or "none of AVX2/AVX-512"


def timed_round(w, prompt: list[int], tokens: int, max_others: float) -> dict:
    """One run of worker ``w`` with the share of the machine other processes took; run again
    (twice at most) while that share is above ``max_others``."""
    for attempt in range(3):
        b0, t0 = cpu_ticks()
        p0 = proc_ticks(w.proc.pid)
        r = w.ask("run", prompt, tokens)
        b1, t1 = cpu_ticks()
        p1 = proc_ticks(w.proc.pid)
        others = max(0.0, ((b1 - b0) - (p1 - p0)) / max(1, t1 - t0))
        r["others"], r["attempts"] = others, attempt + 1
        if others <= max_others:
            break
    return r


def main() -> None:
    import bench_decode as bd

    from bitformat.formats import FORMAT_IDS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="out/bench/2b4t.gguf", help="an i2_s 2B-4T synth")
    ap.add_argument("--out", default="out/bench", help="folder for the converted files")
    ap.add_argument("--containers", default=",".join(FORMAT_IDS))
    ap.add_argument("--builds", default="auto",
                    help="cpu kernel builds to run, comma-separated (auto: this CPU's fastest)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-others", type=float, default=0.10,
                    help="share of the machine other processes may take during a run")
    ap.add_argument("--keep", action="store_true", help="keep the converted files")
    ap.add_argument("--write", action="store_true", help="update docs and the package's data")
    a = ap.parse_args()
    fids = [f.strip() for f in a.containers.split(",") if f.strip()]
    if "i2_s" not in fids:
        fids.insert(0, "i2_s")
    builds = [b.strip() for b in a.builds.split(",") if b.strip()]
    # this CPU's own build fills the main section; named builds get a section of their own
    section, data_file = SECTION, DATA
    if builds != ["auto"]:
        named = f"{'/'.join(builds)} build{'s' if len(builds) > 1 else ''} forced"
        section = SECTION.replace(" (", f", {named} (", 1)
        data_file = DATA.with_name(f"container-decode-{'-'.join(builds)}.json")
    src, out = Path(a.model), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    paths, made = bd.convert_missing(src, out, fids, "containers")
    prompt = bd.make_prompt(src, a.prompt)
    specs = []
    for b in builds:
        env = {} if b == "auto" else {"BITFORMAT_CPU_KERNEL": b}
        for fid in fids:
            label = fid if len(builds) == 1 else f"{fid} [{b}]"
            specs.append((label, "bitformat", paths[fid], a.threads, env))
    t_start = time.perf_counter()
    workers = []
    try:
        for spec in specs:
            t0 = time.perf_counter()
            workers.append(bd.Worker(*spec))
            workers[-1].ask("run", prompt, 4)  # warm-up: page cache, compilation
            print(f"  {spec[0]}: loaded in {workers[-1].load_s:.1f} s, warmed up in "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
        per_build = len(fids)  # each build's workers in turn, its i2_s first
        for i in range(a.repeat):
            for g in range(0, len(workers), per_build):
                base, *others = workers[g: g + per_build]
                before = run_once(base, i, prompt, a)
                for w in others:
                    r = run_once(w, i, prompt, a)
                    after = run_once(base, i, prompt, a)
                    for k in ("decode_tps", "prefill_tps"):  # i2_s either side of the run
                        r["anchor_" + k] = (before[k] + after[k]) / 2
                    before = after
    finally:
        for w in workers:
            w.close()
        if not a.keep:
            for p in made:
                p.unlink(missing_ok=True)
    elapsed = time.perf_counter() - t_start
    rows = []
    for w in workers:
        s = w.summary()
        s["others_max"] = max(r["others"] for r in w.runs)
        s["anchored"] = [{k: r[k] for k in r if k.endswith("_tps")} for r in w.runs
                         if "anchor_decode_tps" in r]
        s["fid"] = w.label.split(" ")[0]
        s["build"] = s["kernel"]
        rows.append(s)
    ref = {r["build"]: r for r in rows if r["fid"] == "i2_s"}
    bad = []
    for r in rows:
        base = ref[r["build"]]
        r["decode_ratio"] = r["decode_tps"] / base["decode_tps"]
        r["prefill_ratio"] = r["prefill_tps"] / base["prefill_tps"]
        r["decode_ratio_anchored"] = anchored_ratio(r, "decode_tps")
        r["prefill_ratio_anchored"] = anchored_ratio(r, "prefill_tps")
        r["same_tokens"] = all(t == base["tokens"][0] for t in r["tokens"])
        if not r["same_tokens"]:
            bad.append(r["label"])
    machine = bd.machine()
    flags = cpu_flags()
    cmd = (f"python tools/bench_containers.py --model {a.model} --builds {a.builds} "
           f"--threads {a.threads} --prompt {a.prompt} --tokens {a.tokens} --repeat {a.repeat} "
           "--write")
    lines = [f"## {section}", "",
             f"Command: `{cmd}`. Machine: {machine}; CPU features {flags}. {elapsed:.0f} s. "
             f"Each container runs in its own process ({a.threads} threads), warmed up, then "
             f"{a.repeat} rounds interleave the containers: a {a.prompt}-token prompt, then "
             f"{a.tokens} greedy decode steps, i2_s run again before and after each other "
             "container's run. Medians (i2_s's over all its runs). The ratios to i2_s of the "
             "same build: 'vs i2_s' of the medians; 'anchored' the median over rounds of a run "
             "over the mean of the i2_s runs either side of it, seconds apart, which the "
             "machine's speed changing over minutes moves far less (what the README and "
             "`inspect` quote). 'others' is the most CPU other processes took during one "
             "of the container's runs (/proc/stat less the worker's own time; a run above "
             f"{100 * a.max_others:.0f}% is run again). Tokens: every run's greedy tokens "
             "against i2_s's (docs/model.md §2).", "",
             "| container | build | bytes read a token | prefill tok/s | decode tok/s (runs) "
             "| decode vs i2_s | decode, anchored | prefill vs i2_s | prefill, anchored "
             "| others | same tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d = r["decode_all"]
        runs = (", ".join(f"{x:.2f}" for x in d) if len(d) <= 6
                else f"{len(d)} runs, {min(d):.2f}-{max(d):.2f}")
        lines.append(f"| {r['fid']} | {r['build']} | {r['bytes'] / 1e9:.3f} GB | "
                     f"{r['prefill_tps']:.1f} | {r['decode_tps']:.2f} ({runs}) | "
                     f"{r['decode_ratio']:.2f}x | {r['decode_ratio_anchored']:.2f}x | "
                     f"{r['prefill_ratio']:.2f}x | {r['prefill_ratio_anchored']:.2f}x | "
                     f"{100 * r['others_max']:.0f}% | {'yes' if r['same_tokens'] else 'NO'} |")
    report = "\n".join(lines) + "\n"
    print(report)
    if bad:
        print(f"ERROR: other tokens than i2_s from {', '.join(bad)}")
    if a.write:
        from benchdoc import DOC, replace_section, section_tail

        # the notes under the table are written by hand (what changed, the targets): kept
        replace_section(DOC, section, report + section_tail(DOC, section), after=SECTION)
        data_file.parent.mkdir(parents=True, exist_ok=True)
        record = {"machine": machine, "cpu_features": flags, "command": cmd,
                  "date": datetime.date.today().isoformat(), "rows": [
                      {k: r[k] for k in ("fid", "build", "prefill_tps", "decode_tps",
                                         "decode_all", "prefill_all", "bytes", "decode_ratio",
                                         "prefill_ratio", "decode_ratio_anchored",
                                         "prefill_ratio_anchored", "anchored",
                                         "others_max", "same_tokens", "held")}
                      for r in rows]}
        data_file.write_text(json.dumps(record, indent=1) + "\n")
        write_costs(record)
        print(f"wrote {DOC}, {data_file} and the package's container costs")
    if bad:
        sys.exit(1)


def run_once(w, i: int, prompt: list[int], a) -> dict:
    """One timed run of worker ``w`` in round ``i``, kept in ``w.runs`` and printed."""
    r = timed_round(w, prompt, a.tokens, a.max_others)
    w.runs.append(r)
    print(f"  round {i + 1} {w.label:22} prefill {r['prefill_tps']:7.1f} tok/s  "
          f"decode {r['decode_tps']:6.2f} tok/s  others {100 * r['others']:4.1f}%"
          + (f" ({r['attempts']} tries)" if r["attempts"] > 1 else ""), flush=True)
    return r


def anchored_ratio(r: dict, key: str) -> float:
    """The median over rounds of a container's tok/s (``key``: decode or prefill) over the
    mean of the i2_s runs just before and just after it, seconds apart: the machine changes
    speed over minutes (docs/benchmarks.md, "Two decode speeds"), and a ratio to i2_s's
    median, or to its run elsewhere in the round, carries that change. 1.0 for i2_s."""
    runs = r.get("anchored") or []
    if not runs:
        return 1.0
    return statistics.median(x[key] / x["anchor_" + key] for x in runs)


def write_costs(record: dict) -> None:
    """This CPU's decode and prefill ratios to i2_s per container and build into
    bitformat/data/container_costs.json (one entry per CPU model and build, replaced): the
    median of the rounds' ratios, which the machine's speed changing between rounds moves
    less than a ratio of medians does."""
    from bitformat.runtime.costs import COSTS_FILE

    data = json.loads(COSTS_FILE.read_text()) if COSTS_FILE.exists() else {"measured": []}
    cpu = record["machine"].split(",")[0]
    for build in sorted({r["build"] for r in record["rows"]}):
        rows = [r for r in record["rows"] if r["build"] == build]
        data["measured"] = [m for m in data["measured"]
                            if (m["cpu"], m["build"]) != (cpu, build)]
        data["measured"].append({
            "cpu": cpu, "cpu_features": record["cpu_features"], "build": build,
            "date": record["date"], "source": "tools/bench_containers.py",
            "i2_s_decode_tps": next(r["decode_tps"] for r in rows if r["fid"] == "i2_s"),
            "containers": {r["fid"]: {"decode": round(r["decode_ratio_anchored"], 3),
                                      "prefill": round(r["prefill_ratio_anchored"], 3),
                                      **({"held": r["held"]} if r.get("held") not in
                                         (None, r["fid"]) else {})} for r in rows}})
    COSTS_FILE.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
