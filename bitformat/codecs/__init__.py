"""Codecs: one contract (:class:`Codec`) and one registry (:func:`get_codec`).

===========  ===========================================================================
id           what it does
===========  ===========================================================================
bitpack2     4 trits per byte, 2-bit codes (trit + 1), first trit in the low bits
base3        5 trits per byte, base-3 digits most significant first (TQ1_0 digit order)
rans         rANS entropy coding, bit-compatible with constriction's DefaultAnsCoder
zstd         Zstandard over raw bytes, the generic baseline
===========  ===========================================================================

Byte layouts: ``docs/codecs.md``. The multi-stream rANS API a container uses lives in
:mod:`bitformat.codecs.rans_streams`.
"""

from __future__ import annotations

from .base import CODECS, Codec, get_codec, register_codec
from .packing import Base3, Bitpack2
from .rans import Rans
from .zstd_codec import Zstd

__all__ = ["CODECS", "Base3", "Bitpack2", "Codec", "Rans", "Zstd", "get_codec",
           "register_codec"]
