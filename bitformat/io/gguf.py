"""A strict GGUF v3 reader and a streaming, atomic GGUF writer.

The ``gguf`` package cannot read type 36 (I2_S) and holds whole files in memory when
writing, so bitformat parses and writes the envelope itself. Layout (little endian)::

    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x   (string key, u32 value_type, value)
    n_tensors x (string name, u32 n_dims, u64 dims[n_dims] (fastest first), u32 type,
                 u64 offset relative to the data section)
    padding to general.alignment (default 32) | tensor data, each at an aligned offset

Every count is checked against the bytes that remain before anything is allocated; sizes are
Python ints; tensor regions must be aligned, in the file and non-overlapping.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..constants import (
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGUF_VERSION,
    SCALAR_FORMAT,
    GGMLType,
    ValueType,
    block_layout,
    foreign_type,
    ggml_nbytes,
)
from ..errors import (
    BadMagicError,
    BitformatIOError,
    CountTooLargeError,
    FormatError,
    TensorLayoutError,
    TruncatedError,
    UnknownTypeError,
    UnsupportedVersionError,
)
from .atomic import atomic_file, checkpoint

MAX_DIMS = 4
MAX_STRING = 1 << 30
MAX_ALIGNMENT = 1 << 16


@dataclass
class MetaValue:
    """One metadata value with its exact GGUF type, so it is written back unchanged."""

    vtype: ValueType
    value: Any  # scalar, str, list[str] or a numpy array for numeric arrays
    item_type: ValueType | None = None  # element type of an ARRAY

    @staticmethod
    def of(value: Any) -> MetaValue:
        """Infer a GGUF type for a Python value (str, bool, int, float, list)."""
        if isinstance(value, MetaValue):
            return value
        if isinstance(value, bool):
            return MetaValue(ValueType.BOOL, value)
        if isinstance(value, int):
            return MetaValue(ValueType.UINT32 if 0 <= value < 2**32 else ValueType.INT64, value)
        if isinstance(value, float):
            return MetaValue(ValueType.FLOAT32, value)
        if isinstance(value, str):
            return MetaValue(ValueType.STRING, value)
        if isinstance(value, np.ndarray):
            kinds = {np.dtype("int32"): ValueType.INT32, np.dtype("uint32"): ValueType.UINT32,
                     np.dtype("float32"): ValueType.FLOAT32, np.dtype("int64"): ValueType.INT64,
                     np.dtype("uint64"): ValueType.UINT64, np.dtype("uint8"): ValueType.UINT8,
                     np.dtype("int8"): ValueType.INT8, np.dtype("float64"): ValueType.FLOAT64}
            return MetaValue(ValueType.ARRAY, value, kinds[value.dtype])
        if isinstance(value, (list, tuple)):
            if all(isinstance(v, str) for v in value):
                return MetaValue(ValueType.ARRAY, list(value), ValueType.STRING)
            if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                arr = np.asarray(value, dtype=np.int64 if any(v < 0 for v in value)
                                 else np.uint64)
                return MetaValue.of(arr)
            if all(isinstance(v, float) for v in value):
                return MetaValue.of(np.asarray(value, dtype=np.float32))
        raise TypeError(f"cannot store {type(value).__name__} as GGUF metadata")

    def plain(self) -> Any:
        """The value as plain Python (lists for arrays)."""
        if self.vtype == ValueType.ARRAY and isinstance(self.value, np.ndarray):
            return self.value.tolist()
        return self.value


ARRAY_DTYPE = {
    ValueType.UINT8: "<u1", ValueType.INT8: "<i1", ValueType.UINT16: "<u2",
    ValueType.INT16: "<i2", ValueType.UINT32: "<u4", ValueType.INT32: "<i4",
    ValueType.FLOAT32: "<f4", ValueType.BOOL: "<u1", ValueType.UINT64: "<u8",
    ValueType.INT64: "<i8", ValueType.FLOAT64: "<f8",
}


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (slowest first): GGUF dims reversed
    ggml_type: GGMLType
    offset: int  # relative to the data section
    nbytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def sanitize(text: str, limit: int = 80) -> str:
    """A name safe to print: control characters escaped, long names cut."""
    out = text.encode("unicode_escape").decode("ascii")
    return out if len(out) <= limit else out[:limit] + "..."


class _Cursor:
    def __init__(self, buf, path: str):
        self.buf = buf
        self.pos = 0
        self.size = len(buf)
        self.path = path

    def remaining(self) -> int:
        return self.size - self.pos

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or n > self.remaining():
            raise TruncatedError(f"file ends inside {what} (needs {n} bytes at offset "
                                 f"{self.pos}, {self.remaining()} left)", path=self.path)
        view = memoryview(self.buf)[self.pos:self.pos + n]
        self.pos += n
        return view

    def scalar(self, vtype: ValueType, what: str):
        fmt = SCALAR_FORMAT[vtype]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def u32(self, what: str) -> int:
        return self.scalar(ValueType.UINT32, what)

    def u64(self, what: str) -> int:
        return self.scalar(ValueType.UINT64, what)

    def string(self, what: str) -> str:
        n = self.u64(f"the length of {what}")
        if n > min(self.remaining(), MAX_STRING):
            raise CountTooLargeError(f"{what} claims {n} bytes but only {self.remaining()} "
                                     "remain", path=self.path)
        raw = bytes(self.take(n, what))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FormatError(f"{what} is not valid UTF-8 ({exc.reason} at byte {exc.start})",
                              path=self.path) from None


    def strings(self, count: int, what: str) -> list[str]:
        """``count`` strings in a row, as :meth:`string` reads them one by one (with the same
        errors), in a tight loop: a tokenizer's vocabulary holds 100,000 and more."""
        buf, pos, size, out = memoryview(self.buf), self.pos, self.size, []
        unpack = _U64.unpack_from
        for i in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.u64(f"the length of element {i} of {what}")  # raises TruncatedError
            (n,) = unpack(buf, pos)
            pos += 8
            if n > min(size - pos, MAX_STRING):
                raise CountTooLargeError(f"element {i} of {what} claims {n} bytes but only "
                                         f"{size - pos} remain", path=self.path)
            try:
                out.append(str(buf[pos:pos + n], "utf-8"))
            except UnicodeDecodeError as exc:
                raise FormatError(f"element {i} of {what} is not valid UTF-8 ({exc.reason} at "
                                  f"byte {exc.start})", path=self.path) from None
            pos += n
        self.pos = pos
        return out


_U64 = struct.Struct("<Q")


class GGUFReader:
    """Memory-mapped, strictly validated view of a GGUF file.

    Examples
    --------
    >>> r = GGUFReader("model.gguf")                       # doctest: +SKIP
    >>> r.metadata["general.architecture"].value           # doctest: +SKIP
    'bitnet-b1.58'
    """

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        try:
            with open(self.path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if size == 0:
                    raise TruncatedError("file is empty", path=self.path)
                self._mmap = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise BitformatIOError(f"cannot open: {exc.strerror}", path=self.path) from None
        self.file_size = size
        self.metadata: dict[str, MetaValue] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._parse()

    # -- parsing -------------------------------------------------------------------------
    def _parse(self) -> None:
        cur = _Cursor(self._mmap, self.path)
        magic = bytes(self._mmap[:4])
        if len(magic) < 4 and GGUF_MAGIC.startswith(magic):
            raise TruncatedError("file ends inside the magic", path=self.path)
        cur.pos = 4
        if magic != GGUF_MAGIC:
            raise BadMagicError(f"not a GGUF file (starts with {magic!r}, expected b'GGUF')",
                                path=self.path)
        self.version = cur.u32("the version")
        if self.version not in (2, 3):
            raise UnsupportedVersionError(f"GGUF version {self.version} is not supported "
                                          "(expected 3)", path=self.path)
        n_tensors = cur.u64("the tensor count")
        n_kv = cur.u64("the metadata count")
        # A metadata entry needs >= 13 bytes (key length, type, 1-byte value); a tensor
        # info >= 28 (name length, n_dims, one dim, type, offset).
        if n_kv * 13 > cur.remaining():
            raise CountTooLargeError(f"header claims {n_kv} metadata entries, more than the "
                                     f"{cur.remaining()} bytes left can hold", path=self.path)
        if n_tensors * 28 > cur.remaining():
            raise CountTooLargeError(f"header claims {n_tensors} tensors, more than the "
                                     f"{cur.remaining()} bytes left can hold", path=self.path)
        for _ in range(n_kv):
            key = cur.string("a metadata key")
            if key in self.metadata:
                raise FormatError(f"metadata key {sanitize(key)!r} appears twice",
                                  path=self.path)
            self.metadata[key] = self._value(cur, key)
        infos = []
        for _ in range(n_tensors):
            infos.append(self._tensor_info(cur))
        alignment = GGUF_DEFAULT_ALIGNMENT
        if "general.alignment" in self.metadata:
            mv = self.metadata["general.alignment"]
            alignment = mv.value if mv.vtype == ValueType.UINT32 else -1
            if alignment <= 0 or alignment & (alignment - 1) or alignment > MAX_ALIGNMENT:
                raise FormatError(f"general.alignment {mv.value!r} is not a power of two "
                                  f"up to {MAX_ALIGNMENT}", path=self.path)
        self.alignment = alignment
        self.data_offset = -(-cur.pos // alignment) * alignment
        self._check_layout(infos)

    def _value(self, cur: _Cursor, key: str) -> MetaValue:
        what = f"metadata {sanitize(key)!r}"
        raw_type = cur.u32(f"the type of {what}")
        try:
            vtype = ValueType(raw_type)
        except ValueError:
            raise UnknownTypeError(f"{what} has unknown value type {raw_type}",
                                   path=self.path) from None
        if vtype == ValueType.STRING:
            return MetaValue(vtype, cur.string(what))
        if vtype != ValueType.ARRAY:
            return MetaValue(vtype, cur.scalar(vtype, what))
        raw_item = cur.u32(f"the element type of {what}")
        try:
            item = ValueType(raw_item)
        except ValueError:
            raise UnknownTypeError(f"{what} is an array of unknown type {raw_item}",
                                   path=self.path) from None
        count = cur.u64(f"the length of {what}")
        if item == ValueType.ARRAY:
            raise UnknownTypeError(f"{what} is a nested array, which bitformat does not read",
                                   path=self.path)
        min_size = 8 if item == ValueType.STRING else struct.calcsize(SCALAR_FORMAT[item])
        if count * min_size > cur.remaining():
            raise CountTooLargeError(f"{what} claims {count} elements, more than the "
                                     f"{cur.remaining()} bytes left can hold", path=self.path)
        if item == ValueType.STRING:
            return MetaValue(vtype, cur.strings(count, what), item)
        data = cur.take(count * min_size, what)
        arr = np.frombuffer(data, dtype=ARRAY_DTYPE[item]).copy()
        if item == ValueType.BOOL:
            arr = arr.astype(bool)
        return MetaValue(vtype, arr, item)

    def _tensor_info(self, cur: _Cursor) -> TensorInfo:
        name = cur.string("a tensor name")
        what = f"tensor {sanitize(name)!r}"
        if name in self.tensors:
            raise FormatError(f"{what} appears twice", path=self.path)
        n_dims = cur.u32(f"the dimension count of {what}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise FormatError(f"{what} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)",
                              path=self.path)
        dims = [cur.u64(f"the dimensions of {what}") for _ in range(n_dims)]
        raw_type = cur.u32(f"the type of {what}")
        offset = cur.u64(f"the offset of {what}")
        try:
            gtype = GGMLType(raw_type)
        except ValueError:  # llama.cpp's other types are listed (inspect), not read
            gtype = foreign_type(raw_type)
            if gtype is None:
                raise UnknownTypeError(f"{what} has GGML type {raw_type}, which neither "
                                       "bitformat nor llama.cpp's gguf package knows",
                                       path=self.path) from None
        n = 1
        for d in dims:
            if d == 0:
                raise FormatError(f"{what} has a zero dimension {dims}", path=self.path)
            n *= d
            if n > self.file_size * 8:
                raise CountTooLargeError(f"{what} claims {n} elements, more than the file "
                                         "could hold", path=self.path)
        per_block = block_layout(gtype)[0]
        if gtype == GGMLType.I2_S:  # blocks over the flat tensor: a row may start mid-block
            if n % per_block:
                raise FormatError(f"{what} has {n} values, not a multiple of the I2_S block "
                                  f"of {per_block}", path=self.path)
        elif dims[0] % per_block:
            raise FormatError(f"{what} has rows of {dims[0]} values, not a multiple of the "
                              f"{gtype.name} block of {per_block}", path=self.path)
        info = TensorInfo(name, tuple(reversed(dims)), gtype, offset,
                          ggml_nbytes(gtype, n, int(dims[0])))
        self.tensors[name] = info
        return info

    def _check_layout(self, infos: list[TensorInfo]) -> None:
        end_of_data = self.file_size - self.data_offset
        if infos and end_of_data < 0:
            raise TruncatedError("file ends before its data section", path=self.path)
        last_end, last_name = 0, None
        for info in sorted(infos, key=lambda t: t.offset):
            what = f"tensor {sanitize(info.name)!r}"
            if info.offset % self.alignment:
                raise TensorLayoutError(f"{what} starts at offset {info.offset}, not a "
                                        f"multiple of the alignment {self.alignment}",
                                        path=self.path)
            if info.offset < last_end:
                raise TensorLayoutError(f"{what} overlaps tensor {sanitize(last_name)!r}",
                                        path=self.path)
            if info.offset + info.nbytes > end_of_data:
                end = self.data_offset + info.offset + info.nbytes
                raise TruncatedError(f"{what} needs bytes up to {end} but the file has "
                                     f"{self.file_size}", path=self.path)
            last_end, last_name = info.offset + info.nbytes, info.name

    # -- access --------------------------------------------------------------------------
    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 array backed by the memory map."""
        info = self.tensors[name]
        start = self.data_offset + info.offset
        return np.frombuffer(self._mmap, dtype=np.uint8, count=info.nbytes, offset=start)

    def array(self, name: str) -> np.ndarray:
        """A plain (non-block) tensor as a typed numpy array of its logical shape."""
        from ..constants import NUMPY_DTYPE

        info = self.tensors[name]
        if info.ggml_type not in NUMPY_DTYPE:
            raise UnknownTypeError(f"{info.ggml_type.name} is a block type, not an array",
                                   path=self.path, tensor=name)
        return self.raw(name).view(NUMPY_DTYPE[info.ggml_type]).reshape(info.shape)

    def get(self, key: str, default: Any = None) -> Any:
        mv = self.metadata.get(key)
        return default if mv is None else mv.plain()

    def close(self) -> None:
        try:
            self._mmap.close()
        except BufferError:
            pass  # arrays still view the map; it closes when they are gone

    def __enter__(self) -> GGUFReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- writing ------------------------------------------------------------------------------
def _pack_string(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def pack_value(mv: MetaValue) -> bytes:
    out = [struct.pack("<I", mv.vtype)]
    if mv.vtype == ValueType.STRING:
        out.append(_pack_string(mv.value))
    elif mv.vtype == ValueType.ARRAY:
        out.append(struct.pack("<IQ", mv.item_type, len(mv.value)))
        if mv.item_type == ValueType.STRING:
            out.extend(_pack_string(s) for s in mv.value)
        else:
            out.append(np.asarray(mv.value).astype(ARRAY_DTYPE[mv.item_type]).tobytes())
    else:
        out.append(struct.pack(SCALAR_FORMAT[mv.vtype], mv.value))
    return b"".join(out)


@dataclass
class PlannedTensor:
    name: str
    shape: tuple[int, ...]  # numpy order
    ggml_type: GGMLType
    nbytes: int


@dataclass
class GGUFWriter:
    """Write a GGUF file tensor by tensor, atomically.

    Declare every tensor first (:meth:`add_tensor`), then :meth:`write` streams the data in
    the declared order from an iterator of byte arrays. Nothing appears at ``path`` unless
    the whole file was written; an existing file there (even the source being read) is
    replaced only at the end.
    """

    path: str
    metadata: dict[str, MetaValue] = field(default_factory=dict)
    tensors: list[PlannedTensor] = field(default_factory=list)
    alignment: int = GGUF_DEFAULT_ALIGNMENT

    def add_metadata(self, key: str, value: Any) -> None:
        self.metadata[key] = MetaValue.of(value)

    def add_tensor(self, name: str, shape: tuple[int, ...], ggml_type: GGMLType,
                   nbytes: int | None = None) -> None:
        if nbytes is None:
            n = 1
            for d in shape:
                n *= int(d)
            nbytes = ggml_nbytes(ggml_type, n, int(shape[-1]) if shape else None)
        self.tensors.append(PlannedTensor(name, tuple(int(d) for d in shape), ggml_type, nbytes))

    def _header(self) -> bytes:
        meta = dict(self.metadata)
        if self.alignment != GGUF_DEFAULT_ALIGNMENT:
            meta["general.alignment"] = MetaValue(ValueType.UINT32, self.alignment)
        parts = [GGUF_MAGIC, struct.pack("<IQQ", GGUF_VERSION, len(self.tensors), len(meta))]
        for key, mv in meta.items():
            parts.append(_pack_string(key))
            parts.append(pack_value(mv))
        offset = 0
        for t in self.tensors:
            dims = tuple(reversed(t.shape))
            parts.append(_pack_string(t.name))
            parts.append(struct.pack("<I", len(dims)))
            parts.append(struct.pack(f"<{len(dims)}Q", *dims))
            parts.append(struct.pack("<IQ", t.ggml_type, offset))
            offset += -(-t.nbytes // self.alignment) * self.alignment
        return b"".join(parts)

    def write(self, data: Iterator[np.ndarray | bytes], *, refresh_header: bool = False) -> None:
        """Write the header and then each declared tensor's bytes, in order.

        With ``refresh_header``, the header is serialised again after the data and written
        over the first one: metadata values the data iterator updated in place (fixed-size
        values only, such as a per-tensor f32 scale) end up in the file.
        """
        header = self._header()
        with atomic_file(self.path) as fh:
            fh.write(header)
            fh.write(b"\0" * (-len(header) % self.alignment))
            count = 0
            for t, blob in zip(self.tensors, data, strict=False):
                buf = memoryview(np.ascontiguousarray(blob)).cast("B") if not isinstance(
                    blob, bytes) else memoryview(blob)
                if buf.nbytes != t.nbytes:
                    raise ValueError(f"tensor {t.name!r}: got {buf.nbytes} bytes, declared "
                                     f"{t.nbytes}")
                fh.write(buf)
                fh.write(b"\0" * (-t.nbytes % self.alignment))
                count += 1
                checkpoint("tensor")
            if count != len(self.tensors):
                raise ValueError(f"declared {len(self.tensors)} tensors, got data for {count}")
            if refresh_header:
                final = self._header()
                if len(final) != len(header):
                    raise ValueError("metadata changed size while the data was written")
                fh.seek(0)
                fh.write(final)


def read_metadata_only(path: str | os.PathLike) -> dict[str, Any]:
    """Metadata of a GGUF file as plain Python values."""
    with GGUFReader(path) as r:
        return {k: v.plain() for k, v in r.metadata.items()}


__all__ = ["GGUFReader", "GGUFWriter", "MetaValue", "TensorInfo"]
