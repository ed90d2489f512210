"""AMX tile kernels for a batched decode step (2..16 tokens) of the 2-bit formats.

With 8 tokens the VNNI kernel (:func:`.batch.mm2_vnni_tokens`) is compute-bound: every
weight meets every token in a vpdpbusd of 64 multiply-adds, 8 of them per weight byte-slot,
and a step of 2B-4T takes ~90 ms of them on two cores against ~20 ms to read the bytes. An
AMX ``tdpbusd`` multiplies a 16 x 64 tile of u8 by a 64 x 16 tile of s8 (16 K multiply-adds)
in one instruction, so the codes of 16 rows meet up to 16 tokens at once:

- the A tile is 16 weight rows x 64 codes: one 64-byte chunk of each row, its slot at one
  shift (``(byte >> 2g) & 3``: the codes of 64 columns, one GFNI affine byte map), written
  to a scratch buffer (four tiles a chunk);
- the B tile is those 64 columns of every token as 16 dwords x T tokens (4 consecutive
  activations per dword): :func:`tile_activations` lays them out once per activation;
- a C tile per group of 16 rows collects its 16 rows x T int32 sums over the row (all four
  shifts); two groups go together, so each B tile is loaded once for two A tiles.

What it costs (Xeon with AMX, Sapphire Rapids class, 2 cores; 2 threads, T = 8): the code
bytes (64 stores of 64 bytes a group and chunk) and the tile work (8 tile loads, 4
``tdpbusd``) take about as long each and hardly overlap; the epilogue (int32 to float32 per
row and token) about a tenth. Writing each shift's codes with one ``vgf2p8affineqb`` instead
of a shift and an AND and two C tiles instead of four took a 13824 x 640-byte matrix from
19.6 to 24.3 GB/s in cache and 13.1 to 15.8 GB/s from memory (T = 2: 25.2 -> 27.8 /
16.1 -> 17.3; T = 16: 13.1 -> 18.6 / 10.5 -> 12.5); sharing the B tiles between two groups
then gave T = 16 another ~30% in cache and ~15% from memory (2560 x 1728 bytes, T = 8:
~15% / ~10%; 13824 x 640, T = 8: about even). Both against the kernel before them, in one
(busier) run: 13824 x 640, from memory / in cache, GB/s: T = 2 13.6 -> 15.8 / 22.6 -> 23.5,
T = 8 11.3 -> 14.5 / 16.1 -> 20.9, T = 16 8.9 -> 11.8 / 10.8 -> 17.5; the whole decode step
of the full-size 2B-4T (:func:`.decode.decode_rows`): 8 tokens 62.8 -> 55.4 ms, 16 tokens
104.4 -> 90.8 ms.

The sum runs over the columns in another order than the other kernels, but integer sums are
exact, so ``out[t, r] = float32(dot - corr[t]) * ws[r] / s[t]`` equals theirs to the bit.

AMX needs Linux's permission for the tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``, once
per process): :func:`available` asks for it and says whether the kernels may run.
"""

from __future__ import annotations

import ctypes
import functools
import platform

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .kernels import KIND_I2S, L2, _dot2_vnni, _load64, _prefetch, host_features
from .screen import SCREEN_BLOCK, _block_max, _bounds, _screen_dot, _screen_dot7, _unpack7_rows

#: rows of weights per A tile, and the most tokens a C tile holds
TILE_ROWS = 16
MAX_TOKENS = 16
#: the most tokens of one pass of :func:`mm2_amx_wide`
WIDE_TOKENS = 64
#: rows a thread takes at a time (groups of 16 share a tile configuration)
BLOCK_ROWS = 128

_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA, _SYS_ARCH_PRCTL = 0x1023, 18, 158


@functools.cache
def available() -> bool:
    """True when this CPU has AMX-INT8 and GFNI (LLVM sees them) and Linux lets this process
    use the tiles."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    if not {"amx-tile", "amx-int8", "avx512bw", "gfni"} <= host_features():
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


@functools.cache
def tile_config(ntok: int) -> np.ndarray:
    """The 64-byte tile configuration (palette 1) for ``ntok`` tokens: tmm0, tmm1 C (16 rows
    x ntok int32: two groups of 16 rows), tmm2..5 A (16 x 64 u8), tmm6, tmm7 B (16 dwords x
    ntok). With 16 tokens every tile is 16 x 64 bytes (:func:`mm2_amx_wide` numbers them its
    own way)."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    colsb, rows = cfg[16:48].view(np.uint16), cfg[48:64]
    for t, width in enumerate((4 * ntok,) * 2 + (64,) * 4 + (4 * ntok,) * 2):
        colsb[t], rows[t] = width, 16
    cfg.setflags(write=False)
    return cfg


def tile_activations(xg: np.ndarray, kind: int, tokens: int = 0) -> np.ndarray:
    """int8 slot activations ``XG [T, 4, bpr]`` -> int32 ``[bpr // 64, 4, 16, T]``: for chunk
    i and shift 2g, the B tile of the 64 columns whose codes sit at that shift (i2_s keeps
    slot 3 - g there, stfma slot g): dword k of token t is its activations 4k..4k+3.
    ``tokens`` > T pads with tokens of zeros (:func:`mm2_amx_wide`)."""
    if tokens > xg.shape[0]:
        xg = np.concatenate([xg, np.zeros((tokens - xg.shape[0], *xg.shape[1:]), xg.dtype)])
    t, _, bpr = xg.shape
    n = bpr // 64
    x = xg[:, :, : n * 64].reshape(t, 4, n * 64).view(np.int32).reshape(t, 4, n, 16)
    if kind == KIND_I2S:
        x = x[:, ::-1]
    return np.ascontiguousarray(x.transpose(2, 1, 3, 0))


_I8 = ir.IntType(8)
_P = _I8.as_pointer()
_I64 = ir.IntType(64)
_I16x32 = ir.VectorType(ir.IntType(16), 32)
_I8x64 = ir.VectorType(_I8, 64)


def _fn(builder, name, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), args),
                                          name)


def _codes(builder, v, g):
    """The 2-bit codes at shift 2g of the 64 bytes ``v``, one u8 each: a GF(2) affine map per
    byte (vgf2p8affineqb: result bit j is the parity of matrix byte 7 - j AND the byte),
    bit 2g to bit 0 and 2g + 1 to bit 1 -- one instruction instead of a shift and a mask."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
        _I8x64, [_I8x64, _I8x64, _I8]), "llvm.x86.vgf2p8affineqb.512")
    m = (1 << 2 * g) << 56 | (2 << 2 * g) << 48
    return builder.call(fn, [v, ir.Constant(_I8x64, [m >> 8 * b & 255 for b in range(8)] * 8),
                             ir.Constant(_I8, 0)])


def _tile_setup(context, builder, signature, args):
    """What the tile loops (:func:`_amx_rows`, :func:`_amx_pairs`) start with: the byte
    pointers of ``w``, ``xb``, ``abuf`` and ``cout``; the tile intrinsics (tilezero,
    tileloadd64, tilestored64, tdpbusd, tilerelease); constant makers for offsets and tile
    numbers; the chunks per row, bytes per B-tile row and per B tile; and the tile
    configuration ``cfg`` loaded."""
    def data(i):
        return builder.bitcast(
            context.make_array(signature.args[i])(context, builder, args[i]).data, _P)

    fns = (_fn(builder, "llvm.x86.tilezero", [_I8]),
           _fn(builder, "llvm.x86.tileloadd64", [_I8, _P, _I64]),
           _fn(builder, "llvm.x86.tilestored64", [_I8, _P, _I64]),
           _fn(builder, "llvm.x86.tdpbusd", [_I8, _I8, _I8]),
           _fn(builder, "llvm.x86.tilerelease", []))

    def c(v):
        return ir.Constant(args[2].type, v)

    def tmm(k):
        return ir.Constant(_I8, k)

    bstride = builder.mul(args[6], c(4))  # ntok dwords a row
    sizes = (builder.udiv(args[3], c(64)), bstride, builder.mul(bstride, c(16)))
    builder.call(_fn(builder, "llvm.x86.ldtilecfg", [_P]), [data(0)])
    return (data(1), data(5), data(7), data(8)), fns, c, tmm, sizes


def _expand(builder, c, wptr, aptr, row0, bpr, i, rows, size):
    """Chunk i's codes of ``rows`` rows (16 or 32) from byte ``row0`` into A buffer i % 2 of
    the scratch ``aptr`` (buffers of ``size`` bytes): per group of 16 rows its four shifts'
    tiles of 1 KB (group j, shift g at ``(4 j + g) KB``); and a prefetch of the next ``rows``
    rows' bytes, in order (one line per row and chunk)."""
    i64 = builder.mul(i, c(64))
    half = builder.mul(builder.and_(i, c(1)), c(size))
    for k in range(rows):
        wv = _load64(builder, wptr, builder.add(builder.add(row0, builder.mul(bpr, c(k))), i64))
        _prefetch(builder, wptr, builder.add(builder.add(row0, builder.mul(bpr, c(rows))),
                                             builder.add(builder.mul(i, c(64 * rows)),
                                                         c(64 * k))), L2)
        for g in range(4):
            dst = builder.gep(aptr, [builder.add(half, c(
                (k // TILE_ROWS * 4 + g) * 1024 + k % TILE_ROWS * 64))])
            builder.store(_codes(builder, wv, g), builder.bitcast(dst, _I8x64.as_pointer()),
                          align=64)


def _pipeline(builder, c, n, expand, multiply):
    """Chunks 0..n-1 software-pipelined: the tiles load a chunk's codes one chunk after they
    were written (a tile load right after the stores waited for them: 4x slower)."""
    expand(c(0))
    with cgutils.for_range(builder, builder.sub(n, c(1))) as loop:
        expand(builder.add(loop.index, c(1)))
        multiply(loop.index)
    multiply(builder.sub(n, c(1)))


def _make_amx_rows(nb: int):
    """The tile loop of :func:`mm2_amx_wide` for ``nb`` blocks of 16 tokens (a C tile per
    block, all shifts summed in it)."""
    return intrinsic(functools.partial(_amx_rows, nb))


def _amx_rows(nb, typingctx, cfg, w, w_off, bpr, ngroups, xb, ntok, abuf, cout):
    """For ``ngroups`` groups of 16 rows from byte ``w_off`` of ``w`` (``bpr`` bytes a row,
    ``bpr // 64`` chunks): tile sums against ``xb`` (:func:`tile_activations`, ``ntok`` = 16
    nb) into ``cout[group, nb, 16, 16]`` int32. ``abuf``: an 8 KB scratch of this thread for
    the A tiles (two sets: a chunk's codes are written while the tiles of the chunk before
    are multiplied). Tiles: C tmm0..nb-1, A tmm4, tmm5, B tmm6, tmm7 (``tile_config(16)``:
    all 16 x 64 bytes)."""
    sig = types.void(cfg, w, types.intp, types.intp, types.intp, xb, types.intp, abuf, cout)

    def codegen(context, builder, signature, args):
        _, _, w_off, bpr, ngroups, _, _, _, _ = args
        ((wptr, xptr, aptr, optr), (zero, load, store, dp, release), c, tmm,
         (n, bstride, bsize)) = _tile_setup(context, builder, signature, args)
        with cgutils.for_range(builder, ngroups) as grp:
            row0 = builder.add(w_off, builder.mul(grp.index, builder.mul(bpr, c(16))))
            for b in range(nb):
                builder.call(zero, [tmm(b)])

            def multiply(i):  # chunk i's A tiles times its B tiles
                half = builder.mul(builder.and_(i, c(1)), c(4096))
                for g in range(4):
                    a_t = tmm(4 + g % 2)
                    builder.call(load, [a_t, builder.gep(aptr, [builder.add(half, c(g * 1024))]),
                                        ir.Constant(_I64, 64)])
                    for b in range(nb):
                        b_t = tmm(6 + (g * nb + b) % 2)
                        builder.call(load, [b_t, builder.gep(xptr, [builder.add(builder.mul(
                            builder.add(builder.mul(i, c(4)), c(g)), bsize), c(64 * b))]),
                            bstride])
                        builder.call(dp, [tmm(b), a_t, b_t])

            _pipeline(builder, c, n, lambda i: _expand(builder, c, wptr, aptr, row0, bpr, i,
                                                       TILE_ROWS, 4096), multiply)
            obase = builder.mul(grp.index, c(1024 * nb))  # nb tiles of 16 x 64 bytes
            for b in range(nb):
                builder.call(store, [tmm(b), builder.gep(optr, [builder.add(
                    obase, c(1024 * b))]), ir.Constant(_I64, 64)])
        builder.call(release, [])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _amx_pairs(typingctx, cfg, w, w_off, bpr, ngroups, xb, ntok, abuf, cout):
    """For ``ngroups`` groups of 16 rows from byte ``w_off`` of ``w`` (``bpr`` bytes a row,
    ``bpr // 64`` chunks): tile sums against ``xb`` (:func:`tile_activations`, ``ntok``
    tokens) into ``cout[group, 16, ntok]`` int32, two groups at a time: each B tile is loaded
    once for both groups' A tiles of its shift, each group's four shifts sum into its C tile
    (tmm0, tmm1; A tmm2..5 in turn, B tmm6, tmm7: :func:`tile_config`). ``abuf``: a 16 KB
    scratch of this thread for the A tiles (two sets: a chunk's codes are written while the
    tiles of the chunk before are multiplied -- a tile load right after the stores waited
    for them: 4x slower)."""
    sig = types.void(cfg, w, types.intp, types.intp, types.intp, xb, types.intp, abuf, cout)

    def codegen(context, builder, signature, args):
        _, _, w_off, bpr, ngroups, _, _, _, _ = args
        ((wptr, xptr, aptr, optr), (zero, load, store, dp, release), c, tmm,
         (n, bstride, bsize)) = _tile_setup(context, builder, signature, args)

        def body(g0, ng):  # groups g0 .. g0 + ng - 1 (ng 1 or 2), C tiles tmm0 .. ng - 1
            row0 = builder.add(w_off, builder.mul(g0, builder.mul(bpr, c(16))))
            for j in range(ng):
                builder.call(zero, [tmm(j)])

            def multiply(i):  # chunk i: per shift one B tile, the groups' A tiles
                half = builder.mul(builder.and_(i, c(1)), c(8192))
                for g in range(4):
                    b_t = tmm(6 + g % 2)
                    builder.call(load, [b_t, builder.gep(xptr, [builder.mul(builder.add(
                        builder.mul(i, c(4)), c(g)), bsize)]), bstride])
                    for j in range(ng):
                        a_t = tmm(2 + (g * ng + j) % 4)
                        builder.call(load, [a_t, builder.gep(aptr, [builder.add(
                            half, c((j * 4 + g) * 1024))]), ir.Constant(_I64, 64)])
                        builder.call(dp, [tmm(j), a_t, b_t])

            _pipeline(builder, c, n, lambda i: _expand(builder, c, wptr, aptr, row0, bpr, i,
                                                       TILE_ROWS * ng, 8192), multiply)
            for j in range(ng):
                builder.call(store, [tmm(j), builder.gep(optr, [builder.mul(
                    builder.add(g0, c(j)), bsize)]), bstride])

        with cgutils.for_range(builder, builder.udiv(ngroups, c(2))) as p:
            body(builder.mul(p.index, c(2)), 2)
        with builder.if_then(builder.icmp_unsigned("!=", builder.urem(ngroups, c(2)), c(0))):
            body(builder.sub(ngroups, c(1)), 1)
        builder.call(release, [])
        return context.get_dummy_value()

    return sig, codegen


_amx_rows2, _amx_rows3, _amx_rows4 = (_make_amx_rows(nb) for nb in (2, 3, 4))


@njit(cache=True, error_model="numpy")
def block_scratch(T):
    """A thread's scratch for :func:`amx_block`: the A-tile buffer (64-byte aligned), the
    block's int32 sums and one group's float results."""
    abuf = np.empty(16 * TILE_ROWS * 64 + 64, np.uint8)
    a0 = (64 - abuf.ctypes.data % 64) % 64
    gpb = BLOCK_ROWS // TILE_ROWS
    return (abuf[a0:], np.empty((gpb, TILE_ROWS, T), np.int32),
            np.empty((TILE_ROWS, T), np.float32))


@njit(cache=True, nogil=True, error_model="numpy")
def amx_block(W, b, XB, cfg, corr, s, ws, out, abuf, cout, f):
    """Block b (``BLOCK_ROWS`` rows, its whole groups of 16) of :func:`mm2_amx_tokens`."""
    rows, bpr = W.shape
    T = out.shape[0]
    groups = rows // TILE_ROWS
    gpb = BLOCK_ROWS // TILE_ROWS
    g0 = b * gpb
    ng = min(gpb, groups - g0)
    _amx_pairs(cfg, W, g0 * TILE_ROWS * bpr, bpr, ng, XB, T, abuf, cout)
    for gi in range(ng):
        r0 = (g0 + gi) * TILE_ROWS
        for k in range(TILE_ROWS):  # along the tile's rows: vcvtdq2ps, vdivps, vmulps
            wk = ws[r0 + k]
            for t in range(T):
                f[k, t] = np.float32(cout[gi, k, t] - corr[t]) * wk / s[t]
        for t in range(T):
            for k in range(TILE_ROWS):
                out[t, r0 + k] = f[k, t]


@njit(parallel=True, cache=True, nogil=True)
def mm2_amx_tokens(W, XG, XB, cfg, corr, s, ws, kind, out):
    """:func:`.kernels.mm2_vnni` for 2..16 tokens (KIND_I2S, KIND_LOW; ``bpr % 64 == 0``) on
    AMX tiles (module docstring): blocks of ``BLOCK_ROWS`` rows split among threads, rows
    past the last group of 16 by the one-token VNNI kernel. Same results to the bit."""
    rows, bpr = W.shape
    T = out.shape[0]
    groups = rows // TILE_ROWS
    gpb = BLOCK_ROWS // TILE_ROWS
    nblocks = (groups + gpb - 1) // gpb
    for b in prange(nblocks):
        abuf, cout, f = block_scratch(T)
        amx_block(W, b, XB, cfg, corr, s, ws, out, abuf, cout, f)
    amx_tail(W, XG, kind, corr, s, ws, out)


@njit(cache=True, nogil=True, error_model="numpy")
def amx_tail(W, XG, kind, corr, s, ws, out):
    """The rows of :func:`mm2_amx_tokens` past the last group of 16: the one-token VNNI kernel
    on the slot layout ``XG`` [T, 4, bpr]."""
    rows = W.shape[0]
    for r in range(rows // TILE_ROWS * TILE_ROWS, rows):
        for t in range(out.shape[0]):
            out[t, r] = np.float32(_dot2_vnni(W[r], XG, t, kind) - corr[t]) * ws[r] / s[t]


@njit(parallel=True, cache=True, nogil=True)
def mm2_amx_wide(W, XG, XB, cfg, corr, s, ws, kind, out):
    """:func:`mm2_amx_tokens` for 17..64 tokens in one pass over the weights: ``XB`` from
    :func:`tile_activations` padded to ``16 * nb`` tokens, ``cfg`` = ``tile_config(16)``, a
    C tile per block of 16 tokens. Same results to the bit."""
    rows, bpr = W.shape
    T = out.shape[0]
    nb = XB.shape[3] // 16
    groups = rows // TILE_ROWS
    gpb = BLOCK_ROWS // TILE_ROWS
    nblocks = (groups + gpb - 1) // gpb
    for b in prange(nblocks):
        g0 = b * gpb
        ng = min(gpb, groups - g0)
        abuf = np.empty(8 * TILE_ROWS * 64 + 64, np.uint8)
        a0 = (64 - abuf.ctypes.data % 64) % 64
        cout = np.empty((ng, nb, TILE_ROWS, 16), np.int32)
        w0 = g0 * TILE_ROWS * bpr
        if nb == 2:
            _amx_rows2(cfg, W, w0, bpr, ng, XB, 16 * nb, abuf[a0:], cout)
        elif nb == 3:
            _amx_rows3(cfg, W, w0, bpr, ng, XB, 16 * nb, abuf[a0:], cout)
        else:
            _amx_rows4(cfg, W, w0, bpr, ng, XB, 16 * nb, abuf[a0:], cout)
        d = np.empty(TILE_ROWS, np.int32)
        for gi in range(ng):
            r0 = (g0 + gi) * TILE_ROWS
            for t in range(T):
                for k in range(TILE_ROWS):
                    d[k] = cout[gi, t // 16, k, t % 16] - corr[t]
                st = s[t]
                for k in range(TILE_ROWS):
                    out[t, r0 + k] = np.float32(d[k]) / st * ws[r0 + k]
    for r in range(groups * TILE_ROWS, rows):
        for t in range(T):
            out[t, r] = np.float32(_dot2_vnni(W[r], XG, t, kind) - corr[t]) * ws[r] / s[t]


# -- the screened LM head's int8 screen (runtime/cpu/screen.py) for 2..8 tokens ------------------
#: the most tokens :func:`screen_amx` takes (two int8 vectors each: 16 columns of a C tile)
SCREEN_TOKENS = 8


@functools.cache
def screen_config(ntok: int) -> np.ndarray:
    """Tiles of :func:`screen_amx`: tmm0, tmm1 C (16 rows x 2 ntok int32), tmm2, tmm3 A
    (16 x 64 u8 codes), tmm4, tmm5 B (16 dwords x 2 ntok)."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    colsb, rows = cfg[16:48].view(np.uint16), cfg[48:64]
    for t, width in enumerate((8 * ntok, 8 * ntok, 64, 64, 8 * ntok, 8 * ntok)):
        colsb[t], rows[t] = width, 16
    cfg.setflags(write=False)
    return cfg


def screen_activations(xq: np.ndarray) -> np.ndarray:
    """int8 ``XQ [T, 2, width]`` -> int32 ``[width // 64, 16, 2T]``: chunk i's B tile, column
    2t + j holding dwords of token t's vector j."""
    t, _, width = xq.shape
    x = np.ascontiguousarray(xq).view(np.int32).reshape(2 * t, width // 64, 16)
    return np.ascontiguousarray(x.transpose(1, 2, 0))


@intrinsic
def _screen_rows(typingctx, cfg, w, v0, width, ngroups, xb, ncol, cout):
    """Tile sums of ``ngroups`` groups of 16 code rows from row v0 (``width`` bytes each,
    loaded straight into A tiles) against ``xb`` (:func:`screen_activations`, ``ncol`` = 2T
    columns) into ``cout[group, 2, 16, ncol]`` (even and odd chunks)."""
    sig = types.void(cfg, w, types.intp, types.intp, types.intp, xb, types.intp, cout)

    def codegen(context, builder, signature, args):
        cfg_a, w_a, v0, width, ngroups, xb_a, ncol, cout_a = args

        def data(i, a):
            return builder.bitcast(
                context.make_array(signature.args[i])(context, builder, a).data, _P)

        cptr, wptr, xptr, optr = data(0, cfg_a), data(1, w_a), data(5, xb_a), data(7, cout_a)
        load = _fn(builder, "llvm.x86.tileloadd64", [_I8, _P, _I64])
        store = _fn(builder, "llvm.x86.tilestored64", [_I8, _P, _I64])
        dp = _fn(builder, "llvm.x86.tdpbusd", [_I8, _I8, _I8])
        zero = _fn(builder, "llvm.x86.tilezero", [_I8])

        def c(v):
            return ir.Constant(v0.type, v)

        def tmm(k):
            return ir.Constant(_I8, k)

        n = builder.udiv(width, c(64))
        bstride = builder.mul(ncol, c(4))
        bsize = builder.mul(bstride, c(16))
        builder.call(_fn(builder, "llvm.x86.ldtilecfg", [_P]), [cptr])
        with cgutils.for_range(builder, ngroups) as grp:
            row0 = builder.mul(builder.add(v0, builder.mul(grp.index, c(16))), width)
            builder.call(zero, [tmm(0)])
            builder.call(zero, [tmm(1)])
            with cgutils.for_range(builder, n) as loop:
                par = builder.and_(loop.index, c(1))
                i64 = builder.mul(loop.index, c(64))
                for k in range(TILE_ROWS):  # the next group's lines, in order
                    _prefetch(builder, wptr, builder.add(builder.add(
                        row0, builder.mul(width, c(TILE_ROWS))), builder.add(
                        builder.mul(loop.index, c(64 * TILE_ROWS)), c(64 * k))), L2)
                for j in range(2):
                    with builder.if_then(builder.icmp_unsigned("==", par, c(j))):
                        builder.call(load, [tmm(2 + j), builder.gep(wptr, [builder.add(
                            row0, i64)]), width])
                        builder.call(load, [tmm(4 + j), builder.gep(xptr, [builder.mul(
                            loop.index, bsize)]), bstride])
                        builder.call(dp, [tmm(j), tmm(2 + j), tmm(4 + j)])
            obase = builder.mul(grp.index, builder.mul(bsize, c(2)))
            builder.call(store, [tmm(0), builder.gep(optr, [obase]), bstride])
            builder.call(store, [tmm(1), builder.gep(optr, [builder.add(obase, bsize)]),
                                 bstride])
        builder.call(_fn(builder, "llvm.x86.tilerelease", []), [])
        return context.get_dummy_value()

    return sig, codegen


@njit(inline="always")
def _tile_bounds(cout, g0, ng, T, mul, off, scale, A, N, par, lo, hi, sums):
    """The bounds of groups g0 .. g0 + ng - 1 from their tile sums (:func:`_screen_rows`) of
    stored codes (``mul * d - off * sum(q)``: :func:`.screen._bound`); their sums into
    ``sums`` [T, V, 2] where it has rows (int7)."""
    for gi in range(ng):
        for t in range(T):
            for k in range(TILE_ROWS):
                v = (g0 + gi) * TILE_ROWS + k
                d1 = np.int64(cout[gi, 0, k, 2 * t]) + np.int64(cout[gi, 1, k, 2 * t])
                d2 = (np.int64(cout[gi, 0, k, 2 * t + 1])
                      + np.int64(cout[gi, 1, k, 2 * t + 1]))
                if sums.shape[1]:
                    sums[t, v, 0], sums[t, v, 1] = d1, d2
                _bounds(v, t, d1, d2, mul, off, scale, A, N, par, lo, hi)


@njit(parallel=True, cache=True, nogil=True)
def screen_amx(W, XQ, XB, cfg, scale, A, N, par, lo, hi, bmax):
    """:func:`.screen.screen_vnni` for 2..8 tokens on AMX tiles: the codes (u8) go from
    memory straight into A tiles, each token's two vectors are two columns of B, so one
    ``tdpbusd`` gives 16 rows x 2T sums. The same integers, so the same bounds (and block
    maxima)."""
    V, width = W.shape
    T = XQ.shape[0]
    groups = V // TILE_ROWS
    gpb = SCREEN_BLOCK // TILE_ROWS
    nblocks = (groups + gpb - 1) // gpb
    xflat = XQ.reshape(-1)
    nosums = np.empty((T, 0, 2), np.int32)
    for b in prange(nblocks):
        g0 = b * gpb
        ng = min(gpb, groups - g0)
        cout = np.empty((ng, 2, TILE_ROWS, 2 * T), np.int32)
        _screen_rows(cfg, W, g0 * TILE_ROWS, width, ng, XB, 2 * T, cout)
        _tile_bounds(cout, g0, ng, T, 1, 128, scale, A, N, par, lo, hi, nosums)
        _block_max(lo, hi, g0 * TILE_ROWS, (g0 + ng) * TILE_ROWS, bmax, b)
    for v in range(groups * TILE_ROWS, V):
        for t in range(T):
            r = _screen_dot(W, v * width, xflat, t * 2 * width, width // 64)
            _bounds(v, t, np.int64(r[0]), np.int64(r[1]), 1, 128, scale, A, N, par, lo, hi)
    if groups * TILE_ROWS < V:
        v0 = groups * TILE_ROWS
        _block_max(lo, hi, v0, V, bmax, v0 // SCREEN_BLOCK)


@njit(parallel=True, cache=True, nogil=True)
def screen_amx7(W, XQ, XB, cfg, scale, A, N, par, lo, hi, bmax, sums):
    """:func:`screen_amx` for int7 codes (:func:`.screen.screen_vbmi7`, whose ``sums`` it
    keeps too): each block's rows are unpacked into a scratch of int8-width rows (in L2) and
    loaded into A tiles from there."""
    V, nbytes = W.shape
    n = nbytes // 56
    width = 64 * n
    T = XQ.shape[0]
    groups = V // TILE_ROWS
    gpb = SCREEN_BLOCK // TILE_ROWS
    nblocks = (groups + gpb - 1) // gpb
    xflat = XQ.reshape(-1)
    for b in prange(nblocks):
        g0 = b * gpb
        ng = min(gpb, groups - g0)
        cout = np.empty((ng, 2, TILE_ROWS, 2 * T), np.int32)
        u = np.empty((ng * TILE_ROWS, width), np.uint8)
        for r in range(ng * TILE_ROWS):
            _unpack7_rows(W, (g0 * TILE_ROWS + r) * nbytes, u[r], n)
        _screen_rows(cfg, u, 0, width, ng, XB, 2 * T, cout)
        _tile_bounds(cout, g0, ng, T, 4, 255, scale, A, N, par, lo, hi, sums)
        _block_max(lo, hi, g0 * TILE_ROWS, (g0 + ng) * TILE_ROWS, bmax, b)
    for v in range(groups * TILE_ROWS, V):
        for t in range(T):
            r = _screen_dot7(W, v * nbytes, xflat, t * 2 * width, n)
            sums[t, v, 0], sums[t, v, 1] = r[0], r[1]
            _bounds(v, t, np.int64(r[0]), np.int64(r[1]), 4, 255, scale, A, N, par, lo, hi)
    if groups * TILE_ROWS < V:
        v0 = groups * TILE_ROWS
        _block_max(lo, hi, v0, V, bmax, v0 // SCREEN_BLOCK)
