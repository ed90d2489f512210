"""The hub every conversion passes through: :class:`TernaryTensor`.

A ternary weight matrix is a grid of trits t in {-1, 0, +1} (int8, ``[rows, cols]``, a row
being one output feature of ``cols`` = in_features consecutive inputs) times scales. The
scales are either one per tensor (``scale_block == 0``, ``scales.shape == (1,)``) or one per
block of ``scale_block`` consecutive values of a row (``scales.shape == (rows, cols //
scale_block)``, as TQ1_0/TQ2_0 store them). Scales are kept as float32, which holds every
f16, bf16 and f32 value exactly, so reading never rounds.

Each container converts to and from this class only; N formats need 2N functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import InvalidScaleError, InvalidTritError, ScaleLossError, ShapeError


@dataclass
class TernaryTensor:
    """Trits plus scales; the lossless in-memory form of one ternary weight matrix.

    Examples
    --------
    >>> t = TernaryTensor(np.array([[1, 0, -1, 1]], dtype=np.int8), np.float32([1.5]))
    >>> t.dense().tolist()
    [[1.5, 0.0, -1.5, 1.5]]
    """

    trits: np.ndarray  # int8 [rows, cols], values in {-1, 0, +1}
    scales: np.ndarray  # float32, (1,) or (rows, cols // scale_block)
    scale_block: int = 0  # 0: one scale for the whole tensor
    name: str = ""

    def __post_init__(self) -> None:
        self.trits = np.asarray(self.trits)
        self.scales = np.asarray(self.scales, dtype=np.float32)
        if self.trits.ndim != 2:
            raise ShapeError(f"trits must be 2-D [rows, cols], got shape {self.trits.shape}",
                             tensor=self.name or None)
        if self.trits.dtype != np.int8:
            self.trits = self.trits.astype(np.int8)
        rows, cols = self.trits.shape
        if self.scale_block == 0:
            if self.scales.shape != (1,):
                raise ShapeError(f"a per-tensor scale must have shape (1,), got "
                                 f"{self.scales.shape}", tensor=self.name or None)
        else:
            if cols % self.scale_block:
                raise ShapeError(f"{cols} columns do not divide into scale blocks of "
                                 f"{self.scale_block}", tensor=self.name or None)
            want = (rows, cols // self.scale_block)
            if self.scales.shape != want:
                raise ShapeError(f"per-block scales must have shape {want}, got "
                                 f"{self.scales.shape}", tensor=self.name or None)
        if not np.all(np.isfinite(self.scales)):
            raise InvalidScaleError("scale is NaN or infinite", tensor=self.name or None)

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.trits.shape[0]), int(self.trits.shape[1]))

    @property
    def rows(self) -> int:
        return int(self.trits.shape[0])

    @property
    def cols(self) -> int:
        return int(self.trits.shape[1])

    def validate_trits(self) -> None:
        """Raise :class:`InvalidTritError` unless every value is -1, 0 or +1."""
        bad = np.abs(self.trits.astype(np.int16)) > 1
        if bad.any():
            r, c = np.argwhere(bad)[0]
            raise InvalidTritError(f"value {int(self.trits[r, c])} at row {r}, column {c} is "
                                   "not a trit", tensor=self.name or None)

    def tensor_scale(self) -> float | None:
        """The single scale of the tensor, or None if non-zero blocks disagree.

        Blocks whose trits are all zero carry no information in their scale (TQ writers give
        them d = 0), so they are ignored. A tensor with no non-zero trit has scale 0 unless it
        says otherwise.
        """
        if self.scale_block == 0:
            return float(self.scales[0])
        nz = self.block_nonzero()
        used = self.scales[nz]
        if used.size == 0:
            return 0.0
        first = used.flat[0]
        if np.all(used == first):
            return float(first)
        return None

    def block_nonzero(self, block: int | None = None) -> np.ndarray:
        """bool [rows, cols // block]: whether each block holds a non-zero trit."""
        block = block or self.scale_block
        rows, cols = self.shape
        return (self.trits.reshape(rows, cols // block, block) != 0).any(axis=2)

    def with_tensor_scale(self, allow_rounding: bool = False) -> tuple[TernaryTensor, float]:
        """Return (tensor with one scale, largest relative scale change made).

        Raises :class:`ScaleLossError` if the blocks disagree and ``allow_rounding`` is false;
        with it, the scale becomes the mean of the non-zero blocks' scales.
        """
        if self.scale_block == 0:
            return self, 0.0
        s = self.tensor_scale()
        loss = 0.0
        if s is None:
            used = self.scales[self.block_nonzero()].astype(np.float64)
            lo, hi = float(used.min()), float(used.max())
            if not allow_rounding:
                raise ScaleLossError(
                    f"per-block scales differ ({lo!r} .. {hi!r}) and the target stores one "
                    "scale per tensor; pass --allow-scale-rounding to use their mean",
                    tensor=self.name or None)
            s = float(np.float32(used.mean()))
            loss = float(np.max(np.abs(used - s) / np.abs(used)))
        out = TernaryTensor(self.trits, np.float32([s]), 0, self.name)
        return out, loss

    def with_block_scales(self, block: int) -> TernaryTensor:
        """Per-block form for a block-scaled target; all-zero blocks get scale 0.

        This matches gguf-py's and ggml's quantizers, which set d = max|x| of the block.
        ``block`` may be finer than the source's blocks (their scales repeat) or coarser, as
        long as the non-zero source blocks inside each target block agree (a per-row target
        takes tq2_0 blocks whose scales change only from row to row); otherwise
        :class:`ScaleLossError` names the first block that disagrees.
        """
        if self.scale_block == block:
            return self
        rows, cols = self.shape
        if cols % block:
            raise ShapeError(f"row length {cols} is not a multiple of the {block}-value block",
                             tensor=self.name or None)
        nz = self.block_nonzero(block)
        src = self.scale_block
        if src == 0:
            scales = np.where(nz, self.scales[0], np.float32(0))
        elif src % block == 0:  # finer: each source scale covers several target blocks
            scales = np.where(nz, np.repeat(self.scales, src // block, axis=1), np.float32(0))
        elif block % src == 0:  # coarser: the source blocks inside one must agree
            k = block // src
            sc = self.scales.reshape(rows, cols // block, k)
            used = self.block_nonzero().reshape(rows, cols // block, k)
            hi = np.where(used, sc, -np.inf).max(axis=2)
            lo = np.where(used, sc, np.inf).min(axis=2)
            bad = nz & (hi != lo)
            if bad.any():
                r, b = (int(v) for v in np.argwhere(bad)[0])
                raise ScaleLossError(
                    f"the target stores one scale per {block} values, but the {src}-value "
                    f"blocks of row {r}, columns {b * block}..{(b + 1) * block - 1} have "
                    f"scales {float(lo[r, b])!r} .. {float(hi[r, b])!r}",
                    tensor=self.name or None)
            scales = np.where(nz, hi, np.float32(0))
        else:
            s = self.tensor_scale()
            if s is None:
                raise ScaleLossError(f"cannot re-block scales from {src} to {block}",
                                     tensor=self.name or None)
            scales = np.where(nz, np.float32(s), np.float32(0))
        return TernaryTensor(self.trits, scales.astype(np.float32), block, self.name)

    def dense(self, dtype=np.float32) -> np.ndarray:
        """The weights as a dense float matrix (for tests and references only)."""
        if self.scale_block == 0:
            return self.trits.astype(dtype) * dtype(self.scales[0])
        rows, cols = self.shape
        s = np.repeat(self.scales.astype(dtype), self.scale_block, axis=1)
        return self.trits.astype(dtype) * s

    def equals(self, other: TernaryTensor) -> bool:
        """Same trits and the same scale information (ignoring all-zero blocks)."""
        if self.shape != other.shape or not np.array_equal(self.trits, other.trits):
            return False
        a, b = self.tensor_scale(), other.tensor_scale()
        if a is not None and b is not None:
            return a == b
        if self.scale_block == other.scale_block:
            nz = self.block_nonzero()
            return bool(np.array_equal(self.scales[nz], other.scales[nz]))
        nz = self.trits != 0  # different blocks (per row, per 64, per 256): value by value
        return bool(np.array_equal(self._element_scales()[nz], other._element_scales()[nz]))

    def _element_scales(self) -> np.ndarray:
        if self.scale_block == 0:
            return np.full(self.shape, self.scales[0], np.float32)
        return np.repeat(self.scales, self.scale_block, axis=1)


def f16_exact(value: float) -> bool:
    """Whether ``value`` survives a round trip through IEEE float16."""
    with np.errstate(over="ignore"):
        return float(np.float16(value)) == float(np.float32(value))


def bf16_exact(value: float) -> bool:
    """Whether ``value`` survives a round trip through bfloat16 (low 16 bits of f32 zero)."""
    return (int(np.float32(value).view(np.uint32)) & 0xFFFF) == 0


def check_codes(codes: np.ndarray, *, path: str | None, tensor: str | None) -> None:
    """Raise :class:`InvalidTritError` at the first code 3 in an unpacked code array."""
    bad = codes > 2
    if bad.any():
        idx = int(np.flatnonzero(bad.reshape(-1))[0])
        raise InvalidTritError(f"code 3 (not a trit) at flat element {idx}", path=path,
                               tensor=tensor)
