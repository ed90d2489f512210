"""Decode, prefill and kernel times of the wgpu backend on one model (a real GPU or lavapipe).

    python tools/bench_gpu.py MODEL.gguf --label new --json out.json [--tuning "i2_s=16;passes=2"]
    python tools/bench_gpu.py --check-tiny       # every family and container against numpy

One process, one loaded model (``head="full"``, no validation: the bytes were written by
``bitformat synth``). Per configuration: ``--rounds`` greedy generations of ``--tokens``
tokens after a 16-token prompt (decode tok/s from the generation stats: the first token comes
from the prompt and is not counted), the same with the screened head, a ``--prefill``-token
prompt (prompt tok/s), the host time per recorded step where the network counts it, and one
profiled step (``net.profile``: GPU-timestamp times per kernel class, each dispatch in its own
pass; ``pass_seconds``: the whole step in one pass). ``--tuning`` rebuilds the network with
other lanes-per-row / rows-per-workgroup settings (``GpuDevice.tuning``) on the same upload.
It works with the code of earlier commits too (``PYTHONPATH=old-tree``): what an older
network lacks is reported as null. The CPU time other processes took during the timed parts
comes from /proc/stat.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if "bitformat" not in sys.modules and not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPT = [(17 * i + 5) % 1000 + 10 for i in range(16)]


def cpu_busy() -> tuple[int, int]:
    """(all jiffies, idle jiffies) from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v), v[3] + v[4]


def rounds(m, n_tokens: int, n_rounds: int, head: str) -> dict:
    from bitformat.runtime.head import Head

    m.net.head = Head(m.backend, head)
    tps, toks, host = [], [], []
    for _ in range(n_rounds):
        if hasattr(m.net, "host_seconds"):
            m.net.host_seconds, m.net.host_steps = 0.0, 0
        r = m.generate(PROMPT, n_tokens, stop_ids=[])
        tps.append(r.stats.generation_tps)
        toks.append(r.tokens)
        if getattr(m.net, "host_steps", 0):
            host.append(m.net.host_seconds / m.net.host_steps * 1e6)
    st = m.net.head.stats.as_dict()  # candidates and fallbacks of the screened head
    return {"tok_s": statistics.median(tps), "rounds": tps,
            "same_tokens": all(t == toks[0] for t in toks), "tokens": toks[0],
            "host_us_per_step": statistics.median(host) if host else None,
            "on_device": bool(getattr(m.net, "screen", None) is not None
                              and head == "screened"),
            "head_stats": {k: st.get(k) for k in ("candidates_per_step_mean",
                                                  "candidates_per_step_max", "head_fallbacks")}}


def measure(m, a) -> dict:
    out = {}
    b0, i0 = cpu_busy()
    w0 = time.perf_counter()
    out["full"] = rounds(m, a.tokens, a.rounds, "full")
    if not a.no_screened:
        out["screened"] = rounds(m, a.tokens, a.rounds, "screened")
        out["screened"]["same_as_full"] = out["screened"]["tokens"] == out["full"]["tokens"]
    from bitformat.runtime.head import Head

    m.net.head = Head(m.backend, "full")
    if a.prefill:
        ids = [(7 * i + 3) % 1000 + 10 for i in range(a.prefill)]
        pt = []
        for _ in range(2):
            r = m.generate(ids, 2, stop_ids=[])
            pt.append(r.stats.prompt_tps)
        out["prefill"] = {"tokens": a.prefill, "tok_s": max(pt), "rounds": pt}
    b1, i1 = cpu_busy()
    wall = time.perf_counter() - w0
    out["host_cpu_busy_cores"] = ((b1 - b0) - (i1 - i0)) / (os.sysconf("SC_CLK_TCK") * wall)
    out["profile"] = profiled(m, a.length)
    if not a.no_screened:  # the step with the screened head's greedy choice on the device
        m.net.head = Head(m.backend, "screened")
        out["profile_screened"] = profiled(m, a.length)
        if getattr(m.net, "screen", None) is not None:  # which labels are the head's
            out["profile_screened"]["head_labels"] = m.net.screen.labels
        m.net.head = Head(m.backend, "full")
    return out


def profiled(m, length: int) -> dict:
    """One profiled decode step at ``length`` (``WgpuBitNet.profile``) as JSON."""
    prof = m.net.profile(length=length, repeats=5)
    out = {k: prof.get(k) for k in ("clock", "length", "gpu_seconds", "pass_seconds",
                                    "token_seconds", "dispatches", "weight_bytes")}
    out["kinds"] = {k: {"dispatches": v["dispatches"], "ms": v["seconds"] * 1e3,
                        "mb": v["bytes"] / 1e6, "gbps": v["gbps"]}
                    for k, v in prof["kinds"].items()}
    out["labels"] = {k: {"dispatches": v["dispatches"], "ms": v["seconds"] * 1e3,
                         "mb": v["bytes"] / 1e6, "gbps": v["gbps"]}
                     for k, v in prof.get("labels", {}).items()}
    return out


def host_info() -> dict:
    """The host's CPU model and count, and wgpu-py's version (the report names them)."""
    import wgpu

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from benchdoc import host_cpu

    return {"cpu": host_cpu(), "cpus": os.cpu_count(), "wgpu": wgpu.__version__}


def check_tiny(a) -> int:
    """Every family (tiny presets) and container: GPU greedy tokens == numpy's."""
    import tempfile

    from bitformat.container import convert
    from bitformat.formats import FORMAT_IDS
    from bitformat.runtime import generate_step, load
    from bitformat.synth import synth

    bad = 0
    with tempfile.TemporaryDirectory() as d:
        for preset in ("tiny", "tiny-1bitllm", "tiny-llama", "tiny-qwen3"):
            src = Path(d) / f"{preset}.gguf"
            synth(preset, src, seed=0, embedding="f16") if preset == "tiny" else synth(
                preset, src, seed=0)
            for fid in FORMAT_IDS if preset == "tiny" else ["i2_s"]:
                p = src if fid == "i2_s" else Path(d) / f"{preset}.{fid}.gguf"
                if fid != "i2_s":
                    convert(src, p, fid)
                with load(p, backend="numpy") as ref, load(p, backend="wgpu", head="full") as m:
                    want = list(generate_step(ref.net, PROMPT[:8], max_new_tokens=16))
                    got = m.generate(PROMPT[:8], 16, stop_ids=[]).tokens
                    net = type(m.net).__name__
                ok = got == want
                bad += not ok
                print(f"check {preset:13s} {fid:12s} {net:12s} {'ok' if ok else 'DIFFERENT'}",
                      flush=True)
    return bad


def containers(a) -> dict:
    """Decode speed and one profiled step of MODEL converted into each container."""
    import bitformat
    from bitformat.container import convert

    out = {}
    sub = argparse.Namespace(**{**vars(a), "rounds": 2, "tokens": min(a.tokens, 64),
                                "prefill": 0, "no_screened": True})
    for key in a.containers.split(","):
        fid, _, decode = key.partition(":")
        path = Path(f"/tmp/bench-gpu.{fid}.gguf")
        t0 = time.perf_counter()
        if not path.exists():
            convert(a.model, path, fid)
        conv = time.perf_counter() - t0
        t0 = time.perf_counter()
        with bitformat.load(path, backend="wgpu", head="full", validate=False,
                            decode=decode or "load") as m:
            load_s = time.perf_counter() - t0
            m.warmup()
            r = measure(m, sub)
            r.update(convert_s=conv, load_s=load_s, file_bytes=path.stat().st_size,
                     weight_bytes_per_token=m.weight_bytes_per_token)
        out[key] = r
        p = r["profile"]
        mv = sum(v["ms"] for k, v in p["kinds"].items() if k.startswith(("matvec", "rans")))
        mb = sum(v["mb"] for k, v in p["kinds"].items() if k.startswith(("matvec", "rans")))
        print(f"[container {key}] {r['full']['tok_s']:.1f} tok/s, weights "
              f"{r['weight_bytes_per_token'] / 1e6:.1f} MB/token, step one pass "
              f"{(p.get('pass_seconds') or 0) * 1e3:.3f} ms, ternary {mv:.3f} ms "
              f"({mb / mv if mv else 0:.0f} GB/s), tokens {r['full']['tokens'][:8]}, convert "
              f"{conv:.1f} s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--label", default="")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--length", type=int, default=64, help="position of the profiled step")
    ap.add_argument("--tuning", default="", help="';'-separated GpuDevice.tuning updates")
    ap.add_argument("--no-screened", action="store_true")
    ap.add_argument("--check-tiny", action="store_true")
    ap.add_argument("--containers", default="",
                    help="comma-separated containers (rans:fused for the fused rANS kernels) to "
                         "convert MODEL into and time too (2 rounds, no screened head/prefill)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.check_tiny:
        sys.exit(1 if check_tiny(a) else 0)
    import bitformat

    t0 = time.perf_counter()
    m = bitformat.load(a.model, backend="wgpu", head="full", validate=False)
    load_s = time.perf_counter() - t0
    dev = m.backend.dev
    t0 = time.perf_counter()
    m.warmup()
    res = {"label": a.label, "model": a.model, "device": dev.name, "info": dev.info,
           "net": type(m.net).__name__, "load_s": load_s, "warmup_s": time.perf_counter() - t0,
           "subgroup_size": getattr(dev, "subgroup_size", None),
           "dispatches_per_token": getattr(m.net, "dispatches_per_token", None),
           "host": host_info(), "configs": {}}
    print(json.dumps({k: v for k, v in res.items() if k != "configs"}), flush=True)
    configs = [""] + [c for c in a.tuning.split(";") if c] if a.tuning else [""]
    net0 = m.net
    base_tuning = dict(getattr(dev, "tuning", {}))
    for cfg in configs:
        if cfg:
            from bitformat.runtime.wgpu.network import WgpuBitNet

            dev.tuning = dict(base_tuning)
            for part in cfg.split(","):
                k, _, v = part.partition("=")
                dev.tuning[k.strip()] = int(v)
            # as load() built it: its KV cache type and context (an f32 cache by default
            # here would time other bytes and give other tokens than the default's f16)
            m.net = WgpuBitNet(m.args, m.backend, head="full", kv_type=net0.kv_type,
                               context=net0.max_len)
            m.net.forward_argmax(PROMPT, m.net.new_cache(len(PROMPT) + 1))  # pipelines built
        r = measure(m, a)
        r["tuning"] = dict(getattr(dev, "tuning", {}))
        res["configs"][cfg or "default"] = r
        p = r["profile"]
        kinds = ", ".join(f"{k} {v['dispatches']}x {v['ms']:.3f} ms"
                          for k, v in sorted((p.get("labels") or p["kinds"]).items(),
                                             key=lambda kv: -kv[1]["ms"]))
        print(f"[{a.label} {cfg or 'default'}] decode full {r['full']['tok_s']:.1f} tok/s "
              f"{r['full']['rounds']}, screened "
              f"{r.get('screened', {}).get('tok_s', float('nan')):.1f}, prefill "
              f"{r.get('prefill', {}).get('tok_s', float('nan')):.1f} tok/s, host "
              f"{r['full']['host_us_per_step']} us/step; step GPU {p['gpu_seconds'] * 1e3:.3f} "
              f"ms (per-dispatch passes), one pass {p.get('pass_seconds')}, wall "
              f"{p['token_seconds'] * 1e3:.3f} ms; {kinds}; other CPU "
              f"{r['host_cpu_busy_cores']:.2f} cores", flush=True)
    res["containers"] = {}
    if a.containers:
        m.close()
        res["containers"] = containers(a)
    if a.json:
        a.json.write_text(json.dumps(res, indent=1, default=float))


if __name__ == "__main__":
    main()
