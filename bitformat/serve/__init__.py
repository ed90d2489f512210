"""``bitformat serve``: an OpenAI-compatible HTTP server over the batching engine.

:func:`serve` loads the model once, starts the :class:`~bitformat.runtime.engine.Engine`
thread, and runs the Starlette app (:mod:`.app`) under uvicorn until Ctrl-C or SIGTERM. On
either signal the server stops listening, every request still running or waiting ends (a
stream gets an error event, a waiting call a 503), and the port is released.

>>> serve("model.gguf", port=8000, ready=print)                    # doctest: +SKIP
"""

from __future__ import annotations

import os
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
          kv_cache: str = DEFAULT_KV_TYPE) -> None:
    """Serve ``path`` until a signal stops it. ``ready(info)`` is called once the port
    listens, with ``url``, ``model``, ``backend``, ``max_batch`` and ``context``;
    ``access_log(line)`` once per request that has ended (client, method and path, status,
    tokens in and out, milliseconds). ``kv_cache``: each request's KV cache type (f16, f32
    or q8_0, as :func:`~bitformat.runtime.load`).

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
        engine = Engine(model.net, model.tokenizer, max_batch=max_batch, context=context,
                        max_queue=max_queue).start()
        server = Server(engine, model.tokenizer, model_id(path), int(time.time()))
        config = uvicorn.Config(server.app(api_key, access_log), host=host, port=port,
                                log_level="warning",
                                access_log=False, lifespan="off", timeout_graceful_shutdown=5)
        info = {"model": server.model_id, "backend": backend, "max_batch": max_batch,
                "context": engine.context, "note": note}

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

