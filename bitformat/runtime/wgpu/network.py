"""The whole forward pass of every family on a wgpu device: a few fused dispatches a layer.

The family's layer as :mod:`bitformat.graph` describes it, lowered onto these kernels
(:func:`~bitformat.graph.decoder_shape` reads the norms, q/k handling and activation back
from the graph's steps, and a step they do not compute is refused by name; docs/gpu.md, "The
decode step"), every dispatch of a token recorded into one compute pass and submitted once::

    embed_step                 h = E[state.token]                    (each embedding chunk)
    per layer:
      fused_matvec  q|k|v      q, k, v = Q8(RMSNorm(h)) [Wq; Wk; Wv]^T / s * scale
      attn_split               q/k norms (Qwen3), RoPE, K/V cache write at state.pos, and
                               softmax attention over runs of positions (flash-decoding)
      attn_merge               o = the runs combined
      fused_matvec  o          h += Q8(RMSNorm_sub(o)) Wo^T ...      (no sub-norm: Q8(o))
      fused_matvec  gate|up    g = act(gate) * up                    (relu^2 or silu)
      fused_matvec  down       h += Q8(RMSNorm_sub(g)) Wd^T ...
    norm_block (f32)           x = RMSNorm(h)
    lm_head_step               logits = H x, and each workgroup's largest logit
    argmax_step                the greedy token, written into the state for the next step

``fused_matvec`` normalizes and quantizes its input in every workgroup (no separate norm
dispatch), so a layer is 6 dispatches and a 2B-4T token 184. A matrix without a row kernel
of its own (rans decoded in the kernels, ``decode="fused"``) gets a ``norm_block`` dispatch
that writes the activation block and its own kernels instead.

The token never leaves the device during greedy decoding: ``argmax_step`` writes the chosen
id and the next position into the state buffer that the next step's kernels read, so the host
submits step t + 1 before it reads step t's token (4 bytes, from a ring of mapped buffers) and
decoding costs max(host, GPU) per token rather than their sum. Per step the host only records
the dispatches, calling wgpu-native's functions directly (:meth:`GpuDevice.encode_raw`).

Buffers (activations, the KV cache of ``context`` positions, the cos/sin table, the attention
runs), pipelines and bind groups are made once, at construction.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import RequestError, UnsupportedConversionError
from ...graph import NotLowerable, decoder_shape
from ..head import Head
from ..models.base import ModelArgs
from ..sampling import Sampler
from .backend import GpuMatrix, WgpuBackend, fused_subs
from .device import Dispatch
from .head import CAP as SCREEN_CAP
from .head import NONE as SCREEN_NONE

#: attention runs: at least SPLIT positions each, up to SPAR runs while a run would exceed
#: SPLIT, at most CMAX positions a run (attn_merge.wgsl)
SPLIT, SPAR, CMAX = 32, 32, 256
RING = 4  # mapped buffers the greedy tokens come back through


def _label(items: list[Dispatch], mark: int, name: str) -> int:
    """Name the step part of the dispatches added since ``mark``; the new mark."""
    for d in items[mark:]:
        d.label = d.label or name
    return len(items)


def splits(length: int, split: int = SPLIT) -> int:
    """How many runs a step attending to ``length`` positions splits them into (at least
    ``split`` positions a run)."""
    return max(min(-(-length // split), SPAR), -(-length // CMAX))


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
    """One activation quantization of a traced step: what the GPU quantized."""

    layer: int
    slot: int  # 0 attention input, 1 o_proj input, 2 FFN input, 3 down_proj input
    y: np.ndarray  # f32 [n], the values before quantization (normalized where there is a norm)
    q: np.ndarray  # int8 [n]
    s: float


@dataclass
class _Program:
    layers: list[list[Dispatch]] = field(default_factory=list)
    attention: list[int] = field(default_factory=list)  # (flat) indices of attn_split dispatches
    norm: Dispatch | None = None  # the final RMSNorm (f32)
    head: list[Dispatch] = field(default_factory=list)  # lm_head_step per chunk
    argmax: Dispatch | None = None  # argmax_step, state untouched
    argmax_step: Dispatch | None = None  # argmax_step that also advances the state
    traces: list[tuple[int, int, Any, int]] = field(default_factory=list)  # layer, slot, buf, n


@dataclass
class _Batch:
    """The batched prompt's dispatches: (dispatch, axis) with axis "z" (grid z = tokens),
    "tN" (grid z = groups of N tokens: matmat_i2_s), "y" (grid y = tokens: attn_merge) or
    "split" (attn_split: runs in y, tokens in z)."""

    items: list[tuple[Dispatch, str]] = field(default_factory=list)
    tokens: int = 0  # tokens a chunk holds at most


@dataclass
class _Pending:
    """A greedy step submitted ahead: its cache, the position it runs, its readback slot."""

    cache: GpuKVCache
    pos: int
    slot: int
    token: int | None = None  # the token it embeds (known once the previous step is read)
    index: int = 0  # its submission (GpuDevice.submit): reading it waits for it alone


#: the KV cache types the fused step keeps, as kv_round.wgsl's KVT (q8_0 runs op by op)
KV_ROUND = {"f32": 0, "f16": 1}


class WgpuBitNet:
    """``forward(tokens, cache)`` -> logits like :class:`~..models.base.Transformer`, on the
    GPU, for every family (BitNet 2B-4T and 1bitLLM, Llama, Qwen3).

    ``forward_argmax`` returns the greedy next token id (computed on the device, 12 bytes back);
    :meth:`decode` with a greedy sampler keeps one step in flight ahead of the caller.
    ``trace = True`` records every activation quantization (:class:`TraceEntry`) into
    ``trace_log``, one list per step, for tests that compare against the CPU path with the
    same quantized inputs. ``last_step_seconds`` is the host time of the last call;
    ``host_seconds`` / ``host_steps`` the host time spent recording and submitting steps;
    :meth:`profile` times every kernel class.
    """

    def __init__(self, args: ModelArgs, backend: WgpuBackend, *, context: int | None = None,
                 progress: Callable[[int, int], None] | None = None, head: str = "full",
                 kv_type: str = "f32"):
        self.args, self.be, self.dev = args, backend, backend.dev
        dev, a = backend.dev, args
        if kv_type not in KV_ROUND:
            raise UnsupportedConversionError(f"the fused wgpu step keeps no {kv_type} KV cache")
        #: the cache type (runtime/kvquant.py): its values as kv_round.wgsl rounds them, held
        #: in float32 slots on the device
        self.kv_type = kv_type
        if not dev.subgroups:
            raise UnsupportedConversionError(
                f"the fused decode step needs subgroup operations, which {dev.name} lacks; "
                "the model runs op by op")
        try:  # the family's layer, lowered onto these kernels (module text)
            self.shape = decoder_shape(a.family.graph)
        except NotLowerable as e:
            raise UnsupportedConversionError(f"the {a.family.id} layer does not lower onto the "
                                             f"wgpu network's kernels: {e}") from None
        self.head = Head(backend, head)  # how decode chooses tokens (runtime/head.py)
        self._progress = progress  # (layer, n_layers) as each layer's weights are uploaded
        self.max_len = int(min(context or backend.context or a.context_length,
                               a.context_length))
        hd, kvd = a.head_dim, a.n_kv_heads * a.head_dim
        self.gq = a.n_heads // a.n_kv_heads
        if hd % 4 or hd > 256 or self.gq > 16:
            raise UnsupportedConversionError(f"head size {hd} x {self.gq} query heads per kv "
                                             "head is beyond attn_split.wgsl")
        if self.max_len * kvd * 4 > dev.max_binding:
            raise UnsupportedConversionError(f"a layer's KV cache of {self.max_len} positions "
                                             "exceeds a storage binding; pass a smaller context")
        f32, nq = 4, a.n_heads * hd
        #: positions a run of attention takes at least (tuning ``split``, default SPLIT)
        self.split = max(1, int(dev.tuning.get("split", SPLIT)))
        self.smax = splits(self.max_len, self.split)
        self.h = dev.buffer(f32 * a.dim, "h")
        self.qkv = dev.buffer(f32 * (nq + 2 * kvd), "qkv")
        self.o = dev.buffer(f32 * nq, "o")
        self.g = dev.buffer(f32 * a.hidden_dim, "g")
        self.u = dev.buffer(f32 * a.hidden_dim, "u")
        self.logits = dev.buffer(f32 * a.vocab_size, "logits")
        self.result = dev.buffer(16, "argmax")
        self._tb = max(1, int(dev.tuning.get("batch", 128)))  # a batched prompt's chunk
        self.state = dev.buffer(16 + 4 * self._tb, "state")
        self.part = dev.buffer(f32 * a.n_heads * self.smax * (hd + 4), "attention runs")
        self.kc = [dev.buffer(f32 * self.max_len * kvd, f"k_cache.{i}") for i in range(a.n_layers)]
        self.vc = [dev.buffer(f32 * self.max_len * kvd, f"v_cache.{i}") for i in range(a.n_layers)]
        inv_freq = 1.0 / a.rope_theta ** (np.arange(0, hd, 2) / hd)  # as the models: float64
        ang = np.arange(self.max_len, dtype=np.float32)[:, None] * inv_freq.astype(np.float32)
        self.cs = dev.upload(np.concatenate([np.cos(ang), np.sin(ang)], axis=1), "cos_sin")
        self.logits_stage = dev.staging(f32 * a.vocab_size, "logits.read")
        self.result_stage = dev.staging(8, "argmax.read")
        self.ring = [dev.staging(16, f"token.read.{i}") for i in range(RING)]
        self._ring_at = 0
        self.trace = False
        self.trace_log: list[list[TraceEntry]] = []
        self.last_step_seconds = 0.0
        self.host_seconds, self.host_steps = 0.0, 0
        self._owner: GpuKVCache | None = None
        self._pending: _Pending | None = None
        self._names = {e.name for e in backend.model.entries}
        self._embed = backend.embedding.embed_dispatches(self.state, self.h)
        self.prog = self._build(trace=False)
        #: the screened head's greedy step on the device (GpuScreenedHead.step_dispatches):
        #: head "screened" where the backend has its tables; tuning ``screen_cap=N`` lists at
        #: most N candidates (0: the full head runs every step, for tests and comparisons)
        self.screen = None
        self.last_candidates = 0
        self.screening()  # made now where the head is screened (pipelines compile at load)
        self._traced: _Program | None = None
        self._batch: _Batch | None | bool = None  # built on the first prompt (False: cannot)

    # -- construction ----------------------------------------------------------------------------
    def _vec(self, name: str) -> Any:
        return self.dev.upload(self.be.vector(name).astype(np.float32), name)

    def _out_scale(self, name: str) -> float:
        s = f"{name}.scale"
        return float(self.be.vector(s).reshape(-1)[0]) if s in self._names else 1.0

    def _norm_block(self, src: Any, gain: Any, n: int, *, quant: bool, norm: bool = True,
                    combine: Any = None, trace: Any = None, out: Any = None,
                    blocks: Any = None) -> Dispatch:
        """One workgroup a vector: the activation block of ``src`` into the backend's X
        (``quant``; both layouts, for the op-by-op kernels) or, with ``blocks``, each token's
        plain-layout block into ``blocks`` (a batched prompt's mat-mats); or the f32 RMSNorm
        into ``out``."""
        dev, a = self.dev, self.args
        subs = fused_subs("", n)
        if blocks is None:
            subs["XV4"] = str(64 + 2 * (-(-n // 256) * 16))  # both layouts
        k = dev.kernel("norm_block", subs, COLS=n, QUANT=int(quant),
                       NORM=int(norm), COMBINE=int(combine is not None),
                       ACT=int(self.shape.activation == "silu"), EPS=np.float32(a.norm_eps),
                       LAYOUT=2 if blocks is None else 0, TRACE=int(trace is not None))
        q = blocks if blocks is not None else self.be.x if quant else dev.scratch
        g = dev.bind(k, src, combine if combine is not None else src,
                     gain if gain is not None else src, q,
                     out if out is not None else dev.scratch,
                     trace if trace is not None else dev.scratch)
        return Dispatch("norm", k, g, (1, 1, 1), 4 * n * (2 + (combine is not None)))

    def _project(self, mats: list[tuple[Any, Any, tuple[float, float]]], src: Any, gain: Any,
                 mode: int, *, norm: bool, trace: Any, combine: Any = None, part: str = ""
                 ) -> list[Dispatch]:
        """The dispatches of matrices that read one input: ``mats`` = (GpuMatrix or GpuRans,
        output binding, out scales) each. On a device that fuses (``dev.fused``) row matrices
        quantize their input themselves; otherwise (CPU adapters, rans matrices) one
        ``norm_block`` writes the activation block and the op-by-op kernels read it."""
        a, out = self.args, []
        act = int(self.shape.activation == "silu")
        n = mats[0][0].cols
        block_done = False
        for m, y, osc in mats:
            if isinstance(m, GpuMatrix) and self.dev.fused:
                out += m.fused_dispatches(src, gain, y, mode, norm=norm, act=act,
                                          eps=a.norm_eps, combine=combine, trace=trace,
                                          out_scales=list(osc) * 2, part=part)
            else:
                if not block_done:
                    out.append(self._norm_block(src, gain, n, quant=True, norm=norm,
                                                combine=combine, trace=trace))
                    block_done = True
                out += m.dispatches(self.be.x, y, mode, osc)
            trace = None  # one quantization traced per input
        return out

    def _trace_buf(self, prog: _Program, layer: int, slot: int, n: int, on: bool) -> Any:
        if not on:
            return None
        buf = self.dev.buffer(4 * (4 + n + -(-n // 256) * 64), f"trace.{layer}.{slot}")
        prog.traces.append((layer, slot, buf, n))
        return buf

    def _build(self, *, trace: bool) -> _Program:
        a, dev, be, sh = self.args, self.dev, self.be, self.shape
        hd, kvd, nq = a.head_dim, a.n_kv_heads * a.head_dim, a.n_heads * a.head_dim
        prog = _Program()
        perm = int(sh.interleaved_qk)
        asub = {"QS4": str(self.gq * hd // 4), "SCN": str(self.gq * CMAX)}
        attn = dev.kernel("attn_split", asub, H=a.n_heads, KVH=a.n_kv_heads, HD=hd,
                          ML=self.max_len, INV=np.float32(1.0 / np.sqrt(hd)),
                          QKN=int(sh.qk_norm is not None), PERM=perm,
                          EPS=np.float32(a.norm_eps), SMAX=self.smax, CMAX=CMAX,
                          KVT=KV_ROUND[self.kv_type])
        merge = dev.kernel("attn_merge", HD=hd, SMAX=self.smax, SPLIT=self.split, SPAR=SPAR,
                           CMAX=CMAX)
        merge_d = Dispatch("attention", merge, dev.bind(merge, self.part, self.state, self.o),
                           (a.n_heads, 1, 1), 4 * a.n_heads * (hd + 4), label="attn_merge")
        at = len(self._embed)
        for i in range(a.n_layers):
            p = f"blk.{i}."
            if self._progress is not None and not trace:
                self._progress(i, a.n_layers)
            L: list[Dispatch] = []
            mark = 0
            names = [f"{p}{x}.weight" for x in sh.qkv]
            tr = self._trace_buf(prog, i, 0, a.dim, trace)
            stack = be.stacked(names) if dev.fused else None
            if stack is not None:
                osc = [self._out_scale(n[:-7]) for n in names]
                L += stack.fused_dispatches(self.h, self._gain(f"{p}{sh.attn_norm}.weight"),
                                            self.qkv, 0, norm=True, eps=a.norm_eps,
                                            trace=tr, out_scales=osc + [1.0], part="qkv")
            else:
                offs = (0, nq, nq + kvd, nq + 2 * kvd)
                ys = [(self.qkv, 4 * offs[j], 4 * (offs[j + 1] - offs[j])) for j in range(3)]
                L += self._project([(be.weight(n), y, (self._out_scale(n[:-7]), 1.0))
                                    for n, y in zip(names, ys, strict=True)],
                                   self.h, self._gain(f"{p}{sh.attn_norm}.weight"), 0,
                                   norm=True, trace=tr, part="qkv")
            mark = _label(L, mark, "qkv")
            ng = self._qk_gains(p) if sh.qk_norm else self.cs
            prog.attention.append(at + sum(map(len, prog.layers)) + len(L))
            L.append(Dispatch("attention", attn,
                              dev.bind(attn, self.qkv, self.kc[i], self.vc[i], self.cs,
                                       self.state, self.part, ng),
                              (a.n_kv_heads, 1, 1), 4 * (nq + 2 * kvd), 2 * 4 * kvd,
                              "attn_split"))
            sub = sh.attn_sub_norm
            tr = self._trace_buf(prog, i, 1, nq, trace)
            wo = be.weight(f"{p}{sh.out}.weight")
            ogain = self._gain(f"{p}{sub}.weight") if sub else None
            if self._fold_merge(wo):  # the o projection merges the runs itself
                mark = len(L)
                L += wo.fused_dispatches(self.part, ogain, self.h, 1, norm=sub is not None,
                                         act=int(sh.activation == "silu"), eps=a.norm_eps,
                                         combine=self.state, trace=tr, part="o",
                                         out_scales=[self._out_scale(f"{p}{sh.out}")] * 4,
                                         merge={"HD": hd, "SMAX": self.smax, "SPLIT": self.split,
                                                "SPAR": SPAR, "CMAX": CMAX})
            else:
                L.append(merge_d)
                mark = len(L)
                L += self._project([(wo, self.h, (self._out_scale(f"{p}{sh.out}"), 1.0))],
                                   self.o, ogain, 1, norm=sub is not None, trace=tr, part="o")
            mark = _label(L, mark, "o")
            tr = self._trace_buf(prog, i, 2, a.dim, trace)
            # the op-by-op pair kernel's epilogue is relu^2 only
            gname, uname = sh.gate_up
            pair = be.pair(f"{p}{gname}.weight", f"{p}{uname}.weight") \
                if dev.fused or sh.activation == "relu2" else None
            combine = None
            gu = (self._out_scale(f"{p}{gname}"), self._out_scale(f"{p}{uname}"))
            fgain = self._gain(f"{p}{sh.ffn_norm}.weight")
            if pair is not None:
                L += self._project([(pair, self.g, gu)], self.h, fgain, 2, norm=True, trace=tr,
                                   part="gate_up")
            else:
                L += self._project([(be.weight(f"{p}{gname}.weight"), self.g, (gu[0], 1.0)),
                                    (be.weight(f"{p}{uname}.weight"), self.u, (gu[1], 1.0))],
                                   self.h, fgain, 0, norm=True, trace=tr, part="gate_up")
                combine = self.u
            mark = _label(L, mark, "gate_up")
            tr = self._trace_buf(prog, i, 3, a.hidden_dim, trace)
            sub = sh.ffn_sub_norm
            L += self._project([(be.weight(f"{p}{sh.down}.weight"), self.h,
                                 (self._out_scale(f"{p}{sh.down}"), 1.0))], self.g,
                               self._gain(f"{p}{sub}.weight") if sub else None, 1,
                               norm=sub is not None, trace=tr, combine=combine, part="down")
            mark = _label(L, mark, "down")
            prog.layers.append(L)
        prog.norm = self._norm_block(self.h, self._gain("output_norm.weight"), a.dim,
                                     quant=False, out=be.xf)
        npart = self.be.head.n_parts
        if not hasattr(self, "head_parts"):
            self.head_parts = dev.buffer(8 * npart, "head maxima")
        prog.head = self.be.head.head_dispatches(self.be.xf, self.logits, self.head_parts)
        for step in (0, 1):
            k = dev.kernel("argmax_step", N=npart, STEP=step)
            d = Dispatch("argmax", k, dev.bind(k, self.head_parts, self.result, self.state),
                         (1, 1, 1), 8 * npart)
            if step:
                prog.argmax_step = d
            else:
                prog.argmax = d
        return prog

    def _fold_merge(self, wo: Any) -> bool:
        """Whether the o projection merges attention's runs in its prologue (COMBINE = 2 of
        quant_prologue.wgsl) instead of an attn_merge dispatch before it: fused row matrices,
        at most 128 heads; tuning ``fold=0`` keeps the merge dispatch (for comparisons)."""
        return (self.dev.fused and isinstance(wo, GpuMatrix) and self.args.n_heads <= 128
                and bool(self.dev.tuning.get("fold", 1)))

    def _gain(self, name: str) -> Any:
        cache = self.__dict__.setdefault("_gains", {})
        if name not in cache:
            cache[name] = self._vec(name)
        return cache[name]

    def _qk_gains(self, p: str) -> Any:
        a = self.args
        qn, kn = self.shape.qk_norm
        g = np.concatenate([self.be.vector(f"{p}{qn}.weight").reshape(-1),
                            self.be.vector(f"{p}{kn}.weight").reshape(-1)])
        if g.size != 2 * a.head_dim:
            raise UnsupportedConversionError(f"{p}{qn}/{kn}: {g.size} gains, "
                                             f"expected 2 x {a.head_dim}")
        return self.dev.upload(g.astype(np.float32), f"{p}qk_norm")

    def _build_batch(self) -> _Batch | None:
        """The batched prompt (every projection fused, every q|k|v stacked and gate|up
        paired), or None where one is not (those prompts run token by token)."""
        a, dev, be, sh = self.args, self.dev, self.be, self.shape
        hd, kvd, nq = a.head_dim, a.n_kv_heads * a.head_dim, a.n_heads * a.head_dim
        stacks, pairs, outs, downs = [], [], [], []
        for i in range(a.n_layers):
            p = f"blk.{i}."
            stacks.append(be.stacked([f"{p}{x}.weight" for x in sh.qkv]))
            pairs.append(be.pair(*(f"{p}{x}.weight" for x in sh.gate_up)))
            outs.append(be.weight(f"{p}{sh.out}.weight"))
            downs.append(be.weight(f"{p}{sh.down}.weight"))
        if any(x is None or not isinstance(x, GpuMatrix)
               for x in (*stacks, *pairs, *outs, *downs)):
            return None
        tb = self._tb
        f32, qkvs = 4, nq + 2 * kvd
        self.hb = dev.buffer(f32 * tb * a.dim, "h.batch")
        self.qkvb = dev.buffer(f32 * tb * qkvs, "qkv.batch")
        self.ob = dev.buffer(f32 * tb * nq, "o.batch")
        self.gb = dev.buffer(f32 * tb * a.hidden_dim, "g.batch")
        self.partb = dev.buffer(f32 * tb * a.n_heads * self.smax * (hd + 4), "runs.batch")
        widest = max(a.dim, nq, a.hidden_dim)
        self.qb = dev.buffer(16 * tb * int(fused_subs("", widest)["XV4"]), "blocks.batch")
        b = _Batch(tokens=tb)
        for d in be.embedding.embed_dispatches(self.state, self.hb, batch=True):
            b.items.append((d, "z"))
        perm, qkn = int(sh.interleaved_qk), int(sh.qk_norm is not None)
        asub = {"QS4": str(self.gq * hd // 4), "SCN": str(self.gq * CMAX)}
        attn = dev.kernel("attn_split", asub, H=a.n_heads, KVH=a.n_kv_heads, HD=hd,
                          ML=self.max_len, INV=np.float32(1.0 / np.sqrt(hd)), QKN=qkn,
                          PERM=perm, EPS=np.float32(a.norm_eps), SMAX=self.smax, CMAX=CMAX,
                          BATCH=1, QKVS=qkvs, KVT=KV_ROUND[self.kv_type])
        kvw = dev.kernel("kv_write", H=a.n_heads, KVH=a.n_kv_heads, HD=hd, QKN=qkn, PERM=perm,
                         EPS=np.float32(a.norm_eps), QKVS=qkvs, KVT=KV_ROUND[self.kv_type])
        merge = dev.kernel("attn_merge", HD=hd, SMAX=self.smax, SPLIT=self.split, SPAR=SPAR,
                           CMAX=CMAX)
        merge_d = Dispatch("attention", merge, dev.bind(merge, self.partb, self.state, self.ob),
                           (a.n_heads, 1, 1), 4 * a.n_heads * (hd + 4))
        osub, dsub = sh.attn_sub_norm, sh.ffn_sub_norm
        for i in range(a.n_layers):
            p = f"blk.{i}."
            names = [f"{p}{x}" for x in sh.qkv]
            b.items += self._batch_project(
                stacks[i], self.hb, self._gain(f"{p}{sh.attn_norm}.weight"), self.qkvb, 0,
                norm=True, ys=qkvs, part="qkv",
                out_scales=[self._out_scale(n) for n in names] + [1.0])
            ng = self._qk_gains(p) if qkn else self.cs
            b.items.append((Dispatch("attention", kvw, dev.bind(kvw, self.qkvb, self.kc[i],
                                                                self.vc[i], self.cs,
                                                                self.state, ng),
                                     (a.n_kv_heads, 1, 1), 4 * 2 * kvd), "z"))
            b.items.append((Dispatch("attention", attn,
                                     dev.bind(attn, self.qkvb, self.kc[i], self.vc[i], self.cs,
                                              self.state, self.partb, ng),
                                     (a.n_kv_heads, 1, 1), 4 * qkvs, 2 * 4 * kvd), "split"))
            b.items.append((merge_d, "y"))
            b.items += self._batch_project(
                outs[i], self.ob, self._gain(f"{p}{osub}.weight") if osub else None, self.hb,
                1, norm=osub is not None, ys=a.dim, part="o",
                out_scales=[self._out_scale(f"{p}{sh.out}")] * 4)
            b.items += self._batch_project(
                pairs[i], self.hb, self._gain(f"{p}{sh.ffn_norm}.weight"), self.gb, 2,
                norm=True, ys=a.hidden_dim, part="gate_up",
                out_scales=tuple(self._out_scale(f"{p}{x}") for x in sh.gate_up))
            b.items += self._batch_project(
                downs[i], self.gb, self._gain(f"{p}{dsub}.weight") if dsub else None, self.hb,
                1, norm=dsub is not None, ys=a.dim, part="down",
                out_scales=[self._out_scale(f"{p}{sh.down}")] * 4)
        return b

    def _batch_project(self, m: GpuMatrix, src: Any, gain: Any, y: Any, mode: int, *,
                       norm: bool, ys: int, part: str, out_scales: Sequence[float]
                       ) -> list[tuple[Dispatch, str]]:
        """One projection of a batched chunk: i2_s rows as one norm_block dispatch (every
        token's activation block) and the mat-mat kernel (``matmat_i2_s.wgsl``, the weights
        read once per :meth:`GpuMatrix.matmat_tokens` tokens); other rows as fused mat-vecs
        with a workgroup per token. (dispatch, grid-z axis) pairs for :meth:`_batch_seq`."""
        a = self.args
        act = int(self.shape.activation == "silu")
        tpw = m.matmat_tokens()
        if not tpw:
            return [(d, "z") for d in m.fused_dispatches(
                src, gain, y, mode, norm=norm, act=act, eps=a.norm_eps, ys=ys, part=part,
                out_scales=out_scales)]
        blocks = self._norm_block(src, gain, m.cols, quant=True, norm=norm, blocks=self.qb)
        blocks.label = part
        out = [(blocks, "z")]
        out += [(d, f"t{tpw}") for d in m.matmat_dispatches(
            self.qb, self.state, y, mode, act=act, ys=ys, out_scales=out_scales, part=part)]
        return out

    def _batch_seq(self, tokens: int, end: int) -> list[tuple]:
        """The raw dispatches of a batched chunk of ``tokens`` ending at length ``end``."""
        s = splits(end, self.split)
        out = []
        for d, axis in self._batch.items:
            p, g, x, y, _ = d.raw
            if axis == "z":
                out.append((p, g, x, y, tokens))
            elif axis[0] == "t":  # token groups of the mat-mat kernel
                out.append((p, g, x, y, -(-tokens // int(axis[1:]))))
            elif axis == "y":
                out.append((p, g, x, tokens, 1))
            else:
                out.append((p, g, x, s, tokens))
        return out

    # -- recording ----------------------------------------------------------------------------
    def _program(self) -> _Program:
        if not self.trace:
            return self.prog
        if self._traced is None:
            self._traced = self._build(trace=True)
        return self._traced

    def _seq(self, length: int, *, head: bool, argmax: int) -> list[tuple]:
        """The raw dispatches of one step attending to ``length`` positions: without the head,
        with it (``argmax`` 0: logits only, 1: + argmax, 2: + argmax advancing the state)."""
        prog = self._program()
        items = [*self._embed, *(d for L in prog.layers for d in L)]
        seq = [d.raw for d in items]
        s = splits(length, self.split)
        for i in prog.attention:
            p, g, x, _, z = seq[i]
            seq[i] = (p, g, x, s, z)
        seq.append(prog.norm.raw)
        if head:
            seq += self._head_seq(argmax)
        return seq

    def _head_seq(self, argmax: int) -> list[tuple]:
        """The head's raw dispatches after the final norm (``argmax`` as :meth:`_seq`): with
        the screened head on the device (:attr:`screen`) wherever the argmax is taken."""
        prog = self._program()
        if argmax and self.screening():
            sc = self.screen
            return [*(d.raw for d in sc.items),
                    (sc.argmax_step if argmax == 2 else sc.argmax).raw]
        seq = [d.raw for d in prog.head]
        if argmax:
            seq.append((prog.argmax_step if argmax == 2 else prog.argmax).raw)
        return seq

    def _submit(self, token: int | None, pos: int, *, head: bool, argmax: int,
                copies: Sequence[tuple] = ()) -> int:
        """Record and submit one step at ``pos``; ``token`` None: the state already holds it
        (the previous step's argmax). Returns the submission's index."""
        t0 = time.perf_counter()
        if token is not None:
            self.dev.write(self.state, np.array([token, pos, pos + 1, 0], np.uint32))
        cb = self.dev.encode_raw(self._seq(pos + 1, head=head, argmax=argmax), copies)
        index = self.dev.submit([cb])
        self.host_seconds += time.perf_counter() - t0
        self.host_steps += 1
        if self.trace:
            self.dev.wait()
            self.trace_log.append(self._read_trace())
        return index

    def _read_trace(self) -> list[TraceEntry]:
        out = []
        for layer, slot, buf, n in self._program().traces:
            t = np.frombuffer(self.dev.read(buf, 4 * (4 + n + -(-n // 4))), np.uint32)
            y = t[4: 4 + n].view(np.float32).copy()
            q = t[4 + n:].view(np.int8)[:n].copy()
            out.append(TraceEntry(layer, slot, y, q, float(t[:1].view(np.float32)[0])))
        return out

    # -- running --------------------------------------------------------------------------------
    def new_cache(self, max_len: int) -> GpuKVCache:
        if max_len > self.max_len:
            raise RequestError(f"{max_len} positions exceed the {self.max_len} "
                               "this GPU KV cache holds (load with a larger "
                               "context)")
        return GpuKVCache(self, max_len)

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

    def _prefix(self, ids: np.ndarray, cache: GpuKVCache) -> None:
        """Run every token but the last (no head)."""
        self._pending = None
        for i, tok in enumerate(ids[:-1]):
            self._submit(int(tok), cache.length + i, head=False, argmax=0)

    def _batched(self, n: int) -> bool:
        """Whether a prompt of ``n`` tokens runs as batched mat-mat steps."""
        if n < 2 or self.trace or not self.dev.fused:
            return False
        if self._batch is None:
            self._batch = self._build_batch() or False
        return bool(self._batch)

    def _prompt(self, ids: np.ndarray, cache: GpuKVCache, *, argmax: int,
                copies: Sequence[tuple] = (), head: bool = True) -> int:
        """Run a prompt: batched chunks of up to ``tuning["batch"]`` tokens where the network
        can (:meth:`_build_batch`), else token by token; the last position's hidden state
        then goes through the final norm and (``head``) the head and the argmax. Returns the
        last submission's index."""
        self._pending = None
        if not self._batched(ids.size):
            self._prefix(ids, cache)
            return self._submit(int(ids[-1]), cache.length + ids.size - 1, head=head,
                                argmax=argmax, copies=copies)
        tb, dim = self._batch.tokens, self.args.dim
        prog = self.prog
        index = 0
        for c0 in range(0, ids.size, tb):
            t0 = time.perf_counter()
            chunk = ids[c0: c0 + tb]
            n, p0 = chunk.size, cache.length + c0
            st = np.zeros(4 + n, np.uint32)
            st[1], st[2], st[4:] = p0, p0 + n, chunk
            self.dev.write(self.state, st)
            parts: list[Any] = [self._batch_seq(n, p0 + n)]
            if c0 + n == ids.size:
                parts.append((self.hb, 4 * (n - 1) * dim, self.h, 0, 4 * dim))
                tail = [prog.norm.raw]
                if head:
                    tail += self._head_seq(argmax)
                parts += [tail, *copies]
            index = self.dev.submit([self.dev.encode_parts(parts)])
            self.host_seconds += time.perf_counter() - t0
            self.host_steps += 1
        return index

    def forward(self, tokens: Sequence[int], cache: GpuKVCache, *,
                all_logits: bool = False) -> np.ndarray:
        """Run ``tokens`` after the cache's positions; logits [T or 1, vocab] (float32)."""
        ids = self._check(tokens, cache)
        self._pending = None
        rows = []
        t0 = time.perf_counter()
        nbytes = 4 * self.args.vocab_size
        if not all_logits and self._batched(ids.size):
            self._prompt(ids, cache, argmax=0,
                         copies=[(self.logits, 0, self.logits_stage, 0, nbytes)])
            cache.length += ids.size
            self.last_step_seconds = time.perf_counter() - t0
            return np.frombuffer(self.dev.map_read(self.logits_stage, nbytes),
                                 np.float32).copy()[None, :]
        for i, tok in enumerate(ids):
            want = all_logits or i == ids.size - 1
            self._submit(int(tok), cache.length + i, head=want, argmax=0,
                         copies=[(self.logits, 0, self.logits_stage, 0, nbytes)] if want else ())
            if want:
                rows.append(np.frombuffer(self.dev.map_read(self.logits_stage, nbytes),
                                          np.float32).copy())
        cache.length += ids.size
        self.last_step_seconds = time.perf_counter() - t0
        return np.stack(rows)

    def _slot(self) -> int:
        self._ring_at = (self._ring_at + 1) % RING
        return self._ring_at

    def _read_slot(self, slot: int, after: int = 0) -> int:
        """The token id in ring slot ``slot``, once submission ``after`` is done (the screened
        head's candidate count goes to :attr:`last_candidates`)."""
        r = np.frombuffer(self.dev.map_read(self.ring[slot], 12, after), np.uint32)
        self.last_candidates = int(r[2])
        return int(r[0])

    def forward_argmax(self, tokens: Sequence[int], cache: GpuKVCache) -> int:
        """Run ``tokens``; the argmax of the last logits, computed on the GPU (12 bytes back)."""
        ids = self._check(tokens, cache)
        t0 = time.perf_counter()
        slot = self._slot()
        index = self._prompt(ids, cache, argmax=1,
                             copies=[(self.result, 0, self.ring[slot], 0, 16)])
        token = self._read_slot(slot, index)
        cache.length += ids.size
        self.last_step_seconds = time.perf_counter() - t0
        return token

    def greedy(self, tokens: Sequence[int], cache: GpuKVCache) -> int:
        """``forward_argmax`` that keeps the next step in flight: after returning token t it
        has already submitted the step that embeds t (from the device's own state), so the
        host records step t + 1 while the GPU runs step t. A call whose token and cache match
        that step just collects it; any other call runs from scratch (the step in flight only
        wrote positions at or past the cache's length, which this call writes again)."""
        ids = self._check(tokens, cache)
        t0 = time.perf_counter()
        pend = self._pending
        if (pend is not None and ids.size == 1 and pend.cache is cache
                and pend.pos == cache.length and pend.token == int(ids[0])):
            cur = pend
        else:
            cur = _Pending(cache, cache.length + ids.size - 1, self._slot())
            cur.index = self._prompt(ids, cache, argmax=2,
                                     copies=[(self.result, 0, self.ring[cur.slot], 0, 16)])
        self._pending = None
        if cur.pos + 1 < cache.max_len:
            nxt = _Pending(cache, cur.pos + 1, self._slot())
            nxt.index = self._submit(None, nxt.pos, head=True, argmax=2,
                                     copies=[(self.result, 0, self.ring[nxt.slot], 0, 16)])
            self._pending = nxt
        # tuning wait_all=1: wait for the whole queue as wgpu-py's map does (for comparisons)
        token = self._read_slot(cur.slot, 0 if self.dev.tuning.get("wait_all") else cur.index)
        if self._pending is not None:
            self._pending.token = token
        cache.length = cur.pos + 1
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
        self._prompt(ids, cache, argmax=0, head=False)
        x = np.frombuffer(self.dev.read(self.be.xf, 4 * self.args.dim), np.float32)
        cache.length += ids.size
        self.last_step_seconds = time.perf_counter() - t0
        return x.reshape(1, -1).copy()

    def decode(self, segments: Sequence[Any], samplers: Sequence[Sampler]) -> list[int]:
        """:meth:`~..models.base.Transformer.decode` for one sequence (the GPU holds one KV
        cache).

        Greedy choices without a repetition penalty take the argmax on the GPU in the step's
        command buffer (12 bytes back, the next step already in flight: :meth:`greedy`): the
        full head's, or with the screened head (``head.mode``, docs/exact-head.md) its whole
        choice on the device (:attr:`screen`). Other samplers read the logits (full head) or
        the final hidden state, which :class:`..head.Head` chooses from (the int8 screen and
        the candidate rows run on the device, the bounds on the host)."""
        if len(segments) != 1:
            raise RequestError("the wgpu backend runs one sequence at a time")
        seg, sampler = segments[0], samplers[0]
        head = self.head
        greedy = sampler.params.greedy and sampler.penalized_ids().size == 0
        if greedy and not head.check and self.screening():  # the choice on the device
            token = self.greedy(seg.tokens, seg.cache)
            self._screen_stats(self.last_candidates)
            return [token]
        if head.mode == "screened" and not head.unavailable:
            return head.select(self.forward_hidden([seg]), [sampler])
        st = head.stats  # the full head, as Head._full counts it
        st.steps += 1
        st.rows += 1
        st.head_bytes += head.full_bytes
        if head.unavailable:
            st.fallbacks[head.unavailable] += 1
        if greedy:
            return [self.greedy(seg.tokens, seg.cache)]
        return [sampler.pick(self.forward(seg.tokens, seg.cache)[-1])]

    def screening(self) -> bool:
        """Whether greedy steps take the screened head's device step (:attr:`screen`): the
        head is screened and has its tables (a caller may swap :attr:`head` for another)."""
        if self.head.mode != "screened" or self.head.unavailable:
            return False
        if self.screen is None:  # (a full head swapped for a screened one: made on first use)
            self.screen = self.be._screen().step_dispatches(
                self.head_parts, self.logits, self.result, self.state,
                cap=int(self.dev.tuning.get("screen_cap", SCREEN_CAP)))
        return True

    def _screen_stats(self, n: int) -> None:
        """Count a greedy step of the screened head on the device as :class:`..head.Head`
        counts its own: ``n`` candidates, or the reason the full head ran."""
        head, st = self.head, self.head.stats
        st.steps += 1
        st.rows += 1
        st.head_bytes += head.tables.nbytes
        if n == SCREEN_NONE:
            st.head_bytes += head.full_bytes
            st.fallbacks["hidden state not finite or logits could overflow"] += 1
        elif n > self.screen.cap:
            st.head_bytes += head.full_bytes
            st.fallbacks[f"more than {self.screen.cap} candidates"] += 1
        else:
            st.screened_rows += 1
            st.screen_bits = head.tables.bits
            st.candidates.append(n)
            st.rescored.append(n)
            st.head_bytes += n * self.be.head.row_bytes

    def generate_greedy(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        """Greedy tokens after ``prompt``, argmax on the GPU, one step in flight ahead."""
        cache = self.new_cache(len(prompt) + max_new_tokens)
        out = [self.greedy(prompt, cache)]
        while len(out) < max_new_tokens:
            out.append(self.greedy([out[-1]], cache))
        return out

    # -- timing -----------------------------------------------------------------------------------
    @property
    def dispatches_per_token(self) -> int:
        """Dispatches of one greedy decode step (embedding chunks included)."""
        return len(self._seq(1, head=True, argmax=2))

    def profile(self, length: int = 1, token: int = 0, repeats: int = 3) -> dict[str, Any]:
        """Per kernel class: dispatches, seconds, bytes read and GB/s of one decode step.

        Runs the step at position ``length - 1`` (attending to ``length`` positions), which
        overwrites that cache position: the GPU forgets the current sequence. The kernel times
        are the median of ``repeats`` profiled runs (GPU timestamps where the adapter has them,
        each dispatch in its own pass; else host timing of each dispatch alone);
        ``pass_seconds`` is the whole step in one compute pass between two timestamps (the
        GPU time of a step as decoding runs it; None without timestamps); ``token_seconds`` is
        the median wall time of the same step run normally (one submit, argmax read back).
        """
        if not 1 <= length <= self.max_len:
            raise RequestError(f"length must be in 1..{self.max_len}")
        self._owner, self._pending = None, None
        self.dev.write(self.state, np.array([token, length - 1, length, 0], np.uint32))
        trace, self.trace = self.trace, False
        try:
            prog = self.prog
            head = ([*self.screen.items, self.screen.argmax] if self.screening()
                    else [*prog.head, prog.argmax])  # as the greedy step runs it
            items = [*self._embed, *(d for L in prog.layers for d in L), prog.norm, *head]
            s = splits(length, self.split)
            for i in prog.attention:
                d = items[i]
                items[i] = Dispatch(d.kind, d.kernel, d.group, (d.grid[0], s, 1), d.nbytes,
                                    d.nbytes_per_pos, d.label)
            runs = [self.dev.profile(items) for _ in range(max(1, repeats))]
            seq = self._seq(length, head=True, argmax=1)
            pass_s = self.dev.pass_seconds(seq, repeats)
            walls = []
            for _ in range(max(1, repeats)):
                t0 = time.perf_counter()
                slot = self._slot()
                self._submit(token, length - 1, head=True, argmax=1,
                             copies=[(self.result, 0, self.ring[slot], 0, 16)])
                self._read_slot(slot)
                walls.append(time.perf_counter() - t0)
        finally:
            self.trace = trace
            self._owner = None
        secs = np.median(np.array([r[0] for r in runs]), axis=0)
        kinds: dict[str, dict[str, float]] = {}
        for d, sec in zip(items, secs, strict=True):
            k = kinds.setdefault(d.kind, {"dispatches": 0, "seconds": 0.0, "bytes": 0})
            k["dispatches"] += 1
            k["seconds"] += float(sec)
            k["bytes"] += d.nbytes + d.nbytes_per_pos * length
        labels: dict[str, dict[str, float]] = {}
        for d, sec in zip(items, secs, strict=True):
            k = labels.setdefault(d.label or d.kind, {"dispatches": 0, "seconds": 0.0,
                                                      "bytes": 0})
            k["dispatches"] += 1
            k["seconds"] += float(sec)
            k["bytes"] += d.nbytes + d.nbytes_per_pos * length
        for k in (*kinds.values(), *labels.values()):
            k["gbps"] = k["bytes"] / k["seconds"] / 1e9 if k["seconds"] else 0.0
        return {"device": self.dev.name, "clock": runs[0][1], "length": length,
                "kinds": kinds, "labels": labels, "gpu_seconds": float(secs.sum()),
                "pass_seconds": pass_s, "dispatches": len(items),
                "token_seconds": float(np.median(walls)),
                "weight_bytes": int(sum(k["bytes"] for n, k in kinds.items()
                                        if n.startswith("matvec") or n == "lm_head"))}


WgpuNetwork = WgpuBitNet

__all__ = ["GpuKVCache", "TraceEntry", "WgpuBitNet", "WgpuNetwork", "splits"]
