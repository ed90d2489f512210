"""The screened LM head against the full one on the wgpu backend (2B-4T; lavapipe or a GPU).

    bitformat synth --preset 2b4t -o out/bench/2b4t.gguf
    flock /tmp/bitformat-cpu.lock python tools/bench_wgpu_head.py --write

One process, one loaded model: the full and the screened head take turns. Reported:

* the head alone, on the hidden state of a real decode step (median of ``--head-repeat``
  interleaved runs): the full head (``lm_head.wgsl`` over every row + the device argmax, 4 bytes
  back) against the screened head's :meth:`Head.select` (hidden state back, host split, int8
  screen, 8 bytes per row back, float64 bounds, candidates, ``lm_head_rows.wgsl``), with the
  screened head's parts timed separately;
* decode tokens/s of greedy generations (``--rounds`` rounds of full then screened, the token
  ids asserted identical, and for seeded sampling with temperature 0.8 and top-k 40);
* candidates per step, and the CPU time other processes took during the timed part
  (/proc/stat). Run it under the shared CPU lock: it does not take the lock itself.

The section is named after the adapter: llvmpipe (lavapipe) writes "... (2B-4T, lavapipe)", any
other adapter "... (2B-4T, <adapter>)", next to the lavapipe one. On an adapter that is not
llvmpipe the section also gives the adapter's driver, the host's CPUs and, where the adapter has
timestamp queries, the kernels' GPU times and read rates (full head, screen, one whole decode
step). ``--require-gpu`` refuses a CPU adapter (listing the adapters wgpu sees).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

SECTION = "Screened LM head on the wgpu backend (2B-4T, lavapipe)"
GPU_SECTION = "Screened LM head on the wgpu backend (2B-4T, {device})"
NOTE = ("On llvmpipe the screen is bound by arithmetic, not by bytes: it reads half the f16 "
        "head's bytes but at a lower rate (two `dot4I8Packed` per code word), so what the head "
        "gains depends on the CPU (1.5x on an earlier run's 2-core Intel Xeon), and the whole "
        "step, dominated by the ternary mat-vecs, gains less. On llvmpipe the device step and "
        "the host path cost about the same: the screen dominates both. Two "
        "variants of the screen kernel were timed alone on 2B-4T-sized random codes (one run, "
        "same machine): codes interleaved 64 rows per word column, for contiguous loads across "
        "invocations, took 107 ms, and one multiply per code byte against `254 q1 + q2` "
        "unpacked to int32 (sums folded every 256 values to stay exact) took 131 ms, against "
        "96 ms for the kernel kept. On a GPU the screen streams memory, where half the bytes "
        "is the point.")
PROMPT = "The history of the printing press begins in"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="out/bench/2b4t.gguf")
    ap.add_argument("--tokens", type=int, default=16, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--head-repeat", type=int, default=7)
    ap.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    ap.add_argument("--out", type=Path, help="also write the section (markdown) to this file")
    ap.add_argument("--json", type=Path, help="write the raw numbers to this file")
    ap.add_argument("--require-gpu", action="store_true",
                    help="fail (listing the adapters) if wgpu's adapter is a CPU one")
    a = ap.parse_args()
    if a.require_gpu:
        require_gpu_adapter()

    from bench_head import cpu_jiffies

    import bitformat
    from bitformat.runtime import head as EH
    from bitformat.runtime.head import Head
    from bitformat.runtime.models.base import Segment
    from bitformat.runtime.sampling import Sampler

    t0 = time.perf_counter()
    m = bitformat.load(a.model, backend="wgpu", head="screened")
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    m.warmup()  # pipelines, and the screen's int8 copy (quantized and uploaded here)
    warm_s = time.perf_counter() - t0
    net, be = m.net, m.backend
    dev = be.dev
    heads = {"full": Head(be, "full"), "screened": net.head}
    prompt = m.encode(PROMPT) if m.tokenizer is not None else list(range(1, 10))
    print(f"{dev.name}: load {load_s:.1f} s, warmup (incl. screen build) {warm_s:.1f} s",
          flush=True)
    lavapipe = is_lavapipe(dev)
    if not lavapipe:
        print(f"adapter info: {dev.info}; lanes {dev.lanes}, x {dev.x_space}, "
              f"timestamps {dev.timestamps}", flush=True)

    b0, s0 = cpu_jiffies()
    w0 = time.perf_counter()
    # -- the head alone, on one real hidden state ---------------------------------------------
    cache = net.new_cache(len(prompt) + 1)
    x = net.forward_hidden([Segment(prompt, cache)])
    screened = heads["screened"]
    t, parts = screened.tables, {"full": [], "screened": [], "screen": [], "bounds": [],
                                 "rows": [], "device": []}
    items = net.prog.head + [net.prog.argmax]
    for _ in range(a.head_repeat):
        t1 = time.perf_counter()
        dev.run(items, [(net.result, 0, net.result_stage, 0, 8)])
        want = int(np.frombuffer(dev.map_read(net.result_stage, 4), np.uint32)[0])
        parts["full"].append(time.perf_counter() - t1)
        t1 = time.perf_counter()
        got = screened.select(x, [Sampler()])[0]
        parts["screened"].append(time.perf_counter() - t1)
        assert got == want, (got, want)
        # the screened head's greedy step on the device (WgpuBitNet.screen: what greedy
        # decoding runs), on the same hidden state (still in the device's x buffer)
        t1 = time.perf_counter()
        dev.run([*net.screen.items, net.screen.argmax],
                [(net.result, 0, net.result_stage, 0, 8)])
        got = int(np.frombuffer(dev.map_read(net.result_stage, 4), np.uint32)[0])
        parts["device"].append(time.perf_counter() - t1)
        assert got == want, (got, want)
        # the screened head's parts, once more on their own
        t1 = time.perf_counter()
        xq, par = t.prepare(x)
        sc = be._screen()
        V = t.scale.size
        dev.write(sc.xq, np.ascontiguousarray(xq[0]).reshape(-1).view("<u4"))
        dev.run(sc.screen)
        s = np.frombuffer(dev.read(sc.sums, 8 * V), "<i4").reshape(V, 2)
        t2 = time.perf_counter()
        lo, hi = EH.bounds_from_sums(t, s[None, :, 0], s[None, :, 1], par)
        ids = screened._greedy_candidates(lo, hi)
        t3 = time.perf_counter()
        be.head_rows(x, ids)
        t4 = time.perf_counter()
        parts["screen"].append(t2 - t1)
        parts["bounds"].append(t3 - t2)
        parts["rows"].append(t4 - t3)
    med = {k: statistics.median(v) * 1e3 for k, v in parts.items()}
    print({k: round(v, 1) for k, v in med.items()}, flush=True)

    # -- whole decode steps ----------------------------------------------------------------------
    def once(mode: str, **kw) -> dict:
        net.head = heads[mode]
        r = m.generate(prompt, a.tokens + 1, stop_ids=(), **kw)
        return {"tps": r.stats.generation_tps, "tokens": r.tokens, "stats": m.head_stats(),
                "candidates": list(heads[mode].stats.candidates)}

    runs: dict[str, list[dict]] = {"full": [], "screened": []}
    for i in range(a.rounds):
        for mode in ("full", "screened"):
            runs[mode].append(once(mode))
            print(f"round {i} {mode}: {runs[mode][-1]['tps']:.3f} tok/s", flush=True)
    ids = {mode: [r["tokens"] for r in rs] for mode, rs in runs.items()}
    assert all(t == ids["full"][0] for t in ids["full"] + ids["screened"]), "ids differ"
    sampled = {mode: once(mode, temperature=0.8, top_k=40, seed=1) for mode in runs}
    assert sampled["full"]["tokens"] == sampled["screened"]["tokens"], "sampled ids differ"
    b1, s1 = cpu_jiffies()
    wall = time.perf_counter() - w0
    other = max(0.0, (b1 - b0 - (s1 - s0)) / os.sysconf("SC_CLK_TCK") / (wall * os.cpu_count()))
    net.head = screened
    kernels = None if lavapipe else profile_kernels(net, be, len(prompt) + a.tokens + 1)
    if kernels:
        print(kernels, flush=True)

    greedy_c = np.concatenate([r["candidates"] for r in runs["screened"]])
    sampled_c = np.asarray(sampled["screened"]["candidates"])
    name = model_name(m.container_model, a.model)
    if lavapipe:
        title = SECTION
        text = render(a, dev.name, med, runs, greedy_c, sampled_c, other, heads, t,
                      len(prompt), name)
    else:
        title = GPU_SECTION.format(device=dev.info.get("device", "?"))
        text = render_gpu(a, title, dev, med, runs, greedy_c, sampled_c, other, heads, t,
                          len(prompt), name, kernels)
    print(text)
    if a.out:
        a.out.write_text(text.rstrip() + "\n")
        print(f"wrote {a.out}")
    if a.json:
        import json

        a.json.write_text(json.dumps({
            "device": dev.info, "lanes": dev.lanes, "x_space": dev.x_space,
            "host_cpus": os.cpu_count(), "load_s": load_s, "warmup_s": warm_s,
            "head_ms": med, "head_ms_runs": {k: [x * 1e3 for x in v] for k, v in parts.items()},
            "tps": {k: [r["tps"] for r in rs] for k, rs in runs.items()},
            "sampled_tps": {k: r["tps"] for k, r in sampled.items()},
            "stats": {k: rs[-1]["stats"] for k, rs in runs.items()},
            "candidates_greedy": greedy_c.tolist(), "candidates_sampled": sampled_c.tolist(),
            "other_cpu": other, "kernels": kernels}, indent=1, default=str))
        print(f"wrote {a.json}")
    if a.write:
        from benchdoc import DOC, replace_section

        replace_section(DOC, title, text, after=None if lavapipe else SECTION)
        print(f"wrote {DOC}")


def is_lavapipe(dev) -> bool:
    return "llvmpipe" in str(dev.info.get("device", "")).lower()


def require_gpu_adapter() -> None:
    """Exit with the list of adapters if wgpu's preferred adapter is a CPU one (or none)."""
    import wgpu

    from bitformat.runtime.wgpu.device import request_adapter

    ad = request_adapter()
    info = dict(ad.info) if ad is not None else {}
    if ad is None or info.get("adapter_type") == "CPU":
        print(f"--require-gpu: wgpu's adapter is {info or 'none'}; adapters it sees:",
              file=sys.stderr)
        for x in wgpu.gpu.enumerate_adapters_sync():
            print(f"  {dict(x.info)}", file=sys.stderr)
        sys.exit(2)
    print(f"adapter: {info}", flush=True)


def profile_kernels(net, be, length: int, repeats: int = 7) -> dict | None:
    """GPU times (timestamp queries, median of ``repeats``) of the full head, the screen and one
    whole decode step (``net.profile``, full head), with the bytes each reads; None without
    timestamp queries. Run after the timed part: ``net.profile`` overwrites a cache position."""
    from bitformat.runtime.wgpu.device import Dispatch

    dev = be.dev
    if not dev.timestamps:
        return None
    head = [d for d in net.prog.head if isinstance(d, Dispatch)]
    sc = be._screen()
    out = {}
    groups = [("lm_head", head), ("argmax", [net.prog.argmax]), ("screen", list(sc.screen))]
    if net.screen is not None:  # the greedy step on the device: its kernels after the norm
        groups.append(("device_step", [*net.screen.items, net.screen.argmax]))
    for name, items in groups:
        secs = np.median(np.array([dev.profile(items)[0] for _ in range(repeats)]), axis=0)
        nbytes = sum(d.nbytes for d in items)
        out[name] = {"dispatches": len(items), "ms": float(secs.sum()) * 1e3, "bytes": nbytes,
                     "gbps": nbytes / float(secs.sum()) / 1e9 if secs.sum() else 0.0,
                     "per_dispatch_ms": [float(x) * 1e3 for x in secs]}
    step = net.profile(length=min(length, net.max_len), repeats=repeats)
    out["step"] = step
    return out


def model_name(model, path: str) -> str:
    v = model.metadata.get("general.name")
    return str(getattr(v, "value", v) or Path(path).name)


def synth_note(name: str) -> str:
    """What the model is, for the section's first paragraph."""
    return (f"`{name}`: `bitformat synth --preset 2b4t`, i2_s; its f16 head is a random "
            "Gaussian 128,256 x 2,560 matrix, without a trained head's outlier columns"
            if "synth" in name else f"`{name}`, i2_s")


def head_table(runs: dict, heads: dict, digits: int) -> list[str]:
    """The markdown table of decode tok/s and bytes per token of both heads."""
    full_b = heads["full"].full_bytes
    rows = ["| head | decode tok/s (median; rounds) | head MB/token | of f16 head | "
            "MB/token (whole step) |", "|---|---|---|---|---|"]
    for mode in ("full", "screened"):
        rs = runs[mode]
        st = rs[-1]["stats"]
        tps = [r["tps"] for r in rs]
        rows.append(f"| {mode} | {statistics.median(tps):.{digits}f} "
                    f"({', '.join(f'{v:.{digits}f}' for v in tps)}) | "
                    f"{st['head_bytes_per_step'] / 1e6:.1f} | "
                    f"{st['head_bytes_per_step'] / full_b:.1%} | "
                    f"{st['bytes_read_per_token'] / 1e6:.1f} |")
    return rows


def decode_lines(runs, speed, greedy_c, sampled_c, tables) -> list[str]:
    """The paragraphs after the table: the decode ratio, the ids, the candidates."""
    from bench_head import dist

    return [
        f"Whole decode, screened / full: {speed:.2f}x. Token ids identical in every round "
        f"({len(runs['full'][0]['tokens'])} greedy tokens) and for seeded "
        "sampling (temperature 0.8, top-k 40, seed 1).", "",
        f"Candidates rescored per step, greedy: {dist(greedy_c)}; temperature 0.8 + top-k 40: "
        f"{dist(sampled_c)}. The screen's table (int8 codes, scales, bound terms) is "
        f"{tables.nbytes / 1e6:.1f} MB; the head bytes above do not count the "
        f"{8 * tables.scale.size / 1e6:.1f} MB a step of integer sums read back (sampling, "
        "on the host path) or of float32 bounds written and read on the device (greedy)."]


def render(a, device, med, runs, greedy_c, sampled_c, other, heads, tables, n_prompt,
           name) -> str:
    from benchdoc import host_cpu

    model_note = synth_note(name)
    rows = head_table(runs, heads, 3)
    cmd = (f"flock /tmp/bitformat-cpu.lock python tools/bench_wgpu_head.py --model {a.model} "
           f"--tokens {a.tokens} --rounds {a.rounds} --head-repeat {a.head_repeat} --write")
    speed = (statistics.median(r["tps"] for r in runs["screened"])
             / statistics.median(r["tps"] for r in runs["full"]))
    return "\n".join([
        f"## {SECTION}", "",
        f"Command: `{cmd}` ({model_note}). **No GPU:** the adapter is {device}, Mesa's "
        "Vulkan driver that compiles the WGSL kernels with LLVM and runs them on the CPU, here "
        f"{host_cpu()} with {os.cpu_count()} cores shared with other sessions; its \"device "
        "memory\" is host RAM. Read the times as what llvmpipe's generated code does, not as "
        "GPU figures. "
        f"Other processes took {other:.0%} of the machine's CPU during the timed part.", "",
        f"The head alone, on the final hidden state of a {n_prompt}-token prompt (median of "
        f"{a.head_repeat} interleaved runs, host wall time): full head (`lm_head.wgsl` over "
        f"every row, then the device argmax) **{med['full']:.1f} ms**; screened head "
        f"(`Head.select`: hidden state back, int8 screen, bounds, candidates, rescoring) "
        f"**{med['screened']:.1f} ms** ({med['full'] / med['screened']:.2f}x), of which the "
        f"screen with its 8 bytes per row read back {med['screen']:.1f} ms, the float64 "
        f"bounds and candidates on the host {med['bounds']:.1f} ms, the rescoring of the "
        f"candidates on the device {med['rows']:.1f} ms. {device_step(med, 1)}", "",
        *rows, "",
        *decode_lines(runs, speed, greedy_c, sampled_c, tables), "",
        NOTE,
    ])


def device_step(med: dict, digits: int) -> str:
    """The sentence on the screened head's greedy step on the device, timed alone."""
    if not med.get("device"):
        return ""
    return (f"The screened head's greedy step on the device (what greedy decoding runs: the "
            f"int8 split, every row's float32 bounds, the candidates, their logits and the "
            f"argmax in one submission, 4 bytes back): **{med['device']:.{digits}f} ms** "
            f"({med['full'] / med['device']:.2f}x the full head's speed).")


def render_gpu(a, title, dev, med, runs, greedy_c, sampled_c, other, heads, tables, n_prompt,
               name, kernels) -> str:
    """The section for an adapter other than llvmpipe: its driver, the host, kernel times."""
    import wgpu
    from benchdoc import host_cpu

    info = dev.info
    model_note = synth_note(name)
    native = getattr(getattr(wgpu, "backends", None), "wgpu_native", None)
    versions = f"wgpu-py {wgpu.__version__}" + (
        f" with wgpu-native {native.__version__}" if getattr(native, "__version__", None) else "")
    rows = head_table(runs, heads, 1)
    cmd = " ".join(["python", "tools/bench_wgpu_head.py", *sys.argv[1:]])
    speed = (statistics.median(r["tps"] for r in runs["screened"])
             / statistics.median(r["tps"] for r in runs["full"]))
    out = [
        f"## {title}", "",
        f"Command: `{cmd}` ({model_note}). Adapter: **{info.get('device', '?')}** through "
        f"{info.get('backend_type', '?')}, driver {info.get('description') or '?'} "
        f"({info.get('vendor') or '?'}, adapter type {info.get('adapter_type', '?')}), "
        f"{versions}; the kernels run {dev.lanes} invocations per row, activations in "
        f"{dev.x_space} buffers. Host: {host_cpu()}, {os.cpu_count()} CPUs, which run Python, "
        "the screened head's host part (int8 split, float64 bounds, candidates) and wgpu's "
        "command encoding. Every time below except the kernel table is host wall time: a "
        "decode step or a head call includes wgpu's encoding, submission, the wait for the "
        f"queue and the readback. Other processes took {other:.0%} of the host's CPU during "
        "the timed part.", "",
        f"The head alone, on the final hidden state of a {n_prompt}-token prompt (median of "
        f"{a.head_repeat} interleaved runs, host wall time): full head (`lm_head.wgsl` over "
        f"every row, then the device argmax, 4 bytes back) **{med['full']:.2f} ms**; screened "
        f"head (`Head.select`: hidden state back, int8 screen, 8 bytes per row back, bounds, "
        f"candidates, rescoring) **{med['screened']:.2f} ms** "
        f"({med['full'] / med['screened']:.2f}x), of which the screen with its read-back "
        f"{med['screen']:.2f} ms, the float64 bounds and candidates on the host "
        f"{med['bounds']:.2f} ms, the rescoring of the candidates {med['rows']:.2f} ms. "
        f"{device_step(med, 2)}", "",
        *rows, "",
        *decode_lines(runs, speed, greedy_c, sampled_c, tables),
    ]
    if kernels:
        st = kernels["step"]
        krows = ["| kernels | dispatches | GPU ms | MB read | GB/s |", "|---|---|---|---|---|"]
        for key, label in (("lm_head", "full head, `lm_head.wgsl`"),
                           ("argmax", "device argmax, `argmax.wgsl`"),
                           ("screen", "screen, `screen.wgsl`"),
                           ("device_step", "screened head's device step (split, bounds, "
                            "candidates, their logits, argmax)")):
            if key not in kernels:
                continue
            k = kernels[key]
            krows.append(f"| {label} | {k['dispatches']} | {k['ms']:.3f} | "
                         f"{k['bytes'] / 1e6:.1f} | {k['gbps']:.0f} |")
        for kind, k in sorted(st["kinds"].items(), key=lambda kv: -kv[1]["seconds"]):
            krows.append(f"| step: {kind} | {k['dispatches']} | {k['seconds'] * 1e3:.3f} | "
                         f"{k['bytes'] / 1e6:.1f} | {k['gbps']:.0f} |")
        step_b = sum(k["bytes"] for k in st["kinds"].values())
        krows.append(f"| step: all | {sum(k['dispatches'] for k in st['kinds'].values())} | "
                     f"{st['gpu_seconds'] * 1e3:.3f} | {step_b / 1e6:.1f} | "
                     f"{step_b / st['gpu_seconds'] / 1e9 if st['gpu_seconds'] else 0:.0f} |")
        out += ["", f"Kernel times ({st['clock']}, median of 7 profiled runs, each dispatch in "
                "its own compute pass, so a pass boundary per dispatch is included): the full "
                "head and its argmax, the screen alone, and one whole decode step with the full "
                f"head at position {st['length'] - 1} (`WgpuBitNet.profile`: its kernels add up "
                f"to {st['gpu_seconds'] * 1e3:.2f} ms; the same step run normally, one submit "
                f"and the argmax read back, took {st['token_seconds'] * 1e3:.2f} ms host wall "
                "time). "
                "MB read counts the weights and activations each kernel reads, as the backend "
                "records them.", "", *krows, "", gpu_summary(med, kernels)]
    return "\n".join(out)


def gpu_summary(med: dict, kernels: dict) -> str:
    """What the kernel table says about the two heads and the step (from the JSON's numbers)."""
    sc, lm, am, st = (kernels["screen"], kernels["lm_head"], kernels["argmax"],
                      kernels["step"])
    full_k = lm["ms"] + am["ms"]
    top, k = max(st["kinds"].items(), key=lambda kv: kv[1]["seconds"])
    return (
        f"The screen kernel reads its {sc['bytes'] / 1e6:.0f} MB at {sc['gbps']:.0f} GB/s and "
        f"the f16 head kernel its {lm['bytes'] / 1e6:.0f} MB at {lm['gbps']:.0f} GB/s: "
        f"{sc['ms']:.3f} ms against {lm['ms']:.3f} ms ({lm['ms'] / sc['ms']:.1f}x), plus "
        f"{am['ms']:.3f} ms for the full head's one-workgroup argmax. But the screen kernel "
        f"is {sc['ms'] / med['screened']:.0%} of the screened head's "
        f"{med['screened']:.2f} ms host wall time (the hidden state back, the int8 split, "
        "the integer sums back, the float64 bounds and candidates on the host, a second "
        f"submit for the rescoring), while the full head's kernels are "
        f"{full_k / med['full']:.0%} of its {med['full']:.2f} ms (one submit, 4 bytes back). "
        f"The head kernels are {(lm['ms'] + am['ms']) / (st['gpu_seconds'] * 1e3):.0%} of "
        f"the decode step's {st['gpu_seconds'] * 1e3:.2f} ms of kernels; the largest class "
        f"is {top}: {k['dispatches']} dispatches, {k['seconds'] * 1e3:.2f} ms "
        f"({k['seconds'] / k['dispatches'] * 1e6:.0f} us each).")


if __name__ == "__main__":
    main()
