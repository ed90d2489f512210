"""Where the cpu backend keeps the weights it reads on every token: anonymous memory (huge
pages), the ternary matrices in one arena in the order a token reads them."""

from __future__ import annotations

import numpy as np

from ...io.mapping import drop_pages


def resident_copy(raw: np.ndarray, chunk: int = 32 << 20,
                  out: np.ndarray | None = None) -> np.ndarray:
    """``raw`` copied into anonymous memory (``out``, or a new array), read-only.

    numpy asks for transparent huge pages for arrays of 4 MiB and more. For the tensors read
    on every token that matters: on 4 KiB pages of a file mapping the LM head streamed 23 GB/s,
    from huge pages 28-29 (2B-4T, 2 threads), and the ternary matrices went from 16 to 21-24
    GB/s (:class:`CpuBackend` copies them into one arena). Where ``raw`` views a read-only file
    mapping (a GGUF), each copied chunk is dropped from this process's mapping again
    (``MADV_DONTNEED`` only unmaps those pages; a later read faults them back in from the page
    cache), so the resident size does not count the tensor twice.
    """
    out = np.empty_like(raw) if out is None else out
    flat_in, flat_out = raw.reshape(-1), out.reshape(-1)
    step = chunk // max(raw.itemsize, 1)
    for i in range(0, flat_in.size, step):
        flat_out[i: i + step] = flat_in[i: i + step]
        drop_pages(flat_in, i * raw.itemsize, min(i + step, flat_in.size) * raw.itemsize)
    out.setflags(write=False)
    return out


class WeightArena:
    """One anonymous buffer holding every ternary matrix's container bytes, in order of use.

    The model asks for its matrices layer by layer, q to down, which is the order a token reads
    them, so a decode step streams one contiguous region: hardware prefetchers run across
    matrix boundaries, and one allocation of hundreds of MB gets huge pages where the OS gives
    them (many small ones would not). Each slot starts on a 64-byte line. The bytes are the
    container's own (a copy, not a decoding). Matrices that do not fit (none, when ``size``
    counts every ternary tensor) get a copy of their own.
    """

    ALIGN = 64

    def __init__(self, size: int):
        self.buf = None
        if size:
            buf = np.empty(size + self.ALIGN, np.uint8)
            skip = -buf.ctypes.data % self.ALIGN
            self.buf = buf[skip: skip + size]
        self.used = 0

    def copy(self, raw: np.ndarray) -> np.ndarray:
        return resident_copy(raw, out=self.take(raw.shape, raw.dtype))

    def take(self, shape: tuple[int, ...], dtype: np.dtype = np.uint8) -> np.ndarray:
        """The next slot, writable, for an array of ``shape`` (a new array if none is left)."""
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if self.buf is None or self.used + n > self.buf.size:
            return np.empty(shape, dtype)
        out = self.buf[self.used: self.used + n].view(dtype).reshape(shape)
        self.used += -(-n // self.ALIGN) * self.ALIGN
        return out
