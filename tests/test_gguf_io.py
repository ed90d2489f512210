"""The GGUF envelope: round trips, agreement with the gguf package, hostile headers."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from bitformat import errors
from bitformat.constants import GGMLType, ValueType
from bitformat.io.gguf import GGUFReader, GGUFWriter, MetaValue


def write_sample(path, *, extra_meta=None):
    w = GGUFWriter(str(path))
    w.add_metadata("general.architecture", "bitnet-b1.58")
    w.add_metadata("bitnet-b1.58.block_count", 2)
    w.add_metadata("general.temperature", 0.5)
    w.add_metadata("tokenizer.ggml.tokens", ["a", "b", "ü"])
    w.add_metadata("tokenizer.ggml.token_type", np.array([1, 1, 3], dtype=np.int32))
    w.add_metadata("tokenizer.ggml.add_bos_token", True)
    for k, v in (extra_meta or {}).items():
        w.add_metadata(k, v)
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.arange(5, dtype=np.float16)
    w.add_tensor("a", a.shape, GGMLType.F32)
    w.add_tensor("b", b.shape, GGMLType.F16)
    w.write(iter([a, b]))
    return a, b


def test_round_trip_and_types(tmp_path):
    path = tmp_path / "x.gguf"
    a, b = write_sample(path)
    with GGUFReader(path) as r:
        assert r.metadata["bitnet-b1.58.block_count"].vtype == ValueType.UINT32
        assert r.metadata["general.temperature"].vtype == ValueType.FLOAT32
        assert r.get("tokenizer.ggml.tokens") == ["a", "b", "ü"]
        assert r.get("tokenizer.ggml.token_type") == [1, 1, 3]
        assert r.get("tokenizer.ggml.add_bos_token") is True
        assert np.array_equal(r.array("a"), a)
        assert np.array_equal(r.array("b"), b)
        assert r.tensors["a"].offset % 32 == 0 and r.tensors["b"].offset % 32 == 0


def test_gguf_package_reads_our_files(tmp_path):
    """The independent reader from the gguf package agrees on metadata and tensors."""
    path = tmp_path / "x.gguf"
    a, b = write_sample(path)
    ref = gguf.GGUFReader(str(path))
    assert bytes(ref.fields["general.architecture"].parts[-1]).decode() == "bitnet-b1.58"
    tensors = {t.name: t for t in ref.tensors}
    assert np.array_equal(np.asarray(tensors["a"].data).reshape(3, 4), a)
    assert np.array_equal(np.asarray(tensors["b"].data), b)


def test_we_read_gguf_package_files(tmp_path):
    path = tmp_path / "ref.gguf"
    w = gguf.GGUFWriter(str(path), "bitnet-b1.58")
    w.add_uint32("bitnet-b1.58.block_count", 7)
    w.add_array("tokenizer.ggml.tokens", ["x", "y"])
    data = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    w.add_tensor("t", data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with GGUFReader(path) as r:
        assert r.get("bitnet-b1.58.block_count") == 7
        assert r.get("tokenizer.ggml.tokens") == ["x", "y"]
        assert np.array_equal(r.array("t"), data)


def test_writer_is_atomic_on_failure(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"precious")
    w = GGUFWriter(str(path))
    w.add_tensor("a", (4,), GGMLType.F32)

    def boom():
        yield np.zeros(4, np.float32)
        raise RuntimeError("disk full")

    w.add_tensor("b", (4,), GGMLType.F32)
    with pytest.raises(RuntimeError):
        w.write(boom())
    assert path.read_bytes() == b"precious"
    assert [p.name for p in tmp_path.iterdir()] == ["x.gguf"]


def test_writer_rejects_wrong_size(tmp_path):
    w = GGUFWriter(str(tmp_path / "x.gguf"))
    w.add_tensor("a", (4,), GGMLType.F32)
    with pytest.raises(ValueError, match="declared"):
        w.write(iter([np.zeros(3, np.float32)]))
    assert not list(tmp_path.iterdir())


# -- hostile headers ---------------------------------------------------------------------------
def header(n_tensors=0, n_kv=0, version=3):
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def gstr(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


@pytest.mark.parametrize(
    "blob, error, text",
    [
        (b"", errors.TruncatedError, "empty"),
        (b"GGU", errors.TruncatedError, "inside the magic"),
        (b"PK\x03", errors.BadMagicError, "not a GGUF"),
        (b"GGML" + b"\0" * 40, errors.BadMagicError, "not a GGUF"),
        (header(version=7), errors.UnsupportedVersionError, "version 7"),
        (b"GGUF" + struct.pack("<I", 3) + b"\0" * 5, errors.TruncatedError, "tensor count"),
        (header(n_kv=2**60), errors.CountTooLargeError, "metadata entries"),
        (header(n_tensors=2**40), errors.CountTooLargeError, "tensors"),
        (header(n_kv=1) + struct.pack("<Q", 2**50) + b"k" * 20, errors.CountTooLargeError,
         "a metadata key"),
        (header(n_kv=1) + gstr(b"key") + struct.pack("<I", 99) + b"\0" * 16,
         errors.UnknownTypeError, "unknown value type 99"),
        (header(n_kv=1) + gstr(b"arr") + struct.pack("<IIQ", 9, 6, 2**40) + b"\0" * 16,
         errors.CountTooLargeError, "claims 1099511627776 elements"),
        (header(n_kv=1) + gstr(b"s") + struct.pack("<I", 8) + gstr(b"\xff\xfe") + b"\0" * 8,
         errors.FormatError, "not valid UTF-8"),
        (header(n_kv=2) + (gstr(b"k") + struct.pack("<IB", 0, 1)) * 2 + b"\0" * 16,
         errors.FormatError, "appears twice"),
    ],
)
def test_hostile_headers(tmp_path, blob, error, text):
    path = tmp_path / "bad.gguf"
    path.write_bytes(blob)
    with pytest.raises(error, match=text) as info:
        GGUFReader(path)
    assert str(path) in str(info.value)


def tensor_info(name=b"w", dims=(128,), gtype=0, offset=0):
    return (gstr(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
            + struct.pack("<IQ", gtype, offset))


def build(infos, data_len):
    body = header(n_tensors=len(infos)) + b"".join(infos)
    body += b"\0" * (-len(body) % 32)
    return body + b"\1" * data_len


@pytest.mark.parametrize(
    "infos, data_len, error, text",
    [
        ([tensor_info(gtype=77)], 512, errors.UnknownTypeError, "GGML type 77"),
        ([tensor_info(dims=(0,))], 512, errors.FormatError, "zero dimension"),
        ([tensor_info(dims=(1,) * 5)], 512, errors.FormatError, "5 dimensions"),
        ([tensor_info(dims=(100,), gtype=35)], 512, errors.FormatError, "multiple of the TQ2_0"),
        ([tensor_info(dims=(100, 2), gtype=36)], 512, errors.FormatError,
         "200 values, not a multiple of the I2_S block"),
        ([tensor_info(dims=(2**40, 2**30))], 512, errors.CountTooLargeError, "elements"),
        ([tensor_info(offset=8)], 512, errors.TensorLayoutError, "alignment"),
        ([tensor_info(dims=(64,))], 100, errors.TruncatedError, "needs bytes up to"),
        ([tensor_info(b"a", offset=0), tensor_info(b"b", offset=256)], 1024,
         errors.TensorLayoutError, "overlaps"),
        ([tensor_info(b"a"), tensor_info(b"a", offset=512)], 1024, errors.FormatError,
         "appears twice"),
    ],
)
def test_hostile_tensor_tables(tmp_path, infos, data_len, error, text):
    path = tmp_path / "bad.gguf"
    path.write_bytes(build(infos, data_len))
    with pytest.raises(error, match=text):
        GGUFReader(path)


def test_bad_alignment(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(header(n_kv=1) + gstr(b"general.alignment") + struct.pack("<II", 4, 48))
    with pytest.raises(errors.FormatError, match="power of two"):
        GGUFReader(path)


def test_meta_value_inference():
    assert MetaValue.of(3).vtype == ValueType.UINT32
    assert MetaValue.of(-3).vtype == ValueType.INT64
    assert MetaValue.of(True).vtype == ValueType.BOOL
    assert MetaValue.of([1, 2]).item_type == ValueType.UINT64
    assert MetaValue.of(["x"]).item_type == ValueType.STRING
    with pytest.raises(TypeError):
        MetaValue.of(object())


def test_what_the_gguf_package_lists(tiny_containers):
    """README: gguf-dump (the gguf package's reader) lists every GGUF container but those whose
    GGML type it does not know: i2_s (type 36, bitnet.cpp's fork only), iq1_bn and iq2_bn
    (134, 135: ik_llama.cpp only) and, in gguf releases older than llama.cpp's, q2_0 (42)."""
    from bitformat.formats import get_format

    known = {int(t) for t in gguf.GGMLQuantizationType}
    for fid, path in tiny_containers.items():
        gtype = int(get_format(fid).storage_type)
        if fid in ("i2_s", "iq1_bn", "iq2_bn", "q2_0") and gtype not in known:
            with pytest.raises(ValueError, match=str(gtype)):
                gguf.GGUFReader(str(path))
            continue
        if fid in ("i2_s", "iq1_bn", "iq2_bn"):
            pytest.fail(f"gguf now knows type {gtype}: update the README's gguf-dump sentence")
        ref = gguf.GGUFReader(str(path))
        with GGUFReader(path) as ours:
            assert [t.name for t in ref.tensors] == list(ours.tensors), fid
            assert ref.fields["bitformat.format"].contents() == fid
