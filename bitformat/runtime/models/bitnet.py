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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..backend import Backend, QuantizedActivations, relu2_glu, rms_norm
from ..exact_head import Head
from ..sampling import Sampler
from . import base
from .base import KVCache, ModelArgs, Rows, Segment

PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
#: projections that read the same activations (a backend may run each group as one matrix)
INPUT_GROUPS = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))


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

    def __init__(self, args: ModelArgs, backend: Backend, *,
                 progress: Callable[[int, int], None] | None = None, head: str = "full"):
        """``progress(layer, n_layers)`` is called as each layer's weights are ready; ``head``:
        "full" or "screened" (:mod:`..exact_head`: the same tokens from fewer bytes)."""
        self.args, self.be = args, backend
        self.head = Head(backend, head)
        names = {e.name for e in backend.model.entries}
        self.blocks = []
        for i in range(args.n_layers):
            if progress is not None:
                progress(i, args.n_layers)
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
        out, end = [], 0
        for n in names:
            start, end = end, end + blk.proj[n].rows
            out.append(y[:, start:end] * y.dtype.type(blk.out_scale[n])
                       if n in blk.out_scale else y[:, start:end])
        return out

    def _norm_quant(self, x: np.ndarray, gain: np.ndarray) -> QuantizedActivations:
        if base.activation_hook is not None:
            return base.activation_hook(rms_norm(x, gain, self.args.norm_eps))
        return self.be.norm_quant(x, gain, self.args.norm_eps)

    def forward(self, tokens: Sequence[int], cache: KVCache, *,
                all_logits: bool = False) -> np.ndarray:
        """Run ``tokens`` after the cache's positions; logits [T or 1, vocab] (last by default)."""
        h = self.forward_hidden([Segment(tokens, cache)], all_positions=all_logits)
        return self.be.lm_head(h)  # [T or 1, vocab]

    def decode(self, segments: Sequence[Segment], samplers: Sequence[Sampler]) -> list[int]:
        """Run each segment (one request's next tokens on its own cache) in one pass over the
        weights, and choose each request's next token with its sampler."""
        return self.select(self.forward_hidden(segments), samplers)

    def select(self, h: np.ndarray, samplers: Sequence[Sampler]) -> list[int]:
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
        eps, hd, n = a.norm_eps, a.head_dim, rows.n
        h = self.be.embed(rows.ids)  # [n, dim]
        for i, blk in enumerate(self.blocks):
            x = self._norm_quant(h, blk.attn_norm)
            q, k, v = self._linears(blk, ("attn_q", "attn_k", "attn_v"), x)
            q = q.reshape(n, a.n_heads, hd)
            k, v = k.reshape(n, a.n_kv_heads, hd), v.reshape(n, a.n_kv_heads, hd)
            o = rows.attend(self.be, i, q, k, v)  # [n, dim]
            o = self._norm_quant(o, blk.attn_sub_norm)
            h = h + self._linear(blk, "attn_output", o)
            f = self._norm_quant(h, blk.ffn_norm)
            gate, up = self._linears(blk, ("ffn_gate", "ffn_up"), f)  # [n, hidden_dim] each
            if base.activation_hook is None:
                g = self.be.glu_norm_quant(gate, up, blk.ffn_sub_norm, eps)
            else:
                g = base.activation_hook(rms_norm(relu2_glu(gate, up), blk.ffn_sub_norm, eps))
            h = h + self._linear(blk, "ffn_down", g)
        rows.advance()
        return rms_norm(h if all_positions else h[rows.last], self.norm, eps)
