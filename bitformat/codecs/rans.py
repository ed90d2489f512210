"""``rans``: trits entropy-coded with a constriction-compatible rANS coder.

Config (JSON): ``{"id": "rans", "mode": "group5", "table": [u_minus, u_zero, u_plus],
"segment": 0}``

* ``mode``: ``"trit"`` (one trit per symbol, alphabet 3) or ``"group5"`` (5 trits per symbol,
  alphabet 243, digits as in ``base3``).
* ``table``: the trit distribution in 12-bit units (each >= 1, sum 4096); in ``group5`` mode the
  243-entry table is derived from it (:func:`~bitformat.codecs.rans_tables.group5_units`), or
  ``table`` may list all 243 units itself. Default: the BitNet b1.58 2B-4T model-wide trit
  distribution (P(0) = 0.422).
* ``segment``: 0 for one stream, else one stream per ``segment`` trits (the last shorter), which
  lets encode and decode run streams in parallel at a cost of ~30-37 bits per stream.

Bytes (all little-endian)::

    u64  n                          trit count
    u32  word_count[S]              only if segment > 0; S = ceil(n / segment)
    u32  words[...]                 the S streams' words, concatenated

Each stream is exactly constriction's ``AnsCoder.encode_reverse`` + ``get_compressed()`` output
for its symbols (see :mod:`~bitformat.codecs.rans_kernels`). Use :meth:`Rans.fit` to build a
codec whose table matches some data.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from ..errors import FormatError, TruncatedError
from . import rans_tables as rt
from .base import Codec, as_trits, finish, read_header, write_header
from .rans_streams import RansTables, decode_trit_streams, encode_trit_streams, segment_offsets

#: P(-1), P(0), P(+1) of BitNet b1.58 2B-4T (bitformat/data/bitnet-2b4t-weight-profile.json)
DEFAULT_TABLE: tuple[int, ...] = tuple(rt.trit_units([288940, 422109, 288951]).tolist())


class Rans(Codec):
    """rANS over trits (``mode="trit"``) or 5-trit groups (``mode="group5"``).

    Examples
    --------
    >>> trits = np.int8([1, 0, 0, -1, 0, 1, 0])
    >>> c = Rans.fit(trits, mode="group5")
    >>> c.get_config()
    {'id': 'rans', 'mode': 'group5', 'table': [585, 2341, 1170], 'segment': 0}
    >>> c.decode(c.encode(trits)).tolist()
    [1, 0, 0, -1, 0, 1, 0]
    """

    codec_id: ClassVar[str] = "rans"

    def __init__(self, mode: str = "group5", table: Any = DEFAULT_TABLE, segment: int = 0):
        if mode not in rt.MODES:
            raise FormatError(f"rans mode must be one of {sorted(rt.MODES)}, got {mode!r:.20}")
        if not isinstance(segment, int) or isinstance(segment, bool) or segment < 0:
            raise FormatError(f"rans segment must be an int >= 0, got {segment!r:.20}")
        table = [int(u) for u in table]
        self.mode = mode
        self.table = table
        self.segment = segment
        self.tables = RansTables.from_stored(mode, [table])  # checks the table

    @classmethod
    def fit(cls, data: Any, mode: str = "group5", segment: int = 0) -> Rans:
        """A codec whose table is the trit distribution of ``data``."""
        return cls(mode, rt.trit_units(rt.count_trits(as_trits(data))).tolist(), segment)

    def get_config(self) -> dict[str, Any]:
        return {"id": self.codec_id, "mode": self.mode, "table": list(self.table),
                "segment": self.segment}

    def _offsets(self, n: int) -> np.ndarray:
        if self.segment == 0:
            return np.array([0, n], dtype=np.int64)
        return segment_offsets(n, self.segment)

    def encode(self, data: Any) -> bytes:
        trits = as_trits(data)
        off = self._offsets(trits.size)
        words, word_off = encode_trit_streams(trits, off, self.tables, parallel=off.size > 2)
        parts = [write_header(trits.size)]
        if self.segment:
            parts.append(np.diff(word_off).astype("<u4").tobytes())
        parts.append(words.astype("<u4", copy=False).tobytes())
        return b"".join(parts)

    def decode(self, buf: Any, out: np.ndarray | None = None) -> np.ndarray:
        n, payload = read_header(buf, out)
        s = -(-n // self.segment) if self.segment else 1
        if self.segment:
            if len(payload) < 4 * s:
                raise TruncatedError(f"rans: {s} stream word counts need {4 * s} bytes, "
                                     f"{len(payload)} remain")
            counts = np.frombuffer(payload[:4 * s], dtype="<u4").astype(np.int64)
            payload = payload[4 * s:]
        if len(payload) % 4:
            raise FormatError(f"rans: {len(payload)} bytes of words is not a whole number")
        words = np.frombuffer(payload, dtype="<u4").astype(np.uint32)
        if not self.segment:
            counts = np.array([words.size], dtype=np.int64)
        if int(counts.sum()) != words.size:
            raise FormatError(f"rans: word counts add up to {int(counts.sum())}, "
                              f"{words.size} words follow")
        word_off = np.zeros(s + 1, dtype=np.int64)
        np.cumsum(counts, out=word_off[1:])
        trits = decode_trit_streams(words, word_off, self._offsets(n), self.tables,
                                    parallel=s > 1)
        return finish(trits, out)
