"""One validation pass over an opened model, before it is run or converted.

:func:`check_model` compares the model's tensors with what its architecture needs (every
tensor present, with the shape, element type and encoding its config implies), checks the
config values (sizes positive, bounded and consistent; eps and RoPE theta finite, positive and
representable in float32) and the per-tensor scales (finite and positive), and, when asked,
the values of the norms and the embedding (no NaN or infinity). It returns a list of
:class:`Problem`; :func:`validate_model` raises the first error as a :class:`~.errors.
BitformatError` that names the file and the tensor, and returns the warnings.

A model family declares its tensors: either its args object has a ``tensor_specs()`` method,
or its architecture is one of a family of :mod:`bitformat.families` (registered families
included), whose layer graph names the block tensors (:func:`family_tensors`). The runtime's
kernels then only ever see shapes that agree with the config they are run with.

What is an error and what a warning (docs/reliability.md, "Validation"):

- errors everywhere (``run``, ``convert``, ``serve``, ``bench``): a missing tensor, a shape,
  type or encoding other than the config implies, a config value out of range, a per-tensor
  scale that is NaN, infinite, zero or negative;
- NaN or infinity in a norm gain or the embedding: an error for ``run`` (every logit or
  every step would be NaN), a warning for ``convert`` (a lossless copy keeps the values as
  they are) and ``inspect`` (which shows the file as it is).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .constants import I2_S_TAIL_BYTES, GGMLType
from .errors import BitformatError, FormatError, InvalidScaleError, MetadataError, ShapeError
from .io.model import Model, TensorEntry

#: Upper bounds on config values (far above any released model, far below what would make
#: the runtime allocate more than a machine holds from a few header bytes).
MAX_DIM = 1 << 17  # hidden size, FFN width (2B-4T: 2560, 6912)
MAX_LAYERS = 1 << 12
MAX_HEADS = 1 << 12
MAX_VOCAB = 1 << 22  # 2B-4T: 128256
MAX_CONTEXT = 1 << 22  # the KV cache is sized from the context a request asks for, not this
FLOAT32_MAX = float(np.finfo(np.float32).max)

PLAIN_FLOATS = ("F32", "F16", "BF16", "F64")  # what the backends read as float vectors
EMBED_FLOATS = ("F32", "F16", "BF16")  # what the LM-head kernels read (and q2_0 blocks)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor a family needs: GGUF name, numpy shape and kind ("ternary": a projection;
    "norm": a float gain vector; "embedding": the float token embedding, also the tied LM
    head; "head": an untied LM head, shape checked only; "scale": a one-value float tensor),
    and whether the model must have it."""

    name: str
    shape: tuple[int, ...]
    kind: str
    required: bool = True


@dataclass(frozen=True)
class Problem:
    """One finding: ``level`` "error" or "warning", the tensor it is about (or None for the
    config), and what is wrong."""

    level: str
    tensor: str | None
    message: str

    def __str__(self) -> str:
        return f"tensor {self.tensor!r}: {self.message}" if self.tensor else self.message


def family_tensors(args: Any) -> list[TensorSpec]:
    """The tensors of a model of ``args.family`` (:mod:`bitformat.families`; BitNet 2B-4T
    when the args carry none): every name of its blocks with the shape the config implies,
    the embedding, the final norm, an optional untied ``output.weight`` and the optional
    per-projection ``.scale`` tensors of upstream llama.cpp's "bitnet" files."""
    from .families import BITNET_2B4T
    from .graph import block_shapes

    family = getattr(args, "family", None) or BITNET_2B4T
    h = args.dim
    shapes = {n: (s, "ternary" if len(s) == 2 else "norm") for n, s in block_shapes(
        h, args.hidden_dim, args.n_heads, args.n_kv_heads, args.head_dim).items()}
    block = [n for n in family.block_tensors() if n in shapes]
    out = [TensorSpec("token_embd.weight", (args.vocab_size, h), "embedding"),
           TensorSpec("output_norm.weight", (h,), "norm"),
           TensorSpec("output.weight", (args.vocab_size, h), "head", required=False)]
    for i in range(args.n_layers):
        p = f"blk.{i}."
        out += [TensorSpec(f"{p}{n}.weight", *shapes[n]) for n in block]
        out += [TensorSpec(f"{p}{n}.scale", (1,), "scale", required=False)
                for n in block if shapes[n][1] == "ternary"]
    return out


def bitnet_tensors(args: Any) -> list[TensorSpec]:
    """BitNet b1.58 2B-4T's tensors (tied LM head)."""
    return family_tensors(args)


def known_architecture(arch: Any) -> bool:
    """Whether a family bitformat runs has the GGUF architecture ``arch``."""
    from .families import ARCHITECTURES

    return arch in ARCHITECTURES


def tensor_specs(args: Any) -> list[TensorSpec] | None:
    """The tensors ``args``' family needs, or None if no family declared them."""
    own = getattr(args, "tensor_specs", None)
    if callable(own):
        return list(own())
    return family_tensors(args) if known_architecture(getattr(args, "arch", None)) else None


def check_args(args: Any) -> list[Problem]:
    """Config values in range: sizes positive, bounded and consistent, eps and theta usable."""
    bad: list[Problem] = []

    def err(msg: str) -> None:
        bad.append(Problem("error", None, msg))

    limits = {"dim": MAX_DIM, "hidden_dim": MAX_DIM, "n_layers": MAX_LAYERS,
              "n_heads": MAX_HEADS, "n_kv_heads": MAX_HEADS, "vocab_size": MAX_VOCAB,
              "context_length": MAX_CONTEXT}
    for key, cap in limits.items():
        v = getattr(args, key, None)
        if v is None:
            continue
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or not 0 < v <= cap:
            err(f"config {key} is {v!r}: must be an integer from 1 to {cap}")
    if bad:
        return bad
    if args.dim % args.n_heads and not getattr(args, "key_length", 0):
        err(f"hidden size {args.dim} is not a multiple of {args.n_heads} heads")
    elif args.n_heads % args.n_kv_heads:
        err(f"{args.n_heads} attention heads do not group into {args.n_kv_heads} kv heads")
    elif args.head_dim % 2:
        err(f"head size {args.head_dim} is odd (RoPE rotates pairs)")
    for key, what, upper in (("norm_eps", "RMSNorm eps", 1.0),
                             ("rope_theta", "RoPE theta", FLOAT32_MAX)):
        v = getattr(args, key, None)
        if v is None:
            continue
        try:
            x = float(v)
        except (TypeError, ValueError):
            err(f"{what} is {v!r}: not a number")
            continue
        if not math.isfinite(x) or not 0 < x <= upper or np.float32(x) == 0:
            err(f"{what} is {x!r}: must be finite, positive, at most {upper:.4g} and "
                "representable in float32")
    return bad


def _is_scale_ok(s: Any) -> bool:
    return isinstance(s, (float, int, np.floating)) and math.isfinite(float(s)) and float(s) > 0


def _check_entry(model: Model, spec: TensorSpec, e: TensorEntry) -> list[Problem]:
    bad: list[Problem] = []

    def err(msg: str) -> None:
        bad.append(Problem("error", spec.name, msg))

    if spec.kind == "head" or (spec.kind == "embedding" and e.encoding == "q2_0"):
        # an untied LM head: its shape (types vary by family); a q2_0 embedding or head
        # (Ternary Bonsai) also its blocks
        if tuple(e.shape) != spec.shape:
            err(f"shape {_dims(e.shape)} but the config implies {_dims(spec.shape)}")
        elif e.encoding == "q2_0":
            problem = _q2_0_problem(model, e.name)
            if problem:
                err(problem)
        return bad
    if spec.kind == "ternary":
        if not e.ternary:
            err(f"must be a ternary matrix, found {e.encoding}")
            return bad
        if tuple(e.shape) != spec.shape:
            err(f"shape {_dims(e.shape)} but the config implies {_dims(spec.shape)}")
            return bad
        scale = _stored_scale(model, e)
        if scale is not None and not _is_scale_ok(scale):
            bad.append(Problem("error", spec.name, f"per-tensor scale is {scale!r}: must be "
                               "finite and positive"))
        return bad
    if e.ternary:
        err(f"must be a float tensor, found the ternary encoding {e.encoding}")
        return bad
    allowed = EMBED_FLOATS if spec.kind == "embedding" else PLAIN_FLOATS
    if e.encoding not in allowed:
        err(f"element type {e.encoding}, expected one of {', '.join(allowed)}")
    shape = tuple(e.shape)
    if spec.kind == "norm" and shape != spec.shape and (len(shape) != 2 or shape[0] != 1
                                                        or shape[1:] != spec.shape):
        err(f"shape {_dims(shape)} but the config implies {_dims(spec.shape)}")
    elif spec.kind == "scale" and math.prod(shape) != 1:
        err(f"shape {_dims(shape)}, expected one value")
    elif spec.kind == "embedding" and shape != spec.shape:
        err(f"shape {_dims(shape)} but the config implies {_dims(spec.shape)}")
    return bad


def _stored_scale(model: Model, e: TensorEntry) -> float | None:
    """A ternary tensor's per-tensor scale where the file holds one outside blocks (bitformat
    metadata, or the i2_s tail), else None (per-block scales are checked as blocks decode)."""
    s = model.get(f"bitformat.tensor.{e.name}.scale")
    if s is not None:
        return s
    if e.encoding == "i2_s":
        try:
            _, raw = model.plain(e.name)
        except (BitformatError, KeyError):
            return None
        n = e.shape[0] * e.shape[1] // 4
        if raw.size >= n + I2_S_TAIL_BYTES:
            return float(raw[n: n + 4].view("<f4")[0])
    return None


def _dims(shape: tuple[int, ...]) -> str:
    return "x".join(str(d) for d in shape) or "scalar"


def _q2_0_problem(model: Model, name: str) -> str | None:
    """What makes a q2_0 embedding or head unusable (a NaN or infinite block d, a code 3,
    which is 2d and not a trit), or None; read block row by block row."""
    from .formats.q2_0 import BLOCK_BYTES
    from .formats.tq2_0 import first_code3

    try:
        _, raw = model.plain(name)
    except (BitformatError, KeyError):
        return None
    blocks = raw.reshape(-1, BLOCK_BYTES)
    step = 1 << 18
    for at in range(0, blocks.shape[0], step):
        b = blocks[at: at + step]
        d = np.ascontiguousarray(b[:, :2]).view("<f2")
        bad = np.flatnonzero(~np.isfinite(d))
        if bad.size:
            return f"a q2_0 block scale is NaN or infinite (block {at + int(bad[0])})"
        k = first_code3(b[:, 2:])
        if k is not None:
            return f"q2_0 code 3 (the value 2d, not a trit) in block {at + k // 16}"
    return None


def _nonfinite(model: Model, name: str, coded: bool) -> int | None:
    """How many values of float tensor ``name`` are NaN or infinite (None: not checked)."""
    if coded:
        return None  # decoded (and its CRC checked) by the backend that loads it
    try:
        gtype, raw = model.plain(name)
    except (BitformatError, KeyError):
        return None
    exp = {GGMLType.F16: ("<u2", 0x7C00), GGMLType.BF16: ("<u2", 0x7F80),
           GGMLType.F32: ("<u4", 0x7F800000), GGMLType.F64: ("<u8", 0x7FF0000000000000)}
    if gtype not in exp:
        return None
    dt, mask = exp[gtype]
    words = raw.view(dt)
    count, step = 0, 1 << 22
    for at in range(0, words.size, step):  # all-ones exponent: inf or NaN
        count += int(np.count_nonzero((words[at: at + step] & mask) == mask))
    return count


def check_model(model: Model, args: Any, *, values: str = "error") -> list[Problem]:
    """Every problem of ``model`` run with ``args`` (its family's sizes), errors first.

    ``values``: what NaN or infinity in a norm or the embedding is, "error", "warning" or
    "skip" (not read)."""
    bad = check_args(args)
    if any(p.level == "error" for p in bad):
        return bad
    specs = tensor_specs(args)
    if specs is None:
        return bad
    by_name = {e.name: e for e in model.entries}
    for spec in specs:
        e = by_name.get(spec.name)
        if e is None:
            if spec.required:
                bad.append(Problem("error", spec.name, "missing (the architecture needs it)"))
            continue
        found = _check_entry(model, spec, e)
        bad += found
        if found or values == "skip" or spec.kind in ("ternary", "head"):
            continue
        n = _nonfinite(model, spec.name, bool(e.coding))
        if n:
            bad.append(Problem(values, spec.name, f"{n} of {e.n_elements} values are NaN or "
                               "infinite"))
    bad.sort(key=lambda p: p.level != "error")
    return bad


def validate_model(model: Model, args: Any, *, values: str = "error") -> list[Problem]:
    """Raise the first error of :func:`check_model` (naming the file and tensor); return the
    warnings."""
    found = check_model(model, args, values=values)
    errors = [p for p in found if p.level == "error"]
    if errors:
        p = errors[0]
        more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
        cls = (InvalidScaleError if "scale" in p.message else ShapeError
               if "shape" in p.message else FormatError if "NaN" in p.message
               else MetadataError)
        raise cls(p.message + more, path=model.path, tensor=p.tensor)
    return found


def model_args(model: Model) -> Any:
    """The runtime's args of ``model`` (raises a clear error when its metadata is not one of a
    known family's)."""
    from .runtime.models import ModelArgs

    meta = {k: v.plain() for k, v in model.metadata.items()}
    embd = next((e for e in model.entries if e.name == "token_embd.weight"), None)
    if embd is None:
        raise MetadataError("missing (the architecture needs it)", path=model.path,
                            tensor="token_embd.weight")
    try:
        return ModelArgs.from_metadata(meta, vocab_size=embd.shape[0])
    except BitformatError as exc:
        if exc.path is None:
            raise type(exc)(exc.problem, path=model.path, tensor=exc.tensor) from None
        raise
