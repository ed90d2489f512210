"""Chat templates render exactly as transformers' apply_chat_template renders them.

The templates in tests/fixtures/chat_templates are those of real model families (Llama 3,
Llama 2 / SentencePiece style, Qwen 2.5 with its tools branch, Falcon 3) plus one that uses
``namespace``, loop controls, ``strftime_now`` and ``tojson`` options; BitNet 2B-4T's is
:data:`bitformat.tokenizers.chat_template.BITNET_CHAT_TEMPLATE`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bitformat.errors import ChatTemplateError, RequestError
from bitformat.tokenizers.bpe import Tokenizer, llama3_specials, to_hf_files, train_bpe
from bitformat.tokenizers.chat_template import BITNET_CHAT_TEMPLATE, render_chat

transformers = pytest.importorskip("transformers")
from transformers.utils.chat_template_utils import render_jinja_template  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"
TEMPLATES = {p.stem: p.read_text(encoding="utf-8").rstrip("\n")
             for p in sorted(FIXTURES.glob("*.jinja"))}
TEMPLATES["bitnet-2b-4t"] = BITNET_CHAT_TEMPLATE

SYSTEM = {"role": "system", "content": "You are terse. Answer in one line."}
TURNS = [
    {"role": "user", "content": "  What is BitNet b1.58?\n"},
    {"role": "assistant", "content": "A 1.58-bit LLM: weights in {-1, 0, +1}."},
    {"role": "user", "content": "Why \"ternary\"? <b>&amp;</b> — ünïcode 🎉"},
    {"role": "assistant", "content": "Three values."},
    {"role": "user", "content": "Thanks!"},
]
CONVERSATIONS = [
    [TURNS[0]],
    [SYSTEM, TURNS[0]],
    [SYSTEM, *TURNS[:3]],
    [SYSTEM, *TURNS],
    TURNS[:4],
]
SPECIALS = [{"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
            {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}]


def _transformers(template, messages, generation, **kwargs):
    rendered, _ = render_jinja_template(conversations=[messages], chat_template=template,
                                        add_generation_prompt=generation, **kwargs)
    return rendered[0]


def test_fixtures_present():
    assert {"llama3", "llama2", "qwen2.5", "falcon3", "namespace-date"} <= set(TEMPLATES)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_same_text_as_transformers(name):
    template = TEMPLATES[name]
    for messages in CONVERSATIONS:
        for generation in (True, False):
            for specials in SPECIALS:
                try:
                    want = _transformers(template, messages, generation, **specials)
                except Exception as exc:  # the template refuses: so must we
                    with pytest.raises(ChatTemplateError):
                        render_chat(template, messages, generation, **specials)
                    assert name == "llama2", exc
                    continue
                assert render_chat(template, messages, generation, **specials) == want
    # the conversation grows at its end: a turn's prompt extends the previous prompt
    # (what the chat session's KV cache reuse relies on, where the template allows it)
    a = render_chat(template, [SYSTEM, *TURNS[:1]], False, **SPECIALS[0])
    b = render_chat(template, [SYSTEM, *TURNS[:3]], False, **SPECIALS[0])
    assert b.startswith(a) != (name == "namespace-date")  # it marks the last-but-one turn


def test_tools_and_none_fields_as_transformers():
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "<b>&",
                                               "parameters": {"type": "object"}}}]
    calls = [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"type": "function", "function": {"name": "get_weather",
                                                   "arguments": {"city": "Zürich"}}}]},
             {"role": "tool", "content": "12 °C"}]
    want = _transformers(TEMPLATES["qwen2.5"], calls, True, tools=tools)
    assert render_chat(TEMPLATES["qwen2.5"], calls, True, tools=tools) == want
    assert '"description": "<b>&"' in want and "Zürich" in want  # not HTML-escaped, not \u


def test_roles_must_alternate_is_a_clear_error():
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="refused the conversation: Conversation roles "
                                                "must alternate"):
        render_chat(TEMPLATES["llama2"], bad)
    assert issubclass(ChatTemplateError, RequestError)  # the server answers 400


@pytest.mark.parametrize("template, match", [
    ("{% for m in messages %}{{ m.content }", "not valid Jinja"),
    ("{{ messages[0].content.upper() }}", "failed to render"),  # no messages: undefined
    ("{{ ''.__class__.__mro__ }}", "failed to render"),  # the sandbox holds
    ("{% set ns = namespace(_x=1) %}", "failed to render"),
])
def test_bad_templates_are_clear_errors(template, match):
    with pytest.raises(ChatTemplateError, match=match):
        render_chat(template, [])


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    """A bitformat Tokenizer and the transformers tokenizer of the same files, per template."""
    data = train_bpe(512, llama3_specials(16))
    out = {}
    for name in ("llama3", "qwen2.5", "falcon3"):
        data.chat_template = TEMPLATES[name]
        meta = data.metadata()
        folder = tmp_path_factory.mktemp(name.replace(".", "_"))
        to_hf_files(meta, folder)
        out[name] = (Tokenizer(meta), transformers.AutoTokenizer.from_pretrained(str(folder)))
    return out


@pytest.mark.parametrize("name", ["llama3", "qwen2.5", "falcon3"])
def test_tokenizer_apply_chat_template_matches(hf_pair, name):
    tok, hf = hf_pair[name]
    for messages in CONVERSATIONS:
        text = tok.apply_chat_template(messages)
        assert text == hf.apply_chat_template(messages, tokenize=False,
                                              add_generation_prompt=True)
        assert tok.encode(text, add_bos=False) == hf(text, add_special_tokens=False)["input_ids"]


def test_server_renders_with_the_same_code(hf_pair):
    """/v1/chat/completions renders through Tokenizer.apply_chat_template, so a conversation
    the template refuses is a RequestError (the server's 400) with the template's words."""
    from bitformat.serve.protocol import parse_chat

    tok, hf = hf_pair["qwen2.5"]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    params = parse_chat({"messages": msgs}, tok)
    text = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert params.prompt == hf(text, add_special_tokens=False)["input_ids"]
    tok.chat_template = TEMPLATES["llama2"]
    try:
        with pytest.raises(RequestError, match="roles must alternate"):
            parse_chat({"messages": [msgs[1], msgs[1]]}, tok)
    finally:
        tok.chat_template = TEMPLATES["qwen2.5"]


def test_module_examples():
    import doctest

    import bitformat.tokenizers.chat_template

    assert doctest.testmod(bitformat.tokenizers.chat_template).failed == 0
