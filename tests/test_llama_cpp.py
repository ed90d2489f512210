"""llama.cpp itself (llama-cpp-python built from source) as the independent check of the q2_0
files bitformat writes: its quantizer gives the same bytes, and it loads and runs them.

Upstream llama.cpp has no ``bitnet-b1.58`` (2B-4T) graph, so the tiny synthetic model is
written under its ``bitnet`` architecture (1bitLLM's graph: SiLU-gated FFN with the same
sub-norms, NEOX RoPE, tied head). Its logits are compared, step by step, with a float64 numpy
forward pass of that graph over the same weights that rounds where ggml's CPU backend rounds
(:func:`_reference`): Q8_0 activations into every Q2_0 mat-vec, and f16 wherever a matrix
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

from bitformat.constants import GGMLType
from bitformat.container import open_model, write_gguf
from bitformat.formats import get_format
from bitformat.gguf_io import GGUFReader, GGUFWriter, MetaValue
from bitformat.runtime.backend import attention, rms_norm, rope

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


def q8_0(x: np.ndarray) -> np.ndarray:
    """ggml's Q8_0 rounding of activations as its x86 build does it (ggml-cpu/arch/x86/quants.c
    ``quantize_row_q8_0``): per 32 float32 values, d = max|x| / 127 stored as f16, q =
    round-half-even(x * (127 / max|x|)); what a Q2_0 mat-vec multiplies."""
    b = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(b).max(axis=-1, keepdims=True)
    d = (amax / np.float32(127)).astype(np.float16).astype(np.float64)
    inv = np.float32(127) / np.where(amax > 0, amax, np.float32(1))
    q = np.rint(b * np.where(amax > 0, inv, np.float32(0)))
    return (q * d).reshape(x.shape)


def f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float64)


def _attention_ggml(q, k, v):
    """Causal GQA as ggml's CPU backend does it without flash attention (llama.cpp's
    ``build_attn_mha``): K and V come from the f16 cache, K·Q converts Q to f16 (the
    ``vec_dot_type`` of F16), the softmax runs in float32 and V·P converts P to f16."""
    T, H, d = q.shape
    rep = H // k.shape[1]
    kk, vv = np.repeat(f16(k), rep, axis=1), np.repeat(f16(v), rep, axis=1)
    s = np.einsum("thd,shd->hts", f16(q), kk) / np.sqrt(d)
    s[:, np.triu(np.ones((T, T), bool), 1)] = -np.inf
    p = np.exp(s - s.max(-1, keepdims=True))
    p = f16(p / p.sum(-1, keepdims=True))
    return np.einsum("hts,shd->thd", p, vv).reshape(T, H * d)


def _reference(model, prompt, steps, act=lambda x: x, forced=None, ggml=False):
    """float64 forward pass of llama.cpp's ``bitnet`` graph (src/models/bitnet.cpp);
    ``act`` rounds the input of every ternary projection; ``ggml``: attention and the head's
    input rounded to f16 as ggml's CPU backend does; ``forced``: the tokens fed after each
    step (default: the greedy ones). Greedy tokens and each step's logits."""
    g = model.get
    a = "bitnet."
    n_layer, n_head, n_kv = g(a + "block_count"), g(a + "attention.head_count"), g(
        a + "attention.head_count_kv")
    eps, base = g(a + "attention.layer_norm_rms_epsilon"), g(a + "rope.freq_base")

    def vec(name):
        gt, raw = model.plain(name)
        return raw.view("<f4" if gt == GGMLType.F32 else "<f2").astype(np.float64).reshape(
            model.entry(name).shape)

    def mat(name):
        return model.ternary(name).dense(np.float64)

    E = vec("token_embd.weight")
    dim = E.shape[1]
    hd = dim // n_head
    ids = list(prompt)
    out, logs = [], []
    for step in range(steps):
        T = len(ids)
        inv = 1.0 / base ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
        ang = np.arange(T)[:, None] * inv[None, :]
        cos, sin = np.cos(ang), np.sin(ang)
        x = E[ids]
        for i in range(n_layer):
            b = f"blk.{i}."
            h = rms_norm(x, vec(b + "attn_norm.weight"), eps)
            q = rope((act(h) @ mat(b + "attn_q.weight").T).reshape(T, n_head, hd), cos, sin)
            k = rope((act(h) @ mat(b + "attn_k.weight").T).reshape(T, n_kv, hd), cos, sin)
            v = (act(h) @ mat(b + "attn_v.weight").T).reshape(T, n_kv, hd)
            o = _attention_ggml(q, k, v) if ggml else attention(q, k, v, 0)
            o = rms_norm(o, vec(b + "attn_sub_norm.weight"), eps)
            x = x + act(o) @ mat(b + "attn_output.weight").T
            h = rms_norm(x, vec(b + "ffn_norm.weight"), eps)
            gate, up = act(h) @ mat(b + "ffn_gate.weight").T, act(h) @ mat(b + "ffn_up.weight").T
            f = rms_norm(gate / (1 + np.exp(-gate)) * up, vec(b + "ffn_sub_norm.weight"), eps)
            x = x + act(f) @ mat(b + "ffn_down.weight").T
        hn = rms_norm(x[-1:], vec("output_norm.weight"), eps)
        logits = (f16(hn) if ggml else hn) @ E.T
        logs.append(logits[0])
        out.append(int(np.argmax(logits[0])))
        ids.append(out[-1] if forced is None else forced[step])
    return out, logs


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

    want, logs = _reference(model, PROMPT, STEPS, q8_0, ggml=True)
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
    want, ggml = _reference(model, PROMPT, 8, q8_0, ggml=True)
    _, plain = _reference(model, PROMPT, 8, q8_0, forced=want)
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
    from bitformat.tokenizer import Tokenizer

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
