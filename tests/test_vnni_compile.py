"""The vnni build's kernels compiled, not run, for a CPU that has AVX-512 VNNI, VBMI and AMX,
on a machine that may lack them (the CI machine may: then nothing else here would even
compile them). A fresh process with numba's target set to Sapphire Rapids and an empty kernel
cache compiles the mat-vecs of every container with a vnni kernel and the int8 and int6
screens; an error in their LLVM IR or typing fails here instead of on a user's machine. The
one-call decode steps are left out: compiled for that target they took more than ten minutes
here."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from bitformat.runtime.cpu.kernels import builds_here

FEATURES = ("+avx512f,+avx512bw,+avx512vl,+avx512dq,+avx512cd,+avx512vnni,+avx512vbmi,"
            "+amx-tile,+amx-int8,+avx2,+avx,+fma,+f16c,+bmi,+bmi2,+popcnt,+sse4.2,+sse4.1,"
            "+ssse3,+sse3,+sse2,+lzcnt,+movbe")

SCRIPT = textwrap.dedent('''
    import numpy as np
    from numba import typeof
    from bitformat.runtime.cpu import kernels as K, screen as S

    def sig(*a):
        return tuple(typeof(x) for x in a)

    def ro(a):
        a.setflags(write=False)
        return a

    i64 = np.int64(1)
    W = ro(np.zeros((4, 128), np.uint8))
    XG = np.zeros((2, 4, 128), np.int8)
    corr, s = np.zeros(2, np.int32), np.ones(2, np.float32)
    ws, out = np.ones(4, np.float32), np.zeros((2, 4), np.float32)
    for k in (K.mm2_vnni, K.mm2_vnni_prompt):
        k.compile(sig(W, XG, corr, s, ws, i64, out))
    bsum = np.zeros((2, 2), np.int32)
    K.tq2_vnni.compile(sig(ro(np.zeros((4, 132), np.uint8)), XG, bsum, s, out))
    K.tq1_vnni.compile(sig(ro(np.zeros((4, 108), np.uint8)), np.zeros((2, 512), np.int8), bsum,
                           s, out))
    tb = np.zeros((2, 256), np.uint8)
    K.lut3_tables.compile(sig(np.zeros((2, 24), np.int8), tb))
    K.mm_lut3.compile(sig(ro(np.zeros((1, 576), np.uint8)), tb, s, ws, out))
    codes = ro(np.zeros((8, 64), np.uint8))
    xq, par = np.zeros((1, 2, 64), np.int8), np.zeros((1, 6))
    lo, bmax = np.zeros((1, 8)), S.block_maxima(8, 1)
    S.screen_vnni.compile(sig(codes, xq, np.ones(8), np.ones(8), np.ones(8), par, lo, lo, bmax))
    S.screen6_vnni.compile(sig(ro(np.zeros((8, 48), np.uint8)), xq, np.ones(8), np.ones(8),
                               np.ones(8), par, lo, lo, bmax, np.zeros((1, 8, 2), np.int32)))
    print("compiled")
''')


def test_vnni_build_compiles_for_a_vnni_cpu(tmp_path):
    if "vnni" in builds_here():
        pytest.skip("this CPU runs the vnni build: the kernel tests run it")
    env = {**os.environ, "NUMBA_CPU_NAME": "sapphirerapids", "NUMBA_CPU_FEATURES": FEATURES,
           "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-4000:]
