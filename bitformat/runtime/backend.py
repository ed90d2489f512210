"""What every runtime backend shares: activation quantization, weight sources, plain tensors.

A backend turns the tensors of an opened container into the three operations
:mod:`bitformat.runtime.models` need: ``embed`` (token rows), ``bitlinear`` (int8 activations
times a ternary matrix read from its container bytes) and ``lm_head`` (the tied embedding or
an untied ``output.weight`` as output projection). Everything else of the model is plain numpy
in ``dtype``.

The embedding and the head are float tensors, or ternary ``q2_0`` blocks (Ternary Bonsai).
A q2_0 embedding row is dequantized as ggml's ``dequantize_row_q2_0`` does (``d * (code - 1)``
per 64-value block); a q2_0 head multiplies as llama.cpp's CPU backend does: the hidden state
is made Q8_0 blocks (:func:`q8_0_activations`, ggml's ``vec_dot_type`` of Q2_0) and each logit
is ``sum_b d_b * (d8_2b * isum_2b + d8_2b+1 * isum_2b+1)`` in float32, block by block
(ggml-cpu ``ggml_vec_dot_q2_0_q8_0``; :func:`q2_0_logits`).

One arithmetic for every container
----------------------------------
Every ternary mat-vec of every backend and container computes, for int8 activations ``q``
with scale ``s`` (``x ~ q / s``) and a row of trits ``t`` with scales ``d_b`` over blocks
``b`` (one block per row where the container has one scale per tensor or row)::

    y = float32( float32( sum_b d_b * sum_{k in b} t_k q_k ) / s )

The integer dot product of each block is exact; the sum of ``d_b`` times it is made exactly
(in float64: each product of an f16 or f32 scale and an integer below 2**16 is exact, and so
is their sum while a row's non-zero scales lie within a factor ``2**SCALE_SPAN_BITS`` of each
other, which every quantizer's output does by far), then rounded to float32 once; the
division by ``s`` is one float32 division. A row with one scale needs no float64:
``float32(dot) * d`` is already the correctly rounded product. So a model gives the same bits
from every container that holds its scales (i2_s's per-tensor f32, TQ2_0's per-256 f16 or
iq2_bn's per-row scale: a conversion keeps the same numbers), whatever order a kernel sums
its blocks in.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..constants import I2_S_TAIL_BYTES, GGMLType
from ..errors import InvalidScaleError, MetadataError, UnsupportedConversionError
from ..formats import ROW_FORMAT_IDS, get_format
from ..formats.base import TernaryFormat
from ..formats.q2_0 import BLOCK_BYTES as Q2_0_BLOCK_BYTES
from ..formats.q2_0 import QK as Q2_0_QK
from ..formats.q2_0 import unpack_codes
from ..io.model import Model
from ..ternary import TernaryTensor
from . import kvquant

#: GGML types of the embedding and the LM head that backends run.
HEAD_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.F64, GGMLType.Q2_0)

#: Block scales of one row within a factor 2**SCALE_SPAN_BITS of each other keep the float64
#: sum of "One arithmetic for every container" exact (2**16 * 2**11 per term, up to 2**7
#: blocks: 53 bits; rows longer than 32,768 values have a bit less room).
SCALE_SPAN_BITS = 19

#: Ternary encodings whose bytes a backend can read row by row.
ROW_FORMATS = ROW_FORMAT_IDS


@dataclass
class QuantizedActivations:
    """Per-token int8 activations: ``x ~ q / s`` (bitnet.cpp and HF BitLinear, docs/model.md §2).

    ``cache`` holds layouts a backend derives from ``q`` (rearranged copies, block sums), so
    the projections that share one input (q/k/v, gate/up) derive them once.
    """

    q: np.ndarray  # int8 [T, n]
    s: np.ndarray  # [T], 127 / max(max|x|, 1e-5), in the model dtype
    cache: dict[str, Any] = field(default_factory=dict)


def quantize_activations(x: np.ndarray) -> QuantizedActivations:
    """``s = 127 / max(max|x|, 1e-5)`` per row, ``q = clamp(round_half_even(x s), -128, 127)``.

    Computed in ``x``'s dtype (float32 like HF's float32 model, or float64).
    """
    dt = x.dtype.type
    s = dt(127.0) / np.maximum(np.max(np.abs(x), axis=-1), dt(1e-5))  # [T]
    q = np.clip(np.rint(x * s[:, None]), -128, 127).astype(np.int8)  # [T, n]
    return QuantizedActivations(q, s)


def rms_norm(x: np.ndarray, gain: np.ndarray, eps: float) -> np.ndarray:
    """``x / sqrt(mean(x^2) + eps) * gain`` over the last axis, in ``x``'s dtype.

    The squares are summed in float64 and the mean rounded back to ``x``'s dtype: the
    correctly rounded mean almost always, whatever the summation order, so the compiled
    version (:func:`.cpu.ops.norm_quant`) gives the same bits.
    """
    ms = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float64).astype(x.dtype)
    return x / np.sqrt(ms + x.dtype.type(eps)) * gain


def relu2_glu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """BitNet's FFN gating: ``relu(gate)^2 * up``."""
    g = np.maximum(gate, 0)
    return g * g * up


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE: x [T, heads, d], cos/sin [T, d/2]; element i pairs with i + d/2."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]  # [T, heads, d/2] each
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int) -> np.ndarray:
    """Causal GQA: q [T, H, d] at positions start.., k/v [S, KV, d] -> [T, H*d]."""
    T, H, d = q.shape
    S, KV, _ = k.shape
    qg = q.reshape(T, KV, H // KV, d).transpose(1, 2, 0, 3)  # [KV, G, T, d]
    scores = qg @ k.transpose(1, 2, 0)[:, None]  # [KV, G, T, S]
    scores *= scores.dtype.type(1.0 / np.sqrt(d))
    future = np.arange(S)[None, :] > (start + np.arange(T))[:, None]  # [T, S]
    scores[..., future] = -np.inf
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    out = p @ v.transpose(1, 0, 2)[:, None]  # [KV, G, T, d]
    return out.transpose(2, 0, 1, 3).reshape(T, H * d)


def head_tensor(model: Model) -> str:
    """The tensor the LM head reads: ``output.weight`` (untied) if present, else the embedding."""
    return "output.weight" if any(e.name == "output.weight" for e in model.entries) \
        else "token_embd.weight"


@dataclass
class TernarySource:
    """One ternary matrix as its container bytes, with what it takes to decode rows of it."""

    name: str
    encoding: str
    rows: int
    cols: int
    raw: np.ndarray  # uint8, the whole tensor's bytes (memory-mapped)
    fmt: TernaryFormat
    scale: float | None  # the per-tensor scale (i2_s: its tail, stfma/colpack: metadata)
    row_bytes: int | None  # bytes per row when rows are separable, else None

    def rows_view(self) -> np.ndarray:
        """uint8 ``[rows, row_bytes]``: each row's bytes (i2_s without its 32-byte tail)."""
        return self.raw[: self.rows * self.row_bytes].reshape(self.rows, self.row_bytes)

    def validate(self) -> None:
        """Every check the format's reader makes on the whole tensor (the trits unmade)."""
        self.fmt.validate(self.raw, self.rows, self.cols, scale=self.scale, name=self.name)

    def decode_rows(self, r0: int, r1: int) -> TernaryTensor:
        """Rows ``r0:r1`` decoded (and validated) by the format's own reader."""
        if self.row_bytes is None:
            if (r0, r1) != (0, self.rows):
                raise ValueError("rows of this tensor are not separable")
            sub = self.raw
        else:
            sub = self.raw[r0 * self.row_bytes: r1 * self.row_bytes]
            if self.encoding == "i2_s":
                n = self.rows * self.cols // 4
                sub = np.concatenate([sub, self.raw[n: n + I2_S_TAIL_BYTES]])
        return self.fmt.decode(sub, r1 - r0, self.cols, scale=self.scale, name=self.name)


def ternary_source(model: Model, name: str, i2s_variant: str = "x86") -> TernarySource | None:
    """The byte source of ternary tensor ``name``, or None if its encoding is not row-readable."""
    e = model.entry(name)
    if e.encoding not in ROW_FORMATS:
        return None
    rows, cols = e.shape
    _, raw = model.plain(name)
    if e.encoding == "i2_s":
        from ..formats.i2_s import I2S

        fmt: TernaryFormat = I2S(i2s_variant)
        row_bytes = cols // 4 if cols % fmt.block == 0 else None
        want = rows * cols // 4 + I2_S_TAIL_BYTES
    else:
        fmt = get_format(e.encoding)
        want = fmt.nbytes(rows, cols)
        row_bytes = want // rows
    if raw.size != want:
        raise MetadataError(f"{e.encoding} data of a {rows}x{cols} matrix must take {want} "
                            f"bytes, found {raw.size}", path=model.path, tensor=name)
    scale = None
    if e.encoding == "i2_s":
        n = rows * cols // 4
        scale = float(raw[n: n + 4].view("<f4")[0])
    elif not fmt.native:
        scale = model.get(f"bitformat.tensor.{name}.scale")
        if not isinstance(scale, float):
            raise MetadataError("missing its per-tensor scale", path=model.path, tensor=name)
    if scale is not None and not np.isfinite(scale):
        raise InvalidScaleError(f"scale is {scale}", path=model.path, tensor=name)
    return TernarySource(name, e.encoding, rows, cols, raw, fmt, scale, row_bytes)


def plain_array(model: Model, name: str, dtype: type = np.float32) -> np.ndarray:
    """A float tensor (F32, F16, BF16 or F64 in the file) as ``dtype``, in its logical shape."""
    gtype, raw = model.plain(name)
    shape = model.entry(name).shape
    return rows_as_float(gtype, raw, shape, dtype, model.path, name)


def rows_as_float(gtype: GGMLType, raw: np.ndarray, shape: tuple[int, ...], dtype: type,
                  path: str = "", name: str = "") -> np.ndarray:
    if gtype == GGMLType.F32:
        a = raw.view("<f4")
    elif gtype == GGMLType.F16:
        a = raw.view("<f2")
    elif gtype == GGMLType.F64:
        a = raw.view("<f8")
    elif gtype == GGMLType.BF16:
        a = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    elif gtype == GGMLType.Q2_0:
        return dequantize_q2_0(raw, math.prod(shape)).reshape(shape).astype(dtype)
    else:
        raise UnsupportedConversionError(f"cannot use a {gtype.name} tensor as floats",
                                         path=path, tensor=name)
    return a.reshape(shape).astype(dtype)


def dequantize_q2_0(raw: np.ndarray, n: int) -> np.ndarray:
    """float32 values of ``n // 64`` q2_0 blocks: ``d * (code - 1)``, as ggml's
    ``dequantize_row_q2_0`` (code 3 gives 2d there too; ``validate`` rejects such a file)."""
    blocks = raw.reshape(n // Q2_0_QK, Q2_0_BLOCK_BYTES)
    d = np.ascontiguousarray(blocks[:, :2]).view("<f2").astype(np.float32)  # [nb, 1]
    codes = unpack_codes(blocks[:, 2:]).astype(np.float32) - np.float32(1)
    return (codes * d).reshape(-1)


def q8_0_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's Q8_0 blocks of float32 activations ``[T, dim]`` as its x86 build makes them
    (ggml-cpu/arch/x86/quants.c ``quantize_row_q8_0``): per 32 values d = max|x| / 127 stored
    as f16, q = round-half-even(x * (127 / max|x|)). Returns int8 q ``[T, dim]`` and the f16 d
    as float32 ``[T, dim / 32]``."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    b = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(b).max(axis=2)
    d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(b * inv[:, :, None]).astype(np.int8)
    return q.reshape(x.shape), d


def q2_0_logits(rows: np.ndarray, q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """float32 ``[T, len(rows)]``: q2_0 head rows (``[n, 18 * dim / 64]`` bytes) times Q8_0
    activations (:func:`q8_0_activations`), summed as ggml's ``ggml_vec_dot_q2_0_q8_0``: per
    64-value block the two 32-value integer sums each times its activation d, then d of the
    block times that, accumulated block after block (the cpu kernel's order too)."""
    n, T = rows.shape[0], q.shape[0]
    nb = rows.shape[1] // Q2_0_BLOCK_BYTES
    blocks = rows.reshape(n, nb, Q2_0_BLOCK_BYTES)
    d0 = np.ascontiguousarray(blocks[:, :, :2]).view("<f2")[:, :, 0].astype(np.float32)
    w = unpack_codes(blocks[:, :, 2:].reshape(n * nb, -1)).astype(np.float64) - 1.0
    w = w.reshape(n, 2 * nb, 32).transpose(1, 2, 0)  # [2nb, 32, n]
    qf = q.astype(np.float64).reshape(T, 2 * nb, 32).transpose(1, 0, 2)  # [2nb, T, 32]
    isum = np.matmul(qf, w).astype(np.float32)  # [2nb, T, n]: exact integer sums
    f = isum * d.T[:, :, None]  # d8 * isum per 32 values
    out = np.zeros((T, n), np.float32)
    for b in range(nb):
        out += d0[:, b] * (f[2 * b] + f[2 * b + 1])
    return out


class Backend(ABC):
    """What every backend implements, and what it may add.

    Every backend holds a model's weights and computes the graph's steps
    (:mod:`bitformat.graph`): :meth:`weight` / :meth:`bitlinear` (the ternary projections, the
    abstract part), :meth:`lm_head`, and the small steps (:meth:`norm_quant`,
    :meth:`glu_norm_quant`, :meth:`attend`, :meth:`stack`), which this class gives in numpy
    and a backend may replace with equivalents of its own (the same bits).

    The optional capabilities are the attributes under "Capabilities" below: each is None (or
    the default given) on a backend without it, and callers test it for None, never probe
    for it. A backend with the capability defines it as a method or property.
    """

    name = "base"

    # -- capabilities: None where this backend has none ------------------------------------
    #: bytes of weights a decode step reads, where not the container's (decoded at load)
    weight_bytes_per_token: int | None = None
    #: bytes per value the full LM head reads (an f16 head: 2)
    head_itemsize: int = 2
    #: bytes one full head pass reads, where not vocab * dim * head_itemsize
    head_nbytes: int | None = None
    #: why the screened head cannot run here (None: it can), see :class:`.head.Head`
    no_screen: str | None = None
    #: ``screen_tables() -> ScreenTables``: the screened head's tables
    #: (:mod:`.head`), with ``head_bounds`` and ``head_rows`` beside it
    screen_tables: Callable[[], Any] | None = None
    #: the screen's code width where this backend lets the head choose it from what pays
    #: (``screen_bits``, settable; the cpu backend's): the widths it may switch between
    screen_choice: tuple[int, ...] = ()
    #: ``pick_full(h, samplers) -> ids``: the full head's tokens chosen on the device
    pick_full: Callable[..., list[int]] | None = None
    #: the screen's input split, compiled (:func:`.head.split_hidden`'s arithmetic)
    split_hidden: Callable[..., Any] | None = None
    #: ``greedy_candidates(lo, hi)``: the greedy candidate rows of the last bounds, compiled
    greedy_candidates: Callable[..., Any] | None = None
    #: ``attend_tokens(q, k, v, layer, rows, out)``: a batched decode step's attention, one
    #: token per segment, in one call
    attend_tokens: Callable[..., None] | None = None
    #: ``warm_attention(kv_type)``: compile the attention kernels ahead of a long prompt
    warm_attention: Callable[[str], None] | None = None

    #: While set, decode steps run op by op and the one-call step (:meth:`decode_plan`) waits
    #: until this returns True. A first run on an empty kernel cache sets it: a second process
    #: compiles the one-call step while this one already generates
    #: (:func:`.warmup.start_helper`).
    step_compiled: Callable[[], bool] | None = None

    def plan_ready(self) -> bool:
        """Whether a model may ask :meth:`decode_plan` now (see :attr:`step_compiled`)."""
        if self.step_compiled is None:
            return True
        if not self.step_compiled():
            return False
        self.step_compiled = None
        return True

    def decode_plan(self, net: Any) -> Any | None:
        """The family's graph lowered onto a one-call decode step (``decode_row`` /
        ``decode_rows`` then run it), or None: the step runs op by op."""
        return None

    def __init__(self, model: Model, *, dtype: type = np.float32, i2s_variant: str = "x86"):
        self.model = model
        self.dtype = np.dtype(dtype).type
        self.i2s_variant = i2s_variant
        #: why the screened head cannot run here (None: it can), see :class:`.head.Head`
        self.no_screen: str | None = None
        self.embed_type, raw = model.plain("token_embd.weight")
        self.vocab, self.dim = model.entry("token_embd.weight").shape
        self._embed_raw = raw.reshape(self.vocab, -1)  # one row of bytes per token
        #: the LM head: an untied ``output.weight`` where the file has one, else the embedding
        self.head_name = head_tensor(model)
        if self.head_name == "token_embd.weight":
            self.head_type, self._head_raw = self.embed_type, self._embed_raw
        else:
            e = model.entry(self.head_name)
            if (e.ternary and e.encoding != "q2_0") or e.shape != (self.vocab, self.dim):
                raise UnsupportedConversionError(
                    f"an untied LM head must be a float or q2_0 [{self.vocab}, {self.dim}] "
                    f"tensor, found {e.encoding} {list(e.shape)}", tensor=self.head_name)
            self.head_type, hraw = model.plain(self.head_name)
            self._head_raw = hraw.reshape(self.vocab, -1)
        for name, gtype in (("token_embd.weight", self.embed_type),
                            (self.head_name, self.head_type)):
            if gtype not in HEAD_TYPES:
                raise UnsupportedConversionError(
                    f"{gtype.name} is not an embedding or head type bitformat runs (F32, F16, "
                    "BF16, F64, or q2_0)", path=model.path, tensor=name)
        #: bytes one full head pass reads, where not vocab * dim * head_itemsize (None)
        self.head_nbytes: int | None = None
        if self.head_type == GGMLType.Q2_0:
            self.no_screen = "a ternary q2_0 head (the screen bounds float heads)"
            self.head_nbytes = int(self._head_raw.nbytes)

    def q2_0_head(self, h: np.ndarray) -> np.ndarray:
        """Logits of a q2_0 head as llama.cpp computes them (:func:`q2_0_logits`), in row
        blocks."""
        q, d = q8_0_activations(h)
        out = np.empty((h.shape[0], self.vocab), dtype=np.float32)
        for v0 in range(0, self.vocab, 2048):
            out[:, v0: v0 + 2048] = q2_0_logits(self._head_raw[v0: v0 + 2048], q, d)
        return out

    def vector(self, name: str) -> np.ndarray:
        """A norm gain or other small plain tensor, in the model dtype."""
        return plain_array(self.model, name, self.dtype)

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """``[T]`` token ids -> ``[T, dim]`` rows of ``token_embd``."""
        rows = self._embed_raw[tokens]
        return rows_as_float(self.embed_type, rows.reshape(-1), (len(tokens), self.dim),
                             self.dtype)

    def head_weights(self, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` of the LM head as ``[len(ids), dim]`` floats."""
        rows = self._head_raw[ids]
        return rows_as_float(self.head_type, rows.reshape(-1), (len(ids), self.dim), self.dtype)

    @abstractmethod
    def weight(self, name: str) -> Any:
        """The ternary matrix ``name`` in this backend's form (what :meth:`bitlinear` reads)."""

    def stack(self, weights: list[Any]) -> Any | None:
        """One weight whose rows are ``weights``' rows in turn (one ``bitlinear`` call for q, k
        and v), or None where this backend cannot (the model then calls them one by one)."""
        return None

    # The model's small steps, in numpy; a backend may replace them with faster equivalents.
    def norm_quant(self, x: np.ndarray, gain: np.ndarray, eps: float) -> QuantizedActivations:
        """RMSNorm, then per-token int8 activations."""
        return quantize_activations(rms_norm(x, gain, eps))

    def glu_norm_quant(self, gate: np.ndarray, up: np.ndarray, gain: np.ndarray,
                       eps: float) -> QuantizedActivations:
        """``relu(gate)^2 * up``, RMSNorm, int8 (the input of the FFN's down projection)."""
        return quantize_activations(rms_norm(relu2_glu(gate, up), gain, eps))

    def attend(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, kc: np.ndarray,
               vc: np.ndarray, start: int, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """RoPE on q [T, H, d] and k [T, KV, d], k and v stored in one layer's cache ``kc``/
        ``vc`` at positions ``start..``, then causal attention over the cache -> [T, H * d]."""
        T, d = q.shape[0], q.shape[2]
        kvquant.store(kc, start, rope(k, cos, sin))  # rounded to the cache's type
        kvquant.store(vc, start, v)
        return attention(rope(q, cos, sin), kvquant.load(kc, start + T, d),
                         kvquant.load(vc, start + T, d), start)

    @abstractmethod
    def bitlinear(self, qa: QuantizedActivations, w: Any) -> np.ndarray:
        """``(q @ T^T) / s * scale`` of int8 activations [T, cols] and weight ``w``: [T, rows]
        (docs/model.md §2: one arithmetic for every container)."""

    @abstractmethod
    def lm_head(self, h: np.ndarray) -> np.ndarray:
        """Logits [T, vocab] of final-normed hidden states [T, dim]."""
