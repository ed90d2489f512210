"""``stfma``: the cached weight layout read by the sparse-ternary-FMA RFC's AVX-512 kernel.

Byte spec (see docs/formats/stfma.md)::

    Stored as a GGML I32 tensor of shape [rows, W], W = ceil(cols / 16), each word a
    little-endian u32. Row r's trits are cut into groups of 16; trit k of group w is in
    word (r, w) at bits 2k..2k+1 as code c = trit + 1 (-1 -> 0b00, 0 -> 0b01, +1 -> 0b10):

        u32 word:  [ t15 | t14 | ... | t1 | t0 ]      (t0 in bits 1..0, t15 in bits 31..30)
                    31 30 29 28       3 2  1 0

    so in file order byte 4w+i of a row holds trits 16w+4i .. 16w+4i+3 (lowest bits first).
    A row whose length is not a multiple of 16 MUST be padded with trit 0 (code 0b01);
    readers MUST reject other padding and code 0b11. The per-tensor scale is not in the
    data: it travels as float32 metadata ``bitformat.tensor.<name>.scale``.

The RFC's kernel decodes ``code - 1`` (0 -> -1, 1 -> 0, 2 -> +1), which this layout follows;
the sparse-ternary-fma library it cites uses another code map (see the docs).
"""

from __future__ import annotations

import numpy as np

from ..constants import GGMLType
from ..errors import InvalidScaleError, InvalidTritError, MetadataError, ShapeError
from ..ternary import TernaryTensor
from .base import TernaryFormat
from .tq2_0 import find_code3

GROUP = 16  # trits per u32 word


def words_per_row(cols: int) -> int:
    return -(-cols // GROUP)


def pad_rows(codes: np.ndarray, pad_code: int) -> np.ndarray:
    """uint8 codes ``(rows, cols)`` -> ``(rows, W*16)``, padded with ``pad_code``."""
    rows, cols = codes.shape
    width = words_per_row(cols) * GROUP
    if width == cols:
        return codes
    out = np.full((rows, width), pad_code, dtype=np.uint8)
    out[:, :cols] = codes
    return out


def pack4_low_first(codes: np.ndarray) -> np.ndarray:
    """uint8 codes (size a multiple of 4) -> bytes, code 4i+k at bits 2k..2k+1 of byte i."""
    c = codes.reshape(-1, 4)
    out = c[:, 0] | (c[:, 1] << 2)
    out |= c[:, 2] << 4
    out |= c[:, 3] << 6
    return out


def unpack4_low_first(packed: np.ndarray) -> np.ndarray:
    """Inverse of :func:`pack4_low_first`: bytes -> uint8 codes, four per byte, flat."""
    p = packed.reshape(-1)
    out = np.empty((p.size, 4), dtype=np.uint8)
    for k in range(4):
        np.bitwise_and(p >> (2 * k), 3, out=out[:, k])
    return out.reshape(-1)


class WordRowFormat(TernaryFormat):
    """Shared shape and checks of the 16-trits-per-u32, row-after-row layouts."""

    native = False
    storage_type = GGMLType.I32
    scale_block = 0
    scale_dtype = "f32"
    pad_code: int = 0

    def stored_shape(self, rows: int, cols: int) -> tuple[int, ...]:
        return (rows, words_per_row(cols))

    # code <-> trit maps, on whole arrays
    def to_codes(self, trits: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def to_trits(self, codes: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def encode(self, t: TernaryTensor) -> np.ndarray:
        codes = pad_rows(self.to_codes(t.trits), self.pad_code)
        return pack4_low_first(codes)

    def decode(self, raw: np.ndarray, rows: int, cols: int, *, scale: float | None = None,
               path: str | None = None, name: str | None = None) -> TernaryTensor:
        fid = self.format_id
        try:
            self.check_shape(rows, cols, name or "")
        except ShapeError as e:
            raise ShapeError(e.problem, path=path, tensor=name) from None
        if scale is None:
            raise MetadataError(f"{fid} needs the per-tensor scale from the metadata",
                                path=path, tensor=name)
        if not np.isfinite(scale):
            raise InvalidScaleError(f"scale is {scale}", path=path, tensor=name)
        nw = words_per_row(cols)
        if raw.size != rows * nw * 4:
            raise ShapeError(f"a {rows}x{cols} {fid} tensor takes {rows * nw * 4} bytes, "
                             f"got {raw.size}", path=path, tensor=name)
        bad = find_code3(raw.reshape(rows, nw * 4))
        if bad is not None:
            r, k, byte, i = bad
            raise InvalidTritError(f"code 3 (not a trit) at row {r}, column {4 * k + i} "
                                   f"(word {k // 4}, bits {8 * (k % 4) + 2 * i}.."
                                   f"{8 * (k % 4) + 2 * i + 1})", path=path, tensor=name)
        codes = unpack4_low_first(raw).reshape(rows, nw * GROUP)
        if nw * GROUP != cols:
            pad = codes[:, cols:]
            bad = pad != self.pad_code
            if bad.any():
                r, c = (int(v) for v in np.argwhere(bad)[0])
                raise InvalidTritError(
                    f"padding at row {r}, column {cols + c} holds code {int(pad[r, c])}, "
                    f"not {self.pad_code} (trit 0)", path=path, tensor=name)
            codes = np.ascontiguousarray(codes[:, :cols])
        return TernaryTensor(self.to_trits(codes), np.float32([scale]), 0, name or "")


class STFMA(WordRowFormat):
    format_id = "stfma"
    pad_code = 1  # trit 0
    description = ("sparse-ternary-FMA RFC kernel layout: 16 trits per u32 (code trit+1), "
                   "per-tensor f32 scale in metadata")

    def to_codes(self, trits: np.ndarray) -> np.ndarray:
        return (trits + np.int8(1)).view(np.uint8)

    def to_trits(self, codes: np.ndarray) -> np.ndarray:
        t = codes.view(np.int8)
        t -= np.int8(1)
        return t
