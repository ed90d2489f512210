"""Atomic writers: strays of killed writes, folder replacement, refusals that protect data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from bitformat.errors import BitformatIOError, OutputPathError
from bitformat.io import atomic, atomic_folder
from bitformat.io.atomic import atomic_file, check_not_source, remove_strays
from bitformat.io.atomic_folder import MANIFEST, atomic_dir

needs_flock = pytest.mark.skipif(atomic.fcntl is None, reason="no flock on this platform")

HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(60)
"""


@pytest.fixture
def holder():
    """Start a process that holds a flock on a path (a live writer), stop it afterwards."""
    procs = []

    def hold(path):
        p = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE,
                             text=True)
        assert p.stdout.readline().strip() == "locked"
        procs.append(p)
        return p

    yield hold
    for p in procs:
        p.kill()
        p.wait()


def write(path, data=b"new"):
    with atomic_file(path) as fh:
        fh.write(data)


def listing(folder):
    return sorted(p.name for p in folder.iterdir())


# -- strays --------------------------------------------------------------------------------------
@needs_flock
def test_next_write_removes_only_stale_strays_of_its_target(tmp_path, holder):
    ours = [".x.gguf.abcd_123.partial", ".x.gguf.zzzzzzzz.old"]
    (tmp_path / ours[0]).write_bytes(b"half")
    (tmp_path / ours[1]).mkdir()
    (tmp_path / ours[1] / "model.safetensors").write_bytes(b"old")
    live = tmp_path / ".x.gguf.livelive.partial"
    live.write_bytes(b"being written")
    holder(live)
    others = [".x.gguf.abc.partial", ".y.gguf.abcdefgh.partial", "x.gguf.abcdefgh.partial",
              ".x.gguf.abcdefgh.partial.bak", ".x.gguf.ABCDEFGH.partial", ".x.gguf.partial"]
    for name in others:
        (tmp_path / name).write_bytes(b"not ours")
    write(tmp_path / "x.gguf")
    assert (tmp_path / "x.gguf").read_bytes() == b"new"
    assert listing(tmp_path) == sorted(["x.gguf", live.name, *others])
    assert live.read_bytes() == b"being written"


@needs_flock
def test_a_moved_aside_folder_is_put_back_when_the_output_is_missing(tmp_path):
    old = tmp_path / ".out.abcdefgh.old"
    old.mkdir()
    (old / "config.json").write_text("{}")
    older = tmp_path / ".out.olderold.old"
    older.mkdir()
    os.utime(older, (time.time() - 100, time.time() - 100))
    removed = remove_strays(tmp_path / "out")
    assert removed == [older.name]
    assert listing(tmp_path) == ["out"] and (tmp_path / "out" / "config.json").exists()


def test_a_claimed_name_taken_by_a_cleaner_is_given_up(tmp_path):
    """A cleaner may lock and delete a brand-new temporary before its writer locks it."""
    made = []

    def make():
        p = tmp_path / f".x.gguf.try{len(made):04d}.partial"
        p.write_bytes(b"")
        made.append(p)
        if len(made) == 1:
            p.unlink()  # the cleaner won the race for the first name
        return str(p)

    path, fd = atomic.claim(make)
    os.close(fd)
    assert path == str(made[1]) and len(made) == 2


def test_failed_write_leaves_nothing_and_keeps_the_old_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"precious")
    with pytest.raises(RuntimeError):
        with atomic_file(tmp_path / "x.gguf") as fh:
            fh.write(b"half")
            raise RuntimeError("disk full")
    assert listing(tmp_path) == ["x.gguf"] and (tmp_path / "x.gguf").read_bytes() == b"precious"


def test_file_output_onto_a_folder_is_refused_before_writing(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(OutputPathError, match="is a folder"):
        write(tmp_path / "d")
    assert listing(tmp_path) == ["d"]


# -- folders ----------------------------------------------------------------------------------
def export(path, files):
    with atomic_dir(path) as tmp:
        for name, text in files.items():
            (tmp / name).write_text(text)


def test_folder_export_has_a_manifest_and_replaces_its_own_export(tmp_path):
    out = tmp_path / "out"
    export(out, {"config.json": "{1}", "model.safetensors": "aaa"})
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["files"] == {"config.json": 3, "model.safetensors": 3}
    export(out, {"config.json": "{2}"})
    assert listing(out) == sorted([MANIFEST, "config.json"])
    assert (out / "config.json").read_text() == "{2}"
    assert listing(tmp_path) == ["out"]


def test_replacing_without_rename_exchange(tmp_path, monkeypatch):
    """Where RENAME_EXCHANGE is missing: move aside, move in; a failure moves the old back."""
    monkeypatch.setattr(atomic_folder, "_renameat2", lambda *a: False)
    out = tmp_path / "out"
    export(out, {"config.json": "{1}"})
    export(out, {"config.json": "{2}"})
    assert (out / "config.json").read_text() == "{2}" and listing(tmp_path) == ["out"]
    real = os.rename

    def failing(src, dst):
        if str(src).endswith(".partial"):
            raise OSError(28, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(atomic_folder.os, "rename", failing)
    with pytest.raises(BitformatIOError, match="No space left"):
        export(out, {"config.json": "{3}"})
    assert (out / "config.json").read_text() == "{2}" and listing(tmp_path) == ["out"]


@pytest.mark.skipif(sys.platform != "linux", reason="renameat2 is Linux")
def test_rename_exchange_swaps_two_folders(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "in_a").touch()
    if not atomic_folder._renameat2(a, b, atomic_folder._RENAME_EXCHANGE):
        pytest.skip("this file system has no RENAME_EXCHANGE")
    assert listing(b) == ["in_a"] and listing(a) == []


@pytest.mark.parametrize("case", ["other files", "no manifest", "added file", "edited file",
                                  "bad manifest"])
def test_folders_bitformat_did_not_write_are_never_replaced(tmp_path, case):
    out = tmp_path / "mymodels"
    if case == "other files":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    else:
        export(out, {"config.json": "{1}"})
        if case == "no manifest":
            (out / MANIFEST).unlink()
        elif case == "added file":
            (out / "README.md").write_text("mine")
        elif case == "edited file":
            (out / "config.json").write_text("{'edited': 1}")
        else:
            (out / MANIFEST).write_text("[" * 5000)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(OutputPathError, match="bitformat replaces only folders it wrote"):
        export(out, {"config.json": "{2}"})
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert listing(tmp_path) == ["mymodels"]


def test_empty_folder_may_be_replaced(tmp_path):
    (tmp_path / "out").mkdir()
    export(tmp_path / "out", {"config.json": "{}"})
    assert (tmp_path / "out" / "config.json").exists()


def test_current_folder_file_and_symlink_targets_are_refused(tmp_path, monkeypatch):
    (tmp_path / "x.gguf").write_bytes(b"model")
    (tmp_path / "sub").mkdir()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "link")
    monkeypatch.chdir(tmp_path / "sub")
    for target, msg in ((".", "current folder"), ("..", "current folder"),
                        (tmp_path / "x.gguf", "is a file"), (tmp_path / "link", "symbolic")):
        with pytest.raises(OutputPathError, match=msg):
            export(target, {"config.json": "{}"})
    assert listing(tmp_path) == ["elsewhere", "link", "sub", "x.gguf"]
    assert listing(tmp_path / "sub") == [] and listing(tmp_path / "elsewhere") == []


def test_outputs_that_would_destroy_the_source(tmp_path):
    src = tmp_path / "m" / "x.gguf"
    src.parent.mkdir()
    src.write_bytes(b"model")
    check_not_source(src, src, folder=False)  # a file over itself is atomic: allowed
    for out, folder, msg in ((src, True, "is the source"), (src.parent, True, "holds the source"),
                             (tmp_path, False, "holds the source"),
                             (src.parent, False, "holds the source")):
        with pytest.raises(OutputPathError, match=msg):
            check_not_source(src, out, folder=folder)
    os.link(src, tmp_path / "hard.gguf")
    with pytest.raises(OutputPathError, match="is the source"):
        check_not_source(src, tmp_path / "hard.gguf", folder=True)
    hf = tmp_path / "hf"
    hf.mkdir()
    with pytest.raises(OutputPathError, match="is the source"):
        check_not_source(hf, hf, folder=True)
    with pytest.raises(OutputPathError, match="is the source"):
        check_not_source(hf, hf, folder=False)


def test_convert_refuses_to_overwrite_its_source(tiny_gguf, tmp_path):
    from click.testing import CliRunner

    from bitformat.cli import main

    src = tmp_path / "x.gguf"
    src.write_bytes(tiny_gguf.read_bytes())
    r = CliRunner().invoke(main, ["convert", str(src), "--to", "hf", "-o", str(src)])
    assert r.exit_code == 1 and "is the source" in r.output, r.output
    r = CliRunner().invoke(main, ["convert", str(src), "--to", "hf", "-o", str(tmp_path)])
    assert r.exit_code == 1 and "holds the source" in r.output, r.output
    assert listing(tmp_path) == ["x.gguf"] and src.read_bytes() == tiny_gguf.read_bytes()
