"""The batching engine (runtime/engine.py) and the text stream (runtime/textstream.py): every
request gets the tokens ``generate_step`` gives it alone, whatever shares its passes."""

from __future__ import annotations

import threading
import time

import pytest

from bitformat.errors import RequestError, UnavailableError
from bitformat.runtime.engine import Engine, Request
from bitformat.runtime.generate import PREFILL_CHUNK, generate_step, stream_generate
from bitformat.runtime.sampling import SamplingParams
from bitformat.runtime.textstream import TextStream

# prompts longer than a chunk (two and three chunks), one of exactly a chunk, short ones
PROMPTS = [list(range(1, 2 * PREFILL_CHUNK + 9)), [9, 8], list(range(300, 300 + PREFILL_CHUNK)),
           [5] * (PREFILL_CHUNK + 1), [100, 200, 300, 17, 4], list(range(7, 7 + 150))]
PARAMS = [SamplingParams(), SamplingParams(temperature=0.8, top_k=20, seed=4),
          SamplingParams(temperature=1.2, min_p=0.05, repetition_penalty=1.3, seed=9),
          SamplingParams(temperature=0.7, top_p=0.9, seed=2**63 + 5),
          SamplingParams(repetition_penalty=1.5), SamplingParams(temperature=1.0, seed=1)]
LIMITS = [12, 20, 7, 16, 25, 9]


class Collector:
    """Events of one request, with a flag set at its last."""

    def __init__(self):
        self.events, self.done = [], threading.Event()

    def __call__(self, ev):
        self.events.append(ev)
        if ev.finish_reason:
            self.done.set()

    @property
    def tokens(self):
        return [e.token for e in self.events if e.token is not None]

    @property
    def text(self):
        return "".join(e.text for e in self.events)


def run_engine(net, tok, requests, *, max_batch, stagger=0.0, max_queue=64):
    eng = Engine(net, tok, max_batch=max_batch, max_queue=max_queue).start(warmup=False)
    try:
        outs = []
        for r in requests:
            outs.append(Collector())
            eng.submit(r, outs[-1])
            time.sleep(stagger)
        for c in outs:
            assert c.done.wait(120), "a request never finished"
        return outs, eng
    finally:
        eng.close(10)


@pytest.mark.parametrize("backend,fid", [("cpu", "i2_s"), ("cpu", "tq2_0"), ("cpu", "tq1_0"),
                                         ("cpu", "rans"), ("numpy", "i2_s")])
def test_batched_requests_get_the_tokens_they_get_alone(tiny_containers, cpu_models, backend,
                                                        fid):
    if backend == "cpu":
        net = cpu_models[fid].net
    else:
        from bitformat.runtime import load

        net = load(tiny_containers[fid], backend="numpy").net
    want = [list(generate_step(net, p, max_new_tokens=n, sampling=s))
            for p, s, n in zip(PROMPTS, PARAMS, LIMITS, strict=True)]
    reqs = [Request(p, n, s, stop_ids=[]) for p, s, n in zip(PROMPTS, PARAMS, LIMITS,
                                                               strict=True)]
    # all at once (prompts prefilled side by side, chunks beside decode rows), then with
    # fewer slots than requests (later ones join as earlier ones leave)
    for max_batch, stagger in ((8, 0.0), (3, 0.01)):
        outs, eng = run_engine(net, None, reqs, max_batch=max_batch, stagger=stagger)
        assert [c.tokens for c in outs] == want
        assert [c.events[-1].finish_reason for c in outs] == ["length"] * len(reqs)
        assert [c.events[-1].completion_tokens for c in outs] == LIMITS
        assert eng.steps < sum(LIMITS) + 12  # passes were shared


def test_text_and_stops_match_stream_generate(cpu_models):
    m = cpu_models["i2_s"]
    prompt = m.tokenizer.encode("def main():")
    ref = "".join(r.text for r in stream_generate(m.net, m.tokenizer, prompt, max_new_tokens=30,
                                                  stop_ids=[]))
    stop = ref[10:13]
    assert stop and stop not in ref[:12]
    cut = "".join(r.text for r in stream_generate(m.net, m.tokenizer, prompt,
                                                  max_new_tokens=30, stop_ids=[], stop=[stop]))
    assert cut == ref[: ref.index(stop)]
    outs, _ = run_engine(m.net, m.tokenizer, [Request(prompt, 30, stop=[stop], stop_ids=[]),
                                              Request(prompt, 30, stop_ids=[])], max_batch=4)
    assert outs[0].text == cut and outs[0].events[-1].finish_reason == "stop"
    assert outs[1].text == ref and outs[1].events[-1].finish_reason == "length"


class Slow:
    """A network whose steps take at least 20 ms, so that requests stay in flight."""

    def __init__(self, net):
        self.net, self.args = net, net.args

    def new_cache(self, n):
        return self.net.new_cache(n)

    def decode(self, segments, samplers):
        time.sleep(0.02)
        return self.net.decode(segments, samplers)


def wait_for(cond, seconds=30):
    deadline = time.time() + seconds
    while not cond() and time.time() < deadline:
        time.sleep(0.005)
    return cond()


def test_queue_cancel_and_close(cpu_models):
    eng = Engine(Slow(cpu_models["i2_s"].net), None, max_batch=1, max_queue=1).start(
        warmup=False)
    try:
        long = [Collector() for _ in range(2)]
        h0 = eng.submit(Request([1, 2, 3], 10_000), long[0])
        eng.submit(Request([4, 5], 10_000), long[1])
        with pytest.raises(UnavailableError, match="busy"):
            eng.submit(Request([6], 5), Collector())
        assert wait_for(lambda: (eng.load["running"], eng.load["waiting"]) == (1, 1))
        assert wait_for(lambda: long[0].events) and not long[1].events
        h0.cancel()  # frees the slot: the waiting request runs
        assert wait_for(lambda: long[1].events)
        assert (eng.load["running"], eng.load["waiting"]) == (1, 0)
        assert not long[0].done.is_set()  # a cancelled request hears nothing more
        with pytest.raises(RequestError, match="context"):
            eng.submit(Request(list(range(256)), 5), Collector())
        with pytest.raises(RequestError, match="more than the model's context length of 256"):
            Engine(eng.net, None, context=257)
        with pytest.raises(RequestError, match="vocabulary"):
            eng.submit(Request([10**6], 5), Collector())
    finally:
        eng.close(30)
    last = long[1].events[-1]
    assert last.finish_reason == "error" and isinstance(last.error, UnavailableError)
    with pytest.raises(UnavailableError, match="shutting down"):
        eng.submit(Request([1], 1), Collector())


def test_cache_pool_admits_what_fits_and_frees_it(cpu_models):
    """With a pool of 100 positions, two requests of 40 run together and a third waits until
    one ends; a request of 101 is refused at once; a full pool with no queue left is a 503;
    ending or cancelling a request gives its positions back, and each request's tokens are
    those it gets alone."""
    net = cpu_models["i2_s"].net
    eng = Engine(Slow(net), None, max_batch=4, max_queue=1, cache_positions=100).start(
        warmup=False)
    try:
        with pytest.raises(RequestError, match="needs 101 positions of KV cache.*holds 100"):
            eng.submit(Request([1] * 51, 50), Collector())
        outs = [Collector() for _ in range(3)]
        hs = [eng.submit(Request([3 + i] * 10, 30, stop_ids=[]), outs[i]) for i in range(2)]
        assert wait_for(lambda: eng.load["running"] == 2)
        assert eng.load["cache_positions_held"] == 80
        eng.submit(Request([9] * 10, 30, stop_ids=[]), outs[2])  # 40 more do not fit: waits
        with pytest.raises(UnavailableError, match="KV cache is full: 80 of its 100"):
            eng.submit(Request([8] * 5, 5), Collector())  # and the queue (1) is taken
        assert wait_for(lambda: outs[0].events)
        assert eng.load["running"] == 2 and eng.load["waiting"] == 1 and not outs[2].events
        hs[1].cancel()  # its client left: its 40 positions go to the waiting request
        assert wait_for(lambda: outs[2].events)
        assert eng.load["cache_positions_held"] == 80
        for c in (outs[0], outs[2]):
            assert c.done.wait(60)
        assert wait_for(lambda: eng.load["cache_positions_held"] == 0)
    finally:
        eng.close(30)
    for i in (0, 2):
        prompt = [3 + i if i == 0 else 9] * 10
        assert outs[i].tokens == list(generate_step(net, prompt, max_new_tokens=30))


class Chars:
    """A toy tokenizer: token i is the character i; 0xC3 0xA9 are the bytes of 'é'."""

    def decode(self, ids, skip_special=True):
        return bytes(ids).decode("utf-8", errors="replace")


def feed(ts, ids):
    return [ts.add(t) for t in ids]


def test_text_stream_holds_back_stop_prefixes_and_partial_characters():
    ts = TextStream(Chars(), stop=["END", "xy"])
    out = feed(ts, b"caf\xc3\xa9 EN")
    assert [t for t, _ in out] == ["c", "a", "f", "", "\u00e9", " ", "", ""]
    assert ts.add(ord("d")) == ("END"[:2] + "d", None)  # not the stop after all
    assert ts.add(ord("E")) == ("", None)
    assert feed(ts, b"ND") == [("", None), ("", "stop")]
    assert ts.text == "caf\u00e9 ENd"
    ts = TextStream(Chars(), stop_ids=[0], stop=["xyz"])
    assert feed(ts, b"axy") == [("a", None), ("", None), ("", None)]
    assert ts.add(0) == ("xy", "stop")  # a stop token flushes what was held back
    ts = TextStream(Chars(), stop=["zz"])
    feed(ts, b"a\xc3")
    assert ts.finish() == "\ufffd"  # an unfinished character at the end is shown as U+FFFD
    assert TextStream(Chars(), stop=["b"]).add(ord("a")) == ("a", None)


class Failing(Slow):
    """Raises on the first step (a bug or a lost device), then works."""

    failed = False

    def decode(self, segments, samplers):
        if not self.failed:
            self.failed = True
            raise RuntimeError("boom")
        return self.net.decode(segments, samplers)


def test_a_failed_step_ends_its_requests_not_the_engine(cpu_models):
    eng = Engine(Failing(cpu_models["i2_s"].net), None).start(warmup=False)
    try:
        first, second = Collector(), Collector()
        eng.submit(Request([1, 2], 3), first)
        assert first.done.wait(30)
        assert first.events[-1].finish_reason == "error" and "boom" in str(first.events[-1].error)
        eng.submit(Request([1, 2], 3), second)
        assert second.done.wait(30) and second.events[-1].finish_reason == "length"
        assert len(second.tokens) == 3
    finally:
        eng.close(30)


def test_a_burst_of_prompts_runs_in_one_step(cpu_models):
    """Requests that all arrive in their prompts (nobody waits for a token) run every prompt
    in one pass, beyond one chunk of prompt tokens a step; each still gets its own tokens."""
    net = cpu_models["i2_s"].net
    prompts = [list(range(10 + i, 10 + i + PREFILL_CHUNK - 20)) for i in range(3)]
    want = [list(generate_step(net, p, max_new_tokens=2)) for p in prompts]
    eng = Engine(net, None, max_batch=8).start(warmup=False)
    try:
        outs = [Collector() for _ in prompts]
        with eng._cv:  # (re-entrant) all three queued before the engine looks: no gather race
            for p, c in zip(prompts, outs, strict=True):
                eng.submit(Request(p, 2, stop_ids=[]), c)
        for c in outs:
            assert c.done.wait(120), "a request never finished"
    finally:
        eng.close(10)
    assert [c.tokens for c in outs] == want
    # 3 x 44 prompt tokens in the first step (more than PREFILL_CHUNK), then one step of
    # their second tokens
    assert eng.steps == 2
