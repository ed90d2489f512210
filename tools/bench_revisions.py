"""The same model and container on two source trees (a revision before a change and after it),
cpu backend, interleaved rounds: that a change kept its speed, and the same tokens.

    git worktree add /tmp/before <rev>
    python tools/bench_revisions.py --before /tmp/before --model out/bench/2b4t.gguf --write

Each tree runs its own ``tools/bench_decode.py`` worker in its own process (so each imports its
own ``bitformat``), warmed up; then ``--repeat`` rounds alternate the trees, each a prompt of
``--prompt`` tokens and ``--tokens`` greedy decode steps. Per run the CPU share other
processes took is read from /proc/stat (tools/bench_containers.py's ``timed_round``) and a run
above ``--max-others`` is run again. ``--write`` puts the table into docs/benchmarks.md under
``--section``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))


def revision(tree: Path) -> str:
    """The commit a tree is at, and "+ changes" where its files differ from it."""
    head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip() or "?"
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain",
                            "--untracked-files=no"], capture_output=True, text=True).stdout.strip()
    return head + (" + changes" if dirty else "")


def main() -> None:
    import bench_decode as bd
    from bench_containers import cpu_flags, timed_round

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, type=Path, help="the other source tree")
    ap.add_argument("--after", default=ROOT, type=Path, help="default: this tree")
    ap.add_argument("--model", default="out/bench/2b4t.gguf", help="a GGUF container")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--max-others", type=float, default=0.10)
    ap.add_argument("--section", default="Before and after a change (cpu decode)")
    ap.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    a = ap.parse_args()
    model = Path(a.model).resolve()
    prompt = bd.make_prompt(model, a.prompt)
    trees = [("before", a.before.resolve()), ("after", a.after.resolve())]
    workers = []
    t_start = time.perf_counter()
    try:
        for label, tree in trees:
            w = bd.Worker(label, "bitformat", model, a.threads,
                          script=tree / "tools" / "bench_decode.py")
            w.ask("run", prompt, 4)  # warm-up: page cache, compilation
            workers.append(w)
            print(f"  {label} ({revision(tree)}): loaded in {w.load_s:.1f} s", flush=True)
        for i in range(a.repeat):
            for w in (workers if i % 2 == 0 else workers[::-1]):
                r = timed_round(w, prompt, a.tokens, a.max_others)
                w.runs.append(r)
                print(f"  round {i + 1} {w.label:7} prefill {r['prefill_tps']:7.1f} tok/s  "
                      f"decode {r['decode_tps']:6.2f} tok/s  others {100 * r['others']:4.1f}%",
                      flush=True)
    finally:
        for w in workers:
            w.close()
    elapsed = time.perf_counter() - t_start
    rows = []
    for (label, tree), w in zip(trees, workers, strict=True):
        rows.append({"label": label, "rev": revision(tree), "kernel": w.runs[-1].get("kernel"),
                     "decode": statistics.median(r["decode_tps"] for r in w.runs),
                     "prefill": statistics.median(r["prefill_tps"] for r in w.runs),
                     "decode_all": [r["decode_tps"] for r in w.runs],
                     "others": max(r["others"] for r in w.runs),
                     "tokens": [r.get("tokens") for r in w.runs]})
    base = rows[0]
    same = all(t == base["tokens"][0] for r in rows for t in r["tokens"])
    cmd = (f"python tools/bench_revisions.py --before <tree at {base['rev']}> --model "
           f"{a.model} --threads {a.threads} --prompt {a.prompt} --tokens {a.tokens} "
           f"--repeat {a.repeat} --write")
    lines = [f"## {a.section}", "",
             f"Command: `{cmd}`. Machine: {bd.machine()}; CPU features {cpu_flags()}. "
             f"{elapsed:.0f} s. Model: `{model.name}`. Each tree in its own process "
             f"({a.threads} threads), warmed up, then {a.repeat} rounds alternating which runs "
             f"first: a {a.prompt}-token prompt, then {a.tokens} greedy decode steps. Medians; "
             "ratios to 'before' from the same run. 'others': the most CPU other processes "
             f"took during one run (a run above {100 * a.max_others:.0f}% is run again).", "",
             "| tree | revision | build | prefill tok/s | decode tok/s (rounds) | decode vs "
             "before | prefill vs before | others |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        runs = ", ".join(f"{x:.2f}" for x in r["decode_all"])
        lines.append(f"| {r['label']} | {r['rev']} | {r['kernel']} | {r['prefill']:.1f} | "
                     f"{r['decode']:.2f} ({runs}) | {r['decode'] / base['decode']:.3f}x | "
                     f"{r['prefill'] / base['prefill']:.3f}x | {100 * r['others']:.0f}% |")
    lines += ["", f"Greedy tokens of every run the same: {'yes' if same else 'NO'}."]
    report = "\n".join(lines) + "\n"
    print(report)
    if a.write:
        from benchdoc import DOC, replace_section

        replace_section(DOC, a.section, report)
        print(f"wrote {DOC}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
