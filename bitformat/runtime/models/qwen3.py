"""Qwen3-architecture ternary models (PrismML's Ternary Bonsai; ``Qwen3ForCausalLM``).

The Llama block plus q/k norms: an RMSNorm with gains ``[head_dim]`` over each head of q and of
k, before RoPE (transformers ``Qwen3Attention``; llama.cpp ``attn_q_norm``/``attn_k_norm``).
The head size is its own hyperparameter (``head_dim`` / ``qwen3.attention.key_length``), so
``n_heads * head_dim`` may differ from the hidden size. RoPE is rotate-half on HF-ordered rows
(llama.cpp's qwen3 graph is NEOX; its converter does not permute). The head is tied or an
``output.weight``. Ternary Bonsai's embedding and head may be ``q2_0`` blocks (per-64 f16
scales): the backends dequantize embedding rows and compute the head's logits as llama.cpp
does (Q8_0 activations; :mod:`..backend`); the screened head falls back to the full one.
"""

from __future__ import annotations

from .base import Transformer


class Qwen3(Transformer):
    """Qwen3 ternary: :class:`.base.Transformer` with q/k norms, SiLU, no sub-norms."""


__all__ = ["Qwen3"]
