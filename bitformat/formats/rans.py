"""``rans``: ternary matrices entropy-coded as independent rANS streams, for storage.

Byte spec (full text, reasons and measurements: docs/formats/rans.md)::

    Stored as a 1-D GGML I32 tensor of N little-endian u32 words (its size depends on the
    content); shape and f32 scale travel as bitformat.tensor.<name>.* metadata, as for stfma.

    word  0      magic 0x534E4152 (bytes "RANS")
    word  1      CRC-32 (zlib / ISO-HDLC) of every byte after this word
    word  2      version 1 in bits 0..7, group (5 or 1 trits per symbol) in bits 8..15
    words 3..11  rows, cols, live_rows L, live_cols C, tables T (1..16),
                 rows_per_stream k, pieces p, streams S, stream words W
    then, each section a whole number of words:
      dead-row bitmap   ceil(rows/32) words, bit r%32 of word r/32 = row r is all zero
      dead-col bitmap   ceil(cols/32) words, the same for columns
      tables            T x 2 words: [u(-1) | u(0) << 16, u(+1)], 12-bit units summing to 4096
      row classes       only if T > 1: L nibbles (live row i at bits 4(i%8) of word i/8)
      word counts       S u16 (stream s in the low half of word s/2 when s is even)
      streams           W words: the S constriction-format rANS streams, concatenated

The live sub-matrix (rows and columns not flagged dead) is cut into S = ceil(L/k) * p
streams: k consecutive live rows per stream (rows shorter than 4096 trits) or p pieces per
row (cut at multiples of 5). Each row segment is coded as 5-trit symbols (alphabet 243,
digits as in base3; the last padded with zero trits) with its row class's table.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from ..codecs import rans_tables as rt
from ..codecs.rans_streams import RansTables
from ..constants import GGMLType
from ..errors import (
    FormatError,
    InvalidScaleError,
    InvalidTritError,
    MetadataError,
    ShapeError,
)
from ..ternary import TernaryTensor
from .base import TernaryFormat

if TYPE_CHECKING:
    from .rans_layout import Geometry

MAGIC = 0x534E4152  # b"RANS" read as a little-endian u32
VERSION = 1
HEADER_WORDS = 12
MAX_TABLES = 16
MAX_DIM = (1 << 31) - 1  # rows and cols are u32 fields; kept below 2^31 for int32 indexing
# A flagged-dead matrix costs (rows + cols) bits, so the data cannot bound the matrix it
# claims: the trit count is capped (1 GiB of decoded trits; 60x the largest 2B-4T tensor,
# above the largest projection of any released model), and a model opened to run or convert
# has every shape checked against its config first (bitformat/validate.py).
MAX_TRITS = 1 << 30
GROUPS = {5: "group5", 1: "trit"}
MIN_STREAM = 4096


def _words(n_bits: int) -> int:
    return -(-n_bits // 32)


def section_words(rows: int, cols: int, live_rows: int, tables: int, streams: int,
                  stream_words: int) -> dict[str, int]:
    """Words of each section, in file order (Python ints, so no overflow)."""
    return {"header": HEADER_WORDS, "dead_rows": _words(rows), "dead_cols": _words(cols),
            "tables": 2 * tables, "classes": _words(4 * live_rows) if tables > 1 else 0,
            "counts": _words(16 * streams), "streams": stream_words}


def _bitmap(flags: np.ndarray) -> np.ndarray:
    """bool flags -> u32 words, flag i at bit i % 32 of word i // 32."""
    packed = np.packbits(flags.astype(np.uint8), bitorder="little")
    out = np.zeros(_words(flags.size) * 4, dtype=np.uint8)
    out[:packed.size] = packed
    return out.view("<u4")


def _pack(values: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned values of ``bits`` (4 or 16) -> u32 words, lowest bits first."""
    per = 32 // bits
    v = np.zeros(-(-values.size // per) * per, dtype=np.uint32)
    v[:values.size] = values
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, :]
    return np.bitwise_or.reduce(v.reshape(-1, per) << shifts, axis=1).astype("<u4")


def _unpack(words: np.ndarray, bits: int) -> np.ndarray:
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, :]
    return ((words.astype(np.uint32)[:, None] >> shifts) & ((1 << bits) - 1)).reshape(-1)


class Rans(TernaryFormat):
    """Tile-wise rANS container encoding (see the module docstring for the bytes).

    ``mode`` picks the symbol: ``"group5"`` (5 trits, the default) or ``"trit"``; both are
    read whatever the instance's mode. ``min_stream`` is the trits a stream should hold and
    ``max_tables`` the most row classes the writer tries (both for measurements; readers take
    whatever the data says).
    """

    format_id = "rans"
    storage_type = GGMLType.I32
    native = False
    variable_size = True
    scale_block = 0
    scale_dtype = "f32"
    description = ("row-class rANS streams of 5-trit symbols over the live sub-matrix, dead "
                   "rows and columns flagged; per-tensor f32 scale in metadata")
    group_of: ClassVar[dict[str, int]] = {"group5": 5, "trit": 1}
    plain_coding = "rans_float"  # the embedding / LM head too (docs/formats/rans_float.md)

    def __init__(self, mode: str = "group5", min_stream: int = MIN_STREAM,
                 max_tables: int = MAX_TABLES):
        if mode not in self.group_of:
            raise ValueError(f"rans mode must be 'group5' or 'trit', got {mode!r:.20}")
        if not 5 <= min_stream <= 1 << 15 or not 1 <= max_tables <= MAX_TABLES:
            # streams hold < 2 * min_stream trits, so their word counts fit in u16
            raise ValueError(f"min_stream must be in 5..32768 and max_tables in "
                             f"1..{MAX_TABLES}")
        self.mode = mode
        self.group = self.group_of[mode]
        self.min_stream = int(min_stream)
        self.max_tables = int(max_tables)

    def check_shape(self, rows: int, cols: int, name: str = "") -> None:
        super().check_shape(rows, cols, name)
        if rows > MAX_DIM or cols > MAX_DIM or rows * cols > MAX_TRITS:
            raise ShapeError(f"rans stores at most {MAX_DIM} rows and columns and {MAX_TRITS} "
                             f"trits, got {rows}x{cols}", tensor=name or None)

    def stored_shape(self, rows: int, cols: int) -> tuple[int, ...]:
        raise TypeError("a rans tensor's size depends on its trits; encode it to learn it")

    # -- encode ----------------------------------------------------------------------------
    def encode(self, t: TernaryTensor) -> np.ndarray:
        from . import rans_layout as rl

        trits = np.ascontiguousarray(t.trits, dtype=np.int8)
        rows, cols = trits.shape
        self.check_shape(rows, cols, t.name)
        counts = np.empty((rows, 3), dtype=np.int64)
        colnz = np.zeros(cols, dtype=np.uint8)
        bad = rl.scan(trits, counts, colnz)
        if bad >= 0:
            r, c = divmod(int(bad), cols)
            raise InvalidTritError(f"value {int(trits[r, c])} at row {r}, column {c} is not "
                                   "a trit", tensor=t.name or None)
        dead_rows = counts[:, 1] == cols
        lrows = np.flatnonzero(~dead_rows).astype(np.int64)
        lcols = np.flatnonzero(colnz).astype(np.int64)
        n_live, n_cols = lrows.size, lcols.size
        live_counts = counts[lrows]
        live_counts[:, 1] -= cols - n_cols  # dead columns hold zeros only
        if n_live:
            units, cls = rl.fit_classes(live_counts, self.max_tables)
        else:
            units, cls = rt.trit_units([0, 0, 0])[None, :], np.zeros(0, dtype=np.uint8)
        tables = RansTables.from_stored(self.mode, units)
        geom = rl.choose_geometry(n_live, n_cols, self.min_stream)
        words, wcounts = rl.encode(trits, lrows, lcols if n_cols < cols else None, geom,
                                   self.group, cls, tables.freqs, tables.cdfs)
        header = np.array([MAGIC, 0, VERSION | self.group << 8, rows, cols, n_live, n_cols,
                           len(units), geom.rows_per_stream, geom.pieces, geom.n_streams,
                           words.size], dtype="<u4")
        tab = np.stack([units[:, 0] | units[:, 1] << 16, units[:, 2]], axis=1)
        parts = [header, _bitmap(dead_rows), _bitmap(colnz == 0), tab.astype("<u4").reshape(-1)]
        if len(units) > 1:
            parts.append(_pack(cls, 4))
        parts += [_pack(wcounts, 16), words.astype("<u4", copy=False)]
        out = np.concatenate(parts).view(np.uint8)
        out[4:8] = np.array([zlib.crc32(out[8:])], dtype="<u4").view(np.uint8)
        return out

    # -- decode ----------------------------------------------------------------------------
    def decode(self, raw: np.ndarray, rows: int, cols: int, *, scale: float | None = None,
               path: str | None = None, name: str | None = None) -> TernaryTensor:
        p = parse(raw, rows, cols, scale=scale, path=path, name=name)
        from . import rans_layout as rl

        out = np.zeros((rows, cols), dtype=np.int8)
        status = rl.decode(p.streams, p.word_off, out, p.live_rows,
                           p.live_cols if p.live_cols.size < cols else None, p.geometry,
                           p.group, p.classes, p.tables.freqs, p.tables.cdfs, p.tables.luts)
        if status.any():
            raise p.corrupt_stream(int(np.flatnonzero(status)[0]))
        return TernaryTensor(out, np.float32([p.scale]), 0, name or "")


@dataclass
class Parsed:
    """A rans tensor whose every field has been checked (:func:`parse`), ready to decode."""

    where: dict
    rows: int
    cols: int
    scale: float
    group: int
    geometry: Geometry
    live_rows: np.ndarray  # int64 [L]
    live_cols: np.ndarray  # int64 [C]
    classes: np.ndarray  # uint8 [L]
    units: np.ndarray  # int64 [T, 3]
    tables: RansTables
    streams: np.ndarray  # uint32 [W], the stream section
    stream_start: int  # its first word in the tensor's words
    word_off: np.ndarray  # int64 [S + 1]: each stream's start in ``streams``

    def corrupt_stream(self, s: int) -> FormatError:
        g, j = divmod(s, self.geometry.pieces)
        k = self.geometry.rows_per_stream
        r0, r1 = g * k, min(self.geometry.live_rows, g * k + k) - 1
        c = self.geometry.cuts()
        return FormatError(f"rans: stream {s} of {self.geometry.n_streams} (live rows {r0}.."
                           f"{r1}, live columns {int(c[j])}..{int(c[j + 1]) - 1}) is corrupt: "
                           "it did not end in state 0 with every word read, or its padding "
                           "is not zero trits", **self.where)


def parse(raw: np.ndarray, rows: int, cols: int, *, scale: float | None = None,
          path: str | None = None, name: str | None = None, check_crc: bool = True) -> Parsed:
    """Check every field of a rans tensor (and its CRC-32) except the streams' contents,
    which a decoder checks as it reads them (end state, padding)."""
    where = {"path": path, "tensor": name}
    try:
        Rans().check_shape(rows, cols, name or "")
    except ShapeError as e:
        raise ShapeError(e.problem, **where) from None
    if scale is None:
        raise MetadataError("rans needs the per-tensor scale from the metadata", **where)
    if not np.isfinite(scale):
        raise InvalidScaleError(f"scale is {scale}", **where)
    raw = np.asarray(raw).reshape(-1)
    if raw.dtype != np.uint8:
        raw = raw.view(np.uint8)
    n = raw.size
    if n < 4 * HEADER_WORDS or n % 4:
        raise ShapeError(f"a rans tensor is whole words of at least a {4 * HEADER_WORDS}-"
                         f"byte header, got {n} bytes", **where)
    h = [int(v) for v in np.frombuffer(raw[:4 * HEADER_WORDS].tobytes(), dtype="<u4")]
    magic, crc, vg, hrows, hcols, n_live, n_cols, n_tab, k, p, n_streams, n_words = h
    if magic != MAGIC:
        raise FormatError(f"not a rans tensor: magic {magic:#010x}, expected "
                          f"{MAGIC:#010x}", **where)
    if vg & 0xFF != VERSION or vg >> 16 or (vg >> 8) & 0xFF not in GROUPS:
        raise FormatError(f"unsupported rans version/group word {vg:#x}", **where)
    group = (vg >> 8) & 0xFF
    if (hrows, hcols) != (rows, cols):
        raise ShapeError(f"rans data is for a {hrows}x{hcols} matrix, the metadata says "
                         f"{rows}x{cols}", **where)
    sizes = section_words(rows, cols, min(n_live, rows), min(n_tab, MAX_TABLES),
                          n_streams, n_words)
    want = 4 * sum(sizes.values())
    if n != want:
        raise ShapeError(f"a {rows}x{cols} rans tensor with {n_streams} streams of "
                         f"{n_words} words takes {want} bytes, got {n}", **where)
    if check_crc and zlib.crc32(raw[8:]) != crc:
        raise FormatError("rans checksum mismatch (CRC-32 of the tensor data)", **where)
    from . import rans_layout as rl

    def bad(msg: str) -> FormatError:
        return FormatError(f"rans: {msg}", **where)

    if not 1 <= n_tab <= MAX_TABLES:
        raise bad(f"{n_tab} tables (1..{MAX_TABLES} allowed)")
    if raw.ctypes.data % 4:
        raw = raw.copy()
    words = raw.view("<u4")
    at = {}
    pos = 0
    for key, size in sizes.items():
        at[key] = words[pos:pos + size]
        pos += size
    dead_rows = np.unpackbits(at["dead_rows"].view(np.uint8), bitorder="little")
    dead_cols = np.unpackbits(at["dead_cols"].view(np.uint8), bitorder="little")
    if dead_rows[rows:].any() or dead_cols[cols:].any():
        raise bad("bits past the last row or column are set in a dead-row/column map")
    lrows = np.flatnonzero(dead_rows[:rows] == 0).astype(np.int64)
    lcols = np.flatnonzero(dead_cols[:cols] == 0).astype(np.int64)
    if (lrows.size, lcols.size) != (n_live, n_cols):
        raise bad(f"header says {n_live} live rows and {n_cols} live columns, the maps "
                  f"{lrows.size} and {lcols.size}")
    if (n_live == 0) != (n_cols == 0):
        raise bad("a matrix with live rows has live columns, and the other way round")
    if k < 1 or p < 1 or (k > 1 and p > 1) or k > max(n_live, 1) or (
            p > 1 and p > n_cols // rl.ALIGN):
        raise bad(f"bad stream geometry: {k} rows per stream, {p} pieces per row for "
                  f"{n_live}x{n_cols} live trits")
    geom = rl.Geometry(n_live, n_cols, k, p)
    if geom.n_streams != n_streams:
        raise bad(f"header says {n_streams} streams, the geometry gives {geom.n_streams}")
    tab = at["tables"].reshape(-1, 2).astype(np.int64)
    units = np.stack([tab[:, 0] & 0xFFFF, tab[:, 0] >> 16, tab[:, 1]], axis=1)
    if np.any(units.min(axis=1) < 1) or np.any(units.sum(axis=1) != rt.UNITS):
        raise bad(f"a frequency table is not three units >= 1 summing to {rt.UNITS}")
    if n_tab > 1:
        cls = _unpack(at["classes"], 4)
        if cls[n_live:].any() or (n_live and cls[:n_live].max() >= n_tab):
            raise bad(f"a row class is not below {n_tab}, or class padding is not zero")
        cls = cls[:n_live].astype(np.uint8)
    else:
        cls = np.zeros(n_live, dtype=np.uint8)
    counts = _unpack(at["counts"], 16).astype(np.int64)
    if counts[n_streams:].any() or int(counts[:n_streams].sum()) != n_words:
        raise bad(f"stream word counts do not add up to the {n_words} stream words")
    word_off = np.zeros(n_streams + 1, dtype=np.int64)
    np.cumsum(counts[:n_streams], out=word_off[1:])
    tables = RansTables.from_stored(GROUPS[group], units)
    start = pos - n_words  # the streams are the last section
    return Parsed(where, rows, cols, float(scale), group, geom, lrows, lcols, cls, units,
                  tables, np.ascontiguousarray(at["streams"], dtype=np.uint32), start,
                  word_off)


def describe(raw: np.ndarray) -> dict[str, int]:
    """The header fields of an encoded tensor (for reports and tests; not validated)."""
    h = [int(v) for v in np.frombuffer(np.asarray(raw, dtype=np.uint8)[:4 * HEADER_WORDS]
                                       .tobytes(), dtype="<u4")]
    keys = ("magic", "crc32", "version_group", "rows", "cols", "live_rows", "live_cols",
            "tables", "rows_per_stream", "pieces", "streams", "stream_words")
    return dict(zip(keys, h, strict=True))
