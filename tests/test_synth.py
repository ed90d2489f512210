"""Synthetic models: the official 2B-4T layout, the weight profile, determinism."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest

from bitformat import open_model
from bitformat.constants import GGMLType, ValueType
from bitformat.io.gguf import GGUFReader
from bitformat.synth import (
    PRESETS,
    dead_neurons,
    draw_trits,
    load_profile,
    plan,
    synth,
    trit_spec,
)
from bitformat.ternary import bf16_exact, f16_exact
from bitformat.tokenizers.bpe import Tokenizer

ARCH_KEYS = ["vocab_size", "context_length", "embedding_length", "block_count",
             "feed_forward_length", "rope.dimension_count", "attention.head_count",
             "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "rope.freq_base"]


@pytest.fixture(scope="module")
def tiny(tiny_gguf):
    with open_model(tiny_gguf) as m:
        yield m


def test_2b4t_plan_matches_the_official_file():
    entries = plan("2b4t")
    assert len(entries) == 332
    assert Counter(e.ggml_type for e in entries) == {GGMLType.F32: 121, GGMLType.F16: 1,
                                                      GGMLType.I2_S: 210}
    assert sum(e.nbytes for e in entries) == 1_179_449_920
    assert entries[0].name == "token_embd.weight" and entries[0].shape == (128256, 2560)
    assert entries[0].ggml_type == GGMLType.F16
    assert entries[-1].name == "output_norm.weight" and entries[-1].shape == (2560,)
    layers = [int(e.name.split(".")[1]) for e in entries[1:-1:11]]
    assert layers == [0, 1, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 2, 20, 21, 22, 23, 24, 25,
                      26, 27, 28, 29, 3, 4, 5, 6, 7, 8, 9]
    block = [(e.name.split(".")[2], e.shape, e.ggml_type.name) for e in entries[1:12]]
    assert block == [
        ("attn_norm", (2560,), "F32"), ("ffn_down", (2560, 6912), "I2_S"),
        ("ffn_sub_norm", (6912,), "F32"), ("ffn_gate", (6912, 2560), "I2_S"),
        ("ffn_up", (6912, 2560), "I2_S"), ("ffn_norm", (2560,), "F32"),
        ("attn_sub_norm", (2560,), "F32"), ("attn_k", (640, 2560), "I2_S"),
        ("attn_output", (2560, 2560), "I2_S"), ("attn_q", (2560, 2560), "I2_S"),
        ("attn_v", (640, 2560), "I2_S")]
    # The measured profile lists the ternary tensors in the same order.
    ternary = [e.name for e in entries if e.ggml_type == GGMLType.I2_S]
    assert ternary == list(load_profile()["tensors"])
    # I2_S: 2 bits per weight plus a 32-byte tail.
    for e in entries:
        if e.ggml_type == GGMLType.I2_S:
            assert e.nbytes == e.shape[0] * e.shape[1] // 4 + 32


def test_tiny_opens_as_planned(tiny):
    assert tiny.container == "i2_s"
    got = [(e.name, e.shape, e.encoding) for e in tiny.entries]
    want = [(e.name, e.shape, "i2_s" if e.ggml_type == GGMLType.I2_S else e.ggml_type.name)
            for e in plan("tiny")]
    assert got == want
    assert len(got) == 2 * 11 + 2


def test_metadata(tiny_gguf):
    p = PRESETS["tiny"]
    with GGUFReader(tiny_gguf) as r:
        meta = r.metadata
    keys = list(meta)
    assert keys[:2] == ["general.architecture", "general.name"]
    assert keys[2:12] == [f"bitnet-b1.58.{k}" for k in ARCH_KEYS]
    assert keys[-3:] == ["general.file_type", "bitformat.format", "bitformat.version"]
    assert meta["general.architecture"].value == "bitnet-b1.58"
    want = [p.vocab, p.context, p.hidden, p.layers, p.ffn, p.head_dim, p.heads, p.kv_heads]
    for key, value in zip(ARCH_KEYS, want, strict=False):
        mv = meta[f"bitnet-b1.58.{key}"]
        assert (mv.vtype, mv.value) == (ValueType.UINT32, value), key
    eps = meta["bitnet-b1.58.attention.layer_norm_rms_epsilon"]
    assert eps.vtype == ValueType.FLOAT32 and eps.value == np.float32(1e-5)
    theta = meta["bitnet-b1.58.rope.freq_base"]
    assert (theta.vtype, theta.value) == (ValueType.FLOAT32, 500000.0)
    assert (meta["general.file_type"].vtype, meta["general.file_type"].value) == (
        ValueType.UINT32, 40)
    assert meta["general.quantization_version"].value == 2
    assert meta["tokenizer.ggml.bos_token_id"].value == 496
    tok = Tokenizer(meta)
    assert tok.vocab_size == p.vocab
    assert tok.decode(tok.encode("synthetic BitNet", add_bos=False)) == "synthetic BitNet"


def test_gguf_package_cannot_read_i2_s(tiny_gguf):
    """gguf-py has no type 36 (docs/model.md §3), which is why bitformat reads GGUF itself."""
    gguf = pytest.importorskip("gguf")
    with pytest.raises(ValueError, match="36"):
        gguf.GGUFReader(tiny_gguf)


def test_trits_follow_the_profile(tiny):
    for e in tiny.entries:
        if not e.ternary:
            continue
        spec = trit_spec("tiny", e.name)
        t = tiny.ternary(e.name)
        assert t.shape == (spec.rows, spec.cols)
        assert abs(float((t.trits == 0).mean()) - spec.zero_fraction) < 0.005, e.name
        plus, minus = int((t.trits == 1).sum()), int((t.trits == -1).sum())
        assert abs(plus - minus) < 4 * np.sqrt(plus + minus), e.name
        assert np.array_equal(np.flatnonzero(~t.trits.any(axis=1)), spec.dead_rows), e.name
        assert np.array_equal(np.flatnonzero(~t.trits.any(axis=0)), spec.dead_cols), e.name


def test_dead_rows_are_scaled_from_the_profile():
    prof = load_profile()
    for layer in (0, 1):
        n = prof["dead_ffn_neurons_by_layer"][str(layer)]["all_three"]
        assert len(dead_neurons("tiny", layer)) == round(n * 512 / 6912)
    assert len(dead_neurons("tiny", 1)) == 223  # 3013 of 6912 in the real layer 1
    assert len(trit_spec("tiny", "blk.1.attn_v.weight").dead_rows) == 4  # 19 of 640
    assert len(dead_neurons("2b4t", 1)) == 3013
    assert len(trit_spec("2b4t", "blk.0.ffn_down.weight").dead_cols) == 333


def test_dead_neurons_are_shared(tiny):
    for layer in (0, 1):
        neurons = dead_neurons("tiny", layer)
        assert len(neurons) > 0
        gate = tiny.ternary(f"blk.{layer}.ffn_gate.weight").trits
        up = tiny.ternary(f"blk.{layer}.ffn_up.weight").trits
        down = tiny.ternary(f"blk.{layer}.ffn_down.weight").trits
        assert not gate[neurons].any() and not up[neurons].any()
        assert not down[:, neurons].any()
        dead_gate = np.flatnonzero(~gate.any(axis=1))
        assert np.array_equal(dead_gate, neurons)
        assert np.array_equal(np.flatnonzero(~up.any(axis=1)), neurons)
        assert set(neurons) <= set(np.flatnonzero(~down.any(axis=0)))


def test_row_density_spread_matches_the_real_model():
    """A full-size gate matrix: dead rows and the spread of live rows as measured."""
    name = "blk.7.ffn_gate.weight"
    spec = trit_spec("2b4t", name)
    t = draw_trits(spec)
    density = (t != 0).mean(axis=1)
    example = load_profile()["row_density_examples"][name]
    assert abs(float((t == 0).mean()) - spec.zero_fraction) < 0.005
    assert int((density == 0).sum()) == 217
    assert abs(float(density.std()) - example["sd"]) < 0.01
    assert abs(float(np.median(density)) - example["median"]) < 0.02


def test_scales_are_bf16_and_exact_everywhere(tiny):
    for e in tiny.entries:
        if e.ternary:
            s = float(tiny.ternary(e.name).scales[0])
            assert 1.3 <= s <= 1.8
            assert bf16_exact(s) and f16_exact(s), (e.name, s)


def test_norms_and_embedding(tiny):
    for e in tiny.entries:
        if e.ternary:
            continue
        gtype, raw = tiny.plain(e.name)
        if re.search(r"norm", e.name):
            assert gtype == GGMLType.F32
            g = raw.view("<f4")
            assert np.all(np.abs(g - 1) < 0.6) and abs(float(g.mean()) - 1) < 0.05
            assert all(bf16_exact(v) for v in g)
        else:
            assert e.name == "token_embd.weight" and gtype == GGMLType.F16
            emb = raw.view("<f2").astype(np.float32).reshape(e.shape)
            assert np.all(np.isfinite(emb)) and abs(float(emb.std()) - 0.1) < 0.005


def test_deterministic(tiny_bf16_gguf, tmp_path):
    again = synth("tiny", tmp_path / "again.gguf", seed=0)
    assert again.read_bytes() == tiny_bf16_gguf.read_bytes()
    other = synth("tiny", tmp_path / "other.gguf", seed=1)
    assert other.read_bytes() != tiny_bf16_gguf.read_bytes()
    assert other.stat().st_size == tiny_bf16_gguf.stat().st_size


def test_progress(tmp_path):
    calls = []
    synth("tiny", tmp_path / "p.gguf", progress=lambda *a: calls.append(a))
    names = [e.name for e in plan("tiny")]
    assert calls == [(n, i, len(names)) for i, n in enumerate(names)]


def test_unknown_preset(tmp_path):
    with pytest.raises(ValueError, match="unknown preset"):
        synth("7b", tmp_path / "x.gguf")
    assert not list(tmp_path.iterdir())


def test_embedding_holds_bf16_values_by_default(tiny_bf16_gguf, tmp_path):
    """As the official file: bf16 master weights stored as F16, so the low 3 mantissa bits of
    every normal value are zero; ``embedding="f16"`` keeps full precision."""
    from bitformat.container import open_model

    with open_model(tiny_bf16_gguf) as m:
        gtype, raw = m.plain("token_embd.weight")
    v = raw.view(np.uint16)
    normal = ((v >> 10) & 31) > 0
    assert gtype == GGMLType.F16 and normal.mean() > 0.99
    assert not (v[normal] & 7).any()
    x = v.view(np.float16).astype(np.float32)
    assert np.array_equal(x.astype(np.float16).view(np.uint16), v)
    bf = (x.view(np.uint32) >> 16 << 16).view(np.float32)  # the bf16 value, exactly
    assert np.array_equal(bf[normal], x[normal])
    full = synth("tiny", tmp_path / "f16.gguf", embedding="f16")
    with open_model(full) as m:
        w = m.plain("token_embd.weight")[1].view(np.uint16)
    assert (w & 7).any() and np.abs(w.view(np.float16).astype(np.float32) - x).max() < 1e-3
    with pytest.raises(ValueError, match="bf16, f16"):
        synth("tiny", tmp_path / "x.gguf", embedding="fp8")
