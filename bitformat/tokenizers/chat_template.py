"""Chat templates rendered as transformers' ``apply_chat_template`` renders them.

A model's chat template is a Jinja template stored with its tokenizer (GGUF
``tokenizer.chat_template``, or ``chat_template`` in ``tokenizer_config.json``). transformers
renders it in a sandboxed Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension, a ``tojson`` filter that does not escape HTML, the globals
``raise_exception``, ``strftime_now``, ``dict`` and ``namespace``, and the variables
``messages``, ``tools``, ``documents``, ``add_generation_prompt`` and the tokenizer's special
tokens (``bos_token``, ``eos_token``, ...). :func:`render_chat` does the same, so a prompt
here is the prompt transformers (and so the model's training) would make. Keys whose value
is None are dropped from messages first, as transformers does.

>>> tpl = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\\n{% endfor %}"
...        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
>>> render_chat(tpl, [{"role": "user", "content": "Hi"}])
'<|user|>Hi\\n<|assistant|>'
>>> render_chat("{{ raise_exception('only user turns') }}", [])
Traceback (most recent call last):
bitformat.errors.ChatTemplateError: the chat template refused the conversation: only user turns
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

from ..errors import ChatTemplateError

__all__ = ["BITNET_CHAT_TEMPLATE", "render_chat"]

#: ``chat_template`` of microsoft/bitnet-b1.58-2B-4T (tokenizer_config.json).
BITNET_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = message['role'] | capitalize + ': '+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}")


class _Raised(Exception):
    """``raise_exception(message)`` inside a template."""


def _raise_exception(message: Any) -> None:
    raise _Raised(str(message))


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates want plain JSON
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # a dependency, but an environment may still lack it
        raise ChatTemplateError("rendering chat templates needs the jinja2 package "
                                "(pip install 'jinja2>=3.1.6')") from None

    class Namespace(jinja2.utils.Namespace):
        """``namespace(...)`` without underscore attributes (no way to CPython internals)."""

        def __init__(*args, **kwargs):  # noqa: N805 (Jinja's signature trick)
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"a chat template cannot set {name!r} on a namespace")

    class Dict:
        """``dict(...)`` and ``dict.fromkeys(...)``, nothing else of the type."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=Dict(), namespace=Namespace)
    try:
        return env.from_string(template)
    except jinja2.TemplateError as exc:
        where = f" (line {exc.lineno})" if getattr(exc, "lineno", None) else ""
        raise ChatTemplateError(f"the model's chat template is not valid Jinja{where}: "
                                f"{exc}") from None


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True, *,
                bos_token: str | None = "<|begin_of_text|>",
                eos_token: str | None = "<|end_of_text|>", tools: list[dict] | None = None,
                documents: list[dict] | None = None, **special: Any) -> str:
    """The conversation ``messages`` as prompt text, rendered from ``template``.

    ``bos_token``, ``eos_token`` and any other ``special`` tokens (``pad_token``, ...) are the
    variables transformers passes from the tokenizer's special tokens map. A template that is
    not valid Jinja, or that refuses the conversation (``raise_exception``, a bad field), is a
    :class:`~bitformat.errors.ChatTemplateError` naming the problem.
    """
    compiled = _compile(template)
    chat = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatTemplateError(f"message {i} is not a dict: {m!r:.60}")
        chat.append({k: v for k, v in m.items() if v is not None})
    tokens = {"bos_token": bos_token, "eos_token": eos_token, **special}
    try:
        return compiled.render(messages=chat, tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt,
                               **{k: v for k, v in tokens.items() if v is not None})
    except _Raised as exc:
        raise ChatTemplateError(f"the chat template refused the conversation: {exc}") from None
    except Exception as exc:  # Jinja's errors, and Python's from inside the sandbox
        raise ChatTemplateError(f"the chat template failed to render: "
                                f"{type(exc).__name__}: {exc}") from None
