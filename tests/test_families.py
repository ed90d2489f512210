"""Every model family in its real Hugging Face layout: import, runtime against transformers,
HF -> every container -> HF, and the same greedy tokens on every backend.

The tiny checkpoints are written here, independently of bitformat's writer, as each family
ships them:

* ``llama``: ``LlamaForCausalLM`` with transformers' BitNet quantization as HF1BitLLM's
  Llama3-8B-1.58 and tiiuae's Falcon3-*-1.58bit have it (``quantization_config`` with
  ``quant_method`` bitnet only, so BitLinear / offline: uint8 ``[out/4, in]`` packed weights,
  a BF16 ``weight_scale`` [1] that the layer DIVIDES by, an untied dense ``lm_head``).
* ``qwen3``: ``Qwen3ForCausalLM`` with the same quantization, ``q_norm``/``k_norm`` and a head
  size of its own (128, with hidden 256 and 4 heads).
* ``1bitllm``: 1bitLLM's ``BitnetForCausalLM`` (``model_type`` llama, its own modeling code,
  no quantization_config): float16 master weights ternarised with absmean on every forward,
  ``inner_attn_ln`` / ``ffn_layernorm`` sub-norms, SiLU, untied ``lm_head``. transformers has
  no class for it; its graph is ``BitNetForCausalLM`` with ``hidden_act`` silu and
  autobitlinear/online, which the oracle loads from the same masters renamed.

The comparisons reuse :mod:`test_oracle_runtime`'s int8-flip detection: logits to 1e-4 per
prompt, or a flip proven by injecting transformers' activations.
"""

from __future__ import annotations

import json
import os
import shutil

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from backends import runtime_backends  # noqa: E402
from test_hf import bf16_bytes, st_tensors, st_write  # noqa: E402

from bitformat import convert, open_model  # noqa: E402
from bitformat.errors import ScaleLossError  # noqa: E402
from bitformat.formats import FORMAT_IDS  # noqa: E402
from bitformat.runtime import load  # noqa: E402

HIDDEN, FF, HEADS, KV, LAYERS, VOCAB = 256, 512, 4, 2, 2, 512
PROJ = {"self_attn.q_proj": "q", "self_attn.k_proj": "kv", "self_attn.v_proj": "kv",
        "self_attn.o_proj": "o", "mlp.gate_proj": "ff", "mlp.up_proj": "ff",
        "mlp.down_proj": "down"}
#: containers that store scales as float16 (per block or per row)
F16_SCALES = tuple(f for f in ("tq2_0", "tq1_0", "q2_0", "iq1_bn") if f in FORMAT_IDS)
_rng = np.random.default_rng(11)
PROMPTS = [_rng.integers(0, VOCAB, int(n)).tolist() for n in (1, 3, 7, 12, 20, 31)]


def f32(x) -> tuple[str, tuple[int, ...], bytes]:
    x = np.asarray(x, np.float32)
    return "F32", x.shape, x.tobytes()


def f16(x) -> tuple[str, tuple[int, ...], bytes]:
    x = np.asarray(x, np.float16)
    return "F16", x.shape, x.tobytes()


def pack(trits: np.ndarray) -> bytes:
    """transformers' packing, written out: byte [r, c] holds rows r + k*R in bits 2k, 2k+1."""
    rows, cols = trits.shape
    r = rows // 4
    out = np.zeros((r, cols), np.uint8)
    for k in range(4):
        out |= ((trits[k * r:(k + 1) * r] + 1).astype(np.uint8) << (2 * k))
    return out.tobytes()


def shapes(head_dim: int) -> dict[str, tuple[int, int]]:
    q, kv = HEADS * head_dim, KV * head_dim
    return {"q": (q, HIDDEN), "kv": (kv, HIDDEN), "o": (HIDDEN, q), "ff": (FF, HIDDEN),
            "down": (HIDDEN, FF)}


def base_config(**extra) -> dict:
    return {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": FF,
            "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
            "num_key_value_heads": KV, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2, **extra}


def norm(rng, n):
    return 1.0 + 0.1 * rng.standard_normal(n)


def write_packed(path, model_type: str, *, seed: int, inverse_scales: str = "pow2"):
    """A ``llama`` or ``qwen3`` folder with packed BitLinear weights (see the module doc)."""
    rng = np.random.default_rng(seed)
    head_dim = 128 if model_type == "qwen3" else HIDDEN // HEADS
    sh = shapes(head_dim)
    t = {"model.embed_tokens.weight": f32(rng.standard_normal((VOCAB, HIDDEN))),
         "model.norm.weight": f32(norm(rng, HIDDEN)),
         "lm_head.weight": f32(rng.standard_normal((VOCAB, HIDDEN)) * 0.5)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = f32(norm(rng, HIDDEN))
        t[p + "post_attention_layernorm.weight"] = f32(norm(rng, HIDDEN))
        if model_type == "qwen3":
            t[p + "self_attn.q_norm.weight"] = f32(norm(rng, head_dim))
            t[p + "self_attn.k_norm.weight"] = f32(norm(rng, head_dim))
        for mod, kind in PROJ.items():
            rows, cols = sh[kind]
            trits = rng.choice(np.int8([-1, 0, 1]), size=(rows, cols), p=[0.3, 0.4, 0.3])
            if inverse_scales == "pow2":  # 1/s and s exact everywhere (f16 blocks too)
                inv = np.float32(2.0 ** rng.integers(-1, 3))
            else:  # a bf16 1/s as real checkpoints have: s is not f16-exact
                inv = np.float32(rng.uniform(1.5, 4.0))
            t[p + mod + ".weight"] = ("U8", (rows // 4, cols), pack(trits))
            t[p + mod + ".weight_scale"] = ("BF16", (1,), bf16_bytes([inv]))
    path.mkdir(parents=True)
    st_write(path / "model.safetensors", t)
    arch = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[model_type]
    cfg = base_config(architectures=[arch], model_type=model_type, hidden_act="silu",
                      tie_word_embeddings=False, torch_dtype="float32",
                      quantization_config={"modules_to_not_convert": None,
                                           "quant_method": "bitnet"})
    if model_type == "qwen3":
        cfg["head_dim"] = head_dim
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def write_1bitllm(path, *, seed: int):
    """1bitLLM's layout: float16 masters, inner_attn_ln / ffn_layernorm, untied lm_head."""
    rng = np.random.default_rng(seed)
    sh = shapes(HIDDEN // HEADS)
    t = {"model.embed_tokens.weight": f16(rng.standard_normal((VOCAB, HIDDEN))),
         "model.norm.weight": f16(norm(rng, HIDDEN)),
         "lm_head.weight": f16(rng.standard_normal((VOCAB, HIDDEN)) * 0.5)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = f16(norm(rng, HIDDEN))
        t[p + "post_attention_layernorm.weight"] = f16(norm(rng, HIDDEN))
        t[p + "self_attn.inner_attn_ln.weight"] = f16(norm(rng, HIDDEN))
        t[p + "mlp.ffn_layernorm.weight"] = f16(norm(rng, FF))
        for mod, kind in PROJ.items():
            t[p + mod + ".weight"] = f16(rng.standard_normal(sh[kind]) * 0.05)
    path.mkdir(parents=True)
    st_write(path / "model.safetensors", t)
    cfg = base_config(architectures=["BitnetForCausalLM"], model_type="llama",
                      hidden_act="silu", tie_word_embeddings=False, torch_dtype="float16",
                      input_bits=8, weight_bits=1, pad_token_id=None)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def oracle_folder_1bitllm(src, dst):
    """The same model as transformers' BitNetForCausalLM (autobitlinear/online, float32)."""
    tensors = {}
    for name, (_, shape, raw) in st_tensors(src / "model.safetensors").items():
        name = name.replace("inner_attn_ln", "attn_sub_norm").replace("ffn_layernorm",
                                                                       "ffn_sub_norm")
        tensors[name] = f32(np.frombuffer(raw, np.float16).reshape(shape))
    dst.mkdir(parents=True)
    st_write(dst / "model.safetensors", tensors)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(architectures=["BitNetForCausalLM"], model_type="bitnet", torch_dtype="float32",
               quantization_config={"quant_method": "bitnet", "linear_class": "autobitlinear",
                                    "quantization_mode": "online"})
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    d = tmp_path_factory.mktemp("families")
    return {"llama": write_packed(d / "llama", "llama", seed=1),
            "qwen3": write_packed(d / "qwen3", "qwen3", seed=2),
            "1bitllm": write_1bitllm(d / "1bitllm", seed=3),
            "llama-bf16-scales": write_packed(d / "llama-b", "llama", seed=4,
                                              inverse_scales="bf16")}


# -- import ----------------------------------------------------------------------------------
@pytest.mark.parametrize("fam, arch, family", [("llama", "llama", "llama"),
                                                ("qwen3", "qwen3", "qwen3"),
                                                ("1bitllm", "bitnet", "bitnet-1bitllm")])
def test_import_names_the_family(folders, fam, arch, family):
    from bitformat.families import family_of

    with open_model(folders[fam]) as m:
        meta = {k: v.plain() for k, v in m.metadata.items()}
        assert m.architecture == arch and family_of(meta).id == family
        assert m.entry("output.weight").shape == (VOCAB, HIDDEN)  # the untied head
        names = {e.name for e in m.entries}
    assert ("blk.0.attn_sub_norm.weight" in names) == (fam == "1bitllm")
    assert ("blk.1.attn_q_norm.weight" in names) == (fam == "qwen3")
    if fam == "1bitllm":
        assert meta["bitnet.hidden_activation"] == "silu"
    if fam == "qwen3":
        assert meta["qwen3.attention.key_length"] == 128


def test_llama_qk_rows_are_permuted_as_llama_cpp(folders):
    """GGUF q/k rows in llama.cpp's convert_hf_to_gguf ``permute`` order, v untouched; the
    scale is 1/weight_scale."""
    t = st_tensors(folders["llama"] / "model.safetensors")
    d = HIDDEN // HEADS

    def hf_trits(name):
        dtype, shape, raw = t[name]
        b = np.frombuffer(raw, np.uint8).reshape(shape)
        return np.concatenate([((b >> (2 * k)) & 3).astype(np.int8) - 1 for k in range(4)])

    def permute(w, n_head):  # convert_hf_to_gguf.LlamaModel.permute, in numpy
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(
            1, 2).reshape(w.shape)

    with open_model(folders["llama"]) as m:
        for gguf, hf, heads in (("attn_q", "self_attn.q_proj", HEADS),
                                ("attn_k", "self_attn.k_proj", KV),
                                ("attn_v", "self_attn.v_proj", None)):
            got = m.ternary(f"blk.1.{gguf}.weight")
            want = hf_trits(f"model.layers.1.{hf}.weight")
            assert np.array_equal(got.trits, want if heads is None else permute(want, heads))
            inv = np.frombuffer(t[f"model.layers.1.{hf}.weight_scale"][2], "<u2")
            stored = (inv.astype(np.uint32) << 16).view(np.float32)[0]
            assert got.tensor_scale() == np.float32(1.0) / stored
    assert d == 64


# -- HF -> every container -> HF -------------------------------------------------------------
@pytest.mark.parametrize("fam", ["llama", "qwen3"])
def test_round_trip_through_every_container(folders, fam, tmp_path):
    """Every tensor comes back with the checkpoint's bytes (packed weights, BF16 1/s scales,
    F32 embedding, head and norms), and every container gives the same folder."""
    src = folders[fam]
    orig = st_tensors(src / "model.safetensors")
    first = None
    for fid in FORMAT_IDS:
        convert(src, tmp_path / f"m.{fid}", fid)
        convert(tmp_path / f"m.{fid}", tmp_path / f"hf-{fid}", "hf")
        back = st_tensors(tmp_path / f"hf-{fid}" / "model.safetensors")
        assert back == orig, f"{fam} via {fid}: tensors differ"
        cfg = json.loads((tmp_path / f"hf-{fid}" / "config.json").read_text())
        assert cfg["model_type"] == fam and cfg["tie_word_embeddings"] is False
        assert cfg["quantization_config"]["linear_class"] == "bitlinear"
        blob = (tmp_path / f"hf-{fid}" / "model.safetensors").read_bytes()
        first = first or blob
        assert blob == first
        shutil.rmtree(tmp_path / f"hf-{fid}")


def test_per_tensor_scales_that_f16_blocks_cannot_hold_are_refused(folders, tmp_path):
    src = folders["llama-bf16-scales"]
    for fid in F16_SCALES:
        with pytest.raises(ScaleLossError):
            convert(src, tmp_path / f"m.{fid}", fid)
        assert not (tmp_path / f"m.{fid}").exists()
    convert(src, tmp_path / "m.i2_s", "i2_s")
    convert(tmp_path / "m.i2_s", tmp_path / "hf", "hf")
    assert st_tensors(tmp_path / "hf" / "model.safetensors") == st_tensors(
        src / "model.safetensors")


def test_1bitllm_exports_as_packed_bitnet_and_round_trips(folders, tmp_path):
    """1bitLLM's float masters are ternarised once (as its BitLinear does on every forward);
    the export is transformers' packed BitNetForCausalLM with SiLU, which then round-trips."""
    convert(folders["1bitllm"], tmp_path / "m.i2_s", "i2_s")
    convert(tmp_path / "m.i2_s", tmp_path / "hf", "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (cfg["model_type"], cfg["hidden_act"], cfg["tie_word_embeddings"]) == (
        "bitnet", "silu", False)
    names = set(st_tensors(tmp_path / "hf" / "model.safetensors"))
    assert "model.layers.0.self_attn.attn_sub_norm.weight" in names and "lm_head.weight" in names
    for fid in FORMAT_IDS:
        if fid in F16_SCALES:  # absmean scales are not f16-exact: refused, clearly
            with pytest.raises(ScaleLossError, match="allow-scale-rounding"):
                convert(tmp_path / "hf", tmp_path / f"n.{fid}", fid)
            continue
        convert(tmp_path / "hf", tmp_path / f"n.{fid}", fid)
        convert(tmp_path / f"n.{fid}", tmp_path / f"hf-{fid}", "hf")
        for f in ("model.safetensors", "config.json"):
            assert (tmp_path / f"hf-{fid}" / f).read_bytes() == (tmp_path / "hf" / f).read_bytes()


# -- the runtime -----------------------------------------------------------------------------
@pytest.mark.parametrize("fam, fid", [("llama", "tq2_0"), ("qwen3", "tq2_0"),
                                      ("1bitllm", "i2_s"), ("qwen3", "q2_0")])
def test_greedy_tokens_agree_on_every_backend(folders, fam, fid, tmp_path):
    if fid not in FORMAT_IDS:
        pytest.skip(f"no {fid} container")
    src = tmp_path / f"m.{fid}"
    convert(folders[fam], src, fid)
    tokens = {}
    for be in runtime_backends():
        with load(src, backend=be) as m:
            tokens[be] = m.generate(PROMPTS[3], max_new_tokens=8, temperature=0,
                                    stop_ids=[]).tokens
    assert len(set(map(tuple, tokens.values()))) == 1, tokens


# -- against transformers --------------------------------------------------------------------
def _transformers_model(folder, fam: str):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import torch
    import torch._dynamo

    transformers.logging.set_verbosity_error()
    cls = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
           "1bitllm": "BitNetForCausalLM"}[fam]
    with torch._dynamo.config.patch(disable=True):
        return getattr(transformers, cls).from_pretrained(str(folder),
                                                          dtype=torch.float32).eval()


@pytest.mark.oracle
@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("fam", ["llama", "qwen3", "1bitllm"])
def test_logits_and_greedy_match_transformers(folders, fam, backend, tmp_path):
    """Our import of each real layout against transformers' class for the family: logits to
    1e-4 (or an int8 flip proven by injection, :func:`test_oracle_runtime.judge`), and the
    same greedy tokens on prompts without a flip."""
    from test_oracle_runtime import describe, hf_runs, judge

    src = folders[fam]
    ref = oracle_folder_1bitllm(src, tmp_path / "tf") if fam == "1bitllm" else src
    model = _transformers_model(ref, fam)
    runs = hf_runs(model, PROMPTS, 6)
    # transformers keeps its cache in float32; so does ours for this comparison
    with load(src, backend=backend, kv_cache="f32") as lm:
        verdicts = {i: judge(lm, p, r) for i, (p, r) in enumerate(zip(PROMPTS, runs,
                                                                       strict=True))}
        bad = {i: (f"{v.err:.3g}", v.problems) for i, v in verdicts.items() if v.problems}
        assert not bad, f"{fam}/{backend}: {bad}; {describe(verdicts)}"
        clean = [i for i, v in verdicts.items() if not v.flips]
        assert len(clean) >= len(PROMPTS) // 2, describe(verdicts)
        for i in clean:
            got = lm.generate(PROMPTS[i], max_new_tokens=6, temperature=0, stop_ids=[]).tokens
            assert got == runs[i].greedy, f"{fam}/{backend} prompt {i}"


# -- synth presets ---------------------------------------------------------------------------
def test_synth_presets_cover_every_family():
    from bitformat.cli.main import SYNTH_PRESETS
    from bitformat.synth import PRESETS, plan

    assert tuple(PRESETS) == SYNTH_PRESETS
    assert {p.family for p in PRESETS.values()} == {"bitnet-2b4t", "bitnet-1bitllm", "llama",
                                                   "qwen3"}
    t = {e.name: e for e in plan("llama3-8b")}
    assert len(t) == 2 + 32 * 9 + 1 and t["output.weight"].shape == (128256, 4096)
    assert t["blk.31.attn_k.weight"].shape == (1024, 4096)
    q = {e.name: e for e in plan("bonsai-8b")}
    assert q["blk.0.attn_q.weight"].shape == (4096, 4096) and q["blk.0.attn_q_norm.weight"
                                                                  ].shape == (128,)


@pytest.mark.parametrize("preset", ["tiny-1bitllm", "tiny-llama", "tiny-qwen3"])
def test_synth_tiny_family_runs_and_exports(preset, tmp_path):
    from bitformat.synth import synth

    path = synth(preset, tmp_path / "m.gguf")
    with load(path, backend="cpu") as m:
        assert m.args.family.id == {"tiny-1bitllm": "bitnet-1bitllm", "tiny-llama": "llama",
                                    "tiny-qwen3": "qwen3"}[preset]
        a = m.generate([1, 2, 3], max_new_tokens=4, temperature=0, stop_ids=[]).tokens
    convert(path, tmp_path / "hf", "hf")
    convert(tmp_path / "hf", tmp_path / "back.gguf", "i2_s")
    with load(tmp_path / "back.gguf", backend="numpy") as m:
        assert m.generate([1, 2, 3], max_new_tokens=4, temperature=0, stop_ids=[]).tokens == a


@pytest.mark.parametrize("fam, words", [
    ("llama", ["Llama ternary", "[llama]", "silu FFN", "no sub-norms", "permuted",
               "untied LM head"]),
    ("qwen3", ["Qwen3 ternary", "q/k norms", "untied LM head"]),
    ("1bitllm", ["1bitLLM", "[bitnet-1bitllm]", "silu FFN, sub-norms"])])
def test_inspect_names_family_and_head(folders, fam, words):
    from click.testing import CliRunner

    from bitformat.cli import main as cli

    res = CliRunner().invoke(cli, ["inspect", str(folders[fam])])
    assert res.exit_code == 0, res.output
    line = next(x for x in res.output.splitlines() if x.strip().startswith("family"))
    assert all(w in line for w in words), line
    assert "output.weight" in res.output  # the LM head line names the untied head


def test_i2_s_rows_that_start_mid_block_load_and_run(tmp_path):
    """1bitLLM bitnet_b1_58-3B's FFN width, 8640, is not a multiple of i2_s's 128-value block
    (ffn_down's rows start mid-block; i2_s blocks run over the flat tensor). The reader
    refused such files; here a tiny 1bitLLM with FFN 320 (2.5 blocks a row) loads, runs with
    the same greedy tokens on every backend and goes through every container that holds it
    (all but tq2_0/tq1_0, which refuse by name) and back byte-identical."""
    import dataclasses

    from bitformat.io.gguf import GGUFReader
    from bitformat.synth import PRESETS, synth

    p = dataclasses.replace(PRESETS["tiny-1bitllm"], name="tiny-1bitllm-ffn320", ffn=320)
    path = synth(p, tmp_path / "m.gguf")
    with GGUFReader(path) as r:
        assert r.tensors["blk.0.ffn_down.weight"].shape == (256, 320)
    runs = {}
    for backend in runtime_backends():
        with load(path, backend=backend) as m:
            runs[backend] = m.generate([1, 2, 3], max_new_tokens=5, temperature=0,
                                       stop_ids=[]).tokens
    assert len(set(map(tuple, runs.values()))) == 1, runs
    from bitformat.errors import ShapeError

    for fid in (*FORMAT_IDS, "hf"):
        out = tmp_path / (fid if fid == "hf" else f"m.{fid}.gguf")
        if fid in ("tq2_0", "tq1_0"):  # 256-value blocks cannot hold rows of 320
            with pytest.raises(ShapeError, match="ffn_down.*rows of a multiple of 256"):
                convert(path, out, fid)
            continue
        if fid != "i2_s":
            convert(path, out, fid)
            convert(out, tmp_path / "back.gguf", "i2_s")
            with GGUFReader(path) as a, GGUFReader(tmp_path / "back.gguf") as b:
                for name in a.tensors:
                    assert bytes(a.raw(name)) == bytes(b.raw(name)), (fid, name)


@pytest.mark.parametrize("preset, embedding, family, head", [
    ("tiny", "bf16", "[bitnet-2b4t]", "token_embd.weight F16"),
    ("tiny-1bitllm", "bf16", "[bitnet-1bitllm]", "output.weight F16"),
    ("tiny-llama", "bf16", "[llama]", "output.weight F16"),
    ("tiny-qwen3", "bf16", "[qwen3]", "output.weight F16"),
    ("tiny-qwen3", "q2_0", "[qwen3]", "output.weight q2_0")])
def test_inspect_names_family_tokenizer_and_head_of_every_preset(preset, embedding, family,
                                                                 head, tmp_path):
    from click.testing import CliRunner

    from bitformat.cli import main as cli
    from bitformat.synth import synth

    path = synth(preset, tmp_path / "m.gguf", embedding=embedding)
    res = CliRunner().invoke(cli, ["inspect", str(path)])
    assert res.exit_code == 0, res.output

    def line(start):
        return next(x for x in res.output.splitlines() if x.strip().startswith(start))

    fam = line("family")
    assert family in fam and "LM head" in fam and (
        ("untied" in fam) == (preset != "tiny")), fam
    assert ("ternary q2_0 LM head" in fam) == (embedding == "q2_0"), fam
    assert "gpt2 (llama-bpe)" in line("tokenizer")  # synth's tokenizer: Llama 3's BPE
    assert head in line("LM head")


def test_inspect_says_llama3_is_assumed_without_a_pre_tokenizer(tiny_gguf, tmp_path):
    """The official 2B-4T GGUF has no tokenizer.ggml.pre: inspect names the Llama 3 choice."""
    from click.testing import CliRunner

    from bitformat.cli import main as cli
    from bitformat.container import write_gguf
    from bitformat.formats import get_format

    model = open_model(tiny_gguf)
    model.metadata = {k: v for k, v in model.metadata.items() if k != "tokenizer.ggml.pre"}
    write_gguf(model, tmp_path / "nopre.gguf", get_format("i2_s"))
    model.close()
    res = CliRunner().invoke(cli, ["inspect", str(tmp_path / "nopre.gguf")])
    assert res.exit_code == 0, res.output
    assert "gpt2 (llama-bpe)" in res.output and "assumed" in res.output, res.output[:2000]


def test_rows_off_the_chunk_are_padded_with_the_same_sums(tmp_path, monkeypatch):
    """With the vnni kernels, a per-tensor-scale matrix whose rows are not whole 256-weight
    chunks (1bitLLM 3B: 3200, 8640) runs as zero-padded stfma rows (AMX for prompts, no
    scalar tail): the logits of a prompt (20 rows) and of decode steps equal the unpadded
    path's."""
    import dataclasses

    from bitformat.runtime.cpu import backend as cpu_backend
    from bitformat.runtime.cpu.kernels import kernel_mode
    from bitformat.synth import PRESETS, synth

    if kernel_mode() != "vnni":
        pytest.skip("padding applies to the vnni kernels")
    p = dataclasses.replace(PRESETS["tiny-1bitllm"], name="tiny-ffn320", ffn=320, hidden=384,
                            heads=6, kv_heads=6)
    path = synth(p, tmp_path / "m.gguf")
    prompt = list(range(3, 23))

    def run():
        with load(path, backend="cpu") as m:
            kinds = {w.encoding for blk in m.net.blocks for w in blk.proj.values()}
            cache = m.net.new_cache(len(prompt) + 3)
            out = [m.net.forward(prompt, cache)]
            out += [m.net.forward([t], cache) for t in (5, 6, 7)]
            return kinds, np.concatenate(out)

    kinds, padded = run()
    assert kinds == {"stfma"}  # 384 and 320 columns: every matrix padded
    monkeypatch.setattr(cpu_backend, "PADDED", ())
    kinds, plain = run()
    assert "i2_s" in kinds
    np.testing.assert_allclose(padded, plain, rtol=0, atol=1e-5)
