"""``bitformat chat``: the session (KV cache kept across turns), its loop, and the command;
``run``'s --system, --stop, --min-p, --context and --file."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from bitformat.cli import main
from bitformat.cli.chat import chat_loop
from bitformat.errors import ChatTemplateError
from bitformat.runtime import load
from bitformat.runtime.chat import ChatSession, ContextFullError
from bitformat.runtime.generate import generate

FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"
QUESTIONS = ["What is a ternary weight?", "And why 1.58 bits?", "Thanks, bye."]


@pytest.fixture()
def model(tiny_gguf):
    with load(tiny_gguf, backend="numpy", dtype="float64") as m:
        yield m


def _fresh(model, ids, n):
    """The answer a new generation over the whole prompt gives (no cache reused)."""
    return generate(model.net, model.tokenizer, ids, max_new_tokens=n).tokens


def _turns(session, questions, n):
    out = []
    for q in questions:
        ids = session.prompt(q)
        before = list(session.cached)
        tokens = [r.token for r in session.send(q) if r.token is not None and
                  r.finish_reason != "stop"]
        common = next((i for i, (a, b) in enumerate(zip(before, ids, strict=False))
                       if a != b),
                      min(len(before), len(ids)))
        out.append((ids, tokens, common, session.last_stats))
    return out


@pytest.mark.parametrize("template", [None, "llama3", "namespace-date"])
def test_turns_reuse_the_cache_and_match_a_fresh_run(model, template):
    if template is not None:
        model.tokenizer.chat_template = (FIXTURES / f"{template}.jinja").read_text().rstrip("\n")
    session = ChatSession(model, system="You are terse.", max_new_tokens=6)
    turns = _turns(session, QUESTIONS, 6)
    for i, (ids, tokens, common, stats) in enumerate(turns):
        assert tokens == _fresh(model, ids, 6)[:len(tokens)] and tokens
        assert stats.cached_tokens == min(common, len(ids) - 1)
        assert stats.prompt_tokens == len(ids) - stats.cached_tokens
        if i and template != "namespace-date":  # the earlier turns' tokens stay cached
            assert stats.cached_tokens > len(turns[i - 1][0]) // 2
    assert [m["role"] for m in session.messages] == ["user", "assistant"] * 3
    if template == "namespace-date":  # re-renders an earlier turn: the cache is cut back there
        assert turns[2][3].cached_tokens < len(turns[1][0])
    # the cache holds exactly the tokens it says: the next answer after a reset still matches
    session.reset()
    ((ids, tokens, _, stats),) = _turns(session, QUESTIONS[:1], 6)
    assert tokens == _fresh(model, ids, 6)[:len(tokens)] and stats.cached_tokens > 0


def test_a_full_context_drops_the_oldest_turns(model):
    session = ChatSession(model, context=40, max_new_tokens=100)
    list(session.send("Hi"))
    assert session.context_full and session.tokens_used == 39  # the answer filled the context
    out = list(session.send("Again"))  # no room left: the first turn leaves
    assert session.dropped == 1 and [m["content"] for m in session.messages][0] == "Again"
    assert len(session.messages) == 2 and out
    messages = list(session.messages)
    with pytest.raises(ContextFullError, match="context holds 40: shorten it"):
        list(session.send("x " * 50))  # cannot fit even alone: refused, nothing changes
    assert session.messages == messages and session.dropped == 1
    with pytest.raises(Exception, match="outside 1..256"):
        ChatSession(model, context=10_000)


def test_answers_fit_the_context_by_default(model):
    """The default answer is a quarter of the context (at most 512): the tiny model's 256
    positions hold several turns of answers that run to their length."""
    session = ChatSession(model)
    assert session.max_new_tokens == 64
    assert ChatSession(model, context=40).max_new_tokens == 16
    for i in range(4):
        tokens = [r.token for r in session.send(f"Question {i}") if r.token is not None]
        assert tokens and session.tokens_used <= session.context
    assert session.dropped >= 1  # later turns made room by dropping the first ones


def test_a_template_that_refuses_is_a_clear_error(model):
    model.tokenizer.chat_template = (FIXTURES / "llama2.jinja").read_text()
    session = ChatSession(model, max_new_tokens=2)
    session.messages = [{"role": "user", "content": "a"}]  # two user turns in a row
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        list(session.send("b"))


def test_stopping_an_answer_keeps_what_was_shown(model):
    session = ChatSession(model, max_new_tokens=20)
    stream = session.send("Hi")
    shown = "".join(next(stream).text for _ in range(4))
    stream.close()  # what Ctrl-C does to the loop's generator
    assert session.messages[-1] == {"role": "assistant", "content": shown}
    assert session.tokens_used == session.cache.length > 0  # the cache says what it holds
    ((ids, tokens, _, stats),) = _turns(session, ["More"], 5)  # and the next turn is right
    assert tokens == _fresh(model, ids, 20)[:len(tokens)] and stats.cached_tokens > 0


def test_loop_commands(model):
    session = ChatSession(model, max_new_tokens=4)
    out, err = io.StringIO(), io.StringIO()
    lines = "Hello\n\n/help\n/system Be brief.\n/bogus\n//slash\n/reset\n/system\nAgain\n" \
            "/exit\nnever sent\n"
    assert chat_loop(session, io.StringIO(lines), out, err, stats=True) == 3
    e = err.getvalue()
    assert "/reset" in e and "system prompt set" in e and "unknown command /bogus" in e
    assert "conversation reset" in e and "system prompt removed" in e
    assert e.count("[prompt ") == 3 and "cached" in e
    assert [m["content"] for m in session.messages if m["role"] == "user"] == ["Again"]
    assert session.system is None
    assert out.getvalue().count("\n") == 3  # one line per answer, no prompts when piped


def test_loop_ends_at_end_of_input_and_reports_full_context(model):
    session = ChatSession(model, context=30, max_new_tokens=100)
    out, err = io.StringIO(), io.StringIO()
    lines = "Hi\nHi again\n" + "x " * 40 + "\n"
    assert chat_loop(session, io.StringIO(lines), out, err, prompt="> ") == 2
    e = err.getvalue()
    assert "the context of 30 tokens is full" in e
    assert "[the oldest 1 turn left the conversation" in e  # "Hi again" made room
    assert "error: this message is" in e and "shorten it" in e  # too long even alone
    assert out.getvalue().startswith("> ") and out.getvalue().endswith("> \n")


def test_chat_command_with_piped_stdin(tiny_gguf):
    """The real command in a subprocess: lines piped in are turns, answers on stdout."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    proc = subprocess.run(
        [sys.executable, "-m", "bitformat.cli", "chat", str(tiny_gguf), "--backend", "numpy",
         "-n", "5", "--system", "Be brief.", "--stats"],
        input="What is BitNet?\n/reset\nWhat is BitNet?\nMore?\n", capture_output=True,
        text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    answers = proc.stdout.split("\n")[:3]
    assert answers[0] == answers[1] and answers[0]  # /reset: the same first turn again
    assert proc.stderr.count("[prompt ") == 3 and "conversation reset" in proc.stderr
    with load(tiny_gguf, backend="numpy") as m:
        want = ChatSession(m, system="Be brief.", max_new_tokens=5)
        assert "".join(r.text for r in want.send("What is BitNet?")) == answers[0]


def _run(*args):
    result = CliRunner().invoke(main, ["run", *map(str, args), "--backend", "numpy", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output.splitlines()[-1])


def test_run_system_stop_min_p_context_file(tiny_gguf, tmp_path):
    plain = _run(tiny_gguf, "-p", "Hello", "-n", "12")
    with load(tiny_gguf, backend="numpy") as m:
        tok = m.tokenizer
        with_system = m.encode("Hello", chat=True, system="Be brief.")
        assert with_system == tok.encode(tok.apply_chat_template(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]),
            add_bos=False)
        want = m.generate(with_system, 8).tokens
    assert _run(tiny_gguf, "-p", "Hello", "-n", "8", "--system", "Be brief.")["tokens"] == want
    # --stop: the text ends where the stop string begins
    stop = plain["text"][5:8]
    cut = _run(tiny_gguf, "-p", "Hello", "-n", "12", "--stop", "zzzz", "--stop", stop)
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == plain["text"][:plain["text"].find(stop)]
    # -f: the prompt from a file or stdin
    (tmp_path / "p.txt").write_text("Hello", encoding="utf-8")
    assert _run(tiny_gguf, "-f", tmp_path / "p.txt", "-n", "12")["tokens"] == plain["tokens"]
    r = CliRunner().invoke(main, ["run", str(tiny_gguf), "-f", "-", "-n", "12", "--backend",
                                  "numpy", "--json"], input="Hello")
    assert json.loads(r.output.splitlines()[-1])["tokens"] == plain["tokens"]
    # --context caps prompt + answer
    capped = _run(tiny_gguf, "-p", "Hello", "-n", "12", "--context", "7")
    assert capped["tokens"] == plain["tokens"][:7 - plain["prompt_tokens"]]
    assert capped["finish_reason"] == "length" and 0 < len(capped["tokens"]) < 12
    # --min-p 1: only the likeliest token survives, so sampling is greedy
    hot = _run(tiny_gguf, "-p", "Hello", "-n", "12", "--temperature", "1.5", "--seed", "1",
               "--min-p", "1")
    assert hot["tokens"] == plain["tokens"]


@pytest.mark.parametrize("args, message", [
    (["-p", "x", "-f", "-"], "exactly one of --prompt, --file and --prompt-ids"),
    (["--prompt-ids", "1,2", "--system", "s"], "--system needs a text prompt"),
    (["-p", "x", "--context", "100000"], "more than the model's context length of 256"),
    (["-p", "x", "--context", "0"], "--context"),
])
def test_run_option_errors(tiny_gguf, args, message):
    result = CliRunner().invoke(main, ["run", str(tiny_gguf), "--backend", "numpy", *args])
    assert result.exit_code != 0 and message in result.output


def test_a_turn_runs_only_its_own_new_tokens(model):
    """The tiny model's answers are random tokens whose text tokenizes otherwise, and its
    template trims the answer: the next prompt still starts with every token the cache holds
    (the answer as sampled), so each turn after the first reuses the whole context so far."""
    session = ChatSession(model, max_new_tokens=12)
    used = []
    for q in ("Hello there", "Tell me more", "And then?"):
        before = session.tokens_used
        list(session.send(q))
        st = session.last_stats
        assert st.cached_tokens == before  # everything the conversation held so far
        assert st.cached_tokens + st.prompt_tokens + st.generated_tokens - 1 == \
            session.tokens_used  # the counts add up
        used.append(session.tokens_used)
    assert used[0] < used[1] < used[2]
    # and what was cached is what a fresh run over that prompt gives
    ids = session.prompt("Last one")
    assert ids[: session.tokens_used] == session.cached
    tokens = [r.token for r in session.send("Last one") if r.token is not None]
    assert tokens[:5] == _fresh(model, ids, 12)[:5]
