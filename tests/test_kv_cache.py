"""The KV cache's type (``--kv-cache f16|f32|q8_0``, runtime/kvquant.py): keys and values
rounded as they are stored, the same way on every backend, and caches that grow with use."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
from click.testing import CliRunner
from gguf import quants

from bitformat.cli import main
from bitformat.errors import RequestError
from bitformat.runtime import kvquant, load
from bitformat.runtime.cpu import ops
from bitformat.runtime.models.base import KV_BLOCK, KVCache, Segment

PROMPT = [5, 17, 300, 42, 7, 99, 480, 1, 250, 33, 64, 128]
TYPES = ("f16", "f32", "q8_0")


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


class kv_type:
    """``net.kv_type`` set for a block, then put back."""

    def __init__(self, net, kind: str):
        self.net, self.kind = net, kind

    def __enter__(self):
        self.old, self.net.kv_type = self.net.kv_type, self.kind

    def __exit__(self, *exc):
        self.net.kv_type = self.old


def steps(m, tokens, kind):
    """Logits of every position, one token at a time through a cache of type ``kind``."""
    with kv_type(m.net, kind):
        cache = m.net.new_cache(len(tokens))
        out = np.concatenate([m.net.forward([t], cache) for t in tokens])
    return out, cache


# -- the q8_0 rows: llama.cpp's blocks ------------------------------------------------------------
def test_q8_0_rows_decode_as_gguf_py_decodes_its_own_blocks():
    """gguf-py's Q8_0 quantizer (an independent implementation of ggml's reference) and ours
    give the same values; our row holds the same codes and scale bits, in its own order."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((64, 128)) * rng.uniform(0.01, 30, (64, 1))).astype(np.float32)
    x[3] = 0.0  # a zero block: scale 0, codes 0
    ours = kvquant.quantize_q8_0(x)
    assert ours.shape == (64, 128 + 8) and ours.dtype == np.int8
    theirs = quants.quantize(x, gguf.GGMLQuantizationType.Q8_0).reshape(64, 4, 34)
    np.testing.assert_array_equal(ours[:, 128:].view(np.uint16),
                                  theirs[:, :, :2].copy().view(np.uint16)[..., 0])
    codes = theirs[:, :, 2:].view(np.int8).reshape(64, 128)
    # gguf-py divides by the scale where ggml multiplies by its inverse: a code can differ by
    # one where x sits on a rounding tie in one and not the other
    diff = np.abs(ours[:, :128].astype(int) - codes)
    assert diff.max() <= 1 and (diff == 0).mean() > 0.999
    back = quants.dequantize(quants.quantize(x, gguf.GGMLQuantizationType.Q8_0),
                             gguf.GGMLQuantizationType.Q8_0)
    mine = kvquant.dequantize_q8_0(ours, 128)
    assert np.abs(mine - back).max() <= np.abs(x).max() / 127 * 1.01
    assert np.abs(mine - x).max() <= np.abs(x).max() / 127 / 2 * 1.01  # half a step at most
    assert not mine[3].any()


def test_q8_0_rounds_halves_away_from_zero_and_takes_partial_blocks():
    x = np.array([[127.0, 0.5, -0.5, 1.5, -2.5, 0.49999997, 3.0]], np.float32)  # scale 1
    row = kvquant.quantize_q8_0(x)
    assert row.shape == (1, 7 + 2)  # one partial block
    np.testing.assert_array_equal(row[0, :7], [127, 1, -1, 2, -3, 0, 3])
    assert kvquant.dequantize_q8_0(row, 7)[0, 0] == 127.0


# heads, kv heads, head size, positions: 96 is three q8_0 blocks and 70 positions two runs of
# attention; 4 query heads a kv head (2B-4T's 20 and 5) take the vector kernels, four heads
# and two positions at a time, and 71 positions leave one over; 6 a kv head leave two heads
# to the one-at-a-time path; a head size of 20 (not a multiple of 8) takes it alone
SHAPES = [(4, 2, 96, 70), (20, 5, 128, 71), (6, 1, 24, 67), (8, 2, 20, 9)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kind", TYPES)
def test_cpu_kernels_store_the_rows_numpy_stores(kind, shape):
    """``attend_one`` writes each key and value row with the bits kvquant writes (float16
    rounding, q8_0 codes and scales), and reads them back as kvquant does."""
    rng = np.random.default_rng(2)
    H, KV, d, n = shape
    width = kvquant.row_width(kind, d)
    dtype = kvquant.storage_dtype(kind)
    kc, vc = np.zeros((n, KV, width), dtype), np.zeros((n, KV, width), dtype)
    ks = (rng.standard_normal((n, KV, d)) * 3).astype(np.float32)
    vs = rng.standard_normal((n, KV, d)).astype(np.float32)
    cos, sin = np.ones(d // 2, np.float32), np.zeros(d // 2, np.float32)  # no rotation
    out = np.empty(H * d, np.float32)
    for t in range(n):
        q = rng.standard_normal((H, d)).astype(np.float32)
        ops.attend_one(q, ks[t], vs[t], cos, sin, ops.kernel_cache(kc), ops.kernel_cache(vc),
                       t, out)
    ref_k, ref_v = np.zeros_like(kc), np.zeros_like(vc)
    kvquant.store(ref_k, 0, ks)
    kvquant.store(ref_v, 0, vs)
    np.testing.assert_array_equal(kc, ref_k)
    np.testing.assert_array_equal(vc, ref_v)
    # the last query's output against numpy attention over the values kvquant reads back
    from bitformat.runtime.backend import attention

    want = attention(q[None], kvquant.load(kc, n, d), kvquant.load(vc, n, d), n - 1)[0]
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


# -- every backend, the same tokens for the same type -------------------------------------------
@pytest.mark.parametrize("kind", TYPES)
def test_cache_type_greedy_tokens_cpu_equal_numpy(tiny_gguf, cpu_models, kind):
    """Past 64 positions the cpu attention runs in merged parts."""
    prompt = PROMPT * 6
    with load(tiny_gguf, backend="numpy", kv_cache=kind) as ref:
        want = ref.generate(prompt, max_new_tokens=24, stop_ids=[]).tokens
    cpu = cpu_models["i2_s"]
    with kv_type(cpu.net, kind):
        got = cpu.generate(prompt, max_new_tokens=24, stop_ids=[]).tokens
    assert got == want


@pytest.mark.parametrize("kind", ("f16", "q8_0"))
def test_cache_type_holds_rounded_values_and_fewer_bytes(tiny_gguf, kind):
    with load(tiny_gguf, backend="numpy") as m:
        a, c32 = steps(m, PROMPT * 6, "f32")
        b, c = steps(m, PROMPT * 6, kind)
    d = m.args.head_dim
    assert c32.k.dtype == np.float32 and c.k.dtype == kvquant.storage_dtype(kind)
    assert c.nbytes * 4 == c32.nbytes * kvquant.row_bytes(kind, d) // d
    assert c.length == c32.length == len(PROMPT) * 6
    # the first layer's first position is computed from the same inputs: the same keys,
    # rounded (after it, the rounded values feed what follows)
    want = np.zeros_like(c.k[0, :1])
    kvquant.store(want, 0, c32.k[0, :1])
    np.testing.assert_array_equal(c.k[0, 0], want[0])
    assert np.isfinite(b).all() and rel_err(b, a) > 0  # lossy: the logits move


@pytest.mark.parametrize("kind", TYPES)
def test_batched_step_equals_one_at_a_time(cpu_models, kind):
    """A decode step of several requests (the server's) gives each request the hidden state
    and the cache rows it gets alone, for every cache type."""
    net = cpu_models["i2_s"].net
    with kv_type(net, kind):
        caches = [net.new_cache(80) for _ in range(3)]
        alone = [net.new_cache(80) for _ in range(3)]
        for i, (c, a) in enumerate(zip(caches, alone, strict=True)):
            p = PROMPT[i:] * (1 + 2 * i)
            net.forward_hidden([Segment(p, c)])
            net.forward_hidden([Segment(p, a)])
        together = net.forward_hidden([Segment([7 + i], c) for i, c in enumerate(caches)])
        each = np.concatenate([net.forward_hidden([Segment([7 + i], a)])
                               for i, a in enumerate(alone)])
    np.testing.assert_array_equal(together, each)
    for c, a in zip(caches, alone, strict=True):
        np.testing.assert_array_equal(c.k[:, :c.length], a.k[:, :a.length])


# -- memory that grows with use ---------------------------------------------------------------
def test_cache_grows_in_blocks_and_keeps_what_it_holds(tiny_gguf, cpu_models):
    net = cpu_models["i2_s"].net
    cache = net.new_cache(2 * KV_BLOCK + 10)
    assert cache.capacity == 0 and cache.allocated == 0  # nothing held, nothing reserved
    net.forward_hidden([Segment(PROMPT, cache)])
    assert cache.capacity == KV_BLOCK
    first = cache.k[:, :len(PROMPT)].copy()
    net.forward_hidden([Segment(PROMPT * 22, cache)])  # 276 positions: a second block
    assert cache.length == len(PROMPT) * 23 and cache.capacity == 2 * KV_BLOCK
    np.testing.assert_array_equal(cache.k[:, :len(PROMPT)], first)
    net.forward_hidden([Segment(PROMPT * 20, cache)])  # past 2 blocks: up to max_len only
    assert cache.capacity == cache.max_len == 2 * KV_BLOCK + 10
    assert cache.allocated == cache.k.nbytes * 2
    # and the tokens are those of a cache made whole up front
    grown = net.new_cache(300)
    whole = net.new_cache(300)
    whole.reserve(300)
    a = net.forward_hidden([Segment(PROMPT * 24, grown)])
    b = net.forward_hidden([Segment(PROMPT * 24, whole)])
    np.testing.assert_array_equal(a, b)


def test_generation_reserves_its_positions_once(cpu_models, monkeypatch):
    """A generation without a cache of its own makes one whose arrays hold the prompt and
    every token it may generate from the start: no copy as the prompt's chunks or the decode
    steps cross a block (the copies grew with the context: 236 MB at 3,072 positions of
    2B-4T). Blocks of 32 positions here, so that the tiny model's context holds several."""
    from bitformat.runtime.models import base

    monkeypatch.setattr(base, "KV_BLOCK", 32)
    lm = cpu_models["i2_s"]
    made = []
    alloc = KVCache._alloc
    monkeypatch.setattr(KVCache, "_alloc",  # (a new cache's empty arrays: capacity 0)
                        lambda self, cap: (cap and made.append(cap)) or alloc(self, cap))
    prompt = (PROMPT * 9)[:100]  # prompt chunks and decode steps cross blocks at 128 and 160
    r = lm.generate(prompt, max_new_tokens=60, stop_ids=[])
    assert r.stats.generated_tokens == 60
    assert made == [160, 160]  # k and v, once each, at their full size
    cache = lm.net.new_cache(160)  # a cache grown by use (chat's, the server's) still grows
    lm.net.forward_hidden([Segment(prompt, cache)])
    assert made[2:] == [128, 128] and cache.capacity == 128


def test_cache_type_refused_with_its_name(tiny_gguf):
    with pytest.raises(RequestError, match="KV cache type must be f16, f32, q8_0"):
        load(tiny_gguf, backend="numpy", kv_cache="q4")
    with load(tiny_gguf, backend="numpy") as m, pytest.raises(RequestError, match="KV cache"):
        KVCache(m.args, 4, np.float32, "bf16")
    r = CliRunner().invoke(main, ["run", str(tiny_gguf), "--prompt-ids", "5", "--kv-cache",
                                  "q4"])
    assert r.exit_code == 2 and "f16" in r.output and "q8_0" in r.output


def test_default_cache_is_f16(tiny_gguf):
    with load(tiny_gguf, backend="numpy") as m:
        assert m.net.kv_type == "f16" and m.net.new_cache(4).store == np.float16


def test_run_reports_the_cache_type_and_its_bytes(tiny_gguf):
    out = {}
    for kind in TYPES:
        r = CliRunner().invoke(main, ["run", str(tiny_gguf), "--prompt-ids", "5,17,300,42",
                                      "-n", "6", "--backend", "numpy", "--kv-cache", kind,
                                      "--json"])
        assert r.exit_code == 0, r.output
        out[kind] = json.loads(r.output.strip().splitlines()[-1])
    assert [out[k]["kv_cache"] for k in TYPES] == list(TYPES)
    assert out["f16"]["kv_cache_bytes_last_token"] * 2 == out["f32"]["kv_cache_bytes_last_token"]
    q8 = out["q8_0"]["kv_cache_bytes_last_token"]
    assert q8 * 64 == out["f32"]["kv_cache_bytes_last_token"] * 17  # 34 bytes per 32 values
    assert (out["f32"]["bytes_read_per_token"] - out["f16"]["bytes_read_per_token"]
            == out["f16"]["kv_cache_bytes_last_token"])


def test_bench_times_each_cache_type(tiny_gguf):
    with load(tiny_gguf, backend="numpy") as m:
        a = m.args
    for kind, per in (("f16", 2 * a.head_dim), ("q8_0", a.head_dim + 2 * (a.head_dim // 32))):
        r = CliRunner().invoke(main, ["bench", str(tiny_gguf), "--formats", "i2_s", "--tokens",
                                      "4", "--kv-cache", kind, "--json"])
        assert r.exit_code == 0, r.output
        res = json.loads(r.output[r.output.index("{"):])
        assert res["kv_cache"] == kind
        assert res["kv_bytes_per_position"] == 2 * a.n_layers * a.n_kv_heads * per
    r = CliRunner().invoke(main, ["bench", str(tiny_gguf), "--formats", "i2_s", "--backend",
                                  "wgpu", "--kv-cache", "q8_0"])
    assert r.exit_code == 1 and "cpu backend only" in r.output


# -- the whole context, on every backend ----------------------------------------------------
@pytest.mark.parametrize("kind", ["f16", "f32"])
def test_generation_to_the_last_position_and_not_past_it(tiny_gguf, kind):
    """The tiny model's context is 256 positions: a 250-token prompt leaves room for 6 tokens
    (the last one sampled from position 255), every backend gives the same ones, a step
    past the context is refused naming it, and so is a prompt longer than it."""
    from backends import runtime_backends

    prompt = (PROMPT * 21)[:250]
    got = {}
    for be in runtime_backends():
        with load(tiny_gguf, backend=be, kv_cache=kind) as m:
            assert m.args.context_length == 256
            got[be] = m.generate(prompt, max_new_tokens=50, stop_ids=[]).tokens
            assert len(got[be]) == 6
            cache = m.net.new_cache(256)
            m.net.forward(prompt + got[be][:5], cache)  # positions 0..254
            m.net.forward(got[be][5:6], cache)  # 255: the last
            assert cache.length == 256
            with pytest.raises(RequestError, match="257 positions exceed the context of 256"):
                m.net.forward([1], cache)
            with pytest.raises(RequestError, match="257 tokens, more than the context of 256"):
                m.generate(prompt + prompt[:7], max_new_tokens=1)
    assert all(t == got["numpy"] for t in got.values()), got


def test_chat_command_takes_the_cache_type(tiny_gguf):
    """``chat --kv-cache q8_0``: the piped conversation's answers are those of a session on a
    model loaded with a q8_0 cache (its caches are q8_0 rows)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from bitformat.runtime.chat import ChatSession

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    lines = ["What is BitNet?", "More?"]
    proc = subprocess.run(
        [sys.executable, "-m", "bitformat.cli", "chat", str(tiny_gguf), "--backend", "numpy",
         "-n", "8", "--kv-cache", "q8_0"], input="\n".join(lines) + "\n",
        capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    with load(tiny_gguf, backend="numpy", kv_cache="q8_0") as m:
        session = ChatSession(m, max_new_tokens=8)
        want = ["".join(r.text for r in session.send(q)) for q in lines]
        assert session.cache.k.dtype == np.int8
    assert proc.stdout == "".join(a + "\n" for a in want)  # each answer, then a newline
