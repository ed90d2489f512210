"""``bitformat serve`` as a client sees it: a real server process on the loopback, real HTTP
clients (httpx, and the official ``openai`` package where installed)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from click.testing import CliRunner

from bitformat.cli import main

httpx = pytest.importorskip("httpx")

KEY = "test-key-123"
ROOT = Path(__file__).resolve().parents[1]


def start(path, *args):
    """A server process on a free port: (process, base URL)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "bitformat.cli", "serve", str(path),
                             "--port", "0", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    deadline = time.time() + 120
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("serving "):
            proc.startup = "".join(lines)  # what it printed up to then
            proc.lines = []  # what it prints later (the access log), read as it comes

            def drain() -> None:
                for later in proc.stdout:
                    proc.lines.append(later)

            proc.drained = threading.Thread(target=drain, daemon=True)
            proc.drained.start()
            return proc, line.split(" at ")[1].strip()[: -len("/v1")]
    proc.kill()
    raise AssertionError("the server did not start:\n" + "".join(lines))


@pytest.fixture(scope="module")
def server_proc(tiny_gguf):
    proc, url = start(tiny_gguf, "--api-key", KEY, "--max-batch", "3")
    yield proc, url
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)


@pytest.fixture(scope="module")
def server(server_proc):
    return server_proc[1]


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60) as c:
        yield c


def sse(lines):
    """The ``data:`` payloads of an event stream, checking the framing."""
    out = []
    for line in lines:
        if line:
            assert line.startswith("data: "), line
            out.append(line[6:])
    assert out[-1] == "[DONE]"
    return [json.loads(d) for d in out[:-1]]


def run_cli(path, *args):
    """What ``bitformat run --json`` gives."""
    r = CliRunner().invoke(main, ["run", str(path), "--json", *args])
    assert r.exit_code == 0, r.output
    return json.loads(r.output.strip().splitlines()[-1])


def test_health_models_auth_and_routes(server, client):
    assert httpx.get(f"{server}/health").json()["status"] == "ok"  # no key needed
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(f"{server}/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny-i2_s"]
    assert client.get("/v1/models/tiny-i2_s").json()["id"] == "tiny-i2_s"
    for r, code in ((client.get("/v1/models/gpt-4"), "model_not_found"),
                    (client.post("/v1/chat/completions", json={
                        "model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}),
                     "model_not_found"),
                    (client.get("/v1/nothing"), "unknown_url"),
                    (client.post("/v2/completions", json={}), "unknown_url")):
        assert r.status_code == 404 and r.json()["error"]["code"] == code, r.text
    r = client.get("/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()
    r = httpx.options(f"{server}/v1/chat/completions", headers={  # a browser's preflight
        "Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] in ("*",
                                                                                 "http://ui.example")


BAD = [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b'"\xff"', "not valid JSON"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ({"messages": [{"role": "user", "content": 5}]}, "content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text parts"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "temperature": 9}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "hi", "seed": "x"}, "seed"),
    ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"prompt": "hi", "n": 2}, "'n'"),
    ({"prompt": "hi", "logprobs": 3}, "logprobs"),
    ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": ["a", "b"]}, "one prompt"),
    ({"prompt": None}, "prompt"),
    ({"prompt": list(range(300))}, "context"),
    ({"prompt": list(range(200)), "max_tokens": 100}, "which leaves 56: ask for at most 56"),
    ({"prompt": [1, 10**9]}, "vocabulary"),
    ({"prompt": "hi", "model": 3}, "model"),
]


@pytest.mark.parametrize("body,words", BAD)
def test_bad_requests_get_400(client, body, words):
    url = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body \
        else "/v1/completions"
    r = (client.post(url, content=body) if isinstance(body, bytes)
         else client.post(url, json=body))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"] == "invalid_request_error"
    assert client.get("/health").json()["status"] == "ok"


def test_access_log(server_proc, client):
    """One line per request on stderr once it has ended: client, method and path, status,
    tokens in and out for generations, milliseconds."""
    proc, _ = server_proc
    client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4,
                                         "ignore_eos": True})
    with client.stream("POST", "/v1/completions", json={"prompt": [4, 5], "max_tokens": 3,
                                                          "stream": True,
                                                          "ignore_eos": True}) as r:
        list(r.iter_lines())
    client.get("/v1/models/none")
    time.sleep(0.3)
    log = "".join(proc.lines)
    assert '"POST /v1/completions" 200 in=3 out=4 ' in log, log[-600:]
    assert '"POST /v1/completions" 200 in=2 out=3 ' in log, log[-600:]
    assert '"GET /v1/models/none" 404 ' in log and " ms\n" in log


def test_quiet_server_writes_no_access_log(tiny_gguf):
    proc, url = start(tiny_gguf, "--quiet")
    try:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 200
        time.sleep(0.3)
        assert not [ln for ln in proc.lines if "/v1/completions" in ln], proc.lines
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_streamed_chat_chunks(tiny_gguf, client):
    body = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 12,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = sse(r.iter_lines())
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    *middle, last, use = chunks[1:]
    assert all(c["choices"][0]["finish_reason"] is None and c["usage"] is None for c in middle)
    assert last["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                  "finish_reason": "length"}
    assert use["choices"] == [] and use["usage"]["completion_tokens"] == 12
    text = "".join(c["choices"][0]["delta"]["content"] for c in middle)
    want = run_cli(tiny_gguf, "--chat", "-p", "Hello there", "-n", "12")
    assert text == want["text"] and use["usage"]["prompt_tokens"] == want["prompt_tokens"]


def ask(client, i):
    """Request i of a mixed set (chat and text, streamed and not, sampling or greedy)."""
    chat, stream = i % 2 == 0, i % 3 == 0
    body = {"max_tokens": 10 + i, "temperature": 0.5 + 0.1 * i if i % 4 else 0, "seed": 7 * i,
            "top_k": 40, "return_token_ids": True, "stream": stream}
    prompt = f"Request number {i} says" + " hello" * (4 * i)  # 4.. are longer than a chunk
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    url = "/v1/chat/completions" if chat else "/v1/completions"
    if not stream:
        c = client.post(url, json=body).json()["choices"][0]
        return prompt, body, c.get("message", {}).get("content", c.get("text")), c["token_ids"]
    with client.stream("POST", url, json=body) as r:
        chunks = sse(r.iter_lines())
    text = "".join(c["choices"][0]["delta"].get("content", "") if chat
                   else c["choices"][0]["text"] for c in chunks)
    return prompt, body, text, [t for c in chunks for t in c["choices"][0].get("token_ids", [])]


def test_concurrent_requests_equal_run(tiny_gguf, client):
    with ThreadPoolExecutor(9) as pool:  # 8 requests, 3 slots: some wait, all share passes
        jobs = [pool.submit(ask, client, i) for i in range(8)]
        waits = []
        while not all(j.done() for j in jobs):  # /health answers meanwhile, and at once
            t0 = time.perf_counter()
            assert client.get("/health").json()["status"] == "ok"
            waits.append(time.perf_counter() - t0)
        got = [j.result() for j in jobs]
    assert waits and max(waits) < 2.0, max(waits)
    for i, (prompt, body, text, ids) in enumerate(got):
        want = run_cli(tiny_gguf, *(["--chat"] if "messages" in body else []), "-p", prompt,
                       "-n", str(body["max_tokens"]), "--temperature",
                       str(body["temperature"]), "--seed", str(body["seed"]), "--top-k", "40")
        stop_token = want["finish_reason"] == "stop"
        assert ids == want["tokens"][: len(want["tokens"]) - stop_token], f"request {i}"
        assert text == want["text"], f"request {i}"


def test_openai_client(tiny_gguf, server):
    openai = pytest.importorskip("openai")
    c = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY)
    r = c.completions.create(model="tiny-i2_s", prompt="Once upon", max_tokens=6,
                             temperature=0, stop=["\n"])
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens <= 6
    want = run_cli(tiny_gguf, "-p", "Once upon", "-n", "6")["text"]
    assert r.choices[0].text == want.split("\n")[0]
    stream = c.chat.completions.create(model="tiny-i2_s", stream=True, max_tokens=5,
                                       messages=[{"role": "user", "content": "Hi"}], seed=3)
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="nope").models.list()
    with pytest.raises(openai.BadRequestError, match="temperature"):
        c.chat.completions.create(model="tiny-i2_s", temperature=7,
                                  messages=[{"role": "user", "content": "Hi"}])


def test_disconnect_frees_the_slot(client):
    before = client.get("/health").json()["generated_tokens"]
    body = {"prompt": "Hi", "max_tokens": 250, "stream": True, "ignore_eos": True}
    for _ in range(3):
        with client.stream("POST", "/v1/completions", json=body) as r:
            next(r.iter_lines())  # the first chunk, then hang up
    deadline = time.time() + 30
    while (h := client.get("/health").json())["running"] and time.time() < deadline:
        time.sleep(0.01)
    assert h["running"] == 0 and h["generated_tokens"] - before < 250
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
    assert r.json()["usage"]["completion_tokens"] <= 3


def test_sigterm_ends_streams_and_frees_the_port(tiny_gguf):
    proc, url = start(tiny_gguf)
    port = int(url.rsplit(":", 1)[1])
    lines, done = [], threading.Event()

    def reader():
        body = {"prompt": "Hi", "max_tokens": 250, "stream": True, "ignore_eos": True}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    if len(lines) == 1:
                        proc.send_signal(signal.SIGTERM)
        except httpx.HTTPError:
            lines.append("<cut>")
        done.set()

    threading.Thread(target=reader, daemon=True).start()
    assert done.wait(60)
    proc.wait(timeout=30)
    proc.drained.join(10)
    out = "".join(proc.lines)
    assert proc.returncode == 0 and "stopped" in out, out
    data = [x for x in lines if x.startswith("data: ")]
    assert data[-1] == "data: [DONE]" or "shutting down" in data[-1], lines[-3:]
    with socket.socket() as s:  # the port is free again
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_cli_refuses_bad_options(tiny_gguf):
    r = CliRunner().invoke(main, ["serve", str(tiny_gguf), "--max-batch", "0"])
    assert r.exit_code == 2 and "--max-batch" in r.output
    r = CliRunner().invoke(main, ["serve", str(tiny_gguf), "--port", "70000"])
    assert r.exit_code == 2 and "--port" in r.output


def test_cache_memory_pool_refuses_what_cannot_fit(tiny_gguf):
    """``--cache-memory 100KiB`` holds 100 positions of the tiny model's f16 cache (1 KiB
    each): the server says so, a request that could never fit gets a 400 naming the sizes,
    one that fits runs and gives its positions back."""
    proc, url = start(tiny_gguf, "--cache-memory", "100KiB", "--quiet")
    try:
        assert "KV cache f16: 100 positions" in proc.startup, proc.startup
        with httpx.Client(base_url=url, timeout=60) as c:
            r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 200})
            assert r.status_code == 400, r.text
            assert "positions of KV cache" in r.json()["error"]["message"]
            assert "holds 100" in r.json()["error"]["message"]
            r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 20})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 20
            h = c.get("/health").json()
            assert h["cache_positions"] == 100 and h["cache_positions_held"] == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    r = CliRunner().invoke(main, ["serve", str(tiny_gguf), "--cache-memory", "lots"])
    assert r.exit_code != 0 and "is not a size" in r.output


def test_kv_cache_type_reaches_the_pool(tiny_gguf):
    """``--kv-cache q8_0``: 544 bytes a position on the tiny model (2 layers x K and V x 2 kv
    heads x 68 bytes: 64 codes and two half scales), so 100 KiB hold 188 positions."""
    proc, url = start(tiny_gguf, "--kv-cache", "q8_0", "--cache-memory", "100KiB", "--quiet")
    try:
        assert "KV cache q8_0: 188 positions" in proc.startup, proc.startup
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 5},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 5
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
