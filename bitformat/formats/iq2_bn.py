"""``iq2_bn``: ik_llama.cpp's IQ2_BN (GGML type 135 there), 2 bits per trit and one f32 scale a row.

Byte spec (see docs/formats/iq2_bn.md; ik_llama.cpp ggml-common.h ``block_iq2_bn``,
iqk/iqk_quantize.cpp ``quantize_one_row_2bn`` / ``dequantize_row_iq2_bn``, ggml.c type
traits ``row_meta_size = 4``)::

    Every row MUST hold a multiple of 64 values. A row is its scale d (IEEE float32, little
    endian, 4 bytes) and then cols / 64 blocks of 16 bytes. Block element j (slot g = j // 16,
    lane m = j % 16) has its code c = trit + 1 (-1 -> 0b00, 0 -> 0b01, +1 -> 0b10) in
    qs[m] at bits 2g:

        qs[m]:  [ e48+m | e32+m | e16+m | em ]      (element m in bits 1..0)

    w = d * (c - 1). Code 0b11 and a NaN or infinite d MUST be rejected. Writers give a row
    without a non-zero trit d = 0 (ik_llama.cpp's quantizer writes d = max|x| of the row).
    This type is not in upstream ggml: upstream's type 135 is unassigned.
"""

from __future__ import annotations

import numpy as np

from ..constants import GGML_BLOCK_LAYOUT, ROW_META_BYTES, FileType, GGMLType
from ..errors import InvalidScaleError, InvalidTritError, ShapeError
from ..ternary import TernaryTensor
from .base import TernaryFormat, _round_scales_f16
from .tq2_0 import find_code3

QK = 64
QS_BYTES = GGML_BLOCK_LAYOUT[GGMLType.IQ2_BN][1]  # 16
META = ROW_META_BYTES[GGMLType.IQ2_BN]  # 4: the row's f32 scale
_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)


class RowScaled(TernaryFormat):
    """Formats with one scale per row, stored at the row's start (ik_llama.cpp's BitNet types)."""

    row_block = QK

    def prepare(self, t: TernaryTensor, allow_rounding: bool = False) -> tuple[TernaryTensor,
                                                                                 float]:
        self.check_shape(t.rows, t.cols, t.name)
        t = t.with_block_scales(t.cols)
        if self.scale_dtype == "f16":
            return _round_scales_f16(t, self.format_id, allow_rounding)
        return t, 0.0

    def row_scales(self, rows_bytes: np.ndarray) -> np.ndarray:
        """float32 [rows]: each row's scale from its first bytes."""
        dt = "<f2" if self.scale_dtype == "f16" else "<f4"
        return np.ascontiguousarray(rows_bytes[:, :self.meta]).view(dt)[:, 0].astype(np.float32)

    meta = 0

    def split_rows(self, raw: np.ndarray, rows: int, cols: int, path, name
                   ) -> tuple[np.ndarray, np.ndarray]:
        """(float32 row scales [rows], uint8 block bytes [rows, row bytes]) after the checks
        every reader makes: shape, size, finite scales."""
        try:
            self.check_shape(rows, cols, name or "")
        except ShapeError as e:
            raise ShapeError(e.problem, path=path, tensor=name) from None
        want = self.nbytes(rows, cols)
        if raw.size != want:
            raise ShapeError(f"a {rows}x{cols} {self.format_id} tensor takes {want} bytes, got "
                             f"{raw.size}", path=path, tensor=name)
        r = raw.reshape(rows, want // rows)
        d = self.row_scales(r)
        bad = ~np.isfinite(d)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise InvalidScaleError(f"row scale is {float(d[i])} at row {i}", path=path,
                                    tensor=name)
        return d, r[:, self.meta:]

    def join_rows(self, t: TernaryTensor, blocks: np.ndarray) -> np.ndarray:
        dt = "<f2" if self.scale_dtype == "f16" else "<f4"
        out = np.empty((t.rows, self.meta + blocks.shape[1]), dtype=np.uint8)
        out[:, :self.meta] = t.scales.astype(dt).reshape(t.rows, 1).view(np.uint8)
        out[:, self.meta:] = blocks
        return out.reshape(-1)


class IQ2BN(RowScaled):
    format_id = "iq2_bn"
    storage_type = GGMLType.IQ2_BN
    file_type = FileType.MOSTLY_IQ2_BN
    scale_block = -1  # one per row (prepare); never per tensor
    scale_dtype = "f32"
    meta = META
    description = "ik_llama.cpp IQ2_BN: 2 bits per weight, 64-value blocks, f32 scale per row"

    def encode(self, t: TernaryTensor) -> np.ndarray:
        c = (t.trits.reshape(-1, 4, 16) + np.int8(1)).view(np.uint8)  # [block, slot, lane]
        qs = c[:, 0] | (c[:, 1] << 2)
        qs |= c[:, 2] << 4
        qs |= c[:, 3] << 6
        return self.join_rows(t, qs.reshape(t.rows, -1))

    def decode(self, raw: np.ndarray, rows: int, cols: int, *, scale: float | None = None,
               path: str | None = None, name: str | None = None) -> TernaryTensor:
        d, qs = self.split_rows(raw, rows, cols, path, name)
        bad = find_code3(qs)
        if bad is not None:
            r, k, byte, g = bad
            blk, m = divmod(k, QS_BYTES)
            raise InvalidTritError(f"code 3 (not a trit) at row {r}, column "
                                   f"{blk * QK + 16 * g + m} (block {blk}, byte {m} = "
                                   f"{byte:#04x})", path=path, tensor=name)
        p = qs.reshape(-1, 1, 1, QS_BYTES)
        trits = ((p >> _SHIFTS) & 3).reshape(rows, cols).view(np.int8)
        trits -= np.int8(1)
        return TernaryTensor(trits, d.reshape(rows, 1), cols, name or "")
