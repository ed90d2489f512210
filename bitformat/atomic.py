"""Atomic writes: a sibling temporary file or folder, renamed over the target at the end.

Converting a file onto itself, a full disk or Ctrl-C therefore never leaves a half-written
output, and the source (which may be memory-mapped by the reader) is never truncated.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from .errors import BitformatIOError


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """Yield a binary file that replaces ``path`` only if the block finishes cleanly."""
    target = Path(path)
    directory = target.parent if str(target.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=directory)
    except OSError as exc:
        raise BitformatIOError(f"cannot create a file next to it: {exc.strerror}",
                               path=str(target)) from None
    try:
        # mkstemp makes the file 0600; give it what a plain open() would (or the old mode).
        os.chmod(tmp, _mode_for(target))
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and not isinstance(exc, BitformatIOError):
            raise BitformatIOError(f"write failed: {exc.strerror or exc}",
                                   path=str(target)) from exc
        raise


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _mode_for(target: Path) -> int:
    try:
        return target.stat().st_mode & 0o777
    except OSError:
        return 0o666 & ~_umask()


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh folder that replaces the folder ``path`` only on success."""
    target = Path(path)
    parent = target.parent if str(target.parent) else Path(".")
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=parent))
    except OSError as exc:
        raise BitformatIOError(f"cannot create a folder next to it: {exc.strerror}",
                               path=str(target)) from None
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700
        yield tmp
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=parent))
            os.replace(target, old / "x")
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
