"""What ``bitformat report`` measures: every container's size for one model, against the floors.

For each ternary tensor of a model (in whatever container it is stored) the trits are encoded
into every container bitformat writes, the bytes counted and decoded again to check that the
trits came back (encode, measure, decode-verify). Next to those sizes stand:

* ``base3``: the base3 codec (5 trits per byte, with its 8-byte trit count header);
* ``zstd19``: Zstandard level 19 over the tensor's i2_s bytes, the generic baseline;
* the order-0 entropy floors: over the whole model (``global``), per tensor, and per row.

Bits per weight are the tensor's bytes as bitformat writes them (everything a GGUF tensor
holds: packed trits, block scales, rANS tables, maps, word counts and checksum) times 8 over
its weight count. The per-tensor metadata keys of non-native containers (shape, scale) are not
counted, as no container's header is.

A generated token reads every ternary matrix once, the LM head (the f16 embedding, when the
model ties it to the embedding, as BitNet b1.58 2B-4T does), one embedding row and every norm;
:class:`Report` gives those bytes per container and the share of each (a coded head is read as
the f16 it is decoded into at load).

The whole file: the LM head is measured too (``Report.head``): its bytes in each container
(``rans`` codes an F16/BF16 head with ``rans_float``, encoded here and decode-verified; the
others store it as it is) against the order-0 entropy of its 16-bit values, and
``Report.model["whole"]`` adds every tensor up, in bits per parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from .container import open_model, require_ternary
from .errors import ScaleLossError, ShapeError
from .formats import FORMAT_IDS, get_format
from .io.model import Model, TensorEntry
from .ternary import TernaryTensor

#: Columns of the report, in order: the containers, the base3 codec, zstd-19 over i2_s bytes.
CONTAINERS = (*[f for f in FORMAT_IDS if f != "rans"], "base3",
              *[f for f in FORMAT_IDS if f == "rans"], "zstd19")
LABELS = {"zstd19": "zstd-19 of i2_s", "colpack_u32": "colpack"}
ZSTD_LEVEL = 19
FLOORS = ("order0_tensor", "order0_row")
#: what the order-0 lines bound, and why rans may go below them
FLOOR_NOTE = ("order-0 floors bound a code of single trits with one table per tensor, per row or "
              "for the whole model; rans can go below them: it leaves out dead rows and columns "
              "(a flagged zero costs nothing) and codes each class of rows with its own table")


@dataclass
class TensorReport:
    name: str
    shape: list[int]
    weights: int
    stored_bytes: int  # in the source container
    bytes: dict[str, int | None]  # container -> bytes (None: the container cannot hold it)
    counts: list[int]  # trits -1, 0, +1
    floors: dict[str, float]  # bits per weight: order-0 entropy of the tensor, sum over rows
    dead_rows: int

    @property
    def bpw(self) -> dict[str, float | None]:
        return {c: None if b is None else b * 8 / self.weights for c, b in self.bytes.items()}


@dataclass
class Report:
    path: str
    container: str
    containers: list[str]
    tensors: list[TensorReport] = field(default_factory=list)
    model: dict = field(default_factory=dict)
    per_token: dict = field(default_factory=dict)
    lm_head: str = ""
    head: dict = field(default_factory=dict)  # the LM head's bytes per container and floor

    def to_json(self) -> dict:
        out = asdict(self)
        for t, d in zip(self.tensors, out["tensors"], strict=True):
            d["bits_per_weight"] = t.bpw
        return out


# -- measuring ---------------------------------------------------------------------------------
def entropy_bits(counts: np.ndarray) -> float:
    """Order-0 entropy (bits per symbol) of a count vector; 0 for no symbols."""
    c = np.asarray(counts, dtype=np.float64)
    total = c.sum()
    if total == 0:
        return 0.0
    p = c[c > 0] / total
    return float(-(p * np.log2(p)).sum())


def row_counts(trits: np.ndarray) -> np.ndarray:
    """int64 ``[rows, 3]``: the -1, 0 and +1 count of every row."""
    from .formats import rans_layout

    t = np.ascontiguousarray(trits, dtype=np.int8)
    counts = np.empty((t.shape[0], 3), dtype=np.int64)
    if rans_layout.scan(t, counts, np.zeros(t.shape[1], dtype=np.uint8)) >= 0:
        TernaryTensor(t, np.float32([1.0])).validate_trits()  # raises, naming the value
    return counts


def row_entropy_bits(counts: np.ndarray) -> float:
    """Total bits of the per-row order-0 floor: each row coded with its own distribution."""
    c = counts.astype(np.float64)
    n = c.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        logp = np.where(c > 0, np.log2(c / np.maximum(n, 1)), 0.0)
    return float(-(c * logp).sum())


def _verify(fid: str, trits: np.ndarray, back: np.ndarray, name: str) -> None:
    if back.shape != trits.shape or not np.array_equal(back.reshape(trits.shape), trits):
        raise RuntimeError(f"{fid}: decoding the bytes just encoded changed the trits of "
                           f"{name} (a bug in bitformat)")


def measure_tensor(t: TernaryTensor, name: str, stored_bytes: int = 0,
                   zstd_level: int = ZSTD_LEVEL) -> TensorReport:
    """Encode ``t`` into every container, count the bytes and decode-verify each."""
    from .codecs import Base3, Zstd

    rows, cols = t.shape
    sizes: dict[str, int | None] = {}
    i2s_bytes = None
    for fid in FORMAT_IDS:
        fmt = get_format(fid)
        try:
            p, _ = fmt.prepare(t, allow_rounding=True)  # sizes do not depend on the scale
        except (ShapeError, ScaleLossError):
            sizes[fid] = None
            continue
        raw = fmt.encode(p)
        back = fmt.decode(raw.reshape(-1).view(np.uint8), rows, cols,
                          scale=None if fmt.native else float(p.scales[0]), name=name)
        _verify(fid, t.trits, back.trits, name)
        sizes[fid] = int(raw.nbytes)
        if fid == "i2_s":
            i2s_bytes = raw
    b3 = Base3().encode(t.trits)
    _verify("base3", t.trits.reshape(-1), Base3().decode(b3), name)
    sizes["base3"] = len(b3)
    if i2s_bytes is None:
        sizes["zstd19"] = None
    else:
        z = Zstd(zstd_level)
        packed = z.encode(i2s_bytes)
        if not np.array_equal(z.decode(packed), i2s_bytes.reshape(-1).view(np.uint8)):
            raise RuntimeError(f"zstd round trip changed the bytes of {name}")
        sizes["zstd19"] = len(packed)
    counts = row_counts(t.trits)
    n = rows * cols
    floors = {"order0_tensor": entropy_bits(counts.sum(axis=0)),
              "order0_row": row_entropy_bits(counts) / n}
    return TensorReport(name, [rows, cols], n, stored_bytes,
                        {c: sizes[c] for c in CONTAINERS}, counts.sum(axis=0).tolist(),
                        floors, int((counts[:, 1] == cols).sum()))


def _lm_head(model: Model) -> tuple[str, int, int]:
    """(description, bytes the LM head reads per token, bytes of one embedding row)."""
    names = {e.name: e for e in model.entries}
    emb = names.get("token_embd.weight")
    row = emb.plain_nbytes // max(emb.shape[0], 1) if emb is not None else 0
    if "output.weight" in names:
        return "output.weight", names["output.weight"].plain_nbytes, row
    if emb is not None:
        return "token_embd.weight (tied)", emb.plain_nbytes, row
    return "none", 0, 0


def measure_head(model: Model, name: str) -> dict:
    """The LM head in every container: stored as it is, or (rans) coded with rans_float,
    encoded here and decoded again to check it; and the order-0 entropy of its values."""
    from .formats import rans_float as rf
    from .summary import order0_entropy

    e = model.entry(name)
    gtype, raw = model.plain(name)
    n = e.n_elements
    plain = int(raw.nbytes)
    sizes: dict[str, int | None] = {c: None for c in CONTAINERS}
    for fid in FORMAT_IDS:
        sizes[fid] = plain
    floor = None
    if gtype.name in ("F16", "BF16"):
        floor = order0_entropy(rf.RansFloat.histogram(raw))
    if rf.codable(gtype, e.shape):
        coded = rf.RansFloat().encode(raw, gtype, e.shape, name)
        back = rf.RansFloat().decode(coded, gtype, e.shape, name=name)
        if not np.array_equal(back, raw.reshape(-1).view(np.uint8)):
            raise RuntimeError(f"rans_float: decoding the bytes just encoded changed {name} "
                               "(a bug in bitformat)")
        sizes["rans"] = int(coded.nbytes)
    return {"name": name, "type": gtype.name, "shape": list(e.shape), "values": n,
            "bytes": sizes,
            "bits_per_value": {c: None if b is None else b * 8 / n for c, b in sizes.items()},
            "floors": {"order0_value": floor}}


def build_report(path, *, zstd_level: int = ZSTD_LEVEL, i2s_variant: str = "x86",
                 progress: Callable[[TensorEntry], None] | None = None) -> Report:
    """Measure the model at ``path`` (any container bitformat reads).

    >>> r = build_report("model.gguf")                           # doctest: +SKIP
    >>> r.model["bits_per_weight"]["rans"]                       # doctest: +SKIP
    >>> r.per_token["rans"]["share"]["lm_head"]                  # doctest: +SKIP
    """
    with open_model(path, i2s_variant=i2s_variant) as model:
        require_ternary(model)
        report = Report(model.path, model.container, list(CONTAINERS))
        head, head_bytes, row_bytes = _lm_head(model)
        report.lm_head = head
        norms = 0
        other_values = 0
        for e in model.entries:
            if e.ternary:
                t = model.ternary(e.name)
                report.tensors.append(measure_tensor(t, e.name, e.nbytes, zstd_level))
            elif e.name == head.split()[0]:
                report.head = measure_head(model, e.name)
            elif e.name == "token_embd.weight":  # untied: the embedding is "other" too
                norms += e.plain_nbytes
                other_values += e.n_elements
            else:
                norms += e.plain_nbytes
                other_values += e.n_elements
            if progress is not None:
                progress(e)
    _totals(report, head_bytes, row_bytes, norms)
    _whole(report, norms, other_values)
    return report


def _whole(report: Report, other: int, other_values: int) -> None:
    """``model["whole"]``: every tensor of the file in each container, in bits per parameter
    (ternary weights, the LM head, the rest); the metadata (tokenizer) is not counted."""
    hd = report.head
    head_values = hd.get("values", 0)
    params = report.model["weights"] + head_values + other_values
    whole = {}
    for c in report.containers:
        tern = report.model["bytes"][c]
        head = hd["bytes"][c] if hd else 0
        if tern is None or head is None:
            whole[c] = None
            continue
        total = tern + head + other
        whole[c] = {"bytes": total, "ternary": tern, "lm_head": head, "other": other,
                    "bits_per_parameter": total * 8 / params if params else None}
    fl = report.model["floors"]
    floor = None
    if hd and hd["floors"]["order0_value"] is not None:
        floor = (fl["order0_tensor"] * report.model["weights"]
                 + hd["floors"]["order0_value"] * head_values + other * 8) / params
    report.model["parameters"] = params
    report.model["whole"] = whole
    report.model["whole_order0_bits_per_parameter"] = floor


def _totals(report: Report, head: int, row: int, norms: int) -> None:
    tensors = report.tensors
    n = sum(t.weights for t in tensors)
    counts = np.sum([t.counts for t in tensors], axis=0) if tensors else np.zeros(3)
    total: dict[str, int | None] = {}
    for c in report.containers:
        sizes = [t.bytes[c] for t in tensors]
        total[c] = None if any(s is None for s in sizes) else int(sum(sizes))
    report.model = {
        "tensors": len(tensors),
        "weights": n,
        "stored_bytes": sum(t.stored_bytes for t in tensors),
        "bytes": total,
        "bits_per_weight": {c: None if b is None or not n else b * 8 / n
                            for c, b in total.items()},
        "floors": {
            "order0_global": entropy_bits(counts),
            "order0_tensor": sum(t.floors["order0_tensor"] * t.weights for t in tensors) / n
            if n else 0.0,
            "order0_row": sum(t.floors["order0_row"] * t.weights for t in tensors) / n
            if n else 0.0,
        },
        "share_zero": float(counts[1] / n) if n else None,
    }
    for c in report.containers:
        if c == "zstd19" or total[c] is None:  # zstd output is not something a token reads
            continue
        parts = {"ternary": total[c], "lm_head": head, "embedding_row": row, "norms": norms}
        whole = sum(parts.values())
        report.per_token[c] = {**parts, "total": whole,
                               "share": {k: v / whole if whole else 0.0
                                         for k, v in parts.items()}}


# -- text --------------------------------------------------------------------------------------
def _fmt(v: float | None, width: int = 7, digits: int = 4) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:{width}.{digits}f}"


def render(report: Report) -> str:
    """A plain-text report: bits per weight per tensor and model-wide, then bytes per token."""
    from .summary import human_bytes

    cols = report.containers
    m = report.model
    lines = [f"{report.path}  (container {report.container}, {m['weights']:,} ternary weights "
             f"in {m['tensors']} tensors)", "", "bits per weight (encoded, measured, "
             "decode-verified) and order-0 entropy floors"]
    head = f"{'tensor':<26}" + "".join(f"{LABELS.get(c, c)[:8]:>9}" for c in cols)
    head += f"{'H0 tens':>9}{'H0 rows':>9}"
    lines += [head, "-" * len(head)]
    for t in report.tensors:
        bpw = t.bpw
        lines.append(f"{t.name[:26]:<26}" + "".join(_fmt(bpw[c], 9) for c in cols)
                     + _fmt(t.floors["order0_tensor"], 9) + _fmt(t.floors["order0_row"], 9))
    fl = m["floors"]
    lines.append("-" * len(head))
    lines.append(f"{'model':<26}" + "".join(_fmt(m["bits_per_weight"][c], 9) for c in cols)
                 + _fmt(fl["order0_tensor"], 9) + _fmt(fl["order0_row"], 9))
    lines.append(f"  floors: order-0 global {fl['order0_global']:.4f}, per tensor "
                 f"{fl['order0_tensor']:.4f}, per row {fl['order0_row']:.4f} bits per weight; "
                 f"zstd-19 column: Zstandard level 19 over the i2_s bytes")
    lines.append(f"  {FLOOR_NOTE}")
    hd = report.head
    if hd:
        fl0 = hd["floors"]["order0_value"]
        lines += ["", f"LM head {hd['name']} ({hd['type']}, {hd['values']:,} values): bits per "
                  "value" + (f"; order-0 entropy of its values {fl0:.4f}" if fl0 else ""),
                  "  " + ", ".join(f"{LABELS.get(c, c)} {v:.4f}"
                                   for c, v in hd["bits_per_value"].items() if v is not None)]
    lines += ["", "the whole file (tensors; metadata not counted): bits per parameter"]
    for c, d in m.get("whole", {}).items():
        if d is not None:
            lines.append(f"  {LABELS.get(c, c):<12}{human_bytes(d['bytes']):>12}"
                         f"{d['bits_per_parameter']:>9.4f}")
    if m.get("whole_order0_bits_per_parameter") is not None:
        lines.append(f"  {'order-0':<12}{'':>12}{m['whole_order0_bits_per_parameter']:>9.4f}  "
                     "(ternary at its per-tensor order-0 entropy, the head at its values', the "
                     "rest as stored)")
    lines += ["", f"bytes one generated token reads (LM head: {report.lm_head}, decoded)",
              f"{'container':<12}{'ternary':>12}{'LM head':>12}{'norms+row':>12}{'total':>12}"
              f"{'ternary %':>11}{'LM head %':>11}"]
    for c, d in report.per_token.items():
        s = d["share"]
        lines.append(f"{LABELS.get(c, c):<12}{human_bytes(d['ternary']):>12}"
                     f"{human_bytes(d['lm_head']):>12}"
                     f"{human_bytes(d['norms'] + d['embedding_row']):>12}"
                     f"{human_bytes(d['total']):>12}{s['ternary']:>10.1%} {s['lm_head']:>10.1%}")
    return "\n".join(lines)


__all__ = ["CONTAINERS", "Report", "TensorReport", "build_report", "entropy_bits",
           "measure_head", "measure_tensor", "render", "row_entropy_bits"]
