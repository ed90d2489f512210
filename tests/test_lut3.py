"""lut3 tiles (bitformat/runtime/cpu/lut3.py): tq1_0 and iq1_bn on AVX-512 VBMI CPUs, a table
lookup per three trits. The packed bytes are read back by the layout the module documents
(written here again in numpy), the tables against their definition, and the mat-vec against
integer products computed by numpy, with the 2-bit kernels' epilogue."""

from __future__ import annotations

import numpy as np
import pytest

from bitformat.runtime.cpu import kernels as K
from bitformat.runtime.cpu import lut3 as L3

VBMI = "vnni" in K.builds_here() and "avx512vbmi" in K.host_features()
needs_vbmi = pytest.mark.skipif(not VBMI, reason="the lut3 kernels need AVX-512 VNNI and VBMI")


def _trits(rng, rows: int, cols: int) -> np.ndarray:
    t = rng.integers(-1, 2, (rows, cols)).astype(np.int8)
    t[rng.random((rows, cols)) < 0.35] = 0
    if rows >= 3:  # the largest sums a group can give, both signs, and an all-zero row
        t[0], t[1], t[2] = 1, -1, 0
    return t


def _unpack(tiles: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """The trits and sign sums that lut3 tiles hold, read as lut3.py's docstring lays them out."""
    nb = L3.blocks(cols)
    ntiles = tiles.shape[0]
    body = tiles[:, :nb * 320].reshape(ntiles, nb, 320)  # tile, block, bytes
    nib = body[..., :256].reshape(ntiles, nb, 4, 16, 4)  # ..., sub-tile, row r, group j
    idx = np.stack([nib & 15, nib >> 4], axis=-2)  # ..., r, quad, j
    bits = np.unpackbits(body[..., 256:].reshape(ntiles, nb, 4, 2, 8), axis=-1,
                         bitorder="little").reshape(ntiles, nb, 4, 2, 16, 4)
    neg = bits.transpose(0, 1, 2, 4, 3, 5)  # ..., r, quad, j
    assert idx.max() <= 13, "an index past the table's 14 entries"
    m = idx.astype(np.int64) + 13  # the combination of digits (t0+1, t1+1, t2+1)
    digits = np.stack([m // 9, (m // 3) % 3, m % 3], axis=-1) - 1
    digits = np.where(neg[..., None] == 1, -digits, digits)
    # tile, block, sub-tile, r, quad, j, k -> row (tile, sub-tile, r), column (block, quad, j, k)
    full = digits.transpose(0, 2, 3, 1, 4, 5, 6).reshape(ntiles * 64, nb * 24)
    sums = tiles[:, nb * 320:].copy().view("<i4").reshape(-1)
    return full[:rows, :cols].astype(np.int8), sums[:rows]


@pytest.mark.parametrize("rows,cols", [(64, 2560), (130, 100), (5, 7), (192, 6912)])
def test_packed_tiles_read_back_by_the_documented_layout(rows, cols):
    rng = np.random.default_rng(rows + cols)
    t = _trits(rng, rows, cols)
    tiles = L3.pack(t)
    assert tiles.shape == L3.shape(rows, cols) and tiles.nbytes == L3.nbytes(rows, cols)
    got, sums = _unpack(tiles, rows, cols)
    np.testing.assert_array_equal(got, t)
    # every group's sign (+1 unless its value is negated), padding groups included
    nb = L3.blocks(cols)
    padded = np.zeros((rows, nb * 24), np.int64)
    padded[:, :cols] = t
    g = padded.reshape(rows, -1, 3)
    n = (g[..., 0] + 1) * 9 + (g[..., 1] + 1) * 3 + g[..., 2] + 1
    np.testing.assert_array_equal(sums, np.where(n < 13, -1, 1).sum(axis=1))


@needs_vbmi
def test_tables_hold_each_combination_of_three_activations():
    rng = np.random.default_rng(1)
    q = rng.integers(-127, 128, (2, 100)).astype(np.int8)
    q[0, :3] = 127
    q[1, :3] = -127
    tb = np.zeros((2, L3.table_bytes(100)), np.uint8)
    K.lut3_tables(q, tb)
    qp = np.zeros((2, L3.blocks(100) * 24), np.int64)
    qp[:, :100] = q
    x = qp.reshape(2, -1, 4, 3)  # token, quad, group j, column k
    want = K.LUT_OFFSET + np.einsum("tqjk,ki->tqji", x, K.LUT_COEFFICIENTS[:, :14])
    got = tb.reshape(2, -1, 2, 4, 16).astype(np.int64)  # token, quad, low|high, j, entry
    np.testing.assert_array_equal(got[:, :, 0, :, :14] + 256 * got[:, :, 1, :, :14], want)


@needs_vbmi
@pytest.mark.parametrize("cols", [100, 2560, 6912])
def test_row_tables_only_read_the_row_the_threads_share(cols):
    """The one-call step's threads each make their own tables from one shared row of int8
    activations (decode._tables), so making them must not write that row: numba refuses to
    compile a write to a read-only array. They are lut3_tables' bytes."""
    from numba import njit

    @njit
    def row_tables(xp, cols, tb):
        K.lut3_row_tables(xp, cols, tb)

    rng = np.random.default_rng(2)
    q = rng.integers(-127, 128, (1, cols)).astype(np.int8)
    want = np.empty((1, L3.table_bytes(cols)), np.uint8)
    K.lut3_tables(q, want)
    xp = np.zeros(K.lut3_padded(cols), np.int8)
    xp[:cols] = q[0]
    xp.setflags(write=False)
    got = np.empty(L3.table_bytes(cols), np.uint8)
    row_tables(xp, cols, got)
    np.testing.assert_array_equal(got, want[0])


@needs_vbmi
@pytest.mark.parametrize("rows,cols,T", [(64, 2560, 1), (130, 100, 3), (5, 7, 1),
                                         (640, 6912, 2), (3840, 2560, 1), (200, 300, 16)])
def test_matvec_gives_exact_products_and_the_2bit_epilogue(rows, cols, T):
    rng = np.random.default_rng(cols + T)
    t = _trits(rng, rows, cols)
    q = rng.integers(-127, 128, (T, cols)).astype(np.int8)
    q[0, : min(cols, 30)] = 127
    tiles = L3.pack(t)
    tiles.setflags(write=False)
    tb = np.empty((T, L3.table_bytes(cols)), np.uint8)
    K.lut3_tables(q, tb)
    shared = np.empty_like(tb)  # a prompt's tables, the tokens shared between the threads
    K.lut3_tables_tokens(q, shared)
    np.testing.assert_array_equal(shared, tb)
    s = rng.uniform(0.5, 2, T).astype(np.float32)
    ws = rng.uniform(0.5, 2, rows).astype(np.float32)
    out = np.full((T, rows), np.nan, np.float32)
    K.mm_lut3(tiles, tb, s, ws, out)
    dots = q.astype(np.int64) @ t.T.astype(np.int64)
    want = dots.astype(np.float32) * ws[None, :] / s[:, None]  # float32(dot) * ws / s
    np.testing.assert_array_equal(out, want)


@needs_vbmi
@pytest.mark.parametrize("fid", ["tq1_0", "iq1_bn"])
def test_base3_containers_run_as_lut3_tiles_with_the_bits_of_i2_s(lut3_models, cpu_models, fid):
    """Asked for (BITFORMAT_CPU_LUT3=1) on a VBMI CPU, tq1_0 and iq1_bn are held as lut3
    tiles, which the one-call step runs, read fewer bytes than i2_s's rows and give i2_s's
    logits and tokens; by default they are lut3 tiles where the CPU has no AMX, else stfma
    rows (AMX tiles run their prompts)."""
    default = cpu_models[fid].backend
    assert (cpu_models[fid].net.blocks[0].proj["attn_q"].encoding
            == ("stfma" if default.amx else "lut3"))
    lm, ref = lut3_models[fid], cpu_models["i2_s"]
    be = lm.backend
    assert be.lut3
    assert {w.encoding for w in lm.net.blocks[0].proj.values()} == {"lut3"}
    plan = lm.net._decode_plan()
    assert plan is not None and (plan.mats[..., 4] == K.KIND_LUT3).all() and not plan.amx
    assert be.weight_bytes_per_token < ref.backend.weight_bytes_per_token
    prompt = [5, 17, 300, 42, 7, 99]
    np.testing.assert_array_equal(lm.logits(prompt), ref.logits(prompt))
    assert (lm.generate(prompt, max_new_tokens=6, stop_ids=[]).tokens
            == ref.generate(prompt, max_new_tokens=6, stop_ids=[]).tokens)


@pytest.mark.parametrize("value,amx,want", [("", False, True), ("", True, False),
                                            ("auto", False, True), ("auto", True, False),
                                            ("1", True, True), (" 1 ", False, True),
                                            ("0", False, False), ("0", True, False)])
def test_lut3_holding_is_chosen_by_the_environment(monkeypatch, value, amx, want):
    from bitformat.runtime.cpu.backend import LUT3_ENV, lut3_wanted

    monkeypatch.setenv(LUT3_ENV, value)
    assert lut3_wanted(amx) is want


def test_a_bad_lut3_setting_says_what_it_takes(monkeypatch):
    from bitformat.errors import RequestError
    from bitformat.runtime.cpu.backend import LUT3_ENV, lut3_wanted

    monkeypatch.setenv(LUT3_ENV, "yes")
    with pytest.raises(RequestError, match="BITFORMAT_CPU_LUT3 must be 1 .* got 'yes'"):
        lut3_wanted(False)


NO_VBMI = ("+avx512f,+avx512bw,+avx512vl,+avx512dq,+avx512cd,+avx512vnni,+avx2,+avx,+fma,+f16c,"
           "+bmi,+bmi2,+popcnt,+sse4.2,+sse4.1,+ssse3,+sse3,+sse2,+lzcnt,+movbe")

WITHOUT_VBMI = '''
import numpy as np
from bitformat.runtime.cpu import kernels as K, lut3 as L3
rng = np.random.default_rng(4)
t = rng.integers(-1, 2, (70, 50)).astype(np.int8)
q = rng.integers(-127, 128, (2, 50)).astype(np.int8)
tb = np.empty((2, L3.table_bytes(50)), np.uint8)
K.lut3_tables(q, tb)
out = np.empty((2, 70), np.float32)
K.mm_lut3(L3.pack(t), tb, np.ones(2, np.float32), np.ones(70, np.float32), out)
assert np.array_equal(out, (q.astype(np.int64) @ t.T.astype(np.int64)).astype(np.float32))
print("same")
'''


@needs_vbmi
def test_lut3_kernels_compile_for_a_vnni_cpu_without_vbmi(tmp_path):
    """Compiled for a VNNI CPU without VBMI (Cascade Lake), where LLVM has no vpermb and stops
    the process on its intrinsic, the lut3 kernels (which the one-call decode step holds) take
    the bytes another way and still give the products (run here, on a CPU that has both)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "NUMBA_CPU_NAME": "cascadelake", "NUMBA_CPU_FEATURES": NO_VBMI,
           "NUMBA_CACHE_DIR": str(tmp_path)}
    p = subprocess.run([sys.executable, "-c", WITHOUT_VBMI], env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0 and "same" in p.stdout, p.stderr[-2000:]


@needs_vbmi
@pytest.mark.parametrize("fid", ["tq1_0", "iq1_bn"])
def test_lut3_tiles_give_the_bits_of_the_containers_own_kernel(lut3_models, tiny_containers,
                                                               fid, monkeypatch):
    """tq1_0 and iq1_bn as lut3 tiles give the logits of the container's own kernel (read as
    it is), prompt and one-token steps alike."""
    from test_cpu_ops import _same_forward

    from bitformat.runtime.cpu.backend import CpuBackend

    assert lut3_models[fid].net.blocks[0].proj["attn_q"].encoding == "lut3"
    monkeypatch.setattr(CpuBackend, "_one_scale_rows", lambda self, e: False)
    _same_forward(lut3_models[fid], tiny_containers[fid], fid)
