"""The whole BitNet b1.58 forward pass on a wgpu device, one command buffer per token.

The same graph as :class:`~..models.bitnet.BitNet` (FORMATS.md 4.3), each step a kernel, every
dispatch of a token recorded into one compute pass and submitted once::

    embed                         h = E[token]                          (the token's chunk)
    per layer:
      norm_quant                  X = Q8(RMSNorm(h))                    activation block
      matvec q, k, v              q, k, v = X W^T / s * scale
      rope                        RoPE(q), RoPE(k) -> K cache, v -> V cache at pos
      attention                   o = softmax(q K^T / sqrt(d)) V        one workgroup per head
      norm_quant, matvec o        h += Q8(RMSNorm(o)) W_o^T ...         residual in the epilogue
      norm_quant                  X = Q8(RMSNorm(h))
      matvec gate+up (MODE 2)     g = relu(gate)^2 * up                 rans: two mat-vecs, and
      norm_quant                  X = Q8(RMSNorm(g))                    the norm combines them
      matvec down                 h += ...
    norm_quant (QUANT 0)          x = RMSNorm(h)
    lm_head (per chunk)           logits = E x
    argmax                        4 bytes back for greedy decoding

Buffers (activations, the KV cache of ``context`` positions, the cos/sin table) are allocated
and every bind group is made once, at construction; a step writes 16 bytes (token row,
position, length) and submits. The prompt runs token by token (no batched prefill kernel):
its steps are submitted back to back and only the last one computes logits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import RequestError, UnsupportedConversionError
from ..exact_head import Head
from ..models.base import ModelArgs
from ..sampling import Sampler
from .backend import WgpuBackend
from .device import UNIFORM_WORDS, Dispatch


class GpuKVCache:
    """A handle on the GPU-resident KV cache: how many positions it holds (``length``)."""

    def __init__(self, net: WgpuBitNet, max_len: int):
        self.net, self.max_len, self.length = net, max_len, 0

    @property
    def nbytes(self) -> int:
        """Bytes a decode step reads from the cache at its current length."""
        a = self.net.args
        return 2 * self.length * a.n_kv_heads * a.head_dim * 4 * a.n_layers


@dataclass
class TraceEntry:
    """One norm_quant call of a traced step: what the GPU quantized."""

    layer: int
    slot: int  # 0 attn_norm, 1 attn_sub_norm, 2 ffn_norm, 3 ffn_sub_norm
    y: np.ndarray  # f32 [n], the normalized values before quantization
    q: np.ndarray  # int8 [n]
    s: float


@dataclass
class _Norm:
    dispatch: Dispatch
    n: int
    traced: Dispatch | None = None  # the TRACE = 1 variant (quantizing norms)
    trace: Any = None  # buffer the traced variant writes y to
    x_copy: Any = None  # buffer receiving the activation block when tracing (made on demand)


@dataclass
class _Program:
    layers: list[Any] = field(default_factory=list)  # Dispatch | _Norm, in order
    head: list[Dispatch] = field(default_factory=list)
    argmax: Dispatch | None = None


class WgpuBitNet:
    """``forward(tokens, cache)`` -> logits like :class:`~..models.bitnet.BitNet`, on the GPU.

    ``forward_argmax`` returns the greedy next token id instead (4 bytes downloaded).
    ``trace = True`` records every activation quantization (:class:`TraceEntry`) into
    ``trace_log``, one list per step, for tests that compare against the CPU path with the
    same quantized inputs. ``last_step_seconds`` is the host time of the last submitted step
    (submit to readback); :meth:`profile` times every kernel class.
    """

    def __init__(self, args: ModelArgs, backend: WgpuBackend, *, context: int | None = None,
                 progress: Callable[[int, int], None] | None = None, head: str = "full"):
        self.args, self.be, self.dev = args, backend, backend.dev
        self.head = Head(backend, head)  # how decode chooses tokens (exact_head.py)
        self._progress = progress  # (layer, n_layers) as each layer's weights are uploaded
        a, dev = args, backend.dev
        self.max_len = int(min(context or backend.context or a.context_length, a.context_length))
        hd, kvd = a.head_dim, a.n_kv_heads * a.head_dim
        if hd > 256:
            raise UnsupportedConversionError(f"head_dim {hd} > 256 (attention.wgsl)")
        if self.max_len * kvd * 4 > dev.max_binding:
            raise UnsupportedConversionError(f"a layer's KV cache of {self.max_len} positions "
                                             "exceeds a storage binding; pass a smaller context")
        f32 = 4
        self.h = dev.buffer(f32 * a.dim, "h")
        self.q = dev.buffer(f32 * a.dim, "q")
        self.k = dev.buffer(f32 * kvd, "k")
        self.v = dev.buffer(f32 * kvd, "v")
        self.o = dev.buffer(f32 * a.dim, "o")
        self.g = dev.buffer(f32 * a.hidden_dim, "g")
        self.u = dev.buffer(f32 * a.hidden_dim, "u")
        self.logits = dev.buffer(f32 * a.vocab_size, "logits")
        self.result = dev.buffer(16, "argmax")
        self.step = dev.uniform(np.zeros(4, np.uint32), "step")
        self.scores = dev.buffer(f32 * a.n_heads * self.max_len, "scores")
        self.kc = [dev.buffer(f32 * self.max_len * kvd, f"k_cache.{i}") for i in range(a.n_layers)]
        self.vc = [dev.buffer(f32 * self.max_len * kvd, f"v_cache.{i}") for i in range(a.n_layers)]
        inv_freq = 1.0 / a.rope_theta ** (np.arange(0, hd, 2) / hd)  # as BitNet: float64
        ang = np.arange(self.max_len, dtype=np.float32)[:, None] * inv_freq.astype(np.float32)
        self.cs = dev.upload(np.concatenate([np.cos(ang), np.sin(ang)], axis=1), "cos_sin")
        self.logits_stage = dev.staging(f32 * a.vocab_size, "logits.read")
        self.result_stage = dev.staging(8, "argmax.read")
        self.trace = False
        self.trace_log: list[list[TraceEntry]] = []
        self.last_step_seconds = 0.0
        self._owner: GpuKVCache | None = None
        self._embed = backend.embedding.embed_dispatches(self.step, self.h)
        self.prog = self._build()

    # -- construction ----------------------------------------------------------------------------
    def _norm(self, src: Any, gain: str, n: int, *, quant: bool = True, combine: Any = None
              ) -> _Norm:
        dev, be = self.dev, self.be
        gbuf = dev.upload(be.vector(gain).astype(np.float32), gain)
        trace = dev.buffer(4 * n, f"{gain}.trace") if quant else None
        b = combine if combine is not None else src
        nbytes = 4 * n * (3 if combine is not None else 2)
        out = []
        for tr in (0, 1) if quant else (0,):
            k = dev.kernel("norm_quant", N=n, EPS=np.float32(self.args.norm_eps),
                           QUANT=int(quant), COMBINE=int(combine is not None), TRACE=tr)
            grp = dev.bind(k, src, b, gbuf, be.x, trace if quant else be.xf)
            out.append(Dispatch("norm", k, grp, (1, 1, 1), nbytes))
        return _Norm(out[0], n, out[1] if quant else None, trace)

    def _build(self) -> _Program:
        a, dev, be = self.args, self.dev, self.be
        names = {e.name for e in be.model.entries}
        hd, kvd = a.head_dim, a.n_kv_heads * a.head_dim
        prog = _Program()
        rope = dev.kernel("rope", H=a.n_heads, KVH=a.n_kv_heads, HD=hd)
        attn = dev.kernel("attention", H=a.n_heads, KVH=a.n_kv_heads, HD=hd, ML=self.max_len,
                          INV=np.float32(1.0 / np.sqrt(hd)))
        n_rope = a.n_heads * hd // 2 + kvd // 2 + kvd
        for i in range(a.n_layers):
            p = f"blk.{i}."
            if self._progress is not None:
                self._progress(i, a.n_layers)

            def out_scale(n: str, p: str = p) -> float:
                s = f"{p}{n}.scale"
                return float(be.vector(s).reshape(-1)[0]) if s in names else 1.0

            def mv(n: str, y: Any, mode: int, p: str = p) -> list[Dispatch]:
                return be.weight(f"{p}{n}.weight").dispatches(be.x, y, mode, (out_scale(n), 1))

            L = prog.layers
            L.append(self._norm(self.h, f"{p}attn_norm.weight", a.dim))
            L += mv("attn_q", self.q, 0) + mv("attn_k", self.k, 0) + mv("attn_v", self.v, 0)
            L.append(Dispatch("rope", rope, dev.bind(rope, self.q, self.k, self.v, self.cs,
                                                     self.kc[i], self.vc[i], self.step),
                              dev.grid(-(-n_rope // 64)), 4 * (a.dim + 2 * kvd + hd)))
            L.append(Dispatch("attention", attn, dev.bind(attn, self.q, self.kc[i], self.vc[i],
                                                          self.scores, self.o, self.step),
                              (a.n_heads, 1, 1), 4 * a.dim, 2 * 4 * kvd))
            L.append(self._norm(self.o, f"{p}attn_sub_norm.weight", a.dim))
            L += mv("attn_output", self.h, 1)
            L.append(self._norm(self.h, f"{p}ffn_norm.weight", a.dim))
            pair = be.pair(f"{p}ffn_gate.weight", f"{p}ffn_up.weight")
            if pair is not None:
                L += pair.dispatches(be.x, self.g, 2, (out_scale("ffn_gate"),
                                                       out_scale("ffn_up")))
                L.append(self._norm(self.g, f"{p}ffn_sub_norm.weight", a.hidden_dim))
            else:
                L += mv("ffn_gate", self.g, 0) + mv("ffn_up", self.u, 0)
                L.append(self._norm(self.g, f"{p}ffn_sub_norm.weight", a.hidden_dim,
                                    combine=self.u))
            L += mv("ffn_down", self.h, 1)
        L.append(self._norm(self.h, "output_norm.weight", a.dim, quant=False))
        prog.head = be.embedding.head_dispatches(be.xf, self.logits)
        k = dev.kernel("argmax", N=a.vocab_size)
        prog.argmax = Dispatch("argmax", k, dev.bind(k, self.logits, self.result), (1, 1, 1),
                               4 * a.vocab_size)
        return prog

    # -- running --------------------------------------------------------------------------------
    def new_cache(self, max_len: int) -> GpuKVCache:
        if max_len > self.max_len:
            raise RequestError(f"{max_len} positions exceed the {self.max_len} "
                               "this GPU KV cache holds (load with a larger "
                               "context)")
        return GpuKVCache(self, max_len)

    def _items(self, token: int, *, head: bool, argmax: bool) -> list[Any]:
        chunk, _ = self.be.embedding.locate(token)
        items: list[Any] = [self._embed[chunk]]
        for it in self.prog.layers:
            if isinstance(it, _Norm):
                items.append(it.traced if self.trace and it.traced else it.dispatch)
                if self.trace and it.trace is not None:
                    if it.x_copy is None:
                        it.x_copy = self.dev.buffer(4 * UNIFORM_WORDS, "trace.x")
                    items.append((self.be.x, 0, it.x_copy, 0, 4 * UNIFORM_WORDS))
            else:
                items.append(it)
        if head:
            items += self.prog.head
            if argmax:
                items.append(self.prog.argmax)
        return items

    def _check(self, tokens: Sequence[int], cache: GpuKVCache) -> np.ndarray:
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise RequestError("no tokens to run")
        if ids.min() < 0 or ids.max() >= self.args.vocab_size:
            bad = int(ids[(ids < 0) | (ids >= self.args.vocab_size)][0])
            raise RequestError(f"token id {bad} is outside the vocabulary "
                               f"(0..{self.args.vocab_size - 1})")
        if cache.length + ids.size > cache.max_len:
            raise RequestError(f"{cache.length + ids.size} positions exceed the "
                               f"context of {cache.max_len}")
        if cache.length and self._owner is not cache:
            raise RequestError("the GPU holds another sequence's KV cache; "
                               "start this one again")
        self._owner = cache
        return ids

    def _submit(self, token: int, pos: int, *, head: bool, argmax: bool,
                copy_logits: bool) -> None:
        _, row = self.be.embedding.locate(token)
        self.dev.write(self.step, np.array([row, pos, pos + 1, 0], np.uint32))
        copies = []
        if copy_logits:
            copies.append((self.logits, 0, self.logits_stage, 0, 4 * self.args.vocab_size))
        if argmax:
            copies.append((self.result, 0, self.result_stage, 0, 8))
        self.dev.run(self._items(token, head=head, argmax=argmax), copies, wait=False)
        if self.trace:
            self.dev.wait()
            self.trace_log.append(self._read_trace())

    def _read_trace(self) -> list[TraceEntry]:
        out = []
        norms = [it for it in self.prog.layers if isinstance(it, _Norm) and it.trace is not None]
        for i, it in enumerate(norms):
            x = np.frombuffer(self.dev.read(it.x_copy), np.uint32)
            y = np.frombuffer(self.dev.read(it.trace, 4 * it.n), np.float32).copy()
            q = x[256:].view(np.int8)[: it.n].copy()
            out.append(TraceEntry(i // 4, i % 4, y, q, float(x[:1].view(np.float32)[0])))
        return out

    def forward(self, tokens: Sequence[int], cache: GpuKVCache, *,
                all_logits: bool = False) -> np.ndarray:
        """Run ``tokens`` after the cache's positions; logits [T or 1, vocab] (float32)."""
        ids = self._check(tokens, cache)
        rows = []
        t0 = time.perf_counter()
        for i, tok in enumerate(ids):
            want = all_logits or i == ids.size - 1
            self._submit(int(tok), cache.length + i, head=want, argmax=False, copy_logits=want)
            if want:
                raw = self.dev.map_read(self.logits_stage, 4 * self.args.vocab_size)
                rows.append(np.frombuffer(raw, np.float32).copy())
        cache.length += ids.size
        self.last_step_seconds = time.perf_counter() - t0
        return np.stack(rows)

    def forward_argmax(self, tokens: Sequence[int], cache: GpuKVCache) -> int:
        """Run ``tokens``; the argmax of the last logits, computed on the GPU (4 bytes back)."""
        ids = self._check(tokens, cache)
        t0 = time.perf_counter()
        for i, tok in enumerate(ids):
            last = i == ids.size - 1
            self._submit(int(tok), cache.length + i, head=last, argmax=last, copy_logits=False)
        token = int(np.frombuffer(self.dev.map_read(self.result_stage, 4), np.uint32)[0])
        cache.length += ids.size
        self.last_step_seconds = time.perf_counter() - t0
        return token

    def forward_hidden(self, segments: Sequence[Any], *, all_positions: bool = False
                       ) -> np.ndarray:
        """Run one segment's tokens; the last one's final-normed hidden state [1, dim]
        (float32): the bits the device's LM head reads (``dim * 4`` bytes back, no head)."""
        if len(segments) != 1 or all_positions:
            raise RequestError("the wgpu backend runs one sequence at a time, "
                               "the last position's hidden state")
        tokens, cache = segments[0].tokens, segments[0].cache
        ids = self._check(tokens, cache)
        t0 = time.perf_counter()
        for i, tok in enumerate(ids):
            self._submit(int(tok), cache.length + i, head=False, argmax=False,
                         copy_logits=False)
        x = np.frombuffer(self.dev.read(self.be.xf, 4 * self.args.dim), np.float32)
        cache.length += ids.size
        self.last_step_seconds = time.perf_counter() - t0
        return x.reshape(1, -1).copy()

    def decode(self, segments: Sequence[Any], samplers: Sequence[Sampler]) -> list[int]:
        """:meth:`~..models.bitnet.BitNet.decode` for one sequence (the GPU holds one KV cache).

        The screened head (``head.mode``, docs/exact-head.md) reads the final hidden state
        back and chooses with :class:`..exact_head.Head` (the int8 screen and the candidate
        rows run on the device). The full head runs on the device in the step's command
        buffer: greedy choices without a repetition penalty take the argmax on the GPU (4
        bytes back), others read the logits."""
        if len(segments) != 1:
            raise RequestError("the wgpu backend runs one sequence at a time")
        seg, sampler = segments[0], samplers[0]
        head = self.head
        if head.mode == "screened" and not head.unavailable:
            return head.select(self.forward_hidden([seg]), [sampler])
        st = head.stats  # the full head, as Head._full counts it
        st.steps += 1
        st.rows += 1
        st.head_bytes += head.full_bytes
        if head.unavailable:
            st.fallbacks[head.unavailable] += 1
        if sampler.params.greedy and sampler.penalized_ids().size == 0:
            return [self.forward_argmax(seg.tokens, seg.cache)]
        return [sampler.pick(self.forward(seg.tokens, seg.cache)[-1])]

    def generate_greedy(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        """Greedy tokens after ``prompt``, argmax on the GPU (the path generate_step can take)."""
        cache = self.new_cache(len(prompt) + max_new_tokens)
        out = [self.forward_argmax(prompt, cache)]
        while len(out) < max_new_tokens:
            out.append(self.forward_argmax([out[-1]], cache))
        return out

    # -- timing -----------------------------------------------------------------------------------
    def profile(self, length: int = 1, token: int = 0, repeats: int = 3) -> dict[str, Any]:
        """Per kernel class: dispatches, seconds, bytes read and GB/s of one decode step.

        Runs the step at position ``length - 1`` (attending to ``length`` positions), which
        overwrites that cache position: the GPU forgets the current sequence. The kernel times
        are the median of ``repeats`` profiled runs (GPU timestamps where the adapter has them,
        else host timing of each dispatch alone); ``token_seconds`` is the median wall time of
        the same step run normally (one submit, argmax read back).
        """
        if not 1 <= length <= self.max_len:
            raise RequestError(f"length must be in 1..{self.max_len}")
        self._owner = None
        _, row = self.be.embedding.locate(token)
        self.dev.write(self.step, np.array([row, length - 1, length, 0], np.uint32))
        trace, self.trace = self.trace, False
        try:
            items = [d for d in self._items(token, head=True, argmax=True)
                     if isinstance(d, Dispatch)]
            runs = [self.dev.profile(items) for _ in range(max(1, repeats))]
            walls = []
            for _ in range(max(1, repeats)):
                t0 = time.perf_counter()
                self._submit(token, length - 1, head=True, argmax=True, copy_logits=False)
                self.dev.map_read(self.result_stage, 4)
                walls.append(time.perf_counter() - t0)
        finally:
            self.trace = trace
            self._owner = None
        secs = np.median(np.array([r[0] for r in runs]), axis=0)
        kinds: dict[str, dict[str, float]] = {}
        for d, s in zip(items, secs, strict=True):
            k = kinds.setdefault(d.kind, {"dispatches": 0, "seconds": 0.0, "bytes": 0})
            k["dispatches"] += 1
            k["seconds"] += float(s)
            k["bytes"] += d.nbytes + d.nbytes_per_pos * length
        for k in kinds.values():
            k["gbps"] = k["bytes"] / k["seconds"] / 1e9 if k["seconds"] else 0.0
        return {"device": self.dev.name, "clock": runs[0][1], "length": length,
                "kinds": kinds, "gpu_seconds": float(secs.sum()),
                "token_seconds": float(np.median(walls)),
                "weight_bytes": int(sum(k["bytes"] for n, k in kinds.items()
                                        if n.startswith("matvec") or n == "lm_head"))}


__all__ = ["GpuKVCache", "TraceEntry", "WgpuBitNet"]
