"""Kill test: ``bitformat convert`` killed with SIGKILL or SIGTERM at every moment of a write.

Each case runs the real CLI in a subprocess with ``BITFORMAT_PAUSE_AT`` naming a moment
(bitformat/io/atomic.py ``checkpoint``): the process stops there, the test sends the signal,
then checks what is on disk: the source unchanged; the target absent or the old version
(before the commit point) or the complete new version (after it), never anything else; after
SIGTERM no stray at all; and after the next convert to the same target, exactly the source
and the new target. Targets: a GGUF container (tq2_0) and an hf folder, with and without an
old version in place, the folder also without RENAME_EXCHANGE (move aside, then move in).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest

from bitformat import convert
from bitformat.io.atomic import PAUSE_VAR

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    sys.platform == "win32", reason="POSIX signals")]

#: (moment, the output is in place at that moment)
MOMENTS = [("created", False), ("tensor:3", False), ("written", False), ("committed", True)]
#: the CLI with RENAME_EXCHANGE unavailable (as on macOS or an old kernel)
NO_EXCHANGE = ("import sys; import bitformat.io.atomic_folder as a; "
               "a._renameat2 = lambda *x: False; "
               "from bitformat.cli import main; sys.argv[0] = 'bitformat'; main()")


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_gguf):
    """The source, an older model (another seed) and what each target looks like."""
    from bitformat.synth import synth

    d = tmp_path_factory.mktemp("kill-models")
    other = synth("tiny", d / "other.gguf", seed=1)
    ref = {}
    for target in ("tq2_0", "hf"):
        for name, src in (("new", tiny_gguf), ("old", other)):
            out = d / f"{name}-{target}"
            convert(src, out, target)
            ref[target, name] = out
    return tiny_gguf, ref


def content(path):
    """Bytes of a file, or {name: bytes} of a folder, or None if absent."""
    if not os.path.lexists(path):
        return None
    if path.is_dir():
        return {p.name: p.read_bytes() for p in sorted(path.iterdir())}
    return path.read_bytes()


def place(ref, path):
    if ref.is_dir():
        shutil.copytree(ref, path)
    else:
        shutil.copy(ref, path)


def paused_convert(src, out, target, moment, exchange=True):
    """Start the CLI converting ``src``; return it once it stopped at ``moment``."""
    head = [sys.executable, "-c", NO_EXCHANGE] if not exchange else [
        sys.executable, "-m", "bitformat.cli"]
    env = {**os.environ, PAUSE_VAR: moment}
    p = subprocess.Popen([*head, "convert", str(src), "--to", target, "-o", str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    seen = []
    for line in p.stderr:
        seen.append(line)
        if f"paused at {moment}" in line:
            return p
    p.wait()
    raise AssertionError(f"never paused at {moment}: exit {p.returncode}, {''.join(seen)}")


def kill(p, sig):
    p.send_signal(sig)
    out, err = p.communicate(timeout=60)
    if sig == signal.SIGTERM:
        assert p.returncode == 143 and "terminated" in err, (p.returncode, err)
    else:
        assert p.returncode == -signal.SIGKILL
    return err


def run_case(tmp_path, models, target, moment, in_place, sig, with_old, exchange=True):
    src0, ref = models
    src = tmp_path / "src.gguf"
    shutil.copy(src0, src)
    out = tmp_path / ("out" if target == "hf" else "out.gguf")
    old = content(ref[target, "old"]) if with_old else None
    new = content(ref[target, "new"])
    if with_old:
        place(ref[target, "old"], out)
    kill(paused_convert(src, out, target, moment, exchange), sig)
    assert src.read_bytes() == src0.read_bytes(), "the source changed"
    now = content(out)
    allowed = [new] if in_place else [old]
    if moment == "moved-aside" and sig == signal.SIGKILL:
        allowed = [None]  # killed between the two renames: the old output is hidden
    assert now in allowed, f"{moment}: the target is neither the old nor the new version"
    strays = [n for n in os.listdir(tmp_path) if n.startswith(f".{out.name}.")]
    if sig == signal.SIGKILL and not in_place:
        assert strays, "nothing left for the next run to clean up"  # so that part is tested
    if sig == signal.SIGTERM:
        assert sorted(os.listdir(tmp_path)) == sorted(
            [src.name] + ([out.name] if now is not None else [])), "SIGTERM left a stray"
    if moment == "moved-aside" and sig == signal.SIGKILL:
        from bitformat.io.atomic import remove_strays

        remove_strays(out)  # what the next write does first: the old output comes back
        assert content(out) == old
    convert(src, out, target)  # the next run
    assert content(out) == new
    assert sorted(os.listdir(tmp_path)) == sorted([src.name, out.name]), "a stray survived"


@pytest.mark.parametrize("target", ["tq2_0", "hf"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["KILL", "TERM"])
@pytest.mark.parametrize("moment, in_place", MOMENTS, ids=[m for m, _ in MOMENTS])
def test_killed_convert_over_an_old_version(tmp_path, models, target, sig, moment, in_place):
    run_case(tmp_path, models, target, moment, in_place, sig, with_old=True)


@pytest.mark.parametrize("target", ["tq2_0", "hf"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["KILL", "TERM"])
def test_killed_convert_to_a_new_path(tmp_path, models, target, sig):
    run_case(tmp_path, models, target, "tensor:3", False, sig, with_old=False)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["KILL", "TERM"])
@pytest.mark.parametrize("moment, in_place", [("moved-aside", False), ("committed", True)],
                         ids=["moved-aside", "committed"])
def test_killed_folder_replacement_without_exchange(tmp_path, models, sig, moment, in_place):
    run_case(tmp_path, models, "hf", moment, in_place, sig, with_old=True, exchange=False)


@pytest.mark.parametrize("target", ["tq2_0", "hf"])
def test_concurrent_convert_keeps_the_live_writers_temporary(tmp_path, models, target):
    """A second convert to the same target does not take the first one's temporary for a
    stray; the first, terminated afterwards, removes it itself."""
    src0, ref = models
    src = tmp_path / "src.gguf"
    shutil.copy(src0, src)
    out = tmp_path / ("out" if target == "hf" else "out.gguf")
    first = paused_convert(src, out, target, "tensor:3")
    live = [n for n in os.listdir(tmp_path) if n.endswith(".partial")]
    assert len(live) == 1
    convert(src, out, target)
    assert content(out) == content(ref[target, "new"])
    assert sorted(os.listdir(tmp_path)) == sorted([src.name, out.name, *live])
    kill(first, signal.SIGTERM)
    assert sorted(os.listdir(tmp_path)) == sorted([src.name, out.name])
    assert content(out) == content(ref[target, "new"])
