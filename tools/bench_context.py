"""Prefill and decode against context length on the cpu backend, against llama.cpp on the
same trits: what a long conversation or document costs.

    python tools/bench_context.py MODEL.gguf [--contexts 8,1024,2048,3072,4000] [--write]
    python tools/bench_context.py MODEL.gguf --no-llama --kv-cache f16,q8_0
    python tools/bench_context.py MODEL.gguf --baseline /tmp/old-tree   # before/after

MODEL is a bitformat container of the 2B-4T shape (``bitformat synth --preset 2b4t``). Each
variant runs in a worker process of its own that loads the model once: this tree with each
``--kv-cache`` type, ``--baseline DIR`` (another source tree, e.g. ``git archive`` of an older
commit), and llama.cpp (llama-cpp-python) on a TQ2_0 copy of MODEL written as upstream's
``bitnet`` architecture (``bench_decode.llama_copy``: the same trits, bytes unchanged), with
the same threads (``--threads``, default all cores) and its default f16 KV cache.

For a context L every worker runs a prompt of L token ids (the same ids for all, drawn from
the vocabulary with a fixed seed) on a fresh sequence, timed as prefill, then ``--steps``
greedy decode steps after it, timed as decode. Rounds interleave the variants and contexts.
Reported per variant and L: prefill and decode tokens/s (medians over ``--rounds``), the KV
cache bytes a decode step reads at L, and the worker's peak resident memory (``VmHWM``).

Contention: each measurement records the CPU other processes took meanwhile (``/proc/stat``
less the worker's own time, in cores); one above ``--max-other`` is repeated once.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from bench_cold_start import cpu_name  # noqa: E402
from bench_load import TreeWorker, _self_cpu  # noqa: E402

SECTION = "Prefill and decode against context length (full-size synthetic 2B-4T, cpu)"
OLD_SECTION = "Decode against context length (full-size synthetic 2B-4T, cpu)"
MSG = "@@ctx "
PAIR_STEPS = 4  # decode steps a block of the paired measurement takes at each context
LLAMA = "llama.cpp"


def peak_rss() -> int:
    """This process's peak resident bytes (``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def prompt_ids(n: int, vocab: int) -> list[int]:
    import numpy as np

    lo = min(1000, vocab // 4)  # past the special tokens
    return [int(t) for t in np.random.default_rng(7).integers(lo, vocab - lo, n)]


# -- the workers ---------------------------------------------------------------------------------
class BitformatSide:
    def __init__(self, model: str, kv: str, threads: int | None):
        from bitformat.runtime import load

        kwargs = {"kv_cache": kv} if kv != "default" else {}
        self.m = load(model, backend="cpu", threads=threads, **kwargs)
        self.vocab = self.m.args.vocab_size
        self.m.warmup()  # every kernel a step can run, long contexts' attention included
        self.run(prompt_ids(70, self.vocab), 4)  # fault the weights in, a prompt's kernels

    def run(self, prompt: list[int], steps: int) -> dict:
        r = self.m.generate(prompt, max_new_tokens=steps + 1, stop_ids=[])
        s = r.stats
        return {"prefill_tps": len(prompt) / s.prompt_seconds, "decode_tps": s.generation_tps,
                "kv_bytes": s.kv_bytes_last_token}

    def paired(self, contexts: list[int], blocks: int, steps: int) -> dict:
        """Decode steps at each of ``contexts`` (two sequences held at once, prefilled first)
        taken in turn, ``steps`` at a time for ``blocks`` blocks: each block's ratio compares
        steps a fraction of a second apart, so the machine's speed is the same for both."""
        from bitformat.runtime.generate import generate_step
        from bitformat.runtime.models.base import Segment
        from bitformat.runtime.sampling import Sampler

        net, grow = self.m.net, blocks * steps + 2
        seqs = []
        for c in contexts:
            cache = net.new_cache(c + grow)
            if hasattr(cache, "reserve"):
                cache.reserve(c + grow)
            token = next(generate_step(net, prompt_ids(c, self.vocab), max_new_tokens=1,
                                       cache=cache))
            seqs.append([cache, token, Sampler()])
        ms: list[list[float]] = [[] for _ in contexts]
        for b in range(blocks):
            order = range(len(seqs)) if b % 2 == 0 else reversed(range(len(seqs)))
            for i in order:
                cache, token, sampler = seqs[i]
                for _ in range(steps):
                    t0 = time.perf_counter()
                    token = net.decode([Segment([token], cache)], [sampler])[0]
                    ms[i].append((time.perf_counter() - t0) * 1e3)
                seqs[i][1] = token
        return {"contexts": contexts, "steps": steps, "ms": ms}


class LlamaSide:
    """llama.cpp on the TQ2_0 copy (``bench_decode.LlamaRunner``, a context this long)."""

    def __init__(self, model: str, threads: int, n_ctx: int):
        from bench_decode import LlamaRunner

        self.runner = LlamaRunner(model, threads, n_ctx)
        self.vocab = self.runner.vocab
        self.run(prompt_ids(70, self.vocab), 4)

    def run(self, prompt: list[int], steps: int) -> dict:
        r = self.runner.run(prompt, steps)
        return {k: r[k] for k in ("prefill_tps", "decode_tps", "kv_bytes")}


def worker(kind: str, model: str, steps: int, max_context: int, kv: str,
           threads: int | None) -> None:
    if kind == "llama":
        side = LlamaSide(model, threads or os.cpu_count() or 1, max_context + steps + 8)
    else:
        side = BitformatSide(model, kv, threads)
    print(MSG + json.dumps({"ready": True, "vocab": side.vocab}), flush=True)
    for line in sys.stdin:
        c0 = _self_cpu()
        if line.startswith("pair "):  # "pair SHORT,LONG BLOCKS"
            ctxs, blocks = line.split()[1:]
            r = side.paired([int(c) for c in ctxs.split(",")], int(blocks), PAIR_STEPS)
            print(MSG + json.dumps({**r, "cpu": _self_cpu() - c0}), flush=True)
            continue
        prompt = prompt_ids(int(line), side.vocab)
        r = side.run(prompt, steps)
        print(MSG + json.dumps({**r, "cpu": _self_cpu() - c0, "peak_rss": peak_rss()}),
              flush=True)


# -- the parent --------------------------------------------------------------------------------
class Worker(TreeWorker):
    def __init__(self, name: str, kind: str, tree: Path, model: str, steps: int,
                 max_context: int, kv: str, threads: int | None):
        self.kind = kind
        super().__init__(name, tree, [
            str(Path(__file__).resolve()), "--worker", kind, model, "--steps", str(steps),
            "--max-context", str(max_context), "--kv-cache", kv]
            + (["--threads", str(threads)] if threads else []), MSG)

    def measure(self, ctx: int) -> dict:
        return self.ask(str(ctx))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--worker", choices=["bitformat", "llama"], help=argparse.SUPPRESS)
    ap.add_argument("--max-context", type=int, default=4000, help=argparse.SUPPRESS)
    ap.add_argument("--contexts", default="8,1024,2048,3072,4000")
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per measurement")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None,
                    help="threads of every variant (default: bitformat adaptive, llama.cpp "
                         "all cores)")
    ap.add_argument("--baseline", type=Path, help="another source tree to compare against")
    ap.add_argument("--kv-cache", default="f16",
                    help="KV cache types to run this tree with (comma-separated)")
    ap.add_argument("--no-llama", action="store_true", help="leave llama.cpp out")
    ap.add_argument("--llama-file", type=Path,
                    help="where the llama.cpp copy goes (default: beside MODEL)")
    ap.add_argument("--pair", default="8,3072",
                    help="SHORT,LONG: each round, bitformat's workers also take decode steps "
                         "at the two contexts in turn, 4 at a time, for a ratio the machine's "
                         "speed changes cannot skew ('' leaves it out)")
    ap.add_argument("--pair-blocks", type=int, default=16,
                    help="blocks of the paired measurement per round")
    ap.add_argument("--max-other", type=float, default=0.25)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "context-decode.png")
    ap.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    ap.add_argument("--from-json", type=Path,
                    help="report a run saved with --json instead of measuring")
    a = ap.parse_args()
    if a.worker:
        worker(a.worker, a.model, a.steps, a.max_context, a.kv_cache, a.threads)
        return
    contexts = [int(x) for x in a.contexts.split(",")]
    if a.from_json:
        out = json.loads(a.from_json.read_text())
        contexts = [int(c) for c in next(iter(out["results"].values()))]
        report(out, contexts, a)
        return
    t_start = time.time()
    model = Path(a.model).resolve()
    kvs = a.kv_cache.split(",")
    specs = [(f"bitformat {kv}", "bitformat", ROOT, str(model), kv) for kv in kvs]
    if a.baseline:
        specs.append(("before", "bitformat", a.baseline.resolve(), str(model), "default"))
    if not a.no_llama:
        llama = a.llama_file or model.with_name(model.stem + ".llama-tq2_0.gguf")
        if not llama.exists():
            from bench_decode import llama_copy

            from bitformat.container import convert

            tq = model.with_name(model.stem + ".tq2_0-for-llama.gguf")
            print(f"writing the TQ2_0 copy for llama.cpp: {llama}", flush=True)
            convert(model, tq, "tq2_0")
            llama_copy(tq, llama)
            tq.unlink()
        specs.append((LLAMA, "llama", ROOT, str(llama), "f16"))
    workers = [Worker(n, kind, tree, path, a.steps, max(contexts), kv, a.threads)
               for n, kind, tree, path, kv in specs]
    res: dict[str, dict[int, list[dict]]] = {w.name: {c: [] for c in contexts} for w in workers}
    pairs: dict[str, list[dict]] = {w.name: [] for w in workers if w.kind != "llama"}
    try:
        for r in range(a.rounds):
            for c in contexts:
                for w in workers:
                    m = w.measure(c)
                    if m["other"] > a.max_other:
                        m = w.measure(c)
                    res[w.name][c].append(m)
                    print(f"round {r} {w.name:15s} L={c:5d} prefill {m['prefill_tps']:7.1f} "
                          f"decode {m['decode_tps']:6.2f} tok/s, peak "
                          f"{m['peak_rss'] / 2**30:.2f} GiB (other {m['other']:.2f})",
                          flush=True)
            for w in workers:
                if a.pair and w.name in pairs:
                    p = w.ask(f"pair {a.pair} {a.pair_blocks}")
                    pairs[w.name].append(p)
                    rs = pair_ratios(p)
                    print(f"round {r} {w.name:15s} paired {a.pair}: decode ratio per block "
                          f"{statistics.median(rs):.3f} ({min(rs):.3f}-{max(rs):.3f}), other "
                          f"{p['other']:.2f}", flush=True)
    finally:
        for w in workers:
            w.close()
    out = {"cpu": cpu_name(), "model": a.model, "steps": a.steps, "rounds": a.rounds,
           "kv": a.kv_cache, "threads": a.threads,
           "baseline_commit": _commit(a.baseline) if a.baseline else None,
           "minutes": (time.time() - t_start) / 60,
           "results": {n: {str(c): v for c, v in d.items()} for n, d in res.items()},
           "paired": pairs}
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    report(out, contexts, a)


def report(out: dict, contexts: list[int], a) -> None:
    text = section(out, contexts)
    print(text)
    plot(out, contexts, a.plot)
    if a.write:
        from benchdoc import DOC, replace_section

        doc = DOC.read_text()
        old = doc.find(f"## {OLD_SECTION}\n")
        if old >= 0:  # this section replaces the decode-only one it grew from
            end = doc.find("\n## ", old + 4)
            DOC.write_text(doc[:old] + doc[end + 1:])
        replace_section(DOC, SECTION, text, after="Decode on the CPU (full-size synthetic 2B-4T)")


def _commit(tree: Path) -> str:
    """The commit ``tree`` was archived from (git archive writes it into no file: the caller
    names it with BASELINE_COMMIT), else its path."""
    return os.environ.get("BASELINE_COMMIT", str(tree))


def pair_ratios(p: dict) -> list[float]:
    """Each block's decode speed at the long context over the short one's (median step times
    of the block, short / long)."""
    k = p["steps"]
    short, long_ = p["ms"]
    return [statistics.median(short[i:i + k]) / statistics.median(long_[i:i + k])
            for i in range(0, len(short), k)]


def _med(ms: list[dict], key: str) -> float:
    return statistics.median(m[key] for m in ms)


def section(out: dict, contexts: list[int]) -> str:
    names = list(out["results"])
    res = out["results"]
    mine = [n for n in names if n.startswith("bitformat")]
    llama = LLAMA if LLAMA in names else None
    threads = out.get("threads")
    lines = [f"## {SECTION}", "",
             f"Command: `python tools/bench_context.py 2b4t.gguf --contexts "
             f"{','.join(map(str, contexts))} --steps {out['steps']} --rounds {out['rounds']} "
             f"--kv-cache {out['kv']}" + (f" --threads {threads}" if threads else "")
             + (" --baseline DIR" if "before" in names else "") + " --write` on `bitformat "
             "synth --preset 2b4t` (i2_s)"
             + (f", DIR = `git archive` of {out['baseline_commit']}" if "before" in names
                else "") + ". Machine: " + out["cpu"] + f". The run took {out['minutes']:.1f} "
             "min.", "",
             "Each variant is a worker process that loads the model once. For a context L it "
             "runs a prompt of L token ids on a fresh sequence (prefill, timed) and then "
             f"{out['steps']} greedy decode steps (decode, timed; the whole step, the LM head "
             "included). llama.cpp is llama-cpp-python on a TQ2_0 copy of the same trits "
             "(upstream's `bitnet` architecture), "
             + (f"{threads} threads" if threads else "all cores") + ", its default f16 KV "
             "cache. Rounds interleave the variants and contexts; figures are medians over the "
             "rounds. KV MB: what the last decode step read from the cache. Peak: the "
             "worker's resident memory at its highest so far (the model's pages included).",
             ""]
    head = ["L"]
    for n in names:
        head += [f"{n} prefill tok/s", f"{n} decode tok/s"]
    if llama:
        head += [f"{m} / llama.cpp (prefill, decode)" for m in mine]
    head += [f"{n} KV MB / peak GiB" for n in names]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in contexts:
        row = [f"{c:,}"]
        for n in names:
            row += [f"{_med(res[n][str(c)], 'prefill_tps'):.1f}",
                    f"{_med(res[n][str(c)], 'decode_tps'):.2f}"]
        if llama:
            lp, ld = (_med(res[llama][str(c)], k) for k in ("prefill_tps", "decode_tps"))
            for m in mine:
                row.append(f"{_med(res[m][str(c)], 'prefill_tps') / lp:.2f}x, "
                           f"{_med(res[m][str(c)], 'decode_tps') / ld:.2f}x")
        for n in names:
            last = res[n][str(c)][-1]
            row.append(f"{last['kv_bytes'] / 1e6:,.0f} / {last['peak_rss'] / 2**30:.2f}")
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    short, long_ = contexts[0], [c for c in contexts if c >= 3072]
    for n in names:
        if long_:
            c = long_[0]
            ratio = _med(res[n][str(c)], "decode_tps") / _med(res[n][str(short)], "decode_tps")
            lines.append(f"- {n}: decode at L = {c:,} is {ratio:.2f} of its speed at L = "
                         f"{short} (target, issue 23: at least 0.6).")
    for n, ps in out.get("paired", {}).items():
        if not ps:
            continue
        c_short, c_long = ps[0]["contexts"]
        rs = [pair_ratios(p) for p in ps]
        every = [x for r in rs for x in r]
        step = [statistics.median(p["ms"][i]) for i in (0, 1) for p in ps]
        lines.append(
            f"- {n}, paired (the two contexts held at once, {ps[0]['steps']} decode steps at "
            f"each in turn, {len(every) // len(ps)} blocks a round): decode at L = {c_long:,} "
            f"is {statistics.median(every):.2f} of its speed at L = {c_short} (each block's "
            f"ratio; rounds' medians " + ", ".join(f"{statistics.median(r):.2f}" for r in rs)
            + f"; blocks {min(every):.2f}-{max(every):.2f}). Step "
            + ", ".join(f"{x:.1f}" for x in step[:len(ps)]) + f" ms at {c_short}, "
            + ", ".join(f"{x:.1f}" for x in step[len(ps):]) + f" ms at {c_long:,} (rounds' "
            f"medians; other processes at most {max(p['other'] for p in ps):.2f} cores).")
    if llama:
        for m in mine:
            dec = min(_med(res[m][str(c)], "decode_tps") / _med(res[llama][str(c)], "decode_tps")
                      for c in contexts)
            pre = min(_med(res[m][str(c)], "prefill_tps")
                      / _med(res[llama][str(c)], "prefill_tps") for c in contexts)
            lines.append(f"- {m} against llama.cpp, lowest over the contexts: decode {dec:.2f}x, "
                         f"prefill {pre:.2f}x (targets, issue 23: at least 1.5x each).")
    other = max(m["other"] for d in res.values() for ms in d.values() for m in ms)
    lines += ["", f"Other processes took at most {other:.2f} cores during a measurement.", "",
              "![tok/s against context](context-decode.png)"]
    return "\n".join(lines) + "\n"


def plot(out: dict, contexts: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for (name, d), marker in zip(out["results"].items(), "osD^v", strict=False):
        for ax, key in zip(axes, ("decode_tps", "prefill_tps"), strict=True):
            ax.plot(contexts, [_med(d[str(c)], key) for c in contexts], marker=marker,
                    label=name)
    for ax, what in zip(axes, ("decode", "prefill"), strict=True):
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(f"{what} tokens/s")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("2B-4T on the cpu backend against context, and llama.cpp\n" + out["cpu"],
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
