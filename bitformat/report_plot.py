"""The picture of a :class:`~bitformat.report.Report`: one figure (PNG, SVG or PDF), two panels.

* Top: bits per weight of every tensor (by layer, then kind) in each container, with the
  order-0 entropies (a table per tensor, per row, one for the model) drawn as black lines;
  they bound single-trit codes, not rans (:data:`~bitformat.report.FLOOR_NOTE`).
* Bottom: the whole file in each container (every tensor; the metadata not counted), split
  into ternary weights, the LM head and the rest (norms), with its bits per parameter written
  on, against the order-0 reference (ternary weights at their per-tensor entropy, the head at
  the entropy of its 16-bit values).

matplotlib is imported here only, and drawn through its Agg canvas (no pyplot, no global
backend switch), so this works without a display and leaves a caller's matplotlib alone.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .errors import UnsupportedConversionError
from .io.atomic import atomic_file
from .report import FLOOR_NOTE, LABELS, Report

#: what :func:`save_figure` writes, chosen by the output's extension
FIGURE_FORMATS = ("png", "svg", "pdf")

KIND_ORDER = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")
#: container (or report series) -> (colour, line style, marker): each its own colour and marker
#: (the bench plot draws markers only), so no two series look alike in either plot
STYLE = {
    "i2_s": ("#7f7f7f", "-", "o"), "tq2_0": ("#bcbd22", "--", "s"),
    "tq1_0": ("#17becf", "-", "^"), "q2_0": ("#e377c2", "--", "D"),
    "iq2_bn": ("#2ca02c", ":", "v"), "iq1_bn": ("#98df8a", "-.", "<"),
    "stfma": ("#9467bd", ":", ">"), "colpack_u32": ("#8c564b", "-.", "p"),
    "base3": ("#ff7f0e", "-", "h"), "rans": ("#d62728", "-", "*"),
    "zstd19": ("#1f77b4", "-", "X"), "hf": ("#aec7e8", "--", "P"),
}
#: for series no table entry names: colours and markers the table does not use
SPARE = (("#ffbb78", "d"), ("#c5b0d5", "H"), ("#c49c94", "8"))  # filled markers only


def style(name: str, variant: int = 0) -> tuple[str, str, str]:
    """(colour, line style, marker) of a series; ``variant`` > 0 gives the same container a
    marker of its own (rans decoded at load and in the kernels)."""
    if name in STYLE and variant == 0:
        return STYLE[name]
    colour = STYLE[name][0] if name in STYLE else SPARE[sum(map(ord, name)) % len(SPARE)][0]
    marker = SPARE[(variant + sum(map(ord, name))) % len(SPARE)][1]
    return colour, "--", marker


def _order(names: list[str]) -> list[int]:
    """Tensor indices sorted by layer number, then projection kind (file order otherwise)."""
    def key(i: int):
        m = _BLOCK.match(names[i])
        if not m:
            return (1 << 30, 0, i)
        kind = m.group(2)
        return (int(m.group(1)), KIND_ORDER.index(kind) if kind in KIND_ORDER else 99, i)

    return sorted(range(len(names)), key=key)


def plot_report(report: Report, out: str | os.PathLike) -> None:
    """Draw ``report`` into ``out``: PNG, SVG or PDF by its extension (written atomically)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 9), layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, height_ratios=[3, 2])
    tensors = report.tensors
    order = _order([t.name for t in tensors])
    x = list(range(len(order)))
    for c in report.containers:
        y = [tensors[i].bpw[c] for i in order]
        if all(v is None for v in y):
            continue
        colour, ls, marker = style(c)
        y = [float("nan") if v is None else v for v in y]
        total = report.model["bits_per_weight"][c]
        label = f"{LABELS.get(c, c)} ({total:.3f})" if total is not None else LABELS.get(c, c)
        top.plot(x, y, ls, color=colour, marker=marker, markersize=5, lw=1.2, label=label,
                 markevery=max(1, len(x) // 24))
    fl = report.model["floors"]
    top.plot(x, [tensors[i].floors["order0_tensor"] for i in order], color="black", lw=1,
             ls="--", label=f"order-0 entropy, a table per tensor ({fl['order0_tensor']:.3f})")
    top.plot(x, [tensors[i].floors["order0_row"] for i in order], color="black", lw=1, ls=":",
             label=f"order-0 entropy, a table per row ({fl['order0_row']:.3f})")
    top.axhline(fl["order0_global"], color="grey", lw=0.8, ls="-.",
                label=f"order-0 entropy, one table ({fl['order0_global']:.3f})")
    _layer_ticks(top, [tensors[i].name for i in order])
    top.set_ylabel("bits per ternary weight")
    top.set_title(f"{os.path.basename(report.path)}: bits per weight per tensor "
                  "(model-wide in brackets)")
    top.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    top.grid(axis="y", alpha=0.3)
    top.text(0.0, -0.16, "black lines: " + FLOOR_NOTE, transform=top.transAxes, fontsize=7,
             va="top", wrap=True)

    whole = {c: d for c, d in report.model.get("whole", {}).items() if d is not None}
    names = list(whole)
    mb = {k: [whole[c][k] / 1e6 for c in names] for k in ("ternary", "lm_head", "other")}
    labels = [LABELS.get(c, c) for c in names]
    bottom.barh(labels, mb["ternary"], color="#4c72b0", label="ternary weights")
    head = report.head
    coded = ", rans codes it" if head and head["bytes"].get("rans") != head["bytes"].get(
        "i2_s") else ""
    bottom.barh(labels, mb["lm_head"], left=mb["ternary"], color="#dd8452",
                label=f"LM head ({report.lm_head}{coded})")
    left = [a + b for a, b in zip(mb["ternary"], mb["lm_head"], strict=True)]
    bottom.barh(labels, mb["other"], left=left, color="#55a868", label="norms and the rest")
    for i, c in enumerate(names):
        total = whole[c]["bytes"] / 1e6
        bottom.text(total, i, f" {whole[c]['bits_per_parameter']:.3f} bits/param",
                    va="center", ha="left", fontsize=8)
        share = whole[c]["lm_head"] / whole[c]["bytes"]
        bottom.text(mb["ternary"][i] + mb["lm_head"][i] / 2, i, f"LM head {share:.0%}",
                    va="center", ha="center", fontsize=8, color="white")
    ref = report.model.get("whole_order0_bits_per_parameter")
    if ref is not None and report.model.get("parameters"):
        bottom.axvline(ref * report.model["parameters"] / 8e6, color="black", ls="--", lw=1,
                       label=f"order-0 reference ({ref:.3f} bits/param)")
    if names:
        bottom.set_xlim(0, 1.22 * max(whole[c]["bytes"] for c in names) / 1e6)  # room for text
    bottom.invert_yaxis()
    bottom.set_xlabel("MB of tensor data in the file")
    bottom.set_title("the whole file, by container")
    bottom.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    save_figure(fig, out)


def save_figure(fig, out: str | os.PathLike) -> None:
    """Write ``fig`` to ``out`` in the format its extension names, atomically."""
    fmt = Path(out).suffix.lower().lstrip(".")
    if fmt not in FIGURE_FORMATS:
        raise UnsupportedConversionError(f"cannot draw a {fmt or 'extension-less'} file; name "
                                         "it .png, .svg or .pdf", path=str(out))
    with atomic_file(out) as fh:
        fig.savefig(fh, dpi=110, format=fmt)


def _layer_ticks(ax, names: list[str]) -> None:
    ticks, labels, last = [], [], None
    for i, n in enumerate(names):
        m = _BLOCK.match(n)
        layer = m.group(1) if m else None
        if layer != last and layer is not None:
            ticks.append(i)
            labels.append(layer)
        last = layer
    step = max(1, len(ticks) // 30)
    ax.set_xticks(ticks[::step], labels[::step], fontsize=7)
    ax.set_xlabel("layer (tensors in each: " + ", ".join(KIND_ORDER) + ")")
    ax.set_xlim(-0.5, len(names) - 0.5)
