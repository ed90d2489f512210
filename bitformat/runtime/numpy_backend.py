"""The reference backend: plain numpy, float32 or float64, slow and obviously right.

Each BitLinear call decodes the matrix's container bytes a block of rows at a time with the
format's own reader (so every call also validates them) and multiplies the int8 activations
by the trits in floating point. The products are small integers and their sums stay below
2**24 for any row shorter than 131072 values, so even float32 sums are exact: the only
rounding is in the scales, applied as ``float(dot) / s * scale``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..modelfile import Model
from ..ternary import TernaryTensor
from .backend import Backend, QuantizedActivations, TernarySource, ternary_source

ROW_BLOCK_VALUES = 1 << 20  # trits decoded at a time


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
                out[:, r0: r0 + t.rows] = dot / s * dt(t.scales[0])
            else:
                nb = t.cols // t.scale_block
                qb = q.reshape(-1, nb, t.scale_block)  # [T, nb, block]
                tb = trits.reshape(t.rows, nb, t.scale_block)  # [rows, nb, block]
                dot = np.einsum("tbk,rbk->trb", qb, tb)  # [T, rows, nb], exact integers
                out[:, r0: r0 + t.rows] = (dot * t.scales.astype(dt)).sum(axis=2) / s
        return out

    def lm_head(self, h: np.ndarray) -> np.ndarray:
        """``[T, dim] -> [T, vocab]`` against the head (``output.weight`` or the tied
        ``token_embd``), converted 4096 rows at a time."""
        out = np.empty((h.shape[0], self.vocab), dtype=self.dtype)
        step = 4096
        for v0 in range(0, self.vocab, step):
            ids = np.arange(v0, min(self.vocab, v0 + step))
            out[:, v0: v0 + len(ids)] = h @ self.head_rows(ids).T
        return out
