"""Type ids and block layouts, written as data.

Ids follow ggml's ``ggml.h`` (mirrored by gguf-py ``gguf/constants.py``) except ``I2_S``,
which only exists in microsoft/BitNet's fork of ggml (bitnet.cpp) and is not in upstream.
"""

from __future__ import annotations

from enum import IntEnum

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
GGUF_DEFAULT_ALIGNMENT = 32


class GGMLType(IntEnum):
    """Tensor element types that bitformat reads or writes."""

    F32 = 0
    F16 = 1
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    I2_S = 36  # microsoft/BitNet fork only; upstream ggml has no type 36
    Q2_0 = 42  # upstream ggml (ggml.h GGML_TYPE_Q2_0): 64-value blocks, f16 d + 2-bit codes
    IQ1_BN = 134  # ik_llama.cpp only: BitNet 1.625 bpw, f16 scale per row
    IQ2_BN = 135  # ik_llama.cpp only: BitNet 2.0 bpw, f32 scale per row


class FileType(IntEnum):
    """``general.file_type`` values for the ternary containers."""

    MOSTLY_TQ1_0 = 36
    MOSTLY_TQ2_0 = 37
    MOSTLY_I2_S = 40  # fork value; upstream uses 40 for MOSTLY_Q1_0, see docs/model.md §3
    MOSTLY_Q2_0 = 41  # upstream llama.h LLAMA_FTYPE_MOSTLY_Q2_0
    MOSTLY_IQ1_BN = 136  # ik_llama.cpp llama.h LLAMA_FTYPE_MOSTLY_IQ1_BN
    MOSTLY_IQ2_BN = 137  # ik_llama.cpp llama.h LLAMA_FTYPE_MOSTLY_IQ2_BN


#: (elements per block, bytes per block). Byte counts spelt out as the layout they hold.
GGML_BLOCK_LAYOUT: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.BF16: (1, 2),
    GGMLType.I8: (1, 1),
    GGMLType.I16: (1, 2),
    GGMLType.I32: (1, 4),
    GGMLType.I64: (1, 8),
    GGMLType.F64: (1, 8),
    GGMLType.TQ1_0: (256, 240 // 5 + 16 // 4 + 2),  # qs: 5 trits/byte, qh: 4/byte, f16 d = 54
    GGMLType.TQ2_0: (256, 256 // 4 + 2),  # qs[64] (4 trits/byte) + f16 d = 66
    GGMLType.I2_S: (128, 128 // 4),  # 32 bytes per 128 values, plus one 32-byte tail per tensor
    GGMLType.Q2_0: (64, 2 + 64 // 4),  # f16 d + qs[16] (4 codes/byte) = 18
    GGMLType.IQ1_BN: (64, 12 + 1),  # ql[12] (5 trits/byte) + extra (4 trits) = 13, + row scale
    GGMLType.IQ2_BN: (64, 64 // 4),  # qs[16] = 16, + row scale
}

#: Bytes each row of these types starts with (ik_llama.cpp's ``row_meta_size``): the row's
#: scale, f16 for IQ1_BN and f32 for IQ2_BN.
ROW_META_BYTES: dict[GGMLType, int] = {GGMLType.IQ1_BN: 2, GGMLType.IQ2_BN: 4}

I2_S_TAIL_BYTES = 32  # after the packed data: f32 scale in bytes 0..3, the rest zero

NUMPY_DTYPE = {
    GGMLType.F32: "<f4",
    GGMLType.F16: "<f2",
    GGMLType.BF16: "<u2",  # numpy has no bfloat16; kept as raw 16-bit words
    GGMLType.I8: "i1",
    GGMLType.I16: "<i2",
    GGMLType.I32: "<i4",
    GGMLType.I64: "<i8",
    GGMLType.F64: "<f8",
}


class ForeignType(int):
    """A GGML type of llama.cpp's that bitformat lists but does not read (Q8_0, Q4_K, ...):
    ``inspect`` shows such a file's tensors by type name; reading one is refused by name."""

    name: str
    block: tuple[int, int]  # (elements per block, bytes per block)

    def __new__(cls, value: int, name: str, block: tuple[int, int]) -> ForeignType:
        obj = int.__new__(cls, value)
        obj.name, obj.block = name, block
        return obj

    def __repr__(self) -> str:
        return f"<GGML type {self.name} ({int(self)})>"


def foreign_type(value: int) -> ForeignType | None:
    """The GGML type ``value`` as gguf-py (llama.cpp's own Python package) knows it, where
    bitformat does not read it; None if neither knows it."""
    try:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        t = GGMLQuantizationType(value)
        return ForeignType(value, t.name, tuple(GGML_QUANT_SIZES[t]))
    except (ImportError, ValueError, KeyError):
        return None


def block_layout(ggml_type: GGMLType | ForeignType) -> tuple[int, int]:
    """(elements per block, bytes per block) of a type bitformat reads or only lists."""
    if isinstance(ggml_type, ForeignType):
        return ggml_type.block
    return GGML_BLOCK_LAYOUT[ggml_type]


def ggml_nbytes(ggml_type: GGMLType, n_elements: int, row_len: int | None = None) -> int:
    """Bytes a tensor of ``n_elements`` values occupies; Python ints, never numpy.

    Types with a per-row header (:data:`ROW_META_BYTES`) need ``row_len``, the values per row
    (the first GGUF dimension).
    """
    per_block, block_bytes = block_layout(ggml_type)
    if n_elements % per_block:
        raise ValueError(f"{n_elements} values do not divide into blocks of {per_block}")
    size = n_elements // per_block * block_bytes
    if ggml_type in ROW_META_BYTES:
        if not row_len or n_elements % row_len:
            raise ValueError(f"{ggml_type.name} needs the row length of its {n_elements} values")
        size += n_elements // row_len * ROW_META_BYTES[ggml_type]
    if ggml_type == GGMLType.I2_S:
        size += I2_S_TAIL_BYTES
    return size


class ValueType(IntEnum):
    """GGUF metadata value types."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


SCALAR_FORMAT = {
    ValueType.UINT8: "<B",
    ValueType.INT8: "<b",
    ValueType.UINT16: "<H",
    ValueType.INT16: "<h",
    ValueType.UINT32: "<I",
    ValueType.INT32: "<i",
    ValueType.FLOAT32: "<f",
    ValueType.BOOL: "<?",
    ValueType.UINT64: "<Q",
    ValueType.INT64: "<q",
    ValueType.FLOAT64: "<d",
}


#: what ``--kv-cache`` takes: the KV cache's element type (:mod:`bitformat.runtime.kvquant`).
#: "f16" (the default, as llama.cpp's) rounds keys and values to float16 as they are stored
#: (to nearest, ties to even): half the bytes of "f32", which keeps them as the model computes
#: them (float32; float64 on the numpy backend in float64). "q8_0" stores llama.cpp's 32-value
#: int8 blocks with a float16 scale: 8.5 bits a value, lossy. Every backend that has a type
#: stores it the same way, so they give the same tokens for the same setting
KV_TYPES = ("f16", "f32", "q8_0")
#: the KV cache type ``run``, ``chat``, ``serve``, ``bench`` and ``load()`` use unless told
DEFAULT_KV_TYPE = "f16"
