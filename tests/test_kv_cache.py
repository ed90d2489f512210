"""The KV cache's element type (``--kv-cache f32|f16``): float16 keys and values, rounded as
they are stored, on the numpy and cpu backends alike."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from bitformat.cli import main
from bitformat.errors import RequestError
from bitformat.runtime import load
from bitformat.runtime.models.base import KVCache, Segment

PROMPT = [5, 17, 300, 42, 7, 99, 480, 1, 250, 33, 64, 128]


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


def steps(m, tokens, kv_cache):
    """Logits of every position, one token at a time through a cache of that type."""
    m.net.kv_type = kv_cache
    try:
        cache = m.net.new_cache(len(tokens))
        out = np.concatenate([m.net.forward([t], cache) for t in tokens])
    finally:
        m.net.kv_type = "f32"
    return out, cache


def test_f16_cache_holds_rounded_values_and_half_the_bytes(tiny_gguf):
    with load(tiny_gguf, backend="numpy") as m:
        a, c32 = steps(m, PROMPT * 6, "f32")
        b, c16 = steps(m, PROMPT * 6, "f16")
    assert c16.k.dtype == np.float16 and c32.k.dtype == np.float32
    assert c16.nbytes * 2 == c32.nbytes and c16.length == c32.length == len(PROMPT) * 6
    # the same keys, rounded: the first layer's first position is computed from the same
    # inputs (after it, the rounded values feed what follows)
    np.testing.assert_array_equal(c16.k[0, 0], c32.k[0, 0].astype(np.float16))
    np.testing.assert_array_equal(c16.v[0, 0], c32.v[0, 0].astype(np.float16))
    # lossy: the logits move (on this random tiny model small changes of the int8
    # activations cascade, so how far says little; tests below compare like with like)
    assert np.isfinite(b).all() and rel_err(b, a) > 0


@pytest.mark.parametrize("length", [12, 200])
def test_f16_cache_cpu_matches_numpy(tiny_gguf, cpu_models, length):
    """The cpu kernels round keys and values as numpy does and read them back exactly: the
    cpu backend with an f16 cache stays as close to the numpy reference with an f16 cache as
    the two are with f32 caches (past 64 positions the attention runs in merged parts)."""
    tokens = (PROMPT * 20)[:length]
    with load(tiny_gguf, backend="numpy") as ref:
        want16, r16 = steps(ref, tokens, "f16")
        want32, _ = steps(ref, tokens, "f32")
    cpu = cpu_models["i2_s"]
    got16, c16 = steps(cpu, tokens, "f16")
    got32, _ = steps(cpu, tokens, "f32")
    assert rel_err(got16, want16) < max(1e-4, 3 * rel_err(got32, want32))
    assert c16.k.dtype == np.float16
    close = np.isclose(c16.k[:, :length].astype(np.float32), r16.k[:, :length], rtol=2e-3,
                       atol=2e-3)
    assert close.mean() > 0.999  # the same rounded keys, but for the last bits of a few


def test_f16_cache_greedy_tokens_cpu_equal_numpy(tiny_gguf, cpu_models):
    cpu = cpu_models["i2_s"]
    with load(tiny_gguf, backend="numpy", kv_cache="f16") as ref:
        want = ref.generate(PROMPT, max_new_tokens=24, stop_ids=[]).tokens
    cpu.net.kv_type = "f16"
    try:
        got = cpu.generate(PROMPT, max_new_tokens=24, stop_ids=[]).tokens
    finally:
        cpu.net.kv_type = "f32"
    assert got == want


def test_f16_cache_batched_step_equals_one_at_a_time(cpu_models):
    """A decode step of several requests (the server's) on f16 caches gives each request the
    hidden state it gets alone."""
    net = cpu_models["i2_s"].net
    net.kv_type = "f16"
    try:
        caches = [net.new_cache(80) for _ in range(3)]
        alone = [net.new_cache(80) for _ in range(3)]
        for i, (c, a) in enumerate(zip(caches, alone, strict=True)):
            p = PROMPT[i:] * (1 + 2 * i)
            net.forward_hidden([Segment(p, c)])
            net.forward_hidden([Segment(p, a)])
        together = net.forward_hidden([Segment([7 + i], c) for i, c in enumerate(caches)])
        each = np.concatenate([net.forward_hidden([Segment([7 + i], a)])
                               for i, a in enumerate(alone)])
    finally:
        net.kv_type = "f32"
    np.testing.assert_array_equal(together, each)
    for c, a in zip(caches, alone, strict=True):
        np.testing.assert_array_equal(c.k, a.k)


def test_kv_cache_type_refused_where_it_does_not_apply(tiny_gguf):
    with pytest.raises(RequestError, match="KV cache type must be f32 or f16"):
        load(tiny_gguf, backend="numpy", kv_cache="q4")
    with pytest.raises(RequestError, match="wgpu backend keeps its cache"):
        load(tiny_gguf, backend="wgpu", kv_cache="f16")
    with load(tiny_gguf, backend="numpy") as m, pytest.raises(RequestError, match="KV cache"):
        KVCache(m.args, 4, np.float32, "bf16")


def test_run_reports_the_cache_type_and_its_bytes(tiny_gguf):
    out = {}
    for kv in ("f32", "f16"):
        r = CliRunner().invoke(main, ["run", str(tiny_gguf), "--prompt-ids", "5,17,300,42",
                                      "-n", "6", "--backend", "numpy", "--kv-cache", kv,
                                      "--json"])
        assert r.exit_code == 0, r.output
        out[kv] = json.loads(r.output.strip().splitlines()[-1])
    assert out["f16"]["kv_cache"] == "f16" and out["f32"]["kv_cache"] == "f32"
    assert out["f16"]["kv_cache_bytes_last_token"] * 2 == out["f32"]["kv_cache_bytes_last_token"]
    assert (out["f32"]["bytes_read_per_token"] - out["f16"]["bytes_read_per_token"]
            == out["f16"]["kv_cache_bytes_last_token"])


def test_bench_times_an_f16_cache(tiny_gguf):
    r = CliRunner().invoke(main, ["bench", str(tiny_gguf), "--formats", "i2_s", "--tokens", "4",
                                  "--kv-cache", "f16", "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output[r.output.index("{"):])
    assert res["kv_cache"] == "f16"
    with load(tiny_gguf, backend="numpy") as m:
        a = m.args
    assert res["kv_bytes_per_position"] == 2 * a.n_layers * a.n_kv_heads * a.head_dim * 2
    r = CliRunner().invoke(main, ["bench", str(tiny_gguf), "--formats", "i2_s", "--backend",
                                  "wgpu", "--kv-cache", "f16"])
    assert r.exit_code == 1 and "cpu backend only" in r.output
