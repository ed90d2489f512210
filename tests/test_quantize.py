"""Float BitNet weights quantized on reading: against transcriptions of bitnet.cpp's converter and
quantizer, against transformers' WeightQuant, and the refusal of models with nothing ternary."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from click.testing import CliRunner

from bitformat import convert, open_model
from bitformat.cli import main
from bitformat.constants import GGMLType
from bitformat.errors import UnsupportedConversionError
from bitformat.io.gguf import GGUFReader, GGUFWriter, MetaValue
from bitformat.quantize import ABSMEAN, TERNARY_VALUES, absmean, quantize, ternary_values


# -- transcriptions of microsoft/BitNet (numpy, written from reading the code) -----------------
def weight_quant_converter(w: np.ndarray) -> np.ndarray:
    """utils/convert-hf-to-gguf-bitnet.py ``BitnetModel.weight_quant`` after its bf16 -> f32
    cast: ``s = 1 / |w|.mean().clamp(min=1e-5)``; ``(w * s).round().clamp(-1, 1) / s``, all
    float32. The mean here is ``math.fsum`` (exact) over n, rounded to float32."""
    w = w.astype(np.float32)
    mean = np.float32(math.fsum(np.abs(w).astype(np.float64).ravel()) / w.size)
    s = np.float32(1) / max(mean, np.float32(1e-5))
    return (np.clip(np.rint(w * s), -1, 1) / s).astype(np.float32)


def quantize_i2_s_c(src: np.ndarray) -> bytes:
    """src/ggml-bitnet-mad.cpp ``quantize_i2_s`` (ACT_PARALLEL, the x86 build): the scale is
    max |v| (in double), a value codes 1 (zero) if |v| < 1e-6, else 2 if v * scale > 0, else 0;
    128-value blocks, value j of a block at byte j % 32, shift 6 - 2 * (j // 32); the scale as
    f32 right after the n / 4 packed bytes (the rest of the 32-byte tail is not written)."""
    flat = src.astype(np.float64).ravel()
    scale = np.abs(flat).max()
    q = np.where(np.abs(flat) < 1e-6, 1, np.where(flat * scale > 0, 2, 0)).astype(np.uint8)
    out = np.zeros(flat.size // 4, np.uint8)
    for j in range(128):
        out.reshape(-1, 32)[:, j % 32] |= q.reshape(-1, 128)[:, j] << (6 - 2 * (j // 32))
    return out.tobytes() + np.float32(scale).tobytes()


# -- float GGUFs like bitnet.cpp's ------------------------------------------------------------
def bf16_round(x: np.ndarray) -> np.ndarray:
    b = np.asarray(x, np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) & np.uint32(0xFFFF0000)).view(np.float32)


def float_gguf(src, out, *, dtype: str = "F32", values: str = "converter", arch: str | None = None,
               seed: int = 0) -> dict[str, np.ndarray]:
    """The tiny model with every ternary projection stored as a float matrix of ``dtype``.

    ``values``: "converter" (bf16 Gaussian masters through ``weight_quant_converter``, what
    bitnet.cpp's converter writes into its f32 GGUF) or "master" (the raw masters). Returns the
    masters (float32). ``arch`` renames the architecture (and its metadata keys)."""
    rng = np.random.default_rng(seed)
    masters = {}
    with open_model(src) as m:
        old = m.architecture
        meta = {k: v for k, v in m.metadata.items()
                if not k.startswith("bitformat.") and k != "general.file_type"}
        if arch is not None:
            meta = {k.replace(f"{old}.", f"{arch}.", 1): v for k, v in meta.items()}
            meta["general.architecture"] = MetaValue.of(arch)
        w = GGUFWriter(str(out))
        w.metadata = meta
        blobs = []
        for e in m.entries:
            if e.ternary:
                master = bf16_round(rng.standard_normal(e.shape).astype(np.float32) * 0.02)
                masters[e.name] = master
                v = weight_quant_converter(master) if values == "converter" else master
                data = {"F32": v, "F16": v.astype(np.float16),
                        "BF16": (bf16_round(v).view(np.uint32) >> 16).astype(np.uint16)}[dtype]
                w.add_tensor(e.name, e.shape, GGMLType[dtype])
            else:
                gtype, data = m.plain(e.name)
                w.add_tensor(e.name, e.shape, gtype, e.nbytes)
            blobs.append(data)
        w.write(iter(blobs))
    return masters


def tensor_bytes(path, name: str) -> bytes:
    with GGUFReader(path) as r:
        return r.raw(name).tobytes()


# -- the rules ------------------------------------------------------------------------------------
def test_rules_on_small_cases():
    assert ternary_values(np.zeros((2, 3), np.float32))[1] == 0
    t, s, rule = quantize(np.array([[2.5, 0.0, -2.5, 5e-7]], np.float32))
    assert (t.tolist(), s, rule) == ([[1, 0, -1, 0]], np.float32(2.5), TERNARY_VALUES)
    w = np.array([[0.5, -0.25, 0.0, 1.0]], np.float32)
    t, s, rule = quantize(w)
    assert rule == ABSMEAN and t.tolist() == [[1, -1, 0, 1]] and s == absmean(w)[1]
    # absmean of ternary values: the same trits, but the scale mean |v| (2/3 * 2.5), not 2.5
    v = np.array([[2.5, 0.0, -2.5]], np.float32)
    assert absmean(v)[0].tolist() == [[1, 0, -1]]
    assert absmean(v)[1] == pytest.approx(2.5 * 2 / 3)


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_bitnet_cpp_f32_gguf_converts_like_quantize_i2_s(tiny_gguf, tmp_path, dtype):
    """A GGUF as bitnet.cpp's converter writes it (weight_quant's t / s values) -> i2_s gives the
    bytes bitnet.cpp's own quantize_i2_s gives for the same values."""
    src = tmp_path / f"model-{dtype}.gguf"
    float_gguf(tiny_gguf, src, dtype=dtype)
    r = CliRunner().invoke(main, ["convert", str(src), "--to", "i2_s", "-o",
                                  str(tmp_path / "out.gguf")], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "quantized 14 tensors from " + dtype + " to ternary" in r.output
    assert "14 held only 0 and +-a" in r.output
    with GGUFReader(src) as f:
        for name, info in f.tensors.items():
            if info.ggml_type != GGMLType[dtype] or len(info.shape) != 2 \
                    or name == "token_embd.weight":
                continue
            raw = f.raw(name)
            v = (raw.view("<f4") if dtype == "F32" else raw.view("<f2").astype(np.float32)
                 if dtype == "F16" else (raw.view("<u2").astype(np.uint32) << 16).view("<f4"))
            want = quantize_i2_s_c(v.reshape(info.shape))
            got = tensor_bytes(tmp_path / "out.gguf", name)
            assert got[:len(want)] == want, name
            assert got[len(want):] == bytes(28), name  # the unused tail, zeroed


def test_raw_masters_in_a_gguf_are_absmean(tiny_gguf, tmp_path):
    """Raw master weights -> the converter's weight_quant, then quantize_i2_s (the two steps
    bitnet.cpp takes from a master checkpoint to an i2_s file)."""
    src = tmp_path / "masters.gguf"
    masters = float_gguf(tiny_gguf, src, values="master")
    out = tmp_path / "out.gguf"
    report = convert(src, out, "i2_s")
    assert set(report.quantized) == set(masters)
    assert {r for _, r in report.quantized.values()} == {ABSMEAN}
    for name, w in masters.items():
        want = quantize_i2_s_c(weight_quant_converter(w))
        assert tensor_bytes(out, name)[:len(want)] == want, name


def test_float_gguf_runs_as_its_quantized_container(tiny_gguf, tmp_path):
    """`run` on the f32 file itself quantizes on load: the same logits as its i2_s conversion."""
    from bitformat.runtime import load

    src = tmp_path / "f32.gguf"
    float_gguf(tiny_gguf, src, values="master")
    convert(src, tmp_path / "q.gguf", "i2_s")
    with load(src, backend="numpy") as a, load(tmp_path / "q.gguf", backend="numpy") as b:
        assert a.container == "f32"
        assert np.array_equal(a.logits([1, 2, 3]), b.logits([1, 2, 3]))
    with open_model(src) as m:
        assert m.quantized["blk.0.attn_q.weight"] == "F32"


def test_every_container_and_hf_take_float_weights(tiny_gguf, tmp_path):
    src = tmp_path / "f32.gguf"
    float_gguf(tiny_gguf, src)
    convert(src, tmp_path / "a.gguf", "i2_s")
    convert(src, tmp_path / "hf", "hf")
    convert(tmp_path / "hf", tmp_path / "b.gguf", "i2_s")
    with open_model(tmp_path / "a.gguf") as a, open_model(tmp_path / "b.gguf") as b:
        for e in a.entries:
            if e.ternary:
                x, y = a.ternary(e.name), b.ternary(e.name)
                assert np.array_equal(x.trits, y.trits) and x.scales[0] == y.scales[0]


def test_non_bitnet_model_is_refused(tiny_gguf, tmp_path):
    src = tmp_path / "llama-f32.gguf"
    float_gguf(tiny_gguf, src, arch="llama")
    with pytest.raises(UnsupportedConversionError, match="architecture 'llama' is not BitNet"):
        convert(src, tmp_path / "out.gguf", "i2_s")
    assert not (tmp_path / "out.gguf").exists()
    r = CliRunner().invoke(main, ["convert", str(src), "--to", "tq2_0"])
    assert r.exit_code == 1 and "not BitNet b1.58" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["run", str(src), "-p", "hi", "--backend", "numpy"])
    assert r.exit_code == 1 and "not BitNet b1.58" in r.output
    r = CliRunner().invoke(main, ["inspect", str(src)])  # reading is still fine
    assert r.exit_code == 0 and "llama" in r.output


# -- transformers' WeightQuant ------------------------------------------------------------------
@pytest.fixture(scope="module")
def weight_quant():
    """transformers' WeightQuant.forward, eager (torch.compile off, as bitnet.cpp's converter)."""
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import torch
    import torch._dynamo
    from transformers.integrations.bitnet import WeightQuant

    def run(w: np.ndarray, dtype=None):
        with torch._dynamo.config.patch(disable=True):
            x = torch.from_numpy(w)
            out = WeightQuant.forward(None, x if dtype is None else x.to(dtype))
        return out.float().numpy()

    return torch, run


def _split(out: np.ndarray) -> tuple[np.ndarray, np.float32]:
    """transformers' output t / inv -> (t, 1 / inv)."""
    mag = np.unique(np.abs(out[out != 0]))
    assert mag.size == 1
    return np.sign(out).astype(np.int8), np.float32(mag[0])


@pytest.mark.oracle
@pytest.mark.parametrize("shape", [(64, 256), (256, 1024), (3, 5)])
def test_absmean_is_weightquant_bit_for_bit(weight_quant, shape):
    """Values on a grid where float32 sums are exact in any order (multiples of 2^-12 below
    2^-4, under 2^24 of them in all): torch's mean is then the exact one, as ours."""
    _, run = weight_quant
    rng = np.random.default_rng(sum(shape))
    k = np.clip(np.rint(rng.laplace(0, 40, shape)), -255, 255)
    w = (k * 2.0 ** -12).astype(np.float32)
    t, s = absmean(w)
    want_t, want_s = _split(run(w))
    assert np.array_equal(t, want_t) and s == want_s
    assert (np.abs(t) == 1).any() and (t == 0).any()


@pytest.mark.oracle
def test_absmean_against_weightquant_at_2b4t_sizes(weight_quant):
    """bf16 Gaussian masters of 2B-4T's shapes: the same trits; the scale equal, or one float32
    step apart where torch's float32 summation rounds the mean the other way."""
    torch, run = weight_quant
    rng = np.random.default_rng(5)
    steps = []
    for shape in [(640, 2560), (2560, 2560)]:
        w = bf16_round(rng.standard_normal(shape).astype(np.float32) * 0.03)
        t, s = absmean(w)
        want_t, want_s = _split(run(w))
        assert np.array_equal(t, want_t)
        steps.append(abs(int(s.view(np.int32)) - int(want_s.view(np.int32))))
        # bf16 model dtype: transformers keeps t / inv in bf16, bitformat (bitnet.cpp) float32
        bt, bs = _split(run(w, torch.bfloat16))
        assert np.array_equal(bt, t) and bs == bf16_round(want_s)
    assert max(steps) <= 1
