"""``zstd``: a generic byte codec, the baseline every ternary codec is compared against.

The bytes are one standard Zstandard frame (RFC 8878) with the content size in its header, as
``zstandard.ZstdCompressor(level).compress`` writes it. Any bytes-like object or array is
accepted (its raw bytes are compressed); ``decode`` returns a flat uint8 array.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from ..errors import FormatError
from .base import MAX_TRITS, Codec, finish


def _raw_bytes(data: Any) -> memoryview:
    if isinstance(data, np.ndarray):
        return memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    return memoryview(data).cast("B")


class Zstd(Codec):
    """Zstandard at ``level`` (1..22, default 19).

    Examples
    --------
    >>> c = Zstd(level=3)
    >>> c.decode(c.encode(b"abcabcabc")).tobytes()
    b'abcabcabc'
    """

    codec_id: ClassVar[str] = "zstd"

    def __init__(self, level: int = 19):
        if not isinstance(level, int) or isinstance(level, bool) or not 1 <= level <= 22:
            raise FormatError(f"zstd level must be an int in 1..22, got {level!r}")
        self.level = level

    def get_config(self) -> dict[str, Any]:
        return {"id": self.codec_id, "level": self.level}

    def encode(self, data: Any) -> bytes:
        import zstandard

        return zstandard.ZstdCompressor(level=self.level, write_content_size=True).compress(
            _raw_bytes(data))

    def decode(self, buf: Any, out: np.ndarray | None = None) -> np.ndarray:
        import zstandard

        raw = _raw_bytes(buf)
        try:
            size = zstandard.frame_content_size(raw)
        except zstandard.ZstdError as exc:
            raise FormatError(f"zstd: not a zstd frame ({exc})") from None
        cap = out.nbytes if out is not None else MAX_TRITS
        if size < 0 or size > cap:  # -1: the frame does not say; we always write it
            raise FormatError(f"zstd: frame content size {size} missing or above {cap}")
        dobj = zstandard.ZstdDecompressor().decompressobj()
        try:  # libzstd itself refuses output beyond the frame's declared content size
            data = dobj.decompress(raw)
        except zstandard.ZstdError as exc:
            raise FormatError(f"zstd: corrupt frame ({exc})") from None
        if not dobj.eof:
            raise FormatError("zstd: frame is truncated")
        if dobj.unused_data:
            raise FormatError(f"zstd: {len(dobj.unused_data)} bytes after the frame")
        if len(data) != size:
            raise FormatError(f"zstd: frame says {size} bytes, decompressed {len(data)}")
        values = np.frombuffer(data, dtype=np.uint8)
        if out is not None:
            if out.nbytes != size:
                raise FormatError(f"zstd: {size} bytes do not fill an output of {out.nbytes}")
            if out.dtype != np.uint8:
                values = values.view(out.dtype)
        return finish(values.copy() if out is None else values, out)
