"""``bitformat bench --backend wgpu`` on the tiny model (lavapipe in CI)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from test_bench import check_container  # tests/ is on sys.path (rootdir of this package)

from bitformat.bench import PROMPT_IDS
from bitformat.cli import main
from bitformat.runtime import load

TOKENS = 3


def test_bench_wgpu(tiny_gguf, adapter, tmp_path):
    png = tmp_path / "gpu.png"
    r = CliRunner().invoke(main, ["bench", str(tiny_gguf), "--backend", "wgpu", "--formats",
                                  "i2_s,rans", "--tokens", str(TOKENS), "--repeats", "1",
                                  "--json", "--plot", str(png), "--keep-dir",
                                  str(tmp_path / "kept")], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["backend"] == "wgpu" and res["timing"] in ("gpu-timestamps", "host")
    assert [(c["format"], c["decode"]) for c in res["containers"]] == [
        ("i2_s", ""), ("rans", "load"), ("rans", "fused")]
    for c in res["containers"]:
        check_container(c, res)
        kinds = c["detail"]["kinds"]
        kernel = "stfma" if c["decode"] == "load" else c["format"]  # decoded at load
        assert f"matvec:{kernel}" in kinds and "lm_head" in kinds
        # the classes are kernel times of one step; the wall time adds submit and readback
        assert sum(v["seconds"] for v in kinds.values()) * 1e3 == pytest.approx(c["kernel_ms"])
        assert c["detail"]["dispatches_per_token"] >= 16 and c["detail"]["host_us_per_token"] > 0
    # 6 a layer + 4 where mat-vecs quantize their own input (GPUs), else a norm before each
    # input's mat-vecs: 12 a layer + 4 (lavapipe's default)
    d = res["containers"][0]["detail"]
    assert d["dispatches_per_token"] == (16 if d["fused"] else 28)
    assert "rans:gather" in res["containers"][2]["detail"]["kinds"]
    assert "rans:gather" not in res["containers"][1]["detail"]["kinds"]
    assert res["containers"][1]["tokens"] == res["containers"][2]["tokens"]
    # the timed steps decode what the numpy reference decodes after the prompt and warm-up
    with load(tiny_gguf, backend="numpy") as m:
        want = m.generate(list(PROMPT_IDS), max_new_tokens=TOKENS + 2, stop_ids=[]).tokens
    assert res["containers"][0]["tokens"] == want[2:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_gpu_check_script_runs_on_any_adapter(tiny_gguf, adapter, tmp_path):
    """tools/bench_gpu.py, what tools/gpu_check.sh runs on a lent GPU (minutes a year, none to
    spend on a broken script), runs here on the tiny model: every configuration and container
    decodes, each with the default configuration's tokens, and the profiled step has kernels."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "after.json"
    p = subprocess.run([sys.executable, str(root / "tools" / "bench_gpu.py"), str(tiny_gguf),
                        "--label", "after", "--prefill", "32", "--tokens", "8", "--rounds", "1",
                        "--containers", "tq2_0", "--tuning", "fold=0", "--json", str(out)],
                       capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res["configs"]) == {"default", "fold=0"} and res["dispatches_per_token"] > 0
    want = res["configs"]["default"]["full"]["tokens"]
    assert len(want) == 8
    for name, cfg in res["configs"].items():
        assert cfg["full"]["tok_s"] > 0 and cfg["prefill"]["tok_s"] > 0, name
        assert cfg["full"]["tokens"] == want, name
        assert cfg["profile"]["kinds"], name
    assert res["containers"]["tq2_0"]["full"]["tokens"] == want
