"""The LM head on the ``cpu`` backend: the tied embedding (f16, bf16 or f32 rows) times float32
hidden states, one dot product per vocabulary row, rows split among threads.

The vnni build converts 32 halves per step with vcvtph2ps (``fpext`` on <16 x half>) into two
zmm FMA accumulators; its summation order is fixed by the code, so the same row gives the same
bits on every call. The intrinsics live here, beside the only kernels that use them (numba's
on-disk cache tracks a kernel's own file; see :mod:`.kernels`).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .kernels import _prefetch


@intrinsic
def _f16_bits(typingctx, h):
    """float32 from the bits of an IEEE half (uint16): fpext, vcvtph2ps once vectorized."""
    sig = types.float32(h)

    def codegen(context, builder, signature, args):
        half = builder.bitcast(builder.trunc(args[0], ir.IntType(16)), ir.HalfType())
        return builder.fpext(half, ir.FloatType())

    return sig, codegen


#: Bytes ahead of the embedding row being read that the LM head prefetches (measured on the
#: 656 MB 2B-4T head, 2 threads: 1024-2048 gave 28-29 GB/s against 26 GB/s without).
HEAD_PREFETCH = 2048


def _make_half_dot(bf16: bool):
    """Intrinsic ``dot(e, e_off, x, x_off, n) -> float32`` over n chunks of 32 halves.

    Chunk i: 16-bit floats ``e[e_off + 32i : +32]`` (IEEE halves: ``fpext``, vcvtph2ps; or
    bfloat16: shifted into the high half of a float32) times float32 ``x[x_off + 32i : +32]``,
    in two <16 x float> accumulators (zmm registers; LLVM's own vectorizer stops at 256 bits
    on this CPU), prefetching ``HEAD_PREFETCH`` bytes ahead. The sum is reassociated.
    """

    @intrinsic
    def dot(typingctx, e, e_off, x, x_off, n):
        sig = types.float32(e, types.intp, x, types.intp, types.intp)

        def codegen(context, builder, signature, args):
            e_arr, e_off, x_arr, x_off, n = args
            eptr = context.make_array(signature.args[0])(context, builder, e_arr).data
            xptr = context.make_array(signature.args[2])(context, builder, x_arr).data
            f32, i16 = ir.FloatType(), ir.IntType(16)
            vf, vi = ir.VectorType(f32, 16), ir.VectorType(i16, 16)
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf] * 3),
                                                 "llvm.fma.v16f32")
            red = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
                f32, [f32, vf]), "llvm.vector.reduce.fadd.v16f32")
            accs = [cgutils.alloca_once_value(builder, ir.Constant(vf, None)) for _ in range(2)]
            ebytes = builder.bitcast(eptr, ir.IntType(8).as_pointer())

            def const(v):
                return ir.Constant(n.type, v)

            with cgutils.for_range(builder, n) as loop:
                base = builder.mul(loop.index, const(32))
                _prefetch(builder, ebytes, builder.add(builder.mul(builder.add(e_off, base),
                                                                   const(2)),
                                                       const(HEAD_PREFETCH)))
                for a, acc in enumerate(accs):
                    i = builder.add(base, const(16 * a))
                    h = builder.load(builder.bitcast(builder.gep(eptr, [builder.add(e_off, i)]),
                                                     vi.as_pointer()), align=2)
                    if bf16:
                        w = builder.shl(builder.zext(h, ir.VectorType(ir.IntType(32), 16)),
                                        ir.Constant(ir.VectorType(ir.IntType(32), 16), [16] * 16))
                        v = builder.bitcast(w, vf)
                    else:
                        v = builder.fpext(builder.bitcast(h, ir.VectorType(ir.HalfType(), 16)), vf)
                    xv = builder.load(builder.bitcast(builder.gep(xptr, [builder.add(x_off, i)]),
                                                      vf.as_pointer()), align=4)
                    builder.store(builder.call(fma, [v, xv, builder.load(acc)]), acc)
            total = builder.fadd(builder.load(accs[0]), builder.load(accs[1]))
            return builder.call(red, [ir.Constant(f32, 0.0), total], fastmath=("reassoc",))

        return sig, codegen

    return dot


_f16_dot = _make_half_dot(bf16=False)
_bf16_dot = _make_half_dot(bf16=True)


@intrinsic
def _bf16_bits(typingctx, h):
    """float32 from the bits of a bfloat16 (uint16): the high half of the float32."""
    sig = types.float32(h)

    def codegen(context, builder, signature, args):
        wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32),
                                                                                16))
        return builder.bitcast(wide, ir.FloatType())

    return sig, codegen


# -- LM head: 16-bit or f32 embedding rows times float32 activations -------------------------------
@njit(parallel=True, cache=True, fastmath=True)
def lm_head_f32(E, X, out):
    for v in prange(E.shape[0]):
        er = E[v]
        for t in range(X.shape[0]):
            xt = X[t]
            acc = np.float32(0.0)
            for k in range(er.shape[0]):
                acc += er[k] * xt[k]
            out[t, v] = acc


@njit(parallel=True, cache=True, fastmath=True)
def lm_head_lut(E, lut, X, out):
    """E uint16 [V, H]; ``lut`` float32[65536] maps the 16 bits to their value (f16 or bf16)."""
    for v in prange(E.shape[0]):
        er = E[v]
        for t in range(X.shape[0]):
            xt = X[t]
            acc = np.float32(0.0)
            for k in range(er.shape[0]):
                acc += lut[er[k]] * xt[k]
            out[t, v] = acc


@njit(parallel=True, cache=True, fastmath=True)
def lm_head_f16(E, X, out):
    """E uint16 [V, H] holding IEEE halves (C-contiguous, as X): vcvtph2ps + FMA per row
    (:func:`_make_half_dot`: zmm registers with AVX-512, pairs of ymm on the avx2 build), f32
    accumulation, rows split among threads."""
    h = E.shape[1]
    n = h // 32
    for v in prange(E.shape[0]):
        er = E[v]
        for t in range(X.shape[0]):
            acc = _f16_dot(er, 0, X, t * h, n)
            for k in range(n * 32, h):
                acc += _f16_bits(er[k]) * X[t, k]
            out[t, v] = acc


@njit(parallel=True, cache=True, fastmath=True)
def lm_head_bf16(E, X, out):
    h = E.shape[1]
    n = h // 32
    for v in prange(E.shape[0]):
        er = E[v]
        for t in range(X.shape[0]):
            acc = _bf16_dot(er, 0, X, t * h, n)
            for k in range(n * 32, h):
                acc += _bf16_bits(er[k]) * X[t, k]
            out[t, v] = acc


def lut16(kind: str) -> np.ndarray:
    """float32[65536]: the value of every 16-bit pattern as an IEEE half or a bfloat16."""
    bits = np.arange(65536, dtype=np.uint32)
    if kind == "F16":
        return bits.astype(np.uint16).view(np.float16).astype(np.float32)
    return (bits << 16).view(np.float32)


@njit(inline="always")
def _q2_byte(w, q, x):
    """Sum of the four q2_0 codes of byte ``w`` (minus 1) times ``q[x..x+3]``."""
    return (((w & 3) - 1) * np.int32(q[x]) + (((w >> 2) & 3) - 1) * np.int32(q[x + 1])
            + (((w >> 4) & 3) - 1) * np.int32(q[x + 2])
            + (((w >> 6) & 3) - 1) * np.int32(q[x + 3]))


@njit(parallel=True, cache=True)
def lm_head_q2_0(E, lut, Q, D, out):
    """A ternary q2_0 head (Ternary Bonsai) as llama.cpp computes it: ``E`` uint8 rows of
    18-byte blocks (f16 d, qs[16]: element 4m + g at bits 2g of byte m), ``Q`` int8 Q8_0
    activations [T, dim] and ``D`` their f16 scales as float32 [T, dim / 32]
    (:func:`..backend.q8_0_activations`), ``lut`` float32[65536] of every f16 pattern.
    out[t, r] = sum_b d_b * (D[t, 2b] * isum_2b + D[t, 2b + 1] * isum_2b+1), float32, block
    after block: the order of :func:`..backend.q2_0_logits` (no fastmath: the same bits)."""
    nb = E.shape[1] // 18
    for r in prange(E.shape[0]):
        er = E[r]
        for t in range(Q.shape[0]):
            qt = Q[t]
            acc = np.float32(0.0)
            for b in range(nb):
                o = b * 18 + 2
                s0 = np.int32(0)
                s1 = np.int32(0)
                for m in range(8):
                    s0 += _q2_byte(np.int32(er[o + m]), qt, 64 * b + 4 * m)
                    s1 += _q2_byte(np.int32(er[o + 8 + m]), qt, 64 * b + 32 + 4 * m)
                f = (np.float32(np.float32(s0) * D[t, 2 * b])
                     + np.float32(np.float32(s1) * D[t, 2 * b + 1]))
                h = np.int32(er[b * 18]) | (np.int32(er[b * 18 + 1]) << 8)
                acc = np.float32(acc + np.float32(lut[h] * f))
            out[t, r] = acc
