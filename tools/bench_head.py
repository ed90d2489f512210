"""The screened LM head against the full one on a full-size synthetic 2B-4T (cpu backend).

    bitformat synth --preset 2b4t -o out/bench/2b4t.gguf
    flock /tmp/bitformat-cpu.lock python tools/bench_head.py --write

One process, one model: the full and the screened head take turns on the same loaded weights
(``--repeat`` rounds of full then screened, each a greedy generation of ``--tokens`` decode
steps after the same prompt), so both meet the same machine load. Reported: decode tokens/s of
each (median of the rounds), the token ids (they must be identical, and are asserted), the
head's bytes per decode step (screen + rescored f16 rows, against the f16 head's), the whole
step's bytes (ternary matrices + norms + head + KV cache), the fraction of the bandwidth floor,
the distribution of candidates per step (greedy, and seeded temperature 0.8 with top-k 40) with
a plot, and the CPU time other processes took during the timed rounds (/proc/stat). Run it
under the shared CPU lock (``flock``, as above): it does not take the lock itself.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

SECTION = "Screened LM head (full-size synthetic 2B-4T, cpu)"
PLOT = ROOT / "docs" / "bench-head-candidates.png"


def cpu_jiffies() -> tuple[int, int]:
    """(busy jiffies of the whole machine, jiffies of this process) so far."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    busy = sum(v) - v[3] - v[4]  # minus idle and iowait
    with open("/proc/self/stat") as f:
        s = f.read().rsplit(")", 1)[1].split()
    return busy, int(s[11]) + int(s[12])  # utime + stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="out/bench/2b4t.gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=64, help="decode steps per round")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--write", action="store_true", help="update docs/benchmarks.md and the plot")
    a = ap.parse_args()

    from bench_runtime import read_bandwidth

    import bitformat
    from bitformat.runtime.head import Head

    path = (ROOT / a.model) if not Path(a.model).is_absolute() else Path(a.model)
    t0 = time.perf_counter()
    m = bitformat.load(path, backend="cpu", threads=a.threads, head="screened")
    load_s = time.perf_counter() - t0
    a.kernel = m.backend.kernel
    m.warmup()
    heads = {"full": Head(m.backend, "full"), "screened": m.net.head}
    a.bits = m.net.head.tables.bits
    if a.bits != 8:  # the int8 screen beside it, on the same weights (its own tables)
        m.backend.screen_bits = 8
        heads["screened-int8"] = Head(m.backend, "screened")
        m.backend.screen_bits = a.bits
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(1000, 100000, a.prompt)]
    bw = [read_bandwidth(3)]
    print(f"read bandwidth {bw[0]:.1f} GB/s; load {load_s:.1f} s", flush=True)

    def once(mode: str, **kw) -> dict:
        m.net.head = heads[mode]
        r = m.generate(prompt, a.tokens + 1, **kw)
        st = m.head_stats()
        return {"tps": r.stats.generation_tps, "tokens": r.tokens, "stats": st,
                "candidates": list(heads[mode].stats.candidates),
                "rescored": list(heads[mode].stats.rescored)}

    for mode in heads:  # warm-up: page faults, thread pickers
        once(mode)
    runs: dict[str, list[dict]] = {mode: [] for mode in heads}
    b0, s0 = cpu_jiffies()
    w0 = time.perf_counter()
    for i in range(a.repeat):
        for mode in heads:
            runs[mode].append(once(mode))
            print(f"round {i} {mode}: {runs[mode][-1]['tps']:.2f} tok/s", flush=True)
    b1, s1 = cpu_jiffies()
    wall = time.perf_counter() - w0
    hz = os.sysconf("SC_CLK_TCK")
    other = max(0.0, (b1 - b0 - (s1 - s0)) / hz / (wall * os.cpu_count()))
    bw.append(read_bandwidth(3))
    ids = {mode: [r["tokens"] for r in rs] for mode, rs in runs.items()}
    assert all(t == ids["full"][0] for rs in ids.values() for t in rs), "ids differ"
    sampled = {mode: once(mode, temperature=0.8, top_k=40, seed=1) for mode in runs}
    assert all(r["tokens"] == sampled["full"]["tokens"] for r in sampled.values()), \
        "sampled ids differ"

    res = {}
    for mode, rs in runs.items():
        st = rs[-1]["stats"]
        tps = statistics.median(r["tps"] for r in rs)
        res[mode] = {"tps": tps, "tps_all": [r["tps"] for r in rs],
                     "head_bytes": st["head_bytes_per_step"],
                     "token_bytes": st["bytes_read_per_token"]}
    greedy_c = np.concatenate([r["candidates"] for r in runs["screened"]])
    sampled_c = np.asarray(sampled["screened"]["candidates"])
    rescored = np.concatenate([r["rescored"] for r in runs["screened"]])
    int8 = None
    if "screened-int8" in runs:
        int8 = {"greedy": np.concatenate([r["candidates"] for r in runs["screened-int8"]]),
                "sampled": np.asarray(sampled["screened-int8"]["candidates"]),
                "sampled_tps": {mode: r["tps"] for mode, r in sampled.items()},
                "screen_bytes": heads["screened-int8"].tables.nbytes}
    full_head = heads["full"].full_bytes
    bwm = statistics.median(bw)
    for r in res.values():
        r["floor"] = (r["token_bytes"] / (bwm * 1e9)) * r["tps"]
    speedup = res["screened"]["tps"] / res["full"]["tps"]
    text = render(a, res, greedy_c, sampled_c, full_head, bw, other, speedup,
                  heads["screened"].tables.nbytes, len(ids["full"][0]), rescored, int8)
    print(text)
    if a.write:
        from benchdoc import DOC, replace_section

        plot(greedy_c, sampled_c)
        replace_section(DOC, SECTION, text)
        print(f"wrote {DOC} and {PLOT}")


def dist(c: np.ndarray) -> str:
    q = np.percentile(c, [50, 90, 99])
    return (f"mean {c.mean():.1f}, median {q[0]:.0f}, p90 {q[1]:.0f}, p99 {q[2]:.0f}, "
            f"max {c.max()} (of {c.size} steps)")


def render(a, res, greedy_c, sampled_c, full_head, bw, other, speedup, screen_bytes,
           n_tokens, rescored, int8=None) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    rows = ["| head | decode tok/s (median; rounds) | head MB/token | of f16 head | "
            "MB/token (whole step) | of bandwidth floor |", "|---|---|---|---|---|---|"]
    for mode in res:
        r = res[mode]
        label = {"screened": f"screened (int{a.bits})", "screened-int8": "screened (int8)"}
        rounds = ", ".join(f"{t:.2f}" for t in r["tps_all"])
        rows.append(f"| {label.get(mode, mode)} | {r['tps']:.2f} ({rounds})"
                    f" | {r['head_bytes'] / 1e6:.1f} | {r['head_bytes'] / full_head:.1%} | "
                    f"{r['token_bytes'] / 1e6:.1f} | {r['floor']:.0%} |")
    hb_ok = res["screened"]["head_bytes"] <= 0.55 * full_head

    def met(ok: bool) -> str:
        return "met" if ok else "not met"

    cmd = (f"flock /tmp/bitformat-cpu.lock python tools/bench_head.py --threads {a.threads} "
           f"--prompt {a.prompt} --tokens {a.tokens} --repeat {a.repeat} --write")
    return "\n".join([
        f"## {SECTION}", "",
        f"Command: `{cmd}` on `bitformat synth --preset 2b4t` (i2_s, seed 0; its head is a "
        f"random Gaussian 128,256 x 2,560 f16 matrix, without a trained head's outlier "
        f"columns). Machine: {cpu}, {os.cpu_count()} cores, {a.threads} threads, cpu backend "
        f"({a.kernel} kernels). One process: the full and "
        f"the screened head alternate on the same loaded model, {a.repeat} rounds of "
        f"{a.tokens} greedy decode steps after a {a.prompt}-token prompt. Other processes "
        f"took {other:.0%} of the machine's CPU during the timed rounds; read bandwidth "
        f"{' / '.join(f'{b:.1f}' for b in bw)} GB/s (before / after).", "",
        *rows, "",
        "The bandwidth-floor column divides the step's bytes by the read bandwidth above "
        "(`bench_runtime.read_bandwidth`: the faster of two 2-thread numba read kernels over "
        "1 GiB, row sums as they come and row sums prefetching 8 KiB ahead into L2, as the "
        "model's kernels do) and by the step's time.", "",
        f"**Screened / full decode: {speedup:.2f}x**; the screened head reads "
        f"{res['screened']['head_bytes'] / full_head:.1%} of the f16 head's bytes per token "
        f"(the int{a.bits} screen with its scales and bound terms, {screen_bytes / 1e6:.1f} MB, "
        f"plus the rescored f16 rows). Token ids: identical in every round ({n_tokens} tokens) "
        f"and every head, and for seeded sampling (temperature 0.8, top-k 40, seed 1).", "",
        "Targets (issue 14): head bytes at most 55 % of the f16 head's: "
        f"**{res['screened']['head_bytes'] / full_head:.1%}** ({met(hb_ok)}); screened decode "
        f"at least 1.3x the full head's: **{speedup:.2f}x** ({met(speedup >= 1.3)}); decode "
        f"with the full head at least 75 % of the bandwidth floor: **{res['full']['floor']:.0%}**"
        f" ({met(res['full']['floor'] >= 0.75)}).", "",
        f"Candidates per step (rows the bounds leave), greedy: {dist(greedy_c)}; temperature "
        f"0.8 + top-k 40: "
        f"{dist(sampled_c)}. Plot: `docs/{PLOT.name}`. Of the greedy candidates the f16 "
        f"kernel read only those that could still win after the one with the largest upper "
        f"bound: {dist(rescored)}.", "",
        *(int8_text(a, res, int8) if int8 is not None else []),
        "The bound is rigorous (docs/exact-head.md): the rounding of each row to its codes and "
        "the two-level int8 rounding of the hidden state, each through Cauchy-Schwarz, plus "
        "the full kernel's float32 rounding from its summation depth (160 FMAs per lane + a "
        "4-level tree). On a trained head (Gemma 3 270M, \"Screened LM head on a trained "
        "model's head\" below) the per-row codes left 2-3x the candidates of a Gaussian head "
        "of the same shape; with column scales, which a Gaussian head does not get, about as "
        "many. The bound scales with the codes' step: on a Gaussian head "
        "(`tools/sim_screen_bits.py`: 128,256 rows, the bound's dominant term) int8 leaves 25 "
        "greedy candidates, int7 420 and int6 15,671 (12 % of the vocabulary), so on this "
        "head the runtime keeps int8 (int7); it switches to int6 by itself where that pays "
        "(docs/exact-head.md, \"The int6 screen, and which width runs\").",
    ])


def int8_text(a, res, int8) -> list[str]:
    """The int8 screen, run in the same rounds, against the int7 one."""
    r8, r7, full = res["screened-int8"], res["screened"], res["full"]
    st = int8["sampled_tps"]
    return [
        f"The int8 screen (where the CPU has no AVX512-VBMI; {int8['screen_bytes'] / 1e6:.1f} "
        f"MB) in the same rounds: {r8['tps']:.2f} tok/s, **{r8['tps'] / full['tps']:.2f}x** "
        f"the full head (int{a.bits}: {r7['tps'] / r8['tps']:.3f}x of int8), head "
        f"{r8['head_bytes'] / 1e6:.1f} MB/token; candidates greedy {dist(int8['greedy'])}; "
        f"temperature 0.8 + top-k 40: {dist(int8['sampled'])}. The seeded-sampling run "
        f"(one each): full {st['full']:.2f}, int{a.bits} {st['screened']:.2f}, int8 "
        f"{st['screened-int8']:.2f} tok/s.", ""]


def plot(greedy_c: np.ndarray, sampled_c: np.ndarray) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    hi = max(greedy_c.max(), sampled_c.max())
    bins = np.unique(np.geomspace(1, hi + 1, 40).astype(int))
    ax.hist(greedy_c, bins=bins, alpha=0.6, label=f"greedy ({greedy_c.size} steps)")
    ax.hist(sampled_c, bins=bins, alpha=0.6, label=f"T=0.8, top-k 40 ({sampled_c.size} steps)")
    ax.set_xscale("log")
    ax.set_xlabel("rows rescored by the f16 kernel per step (of 128,256)")
    ax.set_ylabel("steps")
    ax.set_title("Screened LM head on the synthetic 2B-4T (Gaussian head)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(PLOT, dpi=100)


if __name__ == "__main__":
    main()
