"""Whole model files: open any container, list its tensors, convert it to another.

A bitformat container is one GGUF v3 file: the tokenizer, config, norms and the embedding
travel unchanged, and each ternary matrix is stored in one encoding (see ``formats/``).
Formats that are not GGML types record, per tensor::

    bitformat.tensor.<name>.encoding   string   the format id
    bitformat.tensor.<name>.shape      u64[2]   [rows, cols] of the logical matrix
    bitformat.tensor.<name>.scale      f32      the per-tensor scale

and every container written by bitformat carries ``bitformat.format`` (its encoding id) and
``bitformat.version``. The Hugging Face export is a folder instead (``formats/hf.py``).
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from .constants import GGML_BLOCK_LAYOUT, ForeignType, GGMLType, ValueType
from .errors import FormatError, MetadataError, ShapeError, UnsupportedConversionError
from .families import PROJECTIONS
from .formats import FORMAT_IDS, get_format, rans_float
from .formats.base import TernaryFormat
from .io.atomic import check_not_source
from .io.gguf import GGUFReader, GGUFWriter, MetaValue
from .io.mapping import drop_pages
from .io.model import ConvertReport, Model, TensorEntry
from .io.safetensors import FLOAT_DTYPES, as_float32
from .quantize import MASTER_ARCHITECTURES, quantize
from .ternary import TernaryTensor

CONTAINER_VERSION = 1
TENSOR_KEY = "bitformat.tensor.{name}.{field}"
NATIVE_TYPES = {GGMLType.I2_S: "i2_s", GGMLType.TQ2_0: "tq2_0", GGMLType.TQ1_0: "tq1_0",
                GGMLType.Q2_0: "q2_0", GGMLType.IQ2_BN: "iq2_bn", GGMLType.IQ1_BN: "iq1_bn"}

#: GGUF names of the seven ternary projections of a BitNet block.
TERNARY_NAME = re.compile(rf"^blk\.\d+\.({'|'.join(PROJECTIONS)})\.weight$")


def open_model(path: str | os.PathLike, *, i2s_variant: str = "x86") -> Model:
    """Open a GGUF container or a Hugging Face BitNet folder (a path, a cache snapshot, or
    ``ORG/NAME`` found in the local Hugging Face cache: :mod:`.io.hf_cache`).

    ``i2s_variant`` picks the i2_s block layout ("x86", or "arm64" for files quantized by
    ARM builds of bitnet.cpp since Nov 2025); files do not record it.
    """
    p = Path(path)
    if not p.exists():
        from .io.hf_cache import is_repo_id, resolve

        if is_repo_id(str(path)):
            p = resolve(path)  # ORG/NAME from the local Hugging Face cache, or a clear error
    if p.is_dir():
        from .formats import hf

        return hf.open_hf(p)
    return _open_gguf(p, i2s_variant)


def _open_gguf(path: Path, i2s_variant: str) -> Model:
    reader = GGUFReader(path)
    spath = str(path)
    entries: list[TensorEntry] = []
    codecs: dict[str, tuple[TernaryFormat, int, int, float | None]] = {}
    coded: dict[str, tuple[GGMLType, tuple[int, ...]]] = {}  # plain tensors stored coded
    masters: dict[str, str] = {}  # tensor -> its float type
    rules: dict[str, str] = {}
    for info in reader.tensors.values():
        enc_key = TENSOR_KEY.format(name=info.name, field="encoding")
        if info.ggml_type in NATIVE_TYPES:
            fid = NATIVE_TYPES[info.ggml_type]
            fmt = get_format(fid) if fid != "i2_s" else _i2s(i2s_variant)
            if len(info.shape) != 2:
                raise FormatError(f"a {fid} tensor must be 2-D, got shape {info.shape}",
                                  path=spath, tensor=info.name)
            rows, cols = info.shape
            codecs[info.name] = (fmt, rows, cols, None)
            entries.append(TensorEntry(info.name, (rows, cols), fid, info.nbytes, True))
        elif _coding(reader, info.name) == rans_float.ENCODING:
            gtype, shape = _coded_plain(reader, info)
            coded[info.name] = (gtype, shape)
            entries.append(TensorEntry(info.name, shape, gtype.name, info.nbytes, False,
                                       rans_float.ENCODING))
        elif enc_key in reader.metadata:
            fid, rows, cols, scale = _tensor_meta(reader, info.name)
            try:
                fmt = get_format(fid)
            except ValueError:
                raise MetadataError(f"unknown encoding {fid!r}", path=spath,
                                    tensor=info.name) from None
            if fmt.native:
                raise MetadataError(f"encoding {fid!r} must be stored as GGML type "
                                    f"{fmt.storage_type.name}", path=spath, tensor=info.name)
            try:
                fmt.check_shape(rows, cols, info.name)
            except ShapeError as e:  # the metadata's shape: name the file too
                raise ShapeError(e.problem, path=spath, tensor=info.name) from None
            if fmt.variable_size:  # any length; decode checks it against the data's header
                if len(info.shape) != 1 or info.ggml_type != fmt.storage_type:
                    raise FormatError(f"{fid} data must be a 1-D {fmt.storage_type.name} "
                                      f"tensor, found {info.ggml_type.name} {info.shape}",
                                      path=spath, tensor=info.name)
                codecs[info.name] = (fmt, rows, cols, scale)
                entries.append(TensorEntry(info.name, (rows, cols), fid, info.nbytes, True))
                continue
            want = fmt.stored_shape(rows, cols)
            if info.shape != want or info.ggml_type != fmt.storage_type:
                raise FormatError(f"{fid} data of a {rows}x{cols} matrix must be "
                                  f"{fmt.storage_type.name} {want}, found "
                                  f"{info.ggml_type.name} {info.shape}", path=spath,
                                  tensor=info.name)
            codecs[info.name] = (fmt, rows, cols, scale)
            entries.append(TensorEntry(info.name, (rows, cols), fid, info.nbytes, True))
        elif any(TENSOR_KEY.format(name=info.name, field=f) in reader.metadata
                 for f in ("shape", "scale")):  # described as coded, but with no encoding
            raise MetadataError(f"missing metadata {enc_key} (the tensor has a coded shape or "
                                "scale, so its words are not a plain tensor)", path=spath,
                                tensor=info.name)
        elif _is_master(reader, info):  # f32/f16/bf16 BitNet weights, quantized on reading
            masters[info.name] = info.ggml_type.name
            entries.append(TensorEntry(info.name, info.shape, info.ggml_type.name.lower(),
                                       info.nbytes, True))
        else:
            entries.append(TensorEntry(info.name, info.shape, info.ggml_type.name,
                                       info.nbytes, False))

    def load_ternary(name: str) -> TernaryTensor:
        if name in masters:
            w = as_float32(reader.raw(name), masters[name]).reshape(reader.tensors[name].shape)
            trits, scale, rules[name] = quantize(w)
            return TernaryTensor(trits, np.float32([scale]), 0, name)
        if name not in codecs:
            raise KeyError(f"{name!r} is not a ternary tensor")
        fmt, rows, cols, scale = codecs[name]
        return fmt.decode(reader.raw(name), rows, cols, scale=scale, path=spath, name=name)

    def load_plain(name: str) -> tuple[GGMLType, np.ndarray]:
        gtype = reader.tensors[name].ggml_type
        if isinstance(gtype, ForeignType):
            raise UnsupportedConversionError(
                f"is {gtype.name}, a llama.cpp type bitformat lists but does not read",
                path=spath, tensor=name)
        if name in coded:
            gtype, shape = coded[name]
            raw = reader.raw(name)
            out = rans_float.RansFloat().decode(raw, gtype, shape, path=spath, name=name)
            drop_pages(raw)  # read once: the decoded copy is what the caller keeps
            return gtype, out
        return reader.tensors[name].ggml_type, reader.raw(name)

    kinds = {e.encoding for e in entries if e.ternary}
    container = kinds.pop() if len(kinds) == 1 else ("mixed" if kinds else "none")
    model = Model(spath, dict(reader.metadata), entries, container, load_ternary, load_plain,
                  reader.close)
    model.quantized, model.quantize_rules = masters, rules
    return model


def _is_master(reader: GGUFReader, info) -> bool:
    """A BitNet projection stored as a plain float matrix (bitnet.cpp's f32/f16 GGUFs)."""
    return (reader.metadata.get("general.architecture") is not None
            and reader.metadata["general.architecture"].plain() in MASTER_ARCHITECTURES
            and info.ggml_type.name in FLOAT_DTYPES and len(info.shape) == 2
            and TERNARY_NAME.match(info.name) is not None)


def require_ternary(model: Model) -> None:
    """Refuse a model with no ternary tensors in one line: what the file is (architecture,
    the types of its weights) and what to do instead."""
    if any(e.ternary for e in model.entries):
        return
    arch = model.architecture
    types = Counter(e.encoding for e in model.entries if len(e.shape) == 2)
    kinds = ", ".join(f"{t} x {n}" for t, n in types.most_common(4)) or "no matrices"
    what = (f"not a ternary model: a {arch!r} file whose matrices are {kinds}")
    if any(t not in ("F32", "F16", "BF16") for t in types):  # llama.cpp's quantized types
        raise UnsupportedConversionError(
            f"{what}; bitformat reads BitNet b1.58 ternary weights (i2_s, TQ2_0, TQ1_0, ...): "
            "run this file with llama.cpp, or give bitformat a BitNet checkpoint "
            "(`bitformat inspect` lists its tensors)", path=model.path)
    if arch not in MASTER_ARCHITECTURES:
        raise UnsupportedConversionError(
            f"{what}; architecture {arch!r} is not BitNet b1.58: bitformat reads ternary "
            f"tensors, and quantizes float weights of {', '.join(MASTER_ARCHITECTURES)} "
            "models only", path=model.path)
    raise UnsupportedConversionError(f"{what}, and no BitNet projections "
                                     "(blk.N.attn_q.weight ...) to quantize", path=model.path)


def _coding(reader: GGUFReader, name: str) -> str | None:
    mv = reader.metadata.get(TENSOR_KEY.format(name=name, field="encoding"))
    return mv.value if mv is not None and mv.vtype == ValueType.STRING else None


def _coded_plain(reader: GGUFReader, info) -> tuple[GGMLType, tuple[int, ...]]:
    """(logical type, logical shape) of a plain tensor stored as ``rans_float`` words; the
    rest is checked when it is decoded."""
    key = TENSOR_KEY.format(name=info.name, field="shape")
    mv = reader.metadata.get(key)
    if (mv is None or mv.vtype != ValueType.ARRAY or mv.item_type not in (
            ValueType.UINT64, ValueType.UINT32) or not 1 <= len(mv.value) <= 4):
        raise MetadataError(f"missing or malformed metadata {key} (1 to 4 unsigned "
                            "integers)", path=reader.path, tensor=info.name)
    if len(info.shape) != 1 or info.ggml_type != GGMLType.I32:
        raise FormatError(f"rans_float data must be a 1-D I32 tensor, found "
                          f"{info.ggml_type.name} {info.shape}", path=reader.path,
                          tensor=info.name)
    gtype = rans_float.peek_dtype(reader.raw(info.name), path=reader.path, name=info.name)
    return gtype, tuple(int(v) for v in mv.value)


def _i2s(variant: str) -> TernaryFormat:
    from .formats.i2_s import I2S

    return I2S(variant)


def _tensor_meta(reader: GGUFReader, name: str) -> tuple[str, int, int, float]:
    def need(fieldname: str, vtypes: tuple[ValueType, ...]) -> MetaValue:
        key = TENSOR_KEY.format(name=name, field=fieldname)
        mv = reader.metadata.get(key)
        if mv is None:
            raise MetadataError(f"missing metadata {key}", path=reader.path, tensor=name)
        if mv.vtype not in vtypes:
            raise MetadataError(f"metadata {key} has type {mv.vtype.name}",
                                path=reader.path, tensor=name)
        return mv

    fid = need("encoding", (ValueType.STRING,)).value
    shape = need("shape", (ValueType.ARRAY,))
    if shape.item_type not in (ValueType.UINT64, ValueType.UINT32) or len(shape.value) != 2:
        raise MetadataError("shape must be two unsigned integers [rows, cols]",
                            path=reader.path, tensor=name)
    rows, cols = (int(v) for v in shape.value)
    scale = float(need("scale", (ValueType.FLOAT32,)).value)
    if not np.isfinite(scale):
        from .errors import InvalidScaleError

        raise InvalidScaleError(f"scale is {scale}", path=reader.path, tensor=name)
    return fid, rows, cols, scale


# -- writing -------------------------------------------------------------------------------
def output_metadata(src: dict[str, MetaValue], fmt: TernaryFormat) -> dict[str, MetaValue]:
    """The target's metadata: the source's, less what described the old encoding.

    Order is canonical (source order, then ``general.file_type``, then ``bitformat.*``), so
    conversions between bitformat's own files are byte-for-byte reproducible.
    """
    meta = {k: v for k, v in src.items()
            if k != "general.file_type" and not k.startswith("bitformat.")
            and k != "general.alignment"}
    if fmt.file_type is not None:
        meta["general.file_type"] = MetaValue(ValueType.UINT32, int(fmt.file_type))
    meta["bitformat.format"] = MetaValue(ValueType.STRING, fmt.format_id)
    meta["bitformat.version"] = MetaValue(ValueType.UINT32, CONTAINER_VERSION)
    return meta


def write_gguf(model: Model, out: str | os.PathLike, fmt: TernaryFormat, *,
               allow_scale_rounding: bool = False,
               progress: Callable[[TensorEntry], None] | None = None) -> ConvertReport:
    """Write ``model`` as a GGUF container whose ternary tensors use ``fmt``.

    Streams tensor by tensor, encoding each once. Every ternary tensor's shape is checked
    before anything is written; a :class:`ScaleLossError` stops the conversion before the
    output appears. A format with ``plain_coding`` (rans) also codes its F16/BF16 tensors
    (:mod:`.formats.rans_float`).
    """
    report = ConvertReport(model.path, str(out), fmt.format_id)
    writer = GGUFWriter(str(out))
    meta = output_metadata(model.metadata, fmt)
    for e in model.entries:
        if e.ternary:
            fmt.check_shape(*e.shape, e.name)
    # Per-tensor metadata of non-native encodings holds each tensor's scale, known only once
    # the tensor is decoded, and a variable-size tensor's length is known only once it is
    # encoded. Both are fixed-size fields of the header (an f32, a u64 dimension and offset),
    # so the header is written with placeholders and rewritten in place at the end; the data
    # iterator fills them in as it goes, so every tensor is decoded and encoded once.
    scale_keys: dict[str, MetaValue] = {}
    coded: dict[str, GGMLType] = {}
    for e in model.entries:
        if e.ternary and not fmt.native:
            rows, cols = e.shape
            meta[TENSOR_KEY.format(name=e.name, field="encoding")] = MetaValue(
                ValueType.STRING, fmt.format_id)
            meta[TENSOR_KEY.format(name=e.name, field="shape")] = MetaValue(
                ValueType.ARRAY, np.array([rows, cols], dtype=np.uint64), ValueType.UINT64)
            scale_keys[e.name] = meta[TENSOR_KEY.format(name=e.name, field="scale")] = MetaValue(
                ValueType.FLOAT32, 0.0)
        elif not e.ternary and fmt.plain_coding == rans_float.ENCODING:
            gtype = _plain_type(model, e)
            if rans_float.codable(gtype, e.shape):
                coded[e.name] = gtype
                meta[TENSOR_KEY.format(name=e.name, field="encoding")] = MetaValue(
                    ValueType.STRING, rans_float.ENCODING)
                meta[TENSOR_KEY.format(name=e.name, field="shape")] = MetaValue(
                    ValueType.ARRAY, np.array(e.shape, dtype=np.uint64), ValueType.UINT64)
    sized_later = GGML_BLOCK_LAYOUT[GGMLType.I32][1]
    for e in model.entries:
        if (e.ternary and fmt.variable_size) or e.name in coded:
            writer.add_tensor(e.name, (0,), GGMLType.I32, 0)  # sized when encoded
        elif e.ternary:
            rows, cols = e.shape
            writer.add_tensor(e.name, fmt.stored_shape(rows, cols), fmt.storage_type,
                              fmt.nbytes(rows, cols))
        else:
            writer.add_tensor(e.name, e.shape, _plain_type(model, e), e.plain_nbytes)
    writer.metadata = meta
    planned = {t.name: t for t in writer.tensors}

    def blobs() -> Iterator[np.ndarray]:
        # GGUFWriter.write takes each planned tensor, then its data from here: a size set
        # on the planned tensor before the data is yielded is the size written and checked.
        for e in model.entries:
            if e.ternary:
                t, loss = fmt.prepare(model.ternary(e.name), allow_scale_rounding)
                if loss:
                    report.scale_changes[e.name] = loss
                if e.name in scale_keys:
                    scale_keys[e.name].value = float(t.scales[0])
                report.ternary_weights += t.rows * t.cols
                data = fmt.encode(t)
            elif e.name in coded:
                data = rans_float.RansFloat().encode(model.plain(e.name)[1], coded[e.name],
                                                     e.shape, e.name)
            else:
                data = model.plain(e.name)[1]
            if (e.ternary and fmt.variable_size) or e.name in coded:
                planned[e.name].shape = (data.nbytes // sized_later,)
                planned[e.name].nbytes = data.nbytes
            report.tensors += 1
            report.bytes_written += data.nbytes
            if progress is not None:
                progress(e)
            yield data

    # Scales the source already rounded on reading (an HF "bitlinear" 1/s) are reported too.
    for name, change in model.scale_changes.items():
        report.scale_changes.setdefault(name, change)
    writer.write(blobs(), refresh_header=bool(scale_keys) or bool(coded) or fmt.variable_size)
    return report


def _plain_type(model: Model, e: TensorEntry) -> GGMLType:
    """A plain tensor's GGML type, without decoding a coded one."""
    return GGMLType[e.encoding] if e.coding else model.plain(e.name)[0]


def check_for_convert(model: Model) -> list[str]:
    """Validate a model of a known family before converting it (:mod:`.validate`): a missing
    tensor, a shape the config does not imply or a config value out of range is refused; NaN
    or infinity in a norm or the embedding is copied as it is and returned as a warning.
    Models of other architectures are converted tensor by tensor without this check."""
    from .validate import known_architecture, model_args, validate_model

    if not known_architecture(model.architecture):
        return []
    return [str(p) for p in validate_model(model, model_args(model), values="warning")]


def convert(source: str | os.PathLike, out: str | os.PathLike, format_id: str, *,
            allow_scale_rounding: bool = False, i2s_variant: str = "x86",
            progress: Callable[[TensorEntry], None] | None = None) -> ConvertReport:
    """Convert the model at ``source`` into container ``format_id`` at ``out``.

    ``out`` may be ``source`` itself: the new file replaces it only once complete. An output
    that would destroy the source (an hf folder at the source's path or around it) is
    refused with :class:`~.errors.OutputPathError`. Float master weights of a BitNet model
    are quantized on the way (:mod:`bitformat.quantize`, listed in the report's
    ``quantized``); a model with nothing ternary is refused (:func:`require_ternary`).
    """
    if not Path(source).exists():
        from .io.hf_cache import is_repo_id, resolve

        if is_repo_id(str(source)):
            source = resolve(source)
    check_not_source(source, out, folder=format_id == "hf")
    model = open_model(source, i2s_variant=i2s_variant)
    try:
        require_ternary(model)
        warnings = check_for_convert(model)
        if format_id == "hf":
            from .formats import hf

            report = hf.write_hf(model, out, allow_scale_rounding=allow_scale_rounding,
                                 progress=progress)
        else:
            if format_id not in FORMAT_IDS:
                get_format(format_id)  # raises a clear "unknown format"
            report = write_gguf(model, out, get_format(format_id),
                                allow_scale_rounding=allow_scale_rounding, progress=progress)
        report.quantized = {n: (t, model.quantize_rules.get(n, "")) for n, t in
                            model.quantized.items()}
        report.warnings = warnings
        return report
    finally:
        model.close()
