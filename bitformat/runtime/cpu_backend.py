"""The ``cpu`` backend: numba kernels over the container bytes, on every core.

Float32 throughout. BitLinear runs one kernel per container (:mod:`.cpu_kernels`) with int8
activations and int32 sums; the kernel build (``vnni`` or ``portable``) is chosen once per
process (:func:`~.cpu_kernels.kernel_mode`). Matrices no kernel reads (an i2_s matrix whose
rows do not start on a 128-value block, an hf folder's packed rows) are decoded to int8 trits
once at load and use a generic int8 kernel. With ``validate`` (the default) every matrix is
read once by its format's reader at load, so a code 3 or a NaN scale fails there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..constants import GGMLType
from ..container import Model
from . import cpu_kernels as K
from .backend import Backend, QuantizedActivations, TernarySource, ternary_source

#: Matrices smaller than this run on the calling thread alone (see :meth:`CpuBackend._call`).
SERIAL_BYTES = 512 << 10

#: encoding -> (slot layout of the activations, kernel kind); i2_s's layout is its variant.
TWO_BIT = {"i2_s": (None, K.KIND_I2S), "stfma": ("plain", K.KIND_LOW),
           "colpack_u32": ("plain", K.KIND_COLPACK)}


@dataclass
class CpuWeight:
    encoding: str  # the kernel family: a format id, or "trits" for the generic fallback
    rows: int
    cols: int
    data: np.ndarray  # uint8 [rows, row_bytes] container bytes, or int8 trits [rows, cols]
    scale: np.float32 | np.ndarray  # per-tensor scale, or float32 [rows, n_blocks] (trits)
    layout: str = ""  # slot layout of the activations (2-bit formats)
    kind: int = 0


class ThreadPicker:
    """Chooses between one thread and ``n`` by the bytes per second each recently achieved.

    Both are tried first (twice: a first call pays page faults of a fresh memory map);
    afterwards the faster runs, and every ``EXPLORE``-th call (every fourth of those while it
    is more than twice as fast) tries the other again. Since the setting in use is timed on
    every call, a slowdown is seen at once; a recovery of the other within a few explorations.
    """

    EXPLORE = 32

    def __init__(self, n: int):
        self.options = (n, 1)
        self.rate: dict[int, float] = {}
        self.seen: dict[int, int] = {}
        self.calls = 0

    def pick(self) -> int:
        self.calls += 1
        for n in self.options:
            if n not in self.rate:
                return n
        best, other = sorted(self.options, key=self.rate.__getitem__, reverse=True)
        period = self.EXPLORE * (4 if self.rate[best] > 2 * self.rate[other] else 1)
        return other if self.calls % period == 0 else best

    def record(self, n: int, rate: float) -> None:
        self.seen[n] = self.seen.get(n, 0) + 1
        if self.seen[n] == 1:
            return  # warm-up
        old = self.rate.get(n)
        self.rate[n] = rate if old is None else 0.5 * old + 0.5 * rate


class CpuBackend(Backend):
    name = "cpu"

    def __init__(self, model: Model, *, i2s_variant: str = "x86", threads: int | None = None,
                 kernel: str | None = None, validate: bool = True):
        import numba

        super().__init__(model, dtype=np.float32, i2s_variant=i2s_variant)
        self.validate = validate
        self._set_threads = numba.set_num_threads
        limit = numba.config.NUMBA_NUM_THREADS
        self.threads = max(1, min(int(threads), limit)) if threads else limit
        self._pickers: dict[object, ThreadPicker] | None = (
            {} if threads is None and self.threads > 1 else None)
        self._threads_now = 0  # numba's setting is per Python thread: set on first use
        self.kernel = kernel or K.kernel_mode()
        vnni = self.kernel == "vnni"
        self._mm2 = K.mm2_vnni if vnni else K.mm2_portable
        self._tq2 = K.tq2_vnni if vnni else K.tq2_portable
        self._tq1 = K.tq1_vnni if vnni else K.tq1_portable
        et = self.embed_type
        self._lut = None
        if et == GGMLType.F32:
            self._E = self._embed_raw.view("<f4")
        elif et in (GGMLType.F16, GGMLType.BF16):
            self._E = self._embed_raw.view("<u2")
            self._lut = None if vnni else K.lut16(et.name)
        else:
            self._E = None  # plain_array raises a clear error in lm_head

    # -- weights ------------------------------------------------------------------------------
    def weight(self, name: str) -> CpuWeight:
        src = ternary_source(self.model, name, self.i2s_variant)
        if src is None or src.row_bytes is None:
            return self._trits_weight(name, src)
        if self.validate:  # the kernels trust the bytes: check every code and scale once
            src.decode_rows(0, src.rows)
        if src.encoding in TWO_BIT:
            layout, kind = TWO_BIT[src.encoding]
            return CpuWeight(src.encoding, src.rows, src.cols, src.rows_view(),
                             np.float32(src.scale), layout or self.i2s_variant, kind)
        return CpuWeight(src.encoding, src.rows, src.cols, src.rows_view(), np.float32(0))

    def _trits_weight(self, name: str, src: TernarySource | None) -> CpuWeight:
        t = self.model.ternary(name) if src is None else src.decode_rows(0, src.rows)
        scales = (np.full((t.rows, 1), t.scales[0], np.float32) if t.scale_block == 0
                  else np.ascontiguousarray(t.scales, dtype=np.float32))
        return CpuWeight("trits", t.rows, t.cols, t.trits, scales)

    def _call(self, kernel, nbytes: int, *args) -> None:
        """Run a kernel on all ``self.threads`` cores or on this thread alone.

        Waking the other OpenMP threads costs microseconds on an idle machine but milliseconds
        when another process holds their cores (measured on a busy 2-core VM: 5 us vs 5 ms for
        a 32 KB mat-vec, 1.3 vs 5 tokens/s for 2B-4T). So small matrices always run on one
        thread, and unless ``threads`` was given, a :class:`ThreadPicker` per kernel times the
        calls and keeps whichever setting streams more bytes per second.
        """
        picker = None
        if nbytes < SERIAL_BYTES:
            n = 1
        elif self._pickers is None:
            n = self.threads
        else:
            picker = self._pickers.setdefault(kernel, ThreadPicker(self.threads))
            n = picker.pick()
        if n != self._threads_now:
            self._set_threads(n)
            self._threads_now = n
        if picker is None:
            kernel(*args)
            return
        t0 = time.perf_counter()
        kernel(*args)
        picker.record(n, nbytes / (time.perf_counter() - t0))

    # -- BitLinear ------------------------------------------------------------------------------
    def _derived(self, qa: QuantizedActivations, key: str, width: int = 0) -> np.ndarray:
        """Layouts of ``qa.q`` the kernels read, made once per activation (see cpu_kernels)."""
        full = f"{key}:{width}"
        if full not in qa.cache:
            if key == "sum":
                qa.cache[full] = qa.q.sum(axis=1, dtype=np.int32)
            elif key == "blocks":
                qa.cache[full] = K.block_sums(qa.q)
            elif key == "s":
                qa.cache[full] = qa.s.astype(np.float32)
            else:
                qa.cache[full] = K.slot_activations(qa.q, key, width)
        return qa.cache[full]

    def bitlinear(self, qa: QuantizedActivations, w: CpuWeight) -> np.ndarray:
        out = np.empty((qa.q.shape[0], w.rows), dtype=np.float32)
        s = self._derived(qa, "s")
        enc = w.encoding
        if enc in TWO_BIT:
            xg = self._derived(qa, w.layout, w.data.shape[1] * 4)
            corr = (np.zeros(len(s), np.int32) if w.kind == K.KIND_COLPACK
                    else self._derived(qa, "sum"))
            self._call(self._mm2, w.data.nbytes, w.data, xg, corr, s, w.scale, w.kind, out)
        elif enc == "tq2_0":
            xg = self._derived(qa, "x86", w.cols)
            self._call(self._tq2, w.data.nbytes, w.data, xg, self._derived(qa, "blocks"), s, out)
        elif enc == "tq1_0":
            self._call(self._tq1, w.data.nbytes, w.data, qa.q, self._derived(qa, "blocks"), s,
                       out)
        else:
            self._call(K.mm_trits, w.data.nbytes, w.data, w.scale, qa.q, s, out)
        return out

    # -- LM head ----------------------------------------------------------------------------------
    def lm_head(self, h: np.ndarray) -> np.ndarray:
        if self._E is None:
            return h @ self.vector("token_embd.weight").T
        x = np.ascontiguousarray(h, dtype=np.float32)
        out = np.empty((x.shape[0], self.vocab), dtype=np.float32)
        n = self._E.nbytes
        if self.embed_type == GGMLType.F32:
            self._call(K.lm_head_f32, n, self._E, x, out)
        elif self._lut is not None:
            self._call(K.lm_head_lut, n, self._E, self._lut, x, out)
        elif self.embed_type == GGMLType.F16:
            self._call(K.lm_head_f16, n, self._E, x, out)
        else:
            self._call(K.lm_head_bf16, n, self._E, x, out)
        return out
