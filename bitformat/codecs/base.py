"""The contract every codec follows, and the registry that finds codecs by id.

A codec turns an array into bytes and back, with everything it needs to decode held in its
configuration (``get_config()``: a JSON-serialisable dict that includes ``"id"``) plus the
bytes themselves. This mirrors numcodecs (``abc.py`` / ``registry.py``): subclasses that set
``codec_id`` register themselves through ``__init_subclass__``, and :func:`get_codec` rebuilds a
codec from a config read back from JSON.

Trit codecs (``bitpack2``, ``base3``, ``rans``) take int8 arrays of -1/0/+1 of any shape and
decode to a flat int8 array. Their bytes start with the trit count, so no shape travels in the
config. See ``docs/codecs.md`` for the byte layouts.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from ..errors import FormatError, InvalidTritError, TruncatedError, UnsupportedConversionError

#: codec_id -> class, filled by :meth:`Codec.__init_subclass__`.
CODECS: dict[str, type[Codec]] = {}

#: Largest count (trits, or bytes for zstd) a decoder accepts from a header when no ``out``
#: array bounds it: 2^32, 13x the largest tensor of BitNet b1.58 2B-4T. Compressed data cannot
#: bound it (a zstd frame of zeros, or a rANS run of symbol 0, which costs no words at all), so
#: callers decoding untrusted data should pass ``out`` sized from what they expect.
MAX_TRITS = 1 << 32

HEADER_BYTES = 8  # u64 little-endian trit count at the start of every trit codec's bytes


class Codec:
    """Base class: ``encode(data) -> bytes``, ``decode(buf, out=None) -> ndarray``.

    Subclasses set ``codec_id`` and, if they take parameters, override :meth:`get_config`
    (the default returns ``{"id": codec_id}``) and make ``cls(**config_without_id)`` work.
    Two codecs are equal when their configs are.
    """

    codec_id: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "codec_id" in cls.__dict__:
            register_codec(cls)

    def encode(self, data: Any) -> bytes:
        raise NotImplementedError

    def decode(self, buf: Any, out: np.ndarray | None = None) -> np.ndarray:
        raise NotImplementedError

    def get_config(self) -> dict[str, Any]:
        return {"id": self.codec_id}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Codec:
        cfg = dict(config)
        cfg.pop("id", None)
        return cls(**cfg)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Codec):
            return NotImplemented
        return self.get_config() == other.get_config()

    def __hash__(self) -> int:
        return hash(repr(sorted(self.get_config().items())))

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items() if k != "id")
        return f"{type(self).__name__}({params})"


def register_codec(cls: type[Codec], codec_id: str | None = None) -> type[Codec]:
    """Make ``cls`` findable by :func:`get_codec` (done automatically for subclasses)."""
    cid = codec_id or cls.codec_id
    CODECS[cid] = cls
    return cls


def get_codec(config: dict[str, Any]) -> Codec:
    """Build the codec a config describes (the inverse of :meth:`Codec.get_config`).

    Examples
    --------
    >>> get_codec({"id": "base3"}).get_config()
    {'id': 'base3'}
    """
    if not isinstance(config, dict) or "id" not in config:
        raise FormatError(f"codec config must be a dict with an 'id', got {config!r:.80}")
    cls = CODECS.get(config["id"])
    if cls is None:
        raise FormatError(f"unknown codec id {str(config['id'])!r:.40}")
    try:
        return cls.from_config(config)
    except TypeError as exc:  # unexpected or missing keys
        raise FormatError(f"bad config for codec {cls.codec_id!r}: {exc}") from None


# -- helpers shared by the trit codecs ------------------------------------------------------------
def as_trits(data: Any) -> np.ndarray:
    """Flatten ``data`` to a contiguous int8 array, raising :class:`InvalidTritError` on a
    value outside {-1, 0, +1}."""
    arr = np.asarray(data)
    if arr.dtype != np.int8:
        if arr.size and (arr.min() < -1 or arr.max() > 1):
            bad = int(np.flatnonzero((arr < -1) | (arr > 1))[0])
            raise InvalidTritError(f"value {arr.reshape(-1)[bad]!r} at flat element {bad} is "
                                   "not a trit")
        arr = arr.astype(np.int8)
    flat = np.ascontiguousarray(arr).reshape(-1)
    # (t + 1) as uint8 wraps -128..-2 to 127..255, so one comparison finds every bad value
    codes = flat.view(np.uint8) + np.uint8(1)
    if flat.size and int(codes.max()) > 2:
        bad = int(np.flatnonzero(codes > 2)[0])
        raise InvalidTritError(f"value {int(flat[bad])} at flat element {bad} is not a trit")
    return flat


def write_header(n: int) -> bytes:
    return int(n).to_bytes(HEADER_BYTES, "little")


def read_header(buf: Any, out: np.ndarray | None) -> tuple[int, memoryview]:
    """Split ``buf`` into (trit count, payload), checking the count against ``out`` or the cap."""
    mv = memoryview(buf).cast("B")
    if len(mv) < HEADER_BYTES:
        raise TruncatedError(f"codec data is {len(mv)} bytes, shorter than its "
                             f"{HEADER_BYTES}-byte header")
    n = int.from_bytes(mv[:HEADER_BYTES], "little")
    if out is not None:
        if out.size != n:
            raise FormatError(f"data holds {n} trits but the output array has {out.size}")
    elif n > MAX_TRITS:
        raise FormatError(f"trit count {n} exceeds the cap of {MAX_TRITS}")
    return n, mv[HEADER_BYTES:]


def finish(values: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """Return ``values`` (flat), or copy them into ``out`` and return that."""
    if out is None:
        return values
    if out.dtype != values.dtype:
        raise UnsupportedConversionError(f"output array must be {values.dtype}, got {out.dtype}")
    np.copyto(out, values.reshape(out.shape))  # works for any shape and strides of ``out``
    return out
