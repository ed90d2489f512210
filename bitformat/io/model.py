"""What an opened model file is, whatever its container: its tensors (:class:`TensorEntry`), the
:class:`Model` that loads them, and the :class:`ConvertReport` a writer returns.

The readers (``container.py`` for GGUF files, ``formats/hf.py`` for Hugging Face folders) build
these; nothing here reads a file, so every layer above can import it without a circle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..constants import GGMLType, ggml_nbytes
from ..errors import MissingTensorError
from ..ternary import TernaryTensor
from .gguf import MetaValue


@dataclass
class TensorEntry:
    """One tensor of a model: a ternary matrix in some encoding, or a plain array."""

    name: str
    shape: tuple[int, ...]  # logical, numpy order ([rows, cols] for ternary matrices)
    encoding: str  # a format id for ternary tensors, else the GGML type name ("F16", ...)
    nbytes: int  # bytes it occupies in this container
    ternary: bool
    #: how a plain tensor is stored when not as its GGML type: "rans_float" (entropy-coded,
    #: formats/rans_float.py); ``encoding`` stays its logical type and ``plain`` decodes it
    coding: str = ""

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=object))

    @property
    def plain_nbytes(self) -> int:
        """A plain tensor's bytes as its GGML type (what ``Model.plain`` returns)."""
        if not self.coding:
            return self.nbytes
        return ggml_nbytes(GGMLType[self.encoding], self.n_elements)


@dataclass
class Model:
    """An opened container: metadata, tensors in file order, and loaders for each."""

    path: str
    metadata: dict[str, MetaValue]
    entries: list[TensorEntry]
    container: str  # the format id of the ternary tensors ("mixed" if several)
    _load_ternary: Callable[[str], TernaryTensor] = field(repr=False)
    _load_plain: Callable[[str], tuple[GGMLType, np.ndarray]] = field(repr=False)
    _close: Callable[[], None] = field(repr=False, default=lambda: None)
    #: scales changed on reading (an HF "bitlinear" 1/s): tensor -> relative change
    scale_changes: dict[str, float] = field(default_factory=dict)
    #: float master weights made ternary on reading (:mod:`bitformat.quantize`): tensor -> the
    #: float type it is stored in ("F32", "F16", "BF16")
    quantized: dict[str, str] = field(default_factory=dict)
    #: tensor -> the quantization rule used, filled in as each such tensor is read
    quantize_rules: dict[str, str] = field(default_factory=dict)

    def entry(self, name: str) -> TensorEntry:
        for e in self.entries:
            if e.name == name:
                return e
        raise MissingTensorError("missing (the model has no tensor of this name)",
                                 path=self.path, tensor=name)

    def ternary(self, name: str) -> TernaryTensor:
        """Decode one ternary matrix into the hub form."""
        return self._load_ternary(name)

    def plain(self, name: str) -> tuple[GGMLType, np.ndarray]:
        """A non-ternary tensor: its GGML type and its raw bytes (uint8, read-only)."""
        return self._load_plain(name)

    def get(self, key: str, default: Any = None) -> Any:
        mv = self.metadata.get(key)
        return default if mv is None else mv.plain()

    @property
    def architecture(self) -> str:
        return str(self.get("general.architecture", "unknown"))

    def close(self) -> None:
        self._close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class ConvertReport:
    """What a conversion did: per tensor, the largest relative scale change it made."""

    source: str
    target: str
    format_id: str
    scale_changes: dict[str, float] = field(default_factory=dict)
    tensors: int = 0
    ternary_weights: int = 0
    bytes_written: int = 0
    #: float master weights quantized on the way: tensor -> (float type, rule)
    quantized: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: what validation found but did not refuse (:mod:`bitformat.validate`), one line each
    warnings: list[str] = field(default_factory=list)
