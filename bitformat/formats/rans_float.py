"""``rans_float``: a 16-bit float tensor (f16 or bf16) stored losslessly in fewer bits.

Byte spec (full text, reasons and measurements: docs/formats/rans_float.md)::

    Stored as a 1-D GGML I32 tensor of N32 little-endian u32 words (its size depends on the
    values); the logical shape travels as bitformat.tensor.<name>.shape metadata and the
    logical type (F16 or BF16) in the header.

    word  0      magic 0x464E4152 (bytes "RANF")
    word  1      CRC-32 (zlib / ISO-HDLC) of every byte after this word
    word  2      version 1 in bits 0..7, dtype (1 = f16, 2 = bf16) in bits 8..15, z (low
                 mantissa bits left out) in bits 16..23
    words 3..11  rows, cols, symbols A, tables T (1..16), values per stream n, streams S,
                 stream words W, wide values Z, exceptions X
    then, each section a whole number of words:
      used exponents    2^E bits: bit e = exponent field e occurs (A of them; symbol = rank)
      wide exponents    2^E bits: bit e = values of exponent e keep their low z bits
      tables            T x A u16 units (12-bit, each >= 1, summing to 4096 per table)
      row classes       only if T > 1: rows nibbles
      word counts       S u16
      streams           W words: S constriction-format rANS streams of exponent symbols
      sign/mantissa     N values x b = 1 + M - z bits: s << (M - z) | m >> z, bit-packed
      wide low bits     Z x z bits: the low bits of the values of wide exponents, in order
      exception index   X u32: the other values whose low z bits are not zero, rising
      exception bits    X x z bits: their low bits

Stream s codes the exponents of values ``s*n .. min(N, s*n + n) - 1`` (row-major), each with
its row's table. ``z`` is chosen from the data: bf16 weights stored as f16 have z = 3.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from ..codecs import rans_tables as rt
from ..constants import GGMLType
from ..errors import ShapeError
from .rans_float_layout import (
    DTYPE_CODE,
    DTYPES,
    ENCODING,
    MAGIC,
    MAX_STREAM,
    MAX_TABLES,
    MAX_VALUES,
    MIN_STREAM,
    VERSION,
    Parsed,
    _k,
    _pack,
    decode_tables,
    describe,
    parse,
    peek_dtype,
    section_words,
    shape_2d,
    stream_length,
)

MIN_VALUES = 1 << 16  # a container codes 16-bit tensors of at least this many values
EXCEPTION_BITS = 32  # an exception's index; its low bits come on top
CLASS_CHOICES = (2, 4, 8, 16)
LLOYD_ITERATIONS = 6


# -- what the writer decides ---------------------------------------------------------------------
@dataclass
class Plan:
    """The writer's choices for one tensor, from its histogram of 16-bit patterns."""

    dtype: int
    z: int
    used: np.ndarray  # bool [2^E]
    wide: np.ndarray  # bool [2^E]
    n_wide: int  # values whose exponent is wide
    n_exceptions: int
    bits_estimate: float  # order-0 exponent bits + planes + exceptions (no tables)


def exponent_counts(hist: np.ndarray, e_bits: int, m_bits: int) -> np.ndarray:
    """int64 ``[2^E, 2^M]``: values per (exponent, mantissa), both signs together."""
    h = hist.reshape(2, 1 << e_bits, 1 << m_bits)
    return h[0] + h[1]


def plan(hist: np.ndarray, dtype: int) -> Plan:
    """Choose ``z`` and the wide exponents with the fewest bits.

    For each z, a value costs ``1 + M - z`` plane bits; the values of exponent e whose low z
    bits are not all zero (``x_e``) cost either ``z`` bits for every value of e (wide) or
    ``32 + z`` bits each as exceptions, whichever is less (wide only where strictly cheaper).
    The smallest z within 0.1 % of the fewest bits wins.
    """
    _, e_bits, m_bits = DTYPES[dtype]
    em = exponent_counts(hist, e_bits, m_bits)
    n_e = em.sum(axis=1)
    total = int(n_e.sum())
    used = n_e > 0
    p = n_e[used] / max(total, 1)
    h_exp = float(-(p * np.log2(p)).sum()) * total
    options = []
    for z in range(m_bits + 1):
        clean = em[:, ::1 << z].sum(axis=1)  # low z bits all zero
        x_e = n_e - clean
        wide = (n_e * z < x_e * (EXCEPTION_BITS + z)) & used
        cost = total * (1 + m_bits - z) + int((n_e * z)[wide].sum()) + int(
            (x_e * (EXCEPTION_BITS + z))[~wide].sum())
        options.append((cost, z, wide, int(n_e[wide].sum()), int(x_e[~wide].sum())))
    least = min(o[0] for o in options)
    # the smallest z within 0.1 % of the least: full-precision data keeps z = 0 rather than
    # moving every mantissa's low bits into the wide plane to save a few bits
    cost, z, wide, n_wide, n_exc = next(o for o in options if o[0] <= least * 1.001)
    return Plan(dtype, z, used, wide, n_wide, n_exc, h_exp + cost)


def _apportion(counts: np.ndarray) -> np.ndarray:
    return rt.apportion([int(c) for c in counts])


def _cost(counts: np.ndarray, units: np.ndarray) -> np.ndarray:
    """Bits of each row (``counts [R, A]``) under each table (``units [K, A]``): ``[R, K]``."""
    return -(counts.astype(np.float64) @ np.log2(units / rt.UNITS).T)


def fit_classes(counts: np.ndarray, max_tables: int = MAX_TABLES
                ) -> tuple[np.ndarray, np.ndarray]:
    """Row classes: ``(units [T, A] int64, class [rows] uint8)``.

    One table first; then 2, 4, 8, 16 classes (rows sorted by their mean exponent symbol,
    cut into equal parts, then six rounds of "tables from classes, classes by fewest bits"),
    each kept only while it beats the last count, with 16 bits per table entry and 4 bits per
    row of class index counted. Deterministic.
    """
    rows, a = counts.shape
    one = _apportion(counts.sum(axis=0))[None, :]
    best_bits = float(_cost(counts.sum(axis=0, keepdims=True), one)[0, 0]) + 16 * a
    best = (one, np.zeros(rows, dtype=np.uint8))
    n = counts.sum(axis=1)
    mean = (counts @ np.arange(a)) / np.maximum(n, 1)
    rank = np.empty(rows, dtype=np.int64)
    rank[np.argsort(mean, kind="stable")] = np.arange(rows)
    for k in CLASS_CHOICES:
        if k > min(rows, max_tables):
            break
        lab = rank * k // rows
        for _ in range(LLOYD_ITERATIONS):
            used = np.unique(lab)
            lab = np.searchsorted(used, lab)
            units = np.stack([_apportion(counts[lab == i].sum(axis=0))
                              for i in range(len(used))])
            new = _cost(counts, units).argmin(axis=1)
            if np.array_equal(new, lab):
                break
            lab = new
        used = np.unique(lab)
        lab = np.searchsorted(used, lab)
        units = np.stack([_apportion(counts[lab == i].sum(axis=0)) for i in range(len(used))])
        bits = float(_cost(counts, units)[np.arange(rows), lab].sum())
        bits += 16 * a * len(used) + 4 * rows
        if bits >= best_bits:
            break
        best_bits, best = bits, (units, lab.astype(np.uint8))
    return best


ENCODE_BATCH = 4096  # streams encoded at a time (bounds the scratch words)


def _encode_streams(v: np.ndarray, n: int, cols: int, m_bits: int, emask: int,
                    rank: np.ndarray, cls: np.ndarray, units: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Every stream's words, concatenated, and each stream's word count (int64)."""
    from ..codecs.rans_kernels import compact_par

    k = _k()
    freqs, cdfs, _ = rt.coder_tables(units)
    n_streams = -(-v.size // n)
    wcounts = np.empty(n_streams, dtype=np.int64)
    parts = []
    for s0 in range(0, n_streams, ENCODE_BATCH):
        s1 = min(n_streams, s0 + ENCODE_BATCH)
        sym = np.minimum(n, v.size - n * np.arange(s0, s1, dtype=np.int64))
        cap_off = np.zeros(s1 - s0 + 1, dtype=np.int64)
        np.cumsum(sym // 2 + 4, out=cap_off[1:])  # capacity(): 12 bits a symbol at most
        scratch = np.empty(int(cap_off[-1]), dtype=np.uint32)
        counts = wcounts[s0:s1]
        k.encode_streams(v, n, s0, cols, m_bits, emask, rank, cls, freqs, cdfs, scratch,
                         cap_off, counts)
        if counts.min() < 0 or counts.max() >= 1 << 16:
            raise AssertionError("rans_float stream capacity exceeded (bug)")
        word_off = np.zeros(s1 - s0 + 1, dtype=np.int64)
        np.cumsum(counts, out=word_off[1:])
        words = np.empty(int(word_off[-1]), dtype=np.uint32)
        compact_par(scratch, cap_off, word_off, words)
        parts.append(words)
    return np.concatenate(parts), wcounts


# -- the coder -----------------------------------------------------------------------------------


class RansFloat:
    """Encode and decode one 16-bit float tensor (see the module docstring for the bytes).

    ``max_tables`` caps the row classes the writer tries (1 turns them off); readers take
    whatever the data says.

    Examples
    --------
    >>> v = np.float16([0.5, -1.25, 3.0, 0.0]).view(np.uint16)
    >>> raw = RansFloat().encode(v, GGMLType.F16, (2, 2))
    >>> RansFloat().decode(raw, GGMLType.F16, (2, 2)).view(np.float16).tolist()
    [0.5, -1.25, 3.0, 0.0]
    """

    def __init__(self, max_tables: int = MAX_TABLES):
        if not 1 <= max_tables <= MAX_TABLES:
            raise ValueError(f"max_tables must be in 1..{MAX_TABLES}")
        self.max_tables = int(max_tables)

    @staticmethod
    def histogram(values: np.ndarray) -> np.ndarray:
        """int64 [65536]: how often each 16-bit pattern occurs."""
        out = np.zeros(65536, dtype=np.int64)
        v = np.ascontiguousarray(values).reshape(-1).view(np.uint16)
        if v.size:
            _k().histogram16(v, out)
        return out

    def encode(self, values: np.ndarray, dtype: GGMLType, shape: tuple[int, ...],
               name: str = "") -> np.ndarray:
        """The coded bytes (uint8, a whole number of words) of ``values`` (uint16 patterns,
        or their little-endian bytes) of logical ``shape`` and type F16 or BF16."""
        if dtype not in DTYPE_CODE:
            raise ShapeError(f"rans_float codes F16 or BF16 tensors, not {dtype.name}",
                             tensor=name or None)
        v = np.ascontiguousarray(values).reshape(-1).view(np.uint16)
        rows, cols = shape_2d(shape)
        if v.size != rows * cols or not 1 <= v.size <= MAX_VALUES:
            raise ShapeError(f"{v.size} values for shape {tuple(shape)} (1..{MAX_VALUES} "
                             "values)", tensor=name or None)
        code = DTYPE_CODE[dtype]
        _, e_bits, m_bits = DTYPES[code]
        k = _k()
        hist = self.histogram(v)
        pl = plan(hist, code)
        z = pl.z
        used_e = np.flatnonzero(pl.used)
        rank = np.zeros(1 << e_bits, dtype=np.int64)
        rank[used_e] = np.arange(used_e.size)
        emask = (1 << e_bits) - 1
        if self.max_tables > 1 and rows > 1 and used_e.size > 1:
            counts = np.zeros((rows, used_e.size), dtype=np.int32)
            k.row_symbol_counts(v, cols, m_bits, emask, rank, counts)
            units, cls = fit_classes(counts.astype(np.int64), self.max_tables)
        else:
            e_counts = exponent_counts(hist, e_bits, m_bits).sum(axis=1)
            units = _apportion(e_counts[used_e])[None, :]
            cls = np.zeros(rows, dtype=np.uint8)
        n = stream_length(cols)
        words, wcounts = _encode_streams(v, n, cols, m_bits, emask, rank, cls, units)
        sizes = section_words(e_bits, m_bits, z, rows, cols, used_e.size, len(units),
                              wcounts.size, words.size, pl.n_wide, pl.n_exceptions)
        out = np.zeros(sum(sizes.values()), dtype="<u4")
        sec, pos = {}, 0
        for key, size in sizes.items():
            sec[key] = out[pos:pos + size]
            pos += size
        sec["header"][:] = [MAGIC, 0, VERSION | code << 8 | z << 16, rows, cols, used_e.size,
                            len(units), n, wcounts.size, words.size, pl.n_wide,
                            pl.n_exceptions]
        sec["used"][:] = _pack(pl.used, 1)
        sec["wide"][:] = _pack(pl.wide, 1)
        sec["tables"][:] = _pack(units.reshape(-1), 16)
        if len(units) > 1:
            sec["classes"][:] = _pack(cls, 4)
        sec["counts"][:] = _pack(wcounts, 16)
        sec["streams"][:] = words
        del words
        k.pack_plane(v, m_bits, z, sec["plane"])
        if z:
            nw, nx = k.low_bits(v, m_bits, z, pl.wide.astype(np.uint8), sec["wide_bits"],
                                sec["exc_index"], sec["exc_bits"])
            assert (nw, nx) == (pl.n_wide, pl.n_exceptions)
        raw = out.view(np.uint8)
        raw[4:8] = np.array([zlib.crc32(raw[8:])], dtype="<u4").view(np.uint8)
        return raw

    # -- decode ----------------------------------------------------------------------------
    def decode(self, raw: np.ndarray, dtype: GGMLType, shape: tuple[int, ...], *,
               path: str | None = None, name: str | None = None,
               out: np.ndarray | None = None) -> np.ndarray:
        """The tensor's little-endian bytes (uint8, ``2 * N``), every field checked.

        ``out`` (uint16, N values) receives the values if given.
        """
        p = parse(raw, dtype, shape, path=path, name=name)
        return p.decode(out)


def value_entropy(hist: np.ndarray) -> float:
    """Order-0 entropy of the 16-bit values (bits per value): the floor of any coder that
    codes each value on its own with one distribution."""
    return rt.entropy_bits(hist[hist > 0])


def codable(dtype: GGMLType, shape: tuple[int, ...]) -> bool:
    """Whether a container codes this plain tensor: F16/BF16 with at least MIN_VALUES."""
    n = 1
    for d in shape:
        n *= int(d)
    return dtype in DTYPE_CODE and MIN_VALUES <= n <= MAX_VALUES


__all__ = ["ENCODING", "MAX_STREAM", "MAX_VALUES", "MIN_STREAM", "MIN_VALUES", "Parsed", "Plan",
           "RansFloat", "codable", "decode_tables", "describe", "parse", "peek_dtype", "plan",
           "section_words", "shape_2d", "stream_length", "value_entropy"]
