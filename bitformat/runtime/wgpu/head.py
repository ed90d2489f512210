"""The screened LM head on the ``wgpu`` backend (docs/exact-head.md, "The wgpu backend").

At load (on first use) the head's rows become the same int8 codes as on the cpu backend
(:func:`..cpu.screen.quantize_bits`), uploaded as signed bytes, four to a word, in row chunks
that each fit one storage binding. Per step and token:

1. the host splits the hidden state ``x`` (the f32 bits the full head reads) into two int8
   vectors (:meth:`..head.ScreenTables.prepare`) and writes them (2 bytes per value);
2. ``screen.wgsl`` computes every row's exact integer sums ``D1 = c . q1`` and ``D2 = c . q2``
   (``dot4I8Packed``, int32: no rounding at all), 8 bytes per row come back;
3. the host turns them into float64 bounds (:func:`..head.bounds_from_sums`) and
   :class:`..head.Head` picks the candidates;
4. ``lm_head_rows_step.wgsl`` (``lm_head_rows.wgsl`` on a device without subgroups) computes
   the candidates' logits on the device with the full head kernel's own per-row code
   (``lm_head_row.wgsl`` + ``lm_head_lanes.wgsl``), 4 bytes per candidate back.

The bound's rounding term is wider than the cpu backend's: the compilers between WGSL and the
device (naga, the driver's) may reassociate and fuse the f32 sums, Vulkan leaves the rounding
mode undefined and allows subnormals to be flushed (:func:`flushed_norms`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...constants import GGMLType
from .. import head as EH
from .device import UNIFORM_WORDS, Dispatch, GpuDevice

WG = 64
#: the most candidates the device's greedy screened step lists (more: the full head runs)
CAP = 2048
#: argmax_screen.wgsl's candidate count where the screen did not hold at all
NONE = 0xFFFFFFFF
#: the device's unit roundoff as the bound assumes it: one ulp (2^-23), which covers
#: round-to-nearest (2^-24) and the directed roundings Vulkan also allows
UNIT = 2.0 ** -23
#: below these magnitudes a value may be flushed to zero: f16 subnormals (2^-14) when the
#: driver converts them, f32 (and bf16) subnormals (2^-126) in any arithmetic
SUBNORMAL = {GGMLType.F16: 2.0 ** -14, GGMLType.BF16: 2.0 ** -126, GGMLType.F32: 2.0 ** -126}


def flushed_norms(rows: np.ndarray, gtype: GGMLType, values: np.ndarray | None = None,
                  block: int = 4096, cols: np.ndarray | None = None) -> np.ndarray:
    """Per row, the norm of the values that a device flushing subnormals may read as 0.

    ``rows``: the head's stored words (uint16 bits for F16/BF16, float32 for F32) [V, dim];
    ``values``: the float32 value of every 16-bit pattern (F16/BF16). With column scales
    ``cols``: the norm of those values divided by their column's scale (the screen's rows)."""
    V = rows.shape[0]
    out = np.empty(V)
    lim = SUBNORMAL[gtype]
    icols = 1.0 if cols is None else 1.0 / np.asarray(cols, np.float64)
    for v0 in range(0, V, block):
        r = rows[v0: v0 + block]
        e = (values[r] if values is not None else r).astype(np.float64)
        e = np.where(np.abs(e) < lim, e, 0.0) * icols
        out[v0: v0 + block] = np.sqrt((e * e).sum(axis=1))
    return out


def _f32_up(v: Any) -> np.ndarray:
    """float64 values as float32, rounded up (never below the value)."""
    v = np.asarray(v, np.float64)
    f = v.astype(np.float32)
    return np.where(f.astype(np.float64) < v, np.nextafter(f, np.float32(np.inf)), f)


@dataclass
class ScreenStep:
    """The screened head's part of a greedy decode step (:meth:`GpuScreenedHead.step_dispatches`):
    ``items`` after the final norm, then ``argmax`` (the token into ``result`` only) or
    ``argmax_step`` (and the step state)."""

    items: list[Dispatch]
    argmax: Dispatch
    argmax_step: Dispatch
    cap: int
    bounds: Any  # (lo, hi) float32 per row (screen_step.wgsl)
    candidates: Any  # the count, then the ids (screen_pick.wgsl)

    @property
    def labels(self) -> list[str]:
        """The profile labels (``WgpuBitNet.profile``) of its dispatches: the head's share of
        a profiled step."""
        return sorted({d.label or d.kind for d in (*self.items, self.argmax)})


class GpuScreenedHead:
    """The int8 screen and the candidate rescoring of one head (a ``GpuEmbedding``)."""

    def __init__(self, dev: GpuDevice, head: Any, xf: Any):
        from ..cpu import head as H
        from ..cpu import screen as S

        self.dev, self.head, self.xf = dev, head, xf
        V, dim = head.vocab, head.dim
        gtype = head.gtype
        rows = head.host_rows
        width = EH.padded(dim)
        lut = None
        if gtype == GGMLType.F32:
            E = np.ascontiguousarray(rows).view("<f4").reshape(V, dim)
        else:
            E = np.ascontiguousarray(rows).view("<u2").reshape(V, dim)
            lut = H.lut16(gtype.name)
        cols = S.column_choice(E, lut)
        # int8 codes (the device reads no int7)
        *parts, _ = S.quantize_rows(E, lut, dim, cols=cols)
        codes = parts[0]
        self.tables = EH.ScreenTables.build(*parts, dim, self.depth(dim), UNIT,
                                            flushed=flushed_norms(E, gtype, lut, cols=cols),
                                            flush_x=True, cols=cols)
        self.width, self.w4 = width, width // 4
        if 2 * self.w4 > UNIFORM_WORDS:  # q1 and q2 share one 64 KiB block
            raise ValueError(f"a screen of width {width} exceeds the 64 KiB input block")
        # signed codes, four to a u32 word; rows chunked by the binding limit
        signed = (codes ^ np.uint8(0x80)).view(np.int8)
        step = max(1, dev.max_binding // width)
        self.xq = dev.buffer(4 * UNIFORM_WORDS, "screen.xq", uniform=True)
        self.sums = dev.buffer(8 * V, "screen.sums")
        self.screen: list[Dispatch] = []
        self._chunks: list[tuple[int, int, Any]] = []  # (first row, rows, codes) per chunk
        self._steps: dict[tuple, ScreenStep] = {}  # step_dispatches' steps
        self._terms: tuple[Any, Any] | None = None  # the step's per-row terms, column scales
        for r0 in range(0, V, step):
            n = min(V, r0 + step) - r0
            buf = dev.upload(signed[r0: r0 + n], f"screen.codes[{r0}:{r0 + n}]")
            self._chunks.append((r0, n, buf))
            k = dev.kernel("screen", ROWS=n, W4=self.w4, LANES=dev.lanes)
            p = dev.uniform(np.array([r0, 0, 0, 0], np.uint32))
            self.screen.append(Dispatch("screen", k, dev.bind(k, self.xq, buf, p, self.sums),
                                        dev.grid(math.ceil(n / (WG // dev.lanes))),
                                        n * width + 2 * width))
        # the rescoring: one dispatch per head chunk holding candidates
        self.ids = dev.buffer(4 * V, "head_rows.ids")
        self.out = dev.buffer(4 * V, "head_rows.logits")
        if dev.subgroups:  # the full head is lm_head_step.wgsl: the same per-row arithmetic
            lpr, rpw = dev.head_shape()
            self.kr = dev.kernel("lm_head_rows_step", DIM=dim, DTYPE=head.dtype, RPW=rpw,
                                 LPR=lpr)
            self.rows_per_group = rpw
        else:
            self.kr = dev.kernel("lm_head_rows", DIM=dim, DTYPE=head.dtype, LANES=dev.lanes)
            self.rows_per_group = WG // dev.lanes
        self.rows = []
        for r0, n, buf in head.chunks:
            p = dev.buffer(16, f"head_rows.params[{r0}]", uniform=True)
            self.rows.append((r0, n, p, dev.bind(self.kr, xf, buf, p, self.out, self.ids)))

    def step_dispatches(self, head_parts: Any, logits: Any, result: Any, state: Any, *,
                        cap: int = CAP) -> ScreenStep:
        """The greedy decode step's head on the device (docs/exact-head.md, "The screened head
        on the device"): after the final norm has written ``xf``, these dispatches choose
        the full head's argmax without the hidden state leaving the device.

        ``screen_prep`` splits x into the screen's two int8 vectors and bounds its norms;
        ``screen_step`` (per chunk of the int8 rows) turns every row's integer sums into
        float32 bounds and keeps the largest lower bound; ``screen_pick`` lists the rows
        whose upper bound reaches it (at most ``cap``); ``lm_head_rows_step`` (CAND) computes
        their logits with the full head's per-row arithmetic; ``lm_head_step`` (GATE) runs
        the full head only where the screen did not hold (x not finite, logits that could
        overflow, more than ``cap`` candidates); ``argmax_screen`` takes the argmax of
        whichever ran into ``result`` ([row, logit bits, candidate count]) and, for the
        ``STEP`` variant, the state. The float32 bounds are the host's float64 ones widened
        by their own rounding (the kernels' headers)."""
        dev, t, head = self.dev, self.tables, self.head
        V, dim = head.vocab, head.dim
        key = (cap, head_parts, logits, result, state)  # one step per network and cap
        if key in self._steps:
            return self._steps[key]
        up = _f32_up
        if self._terms is None:  # uploaded once: each row's d, A, N; the column scales
            cols = np.ones(dim, np.float32) if t.cols is None else t.cols.astype(np.float32)
            rows = np.zeros((V, 4), np.float32)
            rows[:, 0] = t.scale.astype(np.float32)  # (its rounding is in the bound)
            rows[:, 1], rows[:, 2] = up(t.A), up(t.N)
            self._terms = (dev.upload(rows, "screen.row_terms"),
                           dev.upload(cols, "screen.column_scales"))
        rtab, cbuf = self._terms
        n = dim + 2  # roundings of a sum of dim squares in any order, and one to spare
        gamma = n * UNIT / (1 - n * UNIT)
        lh = dev.buffer(8 * V, "screen.bounds")
        sp = dev.buffer(32, "screen.params")
        cand = dev.buffer(4 * (cap + 1), "screen.candidates")
        cand_logits = dev.buffer(4 * max(cap, 1), "screen.candidate_logits")
        k = dev.kernel("screen_prep", DIM=dim, W4=self.w4,
                       KS=float(up(1 / (1 - gamma) * (1 + 2.0 ** -18))),
                       SQN=float(up(math.sqrt(dim))), ENORM=float(up(t.max_enorm)))
        items = [Dispatch("screen", k, dev.bind(k, self.xf, cbuf, self.xq, sp, cand),
                          (1, 1, 1), 8 * dim, label="screen_prep")]
        slack = float(up(t.absolute_slack()))
        for r0, nr, codes in self._chunks:  # the same chunks as the host-bounded screen
            k = dev.kernel("screen_step", ROWS=nr, W4=self.w4, LANES=dev.lanes, SLACK=slack)
            p = dev.uniform(np.array([r0, 0, 0, 0], np.uint32))
            items.append(Dispatch("screen", k, dev.bind(k, self.xq, codes, p, lh, rtab, sp),
                                  dev.grid(math.ceil(nr / (WG // dev.lanes))),
                                  nr * (self.width + 16) + 2 * self.width, label="screen"))
        k = dev.kernel("screen_pick", V=V, CAP=cap)
        items.append(Dispatch("screen", k, dev.bind(k, lh, sp, cand),
                              dev.grid(math.ceil(V / 256)), 8 * V, label="screen_pick"))
        lpr, rpw = dev.head_shape()
        kc = dev.kernel("lm_head_rows_step", DIM=dim, DTYPE=head.dtype, RPW=rpw, LPR=lpr,
                        CAND=1, CAP=cap)
        for r0, nr, buf in head.chunks:
            p = dev.uniform(np.array([r0, nr, 0, 0], np.uint32))
            items.append(Dispatch("lm_head", kc, dev.bind(kc, self.xf, buf, p, cand_logits,
                                                          cand),
                                  dev.grid(max(1, math.ceil(cap / rpw))), 4 * cap,
                                  label="lm_head_rows"))
        items += head.head_dispatches(self.xf, logits, head_parts, gate=(cand, cap))
        argmax = []
        for st in (0, 1):
            k = dev.kernel("argmax_screen", N=head.n_parts, CAP=cap, STEP=st)
            argmax.append(Dispatch("argmax", k, dev.bind(k, cand_logits, cand, head_parts,
                                                         result, state),
                                   (1, 1, 1), 8 * head.n_parts, label="argmax"))
        self._steps[key] = ScreenStep(items, argmax[0], argmax[1], cap, lh, cand)
        return self._steps[key]

    @staticmethod
    def depth(dim: int) -> int:
        """Roundings a product may pass through in ``lm_head.wgsl`` as any compiler evaluates it.

        As written, a lane's product passes one rounding for itself, one in its 2-value dot,
        one joining the two dots, then its chain (``ceil(dim / 4 / LANES)`` adds), the lanes'
        ``LANES - 1`` and one for an odd pair: 643 for dim 2560 on one lane. But the sum is
        not marked exact, so naga and the driver may reassociate or fuse it; any binary tree
        over the dim products (each rounded once, or fused into its add) passes a product
        through at most dim roundings. ``dim + 2`` covers every order."""
        return dim + 2

    @property
    def nbytes(self) -> int:
        return self.tables.nbytes

    def bounds(self, t: EH.ScreenTables, xq: np.ndarray, par: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
        """``(lo, hi)`` float64 [n, V]: the device's integer sums, bounded on the host."""
        V = t.scale.size
        d1 = np.empty((xq.shape[0], V), np.int64)
        d2 = np.empty_like(d1)
        for i in range(xq.shape[0]):
            self.dev.write(self.xq, np.ascontiguousarray(xq[i]).reshape(-1).view("<u4"))
            self.dev.run(self.screen)
            s = np.frombuffer(self.dev.read(self.sums, 8 * V), "<i4").reshape(V, 2)
            d1[i], d2[i] = s[:, 0], s[:, 1]
        return EH.bounds_from_sums(t, d1, d2, par)

    def logits(self, h: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """The full head kernel's logits of rows ``ids`` (ascending) [n, len(ids)], float32."""
        ids = np.asarray(ids, np.int64)
        dev = self.dev
        out = np.empty((h.shape[0], ids.size), np.float32)
        if ids.size == 0:
            return out
        dev.write(self.ids, ids.astype("<u4"))
        items = []
        for r0, n, p, group in self.rows:
            a, b = np.searchsorted(ids, [r0, r0 + n])
            dev.write(p, np.array([r0, b - a, a, 0], np.uint32))
            if b > a:
                items.append(Dispatch("lm_head_rows", self.kr, group,
                                      dev.grid(math.ceil((b - a) / self.rows_per_group)),
                                      int(b - a) * self.head.row_bytes))
        for t in range(h.shape[0]):
            dev.write(self.xf, np.ascontiguousarray(h[t], np.float32))
            dev.run(items)
            out[t] = np.frombuffer(dev.read(self.out, 4 * ids.size), np.float32)
        return out
