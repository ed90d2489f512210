"""The decoder every family shares (``base.py``: :class:`Transformer`, which runs a family's
layer as :mod:`bitformat.graph` describes it), its sizes (:class:`ModelArgs`) and KV cache;
:mod:`bitformat.families` holds each family's graph and names."""

from __future__ import annotations

from .base import (
    ARCHITECTURES,
    INPUT_GROUPS,
    KVCache,
    ModelArgs,
    Rows,
    Segment,
    Transformer,
)


def model_class(args: ModelArgs) -> type[Transformer]:
    """The network that runs ``args``' family op by op: the shared :class:`Transformer`
    for every family (each family differs only in its graph)."""
    return Transformer


__all__ = ["ARCHITECTURES", "INPUT_GROUPS", "KVCache", "ModelArgs", "Rows",
           "Segment", "Transformer", "model_class"]
