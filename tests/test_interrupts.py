"""Ctrl-C and SIGTERM while numba compiles the cpu kernels (bitformat/interrupts.py).

An exception raised during compilation can land in one of LLVM's ctypes callbacks, which
swallows it: the command used to print "Exception ignored ..." and run on to exit 0 (SIGTERM
was then ignored for good). Each test starts ``bitformat run`` with an empty kernel cache, sends
the signal once it is compiling, and expects the signal's exit code soon after, one line on
stderr and no traceback; the next run on the same cache works.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

CLI = [sys.executable, "-c", "from bitformat.cli import main; main()"]


def start(tiny, cache, *extra):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1"}
    env.pop("BITFORMAT_DEBUG", None)
    return subprocess.Popen(CLI + ["run", str(tiny), "--prompt-ids", "1,2,3", "-n", "3",
                                   "--backend", "cpu", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def wait_for(proc, text: bytes, timeout: float = 120) -> bytes:
    """Read stderr until ``text`` appears (the notice that compilation began)."""
    seen = b""
    t0 = time.monotonic()
    os.set_blocking(proc.stderr.fileno(), False)
    while text not in seen:
        if proc.poll() is not None or time.monotonic() - t0 > timeout:
            raise AssertionError(f"never saw {text!r}: {seen[-500:]!r}")
        chunk = proc.stderr.read()
        if chunk:
            seen += chunk
        time.sleep(0.05)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["INT", "TERM"])
def test_a_signal_during_compilation_ends_the_command(tiny_gguf, tmp_path, sig, code):
    cache = tmp_path / "numba"
    cache.mkdir()
    proc = start(tiny_gguf, cache)
    seen = wait_for(proc, b"compiling kernels")
    time.sleep(1.5)  # well inside the compilation (it takes tens of seconds with no cache)
    assert proc.poll() is None
    t0 = time.monotonic()
    proc.send_signal(sig)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the command ran on after the signal") from None
    took = time.monotonic() - t0
    os.set_blocking(proc.stderr.fileno(), True)
    err = (seen + proc.stderr.read()).decode(errors="replace")
    assert proc.returncode == code, err[-800:]
    assert "Traceback" not in err and "Exception ignored" not in err, err[-800:]
    last = [ln for ln in err.replace("\r", "\n").splitlines() if ln.strip()][-1]
    assert last.startswith(("interrupted", "terminated")), err[-800:]
    assert took < 10, took  # the watchdog ends it within GRACE of the signal
    if sig == signal.SIGINT:  # the cache it left is one the next run can use
        again = start(tiny_gguf, cache)
        out, err2 = again.communicate(timeout=600)
        assert again.returncode == 0, err2.decode(errors="replace")[-800:]


SWALLOWED = """
import ctypes, sys, time
from bitformat import interrupts
from bitformat.cli.main import _friendly_errors

@_friendly_errors
def main():
    def cb():
        print("ready", flush=True)
        time.sleep(30)  # the signal's exception is raised here and swallowed by ctypes
    ctypes.CFUNCTYPE(None)(cb)()
    time.sleep(30)  # ... so the command would run on, and end with 0
    print("ran on", flush=True)

main()
"""


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["INT", "TERM"])
def test_a_swallowed_interrupt_still_ends_the_command(sig, code):
    """What LLVM's callback does to an interrupt during compilation, done with a plain ctypes
    callback: the watchdog ends the command with the signal's code and one line, and the
    swallowed exception prints nothing."""
    proc = subprocess.Popen([sys.executable, "-c", SWALLOWED], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout.readline() == b"ready\n"
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == code and b"ran on" not in out
    lines = [ln for ln in err.decode().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(("interrupted", "terminated")), lines


@pytest.mark.slow
def test_a_cold_start_compiles_in_two_processes(tiny_gguf, tmp_path):
    """On an empty kernel cache `run` starts a helper that compiles the layer kernels on a
    tiny model while it loads and compiles the screened head: it compiles fewer functions
    itself, generates the same tokens as a run that compiles everything alone, and leaves a
    cache with every kernel (the helper's one-call step or long-context attention, compiled
    while the first process generates, included)."""
    import json

    from bitformat.runtime.cpu.kernels import kernel_mode

    logs = {}
    for helper in ("1", "0"):
        cache = tmp_path / f"numba{helper}"
        cache.mkdir()
        log = tmp_path / f"log{helper}.json"
        env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "BITFORMAT_COMPILE_HELPER": helper,
               "BITFORMAT_COMPILE_LOG": str(log)}
        p = subprocess.run(CLI + ["run", str(tiny_gguf), "--prompt-ids", "1,2,3", "-n", "6",
                                  "--json"], capture_output=True, env=env, timeout=900)
        assert p.returncode == 0, p.stderr.decode()[-800:]
        logs[helper] = (json.loads(p.stdout.decode().strip().splitlines()[-1])["tokens"],
                        json.loads(log.read_text())["count"])
        # the helper compiled the one-call step (where this build has one: the first
        # process steps op by op until then) or the long-context attention after the first
        # output, and the command waited for it, so the next run finds every kernel
        later = "decode._decode_row" if kernel_mode() == "vnni" else "attend_split"
        assert list(cache.rglob(f"*{later}*.nbi")), sorted(
            p.name for p in cache.rglob("*.nbi"))
    assert logs["1"][0] == logs["0"][0]
    assert logs["1"][1] < logs["0"][1] / 2, logs  # most of the kernels came from the helper


SHUTDOWN_HANGS = """
import threading, time, click
from bitformat.cli.main import _friendly_errors

@click.command()
@_friendly_errors
def hang():
    # a worker thread the interpreter's shutdown would wait for, forever
    threading.Thread(target=time.sleep, args=(3600,), daemon=False).start()
    print("ready", flush=True)
    time.sleep(3600)

hang()
"""


def test_a_handled_signal_exits_even_if_shutdown_hangs():
    """After SIGTERM is handled the command exits 143 even where the interpreter's shutdown
    would wait for a thread that never ends (interrupts.end_process)."""
    EXIT_GRACE = 5.0  # noqa: N806  (the bound this test has always held the exit to)

    proc = subprocess.Popen([sys.executable, "-c", SHUTDOWN_HANGS], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=EXIT_GRACE + 20)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the process hung after a handled SIGTERM") from None
    assert proc.returncode == 143 and "terminated" in err, (proc.returncode, err)
    assert time.monotonic() - t0 < EXIT_GRACE + 10
