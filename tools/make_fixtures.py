"""Write the golden fixtures under ``tests/fixtures/<format_id>/`` (deterministic).

Each folder gets ``tensor.bin`` (the encoded bytes of one small matrix), ``trits.npy`` (the
matrix) and ``scale.json`` (shape and scales). The matrix is 3 x 512 with two all-zero
256-value blocks and scale 1.5; stfma and colpack_u32 keep only its first 500 columns so
their row padding is frozen too.

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true", help="rewrite fixtures that differ")
    args = ap.parse_args(argv)
    status = 0
    for fid in FORMAT_IDS:
        folder = ROOT / fid
        folder.mkdir(parents=True, exist_ok=True)
        for fname, data in build(fid).items():
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
