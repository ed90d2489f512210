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
from numba import carray, njit, prange, types
from numba.extending import intrinsic


@njit(cache=True, error_model="numpy")
def _absmax(y):
    """max |y| (NaN skipped, as ``a > m`` is false for it), in eight interleaved maxima: the
    same value as one loop (a maximum does not depend on the order), 8x fewer dependent
    compare-and-selects (2560 values: 2.7 us as one chain)."""
    n = y.shape[0]
    m8 = n // 8 * 8
    m = np.zeros(8, np.float32)
    for j in range(0, m8, 8):
        for i in range(8):
            a = abs(y[j + i])
            if a > m[i]:
                m[i] = a
    top = np.float32(0.0)
    for j in range(m8, n):
        a = abs(y[j])
        if a > top:
            top = a
    for i in range(8):
        if m[i] > top:
            top = m[i]
    return top


@njit(cache=True, error_model="numpy")
def _quantize_row(y, q, t):
    """Row t of ``q`` from float32 ``y``: ``s = 127 / max(max|y|, 1e-5)``, round half even."""
    s = np.float32(127.0) / max(_absmax(y), np.float32(1e-5))
    for j in range(y.shape[0]):
        v = np.rint(y[j] * s)
        q[t, j] = np.int8(min(max(v, np.float32(-128.0)), np.float32(127.0)))
    return s


@njit(cache=True, error_model="numpy")
def _norm_row(x, gain, eps, y):
    """``y = x / sqrt(mean(x^2) + eps) * gain`` in float32, the float32 squares summed in
    float64 as :func:`.backend.rms_norm` does (in eight interleaved sums, not one chain of
    dependent additions: 2560 values took 11 us, one chain's latency)."""
    n = x.shape[0]
    m = n // 8 * 8
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
    for j in range(0, m, 8):
        s0 += np.float64(x[j] * x[j])
        s1 += np.float64(x[j + 1] * x[j + 1])
        s2 += np.float64(x[j + 2] * x[j + 2])
        s3 += np.float64(x[j + 3] * x[j + 3])
        s4 += np.float64(x[j + 4] * x[j + 4])
        s5 += np.float64(x[j + 5] * x[j + 5])
        s6 += np.float64(x[j + 6] * x[j + 6])
        s7 += np.float64(x[j + 7] * x[j + 7])
    for j in range(m, n):
        s0 += np.float64(x[j] * x[j])
    ss = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
    r = np.float32(math.sqrt(np.float32(ss / n) + eps))
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


@njit(cache=True, error_model="numpy")
def _rope(x, cos, sin, out):
    """Rotate-half RoPE of one head ``x`` [d] into ``out``: element i pairs with i + d/2."""
    half = x.shape[0] // 2
    for i in range(half):
        a, b = x[i], x[half + i]
        out[i] = a * cos[i] - b * sin[i]
        out[half + i] = b * cos[i] + a * sin[i]


@njit(cache=True, fastmath=_FAST, error_model="numpy")
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


@njit(cache=True, error_model="numpy")
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


@intrinsic
def _f32_at(typingctx, addr):
    """The float32 pointer at address ``addr`` (an int64 from ``ndarray.ctypes.data``)."""
    sig = types.CPointer(types.float32)(types.int64)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen


@njit(cache=True, parallel=True, nogil=True)
def attend_rows(q, k, v, cos, sin, kaddr, vaddr, lens, pos, layer, out):
    """:func:`attend_one` for T tokens of a decode step, each on its own KV cache, in one call
    (the heads of all tokens split among threads; each head as in :func:`attend_one`).

    Token t: q[t] [H, d], k[t]/v[t] [KV, d] at position ``pos[t]``, ``cos[t]``/``sin[t]``; its
    cache is a float32 array [layers, lens[t], KV, d] at address ``kaddr[t]`` (k) and
    ``vaddr[t]`` (v), of which ``layer`` is used; ``out`` [T, H * d]. The caller keeps the
    caches alive and C-contiguous.
    """
    T, H, d = q.shape
    KV = k.shape[1]
    for t in range(T):
        per = lens[t] * KV * d
        kc = carray(_f32_at(kaddr[t] + 4 * layer * per), (lens[t], KV, d))
        vc = carray(_f32_at(vaddr[t] + 4 * layer * per), (lens[t], KV, d))
        for j in range(KV):
            _rope(k[t, j], cos[t], sin[t], kc[pos[t], j])
            vc[pos[t], j, :] = v[t, j]
    scale = np.float32(1.0 / math.sqrt(d))
    group = H // KV
    for i in prange(T * H):
        t, h = i // H, i % H
        per = lens[t] * KV * d
        kc = carray(_f32_at(kaddr[t] + 4 * layer * per), (lens[t], KV, d))
        vc = carray(_f32_at(vaddr[t] + 4 * layer * per), (lens[t], KV, d))
        _head(q[t, h], cos[t], sin[t], kc, vc, h // group, pos[t] + 1, scale,
              out[t, h * d: (h + 1) * d])
