"""Keeps numba's on-disk cache of the ``cpu`` kernels consistent with their sources.

numba caches each compiled function (``cache=True``) under ``__pycache__`` beside its file and
reuses it while *that file* is unchanged. The kernels here call helpers and intrinsics of
their sibling files (decode.py inlines amx.py's tile loops and kernels.py's dots), so after a
change to one file (a ``git pull``, an edit in a working tree) a cached kernel of another can
keep the old code: at best stale speed, at worst instructions the new code no longer guards
(an AMX kernel compiled before it required GFNI ran on a check that had changed: "Illegal
instruction"). :func:`check` keeps a digest of every source file of this package beside the
cache and, when it differs, removes the package's cached kernels once, so they recompile.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
STAMP = "bitformat-kernel-sources.sha256"


def sources_digest(folder: Path = HERE) -> str:
    """sha256 over the names and bytes of the folder's ``.py`` files, in name order."""
    h = hashlib.sha256()
    for p in sorted(folder.glob("*.py")):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def check(folder: Path = HERE) -> bool:
    """Remove the folder's cached numba kernels if its sources changed since they were
    cached; True when it removed some. Does nothing where ``__pycache__`` is not writable
    (numba then caches elsewhere) or the package is not a plain folder of files."""
    cache = folder / "__pycache__"
    stamp = cache / STAMP
    try:
        digest = sources_digest(folder)
        if stamp.is_file() and stamp.read_text().strip() == digest:
            return False
        removed = False
        if cache.is_dir():
            for f in list(cache.glob("*.nbi")) + list(cache.glob("*.nbc")):
                try:
                    f.unlink()
                    removed = True
                except FileNotFoundError:  # another process got there first
                    pass
        cache.mkdir(exist_ok=True)
        tmp = cache / f"{STAMP}.{os.getpid()}"
        tmp.write_text(digest + "\n")
        os.replace(tmp, stamp)
        return removed
    except OSError:
        return False
