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
from llvmlite import ir
from numba import carray, config, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .. import kvquant
from .kernels import L2, _prefetch, host_features


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


# -- float16 KV caches: held as their uint16 bits (numba has no float16 type) -----------------
@intrinsic
def _h2f(typingctx, bits):
    """The float32 value of the IEEE half ``bits`` (uint16): exact (LLVM's fpext; one
    vcvtph2ps per 8 or 16 lanes where the CPU has F16C)."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


@intrinsic
def _f2h(typingctx, x):
    """The IEEE half bits (uint16) of float32 ``x``, rounded to nearest, ties to even, as
    numpy's ``astype(np.float16)``."""
    sig = types.uint16(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return sig, codegen


# -- cache rows by type (:mod:`..kvquant`): float32; float16 as uint16 bits; q8_0 int8 rows --
QK8_0 = kvquant.QK8_0  # values per q8_0 block


@njit(inline="always", error_model="numpy")
def _q8_scale(row, d, b):
    """Block ``b``'s scale of a q8_0 row of ``d`` values: the half after the codes."""
    lo = np.int32(row[d + 2 * b]) & 0xFF
    hi = np.int32(row[d + 2 * b + 1]) & 0xFF
    return _h2f(np.uint16(lo | (hi << 8)))


def _val(row, i):
    """Element i of a float32 or float16 (uint16 bits) cache row, as float32."""


@overload(_val, inline="always")
def _ol_val(row, i):
    if isinstance(row.dtype, types.Integer):
        return lambda row, i: _h2f(row[i])
    return lambda row, i: row[i]


def _group_dots(qr, h0, hn, row, scale, p, col):
    """``p[h, col] = (qr[h] . values(row)) * scale`` for the query heads ``h0 <= h < hn`` that
    share the cached key ``row`` (any cache type): four heads a pass over the row, so the row
    is read and made float32 once for four dot products (a fifth to eighth head: a second
    pass; with fewer than four the last head's sum is taken more than once, kept once)."""


@overload(_group_dots, inline="always")
def _ol_group_dots(qr, h0, hn, row, scale, p, col):
    q8 = row.dtype == types.int8

    def impl(qr, h0, hn, row, scale, p, col):
        d = qr.shape[1]
        for g in range(h0, hn, 4):
            last = hn - 1
            a, b, c, e = g, min(g + 1, last), min(g + 2, last), min(g + 3, last)
            s0 = s1 = s2 = s3 = np.float32(0.0)
            if q8:  # q8_0: code * fp16(scale), block by block
                for b0 in range(0, d, QK8_0):
                    sc = _q8_scale(row, d, b0 // QK8_0)
                    for i in range(b0, min(d, b0 + QK8_0)):
                        k = np.float32(row[i]) * sc
                        s0 += qr[a, i] * k
                        s1 += qr[b, i] * k
                        s2 += qr[c, i] * k
                        s3 += qr[e, i] * k
            else:
                for i in range(d):
                    k = _val(row, i)
                    s0 += qr[a, i] * k
                    s1 += qr[b, i] * k
                    s2 += qr[c, i] * k
                    s3 += qr[e, i] * k
            p[a, col] = s0 * scale
            if g + 1 <= last:
                p[b, col] = s1 * scale
            if g + 2 <= last:
                p[c, col] = s2 * scale
            if g + 3 <= last:
                p[e, col] = s3 * scale
    return impl


def _row_axpy(w, row, part, h, off):
    """``part[h, off:] += w * values(row)`` (any cache type)."""


@overload(_row_axpy, inline="always")
def _ol_row_axpy(w, row, part, h, off):
    if row.dtype == types.int8:
        def axpy_q8_0(w, row, part, h, off):
            d = part.shape[1] - off
            for b0 in range(0, d, QK8_0):
                sc = _q8_scale(row, d, b0 // QK8_0)
                for i in range(b0, min(d, b0 + QK8_0)):
                    part[h, off + i] += w * (np.float32(row[i]) * sc)
        return axpy_q8_0

    def axpy(w, row, part, h, off):
        for i in range(part.shape[1] - off):
            part[h, off + i] += w * _val(row, i)
    return axpy


@njit(error_model="numpy")
def _q8_put(row, x):
    """float32 ``x`` [d] as a q8_0 row (:mod:`..kvquant`): per block of 32, ``scale = max|x| /
    127``, codes ``roundf(x * (1 / scale))`` (halves away from zero), then the scales' half
    bits, low byte first."""
    d = x.shape[0]
    for b0 in range(0, d, QK8_0):
        b1 = min(d, b0 + QK8_0)
        amax = np.float32(0.0)
        for i in range(b0, b1):
            amax = max(amax, abs(x[i]))
        sc = amax / np.float32(127.0)
        inv = np.float32(0.0)
        if sc != 0:
            inv = np.float32(1.0) / sc
        for i in range(b0, b1):
            y = x[i] * inv
            a = abs(y)
            f = np.floor(a)
            up = np.float32(1.0) if a - f >= np.float32(0.5) else np.float32(0.0)
            r = np.int32(f + up)
            row[i] = np.int8(-r if y < 0 else r)
        bits = np.int32(_f2h(sc))
        lo, hi = bits & 0xFF, bits >> 8
        row[d + 2 * (b0 // QK8_0)] = np.int8(lo - 256 if lo > 127 else lo)
        row[d + 2 * (b0 // QK8_0) + 1] = np.int8(hi - 256 if hi > 127 else hi)


def _row_put(row, x):
    """float32 ``x`` [d] stored as one cache row (float16: nearest even; q8_0: per block of
    32, ``scale = max|x| / 127``, codes ``roundf(x * (1 / scale))``, as ggml's reference)."""


@overload(_row_put, inline="always")
def _ol_row_put(row, x):
    if row.dtype == types.int8:
        return lambda row, x: _q8_put(row, x)
    if isinstance(row.dtype, types.Integer):
        def put_f16(row, x):
            for i in range(x.shape[0]):
                row[i] = _f2h(np.float32(x[i]))
        return put_f16

    def put_f32(row, x):
        for i in range(x.shape[0]):
            row[i] = x[i]
    return put_f32


#: positions an attention partial covers (:func:`_part`): the softmax is taken per run of
#: ``ATTN_CHUNK`` positions and merged (:func:`_merge`), the same way whichever thread computes
#: which run, so every path gives the same bits
ATTN_CHUNK = 64
#: per query head of a partial: its maximum score, the sum of exp(score - max), then d values
PART_M, PART_S, PART_V = 0, 1, 2


#: blocks of consecutive runs a one-token :func:`attend_split` shares among threads, one a
#: thread: each thread hints its next run's rows into L2 while it computes this one
ATTN_BLOCKS = max(1, config.NUMBA_NUM_THREADS)


def attn_chunks(n: int) -> int:
    """Runs of :data:`ATTN_CHUNK` positions that cover ``n`` positions."""
    return -(-n // ATTN_CHUNK)


_F32x8 = ir.VectorType(ir.FloatType(), 8)


def _fma8(builder):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(
        _F32x8, [_F32x8] * 3), "llvm.fma.v8f32")


def _splat8(builder, x):
    """float32 ``x`` in all 8 lanes."""
    i32 = ir.IntType(32)
    undef = ir.Constant(_F32x8, ir.Undefined)
    return builder.shuffle_vector(builder.insert_element(undef, x, ir.Constant(i32, 0)), undef,
                                  ir.Constant(ir.VectorType(i32, 8), [0] * 8))


def _cache_kind(dtype) -> str:
    """A cache array's type as the vector kernels read it (:func:`kernel_cache`)."""
    return {types.uint16: "f16", types.int8: "q8_0"}.get(dtype, "f32")


def _load8(builder, base, row, i, kind, d):
    """Values ``i .. i + 7`` of the cache row at element ``row`` of ``base`` as float32 lanes:
    float32 as stored, float16 widened (exact), q8_0 each code times its block's half scale
    (the row's codes, then its scales: :mod:`..kvquant`; eight values never straddle a block
    of 32)."""
    at = builder.gep(base, [builder.add(row, i)])
    if kind == "q8_0":
        codes = builder.load(builder.bitcast(at, ir.VectorType(ir.IntType(8), 8).as_pointer()),
                             align=1)
        blk = builder.mul(builder.ashr(i, ir.Constant(i.type, 5)), ir.Constant(i.type, 2))
        sat = builder.gep(base, [builder.add(builder.add(row, d), blk)])
        half = builder.bitcast(builder.load(builder.bitcast(sat, ir.IntType(16).as_pointer()),
                                            align=1), ir.HalfType())
        scale = _splat8(builder, builder.fpext(half, ir.FloatType()))
        return builder.fmul(builder.sitofp(codes, _F32x8), scale)
    half = kind == "f16"
    vrow = ir.VectorType(ir.HalfType() if half else ir.FloatType(), 8)
    v = builder.load(builder.bitcast(at, vrow.as_pointer()), align=2 if half else 4)
    return builder.fpext(v, _F32x8) if half else v


#: positions ahead that the attention kernels prefetch the cache rows of (a hint only: past the
#: cache's end it reads nothing). 3,072 f16 positions of 2B-4T, one thread, AMD EPYC: scores
#: and value mix 1.4x and 2.0x faster with it; 4 and 16 positions ahead measured the same.
ATTN_PREFETCH = 8
#: positions ahead whose key rows the scores prefetch into L2 (:func:`_part_scores`), with the
#: value rows of the position being read: a third faster on one thread of an AMD EPYC Zen 4 in
#: quick runs (30 layers of 3,072 f16 positions of 2B-4T, 236 MB); 12 and 48 positions measured
#: the same as 24. tools/bench_attention.py measures the attention kernels as a whole.
ATTN_AHEAD = 24


def _k_off(builder, base, stride, k):
    return builder.add(base, builder.mul(stride, ir.Constant(stride.type, k)))


def _two_rows8(builder, base, row, stride, i, kind, d):
    """Values ``i .. i + 7`` of the cache rows at elements ``row`` and ``row + stride`` (two
    consecutive positions) as float32 lanes (:func:`_load8`); the same values of the rows
    :data:`ATTN_PREFETCH` positions on are prefetched."""
    out = []
    for r in range(2):
        out.append(_load8(builder, base, _k_off(builder, row, stride, r), i, kind, d))
        ahead = _k_off(builder, row, stride, ATTN_PREFETCH + r)
        _prefetch(builder, base, builder.add(ahead, i))
    return out


@intrinsic
def _dots_4x2(typingctx, qr, qo, qs, kc, ko, ks, n8):
    """The eight dot products of four query heads with two cached keys: sum ``k * 2 + r`` is
    ``sum_i qr.flat[qo + k qs + i] * value(kc.flat[ko + r ks + i])`` over i < 8 n8, each in
    8 lanes of fused multiply-adds, the lanes then added in a fixed tree. Eight independent
    sums keep both FMA units busy where four (one key at a time) waited on each other's
    latency. ``kc`` float32, float16 as uint16 bits, or q8_0 int8 rows."""
    kind = _cache_kind(kc.dtype)
    sig = types.UniTuple(types.float32, 8)(qr, types.intp, types.intp, kc, types.intp,
                                           types.intp, types.intp)

    def codegen(context, builder, signature, args):
        q_a, qo, qs, k_a, ko, ks, n8 = args
        qptr = context.make_array(signature.args[0])(context, builder, q_a).data
        kptr = context.make_array(signature.args[3])(context, builder, k_a).data
        fma = _fma8(builder)
        accs = [cgutils.alloca_once_value(builder, ir.Constant(_F32x8, [0.0] * 8))
                for _ in range(8)]
        d = builder.mul(n8, ir.Constant(n8.type, 8))
        with cgutils.for_range(builder, n8) as loop:
            i = builder.mul(loop.index, ir.Constant(n8.type, 8))
            keys = _two_rows8(builder, kptr, ko, ks, i, kind, d)
            for k in range(4):
                qv = _load8(builder, qptr, _k_off(builder, qo, qs, k), i, "f32", d)
                for r in range(2):
                    acc = accs[k * 2 + r]
                    builder.store(builder.call(fma, [qv, keys[r], builder.load(acc)]), acc)
        i32 = ir.IntType(32)
        out = []
        for acc in accs:
            v = builder.load(acc)
            for width in (4, 2, 1):  # halves added: lanes (0..3) + (4..7), then on down
                lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, width),
                                                              list(range(width))))
                hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, width),
                                                              list(range(width, 2 * width))))
                v = builder.fadd(lo, hi)
            out.append(builder.extract_element(v, ir.Constant(i32, 0)))
        return context.make_tuple(builder, signature.return_type, out)

    return sig, codegen


@intrinsic
def _prefetch_span(typingctx, a, off, n):
    """Hint the cache lines of ``a.flat[off : off + n]`` into L2 (a hint only: lines past the
    array's end are not read)."""
    sig = types.void(a, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        a_a, off, n = args
        ptr = context.make_array(signature.args[0])(context, builder, a_a).data
        size = context.get_abi_sizeof(context.get_data_type(signature.args[0].dtype))
        i8p = ir.IntType(8).as_pointer()
        base = builder.bitcast(builder.gep(ptr, [off]), i8p)
        lines = builder.udiv(builder.add(builder.mul(n, ir.Constant(n.type, size)),
                                         ir.Constant(n.type, 63)), ir.Constant(n.type, 64))
        with cgutils.for_range(builder, lines) as loop:
            _prefetch(builder, base, builder.mul(loop.index, ir.Constant(n.type, 64)), L2)
        return context.get_dummy_value()

    return sig, codegen


def _lanes_sum8(builder, vecs):
    """The lane sums of eight 8-lane vectors as one vector (lane j: the sum of ``vecs[j]``),
    each summed in :func:`_dots_4x2`'s tree (lanes (0..3) + (4..7), then (0, 1) + (2, 3),
    then 0 + 1), so the bits are the same; the trees of eight vectors are taken together,
    seven adds where one at a time took 24 adds and 24 shuffles."""
    i32 = ir.IntType(32)

    def pair(a, b, lo, hi):
        return builder.fadd(builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(i32, 8), lo)),
                            builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(i32, 8), hi)))

    x = [pair(vecs[2 * m], vecs[2 * m + 1], [0, 1, 2, 3, 8, 9, 10, 11],
              [4, 5, 6, 7, 12, 13, 14, 15]) for m in range(4)]
    y = [pair(x[2 * m], x[2 * m + 1], [0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15])
         for m in range(2)]
    return pair(y[0], y[1], [0, 2, 4, 6, 8, 10, 12, 14], [1, 3, 5, 7, 9, 11, 13, 15])


#: whether the scores take four positions at a time (:func:`_dots_4x4`: 16 accumulators and
#: four key rows in registers, which AVX-512's 32 vector registers hold and AVX2's 16 do not)
SCORE_QUADS = "avx512f" in host_features()


@intrinsic
def _dots_4x4(typingctx, qr, qo, qs, kc, ko, ks, n8, p, po, ps, scale, pfo, pq):
    """:func:`_dots_4x2` for four cached keys: for k < 4 and r < 4, ``p.flat[po + k ps + r] =
    (sum_i qr.flat[qo + k qs + i] * value(kc.flat[ko + r ks + i])) * scale`` over i < 8 n8,
    each sum in 8 lanes of fused multiply-adds and the lanes added in :func:`_dots_4x2`'s tree
    (:func:`_lanes_sum8`): the same bits. A query vector loaded serves four keys, where two
    left the loads, not the multiply-adds, as the limit."""
    kind = _cache_kind(kc.dtype)
    sig = types.void(qr, types.intp, types.intp, kc, types.intp, types.intp, types.intp, p,
                     types.intp, types.intp, types.float32, types.intp, types.intp)
    line = 64 // ({"f32": 4, "f16": 2}.get(kind, 1))

    def codegen(context, builder, signature, args):
        q_a, qo, qs, k_a, ko, ks, n8, p_a, po, ps, scale, pfo, pq = args
        qptr = context.make_array(signature.args[0])(context, builder, q_a).data
        kptr = context.make_array(signature.args[3])(context, builder, k_a).data
        pptr = context.make_array(signature.args[7])(context, builder, p_a).data
        fma = _fma8(builder)
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(_F32x8, [0.0] * 8))
                 for _ in range(4)] for _ in range(4)]
        d = builder.mul(n8, ir.Constant(n8.type, 8))
        # the next run's key rows into L2: ``pq`` lines a step of the loop below, hinted
        # before it (a prompt's runs hint none, and their loop stays as it was)
        with cgutils.for_range(builder, builder.mul(n8, pq)) as pf:
            _prefetch(builder, kptr, builder.add(pfo, builder.mul(
                pf.index, ir.Constant(pq.type, line))), L2)
        with cgutils.for_range(builder, n8) as loop:
            i = builder.mul(loop.index, ir.Constant(n8.type, 8))
            keys = _two_rows8(builder, kptr, ko, ks, i, kind, d) + _two_rows8(
                builder, kptr, _k_off(builder, ko, ks, 2), ks, i, kind, d)
            for k in range(4):
                qv = _load8(builder, qptr, _k_off(builder, qo, qs, k), i, "f32", d)
                for r in range(4):
                    acc = accs[k][r]
                    builder.store(builder.call(fma, [qv, keys[r], builder.load(acc)]), acc)
        i32 = ir.IntType(32)
        f32x4 = ir.VectorType(ir.FloatType(), 4)
        for g in range(2):  # heads 2g and 2g + 1: four positions each
            z = _lanes_sum8(builder, [builder.load(accs[2 * g + e][r])
                                      for e in range(2) for r in range(4)])
            z = builder.fmul(z, _splat8(builder, scale))
            for e in range(2):
                part = builder.shuffle_vector(z, z, ir.Constant(ir.VectorType(i32, 4),
                                                                list(range(4 * e, 4 * e + 4))))
                at = builder.gep(pptr, [builder.add(po, builder.mul(
                    ps, ir.Constant(ps.type, 2 * g + e)))])
                builder.store(part, builder.bitcast(at, f32x4.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


def _score_pairs(qr, kc, c0, scale, p, j, h0, h1, t, step, pfo, pq):
    """Positions t .. t + step - 1 (step 2, or 4 where :data:`SCORE_QUADS`) of kv head j
    against query heads ``h0 .. h1 - 1`` into ``p`` (:func:`_dots_4x2`, :func:`_dots_4x4`,
    four heads at a time where it applies); returns the first head left."""


@overload(_score_pairs, inline="always")
def _ol_score_pairs(qr, kc, c0, scale, p, j, h0, h1, t, step, pfo, pq):
    if any(a.layout != "C" for a in (qr, kc, p)):  # not known to be contiguous: _group_dots
        return lambda qr, kc, c0, scale, p, j, h0, h1, t, step, pfo, pq: h0

    def impl(qr, kc, c0, scale, p, j, h0, h1, t, step, pfo, pq):
        d = qr.shape[1]
        if d % 8:
            return h0
        KV, W = kc.shape[1], kc.shape[2]
        h = h0
        while h + 4 <= h1:  # offsets into the C-contiguous arrays
            if step == 4:
                _dots_4x4(qr, h * d, d, kc, (t * KV + j) * W, KV * W, d // 8, p,
                          h * p.shape[1] + t - c0, p.shape[1], scale, pfo,
                          pq if h == h0 else 0)
            else:
                s = _dots_4x2(qr, h * d, d, kc, (t * KV + j) * W, KV * W, d // 8)
                for k in range(4):
                    p[h + k, t - c0] = s[2 * k] * scale
                    p[h + k, t + 1 - c0] = s[2 * k + 1] * scale
            h += 4
        return h
    return impl


@njit(cache=True, fastmath=_FAST, error_model="numpy")
def _part_scores(qr, kc, vc, c0, c1, scale, p, warm, nx0, nx1):
    """``p[h, t - c0] = (qr[h] . kc[t, h // G]) * scale`` for c0 <= t < c1, G query heads per
    kv head: the cache is read in its order, four positions (AVX-512) or two at a time for four
    heads in SIMD lanes (:func:`_score_pairs`), what is left one key row at a time for the
    heads that share it (:func:`_group_dots`). Where four positions go at a time, the key
    rows of positions ``nx0 .. nx1 - 1`` (the run this thread takes next) are hinted into L2
    a line or so per step of the sums (the value sums hint its value rows)."""
    H = qr.shape[0]
    KV = kc.shape[1]
    G = H // KV
    W = kc.shape[2]
    per_line = 64 // kc.itemsize
    n8 = max(1, qr.shape[1] // 8)  # steps of the dot products' loop, one hint each
    calls = max(1, ((c1 - c0) // 4) * KV)  # the 4-position calls, each hinting a share
    each = ((nx1 - nx0) * KV * W + per_line - 1) // per_line  # lines of the next run's keys
    each = (each + calls - 1) // calls  # ... a call hints (past the run's end: a hint only)
    pq = (each + n8 - 1) // n8  # lines per step of a call's loop
    m = 0
    t = c0
    while t < c1:
        step = 4 if SCORE_QUADS and t + 4 <= c1 else 2 if t + 2 <= c1 else 1
        if not warm:  # (warm: the run before hinted this run's rows, :func:`_part_mix`)
            # into L2: the value rows the mix reads next (:func:`_part_mix`), with their
            # keys, and the key rows ATTN_AHEAD positions on
            _prefetch_span(vc, t * KV * W, step * KV * W)
            _prefetch_span(kc, (t + ATTN_AHEAD) * KV * W, step * KV * W)
        for j in range(KV):
            h = j * G
            if step > 1:
                h = _score_pairs(qr, kc, c0, scale, p, j, h, (j + 1) * G, t, step,
                                 nx0 * KV * W + m * each * per_line, pq if step == 4 else 0)
                m += step == 4
            if h < (j + 1) * G:  # one call site: each inlined copy of it is a compile
                for u in range(t, t + step):
                    _group_dots(qr, h, (j + 1) * G, kc[u, j], scale, p, u - c0)
        t += step


#: 8-lane vectors of a value row that :func:`_mix_4xn` keeps in registers per pass over a run
#: of positions: four heads times this many accumulators (16 of AVX-512's 32 vector registers;
#: 8 of AVX2's 16)
MIX_VECS = 4 if "avx512f" in host_features() else 2


@intrinsic
def _mix_4xn(typingctx, part, po, ps, vc, vo, vs, p, wo, ws, nt, i0, d, kc, pfo, q, qk):
    """Four heads' value sums over ``nt`` positions for one slice of :data:`MIX_VECS` x 8
    lanes: for k < 4 and i in ``i0 .. i0 + 8 MIX_VECS``, ``part.flat[po + k ps + i] = sum_t
    p.flat[wo + k ws + t] * value(vc.flat[vo + t vs + i])``, one fused multiply-add per
    position in position order from 0 (the bits of one position at a time). The sums stay in
    registers over the whole run, and each position's slice of its value row is loaded once for
    the four heads; a run's rows were read in pieces of one or two cache lines, so the row
    :data:`ATTN_PREFETCH` positions on is prefetched. ``vc`` float32, float16 as uint16 bits or
    q8_0 int8 rows of ``d`` values. At position t the ``q`` cache lines from line ``t q`` on,
    counted from element ``pfo`` of ``vc`` (the next run's rows), are hinted into L2, and as
    many of ``kc`` where ``qk`` (where the scores did not hint them): memory reads while these
    sums compute."""
    kind = _cache_kind(vc.dtype)
    nv = MIX_VECS
    sig = types.void(part, types.intp, types.intp, vc, types.intp, types.intp, p, types.intp,
                     types.intp, types.intp, types.intp, types.intp, kc, types.intp, types.intp,
                     types.intp)

    def codegen(context, builder, signature, args):
        part_a, po, ps, vc_a, vo, vs, p_a, wo, ws, nt, i0, d, kc_a, pfo, q, qk = args
        pptr = context.make_array(signature.args[0])(context, builder, part_a).data
        vptr = context.make_array(signature.args[3])(context, builder, vc_a).data
        wptr = context.make_array(signature.args[6])(context, builder, p_a).data
        kptr = context.make_array(signature.args[12])(context, builder, kc_a).data
        fma = _fma8(builder)
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(_F32x8, [0.0] * 8))
                 for _ in range(nv)] for _ in range(4)]
        line = 64 // ({"f32": 4, "f16": 2}.get(kind, 1))  # values per cache line

        def positions(hints):
            with cgutils.for_range(builder, nt) as loop:
                t = loop.index
                row = builder.add(vo, builder.mul(t, vs))
                ahead = _k_off(builder, row, vs, ATTN_PREFETCH)
                for v in range(0, 8 * nv, line):
                    _prefetch(builder, vptr, builder.add(ahead, builder.add(
                        i0, ir.Constant(i0.type, v))))
                for n, ptr in ((q, vptr), (qk, kptr)) if hints else ():
                    with cgutils.for_range(builder, n) as pf:
                        at = builder.add(pfo, builder.mul(builder.add(builder.mul(t, n),
                                                                      pf.index),
                                                          ir.Constant(t.type, line)))
                        _prefetch(builder, ptr, at, L2)
                vals = [_load8(builder, vptr, row, builder.add(
                    i0, ir.Constant(i0.type, 8 * v)), kind, d) for v in range(nv)]
                for k in range(4):
                    w = _splat8(builder, builder.load(builder.gep(
                        wptr, [builder.add(_k_off(builder, wo, ws, k), t)])))
                    for v in range(nv):
                        acc = accs[k][v]
                        builder.store(builder.call(fma, [w, vals[v], builder.load(acc)]), acc)

        # the loop with hints where there are any; a prompt's runs keep the loop without
        hinted = builder.icmp_signed(">", builder.add(q, qk), ir.Constant(q.type, 0))
        with builder.if_else(hinted) as (then, otherwise):
            with then:
                positions(True)
            with otherwise:
                positions(False)
        for k in range(4):
            row = builder.add(_k_off(builder, po, ps, k), i0)
            for v in range(nv):
                at = builder.gep(pptr, [builder.add(row, ir.Constant(row.type, 8 * v))])
                builder.store(builder.load(accs[k][v]),
                              builder.bitcast(at, _F32x8.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


def _mix_heads(p, vc, c0, c1, part, j, h0, h1, kc, pf0, pf1):
    """Positions ``c0 .. c1 - 1`` of kv head j into the sums of query heads ``h0 .. h1 - 1``
    (:func:`_mix_4xn` four heads at a time where it applies), elements ``pf0 .. pf1 - 1`` of
    ``kc`` and ``vc`` hinted into L2 meanwhile; returns the first head left."""


@overload(_mix_heads, inline="always")
def _ol_mix_heads(p, vc, c0, c1, part, j, h0, h1, kc, pf0, pf1):
    if any(a.layout != "C" for a in (p, vc, part, kc)):
        # arrays not known to be contiguous: one head and position at a time
        return lambda p, vc, c0, c1, part, j, h0, h1, kc, pf0, pf1: h0

    def impl(p, vc, c0, c1, part, j, h0, h1, kc, pf0, pf1):
        d = part.shape[1] - PART_V
        if d % (8 * MIX_VECS):
            return h0
        KV, W = vc.shape[1], vc.shape[2]
        nt = c1 - c0
        per_line = 64 // vc.itemsize
        calls = ((h1 - h0) // 4) * (d // (8 * MIX_VECS))
        lines = (max(0, pf1 - pf0) + per_line - 1) // per_line
        each = (lines + calls - 1) // max(1, calls)  # lines a call hints
        q = (each + nt - 1) // nt if nt > 0 else 0
        m = 0
        h = h0
        while h + 4 <= h1:  # offsets into the C-contiguous arrays
            for i0 in range(0, d, 8 * MIX_VECS):
                _mix_4xn(part, h * part.shape[1] + PART_V, part.shape[1], vc, (c0 * KV + j) * W,
                         KV * W, p, h * p.shape[1], p.shape[1], nt, i0, d, kc,
                         pf0 + m * each * per_line, q, 0 if SCORE_QUADS else q)
                m += 1
            h += 4
        return h
    return impl


@njit(cache=True, fastmath=_FAST, error_model="numpy")
def _part_mix(p, vc, c0, c1, part, kc, nx0, nx1):
    """``part[h, PART_V:] = sum_t p[h, t - c0] * vc[t, h // G]``, each sum in position order:
    four heads of a kv head at a time with the sums in SIMD registers (:func:`_mix_heads`),
    other heads one position at a time. The key and value rows of positions ``nx0 .. nx1 - 1``
    (the run this thread takes next) are prefetched into L2 meanwhile, a share before each kv
    head's sums, so that memory works while the mix computes from L2."""
    H = part.shape[0]
    d = part.shape[1] - PART_V
    KV = vc.shape[1]
    G = H // KV
    span = (nx1 - nx0) * KV * vc.shape[2]
    for j in range(KV):
        a = nx0 * KV * vc.shape[2] + span * j // KV
        b = nx0 * KV * vc.shape[2] + span * (j + 1) // KV
        h = _mix_heads(p, vc, c0, c1, part, j, j * G, (j + 1) * G, kc, a, b)
        for g in range(h, (j + 1) * G):
            for i in range(d):
                part[g, PART_V + i] = 0.0
            for t in range(c0, c1):
                _row_axpy(p[g, t - c0], vc[t, j], part, g, PART_V)


@intrinsic
def _f32_from_bits(typingctx, bits):
    """The float32 whose IEEE bits are the int32 ``bits``."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


#: below this exp(x) is no longer a normal float32 and :func:`_exp_le0` gives 0
_EXP_MIN = np.float32(-87.33654)


@njit(inline="always", error_model="numpy")
def _exp_le0(x):
    """exp(x) in float32 for x <= 0 (a softmax's ``score - max``), branch-free so a loop of
    them runs in SIMD lanes (a call to libm's expf per score cost as much as the dot products
    did): x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so r is exact), Cephes'
    degree-6 polynomial for exp(r), times 2^n made from its exponent bits. Within 1 ulp of
    the true value (tests/test_cpu_ops.py); 0 below :data:`_EXP_MIN`."""
    xc = max(x, _EXP_MIN)
    n = np.floor(xc * np.float32(1.44269504088896341) + np.float32(0.5))
    r = xc - n * np.float32(0.693359375)
    r = r - n * np.float32(-2.12194440e-4)
    y = np.float32(1.9875691500e-4)
    y = y * r + np.float32(1.3981999507e-3)
    y = y * r + np.float32(8.3334519073e-3)
    y = y * r + np.float32(4.1665795894e-2)
    y = y * r + np.float32(1.6666665459e-1)
    y = y * r + np.float32(5.0000001201e-1)
    y = y * (r * r) + r + np.float32(1.0)
    e = _f32_from_bits(np.int32((np.int32(n) + np.int32(127)) * np.int32(1 << 23)))
    return y * e if x >= _EXP_MIN else np.float32(0.0)


@njit(cache=True, fastmath=_FAST, error_model="numpy")
def _part_softmax(p, n, part):
    """Row h of ``p[:, :n]`` (one run's scores) made its softmax in place; its largest score
    and the sum of exp(score - largest) into ``part[h, PART_M]`` and ``part[h, PART_S]``."""
    for h in range(p.shape[0]):
        top = np.float32(-np.inf)  # float32: a float64 start made the whole loop float64
        for t in range(n):
            top = max(top, p[h, t])
        total = np.float32(0.0)
        for t in range(n):
            e = _exp_le0(p[h, t] - top)
            p[h, t] = e
            total += e
        for t in range(n):
            p[h, t] = p[h, t] / total
        part[h, PART_M] = top
        part[h, PART_S] = total


@njit(inline="always", error_model="numpy")
def _part(qr, kc, vc, c0, c1, scale, part, nx0, nx1, warm):
    """The partial attention of every query head (``qr`` [H, d], RoPE applied) over positions
    ``c0 .. c1 - 1`` of ``kc``/``vc`` [len, KV, d]: per head its largest score, the sum of
    exp(score - largest) and the value rows weighted by the run's own softmax, into ``part``
    [H, d + 2]. Normalized before mixing, as numpy's reference does: with one run the merge
    multiplies by exactly 1 (a merged form that divided once after the sums moved a tiny
    Qwen3 model's int8 activations across rounding ties: tests/test_bonsai.py). The rows of
    positions ``nx0 .. nx1 - 1`` (the run this thread takes next; none where equal) are hinted
    into L2 meanwhile; ``warm``: the run before hinted this run's, so it hints none of its own."""
    H = qr.shape[0]
    p = np.empty((H, c1 - c0), np.float32)
    _part_scores(qr, kc, vc, c0, c1, scale, p, warm, nx0, nx1)
    _part_softmax(p, c1 - c0, part)
    _part_mix(p, vc, c0, c1, part, kc, nx0, nx1)


@njit(inline="always", error_model="numpy")
def _merge(parts, nch, out):
    """``out`` [H * d] from the partials ``parts[:nch]`` [nch, H, d + 2] of consecutive runs
    of positions: one softmax correction per run (as flash-decoding merges its splits)."""
    H = parts.shape[1]
    d = parts.shape[2] - PART_V
    for h in range(H):
        top = -np.inf
        for c in range(nch):
            top = max(top, parts[c, h, PART_M])
        total = np.float32(0.0)
        for c in range(nch):
            total += np.exp(parts[c, h, PART_M] - top) * parts[c, h, PART_S]
        o = out[h * d: (h + 1) * d]
        for i in range(d):
            o[i] = 0.0
        for c in range(nch):  # one run: w = s / s = 1 exactly
            w = np.exp(parts[c, h, PART_M] - top) * parts[c, h, PART_S] / total
            for i in range(d):
                o[i] += w * parts[c, h, PART_V + i]


@njit(inline="always", error_model="numpy")
def _rope_heads(q, cos, sin, qr):
    """RoPE of every head of ``q`` [H, d] into ``qr``."""
    for h in range(q.shape[0]):
        _rope(q[h], cos, sin, qr[h])


@njit(inline="always", error_model="numpy")
def _store_kv(k, v, cos, sin, kc, vc, pos):
    """k (RoPE applied) and v [KV, d] into the caches at ``pos`` (rows of the cache's type:
    :func:`_row_put`)."""
    kr = np.empty(k.shape[1], np.float32)
    for j in range(k.shape[0]):
        _rope(k[j], cos, sin, kr)
        _row_put(kc[pos, j], kr)
        _row_put(vc[pos, j], v[j])


@njit(inline="always", error_model="numpy")
def _attend(qr, kc, vc, n, out):
    """Every query head (``qr`` [H, d], RoPE applied) of a token at position n - 1 against
    positions 0..n-1 of the caches, into ``out`` [H * d]: the runs' partials, merged."""
    H, d = qr.shape
    scale = np.float32(1.0 / math.sqrt(d))
    nch = (n + ATTN_CHUNK - 1) // ATTN_CHUNK
    parts = np.empty((nch, H, d + PART_V), np.float32)
    for c in range(nch):  # each run hints the next one's rows (:func:`_part_mix`)
        _part(qr, kc, vc, c * ATTN_CHUNK, min(n, (c + 1) * ATTN_CHUNK), scale, parts[c],
              min(n, (c + 1) * ATTN_CHUNK), min(n, (c + 2) * ATTN_CHUNK), c > 0)
    _merge(parts, nch, out)


@njit(cache=True, error_model="numpy")
def attend_one(q, k, v, cos, sin, kc, vc, pos, out):
    """One token at position ``pos``: RoPE on q [H, d] and k [KV, d], k and v [KV, d] stored
    at ``kc/vc[pos]``, then causal GQA attention over positions 0..pos into ``out`` [H * d]
    (:func:`_attend`), on this thread.

    RoPE pairs element i with i + d/2 (rotate-half); ``cos``/``sin`` are float32 [d/2].
    """
    _store_kv(k, v, cos, sin, kc, vc, pos)
    qr = np.empty(q.shape, np.float32)
    _rope_heads(q, cos, sin, qr)
    _attend(qr, kc, vc, pos + 1, out)


@njit(cache=True, parallel=True, nogil=True, error_model="numpy")
def attend_split(q, k, v, cos, sin, kc, vc, start, out):
    """T tokens of one sequence at positions ``start ..`` in one call, among threads: every
    token's k and v stored, then each token's attention over positions 0 .. its own with
    :func:`attend_one`'s bits. One token (a decode step past one run of positions): its runs'
    partials shared among threads, then merged. Several (a prompt's chunk): the tokens shared
    among threads, each as :func:`attend_one` takes it. ``q`` [T, H, d], ``k``/``v`` [T, KV,
    d], ``cos``/``sin`` [T, d/2], ``out`` [T, H * d].

    For prompts this replaced numpy's matrix products (:func:`..backend.attention`, on one
    thread), which computed a score for every position and masked the future ones after: a
    64-token chunk of 2B-4T at 3,008 positions took 1.34 s over 30 layers that way, 0.50 s
    here (AMD EPYC, 2 cores)."""
    T, H, d = q.shape
    for t in range(T):
        _store_kv(k[t], v[t], cos[t], sin[t], kc, vc, start + t)
    if T == 1:
        qr = np.empty((H, d), np.float32)
        _rope_heads(q[0], cos[0], sin[0], qr)
        scale = np.float32(1.0 / math.sqrt(d))
        n = start + 1
        nch = (n + ATTN_CHUNK - 1) // ATTN_CHUNK
        parts = np.empty((nch, H, d + PART_V), np.float32)
        nth = min(nch, ATTN_BLOCKS)
        for th in prange(nth):  # a thread a block of runs (static schedule): its next is c + 1
            for c in range(th * nch // nth, (th + 1) * nch // nth):
                _part(qr, kc, vc, c * ATTN_CHUNK, min(n, (c + 1) * ATTN_CHUNK), scale,
                      parts[c], min(n, (c + 1) * ATTN_CHUNK),
                      min(n, (c + 2) * ATTN_CHUNK) if c + 1 < (th + 1) * nch // nth else 0,
                      c > th * nch // nth)
        _merge(parts, nch, out[0])
        return
    for i in prange(T):
        # a cheap (early) and a dear (late) token in turn: the threads' shares of a causal
        # chunk weigh the same
        t = i // 2 if i % 2 == 0 else T - 1 - i // 2
        qr = np.empty((H, d), np.float32)
        _rope_heads(q[t], cos[t], sin[t], qr)
        _attend(qr, kc, vc, start + t + 1, out[t])


def kernel_cache(cache: np.ndarray) -> np.ndarray:
    """A KV cache array as the kernels take it: float16 as its uint16 bits (numba has no
    float16 type), float32 and q8_0's int8 rows as they are."""
    return cache.view(np.uint16) if cache.dtype == np.float16 else cache


def warm_attention(kv_type: str = "f32", split: bool = False) -> None:
    """Compile (or read from numba's cache) the one-token attention kernel for a cache of
    ``kv_type`` (:data:`~bitformat.constants.KV_TYPES`), and with ``split`` the one that
    shares long contexts among threads. numba compiles for the arrays' types, not their
    sizes, so small ones do."""
    H, KV, d = 4, 2, 8
    n = ATTN_CHUNK + 2
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, H, d)).astype(np.float32)
    k = rng.standard_normal((1, KV, d)).astype(np.float32)
    cos, sin = np.ones((1, d // 2), np.float32), np.zeros((1, d // 2), np.float32)
    shape = (n, KV, kvquant.row_width(kv_type, d))
    kc = kernel_cache(np.zeros(shape, kvquant.storage_dtype(kv_type)))
    vc = kernel_cache(np.zeros(shape, kvquant.storage_dtype(kv_type)))
    out = np.empty((1, H * d), np.float32)
    attend_one(q[0], k[0], k[0], cos[0], sin[0], kc, vc, n - 1, out[0])
    if split:
        attend_split(q, k, k, cos, sin, kc, vc, n - 1, out)


@intrinsic
def _ptr_like(typingctx, addr, proto):
    """A pointer to ``proto``'s element type at address ``addr`` (an int64 from
    ``ndarray.ctypes.data``)."""
    sig = types.CPointer(proto.dtype)(types.int64, proto)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen


@njit(inline="always")
def _caches(kaddr, vaddr, lens, t, layer, KV, proto):
    """Token t's k and v caches of ``layer``: [lens[t], KV, width] each, of ``proto``'s type
    and width (a row of the cache type: float32, float16 bits, q8_0 int8)."""
    W = proto.shape[0]
    at = layer * lens[t] * KV * W * proto.itemsize
    kc = carray(_ptr_like(kaddr[t] + at, proto), (lens[t], KV, W))
    vc = carray(_ptr_like(vaddr[t] + at, proto), (lens[t], KV, W))
    return kc, vc


@njit(cache=True, parallel=True, nogil=True, error_model="numpy")
def attend_rows(q, k, v, cos, sin, kaddr, vaddr, lens, pos, proto, layer, out):
    """:func:`attend_one` for T tokens of a decode step, each on its own KV cache, in one call
    (the tokens split among threads; each as in :func:`attend_one`).

    Token t: q[t] [H, d], k[t]/v[t] [KV, d] at position ``pos[t]``, ``cos[t]``/``sin[t]``; its
    cache is an array [layers, lens[t], KV, width] of ``proto``'s type and width (one row:
    float32, uint16 half bits or q8_0 int8) at address ``kaddr[t]`` (k) and ``vaddr[t]`` (v),
    of which ``layer`` is used; ``out`` [T, H * d]. The caller keeps the caches alive and
    C-contiguous.
    """
    T, H, d = q.shape
    KV = k.shape[1]
    for t in range(T):
        kc, vc = _caches(kaddr, vaddr, lens, t, layer, KV, proto)
        _store_kv(k[t], v[t], cos[t], sin[t], kc, vc, pos[t])
    for t in prange(T):
        kc, vc = _caches(kaddr, vaddr, lens, t, layer, KV, proto)
        qr = np.empty((H, d), np.float32)
        _rope_heads(q[t], cos[t], sin[t], qr)
        _attend(qr, kc, vc, pos[t] + 1, out[t])
