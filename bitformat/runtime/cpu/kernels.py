"""numba kernels of the ``cpu`` backend: int8 activations times trits read from container bytes.

Every kernel reads the container's own bytes (memory-mapped, never decoded to a dense copy),
accumulates ``code * q`` in int32 and applies the scales once per row (or per 256-block).
Codes are ``trit + 1`` except in colpack_u32, so ``sum(trit * q) = sum(code * q) - sum(q)``.

The 2-bit layouts all hold four codes per byte, at four shifts ("slots"). The activations of
each token are rearranged once (:func:`slot_activations`) into ``XG[g, m]``: the value that
multiplies the code in slot g of row byte m. Then every kernel is four straight loops (or one
vpdpbusd per slot and 64 bytes) over contiguous bytes::

    format        slot g of byte m (counting the row's trit bytes only)   slot g at shift
    i2_s (x86)    element (m // 32) * 128 + 32 g + m % 32                   6 - 2g
    i2_s (arm64)  element (m // 16) * 64 + 16 g + m % 16                    6 - 2g
    tq2_0         element (m // 32) * 128 + 32 g + m % 32  (qs bytes)       2g
    stfma         element 4 m + g                                           2g
    colpack_u32   element 4 m + g  (code 0: 0, 1: +1, 2: -1)                2g
    q2_0          element 4 m + g  (per 64-value block, after its f16 d)    2g
    iq2_bn        element (m // 16) * 64 + 16 g + m % 16  (after the row's  2g
                  f32 scale; the i2_s arm64 slot order)

tq1_0 and iq1_bn (base 3) are decoded where they are used: digit k of byte b is 0, 1 or 2 as
``b * 3**k mod 256`` (uint8 lanes) passes 85 and 170, and each digit of a byte group meets a
contiguous run of activations (table in :func:`_vnni_tq1_row`).

Three builds of the hot loops exist: ``vnni`` (an ``@intrinsic`` that emits AVX512-VNNI
vpdpbusd, 64 u8 x s8 products per instruction, and F16C for the f16 LM head), ``avx2`` (the
ternary mat-vecs of every GGUF type and stfma/colpack_u32 as vpmaddubsw and vpmaddwd on 32
bytes, for CPUs without AVX-512, and the screened head's int8 screen; the rest, e.g. rANS
decoded inside the mat-vec, as ``portable``) and
``portable`` (plain numba; int32 arithmetic kept 32-bit with explicit ``np.int32`` so LLVM
vectorizes it). :func:`kernel_mode` picks the fastest the CPU runs;
``BITFORMAT_CPU_KERNEL=avx2|portable`` forces another (tests run every build the machine has,
and compile the vnni build for a Sapphire Rapids target where the machine lacks it:
``tests/test_vnni_compile.py``). Each build's kernels are compiled only when called, so a
machine never runs an instruction it lacks.

The intrinsics stay in this file although it is long: numba's on-disk cache (``cache=True``)
is invalidated by the timestamp of the kernel's own file only, so kernels here would keep
running stale copies of intrinsics edited in another module.
"""

from __future__ import annotations

import math
import os

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ...errors import UnsupportedConversionError

KIND_I2S = 0  # shifts 6, 4, 2, 0; code = trit + 1
KIND_LOW = 1  # shifts 0, 2, 4, 6; code = trit + 1 (tq2_0, stfma)
KIND_COLPACK = 2  # shifts 0, 2, 4, 6; code 0: 0, 1: +1, 2: -1
KIND_LUT3 = 3  # lut3 tiles (lut3.py): a table lookup per three trits

ENV_VAR = "BITFORMAT_CPU_KERNEL"


def host_features() -> set[str]:
    """LLVM's names of the host CPU's features that are present ("avx512vnni", "f16c", ...)."""
    import llvmlite.binding as llvm

    return {k for k, v in llvm.get_host_cpu_features().items() if v}


#: the kernel builds, fastest first, and the CPU features each needs (LLVM's names)
KERNEL_BUILDS = {"vnni": ("avx512vnni", "avx512bw", "avx512vl", "f16c"),
                 "avx2": ("avx2", "fma", "f16c"), "portable": ()}


def builds_here() -> list[str]:
    """The kernel builds this CPU runs, fastest first (``portable`` always)."""
    feats = host_features()
    return [b for b, need in KERNEL_BUILDS.items() if set(need) <= feats]


def kernel_mode() -> str:
    """``"vnni"``, ``"avx2"`` or ``"portable"``: the env var if set (auto or a build), else
    the fastest build this CPU runs."""
    want = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if want != "auto" and want not in KERNEL_BUILDS:
        raise UnsupportedConversionError(f"{ENV_VAR}={want!r}: choose auto, "
                                         f"{', '.join(KERNEL_BUILDS)}")
    runs = builds_here()
    if want != "auto" and want not in runs:
        raise UnsupportedConversionError(
            f"{ENV_VAR}={want} but this CPU lacks one of "
            f"{', '.join(f.upper() for f in KERNEL_BUILDS[want])}")
    return runs[0] if want == "auto" else want


# -- activation layouts -----------------------------------------------------------------------
def slot_activations(q: np.ndarray, layout: str, width: int) -> np.ndarray:
    """int8 ``[T, cols]`` -> ``XG`` int8 ``[T, 4, width // 4]`` for a 2-bit layout (table above).

    ``width`` is the row's code count (cols, or cols padded to 16 for the u32-word formats);
    padding activations are 0, so padded codes add nothing.
    """
    t, cols = q.shape
    if layout == "plain":  # stfma, colpack_u32: element 4m + g
        if width != cols:
            q = np.concatenate([q, np.zeros((t, width - cols), np.int8)], axis=1)
        return np.ascontiguousarray(q.reshape(t, width // 4, 4).transpose(0, 2, 1))
    lane = {"x86": 32, "arm64": 16}[layout]  # i2_s variants; tq2_0 uses "x86"
    x = q.reshape(t, cols // (4 * lane), 4, lane).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(x.reshape(t, 4, cols // 4))


def block_sums(q: np.ndarray, block: int = 256) -> np.ndarray:
    """int32 ``[T, cols // block]``: the sum of q over each scale block."""
    t, cols = q.shape
    return q.reshape(t, cols // block, block).sum(axis=2, dtype=np.int32)


# -- VNNI intrinsics ----------------------------------------------------------------------------
_I32x16 = ir.VectorType(ir.IntType(32), 16)
_I8x64 = ir.VectorType(ir.IntType(8), 64)


#: Bytes ahead of the weight being read that the vnni loops prefetch. Without it the 2-thread
#: kernel streamed 16 GB/s from DRAM against 25-27 GB/s with it (1024 was best of 512..4096).
PREFETCH = 1024

#: The one-row 2-bit dot (:func:`_make_vnni_dot`; colpack rows and a last odd row, since the
#: one-token mat-vecs take two rows per pass: :data:`PAIR_PREFETCH`) prefetches this far ahead
#: into L2 only (prefetcht1): more lines in flight than the L1 fill buffers allow. Measured
#: when it ran every decode step's matrices: the 120 mat-vecs of a 2B-4T step, in arena
#: order, 2 threads, DRAM-cold (Intel Xeon with AMX, 2 cores): 21.3 ms with 1024 bytes into
#: L1, 18.5 ms with 4096-12288 into L2 (24 -> 28 GB/s); 2048 into L2: 20.5 ms.
ROW_PREFETCH = 6144
#: Bytes ahead of each row that the two-row mat-vec of one token (:func:`_dot2_vnni_pair`)
#: prefetches into L2. The 120 mat-vecs of a 2B-4T step as above, in one interleaved run:
#: one row at a time 21.8 ms; two rows with 4096, 6144, 8192, 12288 bytes into L2: 20.5,
#: 19.8, 19.3, 19.7 ms; 2048 into L1: 21.4; none: 32.5 (reading the bytes without the
#: arithmetic, one row at a time: 20.1).
PAIR_PREFETCH = 8192
#: llvm.prefetch locality: 3 = every level (prefetcht0), 2 = L2 and below (prefetcht1)
L1, L2 = 3, 2


def _prefetch(builder, base, offset, locality=L1):
    """Hint the line at element ``offset`` of ``base`` (a pointer to any element type) into
    the caches (llvm.prefetch: read, keep)."""
    i32 = ir.IntType(32)
    i8p = ir.IntType(8).as_pointer()
    ptr = builder.gep(base, [offset])
    if ptr.type != i8p:
        ptr = builder.bitcast(ptr, i8p)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
        ir.VoidType(), [ptr.type, i32, i32, i32]), "llvm.prefetch")
    builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, locality),
                      ir.Constant(i32, 1)])


def _load64(builder, base, offset):
    ptr = builder.gep(base, [offset])
    return builder.load(builder.bitcast(ptr, _I8x64.as_pointer()), align=1)


def _load64_part(builder, base, offset, count):
    """The ``count`` (< 64) bytes at element ``offset`` of ``base`` as a 64-byte vector, zero
    past them: the last, partial chunk of a row, read without touching memory beyond it.

    Zero weight bytes are zero codes in every 2-bit layout, so a partial chunk adds the same
    integers the scalar loops would. (The tails used to run those loops, inlined for every
    layout at every call site; their vectorized copies were most of the vnni kernels' compile
    time: 29 s for :func:`mm2_vnni` alone, 0.8 s without them, on a 2-core AMD EPYC.)"""
    i8p = ir.IntType(8).as_pointer()
    buf = cgutils.alloca_once(builder, _I8x64)
    builder.store(ir.Constant(_I8x64, None), buf)
    cgutils.raw_memcpy(builder, builder.bitcast(buf, i8p),
                       builder.bitcast(builder.gep(base, [offset]), i8p), count, 1)
    return builder.load(buf)


def _chunk_loop(builder, nbytes, body):
    """``body(i64, load, ahead)`` for each 64-byte chunk of a row of ``nbytes`` bytes: ``i64``
    the chunk's first byte, ``load(base, offset)`` its 64-byte loads (:func:`_load64`), ``ahead``
    whether to prefetch further along the row. A last partial chunk gets :func:`_load64_part`
    (zero past the row's end) and ``ahead`` False."""
    chunks = builder.lshr(nbytes, ir.Constant(nbytes.type, 6))
    c64 = ir.Constant(nbytes.type, 64)
    with cgutils.for_range(builder, chunks) as loop:
        body(builder.mul(loop.index, c64), lambda b, o: _load64(builder, b, o), True)
    part = builder.and_(nbytes, ir.Constant(nbytes.type, 63))
    with builder.if_then(builder.icmp_unsigned("!=", part, ir.Constant(nbytes.type, 0)),
                         likely=False):
        body(builder.mul(chunks, c64), lambda b, o: _load64_part(builder, b, o, part), False)


def _vnni_functions(builder):
    """(vpdpbusd on 512 bits, horizontal int32 sum of 16 lanes), declared in this module."""
    vp = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
        _I32x16, [_I32x16] * 3), "llvm.x86.avx512.vpdpbusd.512")
    red = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
        ir.IntType(32), [_I32x16]), "llvm.vector.reduce.add.v16i32")
    return vp, red


def _make_vnni_dot(shifts: tuple[int, ...], colpack: bool = False):
    """Intrinsic ``dot(w, w_off, xg, x_off, x_stride, nbytes) -> int32`` over a row of
    ``nbytes`` bytes (64-byte chunks, the last one partial where it must be: :func:`_chunk_loop`).

    Chunk i: weight bytes ``w[w_off + 64i : +64]``; slot g's codes ``(byte >> shifts[g]) & 3``
    meet activations ``xg[x_off + g*x_stride + 64i : +64]``. AVX-512 has no byte shift, so
    the codes are not shifted down: slot g's bits are masked in place (``code << s``, still a
    u8) and summed in an accumulator of its own, whose lanes are all multiples of ``2**s``
    and are shifted back once at the end. For colpack the two bits of a code are dotted
    separately (trit = low bit - high bit).
    """
    parts = []  # (slot, in-place mask, shift back, sign)
    for g, s in enumerate(shifts):
        parts += ([(g, 1 << s, s, 1), (g, 2 << s, s + 1, -1)] if colpack else [(g, 3 << s, s, 1)])

    @intrinsic
    def dot(typingctx, w, w_off, xg, x_off, x_stride, n):
        sig = types.int32(w, types.intp, xg, types.intp, types.intp, types.intp)

        def codegen(context, builder, signature, args):
            w_arr, w_off, x_arr, x_off, x_stride, n = args
            wptr = context.make_array(signature.args[0])(context, builder, w_arr).data
            xptr = context.make_array(signature.args[2])(context, builder, x_arr).data
            vp, red = _vnni_functions(builder)
            zero = ir.Constant(_I32x16, None)
            accs = [cgutils.alloca_once_value(builder, zero) for _ in parts]

            def chunk(i64, load, prefetch):
                wv = load(wptr, builder.add(w_off, i64))
                if prefetch:
                    _prefetch(builder, wptr, builder.add(w_off, builder.add(i64, ir.Constant(
                        n.type, ROW_PREFETCH))), L2)
                xv = []
                for g in range(len(shifts)):
                    xoff = builder.add(builder.add(x_off, i64),
                                       builder.mul(x_stride, ir.Constant(n.type, g)))
                    xv.append(builder.bitcast(load(xptr, xoff), _I32x16))
                for acc, (g, mask, _, _) in zip(accs, parts, strict=True):
                    code = builder.and_(wv, ir.Constant(_I8x64, [mask] * 64))
                    builder.store(builder.call(vp, [builder.load(acc), builder.bitcast(
                        code, _I32x16), xv[g]]), acc)

            _chunk_loop(builder, n, chunk)
            total = zero
            for acc, (_, _, back, sign) in zip(accs, parts, strict=True):
                v = builder.load(acc)
                v = builder.ashr(v, ir.Constant(_I32x16, [back] * 16)) if back else v
                total = builder.add(total, v) if sign > 0 else builder.sub(total, v)
            return builder.call(red, [total])

        return sig, codegen

    return dot


def _make_vnni_dot_rows(shifts: tuple[int, ...], nrows: int, prefetch: int = 0):
    """Intrinsic ``dot(W, w_off, w_stride, xg, x_off, x_stride, nbytes) -> nrows int32``: the
    dot of :func:`_make_vnni_dot` for rows ``w_off + k * w_stride`` (k < nrows) against one
    token.

    Each 64-byte chunk of activations is loaded once for ``nrows`` rows. For prompts that cuts
    the activation traffic from L2 (a prompt's activations do not fit L1) by ``nrows`` (4 rows:
    16 zmm accumulators). A single token streams its weights from memory: there two rows
    (:data:`PAIR_PREFETCH`, ``prefetch`` bytes ahead of each row into L2) halve the loads and
    the per-row work the stream has to hide (:func:`_dot2_vnni_pair`).
    """

    @intrinsic
    def dot(typingctx, w, w_off, w_stride, xg, x_off, x_stride, n):
        sig = types.UniTuple(types.int32, nrows)(w, types.intp, types.intp, xg, types.intp,
                                                 types.intp, types.intp)

        def codegen(context, builder, signature, args):
            w_arr, w_off, w_stride, x_arr, x_off, x_stride, n = args
            wptr = context.make_array(signature.args[0])(context, builder, w_arr).data
            xptr = context.make_array(signature.args[3])(context, builder, x_arr).data
            vp, red = _vnni_functions(builder)
            zero = ir.Constant(_I32x16, None)
            accs = [[cgutils.alloca_once_value(builder, zero) for _ in shifts]
                    for _ in range(nrows)]

            def chunk(i64, load, ahead):
                xv = [builder.bitcast(load(xptr, builder.add(
                    builder.add(x_off, i64), builder.mul(x_stride, ir.Constant(n.type, g)))),
                    _I32x16) for g in range(len(shifts))]
                for k in range(nrows):
                    woff = builder.add(builder.add(w_off, builder.mul(
                        w_stride, ir.Constant(n.type, k))), i64)
                    wv = load(wptr, woff)
                    if prefetch and ahead:
                        _prefetch(builder, wptr, builder.add(woff, ir.Constant(n.type, prefetch)),
                                  L2)
                    for g, sh in enumerate(shifts):
                        code = builder.and_(wv, ir.Constant(_I8x64, [3 << sh] * 64))
                        acc = accs[k][g]
                        builder.store(builder.call(vp, [builder.load(acc), builder.bitcast(
                            code, _I32x16), xv[g]]), acc)

            _chunk_loop(builder, n, chunk)
            out = []
            for k in range(nrows):
                total = zero
                for g, sh in enumerate(shifts):
                    v = builder.load(accs[k][g])
                    total = builder.add(total, builder.ashr(v, ir.Constant(_I32x16, [sh] * 16))
                                        if sh else v)
                out.append(builder.call(red, [total]))
            return context.make_tuple(builder, signature.return_type, out)

        return sig, codegen

    return dot


@intrinsic
def _vnni_tq2_row(typingctx, w, xg, x_off, x_stride, bsum, bs_off, nblocks):
    """float64 ``sum_b d_b * (dot_b - bsum[bs_off + b])`` over a tq2_0 row's 66-byte blocks,
    exact (:data:`SCALE_SPAN_BITS`).

    Block b: codes ``qs = w[66b : 66b+64]`` in slots at bits 0, 2, 4, 6 (masked in place as in
    :func:`_make_vnni_dot`), activations ``xg[x_off + g*x_stride + 64b : +64]``, scale ``d``
    the f16 at ``w[66b + 64]``. Each block's int32 lanes are scaled by d into float64 lanes
    (every product and partial sum exact), so there is one horizontal sum per row.
    """
    sig = types.float64(w, xg, types.intp, types.intp, bsum, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        w_arr, x_arr, x_off, x_stride, b_arr, bs_off, n = args
        wptr = context.make_array(signature.args[0])(context, builder, w_arr).data
        xptr = context.make_array(signature.args[1])(context, builder, x_arr).data
        bptr = context.make_array(signature.args[4])(context, builder, b_arr).data
        f64, f64x16 = ir.DoubleType(), ir.VectorType(ir.DoubleType(), 16)
        vp = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_I32x16, [_I32x16] * 3),
            "llvm.x86.avx512.vpdpbusd.512")
        red = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(f64, [f64, f64x16]), "llvm.vector.reduce.fadd.v16f64")
        zero = ir.Constant(_I32x16, None)
        facc_p = cgutils.alloca_once_value(builder, ir.Constant(f64x16, None))
        corr_p = cgutils.alloca_once_value(builder, ir.Constant(f64, 0.0))
        with cgutils.for_range(builder, n) as loop:
            b = loop.index
            base = builder.mul(b, ir.Constant(n.type, 66))
            wv = _load64(builder, wptr, base)
            _prefetch(builder, wptr, builder.add(base, ir.Constant(n.type, PREFETCH)))
            tot = zero
            for g in range(4):
                xoff = builder.add(builder.add(x_off, builder.mul(b, ir.Constant(n.type, 64))),
                                   builder.mul(x_stride, ir.Constant(n.type, g)))
                xv = builder.bitcast(_load64(builder, xptr, xoff), _I32x16)
                code = builder.bitcast(builder.and_(wv, ir.Constant(_I8x64, [3 << 2 * g] * 64)),
                                       _I32x16)
                acc = builder.call(vp, [zero, code, xv])
                tot = builder.add(tot, builder.ashr(acc, ir.Constant(_I32x16, [2 * g] * 16))
                                  if g else acc)
            dptr = builder.bitcast(builder.gep(wptr, [builder.add(base, ir.Constant(
                n.type, 64))]), ir.IntType(16).as_pointer())
            d = builder.fpext(builder.bitcast(builder.load(dptr, align=1), ir.HalfType()), f64)
            dv = builder.shuffle_vector(
                builder.insert_element(ir.Constant(f64x16, ir.Undefined), d,
                                       ir.Constant(ir.IntType(32), 0)),
                ir.Constant(f64x16, ir.Undefined), ir.Constant(_I32x16, [0] * 16))
            builder.store(builder.fadd(builder.load(facc_p), builder.fmul(
                builder.sitofp(tot, f64x16), dv)), facc_p)
            bs = builder.load(builder.gep(bptr, [builder.add(bs_off, b)]))
            builder.store(builder.fadd(builder.load(corr_p), builder.fmul(
                d, builder.sitofp(bs, f64))), corr_p)
        total = builder.call(red, [ir.Constant(f64, 0.0), builder.load(facc_p)])
        return builder.fsub(total, builder.load(corr_p))

    return sig, codegen


def _tq1_digit(builder, q):
    """Base-3 digit of uint8 lanes ``q = b * 3**k mod 256``: 0 up to 85, 1 up to 170, else 2."""
    vt = q.type
    width = vt.count

    def above(limit):
        return builder.zext(builder.icmp_unsigned(">", q, ir.Constant(vt, [limit] * width)), vt)

    return builder.add(above(85), above(170))


def _tq1_dot(builder, acc, codes, x):
    """``acc`` (i32 lanes) + vpdpbusd of u8 ``codes`` and s8 ``x`` (both <32|16 x i8>)."""
    i32v = acc.type
    vp = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32v, [i32v] * 3),
                                        f"llvm.x86.avx512.vpdpbusd.{i32v.count * 32}")
    return builder.call(vp, [acc, builder.bitcast(codes, i32v), builder.bitcast(x, i32v)])


def _load_vec(builder, ptr, off, vt):
    return builder.load(builder.bitcast(builder.gep(ptr, [off]), vt.as_pointer()), align=1)


def _make_tq1_row(dot):
    """Intrinsic ``row(w, x, x_off, bsum, bs_off, nblocks) -> float64``: ``sum_b d_b * (dot_b -
    bsum[bs_off + b])`` over a tq1_0 row's 54-byte blocks, exact (:mod:`..backend`, "One
    arithmetic for every container"), with ``dot(builder, acc, codes, x)`` adding u8 codes
    times s8 activations into int32 lanes (:func:`_tq1_dot`: vpdpbusd).

    Digits are decoded in uint8 lanes (``q*3`` by two adds) and meet contiguous activations:
    qs[0:32] digit k holds elements 32k + m (256-bit); qs[32:48] digit k elements
    160 + 16k + m (128-bit); qh[0:4] is spread to 16 lanes 4k + m, times 3**k, which hold
    elements 240 + 4k + m (128-bit).
    """

    @intrinsic
    def row(typingctx, w, x, x_off, bsum, bs_off, nblocks):
        return types.float64(w, x, types.intp, bsum, types.intp, types.intp), \
            lambda context, builder, signature, args: _tq1_row_codegen(
                dot, context, builder, signature, args)

    return row


def _tq1_row_codegen(dot, context, builder, signature, args):
    """The body of :func:`_make_tq1_row`'s intrinsic."""
    w_arr, x_arr, x_off, b_arr, bs_off, n = args
    wptr = context.make_array(signature.args[0])(context, builder, w_arr).data
    xptr = context.make_array(signature.args[1])(context, builder, x_arr).data
    bptr = context.make_array(signature.args[3])(context, builder, b_arr).data
    f64 = ir.DoubleType()
    v32, v16, v4 = (ir.VectorType(ir.IntType(8), k) for k in (32, 16, 4))
    a8, a4 = ir.VectorType(ir.IntType(32), 8), ir.VectorType(ir.IntType(32), 4)
    red8, red4 = (cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.IntType(32), [t]),
        f"llvm.vector.reduce.add.v{t.count}i32") for t in (a8, a4))
    acc_p = cgutils.alloca_once_value(builder, ir.Constant(f64, 0.0))

    def at(base, k):
        return builder.add(base, ir.Constant(n.type, k))

    with cgutils.for_range(builder, n) as loop:
        b = loop.index
        base = builder.mul(b, ir.Constant(n.type, 54))
        _prefetch(builder, wptr, builder.add(base, ir.Constant(n.type, PREFETCH)))
        xb = builder.add(x_off, builder.mul(b, ir.Constant(n.type, 256)))
        acc8, acc4 = ir.Constant(a8, None), ir.Constant(a4, None)
        for acc_i, vt, first, step, elem in ((0, v32, 0, 32, 0), (1, v16, 32, 16, 160)):
            q = _load_vec(builder, wptr, at(base, first), vt)
            for k in range(5):
                if k:
                    q = builder.add(q, builder.add(q, q))  # times 3, wrapping in uint8
                xv = _load_vec(builder, xptr, at(xb, elem + step * k), vt)
                if acc_i == 0:
                    acc8 = dot(builder, acc8, _tq1_digit(builder, q), xv)
                else:
                    acc4 = dot(builder, acc4, _tq1_digit(builder, q), xv)
        qh = builder.shuffle_vector(_load_vec(builder, wptr, at(base, 48), v4),
                                    ir.Constant(v4, ir.Undefined),
                                    ir.Constant(ir.VectorType(ir.IntType(32), 16),
                                                [m for _ in range(4) for m in range(4)]))
        qh = builder.mul(qh, ir.Constant(v16, [3 ** k for k in range(4) for _ in range(4)]))
        acc4 = dot(builder, acc4, _tq1_digit(builder, qh),
                   _load_vec(builder, xptr, at(xb, 240), v16))
        isum = builder.add(builder.call(red8, [acc8]), builder.call(red4, [acc4]))
        dptr = builder.bitcast(builder.gep(wptr, [at(base, 52)]), ir.IntType(16).as_pointer())
        d = builder.fpext(builder.bitcast(builder.load(dptr, align=1), ir.HalfType()), f64)
        bs = builder.load(builder.gep(bptr, [builder.add(bs_off, b)]))
        builder.store(builder.fadd(builder.load(acc_p), builder.fmul(
            d, builder.sitofp(builder.sub(isum, bs), f64))), acc_p)
    return builder.load(acc_p)


_vnni_tq1_row = _make_tq1_row(_tq1_dot)


_vnni_i2s = _make_vnni_dot((6, 4, 2, 0))
_vnni_low = _make_vnni_dot((0, 2, 4, 6))
_vnni_colpack = _make_vnni_dot((0, 2, 4, 6), colpack=True)
#: rows per pass of :func:`mm2_vnni_prompt`
PROMPT_ROWS = 4
_vnni_i2s_rows = _make_vnni_dot_rows((6, 4, 2, 0), PROMPT_ROWS)
_vnni_low_rows = _make_vnni_dot_rows((0, 2, 4, 6), PROMPT_ROWS)
_vnni_i2s_pair = _make_vnni_dot_rows((6, 4, 2, 0), 2, PAIR_PREFETCH)
_vnni_low_pair = _make_vnni_dot_rows((0, 2, 4, 6), 2, PAIR_PREFETCH)


# -- AVX2 intrinsics (CPUs without AVX-512: vpmaddubsw, then vpmaddwd) -------------------------
_I8x32 = ir.VectorType(ir.IntType(8), 32)
_I16x16 = ir.VectorType(ir.IntType(16), 16)
_I32x8 = ir.VectorType(ir.IntType(32), 8)


def _avx2_madd(builder, width: int):
    """(vpmaddubsw, vpmaddwd) on ``width``-byte vectors (32: AVX2, 16: SSSE3/SSE2)."""
    i8, i16, i32 = (ir.VectorType(ir.IntType(b), width * 8 // b) for b in (8, 16, 32))
    names = (("llvm.x86.avx2.pmadd.ub.sw", "llvm.x86.avx2.pmadd.wd") if width == 32 else
             ("llvm.x86.ssse3.pmadd.ub.sw.128", "llvm.x86.sse2.pmadd.wd"))
    mub = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i16, [i8, i8]),
                                         names[0])
    mwd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32, [i16, i16]),
                                         names[1])
    return mub, mwd


def _avx2_functions(builder):
    """(vpmaddubsw, vpmaddwd on 256 bits, horizontal int32 sum of 8 lanes), declared in this
    module (:func:`_vnni_functions` for AVX2)."""
    red = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
        ir.IntType(32), [_I32x8]), "llvm.vector.reduce.add.v8i32")
    return (*_avx2_madd(builder, 32), red)


def _make_avx2_dot(shifts: tuple[int, ...], colpack: bool = False):
    """Intrinsic ``dot(w, w_off, xg, x_off, x_stride, n) -> int32`` over n 32-byte chunks: the
    dot of :func:`_make_vnni_dot` for AVX2 (no AVX-512).

    Slot g's codes ``(byte >> s) & 3`` (a byte shift LLVM makes of a 16-bit shift and a mask)
    meet ``xg[x_off + g*x_stride + 32i : +32]`` in vpmaddubsw (u8 codes times s8 activations,
    pairs summed into int16: at most 2 * 3 * 128 per lane, so the four slots' sum, 3,072, never
    saturates); vpmaddwd by ones widens each chunk's sum into int32 lanes. For colpack the two
    bits of a code are dotted separately (trit = low bit - high bit). 4.5 -> 13-21 GB/s on one
    6912 x 2560 i2_s matrix against the portable loops (AMD EPYC, 2 threads, from DRAM / from
    cache).
    """
    parts = []  # (slot, shift, mask, sign)
    for g, s in enumerate(shifts):
        parts += ([(g, s, 1, 1), (g, s + 1, 1, -1)] if colpack else [(g, s, 3, 1)])

    @intrinsic
    def dot(typingctx, w, w_off, xg, x_off, x_stride, n):
        sig = types.int32(w, types.intp, xg, types.intp, types.intp, types.intp)

        def codegen(context, builder, signature, args):
            w_arr, w_off, x_arr, x_off, x_stride, n = args
            wptr = context.make_array(signature.args[0])(context, builder, w_arr).data
            xptr = context.make_array(signature.args[2])(context, builder, x_arr).data
            mub, mwd, red = _avx2_functions(builder)
            acc = cgutils.alloca_once_value(builder, ir.Constant(_I32x8, None))
            ones = ir.Constant(_I16x16, [1] * 16)
            c32 = ir.Constant(n.type, 32)
            with cgutils.for_range(builder, n) as loop:
                i32 = builder.mul(loop.index, c32)
                wv = _load_vec(builder, wptr, builder.add(w_off, i32), _I8x32)
                xv = [_load_vec(builder, xptr, builder.add(builder.add(x_off, i32), builder.mul(
                    x_stride, ir.Constant(n.type, g))), _I8x32) for g in range(len(shifts))]
                tot = None
                for g, sh, mask, sign in parts:
                    code = builder.lshr(wv, ir.Constant(_I8x32, [sh] * 32)) if sh else wv
                    code = builder.and_(code, ir.Constant(_I8x32, [mask] * 32))
                    pr = builder.call(mub, [code, xv[g]])
                    tot = pr if tot is None else (builder.add(tot, pr) if sign > 0
                                                  else builder.sub(tot, pr))
                builder.store(builder.add(builder.load(acc), builder.call(mwd, [tot, ones])),
                              acc)
            return builder.call(red, [builder.load(acc)])

        return sig, codegen

    return dot


def _make_avx2_block_row(block: int, code_bytes: int, d_at: int, codes_at: int, width: int):
    """Intrinsic ``row(w, xg, x_off, x_stride, bsum, bs_off, nblocks) -> float64``: ``sum_b d_b
    * (dot_b - bsum[bs_off + b])`` over a row of ``block``-byte blocks, each an f16 ``d`` at
    byte ``d_at`` and ``code_bytes`` of 2-bit codes from ``codes_at`` (slots at bits 0, 2, 4,
    6 meeting ``xg[x_off + g*x_stride + code_bytes*b : ...]``), on ``width``-byte vectors.

    A block's int16 sums are widened into int32 lanes, converted to float64 lanes and scaled by
    its d there (every product and sum exact: :mod:`..backend`, "One arithmetic for every
    container"), so there is one horizontal sum per row. tq2_0: 66-byte blocks, d after 64 code
    bytes; q2_0: 18-byte blocks, d before 16.
    """
    i8 = ir.VectorType(ir.IntType(8), width)
    i16 = ir.VectorType(ir.IntType(16), width // 2)
    f64v = ir.VectorType(ir.DoubleType(), width // 4)

    @intrinsic
    def row(typingctx, w, xg, x_off, x_stride, bsum, bs_off, nblocks):
        sig = types.float64(w, xg, types.intp, types.intp, bsum, types.intp, types.intp)

        def codegen(context, builder, signature, args):
            w_arr, x_arr, x_off, x_stride, b_arr, bs_off, n = args
            wptr = context.make_array(signature.args[0])(context, builder, w_arr).data
            xptr = context.make_array(signature.args[1])(context, builder, x_arr).data
            bptr = context.make_array(signature.args[4])(context, builder, b_arr).data
            f64 = ir.DoubleType()
            mub, mwd = _avx2_madd(builder, width)
            red = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
                f64, [f64, f64v]), f"llvm.vector.reduce.fadd.v{width // 4}f64")
            facc_p = cgutils.alloca_once_value(builder, ir.Constant(f64v, None))
            corr_p = cgutils.alloca_once_value(builder, ir.Constant(f64, 0.0))
            ones = ir.Constant(i16, [1] * (width // 2))

            def at(base, k):
                return builder.add(base, ir.Constant(n.type, k))

            with cgutils.for_range(builder, n) as loop:
                b = loop.index
                base = builder.mul(b, ir.Constant(n.type, block))
                xb = builder.add(x_off, builder.mul(b, ir.Constant(n.type, code_bytes)))
                tot = None
                for c in range(0, code_bytes, width):
                    wv = _load_vec(builder, wptr, at(base, codes_at + c), i8)
                    for g in range(4):
                        xv = _load_vec(builder, xptr, builder.add(at(xb, c), builder.mul(
                            x_stride, ir.Constant(n.type, g))), i8)
                        code = builder.lshr(wv, ir.Constant(i8, [2 * g] * width)) if g else wv
                        code = builder.and_(code, ir.Constant(i8, [3] * width))
                        pr = builder.call(mub, [code, xv])
                        tot = pr if tot is None else builder.add(tot, pr)
                lanes = builder.sitofp(builder.call(mwd, [tot, ones]), f64v)
                dptr = builder.bitcast(builder.gep(wptr, [at(base, d_at)]),
                                       ir.IntType(16).as_pointer())
                d = builder.fpext(builder.bitcast(builder.load(dptr, align=1), ir.HalfType()),
                                  f64)
                dv = builder.shuffle_vector(
                    builder.insert_element(ir.Constant(f64v, ir.Undefined), d,
                                           ir.Constant(ir.IntType(32), 0)),
                    ir.Constant(f64v, ir.Undefined),
                    ir.Constant(ir.VectorType(ir.IntType(32), width // 4), [0] * (width // 4)))
                builder.store(builder.fadd(builder.load(facc_p), builder.fmul(lanes, dv)),
                              facc_p)
                bs = builder.load(builder.gep(bptr, [builder.add(bs_off, b)]))
                builder.store(builder.fadd(builder.load(corr_p), builder.fmul(
                    d, builder.sitofp(bs, f64))), corr_p)
            total = builder.call(red, [ir.Constant(f64, 0.0), builder.load(facc_p)])
            return builder.fsub(total, builder.load(corr_p))

        return sig, codegen

    return row


@intrinsic
def _avx2_iq1_pairs(typingctx, w, x, x_off, x_stride, npairs):
    """int32 sum of digit * activation over ``npairs`` pairs of iq1_bn blocks (from the row's
    third byte, 13 bytes a block): each block's bytes loaded as 16 into one 128-bit half, the
    five base-3 digits decoded in uint8 lanes as in :func:`_tq1_row_codegen` (digit j of a
    byte: the byte times 3**(4 - j), by repeated tripling from j = 4), each against
    ``x[x_off + j*x_stride + 16b : +32]`` (:func:`iq1_activations`) by vpmaddubsw. Each
    block's last 16-byte load reads 3 bytes past it: the caller leaves the row's last block
    (or two) to the scalar loop."""
    sig = types.int32(w, x, types.intp, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        w_arr, x_arr, x_off, x_stride, n = args
        wptr = context.make_array(signature.args[0])(context, builder, w_arr).data
        xptr = context.make_array(signature.args[1])(context, builder, x_arr).data
        mub, mwd, red = _avx2_functions(builder)
        v16 = ir.VectorType(ir.IntType(8), 16)
        acc = cgutils.alloca_once_value(builder, ir.Constant(_I32x8, None))
        ones = ir.Constant(_I16x16, [1] * 16)
        both = ir.Constant(ir.VectorType(ir.IntType(32), 32), list(range(32)))

        def at(base, k):
            return builder.add(base, ir.Constant(n.type, k))

        with cgutils.for_range(builder, n) as loop:
            b0 = builder.mul(loop.index, ir.Constant(n.type, 2))
            o0 = at(builder.mul(b0, ir.Constant(n.type, 13)), 2)
            q = builder.shuffle_vector(_load_vec(builder, wptr, o0, v16),
                                       _load_vec(builder, wptr, at(o0, 13), v16), both)
            xb = builder.add(x_off, builder.mul(b0, ir.Constant(n.type, 16)))
            tot = None
            for j in range(4, -1, -1):  # digit 4 (the byte itself) first, then tripled
                if j < 4:
                    q = builder.add(q, builder.add(q, q))  # times 3, wrapping in uint8
                xv = _load_vec(builder, xptr, builder.add(xb, builder.mul(
                    x_stride, ir.Constant(n.type, j))), _I8x32)
                pr = builder.call(mub, [_tq1_digit(builder, q), xv])
                tot = pr if tot is None else builder.add(tot, pr)
            builder.store(builder.add(builder.load(acc), builder.call(mwd, [tot, ones])), acc)
        return builder.call(red, [builder.load(acc)])

    return sig, codegen


_avx2_i2s = _make_avx2_dot((6, 4, 2, 0))
_avx2_low = _make_avx2_dot((0, 2, 4, 6))
_avx2_colpack = _make_avx2_dot((0, 2, 4, 6), colpack=True)
_avx2_tq2_row = _make_avx2_block_row(66, 64, 64, 0, 32)
_avx2_q2_row = _make_avx2_block_row(18, 16, 0, 2, 16)


# -- scalar helpers -----------------------------------------------------------------------------
@njit(inline="always")
def _f16(lo, hi):
    """float32 of the little-endian half in bytes (lo, hi); exact, no special instruction."""
    h = np.int32(lo) | (np.int32(hi) << 8)
    e = (h >> 10) & 31
    mant = h & 1023
    if e == 0:
        v = math.ldexp(float(mant), -24)
    elif e == 31:
        v = math.inf if mant == 0 else math.nan
    else:
        v = math.ldexp(float(mant + 1024), e - 25)
    return np.float32(-v if h & 0x8000 else v)


@njit(inline="always")
def _slot_dot(wr, w0, xs, x0, n, s):
    """sum over m < n of ((wr[w0+m] >> s) & 3) * xs[x0+m], kept in int32 lanes."""
    acc = np.int32(0)
    for m in range(n):
        acc = np.int32(acc + np.int32((wr[w0 + m] >> s) & 3) * np.int32(xs[x0 + m]))
    return acc


@njit(inline="always")
def _slot_dot_colpack(wr, w0, xs, x0, n, s):
    acc = np.int32(0)
    for m in range(n):
        b = np.int32(wr[w0 + m])
        acc = np.int32(acc + np.int32(((b >> s) & 1) - ((b >> (s + 1)) & 1)) * np.int32(xs[x0 + m]))
    return acc


@njit(inline="always")
def _dot2_portable(wr, w0, xg, x0, n, kind):
    """The four slot loops over n bytes of one row (``xg`` = ``XG[t]``)."""
    if kind == KIND_I2S:
        return (_slot_dot(wr, w0, xg[0], x0, n, 6) + _slot_dot(wr, w0, xg[1], x0, n, 4)
                + _slot_dot(wr, w0, xg[2], x0, n, 2) + _slot_dot(wr, w0, xg[3], x0, n, 0))
    if kind == KIND_LOW:
        return (_slot_dot(wr, w0, xg[0], x0, n, 0) + _slot_dot(wr, w0, xg[1], x0, n, 2)
                + _slot_dot(wr, w0, xg[2], x0, n, 4) + _slot_dot(wr, w0, xg[3], x0, n, 6))
    return (_slot_dot_colpack(wr, w0, xg[0], x0, n, 0)
            + _slot_dot_colpack(wr, w0, xg[1], x0, n, 2)
            + _slot_dot_colpack(wr, w0, xg[2], x0, n, 4)
            + _slot_dot_colpack(wr, w0, xg[3], x0, n, 6))


@njit(inline="always")
def _dot2_vnni(wr, XG, t, kind):
    """The whole row ``wr`` against ``XG[t]``: vpdpbusd on 64-byte chunks, the last one
    partial where the row is not whole chunks."""
    bpr = XG.shape[2]
    x0 = t * 4 * bpr  # XG[t] starts here in the flat buffer
    if kind == KIND_I2S:
        return _vnni_i2s(wr, 0, XG, x0, bpr, bpr)
    if kind == KIND_LOW:
        return _vnni_low(wr, 0, XG, x0, bpr, bpr)
    return _vnni_colpack(wr, 0, XG, x0, bpr, bpr)


@njit(inline="always")
def _dot2_vnni_pair(W, r, XG, t, kind):
    """(:func:`_dot2_vnni` of row r, of row r + 1) of ``W`` against ``XG[t]``; both rows in one
    pass over the chunks (:func:`_make_vnni_dot_rows`) for KIND_I2S and KIND_LOW. Row r + 1
    past the last row gives 0."""
    rows, bpr = W.shape
    if r + 1 >= rows:
        return _dot2_vnni(W[r], XG, t, kind), np.int32(0)
    if kind == KIND_COLPACK:
        return _dot2_vnni(W[r], XG, t, kind), _dot2_vnni(W[r + 1], XG, t, kind)
    x0 = t * 4 * bpr
    if kind == KIND_I2S:
        return _vnni_i2s_pair(W, r * bpr, bpr, XG, x0, bpr, bpr)
    return _vnni_low_pair(W, r * bpr, bpr, XG, x0, bpr, bpr)


# -- per-tensor-scale 2-bit formats: i2_s, stfma, colpack_u32 ------------------------------------
def mm2_portable(W, XG, corr, s, ws, kind, out):
    """out[t, r] = float32(float32(sum_m code*XG - corr[t]) * ws[r]) / s[t] for row bytes ``W[r]``.

    ``ws`` holds each row's tensor scale (float32 [rows]), so matrices stacked by rows (q, k
    and v of a layer, read in one call) keep their own scales. One compiled kernel per
    ``kind``, so a model compiles only its own layout's loops (a kernel with all three took
    6-7 s to compile on 2 cores, a third of a cold first run's critical path).
    """
    MM2_PORTABLE[kind](W, XG, corr, s, ws, kind, out)


@njit(inline="always")
def _mm2_portable_row(W, r, XG, corr, s, ws, kind, out):
    """Row ``r`` of :func:`mm2_portable` for every token."""
    wr = W[r]
    for t in range(out.shape[0]):
        d = _dot2_portable(wr, 0, XG[t], 0, W.shape[1], kind)
        out[t, r] = np.float32(d - corr[t]) * ws[r] / s[t]


@njit(parallel=True, cache=True)
def mm2_portable_i2s(W, XG, corr, s, ws, kind, out):
    """:func:`mm2_portable` for KIND_I2S (``kind`` is ignored)."""
    for r in prange(W.shape[0]):
        _mm2_portable_row(W, r, XG, corr, s, ws, KIND_I2S, out)


@njit(parallel=True, cache=True)
def mm2_portable_low(W, XG, corr, s, ws, kind, out):
    """:func:`mm2_portable` for KIND_LOW (``kind`` is ignored)."""
    for r in prange(W.shape[0]):
        _mm2_portable_row(W, r, XG, corr, s, ws, KIND_LOW, out)


@njit(parallel=True, cache=True)
def mm2_portable_colpack(W, XG, corr, s, ws, kind, out):
    """:func:`mm2_portable` for KIND_COLPACK (``kind`` is ignored)."""
    for r in prange(W.shape[0]):
        _mm2_portable_row(W, r, XG, corr, s, ws, KIND_COLPACK, out)


#: the portable 2-bit kernel of each row layout
MM2_PORTABLE = {KIND_I2S: mm2_portable_i2s, KIND_LOW: mm2_portable_low,
                KIND_COLPACK: mm2_portable_colpack}


@njit(parallel=True, cache=True)
def mm2_vnni(W, XG, corr, s, ws, kind, out):
    """:func:`mm2_portable` on vpdpbusd, two rows at a time (:func:`_dot2_vnni_pair`)."""
    rows = W.shape[0]
    for p in prange((rows + 1) // 2):
        r = 2 * p
        for t in range(out.shape[0]):
            d0, d1 = _dot2_vnni_pair(W, r, XG, t, kind)
            out[t, r] = np.float32(d0 - corr[t]) * ws[r] / s[t]
            if r + 1 < rows:
                out[t, r + 1] = np.float32(d1 - corr[t]) * ws[r + 1] / s[t]


@njit(parallel=True, cache=True)
def mm2_vnni_prompt(W, XG, corr, s, ws, kind, out):
    """:func:`mm2_vnni` for several tokens (KIND_I2S, KIND_LOW): ``PROMPT_ROWS`` rows at a time
    against each token, so a chunk of activations serves four rows (see
    :func:`_make_vnni_dot_rows`); colpack and leftover rows take the one-row path."""
    rows, bpr = W.shape
    R = PROMPT_ROWS
    groups = rows // R if kind != KIND_COLPACK else 0
    for gi in prange(groups):
        r = gi * R
        for t in range(out.shape[0]):
            x0 = t * 4 * bpr
            if kind == KIND_I2S:
                d = _vnni_i2s_rows(W, r * bpr, bpr, XG, x0, bpr, bpr)
            else:
                d = _vnni_low_rows(W, r * bpr, bpr, XG, x0, bpr, bpr)
            for k in range(R):
                out[t, r + k] = np.float32(d[k] - corr[t]) * ws[r + k] / s[t]
    for r in prange(groups * R, rows):
        wr = W[r]
        for t in range(out.shape[0]):
            d1 = _dot2_vnni(wr, XG, t, kind)
            out[t, r] = np.float32(d1 - corr[t]) * ws[r] / s[t]


@njit(inline="always")
def _dot2_avx2(wr, w0, XG, t, n, kind):
    """``n`` bytes of row ``wr`` from ``w0`` against ``XG[t]`` from its start: the AVX2 dot on
    whole 32-byte chunks (:func:`_make_avx2_dot`), the portable loops for the rest."""
    bpr = XG.shape[2]
    chunks = n // 32
    x0 = t * 4 * bpr  # XG[t] starts here in the flat buffer
    if kind == KIND_I2S:
        acc = _avx2_i2s(wr, w0, XG, x0, bpr, chunks)
    elif kind == KIND_LOW:
        acc = _avx2_low(wr, w0, XG, x0, bpr, chunks)
    else:
        acc = _avx2_colpack(wr, w0, XG, x0, bpr, chunks)
    done = chunks * 32
    if done < n:
        acc += _dot2_portable(wr, w0 + done, XG[t], done, n - done, kind)
    return acc


def mm2_avx2(W, XG, corr, s, ws, kind, out):
    """:func:`mm2_portable` on AVX2 (:func:`_dot2_avx2`), any number of tokens; one compiled
    kernel per ``kind`` (:data:`MM2_AVX2`)."""
    MM2_AVX2[kind](W, XG, corr, s, ws, kind, out)


@njit(inline="always")
def _mm2_avx2_row(W, r, XG, corr, s, ws, kind, out):
    """Row ``r`` of :func:`mm2_avx2` for every token."""
    wr = W[r]
    for t in range(out.shape[0]):
        d = _dot2_avx2(wr, 0, XG, t, W.shape[1], kind)
        out[t, r] = np.float32(d - corr[t]) * ws[r] / s[t]


@njit(parallel=True, cache=True)
def mm2_avx2_i2s(W, XG, corr, s, ws, kind, out):
    """:func:`mm2_avx2` for KIND_I2S (``kind`` is ignored)."""
    for r in prange(W.shape[0]):
        _mm2_avx2_row(W, r, XG, corr, s, ws, KIND_I2S, out)


@njit(parallel=True, cache=True)
def mm2_avx2_low(W, XG, corr, s, ws, kind, out):
    """:func:`mm2_avx2` for KIND_LOW (``kind`` is ignored)."""
    for r in prange(W.shape[0]):
        _mm2_avx2_row(W, r, XG, corr, s, ws, KIND_LOW, out)


@njit(parallel=True, cache=True)
def mm2_avx2_colpack(W, XG, corr, s, ws, kind, out):
    """:func:`mm2_avx2` for KIND_COLPACK (``kind`` is ignored)."""
    for r in prange(W.shape[0]):
        _mm2_avx2_row(W, r, XG, corr, s, ws, KIND_COLPACK, out)


#: the AVX2 2-bit kernel of each row layout
MM2_AVX2 = {KIND_I2S: mm2_avx2_i2s, KIND_LOW: mm2_avx2_low, KIND_COLPACK: mm2_avx2_colpack}


# -- tq2_0: 66-byte blocks, qs[64] then f16 d ------------------------------------------------------
@njit(parallel=True, cache=True)
def tq2_portable(W, XG, bsum, s, out):
    """out[t, r] = float32(sum_b d_b * (dot_b - bsum[t, b])) / s[t] over the row's blocks, the
    sum exact in float64 (:mod:`..backend`, "One arithmetic for every container")."""
    for r in prange(W.shape[0]):
        wr = W[r]
        for t in range(out.shape[0]):
            acc = np.float64(0.0)
            for b in range(bsum.shape[1]):
                d = _dot2_portable(wr, b * 66, XG[t], b * 64, 64, KIND_LOW)
                acc += np.float64(_f16(wr[b * 66 + 64], wr[b * 66 + 65])) * np.float64(
                    d - bsum[t, b])
            out[t, r] = np.float32(acc) / s[t]


@njit(parallel=True, cache=True)
def tq2_vnni(W, XG, bsum, s, out):
    bpr, nb = XG.shape[2], bsum.shape[1]
    for r in prange(W.shape[0]):
        wr = W[r]
        for t in range(out.shape[0]):
            out[t, r] = np.float32(_vnni_tq2_row(wr, XG, t * 4 * bpr, bpr, bsum, t * nb, nb)
                                   ) / s[t]


@njit(parallel=True, cache=True)
def tq2_avx2(W, XG, bsum, s, out):
    """:func:`tq2_portable` on AVX2 (:func:`_make_avx2_block_row`)."""
    bpr, nb = XG.shape[2], bsum.shape[1]
    for r in prange(W.shape[0]):
        wr = W[r]
        for t in range(out.shape[0]):
            out[t, r] = np.float32(_avx2_tq2_row(wr, XG, t * 4 * bpr, bpr, bsum, t * nb, nb)
                                   ) / s[t]


# -- tq1_0: 54-byte blocks, base-3 qs[48] + qh[4], then f16 d --------------------------------------
@njit(parallel=True, cache=True)
def tq1_vnni(W, Q, bsum, s, out):
    cols, nb = Q.shape[1], bsum.shape[1]
    for r in prange(W.shape[0]):
        wr = W[r]
        for t in range(out.shape[0]):
            out[t, r] = np.float32(_vnni_tq1_row(wr, Q, t * cols, bsum, t * nb, nb)) / s[t]


# -- q2_0: 18-byte blocks of 64 values, f16 d then qs[16] (element 4m + g at bits 2g) ------------
@njit(parallel=True, cache=True)
def q2_portable(W, XG, bsum, s, lut, out):
    """out[t, r] = float32(sum_b d_b * (dot_b - bsum[t, b])) / s[t], the sum exact in float64;
    ``XG`` in the "plain" layout, ``bsum`` the activation sums over 64-value blocks, ``lut``
    float32[65536] of every f16 pattern (:func:`.head.lut16`). One pass over a block's 16
    bytes reads all four slots (four loops of 16 would not vectorize)."""
    nb = bsum.shape[1]
    for r in prange(W.shape[0]):
        wr = W[r]
        for t in range(out.shape[0]):
            x0, x1, x2, x3 = XG[t, 0], XG[t, 1], XG[t, 2], XG[t, 3]
            acc = np.float64(0.0)
            for b in range(nb):
                o, xo = b * 18 + 2, b * 16
                d = np.int32(0)
                for m in range(16):
                    w = np.int32(wr[o + m])
                    d = np.int32(d + (w & 3) * np.int32(x0[xo + m])
                                 + ((w >> 2) & 3) * np.int32(x1[xo + m])
                                 + ((w >> 4) & 3) * np.int32(x2[xo + m])
                                 + ((w >> 6) & 3) * np.int32(x3[xo + m]))
                h = np.int32(wr[b * 18]) | (np.int32(wr[b * 18 + 1]) << 8)
                acc += np.float64(lut[h]) * np.float64(d - bsum[t, b])
            out[t, r] = np.float32(acc) / s[t]


@njit(parallel=True, cache=True)
def q2_avx2(W, XG, bsum, s, lut, out):
    """:func:`q2_portable` on 16-byte SSSE3 vectors (:func:`_make_avx2_block_row`; ``lut``
    unused: the f16 d is converted by F16C)."""
    bpr, nb = XG.shape[2], bsum.shape[1]
    for r in prange(W.shape[0]):
        wr = W[r]
        for t in range(out.shape[0]):
            out[t, r] = np.float32(_avx2_q2_row(wr, XG, t * 4 * bpr, bpr, bsum, t * nb, nb)
                                   ) / s[t]


# -- iq2_bn: a row is its f32 scale, then 16-byte blocks (element 16g + m at bits 2g of byte m) ---
@njit(parallel=True, cache=True)
def iq2bn_portable(W, XG, corr, s, ws, out):
    """out[t, r] = float32(float32(dot - corr[t]) * ws[r]) / s[t]; ``XG`` in the "arm64" layout (the
    same slot order), ``ws`` the rows' scales (read from their first 4 bytes at load)."""
    rows, bpr = W.shape
    for r in prange(rows):
        wr = W[r]
        for t in range(out.shape[0]):
            d = _dot2_portable(wr, 4, XG[t], 0, bpr - 4, KIND_LOW)
            out[t, r] = np.float32(d - corr[t]) * ws[r] / s[t]


@njit(parallel=True, cache=True)
def iq2bn_avx2(W, XG, corr, s, ws, out):
    """:func:`iq2bn_portable` on AVX2 (:func:`_dot2_avx2` from the row's fifth byte)."""
    rows, bpr = W.shape
    for r in prange(rows):
        wr = W[r]
        for t in range(out.shape[0]):
            d = _dot2_avx2(wr, 4, XG, t, bpr - 4, KIND_LOW)
            out[t, r] = np.float32(d - corr[t]) * ws[r] / s[t]


# -- iq1_bn: a row is its f16 scale, then 13-byte blocks: ql[12] (5 digits), extra (4) ----------
_IQ1_MULT = np.array([81, 27, 9, 3, 1], dtype=np.uint8)  # digit j of a byte: times 3^(4-j)


@njit(inline="always")
def _digit(b, mult):
    """Base-3 digit of a ggml-scaled byte: 0, 1 or 2 as ``b * mult mod 256`` passes 85, 170."""
    q = np.uint8(b * mult)
    return np.int32(q > 85) + np.int32(q > 170)


@njit(inline="always")
def _iq1_block(wr, qt, b):
    """int32 sum of digit * q over iq1_bn block b of row ``wr`` (``qt`` in element order):
    element 16i + 5k + j of a block is digit j of ql[3i + k], element 16i + 15 digit i of
    extra."""
    acc = np.int32(0)
    o, x0 = 2 + b * 13, b * 64
    for i in range(4):
        for k in range(3):
            byte = wr[o + 3 * i + k]
            e = x0 + 16 * i + 5 * k
            for j in range(5):
                acc = np.int32(acc + _digit(byte, _IQ1_MULT[j]) * np.int32(qt[e + j]))
        acc = np.int32(acc + _digit(wr[o + 12], _IQ1_MULT[i]) * np.int32(qt[x0 + 16 * i + 15]))
    return acc


# -- lut3: three trits per table lookup (tq1_0 and iq1_bn on AVX-512 VBMI; layout in lut3.py) -----
#: rows of a lut3 tile: four sub-tiles of 16, each one vpdpbusd lane per row
LUT_TILE_ROWS = 64
#: columns of a lut3 block: two quads of four 3-column groups
LUT_BLOCK_COLS = 24
#: bytes of a block of one sub-tile: 64 index bytes (two nibbles), two 64-bit sign masks
LUT_SUB_BYTES = 80
#: bytes of a block of a whole tile: the four sub-tiles' index bytes (each a cache line,
#: aligned), then their masks from LUT_MASKS_AT
LUT_BLOCK_BYTES = 4 * LUT_SUB_BYTES
LUT_MASKS_AT = 4 * 64
#: bytes of a token's table for one quad (four groups' low bytes, then their high bytes)
LUT_QUAD_BYTES = 128
#: added to every table entry so that its high byte is 0..2 (a u8 for vpdpbusd); a row takes
#: it back as LUT_OFFSET times the sum of its groups' signs, kept at the tile's end
LUT_OFFSET = 384
#: bytes ahead of the block being read that the lut3 tile prefetches into L2. One 6,912 x
#: 2,560 mat-vec from memory, 2 threads (AMD EPYC, AVX-512 VBMI): 4096: 121 us, 8192: 129,
#: 16384: 117 (i2_s's two-row kernel 157 us in the same run).
LUT_PREFETCH = 16384
_I16x16 = ir.VectorType(ir.IntType(16), 16)
_I16x32 = ir.VectorType(ir.IntType(16), 32)
_I8x16 = ir.VectorType(ir.IntType(8), 16)
_I8x32 = ir.VectorType(ir.IntType(8), 32)
_I32 = ir.IntType(32)


def _lut_coefficients() -> np.ndarray:
    """int [3, 16]: the trits of table entry ``idx`` (combination ``idx + 13`` of base-3 digits
    ``(t0 + 1, t1 + 1, t2 + 1)``: entry 0 is all zeros, 1..13 the combinations whose first
    nonzero trit is +1); entries 14 and 15 are never read."""
    c = np.zeros((3, 16), np.int64)
    for idx in range(14):
        m = idx + 13
        c[:, idx] = (m // 9 - 1, (m // 3) % 3 - 1, m % 3 - 1)
    return c


LUT_COEFFICIENTS = _lut_coefficients()


def _target_features() -> set[str]:
    """The features of the CPU numba compiles for: NUMBA_CPU_FEATURES where set (as in
    ``tests/test_vnni_compile.py``), else this CPU's (:func:`host_features`)."""
    from numba.core import config

    if config.CPU_FEATURES:
        return {f[1:] for f in config.CPU_FEATURES.split(",") if f.startswith("+")}
    return host_features()


def _vpermb(builder, table, idx):
    """Byte ``idx[i] & 63`` of the 64-byte ``table`` in each lane i: vpermb where the target
    has AVX-512 VBMI. Elsewhere (a VNNI CPU without VBMI, e.g. Cascade Lake, where the cpu
    backend never holds lut3 tiles) the same bytes by 64 extracts: the decode step holds the
    lut3 branch, and LLVM stops the process on an intrinsic the target lacks."""
    if "avx512vbmi" in _target_features():
        perm = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
            _I8x64, [_I8x64, _I8x64]), "llvm.x86.avx512.permvar.qi.512")
        return builder.call(perm, [table, idx])
    out = ir.Constant(_I8x64, None)
    low = builder.and_(idx, ir.Constant(_I8x64, [63] * 64))
    for i in range(64):
        at = builder.extract_element(low, ir.Constant(_I32, i))
        out = builder.insert_element(out, builder.extract_element(table, at),
                                     ir.Constant(_I32, i))
    return out


@intrinsic
def _lut3_tables(typingctx, q, q_off, tb, t_off, nquads):
    """Tables of the activations ``q[q_off:]`` for ``nquads`` quads of 12 columns into
    ``tb[t_off:]``: 128 bytes a quad, byte ``16 j + idx`` the low byte and ``64 + 16 j + idx``
    the high byte of ``LUT_OFFSET + sum_k c[k, idx] * x[12 quad + 3 j + k]``
    (:data:`LUT_COEFFICIENTS`). Reads 16 bytes at each quad: ``q`` holds 4 bytes past the last."""
    sig = types.void(q, types.intp, tb, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        q_arr, q_off, t_arr, t_off, nq = args
        qptr = context.make_array(signature.args[0])(context, builder, q_arr).data
        tptr = context.make_array(signature.args[2])(context, builder, t_arr).data
        coef = [ir.Constant(_I16x32, [int(LUT_COEFFICIENTS[k, lane % 16]) for lane in range(32)])
                for k in range(3)]
        eight = ir.Constant(_I16x32, [8] * 32)
        cat = ir.Constant(ir.VectorType(_I32, 64), list(range(64)))
        with cgutils.for_range(builder, nq) as loop:
            qd = loop.index
            x = _load_vec(builder, qptr, builder.add(q_off, builder.mul(qd, ir.Constant(
                nq.type, 12))), _I8x16)
            x16 = builder.sext(x, _I16x16)
            los, his = [], []
            for h in range(2):  # lanes of groups 2h and 2h + 1
                v = ir.Constant(_I16x32, [LUT_OFFSET] * 32)
                for k in range(3):
                    X = builder.shuffle_vector(x16, x16, ir.Constant(ir.VectorType(_I32, 32), [
                        3 * (2 * h + lane // 16) + k for lane in range(32)]))
                    v = builder.add(v, builder.mul(X, coef[k]))
                los.append(builder.trunc(v, _I8x32))
                his.append(builder.trunc(builder.ashr(v, eight), _I8x32))
            to = builder.add(t_off, builder.mul(qd, ir.Constant(nq.type, LUT_QUAD_BYTES)))
            for i, part in enumerate((los, his)):
                ptr = builder.gep(tptr, [builder.add(to, ir.Constant(nq.type, 64 * i))])
                builder.store(builder.shuffle_vector(part[0], part[1], cat),
                              builder.bitcast(ptr, _I8x64.as_pointer()), align=1)
        return context.get_dummy_value()

    return sig, codegen


def _make_lut3_tile(lines: int, ntok: int = 1):
    """:func:`_lut3_tile` for ``ntok`` tokens, prefetching ``lines`` cache lines a block."""

    @intrinsic
    def tile(typingctx, w, w_off, tb, t_off, t_stride, nblocks, out, pf_off, pf_stride):
        return _lut3_tile_codegen(lines, ntok, w, tb, out)

    return tile


def _lut3_tile_codegen(lines, ntok, w, tb, out):
    """The exact integer dot products of the 64 rows of the lut3 tile at ``w[w_off:]`` (its
    ``nblocks`` blocks, then 64 int32 sign sums) with the ``ntok`` tokens whose tables are at
    ``tb[t_off + t * t_stride:]``, into ``out[64 t: 64 t + 64]`` (int32); at block b it
    prefetches into L2 the ``lines`` cache lines from ``w[pf_off + b * pf_stride:]``, 64 bytes
    apart. A sub-tile's indices and signs are made once for all ``ntok`` tokens.

    Per block and sub-tile: the index nibbles of quad 0 (low) and quad 1 (high), each or-ed
    with 16 j, pick bytes of the quad's tables by vpermb (low bytes and high bytes apart); the
    sign masks make +-1 bytes, and vpdpbusd sums the four groups of a row into its lane. A
    row's dot is 256 * (high sum) + (low sum) - LUT_OFFSET * (its sign sum)."""
    sig = types.void(w, types.intp, tb, types.intp, types.intp, types.intp, out, types.intp,
                     types.intp)

    def codegen(context, builder, signature, args):
        w_arr, w_off, t_arr, t_off, t_stride, nb, o_arr, pf_off, pf_stride = args
        wptr = context.make_array(signature.args[0])(context, builder, w_arr).data
        tptr = context.make_array(signature.args[2])(context, builder, t_arr).data
        optr = context.make_array(signature.args[6])(context, builder, o_arr).data
        vp, _ = _vnni_functions(builder)
        zero = ir.Constant(_I32x16, None)
        accs = [[[cgutils.alloca_once_value(builder, zero) for _ in range(2)] for _ in range(4)]
                for _ in range(ntok)]

        def c(v):
            return ir.Constant(nb.type, v)

        group = ir.Constant(_I8x64, [16 * (k % 4) for k in range(64)])
        nibble = ir.Constant(_I8x64, [15] * 64)
        four = ir.Constant(_I8x64, [4] * 64)
        plus, minus = ir.Constant(_I8x64, [1] * 64), ir.Constant(_I8x64, [255] * 64)
        bits = ir.VectorType(ir.IntType(1), 64)
        with cgutils.for_range(builder, nb) as loop:
            b = loop.index
            toff = builder.add(t_off, builder.mul(b, c(2 * LUT_QUAD_BYTES)))
            tabs = [[_load_vec(builder, tptr, builder.add(builder.add(toff, builder.mul(
                t_stride, c(t))), c(64 * i)), _I8x64) for i in range(4)]
                for t in range(ntok)]  # quad 0 low, high; quad 1 low, high
            base = builder.add(w_off, builder.mul(b, c(LUT_BLOCK_BYTES)))
            ahead = builder.add(pf_off, builder.mul(b, pf_stride))
            for line in range(lines):
                _prefetch(builder, wptr, builder.add(ahead, c(64 * line)), L2)
            for k in range(4):
                n = _load_vec(builder, wptr, builder.add(base, c(64 * k)), _I8x64)
                idx = (builder.or_(builder.and_(n, nibble), group),
                       builder.or_(builder.and_(builder.lshr(n, four), nibble), group))
                for quad in range(2):
                    m = builder.bitcast(_load_vec(builder, wptr, builder.add(
                        base, c(LUT_MASKS_AT + 16 * k + 8 * quad)), ir.IntType(64)), bits)
                    sign = builder.bitcast(builder.select(m, minus, plus), _I32x16)
                    for t in range(ntok):
                        for half in range(2):
                            acc = accs[t][k][half]
                            val = _vpermb(builder, tabs[t][2 * quad + half], idx[quad])
                            builder.store(builder.call(vp, [builder.load(acc), builder.bitcast(
                                val, _I32x16), sign]), acc)
        sums = builder.add(w_off, builder.mul(nb, c(LUT_BLOCK_BYTES)))
        for k in range(4):
            ssum = builder.mul(_load_vec(builder, wptr, builder.add(sums, c(64 * k)), _I32x16),
                               ir.Constant(_I32x16, [LUT_OFFSET] * 16))
            for t in range(ntok):
                lo, hi = (builder.load(a) for a in accs[t][k])
                dot = builder.sub(builder.add(builder.shl(hi, ir.Constant(_I32x16, [8] * 16)),
                                              lo), ssum)
                builder.store(dot, builder.bitcast(builder.gep(optr, [c(64 * t + 16 * k)]),
                                                   _I32x16.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(inline="always")
def lut3_padded(cols):
    """Bytes :func:`lut3_row_tables` reads of a row of ``cols`` int8 activations held in
    place: its whole blocks, zero past ``cols``, and 4 bytes more (read, never used)."""
    return (cols + LUT_BLOCK_COLS - 1) // LUT_BLOCK_COLS * LUT_BLOCK_COLS + 4


@njit(inline="always")
def lut3_zero_padding(xp, cols):
    """Zero the row ``xp`` of ``cols`` activations past ``cols`` to the end of its last block,
    so that its tables (:func:`lut3_row_tables`) depend on the activations alone."""
    xp[cols:lut3_padded(cols) - 4] = 0


@njit(inline="always")
def lut3_row_tables(xp, cols, tb):
    """The tables ``tb`` of the ``cols`` int8 activations at the start of ``xp``, which holds
    :func:`lut3_padded` bytes, zeroed past ``cols`` (:func:`lut3_zero_padding`). It only reads
    ``xp``: the one-call step's threads each make their own tables from one shared row."""
    _lut3_tables(xp, 0, tb, 0, (lut3_padded(cols) - 4) // 12)


@njit(inline="always")
def _lut3_token_tables(q, t, tb, xp):
    """Token t's tables into ``tb[t]`` (``xp``: int8 scratch of ``lut3_padded(cols)``)."""
    cols = q.shape[1]
    xp[:cols] = q[t]
    lut3_zero_padding(xp, cols)
    lut3_row_tables(xp, cols, tb[t])


@njit(cache=True)
def lut3_tables(q, tb):
    """Every token's tables: ``q`` int8 [T, cols] -> ``tb`` uint8 [T, quads * 128]
    (:func:`_lut3_tables`), columns past ``cols`` taken as zero."""
    xp = np.empty(lut3_padded(q.shape[1]), np.int8)
    for t in range(q.shape[0]):
        _lut3_token_tables(q, t, tb, xp)


@njit(cache=True, parallel=True)
def lut3_tables_tokens(q, tb):
    """:func:`lut3_tables` with the tokens shared out between the threads (a prompt's)."""
    for t in prange(q.shape[0]):
        _lut3_token_tables(q, t, tb, np.empty(lut3_padded(q.shape[1]), np.int8))


#: the tile kernel for one token (prefetching a whole block ahead), for one token of several
#: and for two of several (a line a block: the passes over a tile in cache share out the
#: next tile's prefetches, :func:`lut3_rows`)
_lut3_tile = _make_lut3_tile(LUT_BLOCK_BYTES // 64)
_lut3_tile_pass = _make_lut3_tile(1)
_lut3_tile_pair = _make_lut3_tile(1, 2)


@njit(inline="always")
def _lut3_out(p, dots, at, t, s, ws, rows, out):
    """The 2-bit kernels' epilogue on tile ``p``'s dots ``dots[at: at + 64]`` for token t."""
    r0 = p * LUT_TILE_ROWS
    for k in range(min(LUT_TILE_ROWS, rows - r0)):
        out[t, r0 + k] = np.float32(dots[at + k]) * ws[r0 + k] / s[t]


@njit(inline="always")
def lut3_rows(W, p, tb, s, ws, rows, out, dots):
    """Rows of tile ``p`` of ``W`` against every token t (tables ``tb[t]``): ``out[t, r] =
    float32(dot_r) * ws[r] / s[t]``, the 2-bit kernels' epilogue on the same integers
    (``dots``: int32 scratch of 128).

    One token prefetches :data:`LUT_PREFETCH` bytes ahead of the block it reads. Several
    tokens pass over the tile two at a time (a sub-tile's indices and signs made once for
    both), from cache after the first pass, and pass i of P prefetches from the i-th of P
    shares of the next tile (the one a thread's run of tiles takes next), so the memory
    streams during every pass: a line a block, which covers the share where P is 5 or more
    (10 tokens; fewer passes leave the rest to the hardware prefetcher)."""
    L, nb, T, n = W.shape[1], W.shape[1] // LUT_BLOCK_BYTES, out.shape[0], tb.shape[1]
    w0 = p * L
    if T == 1:
        _lut3_tile(W, w0, tb, 0, n, nb, dots, w0 + LUT_PREFETCH, LUT_BLOCK_BYTES)
        _lut3_out(p, dots, 0, 0, s, ws, rows, out)
        return
    P = (T + 1) // 2
    step = max(64, LUT_BLOCK_BYTES // P)
    for i in range(P):
        t, ahead = 2 * i, w0 + L + i * L // P
        if t + 1 < T:
            _lut3_tile_pair(W, w0, tb, t * n, n, nb, dots, ahead, step)
            _lut3_out(p, dots, 0, t, s, ws, rows, out)
            _lut3_out(p, dots, LUT_TILE_ROWS, t + 1, s, ws, rows, out)
        else:
            _lut3_tile_pass(W, w0, tb, t * n, n, nb, dots, ahead, step)
            _lut3_out(p, dots, 0, t, s, ws, rows, out)


@njit(parallel=True, cache=True)
def mm_lut3(W, tb, s, ws, out):
    """out[t, r] = float32(sum trit * q_t) * ws[r] / s[t] for the lut3 tiles ``W`` [tiles,
    tile bytes] and each token's tables ``tb`` [T, quads * 128]: a tile at a time, every token
    against it while it is in cache (:func:`lut3_rows`)."""
    rows = out.shape[1]
    for p in prange(W.shape[0]):
        lut3_rows(W, p, tb, s, ws, rows, out, np.empty(2 * LUT_TILE_ROWS, np.int32))


#: element of a 64-value iq1_bn block that digit j of block byte m (ql[0:12], then extra)
#: multiplies; 64: none (the extra byte's fifth digit and the three bytes past the block)
IQ1_ELEMENT = np.array([[16 * (m // 3) + 5 * (m % 3) + j if m < 12 else
                         (16 * j + 15 if m == 12 and j < 4 else 64) for m in range(16)]
                        for j in range(5)], dtype=np.intp)



def iq1_activations(q: np.ndarray) -> np.ndarray:
    """int8 ``[T, cols]`` -> ``[T, 5, cols // 4]``: for each 64-value block, 16 activations per
    digit j, the one digit j of block byte m multiplies (:data:`IQ1_ELEMENT`, 0 where none),
    so a block's 13 bytes loaded as 16 meet 16 consecutive activations per digit."""
    t, cols = q.shape
    nb = cols // 64
    qb = np.concatenate([q.reshape(t, nb, 64), np.zeros((t, nb, 1), np.int8)], axis=2)
    x = qb[:, :, IQ1_ELEMENT]  # [T, nb, 5, 16]
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3).reshape(t, 5, nb * 16))


@njit(parallel=True, cache=True)
def iq1bn_avx2(W, X1, Q, corr, s, ws, out):
    """Like :func:`iq2bn_portable` (``Q`` in element order, for :func:`_iq1_block`): two
    blocks a step (:func:`_avx2_iq1_pairs`, ``X1`` from :func:`iq1_activations`); the last
    one or two blocks of a row, whose 16-byte loads would pass the row's end, by the scalar
    loop. The vnni build's iq1_bn kernel; the others repack iq1_bn into iq2_bn rows."""
    rows, bpr = W.shape
    nb = (bpr - 2) // 13
    pairs = (nb - 1) // 2
    stride = X1.shape[2]
    for r in prange(rows):
        wr = W[r]
        for t in range(out.shape[0]):
            acc = _avx2_iq1_pairs(wr, X1, t * 5 * stride, stride, pairs)
            for b in range(2 * pairs, nb):
                acc = np.int32(acc + _iq1_block(wr, Q[t], b))
            out[t, r] = np.float32(acc - corr[t]) * ws[r] / s[t]


# -- any shape: int8 trits decoded at load (fallback for layouts without a kernel) ------------
@njit(inline="always")
def _dot8(a, b, j0, n):
    """int32 sum of a[j0+m] * b[j0+m] over m < n (``range(n)``: numba vectorizes this loop
    ten times faster than one over ``range(j0, j0 + n)``)."""
    acc = np.int32(0)
    for m in range(n):
        acc = np.int32(acc + np.int32(a[j0 + m]) * np.int32(b[j0 + m]))
    return acc


@njit(parallel=True, cache=True)
def mm_trits(T8, scales, Q, s, out):
    """out[t, r] = float32(sum_b scales[r, b] * (sum trit*q over block b)) / s[t], exact in float64.

    ``scales`` is float32 [rows, n_blocks] (n_blocks = 1 for a per-tensor scale).
    """
    rows, cols = T8.shape
    nb = scales.shape[1]
    bl = cols // nb
    for r in prange(rows):
        tr = T8[r]
        for t in range(out.shape[0]):
            acc = np.float64(0.0)
            for b in range(nb):
                acc += np.float64(scales[r, b]) * np.float64(_dot8(tr, Q[t], b * bl, bl))
            out[t, r] = np.float32(acc) / s[t]
