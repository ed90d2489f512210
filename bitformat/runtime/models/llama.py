"""Llama-architecture ternary models: HF1BitLLM/Llama3-8B-1.58-100B-tokens and the
tiiuae/Falcon3-*-1.58bit family (transformers' BitNet quantization on ``LlamaForCausalLM``).

The Llama decoder with every projection a BitLinear (per-token int8 activations, ternary
weights with one scale per tensor)::

    a = RMSNorm(h)                 q, k, v = BitLinear(a)     k/v: GQA
    q, k = RoPE(q), RoPE(k)        GGUF rows in llama.cpp's interleaved order, read back in
                                   HF order (rotate-half), which is the same attention
    h = h + BitLinear_o(o)         no sub-norm
    f = RMSNorm(h)                 h = h + BitLinear_down(silu(BitLinear_gate(f)) * BitLinear_up(f))

and ``logits = RMSNorm(h) @ W_out^T`` with the untied, unquantized ``output.weight`` (HF
``lm_head``, kept dense by transformers' ``modules_to_not_convert``).
"""

from __future__ import annotations

from .base import Transformer


class Llama(Transformer):
    """Llama ternary: :class:`.base.Transformer` without sub-norms, SiLU, permuted q/k rows."""


__all__ = ["Llama"]
