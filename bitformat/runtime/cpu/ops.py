"""numba versions of the model's small per-token steps for the ``cpu`` backend.

A decode step of 2B-4T spends about 35 ms streaming weights and, done in numpy, another 11 ms
in about forty small array operations per layer (each a few microseconds of dispatch and a
temporary array): RMSNorm, int8 quantization, ReLU² gating, RoPE and attention over the KV
cache. Here each group is one compiled call on the calling thread. The arithmetic is the
numpy reference's (:func:`.backend.rms_norm`, :func:`.backend.quantize_activations`,
:func:`.backend.attention`) in float32 in the same order, so RMSNorm and quantization give the
same bits. Attention sums its dot products in SIMD lanes, as numpy's BLAS does in another
order: its output differs in the last bits, which can move an activation that sits on an int8
``.5`` boundary by one step (tests/test_cpu_ops.py).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange


@njit(cache=True)
def _quantize_row(y, q, t):
    """Row t of ``q`` from float32 ``y``: ``s = 127 / max(max|y|, 1e-5)``, round half even."""
    amax = np.float32(0.0)
    for j in range(y.shape[0]):
        a = abs(y[j])
        if a > amax:
            amax = a
    s = np.float32(127.0) / max(amax, np.float32(1e-5))
    for j in range(y.shape[0]):
        v = np.rint(y[j] * s)
        q[t, j] = np.int8(min(max(v, np.float32(-128.0)), np.float32(127.0)))
    return s


@njit(cache=True)
def _norm_row(x, gain, eps, y):
    """``y = x / sqrt(mean(x^2) + eps) * gain`` in float32, the float32 squares summed in
    float64 as :func:`.backend.rms_norm` does."""
    ss = 0.0
    for j in range(x.shape[0]):
        ss += np.float64(x[j] * x[j])
    r = np.float32(math.sqrt(np.float32(ss / x.shape[0]) + eps))
    for j in range(x.shape[0]):
        y[j] = x[j] / r * gain[j]


@njit(cache=True)
def norm_quant(x, gain, eps, q, s):
    """RMSNorm then per-token int8: ``x`` float32 [T, n] -> ``q`` int8 [T, n], ``s`` [T]."""
    y = np.empty(x.shape[1], np.float32)
    for t in range(x.shape[0]):
        _norm_row(x[t], gain, np.float32(eps), y)
        s[t] = _quantize_row(y, q, t)


@njit(cache=True)
def glu_norm_quant(gate, up, gain, eps, q, s):
    """``relu(gate)^2 * up``, then RMSNorm and int8 as :func:`norm_quant` (FFN sub-norm)."""
    g = np.empty(gate.shape[1], np.float32)
    y = np.empty(gate.shape[1], np.float32)
    for t in range(gate.shape[0]):
        for j in range(g.shape[0]):
            a = max(gate[t, j], np.float32(0.0))
            g[j] = a * a * up[t, j]
        _norm_row(g, gain, np.float32(eps), y)
        s[t] = _quantize_row(y, q, t)


@njit(cache=True, parallel=True, nogil=True)
def norm_quant_rows(x, gain, eps, q, s):
    """:func:`norm_quant` with the rows split among threads (a batched step: same bits)."""
    for t in prange(x.shape[0]):
        y = np.empty(x.shape[1], np.float32)
        _norm_row(x[t], gain, np.float32(eps), y)
        s[t] = _quantize_row(y, q, t)


@njit(cache=True, parallel=True, nogil=True)
def glu_norm_quant_rows(gate, up, gain, eps, q, s):
    """:func:`glu_norm_quant` with the rows split among threads (same bits)."""
    for t in prange(gate.shape[0]):
        g = np.empty(gate.shape[1], np.float32)
        y = np.empty(gate.shape[1], np.float32)
        for j in range(g.shape[0]):
            a = max(gate[t, j], np.float32(0.0))
            g[j] = a * a * up[t, j]
        _norm_row(g, gain, np.float32(eps), y)
        s[t] = _quantize_row(y, q, t)


_FAST = {"reassoc", "contract"}  # lets LLVM sum the dot products in SIMD lanes


@njit(cache=True)
def _rope(x, cos, sin, out):
    """Rotate-half RoPE of one head ``x`` [d] into ``out``: element i pairs with i + d/2."""
    half = x.shape[0] // 2
    for i in range(half):
        a, b = x[i], x[half + i]
        out[i] = a * cos[i] - b * sin[i]
        out[half + i] = b * cos[i] + a * sin[i]


@njit(cache=True, fastmath=_FAST)
def _scores(qr, kc, j, n, scale, p):
    """``p[t] = (qr . kc[t, j]) * scale`` for t < n; returns their maximum."""
    top = -np.inf
    for t in range(n):
        dot = np.float32(0.0)
        for i in range(qr.shape[0]):
            dot += qr[i] * kc[t, j, i]
        p[t] = dot * scale
        top = max(top, p[t])
    return top


@njit(cache=True, fastmath=_FAST)
def _mix(p, vc, j, n, out):
    """``out = sum_t p[t] * vc[t, j]`` over t < n."""
    out[:] = 0.0
    for t in range(n):
        w = p[t]
        for i in range(out.shape[0]):
            out[i] += w * vc[t, j, i]


@njit(cache=True)
def _head(qh, cos, sin, kc, vc, j, n, scale, out):
    """Head ``qh`` [d] of a token at position n - 1 against kv head j of positions 0..n-1 of
    ``kc``/``vc`` [len, KV, d]: RoPE, scaled scores, softmax, weighted sum into ``out`` [d]."""
    d = qh.shape[0]
    qr = np.empty(d, np.float32)
    p = np.empty(n, np.float32)
    _rope(qh, cos, sin, qr)
    top = _scores(qr, kc, j, n, scale, p)
    total = np.float32(0.0)
    for t in range(n):
        p[t] = np.exp(p[t] - top)
        total += p[t]
    for t in range(n):
        p[t] = p[t] / total
    _mix(p, vc, j, n, out)


@njit(cache=True)
def attend_one(q, k, v, cos, sin, kc, vc, pos, out):
    """One token at position ``pos``: RoPE on q [H, d] and k [KV, d], k and v [KV, d] stored
    at ``kc/vc[pos]``, then causal GQA attention over positions 0..pos into ``out`` [H * d].

    RoPE pairs element i with i + d/2 (rotate-half); ``cos``/``sin`` are float32 [d/2].
    """
    H, d = q.shape
    KV = k.shape[0]
    for j in range(KV):
        _rope(k[j], cos, sin, kc[pos, j])
        vc[pos, j, :] = v[j]
    scale = np.float32(1.0 / math.sqrt(d))
    group = H // KV
    for h in range(H):
        _head(q[h], cos, sin, kc, vc, h // group, pos + 1, scale, out[h * d: (h + 1) * d])
