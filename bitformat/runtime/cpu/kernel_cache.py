"""Keeps numba's on-disk cache of the ``cpu`` kernels (and the codecs' they inline)
consistent with their sources.

numba caches each compiled function (``cache=True``) under ``__pycache__`` beside its file and
reuses it while *that file* is unchanged. The kernels here call helpers and intrinsics of
their sibling files (decode.py inlines amx.py's tile loops and kernels.py's dots), so after a
change to one file (a ``git pull``, an edit in a working tree) a cached kernel of another can
keep the old code: at best stale speed, at worst instructions the new code no longer guards
(an AMX kernel compiled before it required GFNI ran on a check that had changed: "Illegal
instruction"). :func:`check` keeps a digest of every source file of this package, of
``codecs/`` and of ``formats/`` (whose kernels inline the codecs' rANS step) beside the cache
and, when it differs, removes the three folders' cached kernels once, so they recompile.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: the codecs' kernels, which the cpu backend's inline (the rANS decode step and stream start)
CODECS = HERE.parents[1] / "codecs"
#: the formats' kernels (rans_float), which inline the codecs' decode step
FORMATS = HERE.parents[1] / "formats"
#: the folders kept consistent together: the first holds the digest
FOLDERS = (HERE, CODECS, FORMATS)
STAMP = "bitformat-kernel-sources.sha256"


def sources_digest(*folders: Path) -> str:
    """sha256 over the names and bytes of the folders' ``.py`` files, in name order
    (:data:`FOLDERS` by default)."""
    h = hashlib.sha256()
    for folder in folders or FOLDERS:
        h.update(str(folder.name).encode() + b"/\0")
        for p in sorted(folder.glob("*.py")):
            h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def check(*folders: Path) -> bool:
    """Remove the folders' cached numba kernels (:data:`FOLDERS` by default) if any of their
    sources changed since they were cached; True when it removed some. Does nothing where
    ``__pycache__`` is not writable (numba then caches elsewhere) or the package is not a
    plain folder of files."""
    folders = folders or FOLDERS
    stamp = folders[0] / "__pycache__" / STAMP
    try:
        digest = sources_digest(*folders)
        if stamp.is_file() and stamp.read_text().strip() == digest:
            return False
        removed = False
        for folder in folders:
            cache = folder / "__pycache__"
            if cache.is_dir():
                for f in list(cache.glob("*.nbi")) + list(cache.glob("*.nbc")):
                    try:
                        f.unlink()
                        removed = True
                    except FileNotFoundError:  # another process got there first
                        pass
        stamp.parent.mkdir(exist_ok=True)
        tmp = stamp.parent / f"{STAMP}.{os.getpid()}"
        tmp.write_text(digest + "\n")
        os.replace(tmp, stamp)
        return removed
    except OSError:
        return False
