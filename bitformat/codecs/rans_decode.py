"""Decoding a ``rans`` matrix (docs/formats/rans.md), for every backend: the kernel arrays of
one tensor (:class:`RansWeight`, :func:`rans_weight`), the one-lookup decode tables, the
decode step and a stream's start, and the trits of each symbol. The cpu backend's fused
mat-vecs (:mod:`bitformat.runtime.cpu.rans`) and the decode at load into stfma rows
(:mod:`.rans_rows`, which the cpu and wgpu backends use) both run this step; the encoder and
the plain decoder are :mod:`.rans_kernels`, whose state start is used here.

The coder is the container's (64-bit state, 32-bit words, 24-bit precision, frequencies
multiples of 2^12), and the step takes one lookup instead of three: every table's frequencies
and cumulatives are multiples of 2^12, so for ``slot = q >> 12`` one u32
``dec[slot] = sym | f_u << 8 | (slot - cdf_u) << 20`` (``f = f_u << 12``, ``cdf = cdf_u << 12``)
gives the whole step::

    q = state & 0xFFFFFF;  e = dec[q >> 12]
    state = ((state >> 24) * f_u + (e >> 20)) << 12 | (q & 0xFFF)   (= (state >> 24) f + q - cdf)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from ..formats import rans as R
from . import rans_tables as rt
from .rans_kernels import _init_state
from .rans_streams import RansTables

_U = np.uint64
_MASK = _U((1 << 24) - 1)
_LOW = _U((1 << 12) - 1)
_BIG = _U(1 << 32)
#: every kernel and helper here: cached, GIL released, numpy's error model. The helpers are
#: separate numba functions rather than inlined into their callers' IR (``inline="always"``
#: made the fused mat-vec take 37 s to compile instead of 2; LLVM inlines them all the same
#: and the fused decode runs as fast: 2B-4T at 0.55 tok/s either way, 2-core AMD EPYC)
_JIT = dict(cache=True, nogil=True, error_model="numpy")
LANES = 8  # streams decoded in lock-step by one thread (measured: 8 >= 6 > 4 > 2 > 1)


@dataclass
class RansWeight:
    """What the kernels read of one rans matrix: views of its words plus small index arrays."""

    rows: int
    cols: int
    data: np.ndarray  # uint32: the tensor's words as the container holds them (memory-mapped)
    word_off: np.ndarray  # int64 [S + 1]: where each stream starts in ``data``
    lrows: np.ndarray  # int32 [L]: live rows
    lcols: np.ndarray  # int64 [C]: live columns; empty when every column is live
    n_live_cols: int  # C
    colset: int  # the same number for the same live columns (activation tables are shared)
    k: int  # live rows per stream
    p: int  # pieces per row
    m0: np.ndarray  # int64 [p + 1]: first symbol column of each piece, ceil(cuts / group)
    group: int  # trits per symbol, 5 or 1
    cls: np.ndarray  # uint8 [L]: row class
    dec: np.ndarray  # uint32 [T, 4096]: the one-lookup decode table of each class
    scale: np.float32
    encoding: str = "rans"

    @property
    def work(self) -> int:
        """What the backend weighs a call by (SERIAL_BYTES, its thread choice): decoding, not
        reading, bounds rans, and a live trit decodes in about the time a 2-bit kernel
        streams 8 bytes (0.45 ns against 17 GB/s)."""
        return 8 * self.lrows.size * self.n_live_cols

    @property
    def n_sym(self) -> int:
        """Symbol columns of the live row (the last one padded with zero activations)."""
        return -(-self.n_live_cols // self.group)


def decode_tables(tables: RansTables) -> np.ndarray:
    """uint32 [T, 4096]: ``sym | f_u << 8 | (slot - cdf_u) << 20`` for every slot."""
    units = tables.units.astype(np.int64)
    cdf = np.cumsum(units, axis=1) - units
    slots = np.arange(rt.UNITS, dtype=np.int64)
    out = np.empty((units.shape[0], rt.UNITS), np.uint32)
    for t in range(units.shape[0]):
        sym = np.repeat(np.arange(units.shape[1], dtype=np.int64), units[t])
        out[t] = sym | units[t][sym] << 8 | (slots - cdf[t][sym]) << 20
    return out


def rans_weight(raw: np.ndarray, rows: int, cols: int, scale: float, name: str,
                colsets: dict[bytes, int], *, check_crc: bool = False,
                path: str | None = None) -> RansWeight:
    """Parse a rans tensor's bytes into kernel arrays (no stream is decoded).

    Every field is checked by the format's parser (:func:`bitformat.formats.rans.parse`; the
    CRC-32 only with ``check_crc``); the streams' contents are checked by whoever decodes
    them. ``colsets`` numbers the distinct live-column sets (shared by the matrices of one
    backend).
    """
    p = R.parse(raw, rows, cols, scale=scale, path=path, name=name, check_crc=check_crc)
    if raw.ctypes.data % 4:
        raw = raw.copy()
    data = raw.reshape(-1).view("<u4")
    geom, group = p.geometry, p.group
    n_cols = geom.live_cols
    lcols = p.live_cols if n_cols < cols else np.zeros(0, np.int64)
    colset = colsets.setdefault(lcols.tobytes(), len(colsets))
    cuts = geom.cuts() if geom.live_rows else np.zeros(2, np.int64)
    return RansWeight(rows, cols, data, p.word_off + p.stream_start,
                      p.live_rows.astype(np.int32), lcols, n_cols, colset,
                      max(geom.rows_per_stream, 1), max(geom.pieces, 1), -(-cuts // group),
                      group, p.classes, decode_tables(p.tables), np.float32(scale))


@njit(**_JIT)
def _start(words, word_off, i):
    """(state, pos, lo) of stream i; a corrupt start (last word 0) decodes as state 0."""
    lo = word_off[i]
    state, pos = _init_state(words, lo, word_off[i + 1])
    return state, (lo if pos < 0 else pos), lo


@njit(**_JIT)
def _step(state, pos, lo, words, dec):
    """One decode step without a branch: (symbol, state, pos).

    The next word is always loaded and kept only when the state needs it; at a stream's
    first word that load reads the word before it (``words`` is the whole tensor, whose
    streams come after its header), which is then unused. Unsigned indices spare numba's
    negative-index checks.
    """
    q = state & _MASK
    e = _U(dec[q >> _U(12)])
    state = (((state >> _U(24)) * ((e >> _U(8)) & _LOW) + (e >> _U(20))) << _U(12)) | (q & _LOW)
    more = (state < _BIG) & (pos > lo)
    wider = (state << _U(32)) | _U(words[np.uintp(pos - 1)])
    return np.uintp(e & _U(0xFF)), (wider if more else state), pos - np.intp(more)


def symbol_digits(group: int) -> np.ndarray:
    """int8 [A, group]: the trits of each symbol."""
    return rt.GROUP5_TRITS if group == 5 else np.array([[-1], [0], [1]], np.int8)


__all__ = ["LANES", "RansWeight", "decode_tables", "rans_weight", "symbol_digits"]
