"""A whole decode step of one token in one compiled call (the ``cpu`` backend's fast path).

Run layer by layer from Python, a 2B-4T step makes about 400 calls (four mat-vecs, four norms,
attention, activation layouts, reshapes and residual adds per layer). Between two mat-vecs the
second numba thread has gone to sleep and is woken again, and Python's own work adds up: on an
Intel Xeon (2 cores) the 120 mat-vecs of a step took 18.5 ms in a loop by themselves but about
20 ms inside the model, whose whole step (without the LM head) took 26 ms. :func:`decode_row`
runs every layer in one call: each mat-vec and the attention heads are parallel loops, the
small steps between them run on the calling thread.

The arithmetic is the layer-by-layer path's, step for step, so the bits are the same:
:func:`.ops.norm_quant` and :func:`.ops.glu_norm_quant` for the norms and int8 activations,
:func:`.kernels.slot_activations`'s layout, :func:`.kernels.mm2_vnni`'s sums and epilogue, and
:func:`.ops.attend_one`'s attention per head (``tests/test_cpu_ops.py`` compares them).

It covers the common case only (:meth:`.backend.CpuBackend.decode_plan`): the vnni kernels,
2-bit matrices (i2_s, stfma) with q/k/v and gate/up stacked in the arena, a family with
sub-norms and ReLU² (BitNet), no q/k norms, no interleaved q/k rows, no per-projection scales.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from .kernels import KIND_COLPACK, _dot2_vnni
from .ops import _head, _norm_row, _quantize_row, _rope

#: columns of :data:`Plan.mats`: each matrix's offset in the arena, rows, bytes per row, offset
#: of its row scales in ``ws``, kernel kind
OFF, ROWS, BPR, WS, KIND = range(5)
#: the four matrices of a layer, in the order a step reads them
QKV, OUT, GATE_UP, DOWN = range(4)


@njit(cache=True)
def _slots(q, lane, cols, xg):
    """``xg[0, g, m]`` = the activation that multiplies slot g of row byte m: element
    ``(m // lane) * 4 * lane + lane * g + m % lane`` of ``q[0]`` (0 past ``cols``); lane 32:
    i2_s x86, 16: arm64, 1: stfma (:func:`.kernels.slot_activations`)."""
    bpr = xg.shape[2]
    for g in range(4):
        for m in range(bpr):
            e = (m // lane) * 4 * lane + lane * g + m % lane
            xg[0, g, m] = q[0, e] if e < cols else 0


@njit(cache=True)
def _sum(q):
    acc = np.int32(0)
    for j in range(q.shape[1]):
        acc += np.int32(q[0, j])
    return acc


@njit(cache=True)
def _weight(buf, mats, layer, which):
    off, rows, bpr = mats[layer, which, OFF], mats[layer, which, ROWS], mats[layer, which, BPR]
    return buf[off: off + rows * bpr].reshape((rows, bpr))


@njit(cache=True, parallel=True, nogil=True)
def decode_row(buf, mats, ws, gains, eps, lane, heads, kc, vc, pos, cos, sin, hrow):
    """One token through every layer: ``hrow`` float32 [1, dim] (its embedding) becomes the hidden
    state after the last layer, in place; its k and v go to ``kc``/``vc`` [layers, len, KV, d]
    at ``pos``.

    ``mats`` int64 [layers, 4, 5]: per layer the stacked q/k/v, o, stacked gate/up and down
    matrices as rows of ``buf`` (the arena: offset, rows, bytes per row), the offset of their
    row scales in ``ws`` and their kernel kind. ``gains`` float32 [layers, 4, width]: attention
    norm, attention sub-norm, FFN norm (first dim values) and FFN sub-norm (hidden values).
    """
    h = hrow[0]
    dim = h.shape[0]
    KV, d = kc.shape[2], kc.shape[3]
    H = heads
    group = H // KV
    hidden = mats[0, GATE_UP, ROWS] // 2
    n = pos + 1
    scale = np.float32(1.0 / math.sqrt(d))
    f32eps = np.float32(eps)
    x = np.empty(max(dim, hidden), np.float32)
    q8 = np.empty((1, max(dim, hidden)), np.int8)
    o = np.empty(dim, np.float32)
    for layer in range(mats.shape[0]):
        # attention: q, k, v of the normed input
        _norm_row(h, gains[layer, 0, :dim], f32eps, x[:dim])
        s = _quantize_row(x[:dim], q8, 0)
        y = _matvec(buf, mats, layer, QKV, q8[:, :dim], s, ws, lane)
        kl, vl = kc[layer], vc[layer]
        for j in range(KV):
            _rope(y[(H + j) * d: (H + j + 1) * d], cos, sin, kl[pos, j])
            vl[pos, j, :] = y[(H + KV + j) * d: (H + KV + j + 1) * d]
        for hh in prange(H):
            _head(y[hh * d: (hh + 1) * d], cos, sin, kl, vl, hh // group, n, scale,
                  o[hh * d: (hh + 1) * d])
        _norm_row(o, gains[layer, 1, :dim], f32eps, x[:dim])
        s = _quantize_row(x[:dim], q8, 0)
        y = _matvec(buf, mats, layer, OUT, q8[:, :dim], s, ws, lane)
        for j in range(dim):
            h[j] = h[j] + y[j]
        # FFN
        _norm_row(h, gains[layer, 2, :dim], f32eps, x[:dim])
        s = _quantize_row(x[:dim], q8, 0)
        gu = _matvec(buf, mats, layer, GATE_UP, q8[:, :dim], s, ws, lane)
        for j in range(hidden):
            a = max(gu[j], np.float32(0.0))
            gu[j] = a * a * gu[hidden + j]
        _norm_row(gu[:hidden], gains[layer, 3, :hidden], f32eps, x[:hidden])
        s = _quantize_row(x[:hidden], q8, 0)
        y = _matvec(buf, mats, layer, DOWN, q8[:, :hidden], s, ws, lane)
        for j in range(dim):
            h[j] = h[j] + y[j]


@njit(cache=True, parallel=True, nogil=True)
def _matvec(buf, mats, layer, which, q, s, ws, lane):
    """``out[r] = float32(dot_r - sum q) / s * ws[r]`` (:func:`.kernels.mm2_vnni`, one token)."""
    W = _weight(buf, mats, layer, which)
    rows, bpr = W.shape
    xg = np.empty((1, 4, bpr), np.int8)
    _slots(q, lane, q.shape[1], xg)
    corr = _sum(q)
    kind = mats[layer, which, KIND]
    w0 = mats[layer, which, WS]
    out = np.empty(rows, np.float32)
    for r in prange(rows):
        d = _dot2_vnni(W[r], xg, 0, kind)
        out[r] = np.float32(d - corr) / s * ws[w0 + r]
    return out


#: slot layout -> lane of :func:`_slots`
LANES = {"x86": 32, "arm64": 16, "plain": 1}


@dataclass
class Plan:
    """A network's weights as :func:`decode_row` reads them."""

    mats: np.ndarray  # int64 [layers, 4, 5]
    ws: np.ndarray  # float32: every matrix's row scales
    gains: np.ndarray  # float32 [layers, 4, max(dim, hidden)]
    eps: float
    lane: int
    heads: int
    nbytes: int  # the matrices' bytes (the thread picker's size)

    @classmethod
    def of(cls, net, be) -> Plan | None:
        """The plan for ``net`` (:class:`..models.base.Transformer`) on cpu backend ``be``, or
        None where :func:`decode_row` does not compute what ``net.forward_hidden`` does."""
        a = net.args
        fam = a.family
        if (fam.activation != "relu2" or not fam.sub_norms or net.hf_order is not None
                or be._arena.buf is None):
            return None
        buf = be._arena.buf
        mats = np.zeros((a.n_layers, 4, 5), np.int64)
        scales, at, layouts = [], 0, set()
        gains = np.zeros((a.n_layers, 4, max(a.dim, a.hidden_dim)), np.float32)
        for i, blk in enumerate(net.blocks):
            if blk.q_norm is not None or blk.out_scale or blk.attn_sub_norm is None \
                    or blk.ffn_sub_norm is None:
                return None
            ws = [blk.stacked.get(("attn_q", "attn_k", "attn_v")), blk.proj["attn_output"],
                  blk.stacked.get(("ffn_gate", "ffn_up")), blk.proj["ffn_down"]]
            for j, w in enumerate(ws):
                if (w is None or getattr(w, "layout", "") not in LANES
                        or w.kind == KIND_COLPACK or not np.shares_memory(w.data, buf)
                        or w.data.shape[1] * 4 < w.cols):
                    return None
                layouts.add(w.layout)
                mats[i, j] = (w.data.ctypes.data - buf.ctypes.data, w.rows, w.data.shape[1],
                              at, w.kind)
                scales.append(np.asarray(w.scale, np.float32).reshape(-1))
                at += w.rows
            for j, g in enumerate((blk.attn_norm, blk.attn_sub_norm, blk.ffn_norm,
                                   blk.ffn_sub_norm)):
                gains[i, j, :g.size] = g
        if len(layouts) != 1 or (mats[:, GATE_UP, ROWS] != 2 * a.hidden_dim).any():
            return None
        nbytes = int((mats[..., ROWS] * mats[..., BPR]).sum())
        return cls(mats, np.concatenate(scales), gains, float(a.norm_eps),
                   LANES[layouts.pop()], a.n_heads, nbytes)
