"""The screened LM head (runtime/head.py, cpu/screen.py): the same tokens as the full head.

Every ``Head(..., check=True)`` below also computes the full logits on every step, asserts that
each row's logit lies inside its bounds and that the token is the full head's choice."""

from __future__ import annotations

import numpy as np
import pytest

from bitformat.constants import GGMLType
from bitformat.runtime import head as EH
from bitformat.runtime.head import Head
from bitformat.runtime.sampling import Sampler, SamplingParams

SAMPLINGS = {
    "greedy": SamplingParams(),
    "greedy+penalty": SamplingParams(repetition_penalty=1.3),
    "temp": SamplingParams(temperature=0.7, seed=11),
    "temp+topk": SamplingParams(temperature=0.9, top_k=40, seed=3),
    "topk+topp+minp": SamplingParams(temperature=1.2, top_k=20, top_p=0.8, min_p=0.05, seed=5),
    "hot+penalty": SamplingParams(temperature=2.0, top_k=5, repetition_penalty=0.7, seed=9),
}


def cpu_head_backend(E: np.ndarray, gtype: str = "F16", kernel: str | None = None,
                     bits: int | None = None):
    """A :class:`CpuBackend` holding only an LM head ``E`` (float values, stored as gtype),
    screening with ``bits``-bit codes (None: the backend's choice)."""
    from bitformat.runtime.cpu.backend import CpuBackend

    if gtype == "F32":
        stored = np.ascontiguousarray(E, np.float32)
    elif gtype == "F16":
        stored = np.ascontiguousarray(E, np.float16).view(np.uint16)
    else:
        stored = (np.ascontiguousarray(E, np.float32).view(np.uint32) >> 16).astype(np.uint16)
    be = CpuBackend.head_only(stored, GGMLType[gtype], kernel, threads=2)
    if bits is not None:
        be.screen_bits = bits
    return be


def kernels():
    from bitformat.runtime.cpu import kernels as K

    return K.builds_here()


def screens():
    """(kernel build, screen bits) this CPU runs: int8 on both builds, int7 where it has
    AVX512-VBMI (the vnni build's default there)."""
    from bitformat.runtime.cpu import kernels as K

    # int6: on this CPU's own build (its kernel-against-reference test covers every build)
    out = [(k, 8) for k in kernels()] + [(K.kernel_mode(), 6)]
    if "vnni" in kernels() and "avx512vbmi" in K.host_features():
        out.insert(0, ("vnni", 7))
    return out


def run_steps(head: Head, hs: np.ndarray, params: SamplingParams, history=()) -> list[int]:
    """Decode-like steps: one hidden state per step, tokens accepted into the history."""
    s = Sampler(params, history=list(history))
    out = []
    for x in hs:
        t = head.select(x[None, :], [s])[0]
        s.accept(t)
        out.append(t)
    return out


# -- the screen's numbers -------------------------------------------------------------------------
@pytest.mark.parametrize("kernel,bits", sorted(set(screens()) | {(k, 6) for k in kernels()}))
@pytest.mark.parametrize("dim", [64, 200, 257])
def test_screen_kernels_match_numpy_reference(kernel, bits, dim):
    from bitformat.runtime.cpu import screen as S

    rng = np.random.default_rng(dim)
    E = (rng.standard_normal((301, dim)) * 0.05).astype(np.float16)
    E[7] = 0  # a zero row
    E[8, 3] = 1.0  # a row whose codes reach the extremes (+-63 or +-127)
    E[9, 5] = -1.0
    E[:, 11] *= 8  # an outlier column: the screen scales it (column scales)
    be = cpu_head_backend(E.astype(np.float32), kernel=kernel, bits=bits)
    t = be.screen_tables()
    assert t.bits == bits and t.width == EH.padded(dim)
    cols = choose(E.astype(np.float32))
    assert cols is not None and cols[11] > 1
    assert t.cols is not None and np.array_equal(t.cols, cols)
    q = EH.quantize_head(E.astype(np.float64), bits, cols)
    Es = E.astype(np.float64) / cols  # the rows the codes are of
    codes, d, dn, qn, en, bad = q[:6]
    assert np.array_equal(t.codes, codes) and np.array_equal(t.scale, d) and not bad.any()
    assert t.codes.shape == (301, EH.padded(dim) * bits // 8)
    d8 = d if bits == 8 else 2 * d  # the int8 codes' scale
    c8 = t.signed_codes() if bits == 8 else t.fine_codes(np.arange(301))
    assert np.abs(c8).max() == 127 and not c8[:, dim:].any()
    inv = np.divide(1.0, d8, out=np.zeros_like(d8), where=d8 > 0)
    np.testing.assert_array_equal(c8[:, :dim], np.rint(Es * inv[:, None]))
    if bits != 8:  # the screen's codes: 4 floor(c / 2) + 1 or 8 floor(c / 4) + 3, the plane:
        # c's low bit or two
        assert np.array_equal(t.fine, q[6][0])
        k = t.signed_codes()[:, :dim]
        sp = EH.SPLIT[bits]
        assert np.array_equal(k, 2 * sp * np.floor(c8[:, :dim] / sp) + sp - 1)
    ref = EH.ScreenTables.build(codes, d, dn, qn, en, bad, dim, be.head_depth(), 2.0 ** -24,
                                bits=bits, fine=q[6] if bits != 8 else None, cols=cols)
    np.testing.assert_allclose(t.A, ref.A, rtol=1e-12)
    np.testing.assert_allclose(t.N, ref.N, rtol=1e-12)
    if bits != 8:
        np.testing.assert_allclose(t.fine_A, ref.fine_A, rtol=1e-12)
        np.testing.assert_allclose(t.fine_N, ref.fine_N, rtol=1e-12)
    for T in (1, 2, 7):  # 7: the batched screens' passes of 4, 2 and 1 tokens (and 301 rows:
        # a block whose last row has no partner)
        h = rng.standard_normal((T, dim)).astype(np.float32)
        xq, par = ref.prepare(h)
        lo, hi = be.head_bounds(ref, xq, par)
        rlo, rhi = EH.bounds_numpy(ref, xq, par)
        assert np.array_equal(lo, rlo) and np.array_equal(hi, rhi), f"{T} tokens"
    exact = h.astype(np.float64) @ E.astype(np.float64).T  # (the float32 kernel: within slack)
    if bits != 8:  # the int8 screen of some rows, from the first screen's sums
        ids = np.array([0, 5, 7, 8, 9, 150, 300])
        lo2, hi2 = be.head_refine(ref, ids, xq, par)
        rlo2, rhi2 = EH.refine_numpy(ref, ids, xq, par)
        assert np.array_equal(lo2, rlo2) and np.array_equal(hi2, rhi2)
        assert ((lo2 <= exact[:, ids]) & (exact[:, ids] <= hi2)).all()
        w1, w2 = hi[:, ids] - lo[:, ids], hi2 - lo2  # int8 bounds are the tighter
        assert (w2 <= w1).all() and (w2[:, ids != 7] < w1[:, ids != 7]).all()  # (7: zero row)
    assert ((lo <= exact) & (exact <= hi)).all()
    other = S.screen_portable if (kernel, bits) == ("vnni", 8) else None
    if other is not None:
        lo2, hi2 = np.empty_like(lo), np.empty_like(hi)
        bmax = S.block_maxima(*lo.shape[::-1])
        other(ref.codes, xq, ref.scale, ref.A, ref.N, par, lo2, hi2, bmax)
        assert np.array_equal(lo, lo2) and np.array_equal(hi, hi2)
        assert np.array_equal(bmax, block_maxima_numpy(lo, hi))


def block_maxima_numpy(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The screens' ``bmax`` [blocks, 2, T] from whole bounds [T, V], in numpy."""
    from bitformat.runtime.cpu import screen as S

    T, V = lo.shape
    pad = -V % S.SCREEN_BLOCK
    blocks = [np.pad(a, ((0, 0), (0, pad)), constant_values=-np.inf)
              .reshape(T, -1, S.SCREEN_BLOCK).max(axis=2).T for a in (lo, hi)]
    return np.stack(blocks, axis=1)


def test_int7_packing_round_trips():
    rng = np.random.default_rng(2)
    u = rng.integers(0, 128, (9, 192), dtype=np.uint8)
    p = EH.pack7(u)
    assert p.shape == (9, 168) and np.array_equal(EH.unpack7(p), u)
    # eight codes to seven bytes, little-endian: code m at bits 7m .. 7m + 6
    word = int.from_bytes(p[4, 14:21].tobytes(), "little")
    assert [(word >> (7 * m)) & 0x7F for m in range(8)] == u[4, 16:24].tolist()


def test_screen_bits_are_checked():
    be = cpu_head_backend(np.ones((64, 64), np.float32), kernel="portable")
    assert be.screen_bits == 8
    with pytest.raises(ValueError, match="portable build screens with int8"):
        be.screen_bits = 7
    with pytest.raises(ValueError, match="screen bits 4"):
        cpu_head_backend(np.ones((64, 64), np.float32), kernel="vnni", bits=4)


def test_hidden_split_bounds_its_error():
    rng = np.random.default_rng(1)
    for scale in (1e-30, 1e-3, 1.0, 1e4):
        x = rng.standard_normal(300) * scale
        x[5] *= 1000  # an outlier
        x = x.astype(np.float32).astype(np.float64)
        xq, par = EH.split_hidden(x.astype(np.float32), 320)
        s = 1 / (par[0] * EH.FINE)
        xh = (xq[0, :300].astype(np.float64) + xq[1, :300] / EH.FINE) / s
        assert np.linalg.norm(x - xh) <= par[2] and np.linalg.norm(x) <= par[1]
        assert par[4] == xq[0].sum() and par[5] == xq[1].sum()
        assert np.abs(xq).max() <= 127 and not xq[:, 300:].any()


def test_compiled_split_equals_numpy():
    """The cpu backend's compiled split (screen.split_hidden): the same int8 vectors, scale
    and sums, its two norms within their slack of numpy's (another summation order)."""
    from bitformat.runtime.cpu import screen as S

    rng = np.random.default_rng(4)
    for dim, width in ((2560, 2560), (300, 320), (64, 64)):
        for scale in (1e-30, 1e-3, 1.0, 1e4):
            x = (rng.standard_normal(dim) * scale).astype(np.float32)
            x[3] *= 1000  # an outlier
            xq, par = EH.split_hidden(x, width)
            got, gpar = np.full((2, width), 99, np.int8), np.empty(6)
            S.split_hidden(x, got, gpar)
            assert np.array_equal(got, xq)
            assert np.array_equal(gpar[[0, 3, 4, 5]], par[[0, 3, 4, 5]])
            np.testing.assert_allclose(gpar[1:3], par[1:3], rtol=4 * EH.norm_slack(dim))
            xh = (xq[0, :dim].astype(np.float64) + xq[1, :dim] / EH.FINE) / (
                1 / (par[0] * EH.FINE))
            x64 = x.astype(np.float64)
            assert np.linalg.norm(x64 - xh) <= gpar[2] and np.linalg.norm(x64) <= gpar[1]


# -- the bound over thousands of steps ------------------------------------------------------------
@pytest.mark.parametrize("kernel,bits", screens())
@pytest.mark.parametrize("gtype,dim", [("F16", 256), ("BF16", 200), ("F32", 72)])
def test_bound_holds_every_row_every_step(kernel, bits, gtype, dim):
    rng = np.random.default_rng(7)
    V = 2048
    be = cpu_head_backend(rng.standard_normal((V, dim)) * 0.05, gtype, kernel, bits)
    head = Head(be, "screened", check=True)
    hs = (rng.standard_normal((1500, dim)) * rng.uniform(0.1, 10, (1500, 1))).astype(np.float32)
    for name, p in SAMPLINGS.items():
        run_steps(head, hs[:1500 if name == "greedy" else 250], p)
    st = head.stats
    assert st.screened_rows == st.rows and not st.fallbacks
    assert np.mean(st.candidates) < V / 4  # the screen rules most rows out
    assert st.head_bytes < st.steps * st.full_bytes


# -- column scales (a trained head's outlier columns) -----------------------------------------
def outlier_head(rng, V=4096, dim=256, cols=(3, 70, 200), gain=(6.0, 3.0, 8.0),
                 xcols=(10, 150), xgain=(8.0, 5.0)):
    """A head like a trained one (Gemma 3 270M's, tools/screen_trained_head.py): Gaussian rows
    with a few columns much larger in every row, and hidden states with large values of their
    own in other columns."""
    E = rng.standard_normal((V, dim)) * 0.03
    X = rng.standard_normal((300, dim))
    E[:, cols] *= gain
    X[:, xcols] *= xgain
    return E.astype(np.float16).astype(np.float32), X.astype(np.float32)


def choose(E: np.ndarray) -> np.ndarray | None:
    """The cpu backend's choice (4,096 rows spread over the head)."""
    sample = np.asarray(E, np.float64)[EH.sample_rows(E.shape[0])]
    return EH.column_scales(EH.column_maxima(sample), sample[::4])


def test_column_scales_are_powers_of_two_for_outlier_columns():
    rng = np.random.default_rng(1)
    E, _ = outlier_head(rng)
    c = choose(E)
    assert c is not None and set(np.unique(np.log2(c))) <= set(range(-EH.MAX_SHIFT,
                                                                     EH.MAX_SHIFT + 1))
    assert c[3] >= 4 and c[70] >= 2 and c[200] >= 4
    assert (c[[k for k in range(256) if k not in (3, 70, 200)]] == 1).all()
    # a head without outlier columns keeps its codes: no scales at all
    assert choose(rng.standard_normal((4096, 64))) is None
    assert EH.column_scales(np.zeros(8), np.zeros((2, 8))) is None
    # an all-zero column and an infinite value change nothing
    E2 = E.copy()
    E2[:, 5] = 0
    E2[9, 7] = np.inf
    c2 = choose(E2)
    assert c2[5] == 1 and c2[7] == 1 and np.array_equal(c2[[3, 70, 200]], c[[3, 70, 200]])
    from bitformat.runtime.cpu import head as H
    from bitformat.runtime.cpu import screen as S
    bits16 = np.ascontiguousarray(E2, np.float16).view(np.uint16)
    assert np.array_equal(S.column_choice(bits16, H.lut16("F16")), c2)
    assert np.array_equal(S.column_choice(np.ascontiguousarray(E2, np.float32), None), c2)


def greedy_candidates(t: EH.ScreenTables, X: np.ndarray) -> np.ndarray:
    xq, par = t.prepare(X)
    lo, hi = EH.bounds_numpy(t, xq, par)
    return (hi >= lo.max(axis=1, keepdims=True)).sum(axis=1)


def test_column_scales_narrow_the_screen_of_an_outlier_head():
    rng = np.random.default_rng(2)
    E, X = outlier_head(rng)
    dim = E.shape[1]
    cols = choose(E)
    plain = EH.ScreenTables.build(*EH.quantize_head(E), dim, dim + 2, 2.0 ** -24)
    scaled = EH.ScreenTables.build(*EH.quantize_head(E, cols=cols), dim, dim + 2, 2.0 ** -24,
                                   cols=cols)
    exact = X.astype(np.float64) @ E.astype(np.float64).T
    for t in (plain, scaled):  # both rigorous
        xq, par = t.prepare(X)
        lo, hi = EH.bounds_numpy(t, xq, par)
        assert ((lo <= exact) & (exact <= hi)).all()
    n0, n1 = greedy_candidates(plain, X), greedy_candidates(scaled, X)
    assert n1.mean() * 3 < n0.mean() and np.percentile(n1, 99) < np.percentile(n0, 99)


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("kernel,bits", screens())
def test_outlier_head_checked_on_every_step(kernel, bits, aligned):
    """Column scales, the water-filling bound and every width in check mode, on hidden states
    with large values in other columns than the head's, or in the same ones (where scaling
    grows them further: the bound must hold all the same)."""
    rng = np.random.default_rng(4)
    E, X = outlier_head(rng, V=2048, xcols=(3, 200) if aligned else (10, 150),
                        xgain=(40.0, 1e3) if aligned else (8.0, 5.0))
    X[::7, 0] = 3e4  # and a lone huge value now and then
    be = cpu_head_backend(E, "F16", kernel, bits)
    head = Head(be, "screened", check=True)
    for name, p in SAMPLINGS.items():
        run_steps(head, X[:300 if name == "greedy" else 60], p, history=[1, 2, 3])
    t = be.screen_tables()
    assert t.cols is not None
    assert not head.stats.fallbacks and np.mean(head.stats.candidates) < 2048 / 8


# -- the water-filling bound ---------------------------------------------------------------------
def waterfill_exact(x: np.ndarray, n: float) -> float:
    """max sum w_k |x_k| over 0 <= w_k <= 1, sum w_k^2 <= n: w_k = min(1, lam |x_k|), lam by
    bisection (float64; the reference the table must bound)."""
    a = np.abs(x)
    nz = a[a > 0]
    if nz.size <= n:  # every nonzero value saturated
        return float(a.sum())
    lo, hi = 0.0, 1.0 / nz.min()  # lam = hi saturates all of them
    for _ in range(200):
        lam = (lo + hi) / 2
        w = np.minimum(1.0, lam * a)
        if (w * w).sum() > n:
            hi = lam
        else:
            lo = lam
    return float((np.minimum(1.0, lo * a) * a).sum())


@pytest.mark.parametrize("case", ["gaussian", "outliers", "one", "zeros", "tiny"])
def test_waterfill_table_bounds_the_optimum(case):
    rng = np.random.default_rng(5)
    dim = 200
    x = rng.standard_normal(dim)
    if case == "outliers":
        x[[3, 50, 51]] *= [300, -80, 40]
    elif case == "one":
        x[:] = 0
        x[7] = -5.0
    elif case == "zeros":
        x[:] = 0
    elif case == "tiny":
        x *= 1e-300
    G = EH.waterfill_table(x)
    n = np.arange(EH.WF_GRID + 1) * dim / EH.WF_GRID
    assert G[0] == 0 and (np.diff(G) >= 0).all()
    top = np.abs(x).max() or 1.0
    cs = np.sqrt(n) * np.linalg.norm(x / top) * top  # (scaled: the tiny case's squares)
    assert (G <= cs * (1 + 1e-12)).all()  # never looser than Cauchy-Schwarz
    for j in (1, 17, 100, 333, EH.WF_GRID // 2, EH.WF_GRID):
        assert waterfill_exact(x, n[j]) <= G[j]
    if case == "outliers":  # and much tighter where a few values dominate
        j = np.searchsorted(n, dim / 3)
        assert G[j] < 0.5 * cs[j]


def test_waterfill_narrows_an_outlier_hidden_state():
    rng = np.random.default_rng(6)
    E, X = outlier_head(rng, xgain=(60.0, 30.0))
    dim = E.shape[1]
    t = EH.ScreenTables.build(*EH.quantize_head(E), dim, dim + 2, 2.0 ** -24)
    exact = X.astype(np.float64) @ E.astype(np.float64).T
    xq, par = t.prepare(X)
    lo, hi = EH.bounds_numpy(t, xq, par)
    ids = np.arange(E.shape[0])
    lo3, hi3 = t.waterfill(X, ids, lo, hi, par)
    assert ((lo3 <= exact) & (exact <= hi3)).all()
    assert (lo3 >= lo).all() and (hi3 <= hi).all()
    ratio = ((hi3 - lo3) / (hi - lo)).mean()
    assert ratio < 0.65, ratio  # x's two large values: much tighter


# -- the first pass's width, chosen from what pays ---------------------------------------------
def test_the_head_switches_to_int6_where_it_pays():
    rng = np.random.default_rng(0)
    dim = 128  # few values a row: int6's first pass leaves a small share of the rows
    be = cpu_head_backend(rng.standard_normal((4096, dim)) * 0.05, "F16")
    head = Head(be, "screened", check=True)  # check: every step's bounds and token asserted
    assert head.tables.bits == head.default_bits != 6 and 6 in head.choice
    hs = rng.standard_normal((12, dim)).astype(np.float32)
    run_steps(head, hs, SAMPLINGS["greedy"])
    assert head.tables.bits == 6 and len(head.switches) == 1
    assert f"after {Head.CHOOSE_STEPS} steps" in head.switches[0]
    d = head.stats.as_dict()
    assert d["screen_bits"] == 6 and d["screen_switches"] == head.switches
    assert d["first_pass_candidates_per_step_mean"] > d["candidates_per_step_mean"]
    run_steps(head, hs[:4], SAMPLINGS["temp+topk"])  # and sampling on int6 tables


def test_the_head_keeps_its_width_where_int6_does_not_pay():
    rng = np.random.default_rng(0)
    dim = 2048  # many values a row: int6's bound leaves too many rows
    be = cpu_head_backend(rng.standard_normal((4096, dim)) * 0.05, "F16")
    head = Head(be, "screened", check=True)
    run_steps(head, rng.standard_normal((8, dim)).astype(np.float32), SAMPLINGS["greedy"])
    assert head.tables.bits == head.default_bits != 6
    assert not head.switches and not head.choice  # decided: no more estimates


def test_int6_gives_way_where_its_first_pass_grows():
    rng = np.random.default_rng(0)
    dim = 2048
    be = cpu_head_backend(rng.standard_normal((4096, dim)) * 0.05, "F16")
    head = Head(be, "screened", check=True)
    head.tables = be.switch_screen(6)  # as if int6 had been chosen on other hidden states
    run_steps(head, rng.standard_normal((8, dim)).astype(np.float32), SAMPLINGS["greedy"])
    assert head.tables.bits == head.default_bits != 6
    assert "int6 -> int" in head.switches[0] and "seen at" in head.switches[0]


def test_a_set_width_is_kept():
    rng = np.random.default_rng(0)
    be = cpu_head_backend(rng.standard_normal((4096, 128)) * 0.05, "F16", bits=8)
    head = Head(be, "screened")
    assert not head.choice
    run_steps(head, rng.standard_normal((8, 128)).astype(np.float32), SAMPLINGS["greedy"])
    assert head.tables.bits == 8 and not head.switches


# -- adversarial heads ---------------------------------------------------------------------------
def adversarial_head(rng, V=1024, dim=128):
    E = (rng.standard_normal((V, dim)) * 0.02).astype(np.float16)
    E[10] = E[20] = E[30]  # duplicates: exact ties
    E[40] = E[50]
    bits = E[50].view(np.uint16).copy()
    bits[::3] ^= 1  # the last f16 bit
    E[40] = bits.view(np.float16)
    E[60] = E[61]
    E[60, 0] = np.nextafter(E[61, 0], np.float16(np.inf))  # one value one ulp apart
    E[100] *= 1500  # huge norm (f16 values up to ~60000 ... kept finite)
    E[100] = np.clip(E[100].astype(np.float32), -60000, 60000).astype(np.float16)
    E[101] = np.float16(6e-8) * rng.integers(-3, 4, dim)  # subnormal halves
    E[102] = 0
    E[103] = np.float16(1e-4)  # a constant row
    return E.astype(np.float32)


@pytest.mark.parametrize("kernel,bits", screens())
def test_adversarial_heads(kernel, bits):
    rng = np.random.default_rng(3)
    E = adversarial_head(rng)
    be = cpu_head_backend(E, "F16", kernel, bits)
    head = Head(be, "screened", check=True)
    dim = E.shape[1]
    hs = []
    for i in range(400):
        target = [30, 50, 61, 100, 101, 103, 10][i % 7]
        x = E[target] * rng.uniform(0.5, 50) + rng.standard_normal(dim) * rng.uniform(0, 0.1)
        if i % 5 == 0:
            x[rng.integers(dim)] *= 1e4  # an outlier
        if i % 11 == 0:
            x = x * 1e-20
        hs.append(x)
    hs = np.asarray(hs, np.float32)
    hs[3] = 0  # every logit 0: every row ties
    for p in SAMPLINGS.values():
        run_steps(head, hs, p, history=[10, 20, 30, 40, 50])
    assert not head.stats.fallbacks


def test_ties_go_to_the_lowest_id():
    E = np.zeros((512, 64), np.float32)
    E[300] = E[200] = E[250] = 0.5
    be = cpu_head_backend(E)
    head = Head(be, "screened", check=True)
    x = np.ones((1, 64), np.float32)
    assert head.select(x, [Sampler()]) == [200]
    assert head.stats.candidates == [3]


@pytest.mark.parametrize("kernel,bits", screens())
def test_greedy_rescores_only_rows_that_can_win(kernel, bits):
    """Greedy reads the candidate with the largest upper bound first and then only the
    candidates whose upper bound reaches its exact logit: fewer f16 rows, the same tokens
    (check mode compares every step with the full head), ties still to the lowest id."""
    rng = np.random.default_rng(9)
    E = rng.standard_normal((4096, 256)) * 0.05
    E[1000] = E[3000] = E[2000]  # exact ties
    be = cpu_head_backend(E, "F16", kernel, bits)
    head = Head(be, "screened", check=True)
    hs = (rng.standard_normal((300, 256)) * 3).astype(np.float32)
    hs[:20] = E[2000] * 40  # steps the tied rows win
    s = Sampler()
    got = [head.select(x[None], [s])[0] for x in hs]
    assert got[:20] == [1000] * 20
    st = head.stats
    assert all(r <= c for r, c in zip(st.rescored, st.candidates, strict=True))
    assert sum(st.rescored) < 0.8 * sum(st.candidates)
    full = Head(be, "full")
    assert got == [full.select(x[None], [s])[0] for x in hs]


def test_batched_rows_pick_like_single_rows():
    rng = np.random.default_rng(5)
    be = cpu_head_backend(rng.standard_normal((3000, 128)) * 0.05)
    head = Head(be, "screened", check=True)
    full = Head(be, "full")
    hs = rng.standard_normal((6, 128)).astype(np.float32)
    params = list(SAMPLINGS.values())
    samplers = [Sampler(p, history=[1, 2, 3]) for p in params]
    got = head.select(hs, samplers)
    assert got == full.select(hs, samplers)
    assert got == [head.select(hs[i: i + 1], [s])[0] for i, s in enumerate(samplers)]


# -- fallbacks ------------------------------------------------------------------------------------
def test_fallbacks_are_counted():
    rng = np.random.default_rng(0)
    E = rng.standard_normal((700, 64)).astype(np.float32) * 0.1
    be = cpu_head_backend(E)
    head = Head(be, "screened", check=True)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.9, seed=1))
    assert head.select(x, [s]) == Head(be, "full").select(x, [s])
    s = Sampler(SamplingParams(temperature=1.0, min_p=0.1, seed=1))
    head.select(x, [s])
    bad = x.copy()
    bad[0, 3] = np.nan
    head.select(bad, [Sampler()])
    head.select(x * np.float32(1e37), [Sampler()])  # logits could overflow float32
    assert head.stats.fallbacks == {"top-p or min-p without top-k": 2,
                                    "hidden state not finite": 1, "logits could overflow": 1}
    E[5, 5] = np.inf
    inf_head = Head(cpu_head_backend(E), "screened")
    assert "NaN or infinity in 1 rows" in inf_head.unavailable
    inf_head.select(x, [Sampler()])
    assert inf_head.stats.fallbacks == {inf_head.unavailable: 1}
    with pytest.raises(Exception, match="head must be screened or full"):
        Head(be, "fast")


# -- whole models: every container, both backends -----------------------------------------------
def test_screened_equals_full_on_every_container(cpu_models):
    prompts = [[1, 2, 3], [5, 9, 200, 17, 4], list(range(30, 100))]
    for fid, m in cpu_models.items():
        assert m.head.mode == "screened"
        screened, m.net.head = m.net.head, Head(m.backend, "screened", check=True)
        full = Head(m.backend, "full")
        try:
            for i, prompt in enumerate(prompts):
                for kw in ({}, {"temperature": 0.8, "top_k": 40, "seed": i},
                           {"temperature": 1.1, "seed": 100 + i, "repetition_penalty": 1.2}):
                    n = 48 if i == 0 else 12
                    got = m.generate(prompt, n, **kw).tokens
                    m.net.head, checked = full, m.net.head
                    want = m.generate(prompt, n, **kw).tokens
                    m.net.head = checked
                    assert got == want, (fid, i, kw)
        finally:
            m.net.head = screened


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_numpy_reference_screened_equals_full(tiny_gguf, dtype):
    from bitformat.runtime import load

    with load(tiny_gguf, backend="numpy", dtype=dtype) as m:
        m.net.head = Head(m.backend, "screened", check=True)
        got = [m.generate([1, 2, 3], 20, temperature=t, top_k=k, seed=4).tokens
               for t, k in ((0.0, 0), (0.9, 30), (0.9, 0))]
        m.net.head = Head(m.backend, "full")
        want = [m.generate([1, 2, 3], 20, temperature=t, top_k=k, seed=4).tokens
                for t, k in ((0.0, 0), (0.9, 30), (0.9, 0))]
    assert got == want


def test_load_head_option(tiny_gguf):
    from bitformat.runtime import load

    with load(tiny_gguf, backend="cpu", head="full") as m:
        assert m.head.mode == "full"
        m.generate([1, 2], 4)
        st = m.head_stats()
    assert st["head"] == "full" and st["head_bytes_per_step"] == st["full_head_bytes"]
    with pytest.raises(Exception, match="head must be"):
        load(tiny_gguf, backend="cpu", head="int8")


@pytest.mark.parametrize("bits", [8, 7])
def test_long_generations_checked(cpu_models, bits):
    m = cpu_models["i2_s"]
    if bits not in [b for _, b in screens()] or m.backend.kernel != "vnni":
        pytest.skip(f"this CPU has no int{bits} screen")
    before = m.backend.screen_bits
    m.backend.screen_bits = bits
    screened, m.net.head = m.net.head, Head(m.backend, "screened", check=True)
    assert m.net.head.tables.bits == bits
    try:
        for kw in ({}, {"temperature": 0.7, "top_k": 50, "seed": 8},
                   {"temperature": 1.0, "seed": 2, "repetition_penalty": 1.1}):
            got = m.generate([1, 2, 3], 240, stop_ids=(), **kw).tokens
            assert len(got) == 240
            checked, m.net.head = m.net.head, Head(m.backend, "full")
            assert m.generate([1, 2, 3], 240, stop_ids=(), **kw).tokens == got
            m.net.head = checked
        assert m.net.head.stats.steps == 240 and not m.net.head.stats.fallbacks
    finally:
        m.net.head = screened
        m.backend.screen_bits = before


@pytest.mark.parametrize("T", [1, 3, 8])
def test_compiled_greedy_candidates_equal_numpy(T):
    """The cpu backend's candidate pass (screen.greedy_candidates, which reads only the blocks
    whose largest upper bound reaches the top) picks the rows the numpy expression picks: ties
    at the threshold, equal lower bounds in several rows, a vocabulary that is not a whole
    number of blocks."""
    from bitformat.runtime.cpu import screen as S

    rng = np.random.default_rng(T)
    V = 30 * S.SCREEN_BLOCK + 77
    for trial in range(20):
        a = rng.standard_normal((T, V)).round(1)  # many equal values
        b = np.abs(rng.standard_normal((T, V))) * (0.05 if trial % 2 else 0.5)
        lo, hi = a - b, a + b
        top = lo.max(axis=1)
        hi[:, rng.integers(0, V, 5)] = top[:, None]  # exactly at the threshold
        want = np.flatnonzero((hi >= lo.max(axis=1, keepdims=True)).any(axis=0))
        got = S.greedy_candidates(lo, hi, block_maxima_numpy(lo, hi))
        assert got.dtype == np.int64 and np.array_equal(got, want)
        assert want.size >= T
