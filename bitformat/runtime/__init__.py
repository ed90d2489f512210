"""Run BitNet b1.58 models from any bitformat container: ``load(path, backend)``.

Backends: ``numpy`` (reference, float32 or float64) and ``cpu`` (numba kernels over the
container bytes). Importing this package does not import numba; ``load(..., "cpu")`` does.
"""

from __future__ import annotations

from .generate import (
    GenerationResponse,
    GenerationResult,
    GenerationStats,
    generate,
    generate_step,
    make_sampler,
    stream_generate,
)
from .loader import BACKENDS, LoadedModel, load
from .models import BitNet, ModelArgs

__all__ = ["BACKENDS", "BitNet", "GenerationResponse", "GenerationResult", "GenerationStats",
           "LoadedModel", "ModelArgs", "generate", "generate_step", "load", "make_sampler",
           "stream_generate"]
