"""Run BitNet b1.58 models from any bitformat container: ``load(path, backend)``.

Backends: ``numpy`` (reference, float32 or float64), ``cpu`` (numba kernels over the
container bytes) and ``wgpu`` (WGSL kernels on a GPU through wgpu; docs/gpu.md). Importing
this package imports neither numba nor wgpu; ``load(..., "cpu")`` or ``"wgpu"`` does.
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
from .models import ModelArgs, Transformer

__all__ = ["BACKENDS", "GenerationResponse", "GenerationResult", "GenerationStats",
           "LoadedModel", "ModelArgs", "Transformer", "generate", "generate_step", "load",
           "make_sampler", "stream_generate"]
