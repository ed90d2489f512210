"""Memory of ``bitformat serve`` holding N long requests: the model plus their KV caches, and
nothing else that grows.

    python tools/bench_serve_memory.py MODEL [--clients 8] [--hold 1024] [--tokens 16] [--write]

Starts ``bitformat serve MODEL --backend cpu --max-batch N`` on a free loopback port and
reads the server's resident memory once it is up (``VmRSS``: the model's pages its warm-up
touched, the kernels, the interpreter). Then N clients send one ``/v1/completions`` request
each at the same moment, a prompt of HOLD - TOKENS token ids and ``max_tokens`` TOKENS
(greedy, ``ignore_eos``), so every request holds HOLD positions of KV cache at its end. The
server runs one 64-token prompt chunk a step beside the decode rows, so the prompts finish
one after another: TOKENS (default 18 x N) is long enough that the first request still
decodes when the last prompt is done, and all N hold close to HOLD positions at once. The
server's peak resident memory (``VmHWM``) is read after the last answer. Target (issue 23):
peak <= (memory at start + N x HOLD positions of cache) x 1.1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

SECTION = "Server memory with long requests (full-size synthetic 2B-4T, cpu)"


def status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def start_server(model: Path, clients: int, kv: str) -> tuple[subprocess.Popen, str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "bitformat.cli", "serve", str(model),
                             "--backend", "cpu", "--max-batch", str(clients), "--port", "0",
                             "--kv-cache", kv, "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    for line in proc.stdout:
        if line.startswith("serving "):
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, line.split(" at ")[1].strip()[: -len("/v1")], line.strip()
    raise SystemExit(f"the server did not start (exit {proc.wait()})")


def request(url: str, prompt: list[int], tokens: int, out: dict, go: threading.Event) -> None:
    import httpx

    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    go.wait()
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=3600)
    r.raise_for_status()
    out.update(seconds=time.perf_counter() - t0, usage=r.json()["usage"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--hold", type=int, default=1024, help="positions each request holds")
    ap.add_argument("--tokens", type=int, default=None,
                    help="tokens each request generates (default 18 x clients)")
    ap.add_argument("--kv-cache", default="f16")
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args()
    a.tokens = a.tokens or 18 * a.clients
    import numpy as np
    from bench_cold_start import cpu_name

    from bitformat.container import open_model
    from bitformat.runtime.kvquant import position_bytes
    from bitformat.validate import model_args

    with open_model(a.model) as m:
        args = model_args(m)
    per = position_bytes(args, a.kv_cache)
    rng = np.random.default_rng(3)
    lo = min(1000, args.vocab_size // 4)  # past the special tokens
    prompts = [[int(t) for t in rng.integers(lo, args.vocab_size - lo, a.hold - a.tokens)]
               for _ in range(a.clients)]
    t_start = time.time()
    proc, url, banner = start_server(a.model, a.clients, a.kv_cache)
    try:
        time.sleep(2)
        base = status(proc.pid, "VmRSS")
        go, outs = threading.Event(), [{} for _ in prompts]
        threads = [threading.Thread(target=request, args=(url, p, a.tokens, o, go))
                   for p, o in zip(prompts, outs, strict=True)]
        for t in threads:
            t.start()
        go.set()
        for t in threads:
            t.join()
        peak = status(proc.pid, "VmHWM")
        after = status(proc.pid, "VmRSS")
    finally:
        proc.terminate()
        proc.wait(60)
    held = [o["usage"]["prompt_tokens"] + o["usage"]["completion_tokens"] for o in outs]
    cache = sum(held) * per
    bound = (base + cache) * 1.1
    res = {"cpu": cpu_name(), "clients": a.clients, "hold": a.hold, "kv": a.kv_cache,
           "base": base, "peak": peak, "after": after, "cache": cache, "held": held,
           "seconds": max(o["seconds"] for o in outs), "banner": banner,
           "minutes": (time.time() - t_start) / 60}
    print(json.dumps(res, indent=1))
    g = 2**30
    text = "\n".join([
        f"## {SECTION}", "",
        f"Command: `python tools/bench_serve_memory.py 2b4t.gguf --clients {a.clients} --hold "
        f"{a.hold} --tokens {a.tokens} --kv-cache {a.kv_cache} --write` on `bitformat synth "
        f"--preset 2b4t` (i2_s). Machine: {res['cpu']}. The run took {res['minutes']:.1f} min.",
        "",
        f"The server (`bitformat serve --max-batch {a.clients} --kv-cache {a.kv_cache}`) said: "
        f"`{banner}`. {a.clients} clients each sent a prompt of {a.hold - a.tokens} token ids "
        f"with `max_tokens` {a.tokens}, at once; every request held {min(held)}-{max(held)} "
        f"positions at its end ({per:,} bytes a position).", "",
        "| memory at start (VmRSS) | cache the requests held | peak (VmHWM) | bound: (start + "
        "cache) x 1.1 | peak / (start + cache) | after the answers (VmRSS) |",
        "|---|---|---|---|---|---|",
        f"| {base / g:.2f} GiB | {cache / g:.2f} GiB | {peak / g:.2f} GiB | {bound / g:.2f} GiB "
        f"| {peak / (base + cache):.3f} | {after / g:.2f} GiB |", "",
        f"Target (issue 23): peak within the bound: {'met' if peak <= bound else 'not met'}. "
        f"All {a.clients} answers took {res['seconds']:.0f} s (their prompts' prefill "
        "included).", ""])
    print(text)
    if a.write:
        from benchdoc import DOC, replace_section

        replace_section(DOC, SECTION, text,
                        after="Prefill and decode against context length (full-size synthetic "
                              "2B-4T, cpu)")


if __name__ == "__main__":
    main()
