"""``bitformat serve --backend wgpu``: requests run one after another (the GPU holds one
sequence), each with the tokens ``bitformat run --backend wgpu`` gives."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from test_serve import run_cli, start  # tests/ is on sys.path (rootdir conftest)

httpx = pytest.importorskip("httpx")


def test_wgpu_serves_one_request_at_a_time(adapter, tiny_gguf):
    proc, url = start(tiny_gguf, "--backend", "wgpu")
    try:
        def ask(i):
            body = {"prompt": f"Number {i}", "max_tokens": 6, "temperature": 0,
                    "return_token_ids": True}
            return httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()

        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(ask, range(3)))
        assert httpx.get(f"{url}/health").json()["max_batch"] == 1
        for i, r in enumerate(got):
            want = run_cli(tiny_gguf, "--backend", "wgpu", "-p", f"Number {i}", "-n", "6")
            stop = want["finish_reason"] == "stop"
            assert r["choices"][0]["token_ids"] == want["tokens"][: len(want["tokens"]) - stop]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert "one sequence at a time" in proc.startup
