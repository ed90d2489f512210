"""OpenAI's request and response shapes: parsing a request body into what the engine runs,
and building the JSON objects and stream chunks the clients expect.

Parsing is strict about what it uses and lenient about what it ignores: a parameter the
server reads must have the right type and range, and a feature it does not have (``n`` > 1,
logprobs, tools, penalties other than ``repetition_penalty``) is refused unless its value is
the neutral one; other keys (``user``, ``metadata``, ...) are ignored, as llama.cpp's server
does, so chat UIs that send extras keep working. Every refusal is a
:class:`~bitformat.errors.RequestError` whose message names the parameter.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import RequestError
from ..runtime.sampling import SamplingParams

#: Features the server does not have, with the values that mean "not used".
NEUTRAL = {"n": (1,), "best_of": (1,), "logprobs": (False, 0), "top_logprobs": (0,),
           "echo": (False,), "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0),
           "logit_bias": ({},), "tools": ([],), "functions": ([],), "suffix": ("",),
           "response_format": ({"type": "text"},)}
ROLES = ("system", "developer", "user", "assistant")
MAX_STOP = 4  # stop strings per request, as OpenAI allows


@dataclass
class Params:
    """One parsed request."""

    model: str | None
    prompt: list[int]
    max_tokens: int | None  # None: up to the context
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False  # vLLM's extension: the answer's token ids in the choice
    ignore_eos: bool = False  # llama.cpp's and vLLM's extension: end-of-turn tokens do not stop


def _bad(param: str, what: str) -> RequestError:
    return RequestError(f"'{param}': {what}")


def _num(body: Mapping, key: str, default: float, lo: float, hi: float,
         lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad(key, f"must be a number, got {v!r}")
    if v < lo or v > hi or (lo_open and v == lo):
        raise _bad(key, f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")
    return float(v)


def _int(body: Mapping, key: str, default: int | None, lo: int, hi: int = 2**64 - 1
         ) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(key, f"must be a whole number, got {v!r}")
    if not lo <= v <= hi:
        raise _bad(key, f"must be in [{lo}, {hi}], got {v}")
    return v


def _bool(body: Mapping, key: str) -> bool:
    v = body.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(key, f"must be true or false, got {v!r}")
    return v


def _common(body: Any, prompt: list[int], *, chat: bool) -> Params:
    for key, ok in NEUTRAL.items():
        v = body.get(key)
        if v is not None and not any(type(v) is type(o) and v == o for o in ok):
            raise _bad(key, f"{v!r} is not supported by this server "
                       f"(only {' or '.join(repr(o) for o in ok)})")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", f"must be a string, got {model!r}")
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = _int(body, key, None if chat else 16, 1)
    seed = body.get("seed")
    seed = None if seed == -1 and not isinstance(seed, bool) else _int(body, "seed", None, 0)
    sampling = SamplingParams(
        temperature=_num(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_num(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=_int(body, "top_k", 0, 0, 1 << 31),
        min_p=_num(body, "min_p", 0.0, 0.0, 1.0),
        repetition_penalty=_num(body, "repetition_penalty", 1.0, 0.0, 100.0, lo_open=True),
        seed=seed)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise _bad("stop", "must be a non-empty string or a list of them")
    if len(stop) > MAX_STOP:
        raise _bad("stop", f"at most {MAX_STOP} stop strings, got {len(stop)}")
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not stream:
            raise _bad("stream_options", "is only allowed when 'stream' is true")
        if not isinstance(opts, dict):
            raise _bad("stream_options", f"must be an object, got {opts!r}")
    include_usage = _bool(opts or {}, "include_usage")
    return Params(model, prompt, max_tokens, sampling, stop, stream, include_usage,
                  _bool(body, "return_token_ids"), _bool(body, "ignore_eos"))


def _need_tokenizer(tokenizer: Any, what: str) -> None:
    if tokenizer is None:
        raise RequestError(f"this model file has no tokenizer, so {what} cannot be read: send "
                           "the prompt of /v1/completions as token ids")


def _ids(v: Any) -> list[int] | None:
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool)
                                         for t in v):
        return list(v)
    return None


def parse_completion(body: Any, tokenizer: Any) -> Params:
    """``POST /v1/completions``: ``prompt`` is a string or token ids (or a list of one)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # one prompt in a list
    if isinstance(p, str):
        _need_tokenizer(tokenizer, "a text prompt")
        prompt = tokenizer.encode(p)
    elif _ids(p) is not None:
        prompt = _ids(p)
    elif isinstance(p, list) and len(p) > 1:
        raise _bad("prompt", "one prompt per request (this server answers n = 1)")
    else:
        raise _bad("prompt", "must be a string or a list of token ids")
    return _common(body, prompt, chat=False)


def _content(i: int, m: Mapping) -> str:
    c = m.get("content")
    if c is None and m.get("role") == "assistant":
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):  # content parts: text only
        parts = []
        for part in c:
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise _bad(f"messages[{i}].content", "only text parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"messages[{i}].content", f"must be a string or a list of text parts, got {c!r}")


def parse_chat(body: Any, tokenizer: Any) -> Params:
    """``POST /v1/chat/completions``: ``messages`` rendered by the model's chat template."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "must be a non-empty list of messages")
    messages = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", f"must be an object, got {m!r}")
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        messages.append({"role": "system" if role == "developer" else role,
                         "content": _content(i, m)})
    _need_tokenizer(tokenizer, "chat messages")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return _common(body, tokenizer.encode(text, add_bos=False), chat=True)


# -- responses ------------------------------------------------------------------------------------
def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def error_body(message: str, type_: str, code: str | None = None,
               param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass
class Shape:
    """Builds one request's response objects (``chat`` or text completion)."""

    chat: bool
    model: str
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        self.id = self.id or new_id(self.chat)
        self.created = self.created or int(time.time())

    def _head(self, chunk: bool) -> dict:
        obj = ("chat.completion" if self.chat else "text_completion") + (
            ".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    def _choice(self, text: str | None, finish: str | None, *, delta: bool,
                role: bool = False, token_ids: list[int] | None = None) -> dict:
        c: dict[str, Any] = {"index": 0}
        if self.chat and delta:
            c["delta"] = ({"role": "assistant", "content": ""} if role else
                          {} if text is None else {"content": text})
        elif self.chat:
            c["message"] = {"role": "assistant", "content": text}
        else:
            c["text"] = text or ""
        c["logprobs"] = None
        c["finish_reason"] = finish
        if token_ids is not None:
            c["token_ids"] = token_ids
        return c

    def whole(self, text: str, finish: str, prompt_tokens: int, completion_tokens: int,
              token_ids: list[int] | None) -> dict:
        """The answer of a request without ``stream``."""
        return {**self._head(False), "choices": [self._choice(text, finish, delta=False,
                                                              token_ids=token_ids)],
                "usage": usage(prompt_tokens, completion_tokens)}

    def chunk(self, text: str | None, finish: str | None = None, *, role: bool = False,
              token_ids: list[int] | None = None, with_usage: bool = False) -> dict:
        """One streamed chunk: the role (chat's first), a text delta, or the finish reason."""
        out = {**self._head(True), "choices": [self._choice(text, finish, delta=True, role=role,
                                                            token_ids=token_ids)]}
        if with_usage:
            out["usage"] = None  # OpenAI: null in every chunk but the last when usage is asked
        return out

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return {**self._head(True), "choices": [],
                "usage": usage(prompt_tokens, completion_tokens)}
