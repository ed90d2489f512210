"""llama.cpp itself (llama-cpp-python built from source) as the independent check of the q2_0
files bitformat writes: its quantizer gives the same bytes, and it loads and runs them.

Upstream llama.cpp has no ``bitnet-b1.58`` (2B-4T) graph, so the tiny synthetic model is
written under its ``bitnet`` architecture (1bitLLM's graph: SiLU-gated FFN with the same
sub-norms, NEOX RoPE, tied head). Its logits are compared, step by step, with a float64 numpy
forward pass of that graph over the same weights that rounds where ggml's CPU backend rounds
(tests/ggml_reference.py): Q8_0 activations into every Q2_0 mat-vec, and f16 wherever a matrix
product has an f16 operand (the f16 K and V cache, so Q for K·Q and the softmax
probabilities for V·P, and the final hidden state for the f16 head). With those roundings
the logits agree to about 1e-6 over 40 steps.

Why a plain float64 reference (with Q8_0 activations only) diverged at step 8: this tiny
random model's attention scores are in the hundreds (softmax one-hot in almost every head),
and at step 8 layer 1 head 0 the two largest scores are only 0.41 apart (top probability
0.60). f16 rounding of Q and K (relative 5e-4) moves scores of several hundred by about that
much, so llama.cpp weights the two positions differently and the logits move by up to 1.0
(correlation 0.97). Not a difference in the model's computation and not in bitformat's bytes
(llama-quantize writes the same ones): a near-tie inside attention, which ggml's f16
attention resolves differently from float64.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from ggml_reference import q8_0, reference

from bitformat.constants import GGMLType
from bitformat.container import open_model, write_gguf
from bitformat.formats import get_format
from bitformat.io.gguf import GGUFReader, GGUFWriter, MetaValue

llama_cpp = pytest.importorskip("llama_cpp")

PROMPT = [496, 10, 20, 30, 40]
STEPS = 40  # prompt + steps fit the context of 64
TOL = 1e-3  # logits, against the reference with ggml's roundings (measured: 4e-5 at most)


def _upstream_bitnet(model):
    """The synth model's metadata under upstream llama.cpp's ``bitnet`` architecture."""
    meta = {}
    for k, v in model.metadata.items():
        if k.startswith("bitnet-b1.58."):
            k = "bitnet." + k[len("bitnet-b1.58."):]
        meta[k] = MetaValue.of("bitnet") if k == "general.architecture" else v
    model.metadata = meta
    return model


@pytest.fixture(scope="module")
def files(tiny_gguf, tmp_path_factory):
    d = tmp_path_factory.mktemp("llama-cpp")
    model = _upstream_bitnet(open_model(tiny_gguf))
    q2 = d / "tiny.q2_0.gguf"
    write_gguf(model, q2, get_format("q2_0"))
    f32 = d / "tiny.f32.gguf"  # the same weights as float masters, for llama.cpp's quantizer
    w = GGUFWriter(f32)
    for e in model.entries:
        if e.ternary:
            w.add_tensor(e.name, e.shape, GGMLType.F32)
        else:
            w.add_tensor(e.name, e.shape, model.plain(e.name)[0], e.plain_nbytes)
    w.metadata = {k: v for k, v in model.metadata.items()
                  if not k.startswith("bitformat.") and k != "general.file_type"}
    w.write(model.ternary(e.name).dense().astype("<f4") if e.ternary else model.plain(e.name)[1]
            for e in model.entries)
    yield model, q2, f32, d
    model.close()


def test_llama_quantize_gives_bitformats_bytes(files):
    model, q2, f32, d = files
    out = d / "tiny.llama-quantize.gguf"
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = 41  # LLAMA_FTYPE_MOSTLY_Q2_0
    p.nthread = 1
    p.token_embedding_type = 1  # keep the head F16 (bitformat leaves it as it is)
    p.output_tensor_type = 1
    assert llama_cpp.llama_model_quantize(str(f32).encode(), str(out).encode(),
                                          ctypes.byref(p)) == 0
    ours, theirs = GGUFReader(q2), GGUFReader(out)
    try:
        n = 0
        for name, info in ours.tensors.items():
            if info.ggml_type != GGMLType.Q2_0:
                continue
            assert theirs.tensors[name].ggml_type == GGMLType.Q2_0, name
            np.testing.assert_array_equal(ours.raw(name), theirs.raw(name), err_msg=name)
            n += 1
        assert n == 14  # 7 projections x 2 blocks
    finally:
        ours.close()
        theirs.close()


def test_llama_cpp_runs_bitformats_q2_0(files):
    """llama.cpp's logits on bitformat's q2_0 file, step by step along the reference's greedy
    tokens, against the reference with ggml's roundings (module docstring): within ``TOL`` on
    at least 90 % of the steps; a step beyond it (an int8 or f16 rounding that float64 and
    ggml's float32 sums resolve apart; a float32 version of the reference had two such
    steps, 0.03 off) stays within 0.15 and correlated above 0.999. The greedy tokens agree
    wherever the reference's top two logits are further apart than twice that step's
    difference.
    """
    model, q2, _, _ = files
    llm = llama_cpp.Llama(str(q2), n_ctx=64, n_threads=2, flash_attn=False, verbose=False)
    vocab = int(model.get("bitnet.vocab_size"))

    def last_logits():  # the C API: Llama.scores is only filled with logits_all
        ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(vocab,)).astype(np.float64)

    want, logs = reference(model, PROMPT, STEPS, q8_0, ggml=True)
    llm.eval(PROMPT)
    close = agreed = 0
    for step, ref in enumerate(logs):
        got = last_logits()
        diff = np.abs(got - ref).max()
        close += diff < TOL
        assert diff < 0.15, step
        assert np.corrcoef(got, ref)[0, 1] > 0.999, step
        top = np.sort(ref)[-2:]
        if top[1] - top[0] > 2 * diff:
            assert int(np.argmax(got)) == want[step], step
            agreed += 1
        llm.eval([want[step]])
    assert close >= 0.9 * STEPS
    assert agreed >= 0.9 * STEPS


def test_reference_without_ggml_rounding_diverges(files):
    """Why the roundings are needed (the module docstring's step 8): a float64 reference with
    Q8_0 activations alone, fed the same tokens, is more than 0.5 off at that step and close
    to the ggml-rounded reference at the steps before it."""
    model = files[0]
    want, ggml = reference(model, PROMPT, 8, q8_0, ggml=True)
    _, plain = reference(model, PROMPT, 8, q8_0, forced=want)
    diffs = [np.abs(a - b).max() for a, b in zip(ggml, plain, strict=True)]
    assert max(diffs[:7]) < 0.15 and diffs[7] > 0.5, diffs


TEXTS = ["Hello world, it's 2024!  Numbers 1234567 and   spaces\n\n\tTabs; (x+y)^2 <= z",
         "Don't YOU'LL we've: déjà vu 你好 x86_64 $$$ ~~~ |pipe| `code`", "  lead and trail  ",
         "a\r\nb\rc\n", "1 12 123 1234 12345 3.14159 <|eot_id|>"]


@pytest.mark.filterwarnings("ignore:no tokenizer.ggml.pre")
@pytest.mark.parametrize("pre", ["llama-bpe", "falcon3", "gpt-2", "qwen2", "falcon", "default",
                                 None])
def test_tokenizer_matches_llama_cpp(files, tmp_path, pre):
    """bitformat's tokenizer and llama.cpp's give the same ids for each pre-tokenizer name
    bitformat writes (and without the key: BitNet files mean Llama 3's, llama.cpp 'default')."""
    from bitformat.tokenizers.bpe import Tokenizer

    model, q2, _, _ = files
    src = open_model(q2)
    try:
        meta = dict(src.metadata)
        meta.pop("tokenizer.ggml.pre")
        if pre is not None:
            meta["tokenizer.ggml.pre"] = MetaValue.of(pre)
        src.metadata = meta
        out = tmp_path / "vocab.gguf"
        write_gguf(src, out, get_format("q2_0"))
    finally:
        src.close()
    llm = llama_cpp.Llama(str(out), vocab_only=True, verbose=False)
    tok = Tokenizer(meta)  # general.architecture "bitnet": no Llama 3 assumption
    for text in TEXTS:
        want = llm.tokenize(text.encode(), add_bos=True, special=True)
        assert tok.encode(text) == want, (pre, text)
