"""A strict safetensors reader (memory-mapped, every file hostile) and a streaming writer.

Layout (huggingface/safetensors; little endian)::

    u64 n | n bytes UTF-8 JSON header | data (tensors row-major, little endian)

    header   an object, no key twice: optional "__metadata__" (strings to strings), and per
             tensor exactly {"dtype", "shape", "data_offsets"}: dtype from ST_ITEMSIZE, shape
             at most MAX_DIMS non-negative ints, data_offsets [begin, end] relative to the
             data, spanning exactly itemsize * prod(shape) bytes

n MUST be at most MAX_HEADER and the bytes after it; tensor regions MUST lie inside the data
and MUST NOT overlap. The writer pads the header with spaces to a multiple of 8. A checkpoint
is ``model.safetensors`` or the shards that ``model.safetensors.index.json`` names
(``weight_map``: tensor name -> file in the same folder). numpy has no bfloat16, so
BF16/F16/F32 bytes are converted here, exactly or not at all.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..constants import GGMLType
from ..errors import (
    BitformatIOError,
    CountTooLargeError,
    FormatError,
    TensorLayoutError,
    TruncatedError,
    UnknownTypeError,
)
from .gguf import sanitize

MAX_HEADER = 100_000_000  # the safetensors library's own cap on the JSON header
MAX_JSON = 256 << 20
#: deepest nesting of arrays and objects bitformat reads in any JSON file (safetensors headers,
#: config.json, tokenizer files need 4 or 5; a deeper file is refused, never a RecursionError)
MAX_JSON_DEPTH = 64
MAX_DIMS = 8

#: safetensors dtype -> element size in bytes.
ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2,
               "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}
FLOAT_DTYPES = ("BF16", "F16", "F32")
ST_OF_GGML = {GGMLType.F32: "F32", GGMLType.F16: "F16", GGMLType.BF16: "BF16"}
GGML_OF_ST = {v: k for k, v in ST_OF_GGML.items()}


# -- reading ----------------------------------------------------------------------------------
@dataclass
class SafeTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    nbytes: int
    file: SafeFile


class SafeFile:
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

    def _parse(self, header: bytes, data_start: int, data_size: int) -> dict[str, SafeTensor]:
        try:
            text = header.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FormatError(f"header is not valid JSON (not UTF-8: {exc})",
                              path=self.path) from None
        obj = loads_json(text, "header", self.path, object_pairs_hook=_unique_keys)
        if not isinstance(obj, dict):
            raise FormatError("header is not a JSON object", path=self.path)
        out: dict[str, SafeTensor] = {}
        for name, info in obj.items():
            if name == "__metadata__":
                if not isinstance(info, dict) or not all(
                        isinstance(v, str) for v in info.values()):
                    raise FormatError("__metadata__ must map strings to strings", path=self.path)
                continue
            tensor = sanitize(name)
            if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
                raise FormatError("entry must hold exactly dtype, shape and data_offsets",
                                  path=self.path, tensor=tensor)
            dtype, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
            if not isinstance(dtype, str) or dtype not in ST_ITEMSIZE:
                raise UnknownTypeError(f"unknown dtype {sanitize(str(dtype))!r}",
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
            out[name] = SafeTensor(name, dtype, tuple(shape), data_start + offs[0], n, self)
        end, last = data_start, None
        for t in sorted(out.values(), key=lambda t: (t.start, t.nbytes)):
            if t.start < end:
                raise TensorLayoutError(f"data overlaps tensor {sanitize(last)!r}",
                                        path=self.path, tensor=sanitize(t.name))
            end, last = t.start + t.nbytes, t.name
        return out

    def raw(self, t: SafeTensor) -> np.ndarray:
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
            raise ValueError(f"key {sanitize(k)!r} appears twice")
        out[k] = v
    return out


def _is_uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def loads_json(text: str | bytes, what: str, path: str, **kwargs) -> Any:
    """``json.loads`` with a :class:`FormatError` naming the file for bad JSON, and nesting
    deeper than :data:`MAX_JSON_DEPTH` refused (checked after parsing, without recursion)."""
    try:
        obj = json.loads(text, **kwargs)
    except RecursionError:
        raise FormatError(f"{what} is nested deeper than {MAX_JSON_DEPTH} levels",
                          path=path) from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise FormatError(f"{what} is not valid JSON ({str(exc)[:120]})", path=path) from None
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise FormatError(f"{what} is nested deeper than {MAX_JSON_DEPTH} levels", path=path)
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)))
    return obj


def read_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object file of at most MAX_JSON bytes, no key twice; ``what`` names it in errors."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_JSON + 1)
    except OSError as exc:
        raise BitformatIOError(f"cannot read {what}: {exc.strerror}", path=str(path)) from None
    if len(data) > MAX_JSON:
        raise CountTooLargeError(f"{what} is larger than {MAX_JSON} bytes", path=str(path))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FormatError(f"{what} is not valid JSON (not UTF-8: {exc})",
                          path=str(path)) from None
    obj = loads_json(text, what, str(path), object_pairs_hook=_unique_keys)
    if not isinstance(obj, dict):
        raise FormatError(f"{what} is not a JSON object", path=str(path))
    return obj


def read_tensors(folder: Path) -> tuple[dict[str, SafeTensor], list[SafeFile]]:
    """Every tensor of the checkpoint, single-file or sharded through the index."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        if not (folder / "model.safetensors").is_file():
            raise FormatError("no model.safetensors or model.safetensors.index.json",
                              path=str(folder))
        f = SafeFile(folder / "model.safetensors")
        return dict(f.tensors), [f]
    wmap = read_json(index, "the index").get("weight_map")
    if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
        raise FormatError("weight_map must map tensor names to file names", path=str(index))
    files: dict[str, SafeFile] = {}
    tensors: dict[str, SafeTensor] = {}
    try:
        for name, fname in wmap.items():
            if Path(fname).name != fname or fname in (".", "..") or not fname.endswith(
                    ".safetensors"):
                raise FormatError(f"shard {sanitize(fname)!r} is not a .safetensors file "
                                  "in the folder", path=str(index), tensor=sanitize(name))
            if fname not in files:
                files[fname] = SafeFile(folder / fname)
            if name not in files[fname].tensors:
                raise FormatError(f"tensor listed in the index is not in {sanitize(fname)}",
                                  path=str(index), tensor=sanitize(name))
            tensors[name] = files[fname].tensors[name]
    except BaseException:
        for f in files.values():
            f.close()
        raise
    return tensors, list(files.values())


# -- float dtypes -----------------------------------------------------------------------------
def as_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
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
    for chunk in chunks(raw, ST_ITEMSIZE[src]):
        piece = convert_piece(chunk, src, dst)
        if piece is None:
            return None
        out[at:at + piece.size] = piece
        at += piece.size
    return out


def convert_piece(raw: np.ndarray, src: str, dst: str) -> np.ndarray | None:
    """:func:`convert_floats` of one piece, as one float32 array in between."""
    if src == dst:
        return raw
    x = as_float32(raw, src)
    if dst == "F32":
        return x.view(np.uint8)
    if dst == "BF16":
        bits = x.view(np.uint32)
        return None if (bits & 0xFFFF).any() else (bits >> 16).astype("<u2").view(np.uint8)
    with np.errstate(over="ignore"):
        y = x.astype("<f2")
    same = np.array_equal(y.astype(np.float32).view(np.uint32), x.view(np.uint32))
    return y.view(np.uint8) if same else None


def exact_in(raw: np.ndarray, src: str, dst: str) -> bool:
    """Whether :func:`convert_floats` would succeed, without keeping the converted bytes."""
    if src == dst or dst == "F32":
        return True
    return all(convert_piece(c, src, dst) is not None for c in chunks(raw, ST_ITEMSIZE[src]))


def chunks(raw: np.ndarray, itemsize: int, step: int = 1 << 24) -> Iterator[np.ndarray]:
    """``raw`` in pieces of at most ``step`` bytes, each a whole number of items."""
    step -= step % itemsize
    for i in range(0, raw.size, step):
        yield raw[i:i + step]


# -- writing ----------------------------------------------------------------------------------
def header_bytes(entries: list[tuple[str, str, tuple[int, ...], int]]) -> bytes:
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


def write_safetensors(path: Path, plan: list, plain: Callable[[str], tuple[GGMLType, np.ndarray]],
                      side_path: Path) -> None:
    """Header, then 4-byte, 2-byte and 1-byte tensors (each group by name): all aligned.

    ``plan`` holds (name, dtype, shape, nbytes, source); source is ("plain", key), whose
    (GGML type, bytes) ``plain(key)`` gives, converted to dtype; ("bytes", data); or
    ("packed", offset of the bytes in the side file at ``side_path``), deleted afterwards.
    """
    plan = sorted(plan, key=lambda p: (-ST_ITEMSIZE[p[1]], p[0]))
    with open(path, "wb") as fh, open(side_path, "rb") as side:
        fh.write(header_bytes([p[:4] for p in plan]))
        for _name, dtype, _shape, nbytes, (kind, src) in plan:
            if kind == "plain":
                gtype, raw = plain(src)
                for chunk in chunks(raw, ST_ITEMSIZE[ST_OF_GGML[gtype]]):
                    fh.write(memoryview(convert_piece(chunk, ST_OF_GGML[gtype], dtype)))
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
    os.unlink(side_path)


__all__ = ["SafeFile", "SafeTensor", "as_float32", "convert_floats", "exact_in", "read_json",
           "read_tensors", "write_safetensors"]
