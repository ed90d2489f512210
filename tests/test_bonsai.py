"""Ternary Bonsai: a Qwen3 model whose embedding and untied LM head are q2_0 blocks (per-64
scales), as PrismML's GGUF releases have them.

The embedding rows are checked against a scalar transcription of ggml's
``dequantize_row_q2_0`` (tests/test_ternary_gguf_types.py), the head's logits against a scalar
transcription of ggml-cpu's ``ggml_vec_dot_q2_0_q8_0_generic`` on x86 Q8_0 activations
(``quantize_row_q8_0``), and the whole model against llama.cpp itself (llama-cpp-python) where
it is installed.
"""

from __future__ import annotations

import numpy as np
import pytest
from backends import runtime_backends
from test_ternary_gguf_types import ref_dequantize_q2_0

from bitformat import convert, open_model
from bitformat.errors import BitformatError, UnsupportedConversionError
from bitformat.runtime import load
from bitformat.runtime.backend import q2_0_logits, q8_0_activations
from bitformat.summary import summarize
from bitformat.synth import synth
from bitformat.validate import check_model, model_args

PROMPT = [20, 30, 40, 50, 60]


@pytest.fixture(scope="module")
def bonsai(tmp_path_factory):
    d = tmp_path_factory.mktemp("bonsai")
    src = synth("tiny-qwen3", d / "b.i2_s.gguf", embedding="q2_0")
    out = d / "b.q2_0.gguf"  # every ternary tensor q2_0, as the releases are
    convert(src, out, "q2_0")
    return out


def ref_vec_dot_q2_0_q8_0(row: bytes, x: np.ndarray) -> float:
    """One logit as ggml computes it: x made Q8_0 as the x86 build does (per 32 values
    d = f16(max|x| / 127), q = nearbyint(x * 127 / max|x|)), then per 64-value block
    ``sumf += d0 * sum_k d8_k * isum_k``, one loop per line of the C."""
    x = x.astype(np.float32)
    qs, ds = [], []
    for blk in x.reshape(-1, 32):
        amax = np.float32(0)
        for v in blk:
            amax = max(amax, np.float32(abs(v)))
        ds.append(np.float32(np.float16(amax / np.float32(127))))
        inv = np.float32(127) / amax if amax != 0 else np.float32(0)
        qs.append([int(np.rint(np.float32(v * inv))) for v in blk])
    sumf = np.float32(0)
    for i in range(len(row) // 18):
        blk = row[18 * i: 18 * i + 18]
        d0 = np.float32(np.frombuffer(blk[:2], "<f2")[0])
        sumi = np.float32(0)
        for k in range(2):
            isum = 0
            for j in range(32):
                e = 32 * k + j
                c = (blk[2 + e // 4] >> (2 * (e % 4))) & 3
                isum += (c - 1) * qs[2 * i + k][j]
            sumi = np.float32(sumi + ds[2 * i + k] * np.float32(isum))
        sumf = np.float32(sumf + d0 * sumi)
    return float(sumf)


def test_embedding_rows_are_ggml_dequantize(bonsai):
    with load(bonsai, backend="numpy") as m, open_model(bonsai) as model:
        _, raw = model.plain("token_embd.weight")
        rows = raw.reshape(512, -1)
        ids = np.array([0, 7, 300, 511])
        got = m.backend.embed(ids)
        for k, t in enumerate(ids):
            np.testing.assert_array_equal(got[k], ref_dequantize_q2_0(bytes(rows[t]), 256))


def test_head_logits_are_ggml_vec_dot(bonsai):
    rng = np.random.default_rng(3)
    with open_model(bonsai) as model:
        _, raw = model.plain("output.weight")
        rows = raw.reshape(512, -1)
        x = (rng.standard_normal((2, 256)) * rng.uniform(0.1, 10, (2, 1))).astype(np.float32)
        x[1, :32] = 0  # an all-zero Q8_0 block
        got = q2_0_logits(rows[:40], *q8_0_activations(x))
        for t in range(2):
            want = [ref_vec_dot_q2_0_q8_0(bytes(rows[r]), x[t]) for r in range(40)]
            np.testing.assert_allclose(got[t], want, rtol=2e-6, atol=2e-6 * np.abs(want).max())


def test_greedy_identical_on_every_backend_and_head_falls_back_visibly(bonsai):
    tokens, logits = {}, {}
    for be in runtime_backends():
        with load(bonsai, backend=be) as m:
            tokens[be] = m.generate(PROMPT, max_new_tokens=8, temperature=0, stop_ids=[]).tokens
            st = m.head_stats()
            if be == "wgpu":  # its head is the q2_0 blocks as f16 rows: screened like any
                assert st["head"] == "screened" and not st["head_fallbacks"], st
                assert st["head_bytes_per_step"] < st["full_head_bytes"] == 512 * 256 * 2
            else:
                assert st["head_fallbacks"] == {
                    "a ternary q2_0 head (the screen bounds float heads)": 8}, st
                assert st["head_bytes_per_step"] == 512 * 256 // 64 * 18
                logits[be] = m.net.forward(PROMPT, m.net.new_cache(16))[0]
    assert len(set(map(tuple, tokens.values()))) == 1, tokens
    np.testing.assert_array_equal(logits["numpy"], logits["cpu"])  # the same float32 sums


def test_validate_accepts_q2_0_embedding_and_rejects_code_3(bonsai, tmp_path):
    with open_model(bonsai) as model:
        assert not [p for p in check_model(model, model_args(model)) if p.level == "error"]
    bad = tmp_path / "bad.gguf"
    data = bytearray(bonsai.read_bytes())
    with open_model(bonsai) as model:
        _, raw = model.plain("token_embd.weight")
        at = data.find(bytes(raw[:64]))
    data[at + 18 * 5 + 2] |= 0b11  # block 5, element 0: code 3
    bad.write_bytes(bytes(data))
    with open_model(bad) as model:
        errs = [p for p in check_model(model, model_args(model)) if p.level == "error"]
    assert [(p.tensor, p.message) for p in errs] == [
        ("token_embd.weight", "q2_0 code 3 (the value 2d, not a trit) in block 5")]
    with pytest.raises(BitformatError, match="code 3"):
        load(bad, backend="numpy")


def test_inspect_names_the_ternary_head(bonsai):
    with open_model(bonsai) as model:
        s = summarize(model)
    assert s.family["head"] == "untied ternary q2_0"
    assert s.totals["ternary_tensors"] == 14  # the projections; the embedding/head apart


@pytest.mark.parametrize("target, words", [
    ("tq2_0", "one scale per 256 values"), ("i2_s", "one scale per tensor"),
    ("hf", "keeps them dense")])
def test_conversions_that_cannot_hold_group_scales_refuse(bonsai, tmp_path, target, words):
    with pytest.raises((UnsupportedConversionError, BitformatError), match=words):
        convert(bonsai, tmp_path / f"out.{target}", target)


def test_q2_0_round_trip_is_byte_identical(bonsai, tmp_path):
    again = tmp_path / "again.gguf"
    convert(bonsai, again, "q2_0")
    with open_model(bonsai) as a, open_model(again) as b:
        for name in ("token_embd.weight", "output.weight", "blk.1.ffn_down.weight"):
            np.testing.assert_array_equal(a.plain(name)[1], b.plain(name)[1])


def test_llama_cpp_runs_the_bonsai_file(bonsai):
    """llama.cpp's qwen3 graph on the file: its logits along its own greedy tokens against
    bitformat's cpu backend. The projections differ by design (bitformat quantizes their
    input per token as BitNet does, llama.cpp per 32 values), so the logits agree to a
    correlation (0.999 here), and the tokens where the top two are clearly apart (this tiny
    random model rarely has such margins, so that is not counted)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(str(bonsai), n_ctx=64, n_threads=2, verbose=False)

    def last():
        ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(512,)).astype(np.float64)

    with load(bonsai, backend="cpu") as m:
        ids = list(PROMPT)
        llm.eval(ids)
        for _ in range(6):
            theirs = last()
            ours = m.net.forward(ids, m.net.new_cache(64))[0].astype(np.float64)
            assert np.corrcoef(theirs, ours)[0, 1] > 0.995
            diff = np.abs(theirs - ours).max()
            assert diff < 0.5
            top = np.sort(ours)[-2:]
            if top[1] - top[0] > 2 * diff:
                assert int(np.argmax(theirs)) == int(np.argmax(ours))
            ids.append(int(np.argmax(theirs)))
            llm.eval(ids[-1:])
