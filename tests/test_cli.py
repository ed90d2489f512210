"""The command line, end to end through click's CliRunner."""

from __future__ import annotations

import json

import numpy as np
from click.testing import CliRunner

from bitformat import open_model
from bitformat.cli.main import default_output, main
from bitformat.summary import order0_entropy


def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return result


def test_synth_then_inspect_json(tmp_path):
    out = tmp_path / "m.gguf"
    r = run("synth", "--preset", "tiny", "--seed", 3, "-o", out)
    assert r.exit_code == 0, r.output
    assert "wrote" in r.output and out.exists()
    r = run("inspect", out, "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    assert info["architecture"] == "bitnet-b1.58" and info["container"] == "i2_s"
    with open_model(out) as m:
        names = [e.name for e in m.entries]
        t = m.ternary("blk.0.ffn_gate.weight")
    assert [t["name"] for t in info["tensors"]] == names
    row = next(t for t in info["tensors"] if t["name"] == "blk.0.ffn_gate.weight")
    counts = np.bincount(t.trits.reshape(-1) + 1, minlength=3)
    assert row["share_zero"] == counts[1] / counts.sum()
    assert row["entropy_bits"] == order0_entropy(counts)
    assert row["dead_rows"] == int((~t.trits.any(axis=1)).sum())
    assert row["bits_per_weight"] == (t.rows * t.cols / 4 + 32) * 8 / (t.rows * t.cols)
    tot = info["totals"]
    embed = next(t for t in info["tensors"] if t["name"] == "token_embd.weight")
    assert tot["bytes_per_token"] > tot["ternary_bytes"] + embed["bytes"]
    assert info["tokenizer"]["tokens"] == info["config"]["vocab_size"]


def test_inspect_text_table(tiny_gguf):
    r = run("inspect", tiny_gguf)
    assert r.exit_code == 0, r.output
    assert "blk.1.attn_v.weight" in r.output and "bytes per token" in r.output


def test_inspect_quotes_measured_cpu_speed(tiny_gguf, tmp_path, monkeypatch):
    """inspect says what the container costs to run, from the measured table, per CPU and
    kernel build, and warns where it is slow; the shipped table covers every container."""
    from bitformat.formats import FORMAT_IDS
    from bitformat.runtime import costs

    shipped = costs.measured()
    assert shipped, "bitformat/data/container_costs.json holds no measurement"
    for m in shipped:
        assert set(m["containers"]) == set(FORMAT_IDS), m["cpu"]
        assert m["containers"]["i2_s"]["decode"] == 1.0 and m["build"] in costs.BUILD_NAMES
    table = {"measured": [{"cpu": "Test CPU", "cpu_features": "AVX2", "build": "avx2",
                           "date": "2026-11-27", "source": "tools/bench_containers.py",
                           "i2_s_decode_tps": 12.5,
                           "containers": {"i2_s": {"decode": 1.0, "prefill": 1.0},
                                          "iq1_bn": {"decode": 0.2, "prefill": 0.1,
                                                     "held": "iq2_bn"}}}]}
    f = tmp_path / "costs.json"
    f.write_text(json.dumps(table))
    monkeypatch.setattr(costs, "COSTS_FILE", f)
    r = run("inspect", tiny_gguf)
    assert r.exit_code == 0, r.output
    assert ("1.00x i2_s's decode, 1.00x its prefill on Test CPU (AVX2 kernels (no AVX-512); "
            "i2_s 12.5 tok/s on 2B-4T)") in r.output
    slow = costs.describe("iq1_bn")[0]
    assert slow.endswith("(slow here: pick i2_s, tq2_0 or stfma)")
    assert "held as iq2_bn rows" in slow  # what the measured build held it as
    assert costs.describe("tq2_0") == []
    info = json.loads(run("inspect", tiny_gguf, "--json").output)
    assert info["run_costs"] == costs.describe("i2_s")


def test_convert_default_output_and_round_trip(tiny_gguf, tmp_path):
    src = tmp_path / "tiny.gguf"
    src.write_bytes(tiny_gguf.read_bytes())
    r = run("convert", src, "--to", "stfma")
    assert r.exit_code == 0, r.output
    mid = tmp_path / "tiny.stfma.gguf"
    assert mid.exists() and default_output(src, "stfma") == mid
    r = run("convert", mid, "--to", "i2_s", "-o", tmp_path / "back.gguf")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "back.gguf").read_bytes() == src.read_bytes()


def test_bad_file_gives_message_not_traceback(tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_bytes(b"hello world, not a model")
    result = CliRunner().invoke(main, ["inspect", str(bad)])
    assert result.exit_code == 1
    assert "error:" in result.output and "not a GGUF file" in result.output
    assert "Traceback" not in result.output
    result = CliRunner().invoke(main, ["convert", str(bad), "--to", "tq2_0"])
    assert result.exit_code == 1 and "not a GGUF file" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.gguf"]


def test_unknown_target_is_rejected(tiny_gguf):
    result = CliRunner().invoke(main, ["convert", str(tiny_gguf), "--to", "q4_0"])
    assert result.exit_code == 2 and "q4_0" in result.output


def test_run_streams_and_reports(tiny_gguf):
    r = run("run", tiny_gguf, "-p", "def f(x):", "-n", 6, "--backend", "numpy")
    assert r.exit_code == 0, r.output
    assert "tok/s" in r.output and "MB read per token" in r.output and "screened head" in r.output


def test_run_json_matches_python_api(tiny_gguf):
    import bitformat

    r = run("run", tiny_gguf, "--prompt-ids", "1,2,3", "-n", 5, "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)  # stderr holds the synthetic-model note
    with bitformat.load(tiny_gguf, backend="cpu") as m:
        want = m.generate([1, 2, 3], 5)
    assert out["tokens"] == want.tokens and out["text"] == want.text
    assert out["generated_tokens"] == len(want.tokens)
    # the screened head reads its int8 screen and a few rows instead of the f16 head
    head = m.args.vocab_size * m.args.dim * 2
    assert out["head"] == "screened" and not out["head_fallbacks"]
    assert m.weight_bytes_per_token - head < out["bytes_read_per_token"]
    assert out["bytes_read_per_token"] < m.weight_bytes_per_token
    assert 1 <= out["candidates_per_step_mean"] <= out["candidates_per_step_max"]
    assert 1 <= out["rescored_per_step_mean"] <= out["candidates_per_step_mean"]
    assert out["screen_bits"] in (8, 7, 6) and isinstance(out["screen_switches"], list)
    full = json.loads(run("run", tiny_gguf, "--prompt-ids", "1,2,3", "-n", 5, "--json",
                          "--head", "full").stdout)
    assert full["tokens"] == out["tokens"] and full["head"] == "full"
    assert full["bytes_read_per_token"] >= m.weight_bytes_per_token


def test_run_bad_requests(tiny_gguf):
    result = CliRunner().invoke(main, ["run", str(tiny_gguf), "--prompt-ids", "1,9999"])
    assert result.exit_code == 1 and "outside the vocabulary" in result.output
    result = CliRunner().invoke(main, ["run", str(tiny_gguf)])
    assert result.exit_code == 2 and "exactly one of --prompt" in result.output
    result = CliRunner().invoke(main, ["run", str(tiny_gguf), "--prompt-ids", "a,b"])
    assert result.exit_code == 2 and "token ids" in result.output
