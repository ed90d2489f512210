"""Every WGSL kernel against a numpy reference, on fresh random inputs, on lavapipe.

Outputs are filled with a NaN bit pattern (:data:`POISON`) before each dispatch, so a value the
kernel forgets to write, or a write past its rows, shows. Each test draws a new seed and names
it in its failure messages. Integer sums are checked exactly (``s = scale = 1`` makes the
output the integer sum itself); with real scales the float epilogue is compared with numpy's
float32 operations to within a few ulp (WGSL does not promise correctly rounded division).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from bitformat.constants import GGMLType
from bitformat.formats import get_format
from bitformat.formats.i2_s import I2S
from bitformat.formats.rans import Rans
from bitformat.runtime.backend import attention, quantize_activations, rms_norm, rope
from bitformat.runtime.wgpu.backend import (
    GpuEmbedding,
    GpuMatrix,
    GpuRans,
    RowMatrix,
    activation_block,
)
from bitformat.runtime.wgpu.device import UNIFORM_WORDS, Dispatch
from bitformat.ternary import TernaryTensor

POISON = np.uint32(0x7FC0DEAD)  # a quiet NaN with a payload


class SeededRng:
    """A fresh numpy Generator that remembers its seed (for failure messages)."""

    def __init__(self, seed: int):
        self.seed, self._g = seed, np.random.default_rng(seed)

    def __getattr__(self, name: str):
        return getattr(self._g, name)


@pytest.fixture
def rng():
    return SeededRng(int(np.random.SeedSequence().entropy % (1 << 32)))


def poisoned(dev, n_words: int, label: str = "out"):
    buf = dev.buffer(4 * n_words, label)
    dev.write(buf, np.full(buf.size // 4, POISON, np.uint32))
    return buf


def read(dev, buf, n: int, dtype=np.float32) -> np.ndarray:
    return np.frombuffer(dev.read(buf, 4 * n), dtype).copy()


def ulps(a: np.ndarray, b: np.ndarray) -> int:
    """Largest distance in float32 ulps (0 where equal)."""
    ia = a.astype(np.float32).view(np.int32).astype(np.int64)
    ib = b.astype(np.float32).view(np.int32).astype(np.int64)
    ia = np.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = np.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return int(np.abs(ia - ib).max()) if a.size else 0


def where(bad: np.ndarray) -> str:
    idx = np.argwhere(bad)[:5]
    return ", ".join(str(tuple(int(v) for v in i)) for i in idx)


# -- activation block ------------------------------------------------------------------------------
def test_activation_block_layout(rng):
    q = rng.integers(-128, 128, 300).astype(np.int8)
    blk = activation_block(q, 0.5)
    assert blk.view(np.float32)[0] == 0.5 and blk.view(np.int32)[1] == q.sum()
    assert blk.view(np.int32)[4:6].tolist() == [q[:256].sum(), q[256:].sum()]
    plain = blk[256: 256 + 128].view(np.int8)
    assert np.array_equal(plain[:300], q) and not plain[300:].any()
    slot = blk[256 + 128: 256 + 256].view(np.int8).reshape(-1, 4, 4)  # [w, g, k]
    qp = np.concatenate([q, np.zeros(212, np.int8)])
    for w, g, k in [(0, 0, 0), (0, 1, 0), (0, 0, 1), (3, 2, 3), (18, 3, 2)]:
        assert slot[w, g, k] == qp[16 * w + g + 4 * k]


# -- norm_block (the quantization every fused mat-vec runs first) ---------------------------------
def norm_block(dev, n, a, b, gain, *, quant, combine=None, act=0, norm=True, trace=None):
    from bitformat.runtime.wgpu.backend import fused_subs

    subs = fused_subs("", n)
    subs["XV4"] = str(64 + 2 * (-(-n // 256) * 16))
    k = dev.kernel("norm_block", subs, COLS=n, QUANT=int(quant), NORM=int(norm),
                   COMBINE=int(combine is not None), ACT=act, EPS=np.float32(1e-5), LAYOUT=2,
                   TRACE=int(trace is not None))
    q_buf, f_buf = poisoned(dev, UNIFORM_WORDS, "x"), poisoned(dev, n + 4, "y")
    dev.run([Dispatch("norm", k, dev.bind(k, a, b, gain, q_buf, f_buf,
                                          trace if trace is not None else dev.scratch),
                      (1, 1, 1))])
    return q_buf, f_buf


@pytest.mark.parametrize("n,act", [(256, None), (100, None), (2560, None), (6912, None),
                                   (9000, None), (512, 0), (300, 0), (512, 1)])
@pytest.mark.parametrize("norm", [True, False])
def test_norm_block(gpu, rng, n, act, norm):
    """The int8 block (both layouts, the sums) of RMSNorm(x) (or of x itself), x optionally
    act(gate) * up, against numpy; the traced y and q; QUANT = 0's f32 RMSNorm."""
    dev = gpu
    a = (rng.standard_normal(n) * rng.uniform(0.1, 30)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    gain = rng.uniform(0.2, 2.0, n).astype(np.float32)
    if act is None:
        x = a
    elif act == 0:
        x = (np.maximum(a, 0) ** 2 * b).astype(np.float32)
    else:
        with np.errstate(over="ignore"):  # exp(-a) = inf: a / inf = -0, as the kernel
            x = (a / (1 + np.exp(-a)) * b).astype(np.float32)
    want_y = rms_norm(x[None], gain, np.float32(1e-5))[0] if norm else x
    ab, bb, gb = dev.upload(a), dev.upload(b), dev.upload(gain)
    trace = poisoned(dev, 4 + n + n // 4 + 4, "trace")
    q_buf, _ = norm_block(dev, n, ab, bb, gb, quant=True, norm=norm, trace=trace,
                          combine=None if act is None else bb, act=act or 0)
    t = read(dev, trace, 4 + n + -(-n // 4), np.uint32)
    y, s = t[4: 4 + n].view(np.float32), t[:1].view(np.float32)[0]
    blk = read(dev, q_buf, UNIFORM_WORDS, np.uint32)
    q = blk[256:].view(np.int8)[:n]
    assert np.array_equal(q, t[4 + n:].view(np.int8)[:n])
    assert np.abs(y - want_y).max() <= 2e-6 * np.abs(want_y).max(), f"seed {rng.seed}"
    want = quantize_activations(want_y[None])
    assert abs(s - want.s[0]) <= 1e-6 * want.s[0]
    # q is exactly the GPU's own y quantized (ties to even), and the block layout is exact
    assert np.array_equal(q, np.clip(np.rint(y * s), -128, 127).astype(np.int8))
    npad = -(-n // 256) * 256
    used = np.r_[0, 1, 4: 4 + npad // 256, 256: 256 + npad // 2]  # every word it defines
    assert np.array_equal(blk[used], activation_block(q, float(s))[used]), f"seed {rng.seed}"
    # against numpy's quantization: only values on a rounding boundary may differ, by one step
    diff = q != want.q[0]
    if diff.any():
        half = np.minimum(q, want.q[0])[diff] + 0.5
        mine, theirs = (y * s)[diff].astype(np.float64), (want_y * want.s[0])[diff]
        assert (np.abs(q.astype(int) - want.q[0])[diff] == 1).all()
        assert ((np.abs(mine - half) <= 4e-7 * half)
                | ((mine - half) * (theirs - half) <= 0)).all(), f"seed {rng.seed}"
    if norm and act is None:  # QUANT = 0: the normalized vector itself (the LM head's input)
        _, f0 = norm_block(dev, n, ab, bb, gb, quant=False)
        got = read(dev, f0, n + 4)
        assert np.abs(got[:n] - want_y).max() <= 2e-6 * np.abs(want_y).max()
        assert np.isnan(got[n:]).all()


# -- the row-format mat-vecs ---------------------------------------------------------------------
ROW_CASES = [("i2_s", (5, 384)), ("i2_s", (64, 128)), ("i2_s_arm64", (3, 320)),
             ("tq2_0", (4, 768)), ("tq2_0", (3, 256)), ("tq1_0", (3, 512)),
             ("tq1_0", (5, 256)), ("stfma", (7, 100)), ("stfma", (70, 16)),
             ("colpack_u32", (3, 200)), ("colpack_u32", (9, 2560))]
DEVICE_CASES = [(1, "uniform", None), (4, "storage", None), (16, "uniform", None),
                (1, "storage", "split")]


def row_matrix(fid: str, trits: np.ndarray, rng, unit: bool) -> tuple[RowMatrix, TernaryTensor]:
    rows, cols = trits.shape
    if fid in ("tq2_0", "tq1_0"):
        d = np.ones((rows, cols // 256), np.float32) if unit else rng.uniform(
            -2, 2, (rows, cols // 256)).astype(np.float16).astype(np.float32)
        t = TernaryTensor(trits, d, 256)
    else:
        t = TernaryTensor(trits, np.float32([1.0 if unit else rng.uniform(0.5, 2)]))
    fmt = I2S(fid[5:] or "x86") if fid.startswith("i2_s") else get_format(fid)
    raw = fmt.encode(t).view(np.uint8)
    if fid.startswith("i2_s"):
        rm = RowMatrix("w", "i2_s", rows, cols, raw[: rows * cols // 4].reshape(rows, -1),
                       float(t.scales[0]), {"BLK": fmt.block})
    else:
        rm = RowMatrix("w", fid, rows, cols, raw.reshape(rows, -1),
                       1.0 if t.scale_block else float(t.scales[0]))
    return rm, t


def reference(t: TernaryTensor, q: np.ndarray, s: np.float32) -> np.ndarray:
    """numpy's float32 BitLinear of one token (numpy_backend.py), from exact integer sums:
    ``float32(float32(sum_b d_b * isum_b) / s)`` (docs/model.md §2)."""
    if t.scale_block == 0:
        acc = (t.trits.astype(np.int64) @ q.astype(np.int64)).astype(np.float32)
        return acc * np.float32(t.scales[0]) / s
    nb = t.cols // 256
    acc = np.einsum("rbk,bk->rb", t.trits.reshape(t.rows, nb, 256).astype(np.int64),
                    q.reshape(nb, 256).astype(np.int64)).astype(np.float64)
    return (acc * t.scales.astype(np.float64)).sum(axis=1).astype(np.float32) / s


@pytest.mark.parametrize("lanes,x_space,split", DEVICE_CASES)
@pytest.mark.parametrize("fid,shape", ROW_CASES)
def test_row_matvec(devices, rng, fid, shape, lanes, x_space, split):
    rows, cols = shape
    gate = rng.integers(-1, 2, shape).astype(np.int8)
    up = rng.integers(-1, 2, shape).astype(np.int8)
    for unit in (True, False):
        rm, t = row_matrix(fid, gate, rng, unit)
        rm2, t2 = row_matrix(fid, up, rng, unit)
        # "split": bindings of three rows, so the matrix is cut into chunks
        mb = 2 * 3 * (-(-rm.row_bytes // 4) * 4) + 16 if split else None
        dev = devices(lanes, x_space, mb)
        q = rng.integers(-128, 128, cols).astype(np.int8)
        s = np.float32(1.0 if unit else rng.uniform(0.01, 3))
        x = dev.buffer(4 * UNIFORM_WORDS, "x", uniform=True)
        dev.write(x, activation_block(q, s))
        want, want2 = reference(t, q, s), reference(t2, q, s)
        if unit:  # the integer sum itself: exact
            assert np.array_equal(want, (t.dense(np.float64) @ q).astype(np.float32))
        pad = 8
        single = GpuMatrix(dev, [rm])
        if split:
            assert len(single.chunks) == -(-rows // 6) or rows <= 6
        # MODE 0: write
        y = poisoned(dev, rows + pad)
        dev.run(single.dispatches(x, y, 0))
        got = read(dev, y, rows + pad)
        assert np.isnan(got[rows:]).all(), "wrote past its rows"
        msg = f"{fid} {shape} unit={unit} seed {rng.seed}"
        if unit:
            assert np.array_equal(got[:rows], want), f"{msg}: rows {where(got[:rows] != want)}"
        else:
            assert ulps(got[:rows], want) <= 4, msg
        # MODE 1: add to the residual
        h = rng.standard_normal(rows + pad).astype(np.float32)
        yb = dev.upload(h)
        dev.run(single.dispatches(x, yb, 1, (0.5, 1.0)))
        got = read(dev, yb, rows + pad)
        assert np.array_equal(got[rows:], h[rows:])
        assert np.abs(got[:rows] - (h[:rows] + want * np.float32(0.5))).max() <= 1e-6 * (
            1 + np.abs(want).max()), msg
        # MODE 2: fused gate/up, relu(gate)^2 * up
        pair = GpuMatrix(dev, [rm, rm2])
        y = poisoned(dev, rows + pad)
        dev.run(pair.dispatches(x, y, 2))
        got = read(dev, y, rows + pad)
        g = np.maximum(want, 0)
        exp = g * g * want2
        assert np.isnan(got[rows:]).all()
        assert np.abs(got[:rows] - exp).max() <= 1e-5 * (1 + np.abs(exp).max()), msg


# -- rans ------------------------------------------------------------------------------------------
def rans_trits(rng, rows: int, cols: int, dead_rows: int, dead_cols: int,
               p0_max: float = 0.9) -> np.ndarray:
    p0 = rng.uniform(0.1, p0_max, (rows, 1))  # rows of different density: several tables
    r = rng.random((rows, cols))
    t = np.where(r < p0, 0, np.where(rng.random((rows, cols)) < 0.5, -1, 1)).astype(np.int8)
    t[rng.choice(rows, dead_rows, replace=False)] = 0
    t[:, rng.choice(cols, dead_cols, replace=False)] = 0
    return t


@pytest.mark.parametrize("shape,dead,mode,tables", [
    ((160, 300), (3, 7), "group5", 16),  # k = 14 rows per stream, T > 4: tables read from M
    ((40, 300), (0, 0), "group5", 4),    # T <= 4: tables in workgroup memory
    ((130, 64), (5, 2), "group5", 1),    # k = 62 rows per stream
    ((3, 10000), (1, 300), "group5", 2),  # C >= 8192: pieces (p = 2), atomics + finish
    ((12, 700), (2, 5), "trit", 4),      # single-trit symbols
])
@pytest.mark.parametrize("lanes,x_space", [(1, "uniform"), (8, "storage")])
def test_rans_matvec(devices, rng, shape, dead, mode, tables, lanes, x_space):
    from bitformat.formats import rans as R

    dev = devices(lanes, x_space)
    rows, cols = shape
    trits = rans_trits(rng, rows, cols, *dead, p0_max=0.3 if cols > 8192 else 0.97)
    scale = np.float32(rng.uniform(0.5, 2))
    raw = Rans(mode, max_tables=tables).encode(TernaryTensor(trits, np.float32([scale])))
    head = R.describe(raw)
    msg = f"{shape} {mode} T={head['tables']} seed {rng.seed}"
    assert np.array_equal(get_format("rans").decode(raw, rows, cols, scale=float(scale)).trits,
                          trits)
    xl = dev.buffer(4 * UNIFORM_WORDS, "x_live", uniform=True)
    m = GpuRans(dev, "w", raw, rows, cols, float(scale), xl)
    assert head["pieces"] == (2 if cols > 8192 else 1), msg
    assert (head["tables"] > 4) == (tables > 4), msg  # both lookup-table paths are covered
    q = rng.integers(-128, 128, cols).astype(np.int8)
    s = np.float32(rng.uniform(0.01, 3))
    x = dev.buffer(4 * UNIFORM_WORDS, "x", uniform=True)
    dev.write(x, activation_block(q, s))
    acc = trits.astype(np.int64) @ q.astype(np.int64)
    want = acc.astype(np.float32) * scale / s
    y = poisoned(dev, rows + 4)
    dev.run(m.dispatches(x, y, 0))
    got = read(dev, y, rows + 4)
    assert np.isnan(got[rows:]).all()
    assert ulps(got[:rows], want) <= 4, f"{msg}: rows {where(got[:rows] != want)}"
    h = rng.standard_normal(rows).astype(np.float32)
    yb = dev.upload(h)
    dev.run(m.dispatches(x, yb, 1, (2.0, 1.0)))
    assert np.abs(read(dev, yb, rows) - (h + want * 2)).max() <= 1e-6 * (1 + np.abs(want).max())


# -- embedding and LM head -------------------------------------------------------------------------
def fake_embedding(rng, gtype: GGMLType, vocab: int, dim: int):
    e = rng.standard_normal((vocab, dim)).astype(np.float32)
    if gtype == GGMLType.F16:
        raw, dec = e.astype(np.float16), e.astype(np.float16).astype(np.float32)
    elif gtype == GGMLType.BF16:
        raw = (e.view(np.uint32) >> 16).astype(np.uint16)
        dec = (raw.astype(np.uint32) << 16).view(np.float32)
    else:
        raw, dec = e, e
    model = SimpleNamespace(plain=lambda name: (gtype, raw.reshape(-1).view(np.uint8)),
                            entry=lambda name: SimpleNamespace(shape=(vocab, dim)))
    return model, dec


@pytest.mark.parametrize("gtype,dim", [(GGMLType.F16, 96), (GGMLType.BF16, 96),
                                       (GGMLType.F32, 97)])
@pytest.mark.parametrize("lanes,split", [(1, False), (1, True), (8, True)])
def test_lm_head_and_embed(devices, rng, gtype, dim, lanes, split):
    vocab = 300
    model, dec = fake_embedding(rng, gtype, vocab, dim)
    row_bytes = dim * (4 if gtype == GGMLType.F32 else 2)
    dev = devices(lanes, None, 70 * row_bytes if split else None)
    emb = GpuEmbedding(dev, model)
    assert len(emb.chunks) == (5 if split else 1)
    x = rng.standard_normal(dim).astype(np.float32)
    xf = dev.buffer(4 * UNIFORM_WORDS, "xf", uniform=True)
    dev.write(xf, x)
    logits = poisoned(dev, vocab + 4)
    dev.run(emb.head_dispatches(xf, logits))
    got = read(dev, logits, vocab + 4)
    assert np.isnan(got[vocab:]).all()
    want = dec.astype(np.float64) @ x
    assert np.abs(got[:vocab] - want).max() <= 1e-5 * np.abs(want).max(), f"seed {rng.seed}"
    state = dev.buffer(64, "state")
    h = dev.buffer(4 * (3 * dim + 4))
    for tok in (0, 69, 70, 141, vocab - 1, int(rng.integers(vocab))):
        dev.write(state, np.array([tok, 0, 1, 0], np.uint32))
        dev.write(h, np.full(3 * dim + 4, POISON, np.uint32))
        dev.run(emb.embed_dispatches(state, h))  # every chunk; the token's writes its row
        got = read(dev, h, dim + 4)
        assert np.array_equal(got[:dim], dec[tok]) and np.isnan(got[dim:]).all(), tok
    ids = [int(t) for t in rng.integers(0, vocab, 3)]  # a batched prompt's rows
    dev.write(state, np.array([0, 0, 3, 0, *ids], np.uint32))
    dev.run([Dispatch(d.kind, d.kernel, d.group, (d.grid[0], d.grid[1], 3))
             for d in emb.embed_dispatches(state, h, batch=True)])
    got = read(dev, h, 3 * dim + 4)
    assert np.array_equal(got[: 3 * dim], dec[ids].reshape(-1)) and np.isnan(got[3 * dim:]).all()


@pytest.mark.slow
def test_lm_head_of_2b4t_size(gpu):
    """128256 x 2560 f16 (656.7 MB, 2B-4T's tied embedding) under the adapter's binding limit
    (128 MiB on lavapipe: 5 chunks), then the GPU argmax."""
    vocab, dim = 128256, 2560
    bits = np.empty(vocab * dim, np.uint16)
    step = 1 << 24
    for i in range(0, bits.size, step):  # a hash of the index: finite f16, 2^-7 <= |v| < 2
        h = (np.arange(i, min(bits.size, i + step), dtype=np.uint32) * np.uint32(2654435761)
             ) >> np.uint32(19)
        bits[i: i + step] = (h & 0x3FFF) ^ (h & 0x8000) | 0x2000
    model = SimpleNamespace(plain=lambda name: (GGMLType.F16, bits.view(np.uint8)),
                            entry=lambda name: SimpleNamespace(shape=(vocab, dim)))
    emb = GpuEmbedding(gpu, model)
    per = gpu.max_binding // (2 * dim)
    assert len(emb.chunks) == -(-vocab // per) and all(2 * dim * c[1] <= gpu.max_binding
                                                      for c in emb.chunks)
    x = np.random.default_rng().standard_normal(dim).astype(np.float32)
    xf = gpu.buffer(4 * UNIFORM_WORDS, "xf", uniform=True)
    gpu.write(xf, x)
    logits, res = poisoned(gpu, vocab), poisoned(gpu, 4)
    k = gpu.kernel("argmax", N=vocab)
    gpu.run(emb.head_dispatches(xf, logits) + [Dispatch("argmax", k, gpu.bind(k, logits, res),
                                                        (1, 1, 1))])
    got = read(gpu, logits, vocab)
    e = bits.view(np.float16).reshape(vocab, dim)
    want = np.concatenate([e[i: i + 16384].astype(np.float32) @ x
                           for i in range(0, vocab, 16384)])
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert read(gpu, res, 1, np.uint32)[0] == np.argmax(got)


# -- attention, argmax ----------------------------------------------------------------------------
def attention_kernels(dev, H, KV, hd, ML, *, qkn=0, perm=0, batch=0, kvt=0):
    from bitformat.runtime.wgpu.network import CMAX, SPAR, SPLIT, splits

    smax, gq = splits(ML), H // KV
    qkvs = (H + 2 * KV) * hd
    common = dict(H=H, KVH=KV, HD=hd, QKN=qkn, PERM=perm, EPS=np.float32(1e-6), KVT=kvt)
    split = dev.kernel("attn_split", {"QS4": str(gq * hd // 4), "SCN": str(gq * CMAX)},
                       ML=ML, INV=np.float32(1 / np.sqrt(hd)), SMAX=smax, CMAX=CMAX,
                       BATCH=batch, QKVS=qkvs, **common)
    merge = dev.kernel("attn_merge", HD=hd, SMAX=smax, SPLIT=SPLIT, SPAR=SPAR, CMAX=CMAX)
    kvw = dev.kernel("kv_write", QKVS=qkvs, **common)
    return split, merge, kvw, smax


def hf_rows(x: np.ndarray, perm: bool) -> np.ndarray:
    """q/k heads as the model reads them: llama files hold interleaved rows (perm)."""
    from bitformat.runtime.models.base import interleave_order

    return x[..., np.argsort(interleave_order(x.shape[-1]))] if perm else x


@pytest.mark.parametrize("n", [1, 7, 32, 33, 150, 300])
@pytest.mark.parametrize("qkn,perm", [(0, 0), (1, 0), (0, 1)])
def test_attention_step(gpu, rng, n, qkn, perm):
    """attn_split (RoPE, q/k norms, the new key and value into the cache, runs of positions)
    then attn_merge, against numpy's rope and attention at position n - 1."""
    from bitformat.runtime.wgpu.network import splits

    dev = gpu
    H, KV, hd, ML = 4, 2, 64, 320
    pos = n - 1
    split, merge, _, smax = attention_kernels(dev, H, KV, hd, ML, qkn=qkn, perm=perm)
    inv_freq = 1.0 / 500000.0 ** (np.arange(0, hd, 2) / hd)
    ang = np.arange(ML, dtype=np.float32)[:, None] * inv_freq.astype(np.float32)
    cos, sin = np.cos(ang), np.sin(ang)
    q = rng.standard_normal((1, H, hd)).astype(np.float32) * 3
    k = rng.standard_normal((1, KV, hd)).astype(np.float32) * 3
    v = rng.standard_normal((1, KV, hd)).astype(np.float32)
    kc = rng.standard_normal((ML, KV, hd)).astype(np.float32) * 3
    vc = rng.standard_normal((ML, KV, hd)).astype(np.float32)
    kc[pos:] = np.frombuffer(np.full(kc[pos:].size, POISON, np.uint32).tobytes(), np.float32
                             ).reshape(kc[pos:].shape)
    gains = rng.uniform(0.5, 1.5, 2 * hd).astype(np.float32)
    qkv = dev.upload(np.concatenate([q.reshape(-1), k.reshape(-1), v.reshape(-1)]))
    kcb, vcb = dev.upload(kc), dev.upload(vc)
    cs = dev.upload(np.concatenate([cos, sin], axis=1))
    state = dev.upload(np.array([0, pos, n, 0], np.uint32))
    part, out = poisoned(dev, H * smax * (hd + 4)), poisoned(dev, H * hd + 4)
    ng = dev.upload(gains)
    dev.run([Dispatch("attention", split, dev.bind(split, qkv, kcb, vcb, cs, state, part, ng),
                      (KV, splits(n), 1)),
             Dispatch("attention", merge, dev.bind(merge, part, state, out), (H, 1, 1))])
    qh, kh = hf_rows(q, perm), hf_rows(k, perm)
    if qkn:
        qh = rms_norm(qh, gains[:hd], np.float32(1e-6))
        kh = rms_norm(kh, gains[hd:], np.float32(1e-6))
    want_q = rope(qh, cos[pos: pos + 1], sin[pos: pos + 1])
    want_k = rope(kh, cos[pos: pos + 1], sin[pos: pos + 1])
    got_kc = read(dev, kcb, kc.size).reshape(kc.shape)
    got_vc = read(dev, vcb, vc.size).reshape(vc.shape)
    assert np.abs(got_kc[pos] - want_k[0]).max() <= 2e-6 * np.abs(want_k).max()
    assert np.array_equal(got_kc[:pos], kc[:pos]) and np.isnan(got_kc[pos + 1:]).all()
    assert np.array_equal(got_vc[pos], v[0]) and np.array_equal(got_vc[:pos], vc[:pos])
    want = attention(want_q, got_kc[:n], got_vc[:n], pos)[0]
    got = read(dev, out, H * hd + 4)
    assert np.isnan(got[H * hd:]).all()
    assert np.abs(got[: H * hd] - want).max() <= 2e-5 * np.abs(want).max(), f"n={n} {rng.seed}"


def test_f16_cache_rounds_as_numpy(gpu, rng):
    """KVT = 1 (an f16 cache, kv_round.wgsl): the values attn_split stores are numpy's
    float16 roundings, bit for bit: ties to even, subnormals, overflow to infinity."""
    from bitformat.runtime.wgpu.network import splits

    dev = gpu
    H, KV, hd, ML = 4, 2, 64, 64
    split, _, _, smax = attention_kernels(dev, H, KV, hd, ML, kvt=1)
    special = np.array([1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11), 65519.0, 65520.0, -7e4,
                        2**-25, 3 * 2**-25, 1e-8, -2.5e-6, 6.1e-5, 2**-14 + 2**-25, 0.0, -0.0,
                        1.0009765625, 2049.0, 4097.0, 0.1], np.float32)
    v = (rng.standard_normal((KV, hd)) * rng.uniform(1e-6, 1e3, (KV, hd))).astype(np.float32)
    v.reshape(-1)[:special.size] = special
    q = rng.standard_normal((H, hd)).astype(np.float32)
    k = rng.standard_normal((KV, hd)).astype(np.float32)
    kcb, vcb = poisoned(dev, ML * KV * hd), poisoned(dev, ML * KV * hd)
    inv_freq = 1.0 / 500000.0 ** (np.arange(0, hd, 2) / hd)
    ang = np.arange(ML, dtype=np.float32)[:, None] * inv_freq.astype(np.float32)
    cs = dev.upload(np.concatenate([np.cos(ang), np.sin(ang)], axis=1))
    qkv = dev.upload(np.concatenate([q.reshape(-1), k.reshape(-1), v.reshape(-1)]))
    state = dev.upload(np.array([0, 0, 1, 0], np.uint32))
    part = poisoned(dev, H * smax * (hd + 4))
    ng = dev.upload(np.ones(2 * hd, np.float32))
    dev.run([Dispatch("attention", split, dev.bind(split, qkv, kcb, vcb, cs, state, part, ng),
                      (KV, splits(1), 1))])
    got = read(dev, vcb, KV * hd)
    with np.errstate(over="ignore"):  # 65520 and -7e4 become infinities, as they should
        want = v.reshape(-1).astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    keys = read(dev, kcb, KV * hd)  # rotated, then rounded: float16 values
    assert np.array_equal(keys, keys.astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("qkn,perm", [(0, 0), (1, 1)])
def test_attention_of_a_batched_prompt(gpu, rng, qkn, perm):
    """kv_write caches a prompt's keys and values, then attn_split (BATCH) and attn_merge give
    each token the causal attention over its own positions."""
    from bitformat.runtime.wgpu.network import splits

    dev = gpu
    H, KV, hd, ML, T, p0 = 4, 2, 32, 128, 9, 40
    split, merge, kvw, smax = attention_kernels(dev, H, KV, hd, ML, qkn=qkn, perm=perm, batch=1)
    inv_freq = 1.0 / 10000.0 ** (np.arange(0, hd, 2) / hd)
    ang = np.arange(ML, dtype=np.float32)[:, None] * inv_freq.astype(np.float32)
    cos, sin = np.cos(ang), np.sin(ang)
    q = rng.standard_normal((T, H, hd)).astype(np.float32) * 2
    k = rng.standard_normal((T, KV, hd)).astype(np.float32) * 2
    v = rng.standard_normal((T, KV, hd)).astype(np.float32)
    kc = rng.standard_normal((ML, KV, hd)).astype(np.float32)
    vc = rng.standard_normal((ML, KV, hd)).astype(np.float32)
    gains = rng.uniform(0.5, 1.5, 2 * hd).astype(np.float32)
    qkv = dev.upload(np.concatenate([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], 1))
    kcb, vcb, ng = dev.upload(kc), dev.upload(vc), dev.upload(gains)
    cs = dev.upload(np.concatenate([cos, sin], axis=1))
    state = dev.upload(np.array([0, p0, p0 + T, 0], np.uint32))
    part, out = poisoned(dev, T * H * smax * (hd + 4)), poisoned(dev, T * H * hd)
    dev.run([Dispatch("attention", kvw, dev.bind(kvw, qkv, kcb, vcb, cs, state, ng), (KV, 1, T)),
             Dispatch("attention", split, dev.bind(split, qkv, kcb, vcb, cs, state, part, ng),
                      (KV, splits(p0 + T), T)),
             Dispatch("attention", merge, dev.bind(merge, part, state, out), (H, T, 1))])
    qh, kh = hf_rows(q, perm), hf_rows(k, perm)
    if qkn:
        qh = rms_norm(qh, gains[:hd], np.float32(1e-6))
        kh = rms_norm(kh, gains[hd:], np.float32(1e-6))
    want_q = rope(qh, cos[p0: p0 + T], sin[p0: p0 + T])
    want_kc = kc.copy()
    want_kc[p0: p0 + T] = rope(kh, cos[p0: p0 + T], sin[p0: p0 + T])
    got_kc = read(dev, kcb, kc.size).reshape(kc.shape)
    assert np.abs(got_kc - want_kc).max() <= 2e-6 * np.abs(want_kc).max()
    vfull = vc.copy()
    vfull[p0: p0 + T] = v
    assert np.array_equal(read(dev, vcb, vc.size).reshape(vc.shape), vfull)
    want = attention(want_q, got_kc[: p0 + T], vfull[: p0 + T], p0)
    got = read(dev, out, T * H * hd).reshape(T, -1)
    assert np.abs(got - want).max() <= 2e-5 * np.abs(want).max(), f"seed {rng.seed}"


def test_head_maxima_and_argmax_step(gpu, rng):
    """lm_head_step's per-workgroup maxima and argmax_step: the lowest row among equal maxima
    (as numpy.argmax) across workgroups and chunks, and the state advanced for the next step."""
    vocab, dim = 700, 64
    model, dec = fake_embedding(rng, GGMLType.F32, vocab, dim)
    dev = gpu
    emb = GpuEmbedding(dev, model)
    x = np.zeros(dim, np.float32)
    x[0] = 1.0  # logits = column 0 of the rows: chosen below
    xf = dev.buffer(4 * UNIFORM_WORDS, "xf", uniform=True)
    dev.write(xf, x)
    parts = dev.buffer(8 * emb.n_parts)
    logits, res = poisoned(dev, vocab), poisoned(dev, 4)
    head = emb.head_dispatches(xf, logits, parts)
    k = dev.kernel("argmax_step", N=emb.n_parts, STEP=1)
    state = dev.upload(np.array([5, 10, 11, 0], np.uint32))
    for case in ("random", "tie", "last", "-inf"):
        col = rng.standard_normal(vocab).astype(np.float32)
        if case == "tie":
            i, j = sorted(rng.choice(vocab, 2, replace=False))
            col[[i, j]] = col.max() + 1
        elif case == "last":
            col[-1] = col.max() + 1
        elif case == "-inf":
            col[:] = -np.inf
        rows = dec.copy()
        rows[:, 0] = col
        e2 = GpuEmbedding.from_rows(dev, GGMLType.F32, rows, vocab, dim)
        head = e2.head_dispatches(xf, logits, parts)
        dev.write(state, np.array([5, 10, 11, 0], np.uint32))
        dev.run(head + [Dispatch("argmax", k, dev.bind(k, parts, res, state), (1, 1, 1))])
        got = read(dev, res, 2, np.uint32)[0]
        assert got == np.argmax(col), case
        assert list(read(dev, state, 3, np.uint32)) == [got, 11, 12]


@pytest.mark.parametrize("n", [1, 511, 512, 128256])
def test_argmax(gpu, rng, n):
    logits = rng.standard_normal(n).astype(np.float32)
    cases = [logits]
    if n > 3:
        tie = logits.copy()
        i, j = sorted(rng.choice(n, 2, replace=False))
        tie[[i, j]] = tie.max() + 1  # two equal maxima: the lower index wins
        last = logits.copy()
        last[-1] = last.max() + 1
        cases += [tie, last, np.full(n, -np.inf, np.float32)]
    k = gpu.kernel("argmax", N=n)
    for v in cases:
        lb, rb = gpu.upload(v), poisoned(gpu, 4)
        gpu.run([Dispatch("argmax", k, gpu.bind(k, lb, rb), (1, 1, 1))])
        got = read(gpu, rb, 2, np.uint32)
        assert got[0] == np.argmax(v), f"seed {rng.seed}"
        assert got[1:2].view(np.float32)[0] == v[np.argmax(v)] or not np.isfinite(v).any()


def test_bad_shader_names_the_kernel(gpu):
    from bitformat.errors import BitformatError

    with pytest.raises(BitformatError, match="creating kernel argmax"):
        gpu.kernel("argmax", N=4, NOT_AN_OVERRIDE=1)
