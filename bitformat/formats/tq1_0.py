"""``tq1_0``: upstream ggml's TQ1_0 (GGML type 34), five trits per byte plus an f16 scale.

Byte spec (see docs/formats/tq1_0.md)::

    Every row MUST hold a multiple of 256 values; a row is cut into blocks of 256, each
    stored as 54 bytes: qs[48], qh[4], d (IEEE float16, little endian). Codes c = trit + 1
    are combined as base-3 digits, most significant first, and scaled into a byte:

        n = 81*c0 + 27*c1 + 9*c2 + 3*c3 + c4        (qh: c4 = 0, so n = 3*(27*c0 + ...))
        byte = ceil(n * 256 / 243) = (n*256 + 242) // 243

    qs[m]      (m 0..31)  digits c0..c4 = elements m, m+32, m+64, m+96, m+128
    qs[32+m]   (m 0..15)  digits c0..c4 = elements 160+m, 176+m, 192+m, 208+m, 224+m
    qh[m]      (m 0..3)   digits c0..c3 = elements 240+m, 244+m, 248+m, 252+m

    Digit k of a byte b reads back as c = ((b * 3^k mod 256) * 3) >> 8, and w = d * (c - 1).
    Only 243 byte values are encodings (81 for qh); readers MUST reject the others, and a
    NaN or infinite d. Writers MUST give a block without a non-zero trit d = 0.
"""

from __future__ import annotations

import numpy as np

from ..constants import GGML_BLOCK_LAYOUT, FileType, GGMLType
from ..errors import InvalidTritError
from .base import F16BlockFormat
from .tq2_0 import QK

BLOCK_BYTES = GGML_BLOCK_LAYOUT[GGMLType.TQ1_0][1]  # 54 = qs[48] + qh[4] + f16 d
QS_BYTES = 48
QH_BYTES = 4
D_AT = QS_BYTES + QH_BYTES  # 52

#: The three byte groups of a block: (first byte, bytes, first element, digits per byte).
#: Byte ``first + m`` holds elements ``elem + m + k*bytes`` for digit k.
GROUPS = ((0, 32, 0, 5), (32, 16, 160, 5), (48, 4, 240, 4))

#: base-3 number n (0..242) -> stored byte; ceil(n * 256 / 243), as ggml computes it.
ENCODE_LUT = ((np.arange(243) * 256 + 242) // 243).astype(np.uint8)
#: Which bytes are the encoding of five digits (qs) or of four digits and a zero (qh).
VALID_QS = np.zeros(256, dtype=bool)
VALID_QS[ENCODE_LUT] = True
VALID_QH = np.zeros(256, dtype=bool)
VALID_QH[ENCODE_LUT[::3]] = True


def check_digit_bytes(blocks: np.ndarray, spans, per_row: int, path: str | None,
                      name: str | None) -> None:
    """Refuse the first byte of ``blocks`` [n, block bytes] that is not a base-3 encoding:
    ``spans`` are (first byte, end, table of valid bytes, "five"/"four" trits per byte); the
    error names the byte, the block and the row (``per_row`` blocks a row)."""
    for lo, hi, valid, what in spans:
        part = blocks[:, lo:hi]
        ok = valid[part]
        if not ok.all():
            b, k = divmod(int(np.flatnonzero(~ok.reshape(-1))[0]), hi - lo)
            r, blk = divmod(b, per_row)
            raise InvalidTritError(
                f"byte {lo + k} = {int(part[b, k]):#04x} of block {blk} in row {r} is not "
                f"an encoding of {what} trits", path=path, tensor=name)


def pack_blocks(codes: np.ndarray) -> np.ndarray:
    """uint8 codes ``(n_blocks, 256)`` -> ``qs`` + ``qh`` bytes ``(n_blocks, 52)``."""
    nb = codes.shape[0]
    out = np.empty((nb, D_AT), dtype=np.uint8)
    three = np.uint8(3)
    for first, width, elem, digits in GROUPS:
        c = codes[:, elem: elem + digits * width].reshape(nb, digits, width)
        n = c[:, 0] * three  # Horner in uint8: n <= 242 never wraps
        for k in range(1, 5):
            if k < digits:
                n += c[:, k]
            if k < 4:
                n *= three
        out[:, first: first + width] = ENCODE_LUT[n]
    return out


def unpack_blocks(packed: np.ndarray) -> np.ndarray:
    """``qs`` + ``qh`` bytes ``(n_blocks, 52+)`` -> int8 trits ``(n_blocks, 256)``.

    Assumes every byte is valid (see :data:`VALID_QS`). Digit k of byte b is
    ``c = (q * 3) >> 8`` with ``q = b * 3**k mod 256``, i.e. 0 below 86, 1 below 171, else
    2; so the trit ``c - 1`` is ``(q > 170) - (q < 86)``.
    """
    nb = packed.shape[0]
    out = np.empty((nb, QK), dtype=np.int8)
    for first, width, elem, digits in GROUPS:
        b = packed[:, first: first + width]
        view = out[:, elem: elem + digits * width].reshape(nb, digits, width)
        for k in range(digits):
            q = b * np.uint8(3 ** k) if k else b  # uint8 multiply wraps mod 256 on purpose
            np.subtract((q > 170).view(np.int8), (q < 86).view(np.int8), out=view[:, k])
    return out


class TQ10(F16BlockFormat):
    format_id = "tq1_0"
    storage_type = GGMLType.TQ1_0
    file_type = FileType.MOSTLY_TQ1_0
    scale_block = QK
    row_block = QK
    scale_dtype = "f16"
    description = "ggml TQ1_0: 1.69 bits per weight (base 3), 256-value blocks, f16 scale"

    block_bytes = BLOCK_BYTES
    scale_at = D_AT  # qs[48], qh[4], then d

    def pack(self, codes: np.ndarray) -> np.ndarray:
        return pack_blocks(codes)

    def unpack(self, packed: np.ndarray, per_row: int, path: str | None,
               name: str | None) -> np.ndarray:
        check_digit_bytes(packed, ((0, QS_BYTES, VALID_QS, "five"),
                                   (QS_BYTES, D_AT, VALID_QH, "four")), per_row, path, name)
        return unpack_blocks(packed)
