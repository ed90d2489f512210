"""numba kernels of the ``rans_float`` coding (byte layout and checks: :mod:`.rans_float`).

Values are the raw 16-bit patterns (uint16) of IEEE halves or bfloat16, ``E`` exponent bits
over ``M`` mantissa bits (f16: 5/10, bf16: 8/7)::

    bit 15: sign s     bits M..14: exponent field e     bits 0..M-1: mantissa m

The exponent becomes a symbol (its rank among the exponents that occur) and is rANS-coded;
``s`` and the top ``M - z`` bits of ``m`` go into a fixed-width plane of ``b = 1 + M - z`` bits a
value; the low ``z`` bits, zero for almost every value, are kept only for values of "wide"
exponents (a plane of their own) and for the exceptions (index and bits). Every stream is
one constriction ``DefaultAnsCoder`` stream (:mod:`bitformat.codecs.rans_kernels`: 64-bit state,
32-bit words, 24-bit precision, frequencies multiples of 2^12); the encoder's steps are
imported from there and the one-lookup decode step from :mod:`bitformat.codecs.rans_decode`,
so the coder is defined in one place.

Stream s holds values ``s*n .. min(N, s*n + n) - 1`` in flat (row-major) order, each coded with
the table of its row's class. Importing this module imports numba; :mod:`.rans_float` loads
it on first use.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..codecs.rans_decode import _step
from ..codecs.rans_kernels import _flush, _init_state, _push

_U = np.uint64
_JIT = dict(cache=True, nogil=True, error_model="numpy")
HIST_CHUNKS = 16  # partial histograms summed at the end (one per chunk of the input)


# -- statistics ------------------------------------------------------------------------------------
@njit(parallel=True, **_JIT)
def histogram16(v, out):
    """``out[p]`` (int64 [65536], zeroed by the caller) = how often pattern p occurs in v."""
    n = v.shape[0]
    part = np.zeros((HIST_CHUNKS, 65536), np.int64)
    for c in prange(HIST_CHUNKS):
        h = part[c]
        for i in range(c * n // HIST_CHUNKS, (c + 1) * n // HIST_CHUNKS):
            h[v[i]] += 1
    for c in range(HIST_CHUNKS):
        for p in range(65536):
            out[p] += part[c, p]


@njit(parallel=True, **_JIT)
def row_symbol_counts(v, cols, shift, emask, rank, counts):
    """``counts[r, a]`` (int32, zeroed): values of row r whose exponent has rank a."""
    for r in prange(counts.shape[0]):
        for i in range(r * cols, r * cols + cols):
            counts[r, rank[(v[i] >> shift) & emask]] += 1


# -- planes ----------------------------------------------------------------------------------------
@njit(parallel=True, **_JIT)
def pack_plane(v, m_bits, z, plane):
    """The sign-and-mantissa plane: value i's ``s << (M - z) | m >> z`` at bits ``b*i ..`` of
    ``plane`` (uint32, zeroed, ``ceil(N * b / 32)`` words), b = 1 + M - z. 32 values fill b
    words exactly, so chunks of 32 values run in parallel."""
    b = 1 + m_bits - z
    n = v.shape[0]
    mmask = (1 << m_bits) - 1
    for c in prange((n + 31) // 32):
        acc = np.uint64(0)
        have = 0
        w = c * b
        for i in range(c * 32, min(n, c * 32 + 32)):
            x = v[i]
            r = np.uint64(((x >> 15) << (m_bits - z)) | ((x & mmask) >> z))
            acc |= r << np.uint64(have)
            have += b
            if have >= 32:
                plane[w] = np.uint32(acc & np.uint64(0xFFFFFFFF))
                w += 1
                acc >>= np.uint64(32)
                have -= 32
        if have > 0:
            plane[w] = np.uint32(acc)


@njit(**_JIT)
def low_bits(v, m_bits, z, wide, wide_plane, exc_index, exc_plane):
    """Write the low ``z`` mantissa bits of every value whose exponent is wide into
    ``wide_plane`` (z bits each, in value order), and the index and low bits of every other
    value whose low bits are not zero into ``exc_index`` / ``exc_plane``. The planes are zeroed
    and sized by the caller from the histogram; returns (wide values, exceptions) written."""
    low = (1 << z) - 1
    emask = (1 << (15 - m_bits)) - 1
    nw = 0
    nx = 0
    for i in range(v.shape[0]):
        x = v[i]
        lo = x & low
        if wide[(x >> m_bits) & emask]:
            _put_bits(wide_plane, nw * z, z, lo)
            nw += 1
        elif lo != 0:
            exc_index[nx] = i
            _put_bits(exc_plane, nx * z, z, lo)
            nx += 1
    return nw, nx


@njit(inline="always")
def _put_bits(plane, at, width, value):
    """OR ``value`` (``width`` <= 16 bits) into the little-endian bit stream ``plane`` at bit
    ``at``."""
    w = at >> 5
    sh = at & 31
    x = np.uint64(value) << np.uint64(sh)
    plane[w] |= np.uint32(x & np.uint64(0xFFFFFFFF))
    if sh + width > 32:
        plane[w + 1] |= np.uint32(x >> np.uint64(32))


@njit(inline="always")
def _get_bits(plane, at, width):
    """``width`` bits of the little-endian bit stream ``plane`` from bit ``at`` (uint64)."""
    w = np.uintp(at >> 5)
    sh = at & 31
    x = np.uint64(plane[w]) >> np.uint64(sh)
    if sh + width > 32:
        x |= np.uint64(plane[w + np.uintp(1)]) << np.uint64(32 - sh)
    return x & np.uint64((1 << width) - 1)


# -- streams ---------------------------------------------------------------------------------------
@njit(**_JIT)
def _enc_stream(j, s, v, n, cols, shift, emask, rank, cls, freqs, cdfs, scratch, cap_off,
                counts):
    i0 = s * n
    i1 = min(v.shape[0], i0 + n)
    state = _U(0)
    w = cap_off[j]
    cap = cap_off[j + 1]
    row = (i1 - 1) // cols
    col = (i1 - 1) - row * cols
    f = freqs[cls[row]]
    cdf = cdfs[cls[row]]
    for i in range(i1 - 1, i0 - 1, -1):
        a = rank[(v[i] >> shift) & emask]
        state, w = _push(state, _U(f[a]), _U(cdf[a]), scratch, w, cap)
        if w < 0:
            counts[j] = -1
            return
        col -= 1
        if col < 0 and i > i0:
            col = cols - 1
            row -= 1
            f = freqs[cls[row]]
            cdf = cdfs[cls[row]]
    end = _flush(state, scratch, w, cap)
    counts[j] = end - cap_off[j] if end >= 0 else -1


@njit(parallel=True, **_JIT)
def encode_streams(v, n, s0, cols, shift, emask, rank, cls, freqs, cdfs, scratch, cap_off,
                   counts):
    """Encode the exponent symbols of streams ``s0 + j`` (j < len(counts)) into
    ``scratch[cap_off[j]:cap_off[j+1]]`` and their word counts into ``counts[j]`` (-1 if the
    capacity was too small, which it never is)."""
    for j in prange(counts.shape[0]):
        _enc_stream(j, s0 + j, v, n, cols, shift, emask, rank, cls, freqs, cdfs, scratch,
                    cap_off, counts)


@njit(inline="always")
def _start(words, word_off, s):
    """(state, pos, lo) of stream s; pos is -1 if its last word is 0 (corrupt)."""
    lo = word_off[s]
    state, pos = _init_state(words, lo, word_off[s + 1])
    return state, pos, lo


@njit(inline="always")
def _value(sym, plane, i, b, mz, top, z, symv):
    """Value i from its symbol and its plane bits."""
    r = _get_bits(plane, i * b, b)
    return np.uint16(((r >> mz) << _U(15)) | _U(symv[sym]) | ((r & top) << z))


@njit(**_JIT)
def _dec_one(s, words, word_off, plane, n, cols, b, z, symv, symw, cls, dec, out, wide_count):
    """Stream s alone; 0 if it ends in state 0 with every word read, else 1."""
    state, pos, lo = _start(words, word_off, s)
    if pos < 0:
        return 1
    i0 = s * n
    i1 = min(out.shape[0], i0 + n)
    mz, top, zz = _U(b - 1), _U((1 << (b - 1)) - 1), _U(z)
    row = i0 // cols
    col = i0 - row * cols
    d = dec[cls[row]]
    nw = 0
    for i in range(i0, i1):
        x, state, pos = _step(state, pos, lo, words, d)
        out[i] = _value(x, plane, i, b, mz, top, zz, symv)
        nw += symw[x]
        col += 1
        if col == cols and i + 1 < i1:
            col = 0
            row += 1
            d = dec[cls[row]]
    wide_count[s] = nw
    return 0 if (state == 0 and pos == lo) else 1


LANES = 4  # streams decoded in lock-step by one thread, so their serial chains overlap


@njit(inline="always")
def _byte_value(sym, plane8, i, zz, symv):
    """Value i where the plane holds one byte a value (b = 8: f16 with z = 3, bf16)."""
    r = np.uint16(plane8[np.uintp(i)])
    return np.uint16(((r & np.uint16(0x80)) << np.uint16(8)) | symv[sym]
                     | ((r & np.uint16(0x7F)) << np.uint16(zz)))


@njit(**_JIT)
def _dec_lanes(s0, words, word_off, plane, n, cols, b, z, symv, symw, cls, dec, out,
               wide_count, status):
    """Streams s0 .. s0 + LANES - 1, each ``n`` values of ``n // cols`` whole rows, in
    lock-step: the symbols of one row of each go to ``sym`` first (the serial chains), then
    the values are put together row by row."""
    for s in range(s0, s0 + LANES):
        if _start(words, word_off, s)[1] < 0:  # a corrupt start: each on its own
            for s2 in range(s0, s0 + LANES):
                status[s2] = _dec_one(s2, words, word_off, plane, n, cols, b, z, symv, symw,
                                      cls, dec, out, wide_count)
            return
    t0, p0, l0 = _start(words, word_off, s0)
    t1, p1, l1 = _start(words, word_off, s0 + 1)
    t2, p2, l2 = _start(words, word_off, s0 + 2)
    t3, p3, l3 = _start(words, word_off, s0 + 3)
    mz, top, zz = _U(b - 1), _U((1 << (b - 1)) - 1), _U(z)
    plane8 = plane.view(np.uint8)
    sym = np.empty((LANES, cols), np.uint8)
    nw = np.zeros(LANES, np.int64)
    k = n // cols
    for rr in range(k):
        first = s0 * n + rr * cols
        row = first // cols
        d0, d1 = dec[cls[row]], dec[cls[row + k]]
        d2, d3 = dec[cls[row + 2 * k]], dec[cls[row + 3 * k]]
        for c in range(cols):
            u = np.uintp(c)
            sym[0, u], t0, p0 = _step(t0, p0, l0, words, d0)
            sym[1, u], t1, p1 = _step(t1, p1, l1, words, d1)
            sym[2, u], t2, p2 = _step(t2, p2, l2, words, d2)
            sym[3, u], t3, p3 = _step(t3, p3, l3, words, d3)
        for lane in range(LANES):
            i0 = (s0 + lane) * n + rr * cols
            sl = sym[lane]
            w = 0
            if b == 8:
                for c in range(cols):
                    x = sl[np.uintp(c)]
                    out[np.uintp(i0 + c)] = _byte_value(x, plane8, i0 + c, zz, symv)
                    w += symw[x]
            else:
                for c in range(cols):
                    x = sl[np.uintp(c)]
                    out[np.uintp(i0 + c)] = _value(x, plane, i0 + c, b, mz, top, zz, symv)
                    w += symw[x]
            nw[lane] += w
    ends = ((t0, p0, l0), (t1, p1, l1), (t2, p2, l2), (t3, p3, l3))
    for lane in range(LANES):
        t, p, lo = ends[lane]
        status[s0 + lane] = 0 if (t == 0 and p == lo) else 1
        wide_count[s0 + lane] = nw[lane]


@njit(parallel=True, **_JIT)
def decode_streams(words, word_off, plane, n, cols, b, z, symv, symw, cls, dec, out,
                   wide_count, status):
    """Decode every stream into ``out`` (the low bits of wide exponents and exceptions still
    0), count each stream's wide values and set its status (0: ended in state 0 with every
    word read). ``word_off`` indexes ``words``, the whole tensor."""
    n_streams = status.shape[0]
    full = out.shape[0] // n  # streams of n values
    blocks = full // LANES if n % cols == 0 else 0
    for j in prange(blocks + n_streams - blocks * LANES):
        if j < blocks:
            _dec_lanes(j * LANES, words, word_off, plane, n, cols, b, z, symv, symw, cls, dec,
                       out, wide_count, status)
        else:
            s = blocks * LANES + j - blocks
            status[s] = _dec_one(s, words, word_off, plane, n, cols, b, z, symv, symw, cls,
                                 dec, out, wide_count)


@njit(parallel=True, **_JIT)
def place_plane(plane, m_bits, z, out):
    """OR every value's sign and top mantissa bits from the plane into ``out``."""
    b = 1 + m_bits - z
    mz, top, zz = _U(b - 1), _U((1 << (b - 1)) - 1), _U(z)
    for i in prange(out.shape[0]):
        r = _get_bits(plane, i * b, b)
        out[i] |= np.uint16(((r >> mz) << _U(15)) | ((r & top) << zz))


@njit(parallel=True, **_JIT)
def fill_wide(out, n, m_bits, z, wide, wide_plane, first):
    """OR the low bits of the wide-exponent values of stream s, which are entries
    ``first[s] ..`` of ``wide_plane``, into ``out``."""
    emask = (1 << (15 - m_bits)) - 1
    for s in prange(first.shape[0] - 1):
        if first[s + 1] == first[s]:
            continue
        k = first[s]
        for i in range(s * n, min(out.shape[0], s * n + n)):
            if wide[(out[i] >> m_bits) & emask]:
                out[i] |= np.uint16(_get_bits(wide_plane, k * z, z))
                k += 1


@njit(**_JIT)
def fill_exceptions(out, m_bits, z, wide, exc_index, exc_plane):
    """OR each exception's low bits into ``out``; returns the first bad exception's position
    (index not rising or out of range, its exponent wide, its bits zero) or -1."""
    emask = (1 << (15 - m_bits)) - 1
    last = -1
    for k in range(exc_index.shape[0]):
        i = np.int64(exc_index[k])
        lo = _get_bits(exc_plane, k * z, z)
        if i <= last or i >= out.shape[0] or lo == 0 or wide[(out[i] >> m_bits) & emask]:
            return k
        out[i] |= np.uint16(lo)
        last = i
    return -1
