"""Write the golden fixtures under ``tests/fixtures/<format_id>/`` (deterministic).

Each folder gets ``tensor.bin`` (the encoded bytes of one small matrix), ``trits.npy`` (the
matrix) and ``scale.json`` (shape and scales). The matrix is 3 x 512 with two all-zero
256-value blocks and scale 1.5; stfma and colpack_u32 keep only its first 500 columns so
their row padding is frozen too.

``rans_float/`` freezes the 16-bit float coding: ``tensor.bin``, ``values.npy`` (uint16
patterns, 24 x 200 f16 holding bf16 values, rows of two scales, two subnormals and three
values that are not from bf16: every section of the layout) and ``info.json``.

Usage::

    python tools/make_fixtures.py           # write missing fixtures, verify existing ones
    python tools/make_fixtures.py --force   # rewrite fixtures that differ (format change!)

Tests never call this script: a missing or different fixture fails them.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

import numpy as np

from bitformat.formats import FORMAT_IDS, get_format
from bitformat.ternary import TernaryTensor

ROOT = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
SEED = 20240611
SCALE = 1.5
PADDED_COLS = {"stfma": 500, "colpack_u32": 500}


def base_matrix() -> np.ndarray:
    rng = np.random.default_rng(SEED)
    trits = rng.choice(np.array([-1, 0, 1], dtype=np.int8), size=(3, 512), p=[0.3, 0.4, 0.3])
    trits[0, 256:] = 0  # two all-zero TQ blocks: gguf writes d = 0 there
    trits[2, :256] = 0
    return trits


def build(fid: str) -> dict[str, bytes]:
    """The fixture files of one format, as bytes."""
    trits = base_matrix()[:, : PADDED_COLS.get(fid, 512)].copy()
    fmt = get_format(fid)
    t, loss = fmt.prepare(TernaryTensor(trits, np.float32([SCALE]), 0, "fixture"))
    assert loss == 0.0
    npy = io.BytesIO()
    np.save(npy, trits, allow_pickle=False)
    info = {"format": fid, "rows": t.rows, "cols": t.cols, "scale": SCALE,
            "scale_block": t.scale_block, "scales": t.scales.tolist()}
    return {"tensor.bin": fmt.encode(t).tobytes(), "trits.npy": npy.getvalue(),
            "scale.json": (json.dumps(info, indent=1) + "\n").encode()}


def float_values() -> np.ndarray:
    """The rans_float fixture's values (uint16 f16 patterns, 24 x 200)."""
    rng = np.random.default_rng(SEED)
    scale = np.where(np.arange(24) % 2, 1e-3, 0.05)[:, None]
    x = (rng.standard_normal((24, 200)) * scale).astype(np.float32).view(np.uint32)
    x = (x + 0x7FFF + ((x >> 16) & 1)) & np.uint32(0xFFFF0000)  # round to bfloat16
    v = x.view(np.float32).astype(np.float16).view(np.uint16)
    v[0, 3] |= 1  # not from bf16: exceptions
    v[2, 50] |= 2
    v[4, 7] |= 5
    v[6, 1], v[8, 2] = 0x0001, 0x8203  # subnormals (exponent 0 keeps its low bits)
    return v


def build_float() -> dict[str, bytes]:
    from bitformat.constants import GGMLType
    from bitformat.formats.rans_float import RansFloat

    v = float_values()
    npy = io.BytesIO()
    np.save(npy, v, allow_pickle=False)
    info = {"format": "rans_float", "dtype": "F16", "shape": list(v.shape)}
    return {"tensor.bin": RansFloat().encode(v, GGMLType.F16, v.shape).tobytes(),
            "values.npy": npy.getvalue(), "info.json": (json.dumps(info, indent=1) + "\n")
            .encode()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true", help="rewrite fixtures that differ")
    args = ap.parse_args(argv)
    status = 0
    for fid in (*FORMAT_IDS, "rans_float"):
        folder = ROOT / fid
        folder.mkdir(parents=True, exist_ok=True)
        for fname, data in (build_float() if fid == "rans_float" else build(fid)).items():
            path = folder / fname
            if path.exists() and path.read_bytes() == data:
                print(f"ok        {path.relative_to(ROOT.parent.parent)}")
                continue
            if path.exists() and not args.force:
                print(f"DIFFERS   {path.relative_to(ROOT.parent.parent)} (use --force)")
                status = 1
                continue
            path.write_bytes(data)
            print(f"written   {path.relative_to(ROOT.parent.parent)} ({len(data)} bytes)")
    return status


if __name__ == "__main__":
    sys.exit(main())
