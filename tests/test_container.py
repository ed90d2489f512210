"""Whole-model conversions: lossless chains, byte identity, atomicity, scale refusals."""

from __future__ import annotations

import itertools
import struct

import numpy as np
import pytest

from bitformat import convert, open_model
from bitformat.errors import BitformatError, ScaleLossError
from bitformat.formats import FORMAT_IDS
from bitformat.io.gguf import GGUFReader


@pytest.fixture(scope="module")
def every_container(tiny_containers):
    """The tiny model converted once into every GGUF container."""
    return tiny_containers


def snapshot(path):
    """Trits, scales and plain tensors of a model, for comparisons across containers."""
    with open_model(path) as m:
        tern, plain = {}, {}
        for e in m.entries:
            if e.ternary:
                t = m.ternary(e.name)
                tern[e.name] = (t.trits.copy(), t.tensor_scale())
            else:
                gtype, raw = m.plain(e.name)
                plain[e.name] = (gtype, bytes(raw))
        meta = {k: v.plain() for k, v in m.metadata.items()
                if not k.startswith("bitformat.") and k != "general.file_type"}
        return [e.name for e in m.entries], tern, plain, meta


def test_every_container_holds_the_same_model(tiny_gguf, every_container):
    names, tern, plain, meta = snapshot(tiny_gguf)
    for fid, path in every_container.items():
        n2, t2, p2, m2 = snapshot(path)
        assert n2 == names, fid
        assert p2 == plain, f"{fid}: a plain tensor changed"
        assert m2.keys() == meta.keys(), fid
        for k in meta:
            assert np.array_equal(np.asarray(m2[k], dtype=object), np.asarray(meta[k],
                                  dtype=object)), f"{fid}: metadata {k} changed"
        for name, (trits, scale) in tern.items():
            assert np.array_equal(t2[name][0], trits), f"{fid}: trits of {name} differ"
            assert t2[name][1] == scale, f"{fid}: scale of {name} differs"


@pytest.mark.parametrize("a, b, c", list(itertools.permutations(FORMAT_IDS, 3)))
def test_three_step_chains_are_byte_identical(every_container, tmp_path, a, b, c):
    """A -> B -> C -> A gives back A's exact bytes."""
    start = every_container[a]
    prev = start
    for i, fid in enumerate((b, c, a)):
        nxt = tmp_path / f"{i}.{fid}.gguf"
        convert(prev, nxt, fid)
        prev = nxt
    assert prev.read_bytes() == start.read_bytes()


def test_convert_onto_itself(every_container, tmp_path):
    path = tmp_path / "self.gguf"
    path.write_bytes(every_container["stfma"].read_bytes())
    convert(path, path, "tq1_0")
    assert path.read_bytes() == every_container["tq1_0"].read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == ["self.gguf"]


def patch_i2s_scale(src, dst, name, scale):
    """Copy an i2_s file, changing one tensor's f32 tail scale."""
    blob = bytearray(src.read_bytes())
    with GGUFReader(src) as r:
        info = r.tensors[name]
        at = r.data_offset + info.offset + info.n_elements // 4
    blob[at:at + 4] = struct.pack("<f", scale)
    dst.write_bytes(bytes(blob))


def test_scale_loss_refused_then_allowed(tiny_gguf, tmp_path):
    src = tmp_path / "odd.gguf"
    patch_i2s_scale(tiny_gguf, src, "blk.0.attn_q.weight", 1.2345678)
    before = src.read_bytes()
    out = tmp_path / "out.gguf"
    with pytest.raises(ScaleLossError) as info:
        convert(src, out, "tq2_0")
    msg = str(info.value)
    assert "blk.0.attn_q.weight" in msg and "float16" in msg and "allow-scale-rounding" in msg
    assert not out.exists() and src.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["odd.gguf"]
    report = convert(src, out, "tq2_0", allow_scale_rounding=True)
    assert set(report.scale_changes) == {"blk.0.attn_q.weight"}
    loss = report.scale_changes["blk.0.attn_q.weight"]
    assert 0 < loss < 1e-3
    with open_model(out) as m:
        t = m.ternary("blk.0.attn_q.weight")
        assert t.tensor_scale() == float(np.float16(1.2345678))


def test_interrupted_convert_leaves_nothing(tiny_gguf, tmp_path):
    src = tmp_path / "src.gguf"
    src.write_bytes(tiny_gguf.read_bytes())
    seen = []

    def progress(entry):
        seen.append(entry.name)
        if len(seen) == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert(src, src, "tq2_0", progress=progress)
    assert src.read_bytes() == tiny_gguf.read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == ["src.gguf"]


def test_unknown_format_is_a_clear_error(tiny_gguf, tmp_path):
    with pytest.raises(ValueError, match="unknown format 'q4_0'"):
        convert(tiny_gguf, tmp_path / "x.gguf", "q4_0")


def test_errors_name_file_and_tensor(tiny_gguf, tmp_path):
    """A code 3 planted in one tensor is reported with the file and the tensor."""
    bad = tmp_path / "bad.gguf"
    blob = bytearray(tiny_gguf.read_bytes())
    with GGUFReader(tiny_gguf) as r:
        info = r.tensors["blk.1.ffn_up.weight"]
        blob[r.data_offset + info.offset + 7] = 0xFF
    bad.write_bytes(bytes(blob))
    with open_model(bad) as m, pytest.raises(BitformatError) as e:
        m.ternary("blk.1.ffn_up.weight")
    assert str(bad) in str(e.value) and "blk.1.ffn_up.weight" in str(e.value)
