"""The ``cpu`` backend: numba kernels over the container bytes, on every core.

Float32 throughout. BitLinear runs one kernel per container (:mod:`.kernels`,
:mod:`.rans`) with int8 activations and int32 sums, reading the container's bytes on
every call; the kernel build (``vnni``, ``avx2`` or ``portable``) is chosen once per process
(:func:`~.kernels.kernel_mode`). Nothing is decoded ahead: the 2-bit, TQ and stfma bytes
are copied as they are into one arena in the order a token reads them (:class:`WeightArena`:
huge pages, one stream), so q, k and v (and gate and up) can run as one stacked matrix, and
``rans`` streams are read from the file mapping and decoded inside the mat-vec. Two sources
have no row-readable bytes: an hf folder (not a bitformat container: safetensors of packed
uint8 rows) and an i2_s matrix whose rows do not start on a 128-value block. Those are
decoded once at load and repacked as stfma rows (2 bits a weight) for the 2-bit kernel. With
``validate`` (the default) every matrix is read once by its format's reader at load, so a
code 3, a corrupt rans stream or a NaN scale fails there. RMSNorm, quantization, the FFN gate
and one-token attention run as compiled steps too (:mod:`.ops`).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import numpy as np

from ...codecs import rans_decode as RD
from ...codecs import rans_rows as RR
from ...constants import GGMLType
from ...errors import InvalidScaleError, MetadataError, RequestError
from ...formats import get_format
from ...io.mapping import file_mapping
from ...io.model import Model
from ...ternary import TernaryTensor
from .. import head as EH
from ..backend import (
    ROW_FORMATS,
    Backend,
    QuantizedActivations,
    TernarySource,
    q8_0_activations,
    ternary_source,
)
from ..costs import REPACKED
from . import amx as A
from . import batch as B
from . import decode as D
from . import head as H
from . import kernels as K
from . import lut3 as L3
from . import ops
from . import rans as KR
from . import screen as S
from .arena import WeightArena, resident_copy
from .threadpool import load_tbb

#: How rans matrices run: decoded once at load into stfma rows in the arena (the 2-bit kernels,
#: as fast as i2_s), or decoded inside every mat-vec from the file's words ("fused").
DECODE_MODES = ("load", "fused")

#: Matrices smaller than this run on the calling thread alone (see :meth:`CpuBackend._call`).
SERIAL_BYTES = 512 << 10

#: Rows up to which the 2-bit formats run :func:`.batch.mm2_vnni_tokens` (a batched decode
#: step); longer prompts run :func:`.kernels.mm2_vnni_prompt`.
BATCH_TOKENS = 16

#: ik_llama.cpp's BitNet types: one scale at the start of every row (formats/iq2_bn.py).
ROW_SCALED = ("iq2_bn", "iq1_bn")

#: Rows from which RMSNorm + quantization (a batched step, a prompt) run on all threads.
PAR_ROWS = 4

#: encoding -> (slot layout of the activations, kernel kind); i2_s's layout is its variant.
TWO_BIT = {"i2_s": (None, K.KIND_I2S), "stfma": ("plain", K.KIND_LOW),
           "colpack_u32": ("plain", K.KIND_COLPACK)}


#: Encodings whose matrices run stacked (q, k, v; gate, up) as one kernel call.
STACKABLE = (*TWO_BIT, *ROW_SCALED, "tq2_0", "tq1_0", "q2_0", "lut3")

#: Weights per 64-byte chunk of a 2-bit row: the unit of the vnni and AMX kernels. A row of
#: another length runs its last part through the scalar loop and rules AMX out; 1bitLLM 3B's
#: rows (3200 and 8640 weights) decoded at about 10 GB/s that way and its prompts at 10 tok/s.
#: Per-tensor-scale matrices of such widths (:data:`PADDED`) are repacked at load, with the
#: vnni kernels, as stfma rows padded with zero codes to whole chunks (their activations are
#: padded with zeros, so the sums are the same integers).
CHUNK_WEIGHTS = 256
PADDED = ("i2_s", "stfma")

#: Containers whose matrices the vnni and avx2 builds hold as stfma rows (padded to whole
#: chunks), each row with its own float32 scale, wherever every row of a matrix has one scale
#: (:func:`one_scale_per_row`): then the 2-bit kernels, stacking and the one-call step of i2_s
#: run them, with the same bits as their own kernels (docs/model.md, "One arithmetic"). Models
#: converted from BitNet's files have one scale per tensor in every container; a block format
#: whose blocks' scales differ (a llama.cpp quantization of other weights) keeps its kernel.
ONE_SCALE_ROWS = ("tq2_0", "tq1_0", "q2_0", "iq2_bn", "iq1_bn", "colpack_u32")

#: Of :data:`ONE_SCALE_ROWS`, the base-3 containers that the vnni build holds as lut3 tiles
#: (:mod:`.lut3`: 1.67 bits a weight, a table lookup per three trits) instead of stfma rows
#: (2 bits) where the CPU has AVX-512 VBMI: by default where it has no AMX, whose tiles run a
#: prompt and a batched step of stfma rows (``BITFORMAT_CPU_LUT3``: ``1`` wherever VBMI is,
#: ``0`` never). On a 2-core AMD EPYC (VBMI, no AMX) they decode 2B-4T at 1.07x (tq1_0) and
#: 1.06x (iq1_bn) of i2_s's speed over 30 interleaved rounds, 1.03-1.04x in the rounds where
#: the step is not bound by memory, and prefill at 1.08-1.09x, a prompt's tokens passing over
#: a tile two at a time (docs/benchmarks.md, "lut3 tiles for tq1_0 and iq1_bn" and "lut3
#: against i2_s, round by round").
LUT3_ROWS = ("tq1_0", "iq1_bn")
LUT3_ENV = "BITFORMAT_CPU_LUT3"


def lut3_wanted(amx: bool) -> bool:
    """Whether ``BITFORMAT_CPU_LUT3`` (:data:`LUT3_ROWS`) asks for lut3 tiles on a VBMI CPU
    with AMX tiles (``amx``) or without."""
    value = os.environ.get(LUT3_ENV, "").strip().lower()
    if value not in ("", "auto", "0", "1"):
        raise RequestError(f"{LUT3_ENV} must be 1 (lut3 tiles wherever the CPU has AVX-512 "
                           f"VBMI), 0 (never) or auto (where it has VBMI and no AMX), got "
                           f"{value!r:.20}")
    return value == "1" or (value in ("", "auto") and not amx)


@contextlib.contextmanager
def lut3_setting(value: str):
    """``BITFORMAT_CPU_LUT3`` set to ``value`` while the block runs (a backend made inside it
    holds tq1_0 and iq1_bn by it: :func:`lut3_wanted`), as it was after."""
    before = os.environ.get(LUT3_ENV)
    os.environ[LUT3_ENV] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[LUT3_ENV]
        else:
            os.environ[LUT3_ENV] = before


def _padded_bytes(shape: tuple[int, int]) -> int:
    """Bytes of a matrix as stfma rows padded to whole chunks (:data:`CHUNK_WEIGHTS`)."""
    return shape[0] * -(-shape[1] // CHUNK_WEIGHTS) * CHUNK_WEIGHTS // 4


def one_scale_per_row(t: TernaryTensor) -> np.ndarray | None:
    """float32 [rows]: each row's one scale, or None where a row has two.

    Only scale blocks holding a nonzero trit count (an all-zero block adds 0 whatever its
    scale); a row of zeros gets 0. Such a row's output is then ``float32(d * dot) / s`` in
    every kernel: the block kernels' exact float64 sum of ``d * dot_b`` is ``d * dot``, the
    2-bit kernels' ``float32(dot) * d`` rounds the same product once."""
    rows, cols = t.trits.shape
    if t.scale_block == 0:
        return np.full(rows, t.scales[0], np.float32)
    nb = cols // t.scale_block
    scales = t.scales.reshape(rows, nb)
    live = (t.trits.reshape(rows, nb, t.scale_block) != 0).any(axis=2)
    first = scales[np.arange(rows), live.argmax(axis=1)]
    if np.any(live & (scales != first[:, None])):
        return None
    return np.where(live.any(axis=1), first, np.float32(0)).astype(np.float32)


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
    every call, a slowdown is seen at once; a recovery of the other within about a token's
    calls (2B-4T makes 150 ternary calls a token). Exploring costs: on 2B-4T every 32nd call
    cost 1-2 ms a token (a 1-thread call of gate and up takes twice as long), every 128th
    about a quarter of that.

    A setting's rate is the median of its last ``KEEP`` calls (of two: the faster), so one
    call that lost its core for a while (a page fault, another process's time slice) does not
    flip the choice; two slow calls in three do. After a switch the setting left behind is
    tried again ``RECHECK`` calls later, then after twice as many calls, and so on up to the
    period above: its rate is what its last, possibly unlucky, calls gave, and waiting a whole
    period to look again cost the server (one call per token for the fused one-token step) up
    to 128 tokens at the slower setting. Once it wins back, the other needs no second look:
    its rate comes from the calls it just ran.
    """

    EXPLORE = 128
    KEEP = 3
    RECHECK = 2

    def __init__(self, n: int):
        self.options = (n, 1)
        self.rate: dict[int, float] = {}
        self.seen: dict[int, int] = {}
        self.recent: dict[int, list[float]] = {}
        self.calls = 0
        self.leader: int | None = None
        self.recheck = 0  # calls from one look at the former leader to the next
        self.due: int | None = None  # the call that looks at it again

    def pick(self) -> int:
        self.calls += 1
        for n in self.options:
            if n not in self.rate:
                return n
        best, other = sorted(self.options, key=self.rate.__getitem__, reverse=True)
        period = self.EXPLORE * (4 if self.rate[best] > 2 * self.rate[other] else 1)
        if best != self.leader:
            if self.due is not None:  # back to the setting left behind: the other's rate is fresh
                self.due = None
            elif self.leader is not None:  # a switch: look at the one left behind again soon
                self.recheck = self.RECHECK
                self.due = self.calls + self.recheck
            self.leader = best
        if self.due is not None and self.calls >= self.due:
            self.recheck *= 2
            self.due = self.calls + self.recheck if self.recheck < period else None
            return other
        return other if self.calls % period == 0 else best

    def record(self, n: int, rate: float) -> None:
        self.seen[n] = self.seen.get(n, 0) + 1
        if self.seen[n] == 1:
            return  # warm-up
        recent = self.recent.setdefault(n, [])
        recent.append(rate)
        del recent[:-self.KEEP]
        self.rate[n] = sorted(recent)[len(recent) // 2]  # of two: the faster


class CpuBackend(Backend):
    name = "cpu"
    amx = False  # AMX tile kernels for batched steps (set in __init__ where they may run)

    def __init__(self, model: Model, *, i2s_variant: str = "x86", threads: int | None = None,
                 kernel: str | None = None, validate: bool = True, decode: str = "load"):
        if decode not in DECODE_MODES:
            raise RequestError(f"decode must be {' or '.join(DECODE_MODES)}, got "
                               f"{decode!r:.20}")
        super().__init__(model, dtype=np.float32, i2s_variant=i2s_variant)
        self.validate = validate
        self.decode = decode
        self._setup_threads(threads, kernel)
        vnni, avx2 = self.kernel == "vnni", self.kernel == "avx2"
        self._mm2 = K.mm2_vnni if vnni else K.mm2_avx2 if avx2 else K.mm2_portable
        self._mm2_prompt = (K.mm2_vnni_prompt if vnni else K.mm2_avx2 if avx2
                            else K.mm2_portable)
        self._tq2 = K.tq2_vnni if vnni else K.tq2_avx2 if avx2 else K.tq2_portable
        self._tq1 = K.tq1_vnni  # the other builds repack tq1_0 (REPACKED)
        # q2_0, iq2_bn and iq1_bn have no AVX-512 kernels of their own: the vnni build runs
        # the avx2 ones (every AVX-512 CPU has AVX2, F16C and FMA), not the portable loops
        simd = avx2 or vnni
        self._iq2bn = K.iq2bn_avx2 if simd else K.iq2bn_portable
        self._q2 = K.q2_avx2 if simd else K.q2_portable
        # a batched decode step (2..BATCH_TOKENS rows) and the LM head of any rows: batch.py
        self._mm2_tokens = B.mm2_vnni_tokens if vnni else None
        self._head_tokens = B.lm_head_tokens if vnni else None
        # 2..16 rows of i2_s / stfma on AMX tiles where the CPU and the OS allow it: amx.py
        self.amx = vnni and A.available()
        #: lut3 tiles for LUT3_ROWS (vpermb: AVX-512 VBMI): by default where there is no AMX
        self.lut3 = vnni and "avx512vbmi" in K.host_features() and lut3_wanted(self.amx)
        self._colsets: dict[bytes, int] = {}  # live-column sets of the rans matrices
        self._rans_tables: dict[int, tuple[np.ndarray, tuple | None]] = {}  # _rans_table
        #: bytes held of the matrices held as stfma rows (:data:`ONE_SCALE_ROWS`), by name
        self._held: dict[str, int] = {}
        self._arena = WeightArena(sum(-(-n // WeightArena.ALIGN) * WeightArena.ALIGN
                                      for n in self._arena_bytes()))
        et = self.head_type
        tied = self.head_name == "token_embd.weight"
        if et in (GGMLType.F32, GGMLType.F16, GGMLType.BF16) and file_mapping(
                self._head_raw) is not None:  # (a coded head was decoded into memory already)
            self._head_raw = resident_copy(self._head_raw)
            if tied:
                self._embed_raw = self._head_raw  # also what embed() reads
        self._setup_head()

    def _setup_threads(self, threads: int | None, kernel: str | None) -> None:
        """The thread count, its pickers and the kernel build (``__init__``, ``head_only``)."""
        load_tbb()  # before numba starts its threads: work stealing (see .threadpool)
        import numba

        self._set_threads = numba.set_num_threads
        limit = numba.config.NUMBA_NUM_THREADS
        self.threads = max(1, min(int(threads), limit)) if threads else limit
        self._pickers: dict[tuple, ThreadPicker] | None = (
            {} if threads is None and self.threads > 1 else None)
        self._threads_now = 0  # numba's setting is per Python thread: set on first use
        self.kernel = kernel or K.kernel_mode()

    def _setup_head(self) -> None:
        """The LM head's state from ``head_type`` and ``_head_raw`` (``__init__``,
        ``head_only``): the rows the head kernels read and the screened head's tables."""
        et = self.head_type
        self._lut = None
        self._lut_f16: np.ndarray | None = None  # f16 -> f32 of every pattern (q2_0 kernel)
        self._screen: EH.ScreenTables | None = None
        self._screen_bits: int | None = None  # screen_bits
        self._screen_set = False  # screen_bits was set: the head does not choose it
        #: the screen scales outlier columns (head.column_scales); False: per-row codes only
        #: (benchmarks that compare the two)
        self.screen_columns = True
        self._bounds_scratch: dict = {}  # T -> (lo, hi) of head_bounds
        self._bmax = None  # (lo, hi, block maxima) of the last head_bounds
        self._sums_scratch: dict = {}  # T -> int32 [T, V, 2]: an int7 screen's sums
        self._sums = None  # (xq, sums) of the last int7 head_bounds
        if et == GGMLType.F32:
            self._E = self._head_raw.view("<f4")
        elif et in (GGMLType.F16, GGMLType.BF16):
            self._E = self._head_raw.view("<u2")
            # the vnni and avx2 builds convert halves with vcvtph2ps (F16C), the portable one
            # looks every 16-bit pattern up (H.lm_head_lut: 6 GB/s of f16 head on an EPYC
            # where the avx2 build's lm_head_f16 reads ~20)
            self._lut = None if self.kernel in ("vnni", "avx2") else H.lut16(et.name)
        else:
            self._E = None  # plain_array raises a clear error in lm_head

    @classmethod
    def head_only(cls, E: np.ndarray, gtype: GGMLType, kernel: str | None = None,
                  threads: int | None = None) -> CpuBackend:
        """A backend holding only an LM head, for the screened head's tools and tests: ``E``
        the head's stored values [V, dim] (uint16 bits for F16 and BF16, float32 for F32),
        run by this CPU's head and screen kernels (``kernel``: a build, default this CPU's)
        exactly as a loaded model's head runs them. It has no layers: only the head's methods
        (``lm_head``, ``screen_tables``, ``head_bounds``, ``head_rows``, ...) work."""
        be = object.__new__(cls)
        be.model = None
        be.embed_type = be.head_type = gtype
        be.head_name = "token_embd.weight"
        be._head_raw = np.ascontiguousarray(E).view(np.uint8)
        be.vocab, be.dim = E.shape
        be.dtype, be.no_screen, be.head_nbytes = np.float32, None, None
        be._setup_threads(threads, kernel)
        vnni = be.kernel == "vnni"
        be._head_tokens = B.lm_head_tokens if vnni else None  # as __init__
        be.amx = vnni and A.available()
        be._setup_head()
        return be

    def _arena_bytes(self) -> list[int]:
        """What each ternary matrix takes in the arena: its container bytes, or for rans
        decoded at load its stfma rows, for a repacked base-3 matrix its 2-bit rows."""
        out = []
        for e in self.model.entries:
            if self._one_scale_rows(e):  # as stfma rows, or (other scales) as they are
                native = (get_format(t).nbytes(*e.shape) if (t := self._repacks(e))
                          else e.nbytes)
                held = (L3.nbytes(*e.shape) if self._lut3_rows(e) else
                        _padded_bytes(e.shape))
                out.append(max(held, native))
            elif target := self._repacks(e):
                out.append(get_format(target).nbytes(*e.shape))
            elif self._pads(e):
                out.append(_padded_bytes(e.shape))
            elif e.encoding in ROW_FORMATS:
                out.append(e.nbytes)
            elif e.encoding == "rans" and self.decode == "load":
                out.append(e.shape[0] * RR.stfma_row_bytes(e.shape[1]))
        return out

    @property
    def weight_bytes_per_token(self) -> int:
        """Bytes a decode step reads: every ternary matrix as this backend holds it (rans
        decoded at load: its stfma rows), the LM head as f16/bf16/f32 (a coded head is
        decoded at load), the norms."""
        total = 0
        for e in self.model.entries:
            if e.name in self._held:
                total += self._held[e.name]
            elif target := self._repacks(e):
                total += get_format(target).nbytes(*e.shape)
            elif e.encoding == "rans" and self.decode == "load":
                total += e.shape[0] * RR.stfma_row_bytes(e.shape[1])
            else:
                total += e.plain_nbytes if not e.ternary else e.nbytes
        return total

    # -- weights ------------------------------------------------------------------------------
    def _repacks(self, e) -> str | None:
        """The container matrix entry ``e`` is repacked into at load
        (:data:`~..costs.REPACKED`), or None."""
        if self.kernel == "vnni" or not e.ternary:
            return None
        return REPACKED.get(e.encoding)

    def _one_scale_rows(self, e) -> bool:
        """Whether matrix entry ``e`` becomes stfma rows where its rows have one scale each
        (:data:`ONE_SCALE_ROWS`)."""
        return self.kernel in ("vnni", "avx2") and e.ternary and e.encoding in ONE_SCALE_ROWS

    def _lut3_rows(self, e) -> bool:
        """Whether matrix entry ``e`` becomes lut3 tiles where its rows have one scale each
        (:data:`LUT3_ROWS`)."""
        return self.lut3 and e.ternary and e.encoding in LUT3_ROWS

    def _pads(self, e) -> bool:
        """Whether matrix entry ``e`` is repacked as padded stfma rows (:data:`CHUNK_WEIGHTS`)."""
        return (self.kernel == "vnni" and e.ternary and e.encoding in PADDED
                and e.shape[1] % CHUNK_WEIGHTS != 0)

    def weight(self, name: str) -> CpuWeight | RD.RansWeight:
        e = self.model.entry(name)
        if e.encoding == "rans":
            if self.decode == "load":
                return self._decoded_rans(name)
            return self._rans_weight(name)
        if self._pads(e):
            return self._padded_weight(name)
        src = ternary_source(self.model, name, self.i2s_variant)
        t = None  # the matrix decoded by its format's reader (every check), once decoded
        if self._one_scale_rows(e):
            t = self.model.ternary(name) if src is None else src.decode_rows(0, src.rows)
            if (ws := one_scale_per_row(t)) is not None:
                w = self._lut3_tiles(t, ws) if self._lut3_rows(e) else self._stfma_rows(t, ws)
                self._held[name] = w.data.nbytes
                return w
        if (target := self._repacks(e)) and src is not None:
            return self._base3_repacked(src.decode_rows(0, src.rows) if t is None else t,
                                        target)
        if src is None or src.row_bytes is None:
            return self._repacked_weight(name, src, t)
        if self.validate and t is None:  # the kernels trust the bytes: check every code and
            src.validate()  # scale once (decoding them above did)
        data = self._arena.copy(src.rows_view())
        if src.encoding in TWO_BIT:
            layout, kind = TWO_BIT[src.encoding]
            return CpuWeight(src.encoding, src.rows, src.cols, data,
                             np.full(src.rows, src.scale, np.float32), layout or self.i2s_variant,
                             kind)
        if src.encoding in ROW_SCALED:  # the rows' own scales, for the kernel's epilogue
            return CpuWeight(src.encoding, src.rows, src.cols, data,
                             src.fmt.row_scales(data))
        return CpuWeight(src.encoding, src.rows, src.cols, data, np.float32(0))

    def _rans_weight(self, name: str) -> RD.RansWeight:
        """The tensor's words as they are, with the index arrays to decode them in the kernel."""
        rows, cols = self.model.entry(name).shape
        if self.validate:  # every check of the format's reader; the trits are dropped
            scale = float(self.model.ternary(name).scales[0])
        else:
            scale = self.model.get(f"bitformat.tensor.{name}.scale")
            if not isinstance(scale, float):
                raise MetadataError("missing its per-tensor scale", path=self.model.path,
                                    tensor=name)
            if not np.isfinite(scale):
                raise InvalidScaleError(f"scale is {scale}", path=self.model.path, tensor=name)
        return RD.rans_weight(self.model.plain(name)[1], rows, cols, scale, name, self._colsets)

    def _decoded_rans(self, name: str) -> CpuWeight:
        """A rans matrix decoded once into stfma rows in the arena (``decode="load"``,
        :func:`bitformat.codecs.rans_rows.decode_matrix`: every check, the CRC-32 when
        validating)."""
        rows, cols = self.model.entry(name).shape
        data, scale = RR.decode_matrix(self.model, name,
                                       self._arena.take((rows, RR.stfma_row_bytes(cols))),
                                       validate=self.validate, colsets=self._colsets)
        data.setflags(write=False)
        return CpuWeight("stfma", rows, cols, data, np.full(rows, scale, np.float32), "plain",
                         K.KIND_LOW)

    def _padded_weight(self, name: str) -> CpuWeight:
        """A per-tensor-scale matrix as stfma rows padded with zero trits to whole 64-byte
        chunks, in the arena (so q, k, v and gate, up still stack); read by the format's reader
        (every check)."""
        t = self.model.ternary(name)
        return self._stfma_rows(t, np.full(t.rows, t.scales[0], np.float32))

    def _stfma_rows(self, t: TernaryTensor, ws: np.ndarray) -> CpuWeight:
        """``t``'s trits as stfma rows padded with zero trits to whole 64-byte chunks, in the
        arena, row r scaled by ``ws[r]``."""
        width = -(-t.cols // CHUNK_WEIGHTS) * CHUNK_WEIGHTS
        trits = np.zeros((t.rows, width), np.int8)
        trits[:, :t.cols] = t.trits
        padded = TernaryTensor(trits, np.float32([1.0]), 0, t.name)
        data = self._arena.copy(get_format("stfma").encode(padded).view(np.uint8)
                                .reshape(t.rows, -1))
        data.setflags(write=False)
        return CpuWeight("stfma", t.rows, t.cols, data, ws, "plain", K.KIND_LOW)

    def _lut3_tiles(self, t: TernaryTensor, ws: np.ndarray) -> CpuWeight:
        """``t``'s trits as lut3 tiles (:mod:`.lut3`) in the arena, row r scaled by ``ws[r]``."""
        data = L3.pack(t.trits, self._arena.take(L3.shape(t.rows, t.cols)))
        data.setflags(write=False)
        return CpuWeight("lut3", t.rows, t.cols, data, ws, "lut3", K.KIND_LUT3)

    def _base3_repacked(self, t: TernaryTensor, target: str) -> CpuWeight:
        """A base-3 matrix (tq1_0, iq1_bn) decoded by its format's reader (every check) and
        encoded as ``target``'s rows (tq2_0, iq2_bn: the same scales) in the arena."""
        fmt = get_format(target)
        raw = np.asarray(fmt.encode(t)).view(np.uint8).reshape(t.rows, -1)
        data = self._arena.copy(raw)
        data.setflags(write=False)
        scale = fmt.row_scales(data) if target in ROW_SCALED else np.float32(0)
        return CpuWeight(target, t.rows, t.cols, data, scale)

    def _repacked_weight(self, name: str, src: TernarySource | None,
                         t: TernaryTensor | None = None) -> CpuWeight:
        """Matrices without row-readable bytes (module docstring), decoded once and repacked.

        Per-tensor scales become stfma rows (the 2-bit kernel); anything else keeps int8
        trits and the generic kernel (no source of that kind exists today).
        """
        if t is None:  # (or already decoded by the caller)
            t = self.model.ternary(name) if src is None else src.decode_rows(0, src.rows)
        if t.scale_block == 0:
            rows = get_format("stfma").encode(t).view(np.uint8).reshape(t.rows, -1)
            return CpuWeight("stfma", t.rows, t.cols, rows,
                             np.full(t.rows, t.scales[0], np.float32), "plain", K.KIND_LOW)
        scales = np.ascontiguousarray(t.scales, dtype=np.float32)
        return CpuWeight("trits", t.rows, t.cols, t.trits, scales)

    def stack(self, weights: list[CpuWeight | RD.RansWeight]) -> CpuWeight | None:
        """Matrices of one encoding and row layout that lie one after another in the arena
        (the model asks for q, k, v and gate, up in turn) as one weight over all their rows;
        per-tensor scales become per-row scales. None for anything else (rans, repacked)."""
        first = weights[0]
        if not all(isinstance(w, CpuWeight) and w.encoding in STACKABLE
                   and (w.encoding, w.cols, w.layout, w.kind, w.data.shape[1])
                   == (first.encoding, first.cols, first.layout, first.kind,
                       first.data.shape[1]) for w in weights):
            return None
        buf = self._arena.buf
        if buf is None or not all(np.shares_memory(w.data, buf) for w in weights):
            return None
        if first.encoding == "lut3" and any(w.rows % K.LUT_TILE_ROWS for w in weights):
            return None  # (tiles of 64 rows: a part tile would sit between two matrices)
        start = first.data.ctypes.data - buf.ctypes.data
        for a, b in zip(weights, weights[1:], strict=False):
            if b.data.ctypes.data != a.data.ctypes.data + a.data.nbytes:
                return None
        rows = sum(w.rows for w in weights)
        n = sum(w.data.shape[0] for w in weights)  # rows of bytes (tiles for lut3)
        data = buf[start: start + n * first.data.shape[1]].reshape(n, -1)
        data.setflags(write=False)  # as every weight: one compiled specialisation of a kernel
        scale = (np.concatenate([w.scale for w in weights])
                 if first.encoding in (*TWO_BIT, *ROW_SCALED, "lut3") else first.scale)
        return CpuWeight(first.encoding, rows, first.cols, data, scale, first.layout,
                         first.kind)

    # -- the model's small steps, compiled (ops) ----------------------------------------------
    def norm_quant(self, x: np.ndarray, gain: np.ndarray, eps: float) -> QuantizedActivations:
        x = np.ascontiguousarray(x, dtype=np.float32)
        q, s = np.empty(x.shape, np.int8), np.empty(x.shape[0], np.float32)
        if x.shape[0] >= PAR_ROWS:
            self._call(ops.norm_quant_rows, SERIAL_BYTES, x, gain, eps, q, s)
        else:
            ops.norm_quant(x, gain, eps, q, s)
        return QuantizedActivations(q, s)

    def glu_norm_quant(self, gate: np.ndarray, up: np.ndarray, gain: np.ndarray,
                       eps: float) -> QuantizedActivations:
        q, s = np.empty(gate.shape, np.int8), np.empty(gate.shape[0], np.float32)
        if gate.shape[0] >= PAR_ROWS:
            self._call(ops.glu_norm_quant_rows, SERIAL_BYTES, gate, up, gain, eps, q, s)
        else:
            ops.glu_norm_quant(gate, up, gain, eps, q, s)
        return QuantizedActivations(q, s)

    def attend(self, q, k, v, kc, vc, start, cos, sin):
        """Once :meth:`warm_attention` compiled it, :func:`.ops.attend_split` among threads: a
        prompt's chunk a token per thread, one token past one run of positions its runs. Else
        (and for one token within a run) :func:`.ops.attend_one` a token at a time on this
        thread: the same bits, so a first run never waits for the split kernel to compile (on
        an empty kernel cache the compile helper process compiles it)."""
        T = q.shape[0]
        out = np.empty((T, q.shape[1] * q.shape[2]), np.float32)
        kc, vc = ops.kernel_cache(kc), ops.kernel_cache(vc)
        q, k, v = (np.ascontiguousarray(a, np.float32) for a in (q, k, v))  # one compiled type
        if self.split_attention and (T > 1 or ops.attn_chunks(start + 1) > 1):
            # (the thread picker's key: the positions reached, to a power of two)
            reach = 1 << int(start + T - 1).bit_length()
            self._call(ops.attend_split, reach * kc[0].nbytes * 2, q, k, v, cos, sin, kc, vc,
                       start, out)
        else:
            for t in range(T):
                ops.attend_one(q[t], k[t], v[t], cos[t], sin[t], kc, vc, start + t, out[t])
        return out

    #: whether prompts and one-token attention past :data:`.ops.ATTN_CHUNK` positions are
    #: shared among threads (:func:`.ops.attend_split`); set once :meth:`warm_attention`
    #: compiled it (about 10 s on a 2-core AMD EPYC).
    split_attention = False

    def warm_attention(self, kv_type: str = "f32") -> None:
        """:func:`.ops.warm_attention` with the split kernel, which prompts and long contexts
        use from now on."""
        ops.warm_attention(kv_type, split=True)
        self.split_attention = True

    def decode_plan(self, net) -> D.Plan | None:
        """What :meth:`decode_row` needs to run ``net`` (a :class:`.models.base.Transformer`)
        one token at a time in one compiled call, or None where it does not apply
        (:mod:`.decode`: the vnni kernels, stacked 2-bit matrices in the arena, BitNet's
        layer). Not on the avx2 build: its one-call step decoded 2B-4T 13-26 % faster (AMD
        EPYC) but took 3.6 min to compile, a first run's whole budget many times over."""
        return D.Plan.of(net, self) if self.kernel == "vnni" else None

    def decode_row(self, plan: D.Plan, h: np.ndarray, cache, pos: int, cos: np.ndarray,
                   sin: np.ndarray) -> None:
        """One token through every layer of ``plan``'s network (:func:`.decode.decode_row`):
        ``h`` [1, dim] its embedding, replaced by the last layer's output; k and v stored in
        ``cache`` at ``pos``."""
        self._call(D.decode_row, plan.nbytes, self._arena.buf, plan.mats, plan.ws,
                   plan.gains, plan.eps, plan.lane, plan.heads, ops.kernel_cache(cache.k),
                   ops.kernel_cache(cache.v), pos, cos, sin, h)

    def decode_rows(self, plan: D.Plan, h: np.ndarray, rows) -> bool:
        """A batched decode step (row t of ``h`` [T, dim] the embedding of request t's token,
        ``rows`` a :class:`.models.base.Rows` of one token per request) through every layer in
        one call, on AMX tiles where the CPU has them (:func:`.decode.decode_rows`), else on
        VNNI (:func:`.decode.decode_rows_vnni`), ``h`` replaced by the outputs. False (nothing
        done) where that does not apply."""
        T = h.shape[0]
        if not 2 <= T <= A.MAX_TOKENS:
            return False
        if self.amx and plan.amx:
            self._call(D.decode_rows, plan.nbytes, self._arena.buf, plan.mats, plan.ws,
                       plan.gains, plan.eps, plan.lane, plan.heads, A.tile_config(T),
                       *self._kv_table(rows), rows.cos, rows.sin, plan.kv_heads, plan.head_dim, h)
        else:
            self._call(D.decode_rows_vnni, plan.nbytes, self._arena.buf, plan.mats, plan.ws,
                       plan.gains, plan.eps, plan.lane, plan.heads, *self._kv_table(rows),
                       rows.cos, rows.sin, plan.kv_heads, plan.head_dim, h)
        return True

    def attend_tokens(self, q, k, v, layer: int, rows, out) -> None:
        """Row t of a decode step (one token per request, ``rows`` a
        :class:`.models.base.Rows`) as :meth:`attend` on its own cache, every row of layer
        ``layer`` in one call (:func:`.ops.attend_rows`)."""
        ops.attend_rows(q, k, v, rows.cos, rows.sin, *self._kv_table(rows), layer, out)

    @staticmethod
    def _kv_table(rows) -> tuple[np.ndarray, ...]:
        """Each row's k and v cache addresses, cache lengths and positions (int64 [T] each),
        and a row of the caches' type (the kernels' prototype), once per step."""
        kv = rows.derived.get("kv")
        if kv is None:  # the caches' addresses, once per step
            caches = [(c, start) for _, c, start in rows.spans]
            first = caches[0][0].k
            if not all(c.k.flags.c_contiguous and c.v.flags.c_contiguous
                       and c.k.dtype == first.dtype == c.v.dtype
                       and c.k.shape[2:] == first.shape[2:] for c, _ in caches):
                raise RequestError("the KV caches of one step must be C-contiguous arrays of "
                                   "one type")
            kv = rows.derived["kv"] = tuple(np.array(x, np.int64) for x in zip(
                *[(c.k.ctypes.data, c.v.ctypes.data, c.k.shape[1], start) for c, start in caches],
                strict=True)) + (ops.kernel_cache(np.zeros(first.shape[3], first.dtype)),)
        return kv

    def _call(self, kernel, nbytes: int, *args) -> None:
        """Run a kernel on all ``self.threads`` cores or on this thread alone.

        Waking the other OpenMP threads costs microseconds on an idle machine but milliseconds
        when another process holds their cores (measured on a busy 2-core VM: 5 us vs 5 ms for
        a 32 KB mat-vec, 1.3 vs 5 tokens/s for 2B-4T). So small matrices always run on one
        thread, and unless ``threads`` was given, a :class:`ThreadPicker` per kernel, matrix
        size and kind of call (the number of tokens T up to ``BATCH_TOKENS``, or a prompt: the
        last argument is always the output ``[T, rows]``) times the calls and keeps whichever
        setting streams more bytes per second. A batched decode step of 2 tokens and one of 8
        take different times for the same bytes, so they must not share a picker: one that
        compared 1 thread at 2 tokens with 2 threads at 8 would keep 1 thread for both.
        """
        picker = None
        if nbytes < SERIAL_BYTES:
            n = 1
        elif self._pickers is None:
            n = self.threads
        else:
            rows = args[-1].shape[0]  # a rate is comparable only between calls of one size
            key = (kernel, nbytes, rows if rows <= BATCH_TOKENS else 0)
            picker = self._pickers.get(key)
            if picker is None:
                picker = self._pickers[key] = ThreadPicker(self.threads)
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
        """Layouts of ``qa.q`` the kernels read, made once per activation (see kernels.py)."""
        full = f"{key}:{width}"
        if full not in qa.cache:
            if key == "sum":
                qa.cache[full] = qa.q.sum(axis=1, dtype=np.int32)
            elif key == "blocks":
                qa.cache[full] = K.block_sums(qa.q, width or 256)
            elif key == "s":
                qa.cache[full] = qa.s.astype(np.float32)
            elif key == "iq1":
                qa.cache[full] = K.iq1_activations(qa.q)
            elif key == "lut3":
                qa.cache[full] = np.empty((qa.q.shape[0], L3.table_bytes(width)), np.uint8)
                (K.lut3_tables if len(qa.q) == 1 else K.lut3_tables_tokens)(
                    qa.q, qa.cache[full])
            else:
                qa.cache[full] = K.slot_activations(qa.q, key, width)
        return qa.cache[full]

    def bitlinear(self, qa: QuantizedActivations, w: CpuWeight | RD.RansWeight) -> np.ndarray:
        s = self._derived(qa, "s")
        if w.encoding == "rans":
            return self._rans(qa, w, s)
        out = np.empty((qa.q.shape[0], w.rows), dtype=np.float32)
        self.KERNELS[w.encoding](self, qa, w, s, out)
        return out

    # Each row container's mat-vec, as :data:`KERNELS` lists them: ``(qa, w, s, out)``.
    def _two_bit(self, qa, w, s, out) -> None:
        """i2_s, stfma, colpack_u32 (and rans decoded at load, rows padded to stfma): the
        2-bit kernels, AMX tiles for a prompt where the CPU has them."""
        xg = self._derived(qa, w.layout, w.data.shape[1] * 4)
        corr = (np.zeros(len(s), np.int32) if w.kind == K.KIND_COLPACK
                else self._derived(qa, "sum"))
        if (self.amx and len(s) > 1 and w.kind != K.KIND_COLPACK
                and w.data.shape[1] % 64 == 0):
            self._amx(qa, w, xg, corr, s, out)
            return
        kernel = (self._mm2 if len(s) == 1 else self._mm2_tokens
                  if self._mm2_tokens and len(s) <= BATCH_TOKENS and w.kind != K.KIND_COLPACK
                  else self._mm2_prompt)
        if kernel is K.mm2_portable:  # its compiled kernel for this layout
            kernel = K.MM2_PORTABLE[w.kind]
        elif kernel is K.mm2_avx2:
            kernel = K.MM2_AVX2[w.kind]
        self._call(kernel, w.data.nbytes, w.data, xg, corr, s, w.scale, w.kind, out)

    def _tq2_0(self, qa, w, s, out) -> None:
        xg = self._derived(qa, "x86", w.cols)
        self._call(self._tq2, w.data.nbytes, w.data, xg, self._derived(qa, "blocks"), s, out)

    def _tq1_0(self, qa, w, s, out) -> None:
        self._call(self._tq1, w.data.nbytes, w.data, qa.q, self._derived(qa, "blocks"), s, out)

    def _q2_0(self, qa, w, s, out) -> None:
        xg = self._derived(qa, "plain", w.cols)
        if self._lut_f16 is None:
            self._lut_f16 = H.lut16("F16")
        self._call(self._q2, w.data.nbytes, w.data, xg, self._derived(qa, "blocks", 64), s,
                   self._lut_f16, out)

    def _iq2_bn(self, qa, w, s, out) -> None:
        xg = self._derived(qa, "arm64", w.cols)
        self._call(self._iq2bn, w.data.nbytes, w.data, xg, self._derived(qa, "sum"), s,
                   w.scale, out)

    def _iq1_bn(self, qa, w, s, out) -> None:
        """The vnni build's: the avx2 kernel (the avx2 and portable builds repack iq1_bn,
        REPACKED)."""
        self._call(K.iq1bn_avx2, w.data.nbytes, w.data, self._derived(qa, "iq1", w.cols),
                   qa.q, self._derived(qa, "sum"), s, w.scale, out)

    def _lut3(self, qa, w, s, out) -> None:
        """tq1_0 and iq1_bn held as lut3 tiles (:data:`LUT3_ROWS`): each token's tables, then
        a table lookup per three trits (:func:`.kernels.mm_lut3`)."""
        self._call(K.mm_lut3, w.data.nbytes, w.data, self._derived(qa, "lut3", w.cols), s,
                   w.scale, out)

    def _trits(self, qa, w, s, out) -> None:
        """Unpacked trits (int8 rows): what a weight no kernel reads is held as."""
        self._call(K.mm_trits, w.data.nbytes, w.data, w.scale, qa.q, s, out)

    #: weight encoding -> its mat-vec (every row container of :data:`~bitformat.formats.
    #: ROW_FORMAT_IDS` has one; rans runs :meth:`_rans`); ``tests/test_cpu_ops.py`` checks
    #: the table covers the registry
    KERNELS = {**dict.fromkeys(TWO_BIT, _two_bit), "tq2_0": _tq2_0, "tq1_0": _tq1_0,
               "q2_0": _q2_0, "iq2_bn": _iq2_bn, "iq1_bn": _iq1_bn, "lut3": _lut3,
               "trits": _trits}

    def _amx(self, qa: QuantizedActivations, w: CpuWeight, xg: np.ndarray, corr: np.ndarray,
             s: np.ndarray, out: np.ndarray) -> None:
        """:func:`.amx.mm2_amx_tokens` (up to 16 rows) or :func:`.amx.mm2_amx_wide` on the
        rows of ``qa``, in slices of up to 64."""
        T = len(s)
        for t0 in range(0, T, A.WIDE_TOKENS):
            t1 = min(T, t0 + A.WIDE_TOKENS)
            n = t1 - t0
            pad = 0 if n <= A.MAX_TOKENS else -(-n // 16) * 16
            key = f"amx:{w.layout}:{w.kind}:{xg.shape[2]}:{t0}"
            if key not in qa.cache:
                qa.cache[key] = A.tile_activations(xg[t0:t1], w.kind, pad)
            part = out if (t0, t1) == (0, T) else np.empty((n, w.rows), np.float32)
            kernel = A.mm2_amx_wide if pad else A.mm2_amx_tokens
            self._call(kernel, w.data.nbytes, w.data, xg[t0:t1], qa.cache[key],
                       A.tile_config(16 if pad else n), corr[t0:t1], s[t0:t1], w.scale, w.kind,
                       part)
            if part is not out:
                out[t0:t1] = part

    def _rans(self, qa: QuantizedActivations, w: RD.RansWeight, s: np.ndarray) -> np.ndarray:
        out = np.zeros((qa.q.shape[0], w.rows), dtype=np.float32)  # dead rows stay 0
        args = (w.data, w.word_off, w.lrows, w.k, w.p, w.m0, w.cls, w.dec)
        if qa.q.shape[0] <= KR.MV_TOKENS:  # decode once per token, at a lookup per symbol
            for t in range(qa.q.shape[0]):
                self._call(KR.rans_mv, w.work, *args, self._rans_table(qa, w, t), s[t:t + 1],
                           w.scale, out[t:t + 1])
        else:
            key = f"rans-x:{w.colset}:{w.group}"
            if key not in qa.cache:
                qa.cache[key] = KR.live_activations(qa.q, w)
            self._call(KR.rans_mm, w.work, *args, RD.symbol_digits(w.group), qa.cache[key], s,
                       w.scale, out)
        return out

    def _rans_table(self, qa: QuantizedActivations, w: RD.RansWeight, t: int) -> np.ndarray:
        """Token t's dot-product table for ``w``'s live columns, made once per activation and
        column set, in a scratch buffer per token index reused by every call (so it stays in
        the caches)."""
        buf, owner = self._rans_tables.get(t, (None, None))
        if buf is None or buf.size < 243 * w.n_sym:
            buf, owner = np.empty(243 * max(w.n_sym, 2048), np.int16), None
        key = (w.colset, w.group, w.n_sym)
        if owner is None or owner[0] is not qa or owner[1] != key:
            KR.token_table(w, qa.q[t], buf)
            self._rans_tables[t] = (buf, (qa, key))
        return buf[:(243 if w.group == 5 else 3) * w.n_sym].reshape(-1, w.n_sym)

    # -- LM head ----------------------------------------------------------------------------------
    def lm_head(self, h: np.ndarray) -> np.ndarray:
        if self.head_type == GGMLType.Q2_0:  # llama.cpp's Q2_0 x Q8_0 sums
            q, d = q8_0_activations(h)
            if self._lut_f16 is None:
                self._lut_f16 = H.lut16("F16")
            out = np.empty((h.shape[0], self.vocab), dtype=np.float32)
            self._call(H.lm_head_q2_0, self._head_raw.nbytes, self._head_raw, self._lut_f16,
                       q, d, out)
            return out
        if self._E is None:
            return h @ self.vector(self.head_name).T
        x = np.ascontiguousarray(h, dtype=np.float32)
        out = np.empty((x.shape[0], self.vocab), dtype=np.float32)
        self._head_into(self._E, x, out, self._E.nbytes)
        return out

    def _head_into(self, E: np.ndarray, x: np.ndarray, out: np.ndarray, nbytes: int) -> None:
        """``out = x @ E.T`` by the head kernel of this model and build: every row's sum in the
        kernel's own order, whichever rows ``E`` holds (the screened head's rescoring)."""
        if self.head_type == GGMLType.F32:
            self._call(H.lm_head_f32, nbytes, E, x, out)
        elif self._head_tokens is not None:  # f16, bf16: the same sums for 1 row or many
            self._call(self._head_tokens, nbytes, E, x, self.head_type == GGMLType.BF16, out)
        elif self._lut is not None:
            self._call(H.lm_head_lut, nbytes, E, self._lut, x, out)
        elif self.head_type == GGMLType.F16:
            self._call(H.lm_head_f16, nbytes, E, x, out)
        else:
            self._call(H.lm_head_bf16, nbytes, E, x, out)

    # -- the screened head (runtime/head.py) ------------------------------------------------
    @property
    def head_itemsize(self) -> int:
        return self._E.itemsize if self._E is not None else 4

    def head_depth(self) -> int:
        """Roundings a product passes through in this build's head kernel: the vnni kernel
        (:func:`.batch.lm_head_tokens`) runs one FMA chain of dim / 16 per lane, a 4-level
        tree, then the dim % 16 tail; the others are reassociated by LLVM (fastmath), so any
        tree of dim products: at most dim + 1."""
        h = self.dim
        if self._head_tokens is not None and self.head_type != GGMLType.F32:
            return h // 16 + 4 + 2 * (h % 16)
        return h + 2

    @property
    def screen_bits(self) -> int:
        """The screen's code width: int7 where the vnni build runs on a CPU with AVX512-VBMI
        (which unpacks them in registers), else int8. Set it before the first screen to
        choose (tests, benchmarks)."""
        if self._screen_bits is None:
            self._screen_bits = self._default_screen_bits()
        return self._screen_bits

    def _default_screen_bits(self) -> int:
        vbmi = self.kernel == "vnni" and "avx512vbmi" in K.host_features()
        return 7 if vbmi else 8

    @property
    def screen_choice(self) -> tuple[int, ...]:
        """The widths the screened head may choose between (:class:`..head.Head`): this
        build's default and int6, unless the width was set."""
        return () if self._screen_set else (self._default_screen_bits(), 6)

    @screen_bits.setter
    def screen_bits(self, bits: int) -> None:
        if bits not in EH.SCREEN_BITS or (bits == 7 and self.kernel != "vnni"):
            raise ValueError(f"screen bits {bits}: the {self.kernel} build screens with "
                             f"{'int8, int7 or int6' if self.kernel == 'vnni' else 'int8 or int6'}"
                             " codes")
        self._screen_set = True
        if bits != self._screen_bits:
            self._screen_bits, self._screen = bits, None

    def switch_screen(self, bits: int) -> EH.ScreenTables:
        """The screened head's own choice (:class:`..head.Head`): tables of ``bits``-bit codes
        instead of the current ones (made now), the width still the head's to choose."""
        if bits != self._screen_bits:
            self._screen_bits, self._screen = bits, None
        return self.screen_tables()

    def screen_tables(self) -> EH.ScreenTables | None:
        """The int8 (int7) copy of the head and its bound terms (made once, on first use)."""
        if self._E is None:
            return None
        if self._screen is None:
            E, bits = self._E, self.screen_bits
            lut = None
            if E.dtype == np.uint16:
                lut = self._lut if self._lut is not None else H.lut16(self.head_type.name)
            cols = S.column_choice(E, lut) if self.screen_columns else None
            *parts, fine = S.quantize_rows(E, lut, self.dim, bits, cols)
            self._screen = EH.ScreenTables.build(*parts, self.dim, self.head_depth(),
                                                 2.0 ** -24, bits=bits, fine=fine, cols=cols)
        return self._screen

    def head_bounds(self, t: EH.ScreenTables, xq: np.ndarray, par: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
        """Every row's bounds ``(lo, hi)`` float64 [T, V] (:mod:`.screen`). The arrays are this
        backend's scratch for T tokens: the next call with T tokens overwrites them."""
        T, V = xq.shape[0], t.codes.shape[0]
        lo, hi = self._bounds_scratch.get(T, (None, None))
        if lo is None or lo.shape[1] != V:  # fresh pages cost: 16 MB at 8 tokens
            lo, hi = self._bounds_scratch[T] = np.empty((T, V)), np.empty((T, V))
        bmax = S.block_maxima(V, T)
        args = (t.scale, t.A, t.N, par, lo, hi, bmax)
        if t.bits != 8:  # and the rows' integer sums, for head_refine
            sums = self._sums_scratch.get(T)
            if sums is None or sums.shape[1] != V:
                sums = self._sums_scratch[T] = np.empty((T, V, 2), np.int32)
            args += (sums,)
            self._sums = (xq, sums)
        amx = self.amx and 2 <= T <= A.SCREEN_TOKENS and t.bits != 6  # a batched step
        if amx:
            kernel = A.screen_amx7 if t.bits == 7 else A.screen_amx
            args = (A.screen_activations(xq), A.screen_config(T)) + args
        elif t.bits == 6:
            kernel = {"vnni": S.screen6_vnni, "avx2": S.screen6_avx2}.get(self.kernel,
                                                                           S.screen6_portable)
        elif t.bits == 7:
            kernel = S.screen_vbmi7
        elif self.kernel == "avx2":
            kernel, xq = S.screen_avx2, xq.astype(np.int16)
        else:
            kernel = S.screen_vnni if self.kernel == "vnni" else S.screen_portable
        self._call(kernel, t.codes.nbytes, t.codes, xq, *args)
        self._bmax = (lo, hi, bmax)
        return lo, hi

    @property
    def split_hidden(self):
        """The screen's input split, compiled (:func:`.screen.split_hidden`)."""
        return S.split_hidden

    def head_refine(self, t: EH.ScreenTables, ids: np.ndarray, xq: np.ndarray,
                    par: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The int8 bounds ``(lo, hi)`` [T, len(ids)] of rows ``ids`` of int7 or int6 tables,
        from the last :meth:`head_bounds` of the same ``xq`` (its integer sums) and the bit
        planes (:func:`.screen.refine_vbmi7`, :func:`.screen.refine6`)."""
        last = self._sums
        if last is None or last[0] is not xq:
            raise RuntimeError("head_refine needs the first screen of the same inputs first")
        T = xq.shape[0]
        lo, hi = np.empty((T, ids.size)), np.empty((T, ids.size))
        kernel = S.refine6 if t.bits == 6 else S.refine_vbmi7
        self._call(kernel, t.fine_nbytes(ids.size), t.fine, np.ascontiguousarray(ids, np.int64),
                   xq, last[1], t.scale, t.fine_A, t.fine_N, par, lo, hi)
        return lo, hi

    def greedy_candidates(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """:meth:`.head.Head._greedy_candidates` for float32 logits from the block maxima
        of the last :meth:`head_bounds` (:func:`.screen.greedy_candidates`: the same rows), or
        None for bounds it did not compute."""
        last = self._bmax
        if last is None or last[0] is not lo or last[1] is not hi:
            return None
        return S.greedy_candidates(lo, hi, last[2])

    def head_rows(self, h: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """The head kernel's logits of rows ``ids`` only (the same bits as :meth:`lm_head`): on
        the vnni build read where they lie (:func:`.batch.lm_head_rows`), else those rows
        gathered and the same kernel run on them."""
        x = np.ascontiguousarray(h, dtype=np.float32)
        out = np.empty((x.shape[0], len(ids)), dtype=np.float32)
        # thread pickers are kept per size: round it to a power of two
        nbytes = 1 << max(len(ids) * self.dim * self.head_itemsize, 1).bit_length()
        if self._head_tokens is not None and self.head_type != GGMLType.F32:
            # the rows where they lie (a gathered copy of 500 rows cost 1 ms a step)
            self._call(B.lm_head_rows, nbytes, self._E, np.ascontiguousarray(ids, np.int64), x,
                       self.head_type == GGMLType.BF16, out)
        else:
            self._head_into(self._E[ids], x, out, nbytes)
        return out

    def head_rows_bytes(self, ids: np.ndarray) -> int:
        return len(ids) * self.dim * self.head_itemsize
