"""Several sequences in one forward pass (runtime/models/base.py ``Segment``/``Rows``): each
sequence's tokens are exactly those it gets alone, whatever else shares the pass."""

from __future__ import annotations

import numpy as np
import pytest

from bitformat.errors import RequestError
from bitformat.runtime.models import Segment
from bitformat.runtime.sampling import Sampler, SamplingParams

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [100, 200, 300, 17, 4]]
PARAMS = [SamplingParams(), SamplingParams(temperature=0.8, top_k=20, seed=4),
          SamplingParams(temperature=1.2, min_p=0.05, repetition_penalty=1.3, seed=9)]
STEPS = 10


def alone(net, prompt, params):
    cache = net.new_cache(len(prompt) + STEPS)
    s = Sampler(params, history=list(prompt))
    out = net.decode([Segment(prompt, cache)], [s])
    for _ in range(STEPS - 1):
        s.accept(out[-1])
        out += net.decode([Segment([out[-1]], cache)], [s])
    return out


def batched(net, stagger: int):
    """Sequence j joins at step j * stagger (its prompt prefilled in the same pass as the
    others' decode rows), then all decode together."""
    caches = [net.new_cache(len(p) + STEPS) for p in PROMPTS]
    samplers = [Sampler(p, history=list(q)) for p, q in zip(PARAMS, PROMPTS, strict=True)]
    outs: list[list[int]] = [[] for _ in PROMPTS]
    step = 0
    while any(len(o) < STEPS for o in outs):
        live = [j for j in range(len(PROMPTS)) if j * stagger <= step and len(outs[j]) < STEPS]
        segs = [Segment(outs[j][-1:] if outs[j] else PROMPTS[j], caches[j]) for j in live]
        for j in live:
            if outs[j]:
                samplers[j].accept(outs[j][-1])
        for j, t in zip(live, net.decode(segs, [samplers[j] for j in live]), strict=True):
            outs[j].append(t)
        step += 1
    return outs


@pytest.mark.parametrize("backend", ["cpu", "numpy"])
@pytest.mark.parametrize("fid", ["i2_s", "tq2_0", "tq1_0", "rans"])
@pytest.mark.parametrize("stagger", [0, 2])
def test_batched_decode_equals_alone(tiny_containers, cpu_models, backend, fid, stagger):
    if backend == "cpu":
        net = cpu_models[fid].net
    else:
        from bitformat.runtime import load

        net = load(tiny_containers[fid], backend="numpy").net
    want = [alone(net, p, s) for p, s in zip(PROMPTS, PARAMS, strict=True)]
    assert batched(net, stagger) == want


def test_batched_hidden_rows_are_bitwise_those_alone(cpu_models):
    net = cpu_models["i2_s"].net
    caches = [net.new_cache(16) for _ in PROMPTS]
    together = net.forward_hidden([Segment(p, c) for p, c in zip(PROMPTS, caches, strict=True)])
    for j, p in enumerate(PROMPTS):
        h = net.forward_hidden([Segment(p, net.new_cache(16))])
        np.testing.assert_array_equal(together[j], h[0])
        assert caches[j].length == len(p)


def test_bad_segments_change_nothing(cpu_models):
    net = cpu_models["i2_s"].net
    a, b = net.new_cache(8), net.new_cache(8)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        net.forward_hidden([Segment([1, 2], a), Segment([10**6], b)])
    with pytest.raises(RequestError, match="exceed the context"):
        net.forward_hidden([Segment([1, 2], a), Segment(list(range(9)), b)])
    with pytest.raises(RequestError, match="share a KV cache"):
        net.forward_hidden([Segment([1], a), Segment([2], a)])
    assert a.length == b.length == 0
