"""``i2_s``: bitnet.cpp's GGML type 36 (microsoft/BitNet fork; not in upstream ggml).

Byte spec (x86 layout, written by every published file and by bitformat)::

    The matrix is one flat row-major array, cut into blocks of 128 values (rows*cols MUST be
    a multiple of 128). Block b, element j (group g = j // 32, lane m = j % 32) has its code
    c = trit + 1 (-1 -> 0b00, 0 -> 0b01, +1 -> 0b10) in byte b*32 + m at bits 6-2g..7-2g:

        byte b*32+m:  [ g0 | g1 | g2 | g3 ]      (g0 in bits 7..6, g3 in bits 1..0)
                        7 6  5 4  3 2  1 0

    After the packed data comes a 32-byte tail: bytes 0..3 the per-tensor scale as
    little-endian float32 (w = scale * trit); bytes 4..31 MUST be written as zero and MUST be
    ignored by readers. Code 0b11 MUST be rejected.

The ARM NEON builds of bitnet.cpp (since Nov 2025) use 64-value blocks of 16 bytes (byte
b*16 + j % 16, shift 6 - 2*(j // 16)). Files do not say which layout they use, so reading
that variant is an explicit choice (``variant="arm64"``); bitformat writes only x86.
"""

from __future__ import annotations

import numpy as np

from ..constants import I2_S_TAIL_BYTES, FileType, GGMLType
from ..errors import InvalidScaleError, ShapeError
from ..ternary import TernaryTensor, check_codes
from .base import TernaryFormat

#: bitnet.cpp's value block per layout variant.
VARIANT_BLOCK = {"x86": 128, "arm64": 64}


def pack_codes(codes: np.ndarray, block: int = 128) -> np.ndarray:
    """uint8 codes (flat, length a multiple of ``block``) -> packed bytes."""
    lanes = block // 4
    c = codes.reshape(-1, 4, lanes)
    return ((c[:, 0] << 6) | (c[:, 1] << 4) | (c[:, 2] << 2) | c[:, 3]).reshape(-1)


def unpack_codes(packed: np.ndarray, block: int = 128) -> np.ndarray:
    """Packed bytes -> uint8 codes, flat."""
    lanes = block // 4
    p = packed.reshape(-1, 1, lanes)
    shifts = np.array([6, 4, 2, 0], dtype=np.uint8).reshape(1, 4, 1)
    return ((p >> shifts) & 3).reshape(-1)


class I2S(TernaryFormat):
    format_id = "i2_s"
    storage_type = GGMLType.I2_S
    file_type = FileType.MOSTLY_I2_S
    description = "bitnet.cpp I2_S: 2 bits per weight, 128-value blocks, one f32 scale"

    def __init__(self, variant: str = "x86"):
        if variant not in VARIANT_BLOCK:
            raise ValueError(f"unknown i2_s layout {variant!r}; choose x86 or arm64")
        self.variant = variant
        self.block = VARIANT_BLOCK[variant]

    def check_shape(self, rows: int, cols: int, name: str = "") -> None:
        super().check_shape(rows, cols, name)
        if (rows * cols) % 128:
            raise ShapeError(f"i2_s needs a multiple of 128 values, the matrix {rows}x{cols} "
                             f"has {rows * cols}", tensor=name or None)

    def encode(self, t: TernaryTensor) -> np.ndarray:
        codes = (t.trits.reshape(-1) + 1).astype(np.uint8)
        tail = np.zeros(I2_S_TAIL_BYTES, dtype=np.uint8)
        tail[:4] = np.frombuffer(np.float32(t.scales[0]).tobytes(), dtype=np.uint8)
        return np.concatenate([pack_codes(codes, self.block), tail])

    def validate(self, raw: np.ndarray, rows: int, cols: int, *, scale: float | None = None,
                 path: str | None = None, name: str | None = None) -> None:
        """What :meth:`decode` checks (the size, a finite scale, no code 3), without making the
        trits: a pass over the bytes, 64 MB at a time (3.3 s for 2B-4T's decode, 0.3 s this
        way); where a code 3 is found, :meth:`decode` says where."""
        n = rows * cols
        if n % self.block or raw.size != n // 4 + I2_S_TAIL_BYTES:
            self.decode(raw, rows, cols, scale=scale, path=path, name=name)  # the shape error
            return
        s = float(raw[n // 4: n // 4 + 4].view("<f4")[0])
        if not np.isfinite(s):
            raise InvalidScaleError(f"i2_s scale is {s}", path=path, tensor=name)
        step = 1 << 26
        for a in range(0, n // 4, step):
            b = raw[a: min(n // 4, a + step)]
            if np.any(b & (b >> 1) & 0x55):  # a 2-bit field of 0b11
                self.decode(raw, rows, cols, scale=scale, path=path, name=name)

    def decode(self, raw: np.ndarray, rows: int, cols: int, *, scale: float | None = None,
               path: str | None = None, name: str | None = None) -> TernaryTensor:
        n = rows * cols
        if n % self.block:
            raise ShapeError(f"{n} values do not fill {self.variant} i2_s blocks of "
                             f"{self.block}", path=path, tensor=name)
        if raw.size != n // 4 + I2_S_TAIL_BYTES:
            raise ShapeError(f"a {rows}x{cols} i2_s tensor takes {n // 4 + I2_S_TAIL_BYTES} "
                             f"bytes, got {raw.size}", path=path, tensor=name)
        packed = raw[: n // 4]
        s = float(raw[n // 4: n // 4 + 4].view("<f4")[0])
        if not np.isfinite(s):
            raise InvalidScaleError(f"i2_s scale is {s}", path=path, tensor=name)
        codes = unpack_codes(packed, self.block)
        check_codes(codes, path=path, tensor=name)
        trits = (codes.view(np.int8) - 1).reshape(rows, cols)
        return TernaryTensor(trits, np.float32([s]), 0, name or "")
