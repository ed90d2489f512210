"""Model families: one module each (``bitnet.py``: BitNet b1.58 2B-4T), shared parts in
``base.py``."""

from __future__ import annotations

from .base import ARCHITECTURES, KVCache, ModelArgs, Rows, Segment
from .bitnet import INPUT_GROUPS, PROJECTIONS, BitNet

__all__ = ["ARCHITECTURES", "INPUT_GROUPS", "PROJECTIONS", "BitNet", "KVCache", "ModelArgs", "Rows",
           "Segment"]
