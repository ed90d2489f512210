"""The server's concurrent-client throughput for every GGUF container against i2_s's.

    python tools/bench_serve_containers.py MODEL.gguf [--out DIR] [--clients 8] [--tokens 32]
        [--rounds 3] [--write]

MODEL is an i2_s file (``bitformat synth --preset 2b4t``); the other containers are converted
from it into ``--out`` where missing (tools/bench_decode.py's ``convert_missing``, kept). One
``bitformat serve --backend cpu --max-batch 8`` per container runs at once (idle between its
turns); each round sends, container after container, N concurrent streaming greedy
``/v1/completions`` requests (tools/bench_serve.py's clients) and times them. The table gives
each container's median aggregate tokens/s and its ratio to i2_s's, the ratio taken round by
round (the same minute of the machine) and then the median; every container's token ids must
equal i2_s's, request by request. A section where other processes took more than
``--max-other`` cores is repeated once. ``--write`` puts the table into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from bench_containers import cpu_flags  # noqa: E402
from bench_serve import Contention, clients_run, cpu_model, start_server  # noqa: E402

SECTION = "Serving concurrent clients, every GGUF container (full-size synthetic 2B-4T)"
GGUF_TYPES = ("i2_s", "tq2_0", "tq1_0", "q2_0", "iq2_bn", "iq1_bn")


def main() -> None:
    import bench_decode as bd

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path, help="an i2_s 2B-4T synth")
    ap.add_argument("--out", type=Path, default=Path("out/bench"),
                    help="folder for the converted files")
    ap.add_argument("--containers", default=",".join(GGUF_TYPES))
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-other", type=float, default=0.25,
                    help="cores other processes may take before a section is repeated")
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args()
    fids = [f.strip() for f in a.containers.split(",") if f.strip()]
    if "i2_s" not in fids:
        fids.insert(0, "i2_s")
    a.out.mkdir(parents=True, exist_ok=True)
    paths, _ = bd.convert_missing(a.model, a.out, fids, "containers")
    t_start = time.time()
    servers = {}
    try:
        for fid in fids:
            servers[fid] = start_server(paths[fid], 8, [])
            clients_run(servers[fid][1], 2, 4)  # warm-up: compile, page in a batched step
            print(f"  {fid}: serving", file=sys.stderr, flush=True)
        res: dict[str, list] = {fid: [] for fid in fids}
        for rnd in range(a.rounds):
            for fid in fids:
                proc, url = servers[fid]
                for _attempt in range(2):
                    with Contention([p.pid for p, _ in servers.values()]) as c:
                        r = clients_run(url, a.clients, a.tokens, ids=True)
                    r["other"] = c.cores
                    if c.cores <= a.max_other:
                        break
                res[fid].append(r)
                print(f"  round {rnd + 1} {fid:8} {r['aggregate']:6.1f} tok/s aggregate, "
                      f"others {r['other']:.2f} cores", file=sys.stderr, flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
        for proc, _ in servers.values():
            proc.wait(60)
    report(a, fids, res, time.time() - t_start)


def report(a, fids: list[str], res: dict, seconds: float) -> None:
    base = res["i2_s"]
    lines = [f"## {SECTION}", "",
             f"Command: `python tools/bench_serve_containers.py {a.model.name} --clients "
             f"{a.clients} --tokens {a.tokens} --rounds {a.rounds}`. Machine: {cpu_model()}, "
             f"{os.cpu_count()} cores, CPU features {cpu_flags()}; "
             "`bitformat serve --backend cpu --max-batch 8`, adaptive threads, one server per "
             f"container, all started before the first round. {seconds / 60:.1f} min. Each "
             f"round sends {a.clients} concurrent streaming requests of {a.tokens} greedy "
             "tokens (different prompts, `ignore_eos`) to each server in turn; aggregate = all "
             "tokens / wall time from the first request to the last token. Ratios are taken "
             "round by round against i2_s's, then the median; 'same tokens': every request's "
             "token ids equal i2_s's.", "",
             "| container | aggregate tok/s (rounds) | vs i2_s | per request tok/s | "
             "median TTFT ms | others (max cores) | same tokens |",
             "|---|---|---|---|---|---|---|"]
    bad = []
    for fid in fids:
        runs = res[fid]
        agg = [r["aggregate"] for r in runs]
        pairs = list(zip(runs, base, strict=True))
        ratio = statistics.median(r["aggregate"] / b["aggregate"] for r, b in pairs)
        same = all(r["ids"] == b["ids"] for r, b in pairs)
        if not same:
            bad.append(fid)
        lines.append(
            f"| {fid} | {statistics.median(agg):.1f} ({', '.join(f'{x:.1f}' for x in agg)}) | "
            f"{ratio:.2f}x | {statistics.median(r['tps'] for r in runs):.1f} | "
            f"{1e3 * statistics.median(r['ttft'] for r in runs):.0f} | "
            f"{max(r['other'] for r in runs):.2f} | {'yes' if same else 'NO'} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.write:
        from benchdoc import DOC, replace_section, section_tail

        replace_section(DOC, SECTION, text + section_tail(DOC, SECTION),
                        after="Serving concurrent clients (full-size synthetic 2B-4T)")
        print(f"wrote {DOC}")
    if bad:
        raise SystemExit(f"ERROR: other tokens than i2_s's from {', '.join(bad)}")


if __name__ == "__main__":
    main()
