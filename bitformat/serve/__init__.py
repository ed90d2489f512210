"""``bitformat serve``: an OpenAI-compatible HTTP server over the batching engine.

:func:`serve` loads the model once, starts the :class:`~bitformat.runtime.engine.Engine`
thread, and runs the Starlette app (:mod:`.app`) under uvicorn until Ctrl-C or SIGTERM. On
either signal the server stops listening, every request still running or waiting ends (a
stream gets an error event, a waiting call a 503), and the port is released.

>>> serve("model.gguf", port=8000, ready=print)                    # doctest: +SKIP
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..constants import DEFAULT_KV_TYPE
from ..errors import RequestError

__all__ = ["serve"]


def model_id(path: str | os.PathLike) -> str:
    """The id clients name the model by: the file (or folder) name without ``.gguf``."""
    name = Path(path).name
    return name[:-5] if name.endswith(".gguf") else name


def serve(path: str | os.PathLike, *, host: str = "127.0.0.1", port: int = 8000,
          backend: str = "cpu", api_key: str | None = None, max_batch: int = 8,
          context: int | None = None, max_queue: int = 64, threads: int | None = None,
          i2s_variant: str = "x86", ready: Callable[[dict], None] | None = None,
          access_log: Callable[[str], None] | None = None,
          kv_cache: str = DEFAULT_KV_TYPE, cache_memory: str = "auto") -> None:
    """Serve ``path`` until a signal stops it. ``ready(info)`` is called once the port
    listens, with ``url``, ``model``, ``backend``, ``max_batch`` and ``context``;
    ``access_log(line)`` once per request that has ended (client, method and path, status,
    tokens in and out, milliseconds). ``kv_cache``: each request's KV cache type (f16, f32
    or q8_0, as :func:`~bitformat.runtime.load`). ``cache_memory``: the memory all requests'
    KV caches may take together, as :func:`cache_pool` reads it; requests wait until theirs
    fits (``info["cache_positions"]``).

    The wgpu network holds one sequence at a time, so on ``wgpu`` requests run one after
    another (``max_batch`` 1; ``info["note"]`` says so).
    """
    import uvicorn

    from ..runtime import load
    from ..runtime.engine import Engine
    from .app import Server

    if max_batch < 1:
        raise RequestError(f"--max-batch must be >= 1, got {max_batch}")
    if context is not None and context < 2:
        raise RequestError(f"--context must be >= 2, got {context}")
    note = None
    if backend == "wgpu" and max_batch > 1:
        max_batch, note = 1, "the wgpu backend runs one sequence at a time: requests are " \
                             "served one after another (max batch 1)"
    kwargs: dict[str, Any] = {"threads": threads} if backend == "cpu" else {}
    model = load(path, backend=backend, i2s_variant=i2s_variant, kv_cache=kv_cache, **kwargs)
    try:
        ctx = min(context or model.args.context_length, model.args.context_length)
        from ..runtime.kvquant import position_bytes

        per = position_bytes(model.args, kv_cache)
        pool = None if backend == "wgpu" else cache_pool(cache_memory, per, max_batch * ctx)
        engine = Engine(model.net, model.tokenizer, max_batch=max_batch, context=context,
                        max_queue=max_queue, cache_positions=pool).start()
        server = Server(engine, model.tokenizer, model_id(path), int(time.time()))
        config = uvicorn.Config(server.app(api_key, access_log), host=host, port=port,
                                log_level="warning",
                                access_log=False, lifespan="off", timeout_graceful_shutdown=5)
        info = {"model": server.model_id, "backend": backend, "max_batch": max_batch,
                "context": engine.context, "note": note, "kv_cache": kv_cache,
                "cache_positions": pool, "cache_bytes": None if pool is None else pool * per}

        class Uvicorn(uvicorn.Server):
            """Ends the engine's requests as soon as a signal arrives (uvicorn's own shutdown
            would wait for every open stream to finish) and reports when it listens."""

            def handle_exit(self, sig, frame) -> None:
                # uvicorn's, less raising the signal again after the shutdown (which would
                # kill the process before the model is closed and the CLI says "stopped")
                if self.should_exit and sig == signal.SIGINT:
                    self.force_exit = True  # a second Ctrl-C: stop waiting for connections
                self.should_exit = True
                engine.close(timeout=0)  # open streams get their last event and end

            async def startup(self, sockets=None) -> None:
                await super().startup(sockets)
                if self.started and ready is not None:
                    host, port = self.servers[0].sockets[0].getsockname()[:2]
                    host = f"[{host}]" if ":" in host else host
                    ready({**info, "url": f"http://{host}:{port}"})

        Uvicorn(config).run()
        engine.close()
    finally:
        model.close()


_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 1 << 10, "m": 1e6, "mb": 1e6,
          "mib": 1 << 20, "g": 1e9, "gb": 1e9, "gib": 1 << 30, "t": 1e12, "tb": 1e12,
          "tib": 1 << 40}
#: the share of the memory available at start that ``--cache-memory auto`` gives the caches
AUTO_SHARE = 0.8


def parse_size(text: str) -> int:
    """Bytes of a size such as ``2GiB``, ``1.5GB``, ``512M`` or ``1000000``."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise RequestError(f"{text!r:.30} is not a size: write a number of bytes with a unit "
                           "such as 2GiB, 1.5GB or 512MiB, or auto")
    return int(float(m.group(1)) * _UNITS[unit])


def memory_available() -> int | None:
    """Bytes the kernel says can be taken without swapping (``MemAvailable``), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cache_pool(cache_memory: str, bytes_per_position: int, most: int) -> int:
    """KV cache positions the server's requests may hold together: ``cache_memory`` bytes
    (:func:`parse_size`) or, for "auto", :data:`AUTO_SHARE` of the memory available now,
    at most ``most`` (every request at the full context)."""
    if cache_memory.strip().lower() == "auto":
        free = memory_available()
        if free is None:
            return most
        budget = int(free * AUTO_SHARE)
    else:
        budget = parse_size(cache_memory)
    positions = min(most, budget // bytes_per_position)
    if positions < 2:
        raise RequestError(f"a KV cache of {budget:,} bytes holds {positions} positions of "
                           f"{bytes_per_position:,} bytes: give --cache-memory more")
    return positions
