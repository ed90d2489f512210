"""``hf``: Hugging Face BitNet checkpoints (``BitNetForCausalLM`` folders), read and written.

Byte spec of what :func:`write_hf` writes (the packed "offline" form of
microsoft/bitnet-b1.58-2B-4T; ``docs/formats/hf.md`` says why)::

    config.json             BitNetForCausalLM, tie_word_embeddings true, quantization_config
                            {quant_method bitnet, linear_class autobitlinear, quantization_mode
                            offline}, plus a "bitformat" object (GGUF facts HF has no home for)
    generation_config.json  bos/eos ids
    tokenizer files         from bitformat.tokenizers.bpe.to_hf_files
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
safetensors file is parsed by :mod:`bitformat.io.safetensors` and treated as hostile;
config.json <-> GGUF metadata is :mod:`bitformat.formats.hf_config`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..constants import GGMLType
from ..errors import (
    FormatError,
    InvalidScaleError,
    InvalidTritError,
    ShapeError,
    UnsupportedConversionError,
)
from ..families import Family, family_of, hf_family
from ..io.atomic import checkpoint
from ..io.atomic_folder import atomic_dir
from ..io.gguf import MetaValue, sanitize
from ..io.model import ConvertReport, Model, TensorEntry
from ..io.safetensors import (
    FLOAT_DTYPES,
    GGML_OF_ST,
    ST_ITEMSIZE,
    ST_OF_GGML,
    SafeFile,
    SafeTensor,
    as_float32,
    convert_floats,
    exact_in,
    read_json,
    read_tensors,
    write_safetensors,
)
from ..quantize import ABSMEAN, absmean
from ..ternary import TernaryTensor, bf16_exact
from .hf_config import (
    PROJECTIONS,
    TORCH_DTYPE,
    Hyper,
    bitformat_record,
    config_json,
    gguf_metadata,
    gguf_names,
    hf_module,
    hyper_from_config,
    hyper_from_metadata,
    linear_class,
    quant_mode,
    read_record,
    tensor_order,
)

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


#: Absmean ternarisation as transformers' ``WeightQuant`` does it, in float32 (one quantizer for
#: every container: :mod:`bitformat.quantize` says where transformers and bitnet.cpp differ).
ternarise = absmean


# -- reading ----------------------------------------------------------------------------------
@dataclass
class _Projection:
    tensor: SafeTensor
    rows: int
    cols: int
    scale: np.float32 | None  # None: dense master weights, ternarised on load


def open_hf(path: str | os.PathLike) -> Model:
    """Open a Hugging Face BitNet folder as a :class:`~bitformat.container.Model`.

    Metadata is GGUF-style (``bitnet-b1.58.*`` and the tokenizer's keys); tensors carry their
    GGUF names in the official file's order. Packed projections decode to their trits and
    per-tensor scale; dense master weights are ternarised as transformers does. A
    ``bitlinear`` checkpoint stores 1/s: its scale is read as the float32 nearest to 1/stored,
    and the relative change is kept in the model's ``scale_changes``.
    """
    from ..tokenizers.bpe import from_hf_files

    folder = Path(path)
    where = str(folder / "config.json")
    cfg = read_json(folder / "config.json", "config.json")
    try:
        hf_family(cfg)
    except UnsupportedConversionError as e:
        raise UnsupportedConversionError(str(e), path=where) from None
    linear, mode = quant_mode(cfg, where)
    h = hyper_from_config(cfg, where)
    order, extras, omit, torder, types = read_record(cfg, where)
    tensors, files = read_tensors(folder)
    try:
        tok = from_hf_files(folder) if (folder / "tokenizer.json").is_file() else {}
        meta = gguf_metadata(h, order, extras, omit, tok)
        model = _build(folder, cfg, h, (linear, mode), tensors, files, meta, (torder, types))
    except BaseException:
        for f in files:
            f.close()
        raise
    return model


def _build(folder: Path, cfg: dict[str, Any], h: Hyper, quant: tuple[str, str],
           tensors: dict[str, SafeTensor], files: list[SafeFile], meta: dict[str, MetaValue],
           record: tuple[list[str], dict[str, str]]) -> Model:
    """Map the checkpoint's tensors to GGUF entries, check them, and wrap them as a Model."""
    where = str(folder)
    linear, mode = quant
    fam = h.family
    weights, scale_names = gguf_names(tensors, h.layers, where, fam)
    found = {gguf: tensors[name] for gguf, name in weights.items()}
    scales = {gguf: tensors[name] for gguf, name in scale_names.items()}
    emb, head = found.get("token_embd.weight"), found.get("output.weight")
    if head is not None and emb is not None and (head.dtype, head.shape) == (
            emb.dtype, emb.shape) and np.array_equal(head.file.raw(head), emb.file.raw(emb)):
        head = found.pop("output.weight")  # a saved copy of the tied embedding
        head = None
    if head is None and cfg.get("tie_word_embeddings") is not True:
        raise UnsupportedConversionError("no lm_head.weight, and tie_word_embeddings is not "
                                         "true: the folder has no LM head", path=where)
    if head is not None and cfg.get("tie_word_embeddings") is True:
        raise UnsupportedConversionError("tie_word_embeddings is true but lm_head.weight "
                                         "differs from embed_tokens", path=where)
    shapes = h.shapes(untied=head is not None)
    missing = [n for n in shapes if n not in found]
    if missing:
        raise FormatError(f"missing tensor {hf_module(missing[0], fam)}.weight", path=where)

    plain: dict[str, tuple[SafeTensor, GGMLType]] = {}
    tern: dict[str, _Projection] = {}
    quantized: dict[str, str] = {}  # masters: tensor -> its float type
    rules: dict[str, str] = {}
    scale_changes: dict[str, float] = {}
    entries = []
    torder, types = record
    for gguf in tensor_order(list(found), torder, fam):
        t, want = found[gguf], shapes[gguf]
        where_t = (t.file.path, sanitize(t.name))
        if gguf.split(".")[-2] not in PROJECTIONS:
            if t.dtype not in FLOAT_DTYPES or t.shape != want:
                raise ShapeError(f"expected a float tensor {list(want)}, found {t.dtype} "
                                 f"{list(t.shape)}", path=where_t[0], tensor=where_t[1])
            dst = types.get(gguf, t.dtype if gguf in ("token_embd.weight", "output.weight")
                            else "F32")
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
            quantized[gguf] = t.dtype
        else:
            raise ShapeError(f"expected U8 [{rows // 4}, {cols}] or float {list(want)}, found "
                             f"{t.dtype} {list(t.shape)}", path=where_t[0], tensor=where_t[1])
        entries.append(TensorEntry(gguf, want, "hf", t.nbytes, True))
    if scales:
        raise FormatError("weight_scale without packed weights", path=where,
                          tensor=hf_module(next(iter(scales)), fam) + ".weight_scale")

    def load_ternary(name: str) -> TernaryTensor:
        if name not in tern:
            raise KeyError(f"{name!r} is not a ternary tensor")
        p = tern[name]
        raw = p.tensor.file.raw(p.tensor)
        if p.scale is None:
            trits, s = absmean(as_float32(raw, p.tensor.dtype).reshape(p.rows, p.cols))
            rules[name] = ABSMEAN
        else:
            trits = unpack_rows(raw.reshape(p.rows // 4, p.cols), path=p.tensor.file.path,
                                tensor=sanitize(p.tensor.name))
            s = p.scale
        if fam.permuted_qk and name.split(".")[-2] in ("attn_q", "attn_k"):
            trits = trits[qk_rows(p.rows, h.head_dim)]  # llama.cpp's interleaved-RoPE order
        return TernaryTensor(trits, np.float32([s]), 0, name)

    def load_plain(name: str) -> tuple[GGMLType, np.ndarray]:
        t, dst = plain[name]
        raw = convert_floats(t.file.raw(t), t.dtype, dst)
        if raw is None:
            raise FormatError(f"config.json records type {dst}, which cannot hold these "
                              f"{t.dtype} values exactly", path=t.file.path,
                              tensor=sanitize(t.name))
        return GGML_OF_ST[dst], raw

    def close() -> None:
        for f in files:
            f.close()

    model = Model(where, meta, entries, "hf", load_ternary, load_plain, close)
    model.scale_changes = scale_changes
    model.quantized, model.quantize_rules = quantized, rules
    return model


def _packed_scale(t: SafeTensor | None, linear: str, path: str, tensor: str
                  ) -> tuple[np.float32, float]:
    """The multiplier s of a packed projection and the relative change reading it made."""
    if t is None:
        raise FormatError("packed weights without weight_scale", path=path, tensor=tensor)
    if t.dtype not in FLOAT_DTYPES or int(np.prod(t.shape)) != 1:
        raise ShapeError(f"weight_scale must be one BF16/F16/F32 value, found {t.dtype} "
                         f"{list(t.shape)}", path=path, tensor=tensor)
    stored = as_float32(t.file.raw(t), t.dtype)[0]
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


def qk_rows(rows: int, head_dim: int) -> np.ndarray:
    """The HF row each GGUF row of a q/k projection of the ``llama`` arch holds: llama.cpp's
    converter permutes every head for interleaved RoPE (GGUF row 2i + p = HF row p*d/2 + i)."""
    order = np.arange(head_dim).reshape(2, head_dim // 2).T.reshape(-1)
    return (np.arange(rows // head_dim)[:, None] * head_dim + order).reshape(-1)


# -- writing ----------------------------------------------------------------------------------
def _check_exportable(model, arch: str) -> Hyper:
    """Refuse (before writing anything) what a packed HF folder of the family cannot hold."""
    try:
        fam: Family = family_of({k: v.plain() for k, v in model.metadata.items()
                                 if not k.startswith("tokenizer.")})
    except UnsupportedConversionError as e:
        raise UnsupportedConversionError(f"{e}; the hf export takes every family bitformat "
                                         "runs", path=model.path) from None
    missing = sorted(set(fam.block_tensors()) - set(fam.hf_blocks.values()))
    if not fam.hf_architecture or missing:
        raise UnsupportedConversionError(
            f"the {fam.id} family has no Hugging Face layout"
            + (f" for {', '.join(missing)}" if fam.hf_architecture else "")
            + "; convert it to a GGUF container instead", path=model.path)
    names = {e.name: e for e in model.entries}
    if "token_embd.weight" not in names:
        raise FormatError("missing tensor token_embd.weight", path=model.path)
    h = hyper_from_metadata(model.metadata, arch, names["token_embd.weight"].shape[0],
                             model.path, fam)
    shapes = h.shapes(untied="output.weight" in names)
    for name, e in names.items():
        if name not in shapes:
            raise UnsupportedConversionError(f"no {fam.hf_architecture} tensor maps to it",
                                             path=model.path, tensor=name)
        if e.shape != shapes[name]:
            raise ShapeError(f"shape {list(e.shape)} does not match the metadata's "
                             f"{list(shapes[name])}", path=model.path, tensor=name)
        if e.ternary and name in ("token_embd.weight", "output.weight"):
            raise UnsupportedConversionError(
                f"a ternary {e.encoding} embedding or LM head (Ternary Bonsai) has no place in "
                f"the HF {fam.hf_architecture} layout, which keeps them dense; keep the GGUF",
                path=model.path, tensor=name)
        if e.ternary != (name.split(".")[-2] in PROJECTIONS):
            raise UnsupportedConversionError("ternary and plain tensors are not where "
                                             f"{fam.title} has them", path=model.path,
                                             tensor=name)
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
    return exact_in(raw, ST_OF_GGML[gtype], dst)


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
    from ..tokenizers.bpe import from_hf_files, to_hf_files

    arch = model.architecture
    h = _check_exportable(model, arch)
    fdt = _folder_dtype(model, dtype)
    report = ConvertReport(model.path, str(out), "hf")
    report.scale_changes.update(model.scale_changes)
    with atomic_dir(out) as tmp:
        plan = _write_packed(model, h, tmp / ".packed", fdt, allow_scale_rounding, report,
                             progress)
        write_safetensors(tmp / "model.safetensors", plan, model.plain, tmp / ".packed")
        report.bytes_written = sum(p[3] for p in plan)
        cfg = config_json(model, h, fdt, untied=any(e.name == "output.weight"
                                                    for e in model.entries))
        tok = {}
        if "tokenizer.ggml.model" in model.metadata:
            to_hf_files(model.metadata, tmp)
            tok = from_hf_files(tmp)
        cfg["bitformat"] = bitformat_record(model, cfg, arch, tok, fdt, str(out))
        gen = {k: cfg[f"{k}_token_id"] for k in ("bos", "eos", "pad")
               if cfg[f"{k}_token_id"] is not None}
        for fname, obj in (("config.json", cfg), ("generation_config.json", gen)):
            (tmp / fname).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n",
                                     encoding="utf-8")
    return report


def _write_packed(model, h: Hyper, packed_path: Path, fdt: str, allow: bool, report, progress
                  ) -> list[tuple[str, str, tuple[int, ...], int, Any]]:
    """Pack every ternary tensor into a side file (one decode each); plan every tensor.

    Returns (hf name, dtype, shape, nbytes, source) where source is ("plain", gguf name),
    ("packed", offset in the side file) or ("bytes", the scale's bytes).
    """
    plan = []
    with open(packed_path, "wb") as fh:
        fam = h.family
        inverse = linear_class(fam) == "bitlinear"
        for e in model.entries:
            hf = hf_module(e.name, fam)
            if e.ternary:
                t, loss = model.ternary(e.name).with_tensor_scale(allow)
                if loss:
                    report.scale_changes[e.name] = loss
                trits = t.trits
                if fam.permuted_qk and e.name.split(".")[-2] in ("attn_q", "attn_k"):
                    trits = trits[np.argsort(qk_rows(t.rows, h.head_dim))]  # back to HF order
                packed = pack_rows(trits)
                plan.append((f"{hf}.weight", "U8", packed.shape, packed.nbytes,
                             ("packed", fh.tell())))
                fh.write(memoryview(np.ascontiguousarray(packed)).cast("B"))
                s = np.float32(t.scales[0])
                if inverse:
                    data, dtype, change = _inverse_scale(s)
                    if change:
                        report.scale_changes[e.name] = change
                elif bf16_exact(s):
                    data, dtype = (s.view(np.uint32) >> 16).astype("<u2").tobytes(), "BF16"
                else:
                    data, dtype = s.astype("<f4").tobytes(), "F32"
                plan.append((f"{hf}.weight_scale", dtype, (1,), len(data), ("bytes", data)))
                report.ternary_weights += t.rows * t.cols
            else:
                plan.append((f"{hf}.weight", fdt, e.shape,
                             int(np.prod(e.shape)) * ST_ITEMSIZE[fdt], ("plain", e.name)))
            checkpoint("tensor")
            report.tensors += 1
            if progress is not None:
                progress(e)
    return plan



def _inverse_scale(s: np.float32) -> tuple[bytes, str, float]:
    """The ``bitlinear`` weight_scale (1/s) whose reading (:func:`_packed_scale`: the float32
    nearest 1/stored) gives back ``s``: BF16 where one does (the form such checkpoints ship),
    else F32; the relative change where none does."""
    with np.errstate(divide="ignore", over="ignore"):
        y = np.float32(1.0) / s
    b = np.float32((np.uint32(y.view(np.uint32) + 0x7FFF + ((y.view(np.uint32) >> 16) & 1))
                    & np.uint32(0xFFFF0000)).view(np.float32))  # bf16, round to nearest even
    for cand, dtype in ((b, "BF16"), (y, "F32"), (np.nextafter(y, np.float32(0)), "F32"),
                        (np.nextafter(y, np.float32(np.inf)), "F32")):
        with np.errstate(divide="ignore", over="ignore"):
            back = np.float32(1.0) / cand
        if back == s:
            data = ((cand.view(np.uint32) >> 16).astype("<u2").tobytes() if dtype == "BF16"
                    else cand.astype("<f4").tobytes())
            return data, dtype, 0.0
    return y.astype("<f4").tobytes(), "F32", abs(1.0 - float(np.float32(1.0) / y) / float(s))
