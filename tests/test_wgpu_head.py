"""The screened LM head on the wgpu backend (runtime/wgpu/head.py): the device's full head's tokens.

Every ``Head(..., check=True)`` also runs the full head kernel on every step and asserts that
each row's logit (the device's own f32 bits) lies inside its bounds, that the rescored
candidates are those very bits, and that the token is the full head's choice. Without an
adapter these tests skip, unless ``BITFORMAT_REQUIRE_GPU=1`` (CI on lavapipe) makes that fail.
"""

from __future__ import annotations

import numpy as np
import pytest
from backends import runtime_backends
from test_exact_head import SAMPLINGS, adversarial_head, run_steps

from bitformat.constants import GGMLType
from bitformat.runtime import head as EH
from bitformat.runtime.head import Head
from bitformat.runtime.sampling import Sampler, SamplingParams


@pytest.fixture(scope="module")
def devices():
    """``get(lanes=1, max_binding=None)`` -> a cached GpuDevice (skip without an adapter)."""
    if "wgpu" not in runtime_backends():
        pytest.skip("no wgpu adapter (on Linux: apt-get install mesa-vulkan-drivers)")
    from bitformat.runtime.wgpu.device import GpuDevice

    cache: dict[tuple, GpuDevice] = {}

    def get(lanes: int = 1, max_binding: int | None = None) -> GpuDevice:
        if (lanes, max_binding) not in cache:
            cache[lanes, max_binding] = GpuDevice(lanes=lanes, max_binding=max_binding)
        return cache[lanes, max_binding]

    return get


#: one lane (lavapipe's default), and four lanes with storage bindings cut to 64 KiB: the head
#: and the screen's codes then span many chunks, and rows sum across lanes
CONFIGS = [(1, None), (4, 64 * 1024)]


def head_bytes(E: np.ndarray, gtype: str) -> np.ndarray:
    if gtype == "F32":
        return np.ascontiguousarray(E, "<f4")
    if gtype == "F16":
        return np.ascontiguousarray(E, np.float32).astype("<f2")
    return (np.ascontiguousarray(E, np.float32).view(np.uint32) >> 16).astype("<u2")


def wgpu_head_backend(dev, E: np.ndarray, gtype: str = "F16"):
    """A :class:`WgpuBackend` holding only an LM head ``E`` (float values, stored as gtype)."""
    from bitformat.runtime.wgpu.backend import GpuEmbedding, WgpuBackend
    from bitformat.runtime.wgpu.device import UNIFORM_WORDS

    V, dim = E.shape
    be = object.__new__(WgpuBackend)
    be.dev, be.vocab, be.dim, be.dtype = dev, V, dim, np.float32
    be.head_type = GGMLType[gtype]
    be.head = GpuEmbedding.from_rows(dev, GGMLType[gtype], head_bytes(E, gtype), V, dim)
    be.xf = dev.buffer(4 * UNIFORM_WORDS, "x_f32", uniform=True)
    be._logits = be._screened = be._argmax = be.no_screen = be.head_nbytes = None
    return be


# -- the kernels ----------------------------------------------------------------------------------
@pytest.mark.parametrize("lanes,max_binding", CONFIGS)
@pytest.mark.parametrize("gtype,dim", [("F16", 64), ("F16", 202), ("BF16", 200), ("F32", 74)])
def test_screen_and_rows_kernels(devices, lanes, max_binding, gtype, dim):
    """The screen's sums give the numpy reference's bounds bit for bit; the rescoring kernel
    returns lm_head.wgsl's bits for any subset of rows (odd pairs and f32 tails included)."""
    from bitformat.runtime.cpu.screen import quantize_bits

    rng = np.random.default_rng(dim)
    V = 1500
    E = rng.standard_normal((V, dim)) * 0.05
    E[7] = 0
    be = wgpu_head_backend(devices(lanes, max_binding), E, gtype)
    t = be.screen_tables()
    vals = head_bytes(E, gtype)
    vals = (vals.astype(np.float32) if gtype != "BF16"
            else (vals.astype(np.uint32) << 16).view(np.float32))
    ref = EH.quantize_head(vals.astype(np.float64))
    assert np.array_equal(t.codes, ref[0]) and np.array_equal(t.scale, ref[1])
    codes2 = np.empty_like(t.codes)  # and the cpu backend's quantizer agrees
    none = (np.empty((0, 0), np.uint8), np.empty(0), np.empty(0))
    quantize_bits(vals, None, codes2, none[0], *(np.empty(V) for _ in range(4)),
                  np.empty(V, np.uint8), *none[1:], 8)
    assert np.array_equal(codes2, t.codes)
    h = (rng.standard_normal((3, dim)) * [[1], [1e-3], [40]]).astype(np.float32)
    xq, par = t.prepare(h)
    lo, hi = be.head_bounds(t, xq, par)
    rlo, rhi = EH.bounds_numpy(t, xq, par)
    assert np.array_equal(lo, rlo) and np.array_equal(hi, rhi)
    full = be.lm_head(h)
    assert ((lo <= full) & (full <= hi)).all()
    for ids in (np.arange(V), np.array([0]), np.array([V - 1]), np.sort(rng.choice(V, 97, False))):
        assert np.array_equal(be.head_rows(h, ids), full[:, ids])
    assert be.head_rows(h, np.array([], np.int64)).shape == (3, 0)


def test_bound_terms_cover_the_device():
    """The wgpu tables are wider than the cpu's: a depth of dim + 2, one ulp per rounding, and
    the norm of each row's flushable values (f16 subnormals)."""
    from bitformat.runtime.wgpu.head import UNIT, GpuScreenedHead, flushed_norms

    assert GpuScreenedHead.depth(2560) == 2562 and UNIT == 2.0 ** -23
    E = np.zeros((2, 8), np.float16)
    E[0, :3] = [2.0 ** -20, -(2.0 ** -15), 1.0]  # two f16 subnormals and a normal value
    E[1, 0] = 2.0 ** -14  # the smallest normal half
    lut = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    got = flushed_norms(E.view(np.uint16), GGMLType.F16, lut)
    assert got[0] == np.hypot(2.0 ** -20, 2.0 ** -15) and got[1] == 0


# -- the bound over thousands of steps ------------------------------------------------------------
@pytest.mark.parametrize("lanes,max_binding", CONFIGS)
@pytest.mark.parametrize("gtype,dim", [("F16", 256), ("BF16", 200), ("F32", 72)])
def test_bound_holds_every_row_every_step(devices, lanes, max_binding, gtype, dim):
    rng = np.random.default_rng(7)
    V = 2048
    be = wgpu_head_backend(devices(lanes, max_binding), rng.standard_normal((V, dim)) * 0.05,
                           gtype)
    head = Head(be, "screened", check=True)
    n = 1500 if lanes == 1 else 300
    hs = (rng.standard_normal((n, dim)) * rng.uniform(0.1, 10, (n, 1))).astype(np.float32)
    for name, p in SAMPLINGS.items():
        run_steps(head, hs if name == "greedy" else hs[:200], p)
    st = head.stats
    assert st.screened_rows == st.rows and not st.fallbacks
    assert np.mean(st.candidates) < V / 4
    assert st.head_bytes < st.steps * st.full_bytes


# -- adversarial heads ---------------------------------------------------------------------------
@pytest.mark.parametrize("lanes,max_binding", CONFIGS)
def test_adversarial_heads(devices, lanes, max_binding):
    """Duplicates, rows one f16 bit apart, huge and subnormal rows, ties, outliers (the cpu
    tests' head), plus a row of f16 subnormals only: the flush term's case."""
    rng = np.random.default_rng(3)
    E = adversarial_head(rng)
    E[104] = np.float16(2.0 ** -24) * rng.integers(-1000, 1000, E.shape[1])  # all subnormal
    E[105] = E[104]
    be = wgpu_head_backend(devices(lanes, max_binding), E, "F16")
    head = Head(be, "screened", check=True)
    assert head.tables.A[104] >= np.linalg.norm(E[104])  # all of it may be flushed
    dim = E.shape[1]
    hs = []
    for i in range(400):
        target = [30, 50, 61, 100, 101, 103, 10, 104][i % 8]
        x = E[target] * rng.uniform(0.5, 50) + rng.standard_normal(dim) * rng.uniform(0, 0.1)
        if target == 104:
            x = E[target] * 2.0 ** 20
        if i % 5 == 0:
            x[rng.integers(dim)] *= 1e4  # an outlier
        if i % 11 == 0:
            x = x * 1e-20
        if i % 13 == 0:
            x[::2] = 1e-39  # f32 subnormals (a device may flush them)
        hs.append(x)
    hs = np.asarray(hs, np.float32)
    hs[3] = 0  # every logit 0: every row ties
    for p in SAMPLINGS.values():
        run_steps(head, hs, p, history=[10, 20, 30, 40, 50])
    assert not head.stats.fallbacks


def test_ties_go_to_the_lowest_id(devices):
    E = np.zeros((512, 64), np.float32)
    E[300] = E[200] = E[250] = 0.5
    head = Head(wgpu_head_backend(devices(), E), "screened", check=True)
    assert head.select(np.ones((1, 64), np.float32), [Sampler()]) == [200]
    assert head.stats.candidates == [3]


def test_fallbacks_are_counted(devices):
    rng = np.random.default_rng(0)
    E = rng.standard_normal((700, 64)).astype(np.float32) * 0.1
    be = wgpu_head_backend(devices(), E)
    head = Head(be, "screened", check=True)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.9, seed=1))
    assert head.select(x, [s]) == Head(be, "full").select(x, [s])
    bad = x.copy()
    bad[0, 3] = np.nan
    head.select(bad, [Sampler()])
    # the full head's choices as the device makes them (argmax.wgsl for plain greedy rows)
    hs = np.concatenate([x, x * 2, x * -1])
    samplers = [Sampler(), Sampler(SamplingParams(temperature=0.9, top_k=5, seed=2)),
                Sampler(SamplingParams(repetition_penalty=1.5), history=[1, 2])]
    logits = be.lm_head(hs)
    assert be.pick_full(hs, samplers) == [s.pick(logits[r]) for r, s in enumerate(samplers)]
    head.select(x * np.float32(1e37), [Sampler()])
    assert head.stats.fallbacks == {"top-p or min-p without top-k": 1,
                                    "hidden state not finite": 1, "logits could overflow": 1}
    E[5, 5] = np.inf
    inf_head = Head(wgpu_head_backend(devices(), E), "screened")
    assert "NaN or infinity in 1 rows" in inf_head.unavailable


# -- whole models ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wgpu_models(devices, tiny_containers):
    from bitformat.runtime import load

    models = {fid: load(p, backend="wgpu") for fid, p in tiny_containers.items()}
    yield models
    for m in models.values():
        m.close()


def test_screened_equals_full_on_every_container(wgpu_models):
    prompts = [[1, 2, 3], [5, 9, 200, 17, 4], list(range(30, 100))]
    for fid, m in wgpu_models.items():
        assert m.head.mode == "screened" and not m.head.unavailable
        screened = m.net.head
        try:
            for i, prompt in enumerate(prompts):
                for kw in ({}, {"temperature": 0.8, "top_k": 40, "seed": i},
                           {"temperature": 1.1, "seed": 100 + i, "repetition_penalty": 1.2}):
                    n = 32 if i == 0 else 10
                    m.net.head = Head(m.backend, "screened", check=True)
                    got = m.generate(prompt, n, stop_ids=(), **kw).tokens
                    assert not m.net.head.stats.fallbacks
                    m.net.head = Head(m.backend, "full")
                    assert m.generate(prompt, n, stop_ids=(), **kw).tokens == got, (fid, i, kw)
        finally:
            m.net.head = screened


def test_long_generations_checked(wgpu_models):
    m = wgpu_models["i2_s"]
    screened = m.net.head
    try:
        for seed, kw in enumerate(({}, {"temperature": 0.7, "top_k": 50},
                                   {"temperature": 1.0, "repetition_penalty": 1.1})):
            m.net.head = Head(m.backend, "screened", check=True)
            got = m.generate([1, 2, 3], 200, stop_ids=(), seed=seed, **kw).tokens
            assert len(got) == 200 and m.net.head.stats.steps == 200
            m.net.head = Head(m.backend, "full")
            assert m.generate([1, 2, 3], 200, stop_ids=(), seed=seed, **kw).tokens == got
    finally:
        m.net.head = screened


def test_head_stats_and_modes(wgpu_models, tiny_gguf):
    from bitformat.runtime import load

    m = wgpu_models["i2_s"]
    m.generate([1, 2], 6, stop_ids=())
    st = m.head_stats()
    assert st["head"] == "screened" and st["head_steps"] == 6 and not st["head_fallbacks"]
    assert st["head_bytes_per_step"] < st["full_head_bytes"]
    m.generate([1, 2], 3, stop_ids=(), temperature=1.0, top_p=0.9, seed=1)
    assert m.head_stats()["head_fallbacks"] == {"top-p or min-p without top-k": 3}
    with load(tiny_gguf, backend="wgpu", head="full") as f:
        assert f.generate([1, 2], 6, stop_ids=()).tokens == m.generate([1, 2], 6,
                                                                        stop_ids=()).tokens
        st = f.head_stats()
    assert st["head"] == "full" and st["head_bytes_per_step"] == st["full_head_bytes"]
    assert st["head_steps"] == 6


@pytest.mark.parametrize("lanes,max_binding", CONFIGS)
def test_the_rounding_term_is_load_bearing(devices, lanes, max_binding):
    """Rows and a hidden state that int8 holds exactly (codes = values / 2^-7, x = q / 8):
    the screen's ``a_v`` is then the exact dot product, and all that separates it from the
    device's logit is the device's f32 rounding (partial sums past 2^14 round odd products).
    The bound must hold there, and without its rounding term it would not."""
    rng = np.random.default_rng(11)
    V, dim = 64, 4096
    c = rng.integers(100, 128, (V, dim))
    c[:, 0] = 127  # every row's max: d = 2^-7 exactly
    q = rng.integers(100, 128, dim)
    q[0] = 127  # s = 8 exactly: q1 = q, q2 = 0
    E = c * 2.0 ** -7
    x = (q * 2.0 ** -3).astype(np.float32)[None, :]
    be = wgpu_head_backend(devices(lanes, max_binding), E, "F16")
    t = be.screen_tables()
    xq, par = t.prepare(x)
    assert not xq[0, 1].any() and np.array_equal(xq[0, 0, :dim], q)
    lo, hi = be.head_bounds(t, xq, par)
    exact = (c @ q) * 2.0 ** -10  # int64 sums, exact in float64
    a = (lo + hi) / 2
    np.testing.assert_allclose(a[0], exact, rtol=1e-14)
    got = be.lm_head(x)[0].astype(np.float64)
    assert (got != exact).any()  # the device rounded
    assert ((lo[0] <= got) & (got <= hi[0])).all()
    bare = EH.ScreenTables.build(t.codes, t.scale, *(np.zeros(V) for _ in range(2)),
                                 np.zeros(V), np.zeros(V, bool), dim, 0, 2.0 ** -23)
    blo, bhi = EH.bounds_numpy(bare, xq, par)  # no rounding term (and no int8 error: none)
    assert ((got < blo[0]) | (got > bhi[0])).any()
    assert Head(be, "screened", check=True).select(x, [Sampler()]) == [int(np.argmax(got))]


# -- the screened head's greedy step on the device --------------------------------------------
def device_argmax(logits: np.ndarray) -> int:
    """The device's greedy choice: the largest logit, the lowest id among equal ones, NaN never
    (0 where every logit is NaN)."""
    ok = ~np.isnan(logits)
    if not ok.any():
        return 0
    return int(np.flatnonzero(ok & (logits == logits[ok].max()))[0])


def run_device_step(be, x: np.ndarray, cap: int):
    """One greedy step of the screened head on the device (GpuScreenedHead.step_dispatches)
    for hidden state ``x``: ``(lo, hi, token, count, candidate ids)``."""
    sh, dev, V = be._screen(), be.dev, be.vocab
    if not hasattr(be, "_step_bufs"):
        be._step_bufs = (dev.buffer(8 * be.head.n_parts, "parts"), dev.buffer(4 * V, "logits"),
                         dev.buffer(16, "result"), dev.buffer(16, "state"))
    step = sh.step_dispatches(*be._step_bufs, cap=cap)
    dev.write(be.xf, np.ascontiguousarray(x, np.float32))
    dev.run([*step.items, step.argmax])
    lh = np.frombuffer(dev.read(step.bounds, 8 * V), np.float32).reshape(V, 2)
    r = np.frombuffer(dev.read(be._step_bufs[2], 16), np.uint32)
    n = int(r[2])
    ids = np.frombuffer(dev.read(step.candidates, 4 * (cap + 1)), np.uint32)[1: 1 + min(n, cap)]
    return lh[:, 0], lh[:, 1], int(r[0]), n, np.sort(ids)


@pytest.mark.parametrize("lanes,max_binding", CONFIGS)
@pytest.mark.parametrize("gtype,dim", [("F16", 256), ("BF16", 200), ("F32", 72)])
def test_device_step_bounds_hold_and_choose_the_full_heads_token(devices, lanes, max_binding,
                                                                  gtype, dim):
    """The float32 bounds the device computes itself hold for every row (the device's own
    full-head logits lie inside them), are at most 2 % wider than the host's float64 ones,
    list exactly the rows whose upper bound reaches the largest lower bound, and give the
    full head's token; where the bound does not hold (x zero, not finite, logits that could
    overflow) or the candidates exceed the cap, the full head runs on the device instead."""
    from bitformat.runtime.wgpu.head import NONE

    rng = np.random.default_rng(dim)
    V = 1500
    E = rng.standard_normal((V, dim)) * 0.05
    E[:, 3] *= 8  # a few large columns: column scales
    E[9] = E[10]  # two equal rows: a tie
    be = wgpu_head_backend(devices(lanes, max_binding), E, gtype)
    t = be.screen_tables()
    hs = [rng.standard_normal(dim) * s for s in (1, 1e-3, 40, 1e-15)]
    spiky = rng.standard_normal(dim)
    spiky[[2, 50]] = [300, -900]
    hs.append(spiky)
    sub = rng.standard_normal(dim)
    sub[::3] = 1e-39  # f32 subnormals
    hs.append(sub)
    hs = np.asarray(hs, np.float32)
    for x in hs:
        lo, hi, token, n, ids = run_device_step(be, x, 2048)
        got = be.lm_head(x[None])[0]
        assert ((lo <= got) & (got <= hi)).all()
        hlo, hhi = be.head_bounds(t, *t.prepare(x[None]))
        assert ((hi - lo) <= (hhi[0] - hlo[0]) * 1.02).all()
        assert np.array_equal(ids, np.flatnonzero(hi >= lo.max())) and n == ids.size
        assert token == device_argmax(got)
    tie = np.zeros(dim, np.float32)
    tie[0] = 1.0
    _, _, token, n, ids = run_device_step(be, tie, 2048)
    got = be.lm_head(tie[None])[0]
    assert token == device_argmax(got) and token in ids
    nan = hs[0].copy()
    nan[5] = np.nan
    for x in (np.zeros(dim, np.float32), nan, hs[0] * np.float32(1e37)):
        _, _, token, n, _ = run_device_step(be, x, 2048)
        assert n == NONE and token == device_argmax(be.lm_head(x[None])[0])
    for cap in (0, 1):  # more candidates than the cap: the full head's argmax
        _, _, token, n, _ = run_device_step(be, hs[0], cap)
        assert n > cap or cap == 1
        assert token == device_argmax(be.lm_head(hs[0][None])[0])


def test_greedy_screened_steps_stay_on_the_device(wgpu_models):
    """Greedy decoding with the screened head runs its whole step on the device (no hidden
    state back to the host): the full head's tokens on every container, its candidates
    counted; with a cap of 0 candidates every step runs the full head there instead."""
    from bitformat.runtime.wgpu.network import WgpuBitNet
    for fid, m in wgpu_models.items():
        net = m.net
        assert net.screen is not None and net.screening(), fid
        assert net.dispatches_per_token == (len(net._seq(1, head=False, argmax=0))
                                            + len(net.screen.items) + 1)
        screened = net.head
        cap = net.screen.cap
        try:
            for prompt in ([1, 2, 3], list(range(30, 100))):
                net.head = Head(m.backend, "screened")
                got = m.generate(prompt, 24, stop_ids=()).tokens
                st = net.head.stats
                assert st.steps == st.screened_rows == 24 and not st.fallbacks, fid
                assert st.head_bytes < st.steps * st.full_bytes
                net.head = Head(m.backend, "full")
                assert m.generate(prompt, 24, stop_ids=()).tokens == got, (fid, prompt)
            want = m.generate([1, 2, 3], 8, stop_ids=()).tokens  # (the full head)
            # a second network on the same backend gets a step of its own (its own state,
            # result and maxima buffers), as tools/bench_gpu.py's tuned networks do
            other = WgpuBitNet(net.args, m.backend, head="screened", kv_type=net.kv_type)
            assert other.screen is not net.screen and other.screen.items
            assert other.generate_greedy([1, 2, 3], 8) == want, fid
            net.head = Head(m.backend, "screened")
            net.screen = m.backend._screen().step_dispatches(
                net.head_parts, net.logits, net.result, net.state, cap=0)
            assert m.generate([1, 2, 3], 8, stop_ids=()).tokens == want, fid
            assert net.head.stats.fallbacks == {"more than 0 candidates": 8}
        finally:
            net.head = screened
            net.screen = m.backend._screen().step_dispatches(
                net.head_parts, net.logits, net.result, net.state, cap=cap)
