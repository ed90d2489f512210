"""What every model family shares: its sizes (:class:`ModelArgs`), the KV cache, the
activation hook tests use to record and inject the int8 activations of any family, and the
decoder itself (:class:`Transformer`), which each family's module configures
(:mod:`bitformat.families` says how they differ)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import MetadataError, RequestError, UnsupportedConversionError
from ...families import (
    ARCHITECTURES,
    BITNET_2B4T,
    Family,
    family_of,
    hf_family,
)
from ..backend import Backend, QuantizedActivations, quantize_activations, relu2_glu, rms_norm
from ..head import Head
from ..kvquant import check_kv_type, row_width, storage_dtype

#: When set, every activation quantization of every model goes through it, in numpy:
#: ``activation_hook(x) -> QuantizedActivations`` with ``x`` what is quantized [T, n] (the
#: RMSNorm output; the plain input of o_proj / down_proj in families without sub-norms), four
#: calls per layer in order (attention input, o_proj input, FFN input, down_proj input).
#: The backends' fused steps are bypassed. Tests use it to record and inject activations.
activation_hook: Callable[[np.ndarray], QuantizedActivations] | None = None


@dataclass(frozen=True)
class ModelArgs:
    dim: int  # hidden size
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int  # FFN (intermediate) width
    vocab_size: int
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    context_length: int = 4096
    arch: str = "bitnet-b1.58"
    family: Family = BITNET_2B4T
    key_length: int = 0  # head size where it is not dim / n_heads (Qwen3)

    @property
    def head_dim(self) -> int:
        return self.key_length or self.dim // self.n_heads

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], vocab_size: int | None = None) -> ModelArgs:
        """From GGUF metadata (plain values): ``<arch>.embedding_length`` and friends."""
        arch = meta.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise UnsupportedConversionError(f"architecture {arch!r} is not a ternary family "
                                             f"bitformat runs (expected one of "
                                             f"{', '.join(ARCHITECTURES)})")
        family = family_of(meta)

        def need(key: str, default: Any = None, kind: type = int) -> Any:
            v = meta.get(f"{arch}.{key}", default)
            if v is None:
                raise MetadataError(f"missing metadata {arch}.{key}")
            # a GGUF integer or float of any width; a string, array or bool is a wrong type
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) \
                    or (kind is int and v != int(v) if np.isfinite(v) else kind is int):
                raise MetadataError(f"metadata {arch}.{key} is {str(v)[:40]!r}, not "
                                    f"{'an integer' if kind is int else 'a number'}")
            return kind(v)

        heads = need("attention.head_count")
        args = cls(dim=need("embedding_length"), n_layers=need("block_count"),
                   n_heads=heads, n_kv_heads=need("attention.head_count_kv", heads),
                   hidden_dim=need("feed_forward_length"),
                   vocab_size=need("vocab_size", vocab_size),
                   norm_eps=need("attention.layer_norm_rms_epsilon", 1e-5, float),
                   rope_theta=need("rope.freq_base", 10000.0, float),
                   context_length=need("context_length", 2048), arch=arch,
                   family=family, key_length=need("attention.key_length", 0))
        args.checked()
        rope_dim = need("rope.dimension_count", args.head_dim)
        if rope_dim != args.head_dim:
            raise UnsupportedConversionError(f"partial RoPE ({rope_dim} of {args.head_dim} "
                                             "head dimensions) is not BitNet's")
        return args.checked()

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> ModelArgs:
        """From a Hugging Face ``config.json`` of any family."""
        rope = cfg.get("rope_parameters") or {}
        heads = int(cfg["num_attention_heads"])
        fam = hf_family(cfg) if cfg.get("model_type") or cfg.get("architectures") \
            else BITNET_2B4T
        hd = cfg.get("head_dim")
        return cls(family=fam, arch=fam.arch,
                   key_length=int(hd) if hd and int(hd) != cfg["hidden_size"] // heads else 0,
                   dim=int(cfg["hidden_size"]), n_layers=int(cfg["num_hidden_layers"]),
                   n_heads=heads, n_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                   hidden_dim=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]),
                   norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                   rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 500000.0))),
                   context_length=int(cfg.get("max_position_embeddings", 2048))).checked()

    def checked(self) -> ModelArgs:
        if min(self.dim, self.n_layers, self.n_heads, self.n_kv_heads, self.hidden_dim,
               self.vocab_size, self.context_length) <= 0:
            raise MetadataError(f"model sizes must be positive: {self}")
        if (self.dim % self.n_heads and not self.key_length) or self.n_heads % self.n_kv_heads \
                or self.head_dim % 2:
            raise MetadataError(f"{self.n_heads} heads of an even size do not fit hidden size "
                                f"{self.dim} and {self.n_kv_heads} kv heads")
        return self


class KVCache:
    """Keys and values of every layer for the positions seen so far.

    ``k``/``v`` [layers, capacity, KV, width] hold rows of the cache's type
    (:mod:`..kvquant`: float32, float16, or q8_0 int8 rows of ``width`` elements). The
    capacity grows in blocks of :data:`KV_BLOCK` positions as the sequence does
    (:meth:`reserve`), up to ``max_len``, so a cache made for a whole context costs only the
    positions it holds. ``dtype``: the f32 type's element type (float64 on the numpy backend in
    float64).
    """

    def __init__(self, args: ModelArgs, max_len: int, dtype: type = np.float32,
                 kv_type: str = "f32"):
        check_kv_type(kv_type)
        self.kv_type = kv_type
        self.store = dtype if kv_type == "f32" else storage_dtype(kv_type)
        self._shape = (args.n_layers, args.n_kv_heads, row_width(kv_type, args.head_dim))
        self.k = self.v = self._alloc(0)
        self.length = 0
        self.max_len = max_len

    def _alloc(self, capacity: int) -> np.ndarray:
        """Room for ``capacity`` positions, not cleared: attention reads only the positions
        written (a large ``np.empty`` costs no pages until they are written)."""
        layers, kv, width = self._shape
        return np.empty((layers, capacity, kv, width), self.store)

    @property
    def capacity(self) -> int:
        """Positions the arrays hold now (:meth:`reserve` grows them)."""
        return self.k.shape[1]

    def reserve(self, n: int) -> None:
        """Room for ``n`` positions: the arrays grow to ``n`` rounded up to a block (at most
        ``max_len``), the positions held copied over."""
        if n <= self.capacity:
            return
        if n > self.max_len:
            raise RequestError(f"{n} positions exceed the context of {self.max_len}")
        cap = min(self.max_len, -(-n // KV_BLOCK) * KV_BLOCK)
        k, v = self._alloc(cap), self._alloc(cap)
        k[:, :self.length] = self.k[:, :self.length]
        v[:, :self.length] = self.v[:, :self.length]
        self.k, self.v = k, v

    @property
    def nbytes(self) -> int:
        """Bytes a decode step reads from the cache at its current length."""
        layers, kv, width = self._shape
        return 2 * self.length * layers * kv * width * np.dtype(self.store).itemsize

    @property
    def allocated(self) -> int:
        """Bytes the cache's arrays take now."""
        return self.k.nbytes + self.v.nbytes


#: positions a KV cache grows by at a time (:meth:`KVCache.reserve`)
KV_BLOCK = 256


@dataclass
class Segment:
    """One request's next tokens, to run after the positions its cache already holds."""

    tokens: Sequence[int]
    cache: KVCache


@dataclass
class Rows:
    """The rows of one forward pass: every segment's tokens in turn, with their positions.

    A prompt is one segment of many rows; a batched decode step is many segments of one row
    each. Projections run on all rows at once; attention runs per segment on its own cache.
    """

    ids: np.ndarray  # int64 [n]
    spans: list[tuple[slice, KVCache, int]]  # each segment's rows, cache and first position
    cos: np.ndarray  # [n, head_dim / 2], RoPE at each row's position
    sin: np.ndarray
    last: np.ndarray  # the row index of each segment's last token
    derived: dict[str, Any] = field(default_factory=dict)  # what a backend derives once a step

    @property
    def n(self) -> int:
        return len(self.ids)

    @classmethod
    def of(cls, segments: Sequence[Segment], args: ModelArgs, dtype: type,
           inv_freq: np.ndarray) -> Rows:
        """Check every segment (nothing changes if one is bad) and lay out their rows."""
        if not segments:
            raise RequestError("no tokens to run")
        if len({id(s.cache) for s in segments}) != len(segments):
            raise RequestError("two segments of one forward pass share a KV cache")
        ids, spans, positions, at = [], [], [], 0
        for seg in segments:
            t = np.asarray(seg.tokens, dtype=np.int64).reshape(-1)
            if t.size == 0:
                raise RequestError("no tokens to run")
            if t.min() < 0 or t.max() >= args.vocab_size:
                bad = int(t[(t < 0) | (t >= args.vocab_size)][0])
                raise RequestError(f"token id {bad} is outside the vocabulary "
                                   f"(0..{args.vocab_size - 1})")
            start = seg.cache.length
            if start + t.size > seg.cache.max_len:
                raise RequestError(f"{start + t.size} positions exceed the context of "
                                   f"{seg.cache.max_len}")
            ids.append(t)
            spans.append((slice(at, at + t.size), seg.cache, start))
            positions.append(np.arange(start, start + t.size, dtype=dtype))
            at += t.size
        for sl, cache, start in spans:  # all checked: room for each segment's positions
            cache.reserve(start + sl.stop - sl.start)
        angles = np.concatenate(positions)[:, None] * inv_freq.astype(dtype)  # as HF's float32
        last = np.array([sl.stop - 1 for sl, _, _ in spans], dtype=np.int64)
        return cls(np.concatenate(ids), spans, np.cos(angles), np.sin(angles), last)

    def attend(self, be: Backend, layer: int, q: np.ndarray, k: np.ndarray,
               v: np.ndarray) -> np.ndarray:
        """RoPE, cache write and causal attention of layer ``layer``, segment by segment:
        q [n, H, d], k/v [n, KV, d] -> [n, H * d]."""
        if len(self.spans) == 1:
            _, cache, start = self.spans[0]
            return be.attend(q, k, v, cache.k[layer], cache.v[layer], start, self.cos, self.sin)
        out = np.empty((self.n, q.shape[1] * q.shape[2]), q.dtype)
        ones = be.attend_tokens
        if ones is not None and self.n == len(self.spans):  # a decode step: a token each
            ones(q, k, v, layer, self, out)
            return out
        for sl, cache, start in self.spans:
            out[sl] = be.attend(q[sl], k[sl], v[sl], cache.k[layer], cache.v[layer], start,
                                self.cos[sl], self.sin[sl])
        return out

    def advance(self) -> None:
        """Every cache now holds its segment's positions."""
        for sl, cache, start in self.spans:
            cache.length = start + (sl.stop - sl.start)


# -- the decoder every family shares ----------------------------------------------------------
#: projections that read the same activations (a backend may run each group as one matrix)
INPUT_GROUPS = tuple(s.weights for s in BITNET_2B4T.graph.steps
                     if s.op == "linear" and len(s.weights) > 1)


def silu_glu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """The SiLU-gated FFN (Llama, Qwen3, 1bitLLM): ``gate * sigmoid(gate) * up``."""
    one = gate.dtype.type(1)
    with np.errstate(over="ignore"):  # exp(-gate) = inf: gate / inf = -0, as torch's silu
        return gate / (one + np.exp(-gate)) * up


GLU = {"relu2": relu2_glu, "silu": silu_glu}


def interleave_order(head_dim: int) -> np.ndarray:
    """Where llama.cpp's converter puts each HF row of a head of q/k (``permute``): GGUF row
    ``2i + p`` of a head holds HF row ``p * d/2 + i`` (interleaved RoPE pairs)."""
    return np.arange(head_dim).reshape(2, head_dim // 2).T.reshape(-1)


@dataclass
class Block:
    """The weights of one decoder layer, by the names its graph's steps give them."""

    vectors: dict[str, np.ndarray]  # norm gains: "attn_norm" ... -> float vector
    proj: dict[str, Any]  # "attn_q" ... "ffn_down" -> backend weight
    out_scale: dict[str, float]  # optional per-projection .scale tensors (upstream "bitnet")
    stacked: dict[tuple[str, ...], Any]  # (q, k, v) and (gate, up) as one weight, if possible


class Transformer:
    """The network of every family: ``forward(tokens, cache)`` -> logits, on any backend.

    It runs the family's layer as its graph describes it (:mod:`bitformat.graph`: the steps,
    in order, over named values), and ``logits = RMSNorm(h) @ H^T`` with H ``output.weight``
    if the file has one, else the token embedding. ``BitLinear(x) = (Q8(x) @ T^T) / s *
    scale``: per-token absmax int8 activations. The backend does the projections, norms,
    quantization and attention (:class:`..backend.Backend`); a backend with a fused step of
    its own lowers the same graph (``decode_plan``).
    """

    def __init__(self, args: ModelArgs, backend: Backend, *,
                 progress: Callable[[int, int], None] | None = None, head: str = "full"):
        """``progress(layer, n_layers)`` is called as each layer's weights are ready; ``head``:
        "full" or "screened" (:mod:`..head`: the same tokens from fewer bytes)."""
        self.args, self.be = args, backend
        self.head = Head(backend, head)
        self.graph = graph = args.family.graph
        names = {e.name for e in backend.model.entries}
        self.blocks = []
        for i in range(args.n_layers):
            if progress is not None:
                progress(i, args.n_layers)
            p = f"blk.{i}."
            proj, vectors, stacked = {}, {}, {}
            for step in graph.steps:
                if step.op == "linear":
                    for n in step.weights:
                        proj[n] = backend.weight(f"{p}{n}.weight")
                    if len(step.weights) > 1:
                        w = backend.stack([proj[n] for n in step.weights])
                        if w is not None:
                            stacked[step.weights] = w
                else:
                    for n in step.weights:
                        vectors[n] = backend.vector(f"{p}{n}.weight")
            self.blocks.append(Block(
                vectors, proj, {n: float(backend.vector(f"{p}{n}.scale").reshape(-1)[0])
                                for n in proj if f"{p}{n}.scale" in names}, stacked))
        self.norm = backend.vector("output_norm.weight")
        d = args.head_dim
        self.inv_freq = 1.0 / args.rope_theta ** (np.arange(0, d, 2) / d)  # [d/2], float64
        self.hf_order = np.argsort(interleave_order(d)) if graph.has("hf_rows") else None

    _plan: Any = False  # the backend's plan for a one-token step, once asked (None: none)

    def _decode_plan(self) -> Any:
        """The backend's plan to run one token through every layer in one call
        (``decode_plan``/``decode_row``, the cpu backend), or None."""
        if self._plan is False:
            if not self.be.plan_ready():
                return None  # compiled elsewhere meanwhile: op by op until then
            self._plan = self.be.decode_plan(self)
        return self._plan

    #: the element type of the caches :meth:`new_cache` makes (``constants.KV_TYPES``)
    kv_type: str = "f32"

    def new_cache(self, max_len: int) -> KVCache:
        return KVCache(self.args, max_len, self.be.dtype, self.kv_type)

    def _linear(self, blk: Block, name: str, qa) -> np.ndarray:
        y = self.be.bitlinear(qa, blk.proj[name])  # [T, out]
        return y * y.dtype.type(blk.out_scale[name]) if name in blk.out_scale else y

    def _linears(self, blk: Block, names: tuple[str, ...], qa) -> list[np.ndarray]:
        """The projections ``names`` of one input, in one call where the backend stacked them."""
        w = blk.stacked.get(names)
        if w is None:
            return [self._linear(blk, n, qa) for n in names]
        y = self.be.bitlinear(qa, w)  # [T, sum of rows]
        out, end = [], 0
        for n in names:
            start, end = end, end + blk.proj[n].rows
            out.append(y[:, start:end] * y.dtype.type(blk.out_scale[n])
                       if n in blk.out_scale else y[:, start:end])
        return out

    def _quant(self, x: np.ndarray, gain: np.ndarray | None) -> QuantizedActivations:
        """RMSNorm with ``gain`` (if any), then int8 per token."""
        if activation_hook is not None:
            return activation_hook(x if gain is None else rms_norm(x, gain, self.args.norm_eps))
        if gain is None:
            return quantize_activations(np.ascontiguousarray(x))
        return self.be.norm_quant(x, gain, self.args.norm_eps)

    def _layer(self, i: int, blk: Block, h: np.ndarray, rows: Rows) -> np.ndarray:
        """Layer ``i``: the graph's steps in order on the hidden states ``h`` [n, dim]."""
        a = self.args
        eps, hd, n = a.norm_eps, a.head_dim, rows.n
        val: dict[str, Any] = {"h": h}
        steps = self.graph.steps
        skip = False
        for j, s in enumerate(steps):
            if skip:
                skip = False
                continue
            if s.op == "norm_quant":
                val[s.out[0]] = self._quant(val[s.src[0]],
                                            blk.vectors[s.weights[0]] if s.weights else None)
            elif s.op == "linear":
                val.update(zip(s.out, self._linears(blk, s.weights, val[s.src[0]]),
                               strict=True))
            elif s.op == "hf_rows":
                for v in s.src:
                    x = val[v]
                    val[v] = x.reshape(n, -1, hd)[..., self.hf_order].reshape(n, -1)
            elif s.op == "head_norm":
                for v, g in zip(s.src, s.weights, strict=True):
                    val[v] = rms_norm(val[v].reshape(n, -1, hd), blk.vectors[g], eps
                                      ).reshape(n, -1)
            elif s.op == "attention":
                q, k, v = (val[x] for x in s.src)
                val[s.out[0]] = rows.attend(
                    self.be, i, np.ascontiguousarray(q.reshape(n, a.n_heads, hd)),
                    np.ascontiguousarray(k.reshape(n, a.n_kv_heads, hd)),
                    v.reshape(n, a.n_kv_heads, hd))
            elif s.op == "glu":
                gate, up = val[s.src[0]], val[s.src[1]]
                nxt = steps[j + 1] if j + 1 < len(steps) else None
                if (s.arg == "relu2" and activation_hook is None and nxt is not None
                        and nxt.op == "norm_quant" and nxt.src == s.out and nxt.weights):
                    # ReLU^2, norm and int8 in one backend call (the same arithmetic)
                    gain = blk.vectors[nxt.weights[0]]
                    val[nxt.out[0]] = self.be.glu_norm_quant(gate, up, gain, eps)
                    skip = True
                else:
                    val[s.out[0]] = GLU[s.arg](gate, up)
            elif s.op == "add":
                val[s.out[0]] = val[s.src[0]] + val[s.src[1]]
            else:  # graph.OPS and this interpreter disagree
                raise UnsupportedConversionError(f"the layer step {s.op!r} has no numpy form")
        return val["h"]

    def forward(self, tokens: Sequence[int], cache: KVCache, *,
                all_logits: bool = False) -> np.ndarray:
        """Run ``tokens`` after the cache's positions; logits [T or 1, vocab] (last by default)."""
        h = self.forward_hidden([Segment(tokens, cache)], all_positions=all_logits)
        return self.be.lm_head(h)  # [T or 1, vocab]

    def decode(self, segments: Sequence[Segment], samplers: Sequence[Any]) -> list[int]:
        """Run each segment (one request's next tokens on its own cache) in one pass over the
        weights, and choose each request's next token with its sampler."""
        return self.select(self.forward_hidden(segments), samplers)

    def select(self, h: np.ndarray, samplers: Sequence[Any]) -> list[int]:
        """The token each row of final hidden states ``h`` [n, dim] leads to: the full head's
        choice, by the full or the screened head."""
        return self.head.select(h, samplers)

    def forward_hidden(self, segments: Sequence[Segment], *,
                       all_positions: bool = False) -> np.ndarray:
        """The final-normed hidden states after running every segment: [segments, dim] (each
        segment's last position), or [all rows, dim] with ``all_positions``.

        The rows of all segments go through every projection together (one read of each
        weight), each row quantized on its own, so a row's result does not depend on the
        others; attention reads each segment's own cache.
        """
        a = self.args
        rows = Rows.of(segments, a, self.be.dtype, self.inv_freq)
        eps, n = a.norm_eps, rows.n
        if (n == len(rows.spans) and activation_hook is None
                and self._decode_plan() is not None):
            # a token per request: every layer in one backend call, the same arithmetic
            h = np.array(self.be.embed(rows.ids), self.be.dtype, order="C")
            if n == 1:
                _, cache, start = rows.spans[0]
                self.be.decode_row(self._plan, h, cache, start, rows.cos[0], rows.sin[0])
                done = True
            else:
                done = self.be.decode_rows(self._plan, h, rows)
            if done:
                rows.advance()
                return rms_norm(h, self.norm, eps)
        h = self.be.embed(rows.ids)  # [n, dim]
        for i, blk in enumerate(self.blocks):
            h = self._layer(i, blk, h, rows)
        rows.advance()
        return rms_norm(h if all_positions else h[rows.last], self.norm, eps)
