"""bitformat: lossless containers, converters and runtimes for ternary LLM weights."""

from __future__ import annotations

__version__ = "0.1.0"

from .container import Model, convert, open_model  # noqa: E402
from .ternary import TernaryTensor  # noqa: E402

__all__ = ["Model", "TernaryTensor", "convert", "open_model", "__version__"]
