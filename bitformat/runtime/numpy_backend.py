"""The reference backend: plain numpy, float32 or float64, slow and obviously right.

Each BitLinear call decodes the matrix's container bytes a block of rows at a time with the
format's own reader (so every call also validates them) and multiplies the int8 activations
by the trits in floating point. The products are small integers and their sums stay below
2**24 for any row shorter than 131072 values, so even float32 sums are exact. The scales are
applied as every backend applies them (:mod:`.backend`, "One arithmetic for every
container"): ``(dot * scale) / s``, the block-scaled sum made exactly in float64 first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..constants import GGMLType
from ..io.model import Model
from ..ternary import TernaryTensor
from . import head as EH
from .backend import Backend, QuantizedActivations, TernarySource, ternary_source

ROW_BLOCK_VALUES = 1 << 20  # trits decoded at a time
HEAD_BLOCK = 4096  # embedding rows converted at a time by the LM head


@dataclass
class NumpyWeight:
    source: TernarySource | None  # None: encodings without a row reader (hf folders)
    dense: TernaryTensor | None  # their trits, decoded once at load
    rows: int
    cols: int


class NumpyBackend(Backend):
    name = "numpy"

    def __init__(self, model: Model, *, dtype: type = np.float32, i2s_variant: str = "x86"):
        super().__init__(model, dtype=dtype, i2s_variant=i2s_variant)
        self._screen: EH.ScreenTables | None = None

    def weight(self, name: str) -> NumpyWeight:
        src = ternary_source(self.model, name, self.i2s_variant)
        if src is None:
            t = self.model.ternary(name)
            return NumpyWeight(None, t, t.rows, t.cols)
        return NumpyWeight(src, None, src.rows, src.cols)

    def _blocks(self, w: NumpyWeight):
        if w.source is None:
            yield 0, w.dense
            return
        if w.source.row_bytes is None:
            yield 0, w.source.decode_rows(0, w.rows)
            return
        step = max(1, ROW_BLOCK_VALUES // w.cols)
        for r0 in range(0, w.rows, step):
            yield r0, w.source.decode_rows(r0, min(w.rows, r0 + step))

    def bitlinear(self, qa: QuantizedActivations, w: NumpyWeight) -> np.ndarray:
        dt = self.dtype
        q = qa.q.astype(dt)  # [T, cols]
        s = qa.s.astype(dt)[:, None]  # [T, 1]
        out = np.empty((q.shape[0], w.rows), dtype=dt)
        for r0, t in self._blocks(w):
            trits = t.trits.astype(dt)  # [rows_in_block, cols]
            if t.scale_block == 0:
                dot = q @ trits.T  # [T, rows_in_block], exact integers
                out[:, r0: r0 + t.rows] = dot * dt(t.scales[0]) / s
            else:
                nb = t.cols // t.scale_block
                qb = q.reshape(-1, nb, t.scale_block)  # [T, nb, block]
                tb = trits.reshape(t.rows, nb, t.scale_block)  # [rows, nb, block]
                dot = np.einsum("tbk,rbk->trb", qb, tb)  # [T, rows, nb], exact integers
                acc = (dot.astype(np.float64) * t.scales.astype(np.float64)).sum(axis=2)
                out[:, r0: r0 + t.rows] = acc.astype(dt) / s  # the sum is exact: any order
        return out

    def lm_head(self, h: np.ndarray) -> np.ndarray:
        """``[T, dim] -> [T, vocab]`` against the head (``output.weight`` or the tied
        ``token_embd``), converted 4096 rows at a time."""
        if self.head_type == GGMLType.Q2_0:  # llama.cpp's Q2_0 x Q8_0 sums
            return self.q2_0_head(h).astype(self.dtype)
        out = np.empty((h.shape[0], self.vocab), dtype=self.dtype)
        for v0 in range(0, self.vocab, HEAD_BLOCK):
            out[:, v0: v0 + HEAD_BLOCK] = self._head_block(h, v0)
        return out

    def _head_block(self, h: np.ndarray, v0: int) -> np.ndarray:
        return h @ self.head_weights(np.arange(v0, min(self.vocab, v0 + HEAD_BLOCK))).T

    # -- the screened head's reference (runtime/head.py) -------------------------------------------
    head_itemsize = 2  # what the bytes count: an f16 head

    def screen_tables(self) -> EH.ScreenTables:
        if self._screen is None:
            E = self.head_weights(np.arange(self.vocab)).astype(np.float64)
            unit = 2.0 ** -24 if self.dtype == np.float32 else 2.0 ** -53
            # BLAS sums in an order of its own: any tree of dim products
            sample = E[EH.sample_rows(self.vocab)]  # (as the cpu backend's)
            cols = EH.column_scales(EH.column_maxima(sample), sample[::4])
            self._screen = EH.ScreenTables.build(*EH.quantize_head(E, cols=cols), self.dim,
                                                 self.dim + 2, unit, cols=cols)
        return self._screen

    def head_bounds(self, t, xq, par):
        return EH.bounds_numpy(t, xq, par)

    def head_rows(self, h: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Logits of rows ``ids``: the blocks of :meth:`lm_head` that hold them, computed as it
        computes them (BLAS may sum a block of other rows in another order)."""
        out = np.empty((h.shape[0], len(ids)), dtype=self.dtype)
        for v0 in np.unique(ids // HEAD_BLOCK) * HEAD_BLOCK:
            sel = (ids >= v0) & (ids < v0 + HEAD_BLOCK)
            out[:, sel] = self._head_block(h, int(v0))[:, ids[sel] - v0]
        return out

    def head_rows_bytes(self, ids: np.ndarray) -> int:
        blocks = np.unique(ids // HEAD_BLOCK)
        rows = sum(min(HEAD_BLOCK, self.vocab - int(b) * HEAD_BLOCK) for b in blocks)
        return rows * self.dim * self.head_itemsize
