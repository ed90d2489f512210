"""The picture of a :class:`~bitformat.bench.BenchResult`: one PNG with two panels.

* Left: bytes read per token (x) against milliseconds per token (y), one point per container
  (its own colour and marker, named in the legend below: labels beside the points covered
  each other where containers read the same bytes), with lines of constant GB/s through the
  range for reference.
* Right: each container's milliseconds per token split into kernel classes (stacked bars),
  with the wall time per token marked where it differs from the classes' sum (wgpu: the
  classes are one profiled step's kernel times; the wall time adds submit and readback).

matplotlib is imported here only and drawn through its Agg canvas, as in ``report_plot``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from .bench import CLASSES, LABELS, BenchResult
from .report_plot import save_figure, style

COLOURS = {"ternary": "#4c72b0", "lm_head": "#dd8452", "other": "#55a868",
           "attention": "#c44e52"}


def plot_bench(result: BenchResult, out: str | os.PathLike) -> None:
    """Draw ``result`` into ``out``: PNG, SVG or PDF by its extension (written atomically)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 5.5), layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2, width_ratios=[1, 1])
    cs = result.containers
    xs = [c.bytes_per_token / 1e6 for c in cs]
    ys = [c.ms_per_token for c in cs]
    for c, x, y in zip(cs, xs, ys, strict=True):
        colour, _, marker = style(c.format, 1 if c.decode == "fused" else 0)
        tps = f"{c.tokens_per_s:,.0f}" if c.tokens_per_s >= 100 else f"{c.tokens_per_s:.3g}"
        left.scatter([x], [y], s=70, color=colour, marker=marker, zorder=3, edgecolor="black",
                     linewidth=0.5, label=f"{c.label}: {tps} tok/s, {c.gbps:.2f} GB/s")
    left.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    if cs:
        lo, hi = min(xs) * 0.9, max(xs) * 1.1
        for gbps in _reference_rates(cs):
            left.plot([lo, hi], [lo / gbps, hi / gbps], color="grey", lw=0.6, ls=":")
            left.text(hi, hi / gbps, f" {gbps:g} GB/s", fontsize=7, color="grey", va="center",
                      clip_on=True)
        left.set_xlim(lo, hi * 1.15)
        left.set_ylim(0, max(ys) * 1.25)
    left.set_xlabel("MB read per token (weights as the backend reads them + KV cache)")
    left.set_ylabel("ms per token (wall)")
    left.set_title(f"{Path(result.source).name} on {result.backend}: bytes against latency")
    left.grid(alpha=0.3)

    names = [c.label for c in cs]
    base = [0.0] * len(cs)
    for k in CLASSES:
        ms = [c.classes[k]["ms"] for c in cs]
        right.barh(names, ms, left=base, color=COLOURS[k], label=LABELS[k])
        base = [a + b for a, b in zip(base, ms, strict=True)]
    walls = [(i, c.ms_per_token) for i, c in enumerate(cs)
             if abs(c.ms_per_token - c.kernel_ms) > 1e-3 * c.ms_per_token]
    if walls:
        right.scatter([w for _, w in walls], [names[i] for i, _ in walls], marker="|", s=400,
                      color="black", zorder=3, label="wall time per token")
    right.invert_yaxis()
    right.set_xlabel(f"ms per token by kernel class ({result.timing})")
    right.set_title("where a token's time goes")
    right.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3)
    right.grid(axis="x", alpha=0.3)
    save_figure(fig, out)


def _reference_rates(cs: list) -> list[float]:
    """Powers of ten of GB/s around the measured rates (a line of constant bandwidth each)."""
    rates = [c.gbps for c in cs if c.gbps > 0]
    if not rates:
        return []
    lo, hi = math.floor(math.log10(min(rates))), math.ceil(math.log10(max(rates)))
    return [10.0 ** e for e in range(lo, hi + 1)][:4]
