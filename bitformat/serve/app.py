"""The HTTP layer: a Starlette app that turns OpenAI-style requests into engine requests.

Routes: ``GET /health``, ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/completions``
and ``POST /v1/chat/completions``. The model runs in the engine's thread
(:class:`~bitformat.runtime.engine.Engine`); the event loop only parses, queues and writes,
so ``/health`` answers while a batch computes. Each request's events cross from the engine
thread into its own ``asyncio.Queue``. A client that goes away (mid-stream, or while waiting
for a whole answer) cancels its request, which frees its slot at the next step.

Errors are OpenAI's JSON (``{"error": {"message", "type", "param", "code"}}``): 400 for a
request that cannot be served, 401 for a missing or wrong API key, 404 for an unknown route
or model, 405 for a wrong method, 413 for a body over ``MAX_BODY``, 503 while the queue is
full or the server is stopping. CORS is open (any origin), as llama.cpp's server does, so a
chat UI served from elsewhere can call it from a browser; the API key still applies.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import BitformatError, RequestError, UnavailableError
from ..runtime.engine import Engine, Event
from ..runtime.engine import Request as EngineRequest
from . import protocol as P

log = logging.getLogger("bitformat.serve")

MAX_BODY = 8 << 20  # bytes of one request body


def error(status: int, message: str, type_: str = "invalid_request_error",
          code: str | None = None, param: str | None = None) -> JSONResponse:
    return JSONResponse(P.error_body(message, type_, code, param), status_code=status)


def _from_exc(exc: BitformatError) -> JSONResponse:
    if isinstance(exc, UnavailableError):
        return error(503, str(exc), "server_error", "unavailable")
    if isinstance(exc, RequestError):
        return error(400, str(exc))
    return error(500, str(exc), "server_error")


class _BodyTooLarge(Exception):
    pass


async def _read_json(request: Request) -> Any:
    size = int(request.headers.get("content-length") or 0)
    if size > MAX_BODY:
        raise _BodyTooLarge
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise _BodyTooLarge
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}") from None


def _sse(obj: Any) -> bytes:
    text = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False,
                                                       separators=(",", ":"))
    return f"data: {text}\n\n".encode()


class _Auth:
    """ASGI middleware: with a key, every route but ``/health`` needs ``Authorization: Bearer
    KEY``. Compared in constant time."""

    def __init__(self, app: Any, key: str | None):
        self.app, self.key = app, key.encode() if key else None

    async def __call__(self, scope, receive, send) -> None:
        if self.key is None or scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
            msg = ("Incorrect API key provided." if given else
                   "No API key provided: send 'Authorization: Bearer KEY'.")
            return await error(401, msg, code="invalid_api_key")(scope, receive, send)
        return await self.app(scope, receive, send)


class _AccessLog:
    """ASGI middleware: one line per request on stderr once its response has ended: client,
    method and path, status, prompt and completion tokens (generation routes), milliseconds.
    The handlers put the token counts in the scope (``bitformat.tokens``)."""

    def __init__(self, app: Any, write: Callable[[str], None]):
        self.app, self.write = app, write

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = [0]

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            client = scope.get("client") or ("-", 0)
            tokens = scope.get("bitformat.tokens")
            words = f" in={tokens[0]} out={tokens[1]}" if tokens else ""
            self.write(f'{client[0]} "{scope["method"]} {scope["path"]}" '
                       f"{status[0] or 499}{words} "
                       f"{(time.perf_counter() - t0) * 1e3:.0f} ms")


class Server:
    """The routes over one engine and one model id."""

    def __init__(self, engine: Engine, tokenizer: Any, model_id: str, created: int):
        self.engine, self.tokenizer = engine, tokenizer
        self.model_id, self.created = model_id, created
        self.loop: asyncio.AbstractEventLoop | None = None
        #: the events of the step running now, (queue, event), handed on by wait_for_loop
        self._pending: list[tuple[asyncio.Queue, Event]] = []
        engine.after_step = self.wait_for_loop

    def wait_for_loop(self, timeout: float = 0.05) -> None:
        """Called by the engine thread after each step: hands the step's events to the event
        loop in one call and returns once the loop has run the tasks they woke (their chunks
        are written), or after ``timeout``.

        Without the wait the loop's work for a step interleaves with the next step: each time
        it needs the GIL it waits for the engine to pause, and on two busy cores it can then
        lose its core while holding the GIL, stalling the engine for a time slice. Handing the
        events on one by one as the step made them woke the loop while the engine still
        decoded text for the other requests, and the two took turns at the GIL."""
        pending, self._pending = self._pending, []
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        done = threading.Event()

        def hand_on() -> None:  # the loop; call_soon: runs after the tasks these events wake
            for queue, ev in pending:
                queue.put_nowait(ev)
            loop.call_soon(done.set)

        try:
            loop.call_soon_threadsafe(hand_on)
        except RuntimeError:
            return
        done.wait(timeout)

    def app(self, api_key: str | None = None,
            access_log: Callable[[str], None] | None = None) -> Any:
        """The ASGI app; ``access_log(line)`` hears one line per request where given."""
        routes = [Route("/health", self.health, methods=["GET"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat, methods=["POST"])]

        async def http_error(request: Request, exc: HTTPException) -> Response:
            if exc.status_code == 404:
                return error(404, f"Unknown request URL: {request.method} {request.url.path}",
                             code="unknown_url")
            return error(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}")

        async def crash(request: Request, exc: Exception) -> Response:  # a bug, not an input
            log.exception("unexpected error")
            return error(500, f"internal error: {type(exc).__name__}", "server_error")

        app = Starlette(routes=routes, exception_handlers={HTTPException: http_error,
                                                           Exception: crash})
        # browser chat UIs on another origin ask first (CORS preflight, without the key)
        out = CORSMiddleware(_Auth(app, api_key), allow_origins=["*"], allow_methods=["*"],
                             allow_headers=["*"])
        return _AccessLog(out, access_log) if access_log is not None else out

    # -- plain routes -----------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", **self.engine.load})

    def _card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created,
                "owned_by": "bitformat"}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model(self, request: Request) -> Response:
        if request.path_params["model"] != self.model_id:
            return self._no_model(request.path_params["model"])
        return JSONResponse(self._card())

    def _no_model(self, name: str) -> Response:
        return error(404, f"The model '{name}' does not exist; this server has "
                     f"'{self.model_id}'.", code="model_not_found", param="model")

    # -- generation -------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        try:
            body = await _read_json(request)
            p = (P.parse_chat if chat else P.parse_completion)(body, self.tokenizer)
            if p.model is not None and p.model != self.model_id:
                return self._no_model(p.model)
            loop, events = asyncio.get_running_loop(), asyncio.Queue()
            self.loop = loop

            def on_event(ev: Event) -> None:  # the engine thread
                if self.engine.stepping:  # handed on with the step's others (wait_for_loop)
                    self._pending.append((events, ev))
                    return
                try:
                    loop.call_soon_threadsafe(events.put_nowait, ev)
                except RuntimeError:  # the loop has closed: nobody is listening
                    pass

            room = self.engine.context - len(p.prompt)
            if p.max_tokens is not None and p.max_tokens > room:
                return error(400, f"max_tokens is {p.max_tokens}, but the prompt holds "
                                  f"{len(p.prompt)} of the context's {self.engine.context} "
                                  f"tokens, which leaves {max(room, 0)}: ask for at most "
                                  f"{max(room, 0)} (or start the server with a larger "
                                  "--context)", param="max_tokens",
                             code="context_length_exceeded")
            limit = p.max_tokens if p.max_tokens is not None else self.engine.context
            req = EngineRequest(p.prompt, limit, p.sampling, p.stop,
                                [] if p.ignore_eos else None)
            handle = self.engine.submit(req, on_event)
        except _BodyTooLarge:
            return error(413, f"the request body is larger than {MAX_BODY} bytes")
        except BitformatError as exc:
            return _from_exc(exc)
        shape = P.Shape(chat, self.model_id)
        if p.stream:
            return StreamingResponse(self._stream(shape, p, handle, events, request.scope),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"})
        return await self._whole(request, shape, p, handle, events)

    async def _whole(self, request: Request, shape: P.Shape, p: P.Params, handle,
                     events: asyncio.Queue) -> Response:
        """Wait for the whole answer, cancelling it if the client goes away meanwhile."""
        gone = asyncio.ensure_future(_disconnected(request))
        text, ids = [], []
        try:
            while True:
                get = asyncio.ensure_future(events.get())
                await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    handle.cancel()
                    return Response(status_code=499)  # nobody reads it
                ev: Event = get.result()
                if ev.error is not None:
                    return _from_exc(ev.error)
                text.append(ev.text)
                if ev.token is not None:
                    ids.append(ev.token)
                if ev.finish_reason:
                    request.scope["bitformat.tokens"] = (ev.prompt_tokens,
                                                         ev.completion_tokens)
                    return JSONResponse(shape.whole(
                        "".join(text), ev.finish_reason, ev.prompt_tokens,
                        ev.completion_tokens, ids if p.return_token_ids else None))
        finally:
            gone.cancel()
            handle.cancel()  # no-op when finished; frees the slot when this task is cancelled

    async def _stream(self, shape: P.Shape, p: P.Params, handle,
                      events: asyncio.Queue, scope: dict) -> AsyncIterator[bytes]:
        """Server-sent events in OpenAI's chunk format; runs until the finish or an error, and
        is cancelled by Starlette when the client disconnects."""
        usage = p.include_usage
        try:
            if shape.chat:
                yield _sse(shape.chunk(None, role=True, with_usage=usage))
            while True:
                ev: Event = await events.get()
                if ev.error is not None:
                    status = 503 if isinstance(ev.error, UnavailableError) else 500
                    yield _sse(P.error_body(str(ev.error), "server_error",
                                            "unavailable" if status == 503 else None))
                    return
                ids = ([] if ev.token is None else [ev.token]) if p.return_token_ids else None
                if ev.text or ids:
                    yield _sse(shape.chunk(ev.text, token_ids=ids, with_usage=usage))
                if ev.finish_reason:
                    scope["bitformat.tokens"] = (ev.prompt_tokens, ev.completion_tokens)
                    yield _sse(shape.chunk(None, ev.finish_reason, with_usage=usage))
                    if usage:
                        yield _sse(shape.usage_chunk(ev.prompt_tokens, ev.completion_tokens))
                    yield _sse("[DONE]")
                    return
        finally:
            handle.cancel()


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
