"""The contract every ternary container encoding follows, and its registry.

A format turns a :class:`~bitformat.ternary.TernaryTensor` into the bytes one GGUF tensor
holds and back. Subclasses register themselves by ``format_id`` (``__init_subclass__``), so
the CLI, the converters and the tests all see the same list.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from ..constants import GGMLType, ggml_nbytes
from ..errors import InvalidScaleError, ScaleLossError, ShapeError
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


class F16BlockFormat(TernaryFormat):
    """GGML's block types with one f16 scale ``d`` per block of ``row_block`` trits (tq2_0,
    tq1_0, q2_0): each block is ``block_bytes`` bytes, ``d`` at byte ``scale_at`` and the
    trits' codes in the rest. A subclass says how codes are packed (:meth:`pack`) and read
    back, checked (:meth:`unpack`); encoding, the size and scale checks are here, once."""

    block_bytes: ClassVar[int]
    scale_at: ClassVar[int]

    def _codes(self, blocks: np.ndarray) -> np.ndarray:
        """The code bytes of ``blocks`` [n, block_bytes]: all but the two of ``d``."""
        at = self.scale_at
        return blocks[:, :at] if at else blocks[:, 2:]

    def pack(self, codes: np.ndarray) -> np.ndarray:  # pragma: no cover - interface
        """uint8 codes (trit + 1) [n_blocks, row_block] -> code bytes [n_blocks, ...]."""
        raise NotImplementedError

    def unpack(self, packed: np.ndarray, per_row: int, path: str | None,
               name: str | None) -> np.ndarray:  # pragma: no cover - interface
        """Code bytes [n_blocks, ...] -> int8 trits [n_blocks, row_block]; a byte that holds
        no valid code raises :class:`InvalidTritError` naming its row and column."""
        raise NotImplementedError

    def encode(self, t: TernaryTensor) -> np.ndarray:
        codes = (t.trits.reshape(-1, self.row_block) + np.int8(1)).view(np.uint8)
        nb = codes.shape[0]
        out = np.empty((nb, self.block_bytes), dtype=np.uint8)
        at = self.scale_at
        out[:, at: at + 2] = t.scales.astype("<f2").reshape(nb, 1).view(np.uint8)
        self._codes(out)[:] = self.pack(codes)
        return out.reshape(-1)

    def decode(self, raw: np.ndarray, rows: int, cols: int, *, scale: float | None = None,
               path: str | None = None, name: str | None = None) -> TernaryTensor:
        try:
            self.check_shape(rows, cols, name or "")
        except ShapeError as e:
            raise ShapeError(e.problem, path=path, tensor=name) from None
        qk = self.row_block
        nb, per_row = rows * cols // qk, cols // qk
        if raw.size != nb * self.block_bytes:
            raise ShapeError(f"a {rows}x{cols} {self.format_id} tensor takes "
                             f"{nb * self.block_bytes} bytes, got {raw.size}", path=path,
                             tensor=name)
        blocks = raw.reshape(nb, self.block_bytes)
        at = self.scale_at
        d = np.ascontiguousarray(blocks[:, at: at + 2]).view("<f2").astype(np.float32)
        bad = ~np.isfinite(d)
        if bad.any():
            b = int(np.flatnonzero(bad)[0])
            raise InvalidScaleError(f"block d is {float(d.flat[b])} at row {b // per_row}, "
                                    f"block {b % per_row}", path=path, tensor=name)
        trits = self.unpack(self._codes(blocks), per_row, path, name)
        return TernaryTensor(trits.reshape(rows, cols), d.reshape(rows, per_row), qk,
                             name or "")


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


__all__ = ["FORMATS", "F16BlockFormat", "TernaryFormat", "get_format", "f16_exact"]
