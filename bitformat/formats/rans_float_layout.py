"""The byte layout of ``rans_float`` and its reader (spec: :mod:`.rans_float`, full text in
docs/formats/rans_float.md): constants, section sizes, :func:`parse` (every field checked before
a kernel runs) and :class:`Parsed`, which decodes. The writer's choices live in
:mod:`.rans_float`, the numba kernels in :mod:`.rans_float_kernels` (loaded on first use).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from ..codecs import rans_tables as rt
from ..constants import GGMLType
from ..errors import FormatError, ShapeError

ENCODING = "rans_float"  # the value of bitformat.tensor.<name>.encoding
MAGIC = 0x464E4152  # b"RANF" read as a little-endian u32
VERSION = 1
HEADER_WORDS = 12
MAX_TABLES = 16
MAX_VALUES = (1 << 32) - 1  # exception indices are u32
MIN_STREAM = 4096  # values a stream should hold (whole rows where rows are short)
MAX_STREAM = 1 << 17  # 12 bits a symbol at most: a stream stays below 2^16 words

#: dtype code -> (GGML type, exponent bits E, mantissa bits M)
DTYPES = {1: (GGMLType.F16, 5, 10), 2: (GGMLType.BF16, 8, 7)}
DTYPE_CODE = {g: c for c, (g, _, _) in DTYPES.items()}

def _k():
    from . import rans_float_kernels

    return rans_float_kernels


def _words(bits: int) -> int:
    return -(-bits // 32)


def section_words(e_bits: int, m_bits: int, z: int, rows: int, cols: int, symbols: int,
                  tables: int, streams: int, stream_words: int, wide: int,
                  exceptions: int) -> dict[str, int]:
    """Words of each section, in file order (Python ints, so no overflow)."""
    n = rows * cols
    return {"header": HEADER_WORDS, "used": _words(1 << e_bits), "wide": _words(1 << e_bits),
            "tables": _words(16 * tables * symbols),
            "classes": _words(4 * rows) if tables > 1 else 0, "counts": _words(16 * streams),
            "streams": stream_words, "plane": _words(n * (1 + m_bits - z)),
            "wide_bits": _words(wide * z), "exc_index": exceptions,
            "exc_bits": _words(exceptions * z)}


def _pack(values: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned values of ``bits`` (1, 4 or 16) -> u32 words, lowest bits first."""
    per = 32 // bits
    v = np.zeros(-(-values.size // per) * per, dtype=np.uint32)
    v[:values.size] = values
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, :]
    return np.bitwise_or.reduce(v.reshape(-1, per) << shifts, axis=1).astype("<u4")


def _unpack(words: np.ndarray, bits: int) -> np.ndarray:
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, :]
    return ((words.astype(np.uint32)[:, None] >> shifts) & ((1 << bits) - 1)).reshape(-1)


def shape_2d(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, cols) of a logical shape: the last axis is a row."""
    cols = int(shape[-1]) if shape else 1
    rows = 1
    for d in shape[:-1]:
        rows *= int(d)
    return rows, cols


def stream_length(cols: int) -> int:
    """Values per stream: whole rows adding up to at least ``MIN_STREAM`` values, or
    ``MAX_STREAM`` where one row is longer than that."""
    if cols > MAX_STREAM:
        return MAX_STREAM
    return min(cols * -(-MIN_STREAM // cols), MAX_STREAM // cols * cols)


# -- what the writer decides ---------------------------------------------------------------------

@dataclass
class Parsed:
    """A checked ``rans_float`` tensor's sections (views of its words), ready to decode."""

    where: dict
    dtype: int
    z: int
    rows: int
    cols: int
    n: int
    sections: dict[str, np.ndarray]
    sym_exp: np.ndarray  # int64 [A]: exponent field of each symbol
    wide: np.ndarray  # uint8 [2^E]
    cls: np.ndarray  # uint8 [rows]
    units: np.ndarray  # int64 [T, A]
    words: np.ndarray  # uint32: the whole tensor
    word_off: np.ndarray  # int64 [S + 1]: where each stream starts in ``words``
    n_wide: int

    def bad(self, msg: str) -> FormatError:
        return FormatError(f"rans_float: {msg}", **self.where)

    def decode(self, out: np.ndarray | None = None) -> np.ndarray:
        """Decode every value (uint8 view of the uint16 values); checks every stream."""
        _, _, m_bits = DTYPES[self.dtype]
        n_values = self.rows * self.cols
        if out is None:
            out = np.empty(n_values, dtype=np.uint16)
        elif out.dtype != np.uint16 or out.size != n_values or not out.flags.c_contiguous:
            raise ValueError(f"out must be a contiguous uint16 array of {n_values} values")
        out = out.reshape(-1)
        k = _k()
        sec = self.sections
        n_streams = self.word_off.size - 1
        status = np.zeros(n_streams, dtype=np.uint8)
        wide_count = np.zeros(n_streams, dtype=np.int64)
        if self.units.shape[1] == 1:  # one symbol: it costs nothing, every stream is empty
            if self.word_off[-1] != self.word_off[0]:
                status[int(np.flatnonzero(np.diff(self.word_off))[0])] = 1
            else:
                out[:] = self.sym_exp[0] << m_bits
                k.place_plane(sec["plane"], m_bits, self.z, out)
                wide_count[:] = np.minimum(self.n, n_values - self.n * np.arange(n_streams)) \
                    * int(self.wide[self.sym_exp[0]])
        else:
            symv = (self.sym_exp << m_bits).astype(np.uint16)
            symw = self.wide[self.sym_exp].astype(np.uint8)
            k.decode_streams(self.words, self.word_off, sec["plane"], self.n, self.cols,
                             1 + m_bits - self.z, self.z, symv, symw, self.cls,
                             decode_tables(self.units), out, wide_count, status)
        if status.any():
            s = int(np.flatnonzero(status)[0])
            raise self.bad(f"stream {s} of {n_streams} (values {s * self.n}.."
                           f"{min(n_values, s * self.n + self.n) - 1}) is corrupt: it did not "
                           "end in state 0 with every word read")
        if int(wide_count.sum()) != self.n_wide:
            raise self.bad(f"the header says {self.n_wide} values of wide exponents, the "
                           f"streams hold {int(wide_count.sum())}")
        if self.z:
            first = np.zeros(n_streams + 1, dtype=np.int64)
            np.cumsum(wide_count, out=first[1:])
            k.fill_wide(out, self.n, m_bits, self.z, self.wide, sec["wide_bits"],
                        first)
            bad = k.fill_exceptions(out, m_bits, self.z, self.wide, sec["exc_index"],
                                    sec["exc_bits"])
            if bad >= 0:
                raise self.bad(f"exception {bad}: its index does not rise or lies past the "
                               "values, its exponent is wide, or its low bits are zero")
        return out.view(np.uint8)


def decode_tables(units: np.ndarray) -> np.ndarray:
    """uint32 [T, 4096]: ``sym | f_u << 8 | (slot - cdf_u) << 20`` for every slot (units of
    tables of at least two symbols are below 4096, so each field fits)."""
    freqs, cdfs, luts = rt.coder_tables(units)
    sym = luts.astype(np.int64)
    fu = np.take_along_axis(freqs.astype(np.int64), sym, axis=1) >> rt.UNIT_SHIFT
    cu = np.take_along_axis(cdfs.astype(np.int64), sym, axis=1) >> rt.UNIT_SHIFT
    return (sym | fu << 8 | (np.arange(rt.UNITS)[None, :] - cu) << 20).astype(np.uint32)


def _pad_bits_zero(words: np.ndarray, bits: int) -> bool:
    """True if every bit of ``words`` past the first ``bits`` is zero."""
    if bits % 32 == 0 or words.size == 0:
        return True
    return int(words[-1]) >> (bits % 32) == 0


def parse(raw: np.ndarray, dtype: GGMLType, shape: tuple[int, ...], *,
          path: str | None = None, name: str | None = None, check_crc: bool = True) -> Parsed:
    """Check a ``rans_float`` tensor's header and sections against the logical ``dtype`` and
    ``shape`` (and its CRC-32); the streams are checked when decoded."""
    where = {"path": path, "tensor": name}

    def bad(msg: str, cls: type[FormatError] = FormatError) -> FormatError:
        return cls(f"rans_float: {msg}", **where)

    raw = np.asarray(raw).reshape(-1)
    if raw.dtype != np.uint8:
        raw = raw.view(np.uint8)
    nbytes = raw.size
    if nbytes < 4 * HEADER_WORDS or nbytes % 4:
        raise bad(f"whole words of at least a {4 * HEADER_WORDS}-byte header, got {nbytes} "
                  "bytes", ShapeError)
    h = [int(x) for x in np.frombuffer(raw[:4 * HEADER_WORDS].tobytes(), dtype="<u4")]
    magic, crc, vdz, rows, cols, a, n_tab, n, n_streams, n_words, n_wide, n_exc = h
    if magic != MAGIC:
        raise bad(f"magic {magic:#010x}, expected {MAGIC:#010x}")
    code, z = (vdz >> 8) & 0xFF, (vdz >> 16) & 0xFF
    if vdz & 0xFF != VERSION or vdz >> 24 or code not in DTYPES:
        raise bad(f"unsupported version/dtype word {vdz:#x}")
    gtype, e_bits, m_bits = DTYPES[code]
    if gtype != dtype:
        raise bad(f"the data is {gtype.name}, the tensor says {dtype.name}")
    want_rows, want_cols = shape_2d(tuple(shape))
    if (rows, cols) != (want_rows, want_cols) or rows * cols < 1:
        raise bad(f"data for {rows} rows of {cols}, the shape {tuple(shape)} has "
                  f"{want_rows} of {want_cols}", ShapeError)
    n_values = rows * cols
    if n_values > MAX_VALUES:
        raise bad(f"{n_values} values (at most {MAX_VALUES})", ShapeError)
    if z > m_bits or not 1 <= a <= 1 << e_bits or not 1 <= n_tab <= MAX_TABLES:
        raise bad(f"{z} low bits of {m_bits}, {a} symbols or {n_tab} tables out of range")
    if not 1 <= n <= MAX_STREAM or n_streams != -(-n_values // n):
        raise bad(f"{n_streams} streams of {n} values do not cover {n_values} values")
    if n_wide > n_values or n_exc > n_values or (z == 0 and (n_wide or n_exc)):
        raise bad(f"{n_wide} wide values and {n_exc} exceptions for {n_values} values")
    sizes = section_words(e_bits, m_bits, z, rows, cols, a, n_tab, n_streams, n_words, n_wide,
                          n_exc)
    want = 4 * sum(sizes.values())
    if nbytes != want:
        raise bad(f"{n_values} values in {n_streams} streams of {n_words} words take {want} "
                  f"bytes, got {nbytes}", ShapeError)
    if check_crc and zlib.crc32(raw[8:]) != crc:
        raise bad("checksum mismatch (CRC-32 of the tensor data)")
    if raw.ctypes.data % 4:
        raw = raw.copy()
    words = raw.view("<u4")
    sec, pos = {}, 0
    for key, size in sizes.items():
        sec[key] = words[pos:pos + size]
        pos += size
    used = _unpack(sec["used"], 1).astype(bool)
    wide = _unpack(sec["wide"], 1).astype(bool)
    if int(used.sum()) != a:
        raise bad(f"the header says {a} exponents, the map {int(used.sum())}")
    if np.any(wide & ~used) or (z == 0 and wide.any()):
        raise bad("a wide exponent is not a used one (or z is 0)")
    units = _unpack(sec["tables"], 16).astype(np.int64)
    if units[n_tab * a:].any():
        raise bad("table padding is not zero")
    units = units[:n_tab * a].reshape(n_tab, a)
    if units.min() < 1 or np.any(units.sum(axis=1) != rt.UNITS):
        raise bad(f"a table's units are not all >= 1 summing to {rt.UNITS}")
    if n_tab > 1:
        cls = _unpack(sec["classes"], 4)
        if cls[rows:].any() or cls[:rows].max() >= n_tab:
            raise bad(f"a row class is not below {n_tab}, or class padding is not zero")
        cls = cls[:rows].astype(np.uint8)
    else:
        cls = np.zeros(rows, dtype=np.uint8)
    counts = _unpack(sec["counts"], 16).astype(np.int64)
    if counts[n_streams:].any() or int(counts[:n_streams].sum()) != n_words:
        raise bad(f"stream word counts do not add up to the {n_words} stream words")
    word_off = np.full(n_streams + 1, sum(list(sizes.values())[:list(sizes).index("streams")]),
                       dtype=np.int64)  # the stream section's first word
    word_off[1:] += np.cumsum(counts[:n_streams])
    b = 1 + m_bits - z
    if not (_pad_bits_zero(sec["plane"], n_values * b)
            and _pad_bits_zero(sec["wide_bits"], n_wide * z)
            and _pad_bits_zero(sec["exc_bits"], n_exc * z)):
        raise bad("padding bits after a bit plane are not zero")
    return Parsed(where, code, z, rows, cols, n, sec, np.flatnonzero(used).astype(np.int64),
                  wide.astype(np.uint8), cls, units, words, word_off, n_wide)


def peek_dtype(raw: np.ndarray, *, path: str | None = None, name: str | None = None
               ) -> GGMLType:
    """The logical type (F16 or BF16) a coded tensor's header names (checked: magic, version,
    dtype); everything else is checked when it is decoded."""
    raw = np.asarray(raw).reshape(-1).view(np.uint8)
    if raw.size < 4 * HEADER_WORDS:
        raise ShapeError(f"rans_float: {raw.size} bytes, shorter than its header", path=path,
                         tensor=name)
    magic, _, vdz = (int(x) for x in np.frombuffer(raw[:12].tobytes(), dtype="<u4"))
    if magic != MAGIC:
        raise FormatError(f"rans_float: magic {magic:#010x}, expected {MAGIC:#010x}",
                          path=path, tensor=name)
    if vdz & 0xFF != VERSION or vdz >> 24 or (vdz >> 8) & 0xFF not in DTYPES:
        raise FormatError(f"rans_float: unsupported version/dtype word {vdz:#x}", path=path,
                          tensor=name)
    return DTYPES[(vdz >> 8) & 0xFF][0]


def describe(raw: np.ndarray) -> dict[str, int]:
    """The header fields of a coded tensor (for reports and tests; not validated)."""
    h = [int(x) for x in np.frombuffer(np.asarray(raw, dtype=np.uint8)[:4 * HEADER_WORDS]
                                       .tobytes(), dtype="<u4")]
    keys = ("magic", "crc32", "version_dtype_z", "rows", "cols", "symbols", "tables",
            "stream_values", "streams", "stream_words", "wide_values", "exceptions")
    d = dict(zip(keys, h, strict=True))
    d["z"] = (d["version_dtype_z"] >> 16) & 0xFF
    return d
