"""The cpu backend's compiled small steps and its weight layout, against the numpy reference.

* RMSNorm + int8 quantization (and the ReLU² gate before the FFN sub-norm) must give the same
  bits as :func:`bitformat.runtime.backend.rms_norm` and ``quantize_activations``: both sum the
  float32 squares in float64 and do the rest in float32 in the same order.
* One-token attention (RoPE, KV-cache write, softmax over the cache) against
  :func:`bitformat.runtime.backend.rope` and ``attention`` in float64: only summation order
  differs, so the float32 result must be within a few float32 ulps of the exact one.
* A decode step in one compiled call (:mod:`bitformat.runtime.cpu.decode`) gives the hidden
  states and KV caches of the layer-by-layer path bit for bit, step after step.
* Matrices stacked by rows (q, k, v; gate, up) give, bit for bit, the separate products, and
  every matrix the kernels read is a copy of the container's bytes in one arena.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

from bitformat.container import open_model
from bitformat.formats import FORMAT_IDS
from bitformat.runtime.backend import attention, quantize_activations, relu2_glu, rms_norm, rope
from bitformat.runtime.cpu import ops
from bitformat.runtime.models import INPUT_GROUPS
from bitformat.runtime.models.base import Segment

SHAPES = [(1, 2560), (3, 256), (2, 100), (1, 6912)]


def rows(rng, t, n):
    """Activations with a spread of magnitudes, a zero row and a row with one spike."""
    x = (rng.standard_normal((t, n)) * rng.uniform(0.01, 50, (t, 1))).astype(np.float32)
    if t > 1:
        x[1] = 0.0
    if t > 2:
        x[2, 7] = 1e4
    return x


@pytest.mark.parametrize("shape", SHAPES)
def test_norm_quant_same_bits_as_numpy(shape):
    rng = np.random.default_rng(shape[1])
    x = rows(rng, *shape)
    gain = rng.uniform(0.2, 3, shape[1]).astype(np.float32)
    want = quantize_activations(rms_norm(x, gain, 1e-5))
    q, s = np.empty(shape, np.int8), np.empty(shape[0], np.float32)
    ops.norm_quant(x, gain, 1e-5, q, s)
    np.testing.assert_array_equal(s, want.s)
    np.testing.assert_array_equal(q, want.q)
    assert np.abs(q.astype(int)).max() == 127  # the scale maps each row's maximum to 127


@pytest.mark.parametrize("shape", SHAPES)
def test_glu_norm_quant_same_bits_as_numpy(shape):
    rng = np.random.default_rng(shape[1] + 1)
    gate, up = rows(rng, *shape), rows(rng, *shape)
    gain = rng.uniform(0.2, 3, shape[1]).astype(np.float32)
    want = quantize_activations(rms_norm(relu2_glu(gate, up), gain, 1e-5))
    q, s = np.empty(shape, np.int8), np.empty(shape[0], np.float32)
    ops.glu_norm_quant(gate, up, gain, 1e-5, q, s)
    np.testing.assert_array_equal(s, want.s)
    np.testing.assert_array_equal(q, want.q)


@pytest.mark.parametrize("layout,lane", [("x86", 32), ("arm64", 16), ("plain", 1)])
@pytest.mark.parametrize("cols,bpr", [(2560, 640), (6912, 1728), (130, 40), (96, 24)])
def test_slots_match_layout_table(layout, lane, cols, bpr):
    """decode's activation layout (copied a block of ``lane`` bytes at a time) against the
    per-byte formula, and against :func:`.kernels.slot_activations` where that applies."""
    from bitformat.runtime.cpu import decode as D
    from bitformat.runtime.cpu import kernels as K

    rng = np.random.default_rng(5)
    q = rng.integers(-128, 128, (3, cols)).astype(np.int8)
    want = np.zeros((3, 4, bpr), np.int8)
    for g in range(4):
        for m in range(bpr):
            e = (m // lane) * 4 * lane + lane * g + m % lane
            if e < cols:
                want[:, g, m] = q[:, e]
    if layout == "plain" or cols % (4 * lane) == 0:
        np.testing.assert_array_equal(want, K.slot_activations(q, layout, 4 * bpr))
    xg = np.full((3, 4, bpr), 7, np.int8)
    D._slots_rows(q, lane, cols, xg)
    np.testing.assert_array_equal(xg, want)
    x1 = np.full((1, 4, bpr), 7, np.int8)
    D._slots(q[:1], lane, cols, x1)
    np.testing.assert_array_equal(x1[0], want[0])


@pytest.mark.parametrize("heads,kv,d,pos", [(8, 2, 16, 0), (8, 2, 16, 37), (4, 4, 32, 5),
                                           (20, 5, 128, 90), (8, 2, 16, 255), (8, 2, 16, 256),
                                           (20, 5, 128, 700)])
def test_attend_one_matches_numpy(heads, kv, d, pos):
    rng = np.random.default_rng(pos + d)
    q = rng.standard_normal((1, heads, d)).astype(np.float32) * 3
    k = rng.standard_normal((1, kv, d)).astype(np.float32) * 3
    v = rng.standard_normal((1, kv, d)).astype(np.float32)
    kc = rng.standard_normal((pos + 4, kv, d)).astype(np.float32)
    vc = rng.standard_normal((pos + 4, kv, d)).astype(np.float32)
    inv = 1.0 / 500000.0 ** (np.arange(0, d, 2) / d)
    ang = (pos * inv)[None, :].astype(np.float32)
    cos, sin = np.cos(ang), np.sin(ang)
    kc64, vc64 = kc.astype(np.float64), vc.astype(np.float64)  # the reference's cache
    later = kc[pos + 1:].copy(), vc[pos + 1:].copy()
    kc64[pos], vc64[pos] = rope(k.astype(np.float64), cos, sin)[0], v[0]
    want = attention(rope(q.astype(np.float64), cos, sin), kc64[: pos + 1], vc64[: pos + 1], pos)
    out = np.full((1, heads * d), np.nan, np.float32)
    ops.attend_one(q[0], k[0], v[0], cos[0], sin[0], kc, vc, pos, out[0])
    np.testing.assert_allclose(kc[pos], kc64[pos], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(vc[pos], v[0])
    np.testing.assert_array_equal(kc[pos + 1:], later[0])  # positions after pos untouched
    np.testing.assert_array_equal(vc[pos + 1:], later[1])
    assert np.abs(out - want).max() < 1e-5 * np.abs(want).max()


@numba.njit
def _exp_le0_all(x, out):
    for i in range(x.shape[0]):
        out[i] = ops._exp_le0(x[i])


def test_softmax_exp_within_one_ulp():
    """The attention softmax's own float32 exp (branch-free, so it runs in SIMD lanes) against
    float64's exp, over the whole range a softmax meets (score - max <= 0), and 0 below the
    smallest normal result."""
    x = np.concatenate([-np.logspace(-9, 2, 100_000), np.linspace(-88.0, 0.0, 100_001),
                        [0.0, -0.0, -1e-30, float(ops._EXP_MIN), -87.4, -1e4, -np.inf]])
    x = x.astype(np.float32)
    got = np.empty_like(x)
    _exp_le0_all(x, got)
    ok = x >= ops._EXP_MIN
    want = np.exp(x[ok].astype(np.float64))
    ulps = np.abs(got[ok] - want) / np.spacing(want.astype(np.float32)).astype(np.float64)
    assert ulps.max() < 1.0, (x[ok][ulps.argmax()], ulps.max())
    assert got[x == 0][0] == 1.0
    np.testing.assert_array_equal(got[~ok], 0.0)


@pytest.mark.parametrize("pos", [0, 63, 64, 255, 700, 1023])
def test_attend_one_same_bits_on_any_threads(pos):
    """Attention past one run of positions, its runs' partials shared among threads and
    merged, gives the same bits as on this thread alone, on one thread or two, and as a
    batched step's attention
    (attend_rows), and stays close to a float64 softmax at long contexts."""
    import numba

    rng = np.random.default_rng(pos)
    heads, kv, d = 20, 5, 32
    q = rng.standard_normal((heads, d)).astype(np.float32) * 2
    k = rng.standard_normal((kv, d)).astype(np.float32)
    v = rng.standard_normal((kv, d)).astype(np.float32)
    kc = rng.standard_normal((pos + 1, kv, d)).astype(np.float32)
    vc = rng.standard_normal((pos + 1, kv, d)).astype(np.float32)
    cos, sin = np.ones(d // 2, np.float32), np.zeros(d // 2, np.float32)  # RoPE at position 0
    outs = [np.empty(heads * d, np.float32)]
    ops.attend_one(q, k, v, cos, sin, kc, vc, pos, outs[0])  # on this thread
    before = numba.get_num_threads()
    try:
        for threads in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
            numba.set_num_threads(threads)
            out = np.empty(heads * d, np.float32)
            ops.attend_split(q[None], k[None], v[None], cos[None], sin[None], kc, vc, pos,
                             out[None])
            outs.append(out)
    finally:
        numba.set_num_threads(before)
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])
    rows = np.empty((1, heads * d), np.float32)
    kb, vb = kc[None].copy(), vc[None].copy()
    ops.attend_rows(q[None], k[None], v[None], cos[None], sin[None],
                    np.array([kb.ctypes.data]), np.array([vb.ctypes.data]),
                    np.array([pos + 1]), np.array([pos]), np.zeros(d, np.float32), 0, rows)
    np.testing.assert_array_equal(rows[0], outs[0])
    a = outs[0]
    group = heads // kv
    for h in range(heads):
        sc = kc[:, h // group].astype(np.float64) @ q[h].astype(np.float64) / np.sqrt(d)
        p = np.exp(sc - sc.max())
        want = (p / p.sum()) @ vc[:, h // group].astype(np.float64)
        np.testing.assert_allclose(a[h * d: (h + 1) * d], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["f32", "f16", "q8_0"])
def test_attend_rows_same_bits_as_attend_one(kind):
    """A decode step's tokens in one call, each on its own cache (other lengths, positions,
    layers; every cache type), give attend_one's bits and cache writes, and touch nothing
    else."""
    from bitformat.runtime import kvquant

    rng = np.random.default_rng(11)
    layers, heads, kv, d = 3, 8, 2, 32
    lens, pos = [40, 7, 600, 41], [39, 0, 530, 25]
    T, layer = len(lens), 1

    def cache(n):
        c = np.zeros((layers, n, kv, kvquant.row_width(kind, d)), kvquant.storage_dtype(kind))
        kvquant.store(c.reshape((-1,) + c.shape[2:]), 0,
                      rng.standard_normal((layers * n, kv, d)).astype(np.float32))
        return ops.kernel_cache(c)

    caches = [(cache(n), cache(n)) for n in lens]
    before = [(kc.copy(), vc.copy()) for kc, vc in caches]
    q = rng.standard_normal((T, heads, d)).astype(np.float32)
    k = rng.standard_normal((T, kv, d)).astype(np.float32)
    v = rng.standard_normal((T, kv, d)).astype(np.float32)
    inv = 1.0 / 500000.0 ** (np.arange(0, d, 2) / d)
    ang = (np.array(pos)[:, None] * inv).astype(np.float32)
    cos, sin = np.cos(ang), np.sin(ang)
    out = np.full((T, heads * d), np.nan, np.float32)
    addr = [np.array([c[i].ctypes.data for c in caches], np.int64) for i in (0, 1)]
    ops.attend_rows(q, k, v, cos, sin, *addr, np.array(lens, np.int64),
                    np.array(pos, np.int64), caches[0][0][0, 0, 0], layer, out)
    for t, ((kc, vc), (kb, vb)) in enumerate(zip(caches, before, strict=True)):
        want = np.empty(heads * d, np.float32)
        ops.attend_one(q[t], k[t], v[t], cos[t], sin[t], kb[layer], vb[layer], pos[t], want)
        np.testing.assert_array_equal(out[t], want, err_msg=f"token {t}")
        np.testing.assert_array_equal(kc, kb, err_msg=f"k cache of token {t}")
        np.testing.assert_array_equal(vc, vb, err_msg=f"v cache of token {t}")


@pytest.mark.parametrize("kind", ["f32", "f16", "q8_0"])
def test_scores_four_keys_at_once_same_bits_as_two(kind):
    """The scores of four positions at a time (AVX-512 builds) sum in the same tree as those of
    two: six equal keys, read as a pass of four then one of two, give six equal scores per head
    (and close to float64's)."""
    from bitformat.runtime import kvquant

    rng = np.random.default_rng(2)
    heads, kv, d = 8, 2, 64
    row = rng.standard_normal((1, kv, d)).astype(np.float32)
    c = np.zeros((6, kv, kvquant.row_width(kind, d)), kvquant.storage_dtype(kind))
    kvquant.store(c, 0, np.repeat(row, 6, axis=0))
    kc = ops.kernel_cache(c)
    q = rng.standard_normal((heads, d)).astype(np.float32)
    p = np.full((heads, 6), np.nan, np.float32)
    scale = np.float32(1 / np.sqrt(d))
    ops._part_scores(q, kc, kc, 0, 6, scale, p, False, 0, 0)
    for t in range(1, 6):
        np.testing.assert_array_equal(p[:, t], p[:, 0], err_msg=f"position {t}")
    keys = kvquant.load(c, 1, d)[0].astype(np.float64)
    want = np.array([q[h].astype(np.float64) @ keys[h // (heads // kv)] for h in range(heads)])
    np.testing.assert_allclose(p[:, 0], want * scale, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["f32", "f16", "q8_0"])
def test_a_run_hinting_the_next_keeps_its_bits_and_the_caches(kind):
    """A run of positions that hints the next run's rows into L2 (the decode step's claimed
    next run, attend_split's next in its block), or skips its own hints because the run before
    hinted them, gives the bits of a run without hints and leaves the caches as they were."""
    from bitformat.runtime import kvquant

    rng = np.random.default_rng(5)
    heads, kv, d, n = 20, 5, 128, 200
    c = {}
    for name in "kv":
        c[name] = np.zeros((n, kv, kvquant.row_width(kind, d)), kvquant.storage_dtype(kind))
        kvquant.store(c[name], 0, rng.standard_normal((n, kv, d)).astype(np.float32))
    kc, vc = ops.kernel_cache(c["k"]), ops.kernel_cache(c["v"])
    before = kc.copy(), vc.copy()
    q = rng.standard_normal((heads, d)).astype(np.float32)
    scale = np.float32(1 / np.sqrt(d))
    plain = np.empty((heads, d + ops.PART_V), np.float32)
    ops._part(q, kc, vc, 64, 128, scale, plain, 0, 0, False)
    for nx0, nx1, warm in ((128, 192, False), (128, 192, True), (192, 200, True)):
        hinted = np.full_like(plain, np.nan)
        ops._part(q, kc, vc, 64, 128, scale, hinted, nx0, nx1, warm)
        np.testing.assert_array_equal(hinted, plain, err_msg=f"next {nx0}..{nx1}, warm {warm}")
    np.testing.assert_array_equal(kc, before[0])
    np.testing.assert_array_equal(vc, before[1])


@pytest.mark.parametrize("kind", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("start,T", [(0, 5), (0, 64), (100, 7), (120, 64)])
def test_attend_prompt_same_bits_as_decoding_each_token(kind, start, T):
    """A prompt's chunk in one call gives each token the bits attend_one gives it decoded on
    its own, one after the other (every cache type; chunks that start at 0 and past a run of
    positions, odd and even token counts), writes the same cache rows, and touches no row past
    the chunk."""
    from bitformat.runtime import kvquant

    rng = np.random.default_rng(5)
    heads, kv, d, n = 8, 2, 32, 200
    c = np.zeros((2, n, kv, kvquant.row_width(kind, d)), kvquant.storage_dtype(kind))
    kvquant.store(c.reshape((-1,) + c.shape[2:]), 0,
                  rng.standard_normal((2 * n, kv, d)).astype(np.float32))
    kc, vc = ops.kernel_cache(c[0]), ops.kernel_cache(c[1])
    kb, vb = kc.copy(), vc.copy()
    q = rng.standard_normal((T, heads, d)).astype(np.float32)
    k = rng.standard_normal((T, kv, d)).astype(np.float32)
    v = rng.standard_normal((T, kv, d)).astype(np.float32)
    inv = 1.0 / 500000.0 ** (np.arange(0, d, 2) / d)
    ang = ((start + np.arange(T))[:, None] * inv).astype(np.float32)
    cos, sin = np.cos(ang), np.sin(ang)
    out = np.full((T, heads * d), np.nan, np.float32)
    ops.attend_split(q, k, v, cos, sin, kc, vc, start, out)
    for t in range(T):
        want = np.empty(heads * d, np.float32)
        ops.attend_one(q[t], k[t], v[t], cos[t], sin[t], kb, vb, start + t, want)
        np.testing.assert_array_equal(out[t], want, err_msg=f"token {t}")
    np.testing.assert_array_equal(kc, kb)
    np.testing.assert_array_equal(vc, vb)


def test_prompt_attention_same_bits_before_and_after_the_split_kernel(cpu_models):
    """A prompt's chunk on the cpu backend gives the same bits and cache rows a token at a
    time on this thread (what a first run does until the split kernel is compiled) and among
    threads (:func:`ops.attend_split`, after ``warm_attention``), past one run of positions."""
    import copy

    be = copy.copy(cpu_models["i2_s"].backend)  # its own split_attention flag
    rng = np.random.default_rng(8)
    T, heads, kv, d, start = 9, 8, 2, 32, 70
    q = rng.standard_normal((T, heads, d)).astype(np.float32)
    k = rng.standard_normal((T, kv, d)).astype(np.float32)
    v = rng.standard_normal((T, kv, d)).astype(np.float32)
    ang = rng.uniform(0, 6, (T, d // 2))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    c = rng.standard_normal((2, start + T, kv, d)).astype(np.float16)
    caches = np.stack([c, c])  # the same k and v caches twice
    outs = []
    for split in (False, True):
        if split:
            be.warm_attention("f16")
        assert be.split_attention == split
        kc, vc = caches[int(split)]
        outs.append(be.attend(q, k, v, kc, vc, start, cos, sin))
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(caches[0], caches[1])


@pytest.mark.parametrize("fid", FORMAT_IDS)
def test_stacked_projections_equal_separate(cpu_models, fid):
    lm = cpu_models[fid]
    be, blk = lm.backend, lm.net.blocks[1]
    # rans too: decoded at load into stfma rows (decoded in the kernels, decode="fused", it is
    # never stacked: tests/test_rans_runtime.py)
    assert set(blk.stacked) == set(INPUT_GROUPS)
    rng = np.random.default_rng(3)
    for group, w in blk.stacked.items():
        qa = quantize_activations(rng.standard_normal((2, w.cols)).astype(np.float32))
        separate = np.concatenate([be.bitlinear(qa, blk.proj[n]) for n in group], axis=1)
        np.testing.assert_array_equal(be.bitlinear(qa, w), separate)
        assert w.rows == sum(blk.proj[n].rows for n in group)
        assert all(np.shares_memory(w.data, blk.proj[n].data) for n in group)
        assert not w.data.flags.writeable


@pytest.mark.parametrize("fid", ["i2_s", "tq2_0", "tq1_0", "stfma", "colpack_u32", "iq2_bn"])
def test_weights_are_arena_copies_of_container_bytes(cpu_models, tiny_containers, fid):
    """The arena holds each matrix's container bytes; where the vnni and avx2 builds hold a
    matrix whose rows have one scale each as stfma rows (ONE_SCALE_ROWS), those rows, padded to
    whole chunks, with the container's scales (tq1_0 on a VBMI CPU: lut3 tiles, LUT3_ROWS);
    where the portable build repacks a base-3 container (tq1_0), the rows its 2-bit twin
    encodes."""
    from bitformat.formats import get_format
    from bitformat.runtime.costs import REPACKED
    from bitformat.runtime.cpu import lut3
    from bitformat.runtime.cpu.backend import (
        LUT3_ROWS,
        ONE_SCALE_ROWS,
        TernaryTensor,
        one_scale_per_row,
    )

    be = cpu_models[fid].backend
    arena = be._arena.buf
    as_lut3 = be.lut3 and fid in LUT3_ROWS
    as_stfma = be.kernel in ("vnni", "avx2") and fid in ONE_SCALE_ROWS and not as_lut3
    repacked = not as_stfma and be.kernel != "vnni" and fid in REPACKED
    with open_model(tiny_containers[fid]) as c:
        for i in (0, 1):
            for name, w in cpu_models[fid].net.blocks[i].proj.items():
                full = f"blk.{i}.{name}.weight"
                raw = c.plain(full)[1]
                if as_stfma:
                    t = c.ternary(full)
                    assert w.encoding == "stfma" and w.data.shape[1] % 64 == 0
                    np.testing.assert_array_equal(w.scale, one_scale_per_row(t))
                    width = w.data.shape[1] * 4
                    trits = np.zeros((t.rows, width), np.int8)
                    trits[:, :t.cols] = t.trits
                    raw = np.asarray(get_format("stfma").encode(TernaryTensor(
                        trits, np.float32([1]), 0))).view(np.uint8).reshape(-1)
                if as_lut3:
                    t = c.ternary(full)
                    assert w.encoding == "lut3"
                    np.testing.assert_array_equal(w.scale, one_scale_per_row(t))
                    raw = lut3.pack(t.trits).reshape(-1)
                if repacked:
                    assert w.encoding == REPACKED[fid]
                    raw = np.asarray(get_format(REPACKED[fid]).encode(c.ternary(full))
                                     ).view(np.uint8).reshape(-1)
                assert np.shares_memory(w.data, arena) and not w.data.flags.writeable
                assert w.data.ctypes.data % 64 == 0  # every matrix starts on a cache line
                np.testing.assert_array_equal(w.data.reshape(-1), raw[: w.data.size])


@pytest.mark.parametrize("fid,kind", [("i2_s", "f16"), ("i2_s", "f32"), ("i2_s", "q8_0"),
                                      ("stfma", "f16"), ("rans", "f16"), ("tq2_0", "f16")])
def test_decode_row_same_bits_as_layer_by_layer(cpu_models, fid, kind, monkeypatch):
    """The one-call decode step (where the backend has a plan) against the same network run
    layer by layer: hidden states and both KV caches (of each type) equal after every one of
    40 steps."""
    net = cpu_models[fid].net
    monkeypatch.setattr(net, "kv_type", kind)
    plan = net._decode_plan()
    if net.blocks[0].proj["attn_q"].encoding == "tq2_0":  # held as it is (the portable
        assert plan is None  # build): no 2-bit slot layout, no plan, layer by layer
        return
    if cpu_models[fid].backend.kernel != "vnni":
        pytest.skip("the one-call step needs the vnni kernels")
    assert plan is not None
    fused, layered = net.new_cache(64), net.new_cache(64)
    rng = np.random.default_rng(5)
    prompt = [int(t) for t in rng.integers(0, net.args.vocab_size, 5)]
    net.forward_hidden([Segment(prompt, fused)])
    net.forward_hidden([Segment(prompt, layered)])
    for step in range(40):
        tok = int(rng.integers(0, net.args.vocab_size))
        a = net.forward_hidden([Segment([tok], fused)])
        net._plan = None
        try:
            b = net.forward_hidden([Segment([tok], layered)])
        finally:
            net._plan = plan
        np.testing.assert_array_equal(a, b, err_msg=f"step {step}")
        n = fused.length  # the positions held (the rest of the arrays is not written)
        np.testing.assert_array_equal(fused.k[:, :n], layered.k[:, :n], f"k cache, step {step}")
        np.testing.assert_array_equal(fused.v[:, :n], layered.v[:, :n], f"v cache, step {step}")


@pytest.mark.parametrize("numba_threads,team,least", [
    (1, 1, 64), (2, 2, 64), (2, 2, 1 << 20), (1, 2, 64), (1, 3, 4096), (2, 3, 64)])
def test_decode_row_team_same_bits_for_any_team(cpu_models, numba_threads, team, least):
    """The one-call step's threads share rows and heads phase by phase (:mod:`.cpu.team`):
    the hidden state and the KV caches do not depend on how many threads take part, how
    the rows were cut, or whether the team's threads ran at once. ``numba_threads`` below
    ``team`` runs some members one after another on one thread: a member that came late finds
    every phase done and must neither wait forever nor redo anything."""
    from bitformat.runtime.cpu import decode as D

    net, be = cpu_models["i2_s"].net, cpu_models["i2_s"].backend
    plan = net._decode_plan()
    if plan is None:
        pytest.skip("the one-call step needs the vnni kernels")
    rng = np.random.default_rng(9)
    d2 = plan.head_dim // 2
    cos, sin = (rng.standard_normal(d2).astype(np.float32) for _ in range(2))
    h0 = rng.standard_normal((1, net.args.dim)).astype(np.float32)
    room = net.new_cache(16)
    room.reserve(16)
    k0 = rng.standard_normal(room.k.shape).astype(np.float32)  # an f32 cache
    results = []
    before = numba.get_num_threads()
    try:
        for n, k in ((1, 1), (min(numba_threads, numba.config.NUMBA_NUM_THREADS), team)):
            numba.set_num_threads(n)
            kc, vc, h = k0.copy(), k0 * np.float32(0.5), h0.copy()
            for pos in range(8, 11):  # earlier positions: the random cache
                D._decode_row(be._arena.buf, plan.mats, plan.ws, plan.gains, plan.eps, plan.lane,
                              plan.heads, kc, vc, pos, cos, sin, k, least, h)
            results.append((h, kc, vc))
    finally:
        numba.set_num_threads(before)
    for a, b in zip(*results, strict=True):
        np.testing.assert_array_equal(a, b)
    assert np.isfinite(results[0][0]).all() and not np.array_equal(results[0][0], h0)


@pytest.mark.parametrize("team", [1, 2, 3])
def test_decode_row_team_survives_overflowing_weights(cpu_models, team):
    """A norm gain of 3e38 (a fuzzed file) overflows the activations to inf, so their int8
    scale is 0 and the mat-vec divides by it. Inside the team's region that may not raise: a
    member that raised would leave the others waiting. The step returns, non-finite."""
    from bitformat.runtime.cpu import decode as D

    net, be = cpu_models["i2_s"].net, cpu_models["i2_s"].backend
    plan = net._decode_plan()
    if plan is None:
        pytest.skip("the one-call step needs the vnni kernels")
    gains = plan.gains.copy()
    gains[0, 1, [3, 35]] = np.float32(3e38)
    rng = np.random.default_rng(2)
    d2 = plan.head_dim // 2
    cos, sin = np.ones(d2, np.float32), np.zeros(d2, np.float32)
    cache = net.new_cache(8)
    cache.reserve(8)
    h = rng.standard_normal((1, net.args.dim)).astype(np.float32)
    D._decode_row(be._arena.buf, plan.mats, plan.ws, gains, plan.eps, plan.lane, plan.heads,
                  ops.kernel_cache(cache.k), ops.kernel_cache(cache.v), 0, cos, sin, team, 64,
                  h)
    assert not np.isfinite(h).all()


@pytest.mark.parametrize("fid", ["i2_s", "stfma", "tq1_0-lut3"])
@pytest.mark.parametrize("team", [None, 3])
def test_decode_rows_same_bits_as_layer_by_layer(cpu_models, lut3_models, fid, team,
                                                 monkeypatch):
    """A batched decode step in one call (AMX tiles, :func:`decode.decode_rows`, or VNNI,
    :func:`decode.decode_rows_vnni`; tq1_0 as lut3 tiles where the CPU has VBMI) against the
    same step layer by layer: hidden states and every request's caches equal, 12 steps of 5
    requests whose caches have different lengths and positions; also by a team of 3 threads
    (:mod:`.cpu.team`) on however many threads numba runs, members one after another included."""
    from bitformat.runtime.cpu import decode as D

    if team is not None:
        monkeypatch.setattr(D, "get_num_threads", lambda: team)
    lm = lut3_models[fid[:-5]] if fid.endswith("-lut3") else cpu_models[fid]
    net, be = lm.net, lm.backend
    plan = net._decode_plan()
    if plan is None:
        pytest.skip("no one-call step on this build")
    calls = []
    for name in ("decode_rows", "decode_rows_vnni"):
        kernel = getattr(D, name)
        monkeypatch.setattr(D, name, lambda *a, k=kernel, n=name: (calls.append(n), k(*a)))
    rng = np.random.default_rng(9)
    V = net.args.vocab_size
    fused = [net.new_cache(40 + 3 * i) for i in range(5)]
    layered = [net.new_cache(40 + 3 * i) for i in range(5)]
    for i, (a, b) in enumerate(zip(fused, layered, strict=True)):
        prompt = [int(t) for t in rng.integers(0, V, 2 + i)]
        net.forward_hidden([Segment(prompt, a)])
        net.forward_hidden([Segment(prompt, b)])
    for step in range(12):
        toks = [int(t) for t in rng.integers(0, V, 5)]
        x = net.forward_hidden([Segment([t], c) for t, c in zip(toks, fused, strict=True)])
        net._plan = None
        try:
            y = net.forward_hidden([Segment([t], c) for t, c in zip(toks, layered, strict=True)])
        finally:
            net._plan = plan
        np.testing.assert_array_equal(x, y, err_msg=f"step {step}")
        for a, b in zip(fused, layered, strict=True):
            n = a.length  # the positions held (the rest of the arrays is not written)
            np.testing.assert_array_equal(a.k[:, :n], b.k[:, :n], f"k cache, step {step}")
            np.testing.assert_array_equal(a.v[:, :n], b.v[:, :n], f"v cache, step {step}")
    want = "decode_rows" if be.amx and plan.amx else "decode_rows_vnni"
    assert calls == [want] * 12  # every step in one call, of this CPU's kind


def test_every_row_container_has_a_cpu_kernel():
    """The cpu backend dispatches through one table (:data:`CpuBackend.KERNELS`): every row
    container of the registry, the unpacked-trits fallback and the lut3 tiles that tq1_0 and
    iq1_bn are held as on VBMI CPUs, has its mat-vec there."""
    from bitformat.formats import ROW_FORMAT_IDS
    from bitformat.runtime.cpu.backend import CpuBackend

    assert set(ROW_FORMAT_IDS) | {"trits", "lut3"} == set(CpuBackend.KERNELS)
    assert all(callable(k) for k in CpuBackend.KERNELS.values())


def test_iq1_bn_read_as_it_is_gives_the_repacked_bits(tiny_containers, cpu_models,
                                                       monkeypatch):
    """iq1_bn read as it is (the vnni build's kernel: the avx2 one) and repacked into iq2_bn
    rows at load (the avx2 and portable builds, where its rows are not held as stfma rows)
    give the same logits, bit for bit. (tq1_0 has no such pair: the vnni build alone has a
    kernel for it as it is.)"""
    from bitformat.runtime import load
    from bitformat.runtime.cpu.backend import CpuBackend

    monkeypatch.setattr(CpuBackend, "_one_scale_rows", lambda self, e: False)
    with load(tiny_containers["iq1_bn"], backend="cpu") as repacked:
        if repacked.backend.kernel == "vnni":
            pytest.skip("the vnni build does not repack iq1_bn: nothing to compare")
        assert repacked.net.blocks[0].proj["attn_q"].encoding == "iq2_bn"
        monkeypatch.setattr(CpuBackend, "_repacks", lambda self, e: None)
        _same_forward(repacked, tiny_containers["iq1_bn"], "iq1_bn")


@pytest.mark.parametrize("fid", ["tq2_0", "tq1_0", "q2_0", "iq2_bn", "iq1_bn", "colpack_u32"])
def test_one_scale_rows_give_the_bits_of_the_containers_own_kernel(cpu_models, tiny_containers,
                                                                   fid, monkeypatch):
    """A container held as stfma rows (ONE_SCALE_ROWS: the vnni and avx2 builds), or as lut3
    tiles (LUT3_ROWS, by default on a CPU with VBMI and no AMX), gives the logits its own
    kernel gives, bit for bit, prompt and one-token steps alike."""
    from bitformat.runtime.cpu.backend import LUT3_ROWS, CpuBackend

    held = cpu_models[fid]
    if held.backend.kernel not in ("vnni", "avx2"):
        pytest.skip("the portable build holds every container as it is")
    tiles = held.backend.lut3 and fid in LUT3_ROWS
    assert held.net.blocks[0].proj["attn_q"].encoding == ("lut3" if tiles else "stfma")
    monkeypatch.setattr(CpuBackend, "_one_scale_rows", lambda self, e: False)
    _same_forward(held, tiny_containers[fid], fid)


def _same_forward(want_model, path, fid):
    """``want_model`` and the model loaded now from ``path`` (not as stfma rows) give the same
    hidden states for a prompt and then 6 one-token steps."""
    from bitformat.runtime import load

    with load(path, backend="cpu") as native:
        assert native.net.blocks[0].proj["attn_q"].encoding not in ("stfma", "lut3"), fid
        prompt = [3, 17, 250, 9, 100]
        a, b = (m.net.new_cache(len(prompt) + 6) for m in (want_model, native))
        want = want_model.net.forward(prompt, a)
        np.testing.assert_array_equal(native.net.forward(prompt, b), want)
        for tok in (5, 77, 3, 250, 1, 9):
            want = want_model.net.forward([tok], a)
            np.testing.assert_array_equal(native.net.forward([tok], b), want, err_msg=fid)


def test_one_scale_per_row():
    """A row's one scale counts only blocks with a nonzero trit; a row with two is None; a row
    of zeros gets 0; a per-tensor scale is every row's."""
    from bitformat.runtime.cpu.backend import one_scale_per_row
    from bitformat.ternary import TernaryTensor

    trits = np.zeros((3, 8), np.int8)
    trits[0, [0, 5]] = 1, -1  # blocks 0 and 2 of 4 (blocks of 2)
    trits[1, 2] = 1  # block 1 only
    scales = np.float32([[2, 9, 2, 7], [4, 3, 4, 4], [1, 1, 1, 1]])
    got = one_scale_per_row(TernaryTensor(trits, scales, 2))
    np.testing.assert_array_equal(got, np.float32([2, 3, 0]))
    scales[0, 2] = 2.5  # two scales where trits live
    assert one_scale_per_row(TernaryTensor(trits, scales, 2)) is None
    np.testing.assert_array_equal(one_scale_per_row(TernaryTensor(trits, np.float32([1.5]))),
                                  np.float32([1.5] * 3))


def test_a_matrix_whose_blocks_scales_differ_keeps_its_own_kernel(tiny_containers, tmp_path):
    """One tq2_0 matrix whose rows carry two block scales (as a llama.cpp quantization of
    other weights would): the cpu backend keeps the tq2_0 kernel for it, holds the others as
    stfma rows, and gives the numpy reference's logits."""
    from bitformat.formats import get_format
    from bitformat.io.gguf import GGUFReader, GGUFWriter
    from bitformat.runtime import load

    src, out = tiny_containers["tq2_0"], tmp_path / "mixed.tq2_0.gguf"
    name = "blk.0.ffn_down.weight"
    with open_model(src) as c:
        t = c.ternary(name)
    assert t.scales.shape[1] >= 2 and (t.trits[:, 256:512] != 0).any()
    t.scales[:, 1] *= np.float32(1.5)  # block 1 of every row: another (f16-exact) scale
    with GGUFReader(src) as r:
        w = GGUFWriter(str(out))
        w.metadata = dict(r.metadata)
        blobs = []
        for n, info in r.tensors.items():
            raw = r.raw(n)
            if n == name:
                raw = np.asarray(get_format("tq2_0").encode(t)).view(np.uint8)
            w.add_tensor(n, info.shape, info.ggml_type, raw.nbytes)
            blobs.append(raw)
        w.write(iter(blobs))
    with load(out, backend="cpu", kv_cache="f32") as m:
        if m.backend.kernel not in ("vnni", "avx2"):
            pytest.skip("the portable build holds every container as it is")
        proj = m.net.blocks[0].proj
        assert proj["ffn_down"].encoding == "tq2_0"
        assert proj["attn_output"].encoding == "stfma"
        got = m.logits([3, 17, 250, 9])
    with load(out, backend="numpy", kv_cache="f32") as ref:
        want = ref.logits([3, 17, 250, 9])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
