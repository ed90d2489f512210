"""The validation pass (bitformat/validate.py): a model whose tensors or config disagree is
refused before any kernel sees it, with the file and tensor named; NaN in a norm is an error
for run and a warning for inspect and convert."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from bitformat import open_model
from bitformat.cli import main
from bitformat.constants import GGMLType, ValueType
from bitformat.container import convert
from bitformat.errors import (
    BitformatError,
    InvalidScaleError,
    MetadataError,
    MissingTensorError,
    ShapeError,
)
from bitformat.io.gguf import GGUFReader, GGUFWriter, MetaValue
from bitformat.runtime import load
from bitformat.validate import (
    TensorSpec,
    check_model,
    known_architecture,
    model_args,
    tensor_specs,
)

ARCH = "bitnet-b1.58"


def rewrite(src, dst, *, meta: dict | None = None, drop=(), shapes: dict | None = None,
            patch=None):
    """Copy a GGUF with metadata set (None deletes a key), tensors dropped, declared shapes
    changed (same bytes) and raw bytes patched."""
    with GGUFReader(src) as m:
        md = dict(m.metadata)
        for k, v in (meta or {}).items():
            if v is None:
                md.pop(k, None)
            else:
                md[k] = v
        w = GGUFWriter(str(dst), metadata=md)
        blobs = []
        for e in m.tensors.values():
            if e.name in drop:
                continue
            gtype, raw = e.ggml_type, m.raw(e.name)
            shape = (shapes or {}).get(e.name, e.shape)
            plain = gtype in (GGMLType.F32, GGMLType.F16) and tuple(shape) != e.shape
            w.add_tensor(e.name, tuple(shape), gtype, None if plain else e.nbytes)
            blobs.append(patch(e.name, raw.copy()) if patch else raw)
        w.write(iter(blobs))
    return dst


def f32(v):
    return MetaValue(ValueType.FLOAT32, v)


def f64(v):
    return MetaValue(ValueType.FLOAT64, v)


@pytest.mark.parametrize("backend", ["cpu", "numpy"])
def test_norm_shorter_than_the_config_is_refused(tiny_gguf, tmp_path, backend):
    """The issue's case: attn_sub_norm of 128 values in a 256-wide model read past the end of
    an array in the cpu kernels; now both backends refuse it the same way."""
    name = "blk.0.attn_sub_norm.weight"

    def half(n, raw):
        return raw[: raw.size // 2] if n == name else raw

    bad = rewrite(tiny_gguf, tmp_path / "bad.gguf", shapes={name: (128,)}, patch=half)
    with pytest.raises(ShapeError) as exc:
        load(bad, backend=backend)
    assert str(bad) in str(exc.value) and name in str(exc.value)
    assert "128" in str(exc.value) and "256" in str(exc.value)


def test_swapped_projection_dims_are_refused(tiny_containers, tmp_path):
    name = "blk.1.ffn_up.weight"
    bad = rewrite(tiny_containers["i2_s"], tmp_path / "swap.gguf", shapes={name: (256, 512)})
    with pytest.raises(ShapeError, match="shape 256x512 but the config implies 512x256"):
        load(bad, backend="cpu")
    with pytest.raises(ShapeError):
        convert(bad, tmp_path / "out.gguf", "tq2_0")
    assert not (tmp_path / "out.gguf").exists()


def test_missing_tensor_names_it(tiny_gguf, tmp_path):
    bad = rewrite(tiny_gguf, tmp_path / "miss.gguf", drop={"blk.1.ffn_norm.weight"})
    with pytest.raises(MetadataError, match="blk.1.ffn_norm.weight.*missing"):
        load(bad, backend="numpy")
    with open_model(bad) as m, pytest.raises(MissingTensorError) as exc:
        m.entry("blk.1.ffn_norm.weight")
    assert isinstance(exc.value, KeyError) and str(bad) in str(exc.value)
    r = CliRunner().invoke(main, ["run", str(bad), "--prompt-ids", "1,2", "-n", "1"])
    assert r.exit_code == 1 and r.output.count("\n") == 1 and "Traceback" not in r.output
    assert "blk.1.ffn_norm.weight" in r.output


@pytest.mark.parametrize("key, value, problem", [
    ("attention.layer_norm_rms_epsilon", f32(float("nan")), "eps"),
    ("attention.layer_norm_rms_epsilon", f32(0.0), "eps"),
    ("attention.layer_norm_rms_epsilon", f32(-1e-5), "eps"),
    ("attention.layer_norm_rms_epsilon", f64(1e-60), "eps"),  # 0 in float32
    ("rope.freq_base", f32(float("inf")), "theta"),
    ("rope.freq_base", f64(1e40), "theta"),  # overflows float32
    ("rope.freq_base", f32(-5.0), "theta"),
    ("block_count", MetaValue(ValueType.UINT64, 10**9), "n_layers"),
    ("embedding_length", MetaValue(ValueType.UINT32, 0), "positive"),
    ("attention.head_count", MetaValue(ValueType.UINT32, 3), "heads"),
    ("attention.head_count", MetaValue(ValueType.STRING, "four"), "not an integer"),
    ("feed_forward_length", MetaValue(ValueType.FLOAT32, 512.5), "not an integer"),
    ("context_length", MetaValue(ValueType.ARRAY, ["1", "2"], ValueType.STRING), "not an integer"),
])
def test_config_values_out_of_range_are_refused(tiny_gguf, tmp_path, key, value, problem):
    bad = rewrite(tiny_gguf, tmp_path / "cfg.gguf", meta={f"{ARCH}.{key}": value})
    for backend in ("numpy", "cpu"):
        with pytest.raises(MetadataError, match=problem) as exc:
            load(bad, backend=backend)
        assert str(bad) in str(exc.value)
    with pytest.raises(BitformatError, match=problem):
        convert(bad, tmp_path / "out.gguf", "stfma")
    r = CliRunner().invoke(main, ["inspect", str(bad)])
    assert r.exit_code == 0 and "error (run and convert refuse)" in r.output


def test_nan_in_a_norm_errors_for_run_warns_for_inspect_and_convert(tiny_gguf, tmp_path):
    name = "blk.0.ffn_norm.weight"

    def poison(n, raw):
        if n == name:
            raw.view("<f4")[3] = np.nan
            raw.view("<f4")[7] = np.inf
        return raw

    bad = rewrite(tiny_gguf, tmp_path / "nan.gguf", patch=poison)
    with pytest.raises(BitformatError, match="2 of 256 values are NaN or infinite"):
        load(bad, backend="cpu")
    r = CliRunner().invoke(main, ["inspect", str(bad)])
    assert r.exit_code == 0, r.output
    assert f"warning: tensor '{name}': 2 of 256 values are NaN or infinite" in r.output
    r = CliRunner().invoke(main, ["inspect", "--json", str(bad)])
    problems = json.loads(r.output)["problems"]
    assert problems == [{"level": "warning", "tensor": name,
                         "message": "2 of 256 values are NaN or infinite"}]
    r = CliRunner().invoke(main, ["convert", str(bad), "--to", "tq2_0", "-o",
                                  str(tmp_path / "out.gguf")])
    assert r.exit_code == 0 and "warning: tensor" in r.output
    assert (tmp_path / "out.gguf").exists()


def test_nan_in_the_f16_embedding_is_found(tiny_gguf, tmp_path):
    def poison(n, raw):
        if n == "token_embd.weight":
            raw.view("<u2")[1000] = 0x7E00  # f16 NaN
        return raw

    bad = rewrite(tiny_gguf, tmp_path / "nan.gguf", patch=poison)
    with pytest.raises(BitformatError, match="token_embd.weight.*1 of 131072 values"):
        load(bad, backend="numpy")


@pytest.mark.parametrize("scale", [0.0, -0.5, float("nan")])
def test_bad_per_tensor_scales_are_refused(tiny_containers, tmp_path, scale):
    name = "blk.0.attn_k.weight"
    bad = rewrite(tiny_containers["stfma"], tmp_path / "s.gguf",
                  meta={f"bitformat.tensor.{name}.scale": f32(scale)})
    with pytest.raises(InvalidScaleError) as exc:
        load(bad, backend="cpu")
    assert name in str(exc.value) and str(bad) in str(exc.value)


def test_zero_i2s_scale_is_refused(tiny_gguf, tmp_path):
    name, n = "blk.1.attn_v.weight", 128 * 256 // 4

    def zero(t, raw):
        if t == name:
            raw[n: n + 4] = 0
        return raw

    bad = rewrite(tiny_gguf, tmp_path / "z.gguf", patch=zero)
    with pytest.raises(InvalidScaleError, match="per-tensor scale is 0.0"):
        load(bad, backend="cpu")


def test_valid_models_have_no_problems(tiny_containers):
    for path in tiny_containers.values():
        with open_model(path) as m:
            assert check_model(m, model_args(m)) == []


def test_a_family_declares_its_tensors():
    """A family plugs in by a ``tensor_specs()`` method on its args (or by registering a
    :class:`~bitformat.families.Family`: tests/test_toy_family.py)."""

    class Args:
        arch, dim, n_layers, n_heads, n_kv_heads, hidden_dim = "toy", 8, 1, 2, 1, 16
        vocab_size, head_dim, norm_eps, rope_theta, context_length = 10, 4, 1e-5, 1e4, 32

        def tensor_specs(self):
            return [TensorSpec("token_embd.weight", (10, 8), "embedding")]

    assert tensor_specs(Args()) == [TensorSpec("token_embd.weight", (10, 8), "embedding")]
    assert known_architecture("bitnet-b1.58") and not known_architecture("toy")


# -- the CLI: every error is one line and a non-zero exit --------------------------------------
def one_line_error(r) -> str:
    assert r.exit_code == 1, (r.exit_code, r.output)
    assert "Traceback" not in r.output and r.output.startswith("error: "), r.output
    assert r.output.count("\n") == 1, r.output
    return r.output


@pytest.mark.parametrize("args, problem", [
    (["--temperature", "nan"], "nan is not a finite number"),
    (["--top-p", "inf"], "inf is not a finite number"),
    (["-n", "-5"], "-5 is not in the range"),
])
def test_run_refuses_bad_numbers(tiny_gguf, args, problem):
    r = CliRunner().invoke(main, ["run", str(tiny_gguf), "--prompt-ids", "1", *args])
    assert r.exit_code == 2 and problem in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("exc, says", [
    (MemoryError(), "error: out of memory"),
    (RecursionError("maximum recursion depth exceeded"), "nested too deeply"),
    (OSError(28, "No space left on device", "/x/out.gguf"),
     "error: /x/out.gguf: No space left on device"),
    (TypeError("bad operand"), "internal error (TypeError: bad operand)"),
])
def test_unforeseen_errors_are_one_line(tiny_gguf, monkeypatch, exc, says):
    import bitformat.container

    def boom(*a, **k):
        raise exc

    monkeypatch.setattr(bitformat.container, "open_model", boom)
    monkeypatch.delenv("BITFORMAT_DEBUG", raising=False)
    r = CliRunner().invoke(main, ["inspect", str(tiny_gguf)])
    assert says in one_line_error(r)
    # --debug (or BITFORMAT_DEBUG=1) shows the traceback of what went wrong
    r = CliRunner().invoke(main, ["--debug", "inspect", str(tiny_gguf)])
    assert r.exit_code == 1
    if isinstance(exc, TypeError):
        assert r.exception is exc  # re-raised: Python prints the traceback
    else:
        assert "Traceback" in r.output
    monkeypatch.setenv("BITFORMAT_DEBUG", "1")
    r = CliRunner().invoke(main, ["inspect", str(tiny_gguf)])
    assert r.exit_code == 1 and ("Traceback" in r.output or r.exception is exc)


def test_missing_encoding_key_is_refused_not_copied(tiny_containers, tmp_path):
    """Without its encoding key a stfma tensor's I32 words were copied as a plain tensor."""
    name = "blk.0.ffn_gate.weight"
    bad = rewrite(tiny_containers["stfma"], tmp_path / "noenc.gguf",
                  meta={f"bitformat.tensor.{name}.encoding": None})
    for cmd in (["inspect", str(bad)], ["convert", str(bad), "--to", "i2_s", "-o",
                                        str(tmp_path / "o.gguf")]):
        out = one_line_error(CliRunner().invoke(main, cmd))
        assert f"bitformat.tensor.{name}.encoding" in out and str(bad) in out
    assert not (tmp_path / "o.gguf").exists()


def test_merge_of_unknown_tokens_is_a_clean_error(tiny_gguf, tmp_path):
    with GGUFReader(tiny_gguf) as r:
        merges = list(r.metadata["tokenizer.ggml.merges"].value)
    merges[5] = "\u0100nosuchtoken \u0101neither"
    bad = rewrite(tiny_gguf, tmp_path / "merge.gguf", meta={
        "tokenizer.ggml.merges": MetaValue(ValueType.ARRAY, merges, ValueType.STRING)})
    out = one_line_error(CliRunner().invoke(main, ["run", str(bad), "--prompt", "hi", "-n",
                                                   "1", "--backend", "numpy"]))
    assert "tokenizer" in out and str(bad) in out


# -- bounds: nothing sized from a file beyond what it holds or a documented cap -----------------
def test_rans_matrix_claiming_65536_squared_is_refused(tiny_containers, tmp_path):
    name = "blk.0.attn_q.weight"
    bad = rewrite(tiny_containers["rans"], tmp_path / "big.gguf", meta={
        f"bitformat.tensor.{name}.shape": MetaValue(
            ValueType.ARRAY, np.array([65536, 65536], np.uint64), ValueType.UINT64)})
    with pytest.raises(ShapeError, match="at most") as exc:
        open_model(bad)
    assert name in str(exc.value) and str(bad) in str(exc.value)


def deep(n: int) -> str:
    return "[" * n + "]" * n


@pytest.fixture(scope="module")
def hf_folder(tiny_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("hfv") / "hf"
    convert(tiny_gguf, out, "hf")
    return out


def copy_hf(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("file", ["config.json", "tokenizer.json", "tokenizer_config.json"])
@pytest.mark.parametrize("depth", [100, 100_000])
def test_deep_json_is_a_clean_error(hf_folder, tmp_path, file, depth):
    d = copy_hf(hf_folder, tmp_path / "hf")
    obj = json.loads((d / file).read_text())
    text = json.dumps(obj)[:-1] + f', "deep": {deep(depth)}}}'
    (d / file).write_text(text)
    out = one_line_error(CliRunner().invoke(main, ["inspect", str(d)]))
    assert "nested deeper than 64 levels" in out and file in out


def test_deep_safetensors_header_is_a_clean_error(hf_folder, tmp_path):
    import struct

    d = copy_hf(hf_folder, tmp_path / "hf")
    st = next(d.glob("*.safetensors"))
    blob = st.read_bytes()
    n = struct.unpack("<Q", blob[:8])[0]
    header = blob[8:8 + n].decode().rstrip()
    header = header[:-1] + f', "deep": {deep(5000)}}}'
    header += " " * (-len(header) % 8)
    st.write_bytes(struct.pack("<Q", len(header)) + header.encode() + blob[8 + n:])
    out = one_line_error(CliRunner().invoke(main, ["inspect", str(d)]))
    assert "nested deeper than 64 levels" in out and st.name in out


def test_a_billion_layers_in_config_json_is_refused_at_once(hf_folder, tmp_path):
    import resource
    import time

    d = copy_hf(hf_folder, tmp_path / "hf")
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = 10**9
    (d / "config.json").write_text(json.dumps(cfg))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    out = one_line_error(CliRunner().invoke(main, ["inspect", str(d)]))
    assert "num_hidden_layers is 1000000000, more than bitformat's cap" in out
    assert time.perf_counter() - t0 < 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000  # KiB


def test_every_family_declares_its_block_tensors():
    """The validator's table comes from bitformat/families.py: Qwen3 has q/k norms of one
    head, Llama no sub-norms, BitNet both sub-norms; an untied output.weight is optional."""
    from dataclasses import replace

    from bitformat.families import BITNET_2B4T, LLAMA, QWEN3
    from bitformat.runtime.models import ModelArgs

    base = ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=512,
                     vocab_size=1000)
    for family, has, lacks in ((QWEN3, {"attn_q_norm": (64,), "attn_k_norm": (64,)},
                                ("attn_sub_norm", "ffn_sub_norm")),
                               (LLAMA, {"attn_norm": (256,)}, ("attn_sub_norm", "attn_q_norm")),
                               (BITNET_2B4T, {"ffn_sub_norm": (512,), "attn_sub_norm": (256,)},
                                ("attn_q_norm",))):
        specs = {s.name: s for s in tensor_specs(replace(base, arch=family.arch,
                                                         family=family))}
        for n, shape in has.items():
            assert specs[f"blk.1.{n}.weight"].shape == shape, family.id
        for n in lacks:
            assert f"blk.0.{n}.weight" not in specs, family.id
        assert specs["blk.1.ffn_down.weight"].shape == (256, 512)
        assert not specs["output.weight"].required
    wide = replace(base, arch="qwen3", family=QWEN3, key_length=128)  # head size != dim / heads
    specs = {s.name: s for s in tensor_specs(wide)}
    assert specs["blk.0.attn_q.weight"].shape == (512, 256)
    assert specs["blk.0.attn_output.weight"].shape == (256, 512)
