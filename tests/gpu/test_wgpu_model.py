"""The whole tiny model on the wgpu backend, in every container, against the numpy backend.

Int8 rounding boundaries: the GPU normalizes with another summation order and attends one
token at a time (numpy: the prompt as a batch), so an activation can land on the other side of
a ``.5`` when quantized, and one int8 step moves the logits far more than float noise. Rather
than loosen the tolerance, the GPU run is traced (``WgpuBitNet.trace``: every quantization's
``y``, ``q`` and ``s``) and the numpy run is fed the GPU's quantized activations, after checking
at each call that the two runs' ``x * s`` agree to ``NOISE`` int8 steps and that every ``q``
that differs is a boundary flip (one step, the ``.5`` between the two ``x * s``). With the same
quantized inputs the logits must then agree to 1e-5; without the substitution, to 1e-3 when
no flip occurred.
"""

from __future__ import annotations

import numpy as np
import pytest

from bitformat.container import open_model
from bitformat.errors import RequestError
from bitformat.formats import FORMAT_IDS
from bitformat.runtime import generate_step
from bitformat.runtime.backend import QuantizedActivations, quantize_activations
from bitformat.runtime.models import ModelArgs, Transformer
from bitformat.runtime.models import base as model_mod
from bitformat.runtime.numpy_backend import NumpyBackend
from bitformat.runtime.wgpu.backend import WgpuBackend
from bitformat.runtime.wgpu.network import WgpuBitNet

PROMPT = [5, 17, 300, 42, 7, 99, 480, 1, 250, 33, 64, 128]
#: every container, and rans twice: decoded at load into stfma rows (the default) and in the
#: kernels ("rans:fused")
VARIANTS = [*FORMAT_IDS, "rans:fused"]
NOISE = 0.05  # int8 steps between the two runs' x * s (batch vs token-by-token attention)


def args_of(container) -> ModelArgs:
    return ModelArgs.from_metadata({k: v.plain() for k, v in container.metadata.items()})


def tuned_net(c, gpu, **tuning) -> WgpuBitNet:
    """A network over container ``c`` built with these ``GpuDevice.tuning`` keys (its batched
    prompt too), the device's tuning restored after."""
    saved = dict(gpu.tuning)
    gpu.tuning.update(tuning)
    try:
        net = WgpuBitNet(args_of(c), WgpuBackend(c, device=gpu))
        net._batched(2)  # the batched prompt is built on first use: build it now
        return net
    finally:
        gpu.tuning.clear()
        gpu.tuning.update(saved)


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def nets(tiny_all, gpu):
    """format id -> (container, WgpuBitNet) on the session's device."""
    out = {}
    for key in VARIANTS:
        fid, _, decode = key.partition(":")
        c = open_model(tiny_all[fid])
        out[key] = (c, WgpuBitNet(args_of(c), WgpuBackend(c, device=gpu,
                                                          decode=decode or "load")))
    yield out
    for c, _ in out.values():
        c.close()


class GpuQuant:
    """The model's ``activation_hook``: checks, then returns the GPU's."""

    def __init__(self, monkeypatch, log):
        self.log, self.n, self.flips = log, 0, 0
        monkeypatch.setattr(model_mod, "activation_hook", self)

    def __call__(self, x: np.ndarray) -> QuantizedActivations:
        mine = quantize_activations(x)
        gpu = [step[self.n] for step in self.log]  # this call, every token of the prompt
        self.n += 1
        q = np.stack([e.q for e in gpu])
        s = np.array([e.s for e in gpu], np.float32)
        y = np.stack([e.y for e in gpu]).astype(np.float64)
        ours, theirs = x.astype(np.float64) * mine.s[:, None], y * s[:, None]
        gap = float(np.abs(ours - theirs).max())
        assert gap < NOISE, f"call {self.n - 1}: runs differ by {gap} int8 steps before rounding"
        diff = mine.q != q
        if diff.any():
            half = np.minimum(mine.q, q).astype(np.float64) + 0.5
            # a boundary flip: the .5 lies between the two x * s, or the GPU's x * s is
            # that .5 to float32 precision (its f32 product rounds onto it; ours is f64 here)
            at_half = np.abs(theirs - half) <= 4e-7 * np.abs(half)
            flip = ((np.abs(mine.q.astype(int) - q) == 1)
                    & (((ours - half) * (theirs - half) <= 0) | at_half))[diff]
            assert flip.all(), (f"call {self.n - 1}: int8 activations differ away from a "
                                f"rounding boundary: {ours[diff][~flip][:4]} vs "
                                f"{theirs[diff][~flip][:4]}")
            self.flips += int(diff.sum())
        return QuantizedActivations(q, s.astype(x.dtype))


@pytest.mark.parametrize("fid", VARIANTS)
def test_logits_match_numpy(nets, fid, monkeypatch):
    c, net = nets[fid]
    net.trace, net.trace_log = True, []
    try:
        got = net.forward(PROMPT, net.new_cache(len(PROMPT)), all_logits=True)
    finally:
        net.trace = False
    assert got.shape == (len(PROMPT), net.args.vocab_size) and np.isfinite(got).all()
    assert len(net.trace_log) == len(PROMPT)
    ref = Transformer(net.args, NumpyBackend(c))
    plain = ref.forward(PROMPT, ref.new_cache(len(PROMPT)), all_logits=True)
    shared = GpuQuant(monkeypatch, net.trace_log)
    want = ref.forward(PROMPT, ref.new_cache(len(PROMPT)), all_logits=True)
    assert shared.n == 4 * net.args.n_layers
    assert rel_err(got, want) < 1e-5, f"{fid}: with the GPU's int8 activations"
    if shared.flips == 0:
        assert rel_err(got, plain) < 1e-3, fid


@pytest.mark.parametrize("fid", VARIANTS)
def test_greedy_identical(nets, fid):
    c, net = nets[fid]
    ref = Transformer(net.args, NumpyBackend(c))
    want = list(generate_step(ref, PROMPT, max_new_tokens=24))
    assert net.generate_greedy(PROMPT, 24) == want  # argmax on the GPU, 4 bytes a token
    assert list(generate_step(net, PROMPT, max_new_tokens=8)) == want[:8]


def test_split_bindings_and_lanes_give_the_same_logits(tiny_all, nets, devices):
    """Embedding and FFN matrices cut into several bindings, and 16 lanes per row."""
    c, net = nets["i2_s"]
    want = net.forward(PROMPT, net.new_cache(len(PROMPT)))
    small = WgpuBackend(c, device=devices(1, None, 40000), context=64)
    assert len(small.embedding.chunks) == 7
    net2 = WgpuBitNet(net.args, small)
    assert len(small.pair("blk.0.ffn_gate.weight", "blk.0.ffn_up.weight").chunks) == 2
    np.testing.assert_array_equal(net2.forward(PROMPT, net2.new_cache(len(PROMPT))), want)
    for fid in ("tq1_0", "rans", "rans:fused"):
        c2, net3 = nets[fid]
        wide = WgpuBitNet(net.args, WgpuBackend(c2, device=devices(16, "storage"),
                                                decode=fid.partition(":")[2] or "load"))
        got = wide.forward(PROMPT, wide.new_cache(len(PROMPT)))
        assert rel_err(got, want) < 1e-5, fid


@pytest.mark.parametrize("fid", ["i2_s", "tq2_0", "rans", "rans:fused"])
def test_op_by_op_backend(nets, fid, gpu):
    """The Backend protocol: numpy's graph with GPU BitLinear and LM head."""
    c, _ = nets[fid]
    ref = Transformer(args_of(c), NumpyBackend(c))
    want = ref.forward(PROMPT, ref.new_cache(len(PROMPT)), all_logits=True)
    be = WgpuBackend(c, device=gpu, decode=fid.partition(":")[2] or "load")
    net = Transformer(args_of(c), be)
    assert rel_err(net.forward(PROMPT, net.new_cache(len(PROMPT)), all_logits=True), want) < 1e-5


def test_profile(nets):
    _, net = nets["tq2_0"]
    p = net.profile(length=8, repeats=1)
    kinds = p["kinds"]
    assert {"embed", "norm", "matvec:tq2_0", "attention", "lm_head", "argmax"} <= set(kinds)
    # q|k|v, o (merging attention's runs), gate|up and down, each normalizing its own input;
    # attention split over positions
    assert kinds["matvec:tq2_0"]["dispatches"] == 4 * net.args.n_layers
    assert kinds["attention"]["dispatches"] == net.args.n_layers
    assert p["dispatches"] == net.dispatches_per_token == 5 * net.args.n_layers + 4
    assert all(k["seconds"] > 0 and k["bytes"] > 0 for k in kinds.values())
    assert p["token_seconds"] > 0 and p["gpu_seconds"] > 0
    assert p["clock"] in ("gpu-timestamps", "host")
    assert (p["pass_seconds"] or 0) > 0 or p["clock"] == "host"
    with pytest.raises(RequestError, match="another sequence"):
        cache = net.new_cache(16)
        cache.length = 3  # a sequence the profile has overwritten
        net.forward([1], cache)


def test_bad_requests(nets):
    _, net = nets["stfma"]
    with pytest.raises(RequestError, match="outside the vocabulary"):
        net.forward([1, net.args.vocab_size], net.new_cache(4))
    with pytest.raises(RequestError, match="exceed the context"):
        net.forward([1] * 5, net.new_cache(4))
    with pytest.raises(RequestError, match="this GPU KV cache holds"):
        net.new_cache(net.max_len + 1)
    a = net.new_cache(8)
    net.forward([1, 2], a)
    b = net.new_cache(8)
    net.forward([3], b)  # a fresh sequence may start any time ...
    with pytest.raises(RequestError, match="another sequence"):
        net.forward([4], a)  # ... but the old one's cache is gone


def test_loader_registration(tiny_all, adapter, monkeypatch):
    from bitformat.runtime import loader

    if "wgpu" not in loader.BACKENDS:
        pytest.skip("bitformat.runtime.loader does not list the wgpu backend yet")
    with loader.load(tiny_all["tq1_0"], backend="numpy") as ref:
        want = ref.generate(PROMPT, max_new_tokens=12, stop_ids=[]).tokens
    with loader.load(tiny_all["tq1_0"], backend="wgpu") as m:
        assert type(m.net).__name__ == "WgpuBitNet"
        assert m.generate(PROMPT, max_new_tokens=12, stop_ids=[]).tokens == want
        monkeypatch.setattr(m.net, "forward", None)  # greedy takes the GPU argmax: no logits
        assert m.generate(PROMPT, max_new_tokens=12, stop_ids=[]).tokens == want


# -- the fused network: every family, batched prompts, the step in flight, long contexts ------
@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    from bitformat.synth import synth

    d = tmp_path_factory.mktemp("families")
    return {p: synth(p, d / f"{p}.gguf") for p in ("tiny-1bitllm", "tiny-llama", "tiny-qwen3")}


@pytest.mark.parametrize("preset", ["tiny-1bitllm", "tiny-llama", "tiny-qwen3"])
def test_every_family_runs_the_fused_step(family_models, preset, gpu, monkeypatch):
    """1bitLLM (SiLU, no GQA), Llama (no sub-norms, permuted q/k rows, untied head) and Qwen3
    (q/k norms) through the same 6 dispatches a layer: logits with the GPU's int8 activations
    to 1e-5, greedy tokens identical, and the loader picks the fused network."""
    from bitformat.runtime import load
    from bitformat.runtime.models import model_class

    path = family_models[preset]
    c = open_model(path)
    try:
        args = args_of(c)
        net = WgpuBitNet(args, WgpuBackend(c, device=gpu))
        assert net.dispatches_per_token == 5 * args.n_layers + 4
        ref = model_class(args)(args, NumpyBackend(c))
        want = list(generate_step(ref, PROMPT, max_new_tokens=16))
        assert net.generate_greedy(PROMPT, 16) == want
        net.trace, net.trace_log = True, []
        got = net.forward(PROMPT, net.new_cache(len(PROMPT)), all_logits=True)
        net.trace = False
        shared = GpuQuant(monkeypatch, net.trace_log)
        with_gpu_q = ref.forward(PROMPT, ref.new_cache(len(PROMPT)), all_logits=True)
        assert shared.n == 4 * args.n_layers
        assert rel_err(got, with_gpu_q) < 1e-5, preset
    finally:
        c.close()
    with load(path, backend="wgpu") as m:
        assert type(m.net) is WgpuBitNet


def test_batched_prompt_equals_token_by_token(nets, gpu, tiny_all):
    """A prompt runs as batched chunks (here of 8 tokens: 5 chunks, the last partial) with
    the same logits as one token at a time, and greedy decoding continues from it."""
    c, _ = nets["i2_s"]
    be = WgpuBackend(c, device=gpu)
    net = WgpuBitNet(args_of(c), be)
    net2 = tuned_net(c, gpu, batch=8)
    prompt = [(7 * i + 3) % net.args.vocab_size for i in range(37)]
    steps = net2.host_steps
    batched = net2.forward(prompt, net2.new_cache(len(prompt)))
    assert net2.host_steps - steps == 5  # ceil(37 / 8) command buffers
    one_by_one = net.forward(prompt, net.new_cache(len(prompt)), all_logits=True)[-1:]
    assert rel_err(batched, one_by_one) < 1e-5
    ref = Transformer(net.args, NumpyBackend(c))
    assert net2.generate_greedy(prompt, 12) == list(generate_step(ref, prompt,
                                                                  max_new_tokens=12))


@pytest.mark.parametrize("tpw", [8, 3])
def test_batched_i2s_prompt_reads_each_weight_once_per_token_group(nets, gpu, tpw):
    """i2_s projections of a batched prompt run as mat-mats (matmat_i2_s.wgsl, ``tpw`` tokens
    a workgroup, the last group partial) with the bits of the per-token fused mat-vecs
    (``tpw=0``)."""
    c, _ = nets["i2_s"]
    nets_by = {t: tuned_net(c, gpu, batch=16, tpw=t) for t in (tpw, 0)}
    prompt = [(13 * i + 7) % nets_by[0].args.vocab_size for i in range(29)]  # 16 + 13
    got = nets_by[tpw].forward(prompt, nets_by[tpw].new_cache(len(prompt)))
    want = nets_by[0].forward(prompt, nets_by[0].new_cache(len(prompt)))
    np.testing.assert_array_equal(got, want)
    kernels = {d.kernel.stem for d, _ in nets_by[tpw]._batch.items}
    assert "matmat_i2_s" in kernels and "matmat_i2_s" not in {
        d.kernel.stem for d, _ in nets_by[0]._batch.items}


def test_the_step_in_flight_is_dropped_when_the_caller_goes_elsewhere(nets):
    """greedy() submits the step after each token before returning it; a call with another
    token (a sampled one), another cache, or logits instead, must not see that step."""
    c, net = nets["stfma"]
    ref = Transformer(net.args, NumpyBackend(c))
    cache = net.new_cache(40)
    seq = list(PROMPT)
    t = net.greedy(seq, cache)
    seq.append(t)
    t = net.greedy([t], cache)  # collected from the step in flight
    other = (t + 1) % net.args.vocab_size  # as if sampled: not the device's argmax
    seq.append(other)
    got = net.greedy([other], cache)
    want = int(np.argmax(ref.forward(seq, ref.new_cache(len(seq)))[-1]))
    assert got == want
    seq.append(got)
    logits = net.forward([got], cache)[-1]  # logits while a step is in flight
    np.testing.assert_allclose(logits, ref.forward(seq, ref.new_cache(len(seq)))[-1],
                               rtol=1e-4, atol=1e-4 * np.abs(logits).max())
    fresh = net.new_cache(20)  # a new sequence while one is in flight
    assert net.greedy(PROMPT[:5], fresh) == int(np.argmax(
        ref.forward(PROMPT[:5], ref.new_cache(5))[-1]))
    assert cache.length == len(seq)


def test_long_contexts_split_attention_into_runs(nets):
    """Past 32 positions a step's attention is split into runs (flash-decoding) and merged:
    a 230-token prompt (8 runs at the end) and its continuation give numpy's tokens."""
    from bitformat.runtime.wgpu.network import splits

    c, net = nets["i2_s"]
    assert [splits(n) for n in (1, 32, 33, 230, 1024, 8192, 8193)] == [1, 1, 2, 8, 32, 32, 33]
    prompt = [(11 * i + 5) % net.args.vocab_size for i in range(230)]
    ref = Transformer(net.args, NumpyBackend(c))
    assert net.generate_greedy(prompt, 20) == list(generate_step(ref, prompt,
                                                                 max_new_tokens=20))


def test_the_o_projection_merges_attention_runs_as_attn_merge_does(nets, gpu):
    """The decode step's o projection merges attention's runs in its prologue (no attn_merge
    dispatch); with ``fold=0`` the merge dispatch runs: the logits agree at every position of a
    prompt run token by token past several runs."""
    c, net = nets["i2_s"]
    plain = tuned_net(c, gpu, fold=0)
    assert plain.dispatches_per_token == net.dispatches_per_token + net.args.n_layers
    prompt = [(5 * i + 2) % net.args.vocab_size for i in range(100)]  # up to 4 runs
    got = net.forward(prompt, net.new_cache(len(prompt)), all_logits=True)
    want = plain.forward(prompt, plain.new_cache(len(prompt)), all_logits=True)
    assert rel_err(got, want) < 1e-6
    np.testing.assert_array_equal(got.argmax(axis=1), want.argmax(axis=1))


@pytest.mark.parametrize("tuning", [{"pre": 1, "i2_s": 2}, {"pre": 3, "i2_s": 1},
                                    {"split": 8}])
def test_tunings_give_the_same_logits(nets, gpu, tuning):
    """i2_s rows with fewer units loaded ahead than a lane has (the rest in the loop), other
    lanes per row, and attention split into shorter runs: the same logits."""
    c, net = nets["i2_s"]
    other = tuned_net(c, gpu, **tuning)
    prompt = [(3 * i + 1) % net.args.vocab_size for i in range(40)]
    got = other.forward(prompt, other.new_cache(len(prompt)), all_logits=True)
    want = net.forward(prompt, net.new_cache(len(prompt)), all_logits=True)
    if "split" in tuning:
        assert rel_err(got, want) < 1e-6
    else:
        np.testing.assert_array_equal(got, want)


def test_without_subgroups_the_model_runs_op_by_op(tiny_gguf, adapter, monkeypatch):
    from bitformat.runtime import load
    from bitformat.runtime.wgpu import device as D

    with load(tiny_gguf, backend="numpy") as ref:
        want = ref.generate(PROMPT, max_new_tokens=6, stop_ids=[]).tokens
    monkeypatch.setattr(D.GpuDevice, "_probe_subgroup",
                        lambda self: setattr(self, "subgroups", False) or 0)
    with load(tiny_gguf, backend="wgpu") as m:
        assert not m.backend.dev.subgroups and type(m.net).__name__ == "Transformer"
        assert m.generate(PROMPT, max_new_tokens=6, stop_ids=[]).tokens == want
