"""``rans`` matrices on the cpu backend decoded inside the mat-vec (``decode="fused"``; the
default, ``decode="load"``, decodes them once into stfma rows:
:mod:`bitformat.codecs.rans_rows`).

A rans tensor (docs/formats/rans.md) stays what the container holds: its u32 words, memory-
mapped. :func:`rans_weight` parses the header once into small index arrays (stream offsets,
live rows and columns, row classes: a few bytes per row) and one 16 KB decode table per row
class, and the mat-vec kernels run the rANS decoder over every stream on each call, adding
``trit * q`` into an int32 per row as the symbols come out; no trit is ever stored. Streams
are independent, so row groups (the ``k`` rows of a stream, or the ``p`` pieces of one row)
run in parallel (``prange``), and each thread decodes ``LANES`` streams in lock-step, so that
their serial dependency chains overlap.

The coder, the kernel arrays of a tensor (:class:`~bitformat.codecs.rans_decode.RansWeight`)
and the one-lookup decode step are the codec's (:mod:`bitformat.codecs.rans_decode`); here the
step is fused with the accumulation and interleaved across streams.

Multiplying the symbol's five trits by five activations also takes one lookup when there is one
token: the activations of each run of five live columns are expanded once per call into a
table of all 243 dot products (int16, ``tab[sym, m]``, :func:`dot_table`), shared by the
matrices that read the same input. Several tokens (prefill) use the trits of ``sym`` instead.

Decoding is compute bound (a multiply-add chain and about 20 instructions per 5 trits: about
0.45 ns a trit on one thread here), so a rans matrix takes several times longer than a 2-bit
format even though it reads 25 % fewer bytes; that is the price of the storage container.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ...codecs.rans_decode import _JIT, LANES, RansWeight, _start, _step


# -- activations --------------------------------------------------------------------------------
def live_activations(q: np.ndarray, w: RansWeight) -> np.ndarray:
    """int8 ``[T, n_sym * group]``: q at the live columns, zero-padded to whole symbols."""
    out = np.zeros((q.shape[0], w.n_sym * w.group), np.int8)
    out[:, :w.n_live_cols] = q[:, w.lcols] if w.lcols.size else q
    return out


def token_table(w: RansWeight, q: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """:func:`dot_table` of one token's activations ``q`` (int8 [cols]) for ``w``, in the
    front of ``scratch`` (flat int16, at least ``243 * w.n_sym`` long)."""
    rows = 243 if w.group == 5 else 3
    tab = scratch[:rows * w.n_sym].reshape(rows, w.n_sym)
    dot_table(q, w.lcols, w.n_live_cols, w.group, tab)
    return tab


@njit(**_JIT)
def dot_table(q, lcols, n_live, group, tab):
    """``tab[sym, m]`` (int16) = sum over the symbol's trits of ``trit * x[group * m + d]``.

    ``x`` is ``q`` at the live columns ``lcols`` (all columns when it is empty), zero past
    ``n_live``. group 5: sym = 81 c0 + 27 c1 + 9 c2 + 3 c3 + c4 with c = trit + 1, built as
    the sum of a (c0, c1, c2) part and a (c3, c4) part, each loop contiguous over m; group 1:
    sym = c0.
    """
    n = tab.shape[1]
    if group == 1:
        for m in range(n):
            v = np.int16(q[lcols[m]] if lcols.size else q[m])
            tab[0, m], tab[1, m], tab[2, m] = -v, 0, v
        return
    x = np.zeros((5, n), np.int16)  # x[d, m]: the live activation at column 5m + d
    full = n_live // 5
    for m in range(full):
        for d in range(5):
            x[d, m] = q[lcols[5 * m + d]] if lcols.size else q[5 * m + d]
    for c in range(5 * full, n_live):
        x[c - 5 * full, full] = q[lcols[c]] if lcols.size else q[c]
    hi = np.empty((27, n), np.int16)
    lo = np.empty((9, n), np.int16)
    for h in range(27):  # (c0, c1, c2)
        a, b, c = np.int16(h // 9 - 1), np.int16(h // 3 % 3 - 1), np.int16(h % 3 - 1)
        x0, x1, x2, out = x[0], x[1], x[2], hi[h]
        for m in range(n):
            out[m] = np.int16(np.int16(a * x0[m]) + np.int16(b * x1[m]) + np.int16(c * x2[m]))
    for h in range(9):  # (c3, c4)
        a, b = np.int16(h // 3 - 1), np.int16(h % 3 - 1)
        x3, x4, out = x[3], x[4], lo[h]
        for m in range(n):
            out[m] = np.int16(np.int16(a * x3[m]) + np.int16(b * x4[m]))
    for h in range(27):
        for el in range(9):
            hh, ll, out = hi[h], lo[el], tab[9 * h + el]
            for m in range(n):
                out[m] = np.int16(hh[m] + ll[m])


# -- kernels ------------------------------------------------------------------------------------
#: Up to this many tokens, each token decodes the matrix again with its own dot table (about
#: 0.45 ns a trit and token); more share one decode per row and dot a row buffer (measured
#: 2.6 ns a trit for 3 tokens, 4.3 for 64, on one thread).
MV_TOKENS = 4


@intrinsic
def _prefetch_span(typingctx, a, start, stop):
    """Hint every cache line of the 1-D array slice ``a[start:stop]`` into L2 (prefetcht1)."""
    sig = types.void(a, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        size = ir.Constant(args[1].type, context.get_abi_sizeof(
            context.get_data_type(signature.args[0].dtype)))
        base = builder.bitcast(ary.data, ir.IntType(8).as_pointer())
        lo, hi = builder.mul(args[1], size), builder.mul(args[2], size)
        line = ir.Constant(lo.type, 64)
        n = builder.sdiv(builder.add(builder.sub(hi, lo), ir.Constant(lo.type, 63)), line)
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
            ir.VoidType(), [base.type, i32, i32, i32]), "llvm.prefetch")
        with cgutils.for_range(builder, n) as loop:
            ptr = builder.gep(base, [builder.add(lo, builder.mul(loop.index, line))])
            builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 2), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


@njit(**_JIT)
def _prefetch_rows(a, ids, i0, i1):
    """Hint rows ``a[ids[i]]`` for i0 <= i < i1 into L2 (:func:`_prefetch_span`): rows far
    apart each start with a TLB miss, and issuing them together overlaps those."""
    for i in range(i0, i1):
        _prefetch_span(a[ids[i]], 0, a.shape[1])


@njit(**_JIT)
def _lanes(words, word_off, lrows, k, p, m0, cls, dec, tab, s, ws, out, g0):
    """LANES full row groups g0.. at once: the same rows and pieces, so lock-step.

    Their streams are contiguous words; those of the next LANES groups are prefetched first
    (streams of a few hundred words are too short for the hardware prefetcher).
    """
    n_streams = word_off.shape[0] - 1
    _prefetch_span(words, word_off[min(n_streams, (g0 + LANES) * p)],
                   word_off[min(n_streams, (g0 + 2 * LANES) * p)])
    for ri in range(k):
        r = g0 * k + ri
        d0, d1, d2, d3 = dec[cls[r]], dec[cls[r + k]], dec[cls[r + 2 * k]], dec[cls[r + 3 * k]]
        d4, d5 = dec[cls[r + 4 * k]], dec[cls[r + 5 * k]]
        d6, d7 = dec[cls[r + 6 * k]], dec[cls[r + 7 * k]]
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.int32(0)
        for j in range(p):
            if ri == 0:  # p > 1 means k == 1: every piece is a stream of its own
                i = g0 * p + j
                s0, p0, l0 = _start(words, word_off, i)
                s1, p1, l1 = _start(words, word_off, i + p)
                s2, p2, l2 = _start(words, word_off, i + 2 * p)
                s3, p3, l3 = _start(words, word_off, i + 3 * p)
                s4, p4, l4 = _start(words, word_off, i + 4 * p)
                s5, p5, l5 = _start(words, word_off, i + 5 * p)
                s6, p6, l6 = _start(words, word_off, i + 6 * p)
                s7, p7, l7 = _start(words, word_off, i + 7 * p)
            for mi in range(m0[j], m0[j + 1]):
                m = np.uintp(mi)
                x0, s0, p0 = _step(s0, p0, l0, words, d0)
                x1, s1, p1 = _step(s1, p1, l1, words, d1)
                x2, s2, p2 = _step(s2, p2, l2, words, d2)
                x3, s3, p3 = _step(s3, p3, l3, words, d3)
                x4, s4, p4 = _step(s4, p4, l4, words, d4)
                x5, s5, p5 = _step(s5, p5, l5, words, d5)
                x6, s6, p6 = _step(s6, p6, l6, words, d6)
                x7, s7, p7 = _step(s7, p7, l7, words, d7)
                a0 += np.int32(tab[x0, m])
                a1 += np.int32(tab[x1, m])
                a2 += np.int32(tab[x2, m])
                a3 += np.int32(tab[x3, m])
                a4 += np.int32(tab[x4, m])
                a5 += np.int32(tab[x5, m])
                a6 += np.int32(tab[x6, m])
                a7 += np.int32(tab[x7, m])
        out[0, lrows[r]] = np.float32(a0) * ws / s[0]
        out[0, lrows[r + k]] = np.float32(a1) * ws / s[0]
        out[0, lrows[r + 2 * k]] = np.float32(a2) * ws / s[0]
        out[0, lrows[r + 3 * k]] = np.float32(a3) * ws / s[0]
        out[0, lrows[r + 4 * k]] = np.float32(a4) * ws / s[0]
        out[0, lrows[r + 5 * k]] = np.float32(a5) * ws / s[0]
        out[0, lrows[r + 6 * k]] = np.float32(a6) * ws / s[0]
        out[0, lrows[r + 7 * k]] = np.float32(a7) * ws / s[0]


@njit(**_JIT)
def _one(words, word_off, lrows, k, p, m0, cls, dec, tab, s, ws, out, g):
    """Row group g alone (the groups left over from the lock-step blocks)."""
    r1 = min(lrows.shape[0], g * k + k)
    for r in range(g * k, r1):
        d = dec[cls[r]]
        acc = np.int32(0)
        for j in range(p):
            if r == g * k:
                st, pos, lo = _start(words, word_off, g * p + j)
            for mi in range(m0[j], m0[j + 1]):
                x, st, pos = _step(st, pos, lo, words, d)
                acc += np.int32(tab[x, np.uintp(mi)])
        out[0, lrows[r]] = np.float32(acc) * ws / s[0]


@njit(parallel=True, **_JIT)
def rans_mv(words, word_off, lrows, k, p, m0, cls, dec, tab, s, ws, out):
    """One token: ``out[0, row] = float32(sum trit * q) * ws / s[0]`` for every live row.

    ``tab`` is :func:`dot_table` of the token's live activations; dead rows are left as they
    are (the caller zeroes ``out``).
    """
    n_live = lrows.shape[0]
    n_groups = (n_live + k - 1) // k
    blocks = (n_live // k) // LANES  # lock-step blocks of full row groups
    rest = n_groups - blocks * LANES
    for b in prange(blocks + rest):
        if b < blocks:
            _lanes(words, word_off, lrows, k, p, m0, cls, dec, tab, s, ws, out, b * LANES)
        else:
            _one(words, word_off, lrows, k, p, m0, cls, dec, tab, s, ws, out,
                 blocks * LANES + b - blocks)


@njit(**_JIT)
def _dot8(a, B, t, n):
    """int32 sum of a[m] * B[t, m] over m < n (kept in 32-bit lanes so LLVM vectorizes it)."""
    acc = np.int32(0)
    for m in range(n):
        acc = np.int32(acc + np.int32(a[m]) * np.int32(B[t, m]))
    return acc


@njit(parallel=True, **_JIT)
def rans_mm(words, word_off, lrows, k, p, m0, cls, dec, digits, XL, s, ws, out):
    """Several tokens (prefill): each live row's trits are decoded into a local buffer of
    that one row (6.9 KB at most in 2B-4T, in L1), which every token's activations ``XL``
    (int8 ``[T, n_sym * group]``, live columns, zero-padded) are dotted with; ``digits[sym]``
    are a symbol's trits."""
    n_live = lrows.shape[0]
    group = digits.shape[1]
    n = XL.shape[1]
    for g in prange((n_live + k - 1) // k):
        row = np.zeros(n, np.int8)
        for r in range(g * k, min(n_live, g * k + k)):
            d = dec[cls[r]]
            for j in range(p):
                if r == g * k:
                    st, pos, lo = _start(words, word_off, g * p + j)
                for m in range(m0[j], m0[j + 1]):
                    x, st, pos = _step(st, pos, lo, words, d)
                    for c in range(group):
                        row[m * group + c] = digits[x, c]
            for t in range(XL.shape[0]):
                out[t, lrows[r]] = np.float32(_dot8(row, XL, t, n)) * ws / s[t]
