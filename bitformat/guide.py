"""What a newcomer is told: that a synthetic model's text means nothing, and where real models are.

``bitformat synth`` writes models with the real architecture and random trits (tests and demos
need no download), named by ``general.name`` (``bitnet-tiny-synth``, ``bitnet2b-synth``; the name
travels through every conversion). Their generated text is noise; :func:`is_synthetic` lets
``run`` say so, and :data:`REAL_MODELS` is the way to a model that writes sentences.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: The official BitNet b1.58 2B-4T files on the Hugging Face Hub and what bitformat does with them.
REAL_MODELS = """\
BitNet b1.58 2B-4T (1.2 GB as i2_s) comes from the Hugging Face Hub; download it with the
Hugging Face CLI (`hf download`; older huggingface_hub releases call it
`huggingface-cli download`, same arguments):

  hf download microsoft/bitnet-b1.58-2B-4T-gguf ggml-model-i2_s.gguf --local-dir models/2b4t-gguf
  bitformat inspect models/2b4t-gguf/ggml-model-i2_s.gguf
  bitformat run models/2b4t-gguf/ggml-model-i2_s.gguf --chat -p "What is a ternary weight?"

  hf download microsoft/bitnet-b1.58-2B-4T --local-dir models/2b4t-hf     # packed safetensors
  bitformat convert models/2b4t-hf --to tq2_0 -o models/2b4t.tq2_0.gguf
  bitformat run models/2b4t.tq2_0.gguf --chat -p "What is a ternary weight?"

  hf download microsoft/bitnet-b1.58-2B-4T-bf16 --local-dir models/2b4t-bf16  # bf16 masters
  bitformat convert models/2b4t-bf16 --to i2_s -o models/2b4t.i2_s.gguf       # quantizes them
"""


def is_synthetic(metadata: Mapping[str, Any]) -> bool:
    """Whether ``general.name`` (a MetaValue or a plain value) is one ``synth`` writes.

    >>> is_synthetic({"general.name": "bitnet-tiny-synth"})
    True
    >>> is_synthetic({"general.name": "bitnet2b"})  # the official file's name
    False
    """
    from .synth import PRESETS

    name = metadata.get("general.name")
    name = name.plain() if hasattr(name, "plain") else name
    return isinstance(name, str) and name in {p.general_name for p in PRESETS.values()}


def synthetic_note(path: str) -> str:
    """The lines ``run`` prints before a synthetic model's text."""
    return (f"note: {path} is a synthetic model (`bitformat synth`: the real architecture with "
            "random weights), so the text it generates is meaningless. For a real model:\n"
            "  hf download microsoft/bitnet-b1.58-2B-4T-gguf ggml-model-i2_s.gguf "
            "--local-dir models/2b4t-gguf\n"
            "  bitformat run models/2b4t-gguf/ggml-model-i2_s.gguf --chat -p \"What is a ternary "
            "weight?\"\n"
            "(more: README.md, \"Real models\")")


__all__ = ["REAL_MODELS", "is_synthetic", "synthetic_note"]
