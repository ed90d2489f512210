"""``hf``: Hugging Face BitNet checkpoints (``BitNetForCausalLM`` folders), read and written.

Byte spec of what :func:`write_hf` writes (the packed "offline" form of
microsoft/bitnet-b1.58-2B-4T, FORMATS.md 4.1; ``docs/formats/hf.md`` says why)::

    config.json             BitNetForCausalLM, tie_word_embeddings true, quantization_config
                            {quant_method bitnet, linear_class autobitlinear, quantization_mode
                            offline}, plus a "bitformat" object (GGUF facts HF has no home for)
    generation_config.json  bos/eos ids
    tokenizer files         from bitformat.tokenizer.to_hf_files
    model.safetensors       8-byte LE header length | JSON header | data (F32, then 2-byte, then
                            U8 tensors, so every tensor is aligned to its element size)

    model.layers.N.<proj>.weight        U8 [out/4, in]; out MUST be a multiple of 4. With
                                        R = out/4, byte [r, col] holds the codes (trit + 1) of
                                        rows r, r+R, r+2R, r+3R of column col:
                                            bits  7 6 | 5 4 | 3 2 | 1 0
                                            row  r+3R | r+2R | r+R | r      (row r LOW)
    model.layers.N.<proj>.weight_scale  [1], BF16 if the scale is bf16-exact else F32; a
                                        MULTIPLIER: w = weight_scale * trit
    model.embed_tokens.weight           the GGUF dtype (F16, BF16 or F32), also the LM head
    norms                               their GGUF dtype (F32 in bitformat's files)

Reading accepts that form (also sharded), the ``bitlinear`` convention (weight_scale = 1/s)
and dense bf16/f16/f32 master weights of ``autobitlinear``/``online`` checkpoints, which are
ternarised exactly as transformers does. Code 3 in packed bytes MUST be rejected. Every
safetensors file is parsed here (numpy has no bfloat16) and treated as hostile.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import atomic_dir
from ..constants import GGMLType, ValueType
from ..container import ConvertReport, Model, TensorEntry
from ..errors import (
    BitformatIOError,
    CountTooLargeError,
    FormatError,
    InvalidScaleError,
    InvalidTritError,
    MetadataError,
    ShapeError,
    TensorLayoutError,
    TruncatedError,
    UnknownTypeError,
    UnsupportedConversionError,
)
from ..gguf_io import _ARRAY_DTYPE, MetaValue, _pack_value, _sanitize
from ..ternary import TernaryTensor, bf16_exact

ARCH = "bitnet-b1.58"
#: GGUF architectures whose graph is transformers' BitNet (ReLU^2, sub-norms, NEOX RoPE).
HF_ARCHES = ("bitnet-b1.58", "bitnet-25")
MAX_HEADER = 100_000_000  # the safetensors library's own cap on the JSON header
MAX_JSON = 256 << 20
MAX_DIMS = 8
DEFAULT_ROPE_THETA = 500000.0  # BitNetConfig.default_theta

#: safetensors dtype -> element size in bytes.
ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2,
               "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}
FLOAT_DTYPES = ("BF16", "F16", "F32")
ST_OF_GGML = {GGMLType.F32: "F32", GGMLType.F16: "F16", GGMLType.BF16: "BF16"}
GGML_OF_ST = {v: k for k, v in ST_OF_GGML.items()}

#: HF module path inside a block -> GGUF tensor name inside ``blk.N``.
BLOCK_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.attn_sub_norm": "attn_sub_norm", "mlp.ffn_sub_norm": "ffn_sub_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm"}
HF_NAME = re.compile(r"^(?:model\.layers\.(0|[1-9]\d*)\.)?(.+)\.(weight|weight_scale)$")
IGNORED = re.compile(r"^model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq$")


# -- safetensors, read ----------------------------------------------------------------------
@dataclass
class _Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    nbytes: int
    file: _SafeFile


class _SafeFile:
    """One memory-mapped safetensors file, its header strictly checked."""

    def __init__(self, path: Path):
        self.path = str(path)
        try:
            with open(path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if size < 8:
                    raise TruncatedError("file ends inside the 8-byte header length",
                                         path=self.path)
                n = struct.unpack("<Q", fh.read(8))[0]
                if n > MAX_HEADER or n > size - 8:
                    raise CountTooLargeError(f"header length {n} exceeds the cap {MAX_HEADER} "
                                             f"or the {size - 8} bytes after it", path=self.path)
                header = fh.read(n)
                self._mmap = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise BitformatIOError(f"cannot read: {exc.strerror}", path=self.path) from None
        try:
            self.tensors = self._parse(header, 8 + n, size - 8 - n)
        except BaseException:
            self._mmap.close()
            raise

    def _parse(self, header: bytes, data_start: int, data_size: int) -> dict[str, _Tensor]:
        try:
            obj = json.loads(header.decode("utf-8"), object_pairs_hook=_unique_keys)
        except (UnicodeDecodeError, ValueError) as exc:
            raise FormatError(f"header is not valid JSON ({exc})", path=self.path) from None
        if not isinstance(obj, dict):
            raise FormatError("header is not a JSON object", path=self.path)
        out: dict[str, _Tensor] = {}
        for name, info in obj.items():
            if name == "__metadata__":
                if not isinstance(info, dict) or not all(
                        isinstance(v, str) for v in info.values()):
                    raise FormatError("__metadata__ must map strings to strings", path=self.path)
                continue
            tensor = _sanitize(name)
            if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
                raise FormatError("entry must hold exactly dtype, shape and data_offsets",
                                  path=self.path, tensor=tensor)
            dtype, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
            if not isinstance(dtype, str) or dtype not in ST_ITEMSIZE:
                raise UnknownTypeError(f"unknown dtype {_sanitize(str(dtype))!r}",
                                       path=self.path, tensor=tensor)
            if not (isinstance(shape, list) and len(shape) <= MAX_DIMS and all(_is_uint(d)
                                                                              for d in shape)):
                raise FormatError(f"shape must be a list of at most {MAX_DIMS} non-negative "
                                  "integers", path=self.path, tensor=tensor)
            if not (isinstance(offs, list) and len(offs) == 2 and all(_is_uint(o) for o in offs)
                    and offs[0] <= offs[1] <= data_size):
                raise TensorLayoutError(f"data_offsets {offs!r} do not lie inside the "
                                        f"{data_size} data bytes", path=self.path, tensor=tensor)
            n = ST_ITEMSIZE[dtype]
            for d in shape:
                n *= d
            if n != offs[1] - offs[0]:
                raise FormatError(f"{dtype} {shape} needs {n} bytes, data_offsets span "
                                  f"{offs[1] - offs[0]}", path=self.path, tensor=tensor)
            out[name] = _Tensor(name, dtype, tuple(shape), data_start + offs[0], n, self)
        end, last = data_start, None
        for t in sorted(out.values(), key=lambda t: (t.start, t.nbytes)):
            if t.start < end:
                raise TensorLayoutError(f"data overlaps tensor {_sanitize(last)!r}",
                                        path=self.path, tensor=_sanitize(t.name))
            end, last = t.start + t.nbytes, t.name
        return out

    def raw(self, t: _Tensor) -> np.ndarray:
        return np.frombuffer(self._mmap, dtype=np.uint8, count=t.nbytes, offset=t.start)

    def close(self) -> None:
        try:
            self._mmap.close()
        except BufferError:
            pass  # arrays still view the map; it closes when they are gone


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {_sanitize(k)!r} appears twice")
        out[k] = v
    return out


def _is_uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_JSON + 1)
    except OSError as exc:
        raise BitformatIOError(f"cannot read {what}: {exc.strerror}", path=str(path)) from None
    if len(data) > MAX_JSON:
        raise CountTooLargeError(f"{what} is larger than {MAX_JSON} bytes", path=str(path))
    try:
        obj = json.loads(data.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, ValueError) as exc:
        raise FormatError(f"{what} is not valid JSON ({exc})", path=str(path)) from None
    if not isinstance(obj, dict):
        raise FormatError(f"{what} is not a JSON object", path=str(path))
    return obj


def _read_tensors(folder: Path) -> tuple[dict[str, _Tensor], list[_SafeFile]]:
    """Every tensor of the checkpoint, single-file or sharded through the index."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        if not (folder / "model.safetensors").is_file():
            raise FormatError("no model.safetensors or model.safetensors.index.json",
                              path=str(folder))
        f = _SafeFile(folder / "model.safetensors")
        return dict(f.tensors), [f]
    wmap = _read_json(index, "the index").get("weight_map")
    if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
        raise FormatError("weight_map must map tensor names to file names", path=str(index))
    files: dict[str, _SafeFile] = {}
    tensors: dict[str, _Tensor] = {}
    try:
        for name, fname in wmap.items():
            if Path(fname).name != fname or fname in (".", "..") or not fname.endswith(
                    ".safetensors"):
                raise FormatError(f"shard {_sanitize(fname)!r} is not a .safetensors file "
                                  "in the folder", path=str(index), tensor=_sanitize(name))
            if fname not in files:
                files[fname] = _SafeFile(folder / fname)
            if name not in files[fname].tensors:
                raise FormatError(f"tensor listed in the index is not in {_sanitize(fname)}",
                                  path=str(index), tensor=_sanitize(name))
            tensors[name] = files[fname].tensors[name]
    except BaseException:
        for f in files.values():
            f.close()
        raise
    return tensors, list(files.values())


# -- safetensors, write ---------------------------------------------------------------------
def _st_header(entries: list[tuple[str, str, tuple[int, ...], int]]) -> bytes:
    """Header for (name, dtype, shape, nbytes) laid out back to back, padded to 8 bytes."""
    head: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        head[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset,
                                                                               offset + nbytes]}
        offset += nbytes
    raw = json.dumps(head, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


# -- packing ---------------------------------------------------------------------------------
SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1, 1)


def pack_rows(trits: np.ndarray) -> np.ndarray:
    """int8 trits [out, in] -> uint8 [out/4, in], four rows R apart per byte, row r LOW."""
    rows, cols = trits.shape
    codes = (trits + 1).astype(np.uint8).reshape(4, rows // 4, cols)
    return np.bitwise_or.reduce(codes << SHIFTS, axis=0)


def unpack_rows(packed: np.ndarray, *, path: str | None = None,
                tensor: str | None = None) -> np.ndarray:
    """uint8 [out/4, in] -> int8 trits [out, in]; code 3 raises :class:`InvalidTritError`."""
    r, cols = packed.shape
    codes = (packed[None] >> SHIFTS) & 3  # [4, R, in]: bit pair k holds rows k*R + r
    bad = codes == 3
    if bad.any():
        k, row, col = (int(i) for i in np.argwhere(bad)[0])
        raise InvalidTritError(f"code 3 (not a trit) at row {k * r + row}, column {col} "
                               f"(byte [{row}, {col}], bits {2 * k}-{2 * k + 1})", path=path,
                               tensor=tensor)
    return (codes.view(np.int8) - 1).reshape(4 * r, cols)


def _floats(raw: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values of BF16/F16/F32 bytes (exact for all three)."""
    if dtype == "BF16":
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    return raw.view("<f2" if dtype == "F16" else "<f4").astype(np.float32, copy=False)


def convert_floats(raw: np.ndarray, src: str, dst: str) -> np.ndarray | None:
    """BF16/F16/F32 bytes as ``dst`` bytes (uint8), or None unless every value is exact.

    Works in 16 MiB pieces, so a 2B-4T embedding needs no float32 copy of itself.
    """
    if src == dst:
        return raw
    out = np.empty(raw.size // ST_ITEMSIZE[src] * ST_ITEMSIZE[dst], dtype=np.uint8)
    at = 0
    for chunk in _chunks(raw, ST_ITEMSIZE[src]):
        piece = _convert_piece(chunk, src, dst)
        if piece is None:
            return None
        out[at:at + piece.size] = piece
        at += piece.size
    return out


def _convert_piece(raw: np.ndarray, src: str, dst: str) -> np.ndarray | None:
    if src == dst:
        return raw
    x = _floats(raw, src)
    if dst == "F32":
        return x.view(np.uint8)
    if dst == "BF16":
        bits = x.view(np.uint32)
        return None if (bits & 0xFFFF).any() else (bits >> 16).astype("<u2").view(np.uint8)
    with np.errstate(over="ignore"):
        y = x.astype("<f2")
    same = np.array_equal(y.astype(np.float32).view(np.uint32), x.view(np.uint32))
    return y.view(np.uint8) if same else None


def _chunks(raw: np.ndarray, itemsize: int, step: int = 1 << 24):
    step -= step % itemsize
    for i in range(0, raw.size, step):
        yield raw[i:i + step]


def ternarise(w: np.ndarray) -> tuple[np.ndarray, np.float32]:
    """Absmean ternarisation as transformers' ``WeightQuant`` does it, in float32.

    ``inv = 1 / max(mean|W|, 1e-5)``, ``t = clamp(round(W * inv), -1, 1)``; the weight it
    uses is ``t / inv``, so the scale is ``1 / inv`` (both divisions rounded to float32). The
    mean is the correctly rounded float32 of the exact mean; torch's float32 reduction may
    differ from it in the last bit for large tensors.
    """
    m = np.float32(np.abs(w, dtype=np.float32).mean(dtype=np.float64))
    inv = np.float32(1.0) / max(m, np.float32(1e-5))
    trits = np.clip(np.rint(w * inv), -1, 1).astype(np.int8)
    return trits, np.float32(1.0) / inv


# -- config.json <-> GGUF metadata -----------------------------------------------------------
@dataclass
class _Hyper:
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

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """GGUF name -> expected numpy shape of every tensor the model must have."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, f = self.hidden, self.ff
        out = {"token_embd.weight": (self.vocab, h), "output_norm.weight": (h,)}
        per = {"attn_norm": (h,), "ffn_norm": (h,), "attn_sub_norm": (h,), "ffn_sub_norm": (f,),
               "attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, q),
               "ffn_gate": (f, h), "ffn_up": (f, h), "ffn_down": (h, f)}
        for i in range(self.layers):
            out.update({f"blk.{i}.{k}.weight": s for k, s in per.items()})
        return out


def _need(src: dict[str, Any], key: str, kind: type, where: str, default: Any = None) -> Any:
    v = src.get(key, default)
    ok = (isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v) and v > 0
          if kind is float else isinstance(v, int) and not isinstance(v, bool) and v > 0)
    if not ok:
        raise MetadataError(f"{key} must be a positive {kind.__name__}, got {v!r}", path=where)
    return kind(v)


def _hyper_from_config(cfg: dict[str, Any], where: str) -> _Hyper:
    heads = _need(cfg, "num_attention_heads", int, where)
    hidden = _need(cfg, "hidden_size", int, where)
    kv = _need(cfg, "num_key_value_heads", int, where, heads)
    head_dim = cfg.get("head_dim") or (hidden // heads)
    rope = cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict) or rope.get("rope_type", "default") != "default":
        raise UnsupportedConversionError(f"rope_parameters {rope!r}: only default RoPE has a "
                                         "GGUF equivalent here", path=where)
    theta = rope.get("rope_theta", cfg.get("rope_theta", DEFAULT_ROPE_THETA))
    h = _Hyper(_need(cfg, "vocab_size", int, where), hidden,
               _need(cfg, "intermediate_size", int, where),
               _need(cfg, "num_hidden_layers", int, where), heads, kv,
               _need({"head_dim": head_dim}, "head_dim", int, where),
               _need(cfg, "max_position_embeddings", int, where, 2048),
               _need(cfg, "rms_norm_eps", float, where, 1e-5),
               _need({"rope_theta": theta}, "rope_theta", float, where))
    if heads % kv:
        raise MetadataError(f"{heads} attention heads do not group into {kv} kv heads",
                            path=where)
    return h


def _hyper_from_metadata(meta: dict[str, MetaValue], arch: str, rows: int, where: str) -> _Hyper:
    src = {k[len(arch) + 1:]: v.value for k, v in meta.items() if k.startswith(arch + ".")}
    heads = _need(src, "attention.head_count", int, where)
    hidden = _need(src, "embedding_length", int, where)
    return _Hyper(
        _need(src, "vocab_size", int, where, rows), hidden,
        _need(src, "feed_forward_length", int, where), _need(src, "block_count", int, where),
        heads, _need(src, "attention.head_count_kv", int, where, heads),
        _need(src, "rope.dimension_count", int, where, hidden // heads),
        _need(src, "context_length", int, where, 2048),
        _need(src, "attention.layer_norm_rms_epsilon", float, where),
        _need(src, "rope.freq_base", float, where, 10000.0))  # llama.cpp's default


def _f32(x: float) -> float:
    """The shortest decimal that reads back as the same float32 (1e-05, not 9.99e-06)."""
    return float(str(np.float32(x)))


def _derived_metadata(h: _Hyper, arch: str, tokenizer: dict[str, MetaValue]
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
    meta.update(tokenizer)
    return meta


def _meta_to_json(mv: MetaValue) -> dict[str, Any]:
    out: dict[str, Any] = {"type": mv.vtype.name, "value": mv.plain()}
    if mv.vtype == ValueType.ARRAY:
        out["item_type"] = mv.item_type.name
    return out


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
            arr = np.asarray(value, dtype=_ARRAY_DTYPE[item])
            if arr.ndim != 1 or (arr.dtype.kind in "iu" and not np.array_equal(arr, value)):
                raise TypeError("values out of range")
            return MetaValue(vtype, arr.astype(bool) if item == ValueType.BOOL else arr, item)
        ok = {ValueType.STRING: str, ValueType.BOOL: bool}.get(
            vtype, (int, float) if vtype in (ValueType.FLOAT32, ValueType.FLOAT64) else int)
        if not isinstance(value, ok) or (ok is int and isinstance(value, bool)):
            raise TypeError("wrong type")
        mv = MetaValue(vtype, float(value) if vtype.name.startswith("FLOAT") else value)
        _pack_value(mv)  # range check (struct raises for out-of-range integers)
        return mv
    except (KeyError, TypeError, ValueError, OverflowError, struct.error, AttributeError):
        raise MetadataError(f"bitformat.metadata[{_sanitize(key)!r}] is not a typed GGUF value",
                            path=where) from None


def _same(a: MetaValue, b: MetaValue) -> bool:
    return _pack_value(a) == _pack_value(b)


def hf_module(gguf: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj`` (names already checked)."""
    parts = gguf.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{HF_OF_BLOCK[parts[2]]}"
    return HF_OF_TOP[parts[0]]


HF_OF_BLOCK = {v: k for k, v in BLOCK_NAMES.items()}
HF_OF_TOP = {v: k for k, v in TOP_NAMES.items()}


def _default_order(names: list[str]) -> list[str]:
    """The official GGUF's order: the HF names sorted as strings (layers 0, 1, 10, 11, ...)."""
    return sorted(names, key=hf_module)


# -- reading ----------------------------------------------------------------------------------
@dataclass
class _Projection:
    tensor: _Tensor
    rows: int
    cols: int
    scale: np.float32 | None  # None: dense master weights, ternarised on load


def _quant_mode(cfg: dict[str, Any], where: str) -> tuple[str, str]:
    """(linear_class, quantization_mode), transformers' defaults filled in; refuses others."""
    qc = cfg.get("quantization_config")
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


def _read_record(cfg: dict[str, Any], where: str
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


def open_hf(path: str | os.PathLike) -> Model:
    """Open a Hugging Face BitNet folder as a :class:`~bitformat.container.Model`.

    Metadata is GGUF-style (``bitnet-b1.58.*`` and the tokenizer's keys); tensors carry their
    GGUF names in the official file's order. Packed projections decode to their trits and
    per-tensor scale; dense master weights are ternarised as transformers does. A
    ``bitlinear`` checkpoint stores 1/s: its scale is read as the float32 nearest to 1/stored,
    and the relative change is kept in the model's ``scale_changes``.
    """
    from ..tokenizer import from_hf_files

    folder = Path(path)
    where = str(folder / "config.json")
    cfg = _read_json(folder / "config.json", "config.json")
    if cfg.get("model_type") != "bitnet":
        raise UnsupportedConversionError(f"model_type {cfg.get('model_type')!r} is not bitnet "
                                         "(BitNetForCausalLM)", path=where)
    linear, mode = _quant_mode(cfg, where)
    h = _hyper_from_config(cfg, where)
    order, extras, omit, torder, types = _read_record(cfg, where)
    tensors, files = _read_tensors(folder)
    try:
        arch_mv = extras.get("general.architecture")
        arch = arch_mv.value if arch_mv is not None and arch_mv.value in HF_ARCHES else ARCH
        tok = from_hf_files(folder) if (folder / "tokenizer.json").is_file() else {}
        derived = _derived_metadata(h, arch, tok)
        meta = {k: extras.get(k, derived.get(k)) for k in order if k in extras or k in derived}
        meta.update((k, v) for k, v in derived.items() if k not in meta and k not in omit)
        model = _build(folder, cfg, h, (linear, mode), tensors, files, meta, (torder, types))
    except BaseException:
        for f in files:
            f.close()
        raise
    return model


def _build(folder: Path, cfg: dict[str, Any], h: _Hyper, quant: tuple[str, str],
           tensors: dict[str, _Tensor], files: list[_SafeFile], meta: dict[str, MetaValue],
           record: tuple[list[str], dict[str, str]]) -> Model:
    """Map the checkpoint's tensors to GGUF entries, check them, and wrap them as a Model."""
    where = str(folder)
    linear, mode = quant
    shapes = h.shapes()
    found: dict[str, _Tensor] = {}
    scales: dict[str, _Tensor] = {}
    for name in sorted(tensors):
        if IGNORED.match(name) or name == "lm_head.weight":
            continue
        m = HF_NAME.match(name)
        layer, module, kind = m.groups() if m else (None, None, None)
        gguf = None
        if layer is None and module in TOP_NAMES and kind == "weight":
            gguf = f"{TOP_NAMES[module]}.weight"
        elif layer is not None and module in BLOCK_NAMES and int(layer) < h.layers:
            gguf = f"blk.{layer}.{BLOCK_NAMES[module]}.weight"
            if kind == "weight_scale" and BLOCK_NAMES[module] not in PROJECTIONS:
                gguf = None
        if gguf is None:
            raise FormatError("unexpected tensor for a BitNetForCausalLM with "
                              f"{h.layers} layers", path=where, tensor=_sanitize(name))
        (scales if kind == "weight_scale" else found)[gguf] = tensors[name]
    missing = [n for n in shapes if n not in found]
    if missing:
        raise FormatError(f"missing tensor {hf_module(missing[0])}.weight", path=where)
    emb = found["token_embd.weight"]
    head = tensors.get("lm_head.weight")
    if head is not None and (head.dtype, head.shape) == (emb.dtype, emb.shape) and np.array_equal(
            head.file.raw(head), emb.file.raw(emb)):
        head = None  # a saved copy of the tied embedding
    if head is not None or (tensors.get("lm_head.weight") is None
                            and cfg.get("tie_word_embeddings") is not True):
        raise UnsupportedConversionError("the LM head is not tied to embed_tokens, which the "
                                         "GGUF graph requires", path=where)

    plain: dict[str, tuple[_Tensor, GGMLType]] = {}
    tern: dict[str, _Projection] = {}
    scale_changes: dict[str, float] = {}
    entries = []
    torder, types = record
    for gguf in _ordered(list(found), torder):
        t, want = found[gguf], shapes[gguf]
        where_t = (t.file.path, _sanitize(t.name))
        if gguf.split(".")[-2] not in PROJECTIONS:
            if t.dtype not in FLOAT_DTYPES or t.shape != want:
                raise ShapeError(f"expected a float tensor {list(want)}, found {t.dtype} "
                                 f"{list(t.shape)}", path=where_t[0], tensor=where_t[1])
            dst = types.get(gguf, t.dtype if gguf == "token_embd.weight" else "F32")
            plain[gguf] = (t, dst)
            nbytes = int(np.prod(want)) * ST_ITEMSIZE[dst]
            entries.append(TensorEntry(gguf, want, dst, nbytes, False))
            continue
        rows, cols = want
        if t.dtype == "U8":
            if mode != "offline":
                raise UnsupportedConversionError(
                    "packed weights in an online checkpoint (transformers would use the bytes "
                    "as master weights)", path=where_t[0], tensor=where_t[1])
            if rows % 4 or t.shape != (rows // 4, cols):
                raise ShapeError(f"packed weights of a {rows}x{cols} projection must be U8 "
                                 f"[{rows / 4:g}, {cols}], found {list(t.shape)}",
                                 path=where_t[0], tensor=where_t[1])
            s, change = _packed_scale(scales.pop(gguf, None), linear, *where_t)
            if change:
                scale_changes[gguf] = change
            tern[gguf] = _Projection(t, rows, cols, s)
        elif t.dtype in FLOAT_DTYPES and t.shape == want:
            if (linear, mode) != ("autobitlinear", "online") or gguf in scales:
                raise UnsupportedConversionError(
                    f"dense weights in a {linear}/{mode} checkpoint are not ternary (transformers"
                    " uses them as they are)", path=where_t[0], tensor=where_t[1])
            tern[gguf] = _Projection(t, rows, cols, None)
        else:
            raise ShapeError(f"expected U8 [{rows // 4}, {cols}] or float {list(want)}, found "
                             f"{t.dtype} {list(t.shape)}", path=where_t[0], tensor=where_t[1])
        entries.append(TensorEntry(gguf, want, "hf", t.nbytes, True))
    if scales:
        raise FormatError("weight_scale without packed weights", path=where,
                          tensor=hf_module(next(iter(scales))) + ".weight_scale")

    def load_ternary(name: str) -> TernaryTensor:
        if name not in tern:
            raise KeyError(f"{name!r} is not a ternary tensor")
        p = tern[name]
        raw = p.tensor.file.raw(p.tensor)
        if p.scale is None:
            trits, s = ternarise(_floats(raw, p.tensor.dtype).reshape(p.rows, p.cols))
        else:
            trits = unpack_rows(raw.reshape(p.rows // 4, p.cols), path=p.tensor.file.path,
                                tensor=_sanitize(p.tensor.name))
            s = p.scale
        return TernaryTensor(trits, np.float32([s]), 0, name)

    def load_plain(name: str) -> tuple[GGMLType, np.ndarray]:
        t, dst = plain[name]
        raw = convert_floats(t.file.raw(t), t.dtype, dst)
        if raw is None:
            raise FormatError(f"config.json records type {dst}, which cannot hold these "
                              f"{t.dtype} values exactly", path=t.file.path,
                              tensor=_sanitize(t.name))
        return GGML_OF_ST[dst], raw

    def close() -> None:
        for f in files:
            f.close()

    model = Model(where, meta, entries, "hf", load_ternary, load_plain, close)
    model.scale_changes = scale_changes
    return model


def _ordered(names: list[str], recorded: list[str]) -> list[str]:
    """The recorded tensor order if it is a permutation of ``names``, else the default."""
    if sorted(recorded) == sorted(names):
        return list(recorded)
    return _default_order(names)


def _packed_scale(t: _Tensor | None, linear: str, path: str, tensor: str
                  ) -> tuple[np.float32, float]:
    """The multiplier s of a packed projection and the relative change reading it made."""
    if t is None:
        raise FormatError("packed weights without weight_scale", path=path, tensor=tensor)
    if t.dtype not in FLOAT_DTYPES or int(np.prod(t.shape)) != 1:
        raise ShapeError(f"weight_scale must be one BF16/F16/F32 value, found {t.dtype} "
                         f"{list(t.shape)}", path=path, tensor=tensor)
    stored = _floats(t.file.raw(t), t.dtype)[0]
    if linear == "autobitlinear":
        s = stored
    else:  # bitlinear divides by it: s = 1/stored, rounded to the nearest float32
        with np.errstate(divide="ignore", over="ignore"):
            s = np.float32(1.0) / stored
    if not np.isfinite(s):
        raise InvalidScaleError(f"weight_scale {float(stored)!r} gives scale {float(s)!r} "
                                f"({linear})", path=path, tensor=tensor)
    change = 0.0 if linear == "autobitlinear" else abs(1.0 - float(s) * float(stored))
    return s, change


# -- writing ----------------------------------------------------------------------------------
DROPPED = ("general.file_type", "general.alignment")  # the GGUF writer regenerates these


def _check_exportable(model, arch: str) -> _Hyper:
    """Refuse (before writing anything) what a packed BitNetForCausalLM folder cannot hold."""
    if arch not in HF_ARCHES:
        raise UnsupportedConversionError(
            f"architecture {arch!r} is not transformers' BitNet (ReLU^2 FFN, sub-norms); "
            f"the hf export takes {' or '.join(HF_ARCHES)}", path=model.path)
    names = {e.name: e for e in model.entries}
    if "token_embd.weight" not in names:
        raise FormatError("missing tensor token_embd.weight", path=model.path)
    h = _hyper_from_metadata(model.metadata, arch, names["token_embd.weight"].shape[0],
                             model.path)
    shapes = h.shapes()
    for name, e in names.items():
        if name not in shapes:
            why = ("an untied LM head (output.weight) has no place next to the tied embedding"
                   if name == "output.weight" else "no BitNetForCausalLM tensor maps to it")
            raise UnsupportedConversionError(why, path=model.path, tensor=name)
        if e.shape != shapes[name]:
            raise ShapeError(f"shape {list(e.shape)} does not match the metadata's "
                             f"{list(shapes[name])}", path=model.path, tensor=name)
        if e.ternary != (name.split(".")[-2] in PROJECTIONS):
            raise UnsupportedConversionError("ternary and plain tensors are not where "
                                             "BitNet has them", path=model.path, tensor=name)
        if e.ternary and e.shape[0] % 4:
            raise ShapeError(f"{e.shape[0]} output rows: the packed form needs a multiple of 4",
                             path=model.path, tensor=name)
        if not e.ternary and model.plain(name)[0] not in ST_OF_GGML:
            raise UnsupportedConversionError(f"{e.encoding} tensors cannot be stored "
                                             "losslessly in safetensors", path=model.path,
                                             tensor=name)
    missing = [n for n in shapes if n not in names]
    if missing:
        raise FormatError(f"missing tensor {missing[0]}", path=model.path)
    return h


def _folder_dtype(model, dtype: str | None) -> str:
    """One float dtype for the embedding and the norms.

    transformers 5 keeps every non-projection tensor in its checkpoint dtype whatever
    ``from_pretrained(dtype=...)`` asks, and a mix of dtypes fails at the first matmul; and
    float16 compute overflows (activations are integers up to 127 before the scale is
    applied). So: BF16 if the embedding is BF16 and every norm is exact in it (the official
    checkpoint's layout), else F32; or ``dtype`` ("float32", "bfloat16", "float16") if asked.
    """
    plain = [e.name for e in model.entries if not e.ternary]
    if dtype is not None:
        want = {v: k for k, v in TORCH_DTYPE.items()}.get(dtype)
        if want is None:
            raise UnsupportedConversionError(f"dtype {dtype!r}: choose one of "
                                             f"{', '.join(TORCH_DTYPE.values())}")
        candidates = [want]
    else:
        candidates = ["BF16", "F32"] if model.plain("token_embd.weight")[0] == GGMLType.BF16 \
            else ["F32"]
    for c in candidates:
        bad = next((n for n in plain if not _fits(model, n, c)), None)
        if bad is None:
            return c
    raise UnsupportedConversionError(f"{TORCH_DTYPE[c]} cannot hold every value exactly",
                                     path=model.path, tensor=bad)


def _fits(model, name: str, dst: str) -> bool:
    gtype, raw = model.plain(name)
    src = ST_OF_GGML[gtype]
    if src == dst or dst == "F32":
        return True
    return all(_convert_piece(c, src, dst) is not None for c in _chunks(raw, ST_ITEMSIZE[src]))


TORCH_DTYPE = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def _config(model, h: _Hyper, dtype: str) -> dict[str, Any]:
    tok = {k: model.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding")}
    cfg: dict[str, Any] = {
        "architectures": ["BitNetForCausalLM"], "model_type": "bitnet",
        "vocab_size": h.vocab, "hidden_size": h.hidden, "intermediate_size": h.ff,
        "num_hidden_layers": h.layers, "num_attention_heads": h.heads,
        "num_key_value_heads": h.kv_heads, "hidden_act": "relu2",
        "max_position_embeddings": h.context, "rms_norm_eps": _f32(h.eps),
        "rope_theta": _f32(h.theta), "tie_word_embeddings": True, "attention_bias": False,
        "attention_dropout": 0.0, "use_cache": True, "bos_token_id": tok["bos"],
        "eos_token_id": tok["eos"], "pad_token_id": tok["padding"],
        "torch_dtype": TORCH_DTYPE[dtype],
        "quantization_config": {"quant_method": "bitnet", "linear_class": "autobitlinear",
                                "quantization_mode": "offline"},
    }
    if h.head_dim != h.hidden // h.heads:
        cfg["head_dim"] = h.head_dim
    return cfg


def write_hf(model: Model, out: str | os.PathLike, *, allow_scale_rounding: bool = False,
             progress: Callable[[TensorEntry], None] | None = None,
             dtype: str | None = None) -> ConvertReport:
    """Write ``model`` as a packed ``autobitlinear``/``offline`` BitNetForCausalLM folder.

    The folder appears at ``out`` only once complete. Per-block scales (TQ containers) are
    reduced to one per tensor, refused with :class:`ScaleLossError` unless
    ``allow_scale_rounding``. The embedding and norms share one dtype (see
    :func:`_folder_dtype`). GGUF facts that config.json and the
    tokenizer files cannot carry exactly go into config.json's ``"bitformat"`` object, so
    converting the folder back gives the same GGUF bytes.
    """
    from ..tokenizer import from_hf_files, to_hf_files

    arch = model.architecture
    h = _check_exportable(model, arch)
    fdt = _folder_dtype(model, dtype)
    report = ConvertReport(model.path, str(out), "hf")
    report.scale_changes.update(getattr(model, "scale_changes", {}))
    with atomic_dir(out) as tmp:
        plan = _write_packed(model, tmp / ".packed", fdt, allow_scale_rounding, report,
                             progress)
        _write_safetensors(model, tmp / "model.safetensors", tmp / ".packed", plan)
        report.bytes_written = sum(p[3] for p in plan)
        cfg = _config(model, h, fdt)
        tok = {}
        if "tokenizer.ggml.model" in model.metadata:
            to_hf_files(model.metadata, tmp)
            tok = from_hf_files(tmp)
        derived = _derived_metadata(_hyper_from_config(cfg, str(out)), arch, tok)
        source = {k: v for k, v in model.metadata.items()
                  if k not in DROPPED and not k.startswith("bitformat.")}
        names = [e.name for e in model.entries]
        types = {e.name: e.encoding for e in model.entries if not e.ternary}
        cfg["bitformat"] = {
            "version": 1, "metadata_order": list(source),
            "metadata": {k: _meta_to_json(v) for k, v in source.items()
                         if k not in derived or not _same(derived[k], v)},
            "omit": [k for k in derived if k not in source],
            "tensor_order": [] if names == _default_order(names) else names,
            "tensor_types": {k: v for k, v in types.items()
                             if v != (fdt if k == "token_embd.weight" else "F32")},
        }
        gen = {k: cfg[f"{k}_token_id"] for k in ("bos", "eos", "pad")
               if cfg[f"{k}_token_id"] is not None}
        for fname, obj in (("config.json", cfg), ("generation_config.json", gen)):
            (tmp / fname).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n",
                                     encoding="utf-8")
    return report


def _write_packed(model, packed_path: Path, fdt: str, allow: bool, report, progress
                  ) -> list[tuple[str, str, tuple[int, ...], int, Any]]:
    """Pack every ternary tensor into a side file (one decode each); plan every tensor.

    Returns (hf name, dtype, shape, nbytes, source) where source is ("plain", gguf name),
    ("packed", offset in the side file) or ("bytes", the scale's bytes).
    """
    plan = []
    with open(packed_path, "wb") as fh:
        for e in model.entries:
            hf = hf_module(e.name)
            if e.ternary:
                t, loss = model.ternary(e.name).with_tensor_scale(allow)
                if loss:
                    report.scale_changes[e.name] = loss
                packed = pack_rows(t.trits)
                plan.append((f"{hf}.weight", "U8", packed.shape, packed.nbytes,
                             ("packed", fh.tell())))
                fh.write(memoryview(np.ascontiguousarray(packed)).cast("B"))
                s = np.float32(t.scales[0])
                if bf16_exact(s):
                    data, dtype = (s.view(np.uint32) >> 16).astype("<u2").tobytes(), "BF16"
                else:
                    data, dtype = s.astype("<f4").tobytes(), "F32"
                plan.append((f"{hf}.weight_scale", dtype, (1,), len(data), ("bytes", data)))
                report.ternary_weights += t.rows * t.cols
            else:
                plan.append((f"{hf}.weight", fdt, e.shape,
                             int(np.prod(e.shape)) * ST_ITEMSIZE[fdt], ("plain", e.name)))
            report.tensors += 1
            if progress is not None:
                progress(e)
    return plan


def _write_safetensors(model, path: Path, packed_path: Path, plan: list) -> None:
    """Header, then 4-byte, 2-byte and 1-byte tensors (each group by name): all aligned."""
    plan = sorted(plan, key=lambda p: (-ST_ITEMSIZE[p[1]], p[0]))
    with open(path, "wb") as fh, open(packed_path, "rb") as side:
        fh.write(_st_header([p[:4] for p in plan]))
        for _name, dtype, _shape, nbytes, (kind, src) in plan:
            if kind == "plain":
                gtype, raw = model.plain(src)
                for chunk in _chunks(raw, ST_ITEMSIZE[ST_OF_GGML[gtype]]):
                    fh.write(memoryview(_convert_piece(chunk, ST_OF_GGML[gtype], dtype)))
            elif kind == "bytes":
                fh.write(src)
            else:
                side.seek(src)
                left = nbytes
                while left:
                    chunk = side.read(min(left, 1 << 24))
                    fh.write(chunk)
                    left -= len(chunk)
        fh.flush()
        os.fsync(fh.fileno())
    os.unlink(packed_path)
