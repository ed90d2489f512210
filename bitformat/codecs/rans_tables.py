"""Frequency tables for the rANS coder: 24-bit precision, every frequency a multiple of 2^12.

A table is stored as 12-bit *units* ``u`` (each >= 1, summing to 4096); the coder's frequency
is ``f = u << 12`` (so ``sum f = 2^24``). Because every cumulative frequency is a multiple of
2^12, a decoder finds the symbol of a 24-bit quantile q with one lookup: ``lut[q >> 12]``.

Two alphabets:

* ``trit``: 3 symbols, symbol = trit + 1 (-1, 0, +1 -> 0, 1, 2).
* ``group5``: 243 symbols, 5 trits per symbol as base-3 digits, most significant first
  (``81*c0 + 27*c1 + 9*c2 + 3*c3 + c4``, as in the ``base3`` packer).

Tables are built with integer arithmetic only, so every platform derives the same table:

* :func:`apportion` is largest-remainder rounding in whole units with a floor of one unit.
* :func:`trit_units` applies it to trit counts.
* :func:`group5_units` derives the 243-entry table from a 3-entry unit table: the product
  distribution ``prod_k u[c_k] / 4096^5``, apportioned the same way.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from ..errors import FormatError

PRECISION = 24  # bits of the coder's quantiles (constriction DefaultAnsCoder)
UNIT_BITS = 12  # frequencies are multiples of 2^(PRECISION - UNIT_BITS) = 2^12
UNITS = 1 << UNIT_BITS  # units in a table, and entries in the lookup table
UNIT_SHIFT = PRECISION - UNIT_BITS

MODES = {"trit": 3, "group5": 243}  # symbol mode -> alphabet size
GROUP = {"trit": 1, "group5": 5}  # trits per symbol

#: group5 symbol -> its 5 trits (int8 [243, 5]), digits most significant first
GROUP5_TRITS = ((np.arange(243)[:, None] // np.array([81, 27, 9, 3, 1])) % 3 - 1).astype(np.int8)


def apportion(weights: Sequence[int], units: int = UNITS, total: int | None = None) -> np.ndarray:
    """Split ``units`` among symbols in proportion to integer ``weights``, each getting >= 1.

    Symbol i's ideal share is ``weights[i] * units / total`` (``total`` defaults to the sum of
    the weights; all zero means uniform). Each symbol gets the floor of its share, or 1 if that
    is 0. Leftover units go one each to the largest remainders (lowest index first on ties),
    skipping symbols raised to 1. If the raises overshoot, units are taken back one at a time
    from the symbol with the smallest weight per unit, among those above 1 (lowest index first).

    Examples
    --------
    >>> apportion([2889, 4221, 2890]).tolist()
    [1183, 1729, 1184]
    """
    w = [int(x) for x in weights]
    n = len(w)
    if not 1 <= n <= units:
        raise ValueError(f"cannot give {n} symbols at least one of {units} units each")
    if min(w) < 0:
        raise ValueError("weights must be non-negative")
    if total is None:
        total = sum(w)
    if total == 0:
        w, total = [1] * n, n
    q = [x * units // total for x in w]
    rem = [x * units - qi * total for x, qi in zip(w, q, strict=True)]
    raised = [qi == 0 for qi in q]
    q = [max(qi, 1) for qi in q]
    left = units - sum(q)
    if left > 0:
        order = sorted((i for i in range(n) if not raised[i]), key=lambda i: (-rem[i], i))
        for i in order[:left]:
            q[i] += 1
        left -= min(left, len(order))
    if left < 0:
        ratio = np.array([wi / qi for wi, qi in zip(w, q, strict=True)])  # correctly rounded
        ratio[np.array(q) <= 1] = np.inf
    while left < 0:
        i = _least_weight_per_unit(w, q, ratio)
        q[i] -= 1
        ratio[i] = w[i] / q[i] if q[i] > 1 else np.inf
        left += 1
    if left != 0:  # only if total < sum(weights), which callers never pass
        raise ValueError("weights exceed the stated total")
    return np.array(q, dtype=np.int64)


def _least_weight_per_unit(w: list[int], q: list[int], ratio: np.ndarray) -> int:
    """The index i with q[i] > 1 of the least w[i] / q[i] (lowest index on ties), exactly.

    ``ratio`` holds the float quotients (inf where q[i] <= 1), each within 2^-53 of the true
    one: only those within 1e-9 of the least can be the least, and those few are compared
    exactly by cross-multiplying Python ints (as Fractions would, without building them).
    """
    near = np.flatnonzero(ratio <= ratio.min() * (1 + 1e-9))
    best = int(near[0])
    for i in near[1:]:
        i = int(i)
        if w[i] * q[best] < w[best] * q[i]:
            best = i
    return best


def trit_units(counts: Sequence[int]) -> np.ndarray:
    """The 3-entry unit table (for -1, 0, +1) of trit counts, by :func:`apportion`."""
    if len(counts) != 3:
        raise ValueError(f"need 3 trit counts, got {len(counts)}")
    return apportion(counts)


def count_trits(trits: np.ndarray) -> np.ndarray:
    """Counts of -1, 0, +1 in an int8 trit array (int64 [3])."""
    return np.bincount(trits.reshape(-1).view(np.uint8) + np.uint8(1), minlength=3)[:3]


@functools.lru_cache(maxsize=256)
def _group5_units(t: tuple[int, int, int]) -> tuple[int, ...]:
    digits = [[(s // p) % 3 for p in (81, 27, 9, 3, 1)] for s in range(243)]
    prods = [t[d[0]] * t[d[1]] * t[d[2]] * t[d[3]] * t[d[4]] for d in digits]
    return tuple(apportion(prods, UNITS, UNITS ** 5).tolist())


def group5_units(trit_table: Sequence[int]) -> np.ndarray:
    """The 243-entry unit table derived from a 3-entry unit table (product, then apportion).

    The sum of the products is exactly 4096^5, so the ideal shares sum to 4096 units.
    """
    t = tuple(int(x) for x in trit_table)
    check_units(t, 3)
    return np.array(_group5_units(t), dtype=np.int64)


_DIGITS5 = (np.arange(243)[:, None] // np.array([81, 27, 9, 3, 1])) % 3  # [243, 5]


def group5_units_many(trit_tables: np.ndarray) -> np.ndarray:
    """:func:`group5_units` for a stack ``[T, 3]`` of trit tables, vectorised (``[T, 243]``).

    Each product is below 4096^5 = 2^60, so its share ``prod / 2^48`` splits exactly into
    ``prod >> 48`` and a 48-bit remainder in int64. Rows where raising floors of 0 to 1
    overshoots 4096 (very skewed tables) take the scalar path.
    """
    t = np.asarray(trit_tables, dtype=np.int64).reshape(-1, 3)
    if t.size and (t.min() < 1 or np.any(t.sum(axis=1) != UNITS)):
        raise FormatError(f"rANS table entries must be >= 1 and sum to {UNITS}")
    prods = np.prod(t[:, _DIGITS5], axis=2)  # [T, 243], exact: < 2^60
    q = prods >> 48
    raised = q == 0
    rem = np.where(raised, -1, prods & ((1 << 48) - 1))  # raised symbols sort last
    q = np.maximum(q, 1)
    left = UNITS - q.sum(axis=1)
    rank = np.empty_like(q)
    order = np.argsort(-rem, axis=1, kind="stable")  # largest remainder, lowest index on ties
    np.put_along_axis(rank, order, np.arange(243)[None, :], axis=1)
    q += (rank < left[:, None]) & ~raised
    for i in np.flatnonzero(left < 0):  # raising overshot: units come back one at a time
        q[i] = group5_units(t[i])
    return q


def check_units(units: Sequence[int], alphabet: int) -> None:
    """Raise :class:`FormatError` unless ``units`` is a valid table for ``alphabet`` symbols."""
    if len(units) != alphabet:
        raise FormatError(f"rANS table has {len(units)} entries, expected {alphabet}")
    if min(units) < 1 or sum(int(u) for u in units) != UNITS:
        raise FormatError(f"rANS table entries must be >= 1 and sum to {UNITS}")


def symbol_units(mode: str, table: Sequence[int]) -> np.ndarray:
    """The coder's unit table for ``mode`` from a stored table.

    ``table`` is the 3-entry trit table in either mode; in ``group5`` mode it may instead be an
    explicit 243-entry table.
    """
    if mode not in MODES:
        raise FormatError(f"unknown rANS symbol mode {mode!r:.20}")
    if mode == "group5" and len(table) == 3:
        return group5_units(table)
    check_units(table, MODES[mode])
    return np.asarray(table, dtype=np.int64)


def coder_tables(units: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(freq, cdf, lut)`` for one unit table, or a stack ``[T, A]`` of them.

    freq: uint32 ``[..., A]`` (units << 12); cdf: uint32 ``[..., A + 1]`` (cdf[0] = 0,
    cdf[A] = 2^24); lut: uint8 ``[..., 4096]`` mapping ``quantile >> 12`` to its symbol.
    """
    units = np.asarray(units, dtype=np.int64)
    if units.shape[-1] > 256:
        raise ValueError("lookup tables hold symbols below 256")
    freq = (units << UNIT_SHIFT).astype(np.uint32)
    cdf = np.zeros(units.shape[:-1] + (units.shape[-1] + 1,), dtype=np.int64)
    np.cumsum(units << UNIT_SHIFT, axis=-1, out=cdf[..., 1:])
    flat = units.reshape(-1, units.shape[-1])
    lut = np.stack([np.repeat(np.arange(flat.shape[1], dtype=np.uint8), row) for row in flat])
    return freq, cdf.astype(np.uint32), lut.reshape(units.shape[:-1] + (UNITS,))


def freq24(units: np.ndarray) -> np.ndarray:
    """24-bit frequencies (int64) of a unit table, e.g. for building a constriction model."""
    return np.asarray(units, dtype=np.int64) << UNIT_SHIFT


def entropy_bits(counts: np.ndarray) -> float:
    """Order-0 entropy of a count vector, in bits per symbol."""
    c = np.asarray(counts, dtype=np.float64)
    p = c[c > 0] / c.sum()
    return float(-(p * np.log2(p)).sum())
