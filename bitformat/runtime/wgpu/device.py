"""Device plumbing of the ``wgpu`` backend: adapter, kernels, pipelines, buffers, timing.

Kernels are the ``kernels/*.wgsl`` files, read with :mod:`importlib.resources`. A kernel may
paste a shared file with a line ``//#include name.wgsl``; the activation bindings are written
``var<X_SPACE> X: X_TYPE`` (``XF_TYPE``: f32 elements) and become a uniform
(``array<vec4<u32>, 4096>``, 64 KiB: on
llvmpipe a uniform read at a uniform address is one scalar load, 2x faster than storage) or a
read-only storage array (``array<vec4<u32>>``: GPUs dislike divergent uniform indexing, which
``lanes > 1`` causes). Every pipeline has an explicit bind group layout (:data:`BINDINGS`),
sizes and modes are ``override`` constants, and pipelines are cached by kernel, variant and
constants. wgpu-py 0.32 raises WGSL and validation errors at creation (its error scopes are not
implemented), so creation is wrapped to name the kernel and its constants.

Only what WGSL guarantees on Vulkan, Metal and D3D12 is used: u32/i32/f32, ``dot4I8Packed``,
``unpack2x16float``, workgroup memory <= 16 KiB, no shader-f16, no 64-bit integers. Two
optional features are requested where the adapter has them: ``subgroup`` (subgroup sums,
maxima and shuffles: the fused decode step of network.py needs it; without it a model runs op
by op on the kernels that need nothing optional) and ``timestamp-query`` (only for timing:
:meth:`GpuDevice.profile`, :meth:`GpuDevice.pass_seconds`; without it the profile times each
dispatch on the host). A text substitution (``subs``) may size a kernel's workgroup arrays or
name the file it includes; module and pipeline caches key on it.
"""

from __future__ import annotations

import importlib.resources
import math
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import GpuError, UnsupportedConversionError

#: ``BITFORMAT_REQUIRE_GPU=1`` turns "no adapter" into a test failure instead of a skip.
ENV_REQUIRE = "BITFORMAT_REQUIRE_GPU"

UNIFORM_WORDS = 16384  # 64 KiB: the activation block / x_live / LM head input as a uniform
STAGING_ALIGN = 4

#: kernel -> binding types in binding order: "uniform", "storage" (read_write), "read" (read-only
#: storage) or "x" (the activation-like input: uniform or read-only storage by variant).
BINDINGS: dict[str, tuple[str, ...]] = {
    "matvec_i2_s": ("x", "read", "uniform", "storage"),
    "matvec_tq2_0": ("x", "read", "uniform", "storage"),
    "matvec_tq1_0": ("x", "read", "uniform", "storage"),
    "matvec_stfma": ("x", "read", "uniform", "storage"),
    "matvec_colpack_u32": ("x", "read", "uniform", "storage"),
    "lm_head": ("x", "read", "uniform", "storage"),
    "lm_head_rows": ("x", "read", "uniform", "storage", "read"),
    "screen": ("x", "read", "uniform", "storage"),
    "argmax": ("read", "storage"),
    "rans_gather": ("x", "read", "uniform", "storage", "storage", "storage"),
    "rans_matvec": ("x", "read", "read", "uniform", "x", "storage", "storage"),
    "rans_finish": ("x", "read", "uniform", "read", "storage"),
    # the fused decode step (network.py; these need the `subgroup` feature)
    "fused_matvec": ("read", "read", "read", "uniform", "storage", "storage", "read"),
    "matmat_i2_s": ("read", "read", "uniform", "storage", "read"),
    "norm_block": ("read", "read", "read", "storage", "storage", "storage"),
    "attn_split": ("read", "storage", "storage", "read", "read", "storage", "read"),
    "attn_merge": ("read", "read", "storage"),
    "kv_write": ("read", "storage", "storage", "read", "read", "read"),
    "embed_step": ("read", "uniform", "read", "storage"),
    "lm_head_step": ("x", "read", "uniform", "storage", "storage", "read"),
    "lm_head_rows_step": ("x", "read", "uniform", "storage", "read"),
    "argmax_step": ("read", "storage", "storage"),
    # the screened head's greedy step on the device (head.py: GpuScreenedHead.step_dispatches)
    "screen_prep": ("read", "read", "storage", "storage", "storage"),
    "screen_step": ("x", "read", "uniform", "storage", "read", "storage"),
    "screen_pick": ("read", "read", "storage"),
    "argmax_screen": ("read", "read", "read", "storage", "storage"),
}

_X_TYPES = {  # (X_SPACE, X_TYPE, XF_TYPE) per variant
    "uniform": ("uniform", "array<vec4<u32>, 4096>", "array<vec4<f32>, 4096>"),
    "storage": ("storage, read", "array<vec4<u32>>", "array<vec4<f32>>"),
}


def request_adapter() -> Any | None:
    """The preferred wgpu adapter, or None if there is none (or wgpu cannot load)."""
    try:
        import wgpu

        return wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    except Exception:  # no driver, no Vulkan loader, ...: the caller decides what that means
        return None


#: text every kernel may use, substituted before compiling (a kernel's own ``subs`` win)
DEFAULT_SUBS = {"W_BINDING": "1", "SLOT_OFF": "(QOFF + (COLS + 255u) / 256u * 64u)",
                "I2S_PRE": "2", "XBASE": "0u"}


def kernel_source(stem: str, variant: str = "uniform", subs: dict[str, str] | None = None
                  ) -> str:
    """The WGSL text of ``kernels/<stem>.wgsl`` with includes pasted (each file once, nested
    includes too) and X_* and ``subs`` (names -> text) substituted."""
    root = importlib.resources.files("bitformat.runtime.wgpu") / "kernels"
    seen: set[str] = set()

    def paste(name: str) -> list[str]:
        seen.add(name)
        lines = []
        for line in (root / name).read_text().splitlines():
            if line.startswith("//#include "):
                inc = line.split()[1]
                inc = (subs or {}).get(inc, inc)
                if inc not in seen:
                    lines += paste(inc)
            else:
                lines.append(line)
        return lines

    text = "\n".join(paste(f"{stem}.wgsl"))
    space, xtype, xftype = _X_TYPES[variant]
    table = {**DEFAULT_SUBS, **(subs or {}), "X_SPACE": space, "XF_TYPE": xftype,
             "X_TYPE": xtype}
    for token in sorted(table, key=len, reverse=True):  # longer names first
        text = text.replace(token, table[token])
    return text


@dataclass
class Kernel:
    """One compiled pipeline and its bind group layout."""

    stem: str
    pipeline: Any
    layout: Any
    constants: dict[str, float]


@dataclass
class Dispatch:
    """One recorded dispatch: ``kind`` (the timing class), its bytes read, the work grid."""

    kind: str
    kernel: Kernel
    group: Any
    grid: tuple[int, int, int]
    nbytes: int = 0  # bytes it reads (weights, activations), for GB/s
    nbytes_per_pos: int = 0  # plus this many per cached position (attention)
    label: str = ""  # what it computes in the step (qkv, attn_split, ...), for profiles

    def encode(self, cpass: Any) -> None:
        cpass.set_pipeline(self.kernel.pipeline)
        cpass.set_bind_group(0, self.group)
        cpass.dispatch_workgroups(*self.grid)

    @property
    def raw(self) -> tuple:
        """(pipeline, bind group, x, y, z): wgpu-native handles for
        :meth:`GpuDevice.encode_raw`."""
        return (self.kernel.pipeline._internal, self.group._internal, *self.grid)


#: lanes of a subgroup per matrix row in the fused kernels, by format (at most the subgroup
#: size): 2-bit rows of 2560 values are 40 vec4 units (i2_s) or 160 words (stfma), tq rows 10
#: blocks. ``BITFORMAT_WGPU_FUSED="i2_s=16,passes=2"`` overrides them (tools/gpu_check.sh).
FUSED_LPR = {"i2_s": 8, "stfma": 32, "colpack_u32": 32, "tq2_0": 8, "tq1_0": 8, "head": 32}
ENV_FUSED = "BITFORMAT_WGPU_FUSED"


def _fused_tuning() -> dict[str, int]:
    out: dict[str, int] = {}
    for part in os.environ.get(ENV_FUSED, "").split(","):
        if "=" in part:
            k, _, v = part.partition("=")
            out[k.strip()] = int(v)
    return out


class GpuDevice:
    """A wgpu device with the limits and features the backend needs.

    ``max_binding`` caps the bytes of one storage binding below the adapter's limit (tests use
    it to force splitting); ``lanes`` is the invocations per matrix row of the op-by-op
    kernels (default 1 on CPU adapters such as lavapipe, 16 elsewhere); ``x_space`` is
    "uniform" or "storage" for the activation bindings (default uniform with one lane, storage
    with several); ``fused`` whether the decode step's mat-vecs quantize their own input
    (default: on GPUs, not on CPU adapters).
    """

    def __init__(self, adapter: Any = None, *, max_binding: int | None = None,
                 lanes: int | None = None, x_space: str | None = None,
                 fused: bool | None = None):
        import wgpu

        self.wgpu = wgpu
        adapter = adapter or request_adapter()
        if adapter is None:
            raise GpuError("no wgpu adapter: install a Vulkan, Metal or D3D12 "
                                             "driver (on Linux without a GPU: lavapipe, package "
                                             "mesa-vulkan-drivers)")
        self.adapter = adapter
        self.info = dict(adapter.info)
        limits = adapter.limits
        features = [f for f in ("timestamp-query", "subgroup") if f in adapter.features]
        want = {k: limits[k] for k in ("max-storage-buffer-binding-size", "max-buffer-size",
                                       "max-storage-buffers-per-shader-stage",
                                       "max-compute-workgroup-storage-size")}
        self.device = adapter.request_device_sync(required_features=features,
                                                  required_limits=want)
        self.queue = self.device.queue
        self.limits = self.device.limits
        self.max_binding = int(self.limits["max-storage-buffer-binding-size"])
        if max_binding:
            self.max_binding = min(self.max_binding, int(max_binding))
        self.max_groups = int(self.limits["max-compute-workgroups-per-dimension"])
        self.timestamps = "timestamp-query" in self.device.features
        #: subgroup operations (the fused decode step needs them) and the size a probe kernel
        #: ran with (the kernels read the real size from a builtin; this only sizes work)
        self.subgroups = "subgroup" in self.device.features
        self.subgroup_size = self._probe_subgroup() if self.subgroups else 0
        self._raw = _raw_calls()
        self._native = _native_readback()
        self.is_cpu = self.info.get("adapter_type") == "CPU"
        self.lanes = int(lanes or (1 if self.is_cpu else 16))
        if self.lanes not in (1, 2, 4, 8, 16, 32, 64):
            raise UnsupportedConversionError(f"lanes must be a power of two <= 64, got {lanes}")
        self.x_space = x_space or ("uniform" if self.lanes == 1 else "storage")
        # one lane a row on CPU adapters (lavapipe streams a row per invocation best, as the
        # op-by-op kernels found; its shuffles cost more than they save)
        lpr = dict.fromkeys(FUSED_LPR, 1) if self.is_cpu else FUSED_LPR
        # gate|up: twice the rows a workgroup (H200: 389.8 against 383.2 tok/s in one run,
        # docs/benchmarks.md)
        self.tuning = {**lpr, "passes": 1, "gate_up.passes": 2, **_fused_tuning()}
        #: whether the decode step's mat-vecs quantize their own input (fused_matvec.wgsl) or
        #: read the activation block one norm_block dispatch wrote (the op-by-op kernels):
        #: fused on GPUs; on CPU adapters a workgroup-memory block costs llvmpipe a gather
        #: per read, where the op-by-op kernels read a uniform buffer (5-8x faster there)
        self.fused = (not self.is_cpu) if fused is None else bool(fused)
        self._scratch: Any = None

        if self.x_space not in _X_TYPES:
            raise UnsupportedConversionError(f"x_space must be uniform or storage, not "
                                             f"{x_space!r}")
        self._modules: dict[tuple, Any] = {}
        self._layouts: dict[str, Any] = {}
        self._pipelines: dict[tuple, Kernel] = {}

    def _probe_subgroup(self) -> int:
        w = self.wgpu
        code = ("@group(0) @binding(0) var<storage, read_write> B: array<u32>;\n"
                "@compute @workgroup_size(256) fn main(@builtin(local_invocation_index) t: u32, "
                "@builtin(subgroup_size) n: u32) { if (t == 0u) { B[0] = n; } }")
        try:
            m = self.device.create_shader_module(code=code)
            p = self.device.create_compute_pipeline(layout="auto", compute={
                "module": m, "entry_point": "main"})
            b = self.device.create_buffer(size=16, usage=w.BufferUsage.STORAGE
                                          | w.BufferUsage.COPY_SRC)
            g = self.device.create_bind_group(layout=p.get_bind_group_layout(0), entries=[
                {"binding": 0, "resource": {"buffer": b, "offset": 0, "size": 16}}])
            enc = self.device.create_command_encoder()
            cp = enc.begin_compute_pass()
            cp.set_pipeline(p)
            cp.set_bind_group(0, g)
            cp.dispatch_workgroups(1)
            cp.end()
            self.queue.submit([enc.finish()])
            n = int(np.frombuffer(self.queue.read_buffer(b), np.uint32)[0])
        except Exception:  # noqa: BLE001 - a driver that fails this has no usable subgroups
            self.subgroups = False
            return 0
        if n < 4 or n & (n - 1):
            self.subgroups = False
            return 0
        return n

    def fused_shape(self, encoding: str, part: str = "") -> tuple[int, int]:
        """(lanes per row, rows per workgroup) of a fused kernel for this format's rows; a
        tuning key ``<part>.<encoding>`` or ``<part>.passes`` (``down.i2_s=32``) overrides
        the format's for one step part (qkv, o, gate_up, down)."""
        t = self.tuning
        lanes = t.get(f"{part}.{encoding}", t.get(encoding, 32)) if part else t.get(encoding, 32)
        passes = t.get(f"{part}.passes", t["passes"]) if part else t["passes"]
        lpr = max(1, min(int(lanes), self.subgroup_size or 1))
        return lpr, 256 // lpr * max(1, int(passes))

    def head_shape(self) -> tuple[int, int]:
        """(lanes per row, rows per workgroup) of the head kernels (lm_head_step.wgsl,
        lm_head_rows_step.wgsl): at least 32 rows a workgroup, whole passes of its subgroups."""
        lpr, _ = self.fused_shape("head")
        return lpr, max(32, 256 // lpr)

    @property
    def scratch(self) -> Any:
        """A small storage buffer to bind where a kernel's optional output is unused."""
        if self._scratch is None:
            self._scratch = self.buffer(256, "scratch")
        return self._scratch

    @property
    def name(self) -> str:
        return f"{self.info.get('device', '?')} ({self.info.get('backend_type', '?')})"

    # -- kernels ------------------------------------------------------------------------------
    def _layout(self, stem: str) -> Any:
        if stem not in self._layouts:
            w = self.wgpu
            kinds = {"uniform": "uniform", "storage": "storage", "read": "read-only-storage",
                     "x": "uniform" if self.x_space == "uniform" else "read-only-storage"}
            entries = [{"binding": i, "visibility": w.ShaderStage.COMPUTE,
                        "buffer": {"type": kinds[k]}} for i, k in enumerate(BINDINGS[stem])]
            self._layouts[stem] = self.device.create_bind_group_layout(entries=entries)
        return self._layouts[stem]

    def kernel(self, stem: str, subs: dict[str, str] | None = None, **constants: float
               ) -> Kernel:
        """The pipeline of ``stem`` with these text substitutions (sizes of workgroup arrays,
        included files) and override constants (cached)."""
        skey = tuple(sorted((subs or {}).items()))
        key = (stem, skey, tuple(sorted(constants.items())))
        if key in self._pipelines:
            return self._pipelines[key]
        try:
            if (stem, skey) not in self._modules:
                self._modules[stem, skey] = self.device.create_shader_module(
                    label=stem, code=kernel_source(stem, self.x_space, subs))
            layout = self._layout(stem)
            pipeline = self.device.create_compute_pipeline(
                label=stem, layout=self.device.create_pipeline_layout(bind_group_layouts=[layout]),
                compute={"module": self._modules[stem, skey], "entry_point": "main",
                         "constants": {k: float(v) for k, v in constants.items()}})
        except Exception as e:  # wgpu's GPUValidationError carries naga's message
            raise GpuError(f"creating kernel {stem} with {constants} {subs or ''}: {e}") from e
        k = Kernel(stem, pipeline, layout, dict(constants))
        self._pipelines[key] = k
        return k

    def bind(self, kernel: Kernel, *resources: Any) -> Any:
        """A bind group of ``kernel`` over buffers (or ``(buffer, offset, size)``)."""
        entries = []
        for i, r in enumerate(resources):
            if isinstance(r, tuple):
                buf, off, size = r
                entries.append({"binding": i, "resource": {"buffer": buf, "offset": off,
                                                           "size": size}})
            else:
                entries.append({"binding": i, "resource": {"buffer": r, "offset": 0,
                                                           "size": r.size}})
        return self.device.create_bind_group(layout=kernel.layout, entries=entries)

    def grid(self, groups: int) -> tuple[int, int, int]:
        """A 2-D grid of at least ``groups`` workgroups within the per-dimension limit."""
        groups = max(1, int(groups))
        if groups <= self.max_groups:
            return (groups, 1, 1)
        y = math.ceil(groups / self.max_groups)
        return (math.ceil(groups / y), y, 1)

    # -- buffers --------------------------------------------------------------------------------
    def upload(self, data: np.ndarray | bytes, label: str = "", *, usage: int = 0,
               pad: int = 0) -> Any:
        """A storage buffer holding ``data`` (padded with ``pad`` zero bytes, then to 4)."""
        raw = np.frombuffer(memoryview(data).cast("B"), np.uint8) if not isinstance(
            data, np.ndarray) else np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        size = -(-(raw.size + pad) // STAGING_ALIGN) * STAGING_ALIGN
        if size != raw.size:
            raw = np.concatenate([raw, np.zeros(size - raw.size, np.uint8)])
        u = self.wgpu.BufferUsage
        return self.device.create_buffer_with_data(
            label=label, data=raw, usage=u.STORAGE | u.COPY_DST | u.COPY_SRC | usage)

    def buffer(self, size: int, label: str = "", *, uniform: bool = False) -> Any:
        """A zeroed storage buffer of ``size`` bytes (also a uniform if asked)."""
        u = self.wgpu.BufferUsage
        usage = u.STORAGE | u.COPY_DST | u.COPY_SRC | (u.UNIFORM if uniform else 0)
        return self.device.create_buffer(label=label, size=max(16, -(-size // 16) * 16),
                                         usage=usage)

    def uniform(self, data: np.ndarray | bytes, label: str = "") -> Any:
        u = self.wgpu.BufferUsage
        raw = bytes(data) if not isinstance(data, np.ndarray) else data.tobytes()
        raw += b"\0" * (-len(raw) % 16)
        return self.device.create_buffer_with_data(label=label, data=raw,
                                                   usage=u.UNIFORM | u.COPY_DST)

    def write(self, buf: Any, data: np.ndarray | bytes, offset: int = 0) -> None:
        self.queue.write_buffer(buf, offset, data if isinstance(data, bytes) else data.tobytes())

    def read(self, buf: Any, size: int | None = None, offset: int = 0) -> bytes:
        """Copy ``size`` bytes of ``buf`` back (waits for the queue)."""
        return bytes(self.queue.read_buffer(buf, offset, size))

    def staging(self, size: int, label: str = "") -> Any:
        u = self.wgpu.BufferUsage
        return self.device.create_buffer(label=label, size=-(-size // 4) * 4,
                                         usage=u.MAP_READ | u.COPY_DST)

    def map_read(self, staging: Any, size: int, after: int = 0) -> bytes:
        """Read a MAP_READ buffer that a submitted copy filled (waits for it).

        ``after`` > 0 is the index :meth:`submit` returned for the submission that filled it:
        then only that submission is waited for. wgpu-py's ``map_sync`` polls the device until
        the queue is idle, so a step submitted after the one being read (the greedy step in
        flight) had to finish too, and the GPU idled while the host recorded the next one."""
        if after and self._native is not None:
            return self._native.read(self, staging, size, after)
        staging.map_sync(mode=self.wgpu.MapMode.READ)
        try:
            return bytes(staging.read_mapped(0, -(-size // 4) * 4))[:size]
        finally:
            staging.unmap()

    def submit(self, command_buffers: Sequence[Any]) -> int:
        """Submit; the submission's index for :meth:`map_read` (0 where wgpu-py has no native
        backend: then reads wait for the whole queue)."""
        if self._native is None:  # pragma: no cover - another wgpu-py backend
            self.queue.submit(list(command_buffers))
            return 0
        return self._native.submit(self.queue, command_buffers)

    # -- running ----------------------------------------------------------------------------------
    def encode(self, items: Iterable[Dispatch | tuple], copies: Sequence[tuple] = ()) -> Any:
        """One command buffer: the dispatches in one compute pass, then ``copies``.

        An item that is a tuple ``(src, src_offset, dst, dst_offset, size)`` is a buffer copy
        at that point: the pass ends before it and a new one begins after it (tracing).
        """
        enc = self.device.create_command_encoder()
        cpass = None
        for it in items:
            if isinstance(it, Dispatch):
                cpass = cpass or enc.begin_compute_pass()
                it.encode(cpass)
            else:
                if cpass is not None:
                    cpass.end()
                    cpass = None
                enc.copy_buffer_to_buffer(*it)
        if cpass is not None:
            cpass.end()
        for c in copies:
            enc.copy_buffer_to_buffer(*c)
        return enc.finish()

    def encode_raw(self, seq: Sequence[tuple], copies: Sequence[tuple] = ()) -> Any:
        """One command buffer of ``seq`` = :attr:`Dispatch.raw` tuples in one compute pass,
        then ``copies``. The dispatches are recorded by calling wgpu-native's functions
        directly (the cffi library wgpu-py wraps): about half of wgpu-py's host time per
        dispatch (tools/gpu_probe.py; wgpu-core's own validation remains). Errors surface at
        ``finish`` as with wgpu-py's calls. :meth:`encode_parts` records several passes."""
        return self.encode_parts([list(seq), *copies])

    def encode_parts(self, parts: Sequence[Any]) -> Any:
        """One command buffer of ``parts``, each a list of raw dispatch tuples (one compute
        pass) or a buffer copy ``(src, src_offset, dst, dst_offset, size)``."""
        if self._raw is None:  # pragma: no cover - a wgpu-py without the native backend
            raise GpuError("encode_raw needs wgpu-py's wgpu_native backend")
        sp, sb, dw, null = self._raw
        enc = self.device.create_command_encoder()
        for part in parts:
            if isinstance(part, tuple):
                enc.copy_buffer_to_buffer(*part)
                continue
            cp = enc.begin_compute_pass()
            h = cp._internal
            last = None
            for p, g, x, y, z in part:
                if p is not last:
                    sp(h, p)
                    last = p
                sb(h, 0, g, 0, null)
                dw(h, x, y, z)
            cp.end()
        return enc.finish()

    def pass_seconds(self, seq: Sequence[tuple], repeats: int = 3) -> float | None:
        """GPU seconds of ``seq`` (raw tuples) in one compute pass, between timestamps at the
        pass's start and end (median of ``repeats``); None without timestamp queries."""
        if not self.timestamps or not seq:
            return None
        u = self.wgpu.BufferUsage
        out = []
        for _ in range(max(1, repeats)):
            qs = self.device.create_query_set(type="timestamp", count=2)
            res = self.device.create_buffer(size=16, usage=u.QUERY_RESOLVE | u.COPY_SRC)
            stage = self.staging(16, "timestamps")
            enc = self.device.create_command_encoder()
            cp = enc.begin_compute_pass(timestamp_writes={
                "query_set": qs, "beginning_of_pass_write_index": 0,
                "end_of_pass_write_index": 1})
            sp, sb, dw, null = self._raw
            h = cp._internal
            for p, g, x, y, z in seq:
                sp(h, p)
                sb(h, 0, g, 0, null)
                dw(h, x, y, z)
            cp.end()
            enc.resolve_query_set(qs, 0, 2, res, 0)
            enc.copy_buffer_to_buffer(res, 0, stage, 0, 16)
            self.queue.submit([enc.finish()])
            t = np.frombuffer(self.map_read(stage, 16), np.uint64)
            out.append(max(0, int(t[1]) - int(t[0])) * 1e-9)
        return float(np.median(out))

    def run(self, items: Iterable[Dispatch | tuple], copies: Sequence[tuple] = (), *,
            wait: bool = True) -> None:
        self.queue.submit([self.encode(items, copies)])
        if wait:
            self.wait()

    def wait(self) -> None:
        """Block until the queue is idle (``on_submitted_work_done_sync`` is broken in 0.32)."""
        poll = getattr(self.device, "_poll_wait", None)
        if poll is not None:
            poll()
        else:  # pragma: no cover - other wgpu-py versions: a readback waits too
            self.queue.read_buffer(self._tiny())

    def _tiny(self) -> Any:  # pragma: no cover
        if not hasattr(self, "_tiny_buf"):
            self._tiny_buf = self.buffer(16, "wait")
        return self._tiny_buf

    def profile(self, dispatches: Sequence[Dispatch]) -> tuple[list[float], str]:
        """Seconds of each dispatch, and the clock: "gpu-timestamps" or "host".

        With timestamp queries every dispatch gets its own pass with begin/end timestamps
        (WebGPU timestamps are nanoseconds; lavapipe's period is 1 ns); without them each
        dispatch is submitted and waited for alone, timed on the host (this adds the submit
        overhead, about 0.1-0.3 ms on lavapipe).
        """
        dispatches = list(dispatches)
        if not dispatches:
            return [], "none"
        if not self.timestamps:
            out = []
            for d in dispatches:
                t0 = time.perf_counter()
                self.run([d])
                out.append(time.perf_counter() - t0)
            return out, "host"
        n = len(dispatches)
        qs = self.device.create_query_set(type="timestamp", count=2 * n)
        u = self.wgpu.BufferUsage
        resolve = self.device.create_buffer(size=16 * n, usage=u.QUERY_RESOLVE | u.COPY_SRC)
        stage = self.staging(16 * n, "timestamps")
        enc = self.device.create_command_encoder()
        for i, d in enumerate(dispatches):
            cpass = enc.begin_compute_pass(timestamp_writes={
                "query_set": qs, "beginning_of_pass_write_index": 2 * i,
                "end_of_pass_write_index": 2 * i + 1})
            d.encode(cpass)
            cpass.end()
        enc.resolve_query_set(qs, 0, 2 * n, resolve, 0)
        enc.copy_buffer_to_buffer(resolve, 0, stage, 0, 16 * n)
        self.queue.submit([enc.finish()])
        ticks = np.frombuffer(self.map_read(stage, 16 * n), np.uint64).reshape(n, 2)
        ns = (ticks[:, 1].astype(np.int64) - ticks[:, 0].astype(np.int64)).clip(0)
        return [float(v) * 1e-9 for v in ns], "gpu-timestamps"


def _wgpu_native() -> tuple[Any, Any] | None:
    """wgpu-py's cffi ``(ffi, lib)`` of wgpu-native, or None with another wgpu-py backend."""
    try:
        from wgpu.backends.wgpu_native import ffi, lib
    except Exception:  # pragma: no cover - another wgpu-py backend
        return None
    return ffi, lib


def _raw_calls() -> tuple | None:
    """wgpu-native's set-pipeline, set-bind-group and dispatch functions (and NULL), unwrapped."""
    native = _wgpu_native()
    if native is None:  # pragma: no cover - another wgpu-py backend
        return None
    ffi, lib = native
    return (lib.wgpuComputePassEncoderSetPipeline, lib.wgpuComputePassEncoderSetBindGroup,
            lib.wgpuComputePassEncoderDispatchWorkgroups, ffi.NULL)


class _NativeReadback:
    """Submission indices and buffer maps through wgpu-native's functions (the cffi library
    wgpu-py wraps): ``wgpuQueueSubmitForIndex``, then ``wgpuDevicePoll`` waiting for that index
    alone, a map request whose callback the next non-blocking poll fires, the mapped bytes
    copied and the buffer unmapped."""

    def __init__(self, ffi: Any, lib: Any):
        self.ffi, self.lib = ffi, lib
        self.done: dict[int, int] = {}
        self.next_key = 0
        done = self.done

        @ffi.callback("void(WGPUMapAsyncStatus, WGPUStringView, void *, void *)")
        def on_map(status: int, _msg: Any, key: Any, _u2: Any) -> None:
            done[int(ffi.cast("uintptr_t", key))] = int(status)

        self.on_map = on_map  # kept alive with the device

    def submit(self, queue: Any, command_buffers: Sequence[Any]) -> int:
        cbs = [c._internal for c in command_buffers]
        arr = self.ffi.new("WGPUCommandBuffer[]", cbs)
        return int(self.lib.wgpuQueueSubmitForIndex(queue._internal, len(cbs), arr))

    def read(self, dev: GpuDevice, staging: Any, size: int, after: int) -> bytes:
        ffi, lib = self.ffi, self.lib
        device, buf = dev.device._internal, staging._internal
        nbytes = -(-size // 4) * 4
        lib.wgpuDevicePoll(device, True, ffi.new("WGPUSubmissionIndex *", after))
        self.next_key += 1
        key = self.next_key
        info = ffi.new("WGPUBufferMapCallbackInfo *")
        info.mode = lib.WGPUCallbackMode_AllowProcessEvents
        info.callback = self.on_map
        info.userdata1 = ffi.cast("void *", key)
        lib.wgpuBufferMapAsync(buf, lib.WGPUMapMode_Read, 0, nbytes, info[0])
        for spin in range(100_000):
            if key in self.done:
                break
            # the submission is done, so the first non-blocking poll should fire the callback;
            # after many, wait for the queue as wgpu-py does
            lib.wgpuDevicePoll(device, spin > 1000, ffi.NULL)
        status = self.done.pop(key, None)
        if status != lib.WGPUMapAsyncStatus_Success:
            raise GpuError(f"could not map {staging.label or 'a staging buffer'} for reading "
                           f"(wgpu status {status})")
        try:
            ptr = lib.wgpuBufferGetConstMappedRange(buf, 0, nbytes)
            return bytes(ffi.buffer(ptr, nbytes))[:size]
        finally:
            lib.wgpuBufferUnmap(buf)


def _native_readback() -> _NativeReadback | None:
    """None with another wgpu-py backend: then reads use wgpu-py's own maps."""
    native = _wgpu_native()
    return None if native is None else _NativeReadback(*native)


def require_gpu() -> bool:
    """True if ``BITFORMAT_REQUIRE_GPU`` asks for an adapter (CI on lavapipe)."""
    return os.environ.get(ENV_REQUIRE, "").strip() not in ("", "0", "false", "no")
