"""rANS streams: checked Python entry points around the numba kernels.

Single streams (any alphabet of 2..256 symbols with a 12-bit-granular table):

* :func:`rans_encode` ``(symbols, freq, cdf) -> words``: the words constriction's
  ``AnsCoder.encode_reverse(symbols, model)`` + ``get_compressed()`` return.
* :func:`rans_decode` ``(words, freq, cdf, lut, n) -> symbols``.

Many independent streams (what a container stores): a flat array cut into segments by
``offsets`` (int64, ``S + 1`` entries, ``offsets[0] = 0``, ``offsets[-1]`` = length), one
stream per segment, each with its own table picked by ``table_index[i]`` from a
:class:`RansTables` stack. The result is one concatenated uint32 word array plus
``word_offsets`` (int64, ``S + 1``); stream i is ``words[word_offsets[i]:word_offsets[i + 1]]``,
itself a complete constriction stream.

* :func:`encode_trit_streams` / :func:`decode_trit_streams` work on int8 trits directly
  (symbols are formed and expanded inside the kernels; in ``group5`` mode each segment is
  padded with zero trits to a multiple of 5 on its own).
* :func:`encode_streams` / :func:`decode_streams` do the same for raw symbols.

``parallel=True`` runs the streams on numba's thread pool (``numba.set_num_threads``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import FormatError, InvalidTritError
from . import rans_tables as rt

# ``rans_kernels`` imports numba; it is loaded on first use so ``import bitformat`` stays light.


def _k():
    from . import rans_kernels

    return rans_kernels


# -- tables --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RansTables:
    """A stack of T coder tables for one symbol mode.

    ``stored`` is what a container keeps: ``[T, 3]`` trit unit tables (12-bit units summing
    to 4096), or in ``group5`` mode optionally ``[T, 243]`` explicit tables. ``units`` is the
    coder's table per entry and ``freqs``/``cdfs``/``luts`` its kernel form.
    """

    mode: str
    stored: np.ndarray
    units: np.ndarray
    freqs: np.ndarray
    cdfs: np.ndarray
    luts: np.ndarray

    @classmethod
    def from_stored(cls, mode: str, stored: Any) -> RansTables:
        """Build (and check) the tables from stored unit tables, one row per table."""
        stored = np.atleast_2d(np.asarray(stored, dtype=np.int64))
        if stored.ndim != 2 or stored.shape[0] < 1:
            raise FormatError(f"rANS tables must be [T, entries], got shape {stored.shape}")
        if mode == "group5" and stored.shape[1] == 3:
            units = rt.group5_units_many(stored)  # per-row tables: thousands at once
        else:
            units = np.stack([rt.symbol_units(mode, row.tolist()) for row in stored])
        freqs, cdfs, luts = rt.coder_tables(units)
        return cls(mode, stored, units, freqs, cdfs, luts)

    @classmethod
    def fit(cls, trits: np.ndarray, mode: str = "group5") -> RansTables:
        """One table from the trit counts of ``trits`` (largest-remainder 12-bit units)."""
        return cls.from_stored(mode, rt.trit_units(rt.count_trits(trits)))

    @property
    def group(self) -> int:
        return rt.GROUP[self.mode]

    def __len__(self) -> int:
        return self.stored.shape[0]


def check_coder_table(freq: np.ndarray, cdf: np.ndarray, lut: np.ndarray | None = None) -> None:
    """Raise :class:`FormatError` unless (freq, cdf[, lut]) is a 12-bit-granular 24-bit table."""
    freq = np.asarray(freq, dtype=np.int64)
    cdf = np.asarray(cdf, dtype=np.int64)
    a = freq.shape[0]
    if freq.ndim != 1 or not 2 <= a <= 256 or cdf.shape != (a + 1,):
        raise FormatError(f"rANS table needs 2..256 frequencies and one more cumulative, got "
                          f"{freq.shape} and {cdf.shape}")
    unit = 1 << rt.UNIT_SHIFT
    if (freq.min() < unit or np.any(freq % unit) or cdf[0] != 0
            or np.any(np.diff(cdf) != freq) or cdf[-1] != 1 << rt.PRECISION):
        raise FormatError("rANS table frequencies must be multiples of 4096, >= 4096, summing "
                          "to 2^24, with cdf their running sum")
    if lut is not None:
        want = np.repeat(np.arange(a), freq >> rt.UNIT_SHIFT)
        if lut.shape != (rt.UNITS,) or np.any(lut != want):
            raise FormatError("rANS lookup table does not match the frequencies")


# -- single streams ------------------------------------------------------------------------------
def rans_encode(symbols: np.ndarray, freq: np.ndarray, cdf: np.ndarray) -> np.ndarray:
    """Encode one stream; the result equals constriction's ``get_compressed()`` (uint32).

    Examples
    --------
    >>> units = rt.trit_units([30, 40, 30])
    >>> freq, cdf, lut = rt.coder_tables(units)
    >>> words = rans_encode(np.uint8([2, 1, 0, 1]), freq, cdf)
    >>> rans_decode(words, freq, cdf, lut, 4).tolist()
    [2, 1, 0, 1]
    """
    check_coder_table(freq, cdf)
    symbols = np.ascontiguousarray(symbols).reshape(-1)
    if symbols.size and (symbols.min() < 0 or symbols.max() >= freq.shape[0]):
        raise FormatError(f"symbols must lie in 0..{freq.shape[0] - 1}")
    k = _k()
    words = np.empty(k.capacity(symbols.size), dtype=np.uint32)
    end = k.encode_one(symbols, np.ascontiguousarray(freq, dtype=np.uint32),
                       np.ascontiguousarray(cdf, dtype=np.uint32), words)
    if end < 0:
        raise AssertionError("rANS word capacity exceeded (bug)")
    return words[:end].copy()


def rans_decode(words: np.ndarray, freq: np.ndarray, cdf: np.ndarray, lut: np.ndarray,
                n: int) -> np.ndarray:
    """Decode ``n`` symbols (uint8) from one stream; :class:`FormatError` if it is corrupt."""
    check_coder_table(freq, cdf, lut)
    out = np.empty(int(n), dtype=np.uint8)
    status = _k().decode_one(_as_words(words), np.ascontiguousarray(freq, dtype=np.uint32),
                             np.ascontiguousarray(cdf, dtype=np.uint32),
                             np.ascontiguousarray(lut, dtype=np.uint8), out)
    if status != 0:
        raise FormatError("rANS stream corrupt (final state not 0 or words left over)")
    return out


# -- many streams --------------------------------------------------------------------------------
def segment_offsets(n: int, segment: int) -> np.ndarray:
    """Offsets cutting ``n`` items into segments of ``segment`` (the last one shorter)."""
    if segment < 1:
        raise ValueError("segment must be >= 1")
    return np.append(np.arange(0, n, segment, dtype=np.int64), np.int64(n))


def row_segment_offsets(rows: int, cols: int, min_len: int = 4096, align: int = 5) -> np.ndarray:
    """Offsets giving each row of a row-major ``[rows, cols]`` matrix ``max(1, cols // min_len)``
    streams of near-equal length (about ``min_len`` or more; a row shorter than ``min_len`` is
    one stream). Cuts inside a row fall on multiples of ``align`` (5: no group5 padding except at
    the row's end).

    Examples
    --------
    >>> np.diff(row_segment_offsets(2, 6912)).tolist()
    [6912, 6912]
    >>> np.diff(row_segment_offsets(1, 10000, 4096)).tolist()
    [5000, 5000]
    """
    if rows < 0 or cols < 1 or min_len < 1 or align < 1:
        raise ValueError("rows >= 0, cols >= 1, min_len >= 1 and align >= 1 required")
    pieces = max(1, cols // min_len)
    cuts = (np.arange(pieces, dtype=np.int64) * cols // pieces) // align * align
    starts = (np.arange(rows, dtype=np.int64)[:, None] * cols + cuts).reshape(-1)
    return np.append(starts, np.int64(rows * cols))


def _as_words(words: Any) -> np.ndarray:
    """uint32 words from a uint32 array or from little-endian bytes."""
    w = np.asarray(words)
    if w.dtype == np.uint8:
        if w.size % 4:
            raise FormatError(f"rANS words: {w.size} bytes is not a whole number of words")
        w = np.frombuffer(np.ascontiguousarray(w).tobytes(), dtype="<u4")
    elif w.dtype != np.uint32:
        raise FormatError(f"rANS words must be uint32, got {w.dtype}")
    return np.ascontiguousarray(w.reshape(-1), dtype=np.uint32)


def _check_offsets(offsets: Any, total: int, what: str) -> np.ndarray:
    off = np.ascontiguousarray(offsets, dtype=np.int64).reshape(-1)
    if off.size < 1 or off[0] != 0 or off[-1] != total or np.any(np.diff(off) < 0):
        raise FormatError(f"{what} offsets must rise from 0 to {total}")
    return off


def _check_index(table_index: Any, n_streams: int, n_tables: int) -> np.ndarray:
    if table_index is None:
        if n_tables != 1:
            raise FormatError(f"{n_tables} tables need a table index per stream")
        return np.zeros(n_streams, dtype=np.int32)
    idx = np.ascontiguousarray(table_index, dtype=np.int32).reshape(-1)
    if idx.size != n_streams or (idx.size and (idx.min() < 0 or idx.max() >= n_tables)):
        raise FormatError(f"table index must hold {n_streams} values in 0..{n_tables - 1}")
    return idx


def _encode_many(kind: str, data: np.ndarray, off: np.ndarray, n_sym: np.ndarray,
                 args: tuple, parallel: bool) -> tuple[np.ndarray, np.ndarray]:
    k = _k()
    cap_off = np.zeros(off.size, dtype=np.int64)
    np.cumsum(n_sym // 2 + 4, out=cap_off[1:])  # capacity() per stream
    scratch = np.empty(int(cap_off[-1]), dtype=np.uint32)
    counts = np.empty(off.size - 1, dtype=np.int64)
    if kind == "trit":
        fn = k.enc_trit_many_par if parallel else k.enc_trit_many
    else:
        fn = k.enc_sym_many_par if parallel else k.enc_sym_many
    fn(data, off, *args, scratch, cap_off, counts)
    if counts.size and counts.min() < 0:
        if counts.min() == -2:
            i = int(np.flatnonzero(counts == -2)[0])
            raise InvalidTritError(f"a value in trits {int(off[i])}..{int(off[i + 1]) - 1} "
                                   "is not -1, 0 or +1")
        raise AssertionError("rANS word capacity exceeded (bug)")
    word_off = np.zeros(off.size, dtype=np.int64)
    np.cumsum(counts, out=word_off[1:])
    words = np.empty(int(word_off[-1]), dtype=np.uint32)
    (k.compact_par if parallel else k.compact)(scratch, cap_off, word_off, words)
    return words, word_off


def _raise_bad(status: np.ndarray) -> None:
    if status.size and status.max() != 0:
        bad = np.flatnonzero(status)
        raise FormatError(f"rANS stream corrupt: stream {int(bad[0])} of {status.size} "
                          f"({bad.size} bad) did not end in state 0 with every word read")


def encode_trit_streams(trits: np.ndarray, offsets: Any, tables: RansTables,
                        table_index: Any = None, *, parallel: bool = True,
                        ) -> tuple[np.ndarray, np.ndarray]:
    """Encode int8 trits (flat, values -1/0/+1) as one stream per segment.

    Returns ``(words uint32, word_offsets int64 [S + 1])``. Raises :class:`InvalidTritError`
    (checked inside the kernel, at no extra pass) for any other value.
    """
    trits = np.ascontiguousarray(trits, dtype=np.int8).reshape(-1)
    off = _check_offsets(offsets, trits.size, "trit")
    idx = _check_index(table_index, off.size - 1, len(tables))
    g = tables.group
    n_sym = (np.diff(off) + g - 1) // g
    return _encode_many("trit", trits, off, n_sym, (g, idx, tables.freqs, tables.cdfs), parallel)


def decode_trit_streams(words: Any, word_offsets: Any, offsets: Any, tables: RansTables,
                        table_index: Any = None, *, out: np.ndarray | None = None,
                        parallel: bool = True) -> np.ndarray:
    """Decode the streams back into a flat int8 trit array of ``offsets[-1]`` trits.

    Raises :class:`FormatError` naming the first corrupt stream (final state not 0, words
    left over, a zero final word, or non-zero padding trits in ``group5`` mode).
    """
    words = _as_words(words)
    off = np.ascontiguousarray(offsets, dtype=np.int64).reshape(-1)
    if off.size < 1:
        raise FormatError("trit offsets must have at least one entry")
    off = _check_offsets(off, int(off[-1]), "trit")
    word_off = _check_offsets(word_offsets, words.size, "word")
    if word_off.size != off.size:
        raise FormatError(f"{word_off.size - 1} word ranges for {off.size - 1} streams")
    idx = _check_index(table_index, off.size - 1, len(tables))
    n = int(off[-1])
    if out is None:
        out = np.empty(n, dtype=np.int8)
    elif out.dtype != np.int8 or out.size != n or not out.flags.c_contiguous:
        raise FormatError(f"output must be a contiguous int8 array of {n} trits")
    status = np.zeros(off.size - 1, dtype=np.uint8)
    k = _k()
    fn = k.dec_trit_many_par if parallel else k.dec_trit_many
    fn(words, word_off, off, tables.group, idx, tables.freqs, tables.cdfs, tables.luts,
       rt.GROUP5_TRITS, out.reshape(-1), status)
    _raise_bad(status)
    return out


def encode_streams(symbols: np.ndarray, offsets: Any, freqs: np.ndarray, cdfs: np.ndarray,
                   table_index: Any = None, *, parallel: bool = True,
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Symbol-level :func:`encode_trit_streams`: tables as stacks ``[T, A]``, ``[T, A + 1]``."""
    freqs, cdfs = np.atleast_2d(freqs), np.atleast_2d(cdfs)
    for f, c in zip(freqs, cdfs, strict=True):
        check_coder_table(f, c)
    symbols = np.ascontiguousarray(symbols).reshape(-1)
    off = _check_offsets(offsets, symbols.size, "symbol")
    idx = _check_index(table_index, off.size - 1, freqs.shape[0])
    if symbols.size and (symbols.min() < 0 or np.any(symbols >= freqs.shape[1])):
        raise FormatError(f"symbols must lie in 0..{freqs.shape[1] - 1}")
    return _encode_many("sym", symbols, off, np.diff(off),
                        (idx, freqs.astype(np.uint32), cdfs.astype(np.uint32)), parallel)


def decode_streams(words: Any, word_offsets: Any, offsets: Any, freqs: np.ndarray,
                   cdfs: np.ndarray, luts: np.ndarray, table_index: Any = None, *,
                   parallel: bool = True) -> np.ndarray:
    """Symbol-level :func:`decode_trit_streams`; returns uint8 symbols."""
    freqs, cdfs, luts = np.atleast_2d(freqs), np.atleast_2d(cdfs), np.atleast_2d(luts)
    for f, c, lut in zip(freqs, cdfs, luts, strict=True):
        check_coder_table(f, c, lut)
    words = _as_words(words)
    off = np.ascontiguousarray(offsets, dtype=np.int64).reshape(-1)
    if off.size < 1:
        raise FormatError("symbol offsets must have at least one entry")
    off = _check_offsets(off, int(off[-1]), "symbol")
    word_off = _check_offsets(word_offsets, words.size, "word")
    if word_off.size != off.size:
        raise FormatError(f"{word_off.size - 1} word ranges for {off.size - 1} streams")
    idx = _check_index(table_index, off.size - 1, freqs.shape[0])
    out = np.empty(int(off[-1]), dtype=np.uint8)
    status = np.zeros(off.size - 1, dtype=np.uint8)
    k = _k()
    fn = k.dec_sym_many_par if parallel else k.dec_sym_many
    fn(words, word_off, off, idx, freqs.astype(np.uint32), cdfs.astype(np.uint32),
       luts.astype(np.uint8), out, status)
    _raise_bad(status)
    return out
