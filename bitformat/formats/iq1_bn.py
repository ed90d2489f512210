"""``iq1_bn``: ik_llama.cpp's IQ1_BN (GGML type 134 there), 1.625 bits per trit, f16 scale a row.

Byte spec (see docs/formats/iq1_bn.md; ik_llama.cpp ggml-common.h ``block_iq1_bn``,
iqk/iqk_quantize.cpp ``quantize_one_row_1bn`` / ``dequantize_row_iq1_bn``, ggml.c type
traits ``row_meta_size = 2``)::

    Every row MUST hold a multiple of 64 values. A row is its scale d (IEEE float16, little
    endian, 2 bytes) and then cols / 64 blocks of 13 bytes: ql[12] then extra. With codes
    c = trit + 1 (0, 1, 2), a block's element 16 i + 5 k + j (i 0..3, k 0..2, j 0..4) is
    base-3 digit j (least significant first) of ql[3 i + k], and element 16 i + 15 is digit i
    of extra:

        n(ql[3i+k]) = sum_j 3^j * c[16i + 5k + j]     n(extra) = sum_i 3^i * c[16i + 15]
        byte = ceil(n * 256 / 243) = (256 n + 242) // 243

    Digit j of a byte b reads back as c = ((b * 3^(4-j) mod 256) * 3) >> 8, and w = d * (c-1).
    Only the 243 bytes ceil(256 n / 243) are ql encodings and only the first 81 of them
    extra encodings: readers MUST reject the others, and a NaN or infinite d. Writers give a
    row without a non-zero trit d = 0 (ik_llama.cpp's quantizer writes d = max|x| of the row).
"""

from __future__ import annotations

import numpy as np

from ..constants import ROW_META_BYTES, FileType, GGMLType
from ..ternary import TernaryTensor
from .iq2_bn import QK, RowScaled
from .tq1_0 import ENCODE_LUT, VALID_QS, check_digit_bytes

BLOCK_BYTES = 13
META = ROW_META_BYTES[GGMLType.IQ1_BN]  # 2: the row's f16 scale
VALID_EXTRA = np.zeros(256, dtype=bool)
VALID_EXTRA[ENCODE_LUT[:81]] = True
_POW3 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)
#: element index of (byte, digit) in a block: ql[3i+k] digit j, then extra digit i
_QL_ELEM = np.array([[16 * (b // 3) + 5 * (b % 3) + j for j in range(5)] for b in range(12)])
_EXTRA_ELEM = np.array([16 * i + 15 for i in range(4)])


class IQ1BN(RowScaled):
    format_id = "iq1_bn"
    storage_type = GGMLType.IQ1_BN
    file_type = FileType.MOSTLY_IQ1_BN
    scale_block = -1  # one per row (prepare)
    scale_dtype = "f16"
    meta = META
    description = "ik_llama.cpp IQ1_BN: 1.625 bits per weight (base 3), f16 scale per row"

    def encode(self, t: TernaryTensor) -> np.ndarray:
        c = (t.trits.reshape(-1, QK) + np.int8(1)).astype(np.int32)  # [block, element]
        nb = c.shape[0]
        out = np.empty((nb, BLOCK_BYTES), dtype=np.uint8)
        out[:, :12] = ENCODE_LUT[(c[:, _QL_ELEM] * _POW3.astype(np.int32)).sum(axis=2)]
        out[:, 12] = ENCODE_LUT[(c[:, _EXTRA_ELEM] * _POW3[:4].astype(np.int32)).sum(axis=1)]
        return self.join_rows(t, out.reshape(t.rows, -1))

    def decode(self, raw: np.ndarray, rows: int, cols: int, *, scale: float | None = None,
               path: str | None = None, name: str | None = None) -> TernaryTensor:
        d, body = self.split_rows(raw, rows, cols, path, name)
        blocks = body.reshape(-1, BLOCK_BYTES)
        per_row = cols // QK
        check_digit_bytes(blocks, ((0, 12, VALID_QS, "five"), (12, 13, VALID_EXTRA, "four")),
                          per_row, path, name)
        trits = np.empty((blocks.shape[0], QK), dtype=np.int8)
        for j in range(5):  # digit j: multiplier 3^(4-j)
            q = blocks[:, :12] * np.uint8(3 ** (4 - j))  # wraps mod 256 on purpose
            trits[:, _QL_ELEM[:, j]] = (q > 170).view(np.int8) - (q < 86).view(np.int8)
        for i in range(4):
            q = blocks[:, 12] * np.uint8(3 ** (4 - i))
            trits[:, _EXTRA_ELEM[i]] = (q > 170).view(np.int8) - (q < 86).view(np.int8)
        return TernaryTensor(trits.reshape(rows, cols), d.reshape(rows, 1), cols, name or "")
