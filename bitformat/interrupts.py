"""Ctrl-C and SIGTERM that end a command at any moment, numba's compilation included.

The CLI turns SIGINT into ``KeyboardInterrupt`` and SIGTERM into :class:`.errors.Terminated`,
so the atomic writers remove their unfinished output and the command exits 130 or 143 with one
line. But an exception raised while numba compiles can land in a ctypes callback of LLVM's
(``_raw_object_cache_notify``), which prints "Exception ignored ..." and swallows it; the
command then ran on and exited 0. So each signal also arms a watchdog (and such swallowed
interrupts are no longer printed): the code that handles
the interrupt disarms it (:func:`handled`); if nobody has within :data:`GRACE` seconds, the
watchdog removes the atomic writers' live temporaries, prints the one line itself and ends the
process with the signal's exit code. numba writes its cache entries by an atomic rename, so
the kernel cache stays usable. A second signal while one is pending ends the process at once.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from .errors import Terminated

GRACE = 1.5  # seconds the normal path has to handle a signal before the watchdog ends it
CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
WORDS = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}

_pending: dict[str, threading.Event] = {}
_lock = threading.Lock()
#: helper processes that end with this one (the compile helper of runtime/warmup.py)
CHILDREN: set = set()


def _hard_exit(signum: int) -> None:
    from .io.atomic import remove_live

    for child in list(CHILDREN):
        try:
            child.kill()
        except OSError:
            pass
    remove_live()
    try:
        os.write(2, f"{WORDS[signum]}: nothing unfinished was left\n".encode())
    except OSError:
        pass
    os._exit(CODES[signum])


def _watch(signum: int, done: threading.Event) -> None:
    if not done.wait(GRACE):
        _hard_exit(signum)


def handled() -> bool:
    """The interrupt was handled (the command ends as it should, or chat stopped an
    answer): disarm the watchdog. False where no signal had armed it."""
    with _lock:
        ev = _pending.pop("armed", None)
    if ev is not None:
        ev.set()
    return ev is not None


def end_process(code: int) -> None:
    """End a command that a signal stopped (:func:`handled` said so), once its output is
    cleaned up and its one line said: flush and leave without the interpreter's shutdown.
    That shutdown could wait for a worker thread that never ends (one killed conversion in a
    full test run under load took over a minute), and while numba's compiler was interrupted
    mid-function it crashed now and then (SIGSEGV instead of 143 in a full test run);
    nothing is left for it to do (the atomic writers have removed their temporaries, and
    numba writes each cached kernel whole when it is compiled)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _on_signal(signum: int, frame) -> None:
    with _lock:
        if "armed" in _pending:  # a second signal while the first is pending: end now
            _hard_exit(signum)
        ev = _pending["armed"] = threading.Event()
    threading.Thread(target=_watch, args=(signum, ev), daemon=True,
                     name="bitformat-interrupt-watchdog").start()
    if signum == signal.SIGTERM:
        raise Terminated
    raise KeyboardInterrupt


def _quiet_unraisable(unraisable) -> None:
    """sys.unraisablehook that drops our own interrupts (a callback swallowed them: the
    watchdog ends the process) instead of printing "Exception ignored ..." and a traceback."""
    if isinstance(unraisable.exc_value, (KeyboardInterrupt, Terminated)):
        return
    _default_unraisable(unraisable)


_default_unraisable = sys.unraisablehook


def install() -> dict[int, object] | None:
    """Install the handlers (main thread only); the previous ones, to restore, or None."""
    if threading.current_thread() is not threading.main_thread():
        return None
    sys.unraisablehook = _quiet_unraisable
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.signal(sig, _on_signal)
        except (ValueError, OSError):  # not the main interpreter thread, or no such signal
            pass
    return previous


def restore(previous: dict[int, object] | None) -> None:
    if not previous:
        return
    for sig, h in previous.items():
        try:
            signal.signal(sig, h if h is not None else signal.SIG_DFL)
        except (ValueError, OSError):
            pass


__all__ = ["GRACE", "end_process", "handled", "install", "restore"]
