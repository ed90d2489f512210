"""Kernels compiled before anything is timed: hearing numba compile, and ``bitformat warmup``.

The cpu backend's kernels are numba functions compiled on their first call (about 20 s for a
model's set on a 2-core machine) and kept in numba's on-disk cache (``__pycache__`` beside the
package, or ``NUMBA_CACHE_DIR``), so later runs load them in well under a second. pip cannot
compile them at install time (numba compiles for the machine that runs them); instead
:func:`warm_up_all` runs a tiny synthetic model through every container once, which fills the
cache for every kernel a model can use here. :func:`on_compile` lets a caller show what the
first run's pause is.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..constants import DEFAULT_KV_TYPE


@contextlib.contextmanager
def on_compile(callback: Callable[[str], None],
               done: Callable[[str, float, float], None] | None = None) -> Iterator[None]:
    """Call ``callback(name)`` each time numba starts compiling a function inside the block,
    and ``done(name, seconds, own_seconds)`` when it ends (``own``: less the functions it
    compiled meanwhile, which numba compiles nested inside their first caller).

    ``name`` is ``module.function``. A function found in numba's on-disk cache is loaded, not
    compiled, and is not heard; so a second run hears nothing. (numba's event API, "numba:compile".)
    """
    from numba.core import event

    stack: list[list[float]] = []  # [start, seconds of nested compiles]

    def name_of(ev) -> str:
        fn = ev.data["dispatcher"].py_func
        return f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__qualname__}"

    class Heard(event.Listener):
        def on_start(self, ev) -> None:
            stack.append([time.perf_counter(), 0.0])
            callback(name_of(ev))

        def on_end(self, ev) -> None:
            if not stack:
                return
            t0, inner = stack.pop()
            took = time.perf_counter() - t0
            if stack:
                stack[-1][1] += took
            if done is not None:
                done(name_of(ev), took, took - inner)

    with event.install_listener("numba:compile", Heard()):
        yield


@dataclass
class WarmupStep:
    what: str  # the model variant run, e.g. "i2_s" or "hf (f32 embedding)"
    seconds: float
    compiled: int = 0  # functions numba compiled in this step (0: all were in its cache)


def _bf16_embedding_copy(src: Path, out: Path) -> None:
    """``src`` with its F16 embedding rounded to BF16 (the official checkpoint's type), whose LM
    head is a kernel of its own."""
    from ..constants import GGMLType
    from ..io.gguf import GGUFReader, GGUFWriter

    with GGUFReader(src) as r:
        w = GGUFWriter(str(out))
        w.metadata = dict(r.metadata)
        blobs = []
        for name, info in r.tensors.items():
            gtype, raw = info.ggml_type, r.raw(name)
            if name == "token_embd.weight":
                b = raw.view("<f2").astype(np.float32).view(np.uint32)
                raw, gtype = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype("<u2"), GGMLType.BF16
            w.add_tensor(name, info.shape, gtype, raw.nbytes)
            blobs.append(raw)
        w.write(iter(blobs))


#: the variants a second process runs in parallel on a machine with two or more cores, in
#: its order: the rANS encoder and fused decode first (kernels of their own), then the
#: decoded-at-load variant, whose kernels are mostly the first process's, cached on disk by
#: the time it gets there
SECOND = ("rans:fused", "rans")


def _variants() -> list[tuple[str, str]]:
    from ..formats import FORMAT_IDS

    return [(fid, fid) for fid in FORMAT_IDS] + [("hf", "hf (f32 embedding)"),
                                                ("bf16", "i2_s (bf16 embedding)"),
                                                ("rans:fused", "rans (fused decode)")]


def _run_variants(backend: str, names: list[str] | None,
                  progress: Callable[[str, int, int], None] | None,
                  done: Callable[[WarmupStep], None] | None = None,
                  batch: bool = True) -> list[WarmupStep]:
    """:meth:`~.loader.LoadedModel.warmup` of each variant ``names`` (default all, in their
    order); first, where ``batch``, the split attention and the batched step (the same kernels
    for every container) on the tiny model, its time counted in the first variant's."""
    from ..container import convert
    from ..synth import synth
    from .loader import load

    what_of = dict(_variants())
    variants = [(v, what_of[v]) for v in (names or what_of)]
    steps: list[WarmupStep] = []
    with tempfile.TemporaryDirectory(prefix="bitformat-warmup-") as tmp:
        d = Path(tmp)
        base = synth("tiny", d / "tiny.gguf")
        for i, (fid, what) in enumerate(variants):
            if progress is not None:
                progress(what, i, len(variants))
            t0 = time.perf_counter()
            fid, _, decode = fid.partition(":")  # rans twice: decoded at load, and fused
            path = base if fid == "i2_s" else d / f"tiny.{fid}"
            extra = {"decode": decode} if decode and backend != "numpy" else {}
            heard: list[str] = []
            with on_compile(heard.append):
                if batch and i == 0:  # kernels no variant's prompt and step compile
                    with load(base, backend=backend) as m:
                        m.warmup(parts=("long", "batch"))
                if fid == "bf16":
                    _bf16_embedding_copy(base, path)
                elif fid != "i2_s" and not path.exists():
                    convert(base, path, fid)
                with load(path, backend=backend, **extra) as m:
                    m.warmup(parts=("prompt", "step"))
            steps.append(WarmupStep(what, time.perf_counter() - t0, len(heard)))
            if done is not None:
                done(steps[-1])
    return steps


def warm_up_all(backend: str = "cpu",
                progress: Callable[[str, int, int], None] | None = None,
                processes: int | None = None) -> list[WarmupStep]:
    """Compile (or load from numba's cache) every kernel a model can use on this machine.

    Writes a tiny synthetic model in a temporary folder, converts it into every container (the
    rans encoder compiles too) and to an hf folder (an f32 embedding), adds a copy with a BF16
    embedding, and runs :meth:`~.loader.LoadedModel.warmup` on each on ``backend``.
    ``progress(what, index, total)`` is called before each step. With two or more cores
    (``processes``, default the CPU count, at most 2) a second process runs the rans variants
    (:data:`SECOND`), the split attention and the batched step meanwhile; numba's cache on
    disk holds what both compiled. Times: docs/benchmarks.md, "First run".
    """
    n = min(2, processes or os.cpu_count() or 1)
    helper = None
    if n > 1 and backend == "cpu":
        with contextlib.suppress(OSError):
            helper = subprocess.Popen([sys.executable, "-m", "bitformat.runtime.warmup",
                                       "--variants", ",".join(SECOND), backend],
                                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True)
    if helper is None:
        return _run_variants(backend, None, progress)
    from ..interrupts import CHILDREN

    CHILDREN.add(helper)
    try:
        mine = [v for v, _ in _variants() if v not in SECOND]
        steps = _run_variants(backend, mine, progress, batch=False)  # the helper's
        out, _ = helper.communicate()
        theirs = [WarmupStep(w, float(t), int(c)) for w, t, c in
                  (line.split("\t") for line in out.splitlines() if line.count("\t") == 2)]
        if helper.returncode != 0 or len(theirs) != len(SECOND):  # run them here instead
            theirs = _run_variants(backend, list(SECOND), progress)
    except BaseException:
        helper.kill()
        raise
    finally:
        CHILDREN.discard(helper)
    order = [w for _, w in _variants()]
    return sorted(steps + theirs, key=lambda s: order.index(s.what))


__all__ = ["LAYERS_READY", "WarmupStep", "finish_helper", "on_compile", "start_helper",
           "wait_for_layers", "warm_up_all"]


# -- a second process compiling beside the first (a cold kernel cache) ---------------------------
#: ``BITFORMAT_COMPILE_HELPER=0`` turns the helper off
ENV_HELPER = "BITFORMAT_COMPILE_HELPER"
TINY = {"bitnet-2b4t": "tiny", "bitnet-1bitllm": "tiny-1bitllm", "llama": "tiny-llama",
        "qwen3": "tiny-qwen3"}


def cache_is_cold() -> bool:
    """Whether numba's cache lacks the cpu backend's one-token attention kernel (then the
    first run compiles nearly everything)."""
    try:
        from .cpu import ops

        return not os.path.exists(ops.attend_one._cache._cache_file._index_path)
    except Exception:  # numba's internals moved: assume warm (no helper)
        return False


def start_helper(path: str | os.PathLike, backend: str,
                 kv_cache: str = DEFAULT_KV_TYPE) -> subprocess.Popen | None:
    """On a cold kernel cache, start a process that compiles the layer kernels of the model
    at ``path`` (its family and container) on a tiny synthetic model with the full head,
    while this one loads the real model and compiles its screened head: two cores compile at
    once. numba's cache is shared through the file system, so what the helper wrote this
    process then loads instead of compiling (for KV caches of type ``kv_cache``, whose
    kernels are their own). None where the cache is warm, the backend is not
    cpu, the file is not one it knows, or ``BITFORMAT_COMPILE_HELPER=0``."""
    if os.environ.get(ENV_HELPER, "1") in ("0", "") or backend != "cpu" or not cache_is_cold():
        return None
    try:
        from ..constants import GGMLType
        from ..container import open_model
        from ..families import family_of

        with open_model(path) as m:
            family = family_of({k: v.plain() for k, v in m.metadata.items()
                                if not k.startswith("tokenizer.")})
            container = m.container
            head = "output.weight" if any(e.name == "output.weight" for e in m.entries) \
                else "token_embd.weight"
            q2 = any(e.name == head and e.encoding == GGMLType.Q2_0.name.lower()
                     for e in m.entries)
    except Exception:  # anything unusual: no helper, the run compiles as before
        return None
    preset = TINY.get(family.id)
    if preset is None:
        return None
    cmd = [sys.executable, "-m", "bitformat.runtime.warmup", preset, container,
           "q2_0" if q2 else "f16", kv_cache]
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL)
    except OSError:
        return None
    from ..interrupts import CHILDREN

    CHILDREN.add(proc)  # a signal that ends this process ends the helper too
    return proc


#: what the helper prints once the kernels a first output needs are in the cache (the long-
#: context attention follows, at a lower priority)
LAYERS_READY = b"layers compiled"


def wait_for_layers(helper: subprocess.Popen | None, timeout: float = 600) -> None:
    """Wait until the helper has compiled the kernels of a prompt and a decode step (its
    line :data:`LAYERS_READY`), or has ended, or ``timeout`` seconds passed; the helper goes
    on with the long-context attention, which the run does not need before its first token
    (one-token attention runs on one thread, with the same bits, until that kernel is
    there: :attr:`.cpu.backend.CpuBackend.split_attention`)."""
    if helper is None or helper.stdout is None:
        return
    import select

    end = time.monotonic() + timeout
    fd = helper.stdout.fileno()
    seen = b""
    while LAYERS_READY not in seen:
        left = end - time.monotonic()
        if left <= 0:
            return
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            return
        chunk = os.read(fd, 256)
        if not chunk:  # the helper ended (done, or failed: this process compiles the rest)
            return
        seen = (seen + chunk)[-256:]


def finish_helper(helper: subprocess.Popen | None, timeout: float = 600) -> None:
    """Wait for the helper to end (ending it if it takes longer than ``timeout``)."""
    if helper is None:
        return
    from ..interrupts import CHILDREN

    try:
        helper.wait(timeout)
    except subprocess.TimeoutExpired:
        helper.kill()
        helper.wait()
    except BaseException:  # Ctrl-C while waiting: the helper goes too
        helper.kill()
        raise
    finally:
        CHILDREN.discard(helper)


def _helper_main(preset: str, container: str, embedding: str,
                 kv_cache: str = DEFAULT_KV_TYPE) -> None:
    """The helper's work: a tiny model of the preset in the container, its full-head warmup
    (splitting the one-token step off to the first process was slower: the two then compile
    many of the same helpers)."""
    from ..container import convert
    from ..synth import synth
    from .loader import load

    with tempfile.TemporaryDirectory(prefix="bitformat-helper-") as tmp:
        path = synth(preset, Path(tmp) / "tiny.gguf", embedding=embedding)
        if container not in ("i2_s", "none", "mixed"):
            try:
                convert(path, Path(tmp) / f"tiny.{container}.gguf", container)
                path = Path(tmp) / f"tiny.{container}.gguf"
            except Exception:  # a container the tiny model cannot take: i2_s's kernels then
                pass
        with load(path, backend="cpu", head="full", kv_cache=kv_cache) as m:
            # what the first process runs until this one ends: steps op by op (the one-call
            # step, compiled below, took half of the helper's time to a first output)
            ready = [False]
            m.backend.step_compiled = lambda: ready[0]
            m.warmup(parts=("prompt", "step"))
            sys.stdout.buffer.write(LAYERS_READY + b"\n")  # the first process may go on
            sys.stdout.flush()
            null = os.open(os.devnull, os.O_WRONLY)  # no one reads the pipe from here on
            os.dup2(null, 1)
            os.close(null)
            try:  # the rest at a lower priority: the first process is generating by now
                os.nice(10)
            except OSError:
                pass
            ready[0] = True  # the one-call step where the model has one
            m.warmup(parts=("step", "long"))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--variants"]:  # warm_up_all's second process: a line per step
        _run_variants(sys.argv[3], sys.argv[2].split(","), None,
                      lambda st: print(f"{st.what}\t{st.seconds}\t{st.compiled}", flush=True))
    else:
        _helper_main(*sys.argv[1:5])
