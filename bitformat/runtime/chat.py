"""A multi-turn conversation with a loaded model, its KV cache kept between turns.

Each turn renders the whole conversation with the model's chat template (as transformers
does, :mod:`bitformat.chat_template`) and tokenizes it. The tokens the KV cache already holds
are compared with that prompt: the common prefix stays in the cache and only the rest runs
(normally just the new user turn). Where a template renders earlier turns differently once
the conversation grows, or the answer's text tokenizes differently from the sampled tokens,
the prompt differs from the cache earlier and the cache is cut back there: the result is
always what a fresh run over the whole prompt would see.

>>> from bitformat.runtime import load                              # doctest: +SKIP
>>> chat = ChatSession(load("model.gguf"), system="Be brief.")     # doctest: +SKIP
>>> for r in chat.send("What is BitNet?"):                          # doctest: +SKIP
...     print(r.text, end="", flush=True)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from ..errors import RequestError
from .generate import GenerationResponse, GenerationStats, stream_generate

__all__ = ["ChatSession", "ContextFullError"]


class ContextFullError(RequestError):
    """The conversation no longer fits the context: start a new one."""


class ChatSession:
    """A conversation: ``send`` a user message, stream the answer; ``reset`` to start over.

    ``model``: a :class:`~.loader.LoadedModel` with a tokenizer. ``system``: the system
    prompt (None: none). ``context``: tokens the conversation may hold (default and at most:
    the model's context length); the KV cache is allocated for it once. ``max_new_tokens``
    caps each answer; ``stop`` strings, ``skip_special`` and the sampling options are
    :func:`.generate.stream_generate`'s.
    """

    def __init__(self, model: Any, *, system: str | None = None, context: int | None = None,
                 max_new_tokens: int = 512, stop: Sequence[str] = (),
                 skip_special: bool = True, **sampling: Any):
        if model.tokenizer is None:
            raise RequestError("this model has no tokenizer, so it cannot chat")
        limit = model.args.context_length
        if context is not None and not 1 <= context <= limit:
            raise RequestError(f"context {context} is outside 1..{limit} (the model's context "
                               "length)")
        self.model, self.tokenizer = model, model.tokenizer
        self.context = context or limit
        self.system = system or None
        self.max_new_tokens = max_new_tokens
        self.options = dict(stop=tuple(stop), skip_special=skip_special, **sampling)
        self.messages: list[dict[str, str]] = []  # user and assistant turns, in order
        self.cache = model.net.new_cache(self.context)
        self.cached: list[int] = []  # the tokens whose keys and values the cache holds
        self.last_stats = GenerationStats()
        self.context_full = False  # the last answer stopped because the context was full

    def conversation(self, user: str | None = None) -> list[dict[str, str]]:
        """The messages the template sees: system prompt, the turns, and ``user`` if given."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        tail = [{"role": "user", "content": user}] if user is not None else []
        return head + self.messages + tail

    def prompt(self, user: str) -> list[int]:
        """Token ids of the conversation with ``user`` as the next turn, ready for the answer."""
        text = self.tokenizer.apply_chat_template(self.conversation(user),
                                                  add_generation_prompt=True)
        return self.tokenizer.encode(text, add_bos=False)

    def reset(self) -> None:
        """Forget the turns (the system prompt stays; its tokens stay cached)."""
        self.messages = []
        self.context_full = False

    def set_system(self, text: str | None) -> None:
        """Replace the system prompt (None or "": none); the turns so far are kept."""
        self.system = text or None

    @property
    def tokens_used(self) -> int:
        """Positions of the context the conversation holds now."""
        return len(self.cached)

    def send(self, user: str) -> Iterator[GenerationResponse]:
        """Add the user's turn and stream the answer (as :func:`.generate.stream_generate`).

        The turn and the answer join the conversation once the answer ends, also when the
        consumer stops early (Ctrl-C) after the first token: what was shown is what the model
        said. A conversation
        that does not fit the context with room for one answer token raises
        :class:`ContextFullError` and is left as it was.
        """
        ids = self.prompt(user)
        if len(ids) >= self.context:
            raise ContextFullError(
                f"the conversation with this message is {len(ids)} tokens and the context "
                f"holds {self.context}: /reset starts a new one")
        keep = 0
        for a, b in zip(self.cached, ids, strict=False):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(ids) - 1)  # one token must run to give the next token's logits
        self.cache.length, self.cached = keep, self.cached[:keep]
        sampled: list[int] = []
        pieces: list[str] = []
        finish = None
        try:
            for r in stream_generate(self.model.net, self.tokenizer, ids,
                                     max_new_tokens=self.max_new_tokens, cache=self.cache,
                                     weight_bytes=self.model.weight_bytes_per_token,
                                     **self.options):
                self.last_stats = r.stats
                if r.token is not None:
                    sampled.append(r.token)
                pieces.append(r.text)
                finish = r.finish_reason
                yield r
        finally:
            # the cache holds the prompt and every sampled token but the last
            self.cached = (ids + sampled)[: self.cache.length]
            if sampled:  # stopped before the first token (Ctrl-C): the turn never happened
                self.messages += [{"role": "user", "content": user},
                                  {"role": "assistant", "content": "".join(pieces)}]
            self.context_full = (finish == "length" and len(ids) + len(sampled) >= self.context)
