"""Fixed-rate trit packers: ``bitpack2`` (4 trits per byte) and ``base3`` (5 trits per byte).

Both write ``u64 n`` (little-endian trit count) and then the packed bytes. A trit t is stored
as its code ``c = t + 1`` (0, 1, 2 for -1, 0, +1); the last byte is padded with zero trits
(code 1). Decoders reject a payload of the wrong length, a code 3 / a byte above 242, and
padding that is not code 1, so every trit array has exactly one encoding.

``bitpack2`` byte j holds trits 4j .. 4j+3, little end first::

    bit   7 6 | 5 4 | 3 2 | 1 0
    code   c3 |  c2 |  c1 |  c0        (c0 = trit 4j + 1)

``base3`` byte j holds trits 5j .. 5j+4 as base-3 digits, most significant first (the digit
order of GGUF TQ1_0 before its 256/243 scaling)::

    byte = 81*c0 + 27*c1 + 9*c2 + 3*c3 + c4      (0 .. 242)
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from ..errors import FormatError, InvalidTritError, TruncatedError
from .base import Codec, as_trits, finish, read_header, write_header

_ZERO_CODE = 1


def _padded_codes(trits: np.ndarray, group: int) -> np.ndarray:
    """Codes (uint8) as ``(ceil(n / group), group)``, padded with code 1."""
    n = trits.size
    m = -(-n // group)
    codes = np.full(m * group, _ZERO_CODE, dtype=np.uint8)
    codes[:n] = trits.view(np.uint8) + np.uint8(1)
    return codes.reshape(m, group)


def _check_payload(payload: memoryview, n: int, group: int, codec_id: str) -> np.ndarray:
    want = -(-n // group)
    if len(payload) < want:
        raise TruncatedError(f"{codec_id}: {n} trits need {want} bytes, only {len(payload)} "
                             "follow the header")
    if len(payload) > want:
        raise FormatError(f"{codec_id}: {len(payload) - want} bytes after the packed trits")
    return np.frombuffer(payload, dtype=np.uint8)


def _check_padding(decoded: np.ndarray, n: int, codec_id: str) -> None:
    pad = decoded[n:]
    if pad.size and np.any(pad != 0):
        raise FormatError(f"{codec_id}: padding after trit {n} is not zero trits")


# -- bitpack2 ------------------------------------------------------------------------------------
_SHIFT2 = np.array([0, 2, 4, 6], dtype=np.uint8)
_BYTE_CODES2 = (np.arange(256, dtype=np.uint8)[:, None] >> _SHIFT2) & np.uint8(3)  # [256, 4]
_BITPACK2_TRITS = _BYTE_CODES2.astype(np.int8) - np.int8(1)
_BITPACK2_BAD = np.any(_BYTE_CODES2 == 3, axis=1)


class Bitpack2(Codec):
    """4 trits per byte, 2 bits each (``code = trit + 1``), first trit in the low bits.

    Examples
    --------
    >>> c = Bitpack2()
    >>> c.encode(np.int8([1, 0, -1, 1, 0])).hex()  # n = 5, then 0b10_00_01_10, 0b01_01_01_01
    '05000000000000008655'
    """

    codec_id: ClassVar[str] = "bitpack2"

    def encode(self, data: Any) -> bytes:
        trits = as_trits(data)
        codes = _padded_codes(trits, 4)
        packed = np.bitwise_or.reduce(codes << _SHIFT2, axis=1)
        return write_header(trits.size) + packed.tobytes()

    def decode(self, buf: Any, out: np.ndarray | None = None) -> np.ndarray:
        n, payload = read_header(buf, out)
        packed = _check_payload(payload, n, 4, self.codec_id)
        if packed.size and np.any(_BITPACK2_BAD[packed]):
            j = int(np.flatnonzero(_BITPACK2_BAD[packed])[0])
            k = int(np.flatnonzero(_BYTE_CODES2[packed[j]] == 3)[0])
            raise InvalidTritError(f"bitpack2: code 3 (not a trit) at trit {4 * j + k}")
        trits = _BITPACK2_TRITS[packed].reshape(-1)
        _check_padding(trits, n, self.codec_id)
        return finish(trits[:n], out)


# -- base3 ---------------------------------------------------------------------------------------
_POW3 = np.array([81, 27, 9, 3, 1], dtype=np.uint8)
_BASE3_TRITS = (
    (np.arange(243)[:, None] // np.array([81, 27, 9, 3, 1])) % 3 - 1).astype(np.int8)  # [243, 5]


class Base3(Codec):
    """5 trits per byte as base-3 digits, most significant first (``81*c0 + ... + c4``).

    Examples
    --------
    >>> Base3().encode(np.int8([1, 0, -1, 1, 0, 1])).hex()
    '0600000000000000c4ca'
    """

    codec_id: ClassVar[str] = "base3"

    def encode(self, data: Any) -> bytes:
        trits = as_trits(data)
        codes = _padded_codes(trits, 5)
        # every partial sum stays <= 242, so uint8 arithmetic cannot overflow
        packed = np.add.reduce(codes * _POW3, axis=1, dtype=np.uint8)
        return write_header(trits.size) + packed.tobytes()

    def decode(self, buf: Any, out: np.ndarray | None = None) -> np.ndarray:
        n, payload = read_header(buf, out)
        packed = _check_payload(payload, n, 5, self.codec_id)
        if packed.size and int(packed.max()) > 242:
            j = int(np.flatnonzero(packed > 242)[0])
            raise InvalidTritError(f"base3: byte {j} is {int(packed[j])}, above 242")
        trits = _BASE3_TRITS[packed].reshape(-1)
        _check_padding(trits, n, self.codec_id)
        return finish(trits[:n], out)
