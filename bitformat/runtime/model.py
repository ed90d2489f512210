"""BitNet b1.58 (Ma et al. 2024; 2B-4T report 2025) as transformers' BitNetForCausalLM runs it.

One decoder layer, pre-norm residual (FORMATS.md 4.3)::

    a = RMSNorm(h)                              q, k, v = BitLinear(a)      (GQA: kv heads < heads)
    q, k = RoPE(q), RoPE(k)                     rotate-half pairing (i, i + d/2), theta from file
    o = softmax(q k^T / sqrt(d) + causal) v     float32 softmax
    h = h + BitLinear_o(RMSNorm_sub(o))         attn_sub_norm BEFORE o_proj
    f = RMSNorm(h)                              g = relu(BitLinear_gate(f))^2 * BitLinear_up(f)
    h = h + BitLinear_down(RMSNorm_sub(g))      ffn_sub_norm BEFORE down_proj

and ``logits = RMSNorm(h) @ E^T`` with the token embedding E (tied, not quantized).
``BitLinear(x) = (Q8(x) @ T^T) / s * scale``: per-token absmax int8 activations ``Q8(x) = q``
with ``x ~ q / s`` and trits T with their scale(s). The backend does the BitLinear products and
the LM head from the container bytes; everything else here is numpy in the backend's dtype,
which a backend may replace step by step with equivalents of its own (:class:`.backend.Backend`:
``norm_quant``, ``glu_norm_quant``, ``attend``, ``stack``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import MetadataError, RequestError, UnsupportedConversionError
from .backend import Backend, QuantizedActivations, relu2_glu, rms_norm

#: When set, every activation quantization of every model goes through it, in numpy:
#: ``activation_hook(x) -> QuantizedActivations`` with ``x`` the RMSNorm output [T, n], four
#: calls per layer in order (attention input, attention sub-norm, FFN input, FFN sub-norm).
#: The backends' fused steps are bypassed. Tests use it to record and inject activations.
activation_hook: Callable[[np.ndarray], QuantizedActivations] | None = None

#: GGUF architectures with this graph (bitnet.cpp's two names and upstream llama.cpp's).
ARCHITECTURES = ("bitnet-b1.58", "bitnet-25", "bitnet")
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
#: projections that read the same activations (a backend may run each group as one matrix)
INPUT_GROUPS = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))


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

        def need(key: str, default: Any = None) -> Any:
            v = meta.get(f"{arch}.{key}", default)
            if v is None:
                raise MetadataError(f"missing metadata {arch}.{key}")
            return v

        heads = int(need("attention.head_count"))
        args = cls(dim=int(need("embedding_length")), n_layers=int(need("block_count")),
                   n_heads=heads, n_kv_heads=int(need("attention.head_count_kv", heads)),
                   hidden_dim=int(need("feed_forward_length")),
                   vocab_size=int(need("vocab_size", vocab_size)),
                   norm_eps=float(need("attention.layer_norm_rms_epsilon", 1e-5)),
                   rope_theta=float(need("rope.freq_base", 10000.0)),
                   context_length=int(need("context_length", 2048)), arch=arch)
        rope_dim = meta.get(f"{arch}.rope.dimension_count", args.head_dim)
        if int(rope_dim) != args.head_dim:
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
class Block:
    """The weights of one decoder layer: norm gains and backend handles of the projections."""

    attn_norm: np.ndarray
    attn_sub_norm: np.ndarray
    ffn_norm: np.ndarray
    ffn_sub_norm: np.ndarray
    proj: dict[str, Any]  # "attn_q" ... "ffn_down" -> backend weight
    out_scale: dict[str, float]  # optional per-projection .scale tensors (upstream "bitnet")
    stacked: dict[tuple[str, ...], Any]  # (q, k, v) and (gate, up) as one weight, if possible


class BitNet:
    """The network: ``forward(tokens, cache)`` -> logits, on any backend."""

    def __init__(self, args: ModelArgs, backend: Backend):
        self.args, self.be = args, backend
        names = {e.name for e in backend.model.entries}
        self.blocks = []
        for i in range(args.n_layers):
            p = f"blk.{i}."
            proj = {n: backend.weight(f"{p}{n}.weight") for n in PROJECTIONS}
            stacked = {group: backend.stack([proj[n] for n in group]) for group in INPUT_GROUPS}
            self.blocks.append(Block(
                *(backend.vector(f"{p}{n}.weight") for n in
                  ("attn_norm", "attn_sub_norm", "ffn_norm", "ffn_sub_norm")),
                proj,
                {n: float(backend.vector(f"{p}{n}.scale").reshape(-1)[0])
                 for n in PROJECTIONS if f"{p}{n}.scale" in names},
                {g: w for g, w in stacked.items() if w is not None}))
        self.norm = backend.vector("output_norm.weight")
        d = args.head_dim
        self.inv_freq = 1.0 / args.rope_theta ** (np.arange(0, d, 2) / d)  # [d/2], float64

    def new_cache(self, max_len: int) -> KVCache:
        return KVCache(self.args, max_len, self.be.dtype)

    def _linear(self, blk: Block, name: str, qa) -> np.ndarray:
        y = self.be.bitlinear(qa, blk.proj[name])  # [T, out]
        return y * y.dtype.type(blk.out_scale[name]) if name in blk.out_scale else y

    def _linears(self, blk: Block, names: tuple[str, ...], qa) -> list[np.ndarray]:
        """The projections ``names`` of one input, in one call where the backend stacked them."""
        w = blk.stacked.get(names)
        if w is None:
            return [self._linear(blk, n, qa) for n in names]
        y = self.be.bitlinear(qa, w)  # [T, sum of rows]
        ends = np.cumsum([blk.proj[n].rows for n in names])
        return [y[:, e - blk.proj[n].rows: e] * y.dtype.type(blk.out_scale[n])
                if n in blk.out_scale else y[:, e - blk.proj[n].rows: e]
                for n, e in zip(names, ends, strict=True)]

    def _norm_quant(self, x: np.ndarray, gain: np.ndarray) -> QuantizedActivations:
        if activation_hook is not None:
            return activation_hook(rms_norm(x, gain, self.args.norm_eps))
        return self.be.norm_quant(x, gain, self.args.norm_eps)

    def forward(self, tokens: Sequence[int], cache: KVCache, *,
                all_logits: bool = False) -> np.ndarray:
        """Run ``tokens`` after the cache's positions; logits [T or 1, vocab] (last by default)."""
        a = self.args
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        T, start = len(ids), cache.length
        if T == 0:
            raise RequestError("no tokens to run")
        if ids.min() < 0 or ids.max() >= a.vocab_size:
            bad = int(ids[(ids < 0) | (ids >= a.vocab_size)][0])
            raise RequestError(f"token id {bad} is outside the vocabulary "
                                             f"(0..{a.vocab_size - 1})")
        if start + T > cache.max_len:
            raise RequestError(f"{start + T} positions exceed the context of "
                                             f"{cache.max_len}")
        dt, eps, hd = self.be.dtype, a.norm_eps, a.head_dim
        angles = np.arange(start, start + T, dtype=dt)[:, None] * self.inv_freq.astype(dt)
        cos, sin = np.cos(angles), np.sin(angles)  # [T, hd/2], angles in dt as HF's float32
        h = self.be.embed(ids)  # [T, dim]
        for i, blk in enumerate(self.blocks):
            x = self._norm_quant(h, blk.attn_norm)
            q, k, v = self._linears(blk, ("attn_q", "attn_k", "attn_v"), x)
            q = q.reshape(T, a.n_heads, hd)
            k, v = k.reshape(T, a.n_kv_heads, hd), v.reshape(T, a.n_kv_heads, hd)
            o = self.be.attend(q, k, v, cache.k[i], cache.v[i], start, cos, sin)  # [T, dim]
            o = self._norm_quant(o, blk.attn_sub_norm)
            h = h + self._linear(blk, "attn_output", o)
            f = self._norm_quant(h, blk.ffn_norm)
            gate, up = self._linears(blk, ("ffn_gate", "ffn_up"), f)  # [T, hidden_dim] each
            if activation_hook is None:
                g = self.be.glu_norm_quant(gate, up, blk.ffn_sub_norm, eps)
            else:
                g = activation_hook(rms_norm(relu2_glu(gate, up), blk.ffn_sub_norm, eps))
            h = h + self._linear(blk, "ffn_down", g)
        cache.length = start + T
        h = rms_norm(h if all_logits else h[-1:], self.norm, eps)
        return self.be.lm_head(h)  # [T or 1, vocab]
