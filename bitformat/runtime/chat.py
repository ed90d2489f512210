"""A multi-turn conversation with a loaded model, its KV cache kept between turns.

Each turn renders the whole conversation with the model's chat template (as transformers does,
:mod:`bitformat.tokenizers.chat_template`) and tokenizes it. The tokens the KV cache already
holds are compared with that prompt: the common prefix stays in the cache and only the rest
runs (normally just the new user turn). Where a template renders earlier turns differently once
the conversation grows, or the answer's text tokenizes differently from the sampled tokens, the
prompt differs from the cache earlier and the cache is cut back there. An answer is kept as the
tokens the model sampled (its text need not tokenize back to them): the next prompt is the last
prompt's tokens, the answer's, and the rest of the rendered text tokenized on its own, wherever
the template renders the conversation by appending to it (the answer as sampled, whitespace
that the template trims from a message included). So a turn runs only its own new tokens; a
turn after a reset, a changed system prompt or dropped turns runs the conversation again.

Answers are at most ``max_new_tokens`` long (default: a quarter of the context, at most 512,
so a conversation holds several turns). A message that would leave less than that room drops
the oldest turns first (the system prompt stays; ``dropped`` counts them, and the cache reruns
what follows them); only a message that cannot fit even alone is refused.

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

__all__ = ["ChatSession", "ContextFullError", "default_answer_tokens"]


def default_answer_tokens(context: int) -> int:
    """An answer's length when none is given: a quarter of the context, 16 to 512 tokens."""
    return max(16, min(512, context // 4))


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
                 max_new_tokens: int | None = None, stop: Sequence[str] = (),
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
        self.max_new_tokens = max_new_tokens or default_answer_tokens(self.context)
        self.options = dict(stop=tuple(stop), skip_special=skip_special, **sampling)
        self.messages: list[dict[str, str]] = []  # user and assistant turns, in order
        self.cache = model.net.new_cache(self.context)
        self.cached: list[int] = []  # the tokens whose keys and values the cache holds
        self.last_stats = GenerationStats()
        self.context_full = False  # the last answer stopped because the context was full
        self.dropped = 0  # turns (a message and its answer) dropped to make room, in all
        #: the last turn: (prompt text, prompt ids, answer text, answer ids)
        self._last: tuple[str, list[int], str, list[int]] | None = None

    def conversation(self, user: str | None = None) -> list[dict[str, str]]:
        """The messages the template sees: system prompt, the turns, and ``user`` if given."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        tail = [{"role": "user", "content": user}] if user is not None else []
        return head + self.messages + tail

    def prompt(self, user: str) -> list[int]:
        """Token ids of the conversation with ``user`` as the next turn, ready for the answer."""
        return self._render(self.messages, user)

    def _render(self, messages: list[dict[str, str]], user: str) -> list[int]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        text = self.tokenizer.apply_chat_template(
            head + messages + [{"role": "user", "content": user}], add_generation_prompt=True)
        self._text = text
        last = self._last
        if last is not None and messages == self.messages:
            # the last prompt and answer as the model saw and sampled them, then the rest of
            # the text tokenized on its own: the answer's text need not tokenize back to the
            # sampled tokens, so re-tokenizing it would cut the cache back to the last prompt
            prev_text, prev_ids, answer, answer_ids = last
            said = answer.strip()  # templates trim a message's content
            after = text[len(prev_text):].lstrip() if text.startswith(prev_text) else ""
            if said and after.startswith(said):
                rest = after[len(said):]
                return prev_ids + answer_ids + self.tokenizer.encode(rest, add_bos=False)
        return self.tokenizer.encode(text, add_bos=False)

    def reset(self) -> None:
        """Forget the turns (the system prompt stays; its tokens stay cached)."""
        self.messages = []
        self.context_full = False
        self._last = None

    def set_system(self, text: str | None) -> None:
        """Replace the system prompt (None or "": none); the turns so far are kept."""
        self.system = text or None
        self._last = None

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
        room = min(self.max_new_tokens, max(1, self.context // 4))  # kept for the answer
        kept = list(self.messages)
        while len(ids) + room > self.context and kept:
            kept = kept[2:]  # the oldest message and its answer
            ids = self._render(kept, user)
        if len(ids) >= self.context:
            raise ContextFullError(
                f"this message is {len(ids)} tokens with the system prompt and the context "
                f"holds {self.context}: shorten it, or start with a larger --context")
        if len(kept) < len(self.messages):
            self.dropped += (len(self.messages) - len(kept)) // 2
            self.messages = kept
        keep = 0
        for a, b in zip(self.cached, ids, strict=False):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(ids) - 1)  # one token must run to give the next token's logits
        self.cache.length, self.cached = keep, self.cached[:keep]
        sampled: list[int] = []
        pieces: list[str] = []
        finish = stop_token = None
        stop_string = False
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
                if finish == "stop":
                    stop_token, stop_string = r.token, r.token is None
                yield r
        finally:
            # the cache holds the prompt and every sampled token but the last
            self.cached = (ids + sampled)[: self.cache.length]
            # reused by the next turn where the answer's text is all its tokens said: ended by
            # its length, Ctrl-C or a stop token (which the template writes again as its own
            # end of turn), not by a stop string (cut from the text, not from the tokens)
            said = sampled[:-1] if stop_token is not None else sampled
            self._last = ((self._text, ids, "".join(pieces), said)
                          if sampled and not stop_string else None)
            if sampled:  # stopped before the first token (Ctrl-C): the turn never happened
                self.messages += [{"role": "user", "content": user},
                                  {"role": "assistant", "content": "".join(pieces)}]
            self.context_full = (finish == "length" and len(ids) + len(sampled) >= self.context)
