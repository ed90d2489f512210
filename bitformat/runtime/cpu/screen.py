"""The screened LM head's kernels on the ``cpu`` backend (docs/exact-head.md).

At load, :func:`quantize_bits` turns each embedding row ``e`` (f16, bf16 or f32 values) into int8
codes ``c`` with one float64 scale ``d`` (``max|e| / 127``), stored as ``c + 128`` (uint8, rows
padded to 64 bytes with value 0) so that vpdpbusd (u8 x s8) reads them, and the two norms the
bound needs: ``||e - d c||`` and ``||d c||`` (float64, per row). Where the CPU has AVX512-VBMI
the screen reads only the codes' high 7 bits ``h = floor(c / 2)`` (stored ``h + 64``, packed 8
to 7 bytes, unpacked in registers by vpermb + vpmultishiftqb: :func:`screen_vbmi7`), 1/8 fewer
bytes per step for a bound about twice as wide, and screens its candidates again with the int8
codes from the bit plane of their low bits (:func:`refine_vbmi7`). Per step, a hidden state ``x``
becomes two int8 vectors ``q1 + q2 / 254 ~ x s`` (:func:`..head.split_hidden`), so the
screen's integer sums are exact and its only errors are the two quantizations, which the bound
covers through Cauchy-Schwarz. :func:`screen_vnni` (AVX512-VNNI: one code load, two vpdpbusd per 64
values and token), :func:`screen_avx2` (two vpmaddwd per 16 values and token) and
:func:`screen_portable` (plain numba) give the same integers; each writes every row's lower and
upper bound on the full head's logit.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..head import FINE, REL
from .kernels import L2, _avx2_functions, _I16x16, _I32x8, _load64, _prefetch, _vnni_functions
from .rans import _prefetch_rows

#: bytes ahead that the screen prefetches, into L2 only (prefetcht1). The 328 MB int8 screen
#: of 2B-4T, 2 threads (Intel Xeon with AMX): 10.9 ms with 2048 bytes into L1, 9.9 ms with
#: 8192 into L2 (4096: 10.1, 16384: 10.2).
SCREEN_PREFETCH = 8192
_I32x16 = ir.VectorType(ir.IntType(32), 16)
_I8x64 = ir.VectorType(ir.IntType(8), 64)


@njit(inline="always")
def _quantize_row(e, v, qmax, codes, scale, dnorm, qnorm, enorm, bad):
    """Row v's float64 values ``e`` into ``codes`` (its stored codes ``c + qmax + 1``, padding
    ``qmax + 1``), its scale and norms (:func:`quantize_bits`)."""
    h = e.size
    off = qmax + 1
    m = 0.0
    fin = True
    for k in range(h):
        if not math.isfinite(e[k]):
            fin = False
        a = abs(e[k])
        if a > m:
            m = a
    bad[v] = 0 if fin else 1
    d = m / qmax if fin else 0.0
    scale[v] = d
    inv = 1.0 / d if d > 0 else 0.0
    s1 = 0.0
    s2 = 0.0
    s3 = 0.0
    for k in range(h):
        c = min(float(qmax), max(-float(qmax), np.rint(e[k] * inv))) if fin else 0.0
        codes[k] = np.uint8(np.int32(c) + off)
        r = e[k] - c * d
        s1 += r * r
        s2 += (c * d) * (c * d)
        s3 += e[k] * e[k]
    for k in range(h, codes.size):
        codes[k] = off
    dnorm[v] = math.sqrt(s1)
    qnorm[v] = math.sqrt(s2)
    enorm[v] = math.sqrt(s3)


@njit(inline="always")
def _pack7(u, out):
    """Eight stored int7 codes to seven bytes (:func:`..head.pack7`)."""
    for j in range(u.size // 8):
        w = np.uint64(0)
        for m in range(8):
            w |= np.uint64(u[8 * j + m]) << np.uint64(7 * m)
        for b in range(7):
            out[7 * j + b] = np.uint8((w >> np.uint64(8 * b)) & np.uint64(0xFF))


@njit(inline="always")
def _pack6(u, out):
    """64 stored int6 codes per 48 bytes (:func:`..head.pack6`)."""
    for g in range(u.size // 64):
        o, b = 48 * g, 64 * g
        for a in range(32):
            out[o + a] = np.uint8((u[b + a] & 15) | ((u[b + 32 + a] & 15) << 4))
        for j in range(16):
            t = 0
            for i in range(4):
                t |= ((np.int32(u[b + j + 16 * i]) >> 4) & 3) << (2 * i)
            out[o + 32 + j] = np.uint8(t)


@njit(inline="always")
def _store_split(e, v, bits, codes, plane, scale, dnorm, qnorm, enorm, bad, fdn, fqn):
    """Row v as int7 or int6 codes: the int8 codes c split into ``h = floor(c / sp)``
    (stored h + 64 or h + 32, packed) and the low part ``c - sp h`` (the bit plane), with the
    norms of both (:func:`_store_row`)."""
    sp = 2 if bits == 7 else 4
    off = 64 if bits == 7 else 32
    u = np.empty(codes.shape[1] * 8 // bits, np.uint8)
    _quantize_row(e, v, 127, u, scale, fdn, fqn, enorm, bad)
    half = scale[v] * 0.5
    s1 = 0.0
    s2 = 0.0
    for j in range(plane.shape[1]):
        plane[v, j] = 0
    for k in range(u.size):
        c = np.int32(u[k]) - 128
        h = c >> 1 if sp == 2 else c >> 2  # floor(c / sp)
        u[k] = np.uint8(h + off)
        low = c - sp * h
        if sp == 2:
            if low:
                plane[v, k >> 3] |= np.uint8(1 << (k & 7))
        else:
            plane[v, k >> 2] |= np.uint8(low << (2 * (k & 3)))
        if k < e.size:
            val = half * np.float64(2 * sp * h + sp - 1)
            r = e[k] - val
            s1 += r * r
            s2 += val * val
    if bits == 7:
        _pack7(u, codes[v])
    else:
        _pack6(u, codes[v])
    scale[v] = half
    dnorm[v] = math.sqrt(s1)
    qnorm[v] = math.sqrt(s2)


@njit(inline="always")
def _store_row(e, v, bits, codes, plane, scale, dnorm, qnorm, enorm, bad, fdn, fqn):
    """Row v quantized into ``codes[v]``: int8 codes, or for ``bits`` 7 the int8 codes c split
    into ``h = floor(c / 2)`` (stored h + 64, packed) and the bit plane ``b = c - 2 h``
    (``plane[v]``), with the norms of both: ``(d / 2)(4 h + 1)`` into scale, dnorm, qnorm,
    the int8 codes' into fdn, fqn (:meth:`..head.ScreenTables.build`)."""
    if bits == 8:
        _quantize_row(e, v, 127, codes[v], scale, dnorm, qnorm, enorm, bad)
        return
    _store_split(e, v, bits, codes, plane, scale, dnorm, qnorm, enorm, bad, fdn, fqn)


@njit(cache=True, nogil=True)
def _quantize_span(E, lut, icols, codes, plane, scale, dnorm, qnorm, enorm, bad, fdn, fqn,
                   bits, v0, v1):
    """Rows v0 .. v1 - 1 of ``E`` (uint16 bits valued by ``lut``), each value times
    ``icols[k]`` (1 / its column scale: exact): one thread's share of :func:`quantize_bits`."""
    h = E.shape[1]
    e = np.empty(h)
    for v in range(v0, v1):
        for k in range(h):
            e[k] = lut[E[v, k]] * icols[k]
        _store_row(e, v, bits, codes, plane, scale, dnorm, qnorm, enorm, bad, fdn, fqn)


@njit(cache=True, nogil=True)
def _quantize_span_f32(E, lut, icols, codes, plane, scale, dnorm, qnorm, enorm, bad, fdn, fqn,
                       bits, v0, v1):
    """:func:`_quantize_span` for float rows (``lut`` unused)."""
    h = E.shape[1]
    e = np.empty(h)
    for v in range(v0, v1):
        for k in range(h):
            e[k] = np.float64(E[v, k]) * icols[k]
        _store_row(e, v, bits, codes, plane, scale, dnorm, qnorm, enorm, bad, fdn, fqn)


def column_choice(E, lut) -> np.ndarray | None:
    """The column scales of head rows ``E`` (uint16 bits valued by ``lut``, or float32 with
    ``lut`` None): :func:`..head.column_scales` of 4,096 rows spread over the head (any
    powers of two keep the bound rigorous, so a sample serves)."""
    from ..head import column_maxima, column_scales, sample_rows

    rows = E[sample_rows(E.shape[0])]
    rows = lut[rows] if lut is not None else rows
    return column_scales(column_maxima(rows), rows[::4])


def quantize_bits(E, lut, codes, plane, scale, dnorm, qnorm, enorm, bad, fdn, fqn, bits,
                  threads: int | None = None, cols=None) -> None:
    """Rows of ``E`` (uint16 bits, valued by ``lut``; float32 where ``lut`` is None) into
    ``bits``-bit ``codes`` (int8: uint8 ``c + 128``, padding 128; int7: :func:`_store_row`),
    ``scale`` d, ``||e - d c||``, ``||d c||``, ``||e||`` (float64, as evaluated) and
    ``bad[v]`` = 1 where the row holds a NaN or an infinity (its codes are then 0).
    ``plane``, ``fdn``, ``fqn``: int7 and int6 only (else empty). With column scales
    ``cols`` (:func:`..head.column_scales`) all of it is of the rows ``e / cols``. The rows are
    split over ``threads`` (default: the CPU count) Python threads running one compiled,
    GIL-free loop each: numba's ``prange`` took 7.5 s to compile against 3 s for the same loop
    (2-core AMD EPYC), and a first run compiles this while it loads the model."""
    V = E.shape[0]
    lut = np.empty(0, np.float32) if lut is None else lut
    icols = np.ones(E.shape[1]) if cols is None else 1.0 / np.asarray(cols, np.float64)
    span = _quantize_span if E.dtype == np.uint16 else _quantize_span_f32
    n = max(1, min(threads or os.cpu_count() or 1, V // 1024 or 1))
    bounds = [V * i // n for i in range(n + 1)]
    args = (E, lut, icols, codes, plane, scale, dnorm, qnorm, enorm, bad, fdn, fqn, bits)
    if n == 1:
        span(*args, 0, V)
        return
    with ThreadPoolExecutor(n) as pool:
        for f in [pool.submit(span, *args, bounds[i], bounds[i + 1]) for i in range(n)]:
            f.result()


def quantize_rows(E, lut, dim: int, bits: int = 8, cols=None) -> tuple:
    """The pieces of :meth:`..head.ScreenTables.build` for head rows ``E`` (uint16 bits
    valued by ``lut``, or float32 with ``lut`` None): ``(codes, scale, dnorm, qnorm, enorm,
    bad, fine)``, with ``fine`` = (bit plane, int8 dnorm, int8 qnorm) for ``bits`` 7, else
    None; of the rows ``e / cols`` where column scales ``cols`` are given."""
    from ..head import code_buffer, padded, row_bytes

    V = E.shape[0]
    codes = code_buffer(V, row_bytes(dim, bits))
    scale, dn, qn, en = (np.empty(V) for _ in range(4))
    bad = np.empty(V, np.uint8)
    nested = V if bits != 8 else 0  # int7, int6: the int8 codes' low bits and norms too
    plane = np.empty((nested, padded(dim) // (8 if bits == 7 else 4)), np.uint8)
    fdn, fqn = np.empty(nested), np.empty(nested)
    quantize_bits(E, lut, codes, plane, scale, dn, qn, en, bad, fdn, fqn, bits, cols=cols)
    return codes, scale, dn, qn, en, bad, ((plane, fdn, fqn) if nested else None)


@njit(cache=True, nogil=True)
def split_hidden(x, xq, par):
    """:func:`..head.split_hidden` compiled: x (float32 or float64 [dim]) into ``xq``
    int8 [2, width] and ``par`` float64 [6], the same arithmetic per value (its two norms
    summed in another order, which their slack covers)."""
    n = x.size
    m = 0.0
    for k in range(n):
        m = max(m, abs(np.float64(x[k])))
    s = 127.0 / m if m > 0 else 1.0
    s1 = 0
    s2 = 0
    ndx = 0.0
    nx = 0.0
    for k in range(n):
        v = np.float64(x[k])
        y = v * s
        q1 = min(127.0, max(-127.0, np.rint(y)))
        q2 = min(127.0, max(-127.0, np.rint((y - q1) * FINE)))
        xq[0, k] = np.int8(q1)
        xq[1, k] = np.int8(q2)
        s1 += np.int64(q1)
        s2 += np.int64(q2)
        dx = v - (q1 + q2 / FINE) / s
        ndx += dx * dx
        nx += v * v
    for k in range(n, xq.shape[1]):
        xq[0, k] = 0
        xq[1, k] = 0
    rel = (n + 8) * 2.0 ** -52 + REL  # runtime.head.norm_slack(n)
    par[0] = 1.0 / (FINE * s)
    par[1] = math.sqrt(nx) * (1 + rel)
    par[2] = math.sqrt(ndx) * (1 + rel) + math.sqrt(n) * m * 2.0 ** -48
    par[3] = 0.0
    par[4] = s1
    par[5] = s2


#: vpermb: qword k of a 64-byte load gathers the seven packed bytes 7k..7k+6 of its 8 codes
_GATHER7 = [7 * (j // 8) + min(j % 8, 6) for j in range(64)]
#: vpmultishiftqb: byte m of each qword takes the 8 bits from bit 7m (code m and one more)
_SHIFT7 = [7 * (j % 8) for j in range(64)]


def _unpack7(builder, wptr, off):
    """<64 x i8>: the 64 stored int7 codes packed in the 56 bytes at ``wptr + off`` (it loads 64:
    :func:`..head.code_buffer`). AVX512-VBMI: vpermb, vpmultishiftqb, one and."""
    raw = _load64(builder, wptr, off)
    g = builder.shuffle_vector(raw, ir.Constant(_I8x64, None),
                               ir.Constant(ir.VectorType(ir.IntType(32), 64), _GATHER7))
    shift = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
        _I8x64, [_I8x64, _I8x64]), "llvm.x86.avx512.pmultishift.qb.512")
    s = builder.call(shift, [ir.Constant(_I8x64, _SHIFT7), g])
    return builder.and_(s, ir.Constant(_I8x64, [0x7F] * 64))


def _unpack6_halves(builder, wptr, off):
    """The 64 stored int6 codes of the 48 bytes at ``wptr + off`` (:func:`..head.pack6`) as two
    <32 x i8>: codes 0..31 (the 32 bytes' low nibbles) and 32..63 (their high nibbles), each
    with its top two bits from the 16 bytes after them (byte ``a % 16``, bits ``2 (a // 16)``
    for the low half, ``2 (a // 16) + 4`` for the high one)."""
    i8x16 = ir.VectorType(ir.IntType(8), 16)
    i32x32 = ir.VectorType(ir.IntType(32), 32)

    def splat(v):
        return ir.Constant(_I8x32, [v] * 32)

    nib = builder.load(builder.bitcast(builder.gep(wptr, [off]), _I8x32.as_pointer()), align=1)
    t16 = builder.load(builder.bitcast(builder.gep(wptr, [builder.add(
        off, ir.Constant(off.type, 32))]), i8x16.as_pointer()), align=1)
    top = builder.shuffle_vector(t16, t16, ir.Constant(i32x32, list(range(16)) * 2))
    t = [builder.and_(builder.lshr(top, splat(2 * i)) if i else top, splat(3)) for i in range(4)]
    halves = ir.Constant(i32x32, list(range(16)) + list(range(48, 64)))
    lo_top = builder.shuffle_vector(t[0], t[1], halves)
    hi_top = builder.shuffle_vector(t[2], t[3], halves)
    return (builder.or_(builder.and_(nib, splat(15)), builder.shl(lo_top, splat(4))),
            builder.or_(builder.lshr(nib, splat(4)), builder.shl(hi_top, splat(4))))


def _unpack6(builder, wptr, off):
    """<64 x i8>: :func:`_unpack6_halves`' codes 0..63 in order, for vpdpbusd (u <= 63)."""
    lo, hi = _unpack6_halves(builder, wptr, off)
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(ir.IntType(32), 64),
                                                      list(range(64))))


def _make_screen_dot(bits: int, ntok: int = 1, nrows: int = 1):
    """Intrinsic ``dot(w, w_off, x, x_off, n) -> (D1, D2) * ntok * nrows``: the stored codes
    of ``nrows`` consecutive rows (from byte ``w_off``: n chunks of 64 codes, 64 bytes each for
    int8, 56 packed for int7, 48 for int6) times the int8 ``x[x_off + 2 t width + 64 i]`` (q1
    of token t) and ``x[x_off + (2 t + 1) width + 64 i]`` (q2), ``width = 64 n``, for tokens
    t < ``ntok``; row k's sums first. Exact int32. One code load (int7, int6: and its unpacking) per
    chunk and row for every token, one activation load per chunk for every row, two vpdpbusd
    per chunk, row and token. ``bits`` 1 (one row, one token): a bit plane (8 bytes a chunk)
    whose set bits select x's bytes (a <64 x i1> mask), summed by vpdpbusd against ones; no
    prefetch (its rows are hinted before: :func:`refine_vbmi7`)."""
    step = 64 * bits // 8

    @intrinsic
    def dot(typingctx, w, w_off, x, x_off, n):
        sig = types.UniTuple(types.int32, 2 * ntok * nrows)(w, types.intp, x, types.intp,
                                                            types.intp)

        def codegen(context, builder, signature, args):
            w_arr, w_off, x_arr, x_off, n = args
            wptr = context.make_array(signature.args[0])(context, builder, w_arr).data
            xptr = context.make_array(signature.args[2])(context, builder, x_arr).data
            vp, red = _vnni_functions(builder)
            accs = [cgutils.alloca_once_value(builder, ir.Constant(_I32x16, None))
                    for _ in range(2 * ntok * nrows)]
            ones = builder.bitcast(ir.Constant(_I8x64, [1] * 64), _I32x16)
            zero = ir.Constant(_I8x64, [0] * 64)
            width = builder.mul(n, ir.Constant(n.type, 64))
            row_bytes = builder.mul(n, ir.Constant(n.type, step))
            with cgutils.for_range(builder, n) as loop:
                off = builder.mul(loop.index, ir.Constant(n.type, 64))
                wvs = []
                for k in range(nrows):
                    woff = builder.add(builder.add(w_off, builder.mul(
                        row_bytes, ir.Constant(n.type, k))), builder.mul(
                        loop.index, ir.Constant(n.type, step)))
                    if bits == 1:
                        word = builder.load(builder.bitcast(builder.gep(wptr, [woff]), ir.IntType(
                            64).as_pointer()), align=1)
                        wvs.append(builder.bitcast(word, ir.VectorType(ir.IntType(1), 64)))
                    else:
                        _prefetch(builder, wptr, builder.add(woff, ir.Constant(
                            n.type, SCREEN_PREFETCH)), L2)
                        codes = (_load64(builder, wptr, woff) if bits == 8 else
                                 _unpack7(builder, wptr, woff) if bits == 7 else
                                 _unpack6(builder, wptr, woff))
                        wvs.append(builder.bitcast(codes, _I32x16))
                xo = builder.add(x_off, off)
                for j in range(2 * ntok):  # q1, q2 of token 0, then of token 1, ...
                    xb = _load64(builder, xptr, builder.add(xo, builder.mul(
                        width, ir.Constant(n.type, j))))
                    for k, wv in enumerate(wvs):
                        if bits == 1:
                            pair = [ones, builder.bitcast(builder.select(wv, xb, zero), _I32x16)]
                        else:
                            pair = [wv, builder.bitcast(xb, _I32x16)]
                        acc = accs[k * 2 * ntok + j]
                        builder.store(builder.call(vp, [builder.load(acc), *pair]), acc)
            out = [builder.call(red, [builder.load(a)]) for a in accs]
            return context.make_tuple(builder, signature.return_type, out)

        return sig, codegen

    return dot


_screen_dot = _make_screen_dot(8)
_screen_dot7 = _make_screen_dot(7)
#: tokens per pass of a batched step's screen, two rows at a time (one activation load serves
#: both rows: 2B-4T's int7 screen of 8 tokens, its integer sums alone, 16.5 ms against 26.6 a
#: row at a time, AMD EPYC with AVX-512 VBMI, 2 cores)
SCREEN_GROUPS = (4, 2, 1)
_screen_dot_4, _screen_dot_2, _screen_dot_1 = (_make_screen_dot(8, t, 2) for t in SCREEN_GROUPS)
_screen_dot7_4, _screen_dot7_2, _screen_dot7_1 = (_make_screen_dot(7, t, 2)
                                                  for t in SCREEN_GROUPS)
_screen_dot6 = _make_screen_dot(6)
_screen_dot6_4, _screen_dot6_2, _screen_dot6_1 = (_make_screen_dot(6, t, 2)
                                                  for t in SCREEN_GROUPS)
_plane_dot = _make_screen_dot(1)  # (B1, B2): x's bytes at the set bits of a bit plane


@intrinsic
def _unpack7_rows(typingctx, w, w_off, out, n):
    """``out[64 i : +64]`` = the stored int7 codes of chunk i (``w[w_off + 56 i]``), i < n."""
    sig = types.void(w, types.intp, out, types.intp)

    def codegen(context, builder, signature, args):
        w_arr, w_off, o_arr, n = args
        wptr = context.make_array(signature.args[0])(context, builder, w_arr).data
        optr = context.make_array(signature.args[2])(context, builder, o_arr).data
        with cgutils.for_range(builder, n) as loop:
            src = builder.add(w_off, builder.mul(loop.index, ir.Constant(n.type, 56)))
            _prefetch(builder, wptr, builder.add(src, ir.Constant(n.type, SCREEN_PREFETCH)), L2)
            dst = builder.gep(optr, [builder.mul(loop.index, ir.Constant(n.type, 64))])
            builder.store(_unpack7(builder, wptr, src), builder.bitcast(
                dst, _I8x64.as_pointer()), align=1)
        return context.get_dummy_value()

    return sig, codegen


@njit(inline="always")
def _bound(t, d1, d2, mul, off, scale, A, N, par):
    """Token t's (lower, upper) bound on a row's logit from its integer sums d1, d2 of stored
    codes (``mul * d - off * sum(q)``: its signed codes' sums), its scale and bound terms.
    ``par[t]``: (coef, nx, ndx, absolute slack, sum q1, sum q2)."""
    d1 = mul * d1 - off * np.int64(par[t, 4])
    d2 = mul * d2 - off * np.int64(par[t, 5])
    a = scale * np.float64(FINE * d1 + d2) * par[t, 0]
    b = (A * par[t, 1] + N * par[t, 2] + abs(a) * 2.0 ** -45 + par[t, 3]) * (1.0 + REL)
    return a - b, a + b


@njit(inline="always")
def _bounds(v, t, d1, d2, mul, off, scale, A, N, par, lo, hi):
    """Row v, token t: :func:`_bound` into ``lo[t, v]``, ``hi[t, v]``."""
    lo[t, v], hi[t, v] = _bound(t, d1, d2, mul, off, scale[v], A[v], N[v], par)


#: rows per share of the screens, and per entry of their block maxima (``bmax``)
SCREEN_BLOCK = 128


@njit(inline="always")
def _block_max(lo, hi, v0, v1, bmax, b):
    """Fold rows v0..v1 of the bounds into block b's maxima: ``bmax[b, 0, t]`` the largest lower
    bound of token t, ``bmax[b, 1, t]`` the largest upper bound (starts at -inf)."""
    for t in range(lo.shape[0]):
        m0, m1 = bmax[b, 0, t], bmax[b, 1, t]
        for v in range(v0, v1):
            m0 = max(m0, lo[t, v])
            m1 = max(m1, hi[t, v])
        bmax[b, 0, t], bmax[b, 1, t] = m0, m1


def block_maxima(V: int, T: int) -> np.ndarray:
    """The screens' ``bmax`` for V rows and T tokens, every entry -inf."""
    return np.full((-(-V // SCREEN_BLOCK), 2, T), -np.inf)


@njit(inline="always")
def _keep(v, t0, r, nt, nrows, mul, off, scale, A, N, par, lo, hi, sums):
    """The sums ``r`` of a screen dot (D1, D2 of tokens t0 .. t0 + nt for rows v .. v + nrows,
    row by row) into those rows' bounds and, where ``sums`` has rows, into ``sums``."""
    for k in range(nrows):
        for j in range(nt):
            t = t0 + j
            d1, d2 = r[2 * (k * nt + j)], r[2 * (k * nt + j) + 1]
            if sums.shape[0]:
                sums[t, v + k, 0], sums[t, v + k, 1] = d1, d2
            _bounds(v + k, t, np.int64(d1), np.int64(d2), mul, off, scale, A, N, par, lo, hi)


@njit(inline="always")
def _pass_tokens(T, t0, two):
    """Tokens the next pass of a batched screen takes from t0: 4, 2 or 1 where it takes two
    rows (``two``), else 1."""
    return (4 if T - t0 >= 4 else 2 if T - t0 >= 2 else 1) if two else 1


@njit(parallel=True, cache=True, nogil=True)
def screen_vnni(W, XQ, scale, A, N, par, lo, hi, bmax):
    """Bounds ``lo[t, v] <= l[t, v] <= hi[t, v]`` for every row v of the int8 codes ``W``
    (uint8 [V, width], ``c + 128``) and every token t of ``XQ`` int8 [T, 2, width]
    (``runtime.head.split_hidden``), and their maxima per block of ``SCREEN_BLOCK`` rows into
    ``bmax`` (:func:`block_maxima`), which lets :func:`greedy_candidates` skip the blocks that
    hold no candidate. Several tokens: two rows at a time, tokens in passes of
    :data:`SCREEN_GROUPS`."""
    V, width = W.shape
    T = XQ.shape[0]
    n = width // 64
    xflat = XQ.reshape(-1)
    none = np.empty((0, 0, 2), np.int32)
    for b in prange(bmax.shape[0]):
        v, v1 = b * SCREEN_BLOCK, min(V, (b + 1) * SCREEN_BLOCK)
        while v < v1:
            two = T > 1 and v + 1 < v1
            t0 = 0
            while t0 < T:
                w0, x0, nt = v * width, t0 * 2 * width, _pass_tokens(T, t0, two)
                if nt == 4:
                    _keep(v, t0, _screen_dot_4(W, w0, xflat, x0, n), 4, 2, 1, 128, scale, A, N,
                          par, lo, hi, none)
                elif nt == 2:
                    _keep(v, t0, _screen_dot_2(W, w0, xflat, x0, n), 2, 2, 1, 128, scale, A, N,
                          par, lo, hi, none)
                elif two:
                    _keep(v, t0, _screen_dot_1(W, w0, xflat, x0, n), 1, 2, 1, 128, scale, A, N,
                          par, lo, hi, none)
                else:
                    _keep(v, t0, _screen_dot(W, w0, xflat, x0, n), 1, 1, 1, 128, scale, A, N,
                          par, lo, hi, none)
                t0 += nt
            v += 2 if two else 1
        _block_max(lo, hi, b * SCREEN_BLOCK, v1, bmax, b)


@njit(parallel=True, cache=True, nogil=True)
def screen_vbmi7(W, XQ, scale, A, N, par, lo, hi, bmax, sums):
    """:func:`screen_vnni` for int7 codes (uint8 [V, 7 / 8 width], ``h + 64`` packed by
    :func:`..head.pack7`; needs AVX512-VBMI): 1/8 fewer bytes. Also keeps each row's
    integer sums in ``sums`` int32 [T, V, 2] for :func:`refine_vbmi7`."""
    V, nbytes = W.shape
    T = XQ.shape[0]
    n = nbytes // 56
    width = 64 * n
    xflat = XQ.reshape(-1)
    for b in prange(bmax.shape[0]):
        v, v1 = b * SCREEN_BLOCK, min(V, (b + 1) * SCREEN_BLOCK)
        while v < v1:
            two = T > 1 and v + 1 < v1
            t0 = 0
            while t0 < T:
                w0, x0, nt = v * nbytes, t0 * 2 * width, _pass_tokens(T, t0, two)
                if nt == 4:
                    _keep(v, t0, _screen_dot7_4(W, w0, xflat, x0, n), 4, 2, 4, 255, scale, A, N,
                          par, lo, hi, sums)
                elif nt == 2:
                    _keep(v, t0, _screen_dot7_2(W, w0, xflat, x0, n), 2, 2, 4, 255, scale, A, N,
                          par, lo, hi, sums)
                elif two:
                    _keep(v, t0, _screen_dot7_1(W, w0, xflat, x0, n), 1, 2, 4, 255, scale, A, N,
                          par, lo, hi, sums)
                else:
                    _keep(v, t0, _screen_dot7(W, w0, xflat, x0, n), 1, 1, 4, 255, scale, A, N,
                          par, lo, hi, sums)
                t0 += nt
            v += 2 if two else 1
        _block_max(lo, hi, b * SCREEN_BLOCK, v1, bmax, b)


#: :func:`refine_vbmi7` hints the bit planes of its first rows before the threads start, each
#: share of ``REFINE_BURST`` rows its own (as :data:`.batch.ROWS_AHEAD`)
REFINE_AHEAD = 1024
REFINE_BURST = 128


@njit(parallel=True, cache=True, nogil=True)
def refine_vbmi7(P, ids, XQ, sums, scale, A, N, par, lo, hi):
    """The int8 screen of rows ``ids`` of int7 tables: ``lo[t, i] <= l[t, ids[i]] <= hi[t,
    i]`` from the int7 screen's ``sums`` (of h + 64) and the bit planes ``P`` (the int8 codes
    are c = 2 h + b): ``c . q = 2 (S - 64 sum q) + B``, at scale ``2 * scale`` with the int8
    terms ``A``, ``N`` (``fine_A``, ``fine_N``)."""
    T = XQ.shape[0]
    nb = P.shape[1]
    n = nb // 8
    width = 64 * n
    xflat = XQ.reshape(-1)
    _prefetch_rows(P, ids, 0, min(ids.size, REFINE_AHEAD))  # far apart: overlap TLB misses
    for c in prange((ids.size + REFINE_BURST - 1) // REFINE_BURST):
        i1 = min(ids.size, (c + 1) * REFINE_BURST)
        _prefetch_rows(P, ids, max(c * REFINE_BURST, REFINE_AHEAD), i1)
        for i in range(c * REFINE_BURST, i1):
            v = ids[i]
            for t in range(T):
                r = _plane_dot(P, v * nb, xflat, t * 2 * width, n)
                d1 = 2 * np.int64(sums[t, v, 0]) + np.int64(r[0])
                d2 = 2 * np.int64(sums[t, v, 1]) + np.int64(r[1])
                lo[t, i], hi[t, i] = _bound(t, d1, d2, 1, 128, 2.0 * scale[v], A[v], N[v],
                                            par)


@intrinsic
def _screen_dot_avx2(typingctx, w, w_off, x, x_off, n):
    """``(D1, D2)`` of :func:`_make_screen_dot` (int8) on AVX2: n chunks of 16 stored codes
    (``c + 128``, zero-extended to int16) against the int16 ``x[x_off + 16 i]`` (q1) and
    ``x[x_off + width + 16 i]`` (q2), two vpmaddwd per chunk. vpmaddubsw would be twice as
    wide, but a pair of products of u8 codes up to 255 and s8 values saturates its int16
    sums; vpmaddwd's int32 sums are exact."""
    sig = types.UniTuple(types.int32, 2)(w, types.intp, x, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        w_arr, w_off, x_arr, x_off, n = args
        wptr = context.make_array(signature.args[0])(context, builder, w_arr).data
        xptr = context.make_array(signature.args[2])(context, builder, x_arr).data
        _, mwd, red = _avx2_functions(builder)
        accs = [cgutils.alloca_once_value(builder, ir.Constant(_I32x8, None)) for _ in range(2)]
        i8x16 = ir.VectorType(ir.IntType(8), 16)
        width = builder.mul(n, ir.Constant(n.type, 16))
        with cgutils.for_range(builder, n) as loop:
            off = builder.mul(loop.index, ir.Constant(n.type, 16))
            woff = builder.add(w_off, off)
            _prefetch(builder, wptr, builder.add(woff, ir.Constant(n.type, SCREEN_PREFETCH)), L2)
            codes = builder.zext(builder.load(builder.bitcast(builder.gep(wptr, [woff]),
                                                              i8x16.as_pointer()), align=1),
                                 _I16x16)
            xo = builder.add(x_off, off)
            for j, acc in enumerate(accs):
                xv = builder.load(builder.bitcast(builder.gep(
                    xptr, [builder.add(xo, width) if j else xo]), _I16x16.as_pointer()), align=2)
                builder.store(builder.add(builder.load(acc), builder.call(mwd, [codes, xv])),
                              acc)
        out = [builder.call(red, [builder.load(a)]) for a in accs]
        return context.make_tuple(builder, signature.return_type, out)

    return sig, codegen


@njit(parallel=True, cache=True, nogil=True)
def screen_avx2(W, XQ16, scale, A, N, par, lo, hi, bmax):
    """:func:`screen_vnni` on AVX2 (:func:`_screen_dot_avx2`); ``XQ16`` is ``XQ`` as int16."""
    V, width = W.shape
    T = XQ16.shape[0]
    n = width // 16
    xflat = XQ16.reshape(-1)
    for b in prange(bmax.shape[0]):
        v1 = min(V, (b + 1) * SCREEN_BLOCK)
        for v in range(b * SCREEN_BLOCK, v1):
            for t in range(T):
                r = _screen_dot_avx2(W, v * width, xflat, t * 2 * width, n)
                _bounds(v, t, np.int64(r[0]), np.int64(r[1]), 1, 128, scale, A, N, par, lo, hi)
        _block_max(lo, hi, b * SCREEN_BLOCK, v1, bmax, b)


_I8x32 = ir.VectorType(ir.IntType(8), 32)


@intrinsic
def _screen_dot6_avx2(typingctx, w, w_off, x, x_off, n):
    """``(S1, S2)`` = the stored int6 codes ``u`` (:func:`..head.pack6`: n groups of 64 codes
    in 48 bytes) dotted with the int8 ``x[x_off ..]`` (q1) and ``x[x_off + width ..]`` (q2), on
    AVX2. A group's 32 nibble bytes give codes 0..31 (low nibbles) and 32..63 (high ones); its
    16 bytes of top bits, broadcast to both halves and shifted by 0 and 2 (4 and 6) per
    128-bit half, give their top two bits. vpmaddubsw (u <= 63 times s8: a pair at most
    16,002) sums the two halves' products into int16 without saturating (32,004), vpmaddwd
    widens them to int32."""
    sig = types.UniTuple(types.int32, 2)(w, types.intp, x, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        w_arr, w_off, x_arr, x_off, n = args
        wptr = context.make_array(signature.args[0])(context, builder, w_arr).data
        xptr = context.make_array(signature.args[2])(context, builder, x_arr).data
        mub, mwd, red = _avx2_functions(builder)
        accs = [cgutils.alloca_once_value(builder, ir.Constant(_I32x8, None)) for _ in range(2)]
        ones = ir.Constant(_I16x16, [1] * 16)
        width = builder.mul(n, ir.Constant(n.type, 64))

        def load(ptr, off, vt):
            return builder.load(builder.bitcast(builder.gep(ptr, [off]), vt.as_pointer()),
                                align=1)

        with cgutils.for_range(builder, n) as loop:
            woff = builder.add(w_off, builder.mul(loop.index, ir.Constant(n.type, 48)))
            _prefetch(builder, wptr, builder.add(woff, ir.Constant(n.type, SCREEN_PREFETCH)), L2)
            u_lo, u_hi = _unpack6_halves(builder, wptr, woff)
            xo = builder.add(x_off, builder.mul(loop.index, ir.Constant(n.type, 64)))
            for j, acc in enumerate(accs):
                xj = builder.add(xo, width) if j else xo
                q_lo = load(xptr, xj, _I8x32)
                q_hi = load(xptr, builder.add(xj, ir.Constant(n.type, 32)), _I8x32)
                pr = builder.add(builder.call(mub, [u_lo, q_lo]), builder.call(mub, [u_hi, q_hi]))
                builder.store(builder.add(builder.load(acc), builder.call(mwd, [pr, ones])), acc)
        out = [builder.call(red, [builder.load(a)]) for a in accs]
        return context.make_tuple(builder, signature.return_type, out)

    return sig, codegen


@njit(inline="always")
def _dot6(W, v, x1, x2, n):
    """``(S1, S2)`` of :func:`_screen_dot6_avx2` in plain numba."""
    s1 = np.int32(0)
    s2 = np.int32(0)
    for g in range(n):
        o = 48 * g
        b = 64 * g
        for a in range(32):
            byte = np.int32(W[v, o + a])
            tb = np.int32(W[v, o + 32 + (a & 15)])
            i = a >> 4
            ulo = (byte & 15) | (((tb >> (2 * i)) & 3) << 4)
            uhi = (byte >> 4) | (((tb >> (2 * i + 4)) & 3) << 4)
            s1 += ulo * np.int32(x1[b + a]) + uhi * np.int32(x1[b + 32 + a])
            s2 += ulo * np.int32(x2[b + a]) + uhi * np.int32(x2[b + 32 + a])
    return s1, s2


@njit(parallel=True, cache=True, nogil=True)
def screen6_avx2(W, XQ, scale, A, N, par, lo, hi, bmax, sums):
    """:func:`screen_vnni` for int6 codes (uint8 [V, 3 / 4 width], ``h + 32`` packed by
    :func:`..head.pack6`) on AVX2 (:func:`_screen_dot6_avx2`): 1/4 fewer bytes than int8 for
    a bound about four times as wide. Keeps each row's integer sums in ``sums`` int32 [T, V,
    2] for :func:`refine6`."""
    V, nbytes = W.shape
    T = XQ.shape[0]
    n = nbytes // 48
    width = 64 * n
    xflat = XQ.reshape(-1)
    for b in prange(bmax.shape[0]):
        v1 = min(V, (b + 1) * SCREEN_BLOCK)
        for v in range(b * SCREEN_BLOCK, v1):
            for t in range(T):
                r = _screen_dot6_avx2(W, v * nbytes, xflat, t * 2 * width, n)
                sums[t, v, 0], sums[t, v, 1] = r[0], r[1]
                _bounds(v, t, np.int64(r[0]), np.int64(r[1]), 8, 253, scale, A, N, par, lo,
                        hi)
        _block_max(lo, hi, b * SCREEN_BLOCK, v1, bmax, b)


@njit(parallel=True, cache=True, nogil=True)
def screen6_vnni(W, XQ, scale, A, N, par, lo, hi, bmax, sums):
    """:func:`screen6_avx2` on the vnni build: each 48-byte group unpacked into 64 codes in one
    zmm, one vpdpbusd per group, token and half of the split hidden state (as the int8 and int7
    screens); several tokens: two rows at a time, tokens in passes of :data:`SCREEN_GROUPS`.
    The same integers."""
    V, nbytes = W.shape
    T = XQ.shape[0]
    n = nbytes // 48
    width = 64 * n
    xflat = XQ.reshape(-1)
    for b in prange(bmax.shape[0]):
        v, v1 = b * SCREEN_BLOCK, min(V, (b + 1) * SCREEN_BLOCK)
        while v < v1:
            two = T > 1 and v + 1 < v1
            t0 = 0
            while t0 < T:
                w0, x0, nt = v * nbytes, t0 * 2 * width, _pass_tokens(T, t0, two)
                if nt == 4:
                    _keep(v, t0, _screen_dot6_4(W, w0, xflat, x0, n), 4, 2, 8, 253, scale, A, N,
                          par, lo, hi, sums)
                elif nt == 2:
                    _keep(v, t0, _screen_dot6_2(W, w0, xflat, x0, n), 2, 2, 8, 253, scale, A, N,
                          par, lo, hi, sums)
                elif two:
                    _keep(v, t0, _screen_dot6_1(W, w0, xflat, x0, n), 1, 2, 8, 253, scale, A, N,
                          par, lo, hi, sums)
                else:
                    _keep(v, t0, _screen_dot6(W, w0, xflat, x0, n), 1, 1, 8, 253, scale, A, N,
                          par, lo, hi, sums)
                t0 += nt
            v += 2 if two else 1
        _block_max(lo, hi, b * SCREEN_BLOCK, v1, bmax, b)


@njit(parallel=True, cache=True, nogil=True)
def screen6_portable(W, XQ, scale, A, N, par, lo, hi, bmax, sums):
    """:func:`screen6_avx2` in plain numba (the same integers)."""
    V, nbytes = W.shape
    T = XQ.shape[0]
    n = nbytes // 48
    for b in prange(bmax.shape[0]):
        v1 = min(V, (b + 1) * SCREEN_BLOCK)
        for v in range(b * SCREEN_BLOCK, v1):
            for t in range(T):
                r = _dot6(W, v, XQ[t, 0], XQ[t, 1], n)
                sums[t, v, 0], sums[t, v, 1] = r[0], r[1]
                _bounds(v, t, np.int64(r[0]), np.int64(r[1]), 8, 253, scale, A, N, par, lo,
                        hi)
        _block_max(lo, hi, b * SCREEN_BLOCK, v1, bmax, b)


@njit(parallel=True, cache=True, nogil=True)
def refine6(P, ids, XQ, sums, scale, A, N, par, lo, hi):
    """The int8 screen of rows ``ids`` of int6 tables (:func:`refine_vbmi7` for int6): the
    int8 codes are c = 4 h + b with b the 2-bit plane ``P`` (:func:`..head.pack2`), so ``c . q
    = 4 (S - 32 sum q) + B`` from the int6 screen's ``sums`` S (of h + 32)."""
    T = XQ.shape[0]
    nb = P.shape[1]
    for i in prange(ids.size):
        v = ids[i]
        for t in range(T):
            b1 = np.int32(0)
            b2 = np.int32(0)
            for j in range(nb):
                byte = np.int32(P[v, j])
                for m in range(4):
                    bb = (byte >> (2 * m)) & 3
                    b1 += bb * np.int32(XQ[t, 0, 4 * j + m])
                    b2 += bb * np.int32(XQ[t, 1, 4 * j + m])
            d1 = 4 * np.int64(sums[t, v, 0]) + np.int64(b1)
            d2 = 4 * np.int64(sums[t, v, 1]) + np.int64(b2)
            lo[t, i], hi[t, i] = _bound(t, d1, d2, 1, 128, 2.0 * scale[v], A[v], N[v], par)


@njit(parallel=True, cache=True, nogil=True)
def screen_portable(W, XQ, scale, A, N, par, lo, hi, bmax):
    """:func:`screen_vnni` in plain numba (the same integers)."""
    V, width = W.shape
    T = XQ.shape[0]
    for b in prange(bmax.shape[0]):
        v1 = min(V, (b + 1) * SCREEN_BLOCK)
        for v in range(b * SCREEN_BLOCK, v1):
            wr = W[v]
            for t in range(T):
                x1 = XQ[t, 0]
                x2 = XQ[t, 1]
                d1 = np.int32(0)
                d2 = np.int32(0)
                for k in range(width):
                    c = np.int32(wr[k])
                    d1 += c * np.int32(x1[k])
                    d2 += c * np.int32(x2[k])
                _bounds(v, t, np.int64(d1), np.int64(d2), 1, 128, scale, A, N, par, lo, hi)
        _block_max(lo, hi, b * SCREEN_BLOCK, v1, bmax, b)


@njit(cache=True, nogil=True)
def greedy_candidates(lo, hi, bmax):
    """:meth:`..head.Head._greedy_candidates` of float64 bounds ``lo``, ``hi`` [T, V]
    (float32 logits: no rounding) and their block maxima (a screen's ``bmax``): the rows,
    ascending, whose upper bound reaches some token's largest lower bound. Only the blocks
    whose largest upper bound reaches it are read."""
    T, V = lo.shape
    top = np.full(T, -np.inf)
    for b in range(bmax.shape[0]):
        for t in range(T):
            top[t] = max(top[t], bmax[b, 0, t])
    out = []
    for b in range(bmax.shape[0]):
        hit = False
        for t in range(T):
            hit = hit or bmax[b, 1, t] >= top[t]
        if not hit:
            continue
        for v in range(b * SCREEN_BLOCK, min(V, (b + 1) * SCREEN_BLOCK)):
            for t in range(T):
                if hi[t, v] >= top[t]:
                    out.append(v)
                    break
    ids = np.empty(len(out), np.int64)
    for i in range(len(out)):
        ids[i] = out[i]
    return ids
