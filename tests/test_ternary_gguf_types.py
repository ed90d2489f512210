"""q2_0 (upstream ggml type 42), iq2_bn and iq1_bn (ik_llama.cpp types 135, 134) against
scalar references written from the published C (ggml-quants.c ``quantize_row_q2_0_ref`` /
``dequantize_row_q2_0``; ik_llama.cpp iqk_quantize.cpp ``quantize_one_row_2bn`` /
``quantize_one_row_1bn`` / ``dequantize_row_iq{1,2}_bn``), and against llama.cpp itself
(llama-cpp-python's bundled ggml) where it is installed."""

from __future__ import annotations

import ctypes
import glob
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bitformat.constants import GGMLType, ggml_nbytes
from bitformat.errors import InvalidScaleError, InvalidTritError, ScaleLossError
from bitformat.formats import get_format
from bitformat.ternary import TernaryTensor

NAME = "blk.0.ffn_up.weight"
META = {"iq2_bn": 4, "iq1_bn": 2}
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- scalar references, one loop per line of the C -------------------------------------------
def ref_quantize_q2_0(x: np.ndarray) -> bytes:
    out = bytearray()
    for blk in x.astype(np.float32).reshape(-1, 64):
        amax = np.float32(0)
        for v in blk:
            amax = max(amax, abs(v))
        d = amax
        inv = np.float32(1) / d if d > 0 else np.float32(0)
        out += np.float16(d).tobytes()
        qs = [0] * 16
        for j, w in enumerate(blk):
            q = int(np.round(np.float32(w * inv))) + 1  # roundf: ties never occur for trits
            q = min(max(q, 0), 3)
            qs[j // 4] |= q << ((j % 4) * 2)
        out += bytes(qs)
    return bytes(out)


def ref_dequantize_q2_0(raw: bytes, n: int) -> np.ndarray:
    y = np.empty(n, np.float32)
    for i in range(n // 64):
        blk = raw[18 * i: 18 * i + 18]
        d = np.float32(np.frombuffer(blk[:2], "<f2")[0])
        for j in range(64):
            q = (blk[2 + j // 4] >> ((j % 4) * 2)) & 3
            y[64 * i + j] = np.float32(q - 1) * d
    return y


def _q(v: float, thresh: float) -> int:
    return 1 if abs(v) < thresh else (0 if v < 0 else 2)


def ref_quantize_iq2_bn_row(x: np.ndarray) -> bytes:
    mx = float(np.max(np.abs(x))) if x.size else 0.0
    out = bytearray(np.float32(mx).tobytes())
    th = 0.5 * np.float32(mx)
    for blk in x.reshape(-1, 64):
        L = [_q(float(v), th) for v in blk]
        out += bytes(L[j] | (L[j + 16] << 2) | (L[j + 32] << 4) | (L[j + 48] << 6)
                     for j in range(16))
    return bytes(out)


def ref_quantize_iq1_bn_row(x: np.ndarray) -> bytes:
    mx = float(np.max(np.abs(x)))
    out = bytearray(np.float16(mx).tobytes())
    th = 0.5 * float(np.float32(mx))
    for xb in x.reshape(-1, 64):
        ql, v13 = [], 0
        for i16 in range(4):
            for k in range(3):
                idx = sum(3 ** j * _q(float(xb[16 * i16 + 5 * k + j]), th) for j in range(5))
                ql.append((256 * idx + 242) // 243)
            v13 += 3 ** i16 * _q(float(xb[16 * i16 + 15]), th)
        out += bytes(ql) + bytes([(256 * v13 + 242) // 243])
    return bytes(out)


def ref_dequantize_iq1_bn_row(raw: bytes, n: int) -> np.ndarray:
    """Trits of a row (the reference's to_float leaves the row scale to the mat-mul)."""
    mult = (81, 27, 9, 3, 1)
    y = []
    for i in range(n // 64):
        blk = raw[2 + 13 * i: 2 + 13 * i + 13]
        for i16 in range(4):
            for k in range(3):
                for j in range(5):
                    v = (blk[3 * i16 + k] * mult[j]) & 0xFF
                    y.append(((v + (v >> 1)) >> 7) - 1)
            v = (blk[12] * mult[i16]) & 0xFF
            y.append(((v + (v >> 1)) >> 7) - 1)
    return np.array(y, np.int8)


def ref_dequantize_iq2_bn_row(raw: bytes, n: int) -> np.ndarray:
    y = np.empty(n, np.int8)
    for i in range(n // 64):
        qs = raw[4 + 16 * i: 4 + 16 * i + 16]
        for j in range(16):
            for g in range(4):
                y[64 * i + 16 * g + j] = ((qs[j] >> (2 * g)) & 3) - 1
    return y


def _trits(rng, rows, cols, zero_rows=True):
    t = rng.integers(-1, 2, (rows, cols)).astype(np.int8)
    t[rng.random((rows, cols)) < rng.random()] = 0
    if zero_rows and rows > 1:
        t[rng.integers(rows)] = 0
    if cols >= 128:
        t[0, 64:128] = 0  # an all-zero 64-block
    return t


# -- byte layouts ----------------------------------------------------------------------------
@SETTINGS
@given(rows=st.integers(1, 6), nblk=st.integers(1, 5), seed=st.integers(0, 2**32 - 1),
       per_block=st.booleans())
def test_q2_0_matches_reference_quantizer(rows, nblk, seed, per_block):
    rng = np.random.default_rng(seed)
    cols = 64 * nblk
    trits = _trits(rng, rows, cols)
    if per_block:
        s = rng.choice(np.float32([0.25, 0.5, 1.5, 3.0, 0.0625]), (rows, nblk))
        x = trits * np.repeat(s, 64, axis=1)
        s[~TernaryTensor(trits, s, 64).block_nonzero()] = 0  # ggml's d for such blocks
        t = TernaryTensor(trits, s, 64, NAME)
    else:
        t = TernaryTensor(trits, np.float32([0.75]), 0, NAME)
        x = trits * np.float32(0.75)
    fmt = get_format("q2_0")
    ours = fmt.encode(fmt.prepare(t)[0]).tobytes()
    assert ours == ref_quantize_q2_0(x.astype(np.float32))
    back = fmt.decode(np.frombuffer(ours, np.uint8), rows, cols, name=NAME)
    np.testing.assert_array_equal(back.dense().reshape(-1), ref_dequantize_q2_0(ours, rows * cols))
    assert np.array_equal(back.trits, trits)
    if trits.any():  # (an all-zero tensor's scale scales nothing and is stored as d = 0)
        assert back.equals(t)


@pytest.mark.parametrize("fid", ["iq2_bn", "iq1_bn"])
@SETTINGS
@given(rows=st.integers(1, 6), nblk=st.integers(1, 4), seed=st.integers(0, 2**32 - 1))
def test_bn_matches_reference_quantizer(fid, rows, nblk, seed):
    rng = np.random.default_rng(seed)
    cols = 64 * nblk
    trits = _trits(rng, rows, cols)
    s = rng.choice(np.float32([0.25, 0.5, 1.5, 3.0, 1.0 / 3.0]) if fid == "iq2_bn"
                   else np.float32([0.25, 0.5, 1.5, 3.0]), (rows, 1))
    x = (trits * s).astype(np.float32)
    fmt = get_format(fid)
    s[~trits.any(axis=1)] = 0  # the quantizer's d of an all-zero row
    t = TernaryTensor(trits, s, cols, NAME)
    raw = fmt.encode(fmt.prepare(t)[0])
    assert raw.size == ggml_nbytes(GGMLType[fid.upper()], rows * cols, cols)
    per_row = raw.size // rows
    quant = ref_quantize_iq2_bn_row if fid == "iq2_bn" else ref_quantize_iq1_bn_row
    deq = ref_dequantize_iq2_bn_row if fid == "iq2_bn" else ref_dequantize_iq1_bn_row
    for r in range(rows):
        row = raw[r * per_row: (r + 1) * per_row].tobytes()
        np.testing.assert_array_equal(deq(row, cols), trits[r])
        if not trits[r].any():
            # ik_llama.cpp's threshold is 0.5 * max|x| = 0 in a row of zeros, so it writes
            # code +1 with d = 0 there; bitformat writes trits 0 (docs/formats/iq2_bn.md)
            theirs = quant(x[r])
            assert row[:META[fid]] == theirs[:META[fid]] == bytes(META[fid])
            assert fmt.decode(np.frombuffer(theirs, np.uint8), 1, cols).dense().tolist() \
                == [[0.0] * cols]
            continue
        assert row == quant(x[r]), f"row {r}"
    back = fmt.decode(raw, rows, cols, name=NAME)
    assert np.array_equal(back.trits, trits)
    nz = trits.any(axis=1)
    np.testing.assert_array_equal(back.scales[nz], s[nz])


def test_bn_per_row_scales_and_refusals():
    rng = np.random.default_rng(5)
    trits = _trits(rng, 4, 512, zero_rows=False)
    s = np.float32([[0.5, 0.5], [1.0, 1.0], [2.0, 2.0], [0.25, 0.25]])
    tq = TernaryTensor(trits, s, 256, NAME)  # tq2_0 blocks agreeing within each row
    for fid in ("iq2_bn", "iq1_bn"):
        fmt = get_format(fid)
        p, loss = fmt.prepare(tq)
        assert loss == 0 and p.scales.reshape(-1).tolist() == [0.5, 1.0, 2.0, 0.25]
        back = fmt.decode(fmt.encode(p), 4, 512, name=NAME)
        assert back.equals(tq)
        # back to per-block containers losslessly, refused by per-tensor ones
        for other in ("tq2_0", "tq1_0", "q2_0"):
            o = get_format(other)
            assert o.decode(o.encode(o.prepare(back)[0]), 4, 512, name=NAME).equals(tq)
        for other in ("i2_s", "stfma", "colpack_u32", "rans"):
            with pytest.raises(ScaleLossError, match="per-tensor|differ"):
                get_format(other).prepare(back)
    s2 = s.copy()
    s2[1, 1] = 3.0  # one row with two scales: no per-row format can hold it
    with pytest.raises(ScaleLossError, match=r"row 1, columns 0\.\.511 have scales 1\.0 \.\. 3\.0"
                       ) as e:
        get_format("iq2_bn").prepare(TernaryTensor(trits, s2, 256, NAME))
    assert NAME in str(e.value)
    with pytest.raises(ScaleLossError, match="float16"):
        get_format("iq1_bn").prepare(TernaryTensor(trits, np.float32([0.1]), 0, NAME))
    p, _ = get_format("iq2_bn").prepare(TernaryTensor(trits, np.float32([0.1]), 0, NAME))
    assert p.scales.reshape(-1).tolist() == [np.float32(0.1)] * 4  # f32: exact


def test_q2_0_group_scales_refused_by_coarser_formats():
    rng = np.random.default_rng(2)
    trits = _trits(rng, 2, 256, zero_rows=False)
    trits[:, ::8] = 1
    s = np.float32([[0.5, 1.0, 0.5, 1.0], [1.0, 1.0, 1.0, 1.0]])
    t = TernaryTensor(trits, s, 64, NAME)
    for fid in ("tq2_0", "tq1_0", "iq2_bn", "iq1_bn"):
        with pytest.raises(ScaleLossError, match="row 0"):
            get_format(fid).prepare(t)
    for fid in ("i2_s", "stfma"):
        with pytest.raises(ScaleLossError):
            get_format(fid).prepare(t)


def test_hostile_bytes():
    trits = np.ones((2, 128), np.int8)
    t = TernaryTensor(trits, np.float32([1.0]), 0, NAME)
    q2 = get_format("q2_0")
    raw = q2.encode(q2.prepare(t)[0]).copy()
    raw[18 + 2 + 3] |= 0b11 << 4  # block 1 (row 0, cols 64..127), byte 3, slot 2
    with pytest.raises(InvalidTritError, match="row 0, column 78"):
        q2.decode(raw, 2, 128, name=NAME)
    raw = q2.encode(q2.prepare(t)[0]).copy()
    raw[36:38] = np.array([np.nan], "<f2").view(np.uint8)
    with pytest.raises(InvalidScaleError, match="row 1, block 0"):
        q2.decode(raw, 2, 128, name=NAME)
    i2 = get_format("iq2_bn")
    raw = i2.encode(i2.prepare(t)[0]).copy()
    raw[36 + 4 + 16 + 5] |= 0b11 << 2  # row 1, block 1, byte 5, slot 1
    with pytest.raises(InvalidTritError, match="row 1, column 85"):
        i2.decode(raw, 2, 128, name=NAME)
    raw = i2.encode(i2.prepare(t)[0]).copy()
    raw[36:40] = np.array([np.inf], "<f4").view(np.uint8)
    with pytest.raises(InvalidScaleError, match="row 1"):
        i2.decode(raw, 2, 128, name=NAME)
    i1 = get_format("iq1_bn")
    raw = i1.encode(i1.prepare(t)[0]).copy()
    raw[2 + 13 + 12] = 255  # extra byte of block 1 (only 81 values encode four digits)
    with pytest.raises(InvalidTritError, match="byte 12 = 0xff of block 1 in row 0"):
        i1.decode(raw, 2, 128, name=NAME)
    raw = i1.encode(i1.prepare(t)[0]).copy()
    raw[2 + 4] = 1  # not ceil(256 n / 243) for any n
    with pytest.raises(InvalidTritError, match="byte 4 = 0x01 of block 0 in row 0"):
        i1.decode(raw, 2, 128, name=NAME)


# -- llama.cpp's own ggml (llama-cpp-python) ---------------------------------------------------
def _ggml():
    llama_cpp = pytest.importorskip("llama_cpp")
    libdir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    libs = glob.glob(os.path.join(libdir, "libggml-base.*")) + glob.glob(
        os.path.join(libdir, "libggml.*"))
    if not libs:
        pytest.skip("llama_cpp has no libggml-base to load")
    lib = ctypes.CDLL(libs[0])
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_void_p]
    lib.ggml_type_size.restype = ctypes.c_size_t
    lib.ggml_type_size.argtypes = [ctypes.c_int]
    lib.ggml_blck_size.restype = ctypes.c_int64
    lib.ggml_blck_size.argtypes = [ctypes.c_int]
    return lib


def test_q2_0_bytes_equal_ggml_quantizer():
    lib = _ggml()
    assert (lib.ggml_blck_size(42), lib.ggml_type_size(42)) == (64, 18)
    rng = np.random.default_rng(11)
    trits = _trits(rng, 8, 512)
    s = rng.choice(np.float32([0.25, 0.5, 1.5, 3.0]), (8, 8))
    s[~TernaryTensor(trits, s, 64).block_nonzero()] = 0
    x = np.ascontiguousarray((trits * np.repeat(s, 64, axis=1)).astype(np.float32))
    dst = np.zeros(8 * 8 * 18, np.uint8)
    n = lib.ggml_quantize_chunk(42, x.ctypes.data, dst.ctypes.data, 0, 8, 512, None)
    assert n == dst.size
    fmt = get_format("q2_0")
    ours = fmt.encode(fmt.prepare(TernaryTensor(trits, s, 64, NAME))[0])
    np.testing.assert_array_equal(ours, dst)
