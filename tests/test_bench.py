"""``bitformat bench`` on the cpu backend: bytes per token recounted here from the containers'
tensors and the model shape, times and rates consistent with each other, the plot a real PNG."""

from __future__ import annotations

import json
import tempfile

import pytest
from click.testing import CliRunner

from bitformat import open_model
from bitformat.bench import PROMPT_IDS, parse_formats
from bitformat.cli import main
from bitformat.errors import RequestError
from bitformat.formats import FORMAT_IDS

TOKENS = 4


def bench(*args) -> dict:
    r = CliRunner().invoke(main, ["bench", *map(str, args)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r


def expected_bytes(path, prompt: int, warmup: int, tokens: int, decode: str = "",
                   kv_cache: str = "f16") -> dict[str, int]:
    """Per class, from the container's tensor list and its shape metadata alone: rans decoded
    at load reads stfma rows (16 trits a u32), a coded head is read as the f16 it decodes to."""
    with open_model(path) as m:
        arch = m.get("general.architecture")
        layers, dim = m.get(f"{arch}.block_count"), m.get(f"{arch}.embedding_length")
        heads = m.get(f"{arch}.attention.head_count")
        kv_heads = m.get(f"{arch}.attention.head_count_kv", heads)
        emb = m.entry("token_embd.weight")
        ternary = [e for e in m.entries if e.ternary]
        out = {"ternary": sum(e.shape[0] * -(-e.shape[1] // 16) * 4 if decode == "load"
                              else e.nbytes for e in ternary),
               "lm_head": 2 * emb.shape[0] * emb.shape[1],  # f16 in every tiny container
               "other": sum(e.nbytes for e in m.entries
                            if not e.ternary and e.name != "token_embd.weight")}
        if m.container == "rans":
            assert emb.coding == "rans_float" and emb.nbytes < out["lm_head"]
        else:
            assert sum(out.values()) == sum(e.nbytes for e in m.entries)
    d = dim // heads
    row = {"f32": 4 * d, "f16": 2 * d, "q8_0": d + 2 * -(-d // 32)}[kv_cache]  # q8_0: 34 / 32
    per_pos = layers * 2 * kv_heads * row  # K and V of every layer
    # timed step i runs position prompt + warmup + i and reads that many positions + 1
    lengths = [prompt + warmup + i + 1 for i in range(tokens)]
    kv = sum(per_pos * n for n in lengths)
    assert kv % tokens == 0
    out["attention"] = kv // tokens
    return out


def check_container(c: dict, r: dict) -> None:
    held = "f32" if r["backend"] == "wgpu" else r["kv_cache"]  # wgpu: f16 values, f32 slots
    want = expected_bytes(c["path"], r["prompt_tokens"], r["warmup_tokens"], r["tokens"],
                          c["decode"], held)
    assert {k: v["bytes"] for k, v in c["classes"].items()} == want, c["format"]
    assert c["bytes_per_token"] == sum(want.values())
    assert c["ms_per_token"] > 0 and c["kernel_ms"] > 0
    assert c["tokens_per_s"] == pytest.approx(1e3 / c["ms_per_token"], rel=1e-9)
    assert c["gbps"] == pytest.approx(c["bytes_per_token"] / c["ms_per_token"] / 1e6, rel=1e-9)
    for k, v in c["classes"].items():
        assert v["ms"] > 0, (c["format"], k)
        assert v["gbps"] == pytest.approx(v["bytes"] / v["ms"] / 1e6, rel=1e-9)
    assert len(c["tokens"]) == r["tokens"]
    sc = c["screened"]  # the same steps with the screened head: the same tokens, fewer bytes
    assert sc["same_tokens"] and not sc["fallbacks"] and sc["candidates_mean"] >= 1
    assert sc["head_bytes"] < sc["full_head_bytes"] == want["lm_head"]
    assert sc["bytes_per_token"] == c["bytes_per_token"] - want["lm_head"] + sc["head_bytes"]


def test_cpu_json_bytes_times_and_plot(tiny_gguf, tmp_path):
    png, keep = tmp_path / "bench.png", tmp_path / "kept"
    r = bench(tiny_gguf, "--formats", "rans,i2_s,tq1_0", "--tokens", TOKENS, "--json",
              "--plot", png, "--keep-dir", keep)
    res = json.loads(r.stdout)
    assert res["backend"] == "cpu" and res["timing"] == "host"
    assert (res["tokens"], res["warmup_tokens"]) == (TOKENS, 1)
    assert res["prompt_tokens"] == len(PROMPT_IDS)
    assert [(c["format"], c["decode"]) for c in res["containers"]] == [
        ("i2_s", ""), ("tq1_0", ""), ("rans", "load"), ("rans", "fused")]
    for c in res["containers"]:
        assert c["screened"] is not None, c["format"]
        check_container(c, res)
        assert c["load_s"] > 0
        # the class times are the step's wall time cut into parts
        # the classes come from the same steps run layer by layer (the fast path is one
        # compiled call a token): they add up to that run's step, not to ms_per_token
        assert c["kernel_ms"] == pytest.approx(sum(v["ms"] for v in c["classes"].values()))
        with open_model(c["path"]) as m:
            assert m.container == c["format"]
        assert c["file_bytes"] == (tiny_gguf if c["format"] == "i2_s" else keep /
                                   f"{tiny_gguf.stem}.{c['format']}.gguf").stat().st_size
    assert res["containers"][0]["path"] == str(tiny_gguf)  # the source is used as it is
    rans = res["containers"][2:]
    assert rans[0]["tokens"] == rans[1]["tokens"] == res["containers"][0]["tokens"]
    assert res["tokens_agree"] and len(res["token_groups"]) == 1
    assert rans[0]["classes"]["ternary"]["bytes"] > rans[1]["classes"]["ternary"]["bytes"]
    blob = png.read_bytes()
    assert blob[:8] == b"\x89PNG\r\n\x1a\n" and blob[12:16] == b"IHDR"
    assert len(blob) > 20_000  # two panels of marks and text, not an empty canvas
    import matplotlib.image

    assert matplotlib.image.imread(png).shape[:2] == (605, 1430)


def test_cpu_text_and_temporary_files(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    r = bench(tiny_gguf, "--formats", "tq2_0,stfma", "--tokens", 2)
    for word in ("tq2_0", "stfma", "ternary mat-vecs", "LM head", "attention", "tok/s",
                 "screened LM head", "rows rescored/step"):
        assert word in r.stdout
    assert "i2_s " not in r.stdout
    assert "all 2 runs decoded the same 2 tokens" in r.stdout
    assert list(tmp_path.iterdir()) == []  # converted containers are deleted


def _result(backend: str, tokens: dict[str, list[int]]):
    from bitformat.bench import CLASSES, BenchResult, ContainerBench

    r = BenchResult("m.gguf", backend, "", "host", 3, 1, 2, 64)
    classes = {k: {"bytes": 0, "ms": 1.0, "gbps": 0.0} for k in CLASSES}
    for fid, toks in tokens.items():
        r.containers.append(ContainerBench(fid, "", 0, classes, 0, 1.0, 1.0, 0.0, 0.0, 0.0,
                                           0.0, toks))
    return r


def test_containers_that_disagree_fail_loudly(tiny_gguf, monkeypatch):
    """Lossless containers decode the same tokens: where they do not, bench says which, and
    the command fails; on wgpu TQ1_0/TQ2_0 may differ (float32 block scales) and are named."""
    from bitformat import bench as B

    agree = _result("cpu", {"i2_s": [1, 2], "tq2_0": [1, 2]})
    assert agree.disagreement() is None
    bad = _result("cpu", {"i2_s": [1, 2], "stfma": [1, 2], "tq1_0": [1, 3]})
    why = bad.disagreement()
    assert "i2_s, stfma: [1, 2]" in why and "tq1_0: [1, 3]" in why
    assert f"ERROR: {why}" in B.render(bad)
    gpu = _result("wgpu", {"i2_s": [1, 2], "stfma": [1, 2], "tq2_0": [1, 3]})
    assert gpu.disagreement() is None and "differ, as they may on wgpu" in B.render(gpu)
    assert _result("wgpu", {"i2_s": [1, 2], "stfma": [1, 3]}).disagreement() is not None
    monkeypatch.setattr(B, "run_bench", lambda *a, **k: bad)
    r = CliRunner().invoke(main, ["bench", str(tiny_gguf), "--tokens", "2"])
    assert r.exit_code == 1 and "decoded different tokens" in r.output
    assert "please report" in r.output


def test_bad_requests(tiny_gguf):
    r = CliRunner().invoke(main, ["bench", str(tiny_gguf), "--formats", "i2_s,q4_0"])
    assert r.exit_code == 1 and "unknown container 'q4_0'" in r.output
    r = CliRunner().invoke(main, ["bench", str(tiny_gguf), "--tokens", "0"])
    assert r.exit_code == 2
    r = CliRunner().invoke(main, ["bench", str(tiny_gguf), "--backend", "tpu"])
    assert r.exit_code == 2


def test_parse_formats():
    assert parse_formats("all") == list(FORMAT_IDS)
    assert parse_formats(" rans, i2_s ") == ["i2_s", "rans"]
    for bad in ("", "all,rans", "hf"):
        with pytest.raises(RequestError):
            parse_formats(bad)


@pytest.mark.slow
def test_first_bench_keeps_compilation_out_of_its_figures(tiny_gguf, tmp_path):
    """With an empty kernel cache every kernel compiles during the bench, and none inside a
    timed loop: compilation is reported on its own."""
    import os
    import subprocess
    import sys

    cache = tmp_path / "numba"
    cache.mkdir()
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    p = subprocess.run([sys.executable, "-c", "from bitformat.cli import main; main()", "bench",
                        str(tiny_gguf), "--formats", "i2_s", "--tokens", "2", "--json"],
                       capture_output=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr.decode()[-800:]
    c = json.loads(p.stdout)["containers"][0]
    assert c["compile_count"] > 10 and c["compile_s"] > 0
    assert c["compiled_while_timed"] == 0
