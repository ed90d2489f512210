"""The cpu backend's kernels for a few tokens at once (runtime/cpu/batch.py): the 2-bit
mat-vec equals the one-token kernel to the bit, and the LM head gives each token the same
bits whatever else is in the call (and is close to a float64 reference)."""

from __future__ import annotations

import numpy as np
import pytest

from bitformat.runtime.backend import quantize_activations
from bitformat.runtime.cpu import kernels as K

pytestmark = pytest.mark.skipif(K.kernel_mode() != "vnni", reason="needs AVX-512 VNNI")


@pytest.mark.parametrize("layout,kind", [("x86", K.KIND_I2S), ("plain", K.KIND_LOW)])
@pytest.mark.parametrize("rows,cols", [(7, 256), (10, 640), (5, 512 + 128)])
def test_mm2_tokens_equals_one_token_kernel(layout, kind, rows, cols):
    from bitformat.runtime.cpu.batch import mm2_vnni_tokens

    rng = np.random.default_rng(rows * cols)
    W = rng.integers(0, 256, (rows, cols // 4), dtype=np.uint8)
    W[W & 3 == 3] ^= 1  # code 3 is not a trit (the kernels trust validated bytes)
    ws = rng.uniform(0.5, 2, rows).astype(np.float32)
    for T in (1, 2, 3, 5, 8, 13):
        qa = quantize_activations(rng.standard_normal((T, cols)).astype(np.float32))
        XG = K.slot_activations(qa.q, layout, cols)
        corr = qa.q.sum(axis=1, dtype=np.int32)
        want = np.empty((T, rows), np.float32)
        got = np.empty((T, rows), np.float32)
        K.mm2_vnni(W, XG, corr, qa.s, ws, kind, want)
        mm2_vnni_tokens(W, XG, corr, qa.s, ws, kind, got)
        np.testing.assert_array_equal(got, want, err_msg=f"T={T}")


@pytest.mark.parametrize("layout,kind", [("x86", K.KIND_I2S), ("plain", K.KIND_LOW)])
@pytest.mark.parametrize("rows,cols", [(16, 256), (53, 512), (300, 1024), (3, 256)])
def test_mm2_amx_tokens_equals_one_token_kernel(layout, kind, rows, cols):
    from bitformat.runtime.cpu import amx

    if not amx.available():
        pytest.skip("needs AMX-INT8 (and Linux's permission for it)")
    rng = np.random.default_rng(rows + cols)
    W = rng.integers(0, 256, (rows, cols // 4), dtype=np.uint8)
    W[W & 3 == 3] ^= 1
    ws = rng.uniform(0.5, 2, rows).astype(np.float32)
    for T in (1, 2, 3, 8, 13, 16, 17, 40, 64):
        qa = quantize_activations(rng.standard_normal((T, cols)).astype(np.float32))
        XG = K.slot_activations(qa.q, layout, cols)
        corr = qa.q.sum(axis=1, dtype=np.int32)
        want = np.empty((T, rows), np.float32)
        got = np.empty((T, rows), np.float32)
        K.mm2_vnni(W, XG, corr, qa.s, ws, kind, want)
        if T <= amx.MAX_TOKENS:
            amx.mm2_amx_tokens(W, XG, amx.tile_activations(XG, kind), amx.tile_config(T), corr,
                               qa.s, ws, kind, got)
        else:
            amx.mm2_amx_wide(W, XG, amx.tile_activations(XG, kind, -(-T // 16) * 16),
                             amx.tile_config(16), corr, qa.s, ws, kind, got)
        np.testing.assert_array_equal(got, want, err_msg=f"T={T}")


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("vocab,h", [(37, 256), (10, 80), (9, 100)])
def test_lm_head_tokens_rows_do_not_depend_on_the_batch(bf16, vocab, h):
    from bitformat.runtime.cpu.batch import lm_head_tokens

    rng = np.random.default_rng(vocab + h)
    vals = (rng.standard_normal((vocab, h)) * 0.05).astype(np.float32)
    if bf16:
        E = (vals.view(np.uint32) >> 16).astype(np.uint16)
        ref_e = (E.astype(np.uint32) << 16).view(np.float32)
    else:
        E = vals.astype(np.float16).view(np.uint16)
        ref_e = E.view(np.float16).astype(np.float32)
    X = rng.standard_normal((11, h)).astype(np.float32)
    together = np.empty((11, vocab), np.float32)
    lm_head_tokens(E, X, bf16, together)
    np.testing.assert_allclose(together, X.astype(np.float64) @ ref_e.T.astype(np.float64),
                               rtol=1e-5, atol=1e-5)
    for T in (1, 2, 3, 4, 8):
        part = np.empty((T, vocab), np.float32)
        for t0 in range(0, 11 - T + 1, T):
            lm_head_tokens(E, np.ascontiguousarray(X[t0:t0 + T]), bf16, part)
            np.testing.assert_array_equal(part, together[t0:t0 + T], err_msg=f"T={T}")


@pytest.mark.parametrize("vocab,width", [(37, 256), (48, 128), (300, 640), (261, 128)])
def test_screen_amx_equals_screen_vnni(vocab, width):
    from bitformat.runtime.cpu import amx
    from bitformat.runtime.cpu.screen import SCREEN_BLOCK, block_maxima, screen_vnni

    if not amx.available():
        pytest.skip("needs AMX-INT8 (and Linux's permission for it)")
    rng = np.random.default_rng(vocab + width)
    W = rng.integers(0, 256, (vocab, width), dtype=np.uint8)
    scale, A, N = (rng.random(vocab) for _ in range(3))
    for T in (2, 3, 8):
        XQ = rng.integers(-127, 128, (T, 2, width), dtype=np.int8)
        par = rng.random((T, 6))
        par[:, 4:] = rng.integers(-300, 300, (T, 2))
        want = np.empty((2, T, vocab))
        got = np.empty((2, T, vocab))
        wmax, gmax = block_maxima(vocab, T), block_maxima(vocab, T)
        screen_vnni(W, XQ, scale, A, N, par, want[0], want[1], wmax)
        amx.screen_amx(W, XQ, amx.screen_activations(XQ), amx.screen_config(T), scale, A, N,
                       par, got[0], got[1], gmax)
        np.testing.assert_array_equal(got, want, err_msg=f"T={T}")
        np.testing.assert_array_equal(gmax, wmax, err_msg=f"T={T}")
        for b in range(gmax.shape[0]):  # each block's largest bounds
            rows = slice(b * SCREEN_BLOCK, (b + 1) * SCREEN_BLOCK)
            np.testing.assert_array_equal(gmax[b], got[:, :, rows].max(axis=2))


@pytest.mark.parametrize("vocab,width", [(37, 256), (300, 640), (261, 128)])
def test_screen_amx7_equals_screen_vbmi7(vocab, width):
    from bitformat.runtime import head as EH
    from bitformat.runtime.cpu import amx
    from bitformat.runtime.cpu.kernels import host_features
    from bitformat.runtime.cpu.screen import block_maxima, screen_vbmi7

    if not amx.available() or "avx512vbmi" not in host_features():
        pytest.skip("needs AMX-INT8 and AVX512-VBMI")
    rng = np.random.default_rng(vocab * width)
    U = rng.integers(0, 128, (vocab, width), dtype=np.uint8)  # stored int7 codes h + 64
    W = EH.pack7(U)
    scale, A, N = (rng.random(vocab) for _ in range(3))
    t = EH.ScreenTables(W, scale, A, N, 1.0, 0, 1, 2.0 ** -24, bits=7)
    for T in (1, 2, 5, 8):
        XQ = rng.integers(-127, 128, (T, 2, width), dtype=np.int8)
        par = rng.random((T, 6))
        par[:, 4:] = XQ.sum(axis=2, dtype=np.int64)  # as split_hidden sets them
        want, got = (np.empty((2, T, vocab)) for _ in range(2))
        wsum, gsum = (np.empty((T, vocab, 2), np.int32) for _ in range(2))
        wmax, gmax = block_maxima(vocab, T), block_maxima(vocab, T)
        screen_vbmi7(W, XQ, scale, A, N, par, want[0], want[1], wmax, wsum)
        np.testing.assert_array_equal(  # the sums of the stored codes, exactly
            wsum, np.einsum("vk,tjk->tvj", U.astype(np.int64), XQ.astype(np.int64)))
        rlo, rhi = EH.bounds_numpy(t, XQ, par)  # of the signed codes 4 (u - 64) + 1
        np.testing.assert_array_equal(want, np.stack([rlo, rhi]), err_msg=f"T={T}")
        if T >= 2:
            amx.screen_amx7(W, XQ, amx.screen_activations(XQ), amx.screen_config(T), scale,
                            A, N, par, got[0], got[1], gmax, gsum)
            np.testing.assert_array_equal(got, want, err_msg=f"T={T}")
            np.testing.assert_array_equal(gmax, wmax, err_msg=f"T={T}")
            np.testing.assert_array_equal(gsum, wsum, err_msg=f"T={T}")
