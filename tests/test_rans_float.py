"""``rans_float``: 16-bit float tensors coded losslessly. Round trips of every bit pattern, an
independent reader built on constriction, the writer's choices, hostile bytes, and the rans
container that stores its embedding this way.

The reference reader below is written from docs/formats/rans_float.md alone: plain Python
parses the words and constriction's own ``AnsCoder`` decodes every stream, switching the
model at row boundaries. Our bytes must decode to the same values there, and constriction's
encoder must reproduce our stream words exactly.
"""

from __future__ import annotations

import zlib

import constriction
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bitformat import convert, open_model
from bitformat.constants import GGMLType
from bitformat.errors import BitformatError, FormatError, MetadataError, ShapeError
from bitformat.formats import FORMAT_IDS
from bitformat.formats import rans_float as rf
from bitformat.io.gguf import GGUFReader, GGUFWriter

NAME = "token_embd.weight"
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
EM = {GGMLType.F16: (5, 10), GGMLType.BF16: (8, 7)}


# -- a reference reader, from the spec ---------------------------------------------------------
def exact_model(units: list[int]):
    f = np.asarray(units, dtype=np.int64) << 12
    return constriction.stream.model.Categorical((f - 1).astype(np.float64), perfect=False)


def bits(words: list[int], n: int, width: int, start: int = 0) -> list[int]:
    """n items of ``width`` bits from bit ``start`` of a little-endian bit stream."""
    big = sum(w << (32 * i) for i, w in enumerate(words))
    return [(big >> (start + width * i)) & ((1 << width) - 1) for i in range(n)]


def ref_parse(raw: np.ndarray) -> dict:
    w = [int(v) for v in np.frombuffer(raw.tobytes(), dtype="<u4")]
    magic, crc, vdz, rows, cols, a, n_tab, n, n_streams, n_words, n_wide, n_exc = w[:12]
    assert magic == 0x464E4152 and crc == zlib.crc32(raw.tobytes()[8:])
    dtype, z = (vdz >> 8) & 0xFF, (vdz >> 16) & 0xFF
    e_bits, m_bits = {1: (5, 10), 2: (8, 7)}[dtype]
    pos = 12

    def take(k: int) -> list[int]:
        nonlocal pos
        pos += k
        return w[pos - k:pos]

    used = [e for e, b in enumerate(bits(take(2 ** e_bits // 32), 2 ** e_bits, 1)) if b]
    wide = bits(take(2 ** e_bits // 32), 2 ** e_bits, 1)
    flat = bits(take(-(-n_tab * a // 2)), n_tab * a, 16)
    units = [flat[t * a:(t + 1) * a] for t in range(n_tab)]
    cls = bits(take(-(-rows // 8)), rows, 4) if n_tab > 1 else [0] * rows
    counts = bits(take(-(-n_streams // 2)), n_streams, 16)
    words = take(n_words)
    count = rows * cols
    b = 1 + m_bits - z
    plane = bits(take(-(-count * b // 32)), count, b)
    wide_bits = bits(take(-(-n_wide * z // 32)), n_wide, z) if z else []
    exc_index = take(n_exc)
    exc_bits = bits(take(-(-n_exc * z // 32)), n_exc, z) if z else []
    assert pos == len(w) and len(used) == a and n_streams == -(-count // n)
    off = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    return dict(rows=rows, cols=cols, m_bits=m_bits, z=z, used=used, wide=wide, units=units,
                cls=cls, n=n, plane=plane, wide_bits=wide_bits, exc_index=exc_index,
                exc_bits=exc_bits, count=count,
                streams=[np.array(words[off[s]:off[s + 1]], dtype=np.uint32)
                         for s in range(n_streams)])


def ref_runs(lay: dict, s: int):
    """(first value, value count, model) of the row pieces of stream s, in order."""
    i, end = s * lay["n"], min(lay["count"], s * lay["n"] + lay["n"])
    while i < end:
        row = i // lay["cols"]
        stop = min(end, (row + 1) * lay["cols"])
        units = lay["units"][lay["cls"][row]]
        yield i, stop - i, exact_model(units) if len(units) > 1 else None
        i = stop


def ref_decode(raw: np.ndarray) -> np.ndarray:
    lay = ref_parse(raw)
    sym = np.zeros(lay["count"], dtype=np.int64)
    for s, words in enumerate(lay["streams"]):
        coder = constriction.stream.stack.AnsCoder(words)
        for i, k, model in ref_runs(lay, s):
            sym[i:i + k] = coder.decode(model, k) if len(lay["used"]) > 1 else 0
        assert coder.pos() == (0, 0), f"stream {s} ends in state 0 with every word read"
    m, z = lay["m_bits"], lay["z"]
    out = []
    wide_at = 0
    for i in range(lay["count"]):
        e = lay["used"][sym[i]]
        r = lay["plane"][i]
        v = (r >> (m - z)) << 15 | e << m | (r & ((1 << (m - z)) - 1)) << z
        if lay["wide"][e]:
            v |= lay["wide_bits"][wide_at]
            wide_at += 1
        out.append(v)
    for i, lo in zip(lay["exc_index"], lay["exc_bits"], strict=True):
        out[i] |= lo
    assert wide_at == len(lay["wide_bits"])
    return np.array(out, dtype=np.uint16)


def ref_encode_streams(raw: np.ndarray, values: np.ndarray) -> list[np.ndarray]:
    """constriction's words for each stream of ``raw``'s layout, from the values."""
    lay = ref_parse(raw)
    e_shift = lay["m_bits"]
    rank = {e: a for a, e in enumerate(lay["used"])}
    emask = (1 << (15 - e_shift)) - 1
    sym = np.array([rank[(int(v) >> e_shift) & emask] for v in values], dtype=np.int32)
    out = []
    for s in range(len(lay["streams"])):
        coder = constriction.stream.stack.AnsCoder()
        for i, k, model in reversed(list(ref_runs(lay, s))):
            coder.encode_reverse(sym[i:i + k], model)
        out.append(coder.get_compressed())
    return out


# -- values ------------------------------------------------------------------------------------
def bf16_as_f16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16, then stored as f16 (as the official 2B-4T file)."""
    b = np.asarray(x, dtype=np.float32).view(np.uint32)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & np.uint32(0xFFFF0000)
    return b.view(np.float32).astype(np.float16).view(np.uint16)


def values(rng: np.random.Generator, kind: str, shape: tuple[int, int],
           dtype: GGMLType) -> np.ndarray:
    """uint16 patterns of several kinds, with every special value mixed in."""
    n = shape[0] * shape[1]
    scale = np.exp(rng.normal(-4, 1.5, size=(shape[0], 1)))  # rows of different sizes
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    if dtype == GGMLType.BF16:
        v = (x.view(np.uint32) >> 16).astype(np.uint16)
    elif kind == "bf16":
        v = bf16_as_f16(x)
    else:
        v = x.astype(np.float16).view(np.uint16)
    v = v.reshape(-1)
    if kind == "random":  # every bit pattern equally likely: NaN payloads, subnormals, inf
        v = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    elif kind == "special":
        specials = np.array([0x0000, 0x8000, 0x0001, 0x83FF, 0x7C00, 0xFC00, 0x7E01, 0xFFFF,
                             0x0400, 0x7BFF], dtype=np.uint16)
        at = rng.choice(n, min(n, 12), replace=False)
        v[at] = rng.choice(specials, at.size)
    elif kind == "exceptions" and n > 3:  # a few values not from bf16 among bf16 ones
        v[rng.choice(n, 3, replace=False)] |= np.uint16(5)
    elif kind == "constant":
        v[:] = v[0]
    return v.reshape(shape)


def roundtrip(v: np.ndarray, dtype: GGMLType = GGMLType.F16, max_tables: int = 16
              ) -> np.ndarray:
    raw = rf.RansFloat(max_tables).encode(v, dtype, v.shape, NAME)
    back = rf.RansFloat().decode(raw, dtype, v.shape, name=NAME)
    assert back.dtype == np.uint8 and back.size == 2 * v.size
    got = back.view(np.uint16)
    if not np.array_equal(got, v.reshape(-1)):
        i = int(np.flatnonzero(got != v.reshape(-1))[0])
        raise AssertionError(f"value {i}: {int(got[i]):#06x}, wanted {int(v.flat[i]):#06x}")
    return raw


# -- round trips -------------------------------------------------------------------------------
@SETTINGS
@given(rows=st.integers(1, 30), cols=st.integers(1, 700), seed=st.integers(0, 2**32 - 1),
       kind=st.sampled_from(["bf16", "f16", "random", "special", "exceptions", "constant"]),
       dtype=st.sampled_from([GGMLType.F16, GGMLType.BF16]),
       max_tables=st.sampled_from([1, 4, 16]))
def test_random_tensors_round_trip_and_match_constriction(rows, cols, seed, kind, dtype,
                                                          max_tables):
    rng = np.random.default_rng(seed)
    v = values(rng, kind, (rows, cols), dtype)
    raw = roundtrip(v, dtype, max_tables)
    assert np.array_equal(ref_decode(raw), v.reshape(-1))
    lay = ref_parse(raw)
    if len(lay["used"]) > 1:
        for s, (ours, theirs) in enumerate(zip(lay["streams"], ref_encode_streams(
                raw, v.reshape(-1)), strict=True)):
            assert np.array_equal(ours, theirs), f"stream {s}: words differ from constriction's"
    else:
        assert all(s.size == 0 for s in lay["streams"])  # one symbol costs nothing
    assert np.array_equal(rf.RansFloat(max_tables).encode(v, dtype, v.shape), raw)


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (3, 5), (1, 4096), (2, 4097), (7, 33),
                                   (5, 1 << 17), (1, (1 << 17) + 3), (600, 1)])
def test_remainders_and_stream_geometry(shape):
    rng = np.random.default_rng(sum(shape))
    v = values(rng, "bf16", shape, GGMLType.F16)
    raw = roundtrip(v)
    h = rf.describe(raw)
    n = rf.stream_length(shape[1])
    assert h["stream_values"] == n and h["streams"] == -(-v.size // n)
    if shape[1] <= 1 << 17:
        assert n % shape[1] == 0 and n >= min(4096, (1 << 17) // shape[1] * shape[1])


def test_shapes_of_any_rank():
    v = values(np.random.default_rng(2), "bf16", (12, 40), GGMLType.F16)
    for shape in [(480,), (12, 40), (3, 4, 40), (2, 2, 3, 40)]:
        raw = rf.RansFloat().encode(v, GGMLType.F16, shape)
        h = rf.describe(raw)
        assert (h["rows"], h["cols"]) == (v.size // shape[-1], shape[-1])
        back = rf.RansFloat().decode(raw, GGMLType.F16, shape)
        assert np.array_equal(back.view(np.uint16), v.reshape(-1))


def test_golden_fixture():
    """tests/fixtures/rans_float (tools/make_fixtures.py): our reader, the reference reader and
    our writer all agree with the frozen bytes; every section of the layout is in them."""
    import json
    from pathlib import Path

    folder = Path(__file__).parent / "fixtures" / "rans_float"
    files = [folder / n for n in ("tensor.bin", "values.npy", "info.json")]
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        pytest.fail(f"missing fixture {', '.join(missing)}; run tools/make_fixtures.py")
    raw = np.fromfile(files[0], dtype=np.uint8)
    v = np.load(files[1], allow_pickle=False)
    info = json.loads(files[2].read_text())
    assert info == {"format": "rans_float", "dtype": "F16", "shape": list(v.shape)}
    h = rf.describe(raw)
    assert h["tables"] > 1 and h["wide_values"] > 0 and h["exceptions"] == 3 and h["z"] == 3
    back = rf.RansFloat().decode(raw, GGMLType.F16, v.shape, name="fixture")
    assert np.array_equal(back.view(np.uint16), v.reshape(-1))
    assert np.array_equal(ref_decode(raw), v.reshape(-1))
    assert rf.RansFloat().encode(v, GGMLType.F16, v.shape).tobytes() == raw.tobytes()


# -- what the writer chooses -------------------------------------------------------------------
def test_low_zero_bits_are_found_from_the_data():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((300, 2560)) * 0.02).astype(np.float32)
    from_bf16 = bf16_as_f16(x)
    h = rf.describe(roundtrip(from_bf16))
    assert h["z"] == 3 and h["exceptions"] == 0
    e = (from_bf16 >> 10) & 31
    assert h["wide_values"] == int((e == 0).sum()) > 0  # subnormals keep their low bits
    assert rf.describe(roundtrip(x.astype(np.float16).view(np.uint16)))["z"] == 0
    coarse = from_bf16 & np.uint16(0xFFC0)  # only 4 mantissa bits
    assert rf.describe(roundtrip(coarse))["z"] == 6
    bf = (x.view(np.uint32) >> 16).astype(np.uint16)
    assert rf.describe(roundtrip(bf, GGMLType.BF16))["z"] == 0
    few = from_bf16.copy()
    few.flat[[5, 777, 9000]] |= 3  # not from bf16: exceptions, the rest keeps z = 3
    h = rf.describe(roundtrip(few))
    assert (h["z"], h["exceptions"]) == (3, 3)


def test_bf16_weights_stored_as_f16_take_under_11_bits():
    """The realistic embedding (bf16 values as f16, normal with the synth preset's sd): sign
    and 7 mantissa bits raw, the exponent within 0.01 bit of its order-0 entropy."""
    rng = np.random.default_rng(1)
    v = bf16_as_f16((rng.standard_normal((2000, 2560)) * 0.02).astype(np.float32))
    raw = roundtrip(v)
    e = (v >> 10) & 31
    p = np.bincount(e.reshape(-1), minlength=32) / v.size
    h_exp = float(-(p[p > 0] * np.log2(p[p > 0])).sum())
    bpv = raw.size * 8 / v.size
    assert bpv < 11.0
    wide_bits = 3 * int((e == 0).sum()) / v.size
    # streams of 5,120 values cost a 32-bit flush and a 16-bit count each: 0.0094 bits
    assert 8 + h_exp + wide_bits <= bpv < 8 + h_exp + wide_bits + 0.015
    floor = rf.value_entropy(rf.RansFloat.histogram(v))  # values coded one by one
    assert floor < bpv < floor + 0.1


def test_row_classes_follow_row_scales():
    rng = np.random.default_rng(4)
    scale = np.where(np.arange(400) % 2, 1e-3, 1.0)[:, None]
    v = bf16_as_f16((rng.standard_normal((400, 512)) * scale).astype(np.float32))
    many = roundtrip(v)
    one = roundtrip(v, max_tables=1)
    assert rf.describe(many)["tables"] >= 2 and rf.describe(one)["tables"] == 1
    assert (one.size - many.size) * 8 / v.size > 0.9  # knowing the row's scale: ~1 bit
    iid = bf16_as_f16(rng.standard_normal((400, 512)).astype(np.float32))
    assert rf.describe(roundtrip(iid))["tables"] == 1  # classes do not pay on i.i.d. rows


def test_encoder_refuses_what_it_cannot_code():
    with pytest.raises(ShapeError, match="F16 or BF16"):
        rf.RansFloat().encode(np.zeros(4, np.uint16), GGMLType.F32, (4,), NAME)
    with pytest.raises(ShapeError, match="values for shape"):
        rf.RansFloat().encode(np.zeros(4, np.uint16), GGMLType.F16, (5,), NAME)
    with pytest.raises(ShapeError):
        rf.RansFloat().encode(np.zeros(0, np.uint16), GGMLType.F16, (0,), NAME)


# -- hostile bytes -----------------------------------------------------------------------------
def recrc(raw: np.ndarray) -> np.ndarray:
    raw = raw.copy()
    raw[4:8] = np.array([zlib.crc32(raw[8:].tobytes())], dtype="<u4").view(np.uint8)
    return raw


def put_word(raw: np.ndarray, index: int, value: int, crc: bool = True) -> np.ndarray:
    raw = raw.copy()
    raw[4 * index:4 * index + 4] = np.array([value & 0xFFFFFFFF], dtype="<u4").view(np.uint8)
    return recrc(raw) if crc else raw


def word(raw: np.ndarray, index: int) -> int:
    return int(np.frombuffer(raw[4 * index:4 * index + 4].tobytes(), "<u4")[0])


def valid() -> tuple[np.ndarray, np.ndarray, dict]:
    """A tensor with row classes, wide values and exceptions: every section present."""
    rng = np.random.default_rng(5)
    scale = np.where(np.arange(40) % 2, 1e-3, 1.0)[:, None]
    v = bf16_as_f16((rng.standard_normal((40, 300)) * scale).astype(np.float32))
    v.flat[[3, 650, 1250]] |= 1  # in rows of sd 1: normal values, not from bf16
    v.flat[[10, 20]] = [0x0001, 0x0203]  # subnormals
    raw = roundtrip(v)
    h = rf.describe(raw)
    assert h["tables"] > 1 and h["exceptions"] == 3 and h["wide_values"] > 0
    return raw, v, h


def reject(raw: np.ndarray, match: str = "", kind: type = FormatError,
           shape: tuple[int, ...] = (40, 300), dtype: GGMLType = GGMLType.F16) -> None:
    with pytest.raises(kind, match=match) as e:
        rf.RansFloat().decode(raw, dtype, shape, path="model.gguf", name=NAME)
    assert "model.gguf" in str(e.value) and NAME in str(e.value)


def sections(h: dict) -> dict[str, int]:
    """The first word of each section (from the spec's table)."""
    sizes = rf.section_words(5, 10, h["z"], h["rows"], h["cols"], h["symbols"], h["tables"],
                             h["streams"], h["stream_words"], h["wide_values"], h["exceptions"])
    out, pos = {}, 0
    for k, size in sizes.items():
        out[k] = pos
        pos += size
    return out


def test_hostile_header():
    raw, _, h = valid()
    bad = raw.copy()
    bad[100] ^= 1
    reject(bad, match="checksum mismatch")
    reject(raw[:-4], kind=ShapeError, match=f"got {raw.size - 4}")
    reject(np.concatenate([raw, raw[:4]]), kind=ShapeError, match=f"got {raw.size + 4}")
    reject(raw[:20], kind=ShapeError, match="20 bytes")
    reject(put_word(raw, 0, 0x12345678), match="magic")
    reject(put_word(raw, 2, word(raw, 2) | 1 << 24), match="version/dtype")
    reject(put_word(raw, 2, word(raw, 2) + 1), match="version/dtype")
    reject(put_word(raw, 2, (word(raw, 2) & ~0xFF00) | 0x300), match="version/dtype")
    reject(raw, dtype=GGMLType.BF16, match="the data is F16")
    reject(raw, shape=(41, 300), kind=ShapeError, match="40 rows of 300")
    reject(raw, shape=(300, 40), kind=ShapeError, match="40 rows of 300")
    reject(raw, shape=(12000,), kind=ShapeError, match="rows")
    reject(put_word(raw, 2, (word(raw, 2) & 0xFFFF) | 11 << 16), match="low bits")  # z > M
    reject(put_word(raw, 5, 0), match="symbols")  # A
    reject(put_word(raw, 5, 33), match="symbols")
    reject(put_word(raw, 6, 17), match="tables")
    reject(put_word(raw, 7, 0), match="streams of")
    reject(put_word(raw, 7, (1 << 17) + 1), match="streams of")
    reject(put_word(raw, 8, h["streams"] + 1), match="streams of")
    reject(put_word(raw, 10, 40 * 300 + 1), match="wide values")
    reject(put_word(raw, 11, 40 * 300 + 1), match="exceptions")
    reject(put_word(raw, 9, h["stream_words"] + 1), kind=ShapeError, match="take")


def test_claimed_size_is_bounded_by_the_data():
    """The sign-and-mantissa plane takes at least one bit a value, so a tensor's data bounds
    the values it claims: a tiny tensor cannot make the reader allocate for 2^32 values."""
    raw, _, _ = valid()
    n = (1 << 16) * ((1 << 16) - 1)
    big = put_word(put_word(raw, 3, 1 << 16), 4, (1 << 16) - 1)
    reject(big, shape=(1 << 16, (1 << 16) - 1), match="do not cover")
    big = put_word(big, 8, -(-n // word(raw, 7)))  # a consistent stream count: sizes decide
    reject(big, shape=(1 << 16, (1 << 16) - 1), kind=ShapeError, match="take")
    reject(put_word(put_word(raw, 3, 1 << 20), 4, 1 << 20), shape=(1 << 20, 1 << 20),
           kind=ShapeError, match="at most")


def test_hostile_sections():
    raw, _, h = valid()
    at = sections(h)
    reject(put_word(raw, at["used"], word(raw, at["used"]) ^ (1 << 31)), match="exponents")
    used = word(raw, at["used"])
    unused = next(b for b in range(32) if not used >> b & 1)
    reject(put_word(raw, at["wide"], word(raw, at["wide"]) | 1 << unused), match="wide")
    reject(put_word(raw, at["tables"], 0), match="units")
    reject(put_word(raw, at["tables"], word(raw, at["tables"]) + 1), match="units")
    reject(put_word(raw, at["classes"], 0xF), match="row class")
    first = word(raw, at["counts"])
    reject(put_word(raw, at["counts"], first + 1), match="word counts")
    swap = ((first & 0xFFFF) + 1) | (((first >> 16) - 1) << 16)  # sum kept, streams moved
    reject(put_word(raw, at["counts"], swap), match="stream 0 of")
    reject(put_word(raw, at["exc_bits"], word(raw, at["exc_bits"]) | 1 << 31),
           match="padding")  # 3 exceptions of 3 bits: bits 9.. of the word are padding
    ex = at["exc_index"]
    reject(put_word(raw, ex + 1, word(raw, ex)), match="exception 1")  # not rising
    reject(put_word(raw, ex + 2, 40 * 300), match="exception 2")  # past the values
    reject(put_word(raw, ex, 10), match="exception 0")  # a subnormal: its exponent is wide
    reject(put_word(raw, at["exc_bits"], word(raw, at["exc_bits"]) & ~0x7), match="exception")


def test_wide_count_must_match():
    """A header claiming one wide value fewer or more (the wide plane's size unchanged) is
    caught once the exponents are decoded."""
    raw, v, h = valid()
    z, n = 3, h["wide_values"]
    for other in (n - 1, n + 1):
        if -(-other * z // 32) == -(-n * z // 32):
            reject(put_word(raw, 10, other), match="values of wide exponents|padding")
            break
    else:
        raise AssertionError("no count keeps the plane's size")


def test_flipped_stream_words_never_escape():
    """Every single-bit flip in the stream words (CRC recomputed, so the coder's own checks
    are tested) gives a clean error or 16-bit values; the CRC alone catches every flip."""
    raw, v, h = valid()
    start = 4 * sections(h)["streams"]
    end = start + 4 * h["stream_words"]
    rng = np.random.default_rng(0)
    caught = 0
    for bit in rng.choice((end - start) * 8, 200, replace=False):
        bad = raw.copy()
        bad[start + bit // 8] ^= 1 << (bit % 8)
        reject(bad, match="checksum")
        try:
            out = rf.RansFloat().decode(recrc(bad), GGMLType.F16, (40, 300), name=NAME)
            assert out.size == 2 * v.size
        except FormatError as e:
            assert NAME in str(e)
            caught += 1
    assert caught > 100


def test_random_mutations_with_fixed_crc_are_clean():
    raw, v, _ = valid()
    rng = np.random.default_rng(3)
    outcomes = {"error": 0, "read": 0}
    for _ in range(300):
        bad = raw.copy()
        for _ in range(rng.integers(1, 4)):
            i = int(rng.integers(8, raw.size))
            bad[i] = rng.integers(256) if rng.random() < 0.5 else bad[i] ^ (1 << rng.integers(8))
        try:
            out = rf.RansFloat().decode(recrc(bad), GGMLType.F16, (40, 300), name=NAME)
            assert out.size == 2 * v.size
            outcomes["read"] += 1
        except BitformatError as e:
            assert NAME in str(e)
            outcomes["error"] += 1
    assert outcomes["error"] > 100, outcomes


# -- in the rans container ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_rans(tiny_bf16_gguf, tmp_path_factory):
    """synth's default tiny model (bf16 values in its F16 embedding) as rans."""
    out = tmp_path_factory.mktemp("rans_float") / "tiny.rans.gguf"
    convert(tiny_bf16_gguf, out, "rans")
    return out


def test_rans_container_codes_its_embedding(tiny_bf16_gguf, tiny_rans):
    with open_model(tiny_bf16_gguf) as a, open_model(tiny_rans) as b, \
            GGUFReader(tiny_rans) as r:
        ea, eb = a.entry(NAME), b.entry(NAME)
        assert (eb.encoding, eb.coding, eb.shape) == ("F16", "rans_float", ea.shape)
        info = r.tensors[NAME]
        assert info.ggml_type == GGMLType.I32 and len(info.shape) == 1
        assert eb.nbytes == info.nbytes < 0.7 * ea.nbytes and eb.plain_nbytes == ea.nbytes
        assert b.get(f"bitformat.tensor.{NAME}.encoding") == "rans_float"
        assert list(b.get(f"bitformat.tensor.{NAME}.shape")) == list(ea.shape)
        assert b.plain(NAME)[0] == GGMLType.F16
        assert b.plain(NAME)[1].tobytes() == a.plain(NAME)[1].tobytes()
        assert np.array_equal(ref_decode(r.raw(NAME)), a.plain(NAME)[1].view(np.uint16))
        assert rf.describe(r.raw(NAME))["z"] == 3  # bf16 values: 3 low mantissa bits left out
        for e in a.entries:  # the F32 norms stay as they are
            if not e.ternary and e.name != NAME:
                assert b.entry(e.name).coding == "" and b.entry(e.name).nbytes == e.nbytes


@pytest.mark.parametrize("fid", [f for f in FORMAT_IDS if f != "rans"] + ["hf"])
def test_every_container_back_from_rans(tiny_bf16_gguf, tiny_rans, tmp_path, fid):
    direct = tmp_path / f"direct.{fid}"
    back = tmp_path / f"back.{fid}"
    convert(tiny_bf16_gguf, direct, fid)
    convert(tiny_rans, back, fid)
    if fid == "hf":
        for f in sorted(direct.iterdir()):
            assert (back / f.name).read_bytes() == f.read_bytes(), f.name
    else:
        assert back.read_bytes() == direct.read_bytes()


def test_full_precision_embedding_round_trips(tmp_path):
    from bitformat.synth import synth

    src = synth("tiny", tmp_path / "f16.gguf", embedding="f16")
    mid = tmp_path / "f16.rans.gguf"
    convert(src, mid, "rans")
    back = tmp_path / "back.gguf"
    convert(mid, back, "i2_s")
    assert back.read_bytes() == src.read_bytes()
    with open_model(mid) as m:
        raw = GGUFReader(mid).raw(NAME)
        assert rf.describe(raw)["z"] == 0 and m.entry(NAME).nbytes * 8 / (512 * 256) > 13


def rewrite(src, path, name: str, blob: np.ndarray, meta_shape=None) -> None:
    with GGUFReader(src) as r:
        meta = dict(r.metadata)
        if meta_shape is not None:
            meta[f"bitformat.tensor.{name}.shape"].value = np.array(meta_shape, np.uint64)
        tensors = [(n, info.shape, info.ggml_type, r.raw(n).copy()) for n, info in
                   r.tensors.items()]
    w = GGUFWriter(str(path), metadata=meta)
    for n, shape, gtype, raw in tensors:
        if n == name:
            shape, gtype, raw = blob.shape, blob_type(blob), blob.view(np.uint8)
        w.add_tensor(n, shape, gtype, raw.nbytes)
    w.write(iter(blob.view(np.uint8) if n == name else raw for n, _, _, raw in tensors))


def blob_type(blob: np.ndarray) -> GGMLType:
    return GGMLType.I32 if blob.dtype == np.uint32 else GGMLType.I8


def test_container_rejects_bad_coded_tensors(tiny_rans, tmp_path):
    with GGUFReader(tiny_rans) as r:
        raw = r.raw(NAME).copy()
    words = raw.view("<u4")
    path = tmp_path / "bad.gguf"
    rewrite(tiny_rans, path, NAME, raw.view(np.int8))  # I8, not I32
    with pytest.raises(FormatError, match="1-D I32") as e:
        open_model(path)
    assert str(path) in str(e.value) and NAME in str(e.value)
    rewrite(tiny_rans, path, NAME, put_word(raw, 0, 7, crc=False).view("<u4"))
    with pytest.raises(FormatError, match="magic"):
        open_model(path)
    rewrite(tiny_rans, path, NAME, words, meta_shape=[512, 255])
    with open_model(path) as m, pytest.raises(ShapeError, match="512 rows of 256"):
        m.plain(NAME)
    bad = raw.copy()
    bad[-1] ^= 0x40
    rewrite(tiny_rans, path, NAME, bad.view("<u4"))
    with open_model(path) as m, pytest.raises(FormatError, match="checksum") as e:
        m.plain(NAME)
    assert str(path) in str(e.value)
    with GGUFReader(tiny_rans) as r:
        meta = dict(r.metadata)
    del meta[f"bitformat.tensor.{NAME}.shape"]
    w = GGUFWriter(str(path), metadata=meta)
    with GGUFReader(tiny_rans) as r:
        tensors = [(n, info.shape, info.ggml_type, r.raw(n).copy()) for n, info in
                   r.tensors.items()]
    for n, shape, gtype, data in tensors:
        w.add_tensor(n, shape, gtype, data.nbytes)
    w.write(iter(d for *_, d in tensors))
    with pytest.raises(MetadataError, match="shape"):
        open_model(path)
