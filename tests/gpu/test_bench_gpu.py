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
