"""A GPU section of docs/benchmarks.md, from the JSON that tools/gpu_check.sh wrote.

    python tools/gpu_report.py --run docs/data/gpu-h200/run-a --run docs/data/gpu-h200/run-b \
        --note docs/data/gpu-h200/note-ab.md --probe docs/data/gpu-h200/probe.json \
        --plot docs/gpu-h200-step.png --write
    python tools/gpu_report.py --section "The wgpu decode step on a real GPU, second session \
        (2B-4T)" --run docs/data/gpu-h200/run-c ... --run docs/data/gpu-h200/run-f \
        --note docs/data/gpu-h200/note-cf.md --plot docs/gpu-h200-step-2.png --write

Each ``--run`` folder holds ``after.json`` (``tools/bench_gpu.py`` output), where there was one
``before.json`` (the code to compare against, measured in the same run on the same machine)
and ``run.json`` ({"code": what "after" measured, "base": what "before" measured}). Writes the
section: decode and prompt rates of both codes and every tuning, the step's GPU time by part
(the last run with a before), the containers (the last run that measured them), the probe's
per-dispatch costs, the note, and a plot of the step's GPU time by part, before and after.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

SECTION = "The wgpu decode step on a real GPU (2B-4T)"
PARTS = ("qkv", "attn_split", "attn_merge", "o", "gate_up", "down", "lm_head", "other")
OLD_PARTS = {"norm": "norms (121)", "matvec:i2_s": "mat-vecs (180)", "attention": "attention",
             "rope": "rope", "lm_head": "lm_head", "argmax": "argmax", "embed": "other"}


def load(run: Path) -> tuple[dict | None, dict, dict]:
    """(before or None, after, run.json or {}) of a run folder."""
    before = run / "before.json"
    meta = run / "run.json"
    return (json.loads(before.read_text()) if before.exists() else None,
            json.loads((run / "after.json").read_text()),
            json.loads(meta.read_text()) if meta.exists() else {})


def rate_rows(name: str, before: dict | None, after: dict) -> list[str]:
    rows = []
    for label, res in (("before", before), ("after", after)):
        if res is None:
            continue
        for cfg, r in res["configs"].items():
            p = r["profile"]
            tune = "" if label == "before" else (
                f"i2_s={r['tuning'].get('i2_s')}" if cfg == "default" else
                f"i2_s={r['tuning'].get('i2_s')}, {cfg}" if not cfg.startswith("i2_s") else cfg)
            host = r["full"]["host_us_per_step"]
            one = p.get("pass_seconds")
            rounds = ", ".join(f"{x:.1f}" for x in r["full"]["rounds"])
            pre = r.get("prefill", {})
            rows.append(
                f"| {name} | {label}{f' ({tune})' if tune else ''} | **{r['full']['tok_s']:.1f}** "
                f"({rounds}) | {r.get('screened', {}).get('tok_s', float('nan')):.1f} | "
                f"{pre.get('tok_s', float('nan')):.0f} ({pre.get('tokens', '')}) | "
                f"{one * 1e3:.2f} | " if one else
                f"| {name} | {label} | **{r['full']['tok_s']:.1f}** ({rounds}) | "
                f"{r.get('screened', {}).get('tok_s', float('nan')):.1f} | "
                f"{pre.get('tok_s', float('nan')):.0f} ({pre.get('tokens', '')}) | "
                f"({p['gpu_seconds'] * 1e3:.2f}) | ")
            rows[-1] += (f"{host:,.0f} | " if host else "n/a | ") + (
                f"{res.get('dispatches_per_token') or p.get('dispatches') or 364} | "
                f"{r['host_cpu_busy_cores']:.2f} |")
    return rows


def part_ms(r: dict, old: bool | None = None) -> dict[str, float]:
    """GPU ms of each step part; ``old``: the op-by-op step, by kernel class (default: where
    the profile has no part labels)."""
    p = r["profile"]
    if old is None:
        old = not p.get("labels")
    src = p["kinds"] if old else (p.get("labels") or p["kinds"])
    out: dict[str, float] = {}
    for k, v in src.items():
        key = OLD_PARTS.get(k, "other") if old else (k if k in PARTS else "other")
        out[key] = out.get(key, 0.0) + v["ms"]
    return out


#: the profile labels of the full head (the screened step's are in its JSON: head_labels)
FULL_LABELS = ("lm_head", "argmax")


def screened_lines(name: str, r: dict) -> list[str]:
    """The screened head's greedy step on the device against the full head, from a
    configuration's ``profile_screened`` (tools/bench_gpu.py; none in older runs)."""
    ps = r.get("profile_screened")
    sc = r.get("screened") or {}
    if not ps or not sc.get("on_device"):
        return []
    full = sum(v["ms"] for k, v in r["profile"]["labels"].items() if k in FULL_LABELS)
    parts = {k: v for k, v in ps["labels"].items() if k in ps.get("head_labels", ())}
    dev = sum(v["ms"] for v in parts.values())
    hs = sc.get("head_stats") or {}
    return ["", f"The screened head's greedy step on the device (run {name}, default tuning; "
            f"the same per-dispatch timestamps): its kernels took {dev:.3f} ms against "
            f"{full:.3f} ms for the full head and its argmax ("
            + ", ".join(f"{k} {v['ms']:.3f}" for k, v in parts.items())
            + f"); decode {sc['tok_s']:.1f} tokens/s against {r['full']['tok_s']:.1f} with the "
            f"full head, {hs.get('candidates_per_step_mean', float('nan')):.1f} candidates a "
            f"step on average (at most {hs.get('candidates_per_step_max')}), fallbacks to the "
            f"full head: {hs.get('head_fallbacks') or 'none'}; step in one pass "
            f"{(ps.get('pass_seconds') or 0) * 1e3:.2f} ms against "
            f"{(r['profile'].get('pass_seconds') or 0) * 1e3:.2f} ms."]


def plot(before: dict, after: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b = part_ms(before["configs"]["default"])
    a = part_ms(after["configs"]["default"])
    fig, ax = plt.subplots(figsize=(9, 3.2))
    colors = plt.get_cmap("tab20").colors
    for row, parts in enumerate((b, a)):
        left = 0.0
        for i, (k, v) in enumerate(sorted(parts.items(), key=lambda kv: -kv[1])):
            ax.barh(row, v, left=left, color=colors[(i * 2 + row) % 20], edgecolor="white")
            if v > 0.25:
                ax.text(left + v / 2, row, f"{k}\n{v:.2f}", ha="center", va="center",
                        fontsize=7)
            left += v
        ax.text(left + 0.05, row, f"{left:.2f} ms", va="center", fontsize=8)
    ax.set_yticks([0, 1], [f"before\n{before.get('dispatches_per_token') or 364} dispatches",
                           f"after\n{after.get('dispatches_per_token')} dispatches"])
    ax.invert_yaxis()
    ax.set_xlabel("GPU ms of one 2B-4T decode step (each dispatch timed in its own pass)")
    ax.set_title(f"wgpu on an {after['info']['device']} (Vulkan): "
                 f"{before['configs']['default']['full']['tok_s']:.0f} -> "
                 f"{after['configs']['default']['full']['tok_s']:.0f} tokens/s", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, action="append", required=True)
    ap.add_argument("--section", default=SECTION, help="the section's title")
    ap.add_argument("--after", default="GPU backend on lavapipe (bytes read versus latency)",
                    help="a new section goes after this one")
    ap.add_argument("--first", default="A", help="letter of the first run")
    ap.add_argument("--note", type=Path, help="markdown: what the numbers say")
    ap.add_argument("--probe", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args()
    runs = [load(r) for r in a.run]
    names = [chr(ord(a.first) + i) for i in range(len(runs))]
    last = max(i for i, (b, _, _) in enumerate(runs) if b is not None)
    b0, a0, _ = runs[last]
    info = a0["info"]
    bases = sorted({m["base"] for _, _, m in runs if m.get("base")})
    lines = [f"## {a.section}", "",
             f"Command: `tools/gpu_check.sh` on a lent machine (`tools/gpu_env.sh` installs wgpu "
             f"and the Vulkan loader there; `.base/` holds the code to compare against: "
             f"{' and '.join(bases)}), then `python tools/gpu_report.py --write` from the JSON "
             f"kept in `docs/data/gpu-h200/`. Adapter: **{info['device']}** through "
             f"{info['backend_type']}, driver {info['description']}, "
             f"wgpu-py {a0.get('host', {}).get('wgpu', '0.32.0')}; host: "
             f"{a0.get('host', {}).get('cpu', 'Intel Xeon')}, "
             f"{a0.get('host', {}).get('cpus', 16)} CPUs, which run Python and wgpu's command "
             f"recording. Model: "
             f"`bitformat synth --preset 2b4t` (i2_s, its f16 head a Gaussian 128,256 x 2,560 "
             f"matrix). Each run measured the old and the new code one after the other on one "
             f"machine (where it has a before); every run is a fresh machine of this kind. "
             + "; ".join(f"run {n} measured commit {m.get('code', r.name)}"
                         for n, r, (_, _, m) in zip(names, a.run, runs, strict=True)) + ".", "",
             "Decode: median of 3 greedy generations of 128 tokens after a 16-token prompt "
             "(rounds in brackets), tokens/s counted after the first token; screened: the same "
             "with `--head screened`; prompt: a prompt of that many tokens, the faster of 2 "
             "rounds; GPU ms a step: one decode step at position 63 recorded in one compute "
             "pass between two timestamps (the op-by-op code: the sum of per-dispatch passes, "
             "in brackets); host us a step: recording and submitting one step; CPU busy: cores "
             "the host's processes used during the timed part (this one included). Tuning "
             "(`GpuDevice.tuning`): `i2_s=N` lanes of a subgroup per i2_s row, `passes=2` twice "
             "the rows per workgroup, a `part.` prefix (qkv, o, gate_up, down) for one part "
             "only, `pre=N` i2_s units a lane loads before the prologue, `split=N` positions a "
             "run of attention takes at least, `fold=0` a separate attn_merge dispatch, "
             "`wait_all=1` a greedy token read after the whole queue is idle (as wgpu-py's map "
             "waits), `tpw=N` prompt tokens a mat-mat workgroup takes (0: none), `skipq=1` no "
             "quantization at all (timing only: wrong values).", "",
             "| run | code | decode tok/s (rounds) | screened tok/s | prompt tok/s (tokens) | "
             "GPU ms a step | host us a step | dispatches | CPU busy |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, (b, af, _) in zip(names, runs, strict=True):
        lines += rate_rows(name, b, af)
    fb = b0["configs"]["default"]
    fa = a0["configs"]["default"]
    ratio = fa["full"]["tok_s"] / fb["full"]["tok_s"]
    same = all(r["full"]["same_tokens"] and r.get("screened", {}).get("same_as_full", True)
               for _, af, _ in runs for c, r in af["configs"].items() if "skipq" not in c)
    lines += ["", f"Run {names[last]}: {ratio:.2f}x the tokens/s of the old code in the same "
              f"run ({fa['full']['tok_s']:.1f} vs {fb['full']['tok_s']:.1f}); "
              + ("every round of every configuration (skipq aside) decoded the same tokens, "
                 "and the screened head the full head's tokens." if same else
                 "NOT every round or configuration decoded the same tokens."), ""]
    lines += ["The step by part (run " + names[last] + ", default tuning; GPU timestamps with "
              "each dispatch in its own compute pass, so each carries a pass boundary, about "
              "3 us here: the parts add up to more than the one-pass step). MB counts the "
              "weights and activations a part reads.", "",
              "| part | dispatches | GPU ms | MB | GB/s |", "|---|---|---|---|---|"]
    for k, v in sorted(fa["profile"]["labels"].items(), key=lambda kv: -kv[1]["ms"]):
        lines.append(f"| {k} | {v['dispatches']} | {v['ms']:.3f} | {v['mb']:.1f} | "
                     f"{v['gbps']:.0f} |")
    lines += screened_lines(names[last], fa)
    old = fb["profile"].get("labels") or fb["profile"]["kinds"]
    lines += ["", "The old step, same run: " + ", ".join(
        f"{k} {v['dispatches']} x = {v['ms']:.3f} ms" for k, v in sorted(
            old.items(), key=lambda kv: -kv[1]["ms"])) + "."]
    with_cont = [i for i, (_, af, _) in enumerate(runs) if af.get("containers")]
    if with_cont:
        ci = with_cont[-1]
        cont = runs[ci][1]["containers"]
        base = runs[ci][1]["configs"]["default"]
        lines += ["", "Every container (run " + names[ci] + ", converted from the i2_s file on "
                  "the machine; 2 rounds of 64 tokens; the step in one pass; i2_s from the "
                  "run's default configuration, 3 rounds of 128). MB a token is what the "
                  "backend uploaded and a step reads (rans decoded at load reads stfma rows; "
                  "q2_0, iq2_bn and iq1_bn are re-encoded at load as stfma or tq2_0 rows, so "
                  "they run as those do):", "",
                  "| container | decode tok/s | MB a token | GPU ms a step | ternary GB/s | "
                  "same tokens as i2_s |", "|---|---|---|---|---|---|"]
        for k, r in {"i2_s": base, **cont}.items():
            p = r["profile"]
            mv = sum(v["ms"] for kk, v in p["kinds"].items()
                     if kk.startswith(("matvec", "rans")))
            mb = sum(v["mb"] for kk, v in p["kinds"].items()
                     if kk.startswith(("matvec", "rans")))
            wb = r.get("weight_bytes_per_token") or p.get("weight_bytes")
            n = len(r["full"]["tokens"])
            agree = r["full"]["tokens"] == base["full"]["tokens"][:n]
            lines.append(f"| {k} | {r['full']['tok_s']:.1f} | {wb / 1e6:,.1f} | "
                         f"{(p.get('pass_seconds') or 0) * 1e3:.2f} | {mb / mv:.0f} | "
                         f"{'yes' if agree else 'no'} |")
    if a.probe:
        pr = json.loads(a.probe.read_text())
        fl, host = pr["dispatch_floor_us"], pr["host"]
        lines += ["", "The probe (`tools/gpu_probe.py`, the first call of the session) that "
                  "the design came from: a dispatch in one compute pass costs "
                  f"{fl['chain:132']:.1f} us of GPU time when it writes what the previous one "
                  f"wrote (wgpu puts a barrier between them) and {fl['separate:132']:.2f} us when "
                  "it does not; recording a dispatch costs the host "
                  f"{host['wgpu-py']['encode_us_per_dispatch']:.1f} us through wgpu-py's API "
                  f"and {host['raw']['encode_us_per_dispatch']:.1f} us calling wgpu-native's "
                  f"functions directly (wgpu-core's own validation); subgroups are "
                  f"{pr.get('subgroup', {}).get('size')} lanes; the old one-workgroup "
                  f"norm took {pr['kernels']['norm 2560']['us']:.0f} us (2,560 values) and "
                  f"{pr['kernels']['norm 6912']['us']:.0f} us (6,912) in a pass of 30."]
    if a.note:
        lines += ["", a.note.read_text().strip()]
    if a.plot:
        plot(b0, a0, a.plot)
        lines += ["", f"![GPU time of one decode step by part, before and after]"
                  f"({a.plot.name})"]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.write:
        from benchdoc import DOC, replace_section

        replace_section(DOC, a.section, text, after=a.after)


if __name__ == "__main__":
    main()
