"""``bitformat report``: sizes equal the bytes of real containers, floors recomputed here with
plain numpy, the per-token arithmetic, the CLI and the plot."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
import zstandard
from click.testing import CliRunner

from bitformat import convert, open_model
from bitformat.cli import main
from bitformat.constants import GGMLType
from bitformat.container import output_metadata
from bitformat.formats import FORMAT_IDS, get_format
from bitformat.io.gguf import GGUFReader, GGUFWriter, MetaValue
from bitformat.report import CONTAINERS, build_report, render
from bitformat.ternary import TernaryTensor


@pytest.fixture(scope="module")
def tiny_report(tiny_gguf):
    return build_report(tiny_gguf)


@pytest.fixture(scope="module")
def containers(tiny_gguf, tmp_path_factory):
    d = tmp_path_factory.mktemp("report")
    out = {}
    for fid in FORMAT_IDS:
        out[fid] = d / f"tiny.{fid}.gguf"
        convert(tiny_gguf, out[fid], fid)
    return out


def entropy(counts) -> float:
    p = np.asarray(counts, dtype=np.float64)
    p = p[p > 0] / p.sum()
    return float(-(p * np.log2(p)).sum())


def test_sizes_are_the_bytes_bitformat_writes(tiny_report, containers):
    assert tiny_report.containers == list(CONTAINERS)
    assert CONTAINERS.index("base3") < CONTAINERS.index("rans")
    for fid, path in containers.items():
        with open_model(path) as m:
            for t in tiny_report.tensors:
                e = m.entry(t.name)
                assert t.bytes[fid] == e.nbytes, (fid, t.name)
                assert t.bpw[fid] == e.nbytes * 8 / e.n_elements
        total = sum(t.bytes[fid] for t in tiny_report.tensors)
        assert tiny_report.model["bytes"][fid] == total
        assert tiny_report.model["bits_per_weight"][fid] == total * 8 / \
            tiny_report.model["weights"]


def test_base3_and_zstd_columns(tiny_report, containers):
    with GGUFReader(containers["i2_s"]) as r:
        for t in tiny_report.tensors:
            assert t.bytes["base3"] == 8 + math.ceil(t.weights / 5)
            raw = r.raw(t.name).tobytes()
            z = zstandard.ZstdCompressor(level=19, write_content_size=True).compress(raw)
            assert t.bytes["zstd19"] == len(z)


def test_floors_recomputed_independently(tiny_report, tiny_gguf):
    total = np.zeros(3)
    tensor_bits = row_bits = 0.0
    n = 0
    with open_model(tiny_gguf) as m:
        for t in tiny_report.tensors:
            trits = m.ternary(t.name).trits
            counts = [(trits == v).sum() for v in (-1, 0, 1)]
            assert t.counts == counts
            h = entropy(counts)
            rows = sum(entropy([(r == v).sum() for v in (-1, 0, 1)]) * r.size for r in trits)
            assert t.floors["order0_tensor"] == pytest.approx(h, rel=1e-12)
            assert t.floors["order0_row"] == pytest.approx(rows / trits.size, rel=1e-12)
            assert t.dead_rows == int((~trits.any(axis=1)).sum())
            total += counts
            tensor_bits += h * trits.size
            row_bits += rows
            n += trits.size
    fl = tiny_report.model["floors"]
    assert fl["order0_global"] == pytest.approx(entropy(total), rel=1e-12)
    assert fl["order0_tensor"] == pytest.approx(tensor_bits / n, rel=1e-12)
    assert fl["order0_row"] == pytest.approx(row_bits / n, rel=1e-12)
    assert fl["order0_row"] <= fl["order0_tensor"] <= fl["order0_global"]


def test_same_numbers_from_every_container(tiny_report, containers):
    other = build_report(containers["rans"])
    assert other.container == "rans"
    assert [t.bytes for t in other.tensors] == [t.bytes for t in tiny_report.tensors]
    assert other.model["floors"] == tiny_report.model["floors"]
    assert [t.stored_bytes for t in other.tensors] == [t.bytes["rans"]
                                                      for t in tiny_report.tensors]


def test_per_token_bytes(tiny_report, tiny_gguf):
    with open_model(tiny_gguf) as m:
        emb = m.entry("token_embd.weight")
        norms = sum(e.nbytes for e in m.entries if not e.ternary and e is not emb)
    assert tiny_report.lm_head == "token_embd.weight (tied)"
    for fid, d in tiny_report.per_token.items():
        assert d["ternary"] == tiny_report.model["bytes"][fid]
        assert d["lm_head"] == emb.nbytes
        assert d["embedding_row"] == emb.nbytes // emb.shape[0]
        assert d["norms"] == norms
        assert d["total"] == d["ternary"] + d["lm_head"] + d["embedding_row"] + d["norms"]
        assert d["share"]["lm_head"] == d["lm_head"] / d["total"]
        assert sum(d["share"].values()) == pytest.approx(1.0)
    assert "zstd19" not in tiny_report.per_token


def wide_vocab_model(path) -> None:
    """One BitNet-like block with hidden 128 and a 4,000-token tied f16 embedding."""
    rng = np.random.default_rng(0)
    i2s = get_format("i2_s")
    tensors = [("token_embd.weight", (4000, 128), GGMLType.F16,
                rng.standard_normal((4000, 128)).astype(np.float16))]
    for kind, shape in (("attn_q", (128, 128)), ("ffn_up", (256, 128)),
                        ("ffn_down", (128, 256))):
        t = TernaryTensor(rng.integers(-1, 2, shape).astype(np.int8), np.float32([1.5]))
        tensors.append((f"blk.0.{kind}.weight", shape, GGMLType.I2_S, i2s.encode(t)))
    tensors.append(("output_norm.weight", (128,), GGMLType.F32, np.ones(128, np.float32)))
    meta = output_metadata({"general.architecture": MetaValue.of("bitnet-b1.58")}, i2s)
    w = GGUFWriter(str(path), metadata=meta)
    for name, shape, gtype, data in tensors:
        w.add_tensor(name, shape, gtype, np.asarray(data).nbytes)
    w.write(iter(d for *_, d in tensors))


def test_lm_head_is_over_half_of_a_token(tmp_path):
    path = tmp_path / "wide.gguf"
    wide_vocab_model(path)
    rep = build_report(path)
    emb = 4000 * 128 * 2
    for fid, d in rep.per_token.items():
        assert d["lm_head"] == emb
        assert d["share"]["lm_head"] > 0.5, fid
    text = render(rep)
    assert "LM head" in text and "token_embd.weight (tied)" in text


def test_cli_report_json_text_and_plot(tiny_gguf, tiny_report, tmp_path):
    png = tmp_path / "r.png"
    r = CliRunner().invoke(main, ["report", str(tiny_gguf), "--json", "--plot", str(png)],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    assert info["model"]["bytes"] == tiny_report.model["bytes"]
    row = info["tensors"][0]
    assert row["bits_per_weight"]["rans"] == row["bytes"]["rans"] * 8 / row["weights"]
    blob = png.read_bytes()
    assert blob[:8] == b"\x89PNG\r\n\x1a\n" and blob[12:16] == b"IHDR"
    width, height = struct.unpack(">II", blob[16:24])
    assert width > 800 and height > 600
    import matplotlib.image

    assert matplotlib.image.imread(png).shape[:2] == (height, width)
    r = CliRunner().invoke(main, ["report", str(tiny_gguf)], catch_exceptions=False)
    assert r.exit_code == 0 and "bytes one generated token reads" in r.output
    assert "blk.1.ffn_down.weight" in r.output and "rans" in r.output


def test_cli_convert_to_rans(tiny_gguf, tmp_path):
    src = tmp_path / "m.gguf"
    src.write_bytes(tiny_gguf.read_bytes())
    r = CliRunner().invoke(main, ["convert", str(src), "--to", "rans"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    out = tmp_path / "m.rans.gguf"
    r = CliRunner().invoke(main, ["convert", str(out), "--to", "i2_s", "-o",
                                  str(tmp_path / "back.gguf")], catch_exceptions=False)
    assert r.exit_code == 0 and (tmp_path / "back.gguf").read_bytes() == src.read_bytes()


def test_every_series_has_its_own_colour_and_marker():
    """report --plot and bench --plot: no two containers (nor rans decoded at load and in the
    kernels) share a colour or a marker."""
    from bitformat.formats import FORMAT_IDS
    from bitformat.report_plot import style

    names = [*FORMAT_IDS, "hf", "base3", "zstd19"]
    looks = [style(n)[0] for n in names]
    assert len(set(looks)) == len(names)
    assert len({style(n)[2] for n in names}) == len(names)
    assert style("rans", 1)[2] != style("rans")[2]
    assert style("something_new")[0] not in looks
