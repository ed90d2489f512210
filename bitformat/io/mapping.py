"""Arrays that view a read-only file mapping, and giving their pages back after one read.

Readers memory-map their files (:class:`~bitformat.io.gguf.GGUFReader`), so a tensor read once
and kept in another form (decoded, or copied into anonymous memory) would otherwise stay in
the process's resident set twice. ``MADV_DONTNEED`` on a read-only file mapping only unmaps
those pages from this process: a later read faults them back in from the page cache.
"""

from __future__ import annotations

import mmap

import numpy as np


def file_mapping(arr: np.ndarray) -> tuple[mmap.mmap, int] | None:
    """(the read-only mmap ``arr`` views, ``arr``'s byte offset in it), or None."""
    mm = arr.base
    while isinstance(mm, (np.ndarray, memoryview)):
        mm = mm.base if isinstance(mm, np.ndarray) else mm.obj
    if not (isinstance(mm, mmap.mmap) and hasattr(mm, "madvise") and memoryview(mm).readonly):
        return None
    return mm, arr.ctypes.data - np.frombuffer(mm, np.uint8).ctypes.data


def drop_pages(arr: np.ndarray, start: int = 0, stop: int | None = None) -> None:
    """Unmap the whole pages of bytes ``start:stop`` of ``arr`` (a contiguous view of a
    read-only file mapping) from this process; anything else is left alone."""
    where = file_mapping(arr)
    if where is None:
        return
    mm, base = where
    stop = arr.nbytes if stop is None else stop
    lo = -(-(base + start) // mmap.PAGESIZE) * mmap.PAGESIZE
    hi = (base + stop) // mmap.PAGESIZE * mmap.PAGESIZE
    if hi > lo:
        mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


__all__ = ["drop_pages", "file_mapping"]
