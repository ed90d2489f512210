"""tq1_0 and iq1_bn as lut3 tiles against i2_s, round by round, with the same containers held
as stfma rows (i2_s's kernels) as the control: how far the smaller holding is ahead in each
of the machine's states.

    python tools/bench_lut3.py --model 2b4t.gguf [--out DIR] [--containers tq1_0,iq1_bn]
        [--rounds 30] [--tokens 16] [--threads 2] [--write]

One process loads the i2_s model and each container twice: as lut3 tiles
(``BITFORMAT_CPU_LUT3=1``; the default on a CPU with AVX-512 VBMI and no AMX) and as stfma rows
(``=0``). Every round runs each of them once, a short prompt and then ``--tokens`` greedy
decode steps, with i2_s run before the first and after each, so every run has an i2_s run on
either side, a second or so away. A run's ratio is its decode tok/s over the mean of those
two. The machine this project is measured on moves between two speeds within minutes
(docs/benchmarks.md, "Two decode speeds"): runs are split by the speed of their i2_s runs (the
middle of its range), and rounds whose two i2_s runs differ by more than
``--max-spread`` (the speed changed inside the round) are left out. The control shows what
the method reads where the kernels are the same. Every run's greedy tokens are checked
against i2_s's, and a run during which other processes took more than ``--max-others`` of
the machine (/proc/stat) is run again once, with a fresh i2_s run after it.

``--write`` puts the table into docs/benchmarks.md, the rounds into docs/data/lut3-rounds.json
and a plot of every run's ratio against i2_s's speed into docs/lut3-rounds.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from bench_cold_start import cpu_name  # noqa: E402
from bench_containers import cpu_flags  # noqa: E402
from bench_serve import Contention  # noqa: E402

SECTION = "lut3 against i2_s, round by round (full-size synthetic 2B-4T, cpu)"
DATA = ROOT / "docs" / "data" / "lut3-rounds.json"
PLOT = ROOT / "docs" / "lut3-rounds.png"
HOLDINGS = {"lut3": "1", "stfma": "0"}


def load_all(paths: dict[str, Path], threads: int) -> dict[str, object]:
    """``{"i2_s": model, "<fid> <holding>": model}``; a holding the CPU cannot give is left
    out (lut3 tiles need AVX-512 VBMI and the vnni build)."""
    from bitformat.runtime import load
    from bitformat.runtime.cpu.backend import lut3_setting

    models = {"i2_s": load(paths["i2_s"], backend="cpu", threads=threads)}
    for fid, path in paths.items():
        if fid == "i2_s":
            continue
        for holding, value in HOLDINGS.items():
            with lut3_setting(value):
                m = load(path, backend="cpu", threads=threads)
            held = m.net.blocks[0].proj["attn_q"].encoding
            if held != holding:
                m.close()
                print(f"{fid}: this CPU holds it as {held} rows, not {holding}", flush=True)
                continue
            models[f"{fid} {holding}"] = m
    return models


def timed_run(model, prompt: list[int], tokens: int) -> dict:
    """Decode tok/s of ``tokens`` greedy steps after ``prompt``, the tokens, and the cores
    other processes took meanwhile."""
    with Contention([]) as c:
        r = model.generate(prompt, max_new_tokens=tokens + 1, stop_ids=[])
    return {"tps": r.stats.generation_tps, "tokens": list(r.tokens), "others": c.cores}


def run_rounds(models: dict, rounds: int, tokens: int, max_others: float,
               prompt: list[int], progress=print) -> list[dict]:
    """Every round's runs: ``{"round", "name", "tps", "before", "after", "others", "same"}``,
    ``before``/``after`` the i2_s runs either side. A run above ``max_others`` is run again
    once, with its i2_s run after it."""
    names = [n for n in models if n != "i2_s"]
    ref = models["i2_s"]
    want = timed_run(ref, prompt, tokens)["tokens"]
    for m in models.values():  # warm: compiled kernels, caches
        timed_run(m, prompt, tokens)
    out = []
    for r in range(rounds):
        before = timed_run(ref, prompt, tokens)
        for name in names:
            for _ in range(2):
                run = timed_run(models[name], prompt, tokens)
                after = timed_run(ref, prompt, tokens)
                if max(run["others"], after["others"], before["others"]) <= max_others:
                    break
                before = after
            out.append({"round": r, "name": name, "tps": run["tps"], "before": before["tps"],
                        "after": after["tps"], "same": run["tokens"] == want,
                        "others": max(run["others"], before["others"], after["others"])})
            before = after
        last = out[-len(names):]
        progress(f"  round {r + 1}/{rounds}: " + ", ".join(
            f"{e['name']} {e['tps'] / ((e['before'] + e['after']) / 2):.3f}x" for e in last)
            + f" (i2_s {last[0]['before']:.1f} tok/s)")
    return out


def anchor(e: dict) -> float:
    """Run ``e``'s i2_s speed: the mean of the i2_s runs either side of it."""
    return (e["before"] + e["after"]) / 2


def steady(e: dict, max_spread: float) -> bool:
    """Whether run ``e``'s two i2_s runs differ by at most ``max_spread`` of the slower (the
    machine kept its speed through the round)."""
    return abs(e["before"] - e["after"]) <= max_spread * min(e["before"], e["after"])


def split_speed(runs: list[dict]) -> float:
    """The i2_s speed that splits the runs into the machine's slower and faster states: the
    middle of the range of their anchor speeds (the mean of a run's two i2_s runs)."""
    speeds = [anchor(e) for e in runs]
    return (min(speeds) + max(speeds)) / 2


def summarize(runs: list[dict], max_spread: float) -> tuple[dict[str, dict], float]:
    """Per holding: ratios kept, their median, and the medians of the slower and faster runs
    (:func:`split_speed`)."""
    kept = [e for e in runs if steady(e, max_spread)]
    split = split_speed(kept or runs)
    out = {}
    for name in dict.fromkeys(e["name"] for e in runs):
        mine = [e for e in kept if e["name"] == name]
        speed = [anchor(e) for e in mine]
        ratio = [e["tps"] / x for e, x in zip(mine, speed, strict=True)]
        fast = [q for q, x in zip(ratio, speed, strict=True) if x > split]
        slow = [q for q, x in zip(ratio, speed, strict=True) if x <= split]

        def med(v):
            return statistics.median(v) if v else None

        out[name] = {"runs": sum(e["name"] == name for e in runs), "kept": len(mine),
                     "median": med(ratio), "slow": med(slow), "slow_n": len(slow),
                     "slow_range": [min(slow), max(slow)] if slow else None,
                     "fast": med(fast), "fast_n": len(fast),
                     "fast_range": [min(fast), max(fast)] if fast else None,
                     "same": all(e["same"] for e in runs if e["name"] == name)}
    return out, split


def render(a, summary: dict, split: float, runs: list[dict], seconds: float) -> str:
    def x(v):
        return "-" if v is None else f"{v:.3f}x"

    def rng(v):
        return "" if v is None else f", {v[0]:.2f}-{v[1]:.2f}"

    anchors = [anchor(e) for e in runs]
    lines = [f"## {SECTION}", "",
             f"Command: `python tools/bench_lut3.py --model {Path(a.model).name} --containers "
             f"{a.containers} --rounds {a.rounds} --tokens {a.tokens} --threads {a.threads}`. "
             f"Machine: {cpu_name()}; CPU features {cpu_flags()}. {seconds / 60:.1f} min. One "
             f"process; each round runs every holding once ({a.tokens} greedy decode steps "
             "after an 8-token prompt), i2_s before the first and after each. A run's ratio "
             "is its decode tok/s over the mean of the i2_s runs either side of it; rounds "
             f"whose two i2_s runs differ by more than {a.max_spread:.0%} are left out. i2_s "
             f"ran at {min(anchors):.1f}-{max(anchors):.1f} tok/s (mean of a run's two); "
             f"'slower' and 'faster' are the runs below and above {split:.1f} tok/s, the "
             "middle of that range. 'stfma' is the same "
             "container held as stfma rows, which run i2_s's kernels: the control.", "",
             "![Every run's decode speed over i2_s's, against i2_s's speed](lut3-rounds.png)",
             "",
             "| container, holding | runs kept | median ratio | slower: median, runs, range | "
             "faster: median, runs, range | same tokens |",
             "|---|---|---|---|---|---|"]
    for name, s in summary.items():
        lines.append(f"| {name} | {s['kept']} of {s['runs']} | {x(s['median'])} | "
                     f"{x(s['slow'])}, {s['slow_n']}{rng(s['slow_range'])} | "
                     f"{x(s['fast'])}, {s['fast_n']}{rng(s['fast_range'])} | "
                     f"{'yes' if s['same'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], split: float, max_spread: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    for name in dict.fromkeys(e["name"] for e in runs):
        mine = [e for e in runs if e["name"] == name and steady(e, max_spread)]
        xs = [anchor(e) for e in mine]
        ys = [e["tps"] / x for e, x in zip(mine, xs, strict=True)]
        ax.scatter(xs, ys, s=18, label=name, marker="o" if name.endswith("lut3") else "x")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.axvline(split, color="gray", lw=0.8, ls=":")
    ax.set_xlabel("i2_s decode tok/s (mean of the runs either side)")
    ax.set_ylabel("decode tok/s over i2_s's")
    ax.set_title("tq1_0 / iq1_bn as lut3 tiles and as stfma rows, against i2_s (2B-4T)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="an i2_s 2B-4T synth")
    ap.add_argument("--out", default="out/bench", help="folder for the converted files")
    ap.add_argument("--containers", default="tq1_0,iq1_bn")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-spread", type=float, default=0.15,
                    help="most the two i2_s runs of a round may differ by, as a fraction")
    ap.add_argument("--max-others", type=float, default=0.10,
                    help="cores other processes may take during a run before it is run again")
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args()
    import bench_decode as bd

    fids = ["i2_s", *(f.strip() for f in a.containers.split(",") if f.strip())]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    paths, _ = bd.convert_missing(Path(a.model), out, fids, "containers")
    t0 = time.perf_counter()
    models = load_all(paths, a.threads)
    prompt = [int(x) for x in np.random.default_rng(1).integers(100, 30000, 8)]
    runs = run_rounds(models, a.rounds, a.tokens, a.max_others, prompt)
    seconds = time.perf_counter() - t0
    summary, split = summarize(runs, a.max_spread)
    text = render(a, summary, split, runs, seconds)
    print(text)
    if not all(s["same"] for s in summary.values()):
        raise SystemExit("a holding decoded other tokens than i2_s")
    if a.write:
        from benchdoc import DOC, replace_section, section_tail

        plot(runs, split, a.max_spread)
        replace_section(DOC, SECTION, text + section_tail(DOC, SECTION),
                        after="lut3 tiles for tq1_0 and iq1_bn (AVX-512 VBMI)")
        DATA.write_text(json.dumps({"machine": cpu_name(), "cpu_features": cpu_flags(),
                                    "date": time.strftime("%Y-%m-%d"), "split": split,
                                    "summary": summary, "runs": runs}, indent=1) + "\n")
        print(f"wrote {DOC}, {DATA} and {PLOT}")


if __name__ == "__main__":
    main()
