"""What a wgpu adapter costs per dispatch, per encoded command and per mat-vec shape.

    python tools/gpu_probe.py [--json OUT.json]

Measures, on the adapter wgpu picks (a real GPU or lavapipe):

* adapter, driver, features and the limits the kernels care about;
* the GPU time of a dispatch inside one compute pass (timestamps at the pass's start and end,
  N dispatches), for a chain of dispatches that write one buffer (wgpu puts a barrier between
  each) and for dispatches that write N separate buffers, at 1, 132 and 1056 workgroups;
* the host time to encode and submit N dispatches through wgpu-py's API and through direct
  calls of wgpu-native's C functions (the same cffi library wgpu-py wraps);
* the op-by-op mat-vec kernels (i2_s) and the one-workgroup norm at 2B-4T's shapes, 30 cold
  copies each in one pass, for several lane counts;
* whether subgroup operations compile and what the subgroup size is.

The decode step design in docs/gpu.md was chosen from these numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CHAIN = """
@group(0) @binding(0) var<storage, read_write> B: array<f32>;
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) g: vec3<u32>) {
    if (g.x == 0u) { B[0] = B[0] + 1.0; }
}
"""

SUBGROUP = """
@group(0) @binding(0) var<storage, read_write> B: array<u32>;
@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) t: u32, @builtin(subgroup_size) n: u32) {
    let s = subgroupAdd(1u);
    if (t == 0u) { B[0] = n; B[1] = s; }
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--quick", action="store_true", help="fewer repeats (lavapipe)")
    a = ap.parse_args()
    import wgpu
    from wgpu.backends.wgpu_native import ffi, lib

    out: dict = {}
    adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    info = dict(adapter.info)
    feats = sorted(adapter.features)
    lim = adapter.limits
    keys = [k for k in lim if any(s in k for s in ("workgroup", "storage-buffer", "subgroup",
                                                   "immediate", "buffer-size"))]
    out["adapter"] = info
    out["features"] = feats
    out["limits"] = {k: lim[k] for k in keys}
    print(json.dumps(info), flush=True)
    print("features:", " ".join(feats), flush=True)
    print("limits:", out["limits"], flush=True)
    want = [f for f in ("timestamp-query", "subgroup") if f in adapter.features]
    dev = adapter.request_device_sync(required_features=want, required_limits={
        k: lim[k] for k in ("max-storage-buffer-binding-size", "max-buffer-size",
                            "max-compute-invocations-per-workgroup",
                            "max-compute-workgroup-size-x",
                            "max-compute-workgroup-storage-size")})
    q = dev.queue
    U = wgpu.BufferUsage
    reps = 3 if a.quick else 7

    def wait() -> None:
        dev._poll_wait()

    def timed_pass(encode, n: int = 1, dev=dev) -> float:
        """Median seconds of one compute pass (pass timestamps), divided by n."""
        ts = []
        for _ in range(reps):
            q = dev.queue
            qs = dev.create_query_set(type="timestamp", count=2)
            res = dev.create_buffer(size=16, usage=U.QUERY_RESOLVE | U.COPY_SRC)
            st = dev.create_buffer(size=16, usage=U.MAP_READ | U.COPY_DST)
            enc = dev.create_command_encoder()
            cp = enc.begin_compute_pass(timestamp_writes={
                "query_set": qs, "beginning_of_pass_write_index": 0,
                "end_of_pass_write_index": 1})
            encode(cp)
            cp.end()
            enc.resolve_query_set(qs, 0, 2, res, 0)
            enc.copy_buffer_to_buffer(res, 0, st, 0, 16)
            q.submit([enc.finish()])
            st.map_sync(mode=wgpu.MapMode.READ)
            t = np.frombuffer(st.read_mapped(0, 16), np.uint64).copy()
            st.unmap()
            ts.append(float(int(t[1]) - int(t[0])) * 1e-9)
        return statistics.median(ts) / n

    def pipeline(code: str, constants: dict | None = None):
        m = dev.create_shader_module(code=code)
        return dev.create_compute_pipeline(layout="auto", compute={
            "module": m, "entry_point": "main", "constants": constants or {}})

    # -- dispatch floor --------------------------------------------------------------------
    pl = pipeline(CHAIN)
    N = 200
    bufs = [dev.create_buffer(size=1024, usage=U.STORAGE) for _ in range(N)]
    groups = [dev.create_bind_group(layout=pl.get_bind_group_layout(0), entries=[
        {"binding": 0, "resource": {"buffer": b, "offset": 0, "size": 1024}}]) for b in bufs]
    floor = {}
    for wgs in (1, 132, 1056):
        for kind in ("chain", "separate"):
            def enc(cp, wgs=wgs, kind=kind):
                cp.set_pipeline(pl)
                for i in range(N):
                    cp.set_bind_group(0, groups[0 if kind == "chain" else i])
                    cp.dispatch_workgroups(wgs)
            us = timed_pass(enc, N) * 1e6
            floor[f"{kind}:{wgs}"] = us
            print(f"dispatch floor {kind:8s} {wgs:5d} workgroups: {us:.2f} us", flush=True)
    out["dispatch_floor_us"] = floor

    # -- host encoding ----------------------------------------------------------------------
    pls = [pipeline(CHAIN.replace("1.0", f"{i + 1}.0")) for i in range(6)]
    gr6 = [[dev.create_bind_group(layout=p.get_bind_group_layout(0), entries=[
        {"binding": 0, "resource": {"buffer": bufs[j], "offset": 0, "size": 1024}}])
        for j in range(31)] for p in pls]
    n_disp = 185
    seq = [(pls[i % 6], gr6[i % 6][i // 6]) for i in range(n_disp)]
    seq_raw = [(p._internal, g._internal) for p, g in seq]
    host = {}
    for mode in ("wgpu-py", "raw", "wgpu-py", "raw"):
        ts = []
        for _ in range(20):
            t0 = time.perf_counter()
            enc = dev.create_command_encoder()
            cp = enc.begin_compute_pass()
            if mode == "raw":
                h = cp._internal
                sp, sb, d = (lib.wgpuComputePassEncoderSetPipeline,
                             lib.wgpuComputePassEncoderSetBindGroup,
                             lib.wgpuComputePassEncoderDispatchWorkgroups)
                null = ffi.NULL
                for p, g in seq_raw:
                    sp(h, p)
                    sb(h, 0, g, 0, null)
                    d(h, 1, 1, 1)
            else:
                for p, g in seq:
                    cp.set_pipeline(p)
                    cp.set_bind_group(0, g)
                    cp.dispatch_workgroups(1)
            cp.end()
            cb = enc.finish()
            t1 = time.perf_counter()
            q.submit([cb])
            t2 = time.perf_counter()
            wait()
            ts.append((t1 - t0, t2 - t1))
        enc_us = statistics.median(t[0] for t in ts) / n_disp * 1e6
        sub_us = statistics.median(t[1] for t in ts) / n_disp * 1e6
        host[mode] = {"encode_us_per_dispatch": enc_us, "submit_us_per_dispatch": sub_us}
        print(f"host {mode:8s}: encode {enc_us:.2f} us/dispatch, submit {sub_us:.2f} "
              f"us/dispatch ({n_disp} dispatches)", flush=True)
    out["host"] = host

    # -- subgroups ----------------------------------------------------------------------------
    if "subgroup" in dev.features:
        try:
            p = pipeline(SUBGROUP)
            b = dev.create_buffer(size=16, usage=U.STORAGE | U.COPY_SRC)
            g = dev.create_bind_group(layout=p.get_bind_group_layout(0), entries=[
                {"binding": 0, "resource": {"buffer": b, "offset": 0, "size": 16}}])
            enc = dev.create_command_encoder()
            cp = enc.begin_compute_pass()
            cp.set_pipeline(p)
            cp.set_bind_group(0, g)
            cp.dispatch_workgroups(1)
            cp.end()
            q.submit([enc.finish()])
            v = np.frombuffer(q.read_buffer(b), np.uint32)
            out["subgroup"] = {"size": int(v[0]), "add": int(v[1])}
        except Exception as e:  # noqa: BLE001 - a probe reports what failed
            out["subgroup"] = {"error": str(e)[:300]}
        print("subgroup:", out["subgroup"], flush=True)

    # -- the current kernels at 2B-4T shapes --------------------------------------------------
    from bitformat.runtime.wgpu.backend import GpuMatrix, RowMatrix, activation_block
    from bitformat.runtime.wgpu.device import GpuDevice

    rng = np.random.default_rng(0)
    shapes = [("q/o 2560x2560", 2560, 2560, 1), ("k/v 640x2560", 640, 2560, 1),
              ("gate+up 2x6912x2560", 6912, 2560, 2), ("down 2560x6912", 2560, 6912, 1)]
    copies = 8 if a.quick else 30
    valid = np.array([b for b in range(256) if all((b >> s) & 3 != 3 for s in (0, 2, 4, 6))],
                     np.uint8)  # bytes of four 2-bit codes 0..2
    mv = {}
    for lanes in ((1,) if a.quick else (16, 32, 64)):
        g = GpuDevice(adapter, lanes=lanes)
        x = g.buffer(4 * 16384, "x", uniform=True)
        g.write(x, activation_block(rng.integers(-127, 128, 6912).astype(np.int8), 0.5))
        for name, rows, cols, pair in shapes:
            y = g.buffer(4 * rows, "y")
            ds = []
            for _ in range(copies):
                mats = [RowMatrix("w", "i2_s", rows, cols,
                                  valid[rng.integers(0, valid.size, (rows, cols // 4))],
                                  1.0, {"BLK": 128}) for _ in range(pair)]
                ds += GpuMatrix(g, mats).dispatches(x, y, 2 if pair == 2 else 0)
            nbytes = ds[0].nbytes

            def enc(cp, ds=ds):
                for d in ds:
                    d.encode(cp)
            s = timed_pass(enc, len(ds), g.device)
            mv[f"{name} lanes={lanes}"] = {"us": s * 1e6, "gbps": nbytes / s / 1e9}
            print(f"matvec i2_s {name:22s} lanes {lanes:2d}: {s * 1e6:7.2f} us "
                  f"{nbytes / s / 1e9:7.1f} GB/s", flush=True)
        for n in (2560, 6912):
            src = g.buffer(4 * n)
            g.write(src, rng.standard_normal(n).astype(np.float32))
            gain = g.upload(np.ones(n, np.float32))
            from bitformat.runtime.wgpu.backend import fused_subs
            from bitformat.runtime.wgpu.device import Dispatch
            k = g.kernel("norm_block", fused_subs("", n), COLS=n, QUANT=1, TRACE=0)
            d = Dispatch("norm", k, g.bind(k, src, src, gain, x, g.scratch, g.buffer(4 * n)),
                         (1, 1, 1))

            def enc(cp, d=d):
                for _ in range(30):
                    d.encode(cp)
            s = timed_pass(enc, 30, g.device)
            mv[f"norm {n}"] = {"us": s * 1e6}
            print(f"norm_quant {n}: {s * 1e6:.2f} us", flush=True)
    out["kernels"] = mv
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
