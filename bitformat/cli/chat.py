"""``bitformat chat``'s loop: read a line, run a command or send it, stream the answer.

:func:`chat_loop` takes its input and output streams, so tests drive it with
``io.StringIO``; the command (``cli/main.py``) passes stdin, stdout and stderr.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from .. import interrupts
from ..errors import RequestError

HELP = """\
commands:
  /reset         forget the conversation (the system prompt stays)
  /system TEXT   set the system prompt (the conversation is kept); /system alone removes it
  /help          this list
  /exit, /quit   end the chat (so do Ctrl-D and Ctrl-C at the prompt)
Ctrl-C while the model answers stops the answer. A line starting with // sends /..."""


def chat_loop(session: Any, stdin: TextIO, stdout: TextIO, stderr: TextIO, *,
              prompt: str = "> ", stats: bool = False) -> int:
    """Hold the conversation until /exit or the end of input; return the turns answered.

    ``session``: a :class:`~.runtime.chat.ChatSession`. ``prompt`` is written to ``stdout``
    before each line is read ("" when the input is not a terminal); answers stream to
    ``stdout``; notes, errors and (``stats``) per-turn timings go to ``stderr``.
    """
    def read() -> str:
        if prompt and stdin is sys.stdin and stdout is sys.stdout:  # a terminal: line editing
            try:
                return input(prompt) + "\n"
            except EOFError:
                return ""
        if prompt:
            stdout.write(prompt)
            stdout.flush()
        return stdin.readline()

    turns = 0
    while True:
        try:
            line = read()
        except KeyboardInterrupt:
            interrupts.handled()
            stdout.write("\n")
            return turns
        if not line:  # end of input
            if prompt:
                stdout.write("\n")
            return turns
        line = line.rstrip("\r\n")
        if not line.strip():
            continue
        if line.startswith("/") and not line.startswith("//"):
            command, _, arg = line.partition(" ")
            if command in ("/exit", "/quit", "/bye"):
                return turns
            if command == "/help":
                stderr.write(HELP + "\n")
            elif command == "/reset":
                session.reset()
                stderr.write("conversation reset\n")
            elif command == "/system":
                session.set_system(arg.strip() or None)
                stderr.write("system prompt removed\n" if not arg.strip() else
                             "system prompt set\n")
            else:
                stderr.write(f"unknown command {command}: /help lists the commands\n")
            continue
        text = line[1:] if line.startswith("//") else line
        dropped = session.dropped
        try:
            for r in session.send(text):
                stdout.write(r.text)
                stdout.flush()
        except KeyboardInterrupt:
            interrupts.handled()
            stdout.write("\n")
            stderr.write("[answer stopped]\n")
            continue
        except RequestError as exc:  # the context is full, the template refused, ...
            stderr.write(f"error: {exc}\n")
            continue
        stdout.write("\n")
        stdout.flush()
        turns += 1
        if session.dropped > dropped:
            n = session.dropped - dropped
            stderr.write(f"[the oldest {n} turn{'s' if n > 1 else ''} left the conversation to "
                         f"make room in the context of {session.context} tokens]\n")
        s = session.last_stats
        if session.context_full:
            stderr.write(f"[the context of {session.context} tokens is full: the answer was "
                         "cut; the next message makes room by dropping the oldest turns, "
                         "/reset starts over]\n")
        if stats:
            stderr.write(f"[prompt {s.prompt_tokens} new tokens ({s.cached_tokens} cached) at "
                         f"{s.prompt_tps:.1f} tok/s, answer {s.generated_tokens} tokens at "
                         f"{s.generation_tps:.1f} tok/s, context {session.tokens_used}/"
                         f"{session.context}]\n")
        stderr.flush()
