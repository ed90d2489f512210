"""What ``bitformat inspect`` reports: config, tokenizer, per-tensor statistics, totals."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from .errors import BitformatError
from .families import family_of
from .io.model import Model, TensorEntry


@dataclass
class TensorStats:
    name: str
    shape: list[int]
    encoding: str  # ternary: the format id; plain: the GGML type (F16, F32, ...)
    bytes: int  # as stored in this container
    bits_per_weight: float | None = None  # bytes * 8 per value, every tensor
    share_minus: float | None = None  # ternary tensors only, down to dead_rows
    share_zero: float | None = None
    share_plus: float | None = None
    entropy_bits: float | None = None  # order-0 entropy of the trits, or of 16-bit values
    dead_rows: int | None = None
    scale: float | None = None  # None when per-block scales differ
    coding: str = ""  # a plain tensor stored coded: "rans_float"


@dataclass
class ModelSummary:
    path: str
    container: str
    architecture: str
    config: dict
    tokenizer: dict
    tensors: list[TensorStats] = field(default_factory=list)
    totals: dict = field(default_factory=dict)
    #: what validation found (:mod:`bitformat.validate`): {"level", "tensor", "message"};
    #: level "error" means ``run`` and ``convert`` refuse the file
    problems: list = field(default_factory=list)
    family: dict = field(default_factory=dict)  # id, title, activation, sub_norms, ...
    #: this container's measured cpu speed against i2_s (:mod:`.runtime.costs`), as lines
    run_costs: list = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def order0_entropy(counts: np.ndarray) -> float:
    """Shannon entropy in bits per symbol of a histogram."""
    total = counts.sum()
    if total == 0:
        return 0.0
    p = counts[counts > 0] / total
    return float(-(p * np.log2(p)).sum())


def ternary_stats(e: TensorEntry, trits: np.ndarray) -> dict:
    counts = np.bincount((trits.reshape(-1) + 1).astype(np.intp), minlength=3)[:3]
    n = int(counts.sum())
    return {
        "bits_per_weight": e.nbytes * 8 / n,
        "share_minus": float(counts[0] / n),
        "share_zero": float(counts[1] / n),
        "share_plus": float(counts[2] / n),
        "entropy_bits": order0_entropy(counts),
        "dead_rows": int((~trits.any(axis=1)).sum()),
    }


def value_entropy(raw: np.ndarray) -> float:
    """Order-0 entropy (bits per value) of a 16-bit tensor's values: the floor of any coder
    that codes each value alone with one distribution."""
    from .formats.rans_float import RansFloat

    return order0_entropy(RansFloat.histogram(raw))


def _head_name(model: Model) -> str:
    """The LM head: ``output.weight`` if the model has one, else the tied embedding."""
    names = {e.name for e in model.entries}
    return "output.weight" if "output.weight" in names else "token_embd.weight"


CONFIG_KEYS = ("vocab_size", "context_length", "embedding_length", "block_count",
               "feed_forward_length", "attention.head_count", "attention.head_count_kv",
               "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.dimension_count")


def _as_list(v) -> list:
    """A metadata array as a list (anything else, e.g. a scalar where an array belongs, as [])."""
    return list(v) if isinstance(v, (list, tuple, np.ndarray)) else []


def validation_problems(model: Model) -> list[dict]:
    """The validator's findings for ``inspect``: it shows a broken file rather than refuse it."""
    from .container import require_ternary
    from .errors import BitformatError
    from .validate import check_model, known_architecture, model_args

    try:  # a file with nothing ternary (llama.cpp's Q4_K, ...): one line, not one per tensor
        require_ternary(model)
    except BitformatError as exc:
        return [{"level": "error", "tensor": None, "message": exc.problem}]
    if not known_architecture(model.architecture):
        return []
    try:
        args = model_args(model)
    except BitformatError as exc:
        return [{"level": "error", "tensor": exc.tensor, "message": exc.problem}]
    return [{"level": p.level, "tensor": p.tensor, "message": p.message}
            for p in check_model(model, args, values="warning")]


def _family(model: Model) -> dict:
    """The model family (:mod:`bitformat.families`) and its switches, or why none fits."""
    if not any(e.ternary for e in model.entries):
        return {"id": None, "title": "none: the file holds no ternary weights"}
    try:
        f = family_of({k: v.plain() for k, v in model.metadata.items()
                       if not k.startswith("tokenizer.")})
    except BitformatError as e:
        return {"id": None, "title": str(e)}
    return {"id": f.id, "title": f.title, "activation": f.activation,
            "sub_norms": f.sub_norms, "qk_norm": f.qk_norm, "permuted_qk": f.permuted_qk,
            "head": _head_words(model)}


def _head_words(model: Model) -> str:
    """"tied" or "untied", with "ternary q2_0" where the head is q2_0 blocks (Ternary Bonsai)."""
    name = _head_name(model)
    words = "untied" if name == "output.weight" else "tied"
    enc = next((e.encoding for e in model.entries if e.name == name), None)
    return f"{words} ternary q2_0" if enc == "q2_0" else words


def summarize(model: Model, *, progress: Callable[[TensorEntry], None] | None = None
              ) -> ModelSummary:
    """Decode every tensor once and gather what ``inspect`` prints."""
    arch = model.architecture
    config = {k: model.get(f"{arch}.{k}") for k in CONFIG_KEYS
              if model.get(f"{arch}.{k}") is not None}
    for key in ("general.name", "general.file_type", "bitformat.format"):
        if model.get(key) is not None:
            config[key] = model.get(key)
    tokens = _as_list(model.get("tokenizer.ggml.tokens"))
    token_types = _as_list(model.get("tokenizer.ggml.token_type"))
    tokenizer = {
        "model": model.get("tokenizer.ggml.model"),
        "pre": model.get("tokenizer.ggml.pre"),
        "tokens": len(tokens),
        "merges": len(_as_list(model.get("tokenizer.ggml.merges"))),
        "special_tokens": int(sum(1 for t in token_types if t in (3, 4))),
        "bos_token_id": model.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": model.get("tokenizer.ggml.eos_token_id"),
        "add_bos_token": model.get("tokenizer.ggml.add_bos_token"),
        "chat_template": model.get("tokenizer.chat_template") is not None,
    }
    if tokenizer["model"] == "gpt2" and tokenizer["pre"] is None:
        from .tokenizers.pretokenize import resolve

        tokenizer["pre"], tokenizer["pre_note"] = resolve(None, arch)
    summary = ModelSummary(model.path, model.container, arch, config, tokenizer)
    summary.problems = validation_problems(model)
    summary.family = _family(model)
    if model.container is not None:
        from .runtime.costs import describe

        summary.run_costs = describe(model.container)
    ternary_bytes = ternary_weights = embed_bytes = embed_row = other_bytes = 0
    total_bytes = 0
    counts = np.zeros(3, dtype=np.int64)
    head = None
    for e in model.entries:
        stats = TensorStats(e.name, list(e.shape), e.encoding, e.nbytes,
                            e.nbytes * 8 / max(e.n_elements, 1), coding=e.coding)
        total_bytes += e.nbytes
        if not e.ternary and e.encoding in ("F16", "BF16"):
            stats.entropy_bits = value_entropy(model.plain(e.name)[1])
        if e.name == _head_name(model):
            head = {"name": e.name, "shape": list(e.shape), "type": e.encoding,
                    "coding": e.coding, "values": e.n_elements, "bytes": e.nbytes,
                    "bits_per_value": stats.bits_per_weight,
                    "entropy_bits": stats.entropy_bits}
        if e.ternary:
            t = model.ternary(e.name)
            for k, v in ternary_stats(e, t.trits).items():
                setattr(stats, k, v)
            stats.scale = t.tensor_scale()
            counts += np.bincount((t.trits.reshape(-1) + 1).astype(np.intp), minlength=3)[:3]
        if e.ternary and e.name not in ("token_embd.weight", "output.weight"):
            ternary_bytes += e.nbytes
            ternary_weights += e.n_elements
        elif e.name == "token_embd.weight":  # a coded one is read decoded, at its type's size
            embed_bytes += e.plain_nbytes
            embed_row = e.plain_nbytes // max(e.shape[0], 1)
        elif e.name == "output.weight":
            embed_bytes += e.plain_nbytes  # an untied head is read instead of the embedding
        else:
            other_bytes += e.nbytes
        summary.tensors.append(stats)
        if progress is not None:
            progress(e)
    # One generated token reads every ternary matrix, the LM head (the embedding when tied),
    # one embedding row, and every norm.
    per_token = ternary_bytes + embed_bytes + embed_row + other_bytes
    parameters = sum(e.n_elements for e in model.entries)
    summary.totals = {
        "tensors": len(model.entries),
        "ternary_tensors": sum(1 for e in model.entries if e.ternary and e.name not in (
            "token_embd.weight", "output.weight")),  # a q2_0 embedding/head counts as such
        "ternary_weights": ternary_weights,
        "ternary_bytes": ternary_bytes,
        "ternary_bits_per_weight": ternary_bytes * 8 / ternary_weights if ternary_weights
        else None,
        "entropy_bits": order0_entropy(counts),
        "share_zero": float(counts[1] / counts.sum()) if counts.sum() else None,
        "tensor_bytes": total_bytes,
        "parameters": parameters,
        "bits_per_parameter": total_bytes * 8 / parameters if parameters else None,
        "lm_head": head,
        "bytes_per_token": per_token,
        "lm_head_share_of_token": embed_bytes / per_token if per_token else None,
    }
    return summary


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"


def render(summary: ModelSummary) -> str:
    """A plain-text report for a terminal."""
    lines = [f"{summary.path}", f"  container     {summary.container}",
             f"  architecture  {summary.architecture}"]
    fam = summary.family
    if fam.get("id"):
        parts = [f"{fam['activation']} FFN", "sub-norms" if fam["sub_norms"] else
                 "no sub-norms"] + (["q/k norms"] if fam["qk_norm"] else []) + (
            ["q/k rows permuted (llama.cpp)"] if fam["permuted_qk"] else []) + [
            f"{fam['head']} LM head"]
        lines.append(f"  family        {fam['title']} [{fam['id']}]: {', '.join(parts)}")
    elif fam:
        lines.append(f"  family        none: {fam['title']}")
    for k, v in summary.config.items():
        lines.append(f"  {k:<34} {v:.7g}" if isinstance(v, float) else f"  {k:<34} {v}")
    tok = summary.tokenizer
    lines.append(f"  tokenizer     {tok['model']} ({tok['pre']}), {tok['tokens']} tokens, "
                 f"{tok['merges']} merges, {tok['special_tokens']} special, bos "
                 f"{tok['bos_token_id']}, eos {tok['eos_token_id']}, chat template "
                 f"{'yes' if tok['chat_template'] else 'no'}")
    if tok.get("pre_note"):
        lines.append(f"                {tok['pre_note']}")
    lines.append("")
    head = (f"{'tensor':<28} {'shape':>13} {'encoding':>16} {'bytes':>11} {'bpw':>7} "
            f"{'-1':>6} {'0':>6} {'+1':>6} {'H0':>7} {'dead':>5}")
    lines.append(head)
    lines.append("-" * len(head))
    for t in summary.tensors:
        shape = "x".join(str(d) for d in t.shape)
        enc = f"{t.encoding} {t.coding}" if t.coding else t.encoding
        row = f"{t.name:<28} {shape:>13} {enc:>16} {t.bytes:>11} {t.bits_per_weight:7.3f}"
        if t.share_zero is not None:
            row += (f" {t.share_minus:6.3f} {t.share_zero:6.3f} {t.share_plus:6.3f} "
                    f"{t.entropy_bits:7.4f} {t.dead_rows:>5}")
        elif t.entropy_bits is not None:
            row += f" {'':>6} {'':>6} {'':>6} {t.entropy_bits:7.4f}"
        lines.append(row)
    tot = summary.totals
    lines.append("")
    lines.append(f"  ternary weights    {tot['ternary_weights']:,} in "
                 f"{tot['ternary_tensors']} tensors, {human_bytes(tot['ternary_bytes'])}")
    if tot["ternary_bits_per_weight"] is not None:
        lines.append(f"  bits per weight    {tot['ternary_bits_per_weight']:.4f} stored, "
                     f"{tot['entropy_bits']:.4f} order-0 entropy, zero share "
                     f"{tot['share_zero']:.3f}")
    hd = tot["lm_head"]
    if hd is not None:
        how = f"coded {hd['coding']}" if hd["coding"] else "stored as it is"
        floor = (f", order-0 entropy of its values {hd['entropy_bits']:.4f}"
                 if hd["entropy_bits"] is not None else "")
        lines.append(f"  LM head            {hd['name']} {hd['type']}, {how}: "
                     f"{hd['bits_per_value']:.4f} bits per value{floor}")
    lines.append(f"  tensor data        {human_bytes(tot['tensor_bytes'])}: "
                 f"{tot['parameters']:,} parameters at "
                 f"{tot['bits_per_parameter']:.4f} bits per parameter")
    share = tot["lm_head_share_of_token"]
    lines.append(f"  bytes per token    {human_bytes(tot['bytes_per_token'])}"
                 + (f" (LM head {share:.0%})" if share is not None else ""))
    if summary.run_costs:
        lines.append("  cpu speed          measured on the full-size 2B-4T "
                     "(tools/bench_containers.py):")
        lines += [f"    {c}" for c in summary.run_costs]
    if summary.problems:
        lines.append("")
    for p in summary.problems[:20]:
        what = "error (run and convert refuse)" if p["level"] == "error" else "warning"
        where = f"tensor {p['tensor']!r}: " if p["tensor"] else ""
        lines.append(f"  {what}: {where}{p['message']}")
    if len(summary.problems) > 20:
        lines.append(f"  ... and {len(summary.problems) - 20} more problems (--json lists all)")
    return "\n".join(lines)
