"""Decode benchmark on a full-size synthetic 2B-4T: every container on ``--backend cpu``,
the machine's read bandwidth, and llama.cpp (llama-cpp-python) on the same TQ2_0 weights.

    python tools/bench_decode.py --write          # everything; results into docs/benchmarks.md
    python tools/bench_decode.py --containers i2_s tq2_0 --no-llama

Measured per container, each in its own process (peak RSS is that process's ``ru_maxrss``
from ``os.wait4``; it counts the memory-mapped file pages it touched):

* prefill tokens/s on a ``--prompt``-token prompt and decode tokens/s over ``--tokens``
  decode steps after it (greedy), median of ``--repeat`` repetitions after one warm-up;
* bytes read per decoded token: every weight byte of the container (ternary matrices, norms,
  the f16 LM head) plus the KV cache the last step read;
* the fraction of the bandwidth floor: (bytes per token / read bandwidth) / seconds per token.
  The read bandwidth is a numba ``prange`` row-wise sum over a 1 GiB array
  (``bench_runtime.read_bandwidth``, the fastest of the read kernels we tried on these VMs),
  measured in this run before and after the models; the floor uses the median of all samples.

The llama.cpp copy of the TQ2_0 container has ``general.architecture = "bitnet"`` with the
``bitnet.*`` keys and no ``bitformat.*`` keys; the tensor bytes are copied unchanged. Upstream's
``bitnet`` graph uses a SiLU-gated FFN instead of ReLU² (docs/model.md §3), so its text differs,
but it reads the same bytes and does the same matrix work per token. The reference
containers (i2_s, tq2_0) and llama.cpp run interleaved: one repetition of each in turn, so
drifting load on the shared machine hits all of them alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

SECTION = "Decode on the CPU (full-size synthetic 2B-4T)"
CONTAINERS = ("i2_s", "tq2_0", "tq1_0", "stfma", "colpack_u32", "rans")
MSG = "@@bench "  # prefix of the worker's result lines (anything else on stdout is ignored)
PROMPT_TEXT = (
    "The history of computing is a story of trade-offs between memory and arithmetic. Early "
    "machines stored numbers in mercury delay lines and rotating drums, and programmers "
    "arranged their instructions so that the next word would arrive under the read head just "
    "in time. Today the same problem appears at a different scale: a language model spends "
    "most of each generated token waiting for its weights to stream in from memory."
)


# -- the llama.cpp copy -----------------------------------------------------------------------
def llama_copy(src: Path, dst: Path) -> None:
    """Write ``src`` (a bitformat tq2_0 container) as an upstream llama.cpp ``bitnet`` file."""
    from bitformat.constants import GGMLType
    from bitformat.io.gguf import GGUFReader, GGUFWriter

    with GGUFReader(src) as r:
        arch = r.get("general.architecture")
        w = GGUFWriter(str(dst), alignment=r.alignment)
        for key, mv in r.metadata.items():
            if key.startswith("bitformat.") or key == "general.alignment":
                continue
            if key == "general.architecture":
                w.add_metadata(key, "bitnet")
            elif key == "general.file_type":
                w.add_metadata(key, 37)  # LLAMA_FTYPE_MOSTLY_TQ2_0
            elif key.startswith(f"{arch}."):
                w.metadata["bitnet." + key[len(arch) + 1:]] = mv
            else:
                w.metadata[key] = mv
        names = list(r.tensors)
        bad = [n for n in names if r.tensors[n].ggml_type not in
               (GGMLType.TQ2_0, GGMLType.F32, GGMLType.F16)]
        if bad:
            raise SystemExit(f"{src}: {bad[0]} is {r.tensors[bad[0]].ggml_type.name}, "
                             "not a tq2_0 container")
        for n in names:
            t = r.tensors[n]
            w.add_tensor(n, t.shape, t.ggml_type, t.nbytes)
        w.write(r.raw(n) for n in names)


def import_llama_cpp():
    """``llama_cpp``; its unused disk cache needs ``diskcache``, stubbed if not installed."""
    try:
        import diskcache  # noqa: F401
    except ImportError:
        import types

        sys.modules["diskcache"] = types.ModuleType("diskcache")
    import llama_cpp

    return llama_cpp


# -- workers (one process per model) ----------------------------------------------------------
def send(obj: dict) -> None:
    sys.stdout.write(MSG + json.dumps(obj) + "\n")
    sys.stdout.flush()


class BitformatRunner:
    def __init__(self, path: str, threads: int | None):
        from bitformat.runtime import load

        # BITFORMAT_BENCH_HEAD=full|screened: that LM head instead of the loader's default
        head = os.environ.get("BITFORMAT_BENCH_HEAD")
        self.m = load(path, backend="cpu", threads=threads, **({"head": head} if head else {}))
        self.streamed = self._streamed_bytes()

    def _streamed_bytes(self) -> int:
        """Bytes the cpu backend's kernels actually read per token (rans: decoded trits)."""
        be, net = self.m.backend, self.m.net
        n = be._head_raw.nbytes + net.norm.nbytes  # the LM head: output.weight or tied
        for blk in net.blocks:
            n += sum(v.nbytes for v in blk.vectors.values())  # the layer's norm gains
            for w in blk.proj.values():
                n += w.data.nbytes + np.asarray(w.scale).nbytes
        return n

    def run(self, prompt: list[int], tokens: int) -> dict:
        r = self.m.generate(prompt, max_new_tokens=tokens + 1, stop_ids=[])
        s = r.stats
        return {"prefill_tps": s.prompt_tps, "decode_tps": s.generation_tps,
                "weight_bytes": s.weight_bytes_per_token, "kv_bytes": s.kv_bytes_last_token,
                "streamed_bytes": self.streamed, "tokens": list(r.tokens),
                "kernel": self.m.backend.kernel,
                "held": getattr(self.m.net.blocks[0].proj.get("attn_q"), "encoding", None)}

    def profile(self, prompt: list[int], tokens: int) -> dict:
        """Per decoded token: ms in BitLinear (kernels / the rest), the LM head, everything else."""
        be, net = self.m.backend, self.m.net
        acc = {"bitlinear": 0.0, "kernel": 0.0, "lm_head": 0.0}
        orig_bl, orig_lm, orig_call = be.bitlinear, be.lm_head, be._call

        def timed(key, fn):
            def wrapper(*a):
                t0 = time.perf_counter()
                try:
                    return fn(*a)
                finally:
                    acc[key] += time.perf_counter() - t0
            return wrapper

        cache = net.new_cache(len(prompt) + tokens)
        logits = net.forward(prompt, cache)[-1]
        be.bitlinear, be.lm_head, be._call = (timed("bitlinear", orig_bl),
                                              timed("lm_head", orig_lm),
                                              timed("kernel", orig_call))
        try:
            t0 = time.perf_counter()
            for _ in range(tokens):
                logits = net.forward([int(np.argmax(logits))], cache)[-1]
            total = time.perf_counter() - t0
        finally:
            del be.bitlinear, be.lm_head, be._call
        # _call times both the BitLinear kernels and the LM head kernel.
        lm_kernel = acc["lm_head"]
        ternary_kernels = acc["kernel"] - lm_kernel
        ms = 1e3 / tokens
        ternary = sum(w.data.nbytes for blk in net.blocks for w in blk.proj.values())
        return {"ternary_mb": ternary / 1e6, "lm_head_mb": be._embed_raw.nbytes / 1e6,
                "total_ms": total * ms, "ternary_kernels_ms": ternary_kernels * ms,
                "bitlinear_prep_ms": (acc["bitlinear"] - ternary_kernels) * ms,
                "lm_head_ms": acc["lm_head"] * ms,
                "other_ms": (total - acc["bitlinear"] - acc["lm_head"]) * ms}


class LlamaRunner:
    def __init__(self, path: str, threads: int, n_ctx: int = 256):
        llama_cpp = import_llama_cpp()
        self.lib = llama_cpp
        self.llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads,
                                   n_ctx=n_ctx, n_batch=256, verbose=False)
        self.vocab = self.llm.n_vocab()
        self.weight_bytes = sum(t.nbytes for t in _tensors(path))
        # f16 K and V of every layer: n_layer * 2 * n_embd_kv * 2 bytes per position
        meta = self.llm.metadata
        kv_dim = (int(meta["bitnet.embedding_length"]) // int(meta["bitnet.attention.head_count"])
                  * int(meta["bitnet.attention.head_count_kv"]))
        self.kv_per_pos = int(meta["bitnet.block_count"]) * 2 * kv_dim * 2

    def _next(self) -> int:
        ptr = self.lib.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(self.vocab,))))

    def run(self, prompt: list[int], tokens: int) -> dict:
        llm = self.llm
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        prefill = time.perf_counter() - t0
        tok, decode = self._next(), 0.0
        for _ in range(tokens):
            t0 = time.perf_counter()
            llm.eval([tok])
            decode += time.perf_counter() - t0
            tok = self._next()
        kv = (len(prompt) + tokens - 1) * self.kv_per_pos
        return {"prefill_tps": len(prompt) / prefill, "decode_tps": tokens / decode,
                "weight_bytes": self.weight_bytes, "kv_bytes": kv,
                "streamed_bytes": self.weight_bytes}


def _tensors(path: str):
    from bitformat.io.gguf import GGUFReader

    with GGUFReader(path) as r:
        return list(r.tensors.values())


def worker(kind: str, path: str, threads: int | None) -> None:
    t0 = time.perf_counter()
    runner = LlamaRunner(path, threads or 2) if kind == "llama" else BitformatRunner(path, threads)
    send({"ready": time.perf_counter() - t0})
    for line in sys.stdin:
        req = json.loads(line)
        if req["cmd"] == "quit":
            break
        fn = runner.profile if req["cmd"] == "profile" else runner.run
        send(fn(req["prompt"], req["tokens"]))


class Worker:
    """Parent side of one worker process."""

    def __init__(self, label: str, kind: str, path: Path, threads: int | None,
                 env: dict[str, str] | None = None, script: Path | None = None):
        """``script``: another tree's copy of this file (which then imports that tree's
        ``bitformat``: tools/bench_revisions.py); by default this one."""
        self.label, self.kind, self.path, self.threads = label, kind, path, threads
        script = Path(script or __file__)
        cmd = [sys.executable, str(script), "--worker", kind, "--path", str(path)]
        if threads:
            cmd += ["--threads", str(threads)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1, env={**os.environ, **(env or {})})
        self.runs: list[dict] = []
        self.profile: dict | None = None
        self.load_s = self._read()["ready"]
        self.peak_rss = 0

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MSG):
                return json.loads(line[len(MSG):])
        raise RuntimeError(f"{self.label}: worker exited ({self.path})")

    def ask(self, cmd: str, prompt: list[int], tokens: int) -> dict:
        self.proc.stdin.write(json.dumps({"cmd": cmd, "prompt": prompt, "tokens": tokens}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
        self.proc.stdin.close()
        _, status, ru = os.wait4(self.proc.pid, 0)
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        self.peak_rss = ru.ru_maxrss * 1024  # Linux: KiB

    def summary(self) -> dict:
        med = {k: statistics.median(r[k] for r in self.runs)
               for k in ("prefill_tps", "decode_tps")}
        last = self.runs[-1]
        return {"label": self.label, "threads": str(self.threads or "adaptive"), **med,
                "decode_all": [r["decode_tps"] for r in self.runs],
                "prefill_all": [r["prefill_tps"] for r in self.runs],
                "tokens": [r.get("tokens") for r in self.runs], "kernel": last.get("kernel"),
                "held": last.get("held"),
                "bytes": last["weight_bytes"] + last["kv_bytes"],
                "streamed": last["streamed_bytes"] + last["kv_bytes"],
                "peak_rss": self.peak_rss, "load_s": self.load_s, "profile": self.profile}


def run_group(specs: list[tuple], prompt: list[int], tokens: int,
              repeat: int, profile_tokens: int) -> list[dict]:
    """Start the workers of ``specs``, warm each up, then run ``repeat`` interleaved rounds."""
    workers = []
    try:
        for spec in specs:
            t0 = time.perf_counter()
            workers.append(Worker(*spec))
            workers[-1].ask("run", prompt, 4)  # warm-up: page cache, first-call costs
            print(f"  {spec[0]} ({spec[3] or 'adaptive'} threads): loaded in "
                  f"{workers[-1].load_s:.1f} s, warmed up in {time.perf_counter() - t0:.1f} s",
                  flush=True)
        for i in range(repeat):
            for w in workers:
                r = w.ask("run", prompt, tokens)
                w.runs.append(r)
                print(f"  round {i + 1} {w.label:16} {w.threads or 'adaptive':>8} threads"
                      f"  prefill {r['prefill_tps']:7.1f} tok/s"
                      f"  decode {r['decode_tps']:6.2f} tok/s", flush=True)
        if profile_tokens:
            for w in workers:
                if w.kind == "bitformat":
                    w.profile = w.ask("profile", prompt, profile_tokens)
                    print(f"  profile {w.label}: {w.profile}", flush=True)
    finally:
        for w in workers:
            w.close()
    return [w.summary() for w in workers]


# -- the parent -------------------------------------------------------------------------------
def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def machine() -> str:
    model = "?"
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            model = line.split(":", 1)[1].strip()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{model}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, {platform.machine()}"


def make_prompt(path: Path, n: int) -> list[int]:
    from bitformat.io.gguf import GGUFReader
    from bitformat.tokenizers.bpe import Tokenizer

    with GGUFReader(path) as r:
        tok = Tokenizer(r.metadata)
    ids = tok.encode(PROMPT_TEXT)
    while len(ids) < n:
        ids += tok.encode(" " + PROMPT_TEXT, add_bos=False)
    return ids[:n]


def prepare(src: Path, out: Path, containers: list[str], llama: bool) -> tuple[dict, list]:
    """Paths of each container (converted next to ``out`` if missing) and the files made."""
    from bitformat.container import convert

    paths, made = convert_missing(src, out, containers, "decode")
    if llama:
        tq2 = paths.get("tq2_0") or out / "decode-tq2_0.gguf"
        if not tq2.exists():
            convert(src, tq2, "tq2_0")
            made.append(tq2)
        p = out / "decode-tq2_0-llamacpp.gguf"
        if not p.exists():
            llama_copy(tq2, p)
            made.append(p)
        paths["llama"] = p
    return paths, made


def bandwidth(repeat: int) -> float:
    from bench_runtime import read_bandwidth

    return read_bandwidth(repeat)


def convert_missing(src: Path, out: Path, fids, prefix: str
                    ) -> tuple[dict[str, Path], list[Path]]:
    """``{fid: path}`` of ``src`` in each container ``fids`` (i2_s: ``src`` itself; the others
    ``out/<prefix>-<fid>.gguf``, converted where missing) and the paths converted now."""
    from bitformat.container import convert

    paths, made = {}, []
    for fid in fids:
        p = src if fid == "i2_s" else out / f"{prefix}-{fid}.gguf"
        if not p.exists():
            t0 = time.perf_counter()
            convert(src, p, fid)
            made.append(p)
            print(f"converted {fid} in {time.perf_counter() - t0:.1f} s", flush=True)
        paths[fid] = p
    return paths, made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="out/bench/2b4t.gguf",
                    help="the i2_s source (bitformat synth --preset 2b4t)")
    ap.add_argument("--containers", nargs="+", default=list(CONTAINERS), choices=CONTAINERS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--adaptive", action="store_true",
                    help="also run i2_s and tq2_0 with the default adaptive thread count")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=32, help="decode steps timed")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--profile-tokens", type=int, default=16,
                    help="decode steps of the per-token time breakdown (0: none)")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the converted containers")
    ap.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    ap.add_argument("--worker", choices=["bitformat", "llama"], help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.worker, a.path, a.threads)
        return

    t_start = time.perf_counter()
    src = (ROOT / a.model).resolve() if not Path(a.model).is_absolute() else Path(a.model)
    if not src.exists():
        raise SystemExit(f"{src} is missing: bitformat synth --preset 2b4t -o {a.model}")
    load_before = loadavg()
    paths, made = prepare(src, src.parent, a.containers, not a.no_llama)
    prompt = make_prompt(src, a.prompt)
    try:
        bw = [bandwidth(5)]
        print(f"read bandwidth before: {bw[0]:.1f} GB/s", flush=True)
        # Reference group, interleaved: i2_s, tq2_0 (and adaptive) and llama.cpp.
        specs = [(fid, "bitformat", paths[fid], a.threads)
                 for fid in ("i2_s", "tq2_0") if fid in paths]
        if a.adaptive:
            specs += [(fid, "bitformat", paths[fid], None)
                      for fid in ("i2_s", "tq2_0") if fid in paths]
        if "llama" in paths:
            specs.append(("llama.cpp tq2_0", "llama", paths["llama"], a.threads))
        rows = run_group(specs, prompt, a.tokens, a.repeat, a.profile_tokens)
        bw.append(bandwidth(5))
        print(f"read bandwidth between: {bw[1]:.1f} GB/s", flush=True)
        for fid in a.containers:
            if fid not in ("i2_s", "tq2_0"):
                rows += run_group([(fid, "bitformat", paths[fid], a.threads)], prompt,
                                  a.tokens, a.repeat, 0)
        bw.append(bandwidth(5))
        print(f"read bandwidth after: {bw[2]:.1f} GB/s", flush=True)
    finally:
        if not a.keep:
            for p in made:
                p.unlink(missing_ok=True)
    load_after = loadavg()
    elapsed = time.perf_counter() - t_start
    report = render(rows, bw, a, load_before, load_after, elapsed)
    print(report)
    if a.write:
        from benchdoc import DOC, replace_section

        replace_section(DOC, SECTION, report)
        print(f"wrote {DOC}")


def render(rows: list[dict], bw: list[float], a, load_before: str, load_after: str,
           elapsed: float) -> str:
    from bitformat.runtime.cpu.kernels import kernel_mode

    b = statistics.median(bw)
    cmd = "python tools/bench_decode.py --write" + (" --adaptive" if a.adaptive else "")
    if a.containers != list(CONTAINERS):
        cmd += " --containers " + " ".join(a.containers)
    if (a.prompt, a.tokens, a.repeat, a.threads) != (64, 32, 3, 2):
        cmd += f" --prompt {a.prompt} --tokens {a.tokens} --repeat {a.repeat} --threads {a.threads}"
    if a.no_llama:
        cmd += " --no-llama"
    if a.keep:
        cmd += " --keep"
    bws = ", ".join(f"{x:.1f}" for x in bw)
    out = [f"## {SECTION}", "",
           f"Command: `{cmd}` on `bitformat synth --preset 2b4t` (seed 0, "
           f"`out/bench/2b4t.gguf`; the script converts it to the other containers with "
           "`bitformat convert` where they are missing and deletes those copies after the "
           f"run unless `--keep`). Machine: {machine()}; Python "
           f"{platform.python_version()}, numba cpu kernel build `{kernel_mode()}`. The whole "
           f"run took {elapsed / 60:.1f} min.", "",
           f"Each model runs in its own process. The prompt is {a.prompt} tokens of English "
           f"text; decode means {a.tokens} greedy steps after it. Figures are the median of "
           f"{a.repeat} repetitions after a warm-up. Bytes/token counts every weight byte of "
           "the container (ternary matrices, norms, the f16 LM head) plus the KV cache that "
           "the last step read. The read bandwidth is the faster of two numba read kernels "
           "over 1 GiB (row sums, and row sums prefetching 8 KiB ahead: "
           "`bench_runtime.read_bandwidth`), measured before the models, between the two "
           "groups and after them "
           f"({bws} GB/s); the median, {b:.1f} GB/s, is used. % of floor = (bytes/token ÷ "
           "bandwidth) ÷ seconds per decoded token. Peak RSS is the process's `ru_maxrss`; it "
           "includes the memory-mapped weight pages the process touched. The i2_s, tq2_0 and "
           "llama.cpp rows ran interleaved, one repetition of each in turn; the other "
           "containers ran after them, one at a time.", "",
           "| container | threads | prefill tok/s | decode tok/s | ms/token | bytes/token MB | "
           "GB/s | % of floor | peak RSS GiB |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gbs = r["bytes"] * r["decode_tps"] / 1e9
        r["floor"] = gbs / b
        out.append(f"| {r['label']} | {r['threads']} | {r['prefill_tps']:.1f} | "
                   f"{r['decode_tps']:.2f} | {1e3 / r['decode_tps']:.1f} | "
                   f"{r['bytes'] / 1e6:,.1f} | {gbs:.1f} | {r['floor']:.0%} | "
                   f"{r['peak_rss'] / 2**30:.2f} |")
    for r in rows:
        if r["streamed"] > 1.05 * r["bytes"]:
            gbs = r["streamed"] * r["decode_tps"] / 1e9
            out += ["", f"{r['label']}: the cpu backend decodes this container to int8 trits "
                    f"when it loads, so its kernels stream {r['streamed'] / 1e6:,.0f} MB per "
                    f"token ({gbs:.1f} GB/s, or {gbs / b:.0%} of the bandwidth on that basis)."]
    ours = [r for r in rows if not r["label"].startswith("llama")]
    met = [f"{r['label']} ({r['threads']})" for r in ours if r["floor"] >= 0.6]
    missed = [f"{r['label']} ({r['threads']})" for r in ours if r["floor"] < 0.6]
    out += ["", "Target (issue: `--backend cpu` decode at 60 % of the bandwidth floor or "
            f"better): met by {', '.join(met) or 'none'}; not met by "
            f"{', '.join(missed) or 'none'}."]
    fixed = str(a.threads)
    ref = next((r for r in rows if r["label"] == "tq2_0" and r["threads"] == fixed), None)
    i2s = next((r for r in rows if r["label"] == "i2_s" and r["threads"] == fixed), None)
    lcpp = next((r for r in rows if r["label"].startswith("llama")), None)
    if ref and lcpp:
        ratio = ref["decode_tps"] / lcpp["decode_tps"]
        cols = [("bitformat cpu, tq2_0", ref)] + ([("bitformat cpu, i2_s", i2s)] if i2s else [])
        out += ["", "### Against llama.cpp", "",
                f"llama-cpp-python {_llama_version()} was built from source. It runs the same "
                f"TQ2_0 tensor bytes with the same {a.threads} threads and the same prompt, "
                "interleaved with the bitformat runs above. Only the `Llama.eval` calls are "
                "timed; greedy sampling from their logits happens outside the timer. "
                "bitformat's figures, by contrast, include its own sampling and "
                "detokenizing. The copy given to llama.cpp declares "
                "`general.architecture = bitnet` with the `bitnet.*` keys and has no `.scale` "
                "tensors, since TQ2_0 carries a scale per 256-value block. Upstream's `bitnet` "
                "graph gates the FFN with SiLU rather than ReLU², so its text differs; it "
                "still reads the same bytes and does the same matrix work per token.", "",
                "| | " + " | ".join(c for c, _ in cols) + " | llama.cpp tq2_0 | "
                "tq2_0 ÷ llama.cpp |",
                "|---|" + "---|" * (len(cols) + 2),
                "| decode tok/s | " + " | ".join(f"{r['decode_tps']:.2f}" for _, r in cols)
                + f" | {lcpp['decode_tps']:.2f} | **{ratio:.2f}** |",
                "| prefill tok/s | " + " | ".join(f"{r['prefill_tps']:.1f}" for _, r in cols)
                + f" | {lcpp['prefill_tps']:.1f} | "
                f"{ref['prefill_tps'] / lcpp['prefill_tps']:.2f} |",
                "| decode tok/s, each repetition | "
                + " | ".join(", ".join(f"{x:.2f}" for x in r["decode_all"]) for _, r in cols)
                + f" | {', '.join(f'{x:.2f}' for x in lcpp['decode_all'])} | |", "",
                f"Target (decode at least as fast as llama.cpp): ratio {ratio:.2f}, "
                f"{'met' if ratio >= 1.0 else 'not met'}."]
    profs = [r for r in rows if r["profile"]]
    if profs:
        out += ["", "### Where a decoded token's time goes", "",
                f"These are {a.profile_tokens} decode steps in the same processes, with timers "
                "around the backend calls, in ms per token. *Ternary kernels* are the numba "
                "mat-vec calls. *BitLinear prep* is the activation relayout and sums that come "
                "before them. *LM head* is the f16 output projection. *Other* "
                "covers norms, int8 quantization, RoPE, attention, KV writes and the Python "
                "between them.", "",
                "| container | threads | total | ternary kernels (GB/s) | BitLinear prep | "
                "LM head (GB/s) | other |",
                "|---|---|---|---|---|---|---|"]
        for r in profs:
            p = r["profile"]
            tk, lm = p["ternary_kernels_ms"], p["lm_head_ms"]
            out.append(f"| {r['label']} | {r['threads']} | {p['total_ms']:.1f} | "
                       f"{tk:.1f} ({p['ternary_mb'] / tk:.1f}) | {p['bitlinear_prep_ms']:.1f} | "
                       f"{lm:.1f} ({p['lm_head_mb'] / lm:.1f}) | {p['other_ms']:.1f} |")
    out += ["", "Noise: these figures come from one run on a shared 2-core VM, and other work "
            "may have run at the same time. /proc/loadavg (1, 5 and 15 min) read "
            f"{load_before} before the run and {load_after} after it. Ratios between the "
            "interleaved rows are more reliable than the absolute figures; "
            "repeated runs of one benchmark on these VMs differed by about ±20 %."]
    return "\n".join(out)


def _llama_version() -> str:
    try:
        from importlib.metadata import version

        return version("llama-cpp-python")
    except Exception:  # pragma: no cover
        return "?"


if __name__ == "__main__":
    main()
