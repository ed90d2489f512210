"""Container encodings: one module per format id, each opening with its byte spec."""

from __future__ import annotations

import importlib

from .base import FORMATS, TernaryFormat, get_format

#: Every ternary encoding, in the order tables list them.
FORMAT_IDS = ("i2_s", "tq2_0", "tq1_0", "q2_0", "iq2_bn", "iq1_bn", "stfma", "colpack_u32", "rans")
#: The encodings whose matrices can be read a row at a time (``rans`` holds coded tiles).
ROW_FORMAT_IDS = tuple(f for f in FORMAT_IDS if f != "rans")
#: What ``bitformat convert --to`` takes: every encoding, and a Hugging Face folder.
CONVERT_TARGETS = (*FORMAT_IDS, "hf")


def load_all() -> None:
    """Import every format module so each registers itself."""
    for fid in FORMAT_IDS:
        importlib.import_module(f"{__name__}.{fid}")


__all__ = ["CONVERT_TARGETS", "FORMATS", "FORMAT_IDS", "ROW_FORMAT_IDS", "TernaryFormat",
           "get_format", "load_all"]
