"""Where the time of a batched decode step goes on the cpu backend, against what the CPU's int8
multiply-add rate allows: the figures behind how `bitformat serve` scales with its clients.

    python tools/bench_batched_step.py 2b4t.gguf [--clients 8] [--tokens 32] [--rounds 5] \
        [--json F] [--write]

One process, the full-size 2B-4T given (an i2_s synth), the cpu backend with its defaults.
Each round, in turn:

- ``N`` prompts at once (bench_serve's prompts, as the server's first step runs them: one pass
  over the weights for all their tokens), then steps of one token for each of the ``N``
  requests;
- one prompt alone, then steps of one token (a lone client);
- each projection of a layer (q|k|v stacked, o, gate|up stacked, down) by itself on ``N``
  tokens: the batched kernel's time and rate in multiply-adds a second.

A step is timed in two parts: the layers (``forward_hidden``: every projection, attention,
norm) and the head (the screened head's choice of each request's token). From the parts it
works out the figure `tools/bench_serve.py --clients 1,N --tokens K` measures over HTTP (the
aggregate tok/s of N clients over one client's, K tokens each, the prompts' pass included):
as the parts measured here, and with every pass at its multiply-add floor (its multiply-adds
at the best rate the projections reached, nothing else costing anything), which no
implementation on this CPU can beat. The CPU other processes took is recorded per round
(/proc/stat less this process's own time, in cores: bench_serve's ``Contention``);
``--write`` puts the table into docs/benchmarks.md and the figures into
docs/data/batched-step.json.
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

SECTION = "Where a batched step's time goes (full-size synthetic 2B-4T, cpu)"
DATA = ROOT / "docs" / "data" / "batched-step.json"
#: the stacked projections of a layer, as the one-call decode steps run them
PROJECTIONS = {"q|k|v": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",),
               "gate|up": ("ffn_gate", "ffn_up"), "down": ("ffn_down",)}


def timed(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t


class Bench:
    def __init__(self, path: str, clients: int):
        import numpy as np

        from bitformat.runtime.loader import load
        from bitformat.runtime.models import Segment
        from bitformat.runtime.sampling import Sampler

        self.np, self.Segment, self.Sampler = np, Segment, Sampler
        self.model = load(path, "cpu")
        self.net, self.n = self.model.net, clients
        from bench_serve import PROMPTS

        tok = self.model.tokenizer
        self.prompts = [list(tok.encode(PROMPTS[i % len(PROMPTS)])) for i in range(clients)]
        blk = self.net.blocks[0]  # the weights as the model holds them (stacked where it can)
        self.mats = {name: blk.stacked.get(parts) or blk.proj[parts[0]]
                     for name, parts in PROJECTIONS.items()}
        missing = [n for n, parts in PROJECTIONS.items() if len(parts) > 1
                   and parts not in blk.stacked]
        if missing:
            raise SystemExit(f"{path}: the backend does not stack {', '.join(missing)}: "
                             "give an i2_s 2B-4T file")
        self.layers = len(self.net.blocks)

    def _pass(self, segs) -> tuple[float, float]:
        """(layers s, head s) of one pass of ``segs``."""
        h, t_layers = timed(self.net.forward_hidden, segs)
        _, t_head = timed(self.net.select, h, [self.Sampler() for _ in segs])
        return t_layers, t_head

    def requests(self, prompts: list[list[int]], steps: int) -> dict:
        """The prompts' pass, then ``steps`` steps of a token for each (medians of the steps)."""
        caches = [self.net.new_cache(len(p) + steps + 1) for p in prompts]
        pre = self._pass([self.Segment(p, c) for p, c in zip(prompts, caches, strict=True)])
        layers, head = [], []
        for _ in range(steps):
            a, b = self._pass([self.Segment([7], c) for c in caches])
            layers.append(a)
            head.append(b)
        return {"prompt_layers": pre[0], "prompt_head": pre[1],
                "step_layers": statistics.median(layers), "step_head": statistics.median(head),
                "rows": sum(len(p) for p in prompts)}

    def kernels(self, reps: int = 5) -> dict:
        """Each projection of a layer on ``n`` tokens by itself: seconds (median of ``reps``)
        and multiply-adds."""
        np, be, out = self.np, self.net.be, {}
        rng = np.random.default_rng(0)
        for name, w in self.mats.items():
            x = rng.standard_normal((self.n, w.cols)).astype(np.float32)
            qa = be.norm_quant(x, np.ones(w.cols, np.float32), 1e-5)
            be.bitlinear(qa, w)
            times = [timed(be.bitlinear, qa, w)[1] for _ in range(reps)]
            out[name] = {"s": statistics.median(times), "macs": self.n * w.rows * w.cols}
        return out

    def warm(self) -> None:
        self.requests(self.prompts, 2)
        self.requests(self.prompts[:1], 2)
        self.kernels(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a full-size 2B-4T (i2_s) file: bitformat synth --preset 2b4t")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32, help="tokens a request (for the estimate)")
    ap.add_argument("--steps", type=int, default=6, help="decode steps timed per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-others", type=float, default=0.25,
                    help="cores other processes may take in a round that is kept")
    ap.add_argument("--json", help="write the figures here too")
    ap.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    a = ap.parse_args()
    from bench_cold_start import cpu_name
    from bench_decode import machine
    from bench_serve import Contention

    t_start = time.perf_counter()
    b = Bench(a.model, a.clients)
    b.warm()
    rounds = []
    for i in range(a.rounds):
        for attempt in range(2):
            with Contention([]) as o:  # cores others took meanwhile
                many = b.requests(b.prompts, a.steps)
                one = b.requests(b.prompts[:1], a.steps)
                k = b.kernels()
            if o.cores <= a.max_others or attempt:
                break
        rounds.append({"many": many, "one": one, "kernels": k, "others": o.cores})
        step_n = 1000 * (many["step_layers"] + many["step_head"])
        step_1 = 1000 * (one["step_layers"] + one["step_head"])
        print(f"  round {i + 1}: step of {a.clients} tokens {step_n:.1f} ms, of one "
              f"{step_1:.1f} ms, others {o.cores:.2f} cores", flush=True)
    kept = [r for r in rounds if r["others"] <= a.max_others] or rounds
    n, K, L = a.clients, a.tokens, b.layers

    def part(who: str, key: str) -> float:
        return statistics.median(r[who][key] for r in kept)

    kern = {name: {"s": statistics.median(r["kernels"][name]["s"] for r in kept),
                   "macs": kept[0]["kernels"][name]["macs"]} for name in PROJECTIONS}
    rate = max(v["macs"] / v["s"] for v in kern.values())  # the best the kernels reached
    layer_macs = sum(v["macs"] for v in kern.values()) // n  # a token's, one layer
    head_macs = b.net.be.vocab * b.net.be.dim  # a token's, one int8 pass
    mm_step = L * sum(v["s"] for v in kern.values())
    rows_n, rows_1 = kept[0]["many"]["rows"], kept[0]["one"]["rows"]
    S = {w: part(w, "step_layers") + part(w, "step_head") for w in ("many", "one")}
    P = {w: part(w, "prompt_layers") + part(w, "prompt_head") for w in ("many", "one")}

    def ratio(p_n, s_n, p_1, s_1) -> float:
        return (n * K / (p_n + (K - 1) * s_n)) / (K / (p_1 + (K - 1) * s_1))

    floor_s = n * (L * layer_macs + head_macs) / rate
    floor_p = (rows_n * L * layer_macs + n * head_macs) / rate
    # per round: the machine changes speed over minutes (a lone step, bound by memory, moves
    # with it; a batched one, bound by multiply-adds, much less), so each round's own parts
    def whole(r: dict, w: str, kind: str) -> float:
        return r[w][kind + "_layers"] + r[w][kind + "_head"]

    est_r = [ratio(whole(r, "many", "prompt"), whole(r, "many", "step"),
                   whole(r, "one", "prompt"), whole(r, "one", "step")) for r in kept]
    best_r = [ratio(floor_p, floor_s, whole(r, "one", "prompt"), whole(r, "one", "step"))
              for r in kept]
    need_r = []  # the step of n tokens that 3x needs, the round's prompts' pass as measured
    for r in kept:
        agg1 = K / (whole(r, "one", "prompt") + (K - 1) * whole(r, "one", "step"))
        need_r.append((n * K / (3 * agg1) - whole(r, "many", "prompt")) / (K - 1))
    est, best, need = (statistics.median(x) for x in (est_r, best_r, need_r))

    def span(xs: list[float], f: str) -> str:
        return f"{min(xs):{f}}-{max(xs):{f}}"

    ms = 1000
    cmd = (f"python tools/bench_batched_step.py 2b4t.gguf --clients {n} --tokens {K} "
           f"--steps {a.steps} --rounds {a.rounds}")
    lines = [
        f"## {SECTION}", "",
        f"Command: `{cmd}`. Machine: {machine()} ({cpu_name()}); cpu backend, its defaults. "
        f"{time.perf_counter() - t_start:.0f} s. Medians of {len(kept)} rounds (of "
        f"{len(rounds)}; other processes took at most "
        f"{max(r['others'] for r in kept):.2f} cores in those kept). One process: each round "
        f"runs {n} prompts at once ({rows_n} tokens: bench_serve's prompts) then {a.steps} steps "
        f"of a token for each of the {n}, the first prompt alone ({rows_1} tokens) then "
        f"{a.steps} steps of one token, then each projection of a layer on {n} tokens by itself. "
        "'layers' is `forward_hidden` (every projection, attention, norms), 'head' the "
        "screened head choosing each row's token.", "",
        "| pass | layers ms | head ms | total ms | multiply-add floor ms |",
        "|---|---|---|---|---|",
        f"| {n} prompts ({rows_n} tokens) | {ms * part('many', 'prompt_layers'):.1f} | "
        f"{ms * part('many', 'prompt_head'):.1f} | {ms * P['many']:.1f} | {ms * floor_p:.1f} |",
        f"| step of {n} tokens | {ms * part('many', 'step_layers'):.1f} | "
        f"{ms * part('many', 'step_head'):.1f} | {ms * S['many']:.1f} | {ms * floor_s:.1f} |",
        f"| one prompt ({rows_1} tokens) | {ms * part('one', 'prompt_layers'):.1f} | "
        f"{ms * part('one', 'prompt_head'):.1f} | {ms * P['one']:.1f} | |",
        f"| step of one token | {ms * part('one', 'step_layers'):.1f} | "
        f"{ms * part('one', 'step_head'):.1f} | {ms * S['one']:.1f} | |", "",
        f"A layer's projections on {n} tokens, each by itself (the batched step's kernel; the "
        "same matrix each time, so its rate with the weights in cache, at least the rate "
        "in a step):", "",
        "| projection | us | G multiply-adds/s |", "|---|---|---|"]
    for name, v in kern.items():
        lines.append(f"| {name} | {1e6 * v['s']:.0f} | {v['macs'] / v['s'] / 1e9:.0f} |")
    lines += [
        f"| all {L} layers | {ms * mm_step:.1f} ms | |", "",
        f"The floor: a pass's multiply-adds (each token's {L * layer_macs / 1e9:.3f} G in the "
        f"layers, {head_macs / 1e9:.3f} G for one int8 pass over the head) at the best rate "
        f"above, {rate / 1e9:.0f} G/s, and nothing else. From these parts, "
        f"`bench_serve.py --clients 1,{n} --tokens {K}` (HTTP, client threads and the "
        f"server's own work left out) would show {n} clients at **{est:.2f}x** one client's "
        f"aggregate (the median of the rounds' own parts; rounds {span(est_r, '.2f')}); with "
        f"the {n}-client passes at their floor, {best:.2f}x ({span(best_r, '.2f')}). 3x, the "
        f"prompts' pass as measured, needs a step of {n} tokens of {ms * need:.1f} ms "
        f"({span([ms * x for x in need_r], '.1f')})."]
    report = "\n".join(lines) + "\n"
    print(report)
    record = {"machine": machine(), "cpu": cpu_name(), "command": cmd,
              "date": datetime.date.today().isoformat(), "rounds": rounds,
              "kept": len(kept), "estimate": est_r, "estimate_at_floor": best_r,
              "step_needed_for_3x_s": need_r, "rate_macs_per_s": rate}
    if a.json:
        Path(a.json).write_text(json.dumps(record, indent=1) + "\n")
    if a.write:
        from benchdoc import DOC, replace_section

        replace_section(DOC, SECTION, report,
                        after="Serving concurrent clients, every GGUF container "
                              "(full-size synthetic 2B-4T)")
        DATA.parent.mkdir(parents=True, exist_ok=True)
        DATA.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {DOC} and {DATA}")


if __name__ == "__main__":
    main()
