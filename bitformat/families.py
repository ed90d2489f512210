"""The ternary model families bitformat reads, converts and runs, and how to tell them apart.

A family is one decoder layer (:class:`bitformat.graph.Graph`: its steps, described once and
lowered by every backend) plus the names it goes by: its GGUF architectures and its Hugging
Face layout (``architectures``, ``model_type``, module names). A family of one's own is a
:class:`Family` passed to :func:`register` (``tests/test_toy_family.py`` adds one in one
file and runs it on every backend). The families here all have the
pre-norm block ``h += o_proj(attn(RMSNorm(h)))``, ``h += down(act(gate) * up)`` with int8
per-token activations into every ternary projection; they differ in:

========================  ==========  =========  ========  ===========  =====================
family                    activation  sub-norms  q/k norm  q/k rows     LM head
========================  ==========  =========  ========  ===========  =====================
``bitnet-2b4t``           relu2       yes        no        HF order     tied (token_embd)
``bitnet-1bitllm``        silu        yes        no        HF order     untied in HF (lm_head)
``llama``                 silu        no         no        permuted     untied (output.weight)
``qwen3``                 silu        no         yes       HF order     tied or untied
========================  ==========  =========  ========  ===========  =====================

Sources (read, not copied): transformers ``models/bitnet`` (BitNetForCausalLM: sub-norms before
o_proj and down_proj, ``hidden_act``), 1bitLLM's ``modeling_bitnet.py`` (``inner_attn_ln``,
``ffn_layernorm``, SiLU), transformers ``integrations/bitnet.py`` (BitLinear's packed uint8
weights with ``weight_scale`` divided out), ``models/llama``, ``models/qwen3`` (``q_norm``/
``k_norm`` over each head before RoPE); llama.cpp ``src/models/bitnet.cpp`` (``bitnet``: the FFN
activation from ``bitnet.hidden_activation``, SiLU when absent), ``llama`` (q/k rows permuted
by the converter for interleaved RoPE), ``qwen3`` (NEOX RoPE, ``attn_q_norm``/``attn_k_norm``);
microsoft/BitNet ``utils/convert-hf-to-gguf-bitnet.py`` (``BitnetForCausalLM`` ->
``bitnet-b1.58``, ``LlamaForCausalLM`` -> ``llama`` with permuted q/k and w = trit /
weight_scale).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import UnsupportedConversionError
from .graph import ACTIVATIONS as graph_activations
from .graph import Graph, decoder_graph


@dataclass(frozen=True)
class Family:
    """A model family: its layer (:class:`~bitformat.graph.Graph`, the one description every
    backend lowers), the GGUF architectures it is written under, and its Hugging Face layout
    (empty for a family that has none)."""

    id: str
    title: str
    archs: tuple[str, ...]  # GGUF architectures with this graph (the first is written)
    graph: Graph
    hf_architecture: str = ""  # what an HF export declares
    hf_model_type: str = ""
    hf_blocks: Mapping[str, str] = field(default_factory=dict)  # HF module in model.layers.N
    #                                                              -> GGUF name in blk.N
    hf_aliases: Mapping[str, str] = field(default_factory=dict)  # other spellings read
    #: ``<arch>.<key>`` metadata a file of this family carries where its architecture is
    #: shared with another family (1bitLLM: ``bitnet.hidden_activation`` = silu)
    metadata: Mapping[str, str] = field(default_factory=dict)

    @property
    def arch(self) -> str:
        return self.archs[0]

    @property
    def activation(self) -> str:
        """The FFN gate: "relu2" or "silu"."""
        return self.graph.activation

    @property
    def sub_norms(self) -> bool:
        """attn_sub_norm before o_proj and ffn_sub_norm before down_proj."""
        return {"attn_sub_norm", "ffn_sub_norm"} <= set(self.graph.tensors())

    @property
    def qk_norm(self) -> bool:
        """attn_q_norm / attn_k_norm: RMSNorm over each head before RoPE."""
        return self.graph.has("head_norm")

    @property
    def permuted_qk(self) -> bool:
        """GGUF q/k rows in llama.cpp's interleaved-RoPE order."""
        return self.graph.has("hf_rows")

    def block_tensors(self) -> tuple[str, ...]:
        """The GGUF names inside ``blk.N`` of this family (projections and norms)."""
        return self.graph.tensors()


_ATTN = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output"}
_FFN = {"mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}

BITNET_2B4T = Family(
    "bitnet-2b4t", "BitNet b1.58 2B-4T", ("bitnet-b1.58", "bitnet-25", "bitnet"),
    decoder_graph("relu2", attn_sub_norm=True, ffn_sub_norm=True),
    "BitNetForCausalLM", "bitnet",
    {**_NORMS, "self_attn.attn_sub_norm": "attn_sub_norm", "mlp.ffn_sub_norm": "ffn_sub_norm",
     **_ATTN, **_FFN})
#: 1bitLLM's own folders (custom code, model_type llama, float masters) are read; the export
#: is transformers' packed BitNetForCausalLM with ``hidden_act`` silu, the same graph.
BITNET_1BITLLM = Family(
    "bitnet-1bitllm", "BitNet b1.58 (1bitLLM, SiLU)", ("bitnet", "bitnet-b1.58", "bitnet-25"),
    decoder_graph("silu", attn_sub_norm=True, ffn_sub_norm=True),
    "BitNetForCausalLM", "bitnet", BITNET_2B4T.hf_blocks,
    {"self_attn.inner_attn_ln": "attn_sub_norm", "mlp.ffn_layernorm": "ffn_sub_norm"},
    {"hidden_activation": "silu"})
LLAMA = Family(
    "llama", "Llama ternary (Llama3-8B-1.58, Falcon3-1.58bit)", ("llama",),
    decoder_graph("silu", interleaved_qk=True), "LlamaForCausalLM", "llama",
    {**_NORMS, **_ATTN, **_FFN})
QWEN3 = Family(
    "qwen3", "Qwen3 ternary (Ternary Bonsai)", ("qwen3",), decoder_graph("silu", qk_norm=True),
    "Qwen3ForCausalLM", "qwen3",
    {**_NORMS, "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
     **_ATTN, **_FFN})

#: the seven ternary projections of a block, in the order a layer runs them (every family
#: bitformat ships has them: the GGUF names inside ``blk.N``)
PROJECTIONS = BITNET_2B4T.graph.projections()

#: every family bitformat runs, by id (:func:`register` adds one)
FAMILIES: dict[str, Family] = {f.id: f for f in (BITNET_2B4T, BITNET_1BITLLM, LLAMA, QWEN3)}
#: every GGUF architecture bitformat runs (kept up to date by :func:`register`)
ARCHITECTURES: list[str] = list(dict.fromkeys(a for f in FAMILIES.values() for a in f.archs))
ACTIVATIONS = graph_activations


def register(family: Family) -> Family:
    """Make ``family`` one bitformat reads, validates and runs on every backend (its layer
    must be made of :data:`bitformat.graph.OPS`); returns it. A family already registered
    under its id is replaced."""
    if not family.archs:
        raise ValueError(f"family {family.id!r} names no GGUF architecture")
    FAMILIES[family.id] = family
    for a in family.archs:
        if a not in ARCHITECTURES:
            ARCHITECTURES.append(a)
    return family


def unregister(family_id: str) -> None:
    """Forget a family :func:`register` added (and the architectures only it had)."""
    FAMILIES.pop(family_id, None)
    keep = {a for f in FAMILIES.values() for a in f.archs}
    ARCHITECTURES[:] = [a for a in ARCHITECTURES if a in keep]


def activation_of(meta: Mapping[str, Any], arch: str) -> str:
    """The FFN activation of a BitNet-graph file: ``<arch>.hidden_activation`` (llama.cpp's
    key) if present, else bitnet.cpp's ReLU^2 for ``bitnet-b1.58``/``bitnet-25`` and
    upstream's SiLU for ``bitnet``."""
    act = meta.get(f"{arch}.hidden_activation")
    if act is None:
        return "silu" if arch == "bitnet" else "relu2"
    if act not in ACTIVATIONS:
        raise UnsupportedConversionError(f"{arch}.hidden_activation {act!r} is not one of "
                                         f"{', '.join(ACTIVATIONS)}")
    return str(act)


def family_of(meta: Mapping[str, Any]) -> Family:
    """The family of a model from its GGUF metadata (plain values)."""
    arch = meta.get("general.architecture")
    under = [f for f in FAMILIES.values() if arch in f.archs]
    if len(under) == 1:
        return under[0]
    if under:  # one architecture, several graphs (bitnet: ReLU^2 or SiLU), told by the FFN
        act = activation_of(meta, arch)
        for f in under:
            if f.activation == act:
                return f
    raise UnsupportedConversionError(
        f"architecture {arch!r} is not a ternary family bitformat runs (expected one of "
        f"{', '.join(ARCHITECTURES)})")


def hf_family(cfg: Mapping[str, Any]) -> Family:
    """The family of a Hugging Face ``config.json``."""
    archs = cfg.get("architectures") or []
    mt = cfg.get("model_type")
    if mt == "bitnet" or "BitNetForCausalLM" in archs:
        act = cfg.get("hidden_act", "relu2")
        return BITNET_2B4T if act == "relu2" else BITNET_1BITLLM
    if "BitnetForCausalLM" in archs:
        return BITNET_1BITLLM
    if mt == "qwen3" or "Qwen3ForCausalLM" in archs:
        return QWEN3
    if mt == "llama" or "LlamaForCausalLM" in archs:
        return LLAMA
    for f in FAMILIES.values():  # a registered family with a Hugging Face layout of its own
        if f.hf_architecture and (f.hf_architecture in archs or mt == f.hf_model_type):
            return f
    raise UnsupportedConversionError(
        f"model_type {mt!r} / architectures {archs!r}: not a ternary family bitformat reads "
        "(BitNetForCausalLM, 1bitLLM's BitnetForCausalLM, LlamaForCausalLM or "
        "Qwen3ForCausalLM with BitNet quantization)")


__all__ = ["ACTIVATIONS", "ARCHITECTURES", "BITNET_1BITLLM", "BITNET_2B4T", "FAMILIES", "LLAMA",
           "PROJECTIONS", "QWEN3", "Family", "activation_of", "family_of", "hf_family", "register",
           "unregister"]
