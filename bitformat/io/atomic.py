"""Atomic writes: a sibling temporary file or folder, renamed over the target at the end.

Converting a file onto itself, a full disk, Ctrl-C or SIGTERM therefore never leaves a
half-written output, and the source (which may be memory-mapped by the reader) is never
truncated. What is and is not atomic, per container and for folders, is in
docs/reliability.md ("Atomic writes").

Temporary names are ``.NAME.XXXXXXXX.partial`` (``XXXXXXXX`` from :mod:`tempfile`), next to
the target ``NAME``; a folder replaced without an atomic exchange is moved aside as
``.NAME.XXXXXXXX.old`` for a moment. The writer holds an exclusive ``flock`` on its temporary
for as long as it writes. A process killed with SIGKILL cannot remove its temporary, so every
write first removes the strays of its own target: entries with exactly that name pattern,
owned by this user, whose lock it can take (so their writer is dead; a concurrent write to the
same target keeps its lock and its file).

Folders: :mod:`.atomic_folder`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from ..errors import BitformatIOError, OutputPathError

try:
    import fcntl
except ImportError:  # Windows: no flock; strays are then removed by age (STALE_SECONDS)
    fcntl = None

#: Where locks cannot be taken (no flock, or the file system refuses it), strays older than
#: this are taken as stale.
STALE_SECONDS = 24 * 3600
#: Test hook: ``BITFORMAT_PAUSE_AT=<moment>`` stops the process at that moment (see
#: :func:`checkpoint`; tests/test_kill.py kills it there).
PAUSE_VAR = "BITFORMAT_PAUSE_AT"

_counts: dict[str, int] = {}
#: temporaries being written right now (files and folders), for a hard exit to remove
#: (:mod:`.interrupts`: a signal the normal path could not handle in time)
LIVE: set[str] = set()


def remove_live() -> None:
    """Remove every temporary an atomic writer of this process is still writing."""
    for p in list(LIVE):
        with contextlib.suppress(OSError):
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                os.unlink(p)
        LIVE.discard(p)


def checkpoint(moment: str) -> None:
    """Pause here, forever, if ``$BITFORMAT_PAUSE_AT`` names this moment (tests only).

    Moments: ``created`` (the temporary exists, nothing written), ``tensor:K`` (the writer
    finished its K-th tensor), ``written`` (all data written, not yet synced), ``moved-aside``
    (a folder replaced without exchange: the old one is hidden, the new one not yet in place),
    ``committed`` (the output is in place, the directory not yet synced).
    """
    want = os.environ.get(PAUSE_VAR)
    if not want:
        return
    if moment == "tensor":
        _counts[moment] = _counts.get(moment, 0) + 1
        moment = f"tensor:{_counts[moment]}"
    if want == moment:
        print(f"bitformat: paused at {moment} ({PAUSE_VAR})", file=sys.stderr, flush=True)
        while True:  # short sleeps: a signal taken by another thread (numba's workers) still
            time.sleep(0.05)  # reaches the main thread's handler within one of them


# -- locks and strays -----------------------------------------------------------------------------
def _try_lock(fd: int) -> bool | None:
    """Take an exclusive flock without waiting: True, False (held elsewhere), None (no flock)."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as exc:  # e.g. ENOLCK, EOPNOTSUPP on some network file systems
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        return None


def _stray_re(name: str) -> re.Pattern[str]:
    return re.compile(rf"\.{re.escape(name)}\.[a-z0-9_]{{8}}\.(partial|old)")


def remove_strays(target: str | os.PathLike, *, restore: bool = True) -> list[str]:
    """Remove what killed writes to ``target`` left next to it; return the names removed.

    Only entries named ``.NAME.XXXXXXXX.partial`` or ``.old``, owned by this user, that no
    live process holds locked. If ``target`` itself is missing (killed between the two
    renames that replace a folder without an exchange) and ``restore``, the newest stale
    ``.old`` folder is the previous output and is put back instead of being removed.
    """
    target = Path(target)
    parent = target.parent
    pattern = _stray_re(target.name)
    try:
        entries = [e for e in os.scandir(parent) if pattern.fullmatch(e.name)]
    except OSError:
        return []
    removed, olds = [], []
    for e in sorted(entries, key=_mtime, reverse=True):
        with _locked_stray(e) as path:
            if path is None:
                continue
            if (restore and path.name.endswith(".old") and not olds
                    and not os.path.lexists(target)):
                with contextlib.suppress(OSError):
                    os.rename(path, target)
                    olds.append(path.name)
                    continue
            _remove(path)
            removed.append(path.name)
    return removed


def _mtime(e: os.DirEntry) -> float:
    try:
        return e.stat(follow_symlinks=False).st_mtime
    except OSError:
        return 0.0


@contextlib.contextmanager
def _locked_stray(e: os.DirEntry) -> Iterator[Path | None]:
    """Yield the stray's path while holding its lock, or None if it is not ours or is live."""
    path = Path(e.path)
    try:
        st = e.stat(follow_symlinks=False)
        if not (e.is_dir(follow_symlinks=False) or e.is_file(follow_symlinks=False)):
            yield None
            return
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            yield None
            return
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        yield None
        return
    try:
        got = _try_lock(fd)
        same = os.path.samestat(os.fstat(fd), st)
        stale = got is True or (got is None and time.time() - st.st_mtime > STALE_SECONDS)
        yield path if stale and same else None
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def claim(make: Callable[[], str]) -> tuple[str, int]:
    """Create a temporary with ``make`` and lock it: (path, lock fd).

    A cleaner in another process may lock and remove a brand-new temporary before its
    writer locks it; the writer then finds its path gone (or another file there) and starts
    again with a new name.
    """
    for _ in range(100):
        tmp = make()
        try:
            fd = os.open(tmp, os.O_RDONLY)
        except FileNotFoundError:
            continue
        if fcntl is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.path.samestat(os.stat(tmp, follow_symlinks=False), os.fstat(fd)):
                return tmp, fd
        except OSError:
            pass
        os.close(fd)
    raise BitformatIOError("cannot claim a temporary name next to it", path=tmp)


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a rename in ``directory`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a folder; the rename stands anyway
    finally:
        os.close(fd)


# -- files -------------------------------------------------------------------------------------
def current_umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _mode_for(target: Path) -> int:
    try:
        return target.stat().st_mode & 0o777
    except OSError:
        return 0o666 & ~current_umask()


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """Yield a binary file that replaces ``path`` only if the block finishes cleanly."""
    target = Path(path)
    directory = target.parent
    if target.is_dir():
        raise OutputPathError("is a folder; give the path of a file to write", path=str(target))
    remove_strays(target, restore=False)
    try:
        tmp, lock = claim(lambda: _mkstemp(target))
    except OSError as exc:
        raise BitformatIOError(f"cannot create a file next to it: {exc.strerror}",
                               path=str(target)) from None
    committed = False
    LIVE.add(tmp)
    try:
        # mkstemp makes the file 0600; give it what a plain open() would (or the old mode).
        os.chmod(tmp, _mode_for(target))
        with open(tmp, "r+b") as fh:
            checkpoint("created")
            yield fh
            fh.flush()
            checkpoint("written")
            os.fsync(fh.fileno())
        os.replace(tmp, target)
        committed = True
        checkpoint("committed")
        fsync_dir(directory)
    except BaseException as exc:
        if not committed:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if isinstance(exc, OSError) and not isinstance(exc, BitformatIOError):
            raise BitformatIOError(f"write failed: {exc.strerror or exc}",
                                   path=str(target)) from exc
        raise
    finally:
        LIVE.discard(tmp)
        os.close(lock)


def _mkstemp(target: Path) -> str:
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    os.close(fd)
    return tmp


def check_not_source(source: str | os.PathLike, out: str | os.PathLike, *, folder: bool) -> None:
    """Refuse an output that would destroy the source while it is read.

    A file written over its own source is fine (the new file replaces it only when complete,
    and a reader's memory map keeps the old bytes); a folder output that is the source, or
    holds it, is refused, as is a file output that holds a source folder.
    """
    src, dst = Path(source).resolve(), Path(out).resolve()
    same = src == dst
    with contextlib.suppress(OSError):
        same = same or os.path.samefile(src, dst)
    if same and (folder or src.is_dir()):
        named = "" if str(source) == str(out) else f" {source}"
        raise OutputPathError(f"is the source{named} itself; give another output path",
                              path=str(out))
    if dst in src.parents:
        raise OutputPathError(f"holds the source {source}; give another output path",
                              path=str(out))
