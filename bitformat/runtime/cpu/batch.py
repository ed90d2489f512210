"""Kernels for a few tokens at once (a batched decode step: one row per request).

One token streams every weight from memory once and is memory-bound; with 2-8 tokens the same
bytes serve every token, and the work per byte grows with them until the step is
compute-bound. These kernels do the per-byte work once per byte instead of once per token:

- :func:`mm2_vnni_tokens` (i2_s, stfma; KIND_I2S and KIND_LOW): each 64-byte chunk of two
  rows is loaded once, its four slots are shifted down into codes once (``vpsrlw`` on 16-bit
  lanes, then a byte mask), and every token adds ``code * x`` with vpdpbusd into an
  accumulator of its own (up to 8 tokens x 2 rows = 16 zmm accumulators). The prompt kernel
  (:func:`.kernels.mm2_vnni_prompt`) masks the codes again for each token.
- :func:`lm_head_tokens` (f16 and bf16 embeddings): each group of 16 values of four
  embedding rows is converted to float32 once and meets every token's hidden state, and each
  group of a token's values meets the four rows (the single-token head converts a row again
  for every token, and reads every token's hidden state again for every row).

Integer sums are exact, so the ternary outputs equal the other kernels' bit for bit. The head
sums in float32: its order per token is fixed by this code alone (one FMA accumulator over
the row, then a fixed halving tree across lanes), the same for 1 or 8 tokens, so the cpu
backend runs every head call here and a row's logits do not depend on the batch.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .head import _bf16_bits, _f16_bits
from .kernels import (
    KIND_I2S,
    PREFETCH,
    _chunk_loop,
    _dot2_vnni,
    _prefetch,
    _vnni_functions,
)
from .rans import _prefetch_rows

#: tokens per pass of the kernels (a step of more tokens takes several passes per row)
GROUPS = (8, 4, 2, 1)
_I32x16 = ir.VectorType(ir.IntType(32), 16)
_I16x32 = ir.VectorType(ir.IntType(16), 32)
_I8x64 = ir.VectorType(ir.IntType(8), 64)


def _make_dot_tokens(shifts: tuple[int, ...], nrows: int, ntok: int):
    """Intrinsic ``dot(W, w_off, w_stride, xg, x_off, x_stride, t_stride, n)`` -> ``nrows *
    ntok`` int32 (row-major): rows ``w_off + k * w_stride`` against tokens whose slot g of
    chunk i is ``xg[x_off + t * t_stride + g * x_stride + 64 i : +64]``, over rows of n bytes
    (the last chunk partial where it must be: :func:`.kernels._chunk_loop`)."""

    @intrinsic
    def dot(typingctx, w, w_off, w_stride, xg, x_off, x_stride, t_stride, n):
        sig = types.UniTuple(types.int32, nrows * ntok)(
            w, types.intp, types.intp, xg, types.intp, types.intp, types.intp, types.intp)

        def codegen(context, builder, signature, args):
            w_arr, w_off, w_stride, x_arr, x_off, x_stride, t_stride, n = args
            wptr = context.make_array(signature.args[0])(context, builder, w_arr).data
            xptr = context.make_array(signature.args[3])(context, builder, x_arr).data
            vp, red = _vnni_functions(builder)
            accs = [cgutils.alloca_once_value(builder, ir.Constant(_I32x16, None))
                    for _ in range(nrows * ntok)]
            three = ir.Constant(_I8x64, [3] * 64)

            def c(v):
                return ir.Constant(n.type, v)

            def chunk(i64, load, prefetch):
                codes = []  # [row][slot], u8 codes as <16 x i32> for vpdpbusd
                for k in range(nrows):
                    woff = builder.add(builder.add(w_off, builder.mul(w_stride, c(k))), i64)
                    wv = load(wptr, woff)
                    if prefetch:
                        _prefetch(builder, wptr, builder.add(woff, c(PREFETCH)))
                    row = []
                    for s in shifts:
                        v = wv
                        if s:
                            v = builder.bitcast(builder.lshr(builder.bitcast(v, _I16x32),
                                                             ir.Constant(_I16x32, [s] * 32)),
                                                _I8x64)
                        row.append(builder.bitcast(builder.and_(v, three), _I32x16))
                    codes.append(row)
                for t in range(ntok):
                    base = builder.add(builder.add(x_off, builder.mul(t_stride, c(t))), i64)
                    for g in range(len(shifts)):
                        xv = builder.bitcast(load(xptr, builder.add(
                            base, builder.mul(x_stride, c(g)))), _I32x16)
                        for k in range(nrows):
                            acc = accs[k * ntok + t]
                            builder.store(builder.call(vp, [builder.load(acc), codes[k][g],
                                                            xv]), acc)

            _chunk_loop(builder, n, chunk)
            out = [builder.call(red, [builder.load(a)]) for a in accs]
            return context.make_tuple(builder, signature.return_type, out)

        return sig, codegen

    return dot


# Codes at shifts 0, 2, 4, 6 are slots 0..3 (stfma, KIND_LOW) or slots 3..0 (i2_s): i2_s
# reads its activation slots backwards (a start at slot 3 and a negative slot stride).
_dot8, _dot4, _dot2, _dot1 = (_make_dot_tokens((0, 2, 4, 6), 2, t) for t in GROUPS)


@njit(inline="always")
def _pair(W, r, XG, t0, nt, kind, d):
    """int32 dots of rows r, r+1 with tokens t0.. (nt of them, a GROUPS size) into d[2, 8]."""
    bpr = W.shape[1]
    ts, n, w0 = 4 * bpr, bpr, r * bpr
    x0, xs = (t0 * ts + 3 * bpr, -bpr) if kind == KIND_I2S else (t0 * ts, bpr)
    if nt == 8:
        v8 = _dot8(W, w0, bpr, XG, x0, xs, ts, n)
        for i in range(16):
            d[i // 8, i % 8] = v8[i]
    elif nt == 4:
        v4 = _dot4(W, w0, bpr, XG, x0, xs, ts, n)
        for i in range(8):
            d[i // 4, i % 4] = v4[i]
    elif nt == 2:
        v2 = _dot2(W, w0, bpr, XG, x0, xs, ts, n)
        for i in range(4):
            d[i // 2, i % 2] = v2[i]
    else:
        v1 = _dot1(W, w0, bpr, XG, x0, xs, ts, n)
        d[0, 0], d[1, 0] = v1[0], v1[1]


@njit(inline="always")
def pair_tokens(W, r, XG, corr, s, ws, kind, out, d):
    """Rows r, r+1 of ``W`` (row r alone where it is the last) against every token of ``XG``,
    tokens in passes of 8, 4, 2 and 1: ``out[t, r + k] = float32(dot - corr[t]) * ws[r + k] /
    s[t]`` (``d`` int32 [2, 8] scratch)."""
    T = out.shape[0]
    if r + 1 == W.shape[0]:
        for t in range(T):
            out[t, r] = np.float32(_dot2_vnni(W[r], XG, t, kind) - corr[t]) * ws[r] / s[t]
        return
    t0 = 0
    while t0 < T:
        nt = 8 if T - t0 >= 8 else 4 if T - t0 >= 4 else 2 if T - t0 >= 2 else 1
        _pair(W, r, XG, t0, nt, kind, d)
        for k in range(2):
            for j in range(nt):
                t = t0 + j
                out[t, r + k] = np.float32(d[k, j] - corr[t]) * ws[r + k] / s[t]
        t0 += nt


@njit(parallel=True, cache=True, nogil=True)
def mm2_vnni_tokens(W, XG, corr, s, ws, kind, out):
    """:func:`.kernels.mm2_vnni` for 2..8 tokens (KIND_I2S, KIND_LOW): two rows at a time, the
    tokens in passes of 8, 4, 2 and 1 (module docstring). Same results to the bit."""
    for p in prange((W.shape[0] + 1) // 2):
        pair_tokens(W, 2 * p, XG, corr, s, ws, kind, out, np.empty((2, 8), np.int32))


# -- LM head --------------------------------------------------------------------------------------
def _make_head_tokens(bf16: bool, nrows: int, ntok: int):
    """Intrinsic ``dot(e, e_off, e_stride, x, x_off, x_stride, n)`` -> ``nrows * ntok``
    float32 (row-major): 16-bit floats (IEEE halves or bfloat16) of rows ``e_off + k *
    e_stride`` times float32 tokens ``x[x_off + t * x_stride + 16 i : +16]`` over n chunks of
    16. Each (row, token) has one <16 x float> FMA accumulator, summed at the end by a fixed
    halving tree: the same order for every ``nrows`` and ``ntok``. A chunk of 16 values is
    converted once for all tokens, and a chunk of a token once for all rows (the tokens' hidden
    states do not fit L1 beside the rows: this cuts their traffic from L2 by ``nrows``)."""

    @intrinsic
    def dot(typingctx, e, e_off, e_stride, x, x_off, x_stride, n):
        sig = types.UniTuple(types.float32, nrows * ntok)(
            e, types.intp, types.intp, x, types.intp, types.intp, types.intp)

        def codegen(context, builder, signature, args):
            e_arr, e_off, e_stride, x_arr, x_off, x_stride, n = args
            eptr = context.make_array(signature.args[0])(context, builder, e_arr).data
            xptr = context.make_array(signature.args[3])(context, builder, x_arr).data
            f32, i16, i32 = ir.FloatType(), ir.IntType(16), ir.IntType(32)
            vf, vi = ir.VectorType(f32, 16), ir.VectorType(i16, 16)
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf] * 3),
                                                 "llvm.fma.v16f32")
            accs = [cgutils.alloca_once_value(builder, ir.Constant(vf, None))
                    for _ in range(nrows * ntok)]
            ebytes = builder.bitcast(eptr, ir.IntType(8).as_pointer())

            def c(v):
                return ir.Constant(n.type, v)

            with cgutils.for_range(builder, n) as loop:
                base = builder.mul(loop.index, c(16))
                vals = []
                for k in range(nrows):
                    at = builder.add(builder.add(e_off, builder.mul(e_stride, c(k))), base)
                    _prefetch(builder, ebytes, builder.add(builder.mul(at, c(2)), c(2048)))
                    h = builder.load(builder.bitcast(builder.gep(eptr, [at]), vi.as_pointer()),
                                     align=2)
                    if bf16:
                        w = builder.shl(builder.zext(h, ir.VectorType(i32, 16)),
                                        ir.Constant(ir.VectorType(i32, 16), [16] * 16))
                        vals.append(builder.bitcast(w, vf))
                    else:
                        vals.append(builder.fpext(builder.bitcast(
                            h, ir.VectorType(ir.HalfType(), 16)), vf))
                for t in range(ntok):
                    xv = builder.load(builder.bitcast(builder.gep(xptr, [builder.add(
                        builder.add(x_off, builder.mul(x_stride, c(t))), base)]),
                        vf.as_pointer()), align=4)
                    for k in range(nrows):
                        acc = accs[k * ntok + t]
                        builder.store(builder.call(fma, [vals[k], xv, builder.load(acc)]), acc)
            out = []
            for acc in accs:
                v = builder.load(acc)
                width = 16
                while width > 1:  # lanes [0, w/2) + [w/2, w): a fixed order
                    width //= 2
                    lo = builder.shuffle_vector(v, v, ir.Constant(
                        ir.VectorType(i32, width), list(range(width))))
                    hi = builder.shuffle_vector(v, v, ir.Constant(
                        ir.VectorType(i32, width), list(range(width, 2 * width))))
                    v = builder.fadd(lo, hi)
                out.append(builder.extract_element(v, ir.Constant(i32, 0)))
            return context.make_tuple(builder, signature.return_type, out)

        return sig, codegen

    return dot


#: (rows, tokens) per pass of the head: up to 16 accumulators, the rest of the zmm registers
#: for the converted rows and a token's chunk. One token reads a row at a time (one stream
#: per thread: four streams were 10-20 % slower); 8 tokens run as two passes of four (one
#: pass of 2 rows x 8 tokens took twice as long: all 8 hidden states, 80 KB, come from L2
#: for every two rows).
_HEAD = ((4, 4), (4, 2), (1, 1))
_f16_4x4, _f16_4x2, _f16_1x1 = (_make_head_tokens(False, r, t) for r, t in _HEAD)
_bf16_4x4, _bf16_4x2, _bf16_1x1 = (_make_head_tokens(True, r, t) for r, t in _HEAD)


@njit(inline="always")
def _head4(E, v, X, t0, nt, bf16, out):
    """Rows v..v+3 against tokens t0.. (nt: 4, 2 or 1 of them)."""
    h = E.shape[1]
    n, x0, e0 = h // 16, t0 * h, v * h
    if nt == 4:
        r4 = _bf16_4x4(E, e0, h, X, x0, h, n) if bf16 else _f16_4x4(E, e0, h, X, x0, h, n)
        for i in range(16):
            out[t0 + i % 4, v + i // 4] = r4[i]
    elif nt == 2:
        r2 = _bf16_4x2(E, e0, h, X, x0, h, n) if bf16 else _f16_4x2(E, e0, h, X, x0, h, n)
        for i in range(8):
            out[t0 + i % 2, v + i // 2] = r2[i]
    else:
        for i in range(4):
            e1 = e0 + i * h
            r1 = _bf16_1x1(E, e1, h, X, x0, h, n) if bf16 else _f16_1x1(E, e1, h, X, x0, h, n)
            out[t0, v + i] = r1[0]


@njit(parallel=True, cache=True, nogil=True)
def lm_head_tokens(E, X, bf16, out):
    """``out[t, v] = E[v] . X[t]`` for uint16 rows ``E`` [V, H] (f16, or bf16 when ``bf16``)
    and float32 ``X`` [T, H], any T: groups of four vocabulary rows split among threads,
    tokens in passes of 4, 2, 1. A tail of H % 16 values is added per token after the
    vector part; the V % 4 last rows run one row and one token at a time."""
    V, h = E.shape
    T = X.shape[0]
    tail = h // 16 * 16
    for g in prange(V // 4):
        t0 = 0
        while t0 < T:
            nt = 4 if T - t0 >= 4 else 2 if T - t0 >= 2 else 1
            _head4(E, 4 * g, X, t0, nt, bf16, out)
            t0 += nt
    for v in range(V // 4 * 4, V):
        for t in range(T):
            r = (_bf16_1x1(E, v * h, h, X, t * h, h, h // 16) if bf16
                 else _f16_1x1(E, v * h, h, X, t * h, h, h // 16))
            out[t, v] = r[0]
    if tail < h:
        for v in prange(V):
            for t in range(T):
                acc = out[t, v]
                for k in range(tail, h):
                    acc += (_bf16_bits(E[v, k]) if bf16 else _f16_bits(E[v, k])) * X[t, k]
                out[t, v] = acc


#: :func:`lm_head_rows` hints its first rows into L2 before the threads start, and each share
#: of ``ROWS_BURST`` rows its own: rows far apart each start with a TLB miss (on this KVM
#: guest ~10 us for a cold 5 KB row), and issuing them together overlaps those (30 cold rows
#: of 2B-4T's head after a decode step: 0.26-0.31 -> 0.14-0.16 ms)
ROWS_AHEAD = 64
ROWS_BURST = 16


@njit(parallel=True, cache=True, nogil=True)
def lm_head_rows(E, ids, X, bf16, out):
    """:func:`lm_head_tokens`' logits of the rows ``ids`` only, read where they lie (no
    gathered copy): ``out[t, i] = E[ids[i]] . X[t]``, each row's sum in that kernel's order
    (one FMA chain per lane, the same tree, then the H % 16 tail), so the same bits."""
    h = E.shape[1]
    T = X.shape[0]
    n = h // 16
    tail = n * 16
    _prefetch_rows(E, ids, 0, min(ids.size, ROWS_AHEAD))
    for c in prange((ids.size + ROWS_BURST - 1) // ROWS_BURST):
        i1 = min(ids.size, (c + 1) * ROWS_BURST)
        _prefetch_rows(E, ids, max(c * ROWS_BURST, ROWS_AHEAD), i1)
        for i in range(c * ROWS_BURST, i1):
            v = ids[i]
            for t in range(T):
                r = (_bf16_1x1(E, v * h, h, X, t * h, h, n) if bf16
                     else _f16_1x1(E, v * h, h, X, t * h, h, n))
                acc = r[0]
                for k in range(tail, h):
                    acc += (_bf16_bits(E[v, k]) if bf16 else _f16_bits(E[v, k])) * X[t, k]
                out[t, i] = acc
