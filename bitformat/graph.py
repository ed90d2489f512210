"""One decoder layer of a model family, described once: the steps every backend lowers.

A family's layer is a short list of :class:`Step` s over named values, each naming the tensors
of ``blk.N`` it reads (GGUF names without ``.weight``). The numpy and cpu backends interpret it
step by step (:class:`~bitformat.runtime.models.base.Transformer`); the cpu backend's one-call
decode step (:mod:`bitformat.runtime.cpu.decode`) and the wgpu network
(:mod:`bitformat.runtime.wgpu.network`) lower it to their fused kernels, matching the steps
against what those kernels compute and refusing, by name, a step they do not have. So a new
family whose layer is made of these steps runs on every backend by being described here (or
in a file of its own: :func:`bitformat.families.register`).

The steps (``h`` is the residual stream, the only value that lives from layer to layer)::

    norm_quant   src -> out       RMSNorm with the gain ``weights[0]`` (none: no norm), then
                                  int8 per token (BitLinear's absmax activations)
    linear       src -> outs      the ternary projections ``weights`` of one int8 input, one
                                  output each (a backend may run them as one stacked matrix)
    hf_rows      q, k -> q, k     each head's rows from llama.cpp's interleaved RoPE order
                                  back to Hugging Face's (rotate-half), the same attention
    head_norm    q, k -> q, k     RMSNorm over each head with the gains ``weights`` (q, k)
    attention    q, k, v -> out   RoPE at each position, the KV cache write and causal
                                  softmax attention (grouped query heads)
    glu          gate, up -> out  ``act(gate) * up`` with ``act = arg``: "relu2" or "silu"
    add          a, b -> out      ``a + b``

Sources for each family's layer: :mod:`bitformat.families`; the arithmetic of each step:
docs/model.md.
"""

from __future__ import annotations

from dataclasses import dataclass

#: every step kind, with what it computes (see the module text)
OPS = {
    "norm_quant": "RMSNorm (gain weights[0], or none) then per-token int8 activations",
    "linear": "the ternary projections in weights, one output each",
    "hf_rows": "q/k rows from llama.cpp's interleaved RoPE order to Hugging Face's",
    "head_norm": "RMSNorm over each head of q and k (gains weights[0], weights[1])",
    "attention": "RoPE, KV cache write and causal softmax attention",
    "glu": "act(gate) * up with act = arg",
    "add": "src[0] + src[1]",
}
ACTIVATIONS = ("relu2", "silu")


def block_shapes(hidden: int, ffn: int, heads: int, kv_heads: int, head_dim: int
                 ) -> dict[str, tuple[int, ...]]:
    """The numpy shape of every tensor a layer's steps may read (``blk.N.<name>.weight``):
    projections ``[out, in]``, gains ``[width]`` of the value they scale."""
    h, f, d = hidden, ffn, head_dim
    q, kv = heads * d, kv_heads * d
    return {"attn_norm": (h,), "ffn_norm": (h,), "attn_sub_norm": (q,), "ffn_sub_norm": (f,),
            "attn_q_norm": (d,), "attn_k_norm": (d,), "attn_q": (q, h), "attn_k": (kv, h),
            "attn_v": (kv, h), "attn_output": (h, q), "ffn_gate": (f, h), "ffn_up": (f, h),
            "ffn_down": (h, f)}


@dataclass(frozen=True)
class Step:
    """One step of a layer: ``op`` (one of :data:`OPS`) reads the values ``src`` and the
    tensors ``weights`` of its block, and writes the values ``out``."""

    op: str
    src: tuple[str, ...]
    out: tuple[str, ...]
    weights: tuple[str, ...] = ()
    arg: str = ""

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown step {self.op!r} (steps: {', '.join(OPS)})")
        if self.op == "glu" and self.arg not in ACTIVATIONS:
            raise ValueError(f"glu activation {self.arg!r} is not one of "
                             f"{', '.join(ACTIVATIONS)}")


@dataclass(frozen=True)
class Graph:
    """A decoder layer: its steps in order. Values are read after they are written; ``h``
    comes in and goes out."""

    steps: tuple[Step, ...]

    def __post_init__(self) -> None:
        have = {"h"}
        for s in self.steps:
            missing = [v for v in s.src if v not in have]
            if missing:
                raise ValueError(f"step {s.op} reads {', '.join(missing)} before any step "
                                 "writes it")
            have.update(s.out)

    def tensors(self) -> tuple[str, ...]:
        """The tensors of ``blk.N`` this layer reads, in the order its steps read them."""
        return tuple(w for s in self.steps for w in s.weights)

    def projections(self) -> tuple[str, ...]:
        """The ternary projections, in the order the steps run them."""
        return tuple(w for s in self.steps if s.op == "linear" for w in s.weights)

    def has(self, op: str) -> bool:
        return any(s.op == op for s in self.steps)

    @property
    def activation(self) -> str:
        """The FFN activation (the first ``glu`` step's)."""
        return next(s.arg for s in self.steps if s.op == "glu")


def decoder_graph(activation: str, *, attn_sub_norm: bool = False, ffn_sub_norm: bool = False,
                  qk_norm: bool = False, interleaved_qk: bool = False) -> Graph:
    """The pre-norm decoder layer every family bitformat runs is a case of::

        x = Q8(RMSNorm(h))                      q, k, v = linear(x)
        q, k = hf_rows(q, k)                    (interleaved_qk: llama.cpp's llama rows)
        q, k = head_norm(q, k)                  (qk_norm: Qwen3)
        o = attention(q, k, v)
        h = h + o_proj(Q8(RMSNorm_sub(o)))      (attn_sub_norm; else Q8(o))
        f = Q8(RMSNorm(h))                      g = act(gate(f)) * up(f)
        h = h + down(Q8(RMSNorm_sub(g)))        (ffn_sub_norm; else Q8(g))
    """
    s = [Step("norm_quant", ("h",), ("x",), ("attn_norm",)),
         Step("linear", ("x",), ("q", "k", "v"), ("attn_q", "attn_k", "attn_v"))]
    if interleaved_qk:
        s.append(Step("hf_rows", ("q", "k"), ("q", "k")))
    if qk_norm:
        s.append(Step("head_norm", ("q", "k"), ("q", "k"), ("attn_q_norm", "attn_k_norm")))
    s += [Step("attention", ("q", "k", "v"), ("o",)),
          Step("norm_quant", ("o",), ("xo",), ("attn_sub_norm",) if attn_sub_norm else ()),
          Step("linear", ("xo",), ("y",), ("attn_output",)),
          Step("add", ("h", "y"), ("h",)),
          Step("norm_quant", ("h",), ("xf",), ("ffn_norm",)),
          Step("linear", ("xf",), ("gate", "up"), ("ffn_gate", "ffn_up")),
          Step("glu", ("gate", "up"), ("g",), arg=activation),
          Step("norm_quant", ("g",), ("xd",), ("ffn_sub_norm",) if ffn_sub_norm else ()),
          Step("linear", ("xd",), ("y",), ("ffn_down",)),
          Step("add", ("h", "y"), ("h",))]
    return Graph(tuple(s))


@dataclass(frozen=True)
class DecoderShape:
    """What the fused kernels (cpu one-call step, wgpu network) compute, read back from a
    graph: the gains before each of the four projections (None: no norm, the plain int8
    input), the q/k handling and the activation. :func:`decoder_shape` gives it for a graph
    that is a :func:`decoder_graph`, and names the first step that is not."""

    attn_norm: str
    qkv: tuple[str, str, str]  # the q, k and v projections
    interleaved_qk: bool
    qk_norm: tuple[str, str] | None
    attn_sub_norm: str | None
    out: str  # o_proj
    ffn_norm: str
    gate_up: tuple[str, str]
    activation: str
    ffn_sub_norm: str | None
    down: str


class NotLowerable(ValueError):
    """A graph with a step a fused kernel does not compute (the message names it)."""


def decoder_shape(graph: Graph) -> DecoderShape:
    """Match ``graph`` against :func:`decoder_graph`'s steps, step by step; the switches it
    was made with, or :class:`NotLowerable` naming the first step that differs."""
    steps = list(graph.steps)
    at = 0
    env = {"h": "h"}  # decoder_graph's value names -> the graph's own (any names will do)

    def take(op: str, src: tuple[str, ...], out: tuple[str, ...], *, optional: bool = False,
             weights: int | None = None) -> Step | None:
        nonlocal at
        s = steps[at] if at < len(steps) else None
        ok = (s is not None and s.op == op and len(s.src) == len(src)
              and len(s.out) == len(out) and (weights is None or len(s.weights) == weights)
              and all(env.get(v) == g for v, g in zip(src, s.src, strict=True)))
        if not ok:
            if optional:
                return None
            want = f"{op} of {', '.join(env.get(v, v) for v in src)}"
            got = f"{s.op} of {', '.join(s.src)}" if s is not None else "the end of the layer"
            raise NotLowerable(f"step {at + 1}: expected {want}, found {got}")
        env.update(zip(out, s.out, strict=True))
        at += 1
        return s

    def gain(s: Step) -> str | None:
        if len(s.weights) > 1:
            raise NotLowerable(f"norm_quant with {len(s.weights)} gains")
        return s.weights[0] if s.weights else None

    a = take("norm_quant", ("h",), ("x",))
    qkv = take("linear", ("x",), ("q", "k", "v"), weights=3).weights
    inter = take("hf_rows", ("q", "k"), ("q", "k"), optional=True) is not None
    qkn = take("head_norm", ("q", "k"), ("q", "k"), optional=True, weights=2)
    take("attention", ("q", "k", "v"), ("o",))
    o = take("norm_quant", ("o",), ("xo",))
    out = take("linear", ("xo",), ("y",), weights=1).weights[0]
    take("add", ("h", "y"), ("h",))
    f = take("norm_quant", ("h",), ("xf",))
    gu = take("linear", ("xf",), ("gate", "up"), weights=2).weights
    glu = take("glu", ("gate", "up"), ("g",))
    d = take("norm_quant", ("g",), ("xd",))
    down = take("linear", ("xd",), ("y",), weights=1).weights[0]
    take("add", ("h", "y"), ("h",))
    if at != len(steps):
        raise NotLowerable(f"step {at + 1} ({steps[at].op}) after the layer's last add")
    if gain(a) is None or gain(f) is None:
        raise NotLowerable("an input norm_quant without a gain")
    return DecoderShape(gain(a), (qkv[0], qkv[1], qkv[2]), inter,
                        (qkn.weights[0], qkn.weights[1]) if qkn else None, gain(o), out,
                        gain(f), (gu[0], gu[1]), glu.arg, gain(d), down)


__all__ = ["ACTIVATIONS", "OPS", "DecoderShape", "Graph", "NotLowerable", "Step",
           "block_shapes", "decoder_graph", "decoder_shape"]
