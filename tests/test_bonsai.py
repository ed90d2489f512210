"""Ternary Bonsai: a Qwen3 model whose embedding and untied LM head are q2_0 blocks (per-64
scales), as PrismML's GGUF releases have them.

The embedding rows are checked against a scalar transcription of ggml's
``dequantize_row_q2_0`` (tests/test_ternary_gguf_types.py), the head's logits against a scalar
transcription of ggml-cpu's ``ggml_vec_dot_q2_0_q8_0_generic`` on x86 Q8_0 activations
(``quantize_row_q8_0``). The whole model: bitformat's cpu backend against a float64 reference of
llama.cpp's qwen3 graph (tests/ggml_reference.py) with BitNet's per-token int8 activations (its
one intended difference), and llama.cpp itself (llama-cpp-python) against that reference with
ggml's roundings (Q8_0 activations, f16 attention), over 40 steps each.
"""

from __future__ import annotations

import numpy as np
import pytest
from backends import runtime_backends
from ggml_reference import Weights, absmax_int8, q8_0, reference
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


STEPS = 40  # prompt + steps fit the context of 64


def _forced_logits(step, prompt, tokens):
    """Logits after the prompt and after each of ``tokens``: ``step(ids)`` runs the next ids."""
    out = [step(list(prompt))]
    for t in tokens[:-1]:
        out.append(step([t]))
    return out


def test_cpu_backend_is_the_reference_with_per_token_activations(bonsai):
    """bitformat's cpu backend against the float64 llama.cpp-graph reference
    (tests/ggml_reference.py) with BitNet's per-token int8 activations in place of ggml's
    Q8_0 and f16 roundings (the intended difference), over 40 steps: within 1e-4 on at least
    90 % of them (measured: 7e-7 at most), every step correlated above 0.999, and the same
    greedy tokens wherever the top two logits are clearly apart."""
    with open_model(bonsai) as model:
        want, logs = reference(model, PROMPT, STEPS, absmax_int8)
    with load(bonsai, backend="cpu", kv_cache="f32") as m:  # the reference caches float64
        cache = m.net.new_cache(64)
        got = _forced_logits(lambda ids: m.net.forward(ids, cache)[0].astype(np.float64),
                             PROMPT, want)
    diffs = [np.abs(g - r).max() for g, r in zip(got, logs, strict=True)]
    assert sum(d < 1e-4 for d in diffs) >= 0.9 * STEPS, diffs
    for step, (g, r) in enumerate(zip(got, logs, strict=True)):
        assert np.corrcoef(g, r)[0, 1] > 0.999, step
        top = np.sort(r)[-2:]
        if top[1] - top[0] > 2 * diffs[step]:
            assert int(np.argmax(g)) == want[step], step


class _LlamaQKV:
    """llama.cpp (the C API of llama-cpp-python) on a file, without flash attention, keeping
    the float32 Q and K (after RoPE) and V each layer computes (its graph's ``Qcur-<layer>``,
    ``Kcur-<layer>``, ``Vcur-<layer>``, read through ggml's eval callback) before its
    attention rounds them to f16."""

    def __init__(self, llama_cpp, path, n_layers, heads, kv_heads, head_dim, n_vocab):
        import ctypes
        import glob
        import os

        lib = glob.glob(os.path.join(os.path.dirname(llama_cpp.__file__), "lib",
                                     "libggml-base.*"))
        if not lib:
            pytest.skip("llama-cpp-python without its libggml-base")
        g = ctypes.CDLL(lib[0])
        g.ggml_get_name.restype, g.ggml_get_name.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
        g.ggml_get_data_f32.restype = ctypes.POINTER(ctypes.c_float)
        g.ggml_get_data_f32.argtypes = [ctypes.c_void_p]
        g.ggml_nelements.restype, g.ggml_nelements.argtypes = ctypes.c_int64, [ctypes.c_void_p]
        g.ggml_is_contiguous.restype = ctypes.c_bool
        g.ggml_is_contiguous.argtypes = [ctypes.c_void_p]
        self.qkv = {kind: [[] for _ in range(n_layers)] for kind in "QKV"}
        want = {f"{kind}cur-{i}": (kind, i) for kind in "QKV" for i in range(n_layers)}
        last = {}

        def cb(t, ask, _):
            name = g.ggml_get_name(t).decode()
            if ask or name not in want:
                return True
            # the first field of a ggml_tensor is its type: 0 is F32
            if ctypes.cast(t, ctypes.POINTER(ctypes.c_int32))[0] == 0 and \
                    g.ggml_is_contiguous(t):  # the last node of the name: after RoPE
                n = g.ggml_nelements(t)
                last[name] = np.ctypeslib.as_array(g.ggml_get_data_f32(t), shape=(n,)).copy()
            return True

        self._cb = llama_cpp.ggml_backend_sched_eval_callback(cb)
        self._last, self._want = last, want
        self._heads = {"Q": heads, "K": kv_heads, "V": kv_heads}
        self._head_dim = head_dim
        self.lib, self.n_vocab = llama_cpp, n_vocab
        try:  # its log, as Llama(verbose=False) has it
            from llama_cpp._logger import set_verbose
            set_verbose(False)
        except ImportError:
            pass
        self.model = llama_cpp.llama_model_load_from_file(
            str(path).encode(), llama_cpp.llama_model_default_params())
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx, cp.n_threads, cp.n_threads_batch = 64, 2, 2
        cp.flash_attn_type = 0  # disabled: the f16 K·Q and V·P products of build_attn_mha
        cp.cb_eval = self._cb
        self.ctx = llama_cpp.llama_init_from_model(self.model, cp)

    def __call__(self, ids):
        """Run ``ids`` after the positions so far; the last position's logits."""
        import ctypes

        self._last.clear()
        arr = (ctypes.c_int32 * len(ids))(*ids)
        assert self.lib.llama_decode(self.ctx, self.lib.llama_batch_get_one(arr, len(ids))) == 0
        for name, (kind, i) in self._want.items():
            self.qkv[kind][i].append(self._last[name].reshape(
                len(ids), self._heads[kind], self._head_dim).astype(np.float64))
        ptr = self.lib.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).astype(np.float64)

    def close(self):
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


def test_llama_cpp_runs_the_bonsai_file(bonsai):
    """llama.cpp's qwen3 graph on the file, 40 steps along the greedy tokens of the float64
    reference of that graph with ggml's roundings (tests/ggml_reference.py: Q8_0 activations
    into every q2_0 product, the head included; f16 Q, K, V and softmax probabilities).

    Without more, most steps are 0.03-0.09 apart (the prompt's logits agree to 4e-7): this
    tiny random model's attention outputs reach 40, so one Q8_0 step of o_proj's input is
    0.3, and a Q, K or V element that ggml's float32 arithmetic (RoPE for Q and K) puts on
    the other side of an f16 rounding from float64's (one ulp, 5e-4 relative) moves an
    attention output enough to cross one; the layers amplify that to ~0.05 in the logits,
    and every later step attends to that position. So llama.cpp's own float32 Q, K and V
    (after RoPE) are checked against the reference's (relative 1e-5 at every layer on at
    least 90 % of the positions, all within 0.05; measured: 2e-6 at most) and then fed to
    it: its logits are then within 1e-3 of llama.cpp's on at least 90 % of the steps
    (measured: all 40 within 6e-7; feeding K and V alone left 3 steps 0.05-0.08 off, Q
    near-ties), every step within 0.15 and correlated above 0.999, and the greedy tokens
    agree wherever the top two logits are further apart than twice that step's difference
    (all 40 steps here). Without Q, K and V fed, every step stays within 0.15 and correlated
    above 0.999 (measured: 0.09, 0.9998).
    """
    llama_cpp = pytest.importorskip("llama_cpp")
    with open_model(bonsai) as model:
        g = model.get
        shape = (g("qwen3.block_count"), g("qwen3.attention.head_count"),
                 g("qwen3.attention.head_count_kv"), g("qwen3.attention.key_length"))
        w = Weights(model)
        want, free = reference(model, PROMPT, STEPS, q8_0, ggml=True, weights=w)
        llm = _LlamaQKV(llama_cpp, bonsai, *shape, 512)
        try:
            got = _forced_logits(llm, PROMPT, want)
        finally:
            llm.close()
        theirs = {kind: [np.concatenate(x) for x in per_layer]
                  for kind, per_layer in llm.qkv.items()}
        rel = {}  # layer -> each position's relative Q/K/V difference (the last step's)

        def feed(i, *ours):
            t = len(ours[0])
            fed = tuple(theirs[kind][i][:t] for kind in "QKV")
            rel[i] = np.max([np.abs(a - b).max(axis=(1, 2)) / np.abs(b).max()
                             for a, b in zip(fed, ours, strict=True)], axis=0)
            return fed

        _, logs = reference(model, PROMPT, STEPS, q8_0, forced=want, ggml=True, weights=w,
                            qkv=feed)
    pos = np.max(list(rel.values()), axis=0)  # [positions]
    assert (pos < 1e-5).sum() >= 0.9 * len(pos) and pos.max() < 0.05, pos
    assert np.abs(got[0] - free[0]).max() < 1e-3
    close = agreed = 0
    for step, (g, r, f) in enumerate(zip(got, logs, free, strict=True)):
        diff = np.abs(g - r).max()
        close += diff < 1e-3
        assert diff < 0.15 and np.abs(g - f).max() < 0.15, step
        assert np.corrcoef(g, r)[0, 1] > 0.999 and np.corrcoef(g, f)[0, 1] > 0.999, step
        top = np.sort(r)[-2:]
        if top[1] - top[0] > 2 * diff:
            assert int(np.argmax(g)) == int(np.argmax(r)), step
            agreed += 1
    assert close >= 0.9 * STEPS
    assert agreed >= 0.8 * STEPS
