"""What every model family shares: its sizes (:class:`ModelArgs`), the KV cache, and the
activation hook tests use to record and inject the int8 activations of any family."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import MetadataError, RequestError, UnsupportedConversionError
from ..backend import Backend, QuantizedActivations

#: When set, every activation quantization of every model goes through it, in numpy:
#: ``activation_hook(x) -> QuantizedActivations`` with ``x`` the RMSNorm output [T, n], four
#: calls per layer in order (attention input, attention sub-norm, FFN input, FFN sub-norm).
#: The backends' fused steps are bypassed. Tests use it to record and inject activations.
activation_hook: Callable[[np.ndarray], QuantizedActivations] | None = None

#: GGUF architectures with this graph (bitnet.cpp's two names and upstream llama.cpp's).
ARCHITECTURES = ("bitnet-b1.58", "bitnet-25", "bitnet")


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

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], vocab_size: int | None = None) -> ModelArgs:
        """From GGUF metadata (plain values): ``<arch>.embedding_length`` and friends."""
        arch = meta.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise UnsupportedConversionError(f"architecture {arch!r} is not BitNet b1.58 "
                                             f"(expected one of {', '.join(ARCHITECTURES)})")

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
                   context_length=need("context_length", 2048), arch=arch)
        args.checked()
        rope_dim = need("rope.dimension_count", args.head_dim)
        if rope_dim != args.head_dim:
            raise UnsupportedConversionError(f"partial RoPE ({rope_dim} of {args.head_dim} "
                                             "head dimensions) is not BitNet's")
        return args.checked()

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> ModelArgs:
        """From a Hugging Face ``config.json`` of ``BitNetForCausalLM``."""
        rope = cfg.get("rope_parameters") or {}
        heads = int(cfg["num_attention_heads"])
        return cls(dim=int(cfg["hidden_size"]), n_layers=int(cfg["num_hidden_layers"]),
                   n_heads=heads, n_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                   hidden_dim=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]),
                   norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                   rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 500000.0))),
                   context_length=int(cfg.get("max_position_embeddings", 2048))).checked()

    def checked(self) -> ModelArgs:
        if min(self.dim, self.n_layers, self.n_heads, self.n_kv_heads, self.hidden_dim,
               self.vocab_size, self.context_length) <= 0:
            raise MetadataError(f"model sizes must be positive: {self}")
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads or self.head_dim % 2:
            raise MetadataError(f"{self.n_heads} heads of an even size do not fit hidden size "
                                f"{self.dim} and {self.n_kv_heads} kv heads")
        return self


class KVCache:
    """Keys and values of every layer for the positions seen so far (preallocated)."""

    def __init__(self, args: ModelArgs, max_len: int, dtype: type = np.float32):
        shape = (args.n_layers, max_len, args.n_kv_heads, args.head_dim)
        self.k = np.zeros(shape, dtype)  # [layers, max_len, kv_heads, head_dim]
        self.v = np.zeros(shape, dtype)
        self.length = 0
        self.max_len = max_len

    @property
    def nbytes(self) -> int:
        """Bytes a decode step reads from the cache at its current length."""
        return 2 * self.length * self.k[0, 0].nbytes * self.k.shape[0]




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
        for sl, cache, start in self.spans:
            out[sl] = be.attend(q[sl], k[sl], v[sl], cache.k[layer], cache.v[layer], start,
                                self.cos[sl], self.sin[sl])
        return out

    def advance(self) -> None:
        """Every cache now holds its segment's positions."""
        for sl, cache, start in self.spans:
            cache.length = start + (sl.stop - sl.start)
