"""Token ids in, text out, as it forms: one definition for ``bitformat run`` and the server.

A token may end inside a UTF-8 character (byte-level BPE splits multi-byte characters), and a
stop string may be spread over several tokens. So :class:`TextStream` holds back two kinds of
tail until the next token decides them:

- an incomplete character: while the decoded text ends in U+FFFD, nothing new is shown;
- a possible start of a stop string: the longest tail of the text that is a proper prefix of
  one of the stop strings.

A stop string ends the text where it begins (the stop string itself is not shown, as
OpenAI's API does); a stop token ends it before the token. At the end (a token limit or a stop
token) whatever is still held back as a possible stop prefix is shown.

>>> class Chars:                                       # a toy tokenizer: one id per character
...     def decode(self, ids, skip_special=True): return "".join(map(chr, ids))
>>> ts = TextStream(Chars(), stop=["\\n\\n"])
>>> [ts.add(t) for t in map(ord, "Hi\\n!\\n\\nmore")][:6]
[('H', None), ('i', None), ('', None), ('\\n!', None), ('', None), ('', 'stop')]
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class TextStream:
    """The text of one generation, token by token (module docstring).

    ``tokenizer`` needs ``decode(ids, skip_special=...) -> str`` (None: no text, only token
    ids). ``stop_ids``: tokens that end the generation and are not part of it; ``stop``:
    strings that do the same in the text; ``skip_special``: control tokens add no text.
    """

    def __init__(self, tokenizer: Any, *, stop_ids: Iterable[int] = (),
                 stop: Iterable[str] = (), skip_special: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self.stop = tuple(s for s in stop if s)
        self.tokens: list[int] = []  # the generation's tokens (without a stop token)
        self.good = ""  # the decoded text up to the last complete character
        self.sent = 0  # characters of ``good`` already handed out
        self.finish_reason: str | None = None

    def add(self, token: int) -> tuple[str, str | None]:
        """The new text after ``token`` and the finish reason (None, or "stop")."""
        if self.finish_reason is not None:
            raise ValueError("the text stream has finished")
        if token in self.stop_ids:
            return self._end("stop")
        self.tokens.append(int(token))
        if self.tokenizer is None:
            return "", None
        full = self._decode()
        if not full.endswith("\ufffd"):
            self.good = full
        return self._release()

    def finish(self) -> str:
        """The generation ended for another reason (a token limit): the text still held back."""
        if self.finish_reason is not None:
            return ""
        if self.tokenizer is not None and self.tokens:
            # an incomplete character at the very end is shown as U+FFFD, as a decoder would
            self.good = self._decode()
            text, reason = self._release(final=True)
            if reason:
                return text
        else:
            text = ""
        self.finish_reason = "length"
        return text

    def _decode(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special=self.skip_special)

    @property
    def text(self) -> str:
        """Everything handed out so far."""
        return self.good[: self.sent]

    def _end(self, reason: str) -> tuple[str, str]:
        text = self.good[self.sent:]
        self.sent = len(self.good)
        self.finish_reason = reason
        return text, reason

    def _release(self, final: bool = False) -> tuple[str, str | None]:
        good = self.good
        hit = -1
        for s in self.stop:  # earliest stop string; it cannot lie in text already sent
            i = good.find(s, max(0, self.sent - len(s) + 1))
            if i >= 0 and (hit < 0 or i < hit):
                hit = i
        if hit >= 0:
            self.good = good[: max(hit, self.sent)]
            return self._end("stop")
        hold = 0 if final else max((k for s in self.stop for k in range(1, len(s))
                                    if good.endswith(s[:k])), default=0)
        end = max(self.sent, len(good) - hold)
        text, self.sent = good[self.sent: end], end
        return text, None
