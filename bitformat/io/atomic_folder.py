"""Atomic folders (the hf export): a sibling temporary folder swapped in at the end.

Folders bitformat exports carry a manifest (:data:`MANIFEST`: the name and size of every file).
An existing folder is replaced only if it is empty or holds exactly what its manifest lists:
a folder bitformat did not write, or one a user has added to or edited since, is refused.
Temporary names, locks and strays work as for files (:mod:`.atomic`); what is and is not
atomic is in docs/reliability.md ("Atomic writes").
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ..errors import BitformatIOError, OutputPathError
from .atomic import LIVE, checkpoint, claim, current_umask, fcntl, fsync_dir, remove_strays

#: The manifest every folder written by :func:`atomic_dir` holds.
MANIFEST = ".bitformat-export.json"


def check_folder_target(target: Path, shown: str | None = None) -> None:
    """Refuse a folder output that bitformat must not replace (see the module docstring);
    ``shown`` is the path as the user gave it, for messages."""
    shown = shown or str(target)
    here = Path.cwd().resolve()
    real = target.resolve()
    if real == here or real in here.parents:
        raise OutputPathError("is the current folder or holds it; give a new folder's path",
                              path=shown)
    if target.is_symlink():
        raise OutputPathError("is a symbolic link; give a folder's own path", path=shown)
    if not os.path.lexists(target):
        return
    if not target.is_dir():
        raise OutputPathError("is a file; an hf export is a folder: give a new folder's path",
                              path=shown)
    problem = foreign_content(target)
    if problem:
        raise OutputPathError(f"{problem}; bitformat replaces only folders it wrote itself. "
                              "Give a new folder's path (or remove this one yourself)",
                              path=shown)


def foreign_content(folder: Path) -> str | None:
    """Why ``folder`` is not exactly an export bitformat wrote, or None (also if empty)."""
    names = {e.name: e for e in os.scandir(folder)}
    if not names:
        return None
    if MANIFEST not in names:
        return f"is a folder without bitformat's {MANIFEST}"
    try:
        listed = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))["files"]
        listed = {str(k): int(v) for k, v in listed.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return f"has an unreadable {MANIFEST}"
    extra = sorted(set(names) - set(listed) - {MANIFEST})
    if extra:
        return f"holds files bitformat did not write ({', '.join(extra[:5])})"
    for name, size in listed.items():
        e = names.get(name)
        if e is None or not e.is_file(follow_symlinks=False) or e.stat().st_size != size:
            return f"was changed since bitformat wrote it ({name})"
    return None


def _write_manifest(folder: Path) -> None:
    files = {e.name: e.stat().st_size for e in sorted(os.scandir(folder), key=lambda e: e.name)
             if e.is_file(follow_symlinks=False)}
    (folder / MANIFEST).write_text(json.dumps({"written_by": "bitformat", "files": files},
                                              indent=1) + "\n", encoding="utf-8")


def _fsync_tree(folder: Path) -> None:
    for e in os.scandir(folder):
        if e.is_file(follow_symlinks=False):
            fd = os.open(e.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(folder)


_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2


def _renameat2(src: str | os.PathLike, dst: str | os.PathLike, flags: int) -> bool:
    """Linux renameat2(2) through libc; False where the call or the flag is not supported."""
    if sys.platform != "linux":
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # libc without renameat2 (glibc < 2.28, some musl)
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd = -100
    if fn(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False  # kernel or file system without it
    raise OSError(err, os.strerror(err), str(dst))


@contextlib.contextmanager
def _commit_lock(parent: Path) -> Iterator[None]:
    """Serialise the rename step of writes into one folder (two converts to one target)."""
    try:
        fd = os.open(parent, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        if fcntl is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _swap_in(tmp: Path, target: Path) -> Path | None:
    """Put the finished folder ``tmp`` at ``target``; return where the old output now is.

    An existing target is exchanged with ``tmp`` in one step where Linux allows it
    (``RENAME_EXCHANGE``): no moment without an output. Elsewhere the old folder is moved
    aside to ``.NAME.XXXXXXXX.old``, the new one put in place, and on failure the old one
    is moved back; a process killed between the two renames leaves no output, and the next
    write to the target puts the old one back (:func:`remove_strays`).
    """
    if not os.path.lexists(target):
        if not _renameat2(tmp, target, _RENAME_NOREPLACE):
            os.rename(tmp, target)
        return None
    if _renameat2(tmp, target, _RENAME_EXCHANGE):
        return tmp
    old = tmp.with_name(tmp.name[: -len(".partial")] + ".old")
    keep = os.open(target, os.O_RDONLY)  # lock the old folder: not a stray while we move it
    try:
        if fcntl is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(keep, fcntl.LOCK_EX)
        os.rename(target, old)
        try:
            checkpoint("moved-aside")
            os.rename(tmp, target)
        except BaseException:
            os.rename(old, target)
            raise
    finally:
        os.close(keep)
    return old


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh folder that replaces the folder ``path`` only on success.

    Refused up front (:class:`OutputPathError`) where ``path`` is a file, the current folder,
    or a folder bitformat did not write (:func:`foreign_content`). On success the folder holds
    a :data:`MANIFEST`, every file and the parent folder are synced, and the old output is gone.
    """
    target = Path(os.path.abspath(path))
    parent = target.parent
    check_folder_target(target, str(path))
    remove_strays(target)
    try:
        tmp_name, lock = claim(lambda: tempfile.mkdtemp(prefix=f".{target.name}.",
                                                         suffix=".partial", dir=parent))
    except OSError as exc:
        raise BitformatIOError(f"cannot create a folder next to it: {exc.strerror}",
                               path=str(path)) from None
    tmp = Path(tmp_name)
    old = None
    committed = False
    LIVE.add(tmp_name)
    try:
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes it 0700
        checkpoint("created")
        yield tmp
        checkpoint("written")
        _write_manifest(tmp)
        _fsync_tree(tmp)
        with _commit_lock(parent):
            check_folder_target(target, str(path))  # it may have appeared or changed meanwhile
            old = _swap_in(tmp, target)
            committed = True
        checkpoint("committed")
        fsync_dir(parent)
    except BaseException as exc:
        if not committed:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and not isinstance(exc, BitformatIOError):
            raise BitformatIOError(f"write failed: {exc.strerror or exc}",
                                   path=str(path)) from exc
        raise
    finally:
        LIVE.discard(tmp_name)
        os.close(lock)
        if old is not None:  # also after a signal: the old output is garbage now
            shutil.rmtree(old, ignore_errors=True)
