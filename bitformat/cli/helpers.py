"""What the commands show while they work, and checks of their options (used by ``main.py``).

Everything here writes to stderr, so a command's stdout stays its result (text or JSON).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from ..constants import DEFAULT_KV_TYPE


def cores() -> int:
    """CPU cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def check_threads(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
    """``--threads``: at least 1; more than the cores here is clamped, with a warning."""
    if value is None:
        return None
    if value < 1:
        raise click.BadParameter(f"{value} threads: give at least 1, or leave the option out for "
                                 "the adaptive default", ctx=ctx, param=param)
    n = cores()
    if value > n:
        click.echo(f"warning: --threads {value} is more than the {n} cores available here; "
                   f"using {n}", err=True)
        return n
    return value


def check_output(path: Path | None, what: str, suffixes: tuple[str, ...] = ()) -> None:
    """Refuse, before any work, an output path whose folder is missing or whose extension the
    writer does not produce (``suffixes``; empty: any)."""
    if path is None:
        return
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise click.BadParameter(f"folder {str(parent)!r} does not exist (create it first)",
                                 param_hint=what)
    if path.is_dir():
        raise click.BadParameter(f"{str(path)!r} is a folder; give a file name", param_hint=what)
    if suffixes and path.suffix.lower() not in suffixes:
        raise click.BadParameter(f"{path.name!r}: the file type comes from the extension; use "
                                 f"one of {', '.join(suffixes)}", param_hint=what)


def quantized_line(quantized: dict[str, tuple[str, str]]) -> str:
    """'quantized 210 tensors from F32 to ternary (...)': what a conversion of float weights did."""
    from ..quantize import ABSMEAN, TERNARY_VALUES

    types = " and ".join(sorted({t for t, _ in quantized.values()}))
    rules = Counter(r for _, r in quantized.values())
    how = []
    if rules[TERNARY_VALUES]:
        how.append(f"{rules[TERNARY_VALUES]} held only 0 and +-a: kept as bitnet.cpp's "
                   "quantize_i2_s reads them")
    if rules[ABSMEAN]:
        how.append(f"{rules[ABSMEAN]} by absmean, as transformers and bitnet.cpp's converter")
    return f"quantized {len(quantized)} tensors from {types} to ternary ({'; '.join(how)})"


class LayerBar:
    """``load(progress=...)``: a bar over the model's layers on a terminal, and one line first
    when the model is large enough for loading to take a while."""

    LARGE = 256 << 20

    def __init__(self, path: Path, backend: str):
        from tqdm import tqdm

        size = _size(path)
        if size >= self.LARGE:
            click.echo(f"loading {path} ({size / 1e9:.2f} GB) on {backend}...", err=True)
        self.bar = tqdm(desc="loading", unit="layer", leave=False, file=sys.stderr,
                        disable=not sys.stderr.isatty())

    def __call__(self, layer: int, n_layers: int) -> None:
        self.bar.total = n_layers
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    return path.stat().st_size


class CompileNotice:
    """Says what the first run's pause is: a line when numba starts compiling, a bar of the
    kernels compiled so far (on a terminal, refreshed twice a second), a summary at the end."""

    def __init__(self, after: str = ""):
        self.after = after  # appended to the summary line
        self.count = 0
        self.t0 = 0.0
        self.bar = None
        self._stop = threading.Event()
        #: name -> (seconds, own seconds) of each compiled function; written as JSON to the file
        #: ``BITFORMAT_COMPILE_LOG`` names when the notice closes (tools/bench_cold_start.py)
        self.times: dict[str, tuple[float, float]] = {}

    def done(self, name: str, seconds: float, own: float) -> None:
        old = self.times.get(name, (0.0, 0.0))
        self.times[name] = (old[0] + seconds, old[1] + own)

    def __call__(self, name: str) -> None:
        if self.count == 0:
            from tqdm import tqdm

            click.echo("compiling kernels for this machine (first run only: numba caches them; "
                       "`bitformat warmup` compiles every one ahead)...", err=True)
            self.t0 = time.perf_counter()
            self.bar = tqdm(leave=False, file=sys.stderr,
                            bar_format="compiling kernel {n}: {desc} [{elapsed}]",
                            disable=not sys.stderr.isatty())
            if not self.bar.disable:  # LLVM releases the GIL: keep the clock moving
                threading.Thread(target=self._tick, daemon=True).start()
        self.count += 1
        self.bar.update(1)
        self.bar.set_description_str(name, refresh=True)

    def _tick(self) -> None:
        while not self._stop.wait(0.5):
            self.bar.refresh()

    def close(self) -> None:
        self._stop.set()
        log = os.environ.get("BITFORMAT_COMPILE_LOG")
        if log:
            with open(log, "w") as f:
                json.dump({"count": self.count, "seconds": time.perf_counter() - self.t0
                           if self.count else 0.0, "functions": self.times}, f, indent=1)
        if self.bar is not None:
            self.bar.close()
            click.echo(f"compiled {self.count} kernels in {time.perf_counter() - self.t0:.1f} s"
                       f"{self.after}", err=True)


@contextlib.contextmanager
def ready_model(file: Path, backend: str, i2s_layout: str, threads: int | None,
                decode: str = "load", head: str = "auto",
                kv_cache: str = DEFAULT_KV_TYPE) -> Iterator[Any]:
    """``load`` with a bar over the layers, the synthetic-model note, and the kernels compiled
    (or read from numba's cache) before anything is timed, saying so when they compile."""
    from ..guide import is_synthetic, synthetic_note
    from ..runtime import load
    from ..runtime.warmup import finish_helper, on_compile, start_helper, wait_for_layers

    notice = CompileNotice(" (not counted in the speeds reported)")
    # a cold kernel cache: a second process compiles the layer kernels meanwhile
    helper = start_helper(file, backend, kv_cache)
    bar = LayerBar(file, backend)
    try:
        try:
            with on_compile(notice, notice.done):  # validating rans streams compiles the
                model = load(file, backend=backend, i2s_variant=i2s_layout, progress=bar,
                             head=head, kv_cache=kv_cache,
                             **({"threads": threads} if backend == "cpu" else {}),
                             **({"decode": decode} if backend != "numpy" else {}))
        finally:
            bar.close()
        with model:
            if is_synthetic(model.container_model.metadata):
                click.echo(synthetic_note(str(file)), err=True)
            try:
                with on_compile(notice, notice.done):
                    if helper is None:  # (a server warms its batched step itself)
                        model.warmup(parts=("prompt", "step", "long"))
                    else:  # the screened head here, the layers there
                        # steps op by op until the helper ends (it compiles the one-call step
                        # and the long-context attention after the layers)
                        model.backend.step_compiled = lambda p=helper: p.poll() is not None
                        model.prepare_head()
                        wait_for_layers(helper)
                        # on an empty cache the helper compiled the layers; it compiles the
                        # long-context attention while this one generates
                        model.warmup(parts=("prompt", "step"))
            finally:
                notice.close()
            yield model
            if helper is not None:  # let it finish filling the kernel cache
                waits, t0 = helper.poll() is None, time.perf_counter()
                if waits:
                    click.echo("finishing the kernel cache for later runs (the one-call decode "
                               "step, long-context attention; Ctrl-C leaves the rest to the "
                               "next run)...", err=True, nl=False)
                    # the attention here, the one-call step there: both cores compile
                    model.warmup(parts=("long",))
                finish_helper(helper)
                helper = None
                if waits:
                    click.echo(f" {time.perf_counter() - t0:.1f} s", err=True)
    finally:
        if helper is not None and helper.poll() is None:  # interrupted: the helper goes too
            helper.kill()
