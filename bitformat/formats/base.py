"""The contract every ternary container encoding follows, and its registry.

A format turns a :class:`~bitformat.ternary.TernaryTensor` into the bytes one GGUF tensor
holds and back. Subclasses register themselves by ``format_id`` (``__init_subclass__``), so
the CLI, the converters and the tests all see the same list.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from ..constants import GGMLType, ggml_nbytes
from ..errors import ScaleLossError, ShapeError
from ..ternary import TernaryTensor, f16_exact

FORMATS: dict[str, type[TernaryFormat]] = {}


class TernaryFormat:
    """One encoding of a ternary matrix inside a GGUF tensor.

    ``native`` formats are GGML types that carry their own scales (i2_s, tq2_0, tq1_0).
    The others are stored as a plain integer tensor; their logical shape and per-tensor scale
    travel as ``bitformat.tensor.<name>.*`` metadata, which the container layer handles.
    ``variable_size`` formats (rans) have no fixed :meth:`stored_shape`: their bytes are a 1-D
    tensor of ``storage_type`` whose length :meth:`encode` decides, and :meth:`decode` checks
    the length against the data's own header.
    """

    format_id: ClassVar[str]
    storage_type: ClassVar[GGMLType]
    native: ClassVar[bool] = True
    variable_size: ClassVar[bool] = False  # size depends on the trits (rans): 1-D storage
    file_type: ClassVar[int | None] = None
    scale_block: ClassVar[int] = 0  # 0: one scale per tensor
    row_block: ClassVar[int] = 1  # row length must be a multiple of this
    scale_dtype: ClassVar[str] = "f32"  # the narrowest float the scales are stored in
    description: ClassVar[str] = ""
    #: how a container in this encoding stores its F16/BF16 tensors: "" (as they are) or
    #: "rans_float" (entropy-coded, formats/rans_float.py; rans only)
    plain_coding: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "format_id" in cls.__dict__:
            FORMATS[cls.format_id] = cls

    # -- shapes ----------------------------------------------------------------------------
    def check_shape(self, rows: int, cols: int, name: str = "") -> None:
        """Raise :class:`ShapeError` if a ``[rows, cols]`` matrix cannot be stored."""
        if rows < 1 or cols < 1:
            raise ShapeError(f"empty matrix {rows}x{cols}", tensor=name or None)
        if cols % self.row_block:
            raise ShapeError(f"{self.format_id} needs rows of a multiple of {self.row_block} "
                             f"values, the matrix {rows}x{cols} has rows of {cols}",
                             tensor=name or None)

    def stored_shape(self, rows: int, cols: int) -> tuple[int, ...]:
        """Shape of the GGUF tensor (numpy order) that holds a ``[rows, cols]`` matrix."""
        return (rows, cols)

    def nbytes(self, rows: int, cols: int) -> int:
        shape = self.stored_shape(rows, cols)
        return ggml_nbytes(self.storage_type, int(np.prod(shape)), int(shape[-1]))

    # -- scales ----------------------------------------------------------------------------
    def prepare(self, t: TernaryTensor, allow_rounding: bool = False) -> tuple[TernaryTensor,
                                                                                 float]:
        """Bring ``t``'s scales into the form this format stores.

        Returns the adapted tensor and the largest relative change made to any scale (0.0
        when lossless). Raises :class:`ScaleLossError` instead of changing a scale unless
        ``allow_rounding`` is set.
        """
        self.check_shape(t.rows, t.cols, t.name)
        loss = 0.0
        if self.scale_block == 0:
            t, loss = t.with_tensor_scale(allow_rounding)
        else:
            t = t.with_block_scales(self.scale_block)
        if self.scale_dtype == "f16":
            t, extra = _round_scales_f16(t, self.format_id, allow_rounding)
            loss = max(loss, extra)
        return t, loss

    # -- bytes -----------------------------------------------------------------------------
    def encode(self, t: TernaryTensor) -> np.ndarray:
        """The tensor's stored bytes (or words); ``t`` has been through :meth:`prepare`."""
        raise NotImplementedError

    def decode(self, raw: np.ndarray, rows: int, cols: int, *, scale: float | None = None,
               path: str | None = None, name: str | None = None) -> TernaryTensor:
        """Read a ``[rows, cols]`` matrix from ``raw`` (uint8, exactly :meth:`nbytes` long).

        ``scale`` is the per-tensor scale from the metadata for non-native formats.
        """
        raise NotImplementedError

    def validate(self, raw: np.ndarray, rows: int, cols: int, *, scale: float | None = None,
                 path: str | None = None, name: str | None = None) -> None:
        """Raise what :meth:`decode` raises for these bytes, else nothing (a format may check
        faster than it decodes: i2_s)."""
        self.decode(raw, rows, cols, scale=scale, path=path, name=name)


def _round_scales_f16(t: TernaryTensor, fmt: str, allow: bool) -> tuple[TernaryTensor, float]:
    s = t.scales
    with np.errstate(over="ignore"):
        r = s.astype(np.float16).astype(np.float32)
    bad = r != s
    if not bad.any():
        return t, 0.0
    first = float(s[bad].flat[0])
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.abs(r.astype(np.float64) - s) / np.abs(s.astype(np.float64))
    worst = float(np.nanmax(np.where(bad, rel, 0.0)))
    if not allow:
        raise ScaleLossError(
            f"scale {first!r} is not exactly representable in float16, which {fmt} stores "
            f"(nearest {float(np.float16(first))!r}, relative error up to {worst:.3g}); pass "
            "--allow-scale-rounding to round it", tensor=t.name or None)
    if not np.all(np.isfinite(r)):
        raise ScaleLossError(f"scale {first!r} overflows float16", tensor=t.name or None)
    return TernaryTensor(t.trits, r, t.scale_block, t.name), worst


def get_format(format_id: str) -> TernaryFormat:
    """The registered format called ``format_id``."""
    from . import load_all

    load_all()
    try:
        return FORMATS[format_id]()
    except KeyError:
        raise ValueError(f"unknown format {format_id!r}; known: {', '.join(sorted(FORMATS))}"
                         ) from None


__all__ = ["FORMATS", "TernaryFormat", "get_format", "f16_exact"]
