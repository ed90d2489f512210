"""Container encodings: one module per format id, each opening with its byte spec."""

from __future__ import annotations

import importlib

from .base import FORMATS, TernaryFormat, get_format

#: Every ternary encoding, in the order tables list them.
FORMAT_IDS = ("i2_s", "tq2_0", "tq1_0", "q2_0", "iq2_bn", "iq1_bn", "stfma", "colpack_u32", "rans")


def load_all() -> None:
    """Import every format module so each registers itself."""
    for fid in FORMAT_IDS:
        importlib.import_module(f"{__name__}.{fid}")


__all__ = ["FORMATS", "FORMAT_IDS", "TernaryFormat", "get_format", "load_all"]
