"""``rans`` matrices decoded once at load into stfma rows (``decode="load"``, the default).

Every stream is decoded once, :data:`~.rans_decode.LANES` row groups in lock-step per thread as
in the cpu backend's fused kernels, with the codec's decode step and stream start
(:mod:`.rans_decode`), into the stfma layout: 16 codes ``trit + 1`` per u32, column ``c`` at
bits ``2c`` of its row, dead rows and columns as trit 0 (code 1). A row whose columns are all
live is packed straight from the symbols, 10 bits each (:data:`CODES10`); with dead columns the
live codes are packed first and each run of consecutive live columns is copied into place
(:func:`live_runs`); single-trit streams go through a per-column gather. Every stream is
checked as it ends (state 0, every word read, last word not 0, padding trits 0), so nothing is
trusted that the format's reader would refuse. The 2-bit kernels then read the rows like any
stfma matrix, and the backend stacks q/k/v and gate/up as for the other containers.

The kernels below call ``_step`` and ``_start`` from :mod:`.rans_decode`. The helpers are
separate numba functions, not inlined into the caller's IR (``inline="always"``): LLVM still
inlines them, the decode runs as fast (2B-4T's rans file loaded in a median 8.34 s against 8.54
s, three alternating rounds), and ``rans_rows`` compiles in about 4 s instead of 110 s on a
2-core AMD EPYC. :mod:`bitformat.runtime.cpu.kernel_cache` clears the cache when any file of
this package or of the cpu backend changes.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..errors import MetadataError
from ..formats import rans as R
from ..io.mapping import drop_pages
from ..io.model import Model
from . import rans_tables as rt
from .rans_decode import _JIT, _U, LANES, RansWeight, _start, _step, rans_weight, symbol_digits

#: stfma codes of each 5-trit symbol: trit d (column order) as code trit + 1 at bits 2d
CODES10 = ((rt.GROUP5_TRITS.astype(np.uint32) + 1) << (2 * np.arange(5, dtype=np.uint32))
           ).sum(axis=1).astype(np.uint32)
PAD_WORD = 0x55555555  # sixteen codes 1 (trit 0): stfma's row padding


def stfma_row_bytes(cols: int) -> int:
    """Bytes of one stfma row: 16 codes per u32."""
    return -(-cols // 16) * 4


def decode_to_rows(w: RansWeight, out: np.ndarray) -> np.ndarray:
    """Decode every stream of ``w`` once into ``out`` (uint8 ``[rows, stfma_row_bytes]``,
    C-contiguous): the stfma layout, dead rows and columns as trit 0, so the 2-bit kernels read
    it like any stfma matrix. Returns the per-stream status (uint8, 0: the stream ended in
    state 0 with every word read, its last word was not 0 and its padding trits were 0)."""
    rows, width = out.shape
    dead = np.ones(rows, bool)
    dead[w.lrows] = False
    out[dead] = 0x55
    status = np.zeros(w.word_off.size - 1, np.uint8)
    if not w.lrows.size:
        return status
    n_sym = int(w.m0[-1])
    if w.group != 5:
        mode = GATHER
    else:
        mode = RUNS if w.lcols.size else STRAIGHT
    colpos = np.zeros(1, np.int32)
    if mode == GATHER:
        colpos = np.full(width * 4, n_sym * w.group, np.int32)  # default: the sentinel code 1
        live = w.lcols if w.lcols.size else np.arange(w.cols)
        colpos[live] = np.arange(live.size, dtype=np.int32)
    rans_rows(w.data, w.word_off, w.lrows, w.k, w.p, w.m0, w.cls, w.dec, w.group,
              w.n_live_cols, mode, colpos, live_runs(w.lcols), CODES10,
              symbol_digits(w.group), out, out.view(np.uint32), status)
    return status


def live_runs(lcols: np.ndarray) -> np.ndarray:
    """int64 ``[R, 3]``: (first column, first live index, length) of each run of consecutive
    live columns."""
    if not lcols.size:
        return np.zeros((0, 3), np.int64)
    brk = np.flatnonzero(np.diff(lcols) != 1) + 1
    starts = np.concatenate([[0], brk])
    ends = np.concatenate([brk, [lcols.size]])
    return np.stack([lcols[starts], starts, ends - starts], axis=1).astype(np.int64)


STRAIGHT, RUNS, GATHER = 0, 1, 2  # how a decoded row reaches its columns (decode_to_rows)


def decode_matrix(model: Model, name: str, out: np.ndarray | None = None, *,
                  validate: bool = True, colsets: dict[bytes, int] | None = None
                  ) -> tuple[np.ndarray, np.float32]:
    """Rans tensor ``name`` of ``model`` decoded into stfma rows: ``(rows, scale)``.

    ``out`` (uint8 ``[rows, stfma_row_bytes(cols)]``, e.g. a slot of the weight arena)
    receives them, else a new array. Every field is checked by the format's parser (the CRC-32
    when ``validate``) and every stream as it is decoded; the tensor's mapped words are then
    given back (:func:`~bitformat.io.mapping.drop_pages`), so only the rows stay resident.
    """
    rows, cols = model.entry(name).shape
    scale = model.get(f"bitformat.tensor.{name}.scale")
    if not isinstance(scale, float):
        raise MetadataError("missing its per-tensor scale", path=model.path, tensor=name)
    raw = model.plain(name)[1]
    w = rans_weight(raw, rows, cols, scale, name, {} if colsets is None else colsets,
                    check_crc=validate, path=model.path)
    if out is None:
        out = np.empty((rows, stfma_row_bytes(cols)), np.uint8)
    status = decode_to_rows(w, out)
    if status.any():
        p = R.parse(raw, rows, cols, scale=scale, path=model.path, name=name, check_crc=False)
        raise p.corrupt_stream(int(np.flatnonzero(status)[0]))
    drop_pages(raw)
    return out, w.scale


@njit(**_JIT)
def _ended(state, pos, lo, words, word_off, i):
    """1 unless stream i ended in state 0 with every word read and its last word is not 0."""
    hi = word_off[i + 1]
    bad_start = hi > word_off[i] and words[hi - 1] == 0
    return np.uint8(0 if (state == 0 and pos == lo and not bad_start) else 1)


@njit(**_JIT)
def _pack10(sym, n_sym, codes10, dst, width):
    """The codes of ``n_sym`` 5-trit symbols as a 2-bit stream (10 bits a symbol) in the first
    ``width`` words of ``dst``; the last word is completed with code 1."""
    acc = _U(0)
    nb = _U(0)
    w = 0
    for m in range(n_sym):
        acc |= _U(codes10[sym[np.uintp(m)]]) << nb
        nb += _U(10)
        if nb >= _U(32):
            if w < width:
                dst[w] = np.uint32(acc & _U(0xFFFFFFFF))
            w += 1
            acc >>= _U(32)
            nb -= _U(32)
    if w < width:
        dst[w] = np.uint32((acc & ((_U(1) << nb) - _U(1))) | ((_U(PAD_WORD) << nb)
                                                              & _U(0xFFFFFFFF)))
        w += 1
    while w < width:
        dst[w] = np.uint32(PAD_WORD)
        w += 1


@njit(**_JIT)
def _copy_bits(src, s_bit, dst, d_bit, n_bits):
    """Bits ``s_bit ..`` of the little-endian bit stream ``src`` (with a spare word at its
    end) over bits ``d_bit ..`` of ``dst``, ``n_bits`` of them."""
    while n_bits > 0:
        dsh = d_bit & 31
        m = min(n_bits, 32 - dsh)
        sw = s_bit >> 5
        x = ((_U(src[sw]) | (_U(src[sw + 1]) << _U(32))) >> _U(s_bit & 31)) \
            & ((_U(1) << _U(m)) - _U(1))
        mask = ((_U(1) << _U(m)) - _U(1)) << _U(dsh)
        dw = d_bit >> 5
        dst[dw] = np.uint32((_U(dst[dw]) & ~mask) | (x << _U(dsh)))
        s_bit += m
        d_bit += m
        n_bits -= m


@njit(**_JIT)
def _emit(sym, n_sym, group, n_live, mode, colpos, runs, codes10, digits, live, lbits, out8,
          out32, row):
    """One live row's symbols -> its 2-bit codes in row ``row`` of ``out``; 1 if a padding
    trit of the last symbol is not zero."""
    if mode != GATHER:
        last = sym[np.uintp(n_sym - 1)]
        for d in range(n_live - 5 * (n_sym - 1), 5):
            if digits[last, d] != 0:
                return 1
        if mode == STRAIGHT:  # every column live: 10 bits a symbol, straight into the row
            _pack10(sym, n_sym, codes10, out32[row], out32.shape[1])
            return 0
        _pack10(sym, n_sym, codes10, lbits, lbits.shape[0] - 1)  # the live columns' codes
        dst = out32[row]
        for w in range(dst.shape[0]):
            dst[w] = np.uint32(PAD_WORD)
        for r in range(runs.shape[0]):  # each run of live columns into its place
            _copy_bits(lbits, 2 * runs[r, 1], dst, 2 * runs[r, 0], 2 * runs[r, 2])
        return 0
    for m in range(n_sym):
        x = sym[np.uintp(m)]
        for d in range(group):
            live[m * group + d] = np.uint8(digits[x, d] + 1)
    for c in range(n_live, n_sym * group):
        if live[c] != 1:
            return 1
    live[n_sym * group] = 1  # what dead and padding columns read
    for b in range(out8.shape[1]):
        c = 4 * b
        out8[row, b] = (live[colpos[c]] | (live[colpos[c + 1]] << 2)
                        | (live[colpos[c + 2]] << 4) | (live[colpos[c + 3]] << 6))
    return 0


@njit(**_JIT)
def _rows_lanes(words, word_off, lrows, k, p, m0, cls, dec, group, n_live, mode, colpos, runs,
                codes10, digits, out8, out32, status, g0, sym, live, lbits):
    """LANES full row groups g0.. in lock-step (as :func:`_lanes`), symbols to ``sym``."""
    for ri in range(k):
        r = g0 * k + ri
        d0, d1, d2, d3 = dec[cls[r]], dec[cls[r + k]], dec[cls[r + 2 * k]], dec[cls[r + 3 * k]]
        d4, d5 = dec[cls[r + 4 * k]], dec[cls[r + 5 * k]]
        d6, d7 = dec[cls[r + 6 * k]], dec[cls[r + 7 * k]]
        for j in range(p):
            i = g0 * p + j
            if ri == 0:  # p > 1 means k == 1: every piece is a stream of its own
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
                sym[0, m], s0, p0 = _step(s0, p0, l0, words, d0)
                sym[1, m], s1, p1 = _step(s1, p1, l1, words, d1)
                sym[2, m], s2, p2 = _step(s2, p2, l2, words, d2)
                sym[3, m], s3, p3 = _step(s3, p3, l3, words, d3)
                sym[4, m], s4, p4 = _step(s4, p4, l4, words, d4)
                sym[5, m], s5, p5 = _step(s5, p5, l5, words, d5)
                sym[6, m], s6, p6 = _step(s6, p6, l6, words, d6)
                sym[7, m], s7, p7 = _step(s7, p7, l7, words, d7)
            if ri == k - 1:  # the streams end here
                status[i] = _ended(s0, p0, l0, words, word_off, i)
                status[i + p] = _ended(s1, p1, l1, words, word_off, i + p)
                status[i + 2 * p] = _ended(s2, p2, l2, words, word_off, i + 2 * p)
                status[i + 3 * p] = _ended(s3, p3, l3, words, word_off, i + 3 * p)
                status[i + 4 * p] = _ended(s4, p4, l4, words, word_off, i + 4 * p)
                status[i + 5 * p] = _ended(s5, p5, l5, words, word_off, i + 5 * p)
                status[i + 6 * p] = _ended(s6, p6, l6, words, word_off, i + 6 * p)
                status[i + 7 * p] = _ended(s7, p7, l7, words, word_off, i + 7 * p)
        n_sym = m0[p]
        for lane in range(LANES):
            if _emit(sym[lane], n_sym, group, n_live, mode, colpos, runs, codes10, digits,
                     live, lbits, out8, out32, lrows[r + lane * k]):
                status[(g0 + lane) * p + p - 1] = 1  # the row's last piece holds its padding


@njit(**_JIT)
def _rows_one(words, word_off, lrows, k, p, m0, cls, dec, group, n_live, mode, colpos, runs,
              codes10, digits, out8, out32, status, g, sym, live, lbits):
    """Row group g alone (the groups left over from the lock-step blocks)."""
    r1 = min(lrows.shape[0], g * k + k)
    for r in range(g * k, r1):
        d = dec[cls[r]]
        for j in range(p):
            i = g * p + j
            if r == g * k:
                st, pos, lo = _start(words, word_off, i)
            for mi in range(m0[j], m0[j + 1]):
                m = np.uintp(mi)
                sym[0, m], st, pos = _step(st, pos, lo, words, d)
            if r == r1 - 1:
                status[i] = _ended(st, pos, lo, words, word_off, i)
        if _emit(sym[0], m0[p], group, n_live, mode, colpos, runs, codes10, digits, live, lbits,
                 out8, out32, lrows[r]):
            status[g * p + p - 1] = 1


@njit(parallel=True, **_JIT)
def rans_rows(words, word_off, lrows, k, p, m0, cls, dec, group, n_live, mode, colpos, runs,
              codes10, digits, out8, out32, status):
    """Decode every stream into the 2-bit rows ``out8`` / ``out32`` (two views of one
    uint8 ``[rows, W * 4]`` array; dead rows are the caller's); per-stream ``status``."""
    n_rows = lrows.shape[0]
    n_groups = (n_rows + k - 1) // k
    blocks = (n_rows // k) // LANES
    n_sym = m0[p]
    for b in prange(blocks + n_groups - blocks * LANES):
        sym = np.empty((LANES, n_sym), np.uint8)
        live = np.empty(n_sym * group + 1, np.uint8)
        lbits = np.zeros((10 * n_sym + 31) // 32 + 2, np.uint32)
        if b < blocks:
            _rows_lanes(words, word_off, lrows, k, p, m0, cls, dec, group, n_live, mode,
                        colpos, runs, codes10, digits, out8, out32, status, b * LANES, sym,
                        live, lbits)
        else:
            _rows_one(words, word_off, lrows, k, p, m0, cls, dec, group, n_live, mode, colpos,
                      runs, codes10, digits, out8, out32, status, blocks * LANES + b - blocks,
                      sym, live, lbits)
