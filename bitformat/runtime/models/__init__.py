"""Model families: one module each (``bitnet.py``: BitNet b1.58 2B-4T and 1bitLLM,
``llama.py``: Llama/Falcon3 ternary, ``qwen3.py``: Qwen3/Bonsai), the shared decoder and
parts in ``base.py``; :mod:`bitformat.families` tells the families apart."""

from __future__ import annotations

from .base import (
    ARCHITECTURES,
    INPUT_GROUPS,
    PROJECTIONS,
    KVCache,
    ModelArgs,
    Rows,
    Segment,
    Transformer,
)
from .bitnet import BitNet
from .llama import Llama
from .qwen3 import Qwen3

#: family id -> its network class
MODELS: dict[str, type[Transformer]] = {"bitnet-2b4t": BitNet, "bitnet-1bitllm": BitNet,
                                        "llama": Llama, "qwen3": Qwen3}


def model_class(args: ModelArgs) -> type[Transformer]:
    return MODELS[args.family.id]


__all__ = ["ARCHITECTURES", "INPUT_GROUPS", "MODELS", "PROJECTIONS", "BitNet", "KVCache", "Llama",
           "ModelArgs", "Qwen3", "Rows", "Segment", "Transformer", "model_class"]
