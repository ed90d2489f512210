"""The runtime on the tiny synthetic model, in every container and on both backends.

Three independent checks stack up:

1. the numpy backend (float64) against a float64 forward pass written here from dense weights
   (``TernaryTensor.dense``), i.e. HF's fake-quantized BitLinear ``(round(x s) / s) @ W^T``;
2. the cpu backend's kernels against the numpy backend, per matrix with the same int8 input
   (bitwise) and end to end on logits to rel 1e-4;
3. greedy tokens identical across containers and backends, and cached decoding against a
   full recompute.

Int8 rounding boundaries. Two float32 runs that differ in summation order (BLAS vs numba, a
batch vs one token at a time) can land on either side of a ``.5`` when an activation is
quantized, and one int8 step there moves the logits far more than 1e-4. Rather than loosen the
logits tolerance, :class:`SharedQuant` makes the second run consume the first run's quantized
activations: it is the model's ``activation_hook``, records ``(x, q, s)`` of every
call of the first run, and at each call of the second run compares its own quantization with
the recorded one. Before quantization the runs must agree: ``|x*s - x'*s'|`` stays below
``noise`` int8 steps for every value. Between the backends the attention differs in float32
summation order (numpy's BLAS products against the cpu backend's compiled attention), about
1e-3 int8 steps with an f32 KV cache; with the default f16 cache a key or value that lands on
either side of an f16 rounding boundary moves it further (3.6e-3 measured with numpy 2.4.6 and
the avx2 kernel build, on an AMD EPYC without AVX-512), hence 0.01. Float32 attention with
this random model's large scores gives up to 0.007 between batch and step-wise decoding.
Every differing ``q`` must be a boundary flip: one step apart, with the ``.5`` between the two
runs' ``x*s``. Anything else fails the test; flips are counted, and the recorded ``q`` and
``s`` are used from then on, so everything downstream compares identical quantized inputs.
"""

from __future__ import annotations

import numpy as np
import pytest

from bitformat.container import convert, open_model
from bitformat.errors import RequestError, UnsupportedConversionError
from bitformat.formats import FORMAT_IDS
from bitformat.runtime import ModelArgs, load, make_sampler
from bitformat.runtime.backend import QuantizedActivations, quantize_activations
from bitformat.runtime.cpu.kernels import KERNEL_BUILDS, builds_here
from bitformat.runtime.models import base as model_mod

PROMPT = [5, 17, 300, 42, 7, 99, 480, 1, 250, 33, 64, 128]


@pytest.fixture(scope="module")
def tiny(tiny_containers):
    """format id -> path of the tiny model in that container."""
    return tiny_containers



# -- an independent float64 forward pass ---------------------------------------------------------
def reference_logits(path, tokens) -> np.ndarray:
    """HF BitNetForCausalLM semantics in float64 numpy, from dense weights."""
    with open_model(path) as m:
        arch = m.architecture
        D, L = m.get(f"{arch}.embedding_length"), m.get(f"{arch}.block_count")
        H, KV = m.get(f"{arch}.attention.head_count"), m.get(f"{arch}.attention.head_count_kv")
        eps, theta = m.get(f"{arch}.attention.layer_norm_rms_epsilon"), m.get(
            f"{arch}.rope.freq_base")
        hd = D // H

        def vec(name):
            gtype, raw = m.plain(name)
            return raw.view({"F32": "<f4", "F16": "<f2"}[gtype.name]).astype(np.float64)

        E = vec("token_embd.weight").reshape(-1, D)
        W = {e.name: m.ternary(e.name).dense(np.float64) for e in m.entries if e.ternary}

        def rms(x, g):
            return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * g

        def bitlinear(x, name):  # AutoBitLinear: fake-quantize per token, then x @ W^T
            s = 127.0 / np.maximum(np.abs(x).max(-1, keepdims=True), 1e-5)
            return (np.clip(np.round(x * s), -128, 127) / s) @ W[name].T

        T = len(tokens)
        pos = np.arange(T, dtype=np.float64)
        ang = pos[:, None] * theta ** (-np.arange(0, hd, 2) / hd)
        cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

        def rope(x):  # [T, heads, hd], rotate_half
            rot = np.concatenate([-x[..., hd // 2:], x[..., : hd // 2]], -1)
            return x * cos[:, None] + rot * sin[:, None]

        h = E[tokens]
        for i in range(L):
            p = f"blk.{i}."
            a = rms(h, vec(p + "attn_norm.weight"))
            q = rope(bitlinear(a, p + "attn_q.weight").reshape(T, H, hd))
            k = rope(bitlinear(a, p + "attn_k.weight").reshape(T, KV, hd))
            v = bitlinear(a, p + "attn_v.weight").reshape(T, KV, hd)
            k, v = np.repeat(k, H // KV, axis=1), np.repeat(v, H // KV, axis=1)
            sc = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)
            sc = np.where(np.triu(np.ones((T, T), bool), 1), -np.inf, sc)
            pr = np.exp(sc - sc.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            o = np.einsum("hts,shd->thd", pr, v).reshape(T, D)
            h = h + bitlinear(rms(o, vec(p + "attn_sub_norm.weight")), p + "attn_output.weight")
            f = rms(h, vec(p + "ffn_norm.weight"))
            g = np.maximum(bitlinear(f, p + "ffn_gate.weight"), 0) ** 2 * bitlinear(
                f, p + "ffn_up.weight")
            h = h + bitlinear(rms(g, vec(p + "ffn_sub_norm.weight")), p + "ffn_down.weight")
        return rms(h, vec("output_norm.weight")) @ E.T


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


@pytest.mark.parametrize("fid", FORMAT_IDS)
def test_numpy_backend_matches_float64_reference(tiny, fid):
    ref = reference_logits(tiny[fid], PROMPT)
    with load(tiny[fid], backend="numpy", dtype="float64", kv_cache="f32") as m:  # unrounded
        got = m.logits(PROMPT)
    assert got.dtype == np.float64
    assert rel_err(got, ref) < 1e-9


# -- shared quantized activations ------------------------------------------------------------------
class SharedQuant:
    """Record a run's quantized activations, then feed them to a second run (module docstring)."""

    def __init__(self, monkeypatch, noise: float):
        self.recorded: list[tuple[np.ndarray, QuantizedActivations]] = []
        self.noise, self.replaying, self.n, self.flips, self.per_forward = noise, False, 0, 0, 0
        monkeypatch.setattr(model_mod, "activation_hook", self)

    def replay(self, per_forward: int = 0):
        """From now on substitute; ``per_forward`` > 0: the second run decodes one token per
        forward of ``per_forward`` calls, matching row ``n // per_forward`` of the recording."""
        self.replaying, self.n, self.per_forward = True, 0, per_forward

    def __call__(self, x: np.ndarray) -> QuantizedActivations:
        qa = quantize_activations(x)
        if not self.replaying:
            self.recorded.append((x.copy(), qa))
            return qa
        if self.per_forward:
            (rx, rqa), rows = self.recorded[self.n % self.per_forward], [self.n // self.per_forward]
        else:
            (rx, rqa), rows = self.recorded[self.n], slice(None)
        self.n += 1
        rq, rs = rqa.q[rows], rqa.s[rows]
        mine = x.astype(np.float64) * qa.s[:, None]  # [T, n], in int8 steps
        theirs = rx[rows].astype(np.float64) * rs[:, None]
        gap = float(np.abs(mine - theirs).max())
        assert gap < self.noise, f"call {self.n - 1}: runs differ by {gap} int8 steps"
        diff = qa.q != rq
        if diff.any():
            half = np.minimum(qa.q, rq).astype(np.float64) + 0.5
            flip = ((np.abs(qa.q.astype(int) - rq) == 1)
                    & ((mine - half) * (theirs - half) <= 0))[diff]
            assert flip.all(), (f"call {self.n - 1}: int8 activations differ away from a "
                                f"rounding boundary: x*s {mine[diff][~flip][:4]} vs "
                                f"{theirs[diff][~flip][:4]}")
            self.flips += int(diff.sum())
        return QuantizedActivations(rq.copy(), rs.astype(x.dtype))


@pytest.mark.parametrize("fid", FORMAT_IDS)
def test_cpu_logits_match_numpy(tiny, cpu_models, fid, monkeypatch):
    shared = SharedQuant(monkeypatch, noise=0.01)
    with load(tiny[fid], backend="numpy") as m:
        want = m.logits(PROMPT)
    shared.replay()
    got = cpu_models[fid].logits(PROMPT)
    assert shared.n == len(shared.recorded)
    assert rel_err(got, want) < 1e-4


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("length", [48, 256])
def test_cached_decoding_matches_recompute(tiny, backend, length, monkeypatch):
    """One token at a time through the KV cache gives the whole prompt's logits, up to the
    model's last position (256: the cpu backend's attention then runs in several runs of
    positions, split among threads and merged)."""
    shared = SharedQuant(monkeypatch, noise=0.05)
    tokens = (PROMPT * 22)[:length]
    with load(tiny["i2_s"], backend=backend) as m:
        assert length <= m.net.args.context_length
        full = m.logits(tokens)  # one batch, every position's logits
        shared.replay(per_forward=len(shared.recorded))
        cache = m.net.new_cache(len(tokens))
        steps = np.concatenate([m.net.forward([t], cache) for t in tokens])
    assert cache.length == len(tokens) and shared.n == len(tokens) * len(shared.recorded)
    assert rel_err(steps, full) < 1e-5


def test_cached_prefill_then_decode_float64(tiny):
    with load(tiny["tq2_0"], backend="numpy", dtype="float64") as m:
        full = m.logits(PROMPT)
        cache = m.net.new_cache(len(PROMPT))
        first = m.net.forward(PROMPT[:7], cache, all_logits=True)
        rest = [m.net.forward([t], cache) for t in PROMPT[7:]]
    assert rel_err(np.concatenate([first, *rest]), full) < 1e-9


def test_greedy_identical_everywhere(tiny, cpu_models):
    runs = {}
    for fid, path in tiny.items():
        runs[(fid, "cpu")] = cpu_models[fid].generate(PROMPT, max_new_tokens=24, stop_ids=[]).tokens
        with load(path, backend="numpy") as m:
            runs[(fid, "numpy")] = m.generate(PROMPT, max_new_tokens=24, stop_ids=[]).tokens
    first = runs[("i2_s", "numpy")]
    assert len(first) == 24
    assert all(t == first for t in runs.values()), runs


# -- kernels, per matrix ---------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", list(KERNEL_BUILDS))
def test_kernels_match_numpy_with_shared_input(tiny, kernel):
    from bitformat.runtime.cpu.backend import CpuBackend
    from bitformat.runtime.numpy_backend import NumpyBackend

    if kernel not in builds_here():
        pytest.skip(f"this CPU does not run the {kernel} kernel build")
    rng = np.random.default_rng(0)
    for fid, path in tiny.items():
        with open_model(path) as c:
            cpu, ref = CpuBackend(c, kernel=kernel, decode="fused"), NumpyBackend(c)
            for name in ("blk.0.attn_k.weight", "blk.1.ffn_down.weight", "blk.1.ffn_up.weight"):
                cols = c.entry(name).shape[1]
                qa = quantize_activations(rng.standard_normal((3, cols)).astype(np.float32))
                got, want = cpu.bitlinear(qa, cpu.weight(name)), ref.bitlinear(
                    qa, ref.weight(name))
                # one arithmetic for every container (docs/model.md §2): the same bits
                np.testing.assert_array_equal(got, want, err_msg=f"{fid} {name}")
            h = rng.standard_normal((2, cpu.dim)).astype(np.float32)
            assert rel_err(cpu.lm_head(h), ref.lm_head(h)) < 1e-5


@pytest.mark.parametrize("kernel", list(KERNEL_BUILDS))
@pytest.mark.parametrize("fid,shape", [("i2_s", (5, 384)), ("i2_s", (9, 1024)),
                                       ("i2_s_arm64", (3, 320)), ("stfma", (7, 100)),
                                       ("stfma", (10, 640)),
                                       ("colpack_u32", (3, 200)), ("tq2_0", (4, 768)),
                                       ("tq1_0", (3, 512))])
def test_kernel_tails_and_padding(fid, shape, kernel):
    """Rows with a partial 64-byte chunk or u32 padding, against exact integer sums."""
    from bitformat.formats import get_format
    from bitformat.runtime.cpu import kernels as K
    from bitformat.ternary import TernaryTensor

    if kernel not in builds_here():
        pytest.skip(f"this CPU does not run the {kernel} kernel build")
    rng = np.random.default_rng(1)
    rows, cols = shape
    trits = rng.integers(-1, 2, shape).astype(np.int8)
    q = rng.integers(-128, 128, (2, cols)).astype(np.int8)
    s = np.float32([1.5, 0.25])
    if fid == "i2_s_arm64":
        from bitformat.formats.i2_s import I2S

        fmt, fid, layout = I2S("arm64"), "i2_s", "arm64"
    else:
        fmt, layout = get_format(fid), "x86"
    if fmt.scale_block:
        d = rng.uniform(0.5, 2, (rows, cols // 256)).astype(np.float16).astype(np.float32)
        t = TernaryTensor(trits, d, 256)
    else:
        t = TernaryTensor(trits, np.float32([1.25]))
    raw = fmt.encode(t).view(np.uint8)
    raw.setflags(write=False)  # as memory-mapped files are: the same compiled specialisation
    out = np.zeros((2, rows), np.float32)
    if fid in ("tq2_0", "tq1_0"):
        W, bs = raw.reshape(rows, -1), K.block_sums(q)
        if fid == "tq1_0" and kernel != "vnni":  # these builds repack it (costs.REPACKED)
            fid, W = "tq2_0", get_format("tq2_0").encode(t).view(np.uint8).reshape(rows, -1)
        if fid == "tq2_0":
            getattr(K, f"tq2_{kernel}")(W, K.slot_activations(q, "x86", cols), bs, s, out)
        else:
            getattr(K, f"tq1_{kernel}")(W, q, bs, s, out)
        # one arithmetic (docs/model.md §2): the block sum exact, rounded once, then / s
        acc = (t.dense(np.float64) @ q.T.astype(np.float64)).T
        np.testing.assert_array_equal(out, acc.astype(np.float32) / s[:, None])
        return
    if fid == "i2_s":
        W, kind = raw[: rows * cols // 4].reshape(rows, -1), K.KIND_I2S
    else:
        W, layout = raw.reshape(rows, -1), "plain"
        kind = K.KIND_LOW if fid == "stfma" else K.KIND_COLPACK
    corr = (np.zeros(2, np.int32) if kind == K.KIND_COLPACK else q.sum(1, dtype=np.int32))
    ws = rng.uniform(0.5, 2, rows).astype(np.float32)  # per-row scales (stacked matrices)
    xg = K.slot_activations(q, layout, W.shape[1] * 4)
    exact = (trits.astype(np.int64) @ q.T.astype(np.int64)).T
    want = exact.astype(np.float32) * ws / s[:, None]
    kernels = {"vnni": [K.mm2_vnni, K.mm2_vnni_prompt], "avx2": [K.mm2_avx2],
               "portable": [K.mm2_portable]}[kernel]
    for kern in kernels:  # the prompt kernel: 4 rows a pass, leftover rows one at a time
        out[:] = np.nan
        kern(W, xg, corr, s, ws, kind, out)
        np.testing.assert_array_equal(out, want, err_msg=kern.__name__)


@pytest.mark.parametrize("kernel", list(KERNEL_BUILDS))
@pytest.mark.parametrize("cols", [64, 128, 192, 256, 448, 2560])
def test_iq1_bn_kernels_every_block_count(cols, kernel):
    """iq1_bn rows of 1 to 40 blocks: the avx2 kernel's block pairs and the scalar blocks
    left at each row's end (its 16-byte loads would pass the row) against exact sums."""
    from bitformat.formats import get_format
    from bitformat.runtime.cpu import kernels as K
    from bitformat.ternary import TernaryTensor

    if kernel not in builds_here():
        pytest.skip(f"this CPU does not run the {kernel} kernel build")
    if kernel == "portable":
        pytest.skip("the portable build repacks iq1_bn into iq2_bn rows (costs.REPACKED)")
    rng = np.random.default_rng(cols)
    rows = 5
    trits = rng.integers(-1, 2, (rows, cols)).astype(np.int8)
    fmt = get_format("iq1_bn")
    t, _ = fmt.prepare(TernaryTensor(trits, np.float32([0.75])))
    W = fmt.encode(t).view(np.uint8).reshape(rows, -1)
    W.setflags(write=False)
    q = rng.integers(-128, 128, (3, cols)).astype(np.int8)
    s = np.float32([1.5, 0.25, 3.0])
    ws = np.full(rows, 0.75, np.float32)
    corr = q.sum(1, dtype=np.int32)
    out = np.full((3, rows), np.nan, np.float32)
    x1 = K.iq1_activations(q)  # the avx2 kernel, which the vnni build runs too
    assert x1.shape == (3, 5, cols // 4)
    K.iq1bn_avx2(W, x1, q, corr, s, ws, out)
    exact = (trits.astype(np.int64) @ q.T.astype(np.int64)).T
    np.testing.assert_array_equal(out, exact.astype(np.float32) * ws / s[:, None])


@pytest.mark.parametrize("kernel", list(KERNEL_BUILDS))
@pytest.mark.parametrize("gtype", ["F32", "F16", "BF16"])
def test_lm_head_kernels(gtype, kernel):
    from bitformat.runtime.cpu import head as H

    if kernel not in builds_here():
        pytest.skip(f"this CPU does not run the {kernel} kernel build")
    rng = np.random.default_rng(2)
    E = rng.standard_normal((300, 96)).astype(np.float32)
    x = rng.standard_normal((2, 96)).astype(np.float32)
    out = np.empty((2, 300), np.float32)
    if gtype == "F32":
        E.setflags(write=False)  # read-only like the memory map
        H.lm_head_f32(E, x, out)
    else:
        bits = (E.astype(np.float16).view(np.uint16) if gtype == "F16"
                else (E.view(np.uint32) >> 16).astype(np.uint16))
        bits.setflags(write=False)
        E = H.lut16(gtype)[bits]
        if kernel != "vnni":  # the avx2 build runs the portable head
            H.lm_head_lut(bits, H.lut16(gtype), x, out)
        else:
            (H.lm_head_f16 if gtype == "F16" else H.lm_head_bf16)(bits, x, out)
    assert rel_err(out, x.astype(np.float64) @ E.T.astype(np.float64)) < 1e-5


def test_kernel_mode_env(monkeypatch):
    from bitformat.runtime.cpu import kernels as K

    monkeypatch.setenv(K.ENV_VAR, "portable")
    assert K.kernel_mode() == "portable"
    monkeypatch.setenv(K.ENV_VAR, "fastest")
    with pytest.raises(UnsupportedConversionError, match="auto, vnni, avx2, portable"):
        K.kernel_mode()
    for build in K.KERNEL_BUILDS:
        monkeypatch.setenv(K.ENV_VAR, build)
        if build in K.builds_here():
            assert K.kernel_mode() == build
        else:
            with pytest.raises(UnsupportedConversionError, match="lacks one of"):
                K.kernel_mode()
    monkeypatch.setenv(K.ENV_VAR, "auto")
    assert K.kernel_mode() == K.builds_here()[0]


# -- generation API --------------------------------------------------------------------------------
def test_stream_pieces_join_to_generate_text(cpu_models):
    m = cpu_models["i2_s"]
    pieces = list(m.stream_generate("def main():", max_new_tokens=12, stop_ids=[]))
    assert pieces[-1].finish_reason == "length"
    res = m.generate("def main():", max_new_tokens=12, stop_ids=[])
    assert "".join(p.text for p in pieces) == res.text == m.tokenizer.decode(res.tokens)
    assert len(res.tokens) == 12 and res.stats.prompt_tokens == len(m.encode("def main():"))
    assert res.stats.generation_tps > 0 and res.stats.prompt_tps > 0
    assert res.stats.weight_bytes_per_token == sum(e.nbytes for e in m.container_model.entries)


def test_stops_at_stop_token(cpu_models):
    m = cpu_models["i2_s"]
    first = m.generate(PROMPT, max_new_tokens=1, stop_ids=[]).tokens[0]
    res = m.generate(PROMPT, max_new_tokens=10, stop_ids=[first])
    assert res.finish_reason == "stop" and res.tokens == [] and res.text == ""
    assert set(m.tokenizer.eos_ids) >= {m.tokenizer.data.eos_id}


def test_sampling_is_seeded_and_filters():
    logits = np.array([0.1, 3.0, 2.9, -1.0, 0.5])
    assert make_sampler(1.0, top_k=1)(logits) == 1
    assert make_sampler(1.0, top_p=0.01)(logits) == 1
    draws = [make_sampler(5.0, seed=7)(logits) for _ in range(3)]
    assert len(set(draws)) == 1
    many = make_sampler(5.0, top_k=2, seed=1)
    assert {many(logits) for _ in range(50)} == {1, 2}


def test_repetition_penalty_changes_choice(cpu_models):
    m = cpu_models["i2_s"]
    plain = m.generate(PROMPT, max_new_tokens=40, stop_ids=[]).tokens
    penal = m.generate(PROMPT, max_new_tokens=40, stop_ids=[], repetition_penalty=50.0).tokens
    assert len(set(plain)) < len(plain) or not set(plain).isdisjoint(PROMPT)  # it repeats
    assert len(set(penal)) == len(penal)  # nothing seen is ever picked again
    assert set(penal).isdisjoint(PROMPT) and plain != penal


def test_seeded_sampling_reproducible(cpu_models):
    m = cpu_models["tq1_0"]
    a = m.generate(PROMPT, max_new_tokens=8, temperature=0.9, top_p=0.9, seed=3, stop_ids=[])
    b = m.generate(PROMPT, max_new_tokens=8, temperature=0.9, top_p=0.9, seed=3, stop_ids=[])
    assert a.tokens == b.tokens


# -- bad requests ----------------------------------------------------------------------------------
def test_bad_requests(tiny, cpu_models):
    m = cpu_models["i2_s"]
    with pytest.raises(RequestError, match="more than the context of 256"):
        m.generate([1] * 257, max_new_tokens=4)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        m.generate([1, 512], max_new_tokens=4)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        m.logits([-1])
    with pytest.raises(RequestError, match="empty"):
        m.generate([], max_new_tokens=4)
    with pytest.raises(RequestError, match="sampling"):
        m.generate(PROMPT, temperature=-1)
    with pytest.raises(RequestError, match="unknown backend 'gpu'"):
        load(tiny["i2_s"], backend="gpu")
    with pytest.raises(RequestError, match="float64"):
        load(tiny["i2_s"], backend="cpu", dtype="float64")
    assert len(m.generate([1] * 250, max_new_tokens=50, stop_ids=[]).tokens) == 6  # context left


def test_model_args_sources(tiny):
    with open_model(tiny["i2_s"]) as c:
        meta = {k: v.plain() for k, v in c.metadata.items()}
    a = ModelArgs.from_metadata(meta)
    assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.hidden_dim, a.vocab_size,
            a.head_dim, a.context_length) == (256, 2, 4, 2, 512, 512, 64, 256)
    hf = ModelArgs.from_hf_config({
        "hidden_size": 2560, "num_hidden_layers": 30, "num_attention_heads": 20,
        "num_key_value_heads": 5, "intermediate_size": 6912, "vocab_size": 128256,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096})
    assert (hf.head_dim, hf.n_kv_heads, hf.rope_theta) == (128, 5, 500000.0)
    with pytest.raises(UnsupportedConversionError, match="architecture 'gpt2'"):
        ModelArgs.from_metadata({**meta, "general.architecture": "gpt2"})


# -- other sources: HF folders, upstream's "bitnet" architecture -----------------------------
def test_hf_folder_runs_like_its_gguf(tiny, cpu_models, tmp_path):
    convert(tiny["i2_s"], tmp_path / "hf", "hf")
    with load(tmp_path / "hf", backend="cpu") as m:
        assert m.container == "hf"
        assert rel_err(m.logits(PROMPT), cpu_models["i2_s"].logits(PROMPT)) < 1e-5


def rewrite(src, dst, *, arch: str | None = None, add: dict | None = None, patch=None,
            meta: dict | None = None):
    """Copy a GGUF, renaming its architecture keys, adding F32 tensors, patching raw bytes."""
    from bitformat.constants import GGMLType
    from bitformat.io.gguf import GGUFWriter, MetaValue

    with open_model(src) as m:
        old = m.architecture
        extra = meta
        meta = {(k.replace(old, arch, 1) if arch and k.startswith(old + ".") else k): v
                for k, v in m.metadata.items()}
        if arch:
            meta["general.architecture"] = MetaValue.of(arch)
        meta.update({k: MetaValue.of(v) for k, v in (extra or {}).items()})
        w = GGUFWriter(str(dst), metadata=meta)
        blobs = []
        for e in m.entries:
            gtype, raw = m.plain(e.name)
            w.add_tensor(e.name, e.shape, gtype, e.nbytes)
            blobs.append(patch(e.name, raw.copy()) if patch else raw)
        for name, value in (add or {}).items():
            w.add_tensor(name, (1,), GGMLType.F32)
            blobs.append(np.float32([value]))
        w.write(iter(blobs))
    return dst


def test_upstream_bitnet_arch_with_scale_tensors(tiny, cpu_models, tmp_path):
    """Upstream llama.cpp's ``bitnet`` names, with a ``.scale`` tensor multiplying one output,
    runs like the same model with that factor folded into the i2_s scale."""
    name, n = "blk.0.ffn_down.weight", 256 * 512 // 4

    def double(tensor, raw):
        if tensor == name:
            raw[n: n + 4] = np.frombuffer((raw[n: n + 4].view("<f4") * 2).tobytes(), np.uint8)
        return raw

    a = rewrite(tiny["i2_s"], tmp_path / "a.gguf", arch="bitnet",
                add={"blk.0.ffn_down.scale": 2.0}, meta={"bitnet.hidden_activation": "relu2"})
    b = rewrite(tiny["i2_s"], tmp_path / "b.gguf", patch=double)
    with load(a, backend="cpu") as ma, load(b, backend="cpu") as mb:
        assert ma.args.arch == "bitnet"
        la, lb = ma.logits(PROMPT), mb.logits(PROMPT)
    assert rel_err(la, lb) < 1e-5 and rel_err(la, cpu_models["i2_s"].logits(PROMPT)) > 1e-3


def test_thread_picker_follows_the_faster_setting():
    from bitformat.runtime.cpu.backend import ThreadPicker

    p = ThreadPicker(2)
    for n, rate in ((2, 10e9), (1, 6e9)):  # both are tried first, the first call not counted
        assert [p.pick(), p.pick()] == [n, n]
        p.record(n, 0.1e9)
        p.record(n, rate)
    e = p.EXPLORE
    picks = [p.pick() for _ in range(2 * e)]
    assert picks.count(1) == 2 and picks.count(2) == 2 * e - 2  # explores every EXPLORE-th call
    p.record(2, 1e9)  # one call that lost its core: not enough to switch
    assert [p.pick() for _ in range(e)].count(1) == 1  # only the periodic look
    for _ in range(10):
        p.record(2, 1e9)  # the other cores got busy
    picks = [p.pick() for _ in range(8 * e)]
    # tried again 2, 4, 8, ... calls after the switch (seen at its first call), then (far
    # slower) at every 4 * EXPLORE-th call only
    again = [i + 1 for i, n in enumerate(picks) if n == 2]
    assert again[:5] == [3, 7, 15, 31, 63] and len(again) <= 12
    assert [p.pick() for _ in range(8 * e)].count(2) == 2


def test_thread_picker_recovers_from_a_noisy_switch():
    """Two slow calls of the faster setting make the picker switch; the setting it left is
    tried again 2, then 4 calls later and wins back once its median is clean (5 calls at the
    slower setting), instead of a whole EXPLORE period later."""
    from bitformat.runtime.cpu.backend import ThreadPicker

    true = {2: 20e9, 1: 13e9}  # bytes/s of each setting on a quiet machine
    p = ThreadPicker(2)
    for _ in range(6):
        n = p.pick()
        p.record(n, true[n])
    noisy = iter([5e9, 5e9])  # two unlucky calls of the 2-thread setting
    picks = []
    for _ in range(40):
        n = p.pick()
        picks.append(n)
        p.record(n, next(noisy, true[n]) if n == 2 else true[n])
    # slow, slow: switch; 2 calls later a look (its median is still slow), 4 later another: back
    assert picks == [2, 2, 1, 1, 2, 1, 1, 1] + [2] * 32


# -- rans: streams decoded inside the mat-vec (decode="fused"; "load": test_rans_runtime.py) -----
def _rans_exact(w, trits, q, s):
    """What every cpu kernel must give: exact int sums, then ``* scale / s`` in float32."""
    exact = (q.astype(np.int64) @ trits.T.astype(np.int64)).astype(np.float32)
    return exact * np.float32(w.scale) / s[:, None]


@pytest.mark.parametrize("kernel", list(KERNEL_BUILDS))
def test_rans_cpu_holds_only_container_words(tiny, kernel):
    """The backend keeps a view of the tensor's words plus index arrays a fraction of its size
    (no int8 trits), and every mat-vec matches the numpy backend exactly, for 1 token (a dot
    table per token), 3 (one decode per token) and 6 (one decode, row buffer)."""
    from bitformat.codecs import rans_decode as RD
    from bitformat.runtime.cpu.backend import CpuBackend
    from bitformat.runtime.numpy_backend import NumpyBackend

    if kernel not in builds_here():
        pytest.skip(f"this CPU does not run the {kernel} kernel build")
    rng = np.random.default_rng(5)
    with open_model(tiny["rans"]) as c:
        cpu, ref = CpuBackend(c, kernel=kernel, decode="fused"), NumpyBackend(c)
        for e in (e for e in c.entries if e.ternary):
            w = cpu.weight(e.name)
            assert isinstance(w, RD.RansWeight)
            assert np.shares_memory(w.data, c.plain(e.name)[1]) and w.data.nbytes == e.nbytes
            arrays = [v for v in vars(w).values() if isinstance(v, np.ndarray)]
            assert not any(a.dtype == np.int8 for a in arrays)
            own = sum(a.nbytes for a in arrays if not np.shares_memory(a, w.data))
            # at most 16 decode tables of 16 KB, then a few bytes per row and live column
            assert own < 16 * 4096 * 4 + e.shape[0] * 13 + e.shape[1] * 8 + 64
            for t in (1, 3, 6):
                qa = quantize_activations(rng.standard_normal((t, e.shape[1])).astype(np.float32))
                np.testing.assert_array_equal(cpu.bitlinear(qa, w),
                                              ref.bitlinear(qa, ref.weight(e.name)))


@pytest.mark.parametrize("mode", ["group5", "trit"])
@pytest.mark.parametrize("shape,min_stream", [((37, 300), 64), ((90, 23), 64), ((9, 1000), 4096),
                                              ((70, 2560), 4096), ((3, 5), 5)])
def test_rans_kernels_geometries(shape, min_stream, mode):
    """Pieces per row (p > 1), several rows per stream, lock-step blocks and their leftovers,
    dead rows and columns, single-trit symbols: exact against integer sums."""
    from bitformat.codecs import rans_decode as RD
    from bitformat.formats.rans import Rans
    from bitformat.runtime.cpu import rans as KR
    from bitformat.ternary import TernaryTensor

    rng = np.random.default_rng(sum(shape))
    rows, cols = shape
    trits = rng.choice(np.int8([-1, 0, 1]), shape, p=[0.3, 0.4, 0.3])
    trits[rng.random(rows) < 0.2] = 0  # dead rows
    trits[:, rng.random(cols) < 0.2] = 0  # dead columns
    raw = Rans(mode, min_stream=min_stream).encode(TernaryTensor(trits, np.float32([0.75])))
    w = RD.rans_weight(raw, rows, cols, 0.75, "m", {})
    for t in (1, 7):
        q = rng.integers(-128, 128, (t, cols)).astype(np.int8)
        s = rng.uniform(0.5, 2, t).astype(np.float32)
        out = np.zeros((t, rows), np.float32)
        args = (w.data, w.word_off, w.lrows, w.k, w.p, w.m0, w.cls, w.dec)
        if t == 1:
            tab = KR.token_table(w, q[0], np.empty(243 * w.n_sym, np.int16))
            KR.rans_mv(*args, tab, s, w.scale, out)
        else:
            KR.rans_mm(*args, RD.symbol_digits(w.group), KR.live_activations(q, w), s, w.scale,
                       out)
        np.testing.assert_array_equal(out, _rans_exact(w, trits, q, s), err_msg=f"{t} tokens")


def test_rans_corrupt_stream_fails_at_load(tiny, tmp_path):
    """validate (the default) runs the format's reader once: a flipped stream word fails at
    load; without it the kernels still stay inside the tensor."""
    from bitformat.errors import FormatError
    from bitformat.io.gguf import GGUFReader
    from bitformat.runtime.cpu.backend import CpuBackend

    name = "blk.0.ffn_up.weight"
    with GGUFReader(tiny["rans"]) as r:
        at = r.data_offset + r.tensors[name].offset + r.tensors[name].nbytes - 8
    data = bytearray(tiny["rans"].read_bytes())
    data[at] ^= 0x40  # inside the last stream's words
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with open_model(bad) as c:
        for decode in ("fused", "load"):
            with pytest.raises(FormatError, match="checksum|corrupt"):
                CpuBackend(c, decode=decode).weight(name)
        w = CpuBackend(c, validate=False, decode="fused").weight(name)
        qa = quantize_activations(np.ones((1, w.cols), np.float32))
        assert CpuBackend(c, validate=False, decode="fused").bitlinear(qa, w).shape == (
            1, w.rows)


@pytest.mark.parametrize("decode", ["load", "fused"])
def test_rans_greedy_with_portable_env(tiny, cpu_models, monkeypatch, decode):
    """BITFORMAT_CPU_KERNEL=portable: the rans model decodes the same tokens."""
    from bitformat.runtime.cpu import kernels as K

    monkeypatch.setenv(K.ENV_VAR, "portable")
    with load(tiny["rans"], backend="cpu", decode=decode) as m:
        assert m.backend.kernel == "portable"
        got = m.generate(PROMPT, max_new_tokens=12, stop_ids=[]).tokens
    assert got == cpu_models["i2_s"].generate(PROMPT, max_new_tokens=12, stop_ids=[]).tokens


def test_lm_head_copy_is_resident_and_equal(tiny):
    """The LM head reads an anonymous copy of the embedding (huge pages where the OS gives
    them), equal to the container's bytes; the file pages are released from the mapping."""
    from bitformat.runtime.cpu.backend import CpuBackend, resident_copy
    from bitformat.runtime.numpy_backend import NumpyBackend

    with open_model(tiny["i2_s"]) as c:
        raw = c.plain("token_embd.weight")[1]
        be = CpuBackend(c)
        assert not np.shares_memory(be._embed_raw, raw)
        np.testing.assert_array_equal(be._embed_raw.reshape(-1), raw)
        np.testing.assert_array_equal(resident_copy(raw, chunk=4096 + 17), raw)
        ids = np.array([3, 1])
        np.testing.assert_array_equal(be.embed(ids), NumpyBackend(c).embed(ids))


def test_head_auto_is_full_on_a_gpu_and_screened_elsewhere():
    """--head auto (the default): the full head on the wgpu backend with a real GPU, where the
    screen's round trips to the host cost more than its bytes save; screened on the cpu and
    numpy backends and on CPU adapters (lavapipe). Explicit modes pass through."""
    from types import SimpleNamespace

    from bitformat.runtime.loader import resolve_head

    gpu = SimpleNamespace(name="wgpu", dev=SimpleNamespace(is_cpu=False))
    lavapipe = SimpleNamespace(name="wgpu", dev=SimpleNamespace(is_cpu=True))
    cpu = SimpleNamespace(name="cpu")
    assert resolve_head("auto", gpu) == "full"
    assert resolve_head("auto", lavapipe) == "screened"
    assert resolve_head("auto", cpu) == "screened"
    assert resolve_head("screened", gpu) == "screened"
    assert resolve_head("full", cpu) == "full"
