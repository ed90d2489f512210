"""The ``wgpu`` backend: container bytes uploaded as they are, decoded in WGSL kernels.

Every ternary matrix is uploaded once, in its container's own bytes, and multiplied by fused
decode + mat-vec kernels (``kernels/matvec_<format>.wgsl``, ``kernels/rans_*.wgsl``) that
unpack the packed words in registers and never write decoded weights anywhere. Activations are
int8 per token (the :func:`activation_block` layout, built on the GPU by
``kernels/quant_prologue.wgsl``), sums of ``code * q`` are integers, and ``y = acc / s * scale``
(per 256-block ``d`` for tq formats), the same float operations as the numpy backend.

rans matrices are decoded once on the host at load into stfma rows by default
(``decode="load"``: on lavapipe the 2-bit kernels ran a 2B-4T token 4-5x faster than the
fused rANS kernels); ``decode="fused"`` uploads the stream words and decodes them in the
kernels on every token. A coded LM head (``rans_float``) is decoded into f16 before upload.

Two ways to run a model:

* :class:`WgpuBackend` implements the :class:`~.backend.Backend` protocol (``bitlinear``,
  ``lm_head``, one submit each) so the numpy
  :class:`~..models.base.Transformer` can run on it, op by op;
* :class:`~.network.WgpuBitNet` (built by the loader over this backend), which runs the whole
  token on the GPU (one command buffer per token, KV cache on the GPU, argmax on the GPU).

Tensors larger than the adapter's ``max_storage_buffer_binding_size`` are split by rows into
several buffers, one dispatch each (the 656 MB f16 embedding of 2B-4T takes 5 with 128 MiB).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...constants import GGMLType
from ...errors import MetadataError, ScaleLossError, ShapeError, UnsupportedConversionError
from ...formats import get_format
from ...io.model import Model
from ...ternary import TernaryTensor
from ..backend import Backend, QuantizedActivations, dequantize_q2_0, ternary_source
from .device import UNIFORM_WORDS, Dispatch, GpuDevice

QOFF = 256  # first word of the plain int8 activations in the activation block
MAX_WIDTH = (UNIFORM_WORDS - QOFF) * 2  # 256 + NPAD/4 (plain) + NPAD/4 (slot16) <= 16384 words
EMBED_TYPES = {GGMLType.F32: 0, GGMLType.F16: 1, GGMLType.BF16: 2}
ROW_KERNELS = {"i2_s": "matvec_i2_s", "tq2_0": "matvec_tq2_0", "tq1_0": "matvec_tq1_0",
               "stfma": "matvec_stfma", "colpack_u32": "matvec_colpack_u32"}
WG = 64
#: the activation layout each format's rows read in the fused kernels (0 plain, 1 slot16)
FUSED_LAYOUT = {"i2_s": 0, "tq2_0": 0, "tq1_0": 0, "stfma": 1, "colpack_u32": 1}
FUSED_WGS = 256  # invocations per workgroup of the fused kernels


def activation_block(q: np.ndarray, s: float) -> np.ndarray:
    """The 64 KiB activation block of one token (u32 words; see ``matvec_common.wgsl``).

    ``q`` is int8 ``[n]``, ``s`` the token's scale. This is the numpy reference of what
    ``quant_prologue.wgsl`` writes (``norm_block.wgsl``, LAYOUT 2), and how the op-by-op path
    feeds the mat-vec kernels.
    """
    n = q.size
    npad = -(-n // 256) * 256
    if npad > MAX_WIDTH:
        raise UnsupportedConversionError(f"activations of width {n} exceed the {MAX_WIDTH} the "
                                         "64 KiB activation block holds")
    qp = np.zeros(npad, np.int8)
    qp[:n] = q
    out = np.zeros(UNIFORM_WORDS, np.uint32)
    out[0] = np.float32(s).view(np.uint32)
    out[1] = np.int32(qp.sum(dtype=np.int64)).view(np.uint32)
    bsum = qp.reshape(-1, 256).sum(axis=1, dtype=np.int32)
    out[4: 4 + bsum.size] = bsum.view(np.uint32)
    out[QOFF: QOFF + npad // 4] = qp.view("<u4")
    slot = qp.reshape(-1, 4, 4).transpose(0, 2, 1).copy()  # [16-group w, g, k] = q[16w+g+4k]
    out[QOFF + npad // 4: QOFF + npad // 2] = slot.reshape(-1).view("<u4")
    return out


def fparams(scales: Sequence[float], oscales: Sequence[float], bounds: Sequence[int],
            row0: int = 0, base2: int = 0, up: tuple[float, float] = (1.0, 1.0)) -> np.ndarray:
    """The ``FParams`` uniform of ``fused_matvec.wgsl`` (48 bytes): per row segment its scale
    and out scale (up to three stacked matrices), the segments' ends, the dispatch's first row
    and (MODE 2) the word where the up rows begin, whose scales are ``up``."""
    p = np.zeros(12, np.uint32)
    sc = np.ones(4, np.float32)
    osc = np.ones(4, np.float32)
    sc[: len(scales)] = scales
    osc[: len(oscales)] = oscales
    sc[3], osc[3] = up
    p[:4], p[4:8] = sc.view(np.uint32), osc.view(np.uint32)
    b = list(bounds) + [0xFFFFFFFF] * (2 - len(bounds))
    p[8:12] = b[0], b[1], row0, base2
    return p


def fused_subs(encoding: str, cols: int) -> dict[str, str]:
    """Text substitutions of ``fused_matvec.wgsl`` / ``norm_block.wgsl`` for a format and
    input width: the rows' code and the activation block's size in workgroup memory."""
    npad = -(-cols // 256) * 256
    subs = {"XV4": str(64 + npad // 16), "NBLK": str(npad // 256), "SLOT_OFF": "QOFF",
            "W_BINDING": "6"}
    if encoding:
        subs["ROWS_INCLUDE"] = f"rows_{encoding}.wgsl"
    return subs


def params(scale: float = 1.0, out_scale: float = 1.0, scale2: float = 1.0,
           out_scale2: float = 1.0, row0: int = 0, base2: int = 0) -> np.ndarray:
    """The ``Params`` uniform of the row-format mat-vec kernels (32 bytes)."""
    p = np.zeros(8, np.uint32)
    p[:4] = np.array([scale, out_scale, scale2, out_scale2], np.float32).view(np.uint32)
    p[4:6] = row0, base2
    return p


# -- row formats -----------------------------------------------------------------------------------
@dataclass
class RowMatrix:
    """A matrix whose rows are separable runs of container bytes (five of the formats)."""

    name: str
    encoding: str  # the kernel's format (a fallback re-encodes as stfma)
    rows: int
    cols: int
    data: np.ndarray  # uint8 [rows, row_bytes], the container's bytes (memory-mapped)
    scale: float  # per-tensor scale (tq formats: 1.0, their d is in the data)
    constants: dict[str, int] = field(default_factory=dict)

    @property
    def row_bytes(self) -> int:
        return self.data.shape[1]


@dataclass
class Chunk:
    row0: int
    rows: int
    buffer: Any
    base2: int  # word offset of the second matrix's rows (fused pairs)
    nbytes: int


class GpuMatrix:
    """One matrix (or a fused gate/up pair sharing rows) uploaded as row chunks.

    ``segments``: where several matrices were stacked into one (q, k, v), each one's last row
    + 1, tensor scale and out scale (:meth:`WgpuBackend.stacked`)."""

    def __init__(self, dev: GpuDevice, mats: list[RowMatrix],
                 segments: Sequence[tuple[int, float, float]] | None = None):
        self.dev, self.mats = dev, mats
        self.segments = list(segments or [(mats[0].rows, mats[0].scale, 1.0)])
        m = mats[0]
        self.name, self.encoding, self.rows, self.cols = m.name, m.encoding, m.rows, m.cols
        self.stem = ROW_KERNELS[m.encoding]
        self.nbytes = sum(x.data.nbytes for x in mats)
        per_row = sum(-(-x.row_bytes // 4) * 4 for x in mats)
        step = max(1, (dev.max_binding - 16) // per_row)
        if any(x.row_bytes > dev.max_binding - 16 for x in mats):
            raise UnsupportedConversionError(f"a row of {m.name} is larger than a storage "
                                             f"binding ({dev.max_binding} bytes)")
        self.chunks = []
        for r0 in range(0, self.rows, step):
            r1 = min(self.rows, r0 + step)
            parts, base2 = [], 0
            for i, x in enumerate(mats):
                b = np.ascontiguousarray(x.data[r0:r1]).reshape(-1)
                b = np.concatenate([b, np.zeros(-b.size % 4, np.uint8)])
                if i == 1:
                    base2 = sum(p.size for p in parts) // 4
                parts.append(b)
            raw = np.concatenate(parts)
            buf = dev.upload(raw, f"{m.name}[{r0}:{r1}]", pad=4)
            self.chunks.append(Chunk(r0, r1 - r0, buf, base2, raw.size))

    def dispatches(self, x: Any, y: Any, mode: int, out_scales: tuple[float, float] = (1, 1)
                   ) -> list[Dispatch]:
        """The dispatches of ``y (op)= W q / s * scale`` reading the activation block ``x``."""
        dev, lanes = self.dev, self.dev.lanes
        out = []
        s1 = self.mats[0].scale
        s2 = self.mats[1].scale if len(self.mats) > 1 else 1.0
        for c in self.chunks:
            k = dev.kernel(self.stem, ROWS=c.rows, COLS=self.cols, MODE=mode, LANES=lanes,
                           **self.mats[0].constants)
            p = dev.uniform(params(s1, out_scales[0], s2, out_scales[1], c.row0, c.base2))
            g = dev.bind(k, x, c.buffer, p, y)
            out.append(Dispatch(f"matvec:{self.encoding}", k, g,
                                dev.grid(math.ceil(c.rows / (WG // lanes))),
                                c.nbytes + self.cols))
        return out

    def fused_dispatches(self, src: Any, gain: Any, y: Any, mode: int, *, norm: bool,
                         act: int = 0, eps: float = 1e-5, combine: Any = None,
                         trace: Any = None, out_scales: Sequence[float] = (1.0, 1.0, 1.0, 1.0),
                         ys: int = 0, part: str = "", merge: dict[str, int] | None = None
                         ) -> list[Dispatch]:
        """``fused_matvec.wgsl`` over every chunk: quantize ``src`` (RMSNorm with ``gain`` if
        ``norm``; ``act(src) * combine`` first if ``combine``) in every workgroup, then
        ``y (op)= W q / s * scale`` (``mode`` 0 store, 1 add, 2 ``act(gate) * up``).
        ``out_scales``: per segment (MODE 2: gate, up) the optional ``.scale`` tensors.
        ``ys`` > 0: the batched-prefill variant (grid z = token, outputs ``ys`` floats apart;
        the caller sets z when recording). ``part`` names the step part (qkv, o, gate_up,
        down) for part-specific tuning (:meth:`GpuDevice.fused_shape`). ``merge``: ``src``
        is attention's runs (attn_split.wgsl) and ``combine`` the step state; the input is
        their merge (COMBINE = 2; the overrides HD, SMAX, SPLIT, SPAR, CMAX)."""
        dev = self.dev
        lpr, rpw = dev.fused_shape(self.encoding, part)
        subs = fused_subs(self.encoding, self.cols)
        if self.encoding == "i2_s":  # a lane's first units loaded before the prologue
            units = -(-(self.cols // 64) // lpr)
            subs["I2S_PRE"] = str(max(1, min(int(dev.tuning.get("pre", 2)), units)))
        out = []
        for c in self.chunks:
            k = dev.kernel("fused_matvec", subs, ROWS=c.rows, COLS=self.cols, MODE=mode,
                           ACT=act, NORM=int(norm),
                           COMBINE=2 if merge else int(combine is not None), **(merge or {}),
                           EPS=np.float32(eps), LAYOUT=FUSED_LAYOUT[self.encoding], RPW=rpw,
                           LPR=lpr, TRACE=int(trace is not None), YS=ys,
                           **({"SKIPQ": 1} if dev.tuning.get("skipq") else {}),
                           **self.mats[0].constants)
            p = self._fparams(c, out_scales)
            g = dev.bind(k, src, combine if combine is not None else src,
                         gain if gain is not None else src, p, y,
                         trace if trace is not None else dev.scratch, c.buffer)
            nbytes = c.nbytes + 4 * self.cols * (2 + (combine is not None))
            out.append(Dispatch(f"matvec:{self.encoding}", k, g,
                                dev.grid(math.ceil(c.rows / rpw)), nbytes))
        return out

    def _fparams(self, c: Chunk, out_scales: Sequence[float]) -> Any:
        """The FParams uniform of chunk ``c`` (fused_matvec.wgsl, matmat_i2_s.wgsl)."""
        bounds = [e for e, _, _ in self.segments[:-1]]
        scales = [sc for _, sc, _ in self.segments]
        oscales = list(out_scales[: len(self.segments)])
        up = (self.mats[1].scale, out_scales[1]) if len(self.mats) > 1 else (1.0, 1.0)
        if len(self.mats) > 1:
            oscales = [out_scales[0]]
        return self.dev.uniform(fparams(scales, oscales, bounds, c.row0, c.base2, up))

    def matmat_tokens(self) -> int:
        """Tokens a workgroup of :meth:`matmat_dispatches` takes: tuning ``tpw`` (default 8,
        0: no mat-mat kernel), as many activation blocks as workgroup memory holds; 0 where
        the rows are not i2_s."""
        dev = self.dev
        if self.encoding != "i2_s" or not dev.subgroups:
            return 0
        block = 16 * int(fused_subs(self.encoding, self.cols)["XV4"])
        room = int(dev.limits["max-compute-workgroup-storage-size"]) // block
        return max(0, min(int(dev.tuning.get("tpw", 8)), room))

    def matmat_dispatches(self, blocks: Any, state: Any, y: Any, mode: int, *, act: int,
                          ys: int, out_scales: Sequence[float] = (1.0, 1.0, 1.0, 1.0),
                          part: str = "") -> list[Dispatch]:
        """``matmat_i2_s.wgsl`` over every chunk: a batched prompt's ``y (op)= W q / s *
        scale`` for :meth:`matmat_tokens` tokens a workgroup, reading the activation blocks
        ``blocks`` (norm_block.wgsl, LAYOUT 0, one per token); outputs ``ys`` floats apart.
        The caller sets grid z (token groups) when recording."""
        dev, tpw = self.dev, self.matmat_tokens()
        lpr, rpw = dev.fused_shape(self.encoding, part)
        subs = fused_subs(self.encoding, self.cols)
        xv4 = int(subs["XV4"])
        subs.update(W_BINDING="4", TPW_N=f"{tpw}u", TXV4=str(tpw * xv4), XBASE="xb")
        out = []
        for c in self.chunks:
            k = dev.kernel("matmat_i2_s", subs, ROWS=c.rows, COLS=self.cols, MODE=mode,
                           ACT=act, RPW=rpw, LPR=lpr, YS=ys, **self.mats[0].constants)
            g = dev.bind(k, blocks, state, self._fparams(c, out_scales), y, c.buffer)
            out.append(Dispatch(f"matvec:{self.encoding}", k, g,
                                dev.grid(math.ceil(c.rows / rpw)), c.nbytes + 16 * xv4))
        return out


# -- rans ----------------------------------------------------------------------------------------
RANS_PARAM_WORDS = 20


class GpuRans:
    """A ``rans`` matrix: its stream words plus the metadata the kernels index (rans_common)."""

    def __init__(self, dev: GpuDevice, name: str, raw: np.ndarray, rows: int, cols: int,
                 scale: float, xl: Any):
        from ...codecs.rans_streams import RansTables
        from ...formats import rans as R
        from ...formats.rans_layout import Geometry

        self.dev, self.name, self.rows, self.cols, self.scale, self.xl = (
            dev, name, rows, cols, scale, xl)
        self.encoding = "rans"
        w = np.frombuffer(np.ascontiguousarray(raw).tobytes(), "<u4")
        _, _, vg, _, _, L, C, T, k, p, S, nwords = (int(v) for v in w[:12])
        group = (vg >> 8) & 0xFF
        sizes = R.section_words(rows, cols, L, T, S, nwords)
        at, pos = {}, 0
        for key, size in sizes.items():
            at[key] = w[pos: pos + size]
            pos += size

        def bits(words: np.ndarray, n: int) -> np.ndarray:
            return np.unpackbits(words.view(np.uint8), bitorder="little")[:n]

        lrows = np.flatnonzero(bits(at["dead_rows"], rows) == 0).astype(np.uint32)
        lcols = np.flatnonzero(bits(at["dead_cols"], cols) == 0).astype(np.uint32)
        counts = ((at["counts"][:, None] >> np.uint32([0, 16])) & 0xFFFF).reshape(-1)[:S]
        off = np.zeros(S + 1, np.uint32)
        np.cumsum(counts, out=off[1:])
        tab = at["tables"].reshape(-1, 2).astype(np.int64)
        units = np.stack([tab[:, 0] & 0xFFFF, tab[:, 0] >> 16, tab[:, 1]], axis=1)
        tables = RansTables.from_stored(R.GROUPS[group], units)
        cdf = np.zeros((T, 243), np.uint32)
        freq = np.zeros((T, 243), np.uint32)
        a = tables.units.shape[1]
        freq[:, :a] = tables.units
        cdf[:, :a] = np.cumsum(tables.units, axis=1) - tables.units
        tabw = (cdf << 16) | freq
        luts = np.ascontiguousarray(tables.luts, dtype=np.uint8).view("<u4")  # [T, 1024]
        cuts = Geometry(L, C, k, p).cuts().astype(np.uint32)
        cls = at["classes"] if T > 1 else np.zeros(1, np.uint32)
        sections = [("off", off), ("lrows", lrows), ("lcols", lcols), ("cls", cls),
                    ("tab", tabw.reshape(-1)), ("lut", luts.reshape(-1)), ("cuts", cuts)]
        offsets, parts, n = {}, [], 0
        for key, arr in sections:
            offsets[key] = n
            arr = np.asarray(arr, np.uint32).reshape(-1)
            parts.append(arr)
            n += arr.size + 1  # + 1: no section is empty
            parts.append(np.zeros(1, np.uint32))
        self.L, self.C, self.S, self.p, self.T = L, C, S, p, T
        if C // 5 + 2 > UNIFORM_WORDS // 4:  # x_live: a vec4 per 5 columns, 64 KiB
            raise UnsupportedConversionError(f"{C} live columns exceed the "
                                             f"{5 * (UNIFORM_WORDS // 4 - 2)} the x_live block "
                                             "holds", tensor=name)
        self.meta = dev.upload(np.concatenate(parts), f"{name}.meta")
        self.words = dev.upload(at["streams"], f"{name}.streams", pad=4)
        self.acc = dev.buffer(4 * max(L, 1), f"{name}.acc")
        self.nbytes = int(raw.size)
        rp = np.zeros(RANS_PARAM_WORDS, np.uint32)
        rp[:16] = (rows, L, C, S, k, p, T, group, offsets["off"], offsets["lrows"],
                   offsets["lcols"], offsets["cls"], offsets["tab"], offsets["lut"],
                   offsets["cuts"], 0)
        self._rp = rp

    def dispatches(self, x: Any, y: Any, mode: int, out_scales: tuple[float, float] = (1, 1)
                   ) -> list[Dispatch]:
        if mode not in (0, 1):
            raise ValueError("rans mat-vecs write (0) or add (1); gate/up run as two")
        dev = self.dev
        rp = self._rp.copy()
        rp[16:18] = np.array([self.scale, out_scales[0]], np.float32).view(np.uint32)
        p = dev.uniform(rp, f"{self.name}.params")
        kg = dev.kernel("rans_gather", MODE=mode)
        n = max(self.C // 5 + 2, self.rows, self.L)
        out = [Dispatch("rans:gather", kg, dev.bind(kg, x, self.meta, p, self.xl, y, self.acc),
                        dev.grid(math.ceil(n / WG)), 4 * self.C)]
        if self.S:
            km = dev.kernel("rans_matvec", MODE=mode, SHARED=int(self.T <= 4))
            out.append(Dispatch("matvec:rans", km,
                                dev.bind(km, x, self.words, self.meta, p, self.xl, y, self.acc),
                                dev.grid(math.ceil(self.S / WG)), self.nbytes + 4 * self.C))
        if self.p > 1:
            kf = dev.kernel("rans_finish", MODE=mode)
            out.append(Dispatch("rans:finish", kf, dev.bind(kf, x, self.meta, p, self.acc, y),
                                dev.grid(math.ceil(self.L / WG)), 8 * self.L))
        return out


# -- the embedding / LM head -----------------------------------------------------------------------
class GpuEmbedding:
    """``token_embd`` (or an untied ``output.weight``: ``name``; F32, F16 or BF16) in row
    chunks that each fit one storage binding."""

    def __init__(self, dev: GpuDevice, model: Model, name: str = "token_embd.weight"):
        gtype, raw = model.plain(name)
        vocab, dim = model.entry(name).shape
        if gtype == GGMLType.Q2_0:  # Ternary Bonsai: d * (code - 1) is exact in f16, so the
            # blocks become f16 rows at load (the head then sums unquantized activations,
            # where llama.cpp and the cpu backend use Q8_0 blocks: logits differ slightly)
            raw = dequantize_q2_0(raw, vocab * dim).astype("<f2").view(np.uint8)
            gtype = GGMLType.F16
        self._setup(dev, gtype, raw, vocab, dim, name)

    @classmethod
    def from_rows(cls, dev: GpuDevice, gtype: GGMLType, raw: np.ndarray, vocab: int, dim: int,
                  name: str = "head") -> GpuEmbedding:
        """An embedding from its stored bytes ``raw`` (tests build heads this way)."""
        self = object.__new__(cls)
        self._setup(dev, gtype, np.ascontiguousarray(raw).reshape(-1).view(np.uint8), vocab,
                    dim, name)
        return self

    def _setup(self, dev: GpuDevice, gtype: GGMLType, raw: np.ndarray, vocab: int, dim: int,
               name: str) -> None:
        self.dev, self.vocab, self.dim = dev, vocab, dim
        if gtype not in EMBED_TYPES:
            raise UnsupportedConversionError(f"the wgpu backend reads an F32, F16 or BF16 "
                                             f"embedding, not {gtype.name}", tensor=name)
        self.dtype = EMBED_TYPES[gtype]
        self.name = name
        if self.dtype and self.dim % 2:
            raise UnsupportedConversionError("a 16-bit embedding needs an even width",
                                             tensor=name)
        if self.dim > UNIFORM_WORDS:  # the LM head's f32 input is one 64 KiB block
            raise UnsupportedConversionError(f"embedding width {self.dim} exceeds "
                                             f"{UNIFORM_WORDS}")
        rows = raw.reshape(self.vocab, -1)
        self.gtype, self.host_rows = gtype, rows  # the screened head quantizes these
        self.row_bytes = rows.shape[1]
        self.rows_per_chunk = max(1, dev.max_binding // self.row_bytes)
        self.chunks = []
        for r0 in range(0, self.vocab, self.rows_per_chunk):
            r1 = min(self.vocab, r0 + self.rows_per_chunk)
            self.chunks.append((r0, r1 - r0, dev.upload(rows[r0:r1], f"{name}[{r0}:{r1}]")))
        self.nbytes = int(raw.size)

    def locate(self, token: int) -> tuple[int, int]:
        """(chunk index, row inside the chunk) of a token."""
        return divmod(int(token), self.rows_per_chunk)

    @property
    def n_parts(self) -> int:
        """Workgroups of ``lm_head_step.wgsl`` over every chunk (one largest logit each)."""
        _, rpw = self.dev.head_shape()
        return sum(-(-n // rpw) for _, n, _ in self.chunks)

    def head_dispatches(self, x: Any, logits: Any, parts: Any = None, *,
                        gate: tuple[Any, int] | None = None) -> list[Dispatch]:
        """The head's logits of ``x`` into ``logits``, one dispatch per chunk: with subgroups
        ``lm_head_step.wgsl`` (which also writes each workgroup's largest logit into
        ``parts``, :attr:`n_parts` pairs), else ``lm_head.wgsl``. ``gate``: (the screened
        head's candidate list, its capacity): the rows are computed only where the screen did
        not hold (lm_head_step.wgsl, GATE)."""
        dev, out = self.dev, []
        if dev.subgroups:
            lpr, rpw = dev.head_shape()
            if parts is None:
                parts = dev.buffer(8 * self.n_parts, f"{self.name}.maxima")
            g, cap = gate if gate is not None else (dev.scratch, 0)
            pbase = 0
            for r0, n, buf in self.chunks:
                k = dev.kernel("lm_head_step", ROWS=n, DIM=self.dim, DTYPE=self.dtype,
                               RPW=rpw, LPR=lpr, GATE=int(gate is not None), CAP=cap)
                p = dev.uniform(np.array([r0, pbase, 0, 0], np.uint32))
                # gated: the bytes of a step where the screen held (it reads no row)
                out.append(Dispatch("lm_head", k, dev.bind(k, x, buf, p, logits, parts, g),
                                    dev.grid(-(-n // rpw)),
                                    4 if gate else n * self.row_bytes + 4 * self.dim,
                                    label="lm_head_gated" if gate else ""))
                pbase += -(-n // rpw)
            return out
        for r0, n, buf in self.chunks:
            k = dev.kernel("lm_head", ROWS=n, DIM=self.dim, DTYPE=self.dtype, LANES=dev.lanes)
            p = dev.uniform(np.array([r0, 0, 0, 0], np.uint32))
            out.append(Dispatch("lm_head", k, dev.bind(k, x, buf, p, logits),
                                dev.grid(math.ceil(n / (WG // dev.lanes))),
                                n * self.row_bytes + 4 * self.dim))
        return out

    def embed_dispatches(self, state: Any, h: Any, batch: bool = False) -> list[Dispatch]:
        """``h = E[token]`` with the token read from the step state (``embed_step.wgsl``), one
        dispatch per chunk (the chunk holding the token writes). ``batch``: the prompt's ids
        after the state's first 4 words, row t of ``h`` per token (grid z, set when
        recording)."""
        dev = self.dev
        k = dev.kernel("embed_step", DIM=self.dim, DTYPE=self.dtype, BATCH=int(batch))
        out = []
        for r0, n, buf in self.chunks:
            p = dev.uniform(np.array([r0, n, 0, 0], np.uint32))
            out.append(Dispatch("embed", k, dev.bind(k, buf, p, state, h),
                                dev.grid(-(-self.dim // 256)), self.row_bytes))
        return out


# -- the backend -----------------------------------------------------------------------------------
class WgpuBackend(Backend):
    """Weights on a wgpu device; ``bitlinear`` / ``lm_head`` op by op (``WgpuBitNet`` for speed).

    ``validate`` reads every ternary matrix once with its format's reader at upload (the kernels
    trust the bytes: code 3, NaN scales or corrupt rANS streams fail there). ``context`` caps the
    KV cache the network allocates (default: the model's context length). ``lanes``,
    ``max_binding`` and ``x_space`` go to :class:`~.device.GpuDevice`.
    """

    name = "wgpu"

    def __init__(self, model: Model, *, i2s_variant: str = "x86", validate: bool = True,
                 device: GpuDevice | None = None, lanes: int | None = None,
                 max_binding: int | None = None, x_space: str | None = None,
                 context: int | None = None, decode: str = "load"):
        if decode not in ("load", "fused"):
            raise UnsupportedConversionError(f"decode must be load or fused, got "
                                             f"{decode!r:.20}")
        super().__init__(model, dtype=np.float32, i2s_variant=i2s_variant)
        self.decode = decode
        self.dev = device or GpuDevice(lanes=lanes, max_binding=max_binding, x_space=x_space)
        self.validate, self.context = validate, context
        self.embedding = GpuEmbedding(self.dev, model)
        self.head = self.embedding if self.head_name == "token_embd.weight" else GpuEmbedding(
            self.dev, model, self.head_name)
        self.x = self.dev.buffer(4 * UNIFORM_WORDS, "x", uniform=True)  # activation block
        self.xl = self.dev.buffer(4 * UNIFORM_WORDS, "x_live", uniform=True)
        self.xf = self.dev.buffer(4 * UNIFORM_WORDS, "x_f32", uniform=True)  # LM head input
        self._y: Any = None
        self._logits: Any = None
        self._cache: dict[tuple, Any] = {}
        self._screened: Any = None  # head.GpuScreenedHead, made on first use
        self._argmax: Dispatch | None = None  # pick_full's
        if self.head_type == GGMLType.Q2_0:  # the device's head is f16 rows: it screens
            self.no_screen = None
            self.head_nbytes = self.head.nbytes

    @property
    def weight_bytes_per_token(self) -> int:
        """Bytes a step reads: rans decoded at load as stfma rows, a coded head as f16."""
        from ...codecs.rans_rows import stfma_row_bytes

        return sum(e.shape[0] * stfma_row_bytes(e.shape[1])
                   if e.encoding == "rans" and self.decode == "load" else e.plain_nbytes
                   for e in self.model.entries)

    # -- weights --------------------------------------------------------------------------------
    def row_matrix(self, name: str) -> RowMatrix | None:
        """The row-format view of ``name``; odd layouts become stfma words, and so do rans
        matrices decoded at load (None for rans decoded in the kernels, ``decode="fused"``)."""
        e = self.model.entry(name)
        if e.encoding == "rans":
            return self._decoded_rans(name) if self.decode == "load" else None
        src = ternary_source(self.model, name, self.i2s_variant)
        if src is not None and src.row_bytes is not None and src.encoding in ROW_KERNELS:
            if self.validate:
                src.decode_rows(0, src.rows)
            consts = {"BLK": src.fmt.block} if src.encoding == "i2_s" else {}
            scale = 1.0 if src.encoding in ("tq2_0", "tq1_0") else float(src.scale)
            return RowMatrix(name, src.encoding, src.rows, src.cols, src.rows_view(), scale,
                             consts)
        # i2_s rows that do not start on a block, hf folders, and the types without a WGSL
        # kernel (q2_0, iq2_bn, iq1_bn): re-encoded once, losslessly, as stfma words (one
        # scale per tensor) or else as tq2_0 blocks (scales per 256 values, per row or finer)
        t: TernaryTensor = self.model.ternary(name) if src is None else src.decode_rows(
            0, src.rows)
        if t.tensor_scale() is not None:
            fmt = get_format("stfma")
            t, _ = fmt.prepare(t)
            words = fmt.encode(t).view(np.uint8).reshape(t.rows, -1)
            return RowMatrix(name, "stfma", t.rows, t.cols, words, float(t.scales[0]))
        fmt = get_format("tq2_0")
        try:
            t, _ = fmt.prepare(t)
        except (ScaleLossError, ShapeError) as e:
            raise UnsupportedConversionError(
                f"the wgpu backend has no kernel for {src.encoding if src else 'this source'} "
                f"and its scales fit neither stfma nor tq2_0 ({e.problem}); use the cpu or "
                "numpy backend", path=self.model.path, tensor=name) from None
        blocks = fmt.encode(t).view(np.uint8).reshape(t.rows, -1)
        return RowMatrix(name, "tq2_0", t.rows, t.cols, blocks, 1.0)

    def _decoded_rans(self, name: str) -> RowMatrix:
        """The rANS streams decoded once on the host into stfma rows (the cpu backend's
        checked decoder; the CRC-32 when validating). On lavapipe the 2-bit kernels ran a
        token 4-5x faster than the fused rANS kernels (docs/gpu.md)."""
        from ...codecs.rans_rows import decode_matrix

        rows, cols = self.model.entry(name).shape
        data, scale = decode_matrix(self.model, name, validate=self.validate)
        return RowMatrix(name, "stfma", rows, cols, data, float(scale))

    def _check_width(self, cols: int, name: str) -> None:
        if -(-cols // 256) * 256 > MAX_WIDTH:
            raise UnsupportedConversionError(f"{cols} columns exceed the {MAX_WIDTH} the "
                                             "activation block holds", tensor=name)

    def weight(self, name: str) -> GpuMatrix | GpuRans:
        """``name`` on the GPU (cached)."""
        key = ("w", name)
        if key not in self._cache:
            e = self.model.entry(name)
            self._check_width(e.shape[1], name)
            if e.encoding == "rans" and self.decode == "fused":
                _, raw = self.model.plain(name)
                scale = self.model.get(f"bitformat.tensor.{name}.scale")
                if not isinstance(scale, float):
                    raise MetadataError("missing its per-tensor scale", tensor=name)
                if self.validate:
                    get_format("rans").decode(raw, *e.shape, scale=scale, name=name)
                self._cache[key] = GpuRans(self.dev, name, raw, *e.shape, scale, self.xl)
            else:
                self._cache[key] = GpuMatrix(self.dev, [self.row_matrix(name)])
        return self._cache[key]

    def stacked(self, names: Sequence[str]) -> GpuMatrix | None:
        """Matrices that read the same input (q, k and v) as one: their rows one after the
        other, each keeping its scale, for one fused dispatch (None where one has no row kernel
        or their kernels differ)."""
        key = ("stack", tuple(names))
        if key in self._cache:
            return self._cache[key]
        if self.decode == "fused" and any(self.model.entry(n).encoding == "rans"
                                          for n in names):
            return None
        mats = [self.row_matrix(n) for n in names]
        m0 = mats[0]
        if any((m.encoding, m.cols, m.constants) != (m0.encoding, m0.cols, m0.constants)
               for m in mats):
            return None
        self._check_width(m0.cols, names[0])
        segments, end = [], 0
        for m in mats:
            end += m.rows
            segments.append((end, m.scale, 1.0))
        rows = np.concatenate([np.asarray(m.data) for m in mats])
        self._cache[key] = GpuMatrix(self.dev, [RowMatrix("+".join(names), m0.encoding, end,
                                                          m0.cols, rows, m0.scale,
                                                          m0.constants)], segments)
        return self._cache[key]

    def pair(self, gate: str, up: str) -> GpuMatrix | None:
        """gate and up fused into one upload for ``MODE 2`` (None if their kernels differ;
        cached)."""
        key = ("pair", gate, up)
        if key in self._cache:
            return self._cache[key]
        if self.decode == "fused" and any(self.model.entry(n).encoding == "rans"
                                          for n in (gate, up)):
            return None
        a, b = self.row_matrix(gate), self.row_matrix(up)
        if (a.encoding, a.rows, a.cols, a.constants) != (b.encoding, b.rows, b.cols,
                                                          b.constants):
            return None
        self._check_width(a.cols, gate)
        self._cache[key] = GpuMatrix(self.dev, [a, b])
        return self._cache[key]

    # -- the Backend protocol, op by op ------------------------------------------------------------
    def _out(self, n: int) -> Any:
        if self._y is None or self._y.size < 4 * n:
            self._y = self.dev.buffer(4 * n, "y")
        return self._y

    def bitlinear(self, qa: QuantizedActivations, w: GpuMatrix | GpuRans) -> np.ndarray:
        """``[T, rows]``: one activation block upload, dispatch and readback per token."""
        y = self._out(w.rows)
        key = ("bl", id(w), id(y))  # the dispatches are bound to this output buffer
        if key not in self._cache:
            self._cache[key] = (w, w.dispatches(self.x, y, 0))
        out = np.empty((qa.q.shape[0], w.rows), np.float32)
        for t in range(qa.q.shape[0]):
            self.dev.write(self.x, activation_block(qa.q[t], float(qa.s[t])))
            self.dev.run(self._cache[key][1])
            out[t] = np.frombuffer(self.dev.read(y, 4 * w.rows), np.float32)
        return out

    def lm_head(self, h: np.ndarray) -> np.ndarray:
        if self._logits is None:
            self._logits = self.dev.buffer(4 * self.vocab, "logits")
            self._head = self.head.head_dispatches(self.xf, self._logits)
        out = np.empty((h.shape[0], self.vocab), np.float32)
        for t in range(h.shape[0]):
            self.dev.write(self.xf, np.ascontiguousarray(h[t], np.float32))
            self.dev.run(self._head)
            out[t] = np.frombuffer(self.dev.read(self._logits, 4 * self.vocab), np.float32)
        return out

    def pick_full(self, h: np.ndarray, samplers: Sequence[Any]) -> list[int]:
        """The full head's token per row of ``h``, chosen as :class:`~.network.WgpuBitNet`
        chooses it: greedy rows without a penalty by the device's argmax (4 bytes back, the
        same choice among NaNs too), the others by their sampler on the read-back logits."""
        self.lm_head(h[:0])  # the logits buffer and head dispatches
        if self._argmax is None:
            k = self.dev.kernel("argmax", N=self.vocab)
            self._result = self.dev.buffer(16, "argmax")
            self._argmax = Dispatch("argmax", k, self.dev.bind(k, self._logits, self._result),
                                    (1, 1, 1), 4 * self.vocab)
        out = []
        for t, s in enumerate(samplers):
            self.dev.write(self.xf, np.ascontiguousarray(h[t], np.float32))
            if s.params.greedy and s.penalized_ids().size == 0:
                self.dev.run(self._head + [self._argmax])
                out.append(int(np.frombuffer(self.dev.read(self._result, 4), np.uint32)[0]))
            else:
                self.dev.run(self._head)
                out.append(s.pick(np.frombuffer(self.dev.read(self._logits, 4 * self.vocab),
                                                np.float32).copy()))
        return out

    # -- the screened head (runtime/head.py, head.py) ---------------------------------------
    @property
    def head_itemsize(self) -> int:
        return self.head.row_bytes // self.dim

    def head_depth(self) -> int:
        from .head import GpuScreenedHead

        return GpuScreenedHead.depth(self.dim)

    def _screen(self) -> Any:
        if self._screened is None:
            from .head import GpuScreenedHead

            self._screened = GpuScreenedHead(self.dev, self.head, self.xf)
        return self._screened

    def screen_tables(self) -> Any:
        """The int8 copy of the head and its bound terms (made and uploaded on first use)."""
        return self._screen().tables

    def head_bounds(self, t: Any, xq: np.ndarray, par: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
        return self._screen().bounds(t, xq, par)

    def head_rows(self, h: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """``lm_head``'s logits of rows ``ids``: the same per-row WGSL, on the device."""
        return self._screen().logits(h, ids)

    def head_rows_bytes(self, ids: np.ndarray) -> int:
        return len(ids) * self.head.row_bytes
