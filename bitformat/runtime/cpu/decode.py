"""A whole decode step of one token in one compiled call (the ``cpu`` backend's fast path).

Run layer by layer from Python, a 2B-4T step makes about 400 calls (four mat-vecs, four norms,
attention, activation layouts, reshapes and residual adds per layer). Between two mat-vecs the
second numba thread has gone to sleep and is woken again, and Python's own work adds up: on an
Intel Xeon (2 cores) the 120 mat-vecs of a step took 18.5 ms in a loop by themselves but about
20 ms inside the model, whose whole step (without the LM head) took 26 ms. :func:`decode_row`
runs every layer in one call, and in one parallel region: each thread runs the whole step and
the threads meet at phases (:mod:`.team`): they share each mat-vec's rows and the attention
heads, and one of them runs the small steps between (norms, quantization, residual adds) while
the others wait. As 150 parallel loops (four mat-vecs and the heads per layer) the step took
23.7 ms on an Intel Xeon (2 cores), as one region 21.0 ms (interleaved runs); the batched step
(:func:`decode_rows`, 8 tokens on AMX tiles) 43.4 and 41.6 ms.

The arithmetic is the layer-by-layer path's, step for step, so the bits are the same:
:func:`.ops.norm_quant` and :func:`.ops.glu_norm_quant` for the norms and int8 activations,
:func:`.kernels.slot_activations`'s layout, :func:`.kernels.mm2_vnni`'s sums and epilogue, and
:func:`.ops.attend_one`'s attention (partials per kv head and run of positions, merged; the
same bits whichever thread computes which: ``tests/test_cpu_ops.py`` compares them).

It covers the common case only (:meth:`.backend.CpuBackend.decode_plan`): the vnni kernels,
2-bit matrices (i2_s, stfma) with q/k/v and gate/up stacked in the arena, a family with
sub-norms and ReLU² (BitNet), no q/k norms, no interleaved q/k rows, no per-projection scales.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import get_num_threads, njit, prange

from ...graph import NotLowerable, decoder_shape
from .amx import BLOCK_ROWS, TILE_ROWS, amx_block, amx_tail, block_scratch
from .batch import pair_tokens
from .kernels import (
    KIND_COLPACK,
    KIND_I2S,
    KIND_LUT3,
    LUT_TILE_ROWS,
    _dot2_vnni_pair,
    _lut3_token_tables,
    lut3_padded,
    lut3_row_tables,
    lut3_rows,
    lut3_zero_padding,
)
from .lut3 import table_bytes
from .ops import (
    ATTN_CHUNK,
    PART_V,
    _attend,
    _caches,
    _merge,
    _norm_row,
    _part,
    _quantize_row,
    _rope_heads,
    _store_kv,
)
from .team import SYNC_WIDTH, claim, finish, finish_run, serial, take_guided, wait_done

#: columns of :data:`Plan.mats`: each matrix's offset in the arena, rows, bytes per row, offset
#: of its row scales in ``ws``, kernel kind
OFF, ROWS, BPR, WS, KIND = range(5)
#: the four matrices of a layer, in the order a step reads them
QKV, OUT, GATE_UP, DOWN = range(4)
# (A step passes them to its mat-vec as ``np.intp(QKV)`` and so on: a bare global is typed as
# a literal, and numba compiled the mat-vec once per matrix, four times 1.6 s on a first run.)


@njit(cache=True, error_model="numpy")
def _slots(q, lane, cols, xg):
    """``xg[0, g, m]`` = the activation that multiplies slot g of row byte m: element
    ``(m // lane) * 4 * lane + lane * g + m % lane`` of ``q[0]`` (0 past ``cols``); lane 32:
    i2_s x86, 16: arm64, 1: stfma (:func:`.kernels.slot_activations`)."""
    _slots_row(q, 0, lane, cols, xg)


@njit(inline="always")
def _slots_row(q, t, lane, cols, xg):
    """:func:`_slots` of row t of ``q`` into ``xg[t]``: for each block of ``lane`` row bytes,
    four copies of ``lane`` consecutive activations (the element index once per block, not
    per byte: a :func:`decode_row` step of the full-size 2B-4T went from 25.3 to 24.4 ms,
    medians of interleaved runs on an Intel Xeon with AMX, 2 cores). Lane 1 (stfma rows, as the
    vnni build holds most containers) is a plain four-way split: through the general loop, a
    byte at a time, it took 13.5 us at 2,560 columns (i2_s's lane 32 then 3.9 us), 1.6 ms of a
    2B-4T step."""
    bpr = xg.shape[2]
    if lane == 1:
        full = min(bpr, cols // 4)
        for m in range(full):
            xg[t, 0, m] = q[t, 4 * m]
            xg[t, 1, m] = q[t, 4 * m + 1]
            xg[t, 2, m] = q[t, 4 * m + 2]
            xg[t, 3, m] = q[t, 4 * m + 3]
        for m in range(full, bpr):
            for g in range(4):
                xg[t, g, m] = q[t, 4 * m + g] if 4 * m + g < cols else 0
        return
    # whole blocks of 32 bytes first (i2_s x86): fixed-length copies, 3.9 -> 1.0 us at 2,560
    # columns
    m1 = 0
    if lane == 32:
        m1 = min(bpr, cols // 4) // 32 * 32
        for b in range(m1 // 32):
            for g in range(4):
                for k in range(32):
                    xg[t, g, 32 * b + k] = q[t, 128 * b + 32 * g + k]
    for m0 in range(m1, bpr, lane):
        n = min(lane, bpr - m0)
        for g in range(4):
            e0 = (m0 // lane) * 4 * lane + lane * g
            k1 = max(0, min(n, cols - e0))
            for k in range(k1):
                xg[t, g, m0 + k] = q[t, e0 + k]
            for k in range(k1, n):
                xg[t, g, m0 + k] = 0


@njit(cache=True, error_model="numpy")
def _sum(q, t):
    """The sum of row t of int8 ``q``, in int32."""
    acc = np.int32(0)
    for j in range(q.shape[1]):
        acc += np.int32(q[t, j])
    return acc


@njit(cache=True, error_model="numpy")
def _widest_row(mats):
    """The most bytes per row of a layer's four matrices."""
    bpr = 0
    for w in range(4):
        bpr = max(bpr, mats[0, w, BPR])
    return bpr


@njit(cache=True, error_model="numpy")
def _weight(buf, mats, layer, which):
    off, rows, bpr = mats[layer, which, OFF], mats[layer, which, ROWS], mats[layer, which, BPR]
    return buf[off: off + rows * bpr].reshape((rows, bpr))


def decode_row(buf, mats, ws, gains, eps, lane, heads, kc, vc, pos, cos, sin, hrow):
    """One token through every layer: ``hrow`` float32 [1, dim] (its embedding) becomes the hidden
    state after the last layer, in place; its k and v go to ``kc``/``vc`` [layers, len, KV, d]
    at ``pos``.

    ``mats`` int64 [layers, 4, 5]: per layer the stacked q/k/v, o, stacked gate/up and down
    matrices as rows of ``buf`` (the arena: offset, rows, bytes per row), the offset of their
    row scales in ``ws`` and their kernel kind. ``gains`` float32 [layers, 4, width]: attention
    norm, attention sub-norm, FFN norm (first dim values) and FFN sub-norm (hidden values).

    The whole step is one parallel region: each thread runs :func:`_step` and the threads
    share the mat-vecs' rows and the attention heads phase by phase (:mod:`.team`), one thread
    per thread numba runs now.
    """
    _decode_row(buf, mats, ws, gains, eps, lane, heads, kc, vc, pos, cos, sin, get_num_threads(),
                CHUNK_BYTES, hrow)


@njit(cache=True, parallel=True, nogil=True, error_model="numpy")
def _decode_row(buf, mats, ws, gains, eps, lane, heads, kc, vc, pos, cos, sin, threads, least,
                hrow):
    """:func:`decode_row` by a team of ``threads``, taking at least ``least`` bytes of a
    mat-vec's rows at a time."""
    dim = hrow.shape[1]
    hidden = mats[0, GATE_UP, ROWS] // 2
    width = max(dim, hidden)
    bpr = _widest_row(mats)
    x = np.empty(width, np.float32)
    q8 = np.empty((1, lut3_padded(width)), np.int8)  # lut3 tables read whole blocks
    xg = np.empty(4 * bpr, np.int8)  # the slot layout, for the bytes per row of the next matrix
    tb = np.empty((threads, table_bytes(width)), np.uint8)  # or each thread's lut3 tables
    y = np.empty(mats[0, QKV, ROWS], np.float32)
    o = np.empty(dim, np.float32)
    gu = np.empty(2 * hidden, np.float32)
    sq = np.empty(2, np.float32)  # the activations' scale and their sum, for all threads
    d = 2 * cos.shape[0]  # the head size (a q8_0 cache row is wider)
    qr = np.empty((heads, d), np.float32)  # the query heads, RoPE applied
    parts = np.empty(((pos + ATTN_CHUNK) // ATTN_CHUNK, heads, d + PART_V),
                     np.float32)  # attention partials (:func:`.ops._part`)
    sync = np.zeros((PHASES_PER_LAYER * mats.shape[0] + 1, SYNC_WIDTH), np.int64)
    for _t in prange(threads):
        _step(buf, mats, ws, gains, eps, lane, heads, kc, vc, pos, cos, sin, hrow[0], x, q8,
              xg, tb[_t], y, o, gu, sq, qr, parts, sync, threads, least)


#: phases of :func:`_step` per layer (and one after the last)
PHASES_PER_LAYER = 10


@njit(cache=True, nogil=True, error_model="numpy")
def _step(buf, mats, ws, gains, eps, lane, heads, kc, vc, pos, cos, sin, h, x, q8, xg, tb, y,
          o, gu, sq, qr, parts, sync, threads, least):
    """One thread's part of :func:`decode_row`: every phase in order, serial ones where this
    thread is first to claim them. ``tb`` is this thread's own: for lut3 tiles each thread
    makes the tables of the activations itself (:func:`_tables`)."""
    dim = h.shape[0]
    KV, d = kc.shape[2], 2 * cos.shape[0]
    H = heads
    hidden = mats[0, GATE_UP, ROWS] // 2
    n = pos + 1
    nch = parts.shape[0]  # runs of positions
    scale = np.float32(1.0 / math.sqrt(d))
    f32eps = np.float32(eps)
    ph = 0
    for layer in range(mats.shape[0]):
        # attention: q, k, v of the normed input (and the last layer's FFN output added)
        if serial(sync, ph):
            if layer > 0:
                for j in range(dim):
                    h[j] = h[j] + y[j]
            _activations(h, gains[layer, 0, :dim], f32eps, x, q8, xg, tb, mats, layer,
                         np.intp(QKV), lane, sq)
            finish(sync, ph)
        wait_done(sync, ph, 1)
        _tables(mats, layer, np.intp(QKV), q8, dim, tb)
        _matvec(buf, mats, layer, np.intp(QKV), xg, tb, sq, ws, y, sync, ph + 1, threads,
                least)
        kl, vl = kc[layer], vc[layer]
        if serial(sync, ph + 2):
            _store_kv(y[H * d:(H + KV) * d].reshape((KV, d)),
                      y[(H + KV) * d:(H + 2 * KV) * d].reshape((KV, d)), cos, sin, kl, vl, pos)
            _rope_heads(y[:H * d].reshape((H, d)), cos, sin, qr)
            finish(sync, ph + 2)
        wait_done(sync, ph + 2, 1)
        # the runs of positions' partials (:func:`.ops._part`), merged below. A thread claims
        # its next run before it computes this one, so that run's rows are read from memory
        # while this one's value sums compute from L2
        c = claim(sync, ph + 3)
        warm = False
        while c < nch:
            cn = claim(sync, ph + 3)
            nx0 = min(n, cn * ATTN_CHUNK) if cn < nch else 0
            _part(qr, kl, vl, c * ATTN_CHUNK, min(n, (c + 1) * ATTN_CHUNK), scale, parts[c],
                  nx0, min(n, (cn + 1) * ATTN_CHUNK) if cn < nch else 0, warm)
            finish(sync, ph + 3)
            c, warm = cn, True
        wait_done(sync, ph + 3, nch)
        if serial(sync, ph + 4):
            _merge(parts, nch, o)
            _activations(o, gains[layer, 1, :dim], f32eps, x, q8, xg, tb, mats, layer,
                         np.intp(OUT), lane, sq)
            finish(sync, ph + 4)
        wait_done(sync, ph + 4, 1)
        _tables(mats, layer, np.intp(OUT), q8, dim, tb)
        _matvec(buf, mats, layer, np.intp(OUT), xg, tb, sq, ws, y, sync, ph + 5, threads,
                least)
        # FFN
        if serial(sync, ph + 6):
            for j in range(dim):
                h[j] = h[j] + y[j]
            _activations(h, gains[layer, 2, :dim], f32eps, x, q8, xg, tb, mats, layer,
                         np.intp(GATE_UP), lane, sq)
            finish(sync, ph + 6)
        wait_done(sync, ph + 6, 1)
        _tables(mats, layer, np.intp(GATE_UP), q8, dim, tb)
        _matvec(buf, mats, layer, np.intp(GATE_UP), xg, tb, sq, ws, gu, sync, ph + 7, threads,
                least)
        if serial(sync, ph + 8):
            for j in range(hidden):
                a = max(gu[j], np.float32(0.0))
                gu[j] = a * a * gu[hidden + j]
            _activations(gu[:hidden], gains[layer, 3, :hidden], f32eps, x, q8, xg, tb, mats,
                         layer, np.intp(DOWN), lane, sq)
            finish(sync, ph + 8)
        wait_done(sync, ph + 8, 1)
        _tables(mats, layer, np.intp(DOWN), q8, hidden, tb)
        _matvec(buf, mats, layer, np.intp(DOWN), xg, tb, sq, ws, y, sync, ph + 9, threads,
                least)
        ph += PHASES_PER_LAYER
    if serial(sync, ph):
        for j in range(dim):
            h[j] = h[j] + y[j]
        finish(sync, ph)


@njit(cache=True, error_model="numpy")
def _activations(v, gain, eps, x, q8, xg, tb, mats, layer, which, lane, sq):
    """Norm ``v`` with ``gain``, quantize it to int8 and lay it out for the next mat-vec,
    matrix ``which`` of ``layer``: in slots (``xg``) for 2-bit rows (lut3 tiles read ``q8``
    itself, :func:`_tables`); ``sq`` gets the scale and the sum of the int8 values (exact in
    float32: at most 127 * cols < 2**24)."""
    cols = v.shape[0]
    _norm_row(v, gain, eps, x[:cols])
    sq[0] = _quantize_row(x[:cols], q8, 0)
    sq[1] = np.float32(_sum(q8[:, :cols], 0))
    if mats[layer, which, KIND] == KIND_LUT3:
        lut3_zero_padding(q8[0], cols)  # here, in the serial phase: q8 is shared
    else:
        bpr = mats[layer, which, BPR]
        _slots(q8[:, :cols], lane, cols, xg[:4 * bpr].reshape((1, 4, bpr)))


@njit(inline="always")
def _tables(mats, layer, which, q8, cols, tb):
    """For lut3 tiles, this thread's tables of the ``cols`` activations ``q8`` into its own
    ``tb``: every thread makes them after the serial phase, rather than one thread in it
    while the others wait and then read them from its cache (docs/benchmarks.md, "lut3's
    tables, made by each thread"). It reads ``q8`` and writes only ``tb``, so a thread that
    gets here late (after the others have done the mat-vec and moved on to later phases,
    which rewrite ``q8``) harms nothing: its tables are wrong, and it finds no tiles left."""
    if mats[layer, which, KIND] == KIND_LUT3:
        lut3_row_tables(q8[0], cols, tb)


#: the fewest bytes of weights a thread takes at a time in a mat-vec phase of :func:`_step`
CHUNK_BYTES = 32768


@njit(cache=True, error_model="numpy")
def _matvec(buf, mats, layer, which, xg, tb, sq, ws, out, sync, ph, threads, least):
    """Phase ``ph``: ``out[r] = float32(dot_r - sum q) * ws[r] / s`` (:func:`.kernels.mm2_vnni`,
    one token); returns when all rows are done.

    The row pairs are shared out guided (as OpenMP's ``schedule(guided)``): each take is a
    contiguous run of 1 / (2 * threads) of the rows nobody took yet, at least ``least`` bytes,
    so each thread streams long runs of memory and the takes shrink towards the end, where they
    even out the threads' finish. Equal takes of 32 KiB, interleaved between the threads, cost
    a quarter of the step's speed on an Intel Xeon (2 cores: 29.6 against 23.3 ms).

    lut3 tiles (:func:`_lut3_matvec`) are taken a tile of 64 rows at a time instead."""
    if mats[layer, which, KIND] == KIND_LUT3:
        _lut3_matvec(buf, mats, layer, which, tb[None, :], sq[0:1], ws, out[None, :], sync, ph,
                     threads, least)
        return
    W = _weight(buf, mats, layer, which)
    rows, bpr = W.shape
    s, corr = sq[0], np.int32(sq[1])
    kind = mats[layer, which, KIND]
    w0 = mats[layer, which, WS]
    XG = xg[:4 * bpr].reshape((1, 4, bpr))
    pairs = (rows + 1) // 2
    least = max(1, least // (2 * bpr))
    while True:
        p0, p1 = take_guided(sync, ph, pairs, least, threads)
        if p0 >= p1:
            break
        for p in range(p0, p1):
            r = 2 * p
            d0, d1 = _dot2_vnni_pair(W, r, XG, 0, kind)
            out[r] = np.float32(d0 - corr) * ws[w0 + r] / s
            if r + 1 < rows:
                out[r + 1] = np.float32(d1 - corr) * ws[w0 + r + 1] / s
        finish_run(sync, ph, p1 - p0)
    wait_done(sync, ph, pairs)


@njit(cache=True, error_model="numpy")
def _lut3_matvec(buf, mats, layer, which, tb, s, ws, out, sync, ph, threads, least):
    """Phase ``ph`` for lut3 tiles: ``out[t, r] = float32(dot) * ws[r] / s[t]`` for every token
    t whose tables are ``tb[t]`` (:func:`.kernels.mm_lut3`'s arithmetic), tiles taken guided as
    :func:`_matvec`'s row pairs; returns when all are done."""
    off, rows, bpr = mats[layer, which, OFF], mats[layer, which, ROWS], mats[layer, which, BPR]
    tiles = (rows + LUT_TILE_ROWS - 1) // LUT_TILE_ROWS
    W = buf[off: off + tiles * bpr].reshape((tiles, bpr))
    w0 = mats[layer, which, WS]
    wsl = ws[w0: w0 + rows]
    dots = np.empty(2 * LUT_TILE_ROWS, np.int32)
    while True:
        p0, p1 = take_guided(sync, ph, tiles, max(1, least // bpr), threads)
        if p0 >= p1:
            break
        for p in range(p0, p1):
            lut3_rows(W, p, tb, s, wsl, rows, out, dots)
        finish_run(sync, ph, p1 - p0)
    wait_done(sync, ph, tiles)


@njit(cache=True, error_model="numpy")
def _slots_rows(q, lane, cols, xg):
    """:func:`_slots` for every row t of ``q`` into ``xg[t]``."""
    for t in range(q.shape[0]):
        _slots_row(q, t, lane, cols, xg)


@njit(cache=True, error_model="numpy")
def _tiles_into(q, lane, kind, bpr, out):
    """:func:`.amx.tile_activations` of the slot layout :func:`_slots_rows` gives ``q`` [T,
    cols], straight from ``q``, into ``out`` int32 [bpr // 64, 4, 16, T], slot order reversed
    for i2_s. Dword k of chunk i holds the activations of row bytes ``64 i + 4k .. + 3`` at one
    slot; for lanes of 4 and more (i2_s x86 32, arm64 16) they are 4 consecutive values of
    ``q``, copied as one int32 (element e of q, e a multiple of 4; 0 past ``cols``); stfma
    (lane 1) gathers them byte by byte."""
    T, cols = q.shape
    n = bpr // 64
    out[:] = 0
    if lane % 4 == 0 and cols % 4 == 0:
        q32 = q.reshape(-1).view(np.int32)
        w = cols // 4
        for i in range(n):
            for g in range(4):
                src = 3 - g if kind == KIND_I2S else g
                for k in range(16):
                    m = i * 64 + 4 * k
                    e = (m // lane) * 4 * lane + lane * src + m % lane
                    if e < cols:
                        for t in range(T):
                            out[i, g, k, t] = q32[t * w + e // 4]
        return
    out8 = out.reshape(-1).view(np.int8).reshape((n, 4, 16, T, 4))
    for i in range(n):
        for g in range(4):
            src = 3 - g if kind == KIND_I2S else g
            for k in range(16):
                for b in range(4):
                    m = i * 64 + 4 * k + b
                    e = (m // lane) * 4 * lane + lane * src + m % lane
                    if e < cols:
                        for t in range(T):
                            out8[i, g, k, t, b] = q[t, e]


def decode_rows(buf, mats, ws, gains, eps, lane, heads, cfg, kaddr, vaddr, lens, pos, proto, cos,
                sin, KV, d, h):
    """:func:`decode_row` for T = 2..16 tokens, each on its own cache (a batched decode step):
    ``h`` float32 [T, dim] in place; token t's cache is an array [layers, lens[t], KV, width]
    of ``proto``'s type at addresses ``kaddr[t]``/``vaddr[t]`` (:func:`.ops.attend_rows`), its
    position ``pos[t]``, its RoPE ``cos[t]``/``sin[t]``. The mat-vecs run on AMX tiles (``cfg``:
    :func:`.amx.tile_config` of T, :func:`.amx.amx_block`), a team of threads in one parallel
    region as :func:`decode_row`'s (blocks of ``BLOCK_ROWS`` rows taken guided)."""
    _decode_rows(buf, mats, ws, gains, eps, lane, heads, cfg, kaddr, vaddr, lens, pos, proto, cos,
                 sin, KV, d, get_num_threads(), h)


def decode_rows_vnni(buf, mats, ws, gains, eps, lane, heads, kaddr, vaddr, lens, pos, proto, cos,
                     sin, KV, d, h):
    """:func:`decode_rows` on a CPU without AMX: the mat-vecs are :func:`.batch.mm2_vnni_tokens`'
    (each 64-byte chunk of two rows loaded and split into codes once for up to 8 tokens, the
    same bits as the one-token kernel), row pairs taken guided as :func:`decode_row`'s."""
    _decode_rows_vnni(buf, mats, ws, gains, eps, lane, heads, kaddr, vaddr, lens, pos, proto,
                      cos, sin, KV, d, get_num_threads(), CHUNK_BYTES, h)


@njit(cache=True, error_model="numpy")
def _rows_scratch(mats, T, dim):
    """The arrays a batched step's team shares: int8 activations (model width and FFN width),
    their scales and sums, the mat-vec outputs (q|k|v, o, gate|up, the gated FFN input) and the
    phase counters."""
    hidden = mats[0, GATE_UP, ROWS] // 2
    return (np.empty((T, dim), np.int8), np.empty((T, hidden), np.int8),
            np.empty(T, np.float32), np.empty(T, np.int32),
            np.empty((T, mats[0, QKV, ROWS]), np.float32), np.empty((T, dim), np.float32),
            np.empty((T, 2 * hidden), np.float32), np.empty((T, hidden), np.float32),
            np.zeros((PHASES_PER_ROWS_LAYER * mats.shape[0] + 1, SYNC_WIDTH), np.int64))


@njit(cache=True, parallel=True, nogil=True, error_model="numpy")
def _decode_rows(buf, mats, ws, gains, eps, lane, heads, cfg, kaddr, vaddr, lens, pos, proto,
                 cos, sin, KV, d, threads, h):
    """:func:`decode_rows` by a team of ``threads``."""
    T, dim = h.shape
    bpr = _widest_row(mats)
    q8, q8h, s, corr, y, o, gu, g, sync = _rows_scratch(mats, T, dim)
    xg = np.empty(T * 4 * bpr, np.int8)  # the one-token slots, for rows past the last 16
    xb = np.empty(bpr // 64 * 4 * 16 * T, np.int32)  # the AMX activation tiles
    for _t in prange(threads):
        _step_rows(buf, mats, ws, gains, eps, lane, heads, cfg, kaddr, vaddr, lens, pos, proto,
                   cos, sin, KV, d, h, q8, q8h, s, corr, xg, xb, y, o, gu, g, sync, threads)


@njit(cache=True, parallel=True, nogil=True, error_model="numpy")
def _decode_rows_vnni(buf, mats, ws, gains, eps, lane, heads, kaddr, vaddr, lens, pos, proto,
                      cos, sin, KV, d, threads, least, h):
    """:func:`decode_rows_vnni` by a team of ``threads``, taking at least ``least`` bytes of a
    mat-vec's rows at a time."""
    T, dim = h.shape
    q8, q8h, s, corr, y, o, gu, g, sync = _rows_scratch(mats, T, dim)
    xg = np.empty(T * 4 * _widest_row(mats), np.int8)  # every token's slot layout
    tb = np.empty((T, table_bytes(max(dim, g.shape[1]))), np.uint8)  # or lut3 tables
    for _t in prange(threads):
        _step_rows_vnni(buf, mats, ws, gains, eps, lane, heads, kaddr, vaddr, lens, pos, proto,
                        cos, sin, KV, d, h, q8, q8h, s, corr, xg, tb, y, o, gu, g, sync,
                        threads, least)


#: phases of :func:`_step_rows` per layer (and one after the last)
PHASES_PER_ROWS_LAYER = 14


@njit(cache=True, nogil=True, error_model="numpy")
def _step_rows(buf, mats, ws, gains, eps, lane, heads, cfg, kaddr, vaddr, lens, pos, proto, cos,
               sin, KV, d, h, q8, q8h, s, corr, xg, xb, y, o, gu, g, sync, threads):
    """One thread's part of :func:`decode_rows` (the phases of :func:`_step`; the norms and
    quantizations shared out by token, the activation layouts serial)."""
    dim = h.shape[1]
    f32eps = np.float32(eps)
    abuf, cout, f = block_scratch(h.shape[0])
    x = np.empty(max(dim, g.shape[1]), np.float32)
    ph = 0
    for layer in range(mats.shape[0]):
        _norm_tokens(h, y, layer > 0, gains[layer, 0, :dim], f32eps, q8, s, x, sync, ph)
        _amx_matvec(buf, mats, layer, np.intp(QKV), q8, lane, xg, xb, cfg, corr, s, ws, y, sync,
                    ph + 1, threads, abuf, cout, f)
        _attend_tokens(y, o, heads, kaddr, vaddr, lens, pos, proto, cos, sin, KV, d, layer,
                       sync, ph + 3)
        _norm_tokens(o, y, False, gains[layer, 1, :dim], f32eps, q8, s, x, sync, ph + 5)
        _amx_matvec(buf, mats, layer, np.intp(OUT), q8, lane, xg, xb, cfg, corr, s, ws, y, sync,
                    ph + 6, threads, abuf, cout, f)
        # FFN
        _norm_tokens(h, y, True, gains[layer, 2, :dim], f32eps, q8, s, x, sync, ph + 8)
        _amx_matvec(buf, mats, layer, np.intp(GATE_UP), q8, lane, xg, xb, cfg, corr, s, ws, gu,
                    sync, ph + 9, threads, abuf, cout, f)
        _glu_tokens(gu, g, gains[layer, 3], f32eps, q8h, s, x, sync, ph + 11)
        _amx_matvec(buf, mats, layer, np.intp(DOWN), q8h, lane, xg, xb, cfg, corr, s, ws, y, sync,
                    ph + 12, threads, abuf, cout, f)
        ph += PHASES_PER_ROWS_LAYER
    _add_tokens(h, y, sync, ph)


@njit(cache=True, nogil=True, error_model="numpy")
def _step_rows_vnni(buf, mats, ws, gains, eps, lane, heads, kaddr, vaddr, lens, pos, proto, cos,
                    sin, KV, d, h, q8, q8h, s, corr, xg, tb, y, o, gu, g, sync, threads, least):
    """One thread's part of :func:`decode_rows_vnni`: :func:`_step_rows`' phases, its mat-vecs
    :func:`_tokens_matvec`'s."""
    dim = h.shape[1]
    f32eps = np.float32(eps)
    x = np.empty(max(dim, g.shape[1]), np.float32)
    xp = np.empty(lut3_padded(max(dim, g.shape[1])), np.int8)  # a token's row, for its tables
    ph = 0
    for layer in range(mats.shape[0]):
        _norm_tokens(h, y, layer > 0, gains[layer, 0, :dim], f32eps, q8, s, x, sync, ph)
        _tokens_matvec(buf, mats, layer, np.intp(QKV), q8, lane, xg, tb, xp, corr, s, ws, y, sync,
                       ph + 1, threads, least)
        _attend_tokens(y, o, heads, kaddr, vaddr, lens, pos, proto, cos, sin, KV, d, layer,
                       sync, ph + 3)
        _norm_tokens(o, y, False, gains[layer, 1, :dim], f32eps, q8, s, x, sync, ph + 5)
        _tokens_matvec(buf, mats, layer, np.intp(OUT), q8, lane, xg, tb, xp, corr, s, ws, y, sync,
                       ph + 6, threads, least)
        # FFN
        _norm_tokens(h, y, True, gains[layer, 2, :dim], f32eps, q8, s, x, sync, ph + 8)
        _tokens_matvec(buf, mats, layer, np.intp(GATE_UP), q8, lane, xg, tb, xp, corr, s, ws, gu,
                       sync, ph + 9, threads, least)
        _glu_tokens(gu, g, gains[layer, 3], f32eps, q8h, s, x, sync, ph + 11)
        _tokens_matvec(buf, mats, layer, np.intp(DOWN), q8h, lane, xg, tb, xp, corr, s, ws, y,
                       sync, ph + 12, threads, least)
        ph += PHASES_PER_ROWS_LAYER
    _add_tokens(h, y, sync, ph)


@njit(cache=True, nogil=True, error_model="numpy")
def _attend_tokens(y, o, H, kaddr, vaddr, lens, pos, proto, cos, sin, KV, d, layer, sync, ph):
    """Phases ``ph`` (serial: every token's k and v, from q|k|v ``y``, into its cache) and
    ``ph + 1`` (a token's attention at a time into ``o``)."""
    T = y.shape[0]
    if serial(sync, ph):
        for t in range(T):
            kc, vc = _caches(kaddr, vaddr, lens, t, layer, KV, proto)
            _store_kv(y[t, H * d:(H + KV) * d].reshape((KV, d)),
                      y[t, (H + KV) * d:(H + 2 * KV) * d].reshape((KV, d)), cos[t], sin[t],
                      kc, vc, pos[t])
        finish(sync, ph)
    wait_done(sync, ph, 1)
    while True:
        t = claim(sync, ph + 1)
        if t >= T:
            break
        kc, vc = _caches(kaddr, vaddr, lens, t, layer, KV, proto)
        qr = np.empty((H, d), np.float32)
        _rope_heads(y[t, :H * d].reshape((H, d)), cos[t], sin[t], qr)
        _attend(qr, kc, vc, pos[t] + 1, o[t])
        finish(sync, ph + 1)
    wait_done(sync, ph + 1, T)


@njit(cache=True, nogil=True, error_model="numpy")
def _glu_tokens(gu, g, gain, eps, q, s, x, sync, ph):
    """Phase ``ph``, a token at a time: ReLU^2 gating of gate|up ``gu`` into ``g``, normed with
    ``gain`` and quantized into ``q[t]``, its scale into ``s[t]``."""
    T, hidden = g.shape
    while True:
        t = claim(sync, ph)
        if t >= T:
            break
        for j in range(hidden):
            a = max(gu[t, j], np.float32(0.0))
            g[t, j] = a * a * gu[t, hidden + j]
        _norm_row(g[t], gain[:hidden], eps, x[:hidden])
        s[t] = _quantize_row(x[:hidden], q, t)
        finish(sync, ph)
    wait_done(sync, ph, T)


@njit(cache=True, nogil=True, error_model="numpy")
def _add_tokens(h, y, sync, ph):
    """Phase ``ph``, a token at a time: the last layer's output ``y`` added to ``h``."""
    T, dim = h.shape
    while True:
        t = claim(sync, ph)
        if t >= T:
            break
        for j in range(dim):
            h[t, j] = h[t, j] + y[t, j]
        finish(sync, ph)


@njit(cache=True, error_model="numpy")
def _norm_tokens(v, y, add, gain, eps, q, s, x, sync, ph):
    """Phase ``ph``, a token at a time: row t of ``v`` (first ``v[t] += y[t]`` if ``add``)
    normed with ``gain`` into ``x``, quantized into ``q[t]``, its scale into ``s[t]``
    (:func:`.ops.norm_quant_rows`' arithmetic)."""
    T, cols = v.shape
    while True:
        t = claim(sync, ph)
        if t >= T:
            break
        if add:
            for j in range(cols):
                v[t, j] = v[t, j] + y[t, j]
        _norm_row(v[t], gain, eps, x[:cols])
        s[t] = _quantize_row(x[:cols], q, t)
        finish(sync, ph)
    wait_done(sync, ph, T)


@njit(cache=True, error_model="numpy")
def _amx_inputs(mats, layer, which, q, lane, xg, xb, corr):
    """What :func:`_amx_matvec` of matrix ``which`` reads of the int8 activations ``q`` [T,
    cols]: their sums, the AMX tiles (:func:`_tiles_into`) and, where the matrix has rows past
    its last group of 16, the one-token slot layout."""
    T, cols = q.shape
    rows, bpr = mats[layer, which, ROWS], mats[layer, which, BPR]
    if rows % TILE_ROWS:
        _slots_rows(q, lane, cols, xg[:T * 4 * bpr].reshape((T, 4, bpr)))
    for t in range(T):
        corr[t] = _sum(q, t)
    n = bpr // 64
    _tiles_into(q, lane, mats[layer, which, KIND], bpr, xb[:n * 64 * T].reshape((n, 4, 16, T)))


@njit(cache=True, error_model="numpy")
def _amx_matvec(buf, mats, layer, which, q, lane, xg, xb, cfg, corr, s, ws, out, sync, ph,
                threads, abuf, cout, f):
    """Phases ``ph`` and ``ph + 1``: :func:`_amx_inputs` of ``q`` (serial), then
    :func:`.amx.mm2_amx_tokens` of matrix ``which`` into ``out`` [T, rows] (the same kernel
    and bits), its blocks of ``BLOCK_ROWS`` rows taken guided (as :func:`_matvec`'s row pairs),
    rows past the last group of 16 as one more block."""
    if serial(sync, ph):
        _amx_inputs(mats, layer, which, q, lane, xg, xb, corr)
        finish(sync, ph)
    wait_done(sync, ph, 1)
    ph += 1
    W = _weight(buf, mats, layer, which)
    rows, bpr = W.shape
    T = q.shape[0]
    kind = mats[layer, which, KIND]
    w0 = mats[layer, which, WS]
    wsl = ws[w0: w0 + rows]
    n = bpr // 64
    XB = xb[:n * 64 * T].reshape((n, 4, 16, T))
    nblocks = (rows // TILE_ROWS * TILE_ROWS + BLOCK_ROWS - 1) // BLOCK_ROWS
    units = nblocks + (1 if rows % TILE_ROWS else 0)
    while True:
        b0, b1 = take_guided(sync, ph, units, 1, threads)
        if b0 >= b1:
            break
        for b in range(b0, b1):
            if b < nblocks:
                amx_block(W, b, XB, cfg, corr, s, wsl, out, abuf, cout, f)
            else:
                amx_tail(W, xg[:T * 4 * bpr].reshape((T, 4, bpr)), kind, corr, s, wsl, out)
        finish_run(sync, ph, b1 - b0)
    wait_done(sync, ph, units)


@njit(cache=True, error_model="numpy")
def _tokens_matvec(buf, mats, layer, which, q, lane, xg, tb, xp, corr, s, ws, out, sync, ph,
                   threads, least):
    """Phases ``ph`` (serial: every token's slot layout and sum) and ``ph + 1``:
    :func:`.batch.mm2_vnni_tokens` of matrix ``which`` into ``out`` [T, rows] (the same kernel
    and bits), its row pairs taken guided as :func:`_matvec`'s; for lut3 tiles every token's
    tables (a token at a time, shared out between the threads: ``xp`` is this thread's row
    scratch), then :func:`_lut3_matvec`."""
    T, cols = q.shape
    if mats[layer, which, KIND] == KIND_LUT3:
        n = table_bytes(cols)
        TB = tb.reshape(-1)[:T * n].reshape((T, n))
        while True:
            t = claim(sync, ph)
            if t >= T:
                break
            _lut3_token_tables(q, t, TB, xp)
            finish(sync, ph)
        wait_done(sync, ph, T)
        _lut3_matvec(buf, mats, layer, which, TB, s, ws, out, sync, ph + 1, threads, least)
        return
    W = _weight(buf, mats, layer, which)
    rows, bpr = W.shape
    XG = xg[:T * 4 * bpr].reshape((T, 4, bpr))
    if serial(sync, ph):
        _slots_rows(q, lane, cols, XG)
        for t in range(T):
            corr[t] = _sum(q, t)
        finish(sync, ph)
    wait_done(sync, ph, 1)
    ph += 1
    kind = mats[layer, which, KIND]
    w0 = mats[layer, which, WS]
    wsl = ws[w0: w0 + rows]
    pairs = (rows + 1) // 2
    least = max(1, least // (2 * bpr))
    d = np.empty((2, 8), np.int32)
    while True:
        p0, p1 = take_guided(sync, ph, pairs, least, threads)
        if p0 >= p1:
            break
        for p in range(p0, p1):
            pair_tokens(W, 2 * p, XG, corr, s, wsl, kind, out, d)
        finish_run(sync, ph, p1 - p0)
    wait_done(sync, ph, pairs)


#: slot layout -> lane of :func:`_slots`
LANES = {"x86": 32, "arm64": 16, "plain": 1, "lut3": 0}


@dataclass
class Plan:
    """A network's weights as :func:`decode_row` reads them."""

    mats: np.ndarray  # int64 [layers, 4, 5]
    ws: np.ndarray  # float32: every matrix's row scales
    gains: np.ndarray  # float32 [layers, 4, max(dim, hidden)]
    eps: float
    lane: int
    heads: int
    kv_heads: int
    head_dim: int
    nbytes: int  # the matrices' bytes (the thread picker's size)
    amx: bool  # every row a whole number of 64-byte chunks (AMX tiles: :func:`decode_rows`)

    @classmethod
    def of(cls, net, be) -> Plan | None:
        """The plan for ``net`` (:class:`..models.base.Transformer`) on cpu backend ``be``, or
        None where :func:`decode_row` does not compute what ``net.forward_hidden`` does: the
        family's graph (:mod:`bitformat.graph`) lowered onto this step's phases, which are a
        :func:`~bitformat.graph.decoder_graph` with both sub-norms and ReLU^2."""
        a = net.args
        try:  # the layer this step computes: a decoder_graph with sub-norms and ReLU^2
            shape = decoder_shape(net.graph)
        except NotLowerable:
            return None
        norms = (shape.attn_norm, shape.attn_sub_norm, shape.ffn_norm, shape.ffn_sub_norm)
        if (shape.activation != "relu2" or None in norms or shape.qk_norm is not None
                or shape.interleaved_qk or be._arena.buf is None):
            return None
        buf = be._arena.buf
        mats = np.zeros((a.n_layers, 4, 5), np.int64)
        scales, at, layouts = [], 0, set()
        gains = np.zeros((a.n_layers, 4, max(a.dim, a.hidden_dim)), np.float32)
        for i, blk in enumerate(net.blocks):
            if blk.out_scale:
                return None
            ws = [blk.stacked.get(shape.qkv), blk.proj[shape.out],
                  blk.stacked.get(shape.gate_up), blk.proj[shape.down]]
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
            for j, n in enumerate(norms):
                g = blk.vectors[n]
                gains[i, j, :g.size] = g
        if len(layouts) != 1 or (mats[:, GATE_UP, ROWS] != 2 * a.hidden_dim).any():
            return None
        tiles = mats[..., KIND] == KIND_LUT3
        held = np.where(tiles, -(-mats[..., ROWS] // LUT_TILE_ROWS), mats[..., ROWS])
        layout = layouts.pop()
        return cls(mats, np.concatenate(scales), gains, float(a.norm_eps), LANES[layout],
                   a.n_heads, a.n_kv_heads, a.head_dim, int((held * mats[..., BPR]).sum()),
                   layout != "lut3" and bool((mats[..., BPR] % 64 == 0).all()))
