"""``q2_0``: upstream ggml's Q2_0 (GGML type 42), 64-value blocks of 2-bit codes and an f16 scale.

Byte spec (see docs/formats/q2_0.md; ggml-common.h ``block_q2_0``, ggml-quants.c
``quantize_row_q2_0_ref`` / ``dequantize_row_q2_0``)::

    Every row MUST hold a multiple of 64 values; a row is cut into blocks of 64, each stored
    as 18 bytes: d (IEEE float16, little endian) then qs[16]. Block element j has its code
    c = trit + 1 (-1 -> 0b00, 0 -> 0b01, +1 -> 0b10) in qs[j // 4] at bits 2*(j % 4):

        qs[m]:  [ e4m+3 | e4m+2 | e4m+1 | e4m ]      (element 4m in bits 1..0)

    ggml reads w = d * (c - 1). Code 0b11 (w = 2d) is valid ggml but not a trit: readers
    MUST reject it, and a NaN or infinite d. Writers give a block without a non-zero trit
    d = 0, as ggml's quantizer does (d = max|x| of the block).
"""

from __future__ import annotations

import numpy as np

from ..constants import GGML_BLOCK_LAYOUT, FileType, GGMLType
from ..errors import InvalidTritError
from .base import F16BlockFormat
from .tq2_0 import find_code3

QK = 64  # values per block
QS_BYTES = QK // 4  # 16
BLOCK_BYTES = GGML_BLOCK_LAYOUT[GGMLType.Q2_0][1]  # 18 = f16 d + qs[16]
_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8)


def pack_codes(codes: np.ndarray) -> np.ndarray:
    """uint8 codes ``(n, 4k)`` -> bytes ``(n, k)``: element 4m + g at bits 2g of byte m."""
    c = codes.reshape(codes.shape[0], -1, 4)
    out = c[:, :, 0] | (c[:, :, 1] << 2)
    out |= c[:, :, 2] << 4
    out |= c[:, :, 3] << 6
    return out


def unpack_codes(packed: np.ndarray) -> np.ndarray:
    """bytes ``(n, k)`` -> uint8 codes ``(n, 4k)`` (inverse of :func:`pack_codes`)."""
    return ((packed[:, :, None] >> _SHIFTS) & 3).reshape(packed.shape[0], -1)


class Q20(F16BlockFormat):
    format_id = "q2_0"
    storage_type = GGMLType.Q2_0
    file_type = FileType.MOSTLY_Q2_0
    scale_block = QK
    row_block = QK
    scale_dtype = "f16"
    description = "ggml Q2_0: 2.25 bits per weight, 64-value blocks with an f16 scale each"

    block_bytes = BLOCK_BYTES
    scale_at = 0  # d, then qs[16]

    def pack(self, codes: np.ndarray) -> np.ndarray:
        return pack_codes(codes)

    def unpack(self, qs: np.ndarray, per_row: int, path: str | None,
               name: str | None) -> np.ndarray:
        bad = find_code3(qs)
        if bad is not None:
            b, k, byte, g = bad
            r, blk = divmod(b, per_row)
            raise InvalidTritError(f"code 3 (the value 2d, not a trit) at row {r}, column "
                                   f"{blk * QK + 4 * k + g} (block {blk}, byte {k} = "
                                   f"{byte:#04x})", path=path, tensor=name)
        trits = unpack_codes(qs).view(np.int8)
        trits -= np.int8(1)
        return trits
