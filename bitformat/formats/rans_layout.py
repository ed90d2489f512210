"""Stream geometry, row classes and numba kernels of the ``rans`` container.

:mod:`bitformat.formats.rans` holds the byte layout and its checks; this module does the
work: find the dead rows and columns, fit row classes, cut the live sub-matrix into streams and
run the coder over them. Every stream is a constriction-compatible rANS stream
(:mod:`bitformat.codecs.rans_kernels`: 64-bit state, 32-bit words, 24-bit precision,
frequencies multiples of 2^12); the coder steps are imported from there, so the coder is
defined in one place. What is added here is the order of symbols in a stream and a table that
changes with the row::

    stream s = (row group g, piece j), s = g * pieces + j
    rows     live rows g*k .. min(L, g*k + k) - 1, in order      (k = rows_per_stream)
    columns  live columns cuts[j] .. cuts[j+1] - 1 of each row   (cuts at multiples of 5)
    symbols  per row segment: ceil(len / group) symbols of ``group`` trits (1 or 5), the last
             padded with zero trits; segment of live row i coded with table class[i]

Importing this module imports numba; :mod:`~bitformat.formats.rans` loads it on first use.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from ..codecs import rans_tables as rt
from ..codecs.rans_kernels import _flush, _init_state, _push, capacity, compact, compact_par

MIN_STREAM = 4096  # trits a stream should hold at least (where the matrix has that many)
MAX_TABLES = 16  # row classes per tensor: a class index is 4 bits
ALIGN = 5  # cuts inside a row fall on multiples of 5: no group5 padding there
CLASS_CHOICES = (1, 2, 4, 8, 16)
LLOYD_ITERATIONS = 6
MAX_STREAM_WORDS = (1 << 16) - 1  # word counts are stored as u16

_U = np.uint64
_MASK = _U((1 << 24) - 1)
_BIG = _U(1 << 32)
_S24 = _U(24)
_S12 = _U(12)
_JIT = dict(cache=True, nogil=True, error_model="numpy")


# -- geometry ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Geometry:
    """How the live ``L x C`` sub-matrix is cut into streams."""

    live_rows: int
    live_cols: int
    rows_per_stream: int  # k >= 1
    pieces: int  # p >= 1; k == 1 or p == 1

    @property
    def n_groups(self) -> int:
        return -(-self.live_rows // self.rows_per_stream) if self.live_cols else 0

    @property
    def n_streams(self) -> int:
        return self.n_groups * self.pieces

    def cuts(self) -> np.ndarray:
        """Column cuts (int64, ``pieces + 1`` entries, in live-column space)."""
        p, c = self.pieces, self.live_cols
        cuts = (np.arange(p + 1, dtype=np.int64) * c // p) // ALIGN * ALIGN
        cuts[-1] = c
        return cuts


def choose_geometry(live_rows: int, live_cols: int, min_len: int = MIN_STREAM) -> Geometry:
    """Streams of at least ``min_len`` trits where the matrix allows it.

    A row of ``min_len`` or more live columns is cut into ``C // min_len`` pieces (each under
    ``2 * min_len``); shorter rows are grouped ``ceil(min_len / C)`` to a stream (at most the
    live row count). Either way a stream holds under ``2 * min_len`` trits.

    >>> g = choose_geometry(2560, 2560); (g.rows_per_stream, g.pieces, g.n_streams)
    (2, 1, 1280)
    >>> choose_geometry(2560, 10000).cuts().tolist()
    [0, 5000, 10000]
    """
    if live_rows == 0 or live_cols == 0:
        return Geometry(0, 0, 1, 1)
    if live_cols >= min_len:
        return Geometry(live_rows, live_cols, 1, live_cols // min_len)
    return Geometry(live_rows, live_cols, min(live_rows, -(-min_len // live_cols)), 1)


def stream_symbols(geom: Geometry, group: int) -> np.ndarray:
    """Symbols in each stream (int64 ``[S]``)."""
    seg = np.diff(geom.cuts())
    per_piece = (seg + group - 1) // group  # symbols of one row's segment
    rows = np.full(geom.n_groups, geom.rows_per_stream, dtype=np.int64)
    if rows.size:
        rows[-1] = geom.live_rows - geom.rows_per_stream * (geom.n_groups - 1)
    return (rows[:, None] * per_piece[None, :]).reshape(-1)


# -- row classes ---------------------------------------------------------------------------------
def _units(counts: np.ndarray) -> np.ndarray:
    return rt.trit_units([int(v) for v in counts])


def _assign(counts: np.ndarray, units: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's cheapest class (lowest index on ties) and its cost in bits."""
    logp = np.log2(units / rt.UNITS)  # [K, 3]
    c = counts.astype(np.float64)
    cost = -(c[:, 0:1] * logp[None, :, 0] + c[:, 1:2] * logp[None, :, 1]
             + c[:, 2:3] * logp[None, :, 2])  # [L, K], elementwise: reproducible
    lab = cost.argmin(axis=1)
    return lab, cost[np.arange(len(lab)), lab]


def _lloyd(counts: np.ndarray, k: int) -> np.ndarray:
    """Labels of ``k`` row classes: start from zero-share quantiles, then alternate
    (tables from classes, classes from tables)."""
    n = len(counts)
    zero_share = counts[:, 1] / np.maximum(counts.sum(axis=1), 1)
    rank = np.empty(n, dtype=np.int64)
    rank[np.argsort(zero_share, kind="stable")] = np.arange(n)
    lab = rank * k // n
    for _ in range(LLOYD_ITERATIONS):
        units = np.stack([_units(counts[lab == i].sum(axis=0)) for i in range(k)])
        new, _ = _assign(counts, units)
        if np.array_equal(new, lab):
            break
        lab = new
    return lab


def fit_classes(counts: np.ndarray, max_tables: int = MAX_TABLES) -> tuple[np.ndarray,
                                                                            np.ndarray]:
    """Row classes for the live rows: ``(units [T, 3] int64, class [L] uint8)``.

    ``counts`` is ``[L, 3]`` (-1, 0, +1 per live row, live columns only). Tries 1, 2, 4, 8
    and 16 classes and keeps the one with the fewest estimated bits: rows coded with their
    class's table, plus 64 bits per table and 4 bits per row for the class index (T > 1).
    """
    n = len(counts)
    one = _units(counts.sum(axis=0))[None, :]
    best = (float(_assign(counts, one)[1].sum()) + 64, one, np.zeros(n, dtype=np.uint8))
    for k in CLASS_CHOICES[1:]:
        if k > min(n, max_tables):
            break
        lab = _lloyd(counts, k)
        used = np.unique(lab)  # drop empty classes, keep the order
        lab = np.searchsorted(used, lab)
        units = np.stack([_units(counts[lab == i].sum(axis=0)) for i in range(len(used))])
        bits = float(-(counts * np.log2(units[lab] / rt.UNITS)).sum())
        bits += 64 * len(used) + 4 * n
        if bits < best[0]:
            best = (bits, units, lab.astype(np.uint8))
    return best[1], best[2]


# -- kernels -------------------------------------------------------------------------------------
@njit(**_JIT)
def scan(trits, counts, colnz):
    """Per-row counts of -1/0/+1 and per-column 'has a non-zero' (colnz, uint8, zeroed by the
    caller); returns the flat index of the first value that is not a trit, or -1.

    Branch-free so LLVM vectorises it: with v in {-1, 0, 1}, |v| = v * v counts non-zeros
    and the sum of v is (+1s) - (-1s)."""
    rows, cols = trits.shape
    for r in range(rows):
        nz = 0
        total = 0
        worst = 0
        for c in range(cols):
            v = np.int32(trits[r, c])
            a = v * v
            nz += a
            total += v
            worst = max(worst, a)
            colnz[c] |= np.uint8(a != 0)
        if worst > 1:
            for c in range(cols):
                if trits[r, c] * trits[r, c] > 1:
                    return r * cols + c
        counts[r, 0] = (nz - total) // 2
        counts[r, 1] = cols - nz
        counts[r, 2] = (nz + total) // 2
    return -1


@njit(**_JIT)
def _stream_span(i, p, k, n_live, cuts, group):
    """Stream i covers live rows r0:r1 and columns c0:c1 of each, in n_sym symbols."""
    g = i // p
    j = i - g * p
    r0 = g * k
    r1 = min(n_live, r0 + k)
    c0 = cuts[j]
    c1 = cuts[j + 1]
    return r0, r1, c0, c1, (c1 - c0 + group - 1) // group


@njit(**_JIT)
def _enc_stream(i, src, lrows, colmap, mapped, k, p, n_live, cuts, group, cls, freqs, cdfs,
                scratch, cap_off, counts):
    r0, r1, c0, c1, n_sym = _stream_span(i, p, k, n_live, cuts, group)
    state = _U(0)
    w = cap_off[i]
    cap = cap_off[i + 1]
    for rr in range(r1 - 1, r0 - 1, -1):
        row = lrows[rr]
        f = freqs[cls[rr]]
        cdf = cdfs[cls[rr]]
        for si in range(n_sym - 1, -1, -1):
            at = c0 + si * group
            if group == 1:
                s = src[row, colmap[at] if mapped else at] + 1
            else:
                s = 0
                for q in range(5):
                    col = at + q
                    if col < c1:
                        s = 3 * s + src[row, colmap[col] if mapped else col] + 1
                    else:
                        s = 3 * s + 1
            state, w = _push(state, _U(f[s]), _U(cdf[s]), scratch, w, cap)
            if w < 0:
                counts[i] = -1
                return
    end = _flush(state, scratch, w, cap)
    counts[i] = end - cap_off[i] if end >= 0 else -1


@njit(**_JIT)
def encode_serial(src, lrows, colmap, mapped, k, p, cuts, group, cls, freqs, cdfs, scratch,
                  cap_off, counts):
    for i in range(counts.shape[0]):
        _enc_stream(i, src, lrows, colmap, mapped, k, p, lrows.shape[0], cuts, group, cls,
                    freqs, cdfs, scratch, cap_off, counts)


@njit(parallel=True, **_JIT)
def encode_parallel(src, lrows, colmap, mapped, k, p, cuts, group, cls, freqs, cdfs, scratch,
                    cap_off, counts):
    for i in prange(counts.shape[0]):
        _enc_stream(i, src, lrows, colmap, mapped, k, p, lrows.shape[0], cuts, group, cls,
                    freqs, cdfs, scratch, cap_off, counts)


@njit(**_JIT)
def _dec_stream(i, words, word_off, out, lrows, colmap, mapped, k, p, n_live, cuts, group,
                cls, freqs, cdfs, luts, expand):
    """Decode stream i into ``out``; 0 if it ends in state 0 with every word read and all
    padding digits are zero trits, else 1."""
    lo = word_off[i]
    state, pos = _init_state(words, lo, word_off[i + 1])
    if pos < 0:
        return 1
    r0, r1, c0, c1, n_sym = _stream_span(i, p, k, n_live, cuts, group)
    for rr in range(r0, r1):
        row = lrows[rr]
        t = cls[rr]
        f = freqs[t]
        cdf = cdfs[t]
        lut = luts[t]
        at = c0
        for _ in range(n_sym):
            q = state & _MASK
            s = lut[q >> _S12]
            state = (state >> _S24) * _U(f[s]) + q - _U(cdf[s])
            if state < _BIG and pos > lo:
                pos -= 1
                state = (state << _U(32)) | _U(words[pos])
            if group == 1:
                out[row, colmap[at] if mapped else at] = np.int8(s) - np.int8(1)
                at += 1
            else:
                for d in range(5):
                    col = at + d
                    if col < c1:
                        out[row, colmap[col] if mapped else col] = expand[s, d]
                    elif expand[s, d] != 0:
                        return 1
                at += 5
    return 0 if (state == 0 and pos == lo) else 1


@njit(**_JIT)
def decode_serial(words, word_off, out, lrows, colmap, mapped, k, p, cuts, group, cls, freqs,
                  cdfs, luts, expand, status):
    for i in range(status.shape[0]):
        status[i] = _dec_stream(i, words, word_off, out, lrows, colmap, mapped, k, p,
                                lrows.shape[0], cuts, group, cls, freqs, cdfs, luts, expand)


@njit(parallel=True, **_JIT)
def decode_parallel(words, word_off, out, lrows, colmap, mapped, k, p, cuts, group, cls, freqs,
                    cdfs, luts, expand, status):
    for i in prange(status.shape[0]):
        status[i] = _dec_stream(i, words, word_off, out, lrows, colmap, mapped, k, p,
                                lrows.shape[0], cuts, group, cls, freqs, cdfs, luts, expand)


PARALLEL_FROM = 1 << 20  # trits; smaller matrices run on the calling thread (no pool wake-up)


def _parallel(geom: Geometry) -> bool:
    return geom.n_streams > 1 and geom.live_rows * geom.live_cols >= PARALLEL_FROM


def encode(src: np.ndarray, lrows: np.ndarray, colmap: np.ndarray | None, geom: Geometry,
           group: int, cls: np.ndarray, freqs: np.ndarray, cdfs: np.ndarray,
           ) -> tuple[np.ndarray, np.ndarray]:
    """Encode every stream: ``(words uint32, word counts int64 [S])``.

    ``src`` is the int8 ``[rows, cols]`` matrix (already checked to hold trits only),
    ``lrows`` the live rows (int64), ``colmap`` the live columns (int64) or None when every
    column is live.
    """
    n_sym = stream_symbols(geom, group)
    cap_off = np.zeros(n_sym.size + 1, dtype=np.int64)
    np.cumsum(n_sym // 2 + 4, out=cap_off[1:])  # capacity() of each stream
    assert capacity(0) == 4
    scratch = np.empty(int(cap_off[-1]), dtype=np.uint32)
    counts = np.empty(n_sym.size, dtype=np.int64)
    mapped = colmap is not None
    cmap = colmap if mapped else np.zeros(1, dtype=np.int64)
    fn = encode_parallel if _parallel(geom) else encode_serial
    fn(src, lrows, cmap, mapped, geom.rows_per_stream, geom.pieces, geom.cuts(), group,
       cls, freqs, cdfs, scratch, cap_off, counts)
    if counts.size and (counts.min() < 0 or counts.max() > MAX_STREAM_WORDS):
        raise AssertionError("rANS stream capacity exceeded (bug)")
    word_off = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=word_off[1:])
    words = np.empty(int(word_off[-1]), dtype=np.uint32)
    (compact_par if _parallel(geom) else compact)(scratch, cap_off, word_off, words)
    return words, counts


def decode(words: np.ndarray, word_off: np.ndarray, out: np.ndarray, lrows: np.ndarray,
           colmap: np.ndarray | None, geom: Geometry, group: int, cls: np.ndarray,
           freqs: np.ndarray, cdfs: np.ndarray, luts: np.ndarray) -> np.ndarray:
    """Decode every stream into ``out`` (int8 ``[rows, cols]``, zeros where nothing is
    written); returns the per-stream status (uint8, 0 = good). Inputs must be validated."""
    status = np.zeros(geom.n_streams, dtype=np.uint8)
    mapped = colmap is not None
    cmap = colmap if mapped else np.zeros(1, dtype=np.int64)
    fn = decode_parallel if _parallel(geom) else decode_serial
    fn(words, word_off, out, lrows, cmap, mapped, geom.rows_per_stream, geom.pieces,
       geom.cuts(), group, cls, freqs, cdfs, luts, rt.GROUP5_TRITS, status)
    return status
