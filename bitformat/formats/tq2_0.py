"""``tq2_0``: upstream ggml's TQ2_0 (GGML type 35), 2 bits per trit plus an f16 scale.

Byte spec (see docs/formats/tq2_0.md)::

    Every row MUST hold a multiple of 256 values; a row is cut into blocks of 256, each
    stored as 66 bytes: qs[64] then d (IEEE float16, little endian). Block element j (half
    h = j // 128, group g = (j % 128) // 32, lane m = j % 32) has its code c = trit + 1
    (-1 -> 0b00, 0 -> 0b01, +1 -> 0b10) in qs[h*32 + m] at bits 2g..2g+1:

        qs[h*32+m]:  [ g3 | g2 | g1 | g0 ]      (g0 in bits 1..0, g3 in bits 7..6)
                       7 6  5 4  3 2  1 0

    The value is w = d * (c - 1). Writers MUST give a block without a non-zero trit d = 0
    (as ggml's and gguf-py's quantizers do); readers MUST accept any finite d there. Code
    0b11 and a NaN or infinite d MUST be rejected.
"""

from __future__ import annotations

import numpy as np

from ..constants import GGML_BLOCK_LAYOUT, FileType, GGMLType
from ..errors import InvalidTritError
from .base import F16BlockFormat

QK = 256  # values per block
QS_BYTES = QK // 4  # 64: four codes per byte
BLOCK_BYTES = GGML_BLOCK_LAYOUT[GGMLType.TQ2_0][1]  # 66 = qs[64] + f16 d
_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)


def pack_qs(codes: np.ndarray) -> np.ndarray:
    """uint8 codes ``(n_blocks, 256)`` -> ``qs`` bytes ``(n_blocks, 64)``."""
    c = codes.reshape(-1, 2, 4, 32)  # [block, half, group, lane]
    qs = c[:, :, 0] | (c[:, :, 1] << 2)
    qs |= c[:, :, 2] << 4
    qs |= c[:, :, 3] << 6
    return qs.reshape(-1, QS_BYTES)


def unpack_qs(qs: np.ndarray) -> np.ndarray:
    """``qs`` bytes ``(n_blocks, 64)`` -> uint8 codes ``(n_blocks, 256)``."""
    p = qs.reshape(-1, 2, 1, 32)
    return ((p >> _SHIFTS) & 3).reshape(-1, QK)


def first_code3(packed: np.ndarray) -> int | None:
    """Flat index of the first byte holding the code 0b11 in any bit pair, or None.

    A pair is 0b11 exactly when its high bit and its low bit are both set, so one AND over
    the packed bytes finds it without unpacking.
    """
    hit = (packed & (packed >> 1) & 0x55) != 0
    if not hit.any():
        return None
    return int(np.flatnonzero(hit.reshape(-1))[0])


def find_code3(packed: np.ndarray) -> tuple[int, int, int, int] | None:
    """Where the first code 0b11 of ``packed`` [n, k] bytes is: ``(row, byte, value, pair)``
    (the pair at bits ``2 pair``), or None; what each format's error names it by."""
    at = first_code3(packed)
    if at is None:
        return None
    r, k = divmod(at, packed.shape[-1])
    byte = int(packed[r, k])
    return r, k, byte, next(g for g in range(4) if (byte >> 2 * g) & 3 == 3)


class TQ20(F16BlockFormat):
    format_id = "tq2_0"
    storage_type = GGMLType.TQ2_0
    file_type = FileType.MOSTLY_TQ2_0
    scale_block = QK
    row_block = QK
    scale_dtype = "f16"
    description = "ggml TQ2_0: 2 bits per weight, 256-value blocks with an f16 scale each"

    block_bytes = BLOCK_BYTES
    scale_at = QS_BYTES  # qs[64], then d

    def pack(self, codes: np.ndarray) -> np.ndarray:
        return pack_qs(codes)

    def unpack(self, qs: np.ndarray, per_row: int, path: str | None,
               name: str | None) -> np.ndarray:
        bad = find_code3(qs)
        if bad is not None:
            b, k, byte, g = bad
            j = (k // 32) * 128 + g * 32 + k % 32
            r, blk = divmod(b, per_row)
            raise InvalidTritError(f"code 3 (not a trit) at row {r}, column {blk * QK + j} "
                                   f"(block {blk}, byte {k} = {byte:#04x})", path=path,
                                   tensor=name)
        trits = unpack_qs(qs).view(np.int8)
        trits -= np.int8(1)
        return trits
