"""A float64 numpy transcription of llama.cpp's graphs for the ternary families bitformat writes
(``bitnet``: src/models/bitnet.cpp, ``qwen3``: src/models/qwen3.cpp), rounding where ggml's
CPU backend rounds, so that llama.cpp's logits on a file can be checked tightly
(tests/test_llama_cpp.py, tests/test_bonsai.py).

It reads only the tensors' stored values: q2_0 blocks (projections, and Ternary Bonsai's
embedding and head) are dequantized here from their bytes, as ggml's ``dequantize_row_q2_0``
does; other ternary containers through bitformat's decoder.

``act`` rounds the input of every ternary projection: :func:`q8_0` as llama.cpp does for q2_0
weights (the ``vec_dot_type`` of Q2_0; the products then summed exactly, float64 instead of
ggml's float32 block sums), :func:`absmax_int8` as bitformat's backends do (BitNet's per-token
quantization). With ``ggml=True`` attention rounds as ggml's does with ``flash_attn=False``: K
and V sit in an f16 cache and the products with them convert their other operand to f16 (Q
for K·Q, the softmax probabilities for V·P, the ``vec_dot_type`` of F16), and an f16 head
takes an f16 input; with ``ggml=False`` attention is plain float64. A q2_0 head takes Q8_0
input either way (llama.cpp and bitformat alike).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from bitformat.constants import GGMLType
from bitformat.runtime.backend import attention, rms_norm, rope


def q8_0(x: np.ndarray) -> np.ndarray:
    """ggml's Q8_0 rounding of activations as its x86 build does it (ggml-cpu/arch/x86/quants.c
    ``quantize_row_q8_0``): per 32 float32 values, d = max|x| / 127 stored as f16, q =
    round-half-even(x * (127 / max|x|)); what a Q2_0 mat-vec multiplies."""
    b = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(b).max(axis=-1, keepdims=True)
    d = (amax / np.float32(127)).astype(np.float16).astype(np.float64)
    inv = np.float32(127) / np.where(amax > 0, amax, np.float32(1))
    q = np.rint(b * np.where(amax > 0, inv, np.float32(0)))
    return (q * d).reshape(x.shape)


def absmax_int8(x: np.ndarray) -> np.ndarray:
    """BitNet's activation quantization, per token: s = 127 / max(max|x|, 1e-5), q =
    clamp(round-half-even(x s), -128, 127); returns q / s (what bitformat's BitLinear uses)."""
    s = 127.0 / np.maximum(np.abs(x).max(axis=-1, keepdims=True), 1e-5)
    return np.clip(np.rint(x * s), -128, 127) / s


def f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float64)


def dequantize_q2_0(raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """q2_0 blocks (an f16 d, 16 bytes of 2-bit codes, element j at bits 2(j % 4) of byte
    j / 4) as float64 ``(code - 1) * d``, as ggml's ``dequantize_row_q2_0``."""
    blocks = np.asarray(raw, np.uint8).reshape(-1, 18)
    d = blocks[:, :2].copy().view("<f2").astype(np.float64)  # [n, 1]
    codes = (blocks[:, 2:, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3  # [n, 16, 4]
    return ((codes.reshape(-1, 64).astype(np.float64) - 1) * d).reshape(shape)


def attention_ggml(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Causal GQA as ggml's CPU backend does it without flash attention (llama.cpp's
    ``build_attn_mha``): K and V come from the f16 cache, K·Q converts Q to f16 (the
    ``vec_dot_type`` of F16), the softmax runs in float32 and V·P converts P to f16."""
    T, H, d = q.shape
    rep = H // k.shape[1]
    kk, vv = np.repeat(f16(k), rep, axis=1), np.repeat(f16(v), rep, axis=1)
    s = np.einsum("thd,shd->hts", f16(q), kk) / np.sqrt(d)
    s[:, np.triu(np.ones((T, T), bool), 1)] = -np.inf
    p = np.exp(s - s.max(-1, keepdims=True))
    p = f16(p / p.sum(-1, keepdims=True))
    return np.einsum("hts,shd->thd", p, vv).reshape(T, H * d)


#: ``(layer, q, k, v) -> (q, k, v)``
QKVHook = Callable[[int, np.ndarray, np.ndarray, np.ndarray],
                   tuple[np.ndarray, np.ndarray, np.ndarray]]


class Weights:
    """A model's tensors as float64 arrays (each read once), and which of them are q2_0."""

    def __init__(self, model):
        self.model = model
        self._cache: dict[str, np.ndarray] = {}
        self.names = {e.name for e in model.entries}

    def q2_0(self, name: str) -> bool:
        return self.model.entry(name).encoding in ("q2_0", "Q2_0")

    def f16(self, name: str) -> bool:
        return self.model.entry(name).encoding == "F16"

    def __call__(self, name: str) -> np.ndarray:
        if name not in self._cache:
            e = self.model.entry(name)
            if self.q2_0(name):
                a = dequantize_q2_0(self.model.plain(name)[1], e.shape)
            elif e.ternary:
                a = self.model.ternary(name).dense(np.float64)
            else:
                gt, raw = self.model.plain(name)
                a = raw.view("<f4" if gt == GGMLType.F32 else "<f2").astype(
                    np.float64).reshape(e.shape)
            self._cache[name] = a
        return self._cache[name]


def reference(model, prompt: Sequence[int], steps: int,
              act: Callable[[np.ndarray], np.ndarray] = lambda x: x,
              forced: Sequence[int] | None = None, ggml: bool = False,
              weights: Weights | None = None,
              qkv: QKVHook | None = None) -> tuple[list[int], list[np.ndarray]]:
    """float64 forward pass of llama.cpp's graph of ``model``'s architecture (``bitnet``:
    sub-norms; ``qwen3``: q/k norms, head size ``key_length``; NEOX RoPE and a SiLU-gated FFN
    in both). ``act`` rounds the input of every ternary projection; ``ggml``: the roundings of
    the module docstring; ``forced``: the tokens fed after each step (default: the greedy
    ones); ``qkv(layer, q, k, v) -> (q, k, v)``: sees (and may replace) each layer's Q and K
    (after RoPE) and V of all positions ([T, heads or kv heads, head size]) before
    attention. Greedy tokens and each step's logits."""
    g = model.get
    a = str(g("general.architecture")) + "."
    n_layer, n_head, n_kv = g(a + "block_count"), g(a + "attention.head_count"), g(
        a + "attention.head_count_kv")
    eps, base = g(a + "attention.layer_norm_rms_epsilon"), g(a + "rope.freq_base")
    w = weights or Weights(model)
    head = "output.weight" if "output.weight" in w.names else "token_embd.weight"
    E = w("token_embd.weight")
    hd = g(a + "attention.key_length") or E.shape[1] // n_head
    sub = "blk.0.attn_sub_norm.weight" in w.names
    qk_norm = "blk.0.attn_q_norm.weight" in w.names
    inv = 1.0 / base ** (np.arange(0, hd, 2, dtype=np.float64) / hd)

    def head_input(hn):
        if w.q2_0(head):
            return q8_0(hn)  # ggml and bitformat alike
        return f16(hn) if ggml and w.f16(head) else hn

    ids = list(prompt)
    out, logs = [], []
    for step in range(steps):
        T = len(ids)
        ang = np.arange(T)[:, None] * inv[None, :]
        cos, sin = np.cos(ang), np.sin(ang)
        x = E[ids]
        for i in range(n_layer):
            b = f"blk.{i}."

            def lin(name, x, b=b):
                return act(x) @ w(b + name + ".weight").T

            h = rms_norm(x, w(b + "attn_norm.weight"), eps)
            q, k = lin("attn_q", h).reshape(T, n_head, hd), lin("attn_k", h).reshape(T, n_kv, hd)
            v = lin("attn_v", h).reshape(T, n_kv, hd)
            if qk_norm:
                q = rms_norm(q, w(b + "attn_q_norm.weight"), eps)
                k = rms_norm(k, w(b + "attn_k_norm.weight"), eps)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            if qkv is not None:
                q, k, v = qkv(i, q, k, v)
            o = attention_ggml(q, k, v) if ggml else attention(q, k, v, 0)
            if sub:
                o = rms_norm(o, w(b + "attn_sub_norm.weight"), eps)
            x = x + lin("attn_output", o)
            h = rms_norm(x, w(b + "ffn_norm.weight"), eps)
            gate, up = lin("ffn_gate", h), lin("ffn_up", h)
            f = gate / (1 + np.exp(-gate)) * up
            if sub:
                f = rms_norm(f, w(b + "ffn_sub_norm.weight"), eps)
            x = x + lin("ffn_down", f)
        hn = rms_norm(x[-1:], w("output_norm.weight"), eps)
        logits = head_input(hn) @ w(head).T
        logs.append(logits[0])
        out.append(int(np.argmax(logits[0])))
        ids.append(out[-1] if forced is None else forced[step])
    return out, logs
