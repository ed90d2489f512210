"""Mutation fuzzing: damaged containers of every format give clean errors or correct reads.

Each case mutates a valid container (byte flips in the header or anywhere, a truncation, a
large count written over a field, appended garbage), then opens it and reads every tensor.
The only acceptable outcomes are a :class:`BitformatError` whose message names the file, or a
read whose trits are all in {-1, 0, +1} with finite scales. Any other exception fails the
test with the seed that reproduces it. ``BITFORMAT_FUZZ_CASES`` sets the total (default 2000).
"""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from bitformat import convert, open_model
from bitformat.errors import BitformatError
from bitformat.formats import FORMAT_IDS
from bitformat.io.gguf import GGUFReader

TOTAL = int(os.environ.get("BITFORMAT_FUZZ_CASES", "2000"))
PER_FORMAT = -(-TOTAL // len(FORMAT_IDS))


def mutate(blob: bytes, header_len: int, rng: np.random.Generator) -> bytes:
    b = bytearray(blob)
    kind = rng.integers(6)
    if kind == 0:  # flip a few bytes in the header
        for _ in range(rng.integers(1, 5)):
            b[rng.integers(header_len)] ^= 1 << rng.integers(8)
    elif kind == 1:  # random bytes anywhere
        for _ in range(rng.integers(1, 9)):
            b[rng.integers(len(b))] = rng.integers(256)
    elif kind == 2:  # truncate
        del b[rng.integers(len(b)):]
    elif kind == 3:  # a huge or random 64-bit value over a header field
        at = int(rng.integers(max(header_len - 8, 1)))
        value = int(rng.choice([2**63, 2**32, 2**40, rng.integers(2**62)]))
        b[at:at + 8] = struct.pack("<Q", value)
    elif kind == 4:  # garbage appended or a header string length changed
        b += rng.bytes(int(rng.integers(1, 64)))
        b[rng.integers(header_len)] = rng.integers(256)
    else:  # damage the data section only
        for _ in range(rng.integers(1, 33)):
            b[rng.integers(header_len, len(b))] = rng.integers(256)
    return bytes(b)


def read_everything(path) -> None:
    with open_model(path) as m:
        for e in m.entries:
            if e.ternary:
                t = m.ternary(e.name)
                assert t.trits.dtype == np.int8 and t.trits.shape == e.shape
                assert np.all(np.abs(t.trits) <= 1), e.name
                assert np.all(np.isfinite(t.scales)), e.name
            else:
                m.plain(e.name)


@pytest.mark.parametrize("fid", FORMAT_IDS)
def test_fuzz_container(tiny_gguf, tmp_path, fid):
    valid = tmp_path / f"valid.{fid}.gguf"
    convert(tiny_gguf, valid, fid)
    blob = valid.read_bytes()
    with GGUFReader(valid) as r:
        header_len = r.data_offset
    rng = np.random.default_rng(FORMAT_IDS.index(fid))
    path = tmp_path / "case.gguf"
    outcomes = {"error": 0, "read": 0}
    for case in range(PER_FORMAT):
        path.write_bytes(mutate(blob, header_len, rng))
        try:
            read_everything(path)
            outcomes["read"] += 1
        except BitformatError as exc:
            assert str(path) in str(exc), f"case {case}: message lacks the file: {exc}"
            outcomes["error"] += 1
        except Exception as exc:  # noqa: BLE001 - the point of the test
            pytest.fail(f"{fid} case {case}: {type(exc).__name__}: {exc}")
    assert outcomes["error"] > PER_FORMAT // 10, outcomes  # the mutations do bite
