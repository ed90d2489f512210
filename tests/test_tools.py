"""The benchmark tools' model-facing parts run against the package as it is now (a renamed
attribute must fail here, not in the next benchmark run): tools/bench_decode.py's worker and
tools/bench_revisions.py's report on the tiny model."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))


def test_the_decode_worker_measures_the_tiny_model(tiny_gguf):
    import bench_decode as bd

    runner = bd.BitformatRunner(str(tiny_gguf), 1)
    try:
        r = runner.run([1, 2, 3], 3)
        assert len(r["tokens"]) == 4 and r["decode_tps"] > 0
        # every byte a token streams: the matrices, their scales, the norms, the head
        assert runner.streamed > r["weight_bytes"] // 2
        prof = runner.profile([1, 2, 3], 2)
        assert prof
    finally:
        runner.m.close()


def test_revisions_compares_two_trees(tiny_gguf, tmp_path):
    """The same tree on both sides: the same tokens, a report with both rows."""
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_revisions.py"), "--before",
                        str(ROOT), "--model", str(tiny_gguf), "--repeat", "2", "--tokens", "2",
                        "--prompt", "4", "--threads", "1", "--max-others", "1.0"],
                       capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:] + p.stdout[-2000:]
    assert "| before |" in p.stdout and "| after |" in p.stdout
    assert "Greedy tokens of every run the same: yes" in p.stdout


def test_base3_and_cpu_rate_probes_run_against_the_package():
    """tools/bench_base3.py's matrices have each layout's shape and its kernels run on them;
    tools/probe_cpu_rate.py's probes time this build's kernels."""
    import bench_base3
    import probe_cpu_rate

    from bitformat.runtime.cpu import kernels as K

    vector, scalar = probe_cpu_rate.probes()
    assert vector(3) > 0 and scalar(1000) > 0
    if K.kernel_mode() != "vnni" or "avx512vbmi" not in K.host_features():
        pytest.skip("bench_base3 compares the vnni build's kernels and lut3 (VBMI)")
    rng = np.random.default_rng(3)
    mats = bench_base3.matrices(6, 512, 2, rng)
    assert [m.shape for m in mats["i2_s"]] == [(6, 128)] * 2
    assert [m.shape for m in mats["tq1_0"]] == [(6, 108)] * 2
    assert [m.shape for m in mats["lut3"]] == [(1, 22 * 320 + 256)] * 2
    for tokens in (1, 5):  # a decode step's mat-vec, a prompt's mat-mul
        fs = bench_base3.kernels(6, 512, rng, tokens)
        for name, f in fs.items():
            assert bench_base3.timed(f, mats[name], hot=True, passes=1) > 0
    assert bench_base3.section(16) == ("Base-3 digits against 2-bit codes, a prompt of 16 "
                                       "tokens (one mat-mul, cpu)")


def test_bench_attention_times_the_kernels_a_model_runs():
    """tools/bench_attention.py's worker runs this tree's split attention on its caches: the
    prompt chunk's last token gets the bits one-token attention gives it there, and both
    measurements time something."""
    import bench_attention as ba

    from bitformat.runtime.cpu import ops

    k = ba.Kernels(ba.CHUNK + 70, "f16")  # (runs both once)
    assert k.measure("decode", 1) > 0 and k.measure("prompt", 1) > 0
    last, pos = ba.LAYERS - 1, k.n - 1
    want = np.empty(ba.HEADS * ba.HEAD_DIM, np.float32)
    ops.attend_one(k.q[-1], k.k[-1], k.k[-1], k.cos[-1], k.sin[-1],
                   ops.kernel_cache(k.kc[last]), ops.kernel_cache(k.vc[last]), pos, want)
    np.testing.assert_array_equal(k.out[-1], want)


def test_bench_batched_step_parts_add_up_on_the_tiny_model(tiny_gguf, tmp_path):
    """tools/bench_batched_step.py runs the tiny model's passes and kernels; its floor is the
    multiply-adds over the best kernel rate, below what the step measured."""
    out = tmp_path / "bs.json"
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_batched_step.py"),
                        str(tiny_gguf), "--clients", "3", "--rounds", "2", "--steps", "2",
                        "--max-others", "2.0", "--json", str(out)],
                       capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:] + p.stdout[-2000:]
    import json

    rec = json.loads(out.read_text())
    assert rec["kept"] == 2 and len(rec["estimate"]) == 2
    r = rec["rounds"][0]
    assert r["many"]["rows"] > r["one"]["rows"] > 0
    assert all(v["macs"] > 0 and v["s"] > 0 for v in r["kernels"].values())
    assert set(r["kernels"]) == {"q|k|v", "o", "gate|up", "down"}
    step = r["many"]["step_layers"] + r["many"]["step_head"]
    assert 0 < rec["rate_macs_per_s"] and step > 0
    assert "| step of 3 tokens |" in p.stdout


def test_bench_containers_ratios_to_the_i2_s_runs_either_side():
    """A container's anchored ratio is the median over rounds of its run over the mean of
    the i2_s runs just before and after it; i2_s's own is 1."""
    import bench_containers as bc

    runs = [{"decode_tps": 30.0, "anchor_decode_tps": 40.0},  # 0.75
            {"decode_tps": 44.0, "anchor_decode_tps": 40.0},  # 1.10
            {"decode_tps": 36.0, "anchor_decode_tps": 40.0}]  # 0.90
    assert bc.anchored_ratio({"anchored": runs}, "decode_tps") == pytest.approx(0.90)
    assert bc.anchored_ratio({"anchored": []}, "decode_tps") == 1.0


def test_bench_lut3_rounds_anchor_every_run_and_split_the_states(tiny_gguf, tiny_containers):
    """tools/bench_lut3.py runs each holding between two i2_s runs with i2_s's tokens, leaves
    out rounds whose i2_s runs disagree, and splits the rest at the middle of i2_s's speeds."""
    import bench_lut3 as bl

    models = bl.load_all({"i2_s": tiny_gguf, "tq1_0": tiny_containers["tq1_0"]}, 2)
    try:
        assert "tq1_0 stfma" in models
        runs = bl.run_rounds(models, 2, 3, 10.0, [5, 17, 300], progress=lambda s: None)
    finally:
        for m in models.values():
            m.close()
    names = [n for n in models if n != "i2_s"]
    assert [e["name"] for e in runs] == names * 2
    assert all(e["same"] and e["tps"] > 0 and e["before"] > 0 and e["after"] > 0 for e in runs)
    for a, b in itertools.pairwise(runs):
        if a["round"] == b["round"]:
            assert b["before"] == a["after"]  # the i2_s run between two holdings serves both

    def run(name, tps, before, after):
        return {"name": name, "tps": tps, "before": before, "after": after, "same": True}

    made = [run("x", 33, 30, 30), run("x", 36, 31, 33), run("x", 42, 45, 47),
            run("x", 99, 30, 45)]  # the last: the speed changed inside the round
    summary, split = bl.summarize(made, 0.15)
    assert 32 < split < 45
    s = summary["x"]
    assert (s["runs"], s["kept"], s["slow_n"], s["fast_n"]) == (4, 3, 2, 1)
    assert s["fast"] == pytest.approx(42 / 46) and s["slow"] == pytest.approx((1.1 + 36 / 32) / 2)

