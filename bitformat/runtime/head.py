"""The screened LM head: the full head's tokens from a fraction of its bytes (docs/exact-head.md).

The full head computes every logit ``l_v = E[v] . x`` from the f16 (bf16, f32) embedding. The
screened head reads an int8 copy of it instead (``E[v] ~ d_v c_v``, derived at load) and gets,
per row, an approximate logit ``a_v`` and a rigorous bound ``B_v >= |a_v - l_v|`` on the float32
value the full kernel would produce: the int8 rounding of the row, the rounding of the hidden
state into two int8 vectors, and the full kernel's own float rounding (from its summation
depth). Whatever the sampler needs is then decided from the bounds where they decide it, and
only the rows they leave open (the candidates) are computed by the very same full kernel:

- greedy: the candidates are the rows whose upper bound reaches the largest lower bound;
- temperature (Gumbel-max, :mod:`.sampling`): the same on ``bound / T + g_v`` with the step's
  own noise ``g``;
- top-k: the rows whose upper bound reaches the k-th largest lower bound hold the exact top-k
  set; top-p and min-p then act on it exactly;
- repetition penalty: monotone, so it moves the bounds of the penalized rows.

The token then comes from :meth:`.sampling.Sampler.pick` on a vector holding the candidates'
exact logits and ``-inf`` elsewhere: the same choice as on the full logits. What needs every
logit (top-p or min-p without top-k), a hidden state with NaN or infinity, a head with them,
or logits that could overflow, falls back to the full head, and :class:`HeadStats` counts it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import RequestError
from .sampling import Sampler, pick_tokens

HEAD_MODES = ("screened", "full")

#: the second int8 vector of the hidden state splits the first one's rounding into this many
#: steps, so ``x`` is held to ``1 / (2 FINE s)`` per value
FINE = 254
#: relative slack for the few float64 operations after a norm (2^-40, each is within 2^-53)
REL = 2.0 ** -40
#: the full head's logits may not come near float32's largest value (2^128)
OVERFLOW = 2.0 ** 120


def norm_slack(n: int) -> float:
    """Relative slack on a float64 norm of n values: a sum of n squares is within (n + 1)
    roundings (2^-53 each) of the exact one, the square root one more."""
    return (n + 8) * 2.0 ** -52 + REL


def split_hidden(x: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """One hidden state (float32 or float64 ``[dim]``) as the screen's input.

    Returns ``xq`` int8 ``[2, width]`` (``q1`` then ``q2``, zero-padded) with ``x ~ (q1 + q2 /
    FINE) / s``, and ``par`` float64 ``[6]``: ``1 / (FINE s)`` (a row's approximate logit is ``d
    * (FINE * D1 + D2) / (FINE s)`` for its integer sums D1, D2), upper bounds on ``||x||`` and
    on ``||x - (q1 + q2 / FINE) / s||``, a slot for the absolute slack, ``sum(q1)``, ``sum(q2)``.
    """
    x = np.asarray(x, dtype=np.float64)
    m = float(np.max(np.abs(x))) if x.size else 0.0
    s = 127.0 / m if m > 0 else 1.0
    y = x * s
    q1 = np.clip(np.rint(y), -127, 127)
    q2 = np.clip(np.rint((y - q1) * FINE), -127, 127)
    dx = x - (q1 + q2 / FINE) / s
    xq = np.zeros((2, width), np.int8)
    xq[0, : x.size], xq[1, : x.size] = q1, q2
    rel = norm_slack(x.size)
    # dx as evaluated is off by a few ulps of m per value: sqrt(dim) * m * 2^-48 covers them
    ndx = math.sqrt(float(np.dot(dx, dx))) * (1 + rel) + math.sqrt(x.size) * m * 2.0 ** -48
    nx = math.sqrt(float(np.dot(x, x))) * (1 + rel)
    return xq, np.array([1.0 / (FINE * s), nx, ndx, 0.0, q1.sum(), q2.sum()])


#: column scales are powers of two 2^j with |j| at most this: e / 2^j and x 2^j stay exact in
#: float64 for every f16, bf16 and f32 value
MAX_SHIFT = 40


#: the exponents tried for the column scales (:func:`column_scales`)
COLUMN_POWERS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.25)


def column_scales(colmax: np.ndarray, rows: np.ndarray) -> np.ndarray | None:
    """Per column of the head, the power of two ``c_k`` that the screen divides the column by
    (and multiplies the hidden state's value by), or None: every ``c_k`` is 1.

    ``e . x = (e / c) . (x c)`` exactly, so the bound's proof holds for the scaled pair
    (docs/exact-head.md, "Column scales"). A row's int8 step ``d`` follows its largest value:
    a trained head's few large columns set it for every row, and the rounding of all the
    other columns then makes the Cauchy-Schwarz bound ``||e - d c|| ||x||`` loose. Scaling a
    column down by ``c_k`` shrinks ``d`` but grows ``x``'s value in that column, so the scales
    are ``c_k = 2^round(p log2(colmax_k / median))`` from the columns' largest magnitudes
    ``colmax`` [dim], with the power p in :data:`COLUMN_POWERS` that minimizes the bound's
    size for a hidden state without outliers of its own, ``mean_v max_k |e_vk| / c_k * ||c||``
    over ``rows`` (float64, a sample of the head's finite rows). p = 0 is no scaling.
    """
    colmax = np.asarray(colmax, np.float64)
    ok = (colmax > 0) & np.isfinite(colmax)
    if not ok.any():
        return None
    ratio = np.log2(np.where(ok, colmax / np.median(colmax[ok]), 1.0))
    if not np.rint(max(COLUMN_POWERS) * ratio).any():  # columns alike: no power scales any
        return None
    rows = np.abs(np.asarray(rows, np.float32))  # (an estimate: float32 serves)
    rows = rows[np.isfinite(rows).all(axis=1)]
    best, cost = None, math.inf
    for p in COLUMN_POWERS:
        j = np.clip(np.rint(p * ratio), -MAX_SHIFT, MAX_SHIFT)
        c = np.exp2(j)
        size = (float((rows / c.astype(np.float32)).max(axis=1, initial=0.0).mean())
                * math.sqrt(float(np.dot(c, c))))
        if size < cost * (1 - 1e-9):  # ties keep the smaller power (no scaling first)
            best, cost = (c if j.any() else None), size
    return best


def sample_rows(V: int, n: int = 4096) -> np.ndarray:
    """Up to n row ids spread evenly over a head of V rows (:func:`column_scales`' sample)."""
    return np.unique(np.linspace(0, V - 1, min(V, n)).astype(np.int64))


def padded(dim: int) -> int:
    """Codes per row of the screen: ``dim`` rounded up to 64 (one vpdpbusd)."""
    return -(-dim // 64) * 64


#: the screen's code widths: int8 codes (-127..127) stored a byte each, or the int8 codes split
#: into their high 7 bits (packed eight to seven bytes: the screen reads those) and their low bit
#: (a bit plane read for the screen's candidates only, which it narrows to the int8 screen's
#: candidates): the cpu backend's where the CPU has AVX512-VBMI to unpack them
SCREEN_BITS = (8, 7, 6)
#: per code width of the first pass: the largest |k| of its signed codes (int8: c; int7: the
#: odd 4 h + 1; int6: 8 h + 3) and how each value's int8 code c splits into the stored high
#: part h = floor(c / SPLIT) and the low part c - SPLIT h (the bit plane of the second pass)
QMAX = {8: 127, 7: 255, 6: 253}
SPLIT = {7: 2, 6: 4}


def row_bytes(dim: int, bits: int) -> int:
    """Bytes per row of the screen's codes: ``padded(dim)`` codes of ``bits`` bits."""
    return padded(dim) * bits // 8


def code_buffer(rows: int, nbytes: int) -> np.ndarray:
    """uint8 [rows, nbytes] for a screen's codes, with 64 readable bytes after its end (a
    kernel that unpacks int7 codes loads 64 bytes for the last 56)."""
    return np.zeros(rows * nbytes + 64, np.uint8)[: rows * nbytes].reshape(rows, nbytes)


def pack7(u: np.ndarray) -> np.ndarray:
    """Stored int7 codes (uint8 < 128, ``[V, width]``, width a multiple of 8) packed: each 8
    codes ``u_0..u_7`` become the 7 bytes of the little-endian 56-bit ``sum u_m << 7 m``."""
    V, width = u.shape
    words = np.zeros((V, width // 8), np.uint64)
    for m in range(8):
        words |= u[:, m::8].astype(np.uint64) << np.uint64(7 * m)
    out = code_buffer(V, width * 7 // 8)
    out[:] = words.view(np.uint8).reshape(V, -1, 8)[:, :, :7].reshape(V, -1)
    return out


def pack6(u: np.ndarray) -> np.ndarray:
    """Stored int6 codes (uint8 < 64, ``[V, width]``, width a multiple of 64) packed 64 to 48
    bytes, in the order the AVX2 screen unpacks them: bytes 0..31 of a group hold code a in
    their low nibble and code 32 + a in their high one, bytes 32..47 the codes' top two bits,
    code ``j + 16 i`` at bits ``2 i`` of byte ``32 + j``."""
    V, width = u.shape
    g = u.reshape(V, width // 64, 64).astype(np.uint8)
    out = code_buffer(V, width * 6 // 8)
    o = out.reshape(V, width // 64, 48)
    o[:, :, :32] = (g[:, :, :32] & 15) | ((g[:, :, 32:] & 15) << 4)
    top = g >> 4
    o[:, :, 32:] = (top[:, :, 0:16] | (top[:, :, 16:32] << 2) | (top[:, :, 32:48] << 4)
                    | (top[:, :, 48:64] << 6))
    return out


def unpack6(p: np.ndarray) -> np.ndarray:
    """:func:`pack6` undone: uint8 [V, 4 / 3 * bytes]."""
    V, nb = p.shape
    o = p.reshape(V, nb // 48, 48)
    g = np.empty((V, nb // 48, 64), np.uint8)
    g[:, :, :32] = o[:, :, :32] & 15
    g[:, :, 32:] = o[:, :, :32] >> 4
    for i in range(4):
        g[:, :, 16 * i:16 * i + 16] |= ((o[:, :, 32:] >> (2 * i)) & 3) << 4
    return g.reshape(V, -1)


def pack2(b: np.ndarray) -> np.ndarray:
    """Values 0..3 ``[V, width]`` four to a byte, value ``4 j + i`` at bits ``2 i`` of byte
    j (int6's bit plane)."""
    V, width = b.shape
    q = b.reshape(V, width // 4, 4).astype(np.uint8)
    return q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)


def unpack2(p: np.ndarray) -> np.ndarray:
    """:func:`pack2` undone."""
    return np.stack([(p >> (2 * i)) & 3 for i in range(4)], axis=-1).reshape(p.shape[0], -1)


def unpack7(p: np.ndarray) -> np.ndarray:
    """:func:`pack7` undone: uint8 [V, 8 / 7 * bytes]."""
    V, nb = p.shape
    b = np.zeros((V, nb // 7, 8), np.uint8)
    b[:, :, :7] = p.reshape(V, -1, 7)
    words = b.view(np.uint64).reshape(V, -1)
    out = np.empty((V, nb // 7 * 8), np.uint8)
    for m in range(8):
        out[:, m::8] = (words >> np.uint64(7 * m)) & np.uint64(0x7F)
    return out


def bound_terms(dnorm, qnorm, enorm, scale, qmax: int, dim: int, depth: int, unit: float,
                flushed=None) -> tuple[np.ndarray, np.ndarray]:
    """A row's bound per unit of ``||x||`` (A) and of ``||x - x^||`` (N), every term rounded
    up, from ``||e - s k||``, ``||s k||`` and ``||e||`` (float64, as evaluated) of codes k with
    ``|k| <= qmax`` at scale s. ``flushed``: (wgpu) the norm of each row's values the full
    kernel may flush to zero."""
    rel = norm_slack(dim)
    du = depth * unit
    gamma = du / (1 - du)
    # e - s k as evaluated is within 2 ulps of max|s k| <= qmax s per value
    A = (dnorm * (1 + rel) + math.sqrt(dim) * qmax * scale * 2.0 ** -50
         + gamma * enorm * (1 + rel)) * (1 + REL)
    if flushed is not None:
        A = (A + np.asarray(flushed, np.float64) * (1 + rel)) * (1 + REL)
    return A, qnorm * (1 + rel) * (1 + REL)


#: the water-filling bound's grid: n = j dim / WF_GRID, j = 0 .. WF_GRID
WF_GRID = 1024
#: the largest values of |x| it saturates one by one (the minimum over m below)
WF_SATURATED = 64


def waterfill_terms(d, dnorm, enorm, dim: int, depth: int, unit: float, flushed=None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of int8 codes at scale ``d`` (float64 [V]) with ``||e - d c|| = dnorm`` (as
    evaluated): ``(m, j, rest)`` of :meth:`ScreenTables.waterfill`, each rounded up.

    Every value's error is at most ``m = d / 2`` (``c`` is the nearest code; the evaluated
    quotient is within a few ulps, the ``2^-40`` covers them), so ``w_k = |δe_k| / m`` lies in
    [0, 1] with ``sum w_k^2 <= n = (||δe|| / m)^2``; ``j`` is n's grid index rounded up."""
    d = np.asarray(d, np.float64)
    rel = norm_slack(dim)
    m = d * 0.5 * (1 + 2.0 ** -40)
    R = np.asarray(dnorm, np.float64) * (1 + rel) + math.sqrt(dim) * 127 * d * 2.0 ** -50
    with np.errstate(divide="ignore", invalid="ignore"):
        n = np.where(m > 0, (R / np.where(m > 0, m, 1.0)) ** 2 * (1 + 2.0 ** -40), 0.0)
    j = np.minimum(np.ceil(np.minimum(n, dim) * (WF_GRID / dim) * (1 + 2.0 ** -40)),
                   WF_GRID).astype(np.int64)
    du = depth * unit
    rest = du / (1 - du) * np.asarray(enorm, np.float64) * (1 + rel)
    if flushed is not None:
        rest = rest + np.asarray(flushed, np.float64) * (1 + rel)
    return m, j, rest * (1 + REL)


def waterfill_table(x: np.ndarray, j: np.ndarray | None = None) -> np.ndarray:
    """float64 [WF_GRID + 1] (or at grid indices ``j`` only): upper bounds ``G_j >= max sum_k
    w_k |x_k|`` over ``0 <= w_k <= 1``, ``sum w_k^2 <= n_j = j dim / WF_GRID``, for the
    screen's input ``x`` (float64 [dim]).

    For the m largest ``|x_k|`` (any m) and the rest: ``sum w_k |x_k| <= S1(m) + sqrt(sum_{rest}
    w_k^2) sqrt(T2(m)) <= S1(m) + sqrt(n T2(m))``, with ``S1`` the sum of the m largest and
    ``T2`` the sum of squares of the others (Cauchy-Schwarz on the rest); G is the smallest
    over m = 0 .. WF_SATURATED (m = 0: Cauchy-Schwarz itself, ``sqrt(n) ||x||``). Every sum
    of at most dim float64 terms is within (dim + 2) 2^-53 of its value, the square root and
    product within 2^-50: the factor covers them."""
    a = np.abs(np.asarray(x, np.float64))
    dim = a.size
    n = (np.arange(WF_GRID + 1) if j is None else np.asarray(j)) * (dim / WF_GRID)
    k = min(dim, WF_SATURATED)
    top = np.sort(np.partition(a, dim - k)[dim - k:])[::-1] if dim else a  # the k largest
    if dim == 0 or top[0] == 0:
        return np.zeros(n.size)
    # G is homogeneous: work on a / 2^e (exact), the largest value in [0.5, 1), so no square
    # of a value above 2^-500 of it underflows; the smaller ones add at most 2^-1000 each
    e = math.frexp(float(top[0]))[1]
    a, top = np.ldexp(a, -e), np.ldexp(top, -e)
    s1 = np.concatenate([[0.0], np.cumsum(top)])
    total = float(np.dot(a, a))
    sq = top * top
    t2 = np.concatenate([[total], total - np.cumsum(sq)])
    t2 = np.maximum(t2, 0.0)
    # the tail sums by subtraction lose up to ulp(sum sq) each: add it back
    t2 = t2 + total * (dim + 2) * 2.0 ** -52 + dim * 2.0 ** -1000
    G = np.min(s1[:, None] + np.sqrt(n[None, :] * t2[:, None]), axis=0)
    return np.ldexp(G * (1 + (dim + 8) * 2.0 ** -52 + REL), e)


@dataclass
class ScreenTables:
    """The int8 (int7, int6) copy of the head and what bounds each row's error (built at
    load).

    int8: codes ``c`` (-127..127) of ``e ~ d c``, d = max|e| / 127, stored ``c + 128``.
    int7: the same int8 codes as ``c = 2 h + b`` (h = floor(c / 2), -64..63; b = 0, 1); the
    screen reads ``h + 64`` (7 bits, packed) and bounds ``e ~ (d / 2) k`` with the odd codes
    ``k = 4 h + 1`` (the middle of 2h and 2h + 1); its candidates are then screened again
    with the int8 codes (``2 h`` plus the bit plane ``fine``), whose terms ``fine_A``,
    ``fine_N`` are those of the int8 screen (at scale ``2 * scale``). int6 likewise with
    ``c = 4 h + b`` (h -32..31 stored ``h + 32`` by :func:`pack6`, b 0..3 in a 2-bit plane,
    :func:`pack2`) and ``k = 8 h + 3``.
    """

    codes: np.ndarray  # uint8 [V, row_bytes(dim, bits)]: int8: c + 128; int7/int6: h + off
    scale: np.ndarray  # float64 [V]: int8: d = max|e| / 127; int7, int6: d / 2
    A: np.ndarray  # float64 [V]: bound per unit of ||x||: ||e - d c|| + gamma_D ||e||
    N: np.ndarray  # float64 [V]: bound per unit of ||x - x^||: ||d c||
    max_enorm: float  # max ||e||, for the overflow check
    bad_rows: int  # rows holding NaN or infinity
    depth: int  # roundings a product passes through in the full kernel
    unit: float  # the full kernel's unit roundoff (2^-24 for float32)
    slack: float = 0.0  # further absolute slack per step (a device that may flush x's subnormals)
    bits: int = 8  # the codes' width (SCREEN_BITS)
    # int7: uint8 [V, width / 8], bit i of byte j: b of value 8j+i; int6: pack2 of b
    fine: np.ndarray | None = None
    fine_A: np.ndarray | None = None  # int7, int6: the int8 codes' A and N
    fine_N: np.ndarray | None = None
    #: float64 [dim] powers of two (:func:`column_scales`): the codes are of ``e / cols``, the
    #: screen reads ``x * cols``; None: no column scales
    cols: np.ndarray | None = None
    #: the water-filling bound of the int8 codes (:meth:`waterfill`), per row: the largest
    #: error of one value, the grid index of (||e - d c|| / that)^2, the other terms per unit
    #: of ||x|| (the full kernel's rounding, flushed values) and of ||x - x^||
    wf_m: np.ndarray | None = None
    wf_j: np.ndarray | None = None
    wf_rest: np.ndarray | None = None
    wf_N: np.ndarray | None = None

    @classmethod
    def build(cls, codes, scale, dnorm, qnorm, enorm, bad, dim: int, depth: int,
              unit: float, *, flushed=None, flush_x: bool = False, bits: int = 8,
              fine=None, cols=None) -> ScreenTables:
        """From the exact-math pieces (float64, as evaluated): rounds every term up.

        With column scales ``cols`` (:func:`column_scales`) every piece is of the scaled rows
        ``e / cols`` (``enorm`` too: the full kernel's rounding is bounded through
        ``sum |e_k x_k| = sum |e'_k x'_k| <= ||e'|| ||x'||``), and so is ``flushed``.

        For a full kernel that may flush subnormal inputs to zero (wgpu: Vulkan allows it):
        ``flushed`` [V], the norm of each row's values it may flush (added to the row's bound
        per unit of ``||x||``), and ``flush_x``: x's own subnormals (each below 2^-126) may be
        flushed, which moves a logit by at most ``||e||_1 2^-126 <= sqrt(dim) ||e|| 2^-126``.
        int7: ``fine`` = (bit plane, ``||e - d c||``, ``||d c||``) of the int8 codes.
        """
        scale = np.asarray(scale, np.float64)
        A, N = bound_terms(dnorm, qnorm, enorm, scale, QMAX[bits], dim, depth, unit, flushed)
        fine_A = fine_N = plane = None
        if bits != 8:
            plane, fdn, fqn = fine
            fine_A, fine_N = bound_terms(fdn, fqn, enorm, 2 * scale, 127, dim, depth, unit,
                                         flushed)
        rel = norm_slack(dim)
        good = ~np.asarray(bad, bool)
        max_enorm = float(enorm[good].max()) if good.any() else 0.0
        # x's flushed values move a logit by at most sum_k |e_k| 2^-126 = sum_k |e'_k| c_k
        # 2^-126 <= ||e'|| ||c|| 2^-126 (||c|| = sqrt(dim) without column scales)
        ncols = math.sqrt(dim) if cols is None else math.sqrt(float(np.dot(cols, cols)))
        slack = 2 * ncols * max_enorm * (1 + rel) * 2.0 ** -126 if flush_x else 0.0
        if cols is not None:
            cols = np.asarray(cols, np.float64)
        d8, dn8, N8 = ((scale, dnorm, N) if bits == 8 else (2 * scale, fine[1], fine_N))
        wf = waterfill_terms(d8, dn8, enorm, dim, depth, unit, flushed)
        return cls(codes, scale, A, N, max_enorm, int((~good).sum()), depth, unit, slack, bits,
                   plane, fine_A, fine_N, cols, *wf, N8)

    @property
    def width(self) -> int:
        """Codes per row (``padded(dim)``): the length of the screen's input vectors."""
        return self.codes.shape[1] * 8 // self.bits

    def signed_codes(self) -> np.ndarray:
        """int16 [V, width]: the codes the screen's bound is about (int8: c; int7: k = 4 h + 1;
        int6: k = 8 h + 3)."""
        if self.bits == 8:
            return self.codes.astype(np.int16) - 128
        if self.bits == 7:
            return 4 * (unpack7(self.codes).astype(np.int16) - 64) + 1
        return 8 * (unpack6(self.codes).astype(np.int16) - 32) + 3

    def fine_codes(self, ids: np.ndarray) -> np.ndarray:
        """int7 and int6 tables: int16 [len(ids), width], the int8 codes c = 2 h + b (int7)
        or 4 h + b (int6) of rows ids."""
        if self.bits == 7:
            h = unpack7(self.codes[ids]).astype(np.int16) - 64
            return 2 * h + np.unpackbits(self.fine[ids], axis=1, bitorder="little")
        h = unpack6(self.codes[ids]).astype(np.int16) - 32
        return 4 * h + unpack2(self.fine[ids])

    def fine_nbytes(self, n: int) -> int:
        """What the int8 screen of n candidate rows reads: bit planes, scales, terms, sums."""
        return 0 if self.fine is None else n * (self.fine.shape[1] + 3 * 8 + 8)

    @property
    def nbytes(self) -> int:
        """What one screen of one token reads: the codes, the scales and both bound terms."""
        return self.codes.nbytes + self.scale.nbytes + self.A.nbytes + self.N.nbytes

    def absolute_slack(self) -> float:
        """Underflow: each rounding of the full kernel may also lose up to its smallest normal
        (2^-126 in float32, flushed or not)."""
        tiny = 2.0 ** -125 if self.unit >= 2.0 ** -24 else 2.0 ** -1021
        return self.depth * tiny + self.slack

    def prepare(self, h: np.ndarray, split=None) -> tuple[np.ndarray, np.ndarray] | None:
        """The screen's inputs for hidden states ``h`` [n, dim]: ``(XQ [n, 2, width], par [n,
        6])``, or None where the bound does not hold (NaN/inf, possible overflow). ``split``:
        a compiled :func:`split_hidden` writing ``(x, xq[t], par[t])`` (the cpu backend's)."""
        width = self.width
        xq = np.empty((h.shape[0], 2, width), np.int8)
        par = np.empty((h.shape[0], 6))
        for t in range(h.shape[0]):
            # x * cols: exact in float64 (powers of two within MAX_SHIFT)
            x = h[t] if self.cols is None else self.scaled(h[t])
            if split is None:
                xq[t], par[t] = split_hidden(x, width)
            else:
                split(x, xq[t], par[t])
            if not np.isfinite(par[t, 1]) or self.max_enorm * par[t, 1] * 2 > OVERFLOW:
                return None
        par[:, 3] = self.absolute_slack()
        return xq, par

    def scaled(self, h: np.ndarray) -> np.ndarray:
        """The screen's input: hidden states ``h`` [n, dim] times the column scales (float64,
        exact)."""
        h = np.asarray(h, np.float64)
        return h if self.cols is None else h * self.cols

    #: the water-filling bound is worth computing where this many of a hidden state's largest
    #: values hold at least WF_SHARE of its squared norm (a Gaussian one's 16 of 2,560: ~6 %)
    WF_TOP = 16
    WF_SHARE = 0.1

    def waterfill_pays(self, h: np.ndarray) -> bool:
        """Whether some hidden state of ``h`` [n, dim] has a few values large enough for
        :meth:`waterfill` to narrow the bounds (on flat ones it gives Cauchy-Schwarz's)."""
        if self.wf_m is None:
            return False
        for x in self.scaled(h):
            sq = x * x
            k = min(self.WF_TOP, sq.size)
            if k and np.partition(sq, sq.size - k)[sq.size - k:].sum() >= self.WF_SHARE * sq.sum():
                return True
        return False

    def waterfill(self, h: np.ndarray, ids: np.ndarray, lo8: np.ndarray, hi8: np.ndarray,
                  par: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Tighter bounds ``(lo, hi)`` [n, len(ids)] of rows ``ids`` from their int8 codes'
        bounds ``lo8``, ``hi8`` (as :func:`bounds_from_sums` computed them) and the hidden
        states ``h`` [n, dim] (docs/exact-head.md, "The water-filling bound").

        Cauchy-Schwarz bounds ``|δe . x|`` by ``||δe|| ||x||`` as if the rounding errors could
        all line up with x; but each is at most ``m = d / 2``, so with ``w_k = |δe_k| / m``,
        ``|δe . x| <= m sum w_k |x_k| <= m G(n)`` (:func:`waterfill_table`), which a hidden
        state with a few large values makes far smaller. ``a`` comes back from the bounds as
        their midpoint, within 2^-50 of the larger of them."""
        if self.wf_m is None:  # (tables made without build)
            return lo8, hi8
        grid, at = np.unique(self.wf_j[ids], return_inverse=True)  # the grid points needed
        G = np.stack([waterfill_table(x, grid) for x in self.scaled(h)])  # [n, len(grid)]
        a = (lo8 + hi8) * 0.5
        back = np.maximum(np.abs(lo8), np.abs(hi8)) * 2.0 ** -50
        b = (self.wf_m[ids] * G[:, at.reshape(-1)] + self.wf_rest[ids] * par[:, 1:2]
             + self.wf_N[ids] * par[:, 2:3] + np.abs(a) * 2.0 ** -45 + par[:, 3:4]) * (
                 1.0 + REL) + back
        return np.maximum(a - b, lo8), np.minimum(a + b, hi8)


def column_maxima(E: np.ndarray) -> np.ndarray:
    """float64 [dim]: each column's largest magnitude (NaN ignored, infinity kept: such a
    column gets no scale, :func:`column_scales`)."""
    E = np.asarray(E)
    if E.shape[0] == 0:
        return np.zeros(E.shape[1])
    return np.fmax.reduce(np.abs(E), axis=0).astype(np.float64)


def quantize_head(E: np.ndarray, bits: int = 8, cols: np.ndarray | None = None
                  ) -> tuple[np.ndarray, ...]:
    """numpy reference of :func:`.cpu.screen.quantize_bits`: rows of ``E`` (float values) ->
    ``(codes, scale, ||e - s k||, ||s k||, ||e||, bad)`` (:class:`ScreenTables`), and for
    ``bits`` 7 also ``(bit plane, ||e - d c||, ||d c||)`` of the int8 codes. With column
    scales ``cols``, all of it is of the rows ``e / cols`` (exact)."""
    E = np.asarray(E, dtype=np.float64)
    if cols is not None:
        E = E * (1.0 / np.asarray(cols, np.float64))
    V, h = E.shape
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(E).all(axis=1)
        m = np.where(bad, 0.0, np.abs(np.where(np.isfinite(E), E, 0)).max(axis=1, initial=0))
        d = m / 127.0
        inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
        c = np.where(bad[:, None], 0.0, np.clip(np.rint(E * inv[:, None]), -127, 127))
        r = E - c * d[:, None]
        dnorm = np.sqrt((r * r).sum(axis=1))
        qnorm = np.sqrt(((c * d[:, None]) ** 2).sum(axis=1))
        enorm = np.sqrt((E * E).sum(axis=1))
        if bits != 8:  # the high part h and the first pass's codes k (value (d / 2) k)
            sp = SPLIT[bits]
            hi = np.floor(c / sp)
            val = (d[:, None] / 2) * (2 * sp * hi + sp - 1)
            r1 = E - val
            dn1, qn1 = np.sqrt((r1 * r1).sum(axis=1)), np.sqrt((val * val).sum(axis=1))
    if bits == 8:
        codes = np.full((V, padded(h)), 128, np.uint8)
        codes[:, :h] = (c + 128).astype(np.uint8)
        return codes, d, dnorm, qnorm, enorm, bad
    off = 64 if bits == 7 else 32
    u = np.full((V, padded(h)), off, np.uint8)
    u[:, :h] = (hi + off).astype(np.uint8)
    low = np.zeros((V, padded(h)), np.uint8)
    low[:, :h] = (c - sp * hi).astype(np.uint8)
    if bits == 7:
        return (pack7(u), d / 2, dn1, qn1, enorm, bad,
                (np.packbits(low, axis=1, bitorder="little"), dnorm, qnorm))
    return pack6(u), d / 2, dn1, qn1, enorm, bad, (pack2(low), dnorm, qnorm)


def bounds_numpy(t: ScreenTables, xq: np.ndarray, par: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """numpy reference of the screen kernels: ``(lo, hi)`` float64 [n, V]."""
    c = t.signed_codes().astype(np.float64)  # exact integers: the products and sums are exact
    d1 = xq[:, 0].astype(np.float64) @ c.T  # [n, V]
    d2 = xq[:, 1].astype(np.float64) @ c.T
    return bounds_from_sums(t, d1, d2, par)


def bounds_from_sums(t: ScreenTables, d1: np.ndarray, d2: np.ndarray, par: np.ndarray,
                     ids: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(lo, hi)`` float64 [n, V] from a screen's exact integer sums ``D1 = c . q1`` and
    ``D2 = c . q2`` [n, V] of the signed codes (what the wgpu screen kernel returns): the
    float64 arithmetic of :func:`.cpu.screen._bound`, vectorized. With ``ids``: the int8
    screen of those rows of int7 tables (sums of their int8 codes, [n, len(ids)])."""
    if ids is None:
        scale, A, N = t.scale, t.A, t.N
    else:
        scale, A, N = 2 * t.scale[ids], t.fine_A[ids], t.fine_N[ids]
    a = scale * (FINE * np.asarray(d1, np.float64) + d2) * par[:, :1]
    b = (A * par[:, 1:2] + N * par[:, 2:3] + np.abs(a) * 2.0 ** -45
         + par[:, 3:4]) * (1.0 + REL)
    return a - b, a + b


def refine_numpy(t: ScreenTables, ids: np.ndarray, xq: np.ndarray, par: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """numpy reference of the int8 screen of rows ``ids`` of int7 tables: ``(lo, hi)``
    float64 [n, len(ids)]."""
    c = t.fine_codes(ids).astype(np.float64)
    d1 = xq[:, 0].astype(np.float64) @ c.T
    d2 = xq[:, 1].astype(np.float64) @ c.T
    return bounds_from_sums(t, d1, d2, par, ids)


@dataclass
class HeadStats:
    """What the head did over a generation: per step, how many rows its bounds left and how
    many of those the full kernel rescored."""

    mode: str
    steps: int = 0
    rows: int = 0
    screened_rows: int = 0
    candidates: list[int] = field(default_factory=list)  # rows the bounds leave, per step
    # int7, int6: the first pass's candidates, before the int8 screen of them
    screen_candidates: list[int] = field(default_factory=list)
    rescored: list[int] = field(default_factory=list)  # rows the f16 kernel computed, per step
    fallbacks: Counter = field(default_factory=Counter)  # reason -> rows
    head_bytes: int = 0  # bytes the head read, all steps
    full_bytes: int = 0  # what the full head reads per step

    screen_bits: int = 0  # the first pass's width (its last one)
    switches: list[str] = field(default_factory=list)  # the widths the head chose, and why

    def as_dict(self) -> dict[str, Any]:
        c = np.asarray(self.candidates or [0])
        return {"head": self.mode, "head_steps": self.steps,
                "candidates_per_step_mean": float(c.mean()),
                "candidates_per_step_max": int(c.max()),
                "head_fallbacks": dict(self.fallbacks),
                "head_bytes_per_step": self.head_bytes / max(self.steps, 1),
                "full_head_bytes": self.full_bytes,
                "rescored_per_step_mean": float(np.mean(self.rescored or [0])),
                **({"screen_bits": self.screen_bits, "screen_switches": self.switches}
                   if self.screen_bits else {}),
                **({"first_pass_candidates_per_step_mean":
                    float(np.mean(self.screen_candidates))}
                   if self.screen_candidates else {})}


class Head:
    """Chooses the tokens of final hidden states with the full or the screened head.

    ``backend`` provides ``lm_head(h)``; for the screened head also ``screen_tables()`` (or
    None where it has no screen), ``head_bounds(tables, xq, par) -> (lo, hi)``, ``head_rows(h,
    ids)`` (the full kernel's logits of rows ``ids``, the same bits as ``lm_head``) and
    ``head_rows_bytes(ids)``; and optionally ``pick_full(h, samplers)``, the full head's
    tokens as the backend chooses them itself (wgpu: its device argmax). ``check``: also
    compute the full logits every step and assert every bound and every token (tests).
    """

    def __init__(self, backend, mode: str = "screened", *, check: bool = False):
        if mode not in HEAD_MODES:
            raise RequestError(f"head must be {' or '.join(HEAD_MODES)}, got {mode!r:.20}")
        self.be, self.check = backend, check
        self.tables: ScreenTables | None = None
        self.unavailable = None  # why a screened head runs the full one
        if mode == "screened":
            make = backend.screen_tables
            self.unavailable = backend.no_screen
            self.tables = make() if make is not None and not self.unavailable else None
            if self.unavailable:
                pass  # the backend says why (a q2_0 head): every step reads the full head
            elif self.tables is None:
                self.unavailable = f"no screened head on the {backend.name} backend"
            elif self.tables.bad_rows:
                self.unavailable = f"the head has NaN or infinity in {self.tables.bad_rows} rows"
        self.mode = mode
        self.full_bytes = backend.head_nbytes or (
            backend.vocab * backend.dim * int(backend.head_itemsize))
        self.stats = HeadStats(mode, full_bytes=self.full_bytes)
        # the first pass's width, chosen from what pays on this model (_choose)
        self.choice = (backend.screen_choice if self.tables is not None and not
                       self.unavailable and 6 in backend.screen_choice else ())
        self.default_bits = self.choice[0] if self.choice else 0
        self._shares: list[float] = []  # int6's first pass, estimated or seen: share of rows
        self.switches: list[str] = []

    def reset_stats(self) -> None:
        self.stats = HeadStats(self.mode, full_bytes=self.full_bytes)

    def _full(self, h: np.ndarray, samplers: Sequence[Sampler], reason: str | None
              ) -> list[int]:
        st = self.stats
        st.head_bytes += self.full_bytes
        if reason:
            st.fallbacks[reason] += len(samplers)
        pick = self.be.pick_full  # a backend that chooses on its device
        return pick(h, samplers) if pick is not None else pick_tokens(self.be.lm_head(h),
                                                                      samplers)

    def select(self, h: np.ndarray, samplers: Sequence[Sampler]) -> list[int]:
        """The token each row of ``h`` [n, dim] leads to: the full head's choice."""
        st = self.stats
        st.steps += 1
        st.rows += len(samplers)
        if self.mode == "full":
            return self._full(h, samplers, None)
        if self.unavailable:
            return self._full(h, samplers, self.unavailable)
        for s in samplers:  # one such row makes the step read the whole head anyway
            p = s.params
            if not p.greedy and p.top_k == 0 and (p.top_p < 1.0 or p.min_p > 0.0):
                return self._full(h, samplers, "top-p or min-p without top-k")
        if not np.isfinite(h).all():
            return self._full(h, samplers, "hidden state not finite")
        prep = self.tables.prepare(h, self.be.split_hidden)
        if prep is None:
            return self._full(h, samplers, "logits could overflow")
        lo, hi = self.be.head_bounds(self.tables, *prep)
        # plain greedy rows (no penalty): their candidates in one pass over the bounds
        plain = np.array([s.params.greedy and s.penalized_ids().size == 0 for s in samplers])
        sets = [self._candidates(lo[r], hi[r], s)
                for r, s in enumerate(samplers) if not plain[r]]
        if plain.all():  # (no copies of the bounds: 16 MB at 8 rows)
            sets.append(self._greedy_candidates(lo, hi))
        elif plain.any():
            sets.append(self._greedy_candidates(lo[plain], hi[plain]))
        ids = sets[0] if len(sets) == 1 else np.unique(np.concatenate(sets))
        refined = []  # (rows, lo, hi) of each further pass, for the check
        up = None  # the candidates' upper bounds [n, len(ids)], for the greedy rescoring
        if ids.size > 1 or self.tables.fine is not None and ids.size:
            # the candidates' int8 bounds: int7's second pass (the int8 screen of its
            # candidates), then the water-filling bound, all chosen from at once
            if self.tables.fine is not None:
                st.screen_candidates.append(int(ids.size))
                lo8, hi8 = self.be.head_refine(self.tables, ids, *prep)
                refined.append((ids, lo8, hi8))
            else:
                lo8, hi8 = lo[:, ids], hi[:, ids]
            if ids.size > 1 and self.tables.waterfill_pays(h):
                lo8, hi8 = self.tables.waterfill(h, ids, lo8, hi8, prep[1])
                refined.append((ids, lo8, hi8))
            ids, up = self._refined_candidates(samplers, plain, lo, hi, ids, lo8, hi8)
        n_candidates = ids.size
        if plain.all() and self.be.dtype == np.float32 and ids.size > 1:
            ids, exact = self._rescore_greedy(h, ids, hi[:, ids] if up is None else up)
        else:
            exact = self.be.head_rows(h, ids)  # [n, len(ids)]
        if not np.isfinite(exact).all():
            return self._full(h, samplers, "logits not finite")
        st.screened_rows += len(samplers)
        st.screen_bits, st.switches = self.tables.bits, self.switches
        st.candidates.append(int(n_candidates))
        st.rescored.append(int(ids.size))
        st.head_bytes += (self.tables.nbytes + self.be.head_rows_bytes(ids)
                          + (self.tables.fine_nbytes(refined[0][0].size)
                             if self.tables.fine is not None and refined else 0))
        # greedy without penalty: Sampler.pick's argmax over float32 logits, every row
        # outside ids -inf; ids ascend, so the first maximum is the same row
        best = ids[np.argmax(exact.astype(np.float32, copy=False), axis=1)]
        tokens = []
        for r, s in enumerate(samplers):
            if plain[r]:
                tokens.append(int(best[r]))
                continue
            z = np.full(self.be.vocab, -np.inf, exact.dtype)
            z[ids] = exact[r]
            tokens.append(s.pick(z))
        if self.check:
            self._check(h, samplers, lo, hi, tokens, ids, exact, refined)
        if self.choice:
            self._choose(lo, hi, prep[1])
        return tokens

    #: steps whose int6 first pass is estimated (or watched) before the width is chosen
    CHOOSE_STEPS = 4
    #: int6 pays where its first pass leaves at most this share of the rows (the bit planes
    #: of those, 1/4 byte a value, then cost far less than the 1/4 byte a value it saves on
    #: every row), and stops paying above STOPS (watched over the steps it runs)
    INT6_PAYS = 0.02
    INT6_STOPS = 0.05
    MAX_SWITCHES = 2

    def _choose(self, lo: np.ndarray, hi: np.ndarray, par: np.ndarray) -> None:
        """The first pass's width from what pays on the model at hand: on this backend's
        default width, the candidates int6 codes would leave are estimated from this step's
        bounds (``int6_share``) for CHOOSE_STEPS steps; where they stay at most INT6_PAYS of
        the rows, the tables are made again with int6 codes (once: ~1 s on 2B-4T). On int6,
        its first pass's candidates are watched and above INT6_STOPS the default returns.
        Every width gives the same tokens; only the bytes read differ."""
        t, V = self.tables, self.be.vocab
        if t.bits != 6:
            self._shares.append(self.int6_share(lo, hi, par) / V)
        elif self.stats.screen_candidates:
            self._shares.append(self.stats.screen_candidates[-1] / V)
        if len(self._shares) < self.CHOOSE_STEPS:
            return
        share = float(np.mean(self._shares))
        self._shares.clear()
        to = (6 if t.bits != 6 and share <= self.INT6_PAYS else
              self.default_bits if t.bits == 6 and share > self.INT6_STOPS else None)
        if to is None:
            if t.bits != 6:  # int6 would not pay: stop estimating
                self.choice = ()
            return
        self.switches.append(f"int{t.bits} -> int{to} after {self.stats.steps} steps (int6 "
                             f"first pass {'estimated' if t.bits != 6 else 'seen'} at "
                             f"{share:.2%} of the rows)")
        self.tables = self.be.switch_screen(to)
        if len(self.switches) >= self.MAX_SWITCHES or to != 6:
            self.choice = ()

    def int6_share(self, lo: np.ndarray, hi: np.ndarray, par: np.ndarray) -> float:
        """About how many rows an int6 first pass would leave for these greedy bounds (mean
        over the tokens): each row's bound widened from its own codes' ``||e - e^||`` to
        int6's, ``sqrt(||δe8||^2 + 1.25 dim d^2)`` (the low two bits of the int8 codes, about
        uniform, are int6's added error; an estimate, not a bound)."""
        t = self.tables
        d8 = t.scale * (2.0 if t.bits == 7 else 1.0)
        dn8 = t.fine_A if t.bits == 7 else t.A
        grow = np.maximum(np.sqrt(dn8 * dn8 + 1.25 * t.width * d8 * d8) - t.A, 0.0)
        a, b = (lo + hi) * 0.5, (hi - lo) * 0.5 + grow * par[:, 1:2]
        top = (a - b).max(axis=1, keepdims=True)
        return float((a + b >= top).sum(axis=1).mean())

    def _rescore_greedy(self, h: np.ndarray, ids: np.ndarray, up: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray]:
        """Greedy rows without penalty (float32 logits): the exact logits of the candidates
        ``ids`` that can still win, ``(rows ascending, logits [n, rows])``. First each row's
        candidate with the largest upper bound ``up`` [n, len(ids)]; its exact logit ``e`` is
        at most that row's largest, so a candidate whose upper bound is below ``e`` in every
        row can neither win nor tie and is not read (a cold f16 row costs far more than its
        bytes). On 2B-4T's Gaussian head: ~31 candidates, ~6.5 read."""
        first = np.unique(ids[np.argmax(up, axis=1)])
        ex1 = self.be.head_rows(h, first)
        if not np.isfinite(ex1).all():
            return first, ex1  # (the caller falls back to the full head)
        need = (up >= ex1.max(axis=1, keepdims=True).astype(np.float64)).any(axis=0)
        rest = np.setdiff1d(ids[need], first, assume_unique=True)
        if rest.size == 0:
            return first, ex1
        rows = np.concatenate([first, rest])
        exact = np.concatenate([ex1, self.be.head_rows(h, rest)], axis=1)
        order = np.argsort(rows)
        return rows[order], exact[:, order]

    def _refined_candidates(self, samplers, plain, lo, hi, ids, lo2, hi2
                            ) -> tuple[np.ndarray, np.ndarray | None]:
        """The candidates again, with further bounds ``lo2``, ``hi2`` [n, len(ids)] of the
        candidates ``ids`` (the int8 screen of int7's, the water-filling bound; within all of
        them: each is rigorous). Every other
        row stays out: its upper bound is below the threshold it missed, and the thresholds
        (largest, k-th largest lower bound, with or without noise) only rise. Returns them
        and, where every row is plain greedy, their upper bounds [n, len]."""
        lo2 = np.maximum(lo2, lo[:, ids])
        hi2 = np.minimum(hi2, hi[:, ids])
        sets = []
        for r, s in enumerate(samplers):
            if plain[r]:
                continue
            lo_r, hi_r = lo[r].copy(), hi[r].copy()
            lo_r[ids], hi_r[ids] = lo2[r], hi2[r]
            sets.append(self._candidates(lo_r, hi_r, s))
        if plain.any():
            l2, h2 = lo2[plain], hi2[plain]
            if self.be.dtype != np.float32:  # as _greedy_candidates rounds them
                l2, h2 = l2.astype(np.float32), h2.astype(np.float32)
            top = l2.max(axis=1, keepdims=True)
            keep = (h2 >= top).any(axis=0)
            sets.append(ids[keep])
            if plain.all():
                return sets[0], hi2[:, keep]
        return (sets[0] if len(sets) == 1 else np.unique(np.concatenate(sets))), None

    def _greedy_candidates(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """The union of :meth:`_candidates` of greedy rows without penalty (``lo``, ``hi``
        [rows, vocab]), sorted: rows whose upper bound reaches some row's largest lower bound,
        both as the sampler rounds them (to the logits' dtype; rounding is monotone, so the
        rounded largest bound is the largest rounded bound)."""
        if self.be.dtype != np.float32:
            lo = lo.astype(np.float32)
            hi = hi.astype(np.float32)
        else:
            fast = self.be.greedy_candidates  # the same rows, compiled
            ids = fast(lo, hi) if fast is not None else None
            if ids is not None:
                return ids
        top = lo.max(axis=1, keepdims=True)
        return np.flatnonzero((hi >= top).any(axis=0))

    def _candidates(self, lo: np.ndarray, hi: np.ndarray, s: Sampler) -> np.ndarray:
        """Rows whose exact logit this sampler may need (module docstring)."""
        # the sampler rounds logits to float32 and penalizes them, both monotone: the same
        # maps on the bounds bound what it compares. Float32 logits need no rounding, so
        # there only the penalized rows are mapped.
        pen = s.penalized_ids()
        if self.be.dtype != np.float32:
            lo = s.penalize(lo.astype(np.float32)).astype(np.float64)
            hi = s.penalize(hi.astype(np.float32)).astype(np.float64)
        elif pen.size:
            pen = pen[pen < lo.size]
            lo, hi = lo.copy(), hi.copy()
            lo[pen] = s.penalize(lo[pen].astype(np.float32), pen)
            hi[pen] = s.penalize(hi[pen].astype(np.float32), pen)
        p, V = s.params, lo.size
        k = p.top_k if 0 < p.top_k < V else 0
        if p.greedy:
            return np.flatnonzero(hi >= lo.max())
        if k:
            return np.flatnonzero(hi >= np.partition(lo, -k)[-k])
        g = s.noise(V)
        ylo, yhi = lo / p.temperature + g, hi / p.temperature + g
        return np.flatnonzero(yhi >= ylo.max())

    def _check(self, h, samplers, lo, hi, tokens, ids, exact, refined=()) -> None:
        full = self.be.lm_head(h)
        if not np.array_equal(full[:, ids], exact):  # head_rows: the full kernel's very bits
            raise AssertionError("head_rows differs from lm_head on the candidates")
        full = full.astype(np.float64)
        # the further passes' bounds: int7's int8 screen, the water-filling bound
        for p, (rows, lo2, hi2) in enumerate(refined):
            bad = np.argwhere((full[:, rows] < lo2) | (full[:, rows] > hi2))
            if bad.size:
                r, i = bad[0]
                raise AssertionError(f"pass {p + 2} bound broken at row {rows[i]}: "
                                     f"{lo2[r, i]!r} <= {full[r, rows[i]]!r} <= {hi2[r, i]!r} "
                                     "fails")
        for r, s in enumerate(samplers):
            bad = np.flatnonzero((full[r] < lo[r]) | (full[r] > hi[r]))
            if bad.size:
                v = int(bad[0])
                raise AssertionError(f"bound broken at row {v}: {lo[r, v]!r} <= "
                                     f"{full[r, v]!r} <= {hi[r, v]!r} fails")
            want = s.pick(full[r].astype(self.be.dtype))
            if want != tokens[r]:
                raise AssertionError(f"screened token {tokens[r]} != full head's {want}")
