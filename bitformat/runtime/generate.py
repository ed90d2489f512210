"""Token generation: sampling, the ``generate_step`` generator, streaming and the simple call.

``generate_step`` prefills the prompt in chunks of ``PREFILL_CHUNK`` tokens, then decodes one
token per step against the KV cache and yields up to ``max_new_tokens`` token ids;
``stream_generate`` adds text, stop tokens, stop strings and timing; ``generate`` collects a
whole answer. The batching engine (:mod:`.engine`) runs the same steps for many requests at
once and gives each the tokens it gets here.

>>> from bitformat.runtime import load                           # doctest: +SKIP
>>> m = load("tiny.gguf", backend="cpu")                         # doctest: +SKIP
>>> m.generate("Hello", max_new_tokens=8).text                   # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from ..errors import RequestError
from .models import KVCache, Segment, Transformer
from .sampling import Sampler, SamplingParams, make_sampler
from .textstream import TextStream

__all__ = ["PREFILL_CHUNK", "GenerationResponse", "GenerationResult", "GenerationStats",
           "collect", "generate", "generate_step", "make_sampler", "stream_generate"]

#: Prompt tokens run in one forward pass. The numpy attention of a prompt's rows is not
#: bitwise the same for every split of the prompt (BLAS blocks its sums by the shapes), so
#: ``bitformat run`` and the server both cut prompts at multiples of this: a request gets the
#: same tokens from either. The server's other requests wait for one chunk at most per step.
PREFILL_CHUNK = 64


def prompt_chunks(n: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each prefill pass over a prompt of ``n`` tokens."""
    return [(a, min(a + PREFILL_CHUNK, n)) for a in range(0, n, PREFILL_CHUNK)]


@dataclass
class GenerationStats:
    prompt_tokens: int = 0  # run in the prefill (a chat's cached earlier turns not counted)
    cached_tokens: int = 0  # prompt tokens whose keys and values the KV cache already held
    prompt_seconds: float = 0.0
    generated_tokens: int = 0
    generation_seconds: float = 0.0  # from the first sampled token to the last
    weight_bytes_per_token: int = 0  # ternary matrices + LM head + norms, read per step
    kv_bytes_last_token: int = 0  # KV cache read by the last decode step

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def generation_tps(self) -> float:
        steps = self.generated_tokens - 1  # the first token comes from the prefill
        return steps / self.generation_seconds if steps > 0 and self.generation_seconds else 0.0


def generate_step(model: Transformer, prompt: Sequence[int], *, max_new_tokens: int = 256,
                  sampling: SamplingParams | None = None, context: int | None = None,
                  stats: GenerationStats | None = None, cache: KVCache | None = None
                  ) -> Iterator[int]:
    """Yield up to ``max_new_tokens`` sampled token ids after ``prompt``.

    The prompt runs in chunks of ``PREFILL_CHUNK`` tokens; each next token is one decode step
    on the KV cache, done only when the consumer asks for it. ``context`` caps prompt +
    generated tokens (default: the model's context length). Tokens are chosen as
    :mod:`.sampling` defines.

    ``cache``: a KV cache that already holds the keys and values of the first
    ``cache.length`` prompt tokens (a conversation's earlier turns); only the rest of the
    prompt runs, and the cache's size is the context. Afterwards it holds the prompt and
    every yielded token but the last (which was sampled, not run).
    """
    limit = cache.max_len if cache is not None else context or model.args.context_length
    if len(prompt) == 0:
        raise RequestError("the prompt is empty")
    if len(prompt) > limit:
        raise RequestError(f"the prompt has {len(prompt)} tokens, more than the "
                           f"context of {limit}")
    if max_new_tokens < 0:
        raise RequestError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    max_new_tokens = min(max_new_tokens, limit - len(prompt))
    stats = stats if stats is not None else GenerationStats()
    sampler = Sampler(sampling or SamplingParams(), history=list(prompt))
    start = 0 if cache is None else cache.length
    if start >= len(prompt):
        raise RequestError(f"the KV cache holds {start} positions: at least one of the "
                           f"prompt's {len(prompt)} tokens must run")
    if cache is None:  # room for every position this generation can reach, reserved now:
        # growing block by block copies the cache at each block, during the decode too (2B-4T
        # at 3,072 positions: 236 MB a copy); the pages still come as they are written
        cache = model.new_cache(len(prompt) + max_new_tokens)
        if hasattr(cache, "reserve"):  # (the wgpu step sizes its cache when it makes it)
            cache.reserve(len(prompt) + max_new_tokens)
    t0 = time.perf_counter()
    stats.prompt_tokens, stats.cached_tokens = len(prompt) - start, start
    if max_new_tokens == 0:
        return
    *head, (a, b) = [(start + a0, start + b0) for a0, b0 in prompt_chunks(len(prompt) - start)]
    run_only = getattr(model, "forward_hidden", None)  # the chunks before the last need no head
    for a0, b0 in head:
        if run_only is not None:
            run_only([Segment(prompt[a0:b0], cache)])
        else:
            model.decode([Segment(prompt[a0:b0], cache)], [sampler])
    token = model.decode([Segment(prompt[a:b], cache)], [sampler])[0]
    for i in range(max_new_tokens):
        now = time.perf_counter()
        if i == 0:
            stats.prompt_seconds, t_first = now - t0, now
        else:
            stats.generation_seconds = now - t_first
        stats.generated_tokens = i + 1
        sampler.accept(token)
        yield token
        if i + 1 < max_new_tokens:
            token = model.decode([Segment([token], cache)], [sampler])[0]
            stats.kv_bytes_last_token = cache.nbytes


@dataclass
class GenerationResponse:
    """One streamed step: the new text (may be "" while a character is incomplete)."""

    text: str
    token: int | None
    finish_reason: str | None  # None while running, then "stop" (a stop token) or "length"
    stats: GenerationStats


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    finish_reason: str
    stats: GenerationStats = field(default_factory=GenerationStats)


def stream_generate(model: Transformer, tokenizer, prompt: str | Sequence[int], *,
                    max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
                    top_p: float = 1.0, min_p: float = 0.0, repetition_penalty: float = 1.0,
                    seed: int | None = None, stop_ids: Sequence[int] | None = None,
                    stop: Sequence[str] = (), context: int | None = None,
                    weight_bytes: int = 0, skip_special: bool = True,
                    cache: KVCache | None = None) -> Iterator[GenerationResponse]:
    """Generate from text (needs ``tokenizer``) or token ids, yielding text as it forms.

    Stops at a stop token (default: the tokenizer's eos and eot ids; the stop token itself is
    not yielded as text), at a stop string (``stop``; not yielded either) or after
    ``max_new_tokens``; the last response carries ``finish_reason``. Text is held back as
    :class:`.textstream.TextStream` says. Sampling options are :class:`.sampling.SamplingParams`'.
    Special (control) tokens add no text unless ``skip_special`` is False, as in llama.cpp.
    ``cache``: a KV cache holding the prompt's first tokens already (:func:`generate_step`).
    """
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                              repetition_penalty=repetition_penalty, seed=seed)
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError("this model has no tokenizer: pass token ids")
        ids = tokenizer.encode(prompt)
    else:
        ids = [int(t) for t in prompt]
    text = TextStream(tokenizer, stop=stop, skip_special=skip_special,
                      stop_ids=stop_ids if stop_ids is not None else
                      (tokenizer.eos_ids if tokenizer else ()))
    stats = GenerationStats(weight_bytes_per_token=weight_bytes)
    for token in generate_step(model, ids, max_new_tokens=max_new_tokens, sampling=sampling,
                               context=context, stats=stats, cache=cache):
        piece, reason = text.add(token)
        if reason and token in text.stop_ids:  # a stop token is not part of the answer
            if piece:
                yield GenerationResponse(piece, None, None, stats)
            yield GenerationResponse("", token, reason, stats)
            return
        yield GenerationResponse(piece, token, None, stats)
        if reason:  # a stop string: its token is part of the answer, its text is not
            yield GenerationResponse("", None, reason, stats)
            return
    rest = text.finish()
    if rest:  # flush what was held back
        yield GenerationResponse(rest, None, None, stats)
    yield GenerationResponse("", None, "length", stats)


def generate(model: Transformer, tokenizer, prompt: str | Sequence[int], **kwargs
             ) -> GenerationResult:
    """The whole answer of :func:`stream_generate` (same arguments)."""
    return collect(stream_generate(model, tokenizer, prompt, **kwargs))


def collect(responses: Iterable[GenerationResponse]) -> GenerationResult:
    """Join streamed responses into one :class:`GenerationResult`."""
    text, tokens = [], []
    for r in responses:
        text.append(r.text)
        if r.token is not None and r.finish_reason != "stop":
            tokens.append(r.token)
        if r.finish_reason:
            return GenerationResult("".join(text), tokens, r.finish_reason, r.stats)
    raise AssertionError("stream_generate ended without a finish reason")  # pragma: no cover
