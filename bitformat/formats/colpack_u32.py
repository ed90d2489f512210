"""``colpack_u32``: the weight layout of the bitnet-webgpu-poc WGSL mat-vec kernel.

Byte spec (see docs/formats/colpack_u32.md)::

    Stored as a GGML I32 tensor of shape [rows, W], W = ceil(cols / 16), each word a
    little-endian u32 (the kernel binds it as array<u32>). For each output row, 16
    consecutive input weights share a word; weight i of group w of row r is in word (r, w)
    at bits 2i..2i+1 with the code

        0 -> 0b00,  +1 -> 0b01,  -1 -> 0b10          (0b11 MUST be rejected)

        u32 word:  [ w15 | w14 | ... | w1 | w0 ]      (w0 in bits 1..0)
                    31 30 29 28       3 2  1 0

    A row whose length is not a multiple of 16 MUST be padded with code 0b00; readers MUST
    reject any other padding. The per-tensor scale travels as float32 metadata
    ``bitformat.tensor.<name>.scale``.

The PoC calls this "column-packed" because it packs along the input (column) axis of each
row, unlike the Hugging Face checkpoint, which packs along the output axis.
"""

from __future__ import annotations

import numpy as np

from .stfma import WordRowFormat


class ColpackU32(WordRowFormat):
    format_id = "colpack_u32"
    pad_code = 0  # trit 0
    description = ("bitnet-webgpu-poc kernel layout: 16 weights per u32 (0:00, +1:01, -1:10), "
                   "per-tensor f32 scale in metadata")

    def to_codes(self, trits: np.ndarray) -> np.ndarray:
        # As bytes the trits are 0x00, 0x01, 0xFF; (u & 3) ^ (u >> 7) maps them to 0, 1, 2.
        u = trits.view(np.uint8)
        c = u & np.uint8(3)
        c ^= u >> 7
        return c

    def to_trits(self, codes: np.ndarray) -> np.ndarray:
        # 0 -> 0, 1 -> 1, 2 -> -1: code | -(code >> 1) as int8.
        neg = (codes >> 1).view(np.int8)
        np.negative(neg, out=neg)
        t = codes.view(np.int8)
        t |= neg
        return t
