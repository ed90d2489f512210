"""llama.cpp itself (llama-cpp-python built from source) as the independent check of the q2_0
files bitformat writes: its quantizer gives the same bytes, and it loads and runs them.

Upstream llama.cpp has no ``bitnet-b1.58`` (2B-4T) graph, so the tiny synthetic model is
written under its ``bitnet`` architecture (1bitLLM's graph: SiLU-gated FFN with the same
sub-norms, NEOX RoPE, tied head). Its greedy tokens are compared with a float64 numpy forward
pass of that graph over the same weights (llama.cpp keeps activations unquantized, up to
ggml's q8 dot products, so the comparison needs clear argmax margins, which is checked).
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
STEPS = 6  # at step 8 a rounding flip in an int8 activation makes this tiny random model diverge


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


def _reference(model, prompt, steps, act=lambda x: x):
    """float64 forward pass of llama.cpp's ``bitnet`` graph (src/models/bitnet.cpp);
    ``act`` rounds the input of every ternary projection. Greedy tokens and each step's
    logits."""
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
    for _ in range(steps):
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
            o = rms_norm(attention(q, k, v, 0), vec(b + "attn_sub_norm.weight"), eps)
            x = x + act(o) @ mat(b + "attn_output.weight").T
            h = rms_norm(x, vec(b + "ffn_norm.weight"), eps)
            gate, up = act(h) @ mat(b + "ffn_gate.weight").T, act(h) @ mat(b + "ffn_up.weight").T
            f = rms_norm(gate / (1 + np.exp(-gate)) * up, vec(b + "ffn_sub_norm.weight"), eps)
            x = x + act(f) @ mat(b + "ffn_down.weight").T
        logits = rms_norm(x[-1:], vec("output_norm.weight"), eps) @ E.T
        logs.append(logits[0])
        out.append(int(np.argmax(logits[0])))
        ids.append(out[-1])
    return out, logs


def test_llama_cpp_runs_bitformats_q2_0(files):
    """llama.cpp's logits on bitformat's q2_0 file, step by step along the reference's greedy
    tokens, against the reference with ggml's Q8_0 activation rounding (what its Q2_0
    mat-vec multiplies; without it the tiny random model's logits correlate only 0.83-0.98,
    with it 0.9999). Where the reference's top two logits are clearly apart, the tokens agree.
    """
    model, q2, _, _ = files
    llm = llama_cpp.Llama(str(q2), n_ctx=64, n_threads=2, verbose=False)
    vocab = int(model.get("bitnet.vocab_size"))

    def last_logits():  # the C API: Llama.scores is only filled with logits_all
        ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(vocab,)).astype(np.float64)

    want, logs = _reference(model, PROMPT, STEPS, q8_0)
    llm.eval(PROMPT)
    agreed = 0
    for step, ref in enumerate(logs):
        got = last_logits()
        assert np.abs(got - ref).max() < 0.15, step
        assert np.corrcoef(got, ref)[0, 1] > 0.999, step
        top = np.sort(ref)[-2:]
        if top[1] - top[0] > 0.3:  # twice the largest difference allowed above
            assert int(np.argmax(got)) == want[step], step
            agreed += 1
        llm.eval([want[step]])
    assert agreed >= STEPS // 2


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
