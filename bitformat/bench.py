"""``bitformat bench``: one model in every container, decoded on a backend, timed per kernel class.

For each container the model is converted (into a temporary folder unless ``keep_dir``), loaded
on the backend, given a fixed prompt (:data:`PROMPT_IDS`) and one untimed warm-up decode step,
and then ``tokens`` greedy decode steps are timed. Per token and per kernel class it reports
the bytes read, the milliseconds and the effective GB/s; per container the totals and decode
tokens/s. The same steps then run again with the screened LM head (``screened``: the same
tokens, its head bytes and time; :mod:`.runtime.head`), on cpu and on wgpu.

Bytes are what a step reads (every class reads its tensors once per token, as
:class:`~.runtime.loader.LoadedModel` counts them): the container's own bytes, except where the
backend decoded them at load. A rans container is measured twice: ``decode="load"`` (its
streams decoded once into stfma rows, which the 2-bit kernels read: 2 bits a weight) and
``decode="fused"`` (the stream words, decoded inside every mat-vec), the bytes-read-versus-
latency trade-off; its coded LM head is decoded into f16 at load either way. ``load_s`` is the
time :func:`~.runtime.load` (or the wgpu upload) took, decoding included, less numba's
compilation meanwhile: every timed figure is warm, and the first run on a machine reports its
compilation on a line of its own (``compile_count``, ``compile_s``):

==============  ===========================================  ===============================
class           bytes per token                              time (cpu / wgpu)
==============  ===========================================  ===============================
``ternary``     every ternary matrix as the backend reads it ``bitlinear`` calls / mat-vec,
                                                             rans gather and finish kernels
``lm_head``     ``token_embd`` (the tied LM head), as f16    ``lm_head`` calls / lm_head and
                                                             argmax kernels
``other``       the other tensors (norm gains, scales)       the rest of the step / embed and
                                                             norm_quant kernels
``attention``   the K and V cache the step reads (f32, the   ``attend`` calls / rope and
                mean over the timed steps)                   attention kernels
==============  ===========================================  ===============================

Times: on ``cpu`` host timers around the backend's calls while the timed steps run again layer
by layer (``other`` is that step's wall time minus the three others): the totals come from the
backend's fastest path, which runs a token's layers in one compiled call that cannot be timed
per class, so the classes can sum to more than ``ms_per_token``; on ``wgpu``
:meth:`~.runtime.wgpu.network.WgpuBitNet.profile` of one step at the mean length (GPU
timestamp queries where the adapter has them, else each dispatch submitted and waited for
alone, timed on the host). Totals
(``ms_per_token``, ``tokens_per_s``) are always host wall time of the timed steps, which on
``wgpu`` also holds the submit and the 4-byte argmax readback.

>>> r = run_bench("tiny.gguf", "cpu", ["i2_s", "rans"], tokens=8)     # doctest: +SKIP
>>> r.containers[1].tokens_per_s                                       # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .constants import DEFAULT_KV_TYPE
from .container import Model, convert, open_model
from .errors import RequestError
from .formats import FORMAT_IDS

#: The prompt (token ids, taken modulo the vocabulary): fixed, so runs compare.
PROMPT_IDS = (1, 5, 17, 300, 42, 7, 99, 128)
BACKENDS = ("cpu", "wgpu")
CLASSES = ("ternary", "lm_head", "other", "attention")
LABELS = {"ternary": "ternary mat-vecs", "lm_head": "LM head", "other": "norms, quant, other",
          "attention": "attention (RoPE, KV)"}
#: wgpu profile kinds -> class (anything else is "other": embed, norm)
GPU_CLASS = {"rans:gather": "ternary", "rans:finish": "ternary", "lm_head": "lm_head",
             "argmax": "lm_head", "rope": "attention", "attention": "attention"}


@dataclass
class ContainerBench:
    """One container's figures; ``classes[c]`` has ``bytes``, ``ms`` and ``gbps`` per token."""

    format: str
    path: str
    file_bytes: int
    classes: dict[str, dict[str, float]]
    bytes_per_token: int
    ms_per_token: float  # host wall time of a timed decode step (mean)
    tokens_per_s: float
    gbps: float  # bytes_per_token / ms_per_token
    kernel_ms: float  # the classes' ms summed (wgpu: GPU time of one step)
    convert_s: float
    load_s: float
    tokens: list[int] = field(default_factory=list)  # the greedy tokens of the timed steps
    detail: dict[str, Any] | None = None  # wgpu: the raw profile (its own per-kind bytes)
    decode: str = ""  # rans: "load" or "fused" (see the module docstring)
    #: the same steps with the screened head (:mod:`.runtime.head`): tokens_per_s,
    #: ms_per_token, head_ms, head_bytes and bytes_per_token per step, candidates (mean, max)
    #: and whether its tokens equal the full head's
    screened: dict[str, Any] | None = None
    #: numba's compilation on this container's run (functions, seconds): kept out of every
    #: timed figure (``load_s`` excludes what compiled while loading; the timed steps run warm)
    compile_count: int = 0
    compile_s: float = 0.0
    compiled_while_timed: int = 0  # functions compiled inside a timed loop (should be none)

    @property
    def label(self) -> str:
        return f"{self.format} ({self.decode})" if self.decode else self.format


#: containers whose wgpu kernels add block scales in float32 (docs/model.md §2)
WGPU_FLOAT32_BLOCKS = ("tq1_0", "tq2_0")


@dataclass
class BenchResult:
    source: str
    backend: str
    device: str
    timing: str  # the clock of the class times: "gpu-timestamps" or "host"
    prompt_tokens: int
    warmup_tokens: int
    tokens: int
    kv_bytes_per_position: int
    containers: list[ContainerBench] = field(default_factory=list)
    kv_cache: str = DEFAULT_KV_TYPE  # the KV cache's type (runtime/kvquant.py)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["tokens_agree"] = self.disagreement() is None
        out["token_groups"] = [[c.label for c in g] for g in self.token_groups()]
        return out

    def token_groups(self) -> list[list[ContainerBench]]:
        """The containers grouped by the greedy tokens they decoded, the largest group first."""
        groups: dict[tuple[int, ...], list[ContainerBench]] = {}
        for c in self.containers:
            groups.setdefault(tuple(c.tokens), []).append(c)
        return sorted(groups.values(), key=len, reverse=True)

    def disagreement(self) -> str | None:
        """Why the containers' tokens are not the same where they must be, or None.

        Every container is a lossless conversion of one model and every backend applies the
        scales in one arithmetic (docs/model.md §2), so they decode the same tokens. The one
        documented exception: on wgpu, TQ1_0 and TQ2_0 add their block scales in float32
        (WGSL has no float64), so they may part from the others there.
        """
        groups = self.token_groups()
        if len(groups) < 2:
            return None
        rest = [c for g in groups[1:] for c in g]
        if self.backend == "wgpu" and all(c.format in WGPU_FLOAT32_BLOCKS for c in rest):
            return None
        return ("the containers decoded different tokens: "
                + "; ".join(f"{', '.join(c.label for c in g)}: {g[0].tokens[:8]}"
                            + ("..." if len(g[0].tokens) > 8 else "") for g in groups))


def parse_formats(text: str | list[str] | tuple[str, ...]) -> list[str]:
    """``"all"`` or a comma list of container ids -> the ids, in :data:`FORMAT_IDS` order."""
    items = text.split(",") if isinstance(text, str) else list(text)
    items = [t.strip() for t in items if t.strip()]
    if items == ["all"]:
        return list(FORMAT_IDS)
    bad = [t for t in items if t not in FORMAT_IDS]
    if bad or not items:
        raise RequestError(f"unknown container {bad[0] if bad else '(none)'!r}; choose all or "
                           f"a comma list of {', '.join(FORMAT_IDS)}")
    return [f for f in FORMAT_IDS if f in items]


def class_bytes(model: Model, kv_bytes: int, decode: str = "") -> dict[str, int]:
    """Bytes per token of each kernel class (see the module docstring)."""
    from .codecs.rans_rows import stfma_row_bytes

    out = dict.fromkeys(CLASSES, 0)
    for e in model.entries:
        key = "ternary" if e.ternary else "lm_head" if e.name == "token_embd.weight" else "other"
        if e.encoding == "rans" and decode == "load":
            out[key] += e.shape[0] * stfma_row_bytes(e.shape[1])
        else:
            out[key] += e.nbytes if e.ternary else e.plain_nbytes
    out["attention"] = kv_bytes
    return out


def _args(model: Model) -> Any:
    from .runtime.models import ModelArgs

    meta = {k: v.plain() for k, v in model.metadata.items()}
    return ModelArgs.from_metadata(meta, vocab_size=model.entry("token_embd.weight").shape[0])


class _Timers:
    """Adds the wall time of wrapped calls to ``seconds[key]``."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(CLASSES, 0.0)

    def wrap(self, key: str, fn: Callable) -> Callable:
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds[key] += time.perf_counter() - t0
        return timed


class _Compiles:
    """numba's compilation during a block: functions and seconds (own times summed, so
    nested compiles count once)."""

    def __init__(self) -> None:
        self.count, self.seconds, self.timed = 0, 0.0, 0
        self.timing = False  # inside a timed loop

    @contextlib.contextmanager
    def timed_block(self) -> Iterator[None]:
        self.timing = True
        try:
            yield
        finally:
            self.timing = False

    def done(self, name: str, seconds: float, own: float) -> None:
        self.count += 1
        self.seconds += own
        self.timed += self.timing


@contextlib.contextmanager
def _timed_cpu(backend: Any, timers: _Timers) -> Iterator[None]:
    """Time the backend's ``bitlinear`` / ``lm_head`` / ``attend`` (instance attributes shadow
    the methods)."""
    kinds = {"bitlinear": "ternary", "lm_head": "lm_head", "attend": "attention"}
    for name, key in kinds.items():
        setattr(backend, name, timers.wrap(key, getattr(type(backend), name).__get__(backend)))
    try:
        yield
    finally:
        for name in kinds:
            delattr(backend, name)


def _run_cpu(path: Path, prompt: list[int], tokens: int, threads: int | None,
             i2s_variant: str, decode: str = "load", compiles: _Compiles | None = None,
             kv_cache: str = DEFAULT_KV_TYPE
             ) -> tuple[dict[str, float], float, list[int], float, str, dict[str, Any]]:
    """(seconds per class, wall seconds, tokens, load seconds, device, screened) of ``tokens``
    timed decode steps with the full head; class seconds are totals over the steps.
    ``screened``: the same steps again with the screened head (:class:`ContainerBench`).
    Every timed loop runs its path once untimed first, so nothing timed compiles; the load
    time leaves out what compiled meanwhile (``compiles``)."""
    from .runtime import load

    before = compiles.seconds if compiles else 0.0
    with load(path, backend="cpu", threads=threads, i2s_variant=i2s_variant,
              decode=decode, head="screened", kv_cache=kv_cache) as m:
        load_s = m.load_seconds - ((compiles.seconds - before) if compiles else 0.0)
        net, be = m.net, m.backend
        cache = net.new_cache(len(prompt) + 1 + tokens)
        tok = int(np.argmax(net.forward(prompt, cache)[-1]))
        tok = int(np.argmax(net.forward([tok], cache)[-1]))  # warm-up: first-call costs
        start, first, out = cache.length, tok, []
        timed = compiles.timed_block() if compiles else contextlib.nullcontext()
        with timed:
            t0 = time.perf_counter()
            for _ in range(tokens):
                tok = int(np.argmax(net.forward([tok], cache)[-1]))
                out.append(tok)
            wall = time.perf_counter() - t0
        # the same steps layer by layer, timed per class (the fast path is one call a token);
        # one untimed step first: the layer-by-layer kernels compile on their first call
        cache.length, tok, timers, again = start, first, _Timers(), []
        plan, net._plan = getattr(net, "_plan", False), None
        try:
            net.forward([tok], cache)
            cache.length = start
            with _timed_cpu(be, timers), (compiles.timed_block() if compiles
                                          else contextlib.nullcontext()):
                t0 = time.perf_counter()
                for _ in range(tokens):
                    tok = int(np.argmax(net.forward([tok], cache)[-1]))
                    again.append(tok)
                layered = time.perf_counter() - t0
        finally:
            net._plan = plan
        if again != out:
            raise RuntimeError(f"{path}: the layer-by-layer steps chose other tokens than the "
                               "compiled ones")
        secs = timers.seconds
        secs["other"] = max(0.0, layered - secs["ternary"] - secs["lm_head"] - secs["attention"])
        device = (f"{platform.machine()} cpu, {os.cpu_count()} cores, "
                  f"{getattr(be, 'threads', '?')} threads, numba {getattr(be, 'kernel', '?')}")
        return secs, wall, out, load_s, device, _run_screened(net, prompt, tokens, out,
                                                              compiles)


def _run_screened(net: Any, prompt: list[int], tokens: int, want: list[int],
                  compiles: _Compiles | None = None) -> dict[str, Any]:
    """The timed steps of :func:`_run_cpu` or :func:`_run_wgpu` again, choosing tokens with
    the screened head."""
    from .runtime.models import Segment
    from .runtime.sampling import Sampler

    head, sampler = net.head, Sampler()
    cache = net.new_cache(len(prompt) + 1 + tokens)
    tok = net.decode([Segment(prompt, cache)], [sampler])[0]
    tok = net.decode([Segment([tok], cache)], [sampler])[0]  # warm-up, as the full head's
    head.reset_stats()
    timers, out = _Timers(), []
    select = head.select
    head.select = timers.wrap("lm_head", select)
    try:
        with compiles.timed_block() if compiles else contextlib.nullcontext():
            t0 = time.perf_counter()
            for _ in range(tokens):
                tok = net.decode([Segment([tok], cache)], [sampler])[0]
                out.append(tok)
            wall = time.perf_counter() - t0
    finally:
        del head.select
    st = head.stats.as_dict()
    return {"tokens_per_s": tokens / wall, "ms_per_token": wall / tokens * 1e3,
            "head_ms": timers.seconds["lm_head"] / tokens * 1e3,
            "head_bytes": st["head_bytes_per_step"], "full_head_bytes": st["full_head_bytes"],
            "candidates_mean": st["candidates_per_step_mean"],
            "candidates_max": st["candidates_per_step_max"], "fallbacks": st["head_fallbacks"],
            "same_tokens": out == want}


def _run_wgpu(model: Model, dev: Any, prompt: list[int], tokens: int, repeats: int,
              decode: str = "load", kv_cache: str = DEFAULT_KV_TYPE
              ) -> tuple[dict[str, float], float, list[int], float, dict[str, Any],
                         dict[str, Any] | None]:
    """The same on the GPU; class seconds are one profiled step at the mean length. The
    screened head's steps run after the profile (None where the head cannot screen)."""
    from .runtime.head import Head
    from .runtime.wgpu.backend import WgpuBackend
    from .runtime.wgpu.network import WgpuBitNet

    n = len(prompt) + 1 + tokens
    t0 = time.perf_counter()
    net = WgpuBitNet(_args(model), WgpuBackend(model, device=dev, context=n, decode=decode),
                     head="screened", kv_type=kv_cache)
    load_s = time.perf_counter() - t0
    screened_head = net.head
    net.head = Head(net.be, "full")  # the full head's steps and profile first
    cache = net.new_cache(n)
    tok = net.greedy(prompt, cache)
    tok = net.greedy([tok], cache)  # warm-up
    out = []
    net.host_seconds, net.host_steps = 0.0, 0
    t0 = time.perf_counter()
    for _ in range(tokens):  # as decoding runs: the next step in flight while a token returns
        tok = net.greedy([tok], cache)
        out.append(tok)
    wall = time.perf_counter() - t0
    length = int(round(len(prompt) + (tokens + 3) / 2))  # the mean length of the timed steps
    prof = net.profile(length=min(length, n), token=tok, repeats=repeats)
    secs = dict.fromkeys(CLASSES, 0.0)
    for kind, k in prof["kinds"].items():
        key = "ternary" if kind.startswith("matvec") else GPU_CLASS.get(kind, "other")
        secs[key] += k["seconds"]
    prof["dispatches_per_token"] = net.dispatches_per_token
    prof["fused"] = net.dev.fused
    prof["host_us_per_token"] = net.host_seconds / max(1, net.host_steps) * 1e6
    net.head = screened_head
    screened = None if net.head.unavailable else _run_screened(net, prompt, tokens, out)
    if screened is not None and net.screening():
        # greedy steps took the screened head's choice on the device, inside the step (no
        # Head.select to time): its kernels' share of one profiled step instead
        sp = net.profile(length=min(length, n), token=tok, repeats=repeats)
        screened["head_ms"] = sum(v["seconds"] for k, v in sp["labels"].items()
                                  if k in net.screen.labels) * 1e3
        screened["on_device"] = True
    return secs, wall, out, load_s, prof, screened



def run_bench(path: str | os.PathLike, backend: str = "cpu",
              formats: str | list[str] | tuple[str, ...] = "all", tokens: int = 16, *,
              keep_dir: str | os.PathLike | None = None, threads: int | None = None,
              repeats: int = 3, i2s_variant: str = "x86",
              convert_progress: Callable[[str, int], Any] | None = None,
              stage: Callable[[str, str], None] | None = None,
              kv_cache: str = DEFAULT_KV_TYPE) -> BenchResult:
    """Convert ``path`` into each container of ``formats`` and benchmark decoding on ``backend``.

    ``convert_progress(fid, total_bytes)`` may return a per-tensor callback with ``close()``
    (a progress bar); ``stage(fid, what)`` hears "converting", "loading and decoding" and "done".
    ``repeats`` is the wgpu profile's. A source already in a container is used as it is.
    ``kv_cache``: the KV cache's type (f16, f32; q8_0 on the cpu backend). The wgpu step
    holds an f16 cache's values in float32 slots, and its bytes per step say so.
    """
    if backend not in BACKENDS:
        raise RequestError(f"unknown backend {backend!r}; choose {' or '.join(BACKENDS)}")
    if tokens < 1:
        raise RequestError("bench needs at least one decode step (--tokens)")
    from .runtime.kvquant import check_kv_type

    check_kv_type(kv_cache)
    if kv_cache == "q8_0" and backend != "cpu":
        raise RequestError("bench times a q8_0 KV cache on the cpu backend only (the wgpu "
                           "step keeps f16 or f32)")
    fids = parse_formats(formats)
    src = Path(path)
    with open_model(src, i2s_variant=i2s_variant) as m:
        args = _args(m)
        src_container = m.container if src.is_file() else None
        total = sum(e.nbytes for e in m.entries)
    prompt = [t % args.vocab_size for t in PROMPT_IDS]
    from .runtime.kvquant import position_bytes

    kv_pos = position_bytes(args, kv_cache if backend == "cpu" else "f32")
    kv = kv_pos * (2 * len(prompt) + tokens + 3) // 2  # mean over the timed steps
    dev = None
    if backend == "wgpu":
        from .runtime.wgpu.device import GpuDevice

        dev = GpuDevice()
    result = BenchResult(str(src), backend, dev.name if dev else "", "host", len(prompt), 1,
                         tokens, kv_pos, kv_cache=kv_cache)
    with contextlib.ExitStack() as stack:
        if keep_dir is None:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-")))
        else:
            folder = Path(keep_dir)
            folder.mkdir(parents=True, exist_ok=True)
        stem = src.name if src.is_dir() else src.stem
        for fid in fids:
            target, t0 = src, time.perf_counter()
            if fid != src_container:
                target = folder / f"{stem}.{fid}.gguf"
                if stage:
                    stage(fid, "converting")
                bar = convert_progress(fid, total) if convert_progress else None
                try:
                    convert(src, target, fid, i2s_variant=i2s_variant, progress=bar)
                finally:
                    if bar is not None:
                        bar.close()
            convert_s = time.perf_counter() - t0
            try:
                for decode in (("load", "fused") if fid == "rans" else ("",)):
                    result.containers.append(_bench_one(
                        target, fid, backend, dev, prompt, tokens, kv, threads, repeats,
                        i2s_variant, convert_s, stage, result, decode))
                if stage:
                    stage(fid, "done")
            finally:
                if keep_dir is None and target != src:
                    target.unlink(missing_ok=True)
    return result


def _bench_one(target: Path, fid: str, backend: str, dev: Any, prompt: list[int], tokens: int,
               kv: int, threads: int | None, repeats: int, i2s_variant: str, convert_s: float,
               stage: Callable[[str, str], None] | None, result: BenchResult,
               decode: str = "") -> ContainerBench:
    from .runtime.warmup import on_compile

    if stage:
        stage(fid, f"loading and decoding{f' ({decode})' if decode else ''}")
    detail = None
    compiles = _Compiles()
    with open_model(target, i2s_variant=i2s_variant) as model, \
            on_compile(lambda name: None, compiles.done):
        nbytes = class_bytes(model, kv, decode)
        if backend == "cpu":
            secs, wall, out, load_s, result.device, screened = _run_cpu(
                target, prompt, tokens, threads, i2s_variant, decode or "load", compiles,
                result.kv_cache)
            per_class = {k: v / tokens for k, v in secs.items()}
        else:
            per_class, wall, out, load_s, detail, screened = _run_wgpu(
                model, dev, prompt, tokens, repeats, decode or "load", result.kv_cache)
            result.timing = detail["clock"]
    classes = {k: {"bytes": nbytes[k], "ms": per_class[k] * 1e3,
                   "gbps": nbytes[k] / per_class[k] / 1e9 if per_class[k] > 0 else 0.0}
               for k in CLASSES}
    bpt = sum(nbytes.values())
    ms = wall / tokens * 1e3
    if screened is not None:
        screened["bytes_per_token"] = bpt - nbytes["lm_head"] + screened["head_bytes"]
    return ContainerBench(fid, str(target), target.stat().st_size if target.is_file() else 0,
                          classes, bpt, ms, 1e3 / ms, bpt / ms / 1e6,
                          sum(c["ms"] for c in classes.values()), convert_s, load_s, out, detail,
                          decode, screened, compiles.count, compiles.seconds, compiles.timed)


# -- rendering ----------------------------------------------------------------------------------
def _mb(n: float) -> str:
    return f"{n / 1e6:,.3f}" if n < 1e8 else f"{n / 1e6:,.1f}"


def render(r: BenchResult) -> str:
    """A text table: per container, each class and the totals."""
    where = (f"one profiled step ({r.timing})" if r.backend == "wgpu"
             else "host timers around the backend's calls, the same steps run layer by layer")
    lines = [f"{Path(r.source).name} on {r.backend} ({r.device})",
             f"{r.prompt_tokens}-token prompt, {r.warmup_tokens} warm-up step, {r.tokens} timed "
             f"decode steps; class times: {where}; totals: host wall time per step; "
             f"KV cache {r.kv_cache}", "",
             f"{'container':<14}{'kernel class':<22}{'MB/token':>12}{'ms/token':>11}"
             f"{'GB/s':>9}{'tok/s':>10}{'load s':>9}"]
    for c in r.containers:
        for i, k in enumerate(CLASSES):
            d = c.classes[k]
            lines.append(f"{c.label if i == 0 else '':<14}{LABELS[k]:<22}{_mb(d['bytes']):>12}"
                         f"{d['ms']:>11.3f}{d['gbps']:>9.2f}")
        lines.append(f"{'':<14}{'total (wall)':<22}{_mb(c.bytes_per_token):>12}"
                     f"{c.ms_per_token:>11.3f}{c.gbps:>9.2f}{c.tokens_per_s:>10.1f}"
                     f"{c.load_s:>9.2f}")
        if c.compile_count:
            lines.append(f"{'':<14}compiled {c.compile_count} kernels in {c.compile_s:.1f} s "
                         "(first use on this machine; not in any figure here)")
        d = c.detail or {}
        if d.get("dispatches_per_token"):
            one = d.get("pass_seconds")
            lines.append(f"{'':<14}{d['dispatches_per_token']} dispatches a token, host "
                         f"{d['host_us_per_token']:,.0f} us a token recording and submitting"
                         + (f", GPU {one * 1e3:.3f} ms a step in one pass" if one else ""))
        sc = c.screened
        if sc:
            lines.append(f"{'':<14}{'screened LM head':<22}{_mb(sc['head_bytes']):>12}"
                         f"{sc['head_ms']:>11.3f}")
            lines.append(f"{'':<14}{'total, screened head':<22}{_mb(sc['bytes_per_token']):>12}"
                         f"{sc['ms_per_token']:>11.3f}"
                         f"{sc['bytes_per_token'] / sc['ms_per_token'] / 1e6:>9.2f}"
                         f"{sc['tokens_per_s']:>10.1f}   {sc['candidates_mean']:.1f} rows "
                         f"rescored/step{'' if sc['same_tokens'] else ', TOKENS DIFFER'}")
    groups = r.token_groups()
    why = r.disagreement()
    if why is not None:
        lines += ["", f"ERROR: {why}"]
    elif len(groups) > 1:
        lines += ["", f"tokens: {', '.join(c.label for c in groups[0])} decoded the same "
                  f"{r.tokens} tokens; {', '.join(c.label for g in groups[1:] for c in g)} "
                  "differ, as they may on wgpu (float32 block scales, docs/model.md §2)"]
    elif len(r.containers) > 1:
        lines += ["", f"tokens: all {len(r.containers)} runs decoded the same {r.tokens} tokens "
                  "(one arithmetic for every container)"]
    return "\n".join(lines)


def render_markdown(r: BenchResult) -> str:
    """One markdown table row per container (docs/benchmarks.md)."""
    head = ("| container | MB/token | ms/token (wall) | tok/s | GB/s | load s | "
            + " | ".join(f"{LABELS[k]}: ms (GB/s)" for k in CLASSES) + " |")
    rows = [head, "|" + "---|" * (6 + len(CLASSES))]
    def ms(v: float) -> str:
        return f"{v:,.0f}" if v >= 100 else f"{v:.1f}" if v >= 1 else f"{v:.3f}"

    for c in r.containers:
        cells = [f"{ms(c.classes[k]['ms'])} ({c.classes[k]['gbps']:.2f})" for k in CLASSES]
        rows.append(f"| {c.label} | {_mb(c.bytes_per_token)} | {ms(c.ms_per_token)} | "
                    f"{c.tokens_per_s:.3g} | {c.gbps:.2f} | {c.load_s:.2f} | "
                    + " | ".join(cells) + " |")
        sc = c.screened
        if sc:
            cells = ["" for _ in CLASSES]
            cells[CLASSES.index("lm_head")] = (f"{ms(sc['head_ms'])} "
                                               f"({sc['head_bytes'] / sc['head_ms'] / 1e6:.2f})")
            rows.append(f"| {c.label}, screened head | {_mb(sc['bytes_per_token'])} | "
                        f"{ms(sc['ms_per_token'])} | {sc['tokens_per_s']:.3g} | "
                        f"{sc['bytes_per_token'] / sc['ms_per_token'] / 1e6:.2f} | | "
                        + " | ".join(cells) + " |")
    return "\n".join(rows)


__all__ = ["BenchResult", "ContainerBench", "class_bytes",
           "parse_formats", "render", "render_markdown", "run_bench"]
