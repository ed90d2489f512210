"""lut3: the cpu backend's layout for tq1_0 and iq1_bn matrices on AVX-512 VBMI CPUs.

A table lookup gives the dot product of three trits with three activations at once, as in
bitnet.cpp's TL2 kernels and T-MAC (Wei et al., 2024, arXiv:2407.00088): each group of three
columns gets, per token, a table of the 14 values ``t0 x0 + t1 x1 + t2 x2`` whose first nonzero
trit is +1 (:data:`.kernels.LUT_COEFFICIENTS`), and each row holds for each group a 4-bit index
into it and a sign: 5 bits for three trits, 1.67 bits a weight, against i2_s's 2. tq1_0 (1.69
bits) and iq1_bn (1.625) hold their trits in base-3 digits, which cost 2.5x i2_s's vector
instructions to take apart (docs/benchmarks.md, "Base-3 digits against 2-bit codes"); this
layout takes no digits apart and reads fewer bytes than i2_s's. The cpu backend repacks their
matrices into it at load on VBMI CPUs without AMX (:data:`.backend.LUT3_ROWS`;
``BITFORMAT_CPU_LUT3`` overrides it).

Layout (built by :func:`pack`): rows in tiles of 64 (:data:`.kernels.LUT_TILE_ROWS`), four
sub-tiles of 16; columns in blocks of 24 (padded with zero trits), each two quads of four
groups of three. Tile p is ``blocks * 320 + 256`` bytes; block b's 320 bytes from ``320 b``
hold, for each sub-tile k:

- 64 index bytes at ``64 k`` (a whole cache line: the kernel's loads never straddle two):
  byte ``4 r + j`` (row ``16 k + r`` of the tile, group j of a quad) holds the index of quad
  0's group j in its low nibble and quad 1's in its high nibble;
- two 64-bit little-endian masks (quad 0, quad 1) at ``256 + 16 k``: bit ``4 r + j`` set
  where that group's value is the negative of its table entry;

then 64 int32 at ``320 * blocks``: each row's sum of its groups' signs (+1 or -1), which takes
back :data:`.kernels.LUT_OFFSET`. A token's tables are 128 bytes a quad
(:func:`.kernels.lut3_tables`): the entries' low bytes, then their high bytes, 16 per group.
The kernel (:func:`.kernels._lut3_tile`) reads a row's 16-byte group of four indices as one
vpdpbusd lane, so one vpermb and one vpdpbusd take 64 lookups of 16 rows.

The dot products are exact integers, and a row's output is ``float32(dot) * scale / s`` as in
the 2-bit kernels, so the logits keep their bits (docs/model.md, "One arithmetic").
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .kernels import (
    LUT_BLOCK_BYTES,
    LUT_BLOCK_COLS,
    LUT_MASKS_AT,
    LUT_QUAD_BYTES,
    LUT_TILE_ROWS,
)


@njit(cache=True)
def blocks(cols: int) -> int:
    """Blocks of :data:`.kernels.LUT_BLOCK_COLS` columns of a row of ``cols`` weights."""
    return (cols + LUT_BLOCK_COLS - 1) // LUT_BLOCK_COLS


def tile_bytes(cols: int) -> int:
    """Bytes of one 64-row tile of a matrix of ``cols`` columns."""
    return blocks(cols) * LUT_BLOCK_BYTES + 4 * LUT_TILE_ROWS


def shape(rows: int, cols: int) -> tuple[int, int]:
    """(tiles, bytes a tile) of a ``rows`` x ``cols`` matrix."""
    return -(-rows // LUT_TILE_ROWS), tile_bytes(cols)


def nbytes(rows: int, cols: int) -> int:
    tiles, tb = shape(rows, cols)
    return tiles * tb


@njit(cache=True)
def table_bytes(cols: int) -> int:
    """Bytes of one token's tables for a matrix of ``cols`` columns (also called inside the
    one-call decode steps)."""
    return 2 * blocks(cols) * LUT_QUAD_BYTES


def pack(trits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """int8 trits [rows, cols] -> uint8 [tiles, tile bytes] (module docstring); rows past
    ``rows`` in the last tile are zero trits. ``out`` (that shape) is written if given."""
    rows, cols = trits.shape
    if out is None:
        out = np.empty(shape(rows, cols), np.uint8)
    if out.shape != shape(rows, cols) or out.dtype != np.uint8:
        raise ValueError(f"lut3 tiles of a {rows} x {cols} matrix are {shape(rows, cols)} bytes, "
                         f"not {out.shape}")
    _pack(np.ascontiguousarray(trits, dtype=np.int8), out)
    return out


@njit(parallel=True, cache=True)
def _pack(trits, out):
    rows, cols = trits.shape
    nb = (out.shape[1] - 4 * LUT_TILE_ROWS) // LUT_BLOCK_BYTES
    for p in prange(out.shape[0]):
        tile = out[p]
        tile[:] = 0
        sums = tile[nb * LUT_BLOCK_BYTES:].view(np.int32)
        for i in range(LUT_TILE_ROWS):
            row = p * LUT_TILE_ROWS + i
            k, r = i // 16, i % 16
            total = 0
            for g in range(nb * 8):
                n = 13
                if row < rows:
                    c = 3 * g
                    n = 0
                    for m in range(3):
                        n = 3 * n + (trits[row, c + m] + 1 if c + m < cols else 1)
                neg = n < 13
                idx = 13 - n if neg else n - 13
                b, quad, j = g // 8, (g // 4) % 2, g % 4
                at = b * LUT_BLOCK_BYTES
                tile[at + 64 * k + 4 * r + j] |= np.uint8(idx << (4 * quad))
                if neg:
                    bit = 4 * r + j
                    tile[at + LUT_MASKS_AT + 16 * k + 8 * quad + bit // 8] |= np.uint8(
                        1 << (bit % 8))
                    total -= 1
                else:
                    total += 1
            sums[i] = total
