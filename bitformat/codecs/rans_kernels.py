"""numba rANS kernels, bit-compatible with constriction's ``DefaultAnsCoder``.

Coder: 64-bit state, 32-bit words, 24-bit precision; tables as built by
:mod:`~bitformat.codecs.rans_tables` (frequencies multiples of 2^12, decoded with a 4096-entry
lookup table). One stream is exactly what ``AnsCoder.encode_reverse(symbols, model)`` followed by
``get_compressed()`` returns::

    words = [bulk_0, bulk_1, ..., bulk_{k-1}, state_lo, state_hi]

Bulk words in the order the encoder pushed them (it runs from the last symbol to the first),
then the final state least-significant word first, leaving out the high word when the state is
below 2^32 and both words when it is 0. The encoder starts from state 0, so a decoder that
reads the words back to front ends in state 0 with every word consumed; anything else means
the stream is corrupt. Streams are concatenated as they are; ``word_offsets[i]`` (int64,
``S + 1`` entries) says where stream i starts.

Encode step (frequency f, left cumulative c)::

    if state >> 40 >= f: push(state & 0xFFFFFFFF); state >>= 32
    state = (state // f) << 24 | (c + state % f)

Decode step::

    q = state & 0xFFFFFF;  s = lut[q >> 12]
    state = (state >> 24) * f[s] + q - c[s]
    if state < 2^32 and words remain: state = state << 32 | next word (reading backwards)

Kernels return status codes; the wrappers in :mod:`~bitformat.codecs.rans` raise.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

_U = np.uint64
_MASK = _U((1 << 24) - 1)
_LO32 = _U(0xFFFFFFFF)
_BIG = _U(1 << 32)
_S24 = _U(24)
_S32 = _U(32)
_S40 = _U(40)
_S12 = _U(12)

OK, CORRUPT, OVERFLOW = 0, 1, 2

_JIT = dict(cache=True, nogil=True, error_model="numpy")


def capacity(n_symbols: int) -> int:
    """Words a stream of ``n_symbols`` can need at most (each symbol adds <= 12 bits)."""
    return n_symbols // 2 + 4


# -- one stream ------------------------------------------------------------------------------------
@njit(**_JIT)
def _push(state, f, c, words, w, cap):
    if (state >> _S40) >= f:
        if w >= cap:
            return state, -1
        words[w] = np.uint32(state & _LO32)
        w += 1
        state >>= _S32
    state = ((state // f) << _S24) | (c + state % f)
    return state, w


@njit(**_JIT)
def _flush(state, words, w, cap):
    if state != 0:
        if w + 2 > cap:
            return -1
        words[w] = np.uint32(state & _LO32)
        w += 1
        if (state >> _S32) != 0:
            words[w] = np.uint32(state >> _S32)
            w += 1
    return w


@njit(**_JIT)
def _encode_symbols(symbols, s0, s1, freq, cdf, words, w0, cap):
    """Encode symbols[s0:s1] into words[w0:cap]; return the end index or -1 on overflow."""
    state = _U(0)
    w = w0
    for i in range(s1 - 1, s0 - 1, -1):
        s = symbols[i]
        state, w = _push(state, _U(freq[s]), _U(cdf[s]), words, w, cap)
        if w < 0:
            return -1
    return _flush(state, words, w, cap)


@njit(**_JIT)
def _encode_trits(trits, t0, t1, group, freq, cdf, words, w0, cap):
    """Encode trits[t0:t1] as symbols of ``group`` (1 or 5) trits, padding with zero trits.

    Returns the end index, -1 on overflow, or -2 if a value is not -1, 0 or +1."""
    state = _U(0)
    w = w0
    n_sym = (t1 - t0 + group - 1) // group
    two = _U(2)
    for g in range(n_sym - 1, -1, -1):
        p = t0 + g * group
        if group == 1:
            s = trits[p] + 1
            if _U(s) > two:  # a negative code wraps to a huge unsigned value
                return -2
        elif p + 5 <= t1:
            c0 = trits[p] + 1
            c1 = trits[p + 1] + 1
            c2 = trits[p + 2] + 1
            c3 = trits[p + 3] + 1
            c4 = trits[p + 4] + 1
            if ((_U(c0) > two) | (_U(c1) > two) | (_U(c2) > two) | (_U(c3) > two)
                    | (_U(c4) > two)):
                return -2
            s = 81 * c0 + 27 * c1 + 9 * c2 + 3 * c3 + c4
        else:
            s = 0
            for k in range(5):
                c = trits[p + k] + 1 if p + k < t1 else 1
                if _U(c) > two:
                    return -2
                s = 3 * s + c
        state, w = _push(state, _U(freq[s]), _U(cdf[s]), words, w, cap)
        if w < 0:
            return -1
    return _flush(state, words, w, cap)


@njit(**_JIT)
def _init_state(words, lo, hi):
    """(state, position) after reading the final state; position -1 if the last word is 0."""
    pos = hi
    state = _U(0)
    if pos > lo:
        pos -= 1
        state = _U(words[pos])
        if state == 0:
            return state, -1
        if pos > lo:
            pos -= 1
            state = (state << _S32) | _U(words[pos])
    return state, pos


@njit(**_JIT)
def _decode_symbols(words, lo, hi, freq, cdf, lut, out, o0, o1):
    state, pos = _init_state(words, lo, hi)
    if pos < 0:
        return CORRUPT
    for i in range(o0, o1):
        q = state & _MASK
        s = lut[q >> _S12]
        state = (state >> _S24) * _U(freq[s]) + q - _U(cdf[s])
        if state < _BIG and pos > lo:
            pos -= 1
            state = (state << _S32) | _U(words[pos])
        out[i] = s
    return OK if (state == 0 and pos == lo) else CORRUPT


@njit(**_JIT)
def _decode_trits(words, lo, hi, group, freq, cdf, lut, expand, out, t0, t1):
    """Decode trits out[t0:t1]; in group mode the padding digits must be zero trits."""
    state, pos = _init_state(words, lo, hi)
    if pos < 0:
        return CORRUPT
    n_sym = (t1 - t0 + group - 1) // group
    p = t0
    for _ in range(n_sym):
        q = state & _MASK
        s = lut[q >> _S12]
        state = (state >> _S24) * _U(freq[s]) + q - _U(cdf[s])
        if state < _BIG and pos > lo:
            pos -= 1
            state = (state << _S32) | _U(words[pos])
        if group == 1:
            out[p] = np.int8(s) - np.int8(1)
            p += 1
        elif p + 5 <= t1:
            for k in range(5):
                out[p + k] = expand[s, k]
            p += 5
        else:
            for k in range(5):
                if p + k < t1:
                    out[p + k] = expand[s, k]
                elif expand[s, k] != 0:
                    return CORRUPT
            p = t1
    return OK if (state == 0 and pos == lo) else CORRUPT


# -- single-stream entry points --------------------------------------------------------------------
@njit(**_JIT)
def encode_one(symbols, freq, cdf, words):
    """Encode all of ``symbols`` into ``words`` (capacity(len) long); return the word count."""
    return _encode_symbols(symbols, 0, symbols.shape[0], freq, cdf, words, 0, words.shape[0])


@njit(**_JIT)
def decode_one(words, freq, cdf, lut, out):
    return _decode_symbols(words, 0, words.shape[0], freq, cdf, lut, out, 0, out.shape[0])


# -- many streams ----------------------------------------------------------------------------------
# Each kernel exists twice, serial and parallel (prange over streams), as separate functions so
# numba's on-disk cache (keyed by function name) never mixes them up. Per-stream tables are
# picked by ``tidx`` from stacked tables freqs [T, A], cdfs [T, A + 1], luts [T, 4096].
# Encoders write stream i into scratch[cap_off[i]:cap_off[i + 1]] and its word count into
# counts[i] (-1 on overflow, which the capacity bound rules out; -2 for a value that is not a
# trit); compact() packs them.

@njit(**_JIT)
def _enc_sym_stream(i, symbols, sym_off, tidx, freqs, cdfs, scratch, cap_off, counts):
    t = tidx[i]
    end = _encode_symbols(symbols, sym_off[i], sym_off[i + 1], freqs[t], cdfs[t], scratch,
                          cap_off[i], cap_off[i + 1])
    counts[i] = end - cap_off[i] if end >= 0 else -1


@njit(**_JIT)
def _enc_trit_stream(i, trits, trit_off, group, tidx, freqs, cdfs, scratch, cap_off, counts):
    t = tidx[i]
    end = _encode_trits(trits, trit_off[i], trit_off[i + 1], group, freqs[t], cdfs[t], scratch,
                        cap_off[i], cap_off[i + 1])
    counts[i] = end - cap_off[i] if end >= 0 else end


@njit(**_JIT)
def _copy_stream(i, scratch, cap_off, word_off, words):
    a = cap_off[i]
    b = word_off[i]
    for k in range(word_off[i + 1] - b):
        words[b + k] = scratch[a + k]


@njit(**_JIT)
def enc_sym_many(symbols, sym_off, tidx, freqs, cdfs, scratch, cap_off, counts):
    for i in range(sym_off.shape[0] - 1):
        _enc_sym_stream(i, symbols, sym_off, tidx, freqs, cdfs, scratch, cap_off, counts)


@njit(parallel=True, **_JIT)
def enc_sym_many_par(symbols, sym_off, tidx, freqs, cdfs, scratch, cap_off, counts):
    for i in prange(sym_off.shape[0] - 1):
        _enc_sym_stream(i, symbols, sym_off, tidx, freqs, cdfs, scratch, cap_off, counts)


@njit(**_JIT)
def enc_trit_many(trits, trit_off, group, tidx, freqs, cdfs, scratch, cap_off, counts):
    for i in range(trit_off.shape[0] - 1):
        _enc_trit_stream(i, trits, trit_off, group, tidx, freqs, cdfs, scratch, cap_off, counts)


@njit(parallel=True, **_JIT)
def enc_trit_many_par(trits, trit_off, group, tidx, freqs, cdfs, scratch, cap_off, counts):
    for i in prange(trit_off.shape[0] - 1):
        _enc_trit_stream(i, trits, trit_off, group, tidx, freqs, cdfs, scratch, cap_off, counts)


@njit(**_JIT)
def compact(scratch, cap_off, word_off, words):
    for i in range(cap_off.shape[0] - 1):
        _copy_stream(i, scratch, cap_off, word_off, words)


@njit(parallel=True, **_JIT)
def compact_par(scratch, cap_off, word_off, words):
    for i in prange(cap_off.shape[0] - 1):
        _copy_stream(i, scratch, cap_off, word_off, words)


@njit(**_JIT)
def dec_sym_many(words, word_off, sym_off, tidx, freqs, cdfs, luts, out, status):
    for i in range(sym_off.shape[0] - 1):
        t = tidx[i]
        status[i] = _decode_symbols(words, word_off[i], word_off[i + 1], freqs[t], cdfs[t],
                                    luts[t], out, sym_off[i], sym_off[i + 1])


@njit(parallel=True, **_JIT)
def dec_sym_many_par(words, word_off, sym_off, tidx, freqs, cdfs, luts, out, status):
    for i in prange(sym_off.shape[0] - 1):
        t = tidx[i]
        status[i] = _decode_symbols(words, word_off[i], word_off[i + 1], freqs[t], cdfs[t],
                                    luts[t], out, sym_off[i], sym_off[i + 1])


@njit(**_JIT)
def dec_trit_many(words, word_off, trit_off, group, tidx, freqs, cdfs, luts, expand, out,
                  status):
    for i in range(trit_off.shape[0] - 1):
        t = tidx[i]
        status[i] = _decode_trits(words, word_off[i], word_off[i + 1], group, freqs[t], cdfs[t],
                                  luts[t], expand, out, trit_off[i], trit_off[i + 1])


@njit(parallel=True, **_JIT)
def dec_trit_many_par(words, word_off, trit_off, group, tidx, freqs, cdfs, luts, expand, out,
                      status):
    for i in prange(trit_off.shape[0] - 1):
        t = tidx[i]
        status[i] = _decode_trits(words, word_off[i], word_off[i + 1], group, freqs[t], cdfs[t],
                                  luts[t], expand, out, trit_off[i], trit_off[i + 1])
