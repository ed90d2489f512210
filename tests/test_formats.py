"""The five ternary encodings: differential tests, round trips, scale rules, hostile bytes,
golden fixtures."""

from __future__ import annotations

import itertools
import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bitformat.errors import (
    InvalidScaleError,
    InvalidTritError,
    MetadataError,
    ScaleLossError,
    ShapeError,
)
from bitformat.formats import FORMAT_IDS, get_format
from bitformat.formats.i2_s import I2S
from bitformat.formats.tq1_0 import ENCODE_LUT, VALID_QH, VALID_QS
from bitformat.ternary import TernaryTensor

FIXTURES = Path(__file__).parent / "fixtures"
GGUF_TYPE = {"tq2_0": Q.TQ2_0, "tq1_0": Q.TQ1_0}
BLOCK_BYTES = {"tq2_0": 66, "tq1_0": 54}
NAME = "blk.0.ffn_up.weight"
SETTINGS = settings(max_examples=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


# -- helpers ---------------------------------------------------------------------------------
def bf16_values(rng: np.random.Generator, n: int) -> np.ndarray:
    """Positive bf16 values inside float16's normal range (so exact in f16 too)."""
    exp = rng.integers(127 - 14, 127 + 16, n).astype(np.uint32)
    mant = rng.integers(0, 128, n).astype(np.uint32)
    return ((exp << 23) | (mant << 16)).view(np.float32)


def random_trits(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Trits with a random zero density and some all-zero 256-value stretches and rows."""
    p0 = float(rng.choice([0.0, 0.4, 0.9, 1.0]))
    t = rng.choice(np.array([-1, 0, 1], dtype=np.int8), size=(rows, cols),
                   p=[(1 - p0) / 2, p0, (1 - p0) / 2])
    for _ in range(int(rng.integers(0, 3))):
        r, c = int(rng.integers(rows)), int(rng.integers(cols))
        t[r, c - c % 256: c - c % 256 + 256] = 0
    return t


def locate(fid: str, rows: int, cols: int, i: int) -> str:
    """Where byte ``i`` of a ``fid`` tensor lies, in that format's own terms."""
    if fid in BLOCK_BYTES:
        b, k = divmod(i, BLOCK_BYTES[fid])
        r, blk = divmod(b, cols // 256)
        return f"row {r}, block {blk}, byte {k} of the block"
    if fid == "i2_s":
        if i >= rows * cols // 4:
            return f"scale tail byte {i - rows * cols // 4}"
        b, m = divmod(i, 32)
        return f"128-value block {b} (row {b * 128 // cols}), byte {m}"
    r, k = divmod(i, 4 * -(-cols // 16))
    return f"row {r}, word {k // 4}, byte {k % 4}"


def assert_bytes(fid: str, rows: int, cols: int, got: np.ndarray, want: np.ndarray) -> None:
    got, want = np.asarray(got).reshape(-1), np.asarray(want).reshape(-1)
    assert got.size == want.size, f"{fid}: {got.size} bytes, expected {want.size}"
    diff = np.flatnonzero(got != want)
    if diff.size:
        i = int(diff[0])
        pytest.fail(f"{fid} {rows}x{cols}: {diff.size} bytes differ, first at "
                    f"{locate(fid, rows, cols, i)}: got {int(got[i]):#04x}, expected "
                    f"{int(want[i]):#04x}")


def encode(fid: str, t: TernaryTensor) -> tuple[TernaryTensor, np.ndarray]:
    fmt = get_format(fid)
    p, loss = fmt.prepare(t)
    assert loss == 0.0
    return p, fmt.encode(p)


def decode(fid: str, raw: np.ndarray, p: TernaryTensor) -> TernaryTensor:
    scale = None if get_format(fid).native else float(p.scales[0])
    return get_format(fid).decode(raw, p.rows, p.cols, scale=scale, name=p.name)


# -- TQ2_0 / TQ1_0 against gguf-py's quantizer -------------------------------------------------
@pytest.mark.parametrize("fid", ["tq2_0", "tq1_0"])
@SETTINGS
@given(rows=st.integers(1, 40), nblk=st.integers(1, 4), per_block=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_tq_matches_gguf(fid, rows, nblk, per_block, seed):
    rng = np.random.default_rng(seed)
    cols = 256 * nblk
    trits = random_trits(rng, rows, cols)
    if per_block:
        s = bf16_values(rng, rows * nblk).reshape(rows, nblk)
        x = trits.astype(np.float32) * np.repeat(s, 256, axis=1)
        s[~TernaryTensor(trits, s, 256).block_nonzero()] = 0  # gguf's d for such blocks
        t = TernaryTensor(trits, s, 256, NAME)
    else:
        s = bf16_values(rng, 1)
        t = TernaryTensor(trits, s, 0, NAME)
        x = trits.astype(np.float32) * s[0]
    theirs = quantize(x, GGUF_TYPE[fid]).reshape(-1)
    p, ours = encode(fid, t)
    assert_bytes(fid, rows, cols, ours, theirs)
    back = get_format(fid).decode(theirs, rows, cols, name=NAME)
    assert np.array_equal(back.trits, trits)
    np.testing.assert_array_equal(back.dense(), dequantize(theirs, GGUF_TYPE[fid])
                                  .reshape(rows, cols))
    np.testing.assert_array_equal(back.scales, p.scales)


def test_tq1_0_byte_tables_match_gguf():
    # Every base-3 number in every byte position of a block, through gguf's quantizer.
    digits = np.array(list(itertools.product(range(3), repeat=5)), dtype=np.int8)  # 243 x 5
    x = np.zeros((243, 256), dtype=np.float32)
    x[:, [0, 32, 64, 96, 128]] = digits - 1
    x[:, [240, 244, 248, 252]] = digits[:, 1:] - 1  # qh: four digits, 81 distinct
    x[:, 1] = 1.0  # keep d = 1 for every block
    q = quantize(x, Q.TQ1_0)
    assert np.array_equal(np.sort(np.unique(q[:, 0])), np.flatnonzero(VALID_QS))
    assert np.array_equal(np.sort(np.unique(q[:, 48])), np.flatnonzero(VALID_QH))
    assert np.array_equal(q[:, 0], ENCODE_LUT)
    # Every byte value at qs[0] and qh[0]: accepted iff valid, then decoded as gguf does.
    fmt = get_format("tq1_0")
    for pos, valid in ((0, VALID_QS), (48, VALID_QH)):
        for b in range(256):
            blk = q[0].copy()
            blk[pos] = b
            if valid[b]:
                got = fmt.decode(blk, 1, 256).dense()
                np.testing.assert_array_equal(got, dequantize(blk[None], Q.TQ1_0))
            else:
                with pytest.raises(InvalidTritError, match=f"byte {pos} = {b:#04x}"):
                    fmt.decode(blk, 1, 256, name=NAME)


# -- i2_s against a per-element reference (docs/formats/i2_s.md) --------------------------------
def ref_i2s_encode(trits: np.ndarray, scale: float, block: int = 128) -> bytes:
    flat = [int(v) for v in trits.reshape(-1)]
    out = bytearray(len(flat) // 4)
    lanes = block // 4
    for e, t in enumerate(flat):
        b, j = divmod(e, block)
        g, m = divmod(j, lanes)
        out[b * lanes + m] |= (t + 1) << (6 - 2 * g)
    return bytes(out) + struct.pack("<f", scale) + bytes(28)


def ref_i2s_decode(raw: bytes, n: int, block: int = 128) -> list[int]:
    lanes = block // 4
    return [((raw[(e // block) * lanes + e % block % lanes] >> (6 - 2 * (e % block // lanes)))
             & 3) - 1 for e in range(n)]


@pytest.mark.parametrize("shape", [(1, 128), (3, 128), (2, 320), (5, 256), (7, 384), (128, 3)])
def test_i2s_matches_reference(shape):
    rng = np.random.default_rng(sum(shape))
    trits = random_trits(rng, *shape)
    t = TernaryTensor(trits, np.float32([1.25]), 0, NAME)
    p, ours = encode("i2_s", t)
    want = np.frombuffer(ref_i2s_encode(trits, 1.25), dtype=np.uint8)
    assert_bytes("i2_s", *shape, ours, want)
    back = I2S().decode(want, *shape, name=NAME)
    assert back.trits.reshape(-1).tolist() == ref_i2s_decode(want.tobytes(), trits.size)
    assert back.scales.tolist() == [1.25]


@pytest.mark.parametrize("shape", [(1, 64), (3, 64), (2, 160), (4, 96)])
def test_i2s_arm64_variant_matches_reference(shape):
    rng = np.random.default_rng(sum(shape))
    trits = random_trits(rng, *shape)
    raw = ref_i2s_encode(trits, -0.75, block=64)
    assert ref_i2s_decode(raw, trits.size, block=64) == trits.reshape(-1).tolist()
    back = I2S("arm64").decode(np.frombuffer(raw, dtype=np.uint8), *shape, name=NAME)
    assert np.array_equal(back.trits, trits) and back.scales.tolist() == [-0.75]


# -- stfma / colpack_u32 against a per-element reference, every remainder size ---------------
STFMA_CODE = {-1: 0, 0: 1, 1: 2}
COLPACK_CODE = {0: 0, 1: 1, -1: 2}


def ref_words(trits: np.ndarray, code: dict[int, int]) -> bytes:
    rows, cols = trits.shape
    nw = -(-cols // 16)
    words = [0] * (rows * nw)
    for r in range(rows):
        for c in range(nw * 16):
            t = int(trits[r, c]) if c < cols else 0
            words[r * nw + c // 16] |= code[t] << (2 * (c % 16))
    return struct.pack(f"<{len(words)}I", *words)


@pytest.mark.parametrize("fid, code", [("stfma", STFMA_CODE), ("colpack_u32", COLPACK_CODE)])
def test_word_formats_match_reference(fid, code):
    rng = np.random.default_rng(7)
    for cols in range(1, 49):
        for rows in (1, 3):
            trits = random_trits(rng, rows, cols)
            p, ours = encode(fid, TernaryTensor(trits, np.float32([0.5]), 0, NAME))
            want = np.frombuffer(ref_words(trits, code), dtype=np.uint8)
            assert_bytes(fid, rows, cols, ours, want)
            assert get_format(fid).nbytes(rows, cols) == want.size
            assert np.array_equal(decode(fid, want, p).trits, trits)


# -- every pair of formats round trips through TernaryTensor -----------------------------------
def _shape(data, pair: tuple[str, str]) -> tuple[int, int]:
    if any(f.startswith("tq") for f in pair):
        return data.draw(st.integers(1, 40)), 256 * data.draw(st.integers(1, 3))
    if any(get_format(f).row_block == 64 for f in pair):  # q2_0, iq2_bn, iq1_bn
        cols = 64 * data.draw(st.integers(1, 9))
        rows = data.draw(st.integers(1, 40))
        if "i2_s" in pair and cols % 128:
            rows = 2 * data.draw(st.integers(1, 20))
        return rows, cols
    if "i2_s" in pair:  # rows * cols % 128 == 0 with rows <= 40 needs 4 | cols
        cols = 4 * data.draw(st.integers(1, 75))
        step = 128 // math.gcd(cols, 128)
        return step * data.draw(st.integers(1, 40 // step)), cols
    return data.draw(st.integers(1, 40)), data.draw(st.integers(1, 300))


@pytest.mark.parametrize("a, b", list(itertools.permutations(FORMAT_IDS, 2)))
@SETTINGS
@given(data=st.data())
def test_pair_round_trip(a, b, data):
    rows, cols = _shape(data, (a, b))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    trits = random_trits(rng, rows, cols)
    scale = data.draw(st.sampled_from([0.0, -1.5, 1.0, float(bf16_values(rng, 1)[0])]))
    pa, raw_a = encode(a, TernaryTensor(trits, np.float32([scale]), 0, NAME))
    ta = decode(a, raw_a, pa)
    pb, raw_b = encode(b, ta)
    pa2, raw_a2 = encode(a, decode(b, raw_b, pb))
    ta2 = decode(a, raw_a2, pa2)
    assert np.array_equal(ta2.trits, trits)
    if not trits.any() and get_format(b).scale_block != 0 and pa.scale_block == 0:
        # TQ, Q2_0 and the BN types store d = 0 in blocks (rows) without a non-zero trit, so
        # an all-zero tensor's
        # per-tensor scale (which scales nothing) comes back as 0.
        assert pa2.scales.tolist() == [0.0]
        return
    np.testing.assert_array_equal(pa2.scales, pa.scales)
    np.testing.assert_array_equal(ta2.scales, ta.scales)
    assert_bytes(a, rows, cols, raw_a2, raw_a)


def test_tq_block_scales_survive_tq2_tq1_tq2():
    rng = np.random.default_rng(3)
    trits = random_trits(rng, 9, 1024)
    s = bf16_values(rng, 9 * 4).reshape(9, 4)
    s[~TernaryTensor(trits, s, 256).block_nonzero()] = 0
    p2, raw2 = encode("tq2_0", TernaryTensor(trits, s, 256, NAME))
    p1, raw1 = encode("tq1_0", decode("tq2_0", raw2, p2))
    back = decode("tq1_0", raw1, p1)
    assert_bytes("tq2_0", 9, 1024, encode("tq2_0", back)[1], raw2)


# -- scale loss ------------------------------------------------------------------------------
@pytest.mark.parametrize("fid", ["tq2_0", "tq1_0"])
def test_f32_scale_not_in_f16(fid):
    t = TernaryTensor(np.ones((2, 256), dtype=np.int8), np.float32([1.1]), 0, NAME)
    with pytest.raises(ScaleLossError, match="not exactly representable in float16") as e:
        get_format(fid).prepare(t)
    assert NAME in str(e.value)
    p, loss = get_format(fid).prepare(t, allow_rounding=True)
    want = abs(float(np.float16(1.1)) - float(np.float32(1.1))) / float(np.float32(1.1))
    assert loss == pytest.approx(want) and 0 < loss < 1e-3
    assert set(p.scales.reshape(-1).tolist()) == {float(np.float16(1.1))}
    huge = TernaryTensor(t.trits, np.float32([1e6]), 0, NAME)
    with pytest.raises(ScaleLossError, match="overflows"):
        get_format(fid).prepare(huge, allow_rounding=True)


@pytest.mark.parametrize("fid", ["i2_s", "stfma", "colpack_u32"])
def test_differing_block_scales_to_tensor_scale(fid):
    trits = np.ones((2, 256), dtype=np.int8)
    t = TernaryTensor(trits, np.float32([[1.5], [1.0]]), 256, NAME)
    with pytest.raises(ScaleLossError, match="per-block scales differ") as e:
        get_format(fid).prepare(t)
    assert NAME in str(e.value)
    p, loss = get_format(fid).prepare(t, allow_rounding=True)
    assert p.scales.tolist() == [1.25] and loss == pytest.approx(0.25)
    # blocks without a non-zero trit do not count
    trits[1] = 0
    p, loss = get_format(fid).prepare(TernaryTensor(trits, t.scales, 256, NAME))
    assert p.scales.tolist() == [1.5] and loss == 0.0


# -- hostile bytes ---------------------------------------------------------------------------
def _valid(fid: str, rows: int = 2, cols: int = 512) -> tuple[TernaryTensor, np.ndarray]:
    trits = np.zeros((rows, cols), dtype=np.int8)
    trits[:, ::3] = 1
    p, raw = encode(fid, TernaryTensor(trits, np.float32([2.0]), 0, NAME))
    return p, raw.copy()


@pytest.mark.parametrize("fid, byte, where", [
    ("i2_s", 5, "flat element 37"),  # group 1 (bits 5..4), lane 5
    ("tq2_0", 2 * 66 + 1, "row 1, column 65 (block 0, byte 1"),  # group 2, lane 1
    ("stfma", 124 + 5, "row 1, column 22 (word 1, bits 12..13)"),  # 124 bytes per row
    ("colpack_u32", 124 + 5, "row 1, column 22 (word 1, bits 12..13)")])
def test_code3_rejected(fid, byte, where):
    p, raw = _valid(fid, cols=496 if fid in ("stfma", "colpack_u32") else 512)
    raw[byte] |= 0b11 << 4
    with pytest.raises(InvalidTritError, match="code 3") as e:
        decode(fid, raw, p)
    assert NAME in str(e.value) and where in str(e.value)


@pytest.mark.parametrize("pos, b", [(7, 1), (47, 237), (48, 2), (51, 255)])
def test_tq1_0_bad_byte_rejected(pos, b):
    p, raw = _valid("tq1_0")
    raw[54 * 3 + pos] = b  # row 1, block 1
    with pytest.raises(InvalidTritError, match=f"byte {pos} = {b:#04x} of block 1 in row 1"
                       ) as e:
        decode("tq1_0", raw, p)
    assert NAME in str(e.value)


@pytest.mark.parametrize("fid", ["tq2_0", "tq1_0"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_tq_bad_d_rejected(fid, bad):
    p, raw = _valid(fid)
    raw[2 * BLOCK_BYTES[fid] - 2: 2 * BLOCK_BYTES[fid]] = np.array([bad], "<f2").view(np.uint8)
    with pytest.raises(InvalidScaleError, match="row 0, block 1") as e:
        decode(fid, raw, p)
    assert NAME in str(e.value)


def test_bad_tensor_scales_rejected():
    p, raw = _valid("i2_s")
    raw[-32:-28] = np.array([np.nan], "<f4").view(np.uint8)
    with pytest.raises(InvalidScaleError, match=NAME):
        decode("i2_s", raw, p)
    for fid in ("stfma", "colpack_u32"):
        p, raw = _valid(fid)
        with pytest.raises(InvalidScaleError, match=NAME):
            get_format(fid).decode(raw, 2, 512, scale=float("inf"), name=NAME)
        with pytest.raises(MetadataError, match="per-tensor scale"):
            get_format(fid).decode(raw, 2, 512, name=NAME)


@pytest.mark.parametrize("fid, code", [("stfma", 0b00), ("stfma", 0b10),
                                       ("colpack_u32", 0b01), ("colpack_u32", 0b10)])
def test_nonzero_padding_rejected(fid, code):
    p, raw = _valid(fid, cols=500)  # 500 = 31*16 + 4: 12 padding trits per row
    raw[2 * 128 - 1] = (raw[2 * 128 - 1] & 0b00111111) | (code << 6)  # row 1, column 511
    with pytest.raises(InvalidTritError, match="padding at row 1, column 511") as e:
        decode(fid, raw, p)
    assert NAME in str(e.value)


@pytest.mark.parametrize("fid", FORMAT_IDS)
def test_wrong_sizes_rejected(fid):
    p, raw = _valid(fid)
    for bad in (raw[:-4], np.concatenate([raw, raw[:4]])):
        with pytest.raises(ShapeError, match=f"{NAME}.*got {bad.size}"):
            decode(fid, bad, p)
    if fid.startswith("tq"):
        with pytest.raises(ShapeError, match=f"{NAME}.*multiple of 256"):
            get_format(fid).check_shape(2, 384, NAME)
        with pytest.raises(ShapeError, match="multiple of 256"):
            get_format(fid).decode(raw, 1, 384, name=NAME)


# -- golden fixtures -------------------------------------------------------------------------
@pytest.mark.parametrize("fid", FORMAT_IDS)
def test_golden_fixture(fid):
    folder = FIXTURES / fid
    files = [folder / n for n in ("tensor.bin", "trits.npy", "scale.json")]
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        pytest.fail(f"missing fixture {', '.join(missing)}; run tools/make_fixtures.py")
    raw = np.fromfile(files[0], dtype=np.uint8)
    trits = np.load(files[1], allow_pickle=False)
    info = json.loads(files[2].read_text())
    fmt = get_format(fid)
    scale = None if fmt.native else info["scale"]
    t = fmt.decode(raw, info["rows"], info["cols"], scale=scale, name="fixture")
    assert np.array_equal(t.trits, trits)
    assert t.scale_block == info["scale_block"] and t.scales.tolist() == info["scales"]
    assert_bytes(fid, t.rows, t.cols, fmt.encode(t), raw)
    src = TernaryTensor(trits, np.float32([info["scale"]]), 0, "fixture")
    assert_bytes(fid, t.rows, t.cols, encode(fid, src)[1], raw)
    if fid in GGUF_TYPE:
        x = trits.astype(np.float32) * np.float32(info["scale"])
        assert_bytes(fid, t.rows, t.cols, raw, quantize(x, GGUF_TYPE[fid]))


@pytest.mark.parametrize("fid", ["i2_s", "tq2_0", "tq1_0", "stfma", "colpack_u32", "q2_0",
                                 "iq2_bn", "iq1_bn"])
def test_validate_raises_what_decode_raises(fid):
    """validate (what a backend checks at load, i2_s without making the trits) refuses a code 3
    and a bad scale as decode does, with the same message, and passes what decode passes."""
    from bitformat.formats import get_format

    p, raw = _valid(fid, cols=512)
    fmt = get_format(fid)
    rows, cols = p.trits.shape
    scale = float(p.scales[0]) if p.scales.size == 1 else None
    fmt.validate(raw, rows, cols, scale=scale, name=NAME)  # valid: nothing
    if fid == "i2_s":
        bad = raw.copy()
        bad[100] |= 0b11 << 2
        with pytest.raises(InvalidTritError) as a:
            fmt.decode(bad, rows, cols, name=NAME)
        with pytest.raises(InvalidTritError) as b:
            fmt.validate(bad, rows, cols, name=NAME)
        assert str(a.value) == str(b.value)
        bad = raw.copy()
        bad[-32:-28] = np.frombuffer(np.float32(np.nan).tobytes(), np.uint8)
        with pytest.raises(InvalidScaleError, match="scale is nan"):
            fmt.validate(bad, rows, cols, name=NAME)
