"""BitNet b1.58: 2B-4T (ReLU^2 FFN) as transformers' BitNetForCausalLM runs it, and 1bitLLM's
bitnet_b1_58 models (SiLU FFN, untied head), llama.cpp's ``bitnet`` graph.

One decoder layer, pre-norm residual (docs/model.md §1)::

    a = RMSNorm(h)                              q, k, v = BitLinear(a)      (GQA: kv heads < heads)
    q, k = RoPE(q), RoPE(k)                     rotate-half pairing (i, i + d/2), theta from file
    o = softmax(q k^T / sqrt(d) + causal) v     float32 softmax
    h = h + BitLinear_o(RMSNorm_sub(o))         attn_sub_norm BEFORE o_proj
    f = RMSNorm(h)                              g = act(BitLinear_gate(f)) * BitLinear_up(f)
    h = h + BitLinear_down(RMSNorm_sub(g))      ffn_sub_norm BEFORE down_proj

with ``act(x) = relu(x)^2`` (2B-4T) or ``silu(x)`` (1bitLLM; ``bitnet.hidden_activation``),
and ``logits = RMSNorm(h) @ E^T`` with the token embedding E (tied, not quantized) or an
``output.weight``. ``BitLinear(x) = (Q8(x) @ T^T) / s * scale``: per-token absmax int8
activations ``Q8(x) = q`` with ``x ~ q / s`` and trits T with their scale(s). The backend does
the BitLinear products and the LM head from the container bytes; everything else is numpy in
the backend's dtype, which a backend may replace step by step with equivalents of its own
(:class:`.backend.Backend`: ``norm_quant``, ``glu_norm_quant``, ``attend``, ``stack``). The
code is the shared :class:`.base.Transformer`.
"""

from __future__ import annotations

from .base import INPUT_GROUPS, PROJECTIONS, Transformer


class BitNet(Transformer):
    """BitNet b1.58 (both activations): :class:`.base.Transformer` with sub-norms."""


__all__ = ["INPUT_GROUPS", "PROJECTIONS", "BitNet"]
