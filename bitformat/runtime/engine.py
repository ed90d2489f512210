"""Continuous batching: the requests in flight share every pass over the weights.

Decoding is memory-bound: a step reads the whole model to make one token. The :class:`Engine`
owns the model in a thread of its own and runs a loop of steps; each step is one call of
``model.decode`` over one segment per active request (its last token, or the next chunk of its
prompt), so one read of the weights makes a token for every request. A new request joins at
the next step, a finished or cancelled one leaves, and at most ``max_batch`` run at once; the
rest wait in a bounded queue.

A request's tokens are those ``bitformat run`` gives for the same prompt and sampling options
(:func:`.generate.generate_step`): every row is quantized on its own, attention reads each
request's own cache, prompts are cut at the same multiples of ``PREFILL_CHUNK``, and the
sampler's noise is a function of (seed, step). What else is in the batch changes only when a
token comes, not which.

KV caches grow with use (:meth:`.models.base.KVCache.reserve`), and with ``cache_positions``
the engine keeps one pool of positions for all requests: a request is admitted when its
positions (prompt + its token limit) fit beside those of the requests running, waits in the
queue otherwise, and gives them back when it ends or is cancelled (its client left). A request
larger than the whole pool is refused at once.

Prompt chunks are the only long rows: while any request is generating, per step at most
``PREFILL_CHUNK`` prompt tokens run beside the decode rows (the oldest request's chunk first),
so a long prompt delays the others by about one chunk's time per step instead of its whole
prefill. While every request is still in its prompt (a burst of new requests), nobody waits
for a token, and each one's next chunk runs in the same pass over the weights.

>>> eng = Engine(model.net, model.tokenizer).start()               # doctest: +SKIP
>>> h = eng.submit(Request(ids, max_tokens=16), on_event=print)     # doctest: +SKIP
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import BitformatError, RequestError, UnavailableError
from .generate import PREFILL_CHUNK
from .models import Segment
from .sampling import Sampler, SamplingParams
from .textstream import TextStream

log = logging.getLogger("bitformat.engine")

#: seconds an idle engine waits, once a request comes, for others sent with it (up to
#: ``max_batch``) so that their prompts run in one step: clients that start together otherwise
#: see the first prompt run alone and the rest one step later (8 clients of 2B-4T: one step
#: of about 0.1 s more for all of them)
GATHER_S = 0.015


@dataclass
class Request:
    """What to generate: prompt token ids, a token limit, sampling, stop strings and tokens
    (``stop_ids`` None: the tokenizer's end-of-turn ids)."""

    prompt: Sequence[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: Sequence[str] = ()
    stop_ids: Sequence[int] | None = None


@dataclass
class Event:
    """What a request's owner hears after each step that concerns it.

    ``text`` is new text (may be ""), ``token`` the token of this step that belongs to the
    answer (None for a stop token or an error), ``completion_tokens`` the tokens generated so
    far (a stop token included), ``finish_reason`` None until the last event: "stop" or
    "length"; "error" with ``error`` set when the request cannot go on (the server is stopping,
    or a failure).
    """

    text: str
    token: int | None
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    error: BitformatError | None = None


class Handle:
    """A submitted request: ``cancel()`` it to stop its generation and free its slot."""

    def __init__(self, engine: Engine, request: Request, on_event: Callable[[Event], None],
                 rid: int):
        self.engine, self.request, self.on_event, self.id = engine, request, on_event, rid
        self.cancelled = False

    def cancel(self) -> None:
        self.engine._cancel(self)


class _Slot:
    """An active request: its cache, sampler, text and progress."""

    def __init__(self, handle: Handle, net: Any, tokenizer: Any, context: int):
        r = handle.request
        self.handle = handle
        self.prompt = list(r.prompt)
        self.max_new = min(r.max_tokens, context - len(self.prompt))
        self.positions = len(self.prompt) + self.max_new  # what the pool holds for it
        self.cache = net.new_cache(self.positions)
        self.sampler = Sampler(r.sampling, history=self.prompt)
        stop_ids = r.stop_ids if r.stop_ids is not None else (
            tokenizer.eos_ids if tokenizer is not None else ())
        self.text = TextStream(tokenizer, stop_ids=stop_ids, stop=r.stop)
        self.done = 0  # prompt tokens in the cache
        self.generated = 0
        self.last: int | None = None

    def emit(self, text: str, token: int | None, reason: str | None,
             error: BitformatError | None = None) -> None:
        _emit(self.handle, Event(text, token, reason, len(self.prompt), self.generated, error))


def _emit(handle: Handle, event: Event) -> None:
    try:
        handle.on_event(event)
    except Exception:  # a listener's failure must not stop the engine
        log.exception("request %d: event listener failed", handle.id)


def _as_error(exc: Exception) -> BitformatError:
    if isinstance(exc, BitformatError):
        return exc
    return BitformatError(f"the model failed: {type(exc).__name__}: {exc}")


def _fail(handle: Handle, error: BitformatError) -> None:
    """End a request that never got a slot."""
    _emit(handle, Event("", None, "error", len(handle.request.prompt), 0, error))


class Engine:
    """Runs requests on ``net`` (``decode(segments, samplers)``, ``new_cache(n)``) in batches.

    ``context`` caps prompt + generated tokens of each request (default: the model's);
    ``max_batch`` requests run at once, ``max_queue`` more may wait (beyond that
    :meth:`submit` raises :class:`~bitformat.errors.UnavailableError`); ``gather``: seconds an
    idle engine waits for more requests after the first (:data:`GATHER_S`).
    ``cache_positions``: the KV cache positions all running requests may hold together (None:
    no limit but ``max_batch`` x ``context``).
    """

    def __init__(self, net: Any, tokenizer: Any = None, *, max_batch: int = 8,
                 context: int | None = None, max_queue: int = 64,
                 after_step: Callable[[], None] | None = None, gather: float = GATHER_S,
                 cache_positions: int | None = None):
        if max_batch < 1 or max_queue < 0:
            raise RequestError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch} "
                               f"and {max_queue}")
        if cache_positions is not None and cache_positions < 2:
            raise RequestError(f"the KV cache pool must hold at least 2 positions, got "
                               f"{cache_positions}")
        self.cache_positions = cache_positions
        self._reserved = 0  # positions the running requests hold in the pool
        self.net, self.tokenizer = net, tokenizer
        self.max_batch, self.max_queue = max_batch, max_queue
        self.gather = gather if max_batch > 1 else 0.0
        model_ctx = net.args.context_length
        if context is not None and context > model_ctx:
            raise RequestError(f"--context {context} is more than the model's context length "
                               f"of {model_ctx} (the positions it was trained on)")
        self.context = context or model_ctx
        self.vocab = net.args.vocab_size
        self._cv = threading.Condition()
        self._waiting: collections.deque[Handle] = collections.deque()
        self._active: list[_Slot] = []
        self._closing = False
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        #: called in the engine thread after each step's events (a server hands them to its
        #: event loop there, together, and waits until it has written them: serve/app.py)
        self.after_step = after_step
        #: True while a step makes its events (in the engine thread): a listener may keep
        #: them until ``after_step``
        self.stepping = False
        self.steps = 0  # forward passes run
        self.tokens = 0  # tokens generated

    # -- the owner's side (any thread) -------------------------------------------------------
    def start(self, warmup: bool = True) -> Engine:
        """Start the engine thread; with ``warmup`` run one small batch there first (compiles
        and pages in what a step needs) and return once it is done."""
        ready = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(warmup, ready),
                                        name="bitformat-engine", daemon=True)
        self._thread.start()
        ready.wait()
        return self

    def check(self, request: Request) -> None:
        """Raise :class:`RequestError` if ``request`` cannot run here (empty, too long, ...)."""
        n = len(request.prompt)
        if n == 0:
            raise RequestError("the prompt is empty")
        if n >= self.context:
            raise RequestError(f"the prompt has {n} tokens but the context holds {self.context}"
                               ": no room to generate")
        bad = [t for t in request.prompt if not 0 <= t < self.vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary "
                               f"(0..{self.vocab - 1})")
        if request.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {request.max_tokens}")
        need = self.positions(request)
        if self.cache_positions is not None and need > self.cache_positions:
            raise RequestError(
                f"the request needs {need} positions of KV cache ({n} of prompt and up to "
                f"{need - n} tokens) but this server's cache holds {self.cache_positions} in "
                "all: ask for fewer tokens (max_tokens) or a shorter prompt")

    def positions(self, request: Request) -> int:
        """The KV cache positions ``request`` may fill: its prompt and its token limit."""
        n = len(request.prompt)
        return n + min(request.max_tokens, self.context - n)

    def _pool_left(self) -> int:
        """Positions of the pool neither running nor waiting requests hold (call with the
        lock held)."""
        assert self.cache_positions is not None
        return (self.cache_positions - self._reserved
                - sum(self.positions(h.request) for h in self._waiting))

    def submit(self, request: Request, on_event: Callable[[Event], None]) -> Handle:
        """Queue ``request``; ``on_event`` is called from the engine thread for each step's
        result (it must be quick: hand the event to another thread or loop)."""
        self.check(request)
        with self._cv:
            if self._closing or self._thread is None or not self._thread.is_alive():
                raise UnavailableError("the server is shutting down")
            if len(self._waiting) + len(self._active) >= self.max_batch + self.max_queue:
                raise UnavailableError(f"the server is busy: {len(self._active)} requests "
                                       f"running and {len(self._waiting)} waiting; try again")
            if (self.cache_positions is not None and len(self._waiting) >= self.max_queue
                    and self._pool_left() < self.positions(request)):
                raise UnavailableError(
                    f"the server's KV cache is full: {self._reserved} of its "
                    f"{self.cache_positions} positions held by {len(self._active)} requests; "
                    "try again")
            h = Handle(self, request, on_event, next(self._ids))
            self._waiting.append(h)
            self._cv.notify()
        return h

    def _cancel(self, handle: Handle) -> None:
        with self._cv:
            handle.cancelled = True
            try:
                self._waiting.remove(handle)
            except ValueError:
                pass
            self._cv.notify()

    def close(self, timeout: float | None = None) -> None:
        """Stop: every request still running or waiting gets an "error" event, the thread
        ends after its current step."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def load(self) -> dict[str, int]:
        with self._cv:
            return {"running": len(self._active), "waiting": len(self._waiting),
                    "max_batch": self.max_batch, "steps": self.steps,
                    "generated_tokens": self.tokens, "cache_positions": self.cache_positions,
                    "cache_positions_held": self._reserved}

    # -- the engine thread ---------------------------------------------------------------------
    def _main(self, warmup: bool, ready: threading.Event) -> None:
        try:
            if warmup:
                self._warmup()
        finally:
            ready.set()
        while True:
            with self._cv:
                idle = not self._active
                while not self._closing and not self._waiting and not self._active:
                    self._cv.wait()
                if idle and self.gather > 0:  # from idle to busy: let a burst arrive
                    end = time.monotonic() + self.gather
                    while (not self._closing and len(self._waiting) < self.max_batch
                           and (left := end - time.monotonic()) > 0):
                        self._cv.wait(left)
                if self._closing:
                    break
                while self._waiting and len(self._active) < self.max_batch:
                    h = self._waiting[0]
                    if (self.cache_positions is not None and self._active
                            and self._reserved + self.positions(h.request)
                            > self.cache_positions):
                        break  # waits, in order, for running requests to free positions
                    self._waiting.popleft()
                    try:
                        slot = _Slot(h, self.net, self.tokenizer, self.context)
                    except Exception as exc:  # e.g. a GPU cache that cannot be that long
                        _fail(h, _as_error(exc))
                        continue
                    self._active.append(slot)
                    self._reserved += slot.positions
                self._drop([s for s in self._active if s.handle.cancelled])
            if self._active:
                failed = None
                self.stepping = True
                try:
                    self._step()
                except Exception as exc:  # a failure ends the requests in flight, not the engine
                    failed = exc
                finally:
                    self.stepping = False
                if self.after_step is not None:  # hands on this step's events, those of a
                    try:  # failed step included, before any error event
                        self.after_step()
                    except Exception:
                        log.exception("after_step failed")
                if failed is not None:
                    log.error("a batched step failed", exc_info=failed)
                    for s in self._active:
                        s.emit("", None, "error", _as_error(failed))
                    self._remove(list(self._active))
        stopping = UnavailableError("the server is shutting down")
        with self._cv:
            active, waiting = self._active, list(self._waiting)
            self._drop(active)
            self._waiting = collections.deque()
        for s in active:
            s.emit("", None, "error", stopping)
        for h in waiting:
            _fail(h, stopping)

    def _warmup(self) -> None:
        """One pass of two segments (a 2-token prompt and a 1-token step) through every
        kernel the batched steps use, a step of one token for each (the cpu backend's
        batched step in one call), then two steps of one token on one cache (a lone
        request's step: the cpu backend's fused one-token call and the head), as ``bitformat
        run``'s warm-up does, so the first request does not pay compilation, the first
        calls' page faults or the thread setting's first timings."""
        n = 2 if self.max_batch > 1 else 1
        segs = [Segment([0] * (2 - i), self.net.new_cache(3)) for i in range(n)]
        try:
            self.net.decode(segs, [Sampler() for _ in segs])
            if n > 1:
                self.net.decode([Segment([0], s.cache) for s in segs], [Sampler(), Sampler()])
            cache = self.net.new_cache(2)
            for _ in range(2):
                self.net.decode([Segment([0], cache)], [Sampler()])
        except Exception:
            log.exception("warm-up failed")

    def _step(self) -> None:
        segs, slots = [], []
        # prompt tokens a step takes: one chunk's worth beside requests that wait for their
        # next token; one chunk each where all are in their prompts (8 clients of 2B-4T sent
        # at once, 88 prompt tokens: one pass of ~0.73 s instead of 0.64 + 0.26 s)
        generating = any(s.done >= len(s.prompt) for s in self._active)
        budget = PREFILL_CHUNK * (1 if generating else len(self._active))
        for s in self._active:
            if s.done < len(s.prompt):  # prompt chunks at multiples of PREFILL_CHUNK
                n = min(PREFILL_CHUNK - s.done % PREFILL_CHUNK, len(s.prompt) - s.done)
                if n > budget:
                    continue  # another prompt's chunk runs this step; this one waits
                budget -= n
                segs.append(Segment(s.prompt[s.done: s.done + n], s.cache))
            else:
                segs.append(Segment([s.last], s.cache))
            slots.append(s)
        tokens = self.net.decode(segs, [s.sampler for s in slots])
        self.steps += 1
        finished = []
        for s, seg, token in zip(slots, segs, tokens, strict=True):
            if s.done < len(s.prompt):
                s.done += len(seg.tokens)
                if s.done < len(s.prompt):
                    continue  # not the prompt's last chunk: its token is not used
            s.sampler.accept(token)
            s.generated += 1
            self.tokens += 1
            s.last = token
            text, reason = s.text.add(token)
            if reason is None and s.generated >= s.max_new:
                text += s.text.finish()
                reason = "length"
            # a stop token counts as generated but is not part of the answer
            s.emit(text, None if token in s.text.stop_ids else token, reason)
            if reason is not None:
                finished.append(s)
        self._remove(finished)

    def _remove(self, slots: list[_Slot]) -> None:
        if slots:
            with self._cv:
                self._drop(slots)

    def _drop(self, slots: list[_Slot]) -> None:
        """Take ``slots`` out of the running ones and give their positions and caches back
        (call with the lock held)."""
        gone = {id(s) for s in slots}
        for s in self._active:
            if id(s) in gone:
                self._reserved -= s.positions
                s.cache = None  # its memory goes now, not when the handle goes
        self._active = [s for s in self._active if id(s) not in gone]

