"""bitformat: lossless containers, converters and runtimes for ternary LLM weights."""

from __future__ import annotations

__version__ = "0.1.0"

from .container import Model, convert, open_model  # noqa: E402
from .runtime import load  # noqa: E402  (imports no numba until a cpu model is loaded)
from .ternary import TernaryTensor  # noqa: E402

__all__ = ["Model", "TernaryTensor", "convert", "load", "open_model", "__version__"]
