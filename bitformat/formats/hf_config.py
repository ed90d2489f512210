"""What a Hugging Face folder's config.json and tensor names say in GGUF terms, and back, for
every family of :mod:`bitformat.families` (BitNet 2B-4T and 1bitLLM, Llama/Falcon3 ternary,
Qwen3 ternary).

config.json holds the hyperparameters (:class:`Hyper`) and ``quantization_config``; from
them and the tokenizer files come the GGUF metadata (:func:`derived_metadata`). What HF has
no home for goes into config.json's ``"bitformat"`` object (:func:`bitformat_record`), so a
GGUF -> hf -> GGUF round trip gives the same bytes::

    "bitformat": {
      "version": 1,
      "metadata_order": [GGUF keys in the source's order],
      "metadata": {key: {"type": ValueType name, "value": v[, "item_type": ValueType name]}
                   for each key the folder does not derive, or derives differently},
      "omit": [derived keys the source did not have],
      "tensor_order": [GGUF tensor names] or [] for the default order (:func:`default_order`),
      "tensor_types": {GGUF name: "F32" | "F16" | "BF16"} where not the default (the folder
                      dtype for token_embd.weight, F32 for the norms)
    }

Reading treats the object as hostile: every stored value MUST be a typed GGUF value that
packs (integers in range), else :class:`MetadataError`.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..constants import ValueType
from ..errors import FormatError, MetadataError, UnsupportedConversionError
from ..families import BITNET_1BITLLM, BITNET_2B4T, PROJECTIONS, Family, hf_family
from ..graph import block_shapes
from ..io.gguf import ARRAY_DTYPE, MetaValue, pack_value, sanitize
from ..io.safetensors import FLOAT_DTYPES

ARCH = "bitnet-b1.58"
#: GGUF architectures whose graph is transformers' BitNet (ReLU^2, sub-norms, NEOX RoPE).
HF_ARCHES = ("bitnet-b1.58", "bitnet-25")
DEFAULT_ROPE_THETA = 500000.0  # BitNetConfig.default_theta
TORCH_DTYPE = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
DROPPED = ("general.file_type", "general.alignment")  # the GGUF writer regenerates these

# -- tensor names ----------------------------------------------------------------------------
#: HF module path inside a block -> GGUF tensor name inside ``blk.N`` (BitNet 2B-4T's; each
#: family has its own table, :attr:`~bitformat.families.Family.hf_blocks`).
BLOCK_NAMES = dict(BITNET_2B4T.hf_blocks)
TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
HF_NAME = re.compile(r"^(?:model\.layers\.(0|[1-9]\d*)\.)?(.+)\.(weight|weight_scale)$")
IGNORED = re.compile(r"^model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq$")


def hf_module(gguf: str, family: Family = BITNET_2B4T) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj`` (names already checked)."""
    parts = gguf.split(".")
    if parts[0] == "blk":
        hf = {v: k for k, v in family.hf_blocks.items()}
        return f"model.layers.{parts[1]}.{hf[parts[2]]}"
    return HF_OF_TOP[parts[0]]


HF_OF_TOP = {v: k for k, v in TOP_NAMES.items()}


def default_order(names: list[str], family: Family = BITNET_2B4T) -> list[str]:
    """The official GGUF's order: the HF names sorted as strings (layers 0, 1, 10, 11, ...)."""
    return sorted(names, key=lambda n: hf_module(n, family))


def tensor_order(names: list[str], recorded: list[str], family: Family = BITNET_2B4T
                 ) -> list[str]:
    """The recorded tensor order if it is a permutation of ``names``, else the default."""
    if sorted(recorded) == sorted(names):
        return list(recorded)
    return default_order(names, family)


def gguf_names(names: Iterable[str], layers: int, where: str, family: Family = BITNET_2B4T
               ) -> tuple[dict[str, str], dict[str, str]]:
    """GGUF name -> HF name of the weights, and of the weight scales, of a ``family`` folder
    with ``layers`` blocks (rotary caches skipped; ``lm_head`` -> ``output.weight``); others
    are refused."""
    blocks = {**family.hf_blocks, **family.hf_aliases}
    weights: dict[str, str] = {}
    scales: dict[str, str] = {}
    for name in sorted(names):
        if IGNORED.match(name):
            continue
        m = HF_NAME.match(name)
        layer, module, kind = m.groups() if m else (None, None, None)
        gguf = None
        if layer is None and module in TOP_NAMES and kind == "weight":
            gguf = f"{TOP_NAMES[module]}.weight"
        elif layer is not None and module in blocks and int(layer) < layers:
            gguf = f"blk.{layer}.{blocks[module]}.weight"
            if kind == "weight_scale" and blocks[module] not in PROJECTIONS:
                gguf = None
        if gguf is None or gguf in (weights if kind == "weight" else scales):
            raise FormatError(f"unexpected tensor for a {family.hf_architecture} with "
                              f"{layers} layers", path=where, tensor=sanitize(name))
        (scales if kind == "weight_scale" else weights)[gguf] = name
    return weights, scales


# -- hyperparameters -------------------------------------------------------------------------
@dataclass
class Hyper:
    vocab: int
    hidden: int
    ff: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    context: int
    eps: float
    theta: float
    family: Family = BITNET_2B4T

    def shapes(self, untied: bool = False) -> dict[str, tuple[int, ...]]:
        """GGUF name -> expected numpy shape of every tensor the model must have (with
        ``output.weight`` if ``untied``)."""
        h = self.hidden
        out = {"token_embd.weight": (self.vocab, h), "output_norm.weight": (h,)}
        if untied:
            out["output.weight"] = (self.vocab, h)
        every = block_shapes(h, self.ff, self.heads, self.kv_heads, self.head_dim)
        per = {k: every[k] for k in self.family.block_tensors()}
        for i in range(self.layers):
            out.update({f"blk.{i}.{k}.weight": s for k, s in per.items()})
        return out


def _need(src: dict[str, Any], key: str, kind: type, where: str, default: Any = None) -> Any:
    v = src.get(key, default)
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v) if abs(v) < 2**1000 else float("inf")  # a JSON integer as a float
    ok = (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
          if kind is float else isinstance(v, int) and not isinstance(v, bool) and v > 0)
    if not ok:
        raise MetadataError(f"{key} must be a positive {kind.__name__}, got {v!r}", path=where)
    return kind(v)


def hyper_from_config(cfg: dict[str, Any], where: str) -> Hyper:
    family = hf_family(cfg)
    heads = _need(cfg, "num_attention_heads", int, where)
    hidden = _need(cfg, "hidden_size", int, where)
    kv = _need(cfg, "num_key_value_heads", int, where, heads)
    head_dim = cfg.get("head_dim") or (hidden // heads)
    rope = cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict) or rope.get("rope_type", "default") != "default":
        raise UnsupportedConversionError(f"rope_parameters {rope!r}: only default RoPE has a "
                                         "GGUF equivalent here", path=where)
    theta = rope.get("rope_theta", cfg.get("rope_theta", DEFAULT_ROPE_THETA
                                            if family.hf_model_type == "bitnet" else 10000.0))
    h = Hyper(_need(cfg, "vocab_size", int, where), hidden,
              _need(cfg, "intermediate_size", int, where),
              _need(cfg, "num_hidden_layers", int, where), heads, kv,
              _need({"head_dim": head_dim}, "head_dim", int, where),
              _need(cfg, "max_position_embeddings", int, where, 2048),
              _need(cfg, "rms_norm_eps", float, where, 1e-5),
              _need({"rope_theta": theta}, "rope_theta", float, where), family)
    if heads % kv:
        raise MetadataError(f"{heads} attention heads do not group into {kv} kv heads",
                            path=where)
    return bounded(h, where)


def bounded(h: Hyper, where: str) -> Hyper:
    """Refuse sizes beyond bitformat's caps (bitformat/validate.py) before anything is sized
    from them: ``num_hidden_layers: 1000000000`` must not build a billion-entry table."""
    from ..validate import MAX_CONTEXT, MAX_DIM, MAX_HEADS, MAX_LAYERS, MAX_VOCAB

    for what, v, cap in (("vocab_size", h.vocab, MAX_VOCAB), ("hidden_size", h.hidden, MAX_DIM),
                         ("intermediate_size", h.ff, MAX_DIM),
                         ("num_hidden_layers", h.layers, MAX_LAYERS),
                         ("num_attention_heads", h.heads, MAX_HEADS),
                         ("num_key_value_heads", h.kv_heads, MAX_HEADS),
                         ("head_dim", h.head_dim, MAX_DIM),
                         ("max_position_embeddings", h.context, MAX_CONTEXT)):
        if v > cap:
            raise MetadataError(f"{what} is {v}, more than bitformat's cap of {cap}",
                                path=where)
    return h


def hyper_from_metadata(meta: dict[str, MetaValue], arch: str, rows: int, where: str,
                        family: Family = BITNET_2B4T) -> Hyper:
    src = {k[len(arch) + 1:]: v.value for k, v in meta.items() if k.startswith(arch + ".")}
    heads = _need(src, "attention.head_count", int, where)
    hidden = _need(src, "embedding_length", int, where)
    hd = src.get("attention.key_length", hidden // heads)
    return bounded(Hyper(
        _need(src, "vocab_size", int, where, rows), hidden,
        _need(src, "feed_forward_length", int, where), _need(src, "block_count", int, where),
        heads, _need(src, "attention.head_count_kv", int, where, heads),
        _need(src, "rope.dimension_count", int, where, hd),
        _need(src, "context_length", int, where, 2048),
        _need(src, "attention.layer_norm_rms_epsilon", float, where),
        _need(src, "rope.freq_base", float, where, 10000.0), family), where)  # llama.cpp's default


def _f32(x: float) -> float:
    """The shortest decimal that reads back as the same float32 (1e-05, not 9.99e-06)."""
    return float(str(np.float32(x)))


def derived_metadata(h: Hyper, arch: str, tokenizer: dict[str, MetaValue]
                     ) -> dict[str, MetaValue]:
    """The GGUF metadata that config.json and the tokenizer files say, in canonical order."""
    u32 = lambda v: MetaValue(ValueType.UINT32, int(v))  # noqa: E731
    f32 = lambda v: MetaValue(ValueType.FLOAT32, float(np.float32(v)))  # noqa: E731
    meta = {"general.architecture": MetaValue(ValueType.STRING, arch)}
    for key, mv in (("vocab_size", u32(h.vocab)), ("context_length", u32(h.context)),
                    ("embedding_length", u32(h.hidden)), ("block_count", u32(h.layers)),
                    ("feed_forward_length", u32(h.ff)),
                    ("rope.dimension_count", u32(h.head_dim)),
                    ("attention.head_count", u32(h.heads)),
                    ("attention.head_count_kv", u32(h.kv_heads)),
                    ("attention.layer_norm_rms_epsilon", f32(h.eps)),
                    ("rope.freq_base", f32(h.theta))):
        meta[f"{arch}.{key}"] = mv
    if h.head_dim != h.hidden // h.heads:  # llama.cpp's qwen3 reads the head size here
        meta[f"{arch}.attention.key_length"] = u32(h.head_dim)
        meta[f"{arch}.attention.value_length"] = u32(h.head_dim)
    if h.family is BITNET_1BITLLM:  # llama.cpp's bitnet graph reads its FFN activation here
        meta[f"{arch}.hidden_activation"] = MetaValue(ValueType.STRING, "silu")
    meta.update(tokenizer)
    return meta


# -- config.json -> GGUF ---------------------------------------------------------------------
def quant_mode(cfg: dict[str, Any], where: str) -> tuple[str, str]:
    """(linear_class, quantization_mode), transformers' defaults filled in; refuses others.

    1bitLLM's folders (``BitnetForCausalLM``, its own modeling code) have no
    quantization_config: their float masters are ternarised on every forward, which is
    ``autobitlinear``/``online``."""
    qc = cfg.get("quantization_config")
    if qc is None and "BitnetForCausalLM" in (cfg.get("architectures") or []):
        return "autobitlinear", "online"
    if qc is None:
        raise UnsupportedConversionError(
            "config.json has no quantization_config, so transformers runs these weights as a "
            "dense model; if they are BitNet master weights, declare them with "
            '{"quant_method": "bitnet", "linear_class": "autobitlinear", '
            '"quantization_mode": "online"}', path=where)
    if not isinstance(qc, dict) or qc.get("quant_method") != "bitnet":
        raise UnsupportedConversionError("quantization_config is not quant_method bitnet",
                                         path=where)
    linear = qc.get("linear_class", "bitlinear")
    mode = qc.get("quantization_mode", "offline")
    if linear not in ("bitlinear", "autobitlinear") or mode not in ("offline", "online"):
        raise MetadataError(f"unknown linear_class {linear!r} / quantization_mode {mode!r}",
                            path=where)
    if qc.get("use_rms_norm"):
        raise UnsupportedConversionError("use_rms_norm adds a norm inside every BitLinear, "
                                         "which the GGUF graph does not have", path=where)
    if any(m != "lm_head" for m in qc.get("modules_to_not_convert") or []):
        raise UnsupportedConversionError("modules_to_not_convert keeps projections dense",
                                         path=where)
    return linear, mode


def read_record(cfg: dict[str, Any], where: str
                ) -> tuple[list[str], dict[str, MetaValue], set[str], list[str], dict[str, str]]:
    """config.json's "bitformat" object: key order, stored values, omitted keys, tensor order
    and the GGUF types of plain tensors where they differ from the defaults."""
    rec = cfg.get("bitformat", {})
    if not isinstance(rec, dict):
        raise MetadataError('"bitformat" in config.json is not an object', path=where)
    order, omit, torder = (rec.get(k, []) for k in ("metadata_order", "omit", "tensor_order"))
    stored, types = rec.get("metadata", {}), rec.get("tensor_types", {})
    if not isinstance(types, dict) or not all(v in FLOAT_DTYPES for v in types.values()):
        raise MetadataError('"bitformat".tensor_types must name F32, F16 or BF16', path=where)
    if not isinstance(stored, dict) or not all(
            isinstance(x, list) and all(isinstance(s, str) for s in x)
            for x in (order, omit, torder)):
        raise MetadataError('"bitformat" in config.json is malformed', path=where)
    extras = {k: _meta_from_json(k, v, where) for k, v in stored.items()}
    return order, extras, set(omit), torder, types


def gguf_metadata(h: Hyper, order: list[str], extras: dict[str, MetaValue], omit: set[str],
                  tokenizer: dict[str, MetaValue]) -> dict[str, MetaValue]:
    """The GGUF metadata of a folder: the derived keys, with the record's order, values and
    omissions applied (a folder without a record gets the canonical order)."""
    arch_mv = extras.get("general.architecture")
    arch = arch_mv.value if arch_mv is not None and arch_mv.value in h.family.archs \
        else h.family.arch
    derived = derived_metadata(h, arch, tokenizer)
    meta = {k: extras.get(k, derived.get(k)) for k in order if k in extras or k in derived}
    meta.update((k, v) for k, v in derived.items() if k not in meta and k not in omit)
    return meta


def _meta_from_json(key: str, obj: Any, where: str) -> MetaValue:
    try:
        vtype = ValueType[obj["type"]]
        value = obj["value"]
        if vtype == ValueType.ARRAY:
            item = ValueType[obj["item_type"]]
            if item == ValueType.STRING:
                if not all(isinstance(s, str) for s in value):
                    raise TypeError("not strings")
                return MetaValue(vtype, list(value), item)
            arr = np.asarray(value, dtype=ARRAY_DTYPE[item])
            if arr.ndim != 1 or (arr.dtype.kind in "iu" and not np.array_equal(arr, value)):
                raise TypeError("values out of range")
            return MetaValue(vtype, arr.astype(bool) if item == ValueType.BOOL else arr, item)
        ok = {ValueType.STRING: str, ValueType.BOOL: bool}.get(
            vtype, (int, float) if vtype in (ValueType.FLOAT32, ValueType.FLOAT64) else int)
        if not isinstance(value, ok) or (ok is int and isinstance(value, bool)):
            raise TypeError("wrong type")
        mv = MetaValue(vtype, float(value) if vtype.name.startswith("FLOAT") else value)
        pack_value(mv)  # range check (struct raises for out-of-range integers)
        return mv
    except (KeyError, TypeError, ValueError, OverflowError, struct.error, AttributeError):
        raise MetadataError(f"bitformat.metadata[{sanitize(key)!r}] is not a typed GGUF value",
                            path=where) from None


# -- GGUF -> config.json ---------------------------------------------------------------------
def linear_class(family: Family) -> str:
    """The BitLinear an export of ``family`` declares: BitNet's ``autobitlinear`` (weight_scale
    multiplies, as microsoft/bitnet-b1.58-2B-4T), else transformers' default ``bitlinear``
    (weight_scale divides: HF1BitLLM/Llama3-8B-1.58 and Falcon3-1.58bit store 1/s)."""
    return "autobitlinear" if family.hf_model_type == "bitnet" else "bitlinear"


def config_json(model, h: Hyper, dtype: str, untied: bool = False) -> dict[str, Any]:
    """config.json of the packed ``offline`` export of ``h.family``, without "bitformat"."""
    tok = {k: model.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding")}
    fam = h.family
    cfg: dict[str, Any] = {
        "architectures": [fam.hf_architecture], "model_type": fam.hf_model_type,
        "vocab_size": h.vocab, "hidden_size": h.hidden, "intermediate_size": h.ff,
        "num_hidden_layers": h.layers, "num_attention_heads": h.heads,
        "num_key_value_heads": h.kv_heads, "hidden_act": fam.activation,
        "max_position_embeddings": h.context, "rms_norm_eps": _f32(h.eps),
        "rope_theta": _f32(h.theta), "tie_word_embeddings": not untied, "attention_bias": False,
        "attention_dropout": 0.0, "use_cache": True, "bos_token_id": tok["bos"],
        "eos_token_id": tok["eos"], "pad_token_id": tok["padding"],
        "torch_dtype": TORCH_DTYPE[dtype],
        "quantization_config": {"quant_method": "bitnet", "linear_class": linear_class(fam),
                                "quantization_mode": "offline"},
    }
    if fam.hf_model_type == "llama":
        cfg["mlp_bias"] = False
    if h.head_dim != h.hidden // h.heads or fam.qk_norm:
        cfg["head_dim"] = h.head_dim
    return cfg


def bitformat_record(model, cfg: dict[str, Any], arch: str, tokenizer: dict[str, MetaValue],
                     dtype: str, where: str) -> dict[str, Any]:
    """The "bitformat" object: what ``cfg`` and the tokenizer files do not say of ``model``
    (``dtype`` is the folder's float dtype)."""
    h = hyper_from_config(cfg, where)
    derived = derived_metadata(h, arch, tokenizer)
    source = {k: v for k, v in model.metadata.items()
              if k not in DROPPED and not k.startswith("bitformat.")}
    names = [e.name for e in model.entries]
    types = {e.name: e.encoding for e in model.entries if not e.ternary}
    return {
        "version": 1, "metadata_order": list(source),
        "metadata": {k: _meta_to_json(v) for k, v in source.items()
                     if k not in derived or not _same(derived[k], v)},
        "omit": [k for k in derived if k not in source],
        "tensor_order": [] if names == default_order(names, h.family) else names,
        "tensor_types": {k: v for k, v in types.items()
                         if v != (dtype if k in ("token_embd.weight", "output.weight")
                                  else "F32")},
    }


def _meta_to_json(mv: MetaValue) -> dict[str, Any]:
    out: dict[str, Any] = {"type": mv.vtype.name, "value": mv.plain()}
    if mv.vtype == ValueType.ARRAY:
        out["item_type"] = mv.item_type.name
    return out


def _same(a: MetaValue, b: MetaValue) -> bool:
    return pack_value(a) == pack_value(b)
