"""How a KV cache holds its keys and values: float32, float16 or q8_0 rows (``--kv-cache``).

A cache row is one position's key (or value) of one KV head, ``head_dim`` values. The three
types hold it as:

- ``f32``: the float32 values as they are;
- ``f16``: IEEE half, rounded to nearest (ties to even), as numpy's ``astype(np.float16)``
  and llama.cpp's default cache (``GGML_TYPE_F16``);
- ``q8_0``: llama.cpp's ``Q8_0`` blocks of 32 values, lossy: per block the scale
  ``d = max|x| / 127`` and codes ``round(x * (1 / d))`` (half away from zero, as C's
  ``roundf``), read back as ``code * fp16(d)`` (``quantize_row_q8_0_ref`` in ggml-quants.c).
  A row is int8: ``head_dim`` codes, then each block's scale as its two little-endian half
  bytes (34 bytes per 32 values, as a ``block_q8_0``; the order of the parts is this
  project's). A last block of fewer than 32 values (a head size not a multiple of 32) is
  scaled by its own maximum.

Every backend stores and reads a row by these rules (the cpu backend's kernels in
:mod:`.cpu.ops`, the wgpu kernels for f16), so every backend sees the same cached values for
the same setting.
"""

from __future__ import annotations

import numpy as np

from ..constants import KV_TYPES
from ..errors import RequestError

#: values per q8_0 block (llama.cpp's ``QK8_0``)
QK8_0 = 32


def check_kv_type(kv_type: str) -> None:
    """Refuse a KV cache type that is not one of :data:`~bitformat.constants.KV_TYPES`."""
    if kv_type not in KV_TYPES:
        raise RequestError(f"the KV cache type must be {', '.join(KV_TYPES)}, got "
                           f"{kv_type!r:.20}")


def row_width(kv_type: str, head_dim: int) -> int:
    """Elements of one cache row of ``head_dim`` values (q8_0: codes and scale bytes)."""
    return head_dim + 2 * -(-head_dim // QK8_0) if kv_type == "q8_0" else head_dim


def storage_dtype(kv_type: str) -> type:
    return {"f32": np.float32, "f16": np.float16, "q8_0": np.int8}[kv_type]


def row_bytes(kv_type: str, head_dim: int) -> int:
    """Bytes of one cache row."""
    return row_width(kv_type, head_dim) * np.dtype(storage_dtype(kv_type)).itemsize


def position_bytes(args, kv_type: str) -> int:
    """Bytes of K and V of every layer for one cached position (``args``: the model's
    ``ModelArgs``)."""
    return 2 * args.n_layers * args.n_kv_heads * row_bytes(kv_type, args.head_dim)


def roundf(y: np.ndarray) -> np.ndarray:
    """C's ``roundf`` of float32 ``y``: to nearest, halves away from zero (``np.round`` rounds
    them to even). ``a - floor(a)`` is exact in float32, so the test sees the true fraction."""
    a = np.abs(y)
    f = np.floor(a)
    return np.copysign(f + (a - f >= np.float32(0.5)), y).astype(np.float32)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """float32 rows ``x`` [..., d] -> q8_0 rows int8 [..., :func:`row_width`]."""
    x = np.asarray(x, np.float32)
    d = x.shape[-1]
    nb = -(-d // QK8_0)
    pad = np.zeros(x.shape[:-1] + (nb * QK8_0,), np.float32)
    pad[..., :d] = x
    blocks = pad.reshape(x.shape[:-1] + (nb, QK8_0))
    scale = np.abs(blocks).max(axis=-1) / np.float32(127.0)  # float32, as ggml's
    inv = np.zeros_like(scale)
    np.divide(np.float32(1.0), scale, out=inv, where=scale != 0)
    codes = roundf(blocks * inv[..., None]).astype(np.int8).reshape(pad.shape)
    out = np.empty(x.shape[:-1] + (d + 2 * nb,), np.int8)
    out[..., :d] = codes[..., :d]
    out[..., d:] = scale.astype(np.float16).view(np.int8).reshape(out.shape[:-1] + (2 * nb,))
    return out


def dequantize_q8_0(rows: np.ndarray, d: int) -> np.ndarray:
    """q8_0 rows int8 [..., row_width] -> float32 [..., d]: ``code * fp16(scale)``."""
    nb = -(-d // QK8_0)
    scale = np.ascontiguousarray(rows[..., d:d + 2 * nb]).view(np.float16).astype(np.float32)
    per = np.repeat(scale, QK8_0, axis=-1)[..., :d]
    return rows[..., :d].astype(np.float32) * per


def store(cache: np.ndarray, at: int, x: np.ndarray) -> None:
    """Rows ``x`` float32 [T, KV, d] into one layer's cache ``cache`` [len, KV, width] at
    positions ``at..``, by its type (the storage dtype tells: float32, float16, int8 q8_0)."""
    T = x.shape[0]
    if cache.dtype == np.int8:
        cache[at: at + T] = quantize_q8_0(x)
    else:
        cache[at: at + T] = x  # float16: rounded to nearest even


def load(cache: np.ndarray, n: int, d: int) -> np.ndarray:
    """The first ``n`` positions of one layer's cache as float32 [n, KV, d]."""
    if cache.dtype == np.int8:
        return dequantize_q8_0(cache[:n], d)
    if cache.dtype == np.float16:
        return cache[:n].astype(np.float32)  # exact
    return cache[:n]  # float32 (float64 on the numpy backend in float64)
